/* ops_kernels.h: the argument structs of ops' kernels, shared by the CPU kernels
 * (kernels_cpu.c) and the CUDA kernels of the same names (cuda/ops_kernels.cu), so it is plain
 * C and C++ with fixed-width fields only. cuLaunchKernel copies one struct per launch; the CUDA
 * kernels take it by value as their single parameter.
 */
#ifndef EBB_OPS_KERNELS_H
#define EBB_OPS_KERNELS_H

#include <stdint.h>

#define EBB__KMAX_DIMS 8 /* EBB_TENSOR_MAX_DIMS */

/* Element types as the kernels see them: the codes of ebb_dtype (ebb/tensor.h, which the CUDA
 * side does not include; ops_impl.h asserts that the two agree). */
enum ebb__kdtype { EBB__KDT_F32 = 0, EBB__KDT_F64, EBB__KDT_BF16, EBB__KDT_F16, EBB__KDT_I64, EBB__KDT_BOOL };

/* ---- kernels ---------------------------------------------------------------------------------
 * One strided elementwise kernel ("ebb.ops.ew") serves creation (fill, arange, rand), copies and
 * casts, unary, scalar, binary, comparison and where ops: `op` picks the function. Operands are
 * given after broadcasting (stride 0 along broadcast dims) and dim coalescing. */
enum ebb__ew_op {
  EBB__EW_FILL = 0, EBB__EW_ARANGE, EBB__EW_RAND, EBB__EW_RANDN, EBB__EW_COPY,
  /* unary: out = f(in0), parameters s0, s1 */
  EBB__EW_NEG, EBB__EW_ABS, EBB__EW_EXP, EBB__EW_LOG, EBB__EW_SQRT, EBB__EW_SIN, EBB__EW_COS, EBB__EW_TANH,
  EBB__EW_SIGMOID, EBB__EW_RELU, EBB__EW_GELU, EBB__EW_POWS, EBB__EW_CLAMP, EBB__EW_ADDS, EBB__EW_MULS,
  EBB__EW_RSUBS, EBB__EW_DIVS, EBB__EW_RDIVS, EBB__EW_SIGN, EBB__EW_GELU_GRAD, EBB__EW_CLAMP_MASK,
  EBB__EW_LT_S, EBB__EW_GT_S, EBB__EW_SQUARE,
  /* binary: out = in0 op in1 */
  EBB__EW_ADD, EBB__EW_SUB, EBB__EW_MUL, EBB__EW_DIV, EBB__EW_EQ, EBB__EW_NE, EBB__EW_LT, EBB__EW_LE, EBB__EW_GT,
  EBB__EW_GE, EBB__EW_MAXIMUM,
  /* ternary: out = in0 ? in1 : in2 */
  EBB__EW_WHERE,
  /* the fused in-place updates (ops/inplace.c), in0 being dst: in0 + s0 * in1; lerp of in0
   * towards in1 by s0; in0 + s0 * in1 * in2; in0 + s0 * in1 / in2 */
  EBB__EW_ADD_SCALED, EBB__EW_LERP, EBB__EW_ADDCMUL, EBB__EW_ADDCDIV,
  /* binary, gelu's backward in one pass: in0 (grad) times gelu'(in1) */
  EBB__EW_GELU_BWD,
  EBB__EW_COUNT
};

typedef struct ebb__ew_args {
  int32_t op;
  int32_t ndim;                /* 0: one element */
  int32_t nin;
  int32_t dt_out;
  int32_t dt_in[3];
  int32_t pad_;
  int64_t shape[EBB__KMAX_DIMS];
  int64_t st_out[EBB__KMAX_DIMS]; /* element strides */
  int64_t st_in[3][EBB__KMAX_DIMS];
  void *out;                   /* element 0 of each operand */
  const void *in[3];
  double s0, s1;               /* scalar parameters */
  uint64_t seed, offset;       /* generator key and first counter (rand, randn) */
} ebb__ew_args;

/* Reductions ("ebb.ops.reduce"): for each output element (outer dims), combine the inner dims of
 * the input. `idx` (i64, may be NULL) receives the inner linear index of the max. */
enum ebb__red_op { EBB__RED_SUM = 0, EBB__RED_MEAN, EBB__RED_MAX };

typedef struct ebb__red_args {
  int32_t op;
  int32_t dt_in, dt_out;
  int32_t nouter, ninner;
  int32_t pad_;
  int64_t oshape[EBB__KMAX_DIMS];
  int64_t ost_in[EBB__KMAX_DIMS];  /* input strides of the outer dims */
  int64_t ost_out[EBB__KMAX_DIMS]; /* output strides of the outer dims */
  int64_t ishape[EBB__KMAX_DIMS];
  int64_t ist_in[EBB__KMAX_DIMS];
  const void *in;
  void *out;
  int64_t *idx;                         /* strided like out, or NULL */
} ebb__red_args;

/* Batched matmul ("ebb.ops.matmul"): C[b] = A[b] @ B[b] + beta * C[b], f32 or f64, each matrix
 * with a row stride (lda etc.) and unit column stride, or transposed (trans flags). With beta 0
 * C is only written (never read: it may hold anything, NaN included). */
typedef struct ebb__mm_args {
  int32_t dtype;
  int32_t trans_a, trans_b;
  int32_t pad_;
  int64_t batch, m, n, k;
  int64_t lda, ldb, ldc;
  int64_t sa, sb, sc;                   /* batch strides in elements */
  const void *a, *b;
  void *c;
  double beta;                          /* 0, or 1 to add into C (linear's bias, copied there first) */
} ebb__mm_args;

/* Row kernels ("ebb.ops.rows"): the fused softmax, log_softmax, cross_entropy and layer_norm,
 * forward and backward, over `rows` contiguous rows of `cols` f32 elements (the last dim, or
 * the last dims flattened for layer_norm). Each row is read from memory once and kept in cache
 * for the passes its op makes, so an op costs one read of its inputs and one write of its
 * output. Every pointer is element 0 of a contiguous tensor (f32 unless noted).
 *   SOFTMAX, LOG_SOFTMAX:         out = f(x)
 *   SOFTMAX_BWD:                  out = y (g - sum(g y))                 (x: y, g: grad)
 *   LOG_SOFTMAX_BWD:              out = g - exp(y) sum(g)                (x: y, g: grad)
 *   CE_FWD:                       out[r] = logsumexp(x[r]) - x[r, target[r]]  (out: [rows])
 *   CE_BWD:                       out = (softmax(x) - onehot(target)) * g[0] * s0
 *   LN_FWD:                       out = (x - mean) rstd w + b, rstd = (var + s0)^-1/2 (w, b may be NULL)
 *   LN_BWD:                       out = rstd (gw - mean(gw) - xhat mean(gw xhat)), gw = g w; and
 *                                 gw_out = sum over rows of g xhat, gb_out = sum of g (each may be NULL)
 * A target outside [0, cols) gives that row a NaN loss and NaN gradients. */
enum ebb__rows_op {
  EBB__ROWS_SOFTMAX = 0, EBB__ROWS_LOG_SOFTMAX, EBB__ROWS_SOFTMAX_BWD, EBB__ROWS_LOG_SOFTMAX_BWD,
  EBB__ROWS_CE_FWD, EBB__ROWS_CE_BWD, EBB__ROWS_LN_FWD, EBB__ROWS_LN_BWD, EBB__ROWS_COUNT
};

typedef struct ebb__rows_args {
  int32_t op;
  int32_t pad_;
  int64_t rows, cols;
  const float *x, *g, *w, *b;
  const int64_t *target;
  float *out;
  float *gw_out, *gb_out;
  double s0;
} ebb__rows_args;

#endif /* EBB_OPS_KERNELS_H */
