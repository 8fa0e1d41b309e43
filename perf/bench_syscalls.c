/* bench_syscalls.c: the workload that perf/syscalls.sh runs under strace.
 *
 * ebb's hot path should not call the OS once warm: no mmap, munmap, brk or madvise, and futex
 * only when a thread really parks. This program initialises
 * ebb, warms up (the same steps as the loop, so every pool and cache is filled), then runs
 * `iters` iterations of: launch an empty kernel on stream A, record event E on A, make stream B
 * wait on E, all on device 0, and synchronizes both streams. The loop and its synchronize are
 * bracketed by two marker calls, access("/nonexistent/ebb-bench-syscalls:loop-begin") and
 * ":loop-end", that strace shows verbatim: the script counts what every thread calls between
 * them. (Subtracting a warm-up-only run's `strace -c` totals instead proved too noisy: two
 * identical runs differ by hundreds of futex calls and by an mmap or two.)
 * --work memory swaps the step for memory work: a device arena block (512 B .. 8 MiB), a host
 * pool block (64 B .. 64 KiB), a pinned block (4 KiB .. 1 MiB) recorded on the stream, and a
 * plain malloc of the program's own (16 B .. 512 KiB, first byte written), each kept in a ring
 * of 64 live blocks and freed 64 steps later. The sizes repeat every MEM_PERIOD steps, as a
 * training loop's steps do: a sequence that never repeats keeps reaching new demand peaks after
 * any warm-up, and the arenas' growth (the emulated driver's cuMemAlloc is an mmap) then showed
 * up among the process allocator's calls. The same program is built twice: linked with
 * jemalloc (ebb-bench-syscalls, as all ebb programs) and on glibc's malloc
 * (ebb-bench-syscalls-glibc), so the process allocator's share of the calls shows.
 * --warmup-only skips the loop (the markers still appear). The wall time it prints to stderr is
 * only indicative: strace slows every system call.
 * usage: ebb-bench-syscalls [--warmup-only] [--iters N] [--work stream|memory]
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

#define RING 64
#define MEM_PERIOD 512 /* steps after which the sizes repeat (a multiple of RING) */
#define MEM_SEED 0x9e3779b97f4a7c15ull
_Static_assert(MEM_PERIOD % RING == 0, "each period frees what it allocated");

/* The memory step's live blocks, freed RING steps after their allocation. */
static struct {
  void *dev[RING], *host[RING], *pin[RING], *plain[RING];
  uint64_t rng;
  long n;
} mem = {.rng = MEM_SEED};

static size_t mem_size(size_t lo_log2, size_t hi_log2) {
  mem.rng ^= mem.rng >> 12; /* xorshift64* */
  mem.rng ^= mem.rng << 25;
  mem.rng ^= mem.rng >> 27;
  uint64_t r = mem.rng * 2685821657736338717ull;
  size_t lg = lo_log2 + (size_t)(r >> 58) % (hi_log2 - lo_log2 + 1);
  return ((size_t)1 << lg) + (size_t)(r & 0xfff) % ((size_t)1 << lg);
}

static void mem_step(ebb_stream_t *a) {
  if (mem.n % MEM_PERIOD == 0) mem.rng = MEM_SEED;
  int k = (int)(mem.n++ % RING);
  if (mem.dev[k]) {
    BENCH_CHECK(ebb_arena_free(mem.dev[k]));
    BENCH_CHECK(ebb_pageable_free(mem.host[k]));
    BENCH_CHECK(ebb_pinned_free(mem.pin[k]));
    free(mem.plain[k]);
  }
  BENCH_CHECK(ebb_arena_alloc(0, mem_size(9, 22), a, &mem.dev[k]));
  BENCH_CHECK(ebb_pageable_alloc(mem_size(6, 15), &mem.host[k]));
  BENCH_CHECK(ebb_pinned_alloc(mem_size(12, 19), 0, &mem.pin[k]));
  BENCH_CHECK(ebb_pinned_record_stream(mem.pin[k], a));
  size_t n = mem_size(4, 18);
  mem.plain[k] = malloc(n);
  if (!mem.plain[k]) exit(1);
  *(volatile char *)mem.plain[k] = 1;
}

static void mem_drain(void) {
  for (int k = 0; k < RING; k++) {
    if (!mem.dev[k]) continue;
    BENCH_CHECK(ebb_arena_free(mem.dev[k]));
    BENCH_CHECK(ebb_pageable_free(mem.host[k]));
    BENCH_CHECK(ebb_pinned_free(mem.pin[k]));
    free(mem.plain[k]);
  }
}

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
  bool warmup_only = false, memory = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--warmup-only") == 0) {
      warmup_only = true;
    } else if (strcmp(argv[i], "--work") == 0 && i + 1 < argc && (!strcmp(argv[i + 1], "memory") || !strcmp(argv[i + 1], "stream"))) {
      memory = !strcmp(argv[++i], "memory");
    } else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = strtol(argv[++i], NULL, 10);
    } else {
      fprintf(stderr, "usage: ebb-bench-syscalls [--warmup-only] [--iters N] [--work stream|memory]\n");
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
  for (long i = 0; i < warm; i++) memory ? mem_step(a) : step(a, b, e, k, &args);
  BENCH_CHECK(ebb_stream_synchronize(a));
  BENCH_CHECK(ebb_stream_synchronize(b));

  /* The markers: system calls that fail harmlessly and name themselves in strace's log. */
  (void)access("/nonexistent/ebb-bench-syscalls:loop-begin", F_OK);
  uint64_t t0 = bench_now_ns();
  if (!warmup_only)
    for (long i = 0; i < iters; i++) memory ? mem_step(a) : step(a, b, e, k, &args);
  BENCH_CHECK(ebb_stream_synchronize(a));
  BENCH_CHECK(ebb_stream_synchronize(b));
  uint64_t t1 = bench_now_ns();
  (void)access("/nonexistent/ebb-bench-syscalls:loop-end", F_OK);

  long expect = memory ? 0 : warm + (warmup_only ? 0 : iters);
  if (counter != (uint64_t)expect) {
    fprintf(stderr, "ebb-bench-syscalls: %llu of %ld kernels ran\n", (unsigned long long)counter, expect);
    return 1;
  }
  fprintf(stderr, "ebb-bench-syscalls: %s, %ld iterations, %.1f ms\n", warmup_only ? "warm-up only" : "loop",
          warmup_only ? 0 : iters, (double)(t1 - t0) / 1e6);

  mem_drain();
  BENCH_CHECK(ebb_event_release(e));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
