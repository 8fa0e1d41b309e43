/* ebb/status.h: the one status type of ebb and its thread-local error message.
 *
 * Every fallible ebb call returns an ebb_status: 0 is success, negative values are errors.
 * Results go to out-parameters, written only on success. On failure the call also leaves a
 * message on the calling thread, read with ebb_last_error(): it says what was wrong and what was
 * expected, and names the handle, device or stream involved.
 */
#ifndef EBB_STATUS_H
#define EBB_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(EBB_BUILDING_LIBRARY)
#define EBB_API __attribute__((visibility("default")))
#else
#define EBB_API
#endif

/* X(name, value, text): the single table behind the enum, ebb_status_name and ebb_status_str. */
#define EBB_STATUS_MAP(X)                                              \
  X(OK, 0, "success")                                                  \
  X(EINVAL, -1, "invalid argument")                                    \
  X(ENOMEM, -2, "out of memory")                                       \
  X(EDEVICE, -3, "wrong or lost device")                               \
  X(EFREED, -4, "released handle")                                     \
  X(ENOTINIT, -5, "ebb is not initialised")                            \
  X(EDRIVER, -6, "driver error")                                       \
  X(ENOTSUP, -7, "not supported by this driver or build")              \
  X(EBUSY, -8, "resource busy")                                        \
  X(ESTATE, -9, "call not valid in the object's current state")        \
  X(ELIMIT, -10, "configured limit reached")                           \
  X(ENOTFOUND, -11, "not found")                                       \
  X(EIO, -12, "input/output error")                                    \
  X(EINTERNAL, -13, "internal error")

typedef enum ebb_status {
#define EBB_STATUS_ENUM_(name, value, text) EBB_##name = value,
  EBB_STATUS_MAP(EBB_STATUS_ENUM_)
#undef EBB_STATUS_ENUM_
} ebb_status;

/* "EBB_EINVAL" for EBB_EINVAL; "EBB_UNKNOWN" for a value outside the table. Static strings. */
EBB_API const char *ebb_status_name(ebb_status s);
/* "invalid argument" for EBB_EINVAL; "unknown status" outside the table. Static strings. */
EBB_API const char *ebb_status_str(ebb_status s);

/* The message of the last failing ebb call on this thread ("" if none failed yet; at most 2047
 * bytes, a longer one is cut). Owned by ebb; valid until the next failing ebb call on this
 * thread. Successful calls leave it unchanged. */
EBB_API const char *ebb_last_error(void);
/* Forget this thread's last error message (for tests and long-running loops). */
EBB_API void ebb_clear_error(void);

/* Optional process-wide hook called on every failure with the code and the message, on the
 * failing thread, after the message is stored. It may log; it must not call back into ebb.
 * NULL removes it. Thread-safe. */
typedef void (*ebb_error_hook_fn)(ebb_status status, const char *message, void *user);
EBB_API void ebb_set_error_hook(ebb_error_hook_fn fn, void *user);

/* Warnings: the one way ebb tells about something that did not fail a call (a setting ignored, a
 * trace or snapshot file that could not be written at shutdown, the driver chosen with
 * EBB_LOG=info, an internal invariant broken just before the process aborts). The library never
 * writes to stderr or stdout by itself: every such message goes to the warning handler, called
 * on the thread that noticed, with the message (no trailing newline) and `user`. The default
 * handler, ebb_warning_to_stderr, writes "ebb: <message>\n" to stderr. A handler must not call
 * back into ebb. ebb_set_warning_handler(NULL, NULL) silences warnings;
 * ebb_set_warning_handler(ebb_warning_to_stderr, NULL) restores the default. Thread-safe: a
 * handler being replaced may still be running on another thread, for at most the call in flight.
 * Warnings never touch ebb_last_error or the error hook. */
typedef void (*ebb_warning_fn)(const char *message, void *user);
EBB_API void ebb_set_warning_handler(ebb_warning_fn fn, void *user);
EBB_API void ebb_warning_to_stderr(const char *message, void *user);

#ifdef __cplusplus
}
#endif
#endif /* EBB_STATUS_H */
