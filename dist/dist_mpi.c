/* dist_mpi.c: the MPI backend: who initialises MPI, a group's communicator, and one blocking
 * collective on host memory.
 *
 * Built with Open MPI's C binding when CMake found it (EBB_HAVE_MPI); without it every entry
 * answers EBB_ENOTSUP saying the build had no MPI, and the rest of ebb is unchanged.
 * MPI is initialised by the first group creation unless the caller did it (MPI_Initialized),
 * always asking MPI_THREAD_MULTIPLE: each group calls MPI from its own communication thread,
 * beside whatever the caller does. ebb finalises only an MPI it initialised, at the module's stop
 * (the last ebb_shutdown). A group's communicator is a duplicate of MPI_COMM_WORLD whose errors
 * are returned rather than fatal, so a failing call becomes a status with MPI's own text.
 * Threading: the init state is guarded by a leaf mutex; the run entry is called by one
 * communication thread per group, which MPI_THREAD_MULTIPLE allows.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_impl.h"

#if EBB_HAVE_MPI
#include <mpi.h>

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static bool ebb_initialised_mpi; /* under init_mu */

ebb_status ebb__mpi_available(const char *fn) {
  (void)fn;
  return EBB_OK;
}

static ebb_status mpi_fail(const char *fn, const char *call, int rc) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return ebb__fail(EBB_EIO, "%s: %s failed: %s (MPI error %d)", fn, call, text, rc);
}

/* Initialises MPI unless someone did; checks the thread level either way. */
static ebb_status ensure_init(const char *fn) {
  pthread_mutex_lock(&init_mu);
  int inited = 0, finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    pthread_mutex_unlock(&init_mu);
    return ebb__fail(EBB_ESTATE, "%s: MPI was finalised in this process (%s), and MPI can be initialised only once per "
                     "process; expected the groups of a process to be created before its last ebb_shutdown", fn,
                     ebb_initialised_mpi ? "by ebb's last ebb_shutdown" : "by the program");
  }
  MPI_Initialized(&inited);
  int provided = 0;
  if (!inited) {
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      pthread_mutex_unlock(&init_mu);
      return mpi_fail(fn, "MPI_Init_thread", rc);
    }
    ebb_initialised_mpi = true;
  } else {
    MPI_Query_thread(&provided);
  }
  pthread_mutex_unlock(&init_mu);
  if (provided < MPI_THREAD_MULTIPLE)
    return ebb__fail(EBB_ENOTSUP, "%s: MPI grants thread level %d (%s), below MPI_THREAD_MULTIPLE (%d), which a group's "
                     "communication thread needs; expected MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)%s", fn, provided,
                     inited ? "initialised by the program" : "initialised by ebb", MPI_THREAD_MULTIPLE,
                     inited ? " in the program, or no MPI_Init before the first group (ebb then initialises it)" : "");
  return EBB_OK;
}

ebb_status ebb__mpi_comm_create(const char *fn, void **comm, int *rank, int *size) {
  ebb_status st = ensure_init(fn);
  if (st) return st;
  MPI_Comm *c = malloc(sizeof *c);
  if (!c) return ebb__fail(EBB_ENOMEM, "%s: out of host memory for a communicator", fn);
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, c);
  if (rc != MPI_SUCCESS) {
    free(c);
    return mpi_fail(fn, "MPI_Comm_dup(MPI_COMM_WORLD)", rc);
  }
  MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN);
  MPI_Comm_rank(*c, rank);
  MPI_Comm_size(*c, size);
  *comm = c;
  return EBB_OK;
}

void ebb__mpi_comm_free(void *comm, bool healthy) {
  MPI_Comm *c = comm;
  if (!c) return;
  /* A failed group's peers may never reach the matching free: the handle is dropped instead. */
  if (healthy) MPI_Comm_free(c);
  free(c);
}

static MPI_Datatype type_of(dist_elem e) {
  switch (e) {
  case DIST_ELEM_F32: return MPI_FLOAT;
  case DIST_ELEM_F64: return MPI_DOUBLE;
  case DIST_ELEM_I64: return MPI_INT64_T;
  case DIST_ELEM_BYTE:
  case DIST_ELEM_BF16:
  case DIST_ELEM_F16: break;
  }
  return MPI_BYTE;
}

static void divide(const dist_call *c, int size) {
  if (c->elem == DIST_ELEM_F32) {
    float *p = c->buf;
    for (size_t i = 0; i < c->count; i++) p[i] /= (float)size;
  } else if (c->elem == DIST_ELEM_F64) {
    double *p = c->buf;
    for (size_t i = 0; i < c->count; i++) p[i] /= (double)size;
  }
}

ebb_status ebb__mpi_run(void *comm, const dist_call *c, int rank, int size, char *msg, size_t cap) {
  MPI_Comm mc = *(MPI_Comm *)comm;
  int rc = MPI_SUCCESS;
  const char *call = "";
  /* Bytes moved as bytes: a count in elements of elem_bytes each. */
  MPI_Datatype t = type_of(c->elem);
  int n = (int)(t == MPI_BYTE ? c->count * c->elem_bytes : c->count);
  switch (c->kind) {
  case DIST_ALL_REDUCE:
    call = "MPI_Allreduce";
    rc = MPI_Allreduce(MPI_IN_PLACE, c->buf, n, t, MPI_SUM, mc);
    if (rc == MPI_SUCCESS && c->avg) divide(c, size);
    break;
  case DIST_BROADCAST:
    call = "MPI_Bcast";
    rc = MPI_Bcast(c->buf, n, MPI_BYTE, c->root, mc);
    break;
  case DIST_ALL_GATHER:
    call = "MPI_Allgather";
    rc = MPI_Allgather(n ? c->src : MPI_IN_PLACE, n, MPI_BYTE, c->buf, n, MPI_BYTE, mc);
    break;
  case DIST_BARRIER:
    call = "MPI_Barrier";
    rc = MPI_Barrier(mc);
    break;
  }
  if (rc == MPI_SUCCESS) return EBB_OK;
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(rc, text, &len);
  snprintf(msg, cap, "%s on rank %d of %d failed: %s (MPI error %d)", call, rank, size, text, rc);
  return EBB_EIO;
}

ebb_status ebb__mpi_bcast_bytes(const char *fn, void *comm, void *buf, size_t n, int root) {
  int rc = MPI_Bcast(buf, (int)n, MPI_BYTE, root, *(MPI_Comm *)comm);
  return rc == MPI_SUCCESS ? EBB_OK : mpi_fail(fn, "MPI_Bcast", rc);
}

void ebb__mpi_abort_job(void) { MPI_Abort(MPI_COMM_WORLD, 1); }

void ebb__mpi_finalize_if_ours(void) {
  pthread_mutex_lock(&init_mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (ebb_initialised_mpi && !finalized) MPI_Finalize();
  pthread_mutex_unlock(&init_mu);
}

#else /* !EBB_HAVE_MPI */

ebb_status ebb__mpi_available(const char *fn) {
  return ebb__fail(EBB_ENOTSUP, "%s: this build of ebb has no MPI (CMake found no MPI C library: install libopenmpi-dev "
                   "and openmpi-bin, then configure again); the MPI and NCCL backends are unavailable", fn);
}

ebb_status ebb__mpi_comm_create(const char *fn, void **comm, int *rank, int *size) {
  (void)comm, (void)rank, (void)size;
  return ebb__mpi_available(fn);
}

void ebb__mpi_comm_free(void *comm, bool healthy) { (void)comm, (void)healthy; }

ebb_status ebb__mpi_run(void *comm, const dist_call *c, int rank, int size, char *msg, size_t cap) {
  (void)comm, (void)c, (void)rank, (void)size;
  snprintf(msg, cap, "this build of ebb has no MPI");
  return EBB_ENOTSUP;
}

ebb_status ebb__mpi_bcast_bytes(const char *fn, void *comm, void *buf, size_t n, int root) {
  (void)comm, (void)buf, (void)n, (void)root;
  return ebb__mpi_available(fn);
}

void ebb__mpi_abort_job(void) {}
void ebb__mpi_finalize_if_ours(void) {}

#endif
