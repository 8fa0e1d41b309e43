// ebb_op_linear, y = x @ w^T + b, and ebb_op_linear_backward: values against matmul of the
// transposed w plus the bias (existing ops, in f64) on the CPU and every emulated device, in f32,
// f64, bf16 and f16; x with several, one or no leading dims, w and x read in place or through a
// copy (transposed, padded and permuted layouts), empty dims; the backward against its matmul
// formulas; bad input with messages naming the tensors and the expected shape.
#include <cmath>
#include <string>
#include <vector>

#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

const ebb_dtype kFloats[] = {EBB_F32, EBB_F64, EBB_BF16, EBB_F16};

// Relative room for dt: bf16 and f16 outputs are one rounding of an f32 GEMM.
double tol_of(ebb_dtype dt) {
  switch (dt) {
  case EBB_BF16: return 1.0 / 64;
  case EBB_F16: return 1.0 / 256;
  case EBB_F32: return 1e-5;
  default: return 1e-12;
  }
}

Tensor as_f64(const ebb_tensor_t *t) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_to_dtype(t, EBB_F64, r.out()));
  return r;
}

// x @ w^T (+ b) from matmul in f64; x of any rank >= 1.
Tensor reference(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b) {
  Tensor x64 = as_f64(x), w64 = as_f64(w), wt, y, x2;
  auto xs = shape_of(x);
  const int64_t k = xs.back();
  int64_t m = 1;
  for (size_t d = 0; d + 1 < xs.size(); d++) m *= xs[d];
  const int64_t s2[2] = {m, k};
  EBB_REQUIRE_OK(ebb_tensor_reshape(x64, 2, s2, x2.out()));
  EBB_REQUIRE_OK(ebb_tensor_transpose(w64, 0, 1, wt.out()));
  EBB_REQUIRE_OK(ebb_op_matmul(x2, wt, y.out()));
  if (b) {
    Tensor b64 = as_f64(b), yb;
    EBB_REQUIRE_OK(ebb_op_add(y, b64, yb.out()));
    y = std::move(yb);
  }
  xs.back() = shape_of(w)[0];
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_reshape(y, static_cast<int>(xs.size()), xs.data(), r.out()));
  return r;
}

void check_linear(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, ebb_dtype dt) {
  Tensor y, want = reference(x, w, b);
  EBB_REQUIRE_OK(ebb_op_linear(x, w, b, y.out()));
  CHECK(dtype_of(y) == dt);
  CHECK(shape_of(y) == shape_of(want));
  EBB_CHECK_CLOSE(read(y), read(want), tol_of(dt), tol_of(dt));
}

}  // namespace

TEST_CASE("linear: x @ w^T + b against matmul, on every device and floating dtype, with and without a bias",
          "[ops][linear][values]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : kFloats) {
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt));
      Tensor w = make(dev, dt, {5, 3}, values(15, 1)), b = make(dev, dt, {5}, values(5, 2));
      for (std::vector<int64_t> xs : {std::vector<int64_t>{4, 3}, {2, 3, 3}, {3}}) {
        INFO("x of rank " << xs.size());
        Tensor x = make(dev, dt, xs, values(numel_of(xs), 3));
        check_linear(x, w, b, dt);
        check_linear(x, w, nullptr, dt);
      }
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("linear: w and x in other layouts (transposed, padded rows, permuted) give the same values", "[ops][linear][values]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor b = make(dev, EBB_F32, {4}, values(4, 4));
    // w as the transpose of a [3, 4] matrix (read in place, not transposed by the GEMM)
    Tensor wsrc = make(dev, EBB_F32, {3, 4}, values(12, 5)), wt;
    EBB_REQUIRE_OK(ebb_tensor_transpose(wsrc, 0, 1, wt.out()));
    // w with padded rows: the first 3 columns of a [4, 5] matrix
    Tensor wide = make(dev, EBB_F32, {4, 5}, values(20, 6)), wpad;
    EBB_REQUIRE_OK(ebb_tensor_narrow(wide, 1, 0, 3, wpad.out()));
    // x transposed (2-D), padded (2-D) and permuted (3-D, copied)
    Tensor xsrc = make(dev, EBB_F32, {3, 6}, values(18, 7)), xt, xwide = make(dev, EBB_F32, {6, 7}, values(42, 8)), xpad;
    EBB_REQUIRE_OK(ebb_tensor_transpose(xsrc, 0, 1, xt.out()));
    EBB_REQUIRE_OK(ebb_tensor_narrow(xwide, 1, 2, 3, xpad.out()));
    Tensor x3 = make(dev, EBB_F32, {3, 2, 4}, values(24, 9)), xperm;
    const int perm[3] = {1, 2, 0};
    EBB_REQUIRE_OK(ebb_tensor_permute(x3, perm, 3, xperm.out()));  // [2, 4, 3]
    for (const ebb_tensor_t *w : {wt.get(), wpad.get()})
      for (const ebb_tensor_t *x : {xt.get(), xpad.get(), xperm.get()}) check_linear(x, w, b, EBB_F32);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("linear: empty dims: no rows, no outputs, and no inputs (the bias alone)", "[ops][linear][values]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor w = make(dev, EBB_F64, {2, 3}, values(6, 10)), b = make(dev, EBB_F64, {2}, {0.5, -1});
    Tensor x0 = make(dev, EBB_F64, {0, 3}, {}), y;
    EBB_REQUIRE_OK(ebb_op_linear(x0, w, b, y.out()));
    CHECK(shape_of(y) == std::vector<int64_t>{0, 2});
    Tensor w0 = make(dev, EBB_F64, {0, 3}, {}), b0 = make(dev, EBB_F64, {0}, {}), x = make(dev, EBB_F64, {4, 3}, values(12, 11));
    EBB_REQUIRE_OK(ebb_op_linear(x, w0, b0, y.out()));
    CHECK(shape_of(y) == std::vector<int64_t>{4, 0});
    // K = 0: x @ w^T is all zeros, so y is the bias broadcast (or zeros without one)
    Tensor xk = make(dev, EBB_F64, {3, 0}, {}), wk = make(dev, EBB_F64, {2, 0}, {});
    EBB_REQUIRE_OK(ebb_op_linear(xk, wk, b, y.out()));
    CHECK(read(y) == std::vector<double>{0.5, -1, 0.5, -1, 0.5, -1});
    EBB_REQUIRE_OK(ebb_op_linear(xk, wk, nullptr, y.out()));
    CHECK(read(y) == std::vector<double>(6, 0.0));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("linear backward: grad_x = g w, grad_w = g^T x, grad_b = sum of g, over flattened leading dims",
          "[ops][linear][backward]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : kFloats) {
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt));
      Tensor x = make(dev, dt, {2, 3, 4}, values(24, 12)), w = make(dev, dt, {5, 4}, values(20, 13));
      Tensor g = make(dev, dt, {2, 3, 5}, values(30, 14));
      Tensor gx, gw, gb;
      EBB_REQUIRE_OK(ebb_op_linear_backward(g, x, w, gx.out(), gw.out(), gb.out()));
      // references in f64: g2 [6, 5], x2 [6, 4]
      Tensor g64 = as_f64(g), x64 = as_f64(x), w64 = as_f64(w), g2, x2, g2t, rx, rw, rb;
      const int64_t sg[2] = {6, 5}, sx[2] = {6, 4};
      EBB_REQUIRE_OK(ebb_tensor_reshape(g64, 2, sg, g2.out()));
      EBB_REQUIRE_OK(ebb_tensor_reshape(x64, 2, sx, x2.out()));
      EBB_REQUIRE_OK(ebb_op_matmul(g2, w64, rx.out()));
      EBB_REQUIRE_OK(ebb_tensor_transpose(g2, 0, 1, g2t.out()));
      EBB_REQUIRE_OK(ebb_op_matmul(g2t, x2, rw.out()));
      const int d0[1] = {0};
      EBB_REQUIRE_OK(ebb_op_sum(g2, d0, 1, false, rb.out()));
      CHECK(shape_of(gx) == std::vector<int64_t>{2, 3, 4});
      CHECK(shape_of(gw) == std::vector<int64_t>{5, 4});
      CHECK(shape_of(gb) == std::vector<int64_t>{5});
      CHECK(dtype_of(gx) == dt);
      CHECK(dtype_of(gw) == dt);
      CHECK(dtype_of(gb) == dt);
      const double t = 2 * tol_of(dt);
      EBB_CHECK_CLOSE(read(gx), read(rx), t, t);
      EBB_CHECK_CLOSE(read(gw), read(rw), t, t);
      EBB_CHECK_CLOSE(read(gb), read(rb), t, t);
      // Any one of them alone.
      Tensor only;
      EBB_REQUIRE_OK(ebb_op_linear_backward(g, x, w, nullptr, nullptr, only.out()));
      CHECK(read(only) == read(gb));
      EBB_REQUIRE_OK(ebb_op_linear_backward(g, x, w, nullptr, only.out(), nullptr));
      CHECK(read(only) == read(gw));
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("linear: bad input names the call, the tensors and the expected shape", "[ops][linear][errors]") {
  EbbSession session;
  {  // (the tensors go before the liveness check)
    Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {4, 3}, values(12, 20)), w = make(EBB_DEVICE_CPU, EBB_F32, {5, 3}, values(15, 21));
    Tensor b = make(EBB_DEVICE_CPU, EBB_F32, {5}, values(5, 22)), y;
    EBB_CHECK_FAILS(ebb_op_linear(nullptr, w, b, y.out()), EBB_EINVAL, "ebb_op_linear: x is NULL");
    EBB_CHECK_FAILS(ebb_op_linear(x, nullptr, b, y.out()), EBB_EINVAL, "ebb_op_linear: w is NULL");
    EBB_CHECK_FAILS(ebb_op_linear(x, w, b, nullptr), EBB_EINVAL, "ebb_op_linear: out is NULL");
    // shapes
    Tensor w4 = make(EBB_DEVICE_CPU, EBB_F32, {5, 4}, values(20, 23));
    EBB_CHECK_FAILS(ebb_op_linear(x, w4, b, y.out()), EBB_EINVAL,
                    "ebb_op_linear: x (f32[4, 3] on the CPU) and w (f32[5, 4] on the CPU) do not fit: x's last dim is not w's "
                    "in_features; expected x of shape [..., 4]");
    Tensor b3 = make(EBB_DEVICE_CPU, EBB_F32, {3}, values(3, 24));
    EBB_CHECK_FAILS(ebb_op_linear(x, w, b3, y.out()), EBB_EINVAL,
                    "ebb_op_linear: b (f32[3] on the CPU) does not fit w (f32[5, 3] on the CPU); expected b of shape [5]");
    Tensor w1 = make(EBB_DEVICE_CPU, EBB_F32, {3}, values(3, 25)), x0 = make(EBB_DEVICE_CPU, EBB_F32, {}, {1});
    EBB_CHECK_FAILS(ebb_op_linear(x, w1, nullptr, y.out()), EBB_EINVAL,
                    "ebb_op_linear: w (f32[3] on the CPU) has 1 dims; expected a matrix [out_features, in_features]");
    EBB_CHECK_FAILS(ebb_op_linear(x0, w, nullptr, y.out()), EBB_EINVAL, "expected x of shape [..., 3]");
    // dtypes
    Tensor w64 = make(EBB_DEVICE_CPU, EBB_F64, {5, 3}, values(15, 26)), b64 = make(EBB_DEVICE_CPU, EBB_F64, {5}, values(5, 27));
    EBB_CHECK_FAILS(ebb_op_linear(x, w64, nullptr, y.out()), EBB_EINVAL,
                    "ebb_op_linear: x (f32[4, 3] on the CPU) and w (f64[5, 3] on the CPU) have different dtypes");
    EBB_CHECK_FAILS(ebb_op_linear(x, w, b64, y.out()), EBB_EINVAL, "ebb_op_linear: x (f32[4, 3] on the CPU) and b (f64[5] on the CPU)");
    Tensor xi = make(EBB_DEVICE_CPU, EBB_I64, {4, 3}, values(12, 28)), wi = make(EBB_DEVICE_CPU, EBB_I64, {5, 3}, values(15, 29));
    EBB_CHECK_FAILS(ebb_op_linear(xi, wi, nullptr, y.out()), EBB_EINVAL, "ebb_op_linear: x (i64[4, 3] on the CPU) has dtype i64");
    // devices
    int n = 0;
    EBB_REQUIRE_OK(ebb_dev_count(&n));
    if (n > 0) {
      Tensor wd = make(0, EBB_F32, {5, 3}, values(15, 30)), bd = make(0, EBB_F32, {5}, values(5, 31));
      EBB_CHECK_FAILS(ebb_op_linear(x, wd, nullptr, y.out()), EBB_EDEVICE,
                      "ebb_op_linear: w (f32[5, 3] on device 0) and x (f32[4, 3] on the CPU) are on different devices");
      EBB_CHECK_FAILS(ebb_op_linear(x, w, bd, y.out()), EBB_EDEVICE, "ebb_op_linear: b (f32[5] on device 0) and x");
    }
    // a released handle
    ebb_tensor_t *gone = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_clone(b, &gone));
    EBB_REQUIRE_OK(ebb_tensor_release(gone));
    EBB_CHECK_FAILS(ebb_op_linear(x, w, gone, y.out()), EBB_EFREED, "ebb_op_linear: b");
    CHECK(y.get() == nullptr);
    // backward
    Tensor g = make(EBB_DEVICE_CPU, EBB_F32, {4, 5}, values(20, 32)), gx;
    EBB_CHECK_FAILS(ebb_op_linear_backward(g, x, w, nullptr, nullptr, nullptr), EBB_EINVAL,
                    "ebb_op_linear_backward: grad_x, grad_w and grad_b are all NULL");
    Tensor g45 = make(EBB_DEVICE_CPU, EBB_F32, {4, 4}, values(16, 33));
    EBB_CHECK_FAILS(ebb_op_linear_backward(g45, x, w, gx.out(), nullptr, nullptr), EBB_EINVAL,
                    "ebb_op_linear_backward: grad (f32[4, 4] on the CPU) does not have the forward output's shape; expected [4, 5]");
    EBB_CHECK_FAILS(ebb_op_linear_backward(nullptr, x, w, gx.out(), nullptr, nullptr), EBB_EINVAL, "ebb_op_linear_backward: grad is NULL");
    Tensor gi = make(EBB_DEVICE_CPU, EBB_I64, {4, 5}, std::vector<double>(20, 1));
    EBB_CHECK_FAILS(ebb_op_linear_backward(gi, x, w, gx.out(), nullptr, nullptr), EBB_EINVAL,
                    "ebb_op_linear_backward: grad (i64[4, 5] on the CPU) has dtype i64; expected a floating dtype");
    EBB_CHECK_FAILS(ebb_op_linear_backward(g, x, w4, gx.out(), nullptr, nullptr), EBB_EINVAL, "ebb_op_linear_backward: x (f32[4, 3]");
    CHECK(gx.get() == nullptr);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
