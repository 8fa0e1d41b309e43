/* history.c: who owns the memory and what the allocator did. Owner scopes (a per-thread stack
 * of category + interned name), the per-arena ring of allocator actions, the top-owners line of
 * the OOM report and the JSON snapshot in PyTorch's layout (allocators.md 1.15, 1.16).
 *
 * Owns: the process-wide table of interned owner names and the chunks holding their text
 * (never freed: blocks, history entries and other threads keep pointers to them, also across
 * ebb_shutdown; reachable from static pointers, so leak checkers stay quiet), each thread's
 * owner stack, and each arena's history ring (allocated at arena start, freed at its end).
 *
 * Threading: the name table has one leaf lock (EBB_RANK_LEAF), taken only by
 * ebb_alloc_owner_push and never with another lock held. The owner stack is thread-local. A
 * history ring is part of its arena and written and read under the arena's `mu`; the snapshot
 * holds one arena's lock at a time and writes the file with no lock held.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_export.h"
#include "arena_impl.h"

/* ---- interned owner names ------------------------------------------------------------------ */

#define EBB__NAMES_MAX ((size_t)1 << 16)       /* distinct names; the table never shrinks */
#define EBB__NAME_CHUNK ((size_t)64 << 10)     /* name text is bump-allocated from chunks */

static struct {
  ebb_mutex mu;
  const char **slot; /* open addressing, power-of-two size, NULL: empty */
  size_t cap, count;
  char *chunk;       /* current chunk; its first word links to the previous one */
  size_t used;
} ebb__names = {.mu = {PTHREAD_MUTEX_INITIALIZER, "owner-names", EBB_RANK_LEAF}};

static uint64_t ebb__hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h;
}

/* Copies n bytes + NUL into chunk memory. Lock held. NULL when out of host memory. */
static const char *ebb__name_store(const char *s, size_t n) {
  if (!ebb__names.chunk || ebb__names.used + n + 1 > EBB__NAME_CHUNK) {
    char *c = malloc(EBB__NAME_CHUNK);
    if (!c) return NULL;
    memcpy(c, &ebb__names.chunk, sizeof(char *));
    ebb__names.chunk = c;
    ebb__names.used = sizeof(char *);
  }
  char *d = ebb__names.chunk + ebb__names.used;
  memcpy(d, s, n);
  d[n] = '\0';
  ebb__names.used += n + 1;
  return d;
}

/* Lock held. Doubles the table (load factor <= 1/2). */
static bool ebb__names_grow(void) {
  size_t nc = ebb__names.cap ? ebb__names.cap * 2 : 256;
  const char **ns = calloc(nc, sizeof *ns);
  if (!ns) return false;
  for (size_t i = 0; i < ebb__names.cap; i++) {
    const char *e = ebb__names.slot[i];
    if (!e) continue;
    size_t j = ebb__hash(e, strlen(e)) & (nc - 1);
    while (ns[j]) j = (j + 1) & (nc - 1);
    ns[j] = e;
  }
  free(ebb__names.slot);
  ebb__names.slot = ns;
  ebb__names.cap = nc;
  return true;
}

static ebb_status ebb__intern_locked(const char *fn, const char *name, size_t n, const char **out);

/* A thread's recently interned names, keyed by the caller's pointer and checked by content (the
 * caller's buffer may hold another name since): autograd pushes a scope per backward node with
 * the derivative table's static names, which then cost no lock. Direct-mapped. */
#define EBB__NAME_CACHE 16
static _Thread_local struct {
  const char *key, *interned;
} ebb__name_cache[EBB__NAME_CACHE];

ebb_status ebb__intern(const char *fn, const char *name, size_t n, const char **out) {
  if (n == 0) {
    *out = ""; /* the unnamed owner needs no table entry */
    return EBB_OK;
  }
  size_t ci = ((uintptr_t)name >> 3) & (EBB__NAME_CACHE - 1);
  const char *hit = ebb__name_cache[ci].key == name ? ebb__name_cache[ci].interned : NULL;
  if (hit && !strncmp(hit, name, n) && hit[n] == '\0') {
    *out = hit;
    return EBB_OK;
  }
  ebb_status st = ebb__intern_locked(fn, name, n, out);
  if (!st) {
    ebb__name_cache[ci].key = name;
    ebb__name_cache[ci].interned = *out;
  }
  return st;
}

static ebb_status ebb__intern_locked(const char *fn, const char *name, size_t n, const char **out) {
  uint64_t h = ebb__hash(name, n);
  ebb__mutex_lock(&ebb__names.mu);
  if (ebb__names.cap) {
    for (size_t j = h & (ebb__names.cap - 1);; j = (j + 1) & (ebb__names.cap - 1)) {
      const char *e = ebb__names.slot[j];
      if (!e) break;
      if (!strncmp(e, name, n) && e[n] == '\0') {
        ebb__mutex_unlock(&ebb__names.mu);
        *out = e;
        return EBB_OK;
      }
    }
  }
  if (ebb__names.count == EBB__NAMES_MAX) {
    ebb__mutex_unlock(&ebb__names.mu);
    return ebb__fail(EBB_ELIMIT,
                     "%s: %zu distinct owner names are interned (the maximum; names are never freed); expected names "
                     "reused across steps, not one per allocation",
                     fn, EBB__NAMES_MAX);
  }
  const char *d = NULL;
  if ((ebb__names.count + 1) * 2 <= ebb__names.cap || ebb__names_grow()) d = ebb__name_store(name, n);
  if (!d) {
    ebb__mutex_unlock(&ebb__names.mu);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory to intern the owner name '%.*s'", fn, (int)n, name);
  }
  size_t j = h & (ebb__names.cap - 1);
  while (ebb__names.slot[j]) j = (j + 1) & (ebb__names.cap - 1);
  ebb__names.slot[j] = d;
  ebb__names.count++;
  ebb__mutex_unlock(&ebb__names.mu);
  *out = d;
  return EBB_OK;
}

/* ---- owner scopes -------------------------------------------------------------------------- */

/* The owner stack (arena_impl.h): one thread-local object, not two, since each reaches the
 * thread's TLS block through its own descriptor call (libebb may be dlopen'ed: no initial-exec
 * model); `top` mirrors stack[depth - 1] ({OTHER, ""} at depth 0) for ebb__owner_current. */
_Thread_local struct ebb__owner_tls ebb__os = {0, {"", EBB_OWNER_OTHER}, {{NULL, 0}}};

static const char *const ebb__cat_names[EBB_OWNER_CAT_COUNT] = {
    "other", "parameter", "gradient", "saved", "activation", "optimizer", "staging", "backward",
};

const char *ebb_owner_cat_name(ebb_owner_cat cat) {
  return (unsigned)cat < EBB_OWNER_CAT_COUNT ? ebb__cat_names[cat] : "unknown";
}

ebb_status ebb_alloc_owner_push(ebb_owner_cat cat, const char *name) {
  static const char fn[] = "ebb_alloc_owner_push";
  if ((unsigned)cat >= EBB_OWNER_CAT_COUNT)
    return ebb__fail(EBB_EINVAL, "%s: category %d is not an ebb_owner_cat; expected 0 <= cat < %d", fn, (int)cat,
                     EBB_OWNER_CAT_COUNT);
  if (!name) return ebb__fail(EBB_EINVAL, "%s: name is NULL; expected a string (\"\" for no name)", fn);
  size_t n = strnlen(name, EBB_OWNER_NAME_MAX + 1);
  if (n > EBB_OWNER_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "%s: name '%.32s...' is longer than %d bytes; expected a shorter name", fn, name,
                     EBB_OWNER_NAME_MAX);
  if (ebb__os.depth == EBB_OWNER_MAX_DEPTH)
    return ebb__fail(EBB_ELIMIT, "%s: this thread already holds %d owner scopes (the maximum), innermost %s/%s; expected "
                     "an ebb_alloc_owner_pop for every push",
                     fn, EBB_OWNER_MAX_DEPTH, ebb__cat_names[ebb__os.stack[ebb__os.depth - 1].cat],
                     ebb__os.stack[ebb__os.depth - 1].name);
  const char *in = NULL;
  ebb_status st = ebb__intern(fn, name, n, &in);
  if (st) return st;
  ebb__os.stack[ebb__os.depth].name = in;
  ebb__os.stack[ebb__os.depth].cat = (uint8_t)cat;
  ebb__os.top = ebb__os.stack[ebb__os.depth];
  ebb__os.depth++;
  return EBB_OK;
}

ebb_status ebb__alloc_intern(const char *fn, const char *name, const char **out) {
  if (!name) return ebb__fail(EBB_EINVAL, "%s: name is NULL; expected a string", fn);
  size_t n = strnlen(name, EBB_OWNER_NAME_MAX + 1);
  if (n > EBB_OWNER_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "%s: name '%.32s...' is longer than %d bytes; expected a shorter name", fn, name, EBB_OWNER_NAME_MAX);
  return ebb__intern(fn, name, n, out);
}

bool ebb__alloc_owner_push_interned(ebb_owner_cat cat, const char *interned) {
  if (ebb__os.depth == EBB_OWNER_MAX_DEPTH) return false;
  ebb__os.stack[ebb__os.depth].name = interned;
  ebb__os.stack[ebb__os.depth].cat = (uint8_t)cat;
  ebb__os.top = ebb__os.stack[ebb__os.depth];
  ebb__os.depth++;
  return true;
}

/* Checks shared by the block-owner calls; the name interned into *in when setting. */
static ebb_status ebb__block_owner_args(const char *fn, const void *ptr, bool set, ebb_owner_cat cat, const char *name,
                                        const char **in) {
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return ebb__fail(EBB_EINVAL, "%s: ptr is NULL; expected the start of a live block", fn);
  if (!set) return EBB_OK;
  if ((unsigned)cat >= EBB_OWNER_CAT_COUNT)
    return ebb__fail(EBB_EINVAL, "%s: category %d is not an ebb_owner_cat; expected 0 <= cat < %d", fn, (int)cat,
                     EBB_OWNER_CAT_COUNT);
  if (!name) return ebb__fail(EBB_EINVAL, "%s: name is NULL; expected a string (\"\" for no name)", fn);
  size_t n = strnlen(name, EBB_OWNER_NAME_MAX + 1);
  if (n > EBB_OWNER_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "%s: name '%.32s...' is longer than %d bytes; expected a shorter name", fn, name,
                     EBB_OWNER_NAME_MAX);
  return ebb__intern(fn, name, n, in);
}

ebb_status ebb_alloc_block_owner(const void *ptr, ebb_owner_cat *cat, const char **name) {
  static const char fn[] = "ebb_alloc_block_owner";
  ebb_status st = ebb__block_owner_args(fn, ptr, false, EBB_OWNER_OTHER, NULL, NULL);
  if (st) return st;
  if (!cat) return ebb__fail(EBB_EINVAL, "%s: cat is NULL; expected an ebb_owner_cat to fill", fn);
  return ebb__arena_owner(fn, ptr, false, 0, NULL, cat, name);
}

ebb_status ebb_alloc_block_set_owner(void *ptr, ebb_owner_cat cat, const char *name, ebb_owner_cat *old_cat,
                                     const char **old_name) {
  static const char fn[] = "ebb_alloc_block_set_owner";
  const char *in = NULL;
  ebb_status st = ebb__block_owner_args(fn, ptr, true, cat, name, &in);
  if (st) return st;
  return ebb__arena_owner(fn, ptr, true, (uint8_t)cat, in, old_cat, old_name);
}

ebb_status ebb_alloc_owner_pop(void) {
  if (ebb__os.depth == 0)
    return ebb__fail(EBB_ESTATE, "ebb_alloc_owner_pop: this thread has no owner scope open; expected a matching "
                                 "ebb_alloc_owner_push before");
  ebb__os.depth--;
  ebb__os.top = ebb__os.depth ? ebb__os.stack[ebb__os.depth - 1] : (struct ebb__owner){"", EBB_OWNER_OTHER};
  return EBB_OK;
}


/* ---- history ring -------------------------------------------------------------------------- */

static const char *const ebb__act_names[] = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom",
};

const char *ebb_alloc_action_name(ebb_alloc_action action) {
  return (unsigned)action < EBB_ARRAY_LEN(ebb__act_names) ? ebb__act_names[action] : "unknown";
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
static size_t ebb__hist_held(const struct ebb__hist *h) { return h->total < h->cap ? (size_t)h->total : h->cap; }

/* Hands the newest n actions (n <= ebb__hist_held) to emit, oldest first: an
 * EBB__HIST_FREE_PAIR slot becomes its FREE_REQUESTED and FREE_COMPLETED entries. Lock held. */
static void ebb__hist_expand(const struct ebb__hist *h, size_t n,
                             void (*emit)(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action),
                             void *ctx) {
  if (!n) return;
  /* Back from the newest slot until n actions are covered; the oldest slot reached may hold
   * one more than needed (the FREE_REQUESTED half of a pair), skipped. The ring holds at least
   * ebb__hist_held actions, so this stops within cap slots. */
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

static void ebb__hist_emit_entry(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action) {
  struct ebb__hist_entry *out = ctx;
  out[k] = *e;
  out[k].sac = ebb__he_sac(ebb__he_stream(e), action, ebb__he_cat(e));
}

struct ebb__hist_trace_out {
  ebb_alloc_trace_entry *out;
  int device;
};

static void ebb__hist_emit_trace(void *ctx, size_t k, const struct ebb__hist_entry *e, uint8_t action) {
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

/* Copies the newest min(cap, held) actions, oldest first. Lock held. */
static size_t ebb__hist_copy(const struct ebb__arena *a, struct ebb__hist_entry *out, size_t cap) {
  size_t held = ebb__hist_held(&a->hist);
  size_t n = held < cap ? held : cap;
  ebb__hist_expand(&a->hist, n, ebb__hist_emit_entry, out);
  return n;
}

ebb_status ebb__hist_get(struct ebb__arena *a, ebb_alloc_trace_entry *out, size_t cap, size_t *count,
                         uint64_t *total) {
  ebb__lock(&a->mu);
  size_t held = ebb__hist_held(&a->hist);
  uint64_t tot = a->hist.total;
  if (!out) {
    ebb__unlock(&a->mu);
    *count = held;
    if (total) *total = tot;
    return EBB_OK;
  }
  size_t n = held < cap ? held : cap;
  struct ebb__hist_trace_out o = {out, a->device};
  ebb__hist_expand(&a->hist, n, ebb__hist_emit_trace, &o);
  ebb__unlock(&a->mu);
  *count = n;
  if (total) *total = tot;
  return EBB_OK;
}

/* ---- top owners (OOM report) --------------------------------------------------------------- */

struct ebb__oagg {
  const char *name;
  uint64_t bytes;
  uint8_t cat;
  bool used;
};

static void ebb__oagg_add(struct ebb__oagg *t, size_t tcap, const char *owner, uint8_t cat, uint64_t bytes) {
  const char *nm = owner ? owner : "";
  size_t j = (size_t)(((uintptr_t)nm >> 3) * 31 + cat) & (tcap - 1);
  while (t[j].used && (t[j].name != nm || t[j].cat != cat)) j = (j + 1) & (tcap - 1);
  t[j].used = true;
  t[j].name = nm;
  t[j].cat = cat;
  t[j].bytes += bytes;
}

void ebb__top_owners(struct ebb__arena *a, char *buf, size_t cap) {
  buf[0] = '\0';
  size_t live = 0;
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next)
    for (struct ebb__block *b = ebb_container_of(n, struct ebb__segment, node)->first; b; b = b->next) {
      live += b->state == EBB__B_ALLOC;
      if (b->state == EBB__B_SLAB) live += ebb__slab_of(b)->nslots;
    }
  if (!live) return;
  /* Interned names make (pointer, category) the key: no string compares. */
  size_t tcap = 16;
  while (tcap < live * 2) tcap *= 2;
  struct ebb__oagg *t = calloc(tcap, sizeof *t);
  if (!t) return; /* the report goes out without this line rather than not at all */
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next)
    for (struct ebb__block *b = ebb_container_of(n, struct ebb__segment, node)->first; b; b = b->next) {
      if (b->state == EBB__B_SLAB) {
        const struct ebb__slab *sl = ebb__slab_of(b);
        for (unsigned i = 0; i < sl->nslots; i++)
          if (sl->slots[i].state == EBB__B_ALLOC) ebb__oagg_add(t, tcap, sl->slots[i].owner, sl->slots[i].owner_cat, sl->slot);
        continue;
      }
      if (b->state != EBB__B_ALLOC) continue;
      ebb__oagg_add(t, tcap, b->owner, b->owner_cat, b->size);
    }
  size_t at = (size_t)snprintf(buf, cap, ", top owners:");
  for (int k = 0; k < 5 && at < cap; k++) {
    struct ebb__oagg *best = NULL;
    for (size_t j = 0; j < tcap; j++)
      if (t[j].used && t[j].bytes && (!best || t[j].bytes > best->bytes)) best = &t[j];
    if (!best) break;
    char sz[24];
    /* Names are clipped: the whole report must fit the 512-byte error message. */
    at += (size_t)snprintf(buf + at, cap - at, "%s %s/%.24s %s", k ? "," : "", ebb_owner_cat_name(best->cat),
                           *best->name ? best->name : "(none)", ebb__fmt_bytes(sz, sizeof sz, best->bytes));
    best->bytes = 0;
  }
  free(t);
}

/* ---- JSON snapshot ------------------------------------------------------------------------- */

/* A growing text buffer; `bad` latches the first allocation failure so callers check once. */
struct ebb__sbuf {
  char *p;
  size_t n, cap;
  bool bad;
};

static void ebb__sb_reserve(struct ebb__sbuf *b, size_t more) {
  if (b->bad || b->n + more + 1 <= b->cap) return;
  size_t nc = b->cap ? b->cap : 4096;
  while (nc < b->n + more + 1) nc *= 2;
  char *np = realloc(b->p, nc);
  if (!np) {
    b->bad = true;
    return;
  }
  b->p = np;
  b->cap = nc;
}

static void ebb__sb_printf(struct ebb__sbuf *b, const char *fmt, ...) EBB_PRINTF(2, 3);
static void ebb__sb_printf(struct ebb__sbuf *b, const char *fmt, ...) {
  if (b->bad) return;
  va_list ap;
  va_start(ap, fmt);
  char tmp[256];
  int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (k < 0) {
    b->bad = true;
    return;
  }
  ebb__sb_reserve(b, (size_t)k);
  if (b->bad) return;
  if ((size_t)k < sizeof tmp) {
    memcpy(b->p + b->n, tmp, (size_t)k + 1);
  } else {
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
  }
  b->n += (size_t)k;
}

static void ebb__sb_put(struct ebb__sbuf *b, const char *s, size_t n) {
  ebb__sb_reserve(b, n);
  if (b->bad) return;
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}

/* A JSON string: owner names and paths are caller text and may hold quotes or controls. */
static void ebb__sb_str(struct ebb__sbuf *b, const char *s) {
  ebb__sb_put(b, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)(s ? s : ""); *c; c++) {
    if (*c == '"' || *c == '\\') {
      char e[2] = {'\\', (char)*c};
      ebb__sb_put(b, e, 2);
    } else if (*c < 0x20) {
      ebb__sb_printf(b, "\\u%04x", *c);
    } else {
      ebb__sb_put(b, (const char *)c, 1);
    }
  }
  ebb__sb_put(b, "\"", 1);
}

static void ebb__sb_owner(struct ebb__sbuf *b, uint8_t cat, const char *name) {
  ebb__sb_printf(b, ",\"owner\":{\"category\":\"%s\",\"name\":", ebb_owner_cat_name((ebb_owner_cat)cat));
  ebb__sb_str(b, name);
  ebb__sb_put(b, "}", 1);
}

static const char *ebb__state_name(int state) {
  switch (state) {
  case EBB__B_ALLOC: return "active_allocated";
  case EBB__B_PENDING:
  case EBB__B_FREEING: return "active_pending_free";
  default: return "inactive";
  }
}

/* Appends one block (or slot) of a segment's list. */
static void ebb__snap_block(struct ebb__sbuf *segs, bool *bfirst, uint64_t addr, uint64_t size, uint64_t requested,
                            uint64_t stream, int state, uint8_t owner_cat, const char *owner) {
  bool act = state != EBB__B_FREE;
  ebb__sb_printf(segs,
                 "%s{\"address\":%" PRIu64 ",\"size\":%" PRIu64 ",\"requested_size\":%" PRIu64 ",\"stream\":%" PRIu64
                 ",\"state\":\"%s\",\"frames\":[]",
                 *bfirst ? "" : ",", addr, size, act ? requested : 0, stream, ebb__state_name(state));
  *bfirst = false;
  ebb__sb_owner(segs, act ? owner_cat : EBB_OWNER_OTHER, act ? (owner ? owner : "") : "");
  ebb__sb_put(segs, "}", 1);
}

/* The stream a segment is shown under: its first mapped block's (a hole is nobody's). */
static uint64_t ebb__seg_stream(const struct ebb__segment *g) {
  for (const struct ebb__block *b = g->first; b; b = b->next)
    if (b->spool) return b->spool->stream.id;
  return 0;
}

/* Appends the arena's segments (each preceded by a comma when *first is false) to `segs`. Lock
 * held. */
static void ebb__snap_segments(struct ebb__arena *a, struct ebb__sbuf *segs, bool *first) {
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    const struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    uint64_t alloc = 0, active = 0, req = 0;
    for (const struct ebb__block *b = g->first; b; b = b->next) {
      if (b->state == EBB__B_SLAB) {
        const struct ebb__slab *sl = ebb__slab_of(b);
        for (unsigned i = 0; i < sl->nslots; i++) {
          const struct ebb__slot *t = &sl->slots[i];
          if (t->state == EBB__B_ALLOC) {
            alloc += sl->slot;
            req += t->requested;
          }
          if (t->state != EBB__B_FREE) active += sl->slot;
        }
        continue;
      }
      if (b->state == EBB__B_ALLOC) {
        alloc += b->size;
        req += b->requested;
      }
      if (b->state == EBB__B_ALLOC || b->state == EBB__B_PENDING || b->state == EBB__B_FREEING) active += b->size;
    }
    ebb__sb_printf(segs,
                   "%s{\"device\":%d,\"address\":%" PRIu64 ",\"total_size\":%zu,\"allocated_size\":%" PRIu64
                   ",\"active_size\":%" PRIu64 ",\"requested_size\":%" PRIu64 ",\"stream\":%" PRIu64,
                   *first ? "" : ",", a->device, g->base, g->size - g->unmapped, alloc, active, req, ebb__seg_stream(g));
    ebb__sb_printf(segs, ",\"segment_type\":\"%s\",\"segment_pool_id\":[0,0],\"is_expandable\":%s,\"frames\":[],\"blocks\":[",
                   g->pool == EBB__POOL_SMALL ? "small" : "large", g->expandable ? "true" : "false");
    *first = false;
    bool bfirst = true;
    for (const struct ebb__block *b = g->first; b; b = b->next) {
      /* Holes of an expandable segment hold no memory: left out, as from total_size. */
      if (b->state == EBB__B_UNMAPPED) continue;
      if (b->state == EBB__B_SLAB) {
        /* A slab's slots are the blocks of its span: they tile it, and the viewer sees each
         * allocation at its own address. */
        const struct ebb__slab *sl = ebb__slab_of(b);
        for (unsigned i = 0; i < sl->nslots; i++) {
          const struct ebb__slot *t = &sl->slots[i];
          ebb__snap_block(segs, &bfirst, sl->addr + (uint64_t)i * sl->slot, sl->slot, t->requested, b->spool->stream.id,
                          t->state, t->owner_cat, t->owner);
        }
        continue;
      }
      ebb__snap_block(segs, &bfirst, b->addr, b->size, b->requested, b->spool->stream.id, b->state, b->owner_cat, b->owner);
    }
    ebb__sb_put(segs, "]}", 2);
  }
}

static void ebb__snap_trace(const struct ebb__arena *a, const struct ebb__hist_entry *e, size_t n,
                            struct ebb__sbuf *tr) {
  ebb__sb_put(tr, "[", 1);
  for (size_t i = 0; i < n; i++, e++) {
    const char *act = ebb_alloc_action_name((ebb_alloc_action)ebb__he_action(e));
    ebb__sb_printf(tr,
                   "%s{\"action\":\"%s\",\"addr\":%" PRIu64 ",\"size\":%" PRIu64 ",\"requested_size\":%" PRIu64
                   ",\"stream\":%" PRIu64 ",\"time_us\":%" PRIu64 ",\"device\":%d,\"frames\":[]",
                   i ? "," : "", act, e->addr, e->size, e->requested, ebb__he_stream(e), e->time_ns / 1000, a->device);
    /* PyTorch's viewer reads an oom's free bytes from "device_free"; "addr" stays for tools. */
    if (ebb__he_action(e) == EBB_ACT_OOM) ebb__sb_printf(tr, ",\"device_free\":%" PRIu64, e->addr);
    ebb__sb_owner(tr, (uint8_t)ebb__he_cat(e), e->owner ? e->owner : "");
    ebb__sb_put(tr, "}", 1);
  }
  ebb__sb_put(tr, "]", 1);
}

/* One arena's segments and trace, copied under its lock and formatted after it. The ring is
 * copied, not printed, under the lock: the lock is held for a memcpy-sized moment, not for
 * 65536 printf calls. `*copy` is grown to the ring's capacity (fixed while the arena lives)
 * before locking. */
static ebb_status ebb__snap_arena(const char *fn, struct ebb__arena *a, struct ebb__sbuf *segs, bool *first_seg,
                                  struct ebb__sbuf *trace, struct ebb__hist_entry **copy, size_t *copy_cap) {
  size_t cap = a->hist.cap;
  if (cap > *copy_cap) {
    struct ebb__hist_entry *nc = realloc(*copy, cap * sizeof *nc);
    if (!nc) return ebb__fail(EBB_ENOMEM, "%s: no host memory to copy %zu history entries", fn, cap);
    *copy = nc;
    *copy_cap = cap;
  }
  ebb__lock(&a->mu);
  ebb__snap_segments(a, segs, first_seg);
  size_t n = cap ? ebb__hist_copy(a, *copy, cap) : 0;
  ebb__unlock(&a->mu);
  ebb__snap_trace(a, *copy, n, trace);
  return EBB_OK;
}

ebb_status ebb__snapshot_write(const char *fn, const char *path) {
  struct ebb__sbuf segs = {0}, traces = {0}, out = {0}, pools = {0};
  size_t copy_cap = 0;
  struct ebb__hist_entry *copy = NULL;
  ebb_status st = EBB_OK;
  bool first_seg = true;
  const struct ebb__conf *conf = NULL;
  for (int i = 0;; i++) {
    struct ebb__arena *a = ebb__arena_nth(i);
    if (!a) break;
    conf = &a->conf;
    if (i) ebb__sb_put(&traces, ",", 1);
    if ((st = ebb__snap_arena(fn, a, &segs, &first_seg, &traces, &copy, &copy_cap))) goto done;
  }
  /* The pinned and host pools: the same engine, so the same records, kept apart from the
   * device lists PyTorch's viewers read. */
  for (int i = 0;; i++) {
    struct ebb__arena *a = ebb__hostpool_nth(i);
    if (!a) break;
    ebb__sb_printf(&pools, "%s{\"pool\":\"%s\",\"label\":", i ? "," : "", a->up->name);
    ebb__sb_str(&pools, a->label);
    ebb__sb_printf(&pools, ",\"numa_node\":%d,\"segments\":[", a->numa_node);
    bool first = true;
    struct ebb__sbuf trace = {0};
    st = ebb__snap_arena(fn, a, &pools, &first, &trace, &copy, &copy_cap);
    ebb__sb_put(&pools, "],\"trace\":", 10);
    if (trace.n) ebb__sb_put(&pools, trace.p, trace.n);
    ebb__sb_put(&pools, "}", 1);
    pools.bad |= trace.bad;
    free(trace.p);
    if (st) goto done;
  }
  ebb__sb_put(&out, "{\"segments\":[", 13);
  if (segs.n) ebb__sb_put(&out, segs.p, segs.n);
  ebb__sb_put(&out, "],\"device_traces\":[", 19);
  if (traces.n) ebb__sb_put(&out, traces.p, traces.n);
  ebb__sb_put(&out, "],\"host_pools\":[", 16);
  if (pools.n) ebb__sb_put(&out, pools.p, pools.n);
  ebb__sb_put(&out, "],\"allocator_settings\":{\"EBB_ALLOC_CONF\":", 41);
  ebb__sb_str(&out, conf ? conf->env : "");
  if (conf && conf->max_split != SIZE_MAX)
    ebb__sb_printf(&out, ",\"max_split_size\":%zu", conf->max_split);
  else
    ebb__sb_put(&out, ",\"max_split_size\":-1", 20); /* PyTorch's value for "no limit" */
  ebb__sb_printf(&out, ",\"expandable_segments\":%s,\"history\":%zu,\"oom_snapshot\":",
                 conf && conf->expandable ? "true" : "false", conf ? conf->history : 0);
  ebb__sb_str(&out, conf && conf->oom_snapshot ? conf->oom_snapshot : "");
  ebb__sb_printf(&out, ",\"slab_max_bytes\":%zu", conf ? conf->slab_max : 0);
  ebb__sb_put(&out, "}}\n", 3);
  if (segs.bad || traces.bad || out.bad || pools.bad) {
    st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the snapshot text", fn);
    goto done;
  }
  FILE *f = fopen(path, "w");
  if (!f) {
    st = ebb__fail(EBB_EIO, "%s: cannot open '%s' for writing: %s", fn, path, strerror(errno));
    goto done;
  }
  size_t w = fwrite(out.p, 1, out.n, f);
  int e = w == out.n ? 0 : errno;
  if (fclose(f) != 0 && !e) e = errno;
  if (w != out.n || e) st = ebb__fail(EBB_EIO, "%s: writing '%s' failed: %s", fn, path, strerror(e ? e : EIO));
done:
  free(copy);
  free(segs.p);
  free(traces.p);
  free(pools.p);
  free(out.p);
  return st;
}
