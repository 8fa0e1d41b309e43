// Messages of the autograd calls (ebb/autograd.h) that describe a tensor: each names the
// argument with its index in an array (roots[1], grad_roots[1], inputs[1], tensors[1]), the
// tensor's own name when it has one (ebb_tensor_set_name), and its dtype, shape and device
// written f32[2, 3] on the CPU, both shapes where shapes are the problem. A released tensor is
// named by its argument and pointer only, never read.
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor named(int dev, ebb_dtype dt, std::vector<int64_t> shape, const char *name, bool requires_grad = false) {
  Tensor t = make(dev, dt, shape, values(numel_of(shape), 7));
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  if (requires_grad) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

// x (a named leaf, f32[2, 3]) -> y = 2 x ('y') -> loss = sum(y) ('loss'); w: an unnamed leaf
// of x's shape that the loss does not use; c: a named constant of x's shape.
struct Graph {
  Tensor x = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "x", true);
  Tensor w = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, nullptr, true);
  Tensor c = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "c");
  Tensor g = named(EBB_DEVICE_CPU, EBB_F32, {3, 2}, "g");  // a gradient of the wrong shape
  Tensor y, loss;
  Graph() {
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
    EBB_REQUIRE_OK(ebb_tensor_set_name(y, "y"));
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, loss.out()));
    EBB_REQUIRE_OK(ebb_tensor_set_name(loss, "loss"));
  }
};

ebb_status replace_with_3x2(const ebb_tensor_t *, ebb_tensor_t **replace, void *) {
  const int64_t s[2] = {3, 2};
  return ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 2, s, replace);
}

ebb_status replace_grads_with_3x2(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **replace, void *) {
  return replace_with_3x2(nullptr, &replace[0], nullptr);
}

ebb_status noop_post(const ebb_tensor_t *, void *) { return EBB_OK; }
ebb_status noop_multi(const ebb_tensor_t *const *, int, void *) { return EBB_OK; }
void noop_log(const char *, void *) {}

}  // namespace

TEST_CASE("messages: ebb_backward names the array element at its index, a named tensor's name, and both shapes",
          "[autograd][messages]") {
  EbbSession session;
  {
    Graph G;
    const ebb_tensor_t *dead = released_tensor();
    const ebb_tensor_t *r_null[2] = {G.loss, nullptr};
    EBB_CHECK_MSG(ebb_backward(r_null, nullptr, 2, true, nullptr, 0), EBB_EINVAL, "ebb_backward: roots[1] is NULL");
    const ebb_tensor_t *r_dead0[1] = {dead};
    EBB_CHECK_MSG(ebb_backward(r_dead0, nullptr, 1, true, nullptr, 0), EBB_EFREED, "ebb_backward: roots[0] (0x",
                  "is a released tensor");
    const ebb_tensor_t *r_dead1[2] = {G.loss, dead};
    EBB_CHECK_MSG(ebb_backward(r_dead1, nullptr, 2, true, nullptr, 0), EBB_EFREED, "roots[1] (0x");
    const ebb_tensor_t *r_const[2] = {G.loss, G.c};
    EBB_CHECK_MSG(ebb_backward(r_const, nullptr, 2, true, nullptr, 0), EBB_EINVAL,
                  "roots[1] 'c' (f32[2, 3] on the CPU) does not require a gradient");

    // grad_roots: the wrong shape, dtype, a released one, none for a root of 6 elements.
    const ebb_tensor_t *roots[2] = {G.loss, G.y};
    const ebb_tensor_t *gr_shape[2] = {nullptr, G.g};
    EBB_CHECK_MSG(ebb_backward(roots, gr_shape, 2, true, nullptr, 0), EBB_EINVAL, "grad_roots[1] 'g' (f32[3, 2] on the CPU)",
                  "roots[1] 'y' (f32[2, 3] on the CPU)");
    Tensor g64 = named(EBB_DEVICE_CPU, EBB_F64, {2, 3}, nullptr);
    const ebb_tensor_t *gr_dtype[2] = {nullptr, g64};
    EBB_CHECK_MSG(ebb_backward(roots, gr_dtype, 2, true, nullptr, 0), EBB_EINVAL, "grad_roots[1] (f64[2, 3] on the CPU)",
                  "roots[1] 'y' (f32[2, 3] on the CPU)");
    const ebb_tensor_t *gr_dead[2] = {nullptr, dead};
    EBB_CHECK_MSG(ebb_backward(roots, gr_dead, 2, true, nullptr, 0), EBB_EFREED, "grad_roots[1] (0x", "is a released tensor");
    EBB_CHECK_MSG(ebb_backward(roots, nullptr, 2, true, nullptr, 0), EBB_EINVAL, "roots[1] 'y' (f32[2, 3] on the CPU) has 6 elements",
                  "pass grad_roots[1]");

    // inputs
    const ebb_tensor_t *r1[1] = {G.loss};
    const ebb_tensor_t *in_null[2] = {G.x, nullptr};
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, in_null, 2), EBB_EINVAL, "ebb_backward: inputs[1] is NULL");
    const ebb_tensor_t *in_dead[2] = {G.x, dead};
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, in_dead, 2), EBB_EFREED, "inputs[1] (0x", "is a released tensor");
    const ebb_tensor_t *in_const[2] = {G.x, G.c};
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, in_const, 2), EBB_EINVAL,
                  "inputs[1] 'c' (f32[2, 3] on the CPU) does not require a gradient");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: ebb_grad names outputs, grad_outputs and inputs as its header does", "[autograd][messages]") {
  EbbSession session;
  {
    Graph G;
    const ebb_tensor_t *dead = released_tensor();
    ebb_tensor_t *grads[2] = {nullptr, nullptr};
    const ebb_tensor_t *x1[1] = {G.x};
    const ebb_tensor_t *o_null[2] = {G.loss, nullptr};
    EBB_CHECK_MSG(ebb_grad(o_null, nullptr, 2, x1, 1, true, false, grads), EBB_EINVAL, "ebb_grad: outputs[1] is NULL");
    const ebb_tensor_t *o_dead[1] = {dead};
    EBB_CHECK_MSG(ebb_grad(o_dead, nullptr, 1, x1, 1, true, false, grads), EBB_EFREED, "ebb_grad: outputs[0] (0x");
    const ebb_tensor_t *outs[2] = {G.loss, G.y};
    const ebb_tensor_t *go_shape[2] = {nullptr, G.g};
    EBB_CHECK_MSG(ebb_grad(outs, go_shape, 2, x1, 1, true, false, grads), EBB_EINVAL, "grad_outputs[1] 'g' (f32[3, 2] on the CPU)",
                  "outputs[1] 'y' (f32[2, 3] on the CPU)");
    const ebb_tensor_t *go_dead[2] = {nullptr, dead};
    EBB_CHECK_MSG(ebb_grad(outs, go_dead, 2, x1, 1, true, false, grads), EBB_EFREED, "grad_outputs[1] (0x");
    const ebb_tensor_t *o1[1] = {G.loss};
    const ebb_tensor_t *in_null[2] = {G.x, nullptr};
    EBB_CHECK_MSG(ebb_grad(o1, nullptr, 1, in_null, 2, true, false, grads), EBB_EINVAL, "ebb_grad: inputs[1] is NULL");
    const ebb_tensor_t *in_unused[2] = {G.x, G.w};
    EBB_CHECK_MSG(ebb_grad(o1, nullptr, 1, in_unused, 2, true, false, grads), EBB_EINVAL,
                  "inputs[1] (f32[2, 3] on the CPU) was not used to compute the outputs");
    CHECK(grads[0] == nullptr);
    CHECK(grads[1] == nullptr);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: ebb_tensor_set_grad prints both shapes and the tensors' names", "[autograd][messages]") {
  EbbSession session;
  {
    Graph G;
    EBB_CHECK_MSG(ebb_tensor_set_grad(G.x, G.g), EBB_EINVAL, "grad 'g' (f32[3, 2] on the CPU)", "t 'x' (f32[2, 3] on the CPU)");
    Tensor g64 = named(EBB_DEVICE_CPU, EBB_F64, {2, 3}, nullptr);
    EBB_CHECK_MSG(ebb_tensor_set_grad(G.w, g64), EBB_EINVAL, "grad (f64[2, 3] on the CPU)", "t (f32[2, 3] on the CPU)");
    std::vector<int> devs = devices();
    if (devs.size() > 1) {
      Tensor gd = named(devs[1], EBB_F32, {2, 3}, "gd");
      std::string want = "grad 'gd' (f32[2, 3] on device " + std::to_string(devs[1]) + ")";
      EBB_CHECK_MSG(ebb_tensor_set_grad(G.x, gd), EBB_EINVAL, want.c_str(), "t 'x' (f32[2, 3] on the CPU)");
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: the per-tensor autograd calls name the tensor by its name and shape", "[autograd][messages]") {
  EbbSession session;
  {
    Graph G;
    Tensor idx = named(EBB_DEVICE_CPU, EBB_I64, {3}, "idx");
    EBB_CHECK_MSG(ebb_tensor_set_requires_grad(idx, true), EBB_EINVAL, "t 'idx' (i64[3] on the CPU) has dtype i64");
    EBB_CHECK_MSG(ebb_tensor_set_requires_grad(G.y, false), EBB_EINVAL, "t 'y' (f32[2, 3] on the CPU) was produced by");
    ebb_hook_handle h{};
    EBB_CHECK_MSG(ebb_tensor_register_hook(G.c, replace_with_3x2, nullptr, &h), EBB_EINVAL,
                  "t 'c' (f32[2, 3] on the CPU) does not require a gradient");
    EBB_CHECK_MSG(ebb_tensor_register_post_accumulate_hook(G.y, noop_post, nullptr, &h), EBB_EINVAL,
                  "t 'y' (f32[2, 3] on the CPU) was produced by");
    EBB_CHECK_MSG(ebb_tensor_retain_grad(G.c), EBB_EINVAL, "t 'c' (f32[2, 3] on the CPU) does not require a gradient");
    ebb_gradient_edge e{};
    EBB_CHECK_MSG(ebb_tensor_gradient_edge(G.c, &e), EBB_EINVAL, "t 'c' (f32[2, 3] on the CPU) does not require a gradient");
    // An in-place change of a leaf that requires a gradient (ops asks autograd first).
    EBB_CHECK_MSG(ebb_tensor_fill_(G.x, 1.0), EBB_EINVAL, "dst 'x' (f32[2, 3] on the CPU) is a leaf that requires a gradient");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: the array calls name the bad element by its index", "[autograd][messages]") {
  EbbSession session;
  {
    Graph G;
    const ebb_tensor_t *dead = released_tensor();
    ebb_hook_handle h{};
    ebb_tensor_t *t_null[2] = {G.x, nullptr};
    ebb_tensor_t *t_dead[2] = {G.x, const_cast<ebb_tensor_t *>(dead)};
    EBB_CHECK_MSG(ebb_autograd_increment_version(t_null, 2), EBB_EINVAL, "ebb_autograd_increment_version: tensors[1] is NULL");
    EBB_CHECK_MSG(ebb_autograd_increment_version(t_dead, 2), EBB_EFREED, "tensors[1] (0x", "is a released tensor");
    EBB_CHECK_MSG(ebb_register_multi_grad_hook(t_null, 2, noop_multi, nullptr, EBB_MULTI_GRAD_ALL, &h), EBB_EINVAL,
                  "ebb_register_multi_grad_hook: tensors[1] is NULL");
    EBB_CHECK_MSG(ebb_register_multi_grad_hook(t_dead, 2, noop_multi, nullptr, EBB_MULTI_GRAD_ANY, &h), EBB_EFREED,
                  "tensors[1] (0x");
    const ebb_tensor_t *r_null[2] = {G.loss, nullptr};
    const ebb_tensor_t *r_const[2] = {G.loss, G.c};
    EBB_CHECK_MSG(ebb_autograd_register_logging_hooks(r_null, 2, noop_log, nullptr, &h), EBB_EINVAL,
                  "ebb_autograd_register_logging_hooks: roots[1] is NULL");
    EBB_CHECK_MSG(ebb_autograd_register_logging_hooks(r_const, 2, noop_log, nullptr, &h), EBB_EINVAL,
                  "roots[1] 'c' (f32[2, 3] on the CPU) does not require a gradient");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: a hook's replacement of the wrong shape is reported with both shapes and the leaf's name",
          "[autograd][messages]") {
  EbbSession session;
  {
    // A leaf's tensor hook.
    Graph G;
    ebb_hook_handle h{};
    EBB_REQUIRE_OK(ebb_tensor_register_hook(G.x, replace_with_3x2, nullptr, &h));
    const ebb_tensor_t *r1[1] = {G.loss};
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "of the leaf 'x' (f32[2, 3] on the CPU)",
                  "replaced the gradient (f32[2, 3] on the CPU) with the replacement (f32[3, 2] on the CPU)");
    EBB_REQUIRE_OK(ebb_hook_remove(h));
    // A non-leaf's tensor hook.
    EBB_REQUIRE_OK(ebb_tensor_register_hook(G.y, replace_with_3x2, nullptr, &h));
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, nullptr, 0), EBB_EINVAL,
                  "replaced the gradient (f32[2, 3] on the CPU) with the replacement (f32[3, 2] on the CPU)");
    EBB_REQUIRE_OK(ebb_hook_remove(h));
    // A node's pre-hook: the same form.
    const ebb_node_t *gf = nullptr;
    int nr = 0;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(G.y, &gf, &nr));
    EBB_REQUIRE_OK(ebb_node_register_pre_hook(gf, replace_grads_with_3x2, nullptr, &h));
    EBB_CHECK_MSG(ebb_backward(r1, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "gradient[0] (f32[2, 3] on the CPU)",
                  "the replacement (f32[3, 2] on the CPU)");
    EBB_REQUIRE_OK(ebb_hook_remove(h));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
