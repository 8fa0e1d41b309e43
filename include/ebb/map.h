/* ebb/map.h: ebb_map, a function applied to each slice along dim 0 of some tensors, its results
 * stacked, differentiated as one node.
 *
 * The C counterpart of torch's map (torch/_higher_order_ops/map.py) and of JAX's lax.map:
 *   outputs[k] = stack over s of fn(xs[0][s], ..., xs[nxs-1][s], args[0], ..., args[nargs-1])[k]
 * where xs[i][s] is slice s of xs[i] along dim 0 (a view, as ebb_tensor_select makes) and the
 * args are passed whole to every call. The result is the same as that explicit loop followed by
 * ebb_op_stack, values and gradients alike, but recorded as one node ("MapBackward", a custom
 * function of ebb/function.h) whose backward runs each slice's vector-Jacobian product and sums
 * the gradients of the args over the slices. Two ways to differentiate (ebb_map_options):
 * - save (the default): the forward records each slice's graph as the loop would (its saved
 *   tensors, hooks and offload scopes included) and the backward runs all of them as one backward
 *   (the args' gradients summed over the slices as the engine sums any leaf's); the loop's memory
 *   (each slice's results are not kept beside their copies in the stacked outputs).
 * - checkpoint: the forward records nothing inside fn and keeps only the inputs (xs and args, as
 *   saved tensors of the node); the backward runs fn again on each slice with grad mode on, takes
 *   that slice's gradients and frees its graph before the next slice. Peak memory holds one
 *   slice's graph instead of all of them, for a second forward's time. fn must then compute the
 *   same thing from the same inputs each time (no randomness of its own, no state).
 *
 * fn: called on the calling thread (and, in checkpoint mode, again in the backward on the thread
 * that runs the node: the caller's, or a device worker of a backward over several devices) with
 * the slices of xs and the args, borrowed for the call, and `user` (which, in checkpoint mode,
 * must stay valid while the node lives). It sets outputs[0..noutputs) (NULL on entry) to new
 * references (new tensors, or views of its inputs) and returns EBB_OK, or a failure that fails
 * ebb_map (its status, its message kept after "ebb_map: fn failed at slice s").
 * Every slice must give outputs of the same shapes, dtypes and devices as slice 0's. fn may call
 * any op, ebb_map included; it must not change its inputs in place (the slices are views of xs).
 * In the forward of a map that records a node, grad mode is on while fn runs (save mode) or off
 * (checkpoint mode); the slices and args fn gets are then detached handles, the ones whose
 * gradient is needed requiring one: fn sees leaves, never the caller's history.
 *
 * Gradients flow to xs and args only: a tensor fn reaches otherwise (through `user`) gets none
 * from a map that records a node (pass it among the args), and fn's outputs are copied into the
 * stacked outputs with grad mode off, so they carry no history of their own to the caller.
 * An output of fn that does not require a gradient (it does not depend on an input that needs
 * one, or is not floating) contributes none; an input that no output depends on gets
 * none (a zero gradient, nothing is computed for it); an output whose gradient does not reach
 * the map's node (NULL) counts as zero. xs and args that do not require a gradient get none and
 * cost nothing in the backward. The backward of a node may run again when the first one had
 * retain_graph (the slices' graphs, or the saved inputs, are kept); without it they are freed by
 * that backward, and a second one through the node fails with EBB_ESTATE naming it. Double backward
 * (create_graph) is not supported (ebb/function.h).
 *
 * Nothing recorded (grad mode off, inference mode, or no input requires a gradient): ebb_map is
 * the loop and the stack, with fn seeing the slices as views of xs.
 *
 * Errors (a status and ebb_last_error naming ebb_map, the argument and what was expected; on
 * failure nothing is returned in outputs): EBB_EINVAL for NULL fn, xs or outputs, nxs < 1, nargs
 * < 0, nxs + nargs above EBB_MAP_MAX_INPUTS, noutputs outside 1..EBB_MAP_MAX_OUTPUTS, a NULL
 * entry of xs or args (args NULL with nargs > 0), an xs tensor of 0 dimensions, xs whose leading
 * dims differ (naming both tensors), zero slices (a leading dim of 0: fn's output shapes would be
 * unknown), and an fn that leaves an output NULL or gives, at slice s, an output of another shape,
 * dtype or device than slice 0's, or (checkpoint mode, in the backward) than the forward's;
 * EBB_EFREED for a released tensor among xs or args; EBB_ENOTSUP for an options version this
 * library does not know; fn's own failure; what the ops and the engine report (EBB_ENOMEM, ...).
 * Threading: ebb_map may be called on many threads at once; fn runs on the threads said above,
 * one call at a time per map. Streams: slices and outputs are made on the calling thread's
 * current streams, as the ops fn calls make theirs.
 */
#ifndef EBB_MAP_H
#define EBB_MAP_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Tensors one map takes (xs and args together) and outputs fn may give. */
#define EBB_MAP_MAX_INPUTS 64
#define EBB_MAP_MAX_OUTPUTS 64

/* fn of ebb_map: one slice. xs[0..nxs) are the slices (dim 0 of each removed), args[0..nargs)
 * the args; outputs[0..noutputs) to fill with new references. */
typedef ebb_status (*ebb_map_fn)(const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs,
                                 ebb_tensor_t **outputs, int noutputs, void *user);

/* Options of ebb_map. A zero-initialised struct (`ebb_map_options o = {0};`), or NULL, gives the
 * defaults: save mode. Versions: 0 or EBB_MAP_OPTIONS_VERSION, both meaning the fields below; a
 * later header may add fields at the end and raise the version, and a library refuses a version
 * newer than it reads (EBB_ENOTSUP) instead of ignoring a field (ebb/autograd.h's options rule). */
#define EBB_MAP_OPTIONS_VERSION 1
typedef struct ebb_map_options {
  uint32_t version;  /* 0 or EBB_MAP_OPTIONS_VERSION */
  bool checkpoint;   /* keep only the inputs and run each slice again in the backward */
} ebb_map_options;

/* Runs fn over dim 0 of xs[0..nxs) (all with the same leading dim N >= 1) with args[0..nargs)
 * passed whole, and puts in outputs[k] (k < noutputs) a new reference: the stack along a new
 * dim 0 of the N results k, of shape [N, ...]. Records the "MapBackward" node when grad mode is
 * on and an input requires a gradient: the floating outputs then require one. xs, args and
 * opts (may be NULL) are borrowed for the call (and, in checkpoint mode, xs and args are saved
 * with the node as any op saves its inputs: changing them in place before the backward fails the
 * backward, naming the node). */
EBB_API ebb_status ebb_map(ebb_map_fn fn, void *user, const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args,
                           int nargs, const ebb_map_options *opts, ebb_tensor_t **outputs, int noutputs);

#ifdef __cplusplus
}
#endif

#endif /* EBB_MAP_H */
