/* arena_impl.h: what the files of alloc/ share; nothing outside alloc/ includes it.
 *
 * One engine (arena.c) carves blocks out of segments that an upstream provides; the memory kind
 * lives only in the upstream table, one engine for every kind: device memory through the driver (device.c),
 * pinned and plain host memory through theirs (host.c). The engine never touches the memory it
 * hands out, so it works for memory the host cannot even read.
 *
 * The files, each with one job; the second half of this header declares what each provides, a
 * section per file in this order:
 *   arena.c     the engine: block and segment records, split and merge, allocation (the hit
 *               path, steals, runs, growth, the retry chain, the OOM report), free, the release
 *               paths, limits and counters, the arena's life cycle
 *   fidx.c      the free index: per stream (spool) and pool, a B+-tree in (segment age,
 *               address) order; holes below 2 MiB first, else the oldest fit, the tail last
 *   xseg.c      expandable segments: one VMM reservation mapped granule by granule
 *   pending.c   frees that wait for events on the streams that used the memory, those uses,
 *               and the event cache
 *   slab.c      size-class slabs for small requests, and the walk over a segment's blocks and
 *               slots (struct ebb__piece)
 *   addrmap.c   from an address to its block or slot (the granule map and the ptrmap), and
 *               what a pointer that is no live block is
 *   copy.c      the copy hook: bounds and use records of ebb_copy_async's sides
 *   check.c     the debug walk
 *   owner.c     owner scopes, interned owner names, the owner of a live block
 *   history.c   the per-arena ring of allocator actions
 *   snapshot.c  the JSON snapshot and the OOM report's top owners
 *   module.c    the registry of arenas, EBB_ALLOC_CONF, start and teardown, the entry check
 *   device.c    the device upstream and the public ebb_arena_* calls
 *   host.c      the pinned and host pools: their upstreams and public calls
 * The first half holds the records they share.
 *
 * Ownership: an arena owns its segments, its block records (carved from chunks, recycled, freed
 * only at teardown, so a stale block pointer always points at a block record), its per-stream
 * free indexes, its pending-free queues and an event cache. Pointer -> block lookup is shared by
 * every arena: live blocks larger than 64 KiB (every block, with the default slab_max) are in
 * the process-wide granule map beside the slabs, smaller ones in a sharded hash (addrmap.c).
 *
 * Threading: every field of struct ebb__arena and of its blocks and segments is protected by the
 * arena's `mu` (rank EBB_RANK_ARENA). A ptrmap shard lock is a leaf spin lock, taken with or
 * without `mu` held, never the other way round. Events are created and released (which takes
 * the streams module's event-pool lock, ranked below the arena) only with `mu` dropped. They
 * are recorded, waited for and synchronised with `mu` dropped too: a record or a wait blocks
 * while its stream's queue is full, and a host function queued there that frees memory of this
 * arena would wait for `mu` for ever. Querying never blocks and is done under `mu`. The device
 * synchronisation before expandable granules are unmapped (empty_cache, the OOM retry chain) is
 * done with `mu` held, so that no block freed meanwhile is unmapped under queued work; host
 * functions must therefore not call this module (include/ebb/stream.h says so). VMM map/unmap
 * also run under `mu`.
 */
#ifndef EBB_ARENA_IMPL_H
#define EBB_ARENA_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "ebb/alloc.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_internal.h"
#include "ebb_list.h"
#include "runtime_export.h"
#include "ebb_sync.h"
#include "streams_export.h"

/* ==============================================================================================
 * The records the files share; each says which file owns it where that is not arena.c.
 * ============================================================================================== */

/* ---- sizes (the constants of PyTorch's CUDA caching allocator) ------------------------------ */

#define EBB__MIN_BLOCK ((size_t)512)             /* every size is rounded up to this */
#define EBB__SMALL_SIZE ((size_t)1 << 20)        /* largest request of the small pool */
#define EBB__SMALL_SEGMENT ((size_t)2 << 20)     /* segment of the small pool */
#define EBB__MIN_LARGE_ALLOC ((size_t)10 << 20)  /* below this a large request gets ... */
#define EBB__LARGE_SEGMENT ((size_t)20 << 20)    /* ... a 20 MiB segment */
#define EBB__ROUND_LARGE ((size_t)2 << 20)       /* larger segments are rounded to 2 MiB */
#define EBB__OVERSIZE_SLACK ((size_t)20 << 20)   /* an oversize block serves requests this close */

enum ebb__pool { EBB__POOL_SMALL = 0, EBB__POOL_LARGE = 1, EBB__NPOOLS = 2 };

/* Where a block's memory comes from, recorded in the block: free routes by it, history reports it. */
enum ebb__memkind { EBB__MEM_DEVICE_ARENA = 1, EBB__MEM_PINNED_POOL = 2, EBB__MEM_HOST_POOL = 3 };

enum ebb__bstate {
  EBB__B_FREE = 0,    /* in its stream's free index */
  EBB__B_ALLOC = 1,   /* handed out; in the address map or the ptrmap (by size) */
  EBB__B_FREEING = 2, /* free requested, events being recorded with the lock dropped */
  EBB__B_PENDING = 3, /* free requested, waiting for events on the streams that used it */
  EBB__B_DEAD = 4,    /* record on the arena's spare list */
  EBB__B_UNMAPPED = 5, /* a hole of an expandable segment: whole granules given back to the driver
                          by empty_cache; in no index, not reserved; mapped again on growth */
  EBB__B_SLAB = 6,     /* carved into slots of one size class (slab.c); in no index, not in the
                          ptrmap; its slots carry their own state (struct ebb__slot) */
  EBB__B_ASIDE = 7,    /* free memory (counted in its segment's nfree and free_bytes, shown as
                          inactive) in no index and merging with nothing: what a steal left, while
                          the lock is dropped to order the stealing stream after the old owners */
  EBB__B_CARVED = 8    /* carved for a slab that slab.c is still making (the lock may be dropped
                          meanwhile): no slab record yet, no slots, no stats; EBB__B_SLAB once
                          slab_make (slab.c) attaches its record */
};

/* ---- the free index: best fit in expandable segments, small holes first in classic ones (fidx.c)
 * Expandable segments (the default where the driver has VMM): a request takes the smallest of
 * its stream's free blocks that holds it, the lower address on a tie, and the free block at the
 * end of the segment, which growth extends, only when no other holds it ("the tail last", as
 * PyTorch's expandable segments count their free tail as unbounded). Found through bins (fidx.c:
 * free lists by size, eight an octave, and a bitmap), in O(1). Against the classic rules below
 * on ten real training traces (perf/RESULTS.md, frag rows), best fit with empty slabs given back
 * at once (slab.c) reserves within a granule of plain best fit on every one, where the rules
 * were 8 MiB over it on real_gpt_varlen and real_gru_packed and 1.058 of the peak requested on
 * real_accum (perf/JOURNAL.md, "Best fit in bins").
 *
 * Classic segments: among the free blocks of its pool that hold it:
 *   1. a request below 2 MiB (EBB__SMALL_HOLE): the oldest free block below 2 MiB that holds it;
 *   2. the oldest free block that holds it;
 * "oldest" in (segment age, address) order: the oldest segment that has one, the lowest address
 * inside. Plain oldest fit (rule 2 alone) put small requests (slab blocks, 64 KiB .. 1 MiB
 * activations) into the first hole that held them, often one of a few MiB, which then could not
 * take the next multi-MiB request (perf/JOURNAL.md, "Placement on real training traces", which
 * also gives size bands and other thresholds). Best fit here left a repeated random sequence
 * making 1 to 4 driver calls in its second pass (seven of the tests' eight seeds), where the
 * rules settle after the first. Holes below a granule can neither be given back nor serve the
 * large requests: they are filled first. No rule here guarantees that a sequence repeated
 * exactly settles after one pass; the real traces' steps make no driver call after the second,
 * and the random sequences measured (the arena bench's 18, the tests' 8) none after the first
 * (perf/RESULTS.md).
 *
 * Classic segments keep, per stream and pool, a B+-tree ordered by (segment age, address):
 * nodes of 16 entries, each entry with its key, the largest size under it and the largest size
 * below 2 MiB under it (512-byte units, saturating), so the first block of at least r, and the
 * first such below 2 MiB, are each one walk down reading a node's sizes with sixteen compares at
 * a time: two or three levels at the few hundred free blocks a stream and pool holds under the
 * arena bench, where a tree over the block records took about eight levels of dependent loads
 * (perf/JOURNAL.md, "The free index as a B+-tree"). A split's remainder and a merge take their
 * block's slot in place. Classic blocks of max_split and up (max_split_size_mb) are never split
 * and serve only requests near their size, so they stay out of the tree, in a list searched by
 * the same rules (few: whole segments); so does a block the tree found no host memory for a
 * node for. An expandable mode arena has the bins in place of the tree (they need no node
 * memory), and the segment's free tail beside them (ebb__fidx.tail). */
#define EBB__SMALL_HOLE ((size_t)2 << 20)
#define EBB__FX_BINS 256
struct ebb__fxnode;
struct ebb__fidx {
  struct ebb__fxnode *root;
  struct ebb_list big; /* free blocks >= max_split (classic segments only), and any block the
                          tree had no node for */
  struct ebb__block *tail; /* the free block that ends the expandable segment, when it is this
                              stream's and pool's: in neither the tree nor the list */
  size_t count;        /* free blocks, all three */
  struct ebb_list *bins; /* expandable mode: EBB__FX_BINS free lists by size, in place of the
                            tree (NULL: classic segments, the tree) */
  uint64_t bmap[EBB__FX_BINS / 64]; /* the non-empty bins */
};

struct ebb__stream_ref {
  ebb_stream_t *s; /* borrowed: stream slots outlive the arena (streams tear down after us) */
  uint64_t id;
  int device;
};

/* The free blocks of one allocation stream, per pool (fidx.c). Created at the stream's first
 * allocation on the arena; freed once the stream is released and the spool holds nothing. */
struct ebb__spool {
  struct ebb__stream_ref stream;
  struct ebb__fidx pools[EBB__NPOOLS];
  struct ebb__slab_cls *slab_cls; /* slab.c: per size class; NULL until the stream's first slot */
  size_t nlive;   /* its blocks that are not free (handed out, pending, slabs) */
  size_t nmaking; /* slabs slab.c is making for it with the lock dropped (no block yet) */
  /* While either count is not 0, or its indexes hold a block, the spool stays (spool_reap, fidx.c). */
};

struct ebb__segment;

/* What an allocation's growth asked the upstream for, for its OOM report: the size policy's
 * segment or growth, then (second != 0) the just-large-enough one tried when that failed. */
struct ebb__tried {
  size_t first, second;
  bool expandable; /* growth of the expandable segment (a mapping), not a segment */
};

/* A block record is two cache lines, aligned: the first holds what merging and the neighbour
 * checks of other blocks touch (a free of one block reads its address neighbours' state, so
 * those reads should cost one line each); the second what only the block's own alloc and free
 * read. The free index's walks read its own nodes, not the records. Streams recorded with
 * ebb_arena_record_stream live in a separate array, allocated at the first record and kept with
 * the record for reuse. */
struct ebb__block {
  /* line 1: the free index and the neighbours' view. 128-byte aligned: the address map keeps
   * 7 bits of its own in the low bits of a record's address (addrmap.c). */
  _Alignas(128) size_t size;       /* rounded size: the block's share of its segment */
  struct ebb__block *prev, *next;  /* address neighbours in the segment */
  struct ebb_list node;            /* spare list while DEAD; the index's list while FREE and listed */
  struct ebb__fxnode *leaf;        /* FREE in the index's tree: its leaf (NULL otherwise) */
  struct ebb__spool *spool;        /* allocation stream's pool (owner of the block when free) */
  uint8_t state;                   /* enum ebb__bstate */
  uint8_t pool;                    /* enum ebb__pool */
  uint8_t kind;                    /* enum ebb__memkind */
  uint8_t owner_cat;               /* enum ebb_owner_cat */
  uint16_t bin;                    /* FREE in a binned index: its bin + 1 (0 otherwise) */
  /* line 2: the block's own state */
  _Alignas(64) struct ebb__segment *seg;
  struct ebb__arena *arena;        /* fixed for the record's whole life */
  uint64_t addr;
  size_t requested;                /* what the caller asked for (ALLOC only) */
  const char *owner;               /* interned owner name of the allocation ("" when none) */
  struct ebb__stream_ref *uses;    /* streams other than the allocation stream that used it */
  struct ebb__slab *slab;          /* EBB__B_SLAB: its slab record (slab.c) */
  uint16_t nuses, ucap;            /* (malloc'ed at the first record_stream, kept for reuse) */
  uint32_t event_count;            /* PENDING: events still to complete */
};
_Static_assert(sizeof(struct ebb__block) == 128, "struct ebb__block: two cache lines (see above)");

struct ebb__segment {
  struct ebb_list node;       /* in the arena's segment list */
  uint64_t base;
  size_t size;                /* bytes held from the upstream; expandable: the span from base to
                                 the end of the mapped tail, holes included */
  size_t unmapped;            /* expandable: bytes of UNMAPPED holes inside the span */
  struct ebb__block *first;   /* lowest block; blocks tile [base, base + size) */
  uint8_t pool;               /* pool it was made for (classic segments) */
  bool expandable;
  size_t nblocks, nfree, free_bytes; /* for inactive_split without walking */
  size_t ncached;             /* its slab blocks whose slab is empty and cached (slab.c) */
  uint64_t seq;               /* age: the arena's segment count when it was made (free index) */
  struct ebb_list unpin;      /* in the arena's unpin_due while it may hold nothing but free
                                 blocks and cached empty slabs, one of them sticky (slab.c) */
};

/* A freed block's event on one of the streams that used it. Queued per stream in record order,
 * so polling a queue stops at its first incomplete event (no head-of-line blocking across
 * streams, as PyTorch's per-stream deques). */
struct ebb__pend {
  struct ebb_list node;
  ebb_event_t *ev;
  int ev_device;
  uint32_t slot;          /* slab != NULL: the slot of that slab waiting for the event */
  uint64_t age;           /* the arena's free_count at the free that queued it: across queues,
                             the lower the older (ebb__wait_oldest_pending waits for the oldest first) */
  struct ebb__block *b;   /* NULL for a slot */
  struct ebb__slab *slab;
};

/* ---- slabs (slab.c) ----------------------------------------------------------------------------
 * Requests up to conf.slab_max (rounded to 512 B as every request) are slots of a slab: one block
 * the engine carves from its small pool for one allocation stream, cut into n slots of one size
 * class. A slot alloc or free is a bitmap bit and a slot record: no split, no merge, no ptrmap
 * entry; a slot pointer is found through a process-wide map from 64 KiB address granules to
 * slabs (addrmap.c). */
#define EBB__SLAB_MAX_SLOTS 1024
#define EBB__SLAB_WORDS (EBB__SLAB_MAX_SLOTS / 64)
#define EBB__SLAB_CLASSES 128 /* slot sizes 512 B .. 64 KiB: the largest slab_max */
#define EBB__SLAB_MAX_LIMIT ((size_t)64 << 10) /* largest slab_max_bytes */
#define EBB__SLAB_MAX_DEFAULT ((size_t)64 << 10)
#define EBB__SLAB_TARGET ((size_t)128 << 10)   /* a slab holds max(2, TARGET / slot) slots:
                                                  every slab spans more than 64 KiB (the
                                                  granule map) */
#define EBB__SLAB_EMPTY_CACHE 1 /* empty slabs kept per stream and class (classic segments) */

/* One slot's own state, in the slab's out-of-band array (the slot's memory is never touched):
 * 16 bytes, so 10^5 live slots are 1.6 MB of records, what a free reads at random. */
struct ebb__slot {
  const char *owner;  /* interned owner name while active */
  uint32_t requested; /* bytes asked for (ALLOC, FREEING, PENDING) */
  uint8_t state;      /* EBB__B_FREE, _ALLOC, _FREEING or _PENDING */
  uint8_t owner_cat;
};

/* A slot's record_stream state, in a per-slab array made at the first record_stream of one of
 * its slots (rare: most slots never meet another stream) and kept with the slab record. */
struct ebb__slot_ext {
  struct ebb__stream_ref *uses; /* malloc'ed at the slot's first use, kept for reuse */
  uint16_t nuses, ucap;
  uint32_t event_count;         /* PENDING: events still to complete */
};

/* A slab record. Records are recycled, never freed before teardown (as block records): the
 * address map may hand a stale record to a racing bad free, which validates it under the lock. */
struct ebb__slab {
  /* line 1: what a slot free reads before its slot record. 128-byte aligned: the address map
   * keeps 7 bits of its own in the low bits of a record's address (addrmap.c). */
  _Alignas(128) struct ebb__arena *arena; /* fixed for the record's whole life */
  uint64_t addr;             /* first slot; slot i at addr + i * slot */
  uint64_t inv;              /* 2^32 / (slot / 512), rounded up: the index without a division */
  uint32_t slot;             /* slot size (bytes, a 512-byte multiple) */
  uint16_t nslots, nfree;    /* nfree: FREE slots (their bits are set in `bits`) */
  uint16_t npend;            /* slots FREEING or PENDING */
  uint8_t live;              /* serving slots; 0 on the spare list */
  uint8_t cls;               /* size class: slot / 512 - 1 */
  uint8_t sticky;            /* made again right after its class's slab was given back */
  struct ebb__spool *spool;  /* allocation stream */
  struct ebb__slot *slots;   /* nslots records (capacity `cap`) */
  struct ebb__slot_ext *ext; /* NULL until a slot is recorded on another stream; `cap` entries */
  struct ebb_list node;      /* class list while it has a free slot; spare list while not live */
  /* line 2 on */
  struct ebb__block *b;      /* its block in the segment (state EBB__B_SLAB) */
  uint32_t cap;
  uint64_t bits[EBB__SLAB_WORDS]; /* bit i: slot i is FREE */
};

/* Per stream, per size class: slabs with a free slot, partly used ones first, empty ones at the
 * tail; `nempty` empty slabs are kept (at most conf's cache) before one goes back to the engine. */
struct ebb__slab_cls {
  struct ebb_list slabs;
  uint32_t nempty;
};

/* The bytes of a slab's span: its slots. */
static inline uint64_t ebb__slab_bytes(const struct ebb__slab *sl) { return (uint64_t)sl->slot * sl->nslots; }

struct ebb__evq {
  uint64_t stream_id;
  struct ebb_list q;
};

struct ebb__evcache {
  ebb_event_t **ev;
  size_t n, cap;
};

struct ebb__arena;

/* The memory kind behind an arena: a table of functions, so the engine has no branch on the
 * kind. obtain/release are required; the VMM entries
 * (reserve, map, unmap, unreserve) may be NULL, and then expandable segments are unsupported.
 * Every entry is called with the arena's lock dropped, except map/unmap of expandable growth
 * (see xseg.c). */
struct ebb__upstream {
  const char *name;     /* "device", "pinned", "host": messages */
  const char *alloc_fn; /* the public call that allocates from it: messages */
  const char *free_fn;  /* the public call that frees its blocks: messages */
  enum ebb__memkind kind;
  /* The segment size for a rounded request r; NULL: the device policy (2 MiB segments for
   * requests up to 1 MiB, 20 MiB below 10 MiB, larger ones rounded to 2 MiB). */
  size_t (*segment_size)(size_t r);
  ebb_status (*obtain)(struct ebb__arena *a, size_t bytes, uint64_t *addr);
  ebb_status (*release)(struct ebb__arena *a, uint64_t addr, size_t bytes);
  ebb_status (*mem_info)(struct ebb__arena *a, size_t *free_bytes, size_t *total_bytes);
  ebb_status (*granularity)(struct ebb__arena *a, size_t *gran);
  ebb_status (*reserve)(struct ebb__arena *a, size_t bytes, uint64_t *va);
  ebb_status (*unreserve)(struct ebb__arena *a, uint64_t va, size_t bytes);
  ebb_status (*map)(struct ebb__arena *a, uint64_t va, size_t bytes, uint64_t *handle);
  ebb_status (*unmap)(struct ebb__arena *a, uint64_t va, size_t bytes, uint64_t handle);
};

#define EBB__WAIT_PENDING_US_DEFAULT 20000u /* pending_wait_us: 20 ms an allocation */
#define EBB__WAIT_PENDING_US_MAX 10000000u   /* 10 s */
struct ebb__conf {
  size_t max_split;  /* blocks of this size or more are never split (SIZE_MAX: no limit) */
  bool expandable;   /* an arena's: expandable segments on; the module's: what EBB_ALLOC_CONF
                        asked, when expandable_set */
  bool expandable_set; /* EBB_ALLOC_CONF named expandable_segments; else each device arena has
                          them where its driver does VMM (module.c) */
  uint32_t wait_pending_us; /* device arenas: before growing, wait on the host up to this many
                               microseconds for pending frees that could hold the request
                               (await_pending, arena.c; 0: never); pending_wait_us:N */
  size_t history;            /* history ring entries per arena (0: off) */
  const char *oom_snapshot;  /* snapshot path on EBB_ENOMEM (NULL: none); module-owned text */
  size_t pinned_max;         /* cap on pinned bytes held from the driver (0: none) */
  size_t slab_max;           /* largest rounded request served by a slab slot (0: slabs off) */
  const char *env;           /* EBB_ALLOC_CONF as read (snapshot settings); module-owned text */
};

/* One history entry: a fixed-size record in a preallocated ring, so recording never allocates.
 * 48 bytes, not 56: action and category share the stream id's word. Stream ids come from one
 * 64-bit counter from 1 that streams and events share (ebb__new_id); 56 bits of it last ~2
 * years at one id a nanosecond, so the top byte is free. */
struct ebb__hist_entry {
  uint64_t time_ns, addr, size, requested;
  const char *owner; /* interned */
  uint64_t sac;      /* stream id (bits 0-55), action (56-59: enum ebb_alloc_action, or
                        EBB__HIST_FREE_PAIR in the ring), owner category (60-63). A plain word,
                        not bit-fields: GCC wrote those by read-modify-write, a load that waits
                        for the ring line where a plain store does not (callgrind: D1 read
                        misses on the ring) */
};

static inline uint64_t ebb__he_sac(uint64_t stream, unsigned action, unsigned owner_cat) {
  return stream | (uint64_t)action << 56 | (uint64_t)owner_cat << 60;
}
static inline uint64_t ebb__he_stream(const struct ebb__hist_entry *e) { return e->sac & (((uint64_t)1 << 56) - 1); }
static inline unsigned ebb__he_action(const struct ebb__hist_entry *e) { return (unsigned)(e->sac >> 56) & 15u; }
static inline unsigned ebb__he_cat(const struct ebb__hist_entry *e) { return (unsigned)(e->sac >> 60); }

/* The action of a ring slot that holds two actions: a free that completed in the call that
 * requested it, FREE_REQUESTED then FREE_COMPLETED with the same fields and time. One slot, not
 * two: a pair is the common free, and its second store was a third of the ring lines an
 * alloc+free pair touched. Never seen outside the ring: readers (history.c) expand it. */
#define EBB__HIST_FREE_PAIR 15u
_Static_assert(EBB_ACT_OOM < EBB__HIST_FREE_PAIR && EBB_OWNER_CAT_COUNT <= 16,
               "struct ebb__hist_entry: action and owner_cat are 4 bits");
_Static_assert(sizeof(struct ebb__hist_entry) == 48, "struct ebb__hist_entry: 48 bytes (see above)");

/* The history's clock. Entries carry CLOCK_MONOTONIC nanoseconds (the clock of
 * ebb_trace_now_ns), but reading that clock costs 25-50 ns (the vDSO, more in a VM) and an
 * alloc+free pair records three entries. So, where the CPU has a constant time-stamp counter
 * (x86-64), the clock is read only every `span` ticks and the times in between are the last
 * reading plus the elapsed ticks times the rate measured between the last two readings. `span`
 * starts at a few microseconds (the first times are near-exact) and doubles to ~50 ms; the error
 * is that of the rate over one span (microseconds at most). Times never go back along the ring:
 * each is at least the one before (`last`), also across a re-read that finds the interpolation
 * ran ahead. Elsewhere every entry reads the clock. Per arena, under its lock. */
struct ebb__hclock {
  uint64_t tsc_a;     /* counter at the last clock reading */
  uint64_t ns_a;      /* the clock at tsc_a */
  uint64_t last;      /* newest time handed out */
  uint64_t span;      /* ticks after tsc_a at which the clock is read again (0: read now) */
  double ns_per_tick; /* 0 until two readings gave a rate */
  uint64_t rate_q32;  /* ns_per_tick in 32.32 fixed point: the interpolation is one integer
                         multiply (a double's conversions from and to uint64_t cost ~10 Ir) */
};

/* Capacity counts actions, not slots: the views (ebb__hist_get, the snapshot) show the newest
 * min(total, cap) actions. The ring has cap slots, each one or two
 * actions, so it always holds at least that many; readers drop the older rest, which may be the
 * FREE_REQUESTED half of the oldest slot. */
struct ebb__hist {
  struct ebb__hist_entry *ring; /* NULL when the history is off */
  size_t cap;                   /* slots in ring, and actions shown; 0: off */
  size_t head;                  /* next slot written */
  uint64_t total;               /* actions ever recorded (a pair slot counts two) */
  struct ebb__hclock clk;
};

/* Counters behind ebb_arena_stats, kept as its fields (current and peak). */
struct ebb__counters {
  ebb_arena_stats s;
  uint64_t steals; /* allocations served from another stream's free block after an event wait */
};

struct ebb__arena {
  ebb_lock mu; /* a futex lock: the alloc/free path takes it twice per pair (ebb_sync.h) */
  int device;              /* device arena: its device; pinned pool: the device whose NUMA node it
                              serves (-1: driver-placed); host pool: -1 */
  int numa_node;           /* pinned pool: its NUMA node (-1: any); otherwise -1 */
  char label[48];          /* "device 0", "pinned pool (NUMA node 0)", "host pool": messages */
  bool started;
  const struct ebb__upstream *up;
  struct ebb__conf conf;
  size_t total_mem;        /* the device's memory (capacity in reports) */
  size_t limit;            /* 0: none */
  size_t inflight;         /* bytes being obtained with the lock dropped (counted against limit) */

  struct ebb_list segments;
  uint64_t nsegs_made;       /* segments made so far: the next one's age (ebb__segment.seq) */
  struct ebb_list unpin_due; /* segments left with only free blocks and a sticky slab: given
                                back at the next allocation of anything else (slab.c) */
  uint64_t unpin_at;         /* alloc_count when a slot's free last gave its slab back, ... */
  struct ebb__spool *unpin_sp; /* ... the slab's stream ... */
  uint8_t unpin_cls;         /* ... and its class (sticky slabs, slab.c) */
  struct ebb__spool **spools;
  size_t nspools, capspools;
  struct ebb__spool *last_spool; /* the spool of the last allocation: the common case */

  struct ebb__evq *evqs;   /* pending frees per use stream */
  size_t nevqs, capevqs;
  size_t npending;         /* pend entries queued */
  size_t nheld;            /* blocks and slots held back for good (struct ebb__lost): PENDING,
                            * each with one event that never comes */
  struct ebb_list pend_spare;
  struct ebb__evcache evcache[EBB_MAX_DEVICES]; /* idle events by their device */

  struct ebb_list block_spare; /* DEAD block records */
  struct ebb_list slab_spare;  /* slab records not live (slab.c) */
  void **slab_chunks;          /* slab record chunks, freed at teardown */
  size_t nslab_chunks, capslab_chunks;
  void **slabs;                /* block slabs, freed at teardown */
  size_t nslabs, capslabs;
  struct ebb__fxnode *fx_spare; /* free index nodes not in a tree (fidx.c) */
  size_t nfx_spare;
  void **fx_chunks;             /* their chunks, freed at teardown */
  size_t nfx_chunks, capfx_chunks;

  /* Expandable segments: one VMM reservation, mapped granule by granule from its start. */
  struct ebb__segment *xseg;   /* NULL until first growth */
  uint64_t xva;
  size_t xva_size, xgran;
  uint64_t *xhandles;          /* one physical handle per mapped granule */
  size_t xstuck;               /* granules of holes (or past the span) whose unmap failed: still
                                * mapped, their handles kept, taken again by the next growth */
  unsigned xunmap_fails;       /* failed unmaps since ebb_arena_empty_cache last reported them */
  ebb_status xunmap_st;        /* the first of them: its status and message */
  char xunmap_why[192];

  struct ebb__counters c;
  struct ebb__hist hist;
  /* A range that holds every segment the arena ever had (the expandable reservation whole), in
   * 64 KiB units: low half the first unit, high half one past the last (0: none yet). Only
   * widened, under `mu`; read without the lock by the copy hook as a filter (in_span, copy.c).
   * One word, not two: the arena stays 1 136 bytes, whose multiple the allocation entry
   * computes in one instruction (two at 1 152). */
  _Atomic uint64_t span;
};

/* ==============================================================================================
 * The functions, grouped by the file that provides them; the small inline helpers several files
 * use come first (provided by this header).
 * ============================================================================================== */

/* ---- inline: counters ------------------------------------------------------------------------ */

static inline void ebb__stat_add(ebb_arena_stat *st, uint64_t n) {
  st->current += n;
  if (st->current > st->peak) st->peak = st->current;
}

static inline void ebb__stat_sub(ebb_arena_stat *st, uint64_t n) {
  EBB_ASSERT(st->current >= n);
  st->current -= n;
}

/* current - from + to in one step (modular: a decrease wraps the addend, not the result); the
 * peak test is that of ebb__stat_add, and a decrease never passes it (peak >= current). */
static inline void ebb__stat_move(ebb_arena_stat *st, uint64_t from, uint64_t to) {
  EBB_ASSERT(to >= from || st->current >= from - to);
  st->current += to - from;
  if (st->current > st->peak) st->peak = st->current;
}

/* ---- inline: the size policy and fit rules (arena.c, fidx.c) --------------------------------- */

static inline size_t ebb__round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* The size a new segment gets for a rounded request, unless the upstream has its own policy (the
 * pinned pool's exact sizes): a small request (<= 1 MiB) a 2 MiB segment, one below 10 MiB a 20
 * MiB segment, a larger one its size rounded up to 2 MiB (PyTorch's get_allocation_size). */
static inline size_t ebb__segment_size(const struct ebb__arena *a, size_t r) {
  if (a->up->segment_size) return a->up->segment_size(r);
  if (r <= EBB__SMALL_SIZE) return EBB__SMALL_SEGMENT;
  if (r < EBB__MIN_LARGE_ALLOC) return EBB__LARGE_SEGMENT;
  return ebb__round_up(r, EBB__ROUND_LARGE);
}

/* The free block sizes that may serve rounded request r are [r, ebb__fit_limit): oversize
 * blocks (>= max_split) are never split; they serve oversize requests within the slack, and a
 * smaller request only up to the size of the segment that request would get itself. PyTorch keeps oversize blocks from every smaller request, but a request just below
 * max_split gets a segment rounded up to 2 MiB, which is then oversize: freed, it could serve no
 * request of its own size, and each such request grew the arena again (the arena bench's tensor
 * sequence with max_split_size_mb:64: ~500 driver allocations a replay, 64 GiB reserved before
 * the OOM retry gave it back). */
/* max_split as the fit rules and runs see it: none with expandable segments. Their blocks are
 * always split (carve, arena.c), and their free blocks merge into runs far above max_split: kept
 * from smaller requests, those made the arena map granule after granule
 * (perf/traces/multistream.trace with max_split_size_mb:64: frag_ratio 1.703, 7 112 granules
 * mapped). The setting is about classic segments. */
static inline bool ebb__xmode(const struct ebb__arena *a) { return a->conf.expandable && a->up->map; }

static inline size_t ebb__max_split(const struct ebb__arena *a) {
  return ebb__xmode(a) ? SIZE_MAX : a->conf.max_split;
}

/* The pool a rounded request r is served from. Classic segments keep requests up to 1 MiB in
 * 2 MiB segments of their own (the small pool), so that small blocks do not cut up the large
 * ones' segments. An expandable segment has one pool: its memory is one range, and with two,
 * what one pool freed could serve nothing of the other's. Where a training step's 1 MiB
 * activations had been, its optimizer state could not go (perf/traces/real_mlp.trace: 6.4 MiB
 * of the small pool's free at the reserved peak, 8 % of it; real_lstm: 29.6 MiB), and the
 * segment grew instead (perf/JOURNAL.md, "Placement on real training traces"). */
static inline int ebb__pool_of(const struct ebb__arena *a, size_t r) {
  if (ebb__xmode(a)) return EBB__POOL_LARGE;
  return r <= EBB__SMALL_SIZE ? EBB__POOL_SMALL : EBB__POOL_LARGE;
}

static inline size_t ebb__fit_limit(const struct ebb__arena *a, size_t r) {
  size_t ms = ebb__max_split(a);
  if (r >= ms) return r + EBB__OVERSIZE_SLACK;
  size_t seg = ebb__segment_size(a, r);
  return seg >= ms ? seg + 1 : ms;
}

/* Whether the stream the arena kept in r is still that live stream: after its release its slot
 * can hold a newer stream, hence the id check. Lock-free (streams_export.h). */
static inline bool ebb__ref_live(const struct ebb__stream_ref *r) {
  uint64_t id = 0;
  int dev = -1;
  return ebb__stream_peek(r->s, &id, &dev) && id == r->id;
}

/* ---- inline: record chunks ----------------------------------------------------------------------
 * Block, slab and free-index records come in chunks that live until teardown; the arena keeps
 * each chunk's pointer in a growable array (doubling from `first`). A new chunk of `bytes`
 * (aligned to `align`, not zeroed) of records of `kind`, kept in (*v, *n, *cap); NULL when out of
 * host memory (nothing kept). Lock held. */
enum ebb__chunk_kind { EBB__CHUNK_BLOCKS, EBB__CHUNK_SLABS, EBB__CHUNK_FXNODES };
/* The host memory of one chunk (chunk.c: aligned_alloc; NULL when out of memory). Its own file,
 * so that a white-box test can link a version that fails for one kind in its place and drive the
 * paths that find no host memory for records (tests/alloc/chunk_refusal.c). */
EBB_HIDDEN void *ebb__chunk_mem(enum ebb__chunk_kind kind, size_t align, size_t bytes);
static inline void *ebb__chunk_new(void ***v, size_t *n, size_t *cap, size_t first, size_t align, size_t bytes,
                                   enum ebb__chunk_kind kind) {
  if (*n == *cap) {
    size_t nc = *cap ? *cap * 2 : first;
    void **nv = realloc(*v, nc * sizeof *nv);
    if (!nv) return NULL;
    *v = nv;
    *cap = nc;
  }
  void *p = ebb__chunk_mem(kind, align, bytes);
  if (p) (*v)[(*n)++] = p;
  return p;
}

/* ---- arena.c: the engine --------------------------------------------------------------------- */

/* Block records (lock held): a spare record, reset (NULL: no host memory for a chunk of them),
 * and a record back to the spare list. Inline in arena.c's alloc and free paths. */
EBB_HIDDEN struct ebb__block *ebb__block_new(struct ebb__arena *a);
EBB_HIDDEN void ebb__block_dead(struct ebb__arena *a, struct ebb__block *b);
/* Whether n is a free neighbour that block b merges with: same stream and pool. */
static inline bool ebb__mergeable(const struct ebb__block *b, const struct ebb__block *n) {
  return n && n->state == EBB__B_FREE && n->spool == b->spool && n->pool == b->pool;
}
/* Merges FREE block b (counted in its segment's nfree and free_bytes, not indexed) with its
 * free neighbours of the same stream and pool, and indexes the result. Lock held. */
EBB_HIDDEN void ebb__merge_insert(struct ebb__arena *a, struct ebb__block *b);
/* A block whose uses are over (the last event of a deferred free completed) back to its
 * stream's free index, merged; FREE_COMPLETED recorded. Lock held. */
EBB_HIDDEN void ebb__block_release(struct ebb__arena *a, struct ebb__block *b);
/* A new segment [base, base + size) of pool `pool` for stream spool sp: one FREE block, not
 * indexed, into *first; reserved bytes and the segment count counted, the span widened. NULL:
 * no host memory for the records. Lock held. */
EBB_HIDDEN struct ebb__segment *ebb__segment_add(struct ebb__arena *a, uint64_t base, size_t size, int pool,
                                                 struct ebb__spool *sp, struct ebb__block **first);
/* The 64 KiB unit of addr for the span (struct ebb__arena): addresses past 48 bits share the last. */
static inline uint64_t ebb__span_unit(uint64_t addr) {
  return addr >> 48 ? (uint64_t)UINT32_MAX - 1 : addr >> 16;
}
/* Widens the address range of a's segments (the copy hook's filter, never narrowed) to hold
 * [base, base + size). Lock held. */
EBB_HIDDEN void ebb__span_add(struct ebb__arena *a, uint64_t base, size_t size);

/* An empty arena over upstream `up` (device: its device, or the device a pinned pool serves;
 * total_mem: the capacity its reports name), with its history ring. */
EBB_HIDDEN void ebb__arena_init(struct ebb__arena *a, const struct ebb__upstream *up, int device,
                                const struct ebb__conf *conf, size_t total_mem);
/* Releases every segment (leaked blocks included) and every structure. No lock may be held. */
EBB_HIDDEN void ebb__arena_fini(struct ebb__arena *a);
/* `bytes` (> 0) on stream s into *out: a slot (bytes within conf.slab_max) or a block; the
 * message of a failure names up->alloc_fn. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_alloc(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s,
                                       void **out);
/* Free of a pointer of any arena of `kind`, found through the address map or the ptrmap. `fn`
 * names the public call for messages. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_free(const char *fn, void *ptr, enum ebb__memkind kind);
/* Waits for every pending free, gives empty slabs, whole free granules (after a device
 * synchronisation) and whole free classic segments back. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_empty_cache(struct ebb__arena *a);
/* Gives back a's fully free classic segments (empty cached slabs first), waiting for nothing:
 * what another arena under the same cap (the pinned pool's) can free at once. Bytes given back.
 * Lock not held. */
EBB_HIDDEN size_t ebb__arena_trim(struct ebb__arena *a);
/* The public calls' halves (no lock held): the cap on reserved bytes (0: none); the counters,
 * after polling pending frees in (never a host wait); the peaks back to the current values. */
EBB_HIDDEN void ebb__arena_set_limit(struct ebb__arena *a, size_t bytes);
EBB_HIDDEN void ebb__arena_get_stats(struct ebb__arena *a, ebb_arena_stats *out);
EBB_HIDDEN void ebb__arena_reset_peak(struct ebb__arena *a);
/* "1.50 GiB", "512 B": into buf (at least 16 bytes), returned. */
EBB_HIDDEN const char *ebb__fmt_bytes(char *buf, size_t cap, uint64_t n);

/* For slabs (slab.c); lock not held unless said. */
/* A block of `bytes` (a 512-byte multiple; of the small pool, or of an expandable segment's one)
 * on stream s, for a slab: state EBB__B_CARVED, no stats but reserved and segments, no history,
 * no ptrmap entry. Its own stream's
 * free index, another stream's (ordered by an event), then a new segment; no release-and-retry
 * chain and no OOM report: on failure the caller allocates the request as a plain block, which
 * runs both with the caller's own size. */
EBB_HIDDEN ebb_status ebb__arena_alloc_slab_block(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s,
                                                  struct ebb__block **out);
/* A plain block (never a slot): the engine's own path. */
EBB_HIDDEN ebb_status ebb__arena_alloc_block(struct ebb__arena *a, size_t bytes, const struct ebb__stream_ref *s, void **out);
/* Gives an EBB__B_SLAB or EBB__B_CARVED block back to its stream's free index (merged). Lock
 * held. */
EBB_HIDDEN void ebb__arena_put_slab_block(struct ebb__arena *a, struct ebb__block *b);

/* ---- fidx.c: the free index and the spools ------------------------------------------------------
 * Lock held for every call. */

/* Enters FREE block b (counted in its segment, not indexed) in its stream's index for its pool:
 * the tree, or the list when b is oversize or no node memory is left. */
EBB_HIDDEN void ebb__index_insert(struct ebb__arena *a, struct ebb__block *b);
/* Takes indexed block b out of its index (it stays FREE). */
EBB_HIDDEN void ebb__index_remove(struct ebb__block *b);
/* Indexed block b (in the tree, the list or the tail slot) grew to its current size; one that
 * now ends an expandable segment (it took in the free tail) moves to the tail slot. */
EBB_HIDDEN void ebb__index_grown(struct ebb__arena *a, struct ebb__block *b);
/* Indexed block old leaves the index and FREE block nw, next to it in order and of the same
 * stream and pool, comes in: in the tree, nw takes old's slot (no walk, no split). */
EBB_HIDDEN void ebb__index_replace(struct ebb__arena *a, struct ebb__block *old, struct ebb__block *nw);
/* The free block of x that serves r by the index's rules ("free index": small holes first, the
 * tail last) among those whose size lies in [r, ebb__fit_limit(a, r)), left in the index; NULL
 * when none fits. */
EBB_HIDDEN struct ebb__block *ebb__fidx_find(struct ebb__arena *a, struct ebb__fidx *x, size_t r);
/* ebb__fidx_find, the block taken out of the index (still FREE). */
EBB_HIDDEN struct ebb__block *ebb__fidx_take(struct ebb__arena *a, struct ebb__fidx *x, size_t r);
/* The largest free block of every stream and pool (the OOM report). */
EBB_HIDDEN size_t ebb__fidx_largest_free(const struct ebb__arena *a);
/* The stream's spool (created at its first use, after the spools of released streams that hold
 * nothing are freed); NULL: no host memory. */
EBB_HIDDEN struct ebb__spool *ebb__spool_get_slow(struct ebb__arena *a, const struct ebb__stream_ref *s);
/* The common case inline: the stream of the arena's last allocation. */
static inline struct ebb__spool *ebb__spool_get(struct ebb__arena *a, const struct ebb__stream_ref *s) {
  struct ebb__spool *sp = a->last_spool;
  return EBB_LIKELY(sp && sp->stream.id == s->id) ? sp : ebb__spool_get_slow(a, s);
}
/* The debug walk's part: each spool's tree (links, depths, order, sizes and keys) and list hold
 * exactly its free blocks of that pool; *indexed counts them all. EBB_EINTERNAL with a message. */
EBB_HIDDEN ebb_status ebb__fidx_check(struct ebb__arena *a, const char *fn, size_t *indexed);
/* Frees the node chunks and the spools (teardown, after ebb__slab_fini). */
EBB_HIDDEN void ebb__fidx_fini(struct ebb__arena *a);

/* ---- xseg.c: expandable segments ----------------------------------------------------------------
 * Lock held for every call. */

/* Maps granules at the end of the reservation (reserved at the first call) so that the tail
 * offers `r` bytes to stream spool sp, pool `pool`, after trying the holes left by empty_cache;
 * what was asked for goes into *tried (may be NULL) for the OOM report. */
EBB_HIDDEN ebb_status ebb__x_grow(struct ebb__arena *a, struct ebb__spool *sp, int pool, size_t r, struct ebb__tried *tried);
/* Gives the segment's fully free granules back to the driver (free runs of every stream
 * joined, the free tail cut, whole granules inside free blocks made holes). Bytes unmapped. pre:
 * pending events synchronised and the device synchronised, with the lock held since. */
EBB_HIDDEN size_t ebb__x_shrink(struct ebb__arena *a);
/* The failure `st` of the device synchronisation that must come before unmapping: a message
 * naming fn, the arena and that nothing was unmapped. */
EBB_HIDDEN ebb_status ebb__sync_failed(struct ebb__arena *a, const char *fn, ebb_status st);
/* Unmaps every mapped granule and frees the reservation (teardown; no lock held). */
EBB_HIDDEN void ebb__x_fini(struct ebb__arena *a);

/* ---- pending.c: pending frees and recorded uses ---------------------------------------------- */

/* The arena's idle events by device (lock held): pop one (NULL: none cached), push one back
 * (false: the cache cannot grow; the caller releases it after dropping the lock). */
EBB_HIDDEN ebb_event_t *ebb__ev_pop(struct ebb__arena *a, int device);
EBB_HIDDEN bool ebb__ev_push(struct ebb__arena *a, int device, ebb_event_t *e);
/* An event for the arena's own use, its live-handle count given back (it is no caller's
 * handle), and its release. No arena lock held (the event pool's lock ranks below it). */
EBB_HIDDEN ebb_status ebb__ev_create(int device, ebb_event_t **out);
EBB_HIDDEN void ebb__ev_destroy(ebb_event_t *e);
/* The pending queue of stream stream_id (made at its first use; empty queues are dropped when
 * the array is full). NULL: no host memory. Lock held. */
EBB_HIDDEN struct ebb__evq *ebb__evq_get(struct ebb__arena *a, uint64_t stream_id);
/* Polls every stream's queue from its oldest entry up to the first incomplete event, releasing
 * the memory whose events all completed. No host wait: ebb_event_query only asks. Lock held
 * (dropped only to release an event the cache could not take). */
EBB_HIDDEN void ebb__poll_pending(struct ebb__arena *a);
/* Host-waits for every pending event, then polls them all in. Lock held on entry and exit and
 * dropped for the waits: the entries stay queued, so a concurrent poll may complete some first;
 * waiting on an event that was recycled meanwhile only waits for newer work. */
EBB_HIDDEN void ebb__sync_pending(struct ebb__arena *a);
/* Before growth (arena.c's miss paths): whether waiting for pending frees may serve a rounded
 * request of r bytes instead. Device arenas with a wait budget (pending_wait_us), whose frees still waiting for
 * other streams (active - allocated bytes: blocks and slots freed, not yet reusable) add up to
 * r or more. Lock held. */
static inline bool ebb__wait_pending_worth(const struct ebb__arena *a, size_t r) {
  return a->npending && a->conf.wait_pending_us && a->c.s.active_bytes.current - a->c.s.allocated_bytes.current >= r;
}
/* Host-waits for the oldest pending free (its event) until CLOCK_MONOTONIC time deadline_ns,
 * then polls every queue in; the caller searches again. false when nothing could be waited for,
 * the deadline passed first, or the wait made no progress (an event that never completes: its
 * device failed). Lock held on entry and exit, dropped for the wait (as ebb__sync_pending).
 * Counted in num_syncs. */
EBB_HIDDEN bool ebb__wait_oldest_pending(struct ebb__arena *a, uint64_t deadline_ns);
/* One more slot in a use array (*uses of capacity *ucap, doubled): EBB_ELIMIT past
 * EBB__USES_MAX streams on one pointer, EBB_ENOMEM without host memory; fn, sid and ptr for the
 * message. */
#define EBB__USES_MAX 4096 /* streams recorded on one block or slot: far past any real use */
EBB_HIDDEN ebb_status ebb__uses_grow(struct ebb__stream_ref **uses, uint16_t *ucap, const char *fn, uint64_t sid, void *ptr);
/* Adds stream s to a use array (*uses, *n of capacity *cap) unless it is there already. A full
 * array first drops the uses of released streams whose work is done (a stream made per step
 * and copied on would otherwise fill it), then grows (ebb__uses_grow's errors). Arena lock held
 * (the check takes streams' tomb lock, a leaf). */
EBB_HIDDEN ebb_status ebb__uses_add(const char *fn, struct ebb__stream_ref **uses, uint16_t *n, uint16_t *cap,
                                    const struct ebb__stream_ref *s, void *ptr);
/* The deferred half of a free whose memory was used on other streams (a block's or a slot's
 * `uses`, n of them), in two steps. ebb__uses_record: one event recorded on each using stream,
 * into evs (taken from the event cache under the lock, recorded with the lock dropped; a stream
 * whose event cannot be recorded is waited for on the host and its evs[i] is NULL; evs NULL, no
 * host memory for the array: every using device is waited for). Lock held on
 * entry and on return; the memory must be FREEING so no other call touches it meanwhile.
 * ebb__uses_queue: each event queued on its stream's pending queue for block b, or for slot
 * `slot` of slab sl, counting them in *count (no host memory for a queue entry: that event is
 * waited for instead; evs NULL: nothing). Lock held (dropped only on that path). */
#define EBB__SMALL_EVS 8 /* events of a deferred free recorded without a heap array */
/* Uses whose work could be neither captured by an event nor waited for on the host (the record
 * failed, then the wait did, on a device not in its error state): that work may still read or
 * write the memory, so it is held back for good (PENDING with one event that never comes,
 * counted in nheld). A free still succeeds (the pointer is released) and tells the warning
 * handler why; a steal fails the allocation. Zero-initialised by the caller, filled by
 * ebb__uses_record and ebb__uses_queue. */
struct ebb__lost {
  uint32_t n;              /* uses lost */
  ebb_status st;           /* the failed wait's status, for the first */
  uint64_t stream_id;      /* the first lost use's stream and device */
  int device;
  char why[256];           /* the failed wait's message */
};
EBB_HIDDEN void ebb__uses_record(struct ebb__arena *a, const struct ebb__stream_ref *uses, uint32_t n, ebb_event_t **evs,
                                 struct ebb__lost *lost);
EBB_HIDDEN void ebb__uses_queue(struct ebb__arena *a, const struct ebb__stream_ref *uses, uint32_t n, ebb_event_t **evs,
                                struct ebb__block *b, struct ebb__slab *sl, uint32_t slot, uint32_t *count,
                                struct ebb__lost *lost);
/* Notes a lost use, of stream stream_id on device, with the failed wait's status st (its message
 * read from the muted buffer: call it with the failure muted). */
EBB_HIDDEN void ebb__lost_note(struct ebb__lost *lost, uint64_t stream_id, int device, ebb_status st);
/* What a free says through the warning handler of memory it held back: fn, the pointer and the
 * first lost use named. */
EBB_HIDDEN void ebb__lost_warn(const char *fn, const void *ptr, const struct ebb__lost *lost);
/* The failure an allocation reports when the block it stole was held back. No lock held. */
EBB_HIDDEN ebb_status ebb__lost_report(const char *fn, const void *ptr, const struct ebb__lost *lost);
/* record_stream of a pointer of any arena of `kind`: a slot's or a live block's use of stream
 * s. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_record(const char *fn, void *ptr, const struct ebb__stream_ref *s,
                                        enum ebb__memkind kind);
/* Adds stream s to live block b's uses unless it is b's allocation stream or there already.
 * Called with b's arena locked; unlocks it. */
EBB_HIDDEN ebb_status ebb__block_record_locked(const char *fn, struct ebb__arena *a, struct ebb__block *b, void *ptr,
                                               const struct ebb__stream_ref *s);
/* Waits for every pending event and releases the queues and the event cache (teardown, first). */
EBB_HIDDEN void ebb__pending_fini(struct ebb__arena *a);
/* Removes stream `sid` from the uses of the array uses[0..*n) (order not kept): true if it was there. */
EBB_HIDDEN bool ebb__uses_drop(struct ebb__stream_ref *uses, uint16_t *n, uint64_t sid);

/* ---- slab.c: size-class slabs ---------------------------------------------------------------- */

/* A slot for `bytes` (rounded r <= conf.slab_max) on stream s; falls back to a plain block when
 * no slab can be had. Lock not held. */
EBB_HIDDEN ebb_status ebb__slab_alloc(struct ebb__arena *a, size_t bytes, size_t r, const struct ebb__stream_ref *s,
                                      void **out);
/* Free / record_stream of addr inside slab sl (locked by ebb__addr_lookup_lock; unlocked on
 * return). Same messages as for blocks. */
EBB_HIDDEN ebb_status ebb__slab_free(const char *fn, struct ebb__slab *sl, uint64_t addr, enum ebb__memkind kind);
EBB_HIDDEN ebb_status ebb__slab_record(const char *fn, struct ebb__slab *sl, uint64_t addr,
                                       const struct ebb__stream_ref *s, enum ebb__memkind kind);
/* ebb__arena_use_forget for a slot of sl (locked by ebb__addr_lookup_lock; unlocked on return). */
EBB_HIDDEN bool ebb__slab_forget(struct ebb__slab *sl, uint64_t addr, uint64_t sid);
/* The copy hook's part for an address inside live slab sl (locked by the caller; unlocked on
 * return): nothing for a slot that is not handed out, else the bounds check against the slot's
 * end and the record of s on the slot (ebb__arena_copy_use). */
EBB_HIDDEN ebb_status ebb__slab_copy_use(const char *fn, struct ebb__slab *sl, uint64_t addr, size_t bytes, bool is_dst,
                                         const struct ebb__stream_ref *s);
/* ebb__arena_owner's part for an address inside live slab sl (locked by ebb__addr_lookup_lock;
 * unlocked on return). */
EBB_HIDDEN ebb_status ebb__slab_owner(const char *fn, struct ebb__slab *sl, uint64_t addr, bool set, uint8_t cat,
                                      const char *name, ebb_owner_cat *old_cat, const char **old_name);
/* A pend entry of a slot completed. Lock held. */
EBB_HIDDEN void ebb__slab_pend_done(struct ebb__arena *a, struct ebb__slab *sl, uint32_t slot);
/* Segment g holds nothing but free blocks and cached empty slabs (g->ncached of them): the
 * slabs go back to the engine and the segment is one free block again. Lock held. */
EBB_HIDDEN void ebb__slab_unpin(struct ebb__arena *a, struct ebb__segment *g);
/* A free may have left g with nothing but free blocks and cached empty slabs: they go back.
 * Left where they last emptied, they make the next step's blocks fit around them differently
 * from step to step (the arena bench's sequences needed new segments up to their fourth
 * replay). Lock held. */
static inline void ebb__seg_unpin_check(struct ebb__arena *a, struct ebb__segment *g) {
  if (EBB_UNLIKELY(g->ncached) && g->nfree + g->ncached == g->nblocks) ebb__slab_unpin(a, g);
}
/* Gives back the cached empty slabs of the segments in a->unpin_due (sticky slabs' segments,
 * slab.c) that still hold nothing else. Lock held. */
EBB_HIDDEN void ebb__unpin_due(struct ebb__arena *a);
/* Gives every empty slab of the arena back to the engine (empty_cache, OOM retry). Lock held. */
EBB_HIDDEN void ebb__slab_release_empty(struct ebb__arena *a);
/* Debug walk of one slab block: bitmap against counts and slot states; adds the slab's slot
 * bytes and counts to the walk's totals, and 1 to *ncached when the slab is empty and cached.
 * EBB_OK or EBB_EINTERNAL with a message. Lock held. */
EBB_HIDDEN ebb_status ebb__slab_check(struct ebb__arena *a, const struct ebb__block *b, const char *fn, uint64_t *alloc,
                                      uint64_t *active, uint64_t *requested, uint64_t *isplit, uint64_t *isplit_b,
                                      size_t *pend_events, size_t *ncached);
/* One piece of a segment as the snapshot and the OOM report see it: a block (any state), or in
 * a slab block's stead each of its slots. Fields as of the block or slot record. */
struct ebb__piece {
  uint64_t addr, size, requested;
  uint64_t stream; /* allocation stream's id (0: a hole, nobody's) */
  const char *owner;
  uint8_t state;   /* enum ebb__bstate (a slot: FREE, ALLOC, FREEING or PENDING) */
  uint8_t owner_cat;
  bool slot;
};
/* A walk over the pieces of one segment in address order:
 *   struct ebb__piece p;
 *   for (struct ebb__piece_iter it = ebb__pieces(g); ebb__piece_next(&it, &p);) ...
 * Lock held throughout. */
struct ebb__piece_iter {
  const struct ebb__block *b; /* next block (NULL: done) */
  unsigned slot;              /* its next slot when it is a slab */
};
static inline struct ebb__piece_iter ebb__pieces(const struct ebb__segment *g) {
  return (struct ebb__piece_iter){g->first, 0};
}
EBB_HIDDEN bool ebb__piece_next(struct ebb__piece_iter *it, struct ebb__piece *out);
/* Class lists of every stream: live, partly used slabs before empty ones, nempty exact and
 * within the cache. Lock held. */
EBB_HIDDEN ebb_status ebb__slab_check_classes(struct ebb__arena *a, const char *fn);
/* Frees every slab record of the arena and its address-map entries (teardown). */
EBB_HIDDEN void ebb__slab_fini(struct ebb__arena *a);

/* ---- addrmap.c: from an address to its block or slot --------------------------------------------
 * A live block larger than EBB__AMAP_BLOCK_MIN (one granule of the granule map) is entered
 * there, in the granule where it starts; a smaller one (slabs off or below their maximum, or a
 * small request served as a block when no slab could be made, or one past the map's 48-bit
 * addresses) in the ptrmap. Slabs are in the granule map over their whole span. Lock of the
 * entry's arena held for the writes; the finds take no arena lock and are unvalidated. */
#define EBB__AMAP_BLOCK_MIN ((size_t)64 << 10)
static inline bool ebb__block_in_amap(const struct ebb__block *b) {
  return b->size > EBB__AMAP_BLOCK_MIN && !(b->addr >> 48);
}
EBB_HIDDEN bool ebb__amap_block_put(struct ebb__block *b); /* false: out of host memory */
EBB_HIDDEN struct ebb__block *ebb__amap_block_find(uint64_t addr);
/* The live block of the map that starts nearest at or below addr, looking back at most
 * max_granules granules before addr's own; unvalidated (its record may have been reused: check
 * under its arena's lock that it is ALLOC, in the map and holds addr). NULL when a slab or no
 * leaf comes first, or none within the bound: then no map block is known to hold addr. No lock. */
EBB_HIDDEN struct ebb__block *ebb__amap_block_before(uint64_t addr, unsigned max_granules);
/* Enters (on) or removes slab sl over its span; false: no host memory for a leaf (nothing left
 * entered). Lock of sl's arena held. */
EBB_HIDDEN bool ebb__amap_slab_set(struct ebb__slab *sl, bool on);
/* The slab whose span the map says holds addr, unvalidated; NULL: none. */
EBB_HIDDEN struct ebb__slab *ebb__amap_slab_find(uint64_t addr);
/* What a free or record_stream of addr is about, found through the address map: a slot (its
 * slab returned) or a live block larger than a granule starting at addr (*bout; with `take` a
 * memory kind, a block of that kind has its entry cleared, which elects the caller as the
 * block's one free, and a block of another kind keeps it: a free through the wrong pool's call
 * must not hide the block from its owner's); either with its arena locked. NULL and *bout NULL:
 * neither (the pointer may be a smaller block, in the ptrmap, or bad), no lock held. take 0:
 * the entry stays (record_stream). */
EBB_HIDDEN struct ebb__slab *ebb__addr_lookup_lock(uint64_t addr, int take, struct ebb__block **bout);
EBB_HIDDEN bool ebb__ptrmap_insert(struct ebb__block *b); /* false: out of host memory */
/* The block starting at addr, removed from the ptrmap (take) or left there (find); NULL if none. */
EBB_HIDDEN struct ebb__block *ebb__ptrmap_take(uint64_t addr);
EBB_HIDDEN struct ebb__block *ebb__ptrmap_find(uint64_t addr);
/* Frees both maps' tables (module teardown, after every arena's fini). */
EBB_HIDDEN void ebb__addrmap_clear(void);
/* The block of arena a's segments that holds addr, any state; NULL: none. Lock held. */
EBB_HIDDEN struct ebb__block *ebb__find_containing(struct ebb__arena *a, uint64_t addr);
/* "ebb_arena_alloc", "ebb_pinned_alloc", "ebb_pageable_alloc": the public call of a kind. */
EBB_HIDDEN const char *ebb__kind_alloc_fn(enum ebb__memkind kind);
/* Why `ptr`, found in arena a inside the block or slot at `base` (size, state, allocation stream
 * sid, read under a's lock), is not a live block of `kind`: another pool's memory, an interior
 * pointer, or freed memory. The message names fn, the pool and the block. No lock held. */
EBB_HIDDEN ebb_status ebb__explain_in(const char *fn, void *ptr, enum ebb__memkind kind, const struct ebb__arena *a, int state,
                                      uint64_t base, size_t size, uint64_t sid);
/* Why `ptr` is not a live block of `kind`: searched in every arena's segments, then among the
 * ranges given back (ebb__grave_find). No lock held. */
EBB_HIDDEN ebb_status ebb__explain(const char *fn, void *ptr, enum ebb__memkind kind);
/* EBB_EINVAL: `ptr` is a live block of arena o, not of `kind` (a free through the wrong call). */
EBB_HIDDEN ebb_status ebb__wrong_pool(const char *fn, void *ptr, const struct ebb__arena *o, enum ebb__memkind kind);

/* ---- copy.c: the copy hook ------------------------------------------------------------------- */

/* The copy hook alloc registers with streams (ebb__copy_hook_fn, streams_export.h): bounds
 * check and use record of a copy's side inside a live block of any arena. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_copy_use(void *ptr, size_t bytes, bool is_dst, ebb_stream_t *s, uint64_t sid, int sdev);
/* The copy hook's refusal of a side [ptr, ptr + bytes) that runs past the end of its block
 * [base, base + size) of arena a: EBB_EINVAL naming the block, its size and the offset. */
EBB_HIDDEN ebb_status ebb__copy_past_end(const char *fn, void *ptr, size_t bytes, bool is_dst, const struct ebb__arena *a,
                                         uint64_t base, size_t size);

/* ---- check.c: the debug walk ----------------------------------------------------------------- */

/* Walks every segment, index and counter of the arena under its lock: EBB_OK, or EBB_EINTERNAL
 * with a message naming fn, the arena and what disagrees. No lock held. */
EBB_HIDDEN ebb_status ebb__arena_check(struct ebb__arena *a, const char *fn);

/* A check of a debug walk: on failure `st` gets EBB_EINTERNAL with the message and the walk
 * jumps to its `done` label. */
#define EBB__CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) {                                                         \
      st = ebb__fail(EBB_EINTERNAL, __VA_ARGS__);                          \
      goto done;                                                           \
    }                                                                      \
  } while (0)

/* ---- owner.c: owner scopes and block owners -------------------------------------------------- */

/* The calling thread's owner scopes (ebb_alloc_owner_push/pop), kept by owner.c; `top` is the
 * innermost ({EBB_OWNER_OTHER, ""} outside any), mirrored so that every allocation reads it in
 * two loads. alloc/ is built with TLS descriptors (CMakeLists.txt): the access is an indirect
 * call of two instructions, not __tls_get_addr, and libebb stays dlopen-able. */
struct ebb__owner {
  const char *name;
  uint8_t cat;
};

struct ebb__owner_tls {
  int depth;
  struct ebb__owner top;
  struct ebb__owner stack[EBB_OWNER_MAX_DEPTH];
};

EBB_HIDDEN extern _Thread_local struct ebb__owner_tls ebb__owner_stack;

/* The calling thread's innermost owner scope ({EBB_OWNER_OTHER, ""} outside any). */
static inline void ebb__owner_current(uint8_t *cat, const char **name) {
  *cat = ebb__owner_stack.top.cat;
  *name = ebb__owner_stack.top.name;
}
/* The interned copy of name (n bytes, n <= EBB_OWNER_NAME_MAX) into *out: EBB_ELIMIT when the
 * table is full, EBB_ENOMEM without host memory, the message naming fn. A thread-local cache
 * answers a name this thread interned recently without the table's lock. No arena lock held. */
EBB_HIDDEN ebb_status ebb__intern(const char *fn, const char *name, size_t n, const char **out);
/* ebb_alloc_block_owner / ebb_alloc_block_set_owner: the owner of the live block or slot that
 * starts at ptr, in any pool, into *old_cat / *old_name (may be NULL); with `set`, replaced by
 * (cat, name) (name interned). No lock held. */
EBB_HIDDEN ebb_status ebb__arena_owner(const char *fn, const void *ptr, bool set, uint8_t cat, const char *name,
                                       ebb_owner_cat *old_cat, const char **old_name);

/* ---- history.c: the ring of allocator actions ------------------------------------------------ */

/* Allocates the ring (conf.history entries; an allocation failure turns the history off with a
 * warning) and frees it. Called by ebb__arena_init / ebb__arena_fini. */
EBB_HIDDEN void ebb__hist_init(struct ebb__arena *a);
EBB_HIDDEN void ebb__hist_fini(struct ebb__arena *a);
/* ebb_alloc_history_get's copy: the newest min(cap, held) actions, oldest first (a free pair
 * slot expanded); out NULL: only *count (and *total) of them. Takes the lock. */
EBB_HIDDEN ebb_status ebb__hist_get(struct ebb__arena *a, ebb_alloc_trace_entry *out, size_t cap, size_t *count,
                                    uint64_t *total);
/* The newest min(cap, held) actions into out as ring entries, oldest first, pairs expanded
 * (the snapshot's copy). The count. Lock held. */
EBB_HIDDEN size_t ebb__hist_copy(const struct ebb__arena *a, struct ebb__hist_entry *out, size_t cap);

/* Reads the clock, re-measures the counter's rate and returns the time for counter value t
 * (the slow path of ebb__hist_now). Lock held. */
EBB_HIDDEN uint64_t ebb__hist_clock_read(struct ebb__hclock *c, uint64_t t);

/* The time of a history entry (struct ebb__hclock). Lock held. */
static inline uint64_t ebb__hist_now(struct ebb__hclock *c) {
#if defined(__x86_64__)
  uint64_t t = __builtin_ia32_rdtsc();
  uint64_t d = t - c->tsc_a; /* huge after a counter step back (migration): re-read */
  if (EBB_UNLIKELY(d >= c->span)) return ebb__hist_clock_read(c, t);
  /* d < span <= 2^27 and rate_q32 < 100 * 2^32: the product needs 128 bits; off by < 0.1 ns
   * from the exact d * ns_per_tick. */
  uint64_t ns = c->ns_a + (uint64_t)(((unsigned __int128)d * c->rate_q32) >> 32);
  if (ns < c->last) ns = c->last;
  return c->last = ns;
#else
  return ebb__hist_clock_read(c, 0);
#endif
}

/* history.c: the action as a trace instant, and the arena's allocated bytes after it as a trace
 * counter (ebb/trace.h); act is an ebb_alloc_action or EBB__HIST_FREE_PAIR. For the history's
 * recorders, when tracing is on. Lock held. */
EBB_HIDDEN EBB_COLD void ebb__alloc_trace(const struct ebb__arena *a, unsigned act, uint64_t size, const char *owner);

/* Entries ahead of the one written whose line is prefetched for writing (ebb__hist_rec_at). */
#define EBB__HIST_PREFETCH_AHEAD 8

/* Records one action at time t. Lock held. */
static inline void ebb__hist_rec_at(struct ebb__hist *h, uint64_t t, ebb_alloc_action act, uint64_t addr, uint64_t size,
                                    uint64_t requested, uint64_t stream, uint8_t owner_cat, const char *owner) {
  struct ebb__hist_entry *e = &h->ring[h->head];
  if (++h->head == h->cap) h->head = 0;
  h->total++;
  EBB_ASSERT(stream >> 56 == 0);
  /* A ring larger than the caches makes each new line a read for ownership from memory; asked
   * for a few entries ahead, it overlaps the allocator's own work instead of stalling this
   * store. Past the ring's end it touches nothing: a prefetch never faults (the address is
   * made as an integer, never as an out-of-bounds pointer). */
  __builtin_prefetch((const void *)((uintptr_t)e + EBB__HIST_PREFETCH_AHEAD * sizeof *e), 1, 0);
  *e = (struct ebb__hist_entry){t, addr, size, requested, owner, ebb__he_sac(stream, (unsigned)act, owner_cat)};
}

/* Records one action. Lock held. With the history off this is one predictable branch; on, a
 * counter read (ebb__hist_now) and a 48-byte store into the ring (the oldest entry is
 * overwritten when full). */
static inline void ebb__hist_rec(struct ebb__arena *a, ebb_alloc_action act, uint64_t addr, uint64_t size,
                                 uint64_t requested, uint64_t stream, uint8_t owner_cat, const char *owner) {
  struct ebb__hist *h = &a->hist;
  if (EBB_TRACE_ON()) ebb__alloc_trace(a, (unsigned)act, size, owner);
  if (!h->cap) return;
  ebb__hist_rec_at(h, ebb__hist_now(&h->clk), act, addr, size, requested, stream, owner_cat, owner);
}

/* Records a free that completes in the call that requested it: FREE_REQUESTED, then
 * FREE_COMPLETED with the same fields and time, as one EBB__HIST_FREE_PAIR slot (the readers
 * expand it). Lock held. */
static inline void ebb__hist_rec_free_pair(struct ebb__arena *a, uint64_t addr, uint64_t size, uint64_t requested,
                                           uint64_t stream, uint8_t owner_cat, const char *owner) {
  struct ebb__hist *h = &a->hist;
  if (EBB_TRACE_ON()) ebb__alloc_trace(a, EBB__HIST_FREE_PAIR, size, owner);
  if (!h->cap) return;
  ebb__hist_rec_at(h, ebb__hist_now(&h->clk), (ebb_alloc_action)EBB__HIST_FREE_PAIR, addr, size, requested, stream,
                   owner_cat, owner);
  h->total++; /* the slot holds two actions */
}

/* ---- snapshot.c: snapshots and the OOM report's top owners ----------------------------------- */

/* Writes the snapshot of every arena to `path`; `fn` names the public call for messages. Takes
 * each arena's lock in turn: no arena lock may be held. */
EBB_HIDDEN ebb_status ebb__snapshot_write(const char *fn, const char *path);
/* The top owners by allocated bytes of the arena, as ", top owners: parameter/w1 1.00 GiB, ..."
 * into buf ("" when nothing is allocated or no host memory is left). Lock held. */
EBB_HIDDEN void ebb__top_owners(struct ebb__arena *a, char *buf, size_t cap);

/* ---- module.c: the registry, the configuration, start and teardown --------------------------- */

enum { EBB__AL_DOWN = 0, EBB__AL_STARTING = 1, EBB__AL_UP = 2 };

/* The module's state: read inline by device.c's entry checks (the allocation entry computes
 * &dev[device] from it: one instruction at this layout). */
struct ebb__alloc_state {
  _Atomic int phase;  /* EBB__AL_*: the module down, starting or up */
  int ndev;
  struct ebb__conf conf;
  char oom_path[512]; /* conf.oom_snapshot points here */
  char env[512];      /* conf.env points here */
  struct ebb__arena dev[EBB_MAX_DEVICES];
};
EBB_HIDDEN extern struct ebb__alloc_state ebb__alloc_module;

/* The module started: one acquire load, the whole entry check of every call once it is up.
 * UP implies ebb is initialised: the teardown hook stores DOWN while `ready` is still set. */
static inline bool ebb__alloc_up(void) {
  /* acquire: pairs with the release store of EBB__AL_UP in ebb__alloc_enter_slow: the arenas
   * are initialised. */
  return atomic_load_explicit(&ebb__alloc_module.phase, memory_order_acquire) == EBB__AL_UP;
}
/* Entry check of every public call of the module: ebb initialised, the module started (started
 * here by the first call that finds it down). _slow: the part after ebb__alloc_up. */
EBB_HIDDEN ebb_status ebb__alloc_enter(const char *fn);
EBB_HIDDEN ebb_status ebb__alloc_enter_slow(const char *fn);
/* `s` validated into *out (its id and device); the message names `fn` on failure. */
EBB_HIDDEN ebb_status ebb__stream_ref(const char *fn, ebb_stream_t *s, struct ebb__stream_ref *out);
/* The device arenas, i in [0, device count), NULL past them (snapshots, messages). */
EBB_HIDDEN struct ebb__arena *ebb__arena_nth(int i);
/* Every arena (devices, then the pinned and host pools), NULL past the last: where to search
 * when a pointer is in neither map (messages only). */
EBB_HIDDEN struct ebb__arena *ebb__arena_any(int i);
/* The same arenas, listed at start: *n of them. For the copy hook's range filter. */
#define EBB__ARENAS_MAX (2 * EBB_MAX_DEVICES + 2)
EBB_HIDDEN struct ebb__arena *const *ebb__arenas_all(int *n);
/* Segments given back, remembered for messages about pointers into them. add: a's segment
 * [base, base+size) went back to its upstream during the session (empty_cache, an OOM retry, a
 * trim; the teardown records its own); any lock. find: when a segment of a pool of `kind`
 * holding `addr` went back ("before the last completed ebb_shutdown" / "since ebb_init
 * (...)"), the pool's label in `label`; NULL when none of the remembered ones holds it. Failure
 * paths only. */
EBB_HIDDEN void ebb__grave_add(const struct ebb__arena *a, uint64_t base, size_t size);
EBB_HIDDEN const char *ebb__grave_find(uint64_t addr, enum ebb__memkind kind, char *label, size_t len);

/* ---- device.c: the device arena -------------------------------------------------------------- */

/* The driver upstream of the device arenas. */
EBB_HIDDEN extern const struct ebb__upstream ebb__device_upstream;

/* ---- host.c: the pinned and host pools ----------------------------------------------------------
 * Started and torn down with the device arenas by module.c (start: no lock held, after the
 * configuration is parsed). */

EBB_HIDDEN ebb_status ebb__hostpools_start(const struct ebb__conf *conf, int ndev);
EBB_HIDDEN void ebb__hostpools_fini(void);
/* The pinned pools then the host pool, NULL past the last. */
EBB_HIDDEN struct ebb__arena *ebb__hostpool_nth(int i);

#endif /* EBB_ARENA_IMPL_H */
