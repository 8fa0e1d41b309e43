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

/* The scratch arrays below (e, t, u) are written for i < n before a map reads them; GCC, not
 * relating the two loops, would call them uninitialised (a map's input is a pointer to const). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#ifdef VW
/* 1 + erf(x) in f32 (GELU's 2 Phi(x sqrt 2)), from SLEEF's exp and two polynomials; 2.5x faster
 * than 1 + SLEEF's erff (which keeps a 1-ulp bound with extended-precision steps; figures in
 * perf/RESULTS.md), within 3 ulp of erf, and exact where erf nears -1 (1 + erf cancels there):
 *   |x| < 1:  1 + x P(x^2), P interpolating erf(sqrt(s))/sqrt(s) on s in [0, 1];
 *   |x| >= 1: erfc(|x|) = exp(-x^2) Q(1/|x|), then 2 - erfc for x > 0, erfc itself for x < 0;
 *             Q interpolates erfc(1/t) exp(1/t^2) on t in [1/4, 1], and a second one (R) on
 *             [1/10, 1/4]; past |x| = 10 erfc is below f32's least subnormal and exp gives 0.
 * Coefficients: Chebyshev interpolation in f64 (degrees 6, 8 and 5) turned into monomials and
 * rounded to f32. Every lane computes both forms and keeps one, so the loops vectorise. */
static const float erf_p[7] = {1.12837917f,     -0.376126267f,    0.112835947f,   -0.026854212f,
                               0.00518908742f, -0.000801686428f, 7.87587505e-05f};
static const float erf_q[9] = {0.000305017749f, 0.55847992f,    0.0458379092f,  -0.485939508f,   0.529070575f,
                               -0.286535608f,   0.0613541498f, 0.0109451333f, -0.00593402247f};
static const float erf_r[6] = {9.41210965e-06f, 0.563829899f, 0.00559718022f,
                               -0.327256858f,   0.195424736f, 0.0335453898f};

/* a*b + c, rounded twice: fmaf here (to fuse only the polynomials, as the exact ops must not
 * be) kept gcc 12 from vectorising the loop (scalar vfmadd213ss, gelu 4x slower) */
#define MADD(a, b, c) ((a) * (b) + (c))

static inline float erf_p_at(float s) {
  float v = erf_p[6];
  for (int k = 5; k >= 0; k--) v = MADD(v, s, erf_p[k]);
  return v;
}

/* The loop for a chunk with some |x| >= 1, e[i] = exp(-x[i]^2); `far` says whether some |x|
 * reaches 4 (R is evaluated only then: inlined twice, once with far constant false). */
static inline void erf1p_tail(float *o, const float *x, const float *e, int64_t n, const bool far) {
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(x[i]), ps = erf_p_at(a * a);
    const float t = 1.0f / (a > 1.0f ? a : 1.0f);
    float qs = erf_q[8];
    for (int k = 7; k >= 0; k--) qs = MADD(qs, t, erf_q[k]);
    if (far) {
      float rs = erf_r[5];
      for (int k = 4; k >= 0; k--) rs = MADD(rs, t, erf_r[k]);
      qs = t >= 0.25f ? qs : rs;
    }
    const float erfc = e[i] * qs;
    const float tail = x[i] > 0 ? 2.0f - erfc : erfc;
    const float res = a < 1.0f ? 1.0f + x[i] * ps : tail;
    o[i] = x[i] != x[i] ? x[i] : res;
  }
}

static void map_erf1p(float *o, const float *x, int64_t n) {
  /* a chunk within |x| < 1 (no NaN) needs neither exp nor the tail polynomials */
  int mid = 0, far = 0;
  for (int64_t i = 0; i < n; i++) {
    mid |= !(fabsf(x[i]) < 1.0f);
    far |= !(fabsf(x[i]) < 4.0f);
  }
  if (!mid) {
    for (int64_t i = 0; i < n; i++) o[i] = 1.0f + x[i] * erf_p_at(x[i] * x[i]);
    return;
  }
  float e[CH]; /* n <= CH */
  for (int64_t i = 0; i < n; i++) e[i] = -x[i] * x[i];
  map_exp(e, e, n);
  if (far) erf1p_tail(o, x, e, n, true);
  else erf1p_tail(o, x, e, n, false);
}
#else
static void map_erf1p(float *o, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) o[i] = erfcf(-x[i]);
}
#endif

/* ---- the elementwise ops in f32 ---------------------------------------------------------------- */

#define SQRT1_2F 0.70710678118654752440f  /* 1/sqrt(2) */
#define INV_SQRT2PI_F 0.39894228040143267794f /* 1/sqrt(2 pi) */

#define FOR_N(body)                                                                                        \
  for (int64_t i = 0; i < n; i++) body

static void ew(int op, float *o, const float *x, const float *y, const float *z, int64_t n, double s0, double s1) {
  float t[CH], u[CH]; /* n <= CH */
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
    for (int64_t i = 0; i < n; i++) t[i] = x[i] * SQRT1_2F;
    map_erf1p(t, t, n);
    for (int64_t i = 0; i < n; i++) o[i] = 0.5f * x[i] * t[i];
    return;
  case EBB__EW_GELU_GRAD: /* Phi(x) + x phi(x), as ebb__gelu_grad */
    for (int64_t i = 0; i < n; i++) t[i] = x[i] * SQRT1_2F;
    for (int64_t i = 0; i < n; i++) u[i] = -0.5f * x[i] * x[i];
    map_erf1p(t, t, n);
    map_exp(u, u, n);
    for (int64_t i = 0; i < n; i++) o[i] = 0.5f * t[i] + x[i] * u[i] * INV_SQRT2PI_F;
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
