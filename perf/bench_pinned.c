/* bench_pinned.c: the pinned pool's cache hits against the driver's own pinned allocation.
 *
 * For each size, `iters` pairs of ebb_pinned_alloc + ebb_pinned_free (after one warm-up pair,
 * every pair is a cache hit) and the same pairs of cuMemHostAlloc + cuMemFreeHost through the
 * driver seam (ebb__drv_pinned_alloc/free: the call a pool-less program makes). On the emulated
 * driver cuMemHostAlloc maps and page-locks host pages; on a GPU it also maps them for the
 * device, which takes far longer, so the ratio here is a lower bound. Lines:
 *   bench=pinned size=<bytes> impl=ebb ns_per_pair=<x>
 *   bench=pinned size=<bytes> impl=cuMemHostAlloc ns_per_pair=<x>
 *   bench=pinned size=<bytes> ratio=<driver ns / ebb ns> driver_allocs_after_warmup=<n>
 * System calls of the warm pool are counted by perf/syscalls.sh (work=memory). A warm-up of
 * 25000 pairs first wraps the pool's history ring once (its pages are touched on first use).
 * usage: ebb-bench-pinned [iters]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "runtime_export.h" /* the driver seam (ebb__drv_*), internal */

static uint64_t driver_allocs(void) {
  ebb_arena_stats s;
  BENCH_CHECK(ebb_pinned_get_stats(&s));
  return s.num_device_alloc;
}

int main(int argc, char **argv) {
  long iters = argc > 1 ? strtol(argv[1], NULL, 10) : 20000;
  if (iters < 10) iters = 10;
  BENCH_CHECK(ebb_init());
  /* Warm-up: enough pairs to wrap the pool's history ring (65536 entries, 3 per pair) once, so
   * the first size does not carry the ring's first-touch page faults (a one-time ~200 ns per
   * pair over the first ~22000 pairs of a process). */
  for (long i = 0; i < 25000; i++) {
    void *w = NULL;
    BENCH_CHECK(ebb_pinned_alloc(4096, 0, &w));
    BENCH_CHECK(ebb_pinned_free(w));
  }
  static const size_t sizes[] = {4096, 65536, 1 << 20, 16 << 20};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t n = sizes[k];
    void *p = NULL;
    BENCH_CHECK(ebb_pinned_alloc(n, 0, &p)); /* warm-up: the one driver allocation */
    BENCH_CHECK(ebb_pinned_free(p));
    uint64_t d0 = driver_allocs();
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < iters; i++) {
      BENCH_CHECK(ebb_pinned_alloc(n, 0, &p));
      BENCH_CHECK(ebb_pinned_free(p));
    }
    uint64_t t1 = bench_now_ns();
    uint64_t drv = driver_allocs() - d0;
    double ebb_ns = (double)(t1 - t0) / (double)iters;
    /* The driver is slower by orders of magnitude for large sizes: fewer pairs keep it short. */
    long diters = n >= (1 << 20) ? iters / 20 + 1 : iters / 4 + 1;
    t0 = bench_now_ns();
    for (long i = 0; i < diters; i++) {
      BENCH_CHECK(ebb__drv_pinned_alloc(0, n, &p));
      BENCH_CHECK(ebb__drv_pinned_free(0, p));
    }
    t1 = bench_now_ns();
    double drv_ns = (double)(t1 - t0) / (double)diters;
    printf("bench=pinned size=%zu impl=ebb ns_per_pair=%.1f\n", n, ebb_ns);
    printf("bench=pinned size=%zu impl=cuMemHostAlloc ns_per_pair=%.1f\n", n, drv_ns);
    printf("bench=pinned size=%zu ratio=%.1f driver_allocs_after_warmup=%llu\n", n, drv_ns / ebb_ns,
           (unsigned long long)drv);
    fflush(stdout);
  }
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
