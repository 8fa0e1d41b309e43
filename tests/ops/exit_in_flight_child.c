/* exit_in_flight_child.c: a program that exits with matmuls in flight, run many times by
 * test_ops_exit_in_flight.cpp. Written from the public headers alone and linked against libebb,
 * as a user's program is. It never calls ebb_shutdown and ends with exit(1), the way a program
 * that meets an error and gives up does.
 *
 * usage: exit_in_flight_child devices|cpu-thread|fork
 *   devices     queues a two-layer forward pass (matmul, tanh, matmul) several times on the
 *               current streams of devices 0 and 1, then exits without waiting for any of it;
 *   cpu-thread  a second thread runs CPU matmuls in a loop while the main thread exits;
 *   fork        as cpu-thread, but first forks FORKS children while the matmuls run, each of
 *               which exits at once: a fork must not meet a call inside OpenBLAS, and a child
 *               must not wait at its exit for calls of threads it does not have.
 * Exit status: 1 from the exit under test; 2 when a setup call fails (with its message); 3 when a
 * forked child hung, took FORK_SLOW_S or more to exit, or did not exit 0.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ebb/ebb.h"

enum { N = 256, STEPS = 8 }; /* 256^3 gemms: big enough for OpenBLAS to use its thread pool */
/* Forked children, and how long one may take to exit: far above a healthy exit (milliseconds),
 * and below the bound ebb's exit waits for matmuls in flight (10 s), which a child waiting for
 * its parent's threads would sit out. */
enum { FORKS = 12, FORK_SLOW_S = 8, FORK_HUNG_S = 30 };

static void check(ebb_status st, const char *what) {
  if (st == EBB_OK) return;
  fprintf(stderr, "exit_in_flight_child: %s: %s\n", what, ebb_last_error());
  exit(2);
}

/* Queues x @ w1 -> tanh -> @ w2 STEPS times on each device; releases are stream-ordered, so
 * everything stays queued or running when this returns. */
static void queue_on_devices(void) {
  const int64_t shape[2] = {N, N};
  for (int step = 0; step < STEPS; step++) {
    for (int dev = 0; dev < 2; dev++) {
      ebb_tensor_t *x, *w1, *w2, *h, *a, *y;
      check(ebb_tensor_rand(dev, EBB_F32, 2, shape, 1, (uint64_t)step, &x), "ebb_tensor_rand x");
      check(ebb_tensor_rand(dev, EBB_F32, 2, shape, 2, 0, &w1), "ebb_tensor_rand w1");
      check(ebb_tensor_rand(dev, EBB_F32, 2, shape, 3, 0, &w2), "ebb_tensor_rand w2");
      check(ebb_op_matmul(x, w1, &h), "ebb_op_matmul x w1");
      check(ebb_op_tanh(h, &a), "ebb_op_tanh");
      check(ebb_op_matmul(a, w2, &y), "ebb_op_matmul a w2");
      ebb_tensor_t *all[] = {x, w1, w2, h, a, y};
      for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) check(ebb_tensor_release(all[i]), "ebb_tensor_release");
    }
  }
}

static _Atomic int cpu_started; /* the CPU thread has finished one matmul */

static void *cpu_matmuls(void *unused) {
  (void)unused;
  const int64_t shape[2] = {N, N};
  ebb_tensor_t *a, *b;
  check(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, shape, 1, 0, &a), "ebb_tensor_rand a");
  check(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F32, 2, shape, 2, 0, &b), "ebb_tensor_rand b");
  for (;;) {
    ebb_tensor_t *c;
    check(ebb_op_matmul(a, b, &c), "ebb_op_matmul cpu");
    check(ebb_tensor_release(c), "ebb_tensor_release");
    atomic_store_explicit(&cpu_started, 1, memory_order_relaxed); /* a flag only: orders no data */
  }
  return NULL;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Forks FORKS children while the CPU thread runs matmuls; each exits at once. */
static void fork_children(void) {
  for (int i = 0; i < FORKS; i++) {
    pid_t pid = fork();
    if (pid < 0) exit(2);
    if (pid == 0) exit(0);
    double t0 = now_s(), took = 0;
    int status = 0;
    for (;;) {
      pid_t r = waitpid(pid, &status, WNOHANG);
      took = now_s() - t0;
      if (r == pid) break;
      if (took > FORK_HUNG_S) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fprintf(stderr, "exit_in_flight_child: forked child %d hung in its exit\n", i);
        exit(3);
      }
      struct timespec ts = {0, 2000000};
      nanosleep(&ts, NULL);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || took >= FORK_SLOW_S) {
      fprintf(stderr, "exit_in_flight_child: forked child %d: status %d after %.2f s\n", i, status, took);
      exit(3);
    }
  }
}

int main(int argc, char **argv) {
  bool forking = argc == 2 && strcmp(argv[1], "fork") == 0;
  if (argc != 2 || (strcmp(argv[1], "devices") != 0 && strcmp(argv[1], "cpu-thread") != 0 && !forking)) {
    fprintf(stderr, "usage: exit_in_flight_child devices|cpu-thread|fork\n");
    return 2;
  }
  check(ebb_init(), "ebb_init");
  if (strcmp(argv[1], "devices") == 0) {
    int n = 0;
    check(ebb_dev_count(&n), "ebb_dev_count");
    if (n < 2) {
      fprintf(stderr, "exit_in_flight_child: needs 2 devices, found %d\n", n);
      return 2;
    }
    queue_on_devices();
  } else {
    pthread_t t;
    if (pthread_create(&t, NULL, cpu_matmuls, NULL) != 0) return 2;
    while (!atomic_load_explicit(&cpu_started, memory_order_relaxed)) {
    }
    if (forking) fork_children();
  }
  exit(1);
}
