/* ebb/autograd.h: the autograd graph: grad mode, tensors that require gradients, and the nodes
 * that ops record as they run.
 *
 * The same ebb_op_* and tensor calls (ebb/ops.h, ebb/tensor.h) record the graph: when grad mode
 * is on and an input requires a gradient, each call that produces new values or a view creates
 * one node, named after its backward ("MulBackward", "TransposeBackward"), and its outputs
 * require gradients with that node as their grad_fn. The calls recorded:
 * - ops: ebb_op_add, ebb_op_sub, ebb_op_mul, ebb_op_div, ebb_op_add_scalar, ebb_op_sub_scalar,
 *   ebb_op_mul_scalar, ebb_op_div_scalar, ebb_op_pow_scalar, ebb_op_clamp, ebb_op_neg, ebb_op_abs,
 *   ebb_op_exp, ebb_op_log, ebb_op_sqrt, ebb_op_sin, ebb_op_cos, ebb_op_tanh, ebb_op_sigmoid,
 *   ebb_op_relu, ebb_op_gelu, ebb_op_where, ebb_op_sum, ebb_op_mean, ebb_op_amax, ebb_op_max_dim,
 *   ebb_op_matmul, ebb_op_linear, ebb_op_softmax, ebb_op_log_softmax, ebb_op_cross_entropy,
 *   ebb_op_mse_loss, ebb_op_layer_norm, ebb_op_cat, ebb_op_stack;
 * - views: ebb_tensor_view, ebb_tensor_reshape (a view or a copy), ebb_tensor_transpose,
 *   ebb_tensor_permute, ebb_tensor_slice, ebb_tensor_narrow, ebb_tensor_select,
 *   ebb_tensor_expand, ebb_tensor_squeeze, ebb_tensor_unsqueeze;
 * - copies: ebb_tensor_contiguous (when it copies), ebb_tensor_clone, ebb_tensor_to_dtype, and
 *   ebb_tensor_to_device ("ToDeviceBackward", which runs on the copy's device and sends the
 *   gradient back to the source's device);
 * - in place (below): ebb_op_add_, ebb_op_mul_, ebb_tensor_copy_, ebb_tensor_fill_,
 *   ebb_tensor_zero_, and the family of ops.h: ebb_op_add_scaled_, ebb_op_add_scalar_,
 *   ebb_op_mul_scalar_, ebb_op_lerp_, ebb_op_addcmul_, ebb_op_addcdiv_, ebb_op_sqrt_,
 *   ebb_op_zero_.
 * Not recorded: comparisons (bool results), creation calls, ebb_tensor_detach, and the gradient
 * helpers of ops.h (the ebb_op_*_backward functions, ebb_op_sum_to_shape).
 * A leaf (a tensor the user created and marked with ebb_tensor_set_requires_grad) gets an
 * "AccumulateGrad" node the first time an op uses it: created lazily, held by the nodes that use
 * the leaf (never by the leaf), so it goes with the graph. With no input requiring a gradient,
 * an op records nothing and costs a branch.
 *
 * In-place ops (ebb_op_add_, ebb_op_mul_, ebb_tensor_copy_, ebb_tensor_fill_, ebb_tensor_zero_
 * and the rest of the list above) are recorded too, with grad mode on, when dst requires a
 * gradient or one of its other inputs (src, end, t1, t2) does:
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
 * Status of this header: the graph is recorded and can be inspected; the engine runs a
 * backward on the calling thread or on per-device workers (see "the engine" below), stream-aware,
 * with tensor and post-accumulate hooks, retain_grad, node hooks and metadata, gradient edges,
 * multi-grad and logging hooks, saved-tensor hooks; in-place ops, views and inference mode as above. Not yet:
 * create_graph (a backward records nothing).
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
 * one element only. With `inputs` (ninputs > 0, tensors that require gradients) only their .grad
 * is written and only the nodes on a path to them run (partial backward, found by walking up from
 * the inputs: its cost grows with those nodes, not with the whole graph); an input the roots do
 * not depend on is left as it was. A non-leaf input gets the gradient that reached it (before its
 * tensor hooks; after them when it retains its gradient, whose hook then adds it, once) added into
 * its .grad, as a leaf would. Nodes run on the calling thread in decreasing sequence number,
 * AccumulateGrad first among the ready ones, the same order on every run. Without retain_graph
 * the saved tensors of every node that ran are released: a second backward through those nodes
 * fails with EBB_ESTATE (nodes that save nothing may run again).
 *
 * ebb_grad: the same walk, but the gradients with respect to `inputs` (leaves or not) are
 * returned in grads[0..ninputs) (new references) and no .grad is touched. An input the outputs do
 * not depend on is EBB_EINVAL, or with allow_unused gets grads[i] NULL.
 *
 * retain_graph and allow_unused are adjacent bools that a call can swap without a warning:
 * ebb_autograd_backward and ebb_autograd_grad (below) take them by name.
 *
 * Errors (a status and a message; the graph and the process carry on): EBB_EINVAL for no roots,
 * a root or input that does not require a gradient, a missing gradient for a root of more than
 * one element, a grad_roots entry of the wrong shape, dtype or device; EBB_EFREED for a released
 * tensor among the roots, their gradients or the inputs (naming the argument); EBB_ESTATE for a
 * saved tensor modified in place since it was saved (naming the node, which tensor, and both
 * versions) or freed by an earlier backward; a failing node's status with its name. On failure
 * nothing is returned in grads; .grad may hold the part of the gradient accumulated before the
 * failure.
 * Threading: backward calls on different threads may share leaves: each leaf's accumulation is
 * serialised, so sums are exact; sharing a graph's nodes between concurrent calls needs
 * retain_graph on all of them. */
EBB_API ebb_status ebb_backward(const ebb_tensor_t *const *roots, const ebb_tensor_t *const *grad_roots, int nroots,
                                bool retain_graph, const ebb_tensor_t *const *inputs, int ninputs);
/* The common case of a training step: ebb_backward from one scalar loss (gradient 1), without
 * retain_graph and into every leaf's .grad. Errors as ebb_backward's, with the loss named as
 * such: EBB_EINVAL for NULL, a loss that does not require a gradient or has more than one
 * element; EBB_EFREED for a released one; EBB_ESTATE for a second call through the same graph. */
EBB_API ebb_status ebb_backward_one(const ebb_tensor_t *loss);
EBB_API ebb_status ebb_grad(const ebb_tensor_t *const *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                            const ebb_tensor_t *const *inputs, int ninputs, bool retain_graph, bool allow_unused,
                            ebb_tensor_t **grads);

/* ebb_autograd_backward and ebb_autograd_grad: ebb_backward and ebb_grad with their optional
 * arguments in one options struct, so that a call site names each one
 * (`.retain_graph = true, .allow_unused = true`) rather than passing adjacent bools by position.
 * ebb_backward and ebb_grad are these calls with the options spelt out; everything said of them
 * holds here: what is computed and written, the streams the caller's current streams wait for,
 * threading, and the errors, with opts->grad_roots and opts->inputs (ebb_autograd_backward) or
 * opts->grad_outputs (ebb_autograd_grad) standing for the arguments of the same name. Messages
 * name ebb_autograd_backward or ebb_autograd_grad.
 * Defaults: a zero-initialised struct (`ebb_autograd_backward_options o = {0};`) gives them:
 * no gradients given (1 for each root of one element), no inputs (a full backward), retain_graph
 * and allow_unused false.
 * Versions: `version` is 0 or EBB_AUTOGRAD_OPTIONS_VERSION, both meaning the fields below. A later
 * header may add fields at the end of a struct and raise EBB_AUTOGRAD_OPTIONS_VERSION; a library
 * reads a field only when the caller's version has it, so code built against this header keeps
 * its meaning, and code that sets a newer version (to use a newer field) is refused by an older
 * library instead of having that field ignored.
 * Ownership: opts and the arrays it points to are borrowed for the call; grads[i] are new
 * references, as ebb_grad's.
 * Errors, besides ebb_backward's and ebb_grad's: EBB_EINVAL for NULL opts; EBB_ENOTSUP for a
 * version newer than this library reads (naming both); nothing runs and grads is not written. */
#define EBB_AUTOGRAD_OPTIONS_VERSION 1
typedef struct ebb_autograd_backward_options {
  uint32_t version;                      /* 0 or EBB_AUTOGRAD_OPTIONS_VERSION */
  bool retain_graph;                     /* keep the saved tensors: the graph may run again */
  const ebb_tensor_t *const *grad_roots; /* nroots gradients (NULL entries: 1), or NULL: all 1 */
  const ebb_tensor_t *const *inputs;     /* ninputs > 0: only their .grad, a partial backward */
  int ninputs;
} ebb_autograd_backward_options;
typedef struct ebb_autograd_grad_options {
  uint32_t version;                        /* 0 or EBB_AUTOGRAD_OPTIONS_VERSION */
  bool retain_graph;                       /* keep the saved tensors: the graph may run again */
  bool allow_unused;                       /* an input the outputs do not depend on: grads[i] NULL */
  const ebb_tensor_t *const *grad_outputs; /* noutputs gradients (NULL entries: 1), or NULL: all 1 */
} ebb_autograd_grad_options;
EBB_API ebb_status ebb_autograd_backward(const ebb_tensor_t *const *roots, int nroots, const ebb_autograd_backward_options *opts);
EBB_API ebb_status ebb_autograd_grad(const ebb_tensor_t *const *outputs, int noutputs, const ebb_tensor_t *const *inputs,
                                     int ninputs, ebb_tensor_t **grads, const ebb_autograd_grad_options *opts);

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
 * backward calls like a leaf's, seen after its other tensor hooks. Streams as for a leaf's .grad
 * ("the engine: devices, streams, threads"): written on the stream of the node that made the
 * tensor, which the caller's current streams wait for when the backward returns; a later backward
 * on another stream sums into it after that write. A leaf: nothing to do; twice: once.
 * EBB_EINVAL for a tensor that does not require a gradient. */
EBB_API ebb_status ebb_tensor_retain_grad(ebb_tensor_t *t);
/* Removes a hook (tensor, post-accumulate or node hook), or every hook of a multi-grad or logging
 * handle: it does not run again (a backward running on another thread may still call it once).
 * EBB_EINVAL for a handle removed already, one whose tensor's graph or node is gone, or one never
 * returned. */
EBB_API ebb_status ebb_hook_remove(ebb_hook_handle handle);

/* ---- the Node API: input metadata, user metadata, node hooks ----------------------------------
 * Words: a node's *inputs* are the gradients it receives in backward, one per output of its
 * forward op (PyTorch's numbering: MulBackward has 1 input, max_dim's node 2); its *outputs* are
 * the gradients it returns, one per input of its forward op (its next edges). An AccumulateGrad
 * has one input (its leaf's gradient) and no outputs.
 *
 * Functions taking `const ebb_node_t *` accept the borrowed handles ebb_tensor_grad_fn and
 * ebb_node_next give; hooks and metadata are side tables of the node, not part of what const
 * protects. EBB_EINVAL for a NULL node, EBB_EFREED for one that is not a live node (detected in
 * most cases: a pointer to freed memory cannot always be told apart). */

/* What a node knows of input i (forward output i) when it was recorded: shape, dtype, device
 * and the forward stream, the id (ebb_stream_id) of the calling thread's current stream on that
 * device when the op ran (for an AccumulateGrad: when it was made); 0 for a CPU tensor. */
typedef struct ebb_node_input_info {
  int device;
  ebb_dtype dtype;
  int ndim;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  uint64_t stream_id;
} ebb_node_input_info;
EBB_API ebb_status ebb_node_num_inputs(const ebb_node_t *node, int *out);
/* EBB_EINVAL for i out of [0, ebb_node_num_inputs) or NULL out. */
EBB_API ebb_status ebb_node_input_meta(const ebb_node_t *node, int i, ebb_node_input_info *out);

/* User metadata: key (a NUL-terminated string, copied) -> value, kept as long as the node lives.
 * set: replaces the value of an existing key (the old value's destructor runs, with the old
 * value, before set returns); the node takes `destroy` (may be NULL), called once with `value`
 * when the key is overwritten or removed, or when the node is freed (on the thread that drops
 * its last reference). get: EBB_ENOTFOUND (naming the key) when the key is absent, *value left
 * alone. remove: runs the destructor; EBB_ENOTFOUND when absent. Thread-safe: calls on one node
 * from several threads are serialised; destructors run with no ebb lock held and may call ebb,
 * but not the metadata calls of the node being freed. */
typedef void (*ebb_node_metadata_destroy_fn)(void *value);
EBB_API ebb_status ebb_node_metadata_set(const ebb_node_t *node, const char *key, void *value, ebb_node_metadata_destroy_fn destroy);
EBB_API ebb_status ebb_node_metadata_get(const ebb_node_t *node, const char *key, void **value);
EBB_API ebb_status ebb_node_metadata_remove(const ebb_node_t *node, const char *key);

/* Node hooks. A pre-hook runs when the node is about to execute (never for a node the backward
 * does not run: outside a partial backward's path, or an AccumulateGrad of ebb_grad), after the
 * tensor hooks and retain_grad of its inputs, with the node's input gradients (grads[k] NULL for
 * an input no gradient reached). It may replace gradient k by setting replace[k] (all NULL on
 * entry) to a new reference, which the engine takes; the node then runs with it. A post-hook runs
 * after the node's backward (for an AccumulateGrad: after .grad was updated and its
 * post-accumulate hooks), with the gradients it returned (grad_inputs[i], one per next edge, NULL
 * where none was computed: an input that needs none) and the input gradients it ran with
 * (grad_outputs, after the pre-hooks); it may replace grad_inputs[i] through replace[i] before
 * they are passed on. Order around a node (NOTE [Hooks ordering]): tensor hooks, retain_grad,
 * pre-hooks, the node, post-hooks; for an AccumulateGrad: the leaf's tensor hooks, pre-hooks,
 * .grad updated, post-accumulate hooks, post-hooks. Hooks of one kind run in registration order.
 * A replacement must have the shape, dtype and device of what it replaces (input metadata for
 * pre-hooks, the forward input's for post-hooks); otherwise, or when a pre-hook gives a
 * gradient for an input that got none (hooks replace gradients, they do not create them; a
 * post-hook may give one for an input without one), the backward fails with EBB_EINVAL naming
 * the hook, the node and both shapes. A hook returning an error fails the backward with its
 * status, message kept. Hooks run on the backward's thread with grad mode off; a hook may remove
 * itself or another hook (removal during a backward is honoured from the next hook on), and must
 * not register hooks on a node of a backward running. Handles: ebb_hook_remove; a hook goes with
 * its node. EBB_EINVAL: NULL node, fn or out. */
typedef ebb_status (*ebb_node_pre_hook_fn)(const ebb_node_t *node, const ebb_tensor_t *const *grads, int ngrads,
                                           ebb_tensor_t **replace, void *user);
typedef ebb_status (*ebb_node_post_hook_fn)(const ebb_node_t *node, const ebb_tensor_t *const *grad_inputs, int ninputs,
                                            const ebb_tensor_t *const *grad_outputs, int noutputs, ebb_tensor_t **replace,
                                            void *user);
EBB_API ebb_status ebb_node_register_pre_hook(const ebb_node_t *node, ebb_node_pre_hook_fn fn, void *user, ebb_hook_handle *out);
EBB_API ebb_status ebb_node_register_post_hook(const ebb_node_t *node, ebb_node_post_hook_fn fn, void *user, ebb_hook_handle *out);

/* ---- gradient edges -------------------------------------------------------------------------
 * A gradient edge names where a tensor's gradient enters the graph: (its grad_fn, its output
 * index), or for a leaf its AccumulateGrad (made if needed) and 0. The edge holds a reference on
 * the node: the node (and the graph below it) lives until ebb_gradient_edge_release, whatever
 * happens to the tensor (released, or given new history later): the edge keeps naming the node
 * it was taken from. EBB_EINVAL: NULL t or out, a tensor that does not require a gradient.
 * Release: sets e->node NULL; EBB_EINVAL for NULL e or an edge released already (node NULL).
 * Thread-safe; an edge itself is a value, the caller's to share. */
typedef struct ebb_gradient_edge {
  const ebb_node_t *node;
  int output_nr;
} ebb_gradient_edge;
EBB_API ebb_status ebb_tensor_gradient_edge(const ebb_tensor_t *t, ebb_gradient_edge *out);
EBB_API ebb_status ebb_gradient_edge_release(ebb_gradient_edge *e);
/* ebb_backward and ebb_grad with gradient edges for roots and inputs (the edges are borrowed).
 * A root edge's gradient is checked against the node's input metadata (ebb_node_input_meta;
 * NULL means 1 for one element). An input edge to an AccumulateGrad is its leaf, whose .grad
 * ebb_backward_edges fills. An input edge to any other node is EBB_ENOTSUP there: the edge
 * names a node's output, not a tensor, so there is no .grad to add its gradient into (pass the
 * tensor itself to ebb_backward, which fills a non-leaf's .grad, or take the gradient from
 * ebb_grad_edges). Otherwise as ebb_backward and ebb_grad; additional EBB_EINVAL for an edge
 * with a NULL node or an output_nr out of the node's inputs. */
EBB_API ebb_status ebb_backward_edges(const ebb_gradient_edge *roots, const ebb_tensor_t *const *grad_roots, int nroots,
                                      bool retain_graph, const ebb_gradient_edge *inputs, int ninputs);
EBB_API ebb_status ebb_grad_edges(const ebb_gradient_edge *outputs, const ebb_tensor_t *const *grad_outputs, int noutputs,
                                  const ebb_gradient_edge *inputs, int ninputs, bool retain_graph, bool allow_unused,
                                  ebb_tensor_t **grads);

/* ---- the running backward -------------------------------------------------------------------
 * The node being evaluated on the calling thread (from its tensor hooks to its post-hooks): *out
 * NULL outside a backward. Borrowed: valid while it runs. */
EBB_API ebb_status ebb_autograd_current_node(const ebb_node_t **out);
/* The id of the backward (ebb_backward, ebb_grad, their _edges and options forms) running on
 * the calling thread: ids increase by exactly 1 per call, process-wide, from 0; -1 outside a
 * backward. In a backward started from a hook (reentrant), the inner call's id. */
EBB_API int64_t ebb_autograd_current_task_id(void);
/* Whether the backward running on the calling thread will execute `node` (or, for ebb_grad,
 * reach it for an input's gradient): false for a node outside its graph or, in a partial
 * backward, off every path to its inputs. A node that already ran still answers true. EBB_ESTATE
 * outside a backward; EBB_EINVAL for NULL node or out. */
EBB_API ebb_status ebb_autograd_will_execute(const ebb_node_t *node, bool *out);

/* Bumps the version counter of each tensor (ebb_tensor_bump_version): for changes made where
 * autograd cannot see them (a kernel of your own through ebb_tensor_data), so a saved copy of the
 * tensor fails the backward that needs it (EBB_ESTATE naming the node and both versions) instead
 * of giving a wrong gradient. Bumping twice is harmless. EBB_EINVAL for NULL tensors with n > 0
 * or a NULL entry, EBB_EFREED for a released one; on error no counter was bumped. */
EBB_API ebb_status ebb_autograd_increment_version(ebb_tensor_t *const *tensors, int n);

/* ---- multi-grad hooks -------------------------------------------------------------------------
 * One callback over n tensors, per backward call (graph task): with EBB_MULTI_GRAD_ALL, once the
 * gradients of all those tensors that the backward will compute are known (tensors outside its
 * graph, or off the path of a partial backward, are not waited for), with grads[i] each tensor's
 * gradient (after its earlier tensor hooks) or NULL where none was computed; with
 * EBB_MULTI_GRAD_ANY, once, at the first of them, grads[i] set for that one only. ngrads is n.
 * State is kept per backward call: concurrent backward calls on other threads fire separately. A
 * backward that fails before "all" is complete does not fire it; one that succeeds fires an
 * incomplete "all" (a gradient the engine found absent) at its end. The callback runs on the
 * backward's thread as a tensor hook (in registration order among the tensors' hooks); an error
 * from it fails the backward. Tensors that do not require a gradient are accepted and get NULL.
 * The registration holds the tensors' nodes (grad_fn, or a leaf's AccumulateGrad) until the handle
 * is removed: remove it (ebb_hook_remove removes all n hooks at once) to free them.
 * EBB_EINVAL: NULL tensors, fn or out, n <= 0, a NULL tensor, a mode outside the enum (named);
 * EBB_EFREED: a released tensor (naming it); on error nothing is registered. */
typedef enum ebb_multi_grad_mode { EBB_MULTI_GRAD_ALL = 0, EBB_MULTI_GRAD_ANY = 1 } ebb_multi_grad_mode;
typedef ebb_status (*ebb_multi_grad_fn)(const ebb_tensor_t *const *grads, int ngrads, void *user);
EBB_API ebb_status ebb_register_multi_grad_hook(ebb_tensor_t *const *tensors, int n, ebb_multi_grad_fn fn, void *user,
                                                ebb_multi_grad_mode mode, ebb_hook_handle *out);

/* ---- whole-graph logging -----------------------------------------------------------------------
 * Registers on every node reachable from the roots (their grad_fn, or a leaf's AccumulateGrad) a
 * pre-hook that gives `sink` one line per node executed, before it runs:
 *   "Executing: MulBackward (node 12) with grad_outputs: [f32[2, 3], None]"
 * (the node's name and sequence number, "AccumulateGrad" without one; each input gradient as
 * dtype[shape], None where absent). With sink NULL the lines go to the warning handler
 * (ebb_set_warning_handler), prefixed "autograd: ". Nodes recorded after the call are not
 * covered. One handle (ebb_hook_remove) unregisters all; until then it holds the AccumulateGrad
 * nodes it made for leaf roots (so a leaf root's line comes at every backward). The sink runs on the backward's
 * thread; it must not call ebb. EBB_EINVAL: NULL roots or out, nroots <= 0, a root that does
 * not require a gradient. */
typedef void (*ebb_autograd_log_fn)(const char *line, void *user);
EBB_API ebb_status ebb_autograd_register_logging_hooks(const ebb_tensor_t *const *roots, int nroots, ebb_autograd_log_fn sink,
                                                       void *user, ebb_hook_handle *out);

/* ---- saved tensors and saved-tensor hooks ------------------------------------------------------
 * A node keeps what its backward reads (MulBackward its inputs, ExpBackward its output): by
 * default the data itself, through a handle of its own on the tensor's storage without the
 * tensor's autograd state (so a node that keeps its own output makes no reference cycle), with
 * the storage's version at that moment. A backward that finds the version moved on (an in-place
 * op changed the tensor, or a view of its storage, after the node saved it) fails with
 * EBB_ESTATE, naming the node (name and sequence number), which input or output it is, the
 * tensor (its name, else dtype, shape and device) and both versions. A backward without
 * retain_graph releases the saved tensors of the nodes it ran; a second backward through them
 * fails with EBB_ESTATE naming the node and retain_graph. Saving an inference tensor fails the
 * op (EBB_EINVAL).
 *
 * Saved-tensor hooks change what is kept. Each thread has a stack of hook pairs; while it is not
 * empty, every tensor a node saves on that thread goes through the pair on top (only that one:
 * the innermost wins), which stays bound to the saved tensor whatever is pushed or popped later:
 * - pack(user, t, &packed) runs once, when the op records its node, with grad mode off, on the
 *   thread of the op. t is borrowed for the call: a handle on the saved tensor's data without its
 *   autograd state; pack may retain it (ebb_tensor_retain) or copy it, and must not change it in
 *   place. The packed value is opaque to ebb; the original tensor is not kept.
 * - unpack(user, packed, &out) runs each time a backward needs the tensor (so once per backward
 *   through the node, retain_graph included), on the thread that runs the node (the caller's or
 *   a device worker), with the node's stream current. *out: a new reference, which the engine
 *   takes (it releases it once the node ran); it must have the saved tensor's shape, dtype and
 *   device, any strides. The engine reads it through a handle of its own, so the tensor may be
 *   one the hooks keep (the identity pair: pack retains t, unpack retains it again).
 * - free_packed(user, packed) (may be NULL) runs once per packed value, when the node releases
 *   it: after a backward without retain_graph went through the node, or when the node goes (its
 *   graph released, backward or not); on whichever thread does that, possibly while another
 *   thread's backward still unpacks it for the last time (then after that unpack).
 * user is passed to all three and must stay valid until the last packed value made under the
 * pair is freed. The hooks may call any ebb function; a failure of theirs stays the hook's own
 * (that thread's ebb_last_error and error hook) until the hook returns it.
 * Errors: a pack hook's failure fails the op that saves (its status; the message names the node,
 * the saved input or output and what the hook said); so does a pack hook that changes its
 * input in place (EBB_EINVAL; its packed value is freed). An unpack hook's failure fails the
 * backward (its status), as does one returning NULL or a tensor of another shape, dtype or device
 * (EBB_EINVAL; the message names what was expected and what came back). Versions are not checked
 * for a packed tensor: what the hooks kept is what the backward reads.
 *
 * Threading: the stack is per thread. A backward carries its caller's stack to every thread that
 * runs its nodes (device workers, a pool thread), for its duration, so a tensor saved during the
 * backward (a hook that turns grad mode on) sees the caller's hooks. A hook running in a backward
 * may push and pop its own pairs; what it leaves pushed is dropped when its node (on a worker) or
 * the backward (on the caller) ends; it cannot pop what was on the stack when the backward began.
 * A thread of yours must pop what it pushed (and enable what it disabled) before it ends: the
 * entries of a thread that ends with some left are not freed (a few dozen bytes each).
 *
 * Disabling: ebb_saved_tensors_hooks_disable(message) forbids pushing hooks on this thread until
 * the matching ebb_saved_tensors_hooks_enable; a push meanwhile fails with EBB_ESTATE and the
 * message. Disable scopes nest: each enable ends the innermost one and brings back the message of
 * the one around it. */
typedef ebb_status (*ebb_saved_pack_fn)(void *user, const ebb_tensor_t *t, void **packed);
typedef ebb_status (*ebb_saved_unpack_fn)(void *user, void *packed, ebb_tensor_t **out);
typedef void (*ebb_saved_free_fn)(void *user, void *packed);
typedef struct ebb_saved_hooks {
  ebb_saved_pack_fn pack;        /* required */
  ebb_saved_unpack_fn unpack;    /* required */
  ebb_saved_free_fn free_packed; /* NULL: packed values need no freeing */
  void *user;
} ebb_saved_hooks;
/* Pushes a copy of *h on this thread's stack. EBB_EINVAL for NULL h, pack or unpack; EBB_ESTATE
 * while disabled (the message is the disable's); EBB_ENOMEM. */
EBB_API ebb_status ebb_saved_tensors_hooks_push(const ebb_saved_hooks *h);
/* Pops the pair on top (saved tensors it packed keep it). EBB_ESTATE when this thread has none
 * to pop (none pushed, or, inside a backward's hook, only those there before the backward began). */
EBB_API ebb_status ebb_saved_tensors_hooks_pop(void);
/* Packs node's saved tensor `index` through h now, as if h had been on top of the stack when the
 * node saved it (PyTorch's grad_fn._raw_saved_x.register_hooks): pack runs at once on the calling
 * thread, the node lets go of the tensor's data (it keeps what pack made), and every later
 * backward through the node unpacks it through h; free_packed runs as for any packed value. A
 * node's saved tensors are numbered as its forward's tensors: inputs 0..nin-1 (nin:
 * ebb_node_num_next), then outputs nin, nin+1, ... (ExpBackward saves its output as index 1,
 * MulBackward its inputs as 0 and 1). Thread-safe against backward calls through the node and
 * other calls on it (the node's saved tensors are changed under the engine's lock of the node;
 * pack runs without it: of two calls racing on one index, one fails as below).
 * Errors (nothing changes): EBB_EINVAL for NULL node or h, NULL h->pack or h->unpack, an index out
 * of range or one the node does not save (the message lists those it does); EBB_EFREED for a node
 * that is not live; EBB_ESTATE for a tensor already packed (hooks on the stack when it was saved,
 * or an earlier call: one pair per saved tensor), one saved inside an allow-mutation scope (the
 * scope manages it), or one freed by a backward without retain_graph; a failure of pack as when
 * saving (its status; a pack that changes its input in place: EBB_EINVAL); EBB_ENOMEM. */
EBB_API ebb_status ebb_node_saved_register_hooks(const ebb_node_t *node, int index, const ebb_saved_hooks *h);
/* Starts a disable scope with `message` (copied; the message of a later push's failure).
 * EBB_EINVAL for NULL message; EBB_ESTATE, with the message, when hooks are on this thread's
 * stack (nothing changes); EBB_ENOMEM. */
EBB_API ebb_status ebb_saved_tensors_hooks_disable(const char *message);
/* Ends the innermost disable scope. EBB_ESTATE when none is open on this thread. */
EBB_API ebb_status ebb_saved_tensors_hooks_enable(void);
/* Whether pushing is allowed on this thread (no disable scope open). */
EBB_API bool ebb_saved_tensors_hooks_is_enabled(void);
/* The innermost disable scope's message (owned by ebb, valid until that scope ends), or NULL. */
EBB_API const char *ebb_saved_tensors_hooks_disabled_message(void);

/* ---- offloaded saved tensors -------------------------------------------------------------------
 * An offload scope moves the device tensors that nodes save to pinned host memory during the
 * forward and brings them back during the backward, ahead of the nodes that read them, so the
 * activations of a deep model need not all stay on the device between forward and backward.
 *
 * ebb_offload_scope_enter(policy) pushes an offload entry on this thread's saved-tensor hook
 * stack (above): while it is the innermost entry, every tensor a node saves on this thread is
 * offered to it (a pair of hooks pushed later wins, as hooks do; an offload scope pushed inside
 * hooks wins over them). ebb_offload_scope_exit pops it. What it saved stays offloaded after the
 * exit: the backward may run anywhere later, on any thread, any number of times (retain_graph).
 *
 * Saving (the op's thread, never waiting for the device): a tensor stays as an ordinary saved
 * tensor when it is on the CPU, smaller than min_bytes (its storage's bytes), a leaf that requires
 * a gradient (a parameter) unless offload_params, or when the pinned budget cannot take it (counted
 * in kept_pinned_budget, not an error). Otherwise its whole storage is copied to the pinned pool
 * (NUMA-local to its device, ebb_pinned_alloc) on the device's offload stream (one per device,
 * ordered after the work issued so far on the device's current stream, which made it). Views of
 * one storage saved while the scope is open share one copy, and so do two saves of the same
 * storage at the same version. The device storage of the two newest copies on a device stays
 * (the backward needs them first, and reads them there); an older one is let go: its allocation
 * stream waits for the copy on the device (never the host) and the block goes back to the arena
 * when nothing else holds it, reused in that stream's order, so a host running ahead of the
 * device does not grow the arena by the blocks of copies still in flight. The device block's free, the pinned block (owned by EBB_OWNER_SAVED under the saving
 * node's name) and the reloaded block (the same owner) appear in the memory history.
 *
 * Device budget (device_budget_bytes > 0): at most that many bytes of the scope's saved device
 * tensors stay resident per device, counting the ones being copied out and, in backward, the ones
 * brought back. The device storage of a saved tensor stays as long as the budget holds it; while
 * the total is over, the oldest are let go (the backward needs the newest first, and reads them
 * in place), each after its copy to pinned memory (their streams wait for the copies on the
 * device: counted in forward_waits when that stalls). So that those copies run from the start of
 * the forward, the first budgeted forward on a device copies out every saved tensor at its save;
 * later ones copy at its save each tensor that will have to leave if the forward saves the most
 * a budgeted forward there saved (two tensors of slack), and the rest only if the budget
 * needs their room after all. Only what must leave the device leaves (device_bytes_saved).
 *
 * Backward: the engine knows, when a backward starts, every node it will run on each device and
 * their order (by sequence number). It brings back the offloaded tensors of those nodes in that
 * order on the device's reload stream, keeping at most prefetch_window_bytes brought back ahead
 * of the node now running (and within the device budget), from the first backward on: no warm-up
 * step, no schedule to write. A node's stream waits for its tensors' reload events on the device
 * (the host never waits); a tensor not brought back yet when its node runs is reloaded then
 * (counted in bytes_reloaded_on_demand). The reloaded copy goes when the last node of the backward
 * reading it has run (the pinned copy stays while a node holds the saved tensor: retain_graph).
 * Versions: an in-place change to an offloaded storage after the save (through any tensor or view
 * of it) fails the backward with EBB_ESTATE as for any saved tensor, and the write is ordered
 * after the copy out (its stream waits for it on the device). A tensor saved inside an
 * allow-mutation scope (below) instead survives such a write: the pinned copy is the saved value
 * (made at the write if a budget had kept it uncopied), the device original goes, and the
 * backward reloads it; it needs no clone, and its backward may run after that scope exited.
 * While offloaded tensors live, every in-place op pays a lookup for this.
 *
 * Policy fields (all zero: the defaults):
 *   min_bytes              storages smaller than this stay; 0: 1 MiB
 *   pinned_budget_bytes    pinned bytes the scope's copies may hold at once; 0: no cap
 *   device_budget_bytes    per device, as above; 0: every eligible tensor leaves the device
 *   prefetch_window_bytes  bytes brought back ahead of the running node; 0: 256 MiB
 *   offload_params         offload leaves that require gradients too (default: they stay)
 *   poison                 debug: a device block let go after its copy is filled with NaN (0xFF
 *                          bytes) first, so a kernel that reads it before a reload lands sees it
 * Errors of enter: EBB_EINVAL for NULL policy, a negative field, a window below min_bytes (no
 * offloaded tensor would fit it), EBB_ENOTSUP for a newer version; EBB_ESTATE while saved-tensor
 * hooks are disabled (the message is the disable's); EBB_ENOMEM. Errors of a save in the scope
 * (the op fails, naming the node and the tensor): EBB_EINVAL for a storage larger than the window
 * or than the device budget; the pinned pool's or the copy's failure. exit: EBB_ESTATE when the
 * innermost entry of this thread's stack is not an offload scope.
 * Threading: as the hook stack. */
#define EBB_OFFLOAD_POLICY_VERSION 1
typedef struct ebb_offload_policy {
  uint32_t version; /* 0 or EBB_OFFLOAD_POLICY_VERSION */
  int64_t min_bytes;
  int64_t pinned_budget_bytes;
  int64_t device_budget_bytes;
  int64_t prefetch_window_bytes;
  bool offload_params;
  bool poison;
} ebb_offload_policy;
EBB_API ebb_status ebb_offload_scope_enter(const ebb_offload_policy *policy);
EBB_API ebb_status ebb_offload_scope_exit(void);

/* Counters since the first ebb_init (they restart after the last ebb_shutdown, unless offloaded
 * tensors outlive it) or the last reset, summed over devices and scopes. A stall
 * is a node stream that reached a saved tensor before its reload landed; its wait is measured on
 * the device (two timing events) and counted once both have completed. */
typedef struct ebb_offload_stats {
  uint64_t tensors_offloaded;        /* storages copied out */
  uint64_t bytes_offloaded;
  uint64_t bytes_prefetched;         /* reloads the engine started ahead of the node reading them */
  uint64_t bytes_reloaded_on_demand; /* reloads started by the node reading them */
  uint64_t stalls, stall_ns;         /* node streams that waited for a reload, and their total wait */
  uint64_t forward_waits, forward_wait_ns; /* streams that waited for a copy out before reusing its block */
  uint64_t pinned_bytes, pinned_peak_bytes;             /* pinned bytes the copies hold */
  uint64_t device_bytes_saved, device_bytes_saved_peak; /* saved device bytes not resident now */
  uint64_t kept_small, kept_cpu, kept_params, kept_pinned_budget; /* saves that stayed, by reason */
  uint64_t deduplicated;             /* saves that shared an earlier save's copy */
} ebb_offload_stats;
/* EBB_EINVAL for NULL out. */
EBB_API ebb_status ebb_offload_get_stats(ebb_offload_stats *out);
/* Zeroes the counters and sets each peak to its current value. */
EBB_API void ebb_offload_reset_stats(void);

/* ---- allow mutation on saved tensors -------------------------------------------------------------
 * PyTorch's torch.autograd.graph.allow_mutation_on_saved_tensors: inside the scope, a tensor a
 * node saved may be changed in place before that node's backward runs, and the backward reads it
 * as it was when saved (without the scope, the backward fails its version check instead).
 *
 * ebb_allow_mutation_on_saved_enter opens the scope on the calling thread; _exit closes it. Each
 * tensor a node saves on this thread while it is open, as an ordinary saved tensor (not one
 * packed by saved-tensor hooks), is registered by its storage. An in-place op (ebb_op_add_,
 * ebb_op_mul_, ebb_tensor_copy_, ebb_tensor_fill_, ebb_tensor_zero_, the family of ops.h's
 * ebb_op_add_scaled_), on any thread, that writes
 * a registered storage, through the saved tensor, its base or any view of it, with or without
 * autograd state and in any grad mode, first copies that whole storage (one copy on its device,
 * queued on the writer's current stream, which the nodes' forward streams wait for) and gives
 * each node that saved a part of it a handle on the copy instead: nodes that saved views of one
 * storage share one copy, owned by them (EBB_OWNER_SAVED under the first one's name in the
 * allocator's owners) and freed with them. Only writes after the save are protected: the copy is
 * of the storage as the write finds it, and a saved tensor changed without such a write (e.g.
 * ebb_tensor_bump_version) still fails its version check. A tensor saved again after a write is
 * registered again, and the next write copies it again.
 *
 * The backward of such a node must run while the scope that recorded it is open (on any
 * thread): exiting the scope frees what it kept (the saved tensors it registered, copied or
 * not, and its records), and a later backward through one of its nodes fails with EBB_ESTATE, the
 * message naming the node, the saved tensor and the scope. Those nodes are released as usual
 * (their graph's tensors released), with or without a backward.
 *
 * Cost: while any scope is open in the process, every in-place op takes one process-wide lock
 * and looks its storage up; each registered save takes the lock once. With no scope open, an
 * in-place op on a tensor without autograd state pays one more load and branch.
 *
 * Errors: enter: EBB_ESTATE when a scope is already open on this thread (nesting is an error);
 * EBB_ENOMEM. exit: EBB_ESTATE when none is open on this thread. A save in the scope may fail
 * with EBB_ENOMEM (the op fails); a write whose copy cannot be made fails before it changes
 * anything (the copy's status, EBB_ENOMEM for a full device; the message names the node and
 * the saved tensor).
 * Threading: the scope is per thread; a thread must exit the scope it entered before it ends
 * (otherwise what it kept is never freed). Writes from other threads to registered storages are
 * copied too; a write racing with the backward that reads the same tensor is the caller's race,
 * as without the scope. */
EBB_API ebb_status ebb_allow_mutation_on_saved_enter(void);
EBB_API ebb_status ebb_allow_mutation_on_saved_exit(void);

/* ---- the engine: devices, streams, threads -------------------------------------------------
 * Where nodes run. Each node belongs to a device: the device of its forward outputs (for an
 * AccumulateGrad, its leaf's), or the CPU. A backward whose nodes are all on the CPU or on one
 * device runs on the calling thread, with no hand-off. A backward over several devices gives each
 * device's nodes to that device's worker thread (one per device, started at the first such
 * backward, bound to the device's NUMA node through hwloc, joined by the last ebb_shutdown), and
 * the CPU nodes to the calling thread, which waits for the whole task. Each queue runs its ready
 * nodes by reentrant depth (deeper first: a backward started inside a node's hook finishes before
 * its outer one goes on) then sequence number (larger first; AccumulateGrad first of all), so a
 * device's order is the same on every run. Waits spin briefly, then park: a warm engine makes no
 * system call per node on the calling thread's path, and a busy worker none either.
 *
 * Streams (PyTorch's rules): a node's backward runs on its forward stream (ebb_node_input_meta's
 * stream_id: the current stream of its device when its op ran, or when an AccumulateGrad was
 * made); a node recorded on a stream since released (or whose release was asked), or with none,
 * runs on the caller's current stream of its device, which first waits for the work issued to
 * that stream (the forward's, which made what the node reads). A backward holds the streams its
 * nodes run on and the caller's current streams from its start to its return: releasing one
 * meanwhile (from a hook, or another thread) returns at once and is carried out when the last
 * backward holding it returns (ebb/stream.h, ebb_stream_release), so no step of a backward fails
 * for a stream's release, and the holding costs one atomic pair per stream a backward uses, none
 * per node. A gradient produced on one stream and consumed on another is handed over
 * with one event (none when the streams agree); several producers into one input are summed on
 * the consumer's stream when the gradient is on the consumer's device, else on the first
 * producer's, else on the caller's current stream of the gradient's device, with at most one event
 * per producer and one to the consumer. The roots' gradients count as produced on the caller's
 * current streams. When ebb_backward returns, the caller's current stream of every device waits
 * (on the device, not the host) for every stream that accumulated a .grad (a leaf's, or a
 * non-leaf's through retain_grad, written on the stream of the node that made the tensor) or
 * captured an ebb_grad result, so work issued next on those streams sees the gradients; other
 * streams must wait on them (ebb_stream_wait_stream). A backward that adds into a .grad last
 * written by a backward on another stream (an accumulator that followed its producer, or was made
 * again on another stream, a retained non-leaf whose node's forward stream was released since,
 * or another thread's backward) first makes its stream wait for that one; a .grad set with
 * ebb_tensor_set_grad is the caller's to order. Hooks run with the node's stream current;
 * a change a hook makes to its thread's grad or inference mode lasts until its node ends.
 *
 * Reentrant backward: a backward started inside a hook (or a node) runs on that thread, serving
 * its queue meanwhile, up to a depth of ebb_autograd_max_reentrant_depth (default 60) nested
 * calls per thread; deeper, the inner backward moves to a pool thread and the calling thread
 * waits for it (its stack does not grow further). Errors: the first failing node ends the task on
 * every device: nodes not started are skipped, the caller gets that node's status and a message
 * naming it and its device; a failure of ebb_backward (or ebb_backward_edges) once its nodes
 * started ends by saying which .grad fields it had written before it failed ("no .grad was
 * changed", or the written tensors' names or roles with dtype and shape), so a caller knows
 * whether a retry would add those gradients twice. A failed backward is one failure, wherever its node ran: its message
 * is the calling thread's ebb_last_error and the error hook (ebb_set_error_hook) is called once,
 * on the calling thread; the engine's own steps leave a device worker's or pool thread's last
 * error alone, and a backward that succeeds leaves the caller's alone. Calls a hook makes are the
 * hook's own: one that fails is reported on the thread the hook ran on (a worker's, maybe) as
 * any failing call, and when the hook then fails the backward its message is kept in the
 * backward's.
 *
 * Threading of the settings below: each is process-wide, read at the start of a backward; set
 * them between training steps. */

/* EBB_ENGINE_AUTO (default): the calling thread for backward calls confined to one device, the
 * device workers otherwise. EBB_ENGINE_WORKERS: device nodes always go to their device's worker,
 * even when there is only one device (to compare the two paths). EBB_ENGINE_CALLING_THREAD:
 * everything on the calling thread, over any number of devices (streams and events as above).
 * ebb_autograd_set_engine_mode: EBB_EINVAL for a value outside the enum (named), mode unchanged. */
typedef enum ebb_engine_mode { EBB_ENGINE_AUTO = 0, EBB_ENGINE_WORKERS = 1, EBB_ENGINE_CALLING_THREAD = 2 } ebb_engine_mode;
EBB_API ebb_status ebb_autograd_set_engine_mode(ebb_engine_mode mode);
EBB_API ebb_engine_mode ebb_autograd_engine_mode(void);

/* Nested backward calls a thread runs itself before it hands the next one to a pool thread
 * (1..1024; EBB_EINVAL outside, depth unchanged). */
EBB_API ebb_status ebb_autograd_set_max_reentrant_depth(int depth);
EBB_API int ebb_autograd_max_reentrant_depth(void);

/* The AccumulateGrad stream mismatch. A leaf's AccumulateGrad runs on the stream that was current
 * when it was made, and lives as long as a graph or a gradient edge holds it. Made during a
 * warm-up on a side stream and kept alive (a retained loss, a stashed gradient edge), it keeps
 * that stream after the user moved on: each backward then makes its stream wait for the stream
 * the gradient was produced on. Correct, but an extra dependency every step (and in CUDA-graph
 * capture, a stream outside the capture). When a gradient reaches an AccumulateGrad whose stream
 * differs from the producer's, the engine counts it (ebb_autograd_engine_stats) and, with the
 * warning on (the default), calls the warning handler (ebb_set_warning_handler; on the thread
 * that runs the AccumulateGrad, a device worker included) once per leaf and pair of streams,
 * naming the leaf (its name, else shape and dtype), both streams, the producing node, and what
 * keeps the accumulator alive (nodes of earlier graphs, gradient-edge handles). It never fires
 * (nor counts) when the streams agree, for CPU gradients, or for a producer on another device
 * than the leaf (a leaf used on another device through ebb_tensor_to_device): a gradient that
 * crosses devices needs that hand-off whatever stream the accumulator has, and it is counted
 * among cross_stream_edges like any other.
 * With follow-producer on (off by default), an accumulator whose stream differs takes the
 * producer's stream instead, for this backward and the next ones (ebb_node_input_meta reports
 * it): the gradient is added on the stream that produced it, with no cross-stream wait, and no
 * warning. Only for a producer on the leaf's device; the first producer of a backward wins. */
EBB_API void ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(bool enabled);
EBB_API bool ebb_autograd_warn_on_accumulate_grad_stream_mismatch(void);
EBB_API void ebb_autograd_set_accumulate_grad_follows_producer(bool enabled);
EBB_API bool ebb_autograd_accumulate_grad_follows_producer(void);

/* Counters since the first ebb_init (they restart after the last ebb_shutdown), summed over
 * every backward and thread. */
typedef struct ebb_autograd_engine_stats {
  uint64_t backward_calls;        /* ebb_backward, ebb_grad, their _edges and options forms */
  uint64_t nodes_run;             /* nodes whose backward (or accumulation) ran */
  uint64_t nodes_run_on_workers;  /* of those, on a device worker thread */
  uint64_t cross_stream_edges;    /* gradients handed from one stream to another */
  uint64_t events_recorded;       /* events the engine recorded for those hand-offs and at the end */
  uint64_t stream_waits;          /* waits of one stream on another's event it issued */
  uint64_t accumulate_grad_stream_mismatches; /* gradients made on another stream of the AccumulateGrad's device */
  uint64_t accumulate_grad_warnings;          /* warnings issued for them (once per leaf and stream pair) */
  uint64_t accumulate_grad_followed;          /* accumulators moved to their producer's stream */
  uint64_t reentrant_backwards;   /* backward calls started inside a running backward */
  uint64_t reentrant_handoffs;    /* of those, moved to a pool thread past the depth limit */
  uint64_t worker_parks;          /* times a worker (or a waiting caller) parked after spinning */
} ebb_autograd_engine_stats;
/* EBB_EINVAL for NULL out. */
EBB_API ebb_status ebb_autograd_get_engine_stats(ebb_autograd_engine_stats *out);

/* Nodes alive in the process, for leak checks in tests. */
EBB_API long ebb_autograd_live_nodes(void);

#ifdef __cplusplus
}
#endif

#endif /* EBB_AUTOGRAD_H */
