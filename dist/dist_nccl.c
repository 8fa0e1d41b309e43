/* dist_nccl.c: the NCCL backend, loaded with dlopen("libnccl.so.2") and never linked.
 *
 * NCCL is not a Debian package: like libcuda it is found at run time or the backend reports
 * itself unavailable, with dlopen's or dlsym's text. The types come from the CUDA toolkit's
 * nccl.h when the build found one (EBB_HAVE_NCCL_H), else from the few declarations below, which
 * follow NCCL's stable C ABI (handles are pointers, enums are ints, the unique id 128 bytes).
 * NCCL runs on CUDA devices only: with the emulated driver the backend is unavailable.
 * A communicator is made with ncclCommInitRank, the unique id going from rank 0 to the others
 * over the group's MPI communicator, with the group's device current. Its calls are enqueued
 * on the group's communication stream (a CUstream is a cudaStream_t). NCCL has no barrier: a
 * barrier is an all-reduce of one float in a device word the communicator owns.
 * Threading: the library is loaded once (a leaf mutex); a communicator is used by its group's
 * issue path, serialised by the group's issue lock.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_impl.h"
#include "runtime_export.h"

#if EBB_HAVE_NCCL_H
#include <nccl.h>
#else
typedef struct ncclComm *ncclComm_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum { ncclSuccess = 0, ncclInProgress = 7 } ncclResult_t;
typedef enum { ncclSum = 0, ncclAvg = 4 } ncclRedOp_t;
typedef enum {
  ncclInt8 = 0, ncclInt64 = 4, ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9
} ncclDataType_t;
#endif

/* The entry points ebb uses, resolved by name. */
typedef struct nccl_api {
  ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
  ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
  ncclResult_t (*AllReduce)(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, void *stream);
  ncclResult_t (*Broadcast)(const void *s, void *r, size_t n, ncclDataType_t t, int root, ncclComm_t c, void *stream);
  ncclResult_t (*AllGather)(const void *s, void *r, size_t n, ncclDataType_t t, ncclComm_t c, void *stream);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t c, ncclResult_t *err);
  ncclResult_t (*CommAbort)(ncclComm_t c);
  ncclResult_t (*CommDestroy)(ncclComm_t c);
  const char *(*GetErrorString)(ncclResult_t r); /* optional */
} nccl_api;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static nccl_api api;
static int load_state; /* under load_mu: 0 not tried, 1 loaded, -1 failed (why in load_why) */
static char load_why[400];

static ebb_status load(const char *fn) {
  pthread_mutex_lock(&load_mu);
  if (!load_state) {
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      snprintf(load_why, sizeof load_why, "libnccl.so.2 could not be loaded (%s); install NCCL where the dynamic "
               "loader finds it (LD_LIBRARY_PATH), or use EBB_DIST_MPI", dlerror());
      load_state = -1;
    } else {
      static const struct { const char *name; size_t off; } syms[] = {
          {"ncclGetUniqueId", offsetof(nccl_api, GetUniqueId)},
          {"ncclCommInitRank", offsetof(nccl_api, CommInitRank)},
          {"ncclAllReduce", offsetof(nccl_api, AllReduce)},
          {"ncclBroadcast", offsetof(nccl_api, Broadcast)},
          {"ncclAllGather", offsetof(nccl_api, AllGather)},
          {"ncclGroupStart", offsetof(nccl_api, GroupStart)},
          {"ncclGroupEnd", offsetof(nccl_api, GroupEnd)},
          {"ncclCommGetAsyncError", offsetof(nccl_api, CommGetAsyncError)},
          {"ncclCommAbort", offsetof(nccl_api, CommAbort)},
          {"ncclCommDestroy", offsetof(nccl_api, CommDestroy)},
      };
      load_state = 1;
      for (size_t i = 0; i < EBB_ARRAY_LEN(syms); i++) {
        void *p = dlsym(h, syms[i].name);
        if (!p) {
          snprintf(load_why, sizeof load_why, "libnccl.so.2 has no %s (an NCCL older than 2.10?); expected NCCL 2.10 or "
                   "newer", syms[i].name);
          load_state = -1;
          break;
        }
        memcpy((char *)&api + syms[i].off, &p, sizeof p);
      }
      void *es = dlsym(h, "ncclGetErrorString");
      memcpy(&api.GetErrorString, &es, sizeof es);
      if (load_state < 0) dlclose(h); /* else kept for the process's life */
    }
  }
  int state = load_state;
  pthread_mutex_unlock(&load_mu);
  if (state < 0) return ebb__fail(EBB_ENOTSUP, "%s: the NCCL backend is unavailable: %s", fn, load_why);
  return EBB_OK;
}

ebb_status ebb__nccl_available(const char *fn) {
  ebb_driver_info di;
  ebb_status st = ebb_driver_get_info(&di);
  if (st) return st;
  if (di.kind != EBB_DRIVER_CUDA)
    return ebb__fail(EBB_ENOTSUP, "%s: the NCCL backend needs CUDA devices, and the driver is %s (%s); expected "
                     "EBB_DIST_MPI on this driver", fn, di.name, di.reason);
  return load(fn);
}

static const char *nccl_text(ncclResult_t r) { return api.GetErrorString ? api.GetErrorString(r) : "NCCL error"; }

typedef struct nccl_group {
  ncclComm_t comm;
  int device;
  uint64_t scratch; /* one device float, the barrier's payload */
} nccl_group;

ebb_status ebb__nccl_comm_create(const char *fn, void *mpi_comm, int device, int rank, int size, void **out) {
  ebb_status st = load(fn);
  if (st) return st;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclResult_t r = ncclSuccess;
  if (rank == 0 && (r = api.GetUniqueId(&id)) != ncclSuccess)
    return ebb__fail(EBB_EIO, "%s: ncclGetUniqueId failed on rank 0: %s", fn, nccl_text(r));
  /* Every rank takes part in the broadcast, rank 0's failure included, so none waits forever:
   * a failed rank 0 sends zeros, which make the others' ncclCommInitRank fail. */
  if ((st = ebb__mpi_bcast_bytes(fn, mpi_comm, &id, sizeof id, 0))) return st;
  nccl_group *g = calloc(1, sizeof *g);
  if (!g) return ebb__fail(EBB_ENOMEM, "%s: out of host memory for an NCCL communicator", fn);
  g->device = device;
  ebb_dev_guard guard;
  if ((st = ebb_dev_guard_enter(&guard, device))) goto fail_free;
  if ((st = ebb__drv_mem_alloc(device, sizeof(float), &g->scratch))) goto fail_guard;
  if ((r = api.CommInitRank(&g->comm, size, id, rank)) != ncclSuccess) {
    st = ebb__fail(EBB_EIO, "%s: ncclCommInitRank (rank %d of %d, device %d) failed: %s", fn, rank, size, device,
                   nccl_text(r));
    goto fail_mem;
  }
  ebb_dev_guard_exit(&guard);
  *out = g;
  return EBB_OK;

fail_mem:
  ebb__drv_mem_free(device, g->scratch);
fail_guard:
  ebb_dev_guard_exit(&guard);
fail_free:
  free(g);
  return st;
}

static ncclDataType_t nccl_type(dist_elem e) {
  switch (e) {
  case DIST_ELEM_F32: return ncclFloat32;
  case DIST_ELEM_F64: return ncclFloat64;
  case DIST_ELEM_I64: return ncclInt64;
  case DIST_ELEM_BF16: return ncclBfloat16;
  case DIST_ELEM_F16: return ncclFloat16;
  case DIST_ELEM_BYTE: break;
  }
  return ncclInt8;
}

ebb_status ebb__nccl_enqueue(void *comm, const dist_call *c, const void *sendbuf, struct CUstream_st *stream, int size,
                             char *msg, size_t cap) {
  (void)size;
  nccl_group *g = comm;
  ncclResult_t r = ncclSuccess;
  const char *call = "";
  ncclDataType_t t = nccl_type(c->elem);
  size_t n = c->elem == DIST_ELEM_BYTE ? c->count * c->elem_bytes : c->count;
  switch (c->kind) {
  case DIST_ALL_REDUCE:
    call = "ncclAllReduce";
    r = api.AllReduce(sendbuf, c->buf, n, t, c->avg ? ncclAvg : ncclSum, g->comm, stream);
    break;
  case DIST_BROADCAST:
    call = "ncclBroadcast";
    r = api.Broadcast(sendbuf, c->buf, n, t, c->root, g->comm, stream);
    break;
  case DIST_ALL_GATHER:
    call = "ncclAllGather";
    r = api.AllGather(sendbuf, c->buf, n, t, g->comm, stream);
    break;
  case DIST_BARRIER: {
    call = "ncclAllReduce (barrier)";
    void *p = (void *)(uintptr_t)g->scratch;
    r = api.AllReduce(p, p, 1, ncclFloat32, ncclSum, g->comm, stream);
    break;
  }
  }
  if (r == ncclSuccess) return EBB_OK;
  snprintf(msg, cap, "%s failed: %s", call, nccl_text(r));
  return EBB_EIO;
}

ebb_status ebb__nccl_async_error(void *comm, char *msg, size_t cap) {
  nccl_group *g = comm;
  ncclResult_t err = ncclSuccess;
  ncclResult_t r = api.CommGetAsyncError(g->comm, &err);
  if (r != ncclSuccess) err = r;
  if (err == ncclSuccess || err == ncclInProgress) return EBB_OK;
  snprintf(msg, cap, "the NCCL communicator reported an asynchronous error: %s (a rank may have died)", nccl_text(err));
  return EBB_EIO;
}

void ebb__nccl_comm_free(void *comm, bool healthy) {
  nccl_group *g = comm;
  if (!g) return;
  if (healthy) api.CommDestroy(g->comm);
  else api.CommAbort(g->comm);
  ebb__drv_mem_free(g->device, g->scratch);
  free(g);
}
