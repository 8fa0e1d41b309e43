/* sync.c: ranked mutexes (STYLE.md 12).
 *
 * With EBB_DEBUG >= 1 each thread keeps a small stack of the ranks it holds; taking a lock whose
 * rank is not above the top of that stack aborts at once, naming both locks. Release builds keep
 * only the pthread mutex. Ranks are in common/ebb_sync.h.
 */
#include <stdio.h>
#include <stdlib.h>

#include "ebb_sync.h"

#if EBB_DEBUG >= 1
#define EBB_HELD_MAX 16
static _Thread_local const ebb_mutex *ebb__held[EBB_HELD_MAX];
static _Thread_local int ebb__nheld;

static void ebb__rank_push(const ebb_mutex *mu) {
  if (ebb__nheld > 0) {
    const ebb_mutex *top = ebb__held[ebb__nheld - 1];
    if (mu->rank <= top->rank) {
      fprintf(stderr, "ebb: lock order violated: taking '%s' (rank %d) while holding '%s' (rank %d)\n",
              mu->name, mu->rank, top->name, top->rank);
      abort();
    }
  }
  EBB_ASSERT(ebb__nheld < EBB_HELD_MAX);
  ebb__held[ebb__nheld++] = mu;
}

static void ebb__rank_pop(const ebb_mutex *mu) {
  /* Locks are usually released in reverse order; allow any order by searching down. */
  for (int i = ebb__nheld - 1; i >= 0; i--) {
    if (ebb__held[i] == mu) {
      for (int j = i; j < ebb__nheld - 1; j++) ebb__held[j] = ebb__held[j + 1];
      ebb__nheld--;
      return;
    }
  }
  EBB_ASSERT(!"unlocking a mutex this thread does not hold");
}
#else
static void ebb__rank_push(const ebb_mutex *mu) { (void)mu; }
static void ebb__rank_pop(const ebb_mutex *mu) { (void)mu; }
#endif

void ebb__mutex_init(ebb_mutex *mu, const char *name, int rank) {
  pthread_mutex_init(&mu->m, NULL);
  mu->name = name;
  mu->rank = rank;
}

void ebb__mutex_destroy(ebb_mutex *mu) { pthread_mutex_destroy(&mu->m); }

void ebb__mutex_lock(ebb_mutex *mu) {
  ebb__rank_push(mu);
  pthread_mutex_lock(&mu->m);
}

void ebb__mutex_unlock(ebb_mutex *mu) {
  pthread_mutex_unlock(&mu->m);
  ebb__rank_pop(mu);
}

void ebb__cond_wait(pthread_cond_t *c, ebb_mutex *mu) {
  /* The mutex is held again when pthread_cond_wait returns, so the held-rank stack stays right. */
  pthread_cond_wait(c, &mu->m);
}
