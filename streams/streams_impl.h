/* streams_impl.h: what stream.c, event.c and copy.c share, and nothing outside streams/.
 *
 * The module state is one static struct, started by the first ebb_init (the module's start, in
 * layer order) and torn down by its stop at the last ebb_shutdown. Handles are type-stable
 * slots carved from slabs: a slot's memory stays valid until that teardown, so a stale handle can
 * always be read and reported as EBB_EFREED instead of crashing.
 *
 * Lock ranks (common/ebb_sync.h): stream slots EBB_RANK_STREAM_POOL, event slots and driver-event
 * pool EBB_RANK_EVENT_POOL, each staging chunk EBB_RANK_STAGING, the host-copy record free list
 * EBB_RANK_LEAF. None of the first three is ever held across a call into runtime/ that could take
 * the runtime's own locks (kernel launch); staging chunks are held across seam
 * calls (ebb__drv_*), which take no ebb lock.
 */
#ifndef EBB_STREAMS_IMPL_H
#define EBB_STREAMS_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_internal.h"
#include "runtime_export.h"
#include "ebb_list.h"
#include "ebb_sync.h"

/* ---- limits and defaults ------------------------------------------------------------------- */

#define EBB__POOL_SIZE_DEFAULT 8u
#define EBB__POOL_SIZE_MAX 64u
#define EBB__STAGING_CHUNK_DEFAULT ((size_t)4 << 20)
#define EBB__STAGING_CHUNK_MIN ((size_t)4 << 10)
#define EBB__STAGING_CHUNK_MAX ((size_t)1 << 30)
#define EBB__STAGING_CHUNKS_DEFAULT 4u
#define EBB__STAGING_CHUNKS_MAX 64u
/* A released handle's slot is reused only once this many other released slots wait ahead of it,
 * so a stale handle stays detectable for at least this many later releases. */
#define EBB__SLOT_QUARANTINE 1024u
#define EBB__SLAB_OBJECTS 64u
/* Released streams remembered per device at first (struct ebb__tomb; the table grows), and the
 * most tombs one release reaps. */
#define EBB__TOMBS 64u
#define EBB__CACHE_LINE 64

/* Slot magics: live handles, released ones, and everything else (not a handle of this kind).
 * A stream being released is RELEASING from the moment its release is decided until its last
 * work has a tomb (ebb_stream_release): the public calls report it as released, but its driver
 * stream still exists. */
#define EBB__STREAM_LIVE 0x65627374u      /* "ebst" */
#define EBB__STREAM_RELEASING 0x65627372u /* "ebsr" */
#define EBB__EVENT_LIVE 0x65626576u       /* "ebev" */
#define EBB__SLOT_FREED 0x64656164u       /* "dead" */

/* ---- slabs and slots ----------------------------------------------------------------------- */

/* Fixed-size objects carved from malloc'ed slabs and never returned before teardown. */
struct ebb__slab {
  struct ebb__slab *next;
  size_t used;
  _Alignas(EBB__CACHE_LINE) unsigned char mem[];
};

/* A slot pool: a FIFO free list (released slots at the tail, reuse from the head) over slabs.
 * Not thread-safe: its owner's mutex protects it. */
struct ebb__slot_pool {
  struct ebb_list free;
  size_t nfree;
  size_t quarantine; /* minimum free slots kept before one is reused */
  size_t obj_size;
  struct ebb__slab *slabs;
};

/* The header every slot starts with. `magic`, `gen` and the gone_ fields are atomics because a
 * stale handle may be read by one thread while another reuses its slot; the other fields are
 * owned by whoever holds the handle, and a new handle taking the slot rewrites them. */
#define EBB__GONE_AT_SHUTDOWN (-1)
struct ebb__slot {
  _Atomic uint32_t magic;
  _Atomic uint32_t gen; /* bumped at every reuse of the slot */
  /* The id and device of the handle last released from the slot, written by its release before
   * the magic leaves LIVE: what the EFREED message of a stale handle names, without reading the
   * fields a new handle may be writing. */
  _Atomic uint64_t gone_id;
  _Atomic int gone_device; /* EBB__GONE_AT_SHUTDOWN: live until a completed ebb_shutdown */
  struct ebb_list node; /* in the owner's free list while released */
};

EBB_HIDDEN void ebb__slot_pool_init(struct ebb__slot_pool *p, size_t obj_size, size_t quarantine);
/* A zeroed (fresh) or previously released slot, its gen bumped; NULL when out of memory. */
EBB_HIDDEN void *ebb__slot_take(struct ebb__slot_pool *p);
EBB_HIDDEN void ebb__slot_give(struct ebb__slot_pool *p, void *slot);
/* Calls fn on every slot ever carved (live and free); teardown only. */
EBB_HIDDEN void ebb__slot_pool_each(struct ebb__slot_pool *p, void (*fn)(void *slot, void *ctx), void *ctx);
EBB_HIDDEN void ebb__slot_pool_fini(struct ebb__slot_pool *p);

/* ---- objects ------------------------------------------------------------------------------- */

enum ebb__stream_kind { EBB__STREAM_DEFAULT = 0, EBB__STREAM_POOL = 1, EBB__STREAM_USER = 2 };

struct ebb_stream {
  struct ebb__slot slot;
  uint64_t id;          /* process-unique, never reused */
  int device;           /* fixed for the slot's whole life: slots are per device */
  ebb_stream_prio prio;
  enum ebb__stream_kind kind;
  struct CUstream_st *cu;
  /* Calls using `cu` of a caller-owned stream right now (ebb__stream_pin); its release waits
   * for none to be left before it records the stream's last work and destroys `cu`. */
  _Atomic uint32_t pins;
  /* Modules holding a caller-owned stream for a while (ebb__stream_hold: a running backward)
   * and its release, in one word so that one compare-and-swap decides between them: the low 32
   * bits count the holders, EBB__HOLD_ASKED says ebb_stream_release was called (carried out by
   * whoever brings the count to 0), EBB__HOLD_DONE that the release is carried out or under way.
   * The flags are cleared when the slot gets a new stream. */
  _Atomic uint64_t hold;
};
#define EBB__HOLD_COUNT 0xffffffffull
#define EBB__HOLD_ASKED (1ull << 32)
#define EBB__HOLD_DONE (1ull << 33)

/* The driver handle of live stream s as its trace track's key (ebb/trace.h), 0 when s is not
 * live. Pins s for the read; quiet (a failure is the traced call's own to report). */
EBB_HIDDEN uint64_t ebb__stream_trace_key(ebb_stream_t *s);

struct ebb_event {
  struct ebb__slot slot;
  uint64_t id;
  int device;           /* fixed for the slot's whole life, as for streams */
  unsigned flags;
  _Atomic bool recorded;
  struct CUevent_st *cu; /* borrowed from the device's driver-event pool while the handle lives */
};

/* A released user stream's last work: the pooled driver event ebb_stream_release recorded on it
 * before destroying it (the driver finishes the work, the handle is gone). */
struct ebb__tomb {
  uint64_t id;            /* the released stream's id */
  struct CUevent_st *ev;  /* complete once all work issued to it has run; NULL: lost (its release
                           * could neither record nor wait for that work), never reaped, and a
                           * wait for it fails so that the waiter waits for the device instead */
};

/* One pinned staging chunk of a device's ring. `mu` is held for the whole use of the chunk:
 * waiting for its previous use, filling it and enqueueing the copy and the event record. */
struct ebb__chunk {
  ebb_mutex mu;
  void *mem;            /* ebb__drv_pinned_alloc'ed lazily */
  struct CUevent_st *ev;/* recorded after each use; complete means the chunk is free */
  bool used;            /* ev has been recorded at least once */
};

/* The record a staged device-to-pageable copy hands to its host function. */
/* The record behind a caller's ebb_stream_host_func: the driver runs a trampoline that marks its
 * thread as running a host function (ebb__in_host_fn) around fn(user). */
struct ebb__host_call {
  struct ebb__slot slot;
  ebb_host_fn fn;
  void *user;
  struct ebb__dev *dev; /* whose free list it returns to */
};

struct ebb__host_copy {
  struct ebb__slot slot;
  void *dst;
  const void *src;
  size_t bytes;
  struct ebb__dev *dev; /* whose free list it returns to */
};

/* Counters of one device; each device's set sits on its own cache line. */
struct ebb__dev_stats {
  _Atomic uint64_t streams_created;
  _Atomic uint64_t events_created;
  _Atomic uint64_t event_pool_hits;
  _Atomic uint64_t staged_bytes;
  _Atomic uint64_t staging_waits;
};

struct ebb__abandoned {
  struct ebb__abandoned *next;
  void *mem;
};

struct ebb__dev {
  int ordinal;
  int prio_value[2]; /* driver priority of EBB_PRIO_LOW, EBB_PRIO_HIGH */

  /* Immortal streams, created on first use and published by compare-and-swap. */
  _Atomic(ebb_stream_t *) default_stream;
  _Atomic(ebb_stream_t *) pool[2][EBB__POOL_SIZE_MAX];
  /* Internal, never handed out: it only waits on released streams' tombs and records events
   * after them (ebb__event_record_released), so no caller's stream gains a dependency. */
  _Atomic(ebb_stream_t *) tomb_stream;
  _Alignas(EBB__CACHE_LINE) _Atomic uint32_t pool_next[2]; /* round-robin cursors */

  _Alignas(EBB__CACHE_LINE) ebb_mutex stream_mu; /* protects stream_slots */
  struct ebb__slot_pool stream_slots;

  _Alignas(EBB__CACHE_LINE) ebb_mutex tomb_mu;   /* protects tombs (a leaf: held across seam
                                                    calls only, which take no ebb lock) */
  struct ebb__tomb *tombs;                       /* oldest first; grown when all are busy */
  unsigned ntombs, captombs;

  _Alignas(EBB__CACHE_LINE) ebb_mutex event_mu;  /* protects event_slots and drv_events */
  struct ebb__slot_pool event_slots;
  struct CUevent_st **drv_events[2];             /* [timing]: idle driver events, a stack */
  size_t drv_nevents[2], drv_cap[2];

  _Alignas(EBB__CACHE_LINE) _Atomic uint32_t chunk_next; /* staging ring cursor */
  struct ebb__chunk chunks[EBB__STAGING_CHUNKS_MAX];
  /* Staging memory that work may still use after a failing driver left it unordered: never
   * reused, freed at teardown (after every device was waited for). A lock-free stack. */
  _Atomic(struct ebb__abandoned *) abandoned;
  ebb_mutex rec_mu;                              /* protects host_copies */
  struct ebb__slot_pool host_copies;
  ebb_mutex call_mu;                             /* protects host_calls (a leaf) */
  struct ebb__slot_pool host_calls;

  _Alignas(EBB__CACHE_LINE) struct ebb__dev_stats stats;
};

/* ---- module state -------------------------------------------------------------------------- */

enum ebb__phase { EBB__DOWN = 0, EBB__STARTING = 1, EBB__UP = 2 };

struct ebb__streams {
  _Atomic int phase;
  _Atomic long live_streams; /* caller-owned streams not yet released (ebb_shutdown refuses) */
  _Atomic long live_events;  /* caller-owned events, the arena's internal ones excepted */
  int ndev;
  unsigned pool_size;
  size_t chunk_bytes;
  unsigned nchunks;
  struct ebb__dev dev[EBB_MAX_DEVICES];
};

EBB_HIDDEN extern struct ebb__streams ebb__streams_state;

/* Entry check of every public call: ebb initialised (EBB_ENOTINIT naming `fn` otherwise) and the
 * module started (lazily, reading EBB_STREAM_POOL_SIZE, EBB_STAGING_CHUNK, EBB_STAGING_CHUNKS). */
EBB_HIDDEN ebb_status ebb__streams_enter(const char *fn);
/* A process-unique id for a new stream or event (never reused, not reset by ebb_shutdown). */
EBB_HIDDEN uint64_t ebb__new_id(void);
EBB_HIDDEN ebb_status ebb__check_device(const char *fn, int device);
/* `s` non-NULL, a stream, live: EBB_EINVAL / EBB_EFREED with a message naming `fn` and the id.
 * Enough for calls that read only the fields fixed for a stream's life (id, device, priority);
 * a call that uses the driver stream pins it instead. */
EBB_HIDDEN ebb_status ebb__check_stream(const char *fn, const ebb_stream_t *s);
/* The EBB_EFREED failure for a released (or releasing) stream, naming its id and device. */
EBB_HIDDEN ebb_status ebb__stream_freed(const char *fn, const ebb_stream_t *s);

/* ebb__check_stream for a call that uses the driver stream s->cu: on EBB_OK, s->cu stays valid
 * until ebb__stream_unpin(s), whatever a release of `s` on another thread does meanwhile; a
 * release that came first makes it EBB_EFREED. Pool and default streams are never released and
 * cost no pin. Hold a pin only while enqueueing (driver calls that return without waiting for
 * device work): ebb_stream_release waits for the pins to go, and the work a wait would wait for
 * may include a host function releasing this very stream.
 * The pin is an increment of a counter the stream's users share (its cache line is the slot's,
 * which every call reads anyway); the release side is in ebb_stream_release. */
/* Set on a driver thread while it runs a caller's host function (stream.c). */
EBB_HIDDEN extern _Thread_local bool ebb__tls_in_host_fn;
/* The EBB_ESTATE failure of a call that would reach the driver from a host function. */
EBB_HIDDEN ebb_status ebb__host_fn_refused(const char *fn, const ebb_stream_t *s);

static inline ebb_status ebb__stream_pin(const char *fn, ebb_stream_t *s) {
  ebb_status st = ebb__check_stream(fn, s);
  if (EBB_UNLIKELY(st)) return st;
  /* As CUDA's host functions, ours must not call the driver (cuLaunchHostFunc: it may fail with
   * CUDA_ERROR_NOT_PERMITTED, or wait for the very function): refused on every driver alike. */
  if (EBB_UNLIKELY(ebb__tls_in_host_fn)) return ebb__host_fn_refused(fn, s);
  if (s->kind != EBB__STREAM_USER) return EBB_OK; /* immortal */
  /* seq_cst, both: against the release's seq_cst CAS of the magic and its seq_cst loads of
   * pins, either this load sees the release or the release sees this pin (store-load order). */
  atomic_fetch_add_explicit(&s->pins, 1, memory_order_seq_cst);
  if (EBB_LIKELY(atomic_load_explicit(&s->slot.magic, memory_order_seq_cst) == EBB__STREAM_LIVE)) return EBB_OK;
  /* release: as in ebb__stream_unpin. */
  atomic_fetch_sub_explicit(&s->pins, 1, memory_order_release);
  return ebb__stream_freed(fn, s);
}

/* Ends the pin of a successful ebb__stream_pin. The kind cannot change while pinned: the slot is
 * reused only after its release, which waits for the pins. */
static inline void ebb__stream_unpin(ebb_stream_t *s) {
  /* release: pairs with the loads of pins in ebb_stream_release, so this call's use of s->cu
   * happens before the release destroys it. */
  if (s->kind == EBB__STREAM_USER) atomic_fetch_sub_explicit(&s->pins, 1, memory_order_release);
}

EBB_HIDDEN ebb_status ebb__check_event(const char *fn, const ebb_event_t *e);
/* The calling thread's current stream on `device` (creating the default stream if needed). */
EBB_HIDDEN ebb_status ebb__stream_current_of(const char *fn, int device, ebb_stream_t **out);

/* Waits for driver stream `s` (when not NULL) or else driver event `e`, both of `device`: polls
 * the driver for about EBB__SPIN_NS, relaxing the CPU between polls, then calls its blocking
 * synchronize. Used by stream and event synchronize. */
EBB_HIDDEN ebb_status ebb__spin_then_park(int device, struct CUstream_st *s, struct CUevent_st *e);

/* An idle driver event of `d` from its pool (a driver call only on a miss), and its return. */
EBB_HIDDEN ebb_status ebb__drv_event_get(struct ebb__dev *d, bool timing, struct CUevent_st **out);
EBB_HIDDEN void ebb__drv_event_put(struct ebb__dev *d, bool timing, struct CUevent_st *cu);

/* Records a pooled driver event on `s` and makes `waiter` wait on it: waiter runs after the
 * work issued to `s` so far. Both streams pinned by the caller. */
EBB_HIDDEN ebb_status ebb__stream_order(ebb_stream_t *waiter, ebb_stream_t *s);

/* Per-device start and teardown of each file's part of struct ebb__dev. */
EBB_HIDDEN void ebb__events_start(struct ebb__dev *d);
EBB_HIDDEN void ebb__events_teardown(struct ebb__dev *d);
EBB_HIDDEN void ebb__copy_start(struct ebb__dev *d);
EBB_HIDDEN void ebb__copy_teardown(struct ebb__dev *d);

#endif /* EBB_STREAMS_IMPL_H */
