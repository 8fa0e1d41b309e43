// Helpers of the alloc suites: stats shorthands, the arena invariant check, a slow kernel.
#pragma once
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_test_util.hpp"

namespace alloc_test {

constexpr size_t KiB = 1024, MiB = 1024 * 1024;

inline ebb_arena_stats stats(int dev) {
  ebb_arena_stats s{};
  EBB_REQUIRE_OK(ebb_arena_get_stats(dev, &s));
  return s;
}

// Whether requests up to 64 KiB are slab slots: on unless EBB_ALLOC_CONF turns them off (the
// *_noslab executables run the engine's own small-block behaviour).
inline bool slabs_on() {
  const char *c = std::getenv("EBB_ALLOC_CONF");
  return !c || std::string(c).find("slab_max_bytes:0") == std::string::npos;
}

// The arena's own invariant walk, on every device (two on the emulated driver).
#define ARENA_CHECK()                                                                      \
  do {                                                                                     \
    for (int d_ = 0; d_ < ebb_test_device_count(); d_++) EBB_REQUIRE_OK(ebb_arena_debug_check(d_)); \
  } while (0)

// Enqueues `n` no-op kernels on `s` (each takes EBB_SIM_LAUNCH_US under the timing model).
inline void busy(ebb_stream_t *s, int n = 1) {
  const ebb_kernel_t *k = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_find("ebb.noop", &k));
  ebb_noop_args args{};
  for (int i = 0; i < n; i++) EBB_REQUIRE_OK(ebb_stream_launch(s, k, &args, nullptr));
}

// Queues a host function on `s` that sets *flag to 1: it runs once the work issued before it has.
inline void flag_after(ebb_stream_t *s, std::atomic<int> *flag) {
  EBB_REQUIRE_OK(ebb_stream_host_func(s, [](void *u) { static_cast<std::atomic<int> *>(u)->store(1); }, flag));
}

// A host function that holds its stream until *open != 0 (10 s at most, so a broken test fails
// rather than hangs): work queued behind it waits while the test acts on other streams.
inline void hold_until_open(void *open) {
  auto *o = static_cast<std::atomic<int> *>(open);
  for (int i = 0; i < 100000 && o->load(std::memory_order_acquire) == 0; i++)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

// Words of a and b that differ.
inline size_t words_differing(const std::vector<uint32_t> &a, const std::vector<uint32_t> &b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); i++) n += a[i] != b[i];
  return n;
}

inline ebb_stream_t *pool_stream(int dev, ebb_stream_prio prio = EBB_PRIO_LOW) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(dev, prio, &s));
  return s;
}

// A stream of its own (released by the test).
inline ebb_stream_t *new_stream(int dev, ebb_stream_prio prio = EBB_PRIO_LOW) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(dev, prio, &s));
  return s;
}

inline ebb_stream_t *default_stream(int dev) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(dev, &s));
  return s;
}

// A training step's worth of random traffic, replayed pass after pass as the arena bench does:
// `live` blocks of sizes log-uniform in [lo, hi] bytes, then `ops` times a random one freed and a
// new one allocated in its place, then everything freed. The sequence is drawn once from `seed`
// and repeated exactly. Returns the driver allocations (num_device_alloc) of each pass.
inline std::vector<uint64_t> replay_passes(int dev, ebb_stream_t *s, uint32_t seed, size_t live, size_t ops, double lo,
                                           double hi, int passes) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> logsz(std::log2(lo), std::log2(hi));
  std::vector<size_t> size(live + ops), victim(ops);
  for (size_t &z : size) z = static_cast<size_t>(std::exp2(logsz(rng)));
  for (size_t &v : victim) v = static_cast<size_t>(rng() % live);
  std::vector<void *> slot(live);
  std::vector<uint64_t> drv;
  for (int p = 0; p < passes; p++) {
    uint64_t d0 = stats(dev).num_device_alloc;
    for (size_t i = 0; i < live; i++) EBB_REQUIRE_OK(ebb_arena_alloc(dev, size[i], s, &slot[i]));
    for (size_t i = 0; i < ops; i++) {
      EBB_REQUIRE_OK(ebb_arena_free(slot[victim[i]]));
      EBB_REQUIRE_OK(ebb_arena_alloc(dev, size[live + i], s, &slot[victim[i]]));
    }
    for (void *q : slot) EBB_REQUIRE_OK(ebb_arena_free(q));
    drv.push_back(stats(dev).num_device_alloc - d0);
  }
  return drv;
}

// Eight seeded sequences of 1 000 live blocks of 512 B .. 16 MiB on device 0, three passes each:
// the first makes driver calls (allocations or, with expandable segments, granule maps), the
// others none. Between seeds the arena gives everything back.
inline void check_settles_after_one_pass(ebb_stream_t *s) {
  for (uint32_t seed = 1; seed <= 8; seed++) {
    std::vector<uint64_t> drv = replay_passes(0, s, seed, 1000, 20000, 512.0, 16.0 * MiB, 3);
    INFO("seed " << seed << ": driver calls per pass " << drv[0] << ", " << drv[1] << ", " << drv[2]);
    CHECK(drv[0] > 0);
    CHECK(drv[1] == 0);
    CHECK(drv[2] == 0);
    ARENA_CHECK();
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The free index's placement rules (alloc/arena_impl.h, "free index"), against a model, with
// classic segments: 400 blocks of 1.25 MiB fill 20 MiB segments (16 each, nothing left over)
// one after the other, so (segment age, address) order is the order they were made in. Half of
// them freed at random leave a few hundred free runs in one stream's tree; then every request
// of k blocks must get, among the free runs of at least k (runs end where segments do), for
// k = 1 (a request below 2 MiB) the first run of one block (a hole below 2 MiB) if there is one,
// else the first run in that order; through splits, merges and nodes emptied, with the debug
// walk checking the tree's links, order and maxima as it goes. refuse (white-box tests only,
// else nullptr): a hook that makes the index's node memory run out while its argument is
// positive; the index then gets none until operation refuse_until, so its blocks live in its
// list first and then in both.
inline void check_fit_model(void (*refuse)(int), int refuse_until) {
  ebb_stream_t *s = default_stream(0);
  const size_t S = 5 * MiB / 4;
  const int N = 400;
  if (refuse) refuse(INT_MAX);
  std::vector<uintptr_t> addr(N);
  std::vector<int> seg(N);
  for (int i = 0; i < N; i++) {
    void *p = nullptr;
    EBB_REQUIRE_OK(ebb_arena_alloc(0, S, s, &p));
    addr[i] = reinterpret_cast<uintptr_t>(p);
    seg[i] = i / 16; // 16 a segment: the runs end at segment ends (even where the driver placed
                     // two segments next to each other: they never merge)
    if (i % 16) REQUIRE(addr[i] == addr[i - 1] + S);
  }
  REQUIRE(stats(0).segments.current == N / 16);
  // owner[i]: the first block of the allocation holding block i, or -1 while free.
  std::vector<int> owner(N), len(N, 1);
  for (int i = 0; i < N; i++) owner[i] = i;
  std::mt19937 rng(9);
  auto release = [&](int first) {
    for (int j = first; j < first + len[first]; j++) owner[j] = -1;
    EBB_REQUIRE_OK(ebb_arena_free(reinterpret_cast<void *>(addr[first])));
  };
  for (int i = 0; i < N; i++)
    if (rng() % 2) release(i);
  ARENA_CHECK();
  uint64_t dev = stats(0).num_device_alloc;
  int served = 0, holes = 0;
  for (int op = 0; op < 4000; op++) {
    if (refuse && op == refuse_until) refuse(0);
    if (rng() % 2) {
      int k = 1 + static_cast<int>(rng() % 6);
      // The model: the maximal free runs in order; the first of at least k, and for k = 1 the
      // first of exactly one block (below 2 MiB) before it.
      int at = -1, hole = -1;
      for (int i = 0; i < N;) {
        if (owner[i] >= 0) {
          i++;
          continue;
        }
        int j = i;
        while (j < N && owner[j] < 0 && seg[j] == seg[i]) j++;
        if (j - i >= k && at < 0) at = i;
        if (k == 1 && j - i == 1 && hole < 0) hole = i;
        i = j;
      }
      if (hole >= 0) at = hole;
      if (at < 0) continue;  // would grow the arena: the model knows no new segment
      void *p = nullptr;
      EBB_REQUIRE_OK(ebb_arena_alloc(0, k * S, s, &p));
      INFO("op " << op << ": " << k << " blocks");
      REQUIRE(reinterpret_cast<uintptr_t>(p) == addr[at]);
      for (int j = at; j < at + k; j++) owner[j] = at;
      len[at] = k;
      served++;
      holes += hole >= 0 && hole != at;
    } else {
      int i = static_cast<int>(rng() % N);
      if (owner[i] >= 0) release(owner[i]);
    }
    if (op % 97 == 0) ARENA_CHECK();
  }
  if (refuse) refuse(0);
  CHECK(served > 1000);
  CHECK(stats(0).num_device_alloc == dev);
  ARENA_CHECK();
  for (int i = 0; i < N; i++)
    if (owner[i] == i) release(i);
  ARENA_CHECK();
  CHECK(stats(0).allocated_bytes.current == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

}  // namespace alloc_test
