// The device arena through ebb/alloc.h on the emulated driver (2 devices, default timing):
// size classes, split and merge under random sequences, stream-ordered reuse, record_stream,
// the steal-with-event path, limits, empty_cache, misuse, and threads.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

TEST_CASE("size classes: small, medium and large requests get PyTorch's segments", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *a = nullptr, *b = nullptr, *c = nullptr, *d0 = nullptr, *d = nullptr, *e = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &a));
  CHECK(reinterpret_cast<uintptr_t>(a) % 512 == 0);
  CHECK(stats(0).reserved_bytes.current == 2 * MiB);
  CHECK(stats(0).allocated_bytes.current == 1024);  // rounded to 512 B steps
  CHECK(stats(0).requested_bytes.current == 1000);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &b));  // 1..10 MiB: a 20 MiB segment
  CHECK(stats(0).reserved_bytes.current == 22 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * MiB, s, &c));  // large: exactly its size in 2 MiB
  CHECK(stats(0).reserved_bytes.current == 122 * MiB);
  CHECK(stats(0).segments.current == 3);
  // 1 MiB fits in the first small segment; the next 1 MiB never lands in the 20 MiB segment's
  // 15 MiB of free space but gets a small segment of its own...
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &d0));
  CHECK(stats(0).reserved_bytes.current == 122 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &d));
  CHECK(stats(0).reserved_bytes.current == 124 * MiB);
  // ...but a large one does.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB + 512, s, &e));
  CHECK(stats(0).reserved_bytes.current == 124 * MiB);
  CHECK(reinterpret_cast<uintptr_t>(e) == reinterpret_cast<uintptr_t>(b) + 5 * MiB);
  CHECK(stats(0).num_device_alloc == 4);
  ARENA_CHECK();
  for (void *p : {a, b, c, d0, d, e}) EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_arena_stats st = stats(0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.allocated_bytes.peak >= 106 * MiB);
  CHECK(st.reserved_bytes.current == 124 * MiB);  // cached
  // Every segment merged back to one block; with slabs, the 1 KiB slot's slab (empty, cached for
  // its class) too: it was all that was left in its segment.
  CHECK(st.inactive_split.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  CHECK(stats(0).num_device_free == 4);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("split rules: small pool splits >= 512 B, large only > 1 MiB of slack", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &a));  // exactly a 12 MiB segment, no split
  EBB_REQUIRE_OK(ebb_arena_free(a));
  // An 11.5 MiB request may take the 12 MiB block whole: 0.5 MiB of slack is not split off.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 11 * MiB + 512 * KiB, s, &b));
  CHECK(b == a);
  CHECK(stats(0).allocated_bytes.current == 12 * MiB);
  CHECK(stats(0).inactive_split.current == 0);
  EBB_REQUIRE_OK(ebb_arena_free(b));
  // A 10 MiB request leaves 2 MiB: split, and the piece counts as inactive_split.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 10 * MiB, s, &c));
  CHECK(c == a);
  CHECK(stats(0).allocated_bytes.current == 10 * MiB);
  CHECK(stats(0).inactive_split.current == 1);
  CHECK(stats(0).inactive_split_bytes.current == 2 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(c));
  CHECK(stats(0).inactive_split.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("the free index gives the first fitting block of the oldest segment, not the tightest", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  // Two 20 MiB segments (requests of 1..10 MiB), A made before B:
  //   A: [a1 9 MiB | a2 9 MiB | 2 MiB free]   B: [b 4 | c 4 | d 4 | e 4 | 4 free]
  // then a2, b and d freed: A holds 11 MiB free, B three 4 MiB holes. A 3 MiB request fits
  // everywhere; the tightest holes are B's, but it gets A's block, and so do the next two (what
  // is left of it); then B's lowest hole.
  void *a1 = nullptr, *a2 = nullptr, *b = nullptr, *c = nullptr, *d = nullptr, *e = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 9 * MiB, s, &a1));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 9 * MiB, s, &a2));
  for (void **q : {&b, &c, &d, &e}) EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, q));
  REQUIRE(stats(0).segments.current == 2);
  const uintptr_t ua = reinterpret_cast<uintptr_t>(a1), ub = reinterpret_cast<uintptr_t>(b);
  REQUIRE(reinterpret_cast<uintptr_t>(a2) == ua + 9 * MiB);  // the layout this test is about
  REQUIRE(reinterpret_cast<uintptr_t>(e) == ub + 12 * MiB);
  for (void *q : {a2, b, d}) EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  uint64_t dev = stats(0).num_device_alloc;
  void *f[4] = {};
  for (void *&q : f) EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &q));
  CHECK(reinterpret_cast<uintptr_t>(f[0]) == ua + 9 * MiB);
  CHECK(reinterpret_cast<uintptr_t>(f[1]) == ua + 12 * MiB);
  CHECK(reinterpret_cast<uintptr_t>(f[2]) == ua + 15 * MiB);
  CHECK(f[3] == b);
  CHECK(stats(0).num_device_alloc == dev);
  ARENA_CHECK();
  for (void *q : {a1, c, e, f[0], f[1], f[2], f[3]}) EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  CHECK(stats(0).inactive_split.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("below 1 MiB, the oldest fit among many blocks of nearby sizes", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  // 40 free blocks of 100 KiB + 512 B, then one of exactly 100 KiB, live separators (72 KiB:
  // blocks, not slab slots) keeping them from merging. Every one of them fits 100 KiB, and all
  // are holes below 2 MiB: the lowest wins, not the exact one (best fit's answer), however
  // they were freed.
  const size_t exact = 100 * 1024, near = exact + 512, gap = 72 * 1024;
  std::vector<void *> sep, loose;
  void *tight = nullptr, *p = nullptr;
  for (int i = 0; i < 40; i++) {
    EBB_REQUIRE_OK(ebb_arena_alloc(0, near, s, &p));
    loose.push_back(p);
    EBB_REQUIRE_OK(ebb_arena_alloc(0, gap, s, &p));
    sep.push_back(p);
  }
  EBB_REQUIRE_OK(ebb_arena_alloc(0, exact, s, &tight));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, gap, s, &p));
  sep.push_back(p);
  EBB_REQUIRE_OK(ebb_arena_free(tight));
  for (auto it = loose.rbegin(); it != loose.rend(); ++it) EBB_REQUIRE_OK(ebb_arena_free(*it));
  ARENA_CHECK();
  uint64_t dev = stats(0).num_device_alloc;
  void *q0 = nullptr, *q1 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, exact, s, &q0));
  CHECK(q0 == loose[0]);
  // A size that rounds up to the next 512 B step: the next of the 40.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, near - 100, s, &q1));
  CHECK(q1 == loose[1]);
  CHECK(stats(0).num_device_alloc == dev);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(q0));
  EBB_REQUIRE_OK(ebb_arena_free(q1));
  for (void *x : sep) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  CHECK(stats(0).inactive_split.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A request below 2 MiB takes a free block below 2 MiB before an older, larger one, which stays
// whole for the larger requests (arena_impl.h, "free index", rule 1); from 2 MiB up, the oldest
// fit. (Plain oldest fit gave the 1.25 MiB request the 4 MiB block.)
TEST_CASE("a request below 2 MiB takes a hole below 2 MiB before an older, larger block", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  // One 20 MiB segment: [a 4 | g1 1.5 | h 1.5 | g2 1.5 | 11.5 free], then a and h freed.
  void *a = nullptr, *g1 = nullptr, *h = nullptr, *g2 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &a));
  for (void **q : {&g1, &h, &g2}) EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB / 2, s, q));
  REQUIRE(stats(0).segments.current == 1);
  REQUIRE(reinterpret_cast<uintptr_t>(h) == reinterpret_cast<uintptr_t>(a) + 11 * MiB / 2); // the layout
  EBB_REQUIRE_OK(ebb_arena_free(a));
  EBB_REQUIRE_OK(ebb_arena_free(h));
  ARENA_CHECK();
  const uint64_t dev = stats(0).num_device_alloc;
  void *x = nullptr, *y = nullptr, *z = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB / 4, s, &x)); // below 2 MiB: the 1.5 MiB hole
  CHECK(x == h);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB / 2, s, &y)); // 2 MiB and up: the oldest fit, a
  CHECK(y == a);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB / 4, s, &z)); // the 1.5 MiB y left of a, not the 11.5
  CHECK(reinterpret_cast<uintptr_t>(z) == reinterpret_cast<uintptr_t>(a) + 5 * MiB / 2);
  CHECK(stats(0).num_device_alloc == dev);
  ARENA_CHECK();
  for (void *q : {g1, g2, x, y, z}) EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// (alloc_test_util.hpp, check_fit_model; its node-memory twin is white-box, in
// test_alloc_internal.cpp.)
TEST_CASE("the free index follows its placement rules through thousands of splits and merges", "[alloc]") {
  EbbSession session;
  check_fit_model(nullptr, -1);
}

// The arena bench's pattern at a test's scale (1 000 live blocks of 512 B .. 16 MiB): with the
// placement rules (arena_impl.h, "free index") no pass of these eight seeds after the first makes
// a driver call. No rule guarantees that of a random sequence (best fit grows the arena by 1 to
// 3 segments in later passes of five of these seeds), so a placement change that unsettles
// them shows here.
TEST_CASE("a repeated random sequence needs no driver allocation after its first pass", "[alloc]") {
  EbbSession session;
  check_settles_after_one_pass(default_stream(0));
}

TEST_CASE("random alloc/free sequences keep every invariant (seeded)", "[alloc]") {
  EbbSession session;
  ebb_stream_t *ss[3] = {default_stream(0), nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[1]));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &ss[2]));
  for (uint32_t seed : {1u, 2u, 3u}) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> logsz(6.0, 25.0);  // 64 B .. 32 MiB
    std::vector<void *> live;
    // Every peak is the largest current seen after a call: the counters move by net updates
    // (inactive_split by the change of one segment), never past their value at the call's end.
    EBB_REQUIRE_OK(ebb_arena_reset_peak(0));
    ebb_arena_stats s0 = stats(0);
    uint64_t mx_split = s0.inactive_split.current, mx_split_b = s0.inactive_split_bytes.current;
    uint64_t mx_alloc = s0.allocated_bytes.current, mx_active = s0.active_bytes.current;
    for (int op = 0; op < 3000; op++) {
      if (live.empty() || rng() % 100 < 55) {
        size_t bytes = static_cast<size_t>(std::exp2(logsz(rng)));
        void *p = nullptr;
        EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, ss[rng() % 3], &p));
        live.push_back(p);
      } else {
        size_t i = rng() % live.size();
        EBB_REQUIRE_OK(ebb_arena_free(live[i]));
        live[i] = live.back();
        live.pop_back();
      }
      ebb_arena_stats st = stats(0);
      mx_split = std::max(mx_split, st.inactive_split.current);
      mx_split_b = std::max(mx_split_b, st.inactive_split_bytes.current);
      mx_alloc = std::max(mx_alloc, st.allocated_bytes.current);
      mx_active = std::max(mx_active, st.active_bytes.current);
      if (op % 250 == 0) ARENA_CHECK();
    }
    ebb_arena_stats sp = stats(0);
    CHECK(sp.inactive_split.peak == mx_split);
    CHECK(sp.inactive_split_bytes.peak == mx_split_b);
    CHECK(sp.allocated_bytes.peak == mx_alloc);
    CHECK(sp.active_bytes.peak == mx_active);
    ARENA_CHECK();
    std::shuffle(live.begin(), live.end(), rng);
    for (void *p : live) EBB_REQUIRE_OK(ebb_arena_free(p));
    ARENA_CHECK();
    CHECK(stats(0).allocated_bytes.current == 0);
    CHECK(stats(0).active_bytes.current == 0);
    CHECK(stats(0).requested_bytes.current == 0);
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
    CHECK(stats(0).reserved_bytes.current == 0);
    CHECK(stats(0).segments.current == 0);
    ARENA_CHECK();
  }
  EBB_REQUIRE_OK(ebb_stream_release(ss[1]));
  EBB_REQUIRE_OK(ebb_stream_release(ss[2]));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("stream-ordered reuse: a block freed on S comes back on S at once", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = pool_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4000, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4000, s, &q));
  CHECK(q == p);
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).cache_hits == 1);
  // The current stream is used when none is given.
  ebb_stream_guard g;
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, s));
  void *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4000, nullptr, &r));
  CHECK(r == p);
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
  EBB_REQUIRE_OK(ebb_arena_free(r));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// One block keeps at most 4 096 recorded streams (streams made and released one after another
// each count: their ids differ). Past that, record_stream says so, and the block is unharmed.
// The recorded streams stay live, so no use can be dropped; once they are released with their
// work done, their uses make room.
TEST_CASE("record_stream past the most streams one block keeps is EBB_ELIMIT", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s0 = default_stream(0);
  for (size_t bytes : {size_t(4096), size_t(1) * MiB}) {  // a slab slot, a block
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, s0, &p));
    std::vector<ebb_stream_t *> live(4096);
    for (auto &t : live) {
      EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
      EBB_REQUIRE_OK(ebb_arena_record_stream(p, t));
    }
    ebb_stream_t *t = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
    EBB_CHECK_FAILS(ebb_arena_record_stream(p, t), EBB_ELIMIT, "already recorded on 4096 streams");
    for (auto *u : live) EBB_REQUIRE_OK(ebb_stream_release(u));
    EBB_REQUIRE_OK(ebb_arena_record_stream(p, t));  // the released streams' uses are gone now
    EBB_REQUIRE_OK(ebb_stream_release(t));
    ARENA_CHECK();
    EBB_REQUIRE_OK(ebb_arena_free(p));
    EBB_REQUIRE_OK(ebb_dev_synchronize(0));
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
    ARENA_CHECK();
    CHECK(stats(0).allocated_bytes.current == 0);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("record_stream from several streams: the block waits for all of them", "[alloc]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *a = default_stream(0), *b = nullptr, *c = nullptr, *other = default_stream(1);
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &b));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &c));
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &p));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, a));  // the allocation stream: nothing to do
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, c));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));      // twice: recorded once
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, other));  // a peer device's stream
  busy(b);
  busy(c);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_arena_stats st = stats(0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.free_count == 1);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_stream_synchronize(c));
  EBB_REQUIRE_OK(ebb_stream_synchronize(other));
  // The next allocation polls the events and gets the block back: no new segment.
  void *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q == p);
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).active_bytes.current == 12 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  // Many streams: the inline use array overflows.
  std::vector<ebb_stream_t *> many(9);
  for (auto &m : many) EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &m));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &q));
  for (auto *m : many) EBB_REQUIRE_OK(ebb_arena_record_stream(q, m));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // waits for the events and releases everything
  CHECK(stats(0).active_bytes.current == 0);
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  for (auto *m : many) EBB_REQUIRE_OK(ebb_stream_release(m));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  EBB_REQUIRE_OK(ebb_stream_release(c));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A free that waited for other streams is retired by the stats call once their events have
// completed: active_bytes says what the device still uses, with no allocation in between to
// poll the events and no host wait by the arena (num_syncs stays).
TEST_CASE("stats retire pending frees whose events completed: active_bytes drops to 0", "[alloc]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0), *b = new_stream(0);
  void *big = nullptr, *small = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &big));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &small));  // a slot with slabs on, a block without
  EBB_REQUIRE_OK(ebb_arena_record_stream(big, b));
  EBB_REQUIRE_OK(ebb_arena_record_stream(small, b));
  busy(b);
  uint64_t syncs = stats(0).num_syncs;
  EBB_REQUIRE_OK(ebb_arena_free(big));
  EBB_REQUIRE_OK(ebb_arena_free(small));
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  ebb_arena_stats st = stats(0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.active_bytes.current == 0);
  CHECK(st.num_syncs == syncs);
  ARENA_CHECK();
  // The blocks are reusable on b too, at once (no longer pending).
  void *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, a, &q));
  CHECK(q == big);
  CHECK(stats(0).num_device_alloc == 2);  // a 2 MiB and a 20 MiB segment: nothing new
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A copy on a stream other than the block's own records that use itself, as a tensor op does:
// with no record_stream, the block freed under the copy is not handed to a new owner until the
// copy has run. Stream b is held by a host function, so the copy is still queued when the
// block is freed, reallocated and overwritten; the copy must then read the original data. The
// source is an interior pointer of its block; a 48 KiB slot (with slabs on) and a 4 MiB block.
TEST_CASE("a copy on another stream records its use: a freed source is not reused under it", "[alloc][copy]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0), *b = new_stream(0);
  for (size_t bytes : {48 * KiB, 4 * MiB}) {
    INFO("bytes " << bytes);
    const size_t words = bytes / 4, off = 4096;
    std::vector<uint32_t> pattern(words), zeros(words, 0), out(words, 0);
    for (size_t i = 0; i < words; i++) pattern[i] = 0x9e3779b9u * static_cast<uint32_t>(i + 1);
    void *src = nullptr, *dst = nullptr, *again = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes + off, a, &src));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &dst));
    EBB_REQUIRE_OK(ebb_copy_async(static_cast<char *>(src) + off, pattern.data(), bytes, a));
    EBB_REQUIRE_OK(ebb_stream_synchronize(a));
    std::atomic<int> open{0};
    EBB_REQUIRE_OK(ebb_stream_host_func(b, hold_until_open, &open));
    EBB_REQUIRE_OK(ebb_copy_async(dst, static_cast<char *>(src) + off, bytes, b));  // no record_stream
    EBB_REQUIRE_OK(ebb_arena_free(src));
    // A new owner on a: the same size, written at once (a is idle).
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes + off, a, &again));
    EBB_REQUIRE_OK(ebb_copy_async(static_cast<char *>(again) + off, zeros.data(), bytes, a));
    EBB_REQUIRE_OK(ebb_stream_synchronize(a));
    open.store(1, std::memory_order_release);
    EBB_REQUIRE_OK(ebb_copy_async(out.data(), dst, bytes, b));
    EBB_REQUIRE_OK(ebb_stream_synchronize(b));
    CHECK(words_differing(out, pattern) == 0);
    CHECK(again != src);
    EBB_REQUIRE_OK(ebb_arena_free(again));
    EBB_REQUIRE_OK(ebb_arena_free(dst));
    ARENA_CHECK();
  }
  // The allocation stream's own copies record nothing: the block comes back at once.
  void *p = nullptr, *q = nullptr;
  std::vector<uint32_t> host(1024, 7);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, a, &p));
  EBB_REQUIRE_OK(ebb_copy_async(p, host.data(), 4096, a));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, a, &q));
  CHECK(q == p);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The bound is the bytes the caller asked for, not the rounded block (a 1-byte block is 512
// bytes of the arena) nor a block kept whole (a 1 MiB + 1 request).
TEST_CASE("a copy past the requested bytes of a block is refused, inside its rounding too", "[alloc][copy]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0);
  void *one = nullptr, *odd = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1, a, &one));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB + 1, a, &odd));
  std::vector<uint8_t> host(2 * MiB, 3);
  EBB_REQUIRE_OK(ebb_copy_async(one, host.data(), 1, a));
  EBB_CHECK_FAILS(ebb_copy_async(one, host.data(), 2, a), EBB_EINVAL, "(1 bytes) requested, offset 0;");
  EBB_CHECK_FAILS(ebb_copy_async(static_cast<char *>(one) + 8, host.data(), 1, a), EBB_EINVAL, "expected an offset below 1");
  EBB_REQUIRE_OK(ebb_copy_async(odd, host.data(), MiB + 1, a));
  EBB_CHECK_FAILS(ebb_copy_async(odd, host.data(), MiB + 2, a), EBB_EINVAL, "expected at most 1048577 bytes");
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  EBB_REQUIRE_OK(ebb_arena_free(one));
  EBB_REQUIRE_OK(ebb_arena_free(odd));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A block kept for the whole run and copied on a stream made per step: the uses of released
// streams whose work is done make room, so the 4,097th step copies as the first did (before,
// EBB_ELIMIT: "already recorded on 4096 streams"). Pinned and device blocks, both sides.
TEST_CASE("a block copied on a fresh stream each step keeps working past 4096 streams", "[alloc][copy][streams]") {
  EbbSession session;
  void *pin = nullptr, *dev = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(64 * KiB, 0, &pin));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * KiB, default_stream(0), &dev));
  std::memset(pin, 0x11, 64 * KiB);
  for (int i = 0; i < 4200; i++) {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    ebb_status st = ebb_copy_async(dev, pin, 64 * KiB, s);
    if (st) {
      INFO("step " << i << ": " << ebb_last_error());
      REQUIRE(st == EBB_OK);
    }
    EBB_REQUIRE_OK(ebb_stream_synchronize(s));
    EBB_REQUIRE_OK(ebb_stream_release(s));
  }
  EBB_REQUIRE_OK(ebb_arena_free(dev));
  EBB_REQUIRE_OK(ebb_pinned_free(pin));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A host function must not copy arena blocks: the arena's lock may be held by a thread waiting
// for that very function (empty_cache with expandable segments), so the copy is refused with
// EBB_ESTATE before the lock is taken, instead of a deadlock (ebb_copy_async refuses every copy
// there; the hook's own refusal, for ops' check of a destination, is tested in test_ops_lifecycle).
namespace {
struct HostCopy {
  void *dst, *src;
  ebb_stream_t *s;
  ebb_status st;
  std::string msg;
};
void host_copy(void *p) {
  auto *h = static_cast<HostCopy *>(p);
  h->st = ebb_copy_async(h->dst, h->src, 512, h->s);
  h->msg = h->st ? ebb_last_error() : "";
}
}  // namespace

TEST_CASE("a host function copying arena blocks gets EBB_ESTATE, not a deadlock", "[alloc][copy][host_fn]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0), *b = new_stream(0);
  void *x = nullptr, *y = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &x));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &y));
  HostCopy h{y, x, b, EBB_OK, ""};
  EBB_REQUIRE_OK(ebb_stream_host_func(a, host_copy, &h));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  INFO(h.msg);
  CHECK(h.st == EBB_ESTATE);
  CHECK(h.msg.find("called from a host function") != std::string::npos);
  CHECK(h.msg.find("device 0") != std::string::npos);
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_free(y));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The same for a destination on the other device (a peer copy on a stream of device 1): the
// freed destination block of device 0 waits for the copy writing it.
TEST_CASE("a peer copy records its use on the destination block of the other device", "[alloc][copy]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *a = default_stream(0), *b = new_stream(1);
  const size_t bytes = 48 * KiB, words = bytes / 4;
  std::vector<uint32_t> pattern(words, 0xa5a5a5a5u), mine(words), out(words, 0);
  for (size_t i = 0; i < words; i++) mine[i] = static_cast<uint32_t>(i);
  void *src = nullptr, *dst = nullptr, *again = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(1, bytes, b, &src));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &dst));
  EBB_REQUIRE_OK(ebb_copy_async(src, pattern.data(), bytes, b));
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(b, hold_until_open, &open));
  EBB_REQUIRE_OK(ebb_copy_async(dst, src, bytes, b));  // writes device 0's block, queued on b
  EBB_REQUIRE_OK(ebb_arena_free(dst));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, a, &again));
  // The new owner's data must survive the queued copy. (The peer copy made device 0's current
  // stream, a, wait for b: the new owner writes through a stream of its own.)
  ebb_stream_t *c = new_stream(0);
  EBB_REQUIRE_OK(ebb_copy_async(again, mine.data(), bytes, c));
  EBB_REQUIRE_OK(ebb_stream_synchronize(c));
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_REQUIRE_OK(ebb_copy_async(out.data(), again, bytes, c));
  EBB_REQUIRE_OK(ebb_stream_synchronize(c));
  CHECK(words_differing(out, mine) == 0);
  EBB_REQUIRE_OK(ebb_arena_free(again));
  EBB_REQUIRE_OK(ebb_arena_free(src));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(c));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The copy hook under threads: each thread copies its fresh block on a second stream of its
// own, frees it at once with no record_stream, and takes and overwrites the same size on its
// allocation stream; the copy must still read the original. Four threads do it at once on one
// arena, so the hook's lookups and records race other threads' allocations, frees, steals and
// slabs (a race check for TSan and ASan: without a gate the copy may win even with no record
// taken; the gated single-thread cases above are the ones that fail without it). No gate here: with one per
// thread, a steal orders one thread's stream after another's gated one, and each thread's
// synchronize then waits for the other's gate.
TEST_CASE("4 threads copy blocks on other streams and free them at once: no copy sees the new owner's data",
          "[alloc][copy][threads]") {
  EbbSession session;
  constexpr int kThreads = 4, kOps = 40;
  std::atomic<int> failures{0}, wrong{0};
  auto worker = [&](int t) {
    ebb_stream_t *mine = nullptr, *peer = nullptr;
    void *out = nullptr;
    if (ebb_stream_create(0, EBB_PRIO_LOW, &mine) || ebb_stream_create(0, EBB_PRIO_LOW, &peer) ||
        ebb_arena_alloc(0, MiB, peer, &out)) {
      failures++;
      return;
    }
    std::mt19937 rng(7 + t);
    for (int op = 0; op < kOps; op++) {
      const size_t words = size_t(128) << (rng() % 12), bytes = words * 4;  // 512 B .. 1 MiB
      std::vector<uint32_t> pat(words), zeros(words, 0), back(words, 1);
      for (size_t i = 0; i < words; i++) pat[i] = (uint32_t(t) << 24) ^ (uint32_t(op) << 12) ^ uint32_t(i + 1);
      void *p = nullptr, *q = nullptr;
      bool ok = ebb_arena_alloc(0, bytes, mine, &p) == EBB_OK && ebb_copy_async(p, pat.data(), bytes, mine) == EBB_OK &&
                ebb_stream_wait_stream(peer, mine) == EBB_OK && ebb_copy_async(out, p, bytes, peer) == EBB_OK &&
                ebb_arena_free(p) == EBB_OK && ebb_arena_alloc(0, bytes, mine, &q) == EBB_OK &&
                ebb_copy_async(q, zeros.data(), bytes, mine) == EBB_OK &&
                ebb_copy_async(back.data(), out, bytes, peer) == EBB_OK;
      if (ebb_stream_synchronize(mine) != EBB_OK) failures++;
      if (ebb_stream_synchronize(peer) != EBB_OK || !ok) failures++;
      if (words_differing(back, pat)) wrong++;
      if (q && ebb_arena_free(q) != EBB_OK) failures++;
    }
    if (ebb_arena_free(out) != EBB_OK || ebb_stream_release(mine) != EBB_OK || ebb_stream_release(peer) != EBB_OK)
      failures++;
  };
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; t++) th.emplace_back(worker, t);
  for (auto &x : th) x.join();
  CHECK(failures.load() == 0);
  CHECK(wrong.load() == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).allocated_bytes.current == 0);
  CHECK(stats(0).active_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The arena knows each block's size: a copy running past the end of a block (from its start or
// from inside it, either side) is refused with the block named, and nothing is enqueued (no
// staging, the next block's memory untouched).
TEST_CASE("a copy past the end of an arena block is refused, naming the block", "[alloc][copy]") {
  EbbSession session;
  ebb_stream_t *a = default_stream(0);
  void *small = nullptr, *next = nullptr, *big = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 512, a, &small));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 512, a, &next));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, a, &big));
  std::vector<uint32_t> ones(128, 1), host(MiB / 4, 2), out(128, 0);
  EBB_REQUIRE_OK(ebb_copy_async(next, ones.data(), 512, a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  ebb_stream_stats ss0{}, ss1{};
  EBB_REQUIRE_OK(ebb_stream_get_stats(&ss0));
  char addr[32];
  std::snprintf(addr, sizeof addr, "block at %p", small);
  EBB_CHECK_FAILS(ebb_copy_async(small, host.data(), MiB, a), EBB_EINVAL, "dst");
  EBB_CHECK_FAILS(ebb_copy_async(small, host.data(), MiB, a), EBB_EINVAL, addr);
  EBB_CHECK_FAILS(ebb_copy_async(small, host.data(), MiB, a), EBB_EINVAL, "(512 bytes) requested, offset 0;");
  EBB_CHECK_FAILS(ebb_copy_async(small, host.data(), MiB, a), EBB_EINVAL, "device 0");
  EBB_CHECK_FAILS(ebb_copy_async(static_cast<char *>(small) + 256, big, 512, a), EBB_EINVAL, "offset 256;");
  EBB_CHECK_FAILS(ebb_copy_async(big, small, 1024, a), EBB_EINVAL, "src");
  EBB_CHECK_FAILS(ebb_copy_async(host.data(), static_cast<char *>(big) + MiB - 256, 512, a), EBB_EINVAL,
                  "offset 1048320;");
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  EBB_REQUIRE_OK(ebb_stream_get_stats(&ss1));
  CHECK(ss1.staged_bytes == ss0.staged_bytes);
  EBB_REQUIRE_OK(ebb_copy_async(out.data(), next, 512, a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  CHECK(words_differing(out, ones) == 0);
  // Up to the end is fine, from the start or inside.
  EBB_REQUIRE_OK(ebb_copy_async(static_cast<char *>(small) + 256, big, 256, a));
  EBB_REQUIRE_OK(ebb_copy_async(small, big, 512, a));
  EBB_REQUIRE_OK(ebb_copy_async(static_cast<char *>(big) + MiB - 512, small, 512, a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  // Deep inside a large block: its start is 1 000 granules of the address map back.
  void *huge = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * MiB, a, &huge));
  EBB_CHECK_FAILS(ebb_copy_async(static_cast<char *>(huge) + 64 * MiB - 256, host.data(), 512, a), EBB_EINVAL,
                  "offset 67108608;");
  EBB_REQUIRE_OK(ebb_copy_async(static_cast<char *>(huge) + 40 * MiB, host.data(), 4096, a));
  EBB_REQUIRE_OK(ebb_stream_synchronize(a));
  for (void *p : {small, next, big, huge}) EBB_REQUIRE_OK(ebb_arena_free(p));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a stream's miss takes another stream's free block after an event wait", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &q));
  CHECK(q == p);
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).num_steals == 1);
  ARENA_CHECK();
  // Freed on t, it is now t's block: t reuses it without another steal.
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &q));
  CHECK(q == p);
  CHECK(stats(0).num_steals == 1);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  // A small block split off s's segment: the remainder stays with s, never merged across streams.
  void *x = nullptr, *y = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, s, &x));
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, t, &y));
  CHECK(y == x);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(y));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A stream made per call and released after it (an allocator that caches blocks per stream and
// never hands them to a new stream strands a step's memory each step): each call's block serves the next call's new stream, ordered on the device
// after the released one's work (its release event), with neither growth nor a host wait.
TEST_CASE("a stream made per call reuses the previous call's block, without a host wait", "[alloc]") {
  EbbSession session;
  for (int i = 0; i < 100; i++) {
    ebb_stream_t *s = nullptr;
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * MiB, s, &p));
    EBB_REQUIRE_OK(ebb_arena_free(p));
    EBB_REQUIRE_OK(ebb_stream_release(s));
  }
  ebb_arena_stats st = stats(0);
  CHECK(st.num_device_alloc == 1);
  CHECK(st.num_steals == 99);
  CHECK(st.num_syncs == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a steal gives the remainder to the stealing stream", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  // One 20 MiB segment of s: [0, 8), [8, 16) and [16, 20). t's first steal takes [16, 20)
  // whole (no remainder).
  void *p = nullptr, *p2 = nullptr, *q = nullptr, *r = nullptr, *u = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p2));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, t, &q));
  CHECK(reinterpret_cast<uintptr_t>(q) == reinterpret_cast<uintptr_t>(p) + 16 * MiB);
  CHECK(stats(0).num_steals == 1);
  EBB_REQUIRE_OK(ebb_arena_free(q));  // [16, 20): t's
  EBB_REQUIRE_OK(ebb_arena_free(p));  // [0, 16): s's
  EBB_REQUIRE_OK(ebb_arena_free(p2));
  ARENA_CHECK();
  // t misses (4 MiB of its own) and steals s's 16 MiB for 13 MiB. The 3 MiB left over wait,
  // in no index, until t is ordered after s; then they become t's and merge with t's [16, 20)
  // into 7 MiB (ARENA_CHECK fails on unmerged free neighbours of one stream).
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 13 * MiB, t, &r));
  CHECK(r == p);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_syncs == 0);
  ARENA_CHECK();
  // Left with s, the 3 MiB would have made this a third steal (or a new segment): t's own now.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 7 * MiB, t, &u));
  CHECK(reinterpret_cast<uintptr_t>(u) == reinterpret_cast<uintptr_t>(p) + 13 * MiB);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_device_alloc == 1);
  for (void *x : {r, u}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("adjacent free blocks of several streams serve a request none of them holds alone", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  // One 20 MiB segment, [0, 8) free on t and [8, 20) free on s: neither block holds 14 MiB,
  // and free blocks of two streams never merge on free.
  void *p = nullptr, *q = nullptr, *r = nullptr, *x = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &x));
  CHECK(reinterpret_cast<uintptr_t>(x) == reinterpret_cast<uintptr_t>(p) + 8 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, t, &q));  // the first steal, whole: no remainder
  CHECK(q == p);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  // The run of both serves 14 MiB on t after an event on s: no new segment.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 14 * MiB, t, &r));
  CHECK(r == p);
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_syncs == 0);
  ARENA_CHECK();
  // The 6 MiB left over is t's (t waits for s): t reuses it without another steal.
  void *u = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 6 * MiB, t, &u));
  CHECK(reinterpret_cast<uintptr_t>(u) == reinterpret_cast<uintptr_t>(p) + 14 * MiB);
  CHECK(stats(0).num_steals == 2);
  CHECK(stats(0).num_device_alloc == 1);
  for (void *x : {r, u}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  // Nothing fits even together: the arena grows as before.
  void *v = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 24 * MiB, s, &v));
  CHECK(stats(0).num_device_alloc == 2);
  EBB_REQUIRE_OK(ebb_arena_free(v));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("limits: a cap on reserved bytes, as bytes or a fraction", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 30 * MiB));
  CHECK(stats(0).limit == 30 * MiB);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &a));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &b));
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 12 * MiB, s, &c), EBB_ENOMEM, "limit 30.00 MiB");
  CHECK(stats(0).num_ooms == 1);
  CHECK(stats(0).num_alloc_retries == 1);
  EBB_REQUIRE_OK(ebb_arena_free(b));  // cached: the same size fits again under the cap
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &c));
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &b));
  EBB_CHECK_FAILS(ebb_arena_set_limit_fraction(0, 0.0), EBB_EINVAL, "0 < fraction <= 1");
  EBB_CHECK_FAILS(ebb_arena_set_limit_fraction(0, 1.5), EBB_EINVAL, "0 < fraction <= 1");
  size_t fr = 0, total = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &fr, &total));
  EBB_REQUIRE_OK(ebb_arena_set_limit_fraction(0, 0.5));
  CHECK(stats(0).limit == total / 2);
  for (void *p : {a, b, c}) EBB_REQUIRE_OK(ebb_arena_free(p));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("empty_cache gives cached segments back to the driver", "[alloc]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = default_stream(1);
  size_t free0 = 0, free1 = 0, free2 = 0, total = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(1, &free0, &total));
  void *p = nullptr, *keep = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(1, 100 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_alloc(1, 1000, s, &keep));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_dev_mem_info(1, &free1, &total));
  CHECK(free1 + 102 * MiB <= free0);  // cached, still held from the driver
  EBB_REQUIRE_OK(ebb_arena_empty_cache(1));
  EBB_REQUIRE_OK(ebb_dev_mem_info(1, &free2, &total));
  CHECK(free2 >= free1 + 100 * MiB);
  ebb_arena_stats st = stats(1);
  CHECK(st.reserved_bytes.current == 2 * MiB);  // the segment with a live block stays
  CHECK(st.reserved_bytes.peak == 102 * MiB);
  CHECK(st.num_device_free == 1);
  EBB_REQUIRE_OK(ebb_arena_reset_peak(1));
  CHECK(stats(1).reserved_bytes.peak == 2 * MiB);
  CHECK(stats(0).reserved_bytes.current == 0);  // device 0 untouched
  EBB_REQUIRE_OK(ebb_arena_free(keep));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("misuse: unknown, interior and double frees, bad devices and streams", "[alloc]") {
  {
    void *p = nullptr;
    EBB_CHECK_FAILS(ebb_arena_alloc(0, 16, nullptr, &p), EBB_ENOTINIT, "ebb_init");
  }
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s0 = default_stream(0), *s1 = default_stream(1);
  void *p = nullptr, *z = reinterpret_cast<void *>(1);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 0, s0, &z));  // zero bytes: NULL and OK
  CHECK(z == nullptr);
  EBB_REQUIRE_OK(ebb_arena_free(nullptr));
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 16, s0, nullptr), EBB_EINVAL, "ptr is NULL");
  EBB_CHECK_FAILS(ebb_arena_alloc(7, 16, s0, &p), EBB_EDEVICE, "device 7 is out of range");
  EBB_CHECK_FAILS(ebb_arena_alloc(-1, 16, nullptr, &p), EBB_EDEVICE, "device -1");
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 16, s1, &p), EBB_EDEVICE, "belongs to device 1");
  ebb_stream_t *gone = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &gone));
  EBB_REQUIRE_OK(ebb_stream_release(gone));
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 16, gone, &p), EBB_EFREED, "ebb_arena_alloc");
  {
    // The entry checks' fast path (one peek at the handle) falls back to the public check for
    // every bad stream: the messages name the call, then ebb_stream_get_info's reason, whole.
    std::string want_gone = "ebb_arena_alloc: ebb_stream_get_info: stream ";
    ebb_clear_error();
    CHECK(ebb_arena_alloc(0, 16, gone, &p) == EBB_EFREED);
    CHECK(std::string(ebb_last_error()).rfind(want_gone, 0) == 0);
    CHECK(std::string(ebb_last_error()).find("was released by ebb_stream_release; expected a live stream") !=
          std::string::npos);
    ebb_event_t *ev = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &ev));
    ebb_clear_error();
    CHECK(ebb_arena_alloc(0, 16, reinterpret_cast<ebb_stream_t *>(ev), &p) == EBB_EINVAL);
    CHECK(std::string(ebb_last_error()).find("ebb_arena_alloc: ebb_stream_get_info: ") == 0);
    CHECK(std::string(ebb_last_error()).find("is an event, not a stream; expected a stream handle") != std::string::npos);
    ebb_clear_error();
    CHECK(ebb_arena_record_stream(reinterpret_cast<void *>(4096), reinterpret_cast<ebb_stream_t *>(ev)) == EBB_EINVAL);
    CHECK(std::string(ebb_last_error()).find("ebb_arena_record_stream: ebb_stream_get_info: ") == 0);
    EBB_REQUIRE_OK(ebb_event_release(ev));
    ebb_clear_error();
    CHECK(ebb_arena_record_stream(reinterpret_cast<void *>(4096), gone) == EBB_EFREED);
    CHECK(std::string(ebb_last_error()).find("ebb_arena_record_stream: ebb_stream_get_info: stream ") == 0);
  }
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8192, s0, &p));
  int on_stack = 0;
  EBB_CHECK_FAILS(ebb_arena_free(&on_stack), EBB_EINVAL, "was not allocated by ebb_arena_alloc");
  EBB_CHECK_FAILS(ebb_arena_free(static_cast<char *>(p) + 512), EBB_EINVAL, "is inside the block");
  EBB_CHECK_FAILS(ebb_arena_record_stream(static_cast<char *>(p) + 512, s0), EBB_EINVAL, "is inside the block");
  EBB_CHECK_FAILS(ebb_arena_record_stream(p, nullptr), EBB_EINVAL, "stream is NULL");
  EBB_CHECK_FAILS(ebb_arena_record_stream(nullptr, s0), EBB_EINVAL, "pointer is NULL");
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_arena_record_stream(p, s0), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_arena_empty_cache(2), EBB_EDEVICE, "ebb_arena_empty_cache");
  EBB_CHECK_FAILS(ebb_arena_get_stats(0, nullptr), EBB_EINVAL, "out is NULL");
  ARENA_CHECK();  // nothing above disturbed the pool
  void *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8192, s0, &q));
  CHECK(q == p);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Blocks larger than 64 KiB are found through the address map (one word in the 64 KiB granule
// where they start), smaller ones through the pointer map: the same misuse on both.
TEST_CASE("misuse of blocks larger than 64 KiB: interior, double and wrong-pool frees", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s0 = default_stream(0);
  void *p = nullptr, *pin = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * KiB, s0, &p));
  EBB_REQUIRE_OK(ebb_pinned_alloc(100 * KiB, 0, &pin));
  char *pc = static_cast<char *>(p);
  EBB_CHECK_FAILS(ebb_arena_free(pc + 512), EBB_EINVAL, "is inside the block");
  EBB_CHECK_FAILS(ebb_arena_free(pc + 64 * KiB), EBB_EINVAL, "is inside the block");  // the next granule
  EBB_CHECK_FAILS(ebb_arena_free(pc + 1), EBB_EINVAL, "is inside the block");        // not 512-aligned
  EBB_CHECK_FAILS(ebb_arena_record_stream(pc + 512, s0), EBB_EINVAL, "is inside the block");
  // Wrong pool: named, and the block stays live for its owner (its map entry put back).
  EBB_CHECK_FAILS(ebb_arena_free(pin), EBB_EINVAL, "is a live block of the pinned pool");
  EBB_CHECK_FAILS(ebb_pinned_free(p), EBB_EINVAL, "is a live block of the device 0");
  EBB_CHECK_FAILS(ebb_arena_record_stream(pin, s0), EBB_EINVAL, "belongs to the pinned pool");
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, s0));
  EBB_REQUIRE_OK(ebb_pinned_free(pin));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_arena_record_stream(p, s0), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_pinned_free(pin), EBB_EFREED, "already freed");
  ARENA_CHECK();
  CHECK(stats(0).allocated_bytes.current == 0);
  // The same address again: a new block there is found, and freed once.
  void *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * KiB, s0, &q));
  CHECK(q == p);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_CHECK_FAILS(ebb_arena_free(q), EBB_EFREED, "already freed");
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A free through the wrong pool's call, racing the owner's own free: the bad call must leave the
// block's map entry in place, or the owner's free finds nothing and reports the live block as
// already freed (and it leaks). 8 KiB blocks are slots here and in the ptrmap with slabs off
// (the *_noslab executable, where the race showed in every run); 1 MiB blocks are in the address
// map, whose window was narrower (3 frees in 10^6 failed there, seldom within this test).
TEST_CASE("a wrong-pool free racing the owner's free leaves the owner's free intact", "[alloc][threads]") {
  EbbSession session;
  ebb_stream_t *s0 = default_stream(0);
  for (size_t bytes : {size_t(8) * KiB, size_t(1) * MiB}) {
    std::atomic<void *> shared{nullptr};
    std::atomic<int> stop{0}, odd{0};
    std::thread bad([&] {
      while (!stop.load()) {
        void *q = shared.load();
        if (!q) continue;
        ebb_status st = ebb_pinned_free(q); // always the wrong pool
        if (st != EBB_EINVAL && st != EBB_EFREED) odd++;
      }
    });
    int failed = 0;
    std::string first;
    for (int i = 0; i < 20000; i++) {
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, s0, &p));
      shared.store(p);
      ebb_status st = ebb_arena_free(p);
      shared.store(nullptr);
      if (st && !failed++) first = ebb_last_error();
    }
    stop = 1;
    bad.join();
    INFO(bytes << "-byte blocks: first failed free: " << first);
    CHECK(failed == 0);
    CHECK(odd == 0);
    ebb_arena_stats st = stats(0);
    CHECK(st.allocated_bytes.current == 0);
    CHECK(st.alloc_count == st.free_count);
    ARENA_CHECK();
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A slab ending inside a granule and a large block starting after it in the same granule: the
// granule's entry names both, and each pointer finds its own.
TEST_CASE("a slab's slots and a large block in one 64 KiB granule are each found", "[alloc]") {
  if (!slabs_on()) return;  // no slabs: nothing shares a granule with the block
  EbbSession session;
  ebb_stream_t *s = pool_stream(0);
  // 3 KiB slots: the class's first slab is 42 x 3 KiB = 126 KiB, carved at a new segment's
  // start; the 100 KiB block is then the first fit, right behind it.
  std::vector<void *> slots;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * KiB, s, &p));
  slots.push_back(p);
  void *big = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * KiB, s, &big));
  const uintptr_t g = reinterpret_cast<uintptr_t>(big) >> 16;
  for (int i = 1; i < 42; i++) {
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * KiB, s, &p));
    slots.push_back(p);
  }
  size_t shared = 0;
  for (void *x : slots) shared += (reinterpret_cast<uintptr_t>(x) >> 16) == g;
  INFO("block " << big << ", slots from " << slots.front());
  REQUIRE(shared > 0);  // the layout this test is about
  EBB_CHECK_FAILS(ebb_arena_free(static_cast<char *>(big) + 512), EBB_EINVAL, "is inside the block");
  for (void *x : slots)
    if ((reinterpret_cast<uintptr_t>(x) >> 16) == g) {
      EBB_REQUIRE_OK(ebb_arena_record_stream(x, s));
      EBB_REQUIRE_OK(ebb_arena_free(x));
      EBB_CHECK_FAILS(ebb_arena_free(x), EBB_EFREED, "already freed");
    }
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(big));
  EBB_CHECK_FAILS(ebb_arena_free(big), EBB_EFREED, "already freed");
  for (void *x : slots)
    if ((reinterpret_cast<uintptr_t>(x) >> 16) != g) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  CHECK(stats(0).allocated_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("8 threads allocate, record and free across streams and devices", "[alloc][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  constexpr int kThreads = 8;
  std::vector<ebb_stream_t *> streams(kThreads);
  for (int t = 0; t < kThreads; t++) EBB_REQUIRE_OK(ebb_stream_create(t % 2, EBB_PRIO_LOW, &streams[t]));
  std::mutex mbox_mu;
  std::vector<void *> mbox;  // blocks handed to another thread to free
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::mt19937 rng(100 + t);
    int dev = t % 2;
    ebb_stream_t *mine = streams[t], *peer = streams[(t + 2) % kThreads];  // same device
    std::vector<void *> live;
    for (int op = 0; op < 1500; op++) {
      unsigned r = rng() % 100;
      if (r < 50 || live.empty()) {
        size_t bytes = static_cast<size_t>(std::exp2(9.0 + (rng() % 1300) / 100.0));  // 512 B .. 4 MiB
        void *p = nullptr;
        if (ebb_arena_alloc(dev, bytes, mine, &p) != EBB_OK) failures++;
        else live.push_back(p);
      } else if (r < 60) {
        if (ebb_arena_record_stream(live.back(), peer) != EBB_OK) failures++;
      } else if (r < 70) {
        std::lock_guard<std::mutex> lk(mbox_mu);
        mbox.push_back(live.back());
        live.pop_back();
      } else {
        void *p = live.back();
        live.pop_back();
        {
          std::lock_guard<std::mutex> lk(mbox_mu);
          if (!mbox.empty()) {
            live.push_back(p);
            p = mbox.back();
            mbox.pop_back();
          }
        }
        if (ebb_arena_free(p) != EBB_OK) failures++;
      }
    }
    for (void *p : live)
      if (ebb_arena_free(p) != EBB_OK) failures++;
  };
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; t++) th.emplace_back(worker, t);
  for (auto &x : th) x.join();
  CHECK(failures.load() == 0);
  for (void *p : mbox) EBB_REQUIRE_OK(ebb_arena_free(p));
  ARENA_CHECK();
  for (int d = 0; d < 2; d++) {
    EBB_REQUIRE_OK(ebb_arena_empty_cache(d));
    ebb_arena_stats st = stats(d);
    CHECK(st.allocated_bytes.current == 0);
    CHECK(st.active_bytes.current == 0);
    CHECK(st.reserved_bytes.current == 0);
    CHECK(st.alloc_count == st.free_count);
  }
  ARENA_CHECK();
  for (auto *s : streams) EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("4 threads on 4 streams steal each other's free blocks", "[alloc][threads]") {
  EbbSession session;
  constexpr int kThreads = 4;
  std::vector<ebb_stream_t *> streams(kThreads);
  for (auto &x : streams) EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &x));
  std::atomic<int> failures{0};
  // Large blocks of mixed sizes, freed in random order: each stream's misses steal the others'
  // free blocks (~150 steals), their events recorded under the arena's lock (the remainder goes
  // to the stealing stream) or, the first time, after it, while the other threads allocate and
  // free.
  auto worker = [&](int t) {
    std::mt19937 rng(200 + t);
    std::vector<void *> live;
    for (int op = 0; op < 600; op++) {
      if (rng() % 100 < 55 || live.empty()) {
        size_t bytes = (1 + rng() % 30) * MiB + (rng() % 4) * 4096;
        void *p = nullptr;
        if (ebb_arena_alloc(0, bytes, streams[t], &p) != EBB_OK) failures++;
        else live.push_back(p);
      } else {
        size_t i = rng() % live.size();
        if (ebb_arena_free(live[i]) != EBB_OK) failures++;
        live[i] = live.back();
        live.pop_back();
      }
    }
    for (void *p : live)
      if (ebb_arena_free(p) != EBB_OK) failures++;
  };
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; t++) th.emplace_back(worker, t);
  for (auto &x : th) x.join();
  CHECK(failures.load() == 0);
  ebb_arena_stats st = stats(0);
  CHECK(st.num_steals > 0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.active_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  for (auto *s : streams) EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Streams made per call on two threads: each new stream's first allocation steals a block the
// other thread's stream freed, while that thread releases its stream; and a block recorded on a
// stream is freed while the stream's owner releases it. The arena records its events on those
// streams only while they are live (else after their release events): under TSan the record
// raced the release's destruction of the driver stream.
TEST_CASE("steals and recorded uses race the release of the streams they order after", "[alloc][threads]") {
  EbbSession session;
  std::atomic<int> failures{0};
  auto churn = [&](int t) {
    std::mt19937 rng(300 + t);
    for (int i = 0; i < 1500; i++) {
      ebb_stream_t *s = nullptr;
      void *p = nullptr;
      if (ebb_stream_create(0, EBB_PRIO_LOW, &s) != EBB_OK) {
        failures++;
        continue;
      }
      size_t bytes = (1 + rng() % 8) * MiB;
      if (ebb_arena_alloc(0, bytes, s, &p) != EBB_OK || ebb_arena_free(p) != EBB_OK) failures++;
      if (ebb_stream_release(s) != EBB_OK) failures++;
    }
  };
  std::thread a(churn, 0), b(churn, 1);
  a.join();
  b.join();
  CHECK(failures.load() == 0);
  CHECK(stats(0).num_steals > 0);
  ebb_stream_t *main_s = default_stream(0);
  for (int i = 0; i < 300; i++) {
    ebb_stream_t *s = nullptr;
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 2 * MiB, main_s, &p));
    EBB_REQUIRE_OK(ebb_arena_record_stream(p, s));
    std::atomic<int> go{0};
    ebb_status fst = EBB_OK, rst = EBB_OK;
    std::thread f([&] {
      while (!go.load()) {}
      fst = ebb_arena_free(p); // records its event on s, or after s's release event
    });
    go = 1;
    rst = ebb_stream_release(s);
    f.join();
    if (fst || rst) failures++;
  }
  CHECK(failures.load() == 0);
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).allocated_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("shutdown refuses while a block is live, then releases the cache and a later init starts clean", "[alloc]") {
  size_t free_before = 0, total = 0;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free_before, &total));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * MiB, nullptr, &p));
  // A live block: nothing is torn down, the block stays valid.
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_EBUSY, "blocks of the device 0 arena: 1");
  CHECK(ebb_is_initialized());
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK_FALSE(ebb_is_initialized());
  // A pointer from before a completed shutdown is a released one, said as such.
  EbbSession session;
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "gave back to the driver before the last completed ebb_shutdown");
  CHECK(std::string(ebb_last_error()).find("device 0") != std::string::npos);
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == 0);
  CHECK(st.alloc_count == 0);
  size_t fr = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &fr, &total));
  if (ebb_test_emulated())
    CHECK(fr == free_before); // the emulated device is this process's alone
  else
    WARN("free memory before and after not compared: a real GPU's is shared with other processes (the suite's other tests)");
  // A pointer whose segment empty_cache gave back: freed, said so (not "never allocated").
  void *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * MiB, nullptr, &q));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  EBB_CHECK_FAILS(ebb_arena_free(q), EBB_EFREED, "gave back to the driver since ebb_init (empty_cache");
  // The host pool's ranges go back to the system, whose next mapping may be anyone's: a pointer
  // there is "not allocated", with the hint, and another pool's free call does not match it.
  void *h = nullptr;
  EBB_REQUIRE_OK(ebb_pageable_alloc(8 * MiB, &h));
  EBB_REQUIRE_OK(ebb_pageable_free(h));
  EBB_REQUIRE_OK(ebb_pageable_empty_cache());
  EBB_CHECK_FAILS(ebb_pageable_free(h), EBB_EINVAL, "gave back to the system since ebb_init");
  EBB_CHECK_FAILS(ebb_pinned_free(h), EBB_EINVAL, "was not allocated by ebb_pinned_alloc (no segment");
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("a bad EBB_ALLOC_CONF fails ebb_init naming the variable, the value and what is accepted", "[alloc][config]") {
  {
    ScopedEnv env("EBB_ALLOC_CONF", "expandable_segments:2");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "ebb_init: EBB_ALLOC_CONF='expandable_segments:2' is not valid; expected expandable_segments:0 or");
    CHECK_FALSE(ebb_is_initialized());
  }
  {
    ScopedEnv env("EBB_ALLOC_CONF", "history:10,colour:blue");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "'colour' is unknown");
  }
  {
    // A good one is used by the arena, and the successful init leaves the last error alone.
    ScopedEnv env("EBB_ALLOC_CONF", "max_split_size_mb:20, history:0");
    ebb_clear_error();
    EbbSession session;
    CHECK(std::string(ebb_last_error()).empty());
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, nullptr, &p));
    EBB_REQUIRE_OK(ebb_arena_free(p));
    size_t n = 1;
    uint64_t total = 1;
    ebb_alloc_trace_entry e[4];
    EBB_REQUIRE_OK(ebb_alloc_history_get(0, e, 4, &n, &total));
    CHECK(n == 0);  // history:0 reached the arena
  }
}
