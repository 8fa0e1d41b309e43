/* bench_engine.c: the backward engine's cost per node on CPU tensors of one f32 element, the
 * graph built fresh each iteration, on five graphs:
 *   chain          10,000 ops alternating y*1.0001 and y+0.0001 from one leaf;
 *   wide           1,000 chains of 10 ops, each from its own leaf, summed into one loss by adds;
 *   tree           a binary reduction tree of adds over 4,096 leaves that require grad;
 *   reuse          5,000 steps of y = y*y + y (each y used twice: sums in input buffers);
 *   tree_grad_K    the tree with ebb_grad for K = 1, 64 and 512 of its leaves;
 *   chain_dev0_side the chain on emulated device 0, its forward on a stream of ebb_stream_create
 *                  (its nodes' stream) while the backward is called with the default stream
 *                  current: the calling-thread path with a stream per node to check and enter.
 * Each iteration times the forward (ops recording nodes), the backward (from the call to its
 * return) and the graph's release apart; the line gives the median of `reps` iterations, per
 * node recorded in forward:
 *   bench=engine graph=<g> impl=ebb nodes=N fwd_ns_per_node=X bwd_ns_per_node=Y free_ns_per_node=Z
 * The libtorch peer (bench_engine_torch.cpp, built when Debian's libtorch-dev is installed)
 * prints the same lines with impl=libtorch for the same graphs.
 * usage: ebb-bench-engine [reps]
 * EBB_BENCH_ENGINE_GRAPHS: a comma-separated list of the graph names to run (default: all), so a
 * callgrind count (--toggle-collect=ebb_backward) covers one graph.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_pile.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

static ebb_tensor_t *scalar_leaf(struct bench_pile *p, int device, float v) {
  const int64_t one = 1;
  ebb_tensor_t *t;
  BENCH_CHECK(ebb_tensor_full(device, EBB_F32, 1, &one, v, &t));
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

enum graph { CHAIN, WIDE, TREE, REUSE, TREE_GRAD, CHAIN_DEV0_SIDE };

/* Builds graph g over leaves (made beforehand, untimed) and returns the root; *nodes counts the
 * ops recorded. */
static ebb_tensor_t *forward(enum graph g, struct bench_pile *p, ebb_tensor_t **leaves, long *nodes) {
  ebb_tensor_t *y = NULL;
  *nodes = 0;
  switch (g) {
  case CHAIN:
  case CHAIN_DEV0_SIDE:
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

static bool wanted(const char *name) {
  const char *list = getenv("EBB_BENCH_ENGINE_GRAPHS");
  if (!list || !*list) return true;
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len == n && !strncmp(p, name, n)) return true;
    p += len + (end ? 1 : 0);
  }
  return false;
}

static void run(const char *name, enum graph g, int k, int reps) {
  if (!wanted(name)) return;
  int dev = g == CHAIN_DEV0_SIDE ? 0 : EBB_DEVICE_CPU;
  ebb_stream_t *side = NULL, *def = NULL;
  if (dev >= 0) {
    BENCH_CHECK(ebb_stream_create(dev, EBB_PRIO_LOW, &side));
    BENCH_CHECK(ebb_stream_default(dev, &def));
  }
  int nleaves = g == WIDE ? 1000 : g == TREE || g == TREE_GRAD ? 4096 : 1;
  double *fwd = malloc(sizeof(double) * (size_t)reps), *bwd = malloc(sizeof(double) * (size_t)reps),
         *fre = malloc(sizeof(double) * (size_t)reps);
  ebb_tensor_t **grads = calloc(512, sizeof *grads);
  if (!fwd || !bwd || !fre || !grads) exit(1);
  long nodes = 0;
  for (int r = 0; r < reps; r++) {
    struct bench_pile leaves = {0}, graph = {0};
    for (int i = 0; i < nleaves; i++) scalar_leaf(&leaves, dev, g == REUSE ? 1e-4f : 1.0f);
    if (side) BENCH_CHECK(ebb_stream_set_current(side));
    uint64_t t0 = bench_now_ns();
    ebb_tensor_t *root = forward(g, &graph, leaves.t, &nodes);
    uint64_t t1 = bench_now_ns();
    if (side) BENCH_CHECK(ebb_stream_set_current(def));
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
    if (dev >= 0) BENCH_CHECK(ebb_dev_synchronize(dev)); /* (untimed: the call's host time is the figure) */
    uint64_t t2f = bench_now_ns();
    bench_pile_release(&graph);
    uint64_t t3 = bench_now_ns();
    for (int i = 0; g == TREE_GRAD && i < k; i++) BENCH_CHECK(ebb_tensor_release(grads[i]));
    bench_pile_release(&leaves);
    bench_pile_free(&leaves);
    bench_pile_free(&graph);
    fwd[r] = (double)(t1 - t0) / (double)nodes;
    bwd[r] = (double)(t2 - t1) / (double)nodes;
    fre[r] = (double)(t3 - t2f) / (double)nodes;
  }
  printf("bench=engine graph=%s impl=ebb nodes=%ld fwd_ns_per_node=%.1f bwd_ns_per_node=%.1f free_ns_per_node=%.1f\n", name, nodes,
         bench_median(fwd, (size_t)reps), bench_median(bwd, (size_t)reps), bench_median(fre, (size_t)reps));
  fflush(stdout);
  if (side) BENCH_CHECK(ebb_stream_release(side));
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
  run("chain_dev0_side", CHAIN_DEV0_SIDE, 0, reps);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
