// simdrv_loader.hpp: the simdrv tests' view of the emulated driver, loaded the way ebb's runtime
// loads a driver: dlopen($EBB_SIMDRV_PATH) and dlsym of every entry point by its versioned name
// into typed pointers (types from ebb_cuda.h, so from cuda.h when the toolkit is present).
#pragma once

#include <cstddef>
#include <string>

#include "ebb_cuda.h"
#include "sanitizers.hpp"

struct SimDrv {
  // One typed pointer per EBB_DRV_ENTRIES row: `cu##field` is re-scanned after pasting, so
  // cuMemAlloc becomes cuMemAlloc_v2 exactly as for a C caller.
#define SIMDRV_FIELD(field, symbol, required) decltype(&cu##field) field;
  EBB_DRV_ENTRIES(SIMDRV_FIELD)
#undef SIMDRV_FIELD
  // Entry points simdrv exports beyond the runtime's table.
  decltype(&cuMemcpyHtoDAsync) MemcpyHtoDAsync;
  decltype(&cuMemcpyDtoHAsync) MemcpyDtoHAsync;
  decltype(&cuMemcpyDtoDAsync) MemcpyDtoDAsync;
  decltype(&cuCtxGetDevice) CtxGetDevice;
  decltype(&cuCtxDisablePeerAccess) CtxDisablePeerAccess;
  decltype(&cuDevicePrimaryCtxReset) DevicePrimaryCtxReset;
  decltype(&cuStreamGetPriority) StreamGetPriority;
  ebbsim_register_kernel_fn RegisterKernel;
  ebbsim_init_error_fn InitError;
  ebbsim_skip_waits_fn SkipWaits;
};

// The loaded driver (loaded on first use; Catch2 REQUIREs that every symbol resolves). Does not
// call cuInit.
const SimDrv &drv();

// cuInit(0), retains each device's primary context into ctx[] and makes device 0 current on
// the calling thread. Registers the test kernels below. Returns the device count.
int sim_setup();
extern CUcontext g_ctx[16];

// The CUresult name, for messages.
std::string cu_name(CUresult r);

#define CU_OK(expr)                                            \
  do {                                                         \
    CUresult cu_ok_r_ = (expr);                                \
    INFO(#expr << " -> " << cu_name(cu_ok_r_));                \
    REQUIRE(cu_ok_r_ == CUDA_SUCCESS);                         \
  } while (0)
#define CU_EQ(expr, want)                                      \
  do {                                                         \
    CUresult cu_eq_r_ = (expr);                                \
    INFO(#expr << " -> " << cu_name(cu_eq_r_));                \
    CHECK(cu_eq_r_ == (want));                                 \
  } while (0)

// ---- kernels registered by sim_setup ----
// "append": buf[0] counts entries, buf[1 + n] = value.
struct AppendArgs {
  int *buf;
  int value;
};
// "fill": p[0..n) = value (bytes).
struct FillArgs {
  unsigned char *p;
  size_t n;
  unsigned char value;
};
// "peek": *out = *in (one byte), for reading device memory from a stream.
struct PeekArgs {
  const unsigned char *in;
  unsigned char *out;
};
// "gate": spins until *flag != 0 (to hold a compute engine busy while a test queues work).
struct GateArgs {
  const int *flag;
};
// "big": a 4 KiB argument struct, beyond the inline argument buffer; out[0] = sum of words.
struct BigArgs {
  long *out;
  long words[511];
};

// cuModuleLoadData + cuModuleGetFunction on the current context.
CUfunction get_kernel(const char *name, CUmodule *mod_out = nullptr);
// cuLaunchKernel with a 1x1x1 grid and block.
CUresult launch(CUfunction f, CUstream s, void *args);
// A non-blocking stream of priority `prio` on the current context.
CUstream make_stream(int prio = 0);
// An event with `flags`.
CUevent make_event(unsigned flags = 0);
// A zeroed int buffer of n ints in device memory (host-addressable on simdrv), for "append".
int *dev_ints(size_t n);
// For cuLaunchHostFunc: what the "append" kernel does (user points at an AppendArgs).
void host_append(void *user);
// Holds a device's compute engine busy until opened: a "gate" kernel spins on the flag.
struct Gate {
  int flag = 0;
  GateArgs args{&flag};
  void close_on(CUfunction gate, CUstream s);
  void open() { __atomic_store_n(&flag, 1, __ATOMIC_RELEASE); }
};
// Threads of this process (entries of /proc/self/task).
int thread_count();
// Monotonic milliseconds.
double now_ms();
// The host memory simdrv sizes its default capacity from: physical memory, or a smaller cgroup
// (v2 memory.max, v1 memory.limit_in_bytes) limit.
size_t host_memory_bytes();
// The capacity of each of `ndev` devices when EBB_SIM_MEM is unset (the rule README states):
// 8 GiB, lowered so that every device full fits in three quarters of host_memory_bytes(), in
// whole 2 MiB granules.
size_t sim_default_capacity(int ndev);
// The host's page size.
size_t page();
// Pages of [p, p+n) whose memory exists (mincore: resident; for a shared mapping, in its file's
// page cache once written).
size_t resident_pages(const void *p, size_t n);
// Pages of [p, p+n) present in this process's page tables (/proc/self/pagemap bit 63): a first
// access to them takes no page fault. Read without touching the memory, so sanitizer shadow
// faults do not count.
size_t mapped_pages(const void *p, size_t n);
