/* offload.c: saved tensors moved to pinned host memory during the forward and brought back,
 * ahead of the nodes that read them, during the backward (ebb/autograd.h, "offloaded saved
 * tensors").
 *
 * A record (struct ebb__offl) stands for one storage saved under an offload scope: the packed
 * value of every saved slot that refers to it (saved.c) holds a reference, as does each backward
 * plan that lists it, until its node has run. Its state:
 * - RESIDENT: made, its copy not issued yet (only while the save runs, or when the copy failed);
 * - COPYING: its copy to pinned memory was issued on the device's offload stream, at the save;
 * - HOST: the copy was seen done (an event query; copies of a device finish in issue order).
 * `dev_t` is the storage on the device, if any: the original (`orig`: held after the copy out for
 * EBB__OFFL_HOLD more saves on the device, or, under a device budget, until the budget needs its
 * room) or a reload. Every byte of it counts against the scope's budget.
 *
 * No host wait, and no memory held by a host running ahead. A block freed with a use pending on
 * another stream stays out of the arena's reach until the host sees that use's event complete,
 * and a host that issues a whole forward before the device has run much of it would grow the
 * arena by every activation it offloads. So a copied-out original is held for the next
 * EBB__OFFL_HOLD saves on its device, then retired: its allocation stream waits (on the device)
 * for the copy's event, the copy's use is dropped from the block (ebb__arena_use_forget), and the
 * handle goes; the next allocation on that stream reuses the block in stream order. The stream
 * waits only for a copy issued several layers earlier, which the link has long finished when it
 * keeps up. Reloads work the same way from the other side: a reload is allocated on the stream
 * of the node that reads it first, written by the reload stream after that stream's work so far,
 * and once that node's stream has waited for the reload, the reload stream's use is dropped as
 * well.
 *
 * A write to an offloaded storage after the save (any in-place op: ops shows every one to
 * autograd while records live, ebb__inplace_watch_add) marks its records changed, so the backward
 * fails the version check as for any saved tensor, and makes the writer's stream wait for a copy
 * out still reading it.
 *
 * The plan (struct ebb__offl_plan): when a backward starts, the engine lists the offloaded
 * records of every node it will run (ebb__offl_plan_add), and the plan sorts them per device by
 * node sequence number, largest first: the order the engine runs a device's nodes in (on the
 * calling thread exactly; on device workers as far as cross-device dependencies allow). It then
 * keeps, per device, up to the window's bytes of reloads issued ahead of the node running, on the
 * device's reload stream. A record used by several nodes is reloaded for the first and let go
 * after the last (in plan order); a node that runs out of that order still reads it correctly,
 * reloaded on demand.
 *
 * Threading: one lock (ebb__offl_mu, rank EBB_RANK_AG_OFFLOAD) guards every record's state and
 * reference count, the scopes' counters, the device lists, the plans and the statistics; it is
 * held across the stream, allocator and event calls that change a record, never across a host
 * wait. A record is freed under it when its last reference goes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_export.h"
#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/stream.h"
#include "ebb/trace.h"
#include "ebb_internal.h"
#include "ebb_list.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "streams_export.h"
#include "autograd_impl.h"

#define OFFL_DEFAULT_MIN ((int64_t)1 << 20)
#define OFFL_DEFAULT_WINDOW ((int64_t)256 << 20)
#define OFFL_STALL_MIN_MS 0.002f /* a stream's wait shorter than this is an event's resolution, not a stall */
#define EBB__OFFL_HOLD 2 /* copied-out originals a device holds before retiring the oldest (ebb/autograd.h says 2) */

enum offl_state { OFFL_RESIDENT, OFFL_COPYING, OFFL_HOST };

struct ebb__offl_scope {
  long refs;                  /* the stack entry and each record; under the lock */
  ebb_offload_policy pol;     /* normalised: defaults filled in */
  int ndev;
  int64_t *resident;          /* [ndev] bytes of its records' storages on each device */
  int64_t *saved_bytes;       /* [ndev] bytes of the storages it saved (distinct) on each device */
  struct ebb_list *kept;      /* [ndev] its records not copied out yet (RESIDENT), oldest first */
  int64_t pinned;             /* pinned bytes its records hold */
  struct ebb__offl **bucket;  /* its records by storage serial, for one copy per storage */
  size_t nbucket, count;
};

struct ebb__offl {
  long refs; /* under the lock */
  struct ebb__offl_scope *sc;
  int dev;
  ebb_dtype dt;
  size_t bytes;
  uint64_t serial, version;
  char owner[EBB_OWNER_NAME_MAX + 1]; /* the saving node's name: the pinned and reloaded blocks' owner */
  enum offl_state state;
  ebb_tensor_t *dev_t;  /* the whole storage on the device (a slot-less 1-D handle), or NULL */
  bool orig;            /* dev_t is the original (else a reload) */
  ebb_stream_t *as;     /* dev_t's allocation stream, and its id */
  uint64_t as_id;
  bool in_forgot;       /* the reload stream's use of the reload was dropped */
  ebb_event_t *in_ev;   /* the last reload's completion */
  int users;            /* plans holding dev_t until their last node reading it has run */
  void *host;           /* the pinned copy */
  ebb_event_t *out_ev;  /* the copy out's completion */
  bool allow_mut;       /* saved inside an allow-mutation scope: a write lets the original go instead */
  bool modified;        /* the storage was changed in place after the save */
  uint64_t modified_version;
  bool in_list;         /* `link` is in its scope's kept list (RESIDENT) or the device's list of copies in flight (COPYING) */
  ebb_event_t *made_ev; /* RESIDENT: recorded at the save on the stream that made it (a later copy waits for it) */
  struct ebb_list link;
  bool in_held;         /* `hlink` is in the device's list of held originals */
  struct ebb_list hlink;
  struct ebb__offl *hnext; /* in its scope's table */
  struct ebb__offl *gnext; /* in the table of all records */
};

/* A stall probe: two timing events around a stream's wait for a copy. */
struct offl_probe {
  struct offl_probe *next;
  ebb_event_t *before, *after;
  bool forward; /* a retirement's wait for a copy out (else a node's for a reload) */
};

static ebb_mutex ebb__offl_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.offload", EBB_RANK_AG_OFFLOAD};
static struct {
  int ndev;
  struct offl_dev {
    ebb_stream_t *out, *in;  /* the offload and reload streams, made at first use */
    uint64_t out_id, in_id;
    struct ebb_list pending; /* COPYING records in issue order */
    struct ebb_list held;    /* records holding their copied-out original, oldest first */
    size_t nheld;
    int64_t expect;          /* bytes the last budgeted scope saved on the device (0: none yet) */
  } *dev;
  struct offl_probe *probes;
  ebb_offload_stats st;
} M;
static _Atomic long offl_live; /* records alive: the engine's check for a plan */
static long offl_scopes;       /* scopes alive (under the lock): the device state stays while any does */

/* Events and streams of the module's own: not counted as the caller's (ebb_shutdown's check). */
static ebb_status own_event(int dev, unsigned flags, ebb_event_t **e) {
  ebb_status st = ebb_event_create(dev, flags, e);
  if (!st) ebb__events_live_add(-1);
  return st;
}
static void own_event_free(ebb_event_t *e) {
  if (!e) return;
  ebb__events_live_add(1);
  ebb_event_release(e);
}

/* ---- statistics ---------------------------------------------------------------------------------- */

static void stat_pinned(int64_t d) {
  M.st.pinned_bytes += (uint64_t)d;
  if (M.st.pinned_bytes > M.st.pinned_peak_bytes) M.st.pinned_peak_bytes = M.st.pinned_bytes;
}
static void stat_away(int64_t d) {
  M.st.device_bytes_saved += (uint64_t)d;
  if (M.st.device_bytes_saved > M.st.device_bytes_saved_peak) M.st.device_bytes_saved_peak = M.st.device_bytes_saved;
}

/* The probes whose events completed, counted and freed. Lock held. */
static void probes_resolve(void) {
  struct offl_probe **pp = &M.probes;
  while (*pp) {
    struct offl_probe *p = *pp;
    bool done = false;
    if (ebb_event_query(p->after, &done) == EBB_OK && !done) {
      pp = &p->next;
      continue;
    }
    float ms = 0;
    if (done && ebb_event_elapsed(p->before, p->after, &ms) == EBB_OK && ms >= OFFL_STALL_MIN_MS) {
      *(p->forward ? &M.st.forward_waits : &M.st.stalls) += 1;
      *(p->forward ? &M.st.forward_wait_ns : &M.st.stall_ns) += (uint64_t)((double)ms * 1e6);
    }
    own_event_free(p->before);
    own_event_free(p->after);
    *pp = p->next;
    free(p);
  }
}

ebb_status ebb_offload_get_stats(ebb_offload_stats *out) {
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_offload_get_stats: out is NULL; expected a struct to fill");
  ebb__fail_mute(true);
  ebb__mutex_lock(&ebb__offl_mu);
  probes_resolve();
  *out = M.st;
  ebb__mutex_unlock(&ebb__offl_mu);
  ebb__fail_mute(false);
  return EBB_OK;
}

void ebb_offload_reset_stats(void) {
  ebb__mutex_lock(&ebb__offl_mu);
  ebb_offload_stats z = {0};
  z.pinned_bytes = z.pinned_peak_bytes = M.st.pinned_bytes;
  z.device_bytes_saved = z.device_bytes_saved_peak = M.st.device_bytes_saved;
  M.st = z;
  ebb__mutex_unlock(&ebb__offl_mu);
}

long ebb__offl_live(void) { return atomic_load_explicit(&offl_live, memory_order_relaxed); }

/* ---- devices ---------------------------------------------------------------------------------- */

/* The per-device state, made at first use. Lock held. */
static ebb_status devs_ready(const char *fn) {
  if (M.dev) return EBB_OK;
  int n = 0;
  ebb_status st = ebb_dev_count(&n);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  M.dev = calloc((size_t)(n > 0 ? n : 1), sizeof *M.dev);
  if (!M.dev) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the offload state", fn);
  M.ndev = n;
  for (int d = 0; d < n; d++) {
    ebb_list_init(&M.dev[d].pending);
    ebb_list_init(&M.dev[d].held);
  }
  return EBB_OK;
}

/* Device dev's offload (out) or reload stream. Lock held. */
static ebb_status dev_stream(const char *fn, int dev, bool out, ebb_stream_t **s) {
  ebb_stream_t **slot = out ? &M.dev[dev].out : &M.dev[dev].in;
  if (!*slot) {
    ebb_status st = ebb_stream_create(dev, out ? EBB_PRIO_LOW : EBB_PRIO_HIGH, slot);
    if (!st) ebb__streams_live_add(-1);
    if (!st) st = ebb_stream_id(*slot, out ? &M.dev[dev].out_id : &M.dev[dev].in_id);
    if (st) return ebb__fail(st, "%s: could not make the %s stream of device %d: %s", fn, out ? "offload" : "reload", dev,
                             ebb_last_error());
  }
  *s = *slot;
  return EBB_OK;
}

void ebb__offl_stop(void) {
  ebb__mutex_lock(&ebb__offl_mu);
  for (int d = 0; M.dev && d < M.ndev; d++) {
    for (int i = 0; i < 2; i++) {
      ebb_stream_t *s = i ? M.dev[d].in : M.dev[d].out;
      if (!s) continue;
      ebb__streams_live_add(1);
      ebb_stream_release(s);
    }
  }
  while (M.probes) {
    struct offl_probe *p = M.probes;
    M.probes = p->next;
    own_event_free(p->before);
    own_event_free(p->after);
    free(p);
  }
  /* Records still alive (a graph kept past the last ebb_shutdown, which counts them) keep the
   * device lists they are in. */
  if (!ebb__offl_live() && !offl_scopes) {
    free(M.dev);
    M.dev = NULL;
    M.ndev = 0;
  } else {
    for (int d = 0; d < M.ndev; d++) M.dev[d].out = M.dev[d].in = NULL;
  }
  if (!ebb__offl_live()) memset(&M.st, 0, sizeof M.st); /* (else the survivors' frees would wrap them) */
  ebb__mutex_unlock(&ebb__offl_mu);
}

/* ---- scopes ----------------------------------------------------------------------------------- */

ebb_status ebb__offl_scope_new(const char *fn, const ebb_offload_policy *p, struct ebb__offl_scope **out) {
  if (!p) return ebb__fail(EBB_EINVAL, "%s: policy is NULL; expected a policy (zero-initialised for the defaults)", fn);
  if (p->version > EBB_OFFLOAD_POLICY_VERSION)
    return ebb__fail(EBB_ENOTSUP, "%s: policy->version is %u; this library reads policies up to version %d (0 means %d)", fn,
                     (unsigned)p->version, EBB_OFFLOAD_POLICY_VERSION, EBB_OFFLOAD_POLICY_VERSION);
  static const char *const names[] = {"min_bytes", "pinned_budget_bytes", "device_budget_bytes", "prefetch_window_bytes"};
  const int64_t v[] = {p->min_bytes, p->pinned_budget_bytes, p->device_budget_bytes, p->prefetch_window_bytes};
  for (size_t i = 0; i < EBB_ARRAY_LEN(v); i++)
    if (v[i] < 0)
      return ebb__fail(EBB_EINVAL, "%s: policy->%s is %lld; expected a byte count >= 0 (0: the default)", fn, names[i],
                       (long long)v[i]);
  ebb_offload_policy pol = *p;
  if (!pol.min_bytes) pol.min_bytes = OFFL_DEFAULT_MIN;
  if (!pol.prefetch_window_bytes) pol.prefetch_window_bytes = OFFL_DEFAULT_WINDOW;
  if (pol.prefetch_window_bytes < pol.min_bytes)
    return ebb__fail(EBB_EINVAL, "%s: policy->prefetch_window_bytes is %lld, smaller than any tensor the scope offloads (min_bytes "
                     "%lld); expected a window of at least min_bytes, and of at least the largest saved tensor", fn,
                     (long long)pol.prefetch_window_bytes, (long long)pol.min_bytes);
  ebb__mutex_lock(&ebb__offl_mu);
  ebb_status st = devs_ready(fn);
  int ndev = M.ndev;
  ebb__mutex_unlock(&ebb__offl_mu);
  if (st) return st;
  struct ebb__offl_scope *sc = calloc(1, sizeof *sc);
  if (sc) {
    sc->resident = calloc((size_t)(ndev > 0 ? ndev : 1), sizeof *sc->resident);
    sc->saved_bytes = calloc((size_t)(ndev > 0 ? ndev : 1), sizeof *sc->saved_bytes);
    sc->kept = calloc((size_t)(ndev > 0 ? ndev : 1), sizeof *sc->kept);
    sc->nbucket = 64;
    sc->bucket = calloc(sc->nbucket, sizeof *sc->bucket);
  }
  if (!sc || !sc->resident || !sc->saved_bytes || !sc->kept || !sc->bucket) {
    if (sc) {
      free(sc->resident);
      free(sc->saved_bytes);
      free(sc->kept);
      free(sc->bucket);
    }
    free(sc);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the scope", fn);
  }
  for (int d = 0; d < ndev; d++) ebb_list_init(&sc->kept[d]);
  sc->pol = pol;
  sc->ndev = ndev;
  sc->refs = 1;
  ebb__mutex_lock(&ebb__offl_mu);
  offl_scopes++;
  ebb__mutex_unlock(&ebb__offl_mu);
  *out = sc;
  return EBB_OK;
}

static void scope_put_locked(struct ebb__offl_scope *sc) {
  if (--sc->refs) return;
  offl_scopes--;
  free(sc->resident);
  free(sc->saved_bytes);
  free(sc->kept);
  free(sc->bucket);
  free(sc);
}

void ebb__offl_scope_put(struct ebb__offl_scope *sc) {
  ebb__mutex_lock(&ebb__offl_mu);
  scope_put_locked(sc);
  ebb__mutex_unlock(&ebb__offl_mu);
}

static void poll_dev(int dev);

void ebb__offl_scope_exit(struct ebb__offl_scope *sc) {
  ebb__fail_mute(true);
  ebb__mutex_lock(&ebb__offl_mu);
  for (int d = 0; M.dev && d < sc->ndev && d < M.ndev; d++) {
    poll_dev(d);
    /* What a budgeted forward saved: the next one copies out only what will have to leave. */
    /* (the largest: a small forward between two large ones must not make the next copy too late) */
    if (sc->pol.device_budget_bytes && sc->saved_bytes[d] > M.dev[d].expect) M.dev[d].expect = sc->saved_bytes[d];
  }
  ebb__mutex_unlock(&ebb__offl_mu);
  ebb__fail_mute(false);
}

/* The scope's record of storage `serial` at `version`, or NULL. Lock held. */
static struct ebb__offl *scope_find(const struct ebb__offl_scope *sc, uint64_t serial, uint64_t version, bool allow_mut) {
  for (struct ebb__offl *o = sc->bucket[serial & (sc->nbucket - 1)]; o; o = o->hnext)
    if (o->serial == serial && o->version == version && o->allow_mut == allow_mut) return o;
  return NULL;
}

static void scope_insert(struct ebb__offl_scope *sc, struct ebb__offl *o) {
  if (sc->count >= sc->nbucket) { /* grow (a failure keeps the chains longer, nothing else) */
    struct ebb__offl **nb = calloc(sc->nbucket * 2, sizeof *nb);
    if (nb) {
      for (size_t i = 0; i < sc->nbucket; i++)
        while (sc->bucket[i]) {
          struct ebb__offl *x = sc->bucket[i];
          sc->bucket[i] = x->hnext;
          size_t j = x->serial & (sc->nbucket * 2 - 1);
          x->hnext = nb[j];
          nb[j] = x;
        }
      free(sc->bucket);
      sc->bucket = nb;
      sc->nbucket *= 2;
    }
  }
  size_t j = o->serial & (sc->nbucket - 1);
  o->hnext = sc->bucket[j];
  sc->bucket[j] = o;
  sc->count++;
}

static void scope_remove(struct ebb__offl_scope *sc, struct ebb__offl *o) {
  for (struct ebb__offl **pp = &sc->bucket[o->serial & (sc->nbucket - 1)]; *pp; pp = &(*pp)->hnext)
    if (*pp == o) {
      *pp = o->hnext;
      sc->count--;
      return;
    }
}

/* ---- records ---------------------------------------------------------------------------------- */

/* Every live record by storage serial (ebb__offl_inplace finds the ones a write changes). */
static struct {
  struct ebb__offl **bucket;
  size_t nbucket, count;
} G;

static bool g_insert(struct ebb__offl *o) {
  if (G.count >= G.nbucket) { /* grow (a failure keeps the chains longer, nothing else) */
    size_t nn = G.nbucket ? G.nbucket * 2 : 64;
    struct ebb__offl **nb = calloc(nn, sizeof *nb);
    if (nb) {
      for (size_t i = 0; i < G.nbucket; i++)
        while (G.bucket[i]) {
          struct ebb__offl *x = G.bucket[i];
          G.bucket[i] = x->gnext;
          x->gnext = nb[x->serial & (nn - 1)];
          nb[x->serial & (nn - 1)] = x;
        }
      free(G.bucket);
      G.bucket = nb;
      G.nbucket = nn;
    }
  }
  if (!G.nbucket) return false;
  size_t j = o->serial & (G.nbucket - 1);
  o->gnext = G.bucket[j];
  G.bucket[j] = o;
  G.count++;
  return true;
}

static void g_remove(struct ebb__offl *o) {
  for (struct ebb__offl **pp = &G.bucket[o->serial & (G.nbucket - 1)]; *pp; pp = &(*pp)->gnext)
    if (*pp == o) {
      *pp = o->gnext;
      G.count--;
      return;
    }
}

/* Set while this thread works under the lock: the poison fill it makes is not a user's write. */
static _Thread_local bool offl_busy;

/* Stream s (live, id sid) waits on the device for event ev; with a probe around the wait when ev
 * has not completed yet, so a wait that stalls the stream is measured. Lock held. */
static ebb_status stream_wait(ebb_stream_t *s, ebb_event_t *ev, int dev, bool forward) {
  bool done = false;
  if (ebb_event_query(ev, &done) == EBB_OK && done) return EBB_OK;
  struct offl_probe *p = calloc(1, sizeof *p);
  if (p && (own_event(dev, EBB_EVENT_TIMING, &p->before) || own_event(dev, EBB_EVENT_TIMING, &p->after))) {
    own_event_free(p->before);
    free(p);
    p = NULL;
  }
  if (p && ebb_event_record(p->before, s)) {
    own_event_free(p->before);
    own_event_free(p->after);
    free(p);
    p = NULL;
  }
  ebb_status st = ebb_event_wait(ev, s);
  if (p) {
    ebb_event_record(p->after, s);
    p->forward = forward;
    p->next = M.probes;
    M.probes = p;
  }
  return st;
}

/* Lets go of dev_t. An original copied out is retired: its allocation stream waits for the copy
 * (on the device) and the offload stream's use is dropped, so the block is reusable in that
 * stream's order at once; poisoned first when the policy asks and nothing else holds it. A
 * reload's stream use was dropped when its node waited for it (or its free waits for it). Lock
 * held. */
static void dev_t_drop(struct ebb__offl *o) {
  if (!o->dev_t) return;
  if (o->orig && o->state != OFFL_RESIDENT && o->as && ebb__stream_hold(o->as, o->as_id)) {
    ebb__fail_mute(true);
    if (!stream_wait(o->as, o->out_ev, o->dev, true)) {
      (void)ebb__arena_use_forget(ebb__tensor_block(o->dev_t), M.dev[o->dev].out_id);
      ebb__storage_info si;
      ebb__tensor_storage_info(o->dev_t, &si);
      if (o->sc->pol.poison && ebb__tensor_exclusive(o->dev_t) && !si.used_elsewhere) {
        /* After the copy, in the block's stream order: a reader that does not wait for a reload
         * sees NaN (or -1) where the arena hands the block out next. */
        ebb_stream_guard g;
        if (!ebb_stream_guard_enter(&g, o->as)) {
          offl_busy = true;
          (void)ebb_tensor_fill_(o->dev_t, ebb_dtype_is_float(o->dt) ? (double)NAN : -1.0);
          offl_busy = false;
          ebb_stream_guard_exit(&g);
        }
      }
    }
    ebb__fail_mute(false);
    ebb__stream_unhold(o->as);
  }
  if (o->in_held) {
    ebb_list_remove(&o->hlink);
    o->in_held = false;
    M.dev[o->dev].nheld--;
  }
  ebb_tensor_release(o->dev_t);
  o->dev_t = NULL;
  o->orig = false;
  o->sc->resident[o->dev] -= (int64_t)o->bytes;
  if (o->state != OFFL_RESIDENT) stat_away((int64_t)o->bytes);
}

/* Retires the held originals of device dev beyond the newest `keep` (those a plan reads stay
 * until it is done). Lock held. */
static void retire_held(int dev, size_t keep) {
  struct ebb_list *l = M.dev[dev].held.next;
  while (M.dev[dev].nheld > keep && l != &M.dev[dev].held) {
    struct ebb__offl *o = ebb_container_of(l, struct ebb__offl, hlink);
    l = l->next;
    if (!o->users) dev_t_drop(o);
  }
}

static void record_free(struct ebb__offl *o) {
  struct ebb__offl_scope *sc = o->sc;
  scope_remove(sc, o);
  g_remove(o);
  if (o->in_list) ebb_list_remove(&o->link);
  if (o->dev_t) {
    /* (an original still copying: the copy's recorded use makes its free wait for it) */
    if (o->in_held) {
      ebb_list_remove(&o->hlink);
      M.dev[o->dev].nheld--;
    }
    ebb_tensor_release(o->dev_t);
    sc->resident[o->dev] -= (int64_t)o->bytes;
  } else if (o->state != OFFL_RESIDENT) {
    stat_away(-(int64_t)o->bytes);
  }
  if (o->host) { /* (reused only after the copies that use it: ebb_copy_async recorded them) */
    ebb_pinned_free(o->host);
    sc->pinned -= (int64_t)o->bytes;
    stat_pinned(-(int64_t)o->bytes);
  }
  own_event_free(o->out_ev);
  own_event_free(o->in_ev);
  own_event_free(o->made_ev);
  scope_put_locked(sc);
  free(o);
  atomic_fetch_sub_explicit(&offl_live, 1, memory_order_relaxed);
  ebb__inplace_watch_add(-1);
}

static void put_locked(struct ebb__offl *o) {
  if (--o->refs == 0) record_free(o);
}

void ebb__offl_put(struct ebb__offl *o) {
  ebb__fail_mute(true);
  ebb__mutex_lock(&ebb__offl_mu);
  put_locked(o);
  ebb__mutex_unlock(&ebb__offl_mu);
  ebb__fail_mute(false);
}

/* The copies out of device dev seen done, in issue order. Lock held. */
static void poll_dev(int dev) {
  while (!ebb_list_empty(&M.dev[dev].pending)) {
    struct ebb__offl *o = ebb_container_of(M.dev[dev].pending.next, struct ebb__offl, link);
    bool done = false;
    if (ebb_event_query(o->out_ev, &done) != EBB_OK || !done) return;
    ebb_list_remove(&o->link);
    o->in_list = false;
    o->state = OFFL_HOST;
  }
}

/* Tracing: an offload copy (its waits, the copy, the event after it) as a span on the stream
 * that carries it, enclosing the copy's own span there; its bytes and the saving node as owner. */
static EBB_COLD void trace_copy(const char *what, const ebb_stream_t *s, const struct ebb__offl *o, uint64_t t0) {
  struct CUstream_st *cu = NULL;
  ebb__fail_mute(true);
  bool ok = ebb_stream_cu(s, &cu) == EBB_OK && cu;
  ebb__fail_mute(false);
  if (!ok) return;
  ebb_trace_span r = {.name = what, .start_ns = t0, .end_ns = ebb__now_ns(), .device = o->dev, .stream = (uint64_t)(uintptr_t)cu,
                      .kind = EBB_TRACE_SPAN, .args = EBB_TRACE_ARG_BYTES, .bytes = o->bytes, .owner = ebb_trace_intern(o->owner)};
  (void)ebb_trace_record(&r);
}

/* Copies RESIDENT record o to pinned memory on the device's offload stream; its original is held
 * (retired later, retire_held). *room false (EBB_OK): the pinned budget cannot take it, nothing
 * done. Lock held. */
static ebb_status copy_out(const char *fn, struct ebb__offl *o, bool *room) {
  struct ebb__offl_scope *sc = o->sc;
  *room = !sc->pol.pinned_budget_bytes || sc->pinned + (int64_t)o->bytes <= sc->pol.pinned_budget_bytes;
  if (!*room) {
    M.st.kept_pinned_budget++;
    return EBB_OK;
  }
  ebb_stream_t *out = NULL, *cur = NULL;
  ebb_status st = dev_stream(fn, o->dev, true, &out);
  if (!st) st = ebb_stream_current(o->dev, &cur);
  void *host = NULL;
  if (!st) {
    st = ebb_alloc_owner_push(EBB_OWNER_SAVED, o->owner);
    if (!st) {
      st = ebb_pinned_alloc(o->bytes, o->dev, &host);
      ebb_alloc_owner_pop();
    }
  }
  /* The offload stream starts after the stream that made the tensor: the work issued so far on
   * the current stream at its save (now, or the event recorded then). */
  uint64_t t0 = EBB_TRACE_ON() ? ebb__now_ns() : 0;
  if (!st) st = o->made_ev ? ebb_event_wait(o->made_ev, out) : ebb_stream_wait_stream(out, cur);
  if (!st) st = ebb_copy_async(host, ebb__tensor_block(o->dev_t), o->bytes, out);
  if (!st && !o->out_ev) st = own_event(o->dev, EBB_EVENT_DEFAULT, &o->out_ev);
  if (!st) st = ebb_event_record(o->out_ev, out);
  if (EBB_UNLIKELY(t0 != 0) && !st) trace_copy("offload out", out, o, t0);
  if (st) {
    if (host) ebb_pinned_free(host);
    return ebb__fail(st, "%s: could not copy %s's saved tensor (%zu bytes on device %d) to pinned memory: %s", fn, o->owner,
                     o->bytes, o->dev, ebb_last_error());
  }
  if (o->in_list) ebb_list_remove(&o->link); /* (from the scope's kept list) */
  o->host = host;
  o->state = OFFL_COPYING;
  ebb_list_insert_tail(&M.dev[o->dev].pending, &o->link);
  o->in_list = true;
  ebb_list_insert_tail(&M.dev[o->dev].held, &o->hlink);
  o->in_held = true;
  M.dev[o->dev].nheld++;
  sc->pinned += (int64_t)o->bytes;
  stat_pinned((int64_t)o->bytes);
  M.st.tensors_offloaded++;
  M.st.bytes_offloaded += o->bytes;
  return EBB_OK;
}

/* Brings copied-out record o back to the device: allocated on stream `on` (the stream of the node
 * that will read it; NULL: the current one), written by the reload stream after that stream's
 * work so far and after the copy out. Lock held. */
static ebb_status reload(const char *fn, struct ebb__offl *o, ebb_stream_t *on) {
  ebb_stream_t *in = NULL, *cur = on;
  ebb_status st = dev_stream(fn, o->dev, false, &in);
  if (!st && !cur) st = ebb_stream_current(o->dev, &cur);
  uint64_t cur_id = 0;
  if (!st) st = ebb_stream_id(cur, &cur_id);
  ebb_tensor_t *t = NULL;
  if (!st) st = ebb_alloc_owner_push(EBB_OWNER_SAVED, o->owner);
  if (!st) {
    int64_t n = (int64_t)(o->bytes / ebb_dtype_size(o->dt));
    ebb_stream_guard g;
    st = ebb_stream_guard_enter(&g, cur);
    if (!st) {
      st = ebb_tensor_empty(o->dev, o->dt, 1, &n, &t);
      ebb_stream_guard_exit(&g);
    }
    ebb_alloc_owner_pop();
  }
  /* The block may be one that stream's queued work still uses (reuse in its order). */
  uint64_t t0 = EBB_TRACE_ON() ? ebb__now_ns() : 0;
  if (!st) st = ebb_stream_wait_stream(in, cur);
  if (!st && o->state == OFFL_COPYING) st = ebb_event_wait(o->out_ev, in);
  if (!st) st = ebb_copy_async(ebb__tensor_block(t), o->host, o->bytes, in);
  if (!st && !o->in_ev) st = own_event(o->dev, EBB_EVENT_DEFAULT, &o->in_ev);
  if (!st) st = ebb_event_record(o->in_ev, in);
  if (EBB_UNLIKELY(t0 != 0) && !st) trace_copy("offload reload", in, o, t0);
  if (st) {
    if (t) ebb_tensor_release(t);
    return ebb__fail(st, "%s: could not bring %s's saved tensor (%zu bytes) back to device %d: %s", fn, o->owner, o->bytes, o->dev,
                     ebb_last_error());
  }
  o->dev_t = t;
  o->orig = false;
  o->as = cur;
  o->as_id = cur_id;
  o->in_forgot = false;
  o->sc->resident[o->dev] += (int64_t)o->bytes;
  stat_away(-(int64_t)o->bytes);
  return EBB_OK;
}

bool ebb__offl_watching(void) { return ebb__offl_live() > 0 && !offl_busy; }

ebb_status ebb__offl_inplace(const ebb_tensor_t *dst) {
  ebb__storage_info si;
  ebb__tensor_storage_info(dst, &si);
  uint64_t v = 0;
  ebb_tensor_version(dst, &v);
  ebb_status st = EBB_OK;
  ebb__mutex_lock(&ebb__offl_mu);
  struct ebb__offl *head = G.nbucket ? G.bucket[si.serial & (G.nbucket - 1)] : NULL;
  /* First, before anything changes: a tensor saved inside an allow-mutation scope and not copied
   * yet (a budget kept it) is copied now, after the stream that made it; when it cannot be, the
   * write is refused. */
  for (struct ebb__offl *o = head; o && !st; o = o->gnext) {
    if (o->serial != si.serial || o->version != v || o->modified || !o->allow_mut || o->state != OFFL_RESIDENT) continue;
    bool room;
    st = copy_out(o->owner, o, &room);
    if (!st && !room)
      st = ebb__fail(EBB_ENOMEM, "%s's saved tensor (%zu bytes on device %d, saved inside an allow-mutation scope) must be copied "
                     "to pinned memory before this write changes it, and its offload scope's pinned budget (%lld bytes, %lld "
                     "held) cannot take it; expected a larger pinned_budget_bytes, or the write after the backward", o->owner,
                     o->bytes, o->dev, (long long)o->sc->pol.pinned_budget_bytes, (long long)o->sc->pinned);
  }
  ebb__fail_mute(true);
  for (struct ebb__offl *o = head; o && !st; o = o->gnext) {
    if (o->serial != si.serial || o->version != v || o->modified) continue;
    ebb_stream_t *cur = NULL;
    bool waited = !ebb_stream_current(o->dev, &cur) && (o->state == OFFL_HOST || !ebb_event_wait(o->out_ev, cur));
    if (o->allow_mut && o->state != OFFL_RESIDENT && waited) {
      /* Saved in an allow-mutation scope: the pinned copy is the saved value, the write waits
       * for it on the device, and the original goes (a reload, which the write cannot touch,
       * stays), so the backward reads the value as it was saved. */
      if (o->orig) dev_t_drop(o);
      continue;
    }
    /* The saved value is gone from the device once the write runs: the backward will refuse
     * it, as it refuses any saved tensor changed in place, and the write waits for the copy
     * out still reading the storage (on the device: no host wait). */
    o->modified = true;
    o->modified_version = v; /* (the write moves it on from there) */
  }
  ebb__fail_mute(false);
  ebb__mutex_unlock(&ebb__offl_mu);
  return st;
}

/* ---- saving ----------------------------------------------------------------------------------- */

/* A leaf that requires a gradient (a parameter), or a view of one (its storage stays anyway). */
static bool is_param(const ebb_tensor_t *t) {
  const ebb_tensor_t *b = ebb__tensor_base(t);
  const struct ebb__meta *m = ebb__meta_of(b ? b : t);
  return m && m->requires_grad && !m->grad_fn;
}

/* n's saved tensor k in a message. */
static const char *saved_role(const struct ebb_node *n, int k, char *buf, size_t cap) {
  return ebb__saved_role(n, k, buf, cap);
}

/* Keeps the scope's resident bytes on dev within its device budget: its copied-out originals are
 * let go, oldest first, while the total is over (their streams wait for the copies on the
 * device, never the host: copies started at their saves, long done when the link keeps up);
 * with none left, the oldest kept one is copied out and let go at once (its stream waits for
 * that copy). The newest stay: the backward needs them first. What cannot be copied (the pinned
 * budget is spent) stays, counted. Lock held. */
static ebb_status keep_budget(const char *fn, struct ebb__offl_scope *sc, int dev) {
  while (sc->resident[dev] > sc->pol.device_budget_bytes) {
    struct ebb__offl *w = NULL;
    for (struct ebb_list *l = M.dev[dev].held.next; l != &M.dev[dev].held && !w; l = l->next) {
      struct ebb__offl *o = ebb_container_of(l, struct ebb__offl, hlink);
      if (o->sc == sc && !o->users) w = o;
    }
    struct ebb__offl *o = NULL; /* the oldest kept one no backward reads now */
    for (struct ebb_list *l = sc->kept[dev].next; !w && !o && l != &sc->kept[dev]; l = l->next)
      if (!ebb_container_of(l, struct ebb__offl, link)->users) o = ebb_container_of(l, struct ebb__offl, link);
    if (o) {
      bool room;
      ebb_status st = copy_out(fn, o, &room);
      if (st) return st;
      if (!room) { /* it stays: out of the candidates */
        ebb_list_remove(&o->link);
        o->in_list = false;
        continue;
      }
      w = o;
    }
    if (!w) return EBB_OK;
    dev_t_drop(w);
  }
  return EBB_OK;
}

/* Whether a save of `bytes` on dev under budget scope sc is copied out now: it will have to leave
 * when the forward saves about the most a budgeted forward on the device did (the oldest
 * leave; the newest stay), with EBB__OFFL_HOLD tensors of slack; and always when nothing is
 * known yet. Lock held. */
static bool copy_now(const struct ebb__offl_scope *sc, int dev, int64_t bytes) {
  const int64_t expect = M.dev[dev].expect, budget = sc->pol.device_budget_bytes;
  if (!budget || !expect) return true;
  return sc->saved_bytes[dev] + bytes <= expect - budget + EBB__OFFL_HOLD * bytes;
}

ebb_status ebb__offl_save(struct ebb__offl_scope *sc, const struct ebb_node *n, int k, const ebb_tensor_t *t,
                          struct ebb__offl **out) {
  *out = NULL;
  ebb__storage_info si;
  ebb__tensor_storage_info(t, &si);
  if (si.device == EBB_DEVICE_CPU || (int64_t)si.bytes < sc->pol.min_bytes || (!sc->pol.offload_params && is_param(t))) {
    ebb__mutex_lock(&ebb__offl_mu);
    if (si.device == EBB_DEVICE_CPU) M.st.kept_cpu++;
    else if ((int64_t)si.bytes < sc->pol.min_bytes) M.st.kept_small++;
    else M.st.kept_params++;
    ebb__mutex_unlock(&ebb__offl_mu);
    return EBB_OK;
  }
  char td[EBB__DESC_MAX], role[40];
  int64_t budget = sc->pol.device_budget_bytes;
  if ((int64_t)si.bytes > sc->pol.prefetch_window_bytes || (budget && (int64_t)si.bytes > budget))
    return ebb__fail(EBB_EINVAL, "%s (node %llu) could not save its %s under the offload scope: its storage holds %zu bytes, more "
                     "than the scope's %s (%lld bytes); expected a %s of at least the largest saved tensor",
                     ebb__node_name_of(n), (unsigned long long)n->seq, ebb__tensor_desc(t, saved_role(n, k, role, sizeof role), -1, td, sizeof td),
                     si.bytes, (int64_t)si.bytes > sc->pol.prefetch_window_bytes ? "prefetch window" : "device budget",
                     (long long)((int64_t)si.bytes > sc->pol.prefetch_window_bytes ? sc->pol.prefetch_window_bytes : budget),
                     (int64_t)si.bytes > sc->pol.prefetch_window_bytes ? "prefetch_window_bytes" : "device_budget_bytes");
  uint64_t version = 0;
  ebb_tensor_version(t, &version);
  const char *fn = ebb__node_name_of(n);
  ebb__mutex_lock(&ebb__offl_mu);
  ebb_status st = devs_ready(fn); /* (gone after the last ebb_shutdown when nothing held it) */
  if (!st && (si.device >= M.ndev || si.device >= sc->ndev)) /* (a scope opened before a re-init with more devices) */
    st = ebb__fail(EBB_ESTATE, "%s (node %llu) could not save its %s: the offload scope was opened when device %d did not "
                   "exist (before the last ebb_shutdown); expected a scope opened after ebb_init", fn,
                   (unsigned long long)n->seq, ebb__tensor_desc(t, saved_role(n, k, role, sizeof role), -1, td, sizeof td),
                   si.device);
  if (st) {
    ebb__mutex_unlock(&ebb__offl_mu);
    return st;
  }
  poll_dev(si.device);
  const bool allow_mut = ebb__mutation_scope_here(); /* (a save inside an allow-mutation scope survives writes) */
  struct ebb__offl *o = scope_find(sc, si.serial, version, allow_mut);
  if (o) {
    o->refs++;
    M.st.deduplicated++;
    ebb__mutex_unlock(&ebb__offl_mu);
    *out = o;
    return EBB_OK;
  }
  if (sc->pol.pinned_budget_bytes && sc->pinned + (int64_t)si.bytes > sc->pol.pinned_budget_bytes) {
    M.st.kept_pinned_budget++; /* it stays, as an ordinary saved tensor */
    ebb__mutex_unlock(&ebb__offl_mu);
    return EBB_OK;
  }
  ebb_dtype dt = EBB_F32;
  ebb_tensor_dtype(t, &dt);
  o = calloc(1, sizeof *o);
  int64_t whole = (int64_t)(si.bytes / ebb_dtype_size(dt)), one = 1;
  if (o) o->serial = si.serial;
  if (!o || !g_insert(o) || ebb__tensor_share_as(t, 1, &whole, &one, 0, &o->dev_t)) {
    if (o && G.nbucket) g_remove(o); /* (a no-op when it was not inserted) */
    free(o);
    ebb__mutex_unlock(&ebb__offl_mu);
    return ebb__fail(EBB_ENOMEM, "%s (node %llu) could not save its %s: no host memory", fn, (unsigned long long)n->seq,
                     ebb__tensor_desc(t, saved_role(n, k, role, sizeof role), -1, td, sizeof td));
  }
  o->refs = 1;
  o->sc = sc;
  sc->refs++;
  o->dev = si.device;
  o->orig = true;
  o->as = si.stream;
  o->as_id = si.stream_id;
  o->dt = dt;
  o->bytes = si.bytes;
  o->serial = si.serial;
  o->version = version;
  snprintf(o->owner, sizeof o->owner, "%s", fn);
  o->state = OFFL_RESIDENT;
  o->allow_mut = allow_mut;
  atomic_fetch_add_explicit(&offl_live, 1, memory_order_relaxed);
  ebb__inplace_watch_add(1);
  scope_insert(sc, o);
  sc->resident[o->dev] += (int64_t)o->bytes;
  /* Copied out at once (the copy engine works from the first save), unless a device budget will
   * keep it: the originals go after EBB__OFFL_HOLD more saves, or when the budget needs their
   * room. */
  bool now = copy_now(sc, o->dev, (int64_t)o->bytes), room;
  sc->saved_bytes[o->dev] += (int64_t)o->bytes;
  if (now) {
    st = copy_out(fn, o, &room);
  } else {
    ebb_stream_t *cur = NULL;
    st = ebb_stream_current(o->dev, &cur);
    if (!st) st = own_event(o->dev, EBB_EVENT_DEFAULT, &o->made_ev);
    if (!st) st = ebb_event_record(o->made_ev, cur);
    if (!st) {
      ebb_list_insert_tail(&sc->kept[o->dev], &o->link);
      o->in_list = true;
    }
  }
  if (!st && !budget) retire_held(o->dev, EBB__OFFL_HOLD);
  if (!st && budget) st = keep_budget(fn, sc, o->dev);
  if (st) {
    char why[EBB__ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", ebb_last_error());
    put_locked(o);
    ebb__mutex_unlock(&ebb__offl_mu);
    return ebb__fail(st, "%s (node %llu) could not save its %s under the offload scope: %s", fn, (unsigned long long)n->seq,
                     ebb__tensor_desc(t, saved_role(n, k, role, sizeof role), -1, td, sizeof td), why);
  }
  ebb__mutex_unlock(&ebb__offl_mu);
  *out = o;
  return EBB_OK;
}

/* ---- unpacking -------------------------------------------------------------------------------- */

ebb_status ebb__offl_unpack(const char *fn, const struct ebb_node *n, int k, struct ebb__offl *o, const char *name,
                            ebb_tensor_t **whole) {
  char role[40];
  ebb__mutex_lock(&ebb__offl_mu);
  poll_dev(o->dev);
  probes_resolve();
  uint64_t v = o->version;
  if (!o->modified && o->orig) ebb_tensor_version(o->dev_t, &v);
  if (o->modified || v != o->version) {
    bool seen = o->modified; /* (a write seen by the in-place hook: the version it moved on from) */
    uint64_t now = seen ? o->modified_version + 1 : v;
    ebb__mutex_unlock(&ebb__offl_mu);
    return ebb__fail(EBB_ESTATE, "%s: %s (node %llu) needs its %s%s%s%s (offloaded, %zu bytes on device %d), which was modified in "
                     "place after it was saved: saved at version %llu, now %s%llu; expected it unchanged until backward (clone "
                     "it before changing it)", fn, ebb__node_name_of(n), (unsigned long long)n->seq,
                     saved_role(n, k, role, sizeof role), name[0] ? " '" : "", name, name[0] ? "'" : "", o->bytes, o->dev,
                     (unsigned long long)o->version, seen ? "at least " : "", (unsigned long long)now);
  }
  ebb_status st = EBB_OK;
  bool fetched = false;
  if (!o->dev_t) { /* no plan brought it back: now, for this node */
    st = reload(fn, o, NULL);
    if (!st) M.st.bytes_reloaded_on_demand += o->bytes;
    fetched = !st;
  }
  ebb_tensor_t *w = NULL;
  if (!st && !o->orig) {
    /* The node's stream waits for the reload on the device; when it is the stream the reload
     * was allocated on, that order covers the reload stream's use of the block too. */
    ebb_stream_t *cur = NULL;
    uint64_t cur_id = 0;
    st = ebb_stream_current(o->dev, &cur);
    if (!st) st = stream_wait(cur, o->in_ev, o->dev, false);
    if (!st && !o->in_forgot && !ebb_stream_id(cur, &cur_id) && cur_id == o->as_id)
      o->in_forgot = ebb__arena_use_forget(ebb__tensor_block(o->dev_t), M.dev[o->dev].in_id);
  }
  if (!st) st = ebb__tensor_share(o->dev_t, &w);
  if (fetched && !o->users) dev_t_drop(o); /* (w holds the reload until the node is done with it) */
  ebb__mutex_unlock(&ebb__offl_mu);
  if (st) return ebb__fail(st, "%s: %s (node %llu) could not read its offloaded %s: %s", fn, ebb__node_name_of(n),
                           (unsigned long long)n->seq, saved_role(n, k, role, sizeof role), ebb_last_error());
  *whole = w;
  return EBB_OK;
}

/* ---- the backward's plan ---------------------------------------------------------------------- */

struct pent {
  int ti;        /* task node */
  ebb_stream_t *s; /* the stream it runs on (held by the backward), or NULL: the caller's current */
  uint64_t seq;
  struct ebb__offl *o;
  int first;     /* index of the record's first entry on this device (itself when first) */
  bool last;     /* its last entry */
  bool issued;   /* first entries: the plan holds o->dev_t (users) */
  bool released; /* first entries: ... and let it go */
  bool put;      /* the plan's reference on o (one per entry) was dropped: its node ran */
  int64_t ahead; /* first entries issued ahead: the reload bytes counted in the window */
};

struct ebb__offl_plan {
  struct pdev {
    struct pent *e;
    size_t n, cap, next;
    int64_t ahead;      /* bytes reloaded ahead of the nodes that will read them */
  } *d;
  int ndev;
  struct pnode {
    int dev, at;        /* the node's entries start at d[dev].e[at] (-1: none) */
    bool started;
  } *node;
  size_t nnodes;
};

ebb_status ebb__offl_plan_add(struct ebb__offl_plan **pp, size_t nnodes, int ti, uint64_t seq, ebb_stream_t *s,
                              struct ebb__offl *o) {
  struct ebb__offl_plan *p = *pp;
  if (!p) {
    p = calloc(1, sizeof *p);
    ebb__mutex_lock(&ebb__offl_mu);
    int ndev = M.ndev; /* (set: a record exists) */
    ebb__mutex_unlock(&ebb__offl_mu);
    if (p) {
      p->d = calloc((size_t)(ndev > 0 ? ndev : 1), sizeof *p->d);
      p->node = malloc(nnodes * sizeof *p->node);
    }
    if (!p || !p->d || !p->node) {
      if (p) {
        free(p->d);
        free(p->node);
      }
      free(p);
      return ebb__fail(EBB_ENOMEM, "no host memory for the backward's offload plan");
    }
    p->ndev = ndev;
    p->nnodes = nnodes;
    for (size_t i = 0; i < nnodes; i++) p->node[i] = (struct pnode){-1, -1, false};
    *pp = p;
  }
  struct pdev *d = &p->d[o->dev];
  if (d->n == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : 16;
    struct pent *e = realloc(d->e, cap * sizeof *e);
    if (!e) return ebb__fail(EBB_ENOMEM, "no host memory for the backward's offload plan");
    d->e = e;
    d->cap = cap;
  }
  ebb__mutex_lock(&ebb__offl_mu);
  o->refs++;
  ebb__mutex_unlock(&ebb__offl_mu);
  d->e[d->n++] = (struct pent){.ti = ti, .s = s, .seq = seq, .o = o, .first = -1};
  return EBB_OK;
}

static int pent_cmp(const void *a, const void *b) {
  const struct pent *x = a, *y = b;
  if (x->seq != y->seq) return x->seq > y->seq ? -1 : 1; /* larger sequence numbers run first */
  return x->ti < y->ti ? -1 : x->ti > y->ti;
}

/* Entry e's record on the device, held for the plan: reloaded unless it is there. Lock held. */
static ebb_status issue(const char *fn, struct pdev *d, struct pent *e, bool ahead) {
  struct ebb__offl *o = e->o;
  int64_t bytes = 0;
  if (!o->dev_t) {
    ebb_status st = reload(fn, o, e->s);
    if (st) return st;
    bytes = (int64_t)o->bytes;
    if (ahead) M.st.bytes_prefetched += o->bytes;
    else M.st.bytes_reloaded_on_demand += o->bytes;
  }
  o->users++;
  e->issued = true;
  e->ahead = ahead ? bytes : 0;
  d->ahead += e->ahead;
  return EBB_OK;
}

/* Reloads ahead on device d while the window (and the device budget) allows. Failures are left
 * to the node that needs the tensor (which reloads it itself). Lock held. */
static void prefetch(const char *fn, struct pdev *d, int dev) {
  ebb__fail_mute(true);
  while (d->next < d->n) {
    struct pent *e = &d->e[d->next];
    if (e->first != (int)d->next || e->issued || e->put) {
      d->next++;
      continue;
    }
    struct ebb__offl *o = e->o;
    int64_t need = o->dev_t ? 0 : (int64_t)o->bytes;
    int64_t budget = o->sc->pol.device_budget_bytes;
    if (need && d->ahead + need > o->sc->pol.prefetch_window_bytes) break;
    if (need && budget && o->sc->resident[dev] + need > budget) break;
    if (issue(fn, d, e, true)) break;
    d->next++;
  }
  ebb__fail_mute(false);
}

ebb_status ebb__offl_plan_start(const char *fn, struct ebb__offl_plan *p) {
  ebb__mutex_lock(&ebb__offl_mu);
  for (int dev = 0; dev < p->ndev; dev++) {
    struct pdev *d = &p->d[dev];
    if (!d->n) continue;
    poll_dev(dev);
    qsort(d->e, d->n, sizeof *d->e, pent_cmp);
    /* first and last entries of each record: a small open-addressed table of records */
    size_t cap = 16;
    while (cap < d->n * 2) cap *= 2;
    int *slot = malloc(cap * sizeof *slot);
    if (!slot) {
      ebb__mutex_unlock(&ebb__offl_mu);
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for the backward's offload plan", fn);
    }
    memset(slot, -1, cap * sizeof *slot);
    for (size_t i = 0; i < d->n; i++) {
      size_t h = ((uintptr_t)d->e[i].o >> 6) * 0x9e3779b97f4a7c15ull & (cap - 1);
      while (slot[h] >= 0 && d->e[slot[h]].o != d->e[i].o) h = (h + 1) & (cap - 1);
      if (slot[h] < 0) {
        d->e[i].first = (int)i;
      } else {
        int f = d->e[slot[h]].first;
        d->e[i].first = f;
        d->e[slot[h]].last = false;
      }
      d->e[i].last = true;
      slot[h] = (int)i;
    }
    free(slot);
    for (size_t i = 0; i < d->n; i++)
      if (p->node[d->e[i].ti].at < 0) p->node[d->e[i].ti] = (struct pnode){dev, (int)i, false};
    prefetch(fn, d, dev);
  }
  ebb__mutex_unlock(&ebb__offl_mu);
  return EBB_OK;
}

/* The plan lets go of the record of first entry e (of device d). Lock held. */
static void plan_release(struct pdev *d, struct pent *e) {
  d->ahead -= e->ahead; /* (a node that never ran its backward leaves its reload counted otherwise) */
  e->ahead = 0;
  if (!e->issued || e->released) return;
  e->released = true;
  struct ebb__offl *o = e->o;
  if (--o->users == 0 && o->state != OFFL_RESIDENT) dev_t_drop(o);
}

ebb_status ebb__offl_plan_enter(const char *fn, struct ebb__offl_plan *p, int ti) {
  struct pnode *pn = &p->node[ti];
  if (pn->at < 0) return EBB_OK;
  ebb_status st = EBB_OK;
  ebb__mutex_lock(&ebb__offl_mu);
  pn->started = true;
  struct pdev *d = &p->d[pn->dev];
  poll_dev(pn->dev);
  for (size_t j = (size_t)pn->at; !st && j < d->n && d->e[j].ti == ti; j++) {
    struct pent *f = &d->e[d->e[j].first];
    if (f->issued) {
      d->ahead -= f->ahead; /* (in use now, no longer ahead) */
      f->ahead = 0;
    } else if (!f->released) {
      st = issue(fn, d, f, false);
    }
  }
  if (!st) prefetch(fn, d, pn->dev);
  ebb__mutex_unlock(&ebb__offl_mu);
  return st;
}

void ebb__offl_plan_leave(const char *fn, struct ebb__offl_plan *p, int ti) {
  struct pnode *pn = &p->node[ti];
  if (pn->at < 0) return;
  ebb__mutex_lock(&ebb__offl_mu);
  struct pdev *d = &p->d[pn->dev];
  for (size_t j = (size_t)pn->at; j < d->n && d->e[j].ti == ti; j++)
    if (d->e[j].last) plan_release(d, &d->e[d->e[j].first]);
  /* The node's references go now, not at the backward's end: a record its node released for
   * good (no retain_graph) frees its memory, which makes room for the next reloads. */
  for (size_t j = (size_t)pn->at; j < d->n && d->e[j].ti == ti; j++) {
    d->e[j].put = true;
    put_locked(d->e[j].o);
  }
  prefetch(fn, d, pn->dev);
  ebb__mutex_unlock(&ebb__offl_mu);
}

void ebb__offl_plan_end(struct ebb__offl_plan *p) {
  if (!p) return;
  ebb__fail_mute(true);
  ebb__mutex_lock(&ebb__offl_mu);
  for (int dev = 0; dev < p->ndev; dev++) {
    struct pdev *d = &p->d[dev];
    for (size_t i = 0; i < d->n; i++) {
      if (d->e[i].first == (int)i) plan_release(d, &d->e[i]);
    }
    for (size_t i = 0; i < d->n; i++)
      if (!d->e[i].put) put_locked(d->e[i].o);
    free(d->e);
  }
  ebb__mutex_unlock(&ebb__offl_mu);
  ebb__fail_mute(false);
  free(p->d);
  free(p->node);
  free(p);
}
