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

/* One node of the task. Task nodes live in one array and are named by their index: the array
 * grows while the graph is found, and indices survive that where pointers would not. */
struct ebb__tnode {
  struct ebb_node *n;
  int deps;             /* incoming edges from nodes of the task not yet run */
  int edge0;            /* its next edges' task indices start at task.edges[edge0] (-1: none) */
  bool needed;          /* runs (or, for a capture-only node, is reached) */
  bool run;             /* its backward runs (else only captured) */
  int capture;          /* index of the input whose gradient this is (+1), 0: none; for its input_nr */
  int capture_nr;
  ebb_tensor_t *buf_inline[2]; /* summed gradients of its outputs, for up to two (AccumulateGrad: [0]) */
  ebb_tensor_t **buf_heap;     /* the same for a node of more outputs, allocated on first use */
};

struct ebb__task {
  const char *fn;
  struct ebb__tnode *nodes; /* [count] of cap */
  size_t cap, count;
  int *hash;                /* open addressing on the node's address: index + 1, 0 empty */
  size_t hcap;
  int *edges;               /* the next edges of every task node, as task indices (-1: not in the task) */
  size_t nedges, capedges;
  struct ebb_node **held;   /* references the task took (nodes found from its inputs), dropped at its end */
  size_t nheld, capheld;
  ebb_tensor_t **results;   /* ebb_grad: [ninputs]; NULL: ebb_backward, whose non-leaf inputs get .grad */
  const ebb_tensor_t *const *inputs;
};

/* The next edges a node has in the graph walk (AccumulateGrad has none). */
static int ebb__nedges(const struct ebb_node *n) { return n->op < 0 ? 0 : n->nin; }

/* The input buffer of task node x: one slot per output (AccumulateGrad: one); NULL when x has
 * more than two outputs and none has a gradient yet. */
static ebb_tensor_t **ebb__bufs(struct ebb__tnode *x) { return x->n->nout > 2 ? x->buf_heap : x->buf_inline; }
static int ebb__nbufs(const struct ebb__tnode *x) { return x->n->nout > 0 ? x->n->nout : 1; }

static size_t ebb__hash(const struct ebb_node *n) { return (size_t)(((uintptr_t)n >> 4) * 0x9e3779b97f4a7c15ull); }

/* The task index of n, or -1. */
static int ebb__tfind(const struct ebb__task *t, const struct ebb_node *n) {
  if (!t->hcap) return -1;
  for (size_t j = ebb__hash(n) & (t->hcap - 1);; j = (j + 1) & (t->hcap - 1)) {
    int i = t->hash[j] - 1;
    if (i < 0 || t->nodes[i].n == n) return i;
  }
}

/* The task index of n, added (deps 0, nothing marked) if it is not there; *added says which.
 * -1 without memory. */
static int ebb__tadd(struct ebb__task *t, struct ebb_node *n, bool *added) {
  *added = false;
  int i = ebb__tfind(t, n);
  if (i >= 0) return i;
  if (t->count == t->cap) {
    size_t nc = t->cap ? t->cap * 2 : 64;
    struct ebb__tnode *nn = realloc(t->nodes, nc * sizeof *nn);
    if (!nn) return -1;
    t->nodes = nn;
    t->cap = nc;
  }
  if ((t->count + 1) * 2 > t->hcap) { /* at most half full: short probes */
    size_t nc = t->hcap ? t->hcap * 2 : 128;
    int *nh = calloc(nc, sizeof *nh);
    if (!nh) return -1;
    for (size_t k = 0; k < t->count; k++) {
      size_t j = ebb__hash(t->nodes[k].n) & (nc - 1);
      while (nh[j]) j = (j + 1) & (nc - 1);
      nh[j] = (int)k + 1;
    }
    free(t->hash);
    t->hash = nh;
    t->hcap = nc;
  }
  size_t j = ebb__hash(n) & (t->hcap - 1);
  while (t->hash[j]) j = (j + 1) & (t->hcap - 1);
  i = (int)t->count++;
  t->hash[j] = i + 1;
  t->nodes[i] = (struct ebb__tnode){.n = n, .edge0 = -1};
  *added = true;
  return i;
}

static void ebb__task_free(struct ebb__task *t) {
  for (size_t i = 0; i < t->count; i++) {
    struct ebb__tnode *x = &t->nodes[i];
    ebb_tensor_t **b = ebb__bufs(x);
    for (int k = 0; b && k < ebb__nbufs(x); k++)
      if (b[k]) ebb_tensor_release(b[k]);
    free(x->buf_heap);
  }
  free(t->nodes);
  free(t->hash);
  free(t->edges);
  for (size_t i = 0; i < t->nheld; i++) ebb__node_unref(t->held[i]); /* (after: the loop above reads them) */
  free(t->held);
}

/* Adds g (a new reference, consumed) into slot k of x's buffer. */
static ebb_status ebb__buf_add(struct ebb__tnode *x, int k, ebb_tensor_t *g) {
  if (x->n->nout > 2 && !x->buf_heap && !(x->buf_heap = calloc((size_t)x->n->nout, sizeof *x->buf_heap))) {
    ebb_tensor_release(g);
    return ebb__fail(EBB_ENOMEM, "no host memory for an input buffer");
  }
  ebb_tensor_t **b = ebb__bufs(x);
  if (!b[k]) {
    b[k] = g;
    return EBB_OK;
  }
  /* In place when nothing else sees one of the two and they have one shape and dtype: into the
   * buffer's tensor, or into g, which then becomes the buffer. */
  ebb__tensor_meta bm;
  ebb__tensor_meta_of(b[k], &bm);
  if (ebb__tensor_matches(g, &bm)) {
    if (ebb__tensor_exclusive(b[k])) {
      ebb_status st = ebb__lean_add_(b[k], g);
      ebb_tensor_release(g);
      return st;
    }
    if (ebb__tensor_exclusive(g)) {
      ebb_status st = ebb__lean_add_(g, b[k]);
      ebb_tensor_release(st ? g : b[k]);
      if (!st) b[k] = g;
      return st;
    }
  }
  ebb_tensor_t *sum = NULL;
  ebb_status st = ebb_op_add(b[k], g, &sum);
  ebb_tensor_release(g);
  if (st) return st;
  ebb_tensor_release(b[k]);
  b[k] = sum;
  return EBB_OK;
}

/* ---- finding the graph -------------------------------------------------------------------- */

/* Every node reachable from the roots, with its incoming-edge count and its next edges as task
 * indices (so running the task never looks a node up again), all marked to run.
 *
 * With `within` (a partial backward), only the nodes already in the task are walked: those found
 * from the inputs by ebb__find_from_inputs, each of which leads to an input. A node reached from
 * the roots is needed; it runs when one of its next edges leads to a node of the task (a target
 * none of whose edges does is only captured); its dependencies count the reached nodes' edges. */
static ebb_status ebb__discover(struct ebb__task *t, struct ebb_node *const *roots, int nroots, bool within) {
  size_t cap = 64, depth = 0;
  int *stack = malloc(cap * sizeof *stack);
  if (!stack) return ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", t->fn);
  for (int r = 0; r < nroots; r++) {
    bool added = false;
    int ri = within ? ebb__tfind(t, roots[r]) : ebb__tadd(t, roots[r], &added);
    if (within && (ri < 0 || t->nodes[ri].needed)) continue; /* a root that leads to no input, or seen */
    if (ri < 0) goto oom;
    if (!within && !added) continue;
    t->nodes[ri].needed = true;
    stack[depth++] = ri;
    while (depth) {
      int i = stack[--depth];
      struct ebb_node *n = t->nodes[i].n;
      int ne = ebb__nedges(n);
      if (t->nedges + (size_t)ne > t->capedges) {
        size_t nc = t->capedges ? t->capedges * 2 : 256;
        while (nc < t->nedges + (size_t)ne) nc *= 2;
        int *bigger = realloc(t->edges, nc * sizeof *bigger);
        if (!bigger) goto oom;
        t->edges = bigger;
        t->capedges = nc;
      }
      t->nodes[i].edge0 = (int)t->nedges;
      t->nedges += (size_t)ne;
      for (int e = 0; e < ne; e++) {
        struct ebb_node *c = n->next[e].fn;
        int ci = -1;
        bool fresh = false;
        if (c && within) {
          if ((ci = ebb__tfind(t, c)) >= 0) {
            fresh = !t->nodes[ci].needed;
            t->nodes[ci].needed = true;
            t->nodes[i].run = true;
          }
        } else if (c) {
          if ((ci = ebb__tadd(t, c, &fresh)) < 0) goto oom;
          if (fresh) t->nodes[ci].needed = true;
        }
        if (fresh) {
          if (depth == cap) {
            int *bigger = realloc(stack, cap * 2 * sizeof *stack);
            if (!bigger) goto oom;
            stack = bigger;
            cap *= 2;
          }
          stack[depth++] = ci;
        }
        if (ci >= 0) t->nodes[ci].deps++;
        t->edges[t->nodes[i].edge0 + e] = ci;
      }
    }
  }
  if (!within)
    for (size_t i = 0; i < t->count; i++) t->nodes[i].run = true;
  free(stack);
  return EBB_OK;
oom:
  free(stack);
  return ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", t->fn);
}

/* Room for one more reference the task keeps (held, dropped at its end). */
static bool ebb__hold_room(struct ebb__task *t) {
  if (t->nheld < t->capheld) return true;
  size_t nc = t->capheld ? t->capheld * 2 : 64;
  struct ebb_node **bigger = realloc(t->held, nc * sizeof *bigger);
  if (!bigger) return false;
  t->held = bigger;
  t->capheld = nc;
  return true;
}

/* A partial backward's nodes: every node that leads to one of the inputs' nodes `from` (they
 * included), found by walking consumer edges up from them, each held by the task. Its cost grows
 * with the nodes between the inputs and the roots, not with the roots' whole graph. A consumer
 * made after the last root (sequence number above `maxseq`) cannot be in the roots' graph (a
 * node's producers are older than it) and is not followed, so graphs recorded later on the same
 * leaves cost nothing; older live graphs that use the inputs are walked. */
static ebb_status ebb__find_from_inputs(struct ebb__task *t, struct ebb_node *const *from, int nfrom, uint64_t maxseq) {
  struct ebb_node **found = NULL;
  size_t nfound = 0, capfound = 0, done = 0;
  ebb_status st = EBB_OK;
  for (int i = 0; i < nfrom && !st; i++) {
    bool added;
    if (!from[i]) continue;
    if (ebb__tadd(t, from[i], &added) < 0) st = EBB_ENOMEM;
    else if (added) {
      if (nfound == capfound) {
        size_t nc = capfound ? capfound * 2 : 64;
        struct ebb_node **bigger = realloc(found, nc * sizeof *bigger);
        if (!bigger) {
          st = EBB_ENOMEM;
          break;
        }
        found = bigger;
        capfound = nc;
      }
      found[nfound++] = from[i]; /* (the caller holds the inputs' nodes) */
    }
  }
  /* found[done..nfound) are the nodes whose consumers are still to read; each consumer comes
   * with a reference: kept by the task when it is new, dropped when it was there already. */
  while (!st && done < nfound) {
    size_t before = nfound;
    st = ebb__consumers_get(found[done++], &found, &nfound, &capfound);
    size_t keep = before;
    for (size_t k = before; k < nfound; k++) {
      struct ebb_node *c = found[k];
      bool added = false;
      if (!st && c->seq <= maxseq && (!ebb__hold_room(t) || ebb__tadd(t, c, &added) < 0)) st = EBB_ENOMEM;
      if (added) {
        t->held[t->nheld++] = c;
        found[keep++] = c;
      } else {
        ebb__node_unref(c);
      }
    }
    nfound = keep;
  }
  free(found);
  return st ? ebb__fail(EBB_ENOMEM, "%s: no host memory to find the nodes that lead to the inputs", t->fn) : EBB_OK;
}

/* ---- running nodes ------------------------------------------------------------------------ */

/* A max-heap of ready task nodes by sequence number (the number kept beside the index, so a
 * comparison does not chase the node). */
struct ebb__ready {
  uint64_t seq;
  int i;
};
struct ebb__heap {
  struct ebb__ready *a;
  size_t n, cap;
};

static bool ebb__heap_push(struct ebb__heap *h, const struct ebb__task *t, int i) {
  if (h->n == h->cap) {
    size_t nc = h->cap ? h->cap * 2 : 64;
    struct ebb__ready *na = realloc(h->a, nc * sizeof *na);
    if (!na) return false;
    h->a = na;
    h->cap = nc;
  }
  struct ebb__ready x = {t->nodes[i].n->seq, i};
  size_t k = h->n++;
  while (k && h->a[(k - 1) / 2].seq < x.seq) {
    h->a[k] = h->a[(k - 1) / 2];
    k = (k - 1) / 2;
  }
  h->a[k] = x;
  return true;
}

static int ebb__heap_pop(struct ebb__heap *h) {
  struct ebb__ready top = h->a[0], last = h->a[--h->n];
  size_t k = 0;
  for (;;) {
    size_t c = 2 * k + 1;
    if (c >= h->n) break;
    if (c + 1 < h->n && h->a[c + 1].seq > h->a[c].seq) c++;
    if (h->a[c].seq <= last.seq) break;
    h->a[k] = h->a[c];
    k = c;
  }
  if (h->n) h->a[k] = last;
  return top.i;
}

/* AccumulateGrad, under the leaf's lock: the first gradient becomes .grad, taken from the buffer
 * without a copy when nothing else sees it (*g set to NULL then), else copied contiguous; later
 * ones are added into .grad in place (keeping the tensor the caller may hold). */
static ebb_status ebb__accumulate(struct ebb_node *n, ebb_tensor_t **g) {
  struct ebb__meta *m = ebb__meta_of(n->leaf);
  ebb_status st = EBB_OK;
  ebb__mutex_lock(&m->grad_mu);
  if (m->grad) {
    st = ebb_op_add_(m->grad, *g);
  } else if (ebb__tensor_exclusive(*g)) {
    m->grad = *g;
    *g = NULL;
    ebb__owners_grad_new(n->leaf, m, m->grad); /* owners.c: the buffer is the leaf's gradient now */
  } else {
    bool named = ebb__owners_grad_enter(n->leaf, m); /* owners.c: the copy is the gradient's from the start */
    st = ebb_tensor_clone(*g, &m->grad);
    ebb__owners_leave(named);
    if (!st && !named) ebb__owners_grad_new(n->leaf, m, m->grad);
  }
  ebb__mutex_unlock(&m->grad_mu);
  return st;
}

/* A non-leaf input of ebb_backward (meta m): g added into its .grad, a copy the first time. */
static ebb_status ebb__accumulate_into(struct ebb__meta *m, const ebb_tensor_t *g) {
  ebb__mutex_lock(&m->grad_mu);
  ebb_status st = m->grad ? ebb_op_add_(m->grad, g) : ebb_tensor_clone(g, &m->grad);
  ebb__mutex_unlock(&m->grad_mu);
  return st;
}

/* Whether non-leaf m keeps its gradient through retain_grad (its hook adds into .grad). */
static bool ebb__retained(const struct ebb__meta *m) { return m->retain && !atomic_load(&m->retain->removed); }

/* A node's saved tensors are read and released under one of 16 locks chosen by its address, so
 * backward calls on other threads sharing the node (retain_graph on all but the last) never read
 * a saved tensor another one is releasing. The lock is held for the references, not the math. */
#define EBB__SM(i) {PTHREAD_MUTEX_INITIALIZER, "autograd.saved", EBB_RANK_LEAF}
#define EBB__SM4(i) EBB__SM(i), EBB__SM(i), EBB__SM(i), EBB__SM(i)
static ebb_mutex ebb__saved_mu[16] = {EBB__SM4(0), EBB__SM4(1), EBB__SM4(2), EBB__SM4(3)};
static ebb_mutex *ebb__saved_lock(const struct ebb_node *n) { return &ebb__saved_mu[((uintptr_t)n >> 7) & 15]; }

/* The saved tensor k of n (a new reference in *out, NULL when none), checked against in-place
 * changes since it was saved. Saved lock held. */
static ebb_status ebb__unpack(const struct ebb__task *t, const struct ebb_node *n, int k, const ebb_tensor_t **out) {
  *out = n->saved ? n->saved[k] : NULL;
  if (!*out) return EBB_OK;
  ebb_tensor_retain((ebb_tensor_t *)*out);
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
  ebb_tensor_t **buf = ebb__bufs(x);
  ebb_status st = EBB_OK;
  if (x->capture && !x->run && buf && buf[x->capture_nr]) {
    /* A node only captured (not run): its tensor hooks still see the gradient first, as they
     * would before it ran (PyTorch's order for captures of nodes that do not execute). */
    struct ebb__hook *hl = n->op < 0 ? ebb__meta_of(n->leaf)->hooks : n->hooks;
    st = ebb__run_tensor_hooks(t->fn, n->op < 0 ? "a leaf" : ebb__node_name_of(n), hl, n->op < 0 ? 0 : x->capture_nr,
                               &buf[x->capture_nr]);
    if (st) return st;
  }
  if (x->capture && buf && buf[x->capture_nr]) { /* what reached this node's input: ebb_grad's result, or .grad */
    if (t->results) {
      ebb_tensor_retain(buf[x->capture_nr]);
      t->results[x->capture - 1] = buf[x->capture_nr];
    } else if (ebb__retained(ebb__meta_of(t->inputs[x->capture - 1]))) {
      /* retain_grad's hook (run with this node's tensor hooks) puts the gradient into .grad: once */
    } else if ((st = ebb__accumulate_into(ebb__meta_of(t->inputs[x->capture - 1]), buf[x->capture_nr]))) {
      return ebb__fail(st, "%s: adding the gradient of inputs[%d] (a non-leaf, output %d of %s) into its .grad failed: %s", t->fn,
                       x->capture - 1, x->capture_nr, ebb__node_name_of(n), ebb_last_error());
    }
  }
  if (!x->run) return EBB_OK;
  if (n->op < 0) {
    if (!buf[0]) return EBB_OK;
    struct ebb__meta *lm = ebb__meta_of(n->leaf);
    st = ebb__run_tensor_hooks(t->fn, "a leaf (its AccumulateGrad)", lm->hooks, 0, &buf[0]);
    if (st) return st;
    /* node_api.c: the node's pre-hooks, and the gradient its post-hooks see (kept, so not stolen). */
    bool nh = atomic_load_explicit(&n->has_node_hooks, memory_order_acquire);
    if (nh && (st = ebb__node_pre_hooks(t->fn, n, buf, 1))) return st;
    ebb_tensor_t *seen = nh ? buf[0] : NULL;
    if (seen) ebb_tensor_retain(seen);
    st = ebb__accumulate(n, &buf[0]);
    if (st) st = ebb__fail(st, "%s: AccumulateGrad failed: %s", t->fn, ebb_last_error());
    if (!st) st = ebb__run_post_acc_hooks(t->fn, lm->hooks, n->leaf);
    if (!st && nh) st = ebb__node_post_hooks(t->fn, n, NULL, 0, &seen, 1);
    if (seen) ebb_tensor_release(seen);
    return st;
  }
  for (int k = 0; n->hooks && buf && k < n->nout && !st; k++)
    st = ebb__run_tensor_hooks(t->fn, ebb__node_name_of(n), n->hooks, k, &buf[k]);
  if (st) return st;
  bool nh = atomic_load_explicit(&n->has_node_hooks, memory_order_acquire); /* node_api.c */
  if (nh && (st = ebb__node_pre_hooks(t->fn, n, buf, n->nout))) return st;
  const ebb__deriv *e = ebb__deriv_of((ebb__op_id)n->op);
  const int *edges = t->edges + x->edge0;
  bool any = false;
  for (int k = 0; buf && k < n->nout; k++) any |= buf[k] != NULL;
  bool need_small[8] = {false}, *need = n->nin <= 8 ? need_small : calloc((size_t)n->nin, sizeof *need);
  ebb_tensor_t *gin_small[8] = {NULL}, **gin = n->nin <= 8 ? gin_small : calloc((size_t)n->nin, sizeof *gin);
  const ebb_tensor_t *saved_small[10] = {NULL}, **saved = n->nin + n->nout <= 10 ? saved_small : calloc((size_t)(n->nin + n->nout), sizeof *saved);
  if (!gin || !saved || !need) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to run %s", t->fn, ebb__node_name_of(n));
  if (!st && any && e->backward) {
    if (n->saved) ebb__mutex_lock(ebb__saved_lock(n)); /* (a node that saves nothing has nothing to guard) */
    if (atomic_load_explicit(&n->freed_saved, memory_order_acquire) && e->save)
      st = ebb__fail(EBB_ESTATE, "%s: %s (node %llu) needs its saved tensors, freed by an earlier backward through this graph; "
                     "expected retain_graph on that backward (or on every backward but the last, when several threads share "
                     "the graph) to go through the graph again",
                     t->fn, ebb__node_name_of(n), (unsigned long long)n->seq);
    for (int k = 0; n->saved && !st && k < n->nin + n->nout; k++) st = ebb__unpack(t, n, k, &saved[k]);
    if (n->saved) ebb__mutex_unlock(ebb__saved_lock(n));
    for (int i = 0; !st && i < n->nin; i++) need[i] = edges[i] >= 0 && t->nodes[edges[i]].needed;
    if (!st) {
      /* The buffers the engine holds alone: the backward may compute a gradient in them (not when
       * post-hooks will read them as the node's grad_outputs). */
      bool mine[2] = {!nh && buf[0] && ebb__tensor_exclusive(buf[0]), !nh && n->nout > 1 && buf[1] && ebb__tensor_exclusive(buf[1])};
      const ebb__bw_ctx ctx = {&n->args, n->in_meta, saved, saved + n->nin, n->nin, need, mine};
      const ebb_tensor_t *go[2] = {buf[0], n->nout > 1 ? buf[1] : NULL};
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
  if (!st && nh) st = ebb__node_post_hooks(t->fn, n, gin, n->nin, buf, n->nout); /* node_api.c */
  /* Its gradients are used up: freed now, not at the task's end (a backward holds only the
   * buffers of nodes still waiting), and so a gradient returned in its own buffer is held once,
   * and a producer that gets it may take the next sum into it in place. */
  for (int k = 0; buf && k < n->nout; k++)
    if (buf[k]) {
      ebb_tensor_release(buf[k]);
      buf[k] = NULL;
    }
  /* Deliver (and count down the producers' dependencies, gradient or not). */
  for (int i = 0; gin && i < n->nin; i++) {
    struct ebb__tnode *cx = edges[i] >= 0 ? &t->nodes[edges[i]] : NULL;
    if (!cx) {
      if (gin[i]) ebb_tensor_release(gin[i]);
      continue;
    }
    if (!st && gin[i]) st = ebb__buf_add(cx, n->next[i].input_nr, gin[i]);
    else if (gin[i]) ebb_tensor_release(gin[i]);
    if (--cx->deps == 0 && cx->needed && !st && !ebb__heap_push(ready, t, edges[i]))
      st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue", t->fn);
  }
  /* Without retain_graph the node's saved tensors go. The first backward to get here claims
   * them under the lock (the others see them freed and never read them); its own references are
   * dropped first, so the release of the node's sees whether it is a storage's last. */
  int nsaved = saved ? n->nin + n->nout : 0;
  bool took = false;
  if (!st && !retain && n->saved) {
    ebb__mutex_lock(ebb__saved_lock(n));
    took = !atomic_exchange_explicit(&n->freed_saved, true, memory_order_acq_rel);
    ebb__mutex_unlock(ebb__saved_lock(n));
  }
  for (int k = 0; k < nsaved; k++)
    if (saved[k]) ebb_tensor_release((ebb_tensor_t *)saved[k]);
  for (int k = 0; took && k < n->nin + n->nout; k++)
    if (n->saved[k]) ebb__owners_saved_drop(n, k); /* (owners.c: its block's owner back) */
  if (gin != gin_small) free(gin);
  if (saved != saved_small) free(saved);
  if (need != need_small) free(need);
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
  st = ebb__grad_fn_now(r, m, node, nr); /* inplace.c: a view's history may follow its base's */
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  if (*node) return EBB_OK;
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

/* Roots and inputs are tensors, or (eroots, einputs: the _edges calls) gradient edges. */
static ebb_status ebb__execute(const char *fn, const ebb_tensor_t *const *roots, const ebb_gradient_edge *eroots,
                               const ebb_tensor_t *const *grad_roots, int nroots, bool retain, const ebb_tensor_t *const *inputs,
                               const ebb_gradient_edge *einputs, int ninputs, bool accumulate, bool allow_unused,
                               ebb_tensor_t **results) {
  if ((!roots && !eroots) || nroots <= 0) return ebb__fail(EBB_EINVAL, "%s: no roots; expected at least one tensor to differentiate", fn);
  if (ninputs < 0 || (ninputs > 0 && !inputs && !einputs)) return ebb__fail(EBB_EINVAL, "%s: %d inputs and no inputs array", fn, ninputs);
  if (!accumulate && ((!inputs && !einputs) || ninputs == 0))
    return ebb__fail(EBB_EINVAL, "%s: no inputs; expected the tensors to differentiate with respect to", fn);
  struct ebb__task t = {.fn = fn, .results = results, .inputs = inputs};
  struct ebb_node **rn = calloc((size_t)nroots, sizeof *rn), **racc = calloc((size_t)nroots, sizeof *racc);
  int *rnr = calloc((size_t)nroots, sizeof *rnr);
  ebb_tensor_t **rg = calloc((size_t)nroots, sizeof *rg);
  int *dup = calloc((size_t)(ninputs > 0 ? ninputs : 1), sizeof *dup);
  /* The inputs' nodes (a leaf's AccumulateGrad, held by the task: its leaf holds it weakly). */
  struct ebb_node **innode = calloc((size_t)(ninputs > 0 ? ninputs : 1), sizeof *innode);
  int *innr = calloc((size_t)(ninputs > 0 ? ninputs : 1), sizeof *innr);
  struct ebb__heap ready = {0};
  bool was;
  ebb_status st = rn && racc && rnr && rg && dup && innode && innr
                      ? EBB_OK
                      : ebb__fail(EBB_ENOMEM, "%s: no host memory for %d roots and %d inputs", fn, nroots, ninputs);
  for (int i = 0; dup && i < ninputs; i++) dup[i] = -1;
  struct ebb__task_scope scope; /* node_api.c: the task's id, current node, multi-grad state */
  ebb__task_begin(&scope, &t);
  for (int i = 0; !st && i < nroots; i++)
    st = eroots ? ebb__edge_resolve(fn, "roots", i, &eroots[i], &rn[i], &rnr[i])
                : ebb__root_edge(fn, "roots", i, roots[i], &rn[i], &rnr[i], &racc[i]);
  for (int i = 0; !st && i < nroots; i++)
    st = eroots ? ebb__edge_root_grad(fn, i, rn[i], rnr[i], grad_roots ? grad_roots[i] : NULL, &rg[i])
                : ebb__root_grad(fn, i, roots[i], grad_roots ? grad_roots[i] : NULL, &rg[i]);
  for (int i = 0; !st && i < ninputs; i++) {
    if (einputs) { /* an edge: its node (an AccumulateGrad for a leaf), held by the edge */
      st = ebb__edge_resolve(fn, "inputs", i, &einputs[i], &innode[i], &innr[i]);
      if (!st && accumulate && innode[i]->op >= 0)
        st = ebb__fail(EBB_ENOTSUP, "%s: inputs[%d] is an edge to %s, not to a leaf's AccumulateGrad: an edge has no tensor whose .grad "
                       "to fill (ebb_grad_edges gives its gradient)", fn, i, ebb__node_name_of(innode[i]));
      continue;
    }
    st = ebb__tensor_check(inputs[i], fn, "inputs[i]");
    struct ebb__meta *m = st ? NULL : ebb__meta_of(inputs[i]);
    if (!st && (!m || !m->requires_grad))
      st = ebb__fail(EBB_EINVAL, "%s: inputs[%d] does not require a gradient; expected a tensor that does", fn, i);
    struct ebb_node *in = NULL;
    int nr = 0;
    if (!st) st = ebb__grad_fn_now(inputs[i], m, &in, &nr); /* inplace.c: a view's history may follow its base's */
    if (st) break;
    innr[i] = in ? nr : 0;
    if (in) innode[i] = in;
    else if ((innode[i] = ebb__grad_acc_get(m)) && !(ebb__hold_room(&t) && (t.held[t.nheld++] = innode[i]))) {
      ebb__node_unref(innode[i]);
      st = ebb__fail(EBB_ENOMEM, "%s: no host memory for %d inputs", fn, ninputs);
    }
  }
  /* The task: every node of the roots' graph, or with inputs only those on a path to one. */
  uint64_t maxseq = 0;
  for (int i = 0; !st && i < nroots; i++) maxseq = rn[i]->seq > maxseq ? rn[i]->seq : maxseq;
  if (!st && ninputs > 0) st = ebb__find_from_inputs(&t, innode, ninputs, maxseq);
  if (!st) st = ebb__discover(&t, rn, nroots, ninputs > 0);
  for (int i = 0; !st && i < ninputs; i++) {
    int xi = innode[i] ? ebb__tfind(&t, innode[i]) : -1;
    struct ebb__tnode *x = xi >= 0 && t.nodes[xi].needed ? &t.nodes[xi] : NULL;
    if (!x) {
      if (!accumulate && !allow_unused)
        st = ebb__fail(EBB_EINVAL, "%s: inputs[%d] was not used to compute the roots; expected allow_unused to get no gradient for it", fn, i);
      continue;
    }
    if (accumulate && x->n->op < 0) x->run = true; /* backward(inputs): the leaf's AccumulateGrad */
    else if (x->capture && x->capture_nr == innr[i]) {
      dup[i] = x->capture - 1; /* the same input again: the same gradient, copied after the run */
    } else if (x->capture) {
      st = ebb__fail(EBB_ENOTSUP, "%s: inputs[%d] and inputs[%d] are two outputs of one node (%s); asking for both in one call is "
                     "not supported yet", fn, x->capture - 1, i, ebb__node_name_of(innode[i]));
    } else {
      x->capture = i + 1;
      x->capture_nr = innr[i];
    }
  }
  ebb_grad_set_enabled(false, &was); /* no graph of the backward (create_graph is not supported) */
  for (int i = 0; !st && i < nroots; i++) {
    int ri = ebb__tfind(&t, rn[i]);
    if (ri < 0 || !t.nodes[ri].needed) continue; /* a root that leads to no input: its gradient is not needed */
    st = ebb__buf_add(&t.nodes[ri], rnr[i], rg[i]);
    rg[i] = NULL;
  }
  for (size_t i = 0; !st && i < t.count; i++)
    if (t.nodes[i].deps == 0 && t.nodes[i].needed && !ebb__heap_push(&ready, &t, (int)i))
      st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue", fn);
  while (!st && ready.n) {
    struct ebb__tnode *x = &t.nodes[ebb__heap_pop(&ready)];
    struct ebb_node *prev = ebb__node_enter(x->n); /* node_api.c: ebb_autograd_current_node */
    bool owned = ebb__owners_enter(x->n);        /* owners.c: what the node allocates is its own */
    st = ebb__run_node(&t, x, retain, &ready);
    ebb__owners_leave(owned);
    ebb__node_enter(prev);
    /* What is left of its buffer (a node that only accumulated or was captured) goes now. */
    ebb_tensor_t **b = ebb__bufs(x);
    for (int k = 0; b && k < ebb__nbufs(x); k++)
      if (b[k]) {
        ebb_tensor_release(b[k]);
        b[k] = NULL;
      }
  }
  for (int i = 0; !st && results && i < ninputs; i++)
    if (dup[i] >= 0 && results[dup[i]]) {
      ebb_tensor_retain(results[dup[i]]);
      results[i] = results[dup[i]];
    }
  /* An input whose node was reached without a gradient (only a path that carries none). */
  for (int i = 0; !st && results && !allow_unused && i < ninputs; i++)
    if (!results[i])
      st = ebb__fail(EBB_EINVAL, "%s: inputs[%d] got no gradient from the roots (no path to it carries one); expected allow_unused "
                     "to get no gradient for it", fn, i);
  ebb_status end = ebb__task_end(&scope, st == EBB_OK); /* node_api.c: multi-grad "all" left incomplete */
  if (!st) st = end;
  ebb_grad_set_enabled(was, NULL);
  for (int i = 0; rg && i < nroots; i++)
    if (rg[i]) ebb_tensor_release(rg[i]);
  free(rn);
  free(dup);
  free(rnr);
  free(rg);
  free(innode);
  free(innr);
  free(ready.a);
  ebb__task_free(&t);
  /* After the task: a leaf root's AccumulateGrad may be held by nothing else, and the task's
   * entries read their nodes. */
  for (int i = 0; racc && i < nroots; i++) ebb__node_unref(racc[i]);
  free(racc);
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
  return ebb__execute("ebb_backward", roots, NULL, grad_roots, nroots, retain_graph, inputs, NULL, ninputs, true, false, NULL);
}

ebb_status ebb_backward_edges(const ebb_gradient_edge *roots, const ebb_tensor_t *const *grad_roots, int nroots, bool retain_graph,
                              const ebb_gradient_edge *inputs, int ninputs) {
  return ebb__execute("ebb_backward_edges", NULL, roots, grad_roots, nroots, retain_graph, NULL, inputs, ninputs, true, false, NULL);
}

ebb_status ebb_grad_edges(const ebb_gradient_edge *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                          const ebb_gradient_edge *inputs, int ninputs, bool retain_graph, bool allow_unused, ebb_tensor_t **grads) {
  if (!grads) return ebb__fail(EBB_EINVAL, "ebb_grad_edges: grads is NULL; expected an array of ninputs handles to fill");
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return ebb__execute("ebb_grad_edges", NULL, outputs, grad_outputs, noutputs, retain_graph, NULL, inputs, ninputs, false,
                      allow_unused, grads);
}

bool ebb__task_will_execute(const struct ebb__task *t, const struct ebb_node *n) {
  int i = ebb__tfind(t, n);
  return i >= 0 && t->nodes[i].needed;
}

ebb_status ebb_grad(const ebb_tensor_t *const *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                    const ebb_tensor_t *const *inputs, int ninputs, bool retain_graph, bool allow_unused, ebb_tensor_t **grads) {
  if (!grads) return ebb__fail(EBB_EINVAL, "ebb_grad: grads is NULL; expected an array of ninputs handles to fill");
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return ebb__execute("ebb_grad", outputs, NULL, grad_outputs, noutputs, retain_graph, inputs, NULL, ninputs, false, allow_unused,
                      grads);
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
