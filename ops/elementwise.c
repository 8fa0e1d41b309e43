/* elementwise.c: broadcasting elementwise ops (binary, scalar, unary, comparisons, where, in
 * place) and, beside each, its backward math.
 *
 * Every forward op checks its arguments, settles the result dtype by the promotion rules of
 * ops.h, allocates the result on the inputs' device and runs the "ebb.ops.ew" kernel once
 * (ebb__ew_run). Backward functions are compositions of forward ops; their temporaries are
 * released before they return, and gradients are summed back to each input's shape.
 * Threading: no state of its own; thread-safe as the tensor calls it makes.
 */
#include <math.h>
#include <stdio.h>

#include "ops_impl.h"

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

static ebb_dtype float_of(ebb_dtype dt) { return ebb_dtype_is_float(dt) ? dt : EBB_F32; }

/* ---- forward plumbing -------------------------------------------------------------------------- */

static ebb_status check_out(const char *fn, ebb_tensor_t **out) {
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
static ebb_status ew_new(const char *fn, int op, int nin, const ebb_tensor_t *const *in, ebb_dtype dt, double s0, double s1,
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

enum ebb__bin_kind { EBB__ARITH, EBB__DIVIDE, EBB__COMPARE };

static ebb_status elementwise_binary(const char *fn, int op, int kind, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st) st = check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt;
  ebb_op_promote(a->dtype, b->dtype, &dt);
  if (kind == EBB__ARITH && dt == EBB_BOOL)
    return ebb__fail_about2(EBB_EINVAL, fn, a, "a", b, "b",
                            "are both bool; arithmetic needs a numeric operand (convert with ebb_tensor_to_dtype)");
  if (kind == EBB__DIVIDE) dt = float_of(dt);
  if (kind == EBB__COMPARE) dt = EBB_BOOL;
  const ebb_tensor_t *in[2] = {a, b};
  return ew_new(fn, op, 2, in, dt, 0, 0, out);
}

enum ebb__un_kind { EBB__KEEP, EBB__FLOAT };

static ebb_status elementwise_unary(const char *fn, int op, int kind, const ebb_tensor_t *a, double s0, double s1, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt = kind == EBB__FLOAT ? float_of(a->dtype) : a->dtype;
  return ew_new(fn, op, 1, &a, dt, s0, s1, out);
}

/* ---- backward plumbing ---------------------------------------------------------------------- */

/* Checks grad against the output shape the forward would have produced from `x` (for unary
 * ops: x's shape) and that x is floating. */
static ebb_status bw_check(const char *fn, const ebb_tensor_t *grad, const char *xname, const ebb_tensor_t *x) {
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
static ebb_status grad_for(const char *fn, const ebb_tensor_t *g, const ebb_tensor_t *x, ebb_tensor_t **out) {
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

/* ---- add, sub, mul, div --------------------------------------------------------------------------- */

ebb_status ebb_op_add(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_add", EBB__OP_ADD, NULL, out, elementwise_binary("ebb_op_add", EBB__EW_ADD, EBB__ARITH, a, b, out), a, b);
}

ebb_status ebb_op_sub(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_sub", EBB__OP_SUB, NULL, out, elementwise_binary("ebb_op_sub", EBB__EW_SUB, EBB__ARITH, a, b, out), a, b);
}

ebb_status ebb_op_mul(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_mul", EBB__OP_MUL, NULL, out, elementwise_binary("ebb_op_mul", EBB__EW_MUL, EBB__ARITH, a, b, out), a, b);
}

ebb_status ebb_op_div(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_div", EBB__OP_DIV, NULL, out, elementwise_binary("ebb_op_div", EBB__EW_DIV, EBB__DIVIDE, a, b, out), a, b);
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
  if (!st && ga) st = bw_check(fn, grad, "a", a);
  if (!st && gb) st = bw_check(fn, grad, "b", b);
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
  if (!st && ga) st = grad_for(fn, la, a, &ra);
  if (!st && gb) st = local_b(mode, grad, a, b, &lb);
  if (!st && gb) st = grad_for(fn, lb, b, &rb);
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

/* ---- scalar ops -------------------------------------------------------------------------------------- */

static ebb_dtype scalar_dtype(ebb_dtype dt, double s) {
  if (ebb_dtype_is_float(dt)) return dt;
  return s == floor(s) && fabs(s) < 9.2e18 ? EBB_I64 : EBB_F32;
}

static ebb_status scalar_op(const char *fn, int op, const ebb_tensor_t *a, double s, bool divide, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt = divide ? float_of(a->dtype) : scalar_dtype(a->dtype, s);
  return ew_new(fn, op, 1, &a, dt, s, 0, out);
}

ebb_status ebb_op_add_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {s}};
  EBB__RECORDED("ebb_op_add_scalar", EBB__OP_ADD_SCALAR, &args, out, scalar_op("ebb_op_add_scalar", EBB__EW_ADDS, a, s, false, out), a);
}

ebb_status ebb_op_sub_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {s}};
  EBB__RECORDED("ebb_op_sub_scalar", EBB__OP_SUB_SCALAR, &args, out, scalar_op("ebb_op_sub_scalar", EBB__EW_ADDS, a, -s, false, out), a);
}

ebb_status ebb_op_mul_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {s}};
  EBB__RECORDED("ebb_op_mul_scalar", EBB__OP_MUL_SCALAR, &args, out, scalar_op("ebb_op_mul_scalar", EBB__EW_MULS, a, s, false, out), a);
}

ebb_status ebb_op_div_scalar(const ebb_tensor_t *a, double s, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {s}};
  EBB__RECORDED("ebb_op_div_scalar", EBB__OP_DIV_SCALAR, &args, out, scalar_op("ebb_op_div_scalar", EBB__EW_DIVS, a, s, true, out), a);
}

ebb_status ebb_op_pow_scalar(const ebb_tensor_t *a, double p, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {p}};
  EBB__RECORDED("ebb_op_pow_scalar", EBB__OP_POW_SCALAR, &args, out, elementwise_unary("ebb_op_pow_scalar", EBB__EW_POWS, EBB__FLOAT, a, p, 0, out),
                a);
}

static ebb_status elementwise_clamp(const ebb_tensor_t *a, double lo, double hi, ebb_tensor_t **out) {
  if (lo > hi || lo != lo || hi != hi)
    return ebb__fail(EBB_EINVAL, "ebb_op_clamp: lo %g and hi %g; expected lo <= hi", lo, hi);
  return elementwise_unary("ebb_op_clamp", EBB__EW_CLAMP, EBB__KEEP, a, lo, hi, out);
}

ebb_status ebb_op_clamp(const ebb_tensor_t *a, double lo, double hi, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {lo, hi}};
  EBB__RECORDED("ebb_op_clamp", EBB__OP_CLAMP, &args, out, elementwise_clamp(a, lo, hi, out), a);
}

/* grad_x = f(grad, x) for ops whose local derivative is one elementwise kernel of x (mode
 * `op`, scalars s0, s1) multiplied by grad; op < 0: grad * s0 without reading x. */
/* Most unary backward formulas are grad * f'(x) with f' one more elementwise kernel (e.g.
 * cos for sin, 1/x for log, the mask x > 0 for relu), hence this one helper. */
static ebb_status local_backward(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, int op, double s0, double s1,
                                      ebb_tensor_t **gx) {
  ebb_status st = bw_check(fn, grad, "x", x);
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
  } else {
    st = ew_new(fn, op, 1, &x, x->dtype, s0, s1, &d);
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

ebb_status ebb_op_add_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  (void)s;
  return local_backward("ebb_op_add_scalar_backward", grad, a, -1, 1.0, 0, ga);
}

ebb_status ebb_op_mul_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  return local_backward("ebb_op_mul_scalar_backward", grad, a, -1, s, 0, ga);
}

ebb_status ebb_op_div_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  return local_backward("ebb_op_div_scalar_backward", grad, a, -1, 1.0 / s, 0, ga);
}

ebb_status ebb_op_pow_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double p, ebb_tensor_t **gx) {
  /* d/dx x^p = p x^(p-1): the kernel computes x^(p-1), then the scalar p is applied */
  const char *fn = "ebb_op_pow_scalar_backward";
  ebb_tensor_t *t = NULL;
  ebb_status st = local_backward(fn, grad, x, EBB__EW_POWS, p - 1.0, 0, &t);
  if (st) return ebb__fail_in(fn, st);
  st = ew_new(fn, EBB__EW_MULS, 1, (const ebb_tensor_t *const *)&t, t->dtype, p, 0, gx);
  ebb__tensor_put(t);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_clamp_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double lo, double hi, ebb_tensor_t **gx) {
  return local_backward("ebb_op_clamp_backward", grad, x, EBB__EW_CLAMP_MASK, lo, hi, gx);
}

/* ---- unary ----------------------------------------------------------------------------------------- */

static ebb_status op_neg_impl(const ebb_tensor_t *a, ebb_tensor_t **out) {
  if (a && a->dtype == EBB_BOOL && ebb__tensor_check(a, "ebb_op_neg", "a") == EBB_OK)
    return ebb__fail_about(EBB_EINVAL, "ebb_op_neg", a, "a", "has dtype bool; expected a numeric dtype");
  return elementwise_unary("ebb_op_neg", EBB__EW_NEG, EBB__KEEP, a, 0, 0, out);
}

ebb_status ebb_op_neg(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_neg", EBB__OP_NEG, NULL, out, op_neg_impl(a, out), a);
}

static ebb_status op_abs_impl(const ebb_tensor_t *a, ebb_tensor_t **out) {
  if (a && a->dtype == EBB_BOOL && ebb__tensor_check(a, "ebb_op_abs", "a") == EBB_OK)
    return ebb__fail_about(EBB_EINVAL, "ebb_op_abs", a, "a", "has dtype bool; expected a numeric dtype");
  return elementwise_unary("ebb_op_abs", EBB__EW_ABS, EBB__KEEP, a, 0, 0, out);
}

ebb_status ebb_op_abs(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_abs", EBB__OP_ABS, NULL, out, op_abs_impl(a, out), a);
}

#define EBB__UNARY(name, rec, op, kind)                                                                     \
  ebb_status ebb_op_##name(const ebb_tensor_t *a, ebb_tensor_t **out) {                                     \
    EBB__RECORDED("ebb_op_" #name, rec, NULL, out, elementwise_unary("ebb_op_" #name, op, kind, a, 0, 0, out), a); \
  }
EBB__UNARY(exp, EBB__OP_EXP, EBB__EW_EXP, EBB__FLOAT)
EBB__UNARY(log, EBB__OP_LOG, EBB__EW_LOG, EBB__FLOAT)
EBB__UNARY(sqrt, EBB__OP_SQRT, EBB__EW_SQRT, EBB__FLOAT)
EBB__UNARY(sin, EBB__OP_SIN, EBB__EW_SIN, EBB__FLOAT)
EBB__UNARY(cos, EBB__OP_COS, EBB__EW_COS, EBB__FLOAT)
EBB__UNARY(tanh, EBB__OP_TANH, EBB__EW_TANH, EBB__FLOAT)
EBB__UNARY(sigmoid, EBB__OP_SIGMOID, EBB__EW_SIGMOID, EBB__FLOAT)
EBB__UNARY(relu, EBB__OP_RELU, EBB__EW_RELU, EBB__KEEP)
EBB__UNARY(gelu, EBB__OP_GELU, EBB__EW_GELU, EBB__FLOAT)
#undef EBB__UNARY

/* The tensor a unary backward does not read (y, for the formulas of x) may be NULL; one that is
 * given must still be live, since a released handle is EBB_EFREED wherever it is passed. */
static ebb_status unread_check(const char *fn, const char *arg, const ebb_tensor_t *t) {
  return t ? ebb__fail_in(fn, ebb__tensor_check(t, fn, arg)) : EBB_OK;
}

ebb_status ebb_op_neg_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_neg_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_neg_backward", grad, x, -1, -1.0, 0, gx);
}

ebb_status ebb_op_abs_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_abs_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_abs_backward", grad, x, EBB__EW_SIGN, 0, 0, gx);
}

ebb_status ebb_op_log_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_log_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_log_backward", grad, x, EBB__EW_RDIVS, 1.0, 0, gx);
}

ebb_status ebb_op_sin_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_sin_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_sin_backward", grad, x, EBB__EW_COS, 0, 0, gx);
}

ebb_status ebb_op_relu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_relu_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_relu_backward", grad, x, EBB__EW_GT_S, 0, 0, gx);
}

ebb_status ebb_op_gelu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_gelu_backward", "y", y);
  if (st) return st;
  return local_backward("ebb_op_gelu_backward", grad, x, EBB__EW_GELU_GRAD, 0, 0, gx);
}

ebb_status ebb_op_cos_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  /* -sin(x) * grad */
  const char *fn = "ebb_op_cos_backward";
  ebb_tensor_t *t = NULL;
  ebb_status st = unread_check(fn, "y", y);
  if (!st) st = local_backward(fn, grad, x, EBB__EW_SIN, 0, 0, &t);
  if (st) return ebb__fail_in(fn, st);
  st = ew_new(fn, EBB__EW_NEG, 1, (const ebb_tensor_t *const *)&t, t->dtype, 0, 0, gx);
  ebb__tensor_put(t);
  return ebb__fail_in(fn, st);
}

/* Backward functions that read the forward output y: grad * f(y), with f one kernel of y. The
 * shape and dtype checks are those of x (y has x's shape and a floating dtype). */
/* exp, sqrt, tanh and sigmoid have derivatives cheaper in their output: y, 1/(2y), 1 - y^2 and
 * y (1 - y). Reading y instead of x saves recomputing the function (autograd saves y). */
static ebb_status y_backward(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, int mode,
                                  ebb_tensor_t **gx) {
  ebb_status st = ebb__tensor_check(y, fn, "y");
  if (st) return ebb__fail_in(fn, st);
  if (x) {
    st = ebb__tensor_check(x, fn, "x");
    if (st) return ebb__fail_in(fn, st);
    if (x->ndim != y->ndim || memcmp(x->shape, y->shape, sizeof(int64_t) * (size_t)y->ndim) != 0) {
      char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: %s does not have the shape of %s; expected the forward output of x", fn, EBB__DESC(y, "y", a),
                       EBB__DESC(x, "x", b));
    }
  }
  ebb_tensor_t *d = NULL, *e = NULL, *g = NULL;
  switch (mode) {
  case EBB__EW_EXP: /* grad * y */
    return local_backward(fn, grad, y, EBB__EW_COPY, 0, 0, gx);
  case EBB__EW_SQRT: /* grad * 0.5 / y */
    return local_backward(fn, grad, y, EBB__EW_RDIVS, 0.5, 0, gx);
  case EBB__EW_TANH: /* grad * (1 - y^2) */
    st = ew_new(fn, EBB__EW_SQUARE, 1, &y, y->dtype, 0, 0, &d);
    if (!st) st = local_backward(fn, grad, d, EBB__EW_RSUBS, 1.0, 0, gx);
    ebb__tensor_put(d);
    return ebb__fail_in(fn, st);
  default: /* sigmoid: grad * y * (1 - y) */
    st = ew_new(fn, EBB__EW_RSUBS, 1, &y, y->dtype, 1.0, 0, &d);
    if (!st) st = ebb_op_mul(d, y, &e);
    if (!st) st = local_backward(fn, grad, e, EBB__EW_COPY, 0, 0, &g);
    ebb__tensor_put(d);
    ebb__tensor_put(e);
    if (!st) *gx = g;
    return ebb__fail_in(fn, st);
  }
}

ebb_status ebb_op_exp_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  return y_backward("ebb_op_exp_backward", grad, x, y, EBB__EW_EXP, gx);
}

ebb_status ebb_op_sqrt_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  return y_backward("ebb_op_sqrt_backward", grad, x, y, EBB__EW_SQRT, gx);
}

ebb_status ebb_op_tanh_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  return y_backward("ebb_op_tanh_backward", grad, x, y, EBB__EW_TANH, gx);
}

ebb_status ebb_op_sigmoid_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  return y_backward("ebb_op_sigmoid_backward", grad, x, y, EBB__EW_SIGMOID, gx);
}

/* ---- comparisons and where --------------------------------------------------------------------------- */

#define EBB__CMP(name, op) \
  ebb_status ebb_op_##name(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) { \
    return elementwise_binary("ebb_op_" #name, op, EBB__COMPARE, a, b, out);                           \
  }
EBB__CMP(eq, EBB__EW_EQ)
EBB__CMP(ne, EBB__EW_NE)
EBB__CMP(lt, EBB__EW_LT)
EBB__CMP(le, EBB__EW_LE)
EBB__CMP(gt, EBB__EW_GT)
EBB__CMP(ge, EBB__EW_GE)
#undef EBB__CMP

static ebb_status op_where_impl(const ebb_tensor_t *cond, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  const char *fn = "ebb_op_where";
  ebb_status st = ebb__tensor_check(cond, fn, "cond");
  if (!st) st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st) st = check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  if (cond->dtype != EBB_BOOL)
    return ebb__fail_about(EBB_EINVAL, fn, cond, "cond", "has dtype %s; expected bool (from a comparison)", ebb_dtype_name(cond->dtype));
  ebb_dtype dt;
  ebb_op_promote(a->dtype, b->dtype, &dt);
  const ebb_tensor_t *in[3] = {cond, a, b};
  return ew_new(fn, EBB__EW_WHERE, 3, in, dt, 0, 0, out);
}

ebb_status ebb_op_where(const ebb_tensor_t *cond, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_where", EBB__OP_WHERE, NULL, out, op_where_impl(cond, a, b, out), cond, a, b);
}

ebb_status ebb_op_where_backward(const ebb_tensor_t *grad, const ebb_tensor_t *cond, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                 ebb_tensor_t **ga, ebb_tensor_t **gb) {
  const char *fn = "ebb_op_where_backward";
  ebb_status st = ebb__tensor_check(cond, fn, "cond");
  if (!st) st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st && ga) st = bw_check(fn, grad, "a", a);
  if (!st && gb) st = bw_check(fn, grad, "b", b);
  if (!st && !ga && !gb) st = ebb__fail(EBB_EINVAL, "%s: grad_a and grad_b are both NULL; expected at least one to fill", fn);
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *zero = NULL, *ta = NULL, *tb = NULL, *ra = NULL, *rb = NULL;
  st = ebb_tensor_zeros(grad->stor->device, grad->dtype, 0, NULL, &zero);
  if (!st && ga) st = ebb_op_where(cond, grad, zero, &ta);
  if (!st && ga) st = grad_for(fn, ta, a, &ra);
  if (!st && gb) st = ebb_op_where(cond, zero, grad, &tb);
  if (!st && gb) st = grad_for(fn, tb, b, &rb);
  ebb__tensor_put(zero);
  ebb__tensor_put(ta);
  ebb__tensor_put(tb);
  return ebb__fail_in(fn, ebb__grads_out(st, ra, ga, rb, gb));
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
