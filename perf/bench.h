/* bench.h: the few helpers every ebb-bench-* program shares.
 *
 * A monotonic clock, a check macro that stops the benchmark with ebb's own error message (a
 * benchmark that hits an error has no figure to report, so exiting is the right answer here,
 * unlike in the library), and a median over repeated runs. Header-only; single-threaded use.
 */
#ifndef EBB_BENCH_H
#define EBB_BENCH_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ebb/status.h"

static inline uint64_t bench_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Runs an ebb call; on failure prints where, the status and ebb_last_error(), and exits 1. */
#define BENCH_CHECK(call)                                                                     \
  do {                                                                                        \
    ebb_status bench_st_ = (call);                                                            \
    if (bench_st_ != EBB_OK) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                        \
              ebb_status_name(bench_st_), ebb_last_error());                                  \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

static int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0..n) (sorts v in place). */
static inline double bench_median(double *v, size_t n) {
  qsort(v, n, sizeof *v, bench_cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

#endif /* EBB_BENCH_H */
