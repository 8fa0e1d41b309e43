/* workers.c: the engine's threads: one ready queue and one worker thread per device, and a pool
 * of threads for reentrant backward calls past the depth limit.
 *
 * A queue is a max-heap of (reentrant depth, sequence number) under its own lock, with a count
 * readable without it. A thread waiting on a queue spins a few microseconds on that count (and on
 * the task counter it waits for), then parks on the queue's condition variable; a push signals
 * only when someone is parked, so a busy engine makes no system call per node. Workers start at
 * the first backward that needs their device, bind to the device's NUMA node (ebb_thread_bind_device,
 * best effort), run with grad mode off, and serve their queue until the module stops, which
 * joins them. Items of any task (several backward calls, reentrant ones) share a device's queue.
 *
 * Pool threads run a function on behalf of a thread that reached the reentrant depth limit and
 * waits for it; a pool thread adopts the waiting thread's queue (a device worker's), so the
 * device's queue is still served while its worker waits. Idle pool threads are kept and reused,
 * and joined when the module stops.
 *
 * Threading: queue locks are leaves (nothing is taken under them); the workers' table and the
 * pool are under ebb__threads_mu, never held while running anything.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/runtime.h"
#include "ebb/trace.h"

#define EBB__SPIN_NS 5000 /* waits spin this long before parking (kept short: the machines are small) */

static _Thread_local struct ebb__queue *ebb__home; /* the queue this thread serves (a worker's), else NULL */

void ebb__queue_init(struct ebb__queue *q) {
  memset(q, 0, sizeof *q);
  ebb__mutex_init(&q->mu, "autograd.queue", EBB_RANK_LEAF);
  pthread_cond_init(&q->cv, NULL);
}

void ebb__queue_destroy(struct ebb__queue *q) {
  free(q->a);
  pthread_cond_destroy(&q->cv);
  ebb__mutex_destroy(&q->mu);
}

/* a before b: deeper first, then the larger sequence number. */
static bool qbefore(const struct ebb__qitem *a, const struct ebb__qitem *b) {
  return a->depth != b->depth ? a->depth > b->depth : a->seq > b->seq;
}

bool ebb__queue_push(struct ebb__queue *q, const struct ebb__qitem *it) {
  ebb__mutex_lock(&q->mu);
  if (q->n == q->cap) {
    size_t nc = q->cap ? q->cap * 2 : 64;
    struct ebb__qitem *na = realloc(q->a, nc * sizeof *na);
    if (!na) {
      ebb__mutex_unlock(&q->mu);
      return false;
    }
    q->a = na;
    q->cap = nc;
  }
  size_t k = q->n++;
  while (k && qbefore(it, &q->a[(k - 1) / 2])) {
    q->a[k] = q->a[(k - 1) / 2];
    k = (k - 1) / 2;
  }
  q->a[k] = *it;
  atomic_store_explicit(&q->count, q->n, memory_order_release);
  if (q->sleepers) pthread_cond_signal(&q->cv);
  ebb__mutex_unlock(&q->mu);
  return true;
}

/* Under q->mu, q->n > 0. */
static struct ebb__qitem qpop_locked(struct ebb__queue *q) {
  struct ebb__qitem top = q->a[0], last = q->a[--q->n];
  size_t k = 0;
  for (;;) {
    size_t c = 2 * k + 1;
    if (c >= q->n) break;
    if (c + 1 < q->n && qbefore(&q->a[c + 1], &q->a[c])) c++;
    if (!qbefore(&q->a[c], &last)) break;
    q->a[k] = q->a[c];
    k = c;
  }
  if (q->n) q->a[k] = last;
  atomic_store_explicit(&q->count, q->n, memory_order_release);
  return top;
}

/* Whether a waiter should stop waiting without an item: the counter it waits for reached 0, or
 * (stop) the module is stopping. */
static bool wait_over(_Atomic long *until_zero, _Atomic bool *stop) {
  return (until_zero && atomic_load_explicit(until_zero, memory_order_acquire) == 0) ||
         (stop && atomic_load_explicit(stop, memory_order_acquire));
}

bool ebb__queue_pop_wait(struct ebb__queue *q, _Atomic long *until_zero, _Atomic bool *stop, struct ebb__qitem *out,
                         uint64_t *parks) {
  uint64_t deadline = 0;
  for (unsigned i = 0;; i++) {
    if (wait_over(until_zero, stop)) return false; /* done: other tasks' items are not this waiter's business */
    if (atomic_load_explicit(&q->count, memory_order_acquire) > 0) {
      ebb__mutex_lock(&q->mu);
      if (q->n > 0) {
        *out = qpop_locked(q);
        ebb__mutex_unlock(&q->mu);
        return true;
      }
      ebb__mutex_unlock(&q->mu);
    }
    if ((i & 63) == 63) {
      uint64_t now = ebb__now_ns();
      if (!deadline) deadline = now + EBB__SPIN_NS;
      else if (now >= deadline) break;
    }
    ebb__cpu_relax();
  }
  /* Park. A push signals when sleepers > 0; the counter's last decrement (ebb__queue_done)
   * broadcasts under the lock, so neither wake-up can slip between the check and the wait. */
  ebb__mutex_lock(&q->mu);
  bool over;
  while (!(over = wait_over(until_zero, stop)) && q->n == 0) {
    q->sleepers++;
    if (parks) (*parks)++;
    ebb__cond_wait(&q->cv, &q->mu);
    q->sleepers--;
  }
  bool got = !over && q->n > 0;
  if (got) *out = qpop_locked(q);
  ebb__mutex_unlock(&q->mu);
  return got;
}

void ebb__queue_done(struct ebb__queue *q, _Atomic long *counter) {
  ebb__mutex_lock(&q->mu);
  if (atomic_fetch_sub_explicit(counter, 1, memory_order_acq_rel) == 1) pthread_cond_broadcast(&q->cv);
  ebb__mutex_unlock(&q->mu);
}

void ebb__queue_kick(struct ebb__queue *q) {
  ebb__mutex_lock(&q->mu);
  pthread_cond_broadcast(&q->cv);
  ebb__mutex_unlock(&q->mu);
}

struct ebb__queue *ebb__home_queue(void) { return ebb__home; }

/* ---- device workers ----------------------------------------------------------------------------- */

struct ebb__worker {
  struct ebb__queue q;
  pthread_t th;
  int dev;
  _Atomic bool started; /* set under ebb__threads_mu; read unlocked by the fast path */
  _Atomic bool stop;
};

static ebb_mutex ebb__threads_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.threads", EBB_RANK_AG_QUEUE};
static struct ebb__worker *_Atomic ebb__workers; /* [ebb__nworkers], set once under the lock */
static int ebb__nworkers;

static void *worker_main(void *arg) {
  struct ebb__worker *w = arg;
  /* Best effort: a refused binding (a container's cpuset, hwloc not loaded) leaves the thread
   * where it is. It is no failure of the backward that started this worker, which goes on and
   * may succeed: muted, so neither this thread's last error nor the error hook hears of it. */
  ebb__fail_mute(true);
  (void)ebb_thread_bind_device(w->dev);
  ebb__fail_mute(false);
  ebb_grad_set_enabled(false, NULL);
  char name[48]; /* the track of its node spans in a trace (ebb/trace.h); named whether tracing is on or not */
  snprintf(name, sizeof name, "engine device %d worker", w->dev);
  ebb__fail_mute(true);
  (void)ebb_trace_thread_name(name);
  ebb__fail_mute(false);
  ebb__home = &w->q;
  uint64_t parks = 0;
  struct ebb__qitem it;
  while (ebb__queue_pop_wait(&w->q, NULL, &w->stop, &it, &parks)) {
    ebb__item_run(&it);
    if (parks) ebb__engine_count_parks(parks);
    parks = 0;
  }
  if (parks) ebb__engine_count_parks(parks);
  return NULL;
}

struct ebb__queue *ebb__device_queue(int dev) {
  struct ebb__worker *ws = atomic_load_explicit(&ebb__workers, memory_order_acquire);
  if (ws && dev >= 0 && dev < ebb__nworkers && atomic_load_explicit(&ws[dev].started, memory_order_acquire)) return &ws[dev].q;
  int n = 0, rc = 0;
  if (!ws && ebb_dev_count(&n)) n = 0; /* (outside the lock: the runtime's locks rank below it) */
  ebb__mutex_lock(&ebb__threads_mu);
  ws = atomic_load_explicit(&ebb__workers, memory_order_relaxed);
  if (!ws && n > 0 && (ws = calloc((size_t)n, sizeof *ws))) {
    for (int d = 0; d < n; d++) {
      ebb__queue_init(&ws[d].q);
      ws[d].dev = d;
    }
    ebb__nworkers = n;
    atomic_store_explicit(&ebb__workers, ws, memory_order_release);
  }
  struct ebb__queue *q = NULL;
  if (ws && dev >= 0 && dev < ebb__nworkers) {
    struct ebb__worker *w = &ws[dev];
    if (!atomic_load_explicit(&w->started, memory_order_relaxed)) {
      atomic_store_explicit(&w->stop, false, memory_order_relaxed);
      rc = pthread_create(&w->th, NULL, worker_main, w);
      if (!rc) atomic_store_explicit(&w->started, true, memory_order_release);
    }
    if (!rc) q = &w->q;
  }
  int nw = ebb__nworkers;
  ebb__mutex_unlock(&ebb__threads_mu);
  if (!ws) ebb__fail(EBB_ENOMEM, "no host memory for the autograd device workers");
  else if (rc) ebb__fail(EBB_ENOMEM, "could not start the autograd worker of device %d: %s", dev, strerror(rc));
  else if (!q) ebb__fail(EBB_EDEVICE, "device %d has no autograd worker (%d devices)", dev, nw);
  return q;
}

/* ---- the pool for reentrant calls past the depth limit ------------------------------------------- */

struct ebb__pool_job {
  void (*fn)(void *);
  void *arg;
  struct ebb__queue *home;
  _Atomic bool done;
  ebb_mutex mu; /* done's wake-up */
  pthread_cond_t cv;
  struct ebb__pool_job *next;
};

struct ebb__pool_thread {
  pthread_t th;
  struct ebb__pool_thread *next;
};

static struct {
  struct ebb__pool_job *jobs; /* under ebb__threads_mu */
  struct ebb__pool_thread *threads;
  int idle;
  bool stop;
  pthread_cond_t cv;
} ebb__pool = {.cv = PTHREAD_COND_INITIALIZER};

static void *pool_main(void *arg) {
  (void)arg;
  ebb_grad_set_enabled(false, NULL);
  ebb__fail_mute(true);
  (void)ebb_trace_thread_name("engine reentrant pool");
  ebb__fail_mute(false);
  ebb__mutex_lock(&ebb__threads_mu);
  for (;;) {
    while (!ebb__pool.jobs && !ebb__pool.stop) {
      ebb__pool.idle++;
      ebb__cond_wait(&ebb__pool.cv, &ebb__threads_mu);
      ebb__pool.idle--;
    }
    if (!ebb__pool.jobs) break;
    struct ebb__pool_job *j = ebb__pool.jobs;
    ebb__pool.jobs = j->next;
    ebb__mutex_unlock(&ebb__threads_mu);
    ebb__home = j->home; /* serve the waiting thread's queue while it waits */
    j->fn(j->arg);
    ebb__home = NULL;
    ebb__mutex_lock(&j->mu);
    atomic_store_explicit(&j->done, true, memory_order_release);
    pthread_cond_broadcast(&j->cv);
    ebb__mutex_unlock(&j->mu);
    ebb__mutex_lock(&ebb__threads_mu);
  }
  ebb__mutex_unlock(&ebb__threads_mu);
  return NULL;
}

ebb_status ebb__pool_run(void (*fn)(void *), void *arg) {
  struct ebb__pool_job j = {.fn = fn, .arg = arg, .home = ebb__home};
  ebb__mutex_init(&j.mu, "autograd.pool_job", EBB_RANK_LEAF);
  pthread_cond_init(&j.cv, NULL);
  ebb__mutex_lock(&ebb__threads_mu);
  ebb_status st = EBB_OK;
  /* Every queued job needs a thread of its own: one waiting behind another on the same pool
   * thread leaves its caller's queue unserved, which the other may need (two workers handing
   * off at once, each inner backward crossing to the other's device). An idle thread counts
   * until it has taken a job, so idle threads cover only as many jobs as are queued. */
  size_t queued = 0;
  struct ebb__pool_job **tail = &ebb__pool.jobs;
  for (; *tail; tail = &(*tail)->next) queued++;
  if ((size_t)ebb__pool.idle <= queued) {
    struct ebb__pool_thread *p = calloc(1, sizeof *p);
    int rc = p ? pthread_create(&p->th, NULL, pool_main, NULL) : ENOMEM;
    if (rc) {
      free(p);
      st = ebb__fail(EBB_ENOMEM, "could not start a thread for a reentrant backward past the depth limit: %s", strerror(rc));
    } else {
      p->next = ebb__pool.threads;
      ebb__pool.threads = p;
    }
  }
  if (!st) {
    *tail = &j;
    pthread_cond_signal(&ebb__pool.cv);
  }
  ebb__mutex_unlock(&ebb__threads_mu);
  if (!st) {
    ebb__mutex_lock(&j.mu);
    while (!atomic_load_explicit(&j.done, memory_order_acquire)) ebb__cond_wait(&j.cv, &j.mu);
    ebb__mutex_unlock(&j.mu);
  }
  pthread_cond_destroy(&j.cv);
  ebb__mutex_destroy(&j.mu);
  return st;
}

void ebb__workers_stop(void) {
  ebb__mutex_lock(&ebb__threads_mu);
  struct ebb__worker *ws = atomic_load_explicit(&ebb__workers, memory_order_relaxed);
  int n = ebb__nworkers;
  ebb__pool.stop = true;
  pthread_cond_broadcast(&ebb__pool.cv);
  struct ebb__pool_thread *pt = ebb__pool.threads;
  ebb__pool.threads = NULL;
  ebb__mutex_unlock(&ebb__threads_mu);
  for (int d = 0; ws && d < n; d++)
    if (atomic_load_explicit(&ws[d].started, memory_order_relaxed)) {
      atomic_store_explicit(&ws[d].stop, true, memory_order_release);
      ebb__queue_kick(&ws[d].q);
      pthread_join(ws[d].th, NULL);
    }
  while (pt) {
    struct ebb__pool_thread *next = pt->next;
    pthread_join(pt->th, NULL);
    free(pt);
    pt = next;
  }
  ebb__mutex_lock(&ebb__threads_mu);
  for (int d = 0; ws && d < n; d++) ebb__queue_destroy(&ws[d].q);
  free(ws);
  atomic_store_explicit(&ebb__workers, NULL, memory_order_relaxed);
  ebb__nworkers = 0;
  ebb__pool.stop = false;
  ebb__pool.idle = 0;
  ebb__mutex_unlock(&ebb__threads_mu);
}
