/* tensor.c: tensor handles, storage, creation, views, copies between devices, version counters,
 * and the launch path every op goes through.
 *
 * Owns: the pool of tensor records (type-stable: chunks are never freed, released records wait
 * in a FIFO and are reused only after EBB__TENSOR_QUARANTINE more releases, so a stale handle
 * reads a cleared magic and is reported as EBB_EFREED instead of touching freed memory), the
 * refcounted storages (device arena blocks or host-pool blocks), and the cache of ops' kernel
 * handles (declared at first use after each ebb_init, dropped by the module's stop, ops_stop).
 * Threading: handle refcounts are atomic; the pool lock is a leaf lock that guards
 * only the free FIFO and chunk growth. Storage release is stream-ordered by the arena: freeing
 * a block right after enqueuing its last use is safe on its allocation stream, and other
 * streams are declared with ebb_arena_record_stream when an op first uses them.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "ebb_sync.h"
#include "ops_impl.h"
#include "ops_export.h"
#include "optim_kernels.h" /* the optimizer kernel's argument struct, for its registration */
#include "streams_export.h"

#define EBB__TENSOR_CHUNK 256
#define EBB__TENSOR_QUARANTINE 4096

const size_t ebb__dtype_size[EBB_DTYPE_COUNT] = {4, 8, 2, 2, 8, 1};
static const char *const ebb__dtype_names[EBB_DTYPE_COUNT] = {"f32", "f64", "bf16", "f16", "i64", "bool"};

const char *ebb_dtype_name(ebb_dtype dt) { return (unsigned)dt < EBB_DTYPE_COUNT ? ebb__dtype_names[dt] : "unknown"; }
size_t ebb_dtype_size(ebb_dtype dt) { return (unsigned)dt < EBB_DTYPE_COUNT ? ebb__dtype_size[dt] : 0; }
bool ebb_dtype_is_float(ebb_dtype dt) { return dt == EBB_F32 || dt == EBB_F64 || dt == EBB_BF16 || dt == EBB_F16; }

/* ---- the record pool ------------------------------------------------------------------------ */

static ebb_mutex ebb__pool_lock = {PTHREAD_MUTEX_INITIALIZER, "tensor pool", EBB_RANK_LEAF};
static struct ebb_list ebb__pool_free = {&ebb__pool_free, &ebb__pool_free};
static size_t ebb__pool_nfree;
static _Atomic long ebb__live_tensors;

/* Records come from the FIFO only once more than EBB__TENSOR_QUARANTINE are waiting, so a
 * released record is reused at the earliest 4096 releases later: until then a stale handle
 * still points at a record whose magic is 0, and every call reports EBB_EFREED instead of
 * acting on someone else's tensor. The cost is at most that many idle records (~0.6 MiB). */
static ebb_status record_get(const char *fn, ebb_tensor_t **out) {
  ebb__mutex_lock(&ebb__pool_lock);
  if (ebb__pool_nfree <= EBB__TENSOR_QUARANTINE) {
    /* Chunks are never freed: a released record stays readable (magic 0) for stale handles.
     * They stay reachable through the free list, so leak checkers do not report them. */
    ebb_tensor_t *chunk = calloc(EBB__TENSOR_CHUNK, sizeof *chunk);
    if (!chunk) {
      ebb__mutex_unlock(&ebb__pool_lock);
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for tensor handles", fn);
    }
    for (int i = 0; i < EBB__TENSOR_CHUNK; i++) ebb_list_insert_tail(&ebb__pool_free, &chunk[i].free_link);
    ebb__pool_nfree += EBB__TENSOR_CHUNK;
  }
  struct ebb_list *n = ebb_list_pop_head(&ebb__pool_free);
  ebb__pool_nfree--;
  ebb__mutex_unlock(&ebb__pool_lock);
  ebb_tensor_t *t = ebb_container_of(n, ebb_tensor_t, free_link);
  t->stor = NULL;
  t->offset = 0;
  t->ndim = 0;
  t->autograd = NULL;
  t->base = NULL;
  t->name[0] = 0;
  atomic_store_explicit(&t->refs, 1, memory_order_relaxed);
  atomic_store_explicit(&t->magic, EBB__TENSOR_MAGIC, memory_order_relaxed);
  atomic_fetch_add_explicit(&ebb__live_tensors, 1, memory_order_relaxed);
  ebb__debug_live_add(1);
  *out = t;
  return EBB_OK;
}

static void record_put(ebb_tensor_t *t) {
  atomic_store_explicit(&t->magic, 0, memory_order_relaxed);
  ebb__mutex_lock(&ebb__pool_lock);
  ebb_list_insert_tail(&ebb__pool_free, &t->free_link);
  ebb__pool_nfree++;
  ebb__mutex_unlock(&ebb__pool_lock);
  atomic_fetch_sub_explicit(&ebb__live_tensors, 1, memory_order_relaxed);
  ebb__debug_live_add(-1);
}

long ebb_tensor_live_count(void) { return atomic_load_explicit(&ebb__live_tensors, memory_order_relaxed); }

/* ---- checks and formatting ---------------------------------------------------------------- */

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

static const char *dev_str(int device, char *buf, size_t cap) {
  if (device == EBB_DEVICE_CPU) snprintf(buf, cap, "the CPU");
  else snprintf(buf, cap, "device %d", device);
  return buf;
}

ebb_status ebb__dim(const char *fn, const char *arg, int dim, int ndim, int *out) {
  int lo = ndim ? -ndim : -1, hi = ndim ? ndim - 1 : 0;
  if (dim < lo || dim > hi)
    return ebb__fail(EBB_EINVAL, "%s: %s %d is out of range for a tensor of %d dims; expected [%d, %d]", fn, arg, dim, ndim, lo, hi);
  *out = dim < 0 ? dim + (ndim ? ndim : 1) : dim;
  return EBB_OK;
}

int64_t ebb__numel(const int64_t *shape, int ndim) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

/* Row-major with no gaps. Extents of 1 are skipped (their stride is never used to address an
 * element), and an empty tensor is contiguous whatever its strides say. */
bool ebb__is_contiguous(const ebb_tensor_t *t) {
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] == 0) return true;
    if (t->shape[d] != 1 && t->strides[d] != expect) return false;
    expect *= t->shape[d];
  }
  return true;
}

void *ebb__tensor_ptr(const ebb_tensor_t *t) {
  return t->stor->data ? (char *)t->stor->data + t->offset * (int64_t)ebb__dtype_size[t->dtype] : NULL;
}

static void contig_strides(int ndim, const int64_t *shape, int64_t *strides) {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    strides[d] = s;
    s *= shape[d] > 1 ? shape[d] : 1;
  }
}

static ebb_status check_shape(const char *fn, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > EBB_TENSOR_MAX_DIMS)
    return ebb__fail(EBB_EINVAL, "%s: ndim %d is out of range; expected 0..%d", fn, ndim, EBB_TENSOR_MAX_DIMS);
  if (ndim > 0 && !shape) return ebb__fail(EBB_EINVAL, "%s: shape is NULL with ndim %d; expected %d extents", fn, ndim, ndim);
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) {
      char b[128];
      return ebb__fail(EBB_EINVAL, "%s: shape %s has a negative extent at dim %d; expected extents >= 0", fn,
                       ebb__shape_str(shape, ndim, b, sizeof b), d);
    }
    if (shape[d] && n > (INT64_MAX >> 4) / shape[d]) {
      char b[128];
      return ebb__fail(EBB_EINVAL, "%s: shape %s has too many elements", fn, ebb__shape_str(shape, ndim, b, sizeof b));
    }
    n *= shape[d];
  }
  return EBB_OK;
}

/* ---- storage -------------------------------------------------------------------------------- */

static void storage_put(struct ebb__storage *s) {
  /* acq_rel: the release half publishes this owner's writes; the acquire half lets the last
   * owner see every other owner's before it frees (an acquire fence would do, but TSan does not
   * model fences) */
  if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
  if (s->data) {
    /* Frees are stream-ordered: the arena reuses the block on its allocation stream after the
     * work already queued there, and on recorded streams after their events. */
    if (s->device == EBB_DEVICE_CPU) ebb_pageable_free(s->data);
    else ebb_arena_free(s->data);
  }
  free(s);
}

/* The id of the live stream `s`: one lock-free check (streams_export.h); anything else takes the
 * public call for its message, prefixed with `fn`. Ids are never reused, handles are. */
static ebb_status stream_id_of(const char *fn, ebb_stream_t *s, uint64_t *id) {
  int dev;
  if (EBB_LIKELY(ebb__stream_peek(s, id, &dev))) return EBB_OK;
  ebb_stream_info info;
  ebb_status st = ebb_stream_get_info(s, &info);
  if (st) return ebb__fail_in(fn, st);
  *id = info.id;
  return EBB_OK;
}

/* Storage serials: never reused (a record's address is, once it is freed). */
static _Atomic uint64_t storage_serials = 1;

/* Device storage is allocated on the calling thread's current stream of the device and
 * remembers it (handle and id): that is the stream the arena orders its reuse on. */
static ebb_status storage_new(const char *fn, int device, size_t bytes, struct ebb__storage **out) {
  ebb_stream_t *stream = NULL;
  uint64_t sid = 0;
  if (device != EBB_DEVICE_CPU) {
    int n = 0;
    ebb_status st = ebb_dev_count(&n);
    if (st) return ebb__fail_in(fn, st);
    if (device < 0 || device >= n)
      return ebb__fail(EBB_EDEVICE, "%s: device %d does not exist; expected EBB_DEVICE_CPU (-1) or 0..%d", fn, device, n - 1);
    st = ebb_stream_current(device, &stream);
    if (st) return ebb__fail_in(fn, st);
    st = stream_id_of(fn, stream, &sid);
    if (st) return st;
  }
  struct ebb__storage *s = calloc(1, sizeof *s);
  if (!s) return ebb__fail(EBB_ENOMEM, "%s: no host memory for a storage record", fn);
  void *p = NULL;
  /* (the caller rewrites a failure's message: it knows the tensor's shape and dtype) */
  ebb_status st = device == EBB_DEVICE_CPU ? ebb_pageable_alloc(bytes, &p) : ebb_arena_alloc(device, bytes, stream, &p);
  if (st) {
    free(s);
    return st;
  }
  atomic_store_explicit(&s->refs, 1, memory_order_relaxed);
  s->serial = atomic_fetch_add_explicit(&storage_serials, 1, memory_order_relaxed);
  s->device = device;
  s->data = p;
  s->bytes = bytes;
  s->stream = stream;
  s->stream_id = sid;
  s->inference = ebb__inference_on();
  *out = s;
  return EBB_OK;
}

/* Declares `stream` (whose id is `sid`) to the arena as a user of s's block, once per stream (up
 * to EBB__STORAGE_USED streams remembered; beyond that every use is declared again). Streams are
 * told apart by id: a stream created after another's release may get its handle, and taking it
 * for the old one would leave its use undeclared, so the block could be reused under it. */
static ebb_status storage_use(struct ebb__storage *s, ebb_stream_t *stream, uint64_t sid) {
  if (s->device == EBB_DEVICE_CPU || !s->data || sid == s->stream_id) return EBB_OK;
  for (int i = 0; i < EBB__STORAGE_USED; i++) {
    uint64_t u = atomic_load_explicit(&s->used[i], memory_order_relaxed);
    if (u == sid) return EBB_OK;
    if (!u) {
      ebb_status st = ebb_arena_record_stream(s->data, stream);
      if (st) return st;
      /* a racing thread may take the entry for another stream: that one is then declared
       * again at its next use, which costs a call, never a missed declaration */
      uint64_t expected = 0;
      atomic_compare_exchange_strong_explicit(&s->used[i], &expected, sid, memory_order_relaxed, memory_order_relaxed);
      return EBB_OK;
    }
  }
  return ebb_arena_record_stream(s->data, stream);
}

/* ---- handles -------------------------------------------------------------------------------- */

/* "64 MiB", "1.5 GiB", "12 bytes". */
static const char *bytes_str(size_t n, char *buf, size_t cap) {
  static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  if (u == 0) snprintf(buf, cap, "%zu bytes", n);
  else snprintf(buf, cap, v == (double)(uint64_t)v ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

/* The message of a storage that could not be made, naming the user's call; an out-of-memory
 * report also names the tensor (shape, dtype, bytes, device) before the allocator's report,
 * whose own "ebb_arena_alloc: " / "ebb_pageable_alloc: " is dropped (the user did not call it). */
static ebb_status storage_failed(const char *fn, ebb_status st, int device, ebb_dtype dt, int ndim, const int64_t *shape,
                                      size_t bytes) {
  if (st != EBB_ENOMEM) return ebb__fail_in(fn, st);
  char why[512], sh[128], sz[32], dv[32];
  const char *e = ebb_last_error();
  static const char *const callee[] = {"ebb_arena_alloc: ", "ebb_pageable_alloc: "};
  for (size_t i = 0; i < EBB_ARRAY_LEN(callee); i++)
    if (strncmp(e, callee[i], strlen(callee[i])) == 0) {
      e += strlen(callee[i]);
      break;
    }
  snprintf(why, sizeof why, "%s", e);
  return ebb__fail(st, "%s: out of memory for a %s %s tensor (%s) on %s: %s", fn, ebb__shape_str(shape, ndim, sh, sizeof sh),
                   ebb_dtype_name(dt), bytes_str(bytes, sz, sizeof sz), dev_str(device, dv, sizeof dv), why);
}

ebb_status ebb__tensor_new(const char *fn, int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  /* Checked here, before the runtime's own check (in the first call made for us) names that
   * call instead of the user's. */
  if (EBB_UNLIKELY(!ebb_is_initialized())) return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init() first", fn);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a tensor handle to fill", fn);
  if ((unsigned)dt >= EBB_DTYPE_COUNT) return ebb__fail(EBB_EINVAL, "%s: dtype %d is not an ebb_dtype", fn, (int)dt);
  ebb_status st = check_shape(fn, ndim, shape);
  if (st) return st;
  size_t bytes = (size_t)ebb__numel(shape, ndim) * ebb__dtype_size[dt];
  struct ebb__storage *s = NULL;
  st = storage_new(fn, device, bytes, &s);
  if (st) return storage_failed(fn, st, device, dt, ndim, shape, bytes);
  ebb_tensor_t *t;
  st = record_get(fn, &t);
  if (st) {
    storage_put(s);
    return st;
  }
  t->stor = s;
  t->dtype = dt;
  t->ndim = ndim;
  for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
  contig_strides(ndim, t->shape, t->strides);
  *out = t;
  return EBB_OK;
}

/* The hooks of the module above (ops_export.h): NULL until autograd starts. */
_Atomic(const ebb__tensor_hooks *) ebb__hooks;

/* Public op calls in progress on this thread, counted while hooks are installed. */
static _Thread_local int ebb__rec_depth;

/* Inference mode on this thread (autograd's scope; ops marks the storage made under it). */
static _Thread_local bool ebb__inference;

void ebb__inference_set(bool on) { ebb__inference = on; }
bool ebb__inference_on(void) { return ebb__inference; }
bool ebb__tensor_is_inference(const ebb_tensor_t *t) { return t->stor->inference; }
ebb_tensor_t *ebb__tensor_base(const ebb_tensor_t *t) { return t->base; }

bool ebb__tensor_overlaps(const ebb_tensor_t *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->strides[d] == 0 && t->shape[d] > 1) return true;
  return false;
}

void ebb__view_geom_of(const ebb_tensor_t *base, const ebb_tensor_t *view, ebb__view_geom *g) {
  memset(g, 0, sizeof *g);
  memcpy(g->base_strides, base->strides, sizeof(int64_t) * (size_t)base->ndim);
  g->base_offset = base->offset;
  ebb__tensor_meta_of(view, &g->view);
  memcpy(g->strides, view->strides, sizeof(int64_t) * (size_t)view->ndim);
  g->offset = view->offset;
}

const ebb__tensor_hooks *ebb__rec_enter_slow(const ebb__tensor_hooks *h) {
  if (!h->recorded) return NULL;
  ebb__rec_depth++;
  return h;
}

/* Modules watching every in-place op (ebb__inplace_watch_add). */
static _Atomic long ebb__inplace_watch;
void ebb__inplace_watch_add(long delta) { atomic_fetch_add_explicit(&ebb__inplace_watch, delta, memory_order_relaxed); }

ebb_status ebb__inplace_check(const char *fn, int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc,
                              const ebb__op_args *args, void **token) {
  *token = NULL;
  if (EBB_UNLIKELY(dst->stor->inference) && !ebb__inference) {
    return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "is an inference tensor (made in inference mode), which cannot be changed in "
                           "place outside inference mode; expected the change inside inference mode, or a clone made outside it");
  }
  /* acquire: pairs with the release store in ebb__tensor_hooks_set. */
  const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
  if (EBB_LIKELY(!h || !h->inplace)) return EBB_OK;
  bool slots = dst->autograd || (dst->base && dst->base->autograd);
  for (int i = 0; i < nsrc && !slots; i++) slots = src[i]->autograd != NULL;
  if (EBB_LIKELY(!slots && !atomic_load_explicit(&ebb__inplace_watch, memory_order_relaxed))) return EBB_OK;
  ebb_status st = h->inplace(op, dst, src, nsrc, args, token);
  return st ? ebb__fail_in(fn, st) : EBB_OK;
}

void ebb__inplace_end(void *token, bool ok) {
  if (EBB_LIKELY(!token)) return;
  /* acquire: pairs with the release store in ebb__tensor_hooks_set (the hooks that made the
   * token are still installed: autograd stops after the last op). */
  const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
  if (h && h->inplace_done) h->inplace_done(token, ok);
}

ebb_status ebb__rec_exit(const char *fn, const ebb__tensor_hooks *h, ebb_status st, ebb__op_id op, const ebb_tensor_t *const *in,
                         int nin, ebb_tensor_t **out0, ebb_tensor_t **out1, const ebb__op_args *args) {
  if (--ebb__rec_depth > 0 || st) return st; /* an op's own inner call, or a failure */
  bool any = false;
  for (int i = 0; i < nin && !any; i++) any = in[i] && in[i]->autograd;
  if (!any) return EBB_OK;
  ebb_tensor_t *outs[2] = {*out0, out1 ? *out1 : NULL};
  if (outs[0] == in[0]) return EBB_OK; /* the input itself (contiguous of a contiguous tensor): no node */
  static const ebb__op_args none;
  st = h->recorded((int)op, in, nin, outs, out1 ? 2 : 1, args ? args : &none);
  if (st) {
    ebb__tensor_put(*out0);
    *out0 = NULL;
    if (out1) {
      ebb__tensor_put(*out1);
      *out1 = NULL;
    }
    return ebb__fail_in(fn, st);
  }
  return EBB_OK;
}

void ebb__tensor_hooks_set(const ebb__tensor_hooks *h) {
  /* release: pairs with the acquire loads below; the hooks' module is up. */
  atomic_store_explicit(&ebb__hooks, h, memory_order_release);
}

ebb_status ebb__tensor_alias(const char *fn, const ebb_tensor_t *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset,
                             ebb_tensor_t **out) {
  ebb_tensor_t *v;
  ebb_status st = record_get(fn, &v);
  if (st) return st;
  atomic_fetch_add_explicit(&t->stor->refs, 1, memory_order_relaxed);
  v->stor = t->stor;
  v->dtype = t->dtype;
  v->ndim = ndim;
  v->offset = offset;
  /* A view remembers its base (the first tensor of its chain of views) for autograd, which
   * gives an in-place change through the view to the base's history. */
  v->base = t->base ? t->base : (ebb_tensor_t *)t;
  atomic_fetch_add_explicit(&v->base->refs, 1, memory_order_relaxed);
  for (int d = 0; d < ndim; d++) {
    v->shape[d] = shape[d];
    v->strides[d] = strides[d];
  }
  if (EBB_UNLIKELY(t->autograd != NULL)) {
    /* acquire: pairs with the release store in ebb__tensor_hooks_set. */
    const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
    if (h && h->viewed && (st = h->viewed(t, v, fn))) {
      ebb__tensor_put(v);
      return ebb__fail_in(fn, st);
    }
  }
  *out = v;
  return EBB_OK;
}

void ebb__tensor_put(ebb_tensor_t *t) {
  if (!t) return;
  /* acq_rel: as in storage_put */
  if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) != 1) return;
  if (EBB_UNLIKELY(t->autograd != NULL)) {
    void *slot = t->autograd;
    t->autograd = NULL;
    /* acquire: pairs with the release store in ebb__tensor_hooks_set. */
    const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
    if (h && h->released) h->released(t, slot);
  }
  struct ebb__storage *s = t->stor;
  ebb_tensor_t *base = t->base; /* (a base is never a view: this recurses once at most) */
  record_put(t);
  storage_put(s);
  ebb__tensor_put(base);
}

ebb_status ebb__grads_out(ebb_status st, ebb_tensor_t *ra, ebb_tensor_t **ga, ebb_tensor_t *rb, ebb_tensor_t **gb) {
  if (st) {
    ebb__tensor_put(ra);
    ebb__tensor_put(rb);
    return st;
  }
  if (ga) *ga = ra;
  if (gb) *gb = rb;
  return EBB_OK;
}

ebb_status ebb_tensor_retain(ebb_tensor_t *t) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_retain", "t");
  if (st) return st;
  atomic_fetch_add_explicit(&t->refs, 1, memory_order_relaxed);
  return EBB_OK;
}

ebb_status ebb_tensor_release(ebb_tensor_t *t) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_release", "t");
  if (st) return st;
  ebb__tensor_put(t);
  return EBB_OK;
}

ebb_status ebb_tensor_record_stream(const ebb_tensor_t *t, ebb_stream_t *stream) {
  static const char fn[] = "ebb_tensor_record_stream";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  if (!stream) return ebb__fail(EBB_EINVAL, "%s: stream is NULL; expected a stream of device %d", fn, t->stor->device);
  uint64_t sid;
  st = stream_id_of(fn, stream, &sid);
  if (st) return st;
  ebb_stream_info si;
  st = ebb_stream_get_info(stream, &si);
  if (st) return ebb__fail_in(fn, st);
  char sh[EBB__DESC_MAX];
  if (t->stor->device == EBB_DEVICE_CPU)
    return ebb__fail(EBB_EINVAL, "%s: %s is a CPU tensor, whose memory is not stream-ordered; expected a device tensor", fn,
                     EBB__DESC(t, "t", sh));
  if (si.device != t->stor->device)
    return ebb__fail(EBB_EDEVICE, "%s: stream %llu is on device %d but %s is not; expected a stream of device %d", fn,
                     (unsigned long long)sid, si.device, EBB__DESC(t, "t", sh), t->stor->device);
  st = storage_use(t->stor, stream, sid);
  return st ? ebb__fail_in(fn, st) : EBB_OK;
}

/* ---- kernels and the launch path -------------------------------------------------------------- */

/* The kernels of ops, by id: one name for the registry and the emulated driver, the CUDA
 * function in the fatbin, the argument struct, and the CPU function (CPU tensors call it
 * directly; the emulated driver runs it on a device engine thread). */
static const struct {
  const char *name, *cuda_name;
  size_t arg_bytes;
  ebb_kernel_cpu_fn fn;
} ebb__kernel_defs[EBB__K_COUNT] = {
    [EBB__K_EW] = {"ebb.ops.ew", "ebb_ops_ew", sizeof(ebb__ew_args), ebb__ew_cpu},
    [EBB__K_REDUCE] = {"ebb.ops.reduce", "ebb_ops_reduce", sizeof(ebb__red_args), ebb__reduce_cpu},
    [EBB__K_MATMUL] = {"ebb.ops.matmul", "ebb_ops_matmul", sizeof(ebb__mm_args), ebb__matmul_cpu},
    [EBB__K_ROWS] = {"ebb.ops.rows", "ebb_ops_rows", sizeof(ebb__rows_args), ebb__rows_cpu},
    [EBB__K_OPTIM] = {"ebb.ops.optim", "ebb_ops_optim", sizeof(ebb__optim_args), ebb__optim_cpu},
};

static _Atomic(const ebb_kernel_t *) ebb__kernels[EBB__K_COUNT];

#ifdef EBB_HAVE_FATBIN
/* ops' CUDA kernels (ops/cuda/ops_kernels.cu), embedded by ops/CMakeLists.txt. */
extern const unsigned char ebb__fatbin_ops[];
#define EBB__OPS_IMAGE ((const void *)ebb__fatbin_ops)
#else
#define EBB__OPS_IMAGE NULL
#endif
/* ops' image "ebb.ops", registered by the module's start: written before the start returns,
 * read-only until the stop. */
static const ebb_kernel_image_t *ebb__ops_image;

static ebb_status ops_start(void) { return ebb_kernel_add_image("ebb.ops", EBB__OPS_IMAGE, &ebb__ops_image); }

/* The module's stop: the runtime forgets images and declared kernels at the last ebb_shutdown,
 * so does this cache; cuBLAS handles go too. */
static void ops_stop(void) {
  for (int i = 0; i < EBB__K_COUNT; i++) atomic_store_explicit(&ebb__kernels[i], NULL, memory_order_relaxed);
  ebb__ops_image = NULL;
  ebb__blas_stop();
}

static int ops_count(ebb__live_count *out, int max) {
  if (max < 1) return 0;
  out[0] = (ebb__live_count){"tensors", atomic_load_explicit(&ebb__live_tensors, memory_order_relaxed)};
  return 1;
}

const ebb__module_desc ebb__module_ops = {
  .name = "ops",
  .layer = EBB__LAYER_OPS,
  .start = ops_start,
  .stop = ops_stop,
  .count = ops_count,
};

static ebb_status tensor_kernel(int kid, const ebb_kernel_t **out) {
  /* acquire: pairs with the release store below (the record is fully written) */
  const ebb_kernel_t *k = atomic_load_explicit(&ebb__kernels[kid], memory_order_acquire);
  if (EBB_LIKELY(k)) {
    *out = k;
    return EBB_OK;
  }
  /* Declaring twice with the same parameters returns the same handle, so racing threads agree
   * without a lock of ours (which would rank below the runtime's locks taken inside). */
  ebb_status st = ebb_kernel_declare_in(ebb__ops_image, ebb__kernel_defs[kid].name, ebb__kernel_defs[kid].arg_bytes, ebb__kernel_defs[kid].fn,
                                     ebb__kernel_defs[kid].cuda_name, &k);
  if (st) return st;
  atomic_store_explicit(&ebb__kernels[kid], k, memory_order_release);
  *out = k;
  return EBB_OK;
}

ebb_status ebb__operands_use(const char *fn, const ebb__operand *ops, int nops, ebb_stream_t *stream) {
  uint64_t sid;
  ebb_status st = stream_id_of(fn, stream, &sid);
  if (st) return st;
  for (int i = 0; i < nops; i++) {
    st = storage_use(ops[i].t->stor, stream, sid);
    if (st) return ebb__fail_in(fn, st);
  }
  return EBB_OK;
}

/* CPU tensors run the kernel here and now: there is no stream to order against, and the
 * contract is that CPU results are ready on return. Device launches declare whole storages as
 * read or written (ebb_launch_cfg, checked with EBB_CHECK_LAUNCH=1): a view's bytes lie inside
 * them, and the declaration is about reachability, not exact extents. */
ebb_status ebb__launch(const char *fn, int kid, int device, const void *args, const ebb__operand *ops, int nops, int64_t work) {
  if (device == EBB_DEVICE_CPU) {
    ebb__kernel_defs[kid].fn((void *)(uintptr_t)args);
    return EBB_OK;
  }
  const ebb_kernel_t *k;
  ebb_status st = tensor_kernel(kid, &k);
  ebb_stream_t *s;
  uint64_t sid;
  if (!st) st = ebb_stream_current(device, &s);
  if (st) return ebb__fail_in(fn, st);
  st = stream_id_of(fn, s, &sid);
  if (st) return st;
  ebb_buf reads[8], writes[4];
  int nr = 0, nw = 0;
  for (int i = 0; i < nops; i++) {
    struct ebb__storage *sg = ops[i].t->stor;
    if (!sg->data) continue;
    st = storage_use(sg, s, sid);
    if (st) return ebb__fail_in(fn, st);
    ebb_buf b = {sg->data, sg->bytes};
    if (ops[i].write && nw < 4) writes[nw++] = b;
    else if (!ops[i].write && nr < 8) reads[nr++] = b;
  }
  ebb_launch_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.reads = reads;
  cfg.nreads = nr;
  cfg.writes = writes;
  cfg.nwrites = nw;
  /* 256 threads per block, at most 65535 blocks: grid-stride loops cover the rest */
  int64_t blocks = (work + 255) / 256;
  cfg.block[0] = 256;
  cfg.grid[0] = (unsigned)(blocks < 1 ? 1 : blocks > 65535 ? 65535 : blocks);
  st = ebb_stream_launch(s, k, args, &cfg);
  if (st) {
    char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: launching kernel '%s' on device %d failed: %s", fn, ebb_kernel_name(k), device, why);
  }
  return EBB_OK;
}

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

/* ---- creation ------------------------------------------------------------------------------- */

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
        if (!st) st = stream_id_of(fn, fs, &fid);
        if (!st) st = storage_use(c->stor, fs, fid);
        if (st) goto fail_dst;
      }
      st = ebb_copy_async(r->stor->data, ebb__tensor_ptr(c), bytes, s);
      if (st) goto fail_dst;
    } else {
      /* onto the CPU: a CPU tensor is always ready, so wait for the copy */
      uint64_t sid;
      st = ebb_stream_current(from, &s);
      if (!st) st = stream_id_of(fn, s, &sid);
      if (!st) st = storage_use(c->stor, s, sid);
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
  ebb_ptr_info pi;
  st = ebb__drv_ptr_info(t->stor->device, dst, &pi);
  if (st) return ebb__fail_in(fn, st);
  if (pi.type != EBB_MEMTYPE_PINNED)
    return ebb__fail(EBB_EINVAL, "%s: dst %p is %s memory; expected pinned host memory (ebb_pinned_alloc)", fn, dst,
                     pi.type == EBB_MEMTYPE_DEVICE ? "device" : "pageable host");
  if (edev != t->stor->device)
    return ebb__fail(EBB_EDEVICE, "%s: event done belongs to device %d but %s does not; expected an event of its device", fn, edev,
                     EBB__DESC(t, "t", td));
  ebb_stream_t *s;
  uint64_t sid;
  st = ebb_stream_current(t->stor->device, &s);
  if (st) return ebb__fail_in(fn, st);
  st = stream_id_of(fn, s, &sid);
  if (st) return st;
  /* dst is checked against its pinned block (the copy's own check) before the contiguous copy
   * below is enqueued: a refusal leaves nothing behind. */
  st = ebb__copy_side_check(dst, bytes, true, s);
  if (st) return ebb__fail_in(fn, st);
  /* The copy reads t's storage on s: declared before anything is enqueued. A contiguous copy
   * made below lives on s already. */
  if (ebb__is_contiguous(t)) {
    st = storage_use(t->stor, s, sid);
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

/* ---- getters --------------------------------------------------------------------------------- */

ebb_status ebb_tensor_get_info(const ebb_tensor_t *t, ebb_tensor_info *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_get_info", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_get_info: out is NULL");
  memset(out, 0, sizeof *out);
  out->device = t->stor->device;
  out->dtype = t->dtype;
  out->ndim = t->ndim;
  for (int d = 0; d < t->ndim; d++) {
    out->shape[d] = t->shape[d];
    out->strides[d] = t->strides[d];
  }
  out->offset = t->offset;
  out->numel = ebb__numel(t->shape, t->ndim);
  out->contiguous = ebb__is_contiguous(t);
  out->version = atomic_load_explicit(&t->stor->version, memory_order_relaxed);
  return EBB_OK;
}

#define EBB__GETTER(fname, type, expr)                                               \
  ebb_status fname(const ebb_tensor_t *t, type *out) {                               \
    ebb_status st = ebb__tensor_check(t, #fname, "t");                               \
    if (st) return st;                                                               \
    if (!out) return ebb__fail(EBB_EINVAL, #fname ": out is NULL; expected a place for the result"); \
    *out = (expr);                                                                   \
    return EBB_OK;                                                                   \
  }
EBB__GETTER(ebb_tensor_dtype, ebb_dtype, t->dtype)
EBB__GETTER(ebb_tensor_device, int, t->stor->device)
EBB__GETTER(ebb_tensor_numel, int64_t, ebb__numel(t->shape, t->ndim))
EBB__GETTER(ebb_tensor_is_contiguous, bool, ebb__is_contiguous(t))
EBB__GETTER(ebb_tensor_version, uint64_t, atomic_load_explicit(&t->stor->version, memory_order_relaxed))
EBB__GETTER(ebb_tensor_data, void *, ebb__tensor_ptr(t))
#undef EBB__GETTER

ebb_status ebb_tensor_shape(const ebb_tensor_t *t, int *ndim, int64_t shape[EBB_TENSOR_MAX_DIMS]) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_shape", "t");
  if (st) return st;
  if (!ndim || !shape) return ebb__fail(EBB_EINVAL, "ebb_tensor_shape: ndim and shape must be non-NULL");
  *ndim = t->ndim;
  for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
  return EBB_OK;
}

ebb_status ebb_tensor_strides(const ebb_tensor_t *t, int64_t strides[EBB_TENSOR_MAX_DIMS]) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_strides", "t");
  if (st) return st;
  if (!strides) return ebb__fail(EBB_EINVAL, "ebb_tensor_strides: strides is NULL");
  for (int d = 0; d < t->ndim; d++) strides[d] = t->strides[d];
  return EBB_OK;
}

ebb_status ebb_tensor_same_storage(const ebb_tensor_t *a, const ebb_tensor_t *b, bool *out) {
  ebb_status st = ebb__tensor_check(a, "ebb_tensor_same_storage", "a");
  if (!st) st = ebb__tensor_check(b, "ebb_tensor_same_storage", "b");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_same_storage: out is NULL");
  *out = a->stor == b->stor;
  return EBB_OK;
}

ebb_status ebb_tensor_name(const ebb_tensor_t *t, char *buf, size_t cap) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_name", "t");
  if (st) return st;
  if (!buf || !cap) return ebb__fail(EBB_EINVAL, "ebb_tensor_name: buf is NULL or cap is 0; expected room for the name");
  size_t n = strnlen(t->name, sizeof t->name - 1); /* (a copy, truncated to cap: no printf machinery) */
  if (n >= cap) n = cap - 1;
  memcpy(buf, t->name, n);
  buf[n] = '\0';
  return EBB_OK;
}

ebb_status ebb_tensor_set_name(ebb_tensor_t *t, const char *name) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_set_name", "t");
  if (st) return st;
  if (!name) return ebb__fail(EBB_EINVAL, "ebb_tensor_set_name: name is NULL");
  if (strlen(name) > EBB_TENSOR_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_set_name: name '%.32s...' is longer than %d bytes", name, EBB_TENSOR_NAME_MAX);
  snprintf(t->name, sizeof t->name, "%s", name);
  return EBB_OK;
}

ebb_status ebb__tensor_share(const ebb_tensor_t *t, ebb_tensor_t **out) {
  ebb_tensor_t *v;
  ebb_status st = record_get("ebb__tensor_share", &v);
  if (st) return st;
  atomic_fetch_add_explicit(&t->stor->refs, 1, memory_order_relaxed);
  v->stor = t->stor;
  v->dtype = t->dtype;
  v->ndim = t->ndim;
  v->offset = t->offset;
  memcpy(v->shape, t->shape, sizeof v->shape);
  memcpy(v->strides, t->strides, sizeof v->strides);
  *out = v;
  return EBB_OK;
}

ebb_status ebb__tensor_share_as(const ebb_tensor_t *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset,
                                ebb_tensor_t **out) {
  ebb_tensor_t *v;
  ebb_status st = ebb__tensor_share(t, &v);
  if (st) return st;
  v->ndim = ndim;
  v->offset = offset;
  for (int d = 0; d < ndim; d++) {
    v->shape[d] = shape[d];
    v->strides[d] = strides[d];
  }
  *out = v;
  return EBB_OK;
}

void ebb__tensor_storage_info(const ebb_tensor_t *t, ebb__storage_info *out) {
  const struct ebb__storage *s = t->stor;
  out->block = s->data;
  out->bytes = s->bytes;
  out->serial = s->serial;
  out->stream = s->stream;
  out->stream_id = s->stream_id;
  out->used_elsewhere = false;
  for (int i = 0; i < EBB__STORAGE_USED; i++) out->used_elsewhere |= atomic_load_explicit(&s->used[i], memory_order_relaxed) != 0;
  out->device = s->device;
  out->offset = t->offset;
  memcpy(out->strides, t->strides, sizeof(int64_t) * (size_t)t->ndim);
}

bool ebb__tensor_matches(const ebb_tensor_t *t, const ebb__tensor_meta *m) {
  return t->ndim == m->ndim && t->dtype == m->dtype && t->stor->device == m->device &&
         memcmp(t->shape, m->shape, sizeof(int64_t) * (size_t)m->ndim) == 0;
}

void ebb__tensor_meta_of(const ebb_tensor_t *t, ebb__tensor_meta *m) {
  m->device = t->stor->device;
  m->dtype = t->dtype;
  m->ndim = t->ndim;
  memcpy(m->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
}

bool ebb__tensor_exclusive(const ebb_tensor_t *t) {
  /* acquire: a reference dropped on another thread happened before this read of the count. A
   * view whose base only it holds is alone on the storage too (the base's handle is its). */
  if (atomic_load_explicit(&t->refs, memory_order_acquire) != 1 || t->autograd || !ebb__is_contiguous(t)) return false;
  uint32_t srefs = atomic_load_explicit(&t->stor->refs, memory_order_acquire);
  if (!t->base) return srefs == 1;
  return srefs == 2 && atomic_load_explicit(&t->base->refs, memory_order_acquire) == 1 && !t->base->autograd;
}

void *ebb__tensor_block(const ebb_tensor_t *t) { return t->stor ? t->stor->data : NULL; }

void *ebb__tensor_slot(const ebb_tensor_t *t) { return t->autograd; }
void ebb__tensor_set_slot(ebb_tensor_t *t, void *slot) { t->autograd = slot; }

ebb_status ebb_tensor_bump_version(ebb_tensor_t *t) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_bump_version", "t");
  if (st) return st;
  atomic_fetch_add_explicit(&t->stor->version, 1, memory_order_relaxed);
  return EBB_OK;
}

/* ---- views ----------------------------------------------------------------------------------- */

#define EBB__VIEW_PROLOGUE(fn)                                         \
  ebb_status st = ebb__tensor_check(t, fn, "t");                       \
  if (st) return st;                                                   \
  if (!out) return ebb__fail(EBB_EINVAL, fn ": out is NULL; expected a tensor handle to fill")

/* Strides for viewing (oshape, ostrides) as nshape without copying, or false. Dims of the old
 * shape are grouped into runs that are contiguous among themselves; each run must be covered
 * by a run of new dims with the same element count. */
/* Example: a [2,3,4] tensor transposed to [4,3,2] has strides [1,4,12]; no run of its dims is
 * contiguous, so viewing it as [24] fails, while [4,6] fails too and [4,3,2,1] succeeds. */
static bool view_strides(int od, const int64_t *oshape, const int64_t *ostrides, int nd, const int64_t *nshape, int64_t *nstrides) {
  if (ebb__numel(oshape, od) == 0 || od == 0) {
    contig_strides(nd, nshape, nstrides);
    return true;
  }
  int vd = nd - 1;
  int64_t base = ostrides[od - 1], tnum = 1, vnum = 1;
  for (int td = od - 1; td >= 0; td--) {
    tnum *= oshape[td];
    if (td == 0 || (oshape[td - 1] != 1 && ostrides[td - 1] != tnum * base)) {
      while (vd >= 0 && (vnum < tnum || nshape[vd] == 1)) {
        nstrides[vd] = vnum * base;
        vnum *= nshape[vd];
        vd--;
      }
      if (vnum != tnum) return false;
      if (td > 0) {
        base = ostrides[td - 1];
        tnum = 1;
        vnum = 1;
      }
    }
  }
  return vd == -1;
}

/* Resolves one -1 in shape against numel; EBB_EINVAL when impossible. */
static ebb_status infer_shape(const char *fn, const ebb_tensor_t *t, int ndim, const int64_t *shape, int64_t *res) {
  if (ndim < 0 || ndim > EBB_TENSOR_MAX_DIMS || (ndim && !shape))
    return ebb__fail(EBB_EINVAL, "%s: ndim %d with shape %s; expected 0..%d dims", fn, ndim, shape ? "given" : "NULL", EBB_TENSOR_MAX_DIMS);
  int64_t n = ebb__numel(t->shape, t->ndim), known = 1;
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    res[d] = shape[d];
    if (shape[d] == -1 && infer < 0) infer = d;
    else if (shape[d] < 0) goto bad;
    else known *= shape[d];
  }
  if (infer >= 0) {
    if (known == 0 || n % known) goto bad;
    res[infer] = n / known;
  } else if (known != n) {
    goto bad;
  }
  return EBB_OK;
bad:;
  char a[EBB__DESC_MAX], b[128];
  return ebb__fail(EBB_EINVAL, "%s: cannot view %s (%lld elements) as %s", fn, EBB__DESC(t, "t", a), (long long)n,
                   ebb__shape_str(shape, ndim, b, sizeof b));
}

static ebb_status tensor_view_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_view");
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  st = infer_shape("ebb_tensor_view", t, ndim, shape, ns);
  if (st) return st;
  if (!view_strides(t->ndim, t->shape, t->strides, ndim, ns, nst)) {
    char a[EBB__DESC_MAX], b[128], c[128];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_view: %s with strides %s cannot be viewed as %s without a copy; use ebb_tensor_reshape",
                     EBB__DESC(t, "t", a), ebb__shape_str(t->strides, t->ndim, b, sizeof b), ebb__shape_str(ns, ndim, c, sizeof c));
  }
  return ebb__tensor_alias("ebb_tensor_view", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_view(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_view", EBB__OP_VIEW, NULL, out, tensor_view_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_reshape_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_reshape");
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  st = infer_shape("ebb_tensor_reshape", t, ndim, shape, ns);
  if (st) return st;
  if (view_strides(t->ndim, t->shape, t->strides, ndim, ns, nst))
    return ebb__tensor_alias("ebb_tensor_reshape", t, ndim, ns, nst, t->offset, out);
  /* A copy, reshaped in place: a new tensor, not a view of t (nor of the copy). */
  ebb_tensor_t *c;
  st = ebb__copy_as("ebb_tensor_reshape", t, t->dtype, &c);
  if (st) return st;
  c->ndim = ndim;
  memcpy(c->shape, ns, sizeof(int64_t) * (size_t)ndim);
  contig_strides(ndim, c->shape, c->strides);
  *out = c;
  return EBB_OK;
}

ebb_status ebb_tensor_reshape(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_reshape", EBB__OP_RESHAPE, NULL, out, tensor_reshape_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_permute_impl(const ebb_tensor_t *t, const int *dims, int ndim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_permute");
  if (ndim != t->ndim || (ndim && !dims)) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_permute: %d dims given for %s; expected a permutation of its %d dims", ndim,
                     EBB__DESC(t, "t", a), t->ndim);
  }
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  bool seen[EBB_TENSOR_MAX_DIMS] = {false};
  for (int i = 0; i < ndim; i++) {
    int d;
    char arg[24];
    snprintf(arg, sizeof arg, "dims[%d]", i);
    st = ebb__dim("ebb_tensor_permute", arg, dims[i], ndim, &d);
    if (st) return st;
    if (seen[d]) return ebb__fail(EBB_EINVAL, "ebb_tensor_permute: dim %d appears twice in dims; expected a permutation", d);
    seen[d] = true;
    ns[i] = t->shape[d];
    nst[i] = t->strides[d];
  }
  return ebb__tensor_alias("ebb_tensor_permute", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_permute(const ebb_tensor_t *t, const int *dims, int ndim, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_permute_impl(t, dims, ndim, out);
  ebb__op_args a = {.ndims = ndim};
  for (int k = 0; h && !st && k < ndim; k++) a.dims[k] = dims[k] < 0 ? dims[k] + ndim : dims[k];
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_permute", h, st, EBB__OP_PERMUTE, in, 1, out, NULL, &a);
}

static ebb_status tensor_transpose_impl(const ebb_tensor_t *t, int dim0, int dim1, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_transpose");
  int a, b;
  st = ebb__dim("ebb_tensor_transpose", "dim0", dim0, t->ndim, &a);
  if (!st) st = ebb__dim("ebb_tensor_transpose", "dim1", dim1, t->ndim, &b);
  if (st) return st;
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int d = 0; d < t->ndim; d++) {
    int s = d == a ? b : d == b ? a : d;
    ns[d] = t->shape[s];
    nst[d] = t->strides[s];
  }
  return ebb__tensor_alias("ebb_tensor_transpose", t, t->ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_transpose(const ebb_tensor_t *t, int dim0, int dim1, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_transpose_impl(t, dim0, dim1, out);
  ebb__op_args a = {.dim = dim0, .dim1 = dim1};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    if (a.dim1 < 0) a.dim1 += t->ndim;
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_transpose", h, st, EBB__OP_TRANSPOSE, in, 1, out, NULL, &a);
}

/* The slice view of t along dim d (normalised), start/end clamped; the view is made for `fn`
 * (slice or narrow, whose name the lifecycle hook and messages get). */
/* Python's slice bounds on an extent: negative counts from the end, then clamped. */
static void clamp_bounds(int64_t size, int64_t *start, int64_t *end) {
  if (*start < 0) *start += size;
  if (*end < 0) *end += size;
  *start = *start < 0 ? 0 : *start > size ? size : *start;
  *end = *end < *start ? *start : *end > size ? size : *end;
}

static ebb_status slice_view(const char *fn, const ebb_tensor_t *t, int d, int64_t start, int64_t end, int64_t step,
                                  ebb_tensor_t **out) {
  clamp_bounds(t->shape[d], &start, &end);
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  memcpy(ns, t->shape, sizeof ns);
  memcpy(nst, t->strides, sizeof nst);
  ns[d] = (end - start + step - 1) / step;
  nst[d] = t->strides[d] * step;
  return ebb__tensor_alias(fn, t, t->ndim, ns, nst, t->offset + start * t->strides[d], out);
}

static ebb_status tensor_slice_impl(const ebb_tensor_t *t, int dim, int64_t start, int64_t end, int64_t step, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_slice");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_slice: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_slice", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (step < 1) return ebb__fail(EBB_EINVAL, "ebb_tensor_slice: step is %lld; expected step >= 1", (long long)step);
  return slice_view("ebb_tensor_slice", t, d, start, end, step, out);
}

ebb_status ebb_tensor_slice(const ebb_tensor_t *t, int dim, int64_t start, int64_t end, int64_t step, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_slice_impl(t, dim, start, end, step, out);
  ebb__op_args a = {.dim = dim, .start = start, .end = end, .step = step};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    clamp_bounds(t->shape[a.dim], &a.start, &a.end);
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_slice", h, st, EBB__OP_SLICE, in, 1, out, NULL, &a);
}

static ebb_status tensor_narrow_impl(const ebb_tensor_t *t, int dim, int64_t start, int64_t length, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_narrow");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_narrow: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_narrow", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (start < 0 || length < 0 || start + length > t->shape[d]) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_narrow: start %lld and length %lld do not fit dim %d of %s", (long long)start,
                     (long long)length, d, EBB__DESC(t, "t", a));
  }
  return slice_view("ebb_tensor_narrow", t, d, start, start + length, 1, out);
}

ebb_status ebb_tensor_narrow(const ebb_tensor_t *t, int dim, int64_t start, int64_t length, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_narrow_impl(t, dim, start, length, out);
  ebb__op_args a = {.dim = dim, .start = start, .end = start + length, .step = 1};
  if (h && !st && a.dim < 0) a.dim += t->ndim;
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_narrow", h, st, EBB__OP_NARROW, in, 1, out, NULL, &a);
}

/* The view of t without dim d at index i (both in range), made for `fn` (select or squeeze). */
static ebb_status select_view(const char *fn, const ebb_tensor_t *t, int d, int64_t i, ebb_tensor_t **out) {
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int k = 0, j = 0; k < t->ndim; k++) {
    if (k == d) continue;
    ns[j] = t->shape[k];
    nst[j++] = t->strides[k];
  }
  return ebb__tensor_alias(fn, t, t->ndim - 1, ns, nst, t->offset + i * t->strides[d], out);
}

static ebb_status tensor_select_impl(const ebb_tensor_t *t, int dim, int64_t index, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_select");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_select: %s is a scalar (0 dims); expected at least 1 dim", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_select", "dim", dim, t->ndim, &d);
  if (st) return st;
  int64_t i = index < 0 ? index + t->shape[d] : index;
  if (i < 0 || i >= t->shape[d]) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_select: index %lld is out of range for dim %d of %s", (long long)index, d, EBB__DESC(t, "t", a));
  }
  return select_view("ebb_tensor_select", t, d, i, out);
}

ebb_status ebb_tensor_select(const ebb_tensor_t *t, int dim, int64_t index, ebb_tensor_t **out) {
  const ebb__tensor_hooks *h = ebb__rec_enter();
  ebb_status st = tensor_select_impl(t, dim, index, out);
  ebb__op_args a = {.dim = dim, .start = index};
  if (h && !st) {
    if (a.dim < 0) a.dim += t->ndim;
    if (a.start < 0) a.start += t->shape[a.dim];
  }
  const ebb_tensor_t *in[1] = {t};
  return ebb__rec_done("ebb_tensor_select", h, st, EBB__OP_SELECT, in, 1, out, NULL, &a);
}

static ebb_status tensor_expand_impl(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_expand");
  if (ndim < t->ndim || ndim > EBB_TENSOR_MAX_DIMS || !shape) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_expand: %d target dims for %s; expected %d..%d dims and a shape", ndim,
                     EBB__DESC(t, "t", a), t->ndim, EBB_TENSOR_MAX_DIMS);
  }
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int d = ndim - 1, j = t->ndim - 1; d >= 0; d--, j--) {
    if (j >= 0 && (shape[d] == -1 || shape[d] == t->shape[j])) {
      ns[d] = t->shape[j];
      nst[d] = t->strides[j];
    } else if ((j < 0 || t->shape[j] == 1) && shape[d] >= 0) {
      ns[d] = shape[d];
      nst[d] = 0;
    } else {
      char a[EBB__DESC_MAX], b[128];
      return ebb__fail(EBB_EINVAL, "ebb_tensor_expand: %s cannot be expanded to %s (dim %d); expected equal extents or 1",
                       EBB__DESC(t, "t", a), ebb__shape_str(shape, ndim, b, sizeof b), d);
    }
  }
  return ebb__tensor_alias("ebb_tensor_expand", t, ndim, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_expand(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_expand", EBB__OP_EXPAND, NULL, out, tensor_expand_impl(t, ndim, shape, out), t);
}

static ebb_status tensor_squeeze_impl(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_squeeze");
  int d;
  char sd[EBB__DESC_MAX];
  if (t->ndim == 0) return ebb__fail(EBB_EINVAL, "ebb_tensor_squeeze: %s is a scalar (0 dims); nothing to squeeze", EBB__DESC(t, "t", sd));
  st = ebb__dim("ebb_tensor_squeeze", "dim", dim, t->ndim, &d);
  if (st) return st;
  if (t->shape[d] != 1) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "ebb_tensor_squeeze: dim %d of %s has extent %lld; expected 1", d, EBB__DESC(t, "t", a),
                     (long long)t->shape[d]);
  }
  return select_view("ebb_tensor_squeeze", t, d, 0, out);
}

ebb_status ebb_tensor_squeeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_squeeze", EBB__OP_SQUEEZE, NULL, out, tensor_squeeze_impl(t, dim, out), t);
}

static ebb_status tensor_unsqueeze_impl(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__VIEW_PROLOGUE("ebb_tensor_unsqueeze");
  if (t->ndim == EBB_TENSOR_MAX_DIMS)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_unsqueeze: t has %d dims already (the maximum)", EBB_TENSOR_MAX_DIMS);
  if (dim < -t->ndim - 1 || dim > t->ndim)
    return ebb__fail(EBB_EINVAL, "ebb_tensor_unsqueeze: dim %d is out of range; expected [%d, %d]", dim, -t->ndim - 1, t->ndim);
  int d = dim < 0 ? dim + t->ndim + 1 : dim;
  int64_t ns[EBB_TENSOR_MAX_DIMS], nst[EBB_TENSOR_MAX_DIMS];
  for (int k = 0, j = 0; k <= t->ndim; k++) {
    if (k == d) {
      ns[k] = 1;
      nst[k] = j < t->ndim ? t->strides[j] * t->shape[j] : 1;
    } else {
      ns[k] = t->shape[j];
      nst[k] = t->strides[j++];
    }
  }
  return ebb__tensor_alias("ebb_tensor_unsqueeze", t, t->ndim + 1, ns, nst, t->offset, out);
}

ebb_status ebb_tensor_unsqueeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out) {
  EBB__RECORDED("ebb_tensor_unsqueeze", EBB__OP_UNSQUEEZE, NULL, out, tensor_unsqueeze_impl(t, dim, out), t);
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
  if (src->stor->device != dst->stor->device) st = to_device(fn, src, dst->stor->device, &moved);
  if (!st) st = ebb__ew_run(fn, EBB__EW_COPY, dst, 1, moved ? (const ebb_tensor_t *const *)&moved : &src, 0, 0);
  ebb__tensor_put(moved);
  if (!st) atomic_fetch_add_explicit(&dst->stor->version, 1, memory_order_relaxed);
  ebb__inplace_end(token, !st);
  return st;
}
