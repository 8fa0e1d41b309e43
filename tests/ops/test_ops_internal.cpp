// White-box tests of ops' kernels through their argument structs (ops/ops_kernels.h): Philox
// against the Random123 known-answer vectors, the CPU elementwise kernel on hand-built strided
// and broadcast geometry, the reduction kernel's NaN and index rules, and the struct sizes the
// driver's 4096-byte argument limit allows; and ops_math.h, the element math shared with the
// CUDA kernels, compiled as C++ against the library's C build of it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "ops_kernels.h"
// The element math the CPU kernels and the CUDA kernels share, compiled here as C++: the
// language nvcc compiles it in, so a C/C++ difference in that text would show below.
#include "ops_math.h"

extern "C" {
void ebb__philox(uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]);
void ebb__ew_cpu(void *args);
void ebb__reduce_cpu(void *args);
uint16_t ebb_f32_to_bf16(float x);
float ebb_bf16_to_f32(uint16_t h);
uint16_t ebb_f32_to_f16(float x);
float ebb_f16_to_f32(uint16_t h);
}

TEST_CASE("internal: Philox 4x32-10 matches the Random123 known-answer vectors", "[ops][internal]") {
  struct Kat {
    uint32_t ctr[4], k0, k1, out[4];
  } kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, 0xffffffff, 0xffffffff, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, 0xa4093822, 0x299f31d0, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (auto &k : kats) {
    uint32_t out[4];
    ebb__philox(k.ctr, k.k0, k.k1, out);
    for (int i = 0; i < 4; i++) CHECK(out[i] == k.out[i]);
  }
}

TEST_CASE("internal: the CPU elementwise kernel follows strides, stride 0 and mixed dtypes", "[ops][internal]") {
  // out[i][j] (f64, row-major 2x3) = a[j][i] (f32, read transposed) + b[j] (i64, broadcast)
  float a[6] = {1, 2, 3, 4, 5, 6}; // a as 3x2
  int64_t b[3] = {10, 20, 30};
  double out[6] = {0};
  ebb__ew_args g;
  std::memset(&g, 0, sizeof g);
  g.op = EBB__EW_ADD;
  g.ndim = 2;
  g.nin = 2;
  g.dt_out = 1; // f64
  g.dt_in[0] = 0; // f32
  g.dt_in[1] = 4; // i64
  g.shape[0] = 2, g.shape[1] = 3;
  g.st_out[0] = 3, g.st_out[1] = 1;
  g.st_in[0][0] = 1, g.st_in[0][1] = 2; // transposed
  g.st_in[1][0] = 0, g.st_in[1][1] = 1; // broadcast over rows
  g.out = out;
  g.in[0] = a;
  g.in[1] = b;
  ebb__ew_cpu(&g);
  double want[6] = {11, 23, 35, 12, 24, 36};
  for (int i = 0; i < 6; i++) CHECK(out[i] == want[i]);
  // i64 results stay exact past 2^53
  int64_t x[1] = {(int64_t(1) << 53) + 1}, y[1] = {1}, z[1] = {0};
  std::memset(&g, 0, sizeof g);
  g.op = EBB__EW_ADD;
  g.ndim = 0;
  g.nin = 2;
  g.dt_out = g.dt_in[0] = g.dt_in[1] = 4;
  g.out = z;
  g.in[0] = x;
  g.in[1] = y;
  ebb__ew_cpu(&g);
  CHECK(z[0] == (int64_t(1) << 53) + 2);
}

// f64 max with indices into 2 outputs over one reduced dim of `ishape` elements: output k starts
// at in[k * ost_in], reduced elements are ist_in apart. Returns the arguments it ran with.
static ebb__red_args max_of_two_rows(double *in, double *out, int64_t *idx, int64_t ost_in, int64_t ishape, int64_t ist_in) {
  ebb__red_args r;
  std::memset(&r, 0, sizeof r);
  r.op = EBB__RED_MAX;
  r.dt_in = r.dt_out = 1;
  r.nouter = 1, r.ninner = 1;
  r.oshape[0] = 2, r.ost_in[0] = ost_in, r.ost_out[0] = 1;
  r.ishape[0] = ishape, r.ist_in[0] = ist_in;
  r.in = in;
  r.out = out;
  r.idx = idx;
  ebb__reduce_cpu(&r);
  return r;
}

TEST_CASE("internal: the reduction kernel keeps the first maximum and lets NaN win", "[ops][internal]") {
  double in[8] = {3, 7, 7, 1, 2, NAN, 9, 4};
  double out[2] = {0, 0};
  int64_t idx[2] = {-1, -1};
  max_of_two_rows(in, out, idx, /*ost_in=*/4, /*ishape=*/4, /*ist_in=*/1);
  CHECK(out[0] == 7);
  CHECK(idx[0] == 1);
  CHECK(std::isnan(out[1]));
  CHECK(idx[1] == 1);
}

TEST_CASE("internal: the column-wise reduction loop keeps the same tie, NaN and order rules", "[ops][internal]") {
  // max and sum over dim 0 of a row-major [3, 2]: the kept dim is the inner one in memory
  double in[6] = {1, 2, 5, NAN, 5, 9};
  double out[2] = {0, 0};
  int64_t idx[2] = {-1, -1};
  ebb__red_args r = max_of_two_rows(in, out, idx, /*ost_in=*/1, /*ishape=*/3, /*ist_in=*/2);
  CHECK(out[0] == 5);
  CHECK(idx[0] == 1); // the first of the tied maxima
  CHECK(std::isnan(out[1]));
  CHECK(idx[1] == 1);
  double vals[6] = {0.1, 1e16, 0.2, 1.0, -0.1, -1e16}, sums[2];
  r.op = EBB__RED_SUM;
  r.in = vals;
  r.out = sums;
  r.idx = nullptr;
  ebb__reduce_cpu(&r);
  CHECK(sums[0] == (0.1 + 0.2) + -0.1); // row-major order, exactly as the row loop adds
  CHECK(sums[1] == (1e16 + 1.0) + -1e16);
}

TEST_CASE("internal: the GPU's kernel choices take exactly the layouts and dtypes their CUDA kernels handle", "[ops][internal]") {
  // ebb__ew_flat_f32 picks ebb_ops_ew_f32: one unit-stride dim (an input may be a broadcast
  // element), f32/bf16/f16 operands, a bool where-condition or comparison result, no fill/random.
  auto ew = [](int op, int dto, std::vector<int> dts, std::vector<int64_t> strides) {
    ebb__ew_args g;
    std::memset(&g, 0, sizeof g);
    g.op = op;
    g.ndim = 1;
    g.shape[0] = 100;
    g.st_out[0] = 1;
    g.dt_out = dto;
    g.nin = (int)dts.size();
    for (size_t k = 0; k < dts.size(); k++) {
      g.dt_in[k] = dts[k];
      g.st_in[k][0] = strides[k];
    }
    return g;
  };
  const int F32 = EBB__KDT_F32, F64 = EBB__KDT_F64, BF16 = EBB__KDT_BF16, F16 = EBB__KDT_F16, I64 = EBB__KDT_I64, B = EBB__KDT_BOOL;
  ebb__ew_args g = ew(EBB__EW_ADD, F32, {F32, F32}, {1, 1});
  CHECK(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, BF16, {BF16, F16}, {1, 0});  // mixed 16-bit, a broadcast element
  CHECK(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_LT, B, {F32, F32}, {1, 1});
  CHECK(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_WHERE, F32, {B, F32, F32}, {1, 1, 1});
  CHECK(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_GELU, F16, {F16}, {1});
  CHECK(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F32, {F32, F32}, {1, 2});  // a strided input
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F64, {F64, F64}, {1, 1});
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F32, {F32, I64}, {1, 1});
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, B, {F32, F32}, {1, 1});  // a bool result of arithmetic
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F32, {B, F32}, {1, 1});  // bool is where's condition only
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_RAND, F32, {}, {});
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F32, {F32, F32}, {1, 1});
  g.ndim = 2;  // two dims left after coalescing: a strided layout
  g.shape[1] = 3;
  g.st_out[1] = 1;
  CHECK_FALSE(ebb__ew_flat_f32(&g));
  g = ew(EBB__EW_ADD, F32, {F32, F32}, {1, 1});
  g.st_out[0] = 2;
  CHECK_FALSE(ebb__ew_flat_f32(&g));

  // ebb__red_run gives an output a block of threads when its elements are one dense run of at
  // least 128; ebb__red_cols gives 8 outputs side by side a block; ebb__red_threads is what
  // reduce.c asks the launch for.
  auto red = [](std::vector<int64_t> shape, std::vector<int64_t> strides) {
    ebb__red_args r;
    std::memset(&r, 0, sizeof r);
    r.ninner = (int)shape.size();
    for (size_t d = 0; d < shape.size(); d++) {
      r.ishape[d] = shape[d];
      r.ist_in[d] = strides[d];
    }
    return r;
  };
  ebb__red_args r = red({1024}, {1});
  CHECK(ebb__red_run(&r));
  r = red({2, 64}, {64, 1});
  CHECK(ebb__red_run(&r));
  r = red({64}, {1});  // short: a thread per output
  CHECK_FALSE(ebb__red_run(&r));
  r = red({1024}, {2});
  CHECK_FALSE(ebb__red_run(&r));
  r = red({4, 64}, {128, 1});  // not dense
  CHECK_FALSE(ebb__red_run(&r));
  r = red({}, {});
  CHECK_FALSE(ebb__red_run(&r));
  // ebb__red_cols: one reduced dim, the outputs side by side (a sum over the first dim)
  r = red({4096}, {1024});
  r.nouter = 1;
  r.oshape[0] = 1024;
  r.ost_in[0] = 1;
  CHECK(ebb__red_cols(&r));
  CHECK(ebb__red_threads(&r, 1024) == 128 * 256);
  r.ost_in[0] = 4096;  // outputs apart: a thread each
  CHECK_FALSE(ebb__red_cols(&r));
  CHECK(ebb__red_threads(&r, 1024) == 1024);
  r = red({16}, {1024});  // too few elements to share
  r.nouter = 1;
  r.oshape[0] = 1024;
  r.ost_in[0] = 1;
  CHECK_FALSE(ebb__red_cols(&r));
  r = red({1024}, {1});
  CHECK(ebb__red_threads(&r, 3) == 3 * 256);
}

TEST_CASE("internal: argument structs fit the driver's launch limit", "[ops][internal]") {
  CHECK(sizeof(ebb__ew_args) <= 4096);
  CHECK(sizeof(ebb__red_args) <= 4096);
  CHECK(sizeof(ebb__mm_args) <= 4096);
}

static uint64_t bits_of(double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  return u;
}

TEST_CASE("internal: ops_math.h compiled as C++ agrees bit for bit with the library's C kernels", "[ops][internal]") {
  // conversions: every bf16 and f16, and a sweep of f32 bit patterns (a prime step over 2^32)
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float a = ebb__bf16_to_f32((uint16_t)h), b = ebb_bf16_to_f32((uint16_t)h);
    float c = ebb__f16_to_f32((uint16_t)h), d = ebb_f16_to_f32((uint16_t)h);
    REQUIRE(std::memcmp(&a, &b, 4) == 0);
    REQUIRE(std::memcmp(&c, &d, 4) == 0);
  }
  for (uint64_t u = 0; u < (uint64_t)1 << 32; u += 4099) {
    float f = ebb__f32_from_bits((uint32_t)u);
    REQUIRE(ebb__f32_to_bf16(f) == ebb_f32_to_bf16(f));
    REQUIRE(ebb__f32_to_f16(f) == ebb_f32_to_f16(f));
  }
  // Philox
  for (uint32_t i = 0; i < 64; i++) {
    uint32_t c[4] = {i * 0x9E3779B9u, i, ~i, 7}, x[4], y[4];
    ebb__philox4x32(c, i * 3u, ~i, x);
    ebb__philox(c, i * 3u, ~i, y);
    for (int k = 0; k < 4; k++) CHECK(x[k] == y[k]);
  }
  // every f64 op and every i64 op, one element through the CPU kernel against the C++ text
  const double xs[] = {-2.5, -0.5, 0.0, 0.7, 3.0, NAN}, y = 1.25, z = -4.0, s0 = 0.5, s1 = 2.0;
  const int64_t is[] = {-7, 0, 1, 5, INT64_MAX};
  for (int op = EBB__EW_COPY; op < EBB__EW_COUNT; op++) {
    for (double x : xs) {
      double in[3] = {x, y, z}, out = 0;
      ebb__ew_args g;
      std::memset(&g, 0, sizeof g);
      g.op = op;
      g.nin = op == EBB__EW_GELU_BWD ? 2 : op >= EBB__EW_WHERE ? 3 : op >= EBB__EW_ADD ? 2 : 1;
      g.dt_out = EBB__KDT_F64;
      for (int k = 0; k < 3; k++) g.dt_in[k] = EBB__KDT_F64, g.in[k] = &in[k];
      g.out = &out;
      g.s0 = s0, g.s1 = s1;
      ebb__ew_cpu(&g);
      double want = ebb__ew_f(op, x, y, z, s0, s1);
      INFO("op " << op << " x " << x);
      CHECK((bits_of(out) == bits_of(want) || (out != out && want != want)));
    }
    int64_t r = 0;
    if (!ebb__ew_i(op, 0, 0, 0, 0, 0, &r)) continue;
    for (int64_t x : is) {
      int64_t in[3] = {x, 3, -2}, out = 0, want = 0;
      ebb__ew_args g;
      std::memset(&g, 0, sizeof g);
      g.op = op;
      g.nin = op == EBB__EW_GELU_BWD ? 2 : op >= EBB__EW_WHERE ? 3 : op >= EBB__EW_ADD ? 2 : 1;
      g.dt_out = EBB__KDT_I64;
      for (int k = 0; k < 3; k++) g.dt_in[k] = EBB__KDT_I64, g.in[k] = &in[k];
      g.out = &out;
      g.s0 = -3, g.s1 = 4;
      ebb__ew_cpu(&g);
      ebb__ew_i(op, x, 3, -2, -3, 4, &want);
      INFO("i64 op " << op << " x " << x);
      CHECK(out == want);
    }
  }
}

extern "C" {
int ebb__cpu_isa(void);
void ebb__rows_run_isa(const ebb__rows_args *a, int isa);
}

TEST_CASE("internal: every instruction set's row kernel gives the baseline's results", "[ops][internal][fused]") {
  // The library runs the widest set the CPU has; the narrower ones must agree with it, or a
  // machine without AVX-512 would compute something else. Sets the CPU lacks are skipped
  // (ebb__rows_run_isa caps at the CPU's).
  const int64_t rows = 6;
  for (int64_t cols : {1, 5, 8, 15, 16, 31, 64, 129}) {
    std::vector<float> x((size_t)(rows * cols)), g(x.size()), w((size_t)cols), b((size_t)cols);
    for (size_t i = 0; i < x.size(); i++) {
      x[i] = (float)std::sin((double)i * 1.7) * 20.f;
      g[i] = (float)std::cos((double)i * 0.3);
    }
    for (size_t j = 0; j < w.size(); j++) {
      w[j] = 1.f + 0.01f * (float)j;
      b[j] = 0.5f - 0.02f * (float)j;
    }
    std::vector<int64_t> tgt((size_t)rows);
    for (int64_t r = 0; r < rows; r++) tgt[(size_t)r] = (r * 5) % cols;
    for (int op = 0; op < EBB__ROWS_COUNT; op++) {
      std::vector<float> base, gw0, gb0;
      for (int isa = 0; isa <= ebb__cpu_isa(); isa++) {
        INFO("cols " << cols << " op " << op << " isa " << isa);
        std::vector<float> out(x.size(), -7.f), gw((size_t)cols, -7.f), gb((size_t)cols, -7.f);
        ebb__rows_args a{};
        a.op = op;
        a.rows = rows;
        a.cols = cols;
        a.x = x.data();
        a.g = op == EBB__ROWS_CE_BWD ? g.data() + 3 : g.data();
        a.w = w.data();
        a.b = b.data();
        a.target = tgt.data();
        a.out = out.data();
        a.s0 = op == EBB__ROWS_CE_BWD ? 1.0 / rows : 1e-5;
        if (op == EBB__ROWS_LN_BWD) {
          a.gw_out = gw.data();
          a.gb_out = gb.data();
        }
        ebb__rows_run_isa(&a, isa);
        if (isa == 0) {
          base = out;
          gw0 = gw;
          gb0 = gb;
          continue;
        }
        for (size_t i = 0; i < out.size(); i++) CHECK(out[i] == Approx(base[i]).margin(1e-3).epsilon(1e-4));  // sums in other orders; a wrong lane or tail is far off
        for (size_t j = 0; j < gw.size(); j++) {
          CHECK(gw[j] == Approx(gw0[j]).margin(1e-4).epsilon(1e-5));
          CHECK(gb[j] == Approx(gb0[j]).margin(1e-5).epsilon(1e-5));
        }
      }
    }
  }
}
