/* linear.c: the linear layer, y = x @ w^T + b (PyTorch's convention: w [out_features,
 * in_features], b [out_features]), its backward, and its derivative-table entry.
 *
 * The forward is one GEMM over x's leading dims flattened into rows, with the bias folded in:
 * the bias is broadcast into the output first (one elementwise copy), then the GEMM adds x w^T
 * into it (beta = 1: OpenBLAS on the CPU and the emulated driver, cuBLAS or the plain CUDA
 * kernel on a GPU). w is read in place, row-major (transposed by the GEMM) or already
 * transposed; x when its rows lie evenly in memory. bf16 and f16 are computed in f32 and rounded
 * once. The backward is two GEMMs (grad_x = g w, grad_w = g^T x) and a reduction (grad_b: g
 * summed over its rows).
 * Threading: no state of its own; thread-safe as the tensor calls it makes.
 */
#include <stdio.h>

#include "ops_impl.h"

/* t itself as an operand: a new reference. */
static ebb_tensor_t *held(const ebb_tensor_t *t) {
  atomic_fetch_add_explicit(&((ebb_tensor_t *)t)->refs, 1, memory_order_relaxed);
  return (ebb_tensor_t *)t;
}

/* The product of x's leading dims (the GEMM's rows). */
static int64_t rows_of(const ebb_tensor_t *x) { return ebb__numel(x->shape, x->ndim - 1); }

/* The argument checks shared by the forward and the backward: live handles, one floating
 * dtype (the forward's b too), one device, w [N, K] with x [..., K], b [N]. */
static ebb_status linear_check(const char *fn, const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b) {
  ebb_status st = ebb__tensor_check(x, fn, "x");
  if (!st) st = ebb__tensor_check(w, fn, "w");
  if (!st && b) st = ebb__tensor_check(b, fn, "b");
  if (st) return st;
  if (!ebb_dtype_is_float(x->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, x, "x", "has dtype %s; expected a floating dtype", ebb_dtype_name(x->dtype));
  if (w->dtype != x->dtype)
    return ebb__fail_about2(EBB_EINVAL, fn, x, "x", w, "w", "have different dtypes; expected one floating dtype for x, w and b "
                            "(convert with ebb_tensor_to_dtype)");
  if (b && b->dtype != x->dtype)
    return ebb__fail_about2(EBB_EINVAL, fn, x, "x", b, "b", "have different dtypes; expected one floating dtype for x, w and b "
                            "(convert with ebb_tensor_to_dtype)");
  if (w->stor->device != x->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, w, "w", x, "x", "are on different devices; expected one device (copy with "
                            "ebb_tensor_to_device)");
  if (b && b->stor->device != x->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, b, "b", x, "x", "are on different devices; expected one device (copy with "
                            "ebb_tensor_to_device)");
  if (w->ndim != 2)
    return ebb__fail_about(EBB_EINVAL, fn, w, "w", "has %d dims; expected a matrix [out_features, in_features]", w->ndim);
  const int64_t n = w->shape[0], k = w->shape[1];
  if (x->ndim < 1 || x->shape[x->ndim - 1] != k) {
    char a[EBB__DESC_MAX], c[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s and %s do not fit: x's last dim is not w's in_features; expected x of shape [..., %lld]",
                     fn, EBB__DESC(x, "x", a), EBB__DESC(w, "w", c), (long long)k);
  }
  if (b && (b->ndim != 1 || b->shape[0] != n)) {
    char a[EBB__DESC_MAX], c[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s does not fit %s; expected b of shape [%lld] (w's out_features)", fn, EBB__DESC(b, "b", a),
                     EBB__DESC(w, "w", c), (long long)n);
  }
  if (rows_of(x) > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    char a[EBB__DESC_MAX], c[EBB__DESC_MAX];
    return ebb__fail(EBB_ENOTSUP, "%s: %s and %s exceed the GEMM's int sizes; expected fewer than 2^31 rows, in_features and "
                     "out_features", fn, EBB__DESC(x, "x", a), EBB__DESC(w, "w", c));
  }
  return EBB_OK;
}

/* x as the GEMM's A, rows x K in dtype ct: x itself (retained) when its rows lie evenly with
 * unit column stride (any contiguous x; a 2-D one with padded rows) or it is a transposed
 * matrix, else a contiguous copy. */
static ebb_status operand_x(const char *fn, const ebb_tensor_t *x, ebb_dtype ct, int64_t k, ebb_tensor_t **use, int32_t *trans,
                            int64_t *ld) {
  const int n = x->ndim;
  if (x->dtype == ct && n == 2) {
    const int64_t rs = x->strides[0], cs = x->strides[1], rows = x->shape[0];
    if (cs == 1 && rs >= (k > 1 ? k : 1)) {
      *trans = 0, *ld = rs;
    } else if (rs == 1 && cs >= (rows > 1 ? rows : 1)) {
      *trans = 1, *ld = cs;
    } else {
      goto copy;
    }
    *use = held(x);
    return EBB_OK;
  }
  if (x->dtype == ct && ebb__is_contiguous(x)) {
    *trans = 0, *ld = k > 1 ? k : 1;
    *use = held(x);
    return EBB_OK;
  }
copy:
  *trans = 0, *ld = k > 1 ? k : 1;
  return ebb__copy_as(fn, x, ct, use);
}

/* w [N, K] as the GEMM's B = w^T [K, N] in dtype ct: a row-major w is B transposed (trans 1),
 * a transposed one (a transpose() view of a [K, N] matrix) is B itself; others are copied. */
static ebb_status operand_w(const char *fn, const ebb_tensor_t *w, ebb_dtype ct, ebb_tensor_t **use, int32_t *trans, int64_t *ld) {
  const int64_t n = w->shape[0], k = w->shape[1], rs = w->strides[0], cs = w->strides[1];
  if (w->dtype == ct) {
    if (cs == 1 && rs >= (k > 1 ? k : 1)) {
      *trans = 1, *ld = rs;
      *use = held(w);
      return EBB_OK;
    }
    if (rs == 1 && cs >= (n > 1 ? n : 1)) {
      *trans = 0, *ld = cs;
      *use = held(w);
      return EBB_OK;
    }
  }
  *trans = 1, *ld = k > 1 ? k : 1;
  return ebb__copy_as(fn, w, ct, use);
}

static ebb_status linear_forward(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, ebb_tensor_t **out) {
  const char *fn = "ebb_op_linear";
  ebb_status st = linear_check(fn, x, w, b);
  if (!st && !out) st = ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  if (st) return st;
  const ebb_dtype dt = x->dtype, ct = dt == EBB_F64 ? EBB_F64 : EBB_F32;
  const int64_t m = rows_of(x), n = w->shape[0], k = w->shape[1];
  const int device = x->stor->device;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  shape[x->ndim - 1] = n;
  ebb_tensor_t *r = NULL, *ux = NULL, *uw = NULL, *res = NULL;
  st = ebb__tensor_new(fn, device, ct, x->ndim, shape, &r);
  if (st) return st;
  /* The bias first, broadcast over the rows (converted to ct as it is copied), for the GEMM to
   * add into; without one, a GEMM with beta 0 writes every element, or zeros when K is 0. */
  if (b) st = ebb__ew_run(fn, EBB__EW_COPY, r, 1, &b, 0, 0);
  else if (k == 0) st = ebb__ew_run(fn, EBB__EW_FILL, r, 0, NULL, 0, 0);
  if (!st && m * n > 0 && k > 0) {
    ebb__mm_args g;
    memset(&g, 0, sizeof g);
    st = operand_x(fn, x, ct, k, &ux, &g.trans_a, &g.lda);
    if (!st) st = operand_w(fn, w, ct, &uw, &g.trans_b, &g.ldb);
    if (!st) {
      g.dtype = ct;
      g.batch = 1;
      g.m = m, g.n = n, g.k = k;
      g.ldc = n;
      g.a = ebb__tensor_ptr(ux);
      g.b = ebb__tensor_ptr(uw);
      g.c = ebb__tensor_ptr(r);
      g.beta = b ? 1.0 : 0.0;
      ebb__operand ops[3] = {{r, true}, {ux, false}, {uw, false}};
      st = ebb__mm_gpu(fn, device, &g, ops);
      if (st == EBB_ENOTSUP) st = ebb__launch(fn, EBB__K_MATMUL, device, &g, ops, 3, m * n);
    }
  }
  if (!st && ct != dt) st = ebb__copy_as(fn, r, dt, &res);
  ebb__tensor_put(ux);
  ebb__tensor_put(uw);
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  if (res) ebb__tensor_put(r);
  *out = res ? res : r;
  return EBB_OK;
}

ebb_status ebb_op_linear(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_linear", EBB__OP_LINEAR, NULL, out, linear_forward(x, w, b, out), x, w, b);
}

/* ---- backward ---------------------------------------------------------------------------------- */

/* With g2 = grad as [M, N] and x2 = x as [M, K]: grad_x = g2 w (to x's shape), grad_w = g2^T x2,
 * grad_b = g2 summed over its rows. The transposes are views, which matmul takes without a copy. */
ebb_status ebb_op_linear_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *w, ebb_tensor_t **grad_x,
                                  ebb_tensor_t **grad_w, ebb_tensor_t **grad_b) {
  const char *fn = "ebb_op_linear_backward";
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = linear_check(fn, x, w, NULL);
  if (st) return st;
  if (!grad_x && !grad_w && !grad_b)
    return ebb__fail(EBB_EINVAL, "%s: grad_x, grad_w and grad_b are all NULL; expected at least one to fill", fn);
  if (grad->stor->device != x->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, grad, "grad", x, "x", "are on different devices; expected one device");
  if (!ebb_dtype_is_float(grad->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, grad, "grad", "has dtype %s; expected a floating dtype", ebb_dtype_name(grad->dtype));
  const int64_t m = rows_of(x), n = w->shape[0], k = w->shape[1];
  bool fits = grad->ndim == x->ndim && grad->shape[grad->ndim - 1] == n;
  for (int d = 0; fits && d + 1 < x->ndim; d++) fits = grad->shape[d] == x->shape[d];
  if (!fits) {
    int64_t shape[EBB_TENSOR_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = n;
    char a[EBB__DESC_MAX], s[128];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the forward output's shape; expected %s (x's leading dims, then w's "
                     "out_features)", fn, EBB__DESC(grad, "grad", a), ebb__shape_str(shape, x->ndim, s, sizeof s));
  }
  const int64_t s_g[2] = {m, n}, s_x[2] = {m, k};
  ebb_tensor_t *g2 = NULL, *gt = NULL, *x2 = NULL, *px = NULL, *rx = NULL, *rw = NULL, *rb = NULL;
  st = ebb_tensor_reshape(grad, 2, s_g, &g2);
  if (!st && grad_x) {
    st = ebb_op_matmul(g2, w, &px);
    if (!st) st = ebb_tensor_reshape(px, x->ndim, x->shape, &rx);
  }
  if (!st && grad_w) {
    st = ebb_tensor_transpose(g2, 0, 1, &gt);
    if (!st) st = ebb_tensor_reshape(x, 2, s_x, &x2);
    if (!st) st = ebb_op_matmul(gt, x2, &rw);
  }
  if (!st && grad_b) {
    const int d0[1] = {0};
    st = ebb_op_sum(g2, d0, 1, false, &rb);
  }
  /* each gradient in its input's dtype (grad may be of another floating dtype) */
  ebb_tensor_t **rs[3] = {&rx, &rw, &rb};
  for (int i = 0; i < 3 && !st; i++) {
    if (!*rs[i] || (*rs[i])->dtype == x->dtype) continue;
    ebb_tensor_t *c = NULL;
    st = ebb_tensor_to_dtype(*rs[i], x->dtype, &c);
    ebb__tensor_put(*rs[i]);
    *rs[i] = c;
  }
  ebb__tensor_put(g2);
  ebb__tensor_put(gt);
  ebb__tensor_put(x2);
  ebb__tensor_put(px);
  if (st) {
    ebb__tensor_put(rx);
    ebb__tensor_put(rw);
    ebb__tensor_put(rb);
    return ebb__fail_in(fn, st);
  }
  if (grad_x) *grad_x = rx;
  if (grad_w) *grad_w = rw;
  if (grad_b) *grad_b = rb;
  return EBB_OK;
}

/* The table's call: saves x and w; b (input 2, optional) gets a gradient when it was given. */
ebb_status ebb__bw_linear(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  const bool want_b = c->nin > 2 && c->need[2] && c->in[2].ndim >= 0;
  if (!c->need[0] && !c->need[1] && !want_b) return EBB_OK;
  return ebb_op_linear_backward(go[0], c->saved_in[0], c->saved_in[1], c->need[0] ? &gin[0] : NULL, c->need[1] ? &gin[1] : NULL,
                                want_b ? &gin[2] : NULL);
}
