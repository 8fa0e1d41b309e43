/* A pile of tensor handles made while building one graph, released together: the benches that
 * build a graph per iteration keep every handle here and release the pile after the backward.
 * Single-threaded; an allocation failure ends the program (a bench has no caller to report to). */
#ifndef EBB_BENCH_PILE_H
#define EBB_BENCH_PILE_H

#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ebb/tensor.h"

struct bench_pile {
  ebb_tensor_t **t;
  size_t n, cap;
};

/* Keeps t (owned by the pile from now on) and returns it. */
static inline ebb_tensor_t *bench_pile_keep(struct bench_pile *p, ebb_tensor_t *t) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 256;
    ebb_tensor_t **grown = realloc(p->t, cap * sizeof *grown);
    if (!grown) {
      fprintf(stderr, "bench: out of memory for a pile of %zu tensor handles\n", cap);
      exit(1);
    }
    p->t = grown;
    p->cap = cap;
  }
  p->t[p->n++] = t;
  return t;
}

/* Releases every handle, newest first; the pile keeps its capacity for the next graph. */
static inline void bench_pile_release(struct bench_pile *p) {
  for (size_t i = p->n; i-- > 0;) BENCH_CHECK(ebb_tensor_release(p->t[i]));
  p->n = 0;
}

/* Frees the pile's own array (its handles must have been released). */
static inline void bench_pile_free(struct bench_pile *p) {
  free(p->t);
  *p = (struct bench_pile){0};
}

#endif
