// Backward calls on several threads while another thread releases the stream their graphs were
// recorded on: every call succeeds, and .grad counts every call exactly once. Without the
// timing model (many calls), under the presets' perturbation.
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "devices_test_util.hpp"

using namespace ebb_test;

namespace {

// Thread i runs `calls` backward calls of losses[i] with retain_graph, each with `around` (which
// may make a stream current for it), and, with `until`, goes on until it has made one call that
// started after `until` was set (so calls run on both sides of what the test thread does, however
// the threads are scheduled); ran[i] counts thread i's calls. The test thread waits on `done`
// and joins.
struct Callers {
  std::atomic<int> done{0}, failed{0};
  std::vector<std::string> errors;
  std::vector<int> ran;
  std::vector<std::thread> threads;
  Callers(const std::vector<Tensor> &losses, int calls, std::function<void(int, const std::function<void()> &)> around,
          const std::atomic<bool> *until = nullptr)
      : errors(losses.size()), ran(losses.size()) {
    for (size_t i = 0; i < losses.size(); i++)
      threads.emplace_back([this, &losses, calls, around, until, i] {
        const ebb_tensor_t *root = losses[i];
        for (int c = 0;; c++) {
          bool after = until && until->load();
          if (c >= calls && (!until || after)) break;
          around(c, [&] {
            if (ebb_backward(&root, nullptr, 1, true, nullptr, 0) != EBB_OK && failed.fetch_add(1) == 0) errors[i] = ebb_last_error();
          });
          ran[i]++;
          done.fetch_add(1);
          if (c + 1 >= calls && after) break;
        }
      });
  }
  void wait_for(int n) {
    while (done.load() < n) std::this_thread::yield();
  }
  void join() {
    for (auto &t : threads) t.join();
    for (auto &e : errors)
      if (!e.empty()) INFO("a failed call: " << e);
  }
};

void plain(int, const std::function<void()> &call) { call(); }

}  // namespace

TEST_CASE("threads running backward on graphs of a stream another thread releases all succeed, each counted once",
          "[autograd][streams][release][threads]") {
  EbbSession session;
  constexpr int kThreads = 4;
  const int calls = kSanitized ? 40 : 150;
  const int rounds = kSanitized ? 2 : 4;
  for (int round = 0; round < rounds; round++) {
    auto v = vals(round, 4);
    Tensor w = leaf(0, v, "w");
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    std::vector<Tensor> losses(kThreads);
    {
      OnStream g(s);  // w's AccumulateGrad and every node: recorded on s
      for (int i = 0; i < kThreads; i++) losses[(size_t)i] = sum(scale(w, (double)(i + 1)));
    }
    std::atomic<bool> released{false};
    Callers run(losses, calls, plain, &released);
    // Released once the calls are well under way; every thread makes calls after it returns.
    run.wait_for(kThreads * calls / 4);
    ebb_status rst = ebb_stream_release(s);
    released.store(true);
    int at_release = run.done.load();
    run.join();
    INFO("round " << round << ", released after " << at_release << " of " << run.done.load() << " calls");
    CHECK(rst == EBB_OK);
    CHECK(run.failed.load() == 0);
    // Thread i's loss is sum((i+1) w): each of its calls adds i+1 to every element.
    double k = 0;
    for (int i = 0; i < kThreads; i++) k += (double)run.ran[(size_t)i] * (i + 1);
    sync_all();
    CHECK(same(grad_seen(w), std::vector<double>(v.size(), k)));
  }
}

TEST_CASE("device workers, two devices and CPU-made gradients, with both streams released by another thread mid-run",
          "[autograd][streams][release][threads]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  EngineSettings keep;
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
  constexpr int kThreads = 3;
  const int calls = kSanitized ? 20 : 80;
  auto v = vals(5, 4);
  Tensor w = leaf(0, v, "w");
  ebb_stream_t *s0 = nullptr, *s1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s0));
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s1));
  std::vector<Tensor> losses(kThreads);
  for (int i = 0; i < kThreads; i++) {
    Tensor a, c;
    {
      OnStream g(s0);
      a = scale(w, (double)(i + 1));
    }
    {
      OnStream g(s1);
      Tensor b = to_dev(a, 1);
      c = to_dev(b, EBB_DEVICE_CPU);
    }
    Tensor back = to_dev(scale(c, 1.0), 0);  // a CPU node's gradient, made on the caller's stream of device 0
    OnStream g(s0);
    losses[(size_t)i] = sum(back);
  }
  Callers run(losses, calls, [&](int c, const std::function<void()> &call) {
    ebb_stream_guard g{};
    bool cur = (c & 1) && ebb_stream_guard_enter(&g, s1) == EBB_OK;  // s1 the caller's, every other call
    call();
    if (cur) ebb_stream_guard_exit(&g);
  });
  run.wait_for(kThreads * calls / 4);
  ebb_status r0 = ebb_stream_release(s0);
  run.wait_for(kThreads * calls / 2);
  ebb_status r1 = ebb_stream_release(s1);
  run.join();
  CHECK(r0 == EBB_OK);
  CHECK(r1 == EBB_OK);
  CHECK(run.failed.load() == 0);
  sync_all();
  double k = (double)calls * kThreads * (kThreads + 1) / 2;
  CHECK(same(grad_seen(w), std::vector<double>(v.size(), k)));
  EBB_CHECK_FAILS(ebb_stream_release(s0), EBB_EFREED, "released");
}
