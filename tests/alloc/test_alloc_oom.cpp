// Exhaustion on a small emulated device (EBB_SIM_MEM=256M): the release-and-retry chain, the
// EBB_ENOMEM report, and a process that carries on after it.
#include <random>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

// The setting this executable is about, also when it is run by hand; ctest's ENV (same value)
// takes precedence. Set before main, so before the driver's cuInit reads it.
static const bool kEnvSet = setenv("EBB_SIM_MEM", "256M", 0) == 0;

TEST_CASE("allocate until out of memory, read the report, free, allocate again", "[alloc][oom]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  std::vector<void *> live;
  ebb_status st = EBB_OK;
  std::string msg;
  for (int i = 0; i < 10; i++) {
    void *p = nullptr;
    ebb_clear_error();
    st = ebb_arena_alloc(0, 50 * MiB, s, &p);
    if (st != EBB_OK) {
      msg = ebb_last_error();
      break;
    }
    live.push_back(p);
  }
  REQUIRE(st == EBB_ENOMEM);
  CHECK(live.size() == 5);
  INFO(msg);
  CHECK(msg.find("ebb_arena_alloc: device 0 out of memory: requested 50.00 MiB (rounded 50.00 MiB) on stream ") != std::string::npos);
  CHECK(msg.find("capacity 256.00 MiB") != std::string::npos);
  CHECK(msg.find("reserved 250.00 MiB, allocated 250.00 MiB") != std::string::npos);
  CHECK(msg.find("driver free ") != std::string::npos);
  CHECK(msg.find("largest free block 0 B") != std::string::npos);
  ebb_arena_stats stt = stats(0);
  CHECK(stt.num_ooms == 1);
  CHECK(stt.num_alloc_retries == 1);
  ARENA_CHECK();
  // The process continues: a freed block serves the next request from the cache.
  EBB_REQUIRE_OK(ebb_arena_free(live.back()));
  live.pop_back();
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 50 * MiB, s, &p));
  live.push_back(p);
  // Two cached 50 MiB segments cannot serve 100 MiB; the retry chain gives them back first.
  for (int i = 0; i < 2; i++) {
    EBB_REQUIRE_OK(ebb_arena_free(live.back()));
    live.pop_back();
  }
  uint64_t frees = stats(0).num_device_free;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 100 * MiB, s, &p));
  live.push_back(p);
  stt = stats(0);
  CHECK(stt.num_alloc_retries == 2);
  CHECK(stt.num_ooms == 1);
  CHECK(stt.num_device_free == frees + 2);
  CHECK(stt.reserved_bytes.current == 250 * MiB);
  ARENA_CHECK();
  // A hopeless request fails cleanly and names its size.
  EBB_CHECK_FAILS(ebb_arena_alloc(0, size_t(1) << 40, s, &p), EBB_ENOMEM, "requested 1.00 TiB");
  // Past 2 TiB the free index's 512-byte units saturate: the search walks the blocks' own sizes.
  EBB_CHECK_FAILS(ebb_arena_alloc(0, size_t(3) << 40, s, &p), EBB_ENOMEM, "requested 3.00 TiB");
  ARENA_CHECK();
  for (void *x : live) EBB_REQUIRE_OK(ebb_arena_free(x));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("out of memory on one device leaves the other untouched", "[alloc][oom]") {
  EbbSession session;
  void *p = nullptr, *q = nullptr;
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 300 * MiB, nullptr, &p), EBB_ENOMEM, "device 0 out of memory");
  EBB_REQUIRE_OK(ebb_arena_alloc(1, 200 * MiB, nullptr, &q));
  CHECK(stats(0).num_ooms == 1);
  CHECK(stats(1).num_ooms == 0);
  EBB_REQUIRE_OK(ebb_arena_free(q));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The retry chain gives cached empty slabs back to the engine, where their blocks merge into
// this stream's free index: the request must be searched for there again before the chain goes
// on to grow (here against a limit at the reserved bytes, standing in for a full device).
TEST_CASE("out of memory: the retry chain reuses what the empty slabs it gave back leave free", "[alloc][oom]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  std::vector<void *> slots;
  for (int i = 0; i < 8; i++) { // eight size classes: eight slabs of two slots, 1 MiB in all
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 64 * KiB - i * 512, s, &p));
    slots.push_back(p);
  }
  void *x = nullptr, *y = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 700 * KiB, s, &x)); // keeps the 2 MiB segment in use
  for (void *p : slots) EBB_REQUIRE_OK(ebb_arena_free(p)); // the slabs stay cached, empty
  ebb_arena_stats before = stats(0);
  REQUIRE(before.reserved_bytes.current == 2 * MiB);
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, before.reserved_bytes.current));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 900 * KiB, s, &y));
  ebb_arena_stats after = stats(0);
  CHECK(after.num_ooms == before.num_ooms);
  CHECK(after.reserved_bytes.current == 2 * MiB);
  CHECK(after.num_device_alloc == before.num_device_alloc);
  ARENA_CHECK();
  EBB_REQUIRE_OK(ebb_arena_free(x));
  EBB_REQUIRE_OK(ebb_arena_free(y));
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}
