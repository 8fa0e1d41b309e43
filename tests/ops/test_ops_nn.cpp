// softmax, log_softmax, cross_entropy, mse_loss, layer_norm, cat and stack against f64
// references on the CPU and both emulated devices, gradcheck of each backward, refused inputs.
#include <cmath>
#include <functional>
#include <vector>

#include "gradcheck.hpp"

using namespace ebb_test;

namespace {

// softmax over the last dim of rows x cols.
std::vector<double> ref_softmax(const std::vector<double> &v, int64_t rows, int64_t cols, bool logarithm) {
  std::vector<double> r(v.size());
  for (int64_t i = 0; i < rows; i++) {
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j < cols; j++) m = std::max(m, v[(size_t)(i * cols + j)]);
    for (int64_t j = 0; j < cols; j++) z += std::exp(v[(size_t)(i * cols + j)] - m);
    for (int64_t j = 0; j < cols; j++) {
      double x = v[(size_t)(i * cols + j)] - m;
      r[(size_t)(i * cols + j)] = logarithm ? x - std::log(z) : std::exp(x) / z;
    }
  }
  return r;
}

} // namespace

TEST_CASE("nn: softmax, log_softmax and the losses match the reference", "[ops][nn]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : {EBB_F64, EBB_F32}) {
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt));
      double tol = dt == EBB_F64 ? 1e-12 : 1e-5;
      auto v = values(12, 71, -30, 30); // large logits: needs the max subtracted
      Tensor x = make(dev, dt, {3, 4}, v), sm, lsm, xt, smt;
      auto xv = read(x);
      EBB_REQUIRE_OK(ebb_op_softmax(x, -1, sm.out()));
      EBB_REQUIRE_OK(ebb_op_log_softmax(x, 1, lsm.out()));
      EBB_CHECK_CLOSE(read(sm), ref_softmax(xv, 3, 4, false), tol, tol);
      EBB_CHECK_CLOSE(read(lsm), ref_softmax(xv, 3, 4, true), tol, tol);
      // along dim 0: the same as the transpose along its last dim
      EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, xt.out()));
      EBB_REQUIRE_OK(ebb_op_softmax(xt, 0, smt.out()));
      auto st = read(smt);
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) {
          // softmax over dim 0 of xt [4,3]: column j of xt is row j of x
          double m = -INFINITY, z = 0;
          for (int k = 0; k < 4; k++) m = std::max(m, xv[(size_t)(j * 4 + k)]);
          for (int k = 0; k < 4; k++) z += std::exp(xv[(size_t)(j * 4 + k)] - m);
          CHECK(std::fabs(st[(size_t)(i * 3 + j)] - std::exp(xv[(size_t)(j * 4 + i)] - m) / z) <= tol);
        }
      // cross entropy with class indices
      Tensor tgt = make(dev, EBB_I64, {3}, {2, 0, 3}), ce;
      EBB_REQUIRE_OK(ebb_op_cross_entropy(x, tgt, ce.out()));
      CHECK(shape_of(ce).empty());
      auto ls = ref_softmax(xv, 3, 4, true);
      double want_ce = -(ls[2] + ls[4] + ls[11]) / 3;
      CHECK(std::fabs(read(ce)[0] - want_ce) <= tol * std::max(1.0, std::fabs(want_ce)));
      // mse
      Tensor y = make(dev, dt, {3, 4}, values(12, 72)), mse;
      EBB_REQUIRE_OK(ebb_op_mse_loss(x, y, mse.out()));
      auto yv = read(y);
      double acc = 0;
      for (size_t i = 0; i < 12; i++) acc += (xv[i] - yv[i]) * (xv[i] - yv[i]);
      CHECK(std::fabs(read(mse)[0] - acc / 12) <= tol * acc);
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("nn: layer_norm over the last dims, with and without weight and bias", "[ops][nn]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto v = values(24, 81, -2, 5);
    Tensor x = make(dev, EBB_F64, {2, 3, 4}, v), w = make(dev, EBB_F64, {3, 4}, values(12, 82)), b = make(dev, EBB_F64, {3, 4}, values(12, 83));
    Tensor y, y0;
    EBB_REQUIRE_OK(ebb_op_layer_norm(x, 2, w, b, 1e-5, y.out()));
    EBB_REQUIRE_OK(ebb_op_layer_norm(x, 1, nullptr, nullptr, 1e-5, y0.out()));
    auto wv = read(w), bv = read(b), yv = read(y), y0v = read(y0);
    for (int i = 0; i < 2; i++) {
      double mu = 0, var = 0;
      for (int j = 0; j < 12; j++) mu += v[(size_t)(i * 12 + j)];
      mu /= 12;
      for (int j = 0; j < 12; j++) var += (v[(size_t)(i * 12 + j)] - mu) * (v[(size_t)(i * 12 + j)] - mu);
      var /= 12;
      for (int j = 0; j < 12; j++) {
        double want = (v[(size_t)(i * 12 + j)] - mu) / std::sqrt(var + 1e-5) * wv[(size_t)j] + bv[(size_t)j];
        CHECK(std::fabs(yv[(size_t)(i * 12 + j)] - want) < 1e-12);
      }
    }
    for (int r = 0; r < 6; r++) {
      double mu = 0, var = 0;
      for (int j = 0; j < 4; j++) mu += v[(size_t)(r * 4 + j)];
      mu /= 4;
      for (int j = 0; j < 4; j++) var += (v[(size_t)(r * 4 + j)] - mu) * (v[(size_t)(r * 4 + j)] - mu);
      var /= 4;
      for (int j = 0; j < 4; j++) CHECK(std::fabs(y0v[(size_t)(r * 4 + j)] - (v[(size_t)(r * 4 + j)] - mu) / std::sqrt(var + 1e-5)) < 1e-12);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("nn: cat and stack join along any dim", "[ops][nn][cat]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor a = make(dev, EBB_F32, {2, 2}, {1, 2, 3, 4}), b = make(dev, EBB_F32, {2, 3}, {5, 6, 7, 8, 9, 10}), c, s, s0;
    const ebb_tensor_t *ab[2] = {a, b};
    EBB_REQUIRE_OK(ebb_op_cat(ab, 2, -1, c.out()));
    CHECK(shape_of(c) == std::vector<int64_t>{2, 5});
    CHECK(read(c) == std::vector<double>{1, 2, 5, 6, 7, 3, 4, 8, 9, 10});
    const ebb_tensor_t *aa[3] = {a, a, a};
    EBB_REQUIRE_OK(ebb_op_stack(aa, 3, 1, s.out()));
    CHECK(shape_of(s) == std::vector<int64_t>{2, 3, 2});
    CHECK(read(s) == std::vector<double>{1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4});
    EBB_REQUIRE_OK(ebb_op_stack(aa, 2, 0, s0.out()));
    CHECK(shape_of(s0) == std::vector<int64_t>{2, 2, 2});
    Tensor g0, g1;
    EBB_REQUIRE_OK(ebb_op_cat_backward(c, ab, 2, 1, 1, g1.out()));
    CHECK(read(g1) == read(b));
    EBB_REQUIRE_OK(ebb_op_stack_backward(s, 3, 1, 2, g0.out()));
    CHECK(read(g0) == read(a));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("nn: gradcheck of softmax, log_softmax, cross_entropy, mse_loss, layer_norm, cat and stack", "[ops][nn][gradcheck]") {
  EbbSession session;
  for (int dev : {EBB_DEVICE_CPU, ebb_test_device_count() - 1}) { // device 1 where it exists
    INFO(dev_name(dev));
    std::vector<GcInput> x{{{3, 4}, values(12, 91, -2, 2)}};
    for (int dim : {0, -1}) {
      EBB_CHECK_GRADCHECK(
          dev, x, [dim](const GcInputs &i, ebb_tensor_t **o) { return ebb_op_softmax(i[0], dim, o); },
          [dim](const ebb_tensor_t *g, const GcInputs &, const ebb_tensor_t *y, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_softmax_backward(g, y, dim, &gr[0]);
          });
      EBB_CHECK_GRADCHECK(
          dev, x, [dim](const GcInputs &i, ebb_tensor_t **o) { return ebb_op_log_softmax(i[0], dim, o); },
          [dim](const ebb_tensor_t *g, const GcInputs &, const ebb_tensor_t *y, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_log_softmax_backward(g, y, dim, &gr[0]);
          });
    }
    std::vector<GcInput> ce{{{3, 4}, values(12, 92, -2, 2)}, {{3}, {1, 3, 0}, EBB_I64, false}};
    EBB_CHECK_GRADCHECK(
        dev, ce, [](const GcInputs &i, ebb_tensor_t **o) { return ebb_op_cross_entropy(i[0], i[1], o); },
        [](const ebb_tensor_t *g, const GcInputs &i, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_cross_entropy_backward(g, i[0], i[1], &gr[0]);
        });
    std::vector<GcInput> mse{{{2, 3}, values(6, 93)}, {{2, 3}, values(6, 94)}};
    EBB_CHECK_GRADCHECK(
        dev, mse, [](const GcInputs &i, ebb_tensor_t **o) { return ebb_op_mse_loss(i[0], i[1], o); },
        [](const ebb_tensor_t *g, const GcInputs &i, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_mse_loss_backward(g, i[0], i[1], &gr[0], &gr[1]);
        });
    std::vector<GcInput> ln{{{2, 2, 3}, values(12, 95, -2, 2)}, {{2, 3}, values(6, 96, 0.5, 1.5)}, {{2, 3}, values(6, 97)}};
    EBB_CHECK_GRADCHECK(
        dev, ln, [](const GcInputs &i, ebb_tensor_t **o) { return ebb_op_layer_norm(i[0], 2, i[1], i[2], 1e-5, o); },
        [](const ebb_tensor_t *g, const GcInputs &i, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_layer_norm_backward(g, i[0], 2, i[1], i[2], 1e-5, &gr[0], &gr[1], &gr[2]);
        });
    std::vector<GcInput> cat{{{2, 2}, values(4, 98)}, {{2, 3}, values(6, 99)}};
    EBB_CHECK_GRADCHECK(
        dev, cat,
        [](const GcInputs &i, ebb_tensor_t **o) {
          const ebb_tensor_t *ts[2] = {i[0], i[1]};
          return ebb_op_cat(ts, 2, 1, o);
        },
        [](const ebb_tensor_t *g, const GcInputs &i, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          const ebb_tensor_t *ts[2] = {i[0], i[1]};
          ebb_status st = ebb_op_cat_backward(g, ts, 2, 1, 0, &gr[0]);
          return st ? st : ebb_op_cat_backward(g, ts, 2, 1, 1, &gr[1]);
        });
    std::vector<GcInput> stk{{{2, 3}, values(6, 100)}, {{2, 3}, values(6, 101)}, {{2, 3}, values(6, 102)}};
    EBB_CHECK_GRADCHECK(
        dev, stk,
        [](const GcInputs &i, ebb_tensor_t **o) {
          const ebb_tensor_t *ts[3] = {i[0], i[1], i[2]};
          return ebb_op_stack(ts, 3, -1, o);
        },
        [](const ebb_tensor_t *g, const GcInputs &, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          ebb_status st = EBB_OK;
          for (int k = 0; k < 3 && !st; k++) st = ebb_op_stack_backward(g, 3, -1, k, &gr[(size_t)k]);
          return st;
        });
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("nn: bad inputs name the op, the argument and the shapes", "[ops][nn][errors]") {
  EbbSession session;
  {
    Tensor x = make(0, EBB_F32, {3, 4}, values(12, 1)), i = make(0, EBB_I64, {3, 4}, std::vector<double>(12, 1)), o;
    Tensor t_bad = make(0, EBB_I64, {4}, {0, 1, 2, 3}), t_f = make(0, EBB_F32, {3}, {0, 1, 2}), t_cpu = make(EBB_DEVICE_CPU, EBB_I64, {3}, {0, 1, 2});
    EBB_CHECK_FAILS(ebb_op_softmax(i, 0, o.out()), EBB_EINVAL, "ebb_op_softmax: t (i64[3, 4] on device 0) has dtype i64");
    EBB_CHECK_FAILS(ebb_op_log_softmax(x, 2, o.out()), EBB_EINVAL, "dim 2 is out of range");
    EBB_CHECK_FAILS(ebb_op_cross_entropy(x, t_bad, o.out()), EBB_EINVAL, "logits (f32[3, 4] on device 0) and target (i64[4] on device 0) do not fit");
    EBB_CHECK_FAILS(ebb_op_cross_entropy(x, t_f, o.out()), EBB_EINVAL, "target (f32[3] on device 0) has dtype f32");
    EBB_CHECK_FAILS(ebb_op_cross_entropy(x, t_cpu, o.out()), EBB_EDEVICE, "target (i64[3] on the CPU) and logits (f32[3, 4] on device 0) are on different devices");
    Tensor y = make(0, EBB_F32, {4, 3}, values(12, 2));
    EBB_CHECK_FAILS(ebb_op_mse_loss(x, y, o.out()), EBB_EINVAL, "a (f32[3, 4] on device 0) and b (f32[4, 3] on device 0) differ in shape");
    Tensor w = make(0, EBB_F32, {3}, values(3, 3));
    EBB_CHECK_FAILS(ebb_op_layer_norm(x, 1, w, nullptr, 1e-5, o.out()), EBB_EINVAL, "weight (f32[3] on device 0) does not match x (f32[3, 4] on device 0)");
    EBB_CHECK_FAILS(ebb_op_layer_norm(x, 3, nullptr, nullptr, 1e-5, o.out()), EBB_EINVAL, "nnorm 3");
    Tensor w4 = make(0, EBB_F32, {4}, values(4, 3)), x_cpu = make(EBB_DEVICE_CPU, EBB_F32, {3, 4}, values(12, 1));
    EBB_CHECK_FAILS(ebb_op_layer_norm(x_cpu, 1, w4, nullptr, 1e-5, o.out()), EBB_EDEVICE,
                    "ebb_op_layer_norm: weight (f32[4] on device 0) and x (f32[3, 4] on the CPU) are on different devices");
    EBB_CHECK_FAILS(ebb_op_layer_norm(x_cpu, 1, nullptr, w4, 1e-5, o.out()), EBB_EDEVICE, "expected the bias on x's device");
    const ebb_tensor_t *bad[2] = {x, y};
    EBB_CHECK_FAILS(ebb_op_cat(bad, 2, 0, o.out()), EBB_EINVAL, "ts[1] (f32[4, 3] on device 0) and ts[0] (f32[3, 4] on device 0) differ in shape");
    EBB_CHECK_FAILS(ebb_op_stack(bad, 2, 0, o.out()), EBB_EINVAL, "expected one shape");
    const ebb_tensor_t *mixed[2] = {x, i};
    EBB_CHECK_FAILS(ebb_op_cat(mixed, 2, 0, o.out()), EBB_EINVAL, "expected one dtype and device");
    EBB_CHECK_FAILS(ebb_op_cat(nullptr, 0, 0, o.out()), EBB_EINVAL, "expected at least one");
    Tensor g = make(0, EBB_F32, {3}, values(3, 4)), gx;
    EBB_CHECK_FAILS(ebb_op_mse_loss_backward(g, x, x, gx.out(), nullptr), EBB_EINVAL, "expected a scalar");
    EBB_CHECK_FAILS(ebb_op_softmax_backward(g, x, 0, gx.out()), EBB_EINVAL, "grad (f32[3] on device 0) does not have the shape of y (f32[3, 4] on device 0)");
    EBB_CHECK_FAILS(ebb_op_stack_backward(x, 2, 0, 0, gx.out()), EBB_EINVAL, "expected n = 2");
    REQUIRE(o.get() == nullptr);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// PyTorch: softmax and log_softmax of a tensor with no elements give an empty tensor of its shape,
// whichever dim is empty; so do their backward functions. (Before, an empty dim along `dim`
// failed with a message from the internal ebb_op_amax.)
TEST_CASE("nn: softmax and log_softmax of empty tensors give empty results, forward and backward", "[ops][nn][empty]") {
  EbbSession session;
  const std::vector<std::vector<int64_t>> shapes{{3, 0}, {0, 4}, {0}, {2, 0, 3}};
  for (int dev : devices()) {
    for (const auto &shape : shapes) {
      for (int dim = 0; dim < (int)shape.size(); dim++) {
        for (bool logarithm : {false, true}) {
          INFO(dev_name(dev) << " shape of " << shape.size() << " dims, [" << shape[0] << ",...], dim " << dim
                             << (logarithm ? " log_softmax" : " softmax"));
          Tensor x, y, g, gx;
          EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, (int)shape.size(), shape.data(), x.out()));
          EBB_REQUIRE_OK(logarithm ? ebb_op_log_softmax(x, dim, y.out()) : ebb_op_softmax(x, dim, y.out()));
          CHECK(shape_of(y) == shape);
          CHECK(dtype_of(y) == EBB_F32);
          EBB_REQUIRE_OK(ebb_tensor_ones(dev, EBB_F32, (int)shape.size(), shape.data(), g.out()));
          EBB_REQUIRE_OK(logarithm ? ebb_op_log_softmax_backward(g, y, dim, gx.out()) : ebb_op_softmax_backward(g, y, dim, gx.out()));
          CHECK(shape_of(gx) == shape);
          CHECK(read(gx).empty());
        }
      }
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

namespace {

// One op of the fused row kernel, run on an f32 input (the fused path) and on the same values
// in f64 (the composed path, exact to ~1e-15): the two must agree to f32's precision.
struct RowCase {
  const char *name;
  std::function<ebb_status(const ebb_tensor_t *x, const ebb_tensor_t *g, ebb_tensor_t **out)> run;
};

}  // namespace

TEST_CASE("nn: the fused f32 row kernels agree with the composed f64 path at every row width", "[ops][nn][fused]") {
  EbbSession session;
  const std::vector<RowCase> cases = {
      {"softmax", [](const ebb_tensor_t *x, const ebb_tensor_t *, ebb_tensor_t **o) { return ebb_op_softmax(x, -1, o); }},
      {"log_softmax", [](const ebb_tensor_t *x, const ebb_tensor_t *, ebb_tensor_t **o) { return ebb_op_log_softmax(x, 1, o); }},
      {"softmax_backward",
       [](const ebb_tensor_t *x, const ebb_tensor_t *g, ebb_tensor_t **o) {
         Tensor y;
         ebb_status st = ebb_op_softmax(x, 1, y.out());
         return st ? st : ebb_op_softmax_backward(g, y, 1, o);
       }},
      {"log_softmax_backward",
       [](const ebb_tensor_t *x, const ebb_tensor_t *g, ebb_tensor_t **o) {
         Tensor y;
         ebb_status st = ebb_op_log_softmax(x, 1, y.out());
         return st ? st : ebb_op_log_softmax_backward(g, y, 1, o);
       }},
      {"layer_norm", [](const ebb_tensor_t *x, const ebb_tensor_t *g, ebb_tensor_t **o) {
         // weight and bias from the rows of g (the second input)
         Tensor w, b;
         ebb_status st = ebb_tensor_select(g, 0, 0, w.out());
         if (!st) st = ebb_tensor_select(g, 0, 1, b.out());
         return st ? st : ebb_op_layer_norm(x, 1, w, b, 1e-5, o);
       }},
  };
  for (int dev : devices())
    for (int64_t cols : {1, 3, 7, 8, 16, 17, 33, 100, 1000}) {
      const int64_t rows = 5;
      auto xv = values(rows * cols, 11 + (unsigned)cols, -30, 30);  // large: the max must be subtracted
      auto gv = values(rows * cols, 97 + (unsigned)cols, -2, 2);
      Tensor x32 = make(dev, EBB_F32, {rows, cols}, xv), g32 = make(dev, EBB_F32, {rows, cols}, gv);
      // the f64 references start from the f32-rounded values, so only the math differs
      Tensor x64, g64;
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(x32, EBB_F64, x64.out()));
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(g32, EBB_F64, g64.out()));
      for (const auto &c : cases) {
        INFO(dev_name(dev) << " cols " << cols << " " << c.name);
        Tensor f, r;
        EBB_REQUIRE_OK(c.run(x32, g32, f.out()));
        EBB_REQUIRE_OK(c.run(x64, g64, r.out()));
        EBB_CHECK_CLOSE(read(f), read(r), 2e-5, 2e-5);
      }
      // cross entropy, forward and backward, against the f64 path
      std::vector<double> tv;
      for (int64_t i = 0; i < rows; i++) tv.push_back((double)((i * 7 + 3) % cols));
      Tensor tgt = make(dev, EBB_I64, {rows}, tv), ce32, ce64, one32, one64, gce32, gce64;
      EBB_REQUIRE_OK(ebb_op_cross_entropy(x32, tgt, ce32.out()));
      EBB_REQUIRE_OK(ebb_op_cross_entropy(x64, tgt, ce64.out()));
      INFO(dev_name(dev) << " cols " << cols << " cross_entropy");
      EBB_CHECK_CLOSE(read(ce32), read(ce64), 2e-5, 2e-5);
      one32 = make(dev, EBB_F32, {}, {0.75});
      one64 = make(dev, EBB_F64, {}, {0.75});
      EBB_REQUIRE_OK(ebb_op_cross_entropy_backward(one32, x32, tgt, gce32.out()));
      EBB_REQUIRE_OK(ebb_op_cross_entropy_backward(one64, x64, tgt, gce64.out()));
      EBB_CHECK_CLOSE(read(gce32), read(gce64), 2e-6, 2e-5);
      // layer_norm backward over the last two dims, every gradient
      Tensor x3, g3, w, b, w64, b64, x3d, g3d;
      EBB_REQUIRE_OK(ebb_tensor_view(x32, 3, std::vector<int64_t>{rows, 1, cols}.data(), x3.out()));
      EBB_REQUIRE_OK(ebb_tensor_view(g32, 3, std::vector<int64_t>{rows, 1, cols}.data(), g3.out()));
      w = make(dev, EBB_F32, {1, cols}, values(cols, 5, 0.5, 1.5));
      b = make(dev, EBB_F32, {1, cols}, values(cols, 6, -1, 1));
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(w, EBB_F64, w64.out()));
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(b, EBB_F64, b64.out()));
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(x3, EBB_F64, x3d.out()));
      EBB_REQUIRE_OK(ebb_tensor_to_dtype(g3, EBB_F64, g3d.out()));
      Tensor y32, y64, gx32, gw32, gb32, gx64, gw64, gb64;
      EBB_REQUIRE_OK(ebb_op_layer_norm(x3, 2, w, b, 1e-5, y32.out()));
      EBB_REQUIRE_OK(ebb_op_layer_norm(x3d, 2, w64, b64, 1e-5, y64.out()));
      INFO("layer_norm over two dims, forward and backward");
      EBB_CHECK_CLOSE(read(y32), read(y64), 2e-5, 2e-5);
      EBB_REQUIRE_OK(ebb_op_layer_norm_backward(g3, x3, 2, w, b, 1e-5, gx32.out(), gw32.out(), gb32.out()));
      EBB_REQUIRE_OK(ebb_op_layer_norm_backward(g3d, x3d, 2, w64, b64, 1e-5, gx64.out(), gw64.out(), gb64.out()));
      // a row of one element has xhat 0 and a gradient of 0: absolute tolerance
      EBB_CHECK_CLOSE(read(gx32), read(gx64), 1e-4, 1e-4);
      EBB_CHECK_CLOSE(read(gw32), read(gw64), 1e-4, 1e-4);
      EBB_CHECK_CLOSE(read(gb32), read(gb64), 1e-5, 1e-5);
    }
}

TEST_CASE("nn: fused softmax keeps NaN and infinities as the composed path does", "[ops][nn][fused]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    // a NaN poisons its own row only; -inf entries get probability 0; an all -inf row is NaN
    const double inf = INFINITY;
    std::vector<double> v = {1, NAN, 2, 3, -inf, 0, -inf, 1, -inf, -inf, -inf, -inf};
    Tensor x = make(dev, EBB_F32, {3, 4}, v), y;
    EBB_REQUIRE_OK(ebb_op_softmax(x, 1, y.out()));
    auto r = read(y);
    for (int j = 0; j < 4; j++) CHECK(std::isnan(r[(size_t)j]));
    CHECK(r[4] == 0.0);
    CHECK(r[6] == 0.0);
    CHECK(std::fabs(r[5] - 1 / (1 + std::exp(1.0))) < 1e-6);
    for (int j = 8; j < 12; j++) CHECK(std::isnan(r[(size_t)j]));
  }
}

TEST_CASE("nn: cross_entropy refuses a CPU target that is not a class index, naming the row", "[ops][nn][fused]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {3, 4}, values(12, 3)), bad = make(EBB_DEVICE_CPU, EBB_I64, {3}, {0, 4, 1}), o;
  Tensor neg = make(EBB_DEVICE_CPU, EBB_I64, {3}, {0, 1, -1}), one = make(EBB_DEVICE_CPU, EBB_F32, {}, {1.0});
  EBB_CHECK_FAILS(ebb_op_cross_entropy(x, bad, o.out()), EBB_EINVAL, "holds 4 at row 1; expected a class index in [0, 4)");
  EBB_CHECK_FAILS(ebb_op_cross_entropy_backward(one, x, neg, o.out()), EBB_EINVAL, "holds -1 at row 2");
  CHECK(o.get() == nullptr);
}

TEST_CASE("nn: fused log_softmax and cross_entropy keep a confident row's digits at large logits", "[ops][nn][fused]") {
  // [a, a - 10]: log_softmax = [-log(1 + e^-10), -10 - log(1 + e^-10)] whatever a is; adding
  // log(sum) to the max before subtracting would round the small term away in f32.
  EbbSession session;
  for (int dev : devices())
    for (double a : {100.0, 1000.0, 1e4}) {
      INFO(dev_name(dev) << " a " << a);
      const double l = std::log1p(std::exp(-10.0));
      Tensor x = make(dev, EBB_F32, {1, 2}, {a, a - 10}), ls, ce, tgt = make(dev, EBB_I64, {1}, {0});
      EBB_REQUIRE_OK(ebb_op_log_softmax(x, 1, ls.out()));
      auto r = read(ls);
      CHECK(r[0] == Approx(-l).epsilon(1e-3));
      CHECK(r[1] == Approx(-10 - l).epsilon(1e-5));
      EBB_REQUIRE_OK(ebb_op_cross_entropy(x, tgt, ce.out()));
      CHECK(read(ce)[0] == Approx(l).epsilon(1e-3));
    }
}

TEST_CASE("nn: cross_entropy refuses a bad CPU target on every path: f64 logits, a strided target", "[ops][nn]") {
  EbbSession session;
  Tensor x64 = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, values(6, 4)), x32 = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, values(6, 5));
  Tensor wide = make(EBB_DEVICE_CPU, EBB_I64, {2, 2}, {0, 7, 9, 1}), col, bad = make(EBB_DEVICE_CPU, EBB_I64, {2}, {1, 3}), o;
  Tensor one = make(EBB_DEVICE_CPU, EBB_F64, {}, {1.0});
  EBB_REQUIRE_OK(ebb_tensor_select(wide, 1, 0, col.out()));  // [0, 9], stride 2
  EBB_CHECK_FAILS(ebb_op_cross_entropy(x64, bad, o.out()), EBB_EINVAL, "holds 3 at row 1");
  EBB_CHECK_FAILS(ebb_op_cross_entropy(x32, col, o.out()), EBB_EINVAL, "holds 9 at row 1");
  EBB_CHECK_FAILS(ebb_op_cross_entropy_backward(one, x64, bad, o.out()), EBB_EINVAL, "holds 3 at row 1");
  CHECK(o.get() == nullptr);
}
