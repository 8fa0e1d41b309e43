// Elementwise ops against an f64 reference on the CPU and both emulated devices: binary ops with
// broadcasting (contiguous and strided inputs), unary and scalar ops, comparisons and where,
// type promotion, in-place variants and version counters, every backward formula through
// gradcheck, and the refused inputs.
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "ebb/trace.h"
#include "gradcheck.hpp"

using namespace ebb_test;

namespace {

using BinFn = ebb_status (*)(const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **);
using UnFn = ebb_status (*)(const ebb_tensor_t *, ebb_tensor_t **);
using UnBw = ebb_status (*)(const ebb_tensor_t *, const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **);
using BinBw = ebb_status (*)(const ebb_tensor_t *, const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **, ebb_tensor_t **);

struct Bin {
  const char *name;
  BinFn fn;
  BinBw bw;
  double (*ref)(double, double);
};

const Bin kBinary[] = {
    {"add", ebb_op_add, ebb_op_add_backward, [](double x, double y) { return x + y; }},
    {"sub", ebb_op_sub, ebb_op_sub_backward, [](double x, double y) { return x - y; }},
    {"mul", ebb_op_mul, ebb_op_mul_backward, [](double x, double y) { return x * y; }},
    {"div", ebb_op_div, ebb_op_div_backward, [](double x, double y) { return x / y; }},
};

struct Un {
  const char *name;
  UnFn fn;
  UnBw bw;
  double (*ref)(double);
  double lo, hi; // input domain
};

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double gelu_ref(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

const Un kUnary[] = {
    {"neg", ebb_op_neg, ebb_op_neg_backward, [](double x) { return -x; }, -2, 2},
    {"abs", ebb_op_abs, ebb_op_abs_backward, [](double x) { return std::fabs(x); }, -2, 2},
    {"exp", ebb_op_exp, ebb_op_exp_backward, [](double x) { return std::exp(x); }, -2, 2},
    {"log", ebb_op_log, ebb_op_log_backward, [](double x) { return std::log(x); }, 0.2, 3},
    {"sqrt", ebb_op_sqrt, ebb_op_sqrt_backward, [](double x) { return std::sqrt(x); }, 0.2, 3},
    {"sin", ebb_op_sin, ebb_op_sin_backward, [](double x) { return std::sin(x); }, -3, 3},
    {"cos", ebb_op_cos, ebb_op_cos_backward, [](double x) { return std::cos(x); }, -3, 3},
    {"tanh", ebb_op_tanh, ebb_op_tanh_backward, [](double x) { return std::tanh(x); }, -2, 2},
    {"sigmoid", ebb_op_sigmoid, ebb_op_sigmoid_backward, sigmoid_ref, -4, 4},
    {"relu", ebb_op_relu, ebb_op_relu_backward, [](double x) { return x > 0 ? x : 0.0; }, -2, 2},
    {"gelu", ebb_op_gelu, ebb_op_gelu_backward, gelu_ref, -3, 3},
};

// Tolerances per dtype for results rounded once from f64.
double rtol_of(ebb_dtype dt) { return dt == EBB_F64 ? 1e-14 : dt == EBB_F32 ? 2e-7 : dt == EBB_F16 ? 1e-3 : 8e-3; }

std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> broadcast_cases() {
  return {{{3, 4}, {3, 4}}, {{3, 1}, {1, 4}}, {{2, 3, 4}, {4}}, {{5}, {}}, {{2, 1, 3}, {4, 1}}, {{0, 3}, {3}}, {{}, {}}};
}

} // namespace

TEST_CASE("elementwise: binary ops with broadcasting match the f64 reference", "[ops][elementwise]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : {EBB_F32, EBB_F64, EBB_BF16})
      for (auto &c : broadcast_cases())
        for (const Bin &op : kBinary) {
          INFO(dev_name(dev) << " " << ebb_dtype_name(dt) << " " << op.name);
          Tensor a = make(dev, dt, c.first, values(numel_of(c.first), 1, -2, 2));
          auto bv = values(numel_of(c.second), 2, 0.5, 2); // away from 0 for div
          Tensor b = make(dev, dt, c.second, bv), r;
          EBB_REQUIRE_OK(op.fn(a, b, r.out()));
          auto oshape = broadcast_shape(c.first, c.second);
          REQUIRE(shape_of(r) == oshape);
          CHECK(dtype_of(r) == dt);
          auto av = read(a), bb = read(b);
          std::vector<double> want((size_t)numel_of(oshape));
          for (size_t i = 0; i < want.size(); i++) {
            double x = av[(size_t)broadcast_index((int64_t)i, oshape, c.first)];
            double y = bb[(size_t)broadcast_index((int64_t)i, oshape, c.second)];
            want[i] = op.ref(x, y);
          }
          EBB_CHECK_CLOSE(read(r), want, 0.0, rtol_of(dt));
        }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: small same-shape CPU operands give the kernel's results exactly", "[ops][elementwise]") {
  // Up to 16 elements of one floating dtype and shape, contiguous, are computed without a
  // launch on the CPU; the same values as the head of a 33-element tensor go through the kernel.
  EbbSession session;
  for (ebb_dtype dt : {EBB_F32, EBB_F64})
    for (const std::vector<int64_t> &shape : std::vector<std::vector<int64_t>>{{}, {1}, {2, 3}, {16}, {17}})
      for (const Bin &op : kBinary) {
        INFO(ebb_dtype_name(dt) << " " << op.name << " numel " << numel_of(shape));
        int64_t n = numel_of(shape), big = 33;
        auto av = values(big, 3, -2, 2), bv = values(big, 4, 0.5, 2);
        Tensor a = make(EBB_DEVICE_CPU, dt, shape, std::vector<double>(av.begin(), av.begin() + n));
        Tensor b = make(EBB_DEVICE_CPU, dt, shape, std::vector<double>(bv.begin(), bv.begin() + n));
        Tensor ab = make(EBB_DEVICE_CPU, dt, {big}, av), bb = make(EBB_DEVICE_CPU, dt, {big}, bv), r, rb;
        EBB_REQUIRE_OK(op.fn(a, b, r.out()));
        EBB_REQUIRE_OK(op.fn(ab, bb, rb.out()));
        REQUIRE(shape_of(r) == shape);
        CHECK(dtype_of(r) == dt);
        auto got = read(r), want = read(rb);
        for (int64_t i = 0; i < n; i++) CHECK(got[(size_t)i] == want[(size_t)i]);
      }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: random shapes, broadcasts, transposes and slices match the reference", "[ops][elementwise][random]") {
  EbbSession session;
  uint64_t rng = 12345;
  auto next = [&](int n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng >> 33) % (uint64_t)n);
  };
  for (int dev : {EBB_DEVICE_CPU, 0})
    for (int iter = 0; iter < 150; iter++) {
      // an output shape of 0..4 dims, each input taking a suffix of it with some extents set to 1
      int nd = next(5);
      std::vector<int64_t> out;
      for (int d = 0; d < nd; d++) out.push_back(1 + next(4));
      auto input_shape = [&]() {
        size_t keep = (size_t)next(nd + 1);
        std::vector<int64_t> sh(out.end() - (long)keep, out.end());
        for (auto &e : sh)
          if (next(3) == 0) e = 1;
        return sh;
      };
      std::vector<int64_t> sa = input_shape(), sb = input_shape();
      ebb_dtype dts[3] = {EBB_F32, EBB_F64, EBB_I64};
      ebb_dtype da = dts[next(3)], db = dts[next(3)];
      const Bin &op = kBinary[next(3)]; // add, sub, mul
      INFO(dev_name(dev) << " iter " << iter << " " << op.name << " " << ebb_dtype_name(da) << " x " << ebb_dtype_name(db));
      // make each input non-contiguous at random: built transposed and transposed back, or
      // sliced out of a wider tensor
      auto build = [&](const std::vector<int64_t> &sh, ebb_dtype dt, unsigned seed) {
        auto v = values(numel_of(sh), seed, -3, 3);
        if (dt == EBB_I64)
          for (auto &x : v) x = std::floor(x * 10);
        int mode = sh.size() >= 2 ? next(3) : 0;
        if (mode == 1) { // transpose of a transpose: the values of v, strides swapped
          std::vector<int64_t> ts(sh);
          std::swap(ts[0], ts[1]);
          std::vector<double> tv(v.size());
          int64_t inner = numel_of(sh) / (sh[0] * sh[1]);
          for (int64_t i = 0; i < sh[0]; i++)
            for (int64_t j = 0; j < sh[1]; j++)
              for (int64_t r = 0; r < inner; r++) tv[(size_t)((j * sh[0] + i) * inner + r)] = v[(size_t)((i * sh[1] + j) * inner + r)];
          Tensor base = make(dev, dt, ts, tv), t;
          EBB_REQUIRE_OK(ebb_tensor_transpose(base, 0, 1, t.out()));
          return std::make_pair(std::move(t), v);
        }
        if (mode == 2) { // every other column of a tensor twice as wide
          std::vector<int64_t> ws(sh);
          ws.back() *= 2;
          std::vector<double> wv((size_t)numel_of(ws), 99.0);
          int64_t last = sh.back();
          for (int64_t i = 0; i < numel_of(sh); i++) wv[(size_t)((i / last) * 2 * last + (i % last) * 2)] = v[(size_t)i];
          Tensor base = make(dev, dt, ws, wv), t;
          EBB_REQUIRE_OK(ebb_tensor_slice(base, -1, 0, ws.back(), 2, t.out()));
          return std::make_pair(std::move(t), v);
        }
        return std::make_pair(make(dev, dt, sh, v), v);
      };
      auto A = build(sa, da, 1000u + (unsigned)iter), B = build(sb, db, 2000u + (unsigned)iter);
      Tensor r;
      EBB_REQUIRE_OK(op.fn(A.first, B.first, r.out()));
      auto oshape = broadcast_shape(sa, sb);
      REQUIRE(shape_of(r) == oshape);
      ebb_dtype want_dt;
      EBB_REQUIRE_OK(ebb_op_promote(da, db, &want_dt));
      CHECK(dtype_of(r) == want_dt);
      auto av = read(A.first), bv = read(B.first);
      // the views hold the intended values (checks the test's construction and the copy path)
      auto rounded = [](std::vector<double> v, ebb_dtype dt) {
        if (dt == EBB_F32)
          for (auto &x : v) x = (double)(float)x;
        return v;
      };
      CHECK(av == rounded(A.second, da));
      CHECK(bv == rounded(B.second, db));
      std::vector<double> want((size_t)numel_of(oshape));
      for (size_t i = 0; i < want.size(); i++)
        want[i] = op.ref(av[(size_t)broadcast_index((int64_t)i, oshape, sa)], bv[(size_t)broadcast_index((int64_t)i, oshape, sb)]);
      if (want_dt == EBB_F32)
        for (auto &w : want) w = (double)(float)w;
      EBB_CHECK_CLOSE(read(r), want, 0.0, 0.0);
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: strided and broadcast views as inputs and the large contiguous f32 path", "[ops][elementwise]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto v = values(4 * 6, 3);
    Tensor a = make(dev, EBB_F64, {4, 6}, v), at, sl, r;
    EBB_REQUIRE_OK(ebb_tensor_transpose(a, 0, 1, at.out())); // [6,4]
    EBB_REQUIRE_OK(ebb_tensor_slice(a, 1, 0, 6, 2, sl.out())); // [4,3], stride 2
    Tensor row = make(dev, EBB_F32, {4}, {1, 2, 3, 4});
    EBB_REQUIRE_OK(ebb_op_mul(at, row, r.out())); // f64 * f32 -> f64
    CHECK(dtype_of(r) == EBB_F64);
    auto rv = read(r);
    for (int i = 0; i < 6; i++)
      for (int j = 0; j < 4; j++) CHECK(rv[(size_t)(i * 4 + j)] == v[(size_t)(j * 6 + i)] * (j + 1));
    Tensor s2;
    EBB_REQUIRE_OK(ebb_op_add(sl, sl, s2.out()));
    auto sv = read(s2);
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 3; j++) CHECK(sv[(size_t)(i * 3 + j)] == 2 * v[(size_t)(i * 6 + 2 * j)]);
    // the vectorised contiguous f32 loop
    const int64_t n = 100003;
    auto x = values(n, 4), y = values(n, 5);
    Tensor tx = make(dev, EBB_F32, {n}, x), ty = make(dev, EBB_F32, {n}, y), tz;
    EBB_REQUIRE_OK(ebb_op_sub(tx, ty, tz.out()));
    auto z = read(tz);
    for (int64_t i = 0; i < n; i++) REQUIRE(z[(size_t)i] == (double)((float)x[(size_t)i] - (float)y[(size_t)i]));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: on a device, contiguous f32, bf16 and f16 operands launch the f32 kernel and other layouts the generic one",
          "[ops][elementwise][kernels]") {
  EbbSession session;
  const int dev = 0;
  auto launches = [&](std::function<void()> f) {
    EBB_REQUIRE_OK(ebb_trace_enable(1024));
    f();
    EBB_REQUIRE_OK(ebb_dev_synchronize(dev));
    std::vector<ebb_trace_span> spans(1024);
    size_t n = 0;
    EBB_REQUIRE_OK(ebb_trace_snapshot(spans.data(), spans.size(), &n));
    ebb_trace_disable();
    std::vector<std::string> names;
    for (size_t i = 0; i < n; i++)
      if (spans[i].device == dev && std::string(spans[i].name).rfind("ebb.ops.", 0) == 0) names.emplace_back(spans[i].name);
    return names;
  };
  const int64_t n = 1001;  // not a multiple of 4: the GPU kernel's tail too
  auto x = values(n, 7), y = values(n, 8);
  for (ebb_dtype dt : {EBB_F32, EBB_BF16, EBB_F16}) {
    INFO(ebb_dtype_name(dt));
    Tensor a = make(dev, dt, {n}, x), b = make(dev, dt, {n}, y), ca = make(EBB_DEVICE_CPU, dt, {n}, x),
           cb = make(EBB_DEVICE_CPU, dt, {n}, y), r, cr;
    auto names = launches([&] { EBB_REQUIRE_OK(ebb_op_mul(a, b, r.out())); });
    REQUIRE(names.size() == 1);
    CHECK(names[0] == "ebb.ops.ew_f32");
    EBB_REQUIRE_OK(ebb_op_mul(ca, cb, cr.out()));
    CHECK(read(r) == read(cr));  // the CPU kernels serve both ids: the same values
  }
  Tensor a = make(dev, EBB_F32, {4, 6}, values(24, 9)), at, d = make(dev, EBB_F64, {n}, x), r1, r2, r3;
  EBB_REQUIRE_OK(ebb_tensor_transpose(a, 0, 1, at.out()));
  auto names = launches([&] {
    EBB_REQUIRE_OK(ebb_op_exp(at, r1.out()));  // strided
    EBB_REQUIRE_OK(ebb_op_exp(d, r2.out()));   // f64
    EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_F32, 1, &n, 2.0, r3.out()));  // fill
  });
  CHECK(names == std::vector<std::string>{"ebb.ops.ew", "ebb.ops.ew", "ebb.ops.ew"});
}

TEST_CASE("elementwise: unary and scalar ops match the f64 reference", "[ops][elementwise]") {
  EbbSession session;
  for (int dev : devices())
    for (ebb_dtype dt : {EBB_F32, EBB_F64, EBB_F16}) {
      for (const Un &op : kUnary) {
        INFO(dev_name(dev) << " " << ebb_dtype_name(dt) << " " << op.name);
        Tensor a = make(dev, dt, {3, 5}, values(15, 7, op.lo, op.hi)), r;
        EBB_REQUIRE_OK(op.fn(a, r.out()));
        CHECK(dtype_of(r) == dt);
        std::vector<double> want;
        for (double x : read(a)) want.push_back(op.ref(x));
        EBB_CHECK_CLOSE(read(r), want, dt == EBB_F64 ? 1e-13 : 1e-6, rtol_of(dt));
      }
      INFO(dev_name(dev) << " " << ebb_dtype_name(dt) << " scalar ops");
      Tensor a = make(dev, dt, {7}, {-3, -1.5, -0.5, 0, 0.5, 2, 4}), r;
      auto av = read(a);
      auto check = [&](ebb_status st, std::function<double(double)> f) {
        EBB_REQUIRE_OK(st);
        std::vector<double> want;
        for (double x : av) want.push_back(f(x));
        EBB_CHECK_CLOSE(read(r), want, 0.0, rtol_of(dt));
      };
      check(ebb_op_add_scalar(a, 1.25, r.out()), [](double x) { return x + 1.25; });
      check(ebb_op_sub_scalar(a, 1.25, r.out()), [](double x) { return x - 1.25; });
      check(ebb_op_mul_scalar(a, -2.0, r.out()), [](double x) { return x * -2.0; });
      check(ebb_op_div_scalar(a, 4.0, r.out()), [](double x) { return x / 4.0; });
      check(ebb_op_pow_scalar(a, 2.0, r.out()), [](double x) { return x * x; });
      check(ebb_op_clamp(a, -1.0, 1.0, r.out()), [](double x) { return x < -1 ? -1.0 : x > 1 ? 1.0 : x; });
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: type promotion follows the documented table", "[ops][elementwise][dtype]") {
  EbbSession session;
  ebb_dtype r;
  struct P {
    ebb_dtype a, b, r;
  } table[] = {{EBB_F32, EBB_F32, EBB_F32}, {EBB_BOOL, EBB_I64, EBB_I64}, {EBB_I64, EBB_F16, EBB_F16}, {EBB_BF16, EBB_F16, EBB_F32},
               {EBB_F32, EBB_F64, EBB_F64},  {EBB_BF16, EBB_F32, EBB_F32}, {EBB_BOOL, EBB_BOOL, EBB_BOOL}, {EBB_BOOL, EBB_BF16, EBB_BF16}};
  for (auto &p : table) {
    EBB_REQUIRE_OK(ebb_op_promote(p.a, p.b, &r));
    CHECK(r == p.r);
    EBB_REQUIRE_OK(ebb_op_promote(p.b, p.a, &r));
    CHECK(r == p.r);
  }
  EBB_CHECK_FAILS(ebb_op_promote((ebb_dtype)7, EBB_F32, &r), EBB_EINVAL, "ebb_op_promote");
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor i = make(dev, EBB_I64, {3}, {1, 2, 3}), b = make(dev, EBB_BOOL, {3}, {1, 0, 1}), f = make(dev, EBB_F32, {3}, {0.5, 0.5, 0.5}),
           o;
    EBB_REQUIRE_OK(ebb_op_add(i, b, o.out()));
    CHECK(dtype_of(o) == EBB_I64);
    CHECK(read(o) == std::vector<double>{2, 2, 4});
    EBB_REQUIRE_OK(ebb_op_mul(i, f, o.out()));
    CHECK(dtype_of(o) == EBB_F32);
    EBB_REQUIRE_OK(ebb_op_div(i, i, o.out())); // true division
    CHECK(dtype_of(o) == EBB_F32);
    CHECK(read(o) == std::vector<double>{1, 1, 1});
    EBB_REQUIRE_OK(ebb_op_add_scalar(i, 2.0, o.out()));
    CHECK(dtype_of(o) == EBB_I64);
    EBB_REQUIRE_OK(ebb_op_add_scalar(i, 2.5, o.out()));
    CHECK(dtype_of(o) == EBB_F32);
    CHECK(read(o) == std::vector<double>{3.5, 4.5, 5.5});
    EBB_REQUIRE_OK(ebb_op_exp(i, o.out()));
    CHECK(dtype_of(o) == EBB_F32);
    EBB_REQUIRE_OK(ebb_op_neg(i, o.out()));
    CHECK(dtype_of(o) == EBB_I64);
    EBB_CHECK_FAILS(ebb_op_add(b, b, o.out()), EBB_EINVAL, "both bool");
    EBB_CHECK_FAILS(ebb_op_neg(b, o.out()), EBB_EINVAL, "bool");
    // i64 arithmetic stays exact beyond 2^53
    Tensor big = make(dev, EBB_I64, {1}, {0}), one = make(dev, EBB_I64, {1}, {1});
    EBB_REQUIRE_OK(ebb_tensor_fill_(big, 9007199254740993.0)); // rounds to 2^53 as a double
    EBB_REQUIRE_OK(ebb_op_add_scalar(big, 1.0, o.out()));
    int64_t got = 0;
    EBB_REQUIRE_OK(ebb_tensor_to_host(o, &got, 8));
    CHECK(got == (int64_t)9007199254740992LL + 1);
    Tensor q;
    EBB_REQUIRE_OK(ebb_op_mul(o, one, q.out()));
    EBB_REQUIRE_OK(ebb_tensor_to_host(q, &got, 8));
    CHECK(got == (int64_t)9007199254740993LL);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: comparisons give bool and where selects with broadcasting", "[ops][elementwise]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor a = make(dev, EBB_F32, {2, 3}, {1, 2, 3, 4, 5, 6}), b = make(dev, EBB_I64, {3}, {2, 2, 5}), r;
    struct C {
      BinFn fn;
      std::vector<double> want;
    } cases[] = {{ebb_op_eq, {0, 1, 0, 0, 0, 0}}, {ebb_op_ne, {1, 0, 1, 1, 1, 1}}, {ebb_op_lt, {1, 0, 1, 0, 0, 0}},
                 {ebb_op_le, {1, 1, 1, 0, 0, 0}}, {ebb_op_gt, {0, 0, 0, 1, 1, 1}}, {ebb_op_ge, {0, 1, 0, 1, 1, 1}}};
    for (auto &c : cases) {
      EBB_REQUIRE_OK(c.fn(a, b, r.out()));
      CHECK(dtype_of(r) == EBB_BOOL);
      CHECK(read(r) == c.want);
    }
    Tensor cond, w, zero = make(dev, EBB_F64, {}, {-1});
    EBB_REQUIRE_OK(ebb_op_gt(a, b, cond.out()));
    EBB_REQUIRE_OK(ebb_op_where(cond, a, zero, w.out()));
    CHECK(dtype_of(w) == EBB_F64);
    CHECK(read(w) == std::vector<double>{-1, -1, -1, 4, 5, 6});
    EBB_CHECK_FAILS(ebb_op_where(a, a, zero, w.out()), EBB_EINVAL, "has dtype f32; expected bool");
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: in-place add_ and mul_ write through views and bump the version", "[ops][elementwise][inplace]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor a = make(dev, EBB_F32, {2, 3}, {1, 2, 3, 4, 5, 6}), row = make(dev, EBB_F32, {3}, {10, 20, 30}), v;
    EBB_REQUIRE_OK(ebb_tensor_select(a, 0, 1, v.out()));
    uint64_t ver0, ver;
    EBB_REQUIRE_OK(ebb_tensor_version(a, &ver0));
    EBB_REQUIRE_OK(ebb_op_add_(a, row));
    EBB_REQUIRE_OK(ebb_op_mul_(v, row)); // through a view: the base sees it
    EBB_REQUIRE_OK(ebb_tensor_version(a, &ver));
    CHECK(ver == ver0 + 2);
    CHECK(read(a) == std::vector<double>{11, 22, 33, 140, 500, 1080});
    EBB_REQUIRE_OK(ebb_op_add_(a, a)); // aliasing the same elements is fine
    CHECK(read(a) == std::vector<double>{22, 44, 66, 280, 1000, 2160});
    // refused: a result of another shape, another dtype, or an expanded destination
    Tensor col = make(dev, EBB_F32, {2, 1}, {1, 2}), i = make(dev, EBB_I64, {3}, {1, 2, 3}), f64 = make(dev, EBB_F64, {3}, {1, 1, 1}), ex;
    EBB_CHECK_FAILS(ebb_op_add_(row, col), EBB_EINVAL, "cannot change dst's shape");
    EBB_CHECK_FAILS(ebb_op_add_(i, row), EBB_EINVAL, "in place");
    EBB_CHECK_FAILS(ebb_op_mul_(row, f64), EBB_EINVAL, "f64");
    int64_t es[2] = {4, 3};
    EBB_REQUIRE_OK(ebb_tensor_expand(row, 2, es, ex.out()));
    EBB_CHECK_FAILS(ebb_op_add_(ex, row), EBB_EINVAL, "expanded");
    EBB_REQUIRE_OK(ebb_tensor_version(a, &ver));
    CHECK(ver == ver0 + 3);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: gradcheck of every binary backward, with broadcasting", "[ops][elementwise][gradcheck]") {
  EbbSession session;
  for (int dev : ebb_test_existing({EBB_DEVICE_CPU, 0, 1}))
    for (const Bin &op : kBinary)
      for (auto shapes : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{{{2, 3}, {2, 3}}, {{2, 3}, {3}}, {{3, 1}, {2, 1, 4}}}) {
        INFO(dev_name(dev) << " " << op.name);
        std::vector<GcInput> in{{shapes.first, values(numel_of(shapes.first), 11, -2, 2)},
                                {shapes.second, values(numel_of(shapes.second), 12, 0.5, 2)}};
        BinFn f = op.fn;
        BinBw bw = op.bw;
        EBB_CHECK_GRADCHECK(
            dev, in, [f](const GcInputs &x, ebb_tensor_t **o) { return f(x[0], x[1], o); },
            [bw](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
              return bw(g, x[0], x[1], &gr[0], &gr[1]);
            });
      }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: gradcheck of every unary, scalar and where backward", "[ops][elementwise][gradcheck]") {
  EbbSession session;
  for (int dev : {EBB_DEVICE_CPU, ebb_test_device_count() - 1}) { // device 1 where it exists
    for (const Un &op : kUnary) {
      INFO(dev_name(dev) << " " << op.name);
      auto v = values(6, 21, op.lo, op.hi);
      for (auto &x : v)
        if (std::fabs(x) < 0.05) x += 0.1; // keep abs and relu away from their kink
      UnFn f = op.fn;
      UnBw bw = op.bw;
      EBB_CHECK_GRADCHECK(
          dev, {{{2, 3}, v}}, [f](const GcInputs &x, ebb_tensor_t **o) { return f(x[0], o); },
          [bw](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *y, std::vector<ebb_tensor_t *> &gr) {
            return bw(g, x[0], y, &gr[0]);
          });
    }
    INFO(dev_name(dev) << " scalar ops");
    std::vector<GcInput> in{{{5}, {0.3, 0.7, 1.2, 1.9, 2.5}}};
    EBB_CHECK_GRADCHECK(
        dev, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_add_scalar(x[0], 3.0, o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_add_scalar_backward(g, x[0], 3.0, &gr[0]);
        });
    EBB_CHECK_GRADCHECK(
        dev, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_mul_scalar(x[0], -1.5, o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_mul_scalar_backward(g, x[0], -1.5, &gr[0]);
        });
    EBB_CHECK_GRADCHECK(
        dev, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_div_scalar(x[0], 4.0, o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_div_scalar_backward(g, x[0], 4.0, &gr[0]);
        });
    EBB_CHECK_GRADCHECK(
        dev, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_pow_scalar(x[0], 2.5, o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_pow_scalar_backward(g, x[0], 2.5, &gr[0]);
        });
    EBB_CHECK_GRADCHECK(
        dev, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_clamp(x[0], 0.5, 2.0, o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_clamp_backward(g, x[0], 0.5, 2.0, &gr[0]);
        });
    // where: cond is a fixed input without gradient; a broadcasts against b
    std::vector<GcInput> win{{{2, 3}, {1, 0, 1, 0, 0, 1}, EBB_BOOL, false}, {{2, 3}, values(6, 31)}, {{3}, values(3, 32)}};
    EBB_CHECK_GRADCHECK(
        dev, win, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_where(x[0], x[1], x[2], o); },
        [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
          return ebb_op_where_backward(g, x[0], x[1], x[2], &gr[1], &gr[2]);
        });
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

namespace {
struct Gate {
  std::atomic<int> *open;
  std::atomic<int> *passed;
};
// Holds its stream until *open (10 s at most, so a broken test fails instead of hanging).
void gate_kernel(void *p) {
  auto *g = static_cast<Gate *>(p);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!g->open->load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  g->passed->store(1, std::memory_order_release);
}
} // namespace

TEST_CASE("elementwise: device ops enqueue on the current stream and return without waiting for it", "[ops][elementwise][streams]") {
  EbbSession session;
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.cpu_kernels) EBB_SKIP("the gate kernel is a CPU function");
  const ebb_kernel_t *k = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("ops_test.gate", sizeof(Gate), gate_kernel, nullptr, &k));
  Tensor a = make(0, EBB_F32, {1000}, values(1000, 1)), b = make(0, EBB_F32, {1000}, values(1000, 2)), c, d;
  std::atomic<int> open{0}, passed{0};
  Gate g{&open, &passed};
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_current(0, &s));
  EBB_REQUIRE_OK(ebb_stream_launch(s, k, &g, nullptr));
  // The stream is held: the ops below can only be enqueued behind the gate.
  EBB_REQUIRE_OK(ebb_op_mul(a, b, c.out()));
  EBB_REQUIRE_OK(ebb_op_exp(c, d.out()));
  CHECK(passed.load(std::memory_order_acquire) == 0); // returned while the gate was still closed
  open.store(1, std::memory_order_release);
  auto av = read(a), bv = read(b), dv = read(d);
  CHECK(passed.load() == 1);
  for (size_t i = 0; i < av.size(); i++) CHECK(std::fabs(dv[i] - std::exp((double)(float)(av[i] * bv[i]))) < 1e-5);
  a.reset(), b.reset(), c.reset(), d.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: gradcheck reports a wrong backward formula", "[ops][elementwise][gradcheck]") {
  EbbSession session;
  std::vector<GcInput> in{{{2, 2}, values(4, 5, 0.5, 2)}, {{2, 2}, values(4, 6, 0.5, 2)}};
  // mul's forward with add's backward: the gradients are wrong and must be reported
  GcResult r = gradcheck(
      0, in, [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_mul(x[0], x[1], o); },
      [](const ebb_tensor_t *g, const GcInputs &x, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &gr) {
        return ebb_op_add_backward(g, x[0], x[1], &gr[0], &gr[1]);
      });
  CHECK(!r.ok);
  CHECK(r.report.find("analytic") != std::string::npos);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("elementwise: bad inputs name the op, the argument and the shapes", "[ops][elementwise][errors]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  Tensor a = make(0, EBB_F32, {2, 3}, values(6, 1)), b = make(0, EBB_F32, {4}, values(4, 2)), c = make(1, EBB_F32, {2, 3}, values(6, 3));
  Tensor cpu = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, values(6, 4)), i = make(0, EBB_I64, {2, 3}, {1, 2, 3, 4, 5, 6}), o, g;
  EBB_CHECK_FAILS(ebb_op_add(a, b, o.out()), EBB_EINVAL, "a (f32[2, 3] on device 0) and b (f32[4] on device 0) do not broadcast");
  EBB_CHECK_FAILS(ebb_op_mul(a, c, o.out()), EBB_EDEVICE, "ebb_op_mul: b (f32[2, 3] on device 1) and a (f32[2, 3] on device 0) are on different devices");
  EBB_CHECK_FAILS(ebb_op_sub(cpu, a, o.out()), EBB_EDEVICE, "device 0");
  EBB_CHECK_FAILS(ebb_op_div(a, nullptr, o.out()), EBB_EINVAL, "ebb_op_div: b is NULL");
  EBB_CHECK_FAILS(ebb_op_exp(a, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_op_clamp(a, 2, 1, o.out()), EBB_EINVAL, "lo 2 and hi 1");
  ebb_tensor_t *dead = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_clone(a, &dead));
  EBB_REQUIRE_OK(ebb_tensor_release(dead));
  EBB_CHECK_FAILS(ebb_op_add(a, dead, o.out()), EBB_EFREED, "ebb_op_add: b");
  EBB_CHECK_FAILS(ebb_op_relu(dead, o.out()), EBB_EFREED, "ebb_op_relu");
  // backward: wrong grad shape, gradient of an integer input, nothing requested
  Tensor g_bad = make(0, EBB_F32, {3, 2}, values(6, 5)), ga, gb;
  EBB_CHECK_FAILS(ebb_op_mul_backward(g_bad, a, a, ga.out(), gb.out()), EBB_EINVAL, "grad (f32[3, 2] on device 0) does not have the forward output's shape; expected [2, 3]");
  EBB_CHECK_FAILS(ebb_op_add_backward(a, i, a, ga.out(), nullptr), EBB_EINVAL, "i64");
  EBB_CHECK_FAILS(ebb_op_add_backward(a, a, a, nullptr, nullptr), EBB_EINVAL, "both NULL");
  EBB_CHECK_FAILS(ebb_op_exp_backward(g_bad, a, a, ga.out()), EBB_EINVAL, "grad (f32[3, 2] on device 0) does not have the shape of x (f32[2, 3] on device 0)");
  EBB_CHECK_FAILS(ebb_op_tanh_backward(a, a, nullptr, ga.out()), EBB_EINVAL, "y is NULL");
  EBB_CHECK_FAILS(ebb_op_relu_backward(c, a, nullptr, ga.out()), EBB_EDEVICE, "grad (f32[2, 3] on device 1) and x (f32[2, 3] on device 0) are on different devices");
  Tensor bigger = make(0, EBB_F32, {2, 3, 2}, values(12, 6));
  EBB_CHECK_FAILS(ebb_op_sum_to_shape(a, 3, shape_of(bigger).data(), o.out()), EBB_EINVAL, "target of 3 dims");
  REQUIRE(o.get() == nullptr);
  a.reset(), b.reset(), c.reset(), cpu.reset(), i.reset(), g_bad.reset(), bigger.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}
