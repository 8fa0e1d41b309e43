// Expandable segments (EBB_ALLOC_CONF=expandable_segments:1): one VMM reservation per device,
// grown by mapping granules at its end and shrunk by empty_cache.
#include <random>
#include <string>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

// The setting this executable is about, also when it is run by hand; ctest's ENV (same value)
// takes precedence. Set before main, so before the driver's cuInit reads it.
static const bool kEnvSet = setenv("EBB_ALLOC_CONF", "expandable_segments:1", 0) == 0;

TEST_CASE("expandable segments grow in place and shrink on empty_cache", "[alloc][expandable]") {
  EbbSession session;
  ebb_dev_caps caps{};
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.vmm) EBB_SKIP("driver without VMM");
  ebb_stream_t *s = default_stream(0);
  size_t free0 = 0, total = 0, free1 = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &free0, &total));
  void *a = nullptr, *b = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 5 * MiB, s, &a));
  CHECK(stats(0).reserved_bytes.current == 20 * MiB);
  CHECK(stats(0).segments.current == 1);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 30 * MiB, s, &b));  // grows the same segment
  CHECK(reinterpret_cast<uintptr_t>(b) == reinterpret_cast<uintptr_t>(a) + 5 * MiB);
  CHECK(stats(0).segments.current == 1);
  CHECK(stats(0).reserved_bytes.current == 40 * MiB);  // 15 MiB free tail + 15 MiB more, in 20 MiB
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, s, &c));      // small requests share the reservation
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(b));
  EBB_REQUIRE_OK(ebb_arena_free(c));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));  // the tail behind `a` is unmapped
  ebb_arena_stats st = stats(0);
  CHECK(st.reserved_bytes.current < 20 * MiB);
  CHECK(st.reserved_bytes.current >= 5 * MiB);
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
  ebb_dev_caps caps{};
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.vmm) EBB_SKIP("driver without VMM");
  size_t gran = 0;
  EBB_REQUIRE_OK(ebb_drv_vmm_granularity(0, &gran));
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

// As in test_alloc_api: a repeated sequence settles after one pass. With best fit (before
// 2026-11-23) the second pass of seeds 3, 5, 6 and 8 mapped 1 to 11 granules more.
TEST_CASE("expandable segments: a repeated random sequence maps nothing after its first pass", "[alloc][expandable]") {
  EbbSession session;
  ebb_dev_caps caps{};
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.vmm) EBB_SKIP("driver without VMM");
  check_settles_after_one_pass(default_stream(0));
}
