/* dist_impl.h: the dist module's own declarations, sectioned by the file that provides them.
 * Never included by another module.
 *
 * A group (struct ebb_pg) owns a backend communicator, for the MPI backend a communication
 * thread, and for a device group a communication stream. A collective becomes a work record
 * (struct ebb_work) queued on its group in issue order; the communication thread runs the
 * records one at a time. One module lock (dist_mu, a leaf) guards every record's state and every
 * group's queue; one condition variable (dist_cv) is broadcast on every change of either, and
 * every waiter (ebb_work_wait, a device stream's gate, ebb_pg_destroy, the communication thread)
 * re-checks its own condition. Collectives are rare next to the work they move, so one lock for
 * the module costs nothing measurable and keeps the hand-offs obvious.
 */
#ifndef EBB_DIST_IMPL_H
#define EBB_DIST_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/dist.h"
#include "ebb/stream.h"
#include "ebb/tensor.h"
#include "ebb_internal.h"
#include "ebb_list.h"
#include "ebb_sync.h"

#define EBB__DIST_MSG_MAX 512

typedef enum dist_kind { DIST_ALL_REDUCE = 0, DIST_BROADCAST, DIST_ALL_GATHER, DIST_BARRIER } dist_kind;
/* Element types as the backends see them (the tensor's dtype, or bytes for data moved as is). */
typedef enum dist_elem { DIST_ELEM_BYTE = 0, DIST_ELEM_F32, DIST_ELEM_F64, DIST_ELEM_I64, DIST_ELEM_BF16, DIST_ELEM_F16 } dist_elem;

/* A work record's states, in order; a record only moves forward. */
enum {
  WORK_QUEUED = 0, /* issued; a device record waits for its stream's gate to hand the input over */
  WORK_READY,      /* the input is in place: the communication thread may run it */
  WORK_RUNNING,    /* inside the backend call since start_ns */
  WORK_DONE        /* finished: st and msg hold the outcome */
};

/* The part of a collective that a backend runs: what, on which host memory, how many elements. */
typedef struct dist_call {
  dist_kind kind;
  dist_elem elem;
  bool avg;          /* all-reduce: divide the sum by the group's size after */
  void *buf;         /* all-reduce, broadcast: in and out; all-gather: the output (size * count) */
  const void *src;   /* all-gather: this rank's input (count elements) */
  size_t count;      /* elements per rank */
  size_t elem_bytes;
  int root;          /* broadcast */
} dist_call;

struct ebb_work {
  uint32_t magic;       /* WORK_MAGIC while the caller's handle is live; 0 once released */
  int refs;             /* under dist_mu: the caller's handle, the queue, a device gate */
  bool caller_ref;      /* the caller holds a handle (counted in the live handles) */
  struct ebb_pg *pg;    /* valid until the record is DONE (a group outlives its queued work) */
  uint64_t seq;         /* the collective's number on its group, from 1 */
  int state;            /* WORK_*, under dist_mu */
  bool device;          /* ordered on a communication stream: done when `end` completes */
  bool abandoned;       /* a waiter gave up on it past the timeout while the backend still runs it */
  uint64_t start_ns;    /* when it began to run (WORK_RUNNING) */
  int timeout_ms;       /* the group's, copied: -1 none */
  bool abort_on_timeout;
  dist_call call;
  const char *owner;     /* the issuer's innermost owner scope (interned; "" none): the trace's */
  ebb_tensor_t *hold[2]; /* CPU tensors retained until the call has run (released off the lock) */
  void *pinned;          /* MPI on a device: the staging block, handed back once MPI is done with it */
  ebb_event_t *end;      /* device: recorded on the communication stream after the collective */
  ebb_status st;
  char msg[EBB__DIST_MSG_MAX];
  struct ebb_list qnode; /* on its group's queue while not DONE, else on the free list */
};

struct ebb_pg {
  uint32_t magic;           /* PG_MAGIC while live; 0 once destroyed */
  ebb_dist_backend backend;
  int device;
  int rank, size;
  int timeout_ms;           /* -1: none */
  bool abort_on_timeout;
  void *mpi_comm;           /* the backend's communicator (dist_mpi.c owns its type) */
  void *nccl_comm;          /* NCCL backend (dist_nccl.c) */
  ebb_stream_t *stream;     /* device groups: the communication stream */
  uint64_t trace_stream;    /* its trace track's key (0: CPU group, on the thread's track) */
  const char *staging_owner; /* interned "dist <backend> staging": MPI's pinned copies on a device */
  ebb_mutex issue_mu;       /* serialises issuing, so the stream's order is the queue's */
  /* Under dist_mu: */
  uint64_t next_seq;
  struct ebb_list queue;    /* records not yet DONE, in issue order */
  bool failed;              /* a collective failed: later ones are refused */
  bool stopping;            /* ebb_pg_destroy asked the thread to leave once the queue is empty */
  bool thread_started;
  bool thread_stuck;        /* a destroy gave up on a call blocked past the timeout */
  char fail_msg[EBB__DIST_MSG_MAX];
  /* Staging blocks MPI is done with, freed by the next issue or the destroy: the thread makes no
   * driver call (freeing records an event on the stream, whose queue may be full of work waiting
   * for the thread). */
  void **spent;
  int nspent, spent_cap;
  pthread_t thread;
  struct ebb_list all;      /* on the module's list of every group record */
};

/* ---- pg.c: groups, work records, the communication thread, the module ---------------------- */
EBB_HIDDEN extern ebb_mutex ebb__dist_mu;
EBB_HIDDEN extern pthread_cond_t ebb__dist_cv;
/* A new record with one reference per holder named (the caller's handle when `caller`, and the
 * queue); EBB_ENOMEM. Under no lock. */
EBB_HIDDEN ebb_status ebb__work_new(struct ebb_pg *pg, bool caller, struct ebb_work **out);
/* Drops one reference; the last one puts the record on the free list. Under dist_mu. */
EBB_HIDDEN void ebb__work_unref_locked(struct ebb_work *w);
/* Appends w to pg's queue with the next sequence number and wakes the thread. Under dist_mu. */
EBB_HIDDEN void ebb__work_enqueue_locked(struct ebb_pg *pg, struct ebb_work *w);
/* Marks w DONE with st and the formatted message (kept if w was abandoned already), fails the
 * group when st is an error, wakes waiters. Under dist_mu. */
EBB_HIDDEN void ebb__work_finish_locked(struct ebb_work *w, ebb_status st, const char *msg);
/* Whether a running record is past its timeout at `now`. Under dist_mu. */
EBB_HIDDEN bool ebb__work_timed_out_locked(const struct ebb_work *w, uint64_t now);
/* Fails w (and its group) for its timeout; calls MPI_Abort first when asked to. Under dist_mu. */
EBB_HIDDEN void ebb__work_time_out_locked(struct ebb_work *w, const char *who);
/* Waits on dist_cv until `deadline_ns` (0: no deadline). Under dist_mu. */
EBB_HIDDEN void ebb__dist_wait_locked(uint64_t deadline_ns);
/* The checked group of a public call: EBB_EINVAL for NULL, EBB_EFREED for a destroyed one. */
EBB_HIDDEN ebb_status ebb__pg_check(const struct ebb_pg *pg, const char *fn);
/* Frees the staging blocks the thread handed back. Under no lock (the issue lock allowed). */
EBB_HIDDEN void ebb__pg_free_spent(struct ebb_pg *pg);
/* Settles a record that can no longer run as asked: READY in a failed group (refused), or
 * running past its timeout (abandoned, `who` naming the waiter). Under dist_mu. */
EBB_HIDDEN void ebb__work_settle_locked(struct ebb_work *w, const char *who);
/* The host function a device record's communication stream runs (the gate). */
EBB_HIDDEN void ebb__work_gate(void *user);
EBB_HIDDEN const char *ebb__dist_kind_name(dist_kind k);

/* ---- collectives.c: argument checks and the issue paths ------------------------------------ */

/* ---- dist_mpi.c: the MPI backend (a build without MPI reports it unavailable: EBB_ENOTSUP naming what to install) */
/* EBB_OK, or EBB_ENOTSUP with why in the message (naming fn). */
EBB_HIDDEN ebb_status ebb__mpi_available(const char *fn);
/* Initialises MPI unless someone did (MPI_THREAD_MULTIPLE required), then duplicates
 * MPI_COMM_WORLD into *comm with errors returned, and gives its rank and size. */
EBB_HIDDEN ebb_status ebb__mpi_comm_create(const char *fn, void **comm, int *rank, int *size);
EBB_HIDDEN void ebb__mpi_comm_free(void *comm, bool healthy);
/* Runs one call (blocking) on comm; on failure writes the backend's text into msg. */
EBB_HIDDEN ebb_status ebb__mpi_run(void *comm, const dist_call *c, int rank, int size, char *msg, size_t cap);
/* Broadcasts n bytes from root over comm (the NCCL unique id). */
EBB_HIDDEN ebb_status ebb__mpi_bcast_bytes(const char *fn, void *comm, void *buf, size_t n, int root);
/* Ends the job: MPI_Abort(MPI_COMM_WORLD, 1). Returns only without MPI. */
EBB_HIDDEN void ebb__mpi_abort_job(void);
/* At the module's stop: MPI_Finalize when ebb initialised MPI. */
EBB_HIDDEN void ebb__mpi_finalize_if_ours(void);

/* ---- dist_nccl.c: the NCCL backend, through dlopen ------------------------------------------ */
EBB_HIDDEN ebb_status ebb__nccl_available(const char *fn);
/* ncclCommInitRank over the MPI communicator's ranks (unique id from rank 0 over MPI). */
EBB_HIDDEN ebb_status ebb__nccl_comm_create(const char *fn, void *mpi_comm, int device, int rank, int size, void **comm);
/* Enqueues one call on the stream (a cuda.h CUstream); its text on failure into msg. */
EBB_HIDDEN ebb_status ebb__nccl_enqueue(void *comm, const dist_call *c, const void *sendbuf, struct CUstream_st *stream,
                                        int size, char *msg, size_t cap);
/* EBB_OK, or the communicator's asynchronous error (EBB_EIO, its text in msg). */
EBB_HIDDEN ebb_status ebb__nccl_async_error(void *comm, char *msg, size_t cap);
/* ncclCommDestroy, or ncclCommAbort when !healthy. */
EBB_HIDDEN void ebb__nccl_comm_free(void *comm, bool healthy);

#endif /* EBB_DIST_IMPL_H */
