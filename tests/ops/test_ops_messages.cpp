// Messages of the op calls (ebb/ops.h, ebb/tensor.h) that describe a tensor: each names the
// argument (with its index in an array: ts[1], dims[1]), the tensor's own name when it has one,
// and its dtype, shape and device written f32[2, 3] on the CPU, both tensors where their shapes,
// dtypes or devices disagree.
#include <string>
#include <vector>

#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor named(int dev, ebb_dtype dt, std::vector<int64_t> shape, const char *name) {
  Tensor t = make(dev, dt, shape, values(numel_of(shape), 3, 0.5, 1.5));
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  return t;
}

}  // namespace

TEST_CASE("messages: cat, stack and cat_backward name the bad element of ts by its index", "[ops][messages]") {
  EbbSession session;
  {
    Tensor a = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "a"), b = named(EBB_DEVICE_CPU, EBB_F32, {3, 2}, nullptr);
    Tensor a64 = named(EBB_DEVICE_CPU, EBB_F64, {2, 3}, nullptr), out;
    const ebb_tensor_t *dead = released_tensor();
    const ebb_tensor_t *t_null[2] = {a, nullptr}, *t_dead[2] = {a, dead}, *t_shape[2] = {a, b}, *t_dtype[2] = {a, a64};
    EBB_CHECK_MSG(ebb_op_cat(t_null, 2, 0, out.out()), EBB_EINVAL, "ebb_op_cat: ts[1] is NULL");
    EBB_CHECK_MSG(ebb_op_cat(t_dead, 2, 0, out.out()), EBB_EFREED, "ebb_op_cat: ts[1] (0x", "is a released tensor");
    EBB_CHECK_MSG(ebb_op_cat(t_shape, 2, 0, out.out()), EBB_EINVAL, "ts[1] (f32[3, 2] on the CPU)", "ts[0] 'a' (f32[2, 3] on the CPU)");
    EBB_CHECK_MSG(ebb_op_cat(t_dtype, 2, 0, out.out()), EBB_EINVAL, "ts[1] (f64[2, 3] on the CPU)", "ts[0] 'a' (f32[2, 3] on the CPU)");
    EBB_CHECK_MSG(ebb_op_stack(t_null, 2, 0, out.out()), EBB_EINVAL, "ebb_op_stack: ts[1] is NULL");
    EBB_CHECK_MSG(ebb_op_stack(t_shape, 2, 0, out.out()), EBB_EINVAL, "ts[1] (f32[3, 2] on the CPU)", "ts[0] 'a' (f32[2, 3] on the CPU)");
    Tensor g = named(EBB_DEVICE_CPU, EBB_F32, {4, 3}, nullptr);
    EBB_CHECK_MSG(ebb_op_cat_backward(g, t_null, 2, 0, 1, out.out()), EBB_EINVAL, "ebb_op_cat_backward: ts[1] is NULL");
    // dims arrays
    const int dims[2] = {0, 5};
    EBB_CHECK_MSG(ebb_op_sum(a, dims, 2, false, out.out()), EBB_EINVAL, "dims[1] 5 is out of range");
    EBB_CHECK_MSG(ebb_tensor_permute(a, dims, 2, out.out()), EBB_EINVAL, "dims[1] 5 is out of range");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: shape mismatches of the ops print both tensors with their names", "[ops][messages]") {
  EbbSession session;
  {
    Tensor a = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "pred"), b = named(EBB_DEVICE_CPU, EBB_F32, {3, 2}, "target");
    Tensor g = named(EBB_DEVICE_CPU, EBB_F32, {3, 2}, "g"), x = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, nullptr), out, out2;
    EBB_CHECK_MSG(ebb_op_mse_loss(a, b, out.out()), EBB_EINVAL, "a 'pred' (f32[2, 3] on the CPU)", "b 'target' (f32[3, 2] on the CPU)");
    EBB_CHECK_MSG(ebb_op_matmul(a, x, out.out()), EBB_EINVAL, "a 'pred' (f32[2, 3] on the CPU)", "b (f32[2, 3] on the CPU)",
                  "inner dims 3 and 2 differ");
    EBB_CHECK_MSG(ebb_op_add_backward(g, a, x, out.out(), out2.out()), EBB_EINVAL, "grad 'g' (f32[3, 2] on the CPU)", "[2, 3]");
    Tensor y;
    EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
    EBB_CHECK_MSG(ebb_op_exp_backward(g, x, y, out.out()), EBB_EINVAL, "grad 'g' (f32[3, 2] on the CPU)");
    EBB_CHECK_MSG(ebb_op_softmax_backward(g, y, 1, out.out()), EBB_EINVAL, "grad 'g' (f32[3, 2] on the CPU)", "y (f32[2, 3] on the CPU)");
    Tensor w = named(EBB_DEVICE_CPU, EBB_F32, {2}, "w");
    EBB_CHECK_MSG(ebb_op_layer_norm(x, 1, w, nullptr, 1e-5, out.out()), EBB_EINVAL, "weight 'w' (f32[2] on the CPU)",
                  "x (f32[2, 3] on the CPU)");
    Tensor tgt = named(EBB_DEVICE_CPU, EBB_I64, {3}, "labels");
    EBB_CHECK_MSG(ebb_op_cross_entropy(a, tgt, out.out()), EBB_EINVAL, "logits 'pred' (f32[2, 3] on the CPU)",
                  "target 'labels' (i64[3] on the CPU)");
    Tensor cond = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "mask");
    EBB_CHECK_MSG(ebb_op_where(cond, a, x, out.out()), EBB_EINVAL, "cond 'mask' (f32[2, 3] on the CPU) has dtype f32");
    Tensor v4 = named(EBB_DEVICE_CPU, EBB_F32, {4}, nullptr), bmask;
    EBB_CHECK_MSG(ebb_op_add(a, v4, out.out()), EBB_EINVAL, "a 'pred' (f32[2, 3] on the CPU) and b (f32[4] on the CPU) do not broadcast");
    EBB_REQUIRE_OK(ebb_op_gt(a, a, bmask.out()));
    EBB_CHECK_MSG(ebb_op_where(bmask, a, v4, out.out()), EBB_EINVAL,
                  "cond (bool[2, 3] on the CPU) and b (f32[4] on the CPU) do not broadcast");
    Tensor m1 = named(EBB_DEVICE_CPU, EBB_F32, {2, 2, 3}, "m1"), m2 = named(EBB_DEVICE_CPU, EBB_F32, {3, 3, 2}, nullptr);
    EBB_CHECK_MSG(ebb_op_matmul(m1, m2, out.out()), EBB_EINVAL,
                  "a 'm1' (f32[2, 2, 3] on the CPU) and b (f32[3, 3, 2] on the CPU) do not broadcast in their batch dims");
    const int64_t four = 4;
    EBB_CHECK_MSG(ebb_tensor_view(a, 1, &four, out.out()), EBB_EINVAL, "t 'pred' (f32[2, 3] on the CPU)", "[4]");
    Tensor big = named(EBB_DEVICE_CPU, EBB_F32, {3, 3}, "big");
    EBB_CHECK_MSG(ebb_op_add_(a, big), EBB_EINVAL,
                  "src 'big' (f32[3, 3] on the CPU) does not broadcast to the shape of dst 'pred' (f32[2, 3] on the CPU)");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("messages: device mismatches name both tensors and their devices, where's by its own argument names",
          "[ops][messages]") {
  EbbSession session;
  std::vector<int> devs = devices();
  if (devs.size() < 2) EBB_SKIP("no driver device");
  {
    const int d = devs[1];
    const std::string on_d = "(f32[2, 3] on device " + std::to_string(d) + ")";
    const std::string b_on_d = "b " + on_d, a_on_d = "a " + on_d, src_on_d = "src " + on_d;
    Tensor a = named(EBB_DEVICE_CPU, EBB_F32, {2, 3}, "a"), b = named(d, EBB_F32, {2, 3}, nullptr), out;
    EBB_CHECK_MSG(ebb_op_add(a, b, out.out()), EBB_EDEVICE, b_on_d.c_str(), "a 'a' (f32[2, 3] on the CPU)");
    EBB_CHECK_MSG(ebb_op_matmul(a, b, out.out()), EBB_EDEVICE, b_on_d.c_str(), "a 'a' (f32[2, 3] on the CPU)");
    Tensor cond;
    EBB_REQUIRE_OK(ebb_op_gt(a, a, cond.out()));
    EBB_CHECK_MSG(ebb_op_where(cond, b, a, out.out()), EBB_EDEVICE, a_on_d.c_str(), "cond (bool[2, 3] on the CPU)");
    EBB_CHECK_MSG(ebb_op_add_(a, b), EBB_EDEVICE, src_on_d.c_str(), "dst 'a' (f32[2, 3] on the CPU)");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
