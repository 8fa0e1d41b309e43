/* views.c: views: view, reshape, permute, transpose, slice, narrow, select, expand, squeeze,
 * unsqueeze, and the geometry of a view in its base that autograd's view nodes use.
 *
 * A view is a new handle on its input's storage (ebb__tensor_alias) with its own shape, strides
 * and offset; reshape copies only when no strides express the new shape.
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"
#include "ops_export.h"

#define EBB__VIEW_PROLOGUE(fn)                                         \
  ebb_status st = ebb__tensor_check(t, fn, "t");                       \
  if (st) return st;                                                   \
  if (!out) return ebb__fail(EBB_EINVAL, fn ": out is NULL; expected a tensor handle to fill")

/* Strides for viewing (oshape, ostrides) as nshape without copying, or false. Dims of the old
 * shape are grouped into runs that are contiguous among themselves; each run must be covered
 * by a run of new dims with the same element count. */
/* Example: a [2,3,4] tensor transposed to [4,3,2] has strides [1,4,12]; no run of its dims is
 * contiguous, so viewing it as [24] fails, while [4,6] fails too and [4,3,2,1] succeeds. */
static bool view_strides(int od, const int64_t *oshape, const int64_t *ostrides, int nd, const int64_t *nshape, int64_t *nstrides) {
  if (ebb__numel(oshape, od) == 0 || od == 0) {
    ebb__contig_strides(nd, nshape, nstrides);
    return true;
  }
  int vd = nd - 1;
  int64_t base = ostrides[od - 1], tnum = 1, vnum = 1;
  for (int td = od - 1; td >= 0; td--) {
    tnum *= oshape[td];
    if (td == 0 || (oshape[td - 1] != 1 && ostrides[td - 1] != tnum * base)) {
      while (vd >= 0 && (vnum < tnum || nshape[vd] == 1)) {
        nstrides[vd] = vnum * base;
        vnum *= nshape[vd];
        vd--;
      }
      if (vnum != tnum) return false;
      if (td > 0) {
        base = ostrides[td - 1];
        tnum = 1;
        vnum = 1;
      }
    }
  }
  return vd == -1;
}

/* Resolves one -1 in shape against numel; EBB_EINVAL when impossible. */
static ebb_status infer_shape(const char *fn, const ebb_tensor_t *t, int ndim, const int64_t *shape, int64_t *res) {
  if (ndim < 0 || ndim > EBB_TENSOR_MAX_DIMS || (ndim && !shape))
    return ebb__fail(EBB_EINVAL, "%s: ndim %d with shape %s; expected 0..%d dims", fn, ndim, shape ? "given" : "NULL", EBB_TENSOR_MAX_DIMS);
  int64_t n = ebb__numel(t->shape, t->ndim), known = 1;
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    res[d] = shape[d];
    if (shape[d] == -1 && infer < 0) infer = d;
    else if (shape[d] < 0) goto bad;
    else known *= shape[d];
  }
  if (infer >= 0) {
    if (known == 0 || n % known) goto bad;
    res[infer] = n / known;
  } else if (known != n) {
    goto bad;
  }
  return EBB_OK;
bad:;
  char a[EBB__DESC_MAX], b[128];
  return ebb__fail(EBB_EINVAL, "%s: cannot view %s (%lld elements) as %s", fn, EBB__DESC(t, "t", a), (long long)n,
                   ebb__shape_str(shape, ndim, b, sizeof b));
}

static ebb_status tensor_view_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_view");
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  st = infer_shape("ebb_tensor_view", t, ndim, shape, ns);
  if (st) return st;
  if (!view_strides(t->ndim, t->shape, t->strides, ndim, ns, nst)) {
    char a[EBB__DESC_MAX], b[128], c[128];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_view: %s with strides %s cannot be viewed as %s without a copy; use ebb_tensor_reshape",
                     EBB__DESC(t, "t", a), ebb__shape_str(t->strides, t->ndim, b, sizeof b), ebb__shape_str(ns, ndim, c, sizeof c));
  }
  return ebb__tensor_alias("ebb_tensor_view", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_view(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_view", EBB__OP_VIEW, NULL, out, tensor_view_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_reshape_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_reshape");
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  st = infer_shape("ebb_tensor_reshape", t, ndim, shape, ns);
  if (st) return st;
  if (view_strides(t->ndim, t->shape, t->strides, ndim, ns, nst))
    return ebb__tensor_alias("ebb_tensor_reshape", t, ndim, ns, nst, t->offset, out);
  /* A copy, reshaped in place: a new tensor, not a view of t (nor of the copy). */
  ebb_tensor_t *c;
  st = ebb__copy_as("ebb_tensor_reshape", t, t->dtype, &c);
  if (st) return st;
  c->ndim = ndim;
  memcpy(c->shape, ns, sizeof(int64_t) * (size_t)ndim);
  ebb__contig_strides(ndim, c->shape, c->strides);
  *out = c;
  return EBB_OK;
}

ebb_status ebb_tensor_reshape(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_reshape", EBB__OP_RESHAPE, NULL, out, tensor_reshape_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_permute_impl(const ebb_tensor_t *t, const int *dims, int ndim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_permute");
  if (ndim != t->ndim || (ndim && !dims)) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_permute: %d dims given for %s; expected a permutation of its %d dims", ndim,
                     EBB__DESC(t, "t", a), t->ndim);
  }
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  bool seen[EBB_TENSOR_MAX_DIMS] = {false};
  for (int i = 0; i < ndim; i++) {
    int d;
    char arg[24];
    snprintf(arg, sizeof arg, "dims[%d]", i);
    st = ebb__dim("ebb_tensor_permute", arg, dims[i], ndim, &d);
    if (st) return st;
    if (seen[d]) return ebb__fail(EBB_EINVAL, "ebb_tensor_permute: dim %d appears twice in dims; expected a permutation", d);
    seen[d] = true;
    ns[i] = t->shape[d];
    nst[i] = t->strides[d];
  }
  return ebb__tensor_alias("ebb_tensor_permute", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_permute(const ebb_tensor_t *t, const int *dims, int ndim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_permute_impl(t, dims, ndim, out);
  ebb__op_args a = {.ndims = ndim};
  for (int k = 0; h && !st && k < ndim; k++) a.dims[k] = dims[k] < 0 ? dims[k] + ndim : dims[k];
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_permute", h, st, EBB__OP_PERMUTE, in, 1, out, NULL, &a);
}

static ebb_status tensor_transpose_impl(const ebb_tensor_t *t, int dim0, int dim1, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_transpose");
  int a, b;
  st = ebb__dim("ebb_tensor_transpose", "dim0", dim0, t->ndim, &a);
  if (!st) st = ebb__dim("ebb_tensor_transpose", "dim1", dim1, t->ndim, &b);
  if (st) return st;
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int d = 0; d < t->ndim; d++) {
    int s = d == a ? b : d == b ? a : d;
    ns[d] = t->shape[s];
    nst[d] = t->strides[s];
  }
  return ebb__tensor_alias("ebb_tensor_transpose", t, t->ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_transpose(const ebb_tensor_t *t, int dim0, int dim1, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_transpose_impl(t, dim0, dim1, out);
  ebb__op_args a = {.dim = dim0, .dim1 = dim1};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    if (a.dim1 < 0) a.dim1 += t->ndim;
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_transpose", h, st, EBB__OP_TRANSPOSE, in, 1, out, NULL, &a);
}

/* The slice view of t along dim d (normalised), start/end clamped; the view is made for `fn`
 * (slice or narrow, whose name the lifecycle hook and messages get). */
/* Python's slice bounds on an extent: negative counts from the end, then clamped. */
static void clamp_bounds(int64_t size, int64_t *start, int64_t *end) {
  if (*start < 0) *start += size;
  if (*end < 0) *end += size;
  *start = *start < 0 ? 0 : *start > size ? size : *start;
  *end = *end < *start ? *start : *end > size ? size : *end;
}

static ebb_status slice_view(const char *fn, const ebb_tensor_t *t, int d, int64_t start, int64_t end, int64_t step,
                                  ebb_tensor_t **out) {
  clamp_bounds(t->shape[d], &start, &end);
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  memcpy(ns, t->shape, sizeof ns);
  memcpy(nst, t->strides, sizeof nst);
  ns[d] = (end - start + step - 1) / step;
  nst[d] = t->strides[d] * step;
  return ebb__tensor_alias(fn, t, t->ndim, ns, nst, t->offset + start * t->strides[d], out);
}

static ebb_status tensor_slice_impl(const ebb_tensor_t *t, int dim, int64_t start, int64_t end, int64_t step, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_slice");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_slice: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_slice", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (step < 1) return ebb__fail(EBB_EINVAL, "ebb_tensor_slice: step is %lld; expected step >= 1", (long long)step);
  return slice_view("ebb_tensor_slice", t, d, start, end, step, out);
}

ebb_status ebb_tensor_slice(const ebb_tensor_t *t, int dim, int64_t start, int64_t end, int64_t step, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_slice_impl(t, dim, start, end, step, out);
  ebb__op_args a = {.dim = dim, .start = start, .end = end, .step = step};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    clamp_bounds(t->shape[a.dim], &a.start, &a.end);
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_slice", h, st, EBB__OP_SLICE, in, 1, out, NULL, &a);
}

static ebb_status tensor_narrow_impl(const ebb_tensor_t *t, int dim, int64_t start, int64_t length, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_narrow");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_narrow: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_narrow", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (start < 0 || length < 0 || start + length > t->shape[d]) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_narrow: start %lld and length %lld do not fit dim %d of %s", (long long)start,
                     (long long)length, d, EBB__DESC(t, "t", a));
  }
  return slice_view("ebb_tensor_narrow", t, d, start, start + length, 1, out);
}

ebb_status ebb_tensor_narrow(const ebb_tensor_t *t, int dim, int64_t start, int64_t length, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_narrow_impl(t, dim, start, length, out);
  ebb__op_args a = {.dim = dim, .start = start, .end = start + length, .step = 1};
  if (h && !st && a.dim < 0) a.dim += t->ndim;
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_narrow", h, st, EBB__OP_NARROW, in, 1, out, NULL, &a);
}

/* The view of t without dim d at index i (both in range), made for `fn` (select or squeeze). */
static ebb_status select_view(const char *fn, const ebb_tensor_t *t, int d, int64_t i, ebb_tensor_t **out) {
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int k = 0, j = 0; k < t->ndim; k++) {
    if (k == d) continue;
    ns[j] = t->shape[k];
    nst[j++] = t->strides[k];
  }
  return ebb__tensor_alias(fn, t, t->ndim - 1, ns, nst, t->offset + i * t->strides[d], out);
}

static ebb_status tensor_select_impl(const ebb_tensor_t *t, int dim, int64_t index, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_select");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_select: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_select", "dim", dim, t->ndim, &d);
  if (st) return st;
  int64_t i = index < 0 ? index + t->shape[d] : index;
  if (i < 0 || i >= t->shape[d]) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_select: index %lld is out of range for dim %d of %s", (long long)index, d, EBB__DESC(t, "t", a));
  }
  return select_view("ebb_tensor_select", t, d, i, out);
}

ebb_status ebb_tensor_select(const ebb_tensor_t *t, int dim, int64_t index, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_select_impl(t, dim, index, out);
  ebb__op_args a = {.dim = dim, .start = index};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    if (a.start < 0) a.start += t->shape[a.dim];
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_select", h, st, EBB__OP_SELECT, in, 1, out, NULL, &a);
}

static ebb_status tensor_expand_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_expand");
  if (ndim < t->ndim || ndim > EBB_TENSOR_MAX_DIMS || !shape) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_expand: %d target dims for %s; expected %d..%d dims and a shape", ndim,
                     EBB__DESC(t, "t", a), t->ndim, EBB_TENSOR_MAX_DIMS);
  }
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int d = ndim - 1, j = t->ndim - 1; d >= 0; d--, j--) {
    if (j >= 0 && (shape[d] == -1 || shape[d] == t->shape[j])) {
      ns[d] = t->shape[j];
      nst[d] = t->strides[j];
    } else if ((j < 0 || t->shape[j] == 1) && shape[d] >= 0) {
      ns[d] = shape[d];
      nst[d] = 0;
    } else {
      char a[EBB__DESC_MAX], b[128];
      return ebb__fail(EBB_EINVAL, "ebb_tensor_expand: %s cannot be expanded to %s (dim %d); expected equal extents or 1",
                       EBB__DESC(t, "t", a), ebb__shape_str(shape, ndim, b, sizeof b), d);
    }
  }
  return ebb__tensor_alias("ebb_tensor_expand", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_expand(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_expand", EBB__OP_EXPAND, NULL, out, tensor_expand_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_squeeze_impl(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_squeeze");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_squeeze: %s is a scalar (0 dims); nothing to squeeze", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_squeeze", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (t->shape[d] != 1) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_squeeze: dim %d of %s has extent %lld; expected 1", d, EBB__DESC(t, "t", a),
                     (long long)t->shape[d]);
  }
  return select_view("ebb_tensor_squeeze", t, d, 0, out);
}

ebb_status ebb_tensor_squeeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_squeeze", EBB__OP_SQUEEZE, NULL, out, tensor_squeeze_impl(t, dim, out), t);
}

static ebb_status tensor_unsqueeze_impl(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_unsqueeze");
  if (t->ndim == EBB_TENSOR_MAX_DIMS)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_unsqueeze: t has %d dims already (the maximum)", EBB_TENSOR_MAX_DIMS);
  if (dim < -t->ndim - 1 || dim > t->ndim)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_unsqueeze: dim %d is out of range; expected [%d, %d]", dim, -t->ndim - 1, t->ndim);
  int d = dim < 0 ? dim + t->ndim + 1 : dim;
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int k = 0, j = 0; k <= t->ndim; k++) {
    if (k == d) {
      ns[k] = 1;
      nst[k] = j < t->ndim ? t->strides[j] * t->shape[j] : 1;
    } else {
      ns[k] = t->shape[j];
      nst[k] = t->strides[j++];
    }
  }
  return ebb__tensor_alias("ebb_tensor_unsqueeze", t, t->ndim + 1, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_unsqueeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_unsqueeze", EBB__OP_UNSQUEEZE, NULL, out, tensor_unsqueeze_impl(t, dim, out), t);
}

void ebb__view_geom_of(const ebb_tensor_t *base, const ebb_tensor_t *view, ebb__view_geom *g) {
  memset(g, 0, sizeof *g);
  memcpy(g->base_strides, base->strides, sizeof(int64_t) * (size_t)base->ndim);
  g->base_offset = base->offset;
  ebb__tensor_meta_of(view, &g->view);
  memcpy(g->strides, view->strides, sizeof(int64_t) * (size_t)view->ndim);
  g->offset = view->offset;
}
