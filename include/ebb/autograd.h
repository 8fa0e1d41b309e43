/* ebb/autograd.h: the autograd graph: grad mode, tensors that require gradients, and the nodes
 * that ops record as they run.
 *
 * The same ebb_op_* and tensor calls (ebb/ops.h, ebb/tensor.h) record the graph: when grad mode
 * is on and an input requires a gradient, each call that produces new values or a view creates
 * one node, named after its backward ("MulBackward", "TransposeBackward"), and its outputs
 * require gradients with that node as their grad_fn. A leaf (a tensor the user created and marked
 * with ebb_tensor_set_requires_grad) gets an "AccumulateGrad" node the first time an op uses it:
 * created lazily, held by the nodes that use the leaf (never by the leaf), so it goes with the
 * graph. With no input requiring a gradient, an op records nothing and costs a branch.
 *
 * In-place ops (ebb_op_add_, ebb_op_mul_, ebb_tensor_copy_, ebb_tensor_fill_, ebb_tensor_zero_)
 * are recorded too, with grad mode on, when dst requires a gradient or src does:
 * - on a tensor that is not a view, the op's node becomes dst's grad_fn (output 0), its input 0
 *   being dst's old value (its old grad_fn): dst's history is rebased. The version counter of
 *   dst's storage moves on, so a node that saved dst (or any view of its storage) before fails
 *   at backward with EBB_ESTATE, naming the node, the saved tensor and both versions.
 * - on a view (ebb_tensor_view, reshape when it does not copy, transpose, permute, slice,
 *   narrow, select, expand, squeeze, unsqueeze; not detach), the view's base (the tensor its
 *   chain of views started from) gets the new history: its grad_fn becomes a "CopySlices" node,
 *   which sends the base's gradient where the view lies through the op's backward and the rest
 *   to the base's old grad_fn. The view, and every other view of that base, then takes its
 *   grad_fn from the base's ("AsStridedBackward"), when it is next used or asked for.
 * - refused with EBB_EINVAL: a leaf that requires a gradient, or a view of one, with grad mode on
 *   (turn grad mode off for an optimizer's update); a dst whose elements overlap in memory (an
 *   expanded tensor), or a view of such a base.
 * With grad mode off, in-place ops record nothing (versions still move). Not tracked: a view
 * made before its base required a gradient (or with grad mode off) keeps not requiring one, even
 * after an in-place op through another view or the base gives the base a history.
 *
 * Status of this header: the graph is recorded and can be inspected, and the engine runs a
 * backward on the calling thread (CPU tensors and one device), with tensor and post-accumulate
 * hooks and retain_grad; in-place ops, views and inference mode as above. Not yet: node,
 * multi-grad and logging hooks, create_graph (a backward records nothing), non-leaf inputs to
 * ebb_backward, the multi-device engine (issues 20 and 21).
 *
 * Ownership: node handles are borrowed: valid while a tensor whose graph reaches the node lives
 * (an in-place op on a tensor replaces its grad_fn: the old node lives on only where the new
 * history uses it).
 * Threading: every function is thread-safe; grad mode is per thread. Errors: a status and
 * ebb_last_error naming the call, the tensor and what was expected.
 */
#ifndef EBB_AUTOGRAD_H
#define EBB_AUTOGRAD_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb_node ebb_node_t;

/* ---- grad mode: per thread, on by default ---------------------------------------------------
 * With grad mode off (a no-grad scope), ops record nothing: their outputs do not require
 * gradients. ebb_grad_set_enabled returns the previous state in *was (may be NULL), to restore it
 * at the end of the scope. Never fails. */
EBB_API bool ebb_grad_enabled(void);
EBB_API void ebb_grad_set_enabled(bool enabled, bool *was);

/* ---- inference mode: per thread, off by default ----------------------------------------------
 * A stronger no-grad scope, for code that will never be differentiated: while it is on, ops
 * record nothing and ebb_grad_enabled reads false (whatever ebb_grad_set_enabled says; the grad
 * mode set inside or before comes back when inference mode ends), and every tensor created on
 * this thread (op outputs, creation calls, copies; not views and detached handles of tensors
 * made outside) is an inference tensor. Outside inference mode an inference tensor:
 * - may be an input of ops, recorded or not, except where a recorded op must save it for
 *   backward (ebb_op_mul with an input that requires a gradient, ...): that op fails with
 *   EBB_EINVAL, naming the node and the input;
 * - cannot be changed in place (EBB_EINVAL from ebb_op_add_, ebb_tensor_copy_, ...);
 * - cannot be marked as requiring a gradient (EBB_EINVAL from ebb_tensor_set_requires_grad).
 * A clone made outside inference mode is a normal tensor. ebb_inference_mode_set_enabled
 * returns the previous state in *was (may be NULL) to restore it at the end of the scope; never
 * fails. ebb_tensor_is_inference: EBB_EINVAL for NULL t or out, EBB_EFREED for a released t. */
EBB_API bool ebb_inference_mode_enabled(void);
EBB_API void ebb_inference_mode_set_enabled(bool enabled, bool *was);
EBB_API ebb_status ebb_tensor_is_inference(const ebb_tensor_t *t, bool *out);

/* ---- tensors ---------------------------------------------------------------------------------
 * Marks a leaf (a tensor no recorded op produced) as requiring a gradient, or not. EBB_EINVAL for
 * a tensor an op produced (its requirement follows its inputs; detach it first), or for a
 * non-floating dtype when enabling (only floating tensors have gradients); EBB_EFREED for a
 * released tensor. Affects ops recorded afterwards, not nodes already recorded. Other handles on
 * the same storage (views made before) are not affected. */
EBB_API ebb_status ebb_tensor_set_requires_grad(ebb_tensor_t *t, bool requires_grad);
/* Whether t requires a gradient: a leaf marked so, or the output of a recorded op. */
EBB_API ebb_status ebb_tensor_requires_grad(const ebb_tensor_t *t, bool *out);
/* Whether t is a leaf: no recorded op produced it (every tensor that does not require a gradient
 * is a leaf, as in PyTorch). */
EBB_API ebb_status ebb_tensor_is_leaf(const ebb_tensor_t *t, bool *out);
/* The node that produced t (*out NULL for a leaf) and which of its outputs t is (*output_nr, may
 * be NULL): after an in-place op, that op's node (or, for a view, "AsStridedBackward" from its
 * base's history). The node is borrowed: valid while t lives and is not changed in place.
 * EBB_ENOMEM when a view's history must be taken again from its base and no memory is left. */
EBB_API ebb_status ebb_tensor_grad_fn(const ebb_tensor_t *t, const ebb_node_t **out, int *output_nr);
/* A new handle on t's storage (sharing its version counter) that is a leaf and does not
 * require a gradient: the graph stops there. Not a view for autograd: an in-place change to it
 * is allowed even when t is a leaf that requires a gradient, and records nothing (it does move
 * the version, so nodes that saved t fail at backward). */
EBB_API ebb_status ebb_tensor_detach(const ebb_tensor_t *t, ebb_tensor_t **out);

/* ---- nodes -----------------------------------------------------------------------------------
 * A node's name: its backward ("MulBackward", "AccumulateGrad"); "(invalid node)" for NULL. */
EBB_API const char *ebb_node_name(const ebb_node_t *node);
/* Order of creation among this process's nodes (later ops have larger numbers; the engine will
 * run ready nodes in decreasing order). AccumulateGrad nodes have UINT64_MAX. */
EBB_API ebb_status ebb_node_sequence_nr(const ebb_node_t *node, uint64_t *out);
/* The node's next edges, one per input of its forward op: input i's gradient flows to *next
 * (its grad_fn, or a leaf's AccumulateGrad) as that node's input *input_nr; *next is NULL for an
 * input that needs no gradient. EBB_EINVAL for i out of [0, ebb_node_num_next). */
EBB_API ebb_status ebb_node_num_next(const ebb_node_t *node, int *out);
EBB_API ebb_status ebb_node_next(const ebb_node_t *node, int i, const ebb_node_t **next, int *input_nr);

/* ---- backward ---------------------------------------------------------------------------------
 * ebb_backward: computes the gradient of the roots with respect to the leaves of their graph and
 * adds it into each leaf's .grad (ebb_tensor_grad). grad_roots[i] is the gradient of roots[i]
 * (its shape, dtype and device); grad_roots or an entry of it NULL means 1, allowed for a root of
 * one element only. With `inputs` (ninputs > 0, leaves that require gradients) only their .grad
 * is written and only the nodes on a path to them run (partial backward); an input the roots do
 * not depend on is left as it was. Nodes run on the calling thread in decreasing sequence number,
 * AccumulateGrad first among the ready ones, the same order on every run. Without retain_graph
 * the saved tensors of every node that ran are released: a second backward through those nodes
 * fails with EBB_ESTATE (nodes that save nothing may run again).
 *
 * ebb_grad: the same walk, but the gradients with respect to `inputs` (leaves or not) are
 * returned in grads[0..ninputs) (new references) and no .grad is touched. An input the outputs do
 * not depend on is EBB_EINVAL, or with allow_unused gets grads[i] NULL.
 *
 * Errors (a status and a message; the graph and the process carry on): EBB_EINVAL for no roots,
 * a root or input that does not require a gradient, a missing gradient for a root of more than
 * one element, a grad_roots entry of the wrong shape, dtype or device; EBB_ESTATE for a saved
 * tensor modified in place since it was saved (naming the node, which tensor, and both versions)
 * or freed by an earlier backward; a failing node's status with its name. On failure nothing is
 * returned in grads; .grad may hold the part of the gradient accumulated before the failure.
 * Threading: backward calls on different threads may share leaves: each leaf's accumulation is
 * serialised, so sums are exact; sharing a graph's nodes between concurrent calls needs
 * retain_graph on all of them. */
EBB_API ebb_status ebb_backward(const ebb_tensor_t *const *roots, const ebb_tensor_t *const *grad_roots, int nroots,
                                bool retain_graph, const ebb_tensor_t *const *inputs, int ninputs);
EBB_API ebb_status ebb_grad(const ebb_tensor_t *const *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                            const ebb_tensor_t *const *inputs, int ninputs, bool retain_graph, bool allow_unused,
                            ebb_tensor_t **grads);
/* The gradient accumulated into t by ebb_backward: *out a new reference, NULL when none. */
EBB_API ebb_status ebb_tensor_grad(const ebb_tensor_t *t, ebb_tensor_t **out);
/* Replaces t's .grad with `grad` (retained; t's shape, dtype and device, else EBB_EINVAL), or
 * clears it with NULL. The next backward adds into it in place. */
EBB_API ebb_status ebb_tensor_set_grad(ebb_tensor_t *t, const ebb_tensor_t *grad);

/* ---- hooks ----------------------------------------------------------------------------------
 * A tensor hook of t runs during a backward when t's gradient has been computed (summed over
 * every use of t), before it is used: for a leaf, before it is added into .grad; for a non-leaf,
 * before t's grad_fn runs. It may leave the gradient (*replace stays NULL) or replace it with a
 * tensor of its shape, dtype and device (*replace a new reference, which the engine takes; another
 * shape, dtype or device fails the backward with EBB_EINVAL naming the node). A post-accumulate
 * hook of a leaf runs after .grad was updated (ebb_tensor_grad gives the new value): an optimizer
 * step can run there. Several hooks of one kind run in registration order. A hook returning an
 * error fails the backward with that status, its message kept. Hooks run on the thread of the
 * backward with grad mode off; they must not register or remove hooks of the tensor being
 * processed. A hook stays registered as long as its tensor's graph (non-leaf) or the tensor
 * (leaf) lives, or until removed. EBB_EINVAL: NULL t or fn, a tensor that does not require a
 * gradient, a post-accumulate hook on a non-leaf. */
typedef ebb_status (*ebb_tensor_hook_fn)(const ebb_tensor_t *grad, ebb_tensor_t **replace, void *user);
typedef ebb_status (*ebb_post_accumulate_hook_fn)(const ebb_tensor_t *t, void *user);
typedef struct ebb_hook_handle {
  uint64_t id; /* 0: none */
} ebb_hook_handle;
EBB_API ebb_status ebb_tensor_register_hook(ebb_tensor_t *t, ebb_tensor_hook_fn fn, void *user, ebb_hook_handle *out);
EBB_API ebb_status ebb_tensor_register_post_accumulate_hook(ebb_tensor_t *t, ebb_post_accumulate_hook_fn fn, void *user,
                                                            ebb_hook_handle *out);
/* Makes a non-leaf keep its gradient in .grad (ebb_tensor_grad) at each backward, summed over
 * backward calls like a leaf's, seen after its other tensor hooks. A leaf: nothing to do; twice:
 * once. EBB_EINVAL for a tensor that does not require a gradient. */
EBB_API ebb_status ebb_tensor_retain_grad(ebb_tensor_t *t);
/* Removes a hook: it does not run again (a backward running on another thread may still call it
 * once). EBB_EINVAL for a handle removed already, one whose tensor's graph is gone, or one never
 * returned. */
EBB_API ebb_status ebb_hook_remove(ebb_hook_handle handle);

/* Nodes alive in the process, for leak checks in tests. */
EBB_API long ebb_autograd_live_nodes(void);

#ifdef __cplusplus
}
#endif

#endif /* EBB_AUTOGRAD_H */
