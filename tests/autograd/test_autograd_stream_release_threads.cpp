// Backward calls on several threads while another thread releases the stream their graphs were
// recorded on: every call succeeds, and .grad counts every call exactly once. Without the
// timing model (many calls), under the presets' perturbation.
#include <atomic>
#include <thread>
#include <vector>

#include "devices_test_util.hpp"

using namespace ebb_test;

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
    std::atomic<int> done{0}, failed{0};
    std::vector<std::string> errors(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; i++)
      threads.emplace_back([&, i] {
        const ebb_tensor_t *root = losses[(size_t)i];
        for (int c = 0; c < calls; c++) {
          if (ebb_backward(&root, nullptr, 1, true, nullptr, 0) != EBB_OK) {
            if (failed.fetch_add(1) == 0) errors[(size_t)i] = ebb_last_error();
          }
          done.fetch_add(1);
        }
      });
    // Released once the calls are well under way, while they go on.
    while (done.load() < kThreads * calls / 4) std::this_thread::yield();
    ebb_status rst = ebb_stream_release(s);
    int at_release = done.load();
    for (auto &t : threads) t.join();
    INFO("round " << round << ", released after " << at_release << " of " << kThreads * calls << " calls");
    for (auto &e : errors)
      if (!e.empty()) INFO("a failed call: " << e);
    CHECK(rst == EBB_OK);
    CHECK(failed.load() == 0);
    CHECK(at_release < kThreads * calls);
    // Each thread's loss is sum((i+1) w): calls * (1 + 2 + ... + kThreads) per element.
    double k = (double)calls * kThreads * (kThreads + 1) / 2;
    sync_all();
    CHECK(same(grad_seen(w), std::vector<double>(v.size(), k)));
  }
}
