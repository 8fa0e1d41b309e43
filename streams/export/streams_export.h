/* streams_export.h: what the streams module offers the modules built on it (alloc, ops) beyond
 * its public header: fast checks for their hot paths. Not installed, not part of the API.
 *
 * The public checks (ebb_stream_get_info and friends) build a message naming the call on every
 * failure and are paid for on every success as two or three calls deep; an allocator entry that
 * only needs "is this a live stream, and which id and device" asks here in one call, and goes to
 * the public call only when the answer is no, for its message.
 */
#ifndef EBB_STREAMS_EXPORT_H
#define EBB_STREAMS_EXPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/stream.h"
#include "ebb_internal.h"

/* Caller-owned events are counted so the last ebb_shutdown can refuse while any is live; a
 * module that creates events for its own use (the arena) takes them out of the count with -1
 * after ebb_event_create and gives it back with +1 before ebb_event_release. */
EBB_HIDDEN void ebb__events_live_add(long delta);
/* The same for streams (ebb_stream_create): the offload streams of autograd are its own. */
EBB_HIDDEN void ebb__streams_live_add(long delta);

/* Whether `s` is a live stream of a started module; if so its id and device in *id, *device.
 * A stream whose release has begun but has not recorded its last work yet counts as live (its
 * driver stream still exists, and ebb__stream_wait_released would not find its release's event
 * yet): ebb__event_record_live records on it. False says nothing about why (ebb not
 * initialised, module not started yet, NULL, released, not a stream): the caller then calls the
 * public check, which starts the module when it can and names the reason. Lock-free: an acquire
 * load of the module phase and of the slot's magic. */
EBB_HIDDEN bool ebb__stream_peek(const ebb_stream_t *s, uint64_t *id, int *device);

/* Holds `s`, the live stream whose id is `id`, for a while (a backward, from its start to its
 * return): a release of `s` asked meanwhile (ebb_stream_release returns EBB_OK at once) is
 * carried out by the last ebb__stream_unhold, so until then `s` stays live for everyone, and
 * work issued to it, or to it as a current stream, never fails for its release. A release asked
 * while others hold `s` is joined (the stream stays live for this holder too). Pool and default
 * streams need no hold (true, nothing counted). False, quietly, when `s` is not live, not the
 * stream `id`, or its release was asked with no holder left: the caller then orders after its
 * work (ebb__event_record_live, else ebb__stream_wait_released). Lock-free: a compare-and-swap.
 * Each true is paired with one ebb__stream_unhold, on any thread; the holder must not wait on
 * the host for a release of `s` (it would wait for itself). */
EBB_HIDDEN bool ebb__stream_hold(ebb_stream_t *s, uint64_t id);
EBB_HIDDEN void ebb__stream_unhold(ebb_stream_t *s);

/* Makes `waiter` wait, on the device and never the host, for all the work issued to the stream
 * of `device` whose id was `id` and which has since been released (ebb_stream_release records an
 * event on a stream before destroying it). For a module that kept a stream's id and must order
 * after it once its handle is gone: the arena, for blocks a released stream used. EBB_OK also
 * when there is nothing to wait for (that work is known complete); the caller vouches that `id`
 * was a stream of `device` and is no longer live (a live one is ordered with an event of its
 * own). An error status when `waiter` is not a live stream or `device` is out of range. When the
 * release could neither record nor wait for that work (a failing driver), the host waits for the
 * whole device instead (ebb_dev_synchronize), and its failure is the call's. */
EBB_HIDDEN ebb_status ebb__stream_wait_released(ebb_stream_t *waiter, int device, uint64_t id);

/* Records event `e` (of `device`) so that it completes after all the work issued to the
 * released stream `id` of `device`: for a module that must poll for that work rather than order a
 * stream after it (the arena, for a block a released stream used, freed after the release). The
 * record is made on an internal stream of the device that waits on the release's event, so no
 * caller's stream gains a dependency; with that work known complete, e completes at once. Same
 * contract on `id` as ebb__stream_wait_released; errors for a bad event or device. */
EBB_HIDDEN ebb_status ebb__event_record_released(ebb_event_t *e, int device, uint64_t id);

/* Records event `e` on `s` if `s` is still the live stream whose id is `id`; EBB_EFREED, with
 * nothing recorded, once it has been released (then ebb__event_record_released or
 * ebb__stream_wait_released order after its work). The check and the record are one step
 * against ebb_stream_release, so a release on another thread is seen either before the check or
 * after the record, never between them (when the driver stream could already be destroyed).
 * For modules that keep another caller's stream handle and id (the arena: the streams that last
 * used a block) while its owner may release it. Errors for a bad event or another device's. */
EBB_HIDDEN ebb_status ebb__event_record_live(ebb_event_t *e, const ebb_stream_t *s, uint64_t id);

/* A check that a module above streams makes on each side of every ebb_copy_async, after the
 * copy's own checks and before anything is enqueued: alloc registers one when it starts, so a
 * copy touching an arena or pinned block on a stream other than the block's own records that use
 * itself (a forgotten record_stream cannot hand the block to a new owner under the copy) and a
 * copy running past the block's end is refused. streams cannot include alloc (layer order), so
 * alloc hands streams this function instead.
 *
 * ptr and bytes are one side of the copy (interior pointers included), is_dst says which side;
 * s is the copy's stream, live, with its id and device. EBB_OK lets the copy go on; any other
 * status fails ebb_copy_async with it and the hook's message (ebb__fail naming
 * "ebb_copy_async"), with nothing enqueued. Called on the copy's thread with no streams lock
 * held; it may take alloc's locks and record nothing on the driver. */
typedef ebb_status (*ebb__copy_hook_fn)(void *ptr, size_t bytes, bool is_dst, ebb_stream_t *s, uint64_t sid, int sdev);

/* Runs the copy hook (when one is installed) on one side of a copy that a module above is about
 * to make on `s` through ebb_copy_async, before it enqueues anything else: ops checks a
 * destination so that a copy refused there leaves no earlier work behind (ebb_tensor_to_host_async
 * makes a contiguous copy first). The side's use is recorded on its block as the copy would;
 * the copy's own call then finds it recorded. Errors as the hook's; s must be live. */
EBB_HIDDEN ebb_status ebb__copy_side_check(void *ptr, size_t bytes, bool is_dst, ebb_stream_t *s);

/* Whether the calling thread is running a caller's host function (ebb_stream_host_func): calls
 * that could wait on the host for work queued behind that function refuse to run there, and so
 * does the copy hook for memory its locks guard. */
EBB_HIDDEN bool ebb__in_host_fn(void);

/* Whether all the work issued to the released stream `id` of `device` is done: its release's
 * event completed, or was reaped as complete. The caller vouches that `id` is no longer live
 * (ebb__stream_peek). False when that work may still run, or the device is out of range. Takes
 * the device's tomb lock (a leaf) and queries one event: for the arena, pruning the uses of
 * released streams from a block kept across many of them. */
EBB_HIDDEN bool ebb__stream_released_done(int device, uint64_t id);

/* Installs `fn` as the copy hook (NULL removes it). alloc sets it at its start and clears it at
 * its teardown, which runs before streams' own; copies racing the teardown are the caller's
 * error (no call may race ebb_shutdown). Release store; ebb_copy_async loads it with acquire. */
EBB_HIDDEN void ebb__copy_hook_set(ebb__copy_hook_fn fn);

#endif /* EBB_STREAMS_EXPORT_H */
