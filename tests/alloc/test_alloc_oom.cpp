// Exhaustion on a small emulated device (EBB_SIM_MEM=256M): the release-and-retry chain, the
// EBB_ENOMEM report, and a process that carries on after it.
#include <random>
#include <string>
#include <vector>

#include "alloc_test_util.hpp"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal

using namespace alloc_test;

// The setting this executable is about, also when it is run by hand; ctest's ENV (same value)
// takes precedence. Set before main, so before the driver's cuInit reads it.
static const bool kEnvSet = setenv("EBB_SIM_MEM", "256M", 0) == 0;
// test_alloc_oom_expandable runs with EBB_ALLOC_CONF empty: expandable segments are the
// emulated driver's default (it has VMM); test_alloc_oom with expandable_segments:0.
#ifndef EBB_OOM_EXPANDABLE
static const bool kConfSet = setenv("EBB_ALLOC_CONF", "expandable_segments:0", 0) == 0;
#endif

// The same source with expandable segments (test_alloc_oom_expandable) runs only the cases
// about growth near capacity; the others pin the classic segments' figures.
#ifndef EBB_OOM_EXPANDABLE
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
#endif // EBB_OOM_EXPANDABLE

#ifdef EBB_OOM_EXPANDABLE
// With EBB_ALLOC_CONF silent about them, a device whose driver has VMM gets expandable
// segments: one reservation grown by granules (the classic policy would make a 20 MiB segment
// for the 3 MiB request, and a second one for the 12 MiB request).
TEST_CASE("by default a device whose driver has VMM has expandable segments", "[alloc][oom]") {
  const char *conf = std::getenv("EBB_ALLOC_CONF");
  REQUIRE((!conf || std::string(conf).find("expandable_segments") == std::string::npos));
  EbbSession session;
  ebb_dev_caps caps{};
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  REQUIRE(caps.vmm); // the emulated driver has it
  ebb_stream_t *s = default_stream(0);
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &p));
  CHECK(stats(0).reserved_bytes.current == 4 * MiB);
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 12 * MiB, s, &q));
  CHECK(reinterpret_cast<uintptr_t>(q) == reinterpret_cast<uintptr_t>(p) + 3 * MiB);
  CHECK(stats(0).segments.current == 1);
  CHECK(stats(0).reserved_bytes.current == 16 * MiB);
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_free(q));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}
#endif

// Takes device memory from the driver until `left` bytes are free; returns what it took.
static std::vector<uint64_t> fill_device_leaving(int dev, size_t left) {
  size_t fr = 0, total = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(dev, &fr, &total));
  REQUIRE(fr > left);
  std::vector<uint64_t> taken;
  uint64_t d = 0;
  EBB_REQUIRE_OK(ebb__drv_mem_alloc(dev, fr - left, &d));
  taken.push_back(d);
  EBB_REQUIRE_OK(ebb_dev_mem_info(dev, &fr, &total));
  REQUIRE(fr == left);
  return taken;
}

static void give_back(int dev, const std::vector<uint64_t> &taken) {
  for (uint64_t d : taken) EBB_REQUIRE_OK(ebb__drv_mem_free(dev, d));
}

// Near capacity the size policy's segment (20 MiB for a 3 MiB request) does not fit where the
// request would: the arena falls back to one just large enough (whole 2 MiB) before it fails.
// Expandable segments grow by the granules a request needs anyway: 4 MiB, room or not.
TEST_CASE("near capacity a request that fits gets a segment just large enough", "[alloc][oom]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  for (size_t left : {10 * MiB, 4 * MiB}) {
    INFO("free on the device: " << left / MiB << " MiB");
    std::vector<uint64_t> taken = fill_device_leaving(0, left);
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &p));
    ebb_arena_stats st = stats(0);
    CHECK(st.reserved_bytes.current == 4 * MiB);
    CHECK(st.num_ooms == 0);
    ARENA_CHECK();
    // It is an ordinary block: freed, cached, reused, given back.
    EBB_REQUIRE_OK(ebb_arena_free(p));
    void *q = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &q));
    CHECK(q == p);
    EBB_REQUIRE_OK(ebb_arena_free(q));
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
    CHECK(stats(0).reserved_bytes.current == 0);
    ARENA_CHECK();
    give_back(0, taken);
  }
  // With room, the policy's own size as before.
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 3 * MiB, s, &p));
#ifdef EBB_OOM_EXPANDABLE
  CHECK(stats(0).reserved_bytes.current == 4 * MiB);
#else
  CHECK(stats(0).reserved_bytes.current == 20 * MiB);
#endif
  EBB_REQUIRE_OK(ebb_arena_free(p));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// When even that does not fit, the report says what was tried.
TEST_CASE("an OOM report names the segment sizes it tried", "[alloc][oom]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  std::vector<uint64_t> taken = fill_device_leaving(0, 2 * MiB);
  void *p = nullptr;
#ifdef EBB_OOM_EXPANDABLE
  const char *tried = "; tried to map 4.00 MiB;";
#else
  const char *tried = "; tried a 20.00 MiB segment, then a 4.00 MiB one;";
#endif
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 3 * MiB, s, &p), EBB_ENOMEM, tried);
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 3 * MiB, s, &p), EBB_ENOMEM, "requested 3.00 MiB (rounded 3.00 MiB)");
  // A request the policy sizes exactly: one size tried.
#ifdef EBB_OOM_EXPANDABLE
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 30 * MiB, s, &p), EBB_ENOMEM, "; tried to map 30.00 MiB;");
#else
  EBB_CHECK_FAILS(ebb_arena_alloc(0, 30 * MiB, s, &p), EBB_ENOMEM, "; tried a 30.00 MiB segment;");
#endif
  CHECK(stats(0).reserved_bytes.current == 0);
  ARENA_CHECK();
  give_back(0, taken);
  REQUIRE(ebb_debug_live_handles() == 0);
}
