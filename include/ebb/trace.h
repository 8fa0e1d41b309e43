/* ebb/trace.h: a ring buffer of timed spans, exported as Chrome/Perfetto JSON.
 *
 * Off by default. When off, each of ebb's instrumentation points costs one load and one
 * predictable branch. When on, spans are written into a fixed ring (oldest overwritten) without
 * locks: each writer claims a slot with one atomic increment. Enable with ebb_trace_enable or
 * EBB_TRACE=<capacity> at ebb_init; export at any time.
 */
#ifndef EBB_TRACE_H
#define EBB_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb_trace_span {
  const char *name;   /* static or interned string (ebb_trace_intern) */
  uint64_t start_ns;  /* CLOCK_MONOTONIC */
  uint64_t end_ns;
  uint32_t tid;       /* small per-thread number assigned by ebb */
  int32_t device;     /* -1: host */
  uint64_t stream;    /* driver stream handle value, 0: none */
} ebb_trace_span;

/* Allocates a ring of `capacity` spans (rounded up to a power of two, at least 64) and starts
 * recording. Calling it again while on resizes and clears. EBB_EINVAL for 0. */
EBB_API ebb_status ebb_trace_enable(size_t capacity);
EBB_API void ebb_trace_disable(void);
EBB_API bool ebb_trace_enabled(void);
EBB_API uint64_t ebb_trace_now_ns(void);
/* Records one finished span. No-op when tracing is off. */
EBB_API void ebb_trace_span_add(const char *name, int device, uint64_t stream, uint64_t start_ns, uint64_t end_ns);
/* Returns a copy of `s` that lives until the process ends (deduplicated). NULL on ENOMEM. */
EBB_API const char *ebb_trace_intern(const char *s);
/* Spans currently held (at most the capacity) and spans dropped by wrap-around since enable. */
EBB_API ebb_status ebb_trace_counts(size_t *held, uint64_t *dropped);
/* Copies up to `max` spans, oldest first, into `out`; `*n` gets how many. */
EBB_API ebb_status ebb_trace_snapshot(ebb_trace_span *out, size_t max, size_t *n);
/* Writes {"traceEvents":[...]} with one complete ("ph":"X") event per span: pid is the device
 * (host = -1 shown as "host"), tid the thread, args the stream. EBB_EIO when the file cannot be
 * written. */
EBB_API ebb_status ebb_trace_export_json(const char *path);

#ifdef __cplusplus
}
#endif
#endif /* EBB_TRACE_H */
