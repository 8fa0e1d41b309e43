/* bench_launch.c: the cost of launching an empty kernel on an ebb stream.
 *
 * An almost empty CPU kernel (it bumps a counter so the work is observable) is declared with
 * ebb_kernel_declare and launched with ebb_stream_launch on a pool stream of device 0. Two
 * figures: the enqueue cost (the host time per ebb_stream_launch call) and the throughput with
 * completion (launches plus the final synchronize, divided by the launches). The baseline calls
 * the same function directly through a function pointer. Meant for the emulated driver (on a GPU
 * the kernel has no CUDA function and the launch fails with EBB_ENOTSUP). The same enqueue is
 * also measured on a stream from ebb_stream_create (impl=ebb_created), whose calls pin the
 * stream against a racing ebb_stream_release, where pool streams need no pin.
 * Prints:
 *   bench=launch impl=ebb iters=N ns_per_launch=X ns_per_launch_completed=Y
 *   bench=launch impl=ebb_created iters=N ns_per_launch=X ns_per_launch_completed=Y
 *   bench=launch impl=direct_call iters=N ns_per_call=Z
 *   bench=launch impl=ratio launch_vs_call=X/Z completed_vs_call=Y/Z
 * Each figure is the median of `reps` runs. usage: ebb-bench-launch [iters] [reps]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

typedef struct empty_args {
  uint64_t *counter;
} empty_args;

/* The kernel: runs on the stream's driver thread; the counter is read by the host only after a
 * synchronize, which orders it. */
static void empty_kernel(void *p) {
  empty_args *a = p;
  (*a->counter)++;
}

/* Median enqueue and completed ns per launch on `s` over `reps` runs of `iters` launches. */
static int time_launches(ebb_stream_t *s, const ebb_kernel_t *k, long iters, int reps, double *enq_ns, double *done_ns) {
  uint64_t counter = 0;
  empty_args args = {.counter = &counter};
  /* Warm-up: fills the driver's queues and the thread's caches once. */
  for (long i = 0; i < iters / 10 + 1; i++) BENCH_CHECK(ebb_stream_launch(s, k, &args, NULL));
  BENCH_CHECK(ebb_stream_synchronize(s));
  double enq[64], done[64];
  for (int r = 0; r < reps; r++) {
    counter = 0;
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < iters; i++) BENCH_CHECK(ebb_stream_launch(s, k, &args, NULL));
    uint64_t t1 = bench_now_ns();
    BENCH_CHECK(ebb_stream_synchronize(s));
    uint64_t t2 = bench_now_ns();
    if (counter != (uint64_t)iters) {
      fprintf(stderr, "ebb-bench-launch: %llu of %ld kernels ran\n", (unsigned long long)counter, iters);
      return 1;
    }
    enq[r] = (double)(t1 - t0) / (double)iters;
    done[r] = (double)(t2 - t0) / (double)iters;
  }
  *enq_ns = bench_median(enq, (size_t)reps);
  *done_ns = bench_median(done, (size_t)reps);
  return 0;
}

int main(int argc, char **argv) {
  long iters = argc > 1 ? strtol(argv[1], NULL, 10) : 100000;
  int reps = argc > 2 ? (int)strtol(argv[2], NULL, 10) : 5;
  if (iters <= 0 || reps <= 0 || reps > 64) {
    fprintf(stderr, "usage: ebb-bench-launch [iters>0] [reps 1..64]\n");
    return 2;
  }

  BENCH_CHECK(ebb_init());
  const ebb_kernel_t *k;
  BENCH_CHECK(ebb_kernel_declare("bench_empty", sizeof(empty_args), empty_kernel, NULL, &k));
  ebb_stream_t *s;
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s));

  uint64_t counter = 0;
  empty_args args = {.counter = &counter};
  double e = 0, d = 0, ce = 0, cd = 0, direct[64];
  if (time_launches(s, k, iters, reps, &e, &d)) return 1;
  ebb_stream_t *created;
  BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &created));
  if (time_launches(created, k, iters, reps, &ce, &cd)) return 1;
  BENCH_CHECK(ebb_stream_release(created));

  /* The baseline: the same function through a pointer the compiler cannot see through. */
  void (*volatile fn)(void *) = empty_kernel;
  for (int r = 0; r < reps; r++) {
    counter = 0;
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < iters; i++) fn(&args);
    uint64_t t1 = bench_now_ns();
    if (counter != (uint64_t)iters) return 1;
    direct[r] = (double)(t1 - t0) / (double)iters;
  }

  double c = bench_median(direct, (size_t)reps);
  printf("bench=launch impl=ebb iters=%ld reps=%d ns_per_launch=%.1f ns_per_launch_completed=%.1f\n",
         iters, reps, e, d);
  printf("bench=launch impl=ebb_created iters=%ld reps=%d ns_per_launch=%.1f ns_per_launch_completed=%.1f\n",
         iters, reps, ce, cd);
  printf("bench=launch impl=direct_call iters=%ld reps=%d ns_per_call=%.2f\n", iters, reps, c);
  printf("bench=launch impl=ratio launch_vs_call=%.1f completed_vs_call=%.1f\n", e / c, d / c);

  BENCH_CHECK(ebb_shutdown());
  return 0;
}
