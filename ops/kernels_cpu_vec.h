/* kernels_cpu_vec.h: the CPU kernels' vector loops (kernels_cpu_vec.c), built once per
 * instruction set and chosen at run time.
 *
 * kernels_cpu_vec.c is compiled three times on x86-64: as is (the baseline, SSE2), with AVX2,
 * FMA and F16C (kernels_cpu_vec_avx2.c) and with AVX-512 F/BW/DQ/VL (kernels_cpu_vec_avx512.c);
 * each build fills one table of these functions. ebb__vec_pick() returns the widest table the
 * processor and the operating system support, so no build of ebb needs a newer processor than
 * x86-64 and none is held to it. Elsewhere only the baseline table exists.
 *
 * The loops work on arrays: the f32 math of every unary, scalar, binary and where op, the
 * conversions between f32 and the storage dtypes (f32, bf16, f16, bool), and the sums in f64.
 * The tables agree exactly on the sums (one fixed order of partial sums whatever the vector
 * width), the conversions (of NaN, on its being NaN: the bits of an f16 NaN may differ between a
 * table's hardware conversion and its scalar tail), + - * / sqrt, the comparisons, the scalar
 * ops and the fused updates;
 * the transcendental ops may differ in their last bits between tables (SLEEF's functions
 * differ by width), each within its
 * error bound. A given machine gives the
 * same result every run. Pure functions of their arguments: safe on any thread.
 */
#ifndef EBB_OPS_KERNELS_CPU_VEC_H
#define EBB_OPS_KERNELS_CPU_VEC_H

#include <stdint.h>

/* Plain C for the white-box test too (tests/ops/test_ops_kernels_vec.cpp): only the visibility
 * macro, defined as ebb_internal.h defines it. */
#ifndef EBB_HIDDEN
#if defined(__GNUC__)
#define EBB_HIDDEN __attribute__((visibility("hidden")))
#else
#define EBB_HIDDEN
#endif
#endif

/* Elements per chunk of the f32 loops: 4 KiB per operand, four operands in L1. */
#define EBB__VEC_CHUNK 1024

typedef struct ebb__vec_ops {
  const char *name; /* "baseline", "avx2", "avx512" */
  /* o[i] = op(x[i], y[i], z[i]) for i < n (n <= EBB__VEC_CHUNK), op an EBB__EW_* code other
   * than fill, arange and the random ones. In f32, as libtorch computes f32 tensors, except
   * where that would change a result the f64 formula gives: the scalar ops (x op s0) and the
   * comparisons with a scalar run in f64 (s0 need not be an f32), and + - * / sqrt, computed in
   * f32, round to the same f32 as in f64. The transcendental ops (exp, log, sin, cos, tanh,
   * sigmoid, pow) use SLEEF's f32 functions (error below 1 ulp) when ebb is built with SLEEF,
   * libm's f32 functions otherwise; gelu and its gradient have their own f32 loop (within 4 ulp
   * or 1e-7, and 4 ulp or 2e-7; kernels_cpu_vec.c), with or without SLEEF. o may be x, y or z (in place); inputs
   * an op does not use may be NULL. */
  void (*ew)(int op, float *o, const float *x, const float *y, const float *z, int64_t n, double s0, double s1);
  /* dst[i] = element i of src as f32 (exact), elements `stride` bytes apart (0: one element
   * repeated); dt is f32, bf16, f16 or bool. */
  void (*load)(float *dst, const char *src, int64_t stride, int64_t n, int dt);
  /* The reverse: each f32 rounded to dt (nearest even; bool: v != 0). */
  void (*store)(char *dst, int64_t stride, const float *src, int64_t n, int dt);
  /* The sum of p[0..n) in f64, added in a fixed order of 32 partial sums. */
  double (*sum_f32)(const float *p, int64_t n);
  double (*sum_f64)(const double *p, int64_t n);
  /* acc[i] += p[i] for i < n: one row of a sum over the rows. */
  void (*add_cols_f32)(double *acc, const float *p, int64_t n);
  void (*add_cols_f64)(double *acc, const double *p, int64_t n);
} ebb__vec_ops;

EBB_HIDDEN extern const ebb__vec_ops ebb__vec_baseline;
#if defined(__x86_64__)
EBB_HIDDEN extern const ebb__vec_ops ebb__vec_avx2;
EBB_HIDDEN extern const ebb__vec_ops ebb__vec_avx512;
#endif

/* The table for this processor (kernels_cpu.c): chosen once, at load. EBB_CPU_VEC=baseline
 * or avx2 in the environment caps the choice (to test the narrower paths on a wide machine). */
EBB_HIDDEN const ebb__vec_ops *ebb__vec_pick(void);

#endif /* EBB_OPS_KERNELS_CPU_VEC_H */
