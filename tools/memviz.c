/* memviz: an ebb memory snapshot as an HTML page and an SVG (memviz.h says what they show).
 *
 * Reading: a pull parser walks the snapshot once, schema-directed (segments, device_traces,
 * host_pools; anything else is skipped), straight into per-pool tables, so a snapshot of a million
 * history entries never becomes a tree of a million objects. Pairing: each alloc is matched with
 * the free_completed of its address; a block's category is its owner at the free (or in the
 * snapshot's segments while it lives), since owners are re-tagged after allocation.
 * Writing: the page template (memviz_page.html, embedded at build time) with, where it says
 * so, a small JSON of metadata and per-pool base64 blobs of little-endian typed arrays.
 */
#define _GNU_SOURCE
#include "memviz.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const unsigned char ebb__memviz_page[];
extern const unsigned long ebb__memviz_page_size;

#define NCAT 8
#define MAX_DEVICE 1024 /* device numbers a snapshot may name: each becomes a chart */
static const char *const cat_names[NCAT] = {"other",     "parameter", "gradient", "saved",
                                            "activation", "optimizer", "staging",  "backward"};
static int cat_index(const char *s) {
  for (int i = 0; i < NCAT; i++)
    if (!strcmp(s, cat_names[i])) return i;
  return 0;
}

/* ---- growable arrays ---------------------------------------------------------------------------- */

typedef struct vec {
  void *p;
  size_t n, cap, elem;
} vec;

static bool vec_push(vec *v, const void *x) {
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 1024;
    void *p = realloc(v->p, cap * v->elem);
    if (!p) return false;
    v->p = p;
    v->cap = cap;
  }
  memcpy((char *)v->p + v->n * v->elem, x, v->elem);
  v->n++;
  return true;
}
#define VEC_AT(v, T, i) (((T *)(v).p)[i])

/* ---- the model ------------------------------------------------------------------------------------ */

typedef struct block {
  uint64_t addr, size, stream;
  double t_alloc, t_free; /* µs; t_alloc < 0: before the history; t_free < 0: still live */
  uint32_t owner;         /* index into the owner-name table */
  uint8_t cat;
  bool before; /* allocated before the history's first entry */
} block;

typedef struct event {
  double t;
  uint32_t block;
  int8_t sign;
} event;

typedef struct rsv {
  double t, bytes;
} rsv;

typedef struct seg_block {
  uint64_t addr, size;
  uint8_t cat;
  uint8_t state; /* 0 inactive, 1 allocated, 2 pending free */
  uint32_t owner;
} seg_block;

typedef struct segment {
  uint64_t addr, size;
  size_t first_block, nblocks; /* into pool.seg_blocks */
} segment;

typedef struct pool {
  char title[96];
  bool host;
  vec blocks, events, reserved, segments, seg_blocks, ooms; /* ooms: double times */
  /* pairing: open-addressed map from address to the open block's index + 1 */
  uint64_t *map_key;
  uint32_t *map_val;
  size_t map_cap, map_n;
  double seg_total; /* reserved bytes at the snapshot */
} pool;

typedef struct model {
  vec pools;  /* pool */
  vec owners; /* char *, interned */
  /* owner lookup: open-addressed hash of name -> index + 1 */
  uint32_t *own_idx;
  size_t own_cap;
  double t_min, t_max;
} model;

static void pool_init(pool *p) {
  memset(p, 0, sizeof *p);
  p->blocks.elem = sizeof(block);
  p->events.elem = sizeof(event);
  p->reserved.elem = sizeof(rsv);
  p->segments.elem = sizeof(segment);
  p->seg_blocks.elem = sizeof(seg_block);
  p->ooms.elem = sizeof(double);
}

static void pool_free(pool *p) {
  free(p->blocks.p);
  free(p->events.p);
  free(p->reserved.p);
  free(p->segments.p);
  free(p->seg_blocks.p);
  free(p->ooms.p);
  free(p->map_key);
  free(p->map_val);
}

static uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

/* The slot of `addr` in the pool's map (empty key 0 is never a block address). */
static size_t map_slot(const pool *p, uint64_t addr) {
  size_t m = p->map_cap - 1, i = (size_t)mix64(addr) & m;
  while (p->map_key[i] && p->map_key[i] != addr) i = (i + 1) & m;
  return i;
}

static bool map_grow(pool *p) {
  size_t cap = p->map_cap ? p->map_cap * 2 : 4096;
  uint64_t *k = calloc(cap, sizeof *k);
  uint32_t *v = calloc(cap, sizeof *v);
  if (!k || !v) {
    free(k);
    free(v);
    return false;
  }
  pool old = *p;
  p->map_key = k;
  p->map_val = v;
  p->map_cap = cap;
  p->map_n = 0;
  for (size_t i = 0; i < old.map_cap; i++)
    if (old.map_key[i] && old.map_val[i]) {
      size_t s = map_slot(p, old.map_key[i]);
      p->map_key[s] = old.map_key[i];
      p->map_val[s] = old.map_val[i];
      p->map_n++;
    }
  free(old.map_key);
  free(old.map_val);
  return true;
}

/* Deletion leaves the key with value 0 (a tombstone the probe walks past); keys are reused when
 * the same address comes back, as it does in an arena. */
static bool map_put(pool *p, uint64_t addr, uint32_t val) {
  if ((p->map_n + 1) * 2 > p->map_cap && !map_grow(p)) return false;
  size_t s = map_slot(p, addr);
  if (!p->map_key[s]) p->map_n++;
  p->map_key[s] = addr;
  p->map_val[s] = val;
  return true;
}

static uint32_t map_get(const pool *p, uint64_t addr) {
  if (!p->map_cap) return 0;
  return p->map_val[map_slot(p, addr)];
}

static bool intern_owner(model *m, const char *s, size_t len, uint32_t *out) {
  if ((m->owners.n + 1) * 2 > m->own_cap) {
    size_t cap = m->own_cap ? m->own_cap * 2 : 1024;
    uint32_t *t = calloc(cap, sizeof *t);
    if (!t) return false;
    for (size_t i = 0; i < m->owners.n; i++) {
      const char *o = VEC_AT(m->owners, char *, i);
      uint64_t h = 1469598103934665603ull;
      for (const char *c = o; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
      size_t j = (size_t)h & (cap - 1);
      while (t[j]) j = (j + 1) & (cap - 1);
      t[j] = (uint32_t)i + 1;
    }
    free(m->own_idx);
    m->own_idx = t;
    m->own_cap = cap;
  }
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < len; k++) h = (h ^ (unsigned char)s[k]) * 1099511628211ull;
  size_t j = (size_t)h & (m->own_cap - 1);
  while (m->own_idx[j]) {
    const char *o = VEC_AT(m->owners, char *, m->own_idx[j] - 1);
    if (strlen(o) == len && !memcmp(o, s, len)) {
      *out = m->own_idx[j] - 1;
      return true;
    }
    j = (j + 1) & (m->own_cap - 1);
  }
  char *c = strndup(s, len);
  if (!c || !vec_push(&m->owners, &c)) {
    free(c);
    return false;
  }
  m->own_idx[j] = (uint32_t)m->owners.n;
  *out = (uint32_t)m->owners.n - 1;
  return true;
}

/* ---- the pull parser ----------------------------------------------------------------------------- */

typedef struct jp {
  const char *start, *p, *end;
  const char *path;
  bool failed;
  char *str; /* the last string read, decoded, NUL-terminated */
  size_t str_len, str_cap;
  int depth;
} jp;

static bool input_fault; /* the last failure was the snapshot's (single-threaded tools) */
bool ebb_memviz_last_error_is_input(void) { return input_fault; }

static bool jp_fail(jp *j, const char *what) {
  if (!j->failed) {
    input_fault = strcmp(what, "out of host memory") != 0;
    size_t at = (size_t)(j->p - j->start);
    if (j->p >= j->end)
      fprintf(stderr, "ebb-memviz: '%s' is not a complete snapshot: it ends at byte %zu where %s\n", j->path, at, what);
    else
      fprintf(stderr, "ebb-memviz: '%s' is not a snapshot of ebb_memory_snapshot_json: at byte %zu, %s\n", j->path,
              at, what);
  }
  j->failed = true;
  return false;
}

static void jp_ws(jp *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t')) j->p++;
}

static bool jp_peek(jp *j, char c) {
  jp_ws(j);
  return j->p < j->end && *j->p == c;
}

static bool jp_expect(jp *j, char c, const char *what) {
  if (!jp_peek(j, c)) return jp_fail(j, what);
  j->p++;
  return true;
}

static bool str_put(jp *j, char c) {
  if (j->str_len + 1 >= j->str_cap) {
    size_t cap = j->str_cap ? j->str_cap * 2 : 256;
    char *s = realloc(j->str, cap);
    if (!s) return jp_fail(j, "out of host memory");
    j->str = s;
    j->str_cap = cap;
  }
  j->str[j->str_len++] = c;
  j->str[j->str_len] = 0;
  return true;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static bool jp_string(jp *j) {
  if (!jp_expect(j, '"', "a string was expected")) return false;
  j->str_len = 0;
  if (!str_put(j, 0)) return false;
  j->str_len = 0;
  while (j->p < j->end && *j->p != '"') {
    char c = *j->p++;
    if ((unsigned char)c < 0x20) return jp_fail(j, "a control character is inside a string");
    if (c == '\\') {
      if (j->p >= j->end) break;
      char e = *j->p++;
      switch (e) {
      case 'n': c = '\n'; break;
      case 't': c = '\t'; break;
      case 'r': c = '\r'; break;
      case 'b': c = '\b'; break;
      case 'f': c = '\f'; break;
      case '"': case '\\': case '/': c = e; break;
      case 'u': {
        if (j->end - j->p < 4) return jp_fail(j, "a \\u escape is cut short");
        int v = 0;
        for (int k = 0; k < 4; k++) {
          int h = hexval(j->p[k]);
          if (h < 0) return jp_fail(j, "a \\u escape has a non-hex digit");
          v = v * 16 + h;
        }
        j->p += 4;
        /* Owner names are ASCII in practice; anything else is kept as UTF-8 of the BMP point. */
        if (v < 0x80) c = (char)v;
        else if (v < 0x800) {
          if (!str_put(j, (char)(0xC0 | (v >> 6)))) return false;
          c = (char)(0x80 | (v & 0x3F));
        } else {
          if (!str_put(j, (char)(0xE0 | (v >> 12))) || !str_put(j, (char)(0x80 | ((v >> 6) & 0x3F)))) return false;
          c = (char)(0x80 | (v & 0x3F));
        }
        break;
      }
      default: return jp_fail(j, "a string has an unknown escape");
      }
    }
    if (!str_put(j, c)) return false;
  }
  if (j->p >= j->end) return jp_fail(j, "a string was not closed");
  j->p++;
  return true;
}

static bool jp_number(jp *j, double *out) {
  jp_ws(j);
  char buf[64];
  size_t n = 0;
  while (j->p + n < j->end && n < sizeof buf - 1 && strchr("+-0123456789.eE", j->p[n])) {
    buf[n] = j->p[n];
    n++;
  }
  buf[n] = 0;
  char *e;
  errno = 0;
  double v = strtod(buf, &e);
  if (!n || e != buf + n || errno) return jp_fail(j, "a number was expected");
  j->p += n;
  *out = v;
  return true;
}

/* An unsigned integer (addresses need all 64 bits). */
static bool jp_u64(jp *j, uint64_t *out) {
  jp_ws(j);
  const char *s = j->p;
  uint64_t v = 0;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    unsigned d = (unsigned)(*j->p - '0');
    if (v > (UINT64_MAX - d) / 10) return jp_fail(j, "an integer is larger than 2^64-1");
    v = v * 10 + d;
    j->p++;
  }
  if (j->p == s) return jp_fail(j, "an unsigned integer was expected");
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E')) return jp_fail(j, "an integer was expected");
  *out = v;
  return true;
}

static bool jp_skip(jp *j) {
  jp_ws(j);
  if (j->p >= j->end) return jp_fail(j, "a value was expected");
  char c = *j->p;
  if (c == '"') return jp_string(j);
  if (c == '{' || c == '[') {
    if (++j->depth > 64) return jp_fail(j, "values nest deeper than 64");
    char close = c == '{' ? '}' : ']';
    j->p++;
    if (jp_peek(j, close)) {
      j->p++;
      j->depth--;
      return true;
    }
    for (;;) {
      if (c == '{' && (!jp_string(j) || !jp_expect(j, ':', "':' was expected after a key"))) return false;
      if (!jp_skip(j)) return false;
      if (jp_peek(j, ',')) {
        j->p++;
        continue;
      }
      if (!jp_expect(j, close, c == '{' ? "',' or '}' was expected" : "',' or ']' was expected")) return false;
      j->depth--;
      return true;
    }
  }
  static const char *const lits[] = {"true", "false", "null"};
  for (int k = 0; k < 3; k++) {
    size_t n = strlen(lits[k]);
    if ((size_t)(j->end - j->p) >= n && !memcmp(j->p, lits[k], n)) {
      j->p += n;
      return true;
    }
  }
  double d;
  return jp_number(j, &d);
}

/* Object iteration: jp_obj_begin, then jp_obj_key until it returns 0 (the '}' was read) or -1. */
static bool jp_obj_begin(jp *j, const char *what) { return jp_expect(j, '{', what); }
static int jp_obj_key(jp *j, bool *first) {
  if (jp_peek(j, '}')) {
    j->p++;
    return 0;
  }
  if (!*first && !jp_expect(j, ',', "',' or '}' was expected")) return -1;
  *first = false;
  if (!jp_string(j) || !jp_expect(j, ':', "':' was expected after a key")) return -1;
  return 1;
}
static bool jp_arr_begin(jp *j, const char *what) { return jp_expect(j, '[', what); }
static int jp_arr_next(jp *j, bool *first) {
  if (jp_peek(j, ']')) {
    j->p++;
    return 0;
  }
  if (!*first && !jp_expect(j, ',', "',' or ']' was expected")) return -1;
  *first = false;
  return 1;
}

/* {"category": "...", "name": "..."} */
static bool read_owner(jp *j, model *m, uint8_t *cat, uint32_t *owner) {
  if (!jp_obj_begin(j, "an owner object was expected")) return false;
  bool first = true;
  int k;
  while ((k = jp_obj_key(j, &first)) > 0) {
    if (!strcmp(j->str, "category")) {
      if (!jp_string(j)) return false;
      *cat = (uint8_t)cat_index(j->str);
    } else if (!strcmp(j->str, "name")) {
      if (!jp_string(j) || !intern_owner(m, j->str, j->str_len, owner)) return jp_fail(j, "an owner name was expected");
    } else if (!jp_skip(j))
      return false;
  }
  return k == 0;
}

/* The pool titled `title`, made on first use. */
static pool *pool_for(model *m, const char *title, bool host) {
  for (size_t i = 0; i < m->pools.n; i++) {
    pool *p = &VEC_AT(m->pools, pool, i);
    if (!strcmp(p->title, title)) return p;
  }
  pool p;
  pool_init(&p);
  snprintf(p.title, sizeof p.title, "%s", title);
  p.host = host;
  if (!vec_push(&m->pools, &p)) return NULL;
  return &VEC_AT(m->pools, pool, m->pools.n - 1);
}

/* A segment's "blocks" list, appended to `blocks`. */
static bool read_seg_blocks(jp *j, model *m, vec *blocks) {
  if (!jp_arr_begin(j, "a segment's blocks list was expected")) return false;
  bool first = true;
  int more;
  while ((more = jp_arr_next(j, &first)) > 0) {
    seg_block b = {0};
    if (!jp_obj_begin(j, "a block object was expected")) return false;
    bool f2 = true;
    int k;
    while ((k = jp_obj_key(j, &f2)) > 0) {
      if (!strcmp(j->str, "address")) {
        if (!jp_u64(j, &b.addr)) return false;
      } else if (!strcmp(j->str, "size")) {
        if (!jp_u64(j, &b.size)) return false;
      } else if (!strcmp(j->str, "state")) {
        if (!jp_string(j)) return false;
        b.state = !strcmp(j->str, "active_allocated") ? 1 : !strcmp(j->str, "active_pending_free") ? 2 : 0;
      } else if (!strcmp(j->str, "owner")) {
        if (!read_owner(j, m, &b.cat, &b.owner)) return false;
      } else if (!jp_skip(j))
        return false;
    }
    if (k < 0) return false;
    if (!vec_push(blocks, &b)) return jp_fail(j, "out of host memory");
  }
  return more == 0;
}

/* One segment object, filed under its device's pool (or the host pool `host_title`). */
static bool read_segment(jp *j, model *m, const char *host_title, vec *blocks) {
  segment sg = {0};
  int device = -1;
  blocks->n = 0;
  if (!jp_obj_begin(j, "a segment object was expected")) return false;
  bool first = true;
  int k;
  while ((k = jp_obj_key(j, &first)) > 0) {
    if (!strcmp(j->str, "device")) {
      double d;
      if (!jp_number(j, &d)) return false;
      /* -1: a host pool's segment */
      if (!(d >= -1 && d < MAX_DEVICE && d == (int)d)) return jp_fail(j, "a segment's \"device\" is not a device number (0..1023)");
      device = (int)d;
    } else if (!strcmp(j->str, "address")) {
      if (!jp_u64(j, &sg.addr)) return false;
    } else if (!strcmp(j->str, "total_size")) {
      if (!jp_u64(j, &sg.size)) return false;
    } else if (!strcmp(j->str, "blocks")) {
      if (!read_seg_blocks(j, m, blocks)) return false;
    } else if (!jp_skip(j))
      return false;
  }
  if (k < 0) return false;
  if (!host_title && device < 0) return jp_fail(j, "a segment has no \"device\"");
  char title[96];
  if (host_title) snprintf(title, sizeof title, "%s", host_title);
  else snprintf(title, sizeof title, "device %d", device);
  pool *p = pool_for(m, title, host_title != NULL);
  if (!p) return jp_fail(j, "out of host memory");
  sg.first_block = p->seg_blocks.n;
  sg.nblocks = blocks->n;
  p->seg_total += (double)sg.size;
  for (size_t i = 0; i < blocks->n; i++)
    if (!vec_push(&p->seg_blocks, &VEC_AT(*blocks, seg_block, i))) return jp_fail(j, "out of host memory");
  return vec_push(&p->segments, &sg) || jp_fail(j, "out of host memory");
}

static bool read_segments(jp *j, model *m, const char *host_title) {
  if (!jp_arr_begin(j, "the segments list was expected")) return false;
  bool first = true, ok = true;
  int more = 0;
  vec blocks = {.elem = sizeof(seg_block)};
  while (ok && (more = jp_arr_next(j, &first)) > 0) ok = read_segment(j, m, host_title, &blocks);
  free(blocks.p);
  return ok && more == 0;
}

enum { A_ALLOC, A_FREE_REQ, A_FREE_DONE, A_SEG_ALLOC, A_SEG_FREE, A_SEG_MAP, A_SEG_UNMAP, A_OOM, A_OTHER };
static int action_index(const char *s) {
  static const char *const n[] = {"alloc",       "free_requested", "free_completed", "segment_alloc",
                                  "segment_free", "segment_map",   "segment_unmap",  "oom"};
  for (int i = 0; i < 8; i++)
    if (!strcmp(s, n[i])) return i;
  return A_OTHER;
}

static bool add_event(pool *p, double t, uint32_t block, int8_t sign) {
  event e = {t, block, sign};
  return vec_push(&p->events, &e);
}

/* One pool's history: a list of action objects, oldest first. */
static bool read_trace(jp *j, model *m, pool *p) {
  if (!jp_arr_begin(j, "a list of history entries was expected")) return false;
  bool first = true;
  int more;
  double reserved = 0;
  while ((more = jp_arr_next(j, &first)) > 0) {
    int action = -1;
    uint64_t addr = 0, size = 0, stream = 0, time_us = 0;
    uint8_t cat = 0;
    uint32_t owner = 0;
    bool have_time = false, have_owner = false;
    if (!jp_obj_begin(j, "a history entry object was expected")) return false;
    bool f2 = true;
    int k;
    while ((k = jp_obj_key(j, &f2)) > 0) {
      const char *key = j->str;
      if (!strcmp(key, "action")) {
        if (!jp_string(j)) return false;
        action = action_index(j->str);
      } else if (!strcmp(key, "addr")) {
        if (!jp_u64(j, &addr)) return false;
      } else if (!strcmp(key, "size")) {
        if (!jp_u64(j, &size)) return false;
      } else if (!strcmp(key, "stream")) {
        if (!jp_u64(j, &stream)) return false;
      } else if (!strcmp(key, "time_us")) {
        if (!jp_u64(j, &time_us)) return false;
        have_time = true;
      } else if (!strcmp(key, "owner")) {
        if (!read_owner(j, m, &cat, &owner)) return false;
        have_owner = true;
      } else if (!jp_skip(j))
        return false;
    }
    if (k < 0) return false;
    if (action < 0 || !have_time) return jp_fail(j, "a history entry lacks \"action\" or \"time_us\"");
    double t = (double)time_us;
    if (t < m->t_min) m->t_min = t;
    if (t > m->t_max) m->t_max = t;
    if (!have_owner && !intern_owner(m, "", 0, &owner)) return jp_fail(j, "out of host memory");
    switch (action) {
    case A_ALLOC: {
      block b = {.addr = addr, .size = size, .stream = stream, .t_alloc = t, .t_free = -1, .owner = owner, .cat = cat};
      if (!vec_push(&p->blocks, &b) || !map_put(p, addr, (uint32_t)p->blocks.n) ||
          !add_event(p, t, (uint32_t)p->blocks.n - 1, 1))
        return jp_fail(j, "out of host memory");
      break;
    }
    case A_FREE_DONE: {
      uint32_t id = map_get(p, addr);
      if (id) {
        block *b = &VEC_AT(p->blocks, block, id - 1);
        b->t_free = t;
        b->owner = owner;
        b->cat = cat;
        map_put(p, addr, 0);
        if (!add_event(p, t, id - 1, -1)) return jp_fail(j, "out of host memory");
      } else {
        /* Allocated before the history's first entry: live from its start. */
        block b = {.addr = addr, .size = size, .stream = stream, .t_alloc = -1, .t_free = t, .owner = owner,
                   .cat = cat, .before = true};
        if (!vec_push(&p->blocks, &b) || !add_event(p, t, (uint32_t)p->blocks.n - 1, -1))
          return jp_fail(j, "out of host memory");
      }
      break;
    }
    case A_SEG_ALLOC:
    case A_SEG_MAP:
    case A_SEG_FREE:
    case A_SEG_UNMAP: {
      reserved += (action == A_SEG_ALLOC || action == A_SEG_MAP) ? (double)size : -(double)size;
      rsv r = {t, reserved};
      if (!vec_push(&p->reserved, &r)) return jp_fail(j, "out of host memory");
      break;
    }
    case A_OOM:
      if (!vec_push(&p->ooms, &t)) return jp_fail(j, "out of host memory");
      break;
    default: break;
    }
  }
  return more == 0;
}

static bool read_host_pools(jp *j, model *m) {
  if (!jp_arr_begin(j, "the host_pools list was expected")) return false;
  bool first = true;
  int more;
  while ((more = jp_arr_next(j, &first)) > 0) {
    /* The label comes before segments and trace in ebb's output; a pool object that puts them
     * first is read into a pool named by its position. */
    char title[96];
    snprintf(title, sizeof title, "host pool %zu", m->pools.n);
    if (!jp_obj_begin(j, "a host pool object was expected")) return false;
    bool f2 = true;
    int k;
    while ((k = jp_obj_key(j, &f2)) > 0) {
      if (!strcmp(j->str, "label")) {
        if (!jp_string(j)) return false;
        snprintf(title, sizeof title, "%s", j->str);
      } else if (!strcmp(j->str, "segments")) {
        if (!read_segments(j, m, title)) return false;
      } else if (!strcmp(j->str, "trace")) {
        pool *p = pool_for(m, title, true);
        if (!p) return jp_fail(j, "out of host memory");
        if (!read_trace(j, m, p)) return false;
      } else if (!jp_skip(j))
        return false;
    }
    if (k < 0) return false;
  }
  return more == 0;
}

static bool read_snapshot(jp *j, model *m) {
  if (!jp_obj_begin(j, "the snapshot's top-level object was expected")) return false;
  bool first = true, saw_segments = false, saw_traces = false;
  int k;
  while ((k = jp_obj_key(j, &first)) > 0) {
    if (!strcmp(j->str, "segments")) {
      saw_segments = true;
      if (!read_segments(j, m, NULL)) return false;
    } else if (!strcmp(j->str, "device_traces")) {
      saw_traces = true;
      if (!jp_arr_begin(j, "device_traces (a list per device) was expected")) return false;
      bool f2 = true;
      int more, dev = 0;
      while ((more = jp_arr_next(j, &f2)) > 0) {
        char title[32];
        snprintf(title, sizeof title, "device %d", dev++);
        pool *p = pool_for(m, title, false);
        if (!p) return jp_fail(j, "out of host memory");
        if (!read_trace(j, m, p)) return false;
      }
      if (more < 0) return false;
    } else if (!strcmp(j->str, "host_pools")) {
      if (!read_host_pools(j, m)) return false;
    } else if (!jp_skip(j))
      return false;
  }
  if (k < 0) return false;
  jp_ws(j);
  if (j->p != j->end) return jp_fail(j, "the snapshot continues after its top-level object");
  if (!saw_segments || !saw_traces) return jp_fail(j, "\"segments\" and \"device_traces\" are both required");
  return true;
}

/* After reading: blocks the segments hold that the history never saw allocated are live from its
 * start, and a live block's owner is the segments' (the newest tag). Events get sorted by time
 * with the before-history allocations first, and the reserved line gets its starting level. */
static int cmp_event(const void *a, const void *b) {
  const event *x = a, *y = b;
  if (x->t != y->t) return x->t < y->t ? -1 : 1;
  return (x->block > y->block) - (x->block < y->block);
}

static bool finish_pool(model *m, pool *p) {
  for (size_t s = 0; s < p->segments.n; s++) {
    const segment *sg = &VEC_AT(p->segments, segment, s);
    for (size_t i = 0; i < sg->nblocks; i++) {
      const seg_block *sb = &VEC_AT(p->seg_blocks, seg_block, sg->first_block + i);
      if (!sb->state) continue;
      uint32_t id = map_get(p, sb->addr);
      if (id) {
        block *b = &VEC_AT(p->blocks, block, id - 1);
        b->cat = sb->cat;
        b->owner = sb->owner;
      } else {
        block b = {.addr = sb->addr, .size = sb->size, .t_alloc = -1, .t_free = -1, .owner = sb->owner,
                   .cat = sb->cat, .before = true};
        if (!vec_push(&p->blocks, &b)) return false;
      }
    }
  }
  /* Before-history blocks enter at the first time of the whole snapshot. */
  double t0 = m->t_min;
  for (size_t i = 0; i < p->blocks.n; i++) {
    block *b = &VEC_AT(p->blocks, block, i);
    if (b->before) {
      b->t_alloc = -1;
      if (!add_event(p, t0, (uint32_t)i, 1)) return false;
    }
  }
  /* Stable enough: ties in time keep allocations of earlier blocks first; a free at the same
   * microsecond as its own allocation sorts after it since its block index is the same and the
   * alloc event was pushed first (qsort is not stable, so order by sign as well). A pool with
   * no events has no array (NULL), which qsort must not be given even for zero elements. */
  event *ev = p->events.p;
  if (p->events.n > 1) qsort(ev, p->events.n, sizeof *ev, cmp_event);
  for (size_t i = 1; i < p->events.n; i++)
    if (ev[i].t == ev[i - 1].t && ev[i].block == ev[i - 1].block && ev[i].sign > ev[i - 1].sign) {
      event t = ev[i];
      ev[i] = ev[i - 1];
      ev[i - 1] = t;
    }
  /* Reserved: the history's running sum ends at seg_total; shift it so it does. */
  double end = p->reserved.n ? VEC_AT(p->reserved, rsv, p->reserved.n - 1).bytes : 0;
  double base = p->seg_total - end;
  for (size_t i = 0; i < p->reserved.n; i++) VEC_AT(p->reserved, rsv, i).bytes += base;
  rsv first = {t0, base};
  if (!vec_push(&p->reserved, &first)) return false;
  memmove((rsv *)p->reserved.p + 1, p->reserved.p, (p->reserved.n - 1) * sizeof(rsv));
  VEC_AT(p->reserved, rsv, 0) = first;
  rsv last = {m->t_max, p->seg_total};
  return vec_push(&p->reserved, &last);
}

/* ---- derived figures ---------------------------------------------------------------------------- */

typedef struct peak_info {
  double bytes, t;
  size_t event; /* index of the event that reached the peak */
  double by_cat[NCAT];
} peak_info;

static peak_info find_peak(const pool *p) {
  peak_info pk = {0};
  double cur[NCAT] = {0}, total = 0;
  const event *ev = p->events.p;
  for (size_t i = 0; i < p->events.n; i++) {
    const block *b = &VEC_AT(p->blocks, block, ev[i].block);
    double d = ev[i].sign * (double)b->size;
    cur[b->cat] += d;
    total += d;
    if (total > pk.bytes) {
      pk.bytes = total;
      pk.t = ev[i].t;
      pk.event = i;
      memcpy(pk.by_cat, cur, sizeof cur);
    }
  }
  return pk;
}

typedef struct owner_sum {
  uint32_t owner;
  uint8_t cat;
  double bytes;
  uint32_t blocks;
} owner_sum;

static int cmp_owner_sum(const void *a, const void *b) {
  double x = ((const owner_sum *)a)->bytes, y = ((const owner_sum *)b)->bytes;
  return (x < y) - (x > y);
}

/* The owners holding the most bytes at the peak, largest first (at most `cap`). */
static size_t top_owners(const model *m, const pool *p, const peak_info *pk, owner_sum *out, size_t cap) {
  size_t nown = m->owners.n * NCAT;
  owner_sum *sum = calloc(nown ? nown : 1, sizeof *sum);
  uint8_t *live = calloc(p->blocks.n ? p->blocks.n : 1, 1);
  if (!sum || !live) {
    free(sum);
    free(live);
    return 0;
  }
  const event *ev = p->events.p;
  if (p->events.n)
    for (size_t i = 0; i <= pk->event; i++) live[ev[i].block] = ev[i].sign > 0;
  for (size_t i = 0; i < p->blocks.n; i++) {
    if (!live[i]) continue;
    const block *b = &VEC_AT(p->blocks, block, i);
    owner_sum *s = &sum[(size_t)b->owner * NCAT + b->cat];
    s->owner = b->owner;
    s->cat = b->cat;
    s->bytes += (double)b->size;
    s->blocks++;
  }
  if (nown) qsort(sum, nown, sizeof *sum, cmp_owner_sum);
  size_t n = 0;
  while (n < cap && n < nown && sum[n].bytes > 0) {
    out[n] = sum[n];
    n++;
  }
  free(sum);
  free(live);
  return n;
}

/* ---- output ------------------------------------------------------------------------------------- */

typedef struct out {
  FILE *f;
  bool bad;
} out;

static void o_printf(out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void o_printf(out *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (vfprintf(o->f, fmt, ap) < 0) o->bad = true;
  va_end(ap);
}

static void o_write(out *o, const void *p, size_t n) {
  if (n && fwrite(p, 1, n, o->f) != n) o->bad = true;
}

/* A JSON string (also safe inside a <script> element: '<' is escaped). */
static void o_jstr(out *o, const char *s) {
  o_write(o, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\') o_printf(o, "\\%c", *c);
    else if (*c < 0x20 || *c == '<' || *c == '>' || *c == '&') o_printf(o, "\\u%04x", *c);
    else o_write(o, c, 1);
  }
  o_write(o, "\"", 1);
}

/* Text for SVG/XML. */
static void o_xml(out *o, const char *s) {
  for (; *s; s++) {
    if (*s == '<') o_printf(o, "&lt;");
    else if (*s == '>') o_printf(o, "&gt;");
    else if (*s == '&') o_printf(o, "&amp;");
    else if (*s == '"') o_printf(o, "&quot;");
    else o_write(o, s, 1);
  }
}

/* Base64 of a byte stream, written in pieces. */
typedef struct b64 {
  out *o;
  unsigned char carry[3];
  int ncarry;
  char buf[4096];
  size_t nbuf;
} b64;

static const char b64chars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_quad(b64 *b, const unsigned char *in, int n) {
  if (b->nbuf + 4 > sizeof b->buf) {
    o_write(b->o, b->buf, b->nbuf);
    b->nbuf = 0;
  }
  uint32_t v = (uint32_t)in[0] << 16 | (uint32_t)(n > 1 ? in[1] : 0) << 8 | (uint32_t)(n > 2 ? in[2] : 0);
  b->buf[b->nbuf++] = b64chars[(v >> 18) & 63];
  b->buf[b->nbuf++] = b64chars[(v >> 12) & 63];
  b->buf[b->nbuf++] = n > 1 ? b64chars[(v >> 6) & 63] : '=';
  b->buf[b->nbuf++] = n > 2 ? b64chars[v & 63] : '=';
}

static void b64_put(b64 *b, const void *p, size_t n) {
  const unsigned char *s = p;
  while (n) {
    if (b->ncarry || n < 3) {
      b->carry[b->ncarry++] = *s++;
      n--;
      if (b->ncarry == 3) {
        b64_quad(b, b->carry, 3);
        b->ncarry = 0;
      }
      continue;
    }
    b64_quad(b, s, 3);
    s += 3;
    n -= 3;
  }
}

static void b64_end(b64 *b) {
  if (b->ncarry) b64_quad(b, b->carry, b->ncarry);
  b->ncarry = 0;
  o_write(b->o, b->buf, b->nbuf);
  b->nbuf = 0;
}

/* One pool's arrays, each padded to 8 bytes, in the order memviz_page.html decodes them:
 * ev_t f64[N] ev_b i32[N] (block index, negated minus one for a free), blk_size f64[M],
 * blk_alloc f64[M], blk_free f64[M], blk_stream f64[M], blk_owner u32[M], blk_cat u8[M], rs_t
 * f64[R], rs_v f64[R]. Times are µs from the snapshot's first entry. */
static void write_pool_blob(out *o, const model *m, const pool *p) {
  b64 b = {.o = o};
  const event *ev = p->events.p;
  size_t n = p->events.n, nb = p->blocks.n, nr = p->reserved.n;
  static const unsigned char zero[8];
  for (size_t i = 0; i < n; i++) {
    double t = ev[i].t - m->t_min;
    b64_put(&b, &t, 8);
  }
  for (size_t i = 0; i < n; i++) {
    int32_t v = ev[i].sign > 0 ? (int32_t)ev[i].block : -(int32_t)ev[i].block - 1;
    b64_put(&b, &v, 4);
  }
  if (n % 2) b64_put(&b, zero, 4);
  for (int f = 0; f < 4; f++)
    for (size_t i = 0; i < nb; i++) {
      const block *bk = &VEC_AT(p->blocks, block, i);
      double v = f == 0 ? (double)bk->size
                 : f == 1 ? (bk->t_alloc < 0 ? -1 : bk->t_alloc - m->t_min)
                 : f == 2 ? (bk->t_free < 0 ? -1 : bk->t_free - m->t_min)
                          : (double)bk->stream;
      b64_put(&b, &v, 8);
    }
  for (size_t i = 0; i < nb; i++) b64_put(&b, &VEC_AT(p->blocks, block, i).owner, 4);
  if (nb % 2) b64_put(&b, zero, 4);
  for (size_t i = 0; i < nb; i++) b64_put(&b, &VEC_AT(p->blocks, block, i).cat, 1);
  if (nb % 8) b64_put(&b, zero, 8 - nb % 8);
  for (size_t i = 0; i < nr; i++) {
    double t = VEC_AT(p->reserved, rsv, i).t - m->t_min;
    b64_put(&b, &t, 8);
  }
  for (size_t i = 0; i < nr; i++) b64_put(&b, &VEC_AT(p->reserved, rsv, i).bytes, 8);
  b64_end(&b);
}

#define SEG_MAP_MAX_BLOCKS 200000 /* the segment map lists at most this many blocks per pool */

static void write_meta(out *o, const model *m) {
  o_printf(o, "{\"cats\":[");
  for (int c = 0; c < NCAT; c++) o_printf(o, "%s\"%s\"", c ? "," : "", cat_names[c]);
  o_printf(o, "],\"span_us\":%.0f,\"owners\":[", m->t_max - m->t_min);
  for (size_t i = 0; i < m->owners.n; i++) {
    if (i) o_write(o, ",", 1);
    o_jstr(o, VEC_AT(m->owners, char *, i));
  }
  o_printf(o, "],\"pools\":[");
  for (size_t i = 0; i < m->pools.n; i++) {
    const pool *p = &VEC_AT(m->pools, pool, i);
    peak_info pk = find_peak(p);
    owner_sum top[10];
    size_t ntop = top_owners(m, p, &pk, top, 10);
    o_printf(o, "%s{\"title\":", i ? "," : "");
    o_jstr(o, p->title);
    o_printf(o, ",\"host\":%s,\"events\":%zu,\"blocks\":%zu,\"reserved\":%zu,\"peak\":%.0f,\"peak_t\":%.0f,\"peak_by_cat\":[",
             p->host ? "true" : "false", p->events.n, p->blocks.n, p->reserved.n, pk.bytes, pk.t - m->t_min);
    for (int c = 0; c < NCAT; c++) o_printf(o, "%s%.0f", c ? "," : "", pk.by_cat[c]);
    o_printf(o, "],\"top\":[");
    for (size_t t = 0; t < ntop; t++)
      o_printf(o, "%s[%u,%u,%.0f,%u]", t ? "," : "", top[t].owner, top[t].cat, top[t].bytes, top[t].blocks);
    o_printf(o, "],\"ooms\":[");
    for (size_t t = 0; t < p->ooms.n; t++) o_printf(o, "%s%.0f", t ? "," : "", VEC_AT(p->ooms, double, t) - m->t_min);
    /* segments: [size, [[offset, size, cat, state, owner], ...]] */
    o_printf(o, "],\"segments\":[");
    size_t listed = 0;
    for (size_t s = 0; s < p->segments.n; s++) {
      const segment *sg = &VEC_AT(p->segments, segment, s);
      o_printf(o, "%s[%" PRIu64 ",%" PRIu64 ",[", s ? "," : "", sg->addr, sg->size);
      for (size_t k = 0; k < sg->nblocks && listed < SEG_MAP_MAX_BLOCKS; k++, listed++) {
        const seg_block *sb = &VEC_AT(p->seg_blocks, seg_block, sg->first_block + k);
        o_printf(o, "%s[%" PRIu64 ",%" PRIu64 ",%u,%u,%u]", k ? "," : "", sb->addr - sg->addr, sb->size, sb->cat,
                 sb->state, sb->owner);
      }
      o_printf(o, "]]");
    }
    o_printf(o, "],\"segments_truncated\":%s}", listed >= SEG_MAP_MAX_BLOCKS ? "true" : "false");
  }
  o_printf(o, "]}");
}

static const char *const svg_colors[NCAT] = {"#9e9e9e", "#3366cc", "#dc3912", "#ff9900",
                                             "#109618", "#990099", "#0099c6", "#dd4477"};

/* Stacked live bytes per pool: for each of W columns over the span, the state at the event that
 * reached the column's highest total (so a short peak is never averaged away). */
static void write_svg(out *o, const model *m) {
  const int W = 900, H = 180, left = 70, top = 30, gap = 60;
  int np = (int)m->pools.n;
  o_printf(o, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
              "font-size=\"12\">\n", left + W + 180, top + np * (H + gap) + 10);
  o_printf(o, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  double span = m->t_max > m->t_min ? m->t_max - m->t_min : 1;
  double *col = malloc((size_t)W * (NCAT + 1) * sizeof *col);
  if (!col) {
    o->bad = true;
    return;
  }
  for (int pi = 0; pi < np; pi++) {
    const pool *p = &VEC_AT(m->pools, pool, pi);
    int y0 = top + pi * (H + gap);
    /* state: the bytes per category (and their total) after the newest event so far; a column
     * shows its events' highest total, an empty column the state carried into it */
    double state[NCAT + 1] = {0}, peak = 1;
    memset(col, 0, (size_t)W * (NCAT + 1) * sizeof *col);
    const event *ev = p->events.p;
    int last_c = -1;
    for (size_t i = 0; i < p->events.n; i++) {
      const block *b = &VEC_AT(p->blocks, block, ev[i].block);
      double d = ev[i].sign * (double)b->size;
      int c = (int)((ev[i].t - m->t_min) / span * (W - 1));
      if (c < 0) c = 0;
      if (c >= W) c = W - 1;
      for (int k = last_c + 1; k <= c; k++) memcpy(&col[k * (NCAT + 1)], state, sizeof state);
      state[b->cat] += d;
      state[NCAT] += d;
      if (state[NCAT] > peak) peak = state[NCAT];
      if (state[NCAT] >= col[c * (NCAT + 1) + NCAT]) memcpy(&col[c * (NCAT + 1)], state, sizeof state);
      if (c > last_c) last_c = c;
    }
    for (int k = last_c + 1; k < W; k++) memcpy(&col[k * (NCAT + 1)], state, sizeof state);
    o_printf(o, "<text x=\"%d\" y=\"%d\" font-weight=\"bold\">", left, y0 - 8);
    o_xml(o, p->title);
    o_printf(o, ": live bytes by owner (peak %.1f MiB)</text>\n", peak / 1048576.0);
    o_printf(o, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#ccc\"/>\n", left, y0, W, H);
    for (int c = NCAT - 1; c >= 0; c--) {
      /* band c: from the sum of categories below it to that plus its own */
      o_printf(o, "<path fill=\"%s\" d=\"M%d %d", svg_colors[c], left, y0 + H);
      for (int x = 0; x < W; x++) {
        double s = 0;
        for (int k = 0; k <= c; k++) s += col[x * (NCAT + 1) + k];
        o_printf(o, " L%d %.1f", left + x, y0 + H - s / peak * H);
      }
      o_printf(o, " L%d %d Z\"/>\n", left + W - 1, y0 + H);
    }
    o_printf(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%.1f MiB</text>\n", left - 4, y0 + 10, peak / 1048576.0);
    o_printf(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">0</text>\n", left - 4, y0 + H);
    o_printf(o, "<text x=\"%d\" y=\"%d\">0 s</text><text x=\"%d\" y=\"%d\" text-anchor=\"end\">%.3f s</text>\n", left,
             y0 + H + 14, left + W, y0 + H + 14, span / 1e6);
  }
  for (int c = 0; c < NCAT; c++) {
    o_printf(o, "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>", left + W + 20, top + c * 18,
             svg_colors[c]);
    o_printf(o, "<text x=\"%d\" y=\"%d\">%s</text>\n", left + W + 38, top + c * 18 + 10, cat_names[c]);
  }
  o_printf(o, "</svg>\n");
  free(col);
}

static bool write_html(const model *m, FILE *f) {
  out o = {.f = f};
  const char *page = (const char *)ebb__memviz_page;
  const char *mark = strstr(page, "<!--EBB_MEMVIZ_DATA-->");
  if (!mark) {
    fprintf(stderr, "ebb-memviz: the embedded page has no data marker (a build problem)\n");
    return false;
  }
  o_write(&o, page, (size_t)(mark - page));
  o_printf(&o, "<script id=\"meta\" type=\"application/json\">");
  write_meta(&o, m);
  o_printf(&o, "</script>\n");
  for (size_t i = 0; i < m->pools.n; i++) {
    o_printf(&o, "<script id=\"pool%zu\" type=\"application/octet-stream\">", i);
    write_pool_blob(&o, m, &VEC_AT(m->pools, pool, i));
    o_printf(&o, "</script>\n");
  }
  const char *rest = mark + strlen("<!--EBB_MEMVIZ_DATA-->");
  o_write(&o, rest, ebb__memviz_page_size - (size_t)(rest - page));
  return !o.bad;
}

static void free_model(model *m) {
  for (size_t i = 0; i < m->pools.n; i++) pool_free(&VEC_AT(m->pools, pool, i));
  free(m->pools.p);
  for (size_t i = 0; i < m->owners.n; i++) free(VEC_AT(m->owners, char *, i));
  free(m->owners.p);
  free(m->own_idx);
}

static int cmp_pool(const void *a, const void *b) {
  const pool *x = a, *y = b;
  if (x->host != y->host) return x->host ? 1 : -1;
  return strcmp(x->title, y->title); /* "device 10" after "device 9" only past ten devices */
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "ebb-memviz: cannot read '%s': %s\n", path, strerror(errno));
    return NULL;
  }
  size_t cap = 1 << 20, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (!buf) break;
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    char *nb = realloc(buf, cap * 2);
    if (!nb) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = nb;
    cap *= 2;
  }
  bool err = ferror(f);
  fclose(f);
  if (!buf || err) {
    fprintf(stderr, "ebb-memviz: cannot read '%s': %s\n", path, buf ? strerror(errno) : "out of host memory");
    free(buf);
    return NULL;
  }
  *len = n;
  return buf;
}

static bool write_one(const char *path, const model *m, bool svg) {
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "ebb-memviz: cannot write '%s': %s\n", path, strerror(errno));
    return false;
  }
  bool ok;
  if (svg) {
    out o = {.f = f};
    write_svg(&o, m);
    ok = !o.bad;
  } else
    ok = write_html(m, f);
  if (fclose(f) != 0) ok = false;
  if (!ok) {
    fprintf(stderr, "ebb-memviz: writing '%s' failed: %s\n", path, strerror(errno));
    remove(path);
  }
  return ok;
}

bool ebb_memviz_write_html(const char *snapshot_path, const char *html_path, const char *svg_path) {
  size_t len;
  input_fault = true;
  char *text = read_file(snapshot_path, &len);
  if (!text) return false;
  input_fault = false;
  model m = {.pools = {.elem = sizeof(pool)}, .owners = {.elem = sizeof(char *)}, .t_min = INFINITY, .t_max = -INFINITY};
  jp j = {.start = text, .p = text, .end = text + len, .path = snapshot_path};
  /* Owner 0 is "": an owner object without a name, or none at all, is nobody's. */
  uint32_t none;
  bool ok = intern_owner(&m, "", 0, &none);
  if (!ok) fprintf(stderr, "ebb-memviz: out of host memory\n");
  if (ok) ok = read_snapshot(&j, &m);
  free(j.str);
  free(text);
  if (ok) {
    if (!isfinite(m.t_min)) m.t_min = m.t_max = 0;
    for (size_t i = 0; ok && i < m.pools.n; i++)
      if (!finish_pool(&m, &VEC_AT(m.pools, pool, i))) {
        fprintf(stderr, "ebb-memviz: out of host memory\n");
        ok = false;
      }
    /* Host pools that never held anything say nothing. */
    size_t keep = 0;
    for (size_t i = 0; ok && i < m.pools.n; i++) {
      pool *p = &VEC_AT(m.pools, pool, i);
      if (p->host && !p->events.n && !p->segments.n) {
        pool_free(p);
        continue;
      }
      VEC_AT(m.pools, pool, keep++) = *p;
    }
    if (ok) m.pools.n = keep;
    if (m.pools.n > 1) qsort(m.pools.p, m.pools.n, sizeof(pool), cmp_pool); /* none: p is NULL */
  }
  if (ok) ok = write_one(html_path, &m, false);
  if (ok && svg_path && !write_one(svg_path, &m, true)) {
    remove(html_path);
    ok = false;
  }
  free_model(&m);
  return ok;
}
