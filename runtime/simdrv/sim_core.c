/* sim_core.c: initialisation, devices, primary contexts, peer access, error names and the
 * type-stable handle tables of the emulated driver.
 *
 * Owns: the process-wide `sim` state (device table and settings read from the environment once,
 * in cuInit), each device's primary context and its refcount and peer mask, the thread-local
 * current context, the capacity counters and the handle tables' slot allocator.
 *
 * Threading: cuInit runs its body once (pthread_once) and publishes `sim.ready` with a release
 * store; every other entry point first checks it with an acquire load, after which the device
 * table is read-only. Context refcounts and peer masks change under ctx_lock. Capacity is an
 * atomic counter updated with a compare-and-swap loop. The current context is thread-local, as
 * in CUDA. Handle tables take their own mutex only to hand out or take back slots; lookups are
 * lock-free (see sim_table_get).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sim_internal.h"

struct sim_globals sim;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
/* Why init_body failed, for ebbsim_init_error; written once under the cuInit once-guard. */
static char init_error[512];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local struct sim_device *tls_current;

/* ---------------------------------------------------------------- handle tables */

uint64_t sim_handle(uint32_t tag, uint32_t gen, uint32_t index) {
  return ((uint64_t)tag << 56) | ((uint64_t)(gen & SIM_GEN_MASK) << 32) | index;
}

void *sim_table_alloc(struct sim_table *t, uint64_t *handle) {
  pthread_mutex_lock(&t->lock);
  struct sim_slot *s = t->free_head;
  if (s) {
    t->free_head = s->next_free;
  } else {
    uint32_t chunk = t->nslots / SIM_TABLE_CHUNK, within = t->nslots % SIM_TABLE_CHUNK;
    if (chunk >= SIM_TABLE_MAX_CHUNKS) goto fail_unlock;
    char *c = atomic_load_explicit(&t->chunks[chunk], memory_order_relaxed); /* only we write it */
    if (!c) {
      c = calloc(SIM_TABLE_CHUNK, t->obj_size);
      if (!c) goto fail_unlock;
      /* release: pairs with the acquire in sim_table_get, so a lookup that finds the chunk also
       * sees its zeroed slots */
      atomic_store_explicit(&t->chunks[chunk], c, memory_order_release);
    }
    s = (struct sim_slot *)(void *)(c + (size_t)within * t->obj_size);
    s->index = t->nslots++;
  }
  s->next_free = NULL;
  uint32_t g = atomic_load_explicit(&s->gen, memory_order_relaxed) + 1; /* even -> odd: live */
  /* release: a lookup that sees the new generation sees the index written above */
  atomic_store_explicit(&s->gen, g, memory_order_release);
  pthread_mutex_unlock(&t->lock);
  *handle = sim_handle(t->tag, g, s->index);
  return s;
fail_unlock:
  pthread_mutex_unlock(&t->lock);
  return NULL;
}

void *sim_table_get(struct sim_table *t, uint64_t handle, uint32_t *gen) {
  if ((uint32_t)(handle >> 56) != t->tag) return NULL;
  uint32_t index = (uint32_t)handle, hgen = (uint32_t)(handle >> 32) & SIM_GEN_MASK;
  if (index / SIM_TABLE_CHUNK >= SIM_TABLE_MAX_CHUNKS) return NULL;
  /* acquire: pairs with the release that published the chunk */
  char *c = atomic_load_explicit(&t->chunks[index / SIM_TABLE_CHUNK], memory_order_acquire);
  if (!c) return NULL;
  struct sim_slot *s = (struct sim_slot *)(void *)(c + (size_t)(index % SIM_TABLE_CHUNK) * t->obj_size);
  /* acquire: pairs with the release in sim_table_alloc (new life) or sim_table_kill */
  uint32_t g = atomic_load_explicit(&s->gen, memory_order_acquire);
  if (!(g & 1u) || (g & SIM_GEN_MASK) != hgen) return NULL;
  if (gen) *gen = g;
  return s;
}

bool sim_table_kill(struct sim_slot *s, uint32_t gen) {
  /* acq_rel: the winner of a destroy race alone tears the object down, and later lookups see
   * the slot dead */
  return atomic_compare_exchange_strong_explicit(&s->gen, &gen, gen + 1, memory_order_acq_rel,
                                                 memory_order_relaxed);
}

void sim_table_free(struct sim_table *t, struct sim_slot *s) {
  pthread_mutex_lock(&t->lock);
  s->next_free = t->free_head;
  t->free_head = s;
  pthread_mutex_unlock(&t->lock);
}

/* ---------------------------------------------------------------- small helpers */

uint64_t sim_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

bool sim_charge(struct sim_device *d, size_t bytes) {
  /* relaxed: `used` is a counter that guards no other data; the CAS alone keeps it exact */
  size_t cur = atomic_load_explicit(&d->used, memory_order_relaxed);
  do {
    if (bytes > d->capacity || cur > d->capacity - bytes) return false;
  } while (!atomic_compare_exchange_weak_explicit(&d->used, &cur, cur + bytes, memory_order_relaxed,
                                                  memory_order_relaxed));
  return true;
}

void sim_uncharge(struct sim_device *d, size_t bytes) {
  atomic_fetch_sub_explicit(&d->used, bytes, memory_order_relaxed);
}

struct sim_device *sim_device_get(CUdevice d) {
  if (d < 0 || d >= sim.ndev) return NULL;
  return &sim.dev[d];
}

struct sim_device *sim_device_of_ctx(CUcontext c) {
  /* Compare addresses only: a bogus context pointer is never dereferenced. */
  for (int i = 0; i < sim.ndev; i++)
    if (c == sim_ctx_handle(&sim.dev[i])) return &sim.dev[i];
  return NULL;
}

struct sim_device *sim_current_device(void) { return tls_current; }

/* ---------------------------------------------------------------- errors */

#define SIM_ERRORS(X)                                                                              \
  X(CUDA_SUCCESS, "no error")                                                                      \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                                  \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                     \
  X(CUDA_ERROR_NOT_INITIALIZED, "driver not initialized: call cuInit(0) first")                    \
  X(CUDA_ERROR_DEINITIALIZED, "driver is shutting down")                                           \
  X(CUDA_ERROR_STUB_LIBRARY, "stub driver library loaded instead of a real driver")                \
  X(CUDA_ERROR_NO_DEVICE, "no device found")                                                       \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                           \
  X(CUDA_ERROR_INVALID_IMAGE, "invalid module image")                                              \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid or missing current context")                              \
  X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")                                 \
  X(CUDA_ERROR_ALREADY_MAPPED, "address range already mapped")                                     \
  X(CUDA_ERROR_NOT_MAPPED, "address range not mapped")                                             \
  X(CUDA_ERROR_NOT_MAPPED_AS_POINTER, "resource not mapped as a pointer")                          \
  X(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access not supported between these devices")         \
  X(CUDA_ERROR_INVALID_PTX, "invalid PTX")                                                         \
  X(CUDA_ERROR_INVALID_SOURCE, "invalid kernel source")                                            \
  X(CUDA_ERROR_OPERATING_SYSTEM, "an operating system call failed")                                \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle (bogus or destroyed)")                     \
  X(CUDA_ERROR_ILLEGAL_STATE, "operation not valid in the current state")                          \
  X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                                \
  X(CUDA_ERROR_NOT_READY, "work not complete yet")                                                 \
  X(CUDA_ERROR_ILLEGAL_ADDRESS, "illegal memory address")                                          \
  X(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch")                 \
  X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access already enabled")                         \
  X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access not enabled")                                 \
  X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "primary context already active")                           \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context destroyed")                                          \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "host memory range already registered")             \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "host memory range not registered")                     \
  X(CUDA_ERROR_LAUNCH_FAILED, "kernel launch failed")                                              \
  X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                           \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                           \
  X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "driver and kernel module versions differ")                 \
  X(CUDA_ERROR_UNKNOWN, "unknown error")

/* ---------------------------------------------------------------- environment and cuInit */

/* EBB_SIM_DEVICES: an integer in 1..16. */
static bool parse_devices(const char *s, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 1 || v > SIM_MAX_DEVICES) return false;
  *out = (int)v;
  return true;
}

/* EBB_SIM_MEM: bytes, optionally with a binary suffix K, M, G or T (and an optional "B"/"iB"). */
static bool parse_bytes(const char *s, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || s[0] == '-') return false;
  unsigned shift = 0;
  switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
  }
  if (shift && *end == 'i') end++;
  if (*end == 'B') end++;
  if (*end || v == 0 || v > (SIZE_MAX >> shift)) return false;
  *out = (size_t)v << shift;
  return true;
}

/* EBB_SIM_COMMIT, EBB_SIM_VMM: 1 (the default) or 0. */
static bool parse_bool01(const char *s, bool *out) {
  if ((s[0] != '0' && s[0] != '1') || s[1]) return false;
  *out = s[0] == '1';
  return true;
}

/* A cgroup memory limit in bytes; 0 when the file is absent or says "max" (no limit). */
static size_t cgroup_limit(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  unsigned long long v = 0;
  bool ok = fscanf(f, "%llu", &v) == 1;
  fclose(f);
  return ok && v <= SIZE_MAX ? (size_t)v : 0;
}

/* The default capacity of each of `ndev` devices. Memory is committed at allocation, so every
 * device full must fit in the host, or a full device would meet the kernel's OOM killer rather
 * than CUDA_ERROR_OUT_OF_MEMORY: 8 GiB each, lowered so all devices together take at most three
 * quarters of the host's memory (physical memory, or a smaller cgroup v2/v1 limit: the one a
 * container's OOM killer enforces), the rest left to the program and the system; whole 2 MiB
 * granules, one at least. */
/* The smallest memory limit on the path from `dir` (a cgroup's path, "" for the root) up to the
 * root of the hierarchy mounted at `mount`, reading `file` in each; 0 when none. */
static size_t cgroup_walk(const char *mount, char *dir, const char *file) {
  size_t best = 0;
  for (;;) { /* the cgroup, then each ancestor, then the root */
    char p[4096 + 128];
    snprintf(p, sizeof p, "%s%s/%s", mount, dir, file);
    size_t lim = cgroup_limit(p);
    if (lim && (!best || lim < best)) best = lim;
    char *slash = strrchr(dir, '/');
    if (!slash) break;
    *slash = 0;
  }
  return best;
}

/* Whether `list` (a v1 line's controllers, "cpu,memory") names the memory controller. */
static bool has_memory_ctrl(const char *list) {
  for (const char *p = list; *p;) {
    size_t n = strcspn(p, ",");
    if (n == 6 && strncmp(p, "memory", 6) == 0) return true;
    p += n + (p[n] == ',');
  }
  return false;
}

/* The smallest memory limit that applies to this process: along its own cgroup's path up to the
 * root, for the v2 entry ("0::/a/b") of /proc/self/cgroup under /sys/fs/cgroup (memory.max) and
 * a v1 entry listing the memory controller ("4:memory:/a/b", "4:cpu,memory:/a/b") under
 * /sys/fs/cgroup/<its controllers> or /sys/fs/cgroup/memory (memory.limit_in_bytes). Without a
 * cgroup namespace the root of the mount is not the process's own cgroup, so the root alone
 * would miss its limit. Without /proc/self/cgroup, the roots alone. 0: no limit found. */
static size_t cgroup_min_limit(void) {
  size_t best = 0;
  FILE *f = fopen("/proc/self/cgroup", "r");
  if (!f) {
    static const char *const roots[] = {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
    for (size_t i = 0; i < sizeof roots / sizeof *roots; i++) {
      size_t lim = cgroup_limit(roots[i]);
      if (lim && (!best || lim < best)) best = lim;
    }
    return best;
  }
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    line[strcspn(line, "\n")] = 0;
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2) continue;
    *c2 = 0;
    const char *ctrl = c1 + 1, *path = c2 + 1;
    char dir[4096];
    if (strlen(path) >= sizeof dir) continue; /* (no real cgroup path is this long) */
    const char *mounts[2] = {NULL, NULL}, *file;
    char named[4096 + 32];
    if (!*ctrl) {
      mounts[0] = "/sys/fs/cgroup";
      file = "memory.max";
    } else if (has_memory_ctrl(ctrl)) {
      snprintf(named, sizeof named, "/sys/fs/cgroup/%s", ctrl);
      mounts[0] = named;
      mounts[1] = strcmp(ctrl, "memory") != 0 ? "/sys/fs/cgroup/memory" : NULL;
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    for (int m = 0; m < 2 && mounts[m]; m++) {
      snprintf(dir, sizeof dir, "%s", strcmp(path, "/") == 0 ? "" : path);
      size_t lim = cgroup_walk(mounts[m], dir, file);
      if (lim && (!best || lim < best)) best = lim;
    }
  }
  free(line);
  fclose(f);
  return best;
}

static size_t default_capacity(int ndev) {
  const size_t cap = (size_t)8 << 30;
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return cap; /* unknown: CUDA's usual figure */
  size_t host = (size_t)pages <= SIZE_MAX / (size_t)page ? (size_t)pages * (size_t)page : SIZE_MAX;
  size_t lim = cgroup_min_limit();
  if (lim && lim < host) host = lim;
  size_t share = host / 4 * 3 / (size_t)ndev / SIM_GRANULE * SIM_GRANULE;
  if (share < SIM_GRANULE) share = SIM_GRANULE;
  return share < cap ? share : cap;
}

/* EBB_SIM_COPY_GBPS, EBB_SIM_LAUNCH_US: a finite number >= 0. */
static bool parse_nonneg(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v < 0) return false;
  *out = v;
  return true;
}

/* EBB_SIM_PERTURB: a decimal seed, 0 (off) up to 2^64-1; no sign, no junk. */
static bool parse_seed(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  if (s[0] < '0' || s[0] > '9') return false; /* strtoull would accept " -1" as 2^64-1 */
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end) return false;
  *out = (uint64_t)v;
  return true;
}

/* ---------------------------------------------------------------- fault injection */

/* EBB_SIM_FAULT=<entry|*>:<n>[:<CUresult>][,...]: the n-th call of `entry` (of any entry point
 * for `*`), counted from cuInit, fails once with the CUresult. Every call of an entry point is
 * numbered by an atomic counter (one per entry, one for all), so exactly one call meets each
 * fault whatever the threads do, and the counters run only while a fault is left to fire. */
#define SIM_MAX_FAULTS 16
#define SIM_FAULT_ANY (-1)

struct sim_fault {
  int entry;        /* enum sim_entry, or SIM_FAULT_ANY */
  uint64_t n;       /* the call that fails, from 1 */
  CUresult result;  /* 0: the entry's default */
};

static struct sim_fault faults[SIM_MAX_FAULTS]; /* written by cuInit before `ready` */
static int nfaults;
static _Atomic int faults_left;                 /* not yet fired; the last one clears SIM_SLOW_FAULT */
static _Atomic uint64_t calls_of[SIM_NENTRIES];
static _Atomic uint64_t calls_all;

static const struct {
  const char *name;   /* as in cuda.h's prototypes: cuMemAlloc */
  const char *symbol; /* as exported: cuMemAlloc_v2 */
  unsigned flags;     /* SIM_EF_* */
} entries[SIM_NENTRIES] = {
#define SIM_STR_(x) #x
#define SIM_STR(x) SIM_STR_(x) /* expands ebb_cuda.h's redirection first: the exported name */
#define SIM_ENTRY_ROW(name, fl) [SIM_E_##name] = {#name, SIM_STR(name), (fl)},
    SIM_ENTRIES(SIM_ENTRY_ROW)
#undef SIM_ENTRY_ROW
};

bool sim_error_is_sticky(CUresult r) {
  return ebb__cu_error_sticky((int)r) != 0; /* (ebb_cuda.h) */
}

/* Makes `r` the sticky error of `d`'s context (the context the failing call acted on), the first
 * one only (a GPU's context keeps the error that poisoned it). Without one nothing is poisoned. */
static void sticky_set(struct sim_device *d, CUresult r) {
  if (!d) return;
  int none = CUDA_SUCCESS;
  atomic_compare_exchange_strong_explicit(&d->sticky, &none, (int)r, memory_order_relaxed, memory_order_relaxed);
  atomic_fetch_or_explicit(&sim.slow, SIM_SLOW_STICKY, memory_order_relaxed);
}

static CUresult fault_hit(enum sim_entry e, struct sim_device *target) {
  /* relaxed: the counters only number the calls; each number is handed out once */
  uint64_t mine = atomic_fetch_add_explicit(&calls_of[e], 1, memory_order_relaxed) + 1;
  uint64_t all = atomic_fetch_add_explicit(&calls_all, 1, memory_order_relaxed) + 1;
  for (int i = 0; i < nfaults; i++) {
    const struct sim_fault *f = &faults[i];
    if (f->entry == SIM_FAULT_ANY ? f->n != all : (f->entry != (int)e || f->n != mine)) continue;
    if (atomic_fetch_sub_explicit(&faults_left, 1, memory_order_relaxed) == 1)
      atomic_fetch_and_explicit(&sim.slow, ~SIM_SLOW_FAULT, memory_order_relaxed);
    CUresult r = f->result ? f->result
                           : (entries[e].flags & SIM_EF_ALLOC) ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_LAUNCH_FAILED;
    if (sim_error_is_sticky(r)) sticky_set(target, r);
    return r;
  }
  return CUDA_SUCCESS;
}

CUresult sim_enter_slow(enum sim_entry e, struct sim_device *target) {
  unsigned slow = atomic_load_explicit(&sim.slow, memory_order_relaxed);
  if (slow & SIM_SLOW_FAULT) {
    CUresult r = fault_hit(e, target);
    if (r != CUDA_SUCCESS) return r;
  }
  if ((slow & SIM_SLOW_STICKY) && !(entries[e].flags & SIM_EF_AFTER_STICKY) && tls_current)
    return sim_device_sticky(tls_current);
  return CUDA_SUCCESS;
}

/* A CUresult by name (CUDA_ERROR_LAUNCH_FAILED) or by number (719); false for CUDA_SUCCESS. */
static bool parse_curesult(const char *s, size_t len, CUresult *out) {
#define SIM_ERR_MATCH(code, text)                                        \
  if (len == sizeof #code - 1 && strncmp(s, #code, len) == 0) {          \
    *out = code;                                                         \
    return code != CUDA_SUCCESS;                                         \
  }
  SIM_ERRORS(SIM_ERR_MATCH)
#undef SIM_ERR_MATCH
  unsigned long v = 0;
  if (len == 0 || len > 9) return false;
  for (size_t i = 0; i < len; i++) {
    if (s[i] < '0' || s[i] > '9') return false;
    v = v * 10 + (unsigned long)(s[i] - '0');
  }
  if (v == 0) return false;
  *out = (CUresult)v;
  return true;
}

/* EBB_SIM_FAULT: a comma-separated list of <entry|*>:<n>[:<CUresult>]. On a bad item, writes
 * why (naming the item) into init_error and returns false. */
static bool parse_faults(const char *v) {
  nfaults = 0;
  for (const char *p = v;;) {
    size_t len = strcspn(p, ",");
    char item[160];
    if (len == 0 || len >= sizeof item) {
      snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': an empty or overlong fault; expected <entry|*>:<n>[:<CUresult>][,...]", v);
      return false;
    }
    if (nfaults == SIM_MAX_FAULTS) {
      snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': more than %d faults", v, SIM_MAX_FAULTS);
      return false;
    }
    memcpy(item, p, len);
    item[len] = 0;
    char *c1 = strchr(item, ':');
    if (!c1) {
      snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': '%s' has no call number; expected <entry|*>:<n>[:<CUresult>]", v, item);
      return false;
    }
    *c1 = 0;
    char *num = c1 + 1, *c2 = strchr(num, ':');
    if (c2) *c2 = 0;
    struct sim_fault f = {.entry = SIM_FAULT_ANY};
    if (strcmp(item, "*") != 0) {
      f.entry = -2;
      for (int e = 0; e < SIM_NENTRIES; e++)
        if (strcmp(item, entries[e].name) == 0 || strcmp(item, entries[e].symbol) == 0) f.entry = e;
      if (f.entry == -2) {
        snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': unknown entry point '%s'; expected * or a Driver API entry simdrv exports (cuMemAlloc_v2, cuEventQuery, cuLaunchKernel, ...)", v, item);
        return false;
      }
    }
    char *end;
    errno = 0;
    unsigned long long n = num[0] >= '0' && num[0] <= '9' ? strtoull(num, &end, 10) : 0;
    if (errno || n < 1 || *end) {
      snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': call number '%s' of %s is not an integer >= 1", v, num, item);
      return false;
    }
    f.n = n;
    if (c2 && !parse_curesult(c2 + 1, strlen(c2 + 1), &f.result)) {
      snprintf(init_error, sizeof init_error, "EBB_SIM_FAULT='%s': '%s' is not a CUresult name (CUDA_ERROR_LAUNCH_FAILED, ...) or a number >= 1", v, c2 + 1);
      return false;
    }
    faults[nfaults++] = f;
    if (!p[len]) break;
    p += len + 1;
  }
  atomic_store_explicit(&faults_left, nfaults, memory_order_relaxed);
  return true;
}

/* A setting, NULL when unset or empty (README: an empty variable reads as unset). */
static const char *setting(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

static void init_body(void) {
  const char *e;
  int ndev = 2;
  size_t mem = 0; /* 0: default_capacity(ndev), once ndev is known */
  bool commit = true, vmm = true;
  double gbps = 0, launch_us = 0;
  uint64_t perturb = 0;
  /* A bad setting fails cuInit loudly rather than silently simulating something else. */
  if ((e = setting("EBB_SIM_DEVICES")) && !parse_devices(e, &ndev)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_DEVICES='%s' is not an integer in 1..%d", e, SIM_MAX_DEVICES);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_MEM")) && !parse_bytes(e, &mem)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_MEM='%s' is not a positive byte count (suffix K, M, G, T)", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_COMMIT")) && !parse_bool01(e, &commit)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_COMMIT='%s' is not 0 or 1", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_VMM")) && !parse_bool01(e, &vmm)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_VMM='%s' is not 0 or 1", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_COPY_GBPS")) && !parse_nonneg(e, &gbps)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_COPY_GBPS='%s' is not a number >= 0", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_LAUNCH_US")) && !parse_nonneg(e, &launch_us)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_LAUNCH_US='%s' is not a number >= 0", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_PERTURB")) && !parse_seed(e, &perturb)) {
    snprintf(init_error, sizeof init_error, "EBB_SIM_PERTURB='%s' is not a seed (an integer in 0..2^64-1; 0 is off)", e);
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  if ((e = setting("EBB_SIM_FAULT")) && !parse_faults(e)) {
    init_result = CUDA_ERROR_INVALID_VALUE;
    return;
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (!mem) mem = default_capacity(ndev);
  sim.ndev = ndev;
  sim.mem_capacity = mem;
  sim.commit = commit;
  sim.vmm = vmm;
  sim.copy_gbps = gbps;
  sim.launch_ns = (int64_t)(launch_us * 1000.0);
  sim.perturb_seed = perturb;
  sim.ncores = cores > 0 ? (int)cores : 1;
  for (int i = 0; i < ndev; i++) {
    struct sim_device *d = &sim.dev[i];
    d->ordinal = i;
    d->ctx.ordinal = i;
    d->capacity = mem;
    atomic_init(&d->used, 0);
    atomic_init(&d->sticky, CUDA_SUCCESS);
    sim_exec_init_device(d);
    if (!sim_exec_create_null_stream(d)) {
      snprintf(init_error, sizeof init_error, "no host memory or thread for device %d's null stream", i);
      init_result = CUDA_ERROR_OUT_OF_MEMORY;
      return;
    }
  }
  init_result = CUDA_SUCCESS;
  atomic_store_explicit(&sim.slow, nfaults ? SIM_SLOW_FAULT : 0u, memory_order_relaxed); /* published below */
  /* release: pairs with the acquire in sim_initialized; publishes everything above */
  atomic_store_explicit(&sim.ready, 1, memory_order_release);
}

/* The emulated driver's extension: why cuInit failed ("" before a failure). The once-guard of
 * cuInit orders init_error's write before any caller that saw cuInit return. */
SIM_API const char *ebbsim_init_error(void) { return init_error; }

/* The emulated driver's extension (ebb_cuda.h): the fault counters, for fault sweeps. */
SIM_API void ebbsim_fault_counts(unsigned long long *calls, int *fired) {
  /* relaxed: a count read by a test after its workload's calls returned */
  if (calls) *calls = (unsigned long long)atomic_load_explicit(&calls_all, memory_order_relaxed);
  if (fired) *fired = nfaults - atomic_load_explicit(&faults_left, memory_order_relaxed);
}

SIM_API CUresult CUDAAPI cuInit(unsigned int Flags) {
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&init_once, init_body);
  return init_result;
}

SIM_API CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
  if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = 13000;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
#define SIM_ERR_NAME(code, text) \
  case code: *pStr = #code; return CUDA_SUCCESS;
    SIM_ERRORS(SIM_ERR_NAME)
#undef SIM_ERR_NAME
    default: break;
  }
  *pStr = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
#define SIM_ERR_TEXT(code, text) \
  case code: *pStr = text; return CUDA_SUCCESS;
    SIM_ERRORS(SIM_ERR_TEXT)
#undef SIM_ERR_TEXT
    default: break;
  }
  *pStr = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------- devices */

SIM_API CUresult CUDAAPI cuDeviceGetCount(int *count) {
  SIM_ENTER(cuDeviceGetCount);
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = sim.ndev;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  SIM_ENTER(cuDeviceGet);
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (!sim_device_get(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
  SIM_ENTER(cuDeviceGetName);
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!sim_device_get(dev)) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, (size_t)len, "ebb simdrv device %d", dev); /* truncates like CUDA */
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
  SIM_ENTER(cuDeviceTotalMem);
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  struct sim_device *d = sim_device_get(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = d->capacity;
  return CUDA_SUCCESS;
}

/* What the emulated device reports. Compute capability is 0.0 on purpose: code that picks a
 * code path by architecture must not mistake a CPU for a GPU generation; everything else is the
 * capability a CUDA program checks before using a feature. */
SIM_API CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  SIM_ENTER(cuDeviceGetAttribute);
  if (!pi) return CUDA_ERROR_INVALID_VALUE;
  if (!sim_device_get(dev)) return CUDA_ERROR_INVALID_DEVICE;
  int v;
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1000000; break;            /* kHz */
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = sim.ncores; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x100 + dev; break;         /* past any real bus */
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 1000000; break;      /* kHz */
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 1 << 20; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 2; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = sim.vmm; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 0; break;       /* no cuMemAllocAsync */
    case CU_DEVICE_ATTRIBUTE_NUMA_ID: v = -1; break;                     /* not a NUMA node */
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: v = -1; break;                /* topology is the runtime's */
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  *pi = v;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  SIM_ENTER(cuDeviceGetPCIBusId);
  if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!sim_device_get(dev)) return CUDA_ERROR_INVALID_DEVICE;
  /* Bus 0x100 + ordinal: well-formed, and never a real PCI device (buses end at 0xff). */
  snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x100 + dev);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
  SIM_ENTER(cuDeviceCanAccessPeer);
  if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
  if (!sim_device_get(dev) || !sim_device_get(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
  *canAccessPeer = dev != peerDev;
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- primary contexts */

SIM_API CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  SIM_ENTER(cuDevicePrimaryCtxRetain);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  struct sim_device *d = sim_device_get(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&ctx_lock);
  d->ctx.refcount++;
  pthread_mutex_unlock(&ctx_lock);
  *pctx = sim_ctx_handle(d);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  SIM_ENTER(cuDevicePrimaryCtxRelease);
  struct sim_device *d = sim_device_get(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&ctx_lock);
  if (d->ctx.refcount == 0)
    r = CUDA_ERROR_INVALID_CONTEXT; /* released more often than retained */
  else if (--d->ctx.refcount == 0)
    /* CUDA destroys the primary context with its last release, and a sticky error with it; the
     * emulated context lives on, but without the error. */
    atomic_store_explicit(&d->sticky, CUDA_SUCCESS, memory_order_relaxed);
  pthread_mutex_unlock(&ctx_lock);
  return r;
}

/* Waits for the device's work and drops every retain. Unlike CUDA, allocations, streams and
 * events stay valid: the emulated context is never torn down. */
SIM_API CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) {
  SIM_ENTER(cuDevicePrimaryCtxReset);
  struct sim_device *d = sim_device_get(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  sim_exec_sync_device(d);
  /* A reset is how a CUDA program leaves a sticky error: the context starts afresh. */
  atomic_store_explicit(&d->sticky, CUDA_SUCCESS, memory_order_relaxed);
  pthread_mutex_lock(&ctx_lock);
  d->ctx.refcount = 0;
  d->ctx.peer_mask = 0;
  pthread_mutex_unlock(&ctx_lock);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  SIM_ENTER_ON(cuCtxSetCurrent, ctx ? sim_device_of_ctx(ctx) : NULL); /* a fault poisons the context made current */
  if (!ctx) {
    tls_current = NULL;
    return CUDA_SUCCESS;
  }
  struct sim_device *d = sim_device_of_ctx(ctx);
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  tls_current = d;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
  SIM_ENTER(cuCtxGetCurrent);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  *pctx = tls_current ? sim_ctx_handle(tls_current) : NULL;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
  SIM_ENTER(cuCtxGetDevice);
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (!tls_current) return CUDA_ERROR_INVALID_CONTEXT;
  *device = tls_current->ordinal;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuCtxSynchronize(void) {
  SIM_ENTER(cuCtxSynchronize);
  if (!tls_current) return CUDA_ERROR_INVALID_CONTEXT;
  sim_exec_sync_device(tls_current);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
  SIM_ENTER(cuCtxGetStreamPriorityRange);
  /* Either pointer may be NULL, as in CUDA. */
  if (leastPriority) *leastPriority = SIM_PRIO_LEAST;
  if (greatestPriority) *greatestPriority = SIM_PRIO_GREATEST;
  return CUDA_SUCCESS;
}

/* Peer access is bookkeeping only: peer copies work either way, staged as on PCIe systems
 * without NVLink, so enabling it changes no behaviour a program could observe except these
 * return codes. */
SIM_API CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
  SIM_ENTER(cuCtxEnablePeerAccess);
  struct sim_device *self = tls_current;
  if (!self) return CUDA_ERROR_INVALID_CONTEXT;
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct sim_device *peer = sim_device_of_ctx(peerContext);
  if (!peer) return CUDA_ERROR_INVALID_CONTEXT;
  if (peer == self) return CUDA_ERROR_INVALID_DEVICE;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&ctx_lock);
  if (self->ctx.peer_mask & (1u << peer->ordinal))
    r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  else
    self->ctx.peer_mask |= 1u << peer->ordinal;
  pthread_mutex_unlock(&ctx_lock);
  return r;
}

SIM_API CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext peerContext) {
  SIM_ENTER(cuCtxDisablePeerAccess);
  struct sim_device *self = tls_current;
  if (!self) return CUDA_ERROR_INVALID_CONTEXT;
  struct sim_device *peer = sim_device_of_ctx(peerContext);
  if (!peer) return CUDA_ERROR_INVALID_CONTEXT;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&ctx_lock);
  if (!(self->ctx.peer_mask & (1u << peer->ordinal)))
    r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  else
    self->ctx.peer_mask &= ~(1u << peer->ordinal);
  pthread_mutex_unlock(&ctx_lock);
  return r;
}
