/* trace.c: the trace ring, the track names, and the Chrome/Perfetto JSON export.
 *
 * Off: EBB_TRACE_ON() reads one int and branches (predicted not taken). On: a writer takes a
 * ticket with one relaxed fetch_add on the head counter and claims its slot with one
 * compare-and-swap of the slot's sequence word (odd while written, even once complete), which
 * fails only where another writer is mid-write in that slot a lap away (the record is then
 * dropped); the exporter copies a slot only if it reads the same complete sequence before and
 * after, so it never keeps a torn record. The ring is replaced only by
 * enable/disable, which callers must not race with writers on other threads (documented in
 * trace.h: enable before the work, export after).
 *
 * Track names (threads', streams') live beside the ring in two small tables that survive
 * ebb_trace_enable and wrap-around: a thread or stream is named once, when it starts, whether
 * tracing is on or not, and its records made much later still find the name.
 *
 * The export copies the ring, sorts the records by track and start (spans: longer first), cuts
 * a span that would overlap its enclosing one on the same track, and writes one JSON event per
 * record after the metadata naming processes and tracks.
 *
 * Threading: writers are lock-free; enable, disable, intern, naming and export take the trace
 * lock (nothing else is taken under it but malloc and stdio).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ebb/trace.h"
#include "runtime_impl.h"

typedef struct ebb__tslot {
  _Atomic uint64_t seq; /* 2t+1 while ticket t writes, 2t+2 once written; 0 = never written */
  ebb_trace_span rec;
} ebb__tslot;

int ebb__trace_on;
static ebb_mutex ebb__trace_lock = {PTHREAD_MUTEX_INITIALIZER, "trace", EBB_RANK_TRACE};
static ebb__tslot *ebb__ring;
static size_t ebb__mask;
static _Atomic uint64_t ebb__head;
static atomic_uint ebb__next_tid;
static _Atomic uint64_t ebb__next_flow;
static _Thread_local uint32_t ebb__tid;
static _Thread_local bool ebb__named; /* this thread's track has a name: the default is a no-op */

/* Interned names: a simple list, written under the lock, never freed (names are few). */
typedef struct ebb__name {
  struct ebb__name *next;
  char s[];
} ebb__name;
static ebb__name *ebb__names;

/* Track names, under the lock, never freed (threads and streams of a process are few; a table
 * past EBB__TRACKS_MAX entries names no more, and the export falls back to a number). */
#define EBB__TRACKS_MAX 4096u
#define EBB__TRACK_NAME 64u
typedef struct ebb__track {
  int device;      /* streams: its device; threads: -1 */
  uint64_t key;    /* streams: the driver handle; threads: the tid */
  char name[EBB__TRACK_NAME];
} ebb__track;
static struct {
  ebb__track *a;
  size_t n, cap;
} ebb__tracks;

uint64_t ebb_trace_now_ns(void) { return ebb__now_ns(); }

bool ebb_trace_enabled(void) { return __atomic_load_n(&ebb__trace_on, __ATOMIC_RELAXED) != 0; }

ebb_status ebb_trace_enable(size_t capacity) {
  if (capacity == 0) return ebb__fail(EBB_EINVAL, "ebb_trace_enable: capacity 0; expected the number of records to keep (>= 1)");
  size_t cap = 64;
  while (cap < capacity && cap < ((size_t)1 << 30)) cap <<= 1;
  ebb__tslot *ring = calloc(cap, sizeof *ring);
  if (!ring) return ebb__fail(EBB_ENOMEM, "ebb_trace_enable: no memory for %zu records", cap);
  ebb__mutex_lock(&ebb__trace_lock);
  __atomic_store_n(&ebb__trace_on, 0, __ATOMIC_RELAXED);
  free(ebb__ring);
  ebb__ring = ring;
  ebb__mask = cap - 1;
  atomic_store_explicit(&ebb__head, 0, memory_order_relaxed);
  /* release: writers that see the flag (acquire in trace_put) see the new ring. */
  __atomic_store_n(&ebb__trace_on, 1, __ATOMIC_RELEASE);
  ebb__mutex_unlock(&ebb__trace_lock);
  return EBB_OK;
}

void ebb_trace_disable(void) {
  ebb__mutex_lock(&ebb__trace_lock);
  __atomic_store_n(&ebb__trace_on, 0, __ATOMIC_RELAXED);
  ebb__mutex_unlock(&ebb__trace_lock);
}

static uint32_t my_tid(void) {
  if (EBB_UNLIKELY(ebb__tid == 0)) ebb__tid = atomic_fetch_add_explicit(&ebb__next_tid, 1, memory_order_relaxed) + 1;
  return ebb__tid;
}

/* Writes r into the next slot; r is valid. */
static void trace_put(const ebb_trace_span *r) {
  /* acquire: pairs with the release in ebb_trace_enable (ring pointer and mask). */
  if (!__atomic_load_n(&ebb__trace_on, __ATOMIC_ACQUIRE)) return;
  uint32_t tid = my_tid();
  uint64_t t = atomic_fetch_add_explicit(&ebb__head, 1, memory_order_relaxed);
  ebb__tslot *sl = &ebb__ring[t & ebb__mask];
  /* A slot's seq is 2t+1 while ticket t writes it and 2t+2 once that record is complete. A
   * writer claims the slot only from a complete older record (or an empty slot): one found
   * mid-write (a writer preempted there, perhaps a lap behind) or already newer is left alone
   * and this record is dropped, so no two writers ever fill one slot and an exporter that sees
   * the same complete seq before and after copying has an untorn record. */
  const uint64_t writing = 2 * t + 1;
  uint64_t v = atomic_load_explicit(&sl->seq, memory_order_relaxed);
  do {
    if ((v & 1) || v >= writing) return;
  } while (!atomic_compare_exchange_weak_explicit(&sl->seq, &v, writing, memory_order_acquire, memory_order_relaxed));
  /* Fields are stored atomically (relaxed): an exporter may read them while they change, and
   * discards the slot by its seq. */
  ebb_trace_span *d = &sl->rec;
  __atomic_store_n(&d->name, r->name ? r->name : "?", __ATOMIC_RELAXED);
  __atomic_store_n(&d->start_ns, r->start_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&d->end_ns, r->end_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&d->tid, tid, __ATOMIC_RELAXED);
  __atomic_store_n(&d->device, r->device, __ATOMIC_RELAXED);
  __atomic_store_n(&d->stream, r->stream, __ATOMIC_RELAXED);
  __atomic_store_n(&d->kind, r->kind, __ATOMIC_RELAXED);
  __atomic_store_n(&d->args, r->args, __ATOMIC_RELAXED);
  __atomic_store_n(&d->id, r->id, __ATOMIC_RELAXED);
  __atomic_store_n(&d->task, r->task, __ATOMIC_RELAXED);
  __atomic_store_n(&d->seq, r->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&d->bytes, r->bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&d->owner, r->owner, __ATOMIC_RELAXED);
  /* release: the exporter's acquire load of seq sees the fields written above. */
  atomic_store_explicit(&sl->seq, writing + 1, memory_order_release);
}

void ebb_trace_span_add(const char *name, int device, uint64_t stream, uint64_t start_ns, uint64_t end_ns) {
  if (!__atomic_load_n(&ebb__trace_on, __ATOMIC_RELAXED)) return;
  ebb_trace_span r = {.name = name, .start_ns = start_ns, .end_ns = end_ns < start_ns ? start_ns : end_ns,
                      .device = device, .stream = stream, .kind = EBB_TRACE_SPAN};
  trace_put(&r);
}

ebb_status ebb_trace_record(const ebb_trace_span *rec) {
  if (EBB_UNLIKELY(!rec)) return ebb__fail(EBB_EINVAL, "ebb_trace_record: rec is NULL; expected a record");
  if (EBB_UNLIKELY(rec->kind >= EBB_TRACE_KIND_COUNT))
    return ebb__fail(EBB_EINVAL, "ebb_trace_record: kind %u; expected an ebb_trace_kind (0..%d)", rec->kind, EBB_TRACE_KIND_COUNT - 1);
  if (EBB_UNLIKELY(rec->kind == EBB_TRACE_SPAN && rec->end_ns < rec->start_ns))
    return ebb__fail(EBB_EINVAL, "ebb_trace_record: span '%s' ends (%llu ns) before it starts (%llu ns); expected end_ns >= start_ns",
                     rec->name ? rec->name : "?", (unsigned long long)rec->end_ns, (unsigned long long)rec->start_ns);
  if (EBB_UNLIKELY((rec->kind == EBB_TRACE_FLOW_START || rec->kind == EBB_TRACE_FLOW_END) && rec->id == 0))
    return ebb__fail(EBB_EINVAL, "ebb_trace_record: flow '%s' has id 0; expected an id from ebb_trace_flow_id",
                     rec->name ? rec->name : "?");
  trace_put(rec);
  return EBB_OK;
}

uint64_t ebb_trace_flow_id(void) { return atomic_fetch_add_explicit(&ebb__next_flow, 1, memory_order_relaxed) + 1; }

/* The entry of (device, key), added when absent and there is room; NULL otherwise. Lock held. */
static ebb__track *track_get(int device, uint64_t key, bool add) {
  for (size_t i = 0; i < ebb__tracks.n; i++)
    if (ebb__tracks.a[i].device == device && ebb__tracks.a[i].key == key) return &ebb__tracks.a[i];
  if (!add || ebb__tracks.n == EBB__TRACKS_MAX) return NULL;
  if (ebb__tracks.n == ebb__tracks.cap) {
    size_t nc = ebb__tracks.cap ? ebb__tracks.cap * 2 : 32;
    ebb__track *na = realloc(ebb__tracks.a, nc * sizeof *na);
    if (!na) return NULL;
    ebb__tracks.a = na;
    ebb__tracks.cap = nc;
  }
  ebb__track *t = &ebb__tracks.a[ebb__tracks.n++];
  t->device = device;
  t->key = key;
  t->name[0] = '\0';
  return t;
}

/* Names track (device, key); keep: leave a name already there. */
static ebb_status track_name(const char *fn, int device, uint64_t key, const char *name, bool keep) {
  ebb__mutex_lock(&ebb__trace_lock);
  ebb__track *t = track_get(device, key, true);
  if (t && !(keep && t->name[0])) {
    /* A long name is cut on a character boundary: never inside a UTF-8 sequence, which would
     * leave a stray lead byte at the end. */
    size_t n = strnlen(name, sizeof t->name);
    if (n == sizeof t->name) {
      n--;
      while (n && ((unsigned char)name[n] & 0xC0) == 0x80) n--;
    }
    memcpy(t->name, name, n);
    t->name[n] = '\0';
  }
  ebb__mutex_unlock(&ebb__trace_lock);
  if (!t) return ebb__fail(EBB_ENOMEM, "%s: no room to name '%s' (no host memory, or %u tracks named already)", fn, name, EBB__TRACKS_MAX);
  if (device < 0) ebb__named = true;
  return EBB_OK;
}

ebb_status ebb_trace_thread_name(const char *name) {
  if (!name || !*name) return ebb__fail(EBB_EINVAL, "ebb_trace_thread_name: name is %s; expected a thread name", name ? "empty" : "NULL");
  return track_name("ebb_trace_thread_name", -1, my_tid(), name, false);
}

void ebb__trace_thread_name_default(const char *name) {
  if (ebb__named) return; /* (no lock per node of a backward on a named thread) */
  ebb__fail_mute(true);
  (void)track_name("ebb_trace_thread_name", -1, my_tid(), name, true);
  ebb__fail_mute(false);
}

ebb_status ebb_trace_stream_name(int device, uint64_t stream, const char *name) {
  if (device < 0 || device >= EBB_MAX_DEVICES)
    return ebb__fail(EBB_EINVAL, "ebb_trace_stream_name: device %d; expected 0 <= device < %d", device, EBB_MAX_DEVICES);
  if (!stream) return ebb__fail(EBB_EINVAL, "ebb_trace_stream_name: stream 0; expected a driver stream handle (0 is the thread's track)");
  if (!name || !*name) return ebb__fail(EBB_EINVAL, "ebb_trace_stream_name: name is %s; expected a track name", name ? "empty" : "NULL");
  return track_name("ebb_trace_stream_name", device, stream, name, false);
}

const char *ebb_trace_intern(const char *s) {
  if (!s) return NULL;
  ebb__mutex_lock(&ebb__trace_lock);
  for (ebb__name *n = ebb__names; n; n = n->next)
    if (strcmp(n->s, s) == 0) {
      ebb__mutex_unlock(&ebb__trace_lock);
      return n->s;
    }
  size_t len = strlen(s);
  ebb__name *n = malloc(sizeof *n + len + 1);
  if (n) {
    memcpy(n->s, s, len + 1);
    n->next = ebb__names;
    ebb__names = n;
  }
  ebb__mutex_unlock(&ebb__trace_lock);
  return n ? n->s : NULL;
}

/* Copies complete records oldest first. Caller holds the trace lock. */
static size_t trace_copy(ebb_trace_span *out, size_t max) {
  if (!ebb__ring) return 0;
  uint64_t head = atomic_load_explicit(&ebb__head, memory_order_relaxed);
  uint64_t cap = ebb__mask + 1;
  uint64_t first = head > cap ? head - cap : 0;
  size_t n = 0;
  for (uint64_t t = first; t < head && n < max; t++) {
    ebb__tslot *sl = &ebb__ring[t & ebb__mask];
    /* acquire: pairs with the writer's release store of seq. */
    if (atomic_load_explicit(&sl->seq, memory_order_acquire) != 2 * t + 2) continue;
    const ebb_trace_span *s = &sl->rec;
    ebb_trace_span r;
    r.name = __atomic_load_n(&s->name, __ATOMIC_RELAXED);
    r.start_ns = __atomic_load_n(&s->start_ns, __ATOMIC_RELAXED);
    r.end_ns = __atomic_load_n(&s->end_ns, __ATOMIC_RELAXED);
    r.tid = __atomic_load_n(&s->tid, __ATOMIC_RELAXED);
    r.device = __atomic_load_n(&s->device, __ATOMIC_RELAXED);
    r.stream = __atomic_load_n(&s->stream, __ATOMIC_RELAXED);
    r.kind = __atomic_load_n(&s->kind, __ATOMIC_RELAXED);
    r.args = __atomic_load_n(&s->args, __ATOMIC_RELAXED);
    r.id = __atomic_load_n(&s->id, __ATOMIC_RELAXED);
    r.task = __atomic_load_n(&s->task, __ATOMIC_RELAXED);
    r.seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
    r.bytes = __atomic_load_n(&s->bytes, __ATOMIC_RELAXED);
    r.owner = __atomic_load_n(&s->owner, __ATOMIC_RELAXED);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&sl->seq, memory_order_relaxed) != 2 * t + 2) continue; /* claimed meanwhile */
    out[n++] = r;
  }
  return n;
}

ebb_status ebb_trace_counts(size_t *held, uint64_t *dropped) {
  if (!held || !dropped) return ebb__fail(EBB_EINVAL, "ebb_trace_counts: held and dropped must be non-NULL");
  ebb__mutex_lock(&ebb__trace_lock);
  uint64_t head = atomic_load_explicit(&ebb__head, memory_order_relaxed);
  uint64_t cap = ebb__ring ? ebb__mask + 1 : 0;
  *held = (size_t)(head < cap ? head : cap);
  *dropped = head > cap ? head - cap : 0;
  ebb__mutex_unlock(&ebb__trace_lock);
  return EBB_OK;
}

ebb_status ebb_trace_snapshot(ebb_trace_span *out, size_t max, size_t *n) {
  if (!n || (!out && max)) return ebb__fail(EBB_EINVAL, "ebb_trace_snapshot: out (for max > 0) and n must be non-NULL");
  ebb__mutex_lock(&ebb__trace_lock);
  *n = trace_copy(out, max);
  ebb__mutex_unlock(&ebb__trace_lock);
  return EBB_OK;
}

/* ---- export ------------------------------------------------------------------------------------ */

/* A record placed on its track for the export. */
typedef struct ebb__ev {
  const ebb_trace_span *r;
  uint32_t pid;
  uint32_t tid;
  uint64_t end; /* spans: the end written (cut to the enclosing span's) */
} ebb__ev;

/* The host's process after the devices' (pid d + 1); none is 0, which trace viewers keep for the
 * idle process of system traces. */
#define EBB__HOST_PID ((uint32_t)EBB_MAX_DEVICES + 1)
#define EBB__STREAM_TID0 1000000u /* stream tracks' tids: above any thread's */

static uint32_t pid_of(int device) { return device >= 0 && device < EBB_MAX_DEVICES ? (uint32_t)device + 1 : EBB__HOST_PID; }

/* Track order, then start ascending; at one start, spans before points (a flow or instant at a
 * slice's first nanosecond binds to that slice) and longer spans first (the parent first). */
static int ev_cmp(const void *pa, const void *pb) {
  const ebb__ev *a = pa, *b = pb;
  if (a->pid != b->pid) return a->pid < b->pid ? -1 : 1;
  if (a->tid != b->tid) return a->tid < b->tid ? -1 : 1;
  if (a->r->start_ns != b->r->start_ns) return a->r->start_ns < b->r->start_ns ? -1 : 1;
  bool sa = a->r->kind == EBB_TRACE_SPAN, sb = b->r->kind == EBB_TRACE_SPAN;
  if (sa != sb) return sa ? -1 : 1;
  if (a->r->end_ns != b->r->end_ns) return a->r->end_ns > b->r->end_ns ? -1 : 1;
  return a->r < b->r ? -1 : a->r > b->r; /* ring order: a stable result */
}

/* A JSON string of caller text: quotes, backslashes and controls escaped, well-formed UTF-8
 * copied, and any other byte at or above 0x80 (Latin-1 text, a cut character) written as
 * \u00XX, so the file always parses. */
static void json_str(FILE *f, const char *s) {
  const unsigned char *c = (const unsigned char *)s;
  size_t n = strlen(s);
  fputc('"', f);
  while (n) {
    size_t k;
    if (*c == '"' || *c == '\\') {
      fprintf(f, "\\%c", *c);
      k = 1;
    } else if (*c < 0x20) {
      fprintf(f, "\\u%04x", *c);
      k = 1;
    } else if (*c < 0x80) {
      fputc(*c, f);
      k = 1;
    } else if ((k = ebb__utf8_seq(c, n)) != 0) {
      fwrite(c, 1, k, f);
    } else {
      fprintf(f, "\\u%04x", *c);
      k = 1;
    }
    c += k;
    n -= k;
  }
  fputc('"', f);
}

/* Microseconds since t0 with the nanoseconds as three decimals, exact (no double rounding). */
static void json_us(FILE *f, uint64_t ns) { fprintf(f, "%llu.%03u", (unsigned long long)(ns / 1000), (unsigned)(ns % 1000)); }

static void write_args(FILE *f, const ebb_trace_span *r) {
  fputs(",\"args\":{", f);
  bool first = true;
#define EBB__SEP() (first ? (first = false, "") : ",")
  if (r->kind == EBB_TRACE_COUNTER) {
    fprintf(f, "%s\"bytes\":%llu", EBB__SEP(), (unsigned long long)r->bytes);
  } else {
    fprintf(f, "%s\"device\":%d", EBB__SEP(), r->device);
    if (r->stream) fprintf(f, "%s\"stream\":\"0x%llx\"", EBB__SEP(), (unsigned long long)r->stream);
    if (r->args & EBB_TRACE_ARG_TASK) fprintf(f, "%s\"graph_task\":%llu", EBB__SEP(), (unsigned long long)r->task);
    if (r->args & EBB_TRACE_ARG_SEQ) fprintf(f, "%s\"seq\":%llu", EBB__SEP(), (unsigned long long)r->seq);
    if (r->args & EBB_TRACE_ARG_BYTES) fprintf(f, "%s\"bytes\":%llu", EBB__SEP(), (unsigned long long)r->bytes);
    if (r->owner) {
      fprintf(f, "%s\"owner\":", EBB__SEP());
      json_str(f, r->owner);
    }
  }
#undef EBB__SEP
  fputc('}', f);
}

static void write_event(FILE *f, const ebb__ev *e, uint64_t t0) {
  const ebb_trace_span *r = e->r;
  static const char *const ph[] = {"X", "i", "C", "s", "f"};
  fprintf(f, ",\n{\"ph\":\"%s\",\"name\":", ph[r->kind]);
  json_str(f, r->name ? r->name : "?");
  fprintf(f, ",\"pid\":%u", e->pid);
  if (r->kind != EBB_TRACE_COUNTER) fprintf(f, ",\"tid\":%u", e->tid);
  fputs(",\"ts\":", f);
  json_us(f, r->start_ns - t0);
  switch (r->kind) {
  case EBB_TRACE_SPAN:
    fputs(",\"dur\":", f);
    json_us(f, e->end - r->start_ns);
    break;
  case EBB_TRACE_INSTANT:
    fputs(",\"s\":\"t\"", f);
    break;
  case EBB_TRACE_FLOW_START:
  case EBB_TRACE_FLOW_END:
    /* One category for every flow: viewers pair "s" and "f" by (cat, id). "bp":"e" binds each
     * end to the slice enclosing it (by default an "f" binds to the next slice to begin). */
    fprintf(f, ",\"cat\":\"flow\",\"id\":%llu,\"bp\":\"e\"", (unsigned long long)r->id);
    break;
  default:
    break;
  }
  if (r->kind != EBB_TRACE_FLOW_START && r->kind != EBB_TRACE_FLOW_END) write_args(f, r);
  fputc('}', f);
}

static void write_meta(FILE *f, const char *what, uint32_t pid, const uint32_t *tid, const char *name) {
  fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"%s\",\"pid\":%u", what, pid);
  if (tid) fprintf(f, ",\"tid\":%u", *tid);
  fputs(",\"args\":{\"name\":", f);
  json_str(f, name);
  fputs("}}", f);
}

/* Writes the sorted events and their metadata. Caller holds the trace lock (for the track
 * names); streams[] are the distinct (device, handle) pairs, whose index gives the tid. */
static void write_all(FILE *f, ebb__ev *ev, size_t n, const ebb_trace_span *streams, size_t nstreams) {
  uint64_t t0 = UINT64_MAX;
  for (size_t i = 0; i < n; i++)
    if (ev[i].r->start_ns < t0) t0 = ev[i].r->start_ns;
  fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", f);
  fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%u,\"args\":{\"name\":\"host\"}}", EBB__HOST_PID);
  bool devs[EBB_MAX_DEVICES] = {false};
  for (size_t i = 0; i < n; i++)
    if (ev[i].pid != EBB__HOST_PID) devs[ev[i].pid - 1] = true;
  for (int d = 0; d < EBB_MAX_DEVICES; d++) {
    if (!devs[d]) continue;
    char nm[32];
    snprintf(nm, sizeof nm, "device %d", d);
    write_meta(f, "process_name", (uint32_t)d + 1, NULL, nm);
  }
  /* Thread tracks: every tid seen on the host. */
  uint32_t last = 0;
  for (size_t i = 0; i < n; i++) {
    if (ev[i].pid != EBB__HOST_PID || ev[i].tid == last) continue;
    last = ev[i].tid;
    const ebb__track *t = track_get(-1, last, false);
    char nm[EBB__TRACK_NAME];
    if (t && t->name[0]) snprintf(nm, sizeof nm, "%s", t->name);
    else snprintf(nm, sizeof nm, "thread %u", last);
    write_meta(f, "thread_name", EBB__HOST_PID, &last, nm);
  }
  for (size_t k = 0; k < nstreams; k++) {
    const ebb__track *t = track_get(streams[k].device, streams[k].stream, false);
    char nm[EBB__TRACK_NAME];
    if (t && t->name[0]) snprintf(nm, sizeof nm, "%s", t->name);
    else snprintf(nm, sizeof nm, "stream 0x%llx (device %d)", (unsigned long long)streams[k].stream, streams[k].device);
    uint32_t tid = EBB__STREAM_TID0 + (uint32_t)k;
    write_meta(f, "thread_name", pid_of(streams[k].device), &tid, nm);
  }
  for (size_t i = 0; i < n; i++) write_event(f, &ev[i], t0);
  fputs("\n]}\n", f);
}

/* Slices on one track nest: a span starting inside an open one and ending after it is cut at
 * its end. ev is sorted (ev_cmp). */
static void nest(ebb__ev *ev, size_t n) {
  uint64_t stack[64];
  int depth = 0;
  for (size_t i = 0; i < n; i++) {
    if (i && (ev[i].pid != ev[i - 1].pid || ev[i].tid != ev[i - 1].tid)) depth = 0;
    const ebb_trace_span *r = ev[i].r;
    ev[i].end = r->end_ns;
    if (r->kind != EBB_TRACE_SPAN) continue;
    while (depth && stack[depth - 1] <= r->start_ns) depth--;
    if (depth && ev[i].end > stack[depth - 1]) ev[i].end = stack[depth - 1];
    /* Deeper than the stack: the span is kept as it is (cut already), its children checked
     * against the deepest one kept. */
    if (depth < (int)EBB_ARRAY_LEN(stack)) stack[depth++] = ev[i].end;
  }
}

ebb_status ebb_trace_export_json(const char *path) {
  if (!path || !*path) return ebb__fail(EBB_EINVAL, "ebb_trace_export_json: path is %s; expected a file name", path ? "empty" : "NULL");
  ebb__mutex_lock(&ebb__trace_lock);
  /* Room for what the ring holds now (writers may add more meanwhile: trace_copy stops at cap). */
  uint64_t head = atomic_load_explicit(&ebb__head, memory_order_relaxed);
  size_t cap = ebb__ring ? (size_t)(head < ebb__mask + 1 ? head : ebb__mask + 1) : 0;
  ebb_trace_span *recs = malloc((cap ? cap : 1) * sizeof *recs);
  ebb__ev *ev = malloc((cap ? cap : 1) * sizeof *ev);
  ebb_trace_span *streams = malloc((cap ? cap : 1) * sizeof *streams);
  if (!recs || !ev || !streams) {
    ebb__mutex_unlock(&ebb__trace_lock);
    free(recs);
    free(ev);
    free(streams);
    return ebb__fail(EBB_ENOMEM, "ebb_trace_export_json: no memory to copy %zu records", cap);
  }
  size_t n = trace_copy(recs, cap), nstreams = 0;
  /* Place each record: on its stream's track (a tid per distinct (device, handle), in order of
   * first appearance), a counter in its device's process, the rest on its thread's track. */
  for (size_t i = 0; i < n; i++) {
    const ebb_trace_span *r = &recs[i];
    ev[i].r = r;
    ev[i].pid = r->kind == EBB_TRACE_COUNTER || r->stream ? pid_of(r->device) : EBB__HOST_PID;
    ev[i].tid = r->tid;
    if (r->stream && r->kind != EBB_TRACE_COUNTER) {
      size_t k = 0;
      while (k < nstreams && !(streams[k].stream == r->stream && streams[k].device == r->device)) k++;
      if (k == nstreams) streams[nstreams++] = *r;
      ev[i].tid = EBB__STREAM_TID0 + (uint32_t)k;
    }
  }
  qsort(ev, n, sizeof *ev, ev_cmp);
  nest(ev, n);
  FILE *f = fopen(path, "w");
  if (!f) {
    ebb__mutex_unlock(&ebb__trace_lock);
    free(recs);
    free(ev);
    free(streams);
    return ebb__fail(EBB_EIO, "ebb_trace_export_json: cannot open '%s' for writing", path);
  }
  write_all(f, ev, n, streams, nstreams);
  ebb__mutex_unlock(&ebb__trace_lock);
  bool bad = ferror(f) != 0;
  bad |= fclose(f) != 0;
  free(recs);
  free(ev);
  free(streams);
  if (bad) {
    unlink(path);
    return ebb__fail(EBB_EIO, "ebb_trace_export_json: writing '%s' failed (removed)", path);
  }
  return EBB_OK;
}

/* EBB_TRACE, checked by ebb_init (module.c). A ring that cannot be allocated leaves tracing off
 * and says so; ebb_init itself succeeds (tracing is an aid, not the job). */
void ebb__trace_init_from_env(void) {
  if (!ebb__rt_conf.trace_cap) return;
  ebb__fail_mute(true);
  if (ebb_trace_enable(ebb__rt_conf.trace_cap) != EBB_OK)
    ebb__warn("EBB_TRACE=%zu: %s; tracing stays off", ebb__rt_conf.trace_cap, ebb__muted_error());
  ebb__fail_mute(false);
}

/* EBB_TRACE_FILE: written by the last ebb_shutdown, which succeeds even when the file cannot be
 * written (the warning handler is told), leaving its caller's last error as it was. */
void ebb__trace_fini(void) {
  const char *path = ebb__rt_conf.trace_file;
  if (!ebb_trace_enabled() || !path[0]) return;
  ebb__fail_mute(true);
  if (ebb_trace_export_json(path) != EBB_OK) ebb__warn("%s", ebb__muted_error());
  ebb__fail_mute(false);
}
