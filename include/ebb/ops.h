/* ebb/ops.h: raw ops on tensors (forward) and their backward math (vector-Jacobian products).
 *
 * Every op returns a new contiguous tensor through `out` (one reference for the caller) on the
 * device of its inputs; inputs must share a device (EBB_EDEVICE otherwise: copy first with
 * ebb_tensor_to_device). Ops on CPU tensors finish before they return; ops on device tensors are
 * enqueued on the device's current stream and return at once (see tensor.h).
 *
 * Broadcasting: two shapes are aligned at their last dims; each pair of extents must be equal or
 * one of them 1 (a missing leading dim counts as 1); the result takes the larger extent.
 *
 * Type promotion (binary ops and where): the same dtype gives itself; bool with anything gives
 * the other dtype; i64 with a floating dtype gives the floating dtype; two floating dtypes give
 * the wider one (f64 > f32 > bf16, f16), except that bf16 with f16 gives f32. Then, per op:
 *  - add, sub, mul: the promoted dtype; bool with bool is EBB_EINVAL (no arithmetic on bool);
 *  - div (true division) and the floating functions (exp, log, sqrt, sin, cos, tanh, sigmoid,
 *    gelu, pow_scalar): an integer or bool result dtype becomes f32;
 *  - neg, abs, relu, clamp: the input's dtype (neg and abs of bool are EBB_EINVAL);
 *  - scalar ops (add/sub/mul_scalar): a floating tensor keeps its dtype; an i64 or bool tensor
 *    gives i64 when the scalar is an integer value and f32 otherwise; div_scalar as div;
 *  - comparisons give bool; where(cond, a, b) needs a bool cond and gives promote(a, b).
 * Arithmetic: values are as if computed in f64 on the CPU and emulated devices and rounded once
 * to the result dtype (bf16 and f16 therefore accumulate in at least f32), except that exp,
 * log, sin, cos, tanh, sigmoid, pow, gelu and gelu's backward on f32, bf16 and f16 tensors are
 * computed in f32, as libtorch computes them, within a few f32 ulps of that value; i64 add,
 * sub, mul, neg, abs, clamp and comparisons are exact (overflow wraps).
 *
 * Backward: each differentiable op has ebb_op_<name>_backward beside it. Given the gradient of
 * the loss with respect to the op's output (`grad`, the output's shape), it returns the gradient
 * with respect to each requested input (pass NULL for those not wanted), with that input's
 * shape and dtype: broadcast dims are summed back (ebb_op_sum_to_shape). Only floating inputs
 * have gradients (EBB_EINVAL when one of another dtype is requested). Unary backward functions
 * take the forward input x and output y; each says which it reads (the other may be NULL; given,
 * it must be live: a released one is EBB_EFREED, as everywhere).
 *
 * Autograd (ebb/autograd.h) records the forward ops, the views and the copies. The backward
 * functions and ebb_op_sum_to_shape are gradient helpers it does not record: its engine calls
 * them with grad mode off, and so should a caller (with grad mode on and inputs that require
 * gradients, their results carry a partial graph of the ops inside them).
 *
 * Failures: EBB_EINVAL (NULL, shapes that do not broadcast, dtypes that do not promote, dims out
 * of range), EBB_EDEVICE (inputs on different devices), EBB_EFREED (a released tensor),
 * EBB_ENOMEM; the message names the op, the argument and the shapes.
 * Threading: every function is thread-safe.
 */
#ifndef EBB_OPS_H
#define EBB_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The dtype of a binary op's result before the per-op rule (see above). EBB_EINVAL for a dtype
 * outside the enum. */
EBB_API ebb_status ebb_op_promote(ebb_dtype a, ebb_dtype b, ebb_dtype *out);

/* ---- binary, with broadcasting -------------------------------------------------------------- */
EBB_API ebb_status ebb_op_add(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_sub(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_mul(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_div(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
/* grad_a = sum_to(a) grad; grad_b = sum_to(b) grad (sub: -grad). */
EBB_API ebb_status ebb_op_add_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                       ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);
EBB_API ebb_status ebb_op_sub_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                       ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);
/* grad_a = sum_to(a) grad * b; grad_b = sum_to(b) grad * a. */
EBB_API ebb_status ebb_op_mul_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                       ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);
/* grad_a = sum_to(a) grad / b; grad_b = sum_to(b) -grad * a / b^2. */
EBB_API ebb_status ebb_op_div_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                       ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);

/* ---- with a scalar -------------------------------------------------------------------------- */
EBB_API ebb_status ebb_op_add_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_sub_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_mul_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_div_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out);
/* x^p elementwise. */
EBB_API ebb_status ebb_op_pow_scalar(const ebb_tensor_t *a, double p, ebb_tensor_t **out);
/* min(max(x, lo), hi); NaN stays NaN. EBB_EINVAL when lo > hi. */
EBB_API ebb_status ebb_op_clamp(const ebb_tensor_t *a, double lo, double hi, ebb_tensor_t **out);
/* add/sub_scalar: grad_a = grad; mul_scalar: grad * s; div_scalar: grad / s. */
EBB_API ebb_status ebb_op_add_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **grad_a);
EBB_API ebb_status ebb_op_mul_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **grad_a);
EBB_API ebb_status ebb_op_div_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **grad_a);
/* grad * p * x^(p-1) (reads x). */
EBB_API ebb_status ebb_op_pow_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double p, ebb_tensor_t **grad_x);
/* grad where lo <= x <= hi, else 0 (reads x). */
EBB_API ebb_status ebb_op_clamp_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double lo, double hi,
                                         ebb_tensor_t **grad_x);

/* ---- unary ---------------------------------------------------------------------------------- */
EBB_API ebb_status ebb_op_neg(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_abs(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_exp(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_log(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_sqrt(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_sin(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_cos(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_tanh(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_sigmoid(const ebb_tensor_t *a, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_relu(const ebb_tensor_t *a, ebb_tensor_t **out);
/* The exact GELU: x * Phi(x), Phi the standard normal CDF (through erf). */
EBB_API ebb_status ebb_op_gelu(const ebb_tensor_t *a, ebb_tensor_t **out);
/* Reads: neg none; abs x (sign); exp y; log x; sqrt y; sin x; cos x; tanh y; sigmoid y;
 * relu x (grad where x > 0); gelu x. */
EBB_API ebb_status ebb_op_neg_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_abs_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_exp_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_log_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_sqrt_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_sin_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_cos_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_tanh_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_sigmoid_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y,
                                           ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_relu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_gelu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **grad_x);

/* ---- comparisons (bool results) and where ----------------------------------------------------- */
EBB_API ebb_status ebb_op_eq(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_ne(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_lt(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_le(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_gt(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_ge(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
/* cond ? a : b, all three broadcast together. */
EBB_API ebb_status ebb_op_where(const ebb_tensor_t *cond, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
/* grad_a = sum_to(a) where(cond, grad, 0); grad_b = sum_to(b) where(cond, 0, grad). */
EBB_API ebb_status ebb_op_where_backward(const ebb_tensor_t *grad, const ebb_tensor_t *cond, const ebb_tensor_t *a,
                                         const ebb_tensor_t *b, ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);

/* ---- in place: dst op= src (src broadcast to dst's shape); bump dst's version once ---------- */
/* EBB_EINVAL when src does not broadcast to dst's shape (the result would need another shape),
 * when dst is expanded (stride 0), or when the promoted dtype is not dst's (e.g. f32 into i64). */
EBB_API ebb_status ebb_op_add_(ebb_tensor_t *dst, const ebb_tensor_t *src);
EBB_API ebb_status ebb_op_mul_(ebb_tensor_t *dst, const ebb_tensor_t *src);

/* The in-place updates of a training step (an optimizer's, above all), each one pass over dst
 * that allocates nothing (except a copy of a src that lies on dst's storage in another
 * geometry, made first on the same stream), computed like the out-of-place ops (f64 arithmetic
 * rounded once to dst's dtype) and bumping dst's version once:
 *  - add_scaled_: dst += alpha * src (PyTorch's add_(src, alpha=)); add_ is alpha 1;
 *  - add_scalar_: dst += s; mul_scalar_: dst *= s;
 *  - lerp_: dst += weight * (end - dst), computed from the nearer end so weight 1 gives end;
 *  - addcmul_: dst += value * t1 * t2; addcdiv_: dst += value * t1 / t2 (IEEE: x/0 is inf);
 *  - sqrt_: dst = sqrt(dst) (a negative element gives NaN); zero_: dst = 0 (as ebb_tensor_zero_).
 * Each tensor argument broadcasts to dst's shape, lives on dst's device, and has a dtype that
 * promotes with dst's to dst's (ops.h's rule: f32 dst with an f64 src is refused; bf16 or i64
 * into f32 is allowed). dst: numeric (not bool) for add_scaled_, add_scalar_ and mul_scalar_,
 * which stay exact on an i64 dst and need an integer scalar there; floating for lerp_,
 * addcmul_, addcdiv_ and sqrt_; any dtype for zero_.
 * Streams: as any op: on a device, enqueued on its current stream (a CPU dst finishes first).
 * Autograd (ebb/autograd.h): like add_ and mul_, each is recorded as dst's new grad_fn when
 * grad mode is on and dst or a src requires a gradient ("AddScaledInplaceBackward",
 * "AddScalarInplaceBackward", "MulScalarInplaceBackward", "LerpInplaceBackward",
 * "AddcmulInplaceBackward" and "AddcdivInplaceBackward", which save t1 and t2,
 * "SqrtInplaceBackward", which saves a copy of dst's old value, "ZeroBackward"), on a view
 * through its base; a leaf that requires a gradient (or a view of one) is refused while grad
 * mode is on, so an optimizer turns grad mode off for its step. With grad mode off nothing is
 * recorded, and a node that saved dst before fails its version check at backward.
 * Failures: EBB_EINVAL (NULL, a src that does not broadcast to dst's shape, a dtype dst cannot
 * hold, a non-integer scalar for an integer dst, dst expanded (stride 0), a leaf requiring a
 * gradient with grad mode on), EBB_EDEVICE (a src on another device), EBB_EFREED (a released
 * tensor), EBB_ENOMEM; the message names the call, the argument and the shapes. On failure
 * dst is unchanged. Threading: as any write, the caller orders it with dst's other users. */
EBB_API ebb_status ebb_op_add_scaled_(ebb_tensor_t *dst, const ebb_tensor_t *src, double alpha);
EBB_API ebb_status ebb_op_add_scalar_(ebb_tensor_t *dst, double s);
EBB_API ebb_status ebb_op_mul_scalar_(ebb_tensor_t *dst, double s);
EBB_API ebb_status ebb_op_lerp_(ebb_tensor_t *dst, const ebb_tensor_t *end, double weight);
EBB_API ebb_status ebb_op_addcmul_(ebb_tensor_t *dst, const ebb_tensor_t *t1, const ebb_tensor_t *t2, double value);
EBB_API ebb_status ebb_op_addcdiv_(ebb_tensor_t *dst, const ebb_tensor_t *t1, const ebb_tensor_t *t2, double value);
EBB_API ebb_status ebb_op_sqrt_(ebb_tensor_t *dst);
EBB_API ebb_status ebb_op_zero_(ebb_tensor_t *dst);

/* ---- shape helpers for gradients ---------------------------------------------------------------- */
/* Sums t down to `shape` (to which t's shape must broadcast): leading dims and dims where shape
 * has 1 are summed. Returns a contiguous tensor of t's dtype. */
EBB_API ebb_status ebb_op_sum_to_shape(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out);

/* ---- reductions ------------------------------------------------------------------------------
 * Over the `ndims` dims listed in `dims` (negative allowed, no repeats); ndims == 0 reduces
 * every dim to a scalar. keepdim keeps the reduced dims with extent 1. Accumulation is in f64.
 * sum: a floating input keeps its dtype, i64 and bool give i64, an empty reduction gives 0;
 * mean: floating (i64 -> f32), an empty reduction gives NaN; amax: the input's dtype, NaN if
 * any element is NaN; EBB_EINVAL on an empty reduced dim (amax and max_dim: a maximum of no
 * elements, as PyTorch refuses it). Along a non-empty dim of an empty tensor every reduction
 * gives an empty result; the backward functions give x's (empty) shape. */
EBB_API ebb_status ebb_op_sum(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_mean(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_amax(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out);
/* Max along one dim with the index (i64) of the first maximum. indices may be NULL when the
 * caller does not want them (values is required); they are computed all the same, since a
 * recorded MaxBackward keeps them for its backward. */
EBB_API ebb_status ebb_op_max_dim(const ebb_tensor_t *t, int dim, bool keepdim, ebb_tensor_t **values, ebb_tensor_t **indices);
/* grad broadcast back over the reduced dims (mean: divided by the count). x gives the shape. */
EBB_API ebb_status ebb_op_sum_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const int *dims, int ndims, bool keepdim,
                                       ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_mean_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const int *dims, int ndims, bool keepdim,
                                        ebb_tensor_t **grad_x);
/* grad shared evenly among the elements equal to the maximum (reads x and y = amax(x)). */
EBB_API ebb_status ebb_op_amax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, const int *dims,
                                        int ndims, bool keepdim, ebb_tensor_t **grad_x);
/* grad placed at the index of the maximum (reads x's shape and the indices of the forward). */
EBB_API ebb_status ebb_op_max_dim_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *indices, int dim,
                                           bool keepdim, ebb_tensor_t **grad_x);

/* ---- matmul ----------------------------------------------------------------------------------
 * a [..., m, k] @ b [..., k, n] -> [..., m, n]; both need >= 2 dims (unsqueeze a vector);
 * batch dims broadcast. f32 and f64 run as sgemm/dgemm: OpenBLAS on the CPU and the emulated
 * driver; on a GPU cuBLAS (loaded with dlopen) or, where it cannot be loaded, a plain CUDA
 * kernel (the GPU paths have not run on a GPU yet). bf16 and f16 are computed in f32 and
 * rounded; i64 and bool are EBB_EINVAL. A process may exit (with or without ebb_shutdown) while
 * matmuls run or are queued: CPU gemms already inside OpenBLAS finish first, and one that would
 * start after exit began never does (its thread waits for the process to end). Exit waits up to
 * 10 s for CPU matmuls in flight; one still running then is left to OpenBLAS's teardown, which
 * may hang on it. fork() likewise waits for those in flight (later ones wait for the fork), so
 * OpenBLAS's own fork handler never meets one, and the child starts with none. */
EBB_API ebb_status ebb_op_matmul(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
/* grad_a = grad @ b^T, grad_b = a^T @ grad, each summed to its input's shape. */
EBB_API ebb_status ebb_op_matmul_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                          ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);

/* ---- linear ----------------------------------------------------------------------------------
 * y = x @ w^T + b, PyTorch's convention: x [..., in_features] (at least 1 dim; the leading dims
 * are flattened into the GEMM's rows), w [out_features, in_features], b [out_features] or NULL;
 * y [..., out_features]. x, w and b share one floating dtype and one device. One GEMM with the
 * bias folded in (b is broadcast into y, then the GEMM adds x w^T to it), as matmul's: OpenBLAS
 * on the CPU and the emulated driver, cuBLAS or a plain CUDA kernel on a GPU (not yet run on
 * one); bf16 and f16 computed in f32 and rounded once. w and x are read in place when their
 * rows lie evenly in memory (a transpose() view of w too), else through a contiguous copy.
 * Failures: EBB_EINVAL (NULL; w not 2-D; x's last dim not in_features; b not [out_features]:
 * the message names both tensors and the expected shape; dtypes that differ or are not
 * floating), EBB_EDEVICE, EBB_EFREED, EBB_ENOMEM, EBB_ENOTSUP (2^31 rows or features). */
EBB_API ebb_status ebb_op_linear(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, ebb_tensor_t **out);
/* grad_x = grad @ w (x's shape), grad_w = grad^T @ x over the flattened leading dims, grad_b =
 * grad summed over its leading dims ([out_features]; b itself is not needed). grad has the
 * forward output's shape. Each of grad_x, grad_w, grad_b may be NULL (not all three); each
 * result has x's dtype. */
EBB_API ebb_status ebb_op_linear_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *w,
                                          ebb_tensor_t **grad_x, ebb_tensor_t **grad_w, ebb_tensor_t **grad_b);

/* ---- activations and losses -------------------------------------------------------------------- */
/* Along dim, computed stably (the max is subtracted first). Floating inputs only. A tensor with
 * no elements (an empty dim, along `dim` or another) gives an empty result of its shape, as in
 * PyTorch; so do the backward functions. */
EBB_API ebb_status ebb_op_softmax(const ebb_tensor_t *t, int dim, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_log_softmax(const ebb_tensor_t *t, int dim, ebb_tensor_t **out);
/* softmax: grad_x = y * (grad - sum(grad * y, dim)); log_softmax: grad - exp(y) * sum(grad, dim).
 * Both read y, the forward output. */
EBB_API ebb_status ebb_op_softmax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *y, int dim, ebb_tensor_t **grad_x);
EBB_API ebb_status ebb_op_log_softmax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *y, int dim, ebb_tensor_t **grad_x);
/* Mean over the batch of -log_softmax(logits)[i, target[i]]: logits [N, C] floating, target
 * [N] i64 with values in [0, C). Result: a scalar of logits' dtype. A target outside [0, C):
 * on the CPU both calls refuse it (EBB_EINVAL naming the row and the value); on a device the
 * targets are not read back (that would wait for the device), so nothing is refused: with f32
 * logits whose rows are contiguous (the fused kernel) the row's loss and gradient are NaN, which
 * shows in the loss; otherwise the row contributes 0 to the loss and its gradient lacks the -1.
 * Check targets where they are made when they may be wrong. */
EBB_API ebb_status ebb_op_cross_entropy(const ebb_tensor_t *logits, const ebb_tensor_t *target, ebb_tensor_t **out);
/* grad (a scalar) * (softmax(logits) - onehot(target)) / N; targets as for the forward. */
EBB_API ebb_status ebb_op_cross_entropy_backward(const ebb_tensor_t *grad, const ebb_tensor_t *logits, const ebb_tensor_t *target,
                                                 ebb_tensor_t **grad_logits);
/* mean((a - b)^2) over all elements, a and b of one shape; a scalar. */
EBB_API ebb_status ebb_op_mse_loss(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out);
/* grad_a = grad * 2 (a - b) / numel, grad_b = -grad_a. */
EBB_API ebb_status ebb_op_mse_loss_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                            ebb_tensor_t **grad_a, ebb_tensor_t **grad_b);
/* Normalises over the last `nnorm` dims: (x - mean) / sqrt(var + eps) * weight + bias, var the
 * biased variance; weight and bias (may be NULL) have the shape of those dims. */
EBB_API ebb_status ebb_op_layer_norm(const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *weight, const ebb_tensor_t *bias,
                                     double eps, ebb_tensor_t **out);
EBB_API ebb_status ebb_op_layer_norm_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *weight,
                                              const ebb_tensor_t *bias, double eps, ebb_tensor_t **grad_x,
                                              ebb_tensor_t **grad_weight, ebb_tensor_t **grad_bias);

/* ---- joining ---------------------------------------------------------------------------------- */
/* n tensors of one dtype and device whose shapes agree except along dim. */
EBB_API ebb_status ebb_op_cat(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out);
/* n tensors of one shape, joined along a new dim. */
EBB_API ebb_status ebb_op_stack(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out);
/* The slice of grad belonging to input i (a view of grad: cat -> narrow, stack -> select). */
EBB_API ebb_status ebb_op_cat_backward(const ebb_tensor_t *grad, const ebb_tensor_t *const *ts, int n, int dim, int i,
                                       ebb_tensor_t **grad_i);
EBB_API ebb_status ebb_op_stack_backward(const ebb_tensor_t *grad, int n, int dim, int i, ebb_tensor_t **grad_i);

/* ---- a library's own kernels ------------------------------------------------------------------
 * A kernel declared by the caller (ebb_kernel_declare_in of ebb/runtime.h, in the caller's own
 * image: a CPU function and a CUDA function name) launched on tensors as ops launch theirs: the
 * building block of a custom op's forward and backward (ebb/custom_op.h). */

/* A tensor a kernel touches: `write` when the kernel writes its storage, else it only reads it. */
typedef struct ebb_op_operand {
  const ebb_tensor_t *t;
  bool write;
} ebb_op_operand;

#define EBB_OP_LAUNCH_MAX_OPERANDS 16

/* Runs kernel `k` with the argument struct `args` (k's arg_bytes, copied at launch: the caller
 * may reuse it at once) over operands[0..n), 1 <= n <= EBB_OP_LAUNCH_MAX_OPERANDS, all on one
 * device. `args` carries what the kernel needs of the tensors (their data pointers from
 * ebb_tensor_data, shapes, strides); the operands say which storages it reads and writes:
 *  - CPU tensors: k's CPU function runs on the calling thread and is done when the call returns.
 *  - Device tensors: k is enqueued on the device's current stream (ebb_stream_current) and the
 *    call returns at once. Each operand's storage is declared as used on that stream (its memory
 *    is not reused until the kernel is done, as with ebb_tensor_record_stream) and as read or
 *    written by the launch (the buffers EBB_CHECK_LAUNCH=1 checks); the trace shows the launch
 *    under k's name. The grid is ceil(work / 256) blocks of 256 threads, at most 65535 blocks
 *    (the kernel loops grid-stride over the rest); work < 1 launches one block.
 * A kernel must write only operands declared as written, and read only operands given.
 * Failures (nothing launched): EBB_EINVAL for NULL k, args or operands, n out of range, a NULL
 * tensor in operands or a handle that is not a kernel of this ebb_init (the message names the
 * operand's index); EBB_EFREED for a released tensor; EBB_EDEVICE for operands on different
 * devices or a device in its error state; EBB_ENOTSUP when k has no function for the device (no
 * CPU function for CPU tensors, no CUDA function or an image without CUDA code on a GPU); a
 * failure to load k's image or launch it on the device, naming the kernel and the device.
 * Thread-safe. */
EBB_API ebb_status ebb_op_launch_kernel(const ebb_kernel_t *k, const void *args, const ebb_op_operand *operands, int n, int64_t work);

#ifdef __cplusplus
}
#endif
#endif /* EBB_OPS_H */
