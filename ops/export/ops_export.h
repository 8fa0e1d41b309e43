/* ops_export.h: what ops offers the modules above it (autograd) beyond its public headers.
 * Never installed, not part of the API.
 *
 * Autograd keeps its per-tensor state in one slot of each tensor handle, which ops never reads.
 * ops cannot call autograd (layer order), so autograd hands ops two functions when it starts
 * (ebb__tensor_hooks_set): one that frees a slot's state when the handle holding it dies, and one
 * that lets a view of a tensor with state take its base's history. A tensor whose slot is NULL
 * (every tensor until autograd sets one) costs each path one load and a branch.
 */
#ifndef EBB_OPS_EXPORT_H
#define EBB_OPS_EXPORT_H

#include "ebb/status.h"
#include "ebb/tensor.h"
#include "runtime_export.h" /* EBB_HIDDEN, for C and C++ alike */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb__tensor_hooks {
  /* The last reference to `t` went away and its slot is `slot` (non-NULL): free what the slot
   * holds. Called on the thread that dropped the reference, with no ops lock held, before the
   * record is recycled: t's geometry and storage are still readable, t is not valid for any
   * public call. May release other tensors. */
  void (*released)(ebb_tensor_t *t, void *slot);
  /* `view` was just made from `base` (a view: ebb_tensor_view, reshape without a copy,
   * transpose, permute, slice, narrow, select, expand, squeeze, unsqueeze, or an alias ops makes
   * for itself), whose slot is non-NULL; `fn` is the call that made it. The hook may set view's
   * slot. A failure fails that call with the hook's status (its message prefixed by fn); the view
   * is then released (its `released` hook runs if the slot was set). Same thread as the call. */
  ebb_status (*viewed)(const ebb_tensor_t *base, ebb_tensor_t *view, const char *fn);
} ebb__tensor_hooks;

/* Installs the hooks (NULL removes them): autograd at its start and stop. The struct must outlive
 * the installation. Release store; the paths load it with acquire. */
EBB_HIDDEN void ebb__tensor_hooks_set(const ebb__tensor_hooks *h);

/* The slot of a live handle, and setting it (nothing retained). Callers hold a valid tensor;
 * concurrent setters of one handle are the caller's to order. */
EBB_HIDDEN void *ebb__tensor_slot(const ebb_tensor_t *t);
EBB_HIDDEN void ebb__tensor_set_slot(ebb_tensor_t *t, void *slot);

#ifdef __cplusplus
}
#endif

#endif /* EBB_OPS_EXPORT_H */
