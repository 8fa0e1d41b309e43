/* device.c: devices, their primary contexts and capabilities, the per-thread current device.
 *
 * ebb_init retains every device's primary context and reads its capabilities once from
 * cuDeviceGetAttribute; layers above see only ebb_dev_caps. Each thread has a current device
 * (default 0) and a cache of the context it made current, so most calls make no driver call to
 * switch contexts. The cache is keyed by an init generation: after a shutdown and a new init,
 * stale cached contexts are never trusted.
 *
 * Threading: the device array is written by ebb_init only (runtime lock) and read freely after.
 */
#include <stdio.h>
#include <string.h>

#include "runtime_impl.h"

static atomic_uint ebb__init_gen = 1;
static _Thread_local int ebb__tl_cur_dev;            /* this thread's current device */
static _Thread_local unsigned ebb__tl_ctx_gen;       /* generation of ebb__tl_ctx_dev */
static _Thread_local int ebb__tl_ctx_dev = -1;       /* device whose context we made current */

ebb_status ebb__check_dev(const char *fn, int device) {
  ebb_status st = ebb__check_init(fn);
  if (st) return st;
  if (EBB_UNLIKELY(device < 0 || device >= ebb__runtime_state.ndev))
    return ebb__fail(EBB_EDEVICE, "%s: device %d does not exist; expected 0..%d (%d device(s) on the %s driver)", fn,
                     device, ebb__runtime_state.ndev - 1, ebb__runtime_state.ndev, ebb__runtime_state.info.name);
  return EBB_OK;
}

ebb_status ebb__dev_activate(const char *fn, int device) {
  unsigned gen = atomic_load_explicit(&ebb__init_gen, memory_order_relaxed);
  if (EBB_LIKELY(ebb__tl_ctx_dev == device && ebb__tl_ctx_gen == gen)) return EBB_OK;
  CUresult r = ebb__runtime_state.drv.CtxSetCurrent(ebb__runtime_state.dev[device].ctx);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, fn, "cuCtxSetCurrent");
  ebb__tl_ctx_dev = device;
  ebb__tl_ctx_gen = gen;
  return EBB_OK;
}

/* ---- the error state ----
 * On a GPU a kernel's fault (CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_ILLEGAL_ADDRESS, ...) is sticky:
 * every later call in that context returns it, until the context is destroyed. The first such
 * error ebb sees (ebb__cu_fail) puts the device in an error state, so every later call that would
 * give it work or wait for it answers at once, with the error and the call that met it, instead
 * of asking the driver again (or polling an event that will never complete). */

/* Which device's context holds a sticky error: each context's default stream is asked
 * (cuStreamQuery never waits; in a failed context it returns the error). A driver that does not
 * keep the error makes no context answer: then the device whose context the thread made current
 * for the failing call. The thread's context is set back to the one its cache names (with none
 * cached, its next call sets one). */
static int sticky_owner(void) {
  const ebb_drv *d = &ebb__runtime_state.drv;
  int owner = -1, marked = -1;
  /* A device not yet in its error state first (a second device's fault is its own); else one
   * already in it (the call met that device's error again). */
  for (int i = 0; i < ebb__runtime_state.ndev && owner < 0 && d->StreamQuery; i++) {
    if (d->CtxSetCurrent(ebb__runtime_state.dev[i].ctx) != CUDA_SUCCESS || !ebb__cu_sticky(d->StreamQuery(NULL))) continue;
    /* relaxed: a hint; the marking's CAS decides */
    if (atomic_load_explicit(&ebb__runtime_state.dev[i].failed, memory_order_relaxed) == 0) owner = i;
    else if (marked < 0) marked = i;
  }
  if (owner < 0) owner = marked;
  if (owner < 0) owner = ebb__tl_ctx_dev >= 0 && ebb__tl_ctx_dev < ebb__runtime_state.ndev ? ebb__tl_ctx_dev : ebb__tl_cur_dev;
  if (owner < 0 || owner >= ebb__runtime_state.ndev) owner = 0;
  if (ebb__tl_ctx_dev >= 0 && ebb__tl_ctx_dev < ebb__runtime_state.ndev) d->CtxSetCurrent(ebb__runtime_state.dev[ebb__tl_ctx_dev].ctx);
  return owner;
}

int ebb__dev_mark_failed(CUresult r, const char *call) {
  int dev = sticky_owner();
  ebb_device *dv = &ebb__runtime_state.dev[dev];
  int none = 0;
  /* relaxed: the winner alone writes failed_call, published by the release store below */
  if (atomic_compare_exchange_strong_explicit(&dv->failed, &none, EBB__DEV_MARKING, memory_order_relaxed,
                                              memory_order_relaxed)) {
    snprintf(dv->failed_call, sizeof dv->failed_call, "%s", call);
    /* release: pairs with the acquire in ebb__dev_live_slow; failed_call is written */
    atomic_store_explicit(&dv->failed, (int)r, memory_order_release);
    atomic_store_explicit(&ebb__runtime_state.any_failed, 1, memory_order_relaxed);
  }
  return dev;
}

ebb_status ebb__dev_live_slow(const char *fn, int device) {
  if (device < 0 || device >= ebb__runtime_state.ndev) return EBB_OK; /* (the range check is the caller's) */
  ebb_device *dv = &ebb__runtime_state.dev[device];
  int r;
  /* acquire: pairs with the release in ebb__dev_mark_failed. A marking in progress takes a few
   * instructions: wait for it rather than report a state without its cause. */
  while ((r = atomic_load_explicit(&dv->failed, memory_order_acquire)) == EBB__DEV_MARKING) ebb__cpu_relax();
  if (r == 0) return EBB_OK;
  const char *name = NULL;
  if (ebb__runtime_state.drv.GetErrorName && ebb__runtime_state.drv.GetErrorName((CUresult)r, &name) != CUDA_SUCCESS) name = NULL;
  if (!name) name = ebb__cu_name((CUresult)r);
  char num[16];
  if (!name) {
    snprintf(num, sizeof num, "CUresult %d", r);
    name = num;
  }
  return ebb__fail(EBB_EDEVICE, "%s: device %d is in an error state after %s in %s; release every handle and call ebb_shutdown",
                   fn, device, name, dv->failed_call);
}

bool ebb__dev_failed(int device) {
  if (device < 0 || device >= ebb__runtime_state.ndev) return false;
  /* acquire: pairs with the release in ebb__dev_mark_failed (a marking in progress reads as
   * failed: it is, a few instructions from now) */
  return atomic_load_explicit(&ebb__runtime_state.dev[device].failed, memory_order_acquire) != 0;
}

ebb_status ebb__check_dev_live(const char *fn, int device) {
  ebb_status st = ebb__check_dev(fn, device);
  return st ? st : ebb__dev_live(fn, device);
}

ebb_status ebb_dev_status(int device) { return ebb__check_dev_live("ebb_dev_status", device); }

/* The device attributes ebb reads at ebb_init. A failed read fails ebb_init naming the attribute:
 * read as 0 it would make a GPU look emulated (no compute capability) or without VMM. */
enum { A_CC_MAJOR, A_CC_MINOR, A_SMS, A_ENGINES, A_UVA, A_CONCURRENT, A_VMM, A_HOST_REGISTER, A_PRIORITIES, A_COUNT };
static const struct {
  CUdevice_attribute a;
  const char *name;
} attrs[A_COUNT] = {
    {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)"},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)"},
    {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"},
    {CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, "cuDeviceGetAttribute(ASYNC_ENGINE_COUNT)"},
    {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "cuDeviceGetAttribute(UNIFIED_ADDRESSING)"},
    {CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, "cuDeviceGetAttribute(CONCURRENT_KERNELS)"},
    {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"},
    {CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, "cuDeviceGetAttribute(HOST_REGISTER_SUPPORTED)"},
    {CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED, "cuDeviceGetAttribute(STREAM_PRIORITIES_SUPPORTED)"},
};

static ebb_status dev_read_caps(int i) {
  ebb_device *dv = &ebb__runtime_state.dev[i];
  ebb_dev_caps *c = &dv->caps;
  const ebb_drv *d = &ebb__runtime_state.drv;
  memset(c, 0, sizeof *c);
  c->ordinal = i;
  /* (the name and the PCI bus id are for messages: a default stands in when the driver has none) */
  if (d->DeviceGetName(c->name, (int)sizeof c->name, dv->cu) != CUDA_SUCCESS) snprintf(c->name, sizeof c->name, "device %d", i);
  CUresult r = d->DeviceTotalMem(&c->total_mem, dv->cu);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_init", "cuDeviceTotalMem");
  int v[A_COUNT];
  for (int k = 0; k < A_COUNT; k++) {
    v[k] = 0;
    if ((r = d->DeviceGetAttribute(&v[k], attrs[k].a, dv->cu)) != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_init", attrs[k].name);
  }
  c->cc_major = v[A_CC_MAJOR];
  c->cc_minor = v[A_CC_MINOR];
  c->multiprocessors = v[A_SMS];
  c->async_engines = v[A_ENGINES];
  c->unified_addressing = v[A_UVA] != 0;
  c->concurrent_kernels = v[A_CONCURRENT] != 0;
  c->vmm = d->MemAddressReserve && d->MemCreate && d->MemMap && d->MemSetAccess && d->MemUnmap && v[A_VMM] != 0;
  c->host_register = d->MemHostRegister && d->MemHostUnregister && v[A_HOST_REGISTER] != 0;
  c->host_alloc = d->MemHostAlloc && d->MemFreeHost;
  c->host_func = d->LaunchHostFunc != NULL;
  c->cpu_kernels = d->RegisterKernel != NULL;
  /* No compute capability means no streaming multiprocessors: the device runs on CPU threads. */
  c->emulated = c->cc_major == 0;
  if (d->DeviceGetPCIBusId && d->DeviceGetPCIBusId(c->pci_bus_id, (int)sizeof c->pci_bus_id, dv->cu) != CUDA_SUCCESS)
    c->pci_bus_id[0] = '\0';
  /* Optional: a driver without these attributes leaves the peak unknown (0), nothing fails. */
  if (d->DeviceGetAttribute(&c->mem_clock_khz, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, dv->cu) != CUDA_SUCCESS || c->mem_clock_khz < 0)
    c->mem_clock_khz = 0;
  if (d->DeviceGetAttribute(&c->mem_bus_bits, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, dv->cu) != CUDA_SUCCESS || c->mem_bus_bits < 0)
    c->mem_bus_bits = 0;
  if (!c->emulated) c->peak_mem_gbps = 2.0 * c->mem_clock_khz * 1e3 * (c->mem_bus_bits / 8.0) / 1e9;
  c->prio_least = c->prio_greatest = 0;
  if (d->CtxGetStreamPriorityRange && v[A_PRIORITIES]) {
    ebb_status st = ebb__dev_activate("ebb_init", i);
    if (st) return st;
    if ((r = d->CtxGetStreamPriorityRange(&c->prio_least, &c->prio_greatest)) != CUDA_SUCCESS)
      return ebb__cu_fail(r, "ebb_init", "cuCtxGetStreamPriorityRange");
  }
  return EBB_OK;
}

ebb_status ebb__devices_init(void) {
  const ebb_drv *d = &ebb__runtime_state.drv;
  int n = ebb__runtime_state.info.device_count;
  /* A new generation invalidates every thread's cached current context. */
  atomic_fetch_add_explicit(&ebb__init_gen, 1, memory_order_relaxed);
  ebb__runtime_state.ndev = 0;
  atomic_store_explicit(&ebb__runtime_state.any_failed, 0, memory_order_relaxed); /* fresh contexts, no error state */
  for (int i = 0; i < n; i++) {
    ebb_device *dv = &ebb__runtime_state.dev[i];
    memset(dv, 0, sizeof *dv);
    const char *call = "cuDeviceGet";
    CUresult r = d->DeviceGet(&dv->cu, i);
    if (r == CUDA_SUCCESS) {
      call = "cuDevicePrimaryCtxRetain";
      r = d->DevicePrimaryCtxRetain(&dv->ctx, dv->cu);
    }
    if (r != CUDA_SUCCESS) {
      ebb__devices_fini();
      return ebb__cu_fail(r, "ebb_init", call);
    }
    ebb__runtime_state.ndev = i + 1;
  }
  for (int i = 0; i < n; i++) {
    ebb_status st = dev_read_caps(i);
    if (st) {
      ebb__devices_fini();
      return st;
    }
  }
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < n && d->DeviceCanAccessPeer; j++) {
      int can = 0;
      if (i != j && d->DeviceCanAccessPeer(&can, ebb__runtime_state.dev[i].cu, ebb__runtime_state.dev[j].cu) == CUDA_SUCCESS && can)
        ebb__runtime_state.dev[i].caps.peer = true;
    }
  }
  return EBB_OK;
}

/* Best effort throughout, at the last shutdown (or a start that failed): each device's work is waited for where its
 * context can be made current (a device in its error state fails the wait: its work will not
 * run), and the primary context is released whatever happened, which is what ends its work and
 * frees what it holds; nothing is left to hand a failure to. */
void ebb__devices_fini(void) {
  for (int i = 0; i < ebb__runtime_state.ndev; i++) {
    if (ebb__runtime_state.drv.CtxSetCurrent(ebb__runtime_state.dev[i].ctx) == CUDA_SUCCESS) (void)ebb__runtime_state.drv.CtxSynchronize();
    (void)ebb__runtime_state.drv.DevicePrimaryCtxRelease(ebb__runtime_state.dev[i].cu);
  }
  (void)ebb__runtime_state.drv.CtxSetCurrent(NULL);
  ebb__tl_ctx_dev = -1;
  ebb__runtime_state.ndev = 0;
}

ebb_status ebb_dev_count(int *count) {
  ebb_status st = ebb__check_init("ebb_dev_count");
  if (st) return st;
  if (!count) return ebb__fail(EBB_EINVAL, "ebb_dev_count: count is NULL; expected an int to fill");
  *count = ebb__runtime_state.ndev;
  return EBB_OK;
}

ebb_status ebb_dev_get_caps(int device, ebb_dev_caps *out) {
  ebb_status st = ebb__check_dev("ebb_dev_get_caps", device);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_dev_get_caps: out is NULL; expected a struct to fill");
  *out = ebb__runtime_state.dev[device].caps;
  return EBB_OK;
}

ebb_status ebb_dev_set_current(int device) {
  ebb_status st = ebb__check_dev("ebb_dev_set_current", device);
  if (st) return st;
  st = ebb__dev_activate("ebb_dev_set_current", device);
  if (st) return st;
  ebb__tl_cur_dev = device;
  return EBB_OK;
}

ebb_status ebb_dev_get_current(int *device) {
  ebb_status st = ebb__check_init("ebb_dev_get_current");
  if (st) return st;
  if (!device) return ebb__fail(EBB_EINVAL, "ebb_dev_get_current: device is NULL; expected an int to fill");
  /* A thread's device chosen under an earlier init with more devices falls back to 0. */
  *device = ebb__tl_cur_dev < ebb__runtime_state.ndev ? ebb__tl_cur_dev : 0;
  return EBB_OK;
}

#define EBB_GUARD_LIVE 0x65626764u /* "ebgd" */

ebb_status ebb_dev_guard_enter(ebb_dev_guard *g, int device) {
  if (!g) return ebb__fail(EBB_EINVAL, "ebb_dev_guard_enter: guard is NULL; expected a guard on the caller's stack");
  int prev = 0;
  ebb_status st = ebb_dev_get_current(&prev);
  if (st) return st;
  st = ebb_dev_set_current(device);
  if (st) return st;
  g->prev = prev;
  g->device = device;
  g->magic = EBB_GUARD_LIVE;
  return EBB_OK;
}

ebb_status ebb_dev_guard_exit(ebb_dev_guard *g) {
  if (!g) return ebb__fail(EBB_EINVAL, "ebb_dev_guard_exit: guard is NULL");
  if (g->magic != EBB_GUARD_LIVE)
    return ebb__fail(EBB_ESTATE, "ebb_dev_guard_exit: guard was not entered or was already exited");
  ebb_status st = ebb_dev_set_current(g->prev);
  if (st) return st;
  g->magic = 0;
  return EBB_OK;
}

ebb_status ebb_dev_synchronize(int device) {
  ebb_status st = ebb__check_dev_live("ebb_dev_synchronize", device);
  if (st) return st;
  st = ebb__dev_activate("ebb_dev_synchronize", device);
  if (st) return st;
  CUresult r = ebb__runtime_state.drv.CtxSynchronize();
  return r == CUDA_SUCCESS ? EBB_OK : ebb__cu_fail(r, "ebb_dev_synchronize", "cuCtxSynchronize");
}

ebb_status ebb_dev_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  ebb_status st = ebb__check_dev_live("ebb_dev_mem_info", device);
  if (st) return st;
  if (!free_bytes || !total_bytes)
    return ebb__fail(EBB_EINVAL, "ebb_dev_mem_info: free_bytes and total_bytes must both be non-NULL");
  st = ebb__dev_activate("ebb_dev_mem_info", device);
  if (st) return st;
  size_t f = 0, t = 0;
  CUresult r = ebb__runtime_state.drv.MemGetInfo(&f, &t);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_dev_mem_info", "cuMemGetInfo");
  *free_bytes = f;
  *total_bytes = t;
  return EBB_OK;
}

ebb_status ebb_dev_can_access_peer(int device, int peer, bool *can) {
  ebb_status st = ebb__check_dev("ebb_dev_can_access_peer", device);
  if (!st) st = ebb__check_dev("ebb_dev_can_access_peer (peer)", peer);
  if (st) return st;
  if (!can) return ebb__fail(EBB_EINVAL, "ebb_dev_can_access_peer: can is NULL; expected a bool to fill");
  int v = 0;
  if (device != peer && ebb__runtime_state.drv.DeviceCanAccessPeer) {
    CUresult r = ebb__runtime_state.drv.DeviceCanAccessPeer(&v, ebb__runtime_state.dev[device].cu, ebb__runtime_state.dev[peer].cu);
    if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_dev_can_access_peer", "cuDeviceCanAccessPeer");
  }
  *can = v != 0;
  return EBB_OK;
}

ebb_status ebb_dev_enable_peer(int device, int peer) {
  ebb_status st = ebb__check_dev_live("ebb_dev_enable_peer", device);
  if (!st) st = ebb__check_dev_live("ebb_dev_enable_peer (peer)", peer);
  if (st) return st;
  if (device == peer)
    return ebb__fail(EBB_EINVAL, "ebb_dev_enable_peer: device %d and peer %d are the same; expected two devices", device, peer);
  if (!ebb__runtime_state.drv.CtxEnablePeerAccess)
    return ebb__fail(EBB_ENOTSUP, "ebb_dev_enable_peer: the %s driver has no cuCtxEnablePeerAccess", ebb__runtime_state.info.name);
  st = ebb__dev_activate("ebb_dev_enable_peer", device);
  if (st) return st;
  CUresult r = ebb__runtime_state.drv.CtxEnablePeerAccess(ebb__runtime_state.dev[peer].ctx, 0);
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) return EBB_OK;
  return ebb__cu_fail(r, "ebb_dev_enable_peer", "cuCtxEnablePeerAccess");
}
