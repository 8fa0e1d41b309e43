// bench_engine_torch.cpp: libtorch's autograd engine on the graphs of bench_engine.c (the peer;
// built when Debian's libtorch-dev is installed). Same graphs, same timing: the forward, the
// backward from the call to its return, and the graph's release apart, per node recorded, the
// median of `reps` iterations on 1-element f32 CPU tensors built fresh each iteration.
//   bench=engine graph=<g> impl=libtorch nodes=N fwd_ns_per_node=X bwd_ns_per_node=Y free_ns_per_node=Z
// usage: ebb-bench-engine-torch [reps]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

double now_ns() {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

enum Graph { CHAIN, WIDE, TREE, REUSE, TREE_GRAD };

void run(const char *name, Graph g, int k, int reps) {
  int nleaves = g == WIDE ? 1000 : (g == TREE || g == TREE_GRAD) ? 4096 : 1;
  std::vector<double> fwd, bwd, fre;
  long nodes = 0;
  for (int r = 0; r < reps; r++) {
    std::vector<torch::Tensor> leaves;
    for (int i = 0; i < nleaves; i++) leaves.push_back(torch::full({1}, g == REUSE ? 1e-4f : 1.0f, torch::requires_grad()));
    double t0 = now_ns(), t1, t2, t3;
    {
      torch::Tensor y;
      switch (g) {
      case CHAIN:
        y = leaves[0];
        for (int i = 0; i < 10000; i++) y = i % 2 ? y + 0.0001 : y * 1.0001;
        nodes = 10000;
        break;
      case WIDE:
        for (int c = 0; c < 1000; c++) {
          torch::Tensor z = leaves[c];
          for (int i = 0; i < 10; i++) z = i % 2 ? z + 0.0001 : z * 1.0001;
          y = y.defined() ? y + z : z;
        }
        nodes = 1000 * 10 + 999;
        break;
      case TREE:
      case TREE_GRAD: {
        std::vector<torch::Tensor> level = leaves;
        for (size_t n = 4096; n > 1; n /= 2)
          for (size_t i = 0; i < n / 2; i++) level[i] = level[2 * i] + level[2 * i + 1];
        y = level[0];
        nodes = 4095;
        break;
      }
      case REUSE:
        y = leaves[0];
        for (int i = 0; i < 5000; i++) y = y * y + y;
        nodes = 10000;
        break;
      }
      t1 = now_ns();
      if (g == TREE_GRAD) {
        std::vector<torch::Tensor> in;
        for (int i = 0; i < k; i++) in.push_back(leaves[static_cast<size_t>(i) * (4096 / static_cast<size_t>(k))]);
        auto gr = torch::autograd::grad({y}, in);
        t2 = now_ns();
      } else {
        y.backward();
        t2 = now_ns();
      }
    }  // the graph goes with y
    t3 = now_ns();
    fwd.push_back((t1 - t0) / nodes);
    bwd.push_back((t2 - t1) / nodes);
    fre.push_back((t3 - t2) / nodes);
  }
  std::printf("bench=engine graph=%s impl=libtorch nodes=%ld fwd_ns_per_node=%.1f bwd_ns_per_node=%.1f free_ns_per_node=%.1f\n", name,
              nodes, median(fwd), median(bwd), median(fre));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char **argv) {
  int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  if (reps < 1) reps = 1;
  torch::set_num_threads(1);
  run("chain", CHAIN, 0, reps);
  run("wide", WIDE, 0, reps);
  run("tree", TREE, 0, reps);
  run("reuse", REUSE, 0, reps);
  run("tree_grad_1", TREE_GRAD, 1, reps);
  run("tree_grad_64", TREE_GRAD, 64, reps);
  run("tree_grad_512", TREE_GRAD, 512, reps);
  return 0;
}
