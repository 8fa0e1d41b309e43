/* bench_ops.h: the timed loop the ops benchmarks share (ebb-bench-ops_elementwise and
 * ebb-bench-ops_reduce): calls of one op whose results are released at once, on CPU tensors or
 * on an emulated device's current stream. Header-only, single-threaded, like bench.h.
 */
#ifndef EBB_BENCH_OPS_H
#define EBB_BENCH_OPS_H

#include "bench.h"
#include "ebb/ops.h"
#include "ebb/stream.h"

/* One call of the measured op: a fresh result into *out, which the loop releases. */
typedef ebb_status (*bench_op_fn)(const void *ctx, ebb_tensor_t **out);

/* ns[0..reps) receives the nanoseconds of each of `reps` runs of `count` calls of fn(ctx),
 * after one untimed run that warms the pools and caches. With a stream s (NULL on the CPU) the
 * clock starts after s is synchronised and stops after it is synchronised again, so a run
 * counts the device's work, not only the enqueueing. */
static inline void bench_op_runs(bench_op_fn fn, const void *ctx, ebb_stream_t *s, int reps, int count, double *ns) {
  for (int r = -1; r < reps; r++) {
    if (s) BENCH_CHECK(ebb_stream_synchronize(s));
    uint64_t t0 = bench_now_ns();
    for (int i = 0; i < count; i++) {
      ebb_tensor_t *o;
      BENCH_CHECK(fn(ctx, &o));
      BENCH_CHECK(ebb_tensor_release(o));
    }
    if (s) BENCH_CHECK(ebb_stream_synchronize(s));
    if (r >= 0) ns[r] = (double)(bench_now_ns() - t0);
  }
}

#endif /* EBB_BENCH_OPS_H */
