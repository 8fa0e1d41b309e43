/* check.c: the debug walk of an arena (ebb_arena_debug_check and the pools' own): every
 * segment's blocks tile it, each block's state agrees with the index that should hold it (a free
 * block in its stream's free index and in no pointer map, a live block in the address map or the
 * ptrmap, a hole unmapped), free neighbours of one stream are merged, each segment's and spool's
 * counts match what the walk finds, pending events match the queues, and the counters behind
 * ebb_arena_stats equal the sums of the walk. The free index and the slabs check their own
 * structures (fidx.c, slab.c); this file walks the segments and adds up.
 *
 * Owns nothing: it reads.
 *
 * Threading: the whole walk holds the arena's lock (nothing is dropped), so it sees one
 * consistent state; blocks and slabs that another thread is carving with the lock dropped show
 * as EBB__B_CARVED or EBB__B_ASIDE and are counted as such.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "arena_impl.h"

/* Whether the index for b's size (address map or ptrmap) holds b at its address; and its name. */
static bool block_indexed(const struct ebb__block *b) {
  return (ebb__block_in_amap(b) ? ebb__amap_block_find(b->addr) : ebb__ptrmap_find(b->addr)) == b;
}
static const char *block_index_name(const struct ebb__block *b) {
  return ebb__block_in_amap(b) ? "address map" : "pointer map";
}

/* Every block's spool is one the arena holds (a hole's is none), and each spool counts exactly
 * its blocks in use (spool_reap (fidx.c) frees one only at zero). Lock held. */
static ebb_status spool_check(struct ebb__arena *a, const char *fn) {
  size_t *inuse = calloc(a->nspools + 1, sizeof *inuse);
  if (!inuse) return EBB_OK; /* no host memory for the tally: this part of the walk is skipped */
  ebb_status st = EBB_OK;
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next)
    for (const struct ebb__block *b = ebb_container_of(n, struct ebb__segment, node)->first; b; b = b->next) {
      if (b->state == EBB__B_UNMAPPED) continue;
      size_t i = 0;
      while (i < a->nspools && a->spools[i] != b->spool) i++;
      EBB__CHECK(i < a->nspools, "%s: %s: block 0x%" PRIx64 " (state %d) names a stream pool the arena no longer holds", fn,
                 a->label, b->addr, b->state);
      inuse[i] += b->state != EBB__B_FREE && b->state != EBB__B_ASIDE;
    }
  for (size_t i = 0; i < a->nspools; i++)
    EBB__CHECK(a->spools[i]->nlive == inuse[i], "%s: %s: stream %" PRIu64 "'s pool counts %zu blocks in use, the walk found %zu",
               fn, a->label, a->spools[i]->stream.id, a->spools[i]->nlive, inuse[i]);
done:
  free(inuse);
  return st;
}

ebb_status ebb__arena_check(struct ebb__arena *a, const char *fn) {
  ebb_status st = EBB_OK;
  ebb__lock(&a->mu);
  uint64_t alloc = 0, active = 0, reserved = 0, nseg = 0, isplit = 0, isplit_b = 0, requested = 0;
  size_t nfree = 0, pend_events = 0, stuck = 0;
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    nseg++;
    reserved += g->size - g->unmapped;
    size_t holes = 0;
    uint64_t at = g->base;
    size_t nb = 0, nf = 0, fb = 0, ncached = 0;
    EBB__CHECK(g->first && !g->first->prev, "%s: %s: segment 0x%" PRIx64 " has no first block", fn, a->label, g->base);
    for (struct ebb__block *b = g->first; b; b = b->next) {
      nb++;
      EBB__CHECK(b->addr == at, "%s: %s: block 0x%" PRIx64 " should start at 0x%" PRIx64 " (blocks must tile their segment)",
                 fn, a->label, b->addr, at);
      EBB__CHECK(b->seg == g && b->arena == a, "%s: %s: block 0x%" PRIx64 " points at the wrong segment", fn, a->label, b->addr);
      EBB__CHECK(!b->next || b->next->prev == b, "%s: %s: block 0x%" PRIx64 " has a broken next link", fn, a->label, b->addr);
      EBB__CHECK(b->size >= EBB__MIN_BLOCK && b->size % EBB__MIN_BLOCK == 0, "%s: %s: block 0x%" PRIx64 " has size %zu",
                 fn, a->label, b->addr, b->size);
      at += b->size;
      switch (b->state) {
      case EBB__B_FREE:
        nf++;
        fb += b->size;
        nfree++;
        EBB__CHECK(!ebb__mergeable(b, b->next), "%s: %s: free blocks 0x%" PRIx64 " and 0x%" PRIx64 " of one stream were not merged",
                   fn, a->label, b->addr, b->next->addr);
        EBB__CHECK(!block_indexed(b), "%s: %s: free block 0x%" PRIx64 " is still in the %s", fn, a->label, b->addr,
                   block_index_name(b));
        break;
      case EBB__B_ALLOC:
        alloc += b->size;
        active += b->size;
        requested += b->requested;
        EBB__CHECK(block_indexed(b), "%s: %s: live block 0x%" PRIx64 " is missing from the %s", fn, a->label,
                   b->addr, block_index_name(b));
        break;
      case EBB__B_UNMAPPED:
        holes += b->size;
        EBB__CHECK(g->expandable && (b->addr - a->xva) % a->xgran == 0 && b->size % a->xgran == 0,
                   "%s: %s: hole 0x%" PRIx64 " (%zu bytes) is not whole granules of the expandable segment", fn, a->label,
                   b->addr, b->size);
        EBB__CHECK(!b->next || b->next->state != EBB__B_UNMAPPED, "%s: %s: adjacent holes at 0x%" PRIx64 " were not merged",
                   fn, a->label, b->addr);
        EBB__CHECK(b->next, "%s: %s: the expandable segment ends in a hole at 0x%" PRIx64, fn, a->label, b->addr);
        for (uint64_t va = b->addr; va < b->addr + b->size; va += a->xgran) {
          stuck += a->xhandles[(va - a->xva) / a->xgran] != 0;
          EBB__CHECK(stuck <= a->xstuck, "%s: %s: granule 0x%" PRIx64 " of a hole is still mapped (%zu whose unmap failed)",
                     fn, a->label, va, a->xstuck);
        }
        break;
      case EBB__B_SLAB:
        st = ebb__slab_check(a, b, fn, &alloc, &active, &requested, &isplit, &isplit_b, &pend_events, &ncached);
        if (st) goto done;
        break;
      case EBB__B_PENDING:
      case EBB__B_FREEING:
        active += b->size;
        pend_events += b->event_count;
        break;
      case EBB__B_ASIDE: /* another thread's steal, mid-way: free, in no index */
        nf++;
        fb += b->size;
        break;
      case EBB__B_CARVED: /* another thread's slab, mid-way: no record, no slots, no stats yet */
        break;
      default:
        EBB__CHECK(0, "%s: %s: block 0x%" PRIx64 " has state %d", fn, a->label, b->addr, b->state);
      }
    }
    EBB__CHECK(at == g->base + g->size, "%s: %s: segment 0x%" PRIx64 " blocks end at 0x%" PRIx64 ", expected 0x%" PRIx64, fn,
               a->label, g->base, at, g->base + g->size);
    EBB__CHECK(holes == g->unmapped, "%s: %s: segment 0x%" PRIx64 " has %zu bytes of holes, counted %zu", fn, a->label,
               g->base, holes, g->unmapped);
    EBB__CHECK(nb == g->nblocks && nf == g->nfree && fb == g->free_bytes, "%s: %s: segment 0x%" PRIx64 " counts are stale", fn,
               a->label, g->base);
    EBB__CHECK(ncached == g->ncached, "%s: %s: segment 0x%" PRIx64 " holds %zu empty slabs, counted %zu", fn, a->label, g->base,
               ncached, g->ncached);
    EBB__CHECK(!ncached || nf + ncached < nb || !ebb_list_empty(&g->unpin),
               "%s: %s: segment 0x%" PRIx64 " holds only free blocks and %zu empty slabs, and is not due to give them back", fn,
               a->label, g->base, ncached);
    if (!g->expandable && nb > 1) {
      isplit += nf;
      isplit_b += fb;
    }
  }
  size_t indexed = 0;
  if ((st = ebb__fidx_check(a, fn, &indexed))) goto done;
  EBB__CHECK(indexed == nfree, "%s: %s: %zu free blocks but %zu indexed", fn, a->label, nfree, indexed);
  if ((st = spool_check(a, fn))) goto done;
  if ((st = ebb__slab_check_classes(a, fn))) goto done;
  EBB__CHECK(pend_events == a->npending + a->nheld, "%s: %s: %zu pending events and %zu held back, blocks expect %zu", fn,
             a->label, a->npending, a->nheld, pend_events);
  const ebb_arena_stats *s = &a->c.s;
  EBB__CHECK(s->allocated_bytes.current == alloc && s->active_bytes.current == active && s->requested_bytes.current == requested,
             "%s: %s: stats allocated %" PRIu64 "/active %" PRIu64 "/requested %" PRIu64 ", walk found %" PRIu64 "/%" PRIu64
             "/%" PRIu64,
             fn, a->label, s->allocated_bytes.current, s->active_bytes.current, s->requested_bytes.current, alloc, active, requested);
  /* Granules whose unmap failed stay mapped, outside any block: reserved counts them. */
  reserved += (uint64_t)a->xstuck * a->xgran;
  EBB__CHECK(s->reserved_bytes.current == reserved && s->segments.current == nseg,
             "%s: %s: stats reserved %" PRIu64 " in %" PRIu64 " segments, walk found %" PRIu64 " in %" PRIu64, fn, a->label,
             s->reserved_bytes.current, s->segments.current, reserved, nseg);
  EBB__CHECK(s->inactive_split.current == isplit && s->inactive_split_bytes.current == isplit_b,
             "%s: %s: stats inactive_split %" PRIu64 " (%" PRIu64 " B), walk found %" PRIu64 " (%" PRIu64 " B)", fn, a->label,
             s->inactive_split.current, s->inactive_split_bytes.current, isplit, isplit_b);
done:
  ebb__unlock(&a->mu);
  return st;
}
