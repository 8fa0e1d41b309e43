/* optim_export.h: ops' fused optimizer update, for autograd's optimizers (autograd/optim.c,
 * include/ebb/optim.h). Hidden in libebb, never installed.
 *
 * ops owns the arithmetic and the launches; the caller owns the parameter list, the state
 * tensors and where gradients come from. One call updates a list of parameters in place: on the
 * CPU one pass per tensor (reading parameter, gradient and state once, writing parameter and
 * state once), on each device one kernel launch per dtype, on the device's current stream, after
 * one upload of the launch's tensor table on the same stream.
 */
#ifndef EBB_OPTIM_EXPORT_H
#define EBB_OPTIM_EXPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/tensor.h"
#include "ebb_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kinds and flags (the same definitions as ops/optim_kernels.h's, which the kernels see). */
#define EBB__OPTIM_SGD 0
#define EBB__OPTIM_ADAMW 1
#define EBB__OPTIM_NESTEROV 1u /* SGD */
#define EBB__OPTIM_AMSGRAD 2u  /* AdamW */
#define EBB__OPTIM_MAXIMIZE 4u /* both: the gradient is negated */

/* What every parameter of one call shares. */
typedef struct ebb__optim_hyper {
  int kind;
  uint32_t flags;
  double momentum, dampening;
  double beta1, beta2, eps;
} ebb__optim_hyper;

/* One parameter's update. state[k] are contiguous tensors of the parameter's shape, dtype and
 * device, the caller's (SGD: [0] the momentum buffer, or NULL without momentum; AdamW: [0]
 * exp_avg, [1] exp_avg_sq, [2] max_exp_avg_sq with amsgrad, else NULL); `first` says they hold
 * nothing yet (they are written, never read). */
typedef struct ebb__optim_item {
  ebb_tensor_t *param;
  const ebb_tensor_t *grad;
  ebb_tensor_t *state[3];
  double lr, weight_decay;
  int64_t step;  /* AdamW: this update's step count, 1 for the first */
  bool first;
  int index;     /* the parameter's index in the optimizer, for messages: "params[3]" */
} ebb__optim_item;

/* Checks every item (live parameter and gradient, gradient of the parameter's shape, dtype and
 * device, parameter contiguous and floating), then updates them all: the in-place hook runs for
 * each parameter (ops_export.h, ebb__inplace_check: the caller turns grad mode off first, as an
 * optimizer's step has nothing to record), each parameter's version is bumped once. A gradient
 * that is not contiguous is read through a contiguous copy. Failures name fn and the parameter
 * (params[index]); nothing is updated when a check fails. A launch that fails on a device after
 * other parameters were updated (CPU ones at once, other groups enqueued) leaves those updated:
 * updated[i] (may be NULL; n entries) says which items were, on success and on failure, so the
 * caller counts their steps. Not thread-safe for one list of parameters (the caller orders its
 * steps). */
EBB_HIDDEN ebb_status ebb__optim_fused(const char *fn, const ebb__optim_hyper *h, const ebb__optim_item *items, int n,
                                       bool *updated);

#ifdef __cplusplus
}
#endif
#endif /* EBB_OPTIM_EXPORT_H */
