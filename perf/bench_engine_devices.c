/* bench_engine_devices.c: the multi-device backward engine on 2 emulated devices.
 *
 * Prints one line:
 *   bench=engine_devices one_dev_ms=X two_dev_ms=Y speedup=X/Y calling_thread_ns_per_node=A
 *     worker_thread_ns_per_node=B syscalls_per_backward=N events_per_cross_stream_edge=E
 * (targets: speedup >= 1.8, syscalls_per_backward 0, events_per_cross_stream_edge <= 1).
 * 1. one_dev_ms, two_dev_ms: two balanced independent branches (a leaf, 16 elementwise ops on a
 *    [64,64] f32 tensor, a sum to a scalar loss), one ebb_backward with both losses as roots,
 *    timed from the call until both devices are synchronised; the branches on devices 0 and 1
 *    against both on device 0. Kernels last EBB_SIM_LAUNCH_US (200 us) on their device's compute
 *    engine, sleeping, so the figure is the overlap of the devices' work, not the host's two
 *    cores. stderr adds the two-device time with EBB_ENGINE_CALLING_THREAD: launches return at
 *    once, so a single thread overlaps the devices too while its work per node stays well under
 *    a kernel's time; the difference is what the workers add.
 * 2. calling_thread_ns_per_node, worker_thread_ns_per_node: the single-device graph of 1, timing
 *    model off, with EBB_ENGINE_AUTO (the calling thread) and EBB_ENGINE_WORKERS (device 0's
 *    worker), host time of the call over the nodes it ran (engine stats' nodes_run).
 * 3. syscalls_per_backward: the graph of 1 on CPU tensors, calling-thread path, timing model
 *    off; the parent traces the child running it (ptrace, all its threads) and counts the
 *    system calls entered between a begin and an end marker around each warm ebb_backward.
 * 4. events_per_cross_stream_edge: a chain whose every node-to-node edge crosses streams.
 * Each part runs in a child process: the emulated driver reads EBB_SIM_* once per process (its
 * cuInit runs once, and ebb keeps the driver loaded across ebb_shutdown), so "shut down, change
 * the variable, initialise again" would keep the first timing model. The children set EBB_DRIVER=
 * sim, EBB_SIM_DEVICES=2, EBB_SIM_PERTURB=0 (its random delays would say nothing about ebb) and
 * EBB_SIM_LAUNCH_US themselves. Threading: the parent never calls ebb (it forks and traces); each
 * child calls ebb from its main thread only. Diagnostics go to stderr.
 * usage: ebb-bench-engine_devices [reps] [launch_us]   (defaults 21 and 200)
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_pile.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"

/* The branches' tensors are [SIDE, SIDE] f32. Not [256,256]: an emulated kernel first does its
 * work on its engine's host thread, then sleeps out the rest of EBB_SIM_LAUNCH_US, and at
 * [256,256] that work took ~70-80 us of the 200 (on a 2-core host: the ~72 kernels of the
 * one-device backward took 5 to 6 ms with EBB_SIM_LAUNCH_US=0, and two devices were no faster),
 * so the devices' engine threads competed with the program for the cores; at [64,64] it is
 * under 10 us. (-DSIDE=256 builds the other.) */
#ifndef SIDE
#define SIDE 64
#endif
#define CHAIN_OPS 16    /* elementwise ops per branch */
#define PATH_WARM 3     /* part 2: untimed backward calls per mode first */
#define PATH_REPS 101   /* part 2: timed backward calls per mode */
#define SYS_WARM 10     /* part 3: backward calls before the counted ones */
#define SYS_ITERS 20    /* part 3: counted backward calls */
#define EDGE_OPS 31     /* part 4: ops in the chain; odd, see cross_stream_events */
#define EDGE_REPS 5     /* part 4: backward calls (one graph each) */
#define MAX_NR 64       /* part 3: distinct system calls tallied for the stderr table */

/* What the children measured, in memory shared with the parent (MAP_SHARED before fork). */
struct shared {
  double one_dev_ms, two_dev_ms;
  double calling_ns, worker_ns;
  uint64_t events, engine_edges, built_edges;
  int traceme_errno; /* part 3: PTRACE_TRACEME's errno in the child, 0 when it worked */
};

/* ---- graphs ------------------------------------------------------------------------------- */

/* One branch on `device` (a device ordinal or EBB_DEVICE_CPU): a leaf x that requires grad,
 * CHAIN_OPS ops alternating y*0.9 and tanh(y) (each backward one elementwise kernel), summed to a
 * scalar loss, which is returned. 2 + CHAIN_OPS nodes run in its backward (AccumulateGrad, the
 * ops, SumBackward). */
static const ebb_tensor_t *branch(struct bench_pile *p, int device) {
  const int64_t shape[2] = {SIDE, SIDE};
  ebb_tensor_t *x, *o;
  BENCH_CHECK(ebb_tensor_full(device, EBB_F32, 2, shape, 0.5, &x));
  BENCH_CHECK(ebb_tensor_set_requires_grad(x, true));
  ebb_tensor_t *y = bench_pile_keep(p, x);
  for (int i = 0; i < CHAIN_OPS; i++) {
    if (i % 2)
      BENCH_CHECK(ebb_op_tanh(y, &o));
    else
      BENCH_CHECK(ebb_op_mul_scalar(y, 0.9, &o));
    y = bench_pile_keep(p, o);
  }
  BENCH_CHECK(ebb_op_sum(y, NULL, 0, false, &o));
  return bench_pile_keep(p, o);
}

static void sync_devices(void) {
  BENCH_CHECK(ebb_dev_synchronize(0));
  BENCH_CHECK(ebb_dev_synchronize(1));
}

static ebb_autograd_engine_stats stats(void) {
  ebb_autograd_engine_stats s;
  BENCH_CHECK(ebb_autograd_get_engine_stats(&s));
  return s;
}

/* The children's settings (read by ebb_init, once per process: see the top). */
static void sim_env(const char *launch_us) {
  setenv("EBB_DRIVER", "sim", 1);
  setenv("EBB_SIM_DEVICES", "2", 1);
  setenv("EBB_SIM_PERTURB", "0", 1);
  setenv("EBB_SIM_LAUNCH_US", launch_us, 1);
}

static void init_two_devices(void) {
  BENCH_CHECK(ebb_init());
  int n = 0;
  BENCH_CHECK(ebb_dev_count(&n));
  if (n < 2) {
    fprintf(stderr, "bench_engine_devices: needs 2 devices, the driver has %d\n", n);
    exit(1);
  }
}

/* ---- part 1: one device against two, with modelled kernel time ------------------------------ */

/* One backward of the two branches, the second on device dev_b: ms from the call until both
 * devices are idle. The forward is built again each time and freed by the backward (no
 * retain_graph): that is a training step's backward, saved tensors released as it goes. The
 * forward's own kernels are waited for before the clock starts. */
static double two_branch_ms(int dev_b, ebb_engine_mode mode, uint64_t *on_workers) {
  struct bench_pile p = {0};
  const ebb_tensor_t *roots[2];
  roots[0] = branch(&p, 0);
  roots[1] = branch(&p, dev_b);
  sync_devices();
  BENCH_CHECK(ebb_autograd_set_engine_mode(mode));
  ebb_autograd_engine_stats s0 = stats();
  uint64_t t0 = bench_now_ns();
  BENCH_CHECK(ebb_backward(roots, NULL, 2, false, NULL, 0));
  sync_devices();
  uint64_t t1 = bench_now_ns();
  *on_workers = stats().nodes_run_on_workers - s0.nodes_run_on_workers;
  BENCH_CHECK(ebb_autograd_set_engine_mode(EBB_ENGINE_AUTO));
  bench_pile_release(&p);
  bench_pile_free(&p);
  return (double)(t1 - t0) / 1e6;
}

static void part_devices(struct shared *sh, int reps, const char *launch_us) {
  sim_env(launch_us);
  init_two_devices();
  uint64_t w1 = 0, w2 = 0, w3 = 0;
  /* Warm-up: starts the device workers (lazily, at the first two-device backward) and fills the
   * arenas; interleaved afterwards so both sides see the same machine. */
  (void)two_branch_ms(0, EBB_ENGINE_AUTO, &w1);
  (void)two_branch_ms(1, EBB_ENGINE_AUTO, &w2);
  (void)two_branch_ms(1, EBB_ENGINE_CALLING_THREAD, &w3);
  double *one = malloc(sizeof(double) * (size_t)reps), *two = malloc(sizeof(double) * (size_t)reps),
         *two_ct = malloc(sizeof(double) * (size_t)reps);
  if (!one || !two || !two_ct) exit(1);
  for (int r = 0; r < reps; r++) {
    one[r] = two_branch_ms(0, EBB_ENGINE_AUTO, &w1);
    two[r] = two_branch_ms(1, EBB_ENGINE_AUTO, &w2);
    two_ct[r] = two_branch_ms(1, EBB_ENGINE_CALLING_THREAD, &w3);
  }
  sh->one_dev_ms = bench_median(one, (size_t)reps);
  sh->two_dev_ms = bench_median(two, (size_t)reps);
  /* For the reader: the same two-device graph with every node on the calling thread. Launches
   * return at once, so one thread can keep both devices busy when the host's work per node is
   * far below a kernel's time; the gap between the two figures is what the workers add. */
  fprintf(stderr, "engine_devices: part 1 (EBB_SIM_LAUNCH_US=%s, %d reps): two devices with EBB_ENGINE_CALLING_THREAD: %.3f ms (speedup %.2f); nodes on workers in the last backward: one device %llu, two devices %llu, calling thread %llu\n",
          launch_us, reps, bench_median(two_ct, (size_t)reps), sh->one_dev_ms / bench_median(two_ct, (size_t)reps),
          (unsigned long long)w1, (unsigned long long)w2, (unsigned long long)w3);
  free(one);
  free(two);
  free(two_ct);
  BENCH_CHECK(ebb_shutdown());
}

/* ---- part 2: the calling thread against device 0's worker --------------------------------- */

/* The one-device graph of part 1 backward in `mode`: host ns from the call to its return over
 * the nodes it ran. Kernels run on without the timing model while the clock runs (on the
 * driver's threads, as a GPU's would); they are waited for outside the clock. */
static double ns_per_node(ebb_engine_mode mode, uint64_t *nodes, uint64_t *on_workers) {
  struct bench_pile p = {0};
  const ebb_tensor_t *roots[2];
  roots[0] = branch(&p, 0);
  roots[1] = branch(&p, 0);
  sync_devices();
  BENCH_CHECK(ebb_autograd_set_engine_mode(mode));
  ebb_autograd_engine_stats s0 = stats();
  uint64_t t0 = bench_now_ns();
  BENCH_CHECK(ebb_backward(roots, NULL, 2, false, NULL, 0));
  uint64_t t1 = bench_now_ns();
  ebb_autograd_engine_stats s1 = stats();
  BENCH_CHECK(ebb_autograd_set_engine_mode(EBB_ENGINE_AUTO));
  sync_devices();
  bench_pile_release(&p);
  bench_pile_free(&p);
  *nodes = s1.nodes_run - s0.nodes_run;
  *on_workers = s1.nodes_run_on_workers - s0.nodes_run_on_workers;
  if (*nodes == 0) {
    fprintf(stderr, "bench_engine_devices: the engine's stats counted no node run\n");
    exit(1);
  }
  return (double)(t1 - t0) / (double)*nodes;
}

static void part_paths(struct shared *sh) {
  double calling[PATH_REPS], worker[PATH_REPS];
  uint64_t nc = 0, nw = 0, wc = 0, ww = 0;
  for (int r = 0; r < PATH_WARM; r++) {
    (void)ns_per_node(EBB_ENGINE_AUTO, &nc, &wc);
    (void)ns_per_node(EBB_ENGINE_WORKERS, &nw, &ww);
  }
  for (int r = 0; r < PATH_REPS; r++) {
    calling[r] = ns_per_node(EBB_ENGINE_AUTO, &nc, &wc);
    worker[r] = ns_per_node(EBB_ENGINE_WORKERS, &nw, &ww);
  }
  fprintf(stderr, "engine_devices: part 2 (%d reps): nodes run (on workers) a backward: calling thread %llu (%llu), workers %llu (%llu)\n",
          PATH_REPS, (unsigned long long)nc, (unsigned long long)wc, (unsigned long long)nw, (unsigned long long)ww);
  if (wc != 0 || ww == 0)
    fprintf(stderr, "engine_devices: part 2: the modes did not take the paths asked for (see the counts above)\n");
  sh->calling_ns = bench_median(calling, PATH_REPS);
  sh->worker_ns = bench_median(worker, PATH_REPS);
}

/* ---- part 4: events per cross-stream edge ----------------------------------------------------- */

/* A chain on device 0 whose every node-to-node edge crosses streams, A being the caller's
 * current stream and B a pool stream:
 *   AccumulateGrad(A) <- op0(B) <- op1(A) <- ... <- op30(B) <- SumBackward(A) <- root (on A).
 * The leaf's AccumulateGrad is made on A (through a gradient edge taken while A is current)
 * before op0 runs on B, so that edge crosses too (the mismatch case: its warning is turned off
 * here). With EDGE_OPS odd the sum lands on A, the stream the root's gradient is produced on: the
 * root's hand-off crosses nothing, and every edge counted is a node-to-node edge. The leaf's
 * stream being the caller's current one, the end of the backward needs no wait either. The figure
 * divides the engine's events_recorded by the edges built here (EDGE_OPS + 1 a graph), not by its
 * own cross_stream_edges count, so a miscount there cannot flatter it; the engine's count goes to
 * stderr beside it. In forward, each op's stream waits for the previous op's (the user's
 * hand-off, which the engine does not count). */
static void cross_stream_events(struct shared *sh) {
  ebb_stream_t *a, *b;
  BENCH_CHECK(ebb_stream_current(0, &a));
  BENCH_CHECK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &b));
  bool warn = ebb_autograd_warn_on_accumulate_grad_stream_mismatch();
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(false);
  ebb_autograd_engine_stats s0 = stats();
  for (int r = 0; r < EDGE_REPS; r++) {
    struct bench_pile p = {0};
    const int64_t shape[2] = {16, 16};
    ebb_tensor_t *x, *o;
    BENCH_CHECK(ebb_tensor_full(0, EBB_F32, 2, shape, 0.5, &x));
    BENCH_CHECK(ebb_tensor_set_requires_grad(x, true));
    ebb_tensor_t *y = bench_pile_keep(&p, x);
    ebb_gradient_edge acc;
    BENCH_CHECK(ebb_tensor_gradient_edge(x, &acc));
    ebb_stream_t *prev = a;
    for (int i = 0; i <= EDGE_OPS; i++) {
      ebb_stream_t *s = i % 2 ? a : b; /* i == EDGE_OPS: the sum, on A */
      ebb_stream_guard g;
      BENCH_CHECK(ebb_stream_wait_stream(s, prev));
      BENCH_CHECK(ebb_stream_guard_enter(&g, s));
      if (i == EDGE_OPS)
        BENCH_CHECK(ebb_op_sum(y, NULL, 0, false, &o));
      else
        BENCH_CHECK(ebb_op_mul_scalar(y, 0.9, &o));
      BENCH_CHECK(ebb_stream_guard_exit(&g));
      y = bench_pile_keep(&p, o);
      prev = s;
    }
    const ebb_tensor_t *root = y;
    BENCH_CHECK(ebb_backward(&root, NULL, 1, false, NULL, 0));
    sync_devices();
    BENCH_CHECK(ebb_gradient_edge_release(&acc));
    bench_pile_release(&p);
    bench_pile_free(&p);
  }
  ebb_autograd_engine_stats s1 = stats();
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(warn);
  sh->events = s1.events_recorded - s0.events_recorded;
  sh->engine_edges = s1.cross_stream_edges - s0.cross_stream_edges;
  sh->built_edges = (uint64_t)EDGE_REPS * (EDGE_OPS + 1);
  fprintf(stderr, "engine_devices: part 4 (%d graphs): edges built %llu, engine's cross_stream_edges %llu, events_recorded %llu, stream_waits %llu, accumulate_grad_stream_mismatches %llu\n",
          EDGE_REPS, (unsigned long long)sh->built_edges, (unsigned long long)sh->engine_edges, (unsigned long long)sh->events,
          (unsigned long long)(s1.stream_waits - s0.stream_waits),
          (unsigned long long)(s1.accumulate_grad_stream_mismatches - s0.accumulate_grad_stream_mismatches));
}

static void part_untimed(struct shared *sh) {
  sim_env("0");
  init_two_devices();
  part_paths(sh);
  cross_stream_events(sh);
  BENCH_CHECK(ebb_shutdown());
}

/* ---- part 3: system calls per warm backward, counted by ptrace -------------------------------- */

/* The markers: calls that fail harmlessly. The tracer recognises them by the path's address,
 * which is the same in parent and child (the child is a fork, with no exec in between), so it
 * need not read the child's memory. */
static const char mark_begin[] = "/nonexistent/ebb-bench-engine_devices:backward-begin";
static const char mark_end[] = "/nonexistent/ebb-bench-engine_devices:backward-end";
/* The tracer's self-check: a window holding exactly CAL_CALLS calls of the program's own, so a
 * tracer that missed calls would fail rather than report 0. */
static const char mark_cal_begin[] = "/nonexistent/ebb-bench-engine_devices:check-begin";
static const char mark_cal_end[] = "/nonexistent/ebb-bench-engine_devices:check-end";
#define CAL_CALLS 3

/* The traced child: asks to be traced, stops until the parent has set its options, then runs
 * warm backward calls of the two-branch graph on CPU tensors with the markers around each. */
static void part_syscalls(struct shared *sh) {
  if (ptrace(PTRACE_TRACEME, 0, NULL, NULL) != 0) {
    sh->traceme_errno = errno ? errno : EPERM;
    exit(3);
  }
  raise(SIGSTOP);
  sim_env("0");
  BENCH_CHECK(ebb_init());
  BENCH_CHECK(ebb_autograd_set_engine_mode(EBB_ENGINE_AUTO));
  for (int i = 0; i < SYS_WARM + SYS_ITERS; i++) {
    if (i == SYS_WARM) {
      (void)access(mark_cal_begin, F_OK);
      for (int k = 0; k < CAL_CALLS; k++) (void)getppid(); /* glibc does not cache it: one call each */
      (void)access(mark_cal_end, F_OK);
    }
    struct bench_pile p = {0};
    const ebb_tensor_t *roots[2];
    roots[0] = branch(&p, EBB_DEVICE_CPU);
    roots[1] = branch(&p, EBB_DEVICE_CPU);
    if (i >= SYS_WARM) (void)access(mark_begin, F_OK);
    BENCH_CHECK(ebb_backward(roots, NULL, 2, false, NULL, 0));
    if (i >= SYS_WARM) (void)access(mark_end, F_OK);
    bench_pile_release(&p);
    bench_pile_free(&p);
  }
  BENCH_CHECK(ebb_shutdown());
}

/* Which marker a system call entry is, if any: 1 begin, 2 end, 3 and 4 the self-check's begin
 * and end, 0 neither. access(path, mode)
 * has the path first; glibc may issue it as faccessat(dirfd, path, mode[, flags]). */
static int marker(uint64_t nr, const uint64_t *args) {
  uint64_t path = 0;
#ifdef SYS_access
  if (nr == (uint64_t)SYS_access) path = args[0];
#endif
#ifdef SYS_faccessat
  if (nr == (uint64_t)SYS_faccessat) path = args[1];
#endif
#ifdef SYS_faccessat2
  if (nr == (uint64_t)SYS_faccessat2) path = args[1];
#endif
  if (path && path == (uint64_t)(uintptr_t)mark_begin) return 1;
  if (path && path == (uint64_t)(uintptr_t)mark_end) return 2;
  if (path && path == (uint64_t)(uintptr_t)mark_cal_begin) return 3;
  if (path && path == (uint64_t)(uintptr_t)mark_cal_end) return 4;
  return 0;
}

/* A readable name for the stderr table (the numbers are the architecture's). */
static const char *sys_name(uint64_t nr) {
  static const struct {
    long nr;
    const char *name;
  } known[] = {
#ifdef SYS_futex
    {SYS_futex, "futex"},
#endif
#ifdef SYS_mmap
    {SYS_mmap, "mmap"},
#endif
#ifdef SYS_munmap
    {SYS_munmap, "munmap"},
#endif
#ifdef SYS_madvise
    {SYS_madvise, "madvise"},
#endif
#ifdef SYS_brk
    {SYS_brk, "brk"},
#endif
#ifdef SYS_mprotect
    {SYS_mprotect, "mprotect"},
#endif
#ifdef SYS_sched_yield
    {SYS_sched_yield, "sched_yield"},
#endif
#ifdef SYS_nanosleep
    {SYS_nanosleep, "nanosleep"},
#endif
#ifdef SYS_clock_nanosleep
    {SYS_clock_nanosleep, "clock_nanosleep"},
#endif
#ifdef SYS_clock_gettime
    {SYS_clock_gettime, "clock_gettime"},
#endif
#ifdef SYS_read
    {SYS_read, "read"},
#endif
#ifdef SYS_write
    {SYS_write, "write"},
#endif
#ifdef SYS_getpid
    {SYS_getpid, "getpid"},
#endif
#ifdef SYS_gettid
    {SYS_gettid, "gettid"},
#endif
#ifdef SYS_rt_sigprocmask
    {SYS_rt_sigprocmask, "rt_sigprocmask"},
#endif
#ifdef SYS_sched_getaffinity
    {SYS_sched_getaffinity, "sched_getaffinity"},
#endif
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if ((uint64_t)known[i].nr == nr) return known[i].name;
  return "?";
}

struct tally {
  uint64_t nr[MAX_NR], n[MAX_NR];
  int used;
  uint64_t calls, other; /* other: calls past MAX_NR distinct numbers (counted in calls) */
};

static void tally_add(struct tally *t, uint64_t nr) {
  t->calls++;
  for (int i = 0; i < t->used; i++)
    if (t->nr[i] == nr) {
      t->n[i]++;
      return;
    }
  if (t->used == MAX_NR) {
    t->other++;
    return;
  }
  t->nr[t->used] = nr;
  t->n[t->used++] = 1;
}

/* Traces the forked child `pid` (all its threads, PTRACE_O_TRACECLONE) to its end, counting the
 * system call entries of every thread between each begin marker and the next end marker, as the
 * stops reach the tracer. Returns false, with *why, when tracing is refused or its result cannot
 * be trusted; *status gets the child's wait status. */
static bool trace_child(pid_t pid, struct tally *t, long *begins, long *ends, long *cal, int *status, const char **why) {
  int st;
  *status = -1;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) {
      *why = "waitpid failed";
      return false;
    }
  if (!WIFSTOPPED(st)) { /* PTRACE_TRACEME refused: the child exited without stopping */
    *status = st;
    *why = "PTRACE_TRACEME refused";
    return false;
  }
  long opts = PTRACE_O_TRACESYSGOOD | PTRACE_O_TRACECLONE | PTRACE_O_EXITKILL;
  if (ptrace(PTRACE_SETOPTIONS, pid, NULL, (void *)opts) != 0 || ptrace(PTRACE_SYSCALL, pid, NULL, NULL) != 0) {
    kill(pid, SIGKILL);
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    *why = "PTRACE_SETOPTIONS refused";
    return false;
  }
  bool inside = false, in_cal = false, info_ok = true;
  for (;;) {
    pid_t tid = waitpid(-1, &st, __WALL);
    if (tid < 0) {
      if (errno == EINTR) continue;
      break; /* ECHILD: every thread of the child is gone */
    }
    if (WIFEXITED(st) || WIFSIGNALED(st)) {
      if (tid == pid) *status = st;
      continue;
    }
    if (!WIFSTOPPED(st)) continue;
    int sig = WSTOPSIG(st), inject = 0;
    if (sig == (SIGTRAP | 0x80)) { /* a system call stop (PTRACE_O_TRACESYSGOOD) */
      struct __ptrace_syscall_info info;
      memset(&info, 0, sizeof info);
      if (ptrace(PTRACE_GET_SYSCALL_INFO, tid, (void *)sizeof info, &info) <= 0) {
        info_ok = false;
      } else if (info.op == PTRACE_SYSCALL_INFO_ENTRY) {
        int m = marker(info.entry.nr, info.entry.args);
        if (m == 1) {
          inside = true;
          ++*begins;
        } else if (m == 2) {
          inside = false;
          ++*ends;
        } else if (m == 3 || m == 4) {
          in_cal = m == 3;
        } else if (in_cal) {
          ++*cal;
        } else if (inside) {
          tally_add(t, info.entry.nr);
        }
      }
    } else if (sig == SIGTRAP && (st >> 16) != 0) {
      /* PTRACE_EVENT_CLONE: the new thread is traced already; it reports its own stops */
    } else if (sig == SIGSTOP) {
      /* a new thread's first stop under PTRACE_O_TRACECLONE: swallowed */
    } else {
      inject = sig; /* a real signal: delivered */
    }
    ptrace(PTRACE_SYSCALL, tid, NULL, (void *)(long)inject);
  }
  if (!info_ok) {
    *why = "PTRACE_GET_SYSCALL_INFO failed";
    return false;
  }
  return true;
}

/* ---- the parent -------------------------------------------------------------------------------- */

/* Runs fn(sh) in a child process; returns its wait status. */
static int in_child(void (*fn)(struct shared *), struct shared *sh) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("bench_engine_devices: fork");
    exit(1);
  }
  if (pid == 0) {
    fn(sh);
    exit(0);
  }
  int st;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) return -1;
  return st;
}

static bool child_ok(int st, const char *what) {
  if (st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
  fprintf(stderr, "bench_engine_devices: %s failed (wait status %#x)\n", what, (unsigned)st);
  return false;
}

static int reps_arg = 21;
static const char *launch_us_arg = "200";

static void part_devices_main(struct shared *sh) { part_devices(sh, reps_arg, launch_us_arg); }

int main(int argc, char **argv) {
  if (argc > 1) reps_arg = atoi(argv[1]);
  if (argc > 2) launch_us_arg = argv[2];
  if (reps_arg < 1 || argc > 3) {
    fprintf(stderr, "usage: ebb-bench-engine_devices [reps] [launch_us]\n");
    return 2;
  }
  const char *perturb = getenv("EBB_SIM_PERTURB");
  if (perturb && *perturb && strcmp(perturb, "0") != 0)
    fprintf(stderr, "engine_devices: EBB_SIM_PERTURB=%s is overridden with 0 (its random delays say nothing about ebb)\n", perturb);
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) {
    perror("bench_engine_devices: mmap");
    return 1;
  }
  memset(sh, 0, sizeof *sh);
  uint64_t t0 = bench_now_ns();

  bool ok = child_ok(in_child(part_devices_main, sh), "part 1 (one device against two)");
  ok = child_ok(in_child(part_untimed, sh), "parts 2 and 4 (engine paths, cross-stream events)") && ok;

  /* Part 3: the child stops itself until traced; its failures are reported, not faked as 0. */
  char syscalls[64] = "";
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("bench_engine_devices: fork");
    return 1;
  }
  if (pid == 0) {
    part_syscalls(sh);
    exit(0);
  }
  struct tally t = {0};
  long begins = 0, ends = 0, cal = 0;
  int st;
  const char *why = NULL;
  if (!trace_child(pid, &t, &begins, &ends, &cal, &st, &why)) {
    /* ptrace refused (a container's seccomp policy, Yama): no count, and the line says so */
    fprintf(stderr, "engine_devices: part 3: %s (errno %d in the child); syscalls_per_backward=unavailable\n", why,
            sh->traceme_errno);
    snprintf(syscalls, sizeof syscalls, "unavailable");
  } else if (!child_ok(st, "part 3 (system calls, traced)") || begins != SYS_ITERS || ends != SYS_ITERS) {
    fprintf(stderr, "engine_devices: part 3: %ld begin and %ld end markers seen, %d expected\n", begins, ends, SYS_ITERS);
    ok = false;
  } else if (cal < CAL_CALLS) {
    fprintf(stderr, "engine_devices: part 3: the tracer saw %ld of the self-check's %d calls; no count\n", cal, CAL_CALLS);
    ok = false;
  } else {
    snprintf(syscalls, sizeof syscalls, "%.2f", (double)t.calls / SYS_ITERS);
    fprintf(stderr, "engine_devices: part 3: %llu system calls over %d warm backward calls, all threads (the self-check's window: %ld of %d):\n",
            (unsigned long long)t.calls, SYS_ITERS, cal, CAL_CALLS);
    for (int i = 0; i < t.used; i++)
      fprintf(stderr, "  %s (%llu): %llu\n", sys_name(t.nr[i]), (unsigned long long)t.nr[i], (unsigned long long)t.n[i]);
    if (t.other) fprintf(stderr, "  others: %llu\n", (unsigned long long)t.other);
  }
  if (!ok) return 1;

  fprintf(stderr, "engine_devices: %.1f s in all\n", (double)(bench_now_ns() - t0) / 1e9);
  printf("bench=engine_devices one_dev_ms=%.3f two_dev_ms=%.3f speedup=%.2f calling_thread_ns_per_node=%.0f "
         "worker_thread_ns_per_node=%.0f syscalls_per_backward=%s events_per_cross_stream_edge=%.3f\n",
         sh->one_dev_ms, sh->two_dev_ms, sh->one_dev_ms / sh->two_dev_ms, sh->calling_ns, sh->worker_ns, syscalls,
         sh->built_edges ? (double)sh->events / (double)sh->built_edges : 0.0);
  return 0;
}
