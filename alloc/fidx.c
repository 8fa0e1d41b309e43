/* fidx.c: the free index. Every allocation stream of an arena gets a spool (struct ebb__spool)
 * at its first allocation there, and a spool per pool an index of its free blocks
 * (arena_impl.h, "free index"). With expandable segments: bins by size for best fit, the
 * segment's free tail beside them, taken last. With classic segments: a B+-tree of 16-entry
 * nodes in (segment age, address) order over the blocks below max_split, so that a request
 * takes a small hole first, else the oldest fit, and a list, searched by the same rules, for
 * oversize blocks and any block the tree found no node memory for.
 *
 * Owns: the tree nodes (carved from chunks kept until teardown, recycled through a spare list),
 * the bins' list heads (one array per spool and pool, made with the spool) and the spools (one
 * lives from its stream's first allocation until that stream is released and the spool holds
 * nothing: spool_reap).
 *
 * Threading: all of it is under the arena's lock; nothing here drops it or takes another.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "arena_impl.h"

/* ---- the B+-tree ------------------------------------------------------------------------------ */

/* Size in 512-byte units, saturating at EBB__UNITS_MAX: exact for every block below 1 TiB. The
 * bound keeps units positive as signed 32-bit lanes (the node scans' compares). */
#define EBB__UNITS_MAX ((uint32_t)INT32_MAX)
static inline uint32_t fidx_units(size_t size) {
  size >>= 9;
  return size > EBB__UNITS_MAX ? EBB__UNITS_MAX : (uint32_t)size;
}

/* A block's place in the order: its segment's age in the high half, its offset in the segment
 * in 512-byte units in the low half. The age wraps past 2^32 segments made and the offset
 * saturates in a segment of 2 TiB: the order is then not oldest first there, but the tree
 * stays sound, its order being the keys'. Never UINT64_MAX (a node's empty entries). */
static inline uint64_t fx_key(const struct ebb__block *b) {
  uint64_t off = (b->addr - b->seg->base) >> 9;
  return (uint64_t)(uint32_t)b->seg->seq << 32 | (off >= UINT32_MAX ? UINT32_MAX - 1 : off);
}

/* x comes before y in the index's order: older segment, then lower address. */
static inline bool tree_before(const struct ebb__block *x, const struct ebb__block *y) {
  return fx_key(x) < fx_key(y);
}

/* A block's size as the small-hole maxima count it: its units below EBB__SMALL_HOLE, else 0. */
static inline uint32_t small_units(size_t size) { return size < EBB__SMALL_HOLE ? fidx_units(size) : 0; }

/* Free block b ends an expandable segment: the index keeps it as its tail. Reads b->seg only
 * for a block with no successor (the last of each segment). */
static inline bool is_xtail(const struct ebb__block *b) { return !b->next && b->seg->expandable; }

/* A node: up to EBB__FX_FAN entries in order. A leaf's entries are free blocks, an inner node's
 * its children; `max` is the largest size under the entry (the block's own in a leaf), `smax`
 * the largest below EBB__SMALL_HOLE (0: none), both 0 past n, so a scan needs no bound; `key`
 * the entry's first key (UINT64_MAX past n). The scans of one node read its `max` or `smax`
 * line and one more: a find is a line or two per level, and 16 entries a node keep the levels
 * to two or three at the sizes measured (a few hundred free blocks a stream and pool). */
#define EBB__FX_FAN 16
struct ebb__fxnode {
  _Alignas(64) uint32_t max[EBB__FX_FAN];
  uint32_t smax[EBB__FX_FAN];
  uint64_t key[EBB__FX_FAN];
  void *ent[EBB__FX_FAN];          /* struct ebb__block * (leaf), struct ebb__fxnode * (inner) */
  struct ebb__fxnode *up;          /* parent (NULL: the root); the next spare while spare */
  uint8_t pslot;                   /* its slot in the parent */
  uint8_t n;
  bool leaf;
};
#define EBB__FX_CHUNK 64 /* nodes a chunk */

/* Makes sure the arena holds `need` spare nodes, so that an insertion's splits cannot fail
 * half-way. False: out of host memory. Lock held. */
static bool fx_reserve(struct ebb__arena *a, size_t need) {
  while (a->nfx_spare < need) {
    struct ebb__fxnode *c = ebb__chunk_new(&a->fx_chunks, &a->nfx_chunks, &a->capfx_chunks, 8, _Alignof(struct ebb__fxnode),
                                           EBB__FX_CHUNK * sizeof *c, EBB__CHUNK_FXNODES);
    if (!c) return false;
    for (int i = 0; i < EBB__FX_CHUNK; i++) {
      c[i].up = a->fx_spare;
      a->fx_spare = &c[i];
    }
    a->nfx_spare += EBB__FX_CHUNK;
  }
  return true;
}

/* A reserved spare node, empty. */
static struct ebb__fxnode *fx_new(struct ebb__arena *a, bool leaf) {
  struct ebb__fxnode *n = a->fx_spare;
  EBB_ASSERT(n);
  a->fx_spare = n->up;
  a->nfx_spare--;
  memset(n, 0, sizeof *n);
  memset(n->key, 0xff, sizeof n->key);
  n->leaf = leaf;
  return n;
}

static void fx_put(struct ebb__arena *a, struct ebb__fxnode *n) {
  n->up = a->fx_spare;
  a->fx_spare = n;
  a->nfx_spare++;
}

#if defined(__SSE2__)
static inline __m128i fx_max4(__m128i x, __m128i y) {
  __m128i gt = _mm_cmpgt_epi32(x, y);
  return _mm_or_si128(_mm_and_si128(gt, x), _mm_andnot_si128(gt, y));
}
#endif

/* The largest of the 16 values at m (a node's max or smax). */
static inline uint32_t fx_vmax(const uint32_t *mx) {
#if defined(__SSE2__)
  const __m128i *v = (const __m128i *)mx;
  __m128i m = fx_max4(fx_max4(_mm_load_si128(v), _mm_load_si128(v + 1)),
                           fx_max4(_mm_load_si128(v + 2), _mm_load_si128(v + 3)));
  m = fx_max4(m, _mm_shuffle_epi32(m, 0x4E));
  m = fx_max4(m, _mm_shuffle_epi32(m, 0xB1));
  return (uint32_t)_mm_cvtsi128_si32(m);
#else
  uint32_t m = 0;
  for (int i = 0; i < EBB__FX_FAN; i++) m = mx[i] > m ? mx[i] : m;
  return m;
#endif
}

static inline uint32_t fx_nmax(const struct ebb__fxnode *n) { return fx_vmax(n->max); }
static inline uint32_t fx_nsmax(const struct ebb__fxnode *n) { return fx_vmax(n->smax); }

/* The first of the 16 values at mx (a node's max or smax) that is at least u (1 <= u <=
 * EBB__UNITS_MAX), or -1: sixteen compares packed into one mask (units are positive as signed
 * lanes). */
static inline int fx_first(const uint32_t *mx, uint32_t u) {
#if defined(__SSE2__)
  const __m128i *v = (const __m128i *)mx;
  __m128i t = _mm_set1_epi32((int32_t)(u - 1));
  __m128i lo = _mm_packs_epi32(_mm_cmpgt_epi32(_mm_load_si128(v), t), _mm_cmpgt_epi32(_mm_load_si128(v + 1), t));
  __m128i hi = _mm_packs_epi32(_mm_cmpgt_epi32(_mm_load_si128(v + 2), t), _mm_cmpgt_epi32(_mm_load_si128(v + 3), t));
  unsigned m = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(lo, hi));
#else
  unsigned m = 0;
  for (int i = 0; i < EBB__FX_FAN; i++) m |= (unsigned)(mx[i] >= u) << i;
#endif
  return m ? __builtin_ctz(m) : -1;
}

/* How many keys of n are below k (at or below: le): a binary search of four halvings and a
 * last compare, each a conditional add, so no branch on the data (keys past n are UINT64_MAX). */
static inline int fx_rank(const struct ebb__fxnode *n, uint64_t k, bool le) {
  _Static_assert(EBB__FX_FAN == 16, "fx_rank halves 16 keys");
  const uint64_t *y = n->key;
  int c = (le ? y[7] <= k : y[7] < k) ? 8 : 0;
  c += (le ? y[c + 3] <= k : y[c + 3] < k) ? 4 : 0;
  c += (le ? y[c + 1] <= k : y[c + 1] < k) ? 2 : 0;
  c += (le ? y[c] <= k : y[c] < k) ? 1 : 0;
  return c + (le ? y[c] <= k : y[c] < k);
}

/* The slot of block b in leaf n (b is there). */
static inline int fx_slot(const struct ebb__fxnode *n, const struct ebb__block *b) {
#if defined(__SSE2__) && UINTPTR_MAX == UINT64_MAX
  /* Sixteen pointer compares as 32 half compares packed into one mask, two bits a pointer: no
   * branch on where b sits. */
  const __m128i *v = (const __m128i *)n->ent;
  __m128i t = _mm_set1_epi64x((long long)(uintptr_t)b);
#define EBB__EQ(q) _mm_cmpeq_epi32(_mm_load_si128(v + (q)), t)
  __m128i lo = _mm_packs_epi16(_mm_packs_epi32(EBB__EQ(0), EBB__EQ(1)), _mm_packs_epi32(EBB__EQ(2), EBB__EQ(3)));
  __m128i hi = _mm_packs_epi16(_mm_packs_epi32(EBB__EQ(4), EBB__EQ(5)), _mm_packs_epi32(EBB__EQ(6), EBB__EQ(7)));
#undef EBB__EQ
  uint32_t m = (uint32_t)_mm_movemask_epi8(lo) | (uint32_t)_mm_movemask_epi8(hi) << 16;
  m &= m >> 1 & 0x55555555u;
  EBB_ASSERT(m); /* b is in n: a broken index would otherwise count zeros of nothing */
  return __builtin_ctz(m) / 2;
#else
  int i = 0;
  while (n->ent[i] != b) i++;
  return i;
#endif
}

/* Entries i.. of n point back to n. */
static inline void fx_adopt(struct ebb__fxnode *n, int i) {
  for (; i < n->n; i++) {
    if (n->leaf) {
      ((struct ebb__block *)n->ent[i])->leaf = n;
    } else {
      struct ebb__fxnode *c = n->ent[i];
      c->up = n;
      c->pslot = (uint8_t)i;
    }
  }
}

/* One entry of n changed its max from o to v and its small-hole max from os to vs (0: gone;
 * or came with o = os = 0), and n's first key may have changed (key0): n's entry in each node
 * up the path, while something changes. The parent's max for n is n's max before the change,
 * so the new one is known without a scan unless the entry that held the max shrank; the same
 * for smax. */
static void fx_prop(struct ebb__fxnode *n, uint32_t o, uint32_t v, uint32_t os, uint32_t vs, bool key0) {
  for (struct ebb__fxnode *p; (p = n->up) && (o != v || os != vs || key0); n = p) {
    int i = n->pslot;
    uint32_t pm = p->max[i], ps = p->smax[i];
    uint32_t nm = v >= pm ? v : o < pm ? pm : fx_nmax(n);
    uint32_t ns = os == vs ? ps : vs >= ps ? vs : os < ps ? ps : fx_nsmax(n);
    p->max[i] = nm;
    p->smax[i] = ns;
    if (key0) p->key[i] = n->key[0];
    key0 = key0 && i == 0;
    o = pm;
    v = nm;
    os = ps;
    vs = ns;
  }
}

/* Every entry on the path from n up, recomputed (after splits). */
static void fx_fix_all(struct ebb__fxnode *n) {
  for (struct ebb__fxnode *p; (p = n->up); n = p) {
    p->max[n->pslot] = fx_nmax(n);
    p->smax[n->pslot] = fx_nsmax(n);
    p->key[n->pslot] = n->key[0];
  }
}

/* Shifts of a few entries stay loops: GCC would make each array's loop a call of memmove. */
#if defined(__GNUC__) && !defined(__clang__)
#define EBB__NO_MEMMOVE __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define EBB__NO_MEMMOVE
#endif

/* Puts entry (k, m, sm, e) at slot i of n, which has room. */
EBB__NO_MEMMOVE static void ebb__fx_place(struct ebb__fxnode *n, int i, uint64_t k, uint32_t m, uint32_t sm, void *e) {
  for (int j = n->n; j > i; j--) {
    n->max[j] = n->max[j - 1];
    n->smax[j] = n->smax[j - 1];
    n->key[j] = n->key[j - 1];
    n->ent[j] = n->ent[j - 1];
  }
  n->max[i] = m;
  n->smax[i] = sm;
  n->key[i] = k;
  n->ent[i] = e;
  n->n++;
  if (n->leaf) ((struct ebb__block *)e)->leaf = n;
  else fx_adopt(n, i);
}

/* Puts entry (k, m, sm, e) at slot i of full node n: n splits, its upper half going to a new
 * right sibling entered in the parent (which may split in turn). The spare nodes were reserved;
 * the maxima and keys above the parent are the caller's (fx_fix_all). */
static void fx_split_ins(struct ebb__arena *a, struct ebb__fidx *x, struct ebb__fxnode *n, int i, uint64_t k,
                              uint32_t m, uint32_t sm, void *e) {
  enum { H = EBB__FX_FAN / 2 };
  struct ebb__fxnode *r = fx_new(a, n->leaf);
  memcpy(r->max, &n->max[H], H * sizeof n->max[0]);
  memcpy(r->smax, &n->smax[H], H * sizeof n->smax[0]);
  memcpy(r->key, &n->key[H], H * sizeof n->key[0]);
  memcpy(r->ent, &n->ent[H], H * sizeof n->ent[0]);
  memset(&n->max[H], 0, H * sizeof n->max[0]);
  memset(&n->smax[H], 0, H * sizeof n->smax[0]);
  memset(&n->key[H], 0xff, H * sizeof n->key[0]);
  n->n = r->n = H;
  fx_adopt(r, 0);
  if (i <= H) ebb__fx_place(n, i, k, m, sm, e);
  else ebb__fx_place(r, i - H, k, m, sm, e);
  struct ebb__fxnode *p = n->up;
  if (!p) { /* n was the root: one level more */
    p = fx_new(a, false);
    x->root = p;
    ebb__fx_place(p, 0, n->key[0], fx_nmax(n), fx_nsmax(n), n);
    ebb__fx_place(p, 1, r->key[0], fx_nmax(r), fx_nsmax(r), r);
    return;
  }
  int j = n->pslot;
  p->max[j] = fx_nmax(n);
  p->smax[j] = fx_nsmax(n);
  p->key[j] = n->key[0];
  if (p->n < EBB__FX_FAN) ebb__fx_place(p, j + 1, r->key[0], fx_nmax(r), fx_nsmax(r), r);
  else fx_split_ins(a, x, p, j + 1, r->key[0], fx_nmax(r), fx_nsmax(r), r);
}

/* Enters FREE block b in x's tree. False: no host memory for a node (b is not entered). */
static bool fx_insert(struct ebb__arena *a, struct ebb__fidx *x, struct ebb__block *b) {
  uint64_t k = fx_key(b);
  uint32_t u = fidx_units(b->size), su = small_units(b->size);
  struct ebb__fxnode *n = x->root;
  if (!n) {
    if (!fx_reserve(a, 1)) return false;
    n = x->root = fx_new(a, true);
  }
  while (!n->leaf) {
    int i = fx_rank(n, k, true);
    n = n->ent[i ? i - 1 : 0];
  }
  int i = fx_rank(n, k, false);
  if (EBB_LIKELY(n->n < EBB__FX_FAN)) {
    ebb__fx_place(n, i, k, u, su, b);
    fx_prop(n, 0, u, 0, su, i == 0);
    return true;
  }
  /* A split for each full node from the leaf up, and a new root if they all are. */
  size_t need = 0;
  const struct ebb__fxnode *t = n;
  for (; t && t->n == EBB__FX_FAN; t = t->up) need++;
  if (!t) need++;
  if (!fx_reserve(a, need)) return false;
  fx_split_ins(a, x, n, i, k, u, su, b);
  fx_fix_all(b->leaf);
  return true;
}

/* Takes entry i out of n; a node left empty leaves its parent (free at empty: no merging of
 * half-full siblings, which random deletions would mostly undo). */
EBB__NO_MEMMOVE static void ebb__fx_drop(struct ebb__arena *a, struct ebb__fidx *x, struct ebb__fxnode *n, int i) {
  uint32_t o = n->max[i], os = n->smax[i];
  for (int j = i + 1; j < n->n; j++) {
    n->max[j - 1] = n->max[j];
    n->smax[j - 1] = n->smax[j];
    n->key[j - 1] = n->key[j];
    n->ent[j - 1] = n->ent[j];
  }
  n->max[--n->n] = 0;
  n->smax[n->n] = 0;
  n->key[n->n] = UINT64_MAX;
  if (n->n) {
    if (!n->leaf) fx_adopt(n, i);
    fx_prop(n, o, 0, os, 0, i == 0);
    return;
  }
  struct ebb__fxnode *p = n->up;
  int j = n->pslot;
  fx_put(a, n);
  if (!p) x->root = NULL;
  else ebb__fx_drop(a, x, p, j);
}

static void fx_remove(struct ebb__arena *a, struct ebb__fidx *x, struct ebb__block *b) {
  struct ebb__fxnode *n = b->leaf;
  b->leaf = NULL;
  ebb__fx_drop(a, x, n, fx_slot(n, b));
  /* A root with one child gives way to it. */
  struct ebb__fxnode *r = x->root;
  while (r && !r->leaf && r->n == 1) {
    struct ebb__fxnode *c = r->ent[0];
    c->up = NULL;
    fx_put(a, r);
    x->root = r = c;
  }
}

/* Leaf entry i of n (block b) now has b's size and key. */
static inline void fx_set(struct ebb__fxnode *n, int i, const struct ebb__block *b, bool key) {
  uint32_t o = n->max[i], v = fidx_units(b->size), os = n->smax[i], vs = small_units(b->size);
  n->max[i] = v;
  n->smax[i] = vs;
  if (key) n->key[i] = fx_key(b);
  fx_prop(n, o, v, os, vs, key && i == 0);
}

/* The first block in order under n whose size, as the maxima `off` (offsetof max or smax)
 * count it, is at least u (1 <= u < EBB__UNITS_MAX), or NULL. */
static struct ebb__block *fx_first_fit(const struct ebb__fxnode *n, size_t off, uint32_t u) {
  for (;;) {
    int i = fx_first((const uint32_t *)((const char *)n + off), u);
    if (i < 0) return NULL; /* only at the root: below it, the parent's maximum vouches */
    if (n->leaf) return n->ent[i];
    n = n->ent[i];
  }
}

/* The first block in order of at least r bytes under n, for r of 1 TiB and up (beyond exact
 * units): a walk of the saturated entries. */
static struct ebb__block *fx_first_huge(const struct ebb__fxnode *n, size_t r) {
  for (int i = 0; i < n->n; i++) {
    if (n->max[i] < EBB__UNITS_MAX) continue;
    struct ebb__block *b = n->leaf ? n->ent[i] : fx_first_huge(n->ent[i], r);
    if (b && b->size >= r) return b;
  }
  return NULL;
}

/* The largest size under n. */
static size_t fx_largest(const struct ebb__fxnode *n) {
  size_t best = 0;
  for (int i = 0; n && i < n->n; i++) {
    size_t s = (size_t)n->max[i] << 9;
    if (n->max[i] == EBB__UNITS_MAX)
      s = n->leaf ? ((const struct ebb__block *)n->ent[i])->size : fx_largest(n->ent[i]);
    if (s > best) best = s;
  }
  return best;
}

/* ---- the bins (expandable mode) --------------------------------------------------------------
 * Best fit, the lower address on a tie, among a stream's free blocks of an expandable segment:
 * free lists by size, 16 of one size each below 8 KiB, then eight an octave (a bin's sizes lie
 * within 1/8 of each other), and a bitmap of the non-empty ones. A request reads its own bin,
 * else the next non-empty one above it (every block there holds it), and takes the smallest
 * block that holds it among the first EBB__FB_SCAN of that bin: so a search and an update are
 * O(1), where best fit in the tree's (segment age, address) order walks every fitting entry. */
#define EBB__FB_SCAN 16

static inline unsigned fb_bin(uint32_t u) {
  if (u < 16) return u;
  unsigned e = 31u - (unsigned)__builtin_clz(u); /* 4 .. 30: bins 16 .. 231 */
  return 16 + (e - 4) * 8 + ((u >> (e - 3)) & 7);
}
_Static_assert(16 + 26 * 8 + 8 <= EBB__FX_BINS, "every unit count has a bin");

static inline void fb_insert(struct ebb__fidx *x, struct ebb__block *b) {
  unsigned i = fb_bin(fidx_units(b->size));
  ebb_list_insert_tail(&x->bins[i], &b->node);
  x->bmap[i / 64] |= 1ull << (i % 64);
  b->bin = (uint16_t)(i + 1);
}

static inline void fb_remove(struct ebb__fidx *x, struct ebb__block *b) {
  unsigned i = b->bin - 1u;
  ebb_list_remove(&b->node);
  ebb_list_init(&b->node);
  if (ebb_list_empty(&x->bins[i])) x->bmap[i / 64] &= ~(1ull << (i % 64));
  b->bin = 0;
}

/* The smallest block of at least r among the first EBB__FB_SCAN of bin list l (the lower
 * address on a tie), or NULL. */
static struct ebb__block *fb_best(const struct ebb_list *l, size_t r) {
  struct ebb__block *best = NULL;
  int k = 0;
  for (const struct ebb_list *n = l->next; n != l && k < EBB__FB_SCAN; n = n->next, k++) {
    struct ebb__block *c = ebb_container_of(n, struct ebb__block, node);
    if (c->size >= r && (!best || c->size < best->size || (c->size == best->size && c->addr < best->addr))) best = c;
  }
  return best;
}

/* The first non-empty bin above i, or EBB__FX_BINS. */
static inline unsigned fb_next(const struct ebb__fidx *x, unsigned i) {
  for (unsigned j = i + 1; j < EBB__FX_BINS;) {
    uint64_t m = x->bmap[j / 64] >> (j % 64);
    if (m) return j + (unsigned)__builtin_ctzll(m);
    j = (j / 64 + 1) * 64;
  }
  return EBB__FX_BINS;
}

static struct ebb__block *fb_find(const struct ebb__fidx *x, size_t r) {
  unsigned i = fb_bin(fidx_units(r));
  struct ebb__block *b = x->bmap[i / 64] >> (i % 64) & 1 ? fb_best(&x->bins[i], r) : NULL;
  if (!b) {
    unsigned j = fb_next(x, i);
    if (j < EBB__FX_BINS) b = fb_best(&x->bins[j], r);
  }
  /* The tail last, as in the tree's rule 3: growth extends it. */
  if (!b && x->tail && x->tail->size >= r) b = x->tail;
  return b;
}

void ebb__index_insert(struct ebb__arena *a, struct ebb__block *b) {
  struct ebb__fidx *x = &b->spool->pools[b->pool];
  EBB_ASSERT(b->size % EBB__MIN_BLOCK == 0);
  x->count++;
  b->leaf = NULL;
  b->bin = 0;
  if (EBB_UNLIKELY(is_xtail(b))) { /* beside the tree: taken last (rule 3) */
    EBB_ASSERT(!x->tail);
    x->tail = b;
    return;
  }
  if (x->bins) {
    fb_insert(x, b);
    return;
  }
  if (EBB_LIKELY(b->size < ebb__max_split(a)) && EBB_LIKELY(fx_insert(a, x, b))) return;
  /* Oversize, or no host memory for a node of the tree: the list, searched by the same rules. */
  ebb_list_insert_tail(&x->big, &b->node);
}

void ebb__index_remove(struct ebb__block *b) {
  struct ebb__fidx *x = &b->spool->pools[b->pool];
  x->count--;
  if (b->bin) {
    fb_remove(x, b);
    return;
  }
  if (EBB_UNLIKELY(!b->leaf)) {
    if (x->tail == b) {
      x->tail = NULL;
      return;
    }
    ebb_list_remove(&b->node);
    ebb_list_init(&b->node);
    return;
  }
  fx_remove(b->arena, x, b);
}

void ebb__index_grown(struct ebb__arena *a, struct ebb__block *b) {
  if (b->bin) { /* to the bin of its new size, or the tail */
    if (EBB_UNLIKELY(is_xtail(b)) || fb_bin(fidx_units(b->size)) != b->bin - 1u) {
      ebb__index_remove(b);
      ebb__index_insert(a, b);
    }
    return;
  }
  struct ebb__fxnode *n = b->leaf;
  /* The tail, or in the list: their searches read sizes. A listed block (its tree had no node
   * memory) that took in the segment's tail is the tail now, served last (rule 3), not by the
   * list's rules 1 and 2. */
  if (!n && EBB_LIKELY(!is_xtail(b) || b->spool->pools[b->pool].tail == b)) return;
  /* Oversize now, or it took in the segment's tail and is the tail now. */
  if (EBB_UNLIKELY(!n || b->size >= ebb__max_split(a) || is_xtail(b))) {
    ebb__index_remove(b);
    ebb__index_insert(a, b);
    return;
  }
  fx_set(n, fx_slot(n, b), b, false);
}

void ebb__index_replace(struct ebb__arena *a, struct ebb__block *old, struct ebb__block *nw) {
  struct ebb__fxnode *n = old->leaf;
  if (EBB_LIKELY(n && nw->size < ebb__max_split(a)) && EBB_LIKELY(!is_xtail(nw))) {
    int i = fx_slot(n, old);
    n->ent[i] = nw;
    nw->leaf = n;
    old->leaf = NULL;
    fx_set(n, i, nw, true);
    return;
  }
  ebb__index_remove(old);
  ebb__index_insert(a, nw);
}

/* c serves a request below EBB__SMALL_HOLE before best (rules 1 and 2 between two blocks that
 * hold it): a small hole before a larger block, else the older. */
static inline bool small_first(const struct ebb__block *c, const struct ebb__block *best) {
  bool cs = c->size < EBB__SMALL_HOLE, bs = best->size < EBB__SMALL_HOLE;
  return cs != bs ? cs : tree_before(c, best);
}

struct ebb__block *ebb__fidx_find(struct ebb__arena *a, struct ebb__fidx *x, size_t r) {
  if (!x->count) return NULL;
  if (x->bins) return fb_find(x, r);
  struct ebb__block *best = NULL;
  bool small = r < EBB__SMALL_HOLE;
  if (EBB_LIKELY(r < ebb__max_split(a)) && x->root) {
    /* Every block in the tree is below max_split, so at least r is all it takes. Rule 1, then
     * rule 2 (which finds a block of 2 MiB or more when rule 1 found none). */
    uint32_t u = fidx_units(r);
    if (EBB_UNLIKELY(u >= EBB__UNITS_MAX)) best = fx_first_huge(x->root, r);
    else if (small && (best = fx_first_fit(x->root, offsetof(struct ebb__fxnode, smax), u))) {}
    else best = fx_first_fit(x->root, offsetof(struct ebb__fxnode, max), u);
  }
  if (EBB_UNLIKELY(!ebb_list_empty(&x->big))) {
    /* Listed blocks that may serve r, and come before the tree's answer by the same rules. */
    size_t hi = ebb__fit_limit(a, r);
    for (struct ebb_list *n = x->big.next; n != &x->big; n = n->next) {
      struct ebb__block *c = ebb_container_of(n, struct ebb__block, node);
      if (c->size - r < hi - r && (!best || (small ? small_first(c, best) : tree_before(c, best)))) best = c;
    }
  }
  /* Rule 3: the expandable segment's tail, when nothing else holds r. */
  if (!best && x->tail && x->tail->size >= r) best = x->tail;
  return best;
}

struct ebb__block *ebb__fidx_take(struct ebb__arena *a, struct ebb__fidx *x, size_t r) {
  struct ebb__block *b = ebb__fidx_find(a, x, r);
  if (b) ebb__index_remove(b);
  return b;
}

static size_t fidx_largest(const struct ebb__fidx *x) {
  size_t best = fx_largest(x->root);
  if (x->bins) {
    unsigned i = EBB__FX_BINS;
    while (i-- > 0 && !(x->bmap[i / 64] >> (i % 64) & 1)) {}
    if (i < EBB__FX_BINS)
      for (const struct ebb_list *n = x->bins[i].next; n != &x->bins[i]; n = n->next) {
        const struct ebb__block *c = ebb_container_of(n, const struct ebb__block, node);
        if (c->size > best) best = c->size;
      }
  }
  if (x->tail && x->tail->size > best) best = x->tail->size;
  for (const struct ebb_list *n = x->big.next; n != &x->big; n = n->next) {
    const struct ebb__block *c = ebb_container_of(n, const struct ebb__block, node);
    if (c->size > best) best = c->size;
  }
  return best;
}

size_t ebb__fidx_largest_free(const struct ebb__arena *a) {
  size_t best = 0;
  for (size_t i = 0; i < a->nspools; i++)
    for (int p = 0; p < EBB__NPOOLS; p++) {
      size_t l = fidx_largest(&a->spools[i]->pools[p]);
      if (l > best) best = l;
    }
  return best;
}

/* ---- spools (per allocation stream) -------------------------------------------------------- */

/* Frees the spools of released streams that hold nothing: no block in their free indexes, no
 * block or slab of theirs in use. A program that makes a stream per step would otherwise keep
 * one spool (~3 KiB with its slab lists, 8 KiB more with bins) per stream it ever made, and
 * every scan over them (stream lookups, steals) would grow with it. A released stream's free
 * blocks and cached slabs keep its spool until other streams steal them or empty_cache gives
 * them back. Lock held. */
static void spool_reap(struct ebb__arena *a) {
  for (size_t i = 0; i < a->nspools;) {
    struct ebb__spool *sp = a->spools[i];
    bool empty = !sp->nlive && !sp->nmaking;
    for (int p = 0; p < EBB__NPOOLS; p++) empty = empty && !sp->pools[p].count;
    if (!empty || ebb__ref_live(&sp->stream)) {
      i++;
      continue;
    }
    if (a->last_spool == sp) a->last_spool = NULL;
    if (a->unpin_sp == sp) a->unpin_sp = NULL;
    free(sp->slab_cls);
    for (int p = 0; p < EBB__NPOOLS; p++) free(sp->pools[p].bins);
    free(sp);
    a->spools[i] = a->spools[--a->nspools];
  }
}

/* White-box (tests/alloc): the spools and pending-free queues device `device`'s arena holds. */
EBB_HIDDEN void ebb__arena_debug_counts(int device, size_t *nspools, size_t *nevqs);
void ebb__arena_debug_counts(int device, size_t *nspools, size_t *nevqs) {
  struct ebb__arena *a = ebb__arena_nth(device);
  *nspools = *nevqs = 0;
  if (!a) return;
  ebb__lock(&a->mu);
  *nspools = a->nspools;
  *nevqs = a->nevqs;
  ebb__unlock(&a->mu);
}

struct ebb__spool *ebb__spool_get_slow(struct ebb__arena *a, const struct ebb__stream_ref *s) {
  for (size_t i = 0; i < a->nspools; i++)
    if (a->spools[i]->stream.id == s->id) return a->last_spool = a->spools[i];
  spool_reap(a); /* a new stream: the released ones' spools that hold nothing go first */
  if (a->nspools == a->capspools) {
    size_t nc = a->capspools ? a->capspools * 2 : 8;
    struct ebb__spool **ns = realloc(a->spools, nc * sizeof *ns);
    if (!ns) return NULL;
    a->spools = ns;
    a->capspools = nc;
  }
  struct ebb__spool *sp = malloc(sizeof *sp);
  if (!sp) return NULL;
  sp->stream = *s;
  for (int p = 0; p < EBB__NPOOLS; p++) {
    struct ebb__fidx *x = &sp->pools[p];
    x->root = NULL;
    x->tail = NULL;
    x->count = 0;
    ebb_list_init(&x->big);
    memset(x->bmap, 0, sizeof x->bmap);
    x->bins = NULL;
    if (!ebb__xmode(a)) continue;
    /* Expandable segments: best fit through bins (above), in place of the tree. */
    x->bins = malloc(EBB__FX_BINS * sizeof *x->bins);
    if (!x->bins) {
      while (p-- > 0) free(sp->pools[p].bins);
      free(sp);
      return NULL;
    }
    for (unsigned i = 0; i < EBB__FX_BINS; i++) ebb_list_init(&x->bins[i]);
  }
  sp->slab_cls = NULL;
  sp->nlive = sp->nmaking = 0;
  a->spools[a->nspools++] = sp;
  return a->last_spool = sp;
}

/* ---- walks ------------------------------------------------------------------------------------ */

/* The tree under n: parent links, entry counts, every leaf at one depth (*depth, -1 until the
 * first leaf), each entry a free block of stream sp and pool p below max_split that points back
 * to its leaf, keys in (segment age, address) order (after *prev), and every entry's max and
 * key those of what it holds; *count counts the blocks. */
static ebb_status fx_check(struct ebb__arena *a, const struct ebb__fxnode *n, const struct ebb__fxnode *parent,
                                int level, int *depth, const struct ebb__spool *sp, int p, const struct ebb__block **prev,
                                size_t *count, const char *fn) {
  ebb_status st = EBB_OK;
  EBB__CHECK(n->up == parent && (!parent || (n->pslot < parent->n && parent->ent[n->pslot] == n)) && n->n >= 1 &&
                 n->n <= EBB__FX_FAN && (parent || n->leaf || n->n >= 2),
             "%s: %s: a free index node at level %d has a wrong parent link or %d entries (expected 1..%d, 2.. at an "
             "inner root)",
             fn, a->label, level, (int)n->n, EBB__FX_FAN);
  for (int i = n->n; i < EBB__FX_FAN; i++)
    EBB__CHECK(!n->max[i] && !n->smax[i] && n->key[i] == UINT64_MAX, "%s: %s: a free index node holds an entry past its %d",
               fn, a->label, (int)n->n);
  if (n->leaf) {
    if (*depth < 0) *depth = level;
    EBB__CHECK(*depth == level, "%s: %s: free index leaves at levels %d and %d", fn, a->label, *depth, level);
  }
  for (int i = 0; i < n->n; i++) {
    if (!n->leaf) {
      const struct ebb__fxnode *c = n->ent[i];
      if ((st = fx_check(a, c, n, level + 1, depth, sp, p, prev, count, fn))) return st;
      EBB__CHECK(n->max[i] == fx_nmax(c) && n->smax[i] == fx_nsmax(c) && n->key[i] == c->key[0],
                 "%s: %s: a free index node at level %d holds a wrong maximum or key for its child %d", fn, a->label, level, i);
      continue;
    }
    const struct ebb__block *b = n->ent[i];
    EBB__CHECK(b->state == EBB__B_FREE && b->spool == sp && b->pool == p && b->size < ebb__max_split(a) && b->leaf == n &&
                   !is_xtail(b),
               "%s: %s: indexed block 0x%" PRIx64 " is not a free block of its stream and pool in its leaf (or is the "
               "expandable segment's tail)",
               fn, a->label, b->addr);
    EBB__CHECK(n->key[i] == fx_key(b) && n->max[i] == fidx_units(b->size) && n->smax[i] == small_units(b->size),
               "%s: %s: the free index holds a wrong key or size for block 0x%" PRIx64, fn, a->label, b->addr);
    /* Not after its successor (keys tie only where fx_key saturates or wraps). */
    EBB__CHECK(!*prev || !tree_before(b, *prev),
               "%s: %s: free block 0x%" PRIx64 " is out of (segment age, address) order", fn, a->label, b->addr);
    *prev = b;
    ++*count;
  }
done:
  return st;
}


ebb_status ebb__fidx_check(struct ebb__arena *a, const char *fn, size_t *indexed) {
  ebb_status st = EBB_OK;
  *indexed = 0;
  for (size_t i = 0; i < a->nspools; i++)
    for (int p = 0; p < EBB__NPOOLS; p++) {
      const struct ebb__fidx *x = &a->spools[i]->pools[p];
      size_t c = 0;
      const struct ebb__block *prev = NULL;
      int depth = -1;
      if (x->root && (st = fx_check(a, x->root, NULL, 0, &depth, a->spools[i], p, &prev, &c, fn))) goto done;
      EBB__CHECK(!x->bins || !x->root, "%s: %s: a free index with both bins and a tree", fn, a->label);
      for (unsigned k = 0; x->bins && k < EBB__FX_BINS; k++) {
        EBB__CHECK(!ebb_list_empty(&x->bins[k]) == (x->bmap[k / 64] >> (k % 64) & 1),
                   "%s: %s: free index bin %u is %s but its bit says otherwise", fn, a->label, k,
                   ebb_list_empty(&x->bins[k]) ? "empty" : "not empty");
        for (const struct ebb_list *n = x->bins[k].next; n != &x->bins[k]; n = n->next) {
          const struct ebb__block *b = ebb_container_of(n, const struct ebb__block, node);
          EBB__CHECK(b->state == EBB__B_FREE && b->spool == a->spools[i] && b->pool == p && !b->leaf && !is_xtail(b) &&
                         b->bin == k + 1 && fb_bin(fidx_units(b->size)) == k,
                     "%s: %s: block 0x%" PRIx64 " in free index bin %u is not a free block of its stream, pool and size",
                     fn, a->label, b->addr, k);
          c++;
        }
      }
      for (const struct ebb_list *n = x->big.next; n != &x->big; n = n->next) {
        const struct ebb__block *b = ebb_container_of(n, const struct ebb__block, node);
        EBB__CHECK(b->state == EBB__B_FREE && b->spool == a->spools[i] && b->pool == p && !b->leaf && !is_xtail(b),
                   "%s: %s: block 0x%" PRIx64 " in the free index's list is not a free block of its stream and pool",
                   fn, a->label, b->addr);
        c++;
      }
      if (x->tail) {
        const struct ebb__block *b = x->tail;
        EBB__CHECK(b->state == EBB__B_FREE && b->spool == a->spools[i] && b->pool == p && !b->leaf && is_xtail(b),
                   "%s: %s: block 0x%" PRIx64 " kept as the free index's tail is not the free end of the expandable "
                   "segment, of its stream and pool",
                   fn, a->label, b->addr);
        c++;
      }
      EBB__CHECK(c == x->count, "%s: %s: index count %zu, found %zu", fn, a->label, x->count, c);
      *indexed += c;
    }
done:
  return st;
}

void ebb__fidx_fini(struct ebb__arena *a) {
  for (size_t i = 0; i < a->nfx_chunks; i++) free(a->fx_chunks[i]);
  free(a->fx_chunks);
  for (size_t i = 0; i < a->nspools; i++) {
    for (int p = 0; p < EBB__NPOOLS; p++) free(a->spools[i]->pools[p].bins);
    free(a->spools[i]);
  }
  free(a->spools);
}
