/* saved.c: the tensors a node saves for its backward, and the saved-tensor hooks.
 *
 * A saved slot (struct ebb__saved) holds either the data itself, a handle of the node's own on
 * the tensor's storage without its autograd state (so a node keeping its own output holds no
 * reference back to itself), with the storage's version then; or a packed value: what the pack
 * hook on top of the thread's hook stack made of the tensor, with the pair that packed it and
 * the saved tensor's metadata, to check what unpack gives back. A packed value is reference
 * counted: the node holds one, and a backward unpacking it holds another while the unpack hook
 * runs, outside the engine's saved lock, so a backward on another thread releasing the slot
 * meanwhile frees it only after that unpack (free_packed runs once, with the last reference).
 * The packed form is also where a later representation of a saved tensor (offloaded to host
 * memory, being fetched back) fits: the engine sees only "unpack this".
 *
 * The hook stack is per thread: a linked list of entries, each a pair of hooks or a disable
 * scope (never both kinds on one stack: pushing is refused while disabled, disabling while hooks
 * are pushed). Entries are immutable once pushed, so a backward hands its caller's top entry to
 * the threads running its nodes (ebb__saved_hooks_enter), which read the list without a lock;
 * the part of the stack below that entry cannot be popped while the backward runs, so it lives
 * until every thread has left.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb_internal.h"
#include "ops_export.h"
#include "autograd_impl.h"

struct ebb__packed {
  _Atomic long refs;
  void *data;                          /* what pack made (the user's) */
  ebb_saved_hooks hooks;               /* the pair bound when the tensor was saved */
  ebb__tensor_meta meta;               /* what unpack must give back */
  char name[EBB_TENSOR_NAME_MAX + 1];  /* the saved tensor's name, for messages */
  /* An offloaded tensor instead of hooks (offload.c): its storage's record (a reference) and
   * where the tensor lies in that storage. */
  struct ebb__offl *off;
  int64_t strides[EBB_TENSOR_MAX_DIMS];
  int64_t offset;
};

/* One entry of a thread's stack: a pair of hooks, an offload scope (offload.c), or a disable
 * scope's message. */
enum sh_kind { SH_HOOKS, SH_OFFLOAD, SH_DISABLE };
struct sh_entry {
  struct sh_entry *below;
  enum sh_kind kind;
  ebb_saved_hooks hooks;       /* SH_HOOKS */
  struct ebb__offl_scope *off; /* SH_OFFLOAD: a reference */
  char msg[];                  /* SH_DISABLE: the message */
};

/* This thread's stack, and the entry from which down nothing may be popped (a backward's
 * caller's stack while the backward runs here; NULL: all of it is this thread's). */
static _Thread_local struct sh_entry *sh_top, *sh_base;

/* ---- the stack -------------------------------------------------------------------------------- */

static bool sh_disabled(void) { return sh_top && sh_top->kind == SH_DISABLE; }
/* Whether saves on this thread go through an entry (hooks or an offload scope). */
static bool sh_has_hooks(void) { return sh_top && sh_top->kind != SH_DISABLE; }

static void sh_free(struct sh_entry *e) {
  if (e->kind == SH_OFFLOAD) ebb__offl_scope_put(e->off);
  free(e);
}

ebb_status ebb_saved_tensors_hooks_push(const ebb_saved_hooks *h) {
  if (!h) return ebb__fail(EBB_EINVAL, "ebb_saved_tensors_hooks_push: h is NULL; expected a pair of hooks");
  if (!h->pack || !h->unpack)
    return ebb__fail(EBB_EINVAL, "ebb_saved_tensors_hooks_push: h->%s is NULL; expected a pack and an unpack hook",
                     h->pack ? "unpack" : "pack");
  if (sh_disabled()) return ebb__fail(EBB_ESTATE, "ebb_saved_tensors_hooks_push: %s", sh_top->msg);
  struct sh_entry *e = calloc(1, sizeof *e);
  if (!e) return ebb__fail(EBB_ENOMEM, "ebb_saved_tensors_hooks_push: no host memory for the pair");
  e->below = sh_top;
  e->kind = SH_HOOKS;
  e->hooks = *h;
  sh_top = e;
  return EBB_OK;
}

/* What each kind of entry is called in messages ("no <none> on this thread", "is a <noun>"), and
 * the call that ends it. */
static const char *const sh_none[] = {"saved-tensor hooks pushed", "offload scope open", "disable scope open"};
static const char *const sh_noun[] = {"a pair of saved-tensor hooks", "an offload scope", "a disable scope"};
static const char *const sh_end[] = {"ebb_saved_tensors_hooks_pop", "ebb_offload_scope_exit", "ebb_saved_tensors_hooks_enable"};

/* Pops the top entry, of the kind asked; fn names the call. */
static ebb_status sh_pop(const char *fn, enum sh_kind kind) {
  if (!sh_top)
    return ebb__fail(EBB_ESTATE, "%s: no %s on this thread; expected one %s per start on this thread", fn, sh_none[kind], fn);
  if (sh_top->kind != kind)
    return ebb__fail(EBB_ESTATE, "%s: the innermost entry of this thread's saved-tensor stack is %s, not %s; expected %s "
                     "first (scopes end in the reverse order of their start)", fn, sh_noun[sh_top->kind], sh_noun[kind],
                     sh_end[sh_top->kind]);
  if (sh_top == sh_base)
    return ebb__fail(EBB_ESTATE, "%s: %s on top of this thread's stack belongs to the running backward's caller; expected a "
                     "hook running in a backward to end only what it began", fn, sh_noun[kind]);
  struct sh_entry *e = sh_top;
  sh_top = e->below;
  sh_free(e);
  return EBB_OK;
}

ebb_status ebb_saved_tensors_hooks_pop(void) { return sh_pop("ebb_saved_tensors_hooks_pop", SH_HOOKS); }

ebb_status ebb_saved_tensors_hooks_disable(const char *message) {
  if (!message) return ebb__fail(EBB_EINVAL, "ebb_saved_tensors_hooks_disable: message is NULL; expected the message of a refused push");
  if (sh_has_hooks()) return ebb__fail(EBB_ESTATE, "ebb_saved_tensors_hooks_disable: %s", message);
  size_t len = strlen(message);
  struct sh_entry *e = calloc(1, sizeof *e + len + 1);
  if (!e) return ebb__fail(EBB_ENOMEM, "ebb_saved_tensors_hooks_disable: no host memory for the message");
  memcpy(e->msg, message, len + 1);
  e->below = sh_top;
  e->kind = SH_DISABLE;
  sh_top = e;
  return EBB_OK;
}

ebb_status ebb_saved_tensors_hooks_enable(void) { return sh_pop("ebb_saved_tensors_hooks_enable", SH_DISABLE); }

bool ebb_saved_tensors_hooks_is_enabled(void) { return !sh_disabled(); }

const char *ebb_saved_tensors_hooks_disabled_message(void) { return sh_disabled() ? sh_top->msg : NULL; }

ebb_status ebb_offload_scope_enter(const ebb_offload_policy *policy) {
  static const char fn[] = "ebb_offload_scope_enter";
  if (sh_disabled()) return ebb__fail(EBB_ESTATE, "%s: %s", fn, sh_top->msg);
  struct ebb__offl_scope *sc = NULL;
  ebb_status st = ebb__offl_scope_new(fn, policy, &sc); /* (offload.c: checks the policy) */
  if (st) return st;
  struct sh_entry *e = calloc(1, sizeof *e);
  if (!e) {
    ebb__offl_scope_put(sc);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the scope", fn);
  }
  e->below = sh_top;
  e->kind = SH_OFFLOAD;
  e->off = sc;
  sh_top = e;
  return EBB_OK;
}

ebb_status ebb_offload_scope_exit(void) {
  struct ebb__offl_scope *sc = sh_top && sh_top->kind == SH_OFFLOAD ? sh_top->off : NULL;
  if (sc) ebb__offl_scope_exit(sc); /* (offload.c: a look at its copies, no wait) */
  return sh_pop("ebb_offload_scope_exit", SH_OFFLOAD);
}

const void *ebb__saved_hooks_now(void) { return sh_top; }

void ebb__saved_hooks_enter(struct ebb__saved_hooks_scope *s, const void *stack) {
  s->top = sh_top;
  s->base = sh_base;
  /* (entries are never written after their push: the cast only lets this thread link above it) */
  sh_top = sh_base = (struct sh_entry *)stack;
}

void ebb__saved_hooks_leave(const struct ebb__saved_hooks_scope *s) {
  while (sh_top && sh_top != sh_base) { /* what the backward's hooks left pushed */
    struct sh_entry *e = sh_top;
    sh_top = e->below;
    sh_free(e);
  }
  sh_top = (struct sh_entry *)s->top;
  sh_base = (struct sh_entry *)s->base;
}

/* ---- saving ----------------------------------------------------------------------------------- */

const char *ebb__saved_role(const struct ebb_node *n, int k, char *buf, size_t cap) {
  if (n->fnrec) snprintf(buf, cap, "saved tensor %d", k);
  else snprintf(buf, cap, "saved %s %d", k < n->nin ? "input" : "output", k < n->nin ? k : k - n->nin);
  return buf;
}

/* The tensor n saves at k in a message, before it is saved: "input[0] ...", "output[1] ...", or a
 * custom function's "saved tensor[2] ...". */
static const char *check_desc(const struct ebb_node *n, int k, const ebb_tensor_t *t, char *buf, size_t cap) {
  if (n->fnrec) return ebb__tensor_desc(t, "saved tensor", k, buf, cap);
  return ebb__tensor_desc(t, k < n->nin ? "input" : "output", k < n->nin ? k : k - n->nin, buf, cap);
}

/* A saved handle carries the tensor's name, for the messages that describe it later. */
static void copy_name(const ebb_tensor_t *from, ebb_tensor_t *to) {
  char name[EBB_TENSOR_NAME_MAX + 1];
  if (!ebb_tensor_name(from, name, sizeof name) && name[0]) ebb_tensor_set_name(to, name);
}

/* n's saved tensor k in a message: "saved input 0 'a' (f32[3] on the CPU)". */
static const char *saved_desc(const struct ebb_node *n, int k, const ebb_tensor_t *t, char *buf, size_t cap) {
  char role[40];
  ebb__saved_role(n, k, role, sizeof role);
  return ebb__tensor_desc(t, role, -1, buf, cap);
}

/* What a user's callback that returned st failed with: its own ebb message when it left one
 * (ebb__user_leave copied it where ebb_last_error reads), else its status. Call after leave. */
static const char *user_why(const struct ebb__user_call *uc, ebb_status st, char *buf, size_t cap) {
  if (uc->div || ebb__fail_serial() != uc->serial) return ebb_last_error();
  snprintf(buf, cap, "it returned %s with no message of ebb's", ebb_status_name(st));
  return buf;
}

static void packed_free(struct ebb__packed *p) {
  if (p->off) ebb__offl_put(p->off);
  if (p->hooks.free_packed) {
    struct ebb__user_call uc;
    ebb__user_enter(&uc);
    p->hooks.free_packed(p->hooks.user, p->data);
    ebb__user_leave(&uc, EBB_OK);
  }
  free(p);
}

struct ebb__offl *ebb__packed_offl(const struct ebb__packed *p) { return p->off; }

void ebb__packed_get(struct ebb__packed *p) { atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed); }

void ebb__packed_put(struct ebb__packed *p) {
  /* acq_rel: each holder's reads of p (release) happen before the last one frees it (acquire);
   * as the nodes' counts do, rather than a fence, which TSan cannot follow. */
  if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1) return;
  packed_free(p);
}

/* Packs t through h as n's saved tensor k: *out the packed value (one reference). */
static ebb_status pack_value(const struct ebb_node *n, int k, const ebb_tensor_t *t, const ebb_saved_hooks *h,
                             struct ebb__packed **out) {
  char td[EBB__DESC_MAX], why[128];
  struct ebb__packed *p = calloc(1, sizeof *p);
  ebb_tensor_t *v = NULL; /* what pack sees: t's data without its graph (no cycle through a kept handle) */
  ebb_status st = p ? ebb__tensor_share(t, &v) : EBB_ENOMEM;
  if (st) {
    free(p);
    return ebb__fail(EBB_ENOMEM, "%s (node %llu) could not save its %s: no host memory", ebb__node_name_of(n),
                     (unsigned long long)n->seq, saved_desc(n, k, t, td, sizeof td));
  }
  copy_name(t, v);
  uint64_t before = 0, after = 0;
  ebb_tensor_version(v, &before);
  bool was;
  ebb_grad_set_enabled(false, &was); /* (pack records nothing) */
  struct ebb__user_call uc;
  ebb__user_enter(&uc);
  void *data = NULL;
  st = h->pack(h->user, v, &data);
  ebb__user_leave(&uc, st);
  ebb_grad_set_enabled(was, NULL);
  ebb_tensor_version(v, &after);
  bool packed_ok = !st;
  if (st) {
    st = ebb__fail(st, "%s (node %llu) could not save its %s: the saved-tensor pack hook failed: %s", ebb__node_name_of(n),
                   (unsigned long long)n->seq, saved_desc(n, k, v, td, sizeof td), user_why(&uc, st, why, sizeof why));
  } else if (after != before) {
    st = ebb__fail(EBB_EINVAL, "%s (node %llu) could not save its %s: a saved-tensor pack hook modified its input in place "
                   "(version %llu, now %llu); expected the hook to leave the tensor it packs unchanged (pack a copy)",
                   ebb__node_name_of(n), (unsigned long long)n->seq, saved_desc(n, k, v, td, sizeof td),
                   (unsigned long long)before, (unsigned long long)after);
  }
  ebb__tensor_meta_of(v, &p->meta);
  ebb_tensor_name(v, p->name, sizeof p->name);
  ebb_tensor_release(v);
  p->data = data;
  p->hooks = *h;
  atomic_store_explicit(&p->refs, 1, memory_order_relaxed);
  if (st) {
    if (packed_ok) packed_free(p); /* (a value pack made is freed once, even one the node refuses) */
    else free(p);
    return st;
  }
  *out = p;
  return EBB_OK;
}

/* Packs t through h as n's saved tensor k. */
static ebb_status save_packed(struct ebb_node *n, int k, const ebb_tensor_t *t, const ebb_saved_hooks *h) {
  return pack_value(n, k, t, h, &n->saved[k].packed);
}

/* An inference tensor cannot be saved (its storage may change in place under inference mode,
 * where nothing counts versions). */
static ebb_status check_savable(const struct ebb_node *n, int k, const ebb_tensor_t *t) {
  if (!ebb__tensor_is_inference(t)) return EBB_OK;
  char td[EBB__DESC_MAX];
  return ebb__fail(EBB_EINVAL, "%s must save its %s for backward, which is an inference tensor (made in inference mode) and "
                   "cannot be saved; expected a tensor made outside inference mode (ebb_tensor_clone it there), or grad mode off "
                   "(ebb_grad_set_enabled) instead of inference mode where no gradient is wanted", ebb__node_name_of(n),
                   check_desc(n, k, t, td, sizeof td));
}

/* Saves t as n's saved tensor k through the top of this thread's stack (hooks or an offload
 * scope): *done false when the offload scope leaves it to be saved as is. */
static ebb_status save_through(struct ebb_node *n, int k, const ebb_tensor_t *t, bool *done) {
  *done = true;
  if (sh_top->kind == SH_HOOKS) {
    ebb_saved_hooks h = sh_top->hooks;
    return save_packed(n, k, t, &h);
  }
  struct ebb__offl *o = NULL;
  ebb_status st = ebb__offl_save(sh_top->off, n, k, t, &o); /* (offload.c) */
  if (st || !o) {
    *done = st != EBB_OK;
    return st;
  }
  struct ebb__packed *p = calloc(1, sizeof *p);
  if (!p) {
    ebb__offl_put(o);
    return ebb__fail(EBB_ENOMEM, "%s (node %llu) could not save its saved tensor %d: no host memory", ebb__node_name_of(n),
                     (unsigned long long)n->seq, k);
  }
  ebb__storage_info si;
  ebb__tensor_storage_info(t, &si);
  ebb__tensor_meta_of(t, &p->meta);
  ebb_tensor_name(t, p->name, sizeof p->name);
  memcpy(p->strides, si.strides, sizeof p->strides);
  p->offset = si.offset;
  p->off = o;
  atomic_store_explicit(&p->refs, 1, memory_order_relaxed);
  n->saved[k].packed = p;
  return EBB_OK;
}

ebb_status ebb__save(struct ebb_node *n, int k, const ebb_tensor_t *t) {
  ebb_status st = check_savable(n, k, t);
  if (st) return st;
  if (EBB_UNLIKELY(sh_has_hooks())) {
    bool done;
    st = save_through(n, k, t, &done);
    if (done) return st;
  }
  struct ebb__saved *s = &n->saved[k];
  if (ebb__tensor_share(t, &s->t)) return ebb__fail(EBB_ENOMEM, "no host memory to record %s", ebb__node_name_of(n));
  copy_name(t, s->t);
  ebb__owners_saved(n, k, t);
  ebb_tensor_version(t, &s->version);
  return ebb__mutation_saved(n, k); /* (mutation.c: into this thread's allow-mutation scope, if open) */
}

ebb_status ebb__save_owned(struct ebb_node *n, int k, ebb_tensor_t *t) {
  ebb_status st = check_savable(n, k, t);
  bool done = false;
  if (!st && sh_has_hooks()) st = save_through(n, k, t, &done);
  if (st || done) {
    ebb_tensor_release(t);
    return st;
  }
  n->saved[k].t = t;
  ebb__owners_saved(n, k, t);
  ebb_tensor_version(t, &n->saved[k].version);
  return ebb__mutation_saved(n, k); /* (mutation.c) */
}

void ebb__saved_drop(struct ebb_node *n, int k) {
  struct ebb__saved *s = &n->saved[k];
  if (EBB_UNLIKELY(s->mut != NULL)) ebb__mutation_release(n); /* (mutation.c: before the tensors go) */
  if (s->t) ebb__owners_saved_drop(n, k); /* (owners.c: its block's owner back; releases it) */
  if (s->packed) {
    struct ebb__packed *p = s->packed;
    s->packed = NULL;
    ebb__packed_put(p);
  }
}

/* ---- unpacking -------------------------------------------------------------------------------- */

/* An offloaded tensor: its storage as it is now (on the device, reloaded or never let go) from
 * offload.c, and the saved tensor's handle on it. */
static ebb_status offl_unpack(const char *fn, const struct ebb_node *n, int k, struct ebb__packed *p, const ebb_tensor_t **out) {
  ebb_tensor_t *whole = NULL, *v = NULL;
  ebb_status st = ebb__offl_unpack(fn, n, k, p->off, p->name, &whole);
  if (st) return st;
  st = ebb__tensor_share_as(whole, p->meta.ndim, p->meta.shape, p->strides, p->offset, &v);
  ebb_tensor_release(whole);
  if (st) return ebb__fail(st, "%s: no host memory for a handle of %s's saved tensor", fn, ebb__node_name_of(n));
  if (p->name[0]) ebb_tensor_set_name(v, p->name);
  *out = v;
  return EBB_OK;
}

ebb_status ebb__packed_unpack(const char *fn, const struct ebb_node *n, int k, struct ebb__packed *p, const ebb_tensor_t **out) {
  if (p->off) return offl_unpack(fn, n, k, p, out);
  char want[EBB__DESC_MAX], got[EBB__DESC_MAX], why[128], role[40];
  ebb__saved_role(n, k, role, sizeof role);
  ebb_tensor_t *u = NULL;
  struct ebb__user_call uc;
  ebb__user_enter(&uc);
  ebb_status st = p->hooks.unpack(p->hooks.user, p->data, &u);
  ebb__user_leave(&uc, st);
  if (st) {
    if (u) ebb_tensor_release(u);
    return ebb__fail(st, "%s: %s (node %llu) could not read its %s: the saved-tensor unpack hook failed: %s", fn,
                     ebb__node_name_of(n), (unsigned long long)n->seq,
                     ebb__meta_desc(&p->meta, role, -1, p->name, want, sizeof want), user_why(&uc, st, why, sizeof why));
  }
  bool live = u && !ebb__tensor_check(u, fn, "the unpacked tensor");
  if (!live || !ebb__tensor_matches(u, &p->meta)) {
    if (!u) snprintf(got, sizeof got, "no tensor (NULL)");
    else ebb__tensor_desc(u, "a tensor", -1, got, sizeof got);
    if (live) ebb_tensor_release(u);
    return ebb__fail(EBB_EINVAL, "%s: %s (node %llu) could not read its %s: the saved-tensor unpack hook returned %s; expected "
                     "the saved tensor's shape, dtype and device", fn, ebb__node_name_of(n), (unsigned long long)n->seq,
                     ebb__meta_desc(&p->meta, role, -1, p->name, want, sizeof want), got);
  }
  /* The engine reads a handle of its own: the hooks may keep u, and the backward must not see
   * u's graph (nor add to it). */
  ebb_tensor_t *v = NULL;
  st = ebb__tensor_share(u, &v);
  ebb_tensor_release(u);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  *out = v;
  return EBB_OK;
}

ebb_status ebb__packed_unpack_all(const char *fn, const struct ebb_node *n, struct ebb__packed **pk, const ebb_tensor_t **saved,
                                  ebb_status st) {
  for (int k = 0; k < n->nsaved; k++) {
    if (!pk[k]) continue;
    if (!st) st = ebb__packed_unpack(fn, n, k, pk[k], &saved[k]);
    ebb__packed_put(pk[k]);
  }
  free(pk);
  return st;
}

ebb_status ebb__saved_modified(const char *fn, const struct ebb_node *n, int k, const ebb_tensor_t *sv, uint64_t v) {
  char d[EBB__DESC_MAX];
  return ebb__fail(EBB_ESTATE,
                   "%s: %s (node %llu) needs its %s, which was modified in place after it was saved: saved at version %llu, "
                   "now %llu; expected it unchanged until backward (clone it before changing it)",
                   fn, ebb__node_name_of(n), (unsigned long long)n->seq, saved_desc(n, k, sv, d, sizeof d),
                   (unsigned long long)n->saved[k].version, (unsigned long long)v);
}

/* ---- per-tensor hooks ------------------------------------------------------------------------- */

/* Whether n saves a tensor at index k (its forward's input k, or output k - nin), as the
 * derivative table says (a CopySlices node saves what its in-place op saves). */
static bool saves_at(const struct ebb_node *n, int k) {
  if (n->op < 0 || !n->saved || k < 0 || k >= n->nsaved) return false;
  if (n->fnrec) return ebb__function_saved_at(n->fnrec, k); /* (a custom function's slots are what its ctx saved) */
  int op = n->op == EBB__OP_COPY_SLICES && n->geom ? n->geom->inner_op : n->op;
  unsigned bit = k < n->nin ? (unsigned)k : 8u + (unsigned)(k - n->nin);
  return bit < 16 && (ebb__deriv_of((ebb__op_id)op)->save >> bit & 1);
}

/* "0 (input 0) and 1 (input 1)", or "no tensor", into buf. */
static const char *saved_list(const struct ebb_node *n, char *buf, size_t cap) {
  int count = 0, total = 0;
  for (int k = 0; k < n->nsaved; k++) total += saves_at(n, k);
  size_t len = 0;
  buf[0] = 0;
  for (int k = 0; k < n->nsaved && len < cap; k++) {
    if (!saves_at(n, k)) continue;
    count++;
    const char *sep = count == 1 ? "" : count == total ? " and " : ", ";
    char role[40];
    ebb__saved_role(n, k, role, sizeof role);
    int w = snprintf(buf + len, cap - len, "%s%d (%s)", sep, k, role + 6 /* after "saved " */);
    if (w < 0) break;
    len += (size_t)w;
  }
  if (!count) snprintf(buf, cap, "no tensor");
  return buf;
}

/* n's saved tensor k in a message, as far as the slot still knows it (its tensor, its packed
 * value's record, else its role only). Saved lock held; not for a slot a backward has claimed
 * (freed_saved), which that backward empties without the lock. */
static const char *slot_desc(const struct ebb_node *n, int k, char *buf, size_t cap) {
  const struct ebb__saved *s = &n->saved[k];
  char role[40];
  ebb__saved_role(n, k, role, sizeof role);
  if (atomic_load_explicit(&n->freed_saved, memory_order_acquire)) {
    snprintf(buf, cap, "%s", role);
    return buf;
  }
  if (s->t) return saved_desc(n, k, s->t, buf, cap);
  if (s->packed) return ebb__meta_desc(&s->packed->meta, role, -1, s->packed->name[0] ? s->packed->name : NULL, buf, cap);
  snprintf(buf, cap, "%s", role);
  return buf;
}

/* Whether slot k of n can take a pair of hooks now (its saved lock held): EBB_OK with its tensor
 * in *t (borrowed), else the failure. */
static ebb_status slot_open(const char *fn, const struct ebb_node *n, int k, ebb_tensor_t **t) {
  const struct ebb__saved *s = &n->saved[k];
  char d[EBB__DESC_MAX];
  const char *name = ebb__node_name_of(n);
  unsigned long long seq = (unsigned long long)n->seq;
  if (atomic_load_explicit(&n->freed_saved, memory_order_acquire))
    return ebb__fail(EBB_ESTATE, "%s: the %s of %s (node %llu) was freed by a backward through the node; expected retain_graph on "
                     "that backward to keep the node's saved tensors (for hooks or another backward)", fn,
                     slot_desc(n, k, d, sizeof d), name, seq);
  if (s->packed)
    return ebb__fail(EBB_ESTATE, "%s: the %s of %s (node %llu) has its hooks already set (packed when it was saved, or by an "
                     "earlier call); only one pair per saved tensor", fn, slot_desc(n, k, d, sizeof d), name, seq);
  if (s->mut)
    return ebb__fail(EBB_ESTATE, "%s: the %s of %s (node %llu) was saved inside an allow-mutation scope, which manages its value "
                     "as a pair of hooks would; only one pair per saved tensor", fn, slot_desc(n, k, d, sizeof d), name, seq);
  if (!s->t)
    return ebb__fail(EBB_EINVAL, "%s: %s (node %llu) holds no tensor as its %s (%s); expected the index of a tensor it saved", fn,
                     name, seq, slot_desc(n, k, d, sizeof d), n->fnrec ? "its ctx saved NULL there" : "an optional input not given");
  uint64_t v = 0;
  ebb_tensor_version(s->t, &v);
  if (v != s->version) return ebb__saved_modified(fn, n, k, s->t, v); /* (packing it would hide the change) */
  *t = s->t;
  return EBB_OK;
}

ebb_status ebb_node_saved_register_hooks(const ebb_node_t *node, int index, const ebb_saved_hooks *h) {
  static const char fn[] = "ebb_node_saved_register_hooks";
  if (!node) return ebb__fail(EBB_EINVAL, "%s: node is NULL; expected a node (ebb_tensor_grad_fn)", fn);
  if (node->magic != EBB__NODE_MAGIC) return ebb__fail(EBB_EFREED, "%s: node %p is not a live node", fn, (const void *)node);
  if (!h) return ebb__fail(EBB_EINVAL, "%s: h is NULL; expected a pair of hooks", fn);
  if (!h->pack || !h->unpack)
    return ebb__fail(EBB_EINVAL, "%s: h->%s is NULL; expected a pack and an unpack hook", fn, h->pack ? "unpack" : "pack");
  /* (a node's saved tensors are a side table of it, as its hooks are: not what const protects) */
  struct ebb_node *n = (struct ebb_node *)node;
  if (!saves_at(n, index)) {
    char list[256];
    if (n->fnrec)
      return ebb__fail(EBB_EINVAL, "%s: %s (node %llu) saves no tensor at index %d; it saves %s (indices: the order its ctx "
                       "saved them in, 0..%d)", fn, ebb__node_name_of(n), (unsigned long long)n->seq, index,
                       saved_list(n, list, sizeof list), n->nsaved - 1);
    return ebb__fail(EBB_EINVAL, "%s: %s (node %llu) saves no tensor at index %d; it saves %s (indices: its forward's inputs "
                     "0..%d, then its outputs)", fn, ebb__node_name_of(n), (unsigned long long)n->seq, index,
                     saved_list(n, list, sizeof list), n->nin - 1);
  }
  struct ebb__saved *s = &n->saved[index];
  ebb_tensor_t *t = NULL;
  ebb__mutex_lock(ebb__saved_lock(n));
  ebb_status st = slot_open(fn, n, index, &t);
  if (!st) ebb_tensor_retain(t); /* (the slot may let go of it while pack runs) */
  ebb__mutex_unlock(ebb__saved_lock(n));
  if (st) return st;
  /* pack is the user's code: it runs with no lock held (it may call any ebb function). */
  struct ebb__packed *p = NULL;
  st = pack_value(n, index, t, h, &p);
  if (st) {
    ebb_tensor_release(t);
    return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  }
  ebb_tensor_t *now = NULL;
  ebb__mutex_lock(ebb__saved_lock(n));
  st = slot_open(fn, n, index, &now);
  if (!st && now != t) {
    char d[EBB__DESC_MAX];
    st = ebb__fail(EBB_ESTATE, "%s: the %s of %s (node %llu) changed while its pack hook ran (another call set its hooks); only "
                   "one pair per saved tensor", fn, slot_desc(n, index, d, sizeof d), ebb__node_name_of(n), (unsigned long long)n->seq);
  }
  if (!st) {
    s->packed = p;
    s->t = NULL;
  }
  ebb__mutex_unlock(ebb__saved_lock(n));
  if (st) {
    ebb__packed_put(p); /* (free_packed runs: a value pack made is freed once) */
    ebb_tensor_release(t);
    return st;
  }
  ebb_tensor_release(t); /* ours: the slot's reference, taken out of it, is the last of the node's */
  ebb__owners_saved_forget(n, index, t); /* (owners.c: its block's owner back when n was the last to save it) */
  ebb_tensor_release(t);
  return EBB_OK;
}
