/* slab.c: size-class slabs for small requests, over the arena engine.
 *
 * A request whose rounded size (512-byte multiples, as every request) is at most conf.slab_max
 * is a slot of a slab: one block the engine carves from its small pool (an expandable segment's
 * one pool) on the allocation stream (so segments, reserved bytes, limits, expandable segments,
 * stealing across streams and the OOM chain stay the engine's), cut into n slots of one size. Split and merge per block cost
 * ~10 dependent cache misses per alloc+free pair at 10^5 live blocks (records, ptrmap bucket,
 * both neighbours, their places in the free index); a slot costs a bitmap bit in its slab
 * record and one slot record, and is found on free through the granule map (addrmap.c).
 *
 * Owns: slab records (recycled, freed at teardown: the map may hand a stale one to a racing bad
 * free, validated under the arena lock), their slot arrays and the per-stream class lists.
 *
 * Threading: everything is under the arena's lock; a slab enters and leaves the granule map
 * under that lock too.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "arena_impl.h"
/* ---- counters ------------------------------------------------------------------------------ */

/* Free slots are inactive_split: free memory inside a split piece (the slab), which no other
 * size can use until the whole slab is empty and goes back to the engine. */
static inline void stat_add_slab(ebb_arena_stats *s, uint64_t n, uint64_t bytes) {
  ebb__stat_add(&s->inactive_split, n);
  ebb__stat_add(&s->inactive_split_bytes, bytes);
}

static inline void stat_sub_slab(ebb_arena_stats *s, uint64_t n, uint64_t bytes) {
  ebb__stat_sub(&s->inactive_split, n);
  ebb__stat_sub(&s->inactive_split_bytes, bytes);
}

static inline void stat_add_live(ebb_arena_stats *s, uint64_t slot, uint64_t requested) {
  ebb__stat_add(&s->allocated_bytes, slot);
  ebb__stat_add(&s->active_bytes, slot);
  ebb__stat_add(&s->requested_bytes, requested);
}

/* ---- slab records -------------------------------------------------------------------------- */

#define EBB__SLAB_CHUNK 64

static struct ebb__slab *slab_rec_new(struct ebb__arena *a) {
  struct ebb_list *n = ebb_list_pop_head(&a->slab_spare);
  if (!n) {
    struct ebb__slab *c = ebb__chunk_new(&a->slab_chunks, &a->nslab_chunks, &a->capslab_chunks, 8, _Alignof(struct ebb__slab),
                                         EBB__SLAB_CHUNK * sizeof *c, EBB__CHUNK_SLABS);
    if (!c) return NULL;
    memset(c, 0, EBB__SLAB_CHUNK * sizeof *c);
    for (int i = 0; i < EBB__SLAB_CHUNK; i++) {
      c[i].arena = a; /* written once, before the record can reach the map */
      ebb_list_insert_tail(&a->slab_spare, &c[i].node);
    }
    n = ebb_list_pop_head(&a->slab_spare);
  }
  return ebb_container_of(n, struct ebb__slab, node);
}

static struct ebb__slab_cls *cls_of(struct ebb__slab *sl) { return &sl->spool->slab_cls[sl->cls]; }

/* Slots per slab for slot size r: about EBB__SLAB_TARGET bytes, at least 2 slots, whatever the
 * class already holds. Slabs that grew with their class (2x, then 4x from the third) kept fewer
 * records, but every class in use then held up to a 512 KiB slab of mostly free slots: with
 * 50 classes in use (real_gru_packed, sequence lengths that differ per sample) 14 MiB of free
 * slots stood at the reserved peak, 1.250 of the peak requested against 1.170 this way
 * (perf/JOURNAL.md, "Placement on traces it was not tuned on"). */
static uint32_t slab_nslots(size_t r) {
  size_t n = EBB__SLAB_TARGET / r;
  if (n < 2) n = 2;
  if (n > EBB__SLAB_MAX_SLOTS) n = EBB__SLAB_MAX_SLOTS;
  return (uint32_t)n;
}

/* The slot of sl holding addr (sl->addr <= addr < its end). */
static inline unsigned slot_index(const struct ebb__slab *sl, uint64_t addr) {
  return (unsigned)((((addr - sl->addr) >> 9) * sl->inv) >> 32);
}

/* Slab sl enters or leaves its class's cached empty slabs (k->nempty), counted in its segment
 * too (ebb__slab_unpin). Lock held. */
static inline void cached_inc(struct ebb__slab_cls *k, struct ebb__slab *sl) {
  k->nempty++;
  sl->b->seg->ncached++;
}
static inline void cached_dec(struct ebb__slab_cls *k, struct ebb__slab *sl) {
  k->nempty--;
  sl->b->seg->ncached--;
}

/* Makes block b (state EBB__B_CARVED) a live slab of n slots of r bytes on spool sp, entered in
 * the map and its class list. NULL: no host memory (b untouched). Lock held. */
static struct ebb__slab *slab_make(struct ebb__arena *a, struct ebb__spool *sp, struct ebb__block *b, size_t r,
                                        uint32_t n) {
  if (b->addr >> 48 || b->addr + b->size > ((uint64_t)1 << 48) || b->addr % EBB__MIN_BLOCK)
    return NULL; /* outside the map, or not in its 512-byte units (segments are page-aligned) */
  struct ebb__slab *sl = slab_rec_new(a);
  if (!sl) return NULL;
  if (sl->cap < n) {
    /* The old slot records go, with their use arrays. */
    if (sl->ext)
      for (uint32_t i = 0; i < sl->cap; i++) free(sl->ext[i].uses);
    free(sl->ext);
    sl->ext = NULL;
    free(sl->slots);
    sl->cap = 0;
    sl->slots = calloc(n, sizeof *sl->slots);
    if (!sl->slots) {
      ebb_list_insert_head(&a->slab_spare, &sl->node);
      return NULL;
    }
    sl->cap = n;
  }
  sl->addr = b->addr;
  sl->slot = (uint32_t)r;
  sl->inv = (((uint64_t)1 << 32) + r / EBB__MIN_BLOCK - 1) / (r / EBB__MIN_BLOCK);
  sl->nslots = (uint16_t)n;
  sl->nfree = (uint16_t)n;
  sl->npend = 0;
  sl->cls = (uint8_t)(r / EBB__MIN_BLOCK - 1);
  sl->sticky = a->unpin_at == a->c.s.alloc_count && a->unpin_sp == sp && a->unpin_cls == sl->cls;
  sl->spool = sp;
  sl->b = b;
  memset(sl->bits, 0, sizeof sl->bits);
  for (uint32_t i = 0; i < n; i++) {
    sl->bits[i / 64] |= 1ull << (i % 64);
    struct ebb__slot *t = &sl->slots[i];
    t->state = EBB__B_FREE;
    t->owner = "";
    t->owner_cat = EBB_OWNER_OTHER;
    t->requested = 0;
  }
  if (!ebb__amap_slab_set(sl, true)) {
    ebb_list_insert_head(&a->slab_spare, &sl->node);
    return NULL;
  }
  sl->live = 1;
  b->slab = sl;
  b->state = EBB__B_SLAB;
  struct ebb__slab_cls *k = cls_of(sl);
  ebb_list_insert_tail(&k->slabs, &sl->node);
  cached_inc(k, sl);
  return sl;
}

/* Empty slab sl (out of its class list) goes back to the engine; its record to the spare list.
 * Lock held. */
static void slab_drop(struct ebb__arena *a, struct ebb__slab *sl) {
  EBB_ASSERT(sl->nfree == sl->nslots && !sl->npend);
  stat_sub_slab(&a->c.s, sl->nslots, ebb__slab_bytes(sl));
  ebb__amap_slab_set(sl, false);
  sl->live = 0;
  ebb__arena_put_slab_block(a, sl->b);
  sl->b = NULL;
  ebb_list_insert_head(&a->slab_spare, &sl->node);
}

void ebb__slab_release_empty(struct ebb__arena *a) {
  for (size_t i = 0; i < a->nspools; i++) {
    struct ebb__spool *sp = a->spools[i];
    if (!sp->slab_cls) continue;
    for (unsigned c = 0; c < EBB__SLAB_CLASSES; c++) {
      struct ebb__slab_cls *k = &sp->slab_cls[c];
      /* Empty slabs sit at the tail of the list. */
      while (k->nempty) {
        struct ebb__slab *sl = ebb_container_of(k->slabs.prev, struct ebb__slab, node);
        EBB_ASSERT(sl->nfree == sl->nslots);
        ebb_list_remove(&sl->node);
        cached_dec(k, sl);
        slab_drop(a, sl);
      }
    }
  }
}

/* ---- slots --------------------------------------------------------------------------------- */

/* The lowest free slot of sl (which has one) for a request of `bytes`; fresh: sl was just made,
 * and its slots are not yet counted. Lock held. */
static uint64_t slab_slot_take(struct ebb__arena *a, struct ebb__slab *sl, size_t bytes, bool fresh) {
  unsigned w = 0;
  while (!sl->bits[w]) w++;
  unsigned i = w * 64 + (unsigned)__builtin_ctzll(sl->bits[w]);
  sl->bits[w] &= sl->bits[w] - 1;
  struct ebb__slab_cls *k = cls_of(sl);
  if (sl->nfree-- == sl->nslots) cached_dec(k, sl);
  if (!sl->nfree) {
    /* Full: off the class list until a slot comes back. */
    ebb_list_remove(&sl->node);
    ebb_list_init(&sl->node);
  }
  struct ebb__slot *t = &sl->slots[i];
  t->state = EBB__B_ALLOC;
  t->requested = (uint32_t)bytes;
  ebb__owner_current(&t->owner_cat, &t->owner);
  uint64_t addr = sl->addr + (uint64_t)i * sl->slot;
  ebb__hist_rec(a, EBB_ACT_ALLOC, addr, sl->slot, bytes, sl->spool->stream.id, t->owner_cat, t->owner);
  ebb_arena_stats *s = &a->c.s;
  /* A new slab's other slots are free memory held by a split piece (inactive_split), counted
   * net of the slot taken: no peak above the value this call leaves. */
  if (EBB_UNLIKELY(fresh)) stat_add_slab(s, sl->nslots - 1u, (uint64_t)(sl->nslots - 1u) * sl->slot);
  else stat_sub_slab(s, 1, sl->slot);
  stat_add_live(s, sl->slot, bytes);
  s->alloc_count++;
  return addr;
}

/* Empty slabs a stream keeps of each class. In an expandable segment none: best fit finds the
 * block again at once, and a kept empty slab stood between free blocks that would have merged,
 * the holes it split too small for the larger requests (real_gpt_varlen: five such slabs beside
 * 1.4-2.1 MiB holes at the reserved peak, 12 MiB above plain best fit; perf/JOURNAL.md, "Best
 * fit in bins"). Classic segments keep EBB__SLAB_EMPTY_CACHE, and with it the sticky slabs
 * below. */
static inline unsigned slab_keep(const struct ebb__arena *a) { return ebb__xmode(a) ? 0 : EBB__SLAB_EMPTY_CACHE; }

/* Slot i's uses are over: it is free for its stream at once. An empty slab stays cached (at
 * most slab_keep per stream and class) or goes back to the engine. recorded: the caller
 * recorded FREE_COMPLETED with the request (ebb__hist_rec_free_pair). Lock held. */
static void slot_release(struct ebb__arena *a, struct ebb__slab *sl, unsigned i, bool recorded) {
  struct ebb__slot *t = &sl->slots[i];
  uint64_t addr = sl->addr + (uint64_t)i * sl->slot;
  if (!recorded)
    ebb__hist_rec(a, EBB_ACT_FREE_COMPLETED, addr, sl->slot, t->requested, sl->spool->stream.id, t->owner_cat, t->owner);
  t->owner = "";
  t->owner_cat = EBB_OWNER_OTHER;
  t->state = EBB__B_FREE;
  t->requested = 0;
  ebb__stat_sub(&a->c.s.active_bytes, sl->slot);
  stat_add_slab(&a->c.s, 1, sl->slot);
  sl->bits[i / 64] |= 1ull << (i % 64);
  struct ebb__slab_cls *k = cls_of(sl);
  /* Partly used slabs stay ahead of empty ones, so allocation fills them first and empties
   * drain to the tail, where they are cached or given back. */
  if (!sl->nfree++) ebb_list_insert_head(&k->slabs, &sl->node);
  if (sl->nfree == sl->nslots && !sl->npend) {
    ebb_list_remove(&sl->node);
    struct ebb__segment *g = sl->b->seg;
    struct ebb__spool *sp = sl->spool;
    uint8_t cls = sl->cls;
    bool sticky = false;
    if (k->nempty < slab_keep(a)) {
      ebb_list_insert_tail(&k->slabs, &sl->node);
      cached_inc(k, sl);
      sticky = sl->sticky;
    } else {
      slab_drop(a, sl);
    }
    if (EBB_UNLIKELY(g->ncached) && g->nfree + g->ncached == g->nblocks) {
      if (sticky) {
        if (ebb_list_empty(&g->unpin)) ebb_list_insert_tail(&a->unpin_due, &g->unpin);
      } else {
        ebb__slab_unpin(a, g);
        a->unpin_at = a->c.s.alloc_count;
        a->unpin_sp = sp;
        a->unpin_cls = cls;
      }
    }
  }
}

void ebb__slab_unpin(struct ebb__arena *a, struct ebb__segment *g) {
  while (g->ncached && g->nfree + g->ncached == g->nblocks) {
    struct ebb__block *b = g->first;
    while (b && !(b->state == EBB__B_SLAB && b->slab->nfree == b->slab->nslots && !b->slab->npend)) b = b->next;
    if (!b) break; /* (ncached counts exactly these: the debug walk checks it) */
    struct ebb__slab *sl = b->slab;
    ebb_list_remove(&sl->node);
    cached_dec(cls_of(sl), sl);
    slab_drop(a, sl);
  }
}

/* Sticky slabs. A slab whose segment holds nothing else goes back when it empties
 * (ebb__seg_unpin_check). One slot allocated and freed in turn in an otherwise free segment (a
 * staging buffer, a scalar) then made and dropped its slab every time: 4 KiB pinned pairs went
 * from 122 to 200-340 ns. So a slab made for the very next allocation after its class's slab
 * (same stream) was given back is sticky: when it empties, its segment joins a->unpin_due and
 * the slab stays cached until an allocation of anything else (alloc_impl in arena.c, or
 * ebb__slab_alloc reusing another slab) gives it back. Only such slabs wait: deferring every
 * emptied slab to the next allocation that is not its own reuse left slabs where a step's last
 * frees emptied them, and the next step's blocks fitted around them (arena bench, 18 sequences
 * x 6 replays: dist=small 0 -> 15 driver allocations after the warm-up, dist=tensor 22 -> 31;
 * with sticky slabs both are unchanged). Lock held. */
void ebb__unpin_due(struct ebb__arena *a) {
  struct ebb_list *n;
  while ((n = ebb_list_pop_head(&a->unpin_due))) ebb__slab_unpin(a, ebb_container_of(n, struct ebb__segment, unpin));
}

void ebb__slab_pend_done(struct ebb__arena *a, struct ebb__slab *sl, uint32_t slot) {
  EBB_ASSERT(sl->slots[slot].state == EBB__B_PENDING && sl->ext && sl->ext[slot].event_count > 0);
  if (--sl->ext[slot].event_count) return;
  sl->npend--;
  slot_release(a, sl, slot, false);
}

ebb_status ebb__slab_alloc(struct ebb__arena *a, size_t bytes, size_t r, const struct ebb__stream_ref *s, void **out) {
  ebb__lock(&a->mu);
  if (a->npending) ebb__poll_pending(a);
  struct ebb__spool *sp = ebb__spool_get(a, s);
  if (EBB_UNLIKELY(!sp)) {
    ebb__unlock(&a->mu);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the free index of stream %" PRIu64, a->up->alloc_fn, s->id);
  }
  if (EBB_UNLIKELY(!sp->slab_cls)) {
    sp->slab_cls = malloc(EBB__SLAB_CLASSES * sizeof *sp->slab_cls);
    if (!sp->slab_cls) { /* no host memory for slab lists: the engine serves it as a block */
      ebb__unlock(&a->mu);
      return ebb__arena_alloc_block(a, bytes, s, out);
    }
    for (unsigned c = 0; c < EBB__SLAB_CLASSES; c++) {
      ebb_list_init(&sp->slab_cls[c].slabs);
      sp->slab_cls[c].nempty = 0;
    }
  }
  struct ebb__slab_cls *k = &sp->slab_cls[r / EBB__MIN_BLOCK - 1];
  if (EBB_LIKELY(!ebb_list_empty(&k->slabs))) {
    struct ebb__slab *sl = ebb_container_of(k->slabs.next, struct ebb__slab, node);
    if (EBB_UNLIKELY(!ebb_list_empty(&a->unpin_due))) {
      /* This slab's own segment stays as it is (it is about to hold a live slot); the others
       * due give their empty slabs back now. */
      ebb_list_remove(&sl->b->seg->unpin);
      ebb__unpin_due(a);
    }
    a->c.s.cache_hits++;
    *out = (void *)(uintptr_t)slab_slot_take(a, sl, bytes, false);
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  /* Another stream's cached empty slab of this class goes back to the engine first: the
   * engine's steal (ordered after that stream by an event) then reuses its memory rather than
   * growing, as it would reuse a free block of that stream. */
  for (size_t i = 0; i < a->nspools; i++) {
    struct ebb__spool *o = a->spools[i];
    struct ebb__slab_cls *ok = o != sp && o->slab_cls ? &o->slab_cls[r / EBB__MIN_BLOCK - 1] : NULL;
    if (!ok || !ok->nempty) continue;
    struct ebb__slab *e = ebb_container_of(ok->slabs.prev, struct ebb__slab, node);
    ebb_list_remove(&e->node);
    cached_dec(ok, e);
    struct ebb__segment *g = e->b->seg;
    slab_drop(a, e);
    ebb__seg_unpin_check(a, g);
    break;
  }
  uint32_t n = slab_nslots(r);
  sp->nmaking++; /* sp stays while the lock is dropped (spool_reap, fidx.c) */
  ebb__unlock(&a->mu);
  /* A new slab: the engine carves its block with the lock its own (it may drop it to grow or to
   * order a stolen block); the block is ours alone until it is entered in the map. */
  struct ebb__block *b = NULL;
  /* Muted: a failure here (the driver out of memory, or failing once) is absorbed by the plain
   * block below, whose own miss path retries and reports what it cannot absorb. */
  ebb__fail_mute(true);
  ebb_status bst = ebb__arena_alloc_slab_block(a, (size_t)n * r, s, &b);
  ebb__fail_mute(false);
  ebb__lock(&a->mu);
  sp->nmaking--;
  if (bst != EBB_OK) {
    ebb__unlock(&a->mu);
    return ebb__arena_alloc_block(a, bytes, s, out);
  }
  struct ebb__slab *sl = slab_make(a, sp, b, r, n);
  if (!sl) {
    ebb__arena_put_slab_block(a, b);
    ebb__unlock(&a->mu);
    return ebb__arena_alloc_block(a, bytes, s, out);
  }
  *out = (void *)(uintptr_t)slab_slot_take(a, sl, bytes, true);
  /* Partly used now: ahead of the empty slabs. Other threads may have added slabs of this class
   * while the lock was dropped, so the tail where slab_make put it can be behind empty
   * ones; there it would break the order that lets the empty-slab cache and empty_cache take
   * empty slabs from the tail (and drop a slab with live slots). */
  if (sl->nfree) {
    ebb_list_remove(&sl->node);
    ebb_list_insert_head(&cls_of(sl)->slabs, &sl->node);
  }
  ebb__unlock(&a->mu);
  return EBB_OK;
}

/* ---- free and record_stream ---------------------------------------------------------------- */

/* Why addr in slot i of sl is not a live slot of `kind`, as ebb__arena_free words it for
 * blocks. Unlocks. */
static ebb_status slot_bad(const char *fn, struct ebb__slab *sl, unsigned i, uint64_t addr,
                                enum ebb__memkind kind, bool is_free) {
  struct ebb__arena *a = sl->arena;
  const struct ebb__slot *t = &sl->slots[i];
  uint64_t base = sl->addr + (uint64_t)i * sl->slot, sid = sl->spool->stream.id;
  size_t size = sl->slot;
  int state = t->state;
  ebb__unlock(&a->mu);
  void *ptr = (void *)(uintptr_t)addr;
  if (a->up->kind != kind && is_free && state == EBB__B_ALLOC && addr == base)
    return ebb__fail(EBB_EINVAL, "%s: pointer %p is a live block of the %s (from %s); expected a block from %s", fn, ptr,
                     a->label, a->up->alloc_fn, ebb__kind_alloc_fn(kind));
  return ebb__explain_in(fn, ptr, kind, a, state, base, size, sid);
}


/* Slot i was used on other streams: one event on each, recorded now with the lock dropped; the
 * slot is PENDING until they complete (ebb__slab_pend_done). FREEING keeps every other call off
 * it meanwhile (a second free finds it not ALLOC; its slab cannot empty). Lock held on entry,
 * dropped on return. */
static ebb_status slot_defer(const char *fn, struct ebb__arena *a, struct ebb__slab *sl, unsigned i) {
  struct ebb__slot *slot = &sl->slots[i];
  struct ebb__slot_ext *t = &sl->ext[i];
  slot->state = EBB__B_FREEING;
  sl->npend++;
  uint32_t n = t->nuses;
  ebb_event_t *small[EBB__SMALL_EVS], **evs = n <= EBB_ARRAY_LEN(small) ? small : calloc(n, sizeof *evs);
  struct ebb__lost lost = {0};
  ebb__uses_record(a, t->uses, n, evs, &lost); /* the slot's use array is ours while FREEING */
  slot->state = EBB__B_PENDING;
  t->event_count = 0;
  ebb__uses_queue(a, t->uses, n, evs, NULL, sl, i, &t->event_count, &lost);
  t->nuses = 0;
  if (EBB_UNLIKELY(lost.n)) { /* held back: an event that never comes */
    t->event_count++;
    a->nheld++;
  }
  if (!t->event_count) {
    sl->npend--;
    slot_release(a, sl, i, false);
  }
  ebb__unlock(&a->mu);
  if (evs != small) free(evs);
  if (EBB_UNLIKELY(lost.n)) ebb__lost_warn(fn, (const void *)(uintptr_t)(sl->addr + (uint64_t)i * sl->slot), &lost);
  return EBB_OK;
}

ebb_status ebb__slab_free(const char *fn, struct ebb__slab *sl, uint64_t addr, enum ebb__memkind kind) {
  struct ebb__arena *a = sl->arena;
  unsigned i = slot_index(sl, addr);
  struct ebb__slot *t = &sl->slots[i];
  if (EBB_UNLIKELY(t->state != EBB__B_ALLOC || addr != sl->addr + (uint64_t)i * sl->slot || a->up->kind != kind))
    return slot_bad(fn, sl, i, addr, kind, true);
  ebb_arena_stats *s = &a->c.s;
  ebb__stat_sub(&s->allocated_bytes, sl->slot);
  ebb__stat_sub(&s->requested_bytes, t->requested);
  s->free_count++;
  if (EBB_LIKELY(!sl->ext || !sl->ext[i].nuses)) {
    /* No other stream used it: the free completes now, both entries at the request's time. */
    ebb__hist_rec_free_pair(a, addr, sl->slot, t->requested, sl->spool->stream.id, t->owner_cat, t->owner);
    slot_release(a, sl, i, true);
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  ebb__hist_rec(a, EBB_ACT_FREE_REQUESTED, addr, sl->slot, t->requested, sl->spool->stream.id, t->owner_cat, t->owner);
  return slot_defer(fn, a, sl, i);
}

ebb_status ebb__slab_record(const char *fn, struct ebb__slab *sl, uint64_t addr, const struct ebb__stream_ref *s,
                            enum ebb__memkind kind) {
  struct ebb__arena *a = sl->arena;
  unsigned i = slot_index(sl, addr);
  if (EBB_UNLIKELY(sl->slots[i].state != EBB__B_ALLOC || addr != sl->addr + (uint64_t)i * sl->slot || a->up->kind != kind))
    return slot_bad(fn, sl, i, addr, kind, false);
  if (s->id == sl->spool->stream.id) {
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  if (!sl->ext && !(sl->ext = calloc(sl->cap, sizeof *sl->ext))) {
    ebb__unlock(&a->mu);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory to record stream %" PRIu64 " on pointer %p", fn, s->id,
                     (void *)(uintptr_t)addr);
  }
  struct ebb__slot_ext *t = &sl->ext[i];
  ebb_status st = ebb__uses_add(fn, &t->uses, &t->nuses, &t->ucap, s, (void *)(uintptr_t)addr);
  ebb__unlock(&a->mu);
  return st;
}

bool ebb__slab_forget(struct ebb__slab *sl, uint64_t addr, uint64_t sid) {
  struct ebb__arena *a = sl->arena;
  unsigned i = slot_index(sl, addr);
  bool dropped = sl->slots[i].state == EBB__B_ALLOC && addr == sl->addr + (uint64_t)i * sl->slot && sl->ext &&
                 ebb__uses_drop(sl->ext[i].uses, &sl->ext[i].nuses, sid);
  ebb__unlock(&a->mu);
  return dropped;
}

ebb_status ebb__slab_owner(const char *fn, struct ebb__slab *sl, uint64_t addr, bool set, uint8_t cat, const char *name,
                           ebb_owner_cat *old_cat, const char **old_name) {
  struct ebb__arena *a = sl->arena;
  unsigned i = slot_index(sl, addr);
  struct ebb__slot *t = &sl->slots[i];
  if (EBB_UNLIKELY(t->state != EBB__B_ALLOC || addr != sl->addr + (uint64_t)i * sl->slot)) {
    bool inside = t->state == EBB__B_ALLOC;
    ebb__unlock(&a->mu);
    return ebb__fail(EBB_EINVAL, "%s: pointer %p %s of the %s; expected the start of a live block", fn, (void *)(uintptr_t)addr,
                     inside ? "is inside a live block" : "lies in free memory (a freed block)", a->label);
  }
  if (old_cat) *old_cat = (ebb_owner_cat)t->owner_cat;
  if (old_name) *old_name = t->owner ? t->owner : "";
  if (set) {
    t->owner_cat = cat;
    t->owner = name;
  }
  ebb__unlock(&a->mu);
  return EBB_OK;
}

ebb_status ebb__slab_copy_use(const char *fn, struct ebb__slab *sl, uint64_t addr, size_t bytes, bool is_dst,
                              const struct ebb__stream_ref *s) {
  struct ebb__arena *a = sl->arena;
  unsigned i = slot_index(sl, addr);
  uint64_t start = sl->addr + (uint64_t)i * sl->slot;
  if (sl->slots[i].state != EBB__B_ALLOC) { /* free memory of the slab: not a block's */
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  size_t req = sl->slots[i].requested; /* the bytes asked for, as for blocks */
  if (EBB_UNLIKELY(addr - start > req || bytes > req - (addr - start))) {
    ebb__unlock(&a->mu);
    return ebb__copy_past_end(fn, (void *)(uintptr_t)addr, bytes, is_dst, a, start, req);
  }
  if (!is_dst && a->up->kind == EBB__MEM_HOST_POOL) { /* read before ebb_copy_async returns */
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  return ebb__slab_record(fn, sl, start, s, a->up->kind);
}

/* ---- walks --------------------------------------------------------------------------------- */

bool ebb__piece_next(struct ebb__piece_iter *it, struct ebb__piece *out) {
  const struct ebb__block *b = it->b;
  if (!b) return false;
  if (b->state != EBB__B_SLAB) {
    *out = (struct ebb__piece){.addr = b->addr,
                               .size = b->size,
                               .requested = b->requested,
                               .stream = b->spool ? b->spool->stream.id : 0,
                               .owner = b->owner,
                               .state = b->state,
                               .owner_cat = b->owner_cat,
                               .slot = false};
    it->b = b->next;
    return true;
  }
  const struct ebb__slab *sl = b->slab;
  const struct ebb__slot *t = &sl->slots[it->slot];
  *out = (struct ebb__piece){.addr = sl->addr + (uint64_t)it->slot * sl->slot,
                             .size = sl->slot,
                             .requested = t->requested,
                             .stream = b->spool->stream.id,
                             .owner = t->owner,
                             .state = t->state,
                             .owner_cat = t->owner_cat,
                             .slot = true};
  if (++it->slot == sl->nslots) {
    it->b = b->next;
    it->slot = 0;
  }
  return true;
}

#define EBB__SCHECK(cond, ...)                   \
  do {                                           \
    if (!(cond)) return ebb__fail(EBB_EINTERNAL, __VA_ARGS__); \
  } while (0)

ebb_status ebb__slab_check(struct ebb__arena *a, const struct ebb__block *b, const char *fn, uint64_t *alloc,
                           uint64_t *active, uint64_t *requested, uint64_t *isplit, uint64_t *isplit_b,
                           size_t *pend_events, size_t *ncached) {
  const struct ebb__slab *sl = b->slab;
  EBB__SCHECK(sl && sl->live && sl->b == b && sl->arena == a && sl->spool == b->spool,
              "%s: %s: slab block 0x%" PRIx64 " has no live slab record of its own", fn, a->label, b->addr);
  EBB__SCHECK(sl->addr == b->addr && ebb__slab_bytes(sl) == b->size && sl->slot % EBB__MIN_BLOCK == 0 &&
                  sl->cls == sl->slot / EBB__MIN_BLOCK - 1 && sl->nslots >= 2 && sl->nslots <= EBB__SLAB_MAX_SLOTS &&
                  sl->nslots <= sl->cap,
              "%s: %s: slab 0x%" PRIx64 " (%" PRIu16 " slots of %" PRIu32 " B) does not tile its block of %zu B", fn,
              a->label, sl->addr, sl->nslots, sl->slot, b->size);
  unsigned nfree = 0, npend = 0, bitcount = 0;
  for (unsigned w = 0; w < EBB__SLAB_WORDS; w++) bitcount += (unsigned)__builtin_popcountll(sl->bits[w]);
  for (unsigned i = 0; i < sl->nslots; i++) {
    const struct ebb__slot *t = &sl->slots[i];
    bool bit = (sl->bits[i / 64] >> (i % 64)) & 1;
    uint64_t at = sl->addr + (uint64_t)i * sl->slot;
    EBB__SCHECK(bit == (t->state == EBB__B_FREE), "%s: %s: slot 0x%" PRIx64 " has state %d but free bit %d", fn, a->label,
                at, t->state, bit);
    EBB__SCHECK(ebb__amap_slab_find(at) == sl && ebb__amap_slab_find(at + sl->slot - 1) == sl,
                "%s: %s: slot 0x%" PRIx64 " is not found through the slab address map", fn, a->label, at);
    switch (t->state) {
    case EBB__B_FREE:
      nfree++;
      *isplit += 1;
      *isplit_b += sl->slot;
      break;
    case EBB__B_ALLOC:
      EBB__SCHECK(t->requested <= sl->slot, "%s: %s: slot 0x%" PRIx64 " holds %" PRIu32 " requested bytes in %" PRIu32, fn,
                  a->label, at, t->requested, sl->slot);
      *alloc += sl->slot;
      *active += sl->slot;
      *requested += t->requested;
      break;
    case EBB__B_FREEING:
    case EBB__B_PENDING:
      npend++;
      *active += sl->slot;
      if (sl->ext) *pend_events += sl->ext[i].event_count;
      break;
    default: EBB__SCHECK(0, "%s: %s: slot 0x%" PRIx64 " has state %d", fn, a->label, at, t->state);
    }
  }
  for (unsigned i = sl->nslots; i < EBB__SLAB_MAX_SLOTS; i++)
    EBB__SCHECK(!((sl->bits[i / 64] >> (i % 64)) & 1), "%s: %s: slab 0x%" PRIx64 " has a free bit past its %" PRIu16 " slots",
                fn, a->label, sl->addr, sl->nslots);
  EBB__SCHECK(nfree == sl->nfree && bitcount == nfree && npend == sl->npend,
              "%s: %s: slab 0x%" PRIx64 " counts %" PRIu16 " free and %" PRIu16 " pending slots, bitmap and walk found %u, "
              "%u and %u",
              fn, a->label, sl->addr, sl->nfree, sl->npend, bitcount, nfree, npend);
  bool listed = sl->node.next != &sl->node;
  EBB__SCHECK(listed == (nfree > 0), "%s: %s: slab 0x%" PRIx64 " with %u free slots is %s its class list", fn, a->label,
              sl->addr, nfree, listed ? "on" : "off");
  *ncached += sl->nfree == sl->nslots && !sl->npend;
  return EBB_OK;
}

ebb_status ebb__slab_check_classes(struct ebb__arena *a, const char *fn) {
  for (size_t i = 0; i < a->nspools; i++) {
    struct ebb__spool *sp = a->spools[i];
    if (!sp->slab_cls) continue;
    for (unsigned c = 0; c < EBB__SLAB_CLASSES; c++) {
      const struct ebb__slab_cls *k = &sp->slab_cls[c];
      uint32_t nempty = 0;
      bool seen_empty = false;
      for (const struct ebb_list *n = k->slabs.next; n != &k->slabs; n = n->next) {
        const struct ebb__slab *sl = ebb_container_of(n, const struct ebb__slab, node);
        EBB__SCHECK(sl->live && sl->spool == sp && sl->cls == c && sl->nfree > 0 && sl->b && sl->b->state == EBB__B_SLAB,
                    "%s: %s: class list of %u-byte slots holds slab 0x%" PRIx64 ", not a live slab of it with a free slot",
                    fn, a->label, (c + 1) * 512u, sl->addr);
        bool empty = sl->nfree == sl->nslots && !sl->npend;
        EBB__SCHECK(empty || !seen_empty, "%s: %s: partly used slab 0x%" PRIx64 " sits behind an empty one", fn, a->label,
                    sl->addr);
        seen_empty |= empty;
        nempty += empty;
      }
      EBB__SCHECK(nempty == k->nempty && nempty <= EBB__SLAB_EMPTY_CACHE,
                  "%s: %s: %u empty slabs of %u-byte slots, counted %" PRIu32 " (cache %d)", fn, a->label, nempty,
                  (c + 1) * 512u, k->nempty, EBB__SLAB_EMPTY_CACHE);
    }
  }
  return EBB_OK;
}

void ebb__slab_fini(struct ebb__arena *a) {
  for (size_t c = 0; c < a->nslab_chunks; c++) {
    struct ebb__slab *chunk = a->slab_chunks[c];
    for (int i = 0; i < EBB__SLAB_CHUNK; i++) {
      struct ebb__slab *sl = &chunk[i];
      if (sl->live) ebb__amap_slab_set(sl, false);
      if (sl->ext)
        for (uint32_t k = 0; k < sl->cap; k++) free(sl->ext[k].uses);
      free(sl->ext);
      free(sl->slots);
    }
    free(chunk);
  }
  free(a->slab_chunks);
  for (size_t i = 0; i < a->nspools; i++) free(a->spools[i]->slab_cls);
}
