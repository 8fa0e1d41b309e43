/* scaled_mul.h: a small third-party library built on ebb/custom_op.h, for the tests: the op
 * "ebbtest.scaled_mul" with its own kernel image ("ebbtest": a fatbin when the build has nvcc,
 * else none) and its backward.
 *
 * (x, w) -> (y = alpha * x * w, mask = 1 where x * w > 0 else 0), x and w of one shape, f32 or
 * f64, on one device; alpha comes in the call's args (ebbtest_smul_params, NULL: 1). mask is
 * declared non-differentiable. setup_context saves x and w; backward returns alpha * g * w and
 * alpha * g * x, each only when needed, with the same kernel. */
#ifndef EBBTEST_SCALED_MUL_H
#define EBBTEST_SCALED_MUL_H

#include "ebb/custom_op.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebbtest_smul_params {
  double alpha;
} ebbtest_smul_params;

/* The op's definition (name "ebbtest.scaled_mul"), for a test to register as it is or changed. */
void ebbtest_scaled_mul_def(ebb_custom_op_def *def);

/* The library's fatbin (NULL when built without nvcc), and its kernel's CPU function. */
const void *ebbtest_image(void);
void ebbtest_smul_cpu(void *args);

/* Calls of the library's callbacks since the process started, for the tests. */
extern long ebbtest_forward_calls, ebbtest_backward_calls;

#ifdef __cplusplus
}
#endif

#endif
