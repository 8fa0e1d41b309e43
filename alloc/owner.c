/* owner.c: who owns the memory. Owner scopes (a per-thread stack of category + interned name)
 * that every allocation reads to tag its block or slot, the interned names they hold, and the
 * owner of a live block read or re-tagged (ebb_alloc_block_owner, ebb_alloc_block_set_owner).
 *
 * Owns: the process-wide table of interned owner names and the chunks holding their text
 * (never freed: blocks, history entries and other threads keep pointers to them, also across
 * ebb_shutdown; reachable from static pointers, so leak checkers stay quiet), and each thread's
 * owner stack and interning cache.
 *
 * Threading: the name table has one leaf lock (EBB_RANK_LEAF), taken only to intern a name this
 * thread's cache does not hold, never with another lock held. The owner stack is thread-local.
 * A block's owner is read and written under its arena's lock.
 */
#include <inttypes.h>
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

static uint64_t owner_hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h;
}

/* Copies n bytes + NUL into chunk memory. Lock held. NULL when out of host memory. */
static const char *name_store(const char *s, size_t n) {
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
static bool names_grow(void) {
  size_t nc = ebb__names.cap ? ebb__names.cap * 2 : 256;
  const char **ns = calloc(nc, sizeof *ns);
  if (!ns) return false;
  for (size_t i = 0; i < ebb__names.cap; i++) {
    const char *e = ebb__names.slot[i];
    if (!e) continue;
    size_t j = owner_hash(e, strlen(e)) & (nc - 1);
    while (ns[j]) j = (j + 1) & (nc - 1);
    ns[j] = e;
  }
  free(ebb__names.slot);
  ebb__names.slot = ns;
  ebb__names.cap = nc;
  return true;
}

static ebb_status intern_locked(const char *fn, const char *name, size_t n, const char **out);

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
  ebb_status st = intern_locked(fn, name, n, out);
  if (!st) {
    ebb__name_cache[ci].key = name;
    ebb__name_cache[ci].interned = *out;
  }
  return st;
}

static ebb_status intern_locked(const char *fn, const char *name, size_t n, const char **out) {
  uint64_t h = owner_hash(name, n);
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
  if ((ebb__names.count + 1) * 2 <= ebb__names.cap || names_grow()) d = name_store(name, n);
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
_Thread_local struct ebb__owner_tls ebb__owner_stack = {0, {"", EBB_OWNER_OTHER}, {{NULL, 0}}};

static const char *const ebb__cat_names[EBB_OWNER_CAT_COUNT] = {
    "other", "parameter", "gradient", "saved", "activation", "optimizer", "staging", "backward",
};

const char *ebb_owner_cat_name(ebb_owner_cat cat) {
  return (unsigned)cat < EBB_OWNER_CAT_COUNT ? ebb__cat_names[cat] : "unknown";
}

/* The checks of an owner (cat, name) a public call `fn` was given; *n: the name's length. */
static ebb_status owner_check(const char *fn, ebb_owner_cat cat, const char *name, size_t *n) {
  if ((unsigned)cat >= EBB_OWNER_CAT_COUNT)
    return ebb__fail(EBB_EINVAL, "%s: category %d is not an ebb_owner_cat; expected 0 <= cat < %d", fn, (int)cat,
                     EBB_OWNER_CAT_COUNT);
  if (!name) return ebb__fail(EBB_EINVAL, "%s: name is NULL; expected a string (\"\" for no name)", fn);
  *n = strnlen(name, EBB_OWNER_NAME_MAX + 1);
  if (*n > EBB_OWNER_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "%s: name '%.32s...' is longer than %d bytes; expected a shorter name", fn, name,
                     EBB_OWNER_NAME_MAX);
  return EBB_OK;
}

ebb_status ebb_alloc_owner_push(ebb_owner_cat cat, const char *name) {
  static const char fn[] = "ebb_alloc_owner_push";
  size_t n = 0;
  ebb_status st = owner_check(fn, cat, name, &n);
  if (st) return st;
  if (ebb__owner_stack.depth == EBB_OWNER_MAX_DEPTH)
    return ebb__fail(EBB_ELIMIT, "%s: this thread already holds %d owner scopes (the maximum), innermost %s/%s; expected "
                     "an ebb_alloc_owner_pop for every push",
                     fn, EBB_OWNER_MAX_DEPTH, ebb__cat_names[ebb__owner_stack.stack[ebb__owner_stack.depth - 1].cat],
                     ebb__owner_stack.stack[ebb__owner_stack.depth - 1].name);
  const char *in = NULL;
  if ((st = ebb__intern(fn, name, n, &in))) return st;
  ebb__owner_stack.stack[ebb__owner_stack.depth].name = in;
  ebb__owner_stack.stack[ebb__owner_stack.depth].cat = (uint8_t)cat;
  ebb__owner_stack.top = ebb__owner_stack.stack[ebb__owner_stack.depth];
  ebb__owner_stack.depth++;
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
  if (ebb__owner_stack.depth == EBB_OWNER_MAX_DEPTH) return false;
  ebb__owner_stack.stack[ebb__owner_stack.depth].name = interned;
  ebb__owner_stack.stack[ebb__owner_stack.depth].cat = (uint8_t)cat;
  ebb__owner_stack.top = ebb__owner_stack.stack[ebb__owner_stack.depth];
  ebb__owner_stack.depth++;
  return true;
}

/* Checks shared by the block-owner calls; the name interned into *in when setting. */
static ebb_status block_owner_args(const char *fn, const void *ptr, bool set, ebb_owner_cat cat, const char *name,
                                        const char **in) {
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return ebb__fail(EBB_EINVAL, "%s: ptr is NULL; expected the start of a live block", fn);
  if (!set) return EBB_OK;
  size_t n = 0;
  if ((st = owner_check(fn, cat, name, &n))) return st;
  return ebb__intern(fn, name, n, in);
}

ebb_status ebb_alloc_block_owner(const void *ptr, ebb_owner_cat *cat, const char **name) {
  static const char fn[] = "ebb_alloc_block_owner";
  ebb_status st = block_owner_args(fn, ptr, false, EBB_OWNER_OTHER, NULL, NULL);
  if (st) return st;
  if (!cat) return ebb__fail(EBB_EINVAL, "%s: cat is NULL; expected an ebb_owner_cat to fill", fn);
  return ebb__arena_owner(fn, ptr, false, 0, NULL, cat, name);
}

ebb_status ebb_alloc_block_set_owner(void *ptr, ebb_owner_cat cat, const char *name, ebb_owner_cat *old_cat,
                                     const char **old_name) {
  static const char fn[] = "ebb_alloc_block_set_owner";
  const char *in = NULL;
  ebb_status st = block_owner_args(fn, ptr, true, cat, name, &in);
  if (st) return st;
  return ebb__arena_owner(fn, ptr, true, (uint8_t)cat, in, old_cat, old_name);
}

const char *ebb__alloc_owner_current(ebb_owner_cat *cat) {
  if (cat) *cat = (ebb_owner_cat)ebb__owner_stack.top.cat;
  return ebb__owner_stack.top.name;
}

ebb_status ebb_alloc_owner_pop(void) {
  if (ebb__owner_stack.depth == 0)
    return ebb__fail(EBB_ESTATE, "ebb_alloc_owner_pop: this thread has no owner scope open; expected a matching "
                                 "ebb_alloc_owner_push before");
  ebb__owner_stack.depth--;
  ebb__owner_stack.top = ebb__owner_stack.depth ? ebb__owner_stack.stack[ebb__owner_stack.depth - 1] : (struct ebb__owner){"", EBB_OWNER_OTHER};
  return EBB_OK;
}

/* ---- the owner of a live block ------------------------------------------------------------- */

ebb_status ebb__arena_owner(const char *fn, const void *ptr, bool set, uint8_t cat, const char *name,
                            ebb_owner_cat *old_cat, const char **old_name) {
  uint64_t addr = (uint64_t)(uintptr_t)ptr;
  struct ebb__block *b;
  struct ebb__slab *sl = ebb__addr_lookup_lock(addr, 0, &b);
  if (sl) return ebb__slab_owner(fn, sl, addr, set, cat, name, old_cat, old_name);
  if (!b) {
    b = ebb__ptrmap_find(addr);
    if (b) {
      ebb__lock(&b->arena->mu);
      if (b->addr != addr || b->state != EBB__B_ALLOC) { /* freed since the lookup */
        ebb__unlock(&b->arena->mu);
        b = NULL;
      }
    }
  }
  if (!b) { /* why not: a freed block, an interior pointer, or no pool's memory */
    for (int i = 0;; i++) {
      struct ebb__arena *a = ebb__arena_any(i);
      if (!a) break;
      ebb__lock(&a->mu);
      struct ebb__block *c = ebb__find_containing(a, addr);
      bool live = c && c->state == EBB__B_ALLOC;
      uint64_t base = c ? c->addr : 0;
      ebb__unlock(&a->mu);
      if (!c) continue;
      if (live)
        return ebb__fail(EBB_EINVAL, "%s: pointer %p is inside the block at 0x%" PRIx64 " of the %s; expected the start of a "
                         "live block", fn, ptr, base, a->label);
      return ebb__fail(EBB_EINVAL, "%s: pointer %p lies in free memory of the %s (a freed block); expected a live block", fn,
                       ptr, a->label);
    }
    return ebb__fail(EBB_EINVAL, "%s: pointer %p is not a block of any ebb pool; expected a live block", fn, ptr);
  }
  if (old_cat) *old_cat = (ebb_owner_cat)b->owner_cat;
  if (old_name) *old_name = b->owner ? b->owner : "";
  if (set) {
    b->owner_cat = cat;
    b->owner = name;
  }
  ebb__unlock(&b->arena->mu);
  return EBB_OK;
}
