// Composite graphs through the engine: a 2-layer MLP (matmul, bias, relu or
// gelu, matmul, a loss) and layer_norm + softmax + cross_entropy against finite differences on
// the CPU and on every device; the same graph twice gives the same gradients bit for bit; a node
// failing mid-graph ends the task with its name and the engine carries on; 16 threads of
// backward and grad() calls on shared leaves sum exactly, and concurrent grad() calls on one
// retained graph each get the whole gradient.
#include <atomic>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Leaf {
  std::vector<int64_t> shape;
  std::vector<double> v;
};

Leaf rnd(std::vector<int64_t> shape, unsigned seed, double lo = -1, double hi = 1) {
  return Leaf{shape, values(numel_of(shape), seed, lo, hi)};
}

using LossFn = std::function<ebb_status(int dev, const std::vector<ebb_tensor_t *> &, ebb_tensor_t **)>;

std::vector<Tensor> leaves(int dev, const std::vector<Leaf> &ls, bool requires_grad) {
  std::vector<Tensor> ts;
  for (auto &l : ls) {
    ts.push_back(make(dev, EBB_F64, l.shape, l.v));
    if (requires_grad) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(ts.back(), true));
  }
  return ts;
}

std::vector<ebb_tensor_t *> ptrs(const std::vector<Tensor> &ts) {
  std::vector<ebb_tensor_t *> p;
  for (auto &t : ts) p.push_back(t.get());
  return p;
}

double loss_at(int dev, const std::vector<Leaf> &ls, const LossFn &f) {
  bool was;
  ebb_grad_set_enabled(false, &was);
  auto ts = leaves(dev, ls, false);
  Tensor l;
  ebb_status st = f(dev, ptrs(ts), l.out());
  ebb_grad_set_enabled(was, nullptr);
  EBB_REQUIRE_OK(st);
  return read(l)[0];
}

// The gradients of every leaf after one backward (f64 values read back).
std::vector<std::vector<double>> backward_grads(int dev, const std::vector<Leaf> &ls, const LossFn &f) {
  auto ts = leaves(dev, ls, true);
  Tensor l;
  EBB_REQUIRE_OK(f(dev, ptrs(ts), l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  std::vector<std::vector<double>> gs;
  for (auto &t : ts) {
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
    REQUIRE(g.get() != nullptr);
    gs.push_back(read(g));
  }
  return gs;
}

// Every element of every leaf's gradient against a central difference of the loss.
void check_against_fd(int dev, const std::vector<Leaf> &ls, const LossFn &f, double tol = 1e-6) {
  auto gs = backward_grads(dev, ls, f);
  for (size_t i = 0; i < ls.size(); i++)
    for (size_t j = 0; j < ls[i].v.size(); j++) {
      auto plus = ls, minus = ls;
      const double h = 1e-6;
      plus[i].v[j] += h;
      minus[i].v[j] -= h;
      double num = (loss_at(dev, plus, f) - loss_at(dev, minus, f)) / (2 * h);
      INFO("leaf " << i << " element " << j << ": analytic " << gs[i][j] << " numeric " << num);
      CHECK(std::fabs(gs[i][j] - num) <= tol + 1e-5 * std::fabs(num));
    }
}

// x [4,3] -> matmul W1 [3,5] + b1 [5] -> relu or gelu -> matmul W2 [5,2] + b2 [2] -> mse_loss
// against a target, or cross_entropy against class indices.
LossFn mlp(bool gelu, bool ce) {
  return [gelu, ce](int dev, const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    Tensor x = make(dev, EBB_F64, {4, 3}, values(12, 100)), a, b, h, c, o;
    ebb_status st = ebb_op_matmul(x, p[0], a.out());
    if (!st) st = ebb_op_add(a, p[1], b.out());
    if (!st) st = gelu ? ebb_op_gelu(b, h.out()) : ebb_op_relu(b, h.out());
    if (!st) st = ebb_op_matmul(h, p[2], c.out());
    if (!st) st = ebb_op_add(c, p[3], o.out());
    if (!st && ce) {
      Tensor target = make(dev, EBB_I64, {4}, {1, 0, 1, 1});
      st = ebb_op_cross_entropy(o, target, out);
    } else if (!st) {
      Tensor target = make(dev, EBB_F64, {4, 2}, values(8, 101));
      st = ebb_op_mse_loss(o, target, out);
    }
    return st;
  };
}

std::vector<Leaf> mlp_leaves() {
  // b1 away from zero on most units so relu's kink stays far from the central difference.
  return {rnd({3, 5}, 1), rnd({5}, 2, 0.2, 0.8), rnd({5, 2}, 3), rnd({2}, 4)};
}

// layer_norm over the last dim (with weight and bias) -> matmul -> cross_entropy, plus a term
// through softmax of the normalised input weighted by fixed values.
LossFn ln_softmax_ce() {
  return [](int dev, const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    Tensor target = make(dev, EBB_I64, {3}, {2, 0, 1}), c = make(dev, EBB_F64, {3, 4}, values(12, 102));
    Tensor ln, lg, ce, sm, smc, s;
    ebb_status st = ebb_op_layer_norm(p[0], 1, p[1], p[2], 1e-5, ln.out());
    if (!st) st = ebb_op_matmul(ln, p[3], lg.out());
    if (!st) st = ebb_op_cross_entropy(lg, target, ce.out());
    if (!st) st = ebb_op_softmax(ln, 1, sm.out());
    if (!st) st = ebb_op_mul(sm, c, smc.out());
    if (!st) st = ebb_op_sum(smc, nullptr, 0, false, s.out());
    if (!st) st = ebb_op_add(ce, s, out);
    return st;
  };
}

// The same MLP with ebb_op_linear (w [out, in]); with `bias` false the second layer has none.
// x has two leading dims, so linear flattens them.
LossFn mlp_linear(bool bias) {
  return [bias](int dev, const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    Tensor x = make(dev, EBB_F64, {2, 2, 3}, values(12, 103)), a, h, o;
    Tensor target = make(dev, EBB_F64, {2, 2, 2}, values(8, 104));
    ebb_status st = ebb_op_linear(x, p[0], p[1], a.out());
    if (!st) st = ebb_op_gelu(a, h.out());
    if (!st) st = ebb_op_linear(h, p[2], bias ? p[3] : nullptr, o.out());
    if (!st) st = ebb_op_mse_loss(o, target, out);
    return st;
  };
}

std::vector<Leaf> ln_leaves() { return {rnd({3, 4}, 5), rnd({4}, 6, 0.5, 1.5), rnd({4}, 7), rnd({4, 3}, 8)}; }

}  // namespace

TEST_CASE("composite: a 2-layer MLP with bias, relu or gelu and a loss matches finite differences on every device",
          "[autograd][composite]") {
  EbbSession session;
  for (int dev : devices())
    for (int variant = 0; variant < 3; variant++) {
      bool gelu = variant != 0, ce = variant == 2;
      INFO(dev_name(dev) << (gelu ? " gelu" : " relu") << (ce ? " cross_entropy" : " mse_loss"));
      check_against_fd(dev, mlp_leaves(), mlp(gelu, ce));
    }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("composite: an MLP of ebb_op_linear layers, with and without a bias, matches finite differences on every device",
          "[autograd][composite][linear]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    const std::vector<Leaf> ls = {rnd({5, 3}, 11), rnd({5}, 12), rnd({2, 5}, 13), rnd({2}, 14)};
    check_against_fd(dev, ls, mlp_linear(true));
    check_against_fd(dev, {ls[0], ls[1], ls[2]}, mlp_linear(false));
    // The node: LinearBackward, whose edges go to x's producer (none: x is a constant), w and b.
    auto ts = leaves(dev, ls, true);
    Tensor x = make(dev, EBB_F64, {4, 3}, values(12, 15)), y, y2;
    EBB_REQUIRE_OK(ebb_op_linear(x, ts[0], ts[1], y.out()));
    const ebb_node_t *n = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &n, nullptr));
    REQUIRE(n != nullptr);
    CHECK(std::string(ebb_node_name(n)) == "LinearBackward");
    EBB_REQUIRE_OK(ebb_op_linear(x, ts[0], nullptr, y2.out()));  // no bias: still recorded
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y2, &n, nullptr));
    REQUIRE(n != nullptr);
    CHECK(std::string(ebb_node_name(n)) == "LinearBackward");
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("composite: layer_norm, softmax and cross_entropy match finite differences on every device", "[autograd][composite]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    check_against_fd(dev, ln_leaves(), ln_softmax_ce());
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("composite: the same graph twice gives bitwise the same gradients, on the CPU and on a device", "[autograd][composite][determinism]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto a = backward_grads(dev, mlp_leaves(), mlp(true, true)), b = backward_grads(dev, mlp_leaves(), mlp(true, true));
    CHECK(a == b);
    auto c = backward_grads(dev, ln_leaves(), ln_softmax_ce()), d = backward_grads(dev, ln_leaves(), ln_softmax_ce());
    CHECK(c == d);
  }
}

// The first layer's weight is large (x [4, 2^20] @ W1 [2^20, 4]): under an arena limit every
// node of the second layer runs and the first layer's MatmulBackward, asking for W1's gradient
// (16 MiB), fails. The nodes already run keep their effect (the leaves reached before: b2, W2,
// b1), W1 gets nothing, and with the limit lifted a new graph runs to the end.
TEST_CASE("composite: a node failing mid-graph ends the task with its name and the engine carries on", "[autograd][composite][errors]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  if (ndev == 0) EBB_SKIP("no device");
  const int64_t d = 1 << 20, xs[2] = {4, d}, w1s[2] = {d, 4};
  Tensor x, w1;
  EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 2, xs, 0.001, x.out()));
  EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 2, w1s, 0.001, w1.out()));
  Tensor b1 = make(0, EBB_F32, {4}, values(4, 9)), w2 = make(0, EBB_F32, {4, 2}, values(8, 10)),
         b2 = make(0, EBB_F32, {2}, values(2, 11));
  for (ebb_tensor_t *p : {w1.get(), b1.get(), w2.get(), b2.get()}) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(p, true));
  auto forward = [&](Tensor &loss) {
    Tensor a, b, h, c, o;
    EBB_REQUIRE_OK(ebb_op_matmul(x, w1, a.out()));
    EBB_REQUIRE_OK(ebb_op_add(a, b1, b.out()));
    EBB_REQUIRE_OK(ebb_op_relu(b, h.out()));
    EBB_REQUIRE_OK(ebb_op_matmul(h, w2, c.out()));
    EBB_REQUIRE_OK(ebb_op_add(c, b2, o.out()));
    EBB_REQUIRE_OK(ebb_op_sum(o, nullptr, 0, false, loss.out()));
  };
  Tensor loss;
  forward(loss);
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ebb_arena_stats s;
  EBB_REQUIRE_OK(ebb_arena_get_stats(0, &s));
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, s.reserved_bytes.current + (6 << 20)));
  const ebb_tensor_t *roots[1] = {loss.get()};
  ebb_status st = ebb_backward(roots, nullptr, 1, false, nullptr, 0);
  std::string msg = ebb_last_error();
  INFO(msg);
  CHECK(st == EBB_ENOMEM);
  CHECK(msg.find("ebb_backward: MatmulBackward (node ") == 0);
  CHECK(msg.find("for backward/MatmulBackward") != std::string::npos);
  auto grad_of = [](const Tensor &t) {
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
    return g;
  };
  CHECK(grad_of(w1).get() == nullptr);
  CHECK(grad_of(b2).get() != nullptr);
  CHECK(grad_of(w2).get() != nullptr);
  CHECK(grad_of(b1).get() != nullptr);
  // The graph's saved tensors were not freed by the failed task's unrun nodes, but its nodes that
  // ran did free theirs: a second backward through it is refused, naming a node.
  EBB_CHECK_FAILS(ebb_backward(roots, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "freed by an earlier backward");
  loss.reset();
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  for (ebb_tensor_t *p : {w1.get(), b1.get(), w2.get(), b2.get()}) EBB_REQUIRE_OK(ebb_tensor_set_grad(p, nullptr));
  Tensor loss2;
  forward(loss2);
  const ebb_tensor_t *r2[1] = {loss2.get()};
  EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
  Tensor g = grad_of(w1);
  REQUIRE(g.get() != nullptr);
  CHECK(shape_of(g) == std::vector<int64_t>{d, 4});
  loss2.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
}

// Each thread t has its own input x_t of small integers; its graph sum(x_t @ W + b) gives W the
// gradient x_t^T @ 1 and b the gradient 4 per element, exactly representable. Even calls run
// backward (adding into the shared leaves' .grad), odd calls grad() (checked against the
// thread's own gradient, and leaving .grad alone): .grad ends as the exact sum of the backward
// calls' gradients.
TEST_CASE("composite: 16 threads of backward and grad() calls on shared leaves sum exactly", "[autograd][composite][threads]") {
  EbbSession session;
  const int threads = 16, calls = kSanitized ? 50 : 1000;
  Tensor w = make(EBB_DEVICE_CPU, EBB_F64, {3, 2}, values(6, 12)), b = make(EBB_DEVICE_CPU, EBB_F64, {2}, {0.5, -0.5});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(b, true));
  auto xval = [](int t) {
    std::vector<double> v(12);
    for (int i = 0; i < 12; i++) v[i] = (double)((t * 7 + i * 3) % 11) - 5;
    return v;
  };
  auto wgrad = [&](int t) {  // x_t^T @ ones([4,2]): row r of W gets the column sum r of x_t
    auto v = xval(t);
    std::vector<double> g(6, 0);
    for (int r = 0; r < 3; r++)
      for (int i = 0; i < 4; i++) g[r * 2] += v[i * 3 + r];
    for (int r = 0; r < 3; r++) g[r * 2 + 1] = g[r * 2];
    return g;
  };
  std::atomic<int> failures{0}, wrong{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] {
      ebb_tensor_t *x = nullptr;
      const int64_t xs[2] = {4, 3};
      auto xv = xval(t);
      if (ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_F64, 2, xs, xv.data(), xv.size() * 8, &x) != EBB_OK) {
        failures++;
        return;
      }
      auto want = wgrad(t);
      for (int i = 0; i < calls; i++) {
        ebb_tensor_t *a = nullptr, *o = nullptr, *l = nullptr;
        bool ok = ebb_op_matmul(x, w, &a) == EBB_OK && ebb_op_add(a, b, &o) == EBB_OK &&
                  ebb_op_sum(o, nullptr, 0, false, &l) == EBB_OK;
        const ebb_tensor_t *r[1] = {l};
        if (ok && i % 2 == 0) {
          ok = ebb_backward(r, nullptr, 1, false, nullptr, 0) == EBB_OK;
        } else if (ok) {
          const ebb_tensor_t *in[2] = {w.get(), b.get()};
          ebb_tensor_t *g[2] = {nullptr, nullptr};
          ok = ebb_grad(r, nullptr, 1, in, 2, false, false, g) == EBB_OK;
          double gw[6] = {0}, gb[2] = {0};
          if (ok) ok = ebb_tensor_to_host(g[0], gw, sizeof gw) == EBB_OK && ebb_tensor_to_host(g[1], gb, sizeof gb) == EBB_OK;
          if (ok && (std::vector<double>(gw, gw + 6) != want || gb[0] != 4 || gb[1] != 4)) wrong++;
          for (ebb_tensor_t *p : g)
            if (p) ebb_tensor_release(p);
        }
        if (!ok) failures++;
        for (ebb_tensor_t *p : {a, o, l})
          if (p) ebb_tensor_release(p);
      }
      ebb_tensor_release(x);
    });
  for (auto &th : pool) th.join();
  CHECK(failures.load() == 0);
  CHECK(wrong.load() == 0);
  std::vector<double> want_w(6, 0);
  for (int t = 0; t < threads; t++) {
    auto g = wgrad(t);
    for (int k = 0; k < 6; k++) want_w[k] += g[k] * (calls / 2);
  }
  Tensor gw, gb;
  EBB_REQUIRE_OK(ebb_tensor_grad(w, gw.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(b, gb.out()));
  CHECK(read(gw) == want_w);
  CHECK(read(gb) == std::vector<double>(2, 4.0 * threads * (calls / 2)));
  gw.reset();
  gb.reset();
  w.reset();
  b.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("composite: concurrent grad() calls on one retained graph each get the whole gradient", "[autograd][composite][threads]") {
  EbbSession session;
  const int threads = 16, calls = kSanitized ? 20 : 200;
  auto ts = leaves(EBB_DEVICE_CPU, mlp_leaves(), true);
  Tensor l;
  EBB_REQUIRE_OK(mlp(true, true)(EBB_DEVICE_CPU, ptrs(ts), l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  const ebb_tensor_t *in[4] = {ts[0].get(), ts[1].get(), ts[2].get(), ts[3].get()};
  std::vector<std::vector<double>> ref;
  {
    ebb_tensor_t *g[4] = {nullptr, nullptr, nullptr, nullptr};
    EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, in, 4, true, false, g));
    for (ebb_tensor_t *p : g) {
      Tensor t(p);
      ref.push_back(read(t));
    }
  }
  std::atomic<int> failures{0}, wrong{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&] {
      for (int i = 0; i < calls; i++) {
        ebb_tensor_t *g[4] = {nullptr, nullptr, nullptr, nullptr};
        if (ebb_grad(roots, nullptr, 1, in, 4, true, false, g) != EBB_OK) {
          failures++;
          continue;
        }
        for (int k = 0; k < 4; k++) {
          std::vector<double> v(ref[k].size());
          if (ebb_tensor_to_host(g[k], v.data(), v.size() * 8) != EBB_OK || v != ref[k]) wrong++;
          ebb_tensor_release(g[k]);
        }
      }
    });
  for (auto &th : pool) th.join();
  CHECK(failures.load() == 0);
  CHECK(wrong.load() == 0);
  for (auto &t : ts) {
    Tensor none;
    EBB_REQUIRE_OK(ebb_tensor_grad(t, none.out()));
    CHECK(none.get() == nullptr);  // grad() never touched .grad
  }
  l.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
