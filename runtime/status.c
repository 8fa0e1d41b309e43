/* status.c: ebb_status names and texts from the one table, the thread-local last-error message,
 * the error hook, and the single place where a CUresult becomes an ebb_status.
 *
 * Threading: the message buffer is per thread (_Thread_local), written only by failing calls on
 * that thread; a call that reports its internal steps' failures once, itself, diverts them to a
 * buffer of its own meanwhile (ebb__fail_divert). The error hook sits under a mutex taken only on
 * failures.
 */
#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

#include "runtime_impl.h"

const char *ebb_status_name(ebb_status s) {
  switch (s) {
#define EBB_STATUS_NAME_(name, value, text) \
  case EBB_##name:                          \
    return "EBB_" #name;
    EBB_STATUS_MAP(EBB_STATUS_NAME_)
#undef EBB_STATUS_NAME_
  }
  return "EBB_UNKNOWN";
}

const char *ebb_status_str(ebb_status s) {
  switch (s) {
#define EBB_STATUS_STR_(name, value, text) \
  case EBB_##name:                         \
    return text;
    EBB_STATUS_MAP(EBB_STATUS_STR_)
#undef EBB_STATUS_STR_
  }
  return "unknown status";
}

static _Thread_local char ebb__errbuf[EBB__ERRMSG_MAX];
static _Thread_local char *ebb__errdiv;      /* ebb__fail_divert's buffer, NULL: none */
static _Thread_local uint64_t ebb__errserial; /* failures stored in ebb__errbuf */

/* (while diverted, what the internal steps read back to build on is the diverted message) */
const char *ebb_last_error(void) { return ebb__errdiv ? ebb__errdiv : ebb__errbuf; }
void ebb_clear_error(void) { (ebb__errdiv ? ebb__errdiv : ebb__errbuf)[0] = '\0'; }

char *ebb__fail_divert(char *buf) {
  char *prev = ebb__errdiv;
  ebb__errdiv = buf;
  return prev;
}

uint64_t ebb__fail_serial(void) { return ebb__errserial; }

/* The hook and its argument change together, so both sit under one small lock. Failures are
 * not a hot path; the lock is taken only there and in ebb_set_error_hook. */
static pthread_mutex_t ebb__hook_lock = PTHREAD_MUTEX_INITIALIZER;
static ebb_error_hook_fn ebb__hook_fn;
static void *ebb__hook_user;

void ebb_set_error_hook(ebb_error_hook_fn fn, void *user) {
  pthread_mutex_lock(&ebb__hook_lock);
  ebb__hook_fn = fn;
  ebb__hook_user = user;
  pthread_mutex_unlock(&ebb__hook_lock);
}

/* Muting is a divert into this thread's scratch message: an internal step that may fail inside
 * a call that succeeds (a trace file at shutdown) reports through the warning handler instead.
 * The outermost mute sets the divert and puts back the one it found (a mute inside a diverted
 * backward returns to the backward's buffer). */
static _Thread_local int ebb__muted;
static _Thread_local char ebb__muted_buf[EBB__ERRMSG_MAX];
static _Thread_local char *ebb__mute_prev;

void ebb__fail_mute(bool on) {
  if (on) {
    /* Only the outermost mute starts afresh: an inner one must not wipe a failure the outer
     * scope captured and may still report (a warning). */
    if (ebb__muted++ == 0) {
      ebb__muted_buf[0] = '\0';
      ebb__mute_prev = ebb__fail_divert(ebb__muted_buf);
    }
  } else if (--ebb__muted == 0) {
    ebb__fail_divert(ebb__mute_prev);
  }
}

const char *ebb__muted_error(void) { return ebb__muted_buf; }

ebb_status ebb__fail(ebb_status status, const char *fmt, ...) {
  /* Formatted apart, then copied: a caller may pass the last error itself as an argument
   * ("fn: %s", ebb_last_error()), which must not be read while it is being overwritten. */
  char msg[sizeof ebb__errbuf];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(ebb__errdiv ? ebb__errdiv : ebb__errbuf, msg, sizeof msg);
  if (ebb__errdiv) return status; /* (a diverted or muted failure is reported by the call that diverted it, if at all) */
  ebb__errserial++;
  pthread_mutex_lock(&ebb__hook_lock);
  ebb_error_hook_fn fn = ebb__hook_fn;
  void *user = ebb__hook_user;
  pthread_mutex_unlock(&ebb__hook_lock);
  if (fn) fn(status, ebb__errbuf, user); /* called unlocked: a hook may take its own locks */
  return status;
}

/* The warning handler and its argument change together under their own lock (never held while
 * the handler runs). Statically the default, so warnings before any ebb call are not lost. */
static pthread_mutex_t ebb__warn_lock = PTHREAD_MUTEX_INITIALIZER;
static ebb_warning_fn ebb__warn_fn = ebb_warning_to_stderr;
static void *ebb__warn_user;

void ebb_warning_to_stderr(const char *message, void *user) {
  (void)user;
  /* the one place ebb writes to stderr: the default of the replaceable handler */
  fprintf(stderr, "ebb: %s\n", message ? message : "");
}

void ebb_set_warning_handler(ebb_warning_fn fn, void *user) {
  pthread_mutex_lock(&ebb__warn_lock);
  ebb__warn_fn = fn;
  ebb__warn_user = user;
  pthread_mutex_unlock(&ebb__warn_lock);
}

void ebb__warn(const char *fmt, ...) {
  pthread_mutex_lock(&ebb__warn_lock);
  ebb_warning_fn fn = ebb__warn_fn;
  void *user = ebb__warn_user;
  pthread_mutex_unlock(&ebb__warn_lock);
  if (!fn) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fn(msg, user);
}

void ebb__assert_fail(const char *expr, const char *file, int line) {
  ebb__warn("internal invariant broken: %s (%s:%d)", expr, file, line);
  abort();
}

uint64_t ebb__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool ebb__cu_sticky(CUresult r) {
  return ebb__cu_error_sticky((int)r) != 0; /* (ebb_cuda.h) */
}

/* Every CUresult ebb can meet, mapped once. Errors not listed are EBB_EDRIVER; the sticky ones
 * (ebb__cu_sticky) are EBB_EDEVICE: the device is lost until its context is destroyed. */
ebb_status ebb__cu_status(CUresult r) {
  if (ebb__cu_sticky(r)) return EBB_EDEVICE;
  switch (r) {
  case CUDA_SUCCESS: return EBB_OK;
  case CUDA_ERROR_INVALID_VALUE:
  case CUDA_ERROR_INVALID_HANDLE: /* a handle the driver does not (or no longer) accept */
    return EBB_EINVAL;
  case CUDA_ERROR_OUT_OF_MEMORY: return EBB_ENOMEM;
  case CUDA_ERROR_NOT_INITIALIZED:
  case CUDA_ERROR_DEINITIALIZED: return EBB_ENOTINIT;
  case CUDA_ERROR_NO_DEVICE:
  case CUDA_ERROR_INVALID_DEVICE:
  case CUDA_ERROR_INVALID_CONTEXT:
  case CUDA_ERROR_CONTEXT_IS_DESTROYED:
  case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
  case CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: return EBB_EDEVICE;
  case CUDA_ERROR_NOT_FOUND: return EBB_ENOTFOUND;
  case CUDA_ERROR_NOT_READY:
  case CUDA_ERROR_ILLEGAL_STATE:
  case CUDA_ERROR_ALREADY_MAPPED:
  case CUDA_ERROR_NOT_MAPPED:
  case CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
  case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
  case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
  case CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: return EBB_ESTATE;
  case CUDA_ERROR_NOT_SUPPORTED:
  case CUDA_ERROR_NOT_PERMITTED:
  case CUDA_ERROR_STUB_LIBRARY: return EBB_ENOTSUP;
  case CUDA_ERROR_OPERATING_SYSTEM: return EBB_EIO;
  default: return EBB_EDRIVER;
  }
}

/* The name of a CUresult even when the driver cannot say (a stub libcuda answers nothing). */
const char *ebb__cu_name(CUresult r) {
  switch (r) {
  case CUDA_SUCCESS: return "CUDA_SUCCESS";
  case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
  case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
  case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
  case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
  case CUDA_ERROR_STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
  case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
  case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
  case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
  case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
  case CUDA_ERROR_CONTEXT_ALREADY_CURRENT: return "CUDA_ERROR_CONTEXT_ALREADY_CURRENT";
  case CUDA_ERROR_ALREADY_MAPPED: return "CUDA_ERROR_ALREADY_MAPPED";
  case CUDA_ERROR_NOT_MAPPED: return "CUDA_ERROR_NOT_MAPPED";
  case CUDA_ERROR_NOT_MAPPED_AS_POINTER: return "CUDA_ERROR_NOT_MAPPED_AS_POINTER";
  case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: return "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED";
  case CUDA_ERROR_INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
  case CUDA_ERROR_INVALID_SOURCE: return "CUDA_ERROR_INVALID_SOURCE";
  case CUDA_ERROR_OPERATING_SYSTEM: return "CUDA_ERROR_OPERATING_SYSTEM";
  case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
  case CUDA_ERROR_ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
  case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
  case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
  case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
  case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
  case CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: return "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED";
  case CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: return "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED";
  case CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: return "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE";
  case CUDA_ERROR_CONTEXT_IS_DESTROYED: return "CUDA_ERROR_CONTEXT_IS_DESTROYED";
  case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
  case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
  case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
  case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
  case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
  case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
  case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
  default: return NULL;
  }
}

ebb_status ebb__cu_fail(CUresult r, const char *fn, const char *call) {
  /* A sticky error: the device goes into its error state, and the message says so (naming the
   * error and the call that met it first) from this call on. Not while ebb_init has no device
   * table yet: then the init's own failure is the answer. */
  if (ebb__cu_sticky(r) && ebb__runtime_state.ndev > 0) return ebb__dev_live_slow(fn, ebb__dev_mark_failed(r, call));
  const char *name = NULL, *text = NULL;
  if (ebb__runtime_state.drv.GetErrorName && ebb__runtime_state.drv.GetErrorName(r, &name) != CUDA_SUCCESS) name = NULL;
  if (!name) name = ebb__cu_name(r);
  if (ebb__runtime_state.drv.GetErrorString) ebb__runtime_state.drv.GetErrorString(r, &text);
  return ebb__fail(ebb__cu_status(r), "%s: %s failed on the %s driver: %s (%d: %s)", fn, call,
                   ebb__runtime_state.drv.name ? ebb__runtime_state.drv.name : "unloaded", name ? name : "CUDA_ERROR_?", (int)r,
                   text ? text : "no description");
}
