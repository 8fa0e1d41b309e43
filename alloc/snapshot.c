/* snapshot.c: the memory as it stands, for people: the JSON snapshot in the layout of PyTorch's
 * torch.cuda.memory._snapshot() (with _record_memory_history's trace) of every arena's segments,
 * blocks, slots and history, and the top-owners line of the OOM report. Both walk the live
 * blocks and slots through the slabs' piece iterator (slab.c), never a slab's records.
 *
 * Owns nothing past a call: the text is built in growing buffers and written at the end.
 *
 * Threading: the snapshot holds one arena's lock at a time (its segments are walked and its
 * ring copied under it) and formats and writes the file with no lock held; the top-owners line
 * is made under the lock of the arena whose OOM it reports.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
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

/* A growing text buffer; `bad` latches the first allocation failure so callers check once. */
struct ebb__sbuf {
  char *p;
  size_t n, cap;
  bool bad;
};

static void sb_reserve(struct ebb__sbuf *b, size_t more) {
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

static void sb_printf(struct ebb__sbuf *b, const char *fmt, ...) EBB_PRINTF(2, 3);
static void sb_printf(struct ebb__sbuf *b, const char *fmt, ...) {
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
  sb_reserve(b, (size_t)k);
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

static void sb_put(struct ebb__sbuf *b, const char *s, size_t n) {
  sb_reserve(b, n);
  if (b->bad) return;
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}

/* A JSON string: owner names and paths are caller text and may hold quotes or controls. */
static void sb_str(struct ebb__sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)(s ? s : ""); *c; c++) {
    if (*c == '"' || *c == '\\') {
      char e[2] = {'\\', (char)*c};
      sb_put(b, e, 2);
    } else if (*c < 0x20) {
      sb_printf(b, "\\u%04x", *c);
    } else {
      sb_put(b, (const char *)c, 1);
    }
  }
  sb_put(b, "\"", 1);
}

static void sb_owner(struct ebb__sbuf *b, uint8_t cat, const char *name) {
  sb_printf(b, ",\"owner\":{\"category\":\"%s\",\"name\":", ebb_owner_cat_name((ebb_owner_cat)cat));
  sb_str(b, name);
  sb_put(b, "}", 1);
}

static const char *state_name(int state) {
  switch (state) {
  case EBB__B_ALLOC: return "active_allocated";
  case EBB__B_PENDING:
  case EBB__B_FREEING: return "active_pending_free";
  default: return "inactive";
  }
}

/* Appends one block (or slot) of a segment's list. */
static void snap_block(struct ebb__sbuf *segs, bool *bfirst, uint64_t addr, uint64_t size, uint64_t requested,
                            uint64_t stream, int state, uint8_t owner_cat, const char *owner) {
  bool act = state != EBB__B_FREE;
  sb_printf(segs,
                 "%s{\"address\":%" PRIu64 ",\"size\":%" PRIu64 ",\"requested_size\":%" PRIu64 ",\"stream\":%" PRIu64
                 ",\"state\":\"%s\",\"frames\":[]",
                 *bfirst ? "" : ",", addr, size, act ? requested : 0, stream, state_name(state));
  *bfirst = false;
  sb_owner(segs, act ? owner_cat : EBB_OWNER_OTHER, act ? (owner ? owner : "") : "");
  sb_put(segs, "}", 1);
}

/* The stream a segment is shown under: its first mapped block's (a hole is nobody's). */
static uint64_t seg_stream(const struct ebb__segment *g) {
  for (const struct ebb__block *b = g->first; b; b = b->next)
    if (b->spool) return b->spool->stream.id;
  return 0;
}

/* Appends the arena's segments (each preceded by a comma when *first is false) to `segs`. Lock
 * held. */
static void snap_segments(struct ebb__arena *a, struct ebb__sbuf *segs, bool *first) {
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
    sb_printf(segs,
                   "%s{\"device\":%d,\"address\":%" PRIu64 ",\"total_size\":%zu,\"allocated_size\":%" PRIu64
                   ",\"active_size\":%" PRIu64 ",\"requested_size\":%" PRIu64 ",\"stream\":%" PRIu64,
                   *first ? "" : ",", a->device, g->base, g->size - g->unmapped, alloc, active, req, seg_stream(g));
    sb_printf(segs, ",\"segment_type\":\"%s\",\"segment_pool_id\":[0,0],\"is_expandable\":%s,\"frames\":[],\"blocks\":[",
                   g->pool == EBB__POOL_SMALL ? "small" : "large", g->expandable ? "true" : "false");
    *first = false;
    bool bfirst = true;
    /* A slab's slots are the blocks of its span: they tile it, and the viewer sees each
     * allocation at its own address. */
    for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);) {
      /* Holes of an expandable segment hold no memory: left out, as from total_size. */
      if (p.state == EBB__B_UNMAPPED) continue;
      snap_block(segs, &bfirst, p.addr, p.size, p.requested, p.stream, p.state, p.owner_cat, p.owner);
    }
    sb_put(segs, "]}", 2);
  }
}

static void snap_trace(const struct ebb__arena *a, const struct ebb__hist_entry *e, size_t n,
                            struct ebb__sbuf *tr) {
  sb_put(tr, "[", 1);
  for (size_t i = 0; i < n; i++, e++) {
    const char *act = ebb_alloc_action_name((ebb_alloc_action)ebb__he_action(e));
    sb_printf(tr,
                   "%s{\"action\":\"%s\",\"addr\":%" PRIu64 ",\"size\":%" PRIu64 ",\"requested_size\":%" PRIu64
                   ",\"stream\":%" PRIu64 ",\"time_us\":%" PRIu64 ",\"device\":%d,\"frames\":[]",
                   i ? "," : "", act, e->addr, e->size, e->requested, ebb__he_stream(e), e->time_ns / 1000, a->device);
    /* PyTorch's viewer reads an oom's free bytes from "device_free"; "addr" stays for tools. */
    if (ebb__he_action(e) == EBB_ACT_OOM) sb_printf(tr, ",\"device_free\":%" PRIu64, e->addr);
    sb_owner(tr, (uint8_t)ebb__he_cat(e), e->owner ? e->owner : "");
    sb_put(tr, "}", 1);
  }
  sb_put(tr, "]", 1);
}

/* One arena's segments and trace, copied under its lock and formatted after it. The ring is
 * copied, not printed, under the lock: the lock is held for a memcpy-sized moment, not for
 * 65536 printf calls. `*copy` is grown to the ring's capacity (fixed while the arena lives)
 * before locking. */
static ebb_status snap_arena(const char *fn, struct ebb__arena *a, struct ebb__sbuf *segs, bool *first_seg,
                                  struct ebb__sbuf *trace, struct ebb__hist_entry **copy, size_t *copy_cap) {
  size_t cap = a->hist.cap;
  if (cap > *copy_cap) {
    struct ebb__hist_entry *nc = realloc(*copy, cap * sizeof *nc);
    if (!nc) return ebb__fail(EBB_ENOMEM, "%s: no host memory to copy %zu history entries", fn, cap);
    *copy = nc;
    *copy_cap = cap;
  }
  ebb__lock(&a->mu);
  snap_segments(a, segs, first_seg);
  size_t n = cap ? ebb__hist_copy(a, *copy, cap) : 0;
  ebb__unlock(&a->mu);
  snap_trace(a, *copy, n, trace);
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
    if (i) sb_put(&traces, ",", 1);
    if ((st = snap_arena(fn, a, &segs, &first_seg, &traces, &copy, &copy_cap))) goto done;
  }
  /* The pinned and host pools: the same engine, so the same records, kept apart from the
   * device lists PyTorch's viewers read. */
  for (int i = 0;; i++) {
    struct ebb__arena *a = ebb__hostpool_nth(i);
    if (!a) break;
    sb_printf(&pools, "%s{\"pool\":\"%s\",\"label\":", i ? "," : "", a->up->name);
    sb_str(&pools, a->label);
    sb_printf(&pools, ",\"numa_node\":%d,\"segments\":[", a->numa_node);
    bool first = true;
    struct ebb__sbuf trace = {0};
    st = snap_arena(fn, a, &pools, &first, &trace, &copy, &copy_cap);
    sb_put(&pools, "],\"trace\":", 10);
    if (trace.n) sb_put(&pools, trace.p, trace.n);
    sb_put(&pools, "}", 1);
    pools.bad |= trace.bad;
    free(trace.p);
    if (st) goto done;
  }
  sb_put(&out, "{\"segments\":[", 13);
  if (segs.n) sb_put(&out, segs.p, segs.n);
  sb_put(&out, "],\"device_traces\":[", 19);
  if (traces.n) sb_put(&out, traces.p, traces.n);
  sb_put(&out, "],\"host_pools\":[", 16);
  if (pools.n) sb_put(&out, pools.p, pools.n);
  sb_put(&out, "],\"allocator_settings\":{\"EBB_ALLOC_CONF\":", 41);
  sb_str(&out, conf ? conf->env : "");
  if (conf && conf->max_split != SIZE_MAX)
    sb_printf(&out, ",\"max_split_size\":%zu", conf->max_split);
  else
    sb_put(&out, ",\"max_split_size\":-1", 20); /* PyTorch's value for "no limit" */
  sb_printf(&out, ",\"expandable_segments\":%s,\"history\":%zu,\"oom_snapshot\":",
                 conf && conf->expandable ? "true" : "false", conf ? conf->history : 0);
  sb_str(&out, conf && conf->oom_snapshot ? conf->oom_snapshot : "");
  sb_printf(&out, ",\"slab_max_bytes\":%zu", conf ? conf->slab_max : 0);
  sb_put(&out, "}}\n", 3);
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
