/* cat.c: cat and stack, and their backward (a view of grad each).
 *
 * cat allocates its result once and copies each input into its slice of it; stack is cat of
 * the inputs unsqueezed at dim. Threading: no state of its own.
 */
#include <stdlib.h>

#include "ops_impl.h"

/* ---- cat and stack ------------------------------------------------------------------------------------ */

/* The result is allocated once and each input copied into its narrow() view of it, so cat is
 * n copy kernels and no temporary. Inputs may be any views (the copy kernel takes strides). */
static ebb_status op_cat_impl(const ebb_tensor_t *const *ts, int n, int dim, ebb_tensor_t **out) {
  const char *fn = "ebb_op_cat";
  if (!ts || n < 1) return ebb__fail(EBB_EINVAL, "%s: %d tensors (array %s); expected at least one", fn, n, ts ? "given" : "NULL");
  ebb_status st = ebb__need_out(fn, "out", out);
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
  ebb_status st = ebb__need_out(fn, "out", out);
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
  if (!st) st = ebb__need_out(fn, "grad_i", gi);
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
  if (!st) st = ebb__need_out(fn, "grad_i", gi);
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
