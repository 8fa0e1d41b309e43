/* bench_offload.c: offloaded saved tensors (ebb/autograd.h, "offloaded saved tensors") on a deep
 * MLP on one emulated device, against keeping every saved tensor and against a synchronous
 * offload. Built twice: ebb-bench-offload and, with OFFLOAD_BUDGET=1, ebb-bench-offload_budget.
 *
 * The model: LAYERS layers of h = y @ W (W [DIM, DIM] f32, a parameter) and y = relu(h) on a
 * batch [BATCH, DIM], the loss sum(y) of the last layer. Each layer saves two activations of
 * BATCH x DIM floats (the matmul its input y, the relu its input h; the weight stays), so the
 * saved activations are 2 BATCH / DIM = 16 times the parameters' bytes. A step: the input made on
 * the device (a fill, so no host copy), the forward, ebb_backward, ebb_dev_synchronize(0), timed
 * from the first op to the synchronisation; the gradients are dropped after it (no optimizer).
 * Why [2048, 256] and not smaller: the emulated link lands a copy in up to 16 pieces, one
 * clock_nanosleep each, and on this virtual machine a clock_nanosleep costs 20-25 us of CPU and
 * 30-150 us of wall time even when its deadline has passed, so a copy of a few hundred KiB takes
 * about 0.5 ms whatever the rate; a layer's forward has to be long beside that for the rate to
 * set the copy's time (here about 4 ms a layer, 2 MiB a tensor).
 *
 * The link: EBB_SIM_COPY_GBPS (each copy engine of the emulated driver sleeps bytes / rate) is
 * read once, at the first ebb_init of a process, so the program runs in three stages, each an
 * exec of itself (/proc/self/exe, the same arguments, EBB_BENCH_OFFLOAD_STAGE telling which):
 *   1. the launch: sets EBB_DRIVER=sim, EBB_SIM_DEVICES=1, EBB_SIM_PERTURB=0,
 *      EBB_SIM_LAUNCH_US=0 and OPENBLAS_NUM_THREADS=1 (OpenBLAS reads it when libebb loads it,
 *      before main, so it must be in the environment of a fresh image), then execs stage 2;
 *   2. calibrate: no link model; times one layer's forward (matmul + relu, device events,
 *      the minimum of 31) and sets the rate so that copying one layer's saved activations (2 x BATCH x DIM
 *      floats) takes TARGET_RATIO of it (0.5 here, 2.0 for offload_budget), then execs stage 3;
 *   3. run: times the layer's forward and the copies of its saved activations (two, as the
 *      offload makes them) again, under the link now modelled, and prints their ratio as
 *      copy_ratio; outside the accepted band (the machine is noisy) it corrects the rate by the
 *      ratio it read and execs stage 3 again, at most MAX_TRIES times in all, then goes on with
 *      the last one (the line shows it).
 * Compute runs on one host thread: OpenBLAS on one thread, on the device's compute engine thread,
 * so on this 2-core host the copy engines, which sleep for the link's time, have the other core,
 * as a GPU's copy engines do not take its compute units' time (other programs on the host and the
 * copy engines' own CPU time, above, still take from it: run it under nice -n -10).
 *
 * Modes: none (a: saved tensors stay on the device); sync (b: saved-tensor hooks: pack copies a
 * tensor of at least MIN_BYTES to pinned memory and waits for the copy, unpack copies it back and
 * waits for the reload: PyTorch's save_on_cpu; smaller ones, the weights, stay, as the offload
 * scope keeps them); prefetch (c: ebb_offload_scope_enter, min_bytes MIN_BYTES, a prefetch window
 * of WINDOW_LAYERS layers' saved activations, no device budget). Each mode-run empties the device
 * arena's and the pinned pool's caches and resets the peaks first, so its first step pays its own
 * set-up (pinned pool, arena growth) and its peaks are its own.
 *
 * ebb-bench-offload prints, after `rounds` rounds of the three modes (rotated: each mode runs
 * first, second and third), one line per mode:
 *   bench=offload mode=<none|sync|prefetch> copy_ratio= step_ms= first_step_ms=
 *     peak_device_bytes= peak_allocated_bytes= saved_peak_bytes= stalls=
 * step_ms: the median of the mode's timed steps over all rounds; first_step_ms: the median of its
 * rounds' first steps; peak_device_bytes: the device arena's peak reserved bytes (what an OOM
 * depends on), peak_allocated_bytes its peak allocated bytes, each the largest over the rounds;
 * stalls: ebb_offload_get_stats' stalls summed over every step of every round (stderr gives them
 * a step, with the reload traffic and the host's waits).
 * saved_peak_bytes: the peak, over a mode-run, of the bytes of device blocks holding saved
 * activations, replayed from the arena's history (ebb_alloc_history_get): every block the
 * forward allocates for an activation (under the owner scope EBB_OWNER_ACTIVATION; the last
 * layer's output, which nothing saves, and the loss are allocated under another scope) and
 * every reload (EBB_OWNER_SAVED: ebb's, and the sync hooks' own), from its alloc to its
 * FREE_COMPLETED, the moment the arena may hand the block out again (after a copy out still
 * reading it), not the free request; the largest over the rounds.
 *
 * ebb-bench-offload_budget (link at 2.0): (a) and (b) run once without a cap; the budget is half
 * of (a)'s peak reserved bytes, set as the arena's limit on all the device's bytes
 * (ebb_arena_set_limit), and the policy's device_budget_bytes is that budget less what the
 * device holds besides saved activations: (b)'s peak reserved bytes less its saved_peak_bytes
 * (parameters, gradients, the working set). Then `rounds` rounds, rotated, of (a) without the cap, its steps
 * split (the device waited for after the forward, for the bound's forward and backward), the
 * capped offload (policy as prefetch's, with that device budget) and (b) under the same cap. It
 * prints
 *   bench=offload_budget copy_ratio= step_ms= bound_ms= offloaded_bytes= peak_device_bytes=
 *     budget_bytes= sync_step_ms=
 * with B = (a)'s peak reserved bytes - the budget (the least that must leave the device for
 * (a)'s peak to fit), bound_ms = max((a)'s forward, copy-out of B) + max((a)'s backward, reload
 * of B) at the rates measured in stage 3, offloaded_bytes ebb's bytes_offloaded a step.
 *
 * EBB_BENCH_OFFLOAD_DEBUG=1 adds a stderr line per step (see debug_step).
 * Threading: ebb is called from the main thread only (the backward of one device runs there).
 * usage: ebb-bench-offload[_budget] [steps] [rounds]   (defaults 10 and 3: steps timed per
 *        mode-run, after one first step, and rounds of the modes)
 */
#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb/tensor.h"

#ifndef OFFLOAD_BUDGET
#define OFFLOAD_BUDGET 0
#endif
#ifndef LAYERS
#define LAYERS 16
#endif
#ifndef DIM
#define DIM 256
#endif
#ifndef BATCH
#define BATCH 2048
#endif
#define ACT_BYTES ((int64_t)BATCH * DIM * (int64_t)sizeof(float)) /* one activation */
#define LAYER_SAVED_BYTES (2 * ACT_BYTES)                         /* what one layer saves */
#define SAVED_BYTES (LAYERS * LAYER_SAVED_BYTES)
#define PARAM_BYTES ((int64_t)LAYERS * DIM * DIM * (int64_t)sizeof(float))
_Static_assert(SAVED_BYTES >= 8 * PARAM_BYTES, "the saved activations must be at least 8x the parameters");
#define MIN_BYTES ACT_BYTES /* offloaded: the activations; kept: the weights */
#define WINDOW_LAYERS 2     /* prefetch window, in layers' saved activations */

#if OFFLOAD_BUDGET
#define BENCH_NAME "offload_budget"
#define TARGET_RATIO 2.0
#define RATIO_TOL 0.1
#else
#define BENCH_NAME "offload"
#define TARGET_RATIO 0.5
#define RATIO_TOL 0.05
#endif
#define MAX_TRIES 6     /* stage-3 processes at most, the first included */
#define CAL_WARM 3      /* untimed layer forwards and copies before the timed ones */
#define CAL_REPS 31     /* timed ones (their minimum) */
#define MAX_STEPS 1000

enum mode { MODE_NONE, MODE_SYNC, MODE_PREFETCH, MODE_BUDGET };
static const char *const mode_names[] = {"none", "sync", "prefetch", "budget"};

struct model {
  ebb_tensor_t *w[LAYERS];
  ebb_stream_t *s; /* device 0's current stream, where the ops run */
  ebb_event_t *e0, *e1;
};

/* ---- stages ------------------------------------------------------------------------------------ */

static void reexec(char **argv) {
  fflush(NULL);
  execv("/proc/self/exe", argv);
  perror("bench_" BENCH_NAME ": execv /proc/self/exe");
  exit(1);
}

static void set_env(const char *name, const char *value) {
  if (setenv(name, value, 1) != 0) {
    perror("bench_" BENCH_NAME ": setenv");
    exit(1);
  }
}

/* ---- the model --------------------------------------------------------------------------------- */

static void model_init(struct model *m) {
  BENCH_CHECK(ebb_init());
  BENCH_CHECK(ebb_stream_current(0, &m->s));
  BENCH_CHECK(ebb_event_create(0, EBB_EVENT_TIMING, &m->e0));
  BENCH_CHECK(ebb_event_create(0, EBB_EVENT_TIMING, &m->e1));
  const int64_t shape[2] = {DIM, DIM};
  BENCH_CHECK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, "mlp.w"));
  for (int i = 0; i < LAYERS; i++) {
    ebb_tensor_t *r;
    /* He initialisation: relu activations keep their scale through the layers (no overflow, no
     * denormals slowing the kernels down). */
    BENCH_CHECK(ebb_tensor_randn(0, EBB_F32, 2, shape, 1, (uint64_t)i * DIM * DIM, &r));
    BENCH_CHECK(ebb_op_mul_scalar(r, sqrt(2.0 / DIM), &m->w[i]));
    BENCH_CHECK(ebb_tensor_release(r));
    BENCH_CHECK(ebb_tensor_set_requires_grad(m->w[i], true));
  }
  BENCH_CHECK(ebb_alloc_owner_pop());
  BENCH_CHECK(ebb_dev_synchronize(0));
}

/* The step's input, made on the device. */
static ebb_tensor_t *input(void) {
  const int64_t shape[2] = {BATCH, DIM};
  ebb_tensor_t *x;
  BENCH_CHECK(ebb_tensor_full(0, EBB_F32, 2, shape, 0.5, &x));
  return x;
}

/* ---- (b): synchronous offload through saved-tensor hooks ---------------------------------------- */

struct sync_packed {
  ebb_tensor_t *kept; /* a tensor below MIN_BYTES (a weight): kept as it is */
  void *host;         /* else its pinned copy */
  size_t bytes;
  ebb_tensor_info info;
};

static ebb_status sync_pack(void *user, const ebb_tensor_t *t, void **packed) {
  (void)user;
  struct sync_packed *p = calloc(1, sizeof *p);
  if (!p) return EBB_ENOMEM;
  ebb_status st = ebb_tensor_get_info(t, &p->info);
  if (st) goto fail_free;
  p->bytes = (size_t)p->info.numel * ebb_dtype_size(p->info.dtype);
  if (p->info.device == EBB_DEVICE_CPU || (int64_t)p->bytes < MIN_BYTES) {
    st = ebb_tensor_retain((ebb_tensor_t *)t); /* (pack may retain its borrowed input) */
    if (st) goto fail_free;
    p->kept = (ebb_tensor_t *)t;
    *packed = p;
    return EBB_OK;
  }
  st = ebb_pinned_alloc(p->bytes, p->info.device, &p->host);
  if (st) goto fail_free;
  ebb_event_t *done = NULL;
  st = ebb_event_create(p->info.device, EBB_EVENT_DEFAULT, &done);
  if (st) goto fail_unpin;
  /* On the current stream, after the kernel that made t; the host waits for the copy. */
  st = ebb_tensor_to_host_async(t, p->host, p->bytes, done);
  if (!st) st = ebb_event_synchronize(done);
  ebb_event_release(done);
  if (st) goto fail_unpin;
  *packed = p;
  return EBB_OK;
fail_unpin:
  ebb_pinned_free(p->host);
fail_free:
  free(p);
  return st;
}

static ebb_status sync_unpack(void *user, void *packed, ebb_tensor_t **out) {
  (void)user;
  struct sync_packed *p = packed;
  if (p->kept) {
    ebb_status st = ebb_tensor_retain(p->kept);
    if (!st) *out = p->kept;
    return st;
  }
  /* The reload is a saved tensor's block, as ebb's own reloads are (saved_peak_bytes). */
  ebb_status st = ebb_alloc_owner_push(EBB_OWNER_SAVED, "sync.reload");
  if (st) return st;
  ebb_tensor_t *t = NULL;
  st = ebb_tensor_from_host(p->info.device, p->info.dtype, p->info.ndim, p->info.shape, p->host, p->bytes, &t);
  ebb_alloc_owner_pop();
  if (st) return st;
  /* The host waits for the reload (on the node's stream, after its earlier work). */
  ebb_stream_t *s = NULL;
  st = ebb_stream_current(p->info.device, &s);
  if (!st) st = ebb_stream_synchronize(s);
  if (st) {
    ebb_tensor_release(t);
    return st;
  }
  *out = t;
  return EBB_OK;
}

static void sync_free(void *user, void *packed) {
  (void)user;
  struct sync_packed *p = packed;
  if (p->kept) ebb_tensor_release(p->kept);
  if (p->host) ebb_pinned_free(p->host); /* (the reload that read it was waited for) */
  free(p);
}

static const ebb_saved_hooks sync_hooks = {.pack = sync_pack, .unpack = sync_unpack, .free_packed = sync_free};

/* ---- a step ------------------------------------------------------------------------------------- */

/* The forward: the loss (a new reference). Activations are allocated under the ACTIVATION owner
 * scope, all of them saved; the last layer's output and the loss, which nothing saves, under
 * another one. */
static ebb_tensor_t *forward(const struct model *m) {
  BENCH_CHECK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "mlp.act"));
  ebb_tensor_t *y = input(), *h, *loss;
  for (int i = 0; i < LAYERS; i++) {
    BENCH_CHECK(ebb_op_matmul(y, m->w[i], &h));
    BENCH_CHECK(ebb_tensor_release(y));
    if (i == LAYERS - 1) BENCH_CHECK(ebb_alloc_owner_push(EBB_OWNER_OTHER, "mlp.out"));
    BENCH_CHECK(ebb_op_relu(h, &y));
    BENCH_CHECK(ebb_tensor_release(h));
  }
  BENCH_CHECK(ebb_op_sum(y, NULL, 0, false, &loss));
  BENCH_CHECK(ebb_tensor_release(y));
  BENCH_CHECK(ebb_alloc_owner_pop());
  BENCH_CHECK(ebb_alloc_owner_pop());
  return loss;
}

/* EBB_BENCH_OFFLOAD_DEBUG=1: a stderr line per step, for diagnosis: when the host had issued the
 * forward and the backward (it runs ahead of the device unless something waits), and the arena's
 * counters after the step (current/peak). */
static bool debug;

static void debug_step(enum mode mode, double issued_fwd, double issued_bwd, double ms) {
  ebb_arena_stats as;
  BENCH_CHECK(ebb_arena_get_stats(0, &as));
  fprintf(stderr, "  %s step %.2f ms (forward issued at %.2f, backward at %.2f): reserved %llu/%llu allocated %llu/%llu "
          "active %llu/%llu, steals %llu, driver allocations %llu\n", mode_names[mode], ms, issued_fwd, issued_bwd,
          (unsigned long long)as.reserved_bytes.current, (unsigned long long)as.reserved_bytes.peak,
          (unsigned long long)as.allocated_bytes.current, (unsigned long long)as.allocated_bytes.peak,
          (unsigned long long)as.active_bytes.current, (unsigned long long)as.active_bytes.peak,
          (unsigned long long)as.num_steals, (unsigned long long)as.num_device_alloc);
}

/* One training step in `mode` (pol: the offload policy of prefetch and budget); ms from its first
 * op until the device is idle. With split, the device is also waited for after the forward, and
 * *fwd_ms and *bwd_ms get the two halves. */
static double step(const struct model *m, enum mode mode, const ebb_offload_policy *pol, bool split, double *fwd_ms,
                   double *bwd_ms) {
  uint64_t t0 = bench_now_ns();
  if (mode == MODE_SYNC) BENCH_CHECK(ebb_saved_tensors_hooks_push(&sync_hooks));
  if (mode == MODE_PREFETCH || mode == MODE_BUDGET) BENCH_CHECK(ebb_offload_scope_enter(pol));
  ebb_tensor_t *loss = forward(m);
  if (mode == MODE_SYNC) BENCH_CHECK(ebb_saved_tensors_hooks_pop());
  if (mode == MODE_PREFETCH || mode == MODE_BUDGET) BENCH_CHECK(ebb_offload_scope_exit());
  uint64_t t1 = t0;
  double issued_fwd = (double)(bench_now_ns() - t0) / 1e6;
  if (split) {
    BENCH_CHECK(ebb_dev_synchronize(0));
    t1 = bench_now_ns();
  }
  const ebb_tensor_t *root = loss;
  BENCH_CHECK(ebb_backward(&root, NULL, 1, false, NULL, 0));
  BENCH_CHECK(ebb_tensor_release(loss));
  double issued_bwd = (double)(bench_now_ns() - t0) / 1e6;
  BENCH_CHECK(ebb_dev_synchronize(0));
  uint64_t t2 = bench_now_ns();
  for (int i = 0; i < LAYERS; i++) BENCH_CHECK(ebb_tensor_set_grad(m->w[i], NULL));
  if (debug) debug_step(mode, issued_fwd, issued_bwd, (double)(t2 - t0) / 1e6);
  if (split) {
    *fwd_ms = (double)(t1 - t0) / 1e6;
    *bwd_ms = (double)(t2 - t1) / 1e6;
  }
  return (double)(t2 - t0) / 1e6;
}

/* ---- calibration: a layer's forward and a copy of its saved bytes --------------------------------
 * Each the minimum of CAL_REPS device-timed runs: other programs on this host only add time (a
 * median moved by 30 % between processes a minute apart under their builds; the copies, set by
 * the link, hardly move), so the minimum is the estimate of the layer's own compute that repeats. */

/* The least device ms between e0 and e1 around one layer's forward (matmul + relu, as in the model). */
static double layer_forward_ms(const struct model *m) {
  double best = INFINITY;
  ebb_tensor_t *x = input();
  for (int r = 0; r < CAL_WARM + CAL_REPS; r++) {
    ebb_tensor_t *h, *y;
    BENCH_CHECK(ebb_dev_synchronize(0));
    BENCH_CHECK(ebb_event_record(m->e0, m->s));
    BENCH_CHECK(ebb_op_matmul(x, m->w[0], &h));
    BENCH_CHECK(ebb_op_relu(h, &y));
    BENCH_CHECK(ebb_event_record(m->e1, m->s));
    BENCH_CHECK(ebb_event_synchronize(m->e1));
    float ms = 0;
    BENCH_CHECK(ebb_event_elapsed(m->e0, m->e1, &ms));
    if (r >= CAL_WARM && ms < best) best = ms;
    BENCH_CHECK(ebb_tensor_release(y));
    BENCH_CHECK(ebb_tensor_release(h));
  }
  BENCH_CHECK(ebb_tensor_release(x));
  return best;
}

/* The least device ms of the copies of one layer's saved activations (two of ACT_BYTES, back to back, as
 * the offload makes them), device to pinned host (d2h) or back. */
static double layer_copy_ms(const struct model *m, bool d2h) {
  double best = INFINITY;
  void *dev = NULL, *host = NULL;
  BENCH_CHECK(ebb_arena_alloc(0, (size_t)LAYER_SAVED_BYTES, m->s, &dev));
  BENCH_CHECK(ebb_pinned_alloc((size_t)LAYER_SAVED_BYTES, 0, &host));
  memset(host, 0, (size_t)LAYER_SAVED_BYTES);
  for (int r = 0; r < CAL_WARM + CAL_REPS; r++) {
    BENCH_CHECK(ebb_dev_synchronize(0));
    BENCH_CHECK(ebb_event_record(m->e0, m->s));
    for (int k = 0; k < 2; k++) {
      char *dk = (char *)dev + k * ACT_BYTES, *hk = (char *)host + k * ACT_BYTES;
      BENCH_CHECK(ebb_copy_async(d2h ? (void *)hk : (void *)dk, d2h ? (void *)dk : (void *)hk, (size_t)ACT_BYTES, m->s));
    }
    BENCH_CHECK(ebb_event_record(m->e1, m->s));
    BENCH_CHECK(ebb_event_synchronize(m->e1));
    float ms = 0;
    BENCH_CHECK(ebb_event_elapsed(m->e0, m->e1, &ms));
    if (r >= CAL_WARM && ms < best) best = ms;
  }
  BENCH_CHECK(ebb_dev_synchronize(0));
  BENCH_CHECK(ebb_arena_free(dev));
  BENCH_CHECK(ebb_pinned_free(host));
  return best;
}

/* ---- a mode-run: caches emptied, one first step, `steps` timed ones -------------------------------- */

struct run_result {
  double first_ms;
  double *ms;       /* steps entries */
  double *fwd, *bwd; /* steps entries, split runs only: the two halves */
  uint64_t reserved_peak, allocated_peak, saved_peak;
  ebb_offload_stats off;
  ebb_arena_stats arena;
};

static uint64_t history_total(void) {
  size_t count = 0;
  uint64_t total = 0;
  BENCH_CHECK(ebb_alloc_history_get(0, NULL, 0, &count, &total));
  return total;
}

/* The peak of live saved-activation bytes over the arena's actions since `total0` (file comment). */
static uint64_t saved_peak_since(uint64_t total0) {
  size_t held = 0;
  uint64_t total = 0;
  BENCH_CHECK(ebb_alloc_history_get(0, NULL, 0, &held, &total));
  uint64_t n = total - total0;
  if (n > held) {
    fprintf(stderr, BENCH_NAME ": the allocator's history holds %zu of the run's %llu actions: saved_peak_bytes "
            "undercounts (raise EBB_ALLOC_CONF history:N)\n", held, (unsigned long long)n);
    n = held;
  }
  ebb_alloc_trace_entry *e = calloc(n ? n : 1, sizeof *e);
  struct live {
    uint64_t addr, size;
  } *live = calloc(n ? n : 1, sizeof *live);
  if (!e || !live) {
    fprintf(stderr, BENCH_NAME ": no memory for %llu history entries\n", (unsigned long long)n);
    exit(1);
  }
  size_t got = 0, nlive = 0;
  BENCH_CHECK(ebb_alloc_history_get(0, e, (size_t)n, &got, NULL));
  uint64_t cur = 0, peak = 0;
  for (size_t i = 0; i < got; i++) {
    if (e[i].action == EBB_ACT_ALLOC && (e[i].owner_cat == EBB_OWNER_ACTIVATION || e[i].owner_cat == EBB_OWNER_SAVED)) {
      live[nlive].addr = e[i].addr;
      live[nlive++].size = e[i].size;
      cur += e[i].size;
      if (cur > peak) peak = cur;
    } else if (e[i].action == EBB_ACT_FREE_COMPLETED) {
      for (size_t j = 0; j < nlive; j++)
        if (live[j].addr == e[i].addr) {
          cur -= live[j].size;
          live[j] = live[--nlive];
          break;
        }
    }
  }
  free(live);
  free(e);
  return peak;
}

static void run_mode(const struct model *m, enum mode mode, const ebb_offload_policy *pol, int steps, bool split,
                     struct run_result *r) {
  BENCH_CHECK(ebb_dev_synchronize(0));
  BENCH_CHECK(ebb_arena_empty_cache(0));
  BENCH_CHECK(ebb_pinned_empty_cache());
  BENCH_CHECK(ebb_arena_reset_peak(0));
  ebb_offload_reset_stats();
  uint64_t h0 = history_total();
  ebb_arena_stats before;
  BENCH_CHECK(ebb_arena_get_stats(0, &before));
  double f = 0, b = 0;
  r->first_ms = step(m, mode, pol, split, &f, &b);
  for (int i = 0; i < steps; i++) r->ms[i] = step(m, mode, pol, split, &r->fwd[i], &r->bwd[i]);
  BENCH_CHECK(ebb_arena_get_stats(0, &r->arena));
  r->arena.num_ooms -= before.num_ooms; /* (counters since ebb_init: this run's own) */
  r->arena.num_alloc_retries -= before.num_alloc_retries;
  r->arena.num_syncs -= before.num_syncs;
  r->reserved_peak = r->arena.reserved_bytes.peak;
  r->allocated_peak = r->arena.allocated_bytes.peak;
  r->saved_peak = saved_peak_since(h0);
  BENCH_CHECK(ebb_offload_get_stats(&r->off));
}

/* What a mode gathered over its rounds. */
struct mode_acc {
  double ms[MAX_STEPS * 8], fwd[MAX_STEPS * 8], bwd[MAX_STEPS * 8];
  int n;
  double first[8];
  int nfirst;
  uint64_t reserved_peak, allocated_peak, saved_peak;
  uint64_t stalls, stall_ns, offloaded, prefetched, on_demand, forward_waits, forward_wait_ns, ooms, retries, syncs;
};

static void acc_add(struct mode_acc *a, const struct run_result *r, int steps) {
  for (int i = 0; i < steps; i++) {
    a->fwd[a->n] = r->fwd[i];
    a->bwd[a->n] = r->bwd[i];
    a->ms[a->n++] = r->ms[i];
  }
  a->first[a->nfirst++] = r->first_ms;
  if (r->reserved_peak > a->reserved_peak) a->reserved_peak = r->reserved_peak;
  if (r->allocated_peak > a->allocated_peak) a->allocated_peak = r->allocated_peak;
  if (r->saved_peak > a->saved_peak) a->saved_peak = r->saved_peak;
  a->stalls += r->off.stalls;
  a->stall_ns += r->off.stall_ns;
  a->offloaded += r->off.bytes_offloaded;
  a->prefetched += r->off.bytes_prefetched;
  a->on_demand += r->off.bytes_reloaded_on_demand;
  a->forward_waits += r->off.forward_waits;
  a->forward_wait_ns += r->off.forward_wait_ns;
  a->ooms += r->arena.num_ooms;
  a->retries += r->arena.num_alloc_retries;
  a->syncs += r->arena.num_syncs;
}

static struct mode_acc acc[4];

/* The stderr line of a mode: what its figures came from. */
static void acc_report(enum mode md, const char *note, int steps_each) {
  struct mode_acc *a = &acc[md];
  fprintf(stderr, BENCH_NAME ": %s%s: %d runs of 1 + %d steps; first steps", mode_names[md], note, a->nfirst, steps_each);
  for (int i = 0; i < a->nfirst; i++) fprintf(stderr, " %.2f", a->first[i]);
  double lo = a->ms[0], hi = a->ms[0];
  for (int i = 0; i < a->n; i++) {
    if (a->ms[i] < lo) lo = a->ms[i];
    if (a->ms[i] > hi) hi = a->ms[i];
  }
  int runs = a->nfirst ? a->nfirst : 1;
  fprintf(stderr, " ms; steps %.2f-%.2f ms; offloaded %.0f, prefetched %.0f, reloaded on demand %.0f bytes a step; "
          "stalls %.1f a step (%.3f ms); forward waits %.1f a step (%.3f ms); arena OOMs %llu, retries %llu, host waits %llu\n",
          lo, hi, (double)a->offloaded / (runs * (steps_each + 1)), (double)a->prefetched / (runs * (steps_each + 1)),
          (double)a->on_demand / (runs * (steps_each + 1)), (double)a->stalls / (runs * (steps_each + 1)),
          (double)a->stall_ns / 1e6 / (runs * (steps_each + 1)), (double)a->forward_waits / (runs * (steps_each + 1)),
          (double)a->forward_wait_ns / 1e6 / (runs * (steps_each + 1)), (unsigned long long)a->ooms,
          (unsigned long long)a->retries, (unsigned long long)a->syncs);
}

#if !OFFLOAD_BUDGET
static double acc_first(struct mode_acc *a) {
  double v[8];
  memcpy(v, a->first, sizeof v);
  return bench_median(v, (size_t)a->nfirst);
}
#endif


/* ---- stage 3 ---------------------------------------------------------------------------------- */

/* Times the layer and its copies under the link now modelled; execs a corrected stage 3 when the
 * ratio is out of its band and tries are left. Returns the ratio; *d2h_ms, *h2d_ms: the copies. */
static double check_ratio(const struct model *m, char **argv, double *d2h_ms, double *h2d_ms) {
  double layer_ms = layer_forward_ms(m);
  *d2h_ms = layer_copy_ms(m, true);
  *h2d_ms = layer_copy_ms(m, false);
  double ratio = *d2h_ms / layer_ms;
  const char *gbps_s = getenv("EBB_SIM_COPY_GBPS"), *try_s = getenv("EBB_BENCH_OFFLOAD_TRY");
  double gbps = atof(gbps_s ? gbps_s : "0");
  int tries = atoi(try_s ? try_s : "1");
  fprintf(stderr, BENCH_NAME ": try %d: EBB_SIM_COPY_GBPS=%s; a layer's forward %.3f ms, its saved bytes (%lld) d2h %.3f ms, "
          "h2d %.3f ms: copy_ratio %.3f (target %.2f +- %.2f)\n", tries, gbps_s ? gbps_s : "(unset)", layer_ms,
          (long long)LAYER_SAVED_BYTES, *d2h_ms, *h2d_ms, ratio, TARGET_RATIO, RATIO_TOL);
  if (fabs(ratio - TARGET_RATIO) > RATIO_TOL) {
    if (tries >= MAX_TRIES) {
      fprintf(stderr, BENCH_NAME ": copy_ratio still out of its band after %d tries; going on with it\n", tries);
      return ratio;
    }
    char buf[64];
    snprintf(buf, sizeof buf, "%.6f", gbps * ratio / TARGET_RATIO);
    set_env("EBB_SIM_COPY_GBPS", buf);
    snprintf(buf, sizeof buf, "%d", tries + 1);
    set_env("EBB_BENCH_OFFLOAD_TRY", buf);
    reexec(argv);
  }
  return ratio;
}

static ebb_offload_policy prefetch_policy(int64_t device_budget) {
  ebb_offload_policy p = {.version = EBB_OFFLOAD_POLICY_VERSION,
                          .min_bytes = MIN_BYTES,
                          .prefetch_window_bytes = WINDOW_LAYERS * LAYER_SAVED_BYTES,
                          .device_budget_bytes = device_budget};
  return p;
}

static struct run_result *new_result(int steps) {
  struct run_result *r = calloc(1, sizeof *r);
  if (r) {
    r->ms = calloc((size_t)steps, sizeof *r->ms);
    r->fwd = calloc((size_t)steps, sizeof *r->fwd);
    r->bwd = calloc((size_t)steps, sizeof *r->bwd);
  }
  if (!r || !r->ms || !r->fwd || !r->bwd) {
    fprintf(stderr, BENCH_NAME ": out of memory\n");
    exit(1);
  }
  return r;
}

static void free_result(struct run_result *r) {
  free(r->ms);
  free(r->fwd);
  free(r->bwd);
  free(r);
}

#if !OFFLOAD_BUDGET
static void run_offload(const struct model *m, double ratio, int steps, int rounds) {
  const enum mode order[3] = {MODE_NONE, MODE_SYNC, MODE_PREFETCH};
  ebb_offload_policy pol = prefetch_policy(0);
  struct run_result *r = new_result(steps);
  for (int round = 0; round < rounds; round++)
    for (int k = 0; k < 3; k++) {
      enum mode md = order[(round + k) % 3]; /* rotated: each mode first, second and third */
      run_mode(m, md, &pol, steps, false, r);
      acc_add(&acc[md], r, steps);
    }
  for (int k = 0; k < 3; k++) {
    struct mode_acc *a = &acc[order[k]];
    acc_report(order[k], "", steps);
    double first = acc_first(a);
    printf("bench=offload mode=%s copy_ratio=%.3f step_ms=%.3f first_step_ms=%.3f peak_device_bytes=%llu "
           "peak_allocated_bytes=%llu saved_peak_bytes=%llu stalls=%llu\n",
           mode_names[order[k]], ratio, bench_median(a->ms, (size_t)a->n), first, (unsigned long long)a->reserved_peak,
           (unsigned long long)a->allocated_peak, (unsigned long long)a->saved_peak, (unsigned long long)a->stalls);
  }
  free_result(r);
}
#else
/* Caps the device arena at `bytes` (0: no cap), its cache emptied first so the cap holds from
 * the next allocation. */
static void cap_device(uint64_t bytes) {
  BENCH_CHECK(ebb_dev_synchronize(0));
  BENCH_CHECK(ebb_arena_empty_cache(0));
  BENCH_CHECK(ebb_arena_set_limit(0, (size_t)bytes));
}

static void run_budget(const struct model *m, double ratio, double d2h_ms, double h2d_ms, int steps, int rounds) {
  struct run_result *r = new_result(steps);
  /* The budget from (a)'s peak, and what the device holds besides saved activations from (b)'s
   * (its reserved peak less its saved peak: a tensor being copied out or reloaded is a saved
   * one, which device_budget_bytes counts), both without a cap (their peaks repeat to the byte
   * from run to run). */
  run_mode(m, MODE_NONE, NULL, steps, false, r);
  uint64_t peak_a = r->reserved_peak;
  run_mode(m, MODE_SYNC, NULL, steps, false, r);
  uint64_t rest = r->reserved_peak - r->saved_peak; /* (b)'s own saved tensors in flight are saved bytes */
  uint64_t budget = peak_a / 2;
  int64_t saved_budget = (int64_t)budget - (int64_t)rest;
  uint64_t least = peak_a - budget; /* B: what must leave for (a)'s peak to fit */
  fprintf(stderr, BENCH_NAME ": (a) peak %llu; (b) peak less its saved peak %llu; budget %llu, of which saved activations %lld "
          "(device_budget_bytes); B %llu\n", (unsigned long long)peak_a, (unsigned long long)rest,
          (unsigned long long)budget, (long long)saved_budget, (unsigned long long)least);
  if (saved_budget < WINDOW_LAYERS * LAYER_SAVED_BYTES) {
    fprintf(stderr, BENCH_NAME ": the saved-tensor budget is below the prefetch window; no figure\n");
    exit(1);
  }
  ebb_offload_policy pol = prefetch_policy(saved_budget);
  /* Rounds, rotated: (a) without the cap, its steps split (the device waited for after the
   * forward) for the bound's forward and backward; the offload and (b) under the cap. */
  const enum mode order[3] = {MODE_NONE, MODE_BUDGET, MODE_SYNC};
  for (int round = 0; round < rounds; round++)
    for (int k = 0; k < 3; k++) {
      enum mode md = order[(round + k) % 3];
      cap_device(md == MODE_NONE ? 0 : budget);
      run_mode(m, md, &pol, steps, md == MODE_NONE, r);
      acc_add(&acc[md], r, steps);
    }
  cap_device(0);
  acc_report(MODE_NONE, " (no cap, split)", steps);
  acc_report(MODE_SYNC, " (under the cap)", steps);
  acc_report(MODE_BUDGET, "", steps);
  struct mode_acc *an = &acc[MODE_NONE], *a = &acc[MODE_BUDGET];
  double fwd_ms = bench_median(an->fwd, (size_t)an->n), bwd_ms = bench_median(an->bwd, (size_t)an->n);
  /* The bound: copy-out of B beside the forward, its reload beside the backward, at the link's
   * measured rates. */
  double out_ms = (double)least * d2h_ms / (double)LAYER_SAVED_BYTES;
  double in_ms = (double)least * h2d_ms / (double)LAYER_SAVED_BYTES;
  double bound = fmax(fwd_ms, out_ms) + fmax(bwd_ms, in_ms);
  uint64_t steps_all = (uint64_t)a->nfirst * (uint64_t)(steps + 1);
  fprintf(stderr, BENCH_NAME ": bound: max((a)'s forward %.3f, copy-out of B %.3f) + max((a)'s backward %.3f, reload of B "
          "%.3f) ms; (a)'s steps, split, %.3f ms\n", fwd_ms, out_ms, bwd_ms, in_ms, bench_median(an->ms, (size_t)an->n));
  printf("bench=offload_budget copy_ratio=%.3f step_ms=%.3f bound_ms=%.3f offloaded_bytes=%llu peak_device_bytes=%llu "
         "budget_bytes=%llu sync_step_ms=%.3f\n",
         ratio, bench_median(a->ms, (size_t)a->n), bound, (unsigned long long)(a->offloaded / steps_all),
         (unsigned long long)a->reserved_peak, (unsigned long long)budget,
         bench_median(acc[MODE_SYNC].ms, (size_t)acc[MODE_SYNC].n));
  free_result(r);
}
#endif

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 10, rounds = argc > 2 ? atoi(argv[2]) : 3;
  if (argc > 3 || steps < 1 || steps > MAX_STEPS || rounds < 1 || rounds > 8) {
    fprintf(stderr, "usage: ebb-bench-" BENCH_NAME " [steps 1..%d] [rounds 1..8]\n", MAX_STEPS);
    return 2;
  }
  const char *stage = getenv("EBB_BENCH_OFFLOAD_STAGE");
  debug = getenv("EBB_BENCH_OFFLOAD_DEBUG") && *getenv("EBB_BENCH_OFFLOAD_DEBUG");
  if (!stage || !*stage) { /* stage 1 */
    const char *user_link = getenv("EBB_SIM_COPY_GBPS");
    if (user_link && *user_link)
      fprintf(stderr, BENCH_NAME ": EBB_SIM_COPY_GBPS=%s is replaced by the calibrated link\n", user_link);
    set_env("EBB_DRIVER", "sim");
    set_env("EBB_SIM_DEVICES", "1");
    set_env("EBB_SIM_PERTURB", "0");
    set_env("EBB_SIM_LAUNCH_US", "0");
    set_env("OPENBLAS_NUM_THREADS", "1");
    unsetenv("EBB_SIM_COPY_GBPS");
    unsetenv("EBB_BENCH_OFFLOAD_TRY");
    set_env("EBB_BENCH_OFFLOAD_STAGE", "calibrate");
    reexec(argv);
  }
  if (openblas_get_num_threads() != 1) {
    fprintf(stderr, BENCH_NAME ": OpenBLAS runs %d threads, 1 expected (OPENBLAS_NUM_THREADS=%s)\n",
            openblas_get_num_threads(), getenv("OPENBLAS_NUM_THREADS") ? getenv("OPENBLAS_NUM_THREADS") : "(unset)");
    return 1;
  }
  struct model m;
  model_init(&m);
  if (strcmp(stage, "calibrate") == 0) { /* stage 2 */
    double layer_ms = layer_forward_ms(&m);
    /* GB/s = bytes per ns: the layer's saved bytes in TARGET_RATIO of its forward. */
    double gbps = (double)LAYER_SAVED_BYTES / (TARGET_RATIO * layer_ms * 1e6);
    char buf[64];
    snprintf(buf, sizeof buf, "%.6f", gbps);
    fprintf(stderr, BENCH_NAME ": calibration: a layer's forward %.3f ms without a link model: EBB_SIM_COPY_GBPS=%s\n",
            layer_ms, buf);
    set_env("EBB_SIM_COPY_GBPS", buf);
    set_env("EBB_BENCH_OFFLOAD_TRY", "1");
    set_env("EBB_BENCH_OFFLOAD_STAGE", "run");
    reexec(argv);
  }
  double d2h_ms = 0, h2d_ms = 0;
  double ratio = check_ratio(&m, argv, &d2h_ms, &h2d_ms); /* stage 3 */
  fprintf(stderr, BENCH_NAME ": [%d, %d] f32 batch, %d layers of [%d, %d]: saved activations %lld bytes, parameters %lld "
          "(%.1fx); OpenBLAS on 1 thread\n", BATCH, DIM, LAYERS, DIM, DIM, (long long)SAVED_BYTES, (long long)PARAM_BYTES,
          (double)SAVED_BYTES / (double)PARAM_BYTES);
#if OFFLOAD_BUDGET
  run_budget(&m, ratio, d2h_ms, h2d_ms, steps, rounds);
#else
  (void)d2h_ms;
  (void)h2d_ms;
  run_offload(&m, ratio, steps, rounds);
#endif
  return 0;
}
