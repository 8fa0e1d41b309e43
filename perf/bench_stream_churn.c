/* bench_stream_churn.c: a stream made per step, used by the arena and released, step after step.
 *
 * One step is ebb_stream_create, a 4 KiB slot and a 1 MiB block allocated on the new stream
 * and freed, a 2 MiB block of a long-lived stream recorded on it (its free waits on the new
 * stream) and freed, then ebb_stream_release. The arena keeps per-stream state (free indexes,
 * slab lists, pending-free queues); the cost of a step must not grow with the number of
 * streams made before it. Prints, for each window of `window` steps:
 *   bench=stream_churn streams=<made so far> us_per_step=<x>
 * usage: ebb-bench-stream_churn [steps] [window]
 */
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

int main(int argc, char **argv) {
  long steps = argc > 1 ? strtol(argv[1], NULL, 10) : 20000;
  long window = argc > 2 ? strtol(argv[2], NULL, 10) : 4000;
  if (steps <= 0 || window <= 0 || window > steps) {
    fprintf(stderr, "usage: ebb-bench-stream_churn [steps>0] [window 1..steps]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  ebb_stream_t *side;
  BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &side));
  uint64_t t0 = bench_now_ns();
  for (long i = 1; i <= steps; i++) {
    ebb_stream_t *s;
    void *slot, *blk, *used;
    BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    BENCH_CHECK(ebb_arena_alloc(0, 4096, s, &slot));
    BENCH_CHECK(ebb_arena_alloc(0, 1 << 20, s, &blk));
    BENCH_CHECK(ebb_arena_alloc(0, 2 << 20, side, &used));
    BENCH_CHECK(ebb_arena_record_stream(used, s));
    BENCH_CHECK(ebb_arena_free(slot));
    BENCH_CHECK(ebb_arena_free(blk));
    BENCH_CHECK(ebb_arena_free(used));
    BENCH_CHECK(ebb_stream_release(s));
    if (i % window == 0) {
      uint64_t t = bench_now_ns();
      printf("bench=stream_churn streams=%ld us_per_step=%.2f\n", i, (double)(t - t0) / 1e3 / (double)window);
      t0 = t;
    }
  }
  BENCH_CHECK(ebb_stream_synchronize(side));
  BENCH_CHECK(ebb_stream_release(side));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
