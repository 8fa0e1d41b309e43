/* bench_engine.c: the backward engine's cost per node on CPU tensors of one f32 element, the
 * graph built fresh each iteration, on five graphs:
 *   chain          10,000 ops alternating y*1.0001 and y+0.0001 from one leaf;
 *   wide           1,000 chains of 10 ops, each from its own leaf, summed into one loss by adds;
 *   tree           a binary reduction tree of adds over 4,096 leaves that require grad;
 *   reuse          5,000 steps of y = y*y + y (each y used twice: sums in input buffers);
 *   tree_grad_K    the tree with ebb_grad for K = 1, 64 and 512 of its leaves.
 * Each iteration times the forward (ops recording nodes), the backward (from the call to its
 * return) and the graph's release apart; the line gives the median of `reps` iterations, per
 * node recorded in forward:
 *   bench=engine graph=<g> impl=ebb nodes=N fwd_ns_per_node=X bwd_ns_per_node=Y free_ns_per_node=Z
 * The libtorch peer (bench_engine_torch.cpp, built when Debian's libtorch-dev is installed)
 * prints the same lines with impl=libtorch for the same graphs.
 * usage: ebb-bench-engine [reps]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_pile.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"

static ebb_tensor_t *scalar_leaf(struct bench_pile *p, float v) {
  const int64_t one = 1;
  ebb_tensor_t *t;
  BENCH_CHECK(ebb_tensor_full(EBB_DEVICE_CPU, EBB_F32, 1, &one, v, &t));
  BENCH_CHECK(ebb_tensor_set_requires_grad(t, true));
  return bench_pile_keep(p, t);
}

static ebb_tensor_t *op2(struct bench_pile *p, ebb_status (*f)(const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **),
                         const ebb_tensor_t *a, const ebb_tensor_t *b) {
  ebb_tensor_t *o;
  BENCH_CHECK(f(a, b, &o));
  return bench_pile_keep(p, o);
}

static ebb_tensor_t *ops(struct bench_pile *p, ebb_status (*f)(const ebb_tensor_t *, double, ebb_tensor_t **), const ebb_tensor_t *a,
                         double s) {
  ebb_tensor_t *o;
  BENCH_CHECK(f(a, s, &o));
  return bench_pile_keep(p, o);
}

enum graph { CHAIN, WIDE, TREE, REUSE, TREE_GRAD };

/* Builds graph g over leaves (made beforehand, untimed) and returns the root; *nodes counts the
 * ops recorded. */
static ebb_tensor_t *forward(enum graph g, struct bench_pile *p, ebb_tensor_t **leaves, long *nodes) {
  ebb_tensor_t *y = NULL;
  *nodes = 0;
  switch (g) {
  case CHAIN:
    y = leaves[0];
    for (int i = 0; i < 10000; i++) y = i % 2 ? ops(p, ebb_op_add_scalar, y, 0.0001) : ops(p, ebb_op_mul_scalar, y, 1.0001);
    *nodes = 10000;
    break;
  case WIDE:
    for (int c = 0; c < 1000; c++) {
      ebb_tensor_t *z = leaves[c];
      for (int i = 0; i < 10; i++) z = i % 2 ? ops(p, ebb_op_add_scalar, z, 0.0001) : ops(p, ebb_op_mul_scalar, z, 1.0001);
      y = y ? op2(p, ebb_op_add, y, z) : z;
    }
    *nodes = 1000 * 10 + 999;
    break;
  case TREE:
  case TREE_GRAD: {
    ebb_tensor_t *level[4096];
    memcpy(level, leaves, sizeof level);
    for (int n = 4096; n > 1; n /= 2)
      for (int i = 0; i < n / 2; i++) level[i] = op2(p, ebb_op_add, level[2 * i], level[2 * i + 1]);
    y = level[0];
    *nodes = 4095;
    break;
  }
  case REUSE:
    y = leaves[0];
    for (int i = 0; i < 5000; i++) y = op2(p, ebb_op_add, op2(p, ebb_op_mul, y, y), y);
    *nodes = 10000;
    break;
  }
  return y;
}

static void run(const char *name, enum graph g, int k, int reps) {
  int nleaves = g == WIDE ? 1000 : g == TREE || g == TREE_GRAD ? 4096 : 1;
  double *fwd = malloc(sizeof(double) * (size_t)reps), *bwd = malloc(sizeof(double) * (size_t)reps),
         *fre = malloc(sizeof(double) * (size_t)reps);
  ebb_tensor_t **grads = calloc(512, sizeof *grads);
  if (!fwd || !bwd || !fre || !grads) exit(1);
  long nodes = 0;
  for (int r = 0; r < reps; r++) {
    struct bench_pile leaves = {0}, graph = {0};
    for (int i = 0; i < nleaves; i++) scalar_leaf(&leaves, g == REUSE ? 1e-4f : 1.0f);
    uint64_t t0 = bench_now_ns();
    ebb_tensor_t *root = forward(g, &graph, leaves.t, &nodes);
    uint64_t t1 = bench_now_ns();
    const ebb_tensor_t *roots[1] = {root};
    if (g == TREE_GRAD) {
      /* k leaves spread over the tree */
      const ebb_tensor_t *in[512];
      for (int i = 0; i < k; i++) in[i] = leaves.t[(size_t)i * (4096 / (size_t)k)];
      BENCH_CHECK(ebb_grad(roots, NULL, 1, in, k, false, false, grads));
    } else {
      BENCH_CHECK(ebb_backward(roots, NULL, 1, false, NULL, 0));
    }
    uint64_t t2 = bench_now_ns();
    bench_pile_release(&graph);
    uint64_t t3 = bench_now_ns();
    for (int i = 0; g == TREE_GRAD && i < k; i++) BENCH_CHECK(ebb_tensor_release(grads[i]));
    bench_pile_release(&leaves);
    bench_pile_free(&leaves);
    bench_pile_free(&graph);
    fwd[r] = (double)(t1 - t0) / (double)nodes;
    bwd[r] = (double)(t2 - t1) / (double)nodes;
    fre[r] = (double)(t3 - t2) / (double)nodes;
  }
  printf("bench=engine graph=%s impl=ebb nodes=%ld fwd_ns_per_node=%.1f bwd_ns_per_node=%.1f free_ns_per_node=%.1f\n", name, nodes,
         bench_median(fwd, (size_t)reps), bench_median(bwd, (size_t)reps), bench_median(fre, (size_t)reps));
  fflush(stdout);
  free(fwd);
  free(bwd);
  free(fre);
  free(grads);
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 5;
  if (reps < 1) reps = 1;
  BENCH_CHECK(ebb_init());
  run("chain", CHAIN, 0, reps);
  run("wide", WIDE, 0, reps);
  run("tree", TREE, 0, reps);
  run("reuse", REUSE, 0, reps);
  run("tree_grad_1", TREE_GRAD, 1, reps);
  run("tree_grad_64", TREE_GRAD, 64, reps);
  run("tree_grad_512", TREE_GRAD, 512, reps);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
