/* bench_arena.c: the device arena's fast path (cache hit, one stream) against host allocators.
 *
 * One sequence of alloc+free pairs in random order is generated up front and replayed, timed, on
 * ebb_arena_alloc/free and on glibc, jemalloc and mimalloc, so every allocator sees the same
 * sizes in the same order. The live set is filled first; each pair then frees a random live
 * block and allocates a new size in its place. Two settings:
 *   dist=tensor  sizes log-uniform 512 B .. 64 MiB (512 B multiples), 1000 live blocks;
 *   dist=small   sizes log-uniform 512 B .. 64 KiB, 100000 live blocks.
 * Host allocators get the same sizes: they touch no memory (neither does the arena), so the
 * figures compare bookkeeping. The emulated device memory is never touched, so it is left
 * uncommitted (EBB_SIM_COMMIT=0: mmap'ed, faulted in at first touch) and EBB_SIM_MEM is raised to
 * 16 GiB per device for the ~9 GiB tensor working set.
 * glibc is reached through __libc_malloc/__libc_free (this program's malloc is jemalloc).
 * Each allocator replays the whole sequence (fill, pairs, free all) once untimed - the warm-up,
 * as the first step of a training loop - then three times more (EBB_BENCH_REPLAYS), each pass
 * timing its pairs after the fill and a first quarter. A training loop repeats its step's sequence, so after the
 * first replay an arena has met the sequence's demand peak; a driver allocation in a later
 * replay is fragmentation the arena did not absorb.
 * Output: `bench=arena_fastpath impl=... dist=... live=... ns_per_pair=... cpu_ns_per_pair=...`
 * (the best of the timed passes) and, for ebb, the driver allocations of the timed passes
 * after the warm-up replay (the target is 0), summed and per pass, with the allocated bytes'
 * peak of the warm-up and of the later passes and the configuration (classic or expandable
 * segments: EBB_ALLOC_CONF). ns_per_pair is wall time; cpu_ns_per_pair is the thread's CPU time
 * over the same pass, which leaves out the time the thread waited for a core (the machine is
 * shared: compare both).
 * Optional filters, for profiling one case: EBB_BENCH_IMPL=ebb (or glibc, jemalloc, mimalloc)
 * and EBB_BENCH_DIST=small (or tensor) run only the named implementation / distribution;
 * EBB_BENCH_SMALL_LIVE and EBB_BENCH_SMALL_PAIRS change dist=small's live blocks and pairs (the
 * free index's cost at 10^3 against 10^5 live blocks, or a short run under callgrind);
 * EBB_BENCH_SEED=N draws other sequences (each distribution's starts from the seed, so filters
 * do not change it); EBB_BENCH_REPLAYS=N (1-64, default 3) times N replays after the warm-up,
 * to see after how many replays the arena stops asking the driver for memory (set, it also
 * keeps a slow run - under valgrind - from being cut to one timed replay).
 * Before dist=small a `probe=cache_miss` line gives the machine's cost of one dependent load
 * into 1, 16 and 64 MiB (pointer chase): at 10^5 live blocks the metadata of any allocator is
 * megabytes, so the pair's cost is mostly such misses (EBB_BENCH_IMPL=probe runs only it).
 */
#define _GNU_SOURCE /* dlopen/dlsym of jemalloc's mallocx when it is not the process allocator */
#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mimalloc.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);

struct seq {
  size_t live;       /* blocks kept live */
  size_t pairs;      /* timed free+alloc pairs */
  size_t *fill;      /* sizes of the initial live set */
  size_t *size;      /* size of pair i's allocation */
  uint32_t *victim;  /* which live slot pair i frees */
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void) { /* xorshift64*: reproducible, no libc state */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static size_t log_uniform(double lo, double hi) {
  double u = (double)(rng_next() >> 11) / 9007199254740992.0;
  size_t s = (size_t)exp2(log2(lo) + u * (log2(hi) - log2(lo)));
  return (s + 511) / 512 * 512;
}

/* Each distribution's sequence starts from the same seed (EBB_BENCH_SEED, else fixed), whatever
 * ran before it, so a filtered run replays the same sequence as the full one. */
static void seq_make(struct seq *q, size_t live, size_t pairs, double lo, double hi) {
  const char *sv = getenv("EBB_BENCH_SEED");
  uint64_t seed = sv && *sv ? strtoull(sv, NULL, 0) : 0;
  rng_state = 0x9e3779b97f4a7c15ull ^ (seed * 0xbf58476d1ce4e5b9ull);
  if (!rng_state) rng_state = 1; /* xorshift's one fixed point */
  q->live = live;
  q->pairs = pairs;
  q->fill = malloc(live * sizeof *q->fill);
  q->size = malloc(pairs * sizeof *q->size);
  q->victim = malloc(pairs * sizeof *q->victim);
  if (!q->fill || !q->size || !q->victim) exit(1);
  for (size_t i = 0; i < live; i++) q->fill[i] = log_uniform(lo, hi);
  for (size_t i = 0; i < pairs; i++) {
    q->size[i] = log_uniform(lo, hi);
    q->victim[i] = (uint32_t)(rng_next() % live);
  }
}

/* One allocator as two function pointers over an opaque context. */
struct impl {
  const char *name;
  void *(*alloc)(size_t);
  void (*free)(void *);
};

static ebb_stream_t *g_stream;
static int g_device;
static bool g_expandable; /* the arena has expandable segments (the driver's default or EBB_ALLOC_CONF) */

static void *ebb_alloc_fn(size_t n) {
  void *p = NULL;
  BENCH_CHECK(ebb_arena_alloc(g_device, n, g_stream, &p));
  return p;
}
static void ebb_free_fn(void *p) { BENCH_CHECK(ebb_arena_free(p)); }
static void *glibc_alloc(size_t n) { return __libc_malloc(n); }
static void glibc_free(void *p) { __libc_free(p); }
static void *mi_alloc(size_t n) { return mi_malloc(n); }
static void mi_free_fn(void *p) { mi_free(p); }

static void *(*je_mallocx)(size_t, int);
static void (*je_dallocx)(void *, int);
static void *je_alloc(size_t n) { return je_mallocx(n, 0); }
static void je_free(void *p) { je_dallocx(p, 0); }

static uint64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Replays the sequence once: fill, a first quarter of the pairs, the timed rest, free all; ns per
 * timed pair. For the arena, *drv gets the driver allocations of the whole replay and *peak the
 * allocated bytes' peak over it. */
static double run(const struct impl *im, const struct seq *q, void **slots, bool is_ebb, uint64_t *drv, uint64_t *peak,
                  double *cpu) {
  ebb_arena_stats s0;
  if (is_ebb) {
    BENCH_CHECK(ebb_arena_reset_peak(g_device));
    BENCH_CHECK(ebb_arena_get_stats(g_device, &s0));
  }
  for (size_t i = 0; i < q->live; i++) {
    slots[i] = im->alloc(q->fill[i]);
    if (!slots[i]) exit(1);
  }
  size_t warm = q->pairs / 4;
  for (size_t i = 0; i < warm; i++) {
    uint32_t v = q->victim[i];
    im->free(slots[v]);
    slots[v] = im->alloc(q->size[i]);
  }
  uint64_t c0 = thread_cpu_ns();
  uint64_t t0 = bench_now_ns();
  for (size_t i = warm; i < q->pairs; i++) {
    uint32_t v = q->victim[i];
    im->free(slots[v]);
    slots[v] = im->alloc(q->size[i]);
  }
  uint64_t t1 = bench_now_ns();
  uint64_t c1 = thread_cpu_ns();
  *cpu = (double)(c1 - c0) / (double)(q->pairs - warm);
  for (size_t i = 0; i < q->live; i++) im->free(slots[i]);
  if (is_ebb) {
    ebb_arena_stats s1;
    BENCH_CHECK(ebb_arena_get_stats(g_device, &s1));
    *drv = s1.num_device_alloc - s0.num_device_alloc;
    *peak = s1.allocated_bytes.peak;
  }
  return (double)(t1 - t0) / (double)(q->pairs - warm);
}

/* Whether the filter variable `var` is unset or names `what`. */
static bool selected(const char *var, const char *what) {
  const char *v = getenv(var);
  return !v || !*v || !strcmp(v, what);
}

static void bench(const char *dist, size_t live, size_t pairs, double lo, double hi, const struct impl *ims, int nimpl) {
  if (!selected("EBB_BENCH_DIST", dist)) return;
  struct seq q;
  seq_make(&q, live, pairs, lo, hi);
  void **slots = calloc(live, sizeof *slots);
  if (!slots) exit(1);
  for (int k = 0; k < nimpl; k++) {
    const struct impl *im = &ims[k];
    if (!selected("EBB_BENCH_IMPL", im->name)) continue;
    bool is_ebb = !strcmp(im->name, "ebb");
    double best = 1e30, best_cpu = 1e30;
    uint64_t drv_warm = 0, peak_warm = 0, drv_pass[64] = {0}, peak_after = 0;
    const char *rv = getenv("EBB_BENCH_REPLAYS");
    int reps = rv && atoi(rv) > 0 ? atoi(rv) : 3;
    if (reps > 64) reps = 64;
    double cpu = 0;
    /* The warm-up replay: untimed. */
    run(im, &q, slots, is_ebb, &drv_warm, &peak_warm, &cpu);
    for (int rep = 0; rep < reps; rep++) {
      /* A slow allocator (glibc maps and unmaps every large block) gets one timed pass, unless
       * the replays were asked for (a run under valgrind is slow too, and must be complete). */
      if (rep > 0 && best > 20000.0 && !rv) break;
      uint64_t peak = 0;
      double ns = run(im, &q, slots, is_ebb, &drv_pass[rep], &peak, &cpu);
      if (peak > peak_after) peak_after = peak;
      if (ns < best) best = ns;
      if (cpu < best_cpu) best_cpu = cpu;
    }
    printf("bench=arena_fastpath impl=%s dist=%s live=%zu ns_per_pair=%.1f cpu_ns_per_pair=%.1f\n", im->name, dist, live,
           best, best_cpu);
    if (is_ebb) {
      char by[64 * 21] = "";
      uint64_t sum = 0;
      for (int r = 0, o = 0; r < reps; r++) {
        sum += drv_pass[r];
        o += snprintf(by + o, sizeof by - (size_t)o, "%s%llu", r ? "," : "", (unsigned long long)drv_pass[r]);
      }
      printf("bench=arena_fastpath impl=ebb dist=%s driver_allocs_after_warmup=%llu by_pass=%s "
             "warmup_driver_allocs=%llu warmup_alloc_peak=%llu alloc_peak_after=%llu segments=%s\n",
             dist, (unsigned long long)sum, by, (unsigned long long)drv_warm,
             (unsigned long long)peak_warm, (unsigned long long)peak_after,
             g_expandable ? "expandable" : "classic");
    }
    fflush(stdout);
  }
  free(slots);
  free(q.fill);
  free(q.size);
  free(q.victim);
}

/* The machine's cost of one cache miss: a dependent pointer chase over `mb` MiB in random order
 * (one load per 64-byte line), ns per load. dist=small's arena metadata is ~18 MB at 10^5 live
 * blocks, so this says how many misses per pair the figures leave room for. */
static double chase_ns_per_load(size_t mb) {
  size_t n = mb * 1024 * 1024 / 64, loads = 4000000;
  size_t *line = aligned_alloc(64, n * 64), *order = malloc(n * sizeof *order);
  if (!line || !order) exit(1);
  for (size_t i = 0; i < n; i++) order[i] = i;
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)(rng_next() % (i + 1)), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (size_t i = 0; i < n; i++) line[order[i] * 8] = order[(i + 1) % n] * 8;
  volatile size_t sink;
  size_t x = 0;
  uint64_t t0 = bench_now_ns();
  for (size_t i = 0; i < loads; i++) x = line[x];
  uint64_t t1 = bench_now_ns();
  sink = x;
  (void)sink;
  free(line);
  free(order);
  return (double)(t1 - t0) / (double)loads;
}

int main(void) {
  /* The emulated devices' memory is never touched here: left uncommitted, it costs only
   * address space (committed, the tensor working set would take ~9 GiB of the host). 16 GiB
   * holds that working set with either kind of segment, and the reservation of the default
   * expandable segments (1 1/8 of it) stays within what valgrind lets a program reserve. */
  setenv("EBB_SIM_MEM", "16G", 0);
  setenv("EBB_SIM_COMMIT", "0", 0);
  setenv("EBB_SIM_DEVICES", "2", 0);
  BENCH_CHECK(ebb_init());
  BENCH_CHECK(ebb_stream_default(g_device, &g_stream));
  /* Expandable segments where the driver has VMM, unless EBB_ALLOC_CONF says (alloc.h). */
  ebb_dev_caps caps;
  BENCH_CHECK(ebb_dev_get_caps(g_device, &caps));
  const char *conf = getenv("EBB_ALLOC_CONF");
  g_expandable = conf && strstr(conf, "expandable_segments:1") ? true
                 : conf && strstr(conf, "expandable_segments:0") ? false
                                                                 : caps.vmm;

  struct impl ims[4];
  int n = 0;
  ims[n++] = (struct impl){"ebb", ebb_alloc_fn, ebb_free_fn};
  ims[n++] = (struct impl){"glibc", glibc_alloc, glibc_free};
  /* jemalloc: the process allocator when linked (RTLD_DEFAULT finds mallocx), else dlopen'ed. */
  je_mallocx = (void *(*)(size_t, int))dlsym(RTLD_DEFAULT, "mallocx");
  je_dallocx = (void (*)(void *, int))dlsym(RTLD_DEFAULT, "dallocx");
  if (!je_mallocx || !je_dallocx) {
    void *h = dlopen("libjemalloc.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h) {
      je_mallocx = (void *(*)(size_t, int))dlsym(h, "mallocx");
      je_dallocx = (void (*)(void *, int))dlsym(h, "dallocx");
    }
  }
  if (je_mallocx && je_dallocx) ims[n++] = (struct impl){"jemalloc", je_alloc, je_free};
  else fprintf(stderr, "bench_arena: jemalloc not found; its lines are left out\n");
  ims[n++] = (struct impl){"mimalloc", mi_alloc, mi_free_fn};

  bench("tensor", 1000, 200000, 512.0, 64.0 * 1024 * 1024, ims, n);
  BENCH_CHECK(ebb_arena_empty_cache(g_device));
  const char *lv = getenv("EBB_BENCH_SMALL_LIVE"), *pv = getenv("EBB_BENCH_SMALL_PAIRS");
  size_t small_live = lv && atoll(lv) > 0 ? (size_t)atoll(lv) : 100000;
  size_t small_pairs = pv && atoll(pv) > 0 ? (size_t)atoll(pv) : 2000000;
  if (selected("EBB_BENCH_DIST", "small") && selected("EBB_BENCH_IMPL", "probe"))
    printf("bench=arena_fastpath probe=cache_miss ns_per_load_1mb=%.1f ns_per_load_16mb=%.1f ns_per_load_64mb=%.1f\n",
           chase_ns_per_load(1), chase_ns_per_load(16), chase_ns_per_load(64));
  bench("small", small_live, small_pairs, 512.0, 64.0 * 1024, ims, n);
  BENCH_CHECK(ebb_arena_empty_cache(g_device));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
