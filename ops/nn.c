/* nn.c: softmax, log_softmax, cross_entropy, mse_loss, layer_norm, cat and stack, each with its
 * backward math beside it.
 *
 * softmax, log_softmax, cross_entropy and layer_norm, forward and backward, run one fused row
 * kernel ("ebb.ops.rows", kernels_rows.c) when their rows are contiguous f32 along the last
 * dims: one read of each input and one write of the output. Any other case (another dtype, a
 * dim that is not the last, strided rows) runs the composition of elementwise, reduction and
 * view ops written beside it, which computes in f64 and runs wherever those run. Each function
 * gathers its temporaries in a local array and releases them before returning, on success and
 * on failure. Threading: no state of its own.
 */
#include <math.h>
#include <stdlib.h>

#include "ops_impl.h"

#define EBB__PUT_ALL(arr)                                                     \
  do {                                                                        \
    for (size_t i_ = 0; i_ < EBB_ARRAY_LEN(arr); i_++) ebb__tensor_put(arr[i_]); \
  } while (0)

static ebb_status float_input(const char *fn, const char *arg, const ebb_tensor_t *t) {
  ebb_status st = ebb__tensor_check(t, fn, arg);
  if (st) return ebb__fail_in(fn, st);
  if (!ebb_dtype_is_float(t->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, t, arg, "has dtype %s; expected a floating dtype", ebb_dtype_name(t->dtype));
  return EBB_OK;
}

static ebb_status need_out(const char *fn, const char *arg, ebb_tensor_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected a tensor handle to fill", fn, arg);
  return EBB_OK;
}

/* ---- the fused row kernel ----------------------------------------------------------------------- */

/* Whether t can feed the row kernel: f32, contiguous, with elements (0-element tensors take the
 * composed path, which already handles them). */
static bool rows_ok(const ebb_tensor_t *t) {
  return t->dtype == EBB_F32 && ebb__is_contiguous(t) && ebb__numel(t->shape, t->ndim) > 0;
}

/* Runs a row kernel on `device`: reads and writes are the tensors behind a's pointers (NULL
 * entries skipped), so a device launch declares their storages' uses on its stream. */
static ebb_status rows_launch(const char *fn, int device, const ebb__rows_args *a, const ebb_tensor_t *const *reads, int nr,
                              ebb_tensor_t *const *writes, int nw) {
  ebb__operand ops[8];
  int n = 0;
  for (int i = 0; i < nr; i++)
    if (reads[i]) ops[n++] = (ebb__operand){reads[i], false};
  for (int i = 0; i < nw; i++)
    if (writes[i]) ops[n++] = (ebb__operand){writes[i], true};
  /* one block of 256 threads per row on a GPU */
  return ebb__launch(fn, EBB__K_ROWS, device, a, ops, n, a->rows * 256);
}

/* A new f32 tensor of t's shape on t's device, filled by row kernel op `op` from t (and g). */
static ebb_status rows_map(const char *fn, int op, const ebb_tensor_t *t, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb_tensor_t *r = NULL;
  ebb_status st = ebb__tensor_new(fn, t->stor->device, EBB_F32, t->ndim, t->shape, &r);
  if (st) return st;
  const int64_t cols = t->ndim ? t->shape[t->ndim - 1] : 1;
  ebb__rows_args a = {.op = op, .rows = ebb__numel(t->shape, t->ndim) / cols, .cols = cols, .x = ebb__tensor_ptr(t),
                      .g = g ? ebb__tensor_ptr(g) : NULL, .out = ebb__tensor_ptr(r)};
  const ebb_tensor_t *rd[2] = {t, g};
  st = rows_launch(fn, t->stor->device, &a, rd, 2, &r, 1);
  if (st) {
    ebb__tensor_put(r);
    return st;
  }
  *out = r;
  return EBB_OK;
}

/* ---- softmax and log_softmax ----------------------------------------------------------------------- */

/* y = exp(x - m) / sum(exp(x - m)) with m = max(x) along dim: subtracting m changes nothing
 * mathematically (it cancels in the ratio) but keeps exp from overflowing for large logits.
 * log_softmax is (x - m) - log(sum(exp(x - m))), computed without forming y, so it stays finite
 * where y would underflow to 0. */
static ebb_status nn_softmax(const char *fn, const ebb_tensor_t *t, int dim, bool logarithm, ebb_tensor_t **out) {
  ebb_status st = float_input(fn, "t", t);
  if (!st) st = need_out(fn, "out", out);
  int d;
  if (!st) st = ebb__dim(fn, "dim", dim, t->ndim, &d);
  if (st) return ebb__fail_in(fn, st);
  /* No elements (an empty dim, along `dim` or another): an empty result of t's shape, as
   * PyTorch gives; the max along an empty dim, which amax refuses, is never needed. */
  if (ebb__numel(t->shape, t->ndim) == 0) return ebb__tensor_new(fn, t->stor->device, t->dtype, t->ndim, t->shape, out);
  if (d == t->ndim - 1 && rows_ok(t))
    return ebb__fail_in(fn, rows_map(fn, logarithm ? EBB__ROWS_LOG_SOFTMAX : EBB__ROWS_SOFTMAX, t, NULL, out));
  ebb_tensor_t *m = NULL, *s = NULL, *e = NULL, *z = NULL, *lz = NULL;
  st = ebb_op_amax(t, &d, 1, true, &m);
  if (!st) st = ebb_op_sub(t, m, &s);
  if (!st) st = ebb_op_exp(s, &e);
  if (!st) st = ebb_op_sum(e, &d, 1, true, &z);
  if (!st && logarithm) st = ebb_op_log(z, &lz);
  if (!st) st = logarithm ? ebb_op_sub(s, lz, out) : ebb_op_div(e, z, out);
  ebb_tensor_t *tmp[] = {m, s, e, z, lz};
  EBB__PUT_ALL(tmp);
  return ebb__fail_in(fn, st);
}

/* The normalised dim of a softmax that succeeded (t is valid then). */
static ebb__op_args dim_args(const ebb__tensor_hooks *h, ebb_status st, const ebb_tensor_t *t, int dim) {
  ebb__op_args a = {.dim = dim};
  if (h && !st && dim < 0) a.dim = dim + t->ndim;
  return a;
}

ebb_status ebb_op_softmax(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = nn_softmax("ebb_op_softmax", t, dim, false, out);
  const ebb__op_args a = dim_args(h, st, t, dim);
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_op_softmax", h, st, EBB__OP_SOFTMAX, in, 1, out, NULL, &a);
}

ebb_status ebb_op_log_softmax(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = nn_softmax("ebb_op_log_softmax", t, dim, true, out);
  const ebb__op_args a = dim_args(h, st, t, dim);
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_op_log_softmax", h, st, EBB__OP_LOG_SOFTMAX, in, 1, out, NULL, &a);
}

static ebb_status softmax_bw_check(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *y, int dim, ebb_tensor_t **gx, int *d) {
  ebb_status st = float_input(fn, "grad", grad);
  if (!st) st = float_input(fn, "y", y);
  if (!st) st = need_out(fn, "grad_x", gx);
  if (!st) st = ebb__dim(fn, "dim", dim, y->ndim, d);
  if (st) return ebb__fail_in(fn, st);
  if (grad->ndim != y->ndim || memcmp(grad->shape, y->shape, sizeof(int64_t) * (size_t)y->ndim) != 0) {
    char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the shape of %s; expected the forward output's shape", fn, EBB__DESC(grad, "grad", a),
                     EBB__DESC(y, "y", b));
  }
  return EBB_OK;
}

/* dy_i/dx_j = y_i (delta_ij - y_j), so grad_x_j = sum_i grad_i y_i (delta_ij - y_j)
 * = y_j (grad_j - sum_i grad_i y_i): one product, one reduction along dim, no Jacobian. */
ebb_status ebb_op_softmax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *y, int dim, ebb_tensor_t **gx) {
  const char *fn = "ebb_op_softmax_backward";
  int d;
  ebb_status st = softmax_bw_check(fn, grad, y, dim, gx, &d);
  if (st) return ebb__fail_in(fn, st);
  if (d == y->ndim - 1 && rows_ok(y) && rows_ok(grad) && grad->stor->device == y->stor->device)
    return ebb__fail_in(fn, rows_map(fn, EBB__ROWS_SOFTMAX_BWD, y, grad, gx));
  ebb_tensor_t *gy = NULL, *sg = NULL, *df = NULL;
  st = ebb_op_mul(grad, y, &gy);
  if (!st) st = ebb_op_sum(gy, &d, 1, true, &sg);
  if (!st) st = ebb_op_sub(grad, sg, &df);
  if (!st) st = ebb_op_mul(y, df, gx);
  ebb_tensor_t *tmp[] = {gy, sg, df};
  EBB__PUT_ALL(tmp);
  return ebb__fail_in(fn, st);
}

/* d(log y_i)/dx_j = delta_ij - softmax_j, so grad_x_j = grad_j - softmax_j sum_i grad_i, and
 * softmax is exp of the saved output y (no second pass over x). */
ebb_status ebb_op_log_softmax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *y, int dim, ebb_tensor_t **gx) {
  const char *fn = "ebb_op_log_softmax_backward";
  int d;
  ebb_status st = softmax_bw_check(fn, grad, y, dim, gx, &d);
  if (st) return ebb__fail_in(fn, st);
  if (d == y->ndim - 1 && rows_ok(y) && rows_ok(grad) && grad->stor->device == y->stor->device)
    return ebb__fail_in(fn, rows_map(fn, EBB__ROWS_LOG_SOFTMAX_BWD, y, grad, gx));
  ebb_tensor_t *sg = NULL, *e = NULL, *p = NULL;
  st = ebb_op_sum(grad, &d, 1, true, &sg);
  if (!st) st = ebb_op_exp(y, &e);
  if (!st) st = ebb_op_mul(e, sg, &p);
  if (!st) st = ebb_op_sub(grad, p, gx);
  ebb_tensor_t *tmp[] = {sg, e, p};
  EBB__PUT_ALL(tmp);
  return ebb__fail_in(fn, st);
}

/* ---- cross entropy -------------------------------------------------------------------------------- */

static ebb_status ce_check(const char *fn, const ebb_tensor_t *logits, const ebb_tensor_t *target) {
  ebb_status st = float_input(fn, "logits", logits);
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
  st = rows_launch(fn, logits->stor->device, &a, rd, 2, &per_row, 1);
  if (!st) st = ebb_op_mean(per_row, NULL, 0, false, out);
  ebb__tensor_put(per_row);
  return st;
}

/* Whether the fused cross entropy takes these inputs. */
static bool ce_rows_ok(const ebb_tensor_t *logits, const ebb_tensor_t *target) {
  return rows_ok(logits) && ebb__is_contiguous(target);
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
  if (!st) st = need_out(fn, "out", out);
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
  if (!st) st = float_input(fn, "grad", grad);
  if (!st) st = need_out(fn, "grad_logits", gx);
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
      st = rows_launch(fn, logits->stor->device, &a, rd, 3, &r, 1);
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
  ebb_status st = float_input(fn, "a", a);
  if (!st) st = float_input(fn, "b", b);
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
  if (!st) st = need_out(fn, "out", out);
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
  if (!st) st = float_input(fn, "grad", grad);
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

/* ---- layer norm ------------------------------------------------------------------------------------ */

static ebb_status ln_check(const char *fn, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b,
                                int *dims) {
  ebb_status st = float_input(fn, "x", x);
  if (st) return ebb__fail_in(fn, st);
  char s1[EBB__DESC_MAX], s2[EBB__DESC_MAX];
  if (nnorm < 1 || nnorm > x->ndim)
    return ebb__fail(EBB_EINVAL, "%s: nnorm %d for %s; expected 1..%d", fn, nnorm, EBB__DESC(x, "x", s1), x->ndim);
  const ebb_tensor_t *p[2] = {w, b};
  static const char *const names[2] = {"weight", "bias"};
  for (int i = 0; i < 2; i++) {
    if (!p[i]) continue;
    st = float_input(fn, names[i], p[i]);
    if (st) return ebb__fail_in(fn, st);
    if (p[i]->ndim != nnorm || memcmp(p[i]->shape, x->shape + x->ndim - nnorm, sizeof(int64_t) * (size_t)nnorm) != 0)
      return ebb__fail(EBB_EINVAL, "%s: %s does not match %s; expected the shape of x's last %d dims", fn, EBB__DESC(p[i], names[i], s1),
                       EBB__DESC(x, "x", s2), nnorm);
  }
  for (int i = 0; i < nnorm; i++) dims[i] = x->ndim - nnorm + i;
  return EBB_OK;
}

/* Whether the fused layer_norm takes these inputs: f32 contiguous x (and grad), weight and bias
 * (each may be NULL), all on x's device. */
static bool ln_rows_ok(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, const ebb_tensor_t *g) {
  const ebb_tensor_t *p[3] = {w, b, g};
  if (!rows_ok(x)) return false;
  for (int i = 0; i < 3; i++)
    if (p[i] && (!rows_ok(p[i]) || p[i]->stor->device != x->stor->device)) return false;
  return true;
}

/* The row kernel's view of a layer_norm: the last nnorm dims are one row. */
static ebb__rows_args ln_rows_args(int op, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b, double eps) {
  int64_t cols = 1;
  for (int i = x->ndim - nnorm; i < x->ndim; i++) cols *= x->shape[i];
  return (ebb__rows_args){.op = op, .rows = ebb__numel(x->shape, x->ndim) / cols, .cols = cols, .x = ebb__tensor_ptr(x),
                          .w = w ? ebb__tensor_ptr(w) : NULL, .b = b ? ebb__tensor_ptr(b) : NULL, .s0 = eps};
}

/* xhat = (x - mean) * rstd, with rstd = (var + eps)^-1/2 (keepdim form). */
static ebb_status ln_normalise(const ebb_tensor_t *x, const int *dims, int nnorm, double eps, ebb_tensor_t **xhat, ebb_tensor_t **rstd) {
  ebb_tensor_t *mu = NULL, *xc = NULL, *sq = NULL, *var = NULL, *ve = NULL;
  ebb_status st = ebb_op_mean(x, dims, nnorm, true, &mu);
  if (!st) st = ebb_op_sub(x, mu, &xc);
  if (!st) st = ebb_op_mul(xc, xc, &sq);
  if (!st) st = ebb_op_mean(sq, dims, nnorm, true, &var);
  if (!st) st = ebb_op_add_scalar(var, eps, &ve);
  if (!st) st = ebb_op_pow_scalar(ve, -0.5, rstd);
  if (!st) {
    st = ebb_op_mul(xc, *rstd, xhat);
    if (st) ebb__tensor_put(*rstd);
  }
  ebb_tensor_t *tmp[] = {mu, xc, sq, var, ve};
  EBB__PUT_ALL(tmp);
  return st;
}

static ebb_status op_layer_norm_impl(const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b, double eps, ebb_tensor_t **out) {
  const char *fn = "ebb_op_layer_norm";
  int dims[EBB_TENSOR_MAX_DIMS];
  ebb_status st = ln_check(fn, x, nnorm, w, b, dims);
  if (!st) st = need_out(fn, "out", out);
  if (st) return ebb__fail_in(fn, st);
  if (ln_rows_ok(x, w, b, NULL)) {
    ebb_tensor_t *r = NULL;
    st = ebb__tensor_new(fn, x->stor->device, EBB_F32, x->ndim, x->shape, &r);
    if (st) return ebb__fail_in(fn, st);
    ebb__rows_args a = ln_rows_args(EBB__ROWS_LN_FWD, x, nnorm, w, b, eps);
    a.out = ebb__tensor_ptr(r);
    const ebb_tensor_t *rd[3] = {x, w, b};
    st = rows_launch(fn, x->stor->device, &a, rd, 3, &r, 1);
    if (st) {
      ebb__tensor_put(r);
      return ebb__fail_in(fn, st);
    }
    *out = r;
    return EBB_OK;
  }
  ebb_tensor_t *xhat = NULL, *rstd = NULL, *y = NULL;
  st = ln_normalise(x, dims, nnorm, eps, &xhat, &rstd);
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *cur = xhat;
  xhat = NULL;
  if (w) {
    st = ebb_op_mul(cur, w, &y);
    ebb__tensor_put(cur);
    cur = st ? NULL : y;
  }
  if (!st && b) {
    st = ebb_op_add(cur, b, &y);
    ebb__tensor_put(cur);
    cur = st ? NULL : y;
  }
  ebb__tensor_put(rstd);
  if (st) return ebb__fail_in(fn, st);
  *out = cur;
  return EBB_OK;
}

ebb_status ebb_op_layer_norm(const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b, double eps, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {eps}, .dim = nnorm};
  EBB__RECORDED("ebb_op_layer_norm", EBB__OP_LAYER_NORM, &args, out, op_layer_norm_impl(x, nnorm, w, b, eps, out), x, w, b);
}

/* Whether `device` runs the CPU kernels (the CPU, or an emulated device): there the fused
 * layer_norm backward also sums the weight's and bias's gradients over rows in the same pass.
 * A GPU's row blocks cannot share those sums, so its backward takes the composed path. */
static bool runs_cpu_kernels(int device) {
  if (device == EBB_DEVICE_CPU) return true;
  ebb_dev_caps c;
  return ebb_dev_get_caps(device, &c) == EBB_OK && c.cpu_kernels;
}

/* The fused layer_norm backward: grad_x, and grad_weight / grad_bias where asked, in one pass. */
static ebb_status ln_bwd_fused(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w,
                               const ebb_tensor_t *b, double eps, ebb_tensor_t **gx, ebb_tensor_t **gw, ebb_tensor_t **gb) {
  ebb_tensor_t *rx = NULL, *rw = NULL, *rb = NULL;
  const int dev = x->stor->device;
  ebb_status st = ebb__tensor_new(fn, dev, EBB_F32, x->ndim, x->shape, &rx);
  if (!st && gw) st = ebb__tensor_new(fn, dev, EBB_F32, w->ndim, w->shape, &rw);
  if (!st && gb) st = ebb__tensor_new(fn, dev, EBB_F32, b->ndim, b->shape, &rb);
  if (!st) {
    ebb__rows_args a = ln_rows_args(EBB__ROWS_LN_BWD, x, nnorm, w, NULL, eps);
    a.g = ebb__tensor_ptr(grad);
    a.out = ebb__tensor_ptr(rx);
    a.gw_out = rw ? ebb__tensor_ptr(rw) : NULL;
    a.gb_out = rb ? ebb__tensor_ptr(rb) : NULL;
    const ebb_tensor_t *rd[3] = {x, grad, w};
    ebb_tensor_t *wr[3] = {rx, rw, rb};
    st = rows_launch(fn, dev, &a, rd, 3, wr, 3);
  }
  if (st) {
    ebb__tensor_put(rx);
    ebb__tensor_put(rw);
    ebb__tensor_put(rb);
    return st;
  }
  *gx = rx;
  if (gw) *gw = rw;
  if (gb) *gb = rb;
  return EBB_OK;
}

/* With xhat = (x - mu) rstd over the normalised dims (n elements each), y = xhat w + b:
 *   grad_b = sum over the leading dims of grad, grad_w = the same of grad * xhat;
 *   with g = grad * w, grad_x = rstd (g - mean(g) - xhat mean(g xhat)), the usual result of
 *   differentiating through mu and the biased variance (both depend on every x of the row).
 * The statistics are recomputed from x rather than saved: ops has no saved state, and autograd
 * may keep them later by calling the forward pieces itself. */
ebb_status ebb_op_layer_norm_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b,
                                      double eps, ebb_tensor_t **gx, ebb_tensor_t **gw, ebb_tensor_t **gb) {
  const char *fn = "ebb_op_layer_norm_backward";
  int dims[EBB_TENSOR_MAX_DIMS];
  ebb_status st = ln_check(fn, x, nnorm, w, b, dims);
  if (!st) st = float_input(fn, "grad", grad);
  if (st) return ebb__fail_in(fn, st);
  if (!gx && !gw && !gb) return ebb__fail(EBB_EINVAL, "%s: grad_x, grad_weight and grad_bias are all NULL; expected one to fill", fn);
  if ((gw && !w) || (gb && !b)) return ebb__fail(EBB_EINVAL, "%s: a gradient was asked for a NULL weight or bias", fn);
  if (grad->ndim != x->ndim || memcmp(grad->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0) {
    char s1[EBB__DESC_MAX], s2[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the shape of %s; expected x's shape", fn, EBB__DESC(grad, "grad", s1),
                     EBB__DESC(x, "x", s2));
  }
  if (gx && ln_rows_ok(x, w, b, grad) && runs_cpu_kernels(x->stor->device))
    return ebb__fail_in(fn, ln_bwd_fused(fn, grad, x, nnorm, w, b, eps, gx, gw, gb));
  ebb_tensor_t *xhat = NULL, *rstd = NULL, *gxh = NULL, *m1 = NULL, *p = NULL, *m2 = NULL, *q = NULL, *r1 = NULL, *r2 = NULL, *gp = NULL;
  ebb_tensor_t *rx = NULL, *rw = NULL, *rb = NULL;
  st = ln_normalise(x, dims, nnorm, eps, &xhat, &rstd);
  if (st) return ebb__fail_in(fn, st);
  /* dL/dxhat = grad * w; dL/dx = rstd * (gxh - mean(gxh) - xhat * mean(gxh * xhat)) */
  if (w) {
    st = ebb_op_mul(grad, w, &gxh);
  } else {
    atomic_fetch_add_explicit(&((ebb_tensor_t *)grad)->refs, 1, memory_order_relaxed);
    gxh = (ebb_tensor_t *)grad;
  }
  if (!st && gx) {
    st = ebb_op_mean(gxh, dims, nnorm, true, &m1);
    if (!st) st = ebb_op_mul(gxh, xhat, &p);
    if (!st) st = ebb_op_mean(p, dims, nnorm, true, &m2);
    if (!st) st = ebb_op_mul(xhat, m2, &q);
    if (!st) st = ebb_op_sub(gxh, m1, &r1);
    if (!st) st = ebb_op_sub(r1, q, &r2);
    if (!st) st = ebb_op_mul(r2, rstd, &rx);
  }
  if (!st && gw) {
    st = ebb_op_mul(grad, xhat, &gp);
    if (!st) st = ebb_op_sum_to_shape(gp, w->ndim, w->shape, &rw);
  }
  if (!st && gb) st = ebb_op_sum_to_shape(grad, b->ndim, b->shape, &rb);
  ebb_tensor_t *tmp[] = {xhat, rstd, gxh, m1, p, m2, q, r1, r2, gp};
  EBB__PUT_ALL(tmp);
  if (st) {
    ebb__tensor_put(rx);
    ebb__tensor_put(rw);
    ebb__tensor_put(rb);
    return ebb__fail_in(fn, st);
  }
  if (gx) *gx = rx;
  if (gw) *gw = rw;
  if (gb) *gb = rb;
  return EBB_OK;
}

/* ---- cat and stack ------------------------------------------------------------------------------------ */

/* The result is allocated once and each input copied into its narrow() view of it, so cat is
 * n copy kernels and no temporary. Inputs may be any views (the copy kernel takes strides). */
static ebb_status op_cat_impl(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out) {
  const char *fn = "ebb_op_cat";
  if (!ts || n < 1) return ebb__fail(EBB_EINVAL, "%s: %d tensors (array %s); expected at least one", fn, n, ts ? "given" : "NULL");
  ebb_status st = need_out(fn, "out", out);
  for (int i = 0; i < n && !st; i++) st = ebb__tensor_check_at(ts[i], fn, "ts", i);
  if (st) return ebb__fail_in(fn, st);
  const ebb_tensor_t *t0 = ts[0];
  int d;
  char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
  if (t0->ndim == 0)
    return ebb__fail(EBB_EINVAL, "%s: %s is a scalar; expected tensors of at least 1 dim (use ebb_op_stack)", fn,
                     ebb__tensor_desc(t0, "ts", 0, a, sizeof a));
  st = ebb__dim(fn, "dim", dim, t0->ndim, &d);
  if (st) return ebb__fail_in(fn, st);
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  memcpy(shape, t0->shape, sizeof shape);
  shape[d] = 0;
  for (int i = 0; i < n; i++) {
    const ebb_tensor_t *t = ts[i];
    if (t->dtype != t0->dtype || t->stor->device != t0->stor->device)
      return ebb__fail(EBB_EINVAL, "%s: %s and %s differ in dtype or device; expected one dtype and device", fn,
                       ebb__tensor_desc(t, "ts", i, a, sizeof a), ebb__tensor_desc(t0, "ts", 0, b, sizeof b));
    bool ok = t->ndim == t0->ndim;
    for (int k = 0; ok && k < t->ndim; k++) ok = k == d || t->shape[k] == t0->shape[k];
    if (!ok)
      return ebb__fail(EBB_EINVAL, "%s: %s and %s differ in shape; expected equal extents except along dim %d", fn,
                       ebb__tensor_desc(t, "ts", i, a, sizeof a), ebb__tensor_desc(t0, "ts", 0, b, sizeof b), d);
    shape[d] += t->shape[d];
  }
  ebb_tensor_t *r;
  st = ebb__tensor_new(fn, t0->stor->device, t0->dtype, t0->ndim, shape, &r);
  if (st) return ebb__fail_in(fn, st);
  int64_t at = 0;
  for (int i = 0; i < n && !st; i++) {
    ebb_tensor_t *v;
    st = ebb_tensor_narrow(r, d, at, ts[i]->shape[d], &v);
    if (st) break;
    st = ebb__ew_run(fn, EBB__EW_COPY, v, 1, &ts[i], 0, 0);
    ebb__tensor_put(v);
    at += ts[i]->shape[d];
  }
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  *out = r;
  return EBB_OK;
}

ebb_status ebb_op_cat(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_cat_impl(ts, n, dim, out);
  ebb__op_args a = {.dim = dim};
  if (h && !st && dim < 0) a.dim = dim + ts[0]->ndim;
  return ebb__rec_done("ebb_op_cat", h, st, EBB__OP_CAT, ts, n, out, NULL, &a);
}

static ebb_status op_stack_impl(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out) {
  const char *fn = "ebb_op_stack";
  if (!ts || n < 1 || n > 4096) return ebb__fail(EBB_EINVAL, "%s: %d tensors (array %s); expected 1..4096", fn, n, ts ? "given" : "NULL");
  ebb_status st = need_out(fn, "out", out);
  for (int i = 0; i < n && !st; i++) st = ebb__tensor_check_at(ts[i], fn, "ts", i);
  if (st) return ebb__fail_in(fn, st);
  for (int i = 1; i < n; i++)
    if (ts[i]->ndim != ts[0]->ndim || memcmp(ts[i]->shape, ts[0]->shape, sizeof(int64_t) * (size_t)ts[0]->ndim) != 0) {
      char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: %s and %s differ in shape; expected one shape", fn, ebb__tensor_desc(ts[i], "ts", i, a, sizeof a),
                       ebb__tensor_desc(ts[0], "ts", 0, b, sizeof b));
    }
  ebb_tensor_t **u = calloc((size_t)n, sizeof *u);
  if (!u) return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d views", fn, n);
  for (int i = 0; i < n && !st; i++) st = ebb_tensor_unsqueeze(ts[i], dim, &u[i]);
  if (!st) st = ebb_op_cat((const ebb_tensor_t *const *)u, n, dim, out);
  for (int i = 0; i < n; i++) ebb__tensor_put(u[i]);
  free(u);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_stack(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_stack_impl(ts, n, dim, out);
  ebb__op_args a = {.dim = dim};
  if (h && !st && dim < 0) a.dim = dim + ts[0]->ndim + 1;
  return ebb__rec_done("ebb_op_stack", h, st, EBB__OP_STACK, ts, n, out, NULL, &a);
}

/* The gradient of a slice is the matching slice of grad: a view, no copy. Its offset along
 * dim is the sum of the extents of the inputs before it, hence the walk over ts[0..i). */
ebb_status ebb_op_cat_backward(const ebb_tensor_t *grad, const ebb_tensor_t *const *ts, int n, int dim, int i, ebb_tensor_t **gi) {
  const char *fn = "ebb_op_cat_backward";
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = need_out(fn, "grad_i", gi);
  if (st) return ebb__fail_in(fn, st);
  if (!ts || i < 0 || i >= n) return ebb__fail(EBB_EINVAL, "%s: input %d of %d (array %s); expected 0 <= i < n", fn, i, n, ts ? "given" : "NULL");
  int d;
  st = ebb__dim(fn, "dim", dim, grad->ndim, &d);
  if (st) return ebb__fail_in(fn, st);
  int64_t at = 0;
  char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
  for (int k = 0; k <= i; k++) {
    st = ebb__tensor_check_at(ts[k], fn, "ts", k);
    if (st) return ebb__fail_in(fn, st);
    if (ts[k]->ndim != grad->ndim)
      return ebb__fail(EBB_EINVAL, "%s: %s and %s differ in their number of dims; expected the inputs of the cat that gave grad", fn,
                       ebb__tensor_desc(ts[k], "ts", k, a, sizeof a), EBB__DESC(grad, "grad", b));
    if (k < i) at += ts[k]->shape[d];
  }
  if (st) return ebb__fail_in(fn, st);
  return ebb__fail_in(fn, ebb_tensor_narrow(grad, d, at, ts[i]->shape[d], gi));
}

ebb_status ebb_op_stack_backward(const ebb_tensor_t *grad, int n, int dim, int i, ebb_tensor_t **gi) {
  const char *fn = "ebb_op_stack_backward";
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = need_out(fn, "grad_i", gi);
  if (st) return ebb__fail_in(fn, st);
  if (i < 0 || i >= n) return ebb__fail(EBB_EINVAL, "%s: input %d of %d; expected 0 <= i < n", fn, i, n);
  int d;
  st = ebb__dim(fn, "dim", dim, grad->ndim, &d);
  if (st) return ebb__fail_in(fn, st);
  if (grad->shape[d] != n) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s has %lld entries along dim %d; expected n = %d", fn, EBB__DESC(grad, "grad", a),
                     (long long)grad->shape[d], d, n);
  }
  return ebb__fail_in(fn, ebb_tensor_select(grad, d, i, gi));
}
