/* bench_copy.c: bandwidth of ebb_copy_async against memcpy of the same bytes.
 *
 * Directions h2d, d2h and d2d on device 0, host memory pinned (ebb__drv_pinned_alloc) or pageable
 * (malloc, staged by ebb through pinned chunks), sizes 4 KiB to 64 MiB by factors of 4. Each
 * figure is `count` copies on one pool stream and one synchronize, median of `reps` runs; the
 * baseline is memcpy between two touched malloc buffers of the same size, measured before
 * ebb_init so the driver's threads do not share the cores with it. On the emulated driver
 * both sides are CPU copies, so the ratio is ebb's overhead (target >= 0.8 from 1 MiB).
 * Run it without EBB_SIM_COPY_GBPS: the emulated link model would make copies take the time it
 * prescribes, not what they cost (the program warns and labels its lines when it is set).
 * Each line also gives first_gbps: the warm-up copy alone, the first into its destination since
 * the destination was allocated for h2d/pinned (device buffer d0) and d2d (d1), so it shows
 * whether fresh driver memory costs more on first use (page faults of uncommitted memory).
 * Prints: bench=copy dir=h2d host=pinned bytes=N gbps=X memcpy_gbps=Y ratio=X/Y first_gbps=F
 *
 * Then the cost of enqueueing one small copy (512 B device to device, `ENQ_COUNT` enqueues timed
 * without a synchronize among them, median of `reps` runs), by what the copy touches, so the
 * arena's copy hook (a copy records its stream on the arena and pinned blocks it touches) shows
 * as the difference to driver memory:
 *   bench=copy_enqueue mem=driver|arena_own|arena_foreign|arena_interior|pinned ns_per_copy=X
 * driver: memory from the driver, no block of any arena (the hook finds nothing); arena_own:
 * arena blocks of the copy's stream (nothing to record); arena_foreign: blocks of another stream
 * (recorded at the first copy, found recorded after); arena_interior: the same inside a 4 MiB
 * block (its start found through the address map); pinned: a pinned source (its use recorded).
 * usage: ebb-bench-copy [max_bytes] [reps]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "runtime_export.h" /* the driver seam (ebb__drv_*), internal */
#include "ebb/stream.h"

#define MIN_BYTES ((size_t)4 << 10)
#define DEFAULT_MAX_BYTES ((size_t)64 << 20)
#define TARGET_BYTES ((size_t)256 << 20) /* bytes moved per measured run */

static const char *g_model = "off";

/* Copies needed to move about TARGET_BYTES, at least 4 and at most 20000. */
static long copies_for(size_t bytes) {
  size_t n = TARGET_BYTES / bytes;
  return n < 4 ? 4 : n > 20000 ? 20000 : (long)n;
}

static double gbps(size_t bytes, long count, uint64_t ns) {
  return (double)bytes * (double)count / (double)ns; /* bytes per ns = GB/s */
}

/* The baseline: memcpy through a pointer the compiler cannot drop as a dead store. */
static double memcpy_gbps(size_t bytes, int reps) {
  void *(*volatile mc)(void *, const void *, size_t) = memcpy;
  char *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b) {
    fprintf(stderr, "ebb-bench-copy: malloc(%zu) failed\n", bytes);
    exit(1);
  }
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  long count = copies_for(bytes);
  double v[64];
  mc(b, a, bytes);
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < count; i++) mc(b, a, bytes);
    v[r] = gbps(bytes, count, bench_now_ns() - t0);
  }
  free(a);
  free(b);
  return bench_median(v, (size_t)reps);
}

static double g_first_gbps; /* the last copy_gbps call's warm-up copy */

static double copy_gbps(void *dst, const void *src, size_t bytes, ebb_stream_t *s, int reps) {
  long count = copies_for(bytes);
  double v[64];
  uint64_t w0 = bench_now_ns();
  BENCH_CHECK(ebb_copy_async(dst, src, bytes, s)); /* warm-up: staging chunks, first touch */
  BENCH_CHECK(ebb_stream_synchronize(s));
  g_first_gbps = gbps(bytes, 1, bench_now_ns() - w0);
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < count; i++) BENCH_CHECK(ebb_copy_async(dst, src, bytes, s));
    BENCH_CHECK(ebb_stream_synchronize(s));
    v[r] = gbps(bytes, count, bench_now_ns() - t0);
  }
  return bench_median(v, (size_t)reps);
}

static void report(const char *dir, const char *host, size_t bytes, double g, double m) {
  printf("bench=copy dir=%s host=%s bytes=%zu gbps=%.2f memcpy_gbps=%.2f ratio=%.2f first_gbps=%.2f%s%s\n", dir,
         host, bytes, g, m, g / m, g_first_gbps, strcmp(g_model, "off") ? " timing_model=" : "",
         strcmp(g_model, "off") ? g_model : "");
}

static void *dev_ptr(uint64_t d) { return (void *)(uintptr_t)d; }

#define ENQ_BYTES ((size_t)512)
#define ENQ_COUNT 2000L

/* ns per ebb_copy_async of ENQ_BYTES from src to dst on s, the enqueue alone (the synchronize
 * after each run is not timed). */
__attribute__((noinline)) static double enqueue_ns(void *dst, const void *src, ebb_stream_t *s, int reps) {
  double v[64];
  BENCH_CHECK(ebb_copy_async(dst, src, ENQ_BYTES, s));
  BENCH_CHECK(ebb_stream_synchronize(s));
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < ENQ_COUNT; i++) BENCH_CHECK(ebb_copy_async(dst, src, ENQ_BYTES, s));
    v[r] = (double)(bench_now_ns() - t0) / (double)ENQ_COUNT;
    BENCH_CHECK(ebb_stream_synchronize(s));
  }
  return bench_median(v, (size_t)reps);
}

static void enqueue_costs(ebb_stream_t *s, int reps) {
  ebb_stream_t *other;
  BENCH_CHECK(ebb_stream_create(0, EBB_PRIO_LOW, &other));
  uint64_t d0, d1;
  BENCH_CHECK(ebb__drv_mem_alloc(0, ENQ_BYTES, &d0));
  BENCH_CHECK(ebb__drv_mem_alloc(0, ENQ_BYTES, &d1));
  void *own0, *own1, *f0, *f1, *big0, *big1, *pin;
  BENCH_CHECK(ebb_arena_alloc(0, ENQ_BYTES, s, &own0));
  BENCH_CHECK(ebb_arena_alloc(0, ENQ_BYTES, s, &own1));
  BENCH_CHECK(ebb_arena_alloc(0, ENQ_BYTES, other, &f0));
  BENCH_CHECK(ebb_arena_alloc(0, ENQ_BYTES, other, &f1));
  BENCH_CHECK(ebb_arena_alloc(0, (size_t)4 << 20, other, &big0));
  BENCH_CHECK(ebb_arena_alloc(0, (size_t)4 << 20, other, &big1));
  BENCH_CHECK(ebb_pinned_alloc(ENQ_BYTES, 0, &pin));
  memset(pin, 3, ENQ_BYTES);
  struct {
    const char *mem;
    void *dst;
    const void *src;
  } cases[] = {
      {"driver", dev_ptr(d1), dev_ptr(d0)},
      {"arena_own", own1, own0},
      {"arena_foreign", f1, f0},
      {"arena_interior", (char *)big1 + 4096, (char *)big0 + 4096},
      {"pinned", own1, pin},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    printf("bench=copy_enqueue mem=%s bytes=%zu ns_per_copy=%.1f%s%s\n", cases[i].mem, ENQ_BYTES,
           enqueue_ns(cases[i].dst, cases[i].src, s, reps), strcmp(g_model, "off") ? " timing_model=" : "",
           strcmp(g_model, "off") ? g_model : "");
  BENCH_CHECK(ebb_stream_synchronize(s));
  BENCH_CHECK(ebb_pinned_free(pin));
  void *blocks[] = {own0, own1, f0, f1, big0, big1};
  for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) BENCH_CHECK(ebb_arena_free(blocks[i]));
  BENCH_CHECK(ebb__drv_mem_free(0, d0));
  BENCH_CHECK(ebb__drv_mem_free(0, d1));
  BENCH_CHECK(ebb_stream_release(other));
}

int main(int argc, char **argv) {
  size_t max_bytes = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : DEFAULT_MAX_BYTES;
  int reps = argc > 2 ? (int)strtol(argv[2], NULL, 10) : 3;
  if (max_bytes < MIN_BYTES || reps <= 0 || reps > 64) {
    fprintf(stderr, "usage: ebb-bench-copy [max_bytes >= 4096] [reps 1..64]\n");
    return 2;
  }
  const char *model = getenv("EBB_SIM_COPY_GBPS");
  if (model && *model) {
    g_model = model;
    fprintf(stderr, "ebb-bench-copy: warning: EBB_SIM_COPY_GBPS=%s is set; copies follow the "
                    "emulated link model, not their real cost (unset it for the ratio to memcpy)\n",
            model);
  }

  /* The memcpy baselines first, in a quiet process: once ebb is up, the emulated driver's
   * threads share the machine's cores, and a baseline taken then measures them too. */
  double base[16];
  int nsizes = 0;
  for (size_t bytes = MIN_BYTES; bytes <= max_bytes && nsizes < 16; bytes *= 4)
    base[nsizes++] = memcpy_gbps(bytes, reps);

  BENCH_CHECK(ebb_init());
  ebb_stream_t *s;
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s));

  int si = 0;
  for (size_t bytes = MIN_BYTES; si < nsizes; bytes *= 4, si++) {
    uint64_t d0, d1;
    void *pin_a, *pin_b;
    BENCH_CHECK(ebb__drv_mem_alloc(0, bytes, &d0));
    BENCH_CHECK(ebb__drv_mem_alloc(0, bytes, &d1));
    BENCH_CHECK(ebb__drv_pinned_alloc(0, bytes, &pin_a));
    BENCH_CHECK(ebb__drv_pinned_alloc(0, bytes, &pin_b));
    char *pg_a = malloc(bytes), *pg_b = malloc(bytes);
    if (!pg_a || !pg_b) {
      fprintf(stderr, "ebb-bench-copy: malloc(%zu) failed\n", bytes);
      return 1;
    }
    /* Touch every page so no figure includes first-touch page faults. */
    for (size_t i = 0; i < bytes; i++) ((char *)pin_a)[i] = (char)(i * 7);
    memset(pin_b, 0, bytes);
    memcpy(pg_a, pin_a, bytes);
    memset(pg_b, 0, bytes);

    double m = base[si];
    report("h2d", "pinned", bytes, copy_gbps(dev_ptr(d0), pin_a, bytes, s, reps), m);
    report("h2d", "pageable", bytes, copy_gbps(dev_ptr(d0), pg_a, bytes, s, reps), m);
    report("d2d", "none", bytes, copy_gbps(dev_ptr(d1), dev_ptr(d0), bytes, s, reps), m);
    report("d2h", "pinned", bytes, copy_gbps(pin_b, dev_ptr(d1), bytes, s, reps), m);
    report("d2h", "pageable", bytes, copy_gbps(pg_b, dev_ptr(d1), bytes, s, reps), m);

    /* The bytes went host -> d0 -> d1 -> host: both round trips must give back what was sent,
     * or the figures above measured a copy that did not happen. */
    if (memcmp(pin_a, pin_b, bytes) != 0 || memcmp(pg_a, pg_b, bytes) != 0) {
      fprintf(stderr, "ebb-bench-copy: data mismatch after the round trip at %zu bytes\n", bytes);
      return 1;
    }

    free(pg_a);
    free(pg_b);
    BENCH_CHECK(ebb__drv_pinned_free(0, pin_a));
    BENCH_CHECK(ebb__drv_pinned_free(0, pin_b));
    BENCH_CHECK(ebb__drv_mem_free(0, d0));
    BENCH_CHECK(ebb__drv_mem_free(0, d1));
  }

  enqueue_costs(s, reps);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
