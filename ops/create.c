/* create.c: the tensor factories: empty (named or not), full, zeros, ones, arange, rand, randn
 * and from_host.
 *
 * Each allocates a contiguous tensor (ebb__tensor_new) on the calling thread's current stream of
 * its device and fills it with one elementwise kernel, or one copy from the host.
 * Threading: no state of its own.
 */
#include <stdio.h>

#include "ops_impl.h"

static ebb_status create_fill(const char *fn, int device, ebb_dtype dt, int ndim, const int64_t *shape, int op, double s0,
                                   double s1, uint64_t seed, uint64_t offset, ebb_tensor_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  ebb_tensor_t *t;
  ebb_status st = ebb__tensor_new(fn, device, dt, ndim, shape, &t);
  if (st) return st;
  if (ebb__numel(t->shape, t->ndim) > 0) {
    ebb__ew_args a;
    memset(&a, 0, sizeof a);
    a.op = op;
    a.s0 = s0;
    a.s1 = s1;
    a.seed = seed;
    a.offset = offset;
    ebb__ew_geometry(&a, t, 0, NULL, NULL);
    ebb__operand o = {t, true};
    st = ebb__launch(fn, EBB__K_EW, device, &a, &o, 1, ebb__numel(t->shape, t->ndim));
    if (st) {
      ebb__tensor_put(t);
      return st;
    }
  }
  *out = t;
  return EBB_OK;
}

ebb_status ebb_tensor_empty(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  return ebb__tensor_new("ebb_tensor_empty", device, dt, ndim, shape, out);
}

ebb_status ebb_tensor_empty_named(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_owner_cat cat, const char *name,
                                  ebb_tensor_t **out) {
  if (!name) return ebb__fail(EBB_EINVAL, "ebb_tensor_empty_named: name is NULL; expected the owner's name");
  if (strlen(name) > EBB_TENSOR_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_empty_named: name '%.32s...' is longer than %d bytes", name, EBB_TENSOR_NAME_MAX);
  ebb_status st = ebb_alloc_owner_push(cat, name);
  if (st) return ebb__fail_in("ebb_tensor_empty_named", st);
  ebb_tensor_t *t = NULL;
  st = ebb__tensor_new("ebb_tensor_empty_named", device, dt, ndim, shape, &t);
  ebb_alloc_owner_pop();
  if (st) return st;
  snprintf(t->name, sizeof t->name, "%s", name);
  *out = t;
  return EBB_OK;
}

ebb_status ebb_tensor_full(int device, ebb_dtype dt, int ndim, const int64_t *shape, double value, ebb_tensor_t **out) {
  return create_fill("ebb_tensor_full", device, dt, ndim, shape, EBB__EW_FILL, value, 0, 0, 0, out);
}

ebb_status ebb_tensor_zeros(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  return create_fill("ebb_tensor_zeros", device, dt, ndim, shape, EBB__EW_FILL, 0.0, 0, 0, 0, out);
}

ebb_status ebb_tensor_ones(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  return create_fill("ebb_tensor_ones", device, dt, ndim, shape, EBB__EW_FILL, 1.0, 0, 0, 0, out);
}

ebb_status ebb_tensor_arange(int device, ebb_dtype dt, double start, double step, int64_t n, ebb_tensor_t **out) {
  if (n < 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_arange: n is %lld; expected n >= 0", (long long)n);
  if (dt == EBB_BOOL) return ebb__fail(EBB_EINVAL, "ebb_tensor_arange: dtype bool; expected a numeric dtype");
  return create_fill("ebb_tensor_arange", device, dt, 1, &n, EBB__EW_ARANGE, start, step, 0, 0, out);
}

ebb_status ebb_tensor_rand(int device, ebb_dtype dt, int ndim, const int64_t *shape, uint64_t seed, uint64_t offset,
                           ebb_tensor_t **out) {
  if ((unsigned)dt < EBB_DTYPE_COUNT && !ebb_dtype_is_float(dt))
    return ebb__fail(EBB_EINVAL, "ebb_tensor_rand: dtype %s; expected f32, f64, bf16 or f16", ebb_dtype_name(dt));
  return create_fill("ebb_tensor_rand", device, dt, ndim, shape, EBB__EW_RAND, 0, 0, seed, offset, out);
}

ebb_status ebb_tensor_randn(int device, ebb_dtype dt, int ndim, const int64_t *shape, uint64_t seed, uint64_t offset,
                            ebb_tensor_t **out) {
  if ((unsigned)dt < EBB_DTYPE_COUNT && !ebb_dtype_is_float(dt))
    return ebb__fail(EBB_EINVAL, "ebb_tensor_randn: dtype %s; expected f32, f64, bf16 or f16", ebb_dtype_name(dt));
  return create_fill("ebb_tensor_randn", device, dt, ndim, shape, EBB__EW_RANDN, 0, 0, seed, offset, out);
}

ebb_status ebb_tensor_from_host(int device, ebb_dtype dt, int ndim, const int64_t *shape, const void *src, size_t bytes,
                                ebb_tensor_t **out) {
  const char *fn = "ebb_tensor_from_host";
  ebb_tensor_t *t;
  ebb_status st = ebb__tensor_new(fn, device, dt, ndim, shape, &t);
  if (st) return st;
  if (bytes != t->stor->bytes || (!src && bytes)) {
    char b[128];
    size_t want = t->stor->bytes;
    ebb__tensor_put(t);
    return ebb__fail(EBB_EINVAL, "%s: src is %s with %zu bytes for shape %s of %s; expected %zu bytes", fn, src ? "given" : "NULL",
                     bytes, ebb__shape_str(shape, ndim, b, sizeof b), ebb_dtype_name(dt), want);
  }
  if (bytes) {
    if (device == EBB_DEVICE_CPU) {
      memcpy(t->stor->data, src, bytes);
    } else {
      st = ebb_copy_async(t->stor->data, src, bytes, t->stor->stream);
      if (st) {
        ebb__tensor_put(t);
        return ebb__fail_in(fn, st);
      }
    }
  }
  *out = t;
  return EBB_OK;
}
