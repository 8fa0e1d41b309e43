/* engine.c: the backward engine: graph tasks and where their nodes run.
 *
 * A graph task (one ebb_backward or ebb_grad call) finds the nodes reachable from its roots,
 * counts each node's incoming edges, marks what must run (everything, or with `inputs` only the
 * nodes on a path to one of them), and runs ready nodes in decreasing sequence number (the
 * AccumulateGrad nodes first). Each node gets the sum of the gradients its consumers sent (its
 * input buffer), calls its derivative-table entry, and adds what it returns into its producers'
 * buffers. AccumulateGrad adds into the leaf's .grad under the leaf's lock, so concurrent backward
 * calls on shared leaves sum exactly.
 *
 * Where: a task whose nodes are on the CPU or one device runs on the calling thread (one heap,
 * no locks). A task over several devices (or with EBB_ENGINE_WORKERS) is "shared": each device's
 * nodes go to its worker's queue (workers.c), CPU nodes to the owner's queue, which the calling
 * thread serves until the task's outstanding count is 0; deliveries (buffers, dependency counts,
 * pushes) then happen under the task's lock, a node's own run outside it.
 *
 * Streams: each node runs with its forward stream current; what its gradients need between
 * streams (input buffers, events, waits, .grad's order, the AccumulateGrad mismatch) is inbuf.c's.
 *
 * The first error ends the task: nodes not started are skipped, what the task holds is released,
 * the caller gets the status and a message naming the failing node; the graph and the engine stay
 * usable (with retain_graph).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "engine_impl.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb/trace.h"
#include "ebb_internal.h"
#include "streams_export.h"

/* ---- settings and counters ------------------------------------------------------------------- */

static _Atomic int ebb__mode = EBB_ENGINE_AUTO;
static _Atomic int ebb__max_depth = 60;
static _Atomic uint64_t ebb__stats[EBB__S_COUNT];

void ebb__count(int k, uint64_t n) {
  if (n) atomic_fetch_add_explicit(&ebb__stats[k], n, memory_order_relaxed);
}
void ebb__engine_count_parks(uint64_t n) { ebb__count(EBB__S_PARKS, n); }

/* Nested backward calls running on this thread (0: not inside a backward). */
static _Thread_local int ebb__depth;
/* Reentrant depth of the backward running on this thread, counted across pool hand-offs: the
 * queues' first key. */
static _Thread_local int ebb__total_depth;

/* The next edges a node has in the graph walk (AccumulateGrad has none). */
static int engine_nedges(const struct ebb_node *n) { return n->op < 0 ? 0 : n->nin; }

/* The product's high half folded down: the table masks the low bits, which alone would depend
 * only on the low bits of the address, and nodes come at a fixed stride (their allocator's size
 * class: a power of two leaves most slots unused and probes long). */
static size_t engine_hash(const struct ebb_node *n) {
  uint64_t h = (uint64_t)((uintptr_t)n >> 4) * 0x9e3779b97f4a7c15ull;
  return (size_t)(h ^ (h >> 32));
}

/* The task index of n, or -1. */
int ebb__tfind(const struct ebb__task *t, const struct ebb_node *n) {
  if (!t->hcap) return -1;
  for (size_t j = engine_hash(n) & (t->hcap - 1);; j = (j + 1) & (t->hcap - 1)) {
    int i = t->hash[j] - 1;
    if (i < 0 || t->nodes[i].n == n) return i;
  }
}

/* The task index of n, added (deps 0, nothing marked) if it is not there; *added says which.
 * -1 without memory. */
static int tadd(struct ebb__task *t, struct ebb_node *n, bool *added) {
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
      size_t j = engine_hash(t->nodes[k].n) & (nc - 1);
      while (nh[j]) j = (j + 1) & (nc - 1);
      nh[j] = (int)k + 1;
    }
    free(t->hash);
    t->hash = nh;
    t->hcap = nc;
  }
  size_t j = engine_hash(n) & (t->hcap - 1);
  while (t->hash[j]) j = (j + 1) & (t->hcap - 1);
  i = (int)t->count++;
  t->hash[j] = i + 1;
  t->nodes[i] = (struct ebb__tnode){.n = n, .edge0 = -1};
  *added = true;
  return i;
}

static void task_free(struct ebb__task *t) {
  for (size_t i = 0; i < t->count; i++) {
    struct ebb__tnode *x = &t->nodes[i];
    ebb_tensor_t **b = ebb__bufs(x);
    for (int k = 0; b && k < ebb__nbufs(x); k++)
      if (b[k]) ebb_tensor_release(b[k]);
    for (int k = 0; x->sync && k < ebb__nbufs(x); k++) ebb__ev_free(x->sync[k].ev);
    free(x->buf_heap);
    free(x->sync);
  }
  ebb__task_unhold(t); /* inbuf.c: a release asked meanwhile is carried out now */
  free(t->wrote);
  free(t->flows);
  free(t->caller);
  free(t->leaves);
  free(t->nodes);
  free(t->hash);
  free(t->edges);
  for (size_t i = 0; i < t->nheld; i++) ebb__node_unref(t->held[i]); /* (after: the loop above reads them) */
  free(t->held);
}

/* ---- finding the graph -------------------------------------------------------------------- */

/* Every node reachable from the roots, with its incoming-edge count and its next edges as task
 * indices (so running the task never looks a node up again), all marked to run.
 *
 * With `within` (a partial backward), only the nodes already in the task are walked: those found
 * from the inputs by find_from_inputs, each of which leads to an input. A node reached from
 * the roots is needed; it runs when one of its next edges leads to a node of the task (a target
 * none of whose edges does is only captured); its dependencies count the reached nodes' edges. */
static ebb_status discover(struct ebb__task *t, struct ebb_node *const *roots, int nroots, bool within) {
  size_t cap = 64, depth = 0;
  int *stack = malloc(cap * sizeof *stack);
  if (!stack) return ebb__fail(EBB_ENOMEM, "%s: no host memory to walk the graph", t->fn);
  for (int r = 0; r < nroots; r++) {
    bool added = false;
    int ri = within ? ebb__tfind(t, roots[r]) : tadd(t, roots[r], &added);
    if (within && (ri < 0 || t->nodes[ri].needed)) continue; /* a root that leads to no input, or seen */
    if (ri < 0) goto oom;
    if (!within && !added) continue;
    t->nodes[ri].needed = true;
    stack[depth++] = ri;
    while (depth) {
      int i = stack[--depth];
      struct ebb_node *n = t->nodes[i].n;
      int ne = engine_nedges(n);
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
          if ((ci = tadd(t, c, &fresh)) < 0) goto oom;
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
static bool hold_room(struct ebb__task *t) {
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
static ebb_status find_from_inputs(struct ebb__task *t, struct ebb_node *const *from, int nfrom, uint64_t maxseq) {
  struct ebb_node **found = NULL;
  size_t nfound = 0, capfound = 0, done = 0;
  ebb_status st = EBB_OK;
  for (int i = 0; i < nfrom && !st; i++) {
    bool added;
    if (!from[i]) continue;
    if (tadd(t, from[i], &added) < 0) st = EBB_ENOMEM;
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
      if (!st && c->seq <= maxseq && (!hold_room(t) || tadd(t, c, &added) < 0)) st = EBB_ENOMEM;
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

static bool heap_push(struct ebb__heap *h, const struct ebb__task *t, int i) {
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

static int heap_pop(struct ebb__heap *h) {
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

/* Whether non-leaf m keeps its gradient through retain_grad (its hook adds into .grad). */
static bool engine_retained(const struct ebb__meta *m) { return m->retain && !atomic_load(&m->retain->removed); }

/* A node's saved tensors are read and released under one of 16 locks chosen by its address, so
 * backward calls on other threads sharing the node (retain_graph on all but the last) never read
 * a saved tensor another one is releasing. The lock is held for the references, not the math. */
#define EBB__SM(i) {PTHREAD_MUTEX_INITIALIZER, "autograd.saved", EBB_RANK_LEAF}
#define EBB__SM4(i) EBB__SM(i), EBB__SM(i), EBB__SM(i), EBB__SM(i)
static ebb_mutex ebb__saved_mu[16] = {EBB__SM4(0), EBB__SM4(1), EBB__SM4(2), EBB__SM4(3)};
static ebb_mutex *saved_lock(const struct ebb_node *n) { return &ebb__saved_mu[((uintptr_t)n >> 7) & 15]; }
ebb_mutex *ebb__saved_lock(const struct ebb_node *n) { return saved_lock(n); }

/* The saved tensor k of n (a new reference in *out, NULL when none), checked against in-place
 * changes since it was saved. A packed one (saved.c) gets a reference in pk[k] instead, *pk
 * allocated at the first, for its unpack hook to run once the lock is dropped. Saved lock held. */
static ebb_status unpack(const struct ebb__task *t, const struct ebb_node *n, int k, const ebb_tensor_t **out,
                         struct ebb__packed ***pk) {
  const struct ebb__saved *s = &n->saved[k];
  ebb_status st = EBB_UNLIKELY(s->mut != NULL) ? ebb__mutation_unpack(t->fn, n, k) : EBB_OK; /* (mutation.c: its scope open) */
  if (st) return st;
  *out = s->t;
  if (!*out) {
    if (EBB_LIKELY(!s->packed)) return EBB_OK;
    if (!*pk && !(*pk = calloc((size_t)n->nsaved, sizeof **pk)))
      return ebb__fail(EBB_ENOMEM, "%s: no host memory to run %s", t->fn, ebb__node_name_of(n));
    ebb__packed_get(s->packed);
    (*pk)[k] = s->packed;
    return EBB_OK;
  }
  ebb_tensor_retain((ebb_tensor_t *)*out);
  uint64_t v = 0;
  ebb_tensor_version(*out, &v);
  if (v != s->version) return ebb__saved_modified(t->fn, n, k, *out, v); /* (saved.c) */
  return EBB_OK;
}

static ebb_status ready_push(struct ebb__task *t, int i);

/* Whether node x hands its gradient gin[i] to another of its consumers too (the same tensor for
 * two inputs) that runs on another stream than gin[i]'s consumer: then either may read it after
 * the other could write it in place. Consumers on one stream are ordered by it. */
static bool handed_apart(const struct ebb__task *t, const struct ebb__tnode *x, ebb_tensor_t *const *gin, int i) {
  const int *edges = t->edges + x->edge0;
  uint64_t sid = t->nodes[edges[i]].sr.id;
  for (int j = 0; j < x->n->nin; j++)
    if (j != i && gin[j] == gin[i] && edges[j] >= 0 && t->nodes[edges[j]].sr.id != sid) return true;
  return false;
}

/* retain_grad's write (hooks.c calls it with x's tensor hooks, x's stream current): into .grad
 * after its last write (inbuf.c, as a non-leaf input's), and x's stream noted for the end sync:
 * the caller reads this .grad as it reads a leaf's. */
struct ebb__retain_ctx {
  struct ebb__task *t;
  const struct ebb__tnode *x;
};
static ebb_status retain_write(void *ctx, struct ebb__meta *m, const ebb_tensor_t *g) {
  const struct ebb__retain_ctx *c = ctx;
  ebb_status st = ebb__leaf_stream(c->t, c->x);
  if (!st) st = ebb__accumulate_into(c->t, c->x, m, g);
  return st ? st : ebb__task_wrote(c->t, NULL, c->x->n);
}

/* The messages below describe tensors in stack buffers; these helpers (EBB_COLD) keep those
 * buffers out of run_node's frame, which every node pays for (most leaves have no hooks). */

/* A leaf's tensor hooks (h non-NULL), with the leaf described by name and shape for their messages. */
static EBB_COLD ebb_status leaf_tensor_hooks(struct ebb__task *t, const struct ebb__tnode *x, struct ebb__hook *h,
                                              ebb_tensor_t **grad, struct ebb__retain_ctx *rc) {
  char who[EBB__DESC_MAX];
  return ebb__run_tensor_hooks(t->fn, ebb__tensor_desc(x->n->leaf, "the leaf", -1, who, sizeof who), h, 0, grad, retain_write,
                               rc);
}

/* The failure of adding a captured non-leaf input's gradient into its .grad. */
static EBB_COLD ebb_status input_grad_failed(const struct ebb__task *t, const struct ebb__tnode *x, ebb_status st) {
  char id[EBB__DESC_MAX];
  return ebb__fail(st, "%s: adding the gradient of %s (a non-leaf, output %d of %s) into its .grad failed: %s", t->fn,
                   ebb__tensor_desc(t->inputs[x->capture - 1], "inputs", x->capture - 1, id, sizeof id), x->capture_nr,
                   ebb__node_name_of(x->n), ebb_last_error());
}

/* A backward's gradient for input i that does not match the input's metadata. */
static EBB_COLD ebb_status grad_mismatch(const struct ebb__task *t, const struct ebb_node *n, int i, const ebb_tensor_t *g) {
  char gd[EBB__DESC_MAX], md[EBB__DESC_MAX];
  return ebb__fail(EBB_EINTERNAL, "%s: %s (node %llu) returned %s for %s; expected its shape, dtype and device", t->fn,
                   ebb__node_name_of(n), (unsigned long long)n->seq, ebb__tensor_desc(g, "a gradient", -1, gd, sizeof gd),
                   ebb__meta_desc(&n->in_meta[i], "input", i, NULL, md, sizeof md));
}

/* A gradient leaves the running node for node `to` on another device: the tail of a flow, inside
 * the running node's span, whose head trace_node_start records when `to` runs. Under the task's
 * lock when shared. Without memory for the list the flow is left out (whole). */
static EBB_COLD void trace_flow(struct ebb__task *t, int to) {
  if (t->nflows == t->capflows) {
    size_t nc = t->capflows ? t->capflows * 2 : 16;
    struct ebb__tflow *nf = realloc(t->flows, nc * sizeof *nf);
    if (!nf) return;
    t->flows = nf;
    t->capflows = nc;
  }
  uint64_t id = ebb_trace_flow_id(), now = ebb__now_ns();
  t->flows[t->nflows++] = (struct ebb__tflow){id, to};
  ebb_trace_span r = {.name = "gradient", .start_ns = now, .end_ns = now, .device = t->nodes[to].dev, .kind = EBB_TRACE_FLOW_START, .id = id};
  (void)ebb_trace_record(&r);
}

static ebb_status run_node(struct ebb__task *t, struct ebb__tnode *x) {
  struct ebb_node *n = x->n;
  struct ebb__retain_ctx rc = {t, x};
  ebb_tensor_t **buf = ebb__bufs(x);
  bool retain = t->retain;
  ebb_status st = ebb__consume_waits(t, x);
  if (st) return st;
  if (x->capture && x->sync) st = ebb__leaf_stream(t, x); /* a result the caller reads */
  if (st) return st;
  if (x->capture && !x->run && buf && buf[x->capture_nr]) {
    /* A node only captured (not run): its tensor hooks still see the gradient first, as they
     * would before it ran (PyTorch's order for captures of nodes that do not execute). */
    struct ebb__hook *hl = n->op < 0 ? ebb__meta_of(n->leaf)->hooks : n->hooks;
    if (n->op < 0) st = hl ? leaf_tensor_hooks(t, x, hl, &buf[x->capture_nr], &rc) : EBB_OK;
    else st = ebb__run_tensor_hooks(t->fn, ebb__node_name_of(n), hl, x->capture_nr, &buf[x->capture_nr], retain_write, &rc);
    if (st) return st;
  }
  if (x->capture && buf && buf[x->capture_nr]) { /* what reached this node's input: ebb_grad's result, or .grad */
    if (t->results) {
      ebb_tensor_retain(buf[x->capture_nr]);
      t->results[x->capture - 1] = buf[x->capture_nr];
    } else if (engine_retained(ebb__meta_of(t->inputs[x->capture - 1]))) {
      /* retain_grad's hook (run with this node's tensor hooks) puts the gradient into .grad: once */
    } else if ((st = ebb__accumulate_into(t, x, ebb__meta_of(t->inputs[x->capture - 1]), buf[x->capture_nr]))) {
      return input_grad_failed(t, x, st);
    } else if ((st = ebb__task_wrote(t, t->inputs[x->capture - 1], NULL))) {
      return st;
    }
  }
  if (!x->run) return EBB_OK;
  if (n->op < 0) {
    if (!buf[0]) return EBB_OK;
    ebb__acc_stream(t, x); /* inbuf.c: follow-producer made permanent, or the mismatch warning */
    if (x->sync && (st = ebb__leaf_stream(t, x))) return st;
    struct ebb__meta *lm = ebb__meta_of(n->leaf);
    st = lm->hooks ? leaf_tensor_hooks(t, x, lm->hooks, &buf[0], &rc) : EBB_OK;
    if (st) return st;
    /* node_api.c: the node's pre-hooks, and the gradient its post-hooks see (kept, so not stolen). */
    bool nh = atomic_load_explicit(&n->has_node_hooks, memory_order_acquire);
    if (nh && (st = ebb__node_pre_hooks(t->fn, n, buf, 1))) return st;
    ebb_tensor_t *seen = nh ? buf[0] : NULL;
    if (seen) ebb_tensor_retain(seen);
    st = ebb__accumulate(t, x, &buf[0]);
    if (st) st = ebb__fail(st, "%s: AccumulateGrad failed: %s", t->fn, ebb_last_error());
    else st = ebb__task_wrote(t, n->leaf, n);
    if (!st) st = ebb__run_post_acc_hooks(t->fn, lm->hooks, n->leaf);
    if (!st && nh) st = ebb__node_post_hooks(t->fn, n, NULL, 0, &seen, 1);
    if (seen) ebb_tensor_release(seen);
    return st;
  }
  for (int k = 0; n->hooks && buf && k < n->nout && !st; k++)
    st = ebb__run_tensor_hooks(t->fn, ebb__node_name_of(n), n->hooks, k, &buf[k], retain_write, &rc);
  if (st) return st;
  bool nh = atomic_load_explicit(&n->has_node_hooks, memory_order_acquire); /* node_api.c */
  if (nh && (st = ebb__node_pre_hooks(t->fn, n, buf, n->nout))) return st;
  /* A custom function's node (function.c) has no table entry: it runs its definition's backward
   * (which says itself when there is none) and saves what its ctx saved. */
  bool custom = n->fnrec != NULL;
  const ebb__deriv *e = custom ? NULL : ebb__deriv_of((ebb__op_id)n->op);
  bool runs = custom || e->backward, saves = custom ? ebb__function_saved_at(n->fnrec, -1) : e->save;
  const int *edges = t->edges + x->edge0;
  bool any = false;
  for (int k = 0; buf && k < n->nout; k++) any |= buf[k] != NULL;
  bool need_small[8] = {false}, *need = n->nin <= 8 ? need_small : calloc((size_t)n->nin, sizeof *need);
  ebb_tensor_t *gin_small[8] = {NULL}, **gin = n->nin <= 8 ? gin_small : calloc((size_t)n->nin, sizeof *gin);
  const ebb_tensor_t *saved_small[10] = {NULL}, **saved = n->nsaved <= 10 ? saved_small : calloc((size_t)n->nsaved, sizeof *saved);
  if (!gin || !saved || !need) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to run %s", t->fn, ebb__node_name_of(n));
  int ti = (int)(x - t->nodes);
  if (EBB_UNLIKELY(t->offl != NULL) && !st && any && runs) st = ebb__offl_plan_enter(t->fn, t->offl, ti); /* (offload.c) */
  if (!st && any && runs) {
    if (n->saved) ebb__mutex_lock(saved_lock(n)); /* (a node that saves nothing has nothing to guard) */
    if (atomic_load_explicit(&n->freed_saved, memory_order_acquire) && saves)
      st = ebb__fail(EBB_ESTATE, "%s: %s (node %llu) needs its saved tensors, freed by an earlier backward through this graph; "
                     "expected retain_graph on that backward (or on every backward but the last, when several threads share "
                     "the graph) to go through the graph again",
                     t->fn, ebb__node_name_of(n), (unsigned long long)n->seq);
    struct ebb__packed **pk = NULL; /* (saved.c: packed tensors, unpacked by their hooks below) */
    for (int k = 0; n->saved && !st && k < n->nsaved; k++) st = unpack(t, n, k, &saved[k], &pk);
    if (n->saved) ebb__mutex_unlock(saved_lock(n));
    if (EBB_UNLIKELY(pk != NULL)) st = ebb__packed_unpack_all(t->fn, n, pk, saved, st); /* (saved.c) */
    for (int i = 0; !st && i < n->nin; i++) need[i] = edges[i] >= 0 && t->nodes[edges[i]].needed;
    if (!st && custom) {
      st = ebb__function_backward(t->fn, n, buf, saved, need, gin);
    } else if (!st) {
      /* The buffers the engine holds alone: the backward may compute a gradient in them (not when
       * post-hooks will read them as the node's grad_outputs). */
      bool mine[2] = {!nh && buf[0] && ebb__tensor_exclusive(buf[0]) && !(x->sync && x->sync[0].shared),
                      !nh && n->nout > 1 && buf[1] && ebb__tensor_exclusive(buf[1]) && !(x->sync && x->sync[1].shared)};
      const ebb__bw_ctx ctx = {&n->args, n->in_meta, saved, saved + n->nin, n->nin, need, mine};
      const ebb_tensor_t *go[2] = {buf[0], n->nout > 1 ? buf[1] : NULL};
      st = e->backward(&ctx, go, gin);
      if (st) st = ebb__fail(st, "%s: %s (node %llu) failed: %s", t->fn, ebb__node_name_of(n), (unsigned long long)n->seq, ebb_last_error());
    }
    /* Every gradient in its input's shape, dtype and device (validate_outputs' check). */
    for (int i = 0; !st && i < n->nin; i++) {
      if (!gin[i] || ebb__tensor_matches(gin[i], &n->in_meta[i])) continue;
      st = grad_mismatch(t, n, i, gin[i]);
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
  /* Deliver (and count down the producers' dependencies, gradient or not), under the task's
   * lock when other threads deliver too. */
  if (t->shared) ebb__mutex_lock(&t->mu);
  /* Another node failed first (its error is the task's): nothing more is delivered. */
  bool cancelled = t->shared && atomic_load_explicit(&t->failed, memory_order_relaxed);
  for (int i = 0; gin && i < n->nin; i++) {
    struct ebb__tnode *cx = edges[i] >= 0 ? &t->nodes[edges[i]] : NULL;
    if (!cx) {
      if (gin[i]) ebb_tensor_release(gin[i]);
      continue;
    }
    if (EBB_UNLIKELY(cx->dev != x->dev) && EBB_TRACE_ON() && !st && !cancelled && gin[i]) trace_flow(t, edges[i]);
    if (!st && !cancelled && gin[i]) st = ebb__buf_add(t, cx, n->next[i].input_nr, gin[i], &x->sr, n, handed_apart(t, x, gin, i));
    else if (gin[i]) ebb_tensor_release(gin[i]);
    if (--cx->deps == 0 && cx->needed && !st && !cancelled) st = ready_push(t, edges[i]);
  }
  if (t->shared) ebb__mutex_unlock(&t->mu);
  /* Without retain_graph the node's saved tensors go. The first backward to get here claims
   * them under the lock (the others see them freed and never read them); its own references are
   * dropped first, so the release of the node's sees whether it is a storage's last. */
  int nsaved = saved ? n->nsaved : 0;
  bool took = false;
  if (!st && !retain && n->saved) {
    ebb__mutex_lock(saved_lock(n));
    took = !atomic_exchange_explicit(&n->freed_saved, true, memory_order_acq_rel);
    ebb__mutex_unlock(saved_lock(n));
  }
  for (int k = 0; k < nsaved; k++)
    if (saved[k]) ebb_tensor_release((ebb_tensor_t *)saved[k]);
  for (int k = 0; took && k < n->nsaved; k++)
    if (n->saved[k].t || n->saved[k].packed) ebb__saved_drop(n, k); /* (saved.c: owners and packed values) */
  if (EBB_UNLIKELY(t->offl != NULL)) ebb__offl_plan_leave(t->fn, t->offl, ti); /* (its reloads read for the last time go) */
  if (gin != gin_small) free(gin);
  if (saved != saved_small) free(saved);
  if (need != need_small) free(need);
  return st;
}

/* ---- running a task ------------------------------------------------------------------------ */

/* Node i is ready: onto the calling thread's heap, or (shared) its device's queue or the owner's. */
static ebb_status ready_push(struct ebb__task *t, int i) {
  if (!t->shared)
    return heap_push(t->ready, t, i) ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue", t->fn);
  struct ebb__tnode *x = &t->nodes[i];
  struct ebb__queue *q = x->dev >= 0 ? ebb__device_queue(x->dev) : t->cpuq;
  if (!q) return ebb__fail(EBB_ENOMEM, "%s: %s", t->fn, ebb_last_error());
  atomic_fetch_add_explicit(&t->outstanding, 1, memory_order_relaxed);
  struct ebb__qitem it = {t->depth, x->n->seq, t, i};
  if (ebb__queue_push(q, &it)) return EBB_OK;
  atomic_fetch_sub_explicit(&t->outstanding, 1, memory_order_relaxed);
  return ebb__fail(EBB_ENOMEM, "%s: no host memory for the ready queue of device %d", t->fn, x->dev);
}

/* ---- the trace (ebb/trace.h): a span per node that runs, the heads of its incoming flows ----- */

/* The node's span starts: the flows of gradients that crossed devices to reach it end here
 * (inside its span, which begins at the returned time). Under the task's lock when shared:
 * producers append to x's flows under it. Never 0, so the caller can tell "traced" apart. */
static EBB_COLD uint64_t trace_node_start(struct ebb__task *t, struct ebb__tnode *x) {
  if (!ebb__home_queue()) ebb__trace_thread_name_default("engine caller thread");
  uint64_t t0 = ebb__now_ns();
  int xi = (int)(x - t->nodes);
  if (t->shared) ebb__mutex_lock(&t->mu);
  for (size_t i = 0; i < t->nflows;) {
    if (t->flows[i].to != xi) {
      i++;
      continue;
    }
    /* One nanosecond into the span: a viewer reading events in time order has the span open by
     * then (at the same time the end could come first and bind to nothing). */
    ebb_trace_span r = {.name = "gradient", .start_ns = t0 + 1, .end_ns = t0 + 1, .device = x->dev,
                        .kind = EBB_TRACE_FLOW_END, .id = t->flows[i].id};
    (void)ebb_trace_record(&r);
    t->flows[i] = t->flows[--t->nflows];
  }
  if (t->shared) ebb__mutex_unlock(&t->mu);
  return t0 ? t0 : 1;
}

/* The node's span: also of a node only captured (ebb_grad's input, not run), where flows may end. */
static EBB_COLD void trace_node_end(const struct ebb__task *t, const struct ebb__tnode *x, uint64_t t0) {
  ebb_trace_span r = {.name = ebb__node_name_of(x->n), .start_ns = t0, .end_ns = ebb__now_ns(), .device = x->dev,
                      .kind = EBB_TRACE_SPAN, .args = EBB_TRACE_ARG_TASK | EBB_TRACE_ARG_SEQ,
                      .task = (uint64_t)t->scope->id, .seq = x->n->seq};
  (void)ebb_trace_record(&r);
}

/* Runs node x: current node, owner scope and stream set around it; its buffers freed after.
 * The thread's grad and inference modes come back as they were, whatever its hooks left: a
 * worker runs nodes of every backward after this one, which must not inherit them (PyTorch
 * restores a thread's state around each node too). */
static ebb_status run_one(struct ebb__task *t, struct ebb__tnode *x) {
  uint64_t t0 = EBB_TRACE_ON() ? trace_node_start(t, x) : 0;
  struct ebb_node *prev = ebb__node_enter(x->n); /* node_api.c: ebb_autograd_current_node */
  bool owned = ebb__owners_enter(x->n);        /* owners.c: what the node allocates is its own */
  bool grad_was = ebb__grad_mode_on(), inference_was = ebb_inference_mode_enabled();
  ebb_stream_guard g;
  bool in = ebb__enter(&g, &x->sr);            /* its forward stream: the backward's ops go there */
  ebb_status st = run_node(t, x);
  ebb__leave(&g, in);
  if (ebb__grad_mode_on() != grad_was) ebb_grad_set_enabled(grad_was, NULL);
  if (ebb_inference_mode_enabled() != inference_was) ebb_inference_mode_set_enabled(inference_was, NULL);
  ebb__owners_leave(owned);
  ebb__node_enter(prev);
  if (st && x->dev >= 0) st = ebb__fail(st, "%s (the node ran on device %d)", ebb_last_error(), x->dev);
  if (x->run) atomic_fetch_add_explicit(&t->n_nodes, 1, memory_order_relaxed);
  if (EBB_UNLIKELY(t0 != 0)) trace_node_end(t, x, t0);
  /* What is left of its buffer (a node that only accumulated or was captured) goes now. */
  ebb_tensor_t **b = ebb__bufs(x);
  for (int k = 0; b && k < ebb__nbufs(x); k++)
    if (b[k]) {
      ebb_tensor_release(b[k]);
      b[k] = NULL;
    }
  return st;
}

/* The first error of a shared task (x the failing node, NULL before any ran): kept with its
 * message (and the device it ran on) for the owner; later nodes are skipped. */
static void task_fail(struct ebb__task *t, const struct ebb__tnode *x, ebb_status st) {
  bool locked = t->shared && x; /* (the start's pushes hold the lock already) */
  if (locked) ebb__mutex_lock(&t->mu);
  if (!atomic_load_explicit(&t->failed, memory_order_relaxed)) {
    t->err = st;
    snprintf(t->errmsg, sizeof t->errmsg, "%s", ebb_last_error());
    atomic_store_explicit(&t->failed, true, memory_order_relaxed);
  }
  if (locked) ebb__mutex_unlock(&t->mu);
}

void ebb__item_run(const struct ebb__qitem *it) {
  struct ebb__task *t = it->t;
  if (!atomic_load_explicit(&t->failed, memory_order_relaxed)) {
    struct ebb__tnode *x = &t->nodes[it->i];
    /* The node's failures are the task's, reported once by its owner (engine_execute): on this
     * thread (a device worker's) they touch neither its last error nor the error hook. */
    char msg[EBB__ERRMSG_MAX] = "";
    char *prev = ebb__fail_divert(msg);
    struct ebb__task_scope *ps = ebb__task_switch(t->scope); /* node_api.c: the task its hooks see */
    struct ebb__saved_hooks_scope hs; /* saved.c: and the caller's saved-tensor hooks */
    ebb__saved_hooks_enter(&hs, t->hooks);
    /* A backward a hook starts here is reentrant, one level below this task, as on its owner. */
    int depth = ebb__depth, total = ebb__total_depth;
    if (!ebb__depth) ebb__depth = 1;
    ebb__total_depth = (int)t->depth + 1;
    ebb_status st = run_one(t, x);
    ebb__depth = depth;
    ebb__total_depth = total;
    ebb__saved_hooks_leave(&hs);
    ebb__task_switch(ps);
    if (st) task_fail(t, x, st);
    ebb__fail_divert(prev);
    if (x->run && ebb__home_queue()) atomic_fetch_add_explicit(&t->n_nodes_w, 1, memory_order_relaxed);
  }
  ebb__queue_done(t->cpuq, &t->outstanding); /* the last: t may be gone once this returns */
}

/* ---- the calls -------------------------------------------------------------------------------- */

/* inputs[i] for a message; an edge (the _edges calls pass no tensors) by its index alone. */
static const char *input_desc(const ebb_tensor_t *const *inputs, int i, char *buf, size_t cap) {
  if (inputs) return ebb__tensor_desc(inputs[i], "inputs", i, buf, cap);
  snprintf(buf, cap, "inputs[%d]", i);
  return buf;
}

/* The edge a root's gradient enters the graph through: its grad_fn and output, or a leaf's
 * AccumulateGrad (a new reference in *acc to drop after the task). */
static ebb_status root_edge(const char *fn, const char *what, int i, const ebb_tensor_t *r, struct ebb_node **node, int *nr,
                                 struct ebb_node **acc) {
  ebb_status st = ebb__tensor_check_at(r, fn, what, i);
  if (st) return st;
  struct ebb__meta *m = ebb__meta_of(r);
  *acc = NULL;
  char rd[EBB__DESC_MAX];
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient and has no grad_fn; expected a tensor computed from one "
                     "that requires a gradient", fn, ebb__tensor_desc(r, what, i, rd, sizeof rd));
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
static ebb_status root_grad(const char *fn, int i, const ebb_tensor_t *r, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb_tensor_info ri, gi;
  ebb_status st = ebb_tensor_get_info(r, &ri);
  if (st) return st;
  char rd[EBB__DESC_MAX], gd[EBB__DESC_MAX];
  if (!g) {
    if (ri.numel != 1)
      return ebb__fail(EBB_EINVAL, "%s: %s has %lld elements and no gradient was given; a gradient is implied only for a "
                       "tensor of one element (pass %s[%d])", fn, ebb__tensor_desc(r, ebb__roots_arg(fn), i, rd, sizeof rd),
                       (long long)ri.numel, ebb__grad_roots_arg(fn), i);
    return ebb_tensor_ones(ri.device, ri.dtype, ri.ndim, ri.shape, out);
  }
  st = ebb__tensor_check_at(g, fn, ebb__grad_roots_arg(fn), i);
  if (!st) st = ebb_tensor_get_info(g, &gi);
  if (st) return st;
  bool same = gi.ndim == ri.ndim && memcmp(gi.shape, ri.shape, sizeof(int64_t) * (size_t)ri.ndim) == 0;
  if (!same || gi.dtype != ri.dtype || gi.device != ri.device)
    return ebb__fail(EBB_EINVAL, "%s: %s does not match %s; expected its shape, dtype and device", fn,
                     ebb__tensor_desc(g, ebb__grad_roots_arg(fn), i, gd, sizeof gd), ebb__tensor_desc(r, ebb__roots_arg(fn), i, rd, sizeof rd));
  ebb_tensor_retain((ebb_tensor_t *)g);
  *out = (ebb_tensor_t *)g;
  return EBB_OK;
}

/* A backward call's arguments, for a pool thread to run it past the reentrant depth limit. */
struct ebb__call {
  const char *fn;
  const ebb_tensor_t *const *roots;
  const ebb_gradient_edge *eroots;
  const ebb_tensor_t *const *grad_roots;
  int nroots;
  bool retain;
  const ebb_tensor_t *const *inputs;
  const ebb_gradient_edge *einputs;
  int ninputs;
  bool accumulate, allow_unused;
  ebb_tensor_t **results;
  /* the caller's side */
  int total_depth;
  ebb_stream_t **streams; /* the caller's current stream per device, made current on the pool thread */
  int nstreams;
  const void *hooks; /* the caller's saved-tensor hook stack (saved.c), carried to every thread of the call */
  ebb_status st;
  char msg[EBB__ERRMSG_MAX];
};

/* What a call works with besides its task: the roots' nodes and output numbers (racc: the
 * AccumulateGrad a leaf root got, a reference to drop after the task), the roots' starting
 * gradients, and the inputs' nodes and output numbers (dup: an input given twice, the index of
 * its first place). */
struct ebb__work {
  struct ebb_node **rn, **racc;
  int *rnr;
  ebb_tensor_t **rg;
  int *dup;
  struct ebb_node **innode;
  int *innr;
};

static ebb_status work_alloc(const struct ebb__call *c, struct ebb__work *w) {
  size_t nr = (size_t)c->nroots, ni = (size_t)(c->ninputs > 0 ? c->ninputs : 1);
  *w = (struct ebb__work){calloc(nr, sizeof *w->rn), calloc(nr, sizeof *w->racc), calloc(nr, sizeof *w->rnr), calloc(nr, sizeof *w->rg),
                          calloc(ni, sizeof *w->dup), calloc(ni, sizeof *w->innode), calloc(ni, sizeof *w->innr)};
  if (!w->rn || !w->racc || !w->rnr || !w->rg || !w->dup || !w->innode || !w->innr)
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d roots and %d inputs", c->fn, c->nroots, c->ninputs);
  for (int i = 0; i < c->ninputs; i++) w->dup[i] = -1;
  return EBB_OK;
}

/* The arrays, the starting gradients not handed to the task, and (after the task, whose
 * entries read them) the AccumulateGrad references of leaf roots. */
static void work_free(const struct ebb__call *c, struct ebb__work *w) {
  for (int i = 0; w->rg && i < c->nroots; i++)
    if (w->rg[i]) ebb_tensor_release(w->rg[i]);
  for (int i = 0; w->racc && i < c->nroots; i++) ebb__node_unref(w->racc[i]);
  free(w->rn);
  free(w->racc);
  free(w->rnr);
  free(w->rg);
  free(w->dup);
  free(w->innode);
  free(w->innr);
}

/* The arguments' shape, before anything is looked at. */
static ebb_status check_call(const struct ebb__call *c) {
  if ((!c->roots && !c->eroots) || c->nroots <= 0)
    return ebb__fail(EBB_EINVAL, "%s: no %s; expected at least one tensor to differentiate", c->fn, ebb__roots_arg(c->fn));
  if (c->ninputs < 0 || (c->ninputs > 0 && !c->inputs && !c->einputs))
    return ebb__fail(EBB_EINVAL, "%s: %d inputs and no inputs array", c->fn, c->ninputs);
  if (!c->accumulate && ((!c->inputs && !c->einputs) || c->ninputs == 0))
    return ebb__fail(EBB_EINVAL, "%s: no inputs; expected the tensors to differentiate with respect to", c->fn);
  return EBB_OK;
}

/* Each root's edge into the graph and its starting gradient. */
static ebb_status resolve_roots(const struct ebb__call *c, struct ebb__work *w) {
  ebb_status st = EBB_OK;
  const char *fn = c->fn;
  for (int i = 0; !st && i < c->nroots; i++)
    st = c->eroots ? ebb__edge_resolve(fn, ebb__roots_arg(fn), i, &c->eroots[i], &w->rn[i], &w->rnr[i])
                   : root_edge(fn, ebb__roots_arg(fn), i, c->roots[i], &w->rn[i], &w->rnr[i], &w->racc[i]);
  for (int i = 0; !st && i < c->nroots; i++) {
    const ebb_tensor_t *g = c->grad_roots ? c->grad_roots[i] : NULL;
    st = c->eroots ? ebb__edge_root_grad(fn, i, w->rn[i], w->rnr[i], g, &w->rg[i]) : root_grad(fn, i, c->roots[i], g, &w->rg[i]);
  }
  return st;
}

/* Each input's node: an edge's, a non-leaf's grad_fn, or a leaf's AccumulateGrad (held by the
 * task: its leaf holds it weakly). */
static ebb_status resolve_inputs(const struct ebb__call *c, struct ebb__work *w, struct ebb__task *t) {
  const char *fn = c->fn;
  for (int i = 0; i < c->ninputs; i++) {
    ebb_status st;
    if (c->einputs) { /* an edge: its node (an AccumulateGrad for a leaf), held by the edge */
      st = ebb__edge_resolve(fn, "inputs", i, &c->einputs[i], &w->innode[i], &w->innr[i]);
      if (!st && c->accumulate && w->innode[i]->op >= 0)
        st = ebb__fail(EBB_ENOTSUP, "%s: inputs[%d] is an edge to %s, not to a leaf's AccumulateGrad: it names a node's output, not a "
                       "tensor, so there is no .grad to add its gradient into; pass the tensor to ebb_backward, or take the gradient "
                       "from ebb_grad_edges", fn, i, ebb__node_name_of(w->innode[i]));
      if (st) return st;
      continue;
    }
    const ebb_tensor_t *in = c->inputs[i];
    st = ebb__tensor_check_at(in, fn, "inputs", i);
    struct ebb__meta *m = st ? NULL : ebb__meta_of(in);
    char id[EBB__DESC_MAX];
    if (!st && (!m || !m->requires_grad))
      st = ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient; expected a tensor that does", fn,
                     ebb__tensor_desc(in, "inputs", i, id, sizeof id));
    struct ebb_node *node = NULL;
    int nr = 0;
    if (!st) st = ebb__grad_fn_now(in, m, &node, &nr); /* inplace.c: a view's history may follow its base's */
    if (st) return st;
    w->innr[i] = node ? nr : 0;
    if (node) w->innode[i] = node;
    else if ((w->innode[i] = ebb__grad_acc_get(m)) && !(hold_room(t) && (t->held[t->nheld++] = w->innode[i]))) {
      ebb__node_unref(w->innode[i]);
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d inputs", fn, c->ninputs);
    }
  }
  return EBB_OK;
}

/* What each input's node does in the found graph: a leaf's AccumulateGrad runs (backward with
 * inputs), another node's gradient is captured (grad, or a non-leaf's .grad). */
static ebb_status mark_inputs(const struct ebb__call *c, struct ebb__work *w, struct ebb__task *t) {
  const char *fn = c->fn;
  for (int i = 0; i < c->ninputs; i++) {
    int xi = w->innode[i] ? ebb__tfind(t, w->innode[i]) : -1;
    struct ebb__tnode *x = xi >= 0 && t->nodes[xi].needed ? &t->nodes[xi] : NULL;
    char ia[EBB__DESC_MAX], ib[EBB__DESC_MAX];
    if (!x) {
      if (!c->accumulate && !c->allow_unused)
        return ebb__fail(EBB_EINVAL, "%s: %s was not used to compute the %s; expected allow_unused to get no gradient for it", fn,
                         input_desc(c->inputs, i, ia, sizeof ia), ebb__roots_arg(fn));
      continue;
    }
    if (c->accumulate && x->n->op < 0) x->run = true; /* backward(inputs): the leaf's AccumulateGrad */
    else if (x->capture && x->capture_nr == w->innr[i]) {
      w->dup[i] = x->capture - 1; /* the same input again: the same gradient, copied after the run */
    } else if (x->capture) {
      return ebb__fail(EBB_ENOTSUP, "%s: %s and %s are two outputs of one node (%s); asking for both in one call is not supported yet",
                       fn, input_desc(c->inputs, x->capture - 1, ia, sizeof ia), input_desc(c->inputs, i, ib, sizeof ib),
                       ebb__node_name_of(w->innode[i]));
    } else {
      x->capture = i + 1;
      x->capture_nr = w->innr[i];
    }
  }
  return EBB_OK;
}

/* Runs the found task: its streams, the roots' gradients delivered, its ready nodes on the
 * calling thread or (shared) on the device workers, the end-of-backward sync. A failure once its
 * nodes may have started says which .grad fields it had written. */
/* The task's offload plan (offload.c): the offloaded saved tensors of the nodes it will run. */
static ebb_status offload_plan(struct ebb__task *t) {
  ebb_status st = EBB_OK;
  for (size_t i = 0; !st && i < t->count; i++) {
    struct ebb__tnode *x = &t->nodes[i];
    struct ebb_node *n = x->n;
    if (!x->run || !n->saved) continue;
    /* The packed values are taken under the saved lock (a leaf lock), the plan's lock after it. */
    struct ebb__packed *small[8], **pk = n->nsaved <= 8 ? small : malloc((size_t)n->nsaved * sizeof *pk);
    if (!pk) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the backward's offload plan", t->fn);
    int np = 0;
    ebb__mutex_lock(saved_lock(n));
    for (int k = 0; !atomic_load_explicit(&n->freed_saved, memory_order_acquire) && k < n->nsaved; k++) {
      struct ebb__packed *p = n->saved[k].packed;
      if (p && ebb__packed_offl(p)) {
        ebb__packed_get(p);
        pk[np++] = p;
      }
    }
    ebb__mutex_unlock(saved_lock(n));
    for (int j = 0; j < np; j++) {
      if (!st) st = ebb__offl_plan_add(&t->offl, t->count, (int)i, n->seq, x->sr.id ? x->sr.s : NULL, ebb__packed_offl(pk[j]));
      ebb__packed_put(pk[j]);
    }
    if (pk != small) free(pk);
  }
  if (st) return ebb__fail(st, "%s: %s", t->fn, ebb_last_error());
  return t->offl ? ebb__offl_plan_start(t->fn, t->offl) : EBB_OK;
}

static ebb_status run_task(const struct ebb__call *c, struct ebb__work *w, struct ebb__task *t) {
  int ndevs = 0;
  ebb_status st = ebb__task_streams(t, &ndevs);
  if (st) return st;
  if (EBB_UNLIKELY(ebb__offl_live() > 0) && (st = offload_plan(t))) return st;
  int mode = atomic_load_explicit(&ebb__mode, memory_order_relaxed);
  t->shared = ndevs > 0 && (mode == EBB_ENGINE_WORKERS || (mode == EBB_ENGINE_AUTO && ndevs >= 2));
  struct ebb__queue ownq;
  bool own = false;
  if (t->shared) {
    ebb__mutex_init(&t->mu, "autograd.task", EBB_RANK_AG_TASK);
    if (!(t->cpuq = ebb__home_queue())) { /* a device worker's reentrant call: its CPU nodes run there */
      ebb__queue_init(&ownq);
      t->cpuq = &ownq;
      own = true;
    }
    ebb__mutex_lock(&t->mu); /* workers deliver as soon as the first push */
  }
  for (int i = 0; !st && i < c->nroots; i++) {
    int ri = ebb__tfind(t, w->rn[i]);
    if (ri < 0 || !t->nodes[ri].needed) continue; /* a root that leads to no input: its gradient is not needed */
    int gd = ebb__slot_dev(&t->nodes[ri], w->rnr[i]);
    struct ebb__sref prod = gd >= 0 && t->caller ? t->caller[gd] : (struct ebb__sref){0}; /* made on the caller's stream */
    st = ebb__buf_add(t, &t->nodes[ri], w->rnr[i], w->rg[i], &prod, NULL, false);
    w->rg[i] = NULL;
  }
  for (size_t i = 0; !st && i < t->count; i++)
    if (t->nodes[i].deps == 0 && t->nodes[i].needed) st = ready_push(t, (int)i);
  if (t->shared) {
    if (st) task_fail(t, NULL, st); /* what was pushed is skipped */
    ebb__mutex_unlock(&t->mu);
    uint64_t parks = 0;
    struct ebb__qitem it;
    while (ebb__queue_pop_wait(t->cpuq, &t->outstanding, NULL, &it, &parks)) ebb__item_run(&it);
    ebb__mutex_lock(&t->cpuq->mu); /* the last ebb__queue_done has left the lock: nothing touches t after */
    ebb__mutex_unlock(&t->cpuq->mu);
    ebb__count(EBB__S_PARKS, parks);
    if (t->err) st = ebb__fail(t->err, "%s", t->errmsg);
  } else {
    while (!st && t->ready->n) st = run_one(t, &t->nodes[heap_pop(t->ready)]);
  }
  if (!st) st = ebb__end_sync(t);
  if (st && !c->results) {
    char why[EBB__ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", ebb_last_error());
    ebb__task_wrote_describe(t, why, sizeof why);
    st = ebb__fail(st, "%s", why);
  }
  if (own) ebb__queue_destroy(&ownq);
  if (t->shared) ebb__mutex_destroy(&t->mu);
  return st;
}

/* The engine's counters get the task's. */
static void count_task(const struct ebb__task *t) {
  ebb__count(EBB__S_CALLS, 1);
  ebb__count(EBB__S_NODES, t->n_nodes);
  ebb__count(EBB__S_NODES_W, t->n_nodes_w);
  ebb__count(EBB__S_XEDGES, t->n_xedges);
  ebb__count(EBB__S_EVENTS, t->n_events);
  ebb__count(EBB__S_WAITS, t->n_waits);
  ebb__count(EBB__S_MISM, t->n_mism);
}

/* ebb_grad's results after the task: an input given twice shares the first one's gradient; an
 * input reached by no gradient fails unless allow_unused. */
static ebb_status finish_results(const struct ebb__call *c, const struct ebb__work *w) {
  for (int i = 0; i < c->ninputs; i++)
    if (w->dup[i] >= 0 && c->results[w->dup[i]]) {
      ebb_tensor_retain(c->results[w->dup[i]]);
      c->results[i] = c->results[w->dup[i]];
    }
  for (int i = 0; !c->allow_unused && i < c->ninputs; i++)
    if (!c->results[i]) {
      char id[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: %s got no gradient from the %s (no path to it carries one); expected allow_unused "
                       "to get no gradient for it", c->fn, input_desc(c->inputs, i, id, sizeof id), ebb__roots_arg(c->fn));
    }
  return EBB_OK;
}

/* One backward call on this thread: roots and inputs are tensors, or (eroots, einputs: the
 * _edges calls) gradient edges. The task is every node of the roots' graph, or with inputs only
 * those on a path to one. */
static ebb_status execute_here(const struct ebb__call *c) {
  ebb_status st = check_call(c);
  if (st) return st;
  /* The thread that calls backward names its trace track, whether or not its nodes run here. */
  if (EBB_TRACE_ON() && !ebb__home_queue()) ebb__trace_thread_name_default("engine caller thread");
  struct ebb__task t = {.fn = c->fn, .results = c->results, .inputs = c->inputs, .retain = c->retain, .hooks = c->hooks};
  struct ebb__saved_hooks_scope hs; /* saved.c: the caller's hooks, whatever thread this runs on */
  ebb__saved_hooks_enter(&hs, c->hooks);
  struct ebb__work w;
  struct ebb__heap ready = {0};
  struct ebb__task_scope scope; /* node_api.c: the task's id, current node, multi-grad state */
  ebb__task_begin(&scope, &t);
  st = work_alloc(c, &w);
  if (!st) st = resolve_roots(c, &w);
  if (!st) st = resolve_inputs(c, &w, &t);
  uint64_t maxseq = 0;
  for (int i = 0; !st && i < c->nroots; i++) maxseq = w.rn[i]->seq > maxseq ? w.rn[i]->seq : maxseq;
  if (!st && c->ninputs > 0) st = find_from_inputs(&t, w.innode, c->ninputs, maxseq);
  if (!st) st = discover(&t, w.rn, c->nroots, c->ninputs > 0);
  if (!st) st = mark_inputs(c, &w, &t);
  bool was;
  ebb_grad_set_enabled(false, &was); /* no graph of the backward (create_graph is not supported) */
  t.depth = (uint32_t)ebb__total_depth;
  t.scope = &scope;
  t.ready = &ready;
  if (!st) st = run_task(c, &w, &t);
  ebb__offl_plan_end(t.offl); /* (offload.c: reloads still held go) */
  count_task(&t);
  if (!st && c->results) st = finish_results(c, &w);
  ebb_status end = ebb__task_end(&scope, st == EBB_OK); /* node_api.c: multi-grad "all" left incomplete */
  if (!st) st = end;
  ebb_grad_set_enabled(was, NULL);
  free(ready.a);
  task_free(&t);
  work_free(c, &w); /* (after the task: a leaf root's AccumulateGrad may be held by nothing else) */
  ebb__saved_hooks_leave(&hs);
  if (st && c->results)
    for (int i = 0; i < c->ninputs; i++)
      if (c->results[i]) {
        ebb_tensor_release(c->results[i]);
        c->results[i] = NULL;
      }
  return st;
}


static ebb_status call_here(struct ebb__call *c) {
  ebb__depth++;
  ebb__total_depth++;
  ebb_status st = execute_here(c);
  ebb__total_depth--;
  ebb__depth--;
  return st;
}

/* On a pool thread: the caller's streams current, its depth carried on, its status and message
 * carried back. */
static void call_pooled(void *arg) {
  struct ebb__call *c = arg;
  for (int d = 0; d < c->nstreams; d++)
    if (c->streams[d]) ebb_stream_set_current(c->streams[d]);
  ebb__total_depth = c->total_depth;
  c->msg[0] = '\0';
  char *prev = ebb__fail_divert(c->msg); /* (its failure is the caller's to report, not this thread's) */
  c->st = call_here(c);
  ebb__fail_divert(prev);
  for (int d = 0; d < c->nstreams; d++) { /* the pool thread's own defaults again */
    ebb_stream_t *def = NULL;
    if (!ebb_stream_default(d, &def)) ebb_stream_set_current(def);
  }
  ebb__total_depth = 0;
}

static ebb_status execute_in(struct ebb__call *c);

/* A backward call fails once: its steps (on this thread, device workers, a pool thread) build
 * one message without reporting it (ebb__fail_divert), and it is reported here, on the calling
 * thread, as this call's failure: that thread's last error and one error hook call. A call that
 * succeeds leaves both alone, whatever its steps met on the way. */
static ebb_status engine_execute(const char *fn, const ebb_tensor_t *const *roots, const ebb_gradient_edge *eroots,
                               const ebb_tensor_t *const *grad_roots, int nroots, bool retain, const ebb_tensor_t *const *inputs,
                               const ebb_gradient_edge *einputs, int ninputs, bool accumulate, bool allow_unused,
                               ebb_tensor_t **results) {
  struct ebb__call c = {.fn = fn, .roots = roots, .eroots = eroots, .grad_roots = grad_roots, .nroots = nroots, .retain = retain,
                        .inputs = inputs, .einputs = einputs, .ninputs = ninputs, .accumulate = accumulate,
                        .allow_unused = allow_unused, .results = results, .hooks = ebb__saved_hooks_now()};
  char msg[EBB__ERRMSG_MAX] = "";
  char *prev = ebb__fail_divert(msg);
  ebb_status st = execute_in(&c);
  ebb__fail_divert(prev);
  return st ? ebb__fail(st, "%s", msg) : EBB_OK;
}

static ebb_status execute_in(struct ebb__call *c) {
  if (ebb__depth == 0) return call_here(c);
  ebb__count(EBB__S_REENTRANT, 1);
  /* ebb__depth counts the calls this one is nested in, the outermost included. */
  if (ebb__depth <= atomic_load_explicit(&ebb__max_depth, memory_order_relaxed)) return call_here(c);
  /* Past the depth limit: a pool thread runs it (serving this thread's queue meanwhile), so this
   * stack grows no further. */
  ebb__count(EBB__S_HANDOFFS, 1);
  int n = 0;
  ebb_status st = ebb_dev_count(&n);
  if (!st && n > 0 && !(c->streams = calloc((size_t)n, sizeof *c->streams)))
    st = ebb__fail(EBB_ENOMEM, "%s: no host memory to hand a reentrant backward to a pool thread", c->fn);
  for (int d = 0; !st && d < n; d++) st = ebb_stream_current(d, &c->streams[d]);
  c->nstreams = n;
  c->total_depth = ebb__total_depth;
  if (!st) st = ebb__pool_run(call_pooled, c);
  free(c->streams);
  if (st) return st;
  return c->st ? ebb__fail(c->st, "%s", c->msg) : EBB_OK;
}

ebb_status ebb_backward(const ebb_tensor_t *const *roots, const ebb_tensor_t *const *grad_roots, int nroots, bool retain_graph,
                        const ebb_tensor_t *const *inputs, int ninputs) {
  return engine_execute("ebb_backward", roots, NULL, grad_roots, nroots, retain_graph, inputs, NULL, ninputs, true, false, NULL);
}

ebb_status ebb_backward_one(const ebb_tensor_t *loss) {
  static const char fn[] = "ebb_backward_one";
  ebb_status st = ebb__tensor_check(loss, fn, "loss");
  if (st) return st;
  char d[EBB__DESC_MAX];
  const struct ebb__meta *m = ebb__meta_of(loss);
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient; expected a loss computed from tensors that require "
                     "gradients", fn, ebb__tensor_desc(loss, "loss", -1, d, sizeof d));
  int64_t n = 0;
  ebb_tensor_numel(loss, &n);
  if (n != 1)
    return ebb__fail(EBB_EINVAL, "%s: %s has %lld elements; expected one (ebb_backward with grad_roots starts from a tensor of "
                     "more)", fn, ebb__tensor_desc(loss, "loss", -1, d, sizeof d), (long long)n);
  return engine_execute(fn, &loss, NULL, NULL, 1, false, NULL, NULL, 0, true, false, NULL);
}

ebb_status ebb_backward_edges(const ebb_gradient_edge *roots, const ebb_tensor_t *const *grad_roots, int nroots, bool retain_graph,
                              const ebb_gradient_edge *inputs, int ninputs) {
  return engine_execute("ebb_backward_edges", NULL, roots, grad_roots, nroots, retain_graph, NULL, inputs, ninputs, true, false, NULL);
}

ebb_status ebb_grad_edges(const ebb_gradient_edge *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                          const ebb_gradient_edge *inputs, int ninputs, bool retain_graph, bool allow_unused, ebb_tensor_t **grads) {
  if (!grads) return ebb__fail(EBB_EINVAL, "ebb_grad_edges: grads is NULL; expected an array of ninputs handles to fill");
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return engine_execute("ebb_grad_edges", NULL, outputs, grad_outputs, noutputs, retain_graph, NULL, inputs, ninputs, false,
                      allow_unused, grads);
}

bool ebb__task_will_execute(const struct ebb__task *t, const struct ebb_node *n) {
  int i = ebb__tfind(t, n);
  return i >= 0 && t->nodes[i].needed;
}

bool ebb__task_retains(const struct ebb__task *t) { return t->retain; }

ebb_status ebb_grad(const ebb_tensor_t *const *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                    const ebb_tensor_t *const *inputs, int ninputs, bool retain_graph, bool allow_unused, ebb_tensor_t **grads) {
  if (!grads) return ebb__fail(EBB_EINVAL, "ebb_grad: grads is NULL; expected an array of ninputs handles to fill");
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return engine_execute("ebb_grad", outputs, NULL, grad_outputs, noutputs, retain_graph, inputs, NULL, ninputs, false, allow_unused,
                      grads);
}

/* The options forms: one struct read by field name. A version this library does not know may
 * carry fields it would ignore, so it is refused rather than half-read. */
static ebb_status options_check(const char *fn, const void *opts, uint32_t version) {
  if (!opts) return ebb__fail(EBB_EINVAL, "%s: opts is NULL; expected options (zero-initialised for the defaults)", fn);
  if (version > EBB_AUTOGRAD_OPTIONS_VERSION)
    return ebb__fail(EBB_ENOTSUP, "%s: opts->version is %u; this library reads options up to version %d (0 means %d)", fn,
                     (unsigned)version, EBB_AUTOGRAD_OPTIONS_VERSION, EBB_AUTOGRAD_OPTIONS_VERSION);
  return EBB_OK;
}

ebb_status ebb_autograd_backward(const ebb_tensor_t *const *roots, int nroots, const ebb_autograd_backward_options *opts) {
  static const char fn[] = "ebb_autograd_backward";
  ebb_status st = options_check(fn, opts, opts ? opts->version : 0);
  if (st) return st;
  return engine_execute(fn, roots, NULL, opts->grad_roots, nroots, opts->retain_graph, opts->inputs, NULL, opts->ninputs, true, false,
                      NULL);
}

ebb_status ebb_autograd_grad(const ebb_tensor_t *const *outputs, int noutputs, const ebb_tensor_t *const *inputs, int ninputs,
                             ebb_tensor_t **grads, const ebb_autograd_grad_options *opts) {
  static const char fn[] = "ebb_autograd_grad";
  ebb_status st = options_check(fn, opts, opts ? opts->version : 0);
  if (st) return st;
  if (!grads) return ebb__fail(EBB_EINVAL, "%s: grads is NULL; expected an array of ninputs handles to fill", fn);
  for (int i = 0; i < ninputs; i++) grads[i] = NULL;
  return engine_execute(fn, outputs, NULL, opts->grad_outputs, noutputs, opts->retain_graph, inputs, NULL, ninputs, false,
                      opts->allow_unused, grads);
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
    char gd[EBB__DESC_MAX], td[EBB__DESC_MAX];
    if (!same || gi.dtype != ti.dtype || gi.device != ti.device)
      return ebb__fail(EBB_EINVAL, "%s: %s does not match %s; expected its shape, dtype and device", fn,
                       ebb__tensor_desc(grad, "grad", -1, gd, sizeof gd), ebb__tensor_desc(t, "t", -1, td, sizeof td));
    if (!m && !(m = ebb__meta_new(t))) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the tensor's autograd state", fn);
    ebb_tensor_retain((ebb_tensor_t *)grad);
    copy = (ebb_tensor_t *)grad;
  }
  if (!m) return EBB_OK;
  ebb__mutex_lock(&m->grad_mu);
  ebb_tensor_t *old = m->grad;
  m->grad = copy;
  m->grad_stream_id = 0; /* the caller's tensor: ready on the caller's streams, as it ordered them */
  ebb__mutex_unlock(&m->grad_mu);
  if (old) ebb_tensor_release(old);
  return EBB_OK;
}

/* ---- settings ---------------------------------------------------------------------------------- */

ebb_status ebb_autograd_set_engine_mode(ebb_engine_mode mode) {
  if (mode != EBB_ENGINE_AUTO && mode != EBB_ENGINE_WORKERS && mode != EBB_ENGINE_CALLING_THREAD)
    return ebb__fail(EBB_EINVAL, "ebb_autograd_set_engine_mode: mode %d is none of EBB_ENGINE_AUTO (0), EBB_ENGINE_WORKERS (1), "
                     "EBB_ENGINE_CALLING_THREAD (2)", (int)mode);
  atomic_store_explicit(&ebb__mode, (int)mode, memory_order_relaxed);
  return EBB_OK;
}

ebb_engine_mode ebb_autograd_engine_mode(void) { return (ebb_engine_mode)atomic_load_explicit(&ebb__mode, memory_order_relaxed); }

ebb_status ebb_autograd_set_max_reentrant_depth(int depth) {
  if (depth < 1 || depth > 1024)
    return ebb__fail(EBB_EINVAL, "ebb_autograd_set_max_reentrant_depth: depth %d; expected 1 to 1024 nested backward calls per thread",
                     depth);
  atomic_store_explicit(&ebb__max_depth, depth, memory_order_relaxed);
  return EBB_OK;
}

int ebb_autograd_max_reentrant_depth(void) { return atomic_load_explicit(&ebb__max_depth, memory_order_relaxed); }

ebb_status ebb_autograd_get_engine_stats(ebb_autograd_engine_stats *out) {
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_autograd_get_engine_stats: out is NULL; expected a stats struct to fill");
  uint64_t v[EBB__S_COUNT];
  for (int k = 0; k < EBB__S_COUNT; k++) v[k] = atomic_load_explicit(&ebb__stats[k], memory_order_relaxed);
  *out = (ebb_autograd_engine_stats){
      .backward_calls = v[EBB__S_CALLS],
      .nodes_run = v[EBB__S_NODES],
      .nodes_run_on_workers = v[EBB__S_NODES_W],
      .cross_stream_edges = v[EBB__S_XEDGES],
      .events_recorded = v[EBB__S_EVENTS],
      .stream_waits = v[EBB__S_WAITS],
      .accumulate_grad_stream_mismatches = v[EBB__S_MISM],
      .accumulate_grad_warnings = v[EBB__S_WARNS],
      .accumulate_grad_followed = v[EBB__S_FOLLOWED],
      .reentrant_backwards = v[EBB__S_REENTRANT],
      .reentrant_handoffs = v[EBB__S_HANDOFFS],
      .worker_parks = v[EBB__S_PARKS],
  };
  return EBB_OK;
}

void ebb__engine_stop(void) {
  ebb__workers_stop();
  ebb__offl_stop();
  for (int k = 0; k < EBB__S_COUNT; k++) atomic_store_explicit(&ebb__stats[k], 0, memory_order_relaxed);
  ebb__inbuf_stop();
}
