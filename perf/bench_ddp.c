/* bench_ddp.c: the data-parallel reducer (ebb/ddp.h) overlapping backward, under
 * `mpirun -np N` with one emulated device per rank:
 *   EBB_SIM_DEVICES=1 mpirun --allow-run-as-root --oversubscribe -np 2 ebb-bench-ddp [layers width batch steps]
 *
 * An MLP of `layers` square linear layers (width x width f32, no bias; 7 x 2048 by default: 112
 * MiB of gradients) with a ReLU between them and loss = sum(output), on each rank's own batch.
 * Phases, in one run:
 *  1. without a reducer: steps of forward, backward and a device synchronisation (the gradients
 *     kept and zeroed in place, as the reducer keeps its buckets): the step's and backward's
 *     medians, and the device's peak allocated bytes;
 *  2. the link model: the benchmark sets EBB_DIST_LINK_GBPS (dist/pg.c) so that all-reducing
 *     every gradient takes about half of backward's median (rank 0's figure, broadcast), and
 *     creates a device group and a reducer (default caps) after it;
 *  3. with the reducer: the same steps plus ebb_reducer_finish, a barrier at each start;
 *  4. each bucket's all-reduce alone (a tensor of its size), timed to a device synchronisation.
 * Prints rank 0's line:
 *   bench=ddp ranks= link_gbps= step_ms= base_step_ms= backward_ms= exposed_comm_ms=
 *             allreduce_ms= last_bucket_ms= extra_bytes= bucket_bytes= buckets=
 * step_ms and base_step_ms are medians of `steps` steps with and without the reducer;
 * exposed_comm_ms = step_ms - base_step_ms: what the reduction adds to a step, i.e. what of it
 * remains after backward's last node (the link model's sleep takes no core, so the reduction
 * does not slow the compute itself); allreduce_ms is the sum of the buckets' all-reduces run
 * alone, last_bucket_ms the last bucket's; extra_bytes the device's peak allocated bytes with
 * the reducer minus without; bucket_bytes the largest bucket's bytes; host_us_per_bucket the
 * host time of forward + backward + ebb_reducer_finish with the reducer less forward + backward
 * without it, per bucket (kernels run asynchronously on the device: both are enqueue times).
 * Targets (ebb's issue list): exposed_comm_ms <= last_bucket_ms + 0.1 x allreduce_ms; extra_bytes
 * <= bucket_bytes; host cost under 20 us per bucket.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ebb/ebb.h"

enum { MAX_LAYERS = 64, MAX_STEPS = 64 };
static int L = 7, W = 2048, BT = 16, STEPS = 10;
static ebb_tensor_t *w[MAX_LAYERS];

static void step(int device, ebb_tensor_t *x) {
  ebb_tensor_t *h = x, *y = NULL, *loss = NULL;
  ebb_tensor_retain(x);
  for (int l = 0; l < L; l++) {
    BENCH_CHECK(ebb_op_linear(h, w[l], NULL, &y));
    ebb_tensor_release(h);
    h = y;
    if (l + 1 < L) {
      BENCH_CHECK(ebb_op_relu(h, &y));
      ebb_tensor_release(h);
      h = y;
    }
  }
  BENCH_CHECK(ebb_op_sum(h, NULL, 0, false, &loss));
  ebb_tensor_release(h);
  BENCH_CHECK(ebb_backward_one(loss));
  ebb_tensor_release(loss);
  (void)device;
}

static uint64_t peak_allocated(int device) {
  ebb_arena_stats s;
  BENCH_CHECK(ebb_arena_get_stats(device, &s));
  return s.allocated_bytes.peak;
}

int main(int argc, char **argv) {
  if (argc > 1) L = atoi(argv[1]);
  if (argc > 2) W = atoi(argv[2]);
  if (argc > 3) BT = atoi(argv[3]);
  if (argc > 4) STEPS = atoi(argv[4]);
  if (L < 1 || L > MAX_LAYERS || W < 1 || BT < 1 || STEPS < 1 || STEPS > MAX_STEPS) {
    fprintf(stderr, "usage: ebb-bench-ddp [layers (1..%d) width batch steps (1..%d)]\n", MAX_LAYERS, MAX_STEPS);
    return 2;
  }
  BENCH_CHECK(ebb_init());
  ebb_pg_t *cpu = NULL;
  BENCH_CHECK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, NULL, &cpu));
  int rank = 0, size = 1, ndev = 0;
  BENCH_CHECK(ebb_pg_rank(cpu, &rank));
  BENCH_CHECK(ebb_pg_size(cpu, &size));
  BENCH_CHECK(ebb_dev_count(&ndev));
  if (ndev < 1) {
    fprintf(stderr, "ebb-bench-ddp: no device (run with EBB_SIM_DEVICES=1 on a machine without GPU)\n");
    return 1;
  }
  int device = rank % ndev;
  BENCH_CHECK(ebb_dev_set_current(device));
  int64_t wshape[2] = {W, W}, xshape[2] = {BT, W};
  for (int l = 0; l < L; l++) {
    BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, wshape, 1000 + (uint64_t)l, 0, &w[l]));
    ebb_tensor_t *s = NULL;
    BENCH_CHECK(ebb_op_mul_scalar(w[l], 1.0 / W, &s)); /* keeps activations finite */
    ebb_tensor_release(w[l]);
    w[l] = s;
    BENCH_CHECK(ebb_tensor_set_requires_grad(w[l], true));
  }
  ebb_tensor_t *x = NULL;
  BENCH_CHECK(ebb_tensor_randn(device, EBB_F32, 2, xshape, 7 + (uint64_t)rank, 0, &x));
  double grad_bytes = (double)L * W * W * 4;

  /* 1. without a reducer */
  double base[MAX_STEPS], bwd[MAX_STEPS], host_base[MAX_STEPS], host_red[MAX_STEPS];
  for (int s = -2; s < STEPS; s++) {
    if (s == 0) BENCH_CHECK(ebb_arena_reset_peak(device));
    for (int l = 0; l < L; l++) {
      ebb_tensor_t *g = NULL;
      BENCH_CHECK(ebb_tensor_grad(w[l], &g));
      if (g) {
        BENCH_CHECK(ebb_tensor_zero_(g));
        ebb_tensor_release(g);
      }
    }
    BENCH_CHECK(ebb_barrier(cpu, NULL));
    BENCH_CHECK(ebb_dev_synchronize(device));
    uint64_t t0 = bench_now_ns();
    step(device, x);
    uint64_t th = bench_now_ns();
    BENCH_CHECK(ebb_dev_synchronize(device));
    uint64_t t1 = bench_now_ns();
    if (s >= 0) base[s] = (double)(t1 - t0) / 1e6, bwd[s] = base[s], host_base[s] = (double)(th - t0) / 1e3;
  }
  uint64_t peak_base = peak_allocated(device);
  double base_ms = bench_median(base, (size_t)STEPS);
  /* backward alone: the forward's share measured separately with grad mode off */
  double fwd[MAX_STEPS];
  for (int s = 0; s < STEPS; s++) {
    bool was;
    ebb_grad_set_enabled(false, &was);
    BENCH_CHECK(ebb_dev_synchronize(device));
    uint64_t t0 = bench_now_ns();
    ebb_tensor_t *h = x, *y = NULL;
    ebb_tensor_retain(x);
    for (int l = 0; l < L; l++) {
      BENCH_CHECK(ebb_op_linear(h, w[l], NULL, &y));
      ebb_tensor_release(h);
      h = y;
    }
    ebb_tensor_release(h);
    BENCH_CHECK(ebb_dev_synchronize(device));
    fwd[s] = (double)(bench_now_ns() - t0) / 1e6;
    ebb_grad_set_enabled(was, NULL);
  }
  double bwd_ms = base_ms - bench_median(fwd, (size_t)STEPS);
  (void)bwd;
  for (int l = 0; l < L; l++) BENCH_CHECK(ebb_tensor_set_grad(w[l], NULL));

  /* 2. the link model: the whole reduction about half of backward (rank 0's) */
  double gb[1] = {grad_bytes * 2.0 * (size - 1) / size * 8.0 / (0.5 * bwd_ms * 1e6)}; /* bits per ns = Gbit/s */
  int64_t one = 1;
  ebb_tensor_t *gt = NULL;
  BENCH_CHECK(ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_F64, 1, &one, gb, sizeof gb, &gt));
  BENCH_CHECK(ebb_broadcast(cpu, gt, 0, NULL));
  BENCH_CHECK(ebb_tensor_to_host(gt, gb, sizeof gb));
  ebb_tensor_release(gt);
  if (getenv("BENCH_DDP_GBPS")) gb[0] = atof(getenv("BENCH_DDP_GBPS")); /* a fixed link instead */
  char env[64];
  snprintf(env, sizeof env, "%.6g", gb[0]);
  setenv("EBB_DIST_LINK_GBPS", env, 1);
  ebb_pg_t *pg = NULL;
  /* BENCH_DDP_BACKEND=nccl: the device group over NCCL (CUDA GPUs, one per rank). */
  const char *be = getenv("BENCH_DDP_BACKEND");
  BENCH_CHECK(ebb_pg_create(be && !strcmp(be, "nccl") ? EBB_DIST_NCCL : EBB_DIST_MPI, device, NULL, &pg));
  ebb_reducer_t *red = NULL;
  BENCH_CHECK(ebb_reducer_create(pg, w, L, NULL, &red));
  int nb = 0;
  BENCH_CHECK(ebb_reducer_num_buckets(red, &nb));

  /* 3. with the reducer */
  double with[MAX_STEPS];
  for (int s = -2; s < STEPS; s++) {
    if (s == 0) BENCH_CHECK(ebb_arena_reset_peak(device));
    BENCH_CHECK(ebb_reducer_zero_grad(red));
    BENCH_CHECK(ebb_barrier(cpu, NULL));
    BENCH_CHECK(ebb_dev_synchronize(device));
    uint64_t t0 = bench_now_ns();
    step(device, x);
    uint64_t tb = bench_now_ns();
    BENCH_CHECK(ebb_reducer_finish(red));
    uint64_t tf = bench_now_ns();
    BENCH_CHECK(ebb_dev_synchronize(device));
    uint64_t t1 = bench_now_ns();
    if (getenv("BENCH_DDP_VERBOSE") && rank == 0)
      fprintf(stderr, "step %d: forward+backward returned %.2f ms, finish %.2f ms, synchronised %.2f ms\n", s,
              (double)(tb - t0) / 1e6, (double)(tf - tb) / 1e6, (double)(t1 - tf) / 1e6);
    if (s >= 0) with[s] = (double)(t1 - t0) / 1e6, host_red[s] = (double)(tf - t0) / 1e3;
  }
  uint64_t peak_red = peak_allocated(device);
  double step_ms = bench_median(with, (size_t)STEPS);
  /* the host's cost of the reducer: forward, backward (hooks and issues) and finish, less the
   * same without it, per bucket (the device runs asynchronously: these are enqueue times) */
  double host_us = (bench_median(host_red, (size_t)STEPS) - bench_median(host_base, (size_t)STEPS)) / nb;

  /* 4. each bucket's all-reduce alone */
  int64_t max_numel = 0;
  double ar_total = 0, last_ms = 0;
  for (int b = 0; b < nb; b++) {
    int64_t numel = 0;
    BENCH_CHECK(ebb_reducer_bucket_info(red, b, &numel, NULL, NULL, NULL, 0));
    if (numel > max_numel) max_numel = numel;
    ebb_tensor_t *t = NULL;
    BENCH_CHECK(ebb_tensor_zeros(device, EBB_F32, 1, &numel, &t));
    double v[MAX_STEPS];
    int reps = STEPS < 5 ? STEPS : 5;
    for (int k = 0; k < reps; k++) {
      BENCH_CHECK(ebb_barrier(cpu, NULL));
      BENCH_CHECK(ebb_dev_synchronize(device));
      uint64_t t0 = bench_now_ns();
      BENCH_CHECK(ebb_all_reduce(pg, t, EBB_REDUCE_AVG, NULL));
      BENCH_CHECK(ebb_dev_synchronize(device));
      v[k] = (double)(bench_now_ns() - t0) / 1e6;
    }
    double m = bench_median(v, (size_t)reps);
    ar_total += m;
    if (b == nb - 1) last_ms = m;
    ebb_tensor_release(t);
  }
  if (rank == 0)
    printf("bench=ddp ranks=%d link_gbps=%.3g step_ms=%.2f base_step_ms=%.2f backward_ms=%.2f exposed_comm_ms=%.2f "
           "allreduce_ms=%.2f last_bucket_ms=%.2f extra_bytes=%lld bucket_bytes=%lld buckets=%d layers=%d width=%d batch=%d "
           "steps=%d host_us_per_bucket=%.1f\n",
           size, gb[0], step_ms, base_ms, bwd_ms, step_ms - base_ms, ar_total, last_ms, (long long)peak_red - (long long)peak_base,
           (long long)(max_numel * 4), nb, L, W, BT, STEPS, host_us);
  BENCH_CHECK(ebb_reducer_destroy(red));
  for (int l = 0; l < L; l++) ebb_tensor_release(w[l]);
  ebb_tensor_release(x);
  BENCH_CHECK(ebb_pg_destroy(pg));
  BENCH_CHECK(ebb_pg_destroy(cpu));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
