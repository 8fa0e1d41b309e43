/* matmul.c: matmul (batched, broadcasting batch dims) and its backward math.
 *
 * Runs "ebb.ops.matmul" (sgemm or dgemm per batch entry; OpenBLAS on CPU tensors and the emulated
 * driver) or, on a GPU, cuBLAS (blas_gpu.c). Operands that are neither row-major nor transposed
 * row-major, and batched operands, are made contiguous first; dtypes other than f32 and f64 go
 * through f32 copies.
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

/* A matrix operand for gemm: row-major (unit column stride) or transposed row-major, with one
 * batch stride. Sets *use to t itself (retained) or a contiguous copy expanded to the batch. */
/* gemm reads a matrix as row-major with a leading dimension, or as the transpose of one: a
 * transpose() view of a contiguous matrix therefore needs no copy (trans flag, ld = its row
 * stride). Other layouts, and operands with batch dims, are copied once to a contiguous
 * [batch..., rows, cols]; a 2-D operand shared by every batch entry keeps batch stride 0. */
static ebb_status mm_operand(const char *fn, const ebb_tensor_t *t, int nb, const int64_t *bshape, int64_t rows, int64_t cols,
                                  ebb_tensor_t **use, int32_t *trans, int64_t *ld, int64_t *bstride) {
  const int n = t->ndim;
  const int64_t rs = t->strides[n - 2], cs = t->strides[n - 1];
  if (n == 2) {
    if (cs == 1 && rs >= (cols > 1 ? cols : 1)) {
      *trans = 0, *ld = rs > 0 ? rs : 1;
    } else if (rs == 1 && cs >= (rows > 1 ? rows : 1)) {
      *trans = 1, *ld = cs;
    } else {
      goto copy;
    }
    atomic_fetch_add_explicit(&((ebb_tensor_t *)t)->refs, 1, memory_order_relaxed);
    *use = (ebb_tensor_t *)t;
    *bstride = 0; /* one matrix serves every batch entry */
    return EBB_OK;
  }
copy:;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  for (int d = 0; d < nb; d++) shape[d] = bshape[d];
  shape[nb] = rows;
  shape[nb + 1] = cols;
  ebb_tensor_t *e;
  ebb_status st = ebb_tensor_expand(t, nb + 2, shape, &e);
  if (st) {
    char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: %s", fn, why);
  }
  ebb_tensor_t *c;
  st = ebb_tensor_clone(e, &c);
  ebb__tensor_put(e);
  if (st) return ebb__fail_in(fn, st);
  *use = c;
  *trans = 0;
  *ld = cols > 1 ? cols : 1;
  *bstride = rows * cols;
  return EBB_OK;
}

ebb_status ebb__mm_gpu(const char *fn, int device, const ebb__mm_args *g, const ebb__operand *ops) {
  if (device == EBB_DEVICE_CPU) return EBB_ENOTSUP;
  ebb_dev_caps caps;
  ebb_status st = ebb_dev_get_caps(device, &caps);
  if (st) return ebb__fail_in(fn, st);
  if (caps.cpu_kernels) return EBB_ENOTSUP;
  ebb_stream_t *s;
  st = ebb_stream_current(device, &s);
  if (!st) st = ebb__operands_use(fn, ops, 3, s);
  if (!st) st = ebb__gpu_gemm(fn, device, s, g);
  return st == EBB_ENOTSUP ? st : ebb__fail_in(fn, st);
}

static ebb_status matmul_run(const char *fn, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (st) return ebb__fail_in(fn, st);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  if (a->ndim < 2 || b->ndim < 2)
    return ebb__fail_about2(EBB_EINVAL, fn, a, "a", b, "b", "do not fit; expected at least 2 dims each (unsqueeze a vector)");
  if (a->stor->device != b->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, a, "a", b, "b", "are on different devices; expected one device");
  ebb_dtype dt;
  ebb_op_promote(a->dtype, b->dtype, &dt);
  if (!ebb_dtype_is_float(a->dtype) || !ebb_dtype_is_float(b->dtype))
    return ebb__fail_about2(EBB_EINVAL, fn, a, "a", b, "b", "do not fit; expected floating dtypes");
  const int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1], n = b->shape[b->ndim - 1];
  if (b->shape[b->ndim - 2] != k)
    return ebb__fail_about2(EBB_EINVAL, fn, a, "a", b, "b", "do not fit: inner dims %lld and %lld differ; expected a [..., m, k] and "
                            "b [..., k, n]", (long long)k, (long long)b->shape[b->ndim - 2]);
  /* batch dims broadcast like elementwise shapes */
  int nb;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  st = ebb__broadcast_shape(fn, a, "a", a->ndim - 2, b, "b", b->ndim - 2, &nb, shape);
  if (st) return ebb__fail_in(fn, st);
  shape[nb] = m;
  shape[nb + 1] = n;
  int64_t batch = ebb__numel(shape, nb);
  /* gemm runs in f32 or f64: other floating dtypes go through f32 copies */
  const ebb_dtype ct = dt == EBB_F64 ? EBB_F64 : EBB_F32;
  ebb_tensor_t *ca = NULL, *cb = NULL, *ua = NULL, *ub = NULL, *r = NULL, *res = NULL;
  if (a->dtype != ct) st = ebb_tensor_to_dtype(a, ct, &ca);
  if (!st && b->dtype != ct) st = ebb_tensor_to_dtype(b, ct, &cb);
  if (!st) st = ebb__tensor_new(fn, a->stor->device, ct, nb + 2, shape, &r);
  if (st) goto done;
  if (batch * m * n > 0) {
    if (k == 0) {
      st = ebb__ew_run(fn, EBB__EW_FILL, r, 0, NULL, 0, 0);
      if (st) goto done;
    } else {
      ebb__mm_args g;
      memset(&g, 0, sizeof g);
      st = mm_operand(fn, ca ? ca : a, nb, shape, m, k, &ua, &g.trans_a, &g.lda, &g.sa);
      if (!st) st = mm_operand(fn, cb ? cb : b, nb, shape, k, n, &ub, &g.trans_b, &g.ldb, &g.sb);
      if (st) goto done;
      g.dtype = ct;
      g.batch = batch;
      g.m = m, g.n = n, g.k = k;
      g.ldc = n;
      g.sc = m * n;
      g.a = ebb__tensor_ptr(ua);
      g.b = ebb__tensor_ptr(ub);
      g.c = ebb__tensor_ptr(r);
      ebb__operand ops[3] = {{r, true}, {ua, false}, {ub, false}};
      st = ebb__mm_gpu(fn, a->stor->device, &g, ops);
      if (st == EBB_ENOTSUP) st = ebb__launch(fn, EBB__K_MATMUL, a->stor->device, &g, ops, 3, batch * m * n);
      if (st) goto done;
    }
  }
  if (ct != dt) {
    st = ebb_tensor_to_dtype(r, dt, &res);
    if (st) goto done;
  } else {
    res = r;
    r = NULL;
  }
  *out = res;
done:
  ebb__tensor_put(ca);
  ebb__tensor_put(cb);
  ebb__tensor_put(ua);
  ebb__tensor_put(ub);
  ebb__tensor_put(r);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_matmul(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_matmul", EBB__OP_MATMUL, NULL, out, matmul_run("ebb_op_matmul", a, b, out), a, b);
}

/* C = A B gives dA = dC B^T and dB = A^T dC per batch entry; an operand broadcast over the
 * batch receives the sum over the batch (sum_to_shape). The transposes are views, which the
 * gemm operand rule above takes without copying in the 2-D case. */
ebb_status ebb_op_matmul_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                                  ebb_tensor_t **gb) {
  const char *fn = "ebb_op_matmul_backward";
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (st) return ebb__fail_in(fn, st);
  if (!ga && !gb) return ebb__fail(EBB_EINVAL, "%s: grad_a and grad_b are both NULL; expected at least one to fill", fn);
  if (a->ndim < 2 || b->ndim < 2 || grad->ndim < 2 || grad->shape[grad->ndim - 2] != a->shape[a->ndim - 2] ||
      grad->shape[grad->ndim - 1] != b->shape[b->ndim - 1] || a->shape[a->ndim - 1] != b->shape[b->ndim - 2]) {
    char x[EBB__DESC_MAX], y[EBB__DESC_MAX], z[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s does not match %s @ %s; expected grad of shape [..., m, n]", fn, EBB__DESC(grad, "grad", x),
                     EBB__DESC(a, "a", y), EBB__DESC(b, "b", z));
  }
  ebb_tensor_t *bt = NULL, *at = NULL, *pa = NULL, *pb = NULL, *ra = NULL, *rb = NULL;
  if (ga) {
    st = ebb_tensor_transpose(b, -1, -2, &bt);
    if (!st) st = matmul_run(fn, grad, bt, &pa);
    if (!st) st = ebb_op_sum_to_shape(pa, a->ndim, a->shape, &ra);
    if (!st && ra->dtype != a->dtype) {
      ebb_tensor_t *c;
      st = ebb_tensor_to_dtype(ra, a->dtype, &c);
      ebb__tensor_put(ra);
      ra = st ? NULL : c;
    }
  }
  if (!st && gb) {
    st = ebb_tensor_transpose(a, -1, -2, &at);
    if (!st) st = matmul_run(fn, at, grad, &pb);
    if (!st) st = ebb_op_sum_to_shape(pb, b->ndim, b->shape, &rb);
    if (!st && rb->dtype != b->dtype) {
      ebb_tensor_t *c;
      st = ebb_tensor_to_dtype(rb, b->dtype, &c);
      ebb__tensor_put(rb);
      rb = st ? NULL : c;
    }
  }
  ebb__tensor_put(bt);
  ebb__tensor_put(at);
  ebb__tensor_put(pa);
  ebb__tensor_put(pb);
  return ebb__fail_in(fn, ebb__grads_out(st, ra, ga, rb, gb));
}
