/* reducer.c: the data-parallel reducer (include/ebb/ddp.h).
 *
 * A reducer owns flat buckets (one tensor each) and, per parameter, a view of its bucket that
 * serves as the parameter's .grad. Per step: the first post-accumulate hook of a backward asks
 * the engine which parameters' AccumulateGrad nodes will run and counts the others ready; each
 * hook marks its parameter ready and issues, in bucket order, every bucket whose parameters are
 * all ready; ebb_reducer_finish issues the rest and waits.
 *
 * Locks: each reducer has one mutex (EBB_RANK_DDP_REDUCER) guarding its step state and held
 * across the all-reduces it issues, so buckets leave in index order whatever thread runs the
 * hooks. Calls into autograd (.grad, will_execute) take locks of a lower rank: they run outside
 * the reducer's mutex. The module's mutex (a leaf) guards the table of records only.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_export.h"
#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/ddp.h"
#include "ebb/dist.h"
#include "ebb/stream.h"
#include "ebb/tensor.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "ops_export.h"
#include "runtime_export.h"

#define REDUCER_MAGIC 0x52454455u /* "REDU" */
#define REUSE_AFTER 256           /* destroyed records reused first in, first out after this many */
#define DESC_COLS (2 + EBB_TENSOR_MAX_DIMS)

struct rparam {
  struct ebb_reducer *r;
  int index;
  ebb_tensor_t *t;          /* retained */
  ebb_gradient_edge edge;   /* holds the AccumulateGrad node */
  ebb_hook_handle hook;      /* post-accumulate: ready */
  ebb_hook_handle pre_hook;  /* tensor hook: refuses a second backward before it writes the bucket */
  ebb_dtype dt;
  int64_t numel;
  int bucket;
  int64_t offset;           /* in the bucket, elements */
  ebb_tensor_t *view;       /* the bucket's part of this parameter, in its shape */
  void *view_ptr;
  bool will_run;            /* this step: the backward runs its AccumulateGrad */
  bool ready;
};

struct rbucket {
  ebb_tensor_t *flat;
  ebb_dtype dt;
  int64_t numel;
  int *idx;                 /* parameter indices, in bucket order */
  int n;
  int pending;              /* this step: parameters not ready yet */
  ebb_work_t *work;         /* this step's all-reduce, once issued */
  const char *owner;        /* "ddp bucket <k>", interned: the owner of its memory and its all-reduce */
};

struct ebb_reducer {
  ebb_mutex mu;             /* first: kept (initialised once) when the record is reused */
  uint32_t magic;
  struct ebb_reducer *next_free;
  ebb_pg_t *pg;
  int device, rank, size;
  /* Device groups: the stream the all-reduces are issued from. A collective makes the stream
   * current at its issue wait for its end; issued from the backward's stream, that would hold
   * backward's next kernels until the bucket is reduced. This stream takes that wait instead
   * (after waiting itself for the backward's stream), and ebb_reducer_finish makes the caller's
   * current stream wait for it once. */
  ebb_stream_t *side;
  ebb_reducer_options o;
  int np;
  struct rparam *p;
  int nb;
  struct rbucket *b;
  /* the step */
  bool active;              /* a backward's first hook ran, finish not yet */
  bool no_sync;             /* ebb_reducer_set_sync(false): backwards only accumulate */
  int64_t task;             /* that backward's id */
  int next;                 /* the next bucket to issue */
  ebb_status err;           /* the first failure of a hook or an issue, for finish */
  bool halted;              /* debug mode: a fingerprint differed, nothing more is reduced this step */
  char msg[EBB__ERRMSG_MAX];
  int steps;                /* finished steps */
  int *order;               /* the first step's ready order */
  int norder;
};

/* ---- the module: live count and type-stable records ------------------------------------------- */

static ebb_mutex mod_mu;
static bool mod_once;
static long live_reducers;
static struct ebb_reducer *free_head, *free_tail;
static int nfree;

static ebb_status ddp_start(void) {
  if (!mod_once) {
    ebb__mutex_init(&mod_mu, "ddp", EBB_RANK_LEAF);
    mod_once = true;
  }
  return EBB_OK;
}

static int ddp_count(ebb__live_count *out, int max) {
  if (max < 1 || !mod_once) return 0;
  ebb__mutex_lock(&mod_mu);
  out[0] = (ebb__live_count){"reducers", live_reducers};
  ebb__mutex_unlock(&mod_mu);
  return 1;
}

const ebb__module_desc ebb__module_ddp = {
    .name = "ddp",
    .layer = EBB__LAYER_DDP,
    .start = ddp_start,
    .count = ddp_count,
};

static struct ebb_reducer *record_new(void) {
  struct ebb_reducer *r = NULL;
  ebb__mutex_lock(&mod_mu);
  if (nfree > REUSE_AFTER) {
    r = free_head;
    free_head = r->next_free;
    if (!free_head) free_tail = NULL;
    nfree--;
  }
  ebb__mutex_unlock(&mod_mu);
  if (!r) {
    r = calloc(1, sizeof *r);
    if (!r) return NULL;
    ebb__mutex_init(&r->mu, "ddp reducer", EBB_RANK_DDP_REDUCER);
  } else {
    memset((char *)r + sizeof r->mu, 0, sizeof *r - sizeof r->mu);
  }
  return r;
}

static void record_free(struct ebb_reducer *r) {
  r->magic = 0;
  r->next_free = NULL;
  ebb__mutex_lock(&mod_mu);
  if (free_tail) free_tail->next_free = r;
  else free_head = r;
  free_tail = r;
  nfree++;
  ebb__mutex_unlock(&mod_mu);
}

static ebb_status check_handle(const struct ebb_reducer *r, const char *fn) {
  if (!r) return ebb__fail(EBB_EINVAL, "%s: r is NULL; expected a reducer from ebb_reducer_create", fn);
  if (r->magic != REDUCER_MAGIC) return ebb__fail(EBB_EFREED, "%s: the reducer was destroyed", fn);
  return EBB_OK;
}

/* ---- helpers ---------------------------------------------------------------------------------- */

static const char *dev_str(int device, char *buf, size_t cap) {
  if (device == EBB_DEVICE_CPU) snprintf(buf, cap, "the CPU");
  else snprintf(buf, cap, "device %d", device);
  return buf;
}

/* "parameter 3 (name, f32[4, 8] on ...)" */
static const char *pdesc(const struct ebb_reducer *r, int i, char *buf, size_t cap) {
  return ebb__tensor_desc(r->p[i].t, "parameter", i, buf, cap);
}

/* A description row of parameter shape and dtype, as exchanged at creation. */
static const char *row_str(const int64_t *row, char *buf, size_t cap) {
  int k = snprintf(buf, cap, "%s[", ebb_dtype_name((ebb_dtype)row[0]));
  for (int d = 0; d < row[1] && d < EBB_TENSOR_MAX_DIMS && k > 0 && (size_t)k < cap; d++)
    k += snprintf(buf + k, cap - (size_t)k, d ? ", %" PRId64 : "%" PRId64, row[2 + d]);
  if (k > 0 && (size_t)k < cap) snprintf(buf + k, cap - (size_t)k, "]");
  return buf;
}

/* Keeps the first failure of the step (under r->mu). */
static void step_fail(struct ebb_reducer *r, ebb_status st) {
  if (!r->err) {
    r->err = st;
    snprintf(r->msg, sizeof r->msg, "%s", ebb_last_error());
  }
}

/* ---- buckets ---------------------------------------------------------------------------------- */

static void free_buckets(struct rbucket *b, int nb) {
  for (int k = 0; b && k < nb; k++) {
    if (b[k].work) ebb_work_release(b[k].work);
    if (b[k].flat) ebb_tensor_release(b[k].flat);
    free(b[k].idx);
  }
  free(b);
}

/* Assigns parameters to buckets in `order` (n indices): a bucket closes when the next parameter
 * has another dtype or would pass the cap (the first bucket's cap for bucket 0). Allocates the
 * flat buckets (zeroed) and each parameter's view in *views (new references), offsets in *offs,
 * bucket numbers in *bk. */
static ebb_status plan_buckets(struct ebb_reducer *r, const int *order, struct rbucket **out_b, int *out_nb, ebb_tensor_t **views,
                               int64_t *offs, int *bk, const char *fn) {
  struct rbucket *b = calloc((size_t)r->np, sizeof *b);
  if (!b) return ebb__fail(EBB_ENOMEM, "%s: no host memory for %d buckets", fn, r->np);
  /* First the assignment (bucket numbers, offsets, sizes), then each bucket's index list. */
  int nb = 0;
  int64_t bytes = 0;
  for (int k = 0; k < r->np; k++) {
    struct rparam *p = &r->p[order[k]];
    int64_t pb = p->numel * (int64_t)ebb_dtype_size(p->dt);
    int64_t cap = nb <= 1 ? r->o.first_bucket_bytes : r->o.bucket_bytes; /* the open bucket's (number nb - 1) */
    struct rbucket *cur = nb ? &b[nb - 1] : NULL;
    if (!cur || cur->dt != p->dt || (cur->n > 0 && bytes + pb > cap)) {
      cur = &b[nb++];
      cur->dt = p->dt;
      bytes = 0;
    }
    offs[order[k]] = cur->numel;
    bk[order[k]] = nb - 1;
    cur->n++;
    cur->numel += p->numel;
    bytes += pb;
  }
  for (int k = 0; k < nb; k++) {
    b[k].idx = malloc((size_t)b[k].n * sizeof *b[k].idx);
    if (!b[k].idx) {
      free_buckets(b, nb);
      return ebb__fail(EBB_ENOMEM, "%s: no host memory for a bucket", fn);
    }
    b[k].n = 0;
  }
  for (int k = 0; k < r->np; k++) {
    struct rbucket *cur = &b[bk[order[k]]];
    cur->idx[cur->n++] = order[k];
  }
  ebb_status st = EBB_OK;
  for (int k = 0; k < nb && !st; k++) {
    char name[64];
    snprintf(name, sizeof name, "ddp bucket %d", k);
    int64_t shape[1] = {b[k].numel};
    st = ebb__alloc_intern("ebb_reducer", name, &b[k].owner);
    if (!st) st = ebb_tensor_empty_named(r->device, b[k].dt, 1, shape, EBB_OWNER_GRADIENT, name, &b[k].flat);
    if (!st) st = ebb_tensor_zero_(b[k].flat);
  }
  for (int i = 0; i < r->np && !st; i++) {
    ebb_tensor_info info;
    ebb_tensor_t *nar = NULL;
    st = ebb_tensor_get_info(r->p[i].t, &info);
    if (!st) st = ebb_tensor_narrow(b[bk[i]].flat, 0, offs[i], r->p[i].numel, &nar);
    if (!st) st = ebb_tensor_view(nar, info.ndim, info.shape, &views[i]);
    if (nar) ebb_tensor_release(nar);
  }
  if (st) {
    for (int i = 0; i < r->np; i++)
      if (views[i]) ebb_tensor_release(views[i]), views[i] = NULL;
    free_buckets(b, nb);
    return st;
  }
  *out_b = b;
  *out_nb = nb;
  return EBB_OK;
}

/* Installs new buckets: each parameter's view gets its old gradient (the old view's values, or
 * its .grad when it had one of its own), and in view mode becomes its .grad. */
static ebb_status install_buckets(struct ebb_reducer *r, struct rbucket *nbk, int nnb, ebb_tensor_t **views, const int64_t *offs,
                                  const int *bk, bool from_grad) {
  ebb_status st = EBB_OK;
  bool was;
  ebb_grad_set_enabled(false, &was);
  for (int i = 0; i < r->np && !st; i++) {
    struct rparam *p = &r->p[i];
    ebb_tensor_t *g = NULL;
    if (from_grad || !p->view) st = ebb_tensor_grad(p->t, &g);
    const ebb_tensor_t *src = g ? g : p->view;
    if (!st && src) st = ebb_tensor_copy_(views[i], src);
    if (g) ebb_tensor_release(g);
    if (!st && !r->o.copy_grads) st = ebb_tensor_set_grad(p->t, views[i]);
  }
  ebb_grad_set_enabled(was, NULL);
  if (st) return st;
  for (int i = 0; i < r->np; i++) {
    struct rparam *p = &r->p[i];
    if (p->view) ebb_tensor_release(p->view);
    p->view = views[i];
    views[i] = NULL;
    ebb_tensor_data(p->view, &p->view_ptr);
    p->offset = offs[i];
    p->bucket = bk[i];
  }
  free_buckets(r->b, r->nb);
  r->b = nbk;
  r->nb = nnb;
  return EBB_OK;
}

/* Plans and installs buckets in `order`. */
static ebb_status build_buckets(struct ebb_reducer *r, const int *order, bool from_grad, const char *fn) {
  ebb_tensor_t **views = calloc((size_t)r->np, sizeof *views);
  int64_t *offs = calloc((size_t)r->np, sizeof *offs);
  int *bk = calloc((size_t)r->np, sizeof *bk);
  ebb_status st = (!views || !offs || !bk) ? ebb__fail(EBB_ENOMEM, "%s: no host memory for the bucket plan", fn) : EBB_OK;
  struct rbucket *nbk = NULL;
  int nnb = 0;
  if (!st) st = plan_buckets(r, order, &nbk, &nnb, views, offs, bk, fn);
  if (!st) {
    st = install_buckets(r, nbk, nnb, views, offs, bk, from_grad);
    if (st) {
      for (int i = 0; i < r->np; i++)
        if (views[i]) ebb_tensor_release(views[i]);
      free_buckets(nbk, nnb);
    }
  }
  free(views);
  free(offs);
  free(bk);
  return st;
}

/* ---- the step --------------------------------------------------------------------------------- */

/* Debug mode: bucket k's fingerprint against every rank's (under r->mu; blocking). A difference
 * is seen by every rank in the same exchange, so all of them stop reducing this step. */
enum { FP_COLS = 6 };
static ebb_status fingerprint(struct ebb_reducer *r, int k) {
  const struct rbucket *b = &r->b[k];
  int64_t mine[FP_COLS] = {r->steps, k, b->numel, b->dt, b->n, r->nb}, n = FP_COLS, gshape[2] = {r->size, FP_COLS};
  int64_t *all = calloc((size_t)r->size * FP_COLS, sizeof *all);
  if (!all) return ebb__fail(EBB_ENOMEM, "ebb_reducer: no host memory for the fingerprint of bucket %d", k);
  ebb_tensor_t *in = NULL, *out = NULL;
  ebb_status st = ebb_tensor_from_host(r->device, EBB_I64, 1, &n, mine, sizeof mine, &in);
  if (!st) st = ebb_tensor_empty(r->device, EBB_I64, 2, gshape, &out);
  if (!st) st = ebb_all_gather(r->pg, out, in, NULL);
  if (!st) st = ebb_tensor_to_host(out, all, (size_t)r->size * FP_COLS * sizeof *all);
  if (in) ebb_tensor_release(in);
  if (out) ebb_tensor_release(out);
  if (st) {
    free(all);
    return ebb__fail(st, "ebb_reducer: the fingerprint exchange of bucket %d failed: %s", k, ebb_last_error());
  }
  for (int q = 0; q < r->size && !st; q++) {
    const int64_t *f = all + q * FP_COLS;
    if (!memcmp(f, mine, sizeof mine)) continue;
    char ps[256] = "";
    size_t l = 0;
    for (int j = 0; j < b->n && l + 40 < sizeof ps; j++) {
      char d[EBB__DESC_MAX];
      l += (size_t)snprintf(ps + l, sizeof ps - l, "%s%s", j ? ", " : "", pdesc(r, b->idx[j], d, sizeof d));
    }
    const char *dn = f[3] >= 0 && f[3] < 16 ? ebb_dtype_name((ebb_dtype)f[3]) : "?";
    st = ebb__fail(EBB_ESTATE, "ebb_reducer: bucket %d of step %d differs between ranks: rank %d has %" PRId64 " %s elements in %d "
                   "parameters (%s), rank %d is at step %" PRId64 ", bucket %" PRId64 " with %" PRId64 " %s elements in %" PRId64
                   " parameters (of %" PRId64 " buckets, here %d); expected the same buckets in the same order on every rank (the same parameters, options and "
                   "collectives on the group); no further bucket of this step is reduced", k, r->steps, r->rank, b->numel,
                   ebb_dtype_name(b->dt), b->n, ps, q, f[0], f[1], f[2], dn, f[4], f[5], r->nb);
  }
  free(all);
  return st;
}

/* Bucket b's all-reduce (average) under its owner scope, so the trace names the bucket. */
static ebb_status bucket_all_reduce(struct ebb_reducer *r, struct rbucket *b) {
  bool pushed = ebb__alloc_owner_push_interned(EBB_OWNER_GRADIENT, b->owner);
  ebb_status st = ebb_all_reduce(r->pg, b->flat, EBB_REDUCE_AVG, &b->work);
  if (pushed) ebb_alloc_owner_pop();
  return st;
}

/* Issues every bucket from r->next on whose parameters are all ready (under r->mu). */
static void issue_ready(struct ebb_reducer *r) {
  while (r->next < r->nb && r->b[r->next].pending == 0) {
    struct rbucket *b = &r->b[r->next];
    if (r->o.debug_fingerprint && !r->halted) {
      ebb_status fs = fingerprint(r, r->next);
      if (fs) {
        r->halted = true;
        step_fail(r, fs);
      }
    }
    if (r->halted) {
      r->next++;
      continue;
    }
    ebb_status st = EBB_OK;
    if (r->side) { /* on a device: from the side stream, ordered after the accumulation */
      ebb_stream_t *cur = NULL;
      ebb_stream_guard g;
      st = ebb_stream_current(r->device, &cur);
      if (!st) st = ebb_stream_wait_stream(r->side, cur);
      if (!st) st = ebb_stream_guard_enter(&g, r->side);
      if (!st) {
        st = bucket_all_reduce(r, b);
        ebb_status gs = ebb_stream_guard_exit(&g);
        if (!st) st = gs;
      }
    } else {
      st = bucket_all_reduce(r, b);
    }
    if (st) {
      char m[EBB__ERRMSG_MAX];
      snprintf(m, sizeof m, "%s", ebb_last_error());
      step_fail(r, ebb__fail(st, "ebb_reducer: the all-reduce of bucket %d (%" PRId64 " %s elements, %d parameters) failed: %s",
                             r->next, b->numel, ebb_dtype_name(b->dt), b->n, m));
      b->work = NULL;
    }
    r->next++;
  }
}

/* Starts a step (under r->mu): will[i] says whether parameter i's AccumulateGrad runs. */
static void begin_step(struct ebb_reducer *r, int64_t task, const bool *will) {
  r->active = true;
  r->task = task;
  r->next = 0;
  r->err = EBB_OK;
  r->halted = false;
  r->msg[0] = '\0';
  for (int k = 0; k < r->nb; k++) {
    r->b[k].pending = 0;
    if (r->b[k].work) ebb_work_release(r->b[k].work);
    r->b[k].work = NULL;
  }
  for (int i = 0; i < r->np; i++) {
    r->p[i].will_run = will[i];
    r->p[i].ready = !will[i];
    if (will[i]) r->b[r->p[i].bucket].pending++;
  }
}

static ebb_status grad_into_bucket(struct ebb_reducer *r, struct rparam *p);

/* An unused parameter's bucket part gets its .grad as it stands (zero without one), in view mode
 * only when .grad is no longer the view. Outside r->mu: it reads .grad. */
static ebb_status prepare_unused(struct ebb_reducer *r, const bool *will) {
  ebb_status st = EBB_OK;
  bool was;
  ebb_grad_set_enabled(false, &was);
  for (int i = 0; i < r->np && !st; i++)
    if (!will[i]) st = grad_into_bucket(r, &r->p[i]);
  ebb_grad_set_enabled(was, NULL);
  return st;
}

/* The gradient of p into its bucket (outside r->mu): in view mode only when .grad is no longer
 * the view (cleared or replaced: an optimizer's zero_grad to NULL), then set back. */
static ebb_status grad_into_bucket(struct ebb_reducer *r, struct rparam *p) {
  ebb_tensor_t *g = NULL;
  ebb_status st = ebb_tensor_grad(p->t, &g);
  if (st) return st;
  void *gp = NULL;
  if (g) ebb_tensor_data(g, &gp);
  if (g && gp != p->view_ptr) st = ebb_tensor_copy_(p->view, g);
  else if (!g) st = ebb_tensor_zero_(p->view);
  if (!st && !r->o.copy_grads && gp != p->view_ptr) st = ebb_tensor_set_grad(p->t, p->view);
  if (g) ebb_tensor_release(g);
  return st;
}

/* Before the gradient is added into .grad (the bucket): a backward other than the step's open
 * one must not write into buckets whose reduction may be running. */
static ebb_status on_grad(const ebb_tensor_t *grad, ebb_tensor_t **replace, void *user) {
  (void)grad;
  (void)replace;
  struct rparam *p = user;
  struct ebb_reducer *r = p->r;
  int64_t task = ebb_autograd_current_task_id();
  ebb__mutex_lock(&r->mu);
  bool other = r->active && r->task != task;
  int64_t open_task = r->task;
  ebb__mutex_unlock(&r->mu);
  if (other)
    return ebb__fail(EBB_ESTATE, "ebb_reducer: a second backward (%" PRId64 ") reached parameter %d before "
                     "ebb_reducer_finish ended the step of backward %" PRId64 " (its reductions may still be writing the "
                     "buckets); expected one backward per ebb_reducer_finish", task, p->index, open_task);
  return EBB_OK;
}

static ebb_status on_accumulated(const ebb_tensor_t *t, void *user) {
  (void)t;
  struct rparam *p = user;
  struct ebb_reducer *r = p->r;
  int64_t task = ebb_autograd_current_task_id();
  ebb__mutex_lock(&r->mu);
  bool fresh = !r->active;
  bool other = r->active && r->task != task;
  bool local = !r->active && r->no_sync;
  int64_t open_task = r->task;
  ebb__mutex_unlock(&r->mu);
  if (other)
    return ebb__fail(EBB_ESTATE, "ebb_reducer: a second backward (%" PRId64 ") reached the parameters before "
                     "ebb_reducer_finish ended the step of backward %" PRId64 "; expected one backward per "
                     "ebb_reducer_finish", task, open_task);
  /* Accumulating: the gradient was added into .grad (the bucket, or a .grad of its own that the
   * next synchronised step copies in); nothing is reduced. */
  if (local) return EBB_OK;
  ebb_status st = EBB_OK;
  if (fresh) {
    bool *will = calloc((size_t)r->np, sizeof *will);
    if (!will) return ebb__fail(EBB_ENOMEM, "ebb_reducer: no host memory for the step's parameter map");
    for (int i = 0; i < r->np && !st; i++) st = ebb_autograd_will_execute(r->p[i].edge.node, &will[i]);
    if (!st) st = prepare_unused(r, will);
    if (st) {
      free(will);
      return st;
    }
    ebb__mutex_lock(&r->mu);
    if (!r->active) begin_step(r, task, will);
    ebb__mutex_unlock(&r->mu);
    free(will);
  }
  bool was;
  ebb_grad_set_enabled(false, &was);
  st = grad_into_bucket(r, p);
  ebb_grad_set_enabled(was, NULL);
  ebb__mutex_lock(&r->mu);
  if (st) step_fail(r, st);
  if (!p->ready) {
    p->ready = true;
    if (r->order && r->norder < r->np) r->order[r->norder++] = p->index;
    r->b[p->bucket].pending--;
    issue_ready(r);
  }
  ebb__mutex_unlock(&r->mu);
  return st;
}

/* ---- creation --------------------------------------------------------------------------------- */

/* Every rank's parameter list against the others': counts, then each shape and dtype. */
static ebb_status exchange_lists(struct ebb_reducer *r, const char *fn) {
  int64_t cnt = r->np;
  int64_t one = 1, gshape[2] = {r->size, 1};
  ebb_tensor_t *in = NULL, *out = NULL;
  int64_t *all = calloc((size_t)r->size, sizeof *all);
  if (!all) return ebb__fail(EBB_ENOMEM, "%s: no host memory", fn);
  ebb_status st = ebb_tensor_from_host(r->device, EBB_I64, 1, &one, &cnt, sizeof cnt, &in);
  if (!st) st = ebb_tensor_empty(r->device, EBB_I64, 2, gshape, &out);
  if (!st) st = ebb_all_gather(r->pg, out, in, NULL);
  if (!st) st = ebb_tensor_to_host(out, all, (size_t)r->size * sizeof *all);
  if (in) ebb_tensor_release(in);
  if (out) ebb_tensor_release(out);
  in = out = NULL;
  for (int k = 1; !st && k < r->size; k++)
    if (all[k] != all[0])
      st = ebb__fail(EBB_EINVAL, "%s: the parameter lists differ between ranks: rank 0 has %" PRId64 " parameters, rank %d has %" PRId64
                     " (parameter %" PRId64 " is the first one missing from a list); expected the same parameters, in the same "
                     "order, on every rank", fn, all[0], k, all[k], all[0] < all[k] ? all[0] : all[k]);
  free(all);
  if (st) return st;
  int64_t cols = (int64_t)r->np * DESC_COLS;
  int64_t *mine = calloc((size_t)cols, sizeof *mine), *rows = calloc((size_t)(cols * r->size), sizeof *rows);
  if (!mine || !rows) st = ebb__fail(EBB_ENOMEM, "%s: no host memory", fn);
  for (int i = 0; !st && i < r->np; i++) {
    ebb_tensor_info info;
    st = ebb_tensor_get_info(r->p[i].t, &info);
    mine[i * DESC_COLS] = info.dtype;
    mine[i * DESC_COLS + 1] = info.ndim;
    for (int d = 0; d < info.ndim; d++) mine[i * DESC_COLS + 2 + d] = info.shape[d];
  }
  int64_t gs2[2] = {r->size, cols};
  if (!st) st = ebb_tensor_from_host(r->device, EBB_I64, 1, &cols, mine, (size_t)cols * sizeof *mine, &in);
  if (!st) st = ebb_tensor_empty(r->device, EBB_I64, 2, gs2, &out);
  if (!st) st = ebb_all_gather(r->pg, out, in, NULL);
  if (!st) st = ebb_tensor_to_host(out, rows, (size_t)(cols * r->size) * sizeof *rows);
  if (in) ebb_tensor_release(in);
  if (out) ebb_tensor_release(out);
  for (int i = 0; !st && i < r->np; i++)
    for (int k = 1; !st && k < r->size; k++) {
      const int64_t *a = rows + i * DESC_COLS, *b = rows + k * cols + i * DESC_COLS;
      if (memcmp(a, b, DESC_COLS * sizeof *a)) {
        char sa[160], sb[160], pd[EBB__DESC_MAX];
        st = ebb__fail(EBB_EINVAL, "%s: the parameter lists differ between ranks at parameter %d: rank 0 has %s, rank %d has %s "
                       "(this rank's: %s); expected the same parameters, in the same order, on every rank", fn, i,
                       row_str(a, sa, sizeof sa), k, row_str(b, sb, sizeof sb), pdesc(r, i, pd, sizeof pd));
      }
    }
  free(mine);
  free(rows);
  return st;
}

static ebb_status check_params(ebb_pg_t *pg, int device, ebb_tensor_t *const *params, int n, const char *fn) {
  for (int i = 0; i < n; i++) {
    char d[EBB__DESC_MAX], d2[EBB__DESC_MAX], ds[32], gs[32];
    if (!params[i]) return ebb__fail(EBB_EINVAL, "%s: params[%d] is NULL; expected a leaf tensor that requires a gradient", fn, i);
    ebb_tensor_info info;
    ebb_status st = ebb_tensor_get_info(params[i], &info);
    if (st) return ebb__fail(st, "%s: params[%d]: %s", fn, i, ebb_last_error());
    bool leaf = false, rg = false;
    ebb_tensor_is_leaf(params[i], &leaf);
    ebb_tensor_requires_grad(params[i], &rg);
    if (!leaf || !rg)
      return ebb__fail(EBB_EINVAL, "%s: %s is %s; expected a leaf tensor that requires a gradient (ebb_tensor_set_requires_grad)", fn,
                       ebb__tensor_desc(params[i], "params", i, d, sizeof d), leaf ? "a leaf that does not require a gradient" : "not a leaf");
    if (!ebb_dtype_is_float(info.dtype))
      return ebb__fail(EBB_EINVAL, "%s: %s is not floating; expected f32, f64, bf16 or f16", fn,
                       ebb__tensor_desc(params[i], "params", i, d, sizeof d));
    if (!info.contiguous)
      return ebb__fail(EBB_EINVAL, "%s: %s is not contiguous; expected a contiguous parameter", fn,
                       ebb__tensor_desc(params[i], "params", i, d, sizeof d));
    if (info.device != device)
      return ebb__fail(EBB_EDEVICE, "%s: %s is on %s, the group on %s; expected every parameter on the group's device", fn,
                       ebb__tensor_desc(params[i], "params", i, d, sizeof d), dev_str(info.device, ds, sizeof ds),
                       dev_str(device, gs, sizeof gs));
    for (int j = 0; j < i; j++) {
      bool same = false;
      ebb_tensor_same_storage(params[i], params[j], &same);
      if (same)
        return ebb__fail(EBB_EINVAL, "%s: %s shares its storage with %s; expected distinct parameters", fn,
                         ebb__tensor_desc(params[i], "params", i, d, sizeof d), ebb__tensor_desc(params[j], "params", j, d2, sizeof d2));
    }
  }
  (void)pg;
  return EBB_OK;
}

static void teardown(struct ebb_reducer *r) {
  for (int i = 0; r->p && i < r->np; i++) {
    struct rparam *p = &r->p[i];
    if (p->hook.id) ebb_hook_remove(p->hook);
    if (p->pre_hook.id) ebb_hook_remove(p->pre_hook);
    if (p->edge.node) ebb_gradient_edge_release(&p->edge);
    if (p->view) ebb_tensor_release(p->view);
    if (p->t) ebb_tensor_release(p->t);
  }
  free(r->p);
  free_buckets(r->b, r->nb);
  free(r->order);
  if (r->side) ebb_stream_release(r->side);
  r->side = NULL;
  r->p = NULL;
  r->b = NULL;
}

ebb_status ebb_reducer_create(ebb_pg_t *pg, ebb_tensor_t *const *params, int n, const ebb_reducer_options *opts, ebb_reducer_t **out) {
  const char *fn = "ebb_reducer_create";
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected where to store the reducer", fn);
  if (!pg) return ebb__fail(EBB_EINVAL, "%s: pg is NULL; expected a process group from ebb_pg_create", fn);
  if (n <= 0) return ebb__fail(EBB_EINVAL, "%s: n is %d; expected at least one parameter", fn, n);
  if (!params) return ebb__fail(EBB_EINVAL, "%s: params is NULL with n = %d; expected n parameters", fn, n);
  ebb_reducer_options o = {0};
  if (opts) {
    if (opts->version > EBB_REDUCER_OPTIONS_VERSION)
      return ebb__fail(EBB_ENOTSUP, "%s: options version %u is newer than this library reads (%u)", fn, opts->version,
                       EBB_REDUCER_OPTIONS_VERSION);
    o = *opts;
  }
  if (o.first_bucket_bytes < 0 || o.bucket_bytes < 0)
    return ebb__fail(EBB_EINVAL, "%s: a bucket cap is negative (first_bucket_bytes %" PRId64 ", bucket_bytes %" PRId64
                     "); expected 0 (the default) or a positive number of bytes", fn, o.first_bucket_bytes, o.bucket_bytes);
  if (!o.first_bucket_bytes) o.first_bucket_bytes = EBB_REDUCER_DEFAULT_FIRST_BUCKET_BYTES;
  if (!o.bucket_bytes) o.bucket_bytes = EBB_REDUCER_DEFAULT_BUCKET_BYTES;
  int device = 0, rank = 0, size = 0;
  ebb_status st = ebb_pg_device(pg, &device);
  if (!st) st = ebb_pg_rank(pg, &rank);
  if (!st) st = ebb_pg_size(pg, &size);
  if (st) return ebb__fail(st, "%s: pg: %s", fn, ebb_last_error());
  if ((st = check_params(pg, device, params, n, fn))) return st;

  struct ebb_reducer *r = record_new();
  if (!r) return ebb__fail(EBB_ENOMEM, "%s: no host memory for the reducer", fn);
  r->pg = pg;
  r->device = device;
  r->rank = rank;
  r->size = size;
  r->o = o;
  r->np = n;
  r->p = calloc((size_t)n, sizeof *r->p);
  r->order = o.no_rebuild ? NULL : calloc((size_t)n, sizeof *r->order);
  if (!r->p || (!o.no_rebuild && !r->order)) st = ebb__fail(EBB_ENOMEM, "%s: no host memory for %d parameters", fn, n);
  for (int i = 0; !st && i < n; i++) {
    struct rparam *p = &r->p[i];
    p->r = r;
    p->index = i;
    ebb_tensor_retain(params[i]);
    p->t = params[i];
    ebb_tensor_dtype(p->t, &p->dt);
    ebb_tensor_numel(p->t, &p->numel);
  }
  if (!st && device != EBB_DEVICE_CPU) st = ebb_stream_create(device, EBB_PRIO_HIGH, &r->side);
  if (!st) st = exchange_lists(r, fn);
  /* Every rank starts from rank 0's values. */
  for (int i = 0; !st && i < n && size > 1; i++) st = ebb_broadcast(pg, r->p[i].t, 0, NULL);
  if (!st) {
    int *rev = malloc((size_t)n * sizeof *rev);
    if (!rev) st = ebb__fail(EBB_ENOMEM, "%s: no host memory", fn);
    for (int i = 0; !st && i < n; i++) rev[i] = n - 1 - i;
    if (!st) st = build_buckets(r, rev, true, fn);
    free(rev);
  }
  for (int i = 0; !st && i < n; i++) {
    st = ebb_tensor_gradient_edge(r->p[i].t, &r->p[i].edge);
    if (!st) st = ebb_tensor_register_post_accumulate_hook(r->p[i].t, on_accumulated, &r->p[i], &r->p[i].hook);
    if (!st) st = ebb_tensor_register_hook(r->p[i].t, on_grad, &r->p[i], &r->p[i].pre_hook);
  }
  if (st) {
    char m[EBB__ERRMSG_MAX];
    snprintf(m, sizeof m, "%s", ebb_last_error());
    if (!o.copy_grads)
      for (int i = 0; i < n; i++)
        if (r->p && r->p[i].view) ebb_tensor_set_grad(r->p[i].t, NULL);
    teardown(r);
    record_free(r);
    return strncmp(m, fn, strlen(fn)) ? ebb__fail(st, "%s: %s", fn, m) : ebb__fail(st, "%s", m);
  }
  r->magic = REDUCER_MAGIC;
  ebb__mutex_lock(&mod_mu);
  live_reducers++;
  ebb__mutex_unlock(&mod_mu);
  *out = r;
  return EBB_OK;
}

/* ---- finish, zero, destroy -------------------------------------------------------------------- */

/* After the first step: rank 0's ready order, broadcast, and the buckets rebuilt in it. */
static ebb_status rebuild(struct ebb_reducer *r, const char *fn) {
  int64_t *ord = calloc((size_t)r->np, sizeof *ord);
  bool *seen = calloc((size_t)r->np, sizeof *seen);
  int *order = calloc((size_t)r->np, sizeof *order);
  ebb_status st = (!ord || !seen || !order) ? ebb__fail(EBB_ENOMEM, "%s: no host memory for the rebuild", fn) : EBB_OK;
  int k = 0;
  for (int i = 0; !st && i < r->norder; i++)
    if (!seen[r->order[i]]) seen[r->order[i]] = true, ord[k++] = r->order[i];
  for (int i = r->np - 1; !st && i >= 0; i--) /* the unused: in reverse order, after */
    if (!seen[i]) ord[k++] = i;
  ebb_tensor_t *t = NULL;
  int64_t n64 = r->np;
  if (!st) st = ebb_tensor_from_host(r->device, EBB_I64, 1, &n64, ord, (size_t)r->np * sizeof *ord, &t);
  if (!st) st = ebb_broadcast(r->pg, t, 0, NULL);
  if (!st) st = ebb_tensor_to_host(t, ord, (size_t)r->np * sizeof *ord);
  if (t) ebb_tensor_release(t);
  if (!st) {
    memset(seen, 0, (size_t)r->np * sizeof *seen);
    for (int i = 0; i < r->np && !st; i++) {
      if (ord[i] < 0 || ord[i] >= r->np || seen[ord[i]])
        st = ebb__fail(EBB_EINTERNAL, "%s: rank 0's gradient order is not a permutation of the parameters", fn);
      else seen[ord[i]] = true, order[i] = (int)ord[i];
    }
  }
  if (!st) st = build_buckets(r, order, false, fn);
  free(ord);
  free(seen);
  free(order);
  return st;
}

ebb_status ebb_reducer_finish(ebb_reducer_t *r) {
  const char *fn = "ebb_reducer_finish";
  ebb_status st = check_handle(r, fn);
  if (st) return st;
  ebb__mutex_lock(&r->mu);
  bool fresh = !r->active;
  bool local = fresh && r->no_sync;
  ebb__mutex_unlock(&r->mu);
  if (local) return EBB_OK; /* accumulating (ebb_reducer_set_sync): nothing was issued */
  if (fresh) { /* no parameter reached this rank's loss: every one is unused */
    bool *will = calloc((size_t)r->np, sizeof *will);
    if (!will) return ebb__fail(EBB_ENOMEM, "%s: no host memory", fn);
    st = prepare_unused(r, will);
    ebb__mutex_lock(&r->mu);
    if (!r->active) begin_step(r, -1, will);
    ebb__mutex_unlock(&r->mu);
    free(will);
    if (st) return st;
  }
  char missing[512] = "";
  size_t ml = 0;
  int nmissing = 0;
  ebb__mutex_lock(&r->mu);
  for (int i = 0; i < r->np; i++) {
    if (r->p[i].ready) continue;
    r->p[i].ready = true;
    r->b[r->p[i].bucket].pending--;
    if (ml + 64 < sizeof missing) {
      char d[EBB__DESC_MAX];
      ml += (size_t)snprintf(missing + ml, sizeof missing - ml, "%s%s", nmissing ? ", " : "", pdesc(r, i, d, sizeof d));
    }
    nmissing++;
  }
  issue_ready(r);
  ebb_status err = r->err;
  char msg[EBB__ERRMSG_MAX];
  snprintf(msg, sizeof msg, "%s", r->msg);
  r->active = false;
  ebb__mutex_unlock(&r->mu);
  /* Wait: a host wait on the CPU; on a device the caller's current stream waits for the side
   * stream, which waited for every all-reduce issued from it. */
  if (r->side) {
    ebb_stream_t *cur = NULL;
    ebb_status ws = ebb_stream_current(r->device, &cur);
    if (!ws) ws = ebb_stream_wait_stream(cur, r->side);
    if (ws && !err) {
      err = ws;
      snprintf(msg, sizeof msg, "ordering the caller's stream after the reductions: %s", ebb_last_error());
    }
  }
  for (int k = 0; k < r->nb; k++) {
    struct rbucket *b = &r->b[k];
    if (!b->work) continue;
    ebb_status ws = r->device == EBB_DEVICE_CPU ? ebb_work_wait(b->work) : EBB_OK;
    if (ws && !err) {
      err = ws;
      snprintf(msg, sizeof msg, "the all-reduce of bucket %d (%" PRId64 " %s elements, %d parameters) failed: %s", k, b->numel,
               ebb_dtype_name(b->dt), b->n, ebb_last_error());
    }
    ebb_work_release(b->work);
    b->work = NULL;
  }
  if (err) return ebb__fail(err, "%s: %s", fn, msg);
  if (nmissing)
    return ebb__fail(EBB_ESTATE, "%s: %d parameter(s) that the backward was to run never reported their gradient (%s); the backward "
                     "failed or is still running; the buckets were reduced anyway so the ranks stay in step", fn, nmissing, missing);
  if (r->o.copy_grads) {
    bool was;
    ebb_grad_set_enabled(false, &was);
    for (int i = 0; i < r->np && !st; i++) {
      ebb_tensor_t *g = NULL;
      st = ebb_tensor_grad(r->p[i].t, &g);
      if (!st && g) {
        st = ebb_tensor_copy_(g, r->p[i].view);
      } else if (!st) { /* no .grad of its own: a copy of the reduced one */
        ebb_tensor_t *c = NULL;
        st = ebb_tensor_clone(r->p[i].view, &c);
        if (!st) st = ebb_tensor_set_grad(r->p[i].t, c);
        if (c) ebb_tensor_release(c);
      }
      if (g) ebb_tensor_release(g);
    }
    ebb_grad_set_enabled(was, NULL);
    if (st) return ebb__fail(st, "%s: copying the reduced gradients into .grad: %s", fn, ebb_last_error());
  }
  r->steps++;
  if (r->steps == 1 && r->order) {
    st = rebuild(r, fn);
    free(r->order);
    r->order = NULL;
    if (st) return st;
  }
  return EBB_OK;
}

ebb_status ebb_reducer_set_sync(ebb_reducer_t *r, bool sync) {
  const char *fn = "ebb_reducer_set_sync";
  ebb_status st = check_handle(r, fn);
  if (st) return st;
  ebb__mutex_lock(&r->mu);
  bool open = r->active;
  int64_t task = r->task;
  if (!open) r->no_sync = !sync;
  ebb__mutex_unlock(&r->mu);
  if (open)
    return ebb__fail(EBB_ESTATE, "%s(%s): the step of backward %" PRId64 " is open (its gradients are being reduced); "
                     "expected ebb_reducer_finish first", fn, sync ? "true" : "false", task);
  return EBB_OK;
}

ebb_status ebb_reducer_zero_grad(ebb_reducer_t *r) {
  const char *fn = "ebb_reducer_zero_grad";
  ebb_status st = check_handle(r, fn);
  if (st) return st;
  bool was;
  ebb_grad_set_enabled(false, &was);
  for (int k = 0; k < r->nb && !st; k++) st = ebb_tensor_zero_(r->b[k].flat);
  for (int i = 0; i < r->np && !st; i++) {
    ebb_tensor_t *g = NULL;
    st = ebb_tensor_grad(r->p[i].t, &g);
    void *gp = NULL;
    if (g) ebb_tensor_data(g, &gp);
    if (!st && r->o.copy_grads && g) st = ebb_tensor_zero_(g);
    else if (!st && !r->o.copy_grads && gp != r->p[i].view_ptr) st = ebb_tensor_set_grad(r->p[i].t, r->p[i].view);
    if (g) ebb_tensor_release(g);
  }
  ebb_grad_set_enabled(was, NULL);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  return EBB_OK;
}

ebb_status ebb_reducer_destroy(ebb_reducer_t *r) {
  const char *fn = "ebb_reducer_destroy";
  ebb_status st = check_handle(r, fn);
  if (st) return st;
  r->magic = 0;
  for (int k = 0; k < r->nb; k++)
    if (r->b[k].work) ebb_work_wait(r->b[k].work);
  /* Each .grad that is a bucket view becomes a copy of its own. */
  for (int i = 0; i < r->np; i++) {
    ebb_tensor_t *g = NULL, *c = NULL;
    if (ebb_tensor_grad(r->p[i].t, &g) || !g) continue;
    void *gp = NULL;
    ebb_tensor_data(g, &gp);
    if (gp == r->p[i].view_ptr && !ebb_tensor_clone(g, &c)) {
      ebb_tensor_set_grad(r->p[i].t, c);
      ebb_tensor_release(c);
    }
    ebb_tensor_release(g);
  }
  teardown(r);
  record_free(r);
  ebb__mutex_lock(&mod_mu);
  live_reducers--;
  ebb__mutex_unlock(&mod_mu);
  return EBB_OK;
}

ebb_status ebb_reducer_num_buckets(const ebb_reducer_t *r, int *n) {
  ebb_status st = check_handle(r, "ebb_reducer_num_buckets");
  if (st) return st;
  if (!n) return ebb__fail(EBB_EINVAL, "ebb_reducer_num_buckets: n is NULL");
  *n = r->nb;
  return EBB_OK;
}

ebb_status ebb_reducer_bucket_info(const ebb_reducer_t *r, int b, int64_t *numel, ebb_dtype *dtype, int *nparams, int *params,
                                   int cap) {
  const char *fn = "ebb_reducer_bucket_info";
  ebb_status st = check_handle(r, fn);
  if (st) return st;
  if (b < 0 || b >= r->nb) return ebb__fail(EBB_EINVAL, "%s: bucket %d is out of [0, %d)", fn, b, r->nb);
  if (numel) *numel = r->b[b].numel;
  if (dtype) *dtype = r->b[b].dt;
  if (nparams) *nparams = r->b[b].n;
  for (int k = 0; params && k < r->b[b].n && k < cap; k++) params[k] = r->b[b].idx[k];
  return EBB_OK;
}
