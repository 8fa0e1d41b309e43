/* ebb_cuda.h: the CUDA Driver API types and names ebb uses.
 *
 * With the CUDA toolkit present (EBB_HAVE_CUDA_H) this is <cuda.h> itself, so the names below are
 * redirected to their versioned symbols exactly as the toolkit redirects them (cuMemAlloc ->
 * cuMemAlloc_v2, cuEventElapsedTime -> cuEventElapsedTime_v2, ...). Without the toolkit it is a
 * minimal ABI-identical subset written from the Driver API documentation: the same enum values,
 * struct layouts and #define redirections, for the entry points in EBB_DRV_ENTRIES below and no
 * others. The emulated driver (runtime/simdrv) and the runtime's driver table both compile against
 * this header, so the symbols simdrv exports are the ones cuda.h asks for.
 *
 * EBB_DRV_ENTRIES(X) is the one list of Driver API entry points ebb loads: X(field, symbol,
 * required). The runtime resolves each `symbol` with dlsym; `required` entries must exist in any
 * driver ebb accepts, the others are optional (NULL means "unsupported").
 */
#ifndef EBB_CUDA_H
#define EBB_CUDA_H

#if defined(EBB_HAVE_CUDA_H) && !defined(EBB_FORCE_OWN_CUDA_ABI)
#include <cuda.h>
#else
#include <stddef.h>

#define CUDA_VERSION 13000
#define CUDAAPI
#define CUDA_CB

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef void(CUDA_CB *CUhostFn)(void *userData);

typedef enum cudaError_enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_STUB_LIBRARY = 34,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_NOT_MAPPED = 211,
  CUDA_ERROR_NOT_MAPPED_AS_POINTER = 213,
  CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_INVALID_SOURCE = 300,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
  CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
  CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef enum CUdevice_attribute_enum {
  CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
  CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
  CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_INTEGRATED = 18,
  CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
  CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31,
  CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
  CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
  CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
  CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
  CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
  CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78,
  CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
  CU_DEVICE_ATTRIBUTE_NUMA_ID = 131,
  CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134
} CUdevice_attribute;

typedef enum CUpointer_attribute_enum {
  CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
  CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
  CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  CU_POINTER_ATTRIBUTE_MAPPED = 13
} CUpointer_attribute;

typedef enum CUmemorytype_enum {
  CU_MEMORYTYPE_HOST = 0x01,
  CU_MEMORYTYPE_DEVICE = 0x02,
  CU_MEMORYTYPE_ARRAY = 0x03,
  CU_MEMORYTYPE_UNIFIED = 0x04
} CUmemorytype;

typedef enum CUstream_flags_enum { CU_STREAM_DEFAULT = 0x0, CU_STREAM_NON_BLOCKING = 0x1 } CUstream_flags;

typedef enum CUevent_flags_enum {
  CU_EVENT_DEFAULT = 0x0,
  CU_EVENT_BLOCKING_SYNC = 0x1,
  CU_EVENT_DISABLE_TIMING = 0x2,
  CU_EVENT_INTERPROCESS = 0x4
} CUevent_flags;

#define CU_MEMHOSTALLOC_PORTABLE 0x01
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02
#define CU_MEMHOSTALLOC_WRITECOMBINED 0x04
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02

typedef enum CUmemAllocationType_enum {
  CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
  CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
  CU_MEM_HANDLE_TYPE_NONE = 0x0,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
} CUmemAllocationHandleType;

typedef enum CUmemLocationType_enum {
  CU_MEM_LOCATION_TYPE_INVALID = 0x0,
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1
} CUmemLocationType;

typedef enum CUmemAccess_flags_enum {
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
  CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags_enum {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
} CUmemAllocationGranularity_flags;

typedef struct CUmemLocation_st {
  CUmemLocationType type;
  int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
  CUmemLocation location;
  CUmemAccess_flags flags;
} CUmemAccessDesc;

/* The redirections cuda.h 13 makes for the entry points ebb uses. */
#define cuDeviceTotalMem cuDeviceTotalMem_v2
#define cuMemGetInfo cuMemGetInfo_v2
#define cuMemAlloc cuMemAlloc_v2
#define cuMemFree cuMemFree_v2
#define cuMemHostRegister cuMemHostRegister_v2
#define cuStreamDestroy cuStreamDestroy_v2
#define cuEventDestroy cuEventDestroy_v2
#define cuEventElapsedTime cuEventElapsedTime_v2
#define cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease_v2
#define cuDevicePrimaryCtxReset cuDevicePrimaryCtxReset_v2
#define cuMemcpyHtoDAsync cuMemcpyHtoDAsync_v2
#define cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2
#define cuMemcpyDtoDAsync cuMemcpyDtoDAsync_v2

CUresult CUDAAPI cuInit(unsigned int Flags);
CUresult CUDAAPI cuDriverGetVersion(int *driverVersion);
CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr);
CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr);
CUresult CUDAAPI cuDeviceGetCount(int *count);
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal);
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev);
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
CUresult CUDAAPI cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev);
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx);
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx);
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device);
CUresult CUDAAPI cuCtxSynchronize(void);
CUresult CUDAAPI cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority);
CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags);
CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext peerContext);
CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total);
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);
CUresult CUDAAPI cuMemFree(CUdeviceptr dptr);
CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
CUresult CUDAAPI cuMemFreeHost(void *p);
CUresult CUDAAPI cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags);
CUresult CUDAAPI cuMemHostUnregister(void *p);
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                   CUcontext srcContext, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
CUresult CUDAAPI cuStreamDestroy(CUstream hStream);
CUresult CUDAAPI cuStreamSynchronize(CUstream hStream);
CUresult CUDAAPI cuStreamQuery(CUstream hStream);
CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult CUDAAPI cuStreamGetPriority(CUstream hStream, int *priority);
CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData);
CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult CUDAAPI cuEventDestroy(CUevent hEvent);
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult CUDAAPI cuEventQuery(CUevent hEvent);
CUresult CUDAAPI cuEventSynchronize(CUevent hEvent);
CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image);
CUresult CUDAAPI cuModuleUnload(CUmodule hmod);
CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags);
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags);
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags);
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option);
#endif /* EBB_HAVE_CUDA_H */

/* The emulated driver's one extension: register a CPU function as kernel `name`.
 * cuModuleGetFunction on any module then finds it and cuLaunchKernel copies `arg_bytes` from
 * kernelParams[0] at launch, as CUDA copies kernel parameters. Looked up with dlsym; a real
 * libcuda does not export it. */
typedef void (*ebbsim_kernel_fn)(void *args);
typedef CUresult (*ebbsim_register_kernel_fn)(const char *name, ebbsim_kernel_fn fn, size_t arg_bytes);
#define EBBSIM_REGISTER_KERNEL_SYMBOL "ebbsim_register_kernel"
/* Its second: why cuInit failed, in words ("EBB_SIM_MEM='x' is not ..."), or "" when it did not.
 * The driver never prints; ebb_init puts this text into its own error message. The string is
 * the driver's, valid until it is unloaded. */
typedef const char *(*ebbsim_init_error_fn)(void);
#define EBBSIM_INIT_ERROR_SYMBOL "ebbsim_init_error"
/* Its third, for tests that prove a wait between two streams is needed: while on, every
 * cuStreamWaitEvent that makes `waiter` wait for an event last recorded on `producer` (and not yet
 * complete) succeeds and enqueues nothing, so the waiter reads what the producer has not written
 * yet. One pair at a time; setting a pair or turning it off (on = 0) writes to *skipped (may be
 * NULL) how many waits the previous setting skipped. CUDA_ERROR_INVALID_HANDLE for a stream that
 * is not live; the streams may belong to different devices. */
typedef CUresult (*ebbsim_skip_waits_fn)(CUstream waiter, CUstream producer, int on, unsigned long long *skipped);
#define EBBSIM_SKIP_WAITS_SYMBOL "ebbsim_skip_waits"

/* The emulated driver's extension for fault sweeps: how many counted calls were made since cuInit
 * while a fault of EBB_SIM_FAULT was left to fire (the counters stop with the last fault; a fault
 * past the workload's last call keeps them running to the end), and how many faults fired. */
typedef void (*ebbsim_fault_counts_fn)(unsigned long long *calls, int *fired);
#define EBBSIM_FAULT_COUNTS_SYMBOL "ebbsim_fault_counts"

/* X(field, symbol, required): every Driver API entry point ebb resolves, by its versioned name. */
#define EBB_DRV_ENTRIES(X)                                          \
  X(Init, "cuInit", 1)                                              \
  X(DriverGetVersion, "cuDriverGetVersion", 1)                      \
  X(GetErrorName, "cuGetErrorName", 1)                              \
  X(GetErrorString, "cuGetErrorString", 1)                          \
  X(DeviceGetCount, "cuDeviceGetCount", 1)                          \
  X(DeviceGet, "cuDeviceGet", 1)                                    \
  X(DeviceGetName, "cuDeviceGetName", 1)                            \
  X(DeviceTotalMem, "cuDeviceTotalMem_v2", 1)                       \
  X(DeviceGetAttribute, "cuDeviceGetAttribute", 1)                  \
  X(DeviceGetPCIBusId, "cuDeviceGetPCIBusId", 0)                    \
  X(DeviceCanAccessPeer, "cuDeviceCanAccessPeer", 0)                \
  X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1)          \
  X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1)     \
  X(CtxSetCurrent, "cuCtxSetCurrent", 1)                            \
  X(CtxGetCurrent, "cuCtxGetCurrent", 1)                            \
  X(CtxSynchronize, "cuCtxSynchronize", 1)                          \
  X(CtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange", 0)    \
  X(CtxEnablePeerAccess, "cuCtxEnablePeerAccess", 0)                \
  X(MemGetInfo, "cuMemGetInfo_v2", 1)                               \
  X(MemAlloc, "cuMemAlloc_v2", 1)                                   \
  X(MemFree, "cuMemFree_v2", 1)                                     \
  X(MemHostAlloc, "cuMemHostAlloc", 0)                              \
  X(MemFreeHost, "cuMemFreeHost", 0)                                \
  X(MemHostRegister, "cuMemHostRegister_v2", 0)                     \
  X(MemHostUnregister, "cuMemHostUnregister", 0)                    \
  X(PointerGetAttribute, "cuPointerGetAttribute", 1)                \
  X(MemcpyAsync, "cuMemcpyAsync", 1)                                \
  X(MemcpyPeerAsync, "cuMemcpyPeerAsync", 0)                        \
  X(MemsetD8Async, "cuMemsetD8Async", 0)                            \
  X(StreamCreateWithPriority, "cuStreamCreateWithPriority", 1)      \
  X(StreamDestroy, "cuStreamDestroy_v2", 1)                         \
  X(StreamSynchronize, "cuStreamSynchronize", 1)                    \
  X(StreamQuery, "cuStreamQuery", 1)                                \
  X(StreamWaitEvent, "cuStreamWaitEvent", 1)                        \
  X(LaunchHostFunc, "cuLaunchHostFunc", 0)                          \
  X(EventCreate, "cuEventCreate", 1)                                \
  X(EventDestroy, "cuEventDestroy_v2", 1)                           \
  X(EventRecord, "cuEventRecord", 1)                                \
  X(EventQuery, "cuEventQuery", 1)                                  \
  X(EventSynchronize, "cuEventSynchronize", 1)                      \
  X(EventElapsedTime, "cuEventElapsedTime_v2", 0)                   \
  X(ModuleLoadData, "cuModuleLoadData", 0)                          \
  X(ModuleUnload, "cuModuleUnload", 0)                              \
  X(ModuleGetFunction, "cuModuleGetFunction", 0)                    \
  X(LaunchKernel, "cuLaunchKernel", 0)                              \
  X(MemAddressReserve, "cuMemAddressReserve", 0)                    \
  X(MemAddressFree, "cuMemAddressFree", 0)                          \
  X(MemCreate, "cuMemCreate", 0)                                    \
  X(MemRelease, "cuMemRelease", 0)                                  \
  X(MemMap, "cuMemMap", 0)                                          \
  X(MemUnmap, "cuMemUnmap", 0)                                      \
  X(MemSetAccess, "cuMemSetAccess", 0)                              \
  X(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0)

/* Whether r is an error that leaves its context unusable on a GPU (a kernel's fault, an
 * uncorrectable ECC error): every later call in that context returns it. By value: this header
 * names only some of them. The emulated driver and ebb's runtime ask the same question. */
static inline int ebb__cu_error_sticky(int r) {
  switch (r) {
  case 214: /* CUDA_ERROR_ECC_UNCORRECTABLE */
  case 700: /* CUDA_ERROR_ILLEGAL_ADDRESS */
  case 702: /* CUDA_ERROR_LAUNCH_TIMEOUT */
  case 710: /* CUDA_ERROR_ASSERT */
  case 714: /* CUDA_ERROR_HARDWARE_STACK_ERROR */
  case 715: /* CUDA_ERROR_ILLEGAL_INSTRUCTION */
  case 716: /* CUDA_ERROR_MISALIGNED_ADDRESS */
  case 717: /* CUDA_ERROR_INVALID_ADDRESS_SPACE */
  case 718: /* CUDA_ERROR_INVALID_PC */
  case 719: /* CUDA_ERROR_LAUNCH_FAILED */
    return 1;
  default:
    return 0;
  }
}

#endif /* EBB_CUDA_H */
