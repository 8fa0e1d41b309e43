/* graph.c: autograd's per-tensor state, the nodes ops record through the derivative table, and
 * the module that installs the hooks (ops/export/ops_export.h).
 *
 * A tensor handle autograd knows carries a meta in its slot: whether it requires a gradient, the
 * node that produced it (strong) or, for a leaf, its AccumulateGrad (weak). A node holds strong
 * references to the nodes its inputs came from (its next edges), so a graph lives as long as a
 * tensor at its top does, and goes when the last one is released: the release walks the graph
 * with an explicit stack, never recursion, so a chain of a million nodes frees like one.
 *
 * Threading: metas are written by the thread that creates the handle (or by the user through
 * ebb_tensor_set_requires_grad, the caller's to order with the handle's other users); node
 * reference counts are atomic; a leaf's AccumulateGrad is created under one lock.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "runtime_export.h"
#include "autograd_impl.h"

static _Thread_local bool ebb__grad_off; /* grad mode is on unless set off on this thread */
static _Atomic uint64_t ebb__next_seq;
static _Atomic long ebb__live_nodes;
static ebb_mutex ebb__acc_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.grad_acc", EBB_RANK_LEAF};

/* Consumer lists are guarded by one of 64 locks chosen by the producer's address: recording and
 * freeing take one per edge, uncontended unless threads share a producer (a shared leaf). */
#define EBB__CM(i) {PTHREAD_MUTEX_INITIALIZER, "autograd.consumers", EBB_RANK_LEAF}
#define EBB__CM4(i) EBB__CM(i), EBB__CM(i), EBB__CM(i), EBB__CM(i)
#define EBB__CM16(i) EBB__CM4(i), EBB__CM4(i), EBB__CM4(i), EBB__CM4(i)
static ebb_mutex ebb__cons_mu[64] = {EBB__CM16(0), EBB__CM16(1), EBB__CM16(2), EBB__CM16(3)};

static ebb_mutex *cons_lock(const struct ebb_node *p) { return &ebb__cons_mu[((uintptr_t)p >> 7) & 63]; }

static void edge_link(struct ebb__edge *e) {
  ebb_mutex *mu = cons_lock(e->fn);
  ebb__mutex_lock(mu);
  e->cnext = e->fn->consumers;
  if (e->cnext) e->cnext->cpprev = &e->cnext;
  e->cpprev = &e->fn->consumers;
  e->fn->consumers = e;
  ebb__mutex_unlock(mu);
}

/* Only an edge whose owner was set (by the owner's thread, before linking) is linked; its
 * links are read under the lock, since linking a neighbour rewrites them. */
static void edge_unlink(struct ebb__edge *e) {
  if (!e->owner) return;
  ebb_mutex *mu = cons_lock(e->fn);
  ebb__mutex_lock(mu);
  *e->cpprev = e->cnext;
  if (e->cnext) e->cnext->cpprev = e->cpprev;
  e->cpprev = NULL;
  ebb__mutex_unlock(mu);
  e->owner = NULL;
}

static void node_stream_set(struct ebb_node *n, int device);

void ebb__node_link(struct ebb_node *n) {
  /* Its forward stream: the current stream of its outputs' device as it is recorded. */
  if (n->op >= 0 && n->nout > 0 && n->in_meta && !n->stream_id) node_stream_set(n, n->in_meta[n->nin].device);
  for (int i = 0; n->op >= 0 && i < n->nin; i++)
    if (n->next[i].fn) {
      n->next[i].owner = n;
      edge_link(&n->next[i]);
    }
}

ebb_status ebb__consumers_get(struct ebb_node *p, struct ebb_node ***out, size_t *n, size_t *cap) {
  ebb_mutex *mu = cons_lock(p);
  ebb_status st = EBB_OK;
  ebb__mutex_lock(mu);
  for (struct ebb__edge *e = p->consumers; e && !st; e = e->cnext) {
    struct ebb_node *c = e->owner;
    /* A consumer whose last reference is going (count 0) is being freed and stays linked until
     * its free unlinks it: skip it, never touching its count. Incrementing and undoing would let
     * a walker under another producer's lock see the transient 1 and keep a reference. */
    long r = atomic_load_explicit(&c->refs, memory_order_acquire);
    while (r > 0 && !atomic_compare_exchange_weak_explicit(&c->refs, &r, r + 1, memory_order_acq_rel, memory_order_acquire)) {
    }
    if (r == 0) continue;
    if (*n == *cap) {
      size_t nc = *cap ? *cap * 2 : 64;
      struct ebb_node **bigger = realloc(*out, nc * sizeof *bigger);
      if (!bigger) {
        atomic_fetch_sub_explicit(&c->refs, 1, memory_order_relaxed); /* (its other holders keep it) */
        st = EBB_ENOMEM;
        break;
      }
      *out = bigger;
      *cap = nc;
    }
    (*out)[(*n)++] = c;
  }
  ebb__mutex_unlock(mu);
  return st;
}

bool ebb_grad_enabled(void) { return !ebb__grad_off && !ebb__inference_on(); }
bool ebb__grad_mode_on(void) { return !ebb__grad_off; }

void ebb_grad_set_enabled(bool enabled, bool *was) {
  if (was) *was = !ebb__grad_off;
  ebb__grad_off = !enabled;
}

/* ---- nodes ------------------------------------------------------------------------------------ */

struct ebb__meta *ebb__meta_of(const ebb_tensor_t *t) { return ebb__tensor_slot(t); }

static _Atomic uint64_t ebb__next_meta_uid = 1;

struct ebb__meta *ebb__meta_alloc(void) {
  struct ebb__meta *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  ebb__mutex_init(&m->grad_mu, "autograd.grad", EBB_RANK_AG_GRAD);
  m->uid = atomic_fetch_add_explicit(&ebb__next_meta_uid, 1, memory_order_relaxed);
  return m;
}

struct ebb__meta *ebb__meta_new(ebb_tensor_t *t) {
  struct ebb__meta *m = ebb__meta_alloc();
  if (m) ebb__tensor_set_slot(t, m);
  return m;
}

void ebb__meta_free(struct ebb__meta *m) {
  ebb__retain_end(m);
  ebb__hooks_free(m->hooks);
  if (m->grad) ebb_tensor_release(m->grad);
  ebb__mutex_destroy(&m->grad_mu);
  free(m);
}

const char *ebb__node_name_of(const struct ebb_node *n) {
  if (n->op < 0) return "AccumulateGrad";
  return EBB_UNLIKELY(n->fnrec != NULL) ? ebb__function_node_name(n->fnrec) : ebb__deriv_of((ebb__op_id)n->op)->node;
}

/* Frees a node whose last reference went, and every node that loses its last one with it, with
 * an explicit stack (a long chain must not recurse). */
void ebb__node_unref(struct ebb_node *n) {
  if (!n || atomic_fetch_sub_explicit(&n->refs, 1, memory_order_acq_rel) != 1) return;
  struct ebb_node *small[64], **stack = small;
  size_t depth = 0, cap = 64;
  stack[depth++] = n;
  while (depth) {
    struct ebb_node *x = stack[--depth];
    for (int i = 0; i < x->nin; i++) {
      struct ebb_node *c = x->next ? x->next[i].fn : NULL;
      if (c) edge_unlink(&x->next[i]); /* before its reference goes: c outlives the link */
      if (!c || atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1) continue;
      if (depth == cap) {
        struct ebb_node **bigger = malloc(cap * 2 * sizeof *bigger);
        if (!bigger) { /* no memory for the walk: leak this branch rather than recurse */
          continue;
        }
        memcpy(bigger, stack, depth * sizeof *stack);
        if (stack != small) free(stack);
        stack = bigger;
        cap *= 2;
      }
      stack[depth++] = c;
    }
    for (int i = 0; x->saved && i < x->nsaved; i++) ebb__saved_drop(x, i); /* (saved.c) */
    if (x->leaf) {
      ebb__mutex_lock(&ebb__acc_mu);
      struct ebb__meta *m = ebb__meta_of(x->leaf);
      if (m && m->grad_acc == x) m->grad_acc = NULL;
      ebb__mutex_unlock(&ebb__acc_mu);
      ebb_tensor_release(x->leaf);
    }
    ebb__node_kv_free(x);
    ebb__hooks_free(x->hooks);
    if (x->fnrec) ebb__function_free(x->fnrec); /* (function.c: its ctx's user data goes with it) */
    free(x->geom);
    free(x->in_meta);
    free(x->saved);
    free(x->next);
    x->magic = 0;
    free(x);
    atomic_fetch_sub_explicit(&ebb__live_nodes, 1, memory_order_relaxed);
  }
  if (stack != small) free(stack);
}

void ebb__node_drop(struct ebb_node *n) {
  if (!n) return;
  atomic_store_explicit(&n->refs, 1, memory_order_relaxed);
  ebb__node_unref(n);
}

struct ebb_node *ebb__node_new(int op, int nin, int nout) {
  struct ebb_node *n = calloc(1, sizeof *n);
  if (!n) return NULL;
  n->magic = EBB__NODE_MAGIC;
  n->op = op;
  n->nin = nin;
  n->nout = nout;
  n->nsaved = nin + nout;
  n->seq = op < 0 ? EBB__ACC_SEQ : atomic_fetch_add_explicit(&ebb__next_seq, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&ebb__live_nodes, 1, memory_order_relaxed);
  if (nin > 0 && !(n->next = calloc((size_t)nin, sizeof *n->next))) {
    atomic_store_explicit(&n->refs, 1, memory_order_relaxed);
    ebb__node_unref(n);
    return NULL;
  }
  return n;
}

struct ebb_node *ebb__grad_acc_get(const struct ebb__meta *m) {
  ebb__mutex_lock(&ebb__acc_mu);
  struct ebb_node *a = m->grad_acc;
  if (a && atomic_fetch_add_explicit(&a->refs, 1, memory_order_acq_rel) == 0) { /* going: see ebb__grad_acc */
    atomic_fetch_sub_explicit(&a->refs, 1, memory_order_relaxed);
    a = NULL;
  }
  ebb__mutex_unlock(&ebb__acc_mu);
  return a;
}

/* n's forward stream: the calling thread's current stream on `device` (none for the CPU). */
static void node_stream_set(struct ebb_node *n, int device) {
  ebb_stream_t *s = NULL;
  uint64_t id = 0;
  if (device == EBB_DEVICE_CPU || ebb_stream_current(device, &s) || ebb_stream_id(s, &id)) return;
  n->stream = s;
  n->stream_id = id;
}

/* An AccumulateGrad's stream may move (follow-producer) while other backward calls read it:
 * its two fields change together under this lock. Other nodes' never change after linking. */
static ebb_mutex ebb__nstream_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.node_stream", EBB_RANK_LEAF};

void ebb__node_stream(const struct ebb_node *n, ebb_stream_t **s, uint64_t *id) {
  if (n->op >= 0) {
    *s = n->stream;
    *id = n->stream_id;
    return;
  }
  ebb__mutex_lock(&ebb__nstream_mu);
  *s = n->stream;
  *id = n->stream_id;
  ebb__mutex_unlock(&ebb__nstream_mu);
}

bool ebb__node_stream_move(struct ebb_node *a, uint64_t from, ebb_stream_t *s, uint64_t id) {
  ebb__mutex_lock(&ebb__nstream_mu);
  bool ok = a->stream_id == from;
  if (ok) {
    a->stream = s;
    a->stream_id = id;
  }
  ebb__mutex_unlock(&ebb__nstream_mu);
  return ok;
}

ebb_status ebb__grad_acc(ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **out) {
  ebb__mutex_lock(&ebb__acc_mu);
  struct ebb_node *a = m->grad_acc;
  if (a && atomic_fetch_add_explicit(&a->refs, 1, memory_order_acq_rel) == 0) {
    /* Its last reference is being dropped on another thread (which clears m->grad_acc under
     * this lock after we leave): undo, and make a new one. */
    atomic_fetch_sub_explicit(&a->refs, 1, memory_order_relaxed);
    a = NULL;
  }
  if (!a) {
    a = ebb__node_new(-1, 1, 0);
    ebb_status st = a ? ebb_tensor_retain(t) : EBB_ENOMEM;
    if (st) {
      ebb__mutex_unlock(&ebb__acc_mu);
      if (a) {
        atomic_store_explicit(&a->refs, 1, memory_order_relaxed);
        ebb__node_unref(a);
      }
      return ebb__fail(EBB_ENOMEM, "no host memory for the AccumulateGrad node of a leaf");
    }
    a->leaf = t;
    ebb__tensor_meta tm;
    ebb__tensor_meta_of(t, &tm);
    node_stream_set(a, tm.device);
    atomic_store_explicit(&a->refs, 1, memory_order_relaxed);
    m->grad_acc = a;
  }
  ebb__mutex_unlock(&ebb__acc_mu);
  *out = a;
  return EBB_OK;
}

/* ---- the hooks ops calls ------------------------------------------------------------------------ */

static void ag_released(ebb_tensor_t *t, void *slot) {
  (void)t;
  struct ebb__meta *m = slot;
  ebb__retain_end(m); /* before its node (whose list holds the retain hook) may go */
  ebb__node_unref(m->grad_fn);
  ebb__meta_free(m);
}

static ebb_status ag_recorded(int op, const ebb_tensor_t *const *in, int nin, ebb_tensor_t *const *out, int nout,
                                   const struct ebb__op_args *args) {
  if (ebb__grad_off || ebb__inference_on()) return EBB_OK;
  /* Views among the inputs take their history from their base first, if it moved on: a node
   * made then must be older than this one (the engine relies on producers having smaller
   * sequence numbers than their consumers). This comes before requires_grad is read: another
   * thread may be rebuilding the same view, and ebb__grad_fn_now orders this thread after it. */
  bool any = false;
  for (int i = 0; i < nin; i++) {
    struct ebb__meta *m = in[i] ? ebb__meta_of(in[i]) : NULL;
    struct ebb_node *gf;
    int nr;
    ebb_status st = m && m->is_view ? ebb__grad_fn_now(in[i], m, &gf, &nr) : EBB_OK;
    if (st) return st;
    any = any || (m && m->requires_grad);
  }
  if (!any) return EBB_OK;
  const ebb__deriv *e = ebb__deriv_of((ebb__op_id)op);
  struct ebb_node *n = ebb__node_new(op, nin, nout);
  bool saving = false; /* a failure while saving carries its message (a pack hook's, with the node and tensor) */
  ebb_status st = n ? EBB_OK : EBB_ENOMEM;
  if (!st) {
    n->args = *args;
    n->in_meta = calloc((size_t)(nin + nout), sizeof *n->in_meta); /* [nin + k]: output k's, the node's inputs */
    if (e->save) n->saved = calloc((size_t)(nin + nout), sizeof *n->saved);
    if (!n->in_meta || (e->save && !n->saved)) st = EBB_ENOMEM;
  }
  for (int i = 0; !st && i < nin; i++) {
    if (!in[i]) {
      n->in_meta[i].ndim = -1; /* an optional input not given */
      continue;
    }
    ebb__tensor_meta_of(in[i], &n->in_meta[i]);
    bool diff = e->nin < 0 ? (e->diff & 1) : ((e->diff >> i) & 1);
    struct ebb__meta *m = ebb__meta_of(in[i]);
    if (diff && m && m->requires_grad) {
      struct ebb_node *gf = NULL;
      int nr = 0;
      st = ebb__grad_fn_now(in[i], m, &gf, &nr);
      if (st) break;
      if (gf) {
        atomic_fetch_add_explicit(&gf->refs, 1, memory_order_relaxed);
        n->next[i] = (struct ebb__edge){.fn = gf, .input_nr = nr};
      } else {
        struct ebb_node *a = NULL;
        st = ebb__grad_acc((ebb_tensor_t *)in[i], m, &a);
        if (!st) n->next[i] = (struct ebb__edge){.fn = a};
      }
    }
    if (!st && i < 8 && (e->save & EBB__SAVE_IN(i))) saving = (st = ebb__save(n, i, in[i])) != EBB_OK;
  }
  for (int k = 0; !st && k < nout; k++)
    if (e->save & EBB__SAVE_OUT(k)) saving = (st = ebb__save(n, nin + k, out[k])) != EBB_OK;
  for (int k = 0; !st && k < nout; k++) ebb__tensor_meta_of(out[k], &n->in_meta[nin + k]);
  /* The outputs with a gradient (floating ones: max_dim's indices have none) point at the node. */
  for (int k = 0; !st && k < nout; k++) {
    ebb_dtype dt = EBB_F32;
    st = ebb_tensor_dtype(out[k], &dt);
    if (st || !ebb_dtype_is_float(dt)) continue;
    struct ebb__meta *m = ebb__meta_new(out[k]);
    if (!m) {
      st = EBB_ENOMEM;
      break;
    }
    m->requires_grad = true;
    m->grad_fn = n;
    m->output_nr = k;
    atomic_fetch_add_explicit(&n->refs, 1, memory_order_relaxed);
    if (ebb__tensor_base(out[k])) { /* a view: its history follows its base's from now on */
      uint64_t v = 0;
      ebb_tensor_version(out[k], &v);
      m->is_view = true;
      atomic_store_explicit(&m->view_version, v, memory_order_relaxed);
    }
  }
  if (st) {
    /* Undo: the outputs' metas (the caller releases the outputs, which frees them through the
     * released hook), then the node if nothing points at it. */
    for (int k = 0; k < nout; k++) {
      struct ebb__meta *m = out[k] ? ebb__meta_of(out[k]) : NULL;
      if (m && m->grad_fn == n) {
        ebb__tensor_set_slot(out[k], NULL);
        ebb__meta_free(m);
        atomic_fetch_sub_explicit(&n->refs, 1, memory_order_relaxed);
      }
    }
    if (n) {
      atomic_fetch_add_explicit(&n->refs, 1, memory_order_relaxed);
      ebb__node_unref(n);
    }
    return st == EBB_ENOMEM && !saving ? ebb__fail(EBB_ENOMEM, "no host memory to record %s", e->node) : st;
  }
  if (atomic_load_explicit(&n->refs, memory_order_relaxed) == 0) { /* no output has a gradient */
    ebb__node_drop(n);
    return EBB_OK;
  }
  ebb__node_link(n); /* last, once the node is whole: a partial backward on another thread may find it from here */
  return EBB_OK;
}

static const ebb__tensor_hooks ebb__ag_hooks = {ag_released, NULL, ag_recorded, ebb__ag_inplace, ebb__ag_inplace_done};

/* ---- public API --------------------------------------------------------------------------------- */

static ebb_status check_t(const char *fn, const ebb_tensor_t *t) { return ebb__tensor_check(t, fn, "t"); }

ebb_status ebb_tensor_set_requires_grad(ebb_tensor_t *t, bool requires_grad) {
  static const char fn[] = "ebb_tensor_set_requires_grad";
  ebb_status st = check_t(fn, t);
  if (st) return st;
  struct ebb__meta *m = ebb__meta_of(t);
  char td[EBB__DESC_MAX];
  if (m && m->grad_fn)
    return ebb__fail(EBB_EINVAL, "%s: %s was produced by %s, so whether it requires a gradient follows its inputs; "
                     "expected a leaf (ebb_tensor_detach makes one)", fn, ebb__tensor_desc(t, "t", -1, td, sizeof td),
                     ebb__node_name_of(m->grad_fn));
  ebb_dtype dt;
  ebb_tensor_dtype(t, &dt);
  if (requires_grad && !ebb_dtype_is_float(dt))
    return ebb__fail(EBB_EINVAL, "%s: %s has dtype %s; only floating tensors have gradients", fn,
                     ebb__tensor_desc(t, "t", -1, td, sizeof td), ebb_dtype_name(dt));
  if (requires_grad && ebb__tensor_is_inference(t) && !ebb__inference_on())
    return ebb__fail(EBB_EINVAL, "%s: %s is an inference tensor (made in inference mode), which cannot require a gradient "
                     "outside inference mode; expected a clone made outside the mode", fn, ebb__tensor_desc(t, "t", -1, td, sizeof td));
  if (!m) {
    if (!requires_grad) return EBB_OK;
    if (!(m = ebb__meta_new(t))) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the tensor's autograd state", fn);
  }
  m->requires_grad = requires_grad;
  return EBB_OK;
}

ebb_status ebb_tensor_requires_grad(const ebb_tensor_t *t, bool *out) {
  ebb_status st = check_t("ebb_tensor_requires_grad", t);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_requires_grad: out is NULL; expected a bool to fill");
  const struct ebb__meta *m = ebb__meta_of(t);
  *out = m && m->requires_grad;
  return EBB_OK;
}

ebb_status ebb_tensor_is_leaf(const ebb_tensor_t *t, bool *out) {
  ebb_status st = check_t("ebb_tensor_is_leaf", t);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_is_leaf: out is NULL; expected a bool to fill");
  struct ebb__meta *m = ebb__meta_of(t);
  struct ebb_node *gf = NULL;
  int nr;
  if (m && (st = ebb__grad_fn_now(t, m, &gf, &nr))) return ebb__fail(st, "ebb_tensor_is_leaf: %s", ebb_last_error());
  *out = !gf;
  return EBB_OK;
}

ebb_status ebb_tensor_grad_fn(const ebb_tensor_t *t, const ebb_node_t **out, int *output_nr) {
  ebb_status st = check_t("ebb_tensor_grad_fn", t);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_grad_fn: out is NULL; expected a node pointer to fill");
  struct ebb__meta *m = ebb__meta_of(t);
  struct ebb_node *gf = NULL;
  int nr = 0;
  if (m && (st = ebb__grad_fn_now(t, m, &gf, &nr))) return ebb__fail(st, "ebb_tensor_grad_fn: %s", ebb_last_error());
  *out = gf;
  if (output_nr) *output_nr = nr;
  return EBB_OK;
}

ebb_status ebb_tensor_detach(const ebb_tensor_t *t, ebb_tensor_t **out) {
  ebb_status st = check_t("ebb_tensor_detach", t);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_detach: out is NULL; expected a tensor handle to fill");
  st = ebb__tensor_share(t, out);
  return st ? ebb__fail(st, "ebb_tensor_detach: no host memory for a tensor handle") : EBB_OK;
}

static ebb_status check_node(const char *fn, const ebb_node_t *n) {
  if (!n) return ebb__fail(EBB_EINVAL, "%s: node is NULL; expected a node (ebb_tensor_grad_fn, ebb_node_next)", fn);
  if (n->magic != EBB__NODE_MAGIC) return ebb__fail(EBB_EFREED, "%s: node %p is not a live node", fn, (const void *)n);
  return EBB_OK;
}

const char *ebb_node_name(const ebb_node_t *node) {
  return node && node->magic == EBB__NODE_MAGIC ? ebb__node_name_of(node) : "(invalid node)";
}

ebb_status ebb_node_sequence_nr(const ebb_node_t *node, uint64_t *out) {
  ebb_status st = check_node("ebb_node_sequence_nr", node);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_node_sequence_nr: out is NULL; expected a uint64_t to fill");
  *out = node->seq;
  return EBB_OK;
}

ebb_status ebb_node_num_next(const ebb_node_t *node, int *out) {
  ebb_status st = check_node("ebb_node_num_next", node);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_node_num_next: out is NULL; expected an int to fill");
  *out = node->op < 0 ? 0 : node->nin;
  return EBB_OK;
}

ebb_status ebb_node_next(const ebb_node_t *node, int i, const ebb_node_t **next, int *input_nr) {
  ebb_status st = check_node("ebb_node_next", node);
  if (st) return st;
  int n = node->op < 0 ? 0 : node->nin;
  if (i < 0 || i >= n)
    return ebb__fail(EBB_EINVAL, "ebb_node_next: edge %d of %s, which has %d; expected 0 <= i < %d", i, ebb__node_name_of(node), n, n);
  if (!next) return ebb__fail(EBB_EINVAL, "ebb_node_next: next is NULL; expected a node pointer to fill");
  *next = node->next[i].fn;
  if (input_nr) *input_nr = node->next[i].fn ? node->next[i].input_nr : 0;
  return EBB_OK;
}

long ebb_autograd_live_nodes(void) { return atomic_load_explicit(&ebb__live_nodes, memory_order_relaxed); }

/* ---- the module ------------------------------------------------------------------------------ */

static ebb_status autograd_start(void) {
  ebb__tensor_hooks_set(&ebb__ag_hooks);
  return EBB_OK;
}

static void autograd_stop(void) {
  ebb__engine_stop(); /* workers joined first: none may run a node once the hooks are gone */
  ebb__tensor_hooks_set(NULL);
  ebb__custom_ops_stop(); /* (no node is live: none can reach an op's function) */
}

static int autograd_count(ebb__live_count *out, int max) {
  if (max < 1) return 0;
  out[0] = (ebb__live_count){"autograd nodes", ebb_autograd_live_nodes()};
  if (max < 2) return 1;
  out[1] = (ebb__live_count){"offloaded saved tensors", ebb__offl_live()};
  return 2;
}

const ebb__module_desc ebb__module_autograd = {
    .name = "autograd",
    .layer = EBB__LAYER_AUTOGRAD,
    .start = autograd_start,
    .stop = autograd_stop,
    .count = autograd_count,
};
