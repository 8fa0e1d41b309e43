/* bench_syscalls.c: the workload that perf/syscalls.sh runs under strace.
 *
 * ebb's hot path should not call the OS once warm (DESIGN.md 3, "kernel bypass"): no mmap,
 * munmap, brk or madvise, and futex only when a thread really parks. This program initialises
 * ebb, warms up (the same steps as the loop, so every pool and cache is filled), then runs
 * `iters` iterations of: launch an empty kernel on stream A, record event E on A, make stream B
 * wait on E, all on device 0, and synchronizes both streams. The loop and its synchronize are
 * bracketed by two marker calls, access("/nonexistent/ebb-bench-syscalls:loop-begin") and
 * ":loop-end", that strace shows verbatim: the script counts what every thread calls between
 * them. (Subtracting a warm-up-only run's `strace -c` totals instead proved too noisy: two
 * identical runs differ by hundreds of futex calls and by an mmap or two.)
 * --warmup-only skips the loop (the markers still appear). The wall time it prints to stderr is
 * only indicative: strace slows every system call.
 * usage: ebb-bench-syscalls [--warmup-only] [--iters N]
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

typedef struct empty_args {
  uint64_t *counter;
} empty_args;

static void empty_kernel(void *p) {
  empty_args *a = p;
  (*a->counter)++;
}

static void step(ebb_stream_t *a, ebb_stream_t *b, ebb_event_t *e, const ebb_kernel_t *k,
                 const empty_args *args) {
  BENCH_CHECK(ebb_stream_launch(a, k, args, NULL));
  BENCH_CHECK(ebb_event_record(e, a));
  BENCH_CHECK(ebb_event_wait(e, b));
}

int main(int argc, char **argv) {
  long iters = 100000;
  bool warmup_only = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--warmup-only") == 0) {
      warmup_only = true;
    } else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = strtol(argv[++i], NULL, 10);
    } else {
      fprintf(stderr, "usage: ebb-bench-syscalls [--warmup-only] [--iters N]\n");
      return 2;
    }
  }
  if (iters <= 0) {
    fprintf(stderr, "ebb-bench-syscalls: --iters must be positive\n");
    return 2;
  }

  BENCH_CHECK(ebb_init());
  const ebb_kernel_t *k;
  BENCH_CHECK(ebb_kernel_declare("bench_syscalls_empty", sizeof(empty_args), empty_kernel, NULL, &k));
  ebb_stream_t *a, *b;
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &a));
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &b));
  ebb_event_t *e;
  BENCH_CHECK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  uint64_t counter = 0;
  empty_args args = {.counter = &counter};

  /* Warm-up: a tenth of the loop, at least 1000 steps, then drain. */
  long warm = iters / 10 < 1000 ? 1000 : iters / 10;
  for (long i = 0; i < warm; i++) step(a, b, e, k, &args);
  BENCH_CHECK(ebb_stream_synchronize(a));
  BENCH_CHECK(ebb_stream_synchronize(b));

  /* The markers: system calls that fail harmlessly and name themselves in strace's log. */
  (void)access("/nonexistent/ebb-bench-syscalls:loop-begin", F_OK);
  uint64_t t0 = bench_now_ns();
  if (!warmup_only)
    for (long i = 0; i < iters; i++) step(a, b, e, k, &args);
  BENCH_CHECK(ebb_stream_synchronize(a));
  BENCH_CHECK(ebb_stream_synchronize(b));
  uint64_t t1 = bench_now_ns();
  (void)access("/nonexistent/ebb-bench-syscalls:loop-end", F_OK);

  long expect = warm + (warmup_only ? 0 : iters);
  if (counter != (uint64_t)expect) {
    fprintf(stderr, "ebb-bench-syscalls: %llu of %ld kernels ran\n", (unsigned long long)counter, expect);
    return 1;
  }
  fprintf(stderr, "ebb-bench-syscalls: %s, %ld iterations, %.1f ms\n", warmup_only ? "warm-up only" : "loop",
          warmup_only ? 0 : iters, (double)(t1 - t0) / 1e6);

  BENCH_CHECK(ebb_event_release(e));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
