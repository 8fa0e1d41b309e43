/* ops_math.h: the element math of ops, written once for the CPU kernels (kernels_cpu.c) and
 * their CUDA twins (cuda/ops_kernels.cu): bf16/f16 conversions, element loads and stores by
 * dtype, Philox 4x32-10 and the uniform/normal draws made from it, the elementwise op switches
 * (f64 and exact i64) with the rule that picks between them, and the reduction combiners.
 *
 * Every function is `static inline` and marked EBB__HD, which is `__host__ __device__` under
 * nvcc and nothing in C, so the same text is compiled by gcc -std=c11 and by nvcc as C++: keep
 * it in the common subset (no C++-only constructs, no C-only ones such as compound literals or
 * designated initialisers, explicit casts from void *). Only ops/ includes it.
 * Pure functions of their arguments: no state, safe on any thread.
 */
#ifndef EBB_OPS_MATH_H
#define EBB_OPS_MATH_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ops_kernels.h"

#ifdef __CUDACC__
#define EBB__HD __host__ __device__
#else
#define EBB__HD
#endif

/* ---- bit casts and raw element access -------------------------------------------------------
 * On the host memcpy (no aliasing questions; compilers emit one move). In device code a typed
 * access: operands are aligned to their element size there, and nvcc turns a memcpy from an
 * unknown char pointer into byte loads. */

static inline EBB__HD uint32_t ebb__f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static inline EBB__HD float ebb__f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if defined(__CUDA_ARCH__)
static inline EBB__HD float ebb__raw_f32(const char *p) { return *(const float *)p; }
static inline EBB__HD double ebb__raw_f64(const char *p) { return *(const double *)p; }
static inline EBB__HD uint16_t ebb__raw_u16(const char *p) { return *(const uint16_t *)p; }
static inline EBB__HD int64_t ebb__raw_i64(const char *p) { return *(const int64_t *)p; }
static inline EBB__HD void ebb__raw_put_f32(char *p, float v) { *(float *)p = v; }
static inline EBB__HD void ebb__raw_put_f64(char *p, double v) { *(double *)p = v; }
static inline EBB__HD void ebb__raw_put_u16(char *p, uint16_t v) { *(uint16_t *)p = v; }
static inline EBB__HD void ebb__raw_put_i64(char *p, int64_t v) { *(int64_t *)p = v; }
#else
static inline EBB__HD float ebb__raw_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }
static inline EBB__HD double ebb__raw_f64(const char *p) { double v; memcpy(&v, p, 8); return v; }
static inline EBB__HD uint16_t ebb__raw_u16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline EBB__HD int64_t ebb__raw_i64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline EBB__HD void ebb__raw_put_f32(char *p, float v) { memcpy(p, &v, 4); }
static inline EBB__HD void ebb__raw_put_f64(char *p, double v) { memcpy(p, &v, 8); }
static inline EBB__HD void ebb__raw_put_u16(char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline EBB__HD void ebb__raw_put_i64(char *p, int64_t v) { memcpy(p, &v, 8); }
#endif

/* ---- bf16 and f16: bit manipulation, round to nearest even ---------------------------------- */

static inline EBB__HD uint16_t ebb__f32_to_bf16(float x) {
  uint32_t u = ebb__f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);                                          /* nearest even */
  return (uint16_t)(u >> 16);
}

static inline EBB__HD float ebb__bf16_to_f32(uint16_t h) { return ebb__f32_from_bits((uint32_t)h << 16); }

static inline EBB__HD uint16_t ebb__f32_to_f16(float x) {
  uint32_t u = ebb__f32_bits(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: infinity */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    if (a < 0x33000000u) return sign;                      /* at most 2^-25: ties to zero */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* value / 2^-24 = m >> shift */
    uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  a -= 0x38000000u; /* rebias the exponent from 127 to 15 */
  return (uint16_t)(sign | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
}

static inline EBB__HD float ebb__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0) {
    float f = ldexpf((float)m, -24); /* zero or subnormal: exact */
    return sign ? -f : f;
  }
  if (e == 31) u = sign | 0x7f800000u | (m << 13);
  else u = sign | ((e + 112u) << 23) | (m << 13);
  return ebb__f32_from_bits(u);
}

/* ---- element loads and stores by dtype (EBB__KDT_*) ------------------------------------------ */

/* Double to int64: truncation toward zero, NaN -> 0, saturating (a C cast is undefined there). */
static inline EBB__HD int64_t ebb__d2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

static inline EBB__HD double ebb__load_dt(const char *p, int dt) {
  switch (dt) {
  case EBB__KDT_F32: return ebb__raw_f32(p);
  case EBB__KDT_F64: return ebb__raw_f64(p);
  case EBB__KDT_BF16: return ebb__bf16_to_f32(ebb__raw_u16(p));
  case EBB__KDT_F16: return ebb__f16_to_f32(ebb__raw_u16(p));
  case EBB__KDT_I64: return (double)ebb__raw_i64(p);
  default: return *(const unsigned char *)p ? 1.0 : 0.0;
  }
}

static inline EBB__HD void ebb__store_dt(char *p, int dt, double v) {
  switch (dt) {
  case EBB__KDT_F32: ebb__raw_put_f32(p, (float)v); break;
  case EBB__KDT_F64: ebb__raw_put_f64(p, v); break;
  case EBB__KDT_BF16: ebb__raw_put_u16(p, ebb__f32_to_bf16((float)v)); break;
  case EBB__KDT_F16: ebb__raw_put_u16(p, ebb__f32_to_f16((float)v)); break;
  case EBB__KDT_I64: ebb__raw_put_i64(p, ebb__d2i(v)); break;
  default: *(unsigned char *)p = v != 0.0; break;
  }
}

static inline EBB__HD int64_t ebb__ldi(const char *p, int dt) {
  if (dt == EBB__KDT_I64) return ebb__raw_i64(p);
  if (dt == EBB__KDT_BOOL) return *(const unsigned char *)p != 0;
  return ebb__d2i(ebb__load_dt(p, dt));
}

static inline EBB__HD void ebb__sti(char *p, int dt, int64_t v) {
  if (dt == EBB__KDT_I64) ebb__raw_put_i64(p, v);
  else if (dt == EBB__KDT_BOOL) *(unsigned char *)p = v != 0;
  else ebb__store_dt(p, dt, (double)v);
}

/* ---- Philox 4x32-10 and the draws made from it ----------------------------------------------- */

/* Philox 4x32-10 of counter (c0..c3) and key (k0, k1); out receives 4 words. */
static inline EBB__HD void ebb__philox4x32(const uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
  uint32_t x0 = c[0], x1 = c[1], x2 = c[2], x3 = c[3];
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y1 = (uint32_t)p1;
    uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1, y3 = (uint32_t)p0;
    x0 = y0, x1 = y1, x2 = y2, x3 = y3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

/* Uniform [0, 1) with as many bits as dt holds below 1, so rounding never reaches 1. */
static inline EBB__HD double ebb__uniform(const uint32_t w[4], int dt) {
  switch (dt) {
  case EBB__KDT_F64: return (double)(((uint64_t)(w[0] >> 5) << 26) | (w[1] >> 6)) * 0x1p-53;
  case EBB__KDT_BF16: return (double)(w[0] >> 24) * 0x1p-8;
  case EBB__KDT_F16: return (double)(w[0] >> 21) * 0x1p-11;
  default: return (double)(w[0] >> 8) * 0x1p-24;
  }
}

/* Standard normal by Box-Muller from the first two words. */
static inline EBB__HD double ebb__normal(const uint32_t w[4]) {
  double u1 = ((double)w[0] + 1.0) * 0x1p-32; /* (0, 1]: log is finite */
  double u2 = (double)w[1] * 0x1p-32;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

/* The value of element `ctr` (output index plus the launch's offset) of rand (op EBB__EW_RAND)
 * or randn for dtype dt under `seed`: the same number on every device. */
static inline EBB__HD double ebb__random_at(int op, int dt, uint64_t seed, uint64_t ctr) {
  uint32_t c[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), 0, 0}, w[4];
  ebb__philox4x32(c, (uint32_t)seed, (uint32_t)(seed >> 32), w);
  return op == EBB__EW_RAND ? ebb__uniform(w, dt) : ebb__normal(w);
}

/* ---- the elementwise ops ---------------------------------------------------------------------- */

static inline EBB__HD double ebb__gelu(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440)); }

/* d/dx of the exact GELU: Phi(x) + x * phi(x). */
static inline EBB__HD double ebb__gelu_grad(double x) {
  return 0.5 * (1.0 + erf(x * 0.70710678118654752440)) + x * exp(-0.5 * x * x) * 0.39894228040143267794;
}

/* One element in f64. x, y, z are the inputs; s0, s1 the op's scalars. */
static inline EBB__HD double ebb__ew_f(int op, double x, double y, double z, double s0, double s1) {
  switch (op) {
  case EBB__EW_COPY: return x;
  case EBB__EW_NEG: return -x;
  case EBB__EW_ABS: return fabs(x);
  case EBB__EW_EXP: return exp(x);
  case EBB__EW_LOG: return log(x);
  case EBB__EW_SQRT: return sqrt(x);
  case EBB__EW_SIN: return sin(x);
  case EBB__EW_COS: return cos(x);
  case EBB__EW_TANH: return tanh(x);
  case EBB__EW_SIGMOID: return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
  case EBB__EW_RELU: return x > 0 ? x : 0.0;
  case EBB__EW_GELU: return ebb__gelu(x);
  case EBB__EW_POWS: return pow(x, s0);
  case EBB__EW_CLAMP: return x != x ? x : x < s0 ? s0 : x > s1 ? s1 : x;
  case EBB__EW_ADDS: return x + s0;
  case EBB__EW_MULS: return x * s0;
  case EBB__EW_RSUBS: return s0 - x;
  case EBB__EW_DIVS: return x / s0;
  case EBB__EW_RDIVS: return s0 / x;
  case EBB__EW_SIGN: return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0;
  case EBB__EW_GELU_GRAD: return ebb__gelu_grad(x);
  case EBB__EW_CLAMP_MASK: return x >= s0 && x <= s1 ? 1.0 : 0.0;
  case EBB__EW_LT_S: return x < s0 ? 1.0 : 0.0;
  case EBB__EW_GT_S: return x > s0 ? 1.0 : 0.0;
  case EBB__EW_SQUARE: return x * x;
  case EBB__EW_ADD: return x + y;
  case EBB__EW_SUB: return x - y;
  case EBB__EW_MUL: return x * y;
  case EBB__EW_DIV: return x / y;
  case EBB__EW_EQ: return x == y;
  case EBB__EW_NE: return x != y;
  case EBB__EW_LT: return x < y;
  case EBB__EW_LE: return x <= y;
  case EBB__EW_GT: return x > y;
  case EBB__EW_GE: return x >= y;
  case EBB__EW_MAXIMUM: return x != x || x > y ? x : y;
  case EBB__EW_WHERE: return x != 0 ? y : z;
  case EBB__EW_ADD_SCALED: return x + s0 * y;
  /* from the nearer end, so w = 1 gives y exactly */
  case EBB__EW_LERP: return s0 < 0.5 ? x + s0 * (y - x) : y - (y - x) * (1.0 - s0);
  case EBB__EW_ADDCMUL: return x + s0 * y * z;
  case EBB__EW_ADDCDIV: return x + s0 * y / z;
  case EBB__EW_GELU_BWD: return x * ebb__gelu_grad(y);
  default: return 0.0;
  }
}

/* The same in i64 into *out, for the ops that stay exact on integers; false (*out untouched)
 * for an op without an exact integer form. This switch is the list of those ops: ebb__ew_int_op
 * asks it, so the two cannot disagree. */
static inline EBB__HD bool ebb__ew_i(int op, int64_t x, int64_t y, int64_t z, int64_t s0, int64_t s1, int64_t *out) {
  /* unsigned arithmetic: i64 overflow wraps (as on a GPU) instead of being undefined */
  int64_t r;
  switch (op) {
  case EBB__EW_COPY: r = x; break;
  case EBB__EW_NEG: r = (int64_t)(0u - (uint64_t)x); break;
  case EBB__EW_ABS: r = x < 0 ? (int64_t)(0u - (uint64_t)x) : x; break;
  case EBB__EW_RELU: r = x > 0 ? x : 0; break;
  case EBB__EW_CLAMP: r = x < s0 ? s0 : x > s1 ? s1 : x; break;
  case EBB__EW_ADDS: r = (int64_t)((uint64_t)x + (uint64_t)s0); break;
  case EBB__EW_MULS: r = (int64_t)((uint64_t)x * (uint64_t)s0); break;
  case EBB__EW_RSUBS: r = (int64_t)((uint64_t)s0 - (uint64_t)x); break;
  case EBB__EW_SIGN: r = (x > 0) - (x < 0); break;
  case EBB__EW_SQUARE: r = (int64_t)((uint64_t)x * (uint64_t)x); break;
  case EBB__EW_CLAMP_MASK: r = x >= s0 && x <= s1; break;
  case EBB__EW_LT_S: r = x < s0; break;
  case EBB__EW_GT_S: r = x > s0; break;
  case EBB__EW_ADD: r = (int64_t)((uint64_t)x + (uint64_t)y); break;
  case EBB__EW_SUB: r = (int64_t)((uint64_t)x - (uint64_t)y); break;
  case EBB__EW_MUL: r = (int64_t)((uint64_t)x * (uint64_t)y); break;
  case EBB__EW_EQ: r = x == y; break;
  case EBB__EW_NE: r = x != y; break;
  case EBB__EW_LT: r = x < y; break;
  case EBB__EW_LE: r = x <= y; break;
  case EBB__EW_GT: r = x > y; break;
  case EBB__EW_GE: r = x >= y; break;
  case EBB__EW_MAXIMUM: r = x > y ? x : y; break;
  case EBB__EW_WHERE: r = x ? y : z; break;
  case EBB__EW_ADD_SCALED: r = (int64_t)((uint64_t)x + (uint64_t)s0 * (uint64_t)y); break;
  default: return false;
  }
  *out = r;
  return true;
}

static inline EBB__HD bool ebb__kdt_is_int(int dt) { return dt == EBB__KDT_I64 || dt == EBB__KDT_BOOL; }

/* Whether ebb__ew_i has the op (asked on zeros: every i64 op is defined there). */
static inline EBB__HD bool ebb__ew_int_op(int op) {
  int64_t r;
  return ebb__ew_i(op, 0, 0, 0, 0, 0, &r);
}

/* Whether a launch computes in i64 (ebb__ew_i) rather than f64: integer ops on integer
 * operands; comparisons whenever the inputs are integers (bool result); where when its result
 * and both branches are integers (the condition may be anything). */
static inline EBB__HD bool ebb__ew_exact_int(const ebb__ew_args *a) {
  const int op = a->op;
  if (op == EBB__EW_WHERE)
    return ebb__kdt_is_int(a->dt_out) && ebb__kdt_is_int(a->dt_in[1]) && ebb__kdt_is_int(a->dt_in[2]);
  bool ints = ebb__ew_int_op(op);
  if (op >= EBB__EW_EQ && op <= EBB__EW_GE) ints = true;
  else ints = ints && ebb__kdt_is_int(a->dt_out);
  for (int k = 0; k < a->nin && ints; k++) ints = ebb__kdt_is_int(a->dt_in[k]);
  return ints;
}

/* Whether an elementwise launch takes the GPU's f32 kernel (ebb_ops_ew_f32, cuda/ops_kernels.cu)
 * rather than the generic one: one dim (contiguous operands coalesce to one) with a unit-stride
 * output and each input of unit stride or a broadcast element (stride 0); every operand f32,
 * bf16 or f16, except a bool condition of where and a bool result of a comparison or a copy;
 * an op other than fill, arange and the random ones. The same ops and dtypes the CPU kernels
 * compute in f32 (kernels_cpu.c), so a device gives what the CPU gives, to the transcendental
 * functions' last bits. ew.c asks it to choose the kernel; the CPU kernels serve both ids. */
static inline EBB__HD bool ebb__ew_flat_f32(const ebb__ew_args *a) {
  const int op = a->op, dto = a->dt_out;
  if (op < EBB__EW_COPY || op >= EBB__EW_COUNT || a->ndim != 1 || a->st_out[0] != 1) return false;
  const bool cmp = (op >= EBB__EW_EQ && op <= EBB__EW_GE) || op == EBB__EW_LT_S || op == EBB__EW_GT_S ||
                   op == EBB__EW_CLAMP_MASK;
  if (!(dto == EBB__KDT_F32 || dto == EBB__KDT_BF16 || dto == EBB__KDT_F16 ||
        (dto == EBB__KDT_BOOL && (cmp || op == EBB__EW_COPY))))
    return false;
  for (int k = 0; k < a->nin; k++) {
    const int d = a->dt_in[k];
    if (a->st_in[k][0] != 0 && a->st_in[k][0] != 1) return false;
    if (!(d == EBB__KDT_F32 || d == EBB__KDT_BF16 || d == EBB__KDT_F16 || (d == EBB__KDT_BOOL && op == EBB__EW_WHERE && k == 0)))
      return false;
  }
  return true;
}

/* Element i (row-major output index) of arange. */
static inline EBB__HD double ebb__arange_at(double start, double step, uint64_t i) { return start + (double)i * step; }

/* ---- reductions: combiners in f64 ------------------------------------------------------------- */

static inline EBB__HD double ebb__red_init(int op) { return op == EBB__RED_MAX ? -INFINITY : 0.0; }

/* Max over inner elements visited in row-major order, j their inner index: the first maximum
 * wins ties (best keeps its index) and the first NaN wins over everything and stays, as max of
 * anything with NaN is NaN. */
static inline EBB__HD void ebb__red_max_step(double *acc, int64_t *best, bool *nan, double v, int64_t j) {
  if (!*nan && (v != v || v > *acc || j == 0)) {
    *acc = v;
    *best = j;
    *nan = v != v;
  }
}

/* Whether each output of a reduction combines one contiguous run of the input (the reduced dims
 * are the innermost and dense, as for a sum over the last dim or of a whole contiguous
 * tensor) of at least 128 elements: the GPU then gives each output a block of threads
 * (cuda/ops_kernels.cu) and reduce.c launches 256 threads per output; otherwise one thread per
 * output. */
static inline EBB__HD bool ebb__red_run(const ebb__red_args *a) {
  if (a->ninner < 1 || a->ist_in[a->ninner - 1] != 1) return false;
  int64_t run = a->ishape[a->ninner - 1];
  for (int d = a->ninner - 2; d >= 0; d--) {
    if (a->ist_in[d] != a->ist_in[d + 1] * a->ishape[d + 1]) return false;
    run *= a->ishape[d];
  }
  return run >= 128; /* shorter runs leave most of a block idle: a thread per output */
}

/* Whether a reduction over one dim reads its outputs' elements side by side (the kept last dim
 * is the unit-stride one: a sum over the first dim of a row-major matrix) with at least 32
 * elements per output and no contiguous run: the GPU then gives each 8 adjacent outputs a block
 * whose 32 thread rows split the reduced dim (cuda/ops_kernels.cu). */
static inline EBB__HD bool ebb__red_cols(const ebb__red_args *a) {
  return a->ninner == 1 && a->nouter >= 1 && a->ost_in[a->nouter - 1] == 1 && a->ishape[0] >= 32 && !ebb__red_run(a);
}

/* The GPU threads a reduction with nout outputs asks for (reduce.c): 256 per output for a
 * contiguous run, 256 per 8 outputs side by side, else one per output. */
static inline EBB__HD int64_t ebb__red_threads(const ebb__red_args *a, int64_t nout) {
  if (ebb__red_run(a)) return nout * 256;
  if (ebb__red_cols(a)) return (nout + 7) / 8 * 256;
  return nout;
}

/* The result from the accumulator: the mean divides by the count (NaN for none). */
static inline EBB__HD double ebb__red_finish(int op, double acc, int64_t inner) {
  if (op != EBB__RED_MEAN) return acc;
  return inner ? acc / (double)inner : NAN;
}

#endif /* EBB_OPS_MATH_H */
