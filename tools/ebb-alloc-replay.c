/* ebb-alloc-replay: replays an allocation trace against the device arena and reports how much
 * memory the arena reserved for it.
 *
 * A trace is text, one event per line, from a file or (path `-`) standard input, so a compressed
 * trace is replayed through a pipe (`zcat t.trace.gz | ebb-alloc-replay - ...`; messages then name
 * it `stdin`): `a <id> <bytes> [<stream>]` allocates, `f <id>` frees;
 * `#` starts a comment, blank lines are ignored and further fields are too. The whole trace is
 * read and checked first (syntax, stream indices, ids freed while not live, ids allocated while
 * live), and each id is resolved to a dense slot then, so the timed loop is only the arena's
 * calls and an array index: no parsing and no hashing is measured.
 *
 * It prints one line: peak requested bytes (the trace's own live sum), the arena's peak reserved
 * bytes, their ratio, ns per arena call, allocations and driver allocations.
 * Single-threaded. Exit codes: 0 ok, 1 ebb failed (ebb_init, an allocation: the message from
 * ebb_last_error() goes to stderr), 2 bad command line or bad trace.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/status.h"
#include "ebb/stream.h"

#define PROG "ebb-alloc-replay"
#define MAX_STREAMS 64
#define ID_MAX ((uint64_t)1 << 63) /* ids are 0 .. 2^63 */

/* ---- the parsed trace ---------------------------------------------------------------------- */

typedef struct event {
  uint64_t slot;   /* alloc: its own slot; free: the slot of the allocation it frees */
  uint64_t bytes;  /* alloc only */
  uint64_t line;   /* in the trace, for messages */
  uint32_t stream; /* alloc only: index into the created streams */
  bool is_alloc;
} event;

typedef struct trace {
  event *ev;
  size_t nev, cap;
  uint64_t nallocs, nfrees;
  uint64_t peak_requested;
} trace;

/* ---- id -> slot map -------------------------------------------------------------------------
 * Open addressing with linear probing and backward-shift deletion (no tombstones), so a trace
 * that allocates and frees millions of ids keeps probe sequences short. Holds live ids only. */

typedef struct idmap_entry {
  uint64_t id;
  uint64_t slot;
  uint64_t bytes;
  uint64_t line; /* of the allocation */
  bool used;
} idmap_entry;

typedef struct idmap {
  idmap_entry *e;
  size_t cap; /* a power of two */
  size_t n;
} idmap;

static uint64_t hash_id(uint64_t x) { /* splitmix64's finaliser: ids are often sequential */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

static idmap_entry *idmap_find(const idmap *m, uint64_t id) {
  if (m->cap == 0) return NULL;
  size_t mask = m->cap - 1;
  for (size_t i = hash_id(id) & mask;; i = (i + 1) & mask) {
    if (!m->e[i].used) return NULL;
    if (m->e[i].id == id) return &m->e[i];
  }
}

static bool idmap_grow(idmap *m);

/* Inserts id (not present). false only when memory runs out. */
static bool idmap_put(idmap *m, const idmap_entry *in) {
  if ((m->n + 1) * 4 > m->cap * 3 && !idmap_grow(m)) return false; /* load <= 3/4 */
  size_t mask = m->cap - 1;
  size_t i = hash_id(in->id) & mask;
  while (m->e[i].used) i = (i + 1) & mask;
  m->e[i] = *in;
  m->e[i].used = true;
  m->n++;
  return true;
}

static bool idmap_grow(idmap *m) {
  size_t ncap = m->cap ? m->cap * 2 : 1024;
  idmap old = *m;
  m->e = calloc(ncap, sizeof *m->e);
  if (m->e == NULL) {
    *m = old;
    return false;
  }
  m->cap = ncap;
  m->n = 0;
  for (size_t i = 0; i < old.cap; i++)
    if (old.e[i].used) idmap_put(m, &old.e[i]);
  free(old.e);
  return true;
}

/* Removes the entry at e and shifts later members of its probe run back into the hole. */
static void idmap_remove(idmap *m, idmap_entry *e) {
  size_t mask = m->cap - 1;
  size_t hole = (size_t)(e - m->e);
  for (size_t j = (hole + 1) & mask; m->e[j].used; j = (j + 1) & mask) {
    size_t home = hash_id(m->e[j].id) & mask;
    /* j may move to the hole only if its home is not in (hole, j] (cyclically). */
    bool home_in_range = hole < j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!home_in_range) {
      m->e[hole] = m->e[j];
      hole = j;
    }
  }
  m->e[hole].used = false;
  m->n--;
}

/* ---- parsing ------------------------------------------------------------------------------- */

/* A decimal token of digits only (no sign, no spaces) into *out; false on anything else or on
 * overflow of uint64_t. */
static bool parse_u64(const char *s, uint64_t *out) {
  if (*s == '\0') return false;
  uint64_t v = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9') return false;
    unsigned d = (unsigned)(*s - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

static int trace_fail(const char *path, uint64_t line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int trace_fail(const char *path, uint64_t line, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, PROG ": %s:%" PRIu64 ": ", path, line);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  return 2;
}

static bool trace_push(trace *t, event ev) {
  if (t->nev == t->cap) {
    size_t ncap = t->cap ? t->cap * 2 : 4096;
    event *n = realloc(t->ev, ncap * sizeof *n);
    if (n == NULL) return false;
    t->ev = n;
    t->cap = ncap;
  }
  t->ev[t->nev++] = ev;
  return true;
}

/* Reads and checks the whole trace (path "-": standard input, named "stdin" in messages). Returns
 * 0, or 2 after printing `PROG: path:line: ...` (line 0 for the file as a whole: it cannot be
 * opened). */
static int trace_load(const char *path, unsigned nstreams, trace *t) {
  bool is_stdin = strcmp(path, "-") == 0;
  FILE *f = is_stdin ? stdin : fopen(path, "r");
  if (is_stdin) path = "stdin";
  if (f == NULL)
    return trace_fail(path, 0, "cannot open the trace: %s; expected a readable text file", strerror(errno));

  idmap live = {0};
  uint64_t requested = 0;
  char *buf = NULL;
  size_t bufcap = 0;
  uint64_t line = 0;
  int rc = 0;
  ssize_t len;

  while ((len = getline(&buf, &bufcap, f)) >= 0) {
    line++;
    if (memchr(buf, '\0', (size_t)len) != NULL) {
      rc = trace_fail(path, line, "the line holds a NUL byte; expected a text trace");
      goto done;
    }
    char *hash = strchr(buf, '#');
    if (hash != NULL) *hash = '\0';
    char *save = NULL;
    const char *tok[4] = {0};
    int ntok = 0;
    for (char *p = strtok_r(buf, " \t\r\n\v\f", &save); p != NULL && ntok < 4;
         p = strtok_r(NULL, " \t\r\n\v\f", &save))
      tok[ntok++] = p;
    if (ntok == 0) continue;

    uint64_t id = 0;
    bool is_alloc = strcmp(tok[0], "a") == 0;
    if (!is_alloc && strcmp(tok[0], "f") != 0) {
      rc = trace_fail(path, line, "unknown event '%s'; expected 'a <id> <bytes> [<stream>]' or 'f <id>'", tok[0]);
      goto done;
    }
    if (ntok < 2 || !parse_u64(tok[1], &id) || id > ID_MAX) {
      if (ntok < 2)
        rc = trace_fail(path, line, "'%s' without an id; expected a whole number 0..2^63 after it", tok[0]);
      else
        rc = trace_fail(path, line, "bad id '%s'; expected a whole number 0..2^63", tok[1]);
      goto done;
    }
    idmap_entry *e = idmap_find(&live, id);

    if (!is_alloc) {
      if (e == NULL) {
        rc = trace_fail(path, line,
                        "free of id %" PRIu64 " which is not allocated; expected the id of a live allocation", id);
        goto done;
      }
      event ev = {.slot = e->slot, .line = line, .is_alloc = false};
      requested -= e->bytes;
      idmap_remove(&live, e);
      if (!trace_push(t, ev)) goto oom;
      t->nfrees++;
      continue;
    }

    uint64_t bytes = 0, stream = 0;
    if (ntok < 3 || !parse_u64(tok[2], &bytes) || bytes > SIZE_MAX) {
      if (ntok < 3)
        rc = trace_fail(path, line,
                        "allocation of id %" PRIu64 " without a size; expected 'a <id> <bytes> [<stream>]'", id);
      else
        rc = trace_fail(path, line, "bad byte count '%s'; expected a whole number of bytes", tok[2]);
      goto done;
    }
    if (ntok >= 4 && (!parse_u64(tok[3], &stream) || stream >= nstreams)) {
      rc = trace_fail(path, line, "stream index '%s' is out of range; expected 0..%u (--streams %u)", tok[3],
                      nstreams - 1, nstreams);
      goto done;
    }
    if (e != NULL) {
      rc = trace_fail(path, line,
                      "id %" PRIu64 " is allocated again while still live (allocated on line %" PRIu64
                      "); expected a free of it first",
                      id, e->line);
      goto done;
    }
    uint64_t slot = t->nallocs;
    idmap_entry in = {.id = id, .slot = slot, .bytes = bytes, .line = line};
    if (!idmap_put(&live, &in)) goto oom;
    event ev = {.slot = slot, .bytes = bytes, .line = line, .stream = (uint32_t)stream, .is_alloc = true};
    if (!trace_push(t, ev)) goto oom;
    t->nallocs++;
    requested += bytes;
    if (requested > t->peak_requested) t->peak_requested = requested;
  }
  if (ferror(f)) rc = trace_fail(path, line + 1, "read error: %s; expected a readable text file", strerror(errno));
  goto done;

oom:
  rc = trace_fail(path, line, "out of host memory holding the trace; expected a smaller trace");
done:
  free(buf);
  free(live.e);
  if (!is_stdin) fclose(f);
  return rc;
}

/* ---- replay -------------------------------------------------------------------------------- */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " TRACE [--expandable | --classic] [--streams N] [--peak-snapshot PATH] [--help]\n"
          "Replays an allocation trace on device 0's arena and prints one line:\n"
          "  peak_requested=B peak_reserved=B frag_ratio=R ns_per_op=T allocs=N driver_allocs=N\n"
          "TRACE is a file, or - for standard input (e.g. zcat t.trace.gz | " PROG " - ...).\n"
          "Trace: one event per line; '#' starts a comment; blank lines and extra fields are ignored.\n"
          "  a <id> <bytes> [<stream>]   allocate (stream index 0..N-1, default 0)\n"
          "  f <id>                      free\n"
          "ids are whole numbers 0..2^63; an id may be reused once freed.\n"
          "  --expandable   EBB_ALLOC_CONF gains expandable_segments:1 (the default where the driver\n"
          "                 has VMM, as the emulated driver does)\n"
          "  --classic      EBB_ALLOC_CONF gains expandable_segments:0\n"
          "  --streams N    create N streams (1..%d, default 1) for the stream indices\n"
          "  --peak-snapshot PATH  write a memory snapshot (ebb_memory_snapshot_json) to PATH each\n"
          "                 time reserved bytes reach a new peak: the file left shows the arena at\n"
          "                 its peak. Slow: ns_per_op then includes the stats calls and snapshots.\n"
          "  --help         this message\n"
          "frag_ratio is peak_reserved / peak_requested (0.000 when nothing was requested).\n"
          "EBB_SIM_MEM defaults to 64G and EBB_SIM_COMMIT to 0 here (the replay never touches the\n"
          "memory, so the emulated device maps address space only).\n"
          "Exit: 0 ok, 1 ebb failed, 2 bad command line or bad trace.\n",
          MAX_STREAMS);
}

/* With --peak-snapshot: when device 0's reserved bytes exceed *peak, writes the snapshot again
 * (the last one written shows the arena at its peak). Returns 0, or 1 after printing why. */
static int write_if_peak(const char *path, uint64_t *peak) {
  ebb_arena_stats s;
  ebb_status st = ebb_arena_get_stats(0, &s);
  if (st == EBB_OK && s.reserved_bytes.current > *peak) {
    *peak = s.reserved_bytes.current;
    st = ebb_memory_snapshot_json(path);
  }
  if (st != EBB_OK) {
    fprintf(stderr, PROG ": --peak-snapshot %s: %s: %s\n", path, ebb_status_name(st), ebb_last_error());
    return 1;
  }
  return 0;
}

/* Runs the timed loop (timed only without --peak-snapshot). Returns 0, or 1 after printing the failing call. ptrs[slot] holds every
 * live block on return (NULL for freed ones), whatever happened. */
static int replay(const char *path, const trace *t, ebb_stream_t **streams, void **ptrs, uint64_t *ns,
                  const char *peak_snapshot) {
  uint64_t t0 = now_ns();
  uint64_t peak = 0;
  for (size_t i = 0; i < t->nev; i++) {
    const event *ev = &t->ev[i];
    ebb_status st;
    if (ev->is_alloc) {
      st = ebb_arena_alloc(0, (size_t)ev->bytes, streams[ev->stream], &ptrs[ev->slot]);
    } else {
      st = ebb_arena_free(ptrs[ev->slot]);
      ptrs[ev->slot] = NULL;
    }
    if (st != EBB_OK) {
      if (ev->is_alloc)
        fprintf(stderr, PROG ": %s:%" PRIu64 ": allocation of %" PRIu64 " bytes failed: %s: %s\n", path, ev->line,
                ev->bytes, ebb_status_name(st), ebb_last_error());
      else
        fprintf(stderr, PROG ": %s:%" PRIu64 ": free failed: %s: %s\n", path, ev->line, ebb_status_name(st),
                ebb_last_error());
      return 1;
    }
    if (peak_snapshot && ev->is_alloc && write_if_peak(peak_snapshot, &peak) != 0) return 1;
  }
  *ns = now_ns() - t0;
  return 0;
}

int main(int argc, char **argv) {
  const char *path = NULL;
  int expandable = -1; /* -1: the driver's default; 0 --classic; 1 --expandable */
  unsigned nstreams = 1;
  const char *peak_snapshot = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--expandable") == 0 || strcmp(argv[i], "--classic") == 0) {
      int x = argv[i][2] == 'e';
      if (expandable >= 0 && expandable != x) {
        fprintf(stderr, PROG ": --expandable and --classic exclude each other\n");
        return 2;
      }
      expandable = x;
    } else if (strcmp(argv[i], "--streams") == 0) {
      uint64_t n = 0;
      if (i + 1 >= argc || !parse_u64(argv[i + 1], &n) || n < 1 || n > MAX_STREAMS) {
        fprintf(stderr, PROG ": --streams needs a whole number 1..%d\n", MAX_STREAMS);
        return 2;
      }
      nstreams = (unsigned)n;
      i++;
    } else if (strcmp(argv[i], "--peak-snapshot") == 0) {
      if (i + 1 >= argc || argv[i + 1][0] == '\0') {
        fprintf(stderr, PROG ": --peak-snapshot needs a file path\n");
        return 2;
      }
      peak_snapshot = argv[++i];
    } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
      fprintf(stderr, PROG ": unknown argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    } else if (path == NULL) {
      path = argv[i];
    } else {
      fprintf(stderr, PROG ": one trace expected, got '%s' and '%s'\n", path, argv[i]);
      return 2;
    }
  }
  if (path == NULL) {
    usage(stderr);
    return 2;
  }

  /* Check the whole trace before starting ebb: a malformed trace costs no driver start-up. */
  trace t = {0};
  int rc = trace_load(path, nstreams, &t);
  if (rc != 0) goto out_trace;

  /* Replay never touches the memory: with commit at allocation off the emulated device only
   * maps address space, so a large capacity costs nothing and keeps big traces from failing on
   * the default capacity (nor does the replay's time include committing pages). The user's own
   * settings win. */
  setenv("EBB_SIM_MEM", "64G", 0);
  setenv("EBB_SIM_COMMIT", "0", 0);
  if (expandable >= 0) {
    /* Appended to the user's EBB_ALLOC_CONF: the parser reads keys in order. */
    const char *conf = getenv("EBB_ALLOC_CONF");
    char buf[512]; /* ebb reads at most 511 characters of it */
    const char *sep = conf && *conf ? "," : "";
    int n = snprintf(buf, sizeof buf, "%s%sexpandable_segments:%d", conf ? conf : "", sep, expandable);
    if (n < 0 || (size_t)n >= sizeof buf) {
      /* Cut short, the key (or all but its comma) would be lost and the replay would run the
       * other kind of segments without a word. */
      fprintf(stderr, PROG ": %s: EBB_ALLOC_CONF has no room for '%sexpandable_segments:%d' (at most %zu characters in all)\n",
              expandable ? "--expandable" : "--classic", sep, expandable, sizeof buf - 1);
      rc = 2;
      goto out_trace;
    }
    setenv("EBB_ALLOC_CONF", buf, 1);
  }

  ebb_status st = ebb_init();
  if (st != EBB_OK) {
    fprintf(stderr, PROG ": ebb_init failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
    rc = 1;
    goto out_trace;
  }

  ebb_stream_t *streams[MAX_STREAMS] = {0};
  void **ptrs = calloc(t.nallocs ? t.nallocs : 1, sizeof *ptrs);
  if (ptrs == NULL) {
    fprintf(stderr, PROG ": out of host memory for %" PRIu64 " blocks\n", t.nallocs);
    rc = 1;
    goto out_ebb;
  }
  for (unsigned s = 0; s < nstreams; s++) {
    st = ebb_stream_create(0, EBB_PRIO_LOW, &streams[s]);
    if (st != EBB_OK) {
      fprintf(stderr, PROG ": ebb_stream_create failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
      rc = 1;
      goto out_streams;
    }
  }

  uint64_t ns = 0;
  rc = replay(strcmp(path, "-") == 0 ? "stdin" : path, &t, streams, ptrs, &ns, peak_snapshot);

  ebb_arena_stats stats;
  if (rc == 0) {
    st = ebb_arena_get_stats(0, &stats);
    if (st != EBB_OK) {
      fprintf(stderr, PROG ": ebb_arena_get_stats failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
      rc = 1;
    }
  }
  if (rc == 0) {
    uint64_t ops = t.nallocs + t.nfrees;
    double ratio = t.peak_requested ? (double)stats.reserved_bytes.peak / (double)t.peak_requested : 0.0;
    printf("peak_requested=%" PRIu64 " peak_reserved=%" PRIu64 " frag_ratio=%.3f ns_per_op=%.1f allocs=%" PRIu64
           " driver_allocs=%" PRIu64 "\n",
           t.peak_requested, stats.reserved_bytes.peak, ratio, ops ? (double)ns / (double)ops : 0.0, t.nallocs,
           stats.num_device_alloc);
  }

  /* Blocks the trace never freed go back before the streams and ebb itself. */
  for (uint64_t i = 0; i < t.nallocs; i++) {
    if (ptrs[i] == NULL) continue;
    st = ebb_arena_free(ptrs[i]);
    if (st != EBB_OK && rc == 0) {
      fprintf(stderr, PROG ": ebb_arena_free failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
      rc = 1;
    }
  }
out_streams:
  for (unsigned s = 0; s < nstreams; s++) {
    if (streams[s] == NULL) continue;
    st = ebb_stream_release(streams[s]);
    if (st != EBB_OK && rc == 0) {
      fprintf(stderr, PROG ": ebb_stream_release failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
      rc = 1;
    }
  }
  free(ptrs);
out_ebb:
  st = ebb_shutdown();
  if (st != EBB_OK && rc == 0) {
    fprintf(stderr, PROG ": ebb_shutdown failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
    rc = 1;
  }
  if (fflush(stdout) != 0 && rc == 0) rc = 1;
out_trace:
  free(t.ev);
  return rc;
}
