/* ebb_internal.h: what every ebb module shares inside the library and nothing outside it:
 * the failure helper, assertions in levels, branch hints and the module-to-module live counter.
 * The runtime provides its functions (runtime/status.c), hence its place among the runtime's
 * exports. Not installed; never included by public headers.
 */
#ifndef EBB_INTERNAL_H
#define EBB_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/status.h"

#if defined(__GNUC__)
#define EBB_LIKELY(x) __builtin_expect(!!(x), 1)
#define EBB_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define EBB_PRINTF(f, a) __attribute__((format(printf, f, a)))
/* A function only failures call (a message formatted in stack buffers): kept out of line, so its
 * buffers do not grow the frame of the hot function that calls it, nor stop that one inlining. */
#define EBB_COLD __attribute__((noinline, cold))
#ifndef EBB_HIDDEN /* runtime_export.h defines it the same way */
#define EBB_HIDDEN __attribute__((visibility("hidden")))
#endif
#else
#define EBB_LIKELY(x) (x)
#define EBB_UNLIKELY(x) (x)
#define EBB_PRINTF(f, a)
#define EBB_COLD
#ifndef EBB_HIDDEN
#define EBB_HIDDEN
#endif
#endif

/* Debug levels: 0 release, 1 EBB_ASSERT on, 2 EBB_ASSERT_EXPENSIVE on too
 * (the asan and tsan presets build with 2). */
#ifndef EBB_DEBUG
#ifdef NDEBUG
#define EBB_DEBUG 0
#else
#define EBB_DEBUG 1
#endif
#endif

/* Internal invariant broken: print where and abort. Caller errors never come here. */
_Noreturn EBB_HIDDEN void ebb__assert_fail(const char *expr, const char *file, int line);
#if EBB_DEBUG >= 1
#define EBB_ASSERT(x) ((x) ? (void)0 : ebb__assert_fail(#x, __FILE__, __LINE__))
#else
#define EBB_ASSERT(x) ((void)0)
#endif
#if EBB_DEBUG >= 2
#define EBB_ASSERT_EXPENSIVE(x) EBB_ASSERT(x)
#else
#define EBB_ASSERT_EXPENSIVE(x) ((void)0)
#endif

/* Stores the formatted message as this thread's last error, calls the error hook, and returns
 * `status`, so failures read `return ebb__fail(EBB_EINVAL, "ebb_x: ...", ...);`. */
EBB_HIDDEN ebb_status ebb__fail(ebb_status status, const char *fmt, ...) EBB_PRINTF(2, 3);

/* On: failures on this thread go to a scratch message (ebb__muted_error, which ebb_last_error
 * reads meanwhile) and not to the thread's last error or the error hook, for internal steps of
 * calls that succeed anyway. Nests; a divert (below) into this thread's scratch message. */
EBB_HIDDEN void ebb__fail_mute(bool on);
EBB_HIDDEN const char *ebb__muted_error(void);

/* A call that reports its internal steps' failures once, itself (the backward engine, whose
 * steps run on other threads too): while a thread has a divert buffer (EBB__ERRMSG_MAX bytes),
 * failures on it are stored there, read back by ebb_last_error, and call no hook; the thread's own
 * last error is left alone. Sets buf (NULL: none) and returns the one it replaces, to set back
 * after (so diverts nest, and a user's callback runs with NULL: its failed calls are its own).
 * The caller initialises buf. */
#define EBB__ERRMSG_MAX 2048
EBB_HIDDEN char *ebb__fail_divert(char *buf);
/* How many failures this thread stored as its last error (muted and diverted ones not counted):
 * whether a callback's calls failed. */
EBB_HIDDEN uint64_t ebb__fail_serial(void);

/* Formats the message and hands it to the warning handler (ebb_set_warning_handler). Leaves
 * ebb_last_error and the error hook alone. */
EBB_HIDDEN void ebb__warn(const char *fmt, ...) EBB_PRINTF(1, 2);

/* Monotonic clock in nanoseconds. */
EBB_HIDDEN uint64_t ebb__now_ns(void);

#define EBB_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* The length (2 to 4) of the well-formed UTF-8 sequence of a character at or above U+0080 that
 * starts at s, which holds n > 0 bytes; 0 when s[0] starts none (an ASCII byte, a stray
 * continuation byte, an overlong form, a surrogate, past U+10FFFF, or a sequence cut short).
 * The JSON writers (snapshots, traces) copy such a sequence and write any other byte at or above
 * 0x80 as \u00XX, so caller text in Latin-1 or cut mid-character still makes a valid file. */
static inline size_t ebb__utf8_seq(const unsigned char *s, size_t n) {
  unsigned c = s[0];
  size_t len;
  unsigned lo = 0x80, hi = 0xBF; /* the allowed range of the second byte */
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;      /* overlong below U+0800 */
    else if (c == 0xED) hi = 0x9F; /* surrogates U+D800..U+DFFF */
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;      /* overlong below U+10000 */
    else if (c == 0xF4) hi = 0x8F; /* past U+10FFFF */
  } else {
    return 0;
  }
  if (n < len || s[1] < lo || s[1] > hi) return 0;
  for (size_t k = 2; k < len; k++)
    if ((s[k] & 0xC0) != 0x80) return 0;
  return len;
}

#endif /* EBB_INTERNAL_H */
