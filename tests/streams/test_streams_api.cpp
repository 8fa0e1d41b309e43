// Streams and events through the public header: default, pool and current streams, guards,
// caller-owned streams and their misuse, events (record, wait, query, synchronize, elapsed),
// order within and across streams and devices, statistics.
#include <atomic>
#include <cstdio>
#include <set>
#include <string>
#include <thread>

#include "streams_test_util.hpp"

using namespace streams_test;

TEST_CASE("default stream: one per device, stable, never the NULL stream", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *d0 = nullptr, *d0b = nullptr, *d1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &d0));
  EBB_REQUIRE_OK(ebb_stream_default(0, &d0b));
  EBB_REQUIRE_OK(ebb_stream_default(1, &d1));
  CHECK(d0 == d0b);
  CHECK(d0 != d1);
  int dev = -1;
  EBB_REQUIRE_OK(ebb_stream_device(d1, &dev));
  CHECK(dev == 1);
  struct CUstream_st *cu = nullptr;
  EBB_REQUIRE_OK(ebb_stream_cu(d0, &cu));
  CHECK(cu != nullptr);
  uint64_t id0 = 0, id1 = 0;
  EBB_REQUIRE_OK(ebb_stream_id(d0, &id0));
  EBB_REQUIRE_OK(ebb_stream_id(d1, &id1));
  CHECK(id0 != id1);
  ebb_stream_prio prio = EBB_PRIO_HIGH;
  EBB_REQUIRE_OK(ebb_stream_priority(d0, &prio));
  CHECK(prio == EBB_PRIO_LOW);
  EBB_CHECK_FAILS(ebb_stream_release(d0), EBB_EINVAL, "owned by ebb");
  EBB_REQUIRE_OK(ebb_stream_synchronize(d0));
  bool idle = false;
  EBB_REQUIRE_OK(ebb_stream_query(d0, &idle));
  CHECK(idle);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pool streams: round-robin per device and priority, created lazily", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_stats st0, st1;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&st0));
  std::vector<ebb_stream_t *> low;
  for (int i = 0; i < 8; i++) {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s));
    low.push_back(s);
  }
  CHECK(std::set<ebb_stream_t *>(low.begin(), low.end()).size() == 8);
  ebb_stream_t *again = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &again));
  CHECK(again == low[0]); // default EBB_STREAM_POOL_SIZE is 8
  EBB_REQUIRE_OK(ebb_stream_get_stats(&st1));
  CHECK(st1.streams_created - st0.streams_created == 8);

  ebb_stream_t *high = nullptr, *other_dev = nullptr, *def = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &high));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &other_dev));
  EBB_REQUIRE_OK(ebb_stream_default(0, &def));
  CHECK(std::set<ebb_stream_t *>(low.begin(), low.end()).count(high) == 0);
  CHECK(high != def);
  ebb_stream_prio prio = EBB_PRIO_LOW;
  EBB_REQUIRE_OK(ebb_stream_priority(high, &prio));
  CHECK(prio == EBB_PRIO_HIGH);
  int dev = -1;
  EBB_REQUIRE_OK(ebb_stream_device(other_dev, &dev));
  CHECK(dev == 1);
  EBB_CHECK_FAILS(ebb_stream_release(high), EBB_EINVAL, "pool stream");
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("pool size comes from EBB_STREAM_POOL_SIZE and a bad value is an error naming it", "[streams]") {
  {
    ScopedEnv env("EBB_STREAM_POOL_SIZE", "3");
    EbbSession session;
    EBB_NEED_DEVICES(2);
    ebb_stream_t *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
    EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_HIGH, &a));
    EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_HIGH, &b));
    EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_HIGH, &c));
    EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_HIGH, &d));
    CHECK(a != b);
    CHECK(b != c);
    CHECK(d == a);
    REQUIRE(ebb_debug_live_handles() == 0);
  }
  // One policy for bad configuration: ebb_init fails, naming the variable, the value and what
  // is accepted, and leaves ebb uninitialised.
  {
    ScopedEnv env("EBB_STREAM_POOL_SIZE", "zero");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "EBB_STREAM_POOL_SIZE='zero' is not valid; expected an integer in [1, 64]");
    CHECK_FALSE(ebb_is_initialized());
  }
  {
    ScopedEnv env("EBB_STAGING_CHUNKS", "1000");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "EBB_STAGING_CHUNKS='1000'");
  }
  {
    ScopedEnv env("EBB_STAGING_CHUNK", "4k");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "EBB_STAGING_CHUNK='4k'");
  }
}

TEST_CASE("current stream: default until set, per device and per thread", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *def0 = nullptr, *def1 = nullptr, *cur = nullptr, *p = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &def0));
  EBB_REQUIRE_OK(ebb_stream_default(1, &def1));
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  CHECK(cur == def0);
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &p));
  EBB_REQUIRE_OK(ebb_stream_set_current(p));
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  CHECK(cur == p);
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == def1);
  ebb_stream_t *seen = nullptr;
  std::thread t([&] { ebb_stream_current(0, &seen); });
  t.join();
  CHECK(seen == def0);

  // A released current stream is never handed back: the default takes its place.
  ebb_stream_t *mine = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &mine));
  EBB_REQUIRE_OK(ebb_stream_set_current(mine));
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == mine);
  EBB_REQUIRE_OK(ebb_stream_release(mine));
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == def1);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("guards nest, switch the device, and restore both on exit", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *def0 = nullptr, *def1 = nullptr, *a = nullptr, *b = nullptr, *c = nullptr, *cur = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &def0));
  EBB_REQUIRE_OK(ebb_stream_default(1, &def1));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &a));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_HIGH, &b));
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &c));
  int dev = -1;
  ebb_stream_guard g1, g2, g3;
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g1, a));
  EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
  CHECK(dev == 1);
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == a);
  {
    EBB_REQUIRE_OK(ebb_stream_guard_enter(&g2, b));
    EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
    CHECK(cur == b);
    {
      EBB_REQUIRE_OK(ebb_stream_guard_enter(&g3, c));
      EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
      CHECK(dev == 0);
      EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
      CHECK(cur == c);
      EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
      CHECK(cur == b);
      EBB_REQUIRE_OK(ebb_stream_guard_exit(&g3));
    }
    EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
    CHECK(dev == 1);
    EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
    CHECK(cur == def0);
    EBB_REQUIRE_OK(ebb_stream_guard_exit(&g2));
  }
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == a);
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g1));
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == def1);
  EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
  CHECK(dev == 0);
  EBB_CHECK_FAILS(ebb_stream_guard_exit(&g1), EBB_ESTATE, "already exited");
  EBB_CHECK_FAILS(ebb_stream_guard_enter(nullptr, a), EBB_EINVAL, "guard is NULL");
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The stream a guard restores must be the very stream that was current: the generation is
// checked, not only that the slot holds a live stream. Here the previous stream is released
// inside the guard and its slot is taken by a new stream before the exit (exit restored the new
// stream, a stranger to the caller).
TEST_CASE("guards: exit restores the previous stream only while it is the same stream", "[streams]") {
  EbbSession session;
  ebb_stream_t *a = nullptr, *b = nullptr, *c = nullptr, *def = nullptr, *cur = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &def));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &a));
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &b));
  EBB_REQUIRE_OK(ebb_stream_set_current(a));
  ebb_stream_guard g;
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, b));
  EBB_REQUIRE_OK(ebb_stream_release(a));
  churn_streams(0, 1024);
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &c));
  REQUIRE(c == a); // the new stream took the previous stream's slot
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  CHECK(cur == def);
  EBB_REQUIRE_OK(ebb_stream_release(c));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Guards exited out of order (or on a thread that did not enter them) are refused and change
// nothing: the message names the guard that is innermost, which must be exited first.
TEST_CASE("guards: exiting a guard that is not the innermost is EBB_EINVAL and changes nothing", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *a = nullptr, *b = nullptr, *def0 = nullptr, *def1 = nullptr, *cur = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &def0));
  EBB_REQUIRE_OK(ebb_stream_default(1, &def1));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &a));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &b));
  EBB_REQUIRE_OK(ebb_dev_set_current(0));
  int dev = -1;
  ebb_stream_guard g1, g2;
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g1, a));
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g2, b));
  char inner[32];
  std::snprintf(inner, sizeof inner, "%p", static_cast<void *>(&g2));
  EBB_CHECK_FAILS(ebb_stream_guard_exit(&g1), EBB_EINVAL, std::string("innermost guard is ") + inner);
  EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
  CHECK(dev == 0);
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  CHECK(cur == b);
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == a);
  // Another thread has no guard of its own: g2 is not its innermost either.
  std::string other_msg;
  ebb_status other = EBB_OK;
  std::thread([&] {
    other = ebb_stream_guard_exit(&g2);
    other_msg = ebb_last_error();
  }).join();
  CHECK(other == EBB_EINVAL);
  CHECK(other_msg.find("no guard is entered on this thread") != std::string::npos);
  // In order, both exits work and restore what was there before the first enter.
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g2));
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == a);
  EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
  CHECK(dev == 1);
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g1));
  EBB_REQUIRE_OK(ebb_dev_get_current(&dev));
  CHECK(dev == 0);
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  CHECK(cur == def0);
  EBB_REQUIRE_OK(ebb_stream_current(1, &cur));
  CHECK(cur == def1);
  EBB_CHECK_FAILS(ebb_stream_guard_exit(&g1), EBB_ESTATE, "already exited");
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Two threads release one stream at once: one succeeds, the other reads it as released; neither
// touches the driver stream the winner destroys (checked under tsan and asan).
TEST_CASE("created streams: a release racing another release of the same stream", "[streams][threads]") {
  EbbSession session;
  for (int round = 0; round < 200; round++) {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    std::atomic<int> go{0};
    ebb_status st[2] = {EBB_OK, EBB_OK};
    std::thread th[2];
    for (int i = 0; i < 2; i++)
      th[i] = std::thread([&, i] {
        while (!go.load(std::memory_order_acquire)) {
        }
        st[i] = ebb_stream_release(s);
      });
    go.store(1, std::memory_order_release);
    for (auto &x : th) x.join();
    CHECK(((st[0] == EBB_OK) != (st[1] == EBB_OK)));
    CHECK((st[0] == EBB_EFREED || st[1] == EBB_EFREED));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("created streams: release, double release, use after release", "[streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &s));
  CHECK(ebb_debug_live_handles() == 1);
  ebb_stream_prio prio = EBB_PRIO_LOW;
  EBB_REQUIRE_OK(ebb_stream_priority(s, &prio));
  CHECK(prio == EBB_PRIO_HIGH);
  uint64_t id = 0;
  EBB_REQUIRE_OK(ebb_stream_id(s, &id));
  const std::string sid = "stream " + std::to_string(id);
  ebb_stream_info info{};
  EBB_REQUIRE_OK(ebb_stream_get_info(s, &info));  // the three getters in one call
  CHECK(info.device == 0);
  CHECK(info.prio == EBB_PRIO_HIGH);
  CHECK(info.id == id);
  EBB_CHECK_FAILS(ebb_stream_get_info(s, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_stream_get_info(nullptr, &info), EBB_EINVAL, "stream is NULL");
  EBB_REQUIRE_OK(ebb_stream_release(s));
  CHECK(ebb_debug_live_handles() == 0);
  info.id = 12345;
  EBB_CHECK_FAILS(ebb_stream_get_info(s, &info), EBB_EFREED, sid);
  CHECK(info.id == 12345);  // written only on success
  EBB_CHECK_FAILS(ebb_stream_release(s), EBB_EFREED, sid);
  EBB_CHECK_FAILS(ebb_stream_release(s), EBB_EFREED, "released");
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EFREED, sid);
  bool idle = false;
  EBB_CHECK_FAILS(ebb_stream_query(s, &idle), EBB_EFREED, "released");
  EBB_CHECK_FAILS(ebb_stream_set_current(s), EBB_EFREED, "released");
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  EBB_CHECK_FAILS(ebb_event_record(e, s), EBB_EFREED, sid);
  EBB_CHECK_FAILS(ebb_event_wait(e, s), EBB_EFREED, sid);
  int x = 0, y = 0;
  EBB_CHECK_FAILS(ebb_copy_async(&x, &y, sizeof x, s), EBB_EFREED, sid);
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_CHECK_FAILS(ebb_event_release(e), EBB_EFREED, "released");
  bool done = false;
  EBB_CHECK_FAILS(ebb_event_query(e, &done), EBB_EFREED, "event");

  // Ids are never reused, even when the slot is.
  std::set<uint64_t> ids{id};
  for (int i = 0; i < 100; i++) {
    ebb_stream_t *t = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(i % 2, EBB_PRIO_LOW, &t));
    uint64_t tid = 0;
    EBB_REQUIRE_OK(ebb_stream_id(t, &tid));
    CHECK(ids.insert(tid).second);
    EBB_REQUIRE_OK(ebb_stream_release(t));
  }
  // The slot of `s` is still quarantined: still reported as released.
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EFREED, sid);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("argument errors: NULL, wrong device, bad priority and flags, wrong handle kind", "[streams]") {
  EbbSession session;
  ebb_stream_t *s = nullptr;
  ebb_event_t *e = nullptr;
  EBB_CHECK_FAILS(ebb_stream_default(0, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_default(7, &s), EBB_EDEVICE, "device 7");
  EBB_CHECK_FAILS(ebb_stream_default(-1, &s), EBB_EDEVICE, "-1");
  EBB_CHECK_FAILS(ebb_stream_from_pool(2, EBB_PRIO_LOW, &s), EBB_EDEVICE, "device 2");
  EBB_CHECK_FAILS(ebb_stream_create(9, EBB_PRIO_LOW, &s), EBB_EDEVICE, "device 9");
  EBB_CHECK_FAILS(ebb_stream_current(5, &s), EBB_EDEVICE, "device 5");
  EBB_CHECK_FAILS(ebb_event_create(3, 0, &e), EBB_EDEVICE, "device 3");
  EBB_CHECK_FAILS(ebb_stream_create(0, static_cast<ebb_stream_prio>(4), &s), EBB_EINVAL, "priority 4");
  EBB_CHECK_FAILS(ebb_event_create(0, 8, &e), EBB_EINVAL, "flags");
  EBB_CHECK_FAILS(ebb_stream_release(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_synchronize(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_set_current(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_wait_stream(nullptr, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_event_release(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_event_synchronize(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_get_stats(nullptr), EBB_EINVAL, "NULL");
  EBB_REQUIRE_OK(ebb_stream_default(0, &s));
  EBB_REQUIRE_OK(ebb_event_create(0, 0, &e));
  EBB_CHECK_FAILS(ebb_event_record(nullptr, s), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_event_record(e, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_stream_host_func(s, nullptr, nullptr), EBB_EINVAL, "fn is NULL");
  EBB_CHECK_FAILS(ebb_stream_launch(s, nullptr, &e, nullptr), EBB_EINVAL, "kernel");
  // A handle of the other kind is named as such.
  EBB_CHECK_FAILS(ebb_stream_synchronize(reinterpret_cast<ebb_stream_t *>(e)), EBB_EINVAL, "an event, not a stream");
  EBB_CHECK_FAILS(ebb_event_synchronize(reinterpret_cast<ebb_event_t *>(s)), EBB_EINVAL, "a stream, not an event");
  EBB_REQUIRE_OK(ebb_event_release(e));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("calls before ebb_init fail with EBB_ENOTINIT, and init/shutdown cycles work", "[streams]") {
  ebb_stream_t *s = nullptr;
  ebb_event_t *e = nullptr;
  ebb_stream_stats stats;
  EBB_CHECK_FAILS(ebb_stream_default(0, &s), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_stream_create(0, EBB_PRIO_LOW, &s), EBB_ENOTINIT, "ebb_stream_create");
  EBB_CHECK_FAILS(ebb_stream_current(0, &s), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_stream_release(nullptr), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_event_create(0, 0, &e), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_stream_get_stats(&stats), EBB_ENOTINIT, "ebb_init");
  int x = 0, y = 0;
  EBB_CHECK_FAILS(ebb_copy_async(&x, &y, sizeof x, nullptr), EBB_ENOTINIT, "ebb_init");

  for (int round = 0; round < 3; round++) {
    EBB_REQUIRE_OK(ebb_init());
    const int d1 = ebb_test_device_count() - 1; // device 1 where it exists
    ebb_stream_t *cur = nullptr, *p = nullptr, *mine = nullptr;
    EBB_REQUIRE_OK(ebb_stream_from_pool(d1, EBB_PRIO_HIGH, &p));
    // The current stream set in an earlier round is forgotten, never dereferenced.
    EBB_REQUIRE_OK(ebb_stream_current(d1, &cur));
    ebb_stream_t *def = nullptr;
    EBB_REQUIRE_OK(ebb_stream_default(d1, &def));
    CHECK(cur == def);
    EBB_REQUIRE_OK(ebb_stream_set_current(p));
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &mine));
    EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_TIMING, &e));
    EBB_REQUIRE_OK(ebb_event_record(e, mine));
    EBB_REQUIRE_OK(ebb_event_synchronize(e));
    EBB_REQUIRE_OK(ebb_event_release(e));
    EBB_REQUIRE_OK(ebb_stream_release(mine));
    ebb_stream_stats st;
    EBB_REQUIRE_OK(ebb_stream_get_stats(&st));
    // Counters restart with each ebb_init: e's timing event, and the plain one the release of
    // `mine` recorded its last work with (now back in the pool).
    CHECK(st.events_created == 2);
    REQUIRE(ebb_debug_live_handles() == 0);
    EBB_REQUIRE_OK(ebb_shutdown());
  }
}

TEST_CASE("stream order: work on one stream runs in issue order", "[streams][order]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s));
  PinnedBuf buf(200 * sizeof(int)), count(sizeof(int));
  *count.ints() = 0;
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(s, k.gate, &ga, nullptr));
  for (int i = 0; i < 200; i++) {
    AppendArgs a{buf.ints(), count.ints(), i};
    EBB_REQUIRE_OK(ebb_stream_launch(s, k.append, &a, nullptr));
  }
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  CHECK_FALSE(idle);
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  REQUIRE(*count.ints() == 200);
  bool in_order = true;
  for (int i = 0; i < 200; i++) in_order = in_order && buf.ints()[i] == i;
  CHECK(in_order);
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  CHECK(idle);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("events: record, query, synchronize, wait, and a never-recorded event is complete", "[streams][event]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *a = nullptr, *b = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &a));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &b));
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  int dev = -1;
  EBB_REQUIRE_OK(ebb_event_device(e, &dev));
  CHECK(dev == 0);
  bool done = false;
  EBB_REQUIRE_OK(ebb_event_query(e, &done));
  CHECK(done);
  EBB_REQUIRE_OK(ebb_event_wait(e, b)); // never recorded: nothing to wait for
  EBB_REQUIRE_OK(ebb_event_synchronize(e));

  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(a, k.gate, &ga, nullptr));
  EBB_REQUIRE_OK(ebb_event_record(e, a));
  EBB_REQUIRE_OK(ebb_event_query(e, &done));
  CHECK_FALSE(done);
  // b waits for a's gate through the event; its own work stays behind it.
  std::atomic<long> ran{0};
  IncArgs ia{&ran};
  EBB_REQUIRE_OK(ebb_event_wait(e, b));
  EBB_REQUIRE_OK(ebb_stream_launch(b, k.inc, &ia, nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(ran.load() == 0);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    open.store(1, std::memory_order_release);
  });
  EBB_REQUIRE_OK(ebb_event_synchronize(e)); // parks until the opener runs
  opener.join();
  EBB_REQUIRE_OK(ebb_event_query(e, &done));
  CHECK(done);
  EBB_REQUIRE_OK(ebb_stream_synchronize(b));
  CHECK(ran.load() == 1);
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_stream_release(a));
  EBB_REQUIRE_OK(ebb_stream_release(b));
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A new event's driver event may come from the pool with a record of its previous owner still
// pending. Never recorded by its new owner, it must read as complete all the same.
TEST_CASE("events: a never-recorded event is complete even when its pooled driver event is busy", "[streams][event]") {
  EbbSession session;
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(s, gate_host_fn, &open)); // holds s until opened
  bool done = true;
  for (int i = 0; i < 4; i++) { // leave a few driver events in the pool with pending records
    ebb_event_t *old = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &old));
    EBB_REQUIRE_OK(ebb_event_record(old, s));
    EBB_REQUIRE_OK(ebb_event_query(old, &done));
    CHECK_FALSE(done);
    EBB_REQUIRE_OK(ebb_event_release(old));
  }
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  done = false;
  EBB_REQUIRE_OK(ebb_event_query(e, &done));
  CHECK(done);
  if (!done) open.store(1, std::memory_order_release); // (else the synchronize would wait for ever)
  EBB_REQUIRE_OK(ebb_event_synchronize(e)); // returns at once: the gate is still closed
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("events across devices: record needs the event's device, wait works from any device", "[streams][event]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *s0 = nullptr, *s1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s0));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &s1));
  ebb_event_t *e0 = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e0));
  ebb_clear_error();
  REQUIRE(ebb_event_record(e0, s1) == EBB_EDEVICE);
  std::string msg = ebb_last_error();
  INFO(msg);
  CHECK(msg.find("device 0") != std::string::npos);
  CHECK(msg.find("device 1") != std::string::npos);

  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(s0, k.gate, &ga, nullptr));
  EBB_REQUIRE_OK(ebb_event_record(e0, s0));
  std::atomic<long> ran{0};
  IncArgs ia{&ran};
  EBB_REQUIRE_OK(ebb_event_wait(e0, s1));
  EBB_REQUIRE_OK(ebb_stream_launch(s1, k.inc, &ia, nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(ran.load() == 0); // device 1 is held by device 0's gate
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  CHECK(ran.load() == 1);
  EBB_REQUIRE_OK(ebb_event_release(e0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("ebb_stream_wait_stream and host functions order across streams", "[streams][order]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *producer = nullptr, *consumer = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &producer));
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_HIGH, &consumer));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(consumer, consumer)); // a no-op
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(producer, k.gate, &ga, nullptr));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(consumer, producer));
  std::atomic<int> flag{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(consumer, [](void *u) { static_cast<std::atomic<int> *>(u)->store(1); }, &flag));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(flag.load() == 0);
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(consumer));
  CHECK(flag.load() == 1);
  EBB_REQUIRE_OK(ebb_stream_release(producer));
  EBB_REQUIRE_OK(ebb_stream_release(consumer));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elapsed: timing events only, one device, recorded and complete", "[streams][event]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s = nullptr, *s1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &s1));
  ebb_event_t *t0 = nullptr, *t1 = nullptr, *plain = nullptr, *other = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_TIMING, &t0));
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_TIMING, &t1));
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &plain));
  EBB_REQUIRE_OK(ebb_event_create(1, EBB_EVENT_TIMING, &other));
  float ms = -1;
  EBB_CHECK_FAILS(ebb_event_elapsed(t0, t1, &ms), EBB_ESTATE, "never recorded");
  EBB_REQUIRE_OK(ebb_event_record(t0, s));
  EBB_REQUIRE_OK(ebb_event_record(plain, s));
  EBB_REQUIRE_OK(ebb_event_record(t1, s));
  EBB_REQUIRE_OK(ebb_event_record(other, s1));
  EBB_REQUIRE_OK(ebb_event_synchronize(t1));
  EBB_REQUIRE_OK(ebb_event_synchronize(other));
  EBB_CHECK_FAILS(ebb_event_elapsed(t0, plain, &ms), EBB_EINVAL, "EBB_EVENT_TIMING");
  EBB_CHECK_FAILS(ebb_event_elapsed(plain, t1, &ms), EBB_EINVAL, "start event");
  EBB_CHECK_FAILS(ebb_event_elapsed(t0, other, &ms), EBB_EDEVICE, "device 1");
  EBB_CHECK_FAILS(ebb_event_elapsed(t0, t1, nullptr), EBB_EINVAL, "NULL");
  EBB_REQUIRE_OK(ebb_event_elapsed(t0, t1, &ms));
  CHECK(ms >= 0.0f);
  for (ebb_event_t *e : {t0, t1, plain, other}) EBB_REQUIRE_OK(ebb_event_release(e));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("event pool: 10^4 create/release cycles reuse one driver event", "[streams][event][stats]") {
  EbbSession session;
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &s));
  ebb_stream_stats before, after;
  ebb_event_t *warm = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &warm));
  EBB_REQUIRE_OK(ebb_event_release(warm));
  EBB_REQUIRE_OK(ebb_stream_get_stats(&before));
  for (int i = 0; i < 10000; i++) {
    ebb_event_t *e = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
    EBB_REQUIRE_OK(ebb_event_record(e, s));
    EBB_REQUIRE_OK(ebb_event_release(e));
  }
  // wait_stream borrows pooled events too.
  ebb_stream_t *p = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &p));
  for (int i = 0; i < 1000; i++) EBB_REQUIRE_OK(ebb_stream_wait_stream(p, s));
  EBB_REQUIRE_OK(ebb_stream_get_stats(&after));
  CHECK(after.events_created == before.events_created);
  CHECK(after.event_pool_hits - before.event_pool_hits == 11000);
  EBB_REQUIRE_OK(ebb_stream_synchronize(p));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("the last shutdown refuses while a stream or event is live - handles from before a completed shutdown read EFREED", "[streams][init]") {
  EBB_REQUIRE_OK(ebb_init());
  ebb_stream_t *s = nullptr, *def = nullptr, *released = nullptr;
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  EBB_REQUIRE_OK(ebb_stream_default(0, &def));
  EBB_REQUIRE_OK(ebb_stream_create(ebb_test_device_count() - 1, EBB_PRIO_HIGH, &released)); // device 1 where it exists
  EBB_REQUIRE_OK(ebb_stream_release(released));
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_EBUSY, "streams (ebb_stream_create): 1, events (ebb_event_create): 1");
  // Nothing was torn down: the handles still work.
  CHECK(ebb_is_initialized());
  EBB_REQUIRE_OK(ebb_event_record(e, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_EBUSY, "streams (ebb_stream_create): 1");
  EBB_REQUIRE_OK(ebb_stream_release(s));
  EBB_REQUIRE_OK(ebb_shutdown());
  // A new session: every handle of the old one, caller-owned or ebb's, is a released handle.
  EbbSession session;
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EFREED, "was released by ebb_stream_release");
  EBB_CHECK_FAILS(ebb_stream_synchronize(def), EBB_EFREED, "is from before the last completed ebb_shutdown");
  CHECK(std::string(ebb_last_error()).find("ebb_stream_release") == std::string::npos);  // not a release's
  EBB_CHECK_FAILS(ebb_stream_release(released), EBB_EFREED, "released");
  EBB_CHECK_FAILS(ebb_event_release(e), EBB_EFREED, "released");
  ebb_stream_t *def2 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &def2));
  EBB_REQUIRE_OK(ebb_stream_synchronize(def2));
  REQUIRE(ebb_debug_live_handles() == 0);
}
