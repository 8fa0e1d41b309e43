/* hooks.c: the hooks of the module above (ops_export.h) and what ops does around them.
 *
 * Owns: the installed hook table; the recording bracket of public ops (a thread-local depth, so
 * only the outermost public call records); the check before an in-place op changes a tensor and
 * its commit; the count of modules watching every in-place op; inference mode (per thread).
 * Threading: the table is published with a release store and read with acquire loads; the
 * depth and inference mode are thread-local.
 */
#include "ops_impl.h"
#include "ops_export.h"

/* The hooks of the module above (ops_export.h): NULL until autograd starts. */
_Atomic(const ebb__tensor_hooks *) ebb__hooks;

/* Public op calls in progress on this thread, counted while hooks are installed. */
static _Thread_local int ebb__rec_depth;

/* Inference mode on this thread (autograd's scope; ops marks the storage made under it). */
static _Thread_local bool ebb__inference;

void ebb__inference_set(bool on) { ebb__inference = on; }
bool ebb__inference_on(void) { return ebb__inference; }

const ebb__tensor_hooks *ebb__rec_enter_slow(const ebb__tensor_hooks *h) {
  if (!h->recorded) return NULL;
  ebb__rec_depth++;
  return h;
}

/* Modules watching every in-place op (ebb__inplace_watch_add). */
static _Atomic long ebb__inplace_watch;
void ebb__inplace_watch_add(long delta) { atomic_fetch_add_explicit(&ebb__inplace_watch, delta, memory_order_relaxed); }

ebb_status ebb__inplace_check(const char *fn, int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc,
                              const ebb__op_args *args, void **token) {
  *token = NULL;
  if (EBB_UNLIKELY(dst->stor->inference) && !ebb__inference) {
    return ebb__fail_about(EBB_EINVAL, fn, dst, "dst", "is an inference tensor (made in inference mode), which cannot be changed in "
                           "place outside inference mode; expected the change inside inference mode, or a clone made outside it");
  }
  /* acquire: pairs with the release store in ebb__tensor_hooks_set. */
  const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
  if (EBB_LIKELY(!h || !h->inplace)) return EBB_OK;
  bool slots = dst->autograd || (dst->base && dst->base->autograd);
  for (int i = 0; i < nsrc && !slots; i++) slots = src[i]->autograd != NULL;
  if (EBB_LIKELY(!slots && !atomic_load_explicit(&ebb__inplace_watch, memory_order_relaxed))) return EBB_OK;
  ebb_status st = h->inplace(op, dst, src, nsrc, args, token);
  return st ? ebb__fail_in(fn, st) : EBB_OK;
}

void ebb__inplace_end(void *token, bool ok) {
  if (EBB_LIKELY(!token)) return;
  /* acquire: pairs with the release store in ebb__tensor_hooks_set (the hooks that made the
   * token are still installed: autograd stops after the last op). */
  const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
  if (h && h->inplace_done) h->inplace_done(token, ok);
}

ebb_status ebb__rec_exit(const char *fn, const ebb__tensor_hooks *h, ebb_status st, ebb__op_id op, const ebb_tensor_t *const *in,
                         int nin, ebb_tensor_t **out0, ebb_tensor_t **out1, const ebb__op_args *args) {
  if (--ebb__rec_depth > 0 || st) return st; /* an op's own inner call, or a failure */
  bool any = false;
  for (int i = 0; i < nin && !any; i++) any = in[i] && in[i]->autograd;
  if (!any) return EBB_OK;
  ebb_tensor_t *outs[2] = {*out0, out1 ? *out1 : NULL};
  if (outs[0] == in[0]) return EBB_OK; /* the input itself (contiguous of a contiguous tensor): no node */
  static const ebb__op_args none;
  st = h->recorded((int)op, in, nin, outs, out1 ? 2 : 1, args ? args : &none);
  if (st) {
    ebb__tensor_put(*out0);
    *out0 = NULL;
    if (out1) {
      ebb__tensor_put(*out1);
      *out1 = NULL;
    }
    return ebb__fail_in(fn, st);
  }
  return EBB_OK;
}

void ebb__tensor_hooks_set(const ebb__tensor_hooks *h) {
  /* release: pairs with the acquire loads below; the hooks' module is up. */
  atomic_store_explicit(&ebb__hooks, h, memory_order_release);
}
