/* bench_ops_linear.c: the building blocks of a training step against what they replace, f32 on
 * the CPU, one thread (run with OPENBLAS_NUM_THREADS=1):
 *  - ebb_op_linear(x, w, b) (one GEMM, the bias folded in) against transpose + ebb_op_matmul +
 *    ebb_op_add, for x [m, k] and w [n, k] (default the big MLP's first layer: 256 x 784 -> 1024);
 *  - ebb_op_add_scaled_(p, g, -lr) (one pass) against ebb_op_mul_scalar + ebb_op_add_ (a
 *    temporary and two passes), on `numel` elements (default 4 Mi): an SGD update.
 * Each round times `count` calls of each in turn (interleaved); medians over `reps` rounds.
 * Prints: bench=ops_linear m=M k=K n=N linear_ms=X composed_ms=Y ratio=Y/X
 *         bench=ops_add_scaled numel=E add_scaled_ms=X composed_ms=Y ratio=Y/X
 * usage: ebb-bench-ops_linear [reps] [count] [m k n] [numel]
 */
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/ops.h"

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 9, count = argc > 2 ? atoi(argv[2]) : 10;
  int64_t m = argc > 5 ? atoll(argv[3]) : 256, k = argc > 5 ? atoll(argv[4]) : 784, n = argc > 5 ? atoll(argv[5]) : 1024;
  int64_t numel = argc > 6 ? atoll(argv[6]) : (int64_t)1 << 22;
  if (reps < 1 || reps > 100 || count < 1 || count > 1000 || m < 1 || k < 1 || n < 1 || numel < 1) {
    fprintf(stderr, "usage: ebb-bench-ops_linear [reps 1..100] [count 1..1000] [m k n] [numel]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  const int64_t sx[2] = {m, k}, sw[2] = {n, k}, sb[1] = {n};
  ebb_tensor_t *x, *w, *b, *wt, *p, *g;
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, sx, 1, 0, &x));
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, sw, 2, 0, &w));
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 1, sb, 3, 0, &b));
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 1, &numel, 4, 0, &p));
  BENCH_CHECK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 1, &numel, 5, 0, &g));
  double *lin = calloc((size_t)reps, sizeof *lin), *comp = calloc((size_t)reps, sizeof *comp);
  double *sc = calloc((size_t)reps, sizeof *sc), *sc2 = calloc((size_t)reps, sizeof *sc2);
  if (!lin || !comp || !sc || !sc2) return 1;
  for (int r = -1; r < reps; r++) { /* r = -1 warms OpenBLAS and the pool */
    uint64_t t0 = bench_now_ns();
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *y;
      BENCH_CHECK(ebb_op_linear(x, w, b, &y));
      BENCH_CHECK(ebb_tensor_release(y));
    }
    uint64_t t1 = bench_now_ns();
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *mm, *y;
      BENCH_CHECK(ebb_tensor_transpose(w, 0, 1, &wt));
      BENCH_CHECK(ebb_op_matmul(x, wt, &mm));
      BENCH_CHECK(ebb_op_add(mm, b, &y));
      BENCH_CHECK(ebb_tensor_release(wt));
      BENCH_CHECK(ebb_tensor_release(mm));
      BENCH_CHECK(ebb_tensor_release(y));
    }
    uint64_t t2 = bench_now_ns();
    for (int i = 0; i < count; i++) BENCH_CHECK(ebb_op_add_scaled_(p, g, -1e-3));
    uint64_t t3 = bench_now_ns();
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *s;
      BENCH_CHECK(ebb_op_mul_scalar(g, -1e-3, &s));
      BENCH_CHECK(ebb_op_add_(p, s));
      BENCH_CHECK(ebb_tensor_release(s));
    }
    uint64_t t4 = bench_now_ns();
    if (r >= 0) {
      lin[r] = (double)(t1 - t0) / 1e6 / count;
      comp[r] = (double)(t2 - t1) / 1e6 / count;
      sc[r] = (double)(t3 - t2) / 1e6 / count;
      sc2[r] = (double)(t4 - t3) / 1e6 / count;
    }
  }
  double l = bench_median(lin, (size_t)reps), c = bench_median(comp, (size_t)reps);
  double a = bench_median(sc, (size_t)reps), a2 = bench_median(sc2, (size_t)reps);
  printf("bench=ops_linear m=%lld k=%lld n=%lld linear_ms=%.3f composed_ms=%.3f ratio=%.2f\n", (long long)m, (long long)k,
         (long long)n, l, c, c / l);
  printf("bench=ops_add_scaled numel=%lld add_scaled_ms=%.3f composed_ms=%.3f ratio=%.2f\n", (long long)numel, a, a2, a2 / a);
  free(lin);
  free(comp);
  free(sc);
  free(sc2);
  ebb_tensor_t *all[5] = {x, w, b, p, g};
  for (int i = 0; i < 5; i++) BENCH_CHECK(ebb_tensor_release(all[i]));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
