/* inplace.c: in-place ops recorded by autograd, views that follow their base's history, and
 * inference mode.
 *
 * An in-place op on a tensor that requires a gradient (or from a src that does) becomes the
 * tensor's new grad_fn, whose input 0 is the tensor's old value: its history is rebased. On a
 * view, the base's history is rebased instead (CopySlices: the base's new grad_fn routes the part
 * of its gradient the view covers through the op's backward and the rest to the base's old
 * grad_fn), and every view of that base takes its grad_fn again from the base's when next read
 * (AsStridedBackward), which a view notices by its storage's version having moved on. Leaves that
 * require a gradient, and views of them, are refused with grad mode on.
 *
 * The inplace hook prepares everything that can fail (nodes, metas, saved tensors) before ops
 * changes dst; the done hook then only swaps pointers, or drops what was prepared.
 *
 * Threading: an in-place op writes its tensor and base (the caller orders it with their other
 * users, as for the data). A view's grad_fn may be taken again by any thread that reads it, under
 * ebb__view_mu; readers that find it current read it through an acquire of its version.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "runtime_export.h"
#include "autograd_impl.h"

static ebb_mutex ebb__view_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.views", EBB_RANK_AG_VIEW};

/* ---- inference mode --------------------------------------------------------------------------- */

bool ebb_inference_mode_enabled(void) { return ebb__inference_on(); }

void ebb_inference_mode_set_enabled(bool enabled, bool *was) {
  if (was) *was = ebb__inference_on();
  ebb__inference_set(enabled);
}

ebb_status ebb_tensor_is_inference(const ebb_tensor_t *t, bool *out) {
  ebb_status st = ebb__tensor_check(t, "ebb_tensor_is_inference", "t");
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_tensor_is_inference: out is NULL; expected a bool to fill");
  *out = ebb__tensor_is_inference(t);
  return EBB_OK;
}

/* ---- views ------------------------------------------------------------------------------------- */

/* The edge into base's history (a new reference in e->fn; NULL when base needs no gradient). */
static ebb_status base_edge(ebb_tensor_t *base, struct ebb__meta *bm, struct ebb__edge *e) {
  *e = (struct ebb__edge){.fn = NULL};
  if (!bm || !bm->requires_grad) return EBB_OK;
  if (bm->grad_fn) {
    atomic_fetch_add_explicit(&bm->grad_fn->refs, 1, memory_order_relaxed);
    *e = (struct ebb__edge){.fn = bm->grad_fn, .input_nr = bm->output_nr};
    return EBB_OK;
  }
  return ebb__grad_acc(base, bm, &e->fn);
}

/* A node of op whose args.geom says where `view` lies in `base`, input 0 being base (nin
 * inputs); one reference. in_meta has nin + 1 entries, as a recorded node's: [nin] is its output's
 * (the base for CopySlices, the view for AsStridedBackward), which ebb_node_input_meta reads. */
static struct ebb_node *geom_node(int op, int nin, const ebb_tensor_t *base, const ebb_tensor_t *view) {
  struct ebb_node *n = ebb__node_new(op, nin, 1);
  if (!n) return NULL;
  n->geom = calloc(1, sizeof *n->geom);
  n->in_meta = calloc((size_t)nin + 1, sizeof *n->in_meta);
  if (!n->geom || !n->in_meta) {
    ebb__node_drop(n);
    return NULL;
  }
  ebb__view_geom_of(base, view, n->geom);
  n->args.geom = n->geom;
  ebb__tensor_meta_of(base, &n->in_meta[0]);
  ebb__tensor_meta_of(op == EBB__OP_COPY_SLICES ? base : view, &n->in_meta[nin]);
  atomic_store_explicit(&n->refs, 1, memory_order_relaxed);
  return n;
}

/* View t's grad_fn taken again from its base's history, as of version v. Under ebb__view_mu;
 * the old grad_fn is returned in *old for the caller to drop after the lock. */
static ebb_status view_rebuild_locked(const ebb_tensor_t *t, struct ebb__meta *m, uint64_t v, struct ebb_node **old) {
  ebb_tensor_t *base = ebb__tensor_base(t);
  struct ebb__meta *bm = ebb__meta_of(base);
  *old = NULL;
  if (bm && bm->requires_grad && m->fn_view) {
    char who[EBB__DESC_MAX];
    return ebb__fail(EBB_EINVAL, "%s is a view a custom function returned (its node %s: an input returned as-is, or a view of "
                     "one), and its base was changed in place since: its history would have to bypass the function's backward (wrong "
                     "gradients); expected no in-place change of the base while the function's output is used, or a function "
                     "that returns a new tensor (a clone)", ebb__tensor_desc(t, "a tensor", -1, who, sizeof who), m->fn_view);
  }
  if (bm && bm->requires_grad) {
    struct ebb__edge e;
    ebb_status st = base_edge(base, bm, &e);
    if (st) return st;
    struct ebb_node *n = geom_node(EBB__OP_AS_STRIDED, 1, base, t);
    struct ebb__hook *h = NULL;
    if (!n) {
      ebb__node_unref(e.fn);
      return ebb__fail(EBB_ENOMEM, "no host memory to take a view's history from its base");
    }
    n->next[0] = e;
    st = ebb__retain_prepare(m, n, 0, &h);
    if (st) {
      ebb__node_unref(n);
      return st;
    }
    ebb__retain_commit(m, h); /* (before the old node, which holds the old hook, may go) */
    ebb__node_link(n);
    *old = m->grad_fn;
    m->grad_fn = n;
    m->output_nr = 0;
    /* Written only when it changes: threads that already saw a requiring view read it unlocked. */
    if (!m->requires_grad) m->requires_grad = true;
  }
  /* release: pairs with the acquire in ebb__grad_fn_now; grad_fn is written. */
  atomic_store_explicit(&m->view_version, v, memory_order_release);
  return EBB_OK;
}

ebb_status ebb__grad_fn_now(const ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **fn, int *output_nr) {
  if (m->is_view) {
    uint64_t v = 0;
    ebb_tensor_version(t, &v);
    /* acquire: pairs with the release stores of view_version (the grad_fn written before). */
    if (atomic_load_explicit(&m->view_version, memory_order_acquire) != v) {
      struct ebb_node *old = NULL;
      ebb_status st = EBB_OK;
      ebb__mutex_lock(&ebb__view_mu);
      if (atomic_load_explicit(&m->view_version, memory_order_relaxed) != v) st = view_rebuild_locked(t, m, v, &old);
      ebb__mutex_unlock(&ebb__view_mu);
      ebb__node_unref(old);
      if (st) return st;
    }
  }
  *fn = m->grad_fn;
  *output_nr = m->grad_fn ? m->output_nr : 0;
  return EBB_OK;
}

/* ---- in-place ops ------------------------------------------------------------------------------ */

/* What the inplace hook prepared for its done hook. */
struct ebb__inplace_tok {
  ebb_tensor_t *dst;
  ebb_tensor_t *base;       /* dst's base when dst is a view, else NULL */
  struct ebb_node *node;    /* the new grad_fn of dst (not a view) or of base (a view): one reference */
  struct ebb_node *vnode;   /* a view: dst's new grad_fn, from the base's new history: one reference */
  struct ebb__meta *dm_new; /* metas for dst and base where they have none yet */
  struct ebb__meta *bm_new;
  struct ebb__hook *retain; /* dst's retain_grad hook, registered on its new grad_fn */
  struct ebb__hook *bretain; /* the base's, likewise */
};

static void tok_free(struct ebb__inplace_tok *k) {
  /* The dst view's node first: it holds a reference to the base's. */
  ebb__node_unref(k->vnode);
  ebb__node_unref(k->node); /* (frees the prepared retain hook with its list) */
  if (k->dm_new) ebb__meta_free(k->dm_new);
  if (k->bm_new) ebb__meta_free(k->bm_new);
  free(k);
}

/* The edge into t's history for a node that uses it (a new reference in e->fn). */
static ebb_status edge_of(const ebb_tensor_t *t, struct ebb__meta *m, struct ebb__edge *e) {
  struct ebb_node *gf = NULL;
  int nr = 0;
  ebb_status st = ebb__grad_fn_now(t, m, &gf, &nr);
  if (st) return st;
  if (gf) {
    atomic_fetch_add_explicit(&gf->refs, 1, memory_order_relaxed);
    *e = (struct ebb__edge){.fn = gf, .input_nr = nr};
    return EBB_OK;
  }
  e->input_nr = 0;
  return ebb__grad_acc((ebb_tensor_t *)t, m, &e->fn);
}

static ebb_status ag_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const ebb__op_args *args,
                             void **token);

ebb_status ebb__ag_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const ebb__op_args *args,
                           void **token) {
  ebb_status st = ag_inplace(op, dst, src, nsrc, args, token);
  /* mutation.c: saved tensors on dst's storage are cloned last, after this op's own node saved
   * its inputs (src may be dst: x.mul_(x) keeps x as it was), right before the write; a failure
   * refuses the op. */
  if (!st && (st = ebb__mutation_write(dst)) && *token) {
    tok_free(*token);
    *token = NULL;
  }
  /* offload.c: a write to an offloaded storage, once the op is allowed (a refused one changes
   * nothing); its own refusal drops what was prepared */
  if (EBB_UNLIKELY(ebb__offl_watching()) && !st && (st = ebb__offl_inplace(dst)) && *token) {
    tok_free(*token);
    *token = NULL;
  }
  return st;
}

/* src[i] is the op's input i + 1 (its entry's numbering; input 0 is dst's old value). */
static ebb_status ag_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const ebb__op_args *args,
                             void **token) {
  /* Grad mode off or inference mode: the change is not recorded (an optimizer's step on its
   * leaves); nodes that saved dst see its version move and refuse to run. */
  if (!ebb_grad_enabled()) return EBB_OK;
  const ebb__deriv *e = ebb__deriv_of((ebb__op_id)op);
  struct ebb__meta *dm = ebb__meta_of(dst), *sm[2] = {NULL, NULL};
  ebb_tensor_t *base = ebb__tensor_base(dst);
  struct ebb__meta *bm = base ? ebb__meta_of(base) : NULL;
  bool src_rg[2] = {false, false}, any_src_rg = false;
  if (nsrc < 0 || nsrc > 2 || (e->nin > 0 && nsrc != e->nin - 1))
    return ebb__fail(EBB_EINTERNAL, "%s: %d inputs besides dst, for an entry of %d inputs", e->node, nsrc, e->nin);
  for (int i = 0; i < nsrc; i++) {
    sm[i] = ebb__meta_of(src[i]);
    src_rg[i] = sm[i] && sm[i]->requires_grad && ((e->diff >> (i + 1)) & 1);
    any_src_rg |= src_rg[i];
  }
  bool dst_rg = (dm && dm->requires_grad) || (bm && bm->requires_grad);
  if (!dst_rg && !any_src_rg) return EBB_OK;
  char who[EBB__DESC_MAX];
  if (dm && dm->fn_view)
    return ebb__fail(EBB_EINVAL, "%s is a view a custom function returned (its node %s: an input returned as-is, or a view of "
                     "one), and a change of it in place would give it a history that bypasses the function's backward (wrong "
                     "gradients); expected an out-of-place op, or a function that returns a new tensor (a clone)",
                     ebb__tensor_desc(dst, "dst", -1, who, sizeof who), dm->fn_view);
  if (dm && dm->requires_grad && !dm->is_view && !dm->grad_fn)
    return ebb__fail(EBB_EINVAL, "%s is a leaf that requires a gradient, and a leaf that requires a gradient cannot be changed "
                     "in place while grad mode is on (its gradient would be for a value it no longer holds); expected the change "
                     "with grad mode off (ebb_grad_set_enabled(false, ...), as an optimizer step does), or an out-of-place op",
                     ebb__tensor_desc(dst, "dst", -1, who, sizeof who));
  if (bm && bm->requires_grad && !bm->grad_fn)
    return ebb__fail(EBB_EINVAL, "dst is a view of a leaf that requires a gradient, %s, and a leaf that requires a gradient cannot "
                     "be changed in place while grad mode is on, through a view or not; expected the change with grad mode off "
                     "(ebb_grad_set_enabled(false, ...)), or an out-of-place op", ebb__tensor_desc(base, "its base", -1, who, sizeof who));
  if (base && ebb__tensor_overlaps(base))
    return ebb__fail(EBB_EINVAL, "dst is a view of %s, an expanded tensor whose elements overlap in memory, so a change through it "
                     "has no single gradient; expected a view of a tensor with its own elements (ebb_tensor_contiguous or clone it "
                     "first)", ebb__tensor_desc(base, "its base", -1, who, sizeof who));

  /* The srcs' histories first, if they are views whose base moved on: the nodes made for them
   * must be older than the ones made here (producers before consumers in sequence numbers). */
  for (int i = 0; i < nsrc; i++) {
    if (!src_rg[i]) continue;
    struct ebb_node *gf;
    int nr;
    ebb_status st = ebb__grad_fn_now(src[i], sm[i], &gf, &nr);
    if (st) return st;
  }
  const int nin = e->nin;
  struct ebb__inplace_tok *k = calloc(1, sizeof *k);
  struct ebb_node *n = NULL;
  ebb_status st = k ? EBB_OK : EBB_ENOMEM;
  if (!st) {
    k->dst = dst;
    k->base = base;
    n = base ? geom_node(EBB__OP_COPY_SLICES, nin, base, dst) : ebb__node_new(op, nin, 1);
    k->node = n;
    if (!n) st = EBB_ENOMEM;
  }
  /* the op's scalars: on its own node, or on CopySlices' record of the op (whose own args
   * point at the geometry) */
  if (!st && args && !base) n->args = *args;
  if (!st && args && base) n->geom->inner_args = *args;
  if (!st && !base) {
    atomic_store_explicit(&n->refs, 1, memory_order_relaxed);
    if (!(n->in_meta = calloc((size_t)nin + 1, sizeof *n->in_meta))) {
      st = EBB_ENOMEM;
    } else { /* dst's old value, and [nin] its new one (the node's input, as geom_node's) */
      ebb__tensor_meta_of(dst, &n->in_meta[0]);
      ebb__tensor_meta_of(dst, &n->in_meta[nin]);
    }
  }
  if (!st && e->save) {
    n->saved = calloc((size_t)(nin + 1), sizeof *n->saved);
    if (!n->saved) st = EBB_ENOMEM;
  }
  if (st == EBB_ENOMEM) st = ebb__fail(EBB_ENOMEM, "no host memory to record %s", base ? "CopySlices" : e->node);
  if (!st && base) {
    n->geom->inner_op = op;
    st = base_edge(base, bm, &n->next[0]);
  } else if (!st && (e->diff & 1) && dm && dm->requires_grad) {
    atomic_fetch_add_explicit(&dm->grad_fn->refs, 1, memory_order_relaxed);
    n->next[0] = (struct ebb__edge){.fn = dm->grad_fn, .input_nr = dm->output_nr};
  }
  for (int i = 0; !st && i < nsrc; i++) {
    ebb__tensor_meta_of(src[i], &n->in_meta[1 + i]);
    if (src_rg[i]) st = edge_of(src[i], sm[i], &n->next[1 + i]);
  }
  /* dst's value before the op, when the backward reads it (mul_): a copy, since the op is about
   * to overwrite it; made with grad mode off so it records nothing. */
  if (!st && (e->save & EBB__SAVE_IN(0))) {
    bool was;
    ebb_tensor_t *old = NULL;
    ebb_grad_set_enabled(false, &was);
    st = ebb_tensor_clone(dst, &old);
    ebb_grad_set_enabled(was, NULL);
    char name[EBB_TENSOR_NAME_MAX + 1];
    if (!st && !ebb_tensor_name(dst, name, sizeof name) && name[0]) ebb_tensor_set_name(old, name); /* (for messages) */
    if (!st) st = ebb__save_owned(n, 0, old); /* saved.c: kept as any saved tensor, or packed */
  }
  for (int i = 0; !st && i < nsrc; i++)
    if (e->save & EBB__SAVE_IN(1 + i)) st = ebb__save(n, 1 + i, src[i]);
  if (!st && base) {
    k->vnode = geom_node(EBB__OP_AS_STRIDED, 1, base, dst);
    if (!k->vnode) {
      st = ebb__fail(EBB_ENOMEM, "no host memory to record the view's new history");
    } else {
      atomic_fetch_add_explicit(&n->refs, 1, memory_order_relaxed);
      k->vnode->next[0] = (struct ebb__edge){.fn = n, .input_nr = 0};
    }
    if (!st && !bm && !(k->bm_new = ebb__meta_alloc())) st = ebb__fail(EBB_ENOMEM, "no host memory for the base's autograd state");
  }
  if (!st && !dm && !(k->dm_new = ebb__meta_alloc())) st = ebb__fail(EBB_ENOMEM, "no host memory for dst's autograd state");
  if (!st) st = ebb__retain_prepare(dm, base ? k->vnode : n, 0, &k->retain);
  if (!st && base) st = ebb__retain_prepare(bm, n, 0, &k->bretain);
  if (st) {
    if (k) tok_free(k);
    return st;
  }
  *token = k;
  return EBB_OK;
}

/* Makes m's grad_fn `n` (taking the token's reference) and returns the old one, to drop. */
static struct ebb_node *rebase(struct ebb__meta *m, struct ebb_node *n, struct ebb__hook *retain) {
  ebb__retain_commit(m, retain); /* before the old node, which holds the old hook, may go */
  struct ebb_node *old = m->grad_fn;
  m->grad_fn = n;
  m->output_nr = 0;
  m->requires_grad = true;
  return old;
}

void ebb__ag_inplace_done(void *token, bool ok) {
  struct ebb__inplace_tok *k = token;
  if (!ok) {
    tok_free(k);
    return;
  }
  ebb__node_link(k->node); /* whole now: partial backward walks may find them */
  if (k->vnode) ebb__node_link(k->vnode);
  struct ebb__meta *dm = ebb__meta_of(k->dst);
  if (!dm) {
    dm = k->dm_new;
    k->dm_new = NULL;
    ebb__tensor_set_slot(k->dst, dm);
  }
  struct ebb_node *old_d = NULL, *old_b = NULL;
  if (!k->base) {
    old_d = rebase(dm, k->node, k->retain);
  } else {
    struct ebb__meta *bm = ebb__meta_of(k->base);
    if (!bm) {
      bm = k->bm_new;
      k->bm_new = NULL;
      ebb__tensor_set_slot(k->base, bm);
    }
    uint64_t v = 0;
    ebb_tensor_version(k->dst, &v);
    ebb__mutex_lock(&ebb__view_mu);
    old_b = rebase(bm, k->node, k->bretain);
    old_d = rebase(dm, k->vnode, k->retain);
    dm->is_view = true;
    /* release: pairs with the acquire in ebb__grad_fn_now; grad_fn is written. */
    atomic_store_explicit(&dm->view_version, v, memory_order_release);
    ebb__mutex_unlock(&ebb__view_mu);
  }
  /* The old grad_fns go unless the new history holds them (its edge 0, the old value's). */
  ebb__node_unref(old_d);
  ebb__node_unref(old_b);
  free(k);
}
