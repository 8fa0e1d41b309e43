/* bench_ops_dispatch.c: the fixed cost of an op: ns from the call of ebb_op_add on two 1-element
 * f32 tensors to its return, including the allocation and release of the 1-element result. On
 * the CPU the add itself runs inside the call; on an emulated device the call returns once the
 * kernel is enqueued (the stream is synchronised outside the timed loop, every `batch` adds, so
 * the stream's queue never fills). Median of `reps` runs. `cross=1`: on device 0 with the inputs
 * allocated on the default stream and the adds on a pool stream, so every launch checks that the
 * inputs' storages already declared that stream to the arena (the path a backward pass on a side
 * stream takes).
 * Prints: bench=ops_dispatch device=cpu|0 [cross=1] ns_per_op=X
 * usage: ebb-bench-ops_dispatch [reps] [count]
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/ops.h"
#include "ebb/stream.h"

static double dispatch_ns(int device, bool cross, int reps, int count) {
  int64_t one = 1;
  ebb_tensor_t *a, *b;
  BENCH_CHECK(ebb_tensor_ones(device, EBB_F32, 1, &one, &a));
  BENCH_CHECK(ebb_tensor_ones(device, EBB_F32, 1, &one, &b));
  ebb_stream_t *s = NULL, *def = NULL;
  if (cross) {
    BENCH_CHECK(ebb_stream_current(device, &def));
    BENCH_CHECK(ebb_stream_from_pool(device, EBB_PRIO_LOW, &s));
    BENCH_CHECK(ebb_stream_wait_stream(s, def));
    BENCH_CHECK(ebb_stream_set_current(s));
  } else if (device >= 0) {
    BENCH_CHECK(ebb_stream_current(device, &s));
  }
  const int batch = 256; /* below the emulated stream's queue depth */
  double *v = calloc((size_t)reps, sizeof *v);
  for (int r = -1; r < reps; r++) {
    uint64_t spent = 0;
    for (int done = 0; done < count; done += batch) {
      if (s) BENCH_CHECK(ebb_stream_synchronize(s));
      uint64_t t0 = bench_now_ns();
      for (int i = 0; i < batch; i++) {
        ebb_tensor_t *c;
        BENCH_CHECK(ebb_op_add(a, b, &c));
        BENCH_CHECK(ebb_tensor_release(c));
      }
      spent += bench_now_ns() - t0;
    }
    if (r >= 0) v[r] = (double)spent / (double)((count + batch - 1) / batch * batch);
  }
  if (s) BENCH_CHECK(ebb_stream_synchronize(s));
  if (cross) BENCH_CHECK(ebb_stream_set_current(def));
  double m = bench_median(v, (size_t)reps);
  free(v);
  BENCH_CHECK(ebb_tensor_release(a));
  BENCH_CHECK(ebb_tensor_release(b));
  return m;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 7, count = argc > 2 ? atoi(argv[2]) : 100000;
  if (reps < 1 || reps > 100 || count < 256 || count > 10000000) {
    fprintf(stderr, "usage: ebb-bench-ops_dispatch [reps 1..100] [count 256..10^7]\n");
    return 2;
  }
  BENCH_CHECK(ebb_init());
  printf("bench=ops_dispatch device=cpu ns_per_op=%.1f\n", dispatch_ns(EBB_DEVICE_CPU, false, reps, count));
  printf("bench=ops_dispatch device=0 ns_per_op=%.1f\n", dispatch_ns(0, false, reps, count));
  printf("bench=ops_dispatch device=0 cross=1 ns_per_op=%.1f\n", dispatch_ns(0, true, reps, count));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
