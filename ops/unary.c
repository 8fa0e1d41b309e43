/* unary.c: the unary ops neg, abs, exp, log, sqrt, sin, cos, tanh, sigmoid, relu and gelu, and
 * their backward math.
 *
 * A forward runs one elementwise kernel (ebb__ew_unary), in the input's dtype or, for the
 * transcendental ones, in a floating dtype. A backward reads x (grad times one more kernel of x)
 * or, where the derivative is cheaper in the output, y (exp, sqrt, tanh, sigmoid).
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

static ebb_status op_neg_impl(const ebb_tensor_t *a, ebb_tensor_t **out) {
  if (a && a->dtype == EBB_BOOL && ebb__tensor_check(a, "ebb_op_neg", "a") == EBB_OK)
    return ebb__fail_about(EBB_EINVAL, "ebb_op_neg", a, "a", "has dtype bool; expected a numeric dtype");
  return ebb__ew_unary("ebb_op_neg", EBB__EW_NEG, EBB__KEEP, a, 0, 0, out);
}

ebb_status ebb_op_neg(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_neg", EBB__OP_NEG, NULL, out, op_neg_impl(a, out), a);
}

static ebb_status op_abs_impl(const ebb_tensor_t *a, ebb_tensor_t **out) {
  if (a && a->dtype == EBB_BOOL && ebb__tensor_check(a, "ebb_op_abs", "a") == EBB_OK)
    return ebb__fail_about(EBB_EINVAL, "ebb_op_abs", a, "a", "has dtype bool; expected a numeric dtype");
  return ebb__ew_unary("ebb_op_abs", EBB__EW_ABS, EBB__KEEP, a, 0, 0, out);
}

ebb_status ebb_op_abs(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_abs", EBB__OP_ABS, NULL, out, op_abs_impl(a, out), a);
}

ebb_status ebb_op_exp(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_exp", EBB__OP_EXP, NULL, out, ebb__ew_unary("ebb_op_exp", EBB__EW_EXP, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_log(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_log", EBB__OP_LOG, NULL, out, ebb__ew_unary("ebb_op_log", EBB__EW_LOG, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_sqrt(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_sqrt", EBB__OP_SQRT, NULL, out, ebb__ew_unary("ebb_op_sqrt", EBB__EW_SQRT, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_sin(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_sin", EBB__OP_SIN, NULL, out, ebb__ew_unary("ebb_op_sin", EBB__EW_SIN, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_cos(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_cos", EBB__OP_COS, NULL, out, ebb__ew_unary("ebb_op_cos", EBB__EW_COS, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_tanh(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_tanh", EBB__OP_TANH, NULL, out, ebb__ew_unary("ebb_op_tanh", EBB__EW_TANH, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_sigmoid(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_sigmoid", EBB__OP_SIGMOID, NULL, out, ebb__ew_unary("ebb_op_sigmoid", EBB__EW_SIGMOID, EBB__FLOAT, a, 0, 0, out), a);
}

ebb_status ebb_op_relu(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_relu", EBB__OP_RELU, NULL, out, ebb__ew_unary("ebb_op_relu", EBB__EW_RELU, EBB__KEEP, a, 0, 0, out), a);
}

ebb_status ebb_op_gelu(const ebb_tensor_t *a, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_op_gelu", EBB__OP_GELU, NULL, out, ebb__ew_unary("ebb_op_gelu", EBB__EW_GELU, EBB__FLOAT, a, 0, 0, out), a);
}

/* The tensor a unary backward does not read (y, for the formulas of x) may be NULL; one that is
 * given must still be live, since a released handle is EBB_EFREED wherever it is passed. */
static ebb_status unread_check(const char *fn, const char *arg, const ebb_tensor_t *t) {
  return t ? ebb__fail_in(fn, ebb__tensor_check(t, fn, arg)) : EBB_OK;
}

ebb_status ebb_op_neg_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_neg_backward", "y", y);
  if (st) return st;
  return ebb__local_backward("ebb_op_neg_backward", grad, x, -1, -1.0, 0, gx);
}

ebb_status ebb_op_abs_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_abs_backward", "y", y);
  if (st) return st;
  return ebb__local_backward("ebb_op_abs_backward", grad, x, EBB__EW_SIGN, 0, 0, gx);
}

ebb_status ebb_op_log_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_log_backward", "y", y);
  if (st) return st;
  return ebb__local_backward("ebb_op_log_backward", grad, x, EBB__EW_RDIVS, 1.0, 0, gx);
}

ebb_status ebb_op_sin_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_sin_backward", "y", y);
  if (st) return st;
  return ebb__local_backward("ebb_op_sin_backward", grad, x, EBB__EW_COS, 0, 0, gx);
}

ebb_status ebb_op_relu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_relu_backward", "y", y);
  if (st) return st;
  return ebb__local_backward("ebb_op_relu_backward", grad, x, EBB__EW_GT_S, 0, 0, gx);
}

ebb_status ebb_op_gelu_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  ebb_status st = unread_check("ebb_op_gelu_backward", "y", y);
  if (st) return st;
  /* one kernel, grad * gelu'(x), rather than gelu'(x) into a temporary and a multiply */
  return ebb__local_backward("ebb_op_gelu_backward", grad, x, EBB__EW_GELU_BWD, 0, 0, gx);
}

ebb_status ebb_op_cos_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, const ebb_tensor_t *y, ebb_tensor_t **gx) {
  /* -sin(x) * grad */
  const char *fn = "ebb_op_cos_backward";
  ebb_tensor_t *t = NULL;
  ebb_status st = unread_check(fn, "y", y);
  if (!st) st = ebb__local_backward(fn, grad, x, EBB__EW_SIN, 0, 0, &t);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__ew_new(fn, EBB__EW_NEG, 1, (const ebb_tensor_t *const *)&t, t->dtype, 0, 0, gx);
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
    return ebb__local_backward(fn, grad, y, EBB__EW_COPY, 0, 0, gx);
  case EBB__EW_SQRT: /* grad * 0.5 / y */
    return ebb__local_backward(fn, grad, y, EBB__EW_RDIVS, 0.5, 0, gx);
  case EBB__EW_TANH: /* grad * (1 - y^2) */
    st = ebb__ew_new(fn, EBB__EW_SQUARE, 1, &y, y->dtype, 0, 0, &d);
    if (!st) st = ebb__local_backward(fn, grad, d, EBB__EW_RSUBS, 1.0, 0, gx);
    ebb__tensor_put(d);
    return ebb__fail_in(fn, st);
  default: /* sigmoid: grad * y * (1 - y) */
    st = ebb__ew_new(fn, EBB__EW_RSUBS, 1, &y, y->dtype, 1.0, 0, &d);
    if (!st) st = ebb_op_mul(d, y, &e);
    if (!st) st = ebb__local_backward(fn, grad, e, EBB__EW_COPY, 0, 0, &g);
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
