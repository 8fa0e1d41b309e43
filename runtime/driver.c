/* driver.c: choosing, loading and unloading the CUDA driver; ebb_init and ebb_shutdown.
 *
 * EBB_DRIVER=auto (default) tries libcuda.so.1 and keeps it only when cuInit succeeds and finds
 * a device; otherwise it loads ebb's emulated driver, libebb_simdrv.so. `cuda` and `sim` force
 * one, a path loads that library. Entry points are resolved by their versioned names (cuda.h maps
 * cuMemAlloc to cuMemAlloc_v2, ...; see EBB_DRV_ENTRIES) into one table.
 *
 * Threading: ebb_init/ebb_shutdown serialise on the runtime lock and are reference-counted.
 * Other calls read the table without locks after an acquire load of `ready`, which ebb_init
 * stores with release once the table and the devices are complete. A driver library, once
 * loaded, stays loaded for the life of the process (neither libcuda nor a driver with live
 * engine threads can be unloaded safely); a later ebb_init reuses it.
 */
#define _GNU_SOURCE /* dladdr, to find libebb_simdrv.so next to libebb.so */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime_impl.h"

ebb_runtime ebb__runtime_state = {.lock = {PTHREAD_MUTEX_INITIALIZER, "runtime", EBB_RANK_RUNTIME}};

static bool ebb__closing; /* the last ebb_shutdown is stopping the modules (runtime lock dropped) */

/* Libraries loaded so far (path -> handle), so a re-init does not dlopen twice. */
#define EBB_MAX_LOADED 4
static struct {
  char path[512];
  void *dl;
} ebb__loaded[EBB_MAX_LOADED];

ebb_status ebb__check_init(const char *fn) {
  /* acquire: pairs with the release store at the end of ebb_init (table and devices visible). */
  if (EBB_LIKELY(atomic_load_explicit(&ebb__runtime_state.ready, memory_order_acquire))) return EBB_OK;
  return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init() first", fn);
}

bool ebb_is_initialized(void) { return atomic_load_explicit(&ebb__runtime_state.ready, memory_order_acquire) != 0; }

static void *dlopen_once(const char *path, char *err, size_t errlen) {
  for (int i = 0; i < EBB_MAX_LOADED; i++)
    if (ebb__loaded[i].dl && strcmp(ebb__loaded[i].path, path) == 0) return ebb__loaded[i].dl;
  void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    const char *e = dlerror();
    snprintf(err, errlen, "%s", e ? e : "dlopen failed");
    return NULL;
  }
  for (int i = 0; i < EBB_MAX_LOADED; i++) {
    if (!ebb__loaded[i].dl) {
      snprintf(ebb__loaded[i].path, sizeof ebb__loaded[i].path, "%s", path);
      ebb__loaded[i].dl = dl;
      break;
    }
  }
  return dl;
}

/* Fills `d` from `dl`. On failure writes why into err and returns false. */
static bool driver_resolve(void *dl, ebb_drv *d, char *err, size_t errlen) {
  memset(d, 0, sizeof *d);
  d->abi_version = EBB_DRV_ABI;
#define EBB_RESOLVE_(field, sym, required)                                      \
  *(void **)(&d->field) = dlsym(dl, sym);                                      \
  if (!d->field && (required)) {                                               \
    snprintf(err, errlen, "the library does not export %s, which ebb needs", sym); \
    return false;                                                              \
  }
  EBB_DRV_ENTRIES(EBB_RESOLVE_)
#undef EBB_RESOLVE_
  *(void **)(&d->RegisterKernel) = dlsym(dl, EBBSIM_REGISTER_KERNEL_SYMBOL);
  return true;
}

/* Set when a driver's cuInit failed over a bad setting it named (ebbsim_init_error): ebb_init
 * then fails with EBB_EINVAL, as for any bad configuration. Runtime lock held (ebb_init). */
static bool ebb__bad_setting;

/* dlopen + resolve + cuInit + at least one device. Fills ebb__runtime_state.{dl,drv,info} on success. */
static bool try_driver(const char *path, ebb_driver_kind kind, char *err, size_t errlen) {
  void *dl = dlopen_once(path, err, errlen);
  if (!dl) return false;
  ebb_drv d;
  if (!driver_resolve(dl, &d, err, errlen)) return false;
  CUresult r = d.Init(0);
  if (r != CUDA_SUCCESS) {
    const char *name = NULL;
    if (d.GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = ebb__cu_name(r);
    /* The emulated driver says why in words (a bad EBB_SIM_* setting); libcuda has no such call. */
    ebbsim_init_error_fn why_fn;
    *(void **)(&why_fn) = dlsym(dl, EBBSIM_INIT_ERROR_SYMBOL);
    const char *why = why_fn ? why_fn() : NULL;
    if (why && *why && r == CUDA_ERROR_INVALID_VALUE) ebb__bad_setting = true;
    snprintf(err, errlen, "cuInit failed with %s (%d)%s%s", name ? name : "an unknown error", (int)r,
             r == CUDA_ERROR_STUB_LIBRARY || r == CUDA_ERROR_NO_DEVICE ? ": no GPU here" : why && *why ? ": " : "",
             why && *why ? why : "");
    return false;
  }
  int n = 0, version = 0;
  const char *call = "cuDeviceGetCount";
  if ((r = d.DeviceGetCount(&n)) == CUDA_SUCCESS) {
    call = "cuDriverGetVersion";
    r = d.DriverGetVersion(&version);
  }
  if (r != CUDA_SUCCESS) {
    const char *name = NULL;
    if (d.GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = ebb__cu_name(r);
    snprintf(err, errlen, "%s failed with %s (%d)", call, name ? name : "an unknown error", (int)r);
    return false;
  }
  if (n <= 0) {
    snprintf(err, errlen, "the driver reports no device");
    return false;
  }
  ebb__runtime_state.dl = dl;
  ebb__runtime_state.drv = d;
  ebb_driver_info *info = &ebb__runtime_state.info;
  info->kind = kind;
  info->version = version;
  info->device_count = n < EBB_MAX_DEVICES ? n : EBB_MAX_DEVICES;
  snprintf(info->path, sizeof info->path, "%s", path);
  const char *base = strrchr(path, '/');
  snprintf(info->name, sizeof info->name, "%s",
           kind == EBB_DRIVER_CUDA ? "cuda" : kind == EBB_DRIVER_EMULATED ? "simdrv" : (base ? base + 1 : path));
  ebb__runtime_state.drv.name = kind == EBB_DRIVER_CUDA ? "cuda" : kind == EBB_DRIVER_EMULATED ? "simdrv" : "custom";
  return true;
}

/* The emulated driver: EBB_SIMDRV_PATH, next to libebb, the build tree, the install tree, then
 * the loader's search path. */
static bool try_simdrv(char *err, size_t errlen) {
  const char *cands[5];
  int n = 0;
  const char *env = getenv("EBB_SIMDRV_PATH");
  if (env && *env) cands[n++] = env;
  char beside[512] = "";
  Dl_info dli;
  if (dladdr((void *)&ebb_init, &dli) && dli.dli_fname) {
    const char *slash = strrchr(dli.dli_fname, '/');
    if (slash) {
      snprintf(beside, sizeof beside, "%.*s/libebb_simdrv.so", (int)(slash - dli.dli_fname), dli.dli_fname);
      cands[n++] = beside;
    }
  }
#ifdef EBB_SIMDRV_BUILD_PATH
  cands[n++] = EBB_SIMDRV_BUILD_PATH;
#endif
#ifdef EBB_SIMDRV_INSTALL_PATH
  cands[n++] = EBB_SIMDRV_INSTALL_PATH;
#endif
  cands[n++] = "libebb_simdrv.so";
  size_t used = 0;
  for (int i = 0; i < n; i++) {
    char e[512];
    if (try_driver(cands[i], EBB_DRIVER_EMULATED, e, sizeof e)) return true;
    if (used < errlen) used += (size_t)snprintf(err + used, errlen - used, "%s%s: %s", i ? "; " : "", cands[i], e);
    /* An explicit EBB_SIMDRV_PATH that fails is the answer; do not quietly load another. */
    if (i == 0 && env && *env) return false;
  }
  return false;
}

static ebb_status load_driver(void) {
  const char *want = getenv("EBB_DRIVER");
  if (!want || !*want) want = "auto";
  ebb_driver_info *info = &ebb__runtime_state.info;
  char err[1024] = "", err2[1024] = "";
  ebb__bad_setting = false;
  if (strcmp(want, "auto") == 0) {
    if (try_driver("libcuda.so.1", EBB_DRIVER_CUDA, err, sizeof err)) {
      snprintf(info->reason, sizeof info->reason, "auto: libcuda.so.1 loaded and cuInit found %d device(s)",
               info->device_count);
      return EBB_OK;
    }
    if (try_simdrv(err2, sizeof err2)) {
      snprintf(info->reason, sizeof info->reason, "auto: libcuda.so.1 unusable (%.200s); emulated driver", err);
      return EBB_OK;
    }
    return ebb__fail(ebb__bad_setting ? EBB_EINVAL : EBB_ENOTFOUND, "ebb_init: no driver: libcuda.so.1: %s; emulated driver: %s",
                     err, err2);
  }
  if (strcmp(want, "cuda") == 0) {
    if (try_driver("libcuda.so.1", EBB_DRIVER_CUDA, err, sizeof err)) {
      snprintf(info->reason, sizeof info->reason, "EBB_DRIVER=cuda");
      return EBB_OK;
    }
    return ebb__fail(EBB_EDRIVER, "ebb_init: EBB_DRIVER=cuda but libcuda.so.1 is unusable: %s", err);
  }
  if (strcmp(want, "sim") == 0) {
    if (try_simdrv(err, sizeof err)) {
      snprintf(info->reason, sizeof info->reason, "EBB_DRIVER=sim");
      return EBB_OK;
    }
    return ebb__fail(ebb__bad_setting ? EBB_EINVAL : EBB_ENOTFOUND, "ebb_init: EBB_DRIVER=sim but the emulated driver did not load: %s",
                     err);
  }
  if (strchr(want, '/') || strstr(want, ".so")) {
    if (try_driver(want, EBB_DRIVER_CUSTOM, err, sizeof err)) {
      snprintf(info->reason, sizeof info->reason, "EBB_DRIVER=%.200s", want);
      return EBB_OK;
    }
    return ebb__fail(ebb__bad_setting ? EBB_EINVAL : EBB_EDRIVER, "ebb_init: EBB_DRIVER=%s did not load: %s", want, err);
  }
  return ebb__fail(EBB_EINVAL, "ebb_init: EBB_DRIVER='%s' is not understood; expected auto, cuda, sim or a path to a driver library", want);
}

static void log_choice(void) {
  if (!ebb__rt_conf.log_info) return;
  ebb__warn("driver %s (%s), %d device(s): %s", ebb__runtime_state.info.name, ebb__runtime_state.info.path, ebb__runtime_state.info.device_count,
            ebb__runtime_state.info.reason);
}

/* The runtime's own teardown, after the modules stopped (or never started). Runtime lock held. */
static void runtime_down(void) {
  ebb__trace_fini();
  ebb__kernels_fini();
  ebb__devices_fini();
  ebb__topo_fini();
  atomic_store_explicit(&ebb__runtime_state.ready, 0, memory_order_release);
}

ebb_status ebb_init(void) {
  ebb__mutex_lock(&ebb__runtime_state.lock);
  if (ebb__closing) {
    ebb__mutex_unlock(&ebb__runtime_state.lock);
    return ebb__fail(EBB_EBUSY, "ebb_init: the last ebb_shutdown is still running on another thread; retry after it returns");
  }
  if (ebb__runtime_state.refs > 0) {
    ebb__runtime_state.refs++;
    ebb__mutex_unlock(&ebb__runtime_state.lock);
    return EBB_OK;
  }
  memset(&ebb__runtime_state.info, 0, sizeof ebb__runtime_state.info);
  /* Every variable of the runtime and of the linked modules, before anything is loaded. */
  ebb_status st = ebb__modules_configure();
  if (st == EBB_OK) st = load_driver();
  if (st == EBB_OK) st = ebb__devices_init();
  if (st == EBB_OK) {
    /* ready is needed by the public declare call; published for good below. */
    atomic_store_explicit(&ebb__runtime_state.ready, 1, memory_order_release);
    st = ebb__kernels_builtin_init();
    if (st) {
      ebb__kernels_fini();
      ebb__devices_fini();
      atomic_store_explicit(&ebb__runtime_state.ready, 0, memory_order_release);
    }
  }
  if (st == EBB_OK) {
    ebb__topo_init();
    ebb__trace_init_from_env();
    /* release: publishes the driver table and the device array to ebb__check_init's acquire. */
    atomic_store_explicit(&ebb__runtime_state.ready, 1, memory_order_release);
    /* Modules start lowest layer first, the runtime lock held (a start takes only locks of higher
     * rank); one that fails has stopped them all again. */
    st = ebb__modules_start();
    if (st) runtime_down();
  }
  if (st == EBB_OK) {
    ebb__runtime_state.refs = 1;
    log_choice();
  }
  ebb__mutex_unlock(&ebb__runtime_state.lock);
  return st;
}

ebb_status ebb_shutdown(void) {
  ebb__mutex_lock(&ebb__runtime_state.lock);
  if (ebb__runtime_state.refs == 0) {
    ebb__mutex_unlock(&ebb__runtime_state.lock);
    return ebb__fail(EBB_ENOTINIT, "ebb_shutdown: ebb is not initialised (more ebb_shutdown than ebb_init calls)");
  }
  if (ebb__runtime_state.refs > 1) {
    ebb__runtime_state.refs--;
    ebb__mutex_unlock(&ebb__runtime_state.lock);
    return EBB_OK;
  }
  /* The last reference: nothing is torn down while a caller still owns a handle, so every
   * handle either stays valid or was released before the teardown (and reads EBB_EFREED). */
  char live[384];
  long nlive = ebb__modules_live(live, sizeof live);
  if (nlive > 0) {
    ebb__mutex_unlock(&ebb__runtime_state.lock);
    return ebb__fail(EBB_EBUSY, "ebb_shutdown: %ld object%s still live (%s); release them and call ebb_shutdown again (nothing was torn down)",
                     nlive, nlive == 1 ? " is" : "s are", live);
  }
  ebb__runtime_state.refs = 0;
  /* Module stops run without the runtime lock (they call back into ebb) but while `ready` is
   * still 1, highest layer first. */
  ebb__closing = true;
  ebb__mutex_unlock(&ebb__runtime_state.lock);
  ebb__modules_stop();
  ebb__mutex_lock(&ebb__runtime_state.lock);
  ebb__closing = false;
  runtime_down();
  ebb__mutex_unlock(&ebb__runtime_state.lock);
  return EBB_OK;
}

ebb_status ebb_driver_get_info(ebb_driver_info *out) {
  ebb_status st = ebb__check_init("ebb_driver_get_info");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_driver_get_info: out is NULL; expected a struct to fill");
  *out = ebb__runtime_state.info;
  return EBB_OK;
}
