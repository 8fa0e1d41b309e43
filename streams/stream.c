/* stream.c: streams of ebb/stream.h, the module's lifecycle and the slot pools under every handle.
 *
 * Owns: the module state ebb__streams_state (started by the first ebb_init, torn down by the module's stop
 * at the last ebb_shutdown), per device the default stream, the stream
 * pools (EBB_STREAM_POOL_SIZE per priority, created lazily, handed out round-robin), the slots of
 * caller-owned streams, and each thread's current stream per device.
 *
 * Threading: immortal streams are published once by compare-and-swap and read lock-free; slot
 * pools are guarded by their device's stream_mu, taken only around free-list operations (never
 * around a driver call). A call that uses a caller-owned stream's driver stream pins it
 * (ebb__stream_pin), and its release waits for the pins before destroying it, so a call racing
 * the release either issues its work first or answers EBB_EFREED. The current stream and the
 * innermost guard are thread-local; the current stream is validated by the slot generation and
 * the module epoch, so a released stream or one from an earlier ebb_init is never handed back.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "streams_export.h"
#include "ebb/trace.h"
#include "streams_impl.h"

struct ebb__streams ebb__streams_state;

/* Ids of streams and events: process-unique, never reset, so messages and traces across
 * ebb_init cycles never confuse two handles. */
static _Atomic uint64_t ebb__next_id = 1;
/* Bumped by every teardown; a thread-local current stream set under another epoch is stale. */
static _Atomic uint64_t ebb__epoch = 1;

uint64_t ebb__new_id(void) { return atomic_fetch_add_explicit(&ebb__next_id, 1, memory_order_relaxed); }

/* ---- slot pools ---------------------------------------------------------------------------- */

void ebb__slot_pool_init(struct ebb__slot_pool *p, size_t obj_size, size_t quarantine) {
  /* A pool set up by an earlier ebb_init keeps its slabs (see ebb__slot_pool_fini). */
  if (p->slabs && p->obj_size == obj_size) {
    p->quarantine = quarantine;
    return;
  }
  ebb_list_init(&p->free);
  p->nfree = 0;
  p->quarantine = quarantine;
  p->obj_size = obj_size;
  p->slabs = NULL;
}

void *ebb__slot_take(struct ebb__slot_pool *p) {
  struct ebb__slot *s;
  if (p->nfree > p->quarantine) {
    /* FIFO: the slot released longest ago, so a recent stale handle still reads as released. */
    s = ebb_container_of(ebb_list_pop_head(&p->free), struct ebb__slot, node);
    p->nfree--;
    atomic_fetch_add_explicit(&s->gen, 1, memory_order_relaxed);
    return s;
  }
  struct ebb__slab *sl = p->slabs;
  if (!sl || sl->used == EBB__SLAB_OBJECTS) {
    sl = malloc(sizeof *sl + p->obj_size * EBB__SLAB_OBJECTS);
    if (!sl) return NULL;
    sl->next = p->slabs;
    sl->used = 0;
    p->slabs = sl;
  }
  s = (struct ebb__slot *)(void *)(sl->mem + p->obj_size * sl->used++);
  memset(s, 0, p->obj_size);
  ebb_list_init(&s->node);
  atomic_store_explicit(&s->gen, 1, memory_order_relaxed);
  return s;
}

/* The magic is set here too, so internal callers that never published the slot (a failed
 * creation, a lost publication race) leave it in the same state as a released handle. */
void ebb__slot_give(struct ebb__slot_pool *p, void *slot) {
  struct ebb__slot *s = slot;
  atomic_store_explicit(&s->magic, EBB__SLOT_FREED, memory_order_relaxed);
  ebb_list_insert_tail(&p->free, &s->node);
  p->nfree++;
}

/* Visits slabs newest first and every carved slot in each, free or live: teardown decides by
 * the magic what still owns a driver object. */
void ebb__slot_pool_each(struct ebb__slot_pool *p, void (*fn)(void *slot, void *ctx), void *ctx) {
  for (struct ebb__slab *sl = p->slabs; sl; sl = sl->next)
    for (size_t i = 0; i < sl->used; i++) fn(sl->mem + p->obj_size * i, ctx);
}

/* Slabs are kept for the life of the process: a handle from before a completed ebb_shutdown
 * stays readable memory and reads EBB_EFREED after it (and after a new ebb_init), instead of
 * pointing into freed memory. Every slot ever carved goes back to the free list, marked freed;
 * the next ebb_init reuses them (ebb__slot_pool_init keeps the slabs). */
void ebb__slot_pool_fini(struct ebb__slot_pool *p) {
  ebb_list_init(&p->free);
  p->nfree = 0;
  for (struct ebb__slab *sl = p->slabs; sl; sl = sl->next) {
    for (size_t i = 0; i < sl->used; i++) {
      struct ebb__slot *s = (struct ebb__slot *)(void *)(sl->mem + p->obj_size * i);
      /* A handle still live here (a pool or default stream) ends with the session: its stale
       * message says so (EBB__GONE_AT_SHUTDOWN), not that a release freed it. */
      if (atomic_load_explicit(&s->magic, memory_order_relaxed) != EBB__SLOT_FREED)
        atomic_store_explicit(&s->gone_device, EBB__GONE_AT_SHUTDOWN, memory_order_relaxed);
      atomic_store_explicit(&s->magic, EBB__SLOT_FREED, memory_order_relaxed);
      ebb_list_init(&s->node);
      ebb_list_insert_tail(&p->free, &s->node);
      p->nfree++;
    }
  }
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

/* ---- configuration: checked by the first ebb_init (runtime_export.h), used by the start ---- */

/* An integer in [lo, hi]; NULL (unset) gives `def`. */
static bool env_size(const char *v, size_t def, size_t lo, size_t hi, size_t *out, char *expected, size_t len) {
  if (!v) {
    *out = def;
    return true;
  }
  char *end = NULL;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (errno || end == v || *end || v[0] == '-' || x < lo || x > hi) {
    snprintf(expected, len, "an integer in [%zu, %zu] (unset: %zu)", lo, hi, def);
    return false;
  }
  *out = (size_t)x;
  return true;
}

static size_t ebb__conf_pool, ebb__conf_chunk, ebb__conf_nchunks;

static bool check_pool_size(const char *v, char *expected, size_t len) {
  return env_size(v, EBB__POOL_SIZE_DEFAULT, 1, EBB__POOL_SIZE_MAX, &ebb__conf_pool, expected, len);
}
static bool check_chunk(const char *v, char *expected, size_t len) {
  return env_size(v, EBB__STAGING_CHUNK_DEFAULT, EBB__STAGING_CHUNK_MIN, EBB__STAGING_CHUNK_MAX, &ebb__conf_chunk, expected, len);
}
static bool check_nchunks(const char *v, char *expected, size_t len) {
  return env_size(v, EBB__STAGING_CHUNKS_DEFAULT, 1, EBB__STAGING_CHUNKS_MAX, &ebb__conf_nchunks, expected, len);
}

static const ebb__config_var ebb__streams_vars[] = {
  {"EBB_STREAM_POOL_SIZE", check_pool_size},
  {"EBB_STAGING_CHUNK", check_chunk},
  {"EBB_STAGING_CHUNKS", check_nchunks},
};

static void streams_teardown(void *user);

static void dev_start(struct ebb__dev *d, int ordinal, const ebb_dev_caps *caps) {
  /* The slot pools keep their slabs across ebb_init cycles (ebb__slot_pool_fini); they are put
   * back in place, at the same address their lists point to. */
  struct ebb__slot_pool keep[4] = {d->stream_slots, d->event_slots, d->host_copies, d->host_calls};
  memset(d, 0, sizeof *d);
  d->stream_slots = keep[0];
  d->event_slots = keep[1];
  d->host_copies = keep[2];
  d->host_calls = keep[3];
  d->ordinal = ordinal;
  d->prio_value[EBB_PRIO_LOW] = caps->prio_least;
  d->prio_value[EBB_PRIO_HIGH] = caps->prio_greatest;
  ebb__mutex_init(&d->stream_mu, "streams.slots", EBB_RANK_STREAM_POOL);
  ebb__mutex_init(&d->tomb_mu, "streams.tombs", EBB_RANK_LEAF);
  ebb__slot_pool_init(&d->stream_slots, sizeof(struct ebb_stream), EBB__SLOT_QUARANTINE);
  ebb__mutex_init(&d->call_mu, "streams.host_calls", EBB_RANK_LEAF);
  ebb__slot_pool_init(&d->host_calls, sizeof(struct ebb__host_call), 0);
  ebb__events_start(d);
  ebb__copy_start(d);
}

/* Takes the configuration ebb_init checked, the devices and their priority ranges. Runs with
 * phase == STARTING, owned by this thread. */
static ebb_status streams_start(const char *fn) {
  (void)fn;
  size_t pool = ebb__conf_pool, chunk = ebb__conf_chunk, nchunks = ebb__conf_nchunks;
  int ndev = 0;
  ebb_status st = ebb_dev_count(&ndev);
  if (st) return st;
  ebb_dev_caps caps[EBB_MAX_DEVICES];
  for (int i = 0; i < ndev; i++) {
    st = ebb_dev_get_caps(i, &caps[i]);
    if (st) return st;
  }
  ebb__streams_state.ndev = ndev;
  ebb__streams_state.pool_size = (unsigned)pool;
  ebb__streams_state.chunk_bytes = chunk;
  ebb__streams_state.nchunks = (unsigned)nchunks;
  for (int i = 0; i < ndev; i++) dev_start(&ebb__streams_state.dev[i], i, &caps[i]);
  return EBB_OK;
}

ebb_status ebb__streams_enter(const char *fn) {
  if (EBB_UNLIKELY(!ebb_is_initialized()))
    return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init first", fn);
  /* acquire: pairs with the release store of EBB__UP below, so the device state is visible. */
  if (EBB_LIKELY(atomic_load_explicit(&ebb__streams_state.phase, memory_order_acquire) == EBB__UP)) return EBB_OK;
  for (;;) {
    int ph = EBB__DOWN;
    /* acquire on success: pairs with the teardown's release store of EBB__DOWN, so this start
     * sees the state the last teardown left; on failure, with the release store of EBB__UP. */
    if (atomic_compare_exchange_strong_explicit(&ebb__streams_state.phase, &ph, EBB__STARTING, memory_order_acquire,
                                                memory_order_acquire))
      break;
    if (ph == EBB__UP) return EBB_OK;
    ebb__cpu_relax(); /* another thread is starting the module: a few microseconds */
  }
  ebb_status st = streams_start(fn);
  /* release: publishes the started state (or the undone one) to the acquires above. */
  atomic_store_explicit(&ebb__streams_state.phase, st ? EBB__DOWN : EBB__UP, memory_order_release);
  return st;
}

static void stream_slot_destroy(void *slot, void *ctx) {
  (void)ctx;
  struct ebb_stream *s = slot;
  /* Best effort at teardown: the devices are idle, and a driver stream that fails to go is
   * released with the primary context after the modules stop. */
  if (atomic_load_explicit(&s->slot.magic, memory_order_relaxed) == EBB__STREAM_LIVE && s->cu)
    (void)ebb__drv_stream_destroy(s->device, s->cu);
}

/* The module's stop (run by the last ebb_shutdown once no caller handle is live): waits for
 * every device, then destroys every driver object the module made and marks every slot freed.
 * The driver is still loaded. */
static void streams_teardown(void *user) {
  (void)user;
  /* acquire: pairs with the release store of EBB__UP (the devices' state is visible). */
  if (atomic_load_explicit(&ebb__streams_state.phase, memory_order_acquire) != EBB__UP) return;
  /* Best effort: a device whose wait fails is in its error state (its work will not run) and
   * teardown goes on; the primary context's release ends what is left. */
  for (int i = 0; i < ebb__streams_state.ndev; i++) (void)ebb_dev_synchronize(i);
  for (int i = 0; i < ebb__streams_state.ndev; i++) {
    struct ebb__dev *d = &ebb__streams_state.dev[i];
    /* The devices are idle: every tomb's work is done, its event goes back before the pools go. */
    for (unsigned t = 0; t < d->ntombs; t++)
      if (d->tombs[t].ev) ebb__drv_event_put(d, false, d->tombs[t].ev);
    free(d->tombs);
    d->tombs = NULL;
    d->ntombs = d->captombs = 0;
    ebb__mutex_destroy(&d->tomb_mu);
    ebb__copy_teardown(d);
    ebb__slot_pool_fini(&d->host_calls); /* the devices are idle: every host function has run */
    ebb__mutex_destroy(&d->call_mu);
    ebb__events_teardown(d);
    ebb__slot_pool_each(&d->stream_slots, stream_slot_destroy, NULL);
    ebb__slot_pool_fini(&d->stream_slots);
    ebb__mutex_destroy(&d->stream_mu);
  }
  ebb__streams_state.ndev = 0;
  atomic_fetch_add_explicit(&ebb__epoch, 1, memory_order_relaxed);
  /* release: pairs with the acquire CAS of the next start (see ebb__streams_enter). */
  atomic_store_explicit(&ebb__streams_state.phase, EBB__DOWN, memory_order_release);
}

static ebb_status streams_module_start(void) { return ebb__streams_enter("ebb_init"); }
static void streams_module_stop(void) { streams_teardown(NULL); }

void ebb__events_live_add(long delta) { atomic_fetch_add_explicit(&ebb__streams_state.live_events, delta, memory_order_relaxed); }
void ebb__streams_live_add(long delta) { atomic_fetch_add_explicit(&ebb__streams_state.live_streams, delta, memory_order_relaxed); }

static int streams_count(ebb__live_count *out, int max) {
  if (max < 2) return 0;
  out[0] = (ebb__live_count){"streams (ebb_stream_create)", atomic_load_explicit(&ebb__streams_state.live_streams, memory_order_relaxed)};
  out[1] = (ebb__live_count){"events (ebb_event_create)", atomic_load_explicit(&ebb__streams_state.live_events, memory_order_relaxed)};
  return 2;
}

const ebb__module_desc ebb__module_streams = {
  .name = "streams",
  .layer = EBB__LAYER_STREAMS,
  .vars = ebb__streams_vars,
  .nvars = (int)EBB_ARRAY_LEN(ebb__streams_vars),
  .start = streams_module_start,
  .stop = streams_module_stop,
  .count = streams_count,
};

/* ---- checks -------------------------------------------------------------------------------- */

/* ndev is read plainly: it is published with the module's start (the acquire in
 * ebb__streams_enter) and fixed until teardown. */
ebb_status ebb__check_device(const char *fn, int device) {
  if (EBB_UNLIKELY(device < 0 || device >= ebb__streams_state.ndev))
    return ebb__fail(EBB_EDEVICE, "%s: device %d is out of range; expected 0 <= device < %d", fn, device, ebb__streams_state.ndev);
  return EBB_OK;
}

ebb_status ebb__check_stream(const char *fn, const ebb_stream_t *s) {
  ebb_status st = ebb__streams_enter(fn);
  if (EBB_UNLIKELY(st)) return st;
  if (EBB_UNLIKELY(!s))
    return ebb__fail(EBB_EINVAL, "%s: stream is NULL; expected one from ebb_stream_default, ebb_stream_from_pool or ebb_stream_create", fn);
  /* acquire: pairs with the release store of EBB__STREAM_LIVE in stream_new, so the
   * fields are those of the stream the magic announces. */
  uint32_t m = atomic_load_explicit(&s->slot.magic, memory_order_acquire);
  if (EBB_LIKELY(m == EBB__STREAM_LIVE)) return EBB_OK;
  if (m == EBB__SLOT_FREED || m == EBB__STREAM_RELEASING) return ebb__stream_freed(fn, s);
  return ebb__fail(EBB_EINVAL, "%s: %p is %s; expected a stream handle", fn, (const void *)s,
                   m == EBB__EVENT_LIVE ? "an event, not a stream" : "not a stream handle");
}

/* The slot's id and device fields belong to whichever stream holds it now, and a new stream may
 * be writing them: the message names the released stream from the slot's gone_ fields, which its
 * release wrote before the magic left LIVE (the callers' acquire load of the magic pairs with
 * that release's CAS). */
ebb_status ebb__stream_freed(const char *fn, const ebb_stream_t *s) {
  if (atomic_load_explicit(&s->slot.gone_device, memory_order_relaxed) == EBB__GONE_AT_SHUTDOWN)
    return ebb__fail(EBB_EFREED, "%s: stream handle %p is from before the last completed ebb_shutdown, which ended it; expected a "
                     "stream of this ebb_init (ebb_stream_current, ebb_stream_create, ...)", fn, (const void *)s);
  return ebb__fail(EBB_EFREED, "%s: stream %llu (device %d) was released by ebb_stream_release; expected a live stream", fn,
                   (unsigned long long)atomic_load_explicit(&s->slot.gone_id, memory_order_relaxed),
                   atomic_load_explicit(&s->slot.gone_device, memory_order_relaxed));
}

static ebb_status check_out(const char *fn, const void *out, const char *what) {
  if (EBB_UNLIKELY(!out)) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a pointer to %s to fill", fn, what);
  return EBB_OK;
}

static ebb_status check_prio(const char *fn, ebb_stream_prio prio) {
  if (EBB_UNLIKELY(prio != EBB_PRIO_LOW && prio != EBB_PRIO_HIGH))
    return ebb__fail(EBB_EINVAL, "%s: priority %d is not valid; expected EBB_PRIO_LOW (0) or EBB_PRIO_HIGH (1)", fn, (int)prio);
  return EBB_OK;
}

/* The common prologue of calls taking (device, out). */
static ebb_status enter_dev(const char *fn, int device, const void *out) {
  ebb_status st = ebb__streams_enter(fn);
  if (!st) st = ebb__check_device(fn, device);
  if (!st) st = check_out(fn, out, "an ebb_stream_t *");
  return st;
}

/* ---- creation ------------------------------------------------------------------------------ */

/* Names the stream's trace track after its id, whether tracing is on or not (a stream made before
 * ebb_trace_enable is traced later under its name). Quiet: a name that cannot be stored leaves
 * the track named by its handle. */
static void trace_name(const ebb_stream_t *s) {
  static const char *const kinds[] = {"default", "pool", "user"};
  char name[64];
  snprintf(name, sizeof name, "stream %llu (device %d, %s)", (unsigned long long)s->id, s->device, kinds[s->kind]);
  ebb__fail_mute(true);
  (void)ebb_trace_stream_name(s->device, (uint64_t)(uintptr_t)s->cu, name);
  ebb__fail_mute(false);
}

uint64_t ebb__stream_trace_key(ebb_stream_t *s) {
  ebb__fail_mute(true);
  uint64_t key = 0;
  if (!ebb__stream_pin("ebb__stream_trace_key", s)) {
    key = (uint64_t)(uintptr_t)s->cu;
    ebb__stream_unpin(s);
  }
  ebb__fail_mute(false);
  return key;
}

/* Creates the driver stream first, with no lock held, then takes a slot for it. */
static ebb_status stream_new(const char *fn, struct ebb__dev *d, ebb_stream_prio prio, enum ebb__stream_kind kind,
                                  ebb_stream_t **out) {
  struct CUstream_st *cu = NULL;
  ebb_status st = ebb__drv_stream_create(d->ordinal, d->prio_value[prio], &cu);
  if (st) return st;
  atomic_fetch_add_explicit(&d->stats.streams_created, 1, memory_order_relaxed);
  ebb__mutex_lock(&d->stream_mu);
  struct ebb_stream *s = ebb__slot_take(&d->stream_slots);
  ebb__mutex_unlock(&d->stream_mu);
  if (!s) {
    (void)ebb__drv_stream_destroy(d->ordinal, cu); /* best effort: the call fails with ENOMEM, the stream had no work */
    return ebb__fail(EBB_ENOMEM, "%s: out of host memory for a stream slot of device %d", fn, d->ordinal);
  }
  s->id = ebb__new_id();
  s->device = d->ordinal;
  s->prio = prio;
  s->kind = kind;
  s->cu = cu;
  trace_name(s);
  atomic_fetch_and_explicit(&s->hold, EBB__HOLD_COUNT, memory_order_relaxed); /* (published by the magic's release store) */
  /* release: pairs with the acquire in ebb__check_stream (fields before the live magic). */
  atomic_store_explicit(&s->slot.magic, EBB__STREAM_LIVE, memory_order_release);
  *out = s;
  return EBB_OK;
}

/* Destroys the driver stream (the driver finishes its pending work first) and returns the slot,
 * whose magic the caller has already turned to EBB__SLOT_FREED (with no pin left on it). */
static ebb_status stream_retire(struct ebb__dev *d, ebb_stream_t *s) {
  ebb_status st = ebb__drv_stream_destroy(s->device, s->cu);
  s->cu = NULL;
  ebb__mutex_lock(&d->stream_mu);
  ebb__slot_give(&d->stream_slots, s);
  ebb__mutex_unlock(&d->stream_mu);
  return st;
}

/* An immortal stream held in `cell`, created on first use. Two threads racing both create one;
 * the loser of the compare-and-swap retires its own. */
static ebb_status stream_lazy(const char *fn, struct ebb__dev *d, _Atomic(ebb_stream_t *) *cell, ebb_stream_prio prio,
                                   enum ebb__stream_kind kind, ebb_stream_t **out) {
  /* acquire: pairs with the release half of the CAS below (a published stream is complete). */
  ebb_stream_t *s = atomic_load_explicit(cell, memory_order_acquire);
  if (EBB_LIKELY(s)) {
    *out = s;
    return EBB_OK;
  }
  ebb_stream_t *mine = NULL;
  ebb_status st = stream_new(fn, d, prio, kind, &mine);
  if (st) return st;
  /* acq_rel: release publishes `mine`; acquire (also on failure) pairs with the winner's. */
  if (atomic_compare_exchange_strong_explicit(cell, &s, mine, memory_order_acq_rel, memory_order_acquire)) {
    s = mine;
  } else {
    atomic_store_explicit(&mine->slot.magic, EBB__SLOT_FREED, memory_order_relaxed);
    /* Best effort, muted: the loser's stream never had work, and this call succeeds with the
     * winner's; a failed destroy leaks one driver stream. */
    ebb__fail_mute(true);
    (void)stream_retire(d, mine);
    ebb__fail_mute(false);
  }
  *out = s;
  return EBB_OK;
}

static ebb_status stream_default_of(const char *fn, int device, ebb_stream_t **out) {
  struct ebb__dev *d = &ebb__streams_state.dev[device];
  return stream_lazy(fn, d, &d->default_stream, EBB_PRIO_LOW, EBB__STREAM_DEFAULT, out);
}

/* The default stream has the low priority and, like every ebb stream, is created non-blocking by
 * the seam: it never serialises with the legacy NULL stream other libraries may still use. */
ebb_status ebb_stream_default(int device, ebb_stream_t **out) {
  ebb_status st = enter_dev("ebb_stream_default", device, out);
  if (st) return st;
  return stream_default_of("ebb_stream_default", device, out);
}

ebb_status ebb_stream_from_pool(int device, ebb_stream_prio prio, ebb_stream_t **out) {
  ebb_status st = enter_dev("ebb_stream_from_pool", device, out);
  if (!st) st = check_prio("ebb_stream_from_pool", prio);
  if (st) return st;
  struct ebb__dev *d = &ebb__streams_state.dev[device];
  /* The cursor only spreads work over the pool: two threads handed the same stream is harmless,
   * so a relaxed increment is enough and the hot path takes no lock. */
  uint32_t i = atomic_fetch_add_explicit(&d->pool_next[prio], 1, memory_order_relaxed) % ebb__streams_state.pool_size;
  return stream_lazy("ebb_stream_from_pool", d, &d->pool[prio][i], prio, EBB__STREAM_POOL, out);
}

/* Caller-owned streams count as live handles until released, so a test can prove none leaked. */
ebb_status ebb_stream_create(int device, ebb_stream_prio prio, ebb_stream_t **out) {
  ebb_status st = enter_dev("ebb_stream_create", device, out);
  if (!st) st = check_prio("ebb_stream_create", prio);
  if (!st) st = stream_new("ebb_stream_create", &ebb__streams_state.dev[device], prio, EBB__STREAM_USER, out);
  if (!st) {
    ebb__debug_live_add(1);
    atomic_fetch_add_explicit(&ebb__streams_state.live_streams, 1, memory_order_relaxed);
  }
  return st;
}

/* ---- released streams' last work ----------------------------------------------------------- */

/* ebb_stream_release does not wait: the driver finishes the stream's work after the handle is
 * gone. A module that used the stream (the arena: blocks it used, free on its side) must still
 * order later work after that work. Without a handle to record an event on, it could only wait
 * for the whole device on the host. So release records a pooled event on the stream first and
 * keeps it, with the stream's id, as a tomb; ebb__stream_wait_released makes a stream wait on
 * it. Tombs are reaped (events back to the pool) when the table is full and their work is done;
 * when every remembered stream still has work in flight, the table grows. */

/* Adds the tomb of stream `id`; events of reaped tombs go to done[] (at most EBB__TOMBS of them,
 * returned to the pool by the caller after tomb_mu). When every tomb's work is still in flight
 * the table grows: waiting here would hold tomb_mu across that work, and a host function in it
 * that releases a stream needs tomb_mu, so with every tomb busy the two would wait for each other).
 * False: no host memory for the table (the caller waits for the stream instead). tomb_mu
 * held. */
static bool tomb_add_locked(struct ebb__dev *d, uint64_t id, struct CUevent_st *ev, struct CUevent_st **done,
                                 unsigned *nd) {
  if (d->ntombs == d->captombs) {
    unsigned kept = 0;
    for (unsigned i = 0; i < d->ntombs; i++) {
      bool fin = false;
      ebb__fail_mute(true); /* a failed query keeps the tomb: absorbed */
      bool reap = *nd < EBB__TOMBS && d->tombs[i].ev && ebb__drv_event_query(d->ordinal, d->tombs[i].ev, &fin) == EBB_OK && fin;
      ebb__fail_mute(false);
      if (reap) done[(*nd)++] = d->tombs[i].ev;
      else d->tombs[kept++] = d->tombs[i];
    }
    d->ntombs = kept;
  }
  if (d->ntombs == d->captombs) {
    unsigned nc = d->captombs ? d->captombs * 2 : EBB__TOMBS;
    struct ebb__tomb *nt = nc > d->captombs ? realloc(d->tombs, nc * sizeof *nt) : NULL;
    if (!nt) return false;
    d->tombs = nt;
    d->captombs = nc;
  }
  d->tombs[d->ntombs++] = (struct ebb__tomb){id, ev};
  return true;
}

/* Makes `waiter` (pinned or internal) wait for the tomb of stream `id`, if it has one (none: its
 * work is done). The wait is enqueued under tomb_mu, so the event cannot be reaped and recorded
 * again by another user in between (the driver captures the record at the wait call). A lost
 * tomb (the release could neither record nor wait for the stream's last work) is waited for as
 * the whole device, with no lock held: that work may still run, and nothing narrower orders
 * after it. fn names the caller. */
static ebb_status tomb_wait(const char *fn, struct ebb__dev *d, uint64_t id, const ebb_stream_t *waiter) {
  ebb_status st = EBB_OK;
  bool lost = false;
  ebb__mutex_lock(&d->tomb_mu);
  for (unsigned i = 0; i < d->ntombs; i++) {
    if (d->tombs[i].id != id) continue;
    if (EBB_UNLIKELY(!d->tombs[i].ev)) lost = true;
    else st = ebb__drv_stream_wait_event(waiter->device, waiter->cu, d->ordinal, d->tombs[i].ev);
    break;
  }
  ebb__mutex_unlock(&d->tomb_mu);
  if (EBB_UNLIKELY(lost) && (st = ebb_dev_synchronize(d->ordinal)))
    return ebb__fail(st, "%s: stream %llu of device %d was released with its last work neither recorded nor waited for, and "
                     "the wait for device %d instead failed: %s", fn, (unsigned long long)id, d->ordinal, d->ordinal,
                     ebb_last_error());
  return st;
}

ebb_status ebb__stream_wait_released(ebb_stream_t *waiter, int device, uint64_t id) {
  ebb_status st = ebb__check_stream("ebb__stream_wait_released", waiter);
  if (st) return st;
  if ((unsigned)device >= (unsigned)ebb__streams_state.ndev)
    return ebb__fail(EBB_EDEVICE, "ebb__stream_wait_released: device %d of released stream %llu is out of range; expected 0..%d",
                     device, (unsigned long long)id, ebb__streams_state.ndev - 1);
  st = ebb__stream_pin("ebb__stream_wait_released", waiter);
  if (st) return st;
  st = tomb_wait("ebb__stream_wait_released", &ebb__streams_state.dev[device], id, waiter);
  ebb__stream_unpin(waiter);
  return st;
}

bool ebb__stream_released_done(int device, uint64_t id) {
  if ((unsigned)device >= (unsigned)ebb__streams_state.ndev) return false;
  struct ebb__dev *d = &ebb__streams_state.dev[device];
  bool done = true; /* no tomb: reaped once its work was done (or waited for at the release) */
  ebb__mutex_lock(&d->tomb_mu);
  for (unsigned i = 0; i < d->ntombs; i++) {
    if (d->tombs[i].id != id) continue;
    bool fin = false;
    ebb__fail_mute(true); /* a failed query reads as work not done: absorbed */
    done = d->tombs[i].ev && ebb__drv_event_query(d->ordinal, d->tombs[i].ev, &fin) == EBB_OK && fin;
    ebb__fail_mute(false);
    break;
  }
  ebb__mutex_unlock(&d->tomb_mu);
  return done;
}

ebb_status ebb__event_record_released(ebb_event_t *e, int device, uint64_t id) {
  static const char fn[] = "ebb__event_record_released";
  ebb_status st = ebb__check_event(fn, e);
  if (st) return st;
  if ((unsigned)device >= (unsigned)ebb__streams_state.ndev || e->device != device)
    return ebb__fail(EBB_EDEVICE, "%s: released stream %llu of device %d with event %llu of device %d; expected the same device", fn,
                     (unsigned long long)id, device, (unsigned long long)e->id, e->device);
  struct ebb__dev *d = &ebb__streams_state.dev[device];
  ebb_stream_t *h = NULL;
  st = stream_lazy(fn, d, &d->tomb_stream, EBB_PRIO_LOW, EBB__STREAM_POOL, &h);
  if (st) return st;
  /* The record after the wait on the same stream completes after that work. */
  st = tomb_wait(fn, d, id, h);
  return st ? st : ebb_event_record(e, h);
}

ebb_status ebb__event_record_live(ebb_event_t *e, const ebb_stream_t *s, uint64_t id) {
  static const char fn[] = "ebb__event_record_live";
  ebb_status st = ebb__check_event(fn, e);
  if (st) return st;
  uint64_t sid = 0;
  int dev = -1;
  if (!ebb__stream_peek(s, &sid, &dev) || sid != id) return EBB_EFREED; /* (slots are reused, ids never) */
  if (dev != e->device)
    return ebb__fail(EBB_EDEVICE, "%s: event %llu belongs to device %d but stream %llu to device %d", fn,
                     (unsigned long long)e->id, e->device, (unsigned long long)id, dev);
  struct ebb__dev *d = &ebb__streams_state.dev[dev];
  /* A release turns the stream from RELEASING to released under tomb_mu, after its pins are gone
   * and with its tomb, and destroys its driver stream only after: while tomb_mu is held and the
   * stream is live or releasing (what the peek accepts), s->cu is its driver stream, and a
   * record made here is covered by the tomb recorded after it. */
  ebb__mutex_lock(&d->tomb_mu);
  if (!ebb__stream_peek(s, &sid, &dev) || sid != id) {
    ebb__mutex_unlock(&d->tomb_mu);
    return EBB_EFREED;
  }
  st = ebb__drv_event_record(dev, e->cu, s->cu);
  ebb__mutex_unlock(&d->tomb_mu);
  /* relaxed: as in ebb_event_record. */
  if (!st) atomic_store_explicit(&e->recorded, true, memory_order_relaxed);
  return st;
}

static ebb_status stream_release_now(ebb_stream_t *s);

ebb_status ebb_stream_release(ebb_stream_t *s) {
  ebb_status st = ebb__check_stream("ebb_stream_release", s);
  if (st) return st;
  /* From a host function the release could wait for its own pins, held by an enqueue the driver
   * blocks until that very function returns; CUDA forbids the destroy there anyway. */
  if (EBB_UNLIKELY(ebb__tls_in_host_fn)) return ebb__host_fn_refused("ebb_stream_release", s);
  /* Pool and default streams are shared by every caller of the device: releasing one would pull
   * it from under the others, so it is refused rather than ignored. */
  if (s->kind != EBB__STREAM_USER)
    return ebb__fail(EBB_EINVAL, "ebb_stream_release: %s stream %llu of device %d is owned by ebb; only streams from ebb_stream_create are released",
                     s->kind == EBB__STREAM_POOL ? "pool" : "default", (unsigned long long)s->id, s->device);
  /* Held (ebb__stream_hold: a running backward): the release is asked for here and carried out
   * by the last holder to let go (ebb__stream_unhold). One release per stream: a second call
   * finds it asked. acq_rel: against the holders' CAS and decrements of the same word. */
  uint64_t w = atomic_load_explicit(&s->hold, memory_order_acquire);
  do {
    if (w & EBB__HOLD_ASKED)
      return ebb__fail(EBB_EFREED, "ebb_stream_release: stream %llu (device %d) was already released (a backward that holds it "
                       "carries the release out when it returns)", (unsigned long long)s->id, s->device);
  } while (!atomic_compare_exchange_weak_explicit(&s->hold, &w, w | EBB__HOLD_ASKED | ((w & EBB__HOLD_COUNT) ? 0 : EBB__HOLD_DONE),
                                                  memory_order_acq_rel, memory_order_acquire));
  if (w & EBB__HOLD_COUNT) return EBB_OK; /* deferred to the last holder */
  return stream_release_now(s);
}

bool ebb__stream_hold(ebb_stream_t *s, uint64_t id) {
  uint64_t sid;
  int dev;
  if (!ebb__stream_peek(s, &sid, &dev) || sid != id) return false;
  if (s->kind != EBB__STREAM_USER) return true; /* immortal */
  /* A release asked while others hold the stream is joined (it stays live until the last one
   * lets go); asked with no holder left, or done, it is refused. acq_rel: as in the release. */
  uint64_t w = atomic_load_explicit(&s->hold, memory_order_acquire);
  do {
    if ((w & EBB__HOLD_DONE) || ((w & EBB__HOLD_ASKED) && !(w & EBB__HOLD_COUNT))) return false;
  } while (!atomic_compare_exchange_weak_explicit(&s->hold, &w, w + 1, memory_order_acq_rel, memory_order_acquire));
  /* The slot may have passed to another stream between the peek and the count (it would take
   * a thousand releases meanwhile): then the count goes back, and with it any release it held. */
  if (atomic_load_explicit(&s->slot.magic, memory_order_acquire) == EBB__STREAM_LIVE && s->id == id) return true;
  ebb__stream_unhold(s);
  return false;
}

void ebb__stream_unhold(ebb_stream_t *s) {
  if (s->kind != EBB__STREAM_USER) return;
  /* acq_rel: the holder's work on the stream happens before a release this decrement lets run.
   * Bringing the count to 0 with the release asked makes it this thread's to carry out: no hold
   * joins a count of 0, so nothing can intervene. */
  uint64_t w = atomic_fetch_sub_explicit(&s->hold, 1, memory_order_acq_rel);
  if ((w & EBB__HOLD_COUNT) == 1 && (w & EBB__HOLD_ASKED) && !(w & EBB__HOLD_DONE)) {
    atomic_fetch_or_explicit(&s->hold, EBB__HOLD_DONE, memory_order_relaxed);
    (void)stream_release_now(s); /* (nobody to tell of a failed destroy: as at a driver's teardown) */
  }
}

/* The release itself, once no backward holds the stream: its last work gets a tomb, the driver
 * stream goes. */
static ebb_status stream_release_now(ebb_stream_t *s) {
  struct ebb__dev *d = &ebb__streams_state.dev[s->device];
  /* Three steps. (1) The CAS to RELEASING elects one releaser among racing calls and makes every
   * later pin fail (EBB_EFREED). (2) The calls that pinned the stream before are still issuing
   * work to it: they are waited out with no lock held (a pinned call never waits for device
   * work, see ebb__stream_pin), so the tomb covers their work too. (3) Under tomb_mu the stream
   * gets its tomb and turns released, so whoever sees it released and then looks for its tomb
   * (ebb__stream_wait_released) finds it; until then the arena still records on it under
   * tomb_mu (ebb__event_record_live). Without an event (no host memory, a failing driver), its
   * work is waited for here instead: then nothing is left to order after. When that wait fails
   * too, the work may still run: the stream gets a lost tomb, which makes whoever orders after
   * it wait for the whole device (in tomb_wait).
   * The gone_ fields go first, for the messages of whoever sees the magic leave LIVE; racing
   * releasers of one stream write the same values. */
  atomic_store_explicit(&s->slot.gone_id, s->id, memory_order_relaxed);
  atomic_store_explicit(&s->slot.gone_device, s->device, memory_order_relaxed);
  uint32_t live = EBB__STREAM_LIVE;
  /* seq_cst: with the loads of pins below, against ebb__stream_pin (see there); its release half
   * publishes the gone_ fields to the acquire loads of the magic in the checks. acquire on
   * failure: the message of the loser reads them too. (One caller reaches here per stream: the
   * hold word elected it.) */
  if (!atomic_compare_exchange_strong_explicit(&s->slot.magic, &live, EBB__STREAM_RELEASING, memory_order_seq_cst,
                                               memory_order_acquire))
    return ebb__stream_freed("ebb_stream_release", s);
  /* seq_cst: as above; it also acquires the unpins' release decrements. Pinned calls are short
   * enqueues: spin a little, then yield. */
  for (unsigned spins = 0; atomic_load_explicit(&s->pins, memory_order_seq_cst) != 0; spins++) {
    if (spins < 256) ebb__cpu_relax();
    else sched_yield();
  }
  struct CUevent_st *ev = NULL, *done[EBB__TOMBS + 1];
  unsigned nd = 0;
  /* Muted: a failure to get or record the tomb's event is absorbed by waiting for the stream,
   * and that wait's failure by a lost tomb (the release itself has nothing left to report: the
   * handle is gone either way). With no host memory for even the lost tomb as well, nothing is
   * left to order after. */
  ebb__fail_mute(true);
  if (ebb__drv_event_get(d, false, &ev) != EBB_OK) ev = NULL;
  ebb__mutex_lock(&d->tomb_mu);
  if (!ev || ebb__drv_event_record(s->device, ev, s->cu) != EBB_OK || !tomb_add_locked(d, s->id, ev, done, &nd)) {
    if (ev) done[nd++] = ev;
    if (ebb__drv_stream_synchronize(s->device, s->cu) != EBB_OK) (void)tomb_add_locked(d, s->id, NULL, done, &nd);
  }
  ebb__fail_mute(false);
  /* release: the tomb is in the table before anyone sees the stream released (the peeks' acquire
   * loads, then tomb_mu). */
  atomic_store_explicit(&s->slot.magic, EBB__SLOT_FREED, memory_order_release);
  ebb__mutex_unlock(&d->tomb_mu);
  for (unsigned i = 0; i < nd; i++) ebb__drv_event_put(d, false, done[i]);
  ebb__debug_live_add(-1);
  atomic_fetch_sub_explicit(&ebb__streams_state.live_streams, 1, memory_order_relaxed);
  return stream_retire(d, s);
}

/* ---- current stream and guards ------------------------------------------------------------- */

struct ebb__tls_current {
  ebb_stream_t *s;
  uint32_t gen;
  uint64_t epoch;
};
/* NULL means "the default stream". Never dereferenced before the epoch matches, since slots of
 * an earlier epoch have been freed. */
static _Thread_local struct ebb__tls_current ebb__tls_cur[EBB_MAX_DEVICES];

static void tls_set(int device, ebb_stream_t *s) {
  struct ebb__tls_current *c = &ebb__tls_cur[device];
  c->s = s;
  c->gen = s ? atomic_load_explicit(&s->slot.gen, memory_order_relaxed) : 0;
  c->epoch = atomic_load_explicit(&ebb__epoch, memory_order_relaxed);
}

/* Whether `s`, remembered with generation `gen`, is still the same live stream. */
static bool stream_same(const ebb_stream_t *s, uint32_t gen) {
  return atomic_load_explicit(&s->slot.magic, memory_order_acquire) == EBB__STREAM_LIVE && /* pairs as in ebb__check_stream */
         atomic_load_explicit(&s->slot.gen, memory_order_relaxed) == gen;
}

/* The epoch is compared before the slot is touched (its slab may be gone); then magic and
 * generation tell whether the slot still holds the stream that was set. */
ebb_status ebb__stream_current_of(const char *fn, int device, ebb_stream_t **out) {
  const struct ebb__tls_current *c = &ebb__tls_cur[device];
  if (c->s && c->epoch == atomic_load_explicit(&ebb__epoch, memory_order_relaxed) && stream_same(c->s, c->gen)) {
    *out = c->s;
    return EBB_OK;
  }
  return stream_default_of(fn, device, out);
}

ebb_status ebb_stream_current(int device, ebb_stream_t **out) {
  ebb_status st = enter_dev("ebb_stream_current", device, out);
  if (st) return st;
  return ebb__stream_current_of("ebb_stream_current", device, out);
}

ebb_status ebb_stream_set_current(ebb_stream_t *s) {
  ebb_status st = ebb__check_stream("ebb_stream_set_current", s);
  if (st) return st;
  tls_set(s->device, s);
  return EBB_OK;
}

#define EBB__GUARD_LIVE 0x65627367u /* "ebsg" */

/* The innermost guard entered on this thread and not exited yet (NULL: none). Only compared,
 * never dereferenced: a guard whose frame ended without an exit may be gone. */
static _Thread_local ebb_stream_guard *ebb__tls_guard;

ebb_status ebb_stream_guard_enter(ebb_stream_guard *g, ebb_stream_t *s) {
  static const char fn[] = "ebb_stream_guard_enter";
  ebb_status st = ebb__check_stream(fn, s);
  if (st) return st;
  if (!g) return ebb__fail(EBB_EINVAL, "%s: guard is NULL; expected a guard on the caller's stack", fn);
  /* The previous stream is resolved (the default one when none was set), so exit restores
   * exactly what the caller saw; the device switch comes last so a failure changes nothing. */
  int prev_device = 0;
  ebb_stream_t *prev = NULL;
  st = ebb_dev_get_current(&prev_device);
  if (!st) st = ebb__stream_current_of(fn, s->device, &prev);
  if (!st) st = ebb_dev_set_current(s->device);
  if (st) return st;
  tls_set(s->device, s);
  g->prev_stream = prev;
  g->stream = s;
  g->outer = ebb__tls_guard;
  g->epoch = atomic_load_explicit(&ebb__epoch, memory_order_relaxed);
  g->prev_gen = atomic_load_explicit(&prev->slot.gen, memory_order_relaxed);
  g->device = s->device;
  g->prev_device = prev_device;
  g->magic = EBB__GUARD_LIVE;
  ebb__tls_guard = g;
  return EBB_OK;
}

/* Only the innermost guard of the thread may exit: exiting an outer one would restore a stream
 * and device while an inner guard still expects its own, and that inner guard's exit would then
 * restore what the outer one had replaced. */
ebb_status ebb_stream_guard_exit(ebb_stream_guard *g) {
  static const char fn[] = "ebb_stream_guard_exit";
  ebb_status st = ebb__streams_enter(fn);
  if (st) return st;
  if (!g) return ebb__fail(EBB_EINVAL, "%s: guard is NULL; expected a guard filled by ebb_stream_guard_enter", fn);
  if (g->magic != EBB__GUARD_LIVE)
    return ebb__fail(EBB_ESTATE, "%s: guard %p was not entered or was already exited", fn, (void *)g);
  if (g != ebb__tls_guard) {
    if (!ebb__tls_guard)
      return ebb__fail(EBB_EINVAL, "%s: guard %p is not the innermost guard of this thread: no guard is entered on this thread; expected the thread that entered it to exit it",
                       fn, (void *)g);
    return ebb__fail(EBB_EINVAL, "%s: guard %p is not the innermost guard of this thread: the innermost guard is %p; expected guards exited in the reverse order of entry",
                     fn, (void *)g, (void *)ebb__tls_guard);
  }
  st = ebb_dev_set_current(g->prev_device);
  if (st) return st;
  /* The previous stream is restored only while it is the very stream that was current: same
   * module epoch (else its slab is gone: not even read), live, and the generation it had at
   * enter (its slot may hold a newer stream by now). Otherwise the default stream. */
  ebb_stream_t *prev = g->prev_stream;
  bool same = prev && g->epoch == atomic_load_explicit(&ebb__epoch, memory_order_relaxed) && stream_same(prev, g->prev_gen);
  tls_set(g->device, same ? prev : NULL);
  ebb__tls_guard = g->outer;
  g->magic = 0;
  return EBB_OK;
}

/* ---- queries and work ---------------------------------------------------------------------- */

ebb_status ebb_stream_device(const ebb_stream_t *s, int *device) {
  ebb_status st = ebb__check_stream("ebb_stream_device", s);
  if (!st) st = check_out("ebb_stream_device", device, "an int");
  if (!st) *device = s->device;
  return st;
}

ebb_status ebb_stream_priority(const ebb_stream_t *s, ebb_stream_prio *prio) {
  ebb_status st = ebb__check_stream("ebb_stream_priority", s);
  if (!st) st = check_out("ebb_stream_priority", prio, "an ebb_stream_prio");
  if (!st) *prio = s->prio;
  return st;
}

ebb_status ebb_stream_id(const ebb_stream_t *s, uint64_t *id) {
  ebb_status st = ebb__check_stream("ebb_stream_id", s);
  if (!st) st = check_out("ebb_stream_id", id, "a uint64_t");
  if (!st) *id = s->id;
  return st;
}

/* A stream being released counts as live here: its tomb does not exist yet, so a module that
 * took it for released would find nothing to order after; ebb__event_record_live still records
 * on it (under tomb_mu, before the tomb). */
bool ebb__stream_peek(const ebb_stream_t *s, uint64_t *id, int *device) {
  /* acquire: as in ebb__streams_enter; a module that is not UP is left to the public check. */
  if (EBB_UNLIKELY(atomic_load_explicit(&ebb__streams_state.phase, memory_order_acquire) != EBB__UP || !s)) return false;
  /* acquire: as in ebb__check_stream (the fields are those of the stream the magic announces). */
  uint32_t m = atomic_load_explicit(&s->slot.magic, memory_order_acquire);
  if (EBB_UNLIKELY(m != EBB__STREAM_LIVE && m != EBB__STREAM_RELEASING)) return false;
  *id = s->id;
  *device = s->device;
  return true;
}

ebb_status ebb_stream_get_info(const ebb_stream_t *s, ebb_stream_info *out) {
  ebb_status st = ebb__check_stream("ebb_stream_get_info", s);
  if (!st) st = check_out("ebb_stream_get_info", out, "an ebb_stream_info");
  if (!st) *out = (ebb_stream_info){.device = s->device, .prio = s->prio, .id = s->id};
  return st;
}

/* Pinned for the read only: what the caller does with the handle is ordered by the caller. The
 * pin counter is the handle's own state, not the stream's, hence the cast. */
ebb_status ebb_stream_cu(const ebb_stream_t *s, struct CUstream_st **out) {
  ebb_status st = check_out("ebb_stream_cu", out, "a CUstream");
  if (!st) st = ebb__stream_pin("ebb_stream_cu", (ebb_stream_t *)s);
  if (st) return st;
  *out = s->cu;
  ebb__stream_unpin((ebb_stream_t *)s);
  return EBB_OK;
}

/* Spin budget before parking: about the latency of a short kernel, far below a scheduler tick. */
#define EBB__SPIN_NS 20000u
#define EBB__SPIN_POLLS 256u
#define EBB__RELAX_PER_POLL 32u

ebb_status ebb__spin_then_park(int device, struct CUstream_st *s, struct CUevent_st *e) {
  uint64_t deadline = ebb__now_ns() + EBB__SPIN_NS;
  for (unsigned i = 0; i < EBB__SPIN_POLLS; i++) {
    bool done = false;
    ebb_status st = s ? ebb__drv_stream_query(device, s, &done) : ebb__drv_event_query(device, e, &done);
    if (st || done) return st;
    for (unsigned k = 0; k < EBB__RELAX_PER_POLL; k++) ebb__cpu_relax();
    if (ebb__now_ns() >= deadline) break;
  }
  return s ? ebb__drv_stream_synchronize(device, s) : ebb__drv_event_synchronize(device, e);
}

/* A caller-owned stream is waited for through a pooled event recorded under the pin, not with
 * the pin held: the release of the stream, on another thread or in a host function of the work
 * waited for, must not wait for this wait. Pool and default streams are waited for directly. */
ebb_status ebb_stream_synchronize(ebb_stream_t *s) {
  static const char fn[] = "ebb_stream_synchronize";
  ebb_status st = ebb__stream_pin(fn, s);
  if (st) return st;
  if (s->kind != EBB__STREAM_USER) return ebb__spin_then_park(s->device, s->cu, NULL);
  struct ebb__dev *d = &ebb__streams_state.dev[s->device];
  struct CUevent_st *ev = NULL;
  st = ebb__drv_event_get(d, false, &ev);
  if (!st) st = ebb__drv_event_record(s->device, ev, s->cu);
  ebb__stream_unpin(s);
  if (!st) st = ebb__spin_then_park(s->device, NULL, ev);
  if (ev) ebb__drv_event_put(d, false, ev);
  return st;
}

ebb_status ebb_stream_query(ebb_stream_t *s, bool *idle) {
  ebb_status st = check_out("ebb_stream_query", idle, "a bool");
  if (!st) st = ebb__stream_pin("ebb_stream_query", s);
  if (st) return st;
  st = ebb__drv_stream_query(s->device, s->cu, idle);
  ebb__stream_unpin(s);
  return st;
}

/* The kernel registry checks the kernel, its arguments and declared buffers; the stream only
 * supplies its device and driver stream. */
ebb_status ebb_stream_launch(ebb_stream_t *s, const ebb_kernel_t *k, const void *args, const ebb_launch_cfg *cfg) {
  ebb_status st = ebb__stream_pin("ebb_stream_launch", s);
  if (st) return st;
  st = ebb_kernel_launch(k, s->device, s->cu, args, cfg);
  ebb__stream_unpin(s);
  return st;
}

_Thread_local bool ebb__tls_in_host_fn;

bool ebb__in_host_fn(void) { return ebb__tls_in_host_fn; }

ebb_status ebb__host_fn_refused(const char *fn, const ebb_stream_t *s) {
  return ebb__fail(EBB_ESTATE, "%s: stream %llu (device %d): called from a host function (ebb_stream_host_func), which must "
                   "not make driver calls (as in CUDA, where it may fail or wait for that very function); expected the "
                   "call from a host thread, after the host function signals it",
                   fn, (unsigned long long)s->id, s->device);
}

/* What the driver runs for ebb_stream_host_func: the caller's function, with the thread marked
 * (saved and restored, should a driver run host functions from inside one), then the record goes
 * back to its free list. */
static void host_call_run(void *user) {
  struct ebb__host_call *c = user;
  ebb_host_fn fn = c->fn;
  void *fn_user = c->user;
  struct ebb__dev *d = c->dev;
  ebb__mutex_lock(&d->call_mu);
  ebb__slot_give(&d->host_calls, c);
  ebb__mutex_unlock(&d->call_mu);
  bool outer = ebb__tls_in_host_fn;
  ebb__tls_in_host_fn = true;
  fn(fn_user);
  ebb__tls_in_host_fn = outer;
}

ebb_status ebb_stream_host_func(ebb_stream_t *s, ebb_host_fn fn, void *user) {
  static const char name[] = "ebb_stream_host_func";
  ebb_status st = ebb__check_stream(name, s);
  if (st) return st;
  if (!fn)
    return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected a function to run on stream %llu (device %d)", name,
                     (unsigned long long)s->id, s->device);
  struct ebb__dev *d = &ebb__streams_state.dev[s->device];
  ebb__mutex_lock(&d->call_mu);
  struct ebb__host_call *c = ebb__slot_take(&d->host_calls);
  ebb__mutex_unlock(&d->call_mu);
  if (!c)
    return ebb__fail(EBB_ENOMEM, "%s: out of host memory for a host function record on stream %llu (device %d)", name,
                     (unsigned long long)s->id, s->device);
  c->fn = fn;
  c->user = user;
  c->dev = d;
  st = ebb__stream_pin(name, s);
  if (!st) {
    st = ebb__drv_launch_host_func(s->device, s->cu, host_call_run, c);
    ebb__stream_unpin(s);
  }
  if (st) { /* the function will never run, so nothing else gives the record back */
    ebb__mutex_lock(&d->call_mu);
    ebb__slot_give(&d->host_calls, c);
    ebb__mutex_unlock(&d->call_mu);
  }
  return st;
}

static ebb_status wait_stream(ebb_stream_t *waiter, ebb_stream_t *s) {
  static const char fn[] = "ebb_stream_wait_stream";
  ebb_status st = ebb__check_stream(fn, waiter);
  if (!st) st = ebb__check_stream(fn, s);
  if (st) return st;
  if (waiter == s) return EBB_OK; /* a stream already runs after its own earlier work */
  st = ebb__stream_pin(fn, waiter);
  if (st) return st;
  st = ebb__stream_pin(fn, s);
  if (!st) {
    st = ebb__stream_order(waiter, s);
    ebb__stream_unpin(s);
  }
  ebb__stream_unpin(waiter);
  return st;
}

/* Tracing: the wait as a span on the waiter's track (the host's enqueue, as ebb_event_wait's). */
static EBB_COLD ebb_status wait_stream_traced(ebb_stream_t *waiter, ebb_stream_t *s) {
  uint64_t key = waiter != s ? ebb__stream_trace_key(waiter) : 0, t0 = ebb__now_ns();
  ebb_status st = wait_stream(waiter, s);
  if (!st && key) {
    ebb_trace_span r = {.name = "wait stream", .start_ns = t0, .end_ns = ebb__now_ns(), .device = waiter->device, .stream = key,
                        .kind = EBB_TRACE_SPAN};
    (void)ebb_trace_record(&r);
  }
  return st;
}

ebb_status ebb_stream_wait_stream(ebb_stream_t *waiter, ebb_stream_t *s) {
  if (EBB_UNLIKELY(EBB_TRACE_ON())) return wait_stream_traced(waiter, s);
  return wait_stream(waiter, s);
}

/* ---- statistics ---------------------------------------------------------------------------- */

ebb_status ebb_stream_get_stats(ebb_stream_stats *out) {
  ebb_status st = ebb__streams_enter("ebb_stream_get_stats");
  if (!st) st = check_out("ebb_stream_get_stats", out, "an ebb_stream_stats");
  if (st) return st;
  /* No lock: each counter is exact on its own, the sum is a snapshot that may straddle a call. */
  memset(out, 0, sizeof *out);
  for (int i = 0; i < ebb__streams_state.ndev; i++) {
    const struct ebb__dev_stats *c = &ebb__streams_state.dev[i].stats;
    out->streams_created += atomic_load_explicit(&c->streams_created, memory_order_relaxed);
    out->events_created += atomic_load_explicit(&c->events_created, memory_order_relaxed);
    out->event_pool_hits += atomic_load_explicit(&c->event_pool_hits, memory_order_relaxed);
    out->staged_bytes += atomic_load_explicit(&c->staged_bytes, memory_order_relaxed);
    out->staging_waits += atomic_load_explicit(&c->staging_waits, memory_order_relaxed);
  }
  return EBB_OK;
}
