/* copy.c: ebb_copy_async and the pinned staging rings behind pageable copies.
 *
 * The direction of a copy comes from ebb__drv_ptr_info on both pointers. Device and pinned memory
 * are copied by one driver call. Pageable host memory goes through the device's staging ring:
 * EBB_STAGING_CHUNKS pinned chunks of EBB_STAGING_CHUNK bytes (allocated on first use), each
 * followed by an event recorded after its last use, so a chunk is refilled only once the device
 * is done with it. Host-to-device copies fill a chunk on the calling thread; device-to-host ones
 * drain it into the caller's buffer from a host function in stream order, whose small record
 * comes from a free list. Peer copies order themselves against the other device's current
 * stream with pooled events. Before anything is enqueued, the copy hook a module above may
 * register (streams_export.h; alloc's records the copy's stream on arena and pinned blocks and
 * checks their bounds) sees both sides.
 *
 * Threading: a chunk's mutex is held for the whole of one use (wait for the previous one, fill,
 * enqueue, record), so two threads never share a chunk; the ring cursor is a relaxed atomic. The
 * record free list has a leaf lock, also taken by host functions on driver threads. The stream
 * is pinned (ebb__stream_pin) only while work is enqueued on it, never across the wait for a
 * chunk, so a release of it never waits for device work.
 */
#include <stdlib.h>
#include <string.h>

#include "streams_export.h"
#include "ebb/trace.h"
#include "streams_impl.h"

/* The copy hook of a module above (streams_export.h): NULL until alloc starts. */
static _Atomic(ebb__copy_hook_fn) ebb__copy_hook;

void ebb__copy_hook_set(ebb__copy_hook_fn fn) {
  /* release: pairs with the acquire load in copy_hooks; the hook's module is up. */
  atomic_store_explicit(&ebb__copy_hook, fn, memory_order_release);
}

/* Runs the copy hook on both sides of a copy that passed its own checks, before it is enqueued. */
static inline ebb_status copy_hooks(void *dst, const void *src, size_t bytes, ebb_stream_t *s) {
  /* acquire: pairs with the release store in ebb__copy_hook_set. */
  ebb__copy_hook_fn h = atomic_load_explicit(&ebb__copy_hook, memory_order_acquire);
  if (!h) return EBB_OK;
  ebb_status st = h(dst, bytes, true, s, s->id, s->device);
  if (!st) st = h((void *)(uintptr_t)src, bytes, false, s, s->id, s->device);
  return st;
}

ebb_status ebb__copy_side_check(void *ptr, size_t bytes, bool is_dst, ebb_stream_t *s) {
  /* acquire: pairs with the release store in ebb__copy_hook_set. */
  ebb__copy_hook_fn h = atomic_load_explicit(&ebb__copy_hook, memory_order_acquire);
  return h && bytes ? h(ptr, bytes, is_dst, s, s->id, s->device) : EBB_OK;
}

void ebb__copy_start(struct ebb__dev *d) {
  for (unsigned i = 0; i < ebb__streams_state.nchunks; i++) ebb__mutex_init(&d->chunks[i].mu, "streams.staging", EBB_RANK_STAGING);
  ebb__mutex_init(&d->rec_mu, "streams.host_copy", EBB_RANK_LEAF);
  ebb__slot_pool_init(&d->host_copies, sizeof(struct ebb__host_copy), 0);
  atomic_store_explicit(&d->abandoned, NULL, memory_order_relaxed);
}

/* Runs after the module synchronised every device: no chunk or record is in flight. */
void ebb__copy_teardown(struct ebb__dev *d) {
  for (unsigned i = 0; i < ebb__streams_state.nchunks; i++) {
    struct ebb__chunk *c = &d->chunks[i];
    /* Best effort at teardown: the devices are idle; what fails to go is leaked. */
    if (c->mem) (void)ebb__drv_pinned_free(d->ordinal, c->mem);
    if (c->ev) (void)ebb__drv_event_destroy(d->ordinal, c->ev);
    c->mem = NULL;
    c->ev = NULL;
    c->used = false;
    ebb__mutex_destroy(&c->mu);
  }
  for (struct ebb__abandoned *x = atomic_load_explicit(&d->abandoned, memory_order_relaxed), *next; x; x = next) {
    next = x->next;
    ebb__drv_pinned_free(d->ordinal, x->mem); /* (best effort, teardown) */
    free(x);
  }
  atomic_store_explicit(&d->abandoned, NULL, memory_order_relaxed);
  ebb__slot_pool_fini(&d->host_copies);
  ebb__mutex_destroy(&d->rec_mu);
}

/* ---- staging ------------------------------------------------------------------------------- */

/* Takes the next chunk of the ring, locked and free: allocated if new, else its previous use
 * complete (waiting for it when not, which stats count). */
static ebb_status chunk_claim(struct ebb__dev *d, struct ebb__chunk **out) {
  uint32_t i = atomic_fetch_add_explicit(&d->chunk_next, 1, memory_order_relaxed) % ebb__streams_state.nchunks;
  struct ebb__chunk *c = &d->chunks[i];
  ebb__mutex_lock(&c->mu);
  ebb_status st = EBB_OK;
  if (!c->mem) st = ebb__drv_pinned_alloc(d->ordinal, ebb__streams_state.chunk_bytes, &c->mem);
  if (!st && !c->ev) st = ebb__drv_event_create(d->ordinal, false, &c->ev);
  if (!st && c->used) {
    bool done = false;
    st = ebb__drv_event_query(d->ordinal, c->ev, &done);
    if (!st && !done) {
      atomic_fetch_add_explicit(&d->stats.staging_waits, 1, memory_order_relaxed);
      st = ebb__drv_event_synchronize(d->ordinal, c->ev);
    }
  }
  if (st) {
    ebb__mutex_unlock(&c->mu);
    return st;
  }
  *out = c;
  return EBB_OK;
}

/* Ends a use of `c` on stream `s` whose enqueue returned `st`: records the chunk's event after
 * whatever was enqueued and unlocks. If the record fails, no event marks the end of this use:
 * the stream is drained before anyone may reuse the chunk. If that wait fails too, the work may
 * still read or write the chunk, so its memory is abandoned (never reused, freed at teardown
 * after every device was waited for; the next claim allocates a new one). Either way the record's failure is the copy's answer (the wait
 * muted, so the message names the record). */
static ebb_status chunk_finish(struct ebb__dev *d, struct ebb__chunk *c, ebb_stream_t *s, size_t bytes, ebb_status st) {
  ebb_status rs = ebb__drv_event_record(s->device, c->ev, s->cu);
  if (EBB_LIKELY(rs == EBB_OK)) {
    c->used = true;
  } else {
    ebb__fail_mute(true);
    ebb_status ws = ebb__drv_stream_synchronize(s->device, s->cu);
    ebb__fail_mute(false);
    if (ws) {
      struct ebb__abandoned *x = malloc(sizeof *x);
      if (x) { /* (without host memory for the note, the chunk's memory leaks: still never reused) */
        x->mem = c->mem;
        x->next = atomic_load_explicit(&d->abandoned, memory_order_relaxed);
        /* relaxed: teardown reads the stack after every device and thread is done with it */
        while (!atomic_compare_exchange_weak_explicit(&d->abandoned, &x->next, x, memory_order_relaxed, memory_order_relaxed)) {
        }
      }
      c->mem = NULL;
    }
    c->used = false; /* drained, or a new chunk: no earlier use to wait for */
  }
  ebb__mutex_unlock(&c->mu);
  if (!st && !rs) atomic_fetch_add_explicit(&d->stats.staged_bytes, bytes, memory_order_relaxed);
  return st ? st : rs;
}

/* Host function of a staged device-to-pageable copy: the chunk holds the data by now. */
static void host_copy_run(void *user) {
  struct ebb__host_copy *r = user;
  struct ebb__dev *d = r->dev;
  memcpy(r->dst, r->src, r->bytes);
  ebb__mutex_lock(&d->rec_mu);
  ebb__slot_give(&d->host_copies, r);
  ebb__mutex_unlock(&d->rec_mu);
}

/* Enqueues chunk -> dst as a host function on `s`. On failure the record is returned here: the
 * function never runs, so nothing else would give it back. */
static ebb_status enqueue_host_copy(struct ebb__dev *d, void *dst, const void *chunk, size_t n, ebb_stream_t *s) {
  ebb__mutex_lock(&d->rec_mu);
  struct ebb__host_copy *r = ebb__slot_take(&d->host_copies);
  ebb__mutex_unlock(&d->rec_mu);
  if (!r)
    return ebb__fail(EBB_ENOMEM, "ebb_copy_async: out of host memory for a staging record on stream %llu (device %d)",
                     (unsigned long long)s->id, s->device);
  r->dst = dst;
  r->src = chunk;
  r->bytes = n;
  r->dev = d;
  ebb_status st = ebb__drv_launch_host_func(s->device, s->cu, host_copy_run, r);
  if (st) {
    ebb__mutex_lock(&d->rec_mu);
    ebb__slot_give(&d->host_copies, r);
    ebb__mutex_unlock(&d->rec_mu);
  }
  return st;
}

/* Copies through the ring chunk by chunk. To the device: fill the chunk here, then chunk ->
 * dst on `s`. From the device: src -> chunk on `s`, then a host function drains it into dst.
 * Not from a caller's host function: a chunk may be free only after work queued behind that
 * very function, and the claim waits for it on the host (a deadlock). A release of `s` racing
 * the copy ends it with EBB_EFREED after the chunks already enqueued. */
static ebb_status stage(struct ebb__dev *d, char *dst, const char *src, size_t bytes, bool to_device, ebb_stream_t *s) {
  static const char fn[] = "ebb_copy_async";
  for (size_t off = 0; off < bytes;) {
    size_t n = bytes - off < ebb__streams_state.chunk_bytes ? bytes - off : ebb__streams_state.chunk_bytes;
    struct ebb__chunk *c = NULL;
    ebb_status st = chunk_claim(d, &c);
    if (st) return st;
    st = ebb__stream_pin(fn, s);
    if (st) { /* released meanwhile: the chunk was not used, its state is unchanged */
      ebb__mutex_unlock(&c->mu);
      return st;
    }
    if (to_device) {
      memcpy(c->mem, src + off, n);
      st = ebb__drv_memcpy_async(s->device, dst + off, c->mem, n, s->cu);
    } else {
      st = ebb__drv_memcpy_async(s->device, c->mem, src + off, n, s->cu);
      if (!st) st = enqueue_host_copy(d, dst + off, c->mem, n, s);
    }
    st = chunk_finish(d, c, s, n, st);
    ebb__stream_unpin(s);
    if (st) return st;
    off += n;
  }
  return EBB_OK;
}

/* ---- ebb_copy_async ------------------------------------------------------------------------ */

static const char *memtype_name(ebb_mem_type t) {
  return t == EBB_MEMTYPE_DEVICE ? "device" : t == EBB_MEMTYPE_PINNED ? "pinned host" : "pageable host";
}

/* Device A -> device B on a stream of A or B. The other device's current stream may still be
 * writing src or reading dst: `s` waits for it first, and it waits for the copy after. */
static ebb_status copy_peer(void *dst, const void *src, size_t bytes, int dd, int sd, ebb_stream_t *s) {
  static const char fn[] = "ebb_copy_async";
  if (s->device != sd && s->device != dd)
    return ebb__fail(EBB_EDEVICE, "%s: peer copy from device %d to device %d on stream %llu of device %d; expected a stream of device %d or %d",
                     fn, sd, dd, (unsigned long long)s->id, s->device, sd, dd);
  ebb_stream_t *other = NULL;
  ebb_status st = ebb__stream_current_of(fn, s->device == sd ? dd : sd, &other);
  if (!st) st = ebb__stream_pin(fn, other); /* this thread's current stream, released by another? */
  if (st) return st;
  st = ebb__stream_pin(fn, s);
  if (!st) {
    st = copy_hooks(dst, src, bytes, s);
    if (!st) st = ebb__stream_order(s, other);
    if (!st) st = ebb__drv_memcpy_async(s->device, dst, src, bytes, s->cu);
    if (!st) st = ebb__stream_order(other, s);
    ebb__stream_unpin(s);
  }
  ebb__stream_unpin(other);
  return st;
}

/* ebb_copy_async; *what names the copy for the trace (set when it is enqueued). */
static ebb_status copy_async(void *dst, const void *src, size_t bytes, ebb_stream_t *s, const char **what) {
  static const char fn[] = "ebb_copy_async";
  ebb_status st = ebb__check_stream(fn, s);
  if (st) return st;
  /* Before anything else, which would call the driver (the pointers' kinds, a peer's stream):
   * a pageable copy's staging could also wait on the host for work queued behind the host
   * function itself. */
  if (EBB_UNLIKELY(ebb__tls_in_host_fn)) return ebb__host_fn_refused(fn, s);
  if (bytes == 0) return EBB_OK; /* empty tensors may carry NULL data pointers */
  if (!dst || !src)
    return ebb__fail(EBB_EINVAL, "%s: %s is NULL for a copy of %zu bytes; expected host or device memory", fn, !dst ? "dst" : "src", bytes);
  uintptr_t d0 = (uintptr_t)dst, s0 = (uintptr_t)src;
  if (d0 + bytes < d0 || s0 + bytes < s0)
    return ebb__fail(EBB_EINVAL, "%s: %zu bytes from %p or to %p run past the end of the address space", fn, bytes, src, dst);
  if (d0 < s0 + bytes && s0 < d0 + bytes)
    return ebb__fail(EBB_EINVAL, "%s: dst [%p, %p) and src [%p, %p) overlap; expected disjoint ranges (copy through a temporary)", fn,
                     dst, (void *)(d0 + bytes), src, (void *)(s0 + bytes));
  ebb_ptr_info di, si;
  st = ebb__drv_ptr_info(s->device, dst, &di);
  if (!st) st = ebb__drv_ptr_info(s->device, src, &si);
  if (st) return st;
  if (di.type != EBB_MEMTYPE_DEVICE && si.type != EBB_MEMTYPE_DEVICE)
    return ebb__fail(EBB_EINVAL, "%s: %zu bytes from %s memory %p to %s memory %p is a host to host copy; use memcpy", fn, bytes,
                     memtype_name(si.type), src, memtype_name(di.type), dst);
  if (di.type == EBB_MEMTYPE_DEVICE && si.type == EBB_MEMTYPE_DEVICE && di.device != si.device) {
    *what = "copy peer";
    return copy_peer(dst, src, bytes, di.device, si.device, s);
  }
  /* One device is involved; the copy runs on its stream so it orders with the device's work. */
  int dev = di.type == EBB_MEMTYPE_DEVICE ? di.device : si.device;
  if (s->device != dev)
    return ebb__fail(EBB_EDEVICE, "%s: copy from %s memory %p to %s memory %p involves device %d but stream %llu is on device %d; use a stream of device %d",
                     fn, memtype_name(si.type), src, memtype_name(di.type), dst, dev, (unsigned long long)s->id, s->device, dev);
  if ((st = copy_hooks(dst, src, bytes, s))) return st;
  struct ebb__dev *d = &ebb__streams_state.dev[dev];
  if (si.type == EBB_MEMTYPE_PAGEABLE || di.type == EBB_MEMTYPE_PAGEABLE) {
    *what = si.type == EBB_MEMTYPE_PAGEABLE ? "copy H2D (staged)" : "copy D2H (staged)";
    return stage(d, dst, src, bytes, si.type == EBB_MEMTYPE_PAGEABLE, s);
  }
  *what = si.type != EBB_MEMTYPE_DEVICE ? "copy H2D" : di.type != EBB_MEMTYPE_DEVICE ? "copy D2H" : "copy D2D";
  st = ebb__stream_pin(fn, s);
  if (st) return st;
  st = ebb__drv_memcpy_async(s->device, dst, src, bytes, s->cu);
  ebb__stream_unpin(s);
  return st;
}

/* Tracing: the copy as a span of its bytes on the stream's track, from the call's entry to its
 * return (the host's enqueue, staging included; not the device's transfer). */
static EBB_COLD ebb_status copy_traced(void *dst, const void *src, size_t bytes, ebb_stream_t *s) {
  uint64_t key = ebb__stream_trace_key(s), t0 = ebb__now_ns();
  const char *what = NULL;
  ebb_status st = copy_async(dst, src, bytes, s, &what);
  if (!st && key && what) {
    ebb_trace_span r = {.name = what, .start_ns = t0, .end_ns = ebb__now_ns(), .device = s->device, .stream = key,
                        .kind = EBB_TRACE_SPAN, .args = EBB_TRACE_ARG_BYTES, .bytes = bytes};
    (void)ebb_trace_record(&r);
  }
  return st;
}

ebb_status ebb_copy_async(void *dst, const void *src, size_t bytes, ebb_stream_t *s) {
  if (EBB_UNLIKELY(EBB_TRACE_ON())) return copy_traced(dst, src, bytes, s);
  const char *what;
  return copy_async(dst, src, bytes, s, &what);
}
