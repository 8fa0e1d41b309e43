/* map.c: ebb_map (include/ebb/map.h), a function over the slices along dim 0 of some tensors,
 * stacked, differentiated as one custom function ("Map", ebb/function.h).
 *
 * The node's inputs are xs then args; its outputs the stacked results. Two ways to differentiate:
 * - save: the forward turns grad mode on again inside the function (whose forward runs with it
 *   off), gives fn detached leaves (a slice of each x, each arg) that require a gradient where the
 *   node's input needs one, and keeps, in the ctx's user data, gradient edges to each slice's
 *   results (the roots of the slice's graph) and to those leaves. The backward is one
 *   ebb_grad_edges from every root to every leaf (a backward started inside a node: the engine's
 *   reentrant backward), so the engine sums the args' gradients over the slices as it sums a
 *   leaf's over its uses; each slice's x gradient is copied into its place in the stacked one.
 * - checkpoint: the forward runs fn with grad mode off and saves the node's inputs; the backward
 *   runs each slice again with grad mode on, last first, then a backward from its results into
 *   its leaves' .grad (the args' leaves live through all slices, so theirs is the sum), and frees
 *   the slice's graph before the next one.
 * With nothing to record, ebb_map is the loop and the copies into the stacked outputs, no node.
 * The user data (struct map_state) is freed with the node (its destructor), or, in save mode, its
 * slices' graphs as soon as a backward that does not retain the graph has used them.
 * Threading: nothing shared between calls but the definitions, made once. A node's state is used
 * by its backward; concurrent backward calls through one node need retain_graph on all of them,
 * as for any node.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/autograd.h"
#include "ebb/function.h"
#include "ebb/map.h"
#include "ebb/ops.h"
#include "ebb_internal.h"
#include "ops_export.h"

_Static_assert(EBB_MAP_MAX_INPUTS <= EBB_FUNCTION_MAX_INPUTS, "a map's inputs are its node's");
_Static_assert(EBB_MAP_MAX_OUTPUTS <= EBB_FUNCTION_MAX_OUTPUTS, "a map's outputs are its node's");

static const char FN[] = "ebb_map";

/* What one call of ebb_map asks (apply's args, for the forward). */
struct map_call {
  ebb_map_fn fn;
  void *user;
  int nxs, nargs, noutputs;
  int64_t n; /* slices */
  bool checkpoint;
};

/* The node's user data: the call, the layouts of the xs and of slice 0's outputs (what every
 * slice must give), and, in save mode, the slices' graphs. Those are kept as gradient edges, not
 * tensors: an edge holds the node (and the graph below it) but not the tensor's memory, so the
 * slices' results need not stay beside their copies in the stacked outputs, and a slice's leaf
 * lives on in its AccumulateGrad node. */
struct map_state {
  struct map_call c;
  ebb_tensor_info *xmeta;     /* [nxs]: device, dtype, shape of each x */
  ebb_tensor_info *ometa;     /* [noutputs]: device, dtype, shape of slice 0's outputs */
  ebb_gradient_edge *oedge;   /* save: [noutputs * n], output-major: where result k of slice s enters its graph
                                 (node NULL: it requires no gradient) */
  ebb_gradient_edge *xedge;   /* save: [n * nxs]: slice s of x i as fn saw it, a leaf (node NULL: x i needs no gradient) */
  ebb_gradient_edge *argedge; /* save: [nargs]: arg j as fn saw it, a leaf (node NULL: it needs no gradient) */
  _Atomic bool released;      /* save: a backward without retain_graph freed the slices' graphs */
};

/* ---- messages ---------------------------------------------------------------------------------- */

/* A failure of a call made on the map's behalf: its message kept after "ebb_map: ". */
static ebb_status fail_in(ebb_status st, const char *what) {
  char why[EBB__ERRMSG_MAX];
  snprintf(why, sizeof why, "%s", ebb_last_error());
  return ebb__fail(st, "%s: %s%s", FN, what ? what : "", why);
}

static const char *shape_str(const ebb_tensor_info *ti, char *buf, size_t cap) {
  size_t o = (size_t)snprintf(buf, cap, "%s[", ebb_dtype_name(ti->dtype));
  for (int d = 0; d < ti->ndim && o < cap; d++) o += (size_t)snprintf(buf + o, cap - o, d ? ", %lld" : "%lld", (long long)ti->shape[d]);
  if (o < cap) o += (size_t)snprintf(buf + o, cap - o, "] on ");
  if (o < cap) {
    if (ti->device == EBB_DEVICE_CPU)
      snprintf(buf + o, cap - o, "the CPU");
    else
      snprintf(buf + o, cap - o, "device %d", ti->device);
  }
  return buf;
}

static bool same_layout(const ebb_tensor_info *a, const ebb_tensor_info *b) {
  return a->device == b->device && a->dtype == b->dtype && a->ndim == b->ndim &&
         memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

/* fn's output k at slice s: set, and laid out as slice 0's (ref; NULL: this is slice 0, whose
 * layout is recorded into *got). `when` says which run it was (the forward or the backward's). */
static ebb_status check_output(const struct map_call *c, int64_t s, int k, const ebb_tensor_t *o, const ebb_tensor_info *ref,
                               ebb_tensor_info *got, const char *when) {
  if (!o)
    return ebb__fail(EBB_EINVAL, "%s: fn left outputs[%d] NULL at slice %lld%s; expected noutputs (%d) new tensors from each call",
                     FN, k, (long long)s, when, c->noutputs);
  ebb_status st = ebb__tensor_check_at(o, FN, "fn's outputs", k);
  if (!st) st = ebb_tensor_get_info(o, got);
  if (st) return fail_in(st, "");
  if (ref && !same_layout(ref, got)) {
    char a[EBB__DESC_MAX], b[160];
    return ebb__fail(EBB_EINVAL, "%s: fn gave %s at slice %lld%s, where slice 0 gave %s; expected the same shape, dtype and device from every slice",
                     FN, ebb__tensor_desc(o, "outputs", k, a, sizeof a), (long long)s, when, shape_str(ref, b, sizeof b));
  }
  return EBB_OK;
}

/* Runs fn on one slice; on failure nothing is left in outs[0..noutputs). */
static ebb_status call_fn(const struct map_call *c, int64_t s, const ebb_tensor_t *const *xsl, const ebb_tensor_t *const *args,
                          ebb_tensor_t **outs, const char *when) {
  for (int k = 0; k < c->noutputs; k++) outs[k] = NULL;
  uint64_t serial = ebb__fail_serial();
  ebb_status st = c->fn(xsl, c->nxs, args, c->nargs, outs, c->noutputs, c->user);
  if (st) {
    for (int k = 0; k < c->noutputs; k++) {
      if (outs[k]) ebb_tensor_release(outs[k]);
      outs[k] = NULL;
    }
    char what[96];
    snprintf(what, sizeof what, "fn failed at slice %lld%s: ", (long long)s, when);
    if (ebb__fail_serial() != serial) return fail_in(st, what);
    return ebb__fail(st, "%s: %sit returned %s (%s) with no message of its own", FN, what, ebb_status_name(st), ebb_status_str(st));
  }
  return EBB_OK;
}

static void release_all(ebb_tensor_t **ts, size_t n) {
  if (!ts) return;
  for (size_t i = 0; i < n; i++) {
    if (ts[i]) ebb_tensor_release(ts[i]);
    ts[i] = NULL;
  }
}

/* ---- the state -------------------------------------------------------------------------------- */

static void release_edges(ebb_gradient_edge *es, size_t n) {
  if (!es) return;
  for (size_t i = 0; i < n; i++) {
    if (es[i].node) ebb_gradient_edge_release(&es[i]);
  }
}

static void state_free_graphs(struct map_state *m) {
  release_edges(m->oedge, (size_t)m->c.noutputs * (size_t)m->c.n);
  release_edges(m->xedge, (size_t)m->c.nxs * (size_t)m->c.n);
  release_edges(m->argedge, (size_t)m->c.nargs);
}

static void state_free(void *p) {
  struct map_state *m = p;
  if (!m) return;
  state_free_graphs(m);
  free(m->oedge);
  free(m->xedge);
  free(m->argedge);
  free(m->ometa);
  free(m->xmeta);
  free(m);
}

static ebb_status state_new(const struct map_call *c, bool save, struct map_state **out) {
  struct map_state *m = calloc(1, sizeof *m);
  if (!m) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the map's state", FN);
  m->c = *c;
  m->ometa = calloc((size_t)c->noutputs, sizeof *m->ometa);
  m->xmeta = calloc((size_t)c->nxs, sizeof *m->xmeta);
  bool ok = m->ometa && m->xmeta;
  if (ok && save) {
    m->oedge = calloc((size_t)c->noutputs * (size_t)c->n, sizeof *m->oedge);
    m->xedge = calloc((size_t)c->nxs * (size_t)c->n, sizeof *m->xedge);
    m->argedge = calloc((size_t)(c->nargs > 0 ? c->nargs : 1), sizeof *m->argedge);
    ok = m->oedge && m->xedge && m->argedge;
  }
  if (!ok) {
    state_free(m);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the state of %lld slices", FN, (long long)c->n);
  }
  *out = m;
  return EBB_OK;
}

/* ---- the slices ------------------------------------------------------------------------------- */

/* Slice s of x for fn: a view of x (leaf false), or a detached leaf that requires a gradient
 * (leaf true; x is then a detached handle, so the select records nothing). */
static ebb_status slice_of(const ebb_tensor_t *x, int64_t s, bool leaf, ebb_tensor_t **out) {
  ebb_tensor_t *v = NULL;
  ebb_status st = ebb_tensor_select(x, 0, s, &v);
  if (st || !leaf) {
    *out = v;
    return st ? fail_in(st, "") : EBB_OK;
  }
  st = ebb_tensor_detach(v, out);
  ebb_tensor_release(v);
  if (!st) st = ebb_tensor_set_requires_grad(*out, true);
  if (st) {
    if (*out) ebb_tensor_release(*out);
    *out = NULL;
    return fail_in(st, "");
  }
  return EBB_OK;
}

/* Output k's stacked tensor, made from slice 0's output layout. */
static ebb_status stacked_new(const ebb_tensor_info *ti, int64_t n, ebb_tensor_t **out) {
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  if (ti->ndim + 1 > EBB_TENSOR_MAX_DIMS) {
    char b[160];
    return ebb__fail(EBB_EINVAL, "%s: fn gave %s, which has no room for the stacking dim; expected at most %d dims", FN,
                     shape_str(ti, b, sizeof b), EBB_TENSOR_MAX_DIMS - 1);
  }
  shape[0] = n;
  memcpy(shape + 1, ti->shape, sizeof(int64_t) * (size_t)ti->ndim);
  ebb_status st = ebb_tensor_empty(ti->device, ti->dtype, ti->ndim + 1, shape, out);
  return st ? fail_in(st, "") : EBB_OK;
}

/* dst[s] = src (the callers turn grad mode off: nothing is recorded). */
static ebb_status copy_into(ebb_tensor_t *dst, int64_t s, const ebb_tensor_t *src) {
  ebb_tensor_t *v = NULL;
  ebb_status st = ebb_tensor_select(dst, 0, s, &v);
  if (!st) st = ebb_tensor_copy_(v, src);
  if (v) ebb_tensor_release(v);
  return st ? fail_in(st, "") : EBB_OK;
}

/* The forward loop. xs and args are what fn gets at each slice: the caller's tensors (plain: no
 * node, or a checkpoint forward), or detached handles (save: leaves for the slices and args that
 * need a gradient, need[] saying which, from the node's inputs). Fills outputs[0..noutputs)
 * with the stacked results and, with m, m->ometa (and in save mode the graphs). Runs fn with
 * grad mode `grad`; stacks with it off. */
static ebb_status run_forward(const struct map_call *c, const ebb_tensor_t *const *xs, const ebb_tensor_t *const *args,
                              const bool *need, bool grad, struct map_state *m, ebb_tensor_t **outputs) {
  ebb_tensor_t *xsl[EBB_MAP_MAX_INPUTS], *outs[EBB_MAP_MAX_OUTPUTS];
  ebb_tensor_info first[EBB_MAP_MAX_OUTPUTS], got;
  bool save = m && m->oedge;
  ebb_status st = EBB_OK;
  for (int k = 0; k < c->noutputs; k++) outputs[k] = NULL;
  for (int64_t s = 0; s < c->n && !st; s++) {
    for (int i = 0; i < c->nxs; i++) xsl[i] = NULL;
    for (int k = 0; k < c->noutputs; k++) outs[k] = NULL; /* (released below, whether fn ran or not) */
    bool was;
    ebb_grad_set_enabled(grad, &was);
    for (int i = 0; i < c->nxs && !st; i++) st = slice_of(xs[i], s, save && need[i], &xsl[i]);
    if (!st) st = call_fn(c, s, (const ebb_tensor_t *const *)xsl, args, outs, "");
    ebb_grad_set_enabled(was, NULL);
    for (int k = 0; k < c->noutputs && !st; k++) st = check_output(c, s, k, outs[k], s ? &first[k] : NULL, s ? &got : &first[k], "");
    for (int k = 0; k < c->noutputs && !st && s == 0; k++) st = stacked_new(&first[k], c->n, &outputs[k]);
    ebb_grad_set_enabled(false, &was); /* (the copies record nothing, whatever fn's outputs hold) */
    for (int k = 0; k < c->noutputs && !st; k++) st = copy_into(outputs[k], s, outs[k]);
    ebb_grad_set_enabled(was, NULL);
    /* save: the backward's inputs (the leaves) and roots (the results that require a gradient) */
    for (int i = 0; i < c->nxs && !st && save; i++) {
      if (need[i] && (st = ebb_tensor_gradient_edge(xsl[i], &m->xedge[(size_t)s * (size_t)c->nxs + (size_t)i])))
        st = fail_in(st, "");
    }
    for (int k = 0; k < c->noutputs && !st && save; k++) {
      bool rg = false;
      st = ebb_tensor_requires_grad(outs[k], &rg);
      if (!st && rg) st = ebb_tensor_gradient_edge(outs[k], &m->oedge[(size_t)k * (size_t)c->n + (size_t)s]);
      if (st) st = fail_in(st, "");
    }
    release_all(xsl, (size_t)c->nxs);
    release_all(outs, (size_t)c->noutputs);
  }
  if (st) {
    release_all(outputs, (size_t)c->noutputs);
    return st;
  }
  if (m) memcpy(m->ometa, first, sizeof(ebb_tensor_info) * (size_t)c->noutputs);
  return EBB_OK;
}

/* ---- the node --------------------------------------------------------------------------------- */

static ebb_status map_forward(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs, const void *args,
                              ebb_tensor_t **outputs, int noutputs) {
  const struct map_call *c = args;
  (void)noutputs;
  bool need[EBB_MAP_MAX_INPUTS];
  ebb_status st = ebb_ctx_set_materialize_grads(ctx, false); /* an output no gradient reached: skipped, not zeros */
  for (int i = 0; i < ninputs && !st; i++) st = ebb_ctx_needs_input_grad(ctx, i, &need[i]);
  if (st) return fail_in(st, "");
  struct map_state *m = NULL;
  st = state_new(c, !c->checkpoint, &m);
  if (st) return st;
  for (int i = 0; i < c->nxs; i++) ebb_tensor_get_info(inputs[i], &m->xmeta[i]); /* (checked by ebb_map) */
  if (c->checkpoint) {
    st = run_forward(c, inputs, inputs + c->nxs, need, false, m, outputs);
    if (!st && (st = ebb_ctx_save_for_backward(ctx, inputs, ninputs))) st = fail_in(st, "");
  } else {
    /* fn sees detached handles, so its graph ends at leaves of the map's own and never reaches
     * the caller's history (the node is what connects to it). */
    ebb_tensor_t *det[EBB_MAP_MAX_INPUTS] = {0};
    for (int i = 0; i < ninputs && !st; i++) st = ebb_tensor_detach(inputs[i], &det[i]);
    for (int j = 0; j < c->nargs && !st; j++) {
      if (need[c->nxs + j]) st = ebb_tensor_set_requires_grad(det[c->nxs + j], true);
    }
    if (st) st = fail_in(st, "");
    if (!st) st = run_forward(c, (const ebb_tensor_t *const *)det, (const ebb_tensor_t *const *)det + c->nxs, need, true, m, outputs);
    for (int j = 0; j < c->nargs && !st; j++) {
      if (need[c->nxs + j] && (st = ebb_tensor_gradient_edge(det[c->nxs + j], &m->argedge[j]))) st = fail_in(st, "");
    }
    release_all(det, (size_t)ninputs);
  }
  if (!st) st = ebb_ctx_set_user(ctx, m, state_free);
  if (st) {
    release_all(outputs, (size_t)c->noutputs);
    state_free(m);
    return st;
  }
  return EBB_OK;
}

/* The zeros the gradient of x i starts as (its slices written as they come). */
static ebb_status gx_new(const struct map_state *m, int i, ebb_tensor_t **out) {
  const ebb_tensor_info *ti = &m->xmeta[i];
  ebb_status st = ebb_tensor_zeros(ti->device, ti->dtype, ti->ndim, ti->shape, out);
  return st ? fail_in(st, "") : EBB_OK;
}

/* Checkpoint mode: slice s run again from the saved inputs with grad mode on, and a backward from
 * its results to its leaves (the slices' where need[i], the args' argleaf where not NULL), which
 * adds into their .grad: a slice's x gradient is copied into gx, the args' sum up in their leaves'
 * .grad over the slices (in place, each slice's weight gradient freed as soon as it is added, as
 * the engine does for any leaf). The slice's graph is freed before the next one. */
static ebb_status recompute_vjp(const struct map_state *m, int64_t s, const ebb_tensor_t *const *saved, const bool *need,
                                ebb_tensor_t *const *argleaf, const ebb_tensor_t *const *argin, const ebb_tensor_t *const *grad_outputs,
                                ebb_tensor_t *const *gx) {
  const struct map_call *c = &m->c;
  ebb_tensor_t *xsl[EBB_MAP_MAX_INPUTS] = {0}, *outs[EBB_MAP_MAX_OUTPUTS] = {0}, *groots[EBB_MAP_MAX_OUTPUTS] = {0};
  const ebb_tensor_t *roots[EBB_MAP_MAX_OUTPUTS], *inputs[EBB_MAP_MAX_INPUTS];
  int nroots = 0, nin = 0;
  ebb_status st = EBB_OK;
  bool was;
  ebb_grad_set_enabled(true, &was);
  for (int i = 0; i < c->nxs && !st; i++) {
    ebb_tensor_t *det = NULL;
    if ((st = ebb_tensor_detach(saved[i], &det))) {
      st = fail_in(st, "");
      break;
    }
    st = slice_of(det, s, need[i], &xsl[i]);
    ebb_tensor_release(det);
  }
  if (!st) st = call_fn(c, s, (const ebb_tensor_t *const *)xsl, argin, outs, " (run again in the backward)");
  ebb_grad_set_enabled(was, NULL);
  ebb_tensor_info got;
  for (int k = 0; k < c->noutputs && !st; k++) {
    st = check_output(c, s, k, outs[k], &m->ometa[k], &got, " (run again in the backward)");
    bool rg = false;
    if (!st && grad_outputs[k] && !(st = ebb_tensor_requires_grad(outs[k], &rg)) && rg) {
      if ((st = ebb_tensor_select(grad_outputs[k], 0, s, &groots[nroots]))) st = fail_in(st, "");
      else roots[nroots++] = outs[k];
    }
  }
  for (int i = 0; i < c->nxs; i++) {
    if (need[i]) inputs[nin++] = xsl[i];
  }
  for (int j = 0; j < c->nargs; j++) {
    if (argleaf[j]) inputs[nin++] = argleaf[j];
  }
  if (!st && nroots > 0 && nin > 0) {
    ebb_autograd_backward_options o = {.version = EBB_AUTOGRAD_OPTIONS_VERSION,
                                       .grad_roots = (const ebb_tensor_t *const *)groots,
                                       .inputs = inputs,
                                       .ninputs = nin};
    st = ebb_autograd_backward(roots, nroots, &o);
    for (int i = 0; i < c->nxs && !st; i++) {
      ebb_tensor_t *g = NULL;
      if (need[i] && !(st = ebb_tensor_grad(xsl[i], &g)) && g) {
        st = copy_into(gx[i], s, g);
        ebb_tensor_release(g);
      }
    }
  }
  release_all(groots, (size_t)nroots);
  release_all(outs, (size_t)c->noutputs);
  release_all(xsl, (size_t)c->nxs);
  return st;
}

static ebb_status backward_checkpoint(ebb_function_ctx *ctx, const struct map_state *m, const bool *need,
                                      const ebb_tensor_t *const *grad_outputs, ebb_tensor_t **grad_inputs) {
  const struct map_call *c = &m->c;
  const ebb_tensor_t *const *saved = NULL;
  int nsaved = 0;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &saved, &nsaved);
  if (st) return fail_in(st, "");
  /* The args fn gets again: detached, and leaves requiring a gradient where one is wanted (then
   * inputs of each slice's backward too, their .grad the sum over the slices). */
  ebb_tensor_t *argdet[EBB_MAP_MAX_INPUTS] = {0}, *argleaf[EBB_MAP_MAX_INPUTS] = {0};
  for (int j = 0; j < c->nargs && !st; j++) {
    st = ebb_tensor_detach(saved[c->nxs + j], &argdet[j]);
    if (!st && need[c->nxs + j]) st = ebb_tensor_set_requires_grad(argdet[j], true);
    if (st) st = fail_in(st, "");
    else if (need[c->nxs + j]) argleaf[j] = argdet[j];
  }
  ebb_tensor_t *gx[EBB_MAP_MAX_INPUTS] = {0};
  for (int i = 0; i < c->nxs && !st; i++) {
    if (need[i]) st = gx_new(m, i, &gx[i]);
  }
  /* Last slice first, as the loop's backward would run them. */
  for (int64_t s = c->n - 1; s >= 0 && !st; s--)
    st = recompute_vjp(m, s, saved, need, argleaf, (const ebb_tensor_t *const *)argdet, grad_outputs, gx);
  for (int j = 0; j < c->nargs && !st; j++) {
    if (argleaf[j] && (st = ebb_tensor_grad(argleaf[j], &grad_inputs[c->nxs + j]))) st = fail_in(st, "");
  }
  release_all(argdet, (size_t)c->nargs);
  if (st) {
    release_all(gx, (size_t)c->nxs);
    release_all(grad_inputs + c->nxs, (size_t)c->nargs);
    return st;
  }
  for (int i = 0; i < c->nxs; i++) grad_inputs[i] = gx[i];
  return EBB_OK;
}

/* Save mode: one backward over every slice's graph at once (roots: each result that requires a
 * gradient and got one; inputs: the leaves wanted), so the engine sums the args' gradients as it
 * sums any leaf's over its uses, in the order the loop's backward would run. */
static ebb_status backward_saved(struct map_state *m, const bool *need, const ebb_tensor_t *const *grad_outputs,
                                 ebb_tensor_t **grad_inputs, bool retain) {
  const struct map_call *c = &m->c;
  size_t nr = 0, ni = 0, maxr = (size_t)c->noutputs * (size_t)c->n, maxi = (size_t)c->nxs * (size_t)c->n + (size_t)c->nargs;
  ebb_gradient_edge *roots = malloc(maxr * sizeof *roots), *inputs = malloc(maxi * sizeof *inputs);
  ebb_tensor_t **groots = calloc(maxr, sizeof *groots), **grads = calloc(maxi, sizeof *grads);
  int *where = malloc(maxi * sizeof *where);
  ebb_tensor_t *gx[EBB_MAP_MAX_INPUTS] = {0};
  ebb_status st = EBB_OK;
  if (!roots || !inputs || !groots || !grads || !where)
    st = ebb__fail(EBB_ENOMEM, "%s: no host memory for the backward of %lld slices", FN, (long long)c->n);
  for (int k = 0; k < c->noutputs && !st; k++) {
    for (int64_t s = 0; s < c->n && !st && grad_outputs[k]; s++) {
      const ebb_gradient_edge *e = &m->oedge[(size_t)k * (size_t)c->n + (size_t)s];
      if (!e->node) continue;
      if ((st = ebb_tensor_select(grad_outputs[k], 0, s, &groots[nr]))) st = fail_in(st, "");
      else roots[nr++] = *e;
    }
  }
  for (int64_t s = 0; s < c->n && !st; s++) {
    for (int i = 0; i < c->nxs; i++) {
      if (need[i]) where[ni] = i, inputs[ni++] = m->xedge[(size_t)s * (size_t)c->nxs + (size_t)i];
    }
  }
  for (int j = 0; j < c->nargs && !st; j++) {
    if (need[c->nxs + j]) where[ni] = c->nxs + j, inputs[ni++] = m->argedge[j];
  }
  if (!st && nr > 0 && ni > 0)
    st = ebb_grad_edges(roots, (const ebb_tensor_t *const *)groots, (int)nr, inputs, (int)ni, retain, true, grads);
  for (int i = 0; i < c->nxs && !st; i++) {
    if (need[i]) st = gx_new(m, i, &gx[i]);
  }
  /* x i's gradients come one slice after another (inputs in slice order); each is written into
   * its place in the stacked gradient. The args' come whole. */
  int64_t slice[EBB_MAP_MAX_INPUTS] = {0};
  for (size_t q = 0; q < ni && !st; q++) {
    int i = where[q];
    if (i < c->nxs) {
      if (grads[q]) st = copy_into(gx[i], slice[i], grads[q]);
      slice[i]++;
    } else {
      grad_inputs[i] = grads[q];
      grads[q] = NULL;
    }
  }
  if (grads) release_all(grads, ni);
  if (groots) release_all(groots, nr);
  free(roots);
  free(inputs);
  free(groots);
  free(grads);
  free(where);
  if (st) {
    release_all(gx, (size_t)c->nxs);
    release_all(grad_inputs + c->nxs, (size_t)c->nargs);
    return st;
  }
  for (int i = 0; i < c->nxs; i++) grad_inputs[i] = gx[i];
  return EBB_OK;
}

static ebb_status map_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *grad_outputs, int noutputs, ebb_tensor_t **grad_inputs,
                               int *ngrad_inputs) {
  struct map_state *m = ebb_ctx_user(ctx);
  const struct map_call *c = &m->c;
  int nin = c->nxs + c->nargs;
  bool need[EBB_MAP_MAX_INPUTS], any = false;
  (void)noutputs;
  (void)ngrad_inputs;
  for (int i = 0; i < nin; i++) {
    ebb_status st = ebb_ctx_needs_input_grad(ctx, i, &need[i]);
    if (st) return fail_in(st, "");
    any |= need[i];
  }
  if (!any) return EBB_OK;
  if (c->checkpoint) return backward_checkpoint(ctx, m, need, grad_outputs, grad_inputs);
  if (atomic_load_explicit(&m->released, memory_order_acquire)) /* pairs with the release store below */
    return ebb__fail(EBB_ESTATE, "%s: the graphs of the map's %lld slices were freed by an earlier backward; expected "
                                 "retain_graph on that backward to run through them again", FN, (long long)c->n);
  /* an input whose gradient the forward did not prepare for (it required none then) has no
   * leaves to take one from */
  for (int i = 0; i < nin; i++) {
    if (need[i] && (i < c->nxs ? m->xedge[i].node == NULL : m->argedge[i - c->nxs].node == NULL)) need[i] = false;
  }
  /* The slices' graphs go as the engine frees saved tensors: after a backward that does not
   * retain the graph (theirs were freed by it), with the edges that hold them. */
  bool retain = ebb__current_task_retains();
  ebb_status st = backward_saved(m, need, grad_outputs, grad_inputs, retain);
  if (!retain) {
    atomic_store_explicit(&m->released, true, memory_order_release);
    state_free_graphs(m);
  }
  return st;
}

/* One definition per output count (a definition fixes it), made once, static: the nodes
 * borrow them. */
static ebb_function map_defs[EBB_MAP_MAX_OUTPUTS];
static pthread_once_t map_defs_once = PTHREAD_ONCE_INIT;

static void map_defs_init(void) {
  for (int k = 0; k < EBB_MAP_MAX_OUTPUTS; k++) {
    map_defs[k] = (ebb_function){.version = EBB_FUNCTION_VERSION,
                                 .name = "Map",
                                 .noutputs = k + 1,
                                 .forward = map_forward,
                                 .backward = map_backward};
  }
}

/* ---- ebb_map ---------------------------------------------------------------------------------- */

static ebb_status check_inputs(ebb_map_fn fn, const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs,
                               const ebb_map_options *opts, ebb_tensor_t **outputs, int noutputs, int64_t *n) {
  if (!fn) return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected the function to run on each slice", FN);
  if (!outputs) return ebb__fail(EBB_EINVAL, "%s: outputs is NULL; expected an array of noutputs handles to fill", FN);
  if (noutputs < 1 || noutputs > EBB_MAP_MAX_OUTPUTS)
    return ebb__fail(EBB_EINVAL, "%s: noutputs is %d; expected 1..%d", FN, noutputs, EBB_MAP_MAX_OUTPUTS);
  if (!xs) return ebb__fail(EBB_EINVAL, "%s: xs is NULL; expected nxs tensors to slice along dim 0", FN);
  if (nxs < 1) return ebb__fail(EBB_EINVAL, "%s: nxs is %d; expected at least 1 tensor to slice along dim 0", FN, nxs);
  if (nargs < 0) return ebb__fail(EBB_EINVAL, "%s: nargs is %d; expected 0 or more", FN, nargs);
  if (nargs > 0 && !args) return ebb__fail(EBB_EINVAL, "%s: args is NULL with nargs %d; expected nargs tensors", FN, nargs);
  if (nxs + nargs > EBB_MAP_MAX_INPUTS)
    return ebb__fail(EBB_EINVAL, "%s: nxs + nargs is %d + %d; expected at most %d tensors in all", FN, nxs, nargs, EBB_MAP_MAX_INPUTS);
  if (opts && opts->version > EBB_MAP_OPTIONS_VERSION)
    return ebb__fail(EBB_ENOTSUP, "%s: opts->version is %u, newer than this library reads (%u); expected 0 or %u", FN, opts->version,
                     EBB_MAP_OPTIONS_VERSION, EBB_MAP_OPTIONS_VERSION);
  ebb_status st;
  ebb_tensor_info t0, ti;
  for (int i = 0; i < nxs; i++) {
    st = ebb__tensor_check_at(xs[i], FN, "xs", i);
    if (st) return st;
    ebb_tensor_get_info(xs[i], &ti);
    char a[EBB__DESC_MAX], b[EBB__DESC_MAX];
    if (ti.ndim == 0)
      return ebb__fail(EBB_EINVAL, "%s: %s has 0 dimensions; expected a tensor with a dim 0 to map over", FN,
                       ebb__tensor_desc(xs[i], "xs", i, a, sizeof a));
    if (i == 0) {
      t0 = ti;
    } else if (ti.shape[0] != t0.shape[0]) {
      return ebb__fail(EBB_EINVAL, "%s: %s and %s have different leading dims (%lld, %lld); expected the same number of slices in every x",
                       FN, ebb__tensor_desc(xs[0], "xs", 0, a, sizeof a), ebb__tensor_desc(xs[i], "xs", i, b, sizeof b),
                       (long long)t0.shape[0], (long long)ti.shape[0]);
    }
  }
  if (t0.shape[0] == 0) {
    char a[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s: %s has a leading dim of 0; expected at least one slice (fn's results give the outputs' shapes)", FN,
                     ebb__tensor_desc(xs[0], "xs", 0, a, sizeof a));
  }
  for (int j = 0; j < nargs; j++) {
    st = ebb__tensor_check_at(args[j], FN, "args", j);
    if (st) return st;
  }
  *n = t0.shape[0];
  return EBB_OK;
}

ebb_status ebb_map(ebb_map_fn fn, void *user, const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs,
                   const ebb_map_options *opts, ebb_tensor_t **outputs, int noutputs) {
  int64_t n = 0;
  if (outputs && noutputs > 0 && noutputs <= EBB_MAP_MAX_OUTPUTS) {
    for (int k = 0; k < noutputs; k++) outputs[k] = NULL;
  }
  ebb_status st = check_inputs(fn, xs, nxs, args, nargs, opts, outputs, noutputs, &n);
  if (st) return st;
  struct map_call c = {.fn = fn, .user = user, .nxs = nxs, .nargs = nargs, .noutputs = noutputs, .n = n,
                       .checkpoint = opts && opts->checkpoint};
  /* Whether a node is recorded: grad mode on and an input requiring a gradient (the rule of
   * ebb_function_apply, checked here so a map without one costs no function call). */
  bool record = false;
  if (ebb_grad_enabled()) {
    for (int i = 0; i < nxs + nargs && !record; i++) {
      bool rg = false;
      ebb_tensor_requires_grad(i < nxs ? xs[i] : args[i - nxs], &rg);
      record = rg;
    }
  }
  if (!record) return run_forward(&c, xs, args, NULL, ebb_grad_enabled(), NULL, outputs);
  const ebb_tensor_t *inputs[EBB_MAP_MAX_INPUTS];
  for (int i = 0; i < nxs; i++) inputs[i] = xs[i];
  for (int j = 0; j < nargs; j++) inputs[nxs + j] = args[j];
  pthread_once(&map_defs_once, map_defs_init);
  st = ebb_function_apply(&map_defs[noutputs - 1], inputs, nxs + nargs, &c, outputs);
  if (st) {
    /* The message starts with the call the caller made: the forward's own ("ebb_map: ...", after
     * apply's account of it) as it is, apply's other refusals after "ebb_map: ". */
    char why[EBB__ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", ebb_last_error());
    const char *own = strstr(why, "ebb_map: ");
    return own ? ebb__fail(st, "%s", own) : ebb__fail(st, "%s: %s", FN, why);
  }
  return EBB_OK;
}
