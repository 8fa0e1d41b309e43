/* optim.c: parameter lists and optimizers (include/ebb/optim.h).
 *
 * Owns the records of ebb_params_t and ebb_optim_t: the parameters they retain, the groups'
 * learning rates and weight decays, and an optimizer's state tensors and step counts. A step
 * reads each parameter's .grad through autograd's public accessor, allocates missing state on
 * the parameter's device (owner category "optimizer"), and hands the whole list to ops' fused
 * update (ops/export/optim_export.h), which checks everything, then runs one pass per CPU tensor
 * and one launch per device and dtype. The step runs with grad mode off: it records nothing and
 * its in-place change of a leaf that requires a gradient is allowed, as PyTorch's no_grad step.
 *
 * Records are type-stable: a destroyed one goes to a FIFO and is reused only after 1024 more
 * destructions, so a stale handle reads as destroyed (EBB_EFREED) for that long. The FIFO's lock
 * is a leaf lock (nothing is called while it is held).
 * Threading: the records' FIFO is shared; everything else belongs to the record, whose calls the
 * caller orders (ebb/optim.h).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb/optim.h"
#include "ebb_internal.h"
#include "ebb_list.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "optim_export.h"

#define PARAMS_MAGIC 0x65627070u /* "ebpp" */
#define OPTIM_MAGIC 0x65626f70u  /* "ebop" */
#define REUSE_AFTER 1024         /* destroyed records waiting before one is reused */

struct ebb_params {
  _Atomic uint32_t magic;
  struct ebb_list free_link;
  int n, cap;
  ebb_tensor_t **ts;
  int *group;          /* [n] each parameter's group */
  int ngroups;         /* 1 + groups added; group 0 is the optimizer's */
  double *glr, *gwd;   /* [ngroups], entry 0 unused */
};

struct ebb_optim {
  _Atomic uint32_t magic;
  struct ebb_list free_link;
  ebb__optim_hyper h;
  const char *kind_name;    /* "SGD" or "AdamW", for messages */
  int nstate;               /* state tensors per parameter: SGD 0 or 1, AdamW 2 or 3 */
  int n;
  ebb_tensor_t **params;    /* [n], retained */
  int *group;               /* [n] */
  int ngroups;
  double *lr, *wd;          /* [ngroups]; 0 is the optimizer's own */
  ebb_tensor_t *(*state)[3];/* [n] */
  bool *fresh;              /* [n] state allocated but never written (a failed step made it) */
  int64_t *steps;           /* [n] updates of each parameter */
  int64_t nsteps;           /* successful ebb_optim_step calls */
};

/* ---- type-stable records ------------------------------------------------------------------------ */

static ebb_lock free_lock = {.state = 0, .rank = EBB_RANK_LEAF, .name = "optim records"};
static struct ebb_list params_free = {&params_free, &params_free}, optim_free = {&optim_free, &optim_free};
static long params_nfree, optim_nfree;

/* A record from the FIFO when enough wait in it, else a new one; zeroed (magic 0). */
static void *rec_get(struct ebb_list *fifo, long *nfree, size_t bytes, size_t link_off) {
  void *r = NULL;
  ebb__lock(&free_lock);
  if (*nfree > REUSE_AFTER) {
    struct ebb_list *l = fifo->next;
    ebb_list_remove(l);
    (*nfree)--;
    r = (char *)l - link_off;
  }
  ebb__unlock(&free_lock);
  if (!r) return calloc(1, bytes);
  memset(r, 0, bytes);
  return r;
}

static void rec_put(struct ebb_list *fifo, long *nfree, struct ebb_list *link) {
  ebb__lock(&free_lock);
  ebb_list_insert_tail(fifo, link);
  (*nfree)++;
  ebb__unlock(&free_lock);
}

static ebb_status check_pl(const char *fn, const ebb_params_t *pl) {
  if (!pl) return ebb__fail(EBB_EINVAL, "%s: pl is NULL; expected a parameter list (ebb_params_create)", fn);
  if (atomic_load_explicit(&pl->magic, memory_order_relaxed) != PARAMS_MAGIC)
    return ebb__fail(EBB_EFREED, "%s: parameter list %p was destroyed", fn, (const void *)pl);
  return EBB_OK;
}

static ebb_status check_opt(const char *fn, const ebb_optim_t *o) {
  if (!o) return ebb__fail(EBB_EINVAL, "%s: opt is NULL; expected an optimizer (ebb_optim_sgd, ebb_optim_adamw)", fn);
  if (atomic_load_explicit(&o->magic, memory_order_relaxed) != OPTIM_MAGIC)
    return ebb__fail(EBB_EFREED, "%s: optimizer %p was destroyed", fn, (const void *)o);
  return EBB_OK;
}

/* A failure of a call made on the user's behalf, reworded to start with the user's call (fn). */
static ebb_status wrap(const char *fn, ebb_status st) {
  if (!st) return st;
  const char *e = ebb_last_error();
  size_t k = strlen(fn);
  if (strncmp(e, fn, k) == 0 && e[k] == ':') return st;
  char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
  snprintf(why, sizeof why, "%s", e);
  return ebb__fail(st, "%s: %s", fn, why);
}

/* A value that must be >= 0 (NaN is not). */
static ebb_status nonneg(const char *fn, const char *what, double v) {
  if (v >= 0) return EBB_OK;
  return ebb__fail(EBB_EINVAL, "%s: %s is %g; expected a value >= 0", fn, what, v);
}

/* ---- parameter lists ------------------------------------------------------------------------------ */

ebb_status ebb_params_create(ebb_params_t **out) {
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_params_create: out is NULL; expected a list handle to fill");
  ebb_params_t *pl = rec_get(&params_free, &params_nfree, sizeof *pl, offsetof(ebb_params_t, free_link));
  if (!pl) return ebb__fail(EBB_ENOMEM, "ebb_params_create: no host memory for a parameter list");
  pl->ngroups = 1;
  atomic_store_explicit(&pl->magic, PARAMS_MAGIC, memory_order_relaxed);
  *out = pl;
  return EBB_OK;
}

ebb_status ebb_params_destroy(ebb_params_t *pl) {
  ebb_status st = check_pl("ebb_params_destroy", pl);
  if (st) return st;
  uint32_t want = PARAMS_MAGIC;
  /* one destroyer wins; a second (racing or later) reads it destroyed */
  if (!atomic_compare_exchange_strong_explicit(&pl->magic, &want, 0, memory_order_relaxed, memory_order_relaxed))
    return ebb__fail(EBB_EFREED, "ebb_params_destroy: parameter list %p was destroyed", (const void *)pl);
  for (int i = 0; i < pl->n; i++) ebb_tensor_release(pl->ts[i]);
  free(pl->ts);
  free(pl->group);
  free(pl->glr);
  free(pl->gwd);
  rec_put(&params_free, &params_nfree, &pl->free_link);
  return EBB_OK;
}

ebb_status ebb_params_add_group(ebb_params_t *pl, double lr, double weight_decay, int *group) {
  static const char fn[] = "ebb_params_add_group";
  ebb_status st = check_pl(fn, pl);
  if (!st && !group) st = ebb__fail(EBB_EINVAL, "%s: group is NULL; expected an int to receive the group's index", fn);
  if (!st) st = nonneg(fn, "lr", lr);
  if (!st) st = nonneg(fn, "weight_decay", weight_decay);
  if (st) return st;
  double *glr = realloc(pl->glr, sizeof *glr * (size_t)(pl->ngroups + 1));
  if (glr) pl->glr = glr;
  double *gwd = glr ? realloc(pl->gwd, sizeof *gwd * (size_t)(pl->ngroups + 1)) : NULL;
  if (gwd) pl->gwd = gwd;
  if (!glr || !gwd) return ebb__fail(EBB_ENOMEM, "%s: no host memory for group %d", fn, pl->ngroups);
  pl->glr[pl->ngroups] = lr;
  pl->gwd[pl->ngroups] = weight_decay;
  *group = pl->ngroups++;
  return EBB_OK;
}

static ebb_status add_to(const char *fn, ebb_params_t *pl, int group, ebb_tensor_t *t) {
  ebb_status st = check_pl(fn, pl);
  if (!st) st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  char td[EBB__DESC_MAX], od[EBB__DESC_MAX];
  if (group < 0 || group >= pl->ngroups)
    return ebb__fail(EBB_EINVAL, "%s: group %d does not exist; expected 0 or a group from ebb_params_add_group (0..%d)", fn, group,
                     pl->ngroups - 1);
  ebb_tensor_info ti;
  ebb_tensor_get_info(t, &ti);
  ebb__tensor_desc(t, "t", -1, td, sizeof td);
  if (!ebb_dtype_is_float(ti.dtype))
    return ebb__fail(EBB_EINVAL, "%s: %s is not floating; expected an f32, f64, bf16 or f16 parameter", fn, td);
  if (!ti.contiguous) return ebb__fail(EBB_EINVAL, "%s: %s is not contiguous; expected a contiguous parameter", fn, td);
  bool leaf = false;
  if ((st = ebb_tensor_is_leaf(t, &leaf))) return wrap(fn, st);
  if (!leaf)
    return ebb__fail(EBB_EINVAL, "%s: %s is not a leaf (a recorded op made it); expected a leaf parameter (ebb_tensor_detach "
                     "makes one)", fn, td);
  for (int i = 0; i < pl->n; i++) {
    bool same = false;
    ebb_tensor_same_storage(t, pl->ts[i], &same);
    if (same)
      return ebb__fail(EBB_EINVAL, "%s: %s shares its storage with %s, already in the list; expected each parameter once", fn, td,
                       ebb__tensor_desc(pl->ts[i], "params", i, od, sizeof od));
  }
  if (pl->n == pl->cap) {
    int cap = pl->cap ? pl->cap * 2 : 16;
    ebb_tensor_t **ts = realloc(pl->ts, sizeof *ts * (size_t)cap);
    if (ts) pl->ts = ts;
    int *g = ts ? realloc(pl->group, sizeof *g * (size_t)cap) : NULL;
    if (g) pl->group = g;
    if (!ts || !g) return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d parameters", fn, cap);
    pl->cap = cap;
  }
  ebb_tensor_retain(t);
  pl->ts[pl->n] = t;
  pl->group[pl->n++] = group;
  return EBB_OK;
}

ebb_status ebb_params_add_to(ebb_params_t *pl, int group, ebb_tensor_t *t) { return add_to("ebb_params_add_to", pl, group, t); }
ebb_status ebb_params_add(ebb_params_t *pl, ebb_tensor_t *t) { return add_to("ebb_params_add", pl, 0, t); }

ebb_status ebb_params_count(const ebb_params_t *pl, int *out) {
  ebb_status st = check_pl("ebb_params_count", pl);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_params_count: out is NULL; expected an int to fill");
  *out = pl->n;
  return EBB_OK;
}

/* ---- optimizers: creation -------------------------------------------------------------------------- */

ebb_adamw_options ebb_adamw_defaults(void) {
  ebb_adamw_options o;
  memset(&o, 0, sizeof o);
  o.lr = 1e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 1e-2;
  return o;
}

static ebb_status optim_new(const char *fn, const ebb_params_t *pl, const void *opts, ebb_optim_t **out, ebb_optim_t **made) {
  ebb_status st = check_pl(fn, pl);
  if (st) return st;
  if (!opts) return ebb__fail(EBB_EINVAL, "%s: opts is NULL; expected the optimizer's options", fn);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an optimizer handle to fill", fn);
  if (pl->n == 0) return ebb__fail(EBB_EINVAL, "%s: the parameter list is empty; expected at least one parameter (ebb_params_add)", fn);
  ebb_optim_t *o = rec_get(&optim_free, &optim_nfree, sizeof *o, offsetof(ebb_optim_t, free_link));
  if (!o) return ebb__fail(EBB_ENOMEM, "%s: no host memory for an optimizer", fn);
  const size_t n = (size_t)pl->n;
  o->n = pl->n;
  o->ngroups = pl->ngroups;
  o->params = calloc(n, sizeof *o->params);
  o->group = calloc(n, sizeof *o->group);
  o->lr = calloc((size_t)pl->ngroups, sizeof *o->lr);
  o->wd = calloc((size_t)pl->ngroups, sizeof *o->wd);
  o->state = calloc(n, sizeof *o->state);
  o->fresh = calloc(n, sizeof *o->fresh);
  o->steps = calloc(n, sizeof *o->steps);
  if (!o->params || !o->group || !o->lr || !o->wd || !o->state || !o->fresh || !o->steps) {
    free(o->params), free(o->group), free(o->lr), free(o->wd), free(o->state), free(o->fresh), free(o->steps);
    rec_put(&optim_free, &optim_nfree, &o->free_link);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the state of %d parameters", fn, pl->n);
  }
  for (int i = 0; i < pl->n; i++) {
    ebb_tensor_retain(pl->ts[i]);
    o->params[i] = pl->ts[i];
    o->group[i] = pl->group[i];
  }
  for (int g = 1; g < pl->ngroups; g++) {
    o->lr[g] = pl->glr[g];
    o->wd[g] = pl->gwd[g];
  }
  *made = o;
  return EBB_OK;
}

ebb_status ebb_optim_sgd(const ebb_params_t *pl, const ebb_sgd_options *opts, ebb_optim_t **out) {
  static const char fn[] = "ebb_optim_sgd";
  ebb_status st = EBB_OK;
  if (opts) {
    if (!st) st = nonneg(fn, "opts->lr", opts->lr);
    if (!st) st = nonneg(fn, "opts->momentum", opts->momentum);
    if (!st) st = nonneg(fn, "opts->weight_decay", opts->weight_decay);
    if (!st && !(opts->dampening == opts->dampening))
      st = ebb__fail(EBB_EINVAL, "%s: opts->dampening is NaN; expected a number", fn);
    if (!st && opts->nesterov && (opts->momentum <= 0 || opts->dampening != 0))
      st = ebb__fail(EBB_EINVAL, "%s: nesterov with momentum %g and dampening %g; expected momentum > 0 and dampening 0", fn,
                     opts->momentum, opts->dampening);
    if (st) return st;
  }
  ebb_optim_t *o;
  if ((st = optim_new(fn, pl, opts, out, &o))) return st;
  o->h.kind = EBB__OPTIM_SGD;
  o->h.flags = (opts->nesterov ? EBB__OPTIM_NESTEROV : 0u) | (opts->maximize ? EBB__OPTIM_MAXIMIZE : 0u);
  o->h.momentum = opts->momentum;
  o->h.dampening = opts->dampening;
  o->kind_name = "SGD";
  o->nstate = opts->momentum != 0 ? 1 : 0;
  o->lr[0] = opts->lr;
  o->wd[0] = opts->weight_decay;
  atomic_store_explicit(&o->magic, OPTIM_MAGIC, memory_order_relaxed);
  *out = o;
  return EBB_OK;
}

ebb_status ebb_optim_adamw(const ebb_params_t *pl, const ebb_adamw_options *opts, ebb_optim_t **out) {
  static const char fn[] = "ebb_optim_adamw";
  ebb_status st = EBB_OK;
  if (opts) {
    if (!st) st = nonneg(fn, "opts->lr", opts->lr);
    if (!st) st = nonneg(fn, "opts->eps", opts->eps);
    if (!st) st = nonneg(fn, "opts->weight_decay", opts->weight_decay);
    if (!st && !(opts->beta1 >= 0 && opts->beta1 < 1))
      st = ebb__fail(EBB_EINVAL, "%s: opts->beta1 is %g; expected a value in [0, 1)", fn, opts->beta1);
    if (!st && !(opts->beta2 >= 0 && opts->beta2 < 1))
      st = ebb__fail(EBB_EINVAL, "%s: opts->beta2 is %g; expected a value in [0, 1)", fn, opts->beta2);
    if (st) return st;
  }
  ebb_optim_t *o;
  if ((st = optim_new(fn, pl, opts, out, &o))) return st;
  o->h.kind = EBB__OPTIM_ADAMW;
  o->h.flags = (opts->amsgrad ? EBB__OPTIM_AMSGRAD : 0u) | (opts->maximize ? EBB__OPTIM_MAXIMIZE : 0u);
  o->h.beta1 = opts->beta1;
  o->h.beta2 = opts->beta2;
  o->h.eps = opts->eps;
  o->kind_name = "AdamW";
  o->nstate = opts->amsgrad ? 3 : 2;
  o->lr[0] = opts->lr;
  o->wd[0] = opts->weight_decay;
  atomic_store_explicit(&o->magic, OPTIM_MAGIC, memory_order_relaxed);
  *out = o;
  return EBB_OK;
}

ebb_status ebb_optim_destroy(ebb_optim_t *o) {
  ebb_status st = check_opt("ebb_optim_destroy", o);
  if (st) return st;
  uint32_t want = OPTIM_MAGIC;
  if (!atomic_compare_exchange_strong_explicit(&o->magic, &want, 0, memory_order_relaxed, memory_order_relaxed))
    return ebb__fail(EBB_EFREED, "ebb_optim_destroy: optimizer %p was destroyed", (const void *)o);
  for (int i = 0; i < o->n; i++) {
    for (int k = 0; k < 3; k++)
      if (o->state[i][k]) ebb_tensor_release(o->state[i][k]);
    ebb_tensor_release(o->params[i]);
  }
  free(o->params), free(o->group), free(o->lr), free(o->wd), free(o->state), free(o->fresh), free(o->steps);
  rec_put(&optim_free, &optim_nfree, &o->free_link);
  return EBB_OK;
}

/* ---- the step ---------------------------------------------------------------------------------------- */

static const char *const state_names[2][3] = {{"momentum_buffer", NULL, NULL}, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}};

/* The missing state of parameter i, allocated uninitialised on its device (the first update
 * writes it without reading it), tagged as optimizer state named after the parameter. */
static ebb_status state_alloc(const char *fn, ebb_optim_t *o, int i) {
  ebb_tensor_info ti;
  ebb_tensor_get_info(o->params[i], &ti);
  char pname[EBB_TENSOR_NAME_MAX + 1];
  ebb_tensor_name(o->params[i], pname, sizeof pname);
  for (int k = 0; k < o->nstate; k++) {
    if (o->state[i][k]) continue;
    char name[EBB_TENSOR_NAME_MAX + 1];
    const char *sn = state_names[o->h.kind][k];
    if (pname[0]) snprintf(name, sizeof name, "%.*s.%s", (int)(EBB_TENSOR_NAME_MAX - 1 - strlen(sn)), pname, sn);
    else snprintf(name, sizeof name, "params[%d].%s", i, sn);
    ebb_status st = ebb_tensor_empty_named(ti.device, ti.dtype, ti.ndim, ti.shape, EBB_OWNER_OPTIMIZER, name, &o->state[i][k]);
    if (st) return wrap(fn, st);
    o->fresh[i] = true;
  }
  return EBB_OK;
}

/* One update from grads[i] (NULL: skipped). */
static ebb_status step_with(const char *fn, ebb_optim_t *o, const ebb_tensor_t *const *grads) {
  ebb__optim_item *items = calloc((size_t)o->n, sizeof *items);
  if (!items) return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d parameters", fn, o->n);
  int m = 0;
  ebb_status st = EBB_OK;
  for (int i = 0; !st && i < o->n; i++) {
    if (!grads[i]) continue;
    st = ebb__tensor_check_at(o->params[i], fn, "params", i);
    if (!st) st = state_alloc(fn, o, i);
    if (st) break;
    ebb__optim_item *it = &items[m++];
    it->param = o->params[i];
    it->grad = grads[i];
    for (int k = 0; k < 3; k++) it->state[k] = o->state[i][k];
    it->lr = o->lr[o->group[i]];
    it->weight_decay = o->wd[o->group[i]];
    it->step = o->steps[i] + 1;
    it->first = o->fresh[i];
    it->index = i;
  }
  bool *updated = NULL;
  if (!st && m > 0 && !(updated = calloc((size_t)m, sizeof *updated)))
    st = ebb__fail(EBB_ENOMEM, "%s: no host memory for %d parameters", fn, m);
  if (!st) {
    bool was;
    ebb_grad_set_enabled(false, &was); /* nothing to record; leaves that require gradients may change */
    st = ebb__optim_fused(fn, &o->h, items, m, updated);
    ebb_grad_set_enabled(was, NULL);
  }
  /* A parameter the update reached took its step, even when a later launch failed: its count
   * and state say so, and a retry does not apply the step again as its first. */
  for (int k = 0; updated && k < m; k++)
    if (updated[k]) {
      o->steps[items[k].index]++;
      o->fresh[items[k].index] = false;
    }
  if (!st) o->nsteps++;
  free(updated);
  free(items);
  return st;
}

ebb_status ebb_optim_step(ebb_optim_t *o) {
  static const char fn[] = "ebb_optim_step";
  ebb_status st = check_opt(fn, o);
  if (st) return st;
  ebb_tensor_t **grads = calloc((size_t)o->n, sizeof *grads);
  if (!grads) return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d gradients", fn, o->n);
  for (int i = 0; !st && i < o->n; i++) {
    st = ebb__tensor_check_at(o->params[i], fn, "params", i);
    if (!st && (st = ebb_tensor_grad(o->params[i], &grads[i]))) st = wrap(fn, st);
  }
  if (!st) st = step_with(fn, o, (const ebb_tensor_t *const *)grads);
  for (int i = 0; i < o->n; i++)
    if (grads[i]) ebb_tensor_release(grads[i]);
  free(grads);
  return st;
}

ebb_status ebb_optim_step_grads(ebb_optim_t *o, const ebb_tensor_t *const *grads, int n) {
  static const char fn[] = "ebb_optim_step_grads";
  ebb_status st = check_opt(fn, o);
  if (st) return st;
  if (!grads) return ebb__fail(EBB_EINVAL, "%s: grads is NULL; expected an array of %d gradients (NULL entries skip)", fn, o->n);
  if (n != o->n) return ebb__fail(EBB_EINVAL, "%s: n is %d; expected the number of parameters, %d", fn, n, o->n);
  return step_with(fn, o, grads);
}

ebb_status ebb_optim_zero_grad(ebb_optim_t *o, bool set_to_none) {
  static const char fn[] = "ebb_optim_zero_grad";
  ebb_status st = check_opt(fn, o);
  for (int i = 0; !st && i < o->n; i++) st = ebb__tensor_check_at(o->params[i], fn, "params", i);
  if (st) return st;
  bool was;
  ebb_grad_set_enabled(false, &was);
  for (int i = 0; !st && i < o->n; i++) {
    if (set_to_none) {
      st = ebb_tensor_set_grad(o->params[i], NULL);
      continue;
    }
    ebb_tensor_t *g = NULL;
    st = ebb_tensor_grad(o->params[i], &g);
    if (!st && g) st = ebb_tensor_zero_(g);
    if (g) ebb_tensor_release(g);
  }
  ebb_grad_set_enabled(was, NULL);
  return st ? wrap(fn, st) : EBB_OK;
}

/* ---- settings and state ---------------------------------------------------------------------------- */

ebb_status ebb_optim_set_lr(ebb_optim_t *o, int group, double lr) {
  static const char fn[] = "ebb_optim_set_lr";
  ebb_status st = check_opt(fn, o);
  if (!st) st = nonneg(fn, "lr", lr);
  if (st) return st;
  if (group < -1 || group >= o->ngroups)
    return ebb__fail(EBB_EINVAL, "%s: group %d does not exist; expected -1 (all) or 0..%d", fn, group, o->ngroups - 1);
  for (int g = 0; g < o->ngroups; g++)
    if (group == -1 || g == group) o->lr[g] = lr;
  return EBB_OK;
}

ebb_status ebb_optim_lr(const ebb_optim_t *o, int group, double *out) {
  static const char fn[] = "ebb_optim_lr";
  ebb_status st = check_opt(fn, o);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a double to fill", fn);
  if (group < 0 || group >= o->ngroups)
    return ebb__fail(EBB_EINVAL, "%s: group %d does not exist; expected 0..%d", fn, group, o->ngroups - 1);
  *out = o->lr[group];
  return EBB_OK;
}

ebb_status ebb_optim_step_count(const ebb_optim_t *o, int param, int64_t *out) {
  static const char fn[] = "ebb_optim_step_count";
  ebb_status st = check_opt(fn, o);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an int64_t to fill", fn);
  if (param < -1 || param >= o->n)
    return ebb__fail(EBB_EINVAL, "%s: param %d is out of range; expected -1 (the optimizer) or 0..%d", fn, param, o->n - 1);
  *out = param < 0 ? o->nsteps : o->steps[param];
  return EBB_OK;
}

ebb_status ebb_optim_state(const ebb_optim_t *o, int param, const char *name, ebb_tensor_t **out) {
  static const char fn[] = "ebb_optim_state";
  ebb_status st = check_opt(fn, o);
  if (st) return st;
  if (!out || !name) return ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected a state name and a tensor handle to fill", fn, out ? "name" : "out");
  if (param < 0 || param >= o->n) return ebb__fail(EBB_EINVAL, "%s: param %d is out of range; expected 0..%d", fn, param, o->n - 1);
  int k = -1;
  for (int j = 0; j < 3; j++)
    if (state_names[o->h.kind][j] && strcmp(name, state_names[o->h.kind][j]) == 0) k = j;
  if (k < 0)
    return ebb__fail(EBB_EINVAL, "%s: '%s' is not a state of %s; expected %s", fn, name, o->kind_name,
                     o->h.kind == EBB__OPTIM_SGD ? "\"momentum_buffer\"" : "\"exp_avg\", \"exp_avg_sq\" or \"max_exp_avg_sq\"");
  ebb_tensor_t *s = k < o->nstate && !o->fresh[param] ? o->state[param][k] : NULL;
  if (s) ebb_tensor_retain(s);
  *out = s;
  return EBB_OK;
}
