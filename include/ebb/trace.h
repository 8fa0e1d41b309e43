/* ebb/trace.h: the engine trace: a ring of timed records, exported as Chrome/Perfetto JSON.
 *
 * Off by default. When off, each of ebb's instrumentation points costs one load and one
 * predictable branch. When on, records are written into a fixed ring (oldest overwritten) without
 * locks: each writer claims a slot with one atomic increment. Enable with ebb_trace_enable or
 * EBB_TRACE=<capacity> at ebb_init; export at any time (EBB_TRACE_FILE: at the last ebb_shutdown).
 *
 * What ebb records when on:
 *   - the autograd engine: a span per node it runs (or captures for ebb_grad), on the thread
 *     that ran it (a device's worker, the calling thread, a reentrant-pool thread), named after
 *     the node, with its device, graph task and sequence number; a flow from the node that
 *     produced a gradient on one device to the node that consumes it on another (a backward that
 *     fails may leave flows that never end: their consumers never ran);
 *   - streams: kernel launches, copies, event waits and autograd's offload copies (out and
 *     reload), each a span on the track of its stream. The times are the host's: when the call
 *     enqueued the work (from entry to return of the enqueue), not when the device ran it; the
 *     Driver API reports device times only through events, which would cost a record per launch;
 *   - collectives (ebb/dist.h): a span per collective ("all_reduce", "broadcast", "all_gather",
 *     "barrier") with one rank's bytes, its number on the group (seq) and the owner scope its
 *     issuer had open (ebb/ddp.h's reducer issues each bucket under "ddp bucket <k>"). On a
 *     device group it lies on the communication stream's track, named "comm <backend> stream <id>
 *     (device <d>, rank <r> of <n>)"; over MPI it runs from the start to the end of the MPI call
 *     (the stream waits for it meanwhile), over NCCL it is the host's enqueue time like a
 *     kernel's. On a CPU group it lies on the communication thread's track ("dist mpi comm");
 *   - the arenas: an instant per action (alloc, free requested, free completed, segment
 *     alloc/free/map/unmap, oom) with its bytes and owner, and a counter of each device's
 *     allocated bytes after it.
 *
 * The export: one process per device ("device <d>", pid d + 1) holding one track per stream
 * ("stream <id> (device <d>)") and the counters, one process "host" (pid EBB_MAX_DEVICES + 1) holding one track per
 * thread (named by ebb_trace_thread_name: "engine device 0 worker", ...). Complete events
 * ("ph":"X") are sorted by track, then start ascending and duration descending, and a span that
 * would end after the span enclosing its start on the same track (two threads enqueueing to one
 * stream at once) is cut at that span's end, so slices on one track always nest.
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

/* What a record is; its JSON phase in parentheses. */
typedef enum ebb_trace_kind {
  EBB_TRACE_SPAN = 0,    /* a slice from start_ns to end_ns ("X") */
  EBB_TRACE_INSTANT,     /* a point at start_ns on its track ("i", thread scope) */
  EBB_TRACE_COUNTER,     /* the value `bytes` of the counter `name` of its device from start_ns ("C") */
  EBB_TRACE_FLOW_START,  /* the tail of flow `id`, bound to the slice enclosing start_ns ("s") */
  EBB_TRACE_FLOW_END,    /* the head of flow `id`, bound to the slice enclosing start_ns ("f") */
  EBB_TRACE_KIND_COUNT
} ebb_trace_kind;

/* Which of a record's optional arguments are set (ebb_trace_span.args). owner is set when not NULL. */
enum { EBB_TRACE_ARG_TASK = 1u, EBB_TRACE_ARG_SEQ = 2u, EBB_TRACE_ARG_BYTES = 4u };

/* One record (the name is from when every record was a span). */
typedef struct ebb_trace_span {
  const char *name;   /* static or interned string (ebb_trace_intern): must outlive the export */
  uint64_t start_ns;  /* CLOCK_MONOTONIC (ebb_trace_now_ns) */
  uint64_t end_ns;    /* a span's end (>= start_ns); start_ns for the other kinds */
  uint32_t tid;       /* small per-thread number assigned by ebb (ignored by ebb_trace_record) */
  int32_t device;     /* -1: host */
  uint64_t stream;    /* driver stream handle value: the record is on that stream's track; 0: on the thread's */
  uint32_t kind;      /* ebb_trace_kind */
  uint32_t args;      /* EBB_TRACE_ARG_* set below */
  uint64_t id;        /* flows: the id pairing start and end (ebb_trace_flow_id); else 0 */
  uint64_t task;      /* graph task (EBB_TRACE_ARG_TASK) */
  uint64_t seq;       /* the node's sequence number (EBB_TRACE_ARG_SEQ) */
  uint64_t bytes;     /* bytes, or a counter's value (EBB_TRACE_ARG_BYTES; always read for a counter) */
  const char *owner;  /* who owns the bytes, static or interned (NULL: none) */
} ebb_trace_span;

/* Allocates a ring of `capacity` records (rounded up to a power of two, at least 64, at most
 * 2^30) and starts recording. Calling it again while on resizes and clears. EBB_EINVAL for 0,
 * EBB_ENOMEM when the ring cannot be allocated (the previous state stays). Enable and disable
 * must not race with records made on other threads: enable before the work, export after. */
EBB_API ebb_status ebb_trace_enable(size_t capacity);
/* Stops recording; what the ring holds stays for export. */
EBB_API void ebb_trace_disable(void);
EBB_API bool ebb_trace_enabled(void);
EBB_API uint64_t ebb_trace_now_ns(void);

/* Records one finished span on the calling thread's track (stream 0) or on `stream`'s. No-op
 * when tracing is off. Lock-free, any thread. */
EBB_API void ebb_trace_span_add(const char *name, int device, uint64_t stream, uint64_t start_ns, uint64_t end_ns);

/* Records a copy of `*rec` as made by the calling thread (rec->tid is ignored). Lock-free, any
 * thread; EBB_OK, with nothing recorded, when tracing is off. EBB_EINVAL, nothing recorded, for
 * NULL, a kind outside ebb_trace_kind, a span ending before it starts, or a flow with id 0.
 * The strings it points to (name, owner) are not copied: static or interned ones only. */
EBB_API ebb_status ebb_trace_record(const ebb_trace_span *rec);

/* A new flow id, never 0, unique in the process. Lock-free, any thread, on or off. */
EBB_API uint64_t ebb_trace_flow_id(void);

/* Names the calling thread's track in exports ("thread_name" metadata), replacing an earlier
 * name. The text is copied (at most 63 bytes kept); names stay across ebb_trace_enable and until
 * the process ends. Works on or off. EBB_EINVAL for NULL or "", EBB_ENOMEM. Takes the trace lock. */
EBB_API ebb_status ebb_trace_thread_name(const char *name);

/* Names the track of driver stream `stream` of `device` ("stream 5 (device 0)" for ebb's own
 * streams, named when they are made). The text is copied (at most 63 bytes); a driver handle
 * reused by a later stream takes the later name, for its earlier records too. Works on or off.
 * EBB_EINVAL for a device outside [0, EBB_MAX_DEVICES), stream 0, a NULL or empty name;
 * EBB_ENOMEM. Takes the trace lock. */
EBB_API ebb_status ebb_trace_stream_name(int device, uint64_t stream, const char *name);

/* Returns a copy of `s` that lives until the process ends (deduplicated). NULL for NULL and on
 * ENOMEM. Takes the trace lock: for names made once (a kernel's, a node type's), not per record. */
EBB_API const char *ebb_trace_intern(const char *s);

/* Records currently held (at most the capacity) and records dropped by wrap-around since enable. */
EBB_API ebb_status ebb_trace_counts(size_t *held, uint64_t *dropped);
/* Copies up to `max` records, oldest first, into `out`; `*n` gets how many. Records being
 * written or overwritten while it copies are skipped, never copied half-written. (A writer that
 * finds its slot still being written by another a whole lap behind drops its record: only a
 * ring far too small for the rate of records, or a writer stalled for a lap, does that.) */
EBB_API ebb_status ebb_trace_snapshot(ebb_trace_span *out, size_t max, size_t *n);

/* Writes the records the ring holds as {"displayTimeUnit":"ns","traceEvents":[...]} (the layout
 * at the top of this file): timestamps in microseconds with nanosecond digits, relative to the
 * earliest record; process and thread names as metadata events; each span's device, stream,
 * graph task, sequence number, bytes and owner as args. The file is written whole or, on
 * failure, removed. EBB_EINVAL for a NULL or empty path, EBB_EIO when the file cannot be
 * written, EBB_ENOMEM. Safe while other threads record (their newest records may be missing). */
EBB_API ebb_status ebb_trace_export_json(const char *path);

#ifdef __cplusplus
}
#endif
#endif /* EBB_TRACE_H */
