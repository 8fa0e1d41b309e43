/* derivatives.c: the derivative table (ops_export.h). One entry per differentiable operation:
 * its node name, what its backward reads, which inputs get gradients, and the backward behind
 * one signature. The math lives beside each forward (ebb_op_*_backward); an entry adapts it to
 * the table's call, or, where a backward needs only its inputs' shapes (add, sum, the views),
 * computes it from their metadata so nothing is saved for it.
 *
 * Some entries save more than their math needs, because the public backward they call takes a
 * tensor for its shape or dtype: where (a and b), max_dim (x). The engine's lean path is to
 * replace those reads with the metadata.
 */
#include <stdio.h>
#include <string.h>

#include "ops_export.h"
#include "ops_impl.h"

#define WANT(c, i) ((c)->need[i])

/* ---- shared steps ------------------------------------------------------------------------------ */

ebb_status ebb__grad_fit(const ebb__tensor_meta *m, const ebb_tensor_t *g, ebb_tensor_t **out) {
  ebb_tensor_t *r = NULL, *t = NULL;
  ebb_status st;
  if (g->ndim == m->ndim && memcmp(g->shape, m->shape, sizeof(int64_t) * (size_t)m->ndim) == 0) {
    st = ebb_tensor_retain((ebb_tensor_t *)g);
    r = (ebb_tensor_t *)g;
  } else {
    st = ebb_op_sum_to_shape(g, m->ndim, m->shape, &r);
  }
  if (!st && r->dtype != m->dtype) {
    st = ebb_tensor_to_dtype(r, m->dtype, &t);
    ebb__tensor_put(r);
    r = st ? NULL : t;
  }
  if (!st && r->stor->device != m->device) {
    st = ebb_tensor_to_device(r, m->device, &t);
    ebb__tensor_put(r);
    r = st ? NULL : t;
  }
  if (st) return st;
  *out = r;
  return EBB_OK;
}

/* Whether grad_out[k] is the engine's alone to write into (ebb__bw_ctx.go_mine) and has input
 * m's shape, dtype and device, so a gradient for that input can be computed in it. */
static bool derivatives_reusable(const ebb__bw_ctx *c, int k, const ebb_tensor_t *g, const ebb__tensor_meta *m) {
  return c->go_mine && c->go_mine[k] && ebb__tensor_matches(g, m);
}

/* g itself as a gradient: a new reference. */
static ebb_tensor_t *derivatives_keep(const ebb_tensor_t *g) {
  atomic_fetch_add_explicit(&((ebb_tensor_t *)g)->refs, 1, memory_order_relaxed);
  return (ebb_tensor_t *)g;
}

/* grad * s, fitted to input 0 (in grad itself when the engine gives it up). */
static ebb_status scaled(const ebb__bw_ctx *c, const ebb_tensor_t *g, double s, ebb_tensor_t **gin) {
  if (!WANT(c, 0)) return EBB_OK;
  if (s == 1.0) return ebb__grad_fit(&c->in[0], g, &gin[0]);
  if (derivatives_reusable(c, 0, g, &c->in[0])) {
    ebb_status st = ebb__lean_scale_((ebb_tensor_t *)g, s);
    if (!st) gin[0] = derivatives_keep(g);
    return st;
  }
  ebb_tensor_t *t = NULL;
  ebb_status st = ebb_op_mul_scalar(g, s, &t);
  if (st) return st;
  st = ebb__grad_fit(&c->in[0], t, &gin[0]);
  ebb__tensor_put(t);
  return st;
}

/* Releases grad_in[0..n) after a failure. */
static ebb_status derivatives_drop(ebb_status st, ebb_tensor_t **gin, int n) {
  if (st)
    for (int i = 0; i < n; i++) {
      ebb__tensor_put(gin[i]);
      gin[i] = NULL;
    }
  return st;
}

/* The public two-input backward f(grad, a, b, ga, gb) with the saved inputs and the wanted
 * outputs. */
typedef ebb_status (*ebb__bw2)(const ebb_tensor_t *, const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **, ebb_tensor_t **);
/* Each returned gradient brought to its input's shape, dtype and device (a public backward may
 * return the promoted dtype: mse_loss, layer_norm). */
static ebb_status fit_all(const ebb__bw_ctx *c, ebb_tensor_t **gin, int n) {
  ebb_status st = EBB_OK;
  for (int i = 0; i < n; i++) {
    if (!gin[i] || st) continue;
    ebb_tensor_t *f = NULL;
    st = ebb__grad_fit(&c->in[i], gin[i], &f);
    ebb__tensor_put(gin[i]);
    gin[i] = st ? NULL : f;
  }
  return derivatives_drop(st, gin, n);
}

static ebb_status derivatives_two(ebb__bw2 f, const ebb__bw_ctx *c, const ebb_tensor_t *g, ebb_tensor_t **gin) {
  if (!WANT(c, 0) && !WANT(c, 1)) return EBB_OK;
  ebb_status st = f(g, c->saved_in[0], c->saved_in[1], WANT(c, 0) ? &gin[0] : NULL, WANT(c, 1) ? &gin[1] : NULL);
  return st ? st : fit_all(c, gin, 2);
}

/* ---- binary and scalar ----------------------------------------------------------------------- */

static ebb_status bw_add(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  ebb_status st = WANT(c, 0) ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
  if (!st && WANT(c, 1)) st = ebb__grad_fit(&c->in[1], go[0], &gin[1]);
  return derivatives_drop(st, gin, 2);
}

static ebb_status bw_sub(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  ebb_status st = WANT(c, 0) ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
  if (!st && WANT(c, 1)) {
    ebb_tensor_t *n = NULL;
    st = ebb_op_neg(go[0], &n);
    if (!st) st = ebb__grad_fit(&c->in[1], n, &gin[1]);
    ebb__tensor_put(n);
  }
  return derivatives_drop(st, gin, 2);
}

/* With a gradient the engine gives up and no broadcasting (a, b and grad of one shape, dtype and
 * device), one product is computed in grad itself: a chain of products allocates nothing. */
static ebb_status bw_mul(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  const ebb_tensor_t *g = go[0];
  if (!ebb__tensor_matches(g, &c->in[0]) || !ebb__tensor_matches(g, &c->in[1]) || (!WANT(c, 0) && !WANT(c, 1)))
    return derivatives_two(ebb_op_mul_backward, c, g, gin); /* broadcasting or promoting: the general path */
  bool mine = derivatives_reusable(c, 0, g, &c->in[0]);
  ebb_status st = EBB_OK;
  if (WANT(c, 0) && (WANT(c, 1) || !mine)) st = ebb_op_mul(g, c->saved_in[1], &gin[0]);
  if (!st && WANT(c, 1) && !mine) st = ebb_op_mul(g, c->saved_in[0], &gin[1]);
  if (!st && mine) {
    int k = WANT(c, 1) ? 1 : 0; /* the one computed in place: grad * a for b, grad * b for a */
    st = ebb__lean_mul_((ebb_tensor_t *)g, c->saved_in[1 - k]);
    if (!st) gin[k] = derivatives_keep(g);
  }
  return derivatives_drop(st, gin, 2);
}
static ebb_status bw_div(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return derivatives_two(ebb_op_div_backward, c, go[0], gin);
}
static ebb_status bw_add_scalar(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return scaled(c, go[0], 1.0, gin);
}
static ebb_status bw_mul_scalar(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return scaled(c, go[0], c->args->s[0], gin);
}
static ebb_status bw_div_scalar(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return scaled(c, go[0], 1.0 / c->args->s[0], gin);
}
static ebb_status bw_neg(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return scaled(c, go[0], -1.0, gin);
}
static ebb_status bw_pow_scalar(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_pow_scalar_backward(go[0], c->saved_in[0], c->args->s[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_clamp(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_clamp_backward(go[0], c->saved_in[0], c->args->s[0], c->args->s[1], &gin[0]) : EBB_OK;
}

/* ---- unary: f(grad, x, y, gx) reading the saved x or y ------------------------------------------ */

static ebb_status bw_abs(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_abs_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_exp(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_exp_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_log(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_log_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_sqrt(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_sqrt_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_sin(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_sin_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_cos(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_cos_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_tanh(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_tanh_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_sigmoid(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_sigmoid_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_relu(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_relu_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}
static ebb_status bw_gelu(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_gelu_backward(go[0], c->saved_in[0], c->saved_out[0], &gin[0]) : EBB_OK;
}

static ebb_status bw_where(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 1) && !WANT(c, 2)) return EBB_OK;
  return ebb_op_where_backward(go[0], c->saved_in[0], c->saved_in[1], c->saved_in[2], WANT(c, 1) ? &gin[1] : NULL,
                               WANT(c, 2) ? &gin[2] : NULL);
}

/* ---- reductions, matmul, nn ------------------------------------------------------------------- */

/* grad of a sum over args->dims (all when ndims 0) back to input 0's shape, times `scale`: the
 * reduced dims put back (keepdim false) and expanded, a view of grad when scale is 1. */
static ebb_status unreduce(const ebb__bw_ctx *c, const ebb_tensor_t *g, double scale, ebb_tensor_t **gin) {
  const ebb__tensor_meta *m = &c->in[0];
  const ebb__op_args *a = c->args;
  ebb_tensor_t *t = NULL, *u = NULL;
  ebb_status st = ebb_tensor_retain((ebb_tensor_t *)g);
  t = (ebb_tensor_t *)g;
  if (!a->keepdim) {
    bool reduced[EBB_TENSOR_MAX_DIMS] = {false};
    for (int d = 0; d < m->ndim; d++) reduced[d] = a->ndims == 0;
    for (int k = 0; k < a->ndims; k++) reduced[a->dims[k]] = true;
    for (int d = 0; !st && d < m->ndim; d++) {
      if (!reduced[d]) continue;
      st = ebb_tensor_unsqueeze(t, d, &u);
      ebb__tensor_put(t);
      t = st ? NULL : u;
    }
  }
  if (!st) {
    st = ebb_tensor_expand(t, m->ndim, m->shape, &u);
    ebb__tensor_put(t);
    t = st ? NULL : u;
  }
  if (!st && scale != 1.0) {
    st = ebb_op_mul_scalar(t, scale, &u);
    ebb__tensor_put(t);
    t = st ? NULL : u;
  }
  if (!st) {
    st = ebb__grad_fit(m, t, gin);
    ebb__tensor_put(t);
  }
  return st;
}

static ebb_status bw_sum(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? unreduce(c, go[0], 1.0, &gin[0]) : EBB_OK;
}

static ebb_status bw_mean(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 0)) return EBB_OK;
  const ebb__tensor_meta *m = &c->in[0];
  int64_t count = 1;
  if (c->args->ndims == 0)
    for (int d = 0; d < m->ndim; d++) count *= m->shape[d];
  for (int k = 0; k < c->args->ndims; k++) count *= m->shape[c->args->dims[k]];
  return unreduce(c, go[0], count ? 1.0 / (double)count : 1.0, &gin[0]);
}

static ebb_status bw_amax(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 0)) return EBB_OK;
  const ebb__op_args *a = c->args;
  return ebb_op_amax_backward(go[0], c->saved_in[0], c->saved_out[0], a->dims, a->ndims, a->keepdim, &gin[0]);
}

static ebb_status bw_max_dim(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 0) || !go[0]) return EBB_OK;
  return ebb_op_max_dim_backward(go[0], c->saved_in[0], c->saved_out[1], c->args->dim, c->args->keepdim, &gin[0]);
}

static ebb_status bw_matmul(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return derivatives_two(ebb_op_matmul_backward, c, go[0], gin);
}
static ebb_status bw_softmax(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_softmax_backward(go[0], c->saved_out[0], c->args->dim, &gin[0]) : EBB_OK;
}
static ebb_status bw_log_softmax(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_log_softmax_backward(go[0], c->saved_out[0], c->args->dim, &gin[0]) : EBB_OK;
}
static ebb_status bw_cross_entropy(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_op_cross_entropy_backward(go[0], c->saved_in[0], c->saved_in[1], &gin[0]) : EBB_OK;
}
static ebb_status bw_mse_loss(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return derivatives_two(ebb_op_mse_loss_backward, c, go[0], gin);
}

static ebb_status bw_layer_norm(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  const ebb_tensor_t *w = c->nin > 1 ? c->saved_in[1] : NULL, *b = c->nin > 2 ? c->saved_in[2] : NULL;
  bool gw = w && WANT(c, 1), gb = b && WANT(c, 2);
  if (!WANT(c, 0) && !gw && !gb) return EBB_OK;
  ebb_status st = ebb_op_layer_norm_backward(go[0], c->saved_in[0], c->args->dim, w, b, c->args->s[0], WANT(c, 0) ? &gin[0] : NULL,
                                             gw ? &gin[1] : NULL, gb ? &gin[2] : NULL);
  return st ? st : fit_all(c, gin, 3);
}

/* cat: input i's slice of grad along the dim, at the sum of the sizes before it (a view). */
static ebb_status bw_cat(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  int d = c->args->dim;
  int64_t at = 0;
  ebb_status st = EBB_OK;
  for (int i = 0; !st && i < c->nin; i++) {
    if (WANT(c, i)) st = ebb_tensor_narrow(go[0], d, at, c->in[i].shape[d], &gin[i]);
    at += c->in[i].shape[d];
  }
  return derivatives_drop(st, gin, c->nin);
}

static ebb_status bw_stack(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  ebb_status st = EBB_OK;
  for (int i = 0; !st && i < c->nin; i++)
    if (WANT(c, i)) st = ebb_tensor_select(go[0], c->args->dim, i, &gin[i]);
  return derivatives_drop(st, gin, c->nin);
}

/* ---- views ----------------------------------------------------------------------------------- */

/* view, reshape, squeeze, unsqueeze: grad back in the input's shape. */
static ebb_status bw_reshape(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_tensor_reshape(go[0], c->in[0].ndim, c->in[0].shape, &gin[0]) : EBB_OK;
}

static ebb_status bw_transpose(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb_tensor_transpose(go[0], c->args->dim, c->args->dim1, &gin[0]) : EBB_OK;
}

static ebb_status bw_permute(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 0)) return EBB_OK;
  int inv[EBB_TENSOR_MAX_DIMS];
  for (int k = 0; k < c->args->ndims; k++) inv[c->args->dims[k]] = k;
  return ebb_tensor_permute(go[0], inv, c->args->ndims, &gin[0]);
}

/* slice, narrow, select: zeros of the input's shape with grad written into the same view. */
static ebb_status scatter_view(const ebb__bw_ctx *c, const ebb_tensor_t *g, bool select, ebb_tensor_t **gin) {
  const ebb__tensor_meta *m = &c->in[0];
  const ebb__op_args *a = c->args;
  ebb_tensor_t *z = NULL, *v = NULL;
  ebb_status st = ebb_tensor_zeros(m->device, m->dtype, m->ndim, m->shape, &z);
  if (!st) st = select ? ebb_tensor_select(z, a->dim, a->start, &v) : ebb_tensor_slice(z, a->dim, a->start, a->end, a->step, &v);
  if (!st) st = ebb_tensor_copy_(v, g);
  ebb__tensor_put(v);
  if (st) {
    ebb__tensor_put(z);
    return st;
  }
  *gin = z;
  return EBB_OK;
}

static ebb_status bw_slice(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? scatter_view(c, go[0], false, &gin[0]) : EBB_OK;
}
static ebb_status bw_select(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? scatter_view(c, go[0], true, &gin[0]) : EBB_OK;
}

/* expand, contiguous, clone, to_device, to_dtype: grad fitted back (summed over expanded dims,
 * to the input's dtype and device). */
static ebb_status bw_fit(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 0) ? ebb__grad_fit(&c->in[0], go[0], &gin[0]) : EBB_OK;
}

/* ---- in place ------------------------------------------------------------------------------ */

/* dst += src: dst's old value gets grad, src grad summed to its shape. */
static ebb_status bw_add_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) { return bw_add(c, go, gin); }

/* dst *= src: needs dst's value before the op (saved as input 0) and src. */
static ebb_status bw_mul_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) { return bw_mul(c, go, gin); }

/* dst = src: dst's old value gets nothing (it is gone), src gets grad in its shape, dtype and
 * device. */
static ebb_status bw_copy_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  return WANT(c, 1) ? ebb__grad_fit(&c->in[1], go[0], &gin[1]) : EBB_OK;
}

/* ---- autograd's nodes for in-place ops on views ------------------------------------------------ */

/* A tensor of the base's shape, dtype and device laid out with the base's strides (so the view's
 * strides and its offset from the base's find the same elements in it), zero-filled. */
static ebb_status base_like(const ebb__tensor_meta *bm, const ebb__view_geom *g, ebb_tensor_t **out) {
  int64_t span = 1;
  for (int d = 0; d < bm->ndim; d++) {
    if (bm->shape[d] == 0) span = 0;
    if (span) span += (bm->shape[d] - 1) * g->base_strides[d];
  }
  ebb_tensor_t *raw = NULL;
  ebb_status st = ebb_tensor_zeros(bm->device, bm->dtype, 1, &span, &raw);
  if (!st) st = ebb__tensor_alias("ebb_backward", raw, bm->ndim, bm->shape, g->base_strides, 0, out);
  ebb__tensor_put(raw);
  return st;
}

/* The view's elements within r (base_like's layout); with `collapse`, the view's expanded
 * dims (stride 0) taken as extent 1, so no two elements alias. */
static ebb_status view_in(const ebb_tensor_t *r, const ebb__view_geom *g, bool collapse, ebb_tensor_t **out) {
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  for (int d = 0; d < g->view.ndim; d++) shape[d] = collapse && g->strides[d] == 0 ? 1 : g->view.shape[d];
  return ebb__tensor_alias("ebb_backward", r, g->view.ndim, shape, g->strides, g->offset - g->base_offset, out);
}

/* A view whose history was taken from its base after an in-place change: the base gets the
 * view's gradient where the view lies and zeros elsewhere; an expanded view's gradient is first
 * summed over its expanded dims (each of those elements is one element of the base). */
static ebb_status bw_as_strided(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  if (!WANT(c, 0)) return EBB_OK;
  const ebb__view_geom *g = c->args->geom;
  int dims[EBB_TENSOR_MAX_DIMS], nd = 0;
  for (int d = 0; d < g->view.ndim; d++)
    if (g->strides[d] == 0 && g->view.shape[d] > 1) dims[nd++] = d;
  ebb_tensor_t *r = NULL, *v = NULL, *summed = NULL;
  ebb_status st = base_like(&c->in[0], g, &r);
  if (!st && nd) st = ebb_op_sum(go[0], dims, nd, true, &summed);
  if (!st) st = view_in(r, g, true, &v);
  if (!st) st = ebb_tensor_copy_(v, summed ? summed : go[0]);
  ebb__tensor_put(v);
  ebb__tensor_put(summed);
  if (st) {
    ebb__tensor_put(r);
    return st;
  }
  gin[0] = r;
  return EBB_OK;
}

/* The base after an in-place op on its view: the base's gradient, with the part the view covers
 * replaced by what the in-place op's backward gives its old value (zeros when the old value is
 * gone: copy_, fill_), goes to the base's old history; the op's other input gets its gradient
 * from the op's backward, given the view's part of the base's gradient. */
static ebb_status bw_copy_slices(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin) {
  const ebb__view_geom *g = c->args->geom;
  const ebb__deriv *inner = ebb__deriv_of((ebb__op_id)g->inner_op);
  ebb_tensor_t *r = NULL, *v = NULL, *gv = NULL, *ig[3] = {NULL, NULL, NULL};
  ebb_status st = base_like(&c->in[0], g, &r);
  if (!st) st = ebb_tensor_copy_(r, go[0]);
  if (!st) st = view_in(r, g, false, &v);
  if (!st) st = ebb_tensor_clone(v, &gv);
  if (!st && inner->backward) {
    ebb__tensor_meta in[3] = {g->view, c->nin > 1 ? c->in[1] : g->view, c->nin > 2 ? c->in[2] : g->view};
    const ebb__bw_ctx ic = {&g->inner_args, in, c->saved_in, c->saved_out, c->nin, c->need, NULL};
    const ebb_tensor_t *igo[2] = {gv, NULL};
    st = inner->backward(&ic, igo, ig);
  }
  if (!st && WANT(c, 0)) st = ig[0] ? ebb_tensor_copy_(v, ig[0]) : ebb_tensor_fill_(v, 0.0);
  ebb__tensor_put(v);
  ebb__tensor_put(gv);
  ebb__tensor_put(ig[0]);
  if (st) {
    ebb__tensor_put(r);
    ebb__tensor_put(ig[1]);
    ebb__tensor_put(ig[2]);
    return st;
  }
  if (WANT(c, 0)) gin[0] = r;
  else ebb__tensor_put(r);
  for (int i = 1; i < c->nin && i < 3; i++) gin[i] = ig[i];
  return EBB_OK;
}

/* ---- the table ------------------------------------------------------------------------------- */

static const ebb__deriv ebb__derivs[EBB__OP_COUNT] = {
    [EBB__OP_ADD] = {.node = "AddBackward", .forward = "ebb_op_add", .nin = 2, .nout = 1,
                     .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_add},
    [EBB__OP_SUB] = {.node = "SubBackward", .forward = "ebb_op_sub", .nin = 2, .nout = 1,
                     .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_sub},
    [EBB__OP_MUL] = {.node = "MulBackward", .forward = "ebb_op_mul", .nin = 2, .nout = 1,
                     .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_mul},
    [EBB__OP_DIV] = {.node = "DivBackward", .forward = "ebb_op_div", .nin = 2, .nout = 1,
                     .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_div},
    [EBB__OP_ADD_SCALAR] = {.node = "AddScalarBackward", .forward = "ebb_op_add_scalar", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_add_scalar},
    [EBB__OP_SUB_SCALAR] = {.node = "SubScalarBackward", .forward = "ebb_op_sub_scalar", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_add_scalar},
    [EBB__OP_MUL_SCALAR] = {.node = "MulScalarBackward", .forward = "ebb_op_mul_scalar", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_mul_scalar},
    [EBB__OP_DIV_SCALAR] = {.node = "DivScalarBackward", .forward = "ebb_op_div_scalar", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_div_scalar},
    [EBB__OP_POW_SCALAR] = {.node = "PowScalarBackward", .forward = "ebb_op_pow_scalar", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_pow_scalar},
    [EBB__OP_CLAMP] = {.node = "ClampBackward", .forward = "ebb_op_clamp", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_clamp},
    [EBB__OP_NEG] = {.node = "NegBackward", .forward = "ebb_op_neg", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_neg},
    [EBB__OP_ABS] = {.node = "AbsBackward", .forward = "ebb_op_abs", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_abs},
    [EBB__OP_EXP] = {.node = "ExpBackward", .forward = "ebb_op_exp", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_exp},
    [EBB__OP_LOG] = {.node = "LogBackward", .forward = "ebb_op_log", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_log},
    [EBB__OP_SQRT] = {.node = "SqrtBackward", .forward = "ebb_op_sqrt", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_sqrt},
    [EBB__OP_SIN] = {.node = "SinBackward", .forward = "ebb_op_sin", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_sin},
    [EBB__OP_COS] = {.node = "CosBackward", .forward = "ebb_op_cos", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_cos},
    [EBB__OP_TANH] = {.node = "TanhBackward", .forward = "ebb_op_tanh", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_tanh},
    [EBB__OP_SIGMOID] = {.node = "SigmoidBackward", .forward = "ebb_op_sigmoid", .nin = 1, .nout = 1,
                         .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_sigmoid},
    [EBB__OP_RELU] = {.node = "ReluBackward", .forward = "ebb_op_relu", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_relu},
    [EBB__OP_GELU] = {.node = "GeluBackward", .forward = "ebb_op_gelu", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = bw_gelu},
    [EBB__OP_WHERE] = {.node = "WhereBackward", .forward = "ebb_op_where", .nin = 3, .nout = 1,
                       .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1) | EBB__SAVE_IN(2), .diff = EBB__DIFF_IN(1) | EBB__DIFF_IN(2), .backward = bw_where},
    [EBB__OP_SUM] = {.node = "SumBackward", .forward = "ebb_op_sum", .nin = 1, .nout = 1,
                     .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_sum},
    [EBB__OP_MEAN] = {.node = "MeanBackward", .forward = "ebb_op_mean", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_mean},
    [EBB__OP_AMAX] = {.node = "AmaxBackward", .forward = "ebb_op_amax", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_IN(0) | EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_amax},
    [EBB__OP_MAX_DIM] = {.node = "MaxBackward", .forward = "ebb_op_max_dim", .nin = 1, .nout = 2,
                         .save = EBB__SAVE_IN(0) | EBB__SAVE_OUT(1), .diff = EBB__DIFF_IN(0), .backward = bw_max_dim},
    [EBB__OP_MATMUL] = {.node = "MatmulBackward", .forward = "ebb_op_matmul", .nin = 2, .nout = 1,
                        .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_matmul},
    [EBB__OP_SOFTMAX] = {.node = "SoftmaxBackward", .forward = "ebb_op_softmax", .nin = 1, .nout = 1,
                         .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_softmax},
    [EBB__OP_LOG_SOFTMAX] = {.node = "LogSoftmaxBackward", .forward = "ebb_op_log_softmax", .nin = 1, .nout = 1,
                             .save = EBB__SAVE_OUT(0), .diff = EBB__DIFF_IN(0), .backward = bw_log_softmax},
    [EBB__OP_CROSS_ENTROPY] = {.node = "CrossEntropyBackward", .forward = "ebb_op_cross_entropy", .nin = 2, .nout = 1,
                               .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0), .backward = bw_cross_entropy},
    [EBB__OP_MSE_LOSS] = {.node = "MseLossBackward", .forward = "ebb_op_mse_loss", .nin = 2, .nout = 1,
                          .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_mse_loss},
    [EBB__OP_LAYER_NORM] = {.node = "LayerNormBackward", .forward = "ebb_op_layer_norm", .nin = 3, .nout = 1,
                            .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1) | EBB__SAVE_IN(2), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1) | EBB__DIFF_IN(2), .backward = bw_layer_norm},
    [EBB__OP_CAT] = {.node = "CatBackward", .forward = "ebb_op_cat", .nin = -1, .nout = 1,
                     .save = EBB__SAVE_NONE, .diff = EBB__DIFF_EACH, .backward = bw_cat},
    [EBB__OP_STACK] = {.node = "StackBackward", .forward = "ebb_op_stack", .nin = -1, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_EACH, .backward = bw_stack},
    [EBB__OP_VIEW] = {.node = "ViewBackward", .forward = "ebb_tensor_view", .nin = 1, .nout = 1,
                      .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_reshape},
    [EBB__OP_RESHAPE] = {.node = "ReshapeBackward", .forward = "ebb_tensor_reshape", .nin = 1, .nout = 1,
                         .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_reshape},
    [EBB__OP_TRANSPOSE] = {.node = "TransposeBackward", .forward = "ebb_tensor_transpose", .nin = 1, .nout = 1,
                           .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_transpose},
    [EBB__OP_PERMUTE] = {.node = "PermuteBackward", .forward = "ebb_tensor_permute", .nin = 1, .nout = 1,
                         .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_permute},
    [EBB__OP_SLICE] = {.node = "SliceBackward", .forward = "ebb_tensor_slice", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_slice},
    [EBB__OP_NARROW] = {.node = "NarrowBackward", .forward = "ebb_tensor_narrow", .nin = 1, .nout = 1,
                        .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_slice},
    [EBB__OP_SELECT] = {.node = "SelectBackward", .forward = "ebb_tensor_select", .nin = 1, .nout = 1,
                        .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_select},
    [EBB__OP_EXPAND] = {.node = "ExpandBackward", .forward = "ebb_tensor_expand", .nin = 1, .nout = 1,
                        .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_fit},
    [EBB__OP_SQUEEZE] = {.node = "SqueezeBackward", .forward = "ebb_tensor_squeeze", .nin = 1, .nout = 1,
                         .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_reshape},
    [EBB__OP_UNSQUEEZE] = {.node = "UnsqueezeBackward", .forward = "ebb_tensor_unsqueeze", .nin = 1, .nout = 1,
                           .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_reshape},
    [EBB__OP_CONTIGUOUS] = {.node = "ContiguousBackward", .forward = "ebb_tensor_contiguous", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_fit},
    [EBB__OP_CLONE] = {.node = "CloneBackward", .forward = "ebb_tensor_clone", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_fit},
    [EBB__OP_TO_DEVICE] = {.node = "ToDeviceBackward", .forward = "ebb_tensor_to_device", .nin = 1, .nout = 1,
                           .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_fit},
    [EBB__OP_TO_DTYPE] = {.node = "ToDtypeBackward", .forward = "ebb_tensor_to_dtype", .nin = 1, .nout = 1,
                          .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_fit},
    [EBB__OP_ADD_] = {.node = "AddInplaceBackward", .forward = "ebb_op_add_", .nin = 2, .nout = 1,
                      .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_add_},
    [EBB__OP_MUL_] = {.node = "MulInplaceBackward", .forward = "ebb_op_mul_", .nin = 2, .nout = 1,
                      .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_mul_},
    [EBB__OP_COPY_] = {.node = "CopyBackward", .forward = "ebb_tensor_copy_", .nin = 2, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(1), .backward = bw_copy_},
    [EBB__OP_FILL_] = {.node = "FillBackward", .forward = "ebb_tensor_fill_", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_NONE, .backward = NULL},
    [EBB__OP_ZERO_] = {.node = "ZeroBackward", .forward = "ebb_tensor_zero_", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_NONE, .backward = NULL},
    /* the in-place family and linear: their backward lives beside them (inplace.c, linear.c) */
    [EBB__OP_ADD_SCALED_] = {.node = "AddScaledInplaceBackward", .forward = "ebb_op_add_scaled_", .nin = 2, .nout = 1,
                             .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = ebb__bw_add_scaled_},
    [EBB__OP_ADD_SCALAR_] = {.node = "AddScalarInplaceBackward", .forward = "ebb_op_add_scalar_", .nin = 1, .nout = 1,
                             .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = ebb__bw_add_scalar_},
    [EBB__OP_MUL_SCALAR_] = {.node = "MulScalarInplaceBackward", .forward = "ebb_op_mul_scalar_", .nin = 1, .nout = 1,
                             .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = ebb__bw_mul_scalar_},
    [EBB__OP_LERP_] = {.node = "LerpInplaceBackward", .forward = "ebb_op_lerp_", .nin = 2, .nout = 1,
                       .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = ebb__bw_lerp_},
    [EBB__OP_ADDCMUL_] = {.node = "AddcmulInplaceBackward", .forward = "ebb_op_addcmul_", .nin = 3, .nout = 1,
                          .save = EBB__SAVE_IN(1) | EBB__SAVE_IN(2), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1) | EBB__DIFF_IN(2), .backward = ebb__bw_addcmul_},
    [EBB__OP_ADDCDIV_] = {.node = "AddcdivInplaceBackward", .forward = "ebb_op_addcdiv_", .nin = 3, .nout = 1,
                          .save = EBB__SAVE_IN(1) | EBB__SAVE_IN(2), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1) | EBB__DIFF_IN(2), .backward = ebb__bw_addcdiv_},
    [EBB__OP_SQRT_] = {.node = "SqrtInplaceBackward", .forward = "ebb_op_sqrt_", .nin = 1, .nout = 1,
                       .save = EBB__SAVE_IN(0), .diff = EBB__DIFF_IN(0), .backward = ebb__bw_sqrt_},
    [EBB__OP_LINEAR] = {.node = "LinearBackward", .forward = "ebb_op_linear", .nin = 3, .nout = 1,
                        .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1) | EBB__DIFF_IN(2), .backward = ebb__bw_linear},
    /* autograd builds these itself (no public forward); COPY_SLICES saves what its in-place op
     * saves and has that op's inputs (2, or 3 for addcmul_ and addcdiv_: the entry's nin is the
     * usual count, the node's its own) */
    [EBB__OP_AS_STRIDED] = {.node = "AsStridedBackward", .forward = "(a view's history after an in-place change)", .nin = 1, .nout = 1,
                            .save = EBB__SAVE_NONE, .diff = EBB__DIFF_IN(0), .backward = bw_as_strided},
    [EBB__OP_COPY_SLICES] = {.node = "CopySlices", .forward = "(an in-place op on a view)", .nin = 2, .nout = 1,
                             .save = EBB__SAVE_IN(0) | EBB__SAVE_IN(1), .diff = EBB__DIFF_IN(0) | EBB__DIFF_IN(1), .backward = bw_copy_slices},
};

const ebb__deriv *ebb__deriv_of(ebb__op_id op) { return (unsigned)op < EBB__OP_COUNT ? &ebb__derivs[op] : NULL; }
