// The device arena with max_split_size_mb:64 (EBB_ALLOC_CONF, set by CMake): blocks of 64 MiB
// or more are never split, serve oversize requests within the 20 MiB slack, and serve a smaller
// request only when they are no larger than the segment that request would get. Built twice: the
// second executable adds expandable_segments:1, where the setting has no effect.
#include "alloc_test_util.hpp"

using namespace alloc_test;

static bool expandable() {
  const char *c = std::getenv("EBB_ALLOC_CONF");
  return c && std::string(c).find("expandable_segments:1") != std::string::npos;
}

TEST_CASE("max_split: an oversize block is reused whole within the slack, never split", "[alloc]") {
  if (expandable()) return;  // classic segments only: see the last case
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
  if (expandable()) return;
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

// An expandable segment's blocks are always split and its free blocks merge far above
// max_split: kept from smaller requests, they made the arena map granule after granule
// (multistream.trace: frag_ratio 1.703). With expandable segments the setting has no effect.
TEST_CASE("max_split: no effect with expandable segments, whose free blocks serve any request", "[alloc]") {
  if (!expandable()) return;  // the classic cases above
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * MiB, s, &p));
  uint64_t mapped = stats(0).num_device_alloc;
  EBB_REQUIRE_OK(ebb_arena_free(p));
  // The 100 MiB free block serves 10 MiB, then 80 MiB, split: nothing more is mapped.
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 10 * MiB, s, &q));
  CHECK(q == p);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 80 * MiB, s, &r));
  CHECK(reinterpret_cast<uintptr_t>(r) == reinterpret_cast<uintptr_t>(p) + 10 * MiB);
  CHECK(stats(0).num_device_alloc == mapped);
  CHECK(stats(0).allocated_bytes.current == 90 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_free(r));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}
