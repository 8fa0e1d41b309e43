/* scalar.c: the ops of a tensor and a scalar: add, sub, mul, div and pow by a scalar, clamp,
 * and their backward math.
 *
 * A forward runs one elementwise kernel with the scalar as its argument; an integer tensor with
 * a fractional scalar gives f32 (ops.h). Each backward is grad times one more kernel of x, or
 * times a constant (ebb__local_backward).
 * Threading: no state of its own.
 */
#include <math.h>
#include <stdio.h>

#include "ops_impl.h"

static ebb_dtype scalar_dtype(ebb_dtype dt, double s) {
  if (ebb_dtype_is_float(dt)) return dt;
  return s == floor(s) && fabs(s) < 9.2e18 ? EBB_I64 : EBB_F32;
}

static ebb_status scalar_op(const char *fn, int op, const ebb_tensor_t *a, double s, bool divide, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  ebb_dtype dt = divide ? ebb__float_of(a->dtype) : scalar_dtype(a->dtype, s);
  return ebb__ew_new(fn, op, 1, &a, dt, s, 0, out);
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
  EBB__RECORDED("ebb_op_pow_scalar", EBB__OP_POW_SCALAR, &args, out, ebb__ew_unary("ebb_op_pow_scalar", EBB__EW_POWS, EBB__FLOAT, a, p, 0, out),
                a);
}

static ebb_status elementwise_clamp(const ebb_tensor_t *a, double lo, double hi, ebb_tensor_t **out) {
  if (lo > hi || lo != lo || hi != hi)
    return ebb__fail(EBB_EINVAL, "ebb_op_clamp: lo %g and hi %g; expected lo <= hi", lo, hi);
  return ebb__ew_unary("ebb_op_clamp", EBB__EW_CLAMP, EBB__KEEP, a, lo, hi, out);
}

ebb_status ebb_op_clamp(const ebb_tensor_t *a, double lo, double hi, ebb_tensor_t **out) {
  const ebb__op_args args = {.s = {lo, hi}};
  EBB__RECORDED("ebb_op_clamp", EBB__OP_CLAMP, &args, out, elementwise_clamp(a, lo, hi, out), a);
}
ebb_status ebb_op_add_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  (void)s;
  return ebb__local_backward("ebb_op_add_scalar_backward", grad, a, -1, 1.0, 0, ga);
}

ebb_status ebb_op_mul_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  return ebb__local_backward("ebb_op_mul_scalar_backward", grad, a, -1, s, 0, ga);
}

ebb_status ebb_op_div_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *a, double s, ebb_tensor_t **ga) {
  return ebb__local_backward("ebb_op_div_scalar_backward", grad, a, -1, 1.0 / s, 0, ga);
}

ebb_status ebb_op_pow_scalar_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double p, ebb_tensor_t **gx) {
  /* d/dx x^p = p x^(p-1): the kernel computes x^(p-1), then the scalar p is applied */
  const char *fn = "ebb_op_pow_scalar_backward";
  ebb_tensor_t *t = NULL;
  ebb_status st = ebb__local_backward(fn, grad, x, EBB__EW_POWS, p - 1.0, 0, &t);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__ew_new(fn, EBB__EW_MULS, 1, (const ebb_tensor_t *const *)&t, t->dtype, p, 0, gx);
  ebb__tensor_put(t);
  return ebb__fail_in(fn, st);
}

ebb_status ebb_op_clamp_backward(const ebb_tensor_t *grad, const ebb_tensor_t *x, double lo, double hi, ebb_tensor_t **gx) {
  return ebb__local_backward("ebb_op_clamp_backward", grad, x, EBB__EW_CLAMP_MASK, lo, hi, gx);
}
