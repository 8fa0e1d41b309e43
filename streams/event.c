/* event.c: events of ebb/stream.h and the per-device event pools.
 *
 * Owns, per device, the slots of event handles (FIFO reuse with a quarantine, so a released
 * handle reads as released for a long time) and two stacks of idle driver events, one without
 * timing and one with EBB_EVENT_TIMING. A handle borrows a driver event from its stack while it
 * lives, so creating and releasing events settles into no driver call at all: only a pool miss
 * creates a driver event, and release never destroys one (that waits for teardown).
 *
 * Threading: the device's event_mu guards the slot pool and the stacks and is held only around
 * those list operations; driver calls (create, record, wait, query) run without it. An event
 * may be recorded, waited on and queried from any thread.
 */
#include <stdlib.h>

#include "streams_export.h"
#include "ebb/trace.h"
#include "streams_impl.h"

void ebb__events_start(struct ebb__dev *d) {
  ebb__mutex_init(&d->event_mu, "streams.events", EBB_RANK_EVENT_POOL);
  ebb__slot_pool_init(&d->event_slots, sizeof(struct ebb_event), EBB__SLOT_QUARANTINE);
}

static void event_slot_destroy(void *slot, void *ctx) {
  (void)ctx;
  struct ebb_event *e = slot;
  /* Only live handles (leaked by the caller) still hold a driver event; released ones gave it
   * back to a stack, destroyed below. */
  if (e->cu) (void)ebb__drv_event_destroy(e->device, e->cu); /* best effort at teardown: the context goes next */
  e->cu = NULL;
}

void ebb__events_teardown(struct ebb__dev *d) {
  ebb__slot_pool_each(&d->event_slots, event_slot_destroy, NULL);
  ebb__slot_pool_fini(&d->event_slots);
  for (int t = 0; t < 2; t++) {
    for (size_t i = 0; i < d->drv_nevents[t]; i++) (void)ebb__drv_event_destroy(d->ordinal, d->drv_events[t][i]); /* as above */
    free(d->drv_events[t]);
    d->drv_events[t] = NULL;
    d->drv_nevents[t] = d->drv_cap[t] = 0;
  }
  ebb__mutex_destroy(&d->event_mu);
}

/* As for streams (ebb__stream_freed): the released event is named from the slot's gone_ fields,
 * which its release wrote before the magic left LIVE, never from the fields a new event taking
 * the slot may be writing. */
static ebb_status event_freed(const char *fn, const ebb_event_t *e) {
  return ebb__fail(EBB_EFREED, "%s: event %llu (device %d) was released by ebb_event_release; expected a live event", fn,
                   (unsigned long long)atomic_load_explicit(&e->slot.gone_id, memory_order_relaxed),
                   atomic_load_explicit(&e->slot.gone_device, memory_order_relaxed));
}

ebb_status ebb__check_event(const char *fn, const ebb_event_t *e) {
  ebb_status st = ebb__streams_enter(fn);
  if (EBB_UNLIKELY(st)) return st;
  if (EBB_UNLIKELY(!e)) return ebb__fail(EBB_EINVAL, "%s: event is NULL; expected one from ebb_event_create", fn);
  /* acquire: pairs with the release store of EBB__EVENT_LIVE in ebb_event_create. */
  uint32_t m = atomic_load_explicit(&e->slot.magic, memory_order_acquire);
  if (EBB_LIKELY(m == EBB__EVENT_LIVE)) return EBB_OK;
  if (m == EBB__SLOT_FREED) return event_freed(fn, e);
  return ebb__fail(EBB_EINVAL, "%s: %p is %s; expected an event handle", fn, (const void *)e,
                   m == EBB__STREAM_LIVE ? "a stream, not an event" : "not an event handle");
}

/* An idle driver event of `d` from its stack, or a new one on a miss: the one place an event
 * costs a driver call, made without event_mu. */
ebb_status ebb__drv_event_get(struct ebb__dev *d, bool timing, struct CUevent_st **out) {
  const int t = timing ? 1 : 0;
  struct CUevent_st *cu = NULL;
  ebb__mutex_lock(&d->event_mu);
  if (d->drv_nevents[t] > 0) cu = d->drv_events[t][--d->drv_nevents[t]];
  ebb__mutex_unlock(&d->event_mu);
  if (cu) {
    atomic_fetch_add_explicit(&d->stats.event_pool_hits, 1, memory_order_relaxed);
  } else {
    ebb_status st = ebb__drv_event_create(d->ordinal, timing, &cu);
    if (st) return st;
    atomic_fetch_add_explicit(&d->stats.events_created, 1, memory_order_relaxed);
  }
  *out = cu;
  return EBB_OK;
}

/* Pushes `cu` back on its stack. The stack grows only while the number of events alive at once
 * is still rising, never when warm; with no memory to grow, the event goes back to the driver. */
void ebb__drv_event_put(struct ebb__dev *d, bool timing, struct CUevent_st *cu) {
  const int t = timing ? 1 : 0;
  ebb__mutex_lock(&d->event_mu);
  if (d->drv_nevents[t] == d->drv_cap[t]) {
    size_t cap = d->drv_cap[t] ? 2 * d->drv_cap[t] : 16;
    struct CUevent_st **grown = realloc(d->drv_events[t], cap * sizeof *grown);
    if (grown) {
      d->drv_events[t] = grown;
      d->drv_cap[t] = cap;
    }
  }
  bool kept = d->drv_nevents[t] < d->drv_cap[t];
  if (kept) d->drv_events[t][d->drv_nevents[t]++] = cu;
  ebb__mutex_unlock(&d->event_mu);
  if (!kept) {
    /* Best effort, muted: the caller's step succeeded; an event that fails to go is leaked. */
    ebb__fail_mute(true);
    (void)ebb__drv_event_destroy(d->ordinal, cu);
    ebb__fail_mute(false);
  }
}

/* The event goes back to the stack as soon as the wait is enqueued: the driver captured the
 * record at the wait call, so a later re-record by another user cannot release the waiter
 * early. No handle slot is involved, so a warm call allocates nothing. */
ebb_status ebb__stream_order(ebb_stream_t *waiter, ebb_stream_t *s) {
  struct ebb__dev *d = &ebb__streams_state.dev[s->device];
  struct CUevent_st *cu = NULL;
  ebb_status st = ebb__drv_event_get(d, false, &cu);
  if (st) return st;
  st = ebb__drv_event_record(s->device, cu, s->cu);
  if (!st) st = ebb__drv_stream_wait_event(waiter->device, waiter->cu, s->device, cu);
  ebb__drv_event_put(d, false, cu);
  return st;
}

/* ---- public API ---------------------------------------------------------------------------- */

/* Caller-owned events count as live handles until released (ebb_debug_live_handles). */
ebb_status ebb_event_create(int device, unsigned flags, ebb_event_t **out) {
  static const char fn[] = "ebb_event_create";
  ebb_status st = ebb__streams_enter(fn);
  if (!st) st = ebb__check_device(fn, device);
  if (st) return st;
  if (flags & ~(unsigned)EBB_EVENT_TIMING)
    return ebb__fail(EBB_EINVAL, "%s: flags 0x%x are not valid; expected EBB_EVENT_DEFAULT or EBB_EVENT_TIMING", fn, flags);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a pointer to an ebb_event_t * to fill", fn);
  const bool timing = (flags & EBB_EVENT_TIMING) != 0;
  struct ebb__dev *d = &ebb__streams_state.dev[device];
  /* The slot first, so that running out of host memory fails before any driver call. */
  ebb__mutex_lock(&d->event_mu);
  struct ebb_event *e = ebb__slot_take(&d->event_slots);
  ebb__mutex_unlock(&d->event_mu);
  if (!e) return ebb__fail(EBB_ENOMEM, "%s: out of host memory for an event slot of device %d", fn, device);
  struct CUevent_st *cu = NULL;
  st = ebb__drv_event_get(d, timing, &cu);
  if (st) {
    ebb__mutex_lock(&d->event_mu);
    ebb__slot_give(&d->event_slots, e);
    ebb__mutex_unlock(&d->event_mu);
    return st;
  }
  e->id = ebb__new_id();
  e->device = device;
  e->flags = timing ? EBB_EVENT_TIMING : EBB_EVENT_DEFAULT;
  atomic_store_explicit(&e->recorded, false, memory_order_relaxed);
  e->cu = cu;
  /* release: pairs with the acquire in ebb__check_event (fields before the live magic). */
  atomic_store_explicit(&e->slot.magic, EBB__EVENT_LIVE, memory_order_release);
  ebb__debug_live_add(1);
  ebb__events_live_add(1);
  *out = e;
  return EBB_OK;
}

ebb_status ebb_event_release(ebb_event_t *e) {
  ebb_status st = ebb__check_event("ebb_event_release", e);
  if (st) return st;
  /* For the messages of stale handles; racing releasers write the same values. */
  atomic_store_explicit(&e->slot.gone_id, e->id, memory_order_relaxed);
  atomic_store_explicit(&e->slot.gone_device, e->device, memory_order_relaxed);
  uint32_t live = EBB__EVENT_LIVE;
  /* acq_rel: elects one releaser among racing calls, and publishes the gone_ fields to the
   * acquire loads of the magic in ebb__check_event (acquire on failure: the loser's message
   * reads them). The slot's reuse is ordered by event_mu and the release store in
   * ebb_event_create. */
  if (!atomic_compare_exchange_strong_explicit(&e->slot.magic, &live, EBB__SLOT_FREED, memory_order_acq_rel,
                                               memory_order_acquire))
    return event_freed("ebb_event_release", e);
  ebb__debug_live_add(-1);
  ebb__events_live_add(-1);
  /* The driver keeps any capture of a pending record, so work already made to wait on this
   * event is unaffected by its reuse (CUDA semantics). */
  struct ebb__dev *d = &ebb__streams_state.dev[e->device];
  struct CUevent_st *cu = e->cu;
  e->cu = NULL;
  ebb__drv_event_put(d, (e->flags & EBB_EVENT_TIMING) != 0, cu);
  ebb__mutex_lock(&d->event_mu);
  ebb__slot_give(&d->event_slots, e);
  ebb__mutex_unlock(&d->event_mu);
  return EBB_OK;
}

/* The stream is pinned around its use (ebb__stream_pin): a release racing on another thread
 * makes the call EBB_EFREED, never a record on a destroyed driver stream. */
ebb_status ebb_event_record(ebb_event_t *e, ebb_stream_t *s) {
  static const char fn[] = "ebb_event_record";
  ebb_status st = ebb__check_event(fn, e);
  if (!st) st = ebb__stream_pin(fn, s);
  if (st) return st;
  /* A driver event belongs to its device's context: recording it on another device's stream is
   * an error in CUDA, reported here with both devices instead of a bare driver code. */
  if (e->device != s->device)
  {
    ebb__stream_unpin(s);
    return ebb__fail(EBB_EDEVICE, "%s: event %llu belongs to device %d but stream %llu to device %d; record it on a stream of device %d",
                     fn, (unsigned long long)e->id, e->device, (unsigned long long)s->id, s->device, e->device);
  }
  st = ebb__drv_event_record(s->device, e->cu, s->cu);
  ebb__stream_unpin(s);
  /* relaxed: `recorded` only says whether a record was ever made; the work it captures is
   * ordered by the driver, and a caller reading it from another thread has synchronised with
   * this one to learn about the record at all. */
  if (!st) atomic_store_explicit(&e->recorded, true, memory_order_relaxed);
  return st;
}

/* Cross-device waits go straight to the driver: a stream may wait on any context's event. */
static ebb_status event_wait(ebb_event_t *e, ebb_stream_t *s) {
  static const char fn[] = "ebb_event_wait";
  ebb_status st = ebb__check_event(fn, e);
  if (!st) st = ebb__stream_pin(fn, s);
  if (st) return st;
  /* Never recorded: complete by definition, nothing to wait for (as CUDA). */
  if (atomic_load_explicit(&e->recorded, memory_order_relaxed)) st = ebb__drv_stream_wait_event(s->device, s->cu, e->device, e->cu);
  ebb__stream_unpin(s);
  return st;
}

/* Tracing: the wait as a span on the waiting stream's track, named after the event's device
 * when it is another's. Host time of the enqueue: how long the stream then waits on the device
 * is not known to the host. */
static EBB_COLD ebb_status event_wait_traced(ebb_event_t *e, ebb_stream_t *s) {
  uint64_t key = ebb__stream_trace_key(s), t0 = ebb__now_ns();
  ebb_status st = event_wait(e, s);
  if (!st && key) {
    ebb_trace_span r = {.name = e->device != s->device ? "wait event (other device)" : "wait event", .start_ns = t0,
                        .end_ns = ebb__now_ns(), .device = s->device, .stream = key, .kind = EBB_TRACE_SPAN};
    (void)ebb_trace_record(&r);
  }
  return st;
}

ebb_status ebb_event_wait(ebb_event_t *e, ebb_stream_t *s) {
  if (EBB_UNLIKELY(EBB_TRACE_ON())) return event_wait_traced(e, s);
  return event_wait(e, s);
}

ebb_status ebb_event_query(ebb_event_t *e, bool *done) {
  ebb_status st = ebb__check_event("ebb_event_query", e);
  if (st) return st;
  if (!done) return ebb__fail(EBB_EINVAL, "ebb_event_query: done is NULL; expected a bool to fill");
  /* Never recorded: complete (as CUDA), whatever a pooled driver event's previous owner left
   * pending on it. */
  if (!atomic_load_explicit(&e->recorded, memory_order_relaxed)) {
    *done = true;
    return EBB_OK;
  }
  return ebb__drv_event_query(e->device, e->cu, done);
}

ebb_status ebb_event_synchronize(ebb_event_t *e) {
  ebb_status st = ebb__check_event("ebb_event_synchronize", e);
  if (st) return st;
  if (EBB_UNLIKELY(ebb__tls_in_host_fn))
    return ebb__fail(EBB_ESTATE, "ebb_event_synchronize: event %llu (device %d): called from a host function "
                     "(ebb_stream_host_func), which must not wait for device work (it may be the wait's own); expected "
                     "the wait on a host thread", (unsigned long long)e->id, e->device);
  if (!atomic_load_explicit(&e->recorded, memory_order_relaxed)) return EBB_OK; /* as ebb_event_query */
  return ebb__spin_then_park(e->device, NULL, e->cu);
}

/* EBB_ESTATE unless `e` was recorded and its record has completed. */
static ebb_status event_finished(const char *fn, const char *which, ebb_event_t *e) {
  if (!atomic_load_explicit(&e->recorded, memory_order_relaxed))
    return ebb__fail(EBB_ESTATE, "%s: %s event %llu (device %d) was never recorded; record both events first", fn, which,
                     (unsigned long long)e->id, e->device);
  bool done = false;
  ebb_status st = ebb__drv_event_query(e->device, e->cu, &done);
  if (st) return st;
  if (!done)
    return ebb__fail(EBB_ESTATE, "%s: %s event %llu (device %d) has not completed yet; synchronize it first", fn, which,
                     (unsigned long long)e->id, e->device);
  return EBB_OK;
}

/* Every precondition is checked here, in the order a caller would fix them, so the driver's
 * own error (CUDA_ERROR_INVALID_HANDLE or NOT_READY) is never what the caller sees. */
ebb_status ebb_event_elapsed(ebb_event_t *start, ebb_event_t *end, float *ms) {
  static const char fn[] = "ebb_event_elapsed";
  ebb_status st = ebb__check_event(fn, start);
  if (!st) st = ebb__check_event(fn, end);
  if (st) return st;
  if (!ms) return ebb__fail(EBB_EINVAL, "%s: ms is NULL; expected a float to fill", fn);
  const ebb_event_t *untimed = !(start->flags & EBB_EVENT_TIMING) ? start : !(end->flags & EBB_EVENT_TIMING) ? end : NULL;
  if (untimed)
    return ebb__fail(EBB_EINVAL, "%s: %s event %llu (device %d) was created without EBB_EVENT_TIMING; expected both events to have it",
                     fn, untimed == start ? "start" : "end", (unsigned long long)untimed->id, untimed->device);
  if (start->device != end->device)
    return ebb__fail(EBB_EDEVICE, "%s: start event %llu is on device %d but end event %llu on device %d; expected one device", fn,
                     (unsigned long long)start->id, start->device, (unsigned long long)end->id, end->device);
  st = event_finished(fn, "start", start);
  if (!st) st = event_finished(fn, "end", end);
  if (st) return st;
  return ebb__drv_event_elapsed(start->device, start->cu, end->cu, ms);
}

ebb_status ebb_event_device(const ebb_event_t *e, int *device) {
  ebb_status st = ebb__check_event("ebb_event_device", e);
  if (st) return st;
  if (!device) return ebb__fail(EBB_EINVAL, "ebb_event_device: device is NULL; expected an int to fill");
  *device = e->device;
  return EBB_OK;
}
