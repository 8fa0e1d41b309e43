/* bench_map.c: ebb_map (ebb/map.h) against the explicit loop it stands for, forward + backward,
 * on the emulated device 0.
 *
 * The model: x [SLICES, ROWS, DIM] f32 (data: no gradient), and one block applied to each slice
 * xs = x[s] ([ROWS, DIM]): y_s = linear(gelu(linear(xs, W1, b1)), W2, b2), W1 [HID, DIM], W2
 * [DIM, HID] (shared by every slice, requiring gradients). The loss is sum(Y), Y the stack of the
 * y_s, released once the loss is made (as a training loop's output goes out of scope). A step: the forward, ebb_backward_one(loss), ebb_dev_synchronize(0), the weights' .grad
 * cleared after; timed from the first op to the synchronisation.
 * Three ways to run it:
 *   loop        ebb_tensor_select per slice, the block, ebb_op_stack: the graph ops record;
 *   save        ebb_map in save mode: the same per-slice graphs, kept by the map's node;
 *   checkpoint  ebb_map in checkpoint mode: the slices run again in the backward.
 * peak_bytes: device 0's arena peak allocated bytes over the step (ebb_arena_reset_peak before
 * it), the weights and x included (they are allocated before and live through it).
 *
 * Environment: the program re-executes itself once with EBB_DRIVER=sim, EBB_SIM_DEVICES=1,
 * EBB_SIM_PERTURB=0, EBB_SIM_LAUNCH_US=0 (a kernel takes the time of its host work, no more) and
 * OPENBLAS_NUM_THREADS=1 (read when OpenBLAS loads, before main): one compute thread.
 *
 * usage: ebb-bench-map [rounds=7] [steps=3] [only=loop|save|checkpoint]
 * (only: run that mode alone and print its stderr lines, no bench= line: for profiles)
 * Each round runs the three modes in a rotated order (each comes first, second and third in
 * turn), each one warm-up step then `steps` timed steps; a mode's step_ms is the median of its
 * timed steps over every round, its peak_bytes the largest over them. Prints
 *   bench=map slices=64 mode=<save|checkpoint> step_ms= peak_bytes= loop_step_ms= loop_peak_bytes=
 *     ratio_to_loop= rounds=
 * ratio_to_loop: the median over rounds of the mode's median step over the loop's in the same
 * round (the targets: save <= 1.05, checkpoint <= 1.4 of save's time with peak_bytes <=
 * 0.25 of save's); and, for checkpoint, peak_ratio_to_save= and time_ratio_to_save=.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "ebb/ebb.h"

#define SLICES 64
#define ROWS 32
#define DIM 256
#define HID 1024
#define MAX_ROUNDS 64
#define MAX_STEPS 16

enum { LOOP, SAVE, CHECKPOINT, NMODES };
static const char *const mode_names[NMODES] = {"loop", "save", "checkpoint"};

struct model {
  ebb_tensor_t *x, *w1, *b1, *w2, *b2;
};

static ebb_status block_fn(const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs, ebb_tensor_t **outs,
                           int nouts, void *user) {
  (void)nxs, (void)nargs, (void)nouts, (void)user;
  ebb_tensor_t *h = NULL, *g = NULL;
  ebb_status st = ebb_op_linear(xs[0], args[0], args[1], &h);
  if (!st) st = ebb_op_gelu(h, &g);
  if (!st) st = ebb_op_linear(g, args[2], args[3], &outs[0]);
  if (h) ebb_tensor_release(h);
  if (g) ebb_tensor_release(g);
  return st;
}

static ebb_tensor_t *param(int ndim, const int64_t *shape, uint64_t seed, double scale, bool grad) {
  ebb_tensor_t *r = NULL, *t = NULL;
  BENCH_CHECK(ebb_tensor_randn(0, EBB_F32, ndim, shape, seed, 0, &r));
  BENCH_CHECK(ebb_op_mul_scalar(r, scale, &t));
  ebb_tensor_release(r);
  if (grad) BENCH_CHECK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

static void model_init(struct model *m) {
  int64_t xs[3] = {SLICES, ROWS, DIM}, w1[2] = {HID, DIM}, b1[1] = {HID}, w2[2] = {DIM, HID}, b2[1] = {DIM};
  m->x = param(3, xs, 1, 1.0, false);
  m->w1 = param(2, w1, 2, 0.0625, true);
  m->b1 = param(1, b1, 3, 0.1, true);
  m->w2 = param(2, w2, 4, 0.03125, true);
  m->b2 = param(1, b2, 5, 0.1, true);
}

static void model_free(struct model *m) {
  ebb_tensor_t *ts[5] = {m->x, m->w1, m->b1, m->w2, m->b2};
  for (int i = 0; i < 5; i++) BENCH_CHECK(ebb_tensor_release(ts[i]));
}

/* The forward of one mode: Y [SLICES, ROWS, DIM]. */
static ebb_tensor_t *forward(const struct model *m, int mode) {
  const ebb_tensor_t *args[4] = {m->w1, m->b1, m->w2, m->b2};
  ebb_tensor_t *y = NULL;
  if (mode == LOOP) {
    ebb_tensor_t *ys[SLICES];
    for (int s = 0; s < SLICES; s++) {
      ebb_tensor_t *xs = NULL;
      BENCH_CHECK(ebb_tensor_select(m->x, 0, s, &xs));
      const ebb_tensor_t *in[1] = {xs};
      ys[s] = NULL;
      BENCH_CHECK(block_fn(in, 1, args, 4, &ys[s], 1, NULL));
      ebb_tensor_release(xs);
    }
    BENCH_CHECK(ebb_op_stack((const ebb_tensor_t *const *)ys, SLICES, 0, &y));
    for (int s = 0; s < SLICES; s++) ebb_tensor_release(ys[s]);
  } else {
    const ebb_tensor_t *xs[1] = {m->x};
    ebb_map_options o = {.version = EBB_MAP_OPTIONS_VERSION, .checkpoint = mode == CHECKPOINT};
    BENCH_CHECK(ebb_map(block_fn, NULL, xs, 1, args, 4, &o, &y, 1));
  }
  return y;
}

static uint64_t cpu_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One step; its time in ms, its process CPU time in *cpu_ms, its peak allocated bytes in *peak
 * and that peak less the bytes allocated when it started in *step_peak. */
static double step(const struct model *m, int mode, double *cpu_ms, uint64_t *peak, uint64_t *step_peak) {
  BENCH_CHECK(ebb_dev_synchronize(0));
  BENCH_CHECK(ebb_arena_reset_peak(0));
  ebb_arena_stats st0;
  BENCH_CHECK(ebb_arena_get_stats(0, &st0));
  uint64_t c0 = cpu_now_ns(), t0 = bench_now_ns();
  ebb_tensor_t *y = forward(m, mode), *loss = NULL;
  BENCH_CHECK(ebb_op_sum(y, NULL, 0, false, &loss));
  ebb_tensor_release(y); /* (as a training loop lets go of its output once the loss is made: the sum's backward does not read it) */
  BENCH_CHECK(ebb_backward_one(loss));
  ebb_tensor_release(loss);
  BENCH_CHECK(ebb_dev_synchronize(0));
  double ms = (double)(bench_now_ns() - t0) / 1e6;
  *cpu_ms = (double)(cpu_now_ns() - c0) / 1e6;
  ebb_arena_stats st;
  BENCH_CHECK(ebb_arena_get_stats(0, &st));
  *peak = st.allocated_bytes.peak;
  *step_peak = st.allocated_bytes.peak - st0.allocated_bytes.current;
  ebb_tensor_t *ps[4] = {m->w1, m->b1, m->w2, m->b2};
  for (int i = 0; i < 4; i++) BENCH_CHECK(ebb_tensor_set_grad(ps[i], NULL));
  return ms;
}

static void set_env(const char *name, const char *value) {
  if (setenv(name, value, 1) != 0) {
    perror("bench_map: setenv");
    exit(1);
  }
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 7, steps = argc > 2 ? atoi(argv[2]) : 3, only = -1;
  for (int mode = 0; argc > 3 && mode < NMODES; mode++)
    if (strcmp(argv[3], mode_names[mode]) == 0) only = mode;
  if (rounds < 1 || rounds > MAX_ROUNDS || steps < 1 || steps > MAX_STEPS) {
    fprintf(stderr, "usage: ebb-bench-map [rounds 1..%d] [steps 1..%d]\n", MAX_ROUNDS, MAX_STEPS);
    return 2;
  }
  if (!getenv("EBB_BENCH_MAP_CHILD")) {
    set_env("EBB_DRIVER", "sim");
    set_env("EBB_SIM_DEVICES", "1");
    set_env("EBB_SIM_PERTURB", "0");
    set_env("EBB_SIM_LAUNCH_US", "0");
    set_env("OPENBLAS_NUM_THREADS", "1");
    set_env("EBB_BENCH_MAP_CHILD", "1");
    fflush(NULL);
    execv("/proc/self/exe", argv);
    perror("bench_map: execv /proc/self/exe");
    return 1;
  }
  BENCH_CHECK(ebb_init());
  struct model m;
  model_init(&m);
  static double times[NMODES][MAX_ROUNDS * MAX_STEPS], cpus[NMODES][MAX_ROUNDS * MAX_STEPS], round_med[NMODES][MAX_ROUNDS];
  uint64_t peak[NMODES] = {0}, step_peak[NMODES] = {0};
  for (int r = 0; r < rounds; r++) {
    for (int j = 0; j < NMODES; j++) {
      int mode = (r + j) % NMODES;
      if (only >= 0 && mode != only) continue;
      uint64_t p = 0, sp = 0;
      double cpu;
      step(&m, mode, &cpu, &p, &sp); /* warm-up: the arena's blocks for this mode */
      double t[MAX_STEPS];
      for (int s = 0; s < steps; s++) {
        t[s] = step(&m, mode, &cpu, &p, &sp);
        times[mode][r * steps + s] = t[s];
        cpus[mode][r * steps + s] = cpu;
        if (p > peak[mode]) peak[mode] = p;
        if (sp > step_peak[mode]) step_peak[mode] = sp;
      }
      round_med[mode][r] = bench_median(t, (size_t)steps);
      fprintf(stderr, "map: round %d %s: %.2f ms (cpu %.2f ms), peak %llu bytes, %llu above the step's start\n", r, mode_names[mode],
              round_med[mode][r], cpu, (unsigned long long)p, (unsigned long long)sp);
    }
  }
  if (only >= 0) {
    model_free(&m);
    BENCH_CHECK(ebb_shutdown());
    return 0;
  }
  double med[NMODES], cpu_med[NMODES], ratio_loop[NMODES][MAX_ROUNDS], ratio_save[MAX_ROUNDS];
  for (int r = 0; r < rounds; r++) {
    for (int mode = 0; mode < NMODES; mode++) ratio_loop[mode][r] = round_med[mode][r] / round_med[LOOP][r];
    ratio_save[r] = round_med[CHECKPOINT][r] / round_med[SAVE][r];
  }
  for (int mode = 0; mode < NMODES; mode++) {
    med[mode] = bench_median(times[mode], (size_t)(rounds * steps));
    cpu_med[mode] = bench_median(cpus[mode], (size_t)(rounds * steps));
  }
  for (int mode = SAVE; mode < NMODES; mode++) {
    printf("bench=map slices=%d mode=%s step_ms=%.3f peak_bytes=%llu loop_step_ms=%.3f loop_peak_bytes=%llu ratio_to_loop=%.3f"
           " step_peak_bytes=%llu loop_step_peak_bytes=%llu cpu_ms=%.3f loop_cpu_ms=%.3f",
           SLICES, mode_names[mode], med[mode], (unsigned long long)peak[mode], med[LOOP], (unsigned long long)peak[LOOP],
           bench_median(ratio_loop[mode], (size_t)rounds), (unsigned long long)step_peak[mode], (unsigned long long)step_peak[LOOP],
           cpu_med[mode], cpu_med[LOOP]);
    if (mode == CHECKPOINT)
      printf(" peak_ratio_to_save=%.3f step_peak_ratio_to_save=%.3f time_ratio_to_save=%.3f cpu_ratio_to_save=%.3f",
             (double)peak[CHECKPOINT] / (double)peak[SAVE], (double)step_peak[CHECKPOINT] / (double)step_peak[SAVE],
             bench_median(ratio_save, (size_t)rounds), cpu_med[CHECKPOINT] / cpu_med[SAVE]);
    printf(" rounds=%d\n", rounds);
  }
  model_free(&m);
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
