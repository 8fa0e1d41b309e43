/* node_api.c: the Node API and the graph-wide hooks: a node's input metadata and user metadata,
 * node pre- and post-hooks, gradient edges, what the running backward is (its id, the node being
 * evaluated, whether a node will execute), increment_version, multi-grad hooks and whole-graph
 * logging hooks.
 *
 * The engine tells this file when a graph task starts and ends (ebb__task_begin/_end, a scope on
 * the stack of the call that runs it) and which node it evaluates (ebb__node_enter), and calls
 * the node hooks at two points of a node's run. Hooks live in the registry of hooks.c (node hooks
 * in the node's list, multi-grad and logging handles as groups).
 *
 * Threading: the current task and node are thread-local (a hook runs on the thread of its
 * backward). User metadata is under ebb__kv_mu; multi-grad state (per task, on the task's scope)
 * and a multi-grad registration's nodes are under ebb__mg_mu. Both locks are leaves: callbacks
 * (destructors, multi-grad functions) run with neither held.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/ops.h"
#include "ebb_internal.h"

static ebb_mutex ebb__kv_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.node_metadata", EBB_RANK_LEAF};
static ebb_mutex ebb__mg_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.multi_grad", EBB_RANK_LEAF};
static _Atomic int64_t ebb__next_task_id;
static _Thread_local struct ebb__task_scope *ebb__cur_task;
static _Thread_local struct ebb_node *ebb__cur_node;

/* ---- helpers -------------------------------------------------------------------------------- */

static ebb_status node_check(const char *fn, const ebb_node_t *n) {
  if (!n) return ebb__fail(EBB_EINVAL, "%s: node is NULL; expected a node (ebb_tensor_grad_fn, ebb_node_next)", fn);
  if (n->magic != EBB__NODE_MAGIC) return ebb__fail(EBB_EFREED, "%s: node %p is not a live node", fn, (const void *)n);
  return EBB_OK;
}

static int num_inputs(const struct ebb_node *n) { return n->op < 0 ? 1 : n->nout; }

void ebb__node_input_meta(const struct ebb_node *n, int k, ebb__tensor_meta *out) {
  if (n->op < 0) ebb__tensor_meta_of(n->leaf, out);
  else *out = n->in_meta[n->nin + k];
}

/* "MulBackward (node 12)", or "AccumulateGrad" (whose sequence number says nothing). */
static const char *node_api_label(const struct ebb_node *n, char *buf, size_t cap) {
  if (n->op < 0) snprintf(buf, cap, "AccumulateGrad");
  else snprintf(buf, cap, "%s (node %llu)", ebb__node_name_of(n), (unsigned long long)n->seq);
  return buf;
}

/* "f32[2, 3]" into buf (cap >= 16); "f32[]" for a scalar. */
static const char *fmt_meta(const ebb__tensor_meta *m, char *buf, size_t cap) {
  size_t k = (size_t)snprintf(buf, cap, "%s[", ebb_dtype_name(m->dtype));
  for (int d = 0; d < m->ndim && k < cap; d++) k += (size_t)snprintf(buf + k, cap - k, d ? ", %lld" : "%lld", (long long)m->shape[d]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

/* A replacement r for what meta m describes: EBB_OK if it matches, else the message. */
static ebb_status check_replacement(const char *fn, const char *kind, const struct ebb__hook *h, const struct ebb_node *n,
                                         const char *what, int k, const ebb__tensor_meta *m, const ebb_tensor_t *r) {
  char lb[96], a[EBB__DESC_MAX], b[EBB__DESC_MAX];
  ebb_status st = ebb__tensor_check(r, fn, "a hook's replacement");
  if (st) return st;
  if (ebb__tensor_matches(r, m)) return EBB_OK;
  return ebb__fail(EBB_EINVAL, "%s: a %s (hook %llu) of %s replaced %s with %s; expected the same shape, dtype and device", fn,
                   kind, (unsigned long long)h->id, node_api_label(n, lb, sizeof lb), ebb__meta_desc(m, what, k, NULL, a, sizeof a),
                   ebb__tensor_desc(r, "the replacement", -1, b, sizeof b));
}

/* ---- the running task ----------------------------------------------------------------------- */

void ebb__task_begin(struct ebb__task_scope *s, const struct ebb__task *task) {
  s->id = atomic_fetch_add_explicit(&ebb__next_task_id, 1, memory_order_relaxed);
  s->task = task;
  s->outer = ebb__cur_task;
  s->outer_node = ebb__cur_node;
  s->mg = NULL;
  ebb__cur_task = s;
  ebb__cur_node = NULL;
}

struct ebb__task_scope *ebb__task_switch(struct ebb__task_scope *s) {
  struct ebb__task_scope *prev = ebb__cur_task;
  ebb__cur_task = s;
  return prev;
}

struct ebb_node *ebb__node_enter(struct ebb_node *n) {
  struct ebb_node *prev = ebb__cur_node;
  ebb__cur_node = n;
  return prev;
}

ebb_status ebb_autograd_current_node(const ebb_node_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_autograd_current_node: out is NULL; expected a node pointer to fill");
  *out = ebb__cur_node;
  return EBB_OK;
}

int64_t ebb_autograd_current_task_id(void) { return ebb__cur_task ? ebb__cur_task->id : -1; }

bool ebb__current_task_retains(void) { return ebb__cur_task && ebb__task_retains(ebb__cur_task->task); }

ebb_status ebb_autograd_will_execute(const ebb_node_t *node, bool *out) {
  static const char fn[] = "ebb_autograd_will_execute";
  ebb_status st = node_check(fn, node);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a bool to fill", fn);
  if (!ebb__cur_task)
    return ebb__fail(EBB_ESTATE, "%s: no backward is running on this thread; expected a call from a hook during a backward", fn);
  *out = ebb__task_will_execute(ebb__cur_task->task, node);
  return EBB_OK;
}

/* ---- user metadata -------------------------------------------------------------------------- */

struct ebb__kv {
  struct ebb__kv *next;
  void *value;
  ebb_node_metadata_destroy_fn destroy;
  char key[]; /* NUL-terminated */
};

static ebb_status kv_args(const char *fn, const ebb_node_t *node, const char *key) {
  ebb_status st = node_check(fn, node);
  if (!st && !key) st = ebb__fail(EBB_EINVAL, "%s: key is NULL; expected a NUL-terminated string", fn);
  return st;
}

/* Unlinks key's entry from n (lock held); NULL if absent. */
static struct ebb__kv *kv_take_locked(struct ebb_node *n, const char *key) {
  for (struct ebb__kv **p = &n->kv; *p; p = &(*p)->next)
    if (strcmp((*p)->key, key) == 0) {
      struct ebb__kv *e = *p;
      *p = e->next;
      return e;
    }
  return NULL;
}

static void kv_destroy(struct ebb__kv *e) {
  if (!e) return;
  if (e->destroy) e->destroy(e->value);
  free(e);
}

ebb_status ebb_node_metadata_set(const ebb_node_t *node, const char *key, void *value, ebb_node_metadata_destroy_fn destroy) {
  static const char fn[] = "ebb_node_metadata_set";
  ebb_status st = kv_args(fn, node, key);
  if (st) return st;
  size_t len = strlen(key);
  struct ebb__kv *e = malloc(sizeof *e + len + 1);
  if (!e) return ebb__fail(EBB_ENOMEM, "%s: no host memory for key \"%s\"", fn, key);
  memcpy(e->key, key, len + 1);
  e->value = value;
  e->destroy = destroy;
  struct ebb_node *n = (struct ebb_node *)node;
  ebb__mutex_lock(&ebb__kv_mu);
  struct ebb__kv *old = kv_take_locked(n, key);
  e->next = n->kv;
  n->kv = e;
  ebb__mutex_unlock(&ebb__kv_mu);
  kv_destroy(old); /* the old value's destructor, without the lock */
  return EBB_OK;
}

ebb_status ebb_node_metadata_get(const ebb_node_t *node, const char *key, void **value) {
  static const char fn[] = "ebb_node_metadata_get";
  ebb_status st = kv_args(fn, node, key);
  if (st) return st;
  if (!value) return ebb__fail(EBB_EINVAL, "%s: value is NULL; expected a pointer to fill", fn);
  bool found = false;
  ebb__mutex_lock(&ebb__kv_mu);
  for (struct ebb__kv *e = node->kv; e && !found; e = e->next)
    if (strcmp(e->key, key) == 0) {
      *value = e->value;
      found = true;
    }
  ebb__mutex_unlock(&ebb__kv_mu);
  if (!found) return ebb__fail(EBB_ENOTFOUND, "%s: %s has no metadata \"%s\"; expected a key set with ebb_node_metadata_set", fn,
                               ebb__node_name_of(node), key);
  return EBB_OK;
}

ebb_status ebb_node_metadata_remove(const ebb_node_t *node, const char *key) {
  static const char fn[] = "ebb_node_metadata_remove";
  ebb_status st = kv_args(fn, node, key);
  if (st) return st;
  ebb__mutex_lock(&ebb__kv_mu);
  struct ebb__kv *e = kv_take_locked((struct ebb_node *)node, key);
  ebb__mutex_unlock(&ebb__kv_mu);
  if (!e) return ebb__fail(EBB_ENOTFOUND, "%s: %s has no metadata \"%s\" (removed already, or never set)", fn,
                           ebb__node_name_of(node), key);
  kv_destroy(e);
  return EBB_OK;
}

void ebb__node_kv_free(struct ebb_node *n) {
  /* The node's last reference is gone (an acq_rel decrement orders every earlier use), so no
   * other thread can reach the list: no lock. */
  struct ebb__kv *e = n->kv;
  n->kv = NULL;
  while (e) {
    struct ebb__kv *next = e->next;
    kv_destroy(e);
    e = next;
  }
}

/* ---- input metadata ------------------------------------------------------------------------- */

ebb_status ebb_node_num_inputs(const ebb_node_t *node, int *out) {
  ebb_status st = node_check("ebb_node_num_inputs", node);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_node_num_inputs: out is NULL; expected an int to fill");
  *out = num_inputs(node);
  return EBB_OK;
}

ebb_status ebb_node_input_meta(const ebb_node_t *node, int i, ebb_node_input_info *out) {
  static const char fn[] = "ebb_node_input_meta";
  ebb_status st = node_check(fn, node);
  if (st) return st;
  int n = num_inputs(node);
  if (i < 0 || i >= n)
    return ebb__fail(EBB_EINVAL, "%s: input %d of %s, which has %d; expected 0 <= i < %d", fn, i, ebb__node_name_of(node), n, n);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an ebb_node_input_info to fill", fn);
  ebb__tensor_meta m;
  ebb__node_input_meta(node, i, &m);
  memset(out, 0, sizeof *out);
  out->device = m.device;
  out->dtype = m.dtype;
  out->ndim = m.ndim;
  memcpy(out->shape, m.shape, sizeof(int64_t) * (size_t)(m.ndim > 0 ? m.ndim : 0));
  ebb_stream_t *stream;
  ebb__node_stream(node, &stream, &out->stream_id); /* (an accumulator's may move: read under graph.c's lock) */
  return EBB_OK;
}

/* ---- node hooks ----------------------------------------------------------------------------- */

static ebb_status node_hook_add(const char *fn, const ebb_node_t *node, int kind, ebb_node_pre_hook_fn pre,
                                     ebb_node_post_hook_fn post, void *user, void (*user_free)(void *), uint64_t *id) {
  struct ebb__hook *h = calloc(1, sizeof *h);
  if (!h) return ebb__fail(EBB_ENOMEM, "%s: no host memory for a hook", fn);
  h->kind = kind;
  h->pre = pre;
  h->npost = post;
  h->user = user;
  h->user_free = user_free;
  struct ebb_node *n = (struct ebb_node *)node;
  ebb_status st = ebb__hook_attach(fn, &n->hooks, h, id);
  if (st) {
    free(h);
    return st;
  }
  /* Release: a backward that sees the flag sees the list with the hook (ebb__hook_attach's
   * unlock already orders it for one that takes the lock; this is for the engine's load). */
  atomic_store_explicit(&n->has_node_hooks, true, memory_order_release);
  return EBB_OK;
}

static ebb_status node_hook_register(const char *fn, const ebb_node_t *node, int kind, ebb_node_pre_hook_fn pre,
                                          ebb_node_post_hook_fn post, void *user, ebb_hook_handle *out) {
  ebb_status st = node_check(fn, node);
  if (st) return st;
  if (!pre && !post) return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected a hook function", fn);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a hook handle to fill", fn);
  uint64_t id = 0;
  st = node_hook_add(fn, node, kind, pre, post, user, NULL, &id);
  if (!st) out->id = id;
  return st;
}

ebb_status ebb_node_register_pre_hook(const ebb_node_t *node, ebb_node_pre_hook_fn fn, void *user, ebb_hook_handle *out) {
  return node_hook_register("ebb_node_register_pre_hook", node, EBB__HOOK_NODE_PRE, fn, NULL, user, out);
}

ebb_status ebb_node_register_post_hook(const ebb_node_t *node, ebb_node_post_hook_fn fn, void *user, ebb_hook_handle *out) {
  return node_hook_register("ebb_node_register_post_hook", node, EBB__HOOK_NODE_POST, NULL, fn, user, out);
}

/* An array of n NULL handles: `small` when it fits, else allocated (NULL without memory). */
static ebb_tensor_t **nulls(ebb_tensor_t **small, int nsmall, int n) {
  if (n <= nsmall) {
    for (int i = 0; i < nsmall; i++) small[i] = NULL;
    return small;
  }
  return calloc((size_t)n, sizeof(ebb_tensor_t *));
}

static void release_all(ebb_tensor_t **a, int n) {
  for (int i = 0; i < n; i++)
    if (a[i]) {
      ebb_tensor_release(a[i]);
      a[i] = NULL;
    }
}

ebb_status ebb__node_pre_hooks(const char *fn, struct ebb_node *n, ebb_tensor_t **grads, int ngrads) {
  ebb_tensor_t *gsmall[8], *rsmall[8], **g = grads ? grads : nulls(gsmall, 8, ngrads), **rep = nulls(rsmall, 8, ngrads);
  ebb_status st = g && rep ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory to run the pre-hooks of %s", fn, ebb__node_name_of(n));
  char lb[96];
  for (struct ebb__hook *h = n->hooks; h && !st; h = h->next) {
    if (h->kind != EBB__HOOK_NODE_PRE || h->removed) continue;
    struct ebb__user_call uc;
    ebb__user_enter(&uc);
    st = h->pre(n, (const ebb_tensor_t *const *)g, ngrads, rep, h->user);
    ebb__user_leave(&uc, st);
    if (st) {
      st = ebb__fail(st, "%s: a pre-hook (hook %llu) of %s failed: %s", fn, (unsigned long long)h->id, node_api_label(n, lb, sizeof lb),
                     ebb_last_error());
      break;
    }
    for (int k = 0; k < ngrads && !st; k++) {
      if (!rep[k]) continue;
      ebb__tensor_meta m;
      ebb__node_input_meta(n, k, &m);
      if (!g[k])
        st = ebb__fail(EBB_EINVAL, "%s: a pre-hook (hook %llu) of %s gave a gradient for input %d, which got none; expected "
                       "replacements of gradients that exist (a pre-hook cannot create one)", fn, (unsigned long long)h->id,
                       node_api_label(n, lb, sizeof lb), k);
      else st = check_replacement(fn, "pre-hook", h, n, "gradient", k, &m, rep[k]);
      if (st) break;
      ebb_tensor_release(g[k]);
      g[k] = rep[k];
      rep[k] = NULL;
    }
    if (rep) release_all(rep, ngrads); /* what a failed check left */
  }
  if (g && g != grads) {
    release_all(g, ngrads);
    if (g != gsmall) free(g);
  }
  if (rep && rep != rsmall) free(rep);
  return st;
}

ebb_status ebb__node_post_hooks(const char *fn, struct ebb_node *n, ebb_tensor_t **gin, int nin, ebb_tensor_t *const *gout,
                                int nout) {
  ebb_tensor_t *osmall[8], *rsmall[8], **rep = nulls(rsmall, 8, nin);
  ebb_tensor_t *const *o = gout ? gout : nulls(osmall, 8, nout);
  ebb_status st = o && rep ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory to run the post-hooks of %s", fn, ebb__node_name_of(n));
  char lb[96];
  for (struct ebb__hook *h = n->hooks; h && !st; h = h->next) {
    if (h->kind != EBB__HOOK_NODE_POST || h->removed) continue;
    struct ebb__user_call uc;
    ebb__user_enter(&uc);
    st = h->npost(n, (const ebb_tensor_t *const *)gin, nin, (const ebb_tensor_t *const *)o, nout, rep, h->user);
    ebb__user_leave(&uc, st);
    if (st) {
      st = ebb__fail(st, "%s: a post-hook (hook %llu) of %s failed: %s", fn, (unsigned long long)h->id, node_api_label(n, lb, sizeof lb),
                     ebb_last_error());
      break;
    }
    for (int i = 0; i < nin && !st; i++) {
      if (!rep[i]) continue;
      if (n->in_meta[i].ndim < 0)
        st = ebb__fail(EBB_EINVAL, "%s: a post-hook (hook %llu) of %s gave a gradient for input %d, an optional input the forward "
                       "was not given; expected none there", fn, (unsigned long long)h->id, node_api_label(n, lb, sizeof lb), i);
      else st = check_replacement(fn, "post-hook", h, n, "grad_input", i, &n->in_meta[i], rep[i]);
      if (st) break;
      if (gin[i]) ebb_tensor_release(gin[i]);
      gin[i] = rep[i];
      rep[i] = NULL;
    }
    if (rep) release_all(rep, nin);
  }
  if (o && o != gout && o != osmall) free((void *)o);
  if (rep && rep != rsmall) free(rep);
  return st;
}

/* ---- gradient edges ------------------------------------------------------------------------- */

ebb_status ebb_tensor_gradient_edge(const ebb_tensor_t *t, ebb_gradient_edge *out) {
  static const char fn[] = "ebb_tensor_gradient_edge";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an ebb_gradient_edge to fill", fn);
  struct ebb__meta *m = ebb__meta_of(t);
  char td[EBB__DESC_MAX];
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient, so no gradient flows into the graph from it; "
                     "expected a tensor that requires one", fn, ebb__tensor_desc(t, "t", -1, td, sizeof td));
  struct ebb_node *gf = NULL;
  int nr = 0;
  if ((st = ebb__grad_fn_now(t, m, &gf, &nr))) /* inplace.c: a stale view's history is taken from its base first */
    return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  if (gf) {
    atomic_fetch_add_explicit(&gf->refs, 1, memory_order_relaxed); /* (the tensor's reference keeps it alive now) */
    atomic_fetch_add_explicit(&gf->edge_handles, 1, memory_order_relaxed);
    *out = (ebb_gradient_edge){gf, nr};
    return EBB_OK;
  }
  struct ebb_node *a = NULL;
  st = ebb__grad_acc((ebb_tensor_t *)t, m, &a);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  atomic_fetch_add_explicit(&a->edge_handles, 1, memory_order_relaxed);
  *out = (ebb_gradient_edge){a, 0};
  return EBB_OK;
}

ebb_status ebb_gradient_edge_release(ebb_gradient_edge *e) {
  static const char fn[] = "ebb_gradient_edge_release";
  if (!e) return ebb__fail(EBB_EINVAL, "%s: e is NULL; expected an edge from ebb_tensor_gradient_edge", fn);
  if (!e->node) return ebb__fail(EBB_EINVAL, "%s: the edge has no node: released already, or never filled", fn);
  ebb_status st = node_check(fn, e->node);
  if (st) return st;
  atomic_fetch_sub_explicit(&((struct ebb_node *)e->node)->edge_handles, 1, memory_order_relaxed);
  ebb__node_unref((struct ebb_node *)e->node);
  e->node = NULL;
  return EBB_OK;
}

ebb_status ebb__edge_resolve(const char *fn, const char *what, int i, const ebb_gradient_edge *e, struct ebb_node **node, int *nr) {
  if (!e->node)
    return ebb__fail(EBB_EINVAL, "%s: %s[%d] has no node (released, or never filled); expected an edge from "
                     "ebb_tensor_gradient_edge", fn, what, i);
  if (e->node->magic != EBB__NODE_MAGIC)
    return ebb__fail(EBB_EFREED, "%s: %s[%d] names node %p, which is not a live node", fn, what, i, (const void *)e->node);
  int n = num_inputs(e->node);
  if (e->output_nr < 0 || e->output_nr >= n)
    return ebb__fail(EBB_EINVAL, "%s: %s[%d] has output_nr %d, but %s has %d inputs; expected 0 <= output_nr < %d", fn, what, i,
                     e->output_nr, ebb__node_name_of(e->node), n, n);
  *node = (struct ebb_node *)e->node;
  *nr = e->output_nr;
  return EBB_OK;
}

ebb_status ebb__edge_root_grad(const char *fn, int i, const struct ebb_node *n, int nr, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb__tensor_meta m;
  ebb__node_input_meta(n, nr, &m);
  char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
  if (!g) {
    int64_t numel = 1;
    for (int d = 0; d < m.ndim; d++) numel *= m.shape[d];
    if (numel != 1)
      return ebb__fail(EBB_EINVAL, "%s: %s, input %d of %s, has %lld elements and no gradient was given; a gradient is "
                       "implied only for one element (pass %s[%d])", fn, ebb__meta_desc(&m, ebb__roots_arg(fn), i, NULL, a, sizeof a),
                       nr, ebb__node_name_of(n), (long long)numel, ebb__grad_roots_arg(fn), i);
    return ebb_tensor_ones(m.device, m.dtype, m.ndim, m.shape, out);
  }
  ebb_status st = ebb__tensor_check_at(g, fn, ebb__grad_roots_arg(fn), i);
  if (st) return st;
  if (!ebb__tensor_matches(g, &m))
    return ebb__fail(EBB_EINVAL, "%s: %s does not match %s, input %d of %s; expected its shape, dtype and device", fn,
                     ebb__tensor_desc(g, ebb__grad_roots_arg(fn), i, a, sizeof a),
                     ebb__meta_desc(&m, ebb__roots_arg(fn), i, NULL, b, sizeof b), nr, ebb__node_name_of(n));
  ebb_tensor_retain((ebb_tensor_t *)g);
  *out = (ebb_tensor_t *)g;
  return EBB_OK;
}

/* ---- increment_version ---------------------------------------------------------------------- */

ebb_status ebb_autograd_increment_version(ebb_tensor_t *const *tensors, int n) {
  static const char fn[] = "ebb_autograd_increment_version";
  if (n < 0) return ebb__fail(EBB_EINVAL, "%s: n is %d; expected n >= 0", fn, n);
  if (n > 0 && !tensors) return ebb__fail(EBB_EINVAL, "%s: tensors is NULL with n %d; expected an array of n tensors", fn, n);
  for (int i = 0; i < n; i++) { /* all checked first: on error nothing was bumped */
    ebb_status st = ebb__tensor_check_at(tensors[i], fn, "tensors", i);
    if (st) return st;
  }
  for (int i = 0; i < n; i++) {
    ebb_status st = ebb_tensor_bump_version(tensors[i]);
    if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  }
  return EBB_OK;
}

/* ---- multi-grad hooks ----------------------------------------------------------------------- */

struct ebb__mg;
struct ebb__mg_member { /* the user of tensor i's hook */
  struct ebb__mg *mg;
  int idx;
};
struct ebb__mg {
  _Atomic long refs;          /* the group handle, each member hook, each task state */
  int n;
  ebb_multi_grad_mode mode;
  ebb_multi_grad_fn fn;
  void *user;
  struct ebb_node **nodes;    /* "all": [n] each tensor's grad_fn or AccumulateGrad (strong), under ebb__mg_mu; NULL once removed */
  bool removed;               /* under ebb__mg_mu */
  uint64_t *ids;              /* [n] member hook ids, 0: none */
  struct ebb__mg_member *members;
};
struct ebb__mg_state { /* one registration in one graph task */
  struct ebb__mg_state *next;
  struct ebb__mg *mg;         /* a reference */
  int count, expected;
  bool done;
  ebb_tensor_t **grads;       /* "all": [n] */
};

static void mg_release_nodes(struct ebb_node **nodes, int n) {
  for (int i = 0; nodes && i < n; i++) ebb__node_unref(nodes[i]);
  free(nodes);
}

static void mg_unref(struct ebb__mg *mg) {
  /* acq_rel: the thread freeing it sees every other holder's writes (mimalloc-style pairing). */
  if (atomic_fetch_sub_explicit(&mg->refs, 1, memory_order_acq_rel) != 1) return;
  mg_release_nodes(mg->nodes, mg->n);
  free(mg->ids);
  free(mg->members);
  free(mg);
}

static void mg_member_free(void *user) { mg_unref(((struct ebb__mg_member *)user)->mg); }
static void mg_group_free(void *user) { mg_unref(user); }

/* The group's removal: the member hooks stop, the nodes are let go (a backward on another thread
 * already past its check may still fire once). */
static void mg_remove(void *user) {
  struct ebb__mg *mg = user;
  for (int i = 0; i < mg->n; i++)
    if (mg->ids[i]) ebb__hook_remove_id(mg->ids[i]);
  ebb__mutex_lock(&ebb__mg_mu);
  struct ebb_node **nodes = mg->nodes;
  mg->nodes = NULL;
  mg->removed = true;
  ebb__mutex_unlock(&ebb__mg_mu);
  mg_release_nodes(nodes, mg->n); /* without the lock: a node's free may come back to mg_unref */
}

static void mg_state_free(struct ebb__mg_state *s) {
  if (s->grads) {
    release_all(s->grads, s->mg->n);
    free(s->grads);
  }
  mg_unref(s->mg);
  free(s);
}

/* Calls the user's function with grads[0..n) and releases them. */
static ebb_status mg_fire(struct ebb__mg *mg, ebb_tensor_t **grads) {
  struct ebb__user_call uc;
  ebb__user_enter(&uc);
  ebb_status st = mg->fn((const ebb_tensor_t *const *)grads, mg->n, mg->user);
  ebb__user_leave(&uc, st);
  if (st) st = ebb__fail(st, "a multi-grad hook failed: %s", ebb_last_error());
  release_all(grads, mg->n);
  free(grads);
  return st;
}

static ebb_status mg_hook(const ebb_tensor_t *grad, ebb_tensor_t **replace, void *user) {
  (void)replace;
  struct ebb__mg_member *mb = user;
  struct ebb__mg *mg = mb->mg;
  struct ebb__task_scope *task = ebb__cur_task;
  if (!task) return ebb__fail(EBB_EINTERNAL, "multi-grad hook: called outside a backward");
  ebb_tensor_t **fire = calloc((size_t)mg->n, sizeof *fire); /* what goes to fn if this call fires */
  struct ebb__mg_state *fresh = calloc(1, sizeof *fresh);
  ebb_tensor_t **fresh_grads = mg->mode == EBB_MULTI_GRAD_ALL ? calloc((size_t)mg->n, sizeof *fresh_grads) : NULL;
  if (!fire || !fresh || (mg->mode == EBB_MULTI_GRAD_ALL && !fresh_grads)) {
    free(fire);
    free(fresh);
    free(fresh_grads);
    return ebb__fail(EBB_ENOMEM, "multi-grad hook: no host memory for its state");
  }
  ebb_tensor_retain((ebb_tensor_t *)grad); /* outside the (leaf) lock */
  bool fires = false;
  ebb__mutex_lock(&ebb__mg_mu);
  struct ebb__mg_state *s = task->mg;
  while (s && s->mg != mg) s = s->next;
  if (!mg->removed && !s) { /* this task's first call: its state */
    s = fresh;
    fresh = NULL;
    s->mg = mg;
    atomic_fetch_add_explicit(&mg->refs, 1, memory_order_relaxed);
    s->grads = fresh_grads;
    fresh_grads = NULL;
    for (int i = 0; mg->mode == EBB_MULTI_GRAD_ALL && i < mg->n; i++)
      s->expected += mg->nodes[i] && ebb__task_will_execute(task->task, mg->nodes[i]);
    s->next = task->mg;
    task->mg = s;
  }
  if (!mg->removed && !s->done) {
    if (mg->mode == EBB_MULTI_GRAD_ANY) {
      fire[mb->idx] = (ebb_tensor_t *)grad;
      grad = NULL;
      fires = s->done = true;
    } else {
      if (!s->grads[mb->idx]) s->count++;
      ebb_tensor_t *old = s->grads[mb->idx]; /* (the same tensor listed twice: each entry is its own hook) */
      s->grads[mb->idx] = (ebb_tensor_t *)grad;
      grad = old;
      if (s->count >= s->expected) {
        memcpy(fire, s->grads, (size_t)mg->n * sizeof *fire);
        memset(s->grads, 0, (size_t)mg->n * sizeof *fire);
        fires = s->done = true;
      }
    }
  }
  ebb__mutex_unlock(&ebb__mg_mu);
  if (grad) ebb_tensor_release((ebb_tensor_t *)grad);
  free(fresh);
  free(fresh_grads);
  if (!fires) {
    free(fire);
    return EBB_OK;
  }
  return mg_fire(mg, fire);
}

ebb_status ebb__task_end(struct ebb__task_scope *s, bool ok) {
  ebb__cur_task = s->outer;
  ebb__cur_node = s->outer_node;
  if (!s->mg) return EBB_OK;
  ebb__mutex_lock(&ebb__mg_mu);
  struct ebb__mg_state *list = s->mg;
  s->mg = NULL;
  ebb__mutex_unlock(&ebb__mg_mu);
  ebb_status st = EBB_OK;
  while (list) {
    struct ebb__mg_state *next = list->next;
    /* "all" still waiting for a gradient the engine found absent: fired at the end of a backward
     * that succeeded, never after a failure. Runs in this task's context (its id). */
    ebb__mutex_lock(&ebb__mg_mu);
    bool removed = list->mg->removed;
    ebb__mutex_unlock(&ebb__mg_mu);
    if (ok && !st && !list->done && list->mg->mode == EBB_MULTI_GRAD_ALL && !removed) {
      struct ebb__task_scope *outer = ebb__cur_task;
      ebb__cur_task = s;
      st = mg_fire(list->mg, list->grads);
      ebb__cur_task = outer;
      list->grads = NULL;
    }
    mg_state_free(list);
    list = next;
  }
  return st;
}

ebb_status ebb_register_multi_grad_hook(ebb_tensor_t *const *tensors, int n, ebb_multi_grad_fn fn, void *user,
                                        ebb_multi_grad_mode mode, ebb_hook_handle *out) {
  static const char name[] = "ebb_register_multi_grad_hook";
  if (!tensors || n <= 0) return ebb__fail(EBB_EINVAL, "%s: %d tensors (array %p); expected an array of n > 0 tensors", name, n,
                                           (const void *)tensors);
  if (!fn) return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected a function", name);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a hook handle to fill", name);
  if (mode != EBB_MULTI_GRAD_ALL && mode != EBB_MULTI_GRAD_ANY)
    return ebb__fail(EBB_EINVAL, "%s: mode %d is not a mode; expected EBB_MULTI_GRAD_ALL (0) or EBB_MULTI_GRAD_ANY (1)", name, (int)mode);
  for (int i = 0; i < n; i++) {
    ebb_status st = ebb__tensor_check_at(tensors[i], name, "tensors", i);
    if (st) return st;
  }
  struct ebb__mg *mg = calloc(1, sizeof *mg);
  struct ebb__hook *group = calloc(1, sizeof *group);
  if (mg) {
    mg->ids = calloc((size_t)n, sizeof *mg->ids);
    mg->members = calloc((size_t)n, sizeof *mg->members);
    if (mode == EBB_MULTI_GRAD_ALL) mg->nodes = calloc((size_t)n, sizeof *mg->nodes);
  }
  if (!mg || !group || !mg->ids || !mg->members || (mode == EBB_MULTI_GRAD_ALL && !mg->nodes)) {
    if (mg) {
      free(mg->ids);
      free(mg->members);
      free(mg->nodes);
    }
    free(mg);
    free(group);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d hooks", name, n);
  }
  mg->n = n;
  mg->mode = mode;
  mg->fn = fn;
  mg->user = user;
  atomic_store_explicit(&mg->refs, 1, memory_order_relaxed); /* the group's */
  ebb_status st = EBB_OK;
  for (int i = 0; i < n && !st; i++) {
    struct ebb__meta *m = ebb__meta_of(tensors[i]);
    if (!m || !m->requires_grad) continue; /* no gradient will come: NULL in "all" */
    if (mode == EBB_MULTI_GRAD_ALL) {
      struct ebb_node *gf = NULL;
      int nr;
      if ((st = ebb__grad_fn_now(tensors[i], m, &gf, &nr))) { /* inplace.c: a stale view's node is its base's now */
        st = ebb__fail(st, "%s: %s", name, ebb_last_error());
        break;
      }
      if (gf) {
        atomic_fetch_add_explicit(&gf->refs, 1, memory_order_relaxed);
        mg->nodes[i] = gf;
      } else if ((st = ebb__grad_acc(tensors[i], m, &mg->nodes[i]))) {
        st = ebb__fail(st, "%s: %s", name, ebb_last_error());
        break;
      }
    }
    mg->members[i] = (struct ebb__mg_member){mg, i};
    atomic_fetch_add_explicit(&mg->refs, 1, memory_order_relaxed);
    st = ebb__tensor_hook_add(name, tensors[i], mg_hook, &mg->members[i], mg_member_free, &mg->ids[i]);
    if (st) atomic_fetch_sub_explicit(&mg->refs, 1, memory_order_relaxed);
  }
  uint64_t id = 0;
  if (!st) {
    group->kind = EBB__HOOK_GROUP;
    group->user = mg;
    group->on_remove = mg_remove;
    group->user_free = mg_group_free;
    st = ebb__hook_attach(name, NULL, group, &id);
  }
  if (st) {
    free(group);
    mg_remove(mg);
    mg_unref(mg);
    return st;
  }
  out->id = id;
  return EBB_OK;
}

/* ---- whole-graph logging hooks -------------------------------------------------------------- */

struct ebb__log {
  _Atomic long refs; /* the group, each member hook */
  ebb_autograd_log_fn sink;
  void *user;
  uint64_t *ids;
  size_t nids, cap;
  /* The AccumulateGrads the registration made for leaf roots (no one else may hold them): held
   * until the handle is removed, so their hooks are there when a backward comes (a reference
   * cycle through the hooks, broken by the removal). */
  struct ebb_node **acc;
  int nacc;
};

static void log_unref(void *user) {
  struct ebb__log *l = user;
  if (atomic_fetch_sub_explicit(&l->refs, 1, memory_order_acq_rel) != 1) return;
  free(l->ids);
  free(l);
}

static void log_remove(void *user) {
  struct ebb__log *l = user;
  for (size_t i = 0; i < l->nids; i++) ebb__hook_remove_id(l->ids[i]);
  struct ebb_node **acc = l->acc;
  int nacc = l->nacc;
  l->acc = NULL;
  l->nacc = 0;
  for (int i = 0; i < nacc; i++) ebb__node_unref(acc[i]); /* (l lives on: the group holds it) */
  free(acc);
}

static ebb_status log_hook(const ebb_node_t *node, const ebb_tensor_t *const *grads, int ngrads, ebb_tensor_t **replace,
                                void *user) {
  (void)replace;
  struct ebb__log *l = user;
  char line[768], lb[96], sb[160];
  size_t k = (size_t)snprintf(line, sizeof line, "Executing: %s with grad_outputs: [", node_api_label(node, lb, sizeof lb));
  for (int i = 0; i < ngrads && k < sizeof line; i++) {
    ebb__tensor_meta m;
    if (grads[i]) ebb__tensor_meta_of(grads[i], &m);
    k += (size_t)snprintf(line + k, sizeof line - k, "%s%s", i ? ", " : "", grads[i] ? fmt_meta(&m, sb, sizeof sb) : "None");
  }
  if (k < sizeof line) snprintf(line + k, sizeof line - k, "]");
  if (l->sink) l->sink(line, l->user);
  else ebb__warn("autograd: %s", line);
  return EBB_OK;
}

/* A set of node addresses (open addressing), for the walk. */
struct ebb__nodeset {
  struct ebb_node **a;
  size_t cap, n;
};

static size_t nhash(const struct ebb_node *n) { return (size_t)(((uintptr_t)n >> 4) * 0x9e3779b97f4a7c15ull); }

/* Adds n: 1 if added, 0 if there already, -1 without memory. */
static int nodeset_add(struct ebb__nodeset *s, struct ebb_node *n) {
  if ((s->n + 1) * 2 > s->cap) {
    size_t nc = s->cap ? s->cap * 2 : 64;
    struct ebb_node **na = calloc(nc, sizeof *na);
    if (!na) return -1;
    for (size_t i = 0; i < s->cap; i++) {
      if (!s->a[i]) continue;
      size_t j = nhash(s->a[i]) & (nc - 1);
      while (na[j]) j = (j + 1) & (nc - 1);
      na[j] = s->a[i];
    }
    free(s->a);
    s->a = na;
    s->cap = nc;
  }
  size_t j = nhash(n) & (s->cap - 1);
  while (s->a[j] && s->a[j] != n) j = (j + 1) & (s->cap - 1);
  if (s->a[j]) return 0;
  s->a[j] = n;
  s->n++;
  return 1;
}

ebb_status ebb_autograd_register_logging_hooks(const ebb_tensor_t *const *roots, int nroots, ebb_autograd_log_fn sink, void *user,
                                               ebb_hook_handle *out) {
  static const char fn[] = "ebb_autograd_register_logging_hooks";
  if (!roots || nroots <= 0) return ebb__fail(EBB_EINVAL, "%s: %d roots (array %p); expected an array of nroots > 0 tensors", fn,
                                              nroots, (const void *)roots);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a hook handle to fill", fn);
  struct ebb_node **acc = calloc((size_t)nroots, sizeof *acc); /* AccumulateGrads made for leaf roots: dropped at the end */
  struct ebb__log *l = calloc(1, sizeof *l);
  struct ebb__hook *group = calloc(1, sizeof *group);
  struct ebb__nodeset seen = {0};
  size_t depth = 0, cap = 0;
  struct ebb_node **stack = NULL;
  ebb_status st = acc && l && group ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory", fn);
  if (!st) {
    l->sink = sink;
    l->user = user;
    atomic_store_explicit(&l->refs, 1, memory_order_relaxed); /* the group's */
  }
  for (int i = 0; !st && i < nroots; i++) {
    st = ebb__tensor_check_at(roots[i], fn, "roots", i);
    struct ebb__meta *m = st ? NULL : ebb__meta_of(roots[i]);
    char rd[EBB__DESC_MAX];
    if (!st && (!m || !m->requires_grad))
      st = ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient, so it has no graph; expected a tensor that does", fn,
                     ebb__tensor_desc(roots[i], "roots", i, rd, sizeof rd));
    if (st) break;
    struct ebb_node *r = NULL;
    int rnr;
    if ((st = ebb__grad_fn_now(roots[i], m, &r, &rnr))) { /* inplace.c: a stale view's node is its base's now */
      st = ebb__fail(st, "%s: %s", fn, ebb_last_error());
      break;
    }
    if (!r && (st = ebb__grad_acc((ebb_tensor_t *)roots[i], m, &acc[i]))) break;
    if (!r) r = acc[i];
    int added = nodeset_add(&seen, r);
    if (added < 0) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", fn);
    if (added <= 0) continue;
    /* Depth-first over next edges from this root; every node gets one hook. */
    if (depth == cap) {
      size_t nc = cap ? cap * 2 : 64;
      struct ebb_node **ns = realloc(stack, nc * sizeof *ns);
      if (!ns) {
        st = ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", fn);
        break;
      }
      stack = ns;
      cap = nc;
    }
    stack[depth++] = r;
    while (!st && depth) {
      struct ebb_node *n = stack[--depth];
      if (l->nids == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 64;
        uint64_t *ni = realloc(l->ids, nc * sizeof *ni);
        if (!ni) {
          st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the hooks' ids", fn);
          break;
        }
        l->ids = ni;
        l->cap = nc;
      }
      atomic_fetch_add_explicit(&l->refs, 1, memory_order_relaxed);
      st = node_hook_add(fn, n, EBB__HOOK_NODE_PRE, log_hook, NULL, l, log_unref, &l->ids[l->nids]);
      if (st) {
        atomic_fetch_sub_explicit(&l->refs, 1, memory_order_relaxed);
        break;
      }
      l->nids++;
      for (int e = 0; n->op >= 0 && e < n->nin && !st; e++) {
        struct ebb_node *c = n->next[e].fn;
        int a = c ? nodeset_add(&seen, c) : 0;
        if (a < 0) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", fn);
        if (a <= 0) continue;
        if (depth == cap) {
          size_t nc = cap * 2;
          struct ebb_node **ns = realloc(stack, nc * sizeof *ns);
          if (!ns) {
            st = ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", fn);
            break;
          }
          stack = ns;
          cap = nc;
        }
        stack[depth++] = c;
      }
    }
  }
  uint64_t id = 0;
  if (!st) {
    group->kind = EBB__HOOK_GROUP;
    group->user = l;
    group->on_remove = log_remove;
    group->user_free = log_unref;
    st = ebb__hook_attach(fn, NULL, group, &id);
  }
  if (st) {
    free(group);
    if (l) {
      log_remove(l);
      log_unref(l);
    }
  } else {
    out->id = id;
  }
  free(stack);
  free(seen.a);
  if (!st) { /* the handle keeps them (see struct ebb__log) */
    l->acc = acc;
    l->nacc = nroots;
    acc = NULL;
  }
  for (int i = 0; acc && i < nroots; i++) ebb__node_unref(acc[i]);
  free(acc);
  return st;
}
