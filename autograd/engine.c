/* engine.c: the backward engine on the calling thread (CPU tensors and one device).
 *
 * A graph task (one ebb_backward or ebb_grad call) finds the nodes reachable from its roots,
 * counts each node's incoming edges, marks what must run (everything, or with `inputs` only the
 * nodes on a path to one of them), and runs ready nodes in decreasing sequence number (the
 * AccumulateGrad nodes first): the order is the same on every run. Each node gets the sum of the
 * gradients its consumers sent (its input buffer), calls its derivative-table entry, and adds
 * what it returns into its producers' buffers. AccumulateGrad adds into the leaf's .grad under the
 * leaf's lock, so concurrent backward calls on shared leaves sum exactly.
 *
 * The first error ends the task: what it holds is released, the caller gets the status and a
 * message naming the failing node; the graph and the engine stay usable (with retain_graph).
 */
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/ops.h"
#include "ebb_internal.h"

/* One node of the task. */
struct ebb__tnode {
  struct ebb_node *n;
  int deps;             /* incoming edges from nodes of the task not yet run */
  bool needed;          /* runs (or, for a capture-only node, is reached) */
  bool run;             /* its backward runs (else only captured) */
  ebb_tensor_t **buf;   /* [max(nout, 1)]: summed gradients of its outputs (AccumulateGrad: [1]) */
  ebb_tensor_t *buf_inline[2]; /* buf for up to two outputs: no allocation per node */
  int capture;          /* ebb_grad: index into the results (+1), 0: none; for its input_nr */
  int capture_nr;
};

struct ebb__task {
  const char *fn;
  struct ebb__tnode *nodes; /* open addressing on the node's address */
  size_t cap, count;
  ebb_tensor_t **results;   /* ebb_grad: [ninputs] */
};

static size_t ebb__hash(const struct ebb_node *n) { return (size_t)(((uintptr_t)n >> 4) * 0x9e3779b97f4a7c15ull); }

/* The task's entry of n, added when `add`; NULL without memory (or when not found). */
static struct ebb__tnode *ebb__tfind(struct ebb__task *t, struct ebb_node *n, bool add) {
  if (add && (t->count + 1) * 2 > t->cap) {
    size_t nc = t->cap ? t->cap * 2 : 64;
    struct ebb__tnode *nn = calloc(nc, sizeof *nn);
    if (!nn) return NULL;
    for (size_t i = 0; i < t->cap; i++) {
      if (!t->nodes[i].n) continue;
      size_t j = ebb__hash(t->nodes[i].n) & (nc - 1);
      while (nn[j].n) j = (j + 1) & (nc - 1);
      nn[j] = t->nodes[i];
      if (t->nodes[i].buf == t->nodes[i].buf_inline) nn[j].buf = nn[j].buf_inline; /* (moved with it) */
    }
    free(t->nodes);
    t->nodes = nn;
    t->cap = nc;
  }
  if (!t->cap) return NULL;
  size_t j = ebb__hash(n) & (t->cap - 1);
  while (t->nodes[j].n && t->nodes[j].n != n) j = (j + 1) & (t->cap - 1);
  if (t->nodes[j].n) return &t->nodes[j];
  if (!add) return NULL;
  t->nodes[j].n = n;
  t->count++;
  return &t->nodes[j];
}

static void ebb__task_free(struct ebb__task *t) {
  for (size_t i = 0; i < t->cap; i++) {
    struct ebb__tnode *x = &t->nodes[i];
    if (!x->n || !x->buf) continue;
    int nb = x->n->nout > 0 ? x->n->nout : 1;
    for (int k = 0; k < nb; k++)
      if (x->buf[k]) ebb_tensor_release(x->buf[k]);
    if (x->buf != x->buf_inline) free(x->buf);
  }
  free(t->nodes);
}

/* Adds g (a new reference, consumed) into slot k of x's buffer. */
static ebb_status ebb__buf_add(struct ebb__tnode *x, int k, ebb_tensor_t *g) {
  int nb = x->n->nout > 0 ? x->n->nout : 1;
  if (!x->buf && nb <= 2) x->buf = x->buf_inline;
  if (!x->buf && !(x->buf = calloc((size_t)nb, sizeof *x->buf))) {
    ebb_tensor_release(g);
    return ebb__fail(EBB_ENOMEM, "no host memory for an input buffer");
  }
  if (!x->buf[k]) {
    x->buf[k] = g;
    return EBB_OK;
  }
  /* In place when nothing else sees the buffer's tensor and g has its shape and dtype. */
  ebb__tensor_meta bm;
  if (ebb__tensor_exclusive(x->buf[k]) && (ebb__tensor_meta_of(x->buf[k], &bm), ebb__tensor_matches(g, &bm))) {
    ebb_status st = ebb_op_add_(x->buf[k], g);
    ebb_tensor_release(g);
    return st;
  }
  ebb_tensor_t *sum = NULL;
  ebb_status st = ebb_op_add(x->buf[k], g, &sum);
  ebb_tensor_release(g);
  if (st) return st;
  ebb_tensor_release(x->buf[k]);
  x->buf[k] = sum;
  return EBB_OK;
}

/* ---- finding the graph -------------------------------------------------------------------- */

/* Every node reachable from the roots, with its incoming-edge count. */
static ebb_status ebb__discover(struct ebb__task *t, struct ebb_node *const *roots, int nroots) {
  size_t cap = 64, depth = 0;
  struct ebb_node **stack = malloc(cap * sizeof *stack);
  if (!stack) return ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", t->fn);
  for (int i = 0; i < nroots; i++) {
    struct ebb__tnode *x = ebb__tfind(t, roots[i], false);
    if (x) continue;
    if (!ebb__tfind(t, roots[i], true)) goto oom;
    stack[depth++] = roots[i];
    while (depth) {
      struct ebb_node *n = stack[--depth];
      for (int e = 0; n->op >= 0 && e < n->nin; e++) {
        struct ebb_node *c = n->next[e].fn;
        if (!c) continue;
        struct ebb__tnode *cx = ebb__tfind(t, c, false);
        if (!cx) {
          if (!(cx = ebb__tfind(t, c, true))) goto oom;
          if (depth == cap) {
            struct ebb_node **bigger = realloc(stack, cap * 2 * sizeof *stack);
            if (!bigger) goto oom;
            stack = bigger;
            cap *= 2;
          }
          stack[depth++] = c;
        }
        cx->deps++;
      }
    }
  }
  free(stack);
  return EBB_OK;
oom:
  free(stack);
  return ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", t->fn);
}

/* With targets: a node is needed when it is a target or one of its next edges leads to a needed
 * node; it runs when a next edge does (a capture-only target does not run). Children before
 * parents: repeated passes over the task until nothing changes would be quadratic, so this walks
 * the nodes in increasing sequence number, which puts every producer before its consumers
 * (a node's inputs existed before it), AccumulateGrad (UINT64_MAX) aside: it is a target or not. */
static int ebb__by_seq(const void *a, const void *b) {
  const struct ebb__tnode *x = *(struct ebb__tnode *const *)a, *y = *(struct ebb__tnode *const *)b;
  return x->n->seq < y->n->seq ? -1 : x->n->seq > y->n->seq;
}

static ebb_status ebb__mark_needed(struct ebb__task *t) {
  struct ebb__tnode **order = malloc((t->count ? t->count : 1) * sizeof *order);
  if (!order) return ebb__fail(EBB_ENOMEM, "%s: no host memory to order the graph", t->fn);
  size_t k = 0;
  for (size_t i = 0; i < t->cap; i++)
    if (t->nodes[i].n) order[k++] = &t->nodes[i];
  qsort(order, k, sizeof *order, ebb__by_seq);
  for (size_t i = 0; i < k; i++) {
    struct ebb__tnode *x = order[i];
    if (x->n->op < 0) continue;
    for (int e = 0; e < x->n->nin; e++) {
      struct ebb_node *c = x->n->next[e].fn;
      struct ebb__tnode *cx = c ? ebb__tfind(t, c, false) : NULL;
      if (cx && cx->needed) x->run = true;
    }
    if (x->run) x->needed = true;
  }
  free(order);
  return EBB_OK;
}

/* ---- running nodes ------------------------------------------------------------------------ */

/* A max-heap of ready nodes by sequence number. */
struct ebb__heap {
  struct ebb__tnode **a;
  size_t n, cap;
};

static bool ebb__heap_push(struct ebb__heap *h, struct ebb__tnode *x) {
  if (h->n == h->cap) {
    size_t nc = h->cap ? h->cap * 2 : 64;
    struct ebb__tnode **na = realloc(h->a, nc * sizeof *na);
    if (!na) return false;
    h->a = na;
    h->cap = nc;
  }
  size_t i = h->n++;
  while (i && h->a[(i - 1) / 2]->n->seq < x->n->seq) {
    h->a[i] = h->a[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  h->a[i] = x;
  return true;
}

static struct ebb__tnode *ebb__heap_pop(struct ebb__heap *h) {
  struct ebb__tnode *top = h->a[0], *last = h->a[--h->n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= h->n) break;
    if (c + 1 < h->n && h->a[c + 1]->n->seq > h->a[c]->n->seq) c++;
    if (h->a[c]->n->seq <= last->n->seq) break;
    h->a[i] = h->a[c];
    i = c;
  }
  if (h->n) h->a[i] = last;
  return top;
}

/* AccumulateGrad, under the leaf's lock: the first gradient becomes .grad, taken from the buffer
 * without a copy when nothing else sees it (*g set to NULL then), else copied contiguous; later
 * ones are added into .grad in place (keeping the tensor the caller may hold). */
static ebb_status ebb__accumulate(struct ebb_node *n, ebb_tensor_t **g) {
  struct ebb__meta *m = ebb__meta_of(n->leaf);
  ebb_status st = EBB_OK;
  ebb__mutex_lock(&m->grad_mu);
  bool had = m->grad != NULL;
  if (m->grad) {
    st = ebb_op_add_(m->grad, *g);
  } else if (ebb__tensor_exclusive(*g)) {
    m->grad = *g;
    *g = NULL;
  } else {
    st = ebb_tensor_clone(*g, &m->grad);
  }
  if (!st && m->grad && !had) ebb__owners_grad_new(n->leaf, m, m->grad); /* owners.c: the leaf's gradient now */
  ebb__mutex_unlock(&m->grad_mu);
  return st;
}

/* The saved tensor k of n, checked against in-place changes since it was saved. */
static ebb_status ebb__unpack(const struct ebb__task *t, const struct ebb_node *n, int k, const ebb_tensor_t **out) {
  *out = n->saved ? n->saved[k] : NULL;
  if (!*out) return EBB_OK;
  uint64_t v = 0;
  ebb_tensor_version(*out, &v);
  if (v != n->saved_version[k]) {
    bool is_out = k >= n->nin;
    return ebb__fail(EBB_ESTATE,
                     "%s: %s (node %llu) needs its saved %s %d, which was modified in place after it was saved: saved at "
                     "version %llu, now %llu; expected it unchanged until backward (clone it before changing it)",
                     t->fn, ebb__node_name_of(n), (unsigned long long)n->seq, is_out ? "output" : "input", is_out ? k - n->nin : k,
                     (unsigned long long)n->saved_version[k], (unsigned long long)v);
  }
  return EBB_OK;
}

static ebb_status ebb__run_node(struct ebb__task *t, struct ebb__tnode *x, bool retain, struct ebb__heap *ready) {
  struct ebb_node *n = x->n;
  ebb_status st = EBB_OK;
  if (x->capture && !x->run && x->buf && x->buf[x->capture_nr]) {
    /* A node only captured (not run): its tensor hooks still see the gradient first, as they
     * would before it ran (PyTorch's order for captures of nodes that do not execute). */
    struct ebb__hook *hl = n->op < 0 ? ebb__meta_of(n->leaf)->hooks : n->hooks;
    st = ebb__run_tensor_hooks(t->fn, n->op < 0 ? "a leaf" : ebb__node_name_of(n), hl, n->op < 0 ? 0 : x->capture_nr,
                               &x->buf[x->capture_nr]);
    if (st) return st;
  }
  if (x->capture && x->buf && x->buf[x->capture_nr]) { /* ebb_grad: what reached this node's input */
    ebb_tensor_retain(x->buf[x->capture_nr]);
    t->results[x->capture - 1] = x->buf[x->capture_nr];
  }
  if (!x->run) return EBB_OK;
  if (n->op < 0) {
    if (!x->buf || !x->buf[0]) return EBB_OK;
    struct ebb__meta *lm = ebb__meta_of(n->leaf);
    st = ebb__run_tensor_hooks(t->fn, "a leaf (its AccumulateGrad)", lm->hooks, 0, &x->buf[0]);
    if (st) return st;
    st = ebb__accumulate(n, &x->buf[0]);
    if (st) return ebb__fail(st, "%s: AccumulateGrad failed: %s", t->fn, ebb_last_error());
    return ebb__run_post_acc_hooks(t->fn, lm->hooks, n->leaf);
  }
  for (int k = 0; n->hooks && x->buf && k < n->nout && !st; k++)
    st = ebb__run_tensor_hooks(t->fn, ebb__node_name_of(n), n->hooks, k, &x->buf[k]);
  if (st) return st;
  const ebb__deriv *e = ebb__deriv_of((ebb__op_id)n->op);
  bool any = false;
  for (int k = 0; x->buf && k < n->nout; k++) any |= x->buf[k] != NULL;
  bool need_small[8] = {false}, *need = n->nin <= 8 ? need_small : calloc((size_t)n->nin, sizeof *need);
  ebb_tensor_t *gin_small[8] = {NULL}, **gin = n->nin <= 8 ? gin_small : calloc((size_t)n->nin, sizeof *gin);
  const ebb_tensor_t *saved_small[10] = {NULL}, **saved = n->nin + n->nout <= 10 ? saved_small : calloc((size_t)(n->nin + n->nout), sizeof *saved);
  if (!gin || !saved || !need) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to run %s", t->fn, ebb__node_name_of(n));
  if (!st && any && e->backward) {
    if (atomic_load_explicit(&n->freed_saved, memory_order_acquire) && e->save)
      st = ebb__fail(EBB_ESTATE, "%s: %s (node %llu) needs its saved tensors, freed by an earlier backward through this graph; "
                     "expected retain_graph on that backward to go through the graph again",
                     t->fn, ebb__node_name_of(n), (unsigned long long)n->seq);
    for (int k = 0; !st && k < n->nin + n->nout; k++) st = ebb__unpack(t, n, k, &saved[k]);
    for (int i = 0; !st && i < n->nin; i++) {
      struct ebb_node *c = n->next[i].fn;
      struct ebb__tnode *cx = c ? ebb__tfind(t, c, false) : NULL;
      need[i] = cx && cx->needed;
    }
    if (!st) {
      const ebb__bw_ctx ctx = {&n->args, n->in_meta, saved, saved + n->nin, n->nin, need};
      const ebb_tensor_t *go[2] = {x->buf[0], n->nout > 1 ? x->buf[1] : NULL};
      st = e->backward(&ctx, go, gin);
      if (st) st = ebb__fail(st, "%s: %s (node %llu) failed: %s", t->fn, ebb__node_name_of(n), (unsigned long long)n->seq, ebb_last_error());
    }
    /* Every gradient in its input's shape, dtype and device (validate_outputs' check). */
    for (int i = 0; !st && i < n->nin; i++) {
      if (!gin[i] || ebb__tensor_matches(gin[i], &n->in_meta[i])) continue;
      ebb_tensor_info gi;
      const ebb__tensor_meta *m = &n->in_meta[i];
      st = ebb_tensor_get_info(gin[i], &gi);
      if (!st)
        st = ebb__fail(EBB_EINTERNAL, "%s: %s (node %llu) returned a gradient for input %d with %d dims, %s, device %d; expected %d "
                       "dims, %s, device %d", t->fn, ebb__node_name_of(n), (unsigned long long)n->seq, i, gi.ndim,
                       ebb_dtype_name(gi.dtype), gi.device, m->ndim, ebb_dtype_name(m->dtype), m->device);
    }
  }
  /* Deliver (and count down the producers' dependencies, gradient or not). */
  for (int i = 0; gin && i < n->nin; i++) {
    struct ebb_node *c = n->next[i].fn;
    struct ebb__tnode *cx = c ? ebb__tfind(t, c, false) : NULL;
    if (!cx) {
      if (gin[i]) ebb_tensor_release(gin[i]);
      continue;
    }
    if (!st && gin[i]) st = ebb__buf_add(cx, n->next[i].input_nr, gin[i]);
    else if (gin[i]) ebb_tensor_release(gin[i]);
    if (--cx->deps == 0 && cx->needed && !st && !ebb__heap_push(ready, cx))
      st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue", t->fn);
  }
  if (gin != gin_small) free(gin);
  if (saved != saved_small) free(saved);
  if (need != need_small) free(need);
  if (!st && !retain && n->saved && !atomic_exchange_explicit(&n->freed_saved, true, memory_order_acq_rel))
    for (int k = 0; k < n->nin + n->nout; k++)
      if (n->saved[k]) ebb__owners_saved_drop(n, k); /* (owners.c: its block's owner back) */
  return st;
}

/* ---- the calls -------------------------------------------------------------------------------- */

/* The edge a root's gradient enters the graph through: its grad_fn and output, or a leaf's
 * AccumulateGrad (a new reference in *acc to drop after the task). */
static ebb_status ebb__root_edge(const char *fn, const char *what, int i, const ebb_tensor_t *r, struct ebb_node **node, int *nr,
                                 struct ebb_node **acc) {
  ebb_status st = ebb__tensor_check(r, fn, what);
  if (st) return st;
  struct ebb__meta *m = ebb__meta_of(r);
  *acc = NULL;
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s[%d] does not require a gradient and has no grad_fn; expected a tensor computed from one "
                     "that requires a gradient", fn, what, i);
  if (m->grad_fn) {
    *node = m->grad_fn;
    *nr = m->output_nr;
    return EBB_OK;
  }
  st = ebb__grad_acc((ebb_tensor_t *)r, m, acc);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  *node = *acc;
  *nr = 0;
  return EBB_OK;
}

/* The gradient a root starts with: the caller's (checked against the root) or 1 for a tensor of
 * one element; a new reference. */
static ebb_status ebb__root_grad(const char *fn, int i, const ebb_tensor_t *r, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb_tensor_info ri, gi;
  ebb_status st = ebb_tensor_get_info(r, &ri);
  if (st) return st;
  if (!g) {
    if (ri.numel != 1)
      return ebb__fail(EBB_EINVAL, "%s: root %d has %lld elements and no gradient was given; a gradient is implied only for a "
                       "tensor of one element (pass grad_roots[%d])", fn, i, (long long)ri.numel, i);
    return ebb_tensor_ones(ri.device, ri.dtype, ri.ndim, ri.shape, out);
  }
  st = ebb__tensor_check(g, fn, "grad_roots[i]");
  if (!st) st = ebb_tensor_get_info(g, &gi);
  if (st) return st;
  bool same = gi.ndim == ri.ndim && memcmp(gi.shape, ri.shape, sizeof(int64_t) * (size_t)ri.ndim) == 0;
  if (!same || gi.dtype != ri.dtype || gi.device != ri.device)
    return ebb__fail(EBB_EINVAL, "%s: grad_roots[%d] (%d dims, %s, device %d) does not match root %d (%d dims, %s, device %d); "
                     "expected the root's shape, dtype and device", fn, i, gi.ndim, ebb_dtype_name(gi.dtype), gi.device, i, ri.ndim,
                     ebb_dtype_name(ri.dtype), ri.device);
  ebb_tensor_retain((ebb_tensor_t *)g);
  *out = (ebb_tensor_t *)g;
  return EBB_OK;
}

static ebb_status ebb__execute(const char *fn, const ebb_tensor_t *const *roots, const ebb_tensor_t *const *grad_roots, int nroots,
                               bool retain, const ebb_tensor_t *const *inputs, int ninputs, bool accumulate, bool allow_unused,
                               ebb_tensor_t **results) {
  if (!roots || nroots <= 0) return ebb__fail(EBB_EINVAL, "%s: no roots; expected at least one tensor to differentiate", fn);
  if (ninputs < 0 || (ninputs > 0 && !inputs)) return ebb__fail(EBB_EINVAL, "%s: %d inputs and no inputs array", fn, ninputs);
  if (!accumulate && (!inputs || ninputs == 0)) return ebb__fail(EBB_EINVAL, "%s: no inputs; expected the tensors to differentiate with respect to", fn);
  struct ebb__task t = {.fn = fn, .results = results};
  struct ebb_node **rn = calloc((size_t)nroots, sizeof *rn), **racc = calloc((size_t)nroots, sizeof *racc);
  int *rnr = calloc((size_t)nroots, sizeof *rnr);
  ebb_tensor_t **rg = calloc((size_t)nroots, sizeof *rg);
  int *dup = calloc((size_t)(ninputs > 0 ? ninputs : 1), sizeof *dup);
  struct ebb__heap ready = {0};
  bool was;
  ebb_status st = rn && racc && rnr && rg && dup ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory for %d roots", fn, nroots);
  for (int i = 0; dup && i < ninputs; i++) dup[i] = -1;
  for (int i = 0; !st && i < nroots; i++) st = ebb__root_edge(fn, "roots", i, roots[i], &rn[i], &rnr[i], &racc[i]);
  for (int i = 0; !st && i < nroots; i++) st = ebb__root_grad(fn, i, roots[i], grad_roots ? grad_roots[i] : NULL, &rg[i]);
  if (!st) st = ebb__discover(&t, rn, nroots);
  /* Targets: every node (no inputs), or the inputs' edges. */
  for (int i = 0; !st && i < ninputs; i++) {
    st = ebb__tensor_check(inputs[i], fn, "inputs[i]");
    struct ebb__meta *m = st ? NULL : ebb__meta_of(inputs[i]);
    if (!st && (!m || !m->requires_grad))
      st = ebb__fail(EBB_EINVAL, "%s: inputs[%d] does not require a gradient; expected a tensor that does", fn, i);
    if (st) break;
    struct ebb_node *in = m->grad_fn;
    if (!in) in = ebb__grad_acc_peek(m); /* (under the lock its writers take) */
    int nr = m->grad_fn ? m->output_nr : 0;
    struct ebb__tnode *x = in ? ebb__tfind(&t, in, false) : NULL;
    if (!x) {
      if (!accumulate && !allow_unused)
        st = ebb__fail(EBB_EINVAL, "%s: inputs[%d] was not used to compute the roots; expected allow_unused to get no gradient for it", fn, i);
      continue;
    }
    x->needed = true;
    if (accumulate && !m->grad_fn) x->run = true; /* backward(inputs): the leaf's AccumulateGrad */
    else if (accumulate) st = ebb__fail(EBB_ENOTSUP, "%s: inputs[%d] is not a leaf; backward with non-leaf inputs is not supported yet", fn, i);
    else if (x->capture && x->capture_nr == nr) {
      dup[i] = x->capture - 1; /* the same input again: the same gradient, copied after the run */
    } else if (x->capture) {
      st = ebb__fail(EBB_ENOTSUP, "%s: inputs[%d] and inputs[%d] are two outputs of one node (%s); asking for both in one call is "
                     "not supported yet", fn, x->capture - 1, i, ebb__node_name_of(in));
    } else {
      x->capture = i + 1;
      x->capture_nr = nr;
    }
  }
  if (!st && ninputs == 0)
    for (size_t i = 0; i < t.cap; i++)
      if (t.nodes[i].n) t.nodes[i].needed = t.nodes[i].run = true;
  if (!st && ninputs > 0) st = ebb__mark_needed(&t);
  ebb_grad_set_enabled(false, &was); /* no graph of the backward (create_graph is not supported) */
  for (int i = 0; !st && i < nroots; i++) {
    struct ebb__tnode *x = ebb__tfind(&t, rn[i], false);
    st = ebb__buf_add(x, rnr[i], rg[i]);
    rg[i] = NULL;
  }
  for (size_t i = 0; !st && i < t.cap; i++)
    if (t.nodes[i].n && t.nodes[i].deps == 0 && t.nodes[i].needed && !ebb__heap_push(&ready, &t.nodes[i]))
      st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue", fn);
  while (!st && ready.n) {
    struct ebb__tnode *x = ebb__heap_pop(&ready);
    bool owned = ebb__owners_enter(x->n); /* owners.c: what the node allocates is its own */
    st = ebb__run_node(&t, x, retain, &ready);
    ebb__owners_leave(owned);
    /* Its gradients are used up: freed now, not at the task's end (a backward holds only the
     * buffers of nodes still waiting), and so a producer that got g itself may take the next sum
     * into it in place. */
    int nb = x->n->nout > 0 ? x->n->nout : 1;
    for (int k = 0; x->buf && k < nb; k++)
      if (x->buf[k]) {
        ebb_tensor_release(x->buf[k]);
        x->buf[k] = NULL;
      }
  }
  for (int i = 0; !st && results && i < ninputs; i++)
    if (dup[i] >= 0 && results[dup[i]]) {
      ebb_tensor_retain(results[dup[i]]);
      results[i] = results[dup[i]];
    }
  ebb_grad_set_enabled(was, NULL);
  for (int i = 0; rg && racc && i < nroots; i++) {
    if (rg[i]) ebb_tensor_release(rg[i]);
    ebb__node_unref(racc[i]);
  }
  free(rn);
  free(dup);
  free(racc);
  free(rnr);
  free(rg);
  free(ready.a);
  ebb__task_free(&t);
  if (st && results)
    for (int i = 0; i < ninputs; i++)
      if (results[i]) {
        ebb_tensor_release(results[i]);
        results[i] = NULL;
      }
  return st;
}

ebb_status ebb_backward(const ebb_tensor_t *const *roots, const ebb_tensor_t *const *grad_roots, int nroots, bool retain_graph,
                        const ebb_tensor_t *const *inputs, int ninputs) {
  return ebb__execute("ebb_backward", roots, grad_roots, nroots, retain_graph, inputs, ninputs, true, false, NULL);
}

ebb_status ebb_grad(const ebb_tensor_t *const *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                    const ebb_tensor_t *const *inputs, int ninputs, bool retain_graph, bool allow_unused, ebb_tensor_t **grads) {
  if (!grads) return ebb__fail(EBB_EINVAL, "ebb_grad: grads is NULL; expected an array of ninputs handles to fill");
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return ebb__execute("ebb_grad", outputs, grad_outputs, noutputs, retain_graph, inputs, ninputs, false, allow_unused, grads);
}

ebb_status ebb_tensor_grad(const ebb_tensor_t *t, ebb_tensor_t **out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_grad", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_grad: out is NULL; expected a tensor handle to fill");
  struct ebb__meta *m = ebb__meta_of(t);
  *out = NULL;
  if (!m) return EBB_OK;
  ebb__mutex_lock(&m->grad_mu);
  if (m->grad) {
    ebb_tensor_retain(m->grad);
    *out = m->grad;
  }
  ebb__mutex_unlock(&m->grad_mu);
  return EBB_OK;
}

ebb_status ebb_tensor_set_grad(ebb_tensor_t *t, const ebb_tensor_t *grad) {
  static const char fn[] = "ebb_tensor_set_grad";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (!st && grad) st = ebb__tensor_check(grad, fn, "grad");
  if (st) return st;
  struct ebb__meta *m = ebb__meta_of(t);
  ebb_tensor_t *copy = NULL;
  if (grad) {
    ebb_tensor_info ti, gi;
    ebb_tensor_get_info(t, &ti);
    ebb_tensor_get_info(grad, &gi);
    bool same = gi.ndim == ti.ndim && memcmp(gi.shape, ti.shape, sizeof(int64_t) * (size_t)ti.ndim) == 0;
    if (!same || gi.dtype != ti.dtype || gi.device != ti.device)
      return ebb__fail(EBB_EINVAL, "%s: grad (%d dims, %s, device %d) does not match the tensor (%d dims, %s, device %d); expected "
                       "its shape, dtype and device", fn, gi.ndim, ebb_dtype_name(gi.dtype), gi.device, ti.ndim, ebb_dtype_name(ti.dtype),
                       ti.device);
    if (!m && !(m = ebb__meta_new(t))) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the tensor's autograd state", fn);
    ebb_tensor_retain((ebb_tensor_t *)grad);
    copy = (ebb_tensor_t *)grad;
  }
  if (!m) return EBB_OK;
  ebb__mutex_lock(&m->grad_mu);
  ebb_tensor_t *old = m->grad;
  m->grad = copy;
  ebb__mutex_unlock(&m->grad_mu);
  if (old) ebb_tensor_release(old);
  return EBB_OK;
}
