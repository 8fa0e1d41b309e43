/* ebb/alloc.h: memory. One stream-ordered caching arena engine serving device memory, pinned
 * host memory and plain host memory, each through its own upstream; allocation history and
 * snapshots that know who owns every byte.
 *
 * Device arena (one per device): blocks carved from an expandable segment (the default where
 * the driver has VMM, see below) or from driver segments with size classes (small requests
 * <= 1 MiB from 2 MiB segments, medium from 20 MiB segments, large rounded to 2 MiB),
 * split and merge, stream-ordered reuse: a block freed on stream S is reusable on S at once; a
 * block also used on other streams (declared with ebb_arena_record_stream, or by a copy) becomes
 * reusable when events recorded on those streams at free time complete, checked at allocation
 * time without a host sync. Before the arena grows (a driver call, and memory reserved until
 * empty_cache), an allocation that no free block holds waits instead, on the host, for such
 * pending frees when their blocks (not slab slots) add up to the request, except those waiting
 * only for the allocating stream itself (its new work follows its queued work anyway; a host
 * wait would only put the host in step with it): the oldest first, one event at a time,
 * searching again after each, growing only if what is left pending could not hold it
 * (num_pending_waits counts the allocations served so), for at most pending_wait_us in all, so
 * that a stream held up by the allocating thread itself cannot hold it for ever (0 turns it
 * off, as PyTorch's allocator, which grows and waits only once the driver refuses). So a training step
 * whose demand repeats does not grow the arena when the streams its frees wait for (offload
 * copies, cross-device copies) run late. Near capacity, when the size policy's segment (20 MiB for a 3 MiB request) does not
 * fit, one just large enough for the request (large requests rounded to 2 MiB) is tried before
 * anything else. With expandable segments the arena is one VMM reservation per device, one pool
 * for every size, grown at its end by the granules a request needs beyond the free tail. On
 * exhaustion the arena releases its cached free segments (and unmaps free granules, after a
 * device synchronisation), retries, and then fails with EBB_ENOMEM and a report that says which
 * sizes it tried.
 *
 * Placement: among the free blocks of its stream that hold it, a request below 2 MiB takes the
 * oldest one below 2 MiB (a hole that larger requests could not use); otherwise a request takes
 * the oldest one (the oldest segment that has one, lowest address first); the free end of an
 * expandable segment comes last, so that growth extends it. On PyTorch training traces a
 * training step's driver calls are all made by its second repetition (perf/RESULTS.md); a
 * random sequence repeated exactly may still grow the arena in a later pass.
 *
 * Small requests (rounded size <= slab_max_bytes, 64 KiB by default) are slots of slabs: a slab
 * is one block of the small pool, on one allocation stream, cut into slots of one rounded size.
 * A slot is freed, reused and stream-ordered as a block is (same sizes, same stats, same history
 * actions at the slot's own address); a slab whose slots are all free goes back to the arena as a
 * free block (one per stream and size is kept for reuse), and empty_cache gives every empty slab
 * back first. The pinned and host pools use slabs too.
 *
 * Configuration: EBB_ALLOC_CONF, comma-separated key:value pairs checked by the first ebb_init
 * (an unknown key or a bad value fails it with EBB_EINVAL naming the variable, the value and what
 * is accepted) and used by the arenas until the last ebb_shutdown:
 *   max_split_size_mb:N      blocks of N MiB or more are never split (default: no limit; N >= 20);
 *                            such a block serves a request of N MiB or more within 20 MiB of
 *                            its size, or a smaller one whose own segment would be as large.
 *                            No effect with expandable segments (their blocks are always split)
 *   expandable_segments:0|1  grow one VMM reservation per device instead of separate segments
 *                            (default: 1 on a device whose driver has VMM, ebb_dev_caps.vmm:
 *                            every current GPU and the emulated driver; 0 elsewhere). 1 on a
 *                            device without VMM: that device uses classic segments, and
 *                            ebb_init says so through the warning handler, once per device
 *   pinned_max_bytes:N       cap on pinned bytes held (default: no cap)
 *   oom_snapshot:PATH        write a memory snapshot (ebb_memory_snapshot_json) to PATH when an
 *                            allocation fails with EBB_ENOMEM
 *   history:N                keep the newest N allocator actions per device (default 65536;
 *                            0 turns the history off)
 *   slab_max_bytes:N         largest rounded request served by a slab slot, at most 64K
 *                            (default 64K; 0 turns slabs off), for every arena and pool
 *   pending_wait_us:N        before growing a device arena, wait on the host up to N
 *                            microseconds for frees pending on other streams that could hold
 *                            the request, then grow (default 20000; at most 10^7; 0: grow at
 *                            once, never a host wait on the allocation path short of the OOM
 *                            retry). The pinned and host pools never wait
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
 * the arena's limit) cannot hold the request after releasing cached memory; the report ends
 * with the device's live bytes by owner category (largest first) and the five owners holding
 * the most allocated bytes. With expandable
 * segments, a failure of the device wait before unmapping cached granules (on the way to an
 * OOM) is returned as is, with the driver's message. The block is recorded as owned by the
 * calling thread's innermost owner scope (ebb_alloc_owner_push). May wait on the host, before
 * growing the arena, for work already queued on the streams that used blocks freed earlier
 * (pending_wait_us, above; at most that long), never with the arena's lock held: frees and allocations of other
 * threads go on meanwhile. */
EBB_API ebb_status ebb_arena_alloc(int device, size_t bytes, ebb_stream_t *stream, void **ptr);
/* Returns the block to its arena. Reusable on its allocation stream at once; on other streams
 * once the uses declared with ebb_arena_record_stream have completed. NULL is a no-op.
 * EBB_EINVAL for a pointer the arena did not hand out (or an interior pointer), EBB_EFREED for a
 * block already freed, or one from before a completed last ebb_shutdown (which refuses with
 * EBB_EBUSY while any block is live, and gives back the memory of freed ones). */
EBB_API ebb_status ebb_arena_free(void *ptr);
/* Declares that `stream` uses the block at `ptr`; its reuse waits for that stream's work issued
 * before the free. Recording the allocation stream is a no-op. ebb_copy_async records its
 * stream itself on the blocks it reads or writes (and refuses a copy past a block's end); this
 * call is for other work: kernels, host functions. EBB_EFREED on a freed block;
 * EBB_ELIMIT past 4 096 distinct streams on one block (a stream made and released per use
 * counts anew each time). */
EBB_API ebb_status ebb_arena_record_stream(void *ptr, ebb_stream_t *stream);
/* Returns every cached, fully free segment of `device` to the driver (and unmaps free granules of
 * expandable segments), waiting only for the events of blocks freed with pending uses; with
 * expandable segments it first waits for the whole device, and allocations and frees of other
 * threads on this device's arena wait with it. When that wait fails (a failing device), nothing
 * is unmapped and its status is returned, with the driver's message in ebb_last_error(); the
 * classic segments are still given back. */
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
  ebb_arena_stat inactive_split;       /* free pieces of split segments (count), and the free
                                          slots of slabs (each a piece: free memory inside a
                                          split block, unusable by other sizes until its slab
                                          is empty and given back) */
  ebb_arena_stat inactive_split_bytes; /* and their bytes */
  uint64_t alloc_count, free_count;
  uint64_t cache_hits;          /* allocations served without a driver call */
  uint64_t num_alloc_retries;   /* allocations that needed to release the cache and retry */
  uint64_t num_ooms;
  uint64_t num_syncs;           /* host waits on events: the release paths, and the waits for
                                   pending frees before growth (num_pending_waits) */
  uint64_t num_steals;          /* allocations served from another stream's free block, ordered
                                   after that stream's work by an event (no host wait) */
  uint64_t num_pending_waits;   /* allocations served by waiting on the host for frees pending
                                   on other streams instead of growing the arena (device arenas,
                                   pending_wait_us; 0 for the pinned and host pools) */
  uint64_t num_device_alloc, num_device_free; /* driver allocations / frees (or map / unmap) */
  size_t limit;                 /* 0: none */
} ebb_arena_stats;

/* The counters of `device`. Frees waiting for events on other streams whose events have
 * completed are retired first (an event query each, never a host wait), so after the device
 * has finished with every freed block active_bytes is what is really allocated. */
EBB_API ebb_status ebb_arena_get_stats(int device, ebb_arena_stats *out);
/* Sets every peak to its current value. */
EBB_API ebb_status ebb_arena_reset_peak(int device);

/* Walks every segment of `device` and checks the arena's invariants (blocks tile their segment,
 * no two adjacent free blocks left unmerged, the free index matches the blocks, stats match the
 * walk). EBB_EINTERNAL with the first broken invariant in the message. For tests. */
EBB_API ebb_status ebb_arena_debug_check(int device);

/* ---- pinned host pool ----------------------------------------------------------------------
 * The same engine over page-locked host memory (cuMemHostAlloc, or host pages bound to the NUMA
 * node nearest `device_hint` through hwloc and then registered with cuMemHostRegister). Pinned
 * blocks have no allocation stream: every stream that reads or writes one is declared with
 * ebb_pinned_record_stream, and a freed block becomes reusable when the events recorded on those
 * streams at free time complete (checked when memory is next needed; never a host wait on the
 * allocation path). Requests up to 1 MiB come from 2 MiB segments, larger ones get a segment of
 * exactly their size rounded to 2 MiB (no power-of-two doubling). EBB_ALLOC_CONF's
 * pinned_max_bytes:N caps the bytes held from the driver. Driver calls are never made under a
 * lock. Thread-safe; a block may be freed from any thread. */

/* Allocates `bytes` of pinned host memory, 512-byte aligned, placed on the NUMA node nearest
 * `device_hint` (-1: no preference). bytes == 0: *ptr = NULL and EBB_OK.
 * Failures: EBB_ENOTINIT; EBB_EDEVICE for a device_hint that is neither -1 nor a device;
 * EBB_EINVAL for a NULL ptr; EBB_ELIMIT when the request would take the pool past
 * pinned_max_bytes (the message gives the cap, what is held and what was asked); EBB_ENOMEM when
 * the driver cannot pin more. */
EBB_API ebb_status ebb_pinned_alloc(size_t bytes, int device_hint, void **ptr);
/* Returns a pinned block to the pool; reusable once the uses recorded with
 * ebb_pinned_record_stream have completed. NULL is a no-op. EBB_EINVAL for a pointer the pool
 * did not hand out (a device or host-pool pointer is named as such), EBB_EFREED for a block
 * already freed. */
EBB_API ebb_status ebb_pinned_free(void *ptr);
/* Declares that work on `stream` uses the pinned block at `ptr`. ebb_copy_async records its
 * own stream on the pinned blocks it reads or writes, so a copy needs no call here; kernels
 * and host functions reading the block do.
 * EBB_EFREED on a freed block, EBB_EINVAL for a NULL or foreign pointer or a NULL stream,
 * EBB_ELIMIT past 4 096 distinct streams on one block (as ebb_arena_record_stream). */
EBB_API ebb_status ebb_pinned_record_stream(void *ptr, ebb_stream_t *stream);
/* Returns every fully free pinned segment to the driver (waiting for the events of blocks whose
 * uses are still pending). */
EBB_API ebb_status ebb_pinned_empty_cache(void);
/* Counters of the pinned pool (the fields of ebb_arena_stats; `limit` is pinned_max_bytes). */
EBB_API ebb_status ebb_pinned_get_stats(ebb_arena_stats *out);
/* ebb_arena_debug_check for every pinned arena. For tests. */
EBB_API ebb_status ebb_pinned_debug_check(void);

/* ---- host memory -----------------------------------------------------------------------------
 * The same engine over plain host pages (mmap'ed segments): the memory of CPU tensors, cached,
 * owner-tagged and recorded in the history like device memory. Never malloc: libebb leaves its
 * host program's allocator alone. Blocks are 512-byte aligned. Thread-safe. */

/* bytes == 0: *ptr = NULL and EBB_OK. EBB_EINVAL for a NULL ptr, EBB_ENOMEM when the system has
 * no memory left. */
EBB_API ebb_status ebb_pageable_alloc(size_t bytes, void **ptr);
/* NULL is a no-op; EBB_EINVAL for a foreign pointer, EBB_EFREED for a double free. */
EBB_API ebb_status ebb_pageable_free(void *ptr);
EBB_API ebb_status ebb_pageable_empty_cache(void);
EBB_API ebb_status ebb_pageable_get_stats(ebb_arena_stats *out);
/* ebb_arena_debug_check for the host pool. For tests. */
EBB_API ebb_status ebb_pageable_debug_check(void);

/* ---- owners, history, snapshots ------------------------------------------------------------
 * Every block records who asked for it: the innermost owner scope of the allocating thread
 * (category + name), or EBB_OWNER_OTHER with the name "" outside any scope. Each device keeps a
 * bounded ring of allocator actions (as PyTorch's _record_memory_history) and
 * a snapshot writes segments, blocks and those rings as JSON in the layout of PyTorch's
 * torch.cuda.memory._snapshot(), with the owner added to blocks and
 * actions. */

typedef enum ebb_owner_cat {
  EBB_OWNER_OTHER = 0,
  EBB_OWNER_PARAMETER,
  EBB_OWNER_GRADIENT,
  EBB_OWNER_SAVED,      /* tensors saved for backward */
  EBB_OWNER_ACTIVATION,
  EBB_OWNER_OPTIMIZER,  /* optimizer state */
  EBB_OWNER_STAGING,    /* copy and transfer buffers */
  EBB_OWNER_BACKWARD    /* a backward's temporaries, named by the node that made them */
} ebb_owner_cat;

#define EBB_OWNER_CAT_COUNT 8
#define EBB_OWNER_MAX_DEPTH 32      /* owner scopes one thread may nest */
#define EBB_OWNER_NAME_MAX 127      /* bytes of an owner name, without the terminating NUL */

/* "other", "parameter", "gradient", "saved", "activation", "optimizer", "staging", "backward"; "unknown"
 * for a value outside the enum. Static strings; thread-safe. */
EBB_API const char *ebb_owner_cat_name(ebb_owner_cat cat);

/* Opens an owner scope on the calling thread: blocks this thread allocates until the matching
 * ebb_alloc_owner_pop are recorded as owned by (cat, name). Scopes nest; the innermost wins.
 * `name` is borrowed: it is copied into a process-wide table of interned names (deduplicated,
 * never freed, so blocks and history entries keep a pointer to it), and the caller may reuse
 * its buffer at once. Needs no ebb_init; the scope stack is per thread and outlives
 * ebb_shutdown. Thread-safe.
 * Failures (the stack is unchanged): EBB_EINVAL for a `cat` outside ebb_owner_cat, a NULL
 * `name` or one longer than EBB_OWNER_NAME_MAX bytes; EBB_ELIMIT when the thread already holds
 * EBB_OWNER_MAX_DEPTH scopes or the table of distinct names is full (65536 names); EBB_ENOMEM
 * when no host memory is left for the name. */
EBB_API ebb_status ebb_alloc_owner_push(ebb_owner_cat cat, const char *name);
/* Closes the calling thread's innermost owner scope. EBB_ESTATE when it has none open. */
EBB_API ebb_status ebb_alloc_owner_pop(void);

/* The owner recorded for the live block (or slab slot) that starts at `ptr`, from any pool:
 * device arena, pinned or host pool. *name (may be NULL) is interned: valid for the process's
 * life, "" for none. Thread-safe.
 * Failures: EBB_ENOTINIT before ebb_init; EBB_EINVAL for a NULL ptr or cat, or a pointer that is
 * not the start of a live block of any pool (freed ones included; the message says which). */
EBB_API ebb_status ebb_alloc_block_owner(const void *ptr, ebb_owner_cat *cat, const char **name);
/* Re-tags the live block (or slot) that starts at `ptr` as owned by (cat, name): snapshots, the
 * OOM report's top owners and the history entries of its free name them from now on (entries
 * recorded before keep the owner they had). The previous owner goes into *old_cat and *old_name
 * (each may be NULL; the name interned, so it can be passed back to restore it). For a layer that
 * takes over memory someone else allocated: autograd tags a tensor saved for backward as saved by
 * its node, a gradient as its leaf's. `name` is interned as by ebb_alloc_owner_push. Thread-safe.
 * Failures (the block unchanged): those of ebb_alloc_block_owner, and of ebb_alloc_owner_push
 * for cat and name. */
EBB_API ebb_status ebb_alloc_block_set_owner(void *ptr, ebb_owner_cat cat, const char *name, ebb_owner_cat *old_cat,
                                             const char **old_name);

typedef enum ebb_alloc_action {
  EBB_ACT_ALLOC = 0,          /* a block handed out */
  EBB_ACT_FREE_REQUESTED,     /* ebb_arena_free called */
  EBB_ACT_FREE_COMPLETED,     /* the block is reusable (after the events of other streams) */
  EBB_ACT_SEGMENT_ALLOC,      /* a segment obtained from the driver */
  EBB_ACT_SEGMENT_FREE,       /* a segment returned to the driver */
  EBB_ACT_SEGMENT_MAP,        /* expandable segment grown by mapping */
  EBB_ACT_SEGMENT_UNMAP,      /* expandable segment shrunk by unmapping */
  EBB_ACT_OOM                 /* an allocation failed: addr = driver free bytes, size = request */
} ebb_alloc_action;

/* PyTorch's trace action names: "alloc", "free_requested", "free_completed", "segment_alloc",
 * "segment_free", "segment_map", "segment_unmap", "oom"; "unknown" otherwise. Static strings. */
EBB_API const char *ebb_alloc_action_name(ebb_alloc_action action);

/* One recorded action. */
typedef struct ebb_alloc_trace_entry {
  uint64_t time_ns;       /* monotonic clock (the clock of ebb_trace_now_ns) */
  uint64_t addr;          /* block or segment address; driver free bytes for EBB_ACT_OOM */
  uint64_t size;          /* block or segment bytes (rounded); requested bytes for EBB_ACT_OOM */
  uint64_t requested;     /* bytes the caller asked for (block actions; 0 for segments) */
  uint64_t stream;        /* stream id (ebb_stream_id) the block or segment was made for */
  int device;
  ebb_alloc_action action;
  ebb_owner_cat owner_cat;
  const char *owner_name; /* interned, never freed; "" when no scope was open */
} ebb_alloc_trace_entry;

/* Copies the newest min(cap, held) entries of `device`'s history into out[], oldest first, and
 * their number into *count; *total (may be NULL) receives the number of actions recorded on the
 * device since the arena started, so total - held actions were overwritten. With out == NULL
 * and cap == 0, *count receives the number of entries held. The history is cleared at
 * ebb_shutdown. Thread-safe (takes the device's arena lock).
 * Failures: EBB_ENOTINIT before ebb_init; EBB_EDEVICE for a missing device; EBB_EINVAL for a
 * NULL `count` or out == NULL with cap > 0. */
EBB_API ebb_status ebb_alloc_history_get(int device, ebb_alloc_trace_entry *out, size_t cap, size_t *count,
                                         uint64_t *total);

/* Writes a snapshot of every device arena to the file `path` (created or truncated) as JSON:
 *   {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
 *     "requested_size", "stream", "segment_type": "small"|"large", "segment_pool_id",
 *     "is_expandable", "frames": [], "blocks": [{"address", "size", "requested_size", "stream",
 *     "state": "active_allocated"|"active_pending_free"|"inactive", "frames": [],
 *     "owner": {"category", "name"}}]}] (a slab's slots are listed as the blocks of its span),
 *    "device_traces": [[{"action", "addr", "size", "requested_size", "stream", "time_us",
 *     "device", "frames": [], "owner": {"category", "name"}}], ...one list per device, oldest
 *     first; oom entries carry the driver's free bytes in "device_free" as well],
 *    "allocator_settings": {"EBB_ALLOC_CONF", "max_split_size", "expandable_segments",
 *     "history", "oom_snapshot", "slab_max_bytes"}}
 * Addresses, sizes and stream ids are JSON integers. Each device's segments and trace are read
 * in one hold of its lock (consistent per device, not across devices); the file is written with
 * no lock held. Thread-safe.
 * Failures: EBB_ENOTINIT before ebb_init; EBB_EINVAL for a NULL `path`; EBB_EIO when the file
 * cannot be written (the message names the path and the system error); EBB_ENOMEM when no host
 * memory is left for the text. */
EBB_API ebb_status ebb_memory_snapshot_json(const char *path);

#ifdef __cplusplus
}
#endif
#endif /* EBB_ALLOC_H */
