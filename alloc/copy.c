/* copy.c: the copy hook alloc registers with streams (ebb__copy_hook_fn, streams_export.h).
 * ebb_copy_async calls it on each side of a copy before enqueueing it. A side inside a live
 * block of any arena (device, pinned, host pool; interior pointers too) must end within the
 * block, and the copy's stream becomes one of the block's uses unless it already is (its
 * allocation stream or a recorded one): exactly what ebb_*_record_stream would do, so a free
 * before the copy ran waits for it. Cost, with nothing to record: a side outside the range of
 * every arena's segments (driver or malloc'ed memory, mostly) is one range compare per arena;
 * a block's start or a slot is an address-map lookup (and a ptrmap probe for a small block with
 * slabs off) and the arena lock. An interior pointer of a block over 64 KiB reads the map back
 * granule by granule to the block's start (EBB__COPY_LOOKBACK at most); one of a smaller block
 * walks the segments of the arenas whose range holds it (under their locks). perf/JOURNAL.md
 * measures it ("copy_enqueue").
 *
 * Owns nothing: it reads the maps and records uses on blocks and slots (pending.c, slab.c).
 *
 * Threading: called on any thread with no lock held; takes the lock of the arena whose block it
 * finds. Never from a host function (refused: that arena's lock may be held by a thread waiting
 * for the very function).
 */
#include <inttypes.h>
#include <stdio.h>

#include "arena_impl.h"

/* Whether addr lies in the range of arena a's segments (a filter: no lock). relaxed: a block
 * handed to this thread was made after its segment widened the range, and that hand-off
 * ordered the store before this load. */
static inline bool in_span(const struct ebb__arena *a, uint64_t addr) {
  uint64_t w = atomic_load_explicit(&a->span, memory_order_relaxed), u = ebb__span_unit(addr);
  return u >= (w & UINT32_MAX) && u < (w >> 32);
}

/* Granules (64 KiB) the copy hook looks back in the address map for the start of the block an
 * interior pointer is in: 256 MiB. Past that, or for a block of 64 KiB or less, it walks the
 * segments, under the arena's lock and in time linear in the blocks of the segment. */
#define EBB__COPY_LOOKBACK 4096u

/* The live block that holds addr, locked, found by walking the segments of the arenas from
 * all[i] on whose range holds it: for an interior pointer of a block that is not a slot. NULL
 * (nothing locked) when none. */
static struct ebb__block *live_containing_lock(uint64_t addr, struct ebb__arena *const *all, int i, int n) {
  for (; i < n; i++) {
    struct ebb__arena *a = all[i];
    if (!in_span(a, addr)) continue;
    ebb__lock(&a->mu);
    struct ebb__block *b = ebb__find_containing(a, addr);
    if (b && b->state == EBB__B_ALLOC) return b;
    ebb__unlock(&a->mu);
  }
  return NULL;
}

ebb_status ebb__arena_copy_use(void *ptr, size_t bytes, bool is_dst, ebb_stream_t *s, uint64_t sid, int sdev) {
  static const char fn[] = "ebb_copy_async";
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  /* Memory of no arena (driver or malloc'ed) is the common miss: a range compare per arena. */
  int n, i = 0;
  struct ebb__arena *const *all = ebb__arenas_all(&n);
  while (i < n && !in_span(all[i], addr)) i++;
  if (i == n) return EBB_OK;
  /* From a host function, the arena lock could be held by a thread waiting for this very
   * function's device work (empty_cache with expandable segments, an OOM retry): refuse rather
   * than deadlock, before taking it (stream.h, ebb_stream_host_func). */
  if (ebb__in_host_fn())
    return ebb__fail(EBB_ESTATE, "%s: %s %p lies in the memory of the %s, called from a host function (ebb_stream_host_func), "
                     "which must not use ebb's memory pools (their lock may be held by a thread waiting for that very "
                     "function); expected the call from a host thread, after the host function signals it", fn,
                     is_dst ? "dst" : "src", ptr, all[i]->label);
  const struct ebb__stream_ref ref = {.s = s, .id = sid, .device = sdev};
  struct ebb__block *b;
  struct ebb__slab *sl = ebb__addr_lookup_lock(addr, 0, &b);
  if (sl) return ebb__slab_copy_use(fn, sl, addr, bytes, is_dst, &ref);
  if (!b && (b = ebb__ptrmap_find(addr))) {
    ebb__lock(&b->arena->mu);
    if (b->addr != addr || b->state != EBB__B_ALLOC || ebb__block_in_amap(b)) { /* freed since */
      ebb__unlock(&b->arena->mu);
      b = NULL;
    }
  }
  if (!b && (b = ebb__amap_block_before(addr, EBB__COPY_LOOKBACK))) {
    /* An interior pointer of a block over 64 KiB: the map's nearest block start below, checked
     * under its lock (the record may hold another block by now). */
    ebb__lock(&b->arena->mu);
    if (b->state != EBB__B_ALLOC || !ebb__block_in_amap(b) || addr < b->addr || addr - b->addr >= b->size) {
      ebb__unlock(&b->arena->mu);
      b = NULL;
    }
  }
  if (!b && !(b = live_containing_lock(addr, all, i, n))) return EBB_OK;
  struct ebb__arena *a = b->arena;
  uint64_t off = addr - b->addr;
  /* The bytes the caller asked for, not the rounded block: past them is another request's
   * business (or the rounding's), never this block's data. */
  if (EBB_UNLIKELY(off > b->requested || bytes > b->requested - off)) {
    uint64_t base = b->addr;
    size_t size = b->requested;
    ebb__unlock(&a->mu);
    return ebb__copy_past_end(fn, ptr, bytes, is_dst, a, base, size);
  }
  /* A pageable source is read into the staging chunks before ebb_copy_async returns (streams/copy.c
   * stage): no work on s reads it later, so there is no use to record. */
  if (!is_dst && a->up->kind == EBB__MEM_HOST_POOL) {
    ebb__unlock(&a->mu);
    return EBB_OK;
  }
  return ebb__block_record_locked(fn, a, b, (void *)(uintptr_t)b->addr, &ref);
}

ebb_status ebb__copy_past_end(const char *fn, void *ptr, size_t bytes, bool is_dst, const struct ebb__arena *a,
                              uint64_t base, size_t size) {
  char by[24], sz[24];
  uint64_t off = (uint64_t)(uintptr_t)ptr - base;
  char room[64];
  if (off >= size) snprintf(room, sizeof room, "an offset below %zu", size);
  else snprintf(room, sizeof room, "at most %" PRIu64 " bytes from that offset", (uint64_t)size - off);
  return ebb__fail(EBB_EINVAL,
                   "%s: %s %p: %s (%zu bytes) run past the end of its block of the %s: block at 0x%" PRIx64
                   ", %s (%zu bytes) requested, offset %" PRIu64 "; expected %s",
                   fn, is_dst ? "dst" : "src", ptr, ebb__fmt_bytes(by, sizeof by, bytes), bytes, a->label, base,
                   ebb__fmt_bytes(sz, sizeof sz, size), size, off, room);
}
