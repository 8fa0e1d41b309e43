/* norm.c: layer_norm and its backward math.
 *
 * Forward and backward run one fused row kernel ("ebb.ops.rows", kernels_rows.c; launched
 * through rows.c) when x (and grad), weight and bias are contiguous f32 on one device; the
 * backward's fused pass, which also sums the weight's and bias's gradients, runs only where the
 * CPU kernels run. Any other case runs the composition of reductions and elementwise ops written
 * beside it (f64 math), which recomputes the statistics. Each function gathers its temporaries
 * in a local array and releases them before returning, on success and on failure. Threading: no
 * state of its own.
 */
#include "ops_impl.h"

/* ---- layer norm ------------------------------------------------------------------------------------ */

static ebb_status ln_check(const char *fn, const ebb_tensor_t *x, int nnorm, const ebb_tensor_t *w, const ebb_tensor_t *b,
                                int *dims) {
  ebb_status st = ebb__float_input(fn, "x", x);
  if (st) return ebb__fail_in(fn, st);
  char s1[EBB__DESC_MAX], s2[EBB__DESC_MAX];
  if (nnorm < 1 || nnorm > x->ndim)
    return ebb__fail(EBB_EINVAL, "%s: nnorm %d for %s; expected 1..%d", fn, nnorm, EBB__DESC(x, "x", s1), x->ndim);
  const ebb_tensor_t *p[2] = {w, b};
  static const char *const names[2] = {"weight", "bias"};
  for (int i = 0; i < 2; i++) {
    if (!p[i]) continue;
    st = ebb__float_input(fn, names[i], p[i]);
    if (st) return ebb__fail_in(fn, st);
    if (p[i]->ndim != nnorm || memcmp(p[i]->shape, x->shape + x->ndim - nnorm, sizeof(int64_t) * (size_t)nnorm) != 0)
      return ebb__fail(EBB_EINVAL, "%s: %s does not match %s; expected the shape of x's last %d dims", fn, EBB__DESC(p[i], names[i], s1),
                       EBB__DESC(x, "x", s2), nnorm);
    if (p[i]->stor->device != x->stor->device)
      return ebb__fail(EBB_EDEVICE, "%s: %s and %s are on different devices; expected the %s on x's device", fn,
                       EBB__DESC(p[i], names[i], s1), EBB__DESC(x, "x", s2), names[i]);
  }
  for (int i = 0; i < nnorm; i++) dims[i] = x->ndim - nnorm + i;
  return EBB_OK;
}

/* Whether the fused layer_norm takes these inputs: f32 contiguous x (and grad), weight and bias
 * (each may be NULL), all on x's device. */
static bool ln_rows_ok(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, const ebb_tensor_t *g) {
  const ebb_tensor_t *p[3] = {w, b, g};
  if (!ebb__rows_ok(x)) return false;
  for (int i = 0; i < 3; i++)
    if (p[i] && (!ebb__rows_ok(p[i]) || p[i]->stor->device != x->stor->device)) return false;
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
  if (!st) st = ebb__need_out(fn, "out", out);
  if (st) return ebb__fail_in(fn, st);
  if (ln_rows_ok(x, w, b, NULL)) {
    ebb_tensor_t *r = NULL;
    st = ebb__tensor_new(fn, x->stor->device, EBB_F32, x->ndim, x->shape, &r);
    if (st) return ebb__fail_in(fn, st);
    ebb__rows_args a = ln_rows_args(EBB__ROWS_LN_FWD, x, nnorm, w, b, eps);
    a.out = ebb__tensor_ptr(r);
    const ebb_tensor_t *rd[3] = {x, w, b};
    st = ebb__rows_launch(fn, x->stor->device, &a, rd, 3, &r, 1);
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
    st = ebb__rows_launch(fn, dev, &a, rd, 3, wr, 3);
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
  if (!st) st = ebb__float_input(fn, "grad", grad);
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
