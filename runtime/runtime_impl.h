/* runtime_impl.h: the runtime's implementer-only structures. Never included outside runtime/.
 *
 * The driver table: one struct of Driver API function pointers, filled once by
 * dlsym from libcuda.so.1 or libebb_simdrv.so by the versioned names in EBB_DRV_ENTRIES
 * (common/ebb_cuda.h). Optional entries may be NULL, meaning "unsupported": the wrappers in
 * seam.c answer EBB_ENOTSUP for them. The table is written during ebb_init under the runtime
 * lock and read without locks afterwards (ebb_init's release store of `ebb__runtime_state.ready` publishes
 * it; see driver.c).
 */
#ifndef EBB_RUNTIME_IMPL_H
#define EBB_RUNTIME_IMPL_H

#include <stdatomic.h>

#include "ebb/runtime.h"
#include "ebb_cuda.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "runtime_export.h"

#define EBB_DRV_ABI 1

typedef struct ebb_drv {
  uint32_t abi_version; /* EBB_DRV_ABI */
  const char *name;     /* "cuda" or "simdrv" or the custom file name, for messages */
  CUresult (CUDAAPI *Init)(unsigned int Flags);
  CUresult (CUDAAPI *DriverGetVersion)(int *driverVersion);
  CUresult (CUDAAPI *GetErrorName)(CUresult error, const char **pStr);
  CUresult (CUDAAPI *GetErrorString)(CUresult error, const char **pStr);
  CUresult (CUDAAPI *DeviceGetCount)(int *count);
  CUresult (CUDAAPI *DeviceGet)(CUdevice *device, int ordinal);
  CUresult (CUDAAPI *DeviceGetName)(char *name, int len, CUdevice dev);
  CUresult (CUDAAPI *DeviceTotalMem)(size_t *bytes, CUdevice dev);
  CUresult (CUDAAPI *DeviceGetAttribute)(int *pi, CUdevice_attribute attrib, CUdevice dev);
  CUresult (CUDAAPI *DeviceGetPCIBusId)(char *pciBusId, int len, CUdevice dev);
  CUresult (CUDAAPI *DeviceCanAccessPeer)(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
  CUresult (CUDAAPI *DevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
  CUresult (CUDAAPI *DevicePrimaryCtxRelease)(CUdevice dev);
  CUresult (CUDAAPI *CtxSetCurrent)(CUcontext ctx);
  CUresult (CUDAAPI *CtxGetCurrent)(CUcontext *pctx);
  CUresult (CUDAAPI *CtxSynchronize)(void);
  CUresult (CUDAAPI *CtxGetStreamPriorityRange)(int *leastPriority, int *greatestPriority);
  CUresult (CUDAAPI *CtxEnablePeerAccess)(CUcontext peerContext, unsigned int Flags);
  CUresult (CUDAAPI *MemGetInfo)(size_t *free, size_t *total);
  CUresult (CUDAAPI *MemAlloc)(CUdeviceptr *dptr, size_t bytesize);
  CUresult (CUDAAPI *MemFree)(CUdeviceptr dptr);
  CUresult (CUDAAPI *MemHostAlloc)(void **pp, size_t bytesize, unsigned int Flags);
  CUresult (CUDAAPI *MemFreeHost)(void *p);
  CUresult (CUDAAPI *MemHostRegister)(void *p, size_t bytesize, unsigned int Flags);
  CUresult (CUDAAPI *MemHostUnregister)(void *p);
  CUresult (CUDAAPI *PointerGetAttribute)(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
  CUresult (CUDAAPI *MemcpyAsync)(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
  CUresult (CUDAAPI *MemcpyPeerAsync)(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount, CUstream hStream);
  CUresult (CUDAAPI *MemsetD8Async)(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
  CUresult (CUDAAPI *StreamCreateWithPriority)(CUstream *phStream, unsigned int flags, int priority);
  CUresult (CUDAAPI *StreamDestroy)(CUstream hStream);
  CUresult (CUDAAPI *StreamSynchronize)(CUstream hStream);
  CUresult (CUDAAPI *StreamQuery)(CUstream hStream);
  CUresult (CUDAAPI *StreamWaitEvent)(CUstream hStream, CUevent hEvent, unsigned int Flags);
  CUresult (CUDAAPI *LaunchHostFunc)(CUstream hStream, CUhostFn fn, void *userData);
  CUresult (CUDAAPI *EventCreate)(CUevent *phEvent, unsigned int Flags);
  CUresult (CUDAAPI *EventDestroy)(CUevent hEvent);
  CUresult (CUDAAPI *EventRecord)(CUevent hEvent, CUstream hStream);
  CUresult (CUDAAPI *EventQuery)(CUevent hEvent);
  CUresult (CUDAAPI *EventSynchronize)(CUevent hEvent);
  CUresult (CUDAAPI *EventElapsedTime)(float *pMilliseconds, CUevent hStart, CUevent hEnd);
  CUresult (CUDAAPI *ModuleLoadData)(CUmodule *module, const void *image);
  CUresult (CUDAAPI *ModuleUnload)(CUmodule hmod);
  CUresult (CUDAAPI *ModuleGetFunction)(CUfunction *hfunc, CUmodule hmod, const char *name);
  CUresult (CUDAAPI *LaunchKernel)(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
  CUresult (CUDAAPI *MemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
  CUresult (CUDAAPI *MemAddressFree)(CUdeviceptr ptr, size_t size);
  CUresult (CUDAAPI *MemCreate)(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
  CUresult (CUDAAPI *MemRelease)(CUmemGenericAllocationHandle handle);
  CUresult (CUDAAPI *MemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
  CUresult (CUDAAPI *MemUnmap)(CUdeviceptr ptr, size_t size);
  CUresult (CUDAAPI *MemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
  CUresult (CUDAAPI *MemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option);
  ebbsim_register_kernel_fn RegisterKernel; /* emulated driver only */
} ebb_drv;

typedef struct ebb_device {
  CUdevice cu;
  CUcontext ctx;        /* retained primary context */
  ebb_dev_caps caps;
  ebb_topo topo;
  /* The error state (ebb_dev_status): 0 while the device works, EBB__DEV_MARKING while the
   * first sticky error is being written down, then that CUresult; `failed_call` names the
   * driver call that returned it and is written before the release store of the CUresult. */
  atomic_int failed;
  char failed_call[64];
} ebb_device;
#define EBB__DEV_MARKING (-1)

typedef struct ebb_runtime {
  ebb_mutex lock;              /* init/shutdown and lazy per-device state (rank RUNTIME) */
  atomic_int ready;            /* 1 while initialised; acquire-load before using the table */
  int refs;                    /* ebb_init calls not yet matched by ebb_shutdown */
  void *dl;                    /* dlopen handle of the driver */
  ebb_drv drv;
  ebb_driver_info info;
  int ndev;
  atomic_int any_failed;       /* some device is in the error state: the checks take their slow path */
  ebb_device dev[EBB_MAX_DEVICES];
} ebb_runtime;

EBB_HIDDEN extern ebb_runtime ebb__runtime_state;

/* EBB_ENOTINIT with a message naming `fn` unless ebb is initialised. */
EBB_HIDDEN ebb_status ebb__check_init(const char *fn);
/* ebb__check_init plus a device range check (EBB_EDEVICE naming the device and the range). */
EBB_HIDDEN ebb_status ebb__check_dev(const char *fn, int device);
/* Makes `device`'s primary context current on this thread (cached per thread). */
EBB_HIDDEN ebb_status ebb__dev_activate(const char *fn, int device);
/* The error state of a device (device.c). ebb__dev_live: EBB_EDEVICE with the state's message
 * (naming `fn`) once `device` is in the error state, else EBB_OK; one relaxed load while no
 * device is. ebb__check_dev_live: ebb__check_dev, then ebb__dev_live; for calls that give a
 * device work or wait for it (releases use ebb__check_dev: they must work in the error state). */
EBB_HIDDEN ebb_status ebb__dev_live_slow(const char *fn, int device);
static inline ebb_status ebb__dev_live(const char *fn, int device) {
  /* relaxed: a hint; the slow path reads the device's state with acquire */
  if (EBB_LIKELY(!atomic_load_explicit(&ebb__runtime_state.any_failed, memory_order_relaxed))) return EBB_OK;
  return ebb__dev_live_slow(fn, device);
}
EBB_HIDDEN ebb_status ebb__check_dev_live(const char *fn, int device);
/* Whether `r` leaves its context unusable on a GPU (every later call there returns it). */
EBB_HIDDEN bool ebb__cu_sticky(CUresult r);
/* Puts the device whose context holds the sticky error `r` (returned by `call`) in the error
 * state, the first such error only; returns that device. */
EBB_HIDDEN int ebb__dev_mark_failed(CUresult r, const char *call);
/* Maps a CUresult to an ebb_status and a message "fn: <driver call> failed: NAME (text)". */
EBB_HIDDEN ebb_status ebb__cu_fail(CUresult r, const char *fn, const char *call);
EBB_HIDDEN ebb_status ebb__cu_status(CUresult r);
EBB_HIDDEN const char *ebb__cu_name(CUresult r);

/* The runtime's configuration, checked by the first ebb_init (module.c). */
typedef struct ebb_rt_conf {
  bool log_info;        /* EBB_LOG=info */
  size_t trace_cap;     /* EBB_TRACE: spans, 0 off */
  char trace_file[512]; /* EBB_TRACE_FILE, "" unset */
  bool check_launch;    /* EBB_CHECK_LAUNCH=1 */
} ebb_rt_conf;
EBB_HIDDEN extern ebb_rt_conf ebb__rt_conf;

/* module.c: the configuration of the runtime and of every linked module (EBB_EINVAL naming the
 * first bad variable), the modules' start in layer order (a failure stops those started), their
 * live objects (the total, and `msg` listing them by kind), their stop in reverse layer order. */
EBB_HIDDEN ebb_status ebb__modules_configure(void);
EBB_HIDDEN ebb_status ebb__modules_start(void);
EBB_HIDDEN long ebb__modules_live(char *msg, size_t len);
EBB_HIDDEN void ebb__modules_stop(void);

/* Parts of init/shutdown that live in other files of the runtime. */
EBB_HIDDEN ebb_status ebb__devices_init(void);
EBB_HIDDEN void ebb__devices_fini(void);
EBB_HIDDEN void ebb__topo_init(void);
EBB_HIDDEN void ebb__topo_fini(void);
EBB_HIDDEN ebb_status ebb__kernels_builtin_init(void);
EBB_HIDDEN ebb_status ebb__kernels_add_runtime_image(void);
EBB_HIDDEN void ebb__kernels_fini(void);
EBB_HIDDEN void ebb__trace_init_from_env(void);
EBB_HIDDEN void ebb__trace_fini(void);

#endif /* EBB_RUNTIME_IMPL_H */
