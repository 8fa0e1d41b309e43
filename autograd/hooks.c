/* hooks.c: tensor hooks and post-accumulate hooks, their registry of removable handles.
 *
 * A hook lives in its owner's list: a non-leaf tensor's hooks on its grad_fn (they watch one of
 * the node's outputs), a leaf's on its meta. Handles are ids in one registry (id -> hook), so a
 * handle whose hook is gone (removed, or its owner freed) is found missing rather than read as
 * freed memory. Registration, removal and the owners' frees take ebb__hook_mu; the engine walks a
 * list without it: hooks are only appended (a release store of the link) and a removed hook stays
 * in the list, marked, until its owner goes, which no backward can overlap (a backward holds the
 * graph). A hook may own its user data (user_free, run when the hook struct goes, without the
 * lock). A group (multi-grad, logging hooks) is a registry entry in no list whose removal removes
 * its members; it lives until removed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd_impl.h"
#include "ebb/ops.h"
#include "ebb_internal.h"

static ebb_mutex ebb__hook_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.hooks", EBB_RANK_LEAF};
static struct ebb__hook **ebb__reg; /* registered hooks (ebb__hook_mu), in no order */
static size_t ebb__nreg, ebb__capreg;
static uint64_t ebb__next_hook_id = 1;

/* Adds h to the registry and appends it to *list. Lock held. */
static bool hook_add_locked(_Atomic(struct ebb__hook *) *list, struct ebb__hook *h) {
  if (ebb__nreg == ebb__capreg) {
    size_t nc = ebb__capreg ? ebb__capreg * 2 : 16;
    struct ebb__hook **nr = realloc(ebb__reg, nc * sizeof *nr);
    if (!nr) return false;
    ebb__reg = nr;
    ebb__capreg = nc;
  }
  ebb__reg[ebb__nreg++] = h;
  h->id = ebb__next_hook_id++;
  for (struct ebb__hook *x; (x = atomic_load_explicit(list, memory_order_relaxed));) list = &x->next;
  atomic_store_explicit(list, h, memory_order_release); /* h whole before a walker can reach it */
  return true;
}

static void unregister_locked(const struct ebb__hook *h) {
  for (size_t i = 0; i < ebb__nreg; i++)
    if (ebb__reg[i] == h) {
      ebb__reg[i] = ebb__reg[--ebb__nreg];
      return;
    }
}

void ebb__hooks_free(struct ebb__hook *h) {
  if (!h) return;
  ebb__mutex_lock(&ebb__hook_mu);
  for (struct ebb__hook *x = h; x; x = x->next)
    if (!x->removed) unregister_locked(x);
  ebb__mutex_unlock(&ebb__hook_mu);
  /* Destructors without the lock: one may drop the last reference of a node, whose free comes
   * back here. */
  while (h) {
    struct ebb__hook *next = h->next;
    if (h->user_free) h->user_free(h->user);
    free(h);
    h = next;
  }
}

ebb_status ebb__hook_attach(const char *fn, _Atomic(struct ebb__hook *) *list, struct ebb__hook *h, uint64_t *id) {
  static _Atomic(struct ebb__hook *) none;
  ebb__mutex_lock(&ebb__hook_mu);
  bool ok = hook_add_locked(list ? list : &none, h);
  if (!list) none = NULL; /* a group is in the registry only */
  if (ok) *id = h->id;
  ebb__mutex_unlock(&ebb__hook_mu);
  return ok ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory for the hook registry", fn);
}

bool ebb__hook_remove_id(uint64_t id) {
  ebb__mutex_lock(&ebb__hook_mu);
  struct ebb__hook *h = NULL;
  for (size_t i = 0; i < ebb__nreg && !h; i++)
    if (ebb__reg[i]->id == id) h = ebb__reg[i];
  if (h) {
    h->removed = true;
    unregister_locked(h);
  }
  ebb__mutex_unlock(&ebb__hook_mu);
  return h != NULL;
}

static ebb_status hooks_register(const char *fn, ebb_tensor_t *t, int kind, ebb_tensor_hook_fn f, ebb_post_accumulate_hook_fn post,
                                void *user, void (*user_free)(void *), bool internal, ebb_hook_handle *out) {
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  if (!f && !post) return ebb__fail(EBB_EINVAL, "%s: fn is NULL; expected a hook function", fn);
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected a hook handle to fill", fn);
  struct ebb__meta *m = ebb__meta_of(t);
  char td[EBB__DESC_MAX];
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient, so no gradient will reach a hook; expected a tensor "
                     "that requires one", fn, ebb__tensor_desc(t, "t", -1, td, sizeof td));
  struct ebb_node *gf = NULL;
  int nr = 0;
  if ((st = ebb__grad_fn_now(t, m, &gf, &nr))) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  if (kind == EBB__HOOK_POST_ACC && gf)
    return ebb__fail(EBB_EINVAL, "%s: %s was produced by %s; post-accumulate hooks are for leaves (their .grad)", fn,
                     ebb__tensor_desc(t, "t", -1, td, sizeof td), ebb__node_name_of(gf));
  struct ebb__hook *h = calloc(1, sizeof *h);
  if (!h) return ebb__fail(EBB_ENOMEM, "%s: no host memory for a hook", fn);
  *h = (struct ebb__hook){.kind = kind, .output_nr = nr, .fn = f, .post = post, .user = user, .user_free = user_free,
                            .internal = internal};
  ebb__mutex_lock(&ebb__hook_mu);
  bool ok = hook_add_locked(gf ? &gf->hooks : &m->hooks, h);
  uint64_t id = h->id;
  ebb__mutex_unlock(&ebb__hook_mu);
  if (!ok) {
    free(h);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the hook registry", fn);
  }
  out->id = id;
  return EBB_OK;
}

ebb_status ebb_tensor_register_hook(ebb_tensor_t *t, ebb_tensor_hook_fn fn, void *user, ebb_hook_handle *out) {
  return hooks_register("ebb_tensor_register_hook", t, EBB__HOOK_TENSOR, fn, NULL, user, NULL, false, out);
}

ebb_status ebb__tensor_hook_add(const char *fn, ebb_tensor_t *t, ebb_tensor_hook_fn f, void *user, void (*user_free)(void *),
                                uint64_t *id) {
  ebb_hook_handle h = {0};
  ebb_status st = hooks_register(fn, t, EBB__HOOK_TENSOR, f, NULL, user, user_free, true, &h);
  if (!st) *id = h.id;
  return st;
}

ebb_status ebb_tensor_register_post_accumulate_hook(ebb_tensor_t *t, ebb_post_accumulate_hook_fn fn, void *user, ebb_hook_handle *out) {
  return hooks_register("ebb_tensor_register_post_accumulate_hook", t, EBB__HOOK_POST_ACC, NULL, fn, user, NULL, false, out);
}

ebb_status ebb_hook_remove(ebb_hook_handle handle) {
  ebb__mutex_lock(&ebb__hook_mu);
  struct ebb__hook *h = NULL;
  for (size_t i = 0; i < ebb__nreg && !h; i++)
    if (ebb__reg[i]->id == handle.id) h = ebb__reg[i];
  if (h) {
    h->removed = true;
    unregister_locked(h);
  }
  ebb__mutex_unlock(&ebb__hook_mu);
  if (!h)
    return ebb__fail(EBB_EINVAL, "ebb_hook_remove: hook %llu is not registered: removed already, its tensor's graph is gone, or "
                     "never returned by a register call", (unsigned long long)handle.id);
  if (h->kind == EBB__HOOK_GROUP) { /* in no list: removing it ends it (its members first) */
    h->on_remove(h->user);
    if (h->user_free) h->user_free(h->user);
    free(h);
  }
  return EBB_OK;
}

static ebb_status retain_add(struct ebb__meta *m, struct ebb_node *node, int nr, struct ebb__hook **out);

ebb_status ebb_tensor_retain_grad(ebb_tensor_t *t) {
  static const char fn[] = "ebb_tensor_retain_grad";
  ebb_status st = ebb__tensor_check(t, fn, "t");
  if (st) return st;
  struct ebb__meta *m = ebb__meta_of(t);
  char td[EBB__DESC_MAX];
  if (!m || !m->requires_grad)
    return ebb__fail(EBB_EINVAL, "%s: %s does not require a gradient; expected a tensor computed from one that does", fn,
                     ebb__tensor_desc(t, "t", -1, td, sizeof td));
  struct ebb_node *gf = NULL;
  int nr = 0;
  if ((st = ebb__grad_fn_now(t, m, &gf, &nr))) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  if (!gf || m->retain) return EBB_OK; /* a leaf keeps its .grad anyway; twice is once */
  struct ebb__hook *h = NULL;
  st = retain_add(m, gf, nr, &h);
  if (!st) m->retain = h;
  return st ? ebb__fail(st, "%s: %s", fn, ebb_last_error()) : EBB_OK;
}

/* A retain hook for m on output nr of node. */
static ebb_status retain_add(struct ebb__meta *m, struct ebb_node *node, int nr, struct ebb__hook **out) {
  struct ebb__hook *h = calloc(1, sizeof *h);
  if (!h) return ebb__fail(EBB_ENOMEM, "no host memory for the retain_grad hook");
  /* (no fn: the engine writes .grad itself, ebb__run_tensor_hooks' `retain`, since only it knows
   * the stream the write goes on, which the caller's streams must wait for) */
  *h = (struct ebb__hook){.kind = EBB__HOOK_RETAIN, .output_nr = nr, .user = m};
  ebb__mutex_lock(&ebb__hook_mu);
  bool ok = hook_add_locked(&node->hooks, h);
  ebb__mutex_unlock(&ebb__hook_mu);
  if (!ok) {
    free(h);
    return ebb__fail(EBB_ENOMEM, "no host memory for the hook registry");
  }
  *out = h;
  return EBB_OK;
}

ebb_status ebb__retain_prepare(struct ebb__meta *m, struct ebb_node *node, int nr, struct ebb__hook **out) {
  *out = NULL;
  return m && m->retain ? retain_add(m, node, nr, out) : EBB_OK;
}

void ebb__retain_commit(struct ebb__meta *m, struct ebb__hook *h) {
  if (!h) return;
  ebb__retain_end(m); /* the old grad_fn's hook: it would get the gradient of the old value */
  m->retain = h;
}

void ebb__retain_end(struct ebb__meta *m) {
  if (!m->retain) return;
  ebb__mutex_lock(&ebb__hook_mu);
  if (!m->retain->removed) unregister_locked(m->retain);
  m->retain->removed = true;
  m->retain->user = NULL;
  ebb__mutex_unlock(&ebb__hook_mu);
  m->retain = NULL;
}

/* One pass over the list for the tensor hooks of output_nr. */
static ebb_status run_kind(const char *fn, const char *who, struct ebb__hook *h, int output_nr, ebb_tensor_t **grad) {
  for (; h; h = h->next) {
    if (h->kind != EBB__HOOK_TENSOR || h->output_nr != output_nr || h->removed || !*grad) continue;
    ebb_tensor_t *rep = NULL;
    struct ebb__user_call uc;
    if (!h->internal) ebb__user_enter(&uc);
    ebb_status st = h->fn(*grad, &rep, h->user);
    if (!h->internal) ebb__user_leave(&uc, st);
    if (st) {
      if (rep) ebb_tensor_release(rep);
      return ebb__fail(st, "%s: a tensor hook (hook %llu) of %s failed: %s", fn, (unsigned long long)h->id, who, ebb_last_error());
    }
    if (!rep) continue;
    ebb_tensor_info a, b;
    st = ebb_tensor_get_info(rep, &b);
    if (!st) st = ebb_tensor_get_info(*grad, &a);
    if (!st && (a.ndim != b.ndim || memcmp(a.shape, b.shape, sizeof(int64_t) * (size_t)a.ndim) != 0 || a.dtype != b.dtype ||
                a.device != b.device)) {
      char gd[EBB__DESC_MAX], rd[EBB__DESC_MAX];
      st = ebb__fail(EBB_EINVAL, "%s: a tensor hook (hook %llu) of %s replaced %s with %s; expected the same shape, dtype and device", fn,
                     (unsigned long long)h->id, who, ebb__tensor_desc(*grad, "the gradient", -1, gd, sizeof gd),
                     ebb__tensor_desc(rep, "the replacement", -1, rd, sizeof rd));
      ebb_tensor_release(rep);
      return st;
    }
    if (st) {
      ebb_tensor_release(rep);
      return st;
    }
    ebb_tensor_release(*grad);
    *grad = rep;
  }
  return EBB_OK;
}

ebb_status ebb__run_tensor_hooks(const char *fn, const char *who, struct ebb__hook *h, int output_nr, ebb_tensor_t **grad,
                                 ebb__retain_write_fn retain, void *ctx) {
  ebb_status st = run_kind(fn, who, h, output_nr, grad);
  /* retain_grad sees the gradient after every other tensor hook (PyTorch's order). */
  for (; !st && h; h = h->next) {
    if (h->kind != EBB__HOOK_RETAIN || h->output_nr != output_nr || h->removed || !*grad) continue;
    if ((st = retain(ctx, h->user, *grad)))
      st = ebb__fail(st, "%s: retain_grad's update of the .grad of output %d of %s failed: %s", fn, output_nr, who, ebb_last_error());
  }
  return st;
}

ebb_status ebb__run_post_acc_hooks(const char *fn, struct ebb__hook *h, const ebb_tensor_t *t) {
  for (; h; h = h->next) {
    if (h->kind != EBB__HOOK_POST_ACC || h->removed) continue;
    struct ebb__user_call uc;
    ebb__user_enter(&uc);
    ebb_status st = h->post(t, h->user);
    ebb__user_leave(&uc, st);
    if (st)
      return ebb__fail(st, "%s: a post-accumulate hook (hook %llu) failed: %s", fn, (unsigned long long)h->id, ebb_last_error());
  }
  return EBB_OK;
}

void ebb__user_leave(const struct ebb__user_call *u, ebb_status st) {
  if (st && u->div) {
    if (ebb__fail_serial() != u->serial) snprintf(u->div, EBB__ERRMSG_MAX, "%s", ebb_last_error());
    else snprintf(u->div, EBB__ERRMSG_MAX, "it returned %s with no message of ebb's", ebb_status_name(st));
  }
  ebb__fail_divert(u->div);
}
