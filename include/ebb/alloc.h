/* ebb/alloc.h: memory. One stream-ordered caching arena engine serving device memory, pinned
 * host memory and plain host memory, each through its own upstream; allocation history and
 * snapshots that know who owns every byte.
 *
 * Device arena (one per device): blocks carved from driver segments, size classes (small
 * requests <= 1 MiB from 2 MiB segments, medium from 20 MiB segments, large rounded to 2 MiB),
 * split and merge, stream-ordered reuse: a block freed on stream S is reusable on S at once; a
 * block also used on other streams (declared with ebb_arena_record_stream) becomes reusable when
 * events recorded on those streams at free time complete, checked at allocation time without a
 * host sync. On exhaustion the arena releases its cached free segments (waiting only for the
 * events that must complete), retries, and then fails with EBB_ENOMEM and a report.
 *
 * Configuration: EBB_ALLOC_CONF, comma-separated key:value pairs read at the arena's first use
 * after each ebb_init:
 *   max_split_size_mb:N      blocks of N MiB or more are never split (default: no limit)
 *   expandable_segments:0|1  grow one VMM reservation per device instead of separate segments
 *   pinned_max_bytes:N       cap on pinned bytes held (default: no cap)
 *   oom_snapshot:PATH        write a memory snapshot when an allocation fails
 *
 * Threading: every function is thread-safe. Pointers may be freed from any thread.
 */
#ifndef EBB_ALLOC_H
#define EBB_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- device arena ------------------------------------------------------------------------ */

/* Allocates `bytes` of `device` memory for use on `stream` (NULL: the calling thread's current
 * stream of `device`). The block is 512-byte aligned. bytes == 0 is defined: *ptr = NULL and
 * EBB_OK (freeing NULL is a no-op). EBB_EDEVICE for a missing device, EBB_EDEVICE when `stream`
 * belongs to another device, EBB_ENOMEM with a report in ebb_last_error() when the device (or
 * the arena's limit) cannot hold the request after releasing cached memory. */
EBB_API ebb_status ebb_arena_alloc(int device, size_t bytes, ebb_stream_t *stream, void **ptr);
/* Returns the block to its arena. Reusable on its allocation stream at once; on other streams
 * once the uses declared with ebb_arena_record_stream have completed. NULL is a no-op.
 * EBB_EINVAL for a pointer the arena did not hand out (or an interior pointer), EBB_EFREED for a
 * block already freed. */
EBB_API ebb_status ebb_arena_free(void *ptr);
/* Declares that `stream` uses the block at `ptr`; its reuse waits for that stream's work issued
 * before the free. Recording the allocation stream is a no-op. EBB_EFREED on a freed block. */
EBB_API ebb_status ebb_arena_record_stream(void *ptr, ebb_stream_t *stream);
/* Returns every cached, fully free segment of `device` to the driver (and unmaps free granules of
 * expandable segments), waiting only for the events of blocks freed with pending uses. */
EBB_API ebb_status ebb_arena_empty_cache(int device);
/* Caps the bytes the arena may reserve on `device` (0: no cap beyond the device's memory). */
EBB_API ebb_status ebb_arena_set_limit(int device, size_t bytes);
/* The same cap as a fraction (0, 1] of the device's total memory. */
EBB_API ebb_status ebb_arena_set_limit_fraction(int device, double fraction);

typedef struct ebb_arena_stat {
  uint64_t current, peak;
} ebb_arena_stat;

/* Counters as PyTorch's caching allocator reports them (memory_stats), for one device. */
typedef struct ebb_arena_stats {
  ebb_arena_stat allocated_bytes; /* bytes in blocks handed out (after rounding) */
  ebb_arena_stat reserved_bytes;  /* bytes held from the driver (segments, mapped granules) */
  ebb_arena_stat active_bytes;    /* allocated, or freed but waiting for other streams */
  ebb_arena_stat requested_bytes; /* bytes callers asked for (before rounding) */
  ebb_arena_stat segments;        /* driver segments held */
  ebb_arena_stat inactive_split;       /* free pieces of split segments (count) */
  ebb_arena_stat inactive_split_bytes; /* and their bytes */
  uint64_t alloc_count, free_count;
  uint64_t cache_hits;          /* allocations served without a driver call */
  uint64_t num_alloc_retries;   /* allocations that needed to release the cache and retry */
  uint64_t num_ooms;
  uint64_t num_syncs;           /* host waits on events (release paths only) */
  uint64_t num_steals;          /* allocations served from another stream's free block, ordered
                                   after that stream's work by an event (no host wait) */
  uint64_t num_device_alloc, num_device_free; /* driver allocations / frees (or map / unmap) */
  size_t limit;                 /* 0: none */
} ebb_arena_stats;

EBB_API ebb_status ebb_arena_get_stats(int device, ebb_arena_stats *out);
/* Sets every peak to its current value. */
EBB_API ebb_status ebb_arena_reset_peak(int device);

/* Walks every segment of `device` and checks the arena's invariants (blocks tile their segment,
 * no two adjacent free blocks left unmerged, the free index matches the blocks, stats match the
 * walk). EBB_EINTERNAL with the first broken invariant in the message. For tests. */
EBB_API ebb_status ebb_arena_debug_check(int device);

#ifdef __cplusplus
}
#endif
#endif /* EBB_ALLOC_H */
