// Expandable segments (EBB_ALLOC_CONF=expandable_segments:1): one VMM reservation per device,
// grown by mapping granules at its end and shrunk by empty_cache.
#include <random>
#include <string>
#include <vector>

#include "alloc_test_util.hpp"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "sim_fault_env.hpp"

using namespace alloc_test;

// The setting this executable is about, also when it is run by hand; ctest's ENV (same value)
// takes precedence. Set before main, so before the driver's cuInit reads it.
static const bool kEnvSet = setenv("EBB_ALLOC_CONF", "expandable_segments:1", 0) == 0;

// Skips the test case on a driver without VMM (no expandable segments there).
#define EBB_NEED_VMM()                                \
  do {                                                \
    ebb_dev_caps caps_{};                             \
    EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps_));      \
    if (!caps_.vmm) EBB_SKIP("driver without VMM");   \
  } while (0)

TEST_CASE("expandable segments grow in place and shrink on empty_cache", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  size_t free0 = 0, total = 0, free1 = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free0, &total));
  void *a = nullptr, *b = nullptr, *c = nullptr;
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &gran));
  REQUIRE(gran == 2 * MiB); // the figures below count 2 MiB granules
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &a));
  CHECK(stats(0).reserved_bytes.current == 6 * MiB); // the granules the request needs, no more
  CHECK(stats(0).segments.current == 1);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 30 * MiB, s, &b));  // grows the same segment
  CHECK(reinterpret_cast<uintptr_t>(b) == reinterpret_cast<uintptr_t>(a) + 5 * MiB);
  CHECK(stats(0).segments.current == 1);
  CHECK(stats(0).reserved_bytes.current == 36 * MiB);  // the 1 MiB free tail + 29 MiB, in granules
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, s, &c));      // small requests share the reservation
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(b));
  EBB_REQUIRE_OK(ebb_arena_free(c));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // the tail behind `a` is unmapped
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == 6 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(a));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  CHECK(stats(0).segments.current == 0);
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free1, &total));
  CHECK(free1 == free0);
  // And it grows again from the start of the reservation.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &b));
  CHECK(b == a);
  EBB_REQUIRE_OK(ebb_arena_free(b));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// An expandable segment has one pool for every size: the memory a training step's 1 MiB
// activations freed serves its 4 MiB optimizer state, and the other way round, with no growth.
// (With a small and a large pool in the one reservation, each grew for its own requests.)
TEST_CASE("expandable segments: memory freed by small blocks serves large ones and back", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  std::vector<void *> act(8);
  for (void *&p : act) EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &p));
  void *w = nullptr; // a large block after them: the freed range is not the segment's tail
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &w));
  for (void *p : act) EBB_REQUIRE_OK(ebb_arena_free(p));
  const ebb_arena_stats before = stats(0);
  void *st1 = nullptr, *st2 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &st1));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &st2));
  CHECK(st1 == act[0]);
  CHECK(reinterpret_cast<uintptr_t>(st2) == reinterpret_cast<uintptr_t>(act[0]) + 4 * MiB);
  CHECK(stats(0).reserved_bytes.current == before.reserved_bytes.current);
  CHECK(stats(0).num_device_alloc == before.num_device_alloc);
  ARENA_CHECK();
  // And what the large blocks free serves small requests.
  EBB_REQUIRE_OK(ebb_arena_free(st1));
  EBB_REQUIRE_OK(ebb_arena_free(st2));
  for (void *&p : act) EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &p));
  CHECK(act[0] == st1);
  CHECK(stats(0).reserved_bytes.current == before.reserved_bytes.current);
  CHECK(stats(0).num_device_alloc == before.num_device_alloc);
  for (void *p : act) EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_free(w));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// In the one expandable segment a request takes the smallest free block that holds it, so a
// 1 MiB request takes a 1.5 MiB hole before a lower 4 MiB block; the free tail, though smaller,
// comes last, so growth extends it (arena_impl.h, "free index"). (Plain oldest fit gave the
// first two requests the 4 MiB block.)
TEST_CASE("expandable segments: holes below 2 MiB first, the tail last", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  // [a 4 | g1 1 | h 1.5 | g2 1 | tail 0.5 free]: 8 MiB mapped; then a and h freed.
  void *a = nullptr, *g1 = nullptr, *h = nullptr, *g2 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &a));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &g1));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB / 2, s, &h));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &g2));
  REQUIRE(reinterpret_cast<uintptr_t>(h) == reinterpret_cast<uintptr_t>(a) + 5 * MiB); // the layout
  REQUIRE(stats(0).reserved_bytes.current == 8 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(a));
  EBB_REQUIRE_OK(ebb_arena_free(h));
  ARENA_CHECK();
  const uintptr_t uh = reinterpret_cast<uintptr_t>(h), ua = reinterpret_cast<uintptr_t>(a);
  void *x = nullptr, *y = nullptr, *z = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &x));     // the 1.5 MiB hole, not a
  CHECK(reinterpret_cast<uintptr_t>(x) == uh);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &y));     // what the hole left (0.5 MiB), not a
  CHECK(reinterpret_cast<uintptr_t>(y) == uh + 1 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &z));     // no hole left but the tail: a
  CHECK(reinterpret_cast<uintptr_t>(z) == ua);
  CHECK(stats(0).reserved_bytes.current == 8 * MiB);
  ARENA_CHECK();
  for (void *q : {g1, g2, x, y, z}) EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Best fit in an expandable segment: of two free blocks that hold a request, the smaller, the
// lower address on a tie, whatever their order; the tail last. Oldest fit (the classic
// segments' rule 2) gave the 3 MiB request the 6 MiB block at the start, and the 5 MiB request
// that followed, fitting nowhere then, mapped two more granules.
TEST_CASE("expandable segments: best fit, the lower address on a tie, the tail last", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &gran));
  REQUIRE(gran == 2 * MiB); // the layout below counts 2 MiB granules
  ebb_stream_t *s = default_stream(0);
  // [a 6 | g1 1 | b 3 | g2 1 | c 3 | g3 1 | tail 1 free]: 16 MiB mapped; then a, b and c freed.
  void *a = nullptr, *g1 = nullptr, *b = nullptr, *g2 = nullptr, *c = nullptr, *g3 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 6 * MiB, s, &a));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &g1));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &b));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &g2));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &c));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &g3));
  const uintptr_t ua = reinterpret_cast<uintptr_t>(a);
  REQUIRE(reinterpret_cast<uintptr_t>(b) == ua + 7 * MiB); // the layout
  REQUIRE(reinterpret_cast<uintptr_t>(c) == ua + 11 * MiB);
  REQUIRE(stats(0).reserved_bytes.current == 16 * MiB);
  for (void *q : {a, b, c}) EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  void *x = nullptr, *y = nullptr, *z = nullptr, *w = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &x)); // b and c fit exactly: b, the lower
  CHECK(x == b);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &y)); // only a holds it
  CHECK(y == a);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &z)); // a's 1 MiB left, not c, not the 1 MiB tail
  CHECK(reinterpret_cast<uintptr_t>(z) == ua + 5 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &w)); // c, before the smaller tail
  CHECK(w == c);
  CHECK(stats(0).reserved_bytes.current == 16 * MiB);
  ARENA_CHECK();
  for (void *q : {g1, g2, g3, x, y, z, w}) EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// empty_cache cuts the segment's end back over a hole an earlier one left: the free block in
// front of the hole ends the segment then, and becomes the index's tail (served last, extended
// by the next growth).
TEST_CASE("expandable segments: a free block left at the end by empty_cache is the tail", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &gran));
  REQUIRE(gran == 2 * MiB);
  ebb_stream_t *s = default_stream(0);
  void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr, *e = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &a)); // [0, 1)
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &b)); // [1, 5)
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &c)); // [5, 6): 6 MiB mapped, nothing free
  const uintptr_t ua = reinterpret_cast<uintptr_t>(a);
  REQUIRE(reinterpret_cast<uintptr_t>(c) == ua + 5 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(b));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0)); // [1, 2) free, [2, 4) a hole, [4, 5) free
  CHECK(stats(0).reserved_bytes.current == 4 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(c));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0)); // [4, 6) cut, then the hole: [1, 2) ends the segment
  CHECK(stats(0).reserved_bytes.current == 2 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &d)); // the tail, the one free block
  CHECK(reinterpret_cast<uintptr_t>(d) == ua + 1 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &e)); // grows the tail in place
  CHECK(reinterpret_cast<uintptr_t>(e) == ua + 3 * MiB / 2);
  ARENA_CHECK();
  for (void *q : {a, d, e}) EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("expandable segments: random sequences keep the invariants", "[alloc][expandable]") {
  EbbSession session;
  ebb_stream_t *ss[2] = {default_stream(0), pool_stream(0)};
  std::mt19937 rng(7);
  std::vector<void *> live;
  for (int op = 0; op < 4000; op++) {
    if (live.empty() || rng() % 100 < 55) {
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_arena_alloc(0, static_cast<size_t>(std::exp2(9.0 + (rng() % 1500) / 100.0)), ss[rng() % 2], &p));
      live.push_back(p);
    } else {
      size_t i = rng() % live.size();
      EBB_REQUIRE_OK(ebb_arena_free(live[i]));
      live[i] = live.back();
      live.pop_back();
    }
    if (op % 200 == 0) ARENA_CHECK();
    if (op % 100 == 0) {  // frequent empty_cache: holes open and are refilled all along
      EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
      ARENA_CHECK();
    }
  }
  for (void *p : live) EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  CHECK(stats(0).allocated_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("expandable segments: empty_cache unmaps free granules inside the segment, growth maps them again",
          "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &gran));
  REQUIRE(gran <= 2 * MiB);
  ebb_stream_t *s = default_stream(0);
  void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 20 * MiB, s, &a));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 40 * MiB, s, &b));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &c));
  CHECK(reinterpret_cast<uintptr_t>(b) == reinterpret_cast<uintptr_t>(a) + 20 * MiB);
  CHECK(reinterpret_cast<uintptr_t>(c) == reinterpret_cast<uintptr_t>(b) + 40 * MiB);
  size_t free0 = 0, free1 = 0, total = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free0, &total));
  const uint64_t res0 = stats(0).reserved_bytes.current;
  EBB_REQUIRE_OK(ebb_arena_free(b));  // a hole between two live blocks: the tail cannot reach it
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  ebb_arena_stats st = stats(0);
  CHECK(res0 - st.reserved_bytes.current >= 40 * MiB);  // b's granules went back to the driver
  CHECK(st.segments.current == 1);
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free1, &total));
  CHECK(free1 - free0 == res0 - st.reserved_bytes.current);
  // The next growth maps the hole from its start instead of growing the tail.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 30 * MiB, s, &d));
  CHECK(d == b);
  CHECK(stats(0).reserved_bytes.current == st.reserved_bytes.current + 30 * MiB);
  ARENA_CHECK();
  // A snapshot leaves the remaining hole out of its segment.
  std::string path = std::string(EBB_X_TMPDIR) + "/expandable_snapshot.json";
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  for (void *x : {a, c, d}) EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  CHECK(stats(0).segments.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// As in test_alloc_api: a repeated sequence settles after one pass (eight seeds), under best
// fit in bins as under the classic segments' rules.
TEST_CASE("expandable segments: a repeated random sequence maps nothing after its first pass", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  check_settles_after_one_pass(default_stream(0));
}

// Free blocks merge only within one stream, so with several streams a granule can lie across
// free pieces of two of them. After its wait for the device, empty_cache joins such pieces and
// unmaps the granules: everything free and synchronised leaves nothing reserved.
TEST_CASE("expandable segments: empty_cache unmaps granules that free blocks of several streams share",
          "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s[2] = {new_stream(0), new_stream(0)};
  void *p1 = nullptr, *p2 = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s[0], &p1));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s[1], &p2)); // takes stream 0's free remainder
  CHECK(stats(0).num_steals == 1);
  EBB_REQUIRE_OK(ebb_arena_free(p1));
  EBB_REQUIRE_OK(ebb_arena_free(p2));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  CHECK(stats(0).reserved_bytes.current == 0);
  // Sixteen blocks of 1.5 MiB on alternating streams: free pieces of two owners across granules.
  std::vector<void *> live(16);
  for (size_t i = 0; i < live.size(); i++) EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB / 2, s[i & 1], &live[i]));
  for (void *p : live) EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current == 0);
  CHECK(st.allocated_bytes.current == 0);
  // And the joined memory serves either stream again.
  void *big = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 20 * MiB, s[1], &big));
  EBB_REQUIRE_OK(ebb_arena_free(big));
  ARENA_CHECK();
  for (ebb_stream_t *x : s) EBB_REQUIRE_OK(ebb_stream_release(x));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// An expandable segment keeps no empty slab: its block goes back to the engine as the slab
// empties and merges with its free neighbours, here the free tail, so the next request takes
// those bytes and maps only what it lacks, with no retry chain. (Kept one a class, the 32 empty
// slabs held 4 MiB between the block and the tail, and the request below needed the retry chain
// to unmap them; classic segments still keep one, which their retry chain gives back:
// test_alloc_oom.)
TEST_CASE("expandable segments: an empty slab goes back at once, and its bytes serve the next request",
          "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  void *x = nullptr, *y = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &x));
  std::vector<void *> slots;
  for (int i = 0; i < 32; i++) { // 32 size classes: 32 slabs
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * KiB - i * 512, s, &p));
    slots.push_back(p);
  }
  CHECK(stats(0).inactive_split.current > 0); // the slabs' other slots
  for (void *p : slots) EBB_REQUIRE_OK(ebb_arena_free(p));
  ebb_arena_stats before = stats(0);
  CHECK(before.inactive_split.current == 0); // no slab left, so no free slot
  CHECK(before.inactive_split_bytes.current == 0);
  size_t reserved = before.reserved_bytes.current;
  REQUIRE(reserved >= 4 * MiB);
  ARENA_CHECK();
  // A limit 2 MiB short of the request on top of what is reserved: growth fits under it only
  // when the request takes the free bytes the slabs left.
  const size_t want = 24 * MiB;
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, reserved + want - 2 * MiB));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, want, s, &y));
  ebb_arena_stats after = stats(0);
  CHECK(after.num_ooms == before.num_ooms);
  CHECK(after.num_alloc_retries == before.num_alloc_retries);
  CHECK(after.num_device_free == before.num_device_free); // nothing unmapped
  CHECK(reinterpret_cast<uintptr_t>(y) == reinterpret_cast<uintptr_t>(x) + 1 * MiB);
  CHECK(after.reserved_bytes.current <= reserved + want - 2 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_free(y));
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// fault_probe.c: the next n cuCtxSynchronize calls fail (white-box, through the driver table).
extern "C" void ebb_test_fail_ctx_sync(int n);

// The device wait before unmapping granules is not ignored: when it fails, nothing is unmapped
// (work may still run in that memory) and the caller gets the driver's failure, from
// empty_cache and from the OOM retry chain alike.
TEST_CASE("a failed device wait before unmapping is reported and nothing is unmapped", "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0), *t = new_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 30 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  const uint64_t reserved = stats(0).reserved_bytes.current, unmaps = stats(0).num_device_free;
  REQUIRE(reserved >= 30 * MiB);
  // empty_cache.
  ebb_test_fail_ctx_sync(1);
  EBB_CHECK_FAILS(ebb_arena_empty_cache(0), EBB_EDRIVER, "ebb_arena_empty_cache: device 0: the device synchronisation before unmapping");
  ebb_test_fail_ctx_sync(1);
  EBB_CHECK_FAILS(ebb_arena_empty_cache(0), EBB_EDRIVER, "CUDA_ERROR_UNKNOWN");
  CHECK(stats(0).reserved_bytes.current == reserved);
  CHECK(stats(0).num_device_free == unmaps);
  ARENA_CHECK();
  // The OOM retry chain: a request past the limit on another stream would unmap the cached
  // granules and grow again; with the wait failing it stops there, the cache untouched.
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, reserved));
  ebb_test_fail_ctx_sync(1);
  EBB_CHECK_FAILS(ebb_arena_alloc(0, reserved + 10 * MiB, t, &q), EBB_EDRIVER,
                  "ebb_arena_alloc: device 0: the device synchronisation before unmapping");
  CHECK(stats(0).reserved_bytes.current == reserved);
  CHECK(stats(0).num_device_free == unmaps);
  CHECK(stats(0).num_ooms == 0);
  ARENA_CHECK();
  // The driver well again: both work as before.
  EBB_CHECK_FAILS(ebb_arena_alloc(0, reserved + 10 * MiB, t, &q), EBB_ENOMEM, "out of memory");
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(t));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// While n > 0, the free index's next n node chunks are refused as if host memory had run out
// (chunk_refusal.c, linked in place of the library's chunk memory).
extern "C" void ebb_test_refuse_fidx_chunks(int n);

// A free block that takes in the free block after it, the segment's last, ends the segment: it
// is the index's tail from then on, served last, not by best fit as the smaller of two holes
// (arena_impl.h, "free index"). The index's node chunks are refused throughout, as they once
// sent such blocks to a list: an expandable segment's bins need none.
TEST_CASE("expandable segments: a free block that merges with the free tail becomes the tail",
          "[alloc][expandable]") {
  EbbSession session;
  EBB_NEED_VMM();
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &gran));
  REQUIRE(gran == 2 * MiB); // the layout below counts 2 MiB granules
  ebb_stream_t *s = default_stream(0);
  ebb_test_refuse_fidx_chunks(INT_MAX); // no tree node for the fresh arena: the bins need none
  void *z = nullptr, *a = nullptr, *b = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * MiB, s, &z));   // [z 4]
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &a));   // [z 4 | a 1 | tail 1]
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &b));   // [z 4 | a 1 | b 0.5 | tail 0.5]
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &c));   // [z 4 | a 1 | b 0.5 | c 0.5]
  const uintptr_t uz = reinterpret_cast<uintptr_t>(z);
  REQUIRE(reinterpret_cast<uintptr_t>(c) == uz + 5 * MiB + MiB / 2);
  REQUIRE(stats(0).reserved_bytes.current == 6 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(z)); // a bin
  EBB_REQUIRE_OK(ebb_arena_free(b)); // a bin
  EBB_REQUIRE_OK(ebb_arena_free(c)); // merges into b, which ends the segment now: the tail
  ebb_status st = ebb_arena_debug_check(0);
  INFO(ebb_last_error());
  CHECK(st == EBB_OK);
  // A request below 2 MiB: no free block but z and the tail, so z, the tail last.
  void *x = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, MiB / 2, s, &x));
  CHECK(x == z);
  ebb_test_refuse_fidx_chunks(0);
  ARENA_CHECK();
  for (void *q : {a, x}) EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// chunk_refusal.c: refuse new slabs of block records, and hold a device arena's spare records
// aside (so the next record asked for needs a new slab).
extern "C" void ebb_test_refuse_block_slabs(int n);
extern "C" void ebb_test_hold_block_records(int device, bool hold);

TEST_CASE("expandable segments: growth that can get no block record (no host memory) maps nothing and leaves the arena whole",
          "[alloc][expandable][oom]") {
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  void *a = nullptr, *b = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 2 * MiB, s, &a));  // the whole first granule: no free tail
  size_t reserved = stats(0).reserved_bytes.current;
  REQUIRE(reserved == 2 * MiB);
  ebb_test_hold_block_records(0, true);
  ebb_test_refuse_block_slabs(1 << 20);
  ebb_status st = ebb_arena_alloc(0, 2 * MiB, s, &b);  // growth needs a record for its new tail block
  ebb_test_refuse_block_slabs(0);
  ebb_test_hold_block_records(0, false);
  INFO("ebb_arena_alloc: " << ebb_last_error());
  CHECK(st == EBB_ENOMEM);
  CHECK(b == nullptr);
  ARENA_CHECK();  // every mapped byte is covered by a block
  CHECK(stats(0).reserved_bytes.current == reserved);
  // And the arena goes on: growth works once records can be had, and everything goes back.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 2 * MiB, s, &b));
  CHECK(reinterpret_cast<uintptr_t>(b) == reinterpret_cast<uintptr_t>(a) + 2 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(a));
  EBB_REQUIRE_OK(ebb_arena_free(b));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
}

// A granule whose unmap fails is still mapped: its handle is kept (released, the range would stay
// mapped to memory nobody tracks, and the next growth there would fail), empty_cache says which
// call failed, and the next growth takes the granule as it is. The fault comes from the emulated
// driver (the first cuMemUnmap of the process): a process of its own, as ctest gives it.
TEST_CASE("a granule that fails to unmap stays mapped and is taken again by growth", "[alloc][expandable][fault]") {
  if (!faults_for_this_process("cuMemUnmap:1:CUDA_ERROR_UNKNOWN")) return;
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  const uint64_t mapped0 = stats(0).num_device_alloc;
  EBB_CHECK_MSG(ebb_arena_empty_cache(0), EBB_EDRIVER, "ebb_arena_empty_cache", "failed unmap keeps the granule", "cuMemUnmap");
  ARENA_CHECK();
  // The stuck granule is still the device's memory: reserved counts it (what the limit and an
  // OOM depend on), and the growth that takes it back maps one granule fewer.
  const ebb_arena_stats after = stats(0);
  CHECK(after.reserved_bytes.current == 2 * MiB);
  CHECK(after.num_device_free == mapped0 - 1);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  ARENA_CHECK();
  CHECK(stats(0).reserved_bytes.current == 8 * MiB);
  CHECK(stats(0).num_device_alloc == 2 * mapped0 - 1);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The OOM retry chain gives granules back too, and reports nothing (its allocation succeeds): a
// release that fails there is reported by the next empty_cache, never forgotten.
TEST_CASE("a physical chunk that fails to be released in the OOM retry chain is reported by the next empty_cache",
          "[alloc][expandable][fault]") {
  if (!faults_for_this_process("cuMemRelease:1:CUDA_ERROR_UNKNOWN")) return;
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s1 = new_stream(0), *s2 = new_stream(0);
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 16 * MiB));
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s1, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  const uint64_t r0 = stats(0).num_alloc_retries;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s2, &q));  // 8 + 12 > 16: the retry chain gives s1's 8 MiB back
  CHECK(stats(0).num_alloc_retries == r0 + 1);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_CHECK_MSG(ebb_arena_empty_cache(0), EBB_EDRIVER, "ebb_arena_empty_cache", "leaks", "cuMemRelease");
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // reported once
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(s1));
  EBB_REQUIRE_OK(ebb_stream_release(s2));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Once a granule is unmapped its range is free; a physical chunk that then fails to be
// released leaks, and empty_cache says so rather than dropping the driver's failure.
TEST_CASE("a physical chunk that fails to be released after its unmap is reported", "[alloc][expandable][fault]") {
  if (!faults_for_this_process("cuMemRelease:1:CUDA_ERROR_UNKNOWN")) return;
  EbbSession session;
  EBB_NEED_VMM();
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_CHECK_MSG(ebb_arena_empty_cache(0), EBB_EDRIVER, "ebb_arena_empty_cache", "leaks", "cuMemRelease");
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 8 * MiB, s, &p));
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}
