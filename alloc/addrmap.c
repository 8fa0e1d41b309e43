/* addrmap.c: from an address to what lies there. A free, record_stream, owner call or copy gets a
 * bare pointer; this finds its slot or block (and so its arena) without a driver call and without
 * a lock but the one of the answer's arena, and says what a pointer is when it is no live block.
 *
 * Two maps, process-wide over every arena. The granule map (64 KiB granules of the 48-bit
 * address space) holds every slab and every live block larger than a granule: with the default
 * slab_max, every pointer the engine hands out. The ptrmap, a sharded hash, holds the smaller
 * live blocks (slabs off or below their maximum, a small request served as a block when no slab
 * could be made, or a block past the granule map's 48 bits).
 *
 * Owns: the granule map's leaves and the ptrmap's tables (freed at module teardown, after every
 * arena's), not the records they point to: those stay records of their arena for its whole life,
 * so a stale entry read by a racing bad free still leads to a record, validated under its lock.
 *
 * Threading: granule map entries are atomics written under the lock of the arena whose slab or
 * block they name and read with no lock; a ptrmap shard has a leaf spin lock, taken with or
 * without an arena lock held. A lookup's answer is checked under its arena's lock before use.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "arena_impl.h"

/* ---- the granule map --------------------------------------------------------------------------
 * 48-bit addresses in 64 KiB granules: a top table of 2^18 leaves, a leaf of 2^14 granules
 * (1 GiB, 256 KiB of 16-byte entries, made at first use). A granule can meet two slabs at
 * most, because every slab is longer than a granule (EBB__SLAB_TARGET): `lo` covers the
 * granule's first byte, up to its end; `hi` starts inside it. Each is one word: the slab
 * record's address (records are 128-byte aligned) with, in its low 7 bits, the boundary inside
 * the granule in 512-byte units (lo: where it ends, 0 when it covers the whole granule; hi:
 * where it starts, 1..127). So a lookup is two loads and no record read but the one it
 * returns, and one word is written whole (no torn pair). 10^5 live 13 KiB slots span ~20 000
 * granules: 320 KiB of entries, against ~18 MB of block records and ptrmap for the same
 * blocks. `hi` may instead hold the live block larger than a granule that starts in it (see
 * "live blocks in the map"). */
#define EBB__SMAP_GRAN 16
#define EBB__SMAP_LEAF 14
#define EBB__SMAP_TOP (48 - EBB__SMAP_GRAN - EBB__SMAP_LEAF)

struct ebb__smap_ent {
  _Atomic uintptr_t lo, hi;
};

#define EBB__SMAP_UNITS ((uintptr_t)127) /* low bits of an entry: 512-byte units in a granule */
/* Top bit of `hi`: the record is a live block's, not a slab's (see "live blocks in the map").
 * User-space addresses never have it set (the lower half of the address space). */
#define EBB__SMAP_BLOCK ((uintptr_t)1 << (sizeof(uintptr_t) * 8 - 1))
_Static_assert(((size_t)1 << EBB__SMAP_GRAN) / EBB__MIN_BLOCK == EBB__SMAP_UNITS + 1, "units of a granule fit 7 bits");
_Static_assert(_Alignof(struct ebb__slab) >= EBB__SMAP_UNITS + 1, "slab records leave 7 low bits free");

static _Atomic(struct ebb__smap_ent *) ebb__smap[(size_t)1 << EBB__SMAP_TOP];

_Static_assert(EBB__SLAB_TARGET >= 2 * ((size_t)1 << EBB__SMAP_GRAN),
               "every slab must span more than one granule of the address map");

/* A leaf in one transparent huge page where the kernel gives one: lookups land anywhere in it,
 * and a TLB miss per free costs as much as the entry's own cache miss. */
#define EBB__SMAP_LEAF_BYTES (((size_t)1 << EBB__SMAP_LEAF) * sizeof(struct ebb__smap_ent))
#define EBB__HUGE ((size_t)2 << 20)

static struct ebb__smap_ent *smap_leaf_alloc(void) {
  size_t bytes = EBB__SMAP_LEAF_BYTES < EBB__HUGE ? EBB__HUGE : EBB__SMAP_LEAF_BYTES;
  void *p = aligned_alloc(EBB__HUGE, bytes);
  if (!p) return NULL;
#ifdef MADV_HUGEPAGE
  (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice only: no huge page is still correct */
#endif
  memset(p, 0, EBB__SMAP_LEAF_BYTES);
  return p;
}

__attribute__((noinline, cold)) static struct ebb__smap_ent *ebb__smap_leaf_make(_Atomic(struct ebb__smap_ent *) *top) {
  struct ebb__smap_ent *leaf = NULL;
  struct ebb__smap_ent *nl = smap_leaf_alloc();
  if (!nl) return NULL;
  /* release: the zeroed leaf is visible before its pointer. Two arenas may race to make it. */
  if (atomic_compare_exchange_strong_explicit(top, &leaf, nl, memory_order_release, memory_order_acquire)) return nl;
  free(nl);
  return leaf;
}

static inline struct ebb__smap_ent *smap_leaf(uint64_t g, bool make) {
  _Atomic(struct ebb__smap_ent *) *top = &ebb__smap[g >> EBB__SMAP_LEAF];
  /* acquire: pairs with the release CAS that published the zeroed leaf. */
  struct ebb__smap_ent *leaf = atomic_load_explicit(top, memory_order_acquire);
  if (EBB_LIKELY(leaf) || !make) return leaf;
  return ebb__smap_leaf_make(top);
}

/* The entry of addr's granule; NULL when its leaf was never made. */
static inline struct ebb__smap_ent *smap_ent_of(uint64_t addr) {
  if (EBB_UNLIKELY(addr >> 48)) return NULL;
  uint64_t g = addr >> EBB__SMAP_GRAN;
  struct ebb__smap_ent *leaf = smap_leaf(g, false);
  return leaf ? &leaf[g & (((uint64_t)1 << EBB__SMAP_LEAF) - 1)] : NULL;
}

/* The slab whose entry e (addr's granule, `hi` already loaded) covers addr, unvalidated (NULL:
 * none). */
static inline struct ebb__slab *smap_slab_in(const struct ebb__smap_ent *e, uintptr_t hi, uint64_t addr) {
  uintptr_t unit = (uintptr_t)(addr >> 9) & EBB__SMAP_UNITS;
  /* acquire (hi's and lo's): pair with the release stores of smap_put, so the record's
   * fixed `arena` is seen. */
  if (hi && !(hi & EBB__SMAP_BLOCK) && unit >= (hi & EBB__SMAP_UNITS)) return (struct ebb__slab *)(hi & ~EBB__SMAP_UNITS);
  /* (A block in `hi` starts after any slab that covers the granule's start: lo's bound below
   * then rejects addresses inside the block.) */
  uintptr_t lo = atomic_load_explicit(&e->lo, memory_order_acquire);
  if (lo && (!(lo & EBB__SMAP_UNITS) || unit < (lo & EBB__SMAP_UNITS))) return (struct ebb__slab *)(lo & ~EBB__SMAP_UNITS);
  return NULL;
}

static inline uintptr_t smap_hi(const struct ebb__smap_ent *e) {
  return atomic_load_explicit(&e->hi, memory_order_acquire);
}

struct ebb__slab *ebb__amap_slab_find(uint64_t addr) {
  struct ebb__smap_ent *e = smap_ent_of(addr);
  return e ? smap_slab_in(e, smap_hi(e), addr) : NULL;
}

/* The live block entered at addr, from its granule's `hi` word w; unvalidated (NULL: none).
 * (w's acquire load pairs with the release store of ebb__amap_block_put, so the record's fixed
 * `arena` is seen.) */
static inline struct ebb__block *smap_block_in(uintptr_t w, uint64_t addr) {
  if ((w & EBB__SMAP_BLOCK) && !(addr & (EBB__MIN_BLOCK - 1)) &&
      (w & EBB__SMAP_UNITS) == ((uintptr_t)(addr >> 9) & EBB__SMAP_UNITS))
    return (struct ebb__block *)(w & ~(EBB__SMAP_BLOCK | EBB__SMAP_UNITS));
  return NULL;
}

/* ---- live blocks in the map -------------------------------------------------------------------
 * A live block larger than a granule is entered in the `hi` word of the granule where it starts
 * (tagged EBB__SMAP_BLOCK, with its start's unit, 0..127): slabs and such blocks are all longer
 * than a granule and never overlap, so at most one of them starts in any granule, and the word
 * is its own while it lives. With the default slab_max (64 KiB) every block the engine hands out
 * is one, and a free finds slot and block alike with the one entry read, where the ptrmap cost a
 * shard lock and a probe. */
_Static_assert(_Alignof(struct ebb__block) >= EBB__SMAP_UNITS + 1, "block records leave 7 low bits free");
_Static_assert(EBB__AMAP_BLOCK_MIN == ((size_t)1 << EBB__SMAP_GRAN), "blocks above one granule of the address map");

bool ebb__amap_block_put(struct ebb__block *b) {
  EBB_ASSERT(ebb__block_in_amap(b));
  uint64_t g = b->addr >> EBB__SMAP_GRAN;
  struct ebb__smap_ent *leaf = smap_leaf(g, true);
  if (!leaf) return false;
  struct ebb__smap_ent *e = &leaf[g & (((uint64_t)1 << EBB__SMAP_LEAF) - 1)];
  EBB_ASSERT(!atomic_load_explicit(&e->hi, memory_order_relaxed) && !((uintptr_t)b & EBB__SMAP_BLOCK));
  /* release: pairs with the acquire in smap_block_in. */
  atomic_store_explicit(&e->hi, (uintptr_t)b | EBB__SMAP_BLOCK | ((uintptr_t)(b->addr >> 9) & EBB__SMAP_UNITS),
                        memory_order_release);
  return true;
}

struct ebb__block *ebb__amap_block_find(uint64_t addr) {
  struct ebb__smap_ent *e = smap_ent_of(addr);
  return e ? smap_block_in(smap_hi(e), addr) : NULL;
}

struct ebb__block *ebb__amap_block_before(uint64_t addr, unsigned max_granules) {
  if (EBB_UNLIKELY(addr >> 48)) return NULL;
  uint64_t g = addr >> EBB__SMAP_GRAN;
  for (unsigned k = 0; k <= max_granules; k++, g--) {
    struct ebb__smap_ent *e = smap_ent_of(g << EBB__SMAP_GRAN);
    if (!e) return NULL; /* no leaf: nothing starts in its gigabyte; the caller walks segments */
    uintptr_t hi = smap_hi(e);
    uint64_t start = (g << EBB__SMAP_GRAN) + (uint64_t)(hi & EBB__SMAP_UNITS) * EBB__MIN_BLOCK;
    if (hi && start <= addr) /* the nearest start at or below addr: a live block's, or a slab's */
      return (hi & EBB__SMAP_BLOCK) ? (struct ebb__block *)(hi & ~(EBB__SMAP_BLOCK | EBB__SMAP_UNITS)) : NULL;
    /* acquire: pairs with the release stores of smap_put. A slab over the granule's start
     * is the nearest thing below: addr is in no live block of the map. */
    if (atomic_load_explicit(&e->lo, memory_order_acquire)) return NULL;
    if (!g) return NULL;
  }
  return NULL;
}

/* Writes slab sl's fields of granules [g0, g1) of its span: sl itself (on) or NULL. The fields
 * a slab covers are its own while it is live (no other slab can cover the same granule start or
 * start inside the same granule), so removal needs no compare. false: no host memory for a leaf
 * (on only). Lock of sl's arena held. */
static bool smap_put(struct ebb__slab *sl, bool on, uint64_t g0, uint64_t g1, uint64_t *failed_at) {
  uint64_t start = sl->addr, end = start + ebb__slab_bytes(sl);
  for (uint64_t g = g0; g < g1; g++) {
    struct ebb__smap_ent *leaf = smap_leaf(g, on);
    if (!leaf) {
      if (!on) continue; /* never made: nothing of ours in it */
      *failed_at = g;
      return false;
    }
    struct ebb__smap_ent *e = &leaf[g & (((uint64_t)1 << EBB__SMAP_LEAF) - 1)];
    uint64_t gb = g << EBB__SMAP_GRAN, ge = gb + ((uint64_t)1 << EBB__SMAP_GRAN);
    /* release: pairs with the acquire in smap_slab_in. */
    if (gb >= start)
      atomic_store_explicit(&e->lo, on ? (uintptr_t)sl | (end >= ge ? 0 : (uintptr_t)((end - gb) >> 9)) : 0,
                            memory_order_release);
    else
      atomic_store_explicit(&e->hi, on ? (uintptr_t)sl | (uintptr_t)((start - gb) >> 9) : 0, memory_order_release);
  }
  return true;
}

bool ebb__amap_slab_set(struct ebb__slab *sl, bool on) {
  uint64_t g0 = sl->addr >> EBB__SMAP_GRAN, g1 = ((sl->addr + ebb__slab_bytes(sl) - 1) >> EBB__SMAP_GRAN) + 1, at = g1;
  if (smap_put(sl, on, g0, g1, &at)) return true;
  smap_put(sl, false, g0, at, &at);
  return false;
}

struct ebb__slab *ebb__addr_lookup_lock(uint64_t addr, int take, struct ebb__block **bout) {
  *bout = NULL;
  struct ebb__smap_ent *e = smap_ent_of(addr);
  if (!e) return NULL;
  uintptr_t hi = smap_hi(e);
  struct ebb__block *b = smap_block_in(hi, addr);
  if (b) {
    struct ebb__arena *a = b->arena; /* fixed for the record's whole life */
    ebb__lock(&a->mu);
    /* Freed (the record perhaps reused elsewhere) since the lookup: only a live block at addr
     * that is in the map is an answer (a racing bad free can see an old entry whose record now
     * holds a smaller block at the same address, which the ptrmap tracks). */
    if (b->addr == addr && b->state == EBB__B_ALLOC && ebb__block_in_amap(b)) {
      if (take == b->kind) atomic_store_explicit(&e->hi, 0, memory_order_relaxed); /* written under the lock */
      *bout = b;
      return NULL;
    }
    ebb__unlock(&a->mu);
  }
  struct ebb__slab *sl = smap_slab_in(e, hi, addr);
  if (!sl) return NULL;
  struct ebb__arena *a = sl->arena;
  ebb__lock(&a->mu);
  /* The slab may have gone back to the engine (and its record to another slab) since the
   * lookup: only a live slab holding addr is an answer. */
  if (sl->live && addr >= sl->addr && addr < sl->addr + ebb__slab_bytes(sl)) return sl;
  ebb__unlock(&a->mu);
  return NULL;
}

/* ---- the ptrmap --------------------------------------------------------------------------------
 * 64 shards, each an open-addressing table (linear probing, deletion by backward shift, so no
 * tombstones) behind its own spin lock; the shard comes from a hash of the address, so threads
 * freeing on different devices rarely meet (PyTorch shards its map of live blocks the same way).
 * A table grows by doubling when half full; nothing is allocated per operation otherwise.
 * Growing at a quarter saved ~9 instructions per pair in shorter probe runs but doubled the
 * table, 64 bytes per live block: more cache misses at 10^5 live blocks, where the pair is bound
 * by memory, not instructions. A shard's lock is a leaf held for a few probes, so spinning beats
 * parking. */

#define EBB__SHARDS 64
#define EBB__SHARD_MIN_CAP 64

struct ebb__pm_entry {
  uint64_t key; /* 0: empty (0 is never a block address) */
  struct ebb__block *b;
};

struct ebb__pm_shard {
  _Alignas(64) _Atomic int lock;
  size_t count, cap; /* cap: a power of two, or 0 before the first insert */
  unsigned shift;    /* 64 - log2(cap): a slot is the top bits of the hash below the shard's */
  struct ebb__pm_entry *e;
};

static struct ebb__pm_shard ebb__pm[EBB__SHARDS];

/* Fibonacci hashing: block addresses are 512-byte multiples, so the address in 512-byte units
 * times 2^64 / golden ratio; its top 6 bits pick the shard, the next ones the slot. Consecutive
 * blocks land far apart, and the hash is one multiply: a free re-hashes every entry its
 * backward shift moves, so a finaliser's extra rounds were a visible share of the pair. */
static inline uint64_t pm_hash(uint64_t k) { return (k >> 9) * 0x9e3779b97f4a7c15ull; }

static inline void pm_lock(struct ebb__pm_shard *s) {
  for (;;) {
    /* acquire: pairs with the release store in pm_unlock of the previous holder. */
    if (!atomic_exchange_explicit(&s->lock, 1, memory_order_acquire)) return;
    while (atomic_load_explicit(&s->lock, memory_order_relaxed)) ebb__cpu_relax();
  }
}

static inline void pm_unlock(struct ebb__pm_shard *s) {
  /* release: publishes the table changes to the next acquirer in pm_lock. */
  atomic_store_explicit(&s->lock, 0, memory_order_release);
}

static inline struct ebb__pm_shard *pm_shard_of(uint64_t h) { return &ebb__pm[h >> 58]; }

static inline size_t pm_slot(const struct ebb__pm_shard *s, uint64_t h) { return (size_t)((h << 6) >> s->shift); }

static bool pm_grow(struct ebb__pm_shard *s) {
  size_t ncap = s->cap ? s->cap * 2 : EBB__SHARD_MIN_CAP;
  struct ebb__pm_entry *ne = calloc(ncap, sizeof *ne);
  if (!ne) return false;
  struct ebb__pm_entry *old = s->e;
  size_t ocap = s->cap;
  s->e = ne;
  s->cap = ncap;
  s->shift = 64u - (unsigned)__builtin_ctzll((unsigned long long)ncap);
  for (size_t i = 0; i < ocap; i++) {
    if (!old[i].key) continue;
    size_t j = pm_slot(s, pm_hash(old[i].key));
    while (ne[j].key) j = (j + 1) & (ncap - 1);
    ne[j] = old[i];
  }
  free(old);
  return true;
}

/* Stores key -> b in shard s (locked, with room) and unlocks it. */
static inline void pm_put(struct ebb__pm_shard *s, uint64_t h, uint64_t key, struct ebb__block *b) {
  struct ebb__pm_entry *e = s->e;
  size_t mask = s->cap - 1, j = pm_slot(s, h);
  while (e[j].key) {
    EBB_ASSERT(e[j].key != key); /* a live address is in the map once */
    j = (j + 1) & mask;
  }
  e[j].key = key;
  e[j].b = b;
  s->count++;
  pm_unlock(s);
}

/* The insert that must grow the table first (locked on entry, unlocked on return). Apart, so
 * the common insert keeps nothing live across a call and saves no registers. */
__attribute__((noinline, cold)) static bool ebb__pm_insert_grow(struct ebb__pm_shard *s, uint64_t h, uint64_t key,
                                                                struct ebb__block *b) {
  if (!pm_grow(s)) {
    pm_unlock(s);
    return false;
  }
  pm_put(s, h, key, b);
  return true;
}

bool ebb__ptrmap_insert(struct ebb__block *b) {
  uint64_t key = b->addr, h = pm_hash(key);
  struct ebb__pm_shard *s = pm_shard_of(h);
  pm_lock(s);
  if (EBB_UNLIKELY((s->count + 1) * 2 > s->cap)) return ebb__pm_insert_grow(s, h, key, b);
  pm_put(s, h, key, b);
  return true;
}

/* Index of `addr` in the shard, or SIZE_MAX. Shard locked by the caller. */
static size_t pm_index(const struct ebb__pm_shard *s, uint64_t h, uint64_t addr) {
  if (!s->cap) return SIZE_MAX;
  for (size_t j = pm_slot(s, h);; j = (j + 1) & (s->cap - 1)) {
    if (s->e[j].key == addr) return j;
    if (!s->e[j].key) return SIZE_MAX;
  }
}

struct ebb__block *ebb__ptrmap_find(uint64_t addr) {
  uint64_t h = pm_hash(addr);
  struct ebb__pm_shard *s = pm_shard_of(h);
  pm_lock(s);
  size_t j = pm_index(s, h, addr);
  struct ebb__block *b = j == SIZE_MAX ? NULL : s->e[j].b;
  pm_unlock(s);
  return b;
}

struct ebb__block *ebb__ptrmap_take(uint64_t addr) {
  uint64_t h = pm_hash(addr);
  struct ebb__pm_shard *s = pm_shard_of(h);
  pm_lock(s);
  size_t j = pm_index(s, h, addr);
  if (EBB_UNLIKELY(j == SIZE_MAX)) {
    pm_unlock(s);
    return NULL;
  }
  struct ebb__pm_entry *e = s->e;
  struct ebb__block *b = e[j].b;
  /* Backward-shift deletion: pull later entries of the probe run into the hole so every
   * remaining key stays reachable from its home slot without tombstones. */
  size_t mask = s->cap - 1, hole = j;
  unsigned shift = s->shift;
  for (size_t k = (j + 1) & mask; e[k].key; k = (k + 1) & mask) {
    size_t home = (size_t)((pm_hash(e[k].key) << 6) >> shift); /* pm_slot */
    /* Move e[k] into the hole unless its home lies cyclically in (hole, k]. */
    bool stays = hole <= k ? (home > hole && home <= k) : (home > hole || home <= k);
    if (!stays) {
      e[hole] = e[k];
      hole = k;
    }
  }
  e[hole].key = 0;
  e[hole].b = NULL;
  s->count--;
  pm_unlock(s);
  return b;
}

static void ptrmap_clear(void) {
  for (int i = 0; i < EBB__SHARDS; i++) {
    struct ebb__pm_shard *s = &ebb__pm[i];
    pm_lock(s);
    free(s->e);
    s->e = NULL;
    s->cap = s->count = 0;
    s->shift = 0;
    pm_unlock(s);
  }
}

void ebb__addrmap_clear(void) {
  ptrmap_clear();
  for (size_t i = 0; i < EBB_ARRAY_LEN(ebb__smap); i++) {
    struct ebb__smap_ent *leaf = atomic_exchange_explicit(&ebb__smap[i], NULL, memory_order_acq_rel);
    free(leaf);
  }
}


/* ---- pointers that are no live block: what they are, for messages ----------------------------- */

struct ebb__block *ebb__find_containing(struct ebb__arena *a, uint64_t addr) {
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    if (addr < g->base || addr >= g->base + g->size) continue;
    for (struct ebb__block *b = g->first; b; b = b->next)
      if (addr >= b->addr && addr < b->addr + b->size) return b;
  }
  return NULL;
}

/* The public call that hands out blocks of `kind` (messages). */
const char *ebb__kind_alloc_fn(enum ebb__memkind kind) {
  switch (kind) {
  case EBB__MEM_PINNED_POOL: return "ebb_pinned_alloc";
  case EBB__MEM_HOST_POOL: return "ebb_pageable_alloc";
  default: return "ebb_arena_alloc";
  }
}

/* Why `ptr` is not a live block of `kind`: searched in every arena's segments (an error path).
 * A live block of another kind is named as such: a pinned pointer given to ebb_arena_free. */
ebb_status ebb__explain_in(const char *fn, void *ptr, enum ebb__memkind kind, const struct ebb__arena *a, int state,
                           uint64_t base, size_t size, uint64_t sid) {
  const char *want = ebb__kind_alloc_fn(kind);
  if (a->up->kind != kind)
    return ebb__fail(EBB_EINVAL, "%s: pointer %p belongs to the %s (a block from %s); expected a block from %s", fn, ptr,
                     a->label, a->up->alloc_fn, want);
  if (state == EBB__B_ALLOC && (uint64_t)(uintptr_t)ptr != base)
    return ebb__fail(EBB_EINVAL,
                     "%s: pointer %p is inside the block at 0x%" PRIx64 " (%zu bytes, %s, stream %" PRIu64
                     "); expected the start of a block from %s",
                     fn, ptr, base, size, a->label, sid, want);
  return ebb__fail(EBB_EFREED,
                   "%s: pointer %p (%s) was already freed (it lies in free memory of the pool); expected a live block "
                   "from %s",
                   fn, ptr, a->label, want);
}

ebb_status ebb__explain(const char *fn, void *ptr, enum ebb__memkind kind) {
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  const char *want = ebb__kind_alloc_fn(kind);
  for (int i = 0;; i++) {
    struct ebb__arena *a = ebb__arena_any(i);
    if (!a) break;
    ebb__lock(&a->mu);
    struct ebb__block *b = ebb__find_containing(a, addr);
    if (!b) {
      ebb__unlock(&a->mu);
      continue;
    }
    int state = b->state;
    uint64_t base = b->addr, sid = b->spool ? b->spool->stream.id : 0; /* (a hole is nobody's) */
    size_t size = b->size;
    ebb__unlock(&a->mu);
    return ebb__explain_in(fn, ptr, kind, a, state, base, size, sid);
  }
  char was[48];
  const char *when = ebb__grave_find(addr, kind, was, sizeof was);
  /* Device addresses come from the driver alone: one there is a freed block's (or a driver
   * allocation's, equally not ours to free). Host ranges go back to the system, whose next
   * mapping may be the caller's own memory: "not allocated", with the hint. */
  if (when && kind == EBB__MEM_DEVICE_ARENA)
    return ebb__fail(EBB_EFREED, "%s: pointer %p lies in memory the %s gave back to the driver %s: a pointer to a block freed "
                     "before then (or memory the driver handed out since); expected a live block from %s", fn, ptr, was, when, want);
  if (when)
    return ebb__fail(EBB_EINVAL, "%s: pointer %p was not allocated by %s; it lies in memory the %s gave back to the system %s "
                     "(a pointer to a block freed before then, or memory mapped there since)", fn, ptr, want, was, when);
  return ebb__fail(EBB_EINVAL, "%s: pointer %p was not allocated by %s (no segment of any ebb pool holds it)", fn, ptr, want);
}

ebb_status ebb__wrong_pool(const char *fn, void *ptr, const struct ebb__arena *o, enum ebb__memkind kind) {
  return ebb__fail(EBB_EINVAL, "%s: pointer %p is a live block of the %s (from %s); expected a block from %s", fn, ptr,
                   o->label, o->up->alloc_fn, ebb__kind_alloc_fn(kind));
}
