// test_alloc_held_back.cpp: memory is never handed out again before the work that used it has
// run, even when the driver fails the calls that order the reuse. A free (or a steal of another
// stream's free block) records an event after the users' work; when the record fails the arena
// waits for the device instead; when that wait fails too, the work may still be running: the
// memory is held back for good rather than handed out unordered. The free still succeeds (the
// pointer is released, the last error untouched) and tells the warning handler why; the
// allocation that stole the block fails. A stream released while neither holds keeps a lost
// tomb, which makes later frees of memory it used wait for the device.
//
// The faults come from the emulated driver (EBB_SIM_FAULT: the first cuEventRecord of the
// process, and the first cuCtxSynchronize or cuStreamSynchronize, which no call of these cases
// makes before the fault point), so every case needs a process of its own, as ctest gives it.
// The users' work is a host function that sleeps: a block handed out while it sleeps is one
// handed out before the work that used it.
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"
#include "ebb/alloc.h"
#include "ebb/stream.h"
#include "sim_fault_env.hpp"

using namespace alloc_test;

namespace {

constexpr const char *kRecordAndWait = "cuEventRecord:1:CUDA_ERROR_UNKNOWN,cuCtxSynchronize:1:CUDA_ERROR_UNKNOWN";

// The warnings issued while it lives (the default handler is put back after).
struct WarningLog {
  std::vector<std::string> got;
  WarningLog() {
    ebb_set_warning_handler([](const char *m, void *u) { static_cast<std::vector<std::string> *>(u)->push_back(m); }, &got);
  }
  ~WarningLog() { ebb_set_warning_handler(ebb_warning_to_stderr, nullptr); }
  bool any_with(std::initializer_list<const char *> needles) const {
    for (const std::string &w : got) {
      bool all = true;
      for (const char *n : needles) all = all && w.find(n) != std::string::npos;
      if (all) return true;
    }
    return false;
  }
};

// Queues on `s` a host function that sleeps 300 ms, then one that sets *flag: work that uses the
// memory and is still running while the test goes on.
void slow_then_flag(ebb_stream_t *s, std::atomic<int> *flag) {
  EBB_REQUIRE_OK(ebb_stream_host_func(s, [](void *) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr));
  flag_after(s, flag);
}

// A block of device 0 allocated on its default stream and used by a new stream t, whose work
// (slow_then_flag) is still running. Needs an EbbSession first.
struct UsedBySlowWork {
  ebb_stream_t *s = default_stream(0), *t = new_stream(0);
  std::atomic<int> done{0};
  void *p = nullptr;
  explicit UsedBySlowWork(size_t bytes) {
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, s, &p));
    EBB_REQUIRE_OK(ebb_arena_record_stream(p, t));
    slow_then_flag(t, &done);
  }
  // Whether q, handed out after p's free, was safe to hand out: other memory, or p once t's work ran.
  bool safe(const void *q) const { return q != p || done.load() == 1; }
};

// A block stream s1 allocated and freed while its work (slow_then_flag) still runs: free again at
// once for s1 (its own later work is ordered after), stolen by s2 only after that work.
struct FreedUnderSlowWork {
  ebb_stream_t *s1 = new_stream(0), *s2 = new_stream(0);
  std::atomic<int> done{0};
  void *p = nullptr;
  FreedUnderSlowWork() {
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s1, &p));
    slow_then_flag(s1, &done);
    EBB_REQUIRE_OK(ebb_arena_free(p));
  }
  ~FreedUnderSlowWork() {
    CHECK(ebb_stream_synchronize(s1) == EBB_OK);
    CHECK(ebb_stream_release(s1) == EBB_OK);
    CHECK(ebb_stream_release(s2) == EBB_OK);
  }
};

}  // namespace

TEST_CASE("held back: a pinned block whose free can neither record nor wait is not handed out again",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process(kRecordAndWait)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *t = new_stream(0);
  std::atomic<int> done{0};
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(1 * MiB, -1, &p));
  EBB_REQUIRE_OK(ebb_pinned_record_stream(p, t));
  slow_then_flag(t, &done);
  WarningLog w;
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  CHECK(std::string(ebb_last_error()).empty());
  INFO("warnings: " << w.got.size() << (w.got.empty() ? "" : ", the first: " + w.got[0]));
  CHECK(w.any_with({"ebb_pinned_free", "held back", "cuCtxSynchronize"}));
  EBB_REQUIRE_OK(ebb_pinned_alloc(1 * MiB, -1, &q));
  INFO("work done when the block came back: " << done.load());
  CHECK(q != p);
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  EBB_REQUIRE_OK(ebb_pinned_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  EBB_REQUIRE_OK(ebb_pinned_empty_cache());
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("held back: a device slot whose free can neither record nor wait is not handed out again",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process(kRecordAndWait)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  UsedBySlowWork u(4 * KiB);
  void *q = nullptr;
  WarningLog w;
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb_arena_free(u.p));
  CHECK(std::string(ebb_last_error()).empty());
  INFO("warnings: " << w.got.size() << (w.got.empty() ? "" : ", the first: " + w.got[0]));
  CHECK(w.any_with({"ebb_arena_free", "held back", "cuCtxSynchronize"}));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * KiB, u.s, &q));
  INFO("work done when the memory came back: " << u.done.load());
  CHECK(q != u.p);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(u.t));
  EBB_REQUIRE_OK(ebb_stream_release(u.t));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Another stream's free block, taken by a stream that missed its own: the taker must wait for
// the old owner's work. With neither the event nor the device wait to be had, the block (and the
// remainder the request leaves of it) is held back and the allocation fails; the next one gets
// other memory.
TEST_CASE("held back: a stolen block whose old owner's work can be neither ordered after nor waited for",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process(kRecordAndWait)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  {
    FreedUnderSlowWork f;
    void *q = nullptr;
    ebb_status st = ebb_arena_alloc(0, 1 * MiB, f.s2, &q);
    INFO("ebb_arena_alloc -> " << ebb_status_name(st) << ": " << ebb_last_error() << "; work done: " << f.done.load());
    CHECK((st != EBB_OK || q != f.p || f.done.load() == 1));
    CHECK(st == EBB_EDRIVER);
    CHECK(std::string(ebb_last_error()).find("held back") != std::string::npos);
    if (st == EBB_OK) EBB_REQUIRE_OK(ebb_arena_free(q));
    ARENA_CHECK();
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, f.s2, &q));
    CHECK(q != f.p);
    EBB_REQUIRE_OK(ebb_arena_free(q));
    EBB_REQUIRE_OK(ebb_stream_synchronize(f.s2));
  }
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A stream released with work in flight gets a tomb: an event after its last work, which later
// frees of memory it used order after. When the release can neither record that event nor wait
// for the stream, the release still succeeds, and a later free of such memory waits for the
// device instead of finding nothing to wait for.
TEST_CASE("a released stream whose last work could be neither recorded nor waited for still orders a free",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process("cuEventRecord:1:CUDA_ERROR_UNKNOWN,cuStreamSynchronize:1:CUDA_ERROR_UNKNOWN")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  UsedBySlowWork u(1 * MiB);
  void *q = nullptr;
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb_stream_release(u.t));
  CHECK(std::string(ebb_last_error()).empty());
  EBB_REQUIRE_OK(ebb_arena_free(u.p));
  CHECK(std::string(ebb_last_error()).empty());
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, u.s, &q));
  INFO("block back: " << (q == u.p) << ", work done: " << u.done.load());
  CHECK(u.safe(q));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// EBB_EDEVICE from the failed wait does not make the memory safe: a non-sticky error (an invalid
// context here) reads as EBB_EDEVICE too, with the device working on and the users' work still
// running. Only a device in its error state (which runs no more work) lets the memory go back.
TEST_CASE("held back: a failed wait that reads as EBB_EDEVICE on a working device still holds the block",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process("cuEventRecord:1:CUDA_ERROR_UNKNOWN,cuCtxSynchronize:1:CUDA_ERROR_INVALID_CONTEXT")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  UsedBySlowWork u(4 * KiB);
  void *q = nullptr;
  WarningLog w;
  EBB_REQUIRE_OK(ebb_arena_free(u.p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * KiB, u.s, &q));
  CHECK(u.safe(q));                   // never handed out while t's work may still use it
  EBB_REQUIRE_OK(ebb_dev_status(0));  // the device works on
  CHECK(w.any_with({"held back"}));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(u.t));
  EBB_REQUIRE_OK(ebb_stream_release(u.t));
}

// Ordering after a released stream that left a lost tomb (how the backward engine and the arena
// order after a released stream's work) waits for the whole device on the host, and succeeds:
// it neither fails the caller nor returns before that work.
extern "C" ebb_status ebb__stream_wait_released(ebb_stream_t *waiter, int device, uint64_t id);  // streams_export.h

TEST_CASE("ordering after a released stream whose last work was neither recorded nor waited for waits for its device",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process("cuEventRecord:1:CUDA_ERROR_UNKNOWN,cuStreamSynchronize:1:CUDA_ERROR_UNKNOWN")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  ebb_stream_t *t = new_stream(0), *w = default_stream(0);
  uint64_t tid = 0;
  EBB_REQUIRE_OK(ebb_stream_id(t, &tid));
  std::atomic<int> done{0};
  slow_then_flag(t, &done);
  EBB_REQUIRE_OK(ebb_stream_release(t));  // its record and its stream wait fail: a lost tomb
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb__stream_wait_released(w, 0, tid));
  CHECK(done.load() == 1);
  CHECK(std::string(ebb_last_error()).empty());
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A slab's block stolen from another stream whose work can be neither ordered after nor waited
// for is held back; the small allocation is served by a plain block instead and succeeds, and
// the warning handler hears of the memory kept.
TEST_CASE("held back: a stolen block for a new slab is held back with a warning, and the small allocation is served",
          "[alloc][fault][held-back]") {
  if (!faults_for_this_process(kRecordAndWait)) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  FreedUnderSlowWork f;
  void *q = nullptr;
  WarningLog w;
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * KiB, f.s2, &q));
  CHECK(w.any_with({"held back"}));
  CHECK(std::string(ebb_last_error()).empty());
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(f.s1));
  ARENA_CHECK();
}
