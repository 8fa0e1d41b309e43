/* bench_event.c: the cost of ordering one stream after another with an event.
 *
 * One "pair" is ebb_event_record(e, a) then ebb_event_wait(e, b): stream b waits, on the device,
 * for the work issued to stream a so far. Measured on two pool streams of device 0
 * (pair=same_device) and from a stream of device 0 to one of device 1 (pair=cross_device, when
 * the driver has two devices), and on two streams of device 0 from ebb_stream_create
 * (pair=same_device_created: their calls pin the streams against a racing ebb_stream_release,
 * where pool streams need no pin). ns_per_pair is the host time per pair; ns_per_pair_completed
 * adds the synchronize of both streams at the end. Median of `reps` runs.
 * Prints: bench=event pair=same_device iters=N ns_per_pair=X ns_per_pair_completed=Y
 * usage: ebb-bench-event [iters] [reps]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

static void run_pairs(const char *label, ebb_stream_t *a, ebb_stream_t *b, long iters, int reps) {
  int dev;
  BENCH_CHECK(ebb_stream_device(a, &dev));
  ebb_event_t *e;
  BENCH_CHECK(ebb_event_create(dev, EBB_EVENT_DEFAULT, &e));

  for (long i = 0; i < iters / 10 + 1; i++) { /* warm-up */
    BENCH_CHECK(ebb_event_record(e, a));
    BENCH_CHECK(ebb_event_wait(e, b));
  }
  BENCH_CHECK(ebb_stream_synchronize(a));
  BENCH_CHECK(ebb_stream_synchronize(b));

  double enq[64], done[64];
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < iters; i++) {
      BENCH_CHECK(ebb_event_record(e, a));
      BENCH_CHECK(ebb_event_wait(e, b));
    }
    uint64_t t1 = bench_now_ns();
    BENCH_CHECK(ebb_stream_synchronize(a));
    BENCH_CHECK(ebb_stream_synchronize(b));
    uint64_t t2 = bench_now_ns();
    enq[r] = (double)(t1 - t0) / (double)iters;
    done[r] = (double)(t2 - t0) / (double)iters;
  }
  BENCH_CHECK(ebb_event_release(e));
  printf("bench=event pair=%s iters=%ld reps=%d ns_per_pair=%.1f ns_per_pair_completed=%.1f\n", label,
         iters, reps, bench_median(enq, (size_t)reps), bench_median(done, (size_t)reps));
}

int main(int argc, char **argv) {
  long iters = argc > 1 ? strtol(argv[1], NULL, 10) : 100000;
  int reps = argc > 2 ? (int)strtol(argv[2], NULL, 10) : 5;
  if (iters <= 0 || reps <= 0 || reps > 64) {
    fprintf(stderr, "usage: ebb-bench-event [iters>0] [reps 1..64]\n");
    return 2;
  }

  BENCH_CHECK(ebb_init());
  int ndev;
  BENCH_CHECK(ebb_dev_count(&ndev));

  ebb_stream_t *a, *b;
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &a));
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &b));
  if (a == b) BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &b)); /* pool of one stream */
  run_pairs("same_device", a, b, iters, reps);
  ebb_stream_t *ca, *cb;
  BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &ca));
  BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &cb));
  run_pairs("same_device_created", ca, cb, iters, reps);
  BENCH_CHECK(ebb_stream_release(ca));
  BENCH_CHECK(ebb_stream_release(cb));

  if (ndev >= 2) {
    ebb_stream_t *c;
    BENCH_CHECK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &c));
    run_pairs("cross_device", a, c, iters, reps);
  } else {
    printf("bench=event pair=cross_device skipped=one_device\n");
  }

  BENCH_CHECK(ebb_shutdown());
  return 0;
}
