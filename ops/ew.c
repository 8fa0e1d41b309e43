/* ew.c: the elementwise plumbing: broadcasting, the geometry of an elementwise launch, and
 * ebb__ew_run, the one call every elementwise kernel goes through.
 *
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

/* ---- elementwise plumbing (shared with ops.c) ------------------------------------------------ */

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
  return ebb__launch(fn, EBB__K_EW, out->stor->device, &a, ops, nin + 1, ebb__numel(out->shape, out->ndim));
}
