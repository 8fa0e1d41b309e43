// test_alloc_absorbed_faults.cpp: driver failures the arena and the streams absorb (the call
// that meets one still succeeds, by another way) leave the caller's last error and the error
// hook untouched, as any successful call does. The failures are injected by the emulated driver
// (EBB_SIM_FAULT, set by each case before its first ebb_init: every case needs a process of its
// own, as ctest gives it; run together, the cases after the first skip themselves).
//
// Absorbed: a failing first growth of an expandable segment (the granularity query, the address
// reservation, the physical chunk, its mapping or its access), which the OOM retry chain tries
// again; a failing growth for a new slab, device or pinned, which a plain block replaces; a failing event query of a pending free (the block stays pending); a failing event
// create or record when a free must wait for another stream's work (the arena waits for the
// device instead, and likewise when a stream takes another stream's free block); a failing record
// of a released stream's last work (the release waits for the stream instead).
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "alloc_test_util.hpp"
#include "ebb/alloc.h"
#include "ebb/stream.h"
#include "sim_fault_env.hpp"

using namespace alloc_test;

namespace {

// A failure of the test's own making, so the checks can tell "untouched" from "empty", and a
// count of the hook's calls from then on.
struct LastError {
  std::string msg;
  int hook_calls = 0;
  static void hook(ebb_status, const char *, void *user) { static_cast<LastError *>(user)->hook_calls++; }
  LastError() {
    ebb_set_error_hook(hook, this);
    CHECK(ebb_dev_synchronize(99) == EBB_EDEVICE);
    msg = ebb_last_error();
    hook_calls = 0;
  }
  ~LastError() { ebb_set_error_hook(nullptr, nullptr); }
  void check_untouched() {
    INFO("ebb_last_error: " << ebb_last_error());
    CHECK(std::string(ebb_last_error()) == msg);
    CHECK(hook_calls == 0);
  }
};

// One growth of device 0's arena with the given fault in force: the allocation succeeds and the
// last error is the test's own. A small block (64 KiB) grows through a new slab, whose failure
// the plain block after it absorbs.
void growth_absorbs(const char *fault, size_t bytes = 1 << 20) {
  if (!faults_for_this_process(fault)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  LastError le;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, s, &p));
  le.check_untouched();
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  le.check_untouched();
  REQUIRE(ebb_debug_live_handles() == 0);
}

}  // namespace

TEST_CASE("absorbed: a failed VMM granularity query at the first growth", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemGetAllocationGranularity:1:CUDA_ERROR_UNKNOWN");
}
TEST_CASE("absorbed: a failed address reservation at the first growth", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemAddressReserve:1");
}
TEST_CASE("absorbed: a failed physical chunk at the first growth", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemCreate:1");
}
TEST_CASE("absorbed: a failed mapping at the first growth", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemMap:1:CUDA_ERROR_UNKNOWN");
}
TEST_CASE("absorbed: a failed access grant at the first growth", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemSetAccess:1:CUDA_ERROR_UNKNOWN");
}

TEST_CASE("absorbed: a failed address reservation for a new slab", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemAddressReserve:1", 64 << 10);
}
TEST_CASE("absorbed: a failed physical chunk for a new slab", "[alloc][fault][absorbed]") {
  growth_absorbs("cuMemCreate:1", 64 << 10);
}
TEST_CASE("absorbed: failed pinned memory for a new pinned slab", "[alloc][fault][absorbed]") {
  // Pinned memory comes from cuMemHostAlloc, or from placed pages and cuMemHostRegister where
  // the machine has NUMA nodes: the first call of either fails.
  if (!faults_for_this_process("cuMemHostAlloc:1,cuMemHostRegister:1")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  LastError le;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(64 << 10, 0, &p));
  le.check_untouched();
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  le.check_untouched();
}

// A block used by another stream, then freed: its event goes to the pending queue (or, when the
// event cannot be had, the free waits for the device). `fault` strikes in that path.
static void free_after_use_absorbs(const char *fault) {
  if (!faults_for_this_process(fault)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *s = default_stream(0), *t = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 << 20, s, &p));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, t));
  LastError le;
  EBB_REQUIRE_OK(ebb_arena_free(p));
  le.check_untouched();
  // The next allocation polls the pending frees.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 << 20, s, &q));
  le.check_untouched();
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  le.check_untouched();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("absorbed: a failed event query of a pending free", "[alloc][fault][absorbed]") {
  free_after_use_absorbs("cuEventQuery:1:CUDA_ERROR_UNKNOWN");
}
TEST_CASE("absorbed: a failed event create for a free after another stream's use", "[alloc][fault][absorbed]") {
  free_after_use_absorbs("cuEventCreate:1:CUDA_ERROR_UNKNOWN");
}
TEST_CASE("absorbed: a failed event record for a free after another stream's use", "[alloc][fault][absorbed]") {
  free_after_use_absorbs("cuEventRecord:1:CUDA_ERROR_UNKNOWN");
}

TEST_CASE("absorbed: a failed record of a released stream's last work", "[streams][fault][absorbed]") {
  if (!faults_for_this_process("cuEventRecord:1:CUDA_ERROR_UNKNOWN")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *t = new_stream(0);
  LastError le;
  EBB_REQUIRE_OK(ebb_stream_release(t));
  le.check_untouched();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Another stream's free block taken by a stream that missed its own: the taker is ordered after
// the old owner's work by an event. When the record fails, the wait for the device stands in for
// it: the allocation succeeds, after that work, and the last error is the caller's own.
TEST_CASE("absorbed: a failed event record when a stream takes another stream's free block", "[alloc][fault][absorbed]") {
  if (!faults_for_this_process("cuEventRecord:1:CUDA_ERROR_UNKNOWN")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *s1 = new_stream(0), *s2 = new_stream(0);
  std::atomic<int> done{0};
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 << 20, s1, &p));
  EBB_REQUIRE_OK(ebb_stream_host_func(s1, [](void *) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  flag_after(s1, &done);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  const uint64_t syncs = stats(0).num_syncs;
  LastError le;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 << 20, s2, &q));
  le.check_untouched();
  CHECK(stats(0).num_syncs == syncs + 1); // the device wait that stood in for the event
  CHECK((q != p || done.load() == 1));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  EBB_REQUIRE_OK(ebb_stream_release(s1));
  EBB_REQUIRE_OK(ebb_stream_release(s2));
  le.check_untouched();
  REQUIRE(ebb_debug_live_handles() == 0);
}
