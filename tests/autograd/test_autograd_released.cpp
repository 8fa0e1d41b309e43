// A released tensor passed to any call of autograd.h is EBB_EFREED (tensor.h's rule), alone or at
// any position of a tensor array (roots, their gradients, inputs, a multi-grad hook's tensors,
// ...), with a message naming the call; nothing is registered, run or returned. Each case is a
// call that succeeds with the live tensors it is given; the test then puts a freshly released
// tensor in each tensor position in turn.
#include <functional>
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

ebb_tensor_t *mut(const ebb_tensor_t *t) { return const_cast<ebb_tensor_t *>(t); }

ebb_status keep_hook(const ebb_tensor_t *, ebb_tensor_t **, void *) { return EBB_OK; }
ebb_status keep_post(const ebb_tensor_t *, void *) { return EBB_OK; }
ebb_status keep_multi(const ebb_tensor_t *const *, int, void *) { return EBB_OK; }
void no_log(const char *, void *) {}

// Removes a hook a successful registration returned.
ebb_status removed(ebb_status st, ebb_hook_handle h) {
  if (st == EBB_OK) REQUIRE(ebb_hook_remove(h) == EBB_OK);
  return st;
}

// Releases the tensors a successful call returned.
ebb_status dropped(ebb_status st, std::vector<ebb_tensor_t *> ts) {
  for (auto *t : ts) {
    if (st != EBB_OK) CHECK(t == nullptr);
    if (t) ebb_tensor_release(t);
  }
  return st;
}

}  // namespace

TEST_CASE("released tensors: every autograd call refuses one, alone or in an array, with EBB_EFREED",
          "[autograd][errors][released]") {
  EbbSession session;
  // Two leaves, a non-leaf y = w1 * w2 and two scalar roots l1 = sum(y), l2 = sum(w1), kept
  // (retain_graph) for every backward below.
  Tensor w1 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3}), w2 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {4, 5, 6});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w1, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w2, true));
  Tensor y, l1, l2;
  EBB_REQUIRE_OK(ebb_op_mul(w1, w2, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l1.out()));
  EBB_REQUIRE_OK(ebb_op_sum(w1, nullptr, 0, false, l2.out()));
  Tensor one1 = make(EBB_DEVICE_CPU, EBB_F64, {}, {1}), one2 = make(EBB_DEVICE_CPU, EBB_F64, {}, {1});
  Tensor g3 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {0, 0, 0});
  Tensor plain1 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 1, 1}), plain2 = make(EBB_DEVICE_CPU, EBB_F64, {3}, {2, 2, 2});
  ebb_gradient_edge e1, e2, ein;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(l1, &e1));
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(l2, &e2));
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(w1, &ein));
  const ebb_gradient_edge roots_e[2] = {e1, e2};

  std::vector<ReleasedCase> cases = {
      {"ebb_tensor_is_inference", {w1}, [](const TensorArgs &a) { bool b; return ebb_tensor_is_inference(a[0], &b); }},
      {"ebb_tensor_set_requires_grad", {plain1}, [](const TensorArgs &a) { return ebb_tensor_set_requires_grad(mut(a[0]), false); }},
      {"ebb_tensor_requires_grad", {w1}, [](const TensorArgs &a) { bool b; return ebb_tensor_requires_grad(a[0], &b); }},
      {"ebb_tensor_is_leaf", {w1}, [](const TensorArgs &a) { bool b; return ebb_tensor_is_leaf(a[0], &b); }},
      {"ebb_tensor_grad_fn", {y},
       [](const TensorArgs &a) {
         const ebb_node_t *n = nullptr;
         int nr = 0;
         return ebb_tensor_grad_fn(a[0], &n, &nr);
       }},
      {"ebb_tensor_detach", {y},
       [](const TensorArgs &a) {
         ebb_tensor_t *o = nullptr;
         ebb_status st = ebb_tensor_detach(a[0], &o);
         return dropped(st, {o});
       }},
      {"ebb_tensor_grad", {w1},
       [](const TensorArgs &a) {
         ebb_tensor_t *o = nullptr;
         ebb_status st = ebb_tensor_grad(a[0], &o);
         return dropped(st, {o});
       }},
      {"ebb_tensor_set_grad", {w2, g3}, [](const TensorArgs &a) { return ebb_tensor_set_grad(mut(a[0]), a[1]); }},
      {"ebb_tensor_register_hook", {w1},
       [](const TensorArgs &a) {
         ebb_hook_handle h{};
         return removed(ebb_tensor_register_hook(mut(a[0]), keep_hook, nullptr, &h), h);
       }},
      {"ebb_tensor_register_post_accumulate_hook", {w1},
       [](const TensorArgs &a) {
         ebb_hook_handle h{};
         return removed(ebb_tensor_register_post_accumulate_hook(mut(a[0]), keep_post, nullptr, &h), h);
       }},
      {"ebb_tensor_retain_grad", {y}, [](const TensorArgs &a) { return ebb_tensor_retain_grad(mut(a[0])); }},
      {"ebb_tensor_gradient_edge", {w1},
       [](const TensorArgs &a) {
         ebb_gradient_edge e{};
         ebb_status st = ebb_tensor_gradient_edge(a[0], &e);
         if (st == EBB_OK) REQUIRE(ebb_gradient_edge_release(&e) == EBB_OK);
         return st;
       }},
      // Arrays: roots, their gradients, inputs.
      {"ebb_backward", {l1, l2, one1, one2, w1, w2},
       [](const TensorArgs &a) { return ebb_backward(&a[0], &a[2], 2, true, &a[4], 2); }},
      {"ebb_grad", {l1, l2, one1, one2, w1, y},
       [](const TensorArgs &a) {
         ebb_tensor_t *g[2] = {nullptr, nullptr};
         ebb_status st = ebb_grad(&a[0], &a[2], 2, &a[4], 2, true, false, g);
         return dropped(st, {g[0], g[1]});
       }},
      {"ebb_autograd_backward", {l1, l2, one1, one2, w1, w2},
       [](const TensorArgs &a) {
         ebb_autograd_backward_options o = {};
         o.retain_graph = true;
         o.grad_roots = &a[2];
         o.inputs = &a[4];
         o.ninputs = 2;
         return ebb_autograd_backward(&a[0], 2, &o);
       }},
      {"ebb_autograd_grad", {l1, l2, one1, one2, w1, y},
       [](const TensorArgs &a) {
         ebb_autograd_grad_options o = {};
         o.retain_graph = true;
         o.grad_outputs = &a[2];
         ebb_tensor_t *g[2] = {nullptr, nullptr};
         ebb_status st = ebb_autograd_grad(&a[0], 2, &a[4], 2, g, &o);
         return dropped(st, {g[0], g[1]});
       }},
      {"ebb_backward_edges", {one1, one2},
       [&](const TensorArgs &a) { return ebb_backward_edges(roots_e, &a[0], 2, true, &ein, 1); }},
      {"ebb_grad_edges", {one1, one2},
       [&](const TensorArgs &a) {
         ebb_tensor_t *g[1] = {nullptr};
         ebb_status st = ebb_grad_edges(roots_e, &a[0], 2, &ein, 1, true, false, g);
         return dropped(st, {g[0]});
       }},
      {"ebb_autograd_increment_version", {plain1, plain2},
       [](const TensorArgs &a) {
         ebb_tensor_t *ts[2] = {mut(a[0]), mut(a[1])};
         return ebb_autograd_increment_version(ts, 2);
       }},
      {"ebb_register_multi_grad_hook", {w1, y},
       [](const TensorArgs &a) {
         ebb_tensor_t *ts[2] = {mut(a[0]), mut(a[1])};
         ebb_hook_handle h{};
         return removed(ebb_register_multi_grad_hook(ts, 2, keep_multi, nullptr, EBB_MULTI_GRAD_ALL, &h), h);
       }},
      {"ebb_autograd_register_logging_hooks", {l1, l2},
       [](const TensorArgs &a) {
         ebb_hook_handle h{};
         return removed(ebb_autograd_register_logging_hooks(a.data(), 2, no_log, nullptr, &h), h);
       }},
  };
  for (const auto &c : cases) check_released_case(c);

  // Nothing a refused call touched: one more backward gives the gradients of l1 + l2 once more.
  EBB_REQUIRE_OK(ebb_tensor_set_grad(w1, nullptr));
  EBB_REQUIRE_OK(ebb_tensor_set_grad(w2, nullptr));
  const ebb_tensor_t *roots[2] = {l1, l2};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 2, true, nullptr, 0));
  Tensor gw1, gw2;
  EBB_REQUIRE_OK(ebb_tensor_grad(w1, gw1.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(w2, gw2.out()));
  CHECK(read(gw1) == std::vector<double>{5, 6, 7});  // w2 + 1
  CHECK(read(gw2) == std::vector<double>{1, 2, 3});  // w1
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e1));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e2));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&ein));
}
