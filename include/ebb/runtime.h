/* ebb/runtime.h: initialisation, the driver in use, devices, topology and kernels.
 *
 * ebb talks to GPUs through the CUDA Driver API only, loaded with dlopen: the real libcuda.so.1
 * when a GPU answers cuInit, else ebb's emulated driver (libebb_simdrv.so), which runs the same
 * API on CPU threads. Code above this header sees capabilities (ebb_dev_caps), never which driver
 * it is talking to.
 *
 * Threading: every function here is thread-safe. The current device is per thread.
 * The thin wrappers over the driver that ebb's modules use are internal
 * (runtime/export/runtime_export.h). Driver handles appear as the Driver API's own opaque struct
 * pointers (struct CUstream_st * is
 * cuda.h's CUstream), so this header needs no cuda.h and interoperates with code that has it.
 */
#ifndef EBB_RUNTIME_H
#define EBB_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cuda.h's CUstream */
struct CUevent_st;  /* cuda.h's CUevent */

#define EBB_MAX_DEVICES 16

/* ---- initialisation --------------------------------------------------------------------------
 * ebb_init checks the configuration, loads the driver chosen by EBB_DRIVER (auto|cuda|sim|
 * /path/to/lib.so, default auto: libcuda.so.1 if it loads and cuInit finds a device, else the
 * emulated driver), retains each device's primary context and starts ebb's modules (streams,
 * alloc, ops, autograd) lowest layer first. Reference-counted: each successful ebb_init needs one
 * ebb_shutdown; only the first one does the work. Every other call made before ebb_init returns
 * EBB_ENOTINIT.
 * Configuration: every variable ebb reads (EBB_DRIVER, EBB_LOG, EBB_TRACE, EBB_TRACE_FILE,
 * EBB_CHECK_LAUNCH, and the modules' EBB_STREAM_POOL_SIZE, EBB_STAGING_CHUNK, EBB_STAGING_CHUNKS,
 * EBB_ALLOC_CONF; README lists them) is checked by the first ebb_init under one policy: a value
 * that is not accepted fails it with EBB_EINVAL and a message naming the variable, the value and
 * what is accepted; nothing is loaded or started then. An empty variable reads as unset.
 * Fails with EBB_ENOTFOUND when no driver could be loaded, EBB_EDRIVER when the chosen one failed
 * to initialise, EBB_EBUSY while the last ebb_shutdown runs on another thread, or the status of a
 * module that could not start (the message names the module). A successful ebb_init leaves
 * ebb_last_error and the error hook alone. */
EBB_API ebb_status ebb_init(void);
/* Drops one reference. The last one first counts what callers still own: while any stream or
 * event from ebb_*_create, arena/pinned/host block or tensor is live, it returns EBB_EBUSY with a
 * message counting them by kind ("tensors: 2, blocks of the device 0 arena: 2") and tears nothing
 * down: the reference stays, every handle stays valid; release them and call it again. Otherwise
 * it stops the modules highest layer first (pool and default streams, cached memory, kernels),
 * synchronises every device and releases the driver's contexts. After a completed last
 * ebb_shutdown, every call fails with EBB_ENOTINIT until the next ebb_init, and a handle from
 * before it is EBB_EFREED once ebb is initialised again. Calls racing with the last
 * ebb_shutdown on other threads are the caller's error. Returns EBB_ENOTINIT when ebb is not
 * initialised. */
EBB_API ebb_status ebb_shutdown(void);
EBB_API bool ebb_is_initialized(void);

typedef enum ebb_driver_kind { EBB_DRIVER_CUDA = 0, EBB_DRIVER_EMULATED = 1, EBB_DRIVER_CUSTOM = 2 } ebb_driver_kind;

typedef struct ebb_driver_info {
  ebb_driver_kind kind;
  char name[32];     /* "cuda" or "simdrv" or the custom library's file name */
  char path[512];    /* the library dlopen'ed */
  char reason[256];  /* why this driver: "EBB_DRIVER=sim", "auto: cuInit failed: ..." */
  int version;       /* cuDriverGetVersion, e.g. 13000 */
  int device_count;
} ebb_driver_info;

EBB_API ebb_status ebb_driver_get_info(ebb_driver_info *out);

/* ---- devices -------------------------------------------------------------------------------- */

/* What a device offers. ebb is at ABI version 0 (the library's SOVERSION): fields are appended
 * as ebb learns more about devices, so a program must be rebuilt against the header of the libebb
 * it runs with (ebb_dev_get_caps writes the whole struct of its own header). */
typedef struct ebb_dev_caps {
  int ordinal;
  char name[128];
  size_t total_mem;
  int cc_major, cc_minor;       /* compute capability; 0.0 on the emulated driver */
  bool emulated;                /* the device runs on CPU threads (no compute capability) */
  int multiprocessors;
  int async_engines;            /* copy engines that overlap compute */
  int prio_least, prio_greatest;/* stream priority range: least (e.g. 0) .. greatest (e.g. -5) */
  bool unified_addressing;      /* pointers tell their device (cuPointerGetAttribute) */
  bool concurrent_kernels;
  bool vmm;                     /* cuMemAddressReserve/cuMemCreate/cuMemMap */
  bool host_register;           /* cuMemHostRegister */
  bool host_alloc;              /* cuMemHostAlloc */
  bool host_func;               /* cuLaunchHostFunc */
  bool peer;                    /* can access at least one other device's memory */
  bool cpu_kernels;             /* kernels may be CPU functions (emulated driver) */
  char pci_bus_id[32];          /* "" when unknown */
  /* Memory interface, for judging achieved bandwidth: the peak memory clock (kHz) and bus width
   * (bits) the driver reports, and the peak they give, 2 x clock x width / 8 (double data rate),
   * in GB/s (10^9 bytes/s). 0 where the driver does not say; peak_mem_gbps is 0 on an emulated
   * device, whose memory is the host's (its driver's figures are nominal). */
  int mem_clock_khz;
  int mem_bus_bits;
  double peak_mem_gbps;
} ebb_dev_caps;

EBB_API ebb_status ebb_dev_count(int *count);
EBB_API ebb_status ebb_dev_get_caps(int device, ebb_dev_caps *out);
/* Per-thread current device (default 0). */
EBB_API ebb_status ebb_dev_set_current(int device);
EBB_API ebb_status ebb_dev_get_current(int *device);
/* Scoped switch of the current device: enter saves the previous one, exit restores it.
 * Nest them like braces on one thread. */
typedef struct ebb_dev_guard {
  int prev;
  int device;
  uint32_t magic;
} ebb_dev_guard;
EBB_API ebb_status ebb_dev_guard_enter(ebb_dev_guard *g, int device);
EBB_API ebb_status ebb_dev_guard_exit(ebb_dev_guard *g);
/* Waits for all work on the device (host-blocking; tests and teardown, never the hot path). */
EBB_API ebb_status ebb_dev_synchronize(int device);
/* EBB_OK while the device works. Once the driver returned an error that leaves a context
 * unusable (CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_ILLEGAL_ADDRESS, ...: a kernel fault), the
 * device is in an error state: this call, and every later call that would give the device work
 * or wait for it, fails at once with EBB_EDEVICE and a message naming the error and the driver
 * call that returned it. Releases still work; release every handle and call ebb_shutdown (the
 * last one destroys the contexts; a later ebb_init starts afresh). */
EBB_API ebb_status ebb_dev_status(int device);
EBB_API ebb_status ebb_dev_mem_info(int device, size_t *free_bytes, size_t *total_bytes);
EBB_API ebb_status ebb_dev_can_access_peer(int device, int peer, bool *can);
/* Lets `device` access `peer`'s memory. Idempotent: a second call is success. */
EBB_API ebb_status ebb_dev_enable_peer(int device, int peer);

/* ---- topology (hwloc) ----------------------------------------------------------------------- */

typedef struct ebb_topo {
  int numa_node;       /* nearest NUMA node (logical index), -1 when unknown */
  int numa_nodes;      /* NUMA nodes of the machine */
  int ncores;          /* cores in `cpus` */
  char cpus[256];      /* the node's cpuset as a list, e.g. "0-15,32-47" */
  bool from_pci;       /* true when located through the device's PCI bus id; false: spread */
} ebb_topo;

EBB_API ebb_status ebb_dev_get_topo(int device, ebb_topo *out);
/* Binds the calling thread to the cores nearest `device`. EBB_ENOTSUP when binding is refused
 * by the OS (containers); the thread is then left as it was. */
EBB_API ebb_status ebb_thread_bind_device(int device);
/* Maps `bytes` (rounded up to whole pages) of host memory whose pages are bound to the NUMA node
 * nearest `device` (ebb_dev_get_topo), for the pinned pool to register with the driver.
 * *bound says whether the OS accepted the binding (false: plain pages, e.g. where a container
 * refuses mbind, or hwloc did not load). Pages are not touched. Free with ebb_numa_pages_free
 * and the same byte count. EBB_EDEVICE for a missing device, EBB_EINVAL for NULL out/bound or
 * bytes == 0, EBB_ENOMEM when the system has no memory left. */
EBB_API ebb_status ebb_numa_pages_alloc(int device, size_t bytes, void **out, bool *bound);
EBB_API ebb_status ebb_numa_pages_free(void *p, size_t bytes);
/* The NUMA node (logical index) holding the touched pages of [p, p + bytes): *node = -1 when
 * they span several nodes. EBB_ENOTSUP where the OS or hwloc cannot tell; EBB_EINVAL for NULL
 * arguments. */
EBB_API ebb_status ebb_host_numa_node(const void *p, size_t bytes, int *node);

/* ---- kernels -------------------------------------------------------------------------------
 * Kernels come in images: each module registers its own module image (a fatbin or cubin built
 * from its .cu files) under a name, and declares its kernels against it; the runtime's own
 * kernels are in the image "ebb.runtime". A kernel is declared once: a name (unique across
 * images), the byte size of its argument struct, the CPU function that runs it on the emulated
 * driver (or NULL), and the name of its CUDA function in its image (or NULL). It is launched on a
 * stream with the buffers it reads and writes. Arguments are one struct, copied at launch
 * (callers may reuse theirs at once). Images and kernels live until the last ebb_shutdown; a
 * module registers them again after the next ebb_init. */
typedef void (*ebb_kernel_cpu_fn)(void *args);
typedef struct ebb_kernel ebb_kernel_t;
typedef struct ebb_kernel_image ebb_kernel_image_t;

typedef struct ebb_buf {
  const void *ptr;
  size_t bytes;
} ebb_buf;

typedef struct ebb_launch_cfg {
  unsigned grid[3];     /* zeros mean 1 */
  unsigned block[3];    /* zeros mean 1 */
  unsigned shared_bytes;
  const ebb_buf *reads;  int nreads;
  const ebb_buf *writes; int nwrites;
} ebb_launch_cfg;

/* Registers the module image `image` (a fatbin or cubin, owned by the caller and kept readable
 * until the last ebb_shutdown; NULL: a module with no GPU code, whose kernels run only where
 * kernels are CPU functions) under `name`. It is loaded on a device at the first launch there of
 * one of its kernels. Adding the same name with the same image again returns the same handle.
 * EBB_EINVAL: NULL out, NULL, empty or too long (>= 64) name, or the name added before with
 * another image; EBB_ELIMIT past 32 images. Thread-safe. */
EBB_API ebb_status ebb_kernel_add_image(const char *name, const void *image, const ebb_kernel_image_t **out);
EBB_API const char *ebb_kernel_image_name(const ebb_kernel_image_t *img);
/* Declares (or finds, when the same name, size, functions and image were declared before) a
 * kernel of `image` (NULL: the runtime's own image). EBB_EINVAL: NULL or empty name, arg_bytes 0
 * or above 4096, neither function given, an image handle not from this ebb_init, or the name
 * declared before with other parameters. Image and kernel handles from before a completed last
 * ebb_shutdown are refused afterwards: a later session's images and kernels take other entries
 * of their tables (until as many were added since as a table holds: 32 images). */
EBB_API ebb_status ebb_kernel_declare_in(const ebb_kernel_image_t *image, const char *name, size_t arg_bytes,
                                         ebb_kernel_cpu_fn cpu_fn, const char *cuda_name, const ebb_kernel_t **out);
/* ebb_kernel_declare_in(NULL, ...): for kernels with only a CPU function, or CUDA functions of
 * the runtime's own image. */
EBB_API ebb_status ebb_kernel_declare(const char *name, size_t arg_bytes, ebb_kernel_cpu_fn cpu_fn,
                                      const char *cuda_name, const ebb_kernel_t **out);
EBB_API ebb_status ebb_kernel_find(const char *name, const ebb_kernel_t **out);
EBB_API const char *ebb_kernel_name(const ebb_kernel_t *k);
/* Enqueues `k` on the driver stream `stream` of `device`; returns without waiting.
 * `args` points to arg_bytes bytes. `cfg` may be NULL (1x1x1, no buffers declared). Declared
 * buffers are checked when EBB_CHECK_LAUNCH=1 (read by ebb_init): each must be memory `device`
 * can reach.
 * EBB_ENOTSUP when the kernel has no function for this driver (no CPU function on the emulated
 * driver, no CUDA function or an image without CUDA code on a GPU). */
EBB_API ebb_status ebb_kernel_launch(const ebb_kernel_t *k, int device, struct CUstream_st *stream,
                                     const void *args, const ebb_launch_cfg *cfg);

/* Kernels every driver has, declared by ebb_init (find them with ebb_kernel_find):
 *   "ebb.noop"     does nothing (the launch benchmark's kernel), args ebb_noop_args;
 *   "ebb.fill_u32" dst[i] = value for i < n, args ebb_fill_u32_args.
 * On a GPU they come from the runtime's image "ebb.runtime" (built when nvcc was found). */
typedef struct ebb_noop_args {
  uint64_t unused;
} ebb_noop_args;
typedef struct ebb_fill_u32_args {
  uint32_t *dst;
  uint64_t n;
  uint32_t value;
} ebb_fill_u32_args;

/* A host function enqueued on a stream (ebb_stream_host_func). */
typedef void (*ebb_host_fn)(void *user);

/* ---- counters ------------------------------------------------------------------------------ */
/* Caller-owned handles still live: streams and events from ebb_*_create, tensors. A test ends
 * with ebb_debug_live_handles() == 0. */
EBB_API long ebb_debug_live_handles(void);

#ifdef __cplusplus
}
#endif
#endif /* EBB_RUNTIME_H */
