/* tensor.c: tensor handles and their storage.
 *
 * Owns: the dtype table; the pool of tensor records (type-stable: chunks are never freed,
 * released records wait in a FIFO and are reused only after EBB__TENSOR_QUARANTINE more
 * releases, so a stale handle reads a cleared magic and is reported as EBB_EFREED instead of
 * touching freed memory); the refcounted storages (device arena blocks or host-pool blocks) and
 * the streams each has declared to the arena; making, aliasing, sharing and releasing handles;
 * the getters and the accessors other modules use (ops_export.h).
 * Threading: handle refcounts are atomic; the pool lock is a leaf lock that guards only the free
 * FIFO and chunk growth; each thread keeps a small cache of records, freed storage records and
 * storage serials of its own (thread-local, given back at thread exit). Storage release is stream-ordered by the arena: freeing a block right
 * after enqueuing its last use is safe on its allocation stream, and other streams are declared
 * with ebb_arena_record_stream when an op first uses them (ebb__storage_use).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "ebb_sync.h"
#include "ops_impl.h"
#include "ops_export.h"
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
 * acting on someone else's tensor. The cost is at most that many idle records (~0.6 MiB).
 * Lock held. */
static ebb_status pool_grow(void) {
  /* Chunks are never freed: a released record stays readable (magic 0) for stale handles.
   * They stay reachable through the free list, so leak checkers do not report them. */
  ebb_tensor_t *chunk = calloc(EBB__TENSOR_CHUNK, sizeof *chunk);
  if (!chunk) return EBB_ENOMEM;
  for (int i = 0; i < EBB__TENSOR_CHUNK; i++) ebb_list_insert_tail(&ebb__pool_free, &chunk[i].free_link);
  ebb__pool_nfree += EBB__TENSOR_CHUNK;
  return EBB_OK;
}

/* ---- the per-thread record cache --------------------------------------------------------------
 * Each thread takes records from the FIFO EBB__TENSOR_BATCH at a time and gives released ones
 * back in batches: one pool lock per batch instead of one per make and one per release, which
 * is most of what making and releasing a small tensor costs. Quarantine only grows: a record
 * waiting in a thread's release batch is not yet in the FIFO. The batches go back to the FIFO
 * when the thread exits (a pthread key's destructor), so no record is lost. Where the key cannot
 * be made, every thread takes the pool lock per record as before. */
#define EBB__TENSOR_BATCH 16

struct rec_cache {
  bool keyed; /* this thread's destructor is registered */
  int ntake, nput, nstor;
  ebb_tensor_t *take[EBB__TENSOR_BATCH]; /* past quarantine, for this thread's next makes */
  ebb_tensor_t *put[EBB__TENSOR_BATCH];  /* released, magic 0, not yet in the FIFO */
  struct ebb__storage *stor[EBB__TENSOR_BATCH]; /* storage records freed here, for the next makes */
  uint64_t serial_next, serial_end; /* storage serials reserved by this thread, [next, end) */
};
static _Thread_local struct rec_cache rec_tls;
static pthread_key_t rec_key;
static pthread_once_t rec_once = PTHREAD_ONCE_INIT;
static bool rec_key_ok;

/* Lock held. */
static void cache_flush_locked(struct rec_cache *c) {
  for (int i = 0; i < c->ntake; i++) ebb_list_insert_tail(&ebb__pool_free, &c->take[i]->free_link);
  for (int i = 0; i < c->nput; i++) ebb_list_insert_tail(&ebb__pool_free, &c->put[i]->free_link);
  ebb__pool_nfree += (size_t)(c->ntake + c->nput);
  c->ntake = c->nput = 0;
}

static void cache_thread_exit(void *arg) {
  struct rec_cache *c = arg;
  ebb__mutex_lock(&ebb__pool_lock);
  cache_flush_locked(c);
  ebb__mutex_unlock(&ebb__pool_lock);
  for (int i = 0; i < c->nstor; i++) free(c->stor[i]);
  c->nstor = 0;
  /* A tensor released later in this thread's exit (another key's destructor) registers the
   * cache again, and the next round of destructors flushes it. */
  c->keyed = false;
}

static void cache_key_make(void) { rec_key_ok = pthread_key_create(&rec_key, cache_thread_exit) == 0; }

/* A program may dlclose libebb while threads that made tensors live on: their exit must not
 * call a destructor that was unmapped with the library. */
__attribute__((destructor)) static void cache_key_delete(void) {
  if (rec_key_ok) pthread_key_delete(rec_key);
}

/* This thread's cache, or NULL where it has none (no key). */
static struct rec_cache *cache_get(void) {
  struct rec_cache *c = &rec_tls;
  if (EBB_LIKELY(c->keyed)) return c;
  pthread_once(&rec_once, cache_key_make);
  if (!rec_key_ok || pthread_setspecific(rec_key, c) != 0) return NULL;
  c->keyed = true;
  return c;
}

static void record_init(ebb_tensor_t *t) {
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
}

/* c: this thread's cache (cache_get), or NULL. */
static ebb_status record_get(const char *fn, struct rec_cache *c, ebb_tensor_t **out) {
  if (EBB_LIKELY(c && c->ntake)) {
    ebb_tensor_t *t = c->take[--c->ntake];
    record_init(t);
    *out = t;
    return EBB_OK;
  }
  ebb__mutex_lock(&ebb__pool_lock);
  if (ebb__pool_nfree <= EBB__TENSOR_QUARANTINE && pool_grow()) {
    ebb__mutex_unlock(&ebb__pool_lock);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for tensor handles", fn);
  }
  /* one for now, and up to a batch more for this thread while the FIFO has them past quarantine */
  struct ebb_list *n = ebb_list_pop_head(&ebb__pool_free);
  ebb__pool_nfree--;
  if (c) {
    /* the batch goes into take[] last first, so records leave the FIFO in its order */
    int k = 0;
    ebb_tensor_t *batch[EBB__TENSOR_BATCH];
    while (k < EBB__TENSOR_BATCH && ebb__pool_nfree > EBB__TENSOR_QUARANTINE) {
      batch[k++] = ebb_container_of(ebb_list_pop_head(&ebb__pool_free), ebb_tensor_t, free_link);
      ebb__pool_nfree--;
    }
    for (int i = 0; i < k; i++) c->take[i] = batch[k - 1 - i];
    c->ntake = k;
  }
  ebb__mutex_unlock(&ebb__pool_lock);
  ebb_tensor_t *t = ebb_container_of(n, ebb_tensor_t, free_link);
  record_init(t);
  *out = t;
  return EBB_OK;
}

static void record_put(ebb_tensor_t *t, struct rec_cache *c) {
  atomic_store_explicit(&t->magic, 0, memory_order_relaxed);
  atomic_fetch_sub_explicit(&ebb__live_tensors, 1, memory_order_relaxed);
  ebb__debug_live_add(-1);
  if (EBB_LIKELY(c && c->nput < EBB__TENSOR_BATCH)) {
    c->put[c->nput++] = t;
    return;
  }
  ebb__mutex_lock(&ebb__pool_lock);
  if (c) {
    for (int i = 0; i < c->nput; i++) ebb_list_insert_tail(&ebb__pool_free, &c->put[i]->free_link);
    ebb__pool_nfree += (size_t)c->nput;
    c->nput = 0;
  }
  ebb_list_insert_tail(&ebb__pool_free, &t->free_link);
  ebb__pool_nfree++;
  ebb__mutex_unlock(&ebb__pool_lock);
}

long ebb_tensor_live_count(void) { return atomic_load_explicit(&ebb__live_tensors, memory_order_relaxed); }

/* ---- geometry ------------------------------------------------------------------------------- */

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

void ebb__contig_strides(int ndim, const int64_t *shape, int64_t *strides) {
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

static void storage_put(struct ebb__storage *s, struct rec_cache *c) {
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
  if (EBB_LIKELY(c && c->nstor < EBB__TENSOR_BATCH)) c->stor[c->nstor++] = s;
  else free(s);
}

/* A zeroed storage record: this thread's last freed one, else a new one. */
static struct ebb__storage *storage_record(struct rec_cache *c) {
  if (EBB_LIKELY(c && c->nstor)) {
    struct ebb__storage *s = c->stor[--c->nstor];
    memset(s, 0, sizeof *s);
    return s;
  }
  return calloc(1, sizeof(struct ebb__storage));
}

/* The id of the live stream `s`: one lock-free check (streams_export.h); anything else takes the
 * public call for its message, prefixed with `fn`. Ids are never reused, handles are. */
ebb_status ebb__stream_id_of(const char *fn, ebb_stream_t *s, uint64_t *id) {
  int dev;
  if (EBB_LIKELY(ebb__stream_peek(s, id, &dev))) return EBB_OK;
  ebb_stream_info info;
  ebb_status st = ebb_stream_get_info(s, &info);
  if (st) return ebb__fail_in(fn, st);
  *id = info.id;
  return EBB_OK;
}

/* Storage serials: never reused (a record's address is, once it is freed). A thread with a
 * cache reserves them EBB__TENSOR_BATCH at a time. */
static _Atomic uint64_t storage_serials = 1;

static uint64_t serial_new(struct rec_cache *c) {
  if (!c) return atomic_fetch_add_explicit(&storage_serials, 1, memory_order_relaxed);
  if (EBB_UNLIKELY(c->serial_next == c->serial_end)) {
    c->serial_next = atomic_fetch_add_explicit(&storage_serials, EBB__TENSOR_BATCH, memory_order_relaxed);
    c->serial_end = c->serial_next + EBB__TENSOR_BATCH;
  }
  return c->serial_next++;
}

/* Device storage is allocated on the calling thread's current stream of the device and
 * remembers it (handle and id): that is the stream the arena orders its reuse on. */
static ebb_status storage_new(const char *fn, int device, size_t bytes, struct rec_cache *c, struct ebb__storage **out) {
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
    st = ebb__stream_id_of(fn, stream, &sid);
    if (st) return st;
  }
  struct ebb__storage *s = storage_record(c);
  if (!s) return ebb__fail(EBB_ENOMEM, "%s: no host memory for a storage record", fn);
  void *p = NULL;
  /* (the caller rewrites a failure's message: it knows the tensor's shape and dtype) */
  ebb_status st = device == EBB_DEVICE_CPU ? ebb_pageable_alloc(bytes, &p) : ebb_arena_alloc(device, bytes, stream, &p);
  if (st) {
    free(s); /* (a failure: the cache is not worth a branch here) */
    return st;
  }
  atomic_store_explicit(&s->refs, 1, memory_order_relaxed);
  s->serial = serial_new(c);
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
ebb_status ebb__storage_use(struct ebb__storage *s, ebb_stream_t *stream, uint64_t sid) {
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

/* "the CPU", "device 1". */
static const char *dev_str(int device, char *buf, size_t cap) {
  if (device == EBB_DEVICE_CPU) snprintf(buf, cap, "the CPU");
  else snprintf(buf, cap, "device %d", device);
  return buf;
}

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
  struct rec_cache *c = cache_get();
  st = storage_new(fn, device, bytes, c, &s);
  if (st) return storage_failed(fn, st, device, dt, ndim, shape, bytes);
  ebb_tensor_t *t;
  st = record_get(fn, c, &t);
  if (st) {
    storage_put(s, c);
    return st;
  }
  t->stor = s;
  t->dtype = dt;
  t->ndim = ndim;
  for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
  ebb__contig_strides(ndim, t->shape, t->strides);
  *out = t;
  return EBB_OK;
}

bool ebb__tensor_is_inference(const ebb_tensor_t *t) { return t->stor->inference; }
ebb_tensor_t *ebb__tensor_base(const ebb_tensor_t *t) { return t->base; }

bool ebb__tensor_overlaps(const ebb_tensor_t *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->strides[d] == 0 && t->shape[d] > 1) return true;
  return false;
}

ebb_status ebb__tensor_alias(const char *fn, const ebb_tensor_t *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset,
                             ebb_tensor_t **out) {
  ebb_tensor_t *v;
  ebb_status st = record_get(fn, cache_get(), &v);
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
  struct rec_cache *c = cache_get();
  record_put(t, c);
  storage_put(s, c);
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
  st = ebb__stream_id_of(fn, stream, &sid);
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
  st = ebb__storage_use(t->stor, stream, sid);
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

ebb_status ebb_tensor_dtype(const ebb_tensor_t *t, ebb_dtype *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_dtype", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_dtype: out is NULL; expected a place for the result");
  *out = t->dtype;
  return EBB_OK;
}

ebb_status ebb_tensor_device(const ebb_tensor_t *t, int *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_device", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_device: out is NULL; expected a place for the result");
  *out = t->stor->device;
  return EBB_OK;
}

ebb_status ebb_tensor_numel(const ebb_tensor_t *t, int64_t *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_numel", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_numel: out is NULL; expected a place for the result");
  *out = ebb__numel(t->shape, t->ndim);
  return EBB_OK;
}

ebb_status ebb_tensor_is_contiguous(const ebb_tensor_t *t, bool *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_is_contiguous", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_is_contiguous: out is NULL; expected a place for the result");
  *out = ebb__is_contiguous(t);
  return EBB_OK;
}

ebb_status ebb_tensor_version(const ebb_tensor_t *t, uint64_t *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_version", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_version: out is NULL; expected a place for the result");
  *out = atomic_load_explicit(&t->stor->version, memory_order_relaxed);
  return EBB_OK;
}

ebb_status ebb_tensor_data(const ebb_tensor_t *t, void **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_data", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_data: out is NULL; expected a place for the result");
  *out = ebb__tensor_ptr(t);
  return EBB_OK;
}

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
  ebb_status st = record_get("ebb__tensor_share", cache_get(), &v);
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
