// Before growing, a device arena waits on the host for frees pending on other streams when their
// bytes could hold the request (include/ebb/alloc.h, pending_wait_us), under the emulated
// driver's timing model (EBB_SIM_LAUNCH_US=20000: each kernel takes 20 ms), so the pending work
// is still queued when the allocation asks. Run with classic and with expandable segments.
#include <atomic>
#include <string>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

static const bool kEnvSet = setenv("EBB_SIM_LAUNCH_US", "20000", 0) == 0;

namespace {

// EBB_ALLOC_CONF as ctest set it, with `extra` appended.
std::string conf_with(const char *extra) {
  const char *c = std::getenv("EBB_ALLOC_CONF");
  std::string s = c ? c : "";
  return s.empty() ? std::string(extra) : s + "," + extra;
}

// Copies `words` 32-bit words of `value` into device memory `dst` on stream s, from a pinned
// buffer (*src, allocated here, freed by the caller): the call returns at once and the copy
// runs in s's order, after the work queued before it.
void fill_async(void *dst, size_t words, uint32_t value, ebb_stream_t *s, void **src) {
  EBB_REQUIRE_OK(ebb_pinned_alloc(words * sizeof(uint32_t), -1, src));
  auto *w = static_cast<uint32_t *>(*src);
  for (size_t i = 0; i < words; i++) w[i] = value;
  EBB_REQUIRE_OK(ebb_copy_async(dst, *src, words * sizeof(uint32_t), s));
}

}  // namespace

TEST_CASE("an allocation that only a pending free could hold waits for it instead of growing", "[alloc][pending_wait]") {
  (void)kEnvSet;
  ScopedEnv env("EBB_ALLOC_CONF", conf_with("pending_wait_us:10000000").c_str());  // B's ~60 ms fit
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  const size_t bytes = 12 * MiB, words = bytes / sizeof(uint32_t);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &p));
  ebb_arena_stats before = stats(0);
  // B has ~60 ms of work queued, then writes 0xBBBBBBBB into p: the old owner's late write. The
  // copy records B's use of p, so the free below is pending on B.
  void *old_src = nullptr, *new_src = nullptr;
  std::vector<uint32_t> back(words, 0);
  busy(b, 3);
  fill_async(p, words, 0xBBBBBBBBu, b, &old_src);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  REQUIRE_FALSE(idle);  // the timing model holds B busy: the allocation below finds p pending
  // Nothing else could hold 12 MiB: the arena waits for B's event and hands p out again.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &q));
  CHECK(q == p);
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == before.reserved_bytes.current);
  CHECK(st.num_device_alloc == before.num_device_alloc);
  CHECK(st.num_pending_waits == 1);
  CHECK(st.num_syncs >= 1);  // the wait is a host wait
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  CHECK(idle);  // B's work on the old owner's memory is done before the new owner gets it
  // The new owner's data stays its own: B's write, had it been still queued, would land on it.
  fill_async(q, words, 0x0A0A0A0Au, a, &new_src);
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), q, bytes, a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  CHECK(words_differing(back, std::vector<uint32_t>(words, 0x0A0A0A0Au)) == 0);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_pinned_free(old_src));
  EBB_REQUIRE_OK(ebb_pinned_free(new_src));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pending frees too small for the request are not waited for: the arena grows", "[alloc][pending_wait]") {
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, a, &p));
  busy(b, 3);
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_arena_stats before = stats(0);
  // 4 MiB pending cannot hold 24 MiB (nor can the free rest of the arena): grow, no host wait.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 24 * MiB, a, &q));
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current > before.reserved_bytes.current);
  CHECK(st.num_pending_waits == 0);
  CHECK(st.num_syncs == before.num_syncs);
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  CHECK_FALSE(idle);  // B was not waited for
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pending_wait_us:0 grows instead of waiting, and the pending block stays untouched", "[alloc][pending_wait][config]") {
  ScopedEnv env("EBB_ALLOC_CONF", conf_with("pending_wait_us:0").c_str());
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  ebb_arena_stats before = stats(0);
  busy(b, 3);
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q != p);
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current > before.reserved_bytes.current);
  CHECK(st.num_pending_waits == 0);
  CHECK(st.num_syncs == 0);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("the pinned pool never waits for pending frees on the allocation path", "[alloc][pending_wait][pinned]") {
  EbbSession session;
  ebb_stream_t *b = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(4 * MiB, -1, &p));
  busy(b, 3);
  EBB_REQUIRE_OK(ebb_pinned_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  EBB_REQUIRE_OK(ebb_pinned_alloc(4 * MiB, -1, &q));
  CHECK(q != p);
  ebb_arena_stats st{};
  EBB_REQUIRE_OK(ebb_pinned_get_stats(&st));
  CHECK(st.num_pending_waits == 0);
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  CHECK_FALSE(idle);
  EBB_REQUIRE_OK(ebb_pinned_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pending_wait_us takes microseconds up to 10 s and refuses anything else", "[alloc][pending_wait][config]") {
  for (const char *bad : {"pending_wait_us:-1", "pending_wait_us:10000001", "pending_wait_us:1ms"}) {
    ScopedEnv env("EBB_ALLOC_CONF", bad);
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "expected pending_wait_us:N with N microseconds in [0, 10000000] (0: never wait)");
    CHECK_FALSE(ebb_is_initialized());
  }
}

TEST_CASE("a wait for a stream the allocating thread itself holds up ends after pending_wait_us, and the arena grows",
          "[alloc][pending_wait]") {
  ScopedEnv env("EBB_ALLOC_CONF", conf_with("pending_wait_us:50000").c_str());
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  ebb_arena_stats before = stats(0);
  // B waits for this thread to open it, after the allocation: an unbounded wait would hang.
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(b, hold_until_open, &open));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q != p);
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current > before.reserved_bytes.current);
  CHECK(st.num_pending_waits == 0);
  CHECK(open.load() == 0);  // B still held: the allocation did not wait for it to finish
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}
