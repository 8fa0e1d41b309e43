/* seam.c: the driver seam. Thin wrappers that every layer above runtime/ uses instead of the
 * driver table: each checks its arguments, makes a context current where the Driver API needs
 * one, calls the table and turns a CUresult into an ebb_status with a message naming the call.
 *
 * A NULL table entry means the loaded driver lacks that optional entry point: EBB_ENOTSUP.
 * Threading: no state of its own beyond device.c's per-thread context cache; thread-safe as the
 * driver is.
 */
#include <string.h>

#include "runtime_impl.h"

/* The wrappers' shared prologue: initialised, then the optional entry present. */
#define EBB_SEAM_ENTRY(fn, field)                                                                  \
  do {                                                                                             \
    ebb_status st_ = ebb__check_init(fn);                                                          \
    if (st_) return st_;                                                                           \
    if (EBB_UNLIKELY(!ebb__runtime_state.drv.field))                                                          \
      return ebb__fail(EBB_ENOTSUP, "%s: the %s driver does not provide cu%s", fn, ebb__runtime_state.info.name, #field); \
  } while (0)

#define EBB_SEAM_CALL(fn, call, expr)                        \
  do {                                                       \
    CUresult r_ = (expr);                                    \
    if (EBB_UNLIKELY(r_ != CUDA_SUCCESS)) return ebb__cu_fail(r_, fn, call); \
  } while (0)

#define EBB_SEAM_NONNULL(fn, p, what)                                                   \
  do {                                                                                  \
    if (EBB_UNLIKELY(!(p))) return ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected %s", fn, #p, what); \
  } while (0)

/* Calls on a stream or event run with the context of the object's device made current: the
 * driver judges a call by the context the thread has current (a sticky error in another
 * device's context must not refuse it, nor a healthy current context hide the object's). The
 * device is the caller's, taken from ebb's own stream and event handles (so in range). Teardown (destroy, free,
 * unregister) uses ensure_ctx: it goes on in the error state. */
static ebb_status ensure_ctx(const char *fn, int device) { return ebb__dev_activate(fn, device); }

/* ensure_ctx for calls that give work or wait for it: refused at once while the device is in
 * its error state. */
static ebb_status ensure_ctx_live(const char *fn, int device) {
  ebb_status st = ebb__dev_live(fn, device);
  return st ? st : ebb__dev_activate(fn, device);
}

/* Portable pinned host memory belongs to no device: any live device's context may ask for it.
 * `device` (the arena's or the caller's hint) when live, else the first live one; a device's
 * error state refuses it only when every device is in one (then `device`'s state is the error). */
static bool dev_healthy(int device) { return !ebb__dev_failed(device); }

static ebb_status host_ctx(const char *fn, int device) {
  int use = dev_healthy(device) ? device : -1;
  for (int d = 0; use < 0 && d < ebb__runtime_state.ndev; d++)
    if (d != device && dev_healthy(d)) use = d;
  if (use < 0) return ebb__dev_live(fn, device); /* every device failed: the hint's state */
  return ebb__dev_activate(fn, use);
}

ebb_status ebb__drv_ptr_info(int device, const void *ptr, ebb_ptr_info *out) {
  EBB_SEAM_ENTRY("ebb__drv_ptr_info", PointerGetAttribute);
  EBB_SEAM_NONNULL("ebb__drv_ptr_info", out, "a struct to fill");
  ebb_status st = ensure_ctx_live("ebb__drv_ptr_info", device);
  if (st) return st;
  unsigned int type = 0;
  CUresult r = ebb__runtime_state.drv.PointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)ptr);
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_MAPPED_AS_POINTER) {
    /* The driver does not know the address: ordinary (pageable) host memory. */
    out->type = EBB_MEMTYPE_PAGEABLE;
    out->device = -1;
    return EBB_OK;
  }
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb__drv_ptr_info", "cuPointerGetAttribute(MEMORY_TYPE)");
  int ord = -1;
  if (type == CU_MEMORYTYPE_DEVICE) {
    EBB_SEAM_CALL("ebb__drv_ptr_info", "cuPointerGetAttribute(DEVICE_ORDINAL)",
                  ebb__runtime_state.drv.PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)ptr));
    out->type = EBB_MEMTYPE_DEVICE;
    out->device = ord;
  } else {
    out->type = EBB_MEMTYPE_PINNED;
    out->device = -1;
  }
  return EBB_OK;
}

/* ---- streams ---- */

ebb_status ebb__drv_stream_create(int device, int priority, struct CUstream_st **out) {
  ebb_status st = ebb__check_dev_live("ebb__drv_stream_create", device);
  if (st) return st;
  EBB_SEAM_NONNULL("ebb__drv_stream_create", out, "a CUstream to fill");
  st = ebb__dev_activate("ebb__drv_stream_create", device);
  if (st) return st;
  CUstream s = NULL;
  EBB_SEAM_CALL("ebb__drv_stream_create", "cuStreamCreateWithPriority",
                ebb__runtime_state.drv.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, priority));
  *out = s;
  return EBB_OK;
}

ebb_status ebb__drv_stream_destroy(int device, struct CUstream_st *s) {
  EBB_SEAM_ENTRY("ebb__drv_stream_destroy", StreamDestroy);
  EBB_SEAM_NONNULL("ebb__drv_stream_destroy", s, "a driver stream (the legacy NULL stream is never destroyed)");
  ebb_status st = ensure_ctx("ebb__drv_stream_destroy", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_stream_destroy", "cuStreamDestroy", ebb__runtime_state.drv.StreamDestroy(s));
  return EBB_OK;
}

ebb_status ebb__drv_stream_synchronize(int device, struct CUstream_st *s) {
  EBB_SEAM_ENTRY("ebb__drv_stream_synchronize", StreamSynchronize);
  EBB_SEAM_NONNULL("ebb__drv_stream_synchronize", s, "a driver stream");
  ebb_status st = ensure_ctx_live("ebb__drv_stream_synchronize", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_stream_synchronize", "cuStreamSynchronize", ebb__runtime_state.drv.StreamSynchronize(s));
  return EBB_OK;
}

ebb_status ebb__drv_stream_query(int device, struct CUstream_st *s, bool *idle) {
  EBB_SEAM_ENTRY("ebb__drv_stream_query", StreamQuery);
  EBB_SEAM_NONNULL("ebb__drv_stream_query", s, "a driver stream");
  EBB_SEAM_NONNULL("ebb__drv_stream_query", idle, "a bool to fill");
  ebb_status st = ensure_ctx_live("ebb__drv_stream_query", device);
  if (st) return st;
  CUresult r = ebb__runtime_state.drv.StreamQuery(s);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY) return ebb__cu_fail(r, "ebb__drv_stream_query", "cuStreamQuery");
  *idle = r == CUDA_SUCCESS;
  return EBB_OK;
}

ebb_status ebb__drv_stream_wait_event(int device, struct CUstream_st *s, int event_device, struct CUevent_st *e) {
  EBB_SEAM_ENTRY("ebb__drv_stream_wait_event", StreamWaitEvent);
  EBB_SEAM_NONNULL("ebb__drv_stream_wait_event", s, "a driver stream");
  EBB_SEAM_NONNULL("ebb__drv_stream_wait_event", e, "a driver event");
  /* An event of a device in its error state never completes: the wait is refused too. */
  ebb_status st = event_device == device ? EBB_OK : ebb__dev_live("ebb__drv_stream_wait_event", event_device);
  if (!st) st = ensure_ctx_live("ebb__drv_stream_wait_event", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_stream_wait_event", "cuStreamWaitEvent", ebb__runtime_state.drv.StreamWaitEvent(s, e, 0));
  return EBB_OK;
}

ebb_status ebb__drv_launch_host_func(int device, struct CUstream_st *s, ebb_host_fn fn, void *user) {
  EBB_SEAM_ENTRY("ebb__drv_launch_host_func", LaunchHostFunc);
  EBB_SEAM_NONNULL("ebb__drv_launch_host_func", s, "a driver stream");
  EBB_SEAM_NONNULL("ebb__drv_launch_host_func", fn, "a function to run");
  ebb_status st = ensure_ctx_live("ebb__drv_launch_host_func", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_launch_host_func", "cuLaunchHostFunc", ebb__runtime_state.drv.LaunchHostFunc(s, fn, user));
  return EBB_OK;
}

/* ---- events ---- */

ebb_status ebb__drv_event_create(int device, bool timing, struct CUevent_st **out) {
  ebb_status st = ebb__check_dev_live("ebb__drv_event_create", device);
  if (st) return st;
  EBB_SEAM_NONNULL("ebb__drv_event_create", out, "a CUevent to fill");
  st = ebb__dev_activate("ebb__drv_event_create", device);
  if (st) return st;
  CUevent e = NULL;
  EBB_SEAM_CALL("ebb__drv_event_create", "cuEventCreate",
                ebb__runtime_state.drv.EventCreate(&e, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING));
  *out = e;
  return EBB_OK;
}

ebb_status ebb__drv_event_destroy(int device, struct CUevent_st *e) {
  EBB_SEAM_ENTRY("ebb__drv_event_destroy", EventDestroy);
  EBB_SEAM_NONNULL("ebb__drv_event_destroy", e, "a driver event");
  ebb_status st = ensure_ctx("ebb__drv_event_destroy", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_event_destroy", "cuEventDestroy", ebb__runtime_state.drv.EventDestroy(e));
  return EBB_OK;
}

ebb_status ebb__drv_event_record(int device, struct CUevent_st *e, struct CUstream_st *s) {
  EBB_SEAM_ENTRY("ebb__drv_event_record", EventRecord);
  EBB_SEAM_NONNULL("ebb__drv_event_record", e, "a driver event");
  EBB_SEAM_NONNULL("ebb__drv_event_record", s, "a driver stream");
  ebb_status st = ensure_ctx_live("ebb__drv_event_record", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_event_record", "cuEventRecord", ebb__runtime_state.drv.EventRecord(e, s));
  return EBB_OK;
}

ebb_status ebb__drv_event_query(int device, struct CUevent_st *e, bool *done) {
  EBB_SEAM_ENTRY("ebb__drv_event_query", EventQuery);
  EBB_SEAM_NONNULL("ebb__drv_event_query", e, "a driver event");
  EBB_SEAM_NONNULL("ebb__drv_event_query", done, "a bool to fill");
  ebb_status st = ensure_ctx_live("ebb__drv_event_query", device);
  if (st) return st;
  CUresult r = ebb__runtime_state.drv.EventQuery(e);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY) return ebb__cu_fail(r, "ebb__drv_event_query", "cuEventQuery");
  *done = r == CUDA_SUCCESS;
  return EBB_OK;
}

ebb_status ebb__drv_event_synchronize(int device, struct CUevent_st *e) {
  EBB_SEAM_ENTRY("ebb__drv_event_synchronize", EventSynchronize);
  EBB_SEAM_NONNULL("ebb__drv_event_synchronize", e, "a driver event");
  ebb_status st = ensure_ctx_live("ebb__drv_event_synchronize", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_event_synchronize", "cuEventSynchronize", ebb__runtime_state.drv.EventSynchronize(e));
  return EBB_OK;
}

ebb_status ebb__drv_event_elapsed(int device, struct CUevent_st *start, struct CUevent_st *end, float *ms) {
  EBB_SEAM_ENTRY("ebb__drv_event_elapsed", EventElapsedTime);
  EBB_SEAM_NONNULL("ebb__drv_event_elapsed", start, "a recorded timing event");
  EBB_SEAM_NONNULL("ebb__drv_event_elapsed", end, "a recorded timing event");
  EBB_SEAM_NONNULL("ebb__drv_event_elapsed", ms, "a float to fill");
  ebb_status st = ensure_ctx_live("ebb__drv_event_elapsed", device);
  if (st) return st;
  float v = 0;
  EBB_SEAM_CALL("ebb__drv_event_elapsed", "cuEventElapsedTime", ebb__runtime_state.drv.EventElapsedTime(&v, start, end));
  *ms = v;
  return EBB_OK;
}

/* ---- memory ---- */

ebb_status ebb__drv_mem_alloc(int device, size_t bytes, uint64_t *dptr) {
  ebb_status st = ebb__check_dev_live("ebb__drv_mem_alloc", device);
  if (st) return st;
  EBB_SEAM_NONNULL("ebb__drv_mem_alloc", dptr, "a uint64_t to fill");
  if (bytes == 0) return ebb__fail(EBB_EINVAL, "ebb__drv_mem_alloc: 0 bytes requested on device %d; expected at least 1", device);
  st = ebb__dev_activate("ebb__drv_mem_alloc", device);
  if (st) return st;
  CUdeviceptr p = 0;
  CUresult r = ebb__runtime_state.drv.MemAlloc(&p, bytes);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    return ebb__fail(EBB_ENOMEM, "ebb__drv_mem_alloc: device %d is out of memory for %zu bytes (cuMemAlloc)", device, bytes);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb__drv_mem_alloc", "cuMemAlloc");
  *dptr = (uint64_t)p;
  return EBB_OK;
}

ebb_status ebb__drv_mem_free(int device, uint64_t dptr) {
  ebb_status st = ebb__check_dev("ebb__drv_mem_free", device);
  if (st) return st;
  if (!dptr) return EBB_OK; /* free(NULL), as cuMemFree(0) and ebb_arena_free */
  st = ebb__dev_activate("ebb__drv_mem_free", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_mem_free", "cuMemFree", ebb__runtime_state.drv.MemFree((CUdeviceptr)dptr));
  return EBB_OK;
}

ebb_status ebb__drv_pinned_alloc(int device, size_t bytes, void **out) {
  ebb_status st = ebb__check_dev("ebb__drv_pinned_alloc", device);
  if (st) return st;
  EBB_SEAM_ENTRY("ebb__drv_pinned_alloc", MemHostAlloc);
  EBB_SEAM_NONNULL("ebb__drv_pinned_alloc", out, "a pointer to fill");
  if (bytes == 0) return ebb__fail(EBB_EINVAL, "ebb__drv_pinned_alloc: 0 bytes requested; expected at least 1");
  st = host_ctx("ebb__drv_pinned_alloc", device);
  if (st) return st;
  void *p = NULL;
  CUresult r = ebb__runtime_state.drv.MemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    return ebb__fail(EBB_ENOMEM, "ebb__drv_pinned_alloc: no pinned host memory for %zu bytes (cuMemHostAlloc)", bytes);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb__drv_pinned_alloc", "cuMemHostAlloc");
  *out = p;
  return EBB_OK;
}

ebb_status ebb__drv_pinned_free(int device, void *p) {
  EBB_SEAM_ENTRY("ebb__drv_pinned_free", MemFreeHost);
  if (!p) return EBB_OK; /* free(NULL), as cuMemFreeHost(NULL) and ebb_pinned_free */
  ebb_status st = ensure_ctx("ebb__drv_pinned_free", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_pinned_free", "cuMemFreeHost", ebb__runtime_state.drv.MemFreeHost(p));
  return EBB_OK;
}

ebb_status ebb__drv_host_register(int device, void *p, size_t bytes) {
  EBB_SEAM_ENTRY("ebb__drv_host_register", MemHostRegister);
  EBB_SEAM_NONNULL("ebb__drv_host_register", p, "host memory to register");
  if (bytes == 0) return ebb__fail(EBB_EINVAL, "ebb__drv_host_register: 0 bytes; expected at least 1");
  ebb_status st = host_ctx("ebb__drv_host_register", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_host_register", "cuMemHostRegister",
                ebb__runtime_state.drv.MemHostRegister(p, bytes, CU_MEMHOSTREGISTER_PORTABLE));
  return EBB_OK;
}

ebb_status ebb__drv_host_unregister(int device, void *p) {
  EBB_SEAM_ENTRY("ebb__drv_host_unregister", MemHostUnregister);
  EBB_SEAM_NONNULL("ebb__drv_host_unregister", p, "a registered host pointer");
  ebb_status st = ensure_ctx("ebb__drv_host_unregister", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_host_unregister", "cuMemHostUnregister", ebb__runtime_state.drv.MemHostUnregister(p));
  return EBB_OK;
}

ebb_status ebb__drv_memcpy_async(int device, void *dst, const void *src, size_t bytes, struct CUstream_st *s) {
  EBB_SEAM_ENTRY("ebb__drv_memcpy_async", MemcpyAsync);
  EBB_SEAM_NONNULL("ebb__drv_memcpy_async", dst, "a destination pointer");
  EBB_SEAM_NONNULL("ebb__drv_memcpy_async", src, "a source pointer");
  EBB_SEAM_NONNULL("ebb__drv_memcpy_async", s, "a driver stream");
  if (bytes == 0) return EBB_OK;
  ebb_status st = ensure_ctx_live("ebb__drv_memcpy_async", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_memcpy_async", "cuMemcpyAsync",
                ebb__runtime_state.drv.MemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes, s));
  return EBB_OK;
}

ebb_status ebb__drv_memset_async(int device, void *dst, unsigned char value, size_t bytes, struct CUstream_st *s) {
  EBB_SEAM_ENTRY("ebb__drv_memset_async", MemsetD8Async);
  EBB_SEAM_NONNULL("ebb__drv_memset_async", dst, "device memory");
  EBB_SEAM_NONNULL("ebb__drv_memset_async", s, "a driver stream");
  if (bytes == 0) return EBB_OK;
  ebb_status st = ensure_ctx_live("ebb__drv_memset_async", device);
  if (st) return st;
  EBB_SEAM_CALL("ebb__drv_memset_async", "cuMemsetD8Async",
                ebb__runtime_state.drv.MemsetD8Async((CUdeviceptr)(uintptr_t)dst, value, bytes, s));
  return EBB_OK;
}

/* ---- VMM ---- */

static void vmm_prop(int device, CUmemAllocationProp *prop) {
  memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = device;
}

ebb_status ebb__drv_vmm_granularity(int device, size_t *granularity) {
  ebb_status st = ebb__check_dev_live("ebb__drv_vmm_granularity", device);
  if (st) return st;
  EBB_SEAM_ENTRY("ebb__drv_vmm_granularity", MemGetAllocationGranularity);
  EBB_SEAM_NONNULL("ebb__drv_vmm_granularity", granularity, "a size_t to fill");
  CUmemAllocationProp prop;
  vmm_prop(device, &prop);
  size_t g = 0;
  EBB_SEAM_CALL("ebb__drv_vmm_granularity", "cuMemGetAllocationGranularity",
                ebb__runtime_state.drv.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  *granularity = g;
  return EBB_OK;
}

ebb_status ebb__drv_vmm_reserve(int device, size_t bytes, uint64_t *va) {
  ebb_status st = ebb__check_dev_live("ebb__drv_vmm_reserve", device);
  if (st) return st;
  EBB_SEAM_ENTRY("ebb__drv_vmm_reserve", MemAddressReserve);
  EBB_SEAM_NONNULL("ebb__drv_vmm_reserve", va, "a uint64_t to fill");
  st = ebb__dev_activate("ebb__drv_vmm_reserve", device);
  if (st) return st;
  CUdeviceptr p = 0;
  EBB_SEAM_CALL("ebb__drv_vmm_reserve", "cuMemAddressReserve", ebb__runtime_state.drv.MemAddressReserve(&p, bytes, 0, 0, 0));
  *va = (uint64_t)p;
  return EBB_OK;
}

ebb_status ebb__drv_vmm_free(uint64_t va, size_t bytes) {
  EBB_SEAM_ENTRY("ebb__drv_vmm_free", MemAddressFree);
  if (!va) return ebb__fail(EBB_EINVAL, "ebb__drv_vmm_free: address is 0; expected a reservation");
  EBB_SEAM_CALL("ebb__drv_vmm_free", "cuMemAddressFree", ebb__runtime_state.drv.MemAddressFree((CUdeviceptr)va, bytes));
  return EBB_OK;
}

ebb_status ebb__drv_vmm_create(int device, size_t bytes, uint64_t *handle) {
  ebb_status st = ebb__check_dev_live("ebb__drv_vmm_create", device);
  if (st) return st;
  EBB_SEAM_ENTRY("ebb__drv_vmm_create", MemCreate);
  EBB_SEAM_NONNULL("ebb__drv_vmm_create", handle, "a uint64_t to fill");
  st = ebb__dev_activate("ebb__drv_vmm_create", device);
  if (st) return st;
  CUmemAllocationProp prop;
  vmm_prop(device, &prop);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = ebb__runtime_state.drv.MemCreate(&h, bytes, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    return ebb__fail(EBB_ENOMEM, "ebb__drv_vmm_create: device %d is out of memory for %zu bytes (cuMemCreate)", device, bytes);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb__drv_vmm_create", "cuMemCreate");
  *handle = (uint64_t)h;
  return EBB_OK;
}

ebb_status ebb__drv_vmm_release(uint64_t handle) {
  EBB_SEAM_ENTRY("ebb__drv_vmm_release", MemRelease);
  EBB_SEAM_CALL("ebb__drv_vmm_release", "cuMemRelease", ebb__runtime_state.drv.MemRelease((CUmemGenericAllocationHandle)handle));
  return EBB_OK;
}

ebb_status ebb__drv_vmm_map(uint64_t va, size_t bytes, uint64_t handle, int device) {
  ebb_status st = ebb__check_dev_live("ebb__drv_vmm_map", device);
  if (st) return st;
  EBB_SEAM_ENTRY("ebb__drv_vmm_map", MemMap);
  EBB_SEAM_CALL("ebb__drv_vmm_map", "cuMemMap", ebb__runtime_state.drv.MemMap((CUdeviceptr)va, bytes, 0, (CUmemGenericAllocationHandle)handle, 0));
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = ebb__runtime_state.drv.MemSetAccess((CUdeviceptr)va, bytes, &acc, 1);
  if (r != CUDA_SUCCESS) {
    /* Best effort: leave the range as it was before the call. If the unmap fails too the range
     * stays mapped, and the next map at va fails and says so. */
    (void)ebb__runtime_state.drv.MemUnmap((CUdeviceptr)va, bytes);
    return ebb__cu_fail(r, "ebb__drv_vmm_map", "cuMemSetAccess");
  }
  return EBB_OK;
}

ebb_status ebb__drv_vmm_unmap(uint64_t va, size_t bytes) {
  EBB_SEAM_ENTRY("ebb__drv_vmm_unmap", MemUnmap);
  EBB_SEAM_CALL("ebb__drv_vmm_unmap", "cuMemUnmap", ebb__runtime_state.drv.MemUnmap((CUdeviceptr)va, bytes));
  return EBB_OK;
}

/* ---- live handle counter ---- */

static atomic_long ebb__live;
long ebb_debug_live_handles(void) { return atomic_load_explicit(&ebb__live, memory_order_relaxed); }
void ebb__debug_live_add(long delta) { atomic_fetch_add_explicit(&ebb__live, delta, memory_order_relaxed); }
