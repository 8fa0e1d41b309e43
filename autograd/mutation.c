/* mutation.c: allow-mutation scopes (ebb_allow_mutation_on_saved_enter): a tensor a node saved
 * inside one may be changed in place afterwards; the write clones the saved storage first and
 * the node reads the clone.
 *
 * Each ordinary saved slot (n->saved[k].t, not packed by hooks) saved while a scope is open on
 * the saving thread gets a record (struct ebb__mut), owned by the slot (n->saved[k].mut) and
 * linked into its scope's list and into a process-wide index by storage block. ops calls the
 * inplace hook for every in-place op while any scope is open (ebb__inplace_watch_add); the hook
 * (ebb__mutation_write) looks dst's block up, and when records there still hold the storage at
 * the version they saved, copies the whole storage once and gives each of those slots a handle
 * with its own geometry on the copy (so views of one storage share one clone), before the write.
 * A cloned record leaves the index. Exiting a scope drops what its slots hold (the original or
 * the clone) and marks the records closed: the engine's unpack then fails with a message naming
 * the node and the tensor. A record goes with its node's saved tensors (ebb__mutation_release).
 *
 * Threading: scopes are per thread; the index, the scopes' lists and every record are under
 * mut_mu (rank EBB_RANK_AG_MUTATION: it is taken inside in-place ops that run under a leaf's
 * .grad lock, and held across the clone, the owner re-tags and the releases it makes). A slot's
 * tensor is replaced or dropped under the engine's saved lock of its node too (ebb__saved_lock),
 * which the engine reads it under, and never once a backward has claimed the node's saved
 * tensors (freed_saved): that backward releases them, and its release of the records waits for
 * mut_mu, so a record in a list always has a live node.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb/stream.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "streams_export.h"
#include "autograd_impl.h"

struct mut_scope;

/* One slot saved inside a scope. */
struct ebb__mut {
  struct ebb_node *n; /* the slot is n->saved[k]; n lives while the record is in a list */
  int k;
  void *block;                      /* the storage's block (while indexed) */
  bool indexed;                     /* in the index: not cloned yet, its scope open */
  bool closed;                      /* its scope exited: written and read under n's saved lock */
  struct mut_scope *scope;          /* NULL once the scope exited */
  struct ebb__mut *hnext, **hpprev; /* the index's chain of its bucket */
  struct ebb__mut *snext, **spprev; /* its scope's list */
  ebb__tensor_meta meta;            /* the saved tensor, for the message after its data went */
  char name[EBB_TENSOR_NAME_MAX + 1];
};

struct mut_scope {
  struct ebb__mut *head;
};

static ebb_mutex mut_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.mutation", EBB_RANK_AG_MUTATION};
/* Scopes open in the process: the write path's first check (relaxed, as ops' count). */
static _Atomic long mut_open;
/* Indexed records by block: chained buckets, a power-of-two count; allocated while scopes are
 * open (freed when the last one exits). Under mut_mu. */
static struct {
  struct ebb__mut **b;
  size_t cap, count;
} mut_index;
static _Thread_local struct mut_scope *mut_tls;

/* ---- the index ---------------------------------------------------------------------------------- */

static size_t block_hash(const void *p) { return (size_t)(((uintptr_t)p >> 8) * 0x9e3779b97f4a7c15ull); }

static void chain_link(struct ebb__mut **head, struct ebb__mut *e) {
  e->hnext = *head;
  if (e->hnext) e->hnext->hpprev = &e->hnext;
  e->hpprev = head;
  *head = e;
}

/* Doubles the buckets at a load of 1; without memory the chains just grow longer. */
static void index_grow(void) {
  if (mut_index.count < mut_index.cap) return;
  size_t nc = mut_index.cap * 2;
  struct ebb__mut **nb = calloc(nc, sizeof *nb);
  if (!nb) return;
  for (size_t i = 0; i < mut_index.cap; i++)
    while (mut_index.b[i]) {
      struct ebb__mut *e = mut_index.b[i];
      mut_index.b[i] = e->hnext;
      chain_link(&nb[block_hash(e->block) & (nc - 1)], e);
    }
  free(mut_index.b);
  mut_index.b = nb;
  mut_index.cap = nc;
}

static void index_add(struct ebb__mut *e) {
  index_grow();
  chain_link(&mut_index.b[block_hash(e->block) & (mut_index.cap - 1)], e);
  e->indexed = true;
  mut_index.count++;
}

static void index_del(struct ebb__mut *e) {
  *e->hpprev = e->hnext;
  if (e->hnext) e->hnext->hpprev = e->hpprev;
  e->indexed = false;
  mut_index.count--;
}

static void scope_del(struct ebb__mut *e) {
  *e->spprev = e->snext;
  if (e->snext) e->snext->spprev = e->spprev;
  e->scope = NULL;
}

/* ---- scopes ---------------------------------------------------------------------------------------- */

bool ebb__mutation_scope_here(void) { return mut_tls != NULL; }

ebb_status ebb_allow_mutation_on_saved_enter(void) {
  static const char fn[] = "ebb_allow_mutation_on_saved_enter";
  if (mut_tls)
    return ebb__fail(EBB_ESTATE, "%s: an allow-mutation scope is already open on this thread, and nesting is an error; expected "
                     "ebb_allow_mutation_on_saved_exit before entering again", fn);
  struct mut_scope *sc = calloc(1, sizeof *sc);
  if (!sc) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the scope", fn);
  ebb__mutex_lock(&mut_mu);
  if (!mut_index.b && (mut_index.b = calloc(64, sizeof *mut_index.b))) mut_index.cap = 64;
  bool ok = mut_index.b != NULL;
  if (ok) atomic_fetch_add_explicit(&mut_open, 1, memory_order_relaxed); /* (under the lock: the last exit frees the index) */
  ebb__mutex_unlock(&mut_mu);
  if (!ok) {
    free(sc);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the scope's index", fn);
  }
  ebb__inplace_watch_add(1); /* (ops: every in-place op calls the hook from now on) */
  mut_tls = sc;
  return EBB_OK;
}

/* Drops what record e's slot holds (mut_mu held): the scope that kept it exited. A slot a
 * backward has claimed is left to that backward. */
static void close_slot(struct ebb__mut *e) {
  struct ebb_node *n = e->n;
  struct ebb__saved *s = &n->saved[e->k];
  ebb_tensor_t *t = NULL;
  ebb__mutex_lock(ebb__saved_lock(n));
  if (!atomic_load_explicit(&n->freed_saved, memory_order_acquire)) {
    e->closed = true;
    t = s->t;
    s->t = NULL;
  }
  ebb__mutex_unlock(ebb__saved_lock(n));
  if (!t) return;
  ebb__owners_saved_forget(n, e->k, t); /* (owners.c: its block's owner back) */
  ebb_tensor_release(t);
}

ebb_status ebb_allow_mutation_on_saved_exit(void) {
  struct mut_scope *sc = mut_tls;
  if (!sc)
    return ebb__fail(EBB_ESTATE, "ebb_allow_mutation_on_saved_exit: no allow-mutation scope is open on this thread; expected one "
                     "exit per ebb_allow_mutation_on_saved_enter, on the thread that entered");
  mut_tls = NULL;
  ebb__mutex_lock(&mut_mu);
  while (sc->head) {
    struct ebb__mut *e = sc->head;
    scope_del(e);
    if (e->indexed) index_del(e);
    close_slot(e);
  }
  if (atomic_fetch_sub_explicit(&mut_open, 1, memory_order_relaxed) == 1 && mut_index.count == 0) {
    free(mut_index.b); /* (the last scope: the index goes with it) */
    mut_index.b = NULL;
    mut_index.cap = 0;
  }
  ebb__mutex_unlock(&mut_mu);
  ebb__inplace_watch_add(-1);
  free(sc);
  return EBB_OK;
}

/* ---- saving and releasing --------------------------------------------------------------------------- */

/* n's saved tensor k in a message, from the record: "saved input 0 'x' (f64[3] on the CPU)". */
static const char *record_desc(const struct ebb_node *n, const struct ebb__mut *e, char *buf, size_t cap) {
  char role[40];
  ebb__saved_role(n, e->k, role, sizeof role);
  return ebb__meta_desc(&e->meta, role, -1, e->name[0] ? e->name : NULL, buf, cap);
}

ebb_status ebb__mutation_saved(struct ebb_node *n, int k) {
  struct mut_scope *sc = mut_tls;
  if (EBB_LIKELY(!sc)) return EBB_OK;
  struct ebb__saved *s = &n->saved[k];
  void *block = ebb__tensor_block(s->t);
  if (!block) return EBB_OK; /* (no bytes: nothing a write could change) */
  struct ebb__mut *e = calloc(1, sizeof *e);
  if (!e)
  {
    char role[40];
    return ebb__fail(EBB_ENOMEM, "%s (node %llu) could not save its %s: no host memory for its record in the allow-mutation "
                     "scope", ebb__node_name_of(n), (unsigned long long)n->seq, ebb__saved_role(n, k, role, sizeof role));
  }
  e->n = n;
  e->k = k;
  e->block = block;
  ebb__tensor_meta_of(s->t, &e->meta);
  ebb_tensor_name(s->t, e->name, sizeof e->name);
  s->mut = e;
  /* The slot is whole (t, version) before the record is published: a write on another thread
   * finds it through the index, under mut_mu. */
  ebb__mutex_lock(&mut_mu);
  e->scope = sc;
  e->snext = sc->head;
  if (e->snext) e->snext->spprev = &e->snext;
  e->spprev = &sc->head;
  sc->head = e;
  index_add(e);
  ebb__mutex_unlock(&mut_mu);
  return EBB_OK;
}

void ebb__mutation_release(struct ebb_node *n) {
  ebb__mutex_lock(&mut_mu);
  for (int k = 0; k < n->nsaved; k++) {
    struct ebb__mut *e = n->saved[k].mut;
    if (!e) continue;
    n->saved[k].mut = NULL;
    if (e->indexed) index_del(e);
    if (e->scope) scope_del(e);
    free(e);
  }
  ebb__mutex_unlock(&mut_mu);
}

ebb_status ebb__mutation_unpack(const char *fn, const struct ebb_node *n, int k) {
  const struct ebb__mut *e = n->saved[k].mut;
  if (EBB_LIKELY(!e->closed)) return EBB_OK;
  char d[EBB__DESC_MAX];
  return ebb__fail(EBB_ESTATE, "%s: %s (node %llu) needs its %s, which was saved inside an allow-mutation scope that has exited "
                   "since and freed what it kept of it; expected the backward to run inside the allow-mutation scope its graph "
                   "was recorded in (before that scope's ebb_allow_mutation_on_saved_exit)", fn, ebb__node_name_of(n),
                   (unsigned long long)n->seq, record_desc(n, e, d, sizeof d));
}

/* ---- writing ---------------------------------------------------------------------------------------- */

/* A slot to move onto the clone: its record, the handle it holds now, the one it gets. */
struct mut_move {
  struct ebb__mut *e;
  ebb_tensor_t *old, *v;
};

/* The nodes that will read the clone run their backward on their forward streams, while the copy
 * was queued on this thread's current stream of the device (cur, id cid): each other stream of
 * that device waits for it, and the arena learns of its use there. A stream that is gone, or on
 * another device: the host waits for the copy instead. Failures fail no write (muted). */
static void order_clone(int dev, const struct mut_move *mv, int nmv) {
  ebb_stream_t *cur = NULL;
  uint64_t cid = 0;
  ebb__fail_mute(true);
  if (ebb_stream_current(dev, &cur) || ebb_stream_id(cur, &cid)) cur = NULL;
  bool sync = false;
  for (int i = 0; cur && i < nmv; i++) {
    if (!mv[i].v) continue;
    ebb_stream_t *ns = NULL;
    uint64_t nid = 0, live = 0;
    int nd = -1;
    ebb__node_stream(mv[i].e->n, &ns, &nid);
    if (!nid || nid == cid) continue;
    if (!ebb__stream_peek(ns, &live, &nd) || live != nid || nd != dev || ebb_stream_wait_stream(ns, cur) ||
        ebb_tensor_record_stream(mv[i].v, ns))
      sync = true;
  }
  if (cur && sync) ebb_stream_synchronize(cur);
  ebb__fail_mute(false);
}

/* The records on block b whose slots still hold the storage as saved (version ver), with their
 * handles, into mv (grown; *nmv of *cap); the others (their slot claimed by a backward, or
 * changed without a hook since: the version check reports it) leave the index. mut_mu held. */
static bool collect(void *b, uint64_t ver, struct mut_move **mv, int *nmv, int *cap) {
  struct ebb__mut *e = mut_index.b[block_hash(b) & (mut_index.cap - 1)];
  while (e) {
    struct ebb__mut *next = e->hnext;
    if (e->block == b) {
      struct ebb_node *n = e->n;
      const struct ebb__saved *s = &n->saved[e->k];
      ebb__mutex_lock(ebb__saved_lock(n));
      bool live = !atomic_load_explicit(&n->freed_saved, memory_order_acquire) && s->t && s->version == ver;
      ebb_tensor_t *old = s->t;
      ebb__mutex_unlock(ebb__saved_lock(n));
      if (!live) {
        index_del(e);
      } else {
        if (*nmv == *cap) {
          int nc = *cap ? *cap * 2 : 8;
          struct mut_move *bigger = realloc(*mv, (size_t)nc * sizeof *bigger);
          if (!bigger) return false;
          *mv = bigger;
          *cap = nc;
        }
        (*mv)[(*nmv)++] = (struct mut_move){e, old, NULL};
      }
    }
    e = next;
  }
  return true;
}

ebb_status ebb__mutation_write(const ebb_tensor_t *dst) {
  if (EBB_LIKELY(!atomic_load_explicit(&mut_open, memory_order_relaxed))) return EBB_OK;
  void *b = ebb__tensor_block(dst);
  if (!b) return EBB_OK;
  uint64_t ver = 0;
  ebb_tensor_version(dst, &ver);
  struct mut_move *mv = NULL;
  int nmv = 0, cap = 0;
  ebb_status st = EBB_OK;
  ebb__mutex_lock(&mut_mu);
  if (!mut_index.b) { /* (the last scope exited meanwhile) */
    ebb__mutex_unlock(&mut_mu);
    return EBB_OK;
  }
  if (!collect(b, ver, &mv, &nmv, &cap)) st = ebb__fail(EBB_ENOMEM, "no host memory to keep the tensors saved on dst's storage");
  if (!st && nmv == 0) {
    ebb__mutex_unlock(&mut_mu);
    free(mv);
    return EBB_OK;
  }
  char d[EBB__DESC_MAX];
  ebb_tensor_t *clone = NULL;
  if (!st && (st = ebb__tensor_storage_clone("ebb__mutation_write", dst, &clone))) {
    const struct ebb__mut *e = mv[0].e;
    st = ebb__fail(st, "the allow-mutation scope could not keep the value %s (node %llu) saved as its %s before the write: %s",
                   ebb__node_name_of(e->n), (unsigned long long)e->n->seq, record_desc(e->n, e, d, sizeof d), ebb_last_error());
  }
  for (int i = 0; !st && i < nmv; i++) {
    /* (the slot's geometry on the clone: same dtype, and the clone's storage has the original's size) */
    ebb__tensor_meta m;
    ebb__storage_info si;
    ebb__tensor_meta_of(mv[i].old, &m);
    ebb__tensor_storage_info(mv[i].old, &si);
    if ((st = ebb__tensor_share_as(clone, m.ndim, m.shape, si.strides, si.offset, &mv[i].v))) {
      st = ebb__fail(st, "no host memory for a handle on the clone of a saved tensor");
      break;
    }
    char name[EBB_TENSOR_NAME_MAX + 1];
    if (!ebb_tensor_name(mv[i].old, name, sizeof name) && name[0]) ebb_tensor_set_name(mv[i].v, name);
  }
  if (!st) {
    int dev = EBB_DEVICE_CPU;
    ebb_tensor_device(dst, &dev);
    if (dev != EBB_DEVICE_CPU) order_clone(dev, mv, nmv);
    for (int i = 0; i < nmv; i++) {
      struct ebb__mut *e = mv[i].e;
      struct ebb_node *n = e->n;
      struct ebb__saved *s = &n->saved[e->k];
      ebb__mutex_lock(ebb__saved_lock(n));
      bool swap = !atomic_load_explicit(&n->freed_saved, memory_order_acquire); /* (else its backward releases it) */
      if (swap) {
        s->t = mv[i].v;
        ebb_tensor_version(mv[i].v, &s->version);
      }
      ebb__mutex_unlock(ebb__saved_lock(n));
      index_del(e);
      if (!swap) continue;
      ebb__owners_saved_forget(n, e->k, mv[i].old); /* (owners.c: the original's block back, the clone's the node's) */
      ebb__owners_saved(n, e->k, mv[i].v);
      ebb_tensor_release(mv[i].old);
      mv[i].v = NULL; /* (the slot's now) */
    }
  }
  for (int i = 0; i < nmv; i++)
    if (mv[i].v) ebb_tensor_release(mv[i].v);
  if (clone) ebb_tensor_release(clone);
  ebb__mutex_unlock(&mut_mu);
  free(mv);
  return st;
}
