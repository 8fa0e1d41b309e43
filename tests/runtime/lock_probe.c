/* lock_probe.c: drives ebb_lock (common/ebb_sync.h) for test_runtime_lock.cpp. The lock is an
 * internal C11 type (its state is _Atomic), so C++ tests reach it through these functions. */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ebb_sync.h"

int ebb_test_lock_debug(void) { return EBB_DEBUG; }

struct hammer {
  ebb_lock lock;
  long count;      /* plain: only written inside the lock */
  int inside;      /* plain: a second thread inside the section would see it set */
  int overlaps;
  long iters;
};

static void *hammer_thread(void *arg) {
  struct hammer *h = arg;
  for (long i = 0; i < h->iters; i++) {
    ebb__lock(&h->lock);
    if (h->inside) h->overlaps++;
    h->inside = 1;
    h->count++;
    if (i % 64 == 0) sched_yield(); /* hold it across a yield now and then: waiters park */
    h->inside = 0;
    ebb__unlock(&h->lock);
  }
  return NULL;
}

/* Runs `threads` threads doing `iters` locked increments each; returns the final count and
 * the sections that overlapped (must be 0). */
long ebb_test_lock_hammer(int threads, long iters, int *overlaps) {
  struct hammer h = {.count = 0, .inside = 0, .overlaps = 0, .iters = iters};
  ebb__lock_init(&h.lock, "test-hammer", EBB_RANK_LEAF);
  pthread_t t[16];
  if (threads > 16) threads = 16;
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, hammer_thread, &h);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  *overlaps = h.overlaps;
  return h.count;
}

struct parker {
  ebb_lock *lock;
  _Atomic int got;
};

static void *parker_thread(void *arg) {
  struct parker *p = arg;
  ebb__lock(p->lock);
  atomic_store(&p->got, 1);
  ebb__unlock(p->lock);
  return NULL;
}

/* Holds a lock while another thread asks for it for `hold_ms`: the waiter spins out and parks,
 * marking the lock waited for (state 2). Returns that state as seen by the holder just before
 * releasing, and in *got_while_held whether the waiter got in early (must be 0); *got_after
 * whether it got the lock once released (must be 1), *state_after the state after it left. */
int ebb_test_lock_park(int hold_ms, int *got_while_held, int *got_after, int *state_after) {
  ebb_lock l;
  ebb__lock_init(&l, "test-park", EBB_RANK_LEAF);
  struct parker p = {.lock = &l};
  atomic_init(&p.got, 0);
  ebb__lock(&l);
  pthread_t t;
  pthread_create(&t, NULL, parker_thread, &p);
  struct timespec ts = {hold_ms / 1000, (long)(hold_ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
  int state = (int)atomic_load(&l.state);
  *got_while_held = atomic_load(&p.got);
  ebb__unlock(&l);
  pthread_join(t, NULL);
  *got_after = atomic_load(&p.got);
  *state_after = (int)atomic_load(&l.state);
  return state;
}

/* In a child process: takes an ebb_lock of rank `first`, then an ebb_mutex of rank `second`.
 * Returns the child's wait status (debug builds abort on an order violation). */
int ebb_test_lock_order_child(int first, int second) {
  pid_t pid = fork();
  if (pid == 0) {
    /* The report goes to stderr; keep the test log quiet about the expected one. The abort
     * must kill the child as SIGABRT: the test framework's handler, inherited through fork,
     * would run (allocating, which ThreadSanitizer reports as signal-unsafe and then exits
     * with its own code instead of the signal). */
    signal(SIGABRT, SIG_DFL);
    ebb_lock l;
    ebb_mutex m;
    ebb__lock_init(&l, "test-first", first);
    ebb__mutex_init(&m, "test-second", second);
    ebb__lock(&l);
    ebb__mutex_lock(&m);
    ebb__mutex_unlock(&m);
    ebb__unlock(&l);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

int ebb_test_wait_aborted(int status) { return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT; }
int ebb_test_wait_exited_ok(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
