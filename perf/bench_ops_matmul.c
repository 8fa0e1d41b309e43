/* bench_ops_matmul.c: ebb_op_matmul of two 1024x1024 f32 CPU tensors against cblas_sgemm called
 * directly on the same sizes (OpenBLAS, same thread settings), in GFLOP/s (2 m n k flops per
 * product). The op allocates its result from the host pool each time. Median of `reps` runs
 * of `count` products each; target ratio >= 0.95.
 * Prints: bench=ops_matmul n=1024 gflops=X blas_gflops=Y ratio=X/Y
 * usage: ebb-bench-ops_matmul [reps] [count] [n]
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/ops.h"

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 5, count = argc > 2 ? atoi(argv[2]) : 4, n = argc > 3 ? atoi(argv[3]) : 1024;
  if (reps < 1 || reps > 100 || count < 1 || count > 1000 || n < 16 || n > 8192) {
    fprintf(stderr, "usage: ebb-bench-ops_matmul [reps 1..100] [count 1..1000] [n 16..8192]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  int64_t shape[2] = {n, n};
  ebb_tensor_t *a, *b;
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, shape, 1, 0, &a));
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, shape, 2, 0, &b));
  void *pa, *pb;
  BENCH_CHECK(ebb_tensor_data(a, &pa));
  BENCH_CHECK(ebb_tensor_data(b, &pb));
  float *c = malloc((size_t)n * n * sizeof *c);
  double *vo = calloc((size_t)reps, sizeof *vo), *vb = calloc((size_t)reps, sizeof *vb);
  if (!c || !vo || !vb) return 1;
  const double flops = 2.0 * n * n * n * count;
  for (int r = -1; r < reps; r++) { /* r = -1 warms OpenBLAS's threads and the pool */
    uint64_t t0 = bench_now_ns();
    for (int i = 0; i < count; i++)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, pa, n, pb, n, 0.0f, c, n);
    uint64_t t1 = bench_now_ns();
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *o;
      BENCH_CHECK(ebb_op_matmul(a, b, &o));
      BENCH_CHECK(ebb_tensor_release(o));
    }
    uint64_t t2 = bench_now_ns();
    if (r >= 0) {
      vb[r] = flops / (double)(t1 - t0);
      vo[r] = flops / (double)(t2 - t1);
    }
  }
  double op = bench_median(vo, (size_t)reps), blas = bench_median(vb, (size_t)reps);
  printf("bench=ops_matmul n=%d gflops=%.2f blas_gflops=%.2f ratio=%.2f\n", n, op, blas, op / blas);
  free(c);
  free(vo);
  free(vb);
  BENCH_CHECK(ebb_tensor_release(a));
  BENCH_CHECK(ebb_tensor_release(b));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
