/* kernel.c: the kernel registry, its images, and launch.
 *
 * Images: each module registers its own module image (a fatbin; ops' is "ebb.ops") with
 * ebb_kernel_add_image; the runtime's own kernels live in "ebb.runtime". The
 * runtime loads an image on a device at the first launch of one of its kernels there, one driver
 * module per image and device, and knows no module above it.
 * A kernel is declared once against an image with its name, the size of its argument struct, its
 * CPU function (run by the emulated driver) and the name of its CUDA function in that image. The
 * first launch on a device resolves the driver function: on a driver with CPU kernels the CPU
 * function is registered under the kernel's name and found through a module, as CUDA finds a
 * function in a fatbin. Later launches read the cached function with one acquire load and go
 * straight to cuLaunchKernel.
 *
 * Threading: declarations, image registration and first-launch resolution take the registry
 * lock; the launch path takes no lock. Kernel and image records sit in fixed tables that are
 * never freed, so a handle stays a valid pointer for the life of the process; it is usable until
 * the last ebb_shutdown.
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

#define EBB_MAX_IMAGES 32
#define EBB_IMAGE_NAME_MAX 64
#define EBB_IMAGE_MAGIC 0x6562696du /* "ebim" */

struct ebb_kernel_image {
  uint32_t magic;
  char name[EBB_IMAGE_NAME_MAX];
  const void *image;                 /* fatbin or cubin; NULL: the module has no GPU code */
  CUmodule module[EBB_MAX_DEVICES];  /* loaded at the first launch of one of its kernels */
};

struct ebb_kernel {
  uint32_t magic;
  struct ebb_kernel_image *img;
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
static struct ebb_kernel_image ebb__images[EBB_MAX_IMAGES];
static int ebb__nimages;
/* Handles are pointers into these tables. Each session (ebb_init to the last ebb_shutdown) takes
 * its entries after the previous session's, wrapping around, so a handle from before a completed
 * shutdown points at a cleared entry (rejected as "not from this ebb_init") until the table's
 * size in entries has been added since, rather than at a new session's entry. Entry i of this
 * session: EBB__IMG(i) (0: the runtime's own image), EBB__KER(i). Registry lock held. */
static int ebb__images_base, ebb__kernels_base;
#define EBB__IMG(i) (&ebb__images[(ebb__images_base + (i)) % EBB_MAX_IMAGES])
#define EBB__KER(i) (&ebb__kernels[(ebb__kernels_base + (i)) % EBB_MAX_KERNELS])


/* What cuModuleLoadData gets on a driver with CPU kernels when no image was set: the emulated
 * driver ignores the content and finds registered CPU functions by name. */
static const char ebb__cpu_image[] = "ebb-cpu-kernels";

#ifdef EBB_HAVE_FATBIN
/* The runtime's own fatbin (runtime/cuda/builtin.cu, embedded by cmake/embed.cmake). */
extern const unsigned char ebb__fatbin_runtime[];
#define EBB_RUNTIME_IMAGE ((const void *)ebb__fatbin_runtime)
#else
#define EBB_RUNTIME_IMAGE NULL
#endif

/* Registry lock held. */
static ebb_status image_add_locked(const char *name, const void *image, struct ebb_kernel_image **out) {
  for (int i = 0; i < ebb__nimages; i++) {
    struct ebb_kernel_image *im = EBB__IMG(i);
    if (strcmp(im->name, name) != 0) continue;
    if (im->image != image)
      return ebb__fail(EBB_EINVAL, "ebb_kernel_add_image: an image named '%s' was added before with other contents (%p, now %p)", name,
                       im->image, image);
    *out = im;
    return EBB_OK;
  }
  if (ebb__nimages == EBB_MAX_IMAGES)
    return ebb__fail(EBB_ELIMIT, "ebb_kernel_add_image: %d images added already (the maximum); '%s' not added", EBB_MAX_IMAGES, name);
  struct ebb_kernel_image *im = EBB__IMG(ebb__nimages);
  ebb__nimages++;
  memset(im, 0, sizeof *im);
  snprintf(im->name, sizeof im->name, "%s", name);
  im->image = image;
  im->magic = EBB_IMAGE_MAGIC;
  *out = im;
  return EBB_OK;
}

ebb_status ebb_kernel_add_image(const char *name, const void *image, const ebb_kernel_image_t **out) {
  ebb_status st = ebb__check_init("ebb_kernel_add_image");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_kernel_add_image: out is NULL; expected an image handle to fill");
  if (!name || !*name || strlen(name) >= EBB_IMAGE_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "ebb_kernel_add_image: name is %s; expected 1..%d characters", !name ? "NULL" : !*name ? "empty" : "too long",
                     EBB_IMAGE_NAME_MAX - 1);
  struct ebb_kernel_image *im = NULL;
  ebb__mutex_lock(&ebb__kernels_lock);
  st = image_add_locked(name, image, &im);
  ebb__mutex_unlock(&ebb__kernels_lock);
  if (st) return st;
  *out = im;
  return EBB_OK;
}

const char *ebb_kernel_image_name(const ebb_kernel_image_t *img) {
  return img && img->magic == EBB_IMAGE_MAGIC ? img->name : "(invalid image)";
}

static bool same_str(const char *a, const char *b) { return strcmp(a ? a : "", b ? b : "") == 0; }

ebb_status ebb_kernel_declare(const char *name, size_t arg_bytes, ebb_kernel_cpu_fn cpu_fn, const char *cuda_name,
                              const ebb_kernel_t **out) {
  return ebb_kernel_declare_in(NULL, name, arg_bytes, cpu_fn, cuda_name, out);
}

ebb_status ebb_kernel_declare_in(const ebb_kernel_image_t *image, const char *name, size_t arg_bytes, ebb_kernel_cpu_fn cpu_fn,
                                 const char *cuda_name, const ebb_kernel_t **out) {
  ebb_status st = ebb__check_init("ebb_kernel_declare");
  if (st) return st;
  if (image && image->magic != EBB_IMAGE_MAGIC)
    return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: image %p is not an image from ebb_kernel_add_image of this ebb_init", (const void *)image);
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
  /* NULL: the runtime's own image, added by ebb_init (ebb__kernels_builtin_init). */
  struct ebb_kernel_image *img = image ? (struct ebb_kernel_image *)image : EBB__IMG(0);
  for (int i = 0; i < ebb__nkernels; i++) {
    struct ebb_kernel *k = EBB__KER(i);
    if (strcmp(k->name, name) != 0) continue;
    bool same = k->arg_bytes == arg_bytes && k->cpu_fn == cpu_fn && same_str(k->cuda_name, cuda_name) && k->img == img;
    ebb__mutex_unlock(&ebb__kernels_lock);
    if (!same)
      return ebb__fail(EBB_EINVAL, "ebb_kernel_declare: kernel '%s' was declared before with other parameters (arg_bytes %zu, now %zu; image '%s', now '%s')",
                       name, k->arg_bytes, arg_bytes, k->img->name, img->name);
    *out = k;
    return EBB_OK;
  }
  if (ebb__nkernels == EBB_MAX_KERNELS) {
    ebb__mutex_unlock(&ebb__kernels_lock);
    return ebb__fail(EBB_ELIMIT, "ebb_kernel_declare: %d kernels declared already (the maximum); '%s' not added", EBB_MAX_KERNELS, name);
  }
  struct ebb_kernel *k = EBB__KER(ebb__nkernels);
  memset(k->name, 0, sizeof k->name);
  snprintf(k->name, sizeof k->name, "%s", name);
  snprintf(k->cuda_name, sizeof k->cuda_name, "%s", cuda_name ? cuda_name : "");
  k->arg_bytes = arg_bytes;
  k->cpu_fn = cpu_fn;
  k->img = img;
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
    if (strcmp(EBB__KER(i)->name, name) == 0) {
      *out = EBB__KER(i);
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

ebb_status ebb__kernel_cpu_fn(const char *fn, const ebb_kernel_t *k, ebb_kernel_cpu_fn *out) {
  if (EBB_UNLIKELY(!k || k->magic != EBB_KERNEL_MAGIC))
    return ebb__fail(EBB_EINVAL, "%s: kernel handle %p is %s; expected one from ebb_kernel_declare_in of this ebb_init", fn, (const void *)k,
                     k ? "not a kernel (or from before the last ebb_shutdown)" : "NULL");
  *out = k->cpu_fn;
  return EBB_OK;
}

/* Slow path of the first launch of `k` on `device`: load the device's module and find the
 * function. Runs under the registry lock. */
static ebb_status kernel_resolve(struct ebb_kernel *k, int device, CUfunction *out) {
  const ebb_drv *d = &ebb__runtime_state.drv;
  ebb_device *dv = &ebb__runtime_state.dev[device];
  const bool cpu = dv->caps.cpu_kernels;
  const char *fname = cpu ? k->name : k->cuda_name;
  if (cpu && !k->cpu_fn)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s' has no CPU function, and device %d runs kernels on the CPU", k->name, device);
  if (!cpu && !k->cuda_name[0])
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s' has no CUDA function for GPU device %d", k->name, device);
  if (!d->ModuleLoadData || !d->ModuleGetFunction || !d->LaunchKernel)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: the %s driver cannot load modules or launch kernels", ebb__runtime_state.info.name);
  struct ebb_kernel_image *img = k->img;
  if (!cpu && !img->image)
    return ebb__fail(EBB_ENOTSUP, "ebb_kernel_launch: kernel '%s': its image '%s' has no CUDA code (built without nvcc, or no .cu kernels yet)", k->name,
                     img->name);
  ebb_status st = ebb__dev_activate("ebb_kernel_launch", device);
  if (st) return st;
  if (cpu && !k->sim_registered) {
    CUresult r = d->RegisterKernel(k->name, k->cpu_fn, k->arg_bytes);
    if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "ebbsim_register_kernel");
    k->sim_registered = true;
  }
  if (!img->module[device]) {
    CUresult r = d->ModuleLoadData(&img->module[device], cpu ? (const void *)ebb__cpu_image : img->image);
    if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "cuModuleLoadData");
  }
  CUresult r = d->ModuleGetFunction(out, img->module[device], fname);
  if (r != CUDA_SUCCESS) return ebb__cu_fail(r, "ebb_kernel_launch", "cuModuleGetFunction");
  return EBB_OK;
}

/* Declared buffers must be memory `device` can reach: its own, pinned host, or a peer's. */
static ebb_status launch_check(const struct ebb_kernel *k, int device, const ebb_launch_cfg *cfg) {
  for (int pass = 0; pass < 2; pass++) {
    const ebb_buf *b = pass ? cfg->writes : cfg->reads;
    int n = pass ? cfg->nwrites : cfg->nreads;
    if (n > 0 && !b)
      return ebb__fail(EBB_EINVAL, "ebb_kernel_launch: kernel '%s': %d %s declared but the array is NULL", k->name, n, pass ? "writes" : "reads");
    for (int i = 0; i < n; i++) {
      ebb_ptr_info pi;
      ebb_status st = ebb__drv_ptr_info(device, b[i].ptr, &pi);
      if (st) return st;
      bool ok = pi.type == EBB_MEMTYPE_PINNED || (pi.type == EBB_MEMTYPE_DEVICE && (pi.device == device || ebb__runtime_state.dev[device].caps.peer));
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
  ebb_status st = ebb__check_dev_live("ebb_kernel_launch", device);
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
      st = kernel_resolve(k, device, &f);
      if (st == EBB_OK) atomic_store_explicit(&k->fn[device], f, memory_order_release);
    }
    ebb__mutex_unlock(&ebb__kernels_lock);
    if (st) return st;
  }
  const bool check = ebb__rt_conf.check_launch; /* EBB_CHECK_LAUNCH, fixed from ebb_init to the last ebb_shutdown */
  unsigned g[3] = {1, 1, 1}, b[3] = {1, 1, 1}, shm = 0;
  if (cfg) {
    for (int i = 0; i < 3; i++) {
      if (cfg->grid[i]) g[i] = cfg->grid[i];
      if (cfg->block[i]) b[i] = cfg->block[i];
    }
    shm = cfg->shared_bytes;
    if (check) {
      st = launch_check(k, device, cfg);
      if (st) return st;
    }
  }
  st = ebb__dev_activate("ebb_kernel_launch", device);
  if (st) return st;
  uint64_t t0 = EBB_TRACE_ON() ? ebb__now_ns() : 0;
  void *params[1] = {(void *)(uintptr_t)args};
  CUresult r = ebb__runtime_state.drv.LaunchKernel(f, g[0], g[1], g[2], b[0], b[1], b[2], shm, stream, params, NULL);
  if (EBB_UNLIKELY(r != CUDA_SUCCESS)) return ebb__cu_fail(r, "ebb_kernel_launch", "cuLaunchKernel");
  if (EBB_TRACE_ON()) ebb_trace_span_add(k->name, device, (uint64_t)(uintptr_t)stream, t0, ebb__now_ns());
  return EBB_OK;
}

/* Called by ebb_init: the runtime's own image, always the first. */
ebb_status ebb__kernels_add_runtime_image(void) {
  struct ebb_kernel_image *im = NULL;
  ebb__mutex_lock(&ebb__kernels_lock);
  ebb_status st = image_add_locked("ebb.runtime", EBB_RUNTIME_IMAGE, &im);
  ebb__mutex_unlock(&ebb__kernels_lock);
  return st;
}

void ebb__kernels_fini(void) {
  ebb__mutex_lock(&ebb__kernels_lock);
  for (int i = 0; i < ebb__nimages; i++) {
    struct ebb_kernel_image *im = EBB__IMG(i);
    for (int d = 0; d < ebb__runtime_state.ndev; d++) {
      ebb_device *dv = &ebb__runtime_state.dev[d];
      /* Best effort at the last shutdown: a module that cannot be unloaded goes with its
       * context, released next (ebb__devices_fini). */
      if (im->module[d] && ebb__runtime_state.drv.ModuleUnload && ebb__runtime_state.drv.CtxSetCurrent(dv->ctx) == CUDA_SUCCESS)
        (void)ebb__runtime_state.drv.ModuleUnload(im->module[d]);
      im->module[d] = NULL;
    }
    im->magic = 0;
  }
  ebb__images_base = (ebb__images_base + ebb__nimages) % EBB_MAX_IMAGES;
  ebb__nimages = 0;
  for (int i = 0; i < ebb__nkernels; i++) EBB__KER(i)->magic = 0;
  ebb__kernels_base = (ebb__kernels_base + ebb__nkernels) % EBB_MAX_KERNELS;
  ebb__nkernels = 0;
  ebb__mutex_unlock(&ebb__kernels_lock);
}
