/* check.c: checking tensor arguments and describing tensors in failure messages.
 *
 * Owns: the handle check every public call makes (NULL, released), dim normalisation, and the
 * one format of a tensor in a message ("grad 'g' (f32[3, 2] on the CPU)"), with the helpers that
 * write a failure about one or two tensors or prefix another call's failure with the user's.
 * The nn families' shared checks: a floating input, a named out-argument.
 * Threading: no state; messages go to the calling thread's last error.
 */
#include <stdarg.h>
#include <stdio.h>

#include "ops_impl.h"
#include "ops_export.h"

/* Reading the magic of a released record is defined (records are never freed); a pointer that
 * never was a tensor is the caller's undefined behaviour, as for any C handle. */
static EBB_COLD ebb_status bad_tensor(const ebb_tensor_t *t, const char *fn, const char *arg, int index) {
  char idx[16] = "";
  if (index >= 0) snprintf(idx, sizeof idx, "[%d]", index);
  if (!t) return ebb__fail(EBB_EINVAL, "%s: %s%s is NULL; expected a tensor", fn, arg, idx);
  return ebb__fail(EBB_EFREED, "%s: %s%s (%p) is a released tensor", fn, arg, idx, (const void *)t);
}

ebb_status ebb__tensor_check(const ebb_tensor_t *t, const char *fn, const char *arg) {
  if (EBB_LIKELY(t && atomic_load_explicit(&((ebb_tensor_t *)t)->magic, memory_order_relaxed) == EBB__TENSOR_MAGIC)) return EBB_OK;
  return bad_tensor(t, fn, arg, -1);
}

ebb_status ebb__tensor_check_at(const ebb_tensor_t *t, const char *fn, const char *arg, int index) {
  if (EBB_LIKELY(t && atomic_load_explicit(&((ebb_tensor_t *)t)->magic, memory_order_relaxed) == EBB__TENSOR_MAGIC)) return EBB_OK;
  return bad_tensor(t, fn, arg, index);
}

/* The one format of a tensor in a message (ebb__tensor_desc); a NULL role reads "tensor", a
 * NULL shape "(NULL)". */
static const char *desc_fmt(const char *role, int index, const char *name, ebb_dtype dt, int ndim, const int64_t *shape, int device,
                            char *buf, size_t cap) {
  if (!cap) return buf;
  size_t n = 0;
#define EBB__PUT(...) (n += n < cap ? (size_t)snprintf(buf + n, cap - n, __VA_ARGS__) : 0)
  EBB__PUT("%s", role ? role : "tensor");
  if (index >= 0) EBB__PUT("[%d]", index);
  if (name && name[0]) EBB__PUT(" '%s'", name);
  if (!shape) {
    EBB__PUT(" (NULL)");
    return buf;
  }
  EBB__PUT(" (%s[", ebb_dtype_name(dt));
  for (int d = 0; d < ndim; d++) EBB__PUT(d ? ", %lld" : "%lld", (long long)shape[d]);
  if (device == EBB_DEVICE_CPU) EBB__PUT("] on the CPU)");
  else EBB__PUT("] on device %d)", device);
#undef EBB__PUT
  return buf;
}

const char *ebb__tensor_desc(const ebb_tensor_t *t, const char *role, int index, char *buf, size_t cap) {
  if (t && atomic_load_explicit(&((ebb_tensor_t *)t)->magic, memory_order_relaxed) != EBB__TENSOR_MAGIC) {
    /* a released record: its name and geometry may belong to whoever reuses it next */
    char idx[16] = "";
    if (index >= 0) snprintf(idx, sizeof idx, "[%d]", index);
    snprintf(buf, cap, "%s%s (%p, released)", role ? role : "tensor", idx, (const void *)t);
    return buf;
  }
  if (!t) return desc_fmt(role, index, NULL, EBB_F32, 0, NULL, 0, buf, cap);
  return desc_fmt(role, index, t->name, t->dtype, t->ndim, t->shape, t->stor->device, buf, cap);
}

ebb_status ebb__fail_about(ebb_status st, const char *fn, const ebb_tensor_t *t, const char *role, const char *fmt, ...) {
  char d[EBB__DESC_MAX], rest[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rest, sizeof rest, fmt, ap);
  va_end(ap);
  return ebb__fail(st, "%s: %s %s", fn, EBB__DESC(t, role, d), rest);
}

ebb_status ebb__fail_about2(ebb_status st, const char *fn, const ebb_tensor_t *a, const char *an, const ebb_tensor_t *b, const char *bn,
                            const char *fmt, ...) {
  char da[EBB__DESC_MAX], db[EBB__DESC_MAX], rest[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rest, sizeof rest, fmt, ap);
  va_end(ap);
  return ebb__fail(st, "%s: %s and %s %s", fn, EBB__DESC(a, an, da), EBB__DESC(b, bn, db), rest);
}

const char *ebb__meta_desc(const ebb__tensor_meta *m, const char *role, int index, const char *name, char *buf, size_t cap) {
  return desc_fmt(role, index, name, m->dtype, m->ndim, m->shape, m->device, buf, cap);
}

ebb_status ebb__fail_in(const char *fn, ebb_status st) {
  if (!st) return EBB_OK; /* (a success leaves the last error alone) */
  const char *e = ebb_last_error();
  size_t n = strlen(fn);
  if (strncmp(e, fn, n) == 0 && e[n] == ':') return st;
  char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
  snprintf(why, sizeof why, "%s", e);
  return ebb__fail(st, "%s: %s", fn, why[0] ? why : ebb_status_str(st));
}

const char *ebb__shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
  size_t n = 0;
  n += (size_t)snprintf(buf + n, cap - n, "[");
  for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
  return buf;
}

ebb_status ebb__dim(const char *fn, const char *arg, int dim, int ndim, int *out) {
  int lo = ndim ? -ndim : -1, hi = ndim ? ndim - 1 : 0;
  if (dim < lo || dim > hi)
    return ebb__fail(EBB_EINVAL, "%s: %s %d is out of range for a tensor of %d dims; expected [%d, %d]", fn, arg, dim, ndim, lo, hi);
  *out = dim < 0 ? dim + (ndim ? ndim : 1) : dim;
  return EBB_OK;
}

ebb_status ebb__float_input(const char *fn, const char *arg, const ebb_tensor_t *t) {
  ebb_status st = ebb__tensor_check(t, fn, arg);
  if (st) return ebb__fail_in(fn, st);
  if (!ebb_dtype_is_float(t->dtype))
    return ebb__fail_about(EBB_EINVAL, fn, t, arg, "has dtype %s; expected a floating dtype", ebb_dtype_name(t->dtype));
  return EBB_OK;
}

ebb_status ebb__need_out(const char *fn, const char *arg, ebb_tensor_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected a tensor handle to fill", fn, arg);
  return EBB_OK;
}
