// The pinned host pool and the plain host pool: the arena engine over two more upstreams.
// One source, built three times (EBB_PIN_MODE): 0 plain settings, 1 under the timing model
// (deferred frees), 2 with a pinned_max_bytes cap.
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal

using namespace alloc_test;

#ifndef EBB_PIN_MODE
#define EBB_PIN_MODE 0
#endif

[[maybe_unused]] static ebb_arena_stats pstats() {
  ebb_arena_stats s{};
  EBB_REQUIRE_OK(ebb_pinned_get_stats(&s));
  return s;
}

[[maybe_unused]] static ebb_arena_stats hstats() {
  ebb_arena_stats s{};
  EBB_REQUIRE_OK(ebb_pageable_get_stats(&s));
  return s;
}

#define POOLS_CHECK()                         \
  do {                                        \
    EBB_REQUIRE_OK(ebb_pinned_debug_check()); \
    EBB_REQUIRE_OK(ebb_pageable_debug_check());   \
    ARENA_CHECK();                            \
  } while (0)

#if EBB_PIN_MODE == 0

TEST_CASE("pinned: blocks are pinned, aligned, cached and reused", "[alloc][pinned]") {
  EbbSession session;
  void *p = nullptr, *q = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(1000, 0, &p));
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(p) % 512 == 0);
  ebb_ptr_info info{};
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, p, &info));
  CHECK(info.type == EBB_MEMTYPE_PINNED);
  std::memset(p, 0xab, 1000);  // host memory: the caller may write it
  ebb_arena_stats s = pstats();
  CHECK(s.allocated_bytes.current == 1024);
  CHECK(s.requested_bytes.current == 1000);
  CHECK(s.reserved_bytes.current == 2 * MiB);  // small requests share 2 MiB segments
  CHECK(s.num_device_alloc == 1);
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  EBB_REQUIRE_OK(ebb_pinned_alloc(1000, 0, &q));
  CHECK(q == p);  // no recorded use: reusable at once
  CHECK(pstats().num_device_alloc == 1);
  CHECK(pstats().cache_hits == 1);
  EBB_REQUIRE_OK(ebb_pinned_free(q));
  void *z = reinterpret_cast<void *>(1);
  EBB_REQUIRE_OK(ebb_pinned_alloc(0, -1, &z));
  CHECK(z == nullptr);  // zero bytes: defined, NULL
  EBB_REQUIRE_OK(ebb_pinned_free(nullptr));
  POOLS_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pinned: large requests get exact-size segments, no power-of-two doubling", "[alloc][pinned]") {
  EbbSession session;
  void *p = nullptr;
  const size_t want = 5 * MiB + 12345;  // PyTorch's host allocator would reserve 8 MiB
  EBB_REQUIRE_OK(ebb_pinned_alloc(want, 0, &p));
  ebb_arena_stats s = pstats();
  const size_t rounded = (want + 4095) / 4096 * 4096;
  CHECK(s.reserved_bytes.current == rounded);
  CHECK(s.allocated_bytes.current <= rounded);
  CHECK(s.allocated_bytes.current >= want);
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  EBB_REQUIRE_OK(ebb_pinned_empty_cache());
  CHECK(pstats().reserved_bytes.current == 0);
  CHECK(pstats().num_device_free == 1);
  POOLS_CHECK();
}

TEST_CASE("pinned: pages are placed on the device's NUMA node", "[alloc][pinned][numa]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  for (int d = 0; d < ndev; d++) {
    ebb_topo t{};
    if (ebb_dev_get_topo(d, &t) != EBB_OK || t.numa_node < 0) EBB_SKIP(std::string("no topology for device ") + std::to_string(d));
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_pinned_alloc(4 * MiB, d, &p));
    std::memset(p, 1, 4 * MiB);  // placement happens at first touch (if registration did not)
    int node = -2;
    ebb_status st = ebb_host_numa_node(p, 4 * MiB, &node);
    if (st == EBB_ENOTSUP) {
      EBB_REQUIRE_OK(ebb_pinned_free(p));
      EBB_SKIP(std::string("the OS cannot report page locations: ") + ebb_last_error());
    }
    EBB_REQUIRE_OK(st);
    CHECK(node == t.numa_node);
    EBB_REQUIRE_OK(ebb_pinned_free(p));
  }
  POOLS_CHECK();
}

TEST_CASE("pinned: the runtime's NUMA host pages, and their bad input", "[alloc][pinned][numa]") {
  EbbSession session;
  void *p = nullptr;
  bool bound = false;
  EBB_REQUIRE_OK(ebb_numa_pages_alloc(0, 10000, &p, &bound));
  REQUIRE(p != nullptr);
  std::memset(p, 7, 10000);
  EBB_REQUIRE_OK(ebb_numa_pages_free(p, 10000));
  EBB_CHECK_FAILS(ebb_numa_pages_alloc(99, 10, &p, &bound), EBB_EDEVICE, "99");
  EBB_CHECK_FAILS(ebb_numa_pages_alloc(0, 0, &p, &bound), EBB_EINVAL, "bytes is 0");
  EBB_CHECK_FAILS(ebb_numa_pages_alloc(0, 10, nullptr, &bound), EBB_EINVAL, "NULL");
  int node = 0;
  EBB_CHECK_FAILS(ebb_host_numa_node(nullptr, 10, &node), EBB_EINVAL, "NULL");
}

TEST_CASE("pinned: misuse is reported, never a corrupted pool", "[alloc][pinned]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  void *p = nullptr, *d = nullptr, *h = nullptr;
  EBB_CHECK_FAILS(ebb_pinned_alloc(10, 0, nullptr), EBB_EINVAL, "ptr is NULL");
  EBB_CHECK_FAILS(ebb_pinned_alloc(10, 7, &p), EBB_EDEVICE, "device_hint 7");
  EBB_CHECK_FAILS(ebb_pinned_alloc(10, -2, &p), EBB_EDEVICE, "device_hint -2");
  EBB_REQUIRE_OK(ebb_pinned_alloc(4096, 1, &p));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 4096, nullptr, &d));
  EBB_REQUIRE_OK(ebb_pageable_alloc(4096, &h));
  // Pointers of the wrong pool: named, and left alive for their owner.
  EBB_CHECK_FAILS(ebb_pinned_free(d), EBB_EINVAL, "device 0");
  EBB_CHECK_FAILS(ebb_pinned_free(h), EBB_EINVAL, "host pool");
  EBB_CHECK_FAILS(ebb_arena_free(p), EBB_EINVAL, "pinned pool");
  EBB_CHECK_FAILS(ebb_pageable_free(p), EBB_EINVAL, "ebb_pinned_alloc");
  EBB_CHECK_FAILS(ebb_arena_record_stream(p, default_stream(0)), EBB_EINVAL, "pinned pool");
  EBB_CHECK_FAILS(ebb_pinned_record_stream(d, default_stream(0)), EBB_EINVAL, "device 0");
  EBB_CHECK_FAILS(ebb_pinned_record_stream(p, nullptr), EBB_EINVAL, "stream is NULL");
  EBB_CHECK_FAILS(ebb_pinned_record_stream(nullptr, default_stream(0)), EBB_EINVAL, "NULL");
  // Interior, foreign and double frees.
  EBB_CHECK_FAILS(ebb_pinned_free(static_cast<char *>(p) + 512), EBB_EINVAL, "inside the block");
  int local = 0;
  EBB_CHECK_FAILS(ebb_pinned_free(&local), EBB_EINVAL, "not allocated by ebb_pinned_alloc");
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  EBB_CHECK_FAILS(ebb_pinned_free(p), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_pinned_record_stream(p, default_stream(0)), EBB_EFREED, "freed");
  EBB_REQUIRE_OK(ebb_arena_free(d));
  EBB_REQUIRE_OK(ebb_pageable_free(h));
  EBB_CHECK_FAILS(ebb_pageable_free(h), EBB_EFREED, "already freed");
  EBB_CHECK_FAILS(ebb_pageable_alloc(10, nullptr), EBB_EINVAL, "ptr is NULL");
  EBB_CHECK_FAILS(ebb_pinned_get_stats(nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_pageable_get_stats(nullptr), EBB_EINVAL, "out is NULL");
  CHECK(pstats().allocated_bytes.current == 0);
  CHECK(hstats().allocated_bytes.current == 0);
  POOLS_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pinned and host calls before ebb_init say so", "[alloc][pinned]") {
  void *p = nullptr;
  EBB_CHECK_FAILS(ebb_pinned_alloc(10, 0, &p), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_pageable_alloc(10, &p), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_pinned_free(&p), EBB_ENOTINIT, "ebb_init");
}

TEST_CASE("pinned: a block copied through on a stream is a valid staging buffer", "[alloc][pinned]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *src = nullptr, *dst = nullptr, *dev = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(1 * MiB, 0, &src));
  EBB_REQUIRE_OK(ebb_pinned_alloc(1 * MiB, 0, &dst));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &dev));
  for (size_t i = 0; i < MiB; i++) static_cast<unsigned char *>(src)[i] = static_cast<unsigned char>(i * 7);
  EBB_REQUIRE_OK(ebb_copy_async(dev, src, MiB, s));
  EBB_REQUIRE_OK(ebb_copy_async(dst, dev, MiB, s));
  EBB_REQUIRE_OK(ebb_pinned_record_stream(src, s));
  EBB_REQUIRE_OK(ebb_pinned_record_stream(dst, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(std::memcmp(src, dst, MiB) == 0);
  EBB_REQUIRE_OK(ebb_pinned_free(src));
  EBB_REQUIRE_OK(ebb_pinned_free(dst));
  EBB_REQUIRE_OK(ebb_arena_free(dev));
  POOLS_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A copy from or into a pinned block on a stream records that use itself: a caller that forgets
// ebb_pinned_record_stream does not let a new owner take the block while the copy still reads it
// (without the record, 12 288 of 12 288 words read wrong) or writes it. Stream b is held by a host
// function so the copies are still queued when the blocks are freed, taken again and written
// by the host.
TEST_CASE("pinned: a copy on a stream keeps its block from a new owner without record_stream", "[alloc][pinned][copy]") {
  EbbSession session;
  ebb_stream_t *b = new_stream(0);
  for (size_t bytes : {48 * KiB, 4 * MiB}) {
    INFO("bytes " << bytes);
    const size_t words = bytes / 4;
    std::vector<uint32_t> pattern(words), out(words, 0);
    for (size_t i = 0; i < words; i++) pattern[i] = 0x9e3779b9u * static_cast<uint32_t>(i + 1);
    void *src = nullptr, *dst = nullptr, *dev = nullptr, *dev2 = nullptr, *again = nullptr, *again2 = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, b, &dev));
    EBB_REQUIRE_OK(ebb_arena_alloc(0, bytes, b, &dev2));
    EBB_REQUIRE_OK(ebb_pinned_alloc(bytes, 0, &src));
    EBB_REQUIRE_OK(ebb_pinned_alloc(bytes, 0, &dst));
    std::memcpy(src, pattern.data(), bytes);
    EBB_REQUIRE_OK(ebb_copy_async(dev2, pattern.data(), bytes, b));
    std::atomic<int> open{0};
    EBB_REQUIRE_OK(ebb_stream_host_func(b, hold_until_open, &open));
    EBB_REQUIRE_OK(ebb_copy_async(dev, src, bytes, b));   // reads src later
    EBB_REQUIRE_OK(ebb_copy_async(dst, dev2, bytes, b));  // writes dst later
    EBB_REQUIRE_OK(ebb_pinned_free(src));
    EBB_REQUIRE_OK(ebb_pinned_free(dst));
    EBB_REQUIRE_OK(ebb_pinned_alloc(bytes, 0, &again));
    EBB_REQUIRE_OK(ebb_pinned_alloc(bytes, 0, &again2));
    std::memset(again, 0, bytes);
    std::memset(again2, 0, bytes);
    open.store(1, std::memory_order_release);
    EBB_REQUIRE_OK(ebb_copy_async(out.data(), dev, bytes, b));
    EBB_REQUIRE_OK(ebb_stream_synchronize(b));
    CHECK(words_differing(out, pattern) == 0);
    std::vector<uint32_t> zeros(words, 0), mine(words);
    std::memcpy(mine.data(), again, bytes);
    CHECK(words_differing(mine, zeros) == 0);
    std::memcpy(mine.data(), again2, bytes);
    CHECK(words_differing(mine, zeros) == 0);
    for (void *p : {again, again2}) EBB_REQUIRE_OK(ebb_pinned_free(p));
    for (void *p : {dev, dev2}) EBB_REQUIRE_OK(ebb_arena_free(p));
    POOLS_CHECK();
  }
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The pinned pool knows its blocks' sizes too.
TEST_CASE("pinned: a copy past the end of a pinned block is refused, naming the block", "[alloc][pinned][copy]") {
  EbbSession session;
  ebb_stream_t *s = default_stream(0);
  void *pin = nullptr, *dev = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(512, 0, &pin));
  EBB_REQUIRE_OK(ebb_arena_alloc(0, 1 * MiB, s, &dev));
  EBB_CHECK_FAILS(ebb_copy_async(pin, dev, MiB, s), EBB_EINVAL, "dst");
  EBB_CHECK_FAILS(ebb_copy_async(pin, dev, MiB, s), EBB_EINVAL, "pinned pool");
  EBB_CHECK_FAILS(ebb_copy_async(dev, static_cast<char *>(pin) + 8, 512, s), EBB_EINVAL, "offset 8;");
  EBB_REQUIRE_OK(ebb_copy_async(dev, static_cast<char *>(pin) + 8, 504, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_pinned_free(pin));
  EBB_REQUIRE_OK(ebb_arena_free(dev));
  POOLS_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("host: the tiny-tensor pattern is served from cached segments", "[alloc][host]") {
  EbbSession session;
  std::mt19937_64 rng;
  std::vector<void *> live;
  // A training step of small CPU tensors (64 B .. 64 KiB), the same every step, as steps are.
  auto step = [&]() {
    rng.seed(42);
    for (int i = 0; i < 2000; i++) {
      size_t bytes = size_t(64) << (rng() % 11);
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_pageable_alloc(bytes, &p));
      std::memset(p, 0x5a, bytes);
      live.push_back(p);
      if (live.size() > 300) {
        size_t k = rng() % live.size();
        EBB_REQUIRE_OK(ebb_pageable_free(live[k]));
        live[k] = live.back();
        live.pop_back();
      }
    }
    for (void *p : live) EBB_REQUIRE_OK(ebb_pageable_free(p));
    live.clear();
  };
  step();
  const uint64_t warm = hstats().num_device_alloc;
  CHECK(warm > 0);
  for (int i = 0; i < 5; i++) step();
  ebb_arena_stats s = hstats();
  CHECK(s.num_device_alloc == warm);  // steady state: no new segment, so no mmap
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.alloc_count == 12000);
  CHECK(s.cache_hits == 12000 - s.num_device_alloc);
  EBB_REQUIRE_OK(ebb_pageable_debug_check());
  EBB_REQUIRE_OK(ebb_pageable_empty_cache());
  CHECK(hstats().reserved_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("host: a large block starts a segment on a 2 MiB boundary, where huge pages can back it", "[alloc][host]") {
  EbbSession session;
  // The first block of a fresh segment sits at its start: 2 MiB-aligned for segments of whole
  // 2 MiB pages (a 3 MiB request gets a 20 MiB one, a 12 MiB request exactly 12 MiB).
  for (size_t bytes : {size_t(3) << 20, size_t(12) << 20}) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_pageable_alloc(bytes, &p));
    CHECK(reinterpret_cast<uintptr_t>(p) % (uintptr_t(2) << 20) == 0);
    std::memset(p, 0x5a, bytes);  // every page of it is mapped and writable
    CHECK(static_cast<unsigned char *>(p)[bytes - 1] == 0x5a);
    EBB_REQUIRE_OK(ebb_pageable_free(p));
    EBB_REQUIRE_OK(ebb_pageable_empty_cache());  // the trimmed mapping is unmapped whole
    CHECK(hstats().reserved_bytes.current == 0);
  }
  EBB_REQUIRE_OK(ebb_pageable_debug_check());
}

TEST_CASE("host: blocks are owner-tagged like device blocks", "[alloc][host]") {
  EbbSession session;
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "cpu.act"));
  EBB_REQUIRE_OK(ebb_pageable_alloc(3000, &p));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  std::string path = std::string(EBB_PIN_TMPDIR) + "/host_snapshot.json";
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  FILE *f = std::fopen(path.c_str(), "r");
  REQUIRE(f != nullptr);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  std::fclose(f);
  CHECK(text.find("\"host_pools\"") != std::string::npos);
  CHECK(text.find("\"pool\":\"host\"") != std::string::npos);
  CHECK(text.find("cpu.act") != std::string::npos);
  EBB_REQUIRE_OK(ebb_pageable_free(p));
}

TEST_CASE("8 threads allocate and free pinned and host blocks across streams", "[alloc][pinned][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  std::vector<std::thread> th;
  for (int t = 0; t < 8; t++)
    th.emplace_back([t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      ebb_stream_t *s = nullptr;
      if (ebb_stream_from_pool(t % 2, EBB_PRIO_LOW, &s) != EBB_OK) return;
      std::vector<void *> pins, hosts;
      for (int i = 0; i < 400; i++) {
        void *p = nullptr;
        size_t bytes = 512 + rng() % (256 * 1024);
        if (ebb_pinned_alloc(bytes, t % 2, &p) == EBB_OK) {
          static_cast<char *>(p)[0] = 1;
          ebb_pinned_record_stream(p, s);
          pins.push_back(p);
        }
        if (ebb_pageable_alloc(bytes / 4 + 1, &p) == EBB_OK) hosts.push_back(p);
        if (pins.size() > 8) {
          ebb_pinned_free(pins.front());
          pins.erase(pins.begin());
        }
        if (hosts.size() > 16) {
          ebb_pageable_free(hosts.front());
          hosts.erase(hosts.begin());
        }
      }
      for (void *p : pins) ebb_pinned_free(p);
      for (void *p : hosts) ebb_pageable_free(p);
    });
  for (auto &x : th) x.join();
  CHECK(pstats().allocated_bytes.current == 0);
  CHECK(hstats().allocated_bytes.current == 0);
  CHECK(pstats().alloc_count == 8 * 400);
  POOLS_CHECK();
  REQUIRE(ebb_debug_live_handles() == 0);
}

#elif EBB_PIN_MODE == 1

[[maybe_unused]] static const bool kEnvSet = setenv("EBB_SIM_LAUNCH_US", "20000", 0) == 0;

TEST_CASE("pinned: a freed block waits for the streams that used it, without a host wait", "[alloc][pinned][timing]") {
  EbbSession session;
  ebb_stream_t *s = pool_stream(0);
  void *p = nullptr, *q = nullptr, *r = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(64 * KiB, 0, &p));
  busy(s, 3);  // ~60 ms of work that (in a real program) copies out of p
  EBB_REQUIRE_OK(ebb_pinned_record_stream(p, s));
  EBB_REQUIRE_OK(ebb_pinned_free(p));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  REQUIRE_FALSE(idle);
  EBB_REQUIRE_OK(ebb_pinned_alloc(64 * KiB, 0, &q));
  CHECK(q != p);  // deferred: the copy may still be reading p
  ebb_arena_stats st = pstats();
  CHECK(st.active_bytes.current == 128 * KiB);
  CHECK(st.num_syncs == 0);
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_pinned_alloc(64 * KiB, 0, &r));
  CHECK(r == p);  // the event completed: the next allocation polls it and reuses the block
  CHECK(pstats().num_syncs == 0);
  EBB_REQUIRE_OK(ebb_pinned_free(q));
  EBB_REQUIRE_OK(ebb_pinned_free(r));
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  REQUIRE(ebb_debug_live_handles() == 0);
}

#elif EBB_PIN_MODE == 2

[[maybe_unused]] static const bool kEnvSet = setenv("EBB_ALLOC_CONF", "pinned_max_bytes:8M", 0) == 0;

TEST_CASE("pinned: the pinned_max_bytes cap refuses with ELIMIT and a clear message", "[alloc][pinned][cap]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  CHECK(pstats().limit == 8 * MiB);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(6 * MiB, 0, &a));
  EBB_CHECK_FAILS(ebb_pinned_alloc(3 * MiB, 0, &b), EBB_ELIMIT, "pinned_max_bytes 8.00 MiB");
  EBB_CHECK_FAILS(ebb_pinned_alloc(3 * MiB, -1, &b), EBB_ELIMIT, "3145728 bytes");
  CHECK(pstats().num_ooms == 2);
  EBB_REQUIRE_OK(ebb_pinned_alloc(1 * MiB, 1, &c));  // a 2 MiB small segment still fits
  EBB_REQUIRE_OK(ebb_pinned_free(a));
  // The free segment of `a` is given back to make room: the retry chain, then success.
  EBB_REQUIRE_OK(ebb_pinned_alloc(3 * MiB, 0, &b));
  CHECK(pstats().reserved_bytes.current <= 8 * MiB);
  EBB_REQUIRE_OK(ebb_pinned_free(b));
  EBB_REQUIRE_OK(ebb_pinned_free(c));
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The cap is the whole pinned pool's, and each arena (a NUMA node's, the driver-placed one)
// caches its own free segments: what one holds free must make room for another's request.
TEST_CASE("pinned: free segments cached by one pinned arena make room under the cap for another",
          "[alloc][pinned][cap]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  void *a = nullptr, *b = nullptr;
  EBB_REQUIRE_OK(ebb_pinned_alloc(6 * MiB, 0, &a)); // device 0's NUMA node
  EBB_REQUIRE_OK(ebb_pinned_free(a));               // cached there, still counted
  CHECK(pstats().reserved_bytes.current == 6 * MiB);
  EBB_REQUIRE_OK(ebb_pinned_alloc(6 * MiB, -1, &b)); // the driver-placed arena
  CHECK(pstats().reserved_bytes.current == 6 * MiB);
  CHECK(pstats().num_ooms == 0);
  EBB_REQUIRE_OK(ebb_pinned_free(b));
  EBB_REQUIRE_OK(ebb_pinned_alloc(6 * MiB, 1, &a)); // and back to a node's arena
  EBB_REQUIRE_OK(ebb_pinned_free(a));
  CHECK(pstats().num_ooms == 0);
  EBB_REQUIRE_OK(ebb_pinned_debug_check());
  EBB_REQUIRE_OK(ebb_pinned_empty_cache());
  REQUIRE(ebb_debug_live_handles() == 0);
}

#endif
