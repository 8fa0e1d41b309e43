/* ebb/optim.h: parameter lists and optimizers (SGD, AdamW) whose step updates every parameter
 * in place with one fused pass per tensor on the CPU and one kernel launch per device and dtype.
 *
 * Where it lives and why. An optimizer reads each parameter's gradient from autograd's `.grad`
 * (ebb_tensor_grad), or from gradients the caller passes (ebb_optim_step_grads), so its objects
 * belong to autograd/, the layer that owns `.grad`; the update itself is arithmetic on tensors,
 * so its kernels (the CPU loops and the CUDA twin) live in ops/ with the other kernels, and
 * autograd calls them through ops' export header as it calls the rest of ops. ops/ knows nothing
 * of autograd: it is handed tensors and never reads `.grad`.
 *
 * A step is never recorded: it runs with grad mode off (whatever the caller's), and changes the
 * parameters in place, bumping each updated parameter's version counter once, so a node that
 * saved a parameter before the step refuses to run after it (as after any in-place op).
 * Semantics follow PyTorch's torch.optim.SGD and torch.optim.AdamW (foreach=False); the
 * arithmetic is f32 for f32, bf16 and f16 parameters (their state is stored in the parameter's
 * dtype, as PyTorch stores it) and f64 for f64 ones.
 *
 * Streams: on a device, a step enqueues its work on the device's current stream (for the calling
 * thread) and returns; a backward leaves the caller's current streams ordered after the
 * gradients it wrote, so backward then step on the same thread needs no wait. State tensors are
 * allocated on the first step that updates their parameter, on its device and stream.
 *
 * Handles: a parameter list and an optimizer are created by the caller and destroyed once;
 * destroying twice, or using a destroyed handle, is EBB_EFREED (records are type-stable and
 * reused first in, first out after 1024 more destructions, so a stale handle is caught until
 * then). Parameters added to a list are retained by it; an optimizer retains its own copy of the
 * list's parameters and groups when created, so the list may be destroyed (or changed) at once.
 * Both must be destroyed before the last ebb_shutdown (they hold tensors).
 * Threading: calls on different lists or optimizers are independent. Calls on one optimizer
 * (step, zero_grad, set_lr) must not overlap: the caller orders them, as two steps at once would
 * race on the parameters anyway. A list's calls likewise.
 * Errors: a status and ebb_last_error naming the call, the parameter (its index, its name when it
 * has one, dtype, shape, device) and what was expected. A failing call changes nothing: a step
 * checks every parameter and gradient before it updates any.
 */
#ifndef EBB_OPTIM_H
#define EBB_OPTIM_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb_params ebb_params_t;
typedef struct ebb_optim ebb_optim_t;

/* ---- parameter lists -------------------------------------------------------------------------
 * An ordered list of parameters, each in one group. Group 0 always exists and takes the
 * optimizer's lr and weight_decay; groups made with ebb_params_add_group carry their own. A
 * parameter is a floating leaf tensor (ebb_tensor_is_leaf), contiguous, on the CPU or a device;
 * it need not require a gradient (a parameter without one is skipped by every step). */

EBB_API ebb_status ebb_params_create(ebb_params_t **out);
/* Releases the list's references. EBB_EFREED when already destroyed; NULL is EBB_EINVAL. */
EBB_API ebb_status ebb_params_destroy(ebb_params_t *pl);
/* Appends t to group 0 (retained). Errors: EBB_EINVAL for NULL, a non-floating dtype, a tensor
 * that is not a leaf, a non-contiguous tensor, or one whose storage is already a parameter's in
 * this list (the same tensor or a view of it: it would be updated twice); EBB_EFREED for a
 * released t or a destroyed list. */
EBB_API ebb_status ebb_params_add(ebb_params_t *pl, ebb_tensor_t *t);
/* A new group with its own lr (>= 0) and weight_decay (>= 0); *group gets its index (1, 2, ...).
 * EBB_EINVAL for a negative or NaN value. */
EBB_API ebb_status ebb_params_add_group(ebb_params_t *pl, double lr, double weight_decay, int *group);
/* Appends t to `group` (0 or a group made by ebb_params_add_group). Errors as ebb_params_add's,
 * and EBB_EINVAL for a group that does not exist. */
EBB_API ebb_status ebb_params_add_to(ebb_params_t *pl, int group, ebb_tensor_t *t);
/* Number of parameters in the list (all groups). */
EBB_API ebb_status ebb_params_count(const ebb_params_t *pl, int *out);

/* ---- optimizers ------------------------------------------------------------------------------ */

/* torch.optim.SGD: with g the gradient (negated when maximize) plus weight_decay * p,
 *   momentum != 0: buf = g at the parameter's first step, else momentum * buf + (1 - dampening) * g;
 *                  g = nesterov ? g + momentum * buf : buf
 *   p -= lr * g
 * A zero-initialised struct is plain SGD with lr 0: set lr. Refused (EBB_EINVAL): lr, momentum or
 * weight_decay negative or NaN; nesterov without momentum or with dampening != 0. */
typedef struct ebb_sgd_options {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
} ebb_sgd_options;

/* torch.optim.AdamW: with t the parameter's own step count (after this step's increment),
 *   p *= 1 - lr * weight_decay                     (decoupled weight decay)
 *   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g   (m, v start at 0)
 *   amsgrad: vmax = max(vmax, v), used for v below
 *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * Start from ebb_adamw_defaults() (PyTorch's: lr 1e-3, betas 0.9 and 0.999, eps 1e-8,
 * weight_decay 1e-2). Refused (EBB_EINVAL): lr, eps or weight_decay negative or NaN; a beta
 * outside [0, 1). */
typedef struct ebb_adamw_options {
  double lr;
  double beta1, beta2;
  double eps;
  double weight_decay;
  bool amsgrad;
  bool maximize;
} ebb_adamw_options;
EBB_API ebb_adamw_options ebb_adamw_defaults(void);

/* Creates an optimizer over pl's parameters and groups as they are now (each parameter retained;
 * pl is borrowed). Errors: EBB_EINVAL for NULL arguments, options out of range (naming the
 * option and its value), an empty list; EBB_EFREED for a destroyed list. */
EBB_API ebb_status ebb_optim_sgd(const ebb_params_t *pl, const ebb_sgd_options *opts, ebb_optim_t **out);
EBB_API ebb_status ebb_optim_adamw(const ebb_params_t *pl, const ebb_adamw_options *opts, ebb_optim_t **out);
/* Releases the parameters and the state. EBB_EFREED when already destroyed. */
EBB_API ebb_status ebb_optim_destroy(ebb_optim_t *opt);

/* One update of every parameter from its .grad (ebb_tensor_grad); a parameter without one is
 * skipped, its state and step count unchanged, as in PyTorch. Errors: EBB_EFREED for a destroyed
 * optimizer or a parameter released since (naming params[i]: the optimizer's reference keeps it
 * alive, so only a caller's over-release can do that); EBB_ENOMEM for state that cannot be
 * allocated; a launch's error on a device. Nothing is updated when a check fails. A launch that
 * fails after other parameters were updated (CPU parameters first, then one launch per device
 * and dtype) leaves those updated, and counted: their step counts (ebb_optim_step_count) and
 * state move with them, so a count always says how many updates its parameter took (AdamW's
 * bias correction stays right after a retry). */
EBB_API ebb_status ebb_optim_step(ebb_optim_t *opt);
/* The same with the gradients given: grads[i] for parameter i (in list order), NULL to skip it;
 * n must be the number of parameters. .grad is not read. Errors, besides ebb_optim_step's:
 * EBB_EINVAL for NULL grads, a wrong n, or a gradient whose shape or dtype is not its
 * parameter's (naming both); EBB_EDEVICE for one on another device; EBB_EFREED for a released
 * gradient. */
EBB_API ebb_status ebb_optim_step_grads(ebb_optim_t *opt, const ebb_tensor_t *const *grads, int n);
/* Clears every parameter's .grad: set_to_none drops it (ebb_tensor_set_grad(p, NULL): the next
 * backward allocates it afresh, PyTorch's default), else fills it with zeros in place on the
 * current stream of its device. */
EBB_API ebb_status ebb_optim_zero_grad(ebb_optim_t *opt, bool set_to_none);

/* The learning rate of `group` (0 and the list's added groups); group -1 sets every group's.
 * Takes effect at the next step. EBB_EINVAL for a negative or NaN lr or an unknown group. */
EBB_API ebb_status ebb_optim_set_lr(ebb_optim_t *opt, int group, double lr);
EBB_API ebb_status ebb_optim_lr(const ebb_optim_t *opt, int group, double *out);
/* param -1: the number of successful steps of the optimizer; param i: the number of steps that
 * updated parameter i (AdamW's bias correction counts these). EBB_EINVAL out of range. */
EBB_API ebb_status ebb_optim_step_count(const ebb_optim_t *opt, int param, int64_t *out);
/* A state tensor of parameter `param`, a new reference, NULL (with EBB_OK) before its first
 * update or when the optimizer keeps no such state: "momentum_buffer" (SGD with momentum),
 * "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (AdamW, the last with amsgrad). The tensor is the
 * optimizer's own: writing to it changes the next step. EBB_EINVAL for an unknown name or
 * param out of range. */
EBB_API ebb_status ebb_optim_state(const ebb_optim_t *opt, int param, const char *name, ebb_tensor_t **out);

#ifdef __cplusplus
}
#endif
#endif /* EBB_OPTIM_H */
