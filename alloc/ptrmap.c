/* ptrmap.c: the process-wide map from a live block's address to its block record.
 *
 * ebb_arena_free gets a bare pointer; this map finds its block (and so its arena and device)
 * without a driver call. 64 shards, each an open-addressing table (linear probing, deletion by
 * backward shift, so no tombstones) behind its own spin lock; the shard comes from a hash of the
 * address, so threads freeing on different devices rarely meet (PyTorch shards its map the same
 * way, allocators.md 1.1). A table grows by doubling when half full; nothing is allocated per
 * operation otherwise. (Growing at a quarter saved ~9 instructions per pair in shorter probe runs
 * but doubled the table, 64 bytes per live block: more cache misses at 10^5 live blocks, where
 * the pair is bound by memory, not instructions.)
 *
 * Threading: a shard's lock is a leaf: it may be taken with an arena lock held and never holds
 * another lock. Hold times are a few probes, so spinning beats parking.
 */
#include <stdlib.h>
#include <string.h>

#include "arena_impl.h"

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
static inline uint64_t ebb__pm_hash(uint64_t k) { return (k >> 9) * 0x9e3779b97f4a7c15ull; }

static inline void ebb__pm_lock(struct ebb__pm_shard *s) {
  for (;;) {
    /* acquire: pairs with the release store in ebb__pm_unlock of the previous holder. */
    if (!atomic_exchange_explicit(&s->lock, 1, memory_order_acquire)) return;
    while (atomic_load_explicit(&s->lock, memory_order_relaxed)) ebb__cpu_relax();
  }
}

static inline void ebb__pm_unlock(struct ebb__pm_shard *s) {
  /* release: publishes the table changes to the next acquirer in ebb__pm_lock. */
  atomic_store_explicit(&s->lock, 0, memory_order_release);
}

static inline struct ebb__pm_shard *ebb__pm_shard_of(uint64_t h) { return &ebb__pm[h >> 58]; }

static inline size_t ebb__pm_slot(const struct ebb__pm_shard *s, uint64_t h) { return (size_t)((h << 6) >> s->shift); }

static bool ebb__pm_grow(struct ebb__pm_shard *s) {
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
    size_t j = ebb__pm_slot(s, ebb__pm_hash(old[i].key));
    while (ne[j].key) j = (j + 1) & (ncap - 1);
    ne[j] = old[i];
  }
  free(old);
  return true;
}

/* Stores key -> b in shard s (locked, with room) and unlocks it. */
static inline void ebb__pm_put(struct ebb__pm_shard *s, uint64_t h, uint64_t key, struct ebb__block *b) {
  struct ebb__pm_entry *e = s->e;
  size_t mask = s->cap - 1, j = ebb__pm_slot(s, h);
  while (e[j].key) {
    EBB_ASSERT(e[j].key != key); /* a live address is in the map once */
    j = (j + 1) & mask;
  }
  e[j].key = key;
  e[j].b = b;
  s->count++;
  ebb__pm_unlock(s);
}

/* The insert that must grow the table first (locked on entry, unlocked on return). Apart, so
 * the common insert keeps nothing live across a call and saves no registers. */
__attribute__((noinline, cold)) static bool ebb__pm_insert_grow(struct ebb__pm_shard *s, uint64_t h, uint64_t key,
                                                                struct ebb__block *b) {
  if (!ebb__pm_grow(s)) {
    ebb__pm_unlock(s);
    return false;
  }
  ebb__pm_put(s, h, key, b);
  return true;
}

bool ebb__ptrmap_insert(struct ebb__block *b) {
  uint64_t key = b->addr, h = ebb__pm_hash(key);
  struct ebb__pm_shard *s = ebb__pm_shard_of(h);
  ebb__pm_lock(s);
  if (EBB_UNLIKELY((s->count + 1) * 2 > s->cap)) return ebb__pm_insert_grow(s, h, key, b);
  ebb__pm_put(s, h, key, b);
  return true;
}

/* Index of `addr` in the shard, or SIZE_MAX. Shard locked by the caller. */
static size_t ebb__pm_index(const struct ebb__pm_shard *s, uint64_t h, uint64_t addr) {
  if (!s->cap) return SIZE_MAX;
  for (size_t j = ebb__pm_slot(s, h);; j = (j + 1) & (s->cap - 1)) {
    if (s->e[j].key == addr) return j;
    if (!s->e[j].key) return SIZE_MAX;
  }
}

struct ebb__block *ebb__ptrmap_find(uint64_t addr) {
  uint64_t h = ebb__pm_hash(addr);
  struct ebb__pm_shard *s = ebb__pm_shard_of(h);
  ebb__pm_lock(s);
  size_t j = ebb__pm_index(s, h, addr);
  struct ebb__block *b = j == SIZE_MAX ? NULL : s->e[j].b;
  ebb__pm_unlock(s);
  return b;
}

struct ebb__block *ebb__ptrmap_take(uint64_t addr) {
  uint64_t h = ebb__pm_hash(addr);
  struct ebb__pm_shard *s = ebb__pm_shard_of(h);
  ebb__pm_lock(s);
  size_t j = ebb__pm_index(s, h, addr);
  if (EBB_UNLIKELY(j == SIZE_MAX)) {
    ebb__pm_unlock(s);
    return NULL;
  }
  struct ebb__pm_entry *e = s->e;
  struct ebb__block *b = e[j].b;
  /* Backward-shift deletion: pull later entries of the probe run into the hole so every
   * remaining key stays reachable from its home slot without tombstones. */
  size_t mask = s->cap - 1, hole = j;
  unsigned shift = s->shift;
  for (size_t k = (j + 1) & mask; e[k].key; k = (k + 1) & mask) {
    size_t home = (size_t)((ebb__pm_hash(e[k].key) << 6) >> shift); /* ebb__pm_slot */
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
  ebb__pm_unlock(s);
  return b;
}

size_t ebb__ptrmap_count(void) {
  size_t n = 0;
  for (int i = 0; i < EBB__SHARDS; i++) {
    ebb__pm_lock(&ebb__pm[i]);
    n += ebb__pm[i].count;
    ebb__pm_unlock(&ebb__pm[i]);
  }
  return n;
}

void ebb__ptrmap_clear(void) {
  for (int i = 0; i < EBB__SHARDS; i++) {
    struct ebb__pm_shard *s = &ebb__pm[i];
    ebb__pm_lock(s);
    free(s->e);
    s->e = NULL;
    s->cap = s->count = 0;
    s->shift = 0;
    ebb__pm_unlock(s);
  }
}
