// A released tensor passed to any op of ops.h is EBB_EFREED (tensor.h's rule), in every tensor
// argument and at every position of a tensor array, with a message naming the call; nothing is
// returned. Each case is a call that succeeds with the live tensors it is given; the test then
// puts a released tensor in each tensor position in turn.
#include <functional>
#include <string>
#include <vector>

#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// Releases the outputs a call gave, so a case can run many times.
struct Outs {
  ebb_tensor_t *o[3] = {nullptr, nullptr, nullptr};
  ~Outs() {
    for (auto *t : o)
      if (t) ebb_tensor_release(t);
  }
  bool none() const { return !o[0] && !o[1] && !o[2]; }
};

// On failure nothing was returned.
#define OUTS_CHECK(o)          \
  do {                         \
    if (st) CHECK((o).none()); \
  } while (0)

}  // namespace

TEST_CASE("released tensors: every op refuses one in any tensor argument or array slot with EBB_EFREED", "[ops][errors][released]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, values(6, 2, 0.5, 2.0));
  Tensor y = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, values(6, 3, 0.5, 2.0));
  Tensor xt = make(EBB_DEVICE_CPU, EBB_F64, {3, 2}, values(6, 4));
  Tensor g22 = make(EBB_DEVICE_CPU, EBB_F64, {2, 2}, values(4, 5));
  Tensor cond = make(EBB_DEVICE_CPU, EBB_BOOL, {2, 3}, {1, 0, 1, 0, 1, 0});
  Tensor scalar = make(EBB_DEVICE_CPU, EBB_F64, {}, {1.5});
  Tensor row = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 2});
  Tensor idx = make(EBB_DEVICE_CPU, EBB_I64, {2}, {0, 2});
  Tensor w = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3});
  Tensor b = make(EBB_DEVICE_CPU, EBB_F64, {3}, {0, 1, 0});
  Tensor g43 = make(EBB_DEVICE_CPU, EBB_F64, {4, 3}, values(12, 6));
  Tensor g223 = make(EBB_DEVICE_CPU, EBB_F64, {2, 2, 3}, values(12, 7));
  Tensor dst = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, values(6, 8));
  int64_t shape23[2] = {2, 3};

  using T = const ebb_tensor_t *;
  auto binary = [&](const char *fn, ebb_status (*f)(T, T, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x, y}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto binary_bw = [&](const char *fn, ebb_status (*f)(T, T, T, ebb_tensor_t **, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x, x, y}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], a[2], &o.o[0], &o.o[1]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto with_scalar = [&](const char *fn, ebb_status (*f)(T, double, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], 2.0, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto scalar_bw = [&](const char *fn, ebb_status (*f)(T, T, double, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x, y}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], 2.0, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto unary = [&](const char *fn, ebb_status (*f)(T, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  // Unary backward functions get all three of grad, x and y: a released one is refused even
  // where the formula does not read it.
  auto unary_bw = [&](const char *fn, ebb_status (*f)(T, T, T, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x, y, x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], a[2], &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto inplace = [&](const char *fn, ebb_status (*f)(ebb_tensor_t *, T)) {
    return ReleasedCase{fn, {dst, x}, [f](const TensorArgs &a) { return f(const_cast<ebb_tensor_t *>(a[0]), a[1]); }};
  };
  auto reduction = [&](const char *fn, ebb_status (*f)(T, const int *, int, bool, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], nullptr, 0, false, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto reduction_bw = [&](const char *fn, ebb_status (*f)(T, T, const int *, int, bool, ebb_tensor_t **)) {
    return ReleasedCase{fn, {scalar, x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], nullptr, 0, false, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto softmax = [&](const char *fn, ebb_status (*f)(T, int, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], 1, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };
  auto softmax_bw = [&](const char *fn, ebb_status (*f)(T, T, int, ebb_tensor_t **)) {
    return ReleasedCase{fn, {x, y}, [f](const TensorArgs &a) {
                    Outs o;
                    ebb_status st = f(a[0], a[1], 1, &o.o[0]);
                    OUTS_CHECK(o);
                    return st;
                  }};
  };

  std::vector<ReleasedCase> cases = {
      binary("ebb_op_add", ebb_op_add),
      binary("ebb_op_sub", ebb_op_sub),
      binary("ebb_op_mul", ebb_op_mul),
      binary("ebb_op_div", ebb_op_div),
      binary_bw("ebb_op_add_backward", ebb_op_add_backward),
      binary_bw("ebb_op_sub_backward", ebb_op_sub_backward),
      binary_bw("ebb_op_mul_backward", ebb_op_mul_backward),
      binary_bw("ebb_op_div_backward", ebb_op_div_backward),
      with_scalar("ebb_op_add_scalar", ebb_op_add_scalar),
      with_scalar("ebb_op_sub_scalar", ebb_op_sub_scalar),
      with_scalar("ebb_op_mul_scalar", ebb_op_mul_scalar),
      with_scalar("ebb_op_div_scalar", ebb_op_div_scalar),
      with_scalar("ebb_op_pow_scalar", ebb_op_pow_scalar),
      {"ebb_op_clamp", {x}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_clamp(a[0], 0.0, 1.0, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      scalar_bw("ebb_op_add_scalar_backward", ebb_op_add_scalar_backward),
      scalar_bw("ebb_op_mul_scalar_backward", ebb_op_mul_scalar_backward),
      scalar_bw("ebb_op_div_scalar_backward", ebb_op_div_scalar_backward),
      scalar_bw("ebb_op_pow_scalar_backward", ebb_op_pow_scalar_backward),
      {"ebb_op_clamp_backward", {x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_clamp_backward(a[0], a[1], 0.0, 1.0, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      unary("ebb_op_neg", ebb_op_neg),
      unary("ebb_op_abs", ebb_op_abs),
      unary("ebb_op_exp", ebb_op_exp),
      unary("ebb_op_log", ebb_op_log),
      unary("ebb_op_sqrt", ebb_op_sqrt),
      unary("ebb_op_sin", ebb_op_sin),
      unary("ebb_op_cos", ebb_op_cos),
      unary("ebb_op_tanh", ebb_op_tanh),
      unary("ebb_op_sigmoid", ebb_op_sigmoid),
      unary("ebb_op_relu", ebb_op_relu),
      unary("ebb_op_gelu", ebb_op_gelu),
      unary_bw("ebb_op_neg_backward", ebb_op_neg_backward),
      unary_bw("ebb_op_abs_backward", ebb_op_abs_backward),
      unary_bw("ebb_op_exp_backward", ebb_op_exp_backward),
      unary_bw("ebb_op_log_backward", ebb_op_log_backward),
      unary_bw("ebb_op_sqrt_backward", ebb_op_sqrt_backward),
      unary_bw("ebb_op_sin_backward", ebb_op_sin_backward),
      unary_bw("ebb_op_cos_backward", ebb_op_cos_backward),
      unary_bw("ebb_op_tanh_backward", ebb_op_tanh_backward),
      unary_bw("ebb_op_sigmoid_backward", ebb_op_sigmoid_backward),
      unary_bw("ebb_op_relu_backward", ebb_op_relu_backward),
      unary_bw("ebb_op_gelu_backward", ebb_op_gelu_backward),
      binary("ebb_op_eq", ebb_op_eq),
      binary("ebb_op_ne", ebb_op_ne),
      binary("ebb_op_lt", ebb_op_lt),
      binary("ebb_op_le", ebb_op_le),
      binary("ebb_op_gt", ebb_op_gt),
      binary("ebb_op_ge", ebb_op_ge),
      {"ebb_op_where", {cond, x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_where(a[0], a[1], a[2], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_where_backward", {x, cond, x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_where_backward(a[0], a[1], a[2], a[3], &o.o[0], &o.o[1]);
         OUTS_CHECK(o);
         return st;
       }},
      inplace("ebb_op_add_", ebb_op_add_),
      inplace("ebb_op_mul_", ebb_op_mul_),
      {"ebb_op_add_scaled_", {dst, x}, [](const TensorArgs &a) { return ebb_op_add_scaled_(const_cast<ebb_tensor_t *>(a[0]), a[1], 0.5); }},
      {"ebb_op_add_scalar_", {dst}, [](const TensorArgs &a) { return ebb_op_add_scalar_(const_cast<ebb_tensor_t *>(a[0]), 0.5); }},
      {"ebb_op_mul_scalar_", {dst}, [](const TensorArgs &a) { return ebb_op_mul_scalar_(const_cast<ebb_tensor_t *>(a[0]), 0.5); }},
      {"ebb_op_lerp_", {dst, x}, [](const TensorArgs &a) { return ebb_op_lerp_(const_cast<ebb_tensor_t *>(a[0]), a[1], 0.5); }},
      {"ebb_op_addcmul_", {dst, x, y}, [](const TensorArgs &a) { return ebb_op_addcmul_(const_cast<ebb_tensor_t *>(a[0]), a[1], a[2], 0.5); }},
      {"ebb_op_addcdiv_", {dst, x, y}, [](const TensorArgs &a) { return ebb_op_addcdiv_(const_cast<ebb_tensor_t *>(a[0]), a[1], a[2], 0.5); }},
      {"ebb_op_sqrt_", {dst}, [](const TensorArgs &a) { return ebb_op_sqrt_(const_cast<ebb_tensor_t *>(a[0])); }},
      {"ebb_op_zero_", {dst}, [](const TensorArgs &a) { return ebb_op_zero_(const_cast<ebb_tensor_t *>(a[0])); }},
      {"ebb_op_sum_to_shape", {x}, [&](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_sum_to_shape(a[0], 2, shape23, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      reduction("ebb_op_sum", ebb_op_sum),
      reduction("ebb_op_mean", ebb_op_mean),
      reduction("ebb_op_amax", ebb_op_amax),
      {"ebb_op_max_dim", {x}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_max_dim(a[0], 1, false, &o.o[0], &o.o[1]);
         OUTS_CHECK(o);
         return st;
       }},
      reduction_bw("ebb_op_sum_backward", ebb_op_sum_backward),
      reduction_bw("ebb_op_mean_backward", ebb_op_mean_backward),
      {"ebb_op_amax_backward", {scalar, x, scalar}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_amax_backward(a[0], a[1], a[2], nullptr, 0, false, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_max_dim_backward", {row, x, idx}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_max_dim_backward(a[0], a[1], a[2], 1, false, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_matmul", {x, xt}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_matmul(a[0], a[1], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_matmul_backward", {g22, x, xt}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_matmul_backward(a[0], a[1], a[2], &o.o[0], &o.o[1]);
         OUTS_CHECK(o);
         return st;
       }},
      // linear: x [2, 3], w [2, 3] (y), b [2] (row); its backward from a [2, 2] grad.
      {"ebb_op_linear", {x, y, row}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_linear(a[0], a[1], a[2], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_linear_backward", {g22, x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_linear_backward(a[0], a[1], a[2], &o.o[0], &o.o[1], &o.o[2]);
         OUTS_CHECK(o);
         return st;
       }},
      softmax("ebb_op_softmax", ebb_op_softmax),
      softmax("ebb_op_log_softmax", ebb_op_log_softmax),
      softmax_bw("ebb_op_softmax_backward", ebb_op_softmax_backward),
      softmax_bw("ebb_op_log_softmax_backward", ebb_op_log_softmax_backward),
      {"ebb_op_cross_entropy", {x, idx}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_cross_entropy(a[0], a[1], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_cross_entropy_backward", {scalar, x, idx}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_cross_entropy_backward(a[0], a[1], a[2], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_mse_loss", {x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_mse_loss(a[0], a[1], &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_mse_loss_backward", {scalar, x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_mse_loss_backward(a[0], a[1], a[2], &o.o[0], &o.o[1]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_layer_norm", {x, w, b}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_layer_norm(a[0], 1, a[1], a[2], 1e-5, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_layer_norm_backward", {y, x, w, b}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_layer_norm_backward(a[0], a[1], 1, a[2], a[3], 1e-5, &o.o[0], &o.o[1], &o.o[2]);
         OUTS_CHECK(o);
         return st;
       }},
      // Arrays: the released tensor at each slot.
      {"ebb_op_cat", {x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_cat(a.data(), 2, 0, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_stack", {x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_stack(a.data(), 2, 0, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_cat_backward", {g43, x, y}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_cat_backward(a[0], a.data() + 1, 2, 0, 1, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
      {"ebb_op_stack_backward", {g223}, [](const TensorArgs &a) {
         Outs o;
         ebb_status st = ebb_op_stack_backward(a[0], 2, 0, 1, &o.o[0]);
         OUTS_CHECK(o);
         return st;
       }},
  };
  for (const auto &c : cases) check_released_case(c);
  // layer_norm without its optional weight and bias still refuses a released x.
  {
    Outs o;
    EBB_CHECK_FAILS(ebb_op_layer_norm(released_tensor(), 1, nullptr, nullptr, 1e-5, &o.o[0]), EBB_EFREED, "ebb_op_layer_norm: ");
    CHECK(o.none());
  }
}
