// The backward engine on the calling thread (ebb_backward, ebb_grad): gradients of composite
// graphs against finite differences (an MLP; layer_norm + softmax + cross_entropy; views of
// non-leaves), partial backward, grad(), retain_graph, determinism, errors that name the node,
// and concurrent backward calls on shared leaves summing exactly.
#include <atomic>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Leaf {
  std::vector<int64_t> shape;
  std::vector<double> v;
};

// loss(leaves) -> a scalar tensor, built from the given leaf tensors.
using LossFn = std::function<ebb_status(const std::vector<ebb_tensor_t *> &, ebb_tensor_t **)>;

std::vector<Tensor> make_leaves(int dev, const std::vector<Leaf> &ls, bool requires_grad) {
  std::vector<Tensor> ts;
  for (auto &l : ls) {
    ts.push_back(make(dev, EBB_F64, l.shape, l.v));
    if (requires_grad) REQUIRE(ebb_tensor_set_requires_grad(ts.back(), true) == EBB_OK);
  }
  return ts;
}

std::vector<ebb_tensor_t *> ptrs(const std::vector<Tensor> &ts) {
  std::vector<ebb_tensor_t *> p;
  for (auto &t : ts) p.push_back(t.get());
  return p;
}

double loss_value(int dev, const std::vector<Leaf> &ls, const LossFn &f) {
  bool was;
  ebb_grad_set_enabled(false, &was);
  auto ts = make_leaves(dev, ls, false);
  Tensor l;
  ebb_status st = f(ptrs(ts), l.out());
  ebb_grad_set_enabled(was, nullptr);
  REQUIRE(st == EBB_OK);
  return read(l)[0];
}

// Backward through the engine, then every element of every leaf against a central difference.
void check_gradients(int dev, const std::vector<Leaf> &ls, const LossFn &f, double tol = 1e-6) {
  auto ts = make_leaves(dev, ls, true);
  Tensor l;
  REQUIRE(f(ptrs(ts), l.out()) == EBB_OK);
  const ebb_tensor_t *roots[1] = {l.get()};
  INFO("backward: " << ebb_last_error());
  REQUIRE(ebb_backward(roots, nullptr, 1, false, nullptr, 0) == EBB_OK);
  for (size_t i = 0; i < ls.size(); i++) {
    Tensor g;
    REQUIRE(ebb_tensor_grad(ts[i], g.out()) == EBB_OK);
    REQUIRE(g.get() != nullptr);
    auto an = read(g);
    REQUIRE(an.size() == ls[i].v.size());
    for (size_t j = 0; j < an.size(); j++) {
      auto plus = ls, minus = ls;
      const double h = 1e-6;
      plus[i].v[j] += h;
      minus[i].v[j] -= h;
      double num = (loss_value(dev, plus, f) - loss_value(dev, minus, f)) / (2 * h);
      INFO("leaf " << i << " element " << j << ": analytic " << an[j] << " numeric " << num);
      CHECK(std::fabs(an[j] - num) <= tol + 1e-5 * std::fabs(num));
    }
  }
}

Leaf rnd(std::vector<int64_t> shape, unsigned seed, double lo = -1, double hi = 1) {
  return Leaf{shape, values(numel_of(shape), seed, lo, hi)};
}

// A two-layer MLP's MSE loss on `dev` over fixed data: x [4,3] -> matmul p[0] [3,5] + p[1] ->
// tanh -> matmul p[2] [5,2] + p[3] -> mse against a fixed target [4,2].
LossFn mlp_loss(int dev) {
  auto xv = values(4 * 3, 100), tv = values(4 * 2, 101);
  return [dev, xv, tv](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    Tensor x = make(dev, EBB_F64, {4, 3}, xv), target = make(dev, EBB_F64, {4, 2}, tv), a, b, h, c, o;
    ebb_status st = ebb_op_matmul(x, p[0], a.out());
    if (!st) st = ebb_op_add(a, p[1], b.out());
    if (!st) st = ebb_op_tanh(b, h.out());
    if (!st) st = ebb_op_matmul(h, p[2], c.out());
    if (!st) st = ebb_op_add(c, p[3], o.out());
    if (!st) st = ebb_op_mse_loss(o, target, out);
    return st;
  };
}

}  // namespace

TEST_CASE("engine: an MLP's gradients match finite differences", "[autograd][engine]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    LossFn mlp = mlp_loss(dev);
    check_gradients(dev, {rnd({3, 5}, 1), rnd({5}, 2), rnd({5, 2}, 3), rnd({2}, 4)}, mlp);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: layer_norm, softmax and cross_entropy, views and ops on views of non-leaves", "[autograd][engine]") {
  EbbSession session;
  LossFn net = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    const int64_t two = 3;
    Tensor target, ln, sm, lsm, s, t, tt, u, sl, ce;
    std::vector<double> tg = {2, 0, 1};
    target = make(EBB_DEVICE_CPU, EBB_I64, {3}, tg);
    (void)two;
    ebb_status st = ebb_op_layer_norm(p[0], 1, p[1], p[2], 1e-5, ln.out());
    if (!st) st = ebb_op_softmax(ln, 1, sm.out());
    if (!st) st = ebb_op_mul(sm, ln, s.out());                 // a node used twice (ln)
    if (!st) st = ebb_tensor_transpose(s, 0, 1, t.out());      // a view of a non-leaf
    if (!st) st = ebb_tensor_slice(t, 0, 1, 4, 1, sl.out());   // a view of a view
    if (!st) st = ebb_tensor_transpose(sl, 0, 1, tt.out());
    if (!st) st = ebb_op_cross_entropy(tt, target, ce.out());
    if (!st) st = ebb_op_sum(sl, nullptr, 0, false, u.out());
    if (!st) st = ebb_op_add(ce, u, out);
    return st;
  };
  check_gradients(EBB_DEVICE_CPU, {rnd({3, 4}, 5), rnd({4}, 6, 0.5, 1.5), rnd({4}, 7)}, net);
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: grad() returns gradients without touching .grad, partial backward writes only its inputs",
          "[autograd][engine][partial]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 8), rnd({3}, 9), rnd({3}, 10)}, true);
  auto build = [&](Tensor &loss) {
    Tensor ab, abc;
    REQUIRE(ebb_op_mul(ts[0], ts[1], ab.out()) == EBB_OK);
    REQUIRE(ebb_op_mul(ab, ts[2], abc.out()) == EBB_OK);
    REQUIRE(ebb_op_sum(abc, nullptr, 0, false, loss.out()) == EBB_OK);
  };
  auto a = read(ts[0]), b = read(ts[1]), c = read(ts[2]);
  Tensor loss;
  build(loss);
  const ebb_tensor_t *roots[1] = {loss.get()}, *in[2] = {ts[0].get(), ts[2].get()};
  ebb_tensor_t *g[2] = {nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, in, 2, true, false, g));
  Tensor g0(g[0]), g2(g[1]);
  auto r0 = read(g0), r2 = read(g2);
  for (int i = 0; i < 3; i++) {
    CHECK(r0[i] == b[i] * c[i]);
    CHECK(r2[i] == a[i] * b[i]);
  }
  for (auto &t : ts) {
    Tensor none;
    EBB_REQUIRE_OK(ebb_tensor_grad(t, none.out()));
    CHECK(none.get() == nullptr);  // grad() leaves .grad alone
  }
  // backward(inputs = {b}): only b's .grad (the options form: each option by name).
  const ebb_tensor_t *only_b[1] = {ts[1].get()};
  ebb_autograd_backward_options partial = {};
  partial.retain_graph = true;
  partial.inputs = only_b;
  partial.ninputs = 1;
  EBB_REQUIRE_OK(ebb_autograd_backward(roots, 1, &partial));
  Tensor gb, ga;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[1], gb.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], ga.out()));
  REQUIRE(gb.get() != nullptr);
  CHECK(ga.get() == nullptr);
  auto rb = read(gb);
  for (int i = 0; i < 3; i++) CHECK(rb[i] == a[i] * c[i]);
  // An input the outputs do not depend on: an error, or no gradient with allow_unused.
  auto other = make_leaves(EBB_DEVICE_CPU, {rnd({2}, 11)}, true);
  const ebb_tensor_t *unused[1] = {other[0].get()};
  ebb_tensor_t *gu[1] = {nullptr};
  ebb_autograd_grad_options retain = {};
  retain.retain_graph = true;
  EBB_CHECK_FAILS(ebb_autograd_grad(roots, 1, unused, 1, gu, &retain), EBB_EINVAL,
                  "inputs[0] (f64[2] on the CPU) was not used to compute the outputs");
  retain.allow_unused = true;
  EBB_REQUIRE_OK(ebb_autograd_grad(roots, 1, unused, 1, gu, &retain));
  CHECK(gu[0] == nullptr);
  // The gradient with respect to a non-leaf.
  Tensor ab;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[1], ab.out()));
  Tensor l2;
  EBB_REQUIRE_OK(ebb_op_sum(ab, nullptr, 0, false, l2.out()));
  const ebb_tensor_t *r2s[1] = {l2.get()}, *nonleaf[1] = {ab.get()};
  ebb_tensor_t *gab[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(r2s, nullptr, 1, nonleaf, 1, false, false, gab));
  Tensor gabt(gab[0]);
  CHECK(read(gabt) == std::vector<double>{1, 1, 1});
}

TEST_CASE("engine: retain_graph, a second backward through freed buffers, and accumulation", "[autograd][engine][retain]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({4}, 12)}, true);
  auto x = read(ts[0]);
  Tensor sq, loss;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[0], sq.out()));
  EBB_REQUIRE_OK(ebb_op_sum(sq, nullptr, 0, false, loss.out()));
  const ebb_tensor_t *roots[1] = {loss.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, nullptr, 0));
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));  // retained: runs again, adds
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  auto r = read(g);
  for (int i = 0; i < 4; i++) CHECK(r[i] == 4 * x[i]);
  EBB_CHECK_FAILS(ebb_backward(roots, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "MulBackward");
  CHECK(std::string(ebb_last_error()).find("freed by an earlier backward") != std::string::npos);
  CHECK(std::string(ebb_last_error()).find("retain_graph") != std::string::npos);
  // set_grad(NULL) clears; the engine is usable for a new graph.
  EBB_REQUIRE_OK(ebb_tensor_set_grad(ts[0], nullptr));
  Tensor s2, l2;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 3.0, s2.out()));
  EBB_REQUIRE_OK(ebb_op_sum(s2, nullptr, 0, false, l2.out()));
  const ebb_tensor_t *r2[1] = {l2.get()};
  EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  CHECK(read(g) == std::vector<double>(4, 3.0));
}

TEST_CASE("engine: bad input and failures name what was wrong, the engine carries on", "[autograd][engine][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({2, 2}, 13)}, true);
  Tensor y, plain;
  EBB_REQUIRE_OK(ebb_op_exp(ts[0], y.out()));
  const ebb_tensor_t *roots[1] = {y.get()};
  EBB_CHECK_FAILS(ebb_backward(roots, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "roots[0] (f64[2, 2] on the CPU) has 4 elements and no gradient was given");
  Tensor wrong = make(EBB_DEVICE_CPU, EBB_F64, {4}, values(4, 14));
  const ebb_tensor_t *grads[1] = {wrong.get()};
  EBB_CHECK_FAILS(ebb_backward(roots, grads, 1, false, nullptr, 0), EBB_EINVAL, "grad_roots[0] (f64[4] on the CPU) does not match roots[0] (f64[2, 2] on the CPU)");
  plain = make(EBB_DEVICE_CPU, EBB_F64, {1}, {1.0});
  const ebb_tensor_t *nog[1] = {plain.get()};
  EBB_CHECK_FAILS(ebb_backward(nog, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "roots[0] (f64[1] on the CPU) does not require a gradient");
  EBB_CHECK_FAILS(ebb_backward(nullptr, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "no roots");
  ebb_tensor_t *g1[1];
  EBB_CHECK_FAILS(ebb_grad(roots, nullptr, 1, nullptr, 0, false, false, g1), EBB_EINVAL, "no inputs");
  // A saved input modified in place before backward: the node and both versions are named.
  Tensor z, s;
  Tensor x2 = make(EBB_DEVICE_CPU, EBB_F64, {3}, values(3, 15));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x2, true));
  EBB_REQUIRE_OK(ebb_op_sin(x2, z.out()));
  EBB_REQUIRE_OK(ebb_op_sum(z, nullptr, 0, false, s.out()));
  // In-place on a leaf that requires a gradient is refused with grad mode on; with it off (an
  // optimizer's update) it runs, and the saved input's version moves on.
  EBB_CHECK_FAILS(ebb_tensor_fill_(x2, 0.5), EBB_EINVAL, "is a leaf that requires a gradient");
  bool was;
  ebb_grad_set_enabled(false, &was);
  EBB_REQUIRE_OK(ebb_tensor_fill_(x2, 0.5));
  ebb_grad_set_enabled(was, nullptr);
  const ebb_tensor_t *rs[1] = {s.get()};
  EBB_CHECK_FAILS(ebb_backward(rs, nullptr, 1, true, nullptr, 0), EBB_ESTATE, "SinBackward");
  std::string msg = ebb_last_error();
  CHECK(msg.find("saved input 0") != std::string::npos);
  CHECK(msg.find("saved at version 0, now 1") != std::string::npos);
  // The engine carries on: another graph works.
  Tensor w, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, w.out()));
  EBB_REQUIRE_OK(ebb_op_sum(w, nullptr, 0, false, l.out()));
  const ebb_tensor_t *rl[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(rl, nullptr, 1, false, nullptr, 0));
}

TEST_CASE("engine: the same graph gives the same gradients bit for bit", "[autograd][engine][determinism]") {
  EbbSession session;
  std::vector<std::vector<double>> runs;
  for (int run = 0; run < 2; run++) {
    auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({8, 8}, 16)}, true);
    Tensor a, b, c, l;
    EBB_REQUIRE_OK(ebb_op_matmul(ts[0], ts[0], a.out()));
    EBB_REQUIRE_OK(ebb_op_tanh(a, b.out()));
    EBB_REQUIRE_OK(ebb_op_mul(b, ts[0], c.out()));
    EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, l.out()));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
    runs.push_back(read(g));
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE("engine: backward calls on many threads sharing leaves sum exactly", "[autograd][engine][threads]") {
  EbbSession session;
  const int threads = 16, calls = kSanitized ? 50 : 1000;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({4}, 17), rnd({4}, 18)}, true);
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&] {
      for (int i = 0; i < calls; i++) {
        ebb_tensor_t *a = nullptr, *b = nullptr, *l = nullptr;
        bool ok = ebb_op_mul_scalar(ts[0], 3.0, &a) == EBB_OK && ebb_op_add(a, ts[1], &b) == EBB_OK &&
                  ebb_op_sum(b, nullptr, 0, false, &l) == EBB_OK;
        const ebb_tensor_t *r[1] = {l};
        ok = ok && ebb_backward(r, nullptr, 1, false, nullptr, 0) == EBB_OK;
        if (!ok) failures++;
        for (ebb_tensor_t *x : {a, b, l})
          if (x) ebb_tensor_release(x);
      }
    });
  for (auto &th : pool) th.join();
  CHECK(failures.load() == 0);
  Tensor g0, g1;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g0.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[1], g1.out()));
  CHECK(read(g0) == std::vector<double>(4, 3.0 * threads * calls));
  CHECK(read(g1) == std::vector<double>(4, 1.0 * threads * calls));
  g0.reset();
  g1.reset();
  for (auto &t : ts) t.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: gradients come in their inputs' dtypes, the same input twice gets its gradient twice", "[autograd][engine]") {
  EbbSession session;
  // mse_loss of an f32 leaf against an f64 target computes in f64; x's gradient is f32.
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {3}, {1, 2, 3}), b = make(EBB_DEVICE_CPU, EBB_F64, {3}, {0, 0, 0}), l;
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_mse_loss(x, b, l.out()));
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
  CHECK(dtype_of(g) == EBB_F32);
  auto gv = read(g);
  CHECK(std::fabs(gv[0] - 2.0 / 3) < 1e-6);
  CHECK(std::fabs(gv[2] - 2.0) < 1e-6);
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));  // accumulates into the f32 .grad
  EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
  CHECK(std::fabs(read(g)[2] - 4.0) < 1e-6);
  // ebb_grad with the same input twice.
  const ebb_tensor_t *in[2] = {x.get(), x.get()};
  ebb_tensor_t *gs[2] = {nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_grad(r, nullptr, 1, in, 2, false, false, gs));
  Tensor g0(gs[0]), g1(gs[1]);
  REQUIRE(g0.get() != nullptr);
  REQUIRE(g1.get() != nullptr);
  CHECK(read(g0) == read(g1));
  CHECK(dtype_of(g0) == EBB_F32);
}

// Gradients that meet: one handle delivered twice (a + a: AddBackward hands on the same tensor
// for both inputs), a diamond, and a .grad the caller holds, which later sums must not replace.
TEST_CASE("engine: gradients that meet are summed without touching tensors anyone else holds", "[autograd][engine]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 19)}, true);
  auto x = read(ts[0]);
  Tensor s, l;
  EBB_REQUIRE_OK(ebb_op_add(ts[0], ts[0], s.out()));  // a + a
  EBB_REQUIRE_OK(ebb_op_sum(s, nullptr, 0, false, l.out()));
  const ebb_tensor_t *r[1] = {l.get()};
  Tensor held = make(EBB_DEVICE_CPU, EBB_F64, {3}, {10, 20, 30});
  EBB_REQUIRE_OK(ebb_tensor_set_grad(ts[0], held));  // the caller keeps its handle
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
  CHECK(read(held) == std::vector<double>{12, 22, 32});  // summed into it, in place
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  CHECK(g.get() == held.get());
  // A diamond: x -> (x*2, x*3) -> sum of both.
  EBB_REQUIRE_OK(ebb_tensor_set_grad(ts[0], nullptr));
  Tensor a, b, c, l2;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, a.out()));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 3.0, b.out()));
  EBB_REQUIRE_OK(ebb_op_add(a, b, c.out()));
  EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, l2.out()));
  const ebb_tensor_t *r2[1] = {l2.get()};
  EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  CHECK(read(g) == std::vector<double>(3, 5.0));
  (void)x;
}

namespace {
// A tensor hook that counts its calls and leaves the gradient.
ebb_status count_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  ++*static_cast<std::atomic<int> *>(user);
  return EBB_OK;
}
}  // namespace

TEST_CASE("engine: a partial backward runs only the nodes between its inputs and the roots, whatever else uses them",
          "[autograd][engine][partial]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 30), rnd({3}, 31)}, true);  // w, x
  // Another live graph that uses w (found from w's consumers, never run), and in the roots'
  // graph a branch that does not lead to w (never run).
  Tensor other, other_sum, wx, ex, y, loss, xx, loss2;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 3.0, other.out()));
  EBB_REQUIRE_OK(ebb_op_sum(other, nullptr, 0, false, other_sum.out()));
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[1], wx.out()));
  EBB_REQUIRE_OK(ebb_op_exp(ts[1], ex.out()));
  EBB_REQUIRE_OK(ebb_op_add(wx, ex, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, loss.out()));
  EBB_REQUIRE_OK(ebb_op_mul(ts[1], ts[1], xx.out()));  // a second root that does not lead to w
  EBB_REQUIRE_OK(ebb_op_sum(xx, nullptr, 0, false, loss2.out()));
  std::atomic<int> other_calls{0}, ex_calls{0}, wx_calls{0}, xx_calls{0};
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(other, count_hook, &other_calls, &h));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(ex, count_hook, &ex_calls, &h));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(wx, count_hook, &wx_calls, &h));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(xx, count_hook, &xx_calls, &h));
  const ebb_tensor_t *roots[2] = {loss.get(), loss2.get()}, *in[1] = {ts[0].get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 2, in, 1, true, false, g));
  Tensor gw(g[0]);
  CHECK(read(gw) == read(ts[1]));  // d/dw sum(w*x + exp(x)) + sum(x*x) = x
  CHECK(wx_calls.load() == 1);
  CHECK(other_calls.load() == 0);
  CHECK(ex_calls.load() == 0);
  CHECK(xx_calls.load() == 0);
  // backward(inputs = {w}) likewise, into w's .grad only.
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 2, true, in, 1));
  Tensor gw2, gx;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], gw2.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[1], gx.out()));
  CHECK(read(gw2) == read(ts[1]));
  CHECK(gx.get() == nullptr);
  CHECK(other_calls.load() == 0);
  CHECK(ex_calls.load() == 0);
  // With x as the input, every branch that leads to x runs, the other graph still does not.
  const ebb_tensor_t *inx[1] = {ts[1].get()};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 2, inx, 1, true, false, g));
  Tensor gxx(g[0]);
  auto w = read(ts[0]), x = read(ts[1]), r = read(gxx);
  for (int i = 0; i < 3; i++) CHECK(r[i] == Approx(w[i] + std::exp(x[i]) + 2 * x[i]).epsilon(1e-12));
  CHECK(ex_calls.load() == 1);
  CHECK(xx_calls.load() == 1);
  CHECK(other_calls.load() == 0);
  // A root that leads to no input is no error; the input is unused.
  const ebb_tensor_t *only2[1] = {loss2.get()};
  EBB_CHECK_FAILS(ebb_grad(only2, nullptr, 1, in, 1, true, false, g), EBB_EINVAL, "inputs[0] (f64[3] on the CPU) was not used to compute the outputs");
  for (Tensor *t : {&other, &other_sum, &wx, &ex, &y, &loss, &xx, &loss2, &gw, &gw2, &gxx}) t->reset();
  for (auto &t : ts) t.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: partial backward while other threads record and free graphs on the same leaves", "[autograd][engine][partial][threads]") {
  EbbSession session;
  const int rounds = kSanitized ? 100 : 2000;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({4}, 32), rnd({4}, 33)}, true);
  Tensor wx, loss;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[1], wx.out()));
  EBB_REQUIRE_OK(ebb_op_sum(wx, nullptr, 0, false, loss.out()));
  std::atomic<int> failures{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> churn;
  for (int t = 0; t < 2; t++)
    churn.emplace_back([&] {  // graphs over w and x appearing and going: consumer lists change under the walk
      while (!stop.load()) {
        ebb_tensor_t *a = nullptr, *b = nullptr;
        if (ebb_op_mul_scalar(ts[0], 2.0, &a) != EBB_OK || ebb_op_add(a, ts[1], &b) != EBB_OK) failures++;
        if (b) ebb_tensor_release(b);
        if (a) ebb_tensor_release(a);
      }
    });
  auto x = read(ts[1]);
  for (int i = 0; i < rounds; i++) {
    const ebb_tensor_t *roots[1] = {loss.get()}, *in[1] = {ts[0].get()};
    ebb_tensor_t *g[1] = {nullptr};
    if (ebb_grad(roots, nullptr, 1, in, 1, true, false, g) != EBB_OK) {
      failures++;
      continue;
    }
    Tensor gw(g[0]);
    if (read(gw) != x) failures++;
  }
  stop = true;
  for (auto &th : churn) th.join();
  CHECK(failures.load() == 0);
  wx.reset();
  loss.reset();
  for (auto &t : ts) t.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: threads sharing one graph: without retain_graph one backward runs and the others are told to retain",
          "[autograd][engine][threads][retain]") {
  EbbSession session;
  const int threads = 8, rounds = kSanitized ? 5 : 50;
  for (int round = 0; round < rounds; round++) {
    for (bool retain : {false, true}) {
      auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({4}, 40)}, true);
      Tensor xx, loss;
      EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[0], xx.out()));  // saves x twice
      EBB_REQUIRE_OK(ebb_op_sum(xx, nullptr, 0, false, loss.out()));
      std::atomic<int> ok{0}, told{0}, other{0};
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; t++)
        pool.emplace_back([&] {
          const ebb_tensor_t *r[1] = {loss.get()};
          ebb_status st = ebb_backward(r, nullptr, 1, retain, nullptr, 0);
          if (st == EBB_OK) ok++;
          else if (st == EBB_ESTATE && std::string(ebb_last_error()).find("retain_graph") != std::string::npos) told++;
          else other++;
        });
      for (auto &th : pool) th.join();
      CHECK(other.load() == 0);
      CHECK(ok.load() >= 1);
      CHECK(ok.load() + told.load() == threads);
      if (retain) CHECK(ok.load() == threads);
      Tensor g;
      EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
      auto x = read(ts[0]), gv = read(g);
      for (int i = 0; i < 4; i++) CHECK(gv[i] == 2 * x[i] * ok.load());
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: backward with a non-leaf input adds the gradient that reached it into its .grad", "[autograd][engine][partial]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 50), rnd({3}, 51)}, true);
  Tensor ab, e, loss;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[1], ab.out()));
  EBB_REQUIRE_OK(ebb_op_exp(ab, e.out()));
  EBB_REQUIRE_OK(ebb_op_sum(e, nullptr, 0, false, loss.out()));
  const ebb_tensor_t *roots[1] = {loss.get()}, *in[2] = {ab.get(), ts[0].get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, in, 2));
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, in, 1));  // summed over calls, like a leaf's
  Tensor gab, ga, gb;
  EBB_REQUIRE_OK(ebb_tensor_grad(ab, gab.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], ga.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[1], gb.out()));
  REQUIRE(gab.get() != nullptr);
  REQUIRE(ga.get() != nullptr);
  CHECK(gb.get() == nullptr);  // not an input
  auto a = read(ts[0]), b = read(ts[1]), rab = read(gab), ra = read(ga);
  for (int i = 0; i < 3; i++) {
    CHECK(rab[i] == Approx(2 * std::exp(a[i] * b[i])).epsilon(1e-12));
    CHECK(ra[i] == Approx(std::exp(a[i] * b[i]) * b[i]).epsilon(1e-12));
  }
  for (Tensor *t : {&ab, &e, &loss, &gab, &ga}) t->reset();
  for (auto &t : ts) t.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine: device workers give the calling thread's gradients, for one device forced and for two", "[autograd][engine][workers]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  LossFn mlp = mlp_loss(0);
  ebb_autograd_engine_stats s0, s1;
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s0));
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
  check_gradients(0, {rnd({3, 5}, 1), rnd({5}, 2), rnd({5, 2}, 3), rnd({2}, 4)}, mlp);
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_AUTO));
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s1));
  CHECK(s1.nodes_run_on_workers > s0.nodes_run_on_workers);
  // Two devices: w lives on device 0, the loss is computed on device 1 from a copy of it.
  auto ts = make_leaves(0, {rnd({4}, 5)}, true);
  for (int it = 0; it < 3; it++) {
    Tensor a, b, c, l0, l1, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, a.out()));
    EBB_REQUIRE_OK(ebb_tensor_to_device(a, 1, b.out()));
    EBB_REQUIRE_OK(ebb_op_mul(b, b, c.out()));
    EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, l1.out()));
    EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, l0.out()));
    const ebb_tensor_t *r[2] = {l0.get(), l1.get()};
    INFO("backward: " << ebb_last_error());
    REQUIRE(ebb_backward(r, nullptr, 2, false, nullptr, 0) == EBB_OK);
  }
  ebb_autograd_engine_stats s2;
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s2));
  CHECK(s2.nodes_run_on_workers > s1.nodes_run_on_workers);
  // d/dw [sum(2w) + sum((2w)^2)] = 2 + 8w, three times.
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  auto w = rnd({4}, 5).v;
  auto gv = read(g);
  for (size_t i = 0; i < 4; i++) CHECK(std::abs(gv[i] - 3 * (2 + 8 * w[i])) < 1e-9);
  g.reset();
  for (auto &t : ts) t.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- partial backward into a retained non-leaf, and a leaf as the root -------------------------

namespace {

Tensor cpu_leaf(std::vector<double> v) {
  Tensor t = make(EBB_DEVICE_CPU, EBB_F64, {static_cast<int64_t>(v.size())}, v);
  REQUIRE(ebb_tensor_set_requires_grad(t, true) == EBB_OK);
  return t;
}

std::vector<double> grad_of(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  return g.get() ? read(g) : std::vector<double>{};
}

}  // namespace

// retain_grad on y and ebb_backward(inputs = {y}) both put y's gradient into y.grad: it must be
// there once (PyTorch implements backward(inputs=[non-leaf]) with retain_grad itself).
TEST_CASE("engine: a retained non-leaf that is also a backward input gets its gradient once", "[autograd][engine]") {
  EbbSession session;
  Tensor x = cpu_leaf({1, 2, 3}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y));
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {y.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, in, 1));
  CHECK(grad_of(y) == std::vector<double>{1, 1, 1});
  CHECK(grad_of(x).empty());
  // With x as an input too, y's node also runs: still once.
  EBB_REQUIRE_OK(ebb_tensor_set_grad(y, nullptr));
  const ebb_tensor_t *in2[2] = {y.get(), x.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, in2, 2));
  CHECK(grad_of(y) == std::vector<double>{1, 1, 1});
  CHECK(grad_of(x) == std::vector<double>{2, 2, 2});
  for (Tensor *t : {&x, &y, &l}) t->reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A leaf root whose AccumulateGrad nothing else holds: the task reads that node until its end, so
// the call's reference must outlive the task (else ASan: heap-use-after-free in task_free).
TEST_CASE("engine: backward and grad on a leaf root that nothing else uses", "[autograd][engine]") {
  EbbSession session;
  Tensor x = cpu_leaf({2});
  const ebb_tensor_t *roots[1] = {x.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  CHECK(grad_of(x) == std::vector<double>{1});
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, roots, 1, false, false, g));
  Tensor gx(g[0]);
  CHECK(read(gx) == std::vector<double>{1});
  gx.reset();
  x.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
