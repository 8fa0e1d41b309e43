/* sync.c: ranked mutexes and the futex lock (common/ebb_sync.h).
 *
 * With EBB_DEBUG >= 1 each thread keeps a small stack of the ranks it holds; taking a lock whose
 * rank is not above the top of that stack aborts at once, naming both locks. Release builds keep
 * only the pthread mutex. Ranks are in common/ebb_sync.h.
 */
#include <stdio.h>
#include <stdlib.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#include "ebb_sync.h"

#if EBB_DEBUG >= 1
#define EBB_HELD_MAX 16
/* Both lock types go on one stack, so the ranks order an ebb_lock against an ebb_mutex too. */
struct ebb__held_lock {
  const void *key;
  const char *name;
  int rank;
};
static _Thread_local struct ebb__held_lock ebb__held[EBB_HELD_MAX];
static _Thread_local int ebb__nheld;

void ebb__rank_push(const void *key, const char *name, int rank) {
  if (ebb__nheld > 0) {
    const struct ebb__held_lock *top = &ebb__held[ebb__nheld - 1];
    if (rank <= top->rank) {
      ebb__warn("lock order violated: taking '%s' (rank %d) while holding '%s' (rank %d)", name, rank, top->name,
                top->rank);
      abort();
    }
  }
  EBB_ASSERT(ebb__nheld < EBB_HELD_MAX);
  ebb__held[ebb__nheld++] = (struct ebb__held_lock){key, name, rank};
}

void ebb__rank_pop(const void *key) {
  /* Locks are usually released in reverse order; allow any order by searching down. */
  for (int i = ebb__nheld - 1; i >= 0; i--) {
    if (ebb__held[i].key == key) {
      for (int j = i; j < ebb__nheld - 1; j++) ebb__held[j] = ebb__held[j + 1];
      ebb__nheld--;
      return;
    }
  }
  EBB_ASSERT(!"unlocking a mutex this thread does not hold");
}
#define EBB__RANK_PUSH(mu) ebb__rank_push((mu), (mu)->name, (mu)->rank)
#define EBB__RANK_POP(mu) ebb__rank_pop(mu)
#else
#define EBB__RANK_PUSH(mu) ((void)(mu))
#define EBB__RANK_POP(mu) ((void)(mu))
#endif

/* ---- ebb_lock ------------------------------------------------------------------------------ */

/* Spins before parking: an arena section is a few hundred instructions, so a waiter that spins
 * this long usually gets the lock without the two system calls of a park and a wake. */
#define EBB__LOCK_SPINS 128

void ebb__lock_init(ebb_lock *l, const char *name, int rank) {
  atomic_init(&l->state, 0);
  l->name = name;
  l->rank = rank;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
#if defined(__linux__)
  /* Returns at once when *addr != val (EAGAIN), on a wake, or spuriously: the caller re-checks. */
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
  (void)addr;
  (void)val;
  sched_yield();
#endif
}

void ebb__lock_wait(ebb_lock *l) {
  for (int i = 0; i < EBB__LOCK_SPINS; i++) {
    ebb__cpu_relax();
    uint32_t free_state = 0;
    /* acquire: as in ebb__lock. Read first so spinners do not bounce the line with writes. */
    if (atomic_load_explicit(&l->state, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_weak_explicit(&l->state, &free_state, 1, memory_order_acquire, memory_order_relaxed))
      return;
  }
  /* Park. Swapping in 2 (not 1) marks the lock waited for, so its release wakes someone; a
   * thread that gets the lock this way keeps the 2, which may cost one needless wake later. */
  while (atomic_exchange_explicit(&l->state, 2, memory_order_acquire) != 0) futex_wait(&l->state, 2);
}

void ebb__lock_wake(ebb_lock *l) {
#if defined(__linux__)
  syscall(SYS_futex, (uint32_t *)&l->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
  (void)l; /* waiters poll with sched_yield */
#endif
}

/* ---- ebb_mutex ----------------------------------------------------------------------------- */

void ebb__mutex_init(ebb_mutex *mu, const char *name, int rank) {
  pthread_mutex_init(&mu->m, NULL);
  mu->name = name;
  mu->rank = rank;
}

void ebb__mutex_destroy(ebb_mutex *mu) { pthread_mutex_destroy(&mu->m); }

void ebb__mutex_lock(ebb_mutex *mu) {
  EBB__RANK_PUSH(mu);
  pthread_mutex_lock(&mu->m);
}

void ebb__mutex_unlock(ebb_mutex *mu) {
  pthread_mutex_unlock(&mu->m);
  EBB__RANK_POP(mu);
}

void ebb__cond_wait(pthread_cond_t *c, ebb_mutex *mu) {
  /* The mutex is held again when pthread_cond_wait returns, so the held-rank stack stays right. */
  pthread_cond_wait(c, &mu->m);
}
