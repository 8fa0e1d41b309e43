/* copy.c: copies: contiguous, clone, casts (to_dtype), moves between devices (to_device,
 * to_host, to_host_async), and the writes into an existing tensor (copy_, fill_, zero_).
 *
 * Copies between devices move bytes with ebb_copy_async on the stream that orders them (the
 * destination's current stream onto a device; the source's, then a host wait, onto the CPU);
 * copies on one device, casts and fills are one elementwise kernel.
 * Threading: no state of its own.
 */
#include <stdio.h>
#include <string.h>

#include "ops_impl.h"
#include "ops_export.h"
#include "streams_export.h"

/* ---- copies ---------------------------------------------------------------------------------- */

/* A contiguous copy of t on its own device, converted to dt. */
ebb_status ebb__copy_as(const char *fn, const ebb_tensor_t *t, ebb_dtype dt, ebb_tensor_t **out) {
  ebb_tensor_t *c;
  ebb_status st = ebb__tensor_new(fn, t->stor->device, dt, t->ndim, t->shape, &c);
  if (st) return st;
  st = ebb__ew_run(fn, EBB__EW_COPY, c, 1, &t, 0, 0);
  if (st) {
    ebb__tensor_put(c);
    return st;
  }
  *out = c;
  return EBB_OK;
}

ebb_status ebb__tensor_storage_clone(const char *fn, const ebb_tensor_t *t, ebb_tensor_t **out) {
  /* The whole storage as a 1-D tensor of t's dtype (a storage holds whole elements of the dtype
   * its tensors were made with, and views keep it). */
  ebb_tensor_t *whole;
  const int64_t n = (int64_t)(t->stor->bytes / ebb__dtype_size[t->dtype]), one = 1;
  ebb_status st = ebb__tensor_share_as(t, 1, &n, &one, 0, &whole);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__copy_as(fn, whole, t->dtype, out);
  ebb__tensor_put(whole);
  return st;
}

static ebb_status tensor_contiguous_impl(const ebb_tensor_t *t, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_contiguous", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_contiguous: out is NULL");
  if (ebb__is_contiguous(t)) {
    atomic_fetch_add_explicit(&((ebb_tensor_t *)t)->refs, 1, memory_order_relaxed);
    *out = (ebb_tensor_t *)t;
    return EBB_OK;
  }
  return ebb__copy_as("ebb_tensor_contiguous", t, t->dtype, out);
}

ebb_status ebb_tensor_contiguous(const ebb_tensor_t *t, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_contiguous", EBB__OP_CONTIGUOUS, NULL, out, tensor_contiguous_impl(t, out), t);
}

static ebb_status tensor_clone_impl(const ebb_tensor_t *t, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_clone", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_clone: out is NULL");
  return ebb__copy_as("ebb_tensor_clone", t, t->dtype, out);
}

ebb_status ebb_tensor_clone(const ebb_tensor_t *t, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_clone", EBB__OP_CLONE, NULL, out, tensor_clone_impl(t, out), t);
}

static ebb_status tensor_to_dtype_impl(const ebb_tensor_t *t, ebb_dtype dt, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_to_dtype", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_to_dtype: out is NULL");
  if ((unsigned)dt >= EBB_DTYPE_COUNT) return ebb__fail(EBB_EINVAL, "ebb_tensor_to_dtype: dtype %d is not an ebb_dtype", (int)dt);
  return ebb__copy_as("ebb_tensor_to_dtype", t, dt, out);
}

ebb_status ebb_tensor_to_dtype(const ebb_tensor_t *t, ebb_dtype dt, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_to_dtype", EBB__OP_TO_DTYPE, NULL, out, tensor_to_dtype_impl(t, dt, out), t);
}

/* A contiguous copy of t (any device) on `device`. */
/* Copies move bytes, so a strided source is first made contiguous on its own device (one
 * kernel there), then one ebb_copy_async moves it. Which stream carries the copy decides the
 * ordering: the destination's current stream for anything arriving on a device; the source's
 * for device to CPU, followed by a host wait, since a CPU tensor must be ready on return. */
static ebb_status to_device(const char *fn, const ebb_tensor_t *t, int device, ebb_tensor_t **out) {
  int from = t->stor->device;
  if (from == device) return ebb__copy_as(fn, t, t->dtype, out);
  ebb_tensor_t *c = NULL, *r = NULL;
  ebb_status st = EBB_OK;
  if (ebb__is_contiguous(t)) {
    atomic_fetch_add_explicit(&((ebb_tensor_t *)t)->refs, 1, memory_order_relaxed);
    c = (ebb_tensor_t *)t;
  } else {
    st = ebb__copy_as(fn, t, t->dtype, &c);
    if (st) return st;
  }
  st = ebb__tensor_new(fn, device, t->dtype, t->ndim, t->shape, &r);
  if (st) goto fail_src;
  size_t bytes = r->stor->bytes;
  if (bytes) {
    ebb_stream_t *s;
    if (device != EBB_DEVICE_CPU) {
      /* onto a device: ordered on the destination's current stream; a device source is read
       * there too (the copy waits for the source device's current stream, which then waits for
       * the copy), so the source's stream is declared to its arena */
      st = ebb_stream_current(device, &s);
      if (st) goto fail_dst;
      if (from != EBB_DEVICE_CPU) {
        ebb_stream_t *fs;
        uint64_t fid;
        st = ebb_stream_current(from, &fs);
        if (!st) st = ebb__stream_id_of(fn, fs, &fid);
        if (!st) st = ebb__storage_use(c->stor, fs, fid);
        if (st) goto fail_dst;
      }
      st = ebb_copy_async(r->stor->data, ebb__tensor_ptr(c), bytes, s);
      if (st) goto fail_dst;
    } else {
      /* onto the CPU: a CPU tensor is always ready, so wait for the copy */
      uint64_t sid;
      st = ebb_stream_current(from, &s);
      if (!st) st = ebb__stream_id_of(fn, s, &sid);
      if (!st) st = ebb__storage_use(c->stor, s, sid);
      if (!st) st = ebb_copy_async(r->stor->data, ebb__tensor_ptr(c), bytes, s);
      if (!st) st = ebb_stream_synchronize(s);
      if (st) goto fail_dst;
    }
  }
  ebb__tensor_put(c);
  *out = r;
  return EBB_OK;
fail_dst:
  ebb__tensor_put(r);
fail_src:
  ebb__tensor_put(c);
  return ebb__fail_in(fn, st);
}

static ebb_status tensor_to_device_impl(const ebb_tensor_t *t, int device, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_to_device", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_to_device: out is NULL");
  return to_device("ebb_tensor_to_device", t, device, out);
}

ebb_status ebb_tensor_to_device(const ebb_tensor_t *t, int device, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_to_device", EBB__OP_TO_DEVICE, NULL, out, tensor_to_device_impl(t, device, out), t);
}

/* EBB_EINVAL unless dst (non-NULL where bytes > 0) holds exactly t's elements, packed. */
static ebb_status check_host_dst(const char *fn, const ebb_tensor_t *t, const void *dst, size_t bytes) {
  size_t want = (size_t)ebb__numel(t->shape, t->ndim) * ebb__dtype_size[t->dtype];
  if (bytes == want && (dst || !bytes)) return EBB_OK;
  char b[EBB__DESC_MAX];
  return ebb__fail(EBB_EINVAL, "%s: dst is %s with %zu bytes for %s; expected %zu bytes", fn, dst ? "given" : "NULL", bytes,
                   EBB__DESC(t, "t", b), want);
}

ebb_status ebb_tensor_to_host(const ebb_tensor_t *t, void *dst, size_t bytes) {
  const char *fn = "ebb_tensor_to_host";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  st = check_host_dst(fn, t, dst, bytes);
  if (st) return st;
  if (!bytes) return EBB_OK;
  ebb_tensor_t *c;
  st = to_device(fn, t, EBB_DEVICE_CPU, &c);
  if (st) return st;
  memcpy(dst, c->stor->data, bytes);
  ebb__tensor_put(c);
  return EBB_OK;
}

/* Everything that can be refused is checked before anything is enqueued (tensor.h: on failure
 * nothing is enqueued and `done` is not recorded): the event (live, of t's device), dst, the
 * stream, and the arena's record of the stream's use of t's storage. A non-contiguous t is first
 * made contiguous by a kernel, and only then is the copy enqueued, followed by the record of
 * `done`, which cannot be refused any more (its event and stream were checked just before). */
ebb_status ebb_tensor_to_host_async(const ebb_tensor_t *t, void *dst, size_t bytes, ebb_event_t *done) {
  const char *fn = "ebb_tensor_to_host_async";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  st = check_host_dst(fn, t, dst, bytes);
  if (st) return st;
  if (!done) return ebb__fail(EBB_EINVAL, "%s: done is NULL; expected an event to record after the copy", fn);
  int edev;
  st = ebb_event_device(done, &edev); /* a released event: EBB_EFREED, for a CPU tensor too */
  if (st) return ebb__fail_in(fn, st);
  if (t->stor->device == EBB_DEVICE_CPU) {
    st = ebb_tensor_to_host(t, dst, bytes);
    return st ? ebb__fail_in(fn, st) : EBB_OK;
  }
  char td[EBB__DESC_MAX];
  if (!bytes) return ebb__fail(EBB_EINVAL, "%s: %s is empty; nothing to copy (use ebb_tensor_to_host)", fn, EBB__DESC(t, "t", td));
  ebb_stream_t *s;
  uint64_t sid;
  st = ebb_stream_current(t->stor->device, &s);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__stream_id_of(fn, s, &sid);
  if (st) return st;
  /* From a host function libcuda refuses every call (CUDA_ERROR_NOT_PERMITTED): the pools'
   * refusal of a dst in their memory must come before the pointer query below asks the driver. */
  if (EBB_UNLIKELY(ebb__in_host_fn())) {
    st = ebb__copy_side_check(dst, bytes, true, s);
    if (st) return ebb__fail_in(fn, st);
  }
  ebb_ptr_info pi;
  st = ebb__drv_ptr_info(t->stor->device, dst, &pi);
  if (st) return ebb__fail_in(fn, st);
  if (pi.type != EBB_MEMTYPE_PINNED)
    return ebb__fail(EBB_EINVAL, "%s: dst %p is %s memory; expected pinned host memory (ebb_pinned_alloc)", fn, dst,
                     pi.type == EBB_MEMTYPE_DEVICE ? "device" : "pageable host");
  if (edev != t->stor->device)
    return ebb__fail(EBB_EDEVICE, "%s: event done belongs to device %d but %s does not; expected an event of its device", fn, edev,
                     EBB__DESC(t, "t", td));
  /* dst is checked against its pinned block (the copy's own check) before the contiguous copy
   * below is enqueued: a refusal leaves nothing behind. */
  st = ebb__copy_side_check(dst, bytes, true, s);
  if (st) return ebb__fail_in(fn, st);
  /* The copy reads t's storage on s: declared before anything is enqueued. A contiguous copy
   * made below lives on s already. */
  if (ebb__is_contiguous(t)) {
    st = ebb__storage_use(t->stor, s, sid);
    if (st) return ebb__fail_in(fn, st);
  }
  ebb_tensor_t *c;
  st = ebb_tensor_contiguous(t, &c);
  if (st) return ebb__fail_in(fn, st);
  st = ebb_copy_async(dst, ebb__tensor_ptr(c), bytes, s);
  if (!st) st = ebb_event_record(done, s);
  ebb__tensor_put(c);
  return st ? ebb__fail_in(fn, st) : EBB_OK;
}

/* ---- in place --------------------------------------------------------------------------------- */

static ebb_status check_writable(const char *fn, const ebb_tensor_t *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->strides[d] == 0 && t->shape[d] > 1) {
      char a[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: %s is expanded along dim %d (stride 0): its elements alias; expected a writable tensor",
                       fn, EBB__DESC(t, "dst", a), d);
    }
  return EBB_OK;
}

static ebb_status tensor_fill(const char *fn, int op, ebb_tensor_t *t, double value) {
  void *token = NULL;
  ebb_status st = ebb__tensor_check(t, fn, "dst");
  if (!st) st = check_writable(fn, t);
  if (!st) st = ebb__inplace_check(fn, op, t, NULL, 0, NULL, &token);
  if (st) return st;
  st = ebb__ew_run(fn, EBB__EW_FILL, t, 0, NULL, value, 0);
  if (!st) atomic_fetch_add_explicit(&t->stor->version, 1, memory_order_relaxed);
  ebb__inplace_end(token, !st);
  return st;
}

ebb_status ebb_tensor_fill_(ebb_tensor_t *t, double value) { return tensor_fill("ebb_tensor_fill_", EBB__OP_FILL_, t, value); }
ebb_status ebb_tensor_zero_(ebb_tensor_t *t) { return tensor_fill("ebb_tensor_zero_", EBB__OP_ZERO_, t, 0.0); }

/* src may live on another device: it is first brought to dst's device (contiguous, through
 * ebb_copy_async), then the copy kernel broadcasts and converts it into dst's layout. */
ebb_status ebb_tensor_copy_(ebb_tensor_t *dst, const ebb_tensor_t *src) {
  const char *fn = "ebb_tensor_copy_";
  ebb_status st = ebb__tensor_check(dst, fn, "dst");
  if (!st) st = ebb__tensor_check(src, fn, "src");
  if (!st) st = check_writable(fn, dst);
  if (st) return st;
  int64_t bst[EBB_TENSOR_MAX_DIMS];
  st = ebb__broadcast_strides(fn, "src", src, dst->ndim, dst->shape, bst);
  void *token = NULL;
  if (!st) st = ebb__inplace_check(fn, EBB__OP_COPY_, dst, &src, 1, NULL, &token);
  if (st) return st;
  ebb_tensor_t *moved = NULL;
  /* src on dst's storage in another geometry (copy_(x, x.t())) would be read after the kernel
   * wrote some of it: it is read through a copy made first, as the in-place ops do. The
   * identical view reads each element before writing it. */
  bool same = src->offset == dst->offset && src->ndim == dst->ndim && src->dtype == dst->dtype &&
              memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) == 0 &&
              memcmp(src->strides, dst->strides, sizeof(int64_t) * (size_t)dst->ndim) == 0;
  if (src->stor->device != dst->stor->device) st = to_device(fn, src, dst->stor->device, &moved);
  else if (src->stor == dst->stor && !same) st = ebb__copy_as(fn, src, src->dtype, &moved);
  if (!st) st = ebb__ew_run(fn, EBB__EW_COPY, dst, 1, moved ? (const ebb_tensor_t *const *)&moved : &src, 0, 0);
  ebb__tensor_put(moved);
  if (!st) atomic_fetch_add_explicit(&dst->stor->version, 1, memory_order_relaxed);
  ebb__inplace_end(token, !st);
  return st;
}
