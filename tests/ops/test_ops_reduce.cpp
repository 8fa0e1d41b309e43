// Reductions and matmul against naive f64 references on the CPU and both emulated devices
// (keepdim, several dims, strided inputs, ties and NaN for max, batched and broadcast matmul,
// transposed operands, bf16), sum_to_shape, gradcheck of every backward, and refused inputs.
#include <cmath>
#include <vector>

#include "gradcheck.hpp"

using namespace ebb_test;

namespace {

// Reference reduction of a contiguous [d0, d1, d2] tensor over the dims in mask.
std::vector<double> ref_reduce(const std::vector<double> &v, const std::vector<int64_t> &s, const bool mask[3], int op) {
  std::vector<int64_t> os;
  for (int d = 0; d < 3; d++) os.push_back(mask[d] ? 1 : s[(size_t)d]);
  std::vector<double> out((size_t)numel_of(os), op == 2 ? -INFINITY : 0.0);
  std::vector<int64_t> cnt(out.size(), 0);
  for (int64_t i = 0; i < s[0]; i++)
    for (int64_t j = 0; j < s[1]; j++)
      for (int64_t k = 0; k < s[2]; k++) {
        int64_t o = (mask[0] ? 0 : i) * os[1] * os[2] + (mask[1] ? 0 : j) * os[2] + (mask[2] ? 0 : k);
        double x = v[(size_t)(i * s[1] * s[2] + j * s[2] + k)];
        if (op == 2) out[(size_t)o] = std::max(out[(size_t)o], x);
        else out[(size_t)o] += x;
        cnt[(size_t)o]++;
      }
  if (op == 1)
    for (size_t i = 0; i < out.size(); i++) out[i] /= (double)cnt[i];
  return out;
}

std::vector<double> ref_matmul(const std::vector<double> &a, const std::vector<double> &b, int64_t batch, int64_t m, int64_t k, int64_t n,
                               bool a_shared, bool b_shared) {
  std::vector<double> c((size_t)(batch * m * n), 0.0);
  for (int64_t p = 0; p < batch; p++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double acc = 0;
        for (int64_t q = 0; q < k; q++)
          acc += a[(size_t)((a_shared ? 0 : p) * m * k + i * k + q)] * b[(size_t)((b_shared ? 0 : p) * k * n + q * n + j)];
        c[(size_t)(p * m * n + i * n + j)] = acc;
      }
  return c;
}

} // namespace

TEST_CASE("reduce: sum, mean and amax over dims with and without keepdim", "[ops][reduce]") {
  EbbSession session;
  std::vector<int64_t> s{3, 4, 5};
  auto v = values(60, 41, -3, 3);
  for (int dev : devices())
    for (ebb_dtype dt : {EBB_F64, EBB_F32}) {
      Tensor t = make(dev, dt, s, v);
      auto tv = read(t);
      for (int m = 0; m < 8; m++) {
        bool mask[3] = {(m & 1) != 0, (m & 2) != 0, (m & 4) != 0};
        std::vector<int> dims;
        for (int d = 0; d < 3; d++)
          if (mask[d]) dims.push_back(d == 2 ? -1 : d); // a negative dim too
        if (dims.empty()) mask[0] = mask[1] = mask[2] = true; // ndims 0 = all
        for (bool keep : {false, true}) {
          INFO(dev_name(dev) << " " << ebb_dtype_name(dt) << " mask " << m << " keepdim " << keep);
          Tensor rs, rm, rx;
          EBB_REQUIRE_OK(ebb_op_sum(t, dims.data(), (int)dims.size(), keep, rs.out()));
          EBB_REQUIRE_OK(ebb_op_mean(t, dims.data(), (int)dims.size(), keep, rm.out()));
          EBB_REQUIRE_OK(ebb_op_amax(t, dims.data(), (int)dims.size(), keep, rx.out()));
          std::vector<int64_t> want_shape;
          for (int d = 0; d < 3; d++)
            if (!mask[d]) want_shape.push_back(s[(size_t)d]);
            else if (keep) want_shape.push_back(1);
          CHECK(shape_of(rs) == want_shape);
          CHECK(shape_of(rx) == want_shape);
          CHECK(dtype_of(rs) == dt);
          double tol = dt == EBB_F64 ? 1e-12 : 1e-6;
          EBB_CHECK_CLOSE(read(rs), ref_reduce(tv, s, mask, 0), tol, tol);
          EBB_CHECK_CLOSE(read(rm), ref_reduce(tv, s, mask, 1), tol, tol);
          EBB_CHECK_CLOSE(read(rx), ref_reduce(tv, s, mask, 2), 0, 0);
        }
      }
      // a strided input (a transpose) reduces the same as its contiguous copy
      Tensor tt, a1, a2, cc;
      EBB_REQUIRE_OK(ebb_tensor_transpose(t, 0, 2, tt.out()));
      EBB_REQUIRE_OK(ebb_tensor_contiguous(tt, cc.out()));
      int d1 = 1;
      EBB_REQUIRE_OK(ebb_op_sum(tt, &d1, 1, false, a1.out()));
      EBB_REQUIRE_OK(ebb_op_sum(cc, &d1, 1, false, a2.out()));
      EBB_CHECK_CLOSE(read(a1), read(a2), 1e-12, 1e-6);
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("reduce: random permuted inputs and dim subsets match the reference", "[ops][reduce][random]") {
  EbbSession session;
  uint64_t rng = 777;
  auto next = [&](int n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng >> 33) % (uint64_t)n);
  };
  for (int dev : {EBB_DEVICE_CPU, ebb_test_device_count() - 1}) // device 1 where it exists
    for (int iter = 0; iter < 120; iter++) {
      int nd = 1 + next(4);
      std::vector<int64_t> shape;
      for (int d = 0; d < nd; d++) shape.push_back(1 + next(5));
      std::vector<int> perm(nd);
      for (int d = 0; d < nd; d++) perm[(size_t)d] = d;
      for (int d = nd - 1; d > 0; d--) std::swap(perm[(size_t)d], perm[(size_t)next(d + 1)]);
      Tensor base = make(dev, EBB_F64, shape, values(numel_of(shape), 300u + (unsigned)iter, -5, 5)), t;
      EBB_REQUIRE_OK(ebb_tensor_permute(base, perm.data(), nd, t.out()));
      auto ts = shape_of(t);
      auto tv = read(t); // row-major values of the permuted view
      std::vector<int> dims;
      std::vector<bool> red((size_t)nd, false);
      for (int d = 0; d < nd; d++)
        if (next(2)) dims.push_back(d), red[(size_t)d] = true;
      if (dims.empty()) red.assign((size_t)nd, true);
      bool keep = next(2) == 1;
      int op = next(3); // sum, mean, amax
      INFO(dev_name(dev) << " iter " << iter << " op " << op << " keepdim " << keep);
      Tensor r;
      if (op == 0) EBB_REQUIRE_OK(ebb_op_sum(t, dims.data(), (int)dims.size(), keep, r.out()));
      else if (op == 1) EBB_REQUIRE_OK(ebb_op_mean(t, dims.data(), (int)dims.size(), keep, r.out()));
      else EBB_REQUIRE_OK(ebb_op_amax(t, dims.data(), (int)dims.size(), keep, r.out()));
      // reference: row-major walk of the view, accumulated in the same order as the kernels
      std::vector<int64_t> os;
      for (int d = 0; d < nd; d++) os.push_back(red[(size_t)d] ? 1 : ts[(size_t)d]);
      std::vector<double> want((size_t)numel_of(os), op == 2 ? -INFINITY : 0.0);
      auto tstr = contiguous_strides(ts), ostr = contiguous_strides(os);
      int64_t count = numel_of(ts) / numel_of(os);
      for (int64_t i = 0; i < numel_of(ts); i++) {
        int64_t o = 0;
        for (int d = 0; d < nd; d++)
          if (!red[(size_t)d]) o += ((i / tstr[(size_t)d]) % ts[(size_t)d]) * ostr[(size_t)d];
        if (op == 2) want[(size_t)o] = std::max(want[(size_t)o], tv[(size_t)i]);
        else want[(size_t)o] += tv[(size_t)i];
      }
      if (op == 1)
        for (auto &w : want) w /= (double)count;
      std::vector<int64_t> rs;
      for (int d = 0; d < nd; d++)
        if (!red[(size_t)d]) rs.push_back(ts[(size_t)d]);
        else if (keep) rs.push_back(1);
      CHECK(shape_of(r) == rs);
      EBB_CHECK_CLOSE(read(r), want, 1e-12, 1e-12);
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("reduce: max_dim without indices (NULL) gives the same values", "[ops][reduce]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor t = make(dev, EBB_F32, {2, 4}, {1, 5, 5, 2, -1, -3, -1, -7}), v, w, ix;
    long live = ebb_tensor_live_count();
    EBB_REQUIRE_OK(ebb_op_max_dim(t, 1, false, v.out(), nullptr));
    CHECK(ebb_tensor_live_count() == live + 1);  // the values only: the indices made for it are gone
    EBB_REQUIRE_OK(ebb_op_max_dim(t, 1, false, w.out(), ix.out()));
    CHECK(read(v) == read(w));
    CHECK(read(v) == std::vector<double>{5, -1});
    EBB_REQUIRE_OK(ebb_op_max_dim(t, 0, true, v.out(), nullptr));
    CHECK(shape_of(v) == std::vector<int64_t>{1, 4});
    CHECK(read(v) == std::vector<double>{1, 5, 5, 2});
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("reduce: max_dim gives the first index of the maximum, NaN wins, integers sum to i64", "[ops][reduce]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor t = make(dev, EBB_F32, {2, 4}, {1, 5, 5, 2, -1, -3, -1, -7}), v, ix;
    EBB_REQUIRE_OK(ebb_op_max_dim(t, 1, false, v.out(), ix.out()));
    CHECK(read(v) == std::vector<double>{5, -1});
    CHECK(read(ix) == std::vector<double>{1, 0});
    CHECK(dtype_of(ix) == EBB_I64);
    EBB_REQUIRE_OK(ebb_op_max_dim(t, 0, true, v.out(), ix.out()));
    CHECK(shape_of(v) == std::vector<int64_t>{1, 4});
    CHECK(read(ix) == std::vector<double>{0, 0, 0, 0});
    Tensor n = make(dev, EBB_F64, {3}, {1, NAN, 2}), m;
    EBB_REQUIRE_OK(ebb_op_amax(n, nullptr, 0, false, m.out()));
    CHECK(std::isnan(read(m)[0]));
    Tensor i = make(dev, EBB_BOOL, {4}, {1, 0, 1, 1}), s, mean;
    EBB_REQUIRE_OK(ebb_op_sum(i, nullptr, 0, false, s.out()));
    CHECK(dtype_of(s) == EBB_I64);
    CHECK(read(s) == std::vector<double>{3});
    EBB_REQUIRE_OK(ebb_op_mean(i, nullptr, 0, false, mean.out()));
    CHECK(dtype_of(mean) == EBB_F32);
    CHECK(read(mean) == std::vector<double>{0.75});
    // sum_to_shape: leading dims and dims of extent 1 are summed
    Tensor big = make(dev, EBB_F64, {2, 3, 4}, values(24, 3)), st;
    int64_t to[2] = {3, 1};
    EBB_REQUIRE_OK(ebb_op_sum_to_shape(big, 2, to, st.out()));
    CHECK(shape_of(st) == std::vector<int64_t>{3, 1});
    auto bv = read(big), sv = read(st);
    for (int j = 0; j < 3; j++) {
      double acc = 0;
      for (int i2 = 0; i2 < 2; i2++)
        for (int k = 0; k < 4; k++) acc += bv[(size_t)(i2 * 12 + j * 4 + k)];
      CHECK(std::fabs(sv[(size_t)j] - acc) < 1e-12);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("matmul: 2-D, batched, broadcast batch and transposed operands match the reference", "[ops][matmul]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : {EBB_F64, EBB_F32, EBB_BF16}) {
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt));
      double tol = dt == EBB_F64 ? 1e-12 : dt == EBB_F32 ? 1e-5 : 3e-2;
      // 2-D
      Tensor a = make(dev, dt, {5, 7}, values(35, 1)), b = make(dev, dt, {7, 3}, values(21, 2)), c;
      EBB_REQUIRE_OK(ebb_op_matmul(a, b, c.out()));
      CHECK(shape_of(c) == std::vector<int64_t>{5, 3});
      CHECK(dtype_of(c) == dt);
      EBB_CHECK_CLOSE(read(c), ref_matmul(read(a), read(b), 1, 5, 7, 3, false, false), tol, tol);
      // batched, with b shared by every batch entry (broadcast)
      Tensor ba = make(dev, dt, {2, 4, 5, 7}, values(280, 3)), bc;
      EBB_REQUIRE_OK(ebb_op_matmul(ba, b, bc.out()));
      CHECK(shape_of(bc) == std::vector<int64_t>{2, 4, 5, 3});
      EBB_CHECK_CLOSE(read(bc), ref_matmul(read(ba), read(b), 8, 5, 7, 3, false, true), tol, tol);
      // batch dims broadcast against each other: [2,1,5,7] @ [3,7,3] -> [2,3,5,3]
      Tensor x = make(dev, dt, {2, 1, 5, 7}, values(70, 4)), y = make(dev, dt, {3, 7, 3}, values(63, 5)), xy;
      EBB_REQUIRE_OK(ebb_op_matmul(x, y, xy.out()));
      CHECK(shape_of(xy) == std::vector<int64_t>{2, 3, 5, 3});
      auto xv = read(x), yv = read(y), got = read(xy);
      for (int p = 0; p < 2; p++)
        for (int q = 0; q < 3; q++) {
          std::vector<double> xa(xv.begin() + p * 35, xv.begin() + (p + 1) * 35), yb(yv.begin() + q * 21, yv.begin() + (q + 1) * 21);
          auto want = ref_matmul(xa, yb, 1, 5, 7, 3, false, false);
          std::vector<double> part(got.begin() + (p * 3 + q) * 15, got.begin() + (p * 3 + q + 1) * 15);
          EBB_CHECK_CLOSE(part, want, tol, tol);
        }
      // transposed operands (views) are used as they are
      Tensor at, bt, c2, a_t, b_t;
      EBB_REQUIRE_OK(ebb_tensor_transpose(a, 0, 1, at.out()));   // [7,5]
      EBB_REQUIRE_OK(ebb_tensor_contiguous(at, a_t.out()));      // [7,5] contiguous
      EBB_REQUIRE_OK(ebb_tensor_transpose(a_t, 0, 1, bt.out())); // [5,7] view of a transpose
      EBB_REQUIRE_OK(ebb_op_matmul(bt, b, c2.out()));
      EBB_CHECK_CLOSE(read(c2), read(c), tol, tol);
    }
  // empty inner dim gives zeros; empty result is fine
  Tensor a = make(0, EBB_F32, {3, 0}, {}), b = make(0, EBB_F32, {0, 2}, {}), c;
  EBB_REQUIRE_OK(ebb_op_matmul(a, b, c.out()));
  CHECK(read(c) == std::vector<double>(6, 0.0));
  a.reset(), b.reset(), c.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("reduce and matmul: gradcheck of every backward", "[ops][reduce][matmul][gradcheck]") {
  EbbSession session;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO(dev_name(dev));
    std::vector<GcInput> in{{{2, 3, 4}, values(24, 51)}};
    for (bool keep : {false, true}) {
      int dims[2] = {0, 2};
      EBB_CHECK_GRADCHECK(
          dev, in, [&](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_sum(x[0], dims, 2, keep, o); },
          [&](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_sum_backward(g, x[0], dims, 2, keep, &gr[0]);
          });
      EBB_CHECK_GRADCHECK(
          dev, in, [&](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_mean(x[0], dims + 1, 1, keep, o); },
          [&](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_mean_backward(g, x[0], dims + 1, 1, keep, &gr[0]);
          });
      EBB_CHECK_GRADCHECK(
          dev, in, [&](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_amax(x[0], dims, 1, keep, o); },
          [&](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *y, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_amax_backward(g, x[0], y, dims, 1, keep, &gr[0]);
          });
      EBB_CHECK_GRADCHECK(
          dev, in,
          [&](const GcInputs &x, ebb_tensor_t **o) {
            Tensor ix;
            return ebb_op_max_dim(x[0], -1, keep, o, ix.out());
          },
          [&](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
            Tensor v, ix;
            ebb_status st = ebb_op_max_dim(x[0], -1, keep, v.out(), ix.out());
            return st ? st : ebb_op_max_dim_backward(g, x[0], ix, -1, keep, &gr[0]);
          });
    }
    // matmul: 2-D, and batched with a broadcast operand (its gradient sums over the batch)
    for (auto shapes : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{{{3, 4}, {4, 2}}, {{2, 3, 4}, {4, 2}}, {{3, 4}, {2, 4, 2}}}) {
      std::vector<GcInput> mm{{shapes.first, values(numel_of(shapes.first), 61)}, {shapes.second, values(numel_of(shapes.second), 62)}};
      EBB_CHECK_GRADCHECK(
          dev, mm, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_matmul(x[0], x[1], o); },
          [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
            return ebb_op_matmul_backward(g, x[0], x[1], &gr[0], &gr[1]);
          });
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("reduce and matmul: bad inputs name the op, the argument and the shapes", "[ops][reduce][matmul][errors]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  Tensor t = make(0, EBB_F32, {2, 3}, values(6, 1)), o, ix, e;
  int bad = 2, dup[2] = {1, -1};
  EBB_CHECK_FAILS(ebb_op_sum(t, &bad, 1, false, o.out()), EBB_EINVAL, "dims[0] 2 is out of range");
  EBB_CHECK_FAILS(ebb_op_mean(t, dup, 2, false, o.out()), EBB_EINVAL, "listed twice");
  EBB_CHECK_FAILS(ebb_op_amax(t, nullptr, 1, false, o.out()), EBB_EINVAL, "dims array");
  EBB_CHECK_FAILS(ebb_op_max_dim(t, 0, false, nullptr, ix.out()), EBB_EINVAL, "ebb_op_max_dim: ");
  CHECK(ix.get() == nullptr);
  int64_t zs[2] = {2, 0};
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 2, zs, e.out()));
  int one = 1;
  EBB_CHECK_FAILS(ebb_op_amax(e, &one, 1, false, o.out()), EBB_EINVAL, "empty reduced dim");
  Tensor a = make(0, EBB_F32, {2, 3}, values(6, 2)), b = make(0, EBB_F32, {2, 3}, values(6, 3)), c = make(1, EBB_F32, {3, 2}, values(6, 4));
  Tensor v = make(0, EBB_F32, {3}, values(3, 5)), i = make(0, EBB_I64, {3, 2}, {1, 2, 3, 4, 5, 6});
  EBB_CHECK_FAILS(ebb_op_matmul(a, b, o.out()), EBB_EINVAL, "a (f32[2, 3] on device 0) and b (f32[2, 3] on device 0) do not fit: inner dims 3 and 2 differ");
  EBB_CHECK_FAILS(ebb_op_matmul(a, c, o.out()), EBB_EDEVICE, "b (f32[3, 2] on device 1) are on different devices");
  EBB_CHECK_FAILS(ebb_op_matmul(a, v, o.out()), EBB_EINVAL, "at least 2 dims");
  EBB_CHECK_FAILS(ebb_op_matmul(a, i, o.out()), EBB_EINVAL, "floating");
  Tensor ga;
  EBB_CHECK_FAILS(ebb_op_matmul_backward(a, a, b, ga.out(), nullptr), EBB_EINVAL, "does not match");
  EBB_CHECK_FAILS(ebb_op_sum_backward(v, t, &one, 1, false, ga.out()), EBB_EINVAL, "grad (f32[3] on device 0) does not have the forward output's shape; expected [2]");
  REQUIRE(o.get() == nullptr);
  t.reset(), e.reset(), a.reset(), b.reset(), c.reset(), v.reset(), i.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// Reductions along an empty dim, as PyTorch: sum gives zeros, mean NaN, amax and max_dim refuse
// (a maximum of no elements), naming the call made; along a non-empty dim of an empty tensor
// all give empty results. The backward functions give gradients of x's (empty) shape.
TEST_CASE("reduce: along an empty dim sum gives 0, mean NaN, amax and max_dim refuse", "[ops][reduce][empty]") {
  EbbSession session;
  int64_t zs[2] = {3, 0};
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x, o, ix, g, gx;
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 2, zs, x.out()));
    int one = 1, zero = 0;
    EBB_REQUIRE_OK(ebb_op_sum(x, &one, 1, false, o.out()));
    CHECK(shape_of(o) == std::vector<int64_t>{3});
    CHECK(read(o) == std::vector<double>(3, 0.0));
    EBB_REQUIRE_OK(ebb_op_sum(x, nullptr, 0, false, o.out()));
    CHECK(read(o) == std::vector<double>{0.0});
    EBB_REQUIRE_OK(ebb_op_mean(x, &one, 1, true, o.out()));
    CHECK(shape_of(o) == std::vector<int64_t>({3, 1}));
    for (double v : read(o)) CHECK(std::isnan(v));
    EBB_REQUIRE_OK(ebb_op_mean(x, nullptr, 0, false, o.out()));
    CHECK(std::isnan(read(o).at(0)));
    EBB_CHECK_FAILS(ebb_op_amax(x, &one, 1, false, o.out()), EBB_EINVAL, "ebb_op_amax: t (f32[3, 0] on ");
    EBB_CHECK_FAILS(ebb_op_amax(x, nullptr, 0, false, o.out()), EBB_EINVAL, "ebb_op_amax:");
    EBB_CHECK_FAILS(ebb_op_max_dim(x, 1, false, o.out(), ix.out()), EBB_EINVAL, "ebb_op_max_dim: t (f32[3, 0] on ");
    CHECK(std::string(ebb_last_error()).rfind("ebb_op_max_dim:", 0) == 0);
    // along dim 0 (3 elements each, but no outputs): empty results
    EBB_REQUIRE_OK(ebb_op_amax(x, &zero, 1, false, o.out()));
    CHECK(shape_of(o) == std::vector<int64_t>{0});
    EBB_REQUIRE_OK(ebb_op_max_dim(x, 0, true, o.out(), ix.out()));
    CHECK(shape_of(ix) == std::vector<int64_t>({1, 0}));
    // backward: gradients of x's shape
    EBB_REQUIRE_OK(ebb_tensor_ones(dev, EBB_F32, 1, zs, g.out()));
    EBB_REQUIRE_OK(ebb_op_sum_backward(g, x, &one, 1, false, gx.out()));
    CHECK(shape_of(gx) == std::vector<int64_t>({3, 0}));
    EBB_REQUIRE_OK(ebb_op_mean_backward(g, x, &one, 1, false, gx.out()));
    CHECK(shape_of(gx) == std::vector<int64_t>({3, 0}));
    Tensor y, gy;
    EBB_REQUIRE_OK(ebb_op_amax(x, &zero, 1, false, y.out()));
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 1, zs + 1, gy.out()));
    EBB_REQUIRE_OK(ebb_op_amax_backward(gy, x, y, &zero, 1, false, gx.out()));
    CHECK(shape_of(gx) == std::vector<int64_t>({3, 0}));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
