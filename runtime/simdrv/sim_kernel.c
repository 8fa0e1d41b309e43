/* sim_kernel.c: the emulated driver's kernels: the registry of CPU functions that
 * ebbsim_register_kernel fills, modules, and function handles.
 *
 * A module is a handle bound to the context that loaded it; its image is not read, since the
 * kernels of the emulated driver are the registered CPU functions. A function handle packs the
 * module's slot and generation with the kernel's registry index, so unloading the module makes
 * its functions invalid handles without any per-function storage.
 *
 * Threading: registration appends under kern_lock; registry entries never change or move once
 * published (the count is released after the entry is written), so the launch path reads them
 * without a lock. Modules live in a handle table (sim_core.c).
 */
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

#define SIM_KERN_CHUNK 256u
#define SIM_KERN_MAX_CHUNKS 256u /* 65536 kernels: the index fits the function handle's 16 bits */

struct sim_kernel {
  char *name;
  ebbsim_kernel_fn fn;
  size_t arg_bytes;
};

struct sim_module {
  struct sim_slot slot;
  struct sim_device *dev;
};

static pthread_mutex_t kern_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_kernel *kern_chunks[SIM_KERN_MAX_CHUNKS]; /* written under kern_lock */
static _Atomic uint32_t kern_count;
static struct sim_table module_table = SIM_TABLE_INIT(SIM_TAG_MODULE, struct sim_module);

static struct sim_kernel *kernel_at(uint32_t i) { return &kern_chunks[i / SIM_KERN_CHUNK][i % SIM_KERN_CHUNK]; }

/* Index of kernel `name`, or -1. Caller holds kern_lock. */
static long kernel_find(const char *name) {
  uint32_t n = atomic_load_explicit(&kern_count, memory_order_relaxed); /* we hold the writers' lock */
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(kernel_at(i)->name, name) == 0) return (long)i;
  return -1;
}

/* The extension (ebb_cuda.h): works before cuInit, so a library may register its kernels when
 * it is loaded. Registering a name again is fine with the same function and size. */
SIM_API CUresult ebbsim_register_kernel(const char *name, ebbsim_kernel_fn fn, size_t arg_bytes) {
  if (!name || !*name || !fn) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&kern_lock);
  long i = kernel_find(name);
  if (i >= 0) {
    const struct sim_kernel *k = kernel_at((uint32_t)i);
    if (k->fn != fn || k->arg_bytes != arg_bytes) r = CUDA_ERROR_INVALID_VALUE;
    goto out_unlock;
  }
  uint32_t n = atomic_load_explicit(&kern_count, memory_order_relaxed);
  if (n / SIM_KERN_CHUNK >= SIM_KERN_MAX_CHUNKS) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out_unlock;
  }
  if (!kern_chunks[n / SIM_KERN_CHUNK]) {
    kern_chunks[n / SIM_KERN_CHUNK] = calloc(SIM_KERN_CHUNK, sizeof(struct sim_kernel));
    if (!kern_chunks[n / SIM_KERN_CHUNK]) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      goto out_unlock;
    }
  }
  char *copy = strdup(name);
  if (!copy) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out_unlock;
  }
  struct sim_kernel *k = kernel_at(n);
  k->name = copy;
  k->fn = fn;
  k->arg_bytes = arg_bytes;
  /* release: pairs with the acquire in sim_kernel_resolve; an index below the count names a
   * fully written entry (and its chunk pointer) */
  atomic_store_explicit(&kern_count, n + 1, memory_order_release);
out_unlock:
  pthread_mutex_unlock(&kern_lock);
  return r;
}

SIM_API CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
  SIM_ENTER(cuModuleLoadData);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
  uint64_t h;
  struct sim_module *m = sim_table_alloc(&module_table, &h);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  if (m->slot.index > 0xFFFFu) { /* function handles carry 16 bits of module index */
    sim_table_kill(&m->slot, atomic_load_explicit(&m->slot.gen, memory_order_relaxed));
    sim_table_free(&module_table, &m->slot);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  m->dev = d; /* published to other threads with the handle itself */
  *module = (CUmodule)(uintptr_t)h;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
  SIM_ENTER(cuModuleUnload);
  uint32_t gen;
  struct sim_module *m = sim_table_get(&module_table, (uintptr_t)hmod, &gen);
  if (!m || !sim_table_kill(&m->slot, gen)) return CUDA_ERROR_INVALID_HANDLE;
  sim_table_free(&module_table, &m->slot);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  SIM_ENTER(cuModuleGetFunction);
  if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
  uint32_t gen;
  struct sim_module *m = sim_table_get(&module_table, (uintptr_t)hmod, &gen);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&kern_lock);
  long i = kernel_find(name);
  pthread_mutex_unlock(&kern_lock);
  if (i < 0) return CUDA_ERROR_NOT_FOUND;
  /* {tag, module generation, module index, kernel index} */
  uint64_t h = sim_handle(SIM_TAG_FUNCTION, gen, (m->slot.index << 16) | (uint32_t)i);
  *hfunc = (CUfunction)(uintptr_t)h;
  return CUDA_SUCCESS;
}

CUresult sim_kernel_resolve(CUfunction f, ebbsim_kernel_fn *fn, size_t *arg_bytes, struct sim_device **dev) {
  uint64_t h = (uintptr_t)f;
  if ((uint32_t)(h >> 56) != SIM_TAG_FUNCTION) return CUDA_ERROR_INVALID_HANDLE;
  uint32_t low = (uint32_t)h, kidx = low & 0xFFFFu;
  uint64_t mh = sim_handle(SIM_TAG_MODULE, (uint32_t)(h >> 32), low >> 16);
  struct sim_module *m = sim_table_get(&module_table, mh, NULL);
  if (!m) return CUDA_ERROR_INVALID_HANDLE; /* bogus, or its module was unloaded */
  /* acquire: pairs with the release in ebbsim_register_kernel */
  if (kidx >= atomic_load_explicit(&kern_count, memory_order_acquire)) return CUDA_ERROR_INVALID_HANDLE;
  const struct sim_kernel *k = kernel_at(kidx);
  *fn = k->fn;
  *arg_bytes = k->arg_bytes;
  *dev = m->dev;
  return CUDA_SUCCESS;
}
