// ebb_backward_one: a backward from one scalar loss gives every leaf the .grad ebb_backward gives,
// and names the loss in its refusals.
#include <vector>

#include "autograd_test_util.hpp"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// l = sum(tanh(x * w)), on `dev`.
Tensor loss_of(const ebb_tensor_t *x, const ebb_tensor_t *w) {
  Tensor p, t;
  EBB_REQUIRE_OK(ebb_op_mul(x, w, p.out()));
  EBB_REQUIRE_OK(ebb_op_tanh(p, t.out()));
  return sum_of(t);
}

}  // namespace

TEST_CASE("backward_one: the .grad of every leaf is ebb_backward's, on the CPU and on a device", "[autograd][backward-one]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO(dev_name(dev));
    Tensor x = leaf_on(dev, {0.5, -1.0, 2.0}), w = leaf_on(dev, {1.5, 0.25, -0.75});
    {
      Tensor l = loss_of(x, w);
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    }
    auto gx = grad_of(x), gw = grad_of(w);
    EBB_REQUIRE_OK(ebb_tensor_set_grad(x, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
    Tensor l = loss_of(x, w);
    EBB_REQUIRE_OK(ebb_backward_one(l));
    CHECK(grad_of(x) == gx);
    CHECK(grad_of(w) == gw);
    // Without retain_graph: the graph's saved tensors are gone.
    EBB_CHECK_MSG(ebb_backward_one(l), EBB_ESTATE, "ebb_backward_one", "retain_graph");
  }
  live.check();
}

TEST_CASE("backward_one: a NULL, released, gradient-less or non-scalar loss is refused, naming it", "[autograd][backward-one][errors]") {
  EbbSession session;
  Live live;
  EBB_CHECK_MSG(ebb_backward_one(nullptr), EBB_EINVAL, "ebb_backward_one", "loss");
  {
    Tensor c = make(EBB_DEVICE_CPU, EBB_F64, {1}, {3.0});
    EBB_CHECK_MSG(ebb_backward_one(c), EBB_EINVAL, "ebb_backward_one: loss", "does not require a gradient");
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2}, "x"), y;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
    EBB_CHECK_MSG(ebb_backward_one(y), EBB_EINVAL, "ebb_backward_one: loss", "has 2 elements; expected one");
    EBB_CHECK_MSG(ebb_backward_one(released_tensor()), EBB_EFREED, "ebb_backward_one", "loss");
  }
  live.check();
}
