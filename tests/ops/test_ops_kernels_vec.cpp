// White-box tests of the CPU kernels' vector loops (ops/kernels_cpu_vec.h): every table this
// processor can run (baseline, AVX2, AVX-512) against ops_math.h's f64 formula, op by op, on
// chunks whose length is not a multiple of any vector width; the exact ops bit for bit, the
// transcendental ones within a few ulp; the tables agreeing with each other; in place; the
// conversions; and the sums' fixed order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "ops_kernels.h"
#include "ops_math.h"
extern "C" {
#include "kernels_cpu_vec.h"
}

namespace {

std::vector<const ebb__vec_ops *> tables() {
  std::vector<const ebb__vec_ops *> t = {&ebb__vec_baseline};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) t.push_back(&ebb__vec_avx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    t.push_back(&ebb__vec_avx512);
#endif
  return t;
}

// Distance in f32 ulps between got and the f64 value want (relative to want's f32 neighbours).
double ulps(float got, double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0 : 1e30;
  if (std::isinf(want)) return got == (float)want ? 0 : 1e30;
  float w = (float)want;
  double u = std::fabs((double)std::nextafter(w, INFINITY) - (double)w);
  if (u == 0 || std::isinf(u)) u = std::fabs((double)w - (double)std::nextafter(w, -INFINITY));
  return std::fabs((double)got - want) / u;
}

constexpr int64_t kN = 1003; // not a multiple of 4, 8 or 16

std::vector<float> inputs(double lo, double hi, uint32_t seed) {
  std::vector<float> x(kN);
  for (int64_t i = 0; i < kN; i++) {
    seed = seed * 1664525u + 1013904223u;
    x[i] = (float)(lo + (hi - lo) * (seed >> 8) * 0x1p-24);
  }
  return x;
}

struct Case {
  int op;
  const char *name;
  double lo, hi;   // input range
  double max_ulp;  // 0: bit-exact against the f64 formula rounded once
  double abs_tol;  // besides ulps, an absolute bound (where the result cancels to near zero)
  double s0, s1;
};

} // namespace

TEST_CASE("vec: each table's f32 ops match ops_math.h's f64 formula", "[ops][internal][vec]") {
  const Case cases[] = {
      {EBB__EW_NEG, "neg", -5, 5, 0, 0, 0, 0},
      {EBB__EW_ABS, "abs", -5, 5, 0, 0, 0, 0},
      {EBB__EW_SQRT, "sqrt", 0, 100, 0, 0, 0, 0},
      {EBB__EW_RELU, "relu", -5, 5, 0, 0, 0, 0},
      {EBB__EW_SQUARE, "square", -5, 5, 0, 0, 0, 0},
      {EBB__EW_SIGN, "sign", -5, 5, 0, 0, 0, 0},
      {EBB__EW_ADDS, "add_scalar f32", -5, 5, 0, 0, 0.5, 0},
      {EBB__EW_ADDS, "add_scalar f64", -5, 5, 0, 0, 0.1, 0},
      {EBB__EW_MULS, "mul_scalar f64", -5, 5, 0, 0, 0.1, 0},
      {EBB__EW_DIVS, "div_scalar f64", -5, 5, 0, 0, 3.0, 0},
      {EBB__EW_RSUBS, "rsub_scalar", -5, 5, 0, 0, 0.3, 0},
      {EBB__EW_RDIVS, "rdiv_scalar", 0.5, 5, 0, 0, 0.3, 0},
      {EBB__EW_CLAMP, "clamp", -5, 5, 0, 0, -0.1, 0.7},
      {EBB__EW_CLAMP_MASK, "clamp_mask", -5, 5, 0, 0, -0.1, 0.7},
      {EBB__EW_LT_S, "lt_scalar", -1, 1, 0, 0, 0.1, 0},
      {EBB__EW_GT_S, "gt_scalar", -1, 1, 0, 0, 0.1, 0},
      {EBB__EW_POWS, "pow 2", -5, 5, 0, 0, 2.0, 0},
      {EBB__EW_POWS, "pow 1.5", 0, 5, 2, 0, 1.5, 0},
      {EBB__EW_EXP, "exp", -80, 80, 2, 0, 0, 0},
      {EBB__EW_LOG, "log", 1e-3, 1e3, 2, 0, 0, 0},
      {EBB__EW_SIN, "sin", -10, 10, 2, 1e-7, 0, 0},
      {EBB__EW_COS, "cos", -10, 10, 2, 1e-7, 0, 0},
      {EBB__EW_TANH, "tanh", -10, 10, 2, 0, 0, 0},
      {EBB__EW_SIGMOID, "sigmoid", -30, 30, 3, 0, 0, 0},
      {EBB__EW_GELU, "gelu (|x| < 1.4)", -1.4, 1.4, 4, 1e-7, 0, 0},
      {EBB__EW_GELU, "gelu", -12, 12, 4, 1e-7, 0, 0},
      {EBB__EW_GELU, "gelu (x/sqrt 2 near -1, 1 + erf cancelling)", -1.41, -1.40, 4, 1e-7, 0, 0},
      {EBB__EW_GELU, "gelu (erf's tail, |x/sqrt 2| near 4)", -5.8, -5.5, 4, 1e-7, 0, 0},
      {EBB__EW_GELU_GRAD, "gelu_grad", -12, 12, 4, 2e-7, 0, 0},
  };
  for (const ebb__vec_ops *t : tables()) {
    for (const Case &c : cases) {
      INFO(t->name << " " << c.name);
      std::vector<float> x = inputs(c.lo, c.hi, (uint32_t)c.op * 7u + 1u), o(kN);
      t->ew(c.op, o.data(), x.data(), nullptr, nullptr, kN, c.s0, c.s1);
      double worst = 0;
      for (int64_t i = 0; i < kN; i++) {
        double want = ebb__ew_f(c.op, x[i], 0, 0, c.s0, c.s1);
        if (c.max_ulp == 0) {
          float w = (float)want;
          if (std::memcmp(&o[i], &w, 4) != 0) worst = 1e30;
        } else if (std::fabs(o[i] - want) > c.abs_tol) {
          double u = ulps(o[i], want);
          worst = u > worst ? u : worst;
        }
      }
      CHECK(worst <= c.max_ulp);
    }
  }
}

TEST_CASE("vec: gelu's one-pass backward is the gradient's f32 loop times grad, bit for bit, in place too",
          "[ops][internal][vec]") {
  // grad * gelu'(x): within the gradient's bounds of the f64 formula (4 ulp, or 2e-7 times
  // |grad|, plus the product's rounding) and, with the multiply rounded once, exactly the two
  // passes it replaces (GELU_GRAD, then MUL)
  for (const ebb__vec_ops *t : tables()) {
    INFO(t->name);
    std::vector<float> g = inputs(-3, 3, 21), x = inputs(-12, 12, 22), o(kN), d(kN), two(kN);
    g[5] = 0.0f, x[9] = NAN, x[10] = INFINITY, x[11] = -INFINITY, x[12] = 0.0f;
    t->ew(EBB__EW_GELU_BWD, o.data(), g.data(), x.data(), nullptr, kN, 0, 0);
    t->ew(EBB__EW_GELU_GRAD, d.data(), x.data(), nullptr, nullptr, kN, 0, 0);
    t->ew(EBB__EW_MUL, two.data(), g.data(), d.data(), nullptr, kN, 0, 0);
    std::vector<float> in_g = g, in_x = x;
    t->ew(EBB__EW_GELU_BWD, in_g.data(), in_g.data(), x.data(), nullptr, kN, 0, 0);
    t->ew(EBB__EW_GELU_BWD, in_x.data(), g.data(), in_x.data(), nullptr, kN, 0, 0);
    bool same = true, close = true;
    for (int64_t i = 0; i < kN; i++) {
      auto eq = [](float a, float b) { return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)); };
      same = same && eq(o[i], two[i]) && eq(in_g[i], o[i]) && eq(in_x[i], o[i]);
      double want = ebb__ew_f(EBB__EW_GELU_BWD, g[i], x[i], 0, 0, 0);
      if (std::isnan(want)) close = close && std::isnan(o[i]);
      else close = close && (std::fabs(o[i] - want) <= 2e-7 * std::fabs(g[i]) + 1e-45 || ulps(o[i], want) <= 5);
    }
    CHECK(same);
    CHECK(close);
  }
}

TEST_CASE("vec: gelu and its gradient at NaN, infinities, zeros, subnormals and huge inputs", "[ops][internal][vec]") {
  // as the f64 formula: NaN stays NaN; gelu(+inf) = +inf; gelu(-inf) and gelu_grad(+-inf) are
  // NaN there too (inf times a zero); the rest within the ulp or absolute bounds of above
  const float x[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, -1e-40f, 1e30f, -1e30f, 13.0f, -13.0f, 40.0f, -40.0f};
  const int n = (int)(sizeof x / sizeof x[0]);
  for (const ebb__vec_ops *t : tables()) {
    for (int op : {EBB__EW_GELU, EBB__EW_GELU_GRAD}) {
      float o[sizeof x / sizeof x[0]];
      t->ew(op, o, x, nullptr, nullptr, n, 0, 0);
      for (int i = 0; i < n; i++) {
        INFO(t->name << " op " << op << " x " << x[i] << " got " << o[i]);
        double want = ebb__ew_f(op, x[i], 0, 0, 0, 0);
        if (std::isnan(want)) CHECK(std::isnan(o[i]));
        else CHECK((std::fabs(o[i] - want) <= 2e-7 || ulps(o[i], want) <= 4));
      }
    }
  }
}

TEST_CASE("vec: binary ops, where and the fused updates are exact, in place too", "[ops][internal][vec]") {
  struct {
    int op;
    double s0;
  } const ops[] = {{EBB__EW_ADD, 0},     {EBB__EW_SUB, 0},     {EBB__EW_MUL, 0},        {EBB__EW_DIV, 0},
                   {EBB__EW_EQ, 0},      {EBB__EW_NE, 0},      {EBB__EW_LT, 0},         {EBB__EW_LE, 0},
                   {EBB__EW_GT, 0},      {EBB__EW_GE, 0},      {EBB__EW_MAXIMUM, 0},    {EBB__EW_WHERE, 0},
                   {EBB__EW_ADD_SCALED, -0.1}, {EBB__EW_ADDCMUL, 0.3}, {EBB__EW_ADDCDIV, 0.3},
                   {EBB__EW_LERP, 0.3},  {EBB__EW_LERP, 0.7}};
  for (const ebb__vec_ops *t : tables()) {
    for (auto [op, s0] : ops) {
      INFO(t->name << " op " << op << " s0 " << s0);
      std::vector<float> x = inputs(-3, 3, 11), y = inputs(-3, 3, 12), z = inputs(-3, 3, 13), o(kN);
      for (int64_t i = 0; i < kN; i += 5) y[i] = x[i]; // ties for the comparisons
      x[7] = NAN;
      t->ew(op, o.data(), x.data(), y.data(), z.data(), kN, s0, 0);
      std::vector<float> inplace = x;
      t->ew(op, inplace.data(), inplace.data(), y.data(), z.data(), kN, s0, 0);
      bool ok = true;
      for (int64_t i = 0; i < kN; i++) {
        float w = (float)ebb__ew_f(op, x[i], y[i], z[i], s0, 0);
        ok = ok && (std::memcmp(&o[i], &w, 4) == 0 || (std::isnan(o[i]) && std::isnan(w)));
        ok = ok && (std::memcmp(&inplace[i], &o[i], 4) == 0 || (std::isnan(o[i]) && std::isnan(inplace[i])));
      }
      CHECK(ok);
    }
  }
}

TEST_CASE("vec: the tables agree bit for bit on sums and conversions", "[ops][internal][vec]") {
  std::vector<float> x = inputs(-1e3, 1e3, 5);
  std::vector<double> xd(x.begin(), x.end());
  const ebb__vec_ops *base = &ebb__vec_baseline;
  const double s = base->sum_f32(x.data(), kN), sd = base->sum_f64(xd.data(), kN);
  double serial = 0;
  for (float v : x) serial += v;
  CHECK(std::fabs(s - serial) <= 1e-9 * std::fabs(serial) + 1e-9);
  CHECK(s == sd);
  for (const ebb__vec_ops *t : tables()) {
    INFO(t->name);
    CHECK(t->sum_f32(x.data(), kN) == s);
    CHECK(t->sum_f64(xd.data(), kN) == sd);
    std::vector<double> acc(kN, 1.0);
    t->add_cols_f32(acc.data(), x.data(), kN);
    bool ok = true;
    for (int64_t i = 0; i < kN; i++) ok = ok && acc[i] == 1.0 + (double)x[i];
    CHECK(ok);
    // f32 -> bf16/f16 -> f32, contiguous and strided, against ops_math.h's scalar conversions
    std::vector<uint16_t> h(2 * kN);
    std::vector<float> back(kN), c = x;
    c[3] = NAN, c[4] = INFINITY, c[5] = 1e-6f, c[6] = 70000.0f, c[8] = -0.0f;
    for (int dt : {EBB__KDT_BF16, EBB__KDT_F16}) {
      for (int64_t stride : {2, 4}) {
        t->store((char *)h.data(), stride, c.data(), kN, dt);
        t->load(back.data(), (const char *)h.data(), stride, kN, dt);
        bool same = true;
        for (int64_t i = 0; i < kN; i++) {
          uint16_t want = dt == EBB__KDT_BF16 ? ebb__f32_to_bf16(c[i]) : ebb__f32_to_f16(c[i]);
          uint16_t got;
          std::memcpy(&got, (const char *)h.data() + i * stride, 2);
          float wb = dt == EBB__KDT_BF16 ? ebb__bf16_to_f32(want) : ebb__f16_to_f32(want);
          same = same && (got == want || (std::isnan(c[i]) && std::isnan(back[i])));
          same = same && (std::memcmp(&back[i], &wb, 4) == 0 || std::isnan(c[i]));
        }
        INFO("dt " << dt << " stride " << stride);
        CHECK(same);
      }
    }
    // a broadcast (stride 0) load repeats one element
    float one = 2.5f;
    t->load(back.data(), (const char *)&one, 0, kN, EBB__KDT_F32);
    CHECK((back[0] == 2.5f && back[kN - 1] == 2.5f));
  }
}
