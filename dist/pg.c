/* pg.c: process groups, their work records and communication threads, and the dist module.
 *
 * A group record lives from ebb_pg_create to the process's end (records are few, and a
 * destroyed group's handle must still read as destroyed); a work record is reused first-in
 * first-out once 1024 newer records have been released, so a stale handle reads as released
 * until then. The communication thread of an MPI group takes the head of its group's queue once
 * it is READY, runs the blocking MPI call with no lock held, and finishes it; records behind it
 * wait their turn, so the calls reach MPI in issue order on every rank.
 * Locks: dist_mu (leaf) guards states and queues; a group's issue_mu, taken before the streams
 * and alloc calls of an issue, makes the communication stream's order the queue's order.
 * Timeouts count from the moment a record starts running: whoever waits (ebb_work_wait, a
 * stream's gate, ebb_pg_destroy) checks the deadline, since MPI's blocking calls cannot be
 * interrupted.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dist_impl.h"
#include "alloc_export.h"
#include "ebb/alloc.h"
#include "ebb/trace.h"
#include "runtime_export.h"
#include "streams_export.h"

#define PG_MAGIC 0x70677270u   /* "pgrp" */
#define WORK_MAGIC 0x776f726bu /* "work" */
#define WORK_REUSE_AFTER 1024  /* released records kept before the oldest is reused */

ebb_mutex ebb__dist_mu;
pthread_cond_t ebb__dist_cv;

/* Under dist_mu: every group record ever made, the free work records (oldest first), counts. */
static struct ebb_list all_groups = {&all_groups, &all_groups};
static struct ebb_list free_work = {&free_work, &free_work};
static long nfree_work;
static long live_groups, live_work;
static bool module_ready;

const char *ebb_dist_backend_name(ebb_dist_backend b) {
  switch (b) {
  case EBB_DIST_MPI: return "mpi";
  case EBB_DIST_NCCL: return "nccl";
  }
  return "unknown";
}

const char *ebb__dist_kind_name(dist_kind k) {
  switch (k) {
  case DIST_ALL_REDUCE: return "all_reduce";
  case DIST_BROADCAST: return "broadcast";
  case DIST_ALL_GATHER: return "all_gather";
  case DIST_BARRIER: return "barrier";
  }
  return "collective";
}

/* ---- the module ------------------------------------------------------------------------------ */

static ebb_status dist_start(void) {
  /* The lock and condition variable are set up once per process (a restart reuses them):
   * records outlive a shutdown, and their handles must still be checked after it. */
  static bool once;
  if (!once) {
    ebb__mutex_init(&ebb__dist_mu, "dist", EBB_RANK_LEAF);
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&ebb__dist_cv, &a);
    pthread_condattr_destroy(&a);
    once = true;
  }
  ebb__mutex_lock(&ebb__dist_mu);
  module_ready = true;
  ebb__mutex_unlock(&ebb__dist_mu);
  return EBB_OK;
}

static void dist_stop(void) {
  ebb__mutex_lock(&ebb__dist_mu);
  module_ready = false;
  ebb__mutex_unlock(&ebb__dist_mu);
  ebb__mpi_finalize_if_ours();
}

static int dist_count(ebb__live_count *out, int max) {
  if (max < 2) return 0;
  ebb__mutex_lock(&ebb__dist_mu);
  out[0] = (ebb__live_count){"process groups", live_groups};
  out[1] = (ebb__live_count){"work handles", live_work};
  ebb__mutex_unlock(&ebb__dist_mu);
  return 2;
}

const ebb__module_desc ebb__module_dist = {
    .name = "dist",
    .layer = EBB__LAYER_DIST,
    .start = dist_start,
    .stop = dist_stop,
    .count = dist_count,
};

/* ---- waiting --------------------------------------------------------------------------------- */

void ebb__dist_wait_locked(uint64_t deadline_ns) {
  if (!deadline_ns) {
    ebb__cond_wait(&ebb__dist_cv, &ebb__dist_mu);
    return;
  }
  struct timespec ts = {(time_t)(deadline_ns / 1000000000u), (long)(deadline_ns % 1000000000u)};
  /* The held-rank stack stays as it is across the timed wait: the thread takes no lock while
   * parked, and holds dist_mu again when it returns. */
  int rc = pthread_cond_timedwait(&ebb__dist_cv, &ebb__dist_mu.m, &ts);
  EBB_ASSERT(rc == 0 || rc == ETIMEDOUT || rc == EINTR);
  (void)rc;
}

bool ebb__work_timed_out_locked(const struct ebb_work *w, uint64_t now) {
  return w->state == WORK_RUNNING && w->timeout_ms >= 0 && now - w->start_ns > (uint64_t)w->timeout_ms * 1000000u;
}

void ebb__work_time_out_locked(struct ebb_work *w, const char *who) {
  if (w->abort_on_timeout) ebb__mpi_abort_job();
  char msg[EBB__DIST_MSG_MAX];
  snprintf(msg, sizeof msg,
           "%s #%llu of the %s group (rank %d of %d) did not finish within the group's timeout of %d ms (%s gave up "
           "waiting): a rank may have died or issued another collective; every rank must issue the same collectives "
           "in the same order",
           ebb__dist_kind_name(w->call.kind), (unsigned long long)w->seq, ebb_dist_backend_name(w->pg->backend),
           w->pg->rank, w->pg->size, w->timeout_ms, who);
  ebb__work_finish_locked(w, EBB_EIO, msg);
  w->abandoned = true;
}

void ebb__work_settle_locked(struct ebb_work *w, const char *who) {
  if (w->state == WORK_READY && w->pg->failed) {
    /* Under dist_mu a failed group's thread runs no READY record: it may be finished here. */
    char msg[EBB__DIST_MSG_MAX];
    snprintf(msg, sizeof msg, "%s #%llu not run: the group had failed before it: %.400s",
             ebb__dist_kind_name(w->call.kind), (unsigned long long)w->seq, w->pg->fail_msg);
    ebb__work_finish_locked(w, EBB_ESTATE, msg);
  } else if (ebb__work_timed_out_locked(w, ebb__now_ns())) {
    ebb__work_time_out_locked(w, who);
  }
}

/* ---- work records ---------------------------------------------------------------------------- */

ebb_status ebb__work_new(struct ebb_pg *pg, bool caller, struct ebb_work **out) {
  struct ebb_work *w = NULL;
  ebb__mutex_lock(&ebb__dist_mu);
  if (nfree_work > WORK_REUSE_AFTER) {
    w = ebb_container_of(free_work.next, struct ebb_work, qnode);
    ebb_list_remove(&w->qnode);
    nfree_work--;
  }
  ebb__mutex_unlock(&ebb__dist_mu);
  /* Records are never freed (type-stable: a released handle stays readable as released). */
  if (!w && !(w = calloc(1, sizeof *w))) return ebb__fail(EBB_ENOMEM, "out of host memory for a work record");
  *w = (struct ebb_work){
      .magic = caller ? WORK_MAGIC : 0,
      .refs = caller ? 2 : 1,
      .caller_ref = caller,
      .pg = pg,
      .timeout_ms = pg->timeout_ms,
      .abort_on_timeout = pg->abort_on_timeout,
      .owner = ebb__alloc_owner_current(NULL), /* the issuing thread's */
  };
  ebb_list_init(&w->qnode);
  if (caller) {
    ebb__mutex_lock(&ebb__dist_mu);
    live_work++;
    ebb__mutex_unlock(&ebb__dist_mu);
    ebb__debug_live_add(1);
  }
  *out = w;
  return EBB_OK;
}

void ebb__work_unref_locked(struct ebb_work *w) {
  EBB_ASSERT(w->refs > 0);
  if (--w->refs) return;
  EBB_ASSERT(w->state == WORK_DONE || w->state == WORK_QUEUED);
  w->pg = NULL;
  ebb_list_insert_tail(&free_work, &w->qnode);
  nfree_work++;
}

void ebb__work_enqueue_locked(struct ebb_pg *pg, struct ebb_work *w) {
  w->seq = ++pg->next_seq;
  ebb_list_insert_tail(&pg->queue, &w->qnode);
  pthread_cond_broadcast(&ebb__dist_cv);
}

void ebb__work_finish_locked(struct ebb_work *w, ebb_status st, const char *msg) {
  if (w->state == WORK_DONE) return; /* abandoned past its timeout: the first outcome stands */
  w->state = WORK_DONE;
  w->st = st;
  if (st) {
    snprintf(w->msg, sizeof w->msg, "%s", msg ? msg : "failed");
    struct ebb_pg *pg = w->pg;
    if (!pg->failed) {
      pg->failed = true;
      snprintf(pg->fail_msg, sizeof pg->fail_msg, "%s", w->msg);
    }
  }
  pthread_cond_broadcast(&ebb__dist_cv);
}

/* ---- the communication thread ---------------------------------------------------------------- */

/* The link model (EBB_DIST_LINK_GBPS, for benchmarks on one machine): the Gbit/s of a modelled
 * link, 0 or unset for none. An all-reduce then lasts at least what a ring all-reduce of its
 * bytes takes on that link (2 (n - 1) / n of them each way), the thread sleeping for the rest,
 * so its duration is set and takes no core (as the emulated driver's EBB_SIM_COPY_GBPS does for
 * copies). Read when a group's thread starts. */
static double link_gbps(void) {
  const char *v = getenv("EBB_DIST_LINK_GBPS");
  double g = v ? strtod(v, NULL) : 0;
  return g > 0 ? g : 0;
}

static void link_sleep(const struct ebb_pg *pg, const struct ebb_work *w, double gbps, uint64_t start_ns) {
  if (gbps <= 0 || w->call.kind != DIST_ALL_REDUCE || pg->size < 2) return;
  double bytes = (double)w->call.count * (double)w->call.elem_bytes * 2.0 * (pg->size - 1) / pg->size;
  uint64_t want = start_ns + (uint64_t)(bytes * 8.0 / gbps), now = ebb__now_ns(); /* Gbit/s = bits per ns */
  if (now >= want) return;
  struct timespec ts = {(time_t)((want - now) / 1000000000u), (long)((want - now) % 1000000000u)};
  nanosleep(&ts, NULL);
}

/* One collective the communication thread ran, as a span from the start of its backend call to
 * its end (the link model's wait included): on the communication stream's track for a device
 * group (the stream waits at the gate meanwhile, so it is the collective's time on the stream),
 * on the thread's track for a CPU group. Its bytes are one rank's part, its seq the collective's
 * number on the group, its owner the scope its issuer had open (a bucket's, for the reducer). */
static void trace_collective(const struct ebb_pg *pg, const struct ebb_work *w, uint64_t start, uint64_t end) {
  if (!ebb_trace_enabled()) return;
  ebb_trace_span r = {.name = ebb__dist_kind_name(w->call.kind),
                      .start_ns = start,
                      .end_ns = end,
                      .device = pg->device,
                      .stream = pg->trace_stream,
                      .kind = EBB_TRACE_SPAN,
                      .args = EBB_TRACE_ARG_SEQ | EBB_TRACE_ARG_BYTES,
                      .seq = w->seq,
                      .bytes = (uint64_t)(w->call.count * w->call.elem_bytes),
                      .owner = w->owner && *w->owner ? w->owner : NULL};
  (void)ebb_trace_record(&r);
}

static void *comm_main(void *arg) {
  struct ebb_pg *pg = arg;
  double gbps = link_gbps();
  char name[32];
  snprintf(name, sizeof name, "dist %s comm", ebb_dist_backend_name(pg->backend));
  ebb__trace_thread_name_default(name);
  ebb__mutex_lock(&ebb__dist_mu);
  for (;;) {
    if (ebb_list_empty(&pg->queue)) {
      if (pg->stopping) break;
      ebb__dist_wait_locked(0);
      continue;
    }
    struct ebb_work *w = ebb_container_of(pg->queue.next, struct ebb_work, qnode);
    if (w->state == WORK_QUEUED) { /* a device record: its stream's gate has not run yet */
      ebb__dist_wait_locked(0);
      continue;
    }
    ebb_status st = EBB_OK;
    char msg[EBB__DIST_MSG_MAX] = "";
    if (w->state == WORK_READY) {
      if (pg->failed) {
        /* An earlier collective failed: the ranks no longer agree on the sequence, so nothing
         * more goes to MPI. */
        st = EBB_ESTATE;
        snprintf(msg, sizeof msg, "%s #%llu not run: the group had failed before it: %.400s", ebb__dist_kind_name(w->call.kind),
                 (unsigned long long)w->seq, pg->fail_msg);
      } else {
        w->state = WORK_RUNNING;
        w->start_ns = ebb__now_ns();
        pthread_cond_broadcast(&ebb__dist_cv); /* waiters now have a deadline */
        ebb__mutex_unlock(&ebb__dist_mu);
        st = ebb__mpi_run(pg->mpi_comm, &w->call, pg->rank, pg->size, msg, sizeof msg);
        if (!st) link_sleep(pg, w, gbps, w->start_ns);
        trace_collective(pg, w, w->start_ns, ebb__now_ns());
        ebb__mutex_lock(&ebb__dist_mu);
      }
    }
    /* DONE already: abandoned by a waiter past its timeout, and the call has now returned. */
    ebb__work_finish_locked(w, st, msg);
    ebb_list_remove(&w->qnode);
    ebb_list_init(&w->qnode);
    ebb_tensor_t *hold[2] = {w->hold[0], w->hold[1]};
    w->hold[0] = w->hold[1] = NULL;
    if (w->pinned) {
      /* Handed back only now, not at issue: a gate that gave up on its timeout lets the stream
       * go on while MPI may still write the block. */
      if (pg->nspent == pg->spent_cap) {
        int cap = pg->spent_cap ? 2 * pg->spent_cap : 16;
        void **p = realloc(pg->spent, (size_t)cap * sizeof *p);
        if (p) pg->spent = p, pg->spent_cap = cap;
      }
      if (pg->nspent < pg->spent_cap) pg->spent[pg->nspent++] = w->pinned; /* else kept: no memory to list it */
      w->pinned = NULL;
    }
    ebb__work_unref_locked(w); /* the queue's reference */
    pthread_cond_broadcast(&ebb__dist_cv);
    if (hold[0] || hold[1]) {
      /* Releasing may run autograd's hooks, which take locks ranked below dist_mu. */
      ebb__mutex_unlock(&ebb__dist_mu);
      for (int i = 0; i < 2; i++)
        if (hold[i]) ebb_tensor_release(hold[i]);
      ebb__mutex_lock(&ebb__dist_mu);
    }
  }
  ebb__mutex_unlock(&ebb__dist_mu);
  return NULL;
}

void ebb__pg_free_spent(struct ebb_pg *pg) {
  for (;;) {
    ebb__mutex_lock(&ebb__dist_mu);
    void *p = pg->nspent ? pg->spent[--pg->nspent] : NULL;
    ebb__mutex_unlock(&ebb__dist_mu);
    if (!p) return;
    /* Its copies recorded the communication stream on it: reused only after they ran. */
    ebb_pinned_free(p);
  }
}

/* The gate: a host function on a device group's communication stream, after the input was
 * copied into pinned memory. It hands the record to the communication thread and holds the
 * stream until the MPI call has finished (or its timeout passed), so what the stream runs next
 * (the copy of the result back, the end event) follows the call. */
void ebb__work_gate(void *user) {
  struct ebb_work *w = user;
  ebb__mutex_lock(&ebb__dist_mu);
  if (w->state == WORK_QUEUED) w->state = WORK_READY;
  pthread_cond_broadcast(&ebb__dist_cv);
  for (;;) {
    ebb__work_settle_locked(w, "the communication stream's gate");
    if (w->state == WORK_DONE) break;
    uint64_t deadline = 0;
    if (w->state == WORK_RUNNING && w->timeout_ms >= 0) deadline = w->start_ns + (uint64_t)w->timeout_ms * 1000000u + 1;
    ebb__dist_wait_locked(deadline);
  }
  ebb__work_unref_locked(w); /* the gate's reference */
  ebb__mutex_unlock(&ebb__dist_mu);
}

/* ---- groups ---------------------------------------------------------------------------------- */

ebb_status ebb__pg_check(const struct ebb_pg *pg, const char *fn) {
  if (!pg) return ebb__fail(EBB_EINVAL, "%s: pg is NULL; expected a process group from ebb_pg_create", fn);
  if (pg->magic != PG_MAGIC)
    return ebb__fail(EBB_EFREED, "%s: process group %p was destroyed (ebb_pg_destroy); expected a live group", fn,
                     (const void *)pg);
  return EBB_OK;
}

ebb_status ebb_dist_available(ebb_dist_backend backend) {
  static const char fn[] = "ebb_dist_available";
  if (!ebb_is_initialized()) return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init first", fn);
  switch (backend) {
  case EBB_DIST_MPI: return ebb__mpi_available(fn);
  case EBB_DIST_NCCL: {
    ebb_status st = ebb__mpi_available(fn);
    return st ? st : ebb__nccl_available(fn);
  }
  }
  return ebb__fail(EBB_EINVAL, "%s: backend %d is not one of EBB_DIST_MPI (0), EBB_DIST_NCCL (1)", fn, (int)backend);
}

static ebb_status check_options(const ebb_pg_options *o, const char *fn) {
  if (!o) return EBB_OK;
  if (o->version > EBB_PG_OPTIONS_VERSION)
    return ebb__fail(EBB_ENOTSUP, "%s: options version %u is newer than this library reads (%u); expected 0 or %u", fn,
                     (unsigned)o->version, (unsigned)EBB_PG_OPTIONS_VERSION, (unsigned)EBB_PG_OPTIONS_VERSION);
  if (o->world_size < 0)
    return ebb__fail(EBB_EINVAL, "%s: options world_size %d is negative; expected 0 (the launcher's) or the job's rank count",
                     fn, o->world_size);
  if (o->timeout_ms < -1)
    return ebb__fail(EBB_EINVAL, "%s: options timeout_ms %d; expected -1 (no limit), 0 (the default, %d ms) or a positive "
                     "number of milliseconds", fn, o->timeout_ms, EBB_PG_DEFAULT_TIMEOUT_MS);
  return EBB_OK;
}

ebb_status ebb_pg_create(ebb_dist_backend backend, int device, const ebb_pg_options *opts, ebb_pg_t **out) {
  static const char fn[] = "ebb_pg_create";
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected where to write the group", fn);
  if (backend != EBB_DIST_MPI && backend != EBB_DIST_NCCL)
    return ebb__fail(EBB_EINVAL, "%s: backend %d is not one of EBB_DIST_MPI (0), EBB_DIST_NCCL (1)", fn, (int)backend);
  if (!ebb_is_initialized()) return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init first", fn);
  ebb_status st = check_options(opts, fn);
  if (st) return st;
  int ndev = 0;
  if ((st = ebb_dev_count(&ndev))) return st;
  if (device != EBB_DEVICE_CPU && (device < 0 || device >= ndev))
    return ebb__fail(EBB_EDEVICE, "%s: device %d does not exist; expected EBB_DEVICE_CPU (-1) or a device in [0, %d)", fn,
                     device, ndev);
  if (backend == EBB_DIST_NCCL && device == EBB_DEVICE_CPU)
    return ebb__fail(EBB_ENOTSUP, "%s: the NCCL backend moves device memory only; expected a CUDA device, not "
                     "EBB_DEVICE_CPU (use EBB_DIST_MPI for CPU tensors)", fn);
  if ((st = ebb__mpi_available(fn))) return st;
  if (backend == EBB_DIST_NCCL && (st = ebb__nccl_available(fn))) return st;

  struct ebb_pg *pg = calloc(1, sizeof *pg);
  if (!pg) return ebb__fail(EBB_ENOMEM, "%s: out of host memory for a group", fn);
  pg->backend = backend;
  pg->device = device;
  pg->timeout_ms = opts && opts->timeout_ms ? opts->timeout_ms : EBB_PG_DEFAULT_TIMEOUT_MS;
  pg->abort_on_timeout = opts && opts->abort_on_timeout;
  ebb_list_init(&pg->queue);
  ebb__mutex_init(&pg->issue_mu, "dist issue", EBB_RANK_DIST_ISSUE);

  if ((st = ebb__mpi_comm_create(fn, &pg->mpi_comm, &pg->rank, &pg->size))) goto fail_free;
  if (opts && opts->world_size && opts->world_size != pg->size) {
    st = ebb__fail(EBB_EINVAL, "%s: options world_size %d, but the job has %d ranks (MPI_COMM_WORLD's size); expected 0 "
                   "or %d (launch with mpirun -np %d for %d)", fn, opts->world_size, pg->size, pg->size,
                   opts->world_size, opts->world_size);
    goto fail_comm;
  }
  if (device != EBB_DEVICE_CPU) {
    if ((st = ebb_stream_create(device, EBB_PRIO_HIGH, &pg->stream))) goto fail_comm;
    ebb__streams_live_add(-1); /* the group's own: counted as the group */
    /* Its track says what it carries; a name that cannot be stored leaves the stream's own. */
    struct CUstream_st *cu = NULL; /* a track is keyed by its driver stream's handle (ebb/trace.h) */
    if (ebb_stream_cu(pg->stream, &cu) == EBB_OK) pg->trace_stream = (uint64_t)(uintptr_t)cu;
    uint64_t sid = 0;
    (void)ebb_stream_id(pg->stream, &sid);
    char tn[64];
    snprintf(tn, sizeof tn, "comm %s stream %llu (device %d, rank %d of %d)", ebb_dist_backend_name(backend),
             (unsigned long long)sid, device, pg->rank, pg->size);
    ebb__fail_mute(true);
    (void)ebb_trace_stream_name(device, pg->trace_stream, tn);
    ebb__fail_mute(false);
    char on[48];
    snprintf(on, sizeof on, "dist %s staging", ebb_dist_backend_name(backend));
    if ((st = ebb__alloc_intern(fn, on, &pg->staging_owner))) goto fail_stream;
  }
  if (backend == EBB_DIST_NCCL) {
    if ((st = ebb__nccl_comm_create(fn, pg->mpi_comm, device, pg->rank, pg->size, &pg->nccl_comm))) goto fail_stream;
  } else {
    int rc = pthread_create(&pg->thread, NULL, comm_main, pg);
    if (rc) {
      st = ebb__fail(EBB_ENOMEM, "%s: could not start the communication thread: %s", fn, strerror(rc));
      goto fail_stream;
    }
    pg->thread_started = true;
  }
  pg->magic = PG_MAGIC;
  ebb__mutex_lock(&ebb__dist_mu);
  ebb_list_insert_tail(&all_groups, &pg->all);
  live_groups++;
  ebb__mutex_unlock(&ebb__dist_mu);
  ebb__debug_live_add(1);
  *out = pg;
  return EBB_OK;

fail_stream:
  if (pg->stream) {
    ebb__streams_live_add(1);
    ebb_stream_release(pg->stream);
  }
fail_comm:
  ebb__mpi_comm_free(pg->mpi_comm, true);
fail_free:
  ebb__mutex_destroy(&pg->issue_mu);
  free(pg);
  return st;
}

ebb_status ebb_pg_destroy(ebb_pg_t *pg) {
  static const char fn[] = "ebb_pg_destroy";
  ebb_status st = ebb__pg_check(pg, fn);
  if (st) return st;
  ebb__mutex_lock(&pg->issue_mu); /* no issue in flight from here on */
  ebb__mutex_lock(&ebb__dist_mu);
  if (pg->magic != PG_MAGIC) { /* a racing destroy won */
    ebb__mutex_unlock(&ebb__dist_mu);
    ebb__mutex_unlock(&pg->issue_mu);
    return ebb__fail(EBB_EFREED, "%s: process group %p was destroyed (ebb_pg_destroy); expected a live group", fn, (void *)pg);
  }
  pg->stopping = true;
  pthread_cond_broadcast(&ebb__dist_cv);
  /* Wait for the queue to drain, each running call at most its timeout. */
  while (!ebb_list_empty(&pg->queue)) {
    struct ebb_work *w = ebb_container_of(pg->queue.next, struct ebb_work, qnode);
    uint64_t now = ebb__now_ns();
    if (ebb__work_timed_out_locked(w, now) || (w->abandoned && w->state == WORK_DONE)) {
      if (w->state != WORK_DONE) ebb__work_time_out_locked(w, fn);
      pg->thread_stuck = true;
      char what[160];
      snprintf(what, sizeof what, "%s #%llu", ebb__dist_kind_name(w->call.kind), (unsigned long long)w->seq);
      ebb__mutex_unlock(&ebb__dist_mu);
      ebb__mutex_unlock(&pg->issue_mu);
      return ebb__fail(EBB_EBUSY, "%s: the communication thread of the %s group is still blocked in %s past the timeout "
                       "(%d ms), which MPI cannot cancel; the group stays allocated: end the process (or create groups "
                       "with abort_on_timeout)", fn, ebb_dist_backend_name(pg->backend), what, pg->timeout_ms);
    }
    uint64_t deadline = 0;
    if (w->state == WORK_RUNNING && w->timeout_ms >= 0) deadline = w->start_ns + (uint64_t)w->timeout_ms * 1000000u + 1;
    ebb__dist_wait_locked(deadline);
  }
  pg->magic = 0;
  bool healthy = !pg->failed;
  live_groups--;
  ebb__mutex_unlock(&ebb__dist_mu);
  ebb__mutex_unlock(&pg->issue_mu);
  if (pg->thread_started) pthread_join(pg->thread, NULL);
  ebb__pg_free_spent(pg);
  free(pg->spent);
  pg->spent = NULL;
  pg->spent_cap = 0;
  if (pg->nccl_comm) {
    /* The communicator is destroyed with nothing of it left on the stream. */
    if (healthy && ebb_stream_synchronize(pg->stream)) healthy = false;
    char msg[EBB__DIST_MSG_MAX];
    if (ebb__nccl_async_error(pg->nccl_comm, msg, sizeof msg)) healthy = false;
    ebb__nccl_comm_free(pg->nccl_comm, healthy);
  }
  ebb__mpi_comm_free(pg->mpi_comm, healthy);
  pg->mpi_comm = pg->nccl_comm = NULL;
  if (pg->stream) {
    ebb__streams_live_add(1);
    ebb_stream_release(pg->stream); /* the stream's queued work finishes first (stream.h) */
    pg->stream = NULL;
  }
  ebb__debug_live_add(-1);
  return EBB_OK;
}

ebb_status ebb_pg_rank(const ebb_pg_t *pg, int *rank) {
  ebb_status st = ebb__pg_check(pg, "ebb_pg_rank");
  if (st) return st;
  if (!rank) return ebb__fail(EBB_EINVAL, "ebb_pg_rank: rank is NULL; expected where to write the rank");
  *rank = pg->rank;
  return EBB_OK;
}

ebb_status ebb_pg_size(const ebb_pg_t *pg, int *size) {
  ebb_status st = ebb__pg_check(pg, "ebb_pg_size");
  if (st) return st;
  if (!size) return ebb__fail(EBB_EINVAL, "ebb_pg_size: size is NULL; expected where to write the size");
  *size = pg->size;
  return EBB_OK;
}

ebb_status ebb_pg_device(const ebb_pg_t *pg, int *device) {
  ebb_status st = ebb__pg_check(pg, "ebb_pg_device");
  if (st) return st;
  if (!device) return ebb__fail(EBB_EINVAL, "ebb_pg_device: device is NULL; expected where to write the device");
  *device = pg->device;
  return EBB_OK;
}

ebb_status ebb_pg_backend(const ebb_pg_t *pg, ebb_dist_backend *backend) {
  ebb_status st = ebb__pg_check(pg, "ebb_pg_backend");
  if (st) return st;
  if (!backend) return ebb__fail(EBB_EINVAL, "ebb_pg_backend: backend is NULL; expected where to write the backend");
  *backend = pg->backend;
  return EBB_OK;
}

/* ---- work handles ---------------------------------------------------------------------------- */

static ebb_status work_check(const struct ebb_work *w, const char *fn) {
  if (!w) return ebb__fail(EBB_EINVAL, "%s: work is NULL; expected a work handle from a collective", fn);
  if (w->magic != WORK_MAGIC)
    return ebb__fail(EBB_EFREED, "%s: work handle %p was released (ebb_work_release); expected a live handle", fn,
                     (const void *)w);
  return EBB_OK;
}

/* The device part of a finished record: its end event, polled (NCCL: with the communicator's
 * asynchronous error) until it completes or the timeout passes. */
static ebb_status wait_end_event(struct ebb_work *w, ebb_event_t *end, void *nccl, int timeout_ms, const char *fn) {
  if (!nccl) {
    /* MPI: the gate has returned or will (it has its own timeout), then the copy back runs. */
    ebb_status st = ebb_event_synchronize(end);
    return st ? ebb__fail(st, "%s: %s", fn, ebb_last_error()) : EBB_OK;
  }
  uint64_t t0 = ebb__now_ns();
  for (unsigned spins = 0;; spins++) {
    bool done = false;
    ebb_status st = ebb_event_query(end, &done);
    if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
    if (done) return EBB_OK;
    char msg[EBB__DIST_MSG_MAX];
    if ((st = ebb__nccl_async_error(nccl, msg, sizeof msg))) return ebb__fail(st, "%s: %s", fn, msg);
    if (timeout_ms >= 0 && ebb__now_ns() - t0 > (uint64_t)timeout_ms * 1000000u) {
      if (w->abort_on_timeout) ebb__mpi_abort_job();
      return ebb__fail(EBB_EIO, "%s: %s #%llu on NCCL did not finish within the group's timeout of %d ms", fn,
                       ebb__dist_kind_name(w->call.kind), (unsigned long long)w->seq, timeout_ms);
    }
    if (spins > 1000) {
      struct timespec ts = {0, 50000}; /* a host poll of the NCCL stream, not an ordering device */
      nanosleep(&ts, NULL);
    }
  }
}

ebb_status ebb_work_wait(ebb_work_t *w) {
  static const char fn[] = "ebb_work_wait";
  ebb_status st = work_check(w, fn);
  if (st) return st;
  if (ebb__in_host_fn())
    return ebb__fail(EBB_ESTATE, "%s: called from a host function (ebb_stream_host_func), which must not wait; expected "
                     "the call from a host thread", fn);
  ebb__mutex_lock(&ebb__dist_mu);
  for (;;) {
    ebb__work_settle_locked(w, fn);
    if (w->state == WORK_DONE) break;
    uint64_t deadline = 0;
    if (w->state == WORK_RUNNING && w->timeout_ms >= 0) deadline = w->start_ns + (uint64_t)w->timeout_ms * 1000000u + 1;
    ebb__dist_wait_locked(deadline);
  }
  st = w->st;
  char msg[EBB__DIST_MSG_MAX];
  snprintf(msg, sizeof msg, "%s", w->msg);
  ebb_event_t *end = w->end;
  void *nccl = w->pg && w->pg->backend == EBB_DIST_NCCL ? w->pg->nccl_comm : NULL;
  int timeout_ms = w->timeout_ms;
  w->refs++; /* kept across the event wait: a racing release must not recycle the record */
  ebb__mutex_unlock(&ebb__dist_mu);
  if (st) st = ebb__fail(st, "%s: %s", fn, msg);
  else if (end) st = wait_end_event(w, end, nccl, timeout_ms, fn);
  ebb__mutex_lock(&ebb__dist_mu);
  ebb__work_unref_locked(w);
  ebb__mutex_unlock(&ebb__dist_mu);
  return st;
}

ebb_status ebb_work_test(ebb_work_t *w, bool *done) {
  static const char fn[] = "ebb_work_test";
  ebb_status st = work_check(w, fn);
  if (st) return st;
  if (!done) return ebb__fail(EBB_EINVAL, "%s: done is NULL; expected where to write the answer", fn);
  ebb__mutex_lock(&ebb__dist_mu);
  bool d = w->state == WORK_DONE;
  ebb_event_t *end = d && !w->st ? w->end : NULL;
  ebb__mutex_unlock(&ebb__dist_mu);
  if (end) {
    /* The event belongs to the record until it is recycled; the caller's handle keeps it. */
    if ((st = ebb_event_query(end, &d))) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  }
  *done = d;
  return EBB_OK;
}

ebb_status ebb_work_release(ebb_work_t *w) {
  static const char fn[] = "ebb_work_release";
  ebb_status st = work_check(w, fn);
  if (st) return st;
  ebb__mutex_lock(&ebb__dist_mu);
  if (w->magic != WORK_MAGIC) {
    ebb__mutex_unlock(&ebb__dist_mu);
    return ebb__fail(EBB_EFREED, "%s: work handle %p was released (ebb_work_release); expected a live handle", fn, (void *)w);
  }
  w->magic = 0;
  live_work--;
  ebb_event_t *end = w->end;
  w->end = NULL;
  ebb__work_unref_locked(w);
  ebb__mutex_unlock(&ebb__dist_mu);
  if (end) {
    ebb__events_live_add(1);
    ebb_event_release(end);
  }
  ebb__debug_live_add(-1);
  return EBB_OK;
}
