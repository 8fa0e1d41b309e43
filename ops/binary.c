/* binary.c: the broadcasting binary ops add, sub, mul and div, their backward math, their
 * in-place forms (add_, mul_) and the autograd engine's lean in-place kernels.
 *
 * A forward settles the result dtype by ops.h's promotion rule and runs one elementwise kernel
 * (ebb__ew_binary); a backward is a composition of forward ops summed back to each input's
 * shape (ebb__grad_for).
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

/* ---- add, sub, mul, div --------------------------------------------------------------------------- */

/* Inputs without an autograd slot make ebb__rec_exit record nothing, and these ops call no public
 * op of their own, so they skip the recording bracket (a thread-local depth in and out): a
 * tenth of a small op's cost. A NULL input takes the bracket, whose op reports it; a released
 * one has its slot cleared and is reported by the op as well. */
#define EBB__BINARY_OP(fn, rec_op, ew_op, kind, a, b, out)                                  \
  do {                                                                                    \
    if (EBB_LIKELY((a) && (b) && !(a)->autograd && !(b)->autograd))                       \
      return ebb__ew_binary((fn), (ew_op), (kind), (a), (b), (out));                      \
    EBB__RECORDED((fn), (rec_op), NULL, (out), ebb__ew_binary((fn), (ew_op), (kind), (a), (b), (out)), (a), (b)); \
  } while (0)

ebb_status ebb_op_add(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__BINARY_OP("ebb_op_add", EBB__OP_ADD, EBB__EW_ADD, EBB__ARITH, a, b, out);
}

ebb_status ebb_op_sub(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__BINARY_OP("ebb_op_sub", EBB__OP_SUB, EBB__EW_SUB, EBB__ARITH, a, b, out);
}

ebb_status ebb_op_mul(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__BINARY_OP("ebb_op_mul", EBB__OP_MUL, EBB__EW_MUL, EBB__ARITH, a, b, out);
}

ebb_status ebb_op_div(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__BINARY_OP("ebb_op_div", EBB__OP_DIV, EBB__EW_DIV, EBB__DIVIDE, a, b, out);
}

/* Shared by the four binary backward functions: checks, then per requested input computes the
 * local product (mode) and sums it to the input's shape. */
enum ebb__bin_bw { EBB__BW_ADD, EBB__BW_SUB, EBB__BW_MUL, EBB__BW_DIV };

/* The local products before summing to the input's shape (new references). For a: grad (add,
 * sub), grad * b (mul), grad / b (div). For b: grad (add), -grad (sub), grad * a (mul),
 * -(grad / b) * (a / b) = -grad * a / b^2 (div). */
static ebb_status local_a(int mode, const ebb_tensor_t *grad, const ebb_tensor_t *b, ebb_tensor_t **out) {
  if (mode == EBB__BW_MUL) return ebb_op_mul(grad, b, out);
  if (mode == EBB__BW_DIV) return ebb_op_div(grad, b, out);
  atomic_fetch_add_explicit(&((ebb_tensor_t *)grad)->refs, 1, memory_order_relaxed);
  *out = (ebb_tensor_t *)grad;
  return EBB_OK;
}

static ebb_status local_b(int mode, const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  if (mode == EBB__BW_SUB) return ebb_op_neg(grad, out);
  if (mode == EBB__BW_MUL) return ebb_op_mul(grad, a, out);
  if (mode == EBB__BW_ADD) return local_a(mode, grad, b, out);
  ebb_tensor_t *gb = NULL, *ab = NULL, *p = NULL;
  ebb_status st = ebb_op_div(grad, b, &gb);
  if (!st) st = ebb_op_div(a, b, &ab);
  if (!st) st = ebb_op_mul(gb, ab, &p);
  if (!st) st = ebb_op_neg(p, out);
  ebb__tensor_put(gb);
  ebb__tensor_put(ab);
  ebb__tensor_put(p);
  return st;
}

static ebb_status binary_backward(const char *fn, int mode, const ebb_tensor_t *grad, const ebb_tensor_t *a,
                                       const ebb_tensor_t *b, ebb_tensor_t **ga, ebb_tensor_t **gb) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st && ga) st = ebb__ew_bw_check(fn, grad, "a", a);
  if (!st && gb) st = ebb__ew_bw_check(fn, grad, "b", b);
  if (!st && !ga && !gb) st = ebb__fail(EBB_EINVAL, "%s: grad_a and grad_b are both NULL; expected at least one to fill", fn);
  if (!st && !ga) st = ebb__tensor_check(grad, fn, "grad");
  if (st) return ebb__fail_in(fn, st);
  int nd;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  st = ebb__broadcast_shape(fn, a, "a", a->ndim, b, "b", b->ndim, &nd, shape);
  if (st) return ebb__fail_in(fn, st);
  if (nd != grad->ndim || memcmp(shape, grad->shape, sizeof(int64_t) * (size_t)nd) != 0) {
    char x[EBB__DESC_MAX], y[128];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the forward output's shape; expected %s", fn, EBB__DESC(grad, "grad", x),
                     ebb__shape_str(shape, nd, y, sizeof y));
  }
  ebb_tensor_t *la = NULL, *lb = NULL, *ra = NULL, *rb = NULL;
  if (ga) st = local_a(mode, grad, b, &la);
  if (!st && ga) st = ebb__grad_for(fn, la, a, &ra);
  if (!st && gb) st = local_b(mode, grad, a, b, &lb);
  if (!st && gb) st = ebb__grad_for(fn, lb, b, &rb);
  ebb__tensor_put(la);
  ebb__tensor_put(lb);
  return ebb__fail_in(fn, ebb__grads_out(st, ra, ga, rb, gb));
}

ebb_status ebb_op_add_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                               ebb_tensor_t **gb) {
  return binary_backward("ebb_op_add_backward", EBB__BW_ADD, grad, a, b, ga, gb);
}

ebb_status ebb_op_sub_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                               ebb_tensor_t **gb) {
  return binary_backward("ebb_op_sub_backward", EBB__BW_SUB, grad, a, b, ga, gb);
}

ebb_status ebb_op_mul_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                               ebb_tensor_t **gb) {
  return binary_backward("ebb_op_mul_backward", EBB__BW_MUL, grad, a, b, ga, gb);
}

ebb_status ebb_op_div_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **ga,
                               ebb_tensor_t **gb) {
  return binary_backward("ebb_op_div_backward", EBB__BW_DIV, grad, a, b, ga, gb);
}

/* ---- in place --------------------------------------------------------------------------------------- */

/* dst op= src is dst = dst op src with dst as the output: allowed only when that result has
 * dst's shape and dtype, and dst has no stride-0 dims (two output positions sharing one
 * element would make the result depend on the order of the writes). */
static ebb_status elementwise_inplace(const char *fn, int op, ebb_tensor_t *dst, const ebb_tensor_t *src) {
  ebb_status st = ebb__tensor_check(dst, fn, "dst");
  if (!st) st = ebb__tensor_check(src, fn, "src");
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt;
  ebb_op_promote(dst->dtype, src->dtype, &dt);
  if (dt != dst->dtype || dt == EBB_BOOL)
    return ebb__fail_about2(EBB_EINVAL, fn, dst, "dst", src, "src", "do not fit: the result (%s) cannot be stored in dst in place",
                            ebb_dtype_name(dt));
  if (src->stor->device != dst->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, src, "src", dst, "dst", "are on different devices; expected one device (copy with "
                            "ebb_tensor_to_device)");
  for (int d = 0; d < dst->ndim; d++)
    if (dst->strides[d] == 0 && dst->shape[d] > 1)
      return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "is expanded along dim %d (stride 0); expected a writable tensor", d);
  /* The result keeps dst's shape only where src broadcasts to it (trailing dims equal or 1). */
  bool fits = src->ndim <= dst->ndim;
  for (int d = 1; fits && d <= src->ndim; d++) fits = src->shape[src->ndim - d] == 1 || src->shape[src->ndim - d] == dst->shape[dst->ndim - d];
  if (!fits) {
    char d[EBB__DESC_MAX];
    return ebb__fail_about(EBB_EINVAL, fn, src, "src", "does not broadcast to the shape of %s; an in-place op cannot change dst's shape",
                           EBB__DESC(dst, "dst", d));
  }
  void *token = NULL;
  st = ebb__inplace_check(fn, op == EBB__EW_ADD ? EBB__OP_ADD_ : EBB__OP_MUL_, dst, &src, 1, NULL, &token);
  if (st) return st;
  /* src on dst's storage in another geometry (a row of dst broadcast over it) would be read after
   * the kernel wrote some of it: it is read through a copy, made first on the same stream. The
   * identical view (x op= x) reads each element before writing it and needs none. */
  ebb_tensor_t *copy = NULL;
  bool same = src->offset == dst->offset && src->ndim == dst->ndim &&
              memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) == 0 &&
              memcmp(src->strides, dst->strides, sizeof(int64_t) * (size_t)dst->ndim) == 0 && src->dtype == dst->dtype;
  if (src->stor == dst->stor && !same) st = ebb__copy_as(fn, src, src->dtype, &copy);
  const ebb_tensor_t *in[2] = {dst, copy ? copy : src};
  if (!st) st = ebb__ew_run(fn, op, dst, 2, in, 0, 0);
  ebb__tensor_put(copy);
  if (!st) atomic_fetch_add_explicit(&dst->stor->version, 1, memory_order_relaxed);
  ebb__inplace_end(token, !st);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_add_(ebb_tensor_t *dst, const ebb_tensor_t *src) { return elementwise_inplace("ebb_op_add_", EBB__EW_ADD, dst, src); }
ebb_status ebb_op_mul_(ebb_tensor_t *dst, const ebb_tensor_t *src) { return elementwise_inplace("ebb_op_mul_", EBB__EW_MUL, dst, src); }

/* ---- the engine's lean path (ops_export.h) ---------------------------------------------------
 * For gradient buffers autograd's engine holds alone: the caller has checked the operands (live,
 * one device, b broadcasting to t's shape, t floating and contiguous), so only the kernel runs:
 * no argument checks, no in-place hook, no record, no version bump (nothing else sees t). */

ebb_status ebb__lean_scale_(ebb_tensor_t *t, double s) {
  const ebb_tensor_t *in[1] = {t};
  return ebb__ew_run("autograd backward", EBB__EW_MULS, t, 1, in, s, 0);
}

ebb_status ebb__lean_mul_(ebb_tensor_t *t, const ebb_tensor_t *b) {
  const ebb_tensor_t *in[2] = {t, b};
  return ebb__ew_run("autograd backward", EBB__EW_MUL, t, 2, in, 0, 0);
}

ebb_status ebb__lean_add_(ebb_tensor_t *t, const ebb_tensor_t *b) {
  const ebb_tensor_t *in[2] = {t, b};
  return ebb__ew_run("autograd backward", EBB__EW_ADD, t, 2, in, 0, 0);
}
