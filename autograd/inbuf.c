/* inbuf.c: input buffers and streams: where a gradient is summed and on which stream, the events
 * between streams (PyTorch's InputBuffer rules), the waits before a node runs and at the end of a
 * backward, .grad's accumulation ordered after its last writing stream, and the AccumulateGrad
 * stream mismatch (the warning, its once-set, the follow-producer policy).
 *
 * Threading: everything here runs on the thread that runs or delivers to a task node; a shared
 * task's deliveries (ebb__buf_add) hold its lock, a node's own waits do not need it (no other
 * thread touches a ready node's buffers). The settings are process-wide atomics; the warn-once set
 * has its own leaf lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb_internal.h"
#include "engine_impl.h"
#include "streams_export.h"

static _Atomic bool ebb__warn_acc = true;
static _Atomic bool ebb__follow = false;

void ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(bool enabled) {
  atomic_store_explicit(&ebb__warn_acc, enabled, memory_order_relaxed);
}
bool ebb_autograd_warn_on_accumulate_grad_stream_mismatch(void) { return atomic_load_explicit(&ebb__warn_acc, memory_order_relaxed); }
void ebb_autograd_set_accumulate_grad_follows_producer(bool enabled) { atomic_store_explicit(&ebb__follow, enabled, memory_order_relaxed); }
bool ebb_autograd_accumulate_grad_follows_producer(void) { return atomic_load_explicit(&ebb__follow, memory_order_relaxed); }


/* ---- sums and events -------------------------------------------------------------------------- */

/* Adds g (a new reference, consumed) into *slot: in place when nothing else sees one of the two
 * and they have one shape and dtype (into the slot's tensor, or into g, which then becomes the
 * slot's), else a new sum. On the current stream of their device. slot_shared, g_shared: that
 * tensor was handed to consumers on other streams too, which may not have read it yet: never
 * written in place. */
static ebb_status sum_into(ebb_tensor_t **slot, ebb_tensor_t *g, bool slot_shared, bool g_shared) {
  ebb__tensor_meta bm;
  ebb__tensor_meta_of(*slot, &bm);
  if (ebb__tensor_matches(g, &bm)) {
    if (!slot_shared && ebb__tensor_exclusive(*slot)) {
      ebb_status st = ebb__lean_add_(*slot, g);
      ebb_tensor_release(g);
      return st;
    }
    if (!g_shared && ebb__tensor_exclusive(g)) {
      ebb_status st = ebb__lean_add_(g, *slot);
      ebb_tensor_release(st ? g : *slot);
      if (!st) *slot = g;
      return st;
    }
  }
  ebb_tensor_t *sum = NULL;
  ebb_status st = ebb_op_add(*slot, g, &sum);
  ebb_tensor_release(g);
  if (st) return st;
  ebb_tensor_release(*slot);
  *slot = sum;
  return EBB_OK;
}

/* Pooled events of the engine's own: not counted as the caller's (ebb_shutdown's live check). */
static ebb_event_t *ev_new(int dev) {
  ebb_event_t *e = NULL;
  if (ebb_event_create(dev, EBB_EVENT_DEFAULT, &e)) return NULL;
  ebb__events_live_add(-1);
  return e;
}

void ebb__ev_free(ebb_event_t *e) {
  if (!e) return;
  ebb__events_live_add(1);
  ebb_event_release(e);
}

/* Records *e (made, or remade for another device, as needed) on stream r. */
static ebb_status inbuf_record(struct ebb__task *t, ebb_event_t **e, int *edev, const struct ebb__sref *r) {
  if (*e && *edev != r->dev) {
    ebb__ev_free(*e);
    *e = NULL;
  }
  if (!*e && !(*e = ev_new(r->dev))) return ebb__fail(EBB_ENOMEM, "%s: no event for a gradient on device %d: %s", t->fn, r->dev, ebb_last_error());
  *edev = r->dev;
  ebb_status st = ebb_event_record(*e, r->s);
  if (st) return ebb__fail(st, "%s: recording a gradient's event on stream %llu (device %d) failed: %s", t->fn,
                           (unsigned long long)r->id, r->dev, ebb_last_error());
  atomic_fetch_add_explicit(&t->n_events, 1, memory_order_relaxed);
  return EBB_OK;
}

/* Makes stream r wait (on the device) for event e. */
static ebb_status inbuf_wait(struct ebb__task *t, ebb_event_t *e, const struct ebb__sref *r) {
  ebb_status st = ebb_event_wait(e, r->s);
  if (st) return ebb__fail(st, "%s: making stream %llu (device %d) wait for a gradient failed: %s", t->fn,
                           (unsigned long long)r->id, r->dev, ebb_last_error());
  atomic_fetch_add_explicit(&t->n_waits, 1, memory_order_relaxed);
  return EBB_OK;
}

/* Makes stream w (held, or immortal) wait for all the work issued so far to stream `id` of
 * device dev (handle s), live or released: an event recorded on it while it lives, else its
 * release's own event of its last work. */
static ebb_status order_after(struct ebb__task *t, const struct ebb__sref *w, ebb_stream_t *s, uint64_t id, int dev) {
  ebb_event_t *e = ev_new(dev);
  if (!e) return ebb__fail(EBB_ENOMEM, "%s: no event to order stream %llu after stream %llu (device %d): %s", t->fn,
                           (unsigned long long)w->id, (unsigned long long)id, dev, ebb_last_error());
  ebb_status st = ebb__event_record_live(e, s, id);
  if (st == EBB_EFREED) {
    st = ebb__stream_wait_released(w->s, dev, id); /* (w is held, or immortal) */
  } else if (!st) {
    atomic_fetch_add_explicit(&t->n_events, 1, memory_order_relaxed);
    st = inbuf_wait(t, e, w);
  }
  ebb__ev_free(e);
  if (st)
    return ebb__fail(st, "%s: ordering stream %llu after the work of stream %llu (device %d) failed: %s", t->fn,
                     (unsigned long long)w->id, (unsigned long long)id, dev, ebb_last_error());
  return EBB_OK;
}

/* The device's default stream, which nothing releases. */
static ebb_status default_of(struct ebb__task *t, int dev, struct ebb__sref *out) {
  out->dev = dev;
  ebb_status st = ebb_stream_default(dev, &out->s);
  if (!st) st = ebb_stream_id(out->s, &out->id);
  return st ? ebb__fail(st, "%s: reading the default stream of device %d failed: %s", t->fn, dev, ebb_last_error()) : EBB_OK;
}

/* Holds stream *r for the task (once per stream). When that cannot be (its release was asked
 * already, or is done), *r becomes `instead` (a stream the task holds; NULL: the device's default
 * stream), ordered after the work issued to *r: what the task reads may have been written there.
 * Under the task's lock when shared. */
static ebb_status hold_or(struct ebb__task *t, struct ebb__sref *r, const struct ebb__sref *instead) {
  for (size_t i = 0; i < t->nholds; i++)
    if (t->holds[i].id == r->id) {
      t->last_held = r->id;
      return EBB_OK;
    }
  if (t->nholds == t->capholds) {
    size_t nc = t->capholds ? t->capholds * 2 : 4;
    struct ebb__sref *bigger = realloc(t->holds, nc * sizeof *bigger);
    if (!bigger) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the streams the backward holds", t->fn);
    t->holds = bigger;
    t->capholds = nc;
  }
  if (ebb__stream_hold(r->s, r->id)) {
    t->holds[t->nholds++] = *r;
    t->last_held = r->id;
    return EBB_OK;
  }
  struct ebb__sref gone = *r;
  ebb_status st = instead ? (*r = *instead, EBB_OK) : default_of(t, gone.dev, r);
  return st ? st : order_after(t, r, gone.s, gone.id, gone.dev);
}

void ebb__task_unhold(struct ebb__task *t) {
  for (size_t i = 0; i < t->nholds; i++) ebb__stream_unhold(t->holds[i].s);
  free(t->holds);
  t->holds = NULL;
  t->nholds = t->capholds = 0;
}

/* Makes r current on its device for this thread; false when r is none (or cannot be entered:
 * the engine then runs on whatever is current). */
bool ebb__enter(ebb_stream_guard *g, const struct ebb__sref *r) {
  uint64_t id;
  int d;
  return r->id && ebb__stream_peek(r->s, &id, &d) && id == r->id && ebb_stream_guard_enter(g, r->s) == EBB_OK;
}
void ebb__leave(ebb_stream_guard *g, bool entered) {
  if (entered) ebb_stream_guard_exit(g);
}

/* The device of x's slot k: where its gradient lives. */
int ebb__slot_dev(const struct ebb__tnode *x, int k) {
  return x->n->op < 0 ? x->dev : x->n->in_meta ? x->n->in_meta[x->n->nin + k].device : EBB_DEVICE_CPU;
}

/* Adds g (a new reference, consumed) into slot k of x's buffer; `prod` is the stream it was
 * produced on (the producer node's, or the caller's for a root: id 0 for a CPU gradient) and pn
 * the producer (NULL for a root); `shared`: the producer handed g to consumers on other streams
 * too (see struct ebb__slot). For a device gradient, the spec's InputBuffer rules: the first
 * gradient is kept where it is, with an event when a later wait may need one; later ones are
 * summed on the accumulation stream (the consumer's when the gradient is on its device, else the
 * first producer's, else the caller's current stream of that device) after it waited for them. */
ebb_status ebb__buf_add(struct ebb__task *t, struct ebb__tnode *x, int k, ebb_tensor_t *g, const struct ebb__sref *prod,
                        const struct ebb_node *pn, bool shared) {
  if (x->n->nout > 2 && !x->buf_heap && !(x->buf_heap = calloc((size_t)x->n->nout, sizeof *x->buf_heap))) {
    ebb_tensor_release(g);
    return ebb__fail(EBB_ENOMEM, "no host memory for an input buffer");
  }
  ebb_tensor_t **b = ebb__bufs(x);
  int gd = ebb__slot_dev(x, k);
  struct ebb__sref cur;
  if (gd != EBB_DEVICE_CPU && !prod->id) { /* made by a CPU node (a copy to the device): on this thread's current stream */
    cur.dev = gd;
    if (!ebb_stream_current(gd, &cur.s) && !ebb_stream_id(cur.s, &cur.id)) {
      ebb_status st = hold_or(t, &cur, NULL); /* (t's lock is held when shared) */
      if (st) {
        ebb_tensor_release(g);
        return st;
      }
      prod = &cur;
    }
  }
  if (gd == EBB_DEVICE_CPU || !prod->id || !x->sr.id) { /* no stream logic for the CPU */
    if (!b[k]) {
      b[k] = g;
      return EBB_OK;
    }
    return sum_into(&b[k], g, false, false); /* (CPU kernels are done on return: nothing reads later) */
  }
  if (!x->sync && !(x->sync = calloc((size_t)ebb__nbufs(x), sizeof *x->sync))) {
    ebb_tensor_release(g);
    return ebb__fail(EBB_ENOMEM, "no host memory for an input buffer");
  }
  struct ebb__slot *sl = &x->sync[k];
  /* An AccumulateGrad on another stream of its device than its producer. A producer on another
   * device (the leaf used there through ebb_tensor_to_device) is no mismatch: the gradient
   * crosses devices whatever stream the accumulator has, and no stream of the leaf's device
   * could be the producer's to follow. */
  if (x->n->op < 0 && prod->dev == x->dev && prod->id != x->sr.id) {
    atomic_fetch_add_explicit(&t->n_mism, 1, memory_order_relaxed);
    if (!sl->accum.id && !x->follows && atomic_load_explicit(&ebb__follow, memory_order_relaxed)) {
      x->follows = true; /* made permanent when it runs (ebb__node_stream_move from recorded_id) */
      x->sr = *prod;
    } else if (!x->mism.id) {
      x->mism = *prod;
      x->mism_by = pn;
    }
  }
  if (prod->id != x->sr.id) atomic_fetch_add_explicit(&t->n_xedges, 1, memory_order_relaxed);
  if (!sl->accum.id) { /* the first producer */
    sl->accum = x->sr.dev == gd ? x->sr : prod->dev == gd ? *prod : t->caller[gd];
    sl->ready = *prod;
    b[k] = g;
    sl->shared = shared;
    sl->ev_ok = false;
    if (x->sr.id != prod->id || sl->accum.id != prod->id) {
      ebb_status st = inbuf_record(t, &sl->ev, &sl->ev_dev, prod);
      if (st) return st;
      sl->ev_ok = true;
    }
    return EBB_OK;
  }
  ebb_status st = EBB_OK;
  if (sl->accum.id != prod->id) { /* the sum waits for this producer */
    ebb_event_t *e = NULL;
    int edev = 0;
    st = inbuf_record(t, &e, &edev, prod);
    if (!st) st = inbuf_wait(t, e, &sl->accum);
    ebb__ev_free(e);
  }
  if (!st && sl->accum.id != sl->ready.id) { /* ... and for the value already there */
    if (!sl->ev_ok) st = inbuf_record(t, &sl->ev, &sl->ev_dev, &sl->ready);
    if (!st) st = inbuf_wait(t, sl->ev, &sl->accum);
  }
  if (st) {
    ebb_tensor_release(g);
    return st;
  }
  ebb_stream_guard gu;
  bool in = ebb__enter(&gu, &sl->accum);
  st = sum_into(&b[k], g, sl->shared, shared);
  sl->shared = false; /* the sum is in a tensor no one else was handed (never into a shared one) */
  ebb__leave(&gu, in);
  sl->ready = sl->accum;
  sl->ev_ok = false; /* recorded when the consumer needs it */
  return st;
}

/* .grad (meta m, grad_mu held) is about to be written on stream r (x's). When a backward last
 * wrote it on another stream (a follow-producer move, an accumulator made again on another
 * stream, another thread's backward through another accumulator of the leaf), r first waits for
 * that stream: it holds the last write, which r's read-modify-write must come after. The caller
 * never saw that stream (the engine chose both), so ordering them is the engine's job. */
static ebb_status grad_order(struct ebb__task *t, struct ebb__meta *m, const struct ebb__sref *r) {
  if (!m->grad || !r->id || !m->grad_stream_id || m->grad_stream_id == r->id) return EBB_OK;
  int dev = m->grad_stream_dev;
  ebb_event_t *e = ev_new(dev);
  if (!e) return ebb__fail(EBB_ENOMEM, "%s: no event to order a .grad written on stream %llu (device %d) before stream %llu: %s", t->fn,
                           (unsigned long long)m->grad_stream_id, dev, (unsigned long long)r->id, ebb_last_error());
  /* (streams_export.h: recorded only while that stream lives; once released, its release's own
   * event orders r after its work) */
  ebb_status st = ebb__event_record_live(e, m->grad_stream, m->grad_stream_id);
  if (st == EBB_EFREED) {
    st = ebb__stream_wait_released(r->s, dev, m->grad_stream_id);
  } else if (!st) {
    atomic_fetch_add_explicit(&t->n_events, 1, memory_order_relaxed);
    st = inbuf_wait(t, e, r);
  }
  ebb__ev_free(e);
  if (st)
    return ebb__fail(st, "%s: ordering .grad's last write on stream %llu (device %d) before stream %llu failed: %s", t->fn,
                     (unsigned long long)m->grad_stream_id, dev, (unsigned long long)r->id, ebb_last_error());
  return EBB_OK;
}

/* .grad was just written on stream r (grad_mu held). */
static void grad_written(struct ebb__meta *m, const struct ebb__sref *r) {
  m->grad_stream = r->s;
  m->grad_stream_id = r->id;
  m->grad_stream_dev = r->dev;
}

/* AccumulateGrad x, under the leaf's lock: the first gradient becomes .grad, taken from the
 * buffer without a copy when nothing else sees it (*g set to NULL then), else copied contiguous;
 * later ones are added into .grad in place (keeping the tensor the caller may hold). */
ebb_status ebb__accumulate(struct ebb__task *t, const struct ebb__tnode *x, ebb_tensor_t **g) {
  struct ebb_node *n = x->n;
  struct ebb__meta *m = ebb__meta_of(n->leaf);
  ebb__mutex_lock(&m->grad_mu);
  ebb_status st = grad_order(t, m, &x->sr);
  if (!st && m->grad) {
    st = ebb_op_add_(m->grad, *g);
  } else if (!st && ebb__tensor_exclusive(*g) && !(x->sync && x->sync[0].shared)) { /* (shared: copied, .grad is summed into) */
    m->grad = *g;
    *g = NULL;
    ebb__owners_grad_new(n->leaf, m, m->grad); /* owners.c: the buffer is the leaf's gradient now */
  } else if (!st) {
    bool named = ebb__owners_grad_enter(n->leaf, m); /* owners.c: the copy is the gradient's from the start */
    st = ebb_tensor_clone(*g, &m->grad);
    ebb__owners_leave(named);
    if (!st && !named) ebb__owners_grad_new(n->leaf, m, m->grad);
  }
  if (!st) grad_written(m, &x->sr);
  ebb__mutex_unlock(&m->grad_mu);
  return st;
}

/* A non-leaf's .grad (meta m) written at x, on x's stream: an input of ebb_backward captured
 * there, or a retained one (retain_grad's write): g added into its .grad, a copy the first time.
 * In place after .grad's last write, as for a leaf (a retained .grad is summed over backward
 * calls whose nodes may run on other streams: a forward stream released since, an in-place
 * change that moved its history). */
ebb_status ebb__accumulate_into(struct ebb__task *t, const struct ebb__tnode *x, struct ebb__meta *m, const ebb_tensor_t *g) {
  ebb__mutex_lock(&m->grad_mu);
  ebb_status st = grad_order(t, m, &x->sr);
  if (!st) st = m->grad ? ebb_op_add_(m->grad, g) : ebb_tensor_clone(g, &m->grad);
  if (!st) grad_written(m, &x->sr);
  ebb__mutex_unlock(&m->grad_mu);
  return st;
}

/* ---- before and after a node ------------------------------------------------------------------ */

/* Before x runs (or hands a capture over): its stream waits for each slot whose value became
 * ready on another stream, with the slot's event (recorded now when a sum came after it). */
ebb_status ebb__consume_waits(struct ebb__task *t, struct ebb__tnode *x) {
  ebb_tensor_t **buf = ebb__bufs(x);
  ebb_status st = EBB_OK;
  for (int k = 0; x->sync && buf && k < ebb__nbufs(x) && !st; k++) {
    struct ebb__slot *sl = &x->sync[k];
    if (!buf[k] || !sl->accum.id || sl->ready.id == x->sr.id) continue;
    if (!sl->ev_ok) st = inbuf_record(t, &sl->ev, &sl->ev_dev, &sl->ready);
    if (!st) st = inbuf_wait(t, sl->ev, &x->sr);
  }
  return st;
}

/* x's stream wrote a result the caller will read (.grad, a captured gradient): the caller's
 * current stream of its device waits for it at the end. Under the task's lock when shared. */
ebb_status ebb__leaf_stream(struct ebb__task *t, const struct ebb__tnode *x) {
  if (!x->sr.id) return EBB_OK;
  if (t->shared) ebb__mutex_lock(&t->mu);
  bool seen = false;
  for (size_t i = 0; i < t->nleaves && !seen; i++) seen = t->leaves[i].id == x->sr.id;
  ebb_status st = EBB_OK;
  if (!seen && t->nleaves == t->capleaves) {
    size_t nc = t->capleaves ? t->capleaves * 2 : 8;
    struct ebb__sref *bigger = realloc(t->leaves, nc * sizeof *bigger);
    if (!bigger) st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the leaf streams", t->fn);
    else {
      t->leaves = bigger;
      t->capleaves = nc;
    }
  }
  if (!seen && !st) t->leaves[t->nleaves++] = x->sr;
  if (t->shared) ebb__mutex_unlock(&t->mu);
  return st;
}

/* Leaves and stream pairs warned about already: once per (leaf, accumulator's stream, producer's
 * stream), process-wide, until the module stops. Open addressing on the three ids. */
static ebb_mutex ebb__warned_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.warned", EBB_RANK_LEAF};
static struct {
  uint64_t (*k)[3];
  size_t n, cap;
} ebb__warned;

/* True the first time (leaf, a, b) is seen (false too without memory: no warning then). */
static bool warn_first(uint64_t leaf, uint64_t a, uint64_t b) {
  ebb__mutex_lock(&ebb__warned_mu);
  bool first = false;
  if ((ebb__warned.n + 1) * 2 > ebb__warned.cap) {
    size_t nc = ebb__warned.cap ? ebb__warned.cap * 2 : 64;
    uint64_t(*nk)[3] = calloc(nc, sizeof *nk);
    if (!nk) goto out;
    for (size_t i = 0; i < ebb__warned.cap; i++) {
      if (!ebb__warned.k[i][0]) continue;
      size_t j = (size_t)((ebb__warned.k[i][0] * 0x9e3779b97f4a7c15ull) ^ ebb__warned.k[i][1] ^ (ebb__warned.k[i][2] << 7)) & (nc - 1);
      while (nk[j][0]) j = (j + 1) & (nc - 1);
      memcpy(nk[j], ebb__warned.k[i], sizeof nk[j]);
    }
    free(ebb__warned.k);
    ebb__warned.k = nk;
    ebb__warned.cap = nc;
  }
  size_t j = (size_t)((leaf * 0x9e3779b97f4a7c15ull) ^ a ^ (b << 7)) & (ebb__warned.cap - 1);
  for (;; j = (j + 1) & (ebb__warned.cap - 1)) {
    if (!ebb__warned.k[j][0]) {
      ebb__warned.k[j][0] = leaf;
      ebb__warned.k[j][1] = a;
      ebb__warned.k[j][2] = b;
      ebb__warned.n++;
      first = true;
      break;
    }
    if (ebb__warned.k[j][0] == leaf && ebb__warned.k[j][1] == a && ebb__warned.k[j][2] == b) break;
  }
out:
  ebb__mutex_unlock(&ebb__warned_mu);
  return first;
}

/* The stream-mismatch warning for AccumulateGrad x (its slot saw x->mism), once per leaf and pair
 * of streams: names the leaf, both streams, the producer and what keeps the accumulator alive
 * (the nodes of other graphs that use it, gradient-edge handles). */
static void acc_warn(struct ebb__task *t, const struct ebb__tnode *x) {
  struct ebb_node *n = x->n;
  struct ebb__meta *m = ebb__meta_of(n->leaf);
  if (!warn_first(m->uid, x->sr.id, x->mism.id)) return;
  ebb__count(EBB__S_WARNS, 1);
  char leaf[160], name[EBB_TENSOR_NAME_MAX + 1] = "";
  ebb_tensor_info ti;
  ebb_tensor_name(n->leaf, name, sizeof name);
  ebb_tensor_get_info(n->leaf, &ti);
  int off = snprintf(leaf, sizeof leaf, "%s%s%s[", name[0] ? "'" : "", name, name[0] ? "' " : "");
  for (int d = 0; d < ti.ndim && off > 0 && (size_t)off < sizeof leaf; d++)
    off += snprintf(leaf + off, sizeof leaf - (size_t)off, "%s%lld", d ? ", " : "", (long long)ti.shape[d]);
  if (off > 0 && (size_t)off < sizeof leaf) snprintf(leaf + off, sizeof leaf - (size_t)off, "] %s", ebb_dtype_name(ti.dtype));
  /* Who holds it: nodes outside this task that have an edge to it (earlier graphs still alive). */
  struct ebb_node **cons = NULL;
  size_t ncons = 0, capcons = 0, others = 0;
  const struct ebb_node *first = NULL;
  (void)ebb__consumers_get(n, &cons, &ncons, &capcons);
  for (size_t i = 0; i < ncons; i++) {
    if (ebb__tfind(t, cons[i]) >= 0) continue;
    if (!others++) first = cons[i];
  }
  char held[256];
  long edges = atomic_load_explicit(&n->edge_handles, memory_order_relaxed);
  int h = 0;
  if (others)
    h = snprintf(held, sizeof held, "%zu node%s of an earlier graph still alive (%s, node %llu%s)", others, others == 1 ? "" : "s",
                 ebb__node_name_of(first), (unsigned long long)first->seq, others > 1 ? ", ..." : "");
  if (edges > 0 && h >= 0 && (size_t)h < sizeof held)
    h += snprintf(held + h, sizeof held - (size_t)h, "%s%ld gradient-edge handle%s (ebb_tensor_gradient_edge)", others ? " and " : "",
                  edges, edges == 1 ? "" : "s");
  if (!others && edges <= 0) snprintf(held, sizeof held, "references outside this backward (hook registrations, other backward calls)");
  for (size_t i = 0; i < ncons; i++) ebb__node_unref(cons[i]);
  free(cons);
  /* Made on a stream since released, it runs on the caller's current stream instead. */
  char where[128] = "the stream current when it was made";
  if (x->recorded_id != x->sr.id)
    snprintf(where, sizeof where, "the caller's current stream (stream %llu, current when it was made, was released)",
             (unsigned long long)x->recorded_id);
  ebb__warn("%s: the AccumulateGrad of leaf %s on device %d runs on stream %llu, %s, but "
            "its gradient comes from stream %llu (%s); every backward through it makes stream %llu wait for stream %llu. "
            "The accumulator outlived the forward that made it: it is kept alive by %s. Gradients are right; this costs a "
            "cross-stream wait per step (and breaks CUDA-graph capture when stream %llu is outside it). Release those "
            "references before the next forward, or let accumulators follow their producer "
            "(ebb_autograd_set_accumulate_grad_follows_producer), or silence this "
            "(ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch). Said once per leaf and pair of streams.",
            t->fn, leaf, x->dev, (unsigned long long)x->sr.id, where, (unsigned long long)x->mism.id,
            x->mism_by ? ebb__node_name_of(x->mism_by) : "the caller's current stream: the leaf is a root", (unsigned long long)x->sr.id,
            (unsigned long long)x->mism.id, held, (unsigned long long)x->sr.id);
}


/* Follow-producer made permanent on the node, or the mismatch warning: when AccumulateGrad x runs. */
void ebb__acc_stream(struct ebb__task *t, const struct ebb__tnode *x) {
  if (x->follows && ebb__node_stream_move(x->n, x->recorded_id, x->sr.s, x->sr.id)) ebb__count(EBB__S_FOLLOWED, 1);
  if (x->mism.id && atomic_load_explicit(&ebb__warn_acc, memory_order_relaxed)) acc_warn(t, x);
}

void ebb__inbuf_stop(void) {
  ebb__mutex_lock(&ebb__warned_mu);
  free(ebb__warned.k);
  ebb__warned.k = NULL;
  ebb__warned.n = ebb__warned.cap = 0;
  ebb__mutex_unlock(&ebb__warned_mu);
}

/* ---- what a task wrote ------------------------------------------------------------------------ */

ebb_status ebb__task_wrote(struct ebb__task *t, const ebb_tensor_t *tensor, const struct ebb_node *of) {
  ebb_status st = EBB_OK;
  if (t->shared) ebb__mutex_lock(&t->mu);
  if (t->nwrote == t->capwrote) {
    size_t nc = t->capwrote ? t->capwrote * 2 : 8;
    struct ebb__wrote *bigger = realloc(t->wrote, nc * sizeof *bigger);
    if (!bigger) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to note a written .grad", t->fn);
    else {
      t->wrote = bigger;
      t->capwrote = nc;
    }
  }
  if (!st) t->wrote[t->nwrote++] = (struct ebb__wrote){tensor, of};
  if (t->shared) ebb__mutex_unlock(&t->mu);
  return st;
}

/* One written .grad's tensor for a message (ops' one form: its role, name, dtype, shape, device). */
static int describe_one(const struct ebb__wrote *w, char *out, size_t n) {
  if (!w->t) return snprintf(out, n, "a retained output of %s (node %llu)", ebb__node_name_of(w->of), (unsigned long long)w->of->seq);
  return (int)strlen(ebb__tensor_desc(w->t, w->of ? "the leaf" : "the input", -1, out, n));
}

void ebb__task_wrote_describe(const struct ebb__task *t, char *msg, size_t n) {
  size_t len = strlen(msg);
  if (len + 1 >= n) return;
  if (!t->nwrote) {
    snprintf(msg + len, n - len, "; no .grad was changed by this call");
    return;
  }
  int off = snprintf(msg + len, n - len, "; this call had already written .grad (a retry would add to it again) of ");
  for (size_t i = 0; i < t->nwrote && off > 0 && len + (size_t)off + 1 < n; i++) {
    if (i == 4 && t->nwrote > 5) {
      snprintf(msg + len + off, n - len - (size_t)off, " and %zu more", t->nwrote - 4);
      return;
    }
    if (i) off += snprintf(msg + len + off, n - len - (size_t)off, ", ");
    if (len + (size_t)off + 1 < n) off += describe_one(&t->wrote[i], msg + len + off, n - len - (size_t)off);
  }
}

/* ---- a task's streams --------------------------------------------------------------------------- */

/* The device of node n: its forward outputs' (an AccumulateGrad: its leaf's), or the CPU. */
static int node_dev(const struct ebb_node *n) {
  if (n->op < 0) {
    ebb__tensor_meta m;
    ebb__tensor_meta_of(n->leaf, &m);
    return m.device;
  }
  return n->nout > 0 && n->in_meta ? n->in_meta[n->nin].device : EBB_DEVICE_CPU;
}

/* Each needed node's device and stream (its forward stream while that stream lives, else the
 * caller's current stream of its device), the caller's current streams (when a node is on a
 * device), and how many devices the task touches. */
ebb_status ebb__task_streams(struct ebb__task *t, int *ndevs) {
  uint64_t seen = 0, gone_id = 0;
  *ndevs = 0;
  for (size_t i = 0; i < t->count; i++) {
    struct ebb__tnode *x = &t->nodes[i];
    x->dev = x->needed ? node_dev(x->n) : EBB_DEVICE_CPU;
    if (x->dev < 0) continue;
    if (!t->caller) {
      int n = 0;
      ebb_status st = ebb_dev_count(&n);
      if (!st && !(t->caller = calloc((size_t)(n > 0 ? n : 1), sizeof *t->caller)))
        st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the caller's streams", t->fn);
      for (int d = 0; !st && d < n; d++) {
        t->caller[d].dev = d;
        st = ebb_stream_current(d, &t->caller[d].s);
        if (!st) st = ebb_stream_id(t->caller[d].s, &t->caller[d].id);
      }
      if (st) return ebb__fail(st, "%s: reading the caller's current streams failed: %s", t->fn, ebb_last_error());
      t->ndev = n;
      /* Held too: a hook may release the caller's stream while the task still records on it. */
      for (int d = 0; !st && d < n; d++) st = hold_or(t, &t->caller[d], NULL);
      if (st) return st;
    }
    if (x->dev >= t->ndev)
      return ebb__fail(EBB_EDEVICE, "%s: %s (node %llu) is on device %d, but there are %d devices", t->fn, ebb__node_name_of(x->n),
                       (unsigned long long)x->n->seq, x->dev, t->ndev);
    ebb_stream_t *s;
    uint64_t id, live;
    int d;
    ebb__node_stream(x->n, &s, &id);
    x->recorded_id = id;
    x->sr = (struct ebb__sref){s, id, x->dev};
    /* Its forward stream while it lives, held to the task's end (a run of nodes on one stream
     * takes it once); else (none, released since the forward, or its release asked) the
     * caller's, after the work of that stream, which made what the node reads. */
    bool peeked = id && ebb__stream_peek(s, &live, &d) && live == id;
    ebb_status st = EBB_OK;
    if (!id) {
      x->sr = t->caller[x->dev];
    } else if (peeked && d == x->dev && id != gone_id) {
      if (id != t->last_held) st = hold_or(t, &x->sr, &t->caller[x->dev]);
      if (x->sr.id != id) gone_id = id;
    } else {
      x->sr = t->caller[x->dev];
      if (id != gone_id) st = order_after(t, &x->sr, s, id, peeked ? d : x->dev);
      gone_id = id;
    }
    if (st) return st;
    uint64_t bit = 1ull << (x->dev & 63);
    if (!(seen & bit)) ++*ndevs;
    seen |= bit;
  }
  return EBB_OK;
}

/* At the end: the caller's current stream of each device waits for the streams that wrote what
 * the caller reads (.grad, captured gradients). */
ebb_status ebb__end_sync(struct ebb__task *t) {
  ebb_status st = EBB_OK;
  for (size_t i = 0; i < t->nleaves && !st; i++) {
    const struct ebb__sref *l = &t->leaves[i], *c = &t->caller[l->dev];
    if (!c->id || c->id == l->id) continue;
    ebb_event_t *e = NULL;
    int edev = 0;
    st = inbuf_record(t, &e, &edev, l);
    if (!st) st = inbuf_wait(t, e, c);
    ebb__ev_free(e);
  }
  return st;
}
