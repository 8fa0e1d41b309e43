// Seeded random traffic over the device arena with the invariant walk (ebb_arena_debug_check)
// after every step: sizes on both sides of 2 MiB (slots, blocks below 2 MiB that rule 1 places,
// large ones) and at the edges of the size rules, three streams (steals, runs), frees with
// pending uses held back by a gated stream, empty_cache (holes, the cut tail), limits that drive
// the retry chain and EBB_ENOMEM, and (white box: the library is linked statically) the free
// index's node memory refused for a while, so blocks live in its list. Built twice (classic and
// expandable segments); FUZZ_SEEDS, FUZZ_FIRST and FUZZ_OPS widen a run by hand.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "alloc_test_util.hpp"
#include "sanitizers.hpp"

using namespace alloc_test;

extern "C" void ebb_test_refuse_fidx_chunks(int n);

static int env_int(const char *k, int d) {
  const char *v = std::getenv(k);
  return v && *v ? std::atoi(v) : d;
}

// Holds its stream until *open != 0 or 20 ms have passed: frees with uses on that stream stay
// pending for a while, and a host wait on it (the retry chain, empty_cache) costs 20 ms at most.
static void hold_briefly(void *open) {
  auto *o = static_cast<std::atomic<int> *>(open);
  for (int i = 0; i < 200 && o->load(std::memory_order_acquire) == 0; i++)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

struct Live {
  void *p;
  size_t bytes;
};

static size_t draw_size(std::mt19937_64 &rng) {
  auto logu = [&](double lo, double hi) {
    std::uniform_real_distribution<double> d(std::log2(lo), std::log2(hi));
    return static_cast<size_t>(std::exp2(d(rng)));
  };
  unsigned c = rng() % 100;
  if (c < 25) return logu(1, 64 * KiB);
  if (c < 65) return logu(64 * KiB, 2 * MiB);
  if (c < 90) return logu(2 * MiB, 48 * MiB);
  static const size_t edge[] = {2 * MiB - 512, 2 * MiB, 2 * MiB + 512, 1 * MiB, 1 * MiB + 512, 4 * MiB, 20 * MiB,
                                20 * MiB + 512, 64 * KiB, 64 * KiB + 1};
  return edge[rng() % (sizeof edge / sizeof edge[0])];
}

// A failed step: what, where, and the library's message. Catch's macros are not thread-safe
// (v2), so the sequence reports through its return value instead.
#define FUZZ_OK(call)                                                                                  \
  do {                                                                                                 \
    ebb_status st_ = (call);                                                                           \
    if (st_ != EBB_OK)                                                                                 \
      return "seed " + std::to_string(seed) + " op " + std::to_string(op) + ": " #call " -> " +          \
             ebb_status_name(st_) + ": " + ebb_last_error();                                           \
  } while (0)

// One seeded sequence of `ops` steps; "" when every step and walk passed, else what failed.
// solo: the only thread on the arena, so it may also set limits and refuse node memory (both
// arena-wide); else its streams are new ones of its own.
static std::string fuzz_one(uint64_t seed, int ops, bool solo) {
  std::mt19937_64 rng(seed);
  int op = -1;
  ebb_stream_t *ss[3] = {};
  if (solo) {
    FUZZ_OK(ebb_stream_default(0, &ss[0]));
    FUZZ_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &ss[1]));
  } else {
    FUZZ_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[0]));
    FUZZ_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[1]));
  }
  FUZZ_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ss[2]));
  const ebb_kernel_t *noop = nullptr;
  FUZZ_OK(ebb_kernel_find("ebb.noop", &noop));
  ebb_noop_args noop_args{};
  std::vector<Live> live;
  std::atomic<int> gate{1};
  int gate_close_at = -1;
  size_t limit = 0, live_bytes = 0;
  int refuse_until = solo && seed % 2 ? static_cast<int>(rng() % 500) : -1;
  if (refuse_until >= 0) ebb_test_refuse_fidx_chunks(INT_MAX);
  const size_t kLiveCap = (solo ? 512 : 160) * MiB; // of EBB_SIM_MEM=1G: room for fragmentation
  auto drop = [&](size_t i) {
    live_bytes -= live[i].bytes;
    live[i] = live.back();
    live.pop_back();
  };
  for (op = 0; op < ops; op++) {
    unsigned c = rng() % 1000;
    if (op == refuse_until) ebb_test_refuse_fidx_chunks(0);
    if (gate.load() == 0 && op >= gate_close_at) gate.store(1, std::memory_order_release);
    if (live.empty() || (c < 450 && live_bytes < kLiveCap)) {
      void *p = nullptr;
      size_t bytes = draw_size(rng);
      ebb_status st = ebb_arena_alloc(0, bytes, ss[rng() % 3], &p);
      if (st != EBB_ENOMEM) { // under a limit, or near the device's memory: a report, no damage
        FUZZ_OK(st);
        live.push_back({p, bytes});
        live_bytes += bytes;
      }
    } else if (c < 800) {
      size_t i = rng() % live.size();
      FUZZ_OK(ebb_arena_free(live[i].p));
      drop(i);
    } else if (c < 900) {
      // A use on another stream, then the free: pending while stream 2 is held.
      size_t i = rng() % live.size();
      ebb_stream_t *u = ss[1 + rng() % 2];
      FUZZ_OK(ebb_arena_record_stream(live[i].p, u));
      if (rng() % 2) FUZZ_OK(ebb_stream_launch(u, noop, &noop_args, nullptr));
      FUZZ_OK(ebb_arena_free(live[i].p));
      drop(i);
    } else if (c < 930) {
      if (gate.load() == 1) {
        gate.store(0);
        gate_close_at = op + 1 + static_cast<int>(rng() % 50);
        FUZZ_OK(ebb_stream_host_func(ss[2], hold_briefly, &gate));
      }
    } else if (c < 950) {
      gate.store(1, std::memory_order_release); // empty_cache waits for the device
      FUZZ_OK(ebb_arena_empty_cache(0));
    } else if (c < 970 && solo) {
      if (limit) {
        limit = 0;
      } else {
        ebb_arena_stats s{};
        FUZZ_OK(ebb_arena_get_stats(0, &s));
        limit = s.reserved_bytes.current + (rng() % 4) * 2 * MiB;
        if (!limit) limit = 2 * MiB;
      }
      FUZZ_OK(ebb_arena_set_limit(0, limit));
    } else if (c < 980 && solo) {
      ebb_test_refuse_fidx_chunks(INT_MAX); // no node memory for a while: blocks go to the lists
      refuse_until = op + static_cast<int>(rng() % 300);
    } else if (c >= 980) {
      // A request that fails under a limit, or grows the arena a lot.
      void *p = nullptr;
      ebb_status st = ebb_arena_alloc(0, 200 * MiB, ss[rng() % 3], &p);
      if (st != EBB_ENOMEM) {
        FUZZ_OK(st);
        live.push_back({p, 200 * MiB});
        live_bytes += 200 * MiB;
      }
    }
    FUZZ_OK(ebb_arena_debug_check(0));
  }
  gate.store(1, std::memory_order_release);
  if (solo) {
    ebb_test_refuse_fidx_chunks(0);
    FUZZ_OK(ebb_arena_set_limit(0, 0));
  }
  for (Live &l : live) FUZZ_OK(ebb_arena_free(l.p));
  for (ebb_stream_t *x : ss) FUZZ_OK(ebb_stream_synchronize(x));
  for (int i = solo ? 2 : 0; i < 3; i++) FUZZ_OK(ebb_stream_release(ss[i]));
  return "";
}

TEST_CASE("fuzz: random traffic keeps every invariant after each step", "[alloc][fuzz]") {
  int seeds = env_int("FUZZ_SEEDS", 6), ops = env_int("FUZZ_OPS", 2000 / kSanitizerScale), first = env_int("FUZZ_FIRST", 1);
  for (int s = first; s < first + seeds; s++) {
    EbbSession session; // a fresh arena each: its free index has no node memory at first
    std::string err = fuzz_one(static_cast<uint64_t>(s), ops, true);
    INFO(err);
    REQUIRE(err.empty());
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
    ARENA_CHECK();
    CHECK(stats(0).allocated_bytes.current == 0);
    CHECK(stats(0).reserved_bytes.current == 0);
    REQUIRE(ebb_debug_live_handles() == 0);
  }
}

// Three threads at once, each on streams of its own: steals, runs and set-aside remainders meet
// growth and empty_cache of the others with the lock dropped in between.
TEST_CASE("fuzz: three threads of random traffic keep every invariant", "[alloc][fuzz][threads]") {
  int seeds = env_int("FUZZ_SEEDS", 2), ops = env_int("FUZZ_OPS", 1500 / kSanitizerScale), first = env_int("FUZZ_FIRST", 1);
  for (int s = first; s < first + seeds; s++) {
    EbbSession session;
    std::string err[3];
    std::vector<std::thread> th;
    for (int t = 0; t < 3; t++) th.emplace_back([&err, s, t, ops] { err[t] = fuzz_one(static_cast<uint64_t>(s) * 16 + t, ops, false); });
    for (std::thread &t : th) t.join();
    for (const std::string &e : err) {
      INFO(e);
      CHECK(e.empty());
    }
    EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
    ARENA_CHECK();
    CHECK(stats(0).allocated_bytes.current == 0);
    CHECK(stats(0).reserved_bytes.current == 0);
    REQUIRE(ebb_debug_live_handles() == 0);
  }
}
