/* inplace.c: the in-place updates a training step is made of, dst op= f(dst, src...), and
 * beside them their backward as derivative-table entries (ops_export.h).
 *
 * add_scaled_ (dst += alpha * src), add_scalar_, mul_scalar_, lerp_, addcmul_, addcdiv_, sqrt_
 * and zero_ each run one pass of the elementwise kernel with dst as both its first input and
 * its output (a fused kernel code where one op would otherwise take several: ops_kernels.h),
 * so an optimizer's update allocates nothing. Every call goes the way ebb_op_add_ does: check
 * the arguments, ask the inplace hook (ebb__inplace_check: autograd records the change or
 * refuses it, and the watchers of every write see it), read a src that overlaps dst in another
 * geometry through a copy, run, bump dst's version, tell the hook how it went.
 *
 * The backward functions have the table's signature; each reads only what its entry saves.
 * Threading: no state of its own; thread-safe as the tensor calls it makes (the caller orders
 * an in-place op with the other users of dst, as for any write).
 */
#include <math.h>
#include <stdio.h>

#include "ops_impl.h"

/* ---- the shared path ---------------------------------------------------------------------------- */

/* Which dtypes of dst an op can store its result in. */
enum inplace_dst { DST_ANY, DST_NUMERIC, DST_FLOATING };

typedef struct inplace_op {
  const char *fn;
  ebb__op_id op;            /* its derivative-table entry, the inplace hook's op */
  int ew;                   /* the kernel code */
  int nsrc;                 /* tensors besides dst (0..2) */
  const char *names[2];     /* their argument names */
  enum inplace_dst dst;
  bool scalar;              /* takes a scalar (args.s[0], the kernel's s0) */
} inplace_op;

/* Whether a and b are the same view: the kernel then reads each element before writing it. */
static bool same_view(const ebb_tensor_t *a, const ebb_tensor_t *b) {
  return a->stor == b->stor && a->offset == b->offset && a->dtype == b->dtype && a->ndim == b->ndim &&
         memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0 &&
         memcmp(a->strides, b->strides, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

/* The result keeps dst's shape only where src broadcasts to it (trailing dims equal or 1, no
 * more dims than dst). */
static ebb_status check_fits(const char *fn, const ebb_tensor_t *dst, const ebb_tensor_t *src, const char *name) {
  bool fits = src->ndim <= dst->ndim;
  for (int d = 1; fits && d <= src->ndim; d++)
    fits = src->shape[src->ndim - d] == 1 || src->shape[src->ndim - d] == dst->shape[dst->ndim - d];
  if (fits) return EBB_OK;
  char a[EBB__DESC_MAX], b[EBB__DESC_MAX], s[128];
  return ebb__fail(EBB_EINVAL, "%s: %s does not broadcast to the shape of %s, and an in-place op cannot change dst's shape; "
                   "expected %s of a shape that broadcasts to %s", fn, EBB__DESC(src, name, a), EBB__DESC(dst, "dst", b), name,
                   EBB__SHAPE(dst, s));
}

/* The arguments of an in-place op, in the order a caller fixes them: handles, dtypes, devices,
 * dst writable, shapes. */
static ebb_status inplace_args(const inplace_op *o, const ebb_tensor_t *dst, const ebb_tensor_t *const *src, double s) {
  const char *fn = o->fn;
  ebb_status st = ebb__tensor_check(dst, fn, "dst");
  for (int i = 0; i < o->nsrc && !st; i++) st = ebb__tensor_check(src[i], fn, o->names[i]);
  if (st) return st;
  if (o->dst == DST_FLOATING && !ebb_dtype_is_float(dst->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "has dtype %s; expected a floating dtype (convert with ebb_tensor_to_dtype)",
                           ebb_dtype_name(dst->dtype));
  if (o->dst == DST_NUMERIC && dst->dtype == EBB_BOOL)
    return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "has dtype bool; expected a numeric dtype (no arithmetic on bool)");
  if (o->scalar && !ebb_dtype_is_float(dst->dtype) && (s != floor(s) || !(fabs(s) < 9.2e18)))
    return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "cannot hold the result of the scalar %g in place; expected an integer "
                           "scalar for an integer dst, or a floating dst", s);
  for (int i = 0; i < o->nsrc; i++) {
    ebb_dtype dt;
    ebb_op_promote(dst->dtype, src[i]->dtype, &dt);
    if (dt != dst->dtype)
      return ebb__fail_about2(EBB_EINVAL, fn, dst, "dst", src[i], o->names[i], "do not fit: the result (%s) cannot be stored in dst "
                              "in place; expected %s of dst's dtype or one that promotes to it", ebb_dtype_name(dt), o->names[i]);
    if (src[i]->stor->device != dst->stor->device)
      return ebb__fail_about2(EBB_EDEVICE, fn, src[i], o->names[i], dst, "dst", "are on different devices; expected one device "
                              "(copy with ebb_tensor_to_device)");
  }
  for (int d = 0; d < dst->ndim; d++)
    if (dst->strides[d] == 0 && dst->shape[d] > 1)
      return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "is expanded along dim %d (stride 0): its elements alias; expected a "
                             "writable tensor", d);
  for (int i = 0; i < o->nsrc && !st; i++) st = check_fits(fn, dst, src[i], o->names[i]);
  return st;
}

static ebb_status inplace_run(const inplace_op *o, ebb_tensor_t *dst, const ebb_tensor_t *const *src, double s) {
  ebb_status st = inplace_args(o, dst, src, s);
  if (st) return st;
  const ebb__op_args args = {.s = {s}};
  void *token = NULL;
  st = ebb__inplace_check(o->fn, o->op, dst, src, o->nsrc, o->scalar ? &args : NULL, &token);
  if (st) return st;
  /* A src on dst's storage in another geometry (a row of dst broadcast over it) would be read
   * after the kernel wrote some of it: it is read through a copy, made first on the same stream. */
  ebb_tensor_t *copies[2] = {NULL, NULL};
  const ebb_tensor_t *in[3] = {dst, NULL, NULL};
  for (int i = 0; i < o->nsrc && !st; i++) {
    if (src[i]->stor == dst->stor && !same_view(src[i], dst)) st = ebb__copy_as(o->fn, src[i], src[i]->dtype, &copies[i]);
    in[1 + i] = copies[i] ? copies[i] : src[i];
  }
  /* zero_ fills: no input, not even dst */
  const int nin = o->ew == EBB__EW_FILL ? 0 : 1 + o->nsrc;
  if (!st) st = ebb__ew_run(o->fn, o->ew, dst, nin, nin ? in : NULL, s, 0);
  ebb__tensor_put(copies[0]);
  ebb__tensor_put(copies[1]);
  if (!st) atomic_fetch_add_explicit(&dst->stor->version, 1, memory_order_relaxed);
  ebb__inplace_end(token, !st);
  return ebb__fail_in(o->fn, st);
}

/* ---- the ops --------------------------------------------------------------------------------------- */

ebb_status ebb_op_add_scaled_(ebb_tensor_t *dst, const ebb_tensor_t *src, double alpha) {
  static const inplace_op o = {"ebb_op_add_scaled_", EBB__OP_ADD_SCALED_, EBB__EW_ADD_SCALED, 1, {"src"}, DST_NUMERIC, true};
  return inplace_run(&o, dst, &src, alpha);
}

ebb_status ebb_op_add_scalar_(ebb_tensor_t *dst, double s) {
  static const inplace_op o = {"ebb_op_add_scalar_", EBB__OP_ADD_SCALAR_, EBB__EW_ADDS, 0, {NULL}, DST_NUMERIC, true};
  return inplace_run(&o, dst, NULL, s);
}

ebb_status ebb_op_mul_scalar_(ebb_tensor_t *dst, double s) {
  static const inplace_op o = {"ebb_op_mul_scalar_", EBB__OP_MUL_SCALAR_, EBB__EW_MULS, 0, {NULL}, DST_NUMERIC, true};
  return inplace_run(&o, dst, NULL, s);
}

ebb_status ebb_op_lerp_(ebb_tensor_t *dst, const ebb_tensor_t *end, double weight) {
  static const inplace_op o = {"ebb_op_lerp_", EBB__OP_LERP_, EBB__EW_LERP, 1, {"end"}, DST_FLOATING, true};
  return inplace_run(&o, dst, &end, weight);
}

ebb_status ebb_op_addcmul_(ebb_tensor_t *dst, const ebb_tensor_t *t1, const ebb_tensor_t *t2, double value) {
  static const inplace_op o = {"ebb_op_addcmul_", EBB__OP_ADDCMUL_, EBB__EW_ADDCMUL, 2, {"t1", "t2"}, DST_FLOATING, true};
  const ebb_tensor_t *src[2] = {t1, t2};
  return inplace_run(&o, dst, src, value);
}

ebb_status ebb_op_addcdiv_(ebb_tensor_t *dst, const ebb_tensor_t *t1, const ebb_tensor_t *t2, double value) {
  static const inplace_op o = {"ebb_op_addcdiv_", EBB__OP_ADDCDIV_, EBB__EW_ADDCDIV, 2, {"t1", "t2"}, DST_FLOATING, true};
  const ebb_tensor_t *src[2] = {t1, t2};
  return inplace_run(&o, dst, src, value);
}

ebb_status ebb_op_sqrt_(ebb_tensor_t *dst) {
  static const inplace_op o = {"ebb_op_sqrt_", EBB__OP_SQRT_, EBB__EW_SQRT, 0, {NULL}, DST_FLOATING, false};
  return inplace_run(&o, dst, NULL, 0);
}

/* ebb_tensor_zero_ under the ops' name: the same derivative-table entry (ZeroBackward, which
 * has no backward: the result does not depend on the old value). */
ebb_status ebb_op_zero_(ebb_tensor_t *dst) {
  static const inplace_op o = {"ebb_op_zero_", EBB__OP_ZERO_, EBB__EW_FILL, 0, {NULL}, DST_ANY, false};
  return inplace_run(&o, dst, NULL, 0);
}

/* ---- backward (derivative-table entries) ------------------------------------------------------------
 * Input 0 is dst's old value, inputs 1.. the srcs; go[0] the gradient of dst's new value, with
 * dst's shape, dtype and device. */

/* g * s fitted to input i (g itself when s is 1). */
static ebb_status scaled_to(const ebb__bw_ctx *c, int i, const ebb_tensor_t *g, double s, ebb_tensor_t **out) {
  if (s == 1.0) return ebb__grad_fit(&c->in[i], g, out);
  ebb_tensor_t *t = NULL;
  ebb_status st = ebb_op_mul_scalar(g, s, &t);
  if (!st) st = ebb__grad_fit(&c->in[i], t, out);
  ebb__tensor_put(t);
  return st;
}

/* Releases gin[0..n) after a failure; returns st. */
static ebb_status drop_on_failure(ebb_status st, ebb_tensor_t **gin, int n) {
  if (st)
    for (int i = 0; i < n; i++) {
      ebb__tensor_put(gin[i]);
      gin[i] = NULL;
    }
  return st;
}

/* dst += alpha * src: dst's old value gets g, src alpha * g summed to its shape. */
ebb_status ebb__bw_add_scaled_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  ebb_status st = c->need[0] ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
  if (!st && c->need[1]) st = scaled_to(c, 1, go[0], c->args->s[0], &gin[1]);
  return drop_on_failure(st, gin, 2);
}

/* dst += s: g. */
ebb_status ebb__bw_add_scalar_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return c->need[0] ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
}

/* dst *= s: s * g. */
ebb_status ebb__bw_mul_scalar_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return c->need[0] ? scaled_to(c, 0, go[0], c->args->s[0], &gin[0]) : EBB_OK;
}

/* dst = (1 - w) dst + w end: (1 - w) g for dst's old value, w g summed to end's shape. */
ebb_status ebb__bw_lerp_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  const double w = c->args->s[0];
  ebb_status st = c->need[0] ? scaled_to(c, 0, go[0], 1.0 - w, &gin[0]) : EBB_OK;
  if (!st && c->need[1]) st = scaled_to(c, 1, go[0], w, &gin[1]);
  return drop_on_failure(st, gin, 2);
}

/* dst += v t1 t2 (mul) or v t1 / t2 (div): g for dst's old value; for t1 v g t2 (mul) or
 * v g / t2 (div); for t2 v g t1 (mul) or -v g t1 / t2^2 (div). */
static ebb_status addc_backward(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin, bool divide) {
  const double v = c->args->s[0];
  const ebb_tensor_t *t1 = c->saved_in[1], *t2 = c->saved_in[2];
  ebb_tensor_t *p = NULL, *q = NULL, *r = NULL;
  ebb_status st = c->need[0] ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
  if (!st && c->need[1]) {
    st = divide ? ebb_op_div(go[0], t2, &p) : ebb_op_mul(go[0], t2, &p);
    if (!st) st = scaled_to(c, 1, p, v, &gin[1]);
    ebb__tensor_put(p);
    p = NULL;
  }
  if (!st && c->need[2]) {
    if (divide) { /* -v g t1 / t2^2 = (g / t2) (t1 / t2) (-v) */
      st = ebb_op_div(go[0], t2, &p);
      if (!st) st = ebb_op_div(t1, t2, &q);
      if (!st) st = ebb_op_mul(p, q, &r);
      if (!st) st = scaled_to(c, 2, r, -v, &gin[2]);
    } else {
      st = ebb_op_mul(go[0], t1, &p);
      if (!st) st = scaled_to(c, 2, p, v, &gin[2]);
    }
  }
  ebb__tensor_put(p);
  ebb__tensor_put(q);
  ebb__tensor_put(r);
  return drop_on_failure(st, gin, 3);
}

ebb_status ebb__bw_addcmul_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return addc_backward(c, go, gin, false);
}

ebb_status ebb__bw_addcdiv_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return addc_backward(c, go, gin, true);
}

/* dst = sqrt(dst): g * 0.5 / sqrt(x), from the old value x (saved as a copy before the op). */
ebb_status ebb__bw_sqrt_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return c->need[0] ? ebb_op_pow_scalar_backward(go[0], c->saved_in[0], 0.5, &gin[0]) : EBB_OK;
}
