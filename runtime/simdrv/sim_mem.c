/* sim_mem.c: emulated device memory, pinned and registered host memory, VMM and pointer
 * attributes.
 *
 * Device memory is host memory: cuMemAlloc maps anonymous pages (page aligned, so 256-byte
 * aligned as CUDA promises) and the CUdeviceptr is their address. Memory is committed when it is
 * allocated, as a GPU's is (EBB_SIM_COMMIT, default 1): cuMemAlloc and cuMemHostAlloc fault
 * every page in, cuMemCreate allocates its chunk's pages and cuMemSetAccess fills the page
 * tables, so allocation pays and a first copy costs what any copy costs. Every range the driver knows
 * (device allocations, VMM mappings, cuMemHostAlloc blocks, registered host ranges) sits in one
 * registry, a sorted array searched by binary search, so cuPointerGetAttribute and the copy path
 * find any interior pointer in O(log n). VMM physical chunks are memfd files, so a chunk can be
 * mapped at any reserved address and keeps its contents across unmap and remap.
 *
 * Threading: the registry is under a rwlock (readers: copies, memset, pointer attributes;
 * writers: alloc, free, map, unmap, register). VMM reservations and allocation objects are under
 * vmm_lock, taken before the registry lock. Capacity is charged with sim_charge before memory is
 * mapped and given back after it is unmapped. Frees and unmaps first drain queued work
 * (sim_exec_drain_all) so no engine thread touches unmapped memory, as cuMemFree synchronises.
 */
#define _GNU_SOURCE /* memfd_create, fallocate: VMM chunks are memfd files mapped MAP_SHARED */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_internal.h"

struct sim_vmm_alloc {
  struct sim_slot slot;
  int fd;
  size_t size;
  struct sim_device *dev;
  int maps;        /* vmm_lock: live mappings of this chunk */
  bool released;   /* vmm_lock: cuMemRelease called; destroyed when maps drops to 0 */
};

struct sim_range {
  uintptr_t base;
  size_t size;
  int kind;                       /* enum sim_mem_kind */
  int ordinal;                    /* owning device (for host ranges: the allocating context's) */
  bool accessible;                /* VMM: cuMemSetAccess granted read or write */
  size_t charged;                 /* SIM_MEM_DEVICE: bytes charged against capacity */
  size_t map_len;                 /* bytes mapped for the range (page rounded) */
  struct sim_vmm_alloc *alloc;    /* SIM_MEM_VMM */
};

static struct {
  pthread_rwlock_t lock;
  struct sim_range *v;
  size_t n, cap;
} reg = {.lock = PTHREAD_RWLOCK_INITIALIZER};

struct sim_reservation {
  uintptr_t base;
  size_t size;
};
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_reservation *resv;   /* vmm_lock */
static size_t nresv, capresv;          /* vmm_lock */
static struct sim_table vmm_table = SIM_TABLE_INIT(SIM_TAG_VMM, struct sim_vmm_alloc);

static size_t page_size(void) {
  static _Atomic size_t cached; /* relaxed: any thread computes the same value */
  size_t p = atomic_load_explicit(&cached, memory_order_relaxed);
  if (!p) {
    long s = sysconf(_SC_PAGESIZE);
    p = s > 0 ? (size_t)s : 4096;
    atomic_store_explicit(&cached, p, memory_order_relaxed);
  }
  return p;
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Linux 5.14; older C libraries lack the names. */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

enum commit_how {
  COMMIT_FRESH,  /* new anonymous pages, all zero: faulted in writable */
  COMMIT_WRITE,  /* pages that may hold data, mapped read-write: page tables filled for writing */
  COMMIT_READ,   /* the same, mapped read-only */
};

/* Faults [p, p+len) in now, so first use takes no page fault, as on a GPU where allocation
 * returns memory that exists. False when the host has no memory for it. Kernels before 5.14 lack
 * MADV_POPULATE_*: pages are then touched one by one, a write of the zero they hold where fresh
 * (a read would only map the shared zero page), else a read (which leaves a write to take a
 * cheap write-protect fault; the memory itself already exists). */
static bool commit_pages(void *p, size_t len, enum commit_how how) {
  if (madvise(p, len, how == COMMIT_READ ? MADV_POPULATE_READ : MADV_POPULATE_WRITE) == 0) return true;
  if (errno != EINVAL) return false; /* ENOMEM, or EFAULT where a page could not be provided */
  size_t step = page_size();
  if (how == COMMIT_FRESH) {
    for (size_t off = 0; off < len; off += step) ((volatile unsigned char *)p)[off] = 0;
  } else {
    for (size_t off = 0; off < len; off += step) (void)((volatile const unsigned char *)p)[off];
  }
  return true;
}

/* ---------------------------------------------------------------- registry */

/* Index of the last range with base <= p, or -1. Caller holds reg.lock. */
static long reg_find(uintptr_t p) {
  size_t lo = 0, hi = reg.n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (reg.v[mid].base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return (long)lo - 1;
}

/* Index of the range containing p, or -1. Caller holds reg.lock. */
static long reg_lookup(uintptr_t p) {
  long i = reg_find(p);
  if (i < 0 || p - reg.v[i].base >= reg.v[i].size) return -1;
  return i;
}

/* Inserts r unless it overlaps a range already there. Caller holds reg.lock for writing.
 * Returns CUDA_ERROR_ALREADY_MAPPED on overlap, CUDA_ERROR_OUT_OF_MEMORY when growing fails. */
static CUresult reg_insert_locked(const struct sim_range *r) {
  long i = reg_find(r->base);
  if (i >= 0 && reg.v[i].base + reg.v[i].size > r->base) return CUDA_ERROR_ALREADY_MAPPED;
  if ((size_t)(i + 1) < reg.n && reg.v[i + 1].base < r->base + r->size) return CUDA_ERROR_ALREADY_MAPPED;
  if (reg.n == reg.cap) {
    size_t cap = reg.cap ? reg.cap * 2 : 64;
    struct sim_range *v = realloc(reg.v, cap * sizeof *v);
    if (!v) return CUDA_ERROR_OUT_OF_MEMORY;
    reg.v = v;
    reg.cap = cap;
  }
  size_t at = (size_t)(i + 1);
  memmove(&reg.v[at + 1], &reg.v[at], (reg.n - at) * sizeof *reg.v);
  reg.v[at] = *r;
  reg.n++;
  return CUDA_SUCCESS;
}

static CUresult reg_insert(const struct sim_range *r) {
  pthread_rwlock_wrlock(&reg.lock);
  CUresult res = reg_insert_locked(r);
  pthread_rwlock_unlock(&reg.lock);
  return res;
}

static void reg_remove_at(size_t i) {
  memmove(&reg.v[i], &reg.v[i + 1], (reg.n - i - 1) * sizeof *reg.v);
  reg.n--;
}

/* Removes the range that starts exactly at `base` and has kind `kind`; its record in *out. */
static bool reg_take(uintptr_t base, int kind, struct sim_range *out) {
  bool found = false;
  pthread_rwlock_wrlock(&reg.lock);
  long i = reg_find(base);
  if (i >= 0 && reg.v[i].base == base && reg.v[i].kind == kind) {
    *out = reg.v[i];
    reg_remove_at((size_t)i);
    found = true;
  }
  pthread_rwlock_unlock(&reg.lock);
  return found;
}

CUresult sim_mem_span(uintptr_t p, size_t n, struct sim_ptr *out) {
  if (n && p + n < p) return CUDA_ERROR_INVALID_VALUE; /* wraps around */
  CUresult r = CUDA_SUCCESS;
  pthread_rwlock_rdlock(&reg.lock);
  long i = reg_lookup(p);
  if (i < 0) {
    out->kind = SIM_MEM_NONE;
    out->ordinal = -1;
    goto out_unlock;
  }
  out->kind = reg.v[i].kind;
  out->ordinal = reg.v[i].ordinal;
  /* The whole span must be ours: one range, or VMM mappings of one device laid end to end (an
   * expandable segment grows by mapping granules next to each other). */
  for (size_t j = (size_t)i;; j++) {
    const struct sim_range *cur = &reg.v[j];
    if (cur->kind == SIM_MEM_VMM && !cur->accessible) {
      r = CUDA_ERROR_INVALID_VALUE;
      break;
    }
    uintptr_t end = cur->base + cur->size;
    if (p + n <= end) break;
    if (j + 1 >= reg.n || reg.v[j + 1].base != end || reg.v[j + 1].kind != cur->kind ||
        cur->kind != SIM_MEM_VMM || reg.v[j + 1].ordinal != cur->ordinal) {
      r = CUDA_ERROR_INVALID_VALUE;
      break;
    }
  }
out_unlock:
  pthread_rwlock_unlock(&reg.lock);
  return r;
}

/* ---------------------------------------------------------------- device memory */

SIM_API CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  SIM_ENTER(cuMemAlloc);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  if (!dptr || bytesize == 0 || bytesize > SIZE_MAX / 2) return CUDA_ERROR_INVALID_VALUE;
  size_t charged = round_up(bytesize, SIM_ALIGN);
  if (!sim_charge(d, charged)) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t len = round_up(bytesize, page_size());
  /* MAP_NORESERVE: like a GPU's memory, capacity is enforced by the charge above, not by the
   * host's overcommit policy. The charge comes first, so a request past capacity fails before
   * any page is committed. */
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) goto fail_uncharge;
  if (sim.commit && !commit_pages(p, len, COMMIT_FRESH)) goto fail_unmap;
  struct sim_range r = {.base = (uintptr_t)p, .size = bytesize, .kind = SIM_MEM_DEVICE,
                        .ordinal = d->ordinal, .charged = charged, .map_len = len};
  if (reg_insert(&r) != CUDA_SUCCESS) goto fail_unmap;
  *dptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
fail_unmap:
  munmap(p, len);
fail_uncharge:
  sim_uncharge(d, charged);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_API CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
  SIM_ENTER(cuMemFree);
  if (!dptr) return CUDA_SUCCESS; /* free(NULL), as libcuda */
  struct sim_range r;
  if (!reg_take((uintptr_t)dptr, SIM_MEM_DEVICE, &r)) return CUDA_ERROR_INVALID_VALUE;
  sim_exec_drain_all(); /* queued copies or kernels may still use it */
  munmap((void *)r.base, r.map_len);
  sim_uncharge(&sim.dev[r.ordinal], r.charged);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total) {
  SIM_ENTER(cuMemGetInfo);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
  size_t used = atomic_load_explicit(&d->used, memory_order_relaxed); /* a snapshot, as in CUDA */
  *free = used < d->capacity ? d->capacity - used : 0;
  *total = d->capacity;
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- host memory */

SIM_API CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
  SIM_ENTER(cuMemHostAlloc);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  const unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if (!pp || bytesize == 0 || bytesize > SIZE_MAX / 2 || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
  size_t len = round_up(bytesize, page_size());
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  /* Committed whether or not it can be locked (mlock would fault the pages in too, but only
   * where RLIMIT_MEMLOCK permits). */
  if (sim.commit && !commit_pages(p, len, COMMIT_FRESH)) {
    munmap(p, len);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  /* Page-locked where permitted (RLIMIT_MEMLOCK), else plain: the failure is ignored. */
  (void)mlock(p, len);
  struct sim_range r = {.base = (uintptr_t)p, .size = bytesize, .kind = SIM_MEM_HOST_ALLOC,
                        .ordinal = d->ordinal, .map_len = len};
  if (reg_insert(&r) != CUDA_SUCCESS) {
    munmap(p, len);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *pp = p;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemFreeHost(void *p) {
  SIM_ENTER(cuMemFreeHost);
  if (!p) return CUDA_SUCCESS; /* free(NULL), as libcuda */
  struct sim_range r;
  if (!reg_take((uintptr_t)p, SIM_MEM_HOST_ALLOC, &r)) return CUDA_ERROR_INVALID_VALUE;
  sim_exec_drain_all();
  munmap(p, r.map_len); /* also unlocks */
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
  SIM_ENTER(cuMemHostRegister);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  /* PORTABLE, DEVICEMAP, IOMEMORY (0x04) and READ_ONLY (0x08) are CUDA's flags */
  if (!p || bytesize == 0 || (Flags & ~0x0Fu) || (uintptr_t)p + bytesize < (uintptr_t)p)
    return CUDA_ERROR_INVALID_VALUE;
  struct sim_range r = {.base = (uintptr_t)p, .size = bytesize, .kind = SIM_MEM_HOST_REG, .ordinal = d->ordinal};
  CUresult res = reg_insert(&r);
  if (res == CUDA_ERROR_ALREADY_MAPPED) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  if (res != CUDA_SUCCESS) return res;
  /* Lock the whole pages where permitted; ignored when RLIMIT_MEMLOCK says no. */
  uintptr_t first = (uintptr_t)p & ~(uintptr_t)(page_size() - 1);
  (void)mlock((void *)first, round_up((uintptr_t)p + bytesize - first, page_size()));
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemHostUnregister(void *p) {
  SIM_ENTER(cuMemHostUnregister);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  struct sim_range r;
  if (!reg_take((uintptr_t)p, SIM_MEM_HOST_REG, &r)) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  sim_exec_drain_all();
  uintptr_t first = r.base & ~(uintptr_t)(page_size() - 1);
  (void)munlock((void *)first, round_up(r.base + r.size - first, page_size()));
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- pointer attributes */

SIM_API CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  SIM_ENTER(cuPointerGetAttribute);
  if (!data || !ptr) return CUDA_ERROR_INVALID_VALUE;
  struct sim_range r;
  pthread_rwlock_rdlock(&reg.lock);
  long i = reg_lookup((uintptr_t)ptr);
  if (i >= 0) r = reg.v[i];
  pthread_rwlock_unlock(&reg.lock);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE; /* pageable or unknown memory, as CUDA */
  bool device = sim_is_device_mem(r.kind);
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      *(CUcontext *)data = sim_ctx_handle(&sim.dev[r.ordinal]);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *(unsigned int *)data = device ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: /* unified addressing: the same address */
      *(CUdeviceptr *)data = ptr;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (device) return CUDA_ERROR_INVALID_VALUE;
      *(void **)data = (void *)(uintptr_t)ptr;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *(int *)data = 0;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *(int *)data = r.ordinal;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *(CUdeviceptr *)data = (CUdeviceptr)r.base;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *(size_t *)data = r.size;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      *(int *)data = 1;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

/* ---------------------------------------------------------------- VMM */

/* The device a CUmemLocation names, or NULL. */
static struct sim_device *location_device(const CUmemLocation *loc) {
  if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return NULL;
  return sim_device_get(loc->id);
}

SIM_API CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                      CUmemAllocationGranularity_flags option) {
  SIM_ENTER(cuMemGetAllocationGranularity);
  if (!sim.vmm) return CUDA_ERROR_NOT_SUPPORTED; /* EBB_SIM_VMM=0: a device without VMM */
  if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
  if (!location_device(&prop->location)) return CUDA_ERROR_INVALID_DEVICE;
  *granularity = SIM_GRANULE;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                            unsigned long long flags) {
  SIM_ENTER(cuMemAddressReserve);
  if (!sim.vmm) return CUDA_ERROR_NOT_SUPPORTED; /* EBB_SIM_VMM=0: a device without VMM */
  (void)addr; /* a hint in CUDA too; the kernel picks the address */
  if (!ptr || size == 0 || size % SIM_GRANULE || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment & (alignment - 1)) return CUDA_ERROR_INVALID_VALUE;
  if (alignment < SIM_GRANULE) alignment = SIM_GRANULE;
  if (size > SIZE_MAX / 2 || alignment > SIZE_MAX / 4) return CUDA_ERROR_INVALID_VALUE;
  /* Over-reserve by `alignment`, then trim both ends, to get an aligned PROT_NONE range. */
  size_t len = size + alignment;
  char *raw = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t base = round_up((uintptr_t)raw, alignment);
  size_t head = base - (uintptr_t)raw, tail = len - head - size;
  if (head) munmap(raw, head);
  if (tail) munmap((char *)(base + size), tail);
  pthread_mutex_lock(&vmm_lock);
  if (nresv == capresv) {
    size_t cap = capresv ? capresv * 2 : 16;
    struct sim_reservation *v = realloc(resv, cap * sizeof *v);
    if (!v) {
      pthread_mutex_unlock(&vmm_lock);
      munmap((void *)base, size);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    resv = v;
    capresv = cap;
  }
  resv[nresv++] = (struct sim_reservation){base, size};
  pthread_mutex_unlock(&vmm_lock);
  *ptr = (CUdeviceptr)base;
  return CUDA_SUCCESS;
}

/* Index of the reservation holding [p, p+n), or -1. Caller holds vmm_lock. */
static long resv_find(uintptr_t p, size_t n) {
  for (size_t i = 0; i < nresv; i++)
    if (p >= resv[i].base && n <= resv[i].size && p - resv[i].base <= resv[i].size - n) return (long)i;
  return -1;
}

SIM_API CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  SIM_ENTER(cuMemAddressFree);
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&vmm_lock);
  long i = resv_find((uintptr_t)ptr, size);
  if (!ptr || i < 0 || resv[i].base != (uintptr_t)ptr || resv[i].size != size) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out_unlock;
  }
  /* Mappings must be gone first: freeing the address range under them would orphan chunks. */
  pthread_rwlock_rdlock(&reg.lock);
  long j = reg_find((uintptr_t)ptr + size - 1);
  bool mapped = j >= 0 && reg.v[j].base + reg.v[j].size > (uintptr_t)ptr;
  pthread_rwlock_unlock(&reg.lock);
  if (mapped) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out_unlock;
  }
  munmap((void *)(uintptr_t)ptr, size);
  resv[i] = resv[--nresv];
out_unlock:
  pthread_mutex_unlock(&vmm_lock);
  return r;
}

SIM_API CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
  SIM_ENTER(cuMemCreate);
  if (!sim.vmm) return CUDA_ERROR_NOT_SUPPORTED; /* EBB_SIM_VMM=0: a device without VMM */
  if (!handle || !prop || size == 0 || size % SIM_GRANULE || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  struct sim_device *d = location_device(&prop->location);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  if (!sim_charge(d, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = memfd_create("ebb-simdrv-vmm", MFD_CLOEXEC);
  if (fd < 0) goto fail_uncharge;
  if (ftruncate(fd, (off_t)size) != 0) goto fail_close;
  /* The chunk's pages exist from now on (ENOSPC or ENOMEM when the host has none to give);
   * cuMemSetAccess fills the page tables of its mappings. */
  if (sim.commit && fallocate(fd, 0, 0, (off_t)size) != 0) goto fail_close;
  uint64_t h;
  struct sim_vmm_alloc *a = sim_table_alloc(&vmm_table, &h);
  if (!a) goto fail_close;
  pthread_mutex_lock(&vmm_lock);
  a->fd = fd;
  a->size = size;
  a->dev = d;
  a->maps = 0;
  a->released = false;
  pthread_mutex_unlock(&vmm_lock);
  *handle = h;
  return CUDA_SUCCESS;
fail_close:
  close(fd);
fail_uncharge:
  sim_uncharge(d, size);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Destroys a released chunk with no mappings left. Caller holds vmm_lock. */
static void vmm_alloc_destroy(struct sim_vmm_alloc *a) {
  close(a->fd);
  sim_uncharge(a->dev, a->size);
  a->fd = -1;
  sim_table_free(&vmm_table, &a->slot);
}

SIM_API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  SIM_ENTER(cuMemRelease);
  uint32_t gen;
  pthread_mutex_lock(&vmm_lock);
  struct sim_vmm_alloc *a = sim_table_get(&vmm_table, handle, &gen);
  if (!a || !sim_table_kill(&a->slot, gen)) {
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  /* The handle is dead at once; the memory lives until its last mapping goes, as in CUDA. */
  a->released = true;
  if (a->maps == 0) vmm_alloc_destroy(a);
  pthread_mutex_unlock(&vmm_lock);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                 unsigned long long flags) {
  SIM_ENTER(cuMemMap);
  if (!ptr || size == 0 || size % SIM_GRANULE || offset % SIM_GRANULE || flags != 0 || ptr % SIM_GRANULE)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&vmm_lock);
  struct sim_vmm_alloc *a = sim_table_get(&vmm_table, handle, NULL);
  if (!a) {
    r = CUDA_ERROR_INVALID_HANDLE;
    goto out_unlock;
  }
  if (offset > a->size || size > a->size - offset || resv_find((uintptr_t)ptr, size) < 0) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out_unlock;
  }
  struct sim_range rg = {.base = (uintptr_t)ptr, .size = size, .kind = SIM_MEM_VMM, .ordinal = a->dev->ordinal,
                         .map_len = size, .alloc = a};
  pthread_rwlock_wrlock(&reg.lock);
  /* Over an existing mapping the real driver answers CUDA_ERROR_INVALID_VALUE (CUDA 13 on an H100;
   * cuda.h lists no ALREADY_MAPPED among cuMemMap's results), so the emulated one does too. */
  r = reg_insert_locked(&rg);
  if (r == CUDA_ERROR_ALREADY_MAPPED) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    /* PROT_NONE until cuMemSetAccess, as a fresh CUDA mapping is inaccessible. */
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)offset);
    if (p == MAP_FAILED) {
      reg_remove_at((size_t)reg_lookup((uintptr_t)ptr));
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      a->maps++;
    }
  }
  pthread_rwlock_unlock(&reg.lock);
out_unlock:
  pthread_mutex_unlock(&vmm_lock);
  return r;
}

/* True when [p, p+n) is covered by VMM mappings laid end to end. Caller holds reg.lock. When
 * `exact`, the span must also start and end on mapping boundaries. Index of the first in *first. */
static bool vmm_covered(uintptr_t p, size_t n, bool exact, size_t *first) {
  long i = reg_lookup(p);
  if (i < 0 || reg.v[i].kind != SIM_MEM_VMM || (exact && reg.v[i].base != p)) return false;
  *first = (size_t)i;
  uintptr_t end = p + n;
  for (size_t j = (size_t)i; j < reg.n && reg.v[j].kind == SIM_MEM_VMM; j++) {
    uintptr_t rend = reg.v[j].base + reg.v[j].size;
    if (j > (size_t)i && reg.v[j].base != reg.v[j - 1].base + reg.v[j - 1].size) return false;
    if (rend >= end) return !exact || rend == end;
  }
  return false;
}

SIM_API CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  SIM_ENTER(cuMemSetAccess);
  if (!ptr || size == 0 || !desc || count == 0 || ptr + size < ptr) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  bool any = false;
  for (size_t k = 0; k < count; k++) {
    if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!location_device(&desc[k].location)) return CUDA_ERROR_INVALID_DEVICE;
    switch (desc[k].flags) {
      case CU_MEM_ACCESS_FLAGS_PROT_NONE: break;
      case CU_MEM_ACCESS_FLAGS_PROT_READ: prot |= PROT_READ; any = true; break;
      case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot |= PROT_READ | PROT_WRITE; any = true; break;
      default: return CUDA_ERROR_INVALID_VALUE;
    }
  }
  /* One address space serves every device, so the granted access is the union of the list. */
  CUresult r = CUDA_SUCCESS;
  size_t first;
  pthread_rwlock_wrlock(&reg.lock);
  if (!vmm_covered((uintptr_t)ptr, size, false, &first)) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (mprotect((void *)(uintptr_t)ptr, size, prot) != 0) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    for (size_t j = first; j < reg.n && reg.v[j].base < (uintptr_t)ptr + size; j++) reg.v[j].accessible = any;
  }
  pthread_rwlock_unlock(&reg.lock);
  /* A GPU's mapping is in place once access is granted; here the first access would fault each
   * page in: fill the page tables now, outside the registry lock so copies are not held up. The
   * pages exist already (cuMemCreate), so a failure (an unmap racing this call) costs only
   * faults later. */
  if (r == CUDA_SUCCESS && sim.commit && any)
    (void)commit_pages((void *)(uintptr_t)ptr, size, (prot & PROT_WRITE) ? COMMIT_WRITE : COMMIT_READ);
  return r;
}

SIM_API CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  SIM_ENTER(cuMemUnmap);
  if (!ptr || size == 0 || ptr + size < ptr) return CUDA_ERROR_INVALID_VALUE;
  size_t first;
  pthread_mutex_lock(&vmm_lock);
  pthread_rwlock_rdlock(&reg.lock);
  bool ok = vmm_covered((uintptr_t)ptr, size, true, &first);
  pthread_rwlock_unlock(&reg.lock);
  if (!ok) {
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_ERROR_INVALID_VALUE;
  }
  sim_exec_drain_all(); /* no queued copy or kernel may touch the range once it is gone */
  uintptr_t cur = (uintptr_t)ptr, end = (uintptr_t)ptr + size;
  while (cur < end) {
    struct sim_range r;
    reg_take(cur, SIM_MEM_VMM, &r); /* present: vmm_lock keeps other unmaps out */
    /* Back to a PROT_NONE piece of the reservation; the chunk's pages stay in its memfd. */
    mmap((void *)r.base, r.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (--r.alloc->maps == 0 && r.alloc->released) vmm_alloc_destroy(r.alloc);
    cur = r.base + r.size;
  }
  pthread_mutex_unlock(&vmm_lock);
  return CUDA_SUCCESS;
}
