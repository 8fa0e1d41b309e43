/* sim_internal.h: the emulated CUDA driver's private types, shared by its four source files.
 *
 * simdrv is a standalone MODULE library: it includes ebb_cuda.h for the Driver API types and
 * ebb_list.h for intrusive lists, and nothing else from ebb. Every exported entry point is defined
 * with its cuda.h name and marked SIM_API, so ebb_cuda.h's (or cuda.h's) #define redirections give
 * the versioned symbol (cuMemAlloc -> cuMemAlloc_v2).
 *
 * Who owns what:
 *   sim_core.c   init and environment, devices and attributes, primary contexts, peer access,
 *                error names, the handle tables (struct sim_table)
 *   sim_mem.c    the range registry, device/host/VMM memory, pointer attributes
 *   sim_exec.c   streams, engine threads, commands, events, copies, memset, host functions, launch
 *   sim_kernel.c the kernel registry (ebbsim_register_kernel), modules and function handles
 *
 * Lock order (a thread holds locks only in this order): vmm lock -> sched lock -> range registry
 * rwlock -> table locks / kernel registry lock -> ctx lock. No lock is held while user code (kernels, host
 * functions) runs.
 */
#ifndef EBB_SIM_INTERNAL_H
#define EBB_SIM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb_cuda.h"
#include "ebb_list.h"

/* Exported Driver API symbols; everything else stays hidden (-fvisibility=hidden). */
#define SIM_API __attribute__((visibility("default")))

#define SIM_MAX_DEVICES 16
#define SIM_ALIGN 256u                   /* cuMemAlloc alignment, as CUDA guarantees */
#define SIM_GRANULE ((size_t)2 << 20)    /* VMM granularity: 2 MiB minimum and recommended */
#define SIM_PRIO_LEAST 0                 /* cuCtxGetStreamPriorityRange, H100-like */
#define SIM_PRIO_GREATEST (-5)
#define SIM_NPRIO (SIM_PRIO_LEAST - SIM_PRIO_GREATEST + 1)

_Static_assert(sizeof(void *) == 8, "simdrv encodes handles in 64-bit pointers");

/* ---- handle tables (sim_core.c) ----
 * Streams, events, modules and VMM allocations live in type-stable slots that are never freed,
 * and a handle is {tag, generation, index} packed into 64 bits, not a pointer. A bogus handle
 * fails the tag or index check; a destroyed one fails the generation check, even after its slot
 * was reused. `gen` is odd while the object is live and even while the slot is free. */
#define SIM_TAG_STREAM 0xE1u
#define SIM_TAG_EVENT 0xE2u
#define SIM_TAG_MODULE 0xE3u
#define SIM_TAG_FUNCTION 0xE4u
#define SIM_TAG_VMM 0xE5u
#define SIM_TABLE_CHUNK 64u
#define SIM_TABLE_MAX_CHUNKS 4096u
#define SIM_GEN_MASK 0xFFFFFFu /* generation bits carried in a handle */

struct sim_slot {
  _Atomic uint32_t gen;
  uint32_t index;
  struct sim_slot *next_free; /* table lock */
};

struct sim_table {
  pthread_mutex_t lock;
  uint32_t tag;
  size_t obj_size;                                   /* each object starts with a sim_slot */
  _Atomic(char *) chunks[SIM_TABLE_MAX_CHUNKS];      /* SIM_TABLE_CHUNK objects each */
  uint32_t nslots;                                   /* slots ever handed out (table lock) */
  struct sim_slot *free_head;                        /* table lock */
};
#define SIM_TABLE_INIT(tagv, type) \
  { .lock = PTHREAD_MUTEX_INITIALIZER, .tag = (tagv), .obj_size = sizeof(type) }

/* A live slot with a fresh generation, its handle in *handle; NULL when the table is full or
 * out of memory. The caller initialises the object before publishing the handle. */
void *sim_table_alloc(struct sim_table *t, uint64_t *handle);
/* The live object `handle` names, its generation in *gen; NULL for bogus or dead handles. */
void *sim_table_get(struct sim_table *t, uint64_t handle, uint32_t *gen);
/* Ends the life that started with generation `gen`; false when someone else ended it first. */
bool sim_table_kill(struct sim_slot *s, uint32_t gen);
/* Returns a killed slot for reuse. */
void sim_table_free(struct sim_table *t, struct sim_slot *s);
uint64_t sim_handle(uint32_t tag, uint32_t gen, uint32_t index);

/* ---- execution state of one device (sim_exec.c) ---- */
enum sim_engine_kind {
  SIM_ENG_COMPUTE, /* kernels, memset */
  SIM_ENG_COPY0,   /* H2D, D2D within the device, H2H */
  SIM_ENG_COPY1,   /* D2H, peer */
  SIM_ENG_HOST,    /* cuLaunchHostFunc */
  SIM_NENGINES
};

struct sim_stream;

struct sim_engine {
  struct sim_device *dev;
  int kind;
  bool started;                          /* sched lock */
  bool parked;                           /* sched lock: waiting on cv */
  pthread_cond_t cv;
  _Atomic uint32_t kick;                 /* bumped per ready stream; read while spinning */
  struct ebb_list ready[SIM_NPRIO];      /* streams whose head is ours; [0] = lowest priority */
};

/* ---- the primary context (sim_core.c) ---- */
struct sim_ctx {
  int ordinal;
  int refcount;        /* ctx lock */
  uint32_t peer_mask;  /* ctx lock: peers enabled with cuCtxEnablePeerAccess */
};

struct sim_device {
  int ordinal;
  struct sim_ctx ctx;          /* CUcontext is &ctx; validated by address, never dereferenced blind */
  _Atomic int sticky;          /* the CUresult every later call in this context returns; 0: none */
  size_t capacity;             /* EBB_SIM_MEM */
  _Atomic size_t used;         /* bytes charged against capacity */
  /* execution, all under the sched lock unless atomic */
  struct sim_engine engines[SIM_NENGINES];
  pthread_cond_t done_cv;      /* host threads waiting for this device's work */
  int host_waiters;            /* how many wait on done_cv: engines broadcast only when > 0 */
  _Atomic uint64_t pending;    /* commands queued on this device's streams, not yet retired */
  struct sim_stream *null_stream;
};

struct sim_globals {
  _Atomic int ready;           /* cuInit succeeded; release-stored once the fields below are set */
  int ndev;
  size_t mem_capacity;
  bool commit;                 /* EBB_SIM_COMMIT: memory committed at allocation (default) */
  bool vmm;                    /* EBB_SIM_VMM: the devices report and serve VMM (default) */
  double copy_gbps;            /* 0: copies take only their real time */
  int64_t launch_ns;           /* 0: kernels take only their real time */
  uint64_t perturb_seed;       /* EBB_SIM_PERTURB; 0: off (streams' work runs as soon as it may) */
  int ncores;
  /* SIM_SLOW_* bits: an entry point takes its slow path (sim_enter_slow) only when one is set,
   * so with no fault configured and no sticky error each call pays one relaxed load. */
  _Atomic unsigned slow;
  struct sim_device dev[SIM_MAX_DEVICES];
};
extern struct sim_globals sim;
#define SIM_SLOW_FAULT 1u  /* EBB_SIM_FAULT has faults left to fire */
#define SIM_SLOW_STICKY 2u /* some context holds a sticky error */
/* Added once per host function running (the bits above SIM_SLOW_STICKY count them): while one
 * runs, every entry takes the slow path, which refuses a call from a host function's thread with
 * CUDA_ERROR_NOT_PERMITTED, as libcuda does (CUDA forbids API calls in host functions). */
#define SIM_SLOW_HOSTFN_ONE 256u
/* Whether the calling thread is running a host function (sim_exec.c; on the slow path only). The
 * threads are kept in a table rather than a thread-local flag: LeakSanitizer's walk of the
 * threads at exit faults on the thread-local block of a dlopen'ed library in an engine thread. */
bool sim_in_hostfn(void);

/* ---- entry points, fault injection and sticky errors (sim_core.c) ----
 * X(name, flags) for every Driver API entry point that counts for EBB_SIM_FAULT, by its cuda.h
 * name (the exported symbol is what ebb_cuda.h's #define makes of it: cuMemAlloc_v2). Flags:
 * SIM_EF_ALLOC: an injected fault defaults to CUDA_ERROR_OUT_OF_MEMORY (else
 * CUDA_ERROR_LAUNCH_FAILED); SIM_EF_AFTER_STICKY: the call still works in a context that holds
 * a sticky error (device queries, context selection, and teardown: destroy, free, unmap and
 * unregister calls release host resources and succeed). */
#define SIM_EF_ALLOC 1u
#define SIM_EF_AFTER_STICKY 2u
#define SIM_ENTRIES(X)                                           \
  X(cuDeviceGetCount, SIM_EF_AFTER_STICKY)                       \
  X(cuDeviceGet, SIM_EF_AFTER_STICKY)                            \
  X(cuDeviceGetName, SIM_EF_AFTER_STICKY)                        \
  X(cuDeviceTotalMem, SIM_EF_AFTER_STICKY)                       \
  X(cuDeviceGetAttribute, SIM_EF_AFTER_STICKY)                   \
  X(cuDeviceGetPCIBusId, SIM_EF_AFTER_STICKY)                    \
  X(cuDeviceCanAccessPeer, SIM_EF_AFTER_STICKY)                  \
  X(cuDevicePrimaryCtxRetain, SIM_EF_AFTER_STICKY)               \
  X(cuDevicePrimaryCtxRelease, SIM_EF_AFTER_STICKY)              \
  X(cuDevicePrimaryCtxReset, SIM_EF_AFTER_STICKY)                \
  X(cuCtxSetCurrent, SIM_EF_AFTER_STICKY)                        \
  X(cuCtxGetCurrent, SIM_EF_AFTER_STICKY)                        \
  X(cuCtxGetDevice, SIM_EF_AFTER_STICKY)                         \
  X(cuCtxSynchronize, 0)                                         \
  X(cuCtxGetStreamPriorityRange, 0)                              \
  X(cuCtxEnablePeerAccess, 0)                                    \
  X(cuCtxDisablePeerAccess, 0)                                   \
  X(cuStreamCreateWithPriority, 0)                               \
  X(cuStreamDestroy, SIM_EF_AFTER_STICKY)                        \
  X(cuStreamSynchronize, 0)                                      \
  X(cuStreamQuery, 0)                                            \
  X(cuStreamGetPriority, 0)                                      \
  X(cuEventCreate, 0)                                            \
  X(cuEventDestroy, SIM_EF_AFTER_STICKY)                         \
  X(cuEventRecord, 0)                                            \
  X(cuEventQuery, 0)                                             \
  X(cuEventSynchronize, 0)                                       \
  X(cuEventElapsedTime, 0)                                       \
  X(cuStreamWaitEvent, 0)                                        \
  X(cuMemcpyAsync, 0)                                            \
  X(cuMemcpyHtoDAsync, 0)                                        \
  X(cuMemcpyDtoHAsync, 0)                                        \
  X(cuMemcpyDtoDAsync, 0)                                        \
  X(cuMemcpyPeerAsync, 0)                                        \
  X(cuMemsetD8Async, 0)                                          \
  X(cuLaunchHostFunc, 0)                                         \
  X(cuLaunchKernel, 0)                                           \
  X(cuModuleLoadData, 0)                                         \
  X(cuModuleUnload, SIM_EF_AFTER_STICKY)                         \
  X(cuModuleGetFunction, 0)                                      \
  X(cuMemAlloc, SIM_EF_ALLOC)                                    \
  X(cuMemFree, SIM_EF_AFTER_STICKY)                              \
  X(cuMemGetInfo, 0)                                             \
  X(cuMemHostAlloc, SIM_EF_ALLOC)                                \
  X(cuMemFreeHost, SIM_EF_AFTER_STICKY)                          \
  X(cuMemHostRegister, SIM_EF_ALLOC)                             \
  X(cuMemHostUnregister, SIM_EF_AFTER_STICKY)                    \
  X(cuPointerGetAttribute, 0)                                    \
  X(cuMemGetAllocationGranularity, 0)                            \
  X(cuMemAddressReserve, SIM_EF_ALLOC)                           \
  X(cuMemAddressFree, SIM_EF_AFTER_STICKY)                       \
  X(cuMemCreate, SIM_EF_ALLOC)                                   \
  X(cuMemRelease, SIM_EF_AFTER_STICKY)                           \
  X(cuMemMap, 0)                                                 \
  X(cuMemSetAccess, 0)                                           \
  X(cuMemUnmap, SIM_EF_AFTER_STICKY)

enum sim_entry {
#define SIM_ENTRY_ENUM(name, flags) SIM_E_##name,
  SIM_ENTRIES(SIM_ENTRY_ENUM)
#undef SIM_ENTRY_ENUM
  SIM_NENTRIES
};

/* The slow path of an entry point (after the host-function check, which the macros below make
 * before anything reads the thread-local current context): counts the call against EBB_SIM_FAULT and returns the
 * injected error when it is the call to fail (a sticky one poisons `target`'s context); else the sticky error of the calling thread's
 * current context, for entries without SIM_EF_AFTER_STICKY; else CUDA_SUCCESS. */
CUresult sim_enter_slow(enum sim_entry e, struct sim_device *target);

/* Every entry point (except cuInit, cuDriverGetVersion and the error-name calls) starts here. */
#define SIM_ENTER(name)                                                                     \
  do {                                                                                      \
    if (!sim_initialized()) return CUDA_ERROR_NOT_INITIALIZED;                              \
    if (__builtin_expect(atomic_load_explicit(&sim.slow, memory_order_relaxed) != 0, 0)) { \
      if (sim_in_hostfn()) return CUDA_ERROR_NOT_PERMITTED;                                 \
      CUresult sim_enter_r_ = sim_enter_slow(SIM_E_##name, sim_current_device());          \
      if (sim_enter_r_ != CUDA_SUCCESS) return sim_enter_r_;                                \
    }                                                                                       \
  } while (0)

/* SIM_ENTER for an entry whose injected sticky fault poisons `target` (evaluated only on the
 * slow path), the context the call acts on, rather than the thread's current one. */
#define SIM_ENTER_ON(name, target)                                                          \
  do {                                                                                      \
    if (!sim_initialized()) return CUDA_ERROR_NOT_INITIALIZED;                              \
    if (__builtin_expect(atomic_load_explicit(&sim.slow, memory_order_relaxed) != 0, 0)) { \
      if (sim_in_hostfn()) return CUDA_ERROR_NOT_PERMITTED;                                 \
      CUresult sim_enter_r_ = sim_enter_slow(SIM_E_##name, (target));                       \
      if (sim_enter_r_ != CUDA_SUCCESS) return sim_enter_r_;                                \
    }                                                                                       \
  } while (0)

/* Whether `r` is an error that poisons its context on a GPU: a kernel's fault (illegal address
 * or instruction, misaligned address, hardware stack error, invalid PC, device assert, launch
 * failure or timeout) or an uncorrectable ECC error. */
bool sim_error_is_sticky(CUresult r);

/* The sticky error of device `d`'s context, CUDA_SUCCESS when it has none. */
static inline CUresult sim_device_sticky(struct sim_device *d) {
  /* relaxed: the error is a value in itself; nothing else is published with it */
  if (__builtin_expect(!(atomic_load_explicit(&sim.slow, memory_order_relaxed) & SIM_SLOW_STICKY), 1))
    return CUDA_SUCCESS;
  return (CUresult)atomic_load_explicit(&d->sticky, memory_order_relaxed);
}

static inline bool sim_initialized(void) {
  /* acquire: pairs with the release store at the end of cuInit, so the device table and the
   * timing settings written before it are visible to every caller that sees ready == 1 */
  return atomic_load_explicit(&sim.ready, memory_order_acquire) != 0;
}

/* sim_core.c */
struct sim_device *sim_current_device(void);            /* NULL when no context is current */
struct sim_device *sim_device_of_ctx(CUcontext c);      /* NULL when c is not a simdrv context */
struct sim_device *sim_device_get(CUdevice d);          /* NULL when out of range */
static inline CUcontext sim_ctx_handle(struct sim_device *d) { return (CUcontext)(void *)&d->ctx; }
uint64_t sim_now_ns(void);                               /* CLOCK_MONOTONIC */
bool sim_charge(struct sim_device *d, size_t bytes);     /* false: past capacity */
void sim_uncharge(struct sim_device *d, size_t bytes);

/* sim_mem.c: what a pointer range is, for copies and memset. */
enum sim_mem_kind { SIM_MEM_NONE, SIM_MEM_DEVICE, SIM_MEM_VMM, SIM_MEM_HOST_ALLOC, SIM_MEM_HOST_REG };
struct sim_ptr {
  int kind;    /* SIM_MEM_NONE: not registered (pageable host memory) */
  int ordinal;
};
/* Classifies [p, p+n). Inside a registered range the whole span must be covered (contiguous VMM
 * mappings may be crossed) and accessible, else CUDA_ERROR_INVALID_VALUE. */
CUresult sim_mem_span(uintptr_t p, size_t n, struct sim_ptr *out);
static inline bool sim_is_device_mem(int kind) { return kind == SIM_MEM_DEVICE || kind == SIM_MEM_VMM; }

/* sim_exec.c */
void sim_exec_init_device(struct sim_device *d);       /* at cuInit, before ready */
bool sim_exec_create_null_stream(struct sim_device *d);
void sim_exec_sync_device(struct sim_device *d);       /* waits until the device has no pending work */
void sim_exec_drain_all(void);                          /* every device, for frees and unmaps */

/* sim_kernel.c: the registered kernel and module device a function handle names. */
CUresult sim_kernel_resolve(CUfunction f, ebbsim_kernel_fn *fn, size_t *arg_bytes, struct sim_device **dev);

#endif /* EBB_SIM_INTERNAL_H */
