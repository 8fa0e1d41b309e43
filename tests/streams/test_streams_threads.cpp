// Eight threads creating, using and releasing streams and events at once: records, waits across
// threads and devices, copies, pool streams and guards. Meant to run clean under TSan.
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "streams_test_util.hpp"

using namespace streams_test;

TEST_CASE("threads: 8 threads create, use and release streams and events concurrently", "[streams][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  const bool kernels = cpu_kernels();
  Kernels k;
  constexpr int kThreads = 8, kIters = 150;
  constexpr size_t kBytes = 8192;
  std::atomic<long> launched{0}, ran{0};
  std::atomic<int> failures{0};
  // Events shared between neighbours: thread t records into shared[t], thread t+1 waits on it.
  std::vector<std::atomic<ebb_event_t *>> shared(kThreads);
  for (auto &e : shared) e.store(nullptr);
  // Buffers are made here: DevBuf reports through Catch, which is not thread-safe.
  std::vector<std::unique_ptr<DevBuf>> bufs;
  for (int t = 0; t < 2 * kThreads; t++) bufs.emplace_back(new DevBuf((t / 2) % 2, kBytes));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      auto ok = [&](ebb_status st) {
        if (st != EBB_OK) {
          failures.fetch_add(1);
          // Catch2's macros are not thread-safe: report on stderr, count for the main thread.
          std::fprintf(stderr, "thread %d: %s: %s\n", t, ebb_status_name(st), ebb_last_error());
        }
        return st == EBB_OK;
      };
      const int dev = t % 2;
      const DevBuf &a = *bufs[2 * t], &b = *bufs[2 * t + 1];
      std::vector<unsigned char> host(kBytes), back(kBytes);
      for (int i = 0; i < kIters && failures.load() == 0; i++) {
        ebb_stream_t *s = nullptr, *p = nullptr;
        ebb_event_t *e = nullptr, *mine = nullptr;
        if (!ok(ebb_stream_create(dev, (i & 1) ? EBB_PRIO_HIGH : EBB_PRIO_LOW, &s))) break;
        if (!ok(ebb_stream_from_pool(dev, EBB_PRIO_LOW, &p))) break;
        ebb_stream_guard g;
        ok(ebb_stream_guard_enter(&g, p));
        if (kernels) {
          IncArgs ia{&ran};
          if (ok(ebb_stream_launch(s, k.inc, &ia, nullptr))) launched.fetch_add(1);
        }
        ok(ebb_event_create(dev, (i % 3 == 0) ? EBB_EVENT_TIMING : EBB_EVENT_DEFAULT, &e));
        ok(ebb_event_record(e, s));
        ok(ebb_event_wait(e, p));
        // Wait on a neighbour's event (maybe another device), then offer our own.
        ebb_event_t *theirs = shared[(t + kThreads - 1) % kThreads].exchange(nullptr);
        if (theirs) {
          ok(ebb_event_wait(theirs, s));
          ok(ebb_event_release(theirs));
        }
        if (ok(ebb_event_create(dev, EBB_EVENT_DEFAULT, &mine))) {
          ok(ebb_event_record(mine, p));
          ebb_event_t *old = shared[t].exchange(mine);
          if (old) ok(ebb_event_release(old));
        }
        fill_pattern(host.data(), kBytes, unsigned(t * 1000 + i));
        ok(ebb_copy_async(a.p(), host.data(), kBytes, s));
        ok(ebb_copy_async(b.p(), a.p(), kBytes, s));
        ok(ebb_copy_async(back.data(), b.p(), kBytes, s));
        ok(ebb_stream_wait_stream(p, s));
        ok(ebb_stream_synchronize(s));
        if (!check_pattern(back.data(), kBytes, unsigned(t * 1000 + i))) failures.fetch_add(1);
        ok(ebb_event_release(e));
        ok(ebb_stream_guard_exit(&g));
        ok(ebb_stream_release(s));
      }
      ebb_stream_t *def = nullptr;
      if (ok(ebb_dev_synchronize(dev)) && ok(ebb_stream_default(dev, &def))) ok(ebb_stream_synchronize(def));
    });
  }
  for (auto &th : threads) th.join();
  for (auto &e : shared) {
    ebb_event_t *left = e.exchange(nullptr);
    if (left) EBB_REQUIRE_OK(ebb_event_release(left));
  }
  CHECK(failures.load() == 0);
  for (int d = 0; d < 2; d++) EBB_REQUIRE_OK(ebb_dev_synchronize(d));
  CHECK(ran.load() == launched.load());
  ebb_stream_stats st;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&st));
  CHECK(st.event_pool_hits > 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// More released streams still busy than the first tomb table holds (64), behind one gate, and a
// host function in that very work that tries to release a stream. A release must never wait for
// other released streams' work while holding what that host function needs (were the 65th
// release to wait for the gated stream under the tomb lock, a host function releasing a stream
// would wait for that lock, and neither would go on). A release from a host function is
// refused at once (EBB_ESTATE, as CUDA forbids driver calls there), so the host thread does it.
TEST_CASE("threads: releases past the tomb table while a host function in the pending work releases a stream",
          "[streams][threads]") {
  EbbSession session;
  std::vector<ebb_stream_t *> ss(66);
  for (auto &x : ss) EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &x));
  struct RelArgs {
    ebb_stream_t *s;
    std::atomic<int> result;
  };
  RelArgs ra{nullptr, {0}};
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &ra.s));
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(ss[0], gate_host_fn, &open));
  EBB_REQUIRE_OK(ebb_stream_host_func(
      ss[0],
      [](void *u) {
        auto *r = static_cast<RelArgs *>(u);
        ebb_status st = ebb_stream_release(r->s);
        r->result.store(st == EBB_ESTATE && std::string(ebb_last_error()).find("host function") != std::string::npos ? 1 : 2);
      },
      &ra));
  for (size_t i = 1; i < ss.size(); i++) EBB_REQUIRE_OK(ebb_stream_wait_stream(ss[i], ss[0]));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    open.store(1, std::memory_order_release);
  });
  // The release the host function was refused makes a host thread, racing the main thread's
  // releases of the gated streams past the first tomb table, as the gate stays closed.
  ebb_stream_t *extra = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &extra));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(extra, ss[0]));  // busy behind the gate too
  std::atomic<ebb_status> side_st{EBB_EINTERNAL};
  std::thread releaser([&] { side_st = ebb_stream_release(extra); });
  for (auto *s : ss) EBB_REQUIRE_OK(ebb_stream_release(s)); // all busy behind the gate
  releaser.join();
  CHECK(side_st.load() == EBB_OK);
  opener.join();
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  CHECK(ra.result.load() == 1);
  EBB_REQUIRE_OK(ebb_stream_release(ra.s));  // the host function's refused release, made here
  REQUIRE(ebb_debug_live_handles() == 0);
}
