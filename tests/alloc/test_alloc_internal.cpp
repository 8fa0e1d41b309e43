// White-box tests of the arena engine (alloc/) through hooks the library keeps hidden (the tests
// link it statically, so they can reach them) and chunk_refusal.c's failing chunk memory.
#include "alloc_test_util.hpp"

using namespace alloc_test;

// While n > 0, the free index's next n node chunks are refused as if host memory had run out
// (chunk_refusal.c).
extern "C" void ebb_test_refuse_fidx_chunks(int n);

// Out of host memory for its nodes, the index keeps blocks in its list, searched by the same
// rules: the same answers, first from the list alone, then from the list and the tree.
TEST_CASE("internal: the free index keeps its placement rules when its tree gets no node memory", "[alloc][internal]") {
  EbbSession session;
  check_fit_model(ebb_test_refuse_fidx_chunks, 2000);
}

extern "C" void ebb__arena_debug_counts(int device, size_t *nspools, size_t *nevqs);

// A program that makes a stream per step, uses it (a slot and blocks on it, one of them freed
// only after the stream's release; another stream's block recorded on it) and releases it: the arena's per-stream state (its free index and slab lists, its
// queue of pending frees) must not grow with the streams it has ever seen, and every step's
// memory is reused by the next stream.
TEST_CASE("internal: streams made and released step after step leave no per-stream state behind", "[alloc][internal]") {
  EbbSession session;
  ebb_stream_t *side = new_stream(0);
  size_t max_spools = 0, max_evqs = 0;
  uint64_t drv0 = 0;
  const int steps = 3000;
  void *kept = nullptr; // a block of the previous step's stream, freed after that stream's release
  for (int i = 0; i < steps; i++) {
    ebb_stream_t *s = new_stream(0);
    if (i % 500 == 1) ARENA_CHECK(); // the released stream's pool must still be there for `kept`
    if (kept) EBB_REQUIRE_OK(ebb_arena_free(kept));
    void *slot = nullptr, *blk = nullptr, *used = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 4 * KiB, s, &slot));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &blk));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 2 * MiB, side, &used));
    EBB_REQUIRE_OK(ebb_arena_record_stream(used, s)); // its free waits on s: a queue for s
    EBB_REQUIRE_OK(ebb_arena_free(slot));
    EBB_REQUIRE_OK(ebb_arena_free(blk));
    EBB_REQUIRE_OK(ebb_arena_free(used));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &kept));
    EBB_REQUIRE_OK(ebb_stream_release(s));
    size_t ns = 0, nq = 0;
    ebb__arena_debug_counts(0, &ns, &nq);
    max_spools = std::max(max_spools, ns);
    max_evqs = std::max(max_evqs, nq);
    if (i == 10) drv0 = stats(0).num_device_alloc;
  }
  INFO("most spools " << max_spools << ", most pending queues " << max_evqs << " over " << steps << " streams");
  CHECK(max_spools <= 16);
  CHECK(max_evqs <= 16);
  CHECK(stats(0).num_device_alloc == drv0); // each step's memory serves the next stream
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(kept));
  // A released stream whose only memory is a live block: its pool (nothing free in it) must
  // stay while the block lives, through the next stream's first allocation, which reaps.
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ebb_stream_t *t = new_stream(0), *u = new_stream(0);
  void *k = nullptr, *x = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, t, &k)); // a segment of exactly 12 MiB: no remainder
  EBB_REQUIRE_OK(ebb_stream_release(t));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, u, &x));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(k)); // back into t's pool, for other streams to steal
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_stream_release(u));
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_stream_release(side));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}
