/* kernels_cpu_vec.c: the CPU kernels' vector loops (their contract: kernels_cpu_vec.h).
 *
 * This text is compiled once per instruction set: as is for the baseline table, and included by
 * kernels_cpu_vec_avx2.c and kernels_cpu_vec_avx512.c, whose compile flags (ops/CMakeLists.txt)
 * enable the wider instructions and which name the table through EBB__VEC_NAME. The loops are
 * plain C the compiler vectorises at the width the flags allow; the only intrinsics are the
 * f16 conversions (F16C) and the SLEEF calls, whose vector type follows the width.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels_cpu_vec.h"
#include "ops_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(EBB_HAVE_SLEEF)
#include <sleef.h>
#endif

#ifndef EBB__VEC_NAME
#define EBB__VEC_NAME baseline
#endif
#define VEC_CAT2(a, b) a##b
#define VEC_CAT(a, b) VEC_CAT2(a, b)
#define VEC_STR2(a) #a
#define VEC_STR(a) VEC_STR2(a)

#define CH EBB__VEC_CHUNK

/* ---- the transcendental functions over arrays ------------------------------------------------
 * SLEEF's f32 functions of the build's width (1-ulp bound, the "u10" family), or libm's f32
 * functions one element at a time without SLEEF. A tail shorter than a vector goes through the
 * same vector function on a padded copy, so an element's result does not depend on where it
 * lies in the array. */
#if defined(EBB_HAVE_SLEEF) && defined(__AVX512F__)
#define VW 16
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define SLEEF_F(fn) Sleef_##fn##f16_u10avx512f
#elif defined(EBB_HAVE_SLEEF) && defined(__AVX2__)
#define VW 8
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define SLEEF_F(fn) Sleef_##fn##f8_u10avx2
#elif defined(EBB_HAVE_SLEEF) && defined(__SSE2__)
#define VW 4
#define VLOAD _mm_loadu_ps
#define VSTORE _mm_storeu_ps
#define VSET1 _mm_set1_ps
#define SLEEF_F(fn) Sleef_##fn##f4_u10sse2
#endif

#ifdef VW
#define MAP1(name, fn, libm)                                                                                     \
  static void name(float *o, const float *x, int64_t n) {                                                   \
    int64_t i = 0;                                                                                               \
    for (; i + VW <= n; i += VW) VSTORE(o + i, SLEEF_F(fn)(VLOAD(x + i)));                                      \
    if (i < n) {                                                                                                 \
      float t[VW] = {0};                                                                                         \
      memcpy(t, x + i, (size_t)(n - i) * 4);                                                                     \
      VSTORE(t, SLEEF_F(fn)(VLOAD(t)));                                                                          \
      memcpy(o + i, t, (size_t)(n - i) * 4);                                                                     \
    }                                                                                                            \
  }
static void map_pow(float *o, const float *x, float e, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) VSTORE(o + i, SLEEF_F(pow)(VLOAD(x + i), VSET1(e)));
  if (i < n) {
    float t[VW] = {0};
    memcpy(t, x + i, (size_t)(n - i) * 4);
    VSTORE(t, SLEEF_F(pow)(VLOAD(t), VSET1(e)));
    memcpy(o + i, t, (size_t)(n - i) * 4);
  }
}
#else
#define MAP1(name, fn, libm)                                                                                     \
  static void name(float *o, const float *x, int64_t n) {                                                   \
    for (int64_t i = 0; i < n; i++) o[i] = libm(x[i]);                                                           \
  }
static void map_pow(float *o, const float *x, float e, int64_t n) {
  for (int64_t i = 0; i < n; i++) o[i] = powf(x[i], e);
}
#endif
MAP1(map_exp, exp, expf)
MAP1(map_log, log, logf)
MAP1(map_sin, sin, sinf)
MAP1(map_cos, cos, cosf)
MAP1(map_tanh, tanh, tanhf)

/* The scratch array of sigmoid below (t) is written for i < n before a map reads it; GCC, not
 * relating the two loops, would call it uninitialised (a map's input is a pointer to const). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

/* GELU's two functions of x, 1 + erf(x/sqrt 2) (= 2 Phi(x)) and exp(-x^2/2) (= sqrt(2 pi) phi(x)),
 * in f32, one element at a time in plain C without a branch or a call, so that the loops over
 * them vectorise at every width (every lane computes every piece and selects). With
 * a = |x|/sqrt 2, one formula for every a:
 *   erfc(a) = exp(-a^2) Q(t),  t = 1/(1 + a p),  p = 0.47,
 *   1 + erf(x/sqrt 2) = 2 - erfc(a) for x > 0, erfc(a) itself for x <= 0 (exact where erf nears
 *   -1, where 1 + erf would cancel),
 * Q a degree-7 polynomial fitted to erfc(a) exp(a^2) on a in [0, 4] (t in [0.347, 1]): a
 * smooth function of t, within 6e-8 relative there with its coefficients rounded to f32, and
 * still within 1e-4 out to |x| = 13 (a = 9.2), where exp(-a^2) < 1e-36 makes it not matter.
 * t is computed to within about its last bit (below): Q moves 2.4 times t's relative error.
 * exp(-x^2/2), which the gradient needs as well, is computed from x^2 split exactly in two
 * (with FMA, x*x and its rounding error; without, the square of x's upper 12 bits and the rest;
 * a rounded x*x would cost up to 8 ulp at |x| ~ 3), 2^k (k = round(-x^2/2 / ln 2)) times a
 * degree-7 polynomial on the reduced argument (ln 2 in two parts); |x| is capped at 13, past
 * which the exponential is 0 (below f32's least normal times x).
 * Errors (tests/ops/test_ops_kernels_vec.cpp): gelu within 4 ulp or 1e-7, its gradient within
 * 4 ulp or 2e-7; over every 7th f32 in [-20, 20], gelu 1.7 ulp at most where it is off by more
 * than 1e-7 (every table), its gradient 3.4 ulp where off by more than 2e-7 (baseline; AVX2 and
 * AVX-512 never off by more than 2e-7). Coefficients of Q: least squares on Chebyshev nodes in
 * t, weighted by 1/Q (relative error), in 40-digit arithmetic, rounded to f32. One formula for
 * every a, instead of a polynomial in a near 0 and one in 1/a beyond, costs 8 multiply-adds and
 * two selects less per element. The baseline (no FMA) rounds twice per step of Horner's rule,
 * within the same bounds; its t comes from f64. */
static const float erfc_q[8] = {-0.000349715468f, 0.271067858f,  0.222526312f,  0.407794297f,
                                -0.241512462f,    0.715349257f, -0.474745005f, 0.0998695195f};
#define ERFC_P 0.47f

#if defined(__FMA__)
#define PMADD(a, b, c) fmaf(a, b, c)
#else
#define PMADD(a, b, c) ((a) * (b) + (c))
#endif

typedef union {
  float f;
  uint32_t u;
} f32_bits;

/* Without trapping math gcc may compute both sides of a select (a multiply or add it would
 * otherwise keep behind the condition), which the loops need to vectorise without AVX-512's
 * masks; the kernels never read the floating-point exception flags. */
#define GELU_FN __attribute__((optimize("no-trapping-math")))

static inline GELU_FN void gelu_parts(float x, float *erf1p, float *ex2) {
  /* exp(-x^2/2) */
  const float ax = fabsf(x), xc = ax < 13.0f ? ax : 13.0f; /* NaN: 13 */
#if defined(__FMA__)
  const float sq = xc * xc, sh = 0.5f * sq, sl = 0.5f * fmaf(xc, xc, -sq); /* x^2/2 = sh + sl */
#else
  f32_bits hb = {xc};
  hb.u &= 0xfffff000u;
  const float xh = hb.f, xl = xc - xh;
  const float sh = 0.5f * (xh * xh), sl = 0.5f * (xl * (xh + xc)); /* x^2/2 = sh + sl, sh exact */
#endif
  const float shift = 12582912.0f;                                 /* 1.5 * 2^23: rounds to an integer */
  const float kb = PMADD(sh, -1.44269504f, shift);                     /* k = round(-sh / ln 2), in [-122, 0] */
  const float k = kb - shift;
  /* ln 2 = 0x1.62e4p-1 + rest: k times the first part is exact, and so is -sh less it */
  const float r = PMADD(k, -1.42860682e-06f, PMADD(k, -0x1.62e4p-1f, -sh)) - sl;
  float p = 1.98412701e-04f;                                               /* 1/7!, ..., 1/0! */
  p = PMADD(p, r, 1.38888889e-03f);
  p = PMADD(p, r, 8.33333333e-03f);
  p = PMADD(p, r, 4.16666667e-02f);
  p = PMADD(p, r, 0.166666667f);
  p = PMADD(p, r, 0.5f);
  p = PMADD(p, r, 1.0f);
  p = PMADD(p, r, 1.0f);
  f32_bits kb_bits = {kb}, scale;
  scale.u = (kb_bits.u - 0x4b400000u + 127u) << 23; /* 2^k */
  const float e = p * scale.f;
  *ex2 = ax < 13.0f ? e : 0.0f; /* NaN and infinities: 0, so x * exp(-x^2/2) stays NaN */

  /* 1 + erf(x/sqrt 2), from erfc(a) = exp(-a^2) Q(t) */
  const float a = xc * 0.70710678f;
  /* t to within about its last bit: Q moves 2.4 times t's relative error at a = 0 (where its
   * denominator, just above 1, rounds to 6e-8), and gelu's gradient, 0.5 there, allows 2e-7 */
#if defined(__FMA__)
  const float den = fmaf(a, ERFC_P, 1.0f), den_lo = fmaf(a, ERFC_P, 1.0f - den); /* 1 + a p = den + den_lo */
  const float t0 = 1.0f / den;
  const float t = fmaf(t0, fmaf(-t0, den_lo, fmaf(-t0, den, 1.0f)), t0); /* one Newton step on 1/(den + den_lo) */
#else
  const float t = (float)(1.0 / ((double)a * ERFC_P + 1.0)); /* exact product and sum, rounded once */
#endif
  float q = PMADD(erfc_q[7], t, erfc_q[6]); /* Horner, written out: gcc 12 vectorises no loop
                                             * around inner loops of fmaf */
  q = PMADD(q, t, erfc_q[5]);
  q = PMADD(q, t, erfc_q[4]);
  q = PMADD(q, t, erfc_q[3]);
  q = PMADD(q, t, erfc_q[2]);
  q = PMADD(q, t, erfc_q[1]);
  q = PMADD(q, t, erfc_q[0]);
  const float erfc = *ex2 * q;
  *erf1p = x > 0 ? 2.0f - erfc : erfc;
}

#define INV_SQRT2PI_F 0.39894228040143267794f /* 1/sqrt(2 pi) */

/* the exact GELU, x Phi(x), as ebb__gelu */
static GELU_FN void gelu_f32(float *o, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float e1, ex2;
    gelu_parts(x[i], &e1, &ex2);
    o[i] = 0.5f * x[i] * e1;
  }
}

/* its derivative Phi(x) + x phi(x), as ebb__gelu_grad */
static inline GELU_FN float gelu_grad_one(float x) {
  float e1, ex2;
  gelu_parts(x, &e1, &ex2);
  return 0.5f * e1 + x * ex2 * INV_SQRT2PI_F;
}

static GELU_FN void gelu_grad_f32(float *o, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) o[i] = gelu_grad_one(x[i]);
}

/* gelu's backward, g * gelu'(x), in one pass: the product of the gradient above rounded to f32
 * and g, as the two passes (gradient, then multiply) gave; o may be g or x */
static GELU_FN void gelu_bwd_f32(float *o, const float *g, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) o[i] = g[i] * gelu_grad_one(x[i]);
}

/* ---- the elementwise ops in f32 ---------------------------------------------------------------- */


#define FOR_N(body)                                                                                        \
  for (int64_t i = 0; i < n; i++) body

static void ew(int op, float *o, const float *x, const float *y, const float *z, int64_t n, double s0, double s1) {
  float t[CH]; /* n <= CH */
  switch (op) {
  case EBB__EW_COPY:
    if (o != x) memmove(o, x, (size_t)n * 4);
    return;
  case EBB__EW_NEG: for (int64_t i = 0; i < n; i++) o[i] = -x[i]; return;
  case EBB__EW_ABS: for (int64_t i = 0; i < n; i++) o[i] = fabsf(x[i]); return;
  case EBB__EW_EXP: map_exp(o, x, n); return;
  case EBB__EW_LOG: map_log(o, x, n); return;
  case EBB__EW_SQRT: for (int64_t i = 0; i < n; i++) o[i] = sqrtf(x[i]); return;
  case EBB__EW_SIN: map_sin(o, x, n); return;
  case EBB__EW_COS: map_cos(o, x, n); return;
  case EBB__EW_TANH: map_tanh(o, x, n); return;
  case EBB__EW_SIGMOID: /* e = exp(-|x|) <= 1: 1/(1+e) for x >= 0, e/(1+e) below, never inf/inf */
    for (int64_t i = 0; i < n; i++) t[i] = -fabsf(x[i]);
    map_exp(t, t, n);
    for (int64_t i = 0; i < n; i++) o[i] = (x[i] >= 0 ? 1.0f : t[i]) / (1.0f + t[i]);
    return;
  case EBB__EW_RELU: for (int64_t i = 0; i < n; i++) o[i] = x[i] > 0 ? x[i] : 0.0f; return;
  case EBB__EW_GELU: /* the exact GELU, x Phi(x), as ebb__gelu */
    gelu_f32(o, x, n);
    return;
  case EBB__EW_GELU_GRAD: /* Phi(x) + x phi(x), as ebb__gelu_grad */
    gelu_grad_f32(o, x, n);
    return;
  case EBB__EW_GELU_BWD: /* x is the incoming gradient, y gelu's input */
    gelu_bwd_f32(o, x, y, n);
    return;
  case EBB__EW_POWS:
    if (s0 == 2.0) { /* x*x rounds once, as pow in f64 then to f32 does */
      for (int64_t i = 0; i < n; i++) o[i] = x[i] * x[i];
    } else if (s0 == 1.0) {
      if (o != x) memmove(o, x, (size_t)n * 4);
    } else if ((double)(float)s0 == s0) {
      map_pow(o, x, (float)s0, n);
    } else { /* an exponent f32 cannot hold: f64 */
      for (int64_t i = 0; i < n; i++) o[i] = (float)pow(x[i], s0);
    }
    return;
  case EBB__EW_CLAMP: { /* compared in f64: the bounds need not be f32 */
    const float lo = (float)s0, hi = (float)s1;
    for (int64_t i = 0; i < n; i++) { /* NaN fails both tests and stays; the lower bound wins */
      const double v = x[i];
      const float r = v > s1 ? hi : x[i];
      o[i] = v < s0 ? lo : r;
    }
    return;
  }
  /* the scalar ops: as ebb__ew_f, in f64 and rounded once; when s0 is an f32 that is the f32
   * operation itself (+ - * / of two f32 round alike in f32 and in f64), at twice the width */
  case EBB__EW_ADDS:
    if ((double)(float)s0 == s0) FOR_N(o[i] = x[i] + (float)s0);
    else FOR_N(o[i] = (float)((double)x[i] + s0));
    return;
  case EBB__EW_MULS:
    if ((double)(float)s0 == s0) FOR_N(o[i] = x[i] * (float)s0);
    else FOR_N(o[i] = (float)((double)x[i] * s0));
    return;
  case EBB__EW_RSUBS:
    if ((double)(float)s0 == s0) FOR_N(o[i] = (float)s0 - x[i]);
    else FOR_N(o[i] = (float)(s0 - (double)x[i]));
    return;
  case EBB__EW_DIVS:
    if ((double)(float)s0 == s0) FOR_N(o[i] = x[i] / (float)s0);
    else FOR_N(o[i] = (float)((double)x[i] / s0));
    return;
  case EBB__EW_RDIVS:
    if ((double)(float)s0 == s0) FOR_N(o[i] = (float)s0 / x[i]);
    else FOR_N(o[i] = (float)(s0 / (double)x[i]));
    return;
  case EBB__EW_SIGN: for (int64_t i = 0; i < n; i++) o[i] = x[i] > 0 ? 1.0f : x[i] < 0 ? -1.0f : 0.0f; return;
  case EBB__EW_CLAMP_MASK:
    for (int64_t i = 0; i < n; i++) o[i] = (double)x[i] >= s0 && (double)x[i] <= s1 ? 1.0f : 0.0f;
    return;
  case EBB__EW_LT_S: for (int64_t i = 0; i < n; i++) o[i] = (double)x[i] < s0 ? 1.0f : 0.0f; return;
  case EBB__EW_GT_S: for (int64_t i = 0; i < n; i++) o[i] = (double)x[i] > s0 ? 1.0f : 0.0f; return;
  case EBB__EW_SQUARE: for (int64_t i = 0; i < n; i++) o[i] = x[i] * x[i]; return;
  /* binary: + - * / of two f32 round to the f32 that the f64 result rounds to */
  case EBB__EW_ADD: for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i]; return;
  case EBB__EW_SUB: for (int64_t i = 0; i < n; i++) o[i] = x[i] - y[i]; return;
  case EBB__EW_MUL: for (int64_t i = 0; i < n; i++) o[i] = x[i] * y[i]; return;
  case EBB__EW_DIV: for (int64_t i = 0; i < n; i++) o[i] = x[i] / y[i]; return;
  case EBB__EW_EQ: for (int64_t i = 0; i < n; i++) o[i] = x[i] == y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_NE: for (int64_t i = 0; i < n; i++) o[i] = x[i] != y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_LT: for (int64_t i = 0; i < n; i++) o[i] = x[i] < y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_LE: for (int64_t i = 0; i < n; i++) o[i] = x[i] <= y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_GT: for (int64_t i = 0; i < n; i++) o[i] = x[i] > y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_GE: for (int64_t i = 0; i < n; i++) o[i] = x[i] >= y[i] ? 1.0f : 0.0f; return;
  case EBB__EW_MAXIMUM: for (int64_t i = 0; i < n; i++) o[i] = x[i] != x[i] || x[i] > y[i] ? x[i] : y[i]; return;
  case EBB__EW_WHERE: for (int64_t i = 0; i < n; i++) o[i] = x[i] != 0 ? y[i] : z[i]; return;
  /* the fused updates: ebb__ew_f's formulas in f64, in its order of operations */
  case EBB__EW_ADD_SCALED: FOR_N(o[i] = (float)((double)x[i] + s0 * (double)y[i])); return;
  case EBB__EW_ADDCMUL: FOR_N(o[i] = (float)((double)x[i] + s0 * (double)y[i] * (double)z[i])); return;
  case EBB__EW_ADDCDIV: FOR_N(o[i] = (float)((double)x[i] + s0 * (double)y[i] / (double)z[i])); return;
  case EBB__EW_LERP:
    if (s0 < 0.5) FOR_N(o[i] = (float)((double)x[i] + s0 * ((double)y[i] - (double)x[i])));
    else FOR_N(o[i] = (float)((double)y[i] - ((double)y[i] - (double)x[i]) * (1.0 - s0)));
    return;
  default: /* an op without a loop of its own: ebb__ew_f's formula, in f64 */
    for (int64_t i = 0; i < n; i++) o[i] = (float)ebb__ew_f(op, x[i], y ? y[i] : 0, z ? z[i] : 0, s0, s1);
    return;
  }
}
#pragma GCC diagnostic pop

/* ---- conversions -------------------------------------------------------------------------------- */

static float load_one(const char *p, int dt) {
  switch (dt) {
  case EBB__KDT_F32: return ebb__raw_f32(p);
  case EBB__KDT_BF16: return ebb__bf16_to_f32(ebb__raw_u16(p));
  case EBB__KDT_F16: return ebb__f16_to_f32(ebb__raw_u16(p));
  default: return *(const unsigned char *)p ? 1.0f : 0.0f;
  }
}

static void load(float *dst, const char *src, int64_t stride, int64_t n, int dt) {
  if (stride == 0) {
    const float v = load_one(src, dt);
    for (int64_t i = 0; i < n; i++) dst[i] = v;
    return;
  }
  switch (dt) {
  case EBB__KDT_F32:
    if (stride == 4) memcpy(dst, src, (size_t)n * 4);
    else
      for (int64_t i = 0; i < n; i++) dst[i] = ebb__raw_f32(src + i * stride);
    return;
  case EBB__KDT_BF16:
    if (stride == 2) {
      for (int64_t i = 0; i < n; i++) dst[i] = ebb__bf16_to_f32(ebb__raw_u16(src + 2 * i));
    } else {
      for (int64_t i = 0; i < n; i++) dst[i] = ebb__bf16_to_f32(ebb__raw_u16(src + i * stride));
    }
    return;
  case EBB__KDT_F16: {
    int64_t i = 0;
#if defined(__F16C__)
    if (stride == 2)
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
    for (; i < n; i++) dst[i] = ebb__f16_to_f32(ebb__raw_u16(src + i * stride));
    return;
  }
  default:
    for (int64_t i = 0; i < n; i++) dst[i] = src[i * stride] ? 1.0f : 0.0f;
    return;
  }
}

static void store(char *dst, int64_t stride, const float *src, int64_t n, int dt) {
  switch (dt) {
  case EBB__KDT_F32:
    if (stride == 4) memmove(dst, src, (size_t)n * 4);
    else
      for (int64_t i = 0; i < n; i++) ebb__raw_put_f32(dst + i * stride, src[i]);
    return;
  case EBB__KDT_BF16:
    if (stride == 2) {
      for (int64_t i = 0; i < n; i++) ebb__raw_put_u16(dst + 2 * i, ebb__f32_to_bf16(src[i]));
    } else {
      for (int64_t i = 0; i < n; i++) ebb__raw_put_u16(dst + i * stride, ebb__f32_to_bf16(src[i]));
    }
    return;
  case EBB__KDT_F16: {
    int64_t i = 0;
#if defined(__F16C__)
    /* F16C rounds to nearest even like ebb__f32_to_f16, saturating to infinity alike */
    if (stride == 2)
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) ebb__raw_put_u16(dst + i * stride, ebb__f32_to_f16(src[i]));
    return;
  }
  default:
    for (int64_t i = 0; i < n; i++) dst[i * stride] = src[i] != 0.0f;
    return;
  }
}

/* ---- sums ---------------------------------------------------------------------------------------- */

/* NACC partial sums, element i into partial i % NACC, then folded in halves: one fixed order,
 * whatever the vector width, so every table gives the same sum. */
#define NACC 32

static double sum_f32(const float *p, int64_t n) {
  double acc[NACC] = {0};
  int64_t i = 0;
  for (; i + NACC <= n; i += NACC)
    for (int k = 0; k < NACC; k++) acc[k] += p[i + k];
  for (int64_t k = 0; k < n - i; k++) acc[k] += p[i + k]; /* fewer than NACC left */
  for (int w = NACC / 2; w > 0; w /= 2)
    for (int k = 0; k < w; k++) acc[k] += acc[k + w];
  return acc[0];
}

static double sum_f64(const double *p, int64_t n) {
  double acc[NACC] = {0};
  int64_t i = 0;
  for (; i + NACC <= n; i += NACC)
    for (int k = 0; k < NACC; k++) acc[k] += p[i + k];
  for (int64_t k = 0; k < n - i; k++) acc[k] += p[i + k]; /* fewer than NACC left */
  for (int w = NACC / 2; w > 0; w /= 2)
    for (int k = 0; k < w; k++) acc[k] += acc[k + w];
  return acc[0];
}

static void add_cols_f32(double *restrict acc, const float *restrict p, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc[i] += p[i];
}

static void add_cols_f64(double *restrict acc, const double *restrict p, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc[i] += p[i];
}

const ebb__vec_ops VEC_CAT(ebb__vec_, EBB__VEC_NAME) = {
    .name = VEC_STR(EBB__VEC_NAME),
    .ew = ew,
    .load = load,
    .store = store,
    .sum_f32 = sum_f32,
    .sum_f64 = sum_f64,
    .add_cols_f32 = add_cols_f32,
    .add_cols_f64 = add_cols_f64,
};
