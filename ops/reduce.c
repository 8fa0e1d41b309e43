/* reduce.c: reductions (sum, mean, amax, max along a dim) and sum-to-shape for broadcast
 * gradients, each with its backward math beside it.
 *
 * Reductions run the "ebb.ops.reduce" kernel: the reduced dims of the input become the inner
 * loop, the kept dims the outer one, accumulation in f64. Threading: no state of its own.
 */
#include <math.h>
#include <stdio.h>

#include "ops_impl.h"

/* Which dims of an ndim tensor `dims` names (all when ndims == 0). */
static ebb_status dims_mask(const char *fn, const int *dims, int ndims, int ndim, bool *mask) {
  for (int d = 0; d < EBB_TENSOR_MAX_DIMS; d++) mask[d] = ndims == 0 && d < ndim;
  if (ndims < 0 || ndims > ndim || (ndims && !dims))
    return ebb__fail(EBB_EINVAL, "%s: %d dims listed for a tensor of %d dims; expected 0..%d and a dims array", fn, ndims, ndim, ndim);
  for (int i = 0; i < ndims; i++) {
    int d;
    char arg[24];
    snprintf(arg, sizeof arg, "dims[%d]", i);
    ebb_status st = ebb__dim(fn, arg, dims[i], ndim, &d);
    if (st) return ebb__fail_in(fn, st);
    if (ndim == 0) continue; /* dim 0 or -1 of a scalar: nothing to reduce */
    if (mask[d]) return ebb__fail(EBB_EINVAL, "%s: dim %d is listed twice; expected distinct dims", fn, d);
    mask[d] = true;
  }
  return EBB_OK;
}

/* Shape of the reduction's result. */
static int reduced_shape(const ebb_tensor_t *t, const bool *mask, bool keepdim, int64_t *shape) {
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (!mask[d]) shape[n++] = t->shape[d];
    else if (keepdim) shape[n++] = 1;
  }
  return n;
}

/* One kernel for every reduction: the input's reduced dims become the kernel's inner loop and
 * its kept dims the outer loop, each with the input's own strides, so transposed or sliced
 * inputs reduce in place without a contiguous copy. The result is contiguous; keepdim only
 * changes its shape (extent-1 dims), not the loop. */
static ebb_status reduce_reduce(const char *fn, int op, const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_dtype dt,
                              ebb_tensor_t **out, ebb_tensor_t **idx) {
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return ebb__fail_in(fn, st);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  bool mask[EBB_TENSOR_MAX_DIMS];
  st = dims_mask(fn, dims, ndims, t->ndim, mask);
  if (st) return ebb__fail_in(fn, st);
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  int nd = reduced_shape(t, mask, keepdim, shape);
  ebb__red_args a;
  memset(&a, 0, sizeof a);
  a.op = op;
  a.dt_in = t->dtype;
  a.dt_out = dt;
  int64_t inner = 1;
  for (int d = 0; d < t->ndim; d++)
    if (mask[d]) inner *= t->shape[d];
  if (op == EBB__RED_MAX && inner == 0) {
    return ebb__fail_about(EBB_EINVAL, fn, t, "t", "has an empty reduced dim; a maximum of no elements is undefined");
  }
  ebb_tensor_t *r = NULL, *ix = NULL;
  st = ebb__tensor_new(fn, t->stor->device, dt, nd, shape, &r);
  if (!st && idx) st = ebb__tensor_new(fn, t->stor->device, EBB_I64, nd, shape, &ix);
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  for (int d = 0, o = 0; d < t->ndim; d++) {
    if (mask[d]) {
      a.ishape[a.ninner] = t->shape[d];
      a.ist_in[a.ninner++] = t->strides[d];
      if (keepdim) o++;
    } else {
      a.oshape[a.nouter] = t->shape[d];
      a.ost_in[a.nouter] = t->strides[d];
      a.ost_out[a.nouter++] = r->strides[o++];
    }
  }
  a.in = ebb__tensor_ptr(t);
  a.out = ebb__tensor_ptr(r);
  a.idx = ix ? ebb__tensor_ptr(ix) : NULL;
  if (ebb__numel(shape, nd) > 0) {
    ebb__operand ops[3] = {{r, true}, {t, false}, {ix, true}};
    /* the GPU threads the layout wants (ops_math.h, ebb__red_threads) */
    st = ebb__launch(fn, EBB__K_REDUCE, t->stor->device, &a, ops, ix ? 3 : 2, ebb__red_threads(&a, ebb__numel(shape, nd)));
    if (st) {
      ebb__tensor_put(r);
      ebb__tensor_put(ix);
      return ebb__fail_in(fn, st);
    }
  }
  *out = r;
  if (idx) *idx = ix;
  return EBB_OK;
}

/* The derivative table's arguments of a reduction that succeeded: its dims normalised and
 * sorted (none: all of them). */
static void red_rec_args(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb__op_args *a) {
  bool mask[EBB_TENSOR_MAX_DIMS] = {false};
  for (int i = 0; i < ndims && t->ndim > 0; i++) mask[dims[i] < 0 ? dims[i] + t->ndim : dims[i]] = true;
  a->ndims = 0;
  for (int d = 0; d < t->ndim && ndims > 0; d++)
    if (mask[d]) a->dims[a->ndims++] = d;
  a->keepdim = keepdim;
}

static ebb_status op_sum_impl(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  ebb_dtype dt = t && ebb_dtype_is_float(t->dtype) ? t->dtype : EBB_I64;
  return reduce_reduce("ebb_op_sum", EBB__RED_SUM, t, dims, ndims, keepdim, dt, out, NULL);
}

ebb_status ebb_op_sum(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_sum_impl(t, dims, ndims, keepdim, out);
  ebb__op_args a = {.ndims = 0};
  if (h && !st) red_rec_args(t, dims, ndims, keepdim, &a);
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_op_sum", h, st, EBB__OP_SUM, in, 1, out, NULL, &a);
}

static ebb_status op_mean_impl(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  ebb_dtype dt = t && ebb_dtype_is_float(t->dtype) ? t->dtype : EBB_F32;
  return reduce_reduce("ebb_op_mean", EBB__RED_MEAN, t, dims, ndims, keepdim, dt, out, NULL);
}

ebb_status ebb_op_mean(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_mean_impl(t, dims, ndims, keepdim, out);
  ebb__op_args a = {.ndims = 0};
  if (h && !st) red_rec_args(t, dims, ndims, keepdim, &a);
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_op_mean", h, st, EBB__OP_MEAN, in, 1, out, NULL, &a);
}

static ebb_status op_amax_impl(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  ebb_dtype dt = t ? t->dtype : EBB_F32;
  return reduce_reduce("ebb_op_amax", EBB__RED_MAX, t, dims, ndims, keepdim, dt, out, NULL);
}

ebb_status ebb_op_amax(const ebb_tensor_t *t, const int *dims, int ndims, bool keepdim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_amax_impl(t, dims, ndims, keepdim, out);
  ebb__op_args a = {.ndims = 0};
  if (h && !st) red_rec_args(t, dims, ndims, keepdim, &a);
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_op_amax", h, st, EBB__OP_AMAX, in, 1, out, NULL, &a);
}

static ebb_status op_max_dim_impl(const ebb_tensor_t *t, int dim, bool keepdim, ebb_tensor_t **values, ebb_tensor_t **indices) {
  ebb_dtype dt = t ? t->dtype : EBB_F32;
  return reduce_reduce("ebb_op_max_dim", EBB__RED_MAX, t, &dim, 1, keepdim, dt, values, indices);
}

/* indices NULL: they are made anyway and dropped after the record, because a recorded
 * MaxBackward saves them (its own handle on their storage) to place the gradient. */
ebb_status ebb_op_max_dim(const ebb_tensor_t *t, int dim, bool keepdim, ebb_tensor_t **values, ebb_tensor_t **indices) {
  ebb_tensor_t *own = NULL, **ix = indices ? indices : &own;
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = op_max_dim_impl(t, dim, keepdim, values, ix);
  ebb__op_args a = {.keepdim = keepdim};
  if (h && !st) a.dim = dim < 0 ? dim + t->ndim : dim;
  const ebb_tensor_t *in[1] = {t};
  st = ebb__rec_done("ebb_op_max_dim", h, st, EBB__OP_MAX_DIM, in, 1, values, ix, &a);
  ebb__tensor_put(own);
  return st;
}

/* ---- sum to shape ------------------------------------------------------------------------------ */

/* Broadcasting in the forward repeats an input along leading dims and along its extent-1
 * dims; the adjoint of a repetition is a sum, so the gradient is summed over exactly those
 * dims (keepdim, so the extent-1 dims stay) and then viewed as the input's shape. */
ebb_status ebb_op_sum_to_shape(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  const char *fn = "ebb_op_sum_to_shape";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return ebb__fail_in(fn, st);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL", fn);
  if (ndim < 0 || ndim > t->ndim || (ndim && !shape)) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: target of %d dims for %s; expected at most t's dims and a shape", fn, ndim, EBB__DESC(t, "t", a));
  }
  int dims[EBB_TENSOR_MAX_DIMS], n = 0, lead = t->ndim - ndim;
  for (int d = 0; d < t->ndim; d++) {
    if (d < lead) {
      dims[n++] = d;
    } else if (shape[d - lead] != t->shape[d]) {
      if (shape[d - lead] != 1) {
        char a[EBB__DESC_MAX], b[128];
        return ebb__fail(EBB_EINVAL, "%s: %s cannot be summed to %s (dim %d); expected a shape t broadcasts from", fn,
                         EBB__DESC(t, "t", a), ebb__shape_str(shape, ndim, b, sizeof b), d - lead);
      }
      dims[n++] = d;
    }
  }
  if (n == 0) return ebb__fail_in(fn, ebb_tensor_contiguous(t, out));
  ebb_tensor_t *s;
  st = reduce_reduce(fn, EBB__RED_SUM, t, dims, n, true, t->dtype == EBB_BOOL ? EBB_I64 : t->dtype, &s, NULL);
  if (st) return ebb__fail_in(fn, st);
  st = ebb_tensor_view(s, ndim, shape, out);
  ebb__tensor_put(s);
  return ebb__fail_in(fn, st);
}

/* ---- reduction backward ------------------------------------------------------------------------ */

/* grad of a reduction, reshaped to keepdim form (extent 1 at the reduced dims): a view. */
static ebb_status grad_keepdim(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, const bool *mask, bool keepdim,
                                    ebb_tensor_t **out) {
  int64_t want[EBB_TENSOR_MAX_DIMS], kshape[EBB_TENSOR_MAX_DIMS];
  int nw = reduced_shape(x, mask, keepdim, want);
  int nk = reduced_shape(x, mask, true, kshape);
  if (grad->ndim != nw || memcmp(grad->shape, want, sizeof(int64_t) * (size_t)nw) != 0) {
    char a[EBB__DESC_MAX], b[128];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the forward output's shape; expected %s", fn, EBB__DESC(grad, "grad", a),
                     ebb__shape_str(want, nw, b, sizeof b));
  }
  return ebb__fail_in(fn, ebb_tensor_reshape(grad, nk, kshape, out));
}

static ebb_status reduce_bw_check(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, const int *dims, int ndims,
                                       ebb_tensor_t **gx, bool *mask) {
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = ebb__tensor_check(x, fn, "x");
  if (st) return ebb__fail_in(fn, st);
  if (!gx) return ebb__fail(EBB_EINVAL, "%s: grad_x is NULL; expected a tensor handle to fill", fn);
  if (!ebb_dtype_is_float(x->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, x, "x", "has dtype %s, which has no gradient; expected a floating input",
                           ebb_dtype_name(x->dtype));
  if (grad->stor->device != x->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, grad, "grad", x, "x", "are on different devices; expected one device");
  return dims_mask(fn, dims, ndims, x->ndim, mask);
}

/* grad (keepdim form) times `scale`, broadcast to x's shape, as x's dtype. */
static ebb_status expand_grad(const char *fn, const ebb_tensor_t *gk, const ebb_tensor_t *x, double scale, ebb_tensor_t **gx) {
  ebb_tensor_t *r;
  ebb_status st = ebb__tensor_new(fn, x->stor->device, x->dtype, x->ndim, x->shape, &r);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__ew_run(fn, EBB__EW_MULS, r, 1, &gk, scale, 0);
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  *gx = r;
  return EBB_OK;
}

ebb_status ebb_op_sum_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const int *dims, int ndims, bool keepdim,
                               ebb_tensor_t **gx) {
  const char *fn = "ebb_op_sum_backward";
  bool mask[EBB_TENSOR_MAX_DIMS];
  ebb_status st = reduce_bw_check(fn, grad, x, dims, ndims, gx, mask);
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *gk;
  st = grad_keepdim(fn, grad, x, mask, keepdim, &gk);
  if (st) return ebb__fail_in(fn, st);
  st = expand_grad(fn, gk, x, 1.0, gx);
  ebb__tensor_put(gk);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_mean_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const int *dims, int ndims, bool keepdim,
                                ebb_tensor_t **gx) {
  const char *fn = "ebb_op_mean_backward";
  bool mask[EBB_TENSOR_MAX_DIMS];
  ebb_status st = reduce_bw_check(fn, grad, x, dims, ndims, gx, mask);
  if (st) return ebb__fail_in(fn, st);
  int64_t count = 1;
  for (int d = 0; d < x->ndim; d++)
    if (mask[d]) count *= x->shape[d];
  ebb_tensor_t *gk;
  st = grad_keepdim(fn, grad, x, mask, keepdim, &gk);
  if (st) return ebb__fail_in(fn, st);
  st = expand_grad(fn, gk, x, count ? 1.0 / (double)count : NAN, gx);
  ebb__tensor_put(gk);
  return ebb__fail_in(fn, st);
}

/* amax has no unique derivative at ties; the gradient is split evenly among the elements
 * equal to the maximum (mask / count), which is what a subgradient average gives and keeps
 * the sum of the gradient equal to grad. */
ebb_status ebb_op_amax_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, const int *dims, int ndims,
                                bool keepdim, ebb_tensor_t **gx) {
  const char *fn = "ebb_op_amax_backward";
  bool mask[EBB_TENSOR_MAX_DIMS];
  ebb_status st = reduce_bw_check(fn, grad, x, dims, ndims, gx, mask);
  if (!st) st = ebb__tensor_check(y, fn, "y");
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *gk = NULL, *yk = NULL, *eq = NULL, *m = NULL, *cnt = NULL, *share = NULL;
  st = grad_keepdim(fn, grad, x, mask, keepdim, &gk);
  if (!st) st = grad_keepdim(fn, y, x, mask, keepdim, &yk);
  if (!st) st = ebb_op_eq(x, yk, &eq);
  if (!st) st = ebb_tensor_to_dtype(eq, x->dtype, &m);
  if (!st) st = reduce_reduce(fn, EBB__RED_SUM, m, dims, ndims, true, x->dtype, &cnt, NULL);
  if (!st) st = ebb_op_div(gk, cnt, &share);
  if (!st) st = ebb_op_mul(m, share, gx);
  ebb_tensor_t *tmp[] = {gk, yk, eq, m, cnt, share};
  for (size_t i = 0; i < EBB_ARRAY_LEN(tmp); i++) ebb__tensor_put(tmp[i]);
  return ebb__fail_in(fn, st);
}

/* max along a dim returns the index of its first maximum: the gradient goes to that element
 * only. The index is compared with an arange laid along dim (broadcast against the indices in
 * keepdim form), which gives the one-hot mask without a scatter kernel. */
ebb_status ebb_op_max_dim_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *indices, int dim, bool keepdim,
                                   ebb_tensor_t **gx) {
  const char *fn = "ebb_op_max_dim_backward";
  bool mask[EBB_TENSOR_MAX_DIMS];
  ebb_status st = reduce_bw_check(fn, grad, x, &dim, 1, gx, mask);
  if (!st) st = ebb__tensor_check(indices, fn, "indices");
  if (st) return ebb__fail_in(fn, st);
  char id[EBB__DESC_MAX];
  if (indices->dtype != EBB_I64)
    return ebb__fail(EBB_EINVAL, "%s: %s has dtype %s; expected i64 (from ebb_op_max_dim)", fn, EBB__DESC(indices, "indices", id),
                     ebb_dtype_name(indices->dtype));
  int d = 0;
  for (int k = 0; k < x->ndim; k++)
    if (mask[k]) d = k;
  ebb_tensor_t *gk = NULL, *ik = NULL, *ar = NULL, *arv = NULL, *hit = NULL, *zero = NULL;
  st = grad_keepdim(fn, grad, x, mask, keepdim, &gk);
  if (!st) st = grad_keepdim(fn, indices, x, mask, keepdim, &ik);
  if (!st) st = ebb_tensor_arange(x->stor->device, EBB_I64, 0, 1, x->ndim ? x->shape[d] : 1, &ar);
  if (!st) {
    int64_t shape[EBB_TENSOR_MAX_DIMS];
    for (int k = 0; k < x->ndim; k++) shape[k] = k == d ? x->shape[d] : 1;
    st = ebb_tensor_view(ar, x->ndim, shape, &arv);
  }
  if (!st) st = ebb_op_eq(arv, ik, &hit);
  if (!st) st = ebb_tensor_zeros(x->stor->device, x->dtype, 0, NULL, &zero);
  ebb_tensor_t *w = NULL;
  if (!st) st = ebb_op_where(hit, gk, zero, &w);
  if (!st && w->dtype != x->dtype) {
    st = ebb_tensor_to_dtype(w, x->dtype, gx);
    ebb__tensor_put(w);
  } else if (!st) {
    *gx = w;
  }
  ebb_tensor_t *tmp[] = {gk, ik, ar, arv, hit, zero};
  for (size_t i = 0; i < EBB_ARRAY_LEN(tmp); i++) ebb__tensor_put(tmp[i]);
  return ebb__fail_in(fn, st);
}
