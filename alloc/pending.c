/* pending.c: frees that wait for other streams, and the uses that make them wait. A block or
 * slot used on streams other than its allocation stream (ebb_*_record_stream, or a copy through
 * the copy hook) keeps those streams in its use array; its free records one event on each and
 * queues the memory on each stream's pending queue, and a later allocation, stats call or
 * release path polls the queues and hands the memory back once every event has completed.
 * Also the arena's cache of idle events, so that a steady state records without creating.
 *
 * Owns: the pending queues and their entries (recycled through a spare list), the event cache
 * (events created for the arena's own use, their live-handle counts given back) and the blocks'
 * and slots' use arrays (grown here, kept with their records).
 *
 * Threading: under the arena's lock, which is dropped to create, record, wait for or release an
 * event (the streams module's event pool ranks below the arena, and a record or a wait blocks
 * on a full stream queue, which a host function freeing memory of this arena may be holding
 * up); the memory being freed is FREEING meanwhile, so no other call touches it. Querying an
 * event never blocks and is done under the lock.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "arena_impl.h"

/* ---- events: cache and pending queues ------------------------------------------------------ */

ebb_event_t *ebb__ev_pop(struct ebb__arena *a, int device) {
  struct ebb__evcache *c = &a->evcache[device];
  return c->n ? c->ev[--c->n] : NULL;
}

/* false when the cache cannot grow: the caller releases the event after dropping the lock. */
bool ebb__ev_push(struct ebb__arena *a, int device, ebb_event_t *e) {
  struct ebb__evcache *c = &a->evcache[device];
  if (c->n == c->cap) {
    size_t nc = c->cap ? c->cap * 2 : 16;
    ebb_event_t **ne = realloc(c->ev, nc * sizeof *ne);
    if (!ne) return false;
    c->ev = ne;
    c->cap = nc;
  }
  c->ev[c->n++] = e;
  return true;
}

/* An event for the arena's internal use. Its live-handle count is given back at once: it is
 * not a caller's handle, and tests check that callers release theirs (runtime.h counters).
 * Called without the arena lock (creation takes the event pool's lock, ranked below ours). */
ebb_status ebb__ev_create(int device, ebb_event_t **out) {
  ebb_status st = ebb_event_create(device, EBB_EVENT_DEFAULT, out);
  if (!st) {
    ebb__debug_live_add(-1);
    ebb__events_live_add(-1);
  }
  return st;
}

void ebb__ev_destroy(ebb_event_t *e) {
  ebb__debug_live_add(1); /* the count ebb__ev_create gave back */
  ebb__events_live_add(1);
  ebb_event_release(e);
}

/* Moves queue *src to *dst: the list's sentinel moves, so its ends are pointed at the new one. */
static void evq_move(struct ebb__evq *dst, const struct ebb__evq *src) {
  dst->stream_id = src->stream_id;
  if (ebb_list_empty(&src->q)) {
    ebb_list_init(&dst->q);
    return;
  }
  dst->q = src->q;
  dst->q.next->prev = &dst->q;
  dst->q.prev->next = &dst->q;
}

struct ebb__evq *ebb__evq_get(struct ebb__arena *a, uint64_t stream_id) {
  for (size_t i = 0; i < a->nevqs; i++)
    if (a->evqs[i].stream_id == stream_id) return &a->evqs[i];
  if (a->nevqs == a->capevqs) {
    /* Full: empty queues go first (a queue is only its stream's id when empty), so streams
     * made per step and released leave no trace here. */
    size_t k = 0;
    for (size_t i = 0; i < a->nevqs; i++)
      if (!ebb_list_empty(&a->evqs[i].q)) {
        if (k != i) evq_move(&a->evqs[k], &a->evqs[i]);
        k++;
      }
    a->nevqs = k;
  }
  if (a->nevqs == a->capevqs) {
    size_t nc = a->capevqs ? a->capevqs * 2 : 8;
    struct ebb__evq *nq = malloc(nc * sizeof *nq);
    if (!nq) return NULL;
    for (size_t i = 0; i < a->nevqs; i++) evq_move(&nq[i], &a->evqs[i]);
    free(a->evqs);
    a->evqs = nq;
    a->capevqs = nc;
  }
  struct ebb__evq *q = &a->evqs[a->nevqs++];
  q->stream_id = stream_id;
  ebb_list_init(&q->q);
  return q;
}

/* One pend entry done: its event goes back to the cache, its block to the free index when it
 * was the last. Returns an event the cache could not take (to release with the lock dropped). */
static ebb_event_t *pend_done(struct ebb__arena *a, struct ebb__pend *p) {
  ebb_list_remove(&p->node);
  a->npending--;
  struct ebb__block *b = p->b;
  ebb_event_t *orphan = ebb__ev_push(a, p->ev_device, p->ev) ? NULL : p->ev;
  ebb_list_insert_tail(&a->pend_spare, &p->node);
  if (p->slab) {
    ebb__slab_pend_done(a, p->slab, p->slot);
    return orphan;
  }
  EBB_ASSERT(b->state == EBB__B_PENDING && b->event_count > 0);
  if (--b->event_count == 0) ebb__block_release(a, b);
  return orphan;
}

void ebb__poll_pending(struct ebb__arena *a) {
  for (size_t i = 0; i < a->nevqs && a->npending; i++) {
    for (;;) {
      /* Re-read each time: the queue array may move while the lock is dropped below. */
      struct ebb_list *h = &a->evqs[i].q;
      if (ebb_list_empty(h)) break;
      struct ebb__pend *p = ebb_container_of(h->next, struct ebb__pend, node);
      bool done = false;
      /* A query that fails (event of a device gone wrong) counts as incomplete: the block stays
       * pending until a release path synchronises it, which reports the error. Muted: the
       * call polling here may well succeed. */
      ebb__fail_mute(true);
      ebb_status qst = ebb_event_query(p->ev, &done);
      ebb__fail_mute(false);
      if (qst != EBB_OK || !done) break;
      ebb_event_t *orphan = pend_done(a, p);
      if (orphan) {
        /* Cache growth failed: release it outside the lock (rank order). */
        ebb__unlock(&a->mu);
        ebb__ev_destroy(orphan);
        ebb__lock(&a->mu);
      }
    }
  }
}


void ebb__sync_pending(struct ebb__arena *a) {
  while (a->npending) {
    ebb_event_t *wait[32];
    size_t n = 0;
    for (size_t i = 0; i < a->nevqs && n < EBB_ARRAY_LEN(wait); i++) {
      struct ebb_list *h = &a->evqs[i].q;
      if (!ebb_list_empty(h)) wait[n++] = ebb_container_of(h->prev, struct ebb__pend, node)->ev;
    }
    ebb__unlock(&a->mu);
    /* The newest event of a stream's queue covers the older ones (stream order). Muted: a wait
     * that fails leaves its blocks pending (below), and the call that waits here may succeed. */
    ebb__fail_mute(true);
    for (size_t i = 0; i < n; i++) (void)ebb_event_synchronize(wait[i]);
    ebb__fail_mute(false);
    ebb__lock(&a->mu);
    a->c.s.num_syncs += n;
    size_t before = a->npending;
    ebb__poll_pending(a);
    if (a->npending == before && n) {
      /* No progress: some event failed to complete (its device is lost). Leave it pending. */
      break;
    }
  }
}

static uint64_t mono_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

bool ebb__wait_oldest_pending(struct ebb__arena *a, uint64_t deadline_ns) {
  /* The oldest entry is at the head of its stream's queue: each queue is in free order. Waiting
   * for it alone, not for the newest (as ebb__sync_pending), waits for the least work that
   * makes memory reusable; the caller searches after each one and stops once the request fits. */
  struct ebb__pend *oldest = NULL;
  for (size_t i = 0; i < a->nevqs; i++) {
    struct ebb_list *h = &a->evqs[i].q;
    if (ebb_list_empty(h)) continue;
    struct ebb__pend *p = ebb_container_of(h->next, struct ebb__pend, node);
    if (!oldest || p->age < oldest->age) oldest = p;
  }
  if (!oldest) return false;
  ebb_event_t *ev = oldest->ev;
  size_t before = a->npending;
  ebb__unlock(&a->mu);
  /* Polled, not synchronised, so the wait has a bound: the event's stream may be held up by the
   * very thread that waits (a host function waiting for it to go on, as a program may queue), and
   * an unbounded wait would never return. Sleeps from 2 us doubling to 128 us between queries:
   * a completion is seen within about an eighth of a millisecond. Muted: a query that fails
   * leaves the memory pending (no progress below), and the allocation goes on to grow. The entry
   * stays queued meanwhile: a concurrent poll may complete it and recycle its event, and waiting
   * on a recycled event only waits for newer work. */
  bool done = false;
  ebb_status st = EBB_OK;
  ebb__fail_mute(true);
  for (long sleep_ns = 2000;; sleep_ns = sleep_ns < 128000 ? sleep_ns * 2 : sleep_ns) {
    st = ebb_event_query(ev, &done);
    if (st || done || mono_ns() >= deadline_ns) break;
    struct timespec t = {0, sleep_ns};
    nanosleep(&t, NULL);
  }
  ebb__fail_mute(false);
  ebb__lock(&a->mu);
  a->c.s.num_syncs++;
  ebb__poll_pending(a);
  return (st == EBB_OK && done) || a->npending < before;
}

/* ---- recorded uses and deferred frees ------------------------------------------------------ */

/* Records ev after the work issued so far to the stream that used a block: on the stream while
 * it is the live stream it was, else after the event its release recorded. Lock not held. */
static ebb_status record_use(ebb_event_t *ev, const struct ebb__stream_ref *u) {
  ebb_status st = ebb__event_record_live(ev, u->s, u->id); /* (its owner may release it meanwhile) */
  if (st != EBB_EFREED) return st;
  return ebb__event_record_released(ev, u->device, u->id);
}

ebb_status ebb__uses_grow(struct ebb__stream_ref **uses, uint16_t *ucap, const char *fn, uint64_t sid, void *ptr) {
  uint32_t nc = *ucap ? (uint32_t)*ucap * 2 : 4;
  if (nc > EBB__USES_MAX)
    return ebb__fail(EBB_ELIMIT, "%s: pointer %p is already recorded on %u streams, the most one block keeps; "
                     "expected stream %" PRIu64 " to be one of them, or fewer streams per block", fn, ptr, (unsigned)*ucap, sid);
  struct ebb__stream_ref *nx = realloc(*uses, nc * sizeof *nx);
  if (!nx) return ebb__fail(EBB_ENOMEM, "%s: no host memory to record stream %" PRIu64 " on pointer %p", fn, sid, ptr);
  *uses = nx;
  *ucap = (uint16_t)nc;
  return EBB_OK;
}

/* Whether use u no longer matters to a free: its stream was released and all the work issued
 * to it is done (the release's event completed), so a free would wait for nothing. */
static bool use_retired(const struct ebb__stream_ref *u) {
  if (ebb__ref_live(u)) return false; /* (stream slots are reused, ids never) */
  return ebb__stream_released_done(u->device, u->id);
}

ebb_status ebb__uses_add(const char *fn, struct ebb__stream_ref **uses, uint16_t *n, uint16_t *cap,
                         const struct ebb__stream_ref *s, void *ptr) {
  for (uint32_t i = 0; i < *n; i++)
    if ((*uses)[i].id == s->id) return EBB_OK;
  if (*n == *cap) { /* full: drop the uses of released streams whose work is done first */
    uint16_t kept = 0;
    for (uint32_t i = 0; i < *n; i++)
      if (!use_retired(&(*uses)[i])) (*uses)[kept++] = (*uses)[i];
    *n = kept;
  }
  if (*n == *cap) {
    ebb_status st = ebb__uses_grow(uses, cap, fn, s->id, ptr);
    if (st) return st;
  }
  (*uses)[(*n)++] = *s;
  return EBB_OK;
}

void ebb__lost_note(struct ebb__lost *lost, uint64_t stream_id, int device, ebb_status st) {
  /* A device in its error state runs no more work (its context is lost, every later call that
   * would give it work fails): nothing is left to wait for, and the memory may go back. Judged
   * by the device's state, not by the status: EBB_EDEVICE also reports errors that stop nothing
   * (an invalid context, a peer-access error). */
  if (ebb__dev_failed(device)) return;
  if (lost->n++) return;
  lost->st = st;
  lost->stream_id = stream_id;
  lost->device = device;
  snprintf(lost->why, sizeof lost->why, "%s", ebb__muted_error());
}

void ebb__lost_warn(const char *fn, const void *ptr, const struct ebb__lost *lost) {
  ebb__warn("%s: pointer %p was used on stream %" PRIu64 " (device %d), whose work could be neither ordered after by an "
            "event nor waited for (%s); its memory is held back until shutdown",
            fn, ptr, lost->stream_id, lost->device, lost->why);
}

ebb_status ebb__lost_report(const char *fn, const void *ptr, const struct ebb__lost *lost) {
  return ebb__fail(lost->st,
                   "%s: pointer %p was used on stream %" PRIu64 " (device %d), whose work could be neither ordered after "
                   "by an event nor waited for (%s); its memory is held back until shutdown",
                   fn, ptr, lost->stream_id, lost->device, lost->why);
}

void ebb__uses_record(struct ebb__arena *a, const struct ebb__stream_ref *uses, uint32_t n, ebb_event_t **evs,
                      struct ebb__lost *lost) {
  /* Muted: each failure to record is absorbed by a device wait, and the free that records goes
   * on; a wait that fails too holds the memory back, which the free reports (ebb__lost_warn). */
  if (!evs) {
    /* No host memory for the event array: wait for the devices of the using streams instead,
     * correct if slow (ebb__uses_queue then queues nothing and the memory is free at once). */
    ebb__unlock(&a->mu);
    ebb__fail_mute(true);
    for (uint32_t i = 0; i < n; i++) {
      ebb_status st = ebb_dev_synchronize(uses[i].device);
      if (st) ebb__lost_note(lost, uses[i].id, uses[i].device, st);
    }
    ebb__fail_mute(false);
    ebb__lock(&a->mu);
    a->c.s.num_syncs += n;
    return;
  }
  for (uint32_t i = 0; i < n; i++) evs[i] = ebb__ev_pop(a, uses[i].device);
  ebb__unlock(&a->mu);
  uint32_t syncs = 0;
  ebb__fail_mute(true);
  for (uint32_t i = 0; i < n; i++) {
    const struct ebb__stream_ref *u = &uses[i];
    ebb_status st = evs[i] ? EBB_OK : ebb__ev_create(u->device, &evs[i]);
    if (!st) st = record_use(evs[i], u);
    if (st) {
      /* No event could capture the using stream's work (no host memory, a failed device):
       * wait for its device now. */
      st = ebb_dev_synchronize(u->device);
      if (st) ebb__lost_note(lost, u->id, u->device, st);
      syncs++;
      if (evs[i]) {
        ebb__ev_destroy(evs[i]);
        evs[i] = NULL;
      }
    }
  }
  ebb__fail_mute(false);
  ebb__lock(&a->mu);
  a->c.s.num_syncs += syncs;
}

void ebb__uses_queue(struct ebb__arena *a, const struct ebb__stream_ref *uses, uint32_t n, ebb_event_t **evs,
                     struct ebb__block *b, struct ebb__slab *sl, uint32_t slot, uint32_t *count, struct ebb__lost *lost) {
  if (!evs) return;
  for (uint32_t i = 0; i < n; i++) {
    if (!evs[i]) continue;
    const struct ebb__stream_ref *u = &uses[i];
    struct ebb__evq *q = ebb__evq_get(a, u->id);
    struct ebb_list *pn = ebb_list_pop_head(&a->pend_spare);
    struct ebb__pend *p = pn ? ebb_container_of(pn, struct ebb__pend, node) : malloc(sizeof *p);
    if (!q || !p) {
      /* No host memory for the queue: synchronise this one event instead. */
      free(pn ? NULL : p);
      if (pn) ebb_list_insert_tail(&a->pend_spare, pn);
      ebb__unlock(&a->mu);
      ebb__fail_mute(true);
      ebb_status st = ebb_event_synchronize(evs[i]);
      if (st) ebb__lost_note(lost, u->id, u->device, st);
      ebb__fail_mute(false);
      ebb__lock(&a->mu);
      a->c.s.num_syncs++;
      if (!ebb__ev_push(a, u->device, evs[i])) {
        ebb__unlock(&a->mu);
        ebb__ev_destroy(evs[i]);
        ebb__lock(&a->mu);
      }
      continue;
    }
    p->ev = evs[i];
    p->ev_device = u->device;
    p->b = b;
    p->slab = sl;
    p->slot = slot;
    p->age = a->c.s.free_count;
    ebb_list_insert_tail(&q->q, &p->node);
    a->npending++;
    (*count)++;
  }
}

/* ---- record_stream of blocks ----------------------------------------------------------------- */

ebb_status ebb__arena_record(const char *fn, void *ptr, const struct ebb__stream_ref *s, enum ebb__memkind kind) {
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  struct ebb__block *b;
  struct ebb__slab *sl = ebb__addr_lookup_lock(addr, 0, &b);
  if (sl) return ebb__slab_record(fn, sl, addr, s, kind);
  if (!b) {
    b = ebb__ptrmap_find(addr);
    if (!b) return ebb__explain(fn, ptr, kind);
    ebb__lock(&b->arena->mu);
    /* Freed (and perhaps reused) since the lookup: the record is still a block of this arena. */
    if (b->addr != addr || b->state != EBB__B_ALLOC) {
      ebb__unlock(&b->arena->mu);
      return ebb__fail(EBB_EFREED, "%s: pointer %p was freed while its use was being recorded", fn, ptr);
    }
  }
  struct ebb__arena *a = b->arena;
  if (EBB_UNLIKELY(a->up->kind != kind)) {
    ebb__unlock(&a->mu);
    return ebb__explain(fn, ptr, kind);
  }
  return ebb__block_record_locked(fn, a, b, ptr, s);
}

ebb_status ebb__block_record_locked(const char *fn, struct ebb__arena *a, struct ebb__block *b, void *ptr,
                                    const struct ebb__stream_ref *s) {
  ebb_status st = s->id == b->spool->stream.id ? EBB_OK : ebb__uses_add(fn, &b->uses, &b->nuses, &b->ucap, s, ptr);
  ebb__unlock(&a->mu);
  return st;
}

bool ebb__uses_drop(struct ebb__stream_ref *uses, uint16_t *n, uint64_t sid) {
  for (uint32_t i = 0; i < *n; i++)
    if (uses[i].id == sid) {
      uses[i] = uses[--*n];
      return true;
    }
  return false;
}

bool ebb__arena_use_forget(void *ptr, uint64_t sid) {
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  struct ebb__block *b;
  struct ebb__slab *sl = ebb__addr_lookup_lock(addr, 0, &b);
  if (sl) return ebb__slab_forget(sl, addr, sid);
  if (!b) {
    b = ebb__ptrmap_find(addr);
    if (!b) return false;
    ebb__lock(&b->arena->mu);
    if (b->addr != addr || b->state != EBB__B_ALLOC) {
      ebb__unlock(&b->arena->mu);
      return false;
    }
  }
  struct ebb__arena *a = b->arena;
  bool dropped = ebb__uses_drop(b->uses, &b->nuses, sid);
  ebb__unlock(&a->mu);
  return dropped;
}

void ebb__pending_fini(struct ebb__arena *a) {
  /* The shutdown hooks run before the runtime synchronises the devices: wait for pending
   * events so that no segment goes back to the driver under queued work. */
  for (size_t i = 0; i < a->nevqs; i++) {
    struct ebb_list *n;
    while ((n = ebb_list_pop_head(&a->evqs[i].q))) {
      struct ebb__pend *p = ebb_container_of(n, struct ebb__pend, node);
      (void)ebb_event_synchronize(p->ev); /* best effort: a failing device's work will not run */
      ebb__ev_destroy(p->ev);
      free(p);
    }
  }
  struct ebb_list *n;
  while ((n = ebb_list_pop_head(&a->pend_spare))) free(ebb_container_of(n, struct ebb__pend, node));
  for (int d = 0; d < EBB_MAX_DEVICES; d++) {
    for (size_t i = 0; i < a->evcache[d].n; i++) ebb__ev_destroy(a->evcache[d].ev[i]);
    free(a->evcache[d].ev);
  }
  free(a->evqs);
}
