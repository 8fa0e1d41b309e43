/* xseg.c: expandable segments. With expandable_segments on and an upstream that maps (VMM), an
 * arena has one segment: a virtual reservation (the device's memory and an eighth, reserved at
 * the first growth) mapped granule by granule from its start. Growth maps granules at the tail,
 * or into a hole that empty_cache or the OOM retry left; shrinking joins free runs of every
 * stream, cuts the free tail and unmaps the whole granules inside free blocks (EBB__B_UNMAPPED
 * holes), so the segment gives memory back without moving a block.
 *
 * Owns: the reservation, the granule table (one physical handle per mapped granule) and the
 * holes; the blocks and the segment record are the engine's (arena.c).
 *
 * Threading: under the arena's lock throughout, VMM map and unmap included: the mapped tail is
 * the shared state being changed. The caller of ebb__x_shrink has synchronised the device with
 * the lock held, so no work queued on a freed block can run on a granule as it is unmapped.
 */
#include <stdio.h>
#include <stdlib.h>

#include "arena_impl.h"

/* Unmaps granule `at`. One that fails to unmap is still mapped: its handle stays in the table
 * (released, it would leave the range mapped to memory nobody tracks), counted in xstuck, and
 * the next growth over it takes it as it is. Muted: the caller goes on (an allocation's retry
 * chain, or empty_cache, which reports the first failure). Lock held. */
static bool granule_unmap(struct ebb__arena *a, uint64_t at) {
  uint64_t *h = &a->xhandles[(at - a->xva) / a->xgran];
  ebb__fail_mute(true);
  ebb_status st = a->up->unmap(a, at, a->xgran, *h);
  if (st && !a->xunmap_fails++) {
    a->xunmap_st = st;
    snprintf(a->xunmap_why, sizeof a->xunmap_why, "%s", ebb__muted_error());
  }
  ebb__fail_mute(false);
  if (st) {
    a->xstuck++;
    return false;
  }
  *h = 0;
  return true;
}

/* Maps granules [va, va + bytes) of the reservation, all or nothing. A granule still mapped
 * (its unmap failed) is taken as it is: it is counted in reserved_bytes already, so it is taken
 * out here, the callers counting the whole range once mapped; on a failure only the granules
 * this call mapped are unmapped again. Lock held. */
static ebb_status x_map(struct ebb__arena *a, uint64_t va, size_t bytes) {
  const size_t n = bytes / a->xgran;
  uint64_t *slots = &a->xhandles[(va - a->xva) / a->xgran];
  uint64_t *mine = NULL; /* bit k: granule k mapped by this call (only with stuck granules about) */
  if (EBB_UNLIKELY(a->xstuck)) {
    mine = calloc((n + 63) / 64, sizeof *mine);
    if (!mine) return ebb__fail(EBB_ENOMEM, "%s: no host memory to map %zu granules of %s", a->up->alloc_fn, n, a->label);
  }
  size_t k = 0, reused = 0;
  ebb_status st = EBB_OK;
  for (; k < n; k++) {
    if (EBB_UNLIKELY(slots[k])) {
      reused++;
      continue;
    }
    uint64_t h = 0;
    if ((st = a->up->map(a, va + k * a->xgran, a->xgran, &h))) break;
    slots[k] = h;
    if (mine) mine[k / 64] |= 1ull << (k % 64);
  }
  if (!st) {
    a->xstuck -= reused;
    a->c.s.num_device_alloc += n - reused;
    ebb__stat_sub(&a->c.s.reserved_bytes, reused * a->xgran);
  } else {
    /* One that fails to unmap now is stuck, still mapped: counted from now on. */
    for (size_t j = 0; j < k; j++)
      if ((!mine || (mine[j / 64] >> (j % 64) & 1)) && !granule_unmap(a, va + j * a->xgran))
        ebb__stat_add(&a->c.s.reserved_bytes, a->xgran);
  }
  free(mine);
  return st;
}

/* Unmaps granules [va, va + bytes) of the reservation; returns the bytes of those that failed
 * to unmap and stay mapped (stuck), which the callers, taking the range out of reserved_bytes,
 * count back. Lock held. */
static size_t x_unmap(struct ebb__arena *a, uint64_t va, size_t bytes) {
  size_t stuck = 0;
  for (uint64_t at = va; at < va + bytes; at += a->xgran) {
    if (granule_unmap(a, at)) a->c.s.num_device_free++;
    else stuck += a->xgran;
  }
  return stuck;
}

/* Growth into a hole: maps the first UNMAPPED hole that holds `r` (in whole granules) from its
 * start and hands the mapped piece to stream `sp`, pool `pool`, merged with its free
 * neighbours. EBB_ENOTFOUND when no hole is big enough (the caller grows the tail). First fit
 * by address keeps the mapped range dense at the start of the reservation. Lock held. */
static ebb_status x_fill_hole(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r) {
  struct ebb__segment *g = a->xseg;
  size_t need = ebb__round_up(r, a->xgran);
  struct ebb__block *h = g->first;
  while (h && !(h->state == EBB__B_UNMAPPED && h->size >= need)) h = h->next;
  if (!h) return EBB_ENOTFOUND;
  if (a->limit && a->c.s.reserved_bytes.current + a->inflight + need > a->limit)
    return ebb__fail(EBB_ENOMEM, "limit of %s reached", a->label);
  struct ebb__block *m = h;
  if (h->size > need && !(m = ebb__block_new(a)))
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for a block record", a->up->alloc_fn);
  ebb_status st = x_map(a, h->addr, need);
  if (st) {
    if (m != h) ebb__block_dead(a, m);
    return st;
  }
  if (m != h) { /* m takes the front of the hole; h keeps the rest, still unmapped */
    m->addr = h->addr;
    m->size = need;
    m->seg = g;
    m->prev = h->prev;
    m->next = h;
    if (h->prev) h->prev->next = m;
    else g->first = m;
    h->prev = m;
    h->addr += need;
    h->size -= need;
    g->nblocks++;
  }
  uint8_t ocat;
  const char *oname;
  ebb__owner_current(&ocat, &oname);
  ebb__hist_rec(a, EBB_ACT_SEGMENT_MAP, m->addr, need, 0, sp->stream.id, ocat, oname);
  m->state = EBB__B_FREE;
  m->spool = sp;
  m->pool = (uint8_t)pool;
  g->unmapped -= need;
  g->nfree++;
  g->free_bytes += need;
  ebb__stat_add(&a->c.s.reserved_bytes, need);
  ebb__merge_insert(a, m);
  return EBB_OK;
}

/* Maps `grow` bytes after the first `mapped` of the reservation, all or nothing (which keeps the
 * tail simple), within the reservation and the limit. Lock held. */
static ebb_status x_map_tail(struct ebb__arena *a, size_t mapped, size_t grow) {
  if (mapped + grow > a->xva_size) return ebb__fail(EBB_ENOMEM, "the expandable reservation of %s is full", a->label);
  if (a->limit && a->c.s.reserved_bytes.current + a->inflight + grow > a->limit)
    return ebb__fail(EBB_ENOMEM, "limit of %s reached", a->label);
  return x_map(a, a->xva + mapped, grow);
}

/* Maps granules at the end of the reservation so that the tail offers `r` bytes to stream
 * `sp`, pool `pool`, after trying the holes left by empty_cache. Lock held throughout (see the
 * file comment). */
ebb_status ebb__x_grow(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r, struct ebb__tried *tried) {
  if (!a->xva) {
    size_t gran = 0;
    ebb_status st = a->up->granularity(a, &gran);
    if (st) return st;
    size_t want = ebb__round_up(a->total_mem + a->total_mem / 8, gran);
    st = a->up->reserve(a, want, &a->xva);
    if (st) return st;
    a->xhandles = calloc(want / gran, sizeof *a->xhandles);
    if (!a->xhandles) {
      a->up->unreserve(a, a->xva, want);
      a->xva = 0;
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for the granule table of %s", a->up->alloc_fn, a->label);
    }
    a->xva_size = want;
    a->xgran = gran;
    ebb__span_add(a, a->xva, want); /* the whole reservation: growth stays inside it */
  }
  struct ebb__segment *g = a->xseg;
  if (g && g->unmapped) {
    ebb_status st = x_fill_hole(a, sp, pool, r);
    if (st != EBB_ENOTFOUND) return st;
  }
  size_t mapped = g ? g->size : 0;
  struct ebb__block *tail = NULL;
  if (g)
    for (tail = g->first; tail->next; tail = tail->next) {}
  size_t have = tail && tail->state == EBB__B_FREE && tail->spool == sp && tail->pool == pool ? tail->size : 0;
  /* Grow by the granules the request needs beyond the free tail, no more: a larger step (2 or
   * 20 MiB, PyTorch's pages) leaves up to that much mapped and unused at the reserved peak
   * (perf/JOURNAL.md, "Placement on real training traces"). The driver calls are as many (one per
   * granule), in more growths. */
  size_t grow = ebb__round_up(r - have, a->xgran);
  if (tried) *tried = (struct ebb__tried){.first = grow, .second = 0, .expandable = true};
  /* The record of a new tail block before mapping: once mapped and counted, the granules must be
   * covered by a block, and a record that cannot be had then would leave them untiled. */
  struct ebb__block *b = NULL;
  if (g && !have && !(b = ebb__block_new(a)))
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for a block record", a->up->alloc_fn);
  ebb_status st = x_map_tail(a, mapped, grow);
  if (st) {
    if (b) ebb__block_dead(a, b);
    return st;
  }
  uint8_t ocat;
  const char *oname;
  ebb__owner_current(&ocat, &oname);
  ebb__hist_rec(a, EBB_ACT_SEGMENT_MAP, a->xva + mapped, grow, 0, sp->stream.id, ocat, oname);
  if (!g) {
    g = ebb__segment_add(a, a->xva, grow, pool, sp, &b); /* counts reserved and segments */
    if (!g) {
      ebb__hist_rec(a, EBB_ACT_SEGMENT_UNMAP, a->xva, grow, 0, sp->stream.id, ocat, oname);
      ebb__stat_add(&a->c.s.reserved_bytes, x_unmap(a, a->xva, grow)); /* (stuck granules stay counted) */
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for a segment record", a->up->alloc_fn);
    }
    g->expandable = true;
    a->xseg = g;
    ebb__index_insert(a, b);
    return EBB_OK;
  }
  ebb__stat_add(&a->c.s.reserved_bytes, grow);
  g->size += grow;
  if (have) {
    ebb__index_remove(tail);
    tail->size += grow;
    g->free_bytes += grow;
    ebb__index_insert(a, tail);
    return EBB_OK;
  }
  b->addr = a->xva + mapped;
  b->size = grow;
  b->seg = g;
  b->spool = sp;
  b->pool = (uint8_t)pool;
  b->state = EBB__B_FREE;
  b->prev = tail;
  /* A free tail of another stream stops being the segment's end: the index keeps it elsewhere
   * now (fidx.c). */
  bool rekey = tail->state == EBB__B_FREE;
  if (rekey) ebb__index_remove(tail);
  tail->next = b;
  if (rekey) ebb__index_insert(a, tail);
  g->nblocks++;
  g->nfree++;
  g->free_bytes += grow;
  ebb__index_insert(a, b);
  return EBB_OK;
}

/* Makes the granule-aligned inside of FREE block b a hole: unmaps it and splits b into a free
 * head, the UNMAPPED hole and a free tail (either piece may be empty), merging the hole with
 * neighbouring holes. Returns the bytes unmapped (0 when b holds no whole granule or no block
 * record is left for the pieces) and, when some were, points *bp at the (merged) hole. Lock
 * held; the caller synchronised the device. */
static size_t x_hole(struct ebb__arena *a, struct ebb__segment *g, struct ebb__block **bp) {
  struct ebb__block *b = *bp;
  uint64_t lo = a->xva + ebb__round_up(b->addr - a->xva, a->xgran);
  uint64_t hi = a->xva + (b->addr + b->size - a->xva) / a->xgran * a->xgran;
  if (hi <= lo) return 0;
  size_t head = (size_t)(lo - b->addr), tail = (size_t)(b->addr + b->size - hi), hole = (size_t)(hi - lo);
  struct ebb__block *nh = head ? ebb__block_new(a) : NULL, *nt = tail ? ebb__block_new(a) : NULL;
  if ((head && !nh) || (tail && !nt)) { /* no host memory for the pieces: keep the block mapped */
    if (nh) ebb__block_dead(a, nh);
    if (nt) ebb__block_dead(a, nt);
    return 0;
  }
  ebb__hist_rec(a, EBB_ACT_SEGMENT_UNMAP, lo, hole, 0, b->spool->stream.id, EBB_OWNER_OTHER, "");
  size_t stuck = x_unmap(a, lo, hole);
  ebb__index_remove(b);
  struct ebb__block *pieces[2] = {nh, nt};
  for (int k = 0; k < 2; k++) {
    struct ebb__block *x = pieces[k];
    if (!x) continue;
    x->addr = k ? hi : b->addr;
    x->size = k ? tail : head;
    x->seg = g;
    x->spool = b->spool;
    x->pool = b->pool;
    x->state = EBB__B_FREE;
    if (k) { /* after b */
      x->prev = b;
      x->next = b->next;
      if (b->next) b->next->prev = x;
      b->next = x;
    } else { /* before b */
      x->next = b;
      x->prev = b->prev;
      if (b->prev) b->prev->next = x;
      else g->first = x;
      b->prev = x;
    }
    g->nblocks++;
    ebb__index_insert(a, x);
  }
  b->addr = lo;
  b->size = hole;
  b->state = EBB__B_UNMAPPED;
  b->spool = NULL; /* nobody's: a growth into it names its stream */
  g->nfree += (nh != NULL) + (nt != NULL) - 1; /* b left the free blocks, its pieces joined */
  g->free_bytes -= hole;
  g->unmapped += hole;
  ebb__stat_sub(&a->c.s.reserved_bytes, hole);
  ebb__stat_add(&a->c.s.reserved_bytes, stuck); /* still mapped: counted until a growth takes them */
  /* Adjacent holes become one, so a later growth finds the whole gap. */
  struct ebb__block *p = b->prev, *n = b->next;
  if (p && p->state == EBB__B_UNMAPPED) {
    p->size += b->size;
    p->next = n;
    if (n) n->prev = p;
    g->nblocks--;
    ebb__block_dead(a, b);
    b = p;
  }
  n = b->next;
  if (n && n->state == EBB__B_UNMAPPED) {
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    g->nblocks--;
    ebb__block_dead(a, n);
  }
  *bp = b;
  return hole;
}

/* Joins each run of adjacent free blocks of expandable segment g into one, whatever their
 * streams and pools, owned by the run's first block's. Free blocks merge only within a stream
 * and pool (stream order), so a granule that two streams' free pieces share lies whole inside
 * neither, and could never be unmapped. After a wait for the whole device no stream has work
 * left on free memory, so any stream may own it. Lock held; the caller synchronised the
 * device. */
static void x_join(struct ebb__arena *a, struct ebb__segment *g) {
  for (struct ebb__block *b = g->first; b; b = b->next) {
    struct ebb__block *n = b->next;
    if (b->state != EBB__B_FREE || !n || n->state != EBB__B_FREE) continue;
    ebb__index_remove(b);
    do {
      ebb__index_remove(n);
      b->size += n->size;
      b->next = n->next;
      if (n->next) n->next->prev = b;
      g->nblocks--;
      g->nfree--;
      ebb__block_dead(a, n);
    } while ((n = b->next) && n->state == EBB__B_FREE);
    ebb__index_insert(a, b);
  }
}

/* The failure of the device synchronisation that must come before unmapping granules (the
 * driver's message was ebb_dev_synchronize's): status `st` and a message naming the call, the
 * arena and that nothing was unmapped. */
ebb_status ebb__sync_failed(struct ebb__arena *a, const char *fn, ebb_status st) {
  char why[384];
  snprintf(why, sizeof why, "%s", ebb_last_error());
  return ebb__fail(st, "%s: %s: the device synchronisation before unmapping free granules failed, so nothing was unmapped: %s",
                   fn, a->label, why);
}

/* Gives the expandable segment's fully free granules back to the driver: free runs are joined
 * (x_join), the free tail is cut (the span shrinks), then every whole granule inside a
 * free block becomes a hole that later growth maps again (x_fill_hole). Lock held. The
 * caller synchronised pending events and the device: unmapping must not race queued work, which
 * may still read or write the granules (the driver does not wait for it). */
size_t ebb__x_shrink(struct ebb__arena *a) {
  struct ebb__segment *g = a->xseg;
  if (!g) return 0;
  x_join(a, g);
  size_t released = 0;
  for (;;) {
    struct ebb__block *tail;
    for (tail = g->first; tail->next; tail = tail->next) {}
    if (tail->state == EBB__B_UNMAPPED) {
      /* A hole at the end (its mapped successor was cut): the span just ends before it. */
      g->size -= tail->size;
      g->unmapped -= tail->size;
    } else {
      if (tail->state != EBB__B_FREE) break;
      uint64_t cut = a->xva + ebb__round_up(tail->addr - a->xva, a->xgran);
      uint64_t end = a->xva + g->size;
      if (cut >= end) break;
      ebb__hist_rec(a, EBB_ACT_SEGMENT_UNMAP, cut, end - cut, 0, tail->spool->stream.id, EBB_OWNER_OTHER, "");
      size_t stuck = x_unmap(a, cut, end - cut);
      size_t cutn = end - cut;
      ebb__index_remove(tail);
      g->size -= cutn;
      g->free_bytes -= cutn;
      ebb__stat_sub(&a->c.s.reserved_bytes, cutn);
      ebb__stat_add(&a->c.s.reserved_bytes, stuck); /* still mapped: counted until a growth takes them */
      released += cutn;
      tail->size -= cutn;
      if (tail->size) {
        ebb__index_insert(a, tail);
        break;
      }
      g->nfree--;
    }
    g->nblocks--;
    if (tail->prev) {
      struct ebb__block *np = tail->prev;
      /* A free block that now ends the segment is the index's tail (fidx.c). */
      bool rekey = np->state == EBB__B_FREE;
      if (rekey) ebb__index_remove(np);
      np->next = NULL;
      if (rekey) ebb__index_insert(a, np);
      ebb__block_dead(a, tail);
      continue; /* the new tail may be a free block of another stream, or a hole */
    }
    /* Nothing mapped any more: drop the segment (the reservation stays for the next growth). */
    ebb__block_dead(a, tail);
    ebb_list_remove(&g->node);
    ebb_list_remove(&g->unpin);
    free(g);
    a->xseg = NULL;
    ebb__stat_sub(&a->c.s.segments, 1);
    return released;
  }
  for (struct ebb__block *b = g->first; b; b = b->next) {
    if (b->state != EBB__B_FREE) continue;
    released += x_hole(a, g, &b); /* b: the hole now, when one was made; resume after it */
  }
  return released;
}

void ebb__x_fini(struct ebb__arena *a) {
  if (!a->xva) return;
  size_t mapped = 0;
  for (size_t k = 0; k < a->xva_size / a->xgran; k++)
    if (a->xhandles[k]) mapped = (k + 1) * a->xgran;
  /* Best effort at teardown: the device is idle and the context goes next, with what it holds. */
  for (size_t off = 0; off < mapped; off += a->xgran)
    if (a->xhandles[off / a->xgran]) (void)a->up->unmap(a, a->xva + off, a->xgran, a->xhandles[off / a->xgran]);
  (void)a->up->unreserve(a, a->xva, a->xva_size);
  free(a->xhandles);
}
