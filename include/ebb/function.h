/* ebb/function.h: custom autograd functions: a forward written by the caller, with the backward
 * that differentiates it, recorded in the graph as one node like a built-in op's.
 *
 * The C counterpart of PyTorch's torch.autograd.Function. A definition (ebb_function) names the
 * function and gives its callbacks; ebb_function_apply runs the forward on tensors and, when grad
 * mode is on and an input requires a gradient, records one node named "<name>Backward" whose
 * backward is the definition's. The ctx (ebb_function_ctx) carries what the forward leaves for the
 * backward: saved tensors (through the saved-tensor machinery of ebb/autograd.h: its hooks and
 * offload scopes see them as any node's), which inputs it changed in place, which outputs have no
 * gradient, and user data with its destructor. The ctx and everything it holds are freed with the
 * node: when the last tensor whose graph reaches it goes (or at once, when nothing is recorded).
 *
 * A custom backward is never differentiated: ebb's backward records nothing (no create_graph),
 * so asking for a gradient of a gradient is refused where it is asked (ebb_autograd_backward's
 * options), never computed wrong.
 *
 * The callbacks:
 * - forward(ctx, inputs, ninputs, args, outputs, noutputs): computes the outputs. It runs on the
 *   calling thread with grad mode off (its ops record nothing), so the outputs' history is the
 *   function's node alone. It sets outputs[0..noutputs) (NULL on entry) to new references: new
 *   tensors, an input changed in place and marked dirty (a new reference on the input's handle),
 *   or an input returned unchanged (the caller then gets a new handle on it, a view, whose
 *   history is the node's). A view a function returns (such a handle, or a view of an input the
 *   forward made) keeps the function's history: an in-place change of it, or its use after its
 *   base was changed in place, is refused (EBB_EINVAL naming the node), since rebuilding its
 *   history from the base would bypass the function's backward. `args` is apply's, passed through (the function's non-tensor
 *   arguments; may be NULL). Returning a failure fails the apply: outputs it set are released.
 * - setup_context(ctx, inputs, ninputs, args, outputs, noutputs), optional: called after forward
 *   with the outputs, for what the forward left out (PyTorch's setup_context): saving outputs,
 *   marking outputs non-differentiable, user data. Either callback may use the ctx calls marked
 *   "forward" below.
 * - backward(ctx, grad_outputs, noutputs, grad_inputs, ngrad_inputs): runs inside ebb_backward
 *   (or ebb_grad), when a gradient reached at least one output, on the thread that runs the node: the caller's or, for a device node in a
 *   backward over several devices, that device's worker, with grad mode off and the node's
 *   forward stream current on its device (ebb/autograd.h, "the engine"). grad_outputs[k] is the
 *   gradient of output k, borrowed for the call: NULL where no gradient reached output k (or k is
 *   non-differentiable), unless materialized (ebb_ctx_set_materialize_grads, on by default: then
 *   zeros in output k's shape, dtype and device). It sets grad_inputs[i] (NULL on entry) to a new
 *   reference, the gradient of input i, or leaves it NULL (zero); *ngrad_inputs is ninputs on
 *   entry and must be ninputs when it returns (the count of gradients it returns). A gradient
 *   for an input that requires none is dropped. Each returned gradient is checked against its
 *   input: same device and dtype as the input (not cast, as PyTorch would); shape equal to the
 *   input's, or one that sum-reduces to it along broadcast dims (it is then reduced, as a
 *   broadcasting op's gradient is); a gradient for a non-floating input, or for an input not
 *   given (NULL), is refused (PyTorch drops the first silently). Failures name the function,
 *   the input index, what came and what was expected.
 *
 * Errors: a status and ebb_last_error naming the call, the function and the argument. apply:
 * EBB_EINVAL for NULL fn or outputs, a definition without name or forward, noutputs outside
 * 1..EBB_FUNCTION_MAX_OUTPUTS, ninputs outside 0..EBB_FUNCTION_MAX_INPUTS, a version this library
 * does not know; EBB_EFREED for a released input; a forward that fails (its status, its message
 * kept after the function's name), leaves an output NULL or returns one tensor as two outputs;
 * a forward or setup_context that goes on after one of its ctx calls was refused (EBB_EINVAL
 * with the refusal's message: a lost save or mark is never silent), and likewise a backward.
 * The calls the callbacks make are the caller's own: one that fails sets the thread's last error
 * even when the callback recovers and apply succeeds. ctx calls: EBB_EINVAL for NULL arguments or tensors, EBB_ESTATE for a
 * call in the wrong phase (a forward call from backward, saved tensors read in forward), and the
 * specific refusals listed with each call. Backward: a backward that returns a failure (its status,
 * its message kept), a wrong count, or a gradient that does not fit fails the ebb_backward call,
 * which names the node "<name>Backward".
 * Threading: apply is thread-safe; a definition may be applied on many threads at once. A ctx
 * is used by one callback at a time: forward and setup_context on the applying thread, backward
 * on the engine's. Concurrent backward calls through one node (retain_graph) run its backward
 * on their own threads, each with a ctx of its own over the node's shared state (user data,
 * materialize flag): the ctx calls are thread-safe, the user data is the caller's to guard, and
 * replacing it from backward (which destroys the old data at once) must not race with another
 * backward reading it.
 * Names: each definition's node name is interned once and lives for the process (a program that
 * makes definitions with ever new names grows that table).
 */
#ifndef EBB_FUNCTION_H
#define EBB_FUNCTION_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EBB_FUNCTION_MAX_INPUTS 64
#define EBB_FUNCTION_MAX_OUTPUTS 64
/* Tensors one ctx may save (ebb_ctx_save_for_backward, all calls together). */
#define EBB_FUNCTION_MAX_SAVED 64

typedef struct ebb_function_ctx ebb_function_ctx;

typedef ebb_status (*ebb_function_forward_fn)(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs,
                                              const void *args, ebb_tensor_t **outputs, int noutputs);
typedef ebb_status (*ebb_function_setup_fn)(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs,
                                            const void *args, ebb_tensor_t *const *outputs, int noutputs);
typedef ebb_status (*ebb_function_backward_fn)(ebb_function_ctx *ctx, const ebb_tensor_t *const *grad_outputs,
                                               int noutputs, ebb_tensor_t **grad_inputs, int *ngrad_inputs);

/* A function's definition. Borrowed by apply and by every node it records: it (and its name)
 * must stay valid and unchanged while such a node lives (a static definition is the usual case).
 * Versions: 0 or EBB_FUNCTION_VERSION (ebb/autograd.h's options rule: a later header may add
 * fields at the end). */
#define EBB_FUNCTION_VERSION 1
typedef struct ebb_function {
  uint32_t version;
  const char *name;                    /* "ScaledAdd": messages, and the node "ScaledAddBackward" */
  int noutputs;                        /* 1..EBB_FUNCTION_MAX_OUTPUTS */
  ebb_function_forward_fn forward;     /* required */
  ebb_function_setup_fn setup_context; /* optional */
  ebb_function_backward_fn backward;   /* NULL: not differentiable; a backward that reaches its node
                                          fails (EBB_ENOTSUP, naming the function) */
  void *user;                          /* for the callbacks: ebb_ctx_function_user */
} ebb_function;

/* Runs fn's forward on inputs[0..ninputs) (NULL entries: optional inputs not given; they get
 * no gradient) and puts fn->noutputs new references in outputs[0..). Records the node when grad
 * mode is on and an input requires a gradient; the floating outputs not marked
 * non-differentiable then require gradients with it as their grad_fn (output k is the node's
 * output k). With nothing recorded, the ctx is freed before apply returns (its user data's
 * destructor runs) and the outputs are plain tensors. On failure nothing is returned in
 * outputs. */
EBB_API ebb_status ebb_function_apply(const ebb_function *fn, const ebb_tensor_t *const *inputs, int ninputs,
                                      const void *args, ebb_tensor_t **outputs);

/* ---- the ctx: from forward and setup_context ----------------------------------------------- */

/* Saves tensors[0..n) for backward (appended to what earlier calls saved; ebb_ctx_saved_tensors
 * returns them in that order). Inputs, outputs or tensors the forward made for the purpose; a
 * NULL entry saves nothing there (backward reads NULL). Each is saved when the forward ends,
 * with the node: through the saved-tensor hooks of the applying thread (offload scopes included),
 * else as a handle on its storage with its version, checked at backward (a saved tensor changed
 * in place since fails the backward, naming the node and the saved tensor's index). Without a
 * recorded node nothing is kept. EBB_ELIMIT past EBB_FUNCTION_MAX_SAVED in all; EBB_EFREED for a
 * released tensor. */
EBB_API ebb_status ebb_ctx_save_for_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *tensors, int n);
/* Declares that the forward changed inputs tensors[0..n) in place. Each must be one of apply's
 * inputs (EBB_EINVAL otherwise, naming the position) and be returned as an output (EBB_EINVAL
 * when the forward ends otherwise): its history becomes the node's. Refused when the apply
 * records a node (the forward's change is then made, and the apply fails): an input that is a
 * leaf requiring a gradient (EBB_EINVAL, as an in-place op on it would be), and any view
 * (EBB_ENOTSUP: its base's history would have to follow; pass the base). */
EBB_API ebb_status ebb_ctx_mark_dirty(ebb_function_ctx *ctx, const ebb_tensor_t *const *tensors, int n);
/* Declares outputs[0..n) without a gradient (indices, masks): they do not require one, and their
 * grad_outputs in backward are zeros (materialized) or NULL. Each must be one of the outputs when
 * the forward ends (EBB_EINVAL then, naming it). EBB_ELIMIT past EBB_FUNCTION_MAX_OUTPUTS marks
 * in all. */
EBB_API ebb_status ebb_ctx_mark_non_differentiable(ebb_function_ctx *ctx, const ebb_tensor_t *const *outputs, int n);
/* Whether backward sees zeros (on, the default) or NULL for outputs no gradient reached. May be
 * called from backward too (PyTorch's rule is forward-time; here it takes effect for the next
 * backward through the node). Never fails for a valid ctx. */
EBB_API ebb_status ebb_ctx_set_materialize_grads(ebb_function_ctx *ctx, bool on);

/* ---- the ctx: anywhere ----------------------------------------------------------------------- */

/* Whether input i needs a gradient: in forward and setup_context, whether it requires one (and
 * grad mode is on); in backward, whether this backward wants it (an input the running backward
 * does not reach reads false, so its gradient need not be computed). EBB_EINVAL for i outside
 * [0, ninputs) or NULL out. */
EBB_API ebb_status ebb_ctx_needs_input_grad(const ebb_function_ctx *ctx, int i, bool *out);
/* User data for backward, with the destructor run when the ctx is freed (with the node, or at
 * the end of an apply that recorded none), on the thread that drops the node's last reference;
 * replacing earlier data runs its destructor now. destroy may be NULL. */
EBB_API ebb_status ebb_ctx_set_user(ebb_function_ctx *ctx, void *data, void (*destroy)(void *data));
EBB_API void *ebb_ctx_user(const ebb_function_ctx *ctx);
/* The definition's user pointer (ebb_function.user). */
EBB_API void *ebb_ctx_function_user(const ebb_function_ctx *ctx);
/* The function's name, for the callbacks' own messages. */
EBB_API const char *ebb_ctx_function_name(const ebb_function_ctx *ctx);

/* ---- the ctx: from backward ------------------------------------------------------------------ */

/* The tensors saved by ebb_ctx_save_for_backward, in order: *out points to *n handles (NULL
 * where a NULL was saved) borrowed for the backward call (unpacked through their hooks, reloaded
 * when offloaded). EBB_ESTATE outside backward; the engine's failure of a saved tensor (changed
 * in place, freed by an earlier backward without retain_graph) fails the backward before it is
 * called, naming the node and the saved tensor's index. */
EBB_API ebb_status ebb_ctx_saved_tensors(ebb_function_ctx *ctx, const ebb_tensor_t *const **out, int *n);

/* Live ctx objects in the process (freed with their nodes), for leak checks in tests. */
EBB_API long ebb_function_live_ctx(void);

#ifdef __cplusplus
}
#endif

#endif /* EBB_FUNCTION_H */
