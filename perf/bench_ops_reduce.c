/* bench_ops_reduce.c: the generic (non fast-path) CPU kernels on a [4096, 1024] f32 tensor
 * (16 MiB): sum over the last dim (rows), sum over the first dim (columns), exp (a unary op
 * through the f64 chunk loop) and softmax over the last dim (five ops composed). Milliseconds
 * per call, median of `reps` runs of `count` calls, results allocated and released each call;
 * on CPU tensors and on emulated device 0 (stream synchronised at the end of each run).
 * No target is set for these; they track the cost of the ops autograd will compose.
 * Prints: bench=ops_reduce device=cpu|0 op=sum_last|sum_first|exp|softmax ms=X gbps=Y
 * (gbps: the input's bytes over the time, a lower bound of the traffic).
 * usage: ebb-bench-ops_reduce [reps] [count]
 */
#include <stdio.h>
#include <stdlib.h>

#include "bench_ops.h"

enum { OP_SUM_LAST, OP_SUM_FIRST, OP_EXP, OP_SOFTMAX };
static const char *const names[] = {"sum_last", "sum_first", "exp", "softmax"};

struct job {
  int op;
  const ebb_tensor_t *x;
};

static ebb_status run(const void *ctx, ebb_tensor_t **o) {
  const struct job *j = ctx;
  const ebb_tensor_t *x = j->x;
  int last = 1, first = 0;
  switch (j->op) {
  case OP_SUM_LAST: return ebb_op_sum(x, &last, 1, false, o);
  case OP_SUM_FIRST: return ebb_op_sum(x, &first, 1, false, o);
  case OP_EXP: return ebb_op_exp(x, o);
  default: return ebb_op_softmax(x, 1, o);
  }
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 5, count = argc > 2 ? atoi(argv[2]) : 5;
  if (reps < 1 || reps > 100 || count < 1 || count > 1000) {
    fprintf(stderr, "usage: ebb-bench-ops_reduce [reps 1..100] [count 1..1000]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  int64_t shape[2] = {4096, 1024};
  const double bytes = 4096.0 * 1024 * 4;
  int devices[2] = {EBB_DEVICE_CPU, 0};
  double *v = calloc((size_t)reps, sizeof *v);
  for (int di = 0; di < 2; di++) {
    int dev = devices[di];
    ebb_tensor_t *x;
    BENCH_CHECK(ebb_tensor_rand(dev, EBB_F32, 2, shape, 1, 0, &x));
    ebb_stream_t *s = NULL;
    if (dev >= 0) BENCH_CHECK(ebb_stream_current(dev, &s));
    for (int op = 0; op < 4; op++) {
      struct job j = {op, x};
      bench_op_runs(run, &j, s, reps, count, v);
      for (int r = 0; r < reps; r++) v[r] = v[r] / count / 1e6;
      double ms = bench_median(v, (size_t)reps);
      printf("bench=ops_reduce device=%s op=%s ms=%.2f gbps=%.2f\n", dev < 0 ? "cpu" : "0", names[op], ms, bytes / (ms * 1e6));
    }
    BENCH_CHECK(ebb_tensor_release(x));
  }
  free(v);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
