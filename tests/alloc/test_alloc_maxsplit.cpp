// The device arena with max_split_size_mb:64 (EBB_ALLOC_CONF, set by CMake): blocks of 64 MiB
// or more are never split, serve oversize requests within the 20 MiB slack, and serve a smaller
// request only when they are no larger than the segment that request would get.
#include "alloc_test_util.hpp"

using namespace alloc_test;

TEST_CASE("max_split: an oversize block is reused whole within the slack, never split", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 80 * MiB, s, &p));
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  // 66 MiB is oversize and 80 < 66 + 20: the whole 80 MiB block, not split.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 66 * MiB, s, &q));
  CHECK(q == p);
  CHECK(stats(0).allocated_bytes.current == 80 * MiB);
  CHECK(stats(0).num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  // 40 MiB is not oversize and would get a 40 MiB segment: the 80 MiB block is not for it.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 40 * MiB, s, &r));
  CHECK(r != p);
  CHECK(stats(0).num_device_alloc == 2);
  EBB_REQUIRE_OK(ebb_arena_free(r));
  // 100 MiB is oversize, but 80 MiB is too small.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * MiB, s, &r));
  CHECK(stats(0).num_device_alloc == 3);
  EBB_REQUIRE_OK(ebb_arena_free(r));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A request just below max_split gets a segment rounded up to 2 MiB, which is max_split itself:
// an oversize block. That block must serve the same request again, or every such request grows
// the arena (the arena bench's tensor sequence with max_split_size_mb:64 made ~500 driver
// allocations per replay and reserved 64 GiB before the OOM retry gave them back).
TEST_CASE("max_split: a request just below it reuses the oversize segment it got", "[alloc]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *first = nullptr;
  for (int i = 0; i < 8; i++) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 63 * MiB + 512, s, &p));
    if (!first) first = p;
    CHECK(p == first);
    CHECK(stats(0).allocated_bytes.current == 64 * MiB);  // the whole segment: not split
    EBB_REQUIRE_OK(ebb_arena_free(p));
  }
  CHECK(stats(0).num_device_alloc == 1);
  CHECK(stats(0).reserved_bytes.current == 64 * MiB);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}
