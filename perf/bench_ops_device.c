/* bench_ops_device.c: what ops achieve on a device, against what the device can do.
 *
 * For each op, `count` calls enqueued back to back on the device's current stream, timed by two
 * timing events around them (the device's own clock, so the host's enqueueing is not counted
 * unless it is slower than the device), median of `reps` runs after one warm-up run. Bandwidth
 * counts the bytes an op must move at least (each input read once, the output written once:
 * add 3 x 16 MiB, a unary op 2 x 16 MiB, a sum 16 MiB; half that in bf16), so `fraction` is how close the op
 * comes to the device's peak memory bandwidth (ebb_dev_caps.peak_mem_gbps). matmul reports
 * TFLOP/s (2 n^3 per call). On an emulated device the ops run on the host's cores and the
 * peak is unknown (fraction=n/a): the figures then track the CPU kernels.
 * Prints per op: bench=ops_device device=D op=NAME ms=M gbps=G peak_gbps=P fraction=F
 *            (matmul: bench=ops_device device=D op=matmul n=N ms=M tflops=T)
 * usage: ebb-bench-ops_device [device] [reps] [count] [matmul n]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ebb/ebb.h"
#include "ebb/ops.h"
#include "ebb/stream.h"
#include "ebb/tensor.h"

#define ROWS 4096
#define COLS 1024
#define MIB16 ((double)ROWS * COLS * 4) /* bytes of one [4096,1024] f32 tensor */

typedef struct ctx {
  ebb_tensor_t *a, *b;   /* [4096,1024] f32 */
  ebb_tensor_t *ah, *bh; /* the same in bf16 (2-byte loads and stores, f32 math) */
  ebb_tensor_t *m0, *m1; /* [n,n] f32 for matmul */
} ctx;

typedef ebb_status (*op_fn)(const ctx *c, ebb_tensor_t **out);

static ebb_status op_add(const ctx *c, ebb_tensor_t **o) { return ebb_op_add(c->a, c->b, o); }
static ebb_status op_mul_scalar(const ctx *c, ebb_tensor_t **o) { return ebb_op_mul_scalar(c->a, 1.5, o); }
static ebb_status op_relu(const ctx *c, ebb_tensor_t **o) { return ebb_op_relu(c->a, o); }
static ebb_status op_exp(const ctx *c, ebb_tensor_t **o) { return ebb_op_exp(c->a, o); }
static ebb_status op_gelu(const ctx *c, ebb_tensor_t **o) { return ebb_op_gelu(c->a, o); }
static ebb_status op_add_bf16(const ctx *c, ebb_tensor_t **o) { return ebb_op_add(c->ah, c->bh, o); }
static ebb_status op_gelu_bf16(const ctx *c, ebb_tensor_t **o) { return ebb_op_gelu(c->ah, o); }
static ebb_status op_amax_last(const ctx *c, ebb_tensor_t **o) {
  const int d = 1;
  return ebb_op_amax(c->a, &d, 1, false, o);
}
static ebb_status op_sum_last(const ctx *c, ebb_tensor_t **o) {
  const int d = 1;
  return ebb_op_sum(c->a, &d, 1, false, o);
}
static ebb_status op_sum_first(const ctx *c, ebb_tensor_t **o) {
  const int d = 0;
  return ebb_op_sum(c->a, &d, 1, false, o);
}
static ebb_status op_mean_all(const ctx *c, ebb_tensor_t **o) { return ebb_op_mean(c->a, NULL, 0, false, o); }
static ebb_status op_softmax(const ctx *c, ebb_tensor_t **o) { return ebb_op_softmax(c->a, 1, o); }
static ebb_status op_transpose_copy(const ctx *c, ebb_tensor_t **o) {
  ebb_tensor_t *t = NULL;
  ebb_status st = ebb_tensor_transpose(c->a, 0, 1, &t);
  if (st) return st;
  st = ebb_tensor_contiguous(t, o);
  ebb_tensor_release(t);
  return st;
}
static ebb_status op_matmul(const ctx *c, ebb_tensor_t **o) { return ebb_op_matmul(c->m0, c->m1, o); }

static const struct {
  const char *name;
  op_fn fn;
  double bytes; /* least bytes moved per call */
} cases[] = {
    {"add", op_add, 3 * MIB16},
    {"mul_scalar", op_mul_scalar, 2 * MIB16},
    {"relu", op_relu, 2 * MIB16},
    {"exp", op_exp, 2 * MIB16},
    {"gelu", op_gelu, 2 * MIB16},
    {"add_bf16", op_add_bf16, 3 * MIB16 / 2},
    {"gelu_bf16", op_gelu_bf16, 2 * MIB16 / 2},
    {"sum_last", op_sum_last, MIB16},
    {"sum_first", op_sum_first, MIB16},
    {"amax_last", op_amax_last, MIB16},
    {"mean_all", op_mean_all, MIB16},
    {"softmax", op_softmax, 2 * MIB16},
    {"transpose_copy", op_transpose_copy, 2 * MIB16},
};

/* Median milliseconds of one call: reps runs of count calls between two timing events. */
static double time_op(op_fn fn, const ctx *c, int device, int reps, int count) {
  ebb_stream_t *s = NULL;
  ebb_event_t *e0 = NULL, *e1 = NULL;
  BENCH_CHECK(ebb_stream_current(device, &s));
  BENCH_CHECK(ebb_event_create(device, EBB_EVENT_TIMING, &e0));
  BENCH_CHECK(ebb_event_create(device, EBB_EVENT_TIMING, &e1));
  double *ms = calloc((size_t)reps, sizeof *ms);
  if (!ms) exit(1);
  for (int r = -1; r < reps; r++) {
    BENCH_CHECK(ebb_event_record(e0, s));
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *o = NULL;
      BENCH_CHECK(fn(c, &o));
      BENCH_CHECK(ebb_tensor_release(o));
    }
    BENCH_CHECK(ebb_event_record(e1, s));
    BENCH_CHECK(ebb_event_synchronize(e1));
    float t = 0;
    BENCH_CHECK(ebb_event_elapsed(e0, e1, &t));
    if (r >= 0) ms[r] = (double)t / count;
  }
  double m = bench_median(ms, (size_t)reps);
  free(ms);
  BENCH_CHECK(ebb_event_release(e0));
  BENCH_CHECK(ebb_event_release(e1));
  return m;
}

int main(int argc, char **argv) {
  const int device = argc > 1 ? atoi(argv[1]) : 0;
  const int reps = argc > 2 ? atoi(argv[2]) : 9;
  const int count = argc > 3 ? atoi(argv[3]) : 10;
  const int64_t n = argc > 4 ? atoll(argv[4]) : 4096;
  if (reps < 1 || count < 1 || n < 1) {
    fprintf(stderr, "usage: ebb-bench-ops_device [device] [reps>=1] [count>=1] [matmul n>=1]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  ebb_dev_caps caps;
  BENCH_CHECK(ebb_dev_get_caps(device, &caps));
  ctx c = {0};
  const int64_t shape[2] = {ROWS, COLS}, mshape[2] = {n, n};
  BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, shape, 1, 0, &c.a));
  BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, shape, 2, 0, &c.b));
  BENCH_CHECK(ebb_tensor_to_dtype(c.a, EBB_BF16, &c.ah));
  BENCH_CHECK(ebb_tensor_to_dtype(c.b, EBB_BF16, &c.bh));
  BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, mshape, 3, 0, &c.m0));
  BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, mshape, 4, 0, &c.m1));
  printf("bench=ops_device device=%d name=\"%s\" emulated=%d peak_gbps=%.0f\n", device, caps.name, caps.emulated ? 1 : 0,
         caps.peak_mem_gbps);
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    double ms = time_op(cases[k].fn, &c, device, reps, count);
    double gbps = cases[k].bytes / (ms * 1e-3) / 1e9;
    char frac[32] = "n/a";
    if (caps.peak_mem_gbps > 0) snprintf(frac, sizeof frac, "%.2f", gbps / caps.peak_mem_gbps);
    printf("bench=ops_device device=%d op=%s ms=%.4f gbps=%.1f peak_gbps=%.0f fraction=%s\n", device, cases[k].name, ms,
           gbps, caps.peak_mem_gbps, frac);
    fflush(stdout);
  }
  /* matmul: fewer calls, the work per call is large */
  double ms = time_op(op_matmul, &c, device, reps, count < 3 ? count : 3);
  printf("bench=ops_device device=%d op=matmul n=%lld ms=%.3f tflops=%.2f\n", device, (long long)n, ms,
         2.0 * (double)n * (double)n * (double)n / (ms * 1e-3) / 1e12);
  BENCH_CHECK(ebb_tensor_release(c.a));
  BENCH_CHECK(ebb_tensor_release(c.b));
  BENCH_CHECK(ebb_tensor_release(c.ah));
  BENCH_CHECK(ebb_tensor_release(c.bh));
  BENCH_CHECK(ebb_tensor_release(c.m0));
  BENCH_CHECK(ebb_tensor_release(c.m1));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
