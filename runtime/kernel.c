/* kernel.c: the kernel registry and launch.
 *
 * A kernel is declared once with its name, the size of its argument struct, its CPU function
 * (run by the emulated driver) and the name of its CUDA function (found in the module image that
 * ops/ hands over with ebb_kernel_set_image). The first launch on a device resolves the driver
 * function: on a driver with CPU kernels the CPU function is registered under the kernel's name
 * and found through a module, as CUDA finds a function in a fatbin. Later launches read the
 * cached function with one acquire load and go straight to cuLaunchKernel.
 *
 * Threading: declarations and first-launch resolution take the registry lock; the launch path
 * takes no lock. Kernel records sit in a fixed table that is never freed, so a handle stays a
 * valid pointer for the life of the process; it is usable until the last ebb_shutdown.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/trace.h"
#include "runtime_impl.h"

#define EBB_MAX_KERNELS 1024
#define EBB_KERNEL_NAME_MAX 96
#define EBB_KERNEL_ARG_MAX 4096
#define EBB_KERNEL_MAGIC 0x65626b6eu /* "ebkn" */

struct ebb_kernel {
  uint32_t magic;
  char name[EBB_KERNEL_NAME_MAX];
  char cuda_name[EBB_KERNEL_NAME_MAX];
  size_t arg_bytes;
  ebb_kernel_cpu_fn cpu_fn;
  bool sim_registered;                       /* registered with the loaded emulated driver */
  _Atomic(CUfunction) fn[EBB_MAX_DEVICES];   /* resolved per device; NULL until first launch */
};

static ebb_mutex ebb__kernels_lock = {PTHREAD_MUTEX_INITIALIZER, "kernels", EBB_RANK_KERNELS};
static struct ebb_kernel ebb__kernels[EBB_MAX_KERNELS];
static int ebb__nkernels;
static const void *ebb__image;            /* module image for GPU kernels (fatbin), or NULL */
static atomic_int ebb__check_launch = -1; /* EBB_CHECK_LAUNCH, read on first launch */

/* What cuModuleLoadData gets on a driver with CPU kernels when no image was set: the emulated
 * driver ignores the content and finds registered CPU functions by name. */
static const char ebb__cpu_image[] = "ebb-cpu-kernels";

ebb_status ebb_kernel_set_image(const void *image) {
  ebb_status st = ebb__check_init("ebb_kernel_set_image");
  if (st) return st;
  if (!image) return ebb__fail(EBB_EINVAL, "ebb_kernel_set_image: image is NULL; expected a fatbin or cubin image");
  ebb__mutex_lock(&ebb__kernels_lock);
  bool loaded = false;
  for (int d = 0; d < ebb__rt.ndev; d++) loaded |= ebb__rt.dev[d].module != NULL;
  if (!loaded) ebb__image = image;
  ebb__mutex_unlock(&ebb__kernels_lock);
  if (loaded)
    return ebb__fail(EBB_ESTATE, "ebb_kernel_set_image: kernels were already launched from the current image; set the image before the first launch");
  return EBB_OK;
}

static bool ebb__same_str(const char *a, const char *b) { return strcmp(a ? a : "", b ? b : "") == 0; }

ebb_status ebb_kernel_declare(const char *name, size_t arg_bytes, ebb_kernel_cpu_fn cpu_fn, const char *cuda_name,
                              const ebb_kernel_t **out) {
  ebb_status st = ebb__check_init("ebb_kernel_declare");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: out is NULL; expected a kernel handle to fill");
  if (!name || !*name || strlen(name) >= EBB_KERNEL_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: name is %s; expected 1..%d characters", !name ? "NULL" : !*name ? "empty" : "too long",
                     EBB_KERNEL_NAME_MAX - 1);
  if (arg_bytes == 0 || arg_bytes > EBB_KERNEL_ARG_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: kernel '%s' has arg_bytes %zu; expected 1..%d (one argument struct)", name,
                     arg_bytes, EBB_KERNEL_ARG_MAX);
  if (!cpu_fn && (!cuda_name || !*cuda_name))
    return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: kernel '%s' has neither a CPU function nor a CUDA function name", name);
  if (cuda_name && strlen(cuda_name) >= EBB_KERNEL_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: kernel '%s': CUDA name longer than %d characters", name, EBB_KERNEL_NAME_MAX - 1);
  ebb__mutex_lock(&ebb__kernels_lock);
  for (int i = 0; i < ebb__nkernels; i++) {
    struct ebb_kernel *k = &ebb__kernels[i];
    if (strcmp(k->name, name) != 0) continue;
    bool same = k->arg_bytes == arg_bytes && k->cpu_fn == cpu_fn && ebb__same_str(k->cuda_name, cuda_name);
    ebb__mutex_unlock(&ebb__kernels_lock);
    if (!same)
      return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: kernel '%s' was declared before with other parameters (arg_bytes %zu, now %zu)",
                       name, k->arg_bytes, arg_bytes);
    *out = k;
    return EBB_OK;
  }
  if (ebb__nkernels == EBB_MAX_KERNELS) {
    ebb__mutex_unlock(&ebb__kernels_lock);
    return ebb__fail(EBB_ELIMIT, "ebb_kernel_declare: %d kernels declared already (the maximum); '%s' not added", EBB_MAX_KERNELS, name);
  }
  struct ebb_kernel *k = &ebb__kernels[ebb__nkernels];
  memset(k->name, 0, sizeof k->name);
  snprintf(k->name, sizeof k->name, "%s", name);
  snprintf(k->cuda_name, sizeof k->cuda_name, "%s", cuda_name ? cuda_name : "");
  k->arg_bytes = arg_bytes;
  k->cpu_fn = cpu_fn;
  k->sim_registered = false;
  for (int d = 0; d < EBB_MAX_DEVICES; d++) atomic_store_explicit(&k->fn[d], NULL, memory_order_relaxed);
  k->magic = EBB_KERNEL_MAGIC;
  ebb__nkernels++;
  ebb__mutex_unlock(&ebb__kernels_lock);
  *out = k;
  return EBB_OK;
}

ebb_status ebb_kernel_find(const char *name, const ebb_kernel_t **out) {
  ebb_status st = ebb__check_init("ebb_kernel_find");
  if (st) return st;
  if (!name || !out) return ebb__fail(EBB_EINVAL, "ebb_kernel_find: name and out must be non-NULL");
  ebb__mutex_lock(&ebb__kernels_lock);
  for (int i = 0; i < ebb__nkernels; i++) {
    if (strcmp(ebb__kernels[i].name, name) == 0) {
      *out = &ebb__kernels[i];
      ebb__mutex_unlock(&ebb__kernels_lock);
      return EBB_OK;
    }
  }
  ebb__mutex_unlock(&ebb__kernels_lock);
  return ebb__fail(EBB_ENOTFOUND, "ebb_kernel_find: no kernel named '%s' is declared", name);
}

const char *ebb_kernel_name(const ebb_kernel_t *k) {
  return k && k->magic == EBB_KERNEL_MAGIC ? k->name : "(invalid kernel)";
}

/* Slow path of the first launch of `k` on `device`: load the device's module and find the
 * function. Runs under the registry lock. */
static ebb_status ebb__kernel_resolve(struct ebb_kernel *k, int device, CUfunction *out) {
  const ebb_drv *d = &ebb__rt.drv;
  ebb_device *dv = &ebb__rt.dev[device];
  const bool cpu = dv->caps.cpu_kernels;
  const char *fname = cpu ? k->name : k->cuda_name;
  if (cpu && !k->cpu_fn)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s' has no CPU function, and device %d runs kernels on the CPU", k->name, device);
  if (!cpu && !k->cuda_name[0])
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s' has no CUDA function for GPU device %d", k->name, device);
  if (!d->ModuleLoadData || !d->ModuleGetFunction || !d->LaunchKernel)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: the %s driver cannot load modules or launch kernels", ebb__rt.info.name);
  if (!cpu && !ebb__image)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s': no CUDA module image was built into this ebb (nvcc absent at build time, or no .cu kernels yet)", k->name);
  ebb_status st = ebb__dev_activate("ebb_kernel_launch", device);
  if (st) return st;
  if (cpu && !k->sim_registered) {
    CUresult r = d->RegisterKernel(k->name, k->cpu_fn, k->arg_bytes);
    if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "ebbsim_register_kernel");
    k->sim_registered = true;
  }
  if (!dv->module) {
    CUresult r = d->ModuleLoadData(&dv->module, cpu ? (const void *)ebb__cpu_image : ebb__image);
    if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "cuModuleLoadData");
  }
  CUresult r = d->ModuleGetFunction(out, dv->module, fname);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "cuModuleGetFunction");
  return EBB_OK;
}

/* Declared buffers must be memory `device` can reach: its own, pinned host, or a peer's. */
static ebb_status ebb__launch_check(const struct ebb_kernel *k, int device, const ebb_launch_cfg *cfg) {
  for (int pass = 0; pass < 2; pass++) {
    const ebb_buf *b = pass ? cfg->writes : cfg->reads;
    int n = pass ? cfg->nwrites : cfg->nreads;
    if (n > 0 && !b)
      return ebb__fail(EBB_EINVAL, "ebb_kernel_launch: kernel '%s': %d %s declared but the array is NULL", k->name, n, pass ? "writes" : "reads");
    for (int i = 0; i < n; i++) {
      ebb_ptr_info pi;
      ebb_status st = ebb_drv_ptr_info(b[i].ptr, &pi);
      if (st) return st;
      bool ok = pi.type == EBB_MEMTYPE_PINNED || (pi.type == EBB_MEMTYPE_DEVICE && (pi.device == device || ebb__rt.dev[device].caps.peer));
      if (!ok)
        return ebb__fail(EBB_EDEVICE, "ebb_kernel_launch: kernel '%s' on device %d %s buffer %d at %p (%zu bytes), which is %s", k->name, device,
                         pass ? "writes" : "reads", i, b[i].ptr, b[i].bytes,
                         pi.type == EBB_MEMTYPE_PAGEABLE ? "pageable host memory the device cannot reach" : "another device's memory without peer access");
    }
  }
  return EBB_OK;
}

ebb_status ebb_kernel_launch(const ebb_kernel_t *kc, int device, struct CUstream_st *stream, const void *args,
                             const ebb_launch_cfg *cfg) {
  ebb_status st = ebb__check_dev("ebb_kernel_launch", device);
  if (st) return st;
  if (EBB_UNLIKELY(!kc || kc->magic != EBB_KERNEL_MAGIC))
    return ebb__fail(EBB_EINVAL, "ebb_kernel_launch: kernel handle %p is %s; expected one from ebb_kernel_declare", (const void *)kc,
                     kc ? "not a kernel" : "NULL");
  if (EBB_UNLIKELY(!args)) return ebb__fail(EBB_EINVAL, "ebb_kernel_launch: kernel '%s': args is NULL; expected %zu bytes", kc->name, kc->arg_bytes);
  if (EBB_UNLIKELY(!stream)) return ebb__fail(EBB_EINVAL, "ebb_kernel_launch: kernel '%s': stream is NULL; expected a driver stream of device %d", kc->name, device);
  struct ebb_kernel *k = (struct ebb_kernel *)kc; /* the registry owns the record; launch updates its cache */
  /* acquire: pairs with the release store below, so the module and registration are visible. */
  CUfunction f = atomic_load_explicit(&k->fn[device], memory_order_acquire);
  if (EBB_UNLIKELY(!f)) {
    ebb__mutex_lock(&ebb__kernels_lock);
    f = atomic_load_explicit(&k->fn[device], memory_order_relaxed);
    if (!f) {
      st = ebb__kernel_resolve(k, device, &f);
      if (st == EBB_OK) atomic_store_explicit(&k->fn[device], f, memory_order_release);
    }
    ebb__mutex_unlock(&ebb__kernels_lock);
    if (st) return st;
  }
  int check = atomic_load_explicit(&ebb__check_launch, memory_order_relaxed);
  if (EBB_UNLIKELY(check < 0)) {
    const char *e = getenv("EBB_CHECK_LAUNCH");
    check = e && *e && strcmp(e, "0") != 0;
    atomic_store_explicit(&ebb__check_launch, check, memory_order_relaxed);
  }
  unsigned g[3] = {1, 1, 1}, b[3] = {1, 1, 1}, shm = 0;
  if (cfg) {
    for (int i = 0; i < 3; i++) {
      if (cfg->grid[i]) g[i] = cfg->grid[i];
      if (cfg->block[i]) b[i] = cfg->block[i];
    }
    shm = cfg->shared_bytes;
    if (check) {
      st = ebb__launch_check(k, device, cfg);
      if (st) return st;
    }
  }
  st = ebb__dev_activate("ebb_kernel_launch", device);
  if (st) return st;
  uint64_t t0 = EBB_TRACE_ON() ? ebb__now_ns() : 0;
  void *params[1] = {(void *)(uintptr_t)args};
  CUresult r = ebb__rt.drv.LaunchKernel(f, g[0], g[1], g[2], b[0], b[1], b[2], shm, stream, params, NULL);
  if (EBB_UNLIKELY(r != CUDA_SUCCESS)) return ebb__cu_fail(r, "ebb_kernel_launch", "cuLaunchKernel");
  if (EBB_TRACE_ON()) ebb_trace_span_add(k->name, device, (uint64_t)(uintptr_t)stream, t0, ebb__now_ns());
  return EBB_OK;
}

void ebb__kernels_fini(void) {
  ebb__mutex_lock(&ebb__kernels_lock);
  for (int d = 0; d < ebb__rt.ndev; d++) {
    ebb_device *dv = &ebb__rt.dev[d];
    if (dv->module && ebb__rt.drv.ModuleUnload && ebb__rt.drv.CtxSetCurrent(dv->ctx) == CUDA_SUCCESS)
      ebb__rt.drv.ModuleUnload(dv->module);
    dv->module = NULL;
  }
  for (int i = 0; i < ebb__nkernels; i++) ebb__kernels[i].magic = 0;
  ebb__nkernels = 0;
  ebb__image = NULL;
  atomic_store_explicit(&ebb__check_launch, -1, memory_order_relaxed);
  ebb__mutex_unlock(&ebb__kernels_lock);
}
