// Ops from several threads at once: each thread runs its own chain of ops on the CPU and on an
// emulated device while all of them share (retain, read, release) one input tensor; the results
// match a single-threaded run, and every handle is released at the end. Meant for tsan too.
#include <atomic>
#include <thread>
#include <vector>

#include "tensor_test_util.hpp"

using namespace ebb_test;

TEST_CASE("threads: concurrent ops on shared inputs give the single-threaded results", "[ops][threads]") {
  EbbSession session;
  auto v = values(512, 1, -1, 1);
  Tensor shared = make(0, EBB_F32, {16, 32}, v);
  Tensor shared_cpu = make(EBB_DEVICE_CPU, EBB_F32, {16, 32}, v);
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  // reference: one thread
  auto chain = [](ebb_tensor_t *x, int k, ebb_tensor_t **out) -> ebb_status {
    ebb_tensor_t *a = nullptr, *b = nullptr, *c = nullptr;
    ebb_status st = ebb_op_mul_scalar(x, (double)k, &a);
    if (!st) st = ebb_op_tanh(a, &b);
    int d = 1;
    if (!st) st = ebb_op_sum(b, &d, 1, false, &c);
    if (!st) st = ebb_op_add(c, c, out);
    if (a) ebb_tensor_release(a);
    if (b) ebb_tensor_release(b);
    if (c) ebb_tensor_release(c);
    return st;
  };
  const int nthreads = 4, rounds = 20;
  std::vector<std::vector<double>> want(nthreads);
  for (int k = 0; k < nthreads; k++) {
    Tensor r;
    EBB_REQUIRE_OK(chain(shared_cpu, k + 1, r.out()));
    want[(size_t)k] = read(r);
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < nthreads; k++)
    threads.emplace_back([&, k] {
      for (int r = 0; r < rounds; r++) {
        ebb_tensor_t *in = (k % 2) ? shared.get() : shared_cpu.get();
        if (ebb_tensor_retain(in) != EBB_OK) failures++;
        ebb_tensor_t *out = nullptr;
        if (chain(in, k + 1, &out) != EBB_OK) {
          failures++;
        } else {
          std::vector<float> got(16);
          if (ebb_tensor_to_host(out, got.data(), 16 * sizeof(float)) != EBB_OK) failures++;
          for (int i = 0; i < 16; i++)
            if (std::fabs(got[(size_t)i] - want[(size_t)k][(size_t)i]) > 1e-4) failures++;
          ebb_tensor_release(out);
        }
        ebb_tensor_release(in);
      }
    });
  for (auto &t : threads) t.join();
  CHECK(failures.load() == 0);
  shared.reset();
  shared_cpu.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}
