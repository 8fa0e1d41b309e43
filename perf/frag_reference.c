/* ebb-frag-reference: replays an allocation trace (ebb-alloc-replay's format) against a simulated
 * policy shaped like PyTorch's CUDA caching allocator, so perf/frag.sh can print every frag
 * figure of ebb beside the one a PyTorch-like policy reaches on the same trace. Nothing here
 * touches memory or a driver: blocks are numbers (address, size) in simulated address space.
 * Single-threaded; it owns only its own simulation.
 *
 * Read from PyTorch's c10/cuda/CUDACachingAllocator.cpp (revision 001074d2, through the code
 * search), the rules implemented, with the function each comes from:
 *  - Sizes (round_size): a request of n bytes takes max(512, n rounded up to 512) bytes
 *    (roundup_power2_divisions is off by default, so its branch is left out). A request of
 *    0 bytes takes nothing (NativeCachingAllocator::allocate calls malloc only for size != 0),
 *    but counts in allocs as it does in ebb-alloc-replay.
 *  - Pools (get_pool): rounded sizes <= 1 MiB (kSmallSize) go to the small pool, others to the
 *    large one. Each pool is per stream: BlockComparatorSize orders (stream, size, address), and
 *    get_free_block only takes a block of the caller's stream, so a block is reused only by the
 *    stream that allocated it.
 *  - Best fit (get_free_block): the free block of the caller's stream and pool with the smallest
 *    size >= the request, ties to the lowest address (the set's lower_bound). max_split_size
 *    is unlimited by default, so the oversize rules never apply and are left out.
 *  - Classic segments (alloc_block, get_allocation_size): when nothing fits, one new segment
 *    (one cudaMalloc, one driver allocation): 2 MiB (kSmallBuffer) for a small-pool request,
 *    20 MiB (kLargeBuffer) for a request < 10 MiB (kMinLargeAlloc; strictly less: a request of
 *    exactly 10 MiB gets its own 10 MiB segment), else the request rounded up to 2 MiB
 *    (kRoundLarge).
 *  - Splitting (should_split, alloc_found_block): the request keeps the low end of the block;
 *    the rest becomes a free block of the same pool when it is >= 512 B (small pool, or any
 *    pool with expandable segments) or > 1 MiB (large pool, classic). Otherwise the request
 *    takes the whole block (up to 1 MiB of slack in the large pool).
 *  - Merging (free_block, try_merge_blocks): a freed block joins its free neighbours in the
 *    same segment (never across segments: they are separate driver allocations).
 *  - Nothing goes back to the driver: empty_cache and the OOM retry path
 *    (release_cached_blocks) are not modelled, since the device has no capacity here; peak
 *    reserved is then the final reserved. (garbage_collection_threshold needs a memory
 *    fraction and is off by default.)
 *  - Expandable segments (Note [Expandable Segments], ExpandableSegment, find_expandable_block,
 *    map_block, try_allocate_expandable_block): one growing virtual range per stream and pool,
 *    mapped in pages of 2 MiB (small pool) or 20 MiB (large pool: kLargeBuffer; --large-page
 *    changes it). Best fit as above among its mapped free blocks, except that get_free_block
 *    measures a block followed by unmapped space as its size plus that space (its
 *    expandable_size), which in practice is unbounded: the free block at the mapped end is
 *    taken only when no other free block fits. When none fits, the range grows at its end: the
 *    free block at the mapped end (if any) plus ceil(missing / page) new pages, then the
 *    request is split off it as above. Each page is one cuMemCreate, so driver_allocs counts
 *    pages (as ebb counts granules); PyTorch's own num_device_alloc counts map calls.
 *
 * --best-fit is not PyTorch's policy but the plain one the others are judged against: one pool
 * per stream for every size (no small pool), one range per stream grown by 2 MiB granules as
 * ebb's expandable segment grows, best fit among all its free blocks, the free block at the
 * mapped end measured by its mapped size like any other (no "tail last" rule), split whenever
 * 512 B or more is left, merge as above. Growth and rounding are those of --expandable.
 *
 * Simplifications: no event or record_stream delays (a trace frees a block when its stream
 * may reuse it); no capacity, so no OOM path and no unmapping; classic segments take
 * increasing addresses in creation order (the address tie-break of best fit then prefers
 * older segments; cudaMalloc's real addresses are the driver's choice); expandable ranges have
 * unbounded virtual space (PyTorch reserves 1 1/8 of the device's memory per range, so a second
 * range per stream and pool is never needed here); free blocks are found by a scan of the pool's
 * free list (linear in its free blocks; fine for traces of 10^5-10^6 events).
 *
 * Output, one line, the fields of ebb-alloc-replay that apply (no timing):
 *   peak_requested=B peak_reserved=B frag_ratio=R allocs=N driver_allocs=N
 * Exit codes: 0 ok, 1 out of host memory, 2 bad command line or bad trace.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "ebb-frag-reference"
#define MIB ((uint64_t)1 << 20)
#define EIB ((uint64_t)1 << 60)
#define MAX_STREAMS 4096            /* stream indices 0..4095: a sanity bound, not PyTorch's */
#define ID_LIMIT ((uint64_t)1 << 63) /* ids 0..2^63, as ebb-alloc-replay */

/* PyTorch's constants (CUDACachingAllocator.cpp). */
static const uint64_t min_block = 512;           /* kMinBlockSize */
static const uint64_t small_size = 1 * MIB;      /* kSmallSize: largest small-pool request */
static const uint64_t small_buffer = 2 * MIB;    /* kSmallBuffer: small segment, small page */
static const uint64_t min_large_alloc = 10 * MIB; /* kMinLargeAlloc */
static const uint64_t round_large = 2 * MIB;     /* kRoundLarge */
static const uint64_t large_buffer = 20 * MIB;   /* kLargeBuffer: large segment, large page */

/* ---- the simulated allocator ---------------------------------------------------------------- */

typedef struct pool pool;

/* A block: a range of a segment, free or handed out. */
typedef struct block {
  uint64_t addr, size;
  struct block *left, *right;     /* address neighbours in the same segment (NULL at its ends) */
  struct block *fprev, *fnext;    /* the pool's free list, while free */
  pool *pool;
  bool free;
} block;

/* One stream's small or large pool. */
struct pool {
  block *free_list; /* unordered: best fit scans it */
  bool small;
  /* Expandable segments only: the pool's one range, mapped [xbase, xbase + xmapped). */
  uint64_t xbase, xmapped;
  block *xlast; /* the block that ends at the mapped end, NULL before the first page */
};

typedef struct sim {
  bool expandable;
  bool best_fit;       /* --best-fit: one pool, 2 MiB pages, the end block by its size */
  uint64_t large_page; /* expandable: the large pool's page */
  pool **pools;        /* [2 * stream + (large ? 1 : 0)], NULL until used */
  size_t npools;
  uint64_t next_va; /* where the next segment (or expandable range) starts */
  uint64_t reserved, peak_reserved;
  uint64_t driver_allocs;
} sim;

static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

/* round_size: what a request of n > 0 bytes takes. */
static uint64_t request_size(uint64_t n) { return n < min_block ? min_block : round_up(n, min_block); }

/* get_allocation_size: the classic segment made for a request of `size` (rounded) bytes. */
static uint64_t segment_size(uint64_t size) {
  if (size <= small_size) return small_buffer;
  if (size < min_large_alloc) return large_buffer;
  return round_up(size, round_large);
}

static void free_list_push(pool *p, block *b) {
  b->fprev = NULL;
  b->fnext = p->free_list;
  if (p->free_list) p->free_list->fprev = b;
  p->free_list = b;
}

static void free_list_unlink(pool *p, block *b) {
  if (b->fprev) b->fprev->fnext = b->fnext;
  else p->free_list = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
}

/* The pool of (stream, size class), made on first use (pools stay put: blocks point at
 * them). NULL: out of memory. */
static pool *pool_of(sim *s, uint32_t stream, bool small) {
  size_t i = 2 * (size_t)stream + (small ? 0 : 1);
  if (i >= s->npools) {
    size_t n = s->npools ? s->npools : 8;
    while (n <= i) n *= 2;
    pool **np = realloc(s->pools, n * sizeof *np);
    if (np == NULL) return NULL;
    memset(np + s->npools, 0, (n - s->npools) * sizeof *np);
    s->pools = np;
    s->npools = n;
  }
  if (s->pools[i] == NULL && (s->pools[i] = calloc(1, sizeof(pool))) != NULL) s->pools[i]->small = small;
  return s->pools[i];
}

/* Best fit: the smallest free block of p that holds `size`, ties to the lower address. With
 * expandable segments the free block at the mapped end counts as unbounded (get_free_block's
 * expandable_size), so it is the answer only when no other block fits; with --best-fit it
 * counts by its size. */
static block *best_fit(const sim *s, const pool *p, uint64_t size) {
  block *best = NULL;
  block *tail = NULL;
  for (block *b = p->free_list; b; b = b->fnext) {
    if (b->size < size) continue;
    if (s->expandable && !s->best_fit && b == p->xlast) {
      tail = b;
      continue;
    }
    if (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr)) best = b;
  }
  return best ? best : tail;
}

static block *block_new(pool *p, uint64_t addr, uint64_t size) {
  block *b = calloc(1, sizeof *b);
  if (b == NULL) return NULL;
  b->addr = addr;
  b->size = size;
  b->pool = p;
  b->free = true;
  free_list_push(p, b);
  return b;
}

static void reserve(sim *s, uint64_t bytes) {
  s->reserved += bytes;
  if (s->reserved > s->peak_reserved) s->peak_reserved = s->reserved;
}

/* Nothing fits: a new classic segment for `size`, or the expandable range grown at its end so
 * that its last free block holds `size`. Returns that free block; NULL when out of memory. */
static block *grow(sim *s, pool *p, uint64_t size) {
  if (!s->expandable) {
    uint64_t seg = segment_size(size);
    block *b = block_new(p, s->next_va, seg);
    if (b == NULL) return NULL;
    s->next_va += seg;
    reserve(s, seg);
    s->driver_allocs++;
    return b;
  }
  uint64_t page = p->small ? small_buffer : s->large_page;
  if (p->xmapped == 0) {
    /* The pool's range: far from every other one (the simulation never runs out of VA). */
    p->xbase = s->next_va;
    s->next_va += (uint64_t)1 << 46;
  }
  block *tail = p->xlast && p->xlast->free ? p->xlast : NULL;
  uint64_t have = tail ? tail->size : 0;
  uint64_t pages = (size - have + page - 1) / page;
  uint64_t bytes = pages * page;
  if (tail) {
    tail->size += bytes;
  } else {
    tail = block_new(p, p->xbase + p->xmapped, bytes);
    if (tail == NULL) return NULL;
    tail->left = p->xlast;
    if (p->xlast) p->xlast->right = tail;
    p->xlast = tail;
  }
  p->xmapped += bytes;
  reserve(s, bytes);
  s->driver_allocs += pages;
  return tail;
}

/* Hands out `size` bytes of free block b: the low end, the rest split off as a free block when
 * should_split says so. false: out of memory (b is left free). */
static bool take(sim *s, block *b, uint64_t size) {
  pool *p = b->pool;
  uint64_t rest = b->size - size;
  bool split = (p->small || s->expandable) ? rest >= min_block : rest > small_size;
  if (split) {
    block *r = block_new(p, b->addr + size, rest);
    if (r == NULL) return false;
    r->left = b;
    r->right = b->right;
    if (b->right) b->right->left = r;
    b->right = r;
    b->size = size;
    if (p->xlast == b) p->xlast = r;
  }
  free_list_unlink(p, b);
  b->free = false;
  return true;
}

/* Allocates `bytes` (> 0) on `stream`. Returns the block, NULL when out of host memory. */
static block *sim_alloc(sim *s, uint32_t stream, uint64_t bytes) {
  uint64_t size = request_size(bytes);
  pool *p = pool_of(s, stream, !s->best_fit && size <= small_size);
  if (p == NULL) return NULL;
  block *b = best_fit(s, p, size);
  if (b == NULL) b = grow(s, p, size);
  if (b == NULL || !take(s, b, size)) return NULL;
  return b;
}

/* Removes free block n from its segment and its pool; its bytes have joined a neighbour. */
static void absorb(block *n) {
  free_list_unlink(n->pool, n);
  if (n->left) n->left->right = n->right;
  if (n->right) n->right->left = n->left;
  free(n);
}

/* Frees b and merges it with its free neighbours in the segment. */
static void sim_free(block *b) {
  pool *p = b->pool;
  block *r = b->right, *l = b->left;
  if (r && r->free) {
    b->size += r->size;
    if (p->xlast == r) p->xlast = b;
    absorb(r);
  }
  if (l && l->free) {
    b->addr = l->addr;
    b->size += l->size;
    absorb(l);
  }
  b->free = true;
  free_list_push(p, b);
}

/* Every block still in the simulation: the live ones through the id table, the free ones here. */
static void sim_destroy(sim *s) {
  for (size_t k = 0; k < s->npools; k++) {
    pool *p = s->pools[k];
    while (p && p->free_list) {
      block *b = p->free_list;
      free_list_unlink(p, b);
      free(b);
    }
    free(p);
  }
  free(s->pools);
}

/* ---- live ids ------------------------------------------------------------------------------
 * A chained hash table from a live trace id to its block (NULL for a 0-byte request) and size.
 * Fibonacci hashing spreads the sequential ids traces use. */

typedef struct live {
  uint64_t id, bytes, line;
  block *b;
  struct live *next;
} live;

typedef struct live_table {
  live **slot;
  unsigned bits; /* 2^bits chains */
  size_t count;
} live_table;

static size_t live_hash(const live_table *t, uint64_t id) {
  return (size_t)((id * 0x9E3779B97F4A7C15ULL) >> (64 - t->bits));
}

/* The chain link that points at id's entry (or at the chain's NULL end). */
static live **live_link(const live_table *t, uint64_t id) {
  live **at = &t->slot[live_hash(t, id)];
  while (*at && (*at)->id != id) at = &(*at)->next;
  return at;
}

/* Doubles the chains when they average two entries. false: out of memory (the table stays). */
static bool live_rehash(live_table *t) {
  unsigned bits = t->bits ? t->bits + 1 : 10;
  live **slot = calloc((size_t)1 << bits, sizeof *slot);
  if (slot == NULL) return false;
  live_table n = {.slot = slot, .bits = bits, .count = t->count};
  for (size_t i = 0; t->bits && i < ((size_t)1 << t->bits); i++) {
    while (t->slot[i]) {
      live *e = t->slot[i];
      t->slot[i] = e->next;
      live **at = &slot[live_hash(&n, e->id)];
      e->next = *at;
      *at = e;
    }
  }
  free(t->slot);
  *t = n;
  return true;
}

/* ---- the trace ------------------------------------------------------------------------------ */

typedef struct run {
  const char *path; /* for messages ("-": standard input) */
  uint64_t line;
  uint64_t requested, peak_requested;
  uint64_t allocs;
} run;

static int trace_error(const run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int trace_error(const run *r, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, PROG ": %s:%" PRIu64 ": ", r->path, r->line);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  return 2;
}

static int out_of_memory(const run *r) {
  fprintf(stderr, PROG ": %s:%" PRIu64 ": out of host memory for the simulation\n", r->path, r->line);
  return 1;
}

/* A whole number of decimal digits and nothing else, <= max. */
static bool parse_whole(const char *tok, uint64_t max, uint64_t *out) {
  uint64_t v = 0;
  if (tok == NULL || *tok == '\0') return false;
  for (const char *c = tok; *c; c++) {
    if (*c < '0' || *c > '9' || v > (max - (uint64_t)(*c - '0')) / 10) return false;
    v = v * 10 + (uint64_t)(*c - '0');
  }
  *out = v;
  return true;
}

/* One event: `a <id> <bytes> [<stream>]` or `f <id>` (tok[0..3], NULL past the line's end). */
static int apply(sim *s, run *r, live_table *t, char *tok[4]) {
  bool is_alloc = strcmp(tok[0], "a") == 0;
  uint64_t id, bytes = 0, stream = 0;
  if (!is_alloc && strcmp(tok[0], "f") != 0)
    return trace_error(r, "unknown event '%s'; expected 'a <id> <bytes> [<stream>]' or 'f <id>'", tok[0]);
  if (!parse_whole(tok[1], ID_LIMIT, &id))
    return trace_error(r, "'%s' needs an id, a whole number 0..2^63; got '%s'", tok[0], tok[1] ? tok[1] : "");
  live **at = live_link(t, id);

  if (!is_alloc) {
    live *e = *at;
    if (e == NULL) return trace_error(r, "free of id %" PRIu64 " which is not live; expected a live id", id);
    if (e->b) sim_free(e->b);
    r->requested -= e->bytes;
    *at = e->next;
    free(e);
    t->count--;
    return 0;
  }
  /* PyTorch's allocate refuses 1 EiB and more; the cap also keeps the sums below from wrapping. */
  if (!parse_whole(tok[2], EIB - 1, &bytes))
    return trace_error(r, "allocation of id %" PRIu64 " needs a whole number of bytes below 2^60; got '%s'", id,
                       tok[2] ? tok[2] : "");
  if (tok[3] && !parse_whole(tok[3], MAX_STREAMS - 1, &stream))
    return trace_error(r, "stream index '%s' is not a whole number 0..%d", tok[3], MAX_STREAMS - 1);
  if (*at)
    return trace_error(r, "id %" PRIu64 " is allocated again while live (since line %" PRIu64 "); expected a free first",
                       id, (*at)->line);

  live *e = calloc(1, sizeof *e);
  if (e == NULL) return out_of_memory(r);
  e->id = id;
  e->bytes = bytes;
  e->line = r->line;
  if (bytes > 0 && (e->b = sim_alloc(s, (uint32_t)stream, bytes)) == NULL) {
    free(e);
    return out_of_memory(r);
  }
  *at = e;
  t->count++;
  r->allocs++;
  r->requested += bytes;
  if (r->requested > r->peak_requested) r->peak_requested = r->requested;
  if (t->count > ((size_t)2 << t->bits) && !live_rehash(t)) return out_of_memory(r);
  return 0;
}

/* Replays the whole trace from f. 0, or the exit code after a message. */
static int replay(sim *s, run *r, live_table *t, FILE *f) {
  char *buf = NULL;
  size_t cap = 0;
  ssize_t len;
  int rc = 0;
  while (rc == 0 && (len = getline(&buf, &cap, f)) >= 0) {
    r->line++;
    if (memchr(buf, '\0', (size_t)len)) {
      rc = trace_error(r, "a NUL byte; expected a text trace");
      break;
    }
    buf[strcspn(buf, "#")] = '\0';
    char *tok[4] = {NULL, NULL, NULL, NULL};
    char *save = NULL;
    int n = 0;
    for (char *w = strtok_r(buf, " \t\r\n\v\f", &save); w && n < 4; w = strtok_r(NULL, " \t\r\n\v\f", &save))
      tok[n++] = w;
    if (n > 0) rc = apply(s, r, t, tok);
  }
  if (rc == 0 && ferror(f)) {
    r->line++;
    rc = trace_error(r, "read error: %s", strerror(errno));
  }
  free(buf);
  return rc;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " TRACE|- [--expandable] [--large-page BYTES] [--best-fit] [--help]\n"
          "Replays an allocation trace (ebb-alloc-replay's format; '-' reads standard input, e.g.\n"
          "from zcat) against a simulation of PyTorch's CUDA caching allocator and prints:\n"
          "  peak_requested=B peak_reserved=B frag_ratio=R allocs=N driver_allocs=N\n"
          "  --expandable       expandable segments: one range per stream and pool, grown by pages\n"
          "                     (driver_allocs counts pages); default: classic segments (driver_allocs\n"
          "                     counts segments)\n"
          "  --large-page BYTES the large pool's page with --expandable (a multiple of 2097152;\n"
          "                     default 20971520, PyTorch's; the small pool's is 2097152)\n"
          "  --best-fit         not PyTorch's policy: plain best fit over one pool per stream for\n"
          "                     every size, grown by 2 MiB pages, the free block at the mapped end\n"
          "                     measured by its size (implies --expandable --large-page 2097152)\n"
          "frag_ratio is peak_reserved / peak_requested (0.000 when nothing was requested).\n"
          "The rules and what was checked in PyTorch's source: the header of perf/frag_reference.c.\n"
          "Exit: 0 ok, 1 out of host memory, 2 bad command line or bad trace.\n");
}

/* Reads the command line into s and *path. Returns -1 to go on, else the exit code. */
static int parse_args(int argc, char **argv, sim *s, const char **path) {
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      usage(stdout);
      return 0;
    }
    if (strcmp(arg, "--expandable") == 0) {
      s->expandable = true;
      continue;
    }
    if (strcmp(arg, "--best-fit") == 0) {
      s->best_fit = true;
      continue;
    }
    if (strcmp(arg, "--large-page") == 0) {
      const char *v = i + 1 < argc ? argv[++i] : NULL;
      if (!parse_whole(v, (uint64_t)1 << 40, &s->large_page) || s->large_page == 0 ||
          s->large_page % small_buffer != 0) {
        fprintf(stderr, PROG ": --large-page needs a whole multiple of 2097152 bytes (2 MiB)\n");
        return 2;
      }
      continue;
    }
    bool option = arg[0] == '-' && arg[1] != '\0'; /* "-" alone is standard input */
    if (option || *path != NULL) {
      if (option) fprintf(stderr, PROG ": unknown argument '%s'\n", arg);
      else fprintf(stderr, PROG ": one trace expected, got '%s' and '%s'\n", *path, arg);
      return 2;
    }
    *path = arg;
  }
  if (s->best_fit) {
    if (s->large_page != large_buffer && s->large_page != small_buffer) {
      fprintf(stderr, PROG ": --best-fit grows by 2 MiB pages; --large-page must be 2097152 or left out\n");
      return 2;
    }
    s->expandable = true;
    s->large_page = small_buffer;
  }
  if (*path != NULL) return -1;
  usage(stderr);
  return 2;
}

int main(int argc, char **argv) {
  const char *path = NULL;
  sim s = {.large_page = large_buffer, .next_va = (uint64_t)1 << 32};
  int rc = parse_args(argc, argv, &s, &path);
  if (rc >= 0) return rc;

  run r = {.path = path};
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
  if (f == NULL) return trace_error(&r, "cannot open the trace: %s; expected a readable text file", strerror(errno));
  live_table t = {0};
  rc = live_rehash(&t) ? replay(&s, &r, &t, f) : out_of_memory(&r);
  if (f != stdin) fclose(f);

  if (rc == 0) {
    double ratio = r.peak_requested ? (double)s.peak_reserved / (double)r.peak_requested : 0.0;
    printf("peak_requested=%" PRIu64 " peak_reserved=%" PRIu64 " frag_ratio=%.3f allocs=%" PRIu64
           " driver_allocs=%" PRIu64 "\n",
           r.peak_requested, s.peak_reserved, ratio, r.allocs, s.driver_allocs);
    if (fflush(stdout) != 0) rc = 1;
  }

  /* Live blocks first (through the table), then the free ones. */
  for (size_t i = 0; t.bits && i < ((size_t)1 << t.bits); i++) {
    while (t.slot[i]) {
      live *e = t.slot[i];
      t.slot[i] = e->next;
      free(e->b);
      free(e);
    }
  }
  free(t.slot);
  sim_destroy(&s);
  return rc;
}
