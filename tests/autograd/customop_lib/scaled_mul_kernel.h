/* scaled_mul_kernel.h: the argument struct of the test library's kernel, shared by its CPU
 * function (scaled_mul.c) and its CUDA function (cuda/scaled_mul.cu), so plain C with
 * fixed-width fields. y[i] = alpha * a[i] * b[i] and, when mask is set, mask[i] = 1 where
 * a[i] * b[i] > 0, else 0; n contiguous elements of f32 (dtype 0) or f64 (dtype 1). */
#ifndef EBBTEST_SCALED_MUL_KERNEL_H
#define EBBTEST_SCALED_MUL_KERNEL_H

#include <stdint.h>

typedef struct ebbtest_smul_args {
  int64_t n;
  int32_t dtype; /* 0: f32, 1: f64 */
  int32_t pad_;
  double alpha;
  const void *a, *b;
  void *y;
  void *mask; /* NULL: none */
} ebbtest_smul_args;

#endif
