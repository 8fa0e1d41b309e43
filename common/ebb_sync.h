/* ebb_sync.h: mutexes with lock ranks (STYLE.md 12) and a spin-then-park wait.
 *
 * Every mutex has a rank from enum ebb_lock_rank; a thread may only take a lock of a higher
 * rank than the last one it holds. Under EBB_DEBUG >= 1 a thread-local stack of held ranks
 * checks this on every lock and aborts on the first inversion (TSan would need both orders to
 * happen before it says anything). In release builds the wrapper is a plain pthread mutex.
 */
#ifndef EBB_SYNC_H
#define EBB_SYNC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ebb_internal.h"

enum ebb_lock_rank {
  EBB_RANK_RUNTIME = 1,     /* init/shutdown, driver table */
  EBB_RANK_KERNELS,         /* kernel registry */
  EBB_RANK_STREAM_POOL,     /* per-device stream pools and slots */
  EBB_RANK_EVENT_POOL,      /* per-device event pools */
  EBB_RANK_STAGING,         /* pinned staging ring of async copies */
  EBB_RANK_ARENA,
  EBB_RANK_PINNED,
  EBB_RANK_AG_QUEUE,
  EBB_RANK_TRACE,
  EBB_RANK_LEAF             /* locks that never hold another */
};

typedef struct ebb_mutex {
  pthread_mutex_t m;
  const char *name;
  int rank;
} ebb_mutex;

EBB_HIDDEN void ebb__mutex_init(ebb_mutex *mu, const char *name, int rank);
EBB_HIDDEN void ebb__mutex_destroy(ebb_mutex *mu);
EBB_HIDDEN void ebb__mutex_lock(ebb_mutex *mu);
EBB_HIDDEN void ebb__mutex_unlock(ebb_mutex *mu);
/* Condition wait on a ranked mutex (keeps the held-rank stack right across the wait). */
EBB_HIDDEN void ebb__cond_wait(pthread_cond_t *c, ebb_mutex *mu);

/* One CPU pause for spin-then-park loops: callers poll a few thousand times, then park. */
static inline void ebb__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#endif /* EBB_SYNC_H */
