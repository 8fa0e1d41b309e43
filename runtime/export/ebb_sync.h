/* ebb_sync.h: mutexes with lock ranks and a spin-then-park wait, for every module; implemented
 * in runtime/sync.c.
 *
 * Every mutex has a rank from enum ebb_lock_rank; a thread may only take a lock of a higher
 * rank than the last one it holds. Under EBB_DEBUG >= 1 a thread-local stack of held ranks
 * checks this on every lock and aborts on the first inversion (TSan would need both orders to
 * happen before it says anything). In release builds the wrapper is a plain pthread mutex.
 *
 * Two lock types share those ranks. ebb_mutex is a pthread mutex, so it works with condition
 * variables (ebb__cond_wait). ebb_lock is a futex lock for the hottest short sections (the
 * arena's alloc/free path): taking and releasing it uncontended is one atomic read-modify-write
 * each, inline, where a pthread mutex costs two library calls of ~50 instructions (its type,
 * owner and robustness checks). It has no condition wait. Its atomics are C11 ones, so TSan
 * sees the acquire/release pairs that order the sections.
 */
#ifndef EBB_SYNC_H
#define EBB_SYNC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ebb_internal.h"

enum ebb_lock_rank {
  EBB_RANK_AG_TASK = 1,     /* autograd: a shared graph task's deliveries, held across the ops that sum gradients */
  EBB_RANK_AG_GRAD,     /* autograd: a leaf's .grad, held across the ops that accumulate it */
  EBB_RANK_AG_OFFLOAD,      /* autograd: offloaded saved tensors, held across the stream, event and alloc calls that move them */
  EBB_RANK_AG_MUTATION,     /* autograd: the allow-mutation registry, held across the clones it makes and the saved-slot changes */
  EBB_RANK_AG_SAVED,        /* autograd: its table of saved blocks, held across the alloc calls that re-tag them */
  EBB_RANK_DDP_REDUCER,     /* ddp: a reducer's state, held across the collectives it issues in bucket order */
  EBB_RANK_DIST_ISSUE,      /* dist: a group's issue order, held across the stream, event and alloc calls of a collective */
  EBB_RANK_RUNTIME,         /* init/shutdown, driver table */
  EBB_RANK_KERNELS,         /* kernel registry */
  EBB_RANK_STREAM_POOL,     /* per-device stream pools and slots */
  EBB_RANK_EVENT_POOL,      /* per-device event pools */
  EBB_RANK_STAGING,         /* pinned staging ring of async copies */
  EBB_RANK_ARENA,
  EBB_RANK_PINNED,
  EBB_RANK_AG_QUEUE,
  EBB_RANK_AG_VIEW,         /* autograd: a view's history taken again from its base (takes leaf locks) */
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

/* A futex lock (Drepper's "mutex 3"): state 0 free, 1 held, 2 held and perhaps waited for.
 * Taking it is a compare-and-swap 0 -> 1; a taker that fails spins a little (sections are short)
 * then swaps in 2 and parks. Release swaps in 0 and wakes one parked thread only when the old
 * state was 2, so an uncontended pair makes no system call. */
typedef struct ebb_lock {
  _Atomic uint32_t state;
  int rank;
  const char *name;
} ebb_lock;

EBB_HIDDEN void ebb__lock_init(ebb_lock *l, const char *name, int rank);
/* Contended paths of ebb__lock / ebb__unlock (runtime/sync.c). */
EBB_HIDDEN void ebb__lock_wait(ebb_lock *l);
EBB_HIDDEN void ebb__lock_wake(ebb_lock *l);
#if EBB_DEBUG >= 1
/* The held-rank stack (runtime/sync.c): `key` is the lock, `name` and `rank` its messages. */
EBB_HIDDEN void ebb__rank_push(const void *key, const char *name, int rank);
EBB_HIDDEN void ebb__rank_pop(const void *key);
#endif

static inline void ebb__lock(ebb_lock *l) {
#if EBB_DEBUG >= 1
  ebb__rank_push(l, l->name, l->rank);
#endif
  uint32_t free_state = 0;
  /* acquire: pairs with the release exchange in ebb__unlock of the previous holder. */
  if (EBB_LIKELY(atomic_compare_exchange_strong_explicit(&l->state, &free_state, 1, memory_order_acquire,
                                                         memory_order_relaxed)))
    return;
  ebb__lock_wait(l);
}

static inline void ebb__unlock(ebb_lock *l) {
  /* release: publishes the section's writes to the next taker's acquire. */
  if (EBB_UNLIKELY(atomic_exchange_explicit(&l->state, 0, memory_order_release) == 2)) ebb__lock_wake(l);
#if EBB_DEBUG >= 1
  ebb__rank_pop(l);
#endif
}

/* One CPU pause for spin-then-park loops: callers poll a few thousand times, then park. */
static inline void ebb__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#endif /* EBB_SYNC_H */
