/* snapshot.c: the memory as it stands, for people: the JSON snapshot in the layout of PyTorch's
 * torch.cuda.memory._snapshot() (with _record_memory_history's trace) of every arena's segments,
 * blocks, slots and history, and the top-owners line of the OOM report. Both walk the live
 * blocks and slots through the slabs' piece iterator (slab.c), never a slab's records.
 *
 * Owns nothing past a call: the segments' text is built in growing buffers, each arena's
 * history copied, and the file written through a fixed window as the history is formatted.
 *
 * Threading: the snapshot holds one arena's lock at a time (its segments are walked and its
 * ring copied under it) and formats and writes the file with no lock held; the top-owners line
 * is made under the lock of the arena whose OOM it reports.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena_impl.h"

/* ---- top owners (OOM report) --------------------------------------------------------------- */

struct ebb__oagg {
  const char *name;
  uint64_t bytes;
  uint8_t cat;
  bool used;
};

static void oagg_add(struct ebb__oagg *t, size_t tcap, const char *owner, uint8_t cat, uint64_t bytes) {
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
  size_t live = 0; /* live blocks and every slot: what the table may have to hold */
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    const struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    struct ebb__piece p;
    for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);)
      live += p.slot || p.state == EBB__B_ALLOC;
  }
  if (!live) return;
  /* Interned names make (pointer, category) the key: no string compares. */
  size_t tcap = 16;
  while (tcap < live * 2) tcap *= 2;
  struct ebb__oagg *t = calloc(tcap, sizeof *t);
  if (!t) return; /* the report goes out without this line rather than not at all */
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    const struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    struct ebb__piece p;
    for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);)
      if (p.state == EBB__B_ALLOC) oagg_add(t, tcap, p.owner, p.owner_cat, p.size);
  }
  /* Live bytes by owner category, largest first: what filled the device, at a glance. */
  uint64_t by_cat[EBB_OWNER_CAT_COUNT] = {0};
  for (size_t j = 0; j < tcap; j++)
    if (t[j].used && t[j].cat < EBB_OWNER_CAT_COUNT) by_cat[t[j].cat] += t[j].bytes;
  size_t at = (size_t)snprintf(buf, cap, "; live by owner category:");
  for (int k = 0; k < EBB_OWNER_CAT_COUNT && at < cap; k++) {
    int best = -1;
    for (int c = 0; c < EBB_OWNER_CAT_COUNT; c++)
      if (by_cat[c] && (best < 0 || by_cat[c] > by_cat[best])) best = c;
    if (best < 0) break;
    char sz[24];
    at += (size_t)snprintf(buf + at, cap - at, "%s %s %s", k ? "," : "", ebb_owner_cat_name((ebb_owner_cat)best),
                           ebb__fmt_bytes(sz, sizeof sz, by_cat[best]));
    by_cat[best] = 0;
  }
  if (at < cap) at += (size_t)snprintf(buf + at, cap - at, "; top owners:");
  for (int k = 0; k < 5 && at < cap; k++) {
    struct ebb__oagg *best = NULL;
    for (size_t j = 0; j < tcap; j++)
      if (t[j].used && t[j].bytes && (!best || t[j].bytes > best->bytes)) best = &t[j];
    if (!best) break;
    char sz[24];
    /* Names are clipped: the whole report must fit the error message (EBB__ERRMSG_MAX). */
    at += (size_t)snprintf(buf + at, cap - at, "%s %s/%.40s %s", k ? "," : "", ebb_owner_cat_name(best->cat),
                           *best->name ? best->name : "(none)", ebb__fmt_bytes(sz, sizeof sz, best->bytes));
    best->bytes = 0;
  }
  free(t);
}

/* ---- JSON snapshot ------------------------------------------------------------------------- */

/* The snapshot's text is made with memcpy of constant fragments and a hand-made integer
 * formatter, not printf: a history of 10^6 entries is ~2*10^8 bytes, and printf's format
 * parsing was most of its time. Each entry reserves its worst case once and then writes
 * unchecked. */

/* A text buffer. In memory (f NULL) it grows; bound to a file it is a fixed window written out
 * whenever the next reserve would not fit, so a large snapshot never lives whole in memory.
 * `bad` latches the first failure (no host memory, a failed write) so callers check once. */
struct ebb__sbuf {
  char *p;
  size_t n, cap;
  FILE *f;
  int err; /* the failed write's errno */
  bool bad;
};

#define EBB__SNAP_WINDOW ((size_t)1 << 20)

static void sb_flush(struct ebb__sbuf *b) {
  if (!b->f || !b->n || b->bad) return;
  if (fwrite(b->p, 1, b->n, b->f) != b->n) {
    b->err = errno ? errno : EIO;
    b->bad = true;
  }
  b->n = 0;
}

/* Room for `more` bytes at b->p + b->n; false (and `bad`) when there is none. */
static bool sb_reserve(struct ebb__sbuf *b, size_t more) {
  if (b->bad) return false;
  if (b->n + more <= b->cap) return true;
  if (b->f) {
    sb_flush(b);
    if (b->bad) return false;
    if (more <= b->cap) return true;
  }
  size_t nc = b->cap ? b->cap : 4096;
  while (nc < b->n + more) nc *= 2;
  char *np = realloc(b->p, nc);
  if (!np) {
    b->bad = true;
    return false;
  }
  b->p = np;
  b->cap = nc;
  return true;
}

static void sb_put(struct ebb__sbuf *b, const char *s, size_t n) {
  if (!n) return; /* an empty part may have no buffer at all (NULL), which memcpy must not see */
  if (b->f && n > b->cap) { /* a long run (a pool's segments) goes out as it is */
    sb_flush(b);
    if (!b->bad && fwrite(s, 1, n, b->f) != n) {
      b->err = errno ? errno : EIO;
      b->bad = true;
    }
    return;
  }
  if (!sb_reserve(b, n)) return;
  memcpy(b->p + b->n, s, n);
  b->n += n;
}

/* Unchecked writers into reserved room; each returns the end of what it wrote. */
#define EBB__LIT(d, s) (memcpy((d), (s), sizeof(s) - 1), (d) + sizeof(s) - 1)
#define EBB__U64_MAX_DIGITS 20
#define EBB__I64_MAX_CHARS 20

static const char ebb__digit_pairs[201] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                          "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                          "8081828384858687888990919293949596979899";

static char *put_u64(char *d, uint64_t v) {
  char t[EBB__U64_MAX_DIGITS];
  char *e = t + sizeof t, *q = e;
  while (v >= 100) {
    unsigned r = (unsigned)(v % 100);
    v /= 100;
    q -= 2;
    memcpy(q, ebb__digit_pairs + 2 * r, 2);
  }
  if (v >= 10) {
    q -= 2;
    memcpy(q, ebb__digit_pairs + 2 * v, 2);
  } else {
    *--q = (char)('0' + v);
  }
  memcpy(d, q, (size_t)(e - q));
  return d + (e - q);
}

static char *put_i64(char *d, int64_t v) {
  if (v >= 0) return put_u64(d, (uint64_t)v);
  *d++ = '-';
  return put_u64(d, (uint64_t)0 - (uint64_t)v);
}

/* The worst case of a JSON string of n bytes of text: every byte as \u00XX, and the quotes. */
#define EBB__JSON_STR_ROOM(n) (6 * (n) + 2)

/* A JSON string: owner names and labels are caller text and may hold quotes, controls or bytes
 * that are not UTF-8 (ebb__utf8_seq). */
static char *put_str(char *d, const char *s, size_t n) {
  static const char hex[] = "0123456789abcdef";
  const unsigned char *c = (const unsigned char *)s;
  *d++ = '"';
  while (n) {
    size_t k = 1;
    if (*c == '"' || *c == '\\') {
      *d++ = '\\';
      *d++ = (char)*c;
    } else if (*c >= 0x20 && *c < 0x80) {
      *d++ = (char)*c;
    } else if (*c >= 0x80 && (k = ebb__utf8_seq(c, n)) != 0) {
      memcpy(d, c, k);
      d += k;
    } else {
      k = 1;
      d = EBB__LIT(d, "\\u00");
      *d++ = hex[*c >> 4];
      *d++ = hex[*c & 15];
    }
    c += k;
    n -= k;
  }
  *d++ = '"';
  return d;
}

static void sb_str(struct ebb__sbuf *b, const char *s) {
  s = s ? s : "";
  size_t n = strlen(s);
  if (!sb_reserve(b, EBB__JSON_STR_ROOM(n))) return;
  b->n = (size_t)(put_str(b->p + b->n, s, n) - b->p);
}

/* Owner names as JSON strings, each escaped once: names are interned, so the pointer is the
 * key. Open addressing at most half full; text in one growing buffer. Without host memory for
 * it, a name is escaped at each use (names_get returns false). */
struct ebb__name_esc {
  const char *key;
  uint32_t off, len;
};

struct ebb__names {
  struct ebb__name_esc *t;
  size_t cap, n;
  struct ebb__sbuf text;
};

static size_t name_hash(const char *key, size_t cap) {
  return (size_t)(((uintptr_t)key >> 3) * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static bool names_grow(struct ebb__names *nm) {
  size_t nc = nm->cap ? nm->cap * 2 : 256;
  struct ebb__name_esc *t = calloc(nc, sizeof *t);
  if (!t) return false;
  for (size_t i = 0; i < nm->cap; i++) {
    if (!nm->t[i].key) continue;
    size_t j = name_hash(nm->t[i].key, nc);
    while (t[j].key) j = (j + 1) & (nc - 1);
    t[j] = nm->t[i];
  }
  free(nm->t);
  nm->t = t;
  nm->cap = nc;
  return true;
}

/* The escaped text of `key` (non-NULL) into *s, *len. */
static bool names_get(struct ebb__names *nm, const char *key, const char **s, size_t *len) {
  if (nm->cap) {
    for (size_t j = name_hash(key, nm->cap);; j = (j + 1) & (nm->cap - 1)) {
      if (nm->t[j].key == key) {
        *s = nm->text.p + nm->t[j].off;
        *len = nm->t[j].len;
        return true;
      }
      if (!nm->t[j].key) break;
    }
  }
  if ((nm->n + 1) * 2 > nm->cap && !names_grow(nm)) return false;
  size_t off = nm->text.n;
  sb_str(&nm->text, key);
  if (nm->text.bad || nm->text.n - off > UINT32_MAX || off > UINT32_MAX) {
    nm->text.bad = false; /* this name goes unescaped-in-cache; the next may fit */
    nm->text.n = off;
    return false;
  }
  size_t j = name_hash(key, nm->cap);
  while (nm->t[j].key) j = (j + 1) & (nm->cap - 1);
  nm->t[j] = (struct ebb__name_esc){key, (uint32_t)off, (uint32_t)(nm->text.n - off)};
  nm->n++;
  *s = nm->text.p + off;
  *len = nm->text.n - off;
  return true;
}

static void names_free(struct ebb__names *nm) {
  free(nm->t);
  free(nm->text.p);
}

/* The room an owner object takes at most, its name's text aside. */
#define EBB__OWNER_ROOM 64

/* ,"owner":{"category":"<cat>","name":<name>} into reserved room (EBB__OWNER_ROOM plus the
 * name's: esc_len, or EBB__JSON_STR_ROOM of its bytes when esc is NULL). */
static char *put_owner(char *d, uint8_t cat, const char *esc, size_t esc_len, const char *name) {
  d = EBB__LIT(d, ",\"owner\":{\"category\":\"");
  const char *cn = ebb_owner_cat_name((ebb_owner_cat)cat);
  size_t cl = strlen(cn);
  memcpy(d, cn, cl);
  d += cl;
  d = EBB__LIT(d, "\",\"name\":");
  if (esc) {
    memcpy(d, esc, esc_len);
    d += esc_len;
  } else {
    d = put_str(d, name, strlen(name));
  }
  *d++ = '}';
  return d;
}

/* Reserves room for one record ending in an owner and finds the owner's text: *esc NULL when
 * the name is to be escaped in place. */
static bool reserve_owned(struct ebb__sbuf *b, struct ebb__names *nm, size_t fixed, const char *name,
                          const char **esc, size_t *esc_len) {
  size_t room = fixed + EBB__OWNER_ROOM;
  if (names_get(nm, name, esc, esc_len)) {
    room += *esc_len;
  } else {
    *esc = NULL;
    room += EBB__JSON_STR_ROOM(strlen(name));
  }
  return sb_reserve(b, room);
}

static const char *state_name(int state) {
  switch (state) {
  case EBB__B_ALLOC: return "active_allocated";
  case EBB__B_PENDING:
  case EBB__B_FREEING: return "active_pending_free";
  default: return "inactive";
  }
}

/* Room for a record's fixed text: its keys, constant words and up to 8 integers. */
#define EBB__REC_ROOM (256 + 8 * EBB__U64_MAX_DIGITS)

/* Appends one block (or slot) of a segment's list. */
static void snap_block(struct ebb__sbuf *segs, struct ebb__names *nm, bool *bfirst, uint64_t addr, uint64_t size,
                       uint64_t requested, uint64_t stream, int state, uint8_t owner_cat, const char *owner) {
  bool act = state != EBB__B_FREE;
  const char *name = act && owner ? owner : "";
  const char *esc;
  size_t esc_len;
  if (!reserve_owned(segs, nm, EBB__REC_ROOM, name, &esc, &esc_len)) return;
  char *d = segs->p + segs->n;
  if (!*bfirst) *d++ = ',';
  *bfirst = false;
  d = EBB__LIT(d, "{\"address\":");
  d = put_u64(d, addr);
  d = EBB__LIT(d, ",\"size\":");
  d = put_u64(d, size);
  d = EBB__LIT(d, ",\"requested_size\":");
  d = put_u64(d, act ? requested : 0);
  d = EBB__LIT(d, ",\"stream\":");
  d = put_u64(d, stream);
  d = EBB__LIT(d, ",\"state\":\"");
  const char *sn = state_name(state);
  size_t sl = strlen(sn);
  memcpy(d, sn, sl);
  d += sl;
  d = EBB__LIT(d, "\",\"frames\":[]");
  d = put_owner(d, act ? owner_cat : EBB_OWNER_OTHER, esc, esc_len, name);
  *d++ = '}';
  segs->n = (size_t)(d - segs->p);
}

/* The stream a segment is shown under: its first mapped block's (a hole is nobody's). */
static uint64_t seg_stream(const struct ebb__segment *g) {
  for (const struct ebb__block *b = g->first; b; b = b->next)
    if (b->spool) return b->spool->stream.id;
  return 0;
}

/* Appends the arena's segments (each preceded by a comma when *first is false) to `segs`. Lock
 * held. */
static void snap_segments(struct ebb__arena *a, struct ebb__sbuf *segs, struct ebb__names *nm, bool *first) {
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    const struct ebb__segment *g = ebb_container_of(n, struct ebb__segment, node);
    uint64_t alloc = 0, active = 0, req = 0;
    struct ebb__piece p;
    for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);) {
      if (p.state == EBB__B_ALLOC) {
        alloc += p.size;
        req += p.requested;
      }
      if (p.state == EBB__B_ALLOC || p.state == EBB__B_PENDING || p.state == EBB__B_FREEING) active += p.size;
    }
    if (!sb_reserve(segs, EBB__REC_ROOM)) return;
    char *d = segs->p + segs->n;
    if (!*first) *d++ = ',';
    *first = false;
    d = EBB__LIT(d, "{\"device\":");
    d = put_i64(d, a->device);
    d = EBB__LIT(d, ",\"address\":");
    d = put_u64(d, g->base);
    d = EBB__LIT(d, ",\"total_size\":");
    d = put_u64(d, g->size - g->unmapped);
    d = EBB__LIT(d, ",\"allocated_size\":");
    d = put_u64(d, alloc);
    d = EBB__LIT(d, ",\"active_size\":");
    d = put_u64(d, active);
    d = EBB__LIT(d, ",\"requested_size\":");
    d = put_u64(d, req);
    d = EBB__LIT(d, ",\"stream\":");
    d = put_u64(d, seg_stream(g));
    if (g->pool == EBB__POOL_SMALL) d = EBB__LIT(d, ",\"segment_type\":\"small\"");
    else d = EBB__LIT(d, ",\"segment_type\":\"large\"");
    d = EBB__LIT(d, ",\"segment_pool_id\":[0,0],\"is_expandable\":");
    if (g->expandable) d = EBB__LIT(d, "true");
    else d = EBB__LIT(d, "false");
    d = EBB__LIT(d, ",\"frames\":[],\"blocks\":[");
    segs->n = (size_t)(d - segs->p);
    bool bfirst = true;
    /* A slab's slots are the blocks of its span: they tile it, and the viewer sees each
     * allocation at its own address. */
    for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);) {
      /* Holes of an expandable segment hold no memory: left out, as from total_size. */
      if (p.state == EBB__B_UNMAPPED) continue;
      snap_block(segs, nm, &bfirst, p.addr, p.size, p.requested, p.stream, p.state, p.owner_cat, p.owner);
    }
    sb_put(segs, "]}", 2);
  }
}

/* One arena's history as a JSON list, from its copied ring: the bulk of a large snapshot, so
 * each entry's constant text is made once per action (its opening) and per arena (the device
 * key) and names come from the cache. */
static void snap_trace(const struct ebb__arena *a, const struct ebb__hist_entry *e, size_t n, struct ebb__sbuf *tr,
                       struct ebb__names *nm) {
  char open[EBB_ACT_OOM + 1][48];
  size_t open_len[EBB_ACT_OOM + 1];
  for (unsigned k = 0; k <= EBB_ACT_OOM; k++) {
    char *d = EBB__LIT(open[k], "{\"action\":\"");
    const char *an = ebb_alloc_action_name((ebb_alloc_action)k);
    size_t al = strlen(an);
    memcpy(d, an, al);
    d = EBB__LIT(d + al, "\",\"addr\":");
    open_len[k] = (size_t)(d - open[k]);
  }
  char dev[48];
  char *dd = EBB__LIT(dev, ",\"device\":");
  dd = put_i64(dd, a->device);
  dd = EBB__LIT(dd, ",\"frames\":[]");
  size_t dev_len = (size_t)(dd - dev);
  sb_put(tr, "[", 1);
  for (size_t i = 0; i < n; i++, e++) {
    unsigned act = ebb__he_action(e);
    const char *name = e->owner ? e->owner : "";
    const char *esc;
    size_t esc_len;
    if (!reserve_owned(tr, nm, EBB__REC_ROOM, name, &esc, &esc_len)) return;
    char *d = tr->p + tr->n;
    if (i) *d++ = ',';
    if (act <= EBB_ACT_OOM) {
      memcpy(d, open[act], sizeof open[act]); /* fixed size: one wide copy; the length is kept */
      d += open_len[act];
    } else { /* not in a copied ring (pairs are expanded); kept as the name function says */
      d = EBB__LIT(d, "{\"action\":\"unknown\",\"addr\":");
    }
    d = put_u64(d, e->addr);
    d = EBB__LIT(d, ",\"size\":");
    d = put_u64(d, e->size);
    d = EBB__LIT(d, ",\"requested_size\":");
    d = put_u64(d, e->requested);
    d = EBB__LIT(d, ",\"stream\":");
    d = put_u64(d, ebb__he_stream(e));
    d = EBB__LIT(d, ",\"time_us\":");
    d = put_u64(d, e->time_ns / 1000);
    memcpy(d, dev, dev_len);
    d += dev_len;
    /* PyTorch's viewer reads an oom's free bytes from "device_free"; "addr" stays for tools. */
    if (act == EBB_ACT_OOM) {
      d = EBB__LIT(d, ",\"device_free\":");
      d = put_u64(d, e->addr);
    }
    d = put_owner(d, (uint8_t)ebb__he_cat(e), esc, esc_len, name);
    *d++ = '}';
    tr->n = (size_t)(d - tr->p);
  }
  sb_put(tr, "]", 1);
}

/* One arena as taken under its lock: its segments' text and a copy of its history. */
struct ebb__snap_arena {
  struct ebb__arena *a;
  struct ebb__hist_entry *copy;
  size_t n;
  struct ebb__sbuf head; /* a host pool's opening and segments, up to its "trace" key */
};

/* Takes one arena: segments into `segs`, the ring into s->copy (its capacity, fixed while the
 * arena lives, allocated before locking). The lock is held for the segment walk and a
 * memcpy-sized moment, never while the history is formatted. */
static ebb_status snap_take(const char *fn, struct ebb__arena *a, struct ebb__sbuf *segs, struct ebb__names *nm,
                            bool *first_seg, struct ebb__snap_arena *s) {
  s->a = a;
  size_t cap = a->hist.cap;
  if (cap) {
    /* malloc, not calloc: only the pages of the entries held are touched. */
    s->copy = malloc(cap * sizeof *s->copy);
    if (!s->copy) return ebb__fail(EBB_ENOMEM, "%s: no host memory to copy %zu history entries", fn, cap);
  }
  ebb__lock(&a->mu);
  snap_segments(a, segs, nm, first_seg);
  s->n = cap ? ebb__hist_copy(a, s->copy, cap) : 0;
  ebb__unlock(&a->mu);
  return EBB_OK;
}

static int arena_count(struct ebb__arena *(*nth)(int)) {
  int n = 0;
  while (nth(n)) n++;
  return n;
}

/* The file's text: segments first, then the device traces, the host pools and the settings.
 * Every arena is taken (segments and a ring copy, under its lock) before the file is opened,
 * so running out of host memory leaves no file behind; the history is then formatted through a
 * window written to the file as it fills. */
ebb_status ebb__snapshot_write(const char *fn, const char *path) {
  struct ebb__sbuf segs = {0};
  struct ebb__names nm = {0};
  struct ebb__sbuf out = {0};
  ebb_status st = EBB_OK;
  bool first_seg = true;
  const struct ebb__conf *conf = NULL;
  int ndev = arena_count(ebb__arena_nth), npool = arena_count(ebb__hostpool_nth);
  struct ebb__snap_arena *sa = calloc((size_t)(ndev + npool) + 1, sizeof *sa);
  if (!sa) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the snapshot", fn);
  /* Arenas live from ebb_init to ebb_shutdown, which must not race with this call: the counts
   * hold, but a NULL from nth ends the walk anyway. */
  int nd = 0, np = 0;
  for (; nd < ndev; nd++) {
    struct ebb__arena *a = ebb__arena_nth(nd);
    if (!a) break;
    conf = &a->conf;
    if ((st = snap_take(fn, a, &segs, &nm, &first_seg, &sa[nd]))) goto done;
  }
  for (; np < npool; np++) {
    struct ebb__arena *a = ebb__hostpool_nth(np);
    if (!a) break;
    struct ebb__snap_arena *s = &sa[ndev + np];
    struct ebb__sbuf *h = &s->head;
    sb_put(h, np ? ",{\"pool\":\"" : "{\"pool\":\"", np ? 10 : 9);
    sb_put(h, a->up->name, strlen(a->up->name));
    sb_put(h, "\",\"label\":", 10);
    sb_str(h, a->label);
    if (sb_reserve(h, 64)) {
      char *d = EBB__LIT(h->p + h->n, ",\"numa_node\":");
      d = put_i64(d, a->numa_node);
      d = EBB__LIT(d, ",\"segments\":[");
      h->n = (size_t)(d - h->p);
    }
    bool first = true;
    if ((st = snap_take(fn, a, h, &nm, &first, s))) goto done;
    sb_put(h, "],\"trace\":", 10);
  }
  bool bad = segs.bad || nm.text.bad;
  for (int i = 0; i < ndev + npool; i++) bad |= sa[i].head.bad;
  out.p = malloc(EBB__SNAP_WINDOW);
  if (bad || !out.p) {
    st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the snapshot text", fn);
    goto done;
  }
  out.cap = EBB__SNAP_WINDOW;
  out.f = fopen(path, "w");
  if (!out.f) {
    st = ebb__fail(EBB_EIO, "%s: cannot open '%s' for writing: %s", fn, path, strerror(errno));
    goto done;
  }
  /* The stream's own buffer would only copy the window again: every write is a large one. */
  setvbuf(out.f, NULL, _IONBF, 0);
  sb_put(&out, "{\"segments\":[", 13);
  sb_put(&out, segs.p, segs.n);
  sb_put(&out, "],\"device_traces\":[", 19);
  for (int i = 0; i < nd; i++) {
    if (i) sb_put(&out, ",", 1);
    snap_trace(sa[i].a, sa[i].copy, sa[i].n, &out, &nm);
  }
  sb_put(&out, "],\"host_pools\":[", 16);
  for (int i = 0; i < np; i++) {
    struct ebb__snap_arena *s = &sa[ndev + i];
    sb_put(&out, s->head.p, s->head.n);
    snap_trace(s->a, s->copy, s->n, &out, &nm);
    sb_put(&out, "}", 1);
  }
  sb_put(&out, "],\"allocator_settings\":{\"EBB_ALLOC_CONF\":", 41);
  sb_str(&out, conf ? conf->env : "");
  if (sb_reserve(&out, 256)) {
    char *d = out.p + out.n;
    if (conf && conf->max_split != SIZE_MAX) {
      d = EBB__LIT(d, ",\"max_split_size\":");
      d = put_u64(d, conf->max_split);
    } else {
      d = EBB__LIT(d, ",\"max_split_size\":-1"); /* PyTorch's value for "no limit" */
    }
    d = EBB__LIT(d, ",\"expandable_segments\":");
    if (conf && conf->expandable) d = EBB__LIT(d, "true");
    else d = EBB__LIT(d, "false");
    d = EBB__LIT(d, ",\"history\":");
    d = put_u64(d, conf ? conf->history : 0);
    d = EBB__LIT(d, ",\"oom_snapshot\":");
    out.n = (size_t)(d - out.p);
  }
  sb_str(&out, conf && conf->oom_snapshot ? conf->oom_snapshot : "");
  if (sb_reserve(&out, 64)) {
    char *d = EBB__LIT(out.p + out.n, ",\"slab_max_bytes\":");
    d = put_u64(d, conf ? conf->slab_max : 0);
    d = EBB__LIT(d, "}}\n");
    out.n = (size_t)(d - out.p);
  }
  sb_flush(&out);
  int e = out.bad ? out.err : 0;
  if (fclose(out.f) != 0 && !e) e = errno ? errno : EIO;
  out.f = NULL;
  if (e || out.bad) {
    st = ebb__fail(EBB_EIO, "%s: writing '%s' failed: %s", fn, path, strerror(e ? e : EIO));
    remove(path); /* a cut file would only mislead a viewer */
  }
done:
  for (int i = 0; i < ndev + npool; i++) {
    free(sa[i].copy);
    free(sa[i].head.p);
  }
  free(sa);
  free(segs.p);
  free(out.p);
  names_free(&nm);
  return st;
}
