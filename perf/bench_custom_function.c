/* ebb-bench-custom_function: what a custom function (ebb/function.h) costs over the same ops
 * called directly.
 *
 *   bench=custom_function inputs=<1|13> custom_ns=<x> direct_ns=<y> extra_ns=<x-y>
 *
 * One call is a forward and a backward on the CPU: y = c + x0 + ... + x(n-1) (one add per input;
 * c a constant f32[16], each x an f32[16] leaf that requires a gradient), loss = sum(y),
 * ebb_backward_one(loss). "custom" does the adds inside a custom function whose backward returns
 * the incoming gradient to each input; "direct" calls the same adds in the recorded graph. The
 * two are interleaved in rounds of ITERS calls; each figure is the median over rounds of the
 * per-call time. Target (perf/RESULTS.md): at most 1 us more per call (PyTorch: 20.7 us against
 * 3.2 us with 13 inputs, pytorch#189573).
 *
 * Usage: ebb-bench-custom_function [rounds (default 15)]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ebb/ebb.h"

#define MAXIN 13
#define ITERS 2000

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int die(const char *what) {
  fprintf(stderr, "ebb-bench-custom_function: %s: %s\n", what, ebb_last_error());
  exit(1);
}

static const ebb_tensor_t *g_const;

/* y = c + x0 + ... : the adds, recorded or not (the caller's grad mode decides). */
static ebb_status sum_inputs(const ebb_tensor_t *const *in, int n, ebb_tensor_t **out) {
  ebb_tensor_t *acc = NULL;
  ebb_status st = EBB_OK;
  for (int i = 0; i < n && !st; i++) {
    ebb_tensor_t *next = NULL;
    st = ebb_op_add(acc ? acc : g_const, in[i], &next);
    if (acc) ebb_tensor_release(acc);
    acc = next;
  }
  if (st && acc) ebb_tensor_release(acc);
  if (!st) *out = acc;
  return st;
}

static ebb_status fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int nin, const void *args, ebb_tensor_t **out,
                      int nout) {
  (void)ctx;
  (void)args;
  (void)nout;
  return sum_inputs(in, nin, &out[0]);
}

static ebb_status bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int nout, ebb_tensor_t **gin, int *ngin) {
  (void)ctx;
  (void)nout;
  for (int i = 0; i < *ngin; i++) {
    ebb_tensor_retain((ebb_tensor_t *)go[0]);
    gin[i] = (ebb_tensor_t *)go[0];
  }
  return EBB_OK;
}

static const ebb_function kAddAll = {EBB_FUNCTION_VERSION, "AddAll", 1, fwd, NULL, bwd, NULL};

static void step(bool custom, ebb_tensor_t *const *x, int n) {
  ebb_tensor_t *y = NULL, *l = NULL;
  ebb_status st = custom ? ebb_function_apply(&kAddAll, (const ebb_tensor_t *const *)x, n, NULL, &y)
                         : sum_inputs((const ebb_tensor_t *const *)x, n, &y);
  if (st) die(custom ? "ebb_function_apply" : "ebb_op_add");
  if (ebb_op_sum(y, NULL, 0, false, &l) || ebb_backward_one(l)) die("backward");
  ebb_tensor_release(l);
  ebb_tensor_release(y);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 15;
  if (rounds < 1) rounds = 15;
  if (ebb_init()) die("ebb_init");
  int64_t shape[1] = {16};
  ebb_tensor_t *c = NULL, *x[MAXIN];
  if (ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, shape, &c)) die("zeros");
  g_const = c;
  for (int i = 0; i < MAXIN; i++)
    if (ebb_tensor_ones(EBB_DEVICE_CPU, EBB_F32, 1, shape, &x[i]) || ebb_tensor_set_requires_grad(x[i], true)) die("leaf");
  double *tc = malloc(sizeof(double) * (size_t)rounds), *td = malloc(sizeof(double) * (size_t)rounds);
  int sizes[2] = {1, 13};
  for (int s = 0; s < 2; s++) {
    int n = sizes[s];
    for (int w = 0; w < 500; w++) { /* warm both paths (caches, the name table, the .grad buffers) */
      step(true, x, n);
      step(false, x, n);
    }
    for (int r = 0; r < rounds; r++) {
      for (int pass = 0; pass < 2; pass++) { /* alternate which goes first */
        bool custom = (pass == 0) == (r % 2 == 0);
        double t0 = now_ns();
        for (int i = 0; i < ITERS; i++) step(custom, x, n);
        double per = (now_ns() - t0) / ITERS;
        if (custom) tc[r] = per;
        else td[r] = per;
      }
    }
    qsort(tc, (size_t)rounds, sizeof *tc, cmp);
    qsort(td, (size_t)rounds, sizeof *td, cmp);
    double mc = tc[rounds / 2], md = td[rounds / 2];
    printf("bench=custom_function inputs=%d custom_ns=%.0f direct_ns=%.0f extra_ns=%.0f\n", n, mc, md, mc - md);
    fflush(stdout);
  }
  free(tc);
  free(td);
  for (int i = 0; i < MAXIN; i++) ebb_tensor_release(x[i]);
  ebb_tensor_release(c);
  if (ebb_shutdown()) die("ebb_shutdown");
  return 0;
}
