/* loss.c: the losses, cross_entropy and mse_loss, each with its backward math beside it.
 *
 * cross_entropy, forward and backward, runs one fused row kernel ("ebb.ops.rows",
 * kernels_rows.c; launched through rows.c) when its logits are contiguous f32 rows and its
 * targets contiguous; any other case runs the composition of log_softmax, a one-hot mask and
 * where() written beside it (f64 math). mse_loss is composed of elementwise ops and a mean. Each
 * function gathers its temporaries in a local array and releases them before returning, on
 * success and on failure. Threading: no state of its own.
 */
#include <math.h>

#include "ops_impl.h"

/* ---- cross entropy -------------------------------------------------------------------------------- */

static ebb_status ce_check(const char *fn, const ebb_tensor_t *logits, const ebb_tensor_t *target) {
  ebb_status st = ebb__float_input(fn, "logits", logits);
  if (!st) st = ebb__tensor_check(target, fn, "target");
  if (st) return ebb__fail_in(fn, st);
  char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
  if (logits->ndim != 2 || target->ndim != 1 || target->shape[0] != logits->shape[0])
    return ebb__fail(EBB_EINVAL, "%s: %s and %s do not fit; expected logits [N, C] and target [N]", fn, EBB__DESC(logits, "logits", a),
                     EBB__DESC(target, "target", b));
  if (target->dtype != EBB_I64)
    return ebb__fail(EBB_EINVAL, "%s: %s has dtype %s; expected i64 class indices", fn, EBB__DESC(target, "target", a),
                     ebb_dtype_name(target->dtype));
  if (target->stor->device != logits->stor->device)
    return ebb__fail(EBB_EDEVICE, "%s: %s and %s are on different devices; expected one device", fn, EBB__DESC(target, "target", a),
                     EBB__DESC(logits, "logits", b));
  return EBB_OK;
}

/* On the CPU the targets can be read before any kernel runs: one outside [0, C) is refused with
 * its row, on every path. (On a device they are not read back: ops.h says what such a row gives.) */
static ebb_status ce_targets_in_range(const char *fn, const ebb_tensor_t *logits, const ebb_tensor_t *target) {
  if (target->stor->device != EBB_DEVICE_CPU) return EBB_OK;
  const int64_t *t = ebb__tensor_ptr(target), n = logits->shape[0], c = logits->shape[1], st = target->strides[0];
  for (int64_t i = 0; i < n; i++)
    if (t[i * st] < 0 || t[i * st] >= c) {
      char a[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: %s holds %lld at row %lld; expected a class index in [0, %lld)", fn,
                       EBB__DESC(target, "target", a), (long long)t[i * st], (long long)i, (long long)c);
    }
  return EBB_OK;
}

/* The fused cross entropy: per-row losses from the row kernel, then their mean. */
static ebb_status ce_fused(const char *fn, const ebb_tensor_t *logits, const ebb_tensor_t *target, ebb_tensor_t **out) {
  ebb_tensor_t *per_row = NULL;
  ebb_status st = ebb__tensor_new(fn, logits->stor->device, EBB_F32, 1, logits->shape, &per_row);
  if (st) return st;
  ebb__rows_args a = {.op = EBB__ROWS_CE_FWD, .rows = logits->shape[0], .cols = logits->shape[1],
                      .x = ebb__tensor_ptr(logits), .target = ebb__tensor_ptr(target), .out = ebb__tensor_ptr(per_row)};
  const ebb_tensor_t *rd[2] = {logits, target};
  st = ebb__rows_launch(fn, logits->stor->device, &a, rd, 2, &per_row, 1);
  if (!st) st = ebb_op_mean(per_row, NULL, 0, false, out);
  ebb__tensor_put(per_row);
  return st;
}

/* Whether the fused cross entropy takes these inputs. */
static bool ce_rows_ok(const ebb_tensor_t *logits, const ebb_tensor_t *target) {
  return ebb__rows_ok(logits) && ebb__is_contiguous(target);
}

/* onehot[i, c] = (target[i] == c), as a bool [N, C]. */
static ebb_status nn_onehot(const ebb_tensor_t *logits, const ebb_tensor_t *target, ebb_tensor_t **out) {
  ebb_tensor_t *ar = NULL, *tc = NULL;
  ebb_status st = ebb_tensor_arange(logits->stor->device, EBB_I64, 0, 1, logits->shape[1], &ar);
  if (!st) st = ebb_tensor_unsqueeze(target, 1, &tc);
  if (!st) st = ebb_op_eq(tc, ar, out);
  ebb__tensor_put(ar);
  ebb__tensor_put(tc);
  return st;
}

/* loss = -(1/N) sum_i log_softmax(logits)[i, t_i]. The target column is picked with a one-hot
 * mask and where() instead of a gather kernel: one more elementwise pass over [N, C], but the
 * same kernels run on every device, and a target outside [0, C) simply matches no column. */
static ebb_status op_cross_entropy_impl(const ebb_tensor_t *logits, const ebb_tensor_t *target, ebb_tensor_t **out) {
  const char *fn = "ebb_op_cross_entropy";
  ebb_status st = ce_check(fn, logits, target);
  if (!st) st = ebb__need_out(fn, "out", out);
  if (!st) st = ce_targets_in_range(fn, logits, target);
  if (st) return ebb__fail_in(fn, st);
  if (ce_rows_ok(logits, target)) return ebb__fail_in(fn, ce_fused(fn, logits, target, out));
  ebb_tensor_t *ls = NULL, *oh = NULL, *zero = NULL, *picked = NULL, *total = NULL;
  st = ebb_op_log_softmax(logits, 1, &ls);
  if (!st) st = nn_onehot(logits, target, &oh);
  if (!st) st = ebb_tensor_zeros(logits->stor->device, logits->dtype, 0, NULL, &zero);
  if (!st) st = ebb_op_where(oh, ls, zero, &picked);
  if (!st) st = ebb_op_sum(picked, NULL, 0, false, &total);
  if (!st) st = ebb_op_mul_scalar(total, logits->shape[0] ? -1.0 / (double)logits->shape[0] : NAN, out);
  ebb_tensor_t *tmp[] = {ls, oh, zero, picked, total};
  EBB__PUT_ALL(tmp);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_cross_entropy(const ebb_tensor_t *logits, const ebb_tensor_t *target, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_cross_entropy", EBB__OP_CROSS_ENTROPY, NULL, out, op_cross_entropy_impl(logits, target, out), logits, target);
}

/* d loss / d logits[i, c] = (softmax[i, c] - onehot[i, c]) / N, times the incoming scalar. */
ebb_status ebb_op_cross_entropy_backward(const ebb_tensor_t *grad, const ebb_tensor_t *logits, const ebb_tensor_t *target,
                                         ebb_tensor_t **gx) {
  const char *fn = "ebb_op_cross_entropy_backward";
  ebb_status st = ce_check(fn, logits, target);
  if (!st) st = ebb__float_input(fn, "grad", grad);
  if (!st) st = ebb__need_out(fn, "grad_logits", gx);
  if (st) return ebb__fail_in(fn, st);
  if (grad->ndim != 0) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s is not a scalar; expected a scalar (the loss is one)", fn, EBB__DESC(grad, "grad", a));
  }
  st = ce_targets_in_range(fn, logits, target);
  if (st) return ebb__fail_in(fn, st);
  if (ce_rows_ok(logits, target) && grad->dtype == EBB_F32 && grad->stor->device == logits->stor->device) {
    ebb_tensor_t *r = NULL;
    st = ebb__tensor_new(fn, logits->stor->device, EBB_F32, 2, logits->shape, &r);
    if (!st) {
      ebb__rows_args a = {.op = EBB__ROWS_CE_BWD, .rows = logits->shape[0], .cols = logits->shape[1],
                          .x = ebb__tensor_ptr(logits), .g = ebb__tensor_ptr(grad), .target = ebb__tensor_ptr(target),
                          .out = ebb__tensor_ptr(r), .s0 = 1.0 / (double)logits->shape[0]};
      const ebb_tensor_t *rd[3] = {logits, grad, target};
      st = ebb__rows_launch(fn, logits->stor->device, &a, rd, 3, &r, 1);
    }
    if (st) ebb__tensor_put(r);
    else *gx = r;
    return ebb__fail_in(fn, st);
  }
  ebb_tensor_t *p = NULL, *oh = NULL, *d = NULL, *g = NULL;
  st = ebb_op_softmax(logits, 1, &p);
  if (!st) st = nn_onehot(logits, target, &oh);
  if (!st) st = ebb_op_sub(p, oh, &d);
  if (!st) st = ebb_op_mul(d, grad, &g);
  if (!st) st = ebb_op_mul_scalar(g, logits->shape[0] ? 1.0 / (double)logits->shape[0] : NAN, gx);
  ebb_tensor_t *tmp[] = {p, oh, d, g};
  EBB__PUT_ALL(tmp);
  return ebb__fail_in(fn, st);
}

/* ---- mse ------------------------------------------------------------------------------------------ */

static ebb_status mse_check(const char *fn, const ebb_tensor_t *a, const ebb_tensor_t *b) {
  ebb_status st = ebb__float_input(fn, "a", a);
  if (!st) st = ebb__float_input(fn, "b", b);
  if (st) return ebb__fail_in(fn, st);
  if (a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) != 0) {
    char x[EBB__DESC_MAX], y[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s and %s differ in shape; expected one shape", fn, EBB__DESC(a, "a", x), EBB__DESC(b, "b", y));
  }
  return EBB_OK;
}

static ebb_status op_mse_loss_impl(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  const char *fn = "ebb_op_mse_loss";
  ebb_status st = mse_check(fn, a, b);
  if (!st) st = ebb__need_out(fn, "out", out);
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *d = NULL, *sq = NULL;
  st = ebb_op_sub(a, b, &d);
  if (!st) st = ebb_op_mul(d, d, &sq);
  if (!st) st = ebb_op_mean(sq, NULL, 0, false, out);
  ebb__tensor_put(d);
  ebb__tensor_put(sq);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_mse_loss(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_mse_loss", EBB__OP_MSE_LOSS, NULL, out, op_mse_loss_impl(a, b, out), a, b);
}

/* loss = (1/n) sum (a - b)^2: d/da = 2 (a - b) / n, d/db = -d/da. */
ebb_status ebb_op_mse_loss_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                                    ebb_tensor_t **gb) {
  const char *fn = "ebb_op_mse_loss_backward";
  ebb_status st = mse_check(fn, a, b);
  if (!st) st = ebb__float_input(fn, "grad", grad);
  if (!st && !ga && !gb) st = ebb__fail(EBB_EINVAL, "%s: grad_a and grad_b are both NULL; expected at least one to fill", fn);
  if (st) return ebb__fail_in(fn, st);
  if (grad->ndim != 0) {
    char x[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s is not a scalar; expected a scalar (the loss is one)", fn, EBB__DESC(grad, "grad", x));
  }
  int64_t n = ebb__numel(a->shape, a->ndim);
  ebb_tensor_t *d = NULL, *g = NULL, *r = NULL;
  st = ebb_op_sub(a, b, &d);
  if (!st) st = ebb_op_mul(d, grad, &g);
  if (!st) st = ebb_op_mul_scalar(g, n ? 2.0 / (double)n : NAN, &r);
  if (!st && gb) st = ebb_op_neg(r, gb);
  ebb__tensor_put(d);
  ebb__tensor_put(g);
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  if (ga) *ga = r;
  else ebb__tensor_put(r);
  return EBB_OK;
}
