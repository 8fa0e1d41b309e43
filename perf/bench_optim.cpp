// bench_optim.cpp: one AdamW step over 100 CPU parameter tensors (10 M f32 parameters in all),
// ebb's fused step (ebb_optim_step: one pass per tensor) against torch::optim::AdamW (libtorch
// 1.13, its per-op loop), in one process, one thread each (at::set_num_threads(1)). Both start
// from the same values and gradients and take the same steps; rounds alternate which goes first;
// each prints the median of its rounds' step times:
//   bench=optim impl=<ebb|libtorch> tensors=100 params=<n> step_ms=<median>
//   bench=optim ratio=<libtorch step_ms / ebb step_ms> rounds=<r> max_abs_diff=<ebb vs libtorch params>
// usage: ebb-bench-optim [rounds (>= 7, default 9)]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ebb/ebb.h"

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void ok(ebb_status st, const char *what) {
  if (st != EBB_OK) {
    std::fprintf(stderr, "ebb-bench-optim: %s failed: %s\n", what, ebb_last_error());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char **argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  if (rounds < 7) rounds = 7;
  at::set_num_threads(1);
  ok(ebb_init(), "ebb_init");
  const int ntensors = 100;
  // Sizes alternate 150 000 and 50 000 elements: 10 M in all, as a model's mix of large weight
  // matrices and smaller ones.
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (int i = 0; i < ntensors; i++) {
    sizes.push_back(i % 2 ? 50000 : 150000);
    total += sizes.back();
  }
  std::vector<torch::Tensor> tp;
  std::vector<ebb_tensor_t *> ep;
  ebb_params_t *pl = nullptr;
  ok(ebb_params_create(&pl), "ebb_params_create");
  for (int i = 0; i < ntensors; i++) {
    torch::Tensor p = torch::randn({sizes[i]}, torch::kFloat32);
    torch::Tensor g = torch::randn({sizes[i]}, torch::kFloat32) * 0.01;
    ebb_tensor_t *e = nullptr, *eg = nullptr;
    const int64_t n = sizes[i];
    ok(ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_F32, 1, &n, p.data_ptr<float>(), (size_t)n * 4, &e), "ebb_tensor_from_host");
    ok(ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_F32, 1, &n, g.data_ptr<float>(), (size_t)n * 4, &eg), "ebb_tensor_from_host");
    ok(ebb_tensor_set_requires_grad(e, true), "ebb_tensor_set_requires_grad");
    ok(ebb_tensor_set_grad(e, eg), "ebb_tensor_set_grad");
    ok(ebb_tensor_release(eg), "ebb_tensor_release");
    ok(ebb_params_add(pl, e), "ebb_params_add");
    ep.push_back(e);
    p.set_requires_grad(true);
    p.mutable_grad() = g;
    tp.push_back(p);
  }
  ebb_adamw_options eo = ebb_adamw_defaults();
  ebb_optim_t *opt = nullptr;
  ok(ebb_optim_adamw(pl, &eo, &opt), "ebb_optim_adamw");
  ok(ebb_params_destroy(pl), "ebb_params_destroy");
  torch::optim::AdamW topt(tp, torch::optim::AdamWOptions(1e-3).betas({0.9, 0.999}).eps(1e-8).weight_decay(1e-2));

  // Warm-up: the first step allocates the state (and faults its pages in) on both sides.
  for (int w = 0; w < 2; w++) {
    ok(ebb_optim_step(opt), "ebb_optim_step");
    topt.step();
  }
  std::vector<double> te, tt;
  for (int r = 0; r < rounds; r++) {
    for (int k = 0; k < 2; k++) {
      bool ebb_turn = (k == 0) == (r % 2 == 0);
      double t0 = now_ms();
      if (ebb_turn) ok(ebb_optim_step(opt), "ebb_optim_step");
      else topt.step();
      double dt = now_ms() - t0;
      (ebb_turn ? te : tt).push_back(dt);
    }
  }
  // Both took the same steps from the same values: their parameters agree to f32 rounding.
  double maxdiff = 0;
  std::vector<float> buf;
  for (int i = 0; i < ntensors; i++) {
    buf.resize((size_t)sizes[i]);
    ok(ebb_tensor_to_host(ep[i], buf.data(), buf.size() * 4), "ebb_tensor_to_host");
    const float *q = tp[i].data_ptr<float>();
    for (size_t j = 0; j < buf.size(); j++) maxdiff = std::max(maxdiff, (double)std::fabs(buf[j] - q[j]));
  }
  double me = median(te), mt = median(tt);
  std::printf("bench=optim impl=ebb tensors=%d params=%lld step_ms=%.3f\n", ntensors, (long long)total, me);
  std::printf("bench=optim impl=libtorch tensors=%d params=%lld step_ms=%.3f\n", ntensors, (long long)total, mt);
  std::printf("bench=optim ratio=%.2f rounds=%d max_abs_diff=%.3g\n", mt / me, rounds, maxdiff);
  ok(ebb_optim_destroy(opt), "ebb_optim_destroy");
  for (auto *e : ep) ok(ebb_tensor_release(e), "ebb_tensor_release");
  ok(ebb_shutdown(), "ebb_shutdown");
  return 0;
}
