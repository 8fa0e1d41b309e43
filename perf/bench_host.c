/* bench_host.c: alloc + free of small host blocks through the arena engine's host pool (the
 * memory of CPU tensors) against the process allocators, in one run.
 *
 * One sequence of alloc+free pairs in random order is generated up front and replayed on
 * ebb_pageable_alloc/free, glibc (__libc_malloc/__libc_free: this program's malloc is jemalloc) and
 * jemalloc (mallocx/dallocx), so each sees the same sizes in the same order: sizes log-uniform
 * from 64 B to 64 KiB, 1000 blocks live; each pair frees a random live block and allocates the
 * next size in its place. Nobody touches the memory: the figures compare bookkeeping. The
 * first quarter of the pairs is warm-up; the best of three timed passes is printed:
 *   bench=host impl=<ebb|glibc|jemalloc> live=1000 ns_per_pair=<x>
 *   bench=host impl=ebb segments_after_warmup=<n>     (target 0: no mmap once warm)
 * usage: ebb-bench-host [pairs]
 */
#define _GNU_SOURCE /* dlsym(RTLD_DEFAULT) for jemalloc's mallocx */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/runtime.h"

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);

#define LIVE 1000

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rng_next(void) { /* xorshift64*: reproducible, no libc state */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static void *(*je_mallocx)(size_t, int);
static void (*je_dallocx)(void *, int);

static void *ebb_a(size_t n) {
  void *p = NULL;
  BENCH_CHECK(ebb_pageable_alloc(n, &p));
  return p;
}
static void ebb_f(void *p) { BENCH_CHECK(ebb_pageable_free(p)); }
static void *glibc_a(size_t n) { return __libc_malloc(n); }
static void glibc_f(void *p) { __libc_free(p); }
static void *je_a(size_t n) { return je_mallocx(n, 0); }
static void je_f(void *p) { je_dallocx(p, 0); }

struct impl {
  const char *name;
  void *(*alloc)(size_t);
  void (*free)(void *);
};

static uint64_t host_segments_made(void) {
  ebb_arena_stats s;
  BENCH_CHECK(ebb_pageable_get_stats(&s));
  return s.num_device_alloc;
}

int main(int argc, char **argv) {
  size_t pairs = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000000;
  if (pairs < 100) pairs = 100;
  BENCH_CHECK(ebb_init());
  size_t *fill = malloc(LIVE * sizeof *fill), *size = malloc(pairs * sizeof *size);
  uint32_t *victim = malloc(pairs * sizeof *victim);
  void **slot = malloc(LIVE * sizeof *slot);
  if (!fill || !size || !victim || !slot) return 1;
  for (size_t i = 0; i < LIVE + pairs; i++) {
    double u = (double)(rng_next() >> 11) / 9007199254740992.0;
    size_t s = (size_t)exp2(6.0 + u * 10.0); /* 2^6 .. 2^16 */
    if (i < LIVE) fill[i] = s;
    else size[i - LIVE] = s, victim[i - LIVE] = (uint32_t)(rng_next() % LIVE);
  }
  struct impl ims[3] = {{"ebb", ebb_a, ebb_f}, {"glibc", glibc_a, glibc_f}, {NULL, NULL, NULL}};
  je_mallocx = (void *(*)(size_t, int))dlsym(RTLD_DEFAULT, "mallocx");
  je_dallocx = (void (*)(void *, int))dlsym(RTLD_DEFAULT, "dallocx");
  if (je_mallocx && je_dallocx) ims[2] = (struct impl){"jemalloc", je_a, je_f};
  else fprintf(stderr, "ebb-bench-host: jemalloc is not this program's allocator; its line is left out\n");
  for (int k = 0; k < 3 && ims[k].name; k++) {
    const struct impl *im = &ims[k];
    double best = 1e30;
    uint64_t seg_after_warm = 0;
    for (int rep = 0; rep < 3; rep++) {
      for (size_t i = 0; i < LIVE; i++) slot[i] = im->alloc(fill[i]);
      size_t warm = pairs / 4;
      for (size_t i = 0; i < warm; i++) {
        im->free(slot[victim[i]]);
        slot[victim[i]] = im->alloc(size[i]);
      }
      uint64_t s0 = k == 0 ? host_segments_made() : 0;
      uint64_t t0 = bench_now_ns();
      for (size_t i = warm; i < pairs; i++) {
        im->free(slot[victim[i]]);
        slot[victim[i]] = im->alloc(size[i]);
      }
      uint64_t t1 = bench_now_ns();
      if (k == 0) seg_after_warm += host_segments_made() - s0;
      for (size_t i = 0; i < LIVE; i++) im->free(slot[i]);
      double ns = (double)(t1 - t0) / (double)(pairs - warm);
      if (ns < best) best = ns;
    }
    printf("bench=host impl=%s live=%d ns_per_pair=%.1f\n", im->name, LIVE, best);
    if (k == 0) printf("bench=host impl=ebb segments_after_warmup=%llu\n", (unsigned long long)seg_after_warm);
    fflush(stdout);
  }
  free(fill);
  free(size);
  free(victim);
  free(slot);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
