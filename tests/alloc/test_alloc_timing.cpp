// Stream-ordered reuse under the emulated driver's timing model (EBB_SIM_LAUNCH_US=20000: each
// kernel takes 20 ms): a block used on another stream is not reused before that stream's work
// completes, and is after; a stolen block's new stream waits for the old one on the device.
#include <atomic>
#include <set>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

// The setting this executable is about, also when it is run by hand; ctest's ENV (same value)
// takes precedence. Set before main, so before the driver's cuInit reads it.
static const bool kEnvSet = setenv("EBB_SIM_LAUNCH_US", "20000", 0) == 0;

TEST_CASE("a block used on stream B is not reused before B's work completes", "[alloc][timing]") {
  // Without the wait before growth: the allocation grows rather than waiting for B (the wait
  // itself: test_alloc_pending_wait.cpp).
  ScopedEnv env("EBB_ALLOC_CONF", "expandable_segments:0,pending_wait_us:0");
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  busy(b, 3);  // ~60 ms of work on B that (in a real program) reads p
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  REQUIRE_FALSE(idle);  // the timing model holds B busy: the check below is meaningful
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q != p);  // pending: not handed out, not even to its own stream
  ebb_arena_stats st = stats(0);
  CHECK(st.active_bytes.current == 24 * MiB);
  CHECK(st.allocated_bytes.current == 12 * MiB);
  CHECK(st.num_syncs == 0);  // no host wait on the allocation path
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &r));
  CHECK(r == p);  // B is done: the next allocation polls the event and reuses the block
  CHECK(stats(0).num_device_alloc == 2);
  for (void *x : {q, r}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a slab slot used on stream B is not reused before B's work completes", "[alloc][timing][slab]") {
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &p));
  busy(b, 3);  // ~60 ms of work on B that reads p
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  REQUIRE_FALSE(idle);
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "already freed");  // pending is freed, for the caller
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &q));
  CHECK(q != p);  // pending: not handed out, not even to its own stream
  ebb_arena_stats st = stats(0);
  CHECK(st.active_bytes.current == 8192);
  CHECK(st.allocated_bytes.current == 4096);
  CHECK(st.num_syncs == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &r));
  CHECK(r == p);  // B is done: the allocation polled the event, the lowest free slot is p's
  CHECK(stats(0).num_device_alloc == 1);
  for (void *x : {q, r}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  // A pending slot keeps its slab from going back: empty_cache waits for it, then releases all.
  void *u = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &u));
  busy(b, 1);
  EBB_REQUIRE_OK(ebb_arena_record_stream(u, b));
  EBB_REQUIRE_OK(ebb_arena_free(u));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  CHECK(stats(0).active_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a stolen block orders its new stream after the old one, without a host wait", "[alloc][timing]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &p));
  busy(s, 3);                         // S still works on p ...
  EBB_REQUIRE_OK(ebb_arena_free(p));  // ... when it is freed on S (stream order makes that legal)
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &q));
  CHECK(q == p);
  CHECK(stats(0).num_steals == 1);
  CHECK(stats(0).num_syncs == 0);
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(t, &idle));
  CHECK_FALSE(idle);  // T waits on the device for S's work
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  CHECK(idle);  // so when T is done, S's earlier work is done too
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a steal hands its remainder to the new stream, still after the old one", "[alloc][timing]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  // A first steal (whole block), so the second finds an event in the arena's cache.
  void *w = nullptr, *x = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 20 * MiB, s, &w));
  EBB_REQUIRE_OK(ebb_arena_free(w));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 20 * MiB, t, &x));
  CHECK(stats(0).num_steals == 1);
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  // s works on p when it frees it; t steals it and, once it waits for s (the event recorded
  // and waited for with the lock dropped, the remainder set aside meanwhile), keeps the
  // remainder.
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &p));
  busy(s, 3);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, t, &q));
  CHECK(q == p);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_syncs == 0);
  // The remainder is t's at once, without a steal of its own...
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, t, &r));
  CHECK(reinterpret_cast<uintptr_t>(r) == reinterpret_cast<uintptr_t>(p) + 4 * MiB);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_device_alloc == 2);
  // ...and t's work on it still waits for s's on the device.
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(t, &idle));
  CHECK_FALSE(idle);
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  CHECK(idle);
  for (void *y : {x, q, r}) EBB_REQUIRE_OK(ebb_arena_free(y));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("empty_cache waits for pending frees before releasing their segments", "[alloc][timing]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0), *b = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &b));
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  busy(b, 2);
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == 0);
  CHECK(st.active_bytes.current == 0);
  CHECK(st.num_syncs >= 1);
  bool idle = false;
  EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
  CHECK(idle);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A stream released after it used a block (a stream made per call, then dropped): ebb_stream_release
// does not wait, so its work may still run. The block's next user, a steal from another stream,
// waits on the device for the event the release recorded: no host wait, and never before that work.
TEST_CASE("a block of a released stream is stolen after that stream's work, without a host wait", "[alloc][timing]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &p));
  busy(s, 3);  // ~60 ms of work on S that uses p
  std::atomic<int> s_done{0};
  flag_after(s, &s_done);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_stream_release(s));  // does not wait: S's work goes on
  CHECK(s_done.load() == 0);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &q));
  CHECK(q == p);
  CHECK(stats(0).num_steals == 1);
  CHECK(stats(0).num_syncs == 0);     // before: a wait for the whole device
  CHECK(stats(0).num_device_alloc == 1);
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(t, &idle));
  CHECK_FALSE(idle);  // T waits on the device for the released stream's work
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  CHECK(s_done.load() == 1);  // so when T is done, S's work is done too
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// More released streams with work in flight than the streams module remembers (64 a device): the
// oldest release's work is waited for when a newer one needs its place, so a block of any of them
// is still reused only after its stream's work.
TEST_CASE("blocks of many released streams, all still busy, are reused after their work", "[alloc][timing]") {
  EbbSession session;
  constexpr int n = 70;
  std::vector<void *> ps(n);
  std::vector<std::atomic<int>> done(n);
  std::vector<ebb_stream_t *> ss(n);
  for (int i = 0; i < n; i++) {
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[i]));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, ss[i], &ps[i]));
  }
  for (int i = 0; i < n; i++) {
    busy(ss[i], 1);
    flag_after(ss[i], &done[i]);
    EBB_REQUIRE_OK(ebb_arena_free(ps[i]));
    EBB_REQUIRE_OK(ebb_stream_release(ss[i]));
  }
  ebb_stream_t *t = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
  std::vector<void *> qs(n);
  for (int i = 0; i < n; i++) EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &qs[i]));
  CHECK(std::set<void *>(qs.begin(), qs.end()) == std::set<void *>(ps.begin(), ps.end()));
  CHECK(stats(0).num_device_alloc == n);
  CHECK(stats(0).num_syncs == 0);
  EBB_REQUIRE_OK(ebb_stream_synchronize(t));
  for (int i = 0; i < n; i++) CHECK(done[i].load() == 1);
  for (void *x : qs) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// record_stream on a stream that is released before the block's free: the free's event for that
// use comes after the event the release recorded (on an internal stream), so the block stays
// pending until the released stream's work is done, with no host wait at the free.
TEST_CASE("a block used on a stream released before its free waits for that stream's work", "[alloc][timing]") {
  ScopedEnv env("EBB_ALLOC_CONF", "expandable_segments:0,pending_wait_us:0");  // grow, not wait
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  busy(b, 3);  // ~60 ms of work on B that reads p
  std::atomic<int> b_done{0};
  flag_after(b, &b_done);
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_stream_release(b));  // B's work goes on
  EBB_REQUIRE_OK(ebb_arena_free(p));
  CHECK(stats(0).num_syncs == 0);  // before: a wait for the whole device at this free
  CHECK(b_done.load() == 0);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q != p);  // pending behind the released stream's work
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  CHECK(b_done.load() == 1);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &r));
  CHECK(r == p);  // that work is done: the next allocation polls the event and reuses the block
  CHECK(stats(0).num_syncs == 0);
  for (void *x : {q, r}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(a));
  REQUIRE(ebb_debug_live_handles() == 0);
}

extern "C" bool ebb__arena_use_forget(void *ptr, uint64_t sid);

// A module that orders a block's allocation stream after another stream's use itself (an event
// wait on the device) may drop that use: the free is then ordered on the allocation stream alone
// and the block is reused at once, in that stream's order, while the other stream is still busy.
TEST_CASE("a use dropped after its stream was waited for frees the block in stream order at once", "[alloc][timing]") {
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  uint64_t bid = 0;
  EBB_REQUIRE_OK(ebb_stream_id(b, &bid));
  for (size_t bytes : {(size_t)12 * MiB, (size_t)4096}) {  // a block, and a slab slot
    INFO("bytes " << bytes);
    void *p = nullptr, *q = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &p));
    busy(b, 2);  // ~40 ms of work on B that reads p
    EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(a, b));  // A's later work is ordered after B's
    CHECK(ebb__arena_use_forget(p, bid));
    CHECK_FALSE(ebb__arena_use_forget(p, bid));  // not among its uses any more
    uint64_t aid = 0;
    EBB_REQUIRE_OK(ebb_stream_id(a, &aid));
    CHECK_FALSE(ebb__arena_use_forget(p, aid));  // the allocation stream is never a recorded use
    EBB_REQUIRE_OK(ebb_arena_free(p));
    bool idle = true;
    EBB_REQUIRE_OK(ebb_stream_query(b, &idle));
    REQUIRE_FALSE(idle);
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &q));
    CHECK(q == p);  // reused at once, in A's order
    CHECK(stats(0).num_syncs == 0);
    CHECK_FALSE(ebb__arena_use_forget(static_cast<char *>(q) + 512, bid));  // not a block's start
    EBB_REQUIRE_OK(ebb_arena_free(q));
    CHECK_FALSE(ebb__arena_use_forget(q, bid));  // freed
    EBB_REQUIRE_OK(ebb_stream_synchronize(b));
    ARENA_CHECK();
  }
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}
