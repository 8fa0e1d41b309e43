/* ew.c: the elementwise plumbing: broadcasting, the geometry of an elementwise launch and
 * ebb__ew_run, the one call every elementwise kernel goes through; then the steps the elementwise
 * families (binary.c, scalar.c, unary.c, compare.c) share: dtype promotion (ebb_op_promote), the
 * argument checks, the result's allocation and kernel (ebb__ew_new), and on the backward side
 * the checks, a gradient summed to its input's shape (ebb__grad_for) and grad times one kernel
 * of x (ebb__local_backward).
 *
 * Every forward op checks its arguments, settles the result dtype by the promotion rules of
 * ops.h, allocates the result on the inputs' device and runs the "ebb.ops.ew" kernel once.
 * Backward functions are compositions of forward ops; their temporaries are released before
 * they return, and gradients are summed back to each input's shape.
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

/* ---- broadcasting and the elementwise launch ------------------------------------------------- */

ebb_status ebb__broadcast_strides(const char *fn, const char *arg, const ebb_tensor_t *t, int ndim, const int64_t *shape,
                                  int64_t *strides) {
  if (t->ndim > ndim) goto fail;
  for (int d = ndim - 1, j = t->ndim - 1; d >= 0; d--, j--) {
    if (j < 0) strides[d] = 0;
    else if (t->shape[j] == shape[d]) strides[d] = shape[d] == 1 ? 0 : t->strides[j];
    else if (t->shape[j] == 1) strides[d] = 0;
    else goto fail;
  }
  return EBB_OK;
fail:;
  char b[128];
  return ebb__fail_about(EBB_EINVAL, fn, t, arg, "does not broadcast to %s", ebb__shape_str(shape, ndim, b, sizeof b));
}

static EBB_COLD ebb_status no_broadcast(const char *fn, const ebb_tensor_t *a, const char *an, const ebb_tensor_t *b, const char *bn,
                                       bool batch, int d, int64_t x, int64_t y) {
  char sa[EBB__DESC_MAX], sb[EBB__DESC_MAX];
  return ebb__fail(EBB_EINVAL, "%s: %s and %s do not broadcast%s: dim %d has %lld and %lld; expected equal extents or 1", fn,
                   EBB__DESC(a, an, sa), EBB__DESC(b, bn, sb), batch ? " in their batch dims" : "", d, (long long)x, (long long)y);
}

ebb_status ebb__broadcast_shape(const char *fn, const ebb_tensor_t *a, const char *an, int na, const ebb_tensor_t *b, const char *bn,
                                int nb, int *ndim, int64_t *shape) {
  int n = na > nb ? na : nb;
  for (int d = n - 1, i = na - 1, j = nb - 1; d >= 0; d--, i--, j--) {
    int64_t x = i >= 0 ? a->shape[i] : 1, y = j >= 0 ? b->shape[j] : 1;
    if (x != y && x != 1 && y != 1) return no_broadcast(fn, a, an, b, bn, na < a->ndim || nb < b->ndim, d, x, y);
    shape[d] = x == 1 ? y : x;
  }
  *ndim = n;
  return EBB_OK;
}

/* Coalescing matters for speed, not correctness: a contiguous tensor of any shape becomes one
 * dim, which is what the kernels' fast paths (and the inner loop's pointer stepping) need. */
void ebb__ew_geometry(ebb__ew_args *a, const ebb_tensor_t *out, int nin, const ebb_tensor_t *const *in,
                      const int64_t (*in_strides)[EBB_TENSOR_MAX_DIMS]) {
  /* Keep dims of extent > 1, then merge neighbours whose strides chain for every operand. */
  int nd = 0;
  for (int d = 0; d < out->ndim; d++) {
    if (out->shape[d] == 1) continue;
    a->shape[nd] = out->shape[d];
    a->st_out[nd] = out->strides[d];
    for (int k = 0; k < nin; k++) a->st_in[k][nd] = in_strides[k][d];
    if (nd > 0) {
      bool chain = a->st_out[nd - 1] == a->st_out[nd] * a->shape[nd];
      for (int k = 0; k < nin; k++) chain = chain && a->st_in[k][nd - 1] == a->st_in[k][nd] * a->shape[nd];
      if (chain) {
        a->shape[nd - 1] *= a->shape[nd];
        a->st_out[nd - 1] = a->st_out[nd];
        for (int k = 0; k < nin; k++) a->st_in[k][nd - 1] = a->st_in[k][nd];
        continue;
      }
    }
    nd++;
  }
  a->ndim = nd;
  a->nin = nin;
  a->dt_out = out->dtype;
  a->out = ebb__tensor_ptr(out);
  for (int k = 0; k < nin; k++) {
    a->dt_in[k] = in[k]->dtype;
    a->in[k] = ebb__tensor_ptr(in[k]);
  }
}

ebb_status ebb__ew_run(const char *fn, int op, ebb_tensor_t *out, int nin, const ebb_tensor_t *const *in, double s0, double s1) {
  static const char *const names[3] = {"a", "b", "c"};
  int64_t bst[3][EBB_TENSOR_MAX_DIMS];
  for (int k = 0; k < nin; k++) {
    if (in[k]->stor->device != out->stor->device)
      return ebb__fail_about2(EBB_EDEVICE, fn, in[k], names[k], out, "the result",
                              "are on different devices; expected one device (copy with ebb_tensor_to_device)");
    ebb_status st = ebb__broadcast_strides(fn, names[k], in[k], out->ndim, out->shape, bst[k]);
    if (st) return st;
  }
  if (ebb__numel(out->shape, out->ndim) == 0) return EBB_OK;
  ebb__ew_args a;
  memset(&a, 0, sizeof a);
  a.op = op;
  a.s0 = s0;
  a.s1 = s1;
  ebb__ew_geometry(&a, out, nin, in, (const int64_t(*)[EBB_TENSOR_MAX_DIMS])bst);
  ebb__operand ops[4] = {{out, true}};
  for (int k = 0; k < nin; k++) ops[k + 1] = (ebb__operand){in[k], false};
  const int64_t n = ebb__numel(out->shape, out->ndim);
  /* On a device, contiguous f32/bf16/f16 operands take the f32 kernel, a GPU thread per 4
   * elements (ops_math.h, ebb__ew_flat_f32); the CPU kernels serve both ids alike. */
  if (out->stor->device != EBB_DEVICE_CPU && ebb__ew_flat_f32(&a))
    return ebb__launch(fn, EBB__K_EW_F32, out->stor->device, &a, ops, nin + 1, (n + 3) / 4);
  return ebb__launch(fn, EBB__K_EW, out->stor->device, &a, ops, nin + 1, n);
}

/* The rule of ops.h: a lattice bool < i64 < floating, and among floating dtypes the wider
 * one, with bf16 + f16 going to f32 since neither holds the other (bf16 has the range, f16
 * the precision). */
ebb_status ebb_op_promote(ebb_dtype a, ebb_dtype b, ebb_dtype *out) {
  if ((unsigned)a >= EBB_DTYPE_COUNT || (unsigned)b >= EBB_DTYPE_COUNT || !out)
    return ebb__fail(EBB_EINVAL, "ebb_op_promote: dtypes %d and %d (or a NULL out); expected two ebb_dtype values", (int)a, (int)b);
  ebb_dtype r;
  if (a == b) r = a;
  else if (a == EBB_BOOL) r = b;
  else if (b == EBB_BOOL) r = a;
  else if (a == EBB_I64) r = b;
  else if (b == EBB_I64) r = a;
  else if (a == EBB_F64 || b == EBB_F64) r = EBB_F64;
  else r = EBB_F32; /* f32 with bf16/f16, or bf16 with f16 */
  *out = r;
  return EBB_OK;
}

ebb_dtype ebb__float_of(ebb_dtype dt) { return ebb_dtype_is_float(dt) ? dt : EBB_F32; }

/* ---- the families' forward steps ------------------------------------------------------------- */

ebb_status ebb__check_out(const char *fn, ebb_tensor_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  return EBB_OK;
}

/* The public names of an elementwise op's inputs: where's are (cond, a, b). */
static const char *const *ew_names(int nin) {
  static const char *const names2[2] = {"a", "b"}, *const names3[3] = {"cond", "a", "b"};
  return nin == 3 ? names3 : names2;
}

static EBB_COLD ebb_status ew_devices_differ(const char *fn, int nin, const ebb_tensor_t *const *in, int k) {
  char x[EBB__DESC_MAX], y[EBB__DESC_MAX];
  return ebb__fail(EBB_EDEVICE, "%s: %s and %s are on different devices; expected one device (copy with ebb_tensor_to_device)", fn,
                   EBB__DESC(in[k], ew_names(nin)[k], x), EBB__DESC(in[0], ew_names(nin)[0], y));
}

/* where's three shapes broadcast together. They do exactly when every pair of them does, so
 * each pair is checked (a failure names two real arguments), then b is folded into the shape of
 * cond and a. */
static ebb_status ew_shape3(const char *fn, const ebb_tensor_t *const *in, int *ndim, int64_t *shape) {
  const char *const *names = ew_names(3);
  ebb_status st = ebb__broadcast_shape(fn, in[0], names[0], in[0]->ndim, in[1], names[1], in[1]->ndim, ndim, shape);
  for (int j = 0; j < 2 && !st; j++) {
    int nd;
    int64_t s[EBB_TENSOR_MAX_DIMS];
    st = ebb__broadcast_shape(fn, in[j], names[j], in[j]->ndim, in[2], names[2], in[2]->ndim, &nd, s);
  }
  if (st) return st;
  int n = *ndim > in[2]->ndim ? *ndim : in[2]->ndim;
  int64_t folded[EBB_TENSOR_MAX_DIMS];
  for (int d = n - 1, i = *ndim - 1, j = in[2]->ndim - 1; d >= 0; d--, i--, j--) {
    int64_t x = i >= 0 ? shape[i] : 1, y = j >= 0 ? in[2]->shape[j] : 1;
    folded[d] = x == 1 ? y : x;
  }
  memcpy(shape, folded, sizeof(int64_t) * (size_t)n);
  *ndim = n;
  return EBB_OK;
}

/* out = op(in...) with the shape of in broadcast together and dtype dt. */
/* Every forward op ends here: broadcast the input shapes (where's three pairwise, so it gets the
 * same rule and message as a binary op), allocate the result, run one kernel. The kernel
 * converts each input's dtype as it loads, so mixed dtypes never need cast copies. */
ebb_status ebb__ew_new(const char *fn, int op, int nin, const ebb_tensor_t *const *in, ebb_dtype dt, double s0, double s1,
                              ebb_tensor_t **out) {
  int ndim = in[0]->ndim;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  memcpy(shape, in[0]->shape, sizeof shape);
  for (int k = 1; k < nin; k++)
    if (in[k]->stor->device != in[0]->stor->device) return ew_devices_differ(fn, nin, in, k);
  if (nin > 1) {
    ebb_status st = nin == 2 ? ebb__broadcast_shape(fn, in[0], "a", in[0]->ndim, in[1], "b", in[1]->ndim, &ndim, shape)
                             : ew_shape3(fn, in, &ndim, shape);
    if (st) return ebb__fail_in(fn, st);
  }
  ebb_tensor_t *r;
  ebb_status st = ebb__tensor_new(fn, in[0]->stor->device, dt, ndim, shape, &r);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__ew_run(fn, op, r, nin, in, s0, s1);
  if (st) {
    ebb__tensor_put(r);
    return ebb__fail_in(fn, st);
  }
  *out = r;
  return EBB_OK;
}

/* ---- the small-operand fast path --------------------------------------------------------------
 * An op on a few elements spends ten times its arithmetic on the general path's broadcast, launch
 * geometry and kernel dispatch. Two CPU operands of one floating dtype, one shape and contiguous
 * layout with at most EBB__EW_TINY elements get their result computed here instead: the same
 * one IEEE operation per element as the kernel (ops_math.h), so the values are the kernel's bit
 * for bit. The result is made by ebb__tensor_new as on the general path (the host pool, the
 * owner scope). */
#define EBB__EW_TINY 16
_Static_assert(EBB__EW_SUB == EBB__EW_ADD + 1 && EBB__EW_MUL == EBB__EW_ADD + 2 && EBB__EW_DIV == EBB__EW_ADD + 3,
               "the fast path's ops are one run of codes");

static bool tiny_contiguous(const ebb_tensor_t *t) {
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != expect) return false;
    expect *= t->shape[d];
  }
  return true;
}

/* The element count when a op b takes the fast path, else 0. */
static int64_t tiny_numel(int op, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_dtype dt) {
  if (op < EBB__EW_ADD || op > EBB__EW_DIV || (dt != EBB_F32 && dt != EBB_F64) || a->dtype != dt || b->dtype != dt ||
      a->ndim != b->ndim || a->stor->device != EBB_DEVICE_CPU || b->stor->device != EBB_DEVICE_CPU)
    return 0;
  int64_t n = 1;
  for (int d = 0; d < a->ndim; d++) {
    if (a->shape[d] != b->shape[d]) return 0;
    n *= a->shape[d];
  }
  if (n < 1 || n > EBB__EW_TINY || !tiny_contiguous(a) || !tiny_contiguous(b)) return 0;
  return n;
}

#define EBB__TINY_LOOP(T)                                            \
  do {                                                               \
    T *o_ = po;                                                      \
    const T *x_ = px, *y_ = py;                                      \
    switch (op) {                                                    \
    case EBB__EW_ADD: for (int64_t i = 0; i < n; i++) o_[i] = x_[i] + y_[i]; break; \
    case EBB__EW_SUB: for (int64_t i = 0; i < n; i++) o_[i] = x_[i] - y_[i]; break; \
    case EBB__EW_MUL: for (int64_t i = 0; i < n; i++) o_[i] = x_[i] * y_[i]; break; \
    default: for (int64_t i = 0; i < n; i++) o_[i] = x_[i] / y_[i]; break;          \
    }                                                                \
  } while (0)

static ebb_status tiny_binary(const char *fn, int op, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_dtype dt, int64_t n,
                              ebb_tensor_t **out) {
  ebb_tensor_t *r;
  ebb_status st = ebb__tensor_new(fn, EBB_DEVICE_CPU, dt, a->ndim, a->shape, &r);
  if (st) return ebb__fail_in(fn, st);
  /* (n >= 1: every storage has its block; the offsets are a's and b's, the result's is 0) */
  size_t es = ebb__dtype_size[dt];
  void *po = r->stor->data;
  const void *px = (const char *)a->stor->data + a->offset * (int64_t)es, *py = (const char *)b->stor->data + b->offset * (int64_t)es;
  if (dt == EBB_F32) EBB__TINY_LOOP(float);
  else EBB__TINY_LOOP(double);
  *out = r;
  return EBB_OK;
}
#undef EBB__TINY_LOOP

ebb_status ebb__ew_binary(const char *fn, int op, int kind, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st) st = ebb__check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt;
  ebb_op_promote(a->dtype, b->dtype, &dt);
  if (kind == EBB__ARITH && dt == EBB_BOOL)
    return ebb__fail_about2(EBB_EINVAL, fn, a, "a", b, "b",
                            "are both bool; arithmetic needs a numeric operand (convert with ebb_tensor_to_dtype)");
  if (kind == EBB__DIVIDE) dt = ebb__float_of(dt);
  if (kind == EBB__COMPARE) dt = EBB_BOOL;
  int64_t tiny = tiny_numel(op, a, b, dt);
  if (tiny) return tiny_binary(fn, op, a, b, dt, tiny, out);
  const ebb_tensor_t *in[2] = {a, b};
  return ebb__ew_new(fn, op, 2, in, dt, 0, 0, out);
}

ebb_status ebb__ew_unary(const char *fn, int op, int kind, const ebb_tensor_t *a, double s0, double s1, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt = kind == EBB__FLOAT ? ebb__float_of(a->dtype) : a->dtype;
  return ebb__ew_new(fn, op, 1, &a, dt, s0, s1, out);
}

/* ---- the families' backward steps ------------------------------------------------------------ */

/* Checks grad against the output shape the forward would have produced from `x` (for unary
 * ops: x's shape) and that x is floating. */
ebb_status ebb__ew_bw_check(const char *fn, const ebb_tensor_t *grad, const char *xname, const ebb_tensor_t *x) {
  ebb_status st = ebb__tensor_check(grad, fn, "grad");
  if (!st) st = ebb__tensor_check(x, fn, xname);
  if (st) return ebb__fail_in(fn, st);
  if (!ebb_dtype_is_float(x->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, x, xname, "has dtype %s, which has no gradient; expected a floating input",
                           ebb_dtype_name(x->dtype));
  if (grad->stor->device != x->stor->device)
    return ebb__fail_about2(EBB_EDEVICE, fn, grad, "grad", x, xname, "are on different devices; expected one device");
  return EBB_OK;
}

/* g summed to x's shape and converted to x's dtype (a new reference). */
ebb_status ebb__grad_for(const char *fn, const ebb_tensor_t *g, const ebb_tensor_t *x, ebb_tensor_t **out) {
  ebb_tensor_t *s;
  ebb_status st = ebb_op_sum_to_shape(g, x->ndim, x->shape, &s);
  if (st) {
    char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: the gradient cannot be reduced to the input's shape: %s", fn, why);
  }
  if (s->dtype == x->dtype) {
    *out = s;
    return EBB_OK;
  }
  st = ebb_tensor_to_dtype(s, x->dtype, out);
  ebb__tensor_put(s);
  return ebb__fail_in(fn, st);
}


/* grad_x = f(grad, x) for ops whose local derivative is one elementwise kernel of x (mode
 * `op`, scalars s0, s1) multiplied by grad; op < 0: grad * s0 without reading x; a binary op
 * that does the multiply itself (EBB__EW_GELU_BWD: grad * gelu'(x)): that one kernel of (grad, x),
 * in one pass without a temporary. */
/* Most unary backward formulas are grad * f'(x) with f' one more elementwise kernel (e.g.
 * cos for sin, 1/x for log, the mask x > 0 for relu), hence this one helper. */
ebb_status ebb__local_backward(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, int op, double s0, double s1,
                                      ebb_tensor_t **gx) {
  ebb_status st = ebb__ew_bw_check(fn, grad, "x", x);
  if (!st && !gx) st = ebb__fail(EBB_EINVAL, "%s: grad_x is NULL; expected a tensor handle to fill", fn);
  if (st) return ebb__fail_in(fn, st);
  if (grad->ndim != x->ndim || memcmp(grad->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0) {
    char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s does not have the shape of %s; expected the input's shape", fn, EBB__DESC(grad, "grad", a),
                     EBB__DESC(x, "x", b));
  }
  ebb_tensor_t *d = NULL, *p = NULL;
  if (op < 0) {
    st = ebb_op_mul_scalar(grad, s0, &p);
  } else if (op == EBB__EW_GELU_BWD) { /* a binary kernel that multiplies by grad itself */
    const ebb_tensor_t *in[2] = {grad, x};
    ebb_dtype dt;
    ebb_op_promote(grad->dtype, x->dtype, &dt);
    st = ebb__ew_new(fn, op, 2, in, dt, s0, s1, &p);
  } else {
    st = ebb__ew_new(fn, op, 1, &x, x->dtype, s0, s1, &d);
    if (!st) st = ebb_op_mul(grad, d, &p);
  }
  ebb__tensor_put(d);
  if (st) return ebb__fail_in(fn, st);
  if (p->dtype != x->dtype) {
    ebb_tensor_t *c;
    st = ebb_tensor_to_dtype(p, x->dtype, &c);
    ebb__tensor_put(p);
    if (st) return ebb__fail_in(fn, st);
    p = c;
  }
  *gx = p;
  return EBB_OK;
}
