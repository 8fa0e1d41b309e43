/* compare.c: the comparisons eq, ne, lt, le, gt, ge (bool results, no gradient) and where,
 * which selects by a bool condition, with where's backward math.
 *
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

/* Comparisons are not recorded: a bool result has no gradient. */
ebb_status ebb_op_eq(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_eq", EBB__EW_EQ, EBB__COMPARE, a, b, out);
}

ebb_status ebb_op_ne(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_ne", EBB__EW_NE, EBB__COMPARE, a, b, out);
}

ebb_status ebb_op_lt(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_lt", EBB__EW_LT, EBB__COMPARE, a, b, out);
}

ebb_status ebb_op_le(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_le", EBB__EW_LE, EBB__COMPARE, a, b, out);
}

ebb_status ebb_op_gt(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_gt", EBB__EW_GT, EBB__COMPARE, a, b, out);
}

ebb_status ebb_op_ge(const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  return ebb__ew_binary("ebb_op_ge", EBB__EW_GE, EBB__COMPARE, a, b, out);
}

static ebb_status op_where_impl(const ebb_tensor_t *cond, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out) {
  const char *fn = "ebb_op_where";
  ebb_status st = ebb__tensor_check(cond, fn, "cond");
  if (!st) st = ebb__tensor_check(a, fn, "a");
  if (!st) st = ebb__tensor_check(b, fn, "b");
  if (!st) st = ebb__check_out(fn, out);
  if (st) return ebb__fail_in(fn, st);
  if (cond->dtype != EBB_BOOL)
    return ebb__fail_about(EBB_EINVAL, fn, cond, "cond", "has dtype %s; expected bool (from a comparison)", ebb_dtype_name(cond->dtype));
  ebb_dtype dt;
  ebb_op_promote(a->dtype, b->dtype, &dt);
  const ebb_tensor_t *in[3] = {cond, a, b};
  return ebb__ew_new(fn, EBB__EW_WHERE, 3, in, dt, 0, 0, out);
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
  if (!st && ga) st = ebb__ew_bw_check(fn, grad, "a", a);
  if (!st && gb) st = ebb__ew_bw_check(fn, grad, "b", b);
  if (!st && !ga && !gb) st = ebb__fail(EBB_EINVAL, "%s: grad_a and grad_b are both NULL; expected at least one to fill", fn);
  if (st) return ebb__fail_in(fn, st);
  ebb_tensor_t *zero = NULL, *ta = NULL, *tb = NULL, *ra = NULL, *rb = NULL;
  st = ebb_tensor_zeros(grad->stor->device, grad->dtype, 0, NULL, &zero);
  if (!st && ga) st = ebb_op_where(cond, grad, zero, &ta);
  if (!st && ga) st = ebb__grad_for(fn, ta, a, &ra);
  if (!st && gb) st = ebb_op_where(cond, zero, grad, &tb);
  if (!st && gb) st = ebb__grad_for(fn, tb, b, &rb);
  ebb__tensor_put(zero);
  ebb__tensor_put(ta);
  ebb__tensor_put(tb);
  return ebb__fail_in(fn, ebb__grads_out(st, ra, ga, rb, gb));
}
