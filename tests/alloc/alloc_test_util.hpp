// Helpers of the alloc suites: stats shorthands, the arena invariant check, a slow kernel.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

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

// The arena's own invariant walk, on both devices.
#define ARENA_CHECK()                         \
  do {                                        \
    EBB_REQUIRE_OK(ebb_arena_debug_check(0)); \
    EBB_REQUIRE_OK(ebb_arena_debug_check(1)); \
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

inline ebb_stream_t *pool_stream(int dev, ebb_stream_prio prio = EBB_PRIO_LOW) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(dev, prio, &s));
  return s;
}

inline ebb_stream_t *default_stream(int dev) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(dev, &s));
  return s;
}

}  // namespace alloc_test
