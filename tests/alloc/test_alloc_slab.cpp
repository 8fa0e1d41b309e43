// Size-class slabs (alloc/slab.c) through ebb/alloc.h on the emulated driver: requests up to
// 64 KiB are slots of slabs carved from the small pool. Slot reuse on the allocation stream,
// slabs going back to the engine and serving other sizes and streams, bad frees of slot
// pointers, exact stats, empty_cache, the host and pinned pools, and threads over streams.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

namespace {

// Slots of the slab for a rounded slot size (slab.c: about 128 KiB, at least 2 slots).
size_t slab_slots(size_t slot) { return std::max<size_t>(2, 128 * KiB / slot); }

void require_all_checks() {
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_pageable_debug_check());
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
}

}  // namespace

// test_alloc_slab_16k runs with EBB_ALLOC_CONF=slab_max_bytes:16K: the limit is "rounded size".
static bool limit_16k() {
  const char *c = std::getenv("EBB_ALLOC_CONF");
  return c && std::strstr(c, "slab_max_bytes:16K");
}

TEST_CASE("slab: slab_max_bytes bounds the rounded sizes served by slots", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  const size_t limit = limit_16k() ? 16 * KiB : 64 * KiB;
  void *p = nullptr, *q = nullptr;
  // Just above the limit: a plain block split off a segment (one free remainder).
  EBB_REQUIRE_OK(ebb_arena_alloc(0, limit + 1, s, &p));
  CHECK(stats(0).inactive_split.current == 1);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  // At the limit (rounded): a slot, its slab's other slots free.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, limit - 100, s, &q));
  CHECK(stats(0).inactive_split.current == slab_slots(limit) - 1 + 1);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: a freed slot is reused on its stream at once, with exact stats", "[alloc][slab]") {
  REQUIRE(slabs_on());
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1000, s, &p));
  ebb_arena_stats st = stats(0);
  CHECK(st.allocated_bytes.current == 1024);
  CHECK(st.active_bytes.current == 1024);
  CHECK(st.requested_bytes.current == 1000);
  CHECK(st.reserved_bytes.current == 2 * MiB);
  CHECK(st.alloc_count == 1);
  // The rest of the slab is free slots: inactive_split counts them, and the free rest of the
  // segment after the slab.
  CHECK(st.inactive_split.current == slab_slots(1024) - 1 + 1);
  CHECK(st.inactive_split_bytes.current == (slab_slots(1024) - 1) * 1024 + (2 * MiB - slab_slots(1024) * 1024));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1024, s, &q));
  CHECK(reinterpret_cast<uintptr_t>(q) == reinterpret_cast<uintptr_t>(p) + 1024);  // the next slot
  EBB_REQUIRE_OK(ebb_arena_free(p));
  CHECK(stats(0).allocated_bytes.current == 1024);
  CHECK(stats(0).requested_bytes.current == 1024);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 600, s, &r));
  CHECK(r == p);  // the lowest free slot, at once
  st = stats(0);
  CHECK(st.allocated_bytes.current == 2048);
  CHECK(st.requested_bytes.current == 1624);
  CHECK(st.alloc_count == 3);
  CHECK(st.free_count == 1);
  CHECK(st.cache_hits == 2);  // the two slots after the first came from the slab
  CHECK(st.num_device_alloc == 1);
  CHECK(st.allocated_bytes.peak == 2048);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_free(r));
  st = stats(0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.active_bytes.current == 0);
  CHECK(st.requested_bytes.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: empty slabs go back to the engine, for other sizes and other streams", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *s = new_stream(0), *t = new_stream(0);
  // A plain block at the start of a segment keeps it in use. Then the largest slots (64 KiB: 2
  // per slab; 16 KiB under the 16K limit: 8): three slabs' worth fill three slabs of the same
  // segment, in address order.
  const size_t slot = limit_16k() ? 16 * KiB : 64 * KiB;
  void *keep = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 256 * KiB, s, &keep));
  std::vector<void *> v(3 * slab_slots(slot));
  for (void *&p : v) EBB_REQUIRE_OK(ebb_arena_alloc(0, slot, s, &p));
  std::vector<void *> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); i++)
    CHECK(reinterpret_cast<uintptr_t>(sorted[i]) == reinterpret_cast<uintptr_t>(sorted[0]) + i * slot);
  CHECK(stats(0).segments.current == 1);
  ARENA_CHECK();
  // All free: one empty slab stays cached for the class (the first to empty), the others merge
  // back into the segment's free space, so a 256 KiB block (not a slot) fits where they were.
  for (void *p : v) EBB_REQUIRE_OK(ebb_arena_free(p));
  ARENA_CHECK();
  CHECK(stats(0).inactive_split.current == slab_slots(slot) + 1);  // the cached slab's slots, the rest
  void *big = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 256 * KiB, s, &big));
  CHECK(stats(0).num_device_alloc == 1);
  uintptr_t base = reinterpret_cast<uintptr_t>(sorted[0]);
  CHECK(reinterpret_cast<uintptr_t>(big) >= base);
  CHECK(reinterpret_cast<uintptr_t>(big) < base + 2 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(big));
  // Another stream's first slot of the class: the cached empty slab of s goes back to the
  // engine and t steals its memory after an event wait, rather than growing the pool.
  uint64_t steals = stats(0).num_steals;
  void *x = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, slot, t, &x));
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).num_steals == steals + 1);
  CHECK(reinterpret_cast<uintptr_t>(x) >= base);
  CHECK(reinterpret_cast<uintptr_t>(x) < base + 2 * MiB);
  ARENA_CHECK();
  // A slot of another size reuses the memory too (no new segment).
  void *y = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &y));
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_free(y));
  ARENA_CHECK();
  // empty_cache gives every empty slab back, then every free segment.
  EBB_REQUIRE_OK(ebb_arena_free(keep));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == 0);
  CHECK(st.segments.current == 0);
  CHECK(st.inactive_split.current == 0);
  CHECK(st.inactive_split_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: a slot used on another stream waits for its events", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *a = new_stream(0), *b = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &p));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, b));  // once is enough
  EBB_REQUIRE_OK(ebb_arena_record_stream(p, a));  // its own stream: nothing to record
  // Hold B busy with a host-blocked kernel so the event recorded at free stays incomplete.
  EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_arena_stats st = stats(0);
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.free_count == 1);
  // Active until B's event completes (it may already have: no work was queued on B).
  CHECK(st.active_bytes.current <= 4096);
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "already freed");
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, a, &q));  // polls the event: the slot is free again
  CHECK(q == p);
  CHECK(stats(0).active_bytes.current == 4096);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: bad frees of slot pointers are reported as for blocks", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr, *h = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8192, s, &p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8192, s, &q));
  char *pc = static_cast<char *>(p);
  EBB_CHECK_FAILS(ebb_arena_free(pc + 512), EBB_EINVAL, "is inside the block");
  EBB_CHECK_FAILS(ebb_arena_free(pc + 8191), EBB_EINVAL, "is inside the block");
  EBB_CHECK_FAILS(ebb_arena_record_stream(pc + 4096, s), EBB_EINVAL, "is inside the block");
  // A free slot of a live slab (never handed out): freed memory of the pool.
  EBB_CHECK_FAILS(ebb_arena_free(static_cast<char *>(q) + 8192), EBB_EFREED, "already freed");
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_arena_record_stream(p, s), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_arena_free(pc + 512), EBB_EFREED, "already freed");
  // Slots of another pool: a host slot given to ebb_arena_free and the other way round.
  EBB_REQUIRE_OK(ebb_pageable_alloc(100, &h));
  EBB_CHECK_FAILS(ebb_arena_free(h), EBB_EINVAL, "is a live block of the host pool");
  EBB_CHECK_FAILS(ebb_arena_free(static_cast<char *>(h) + 512), EBB_EINVAL, "belongs to the host pool");
  EBB_CHECK_FAILS(ebb_pageable_free(q), EBB_EINVAL, "is a live block of the device 0");
  EBB_CHECK_FAILS(ebb_arena_record_stream(h, s), EBB_EINVAL, "belongs to the host pool");
  int on_stack = 0;
  EBB_CHECK_FAILS(ebb_arena_free(&on_stack), EBB_EINVAL, "was not allocated by ebb_arena_alloc");
  require_all_checks();  // nothing above disturbed the pools
  CHECK(stats(0).allocated_bytes.current == 8192);
  EBB_REQUIRE_OK(ebb_pageable_free(h));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_CHECK_FAILS(ebb_pageable_free(h), EBB_EFREED, "already freed");
  require_all_checks();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: random slot and block traffic keeps stats equal to the walk", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *ss[2] = {default_stream(0), nullptr};
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[1]));
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> logsz(0.0, 18.0);  // 1 B .. 256 KiB: slots and blocks
  struct Live {
    void *p;
    size_t bytes;
  };
  std::vector<Live> live;
  uint64_t want_req = 0, want_alloc = 0;
  for (int op = 0; op < 6000; op++) {
    if (live.empty() || rng() % 100 < 55) {
      size_t bytes = static_cast<size_t>(std::exp2(logsz(rng)));
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, ss[rng() % 2], &p));
      live.push_back({p, bytes});
      want_req += bytes;
      want_alloc += (bytes + 511) / 512 * 512;
    } else {
      size_t i = rng() % live.size();
      EBB_REQUIRE_OK(ebb_arena_free(live[i].p));
      want_req -= live[i].bytes;
      want_alloc -= (live[i].bytes + 511) / 512 * 512;
      live[i] = live.back();
      live.pop_back();
    }
    if (op % 1000 == 999) {
      ARENA_CHECK();
      CHECK(stats(0).requested_bytes.current == want_req);
      CHECK(stats(0).allocated_bytes.current == want_alloc);
    }
  }
  std::set<void *> uniq;
  for (const Live &l : live) uniq.insert(l.p);
  CHECK(uniq.size() == live.size());
  for (const Live &l : live) EBB_REQUIRE_OK(ebb_arena_free(l.p));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_stream_release(ss[1]));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: the host and pinned pools serve small requests from slabs", "[alloc][slab]") {
  EbbSession session;
  std::vector<void *> v;
  for (size_t bytes : {64, 100, 512, 513, 4000, 65536}) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_pageable_alloc(bytes, &p));
    v.push_back(p);
  }
  ebb_arena_stats st{};
  EBB_REQUIRE_OK(ebb_pageable_get_stats(&st));
  CHECK(st.allocated_bytes.current == 512 + 512 + 512 + 1024 + 4096 + 65536);
  CHECK(st.requested_bytes.current == 64 + 100 + 512 + 513 + 4000 + 65536);
  CHECK(st.num_device_alloc == 1);  // one segment holds every slab
  // The host pool's memory is the caller's: writing every slot whole must not clobber another.
  for (size_t i = 0; i < v.size(); i++) std::memset(v[i], int(i + 1), i < 2 ? 64 : 512);
  void *first = v[0];
  EBB_REQUIRE_OK(ebb_pageable_free(first));
  void *again = nullptr;
  EBB_REQUIRE_OK(ebb_pageable_alloc(200, &again));
  CHECK(again == first);
  v[0] = again;
  for (void *p : v) EBB_REQUIRE_OK(ebb_pageable_free(p));
  void *pin = nullptr, *pin2 = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(4096, 0, &pin));
  EBB_REQUIRE_OK(ebb_pinned_free(pin));
  EBB_REQUIRE_OK(ebb_pinned_alloc(4000, 0, &pin2));
  CHECK(pin2 == pin);
  EBB_CHECK_FAILS(ebb_pageable_free(pin2), EBB_EINVAL, "pinned pool");
  EBB_REQUIRE_OK(ebb_pinned_free(pin2));
  require_all_checks();
  EBB_REQUIRE_OK(ebb_pageable_empty_cache());
  EBB_REQUIRE_OK(ebb_pinned_empty_cache());
  EBB_REQUIRE_OK(ebb_pageable_get_stats(&st));
  CHECK(st.reserved_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_pinned_get_stats(&st));
  CHECK(st.reserved_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("slab: 8 threads over 4 streams, freeing each other's slots", "[alloc][slab][threads]") {
  EbbSession session;
  ebb_stream_t *ss[4] = {};
  for (ebb_stream_t *&s : ss) EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  // Each thread allocates on its stream and hands every other slot to the next thread, which
  // frees it (a cross-thread free of another stream's slot) or records its own stream first.
  constexpr int kThreads = 8, kOps = 3000;
  std::vector<std::vector<void *>> handoff(kThreads);
  std::vector<std::mutex> mu(kThreads);
  std::vector<std::thread> th;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; t++)
    th.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      std::vector<void *> mine;
      ebb_stream_t *s = ss[t % 4];
      for (int op = 0; op < kOps; op++) {
        size_t bytes = 1 + rng() % (80 * 1024);  // slots and a few blocks
        void *p = nullptr;
        if (ebb_arena_alloc(0, bytes, s, &p) != EBB_OK) {
          failures++;
          continue;
        }
        if (op % 2) {
          std::lock_guard<std::mutex> g(mu[(t + 1) % kThreads]);
          handoff[(t + 1) % kThreads].push_back(p);
        } else {
          mine.push_back(p);
        }
        std::vector<void *> got;
        {
          std::lock_guard<std::mutex> g(mu[t]);
          got.swap(handoff[t]);
        }
        for (void *q : got) {
          if (rng() % 4 == 0 && ebb_arena_record_stream(q, s) != EBB_OK) failures++;
          if (ebb_arena_free(q) != EBB_OK) failures++;
        }
        if (mine.size() > 64) {
          size_t i = rng() % mine.size();
          if (ebb_arena_free(mine[i]) != EBB_OK) failures++;
          mine[i] = mine.back();
          mine.pop_back();
        }
      }
      for (void *q : mine)
        if (ebb_arena_free(q) != EBB_OK) failures++;
    });
  for (std::thread &x : th) x.join();
  // The walk with the last hand-offs still live: class lists keep partly used slabs ahead of
  // empty ones (a slab made with the lock dropped once landed behind empties, and the empty
  // cache then dropped it with live slots).
  ARENA_CHECK();
  for (auto &h : handoff)
    for (void *q : h) EBB_REQUIRE_OK(ebb_arena_free(q));
  CHECK(failures.load() == 0);
  for (ebb_stream_t *s : ss) EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  ARENA_CHECK();
  CHECK(stats(0).allocated_bytes.current == 0);
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  for (ebb_stream_t *s : ss) EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// One slot allocated and freed in turn in an otherwise free segment (a staging buffer, a scalar)
// must not make and drop its slab every time: the slab made right after its class's slab went
// back is sticky and stays cached until an allocation of anything else.
TEST_CASE("slab: a slot allocated and freed in turn keeps its slab until something else is allocated", "[alloc][slab]") {
  REQUIRE(slabs_on());
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr;
  // First round: the segment holds nothing else, so the emptied slab goes back at once.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  CHECK(stats(0).inactive_split.current == 0);
  ARENA_CHECK();
  // The next allocation is the same class at once: its new slab is sticky and stays cached.
  for (int i = 0; i < 5; i++) {
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &q));
    CHECK(q == p);
    EBB_REQUIRE_OK(ebb_arena_free(q));
    CHECK(stats(0).inactive_split.current == slab_slots(3072) + 1);  // its slots and the rest
    ARENA_CHECK();
  }
  // Anything else allocated gives the slab back first: the block starts the whole segment.
  void *blk = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 256 * KiB, s, &blk));
  CHECK(blk == p);
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(blk));
  CHECK(stats(0).inactive_split.current == 0);
  ARENA_CHECK();
  // A sticky slab's segment given back by empty_cache leaves nothing behind to give back later.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  CHECK(stats(0).inactive_split.current > 0);
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 256 * KiB, s, &blk));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &p));
  for (void *x : {blk, p}) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A cached empty slab must not pin a segment that holds nothing else: at the end of a training
// step that frees everything, slabs cached wherever they last emptied made the next step's
// blocks fit differently and grow the arena (perf/JOURNAL.md, the empty-slab cache).
TEST_CASE("slab: a segment left with only cached empty slabs is whole again", "[alloc][slab]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *slot = nullptr, *blk = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &slot));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 256 * KiB, s, &blk));
  CHECK(stats(0).segments.current == 1);
  // The slot's slab empties and stays cached: the block still uses the segment.
  EBB_REQUIRE_OK(ebb_arena_free(slot));
  CHECK(stats(0).inactive_split.current > 0);
  ARENA_CHECK();
  // The block goes: only the cached slab is left, so it goes back and the segment is whole.
  EBB_REQUIRE_OK(ebb_arena_free(blk));
  CHECK(stats(0).inactive_split.current == 0);
  CHECK(stats(0).inactive_split_bytes.current == 0);
  ARENA_CHECK();
  // The whole 2 MiB segment serves a 1 MiB block from its start, without the driver.
  void *big = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &big));
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(big));
  // The class's next slot carves a new slab: the cache did its work while the segment was used.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3000, s, &slot));
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(slot));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}
