/* function.c: custom autograd functions (ebb/function.h).
 *
 * ebb_function_apply runs the caller's forward with grad mode off, then records one node of op
 * EBB__OP_FUNCTION whose record (struct ebb__fnrec) carries the definition, the node's interned
 * name and the ctx state that outlives the forward (materialize flag, user data). The rest of
 * autograd treats it as an op's node: edges, input metadata (inputs then outputs), saved tensors
 * through ebb__save (hooks and offload scopes included), owner tags, trace spans and the Node API;
 * only the engine's call of its backward differs (ebb__function_backward).
 *
 * The ctx the callbacks see is a stack object of the call that runs them: apply's for forward and
 * setup_context (with the lists the forward builds: tensors to save, dirty inputs,
 * non-differentiable outputs), the engine's for backward (the unpacked saved tensors and which
 * inputs the running backward wants). Only the record lives with the node, so concurrent backward
 * calls through one node (retain_graph) each have their own ctx.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_export.h"
#include "autograd_impl.h"
#include "ebb/function.h"
#include "ebb/ops.h"
#include "ebb_internal.h"
#include "ops_export.h"

#define CTX_MAGIC 0x65626378u /* "ebcx" */
enum { PH_FORWARD = 1, PH_SETUP, PH_BACKWARD, PH_DONE };

/* What a recorded node keeps of its function. */
struct ebb__fnrec {
  const ebb_function *fn;
  const char *node_name; /* "<name>Backward", interned (lives for the process) */
  _Atomic bool materialize;
  uint64_t saved_mask; /* bit k: the ctx saved a tensor (not NULL) at slot k */
  void *user;
  void (*destroy)(void *);
};

struct ebb_function_ctx {
  uint32_t magic;
  int phase;
  struct ebb__fnrec *rec;
  int nin, nout;
  const ebb_tensor_t *const *inputs;
  ebb_tensor_t *const *outputs;
  /* forward and setup_context */
  bool recording;
  uint64_t req;   /* bit i: input i requires a gradient (and grad mode is on) */
  uint64_t dirty; /* bit i: input i was changed in place */
  int nsave, nnondiff;
  ebb_tensor_t *save[EBB_FUNCTION_MAX_SAVED];               /* NULL: a NULL saved */
  uint64_t save_owned;                                      /* bit k: save[k] is a reference of the ctx's */
  const ebb_tensor_t *nondiff[EBB_FUNCTION_MAX_OUTPUTS];
  /* A ctx call refused while a callback ran: the callback's call then fails whatever the
   * callback returned (a refusal ignored would lose a save or a mark). The first message. */
  bool refused;
  char why[320];
  /* backward */
  const ebb_tensor_t *const *saved;
  int nsaved;
  const bool *need;
};

static _Atomic long ebb__live_ctx;
long ebb_function_live_ctx(void) { return atomic_load_explicit(&ebb__live_ctx, memory_order_relaxed); }

/* ---- the node's name: interned once per definition ------------------------------------------- */

/* Definitions seen, by address; an entry is checked against the name it was made from (a
 * definition on the stack may be reused with another name), so a stale one is only a miss. */
#define NAME_SLOTS 512
static struct {
  _Atomic(const ebb_function *) fn;
  _Atomic(const char *) node;
} ebb__fn_names[NAME_SLOTS];
static ebb_mutex ebb__fn_names_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.function_names", EBB_RANK_LEAF};

static bool name_matches(const char *node, const char *name, size_t len) {
  return strncmp(node, name, len) == 0 && strcmp(node + len, "Backward") == 0;
}

static ebb_status node_name(const ebb_function *f, size_t len, const char **out) {
  size_t h = ((uintptr_t)f >> 4) * 0x9E3779B97F4A7C15ull >> 55; /* 9 bits: NAME_SLOTS */
  for (size_t i = 0; i < 8; i++) {
    size_t s = (h + i) & (NAME_SLOTS - 1);
    if (atomic_load_explicit(&ebb__fn_names[s].fn, memory_order_acquire) != f) continue;
    const char *nm = atomic_load_explicit(&ebb__fn_names[s].node, memory_order_acquire);
    if (nm && name_matches(nm, f->name, len)) {
      *out = nm;
      return EBB_OK;
    }
  }
  char buf[EBB_OWNER_NAME_MAX + 1];
  snprintf(buf, sizeof buf, "%sBackward", f->name);
  const char *in = NULL;
  ebb_status st = ebb__alloc_intern("ebb_function_apply", buf, &in);
  if (st) return st;
  /* Remember it: an empty slot, else the first of the probe (a busy process with more
   * definitions than slots interns again, which finds the same string). */
  ebb__mutex_lock(&ebb__fn_names_mu);
  size_t pick = h & (NAME_SLOTS - 1);
  for (size_t i = 0; i < 8; i++) {
    size_t s = (h + i) & (NAME_SLOTS - 1);
    if (!atomic_load_explicit(&ebb__fn_names[s].fn, memory_order_relaxed)) {
      pick = s;
      break;
    }
  }
  atomic_store_explicit(&ebb__fn_names[pick].fn, NULL, memory_order_relaxed);
  atomic_store_explicit(&ebb__fn_names[pick].node, in, memory_order_release);
  atomic_store_explicit(&ebb__fn_names[pick].fn, f, memory_order_release);
  ebb__mutex_unlock(&ebb__fn_names_mu);
  *out = in;
  return EBB_OK;
}

const char *ebb__function_node_name(const struct ebb__fnrec *r) { return r->node_name; }

bool ebb__function_saved_at(const struct ebb__fnrec *r, int k) {
  return k < 0 ? r->saved_mask != 0 : k < 64 && (r->saved_mask >> k & 1);
}

void ebb__function_free(struct ebb__fnrec *r) {
  if (r->destroy) r->destroy(r->user);
  free(r);
  atomic_fetch_sub_explicit(&ebb__live_ctx, 1, memory_order_relaxed);
}

/* ---- ctx calls ------------------------------------------------------------------------------- */

static ebb_status check_ctx(const char *fn, const ebb_function_ctx *ctx) {
  if (!ctx) return ebb__fail(EBB_EINVAL, "%s: ctx is NULL; expected the ctx a custom function's callback was given", fn);
  if (ctx->magic != CTX_MAGIC || ctx->phase == PH_DONE)
    return ebb__fail(EBB_ESTATE, "%s: ctx %p is not the ctx of a running callback (a ctx is valid only during the forward, "
                     "setup_context or backward call it was given to)", fn, (const void *)ctx);
  return EBB_OK;
}

static const char *phase_name(int ph) {
  return ph == PH_FORWARD ? "forward" : ph == PH_SETUP ? "setup_context" : "backward";
}

static ebb_status check_forward(const char *fn, const ebb_function_ctx *ctx) {
  ebb_status st = check_ctx(fn, ctx);
  if (st) return st;
  if (ctx->phase == PH_BACKWARD)
    return ebb__fail(EBB_ESTATE, "%s: called from the backward of '%s'; expected it in the function's forward or setup_context "
                     "(what backward gets is fixed when the forward ends)", fn, ctx->rec->fn->name);
  return EBB_OK;
}

/* A ctx call refused (st, message set) while its callback runs: remembered, so the apply (or the
 * backward) fails even when the callback goes on. Returns st. */
static ebb_status refuse(ebb_function_ctx *ctx, ebb_status st) {
  if (st && ctx && ctx->magic == CTX_MAGIC && ctx->phase != PH_DONE && !ctx->refused) {
    ctx->refused = true;
    snprintf(ctx->why, sizeof ctx->why, "%s", ebb_last_error());
  }
  return st;
}

static ebb_status check_list(const char *fn, const ebb_function_ctx *ctx, const char *arg, const void *list, int n) {
  if (n < 0) return ebb__fail(EBB_EINVAL, "%s: %s of '%s': n is %d; expected 0 or more", fn, arg, ctx->rec->fn->name, n);
  if (n > 0 && !list) return ebb__fail(EBB_EINVAL, "%s: %s of '%s' is NULL with n %d; expected %d tensors", fn, arg, ctx->rec->fn->name, n, n);
  return EBB_OK;
}

ebb_status ebb_ctx_save_for_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *tensors, int n) {
  static const char fn[] = "ebb_ctx_save_for_backward";
  ebb_status st = check_forward(fn, ctx);
  if (!st) st = check_list(fn, ctx, "tensors", tensors, n);
  if (st) return refuse(ctx, st);
  if (ctx->nsave + n > EBB_FUNCTION_MAX_SAVED)
    return refuse(ctx, ebb__fail(EBB_ELIMIT, "%s: '%s' would save %d tensors (%d before this call); at most %d per call of a function", fn,
                     ctx->rec->fn->name, ctx->nsave + n, ctx->nsave, EBB_FUNCTION_MAX_SAVED));
  for (int i = 0; i < n; i++)
    if (tensors[i] && (st = ebb__tensor_check_at(tensors[i], fn, "tensors", i))) return refuse(ctx, st);
  for (int i = 0; i < n; i++) {
    ebb_tensor_t *t = (ebb_tensor_t *)tensors[i];
    /* An input is borrowed (the caller holds it through apply); anything else, which the
     * forward may release before it returns, is retained until the node has saved it. */
    bool input = false;
    for (int j = 0; t && j < ctx->nin && !input; j++) input = ctx->inputs[j] == t;
    if (t && !input) {
      ebb_tensor_retain(t);
      ctx->save_owned |= 1ull << ctx->nsave;
    }
    ctx->save[ctx->nsave++] = t;
  }
  return EBB_OK;
}

ebb_status ebb_ctx_mark_dirty(ebb_function_ctx *ctx, const ebb_tensor_t *const *tensors, int n) {
  static const char fn[] = "ebb_ctx_mark_dirty";
  ebb_status st = check_forward(fn, ctx);
  if (!st) st = check_list(fn, ctx, "tensors", tensors, n);
  if (st) return refuse(ctx, st);
  uint64_t bits = 0;
  for (int i = 0; i < n; i++) {
    if ((st = ebb__tensor_check_at(tensors[i], fn, "tensors", i))) return refuse(ctx, st);
    uint64_t b = 0;
    for (int j = 0; j < ctx->nin; j++)
      if (ctx->inputs[j] == tensors[i]) b |= 1ull << j;
    if (!b) {
      char d[EBB__DESC_MAX];
      return refuse(ctx, ebb__fail(EBB_EINVAL, "%s: %s is not an input of '%s'; expected one of the %d tensors apply gave the "
                                   "forward (only an input can be changed in place and marked dirty)", fn,
                                   ebb__tensor_desc(tensors[i], "tensors", i, d, sizeof d), ctx->rec->fn->name, ctx->nin));
    }
    bits |= b;
  }
  ctx->dirty |= bits;
  return EBB_OK;
}

ebb_status ebb_ctx_mark_non_differentiable(ebb_function_ctx *ctx, const ebb_tensor_t *const *outputs, int n) {
  static const char fn[] = "ebb_ctx_mark_non_differentiable";
  ebb_status st = check_forward(fn, ctx);
  if (!st) st = check_list(fn, ctx, "outputs", outputs, n);
  if (st) return refuse(ctx, st);
  if (ctx->nnondiff + n > EBB_FUNCTION_MAX_OUTPUTS)
    return refuse(ctx, ebb__fail(EBB_ELIMIT, "%s: '%s' would have marked %d tensors non-differentiable in all; at most %d per call",
                                 fn, ctx->rec->fn->name, ctx->nnondiff + n, EBB_FUNCTION_MAX_OUTPUTS));
  for (int i = 0; i < n; i++)
    if ((st = ebb__tensor_check_at(outputs[i], fn, "outputs", i))) return refuse(ctx, st);
  for (int i = 0; i < n; i++) ctx->nondiff[ctx->nnondiff++] = outputs[i];
  return EBB_OK;
}

ebb_status ebb_ctx_set_materialize_grads(ebb_function_ctx *ctx, bool on) {
  ebb_status st = check_ctx("ebb_ctx_set_materialize_grads", ctx);
  if (st) return st;
  atomic_store_explicit(&ctx->rec->materialize, on, memory_order_relaxed);
  return EBB_OK;
}

ebb_status ebb_ctx_needs_input_grad(const ebb_function_ctx *ctx, int i, bool *out) {
  static const char fn[] = "ebb_ctx_needs_input_grad";
  ebb_status st = check_ctx(fn, ctx);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a bool to write", fn);
  if (i < 0 || i >= ctx->nin)
    return ebb__fail(EBB_EINVAL, "%s: input %d of '%s', which has %d inputs; expected an index in [0, %d)", fn, i,
                     ctx->rec->fn->name, ctx->nin, ctx->nin); /* (a question, not a request: nothing lost when ignored) */
  *out = ctx->phase == PH_BACKWARD ? ctx->need[i] : (ctx->req >> i & 1);
  return EBB_OK;
}

/* The user data of every record: set from any thread (backward calls may share a record). */
static ebb_mutex ebb__fn_user_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.function_user", EBB_RANK_LEAF};

ebb_status ebb_ctx_set_user(ebb_function_ctx *ctx, void *data, void (*destroy)(void *data)) {
  ebb_status st = check_ctx("ebb_ctx_set_user", ctx);
  if (st) return st;
  ebb__mutex_lock(&ebb__fn_user_mu);
  void *old = ctx->rec->user;
  void (*old_destroy)(void *) = ctx->rec->destroy;
  ctx->rec->user = data;
  ctx->rec->destroy = destroy;
  ebb__mutex_unlock(&ebb__fn_user_mu);
  if (old_destroy && old != data) old_destroy(old);
  return EBB_OK;
}

void *ebb_ctx_user(const ebb_function_ctx *ctx) {
  if (!ctx || ctx->magic != CTX_MAGIC) return NULL;
  ebb__mutex_lock(&ebb__fn_user_mu);
  void *u = ctx->rec->user;
  ebb__mutex_unlock(&ebb__fn_user_mu);
  return u;
}

void *ebb_ctx_function_user(const ebb_function_ctx *ctx) {
  return ctx && ctx->magic == CTX_MAGIC ? ctx->rec->fn->user : NULL;
}

const char *ebb_ctx_function_name(const ebb_function_ctx *ctx) {
  return ctx && ctx->magic == CTX_MAGIC ? ctx->rec->fn->name : "(invalid ctx)";
}

ebb_status ebb_ctx_saved_tensors(ebb_function_ctx *ctx, const ebb_tensor_t *const **out, int *n) {
  static const char fn[] = "ebb_ctx_saved_tensors";
  ebb_status st = check_ctx(fn, ctx);
  if (st) return st;
  if (!out || !n)
    return refuse(ctx, ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected where to write the saved tensors and their count", fn,
                                 out ? "n" : "out"));
  if (ctx->phase != PH_BACKWARD)
    return refuse(ctx, ebb__fail(EBB_ESTATE, "%s: called from the %s of '%s'; saved tensors are read in backward (the forward "
                                 "has them itself)", fn, phase_name(ctx->phase), ctx->rec->fn->name));
  *out = ctx->saved;
  *n = ctx->nsaved;
  return EBB_OK;
}

/* ---- apply ------------------------------------------------------------------------------------ */

static ebb_status check_def(const char *fn, const ebb_function *f, int nin, size_t *namelen) {
  if (!f) return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected a function's definition (ebb_function)", fn);
  if (f->version != 0 && f->version != EBB_FUNCTION_VERSION)
    return ebb__fail(EBB_EINVAL, "%s: fn->version is %u; this library knows 0 and %u (EBB_FUNCTION_VERSION)", fn, f->version,
                     EBB_FUNCTION_VERSION);
  if (!f->name || !f->name[0]) return ebb__fail(EBB_EINVAL, "%s: fn->name is %s; expected the function's name", fn, f->name ? "empty" : "NULL");
  *namelen = strlen(f->name);
  if (*namelen > EBB_OWNER_NAME_MAX - 8)
    return ebb__fail(EBB_EINVAL, "%s: fn->name is %zu bytes; expected at most %d (its node's name, \"<name>Backward\", is an owner "
                     "name of at most %d)", fn, *namelen, EBB_OWNER_NAME_MAX - 8, EBB_OWNER_NAME_MAX);
  if (!f->forward) return ebb__fail(EBB_EINVAL, "%s: the forward of '%s' is NULL; expected a forward", fn, f->name);
  if (f->noutputs < 1 || f->noutputs > EBB_FUNCTION_MAX_OUTPUTS)
    return ebb__fail(EBB_EINVAL, "%s: '%s' has noutputs %d; expected 1..%d", fn, f->name, f->noutputs, EBB_FUNCTION_MAX_OUTPUTS);
  if (nin < 0 || nin > EBB_FUNCTION_MAX_INPUTS)
    return ebb__fail(EBB_EINVAL, "%s: '%s' applied to %d inputs; expected 0..%d", fn, f->name, nin, EBB_FUNCTION_MAX_INPUTS);
  return EBB_OK;
}

/* What a user callback that returned st failed with (serial: ebb__fail_serial before it ran). */
static const char *callback_why(uint64_t serial, ebb_status st, char *buf, size_t cap) {
  if (ebb__fail_serial() != serial) return ebb_last_error();
  snprintf(buf, cap, "it returned %s with no message of ebb's", ebb_status_name(st));
  return buf;
}

static void release_all(ebb_tensor_t **ts, int n) {
  for (int i = 0; i < n; i++)
    if (ts[i]) {
      ebb_tensor_release(ts[i]);
      ts[i] = NULL;
    }
}

/* The outputs as the forward left them: each set and live, none twice. */
static ebb_status check_outputs(const char *fn, const ebb_function_ctx *ctx, ebb_tensor_t **out) {
  const char *name = ctx->rec->fn->name;
  for (int k = 0; k < ctx->nout; k++) {
    if (!out[k])
      return ebb__fail(EBB_EINVAL, "%s: the forward of '%s' left output %d NULL; expected all %d outputs set (new references)", fn,
                       name, k, ctx->nout);
    ebb_status st = ebb__tensor_check_at(out[k], fn, "outputs", k);
    if (st) return ebb__fail(st, "%s: the forward of '%s' returned a released tensor as output %d", fn, name, k);
    for (int j = 0; j < k; j++)
      if (out[j] == out[k])
        return ebb__fail(EBB_EINVAL, "%s: the forward of '%s' returned the same tensor as outputs %d and %d; expected a distinct "
                         "tensor for each output", fn, name, j, k);
  }
  return EBB_OK;
}

/* The dirty inputs: each returned, and one whose change can be recorded. */
static ebb_status check_dirty(const char *fn, const ebb_function_ctx *ctx, ebb_tensor_t *const *out) {
  const char *name = ctx->rec->fn->name;
  for (int i = 0; i < ctx->nin; i++) {
    if (!(ctx->dirty >> i & 1)) continue;
    bool returned = false;
    for (int k = 0; k < ctx->nout; k++) returned |= out[k] == ctx->inputs[i];
    char d[EBB__DESC_MAX];
    if (!returned)
      return ebb__fail(EBB_EINVAL, "%s: '%s' marked %s dirty but did not return it; expected an input changed in place to be "
                       "returned as one of the outputs (its new history is the function's)", fn, name,
                       ebb__tensor_desc(ctx->inputs[i], "input", i, d, sizeof d));
    if (!ctx->recording) continue;
    struct ebb__meta *m = ebb__meta_of(ctx->inputs[i]);
    if (m && m->requires_grad && !m->grad_fn && !m->is_view)
      return ebb__fail(EBB_EINVAL, "%s: '%s' changed %s in place (marked dirty), a leaf that requires a gradient, which cannot be "
                       "changed in place while grad mode is on; expected a clone of it as the input, or the call with grad mode off",
                       fn, name, ebb__tensor_desc(ctx->inputs[i], "input", i, d, sizeof d));
    if (ebb__tensor_base(ctx->inputs[i]))
      return ebb__fail(EBB_ENOTSUP, "%s: '%s' changed %s in place (marked dirty), which is a view: a custom function's change of a "
                       "view in place is not supported (its base's history would have to follow); expected the view's base as "
                       "the input, or a contiguous clone", fn, name, ebb__tensor_desc(ctx->inputs[i], "input", i, d, sizeof d));
  }
  return EBB_OK;
}

/* An input returned unchanged (not dirty) becomes a view of it, so the caller's handle has a
 * history of its own; marks on the input's handle follow it to the view. */
static ebb_status alias_views(const char *fn, ebb_function_ctx *ctx, ebb_tensor_t **out) {
  for (int k = 0; k < ctx->nout; k++) {
    int in = -1;
    for (int j = 0; j < ctx->nin && in < 0; j++)
      if (ctx->inputs[j] == out[k]) in = j;
    if (in < 0 || (ctx->dirty >> in & 1)) continue;
    ebb_tensor_info ti;
    ebb_tensor_t *v = NULL;
    bool was;
    ebb_grad_set_enabled(false, &was);
    ebb_status st = ebb_tensor_get_info(out[k], &ti);
    if (!st) st = ebb_tensor_view(out[k], ti.ndim, ti.shape, &v);
    ebb_grad_set_enabled(was, NULL);
    if (st)
      return ebb__fail(st, "%s: output %d of '%s' is its input %d returned unchanged, and its view failed: %s", fn, k,
                       ctx->rec->fn->name, in, ebb_last_error());
    for (int i = 0; i < ctx->nnondiff; i++)
      if (ctx->nondiff[i] == out[k]) ctx->nondiff[i] = v;
    ebb_tensor_release(out[k]);
    out[k] = v;
  }
  return EBB_OK;
}

/* The outputs marked non-differentiable, as bits of their indices. */
static ebb_status nondiff_bits(const char *fn, const ebb_function_ctx *ctx, ebb_tensor_t *const *out, uint64_t *bits) {
  *bits = 0;
  for (int i = 0; i < ctx->nnondiff; i++) {
    int k = -1;
    for (int j = 0; j < ctx->nout && k < 0; j++)
      if (out[j] == ctx->nondiff[i]) k = j;
    if (k < 0) {
      char d[EBB__DESC_MAX];
      return ebb__fail(EBB_EINVAL, "%s: '%s' marked %s non-differentiable, which is none of its %d outputs; expected "
                       "ebb_ctx_mark_non_differentiable on outputs only", fn, ctx->rec->fn->name,
                       ebb__tensor_desc(ctx->nondiff[i], "a tensor", -1, d, sizeof d), ctx->nout);
    }
    *bits |= 1ull << k;
  }
  return EBB_OK;
}

/* The node's edges, taken before the forward runs (as an op takes them before its kernel): a view
 * input whose base the forward changes gets the history it had when it was passed in, made
 * before the node (producers have smaller sequence numbers than their consumers). New references
 * in e[i] for the inputs that require a gradient. */
static ebb_status take_edges(const ebb_function_ctx *ctx, struct ebb__edge *e) {
  ebb_status st = EBB_OK;
  for (int i = 0; i < ctx->nin && !st; i++) {
    e[i] = (struct ebb__edge){0};
    if (!(ctx->req >> i & 1)) continue;
    const ebb_tensor_t *t = ctx->inputs[i];
    struct ebb__meta *m = ebb__meta_of(t);
    struct ebb_node *gf = NULL;
    int nr = 0;
    st = ebb__grad_fn_now(t, m, &gf, &nr);
    if (st) break;
    if (gf) {
      atomic_fetch_add_explicit(&gf->refs, 1, memory_order_relaxed);
      e[i] = (struct ebb__edge){.fn = gf, .input_nr = nr};
    } else {
      struct ebb_node *a = NULL;
      st = ebb__grad_acc((ebb_tensor_t *)t, m, &a);
      if (!st) e[i] = (struct ebb__edge){.fn = a};
    }
  }
  return st;
}

static void drop_edges(struct ebb__edge *e, int n) {
  for (int i = 0; i < n; i++)
    if (e[i].fn) {
      ebb__node_unref(e[i].fn);
      e[i].fn = NULL;
    }
}

/* Records the node of a forward that ran: its edges (taken before the forward, consumed here
 * whatever happens), metadata, saved tensors, then the outputs' histories (dirty inputs rebased
 * onto it). On failure nothing points at it. */
static ebb_status record(const char *fn, ebb_function_ctx *ctx, struct ebb__edge *edges, ebb_tensor_t **out, uint64_t nondiff) {
  const int nin = ctx->nin, nout = ctx->nout;
  const char *name = ctx->rec->fn->name;
  struct ebb_node *n = ebb__node_new(EBB__OP_FUNCTION, nin, nout);
  struct ebb__fnrec *r = n ? malloc(sizeof *r) : NULL;
  /* Only entries [0, nin) and [0, nout) are used: zeroing those alone keeps 1 KiB of stores off
   * every recorded apply (a tenth of a custom op's cost over its built-in twin, perf/JOURNAL.md). */
  struct ebb__hook *retain[EBB_FUNCTION_MAX_INPUTS];
  struct ebb__meta *fresh[EBB_FUNCTION_MAX_OUTPUTS];
  memset(retain, 0, sizeof retain[0] * (size_t)nin);
  memset(fresh, 0, sizeof fresh[0] * (size_t)nout);
  ebb_status st = n && r ? EBB_OK : EBB_ENOMEM;
  if (!st) {
    n->in_meta = calloc((size_t)(nin + nout), sizeof *n->in_meta);
    n->nsaved = ctx->nsave;
    if (ctx->nsave && !(n->saved = calloc((size_t)ctx->nsave, sizeof *n->saved))) st = EBB_ENOMEM;
    if (!n->in_meta) st = EBB_ENOMEM;
  }
  if (st) {
    free(r);
    if (n) ebb__node_drop(n);
    drop_edges(edges, nin);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory to record %sBackward", fn, name);
  }
  for (int i = 0; i < nin; i++) { /* (the node owns them from here: freed with it) */
    n->next[i] = edges[i];
    edges[i].fn = NULL;
  }
  *r = *ctx->rec;
  r->saved_mask = 0;
  for (int k = 0; k < ctx->nsave; k++)
    if (ctx->save[k]) r->saved_mask |= 1ull << k;
  n->fnrec = r;
  atomic_fetch_add_explicit(&ebb__live_ctx, 1, memory_order_relaxed);
  /* The user data is the node's from here: freed with it (ebb__function_free). */
  ctx->rec->user = NULL;
  ctx->rec->destroy = NULL;
  for (int i = 0; i < nin; i++) {
    if (ctx->inputs[i]) ebb__tensor_meta_of(ctx->inputs[i], &n->in_meta[i]);
    else n->in_meta[i].ndim = -1; /* an optional input not given */
  }
  for (int k = 0; k < nout; k++) ebb__tensor_meta_of(out[k], &n->in_meta[nin + k]);
  /* Autograd state for each output with a gradient, made before any is changed so a failure
   * undoes nothing: new metas for fresh outputs, the retain_grad hooks of dirty inputs moved. */
  for (int k = 0; !st && k < nout; k++) {
    if ((nondiff >> k & 1) || !ebb_dtype_is_float(n->in_meta[nin + k].dtype)) continue;
    struct ebb__meta *m = ebb__meta_of(out[k]);
    int in = -1;
    for (int j = 0; j < nin && in < 0; j++)
      if (ctx->inputs[j] == out[k] && (ctx->dirty >> j & 1)) in = j;
    if (in >= 0) {
      if (m) st = ebb__retain_prepare(m, n, k, &retain[in]);
      else if (!(fresh[k] = ebb__meta_alloc())) st = EBB_ENOMEM;
      continue;
    }
    if (m && m->requires_grad) {
      char d[EBB__DESC_MAX];
      st = ebb__fail(EBB_EINVAL, "%s: the forward of '%s' returned as output %d %s, which already has a history (requires a "
                     "gradient) and is not one of its inputs marked dirty; expected a tensor the forward made", fn, name, k,
                     ebb__tensor_desc(out[k], "a tensor", -1, d, sizeof d));
      break;
    }
    if (!m && !(fresh[k] = ebb__meta_alloc())) st = EBB_ENOMEM;
  }
  if (st == EBB_ENOMEM) st = ebb__fail(EBB_ENOMEM, "%s: no host memory to record %sBackward", fn, name);
  /* The saved tensors, before anything points at the node: a save that fails (a pack hook, an
   * offload copy) then leaves no tensor with a history through a node missing what it saved. */
  for (int k = 0; !st && k < ctx->nsave; k++)
    if (ctx->save[k]) st = ebb__save(n, k, ctx->save[k]);
  if (st) {
    for (int k = 0; k < nout; k++) ebb__meta_free(fresh[k]);
    ebb__node_drop(n); /* (its edges, saved tensors, record and uncommitted retain hooks with it) */
    return st;
  }
  /* Commit: every output with a gradient points at the node. */
  long refs = 0;
  for (int k = 0; k < nout; k++) {
    if ((nondiff >> k & 1) || !ebb_dtype_is_float(n->in_meta[nin + k].dtype)) continue;
    struct ebb__meta *m = ebb__meta_of(out[k]);
    if (!m) {
      m = fresh[k];
      fresh[k] = NULL;
      ebb__tensor_set_slot(out[k], m);
    }
    int in = -1;
    for (int j = 0; j < nin && in < 0; j++)
      if (ctx->inputs[j] == out[k] && (ctx->dirty >> j & 1)) in = j;
    struct ebb_node *old = NULL;
    if (in >= 0) {
      ebb__retain_commit(m, retain[in]); /* before the old node, which holds the old hook, may go */
      retain[in] = NULL;
      old = m->grad_fn;
    } else if (ebb__tensor_base(out[k])) {
      /* A view (of an input, or of its own): its history is the function's, and must never be
       * rebuilt from its base (inplace.c refuses that, naming the function). */
      uint64_t v = 0;
      ebb_tensor_version(out[k], &v);
      m->is_view = true;
      m->fn_view = r->node_name;
      atomic_store_explicit(&m->view_version, v, memory_order_relaxed);
    }
    m->requires_grad = true;
    m->grad_fn = n;
    m->output_nr = k;
    refs++;
    ebb__node_unref(old); /* (the node's edge holds its own reference when it uses the old history) */
  }
  if (!refs) { /* every output non-differentiable: nothing to record */
    ebb__node_drop(n);
    return EBB_OK;
  }
  atomic_store_explicit(&n->refs, refs, memory_order_relaxed);
  ebb__node_link(n);
  return EBB_OK;
}

ebb_status ebb_function_apply(const ebb_function *f, const ebb_tensor_t *const *inputs, int ninputs, const void *args,
                              ebb_tensor_t **outputs) {
  static const char fn[] = "ebb_function_apply";
  size_t namelen = 0;
  ebb_status st = check_def(fn, f, ninputs, &namelen);
  if (st) return st;
  if (!outputs) return ebb__fail(EBB_EINVAL, "%s: outputs is NULL; expected room for the %d outputs of '%s'", fn, f->noutputs, f->name);
  if (ninputs > 0 && !inputs) return ebb__fail(EBB_EINVAL, "%s: inputs is NULL with ninputs %d (for '%s')", fn, ninputs, f->name);
  bool grad = ebb_grad_enabled();
  uint64_t req = 0;
  for (int i = 0; i < ninputs; i++) {
    if (!inputs[i]) continue;
    if ((st = ebb__tensor_check_at(inputs[i], fn, "inputs", i))) return st;
    struct ebb__meta *m = grad ? ebb__meta_of(inputs[i]) : NULL;
    if (m && m->requires_grad) req |= 1ull << i;
  }
  struct ebb__fnrec rec = {.fn = f, .materialize = true};
  if (req && (st = node_name(f, namelen, &rec.node_name))) return st;
  ebb_function_ctx ctx;
  ctx.magic = CTX_MAGIC;
  ctx.phase = PH_FORWARD;
  ctx.rec = &rec;
  ctx.nin = ninputs;
  ctx.nout = f->noutputs;
  ctx.inputs = inputs;
  ctx.outputs = outputs;
  ctx.recording = req != 0;
  ctx.req = req;
  ctx.dirty = 0;
  ctx.nsave = ctx.nnondiff = 0;
  ctx.save_owned = 0;
  ctx.refused = false;
  for (int k = 0; k < f->noutputs; k++) outputs[k] = NULL;
  struct ebb__edge edges[EBB_FUNCTION_MAX_INPUTS];
  if (req && (st = take_edges(&ctx, edges))) {
    drop_edges(edges, ninputs);
    return st;
  }

  bool was;
  ebb_grad_set_enabled(false, &was);
  uint64_t serial = ebb__fail_serial();
  st = f->forward(&ctx, inputs, ninputs, args, outputs, f->noutputs);
  char why[96];
  if (st) st = ebb__fail(st, "%s: the forward of '%s' failed: %s", fn, f->name, callback_why(serial, st, why, sizeof why));
  else if (ctx.refused) st = ebb__fail(EBB_EINVAL, "%s: the forward of '%s' went on after a ctx call was refused: %s", fn, f->name, ctx.why);
  if (!st) st = check_outputs(fn, &ctx, outputs);
  if (!st && f->setup_context) {
    ctx.phase = PH_SETUP;
    serial = ebb__fail_serial();
    st = f->setup_context(&ctx, inputs, ninputs, args, outputs, f->noutputs);
    if (st) st = ebb__fail(st, "%s: the setup_context of '%s' failed: %s", fn, f->name, callback_why(serial, st, why, sizeof why));
    else if (ctx.refused)
      st = ebb__fail(EBB_EINVAL, "%s: the setup_context of '%s' went on after a ctx call was refused: %s", fn, f->name, ctx.why);
  }
  ebb_grad_set_enabled(was, NULL);
  ctx.phase = PH_DONE;
  uint64_t nondiff = 0;
  if (!st) st = check_dirty(fn, &ctx, outputs);
  if (!st) st = alias_views(fn, &ctx, outputs);
  if (!st) st = nondiff_bits(fn, &ctx, outputs, &nondiff);
  if (!st && ctx.recording) st = record(fn, &ctx, edges, outputs, nondiff);
  else if (req) drop_edges(edges, ninputs);
  for (int k = 0; k < ctx.nsave; k++)
    if (ctx.save_owned >> k & 1) ebb_tensor_release(ctx.save[k]);
  if (rec.destroy) rec.destroy(rec.user); /* (not recorded, or the node took it: then NULL) */
  if (st) release_all(outputs, f->noutputs);
  return st;
}

/* ---- backward -------------------------------------------------------------------------------- */

/* Gradient g returned for input i of n, checked against the input: *out the gradient to pass on
 * (g itself, reduced to the input's shape, or NULL: dropped), g's reference taken. */
static ebb_status check_grad(const char *fn, const struct ebb_node *n, int i, bool need, ebb_tensor_t *g, ebb_tensor_t **out) {
  const ebb__tensor_meta *im = &n->in_meta[i];
  const char *name = n->fnrec->fn->name, *node = ebb__node_name_of(n);
  unsigned long long seq = (unsigned long long)n->seq;
  char gd[EBB__DESC_MAX], md[EBB__DESC_MAX];
  *out = NULL;
  ebb_status st = ebb__tensor_check_at(g, fn, "grad_inputs", i);
  if (st) st = ebb__fail(st, "%s: %s (node %llu): the backward of '%s' returned a released tensor as the gradient of input %d", fn,
                         node, seq, name, i);
  else if (im->ndim < 0)
    st = ebb__fail(EBB_EINVAL, "%s: %s (node %llu): the backward of '%s' returned %s for input %d, which was not given (NULL); "
                   "expected NULL there", fn, node, seq, name, ebb__tensor_desc(g, "a gradient", -1, gd, sizeof gd), i);
  else if (!ebb_dtype_is_float(im->dtype))
    st = ebb__fail(EBB_EINVAL, "%s: %s (node %llu): the backward of '%s' returned %s for %s, which is not floating and has no "
                   "gradient; expected NULL there", fn, node, seq, name, ebb__tensor_desc(g, "a gradient", -1, gd, sizeof gd),
                   ebb__meta_desc(im, "input", i, NULL, md, sizeof md));
  if (st || !need) { /* (a gradient for an input that needs none is dropped, as PyTorch drops it) */
    ebb_tensor_release(g);
    return st;
  }
  if (ebb__tensor_matches(g, im)) {
    *out = g;
    return EBB_OK;
  }
  ebb_tensor_info gi;
  ebb_tensor_get_info(g, &gi);
  const char *what = gi.device != im->device ? "device" : gi.dtype != im->dtype ? "dtype" : NULL;
  ebb_tensor_t *r = NULL;
  if (!what) { /* a shape that sum-reduces to the input's along broadcast dims */
    ebb__fail_mute(true);
    st = ebb_op_sum_to_shape(g, im->ndim, im->shape, &r);
    ebb__fail_mute(false);
    if (st) what = "shape (nor one that sums to it along broadcast dims)";
  }
  if (what) {
    st = ebb__fail(EBB_EINVAL, "%s: %s (node %llu): the backward of '%s' returned %s as the gradient of %s; expected its %s", fn,
                   node, seq, name, ebb__tensor_desc(g, "a gradient", -1, gd, sizeof gd), ebb__meta_desc(im, "input", i, NULL, md, sizeof md),
                   what);
    ebb_tensor_release(g);
    return st;
  }
  ebb_tensor_release(g);
  *out = r;
  return EBB_OK;
}

ebb_status ebb__function_backward(const char *fn, struct ebb_node *n, ebb_tensor_t *const *go, const ebb_tensor_t *const *saved,
                                  const bool *need, ebb_tensor_t **gin) {
  struct ebb__fnrec *r = n->fnrec;
  const ebb_function *f = r->fn;
  const int nin = n->nin, nout = n->nout;
  unsigned long long seq = (unsigned long long)n->seq;
  if (!f->backward) {
    int want = -1;
    for (int i = 0; i < nin && want < 0; i++)
      if (need[i]) want = i;
    if (want < 0) return EBB_OK; /* (nothing wanted of it: nothing to refuse) */
    return ebb__fail(EBB_ENOTSUP, "%s: %s (node %llu) has no backward: '%s' was defined without one (ebb_function.backward NULL), "
                     "and the gradient of its input %d is needed; expected a backward in the definition, or that input detached",
                     fn, r->node_name, seq, f->name, want);
  }
  ebb_tensor_t *zsmall[8] = {NULL}, **zeros = nout <= 8 ? zsmall : calloc((size_t)nout, sizeof *zeros);
  const ebb_tensor_t *gsmall[8], **g = nout <= 8 ? gsmall : malloc((size_t)nout * sizeof *g);
  ebb_status st = zeros && g ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory to run %s", fn, r->node_name);
  bool mat = atomic_load_explicit(&r->materialize, memory_order_relaxed);
  for (int k = 0; !st && k < nout; k++) {
    g[k] = go ? go[k] : NULL;
    if (g[k] || !mat) continue;
    const ebb__tensor_meta *m = &n->in_meta[nin + k];
    st = ebb_tensor_zeros(m->device, m->dtype, m->ndim, m->shape, &zeros[k]);
    if (st) st = ebb__fail(st, "%s: %s (node %llu): zeros for output %d's missing gradient: %s", fn, r->node_name, seq, k, ebb_last_error());
    g[k] = zeros[k];
  }
  int ng = nin;
  if (!st) {
    ebb_function_ctx ctx;
    ctx.magic = CTX_MAGIC;
    ctx.phase = PH_BACKWARD;
    ctx.rec = r;
    ctx.nin = nin;
    ctx.nout = nout;
    ctx.inputs = NULL;
    ctx.outputs = NULL;
    ctx.saved = saved;
    ctx.nsaved = n->nsaved;
    ctx.need = need;
    struct ebb__user_call uc;
    ebb__user_enter(&uc);
    ctx.refused = false;
    st = f->backward(&ctx, g, nout, gin, &ng);
    ebb__user_leave(&uc, st);
    ctx.phase = PH_DONE;
    if (st) st = ebb__fail(st, "%s: %s (node %llu): the backward of '%s' failed: %s", fn, r->node_name, seq, f->name, ebb_last_error());
    else if (ctx.refused)
      st = ebb__fail(EBB_EINVAL, "%s: %s (node %llu): the backward of '%s' went on after a ctx call was refused: %s", fn,
                     r->node_name, seq, f->name, ctx.why);
  }
  for (int k = 0; k < nout && zeros; k++)
    if (zeros[k]) ebb_tensor_release(zeros[k]);
  if (zeros != zsmall) free(zeros);
  if (g != gsmall) free(g);
  if (!st && ng != nin)
    st = ebb__fail(EBB_EINVAL, "%s: %s (node %llu): the backward of '%s' returned %d gradients (*ngrad_inputs); expected %d, one per "
                   "input (NULL for an input without one)", fn, r->node_name, seq, f->name, ng, nin);
  for (int i = 0; i < nin; i++) {
    if (!gin[i]) continue;
    ebb_tensor_t *gi = gin[i];
    gin[i] = NULL;
    if (st) ebb_tensor_release(gi);
    else st = check_grad(fn, n, i, need[i], gi, &gin[i]);
  }
  if (st) release_all(gin, nin);
  return st;
}
