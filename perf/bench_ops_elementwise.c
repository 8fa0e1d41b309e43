/* bench_ops_elementwise.c: bandwidth of ebb_op_add on two 16 MiB f32 tensors against memcpy.
 *
 * One add reads 2 x 16 MiB and writes 16 MiB; one memcpy of 16 MiB reads and writes 16 MiB each.
 * Both are reported as bytes moved per second (GB/s), so the ratio compares how close the op
 * comes to the machine's copy bandwidth (target >= 0.5). The result tensor is allocated and
 * released by every add (from the host pool or the device arena, cached after the first).
 * On an emulated device the adds are enqueued back to back and the stream synchronised once
 * per run. Median of `reps` runs of `count` adds. The memcpy baseline runs before ebb_init.
 * Prints: bench=ops_elementwise device=cpu|0 gbps=X memcpy_gbps=Y ratio=X/Y
 * usage: ebb-bench-ops_elementwise [reps] [count]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ops.h"

#define N ((int64_t)4 << 20) /* 16 MiB of f32 */

static double memcpy_gbps(int reps, int count) {
  size_t bytes = (size_t)N * 4;
  char *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b) exit(1);
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  double *v = calloc((size_t)reps, sizeof *v);
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = bench_now_ns();
    for (int i = 0; i < count; i++) memcpy((i & 1) ? a : b, (i & 1) ? b : a, bytes);
    v[r] = 2.0 * (double)bytes * count / (double)(bench_now_ns() - t0);
  }
  volatile char sink = a[bytes / 2] + b[bytes / 3];
  (void)sink;
  double m = bench_median(v, (size_t)reps);
  free(v);
  free(a);
  free(b);
  return m;
}

static ebb_status add(const void *ctx, ebb_tensor_t **out) {
  ebb_tensor_t *const *ab = ctx;
  return ebb_op_add(ab[0], ab[1], out);
}

static double add_gbps(int device, int reps, int count) {
  int64_t n = N;
  ebb_tensor_t *a, *b;
  BENCH_CHECK(ebb_tensor_rand(device, EBB_F32, 1, &n, 1, 0, &a));
  BENCH_CHECK(ebb_tensor_rand(device, EBB_F32, 1, &n, 2, 0, &b));
  ebb_stream_t *s = NULL;
  if (device >= 0) BENCH_CHECK(ebb_stream_current(device, &s));
  double *v = calloc((size_t)reps, sizeof *v);
  ebb_tensor_t *ab[2] = {a, b};
  bench_op_runs(add, ab, s, reps, count, v);
  for (int r = 0; r < reps; r++) v[r] = 3.0 * (double)N * 4 * count / v[r];
  double m = bench_median(v, (size_t)reps);
  free(v);
  BENCH_CHECK(ebb_tensor_release(a));
  BENCH_CHECK(ebb_tensor_release(b));
  return m;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 7, count = argc > 2 ? atoi(argv[2]) : 10;
  if (reps < 1 || reps > 100 || count < 1 || count > 10000) {
    fprintf(stderr, "usage: ebb-bench-ops_elementwise [reps 1..100] [count 1..10000]\n");
    return 2;
  }
  double base = memcpy_gbps(reps, count);
  BENCH_CHECK(ebb_init());
  double cpu = add_gbps(EBB_DEVICE_CPU, reps, count);
  printf("bench=ops_elementwise device=cpu gbps=%.2f memcpy_gbps=%.2f ratio=%.2f\n", cpu, base, cpu / base);
  double dev = add_gbps(0, reps, count);
  printf("bench=ops_elementwise device=0 gbps=%.2f memcpy_gbps=%.2f ratio=%.2f\n", dev, base, dev / base);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
