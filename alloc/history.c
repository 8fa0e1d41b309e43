/* history.c: what the allocator did. Each arena keeps a ring of its actions (alloc, the two
 * halves of a free, segment and mapping changes, OOMs), recorded inline by the engine and the
 * slabs (arena_impl.h, ebb__hist_rec) and read back by ebb_alloc_history_get and the snapshot.
 *
 * Owns: each arena's history ring (allocated at arena start, freed at its end) and its clock.
 *
 * Threading: a ring is part of its arena, written and read under the arena's lock.
 */
#include <stdlib.h>
#include <string.h>

#include "arena_impl.h"
#include "ebb/trace.h"

/* ---- history ring -------------------------------------------------------------------------- */

static const char *const ebb__act_names[] = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom",
};

const char *ebb_alloc_action_name(ebb_alloc_action action) {
  return (unsigned)action < EBB_ARRAY_LEN(ebb__act_names) ? ebb__act_names[action] : "unknown";
}

/* ---- the trace (ebb/trace.h) ------------------------------------------------------------------ */

void ebb__alloc_trace(const struct ebb__arena *a, unsigned act, uint64_t size, const char *owner) {
  uint64_t now = ebb__now_ns();
  bool dev = a->up->kind == EBB__MEM_DEVICE_ARENA;
  const char *name = act == EBB__HIST_FREE_PAIR ? "free" : ebb_alloc_action_name((ebb_alloc_action)act);
  ebb_trace_span r = {.name = name, .start_ns = now, .end_ns = now, .device = a->device, .kind = EBB_TRACE_INSTANT,
                      .args = EBB_TRACE_ARG_BYTES, .bytes = size, .owner = owner && *owner ? owner : NULL};
  (void)ebb_trace_record(&r);
  /* The counter of the arena's bytes in use after the action: a device's in its process, the
   * pinned and host pools' on the host (their `device` is a NUMA neighbour, not a place). */
  ebb_trace_span c = {.name = dev ? "allocated bytes" : a->up->kind == EBB__MEM_PINNED_POOL ? "pinned allocated bytes" : "host pool allocated bytes",
                      .start_ns = now, .end_ns = now, .device = dev ? a->device : -1, .kind = EBB_TRACE_COUNTER,
                      .args = EBB_TRACE_ARG_BYTES, .bytes = a->c.s.allocated_bytes.current};
  (void)ebb_trace_record(&c);
}

void ebb__hist_init(struct ebb__arena *a) {
  memset(&a->hist, 0, sizeof a->hist);
  if (!a->conf.history) return;
  /* calloc: the pages are committed as the ring fills, so a big default costs little until used. */
  a->hist.ring = calloc(a->conf.history, sizeof *a->hist.ring);
  if (!a->hist.ring) {
    ebb__warn("no host memory for %zu history entries of %s; history off", a->conf.history, a->label);
    return;
  }
  a->hist.cap = a->conf.history;
}

#define EBB__HCLOCK_SPAN_MIN ((uint64_t)1 << 13) /* ~3 us at 2.5 GHz */
#define EBB__HCLOCK_SPAN_MAX ((uint64_t)1 << 27) /* ~50 ms */

uint64_t ebb__hist_clock_read(struct ebb__hclock *c, uint64_t t) {
  uint64_t ns = ebb__now_ns();
#if defined(__x86_64__)
  /* A pair (counter, clock) is only as good as the gap between its two reads: a thread
   * preempted in between would skew the next rate. Re-read (a few times at most) until the
   * clock read sits within EBB__HCLOCK_SPAN_MIN ticks of a counter read, and pair it with the
   * middle of the two counter reads. */
  for (int tries = 0;; tries++) {
    uint64_t t1 = __builtin_ia32_rdtsc();
    if (t1 - t < EBB__HCLOCK_SPAN_MIN || tries == 3) {
      t += (t1 - t) / 2;
      break;
    }
    t = t1;
    ns = ebb__now_ns();
  }
  /* The rate over the interval since the last reading; a longer interval gives a better one.
   * Nonsense (a counter that stepped back, an interval too short to measure) keeps the old. */
  if (c->span && t > c->tsc_a && ns > c->ns_a && t - c->tsc_a >= EBB__HCLOCK_SPAN_MIN) {
    double r = (double)(ns - c->ns_a) / (double)(t - c->tsc_a);
    if (r > 0.01 && r < 100.0) {
      c->ns_per_tick = r;
      c->rate_q32 = (uint64_t)(r * 4294967296.0);
    }
  }
  c->tsc_a = t;
  c->ns_a = ns;
  /* Until a rate is known every entry reads the clock; then the span doubles to its cap. */
  if (c->ns_per_tick == 0.0) c->span = EBB__HCLOCK_SPAN_MIN;
  else c->span = c->span * 2 < EBB__HCLOCK_SPAN_MAX ? c->span * 2 : EBB__HCLOCK_SPAN_MAX;
#else
  (void)t;
#endif
  if (ns < c->last) ns = c->last;
  return c->last = ns;
}

void ebb__hist_fini(struct ebb__arena *a) {
  free(a->hist.ring);
  memset(&a->hist, 0, sizeof a->hist);
}

/* The actions the views show: the newest min(total, cap) (struct ebb__hist). */
static size_t hist_held(const struct ebb__hist *h) { return h->total < h->cap ? (size_t)h->total : h->cap; }

/* Hands the newest n actions (n <= hist_held) to emit, oldest first: an
 * EBB__HIST_FREE_PAIR slot becomes its FREE_REQUESTED and FREE_COMPLETED entries. Lock held. */
static void hist_expand(const struct ebb__hist *h, size_t n,
                             void (*emit)(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action),
                             void *ctx) {
  if (!n) return;
  /* Back from the newest slot until n actions are covered; the oldest slot reached may hold
   * one more than needed (the FREE_REQUESTED half of a pair), skipped. The ring holds at least
   * hist_held actions, so this stops within cap slots. */
  size_t slot = h->head, got = 0;
  while (got < n) {
    slot = (slot ? slot : h->cap) - 1;
    got += ebb__he_action(&h->ring[slot]) == EBB__HIST_FREE_PAIR ? 2 : 1;
  }
  bool skip = got > n;
  for (size_t k = 0; k < n; slot = slot + 1 == h->cap ? 0 : slot + 1) {
    const struct ebb__hist_entry *e = &h->ring[slot];
    unsigned act = ebb__he_action(e);
    if (act != EBB__HIST_FREE_PAIR) {
      emit(ctx, k++, e, act);
      continue;
    }
    if (!skip) emit(ctx, k++, e, EBB_ACT_FREE_REQUESTED);
    skip = false;
    emit(ctx, k++, e, EBB_ACT_FREE_COMPLETED); /* k < n: got - n actions were skipped, at most 1 */
  }
}

static void hist_emit_entry(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action) {
  struct ebb__hist_entry *out = ctx;
  out[k] = *e;
  out[k].sac = ebb__he_sac(ebb__he_stream(e), action, ebb__he_cat(e));
}

struct ebb__hist_trace_out {
  ebb_alloc_trace_entry *out;
  int device;
};

static void hist_emit_trace(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action) {
  const struct ebb__hist_trace_out *o = ctx;
  o->out[k] = (ebb_alloc_trace_entry){.time_ns = e->time_ns,
                                      .addr = e->addr,
                                      .size = e->size,
                                      .requested = e->requested,
                                      .stream = ebb__he_stream(e),
                                      .device = o->device,
                                      .action = (ebb_alloc_action)action,
                                      .owner_cat = (ebb_owner_cat)ebb__he_cat(e),
                                      .owner_name = e->owner ? e->owner : ""};
}

size_t ebb__hist_copy(const struct ebb__arena *a, struct ebb__hist_entry *out, size_t cap) {
  size_t held = hist_held(&a->hist);
  size_t n = held < cap ? held : cap;
  hist_expand(&a->hist, n, hist_emit_entry, out);
  return n;
}

ebb_status ebb__hist_get(struct ebb__arena *a, ebb_alloc_trace_entry *out, size_t cap, size_t *count,
                         uint64_t *total) {
  ebb__lock(&a->mu);
  size_t held = hist_held(&a->hist);
  uint64_t tot = a->hist.total;
  if (!out) {
    ebb__unlock(&a->mu);
    *count = held;
    if (total) *total = tot;
    return EBB_OK;
  }
  size_t n = held < cap ? held : cap;
  struct ebb__hist_trace_out o = {out, a->device};
  hist_expand(&a->hist, n, hist_emit_trace, &o);
  ebb__unlock(&a->mu);
  *count = n;
  if (total) *total = tot;
  return EBB_OK;
}
