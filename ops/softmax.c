/* softmax.c: softmax and log_softmax, each with its backward math beside it.
 *
 * Along the last dim of contiguous f32 rows each runs one fused row kernel ("ebb.ops.rows",
 * kernels_rows.c; launched through rows.c): one read of each input and one write of the output.
 * Any other case (another dtype, a dim that is not the last, strided rows) runs the composition
 * of elementwise, reduction and view ops written beside it, which computes in f64 and runs
 * wherever those run. Each function gathers its temporaries in a local array and releases them
 * before returning, on success and on failure. Threading: no state of its own.
 */
#include "ops_impl.h"

/* A new f32 tensor of t's shape on t's device, filled by row kernel op `op` from t (and g). */
static ebb_status rows_map(const char *fn, int op, const ebb_tensor_t *t, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb_tensor_t *r = NULL;
  ebb_status st = ebb__tensor_new(fn, t->stor->device, EBB_F32, t->ndim, t->shape, &r);
  if (st) return st;
  const int64_t cols = t->ndim ? t->shape[t->ndim - 1] : 1;
  ebb__rows_args a = {.op = op, .rows = ebb__numel(t->shape, t->ndim) / cols, .cols = cols, .x = ebb__tensor_ptr(t),
                      .g = g ? ebb__tensor_ptr(g) : NULL, .out = ebb__tensor_ptr(r)};
  const ebb_tensor_t *rd[2] = {t, g};
  st = ebb__rows_launch(fn, t->stor->device, &a, rd, 2, &r, 1);
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
  ebb_status st = ebb__float_input(fn, "t", t);
  if (!st) st = ebb__need_out(fn, "out", out);
  int d;
  if (!st) st = ebb__dim(fn, "dim", dim, t->ndim, &d);
  if (st) return ebb__fail_in(fn, st);
  /* No elements (an empty dim, along `dim` or another): an empty result of t's shape, as
   * PyTorch gives; the max along an empty dim, which amax refuses, is never needed. */
  if (ebb__numel(t->shape, t->ndim) == 0) return ebb__tensor_new(fn, t->stor->device, t->dtype, t->ndim, t->shape, out);
  if (d == t->ndim - 1 && ebb__rows_ok(t))
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
  ebb_status st = ebb__float_input(fn, "grad", grad);
  if (!st) st = ebb__float_input(fn, "y", y);
  if (!st) st = ebb__need_out(fn, "grad_x", gx);
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
  if (d == y->ndim - 1 && ebb__rows_ok(y) && ebb__rows_ok(grad) && grad->stor->device == y->stor->device)
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
  if (d == y->ndim - 1 && ebb__rows_ok(y) && ebb__rows_ok(grad) && grad->stor->device == y->stor->device)
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
