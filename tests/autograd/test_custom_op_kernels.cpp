// A custom op's own kernels (ebb/custom_op.h, through the test library customop_lib/): its CPU
// function on CPU tensors and on the emulated driver's devices against a reference computed here,
// its gradients against finite differences in f64, gradients only for the inputs that need one,
// and no ctx, node or tensor left alive after many steps.
#include <cmath>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/custom_op.h"
#include "ebb/function.h"
#include "gradcheck.hpp"
#include "scaled_mul.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

ebb_custom_op_t *register_smul() {
  ebb_custom_op_def def;
  ebbtest_scaled_mul_def(&def);
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  return op;
}

// (y, mask) = op(x, w) with alpha.
void call(const ebb_custom_op_t *op, const ebb_tensor_t *x, const ebb_tensor_t *w, double alpha, Tensor &y, Tensor &mask) {
  const ebb_tensor_t *in[2] = {x, w};
  ebbtest_smul_params p = {alpha};
  ebb_tensor_t *out[2] = {nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_custom_op_call(op, in, &p, out));
  y = Tensor(out[0]);
  mask = Tensor(out[1]);
}

}  // namespace

TEST_CASE("custom op: its CPU and emulated-device kernels match a reference in f32 and f64", "[custom_op][kernels]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    for (ebb_dtype dt : {EBB_F32, EBB_F64}) {
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt));
      // 70000 elements: more than one block of 256 on a device, a grid of many blocks
      const std::vector<int64_t> shape{70, 1000};
      auto xv = values(70000, 11), wv = values(70000, 12);
      Tensor x = make(dev, dt, shape, xv), w = make(dev, dt, shape, wv), y, mask;
      call(op, x, w, -1.5, y, mask);
      CHECK(shape_of(y) == shape);
      CHECK(dtype_of(y) == dt);
      CHECK(shape_of(mask) == shape);
      std::vector<double> want(xv.size()), want_mask(xv.size());
      for (size_t i = 0; i < xv.size(); i++) {
        if (dt == EBB_F32) {
          float p = (float)xv[i] * (float)wv[i];
          want[i] = (float)-1.5 * p;
          want_mask[i] = p > 0;
        } else {
          double p = xv[i] * wv[i];
          want[i] = -1.5 * p;
          want_mask[i] = p > 0;
        }
      }
      EBB_CHECK_CLOSE(read(y), want, 0, 0);  // the same arithmetic: exact
      EBB_CHECK_CLOSE(read(mask), want_mask, 0, 0);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("custom op: a non-contiguous input is made contiguous by its forward and the result is the same", "[custom_op][kernels]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto xv = values(12, 3), wv = values(12, 4);
    Tensor x = make(dev, EBB_F64, {3, 4}, xv), w = make(dev, EBB_F64, {4, 3}, wv), wt, y, mask;
    EBB_REQUIRE_OK(ebb_tensor_transpose(w, 0, 1, wt.out()));
    call(op, x, wt, 2.0, y, mask);
    std::vector<double> want(12);
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 4; j++) want[i * 4 + j] = 2.0 * (xv[i * 4 + j] * wv[j * 3 + i]);
    EBB_CHECK_CLOSE(read(y), want, 0, 0);
  }
}

TEST_CASE("custom op: gradients match finite differences in f64 on the CPU and the emulated devices", "[custom_op][gradcheck]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    const double alpha = 0.7;
    GcForward fwd = [&](const GcInputs &in, ebb_tensor_t **out) {
      const ebb_tensor_t *args[2] = {in[0], in[1]};
      ebbtest_smul_params p = {alpha};
      ebb_tensor_t *outs[2] = {nullptr, nullptr};
      ebb_status st = ebb_custom_op_call(op, args, &p, outs);
      if (st) return st;
      ebb_tensor_release(outs[1]);
      *out = outs[0];
      return EBB_OK;
    };
    // The analytic gradient through autograd: leaves that require one, the op recorded, ebb_grad.
    GcBackward bwd = [&](const ebb_tensor_t *g, const GcInputs &in, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &grads) {
      Tensor x, w, y, mask;
      ebb_status st = ebb_tensor_detach(in[0], x.out());
      if (!st) st = ebb_tensor_detach(in[1], w.out());
      if (!st) st = ebb_tensor_set_requires_grad(x, true);
      if (!st) st = ebb_tensor_set_requires_grad(w, true);
      if (st) return st;
      const ebb_tensor_t *args[2] = {x.get(), w.get()};
      ebbtest_smul_params p = {alpha};
      ebb_tensor_t *outs[2] = {nullptr, nullptr};
      st = ebb_custom_op_call(op, args, &p, outs);
      if (st) return st;
      y = Tensor(outs[0]);
      mask = Tensor(outs[1]);
      const ebb_tensor_t *roots[1] = {y.get()}, *groots[1] = {g};
      return ebb_grad(roots, groots, 1, args, 2, false, false, grads.data());
    };
    std::vector<GcInput> in{{{2, 3}, values(6, 21)}, {{2, 3}, values(6, 22)}};
    EBB_CHECK_GRADCHECK(dev, in, fwd, bwd);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_function_live_ctx() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("custom op: the mask output is non-differentiable and only the inputs that need a gradient get one",
          "[custom_op][autograd]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(dev, EBB_F64, {4}, {1, -2, 3, -4}), w = make(dev, EBB_F64, {4}, {0.5, 0.5, -1, 2}), y, mask;
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    call(op, x, w, 3.0, y, mask);
    bool rg = false;
    EBB_REQUIRE_OK(ebb_tensor_requires_grad(y, &rg));
    CHECK(rg);
    EBB_REQUIRE_OK(ebb_tensor_requires_grad(mask, &rg));
    CHECK_FALSE(rg);
    CHECK(read(mask) == std::vector<double>{1, 0, 0, 0});
    long before = ebbtest_backward_calls;
    Tensor s;
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, s.out()));
    EBB_REQUIRE_OK(ebb_backward_one(s));
    CHECK(ebbtest_backward_calls == before + 1);
    Tensor gx, gw;
    EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
    EBB_REQUIRE_OK(ebb_tensor_grad(w, gw.out()));
    REQUIRE(gx.get() != nullptr);
    CHECK(read(gx) == std::vector<double>{1.5, 1.5, -3, 6});
    CHECK(gw.get() == nullptr);  // w requires none: none computed, none kept
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("custom op: many forward and backward steps leave no ctx, node or tensor alive", "[custom_op][autograd][lifetime]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  long ctx0 = ebb_function_live_ctx();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor w = make(dev, EBB_F32, {64}, values(64, 5));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    for (int step = 0; step < 200; step++) {
      Tensor x = make(dev, EBB_F32, {64}, values(64, 100 + step)), y, mask, s;
      call(op, x, w, 0.5, y, mask);
      EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, s.out()));
      if (step % 2 == 0) EBB_REQUIRE_OK(ebb_backward_one(s));  // odd steps: the graph is dropped unused
    }
    if (dev != EBB_DEVICE_CPU) EBB_REQUIRE_OK(ebb_dev_synchronize(dev));
  }
  CHECK(ebb_function_live_ctx() == ctx0);
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
