/* trace.c: the span ring buffer and its Chrome/Perfetto JSON export.
 *
 * Off: EBB_TRACE_ON() reads one int and branches (predicted not taken). On: a writer claims a
 * slot with one relaxed fetch_add on the head counter and fills it; each slot carries a sequence
 * number written last with release, so the exporter (acquire) copies only slots whose content
 * is complete and skips the ones being overwritten. The ring is replaced only by
 * enable/disable, which callers must not race with writers on other threads (documented in
 * trace.h: enable before the work, export after).
 *
 * Threading: writers are lock-free; enable, disable, intern and export take the trace lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/trace.h"
#include "runtime_impl.h"

typedef struct ebb__slot {
  _Atomic uint64_t seq; /* claim ticket + 1 once written; 0 = never written */
  ebb_trace_span span;
} ebb__slot;

int ebb__trace_on;
static ebb_mutex ebb__trace_lock = {PTHREAD_MUTEX_INITIALIZER, "trace", EBB_RANK_TRACE};
static ebb__slot *ebb__ring;
static size_t ebb__mask;
static _Atomic uint64_t ebb__head;
static atomic_uint ebb__next_tid;
static _Thread_local uint32_t ebb__tid;

/* Interned names: a simple list, written under the lock, never freed (names are few). */
typedef struct ebb__name {
  struct ebb__name *next;
  char s[];
} ebb__name;
static ebb__name *ebb__names;

uint64_t ebb_trace_now_ns(void) { return ebb__now_ns(); }

bool ebb_trace_enabled(void) { return __atomic_load_n(&ebb__trace_on, __ATOMIC_RELAXED) != 0; }

ebb_status ebb_trace_enable(size_t capacity) {
  if (capacity == 0) return ebb__fail(EBB_EINVAL, "ebb_trace_enable: capacity 0; expected the number of spans to keep (>= 1)");
  size_t cap = 64;
  while (cap < capacity && cap < ((size_t)1 << 30)) cap <<= 1;
  ebb__slot *ring = calloc(cap, sizeof *ring);
  if (!ring) return ebb__fail(EBB_ENOMEM, "ebb_trace_enable: no memory for %zu spans", cap);
  ebb__mutex_lock(&ebb__trace_lock);
  __atomic_store_n(&ebb__trace_on, 0, __ATOMIC_RELAXED);
  free(ebb__ring);
  ebb__ring = ring;
  ebb__mask = cap - 1;
  atomic_store_explicit(&ebb__head, 0, memory_order_relaxed);
  /* release: writers that see the flag (acquire in span_add) see the new ring. */
  __atomic_store_n(&ebb__trace_on, 1, __ATOMIC_RELEASE);
  ebb__mutex_unlock(&ebb__trace_lock);
  return EBB_OK;
}

void ebb_trace_disable(void) {
  ebb__mutex_lock(&ebb__trace_lock);
  __atomic_store_n(&ebb__trace_on, 0, __ATOMIC_RELAXED);
  ebb__mutex_unlock(&ebb__trace_lock);
}

void ebb_trace_span_add(const char *name, int device, uint64_t stream, uint64_t start_ns, uint64_t end_ns) {
  /* acquire: pairs with the release in ebb_trace_enable (ring pointer and mask). */
  if (!__atomic_load_n(&ebb__trace_on, __ATOMIC_ACQUIRE)) return;
  if (EBB_UNLIKELY(ebb__tid == 0)) ebb__tid = atomic_fetch_add_explicit(&ebb__next_tid, 1, memory_order_relaxed) + 1;
  uint64_t t = atomic_fetch_add_explicit(&ebb__head, 1, memory_order_relaxed);
  ebb__slot *sl = &ebb__ring[t & ebb__mask];
  /* Invalidate first so an exporter never takes a half-written slot as complete. */
  atomic_store_explicit(&sl->seq, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  /* Fields are stored atomically (relaxed): after a wrap-around two writers may fill the same
   * slot at once; the seq check below and in the exporter discards such a slot. */
  __atomic_store_n(&sl->span.name, name ? name : "?", __ATOMIC_RELAXED);
  __atomic_store_n(&sl->span.start_ns, start_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&sl->span.end_ns, end_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&sl->span.tid, ebb__tid, __ATOMIC_RELAXED);
  __atomic_store_n(&sl->span.device, device, __ATOMIC_RELAXED);
  __atomic_store_n(&sl->span.stream, stream, __ATOMIC_RELAXED);
  /* release: the exporter's acquire load of seq sees the span fields written above. */
  atomic_store_explicit(&sl->seq, t + 1, memory_order_release);
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

/* Copies complete spans oldest first. Caller holds the trace lock. */
static size_t trace_copy(ebb_trace_span *out, size_t max) {
  if (!ebb__ring) return 0;
  uint64_t head = atomic_load_explicit(&ebb__head, memory_order_relaxed);
  uint64_t cap = ebb__mask + 1;
  uint64_t first = head > cap ? head - cap : 0;
  size_t n = 0;
  for (uint64_t t = first; t < head && n < max; t++) {
    ebb__slot *sl = &ebb__ring[t & ebb__mask];
    /* acquire: pairs with the writer's release store of seq. */
    if (atomic_load_explicit(&sl->seq, memory_order_acquire) != t + 1) continue;
    ebb_trace_span sp;
    sp.name = __atomic_load_n(&sl->span.name, __ATOMIC_RELAXED);
    sp.start_ns = __atomic_load_n(&sl->span.start_ns, __ATOMIC_RELAXED);
    sp.end_ns = __atomic_load_n(&sl->span.end_ns, __ATOMIC_RELAXED);
    sp.tid = __atomic_load_n(&sl->span.tid, __ATOMIC_RELAXED);
    sp.device = __atomic_load_n(&sl->span.device, __ATOMIC_RELAXED);
    sp.stream = __atomic_load_n(&sl->span.stream, __ATOMIC_RELAXED);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&sl->seq, memory_order_relaxed) != t + 1) continue; /* overwritten meanwhile */
    out[n++] = sp;
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

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

ebb_status ebb_trace_export_json(const char *path) {
  if (!path || !*path) return ebb__fail(EBB_EINVAL, "ebb_trace_export_json: path is %s; expected a file name", path ? "empty" : "NULL");
  ebb__mutex_lock(&ebb__trace_lock);
  size_t cap = ebb__ring ? ebb__mask + 1 : 0;
  ebb_trace_span *spans = cap ? malloc(cap * sizeof *spans) : NULL;
  if (cap && !spans) {
    ebb__mutex_unlock(&ebb__trace_lock);
    return ebb__fail(EBB_ENOMEM, "ebb_trace_export_json: no memory to copy %zu spans", cap);
  }
  size_t n = trace_copy(spans, cap);
  ebb__mutex_unlock(&ebb__trace_lock);
  FILE *f = fopen(path, "w");
  if (!f) {
    free(spans);
    return ebb__fail(EBB_EIO, "ebb_trace_export_json: cannot open '%s' for writing", path);
  }
  uint64_t t0 = n ? spans[0].start_ns : 0;
  for (size_t i = 0; i < n; i++)
    if (spans[i].start_ns < t0) t0 = spans[i].start_ns;
  fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", f);
  /* Process names: one track group per device, "host" for device -1. */
  bool seen[EBB_MAX_DEVICES + 1] = {false};
  bool first = true;
  for (size_t i = 0; i < n; i++) {
    int d = spans[i].device;
    int idx = d < 0 ? EBB_MAX_DEVICES : d < EBB_MAX_DEVICES ? d : EBB_MAX_DEVICES;
    if (seen[idx]) continue;
    seen[idx] = true;
    fprintf(f, "%s{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":", first ? "" : ",\n", d);
    char nm[32];
    if (d < 0) snprintf(nm, sizeof nm, "host");
    else snprintf(nm, sizeof nm, "device %d", d);
    json_str(f, nm);
    fputs("}}", f);
    first = false;
  }
  for (size_t i = 0; i < n; i++) {
    const ebb_trace_span *sp = &spans[i];
    uint64_t dur = sp->end_ns > sp->start_ns ? sp->end_ns - sp->start_ns : 0;
    fprintf(f, "%s{\"ph\":\"X\",\"name\":", first ? "" : ",\n");
    json_str(f, sp->name);
    fprintf(f, ",\"pid\":%d,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"stream\":\"0x%llx\"}}", sp->device, sp->tid,
            (double)(sp->start_ns - t0) / 1000.0, (double)dur / 1000.0, (unsigned long long)sp->stream);
    first = false;
  }
  fputs("\n]}\n", f);
  free(spans);
  if (fclose(f) != 0) return ebb__fail(EBB_EIO, "ebb_trace_export_json: writing '%s' failed", path);
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
