/* kernels_rows_body.h: the fused row kernels' loops (ebb__rows_args, ops_kernels.h), one text
 * compiled once per instruction set. The including file defines ROWS_ISA_AVX512, ROWS_ISA_AVX2,
 * ROWS_ISA_SSE2 or ROWS_ISA_SCALAR and compiles with that set's flags (ops/CMakeLists.txt);
 * kernels_rows.c picks the widest one the CPU has at run time. The vector width and the
 * vector operations are macros over that set's intrinsics; exp is SLEEF's (1.0-ulp) for the
 * same width, the leftover elements of a row (fewer than a vector) use libm's expf.
 *
 * Each op walks one row at a time: the row (a few KiB) stays in the first-level cache across
 * the op's passes (its max, its sum, its output), so memory sees one read of each input and
 * one write of the output. Sums over a row accumulate in f32 vectors, lane by lane, then
 * across lanes: the same order on every call, so results repeat exactly.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(ROWS_ISA_AVX512)
#include <immintrin.h>
#include <sleef.h>
typedef __m512 V;
#define VW 16
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_SET(x) _mm512_set1_ps(x)
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_EXP(a) Sleef_expf16_u10avx512f(a)
#define ROWS_FN(name) name##_avx512
#elif defined(ROWS_ISA_AVX2)
#include <immintrin.h>
#include <sleef.h>
typedef __m256 V;
#define VW 8
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_SET(x) _mm256_set1_ps(x)
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_EXP(a) Sleef_expf8_u10avx2(a)
#define ROWS_FN(name) name##_avx2
#elif defined(ROWS_ISA_SSE2)
#include <emmintrin.h>
#include <sleef.h>
typedef __m128 V;
#define VW 4
#define V_LOAD(p) _mm_loadu_ps(p)
#define V_STORE(p, v) _mm_storeu_ps((p), (v))
#define V_SET(x) _mm_set1_ps(x)
#define V_ADD(a, b) _mm_add_ps((a), (b))
#define V_SUB(a, b) _mm_sub_ps((a), (b))
#define V_MUL(a, b) _mm_mul_ps((a), (b))
#define V_MAX(a, b) _mm_max_ps((a), (b))
#define V_FMA(a, b, c) _mm_add_ps(_mm_mul_ps((a), (b)), (c))
#define V_EXP(a) Sleef_expf4_u10sse2(a)
#define ROWS_FN(name) name##_sse2
#elif defined(ROWS_ISA_SCALAR)
typedef float V;
#define VW 1
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET(x) (x)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_MUL(a, b) ((a) * (b))
#define V_MAX(a, b) ((a) > (b) ? (a) : (b))
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_EXP(a) expf(a)
#define ROWS_FN(name) name##_scalar
#else
#error "define one ROWS_ISA_* before including kernels_rows_body.h"
#endif

#include "ops_kernels.h"

static inline float hsum(V v) {
  float t[VW];
  V_STORE(t, v);
  float s = 0;
  for (int k = 0; k < VW; k++) s += t[k];
  return s;
}

static inline float hmax(V v) {
  float t[VW];
  V_STORE(t, v);
  float m = t[0];
  for (int k = 1; k < VW; k++) m = t[k] > m ? t[k] : m;
  return m;
}

/* The largest element (a NaN in the row makes every later result of the row NaN anyway: it
 * reaches the sum of exponentials). */
static float row_max(const float *x, int64_t n) {
  V m = V_SET(-INFINITY);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) m = V_MAX(m, V_LOAD(x + i));
  float r = hmax(m);
  for (; i < n; i++) r = x[i] > r ? x[i] : r;
  return r;
}

static float row_sum(const float *x, int64_t n) {
  V s = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) s = V_ADD(s, V_LOAD(x + i));
  float r = hsum(s);
  for (; i < n; i++) r += x[i];
  return r;
}

static float row_dot(const float *x, const float *y, int64_t n) {
  V s = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) s = V_FMA(V_LOAD(x + i), V_LOAD(y + i), s);
  float r = hsum(s);
  for (; i < n; i++) r += x[i] * y[i];
  return r;
}

/* sum of exp(x - m); y (NULL: not kept) receives the exponentials. */
static float row_expsum(float *y, const float *x, float m, int64_t n) {
  const V vm = V_SET(m);
  V s = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    V e = V_EXP(V_SUB(V_LOAD(x + i), vm));
    if (y) V_STORE(y + i, e);
    s = V_ADD(s, e);
  }
  float r = hsum(s);
  for (; i < n; i++) {
    float e = expf(x[i] - m);
    if (y) y[i] = e;
    r += e;
  }
  return r;
}

static void row_scale(float *y, float k, int64_t n) {
  const V vk = V_SET(k);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) V_STORE(y + i, V_MUL(V_LOAD(y + i), vk));
  for (; i < n; i++) y[i] *= k;
}

static void row_fill(float *y, float v, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = v;
}

static void softmax_row(float *y, const float *x, int64_t n) {
  const float m = row_max(x, n);
  row_scale(y, 1.0f / row_expsum(y, x, m, n), n);
}

/* (x - m) - log(sum): the small log(sum) is not added to a large max first, where f32 would round
 * it away (a confident row's values would lose their digits). */
static void log_softmax_row(float *y, const float *x, int64_t n) {
  const float m = row_max(x, n);
  const float l = logf(row_expsum(NULL, x, m, n));
  const V vm = V_SET(m), vl = V_SET(l);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) V_STORE(y + i, V_SUB(V_SUB(V_LOAD(x + i), vm), vl));
  for (; i < n; i++) y[i] = (x[i] - m) - l;
}

/* out = y (g - sum(g y)) */
static void softmax_bwd_row(float *out, const float *y, const float *g, int64_t n) {
  const float ds = row_dot(g, y, n);
  const V d = V_SET(ds);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) V_STORE(out + i, V_MUL(V_LOAD(y + i), V_SUB(V_LOAD(g + i), d)));
  for (; i < n; i++) out[i] = y[i] * (g[i] - ds);
}

/* out = g - exp(y) sum(g) */
static void log_softmax_bwd_row(float *out, const float *y, const float *g, int64_t n) {
  const float sg = row_sum(g, n);
  const V vs = V_SET(sg);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) V_STORE(out + i, V_SUB(V_LOAD(g + i), V_MUL(V_EXP(V_LOAD(y + i)), vs)));
  for (; i < n; i++) out[i] = g[i] - expf(y[i]) * sg;
}

/* Mean and 1/sqrt(var + eps) of a row, the variance from the deviations (two passes over the
 * cached row: no cancellation of a large mean). */
static void row_stats(const float *x, int64_t n, double eps, float *mean, float *rstd) {
  const float mu = row_sum(x, n) / (float)n;
  const V vm = V_SET(mu);
  V s = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    V d = V_SUB(V_LOAD(x + i), vm);
    s = V_FMA(d, d, s);
  }
  float v = hsum(s);
  for (; i < n; i++) v += (x[i] - mu) * (x[i] - mu);
  *mean = mu;
  *rstd = (float)(1.0 / sqrt((double)v / (double)n + eps));
}

static void ln_fwd_row(float *y, const float *x, const float *w, const float *b, int64_t n, double eps) {
  float mu, rs;
  row_stats(x, n, eps, &mu, &rs);
  const V vm = V_SET(mu), vr = V_SET(rs), one = V_SET(1.f), zero = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    V t = V_MUL(V_SUB(V_LOAD(x + i), vm), vr);
    V_STORE(y + i, V_FMA(t, w ? V_LOAD(w + i) : one, b ? V_LOAD(b + i) : zero));
  }
  for (; i < n; i++) y[i] = (x[i] - mu) * rs * (w ? w[i] : 1.f) + (b ? b[i] : 0.f);
}

/* With xhat = (x - mean) rstd and gw = g w: out = rstd (gw - mean(gw) - xhat mean(gw xhat));
 * gwo += g xhat and gbo += g when given (the weight's and the bias's gradients, summed over
 * rows by the caller's loop). */
static void ln_bwd_row(float *out, const float *x, const float *g, const float *w, float *gwo, float *gbo, int64_t n,
                       double eps) {
  float mu, rs;
  row_stats(x, n, eps, &mu, &rs);
  const V vm = V_SET(mu), vr = V_SET(rs), one = V_SET(1.f);
  V s1 = V_SET(0.f), s2 = V_SET(0.f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    V xh = V_MUL(V_SUB(V_LOAD(x + i), vm), vr), gi = V_LOAD(g + i);
    V gx = V_MUL(gi, w ? V_LOAD(w + i) : one);
    s1 = V_ADD(s1, gx);
    s2 = V_FMA(gx, xh, s2);
    if (gwo) V_STORE(gwo + i, V_FMA(gi, xh, V_LOAD(gwo + i)));
    if (gbo) V_STORE(gbo + i, V_ADD(V_LOAD(gbo + i), gi));
  }
  float a1 = hsum(s1), a2 = hsum(s2);
  for (int64_t j = i; j < n; j++) {
    float xh = (x[j] - mu) * rs, gx = g[j] * (w ? w[j] : 1.f);
    a1 += gx;
    a2 += gx * xh;
    if (gwo) gwo[j] += g[j] * xh;
    if (gbo) gbo[j] += g[j];
  }
  const float m1 = a1 / (float)n, m2 = a2 / (float)n;
  const V v1 = V_SET(m1), v2 = V_SET(m2);
  for (i = 0; i + VW <= n; i += VW) {
    V xh = V_MUL(V_SUB(V_LOAD(x + i), vm), vr);
    V gx = V_MUL(V_LOAD(g + i), w ? V_LOAD(w + i) : one);
    V_STORE(out + i, V_MUL(vr, V_SUB(V_SUB(gx, v1), V_MUL(xh, v2))));
  }
  for (; i < n; i++) {
    float xh = (x[i] - mu) * rs, gx = g[i] * (w ? w[i] : 1.f);
    out[i] = rs * (gx - m1 - xh * m2);
  }
}

/* Rows [r0, r1) of the op (the weight and bias gradients of LN_BWD are zeroed by the caller). */
void ROWS_FN(ebb__rows_run)(const ebb__rows_args *a, int64_t r0, int64_t r1) {
  const int64_t n = a->cols;
  for (int64_t r = r0; r < r1; r++) {
    const float *x = a->x + r * n, *g = a->g ? a->g + r * n : NULL;
    float *y = a->out + r * n;
    switch (a->op) {
    case EBB__ROWS_SOFTMAX: softmax_row(y, x, n); break;
    case EBB__ROWS_LOG_SOFTMAX: log_softmax_row(y, x, n); break;
    case EBB__ROWS_SOFTMAX_BWD: softmax_bwd_row(y, x, g, n); break;
    case EBB__ROWS_LOG_SOFTMAX_BWD: log_softmax_bwd_row(y, x, g, n); break;
    case EBB__ROWS_CE_FWD: {
      const int64_t t = a->target[r];
      if (t < 0 || t >= n) {
        a->out[r] = NAN;
        break;
      }
      const float m = row_max(x, n);
      a->out[r] = (m - x[t]) + logf(row_expsum(NULL, x, m, n)); /* small terms kept apart from m */
      break;
    }
    case EBB__ROWS_CE_BWD: {
      const int64_t t = a->target[r];
      const float k = (float)((double)a->g[0] * a->s0);
      if (t < 0 || t >= n) {
        row_fill(y, NAN, n);
        break;
      }
      const float m = row_max(x, n);
      row_scale(y, k / row_expsum(y, x, m, n), n);
      y[t] -= k;
      break;
    }
    case EBB__ROWS_LN_FWD: ln_fwd_row(y, x, a->w, a->b, n, a->s0); break;
    case EBB__ROWS_LN_BWD: ln_bwd_row(y, x, g, a->w, a->gw_out, a->gb_out, n, a->s0); break;
    default: break;
    }
  }
}

#undef VW
#undef V_LOAD
#undef V_STORE
#undef V_SET
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_MAX
#undef V_FMA
#undef V_EXP
#undef ROWS_FN
