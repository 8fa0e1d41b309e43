// The options forms of backward and grad (ebb_autograd_backward, ebb_autograd_grad): a
// zero-initialised struct gives ebb_backward's and ebb_grad's defaults, each field does what its
// positional argument does, messages name the options call, and bad options (NULL, a version
// newer than the library) are refused before anything runs.
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor leaf(std::vector<double> v) {
  Tensor t = make(EBB_DEVICE_CPU, EBB_F64, {(int64_t)v.size()}, v);
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

// l = sum(a * b): dl/da = b, dl/db = a.
Tensor loss_of(const ebb_tensor_t *a, const ebb_tensor_t *b) {
  Tensor y, l;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  return l;
}

// t's .grad as doubles; empty when it has none.
std::vector<double> grad_of(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  return g.get() ? read(g) : std::vector<double>{};
}

}  // namespace

TEST_CASE("options: a zero-initialised struct gives ebb_backward's defaults, retain_graph by name keeps the graph",
          "[autograd][engine][options]") {
  EbbSession session;
  Tensor a = leaf({1, 2, 3}), b = leaf({4, 5, 6});
  Tensor l = loss_of(a, b);
  const ebb_tensor_t *roots[1] = {l.get()};
  ebb_autograd_backward_options keep = {};
  keep.retain_graph = true;
  EBB_REQUIRE_OK(ebb_autograd_backward(roots, 1, &keep));
  CHECK(grad_of(a) == std::vector<double>{4, 5, 6});
  CHECK(grad_of(b) == std::vector<double>{1, 2, 3});
  // Defaults: no retain_graph, so the saved tensors go and a second backward is refused.
  ebb_autograd_backward_options defaults = {};
  EBB_REQUIRE_OK(ebb_autograd_backward(roots, 1, &defaults));
  CHECK(grad_of(a) == std::vector<double>{8, 10, 12});
  EBB_CHECK_FAILS(ebb_autograd_backward(roots, 1, &defaults), EBB_ESTATE, "ebb_autograd_backward: ");
  // The same through ebb_backward: the positional form is the same call.
  Tensor l2 = loss_of(a, b);
  const ebb_tensor_t *roots2[1] = {l2.get()};
  EBB_REQUIRE_OK(ebb_backward(roots2, nullptr, 1, false, nullptr, 0));
  CHECK(grad_of(a) == std::vector<double>{12, 15, 18});
  EBB_CHECK_FAILS(ebb_backward(roots2, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "ebb_backward: ");
}

TEST_CASE("options: grad_roots and inputs by name give a seeded, partial backward", "[autograd][engine][options]") {
  EbbSession session;
  Tensor a = leaf({1, 2, 3}), b = leaf({4, 5, 6});
  Tensor y;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, y.out()));
  Tensor seed = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 10, 100});
  const ebb_tensor_t *roots[1] = {y.get()}, *grads[1] = {seed.get()}, *inputs[1] = {a.get()};
  ebb_autograd_backward_options o = {};
  o.version = EBB_AUTOGRAD_OPTIONS_VERSION;
  o.grad_roots = grads;
  o.inputs = inputs;
  o.ninputs = 1;
  EBB_REQUIRE_OK(ebb_autograd_backward(roots, 1, &o));
  CHECK(grad_of(a) == std::vector<double>{4, 50, 600});
  CHECK(grad_of(b).empty());  // not an input: untouched
  // Without grad_roots, a root of 3 elements has no implied gradient: ebb_backward's error,
  // named after the options call.
  Tensor y2;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, y2.out()));
  const ebb_tensor_t *roots2[1] = {y2.get()};
  ebb_autograd_backward_options none = {};
  EBB_CHECK_FAILS(ebb_autograd_backward(roots2, 1, &none), EBB_EINVAL, "ebb_autograd_backward: root 0 has 3 elements");
}

TEST_CASE("options: ebb_autograd_grad takes retain_graph and allow_unused by name", "[autograd][engine][options]") {
  EbbSession session;
  Tensor a = leaf({1, 2, 3}), b = leaf({4, 5, 6}), unused = leaf({7, 8, 9});
  Tensor l = loss_of(a, b);
  const ebb_tensor_t *outs[1] = {l.get()}, *inputs[2] = {a.get(), unused.get()};
  ebb_tensor_t *g[2] = {nullptr, nullptr};
  // Defaults: an input the outputs do not depend on is an error; nothing is returned.
  ebb_autograd_grad_options defaults = {};
  EBB_CHECK_FAILS(ebb_autograd_grad(outs, 1, inputs, 2, g, &defaults), EBB_EINVAL, "ebb_autograd_grad: inputs[1]");
  CHECK(g[0] == nullptr);
  CHECK(g[1] == nullptr);
  // allow_unused (and retain_graph, so the graph serves again): NULL for it.
  ebb_autograd_grad_options o = {};
  o.retain_graph = true;
  o.allow_unused = true;
  EBB_REQUIRE_OK(ebb_autograd_grad(outs, 1, inputs, 2, g, &o));
  Tensor ga(g[0]);
  CHECK(read(ga) == std::vector<double>{4, 5, 6});
  CHECK(g[1] == nullptr);
  CHECK(grad_of(a).empty());  // grad never writes .grad
  // grad_outputs by name: the root's gradient scales the result.
  Tensor two = make(EBB_DEVICE_CPU, EBB_F64, {}, {2});
  const ebb_tensor_t *seed[1] = {two.get()};
  o.grad_outputs = seed;
  EBB_REQUIRE_OK(ebb_autograd_grad(outs, 1, inputs, 2, g, &o));
  Tensor ga2(g[0]);
  CHECK(read(ga2) == std::vector<double>{8, 10, 12});
  // Without retain_graph the graph goes after this call.
  o.retain_graph = false;
  EBB_REQUIRE_OK(ebb_autograd_grad(outs, 1, inputs, 2, g, &o));
  Tensor ga3(g[0]);
  CHECK(read(ga3) == std::vector<double>{8, 10, 12});
  EBB_CHECK_FAILS(ebb_autograd_grad(outs, 1, inputs, 2, g, &o), EBB_ESTATE, "ebb_autograd_grad: ");
  CHECK(g[0] == nullptr);
}

TEST_CASE("options: NULL options, a newer version and NULL grads are refused before anything runs", "[autograd][engine][options][errors]") {
  EbbSession session;
  Tensor a = leaf({1, 2, 3}), b = leaf({4, 5, 6});
  Tensor l = loss_of(a, b);
  const ebb_tensor_t *roots[1] = {l.get()}, *inputs[1] = {a.get()};
  static char mark;
  ebb_tensor_t *sentinel = reinterpret_cast<ebb_tensor_t *>(&mark);  // never read: must stay as it is
  ebb_tensor_t *g[1] = {sentinel};
  EBB_CHECK_FAILS(ebb_autograd_backward(roots, 1, nullptr), EBB_EINVAL, "ebb_autograd_backward: opts is NULL");
  EBB_CHECK_FAILS(ebb_autograd_grad(roots, 1, inputs, 1, g, nullptr), EBB_EINVAL, "ebb_autograd_grad: opts is NULL");
  CHECK(g[0] == sentinel);
  ebb_autograd_backward_options bo = {};
  bo.version = EBB_AUTOGRAD_OPTIONS_VERSION + 1;
  ebb_autograd_grad_options go = {};
  go.version = EBB_AUTOGRAD_OPTIONS_VERSION + 1;
  std::string newer = "opts->version is " + std::to_string(EBB_AUTOGRAD_OPTIONS_VERSION + 1);
  EBB_CHECK_FAILS(ebb_autograd_backward(roots, 1, &bo), EBB_ENOTSUP, newer);
  EBB_CHECK_FAILS(ebb_autograd_grad(roots, 1, inputs, 1, g, &go), EBB_ENOTSUP, newer);
  CHECK(g[0] == sentinel);
  go.version = 0;
  EBB_CHECK_FAILS(ebb_autograd_grad(roots, 1, inputs, 1, nullptr, &go), EBB_EINVAL, "ebb_autograd_grad: grads is NULL");
  EBB_CHECK_FAILS(ebb_autograd_backward(nullptr, 1, &bo), EBB_ENOTSUP, newer);  // the options first
  bo.version = 0;
  EBB_CHECK_FAILS(ebb_autograd_backward(nullptr, 1, &bo), EBB_EINVAL, "ebb_autograd_backward: no roots");
  // Nothing ran: no .grad, and the graph (not retained) still serves one backward.
  CHECK(grad_of(a).empty());
  EBB_REQUIRE_OK(ebb_autograd_backward(roots, 1, &bo));
  CHECK(grad_of(a) == std::vector<double>{4, 5, 6});
  // A success leaves the last error alone.
  EBB_CHECK_FAILS(ebb_autograd_backward(roots, 1, nullptr), EBB_EINVAL, "opts is NULL");
  std::string before = ebb_last_error();
  Tensor l2 = loss_of(a, b);
  const ebb_tensor_t *roots2[1] = {l2.get()};
  EBB_REQUIRE_OK(ebb_autograd_backward(roots2, 1, &bo));
  CHECK(before == ebb_last_error());
}
