/* host.c: the pinned host pool and the plain host pool: two more upstreams under the arena
 * engine (arena.c), and the public ebb_pinned_* and ebb_host_* calls of ebb/alloc.h.
 *
 * Pinned: one arena per NUMA node that holds a device (its segments are pages bound to that
 * node through hwloc, then registered with cuMemHostRegister), plus one driver-placed arena
 * (cuMemHostAlloc) for requests without a device hint. Their blocks have no allocation stream:
 * every use is declared with ebb_pinned_record_stream, and a freed block waits in the engine's
 * pending queues for the events recorded at free time. The pinned_max_bytes cap is shared by
 * every pinned arena, counted in `held` by the upstream itself.
 *
 * Host: one arena over anonymous mmap'ed segments: the memory of CPU tensors. Never malloc:
 * libebb leaves its host program's allocator alone, and segments are cached like device ones.
 *
 * Threading: arenas serialise themselves; the upstream calls (driver, mmap, hwloc) run with
 * the arena lock dropped (arena.c), so no driver call is made under a lock. `held` is atomic.
 * Start and teardown run from module.c's, single-threaded by its phase word.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "arena_impl.h"

#define EBB__PIN_MAX (EBB_MAX_DEVICES + 1) /* the driver-placed arena + one per node with a device */
#define EBB__PAGE ((size_t)4096)

static struct {
  int npin;                              /* pinned arenas started (0: module down) */
  struct ebb__arena pin[EBB__PIN_MAX];   /* [0]: driver-placed; [1..]: one per NUMA node */
  int pin_of_dev[EBB_MAX_DEVICES];       /* device -> index in pin[] */
  int ndev;
  size_t cap;                            /* pinned_max_bytes; 0: none */
  _Atomic size_t held;                   /* pinned bytes obtained from the driver, all arenas */
  bool host_up;
  struct ebb__arena host;
} ebb__hp;

/* The allocation "stream" of pinned and host blocks: none. Every pinned block is in this one
 * stream pool of its arena, so a free with no recorded uses makes it reusable at once and one
 * with uses waits for their events (ebb_pinned_record_stream). */
static const struct ebb__stream_ref ebb__nostream = {.s = NULL, .id = 0, .device = -1};

/* ---- the pinned upstream -------------------------------------------------------------------- */

/* Up to 1 MiB: 2 MiB segments shared by small blocks. Above: a segment of exactly the request,
 * rounded to a page (PyTorch's host allocator doubles to a power of two: up to 2x waste). */
static size_t pin_segment_size(size_t r) {
  if (r <= EBB__SMALL_SIZE) return EBB__SMALL_SEGMENT;
  return (r + EBB__PAGE - 1) / EBB__PAGE * EBB__PAGE;
}

/* Counts `bytes` against the cap before asking the driver; false (with the message) past it. */
static ebb_status pin_charge(struct ebb__arena *a, size_t bytes) {
  /* relaxed: `held` is a counter checked against a cap, ordering nothing else. */
  size_t prev = atomic_fetch_add_explicit(&ebb__hp.held, bytes, memory_order_relaxed);
  if (!ebb__hp.cap || prev + bytes <= ebb__hp.cap) return EBB_OK;
  atomic_fetch_sub_explicit(&ebb__hp.held, bytes, memory_order_relaxed);
  char c[24], h[24], n[24];
  return ebb__fail(EBB_ELIMIT,
                   "the pinned pool would pass its cap: pinned_max_bytes %s, held %s, a new segment of %s needed for %s "
                   "(raise EBB_ALLOC_CONF=pinned_max_bytes or free pinned blocks)",
                   ebb__fmt_bytes(c, sizeof c, ebb__hp.cap), ebb__fmt_bytes(h, sizeof h, prev),
                   ebb__fmt_bytes(n, sizeof n, bytes), a->label);
}

static void pin_uncharge(size_t bytes) {
  atomic_fetch_sub_explicit(&ebb__hp.held, bytes, memory_order_relaxed);
}

/* Node arenas: hwloc-placed pages, then registered. The driver-placed arena: cuMemHostAlloc. */
static ebb_status pin_obtain(struct ebb__arena *a, size_t bytes, uint64_t *addr) {
  ebb_status st = pin_charge(a, bytes);
  if (st == EBB_ELIMIT) {
    /* The cap is the pool's, the cached segments each arena's: what the other arenas hold
     * free counts against this one's request until they give it back (a's own go in its
     * retry chain). Their locks are free to take: a's is dropped around this call. */
    size_t back = 0;
    for (int i = 0; i < ebb__hp.npin; i++)
      if (&ebb__hp.pin[i] != a) back += ebb__arena_trim(&ebb__hp.pin[i]);
    if (back) st = pin_charge(a, bytes);
  }
  if (st) return st;
  void *p = NULL;
  if (a->numa_node < 0) {
    st = ebb__drv_pinned_alloc(a->device, bytes, &p);
  } else {
    bool bound = false;
    st = ebb_numa_pages_alloc(a->device, bytes, &p, &bound);
    if (!st && (st = ebb__drv_host_register(a->device, p, bytes))) ebb_numa_pages_free(p, bytes);
  }
  if (st) {
    pin_uncharge(bytes);
    return st;
  }
  *addr = (uint64_t)(uintptr_t)p;
  return EBB_OK;
}

static ebb_status pin_release(struct ebb__arena *a, uint64_t addr, size_t bytes) {
  void *p = (void *)(uintptr_t)addr;
  ebb_status st;
  if (a->numa_node < 0) {
    st = ebb__drv_pinned_free(a->device, p);
  } else {
    st = ebb__drv_host_unregister(a->device, p);
    /* Unmapping pages the driver still holds pinned would be worse than leaking them. */
    if (!st) st = ebb_numa_pages_free(p, bytes);
  }
  if (!st) pin_uncharge(bytes);
  return st;
}

/* Host RAM for reports: what the system has, what is left. */
static ebb_status ram_info(struct ebb__arena *a, size_t *free_bytes, size_t *total_bytes) {
  (void)a;
  long pg = sysconf(_SC_PAGESIZE), tot = sysconf(_SC_PHYS_PAGES), av = sysconf(_SC_AVPHYS_PAGES);
  if (pg <= 0 || tot <= 0 || av < 0) return ebb__fail(EBB_ENOTSUP, "the system does not report its memory size");
  *free_bytes = (size_t)av * (size_t)pg;
  *total_bytes = (size_t)tot * (size_t)pg;
  return EBB_OK;
}

static const struct ebb__upstream ebb__pinned_upstream = {
    .name = "pinned",
    .alloc_fn = "ebb_pinned_alloc",
    .free_fn = "ebb_pinned_free",
    .kind = EBB__MEM_PINNED_POOL,
    .segment_size = pin_segment_size,
    .obtain = pin_obtain,
    .release = pin_release,
    .mem_info = ram_info,
};

/* ---- the host upstream ---------------------------------------------------------------------- */

/* A segment of whole 2 MiB pages (all but the near-capacity fallback: arena_impl.h) starts on a
 * 2 MiB boundary and asks for transparent huge pages: a CPU tensor of a few MiB then spans a few
 * TLB entries instead of a thousand, which a GEMM reading a matrix across its rows (OpenBLAS's
 * packing of a transposed operand) or a pass over a 4 MiB weight feels: 15-20% of an sgemm's
 * time on 1024x1024 f32 operands here (perf/JOURNAL.md). The mapping is made 2 MiB larger and
 * the ends outside the aligned range are unmapped, so host_release's munmap of (addr, bytes)
 * still matches it. The advice is only advice: where the system has huge pages off (or gives
 * none), the segment is ordinary pages and equally correct. */
#define EBB__HOST_HUGE ((size_t)2 << 20)

static ebb_status host_obtain(struct ebb__arena *a, size_t bytes, uint64_t *addr) {
  (void)a;
  const bool huge = bytes % EBB__HOST_HUGE == 0;
  const size_t span = huge ? bytes + EBB__HOST_HUGE : bytes;
  void *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return ebb__fail(EBB_ENOMEM, "the system has no %zu bytes of host memory left: %s", bytes, strerror(errno));
  if (huge) {
    const uintptr_t lo = (uintptr_t)p, start = (lo + EBB__HOST_HUGE - 1) & ~(uintptr_t)(EBB__HOST_HUGE - 1);
    const size_t head = start - lo, tail = span - head - bytes;
    /* best effort: a failed trim leaves those pages mapped and unused, never wrong */
    if (head) (void)munmap(p, head);
    if (tail) (void)munmap((void *)(start + bytes), tail);
    p = (void *)start;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
  }
  *addr = (uint64_t)(uintptr_t)p;
  return EBB_OK;
}

static ebb_status host_release(struct ebb__arena *a, uint64_t addr, size_t bytes) {
  (void)a;
  if (munmap((void *)(uintptr_t)addr, bytes) != 0)
    return ebb__fail(EBB_EINTERNAL, "munmap of a host segment (0x%" PRIx64 ", %zu bytes) failed: %s", addr, bytes,
                     strerror(errno));
  return EBB_OK;
}

static const struct ebb__upstream ebb__host_upstream = {
    .name = "host",
    .alloc_fn = "ebb_pageable_alloc",
    .free_fn = "ebb_pageable_free",
    .kind = EBB__MEM_HOST_POOL,
    .obtain = host_obtain,
    .release = host_release,
    .mem_info = ram_info,
};

/* ---- start and teardown --------------------------------------------------------------------- */

ebb_status ebb__hostpools_start(const struct ebb__conf *conf, int ndev) {
  size_t fr = 0, ram = 0;
  if (ram_info(NULL, &fr, &ram)) ram = 0;
  ebb__hp.cap = conf->pinned_max;
  atomic_store_explicit(&ebb__hp.held, 0, memory_order_relaxed);
  ebb__hp.ndev = ndev;
  /* [0]: driver-placed, made through device 0's context (cuMemHostAlloc PORTABLE: any device). */
  ebb__arena_init(&ebb__hp.pin[0], &ebb__pinned_upstream, 0, conf, ram);
  int npin = 1;
  for (int d = 0; d < ndev; d++) {
    ebb_topo t;
    int node = ebb_dev_get_topo(d, &t) == EBB_OK ? t.numa_node : -1;
    int k = 0;
    if (node >= 0) {
      for (k = 1; k < npin && ebb__hp.pin[k].numa_node != node; k++) {
      }
      if (k == npin) {
        struct ebb__arena *a = &ebb__hp.pin[npin++];
        ebb__arena_init(a, &ebb__pinned_upstream, d, conf, ram);
        a->numa_node = node;
        snprintf(a->label, sizeof a->label, "pinned pool (NUMA node %d)", node);
      }
    }
    ebb__hp.pin_of_dev[d] = k; /* unknown node: the driver-placed arena */
  }
  ebb__hp.npin = npin;
  ebb__arena_init(&ebb__hp.host, &ebb__host_upstream, -1, conf, ram);
  ebb__hp.host_up = true;
  return EBB_OK;
}

void ebb__hostpools_fini(void) {
  for (int i = 0; i < ebb__hp.npin; i++) ebb__arena_fini(&ebb__hp.pin[i]);
  ebb__hp.npin = 0;
  if (ebb__hp.host_up) ebb__arena_fini(&ebb__hp.host);
  ebb__hp.host_up = false;
}

struct ebb__arena *ebb__hostpool_nth(int i) {
  if (i < 0) return NULL;
  if (i < ebb__hp.npin) return &ebb__hp.pin[i];
  return i == ebb__hp.npin && ebb__hp.host_up ? &ebb__hp.host : NULL;
}

/* ---- public API ------------------------------------------------------------------------------ */

/* The stats of several arenas added field by field (pinned: one per NUMA node). Peaks are the
 * sums of each arena's peak: exact with one node, an upper bound with several. */
static void stats_sum(struct ebb__arena *arenas, int n, ebb_arena_stats *out) {
  memset(out, 0, sizeof *out);
  for (int i = 0; i < n; i++) {
    ebb_arena_stats s;
    ebb__arena_get_stats(&arenas[i], &s);
    ebb_arena_stat *dst[] = {&out->allocated_bytes, &out->reserved_bytes, &out->active_bytes, &out->requested_bytes,
                             &out->segments, &out->inactive_split, &out->inactive_split_bytes};
    const ebb_arena_stat *src[] = {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes,
                                   &s.segments, &s.inactive_split, &s.inactive_split_bytes};
    for (size_t k = 0; k < EBB_ARRAY_LEN(dst); k++) {
      dst[k]->current += src[k]->current;
      dst[k]->peak += src[k]->peak;
    }
    out->alloc_count += s.alloc_count;
    out->free_count += s.free_count;
    out->cache_hits += s.cache_hits;
    out->num_alloc_retries += s.num_alloc_retries;
    out->num_ooms += s.num_ooms;
    out->num_syncs += s.num_syncs;
    out->num_steals += s.num_steals;
    out->num_pending_waits += s.num_pending_waits;
    out->num_device_alloc += s.num_device_alloc;
    out->num_device_free += s.num_device_free;
  }
}

ebb_status ebb_pinned_alloc(size_t bytes, int device_hint, void **ptr) {
  static const char fn[] = "ebb_pinned_alloc";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (EBB_UNLIKELY(!ptr)) return ebb__fail(EBB_EINVAL, "%s: ptr is NULL; expected a void * to fill", fn);
  if (EBB_UNLIKELY(device_hint < -1 || device_hint >= ebb__hp.ndev))
    return ebb__fail(EBB_EDEVICE, "%s: device_hint %d is not valid; expected -1 (no preference) or a device in [0, %d)", fn,
                     device_hint, ebb__hp.ndev);
  if (bytes == 0) {
    *ptr = NULL;
    return EBB_OK;
  }
  struct ebb__arena *a = &ebb__hp.pin[device_hint < 0 ? 0 : ebb__hp.pin_of_dev[device_hint]];
  st = ebb__arena_alloc(a, bytes, &ebb__nostream, ptr);
  if (st == EBB_ELIMIT) {
    char why[400];
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: %zu bytes for device hint %d refused: %s", fn, bytes, device_hint, why);
  }
  return st;
}

ebb_status ebb_pinned_free(void *ptr) {
  static const char fn[] = "ebb_pinned_free";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return EBB_OK;
  return ebb__arena_free(fn, ptr, EBB__MEM_PINNED_POOL);
}

ebb_status ebb_pinned_record_stream(void *ptr, ebb_stream_t *stream) {
  static const char fn[] = "ebb_pinned_record_stream";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return ebb__fail(EBB_EINVAL, "%s: pointer is NULL; expected a block from ebb_pinned_alloc", fn);
  if (!stream) return ebb__fail(EBB_EINVAL, "%s: stream is NULL; expected the stream that uses the block", fn);
  struct ebb__stream_ref s;
  if ((st = ebb__stream_ref(fn, stream, &s))) return st;
  return ebb__arena_record(fn, ptr, &s, EBB__MEM_PINNED_POOL);
}

ebb_status ebb_pinned_empty_cache(void) {
  ebb_status st = ebb__alloc_enter("ebb_pinned_empty_cache");
  for (int i = 0; !st && i < ebb__hp.npin; i++) st = ebb__arena_empty_cache(&ebb__hp.pin[i]);
  return st;
}

ebb_status ebb_pinned_get_stats(ebb_arena_stats *out) {
  static const char fn[] = "ebb_pinned_get_stats";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an ebb_arena_stats to fill", fn);
  stats_sum(ebb__hp.pin, ebb__hp.npin, out);
  out->limit = ebb__hp.cap;
  return EBB_OK;
}

ebb_status ebb_pageable_alloc(size_t bytes, void **ptr) {
  static const char fn[] = "ebb_pageable_alloc";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (EBB_UNLIKELY(!ptr)) return ebb__fail(EBB_EINVAL, "%s: ptr is NULL; expected a void * to fill", fn);
  if (bytes == 0) {
    *ptr = NULL;
    return EBB_OK;
  }
  return ebb__arena_alloc(&ebb__hp.host, bytes, &ebb__nostream, ptr);
}

ebb_status ebb_pageable_free(void *ptr) {
  static const char fn[] = "ebb_pageable_free";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return EBB_OK;
  return ebb__arena_free(fn, ptr, EBB__MEM_HOST_POOL);
}

ebb_status ebb_pageable_empty_cache(void) {
  ebb_status st = ebb__alloc_enter("ebb_pageable_empty_cache");
  if (st) return st;
  return ebb__arena_empty_cache(&ebb__hp.host);
}

ebb_status ebb_pageable_get_stats(ebb_arena_stats *out) {
  static const char fn[] = "ebb_pageable_get_stats";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an ebb_arena_stats to fill", fn);
  stats_sum(&ebb__hp.host, 1, out);
  return EBB_OK;
}

ebb_status ebb_pinned_debug_check(void) {
  static const char fn[] = "ebb_pinned_debug_check";
  ebb_status st = ebb__alloc_enter(fn);
  for (int i = 0; !st && i < ebb__hp.npin; i++) st = ebb__arena_check(&ebb__hp.pin[i], fn);
  return st;
}

ebb_status ebb_pageable_debug_check(void) {
  static const char fn[] = "ebb_pageable_debug_check";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  return ebb__arena_check(&ebb__hp.host, fn);
}
