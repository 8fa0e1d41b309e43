/* ebb/ddp.h: data-parallel gradient reduction that overlaps backward.
 *
 * Every rank of a process group (ebb/dist.h) runs the same model on its own batch; a reducer
 * attached to the model's parameters averages their gradients over the ranks while backward
 * still runs, so that when ebb_reducer_finish returns every rank holds the same .grad: the mean
 * of the ranks' gradients.
 *
 * Buckets. The parameters are grouped into flat buckets, one per dtype run, in reverse parameter
 * order (the order in which backward usually produces their gradients): the first bucket holds
 * at most first_bucket_bytes, the others at most bucket_bytes; a parameter larger than the cap
 * gets a bucket of its own. Each parameter's .grad is set, at creation, to a view of its bucket
 * (ebb_tensor_set_grad), so backward's AccumulateGrad adds into the bucket in place and the
 * bucket is reduced with no copy (gradient views; with copy_grads the gradient is copied into
 * the bucket instead, and back into .grad at the end).
 *
 * One step, on every rank, in the same order:
 *   zero the gradients (ebb_reducer_zero_grad, or an optimizer's zero_grad: in place or to NULL),
 *   forward, ebb_backward (or any backward through the parameters), ebb_reducer_finish,
 *   the optimizer's step. With gradient accumulation, backwards with sync off
 *   (ebb_reducer_set_sync) come between the zeroing and the last, synchronised backward.
 * During backward, a post-accumulate hook per parameter marks it ready. At the first hook of a
 * backward the reducer asks the engine which parameters' AccumulateGrad nodes that backward will
 * run (ebb_autograd_will_execute): the others are unused this step, and count as ready at once
 * with their gradient as it stands (zero after zero_grad). No flag and no graph walk: a model
 * whose parameters reach the loss in some steps and not in others needs nothing. When every
 * parameter of a bucket is ready, its all-reduce (average) is issued; buckets are issued strictly
 * in index order (a full bucket waits for the ones before it), so every rank issues the same
 * sequence whatever the timing. ebb_reducer_finish issues what remains (all of it when no hook
 * ran: no parameter reached the loss on this rank) and waits for the reductions.
 *
 * Profiling: bucket k's memory is owned by "ddp bucket <k>" (EBB_OWNER_GRADIENT) in snapshots,
 * and its all-reduce is issued under that owner scope, so the engine trace's span of it
 * (ebb/trace.h: on the group's communication stream, or its thread on the CPU) names the bucket.
 *
 * Bucket rebuild: the reverse order is a guess. During the first step the reducer records the
 * order in which gradients became ready; at that step's ebb_reducer_finish rank 0's order is
 * broadcast and every rank rebuilds its buckets in it (once), copying the reduced gradients
 * into the new buckets. Later steps keep those buckets.
 *
 * Streams: on a device group, each bucket's all-reduce is issued from a stream of the reducer's
 * own (a side stream), which first waits for the stream current when the bucket filled (in a
 * hook: the AccumulateGrad node's, which wrote the bucket); the collective's end is waited for by
 * the side stream only, so backward's next kernels never wait for a reduction. Each
 * ebb_reducer_finish makes the caller's current stream wait for the side stream (on the device,
 * no host wait): work issued after it on that stream sees the reduced gradients, and other
 * streams must wait for that one. On the CPU, the all-reduces run on the group's communication
 * thread while backward continues, and ebb_reducer_finish waits for them on the host. The
 * AccumulateGrad nodes of one bucket's parameters are expected to run on one stream (the
 * forward's, as usual): the all-reduce is ordered after the stream of the bucket's last hook.
 * Handles: a reducer is owned by the caller (ebb_reducer_destroy), holds references on its
 * parameters, their AccumulateGrad nodes and its buckets, and must be destroyed before its
 * group and before the last ebb_shutdown (EBB_EBUSY while one is live). A destroyed handle is
 * EBB_EFREED until its record is reused (records are reused first in, first out after 256 more
 * destructions).
 * Threading: calls on one reducer must not overlap each other or a backward through its
 * parameters other than the one the hooks serve; one backward per ebb_reducer_finish: a second
 * backward that reaches a parameter before finish fails with EBB_ESTATE naming finish, before it
 * writes into a bucket (a tensor hook per parameter checks it).
 * Errors: a status and ebb_last_error naming the call, the parameter (index, name when it has
 * one, dtype, shape, device) or the bucket, and what was expected.
 */
#ifndef EBB_DDP_H
#define EBB_DDP_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/dist.h"
#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebb_reducer ebb_reducer_t;

/* Options of ebb_reducer_create. A zero-initialised struct (or NULL) gives the defaults.
 * `version` is 0 or EBB_REDUCER_OPTIONS_VERSION; a newer one is EBB_ENOTSUP. */
#define EBB_REDUCER_OPTIONS_VERSION 1
#define EBB_REDUCER_DEFAULT_FIRST_BUCKET_BYTES ((int64_t)1 << 20)
#define EBB_REDUCER_DEFAULT_BUCKET_BYTES ((int64_t)25 << 20)
typedef struct ebb_reducer_options {
  uint32_t version;           /* 0 or EBB_REDUCER_OPTIONS_VERSION */
  int64_t first_bucket_bytes; /* 0: EBB_REDUCER_DEFAULT_FIRST_BUCKET_BYTES; < 0: EBB_EINVAL */
  int64_t bucket_bytes;       /* 0: EBB_REDUCER_DEFAULT_BUCKET_BYTES; < 0: EBB_EINVAL */
  bool copy_grads;            /* false (default): .grad is a view of its bucket; true: copied in and out */
  bool no_rebuild;            /* true: keep the reverse-order buckets (no first-step rebuild) */
  /* Debug: before each bucket's all-reduce the ranks all-gather its fingerprint (step, bucket,
   * element count, dtype, parameter count; a blocking exchange, so this costs a round trip per
   * bucket) and compare. A difference (ranks whose buckets differ, or whose collectives on the
   * group went out of step) fails the step on every rank at once, naming the bucket, its
   * parameters and what each rank has, and no further bucket of that step is reduced, instead of
   * a mismatched all-reduce that hangs or mixes unrelated data. A rank that issues nothing at
   * all is only seen by the group's timeout (ebb_pg_options.timeout_ms: give 10000 for 10 s). */
  bool debug_fingerprint;
} ebb_reducer_options;

/* Creates a reducer over `pg` for params[0..n): leaf tensors that require gradients, floating,
 * contiguous, on the group's device, none sharing storage with another. Collective over the
 * group: every rank calls it with the same parameter list (count, and each shape and dtype, in
 * order). The ranks exchange a description of their list first, and a list that differs between
 * ranks is EBB_EINVAL on every rank, naming the first parameter that differs (or the counts)
 * and what each rank has. Then rank 0's parameter values are broadcast so every rank starts from
 * the same model (as DDP does). Sets each parameter's .grad to its bucket's view (keeping the
 * values of a .grad it had, else zero), registers a post-accumulate hook on each, and holds each
 * parameter's AccumulateGrad node (ebb_tensor_gradient_edge).
 * Errors: EBB_EINVAL for NULL pg, params (with n > 0), a NULL entry or out; n <= 0; a parameter
 * that is not a leaf requiring a gradient, not floating, not contiguous, or shares storage with
 * another; options with a negative cap; EBB_EDEVICE for a parameter on another device than the
 * group's (naming both); EBB_ENOTSUP for a newer options version; EBB_EFREED for a released
 * tensor or group; the group's errors (EBB_ESTATE for a failed group, EBB_EIO). On failure
 * nothing is left registered; .grad of the parameters may have been reset to NULL. */
EBB_API ebb_status ebb_reducer_create(ebb_pg_t *pg, ebb_tensor_t *const *params, int n, const ebb_reducer_options *opts,
                                      ebb_reducer_t **out);

/* Removes the hooks, waits for reductions still in flight, releases the buckets (each .grad that
 * is a bucket view becomes a copy of its own, so the gradients stay readable), the nodes and the
 * parameters, and the handle. EBB_EINVAL for NULL, EBB_EFREED for a destroyed reducer. */
EBB_API ebb_status ebb_reducer_destroy(ebb_reducer_t *r);

/* Ends the step's reduction: issues, in order, the buckets not issued yet (every one when no
 * parameter reached this rank's loss), waits for all of the step's all-reduces (a host wait on
 * the CPU; on a device the caller's current stream is ordered after them), copies back with
 * copy_grads, and after the first step rebuilds the buckets (see the top of this header). Every
 * rank calls it once per backward. EBB_ESTATE when a parameter the backward was to run never
 * reported (a backward that failed): the remaining buckets are still issued so the ranks stay in
 * step, and the message names the parameters; the group's errors otherwise (EBB_EIO, naming the
 * bucket). EBB_EINVAL for NULL, EBB_EFREED for a destroyed reducer. */
EBB_API ebb_status ebb_reducer_finish(ebb_reducer_t *r);

/* Gradient accumulation (DDP's no_sync): with sync false, backwards through the parameters only
 * add into each rank's own .grad (the buckets): no collective is issued, and
 * ebb_reducer_finish, which may be called or not, returns at once. The first backward after
 * ebb_reducer_set_sync(r, true) (the default) reduces what was accumulated, unused parameters'
 * gradients included, and its ebb_reducer_finish waits as usual. Every rank must follow the
 * same pattern (debug_fingerprint catches steps that went out of step). Zero the gradients
 * before the first accumulating backward, not between them. Call it between backwards: a call
 * while a backward through the parameters runs on another thread is not detected (part of that
 * backward would be reduced and part not). EBB_ESTATE while a step is open (a synchronised
 * backward ran and its finish has not); EBB_EINVAL for NULL, EBB_EFREED for a destroyed reducer. */
EBB_API ebb_status ebb_reducer_set_sync(ebb_reducer_t *r, bool sync);

/* Zeroes every bucket (the gradients of all parameters) on the group's device, on the caller's
 * current stream, and sets back as .grad the bucket view of a parameter whose .grad was replaced
 * or cleared. EBB_EINVAL for NULL, EBB_EFREED for a destroyed reducer. */
EBB_API ebb_status ebb_reducer_zero_grad(ebb_reducer_t *r);

/* The buckets: *n the count; for bucket b, its element count, dtype, and which parameters it
 * holds (their indices in the creation list, in bucket order: nparams, params may be NULL to ask
 * the count only, else up to cap entries written). EBB_EINVAL for NULL r, b out of range. */
EBB_API ebb_status ebb_reducer_num_buckets(const ebb_reducer_t *r, int *n);
EBB_API ebb_status ebb_reducer_bucket_info(const ebb_reducer_t *r, int b, int64_t *numel, ebb_dtype *dtype, int *nparams,
                                           int *params, int cap);

#ifdef __cplusplus
}
#endif
#endif /* EBB_DDP_H */
