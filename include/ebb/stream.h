/* ebb/stream.h: streams, events and asynchronous copies.
 *
 * Per device ebb keeps a default stream (created non-blocking; the legacy NULL stream is never
 * used) and, per priority, a pool of streams handed out round-robin. Each thread has a current
 * stream per device (the default stream until set). Events come from a per-device pool and are
 * recycled. Cross-stream ordering is always an event: a stream waits on an event, never the host.
 *
 * Handles: pool and default streams are owned by ebb and need no release; streams from
 * ebb_stream_create and events from ebb_event_create are owned by the caller and released once.
 * A released handle passed to any call returns EBB_EFREED (handles live in type-stable slots
 * reused first-in-first-out: a slot is not reused before 1024 more handles of its kind and device
 * have been released after it, so a stale handle is reported until then). The last ebb_shutdown
 * refuses with EBB_EBUSY while a caller-owned stream or event is live; once it completes, calls
 * read EBB_ENOTINIT until the next ebb_init, and after it every handle from before the shutdown
 * (pool and default streams included, their message saying the shutdown ended them) reads
 * EBB_EFREED.
 * Threading: every function is thread-safe; a stream or event may be used from any thread. A
 * call racing ebb_stream_release of its stream on another thread either issues its work before
 * the release (which then covers it) or fails with EBB_EFREED; it never reaches the destroyed
 * driver stream. The release waits for such racing calls to finish enqueueing (an enqueue the
 * driver blocks because the stream's queue is full included), never for the work itself.
 * Configuration, checked by the first ebb_init (a malformed value makes it fail with EBB_EINVAL
 * naming the variable, the value and what is accepted): EBB_STREAM_POOL_SIZE (streams per pool, 1..64,
 * default 8), EBB_STAGING_CHUNK (bytes per pinned staging chunk, 4096..2^30, default 4 MiB),
 * EBB_STAGING_CHUNKS (chunks per device, 1..64, default 4).
 */
#ifndef EBB_STREAM_H
#define EBB_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/runtime.h"
#include "ebb/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb_stream ebb_stream_t;
typedef struct ebb_event ebb_event_t;

typedef enum ebb_stream_prio { EBB_PRIO_LOW = 0, EBB_PRIO_HIGH = 1 } ebb_stream_prio;

/* ---- streams ------------------------------------------------------------------------------ */

/* The device's default stream (borrowed, immortal). */
EBB_API ebb_status ebb_stream_default(int device, ebb_stream_t **out);
/* The next stream of the device's pool for `prio`, round-robin (borrowed, immortal).
 * EBB_STREAM_POOL_SIZE streams per priority (default 8, from the environment at init). */
EBB_API ebb_status ebb_stream_from_pool(int device, ebb_stream_prio prio, ebb_stream_t **out);
/* A stream owned by the caller; release it with ebb_stream_release, which does not wait for the
 * stream's work: the driver finishes the work already issued to the stream, then frees it (CUDA
 * semantics); it waits only for calls on the stream racing it on other threads to finish
 * enqueueing (see Threading above). The
 * release records an event of that last work, so arena memory the stream used is reused after
 * it on the device, without a host wait. Releasing a pool or default stream is EBB_EINVAL;
 * releasing twice is EBB_EFREED.
 * A backward running with nodes on the stream (ebb/autograd.h: a backward holds the streams its
 * nodes run on, and the caller's current streams, from its start to its return) defers the
 * release: ebb_stream_release returns EBB_OK at once, and the last such backward to return
 * carries the release out on its own thread. Until then the stream stays live for every caller
 * (work issued to it, or to it as a current stream, runs there), a second release is
 * EBB_EFREED, and ebb_shutdown counts it as live. So a hook, or another thread, may release a
 * stream a backward uses without failing that backward. */
EBB_API ebb_status ebb_stream_create(int device, ebb_stream_prio prio, ebb_stream_t **out);
EBB_API ebb_status ebb_stream_release(ebb_stream_t *s);

/* The calling thread's current stream on `device`: the default stream until set, and again
 * after the stream that was set is released. */
EBB_API ebb_status ebb_stream_current(int device, ebb_stream_t **out);
/* Makes `s` current on its device for the calling thread. */
EBB_API ebb_status ebb_stream_set_current(ebb_stream_t *s);

/* Scoped: makes `s` current on its device and its device current; exit restores both. Nest them
 * like braces on one thread: only the innermost guard of the calling thread may exit; exiting
 * another (an outer one, or one entered on another thread) is EBB_EINVAL, changes nothing, and
 * the message names the innermost guard. Exiting a guard not entered (or twice) is EBB_ESTATE.
 * Exit restores the previous stream only if it is still the same live stream (a stream
 * released meanwhile, even one whose slot a new stream has taken, restores the default one).
 * The fields are ebb's: filled by enter, read by exit. */
typedef struct ebb_stream_guard {
  ebb_stream_t *prev_stream;
  ebb_stream_t *stream;
  struct ebb_stream_guard *outer; /* the thread's innermost guard at enter */
  uint64_t epoch;
  uint32_t prev_gen;
  int device;
  int prev_device;
  uint32_t magic;
} ebb_stream_guard;
EBB_API ebb_status ebb_stream_guard_enter(ebb_stream_guard *g, ebb_stream_t *s);
EBB_API ebb_status ebb_stream_guard_exit(ebb_stream_guard *g);

EBB_API ebb_status ebb_stream_device(const ebb_stream_t *s, int *device);
EBB_API ebb_status ebb_stream_priority(const ebb_stream_t *s, ebb_stream_prio *prio);
/* A process-unique id (never reused), for messages and traces. */
EBB_API ebb_status ebb_stream_id(const ebb_stream_t *s, uint64_t *id);

/* Device, priority and id of a stream in one checked call (the allocator's hot path asks for
 * two of them per allocation). EBB_EINVAL for a NULL stream or out, EBB_EFREED for a released
 * stream; *out is written only on success. */
typedef struct ebb_stream_info {
  int device;
  ebb_stream_prio prio;
  uint64_t id;
} ebb_stream_info;
EBB_API ebb_status ebb_stream_get_info(const ebb_stream_t *s, ebb_stream_info *out);
/* The driver's stream (cuda.h's CUstream), for interop and for ebb_kernel_launch. For a stream
 * from ebb_stream_create it is valid until ebb_stream_release: the caller must not use it after
 * (or while) releasing the stream. */
EBB_API ebb_status ebb_stream_cu(const ebb_stream_t *s, struct CUstream_st **out);
/* Host-blocking wait for all work issued to `s` (spins briefly, then parks). */
EBB_API ebb_status ebb_stream_synchronize(ebb_stream_t *s);
EBB_API ebb_status ebb_stream_query(ebb_stream_t *s, bool *idle);
/* Launches a kernel on `s` (ebb_kernel_launch on the stream's device). */
EBB_API ebb_status ebb_stream_launch(ebb_stream_t *s, const ebb_kernel_t *k, const void *args,
                                     const ebb_launch_cfg *cfg);
/* Runs fn(user) on a driver thread once all earlier work on `s` is done. As CUDA's host functions
 * must not call CUDA, fn must not wait for device work (ebb_stream_synchronize,
 * ebb_event_synchronize, ebb_dev_synchronize), nor call the memory functions of ebb/alloc.h:
 * the wait may be for fn itself, and the arenas wait for their device with their lock held
 * (ebb_arena_empty_cache with expandable segments, an OOM retry), so an alloc or free in fn can
 * wait for a thread that waits for fn. As in CUDA, fn must not make driver calls either: the
 * calls of this header that would (ebb_copy_async, ebb_stream_launch, ebb_stream_host_func,
 * ebb_stream_wait_stream, ebb_stream_query, ebb_stream_synchronize, ebb_stream_release,
 * ebb_event_record, ebb_event_synchronize) fail from fn with EBB_ESTATE, nothing enqueued, on
 * every driver; a host function signals a host thread (an atomic flag, a condition variable),
 * which then makes the calls. The record that carries fn and user comes from a per-device
 * free list (EBB_ENOMEM without host memory for one). */
EBB_API ebb_status ebb_stream_host_func(ebb_stream_t *s, ebb_host_fn fn, void *user);
/* Makes `waiter` wait (on the device, never the host) for all work issued to `s` so far.
 * Any two devices; waiter == s is a no-op. Uses a pooled event, returned at once. */
EBB_API ebb_status ebb_stream_wait_stream(ebb_stream_t *waiter, ebb_stream_t *s);

/* ---- events ------------------------------------------------------------------------------- */

typedef enum ebb_event_flags { EBB_EVENT_DEFAULT = 0, EBB_EVENT_TIMING = 1 } ebb_event_flags;

/* An event of `device` from its pool (created on first use, recycled on release). */
EBB_API ebb_status ebb_event_create(int device, unsigned flags, ebb_event_t **out);
EBB_API ebb_status ebb_event_release(ebb_event_t *e);
/* Captures the work issued to `s` so far. `s` must be on the event's device (EBB_EDEVICE). */
EBB_API ebb_status ebb_event_record(ebb_event_t *e, ebb_stream_t *s);
/* Makes `s` wait for the last record of `e`. Any device may wait on any device's event.
 * An event never recorded is complete: waiting on it does nothing (as CUDA). */
EBB_API ebb_status ebb_event_wait(ebb_event_t *e, ebb_stream_t *s);
EBB_API ebb_status ebb_event_query(ebb_event_t *e, bool *done);
/* Host-blocking wait (spins briefly, then parks). */
EBB_API ebb_status ebb_event_synchronize(ebb_event_t *e);
/* Milliseconds between two recorded timing events of one device. EBB_EINVAL when either lacks
 * EBB_EVENT_TIMING, EBB_EDEVICE across devices, EBB_ESTATE when either is not recorded or not
 * complete yet. */
EBB_API ebb_status ebb_event_elapsed(ebb_event_t *start, ebb_event_t *end, float *ms);
EBB_API ebb_status ebb_event_device(const ebb_event_t *e, int *device);

/* ---- copies ------------------------------------------------------------------------------- */

/* Copies `bytes` from src to dst in the order of `s`, without blocking the host. The direction
 * comes from the pointers (host pageable, host pinned, device of any ordinal):
 *  - pageable host source: copied into pinned staging chunks at call time, then to the device, so
 *    the caller may reuse src when the call returns;
 *  - pageable host destination: staged device -> pinned, then copied into dst by a host function
 *    in stream order; dst must stay valid until `s` reaches that point;
 *  - peer copy (devices differ): `s` must belong to one of the two devices (else EBB_EDEVICE);
 *    `s` first waits for the other device's current stream (its pending writes to src or uses
 *    of dst), and that stream then waits for the copy, each through a pooled event;
 *  - any other copy involves one device, and `s` must belong to it (else EBB_EDEVICE), so the
 *    copy is ordered with that device's work.
 * Blocks of ebb's arenas (ebb_arena_alloc, ebb_pinned_alloc, ebb_pageable_alloc; a side may point
 * inside a block): a copy on a stream other than the block's allocation stream records that
 * use itself, as ebb_arena_record_stream / ebb_pinned_record_stream would, so a block freed
 * before the copy ran is not handed to a new owner until it has (a forgotten record_stream cannot
 * corrupt the copy or the new owner's data). A side that runs past the bytes its
 * block was asked for (not its rounded size) is EBB_EINVAL, with the block's address, requested
 * size and the side's offset in the message, and nothing is enqueued. A pageable block as the
 * source is read before the call returns, so nothing is recorded on it. Memory from elsewhere
 * (the driver, malloc) is copied unchecked.
 * bytes == 0 is a no-op success (the pointers may then be NULL, as an empty tensor's are).
 * NULL pointers, overlapping src and dst ranges, and host to host copies (use memcpy) are
 * EBB_EINVAL; a released stream is EBB_EFREED (a staged copy racing the release may have
 * enqueued its first chunks); a copy from a host function is EBB_ESTATE (ebb_stream_host_func). */
EBB_API ebb_status ebb_copy_async(void *dst, const void *src, size_t bytes, ebb_stream_t *s);

/* Counters for tests and benchmarks, summed over devices, counted from the first streams call
 * after ebb_init (they restart after the last ebb_shutdown). */
typedef struct ebb_stream_stats {
  uint64_t streams_created;   /* driver streams created */
  uint64_t events_created;    /* driver events created for the event pools (pool misses) */
  uint64_t event_pool_hits;
  uint64_t staged_bytes;      /* bytes copied through pinned staging */
  uint64_t staging_waits;     /* times a staging chunk had to be waited for */
} ebb_stream_stats;
EBB_API ebb_status ebb_stream_get_stats(ebb_stream_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* EBB_STREAM_H */
