/* ebb-bench-history: what the allocation history costs.
 *
 *   bench=history ns_per_alloc=<x> dump_s_per_million=<y>
 *
 * ns_per_alloc: the extra time of one ebb_arena_alloc + ebb_arena_free pair on device 0 (4 KiB,
 * a slab slot: the arena's fastest path, so the history's share is largest) with the history on
 * (EBB_ALLOC_CONF=history:N) against off (history:0), each mode in its own process (the
 * configuration is read by the first ebb_init), the processes interleaved. Each process reports
 * the fastest of its short bursts (a burst a preemption hit is slower, never faster); the figure
 * is the median over rounds of on minus off, and pair_ns_on/off are the medians of each. The
 * pair records an alloc and the free's entries; the figure is per pair. Under heavy load the
 * instruction counts are the steadier measure:
 *   EBB_ALLOC_CONF=history:1048576 valgrind --tool=callgrind ebb-bench-history --child pairs
 * against history:0, divided by the pairs run (BURST * SUBROUNDS + 10000); see perf/RESULTS.md. dump_s_per_million: ebb_memory_snapshot_json's
 * time for a history of 10^6 entries, per million entries.
 * Targets (README's issue list, perf/RESULTS.md): under 50 ns and under 0.5 s.
 *
 * Usage: ebb-bench-history [rounds (default 11)]. Internally re-runs itself as
 * `ebb-bench-history --child pairs|dump`.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ebb/ebb.h"

#define BURST 100000
#define SUBROUNDS 20
#define DUMP_ENTRIES 1000000

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int die(const char *what) {
  fprintf(stderr, "ebb-bench-history: %s: %s\n", what, ebb_last_error());
  return 1;
}

/* The time of one pair: the fastest of SUBROUNDS bursts of BURST pairs. A burst is ~10 ms, so
 * most bursts run without a preemption on a loaded machine and the fastest is the undisturbed
 * cost. */
static int child_pairs(void) {
  if (ebb_init() != EBB_OK) return die("ebb_init");
  void *p;
  for (int i = 0; i < 10000; i++) { /* warm the slab */
    if (ebb_arena_alloc(0, 4096, NULL, &p) != EBB_OK) return die("alloc");
    ebb_arena_free(p);
  }
  double best = 1e30;
  for (int r = 0; r < SUBROUNDS; r++) {
    double t0 = now_s();
    for (int i = 0; i < BURST; i++) {
      if (ebb_arena_alloc(0, 4096, NULL, &p) != EBB_OK) return die("alloc");
      ebb_arena_free(p);
    }
    double ns = (now_s() - t0) / BURST * 1e9;
    if (ns < best) best = ns;
  }
  printf("%.2f\n", best);
  return ebb_shutdown() == EBB_OK ? 0 : die("ebb_shutdown");
}

static int child_dump(const char *path) {
  if (ebb_init() != EBB_OK) return die("ebb_init");
  size_t held = 0;
  void *p[64];
  while (held < DUMP_ENTRIES) {
    for (int k = 0; k < 64; k++)
      if (ebb_arena_alloc(0, 4096u * (1u + (unsigned)k % 7u), NULL, &p[k]) != EBB_OK) return die("alloc");
    for (int k = 0; k < 64; k++) ebb_arena_free(p[k]);
    if (ebb_alloc_history_get(0, NULL, 0, &held, NULL) != EBB_OK) return die("history_get");
  }
  double t0 = now_s();
  if (ebb_memory_snapshot_json(path) != EBB_OK) return die("snapshot");
  double s = now_s() - t0;
  printf("%.4f %zu\n", s / (double)held * 1e6, held);
  remove(path);
  return ebb_shutdown() == EBB_OK ? 0 : die("ebb_shutdown");
}

/* Runs this program as a child with EBB_ALLOC_CONF=conf and reads its one line. */
static int run_child(const char *self, const char *mode, const char *conf, char *line, size_t cap) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "EBB_ALLOC_CONF='%s' '%s' --child %s", conf, self, mode);
  FILE *f = popen(cmd, "r");
  if (!f) return -1;
  bool got = fgets(line, (int)cap, f) != NULL;
  int rc = pclose(f);
  return got && rc == 0 ? 0 : -1;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc >= 3 && !strcmp(argv[1], "--child")) {
    if (!strcmp(argv[2], "pairs")) return child_pairs();
    char path[64];
    snprintf(path, sizeof path, "/tmp/ebb-bench-history-%ld.json", (long)getpid());
    return child_dump(path);
  }
  int rounds = argc > 1 ? atoi(argv[1]) : 11;
  if (rounds < 1 || rounds > 100) {
    fprintf(stderr, "usage: ebb-bench-history [rounds 1..100]\n");
    return 2;
  }
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  double on[100], off[100], diff[100];
  char line[256];
  for (int r = 0; r < rounds; r++) {
    if (run_child(self, "pairs", "history:1048576", line, sizeof line)) return 1;
    on[r] = atof(line);
    if (run_child(self, "pairs", "history:0", line, sizeof line)) return 1;
    off[r] = atof(line);
    diff[r] = on[r] - off[r];
  }
  qsort(on, (size_t)rounds, sizeof *on, cmp);
  qsort(off, (size_t)rounds, sizeof *off, cmp);
  qsort(diff, (size_t)rounds, sizeof *diff, cmp);
  if (run_child(self, "dump", "history:1048576", line, sizeof line)) return 1;
  double dump = atof(line);
  printf("bench=history pair_ns_on=%.1f pair_ns_off=%.1f rounds=%d\n", on[rounds / 2], off[rounds / 2], rounds);
  printf("bench=history ns_per_alloc=%.1f dump_s_per_million=%.3f\n", diff[rounds / 2], dump);
  return 0;
}
