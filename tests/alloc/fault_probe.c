/* fault_probe.c: driver faults for white-box tests. Swaps an entry of the runtime's driver table
 * (runtime/runtime_impl.h) for one that fails a given number of times and then forwards to the
 * real one, so a test sees what the library does when the driver fails where simdrv never does.
 * The table is refilled by every ebb_init: call the probe inside a session, after the init.
 * Threading: the test's own thread only (the swap is a plain write to a table read unlocked). */
#include <stdatomic.h>

#include "runtime_impl.h"

static CUresult(CUDAAPI *ebb_test_real_ctx_sync)(void);
static _Atomic int ebb_test_ctx_sync_fails;

static CUresult CUDAAPI ebb_test_failing_ctx_sync(void) {
  int left = atomic_load_explicit(&ebb_test_ctx_sync_fails, memory_order_relaxed);
  if (left > 0) {
    atomic_store_explicit(&ebb_test_ctx_sync_fails, left - 1, memory_order_relaxed);
    return CUDA_ERROR_UNKNOWN; /* a failure that leaves the context usable (not sticky) */
  }
  return ebb_test_real_ctx_sync();
}

/* The next n cuCtxSynchronize calls fail with CUDA_ERROR_UNKNOWN. */
void ebb_test_fail_ctx_sync(int n) {
  if (ebb__runtime_state.drv.CtxSynchronize != ebb_test_failing_ctx_sync) {
    ebb_test_real_ctx_sync = ebb__runtime_state.drv.CtxSynchronize;
    ebb__runtime_state.drv.CtxSynchronize = ebb_test_failing_ctx_sync;
  }
  atomic_store_explicit(&ebb_test_ctx_sync_fails, n, memory_order_relaxed);
}
