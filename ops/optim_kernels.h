/* optim_kernels.h: the fused optimizer kernel ("ebb.ops.optim"): its argument struct, the
 * per-tensor table it reads, and the update of one element, written once for the CPU loops
 * (optim.c, which serve CPU tensors and the emulated driver) and the CUDA kernel
 * (cuda/optim_kernels.cuh). Plain C and C++ with fixed-width fields, like ops_kernels.h.
 *
 * One launch updates every parameter of one dtype on one device: the argument struct points at a
 * table in the device's memory that lists each tensor (its parameter, gradient and state
 * pointers, its element count and its own scalars) and, for the CUDA kernel, the chunks of
 * EBB__OPTIM_CHUNK elements that its blocks take one at a time. The table is uploaded on the
 * launch's stream before it, so the argument struct stays a few dozen bytes whatever the number
 * of tensors (a kernel's parameters are limited to 4 KiB).
 */
#ifndef EBB_OPTIM_KERNELS_H
#define EBB_OPTIM_KERNELS_H

#include <stdint.h>

#include "ops_math.h"

/* The kinds and flags, also defined by ops/export/optim_export.h for the caller: identical
 * macro definitions may repeat, and a difference fails to compile optim.c, which includes both. */
#define EBB__OPTIM_SGD 0
#define EBB__OPTIM_ADAMW 1
#define EBB__OPTIM_NESTEROV 1u /* SGD */
#define EBB__OPTIM_AMSGRAD 2u  /* AdamW */
#define EBB__OPTIM_MAXIMIZE 4u /* both: the gradient is negated */

#define EBB__OPTIM_CHUNK 65536 /* elements per block-sized piece of work (CUDA) */

/* One parameter's update. Scalars are computed on the host in f64, as PyTorch computes them in
 * Python: SGD uses lr and wd; AdamW uses decay = 1 - lr * wd, step_size = lr / (1 - beta1^t) and
 * bc2_sqrt = sqrt(1 - beta2^t). */
typedef struct ebb__optim_tensor {
  void *p;          /* the parameter */
  const void *g;    /* its gradient, same dtype, contiguous */
  void *s0;         /* SGD: the momentum buffer (NULL without momentum); AdamW: exp_avg */
  void *s1;         /* AdamW: exp_avg_sq */
  void *s2;         /* AdamW with amsgrad: max_exp_avg_sq */
  int64_t n;        /* elements */
  double lr, wd;
  double decay, step_size, bc2_sqrt;
  int32_t first;    /* the state holds nothing yet: SGD sets buf = g, AdamW reads 0 */
  int32_t pad_;
} ebb__optim_tensor;

/* A block's piece of work (CUDA): elements [start, start + EBB__OPTIM_CHUNK) of tensor `tensor`. */
typedef struct ebb__optim_chunk {
  int32_t tensor;
  int32_t pad_;
  int64_t start;
} ebb__optim_chunk;

typedef struct ebb__optim_args {
  int32_t kind;     /* EBB__OPTIM_SGD or EBB__OPTIM_ADAMW */
  int32_t dtype;    /* EBB__KDT_*: every tensor of the launch has it */
  int32_t ntensors;
  int32_t nchunks;
  uint32_t flags;   /* EBB__OPTIM_* */
  int32_t pad_;
  double momentum, dampening; /* SGD */
  double beta1, beta2, eps;   /* AdamW */
  const ebb__optim_tensor *tensors; /* [ntensors], in the launch device's memory */
  const ebb__optim_chunk *chunks;   /* [nchunks], after the tensors in the same table */
} ebb__optim_args;

/* ---- one element ----------------------------------------------------------------------------
 * In the order PyTorch's single-tensor loops apply their in-place ops, each rounded to the
 * arithmetic's precision as those ops round: f32 for f32, bf16 and f16 parameters, f64 for f64
 * ones (the float and double twins below). *p, *g, *s are values already loaded as that type. */

static inline EBB__HD float ebb__sgd_f(float p, float g, float *buf, int first, float lr, float wd, float mom, float damp1,
                                       uint32_t flags) {
  float d = (flags & EBB__OPTIM_MAXIMIZE) ? -g : g;
  if (wd != 0.0f) d = d + wd * p;
  if (mom != 0.0f) {
    float b = first ? d : *buf * mom + damp1 * d;
    *buf = b;
    d = (flags & EBB__OPTIM_NESTEROV) ? d + mom * b : b;
  }
  return p + -lr * d;
}

static inline EBB__HD double ebb__sgd_d(double p, double g, double *buf, int first, double lr, double wd, double mom, double damp1,
                                        uint32_t flags) {
  double d = (flags & EBB__OPTIM_MAXIMIZE) ? -g : g;
  if (wd != 0.0) d = d + wd * p;
  if (mom != 0.0) {
    double b = first ? d : *buf * mom + damp1 * d;
    *buf = b;
    d = (flags & EBB__OPTIM_NESTEROV) ? d + mom * b : b;
  }
  return p + -lr * d;
}

/* m, v and vmax hold the old state (ignored when first) and receive the new. */
static inline EBB__HD float ebb__adamw_f(float p, float g, float *m, float *v, float *vmax, int first, float decay, float step_size,
                                         float bc2_sqrt, float b1, float b1c, float b2, float b2c, float eps, uint32_t flags) {
  if (flags & EBB__OPTIM_MAXIMIZE) g = -g;
  p = p * decay;
  float mo = first ? 0.0f : *m, vo = first ? 0.0f : *v;
  float mn = mo * b1 + b1c * g;
  float vn = vo * b2 + b2c * (g * g);
  *m = mn;
  *v = vn;
  if (flags & EBB__OPTIM_AMSGRAD) {
    float x = first ? 0.0f : *vmax;
    vn = x > vn ? x : vn;
    *vmax = vn;
  }
  float denom = sqrtf(vn) / bc2_sqrt + eps;
  return p + -step_size * (mn / denom);
}

static inline EBB__HD double ebb__adamw_d(double p, double g, double *m, double *v, double *vmax, int first, double decay,
                                          double step_size, double bc2_sqrt, double b1, double b1c, double b2, double b2c, double eps,
                                          uint32_t flags) {
  if (flags & EBB__OPTIM_MAXIMIZE) g = -g;
  p = p * decay;
  double mo = first ? 0.0 : *m, vo = first ? 0.0 : *v;
  double mn = mo * b1 + b1c * g;
  double vn = vo * b2 + b2c * (g * g);
  *m = mn;
  *v = vn;
  if (flags & EBB__OPTIM_AMSGRAD) {
    double x = first ? 0.0 : *vmax;
    vn = x > vn ? x : vn;
    *vmax = vn;
  }
  double denom = sqrt(vn) / bc2_sqrt + eps;
  return p + -step_size * (mn / denom);
}

#endif /* EBB_OPTIM_KERNELS_H */
