// In-place ops recorded by autograd (ebb_op_add_, ebb_op_mul_, ebb_tensor_copy_, fill_, zero_):
// history rebased on non-leaves, views of non-leaves rebasing their base's history (CopySlices)
// and taking their own again from it, gradients against finite differences; the errors (a saved
// tensor modified in place, leaves, expanded tensors); inference mode; released handles.
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ebb/autograd.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Leaf {
  std::vector<int64_t> shape;
  std::vector<double> v;
};

using LossFn = std::function<ebb_status(const std::vector<ebb_tensor_t *> &, ebb_tensor_t **)>;

Leaf rnd(std::vector<int64_t> shape, unsigned seed) { return Leaf{shape, values(numel_of(shape), seed)}; }

std::vector<Tensor> make_leaves(int dev, const std::vector<Leaf> &ls, bool requires_grad) {
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

double loss_value(int dev, const std::vector<Leaf> &ls, const LossFn &f) {
  bool was;
  ebb_grad_set_enabled(false, &was);
  auto ts = make_leaves(dev, ls, false);
  Tensor l;
  ebb_status st = f(ptrs(ts), l.out());
  ebb_grad_set_enabled(was, nullptr);
  INFO(ebb_last_error());
  REQUIRE(st == EBB_OK);
  return read(l)[0];
}

// Backward through the engine, then every element of every leaf against a central difference.
void check_gradients(int dev, const std::vector<Leaf> &ls, const LossFn &f, double tol = 1e-6) {
  auto ts = make_leaves(dev, ls, true);
  Tensor l;
  {
    ebb_status st = f(ptrs(ts), l.out());
    INFO("forward: " << ebb_last_error());
    REQUIRE(st == EBB_OK);
  }
  const ebb_tensor_t *roots[1] = {l.get()};
  {
    ebb_status st = ebb_backward(roots, nullptr, 1, false, nullptr, 0);
    INFO("backward: " << ebb_last_error());
    REQUIRE(st == EBB_OK);
  }
  for (size_t i = 0; i < ls.size(); i++) {
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(ts[i], g.out()));
    INFO("leaf " << i);
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

std::string grad_fn_name(const ebb_tensor_t *t, int *nr = nullptr) {
  const ebb_node_t *n = nullptr;
  int k = -1;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, &k));
  if (nr) *nr = k;
  return n ? ebb_node_name(n) : "(leaf)";
}

uint64_t version_of(const ebb_tensor_t *t) {
  uint64_t v = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(t, &v));
  return v;
}

bool requires_grad(const ebb_tensor_t *t) {
  bool r = false;
  EBB_REQUIRE_OK(ebb_tensor_requires_grad(t, &r));
  return r;
}

bool is_inference(const ebb_tensor_t *t) {
  bool r = false;
  EBB_REQUIRE_OK(ebb_tensor_is_inference(t, &r));
  return r;
}

// sum(t * t): a loss that reads every element of t.
ebb_status sum_sq(const ebb_tensor_t *t, ebb_tensor_t **out) {
  Tensor sq;
  ebb_status st = ebb_op_mul(t, t, sq.out());
  return st ? st : ebb_op_sum(sq, nullptr, 0, false, out);
}

}  // namespace

TEST_CASE("inplace: ops on non-leaves rebase their history, and gradients match finite differences", "[autograd][inplace]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    // h = x * y; h *= z; h += w (broadcast); g = exp(x) overwritten by copy_ from h's row; the
    // loss reads h and g.
    LossFn f = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
      Tensor h, g, row, a, b;
      ebb_status st = ebb_op_mul(p[0], p[1], h.out());
      if (!st) st = ebb_op_mul_(h, p[2]);
      if (!st) st = ebb_op_add_(h, p[3]);
      if (!st) st = ebb_op_exp(p[0], g.out());
      if (!st) st = ebb_tensor_select(h, 0, 1, row.out());
      if (!st) st = ebb_tensor_copy_(g, row);  // g's old value (and exp) drop out of the gradient
      if (!st) st = sum_sq(h, a.out());
      if (!st) st = ebb_op_sum(g, nullptr, 0, false, b.out());
      if (!st) st = ebb_op_add(a, b, out);
      return st;
    };
    check_gradients(dev, {rnd({2, 3}, 1), rnd({2, 3}, 2), rnd({2, 3}, 3), rnd({3}, 4)}, f);
  }
  // The node, its output and the version: the in-place op's node is h's grad_fn, whose first
  // edge is h's old history.
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 5), rnd({3}, 6)}, true);
  Tensor h;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[1], h.out()));
  CHECK(version_of(h) == 0);
  EBB_REQUIRE_OK(ebb_op_mul_(h, ts[1]));
  int nr = -1;
  CHECK(grad_fn_name(h, &nr) == "MulInplaceBackward");
  CHECK(nr == 0);
  CHECK(version_of(h) == 1);
  const ebb_node_t *n = nullptr, *prev = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(h, &n, nullptr));
  EBB_REQUIRE_OK(ebb_node_next(n, 0, &prev, nullptr));
  CHECK(std::string(ebb_node_name(prev)) == "MulBackward");
  EBB_REQUIRE_OK(ebb_tensor_zero_(h));
  CHECK(grad_fn_name(h) == "ZeroBackward");
  EBB_REQUIRE_OK(ebb_tensor_fill_(h, 2.0));
  CHECK(grad_fn_name(h) == "FillBackward");
  CHECK(version_of(h) == 3);
  h.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: a tensor that does not require a gradient, changed from one that does, gets a history",
          "[autograd][inplace]") {
  EbbSession session;
  // buf.copy_(x) and a row of zeros.copy_(x): buf (a leaf that needed no gradient) and the base
  // of the row now depend on x.
  LossFn f = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
    const int64_t s3[1] = {3}, s23[2] = {2, 3};
    Tensor buf, base, row, a, b;
    ebb_status st = ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 1, s3, buf.out());
    if (!st) st = ebb_tensor_copy_(buf, p[0]);
    if (!st) st = ebb_op_add_(buf, p[1]);
    if (!st) st = ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 2, s23, base.out());
    if (!st) st = ebb_tensor_select(base, 0, 1, row.out());
    if (!st) st = ebb_tensor_copy_(row, p[0]);
    if (!st) st = sum_sq(buf, a.out());
    if (!st) st = sum_sq(base, b.out());  // through the base, not the row
    if (!st) st = ebb_op_add(a, b, out);
    return st;
  };
  check_gradients(EBB_DEVICE_CPU, {rnd({3}, 7), rnd({3}, 8)}, f);
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 9)}, true);
  const int64_t s23[2] = {2, 3};
  Tensor base, row, buf = make(EBB_DEVICE_CPU, EBB_F64, {3}, {0, 0, 0});
  EBB_REQUIRE_OK(ebb_tensor_copy_(buf, ts[0]));
  bool leaf = true;
  EBB_REQUIRE_OK(ebb_tensor_is_leaf(buf, &leaf));
  CHECK(!leaf);
  CHECK(requires_grad(buf));
  CHECK(grad_fn_name(buf) == "CopyBackward");
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 2, s23, base.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(base, 0, 0, row.out()));
  CHECK(!requires_grad(row));
  EBB_REQUIRE_OK(ebb_tensor_copy_(row, ts[0]));
  CHECK(grad_fn_name(base) == "CopySlices");
  CHECK(grad_fn_name(row) == "AsStridedBackward");
  CHECK(requires_grad(base));
  // With nothing that requires a gradient, in-place ops record nothing.
  Tensor plain = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3}), other = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 1, 1});
  EBB_REQUIRE_OK(ebb_op_add_(plain, other));
  CHECK(!requires_grad(plain));
  CHECK(grad_fn_name(plain) == "(leaf)");
  CHECK(read(plain) == std::vector<double>{2, 3, 4});
  buf.reset();
  row.reset();
  base.reset();
  plain.reset();
  other.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: ops on views of non-leaves (slice, select, transpose, a chain) rebase the base, and gradients match",
          "[autograd][inplace][views]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    LossFn f = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
      Tensor h, s, r, t, c, tc, a, b, d, e;
      ebb_status st = ebb_op_mul_scalar(p[0], 2.0, h.out());        // h [3,4], a non-leaf
      if (!st) st = ebb_tensor_slice(h, 1, 1, 3, 1, s.out());        // s = h[:, 1:3]
      if (!st) st = ebb_op_mul_(s, p[1]);                            // s *= y [3,2]
      if (!st) st = ebb_tensor_select(h, 0, 2, r.out());             // r = h[2]
      if (!st) st = ebb_op_add_(r, p[2]);                            // r += z [4]
      if (!st) st = ebb_tensor_transpose(h, 0, 1, t.out());          // t = h^T [4,3]
      if (!st) st = ebb_tensor_slice(t, 0, 0, 4, 2, c.out());        // c = t[0:4:2] [2,3], a view of a view
      if (!st) st = ebb_tensor_transpose(c, 0, 1, tc.out());         // tc [3,2], a third view
      if (!st) st = ebb_op_mul_(tc, p[3]);                           // tc *= w [3,2]
      if (!st) st = sum_sq(h, a.out());                              // the base, changed three times
      if (!st) st = sum_sq(s, b.out());                              // a view made before the changes
      if (!st) st = ebb_op_add(a, b, d.out());
      if (!st) st = ebb_op_sum(r, nullptr, 0, false, e.out());
      if (!st) st = ebb_op_add(d, e, out);
      return st;
    };
    check_gradients(dev, {rnd({3, 4}, 10), rnd({3, 2}, 11), rnd({4}, 12), rnd({3, 2}, 13)}, f);
  }
  // The base's grad_fn is CopySlices; its views take theirs from it when asked.
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3, 4}, 14), rnd({4}, 15)}, true);
  Tensor h, s, r;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 1, 0, 2, 1, s.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 1, r.out()));
  CHECK(grad_fn_name(s) == "SliceBackward");
  EBB_REQUIRE_OK(ebb_op_add_(r, ts[1]));
  CHECK(grad_fn_name(h) == "CopySlices");
  CHECK(grad_fn_name(r) == "AsStridedBackward");
  // A stale sibling view used by an op: its new history is made before the op's node (a
  // producer's sequence number is below its consumers', which partial backward relies on).
  {
    Tensor m;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(s, 3.0, m.out()));
    const ebb_node_t *ns = nullptr, *nm = nullptr;
    uint64_t qs = 0, qm = 0;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(s, &ns, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(m, &nm, nullptr));
    EBB_REQUIRE_OK(ebb_node_sequence_nr(ns, &qs));
    EBB_REQUIRE_OK(ebb_node_sequence_nr(nm, &qm));
    CHECK(qs < qm);
  }
  CHECK(grad_fn_name(s) == "AsStridedBackward");  // a sibling view: its version moved on
  const ebb_node_t *cs = nullptr, *e0 = nullptr, *e1 = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(h, &cs, nullptr));
  EBB_REQUIRE_OK(ebb_node_next(cs, 0, &e0, nullptr));
  EBB_REQUIRE_OK(ebb_node_next(cs, 1, &e1, nullptr));
  CHECK(std::string(ebb_node_name(e0)) == "MulScalarBackward");  // the base's old history
  CHECK(std::string(ebb_node_name(e1)) == "AccumulateGrad");     // src
  // A view that outlives every other handle on its base keeps the base (and its history).
  h.reset();
  s.reset();
  EBB_REQUIRE_OK(ebb_op_mul_(r, ts[1]));
  Tensor l;
  EBB_REQUIRE_OK(ebb_op_sum(r, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor gx, gz;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], gx.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[1], gz.out()));
  // l = sum((2 x[1] + z) * z): dl/dx[1] = 2 z, dl/dz = 2 x[1] + 2 z; other rows of x get 0.
  auto x = read(ts[0]), z = read(ts[1]), rx = read(gx), rz = read(gz);
  for (int j = 0; j < 4; j++) {
    CHECK(rx[j] == 0.0);
    CHECK(std::fabs(rx[4 + j] - 2 * z[j]) < 1e-12);
    CHECK(rx[8 + j] == 0.0);
    CHECK(std::fabs(rz[j] - (2 * x[4 + j] + 2 * z[j])) < 1e-12);
  }
  l.reset();
  r.reset();
  gx.reset();
  gz.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: a saved tensor modified in place fails backward, naming the node, the tensor and both versions",
          "[autograd][inplace][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 16)}, true);
  Tensor a, b, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, a.out()));
  EBB_REQUIRE_OK(ebb_op_mul(a, a, b.out()));  // saves a (inputs 0 and 1)
  EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, l.out()));
  EBB_REQUIRE_OK(ebb_op_add_(a, ts[0]));      // recorded: a's history moves on, its version too
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_CHECK_FAILS(ebb_backward(roots, nullptr, 1, true, nullptr, 0), EBB_ESTATE, "MulBackward");
  std::string msg = ebb_last_error();
  CHECK(msg.find("saved input 0") != std::string::npos);
  CHECK(msg.find("saved at version 0, now 1") != std::string::npos);
  // Through a view: exp saves its output; a change to a slice of it is a change to it.
  Tensor e, s, l2;
  EBB_REQUIRE_OK(ebb_op_exp(a, e.out()));
  EBB_REQUIRE_OK(ebb_op_sum(e, nullptr, 0, false, l2.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(e, 0, 0, 2, 1, s.out()));
  EBB_REQUIRE_OK(ebb_tensor_fill_(s, 0.0));
  const ebb_tensor_t *roots2[1] = {l2.get()};
  EBB_CHECK_FAILS(ebb_backward(roots2, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "ExpBackward");
  msg = ebb_last_error();
  CHECK(msg.find("saved output 0") != std::string::npos);
  CHECK(msg.find("saved at version 0, now 1") != std::string::npos);
  // The engine carries on: a graph that needs no changed tensor runs (a's history is
  // AddInplaceBackward over MulScalarBackward, which save nothing; e's would go through exp's
  // changed output).
  Tensor l3;
  EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, l3.out()));
  const ebb_tensor_t *roots3[1] = {l3.get()};
  EBB_REQUIRE_OK(ebb_backward(roots3, nullptr, 1, false, nullptr, 0));
  // mul_ saves dst's old value itself: a later change to dst does not spoil it, one to src does.
  Tensor m, y = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3}), lm;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, m.out()));
  EBB_REQUIRE_OK(ebb_op_mul_(m, ts[0]));  // saves m's old value (a copy) and src x
  EBB_REQUIRE_OK(ebb_op_add_(m, y));
  EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, lm.out()));
  const ebb_tensor_t *rm[1] = {lm.get()};
  EBB_REQUIRE_OK(ebb_backward(rm, nullptr, 1, true, nullptr, 0));
  bool was;
  ebb_grad_set_enabled(false, &was);
  EBB_REQUIRE_OK(ebb_op_add_(ts[0], y));  // an optimizer-style step on the leaf
  ebb_grad_set_enabled(was, nullptr);
  EBB_CHECK_FAILS(ebb_backward(rm, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "MulInplaceBackward");
  CHECK(std::string(ebb_last_error()).find("saved input 1") != std::string::npos);
  a.reset(); b.reset(); l.reset(); e.reset(); s.reset(); l2.reset(); l3.reset(); m.reset(); lm.reset(); y.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: a leaf that requires a gradient, or a view of one, cannot be changed in place with grad mode on",
          "[autograd][inplace][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({2, 3}, 17), rnd({3}, 18)}, true);
  EBB_REQUIRE_OK(ebb_tensor_set_name(ts[0], "weight"));
  auto before = read(ts[0]);
  EBB_CHECK_FAILS(ebb_op_add_(ts[0], ts[1]), EBB_EINVAL, "ebb_op_add_: dst 'weight' (f64[2, 3] on the CPU) is a leaf that requires a gradient");
  EBB_CHECK_FAILS(ebb_tensor_fill_(ts[0], 1.0), EBB_EINVAL, "cannot be changed in place while grad mode is on");
  EBB_CHECK_FAILS(ebb_tensor_zero_(ts[0]), EBB_EINVAL, "ebb_tensor_zero_: dst 'weight' (f64[2, 3] on the CPU) is a leaf");
  Tensor v, v2;
  EBB_REQUIRE_OK(ebb_tensor_select(ts[0], 0, 1, v.out()));
  EBB_CHECK_FAILS(ebb_op_mul_(v, ts[1]), EBB_EINVAL, "ebb_op_mul_: dst is a view of a leaf that requires a gradient, its base 'weight' (f64[2, 3] on the CPU), and");
  EBB_CHECK_FAILS(ebb_tensor_copy_(v, ts[1]), EBB_EINVAL, "view of a leaf");
  // A view made with grad mode off is still a view of the leaf.
  bool was;
  ebb_grad_set_enabled(false, &was);
  EBB_REQUIRE_OK(ebb_tensor_transpose(ts[0], 0, 1, v2.out()));
  ebb_grad_set_enabled(was, nullptr);
  EBB_CHECK_FAILS(ebb_tensor_fill_(v2, 0.0), EBB_EINVAL, "view of a leaf");
  CHECK(read(ts[0]) == before);  // nothing changed
  CHECK(version_of(ts[0]) == 0);
  // Grad mode off: allowed, recorded nowhere; the leaf stays a leaf.
  ebb_grad_set_enabled(false, &was);
  EBB_REQUIRE_OK(ebb_op_add_(ts[0], ts[1]));
  EBB_REQUIRE_OK(ebb_tensor_fill_(v, 0.5));
  ebb_grad_set_enabled(was, nullptr);
  CHECK(grad_fn_name(ts[0]) == "(leaf)");
  CHECK(version_of(ts[0]) == 2);
  // A detached handle is not a view for autograd: changing it is allowed (and moves the version).
  Tensor d;
  EBB_REQUIRE_OK(ebb_tensor_detach(ts[0], d.out()));
  EBB_REQUIRE_OK(ebb_tensor_fill_(d, 1.0));
  CHECK(read(ts[0]) == std::vector<double>(6, 1.0));
  CHECK(version_of(ts[0]) == 3);
  // A leaf as src is fine.
  Tensor h;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[1], 1.0, h.out()));
  EBB_REQUIRE_OK(ebb_op_add_(h, ts[1]));
  v.reset(); v2.reset(); d.reset(); h.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: an expanded tensor, or a view of one, is refused", "[autograd][inplace][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 19), rnd({2, 3}, 20)}, true);
  Tensor h, u, e, d, row;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_unsqueeze(h, 0, u.out()));
  const int64_t s23[2] = {2, 3};
  EBB_REQUIRE_OK(ebb_tensor_expand(u, 2, s23, e.out()));
  EBB_CHECK_FAILS(ebb_op_add_(e, ts[1]), EBB_EINVAL, "ebb_op_add_: dst (f64[2, 3] on the CPU) is expanded along dim 0");
  EBB_CHECK_FAILS(ebb_tensor_copy_(e, ts[1]), EBB_EINVAL, "is expanded along dim 0");
  // A row of a detached expanded tensor has its own elements, but its base does not.
  EBB_REQUIRE_OK(ebb_tensor_detach(e, d.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(d, 0, 1, row.out()));
  EBB_CHECK_FAILS(ebb_tensor_copy_(row, ts[0]), EBB_EINVAL, "ebb_tensor_copy_: dst is a view of its base (f64[2, 3] on the CPU), an expanded tensor");
  CHECK(version_of(h) == 0);
  h.reset(); u.reset(); e.reset(); d.reset(); row.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: retain_grad follows the new value, and a hook registered before sees the old one's gradient",
          "[autograd][inplace][hooks]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 21)}, true);
  Tensor h, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(h));
  static std::vector<double> seen;
  seen.clear();
  ebb_hook_handle hk;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(
      h, [](const ebb_tensor_t *g, ebb_tensor_t **, void *) { seen = read(g); return EBB_OK; }, nullptr, &hk));
  Tensor three = make(EBB_DEVICE_CPU, EBB_F64, {3}, {3, 3, 3});
  EBB_REQUIRE_OK(ebb_op_mul_(h, three));
  EBB_REQUIRE_OK(ebb_op_sum(h, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(h, g.out()));
  REQUIRE(g.get() != nullptr);
  CHECK(read(g) == std::vector<double>{1, 1, 1});  // d l / d (new h)
  CHECK(seen == std::vector<double>{3, 3, 3});      // d l / d (old h)
  h.reset(); l.reset(); g.reset(); three.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inference mode: nothing recorded, inference tensors, and their misuse outside the mode", "[autograd][inference]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 22)}, true);
  CHECK(!ebb_inference_mode_enabled());
  CHECK(ebb_grad_enabled());
  long nodes = ebb_autograd_live_nodes();
  bool was = true;
  ebb_inference_mode_set_enabled(true, &was);
  CHECK(!was);
  CHECK(ebb_inference_mode_enabled());
  CHECK(!ebb_grad_enabled());
  Tensor y, v, z;
  EBB_REQUIRE_OK(ebb_op_mul(ts[0], ts[0], y.out()));
  CHECK(!requires_grad(y));
  CHECK(ebb_autograd_live_nodes() == nodes);
  CHECK(is_inference(y));
  CHECK(!is_inference(ts[0]));
  EBB_REQUIRE_OK(ebb_tensor_slice(y, 0, 0, 2, 1, v.out()));
  CHECK(is_inference(v));  // a view of an inference tensor
  // In place inside the mode: inference tensors, and a leaf that requires a gradient (as with
  // grad mode off), with its version moving on.
  EBB_REQUIRE_OK(ebb_op_add_(y, ts[0]));
  EBB_REQUIRE_OK(ebb_tensor_fill_(v, 1.0));
  EBB_REQUIRE_OK(ebb_tensor_fill_(ts[0], 0.5));
  CHECK(version_of(ts[0]) == 1);
  // Another thread is not in inference mode.
  bool other = true, other_grad = false;
  std::thread th([&] {
    other = ebb_inference_mode_enabled();
    other_grad = ebb_grad_enabled();
  });
  th.join();
  CHECK(!other);
  CHECK(other_grad);
  ebb_inference_mode_set_enabled(was, nullptr);
  CHECK(!ebb_inference_mode_enabled());
  CHECK(ebb_grad_enabled());  // grad mode comes back
  CHECK(is_inference(y));
  // Outside: used where nothing must save it, fine; saved for backward, refused.
  Tensor s, l, p;
  EBB_REQUIRE_OK(ebb_op_add(ts[0], y, s.out()));
  CHECK(requires_grad(s));
  EBB_CHECK_FAILS(ebb_op_mul(ts[0], y, p.out()), EBB_EINVAL, "ebb_op_mul: MulBackward must save its input[1] (f64[3] on the CPU) for backward, which is an inference tensor");
  CHECK(p.get() == nullptr);
  EBB_CHECK_FAILS(ebb_op_add_(y, ts[0]), EBB_EINVAL, "ebb_op_add_: dst (f64[3] on the CPU) is an inference tensor");
  EBB_CHECK_FAILS(ebb_tensor_fill_(v, 0.0), EBB_EINVAL, "cannot be changed in place outside inference mode");
  EBB_CHECK_FAILS(ebb_tensor_set_requires_grad(y, true), EBB_EINVAL, "inference tensor");
  // A recorded in-place op that must save an inference src is refused too.
  Tensor h;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, h.out()));
  EBB_CHECK_FAILS(ebb_op_mul_(h, y), EBB_EINVAL, "an inference tensor");
  // The gradient through the use that saved nothing flows.
  EBB_REQUIRE_OK(ebb_op_sum(s, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor g, c;
  EBB_REQUIRE_OK(ebb_tensor_grad(ts[0], g.out()));
  CHECK(read(g) == std::vector<double>{1, 1, 1});
  // A clone made outside the mode is a normal tensor.
  EBB_REQUIRE_OK(ebb_tensor_clone(y, c.out()));
  CHECK(!is_inference(c));
  EBB_REQUIRE_OK(ebb_op_add_(c, ts[0]));
  // Grad mode set inside inference mode comes back as it was set.
  ebb_inference_mode_set_enabled(true, nullptr);
  ebb_grad_set_enabled(false, nullptr);
  ebb_inference_mode_set_enabled(false, nullptr);
  CHECK(!ebb_grad_enabled());
  ebb_grad_set_enabled(true, nullptr);
  // Bad input.
  bool b;
  EBB_CHECK_FAILS(ebb_tensor_is_inference(nullptr, &b), EBB_EINVAL, "ebb_tensor_is_inference: t is NULL");
  EBB_CHECK_FAILS(ebb_tensor_is_inference(y, nullptr), EBB_EINVAL, "out is NULL");
  y.reset(); v.reset(); z.reset(); s.reset(); l.reset(); h.reset(); g.reset(); c.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: released handles are refused", "[autograd][inplace][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 23)}, true);
  ebb_tensor_t *h = nullptr, *v = nullptr;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 2.0, &h));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, &v));
  EBB_REQUIRE_OK(ebb_tensor_release(v));
  EBB_CHECK_FAILS(ebb_op_add_(v, ts[0]), EBB_EFREED, "ebb_op_add_: dst");
  EBB_CHECK_FAILS(ebb_tensor_fill_(v, 1.0), EBB_EFREED, "released tensor");
  EBB_CHECK_FAILS(ebb_tensor_copy_(h, v), EBB_EFREED, "ebb_tensor_copy_: src");
  bool b;
  EBB_CHECK_FAILS(ebb_tensor_is_inference(v, &b), EBB_EFREED, "ebb_tensor_is_inference: t");
  EBB_REQUIRE_OK(ebb_tensor_release(h));
  EBB_CHECK_FAILS(ebb_op_mul_(h, ts[0]), EBB_EFREED, "released tensor");
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: threads that use a stale view at once take its history from the base once, and sum exactly",
          "[autograd][inplace][threads]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({2, 3}, 24)}, true);
  Tensor h, row, one = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 1, 1});
  std::vector<Tensor> views(8);
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, h.out()));
  for (auto &v : views) EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 0, v.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 1, row.out()));
  EBB_REQUIRE_OK(ebb_op_add_(row, one));  // every view above is now stale
  // Each thread records ops on every view (reading their grad_fns at once) and asks grad() of x.
  std::vector<std::thread> th;
  std::vector<int> ok(8, 0);
  std::vector<std::string> errs(8);
  for (int t = 0; t < 8; t++)
    th.emplace_back([&, t] {
      for (int i = 0; i < 8; i++) {
        ebb_tensor_t *m = nullptr, *s = nullptr, *g[1] = {nullptr};
        bool good = ebb_op_mul_scalar(views[(t + i) % 8], 2.0, &m) == EBB_OK && ebb_op_sum(m, nullptr, 0, false, &s) == EBB_OK;
        const ebb_tensor_t *roots[1] = {s}, *in[1] = {ts[0].get()};
        good = good && ebb_grad(roots, nullptr, 1, in, 1, false, false, g) == EBB_OK;
        if (good && g[0]) {  // (read back without Catch, which is not thread-safe)
          double r[6] = {0};
          good = ebb_tensor_to_host(g[0], r, sizeof r) == EBB_OK && r[0] == 2 && r[1] == 2 && r[2] == 2 && r[3] == 0 &&
                 r[4] == 0 && r[5] == 0;
        } else if (good) {
          good = false;
        }
        if (!good && errs[t].empty()) errs[t] = std::string(g[0] ? "wrong gradient; " : "no gradient; ") + ebb_last_error();
        if (g[0]) ebb_tensor_release(g[0]);
        if (s) ebb_tensor_release(s);
        if (m) ebb_tensor_release(m);
        ok[t] += good;
      }
    });
  for (auto &x : th) x.join();
  for (int t = 0; t < 8; t++) {
    INFO("thread " << t << ": " << errs[t]);
    CHECK(ok[t] == 8);
  }
  for (auto &v : views) CHECK(grad_fn_name(v) == "AsStridedBackward");
  views.clear();
  h.reset(); row.reset(); one.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: a partial backward finds the nodes in-place ops and stale views made (they are linked as consumers)",
          "[autograd][inplace][partial]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  Tensor y, v, loss, w, lw;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(y, 0, 1, 3, 1, v.out()));
  Tensor three = make(EBB_DEVICE_CPU, EBB_F64, {2}, {3, 3});
  EBB_REQUIRE_OK(ebb_op_mul_(v, three));  // y's history: CopySlices over MulScalarBackward
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, loss.out()));
  const ebb_tensor_t *roots[1] = {loss.get()}, *in[1] = {x.get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, in, 1, true, false, g));
  Tensor gx(g[0]);
  CHECK(read(gx) == std::vector<double>{2, 6, 6, 2});
  // The view's own history, rebuilt from its base when next used, is found too.
  EBB_REQUIRE_OK(ebb_op_sum(v, nullptr, 0, false, lw.out()));
  const ebb_tensor_t *roots2[1] = {lw.get()};
  EBB_REQUIRE_OK(ebb_grad(roots2, nullptr, 1, in, 1, true, false, g));
  Tensor gv(g[0]);
  CHECK(read(gv) == std::vector<double>{0, 6, 6, 0});
  for (Tensor *t : {&x, &y, &v, &loss, &w, &lw, &three, &gx, &gv}) t->reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- node metadata, aliasing, views and inference mode ---------------------------------------

namespace {

const ebb_node_t *grad_fn(const ebb_tensor_t *t) {
  const ebb_node_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, nullptr));
  return n;
}

void check_input_meta(const ebb_node_t *n, std::vector<int64_t> shape) {
  INFO(ebb_node_name(n));
  int k = 0;
  EBB_REQUIRE_OK(ebb_node_num_inputs(n, &k));
  REQUIRE(k == 1);
  ebb_node_input_info info;
  EBB_REQUIRE_OK(ebb_node_input_meta(n, 0, &info));
  CHECK(info.dtype == EBB_F64);
  CHECK(info.device == EBB_DEVICE_CPU);
  REQUIRE(info.ndim == (int)shape.size());
  for (size_t d = 0; d < shape.size(); d++) CHECK(info.shape[d] == shape[d]);
}

}  // namespace

// The nodes inplace.c builds (an in-place op's, CopySlices, AsStridedBackward) describe their
// outputs too: ebb_node_input_meta (and the pre-hook check, and a gradient edge used as a root)
// read entry nin + k of in_meta for the node's input k, one past the end of an in_meta that holds
// the nin inputs only.
TEST_CASE("inplace: ebb_node_input_meta of the nodes in-place ops make describes their output", "[autograd][inplace]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, values(12, 1));
  Tensor z = make(EBB_DEVICE_CPU, EBB_F64, {4}, values(4, 2));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
  Tensor h, r, s;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 1, r.out()));        // r = h[1], [4]
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 1, 0, 2, 1, s.out()));   // s = h[:, 0:2], [3,2]
  EBB_REQUIRE_OK(ebb_op_add_(r, z));
  check_input_meta(grad_fn(h), {3, 4});                        // CopySlices: the base
  check_input_meta(grad_fn(r), {4});                           // AsStridedBackward: the view
  check_input_meta(grad_fn(s), {3, 2});                        // a sibling's AsStridedBackward
  Tensor y;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_mul_(y, x));
  CHECK(std::string(ebb_node_name(grad_fn(y))) == "MulInplaceBackward");
  check_input_meta(grad_fn(y), {3, 4});
  // A gradient edge of such a node as a root with no gradient given: its numel comes from there.
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(r, &e));
  CHECK(ebb_backward_edges(&e, nullptr, 1, false, nullptr, 0) == EBB_EINVAL);
  CHECK(std::string(ebb_last_error()).find("4 elements") != std::string::npos);
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  x.reset(), z.reset(), h.reset(), r.reset(), s.reset(), y.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: a non-contiguous base with an offset (detach of a slice of a transpose)", "[autograd][inplace][views]") {
  EbbSession session;
  std::vector<double> xv(12), cv(6);
  for (int i = 0; i < 12; i++) xv[i] = i + 1;
  for (int i = 0; i < 6; i++) cv[i] = 10 * (i + 1);
  Tensor xc = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, xv);
  Tensor c = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, cv);
  Tensor src = make(EBB_DEVICE_CPU, EBB_F64, {2}, {0.5, -2.0});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(src, true));
  for (int op = 0; op < 2; op++) {
    INFO("op " << op);
    Tensor t, s, d, v, p, l, dd;
    EBB_REQUIRE_OK(ebb_tensor_transpose(xc, 0, 1, t.out()));      // [4,3]: t[i][j] = x[j][i]
    EBB_REQUIRE_OK(ebb_tensor_slice(t, 0, 1, 3, 1, s.out()));     // [2,3]: s[i][j] = x[j][i+1]
    EBB_REQUIRE_OK(ebb_tensor_detach(s, d.out()));                // not a view for autograd
    EBB_REQUIRE_OK(ebb_tensor_clone(d, dd.out()));                // d's old values
    auto old = read(dd);
    EBB_REQUIRE_OK(ebb_tensor_select(d, 1, 2, v.out()));          // v[i] = d[i][2] = x[2][i+1]
    if (op == 0) EBB_REQUIRE_OK(ebb_tensor_copy_(v, src));
    else EBB_REQUIRE_OK(ebb_op_mul_(v, src));
    EBB_REQUIRE_OK(ebb_op_mul(d, c, p.out()));
    EBB_REQUIRE_OK(ebb_op_sum(p, nullptr, 0, false, l.out()));
    const ebb_tensor_t *roots[1] = {l.get()};
    const ebb_tensor_t *in[1] = {src.get()};
    ebb_tensor_t *g[1] = {nullptr};
    EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, in, 1, true, false, g));
    Tensor gg(g[0]);
    auto r = read(gg);
    REQUIRE(r.size() == 2);
    for (int i = 0; i < 2; i++) {
      double want = cv[i * 3 + 2] * (op == 0 ? 1.0 : old[i * 3 + 2]);
      CHECK(r[i] == Approx(want));
    }
    // the rest of d: x restored by hand for the next round
    bool was;
    ebb_grad_set_enabled(false, &was);
    Tensor xr = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, xv);
    EBB_REQUIRE_OK(ebb_tensor_copy_(xc, xr));
    ebb_grad_set_enabled(was, nullptr);
  }
  xc.reset(), c.reset(), src.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: copy_ into a view from another dtype and another device", "[autograd][inplace][views]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    Tensor src = make(dev, EBB_F32, {2}, {5, 7});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(src, true));
    Tensor h, v, hh, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
    EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 1, 3, 1, v.out()));
    EBB_REQUIRE_OK(ebb_tensor_copy_(v, src));  // h = [2, 5, 7]
    EBB_REQUIRE_OK(ebb_op_mul(h, h, hh.out()));
    EBB_REQUIRE_OK(ebb_op_sum(hh, nullptr, 0, false, l.out()));
    const ebb_tensor_t *roots[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
    Tensor gx, gs;
    EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
    EBB_REQUIRE_OK(ebb_tensor_grad(src, gs.out()));
    REQUIRE(gs.get() != nullptr);
    CHECK(dtype_of(gs) == EBB_F32);
    CHECK(read(gx) == std::vector<double>{8, 0, 0});
    CHECK(read(gs) == std::vector<double>{10, 14});
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: an inference src refused for mul_ on a view leaves everything as it was", "[autograd][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  Tensor inf;
  bool was;
  ebb_inference_mode_set_enabled(true, &was);
  inf = make(EBB_DEVICE_CPU, EBB_F64, {2}, {4, 5});
  ebb_inference_mode_set_enabled(was, nullptr);
  Tensor h, v, w;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, v.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 1, 3, 1, w.out()));
  long nodes = ebb_autograd_live_nodes(), handles = ebb_debug_live_handles();
  const ebb_node_t *hn = grad_fn(h), *vn = grad_fn(v);
  uint64_t ver = 0, ver2 = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(h, &ver));
  CHECK(ebb_op_mul_(v, inf) == EBB_EINVAL);
  CHECK(std::string(ebb_last_error()).find("inference") != std::string::npos);
  EBB_REQUIRE_OK(ebb_tensor_version(h, &ver2));
  CHECK(ver == ver2);
  CHECK(grad_fn(h) == hn);
  CHECK(grad_fn(v) == vn);
  CHECK(read(h) == std::vector<double>{2, 4, 6});
  CHECK(ebb_autograd_live_nodes() == nodes);
  CHECK(ebb_debug_live_handles() == handles);
  // add_ saves nothing: allowed
  EBB_REQUIRE_OK(ebb_op_add_(v, inf));
  Tensor l;
  EBB_REQUIRE_OK(ebb_op_sum(w, nullptr, 0, false, l.out()));  // w = [8, 6]
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor gx;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  CHECK(read(gx) == std::vector<double>{0, 2, 2});
  l.reset(), h.reset(), v.reset(), w.reset(), x.reset(), inf.reset(), gx.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: two views changed in turn, the base released, a stale view and a view of a view", "[autograd][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor a = make(EBB_DEVICE_CPU, EBB_F64, {3}, {10, 20, 30});
  Tensor b = make(EBB_DEVICE_CPU, EBB_F64, {2}, {-1, -2});
  for (auto *t : {&x, &a, &b}) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(*t, true));
  Tensor h, r0, c2, tr, q, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 1.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 0, r0.out()));      // row 0
  EBB_REQUIRE_OK(ebb_tensor_transpose(h, 0, 1, tr.out()));   // [3,2]
  EBB_REQUIRE_OK(ebb_tensor_select(tr, 0, 2, c2.out()));     // column 2, a view of a view
  EBB_REQUIRE_OK(ebb_op_mul_(r0, a));                        // h[0] *= a: [10, 40, 90]
  EBB_REQUIRE_OK(ebb_op_mul_(c2, b));                        // h[:,2] *= b: h[0][2] = -90, h[1][2] = -12
  h.reset();
  tr.reset();
  // loss = sum(r0 * r0): r0 = [10, 40, -90] = [x00 a0, x01 a1, x02 a2 b0]
  EBB_REQUIRE_OK(ebb_op_mul(r0, r0, q.out()));
  EBB_REQUIRE_OK(ebb_op_sum(q, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor gx, ga, gb;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(a, ga.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(b, gb.out()));
  // d/dx00 = 2*10*a0 = 200; d/dx01 = 2*40*20 = 1600; d/dx02 = 2*(-90)*a2*b0 = 5400; row 1: 0
  CHECK(read(gx) == std::vector<double>{200, 1600, 5400, 0, 0, 0});
  // d/da = 2 r0 * x0 * [1,1,b0]: [2*10*1, 2*40*2, 2*-90*3*-1]
  CHECK(read(ga) == std::vector<double>{20, 160, 540});
  // d/db0 = 2*(-90) * 90 = -16200; d/db1 = 0 (h[1][2] not in the loss)
  CHECK(read(gb) == std::vector<double>{-16200, 0});
  l.reset(), q.reset(), r0.reset(), c2.reset(), x.reset(), a.reset(), b.reset(), gx.reset(), ga.reset(), gb.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// ops/binary.c elementwise_inplace: were add_ and mul_ to run the kernel straight from src into
// dst, a src view that partly overlaps dst (a row of dst broadcast over it) would be read after
// some of its elements were written, so the result would depend on the order of the writes, and
// autograd's node (which takes src's value before the op) would describe a value dst does not
// hold. So src on dst's storage in another geometry is read through a copy; identical aliasing
// (x.add_(x)) needs none. copy_ is checked too.
TEST_CASE("inplace: add_ from a view that partly overlaps dst reads src as it was before the op",
          "[autograd][inplace]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor c = make(dev, EBB_F64, {3, 2}, {1, 2, 3, 4, 5, 6}), s, s2;
    EBB_REQUIRE_OK(ebb_tensor_slice(c, 0, 0, 2, 1, s.out()));   // rows 0, 1
    EBB_REQUIRE_OK(ebb_tensor_slice(c, 0, 1, 3, 1, s2.out()));  // rows 1, 2
    EBB_REQUIRE_OK(ebb_tensor_copy_(s2, s));                     // rows 1, 2 = the old rows 0, 1
    CHECK(read(c) == std::vector<double>{1, 2, 1, 2, 3, 4});
    Tensor h = make(dev, EBB_F64, {3, 2}, {1, 2, 3, 4, 5, 6}), r;
    EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 0, r.out()));  // r = h[0] = [1, 2], broadcast over h
    ebb_status st = ebb_op_add_(h, r);
    // Either refused, or h + (its row 0 as it was); never row 0 doubled added to the rest.
    if (st == EBB_OK) CHECK(read(h) == std::vector<double>{2, 4, 4, 6, 6, 8});
    else CHECK(st == EBB_EINVAL);
  }
}

namespace {
// Leaves x [4] and z [2]; h = 2x with two views, s = h[0:2] and r = h[2:4]; then r += z in place,
// which leaves s stale (its base changed through another view since s took its grad_fn).
struct StaleView {
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4}), z = make(EBB_DEVICE_CPU, EBB_F64, {2}, {10, 20}), h, s, r;
  StaleView() {
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
    EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, s.out()));
    EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 2, 4, 1, r.out()));
    EBB_REQUIRE_OK(ebb_op_add_(r, z));
  }
};
}  // namespace

// A view whose base was changed in place through another view takes its grad_fn again from the
// base when next read (ebb__grad_fn_now). ebb_tensor_gradient_edge, ebb_register_multi_grad_hook
// ("all") and ebb_register_logging_hooks read m->grad_fn directly: a stale view's old node, which
// is not in the graph its later uses build.
TEST_CASE("inplace: a stale view's gradient edge is the node its uses build on", "[autograd][inplace][views]") {
  EbbSession session;
  StaleView sv;
  Tensor &x = sv.x, &z = sv.z, &h = sv.h, &s = sv.s, &r = sv.r, m, l;
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(s, &e));
  CHECK(e.node == grad_fn(s));
  CHECK(std::string(ebb_node_name(e.node)) == "AsStridedBackward");
  EBB_REQUIRE_OK(ebb_op_mul_scalar(s, 3.0, m.out()));
  EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
  ebb_gradient_edge le;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(l, &le));
  ebb_tensor_t *g[1] = {nullptr};
  ebb_status st = ebb_grad_edges(&le, nullptr, 1, &e, 1, false, false, g);
  INFO(ebb_last_error());
  CHECK(st == EBB_OK);
  Tensor gg(g[0]);
  if (st == EBB_OK) CHECK(read(gg) == std::vector<double>{3, 3});
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&le));
  gg.reset(), l.reset(), m.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

namespace {
struct MgSeen {
  int calls = 0;
  std::vector<bool> got;
};
ebb_status mg_record(const ebb_tensor_t *const *grads, int n, void *user) {
  auto *s = static_cast<MgSeen *>(user);
  s->calls++;
  s->got.clear();
  for (int i = 0; i < n; i++) s->got.push_back(grads[i] != nullptr);
  return EBB_OK;
}
}  // namespace

TEST_CASE("inplace: a multi-grad hook (all) over a stale view waits for the view's gradient", "[autograd][inplace][views]") {
  EbbSession session;
  StaleView sv;
  Tensor &x = sv.x, &z = sv.z, &h = sv.h, &s = sv.s, &r = sv.r, m, l;
  MgSeen seen;
  ebb_hook_handle hh;
  ebb_tensor_t *ts[2] = {s.get(), x.get()};
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 2, mg_record, &seen, EBB_MULTI_GRAD_ALL, &hh));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(s, 3.0, m.out()));
  EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  CHECK(seen.calls == 1);
  CHECK(seen.got == std::vector<bool>{true, true});
  EBB_REQUIRE_OK(ebb_hook_remove(hh));
  l.reset(), m.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace: logging hooks from a stale view cover the nodes its backward runs", "[autograd][inplace][views]") {
  EbbSession session;
  StaleView sv;
  Tensor &x = sv.x, &z = sv.z, &h = sv.h, &s = sv.s, &r = sv.r;
  std::vector<std::string> lines;
  ebb_hook_handle lh;
  const ebb_tensor_t *lroots[1] = {s.get()};
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(
      lroots, 1, [](const char *line, void *u) { static_cast<std::vector<std::string> *>(u)->push_back(line); }, &lines, &lh));
  const ebb_tensor_t *roots[1] = {s.get()};
  Tensor ones = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 1});
  const ebb_tensor_t *gr[1] = {ones.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, gr, 1, false, nullptr, 0));
  std::string all;
  for (auto &ln : lines) all += ln + "\n";
  INFO(all);
  CHECK(all.find("AsStridedBackward") != std::string::npos);
  CHECK(all.find("CopySlices") != std::string::npos);
  EBB_REQUIRE_OK(ebb_hook_remove(lh));
  Tensor gx;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  CHECK(read(gx) == std::vector<double>{2, 2, 0, 0});
  gx.reset(), ones.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// ---- the in-place family of ops.h (add_scaled_, add_scalar_, mul_scalar_, lerp_, addcmul_,
// addcdiv_, sqrt_, zero_): recorded like add_ and mul_ ----------------------------------------------

TEST_CASE("inplace family: each update on a non-leaf and on a view rebases the history, and gradients match",
          "[autograd][inplace][family]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    // h = 2x (a non-leaf), then every update in turn, srcs broadcast; the loss reads h.
    LossFn f = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
      Tensor h, q, pos;
      ebb_status st = ebb_op_mul_scalar(p[0], 2.0, h.out());      // h [2,3]
      if (!st) st = ebb_op_add_scaled_(h, p[1], -0.5);           // h += -0.5 y [3]
      if (!st) st = ebb_op_lerp_(h, p[2], 0.3);                  // towards z [2,3]
      if (!st) st = ebb_op_lerp_(h, p[1], 0.8);                  // the other formula
      if (!st) st = ebb_op_addcmul_(h, p[1], p[2], 0.5);         // += 0.5 y z
      if (!st) st = ebb_op_mul(p[3], p[3], pos.out());           // w^2 + 1 > 0
      if (!st) st = ebb_op_add_scalar_(pos, 1.0);
      if (!st) st = ebb_op_addcdiv_(h, p[2], pos, -0.25);        // += -0.25 z / (w^2 + 1)
      if (!st) st = ebb_op_mul_scalar_(h, 1.5);
      if (!st) st = ebb_op_add_scalar_(h, 3.0);                  // h > 0 for sqrt_ (values in [-1, 1])
      if (!st) st = ebb_op_mul(h, h, q.out());
      if (!st) st = ebb_op_add_scalar_(q, 0.5);
      if (!st) st = ebb_op_sqrt_(q);                             // sqrt(h^2 + 0.5)
      if (!st) st = sum_sq(q, out);
      return st;
    };
    check_gradients(dev, {rnd({2, 3}, 40), rnd({3}, 41), rnd({2, 3}, 42), rnd({2, 3}, 43)}, f);
    // The same through views of a non-leaf: addcmul_ on a row (three inputs: CopySlices of
    // three), lerp_ on a transposed slice, zero_ on a column.
    LossFn g = [](const std::vector<ebb_tensor_t *> &p, ebb_tensor_t **out) {
      Tensor h, r, t, c, col;
      ebb_status st = ebb_op_mul_scalar(p[0], 2.0, h.out());      // h [3,4]
      if (!st) st = ebb_tensor_select(h, 0, 1, r.out());          // r = h[1] [4]
      if (!st) st = ebb_op_addcmul_(r, p[1], p[2], 0.75);         // r += 0.75 y [4] z [1]
      if (!st) st = ebb_tensor_transpose(h, 0, 1, t.out());       // [4,3]
      if (!st) st = ebb_tensor_slice(t, 0, 1, 3, 1, c.out());     // [2,3]
      if (!st) st = ebb_op_lerp_(c, p[3], 0.4);                   // towards w [3]
      if (!st) st = ebb_tensor_select(h, 1, 3, col.out());        // h[:, 3]
      if (!st) st = ebb_op_zero_(col);
      if (!st) st = sum_sq(h, out);
      return st;
    };
    check_gradients(dev, {rnd({3, 4}, 44), rnd({4}, 45), rnd({1}, 46), rnd({3}, 47)}, g);
  }
  // The nodes' names, and what their edges reach.
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 48), rnd({3}, 49)}, true);
  Tensor h;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, h.out()));
  struct Step {
    std::function<ebb_status()> f;
    const char *node;
  };
  const std::vector<Step> steps = {
      {[&] { return ebb_op_add_scaled_(h, ts[1], 2.0); }, "AddScaledInplaceBackward"},
      {[&] { return ebb_op_add_scalar_(h, 2.0); }, "AddScalarInplaceBackward"},
      {[&] { return ebb_op_mul_scalar_(h, 2.0); }, "MulScalarInplaceBackward"},
      {[&] { return ebb_op_lerp_(h, ts[1], 0.5); }, "LerpInplaceBackward"},
      {[&] { return ebb_op_addcmul_(h, ts[1], ts[0], 0.5); }, "AddcmulInplaceBackward"},
      {[&] { return ebb_op_addcdiv_(h, ts[1], ts[1], 0.5); }, "AddcdivInplaceBackward"},
      {[&] { return ebb_op_sqrt_(h); }, "SqrtInplaceBackward"},
      {[&] { return ebb_op_zero_(h); }, "ZeroBackward"},
  };
  uint64_t v = version_of(h);
  for (const auto &s : steps) {
    INFO(s.node);
    EBB_REQUIRE_OK(s.f());
    CHECK(grad_fn_name(h) == s.node);
    CHECK(version_of(h) == ++v);
  }
  const ebb_node_t *n = nullptr, *e = nullptr;
  EBB_REQUIRE_OK(ebb_op_addcmul_(h, ts[1], ts[0], 0.5));
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(h, &n, nullptr));
  EBB_REQUIRE_OK(ebb_node_next(n, 0, &e, nullptr));
  CHECK(std::string(ebb_node_name(e)) == "ZeroBackward");  // h's old history
  EBB_REQUIRE_OK(ebb_node_next(n, 2, &e, nullptr));
  CHECK(std::string(ebb_node_name(e)) == "AccumulateGrad");  // t2, the leaf x
  h.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace family: a leaf that requires a gradient is refused with grad mode on, an optimizer step with it off is not",
          "[autograd][inplace][family][errors]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto ts = make_leaves(dev, {rnd({2, 3}, 50), rnd({2, 3}, 51)}, true);
    EBB_REQUIRE_OK(ebb_tensor_set_name(ts[0], "weight"));
    Tensor m = make(dev, EBB_F64, {2, 3}, std::vector<double>(6, 0.0)), vv = make(dev, EBB_F64, {2, 3}, std::vector<double>(6, 0.0));
    Tensor g = make(dev, EBB_F64, {2, 3}, values(6, 52)), col;
    const auto before = read(ts[0]);
    const std::string leaf = "dst 'weight' (f64[2, 3] on " + std::string(dev == EBB_DEVICE_CPU ? "the CPU" : "device " + std::to_string(dev)) + ") is a leaf";
    EBB_CHECK_FAILS(ebb_op_add_scaled_(ts[0], g, -0.1), EBB_EINVAL, "ebb_op_add_scaled_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_add_scalar_(ts[0], 1.0), EBB_EINVAL, "ebb_op_add_scalar_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(ts[0], 0.9), EBB_EINVAL, "ebb_op_mul_scalar_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_lerp_(ts[0], g, 0.5), EBB_EINVAL, "ebb_op_lerp_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_addcmul_(ts[0], g, g, 0.5), EBB_EINVAL, "ebb_op_addcmul_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_addcdiv_(ts[0], g, g, 0.5), EBB_EINVAL, "ebb_op_addcdiv_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_sqrt_(ts[0]), EBB_EINVAL, "ebb_op_sqrt_: " + leaf);
    EBB_CHECK_FAILS(ebb_op_zero_(ts[0]), EBB_EINVAL, "ebb_op_zero_: " + leaf);
    EBB_REQUIRE_OK(ebb_tensor_select(ts[0], 1, 0, col.out()));
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(col, 0.9), EBB_EINVAL, "ebb_op_mul_scalar_: dst is a view of a leaf");
    CHECK(read(ts[0]) == before);
    CHECK(version_of(ts[0]) == 0);
    // An Adam-like step with grad mode off: moments from the gradient, then the update; the
    // leaf stays a leaf (no history), its version moves once per update.
    bool was;
    ebb_grad_set_enabled(false, &was);
    EBB_REQUIRE_OK(ebb_op_lerp_(m, g, 0.1));              // m = 0.9 m + 0.1 g
    EBB_REQUIRE_OK(ebb_op_mul_scalar_(vv, 0.999));
    EBB_REQUIRE_OK(ebb_op_addcmul_(vv, g, g, 0.001));     // v = 0.999 v + 0.001 g^2
    Tensor den;
    EBB_REQUIRE_OK(ebb_tensor_clone(vv, den.out()));
    EBB_REQUIRE_OK(ebb_op_sqrt_(den));
    EBB_REQUIRE_OK(ebb_op_add_scalar_(den, 1e-8));
    EBB_REQUIRE_OK(ebb_op_mul_scalar_(ts[0], 1.0 - 1e-3 * 0.01));  // decoupled weight decay
    EBB_REQUIRE_OK(ebb_op_addcdiv_(ts[0], m, den, -1e-3));
    ebb_grad_set_enabled(was, nullptr);
    CHECK(grad_fn_name(ts[0]) == "(leaf)");
    CHECK(version_of(ts[0]) == 2);
    // the step itself, against its formula on the host
    auto w = read(ts[0]), gv = read(g);
    for (size_t j = 0; j < w.size(); j++) {
      const double mj = 0.1 * gv[j], vj = 0.001 * gv[j] * gv[j];
      const double want = before[j] * (1.0 - 1e-5) - 1e-3 * mj / (std::sqrt(vj) + 1e-8);
      CHECK(std::fabs(w[j] - want) < 1e-12);
    }
    // A leaf as a src is fine with grad mode on (the leaf gets a gradient).
    Tensor h;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[1], 1.0, h.out()));
    EBB_REQUIRE_OK(ebb_op_addcmul_(h, ts[0], ts[1], 1.0));
    col.reset();
    h.reset();
    ts.clear();
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace family: addcmul_ saves t1 and t2, and a later change to one fails backward naming it",
          "[autograd][inplace][family][errors]") {
  EbbSession session;
  auto ts = make_leaves(EBB_DEVICE_CPU, {rnd({3}, 53), rnd({3}, 54)}, true);
  Tensor h, t2 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3}), l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(ts[0], 1.0, h.out()));
  EBB_REQUIRE_OK(ebb_op_addcmul_(h, ts[1], t2, 2.0));
  EBB_REQUIRE_OK(ebb_op_sum(h, nullptr, 0, false, l.out()));
  EBB_REQUIRE_OK(ebb_op_add_scalar_(t2, 1.0));  // t2 requires no gradient: allowed, its version moves
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_CHECK_FAILS(ebb_backward(roots, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "AddcmulInplaceBackward");
  std::string msg = ebb_last_error();
  CHECK(msg.find("saved input 2") != std::string::npos);
  CHECK(msg.find("saved at version 0, now 1") != std::string::npos);
  h.reset();
  l.reset();
  t2.reset();
  ts.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
