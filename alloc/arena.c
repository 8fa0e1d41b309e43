/* arena.c: the arena engine, written once for every memory kind (arena_impl.h). Blocks carved
 * from upstream segments: split and merge, allocation (the stream's own free index, then another
 * stream's free block or a run of several streams' blocks, ordered after their streams by
 * events, then the upstream, then the release-and-retry chain and the OOM report), the free of a
 * block, the release paths (empty_cache, trim), limits, counters and the history actions, and
 * the arena's life cycle. Its parts have files of their own: the free index (fidx.c), expandable
 * segments (xseg.c), pending frees (pending.c), slabs (slab.c), the address maps (addrmap.c).
 *
 * Owns: the segment records and the block records (carved from chunks, recycled, freed only at
 * teardown), the counters, and the arena's teardown, which calls each part's. The upstream owns
 * the memory itself.
 *
 * Threading: one mutex per arena (rank EBB_RANK_ARENA) protects all of it. The lock is dropped
 * around upstream obtain/release (a driver allocation can take milliseconds and may synchronise
 * the device: PyTorch's release_lock_on_cudamalloc) and around event creation and host waits;
 * each such window says what keeps the state consistent while the lock is down. The one
 * exception is expandable growth and shrink: VMM map/unmap runs under the lock because the
 * mapped tail of the reservation is the shared state being changed.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arena_impl.h"

#define EBB__SLAB_BLOCKS 256

_Static_assert(sizeof(struct ebb__block) == 128 && offsetof(struct ebb__block, seg) == 64,
               "a block record is two cache lines, the free-index fields in the first");
/* The pieces of the alloc/free hit path: inlined into it even where they have other callers,
 * so a pair is one straight run with the block's fields in registers, not a dozen calls each
 * reloading them (GCC's size heuristics left most of them out of line). One that arena_impl.h
 * also declares (extern) is an external inline definition (C11 6.7.4): inlined here, and emitted
 * once out of line for the other files (xseg.c, pending.c). */
#define EBB__HOT inline __attribute__((always_inline))

/* ---- small helpers ------------------------------------------------------------------------- */

const char *ebb__fmt_bytes(char *buf, size_t cap, uint64_t n) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (n < 1024) {
    snprintf(buf, cap, "%" PRIu64 " B", n);
    return buf;
  }
  double v = (double)n;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, cap, "%.2f %s", v, unit[u]);
  return buf;
}

/* ---- block records ------------------------------------------------------------------------- */

/* Records come from slabs and go back to a spare list, never to malloc before teardown: a
 * record found in the address map or the ptrmap may be read after another thread freed the
 * block, and must still be a block record of the same arena (checked under the lock before
 * use). The spare list is LIFO: the record reused next is the one retired last, still in cache.
 * Slabs are 128-byte aligned, so each record is exactly its two lines and leaves the address
 * map its 7 low bits. */
/* A new slab of records onto the spare list; false when out of host memory. */
static bool block_slab(struct ebb__arena *a) {
  struct ebb__block *slab = ebb__chunk_new(&a->slabs, &a->nslabs, &a->capslabs, 16, _Alignof(struct ebb__block),
                                           EBB__SLAB_BLOCKS * sizeof *slab, EBB__CHUNK_BLOCKS);
  if (!slab) return false;
  memset(slab, 0, EBB__SLAB_BLOCKS * sizeof *slab);
  for (int i = 0; i < EBB__SLAB_BLOCKS; i++) {
    slab[i].arena = a;
    slab[i].kind = (uint8_t)a->up->kind;
    slab[i].state = EBB__B_DEAD;
    ebb_list_insert_tail(&a->block_spare, &slab[i].node);
  }
  return true;
}

EBB__HOT struct ebb__block *ebb__block_new(struct ebb__arena *a) {
  struct ebb_list *n = ebb_list_pop_head(&a->block_spare);
  if (EBB_UNLIKELY(!n)) {
    if (!block_slab(a)) return NULL;
    n = ebb_list_pop_head(&a->block_spare);
  }
  struct ebb__block *b = ebb_container_of(n, struct ebb__block, node);
  /* Field by field, not memset: `arena` and `kind` are written once, when the slab is made,
   * because a free or record_stream reads a record found in a map before taking its arena's lock
   * (the record may have been freed and reused meanwhile; it is still a record of that arena).
   * The use array stays with the record for its next user. */
  b->addr = 0;
  b->size = 0;
  b->prev = b->next = NULL;
  b->spool = NULL;
  b->state = EBB__B_FREE;
  b->pool = 0;
  b->owner_cat = EBB_OWNER_OTHER;
  b->leaf = NULL;
  b->seg = NULL;
  b->requested = 0;
  b->owner = NULL;
  b->slab = NULL;
  b->nuses = 0;
  b->event_count = 0;
  ebb_list_init(&b->node);
  return b;
}

inline void ebb__block_dead(struct ebb__arena *a, struct ebb__block *b) {
  b->state = EBB__B_DEAD;
  b->addr = 0;
  b->seg = NULL;
  b->nuses = 0;
  ebb_list_insert_head(&a->block_spare, &b->node);
}

/* ---- segments and inactive_split ----------------------------------------------------------- */

/* A segment's share of inactive_split: its free pieces when it is split into several blocks.
 * Expandable segments are left out, as PyTorch does: their free pieces are unmappable. */
static inline bool seg_is_split(const struct ebb__segment *g) { return !g->expandable && g->nblocks >= 2; }

static void seg_split_stat(struct ebb__arena *a, const struct ebb__segment *g, bool add) {
  if (!seg_is_split(g)) return;
  if (add) {
    ebb__stat_add(&a->c.s.inactive_split, g->nfree);
    ebb__stat_add(&a->c.s.inactive_split_bytes, g->free_bytes);
  } else {
    ebb__stat_sub(&a->c.s.inactive_split, g->nfree);
    ebb__stat_sub(&a->c.s.inactive_split_bytes, g->free_bytes);
  }
}

/* ---- free and merge ------------------------------------------------------------------------ */

EBB__HOT void ebb__merge_insert(struct ebb__arena *a, struct ebb__block *b) {
  struct ebb__segment *g = b->seg;
  struct ebb__block *p = b->prev, *n = b->next;
  bool left = ebb__mergeable(b, p), right = ebb__mergeable(b, n);
  if (right) {
    /* b absorbs n. With no free left neighbour b takes n's place in the index (b sits right
     * before it in order); else n just leaves it. */
    if (left) ebb__index_remove(n);
    b->size += n->size;
    b->next = n->next; /* first: whether b ends an expandable segment decides where it is kept */
    if (!left) ebb__index_replace(a, n, b);
    if (n->next) n->next->prev = b;
    g->nblocks--;
    g->nfree--;
    ebb__block_dead(a, n);
  }
  if (left) {
    /* p absorbs b and keeps its place in the index: only its size changes. */
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    g->nblocks--;
    g->nfree--;
    ebb__block_dead(a, b);
    ebb__index_grown(a, p);
  } else if (!right) {
    ebb__index_insert(a, b);
  }
}

/* Returns a block whose uses are over to its stream's free index, merged with free neighbours
 * of the same stream and pool. Stats: allocated was dropped at the free request; active now.
 * recorded: the caller recorded FREE_COMPLETED with the request (ebb__hist_rec_free_pair). */
static EBB__HOT void block_release_t(struct ebb__arena *a, struct ebb__block *b, bool recorded) {
  struct ebb__segment *g = b->seg;
  if (!recorded)
    ebb__hist_rec(a, EBB_ACT_FREE_COMPLETED, b->addr, b->size, b->requested, b->spool->stream.id, b->owner_cat, b->owner);
  /* A free block belongs to nobody; snapshots show its owner only while it is active. */
  b->owner = "";
  b->owner_cat = EBB_OWNER_OTHER;
  ebb__stat_sub(&a->c.s.active_bytes, b->size);
  bool counted = seg_is_split(g);
  size_t nf0 = g->nfree, fb0 = g->free_bytes;
  b->spool->nlive--;
  b->state = EBB__B_FREE;
  b->nuses = 0;
  g->nfree++;
  g->free_bytes += b->size;
  ebb__merge_insert(a, b);
  /* inactive_split by the change just made, not by re-adding the segment's whole share (a
   * segment of one block never counted and cannot merge). */
  if (EBB_LIKELY(counted)) {
    if (EBB_LIKELY(seg_is_split(g))) {
      /* Still split: one more free piece, less those it merged with; the freed bytes. */
      if (g->nfree != nf0) ebb__stat_move(&a->c.s.inactive_split, nf0, g->nfree);
      ebb__stat_add(&a->c.s.inactive_split_bytes, g->free_bytes - fb0);
    } else {
      /* Merged back into one block: the segment's pieces stop counting. */
      ebb__stat_sub(&a->c.s.inactive_split, nf0);
      ebb__stat_sub(&a->c.s.inactive_split_bytes, fb0);
    }
  }
  /* The segment's last live block: cached empty slabs pinning it go back (ebb__slab_unpin). */
  ebb__seg_unpin_check(a, g);
}

void ebb__block_release(struct ebb__arena *a, struct ebb__block *b) { block_release_t(a, b, false); }

/* ---- segments ------------------------------------------------------------------------------ */

void ebb__span_add(struct ebb__arena *a, uint64_t base, size_t size) {
  uint64_t w = atomic_load_explicit(&a->span, memory_order_relaxed);
  uint64_t lo = w & UINT32_MAX, hi = w >> 32;
  uint64_t blo = ebb__span_unit(base), bhi = ebb__span_unit(base + size - 1) + 1;
  if (!hi || blo < lo) lo = blo;
  if (bhi > hi) hi = bhi;
  /* relaxed: a filter only (see in_span, copy.c). */
  atomic_store_explicit(&a->span, lo | hi << 32, memory_order_relaxed);
}

struct ebb__segment *ebb__segment_add(struct ebb__arena *a, uint64_t base, size_t size, int pool, struct ebb__spool *sp,
                                      struct ebb__block **first) {
  struct ebb__segment *g = calloc(1, sizeof *g);
  struct ebb__block *b = g ? ebb__block_new(a) : NULL;
  if (!b) {
    free(g);
    return NULL;
  }
  ebb_list_init(&g->unpin);
  g->seq = a->nsegs_made++;
  g->base = base;
  g->size = size;
  g->pool = (uint8_t)pool;
  g->first = b;
  g->nblocks = 1;
  b->addr = base;
  b->size = size;
  b->seg = g;
  b->spool = sp;
  b->pool = (uint8_t)pool;
  b->state = EBB__B_FREE; /* not indexed: handed to the caller */
  g->nfree = 1;
  g->free_bytes = size;
  ebb_list_insert_tail(&a->segments, &g->node);
  ebb__span_add(a, base, size);
  ebb__stat_add(&a->c.s.reserved_bytes, size);
  ebb__stat_add(&a->c.s.segments, 1);
  *first = b;
  return g;
}

/* Detaches every classic segment whose blocks are all free (any stream) and returns them to
 * the upstream with the lock dropped. Free blocks need no wait: their streams' later work is
 * ordered by the driver's free (cuMemFree synchronises). Lock held on entry and exit. */
static size_t release_free_segments(struct ebb__arena *a) {
  struct ebb_list gone;
  ebb_list_init(&gone);
  size_t released = 0;
  for (struct ebb_list *n = a->segments.next, *nx; n != &a->segments; n = nx) {
    nx = n->next;
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    if (g->expandable || g->nfree != g->nblocks) continue;
    seg_split_stat(a, g, false);
    ebb__hist_rec(a, EBB_ACT_SEGMENT_FREE, g->base, g->size, 0, g->first->spool->stream.id, EBB_OWNER_OTHER, "");
    for (struct ebb__block *b = g->first, *bn; b; b = bn) {
      bn = b->next;
      ebb__index_remove(b);
      ebb__block_dead(a, b);
    }
    ebb_list_remove(&g->node);
    ebb_list_remove(&g->unpin);
    ebb_list_insert_tail(&gone, &g->node);
    ebb__stat_sub(&a->c.s.reserved_bytes, g->size);
    ebb__stat_sub(&a->c.s.segments, 1);
    released += g->size;
  }
  if (ebb_list_empty(&gone)) return 0;
  ebb__unlock(&a->mu);
  size_t nfreed = 0;
  struct ebb_list *n;
  while ((n = ebb_list_pop_head(&gone))) {
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    /* A failing release leaks the range rather than risk handing it out twice. Muted, and said
     * through the warning handler: the call that gives memory back goes on. */
    ebb__fail_mute(true);
    ebb_status rst = a->up->release(a, g->base, g->size);
    ebb__fail_mute(false);
    if (rst == EBB_OK) {
      nfreed++;
      ebb__grave_add(a, g->base, g->size);
    } else {
      ebb__warn("%s: a segment of %zu bytes at 0x%" PRIx64 " could not be given back and leaks: %s", a->label, g->size,
                g->base, ebb__muted_error());
    }
    free(g);
  }
  ebb__lock(&a->mu);
  a->c.s.num_device_free += nfreed;
  return released;
}

/* ---- allocation ---------------------------------------------------------------------------- */

/* The streams whose last work on a block's memory the allocation stream must be ordered after,
 * one event each, before the block is handed out: the owner of a stolen block, or the owners of
 * the pieces of a run (take_run). Filled under the lock by the miss path; alloc_impl
 * records and waits for the events. */
#define EBB__ORDER_MAX 4 /* streams one allocation may be ordered after */
struct ebb__order {
  unsigned n;
  struct ebb__stream_ref from[EBB__ORDER_MAX];
  ebb_event_t *ev[EBB__ORDER_MAX];
};

/* Adds the stream of `sp` to o unless it is `own` or already there; false when o is full. */
static bool order_add(struct ebb__order *o, const struct ebb__spool *sp, const struct ebb__spool *own) {
  if (sp == own) return true;
  for (unsigned i = 0; i < o->n; i++)
    if (o->from[i].id == sp->stream.id) return true;
  if (o->n == EBB__ORDER_MAX) return false;
  o->from[o->n++] = sp->stream;
  return true;
}

/* Another stream's free block for a request that missed its own stream: free memory must not
 * stay stranded with the stream that freed it while another stream grows the arena. Its owner
 * goes into o: the caller orders the new stream after it with an event before handing the block
 * out. Lock held. */
static struct ebb__block *arena_steal(struct ebb__arena *a, struct ebb__spool *own, int pool, size_t r,
                                     struct ebb__order *o) {
  for (size_t i = 0; i < a->nspools; i++) {
    struct ebb__spool *sp = a->spools[i];
    if (sp == own || !sp->pools[pool].count) continue;
    struct ebb__block *b = ebb__fidx_take(a, &sp->pools[pool], r);
    if (b) {
      order_add(o, sp, own);
      return b;
    }
  }
  return NULL;
}

/* A run of address-adjacent free blocks of one pool that together hold r, merged into one free
 * block (out of the index), when no single free block of any stream does. Free neighbours merge
 * only within a stream (a block freed on S is S's until an event orders another stream after
 * it), so with several streams a segment's free memory ends up in pieces of alternating owners
 * that no stream can use alone. The run's other owners go into o, as for a steal (at most
 * EBB__ORDER_MAX of them: else the caller grows instead). Best fit over the maximal runs (the
 * smallest that holds r), taken from its start up to the piece that covers r; that last piece's
 * owner owns the merged block, so carve leaves it the remainder, which lies inside its
 * piece (or gives it to `own`, when alloc_impl could order `own` after every owner under
 * the lock). Oversize blocks (max_split) are never part of a run. A walk over the blocks of the
 * pool's segments, only on the miss path, just before the upstream is asked. Lock held. */
static struct ebb__block *take_run(struct ebb__arena *a, struct ebb__spool *own, int pool, size_t r,
                                        struct ebb__order *o) {
  size_t ms = ebb__max_split(a);
  /* One stream's adjacent free blocks of one pool are always merged: no run without two. */
  if (r >= ms || a->nspools < 2) return NULL;
  struct ebb__block *best = NULL;
  size_t best_total = SIZE_MAX;
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    if ((!g->expandable && g->pool != pool) || g->nfree < 2 || g->free_bytes < r) continue;
    struct ebb__block *start = NULL;
    size_t total = 0;
    for (struct ebb__block *b = g->first;; b = b->next) {
      if (b && b->state == EBB__B_FREE && b->pool == pool && b->size < ms) {
        if (!start) {
          start = b;
          total = 0;
        }
        total += b->size;
        continue;
      }
      /* A run of one block is a block the free indexes already refused. */
      if (start && start->next != b && total >= r && total < best_total) {
        best = start;
        best_total = total;
      }
      start = NULL;
      if (!b) break;
    }
  }
  if (!best) return NULL;
  struct ebb__order w = *o;
  struct ebb__block *last = best;
  for (size_t sum = 0;; last = last->next) {
    if (!order_add(&w, last->spool, own)) return NULL;
    if ((sum += last->size) >= r) break;
  }
  *o = w;
  struct ebb__segment *g = best->seg;
  struct ebb__block *after = last->next;
  seg_split_stat(a, g, false);
  ebb__index_remove(best);
  for (struct ebb__block *b = best->next, *bn; b != after; b = bn) {
    bn = b->next;
    ebb__index_remove(b);
    best->size += b->size;
    g->nblocks--;
    g->nfree--;
    ebb__block_dead(a, b);
  }
  best->next = after;
  if (after) after->prev = best;
  best->spool = last->spool;
  seg_split_stat(a, g, true);
  return best;
}

/* Hands out free block b (still in its stream's index when `indexed`, else out of every index)
 * for rounded request r on stream spool sp: splits off the remainder when the pool's rule allows
 * (the small pool and expandable segments: a remainder of at least 512 bytes; classic large
 * segments: more than 1 MiB, from a block below max_split). The remainder is b->spool's (the
 * stream that freed b) and goes into its index, or, with `aside` (b came from other streams), is
 * set aside (EBB__B_ASIDE) for aside_settle. Lock held. */
static void carve(struct ebb__arena *a, struct ebb__block *b, bool indexed, struct ebb__spool *sp, size_t r,
                       size_t bytes, bool slab, struct ebb__block **aside) {
  struct ebb__segment *g = b->seg;
  size_t rest = b->size - r;
  bool split = g->expandable || b->pool == EBB__POOL_SMALL ? rest >= EBB__MIN_BLOCK
                                                            : rest > EBB__SMALL_SIZE && b->size < a->conf.max_split;
  bool counted = seg_is_split(g);
  size_t nf0 = g->nfree;
  if (split) {
    struct ebb__block *nb = ebb__block_new(a);
    if (nb) { /* no host memory for a record: hand out the whole block instead */
      nb->addr = b->addr + r;
      nb->size = rest;
      nb->seg = g;
      nb->spool = b->spool;
      nb->pool = b->pool;
      nb->state = EBB__B_FREE;
      nb->prev = b;
      nb->next = b->next;
      if (b->next) b->next->prev = nb;
      b->next = nb;
      b->size = r;
      g->nblocks++;
      g->nfree++; /* free_bytes already counts the remainder: it was part of b */
      if (EBB_UNLIKELY(aside)) {
        /* Counted free, but in no index and merging with nothing until aside_settle; sp's
         * already (the old owner's spool may go meanwhile: spool_reap, fidx.c). */
        nb->state = EBB__B_ASIDE;
        nb->spool = sp;
        *aside = nb;
      } else if (indexed) {
        ebb__index_replace(a, b, nb); /* nb follows b in order */
        indexed = false;
      } else {
        ebb__index_insert(a, nb);
      }
    }
  }
  if (indexed) ebb__index_remove(b);
  g->nfree--;
  g->free_bytes -= b->size;
  /* inactive_split by the change just made (see block_release_t). */
  if (EBB_LIKELY(counted)) {
    /* Still split: the block handed out leaves the free pieces (its remainder, if split off,
     * takes its place). */
    if (g->nfree != nf0) ebb__stat_move(&a->c.s.inactive_split, nf0, g->nfree);
    ebb__stat_sub(&a->c.s.inactive_split_bytes, b->size);
  } else if (seg_is_split(g)) {
    /* The segment's first split: its free pieces start to count. */
    ebb__stat_add(&a->c.s.inactive_split, g->nfree);
    ebb__stat_add(&a->c.s.inactive_split_bytes, g->free_bytes);
  }
  b->spool = sp;
  sp->nlive++;
  if (slab) { /* slab.c counts and records the slots, not the slab */
    b->state = EBB__B_CARVED;
    b->requested = 0;
    b->owner = "";
    b->owner_cat = EBB_OWNER_OTHER;
    b->nuses = 0;
    return;
  }
  b->state = EBB__B_ALLOC;
  b->requested = bytes;
  b->nuses = 0;
  ebb__owner_current(&b->owner_cat, &b->owner);
  ebb__hist_rec(a, EBB_ACT_ALLOC, b->addr, b->size, bytes, sp->stream.id, b->owner_cat, b->owner);
  ebb__stat_add(&a->c.s.allocated_bytes, b->size);
  ebb__stat_add(&a->c.s.active_bytes, b->size);
  ebb__stat_add(&a->c.s.requested_bytes, bytes);
  a->c.s.alloc_count++;
}

/* The OOM report. Lock held: the driver's free memory is asked through the seam, which takes no
 * ebb lock. */
static ebb_status arena_oom(struct ebb__arena *a, size_t bytes, size_t r, const struct ebb__stream_ref *s,
                           const struct ebb__tried *tried) {
  a->c.s.num_ooms++;
  char rq[24], rr[24], cap[24], fr[24], res[24], al[24], lg[24], lim[48] = "", top[600], tr[96] = "";
  size_t dfree = 0, dtotal = 0;
  if (a->up->mem_info(a, &dfree, &dtotal) != EBB_OK) dfree = 0;
  uint8_t ocat;
  const char *oname;
  ebb__owner_current(&ocat, &oname);
  /* As PyTorch's trace: the driver's free bytes where an address would be, the request as size. */
  ebb__hist_rec(a, EBB_ACT_OOM, dfree, bytes, bytes, s->id, ocat, oname);
  ebb__top_owners(a, top, sizeof top);
  if (a->limit) {
    char l[24];
    snprintf(lim, sizeof lim, ", limit %s", ebb__fmt_bytes(l, sizeof l, a->limit));
  }
  if (tried->first) {
    /* "; tried a 20.00 MiB segment, then a 4.00 MiB one" / "; tried to map 20.00 MiB, then 4.00 MiB" */
    char t1[24], t2[24], then[48] = "";
    bool x = tried->expandable;
    if (tried->second)
      snprintf(then, sizeof then, ", then %s%s%s", x ? "" : "a ", ebb__fmt_bytes(t2, sizeof t2, tried->second),
               x ? "" : " one");
    snprintf(tr, sizeof tr, "; tried %s %s%s%s", x ? "to map" : "a", ebb__fmt_bytes(t1, sizeof t1, tried->first),
             x ? "" : " segment", then);
  }
  /* Who asked: the allocating thread's owner scope (a backward names its node). */
  char who[64] = "";
  if (ocat != EBB_OWNER_OTHER || (oname && *oname))
    snprintf(who, sizeof who, " for %s/%.40s", ebb_owner_cat_name((ebb_owner_cat)ocat), oname && *oname ? oname : "(none)");
  return ebb__fail(EBB_ENOMEM,
                   "%s: %s out of memory: requested %s (rounded %s)%s on stream %" PRIu64
                   "%s; capacity %s, driver free %s, reserved %s, allocated %s, largest free block %s%s%s",
                   a->up->alloc_fn, a->label, ebb__fmt_bytes(rq, sizeof rq, bytes), ebb__fmt_bytes(rr, sizeof rr, r), who, s->id,
                   tr, ebb__fmt_bytes(cap, sizeof cap, a->total_mem), ebb__fmt_bytes(fr, sizeof fr, dfree),
                   ebb__fmt_bytes(res, sizeof res, a->c.s.reserved_bytes.current),
                   ebb__fmt_bytes(al, sizeof al, a->c.s.allocated_bytes.current),
                   ebb__fmt_bytes(lg, sizeof lg, ebb__fidx_largest_free(a)), lim, top);
}

/* Gets a new segment (or expandable growth) big enough for r. Lock held on entry and exit;
 * dropped around the upstream call, with the bytes counted in `inflight` so concurrent
 * allocations see them against the limit. On success *out is a FREE block not in the index. */
/* One segment of `seg` bytes from the upstream, within the limit; the lock dropped around the
 * call. Lock held on entry and exit. */
static ebb_status arena_obtain(struct ebb__arena *a, size_t seg, uint64_t *base) {
  if (a->limit && a->c.s.reserved_bytes.current + a->inflight + seg > a->limit)
    return ebb__fail(EBB_ENOMEM, "limit of %s reached", a->label);
  a->inflight += seg;
  ebb__unlock(&a->mu);
  ebb_status st = a->up->obtain(a, seg, base);
  ebb__lock(&a->mu);
  a->inflight -= seg;
  return st;
}

/* The least a segment (or expandable growth) for rounded request r may be when the size policy's
 * one does not fit: r itself, large requests rounded to 2 MiB (what a driver hands out for them
 * anyway), small ones to a block. */
static inline size_t fallback_size(size_t r) {
  return ebb__round_up(r, r > EBB__SMALL_SIZE ? EBB__ROUND_LARGE : EBB__MIN_BLOCK);
}

static ebb_status arena_grow(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r, struct ebb__block **out,
                            struct ebb__tried *tried) {
  if (ebb__xmode(a)) {
    ebb_status st = ebb__x_grow(a, sp, pool, r, tried);
    if (st) return st;
    *out = ebb__fidx_take(a, &sp->pools[pool], r);
    return *out ? EBB_OK : ebb__fail(EBB_EINTERNAL, "%s: %s grew but found no block", a->up->alloc_fn, a->label);
  }
  size_t seg = ebb__segment_size(a, r), fb = fallback_size(r);
  uint64_t base = 0;
  ebb_status st = arena_obtain(a, seg, &base);
  if (tried) *tried = (struct ebb__tried){.first = seg, .second = 0, .expandable = false};
  /* Near capacity the policy's segment (20 MiB for a 3 MiB request) may not fit where the
   * request would: one just large enough before the retry chain and the OOM report. */
  if (st == EBB_ENOMEM && fb < seg) {
    if (tried) tried->second = fb;
    seg = fb;
    st = arena_obtain(a, seg, &base);
  }
  if (st) return st;
  a->c.s.num_device_alloc++;
  if (!ebb__segment_add(a, base, seg, pool, sp, out)) {
    ebb__unlock(&a->mu);
    (void)a->up->release(a, base, seg); /* best effort: the ENOMEM below is the answer (its message replaces this one's) */
    ebb__lock(&a->mu);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for a segment record", a->up->alloc_fn);
  }
  uint8_t ocat;
  const char *oname;
  ebb__owner_current(&ocat, &oname);
  ebb__hist_rec(a, EBB_ACT_SEGMENT_ALLOC, base, seg, 0, sp->stream.id, ocat, oname);
  return EBB_OK;
}

/* Before growth: frees pending on other streams whose bytes could hold r, waited for on the
 * host, oldest first, one event at a time, searching again after each (this stream's index,
 * another stream's block, a run), until the request fits or what is still pending could not hold
 * it. Growth is a driver call and memory reserved until empty_cache; a wait costs the time until
 * work already queued on another stream (an offload copy, a gradient's cross-device copy)
 * reaches the event, work that runs whether the host waits or not. A program whose demand
 * repeats each step would otherwise grow whenever those streams run late (a loaded host, a slow
 * copy), as PyTorch's allocator does: it only queries the events on each malloc, and waits for
 * them once the driver refuses memory. Bounded by the entries pending on entry, so a queue
 * refilled by other threads meanwhile cannot keep it waiting, and by pending_wait_us in all
 * (a stream held up by this very thread, through a host function waiting for it, would
 * otherwise never let it go on). Lock held (dropped for each wait); NULL: grow. */
static struct ebb__block *await_pending(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r,
                                        struct ebb__order *o) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  uint64_t deadline = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec + (uint64_t)a->conf.wait_pending_us * 1000u;
  for (size_t n = a->npending; n && ebb__wait_pending_worth(a, r); n--) {
    if (!ebb__wait_oldest_pending(a, deadline)) break;
    struct ebb__block *b = ebb__fidx_take(a, &sp->pools[pool], r);
    if (!b) b = arena_steal(a, sp, pool, r, o);
    if (!b) b = take_run(a, sp, pool, r, o);
    if (b) {
      a->c.s.num_pending_waits++;
      return b;
    }
  }
  return NULL;
}

/* The miss path: another stream's block, a run of free blocks of several streams, pending frees
 * that could hold the request waited for (await_pending), then the upstream, then once the
 * release-and-retry chain: the completed pending frees, then waiting for
 * the rest, each followed by a new search (a step PyTorch's chain skips: the blocks they free may
 * fit), empty slabs, every fully free segment and granule given back, and the upstream again.
 * The streams the block must be ordered after go into o. */
static ebb_status alloc_slow(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r, size_t bytes,
                                  const struct ebb__stream_ref *s, struct ebb__block **out, struct ebb__order *o) {
  ebb_status gst = EBB_OK;
  struct ebb__tried tried = {0, 0, false};
  for (int attempt = 0;; attempt++) {
    struct ebb__block *b = arena_steal(a, sp, pool, r, o);
    if (!b) b = take_run(a, sp, pool, r, o);
    if (!b && !attempt && EBB_UNLIKELY(ebb__wait_pending_worth(a, r))) b = await_pending(a, sp, pool, r, o);
    if (b) {
      *out = b;
      return EBB_OK;
    }
    /* The first growth's failure (the driver out of memory, or failing once) is absorbed when
     * the retry below succeeds, so it is muted: a call that succeeds leaves the last error and
     * the hook alone. The second growth's failure, or the OOM report, is the caller's. */
    if (!attempt) ebb__fail_mute(true);
    gst = arena_grow(a, sp, pool, r, out, &tried);
    if (!attempt) ebb__fail_mute(false);
    if (gst == EBB_OK) return EBB_OK;
    if (attempt) break;
    /* (1) completed pending frees, (2) wait for the rest and re-search, (3) give back every
     * fully free segment, then try once more. */
    ebb__poll_pending(a);
    if ((b = ebb__fidx_take(a, &sp->pools[pool], r))) {
      *out = b;
      return EBB_OK;
    }
    ebb__sync_pending(a);
    if ((b = ebb__fidx_take(a, &sp->pools[pool], r))) {
      *out = b;
      return EBB_OK;
    }
    /* Empty slabs before unmapping, as empty_cache: their blocks merge back into the free
     * indexes (this stream's too, hence the search) and may free whole granules or segments. */
    ebb__slab_release_empty(a);
    if ((b = ebb__fidx_take(a, &sp->pools[pool], r))) {
      *out = b;
      return EBB_OK;
    }
    if (a->xseg) {
      a->c.s.num_syncs++;
      /* Unmapping must not race queued work (the driver does not wait for it). A failed
       * synchronisation says the device is failing: unmapping under work that may still run
       * would corrupt it, and an OOM report would hide the cause, so the driver's failure is
       * the answer. */
      ebb_status sst = ebb_dev_synchronize(a->device);
      if (sst) return ebb__sync_failed(a, a->up->alloc_fn, sst);
      ebb__x_shrink(a);
    }
    release_free_segments(a);
    a->c.s.num_alloc_retries++;
    /* x_shrink joins free blocks of several streams: the join may be this stream's now. */
    if ((b = ebb__fidx_take(a, &sp->pools[pool], r))) {
      *out = b;
      return EBB_OK;
    }
  }
  /* A configured cap of the upstream (pinned_max_bytes), not exhausted memory: its own code,
   * and the upstream's message says which cap, what is held and what was asked. */
  if (gst == EBB_ELIMIT) {
    a->c.s.num_ooms++;
    return gst;
  }
  /* A device in its error state (a sticky driver error) is no OOM: its own message is the answer. */
  if (gst == EBB_EDEVICE) return gst;
  return arena_oom(a, bytes, r, s, &tried);
}

/* The oom_snapshot setting: after the report is composed and the lock dropped (the snapshot
 * takes every arena's lock in turn, as PyTorch calls its OOM observers unlocked). The report
 * stays this thread's last error; a snapshot that cannot be written goes to the warning handler. */
static ebb_status arena_oom_snapshot(struct ebb__arena *a, ebb_status st) {
  if (st != EBB_ENOMEM || !a->conf.oom_snapshot) return st;
  char report[512];
  snprintf(report, sizeof report, "%s", ebb_last_error());
  if (ebb__snapshot_write("oom_snapshot", a->conf.oom_snapshot) != EBB_OK) {
    ebb__warn("%s", ebb_last_error());
    return ebb__fail(st, "%s", report);
  }
  return st;
}

/* The miss path of a slab's block: another stream's free block or a run, then the upstream. No release
 * chain: the caller falls back to a plain block, whose own miss path runs it (and reports an
 * OOM with the caller's size). Lock held. */
static ebb_status alloc_slab_slow(struct ebb__arena *a, struct ebb__spool *sp, size_t r, struct ebb__block **out,
                                       struct ebb__order *o) {
  int pool = ebb__pool_of(a, r); /* the small pool, or an expandable segment's one */
  struct ebb__block *b = arena_steal(a, sp, pool, r, o);
  if (!b) b = take_run(a, sp, pool, r, o);
  if (!b && EBB_UNLIKELY(ebb__wait_pending_worth(a, r))) b = await_pending(a, sp, pool, r, o);
  if (b) {
    *out = b;
    return EBB_OK;
  }
  return arena_grow(a, sp, pool, r, out, NULL);
}

static ebb_status alloc_impl(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s, bool slab,
                                  void **out, struct ebb__block **bout);

/* Makes stream `to` wait on the device for the work issued so far to `from`: an event recorded
 * on it while it is the live stream it was, else the event its release recorded (a stream
 * released after using memory of this arena: a training step that makes a stream per call).
 * *ev: an event of
 * from's device, or NULL (one is made when needed); left for the caller to recycle. Lock not
 * held. */
static ebb_status order_after(ebb_stream_t *to, const struct ebb__stream_ref *from, ebb_event_t **ev) {
  if (ebb__ref_live(from)) {
    ebb_status st = *ev ? EBB_OK : ebb__ev_create(from->device, ev);
    /* Its owner may release it meanwhile: the record is made only while it is live, else
     * EBB_EFREED, and its release event covers it. */
    if (!st) st = ebb__event_record_live(*ev, from->s, from->id);
    if (!st) return ebb_event_wait(*ev, to);
    if (st != EBB_EFREED) return st;
  }
  return ebb__stream_wait_released(to, from->device, from->id);
}

/* What a stolen block (or run) leaves after the request, set aside by carve while the lock
 * is dropped to order the new stream after the old owners: then it becomes `sp`'s (the new
 * stream's, once ordered) and merges with sp's free neighbours. Left with its old owner, a
 * stream that asks for other sizes, such a remainder was stranded: with three streams on one
 * expandable segment (perf/traces/multistream.trace), 64 MiB requests of stream 0 cut 80 MiB
 * blocks of stream 1, whose 16 MiB remainders no request of stream 1 fits, and 290 MB sat free
 * in 34 pieces of three owners at the reserved peak. Set aside rather than indexed at once, so
 * no allocation on sp can take it before sp waits for the old owners, and no event is recorded
 * or waited for under the lock (either can block on a full stream queue, which a host function
 * that frees memory of this arena may be holding up). Lock held. */
static void aside_settle(struct ebb__arena *a, struct ebb__block *nb, struct ebb__spool *sp) {
  struct ebb__segment *g = nb->seg;
  size_t nf0 = g->nfree;
  EBB_ASSERT(nb->state == EBB__B_ASIDE);
  nb->state = EBB__B_FREE;
  nb->spool = sp;
  ebb__merge_insert(a, nb);
  /* The block handed out shares the segment, so a counted segment stays split: fewer pieces,
   * same bytes. */
  if (seg_is_split(g) && g->nfree != nf0) ebb__stat_move(&a->c.s.inactive_split, nf0, g->nfree);
}

/* Holds block x back for good: PENDING with one event that never comes (nheld). Lock held. */
static void block_hold(struct ebb__arena *a, struct ebb__block *x) {
  x->state = EBB__B_PENDING;
  x->event_count = 1;
  x->nuses = 0;
  a->nheld++;
}

/* A stolen block whose old owners' work could be neither ordered after nor waited for: that
 * work may still use it, so neither the block nor its remainder is handed out, ever, and the
 * allocation fails. Both are held back; a slab's block, not yet made a slab, stays CARVED (a
 * state nothing else touches). Lock not held. */
static ebb_status steal_lost(struct ebb__arena *a, struct ebb__block *b, struct ebb__block *aside, bool indexed, bool slab,
                             struct ebb__spool *sp, const struct ebb__lost *lost) {
  struct ebb__block *m = NULL;
  if (!slab && indexed && ebb__block_in_amap(b)) (void)ebb__addr_lookup_lock(b->addr, b->kind, &m); /* (locks a when found) */
  if (!m) ebb__lock(&a->mu);
  if (!slab && indexed) {
    /* Out of the address maps, as a free takes it: a live block nobody was given would keep
     * the arena busy for good. */
    if (!m) m = ebb__ptrmap_take(b->addr);
    EBB_ASSERT(m == b);
    ebb__stat_sub(&a->c.s.allocated_bytes, b->size);
    ebb__stat_sub(&a->c.s.requested_bytes, b->requested);
  }
  if (!slab) {
    a->c.s.free_count++; /* not the caller's: the allocation fails */
    block_hold(a, b);
  }
  if (aside) {
    struct ebb__segment *g = aside->seg;
    seg_split_stat(a, g, false);
    g->nfree--;
    g->free_bytes -= aside->size;
    seg_split_stat(a, g, true);
    ebb__stat_add(&a->c.s.active_bytes, aside->size);
    sp->nlive++;
    block_hold(a, aside);
  }
  uint64_t addr = b->addr;
  ebb__unlock(&a->mu);
  /* A slab's block is asked for muted, and a plain block serves the request instead (slab.c):
   * the memory held back would go untold but for a warning. */
  if (slab) ebb__lost_warn(a->up->alloc_fn, (const void *)(uintptr_t)addr, lost);
  return ebb__lost_report(a->up->alloc_fn, (const void *)(uintptr_t)addr, lost);
}

ebb_status ebb__arena_alloc(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s, void **out) {
  /* Small requests are slots of a slab (slab.c): no split, merge or ptrmap entry per request.
   * slab_max is a 512-byte multiple, so this is "rounded size <= slab_max". */
  if (bytes <= a->conf.slab_max)
    return ebb__slab_alloc(a, bytes, bytes < EBB__MIN_BLOCK ? EBB__MIN_BLOCK : ebb__round_up(bytes, EBB__MIN_BLOCK), s, out);
  return alloc_impl(a, bytes, s, false, out, NULL);
}

ebb_status ebb__arena_alloc_block(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s, void **out) {
  return alloc_impl(a, bytes, s, false, out, NULL);
}

ebb_status ebb__arena_alloc_slab_block(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s,
                                       struct ebb__block **out) {
  return alloc_impl(a, bytes, s, true, NULL, out);
}

/* A slab's block goes back as a free block: no stats of its own to drop (slab.c dropped its
 * slots'), no history (the slots' frees were recorded). Lock held. */
void ebb__arena_put_slab_block(struct ebb__arena *a, struct ebb__block *b) {
  struct ebb__segment *g = b->seg;
  EBB_ASSERT(b->state == EBB__B_SLAB || b->state == EBB__B_CARVED);
  b->spool->nlive--;
  b->slab = NULL;
  seg_split_stat(a, g, false);
  b->state = EBB__B_FREE;
  g->nfree++;
  g->free_bytes += b->size;
  ebb__merge_insert(a, b);
  seg_split_stat(a, g, true);
}

/* A plain block, or (slab) the block of a new slab: *bout, state EBB__B_CARVED, no ptrmap entry,
 * no stats but the engine's own (cache hits, reserved, segments). */
/* Orders stream s after the old owners of a stolen block b (and of its remainder, aside), one
 * event each, with the lock dropped; the events go back to the cache. EBB_OK, or steal_lost's
 * failure when an owner's work could be neither ordered after nor waited for. */
static ebb_status steal_order(struct ebb__arena *a, const struct ebb__stream_ref *s, struct ebb__order *o,
                              struct ebb__block *b, struct ebb__block *aside, bool indexed, bool slab, struct ebb__spool *sp) {
  struct ebb__lost lost = {0};
  for (unsigned i = 0; i < o->n; i++) {
    ebb_event_t *ev = o->ev[i];
    /* The last users of the block (or of a piece of its run) ran on `from`: make the new stream
     * wait for them on the device. The block is ours (ALLOC, not yet returned) and its
     * remainder is set aside, so the lock may stay dropped. Muted: a failed ordering is
     * absorbed by the host wait below; a wait that fails too (the device not in its error
     * state, where nothing runs any more) is this call's failure. */
    const struct ebb__stream_ref *from = &o->from[i];
    ebb__fail_mute(true);
    ebb_status st = order_after(s->s, from, &ev);
    if (st) {
      /* Neither an event nor the stream's release event could order s (no host memory, a failed
       * device): wait for the device on the host instead. Counted as a sync. */
      st = ebb_dev_synchronize(from->device);
      if (st) ebb__lost_note(&lost, from->id, from->device, st);
      ebb__lock(&a->mu);
      a->c.s.num_syncs++;
      ebb__unlock(&a->mu);
    }
    ebb__fail_mute(false);
    if (ev) {
      ebb__lock(&a->mu);
      bool kept = ebb__ev_push(a, from->device, ev);
      ebb__unlock(&a->mu);
      if (!kept) ebb__ev_destroy(ev);
    }
  }
  return EBB_UNLIKELY(lost.n) ? steal_lost(a, b, aside, indexed, slab, sp, &lost) : EBB_OK;
}

static ebb_status alloc_impl(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s, bool slab,
                                  void **out, struct ebb__block **bout) {
  if (EBB_UNLIKELY(bytes > ((size_t)1 << 50))) {
    ebb__lock(&a->mu);
    const struct ebb__tried none = {0, 0, false}; /* nothing asked: beyond any device */
    ebb_status st = arena_oom(a, bytes, bytes, s, &none);
    ebb__unlock(&a->mu);
    return arena_oom_snapshot(a, st);
  }
  size_t r = bytes < EBB__MIN_BLOCK ? EBB__MIN_BLOCK : ebb__round_up(bytes, EBB__MIN_BLOCK);
  int pool = ebb__pool_of(a, r);
  ebb__lock(&a->mu);
  if (a->npending) ebb__poll_pending(a);
  if (EBB_UNLIKELY(!ebb_list_empty(&a->unpin_due))) ebb__unpin_due(a);
  struct ebb__spool *sp = ebb__spool_get(a, s);
  if (EBB_UNLIKELY(!sp)) {
    ebb__unlock(&a->mu);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the free index of stream %" PRIu64, a->up->alloc_fn, s->id);
  }
  /* Left in the index: carve puts what the request leaves of it in its place. */
  struct ebb__block *b = ebb__fidx_find(a, &sp->pools[pool], r);
  bool in_index = b != NULL;
  struct ebb__order o;
  o.n = 0;
  struct ebb__block *aside = NULL;
  if (EBB_LIKELY(b)) {
    a->c.s.cache_hits++;
  } else {
    ebb_status st = slab ? alloc_slab_slow(a, sp, r, &b, &o) : alloc_slow(a, sp, pool, r, bytes, s, &b, &o);
    if (st) {
      ebb__unlock(&a->mu);
      return slab ? st : arena_oom_snapshot(a, st);
    }
    if (o.n) {
      a->c.steals++;
      a->c.s.cache_hits++;
      for (unsigned i = 0; i < o.n; i++) o.ev[i] = ebb__ev_pop(a, o.from[i].device);
    }
  }
  carve(a, b, in_index, sp, r, bytes, slab, o.n ? &aside : NULL);
  bool indexed = slab || (ebb__block_in_amap(b) ? ebb__amap_block_put(b) : ebb__ptrmap_insert(b));
  if (EBB_UNLIKELY(!indexed)) {
    ebb__stat_sub(&a->c.s.allocated_bytes, b->size);
    ebb__stat_sub(&a->c.s.requested_bytes, bytes);
    if (!o.n) {
      ebb__block_release(a, b);
      ebb__unlock(&a->mu);
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for the pointer map", a->up->alloc_fn);
    }
    /* A stolen block is this stream's only once it waits for the old owners: released below,
     * after the ordering (no map entry: nobody else can reach it meanwhile). */
  }
  ebb__unlock(&a->mu);
  if (EBB_UNLIKELY(o.n)) {
    ebb_status st = steal_order(a, s, &o, b, aside, indexed, slab, sp);
    if (st) return st;
  }
  if (aside || !indexed) { /* s now waits for every old owner: the remainder is s's */
    ebb__lock(&a->mu);
    if (aside) aside_settle(a, aside, sp);
    if (!indexed) ebb__block_release(a, b);
    ebb__unlock(&a->mu);
    if (!indexed) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the pointer map", a->up->alloc_fn);
  }
  if (slab) *bout = b;
  else *out = (void *)(uintptr_t)b->addr;
  return EBB_OK;
}

/* ---- free ------------------------------------------------------------------------------------ */

ebb_status ebb__arena_free(const char *fn, void *ptr, enum ebb__memkind kind) {
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  struct ebb__block *b;
  /* A slot, or a large block taken out of the address map (which elects this call as its one
   * free: a racing second free finds no entry, or after the lock a block no longer ALLOC at
   * addr); arena locked. */
  struct ebb__slab *sl = ebb__addr_lookup_lock(addr, kind, &b);
  if (sl) return ebb__slab_free(fn, sl, addr, kind);
  struct ebb__arena *a;
  if (EBB_LIKELY(b)) {
    a = b->arena;
    if (EBB_UNLIKELY(b->kind != kind)) { /* another pool's live block: its entry stayed */
      ebb__unlock(&a->mu);
      return ebb__wrong_pool(fn, ptr, a, kind);
    }
  } else {
    /* A smaller block, in the ptrmap: validated and taken out under its arena's lock, as the
     * address map's entries are. Of two racing frees the second then finds it no longer ALLOC,
     * a wrong-pool free leaves the entry for the owner's, and the debug walk (under the lock)
     * never sees a live block without its entry. */
    b = ebb__ptrmap_find(addr);
    if (EBB_UNLIKELY(!b)) return ebb__explain(fn, ptr, kind);
    a = b->arena; /* kind and arena: fixed for the record's whole life */
    if (EBB_UNLIKELY(b->kind != kind)) return ebb__wrong_pool(fn, ptr, a, kind);
    ebb__lock(&a->mu);
    if (EBB_UNLIKELY(b->addr != addr || b->state != EBB__B_ALLOC || ebb__block_in_amap(b))) {
      ebb__unlock(&a->mu); /* freed (the record perhaps reused) since the lookup */
      return ebb__explain(fn, ptr, kind);
    }
    struct ebb__block *t = ebb__ptrmap_take(addr);
    EBB_ASSERT(t == b);
    (void)t;
  }
  /* The merge below reads both address neighbours: start both misses now, overlapping each
   * other and the bookkeeping before the merge. Under the lock: a neighbour's split or merge
   * rewrites these links, so reading them unlocked would race. */
  __builtin_prefetch(b->prev);
  __builtin_prefetch(b->next);
  EBB_ASSERT(b->addr == addr && b->state == EBB__B_ALLOC);
  ebb__stat_sub(&a->c.s.allocated_bytes, b->size);
  ebb__stat_sub(&a->c.s.requested_bytes, b->requested);
  a->c.s.free_count++;
  if (EBB_LIKELY(!b->nuses)) {
    /* No other stream used it: the free completes now. Both entries at once, one clock read
     * and the fields gathered once (the completion repeats the request). */
    ebb__hist_rec_free_pair(a, b->addr, b->size, b->requested, b->spool->stream.id, b->owner_cat, b->owner);
    block_release_t(a, b, true);
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  ebb__hist_rec(a, EBB_ACT_FREE_REQUESTED, b->addr, b->size, b->requested, b->spool->stream.id, b->owner_cat, b->owner);
  /* Used on other streams: one event on each, recorded now; the block waits for all of them.
   * FREEING keeps everyone off the block while the lock is dropped (it is in neither the ptrmap
   * nor the index, so only this thread reaches it). */
  b->state = EBB__B_FREEING;
  uint32_t n = b->nuses;
  ebb_event_t *small[EBB__SMALL_EVS], **evs = n <= EBB_ARRAY_LEN(small) ? small : calloc(n, sizeof *evs);
  struct ebb__lost lost = {0};
  ebb__uses_record(a, b->uses, n, evs, &lost);
  b->state = EBB__B_PENDING;
  b->event_count = 0;
  ebb__uses_queue(a, b->uses, n, evs, b, NULL, 0, &b->event_count, &lost);
  b->nuses = 0;
  if (EBB_UNLIKELY(lost.n)) { /* held back: an event that never comes */
    b->event_count++;
    a->nheld++;
  }
  if (!b->event_count) ebb__block_release(a, b);
  ebb__unlock(&a->mu);
  if (evs != small) free(evs);
  if (EBB_UNLIKELY(lost.n)) ebb__lost_warn(fn, ptr, &lost);
  return EBB_OK;
}

/* ---- release paths, limits, stats ---------------------------------------------------------- */

ebb_status ebb__arena_empty_cache(struct ebb__arena *a) {
  ebb_status st = EBB_OK;
  ebb__lock(&a->mu);
  /* (failed unmaps and releases of earlier OOM retry chains, which report none, are reported
   * below with this call's) */
  ebb__poll_pending(a);
  ebb__sync_pending(a);
  /* Empty slabs first: their blocks merge back, so the segments below may become free. */
  ebb__slab_release_empty(a);
  if (a->xseg) {
    /* Unmapping does not wait for queued work on every driver: wait for this arena's device
     * (not the caller's current one) first, with the lock held, as the OOM retry chain does
     * (and PyTorch). With it dropped, another thread could free a block whose
     * stream still has work queued on it after the synchronisation began; x_shrink would then
     * unmap memory that work is using. When the synchronisation fails nothing is unmapped
     * (work may still run there) and the caller hears why; classic segments below are still
     * given back, their driver free synchronising by itself. */
    st = ebb_dev_synchronize(a->device);
    a->c.s.num_syncs++;
    if (st) st = ebb__sync_failed(a, "ebb_arena_empty_cache", st);
    else ebb__x_shrink(a);
  }
  release_free_segments(a);
  /* Granules that failed to unmap stay mapped and are kept (xseg.c): the cache is not empty,
   * and the caller hears why. */
  unsigned xfails = a->xunmap_fails;
  ebb_status xst = a->xunmap_st;
  char why[sizeof a->xunmap_why];
  if (EBB_UNLIKELY(xfails)) memcpy(why, a->xunmap_why, sizeof why);
  a->xunmap_fails = 0;
  ebb__unlock(&a->mu);
  if (EBB_UNLIKELY(xfails) && !st)
    st = ebb__fail(xst, "ebb_arena_empty_cache: %u granule(s) of %s could not be given back (a failed unmap keeps the granule "
                   "mapped for later growth; a failed release after the unmap leaks its chunk): %s", xfails, a->label, why);
  return st;
}

size_t ebb__arena_trim(struct ebb__arena *a) {
  ebb__lock(&a->mu);
  ebb__slab_release_empty(a);
  size_t n = release_free_segments(a);
  ebb__unlock(&a->mu);
  return n;
}

void ebb__arena_set_limit(struct ebb__arena *a, size_t bytes) {
  ebb__lock(&a->mu);
  a->limit = bytes;
  ebb__unlock(&a->mu);
}

void ebb__arena_get_stats(struct ebb__arena *a, ebb_arena_stats *out) {
  ebb__lock(&a->mu);
  /* Frees waiting for events that have completed are retired first, so active_bytes (and the
   * free counts) say what the device has really finished with; a query per stream's oldest
   * pending event, never a host wait. */
  ebb__poll_pending(a);
  *out = a->c.s;
  out->limit = a->limit;
  out->num_steals = a->c.steals;
  ebb__unlock(&a->mu);
}

void ebb__arena_reset_peak(struct ebb__arena *a) {
  ebb__lock(&a->mu);
  ebb_arena_stat *all[] = {&a->c.s.allocated_bytes, &a->c.s.reserved_bytes, &a->c.s.active_bytes, &a->c.s.requested_bytes,
                           &a->c.s.segments, &a->c.s.inactive_split, &a->c.s.inactive_split_bytes};
  for (size_t i = 0; i < EBB_ARRAY_LEN(all); i++) all[i]->peak = all[i]->current;
  ebb__unlock(&a->mu);
}

/* ---- life cycle ---------------------------------------------------------------------------- */

void ebb__arena_init(struct ebb__arena *a, const struct ebb__upstream *up, int device, const struct ebb__conf *conf,
                     size_t total_mem) {
  memset(a, 0, sizeof *a);
  ebb__lock_init(&a->mu, "arena", EBB_RANK_ARENA);
  a->up = up;
  a->device = device;
  a->numa_node = -1;
  /* The pools' own names; host.c adds the NUMA node of a pinned arena once it is known. */
  if (up->kind == EBB__MEM_DEVICE_ARENA) snprintf(a->label, sizeof a->label, "device %d", device);
  else snprintf(a->label, sizeof a->label, "%s pool", up->name);
  a->conf = *conf;
  /* The pinned and host pools never wait on the allocation path (include/ebb/alloc.h). */
  if (up->kind != EBB__MEM_DEVICE_ARENA) a->conf.wait_pending_us = 0;
  a->total_mem = total_mem;
  ebb_list_init(&a->segments);
  ebb_list_init(&a->unpin_due);
  a->unpin_at = UINT64_MAX;
  ebb_list_init(&a->pend_spare);
  ebb_list_init(&a->block_spare);
  ebb_list_init(&a->slab_spare);
  ebb__hist_init(a);
  a->started = true;
}

void ebb__arena_fini(struct ebb__arena *a) {
  if (!a->started) return;
  ebb__pending_fini(a);
  struct ebb_list *n;
  /* Leaked blocks go back with their segments, silently (the caller's leak, not ours). */
  while ((n = ebb_list_pop_head(&a->segments))) {
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    if (!g->expandable) a->up->release(a, g->base, g->size);
    free(g);
  }
  ebb__x_fini(a);
  ebb__slab_fini(a);
  for (size_t i = 0; i < a->nslabs; i++) {
    struct ebb__block *slab = a->slabs[i];
    for (int k = 0; k < EBB__SLAB_BLOCKS; k++) free(slab[k].uses);
    free(slab);
  }
  free(a->slabs);
  ebb__fidx_fini(a);
  ebb__hist_fini(a);
  memset(a, 0, sizeof *a);
}
