/* ops_export.h: what ops offers the modules above it (autograd) beyond its public headers.
 * Never installed, not part of the API.
 *
 * Autograd keeps its per-tensor state in one slot of each tensor handle, which ops never reads.
 * ops cannot call autograd (layer order), so autograd hands ops a table of functions when it
 * starts (ebb__tensor_hooks_set, below): `released` frees a slot's state when the handle holding
 * it dies, `viewed` lets a view of a tensor with state take its base's history, `recorded`
 * records the node of an operation, and `inplace` / `inplace_done` record an in-place op around
 * it. It also offers the derivative table (ebb__deriv_of) and the lean in-place kernels the
 * engine computes gradients with (ebb__lean_*). A tensor whose slot is NULL (every tensor until
 * autograd sets one) costs each path one load and a branch.
 */
#ifndef EBB_OPS_EXPORT_H
#define EBB_OPS_EXPORT_H

#include "ebb/status.h"
#include "ebb/tensor.h"
#include "runtime_export.h" /* EBB_HIDDEN, for C and C++ alike */

#ifdef __cplusplus
extern "C" {
#endif

struct ebb__op_args; /* the derivative table's arguments, below */
struct ebb__tensor_meta;

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
  /* Operation `op` (its derivative-table entry, declared below) made the `nout` tensors `out`
   * from the `nin` tensors `in` (NULL where an optional input was not given: layer_norm's
   * weight and bias), and at least one input has a slot; `args` as the table documents them.
   * The hook records the node (setting the outputs' slots). Called once per public call, after
   * it succeeded: the calls an op makes for itself (a composite's inner ops) record nothing.
   * A failure fails that call with the hook's status (its message prefixed by the call's name);
   * the outputs are released. Same thread as the call. A call that returns its input itself
   * (ebb_tensor_contiguous of a contiguous tensor) records nothing. In-place ops go through
   * `inplace` instead. */
  ebb_status (*recorded)(int op, const ebb_tensor_t *const *in, int nin, ebb_tensor_t *const *out, int nout,
                         const struct ebb__op_args *args);
  /* An in-place op `op` (an EBB__OP_*_ entry: add_, mul_, copy_, fill_, zero_ and the family
   * of ops/inplace.c) is about to change dst; src[0..nsrc) are its other inputs, the entry's
   * inputs 1.. in order (nsrc 0 for fill and zero; at most 2), and args its scalars as the
   * table documents them (NULL: none). dst or a src has a slot, or dst is a view whose base has
   * one, or a module watches every in-place op (ebb__inplace_watch_add). A failure refuses the
   * op before anything changes, with the hook's status (its message prefixed by the call's
   * name). The hook may set *token (NULL before the call): ops then calls
   * `inplace_done(token, ok)` once, after the op changed dst and bumped its version (ok true)
   * or failed (ok false), so what the hook prepared is committed or dropped. Same thread as the
   * call. */
  ebb_status (*inplace)(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const struct ebb__op_args *args,
                        void **token);
  void (*inplace_done)(void *token, bool ok);
} ebb__tensor_hooks;

/* While the count is above 0 the `inplace` hook runs for every in-place op, whether or not its
 * tensors have slots: autograd counts the saved storages it has copied elsewhere (offloaded saved
 * tensors), whose writers it must see. Without watchers the check costs one relaxed load. */
EBB_HIDDEN void ebb__inplace_watch_add(long delta);

/* Installs the hooks (NULL removes them): autograd at its start and stop. The struct must outlive
 * the installation. Release store; the paths load it with acquire. */
EBB_HIDDEN void ebb__tensor_hooks_set(const ebb__tensor_hooks *h);

/* A new handle on t's storage with t's geometry and dtype, without a slot and without running
 * any hook: what autograd keeps of a tensor it saves (the data, not the graph). Released with
 * ebb_tensor_release. EBB_ENOMEM without host memory for a handle. */
EBB_HIDDEN ebb_status ebb__tensor_share(const ebb_tensor_t *t, ebb_tensor_t **out);

/* Whether `t` is the only handle on its storage and holds it alone (one reference to the handle,
 * one handle on the storage), contiguous and without a slot: nothing else can see a change made
 * to it in place, so autograd may add into it or keep it as a .grad without a copy. */
EBB_HIDDEN bool ebb__tensor_exclusive(const ebb_tensor_t *t);

/* The block t's storage lives in, as ebb_arena_alloc or ebb_pageable_alloc handed it out (not
 * t's data pointer: a view starts inside it); NULL for a storage of 0 bytes. For autograd to name
 * the owner of a saved tensor's or a gradient's memory (ebb_alloc_block_set_owner). */
EBB_HIDDEN void *ebb__tensor_block(const ebb_tensor_t *t);

/* A new handle like ebb__tensor_share's with the geometry given instead of t's (elements of t's
 * dtype; the caller keeps it within the storage). */
EBB_HIDDEN ebb_status ebb__tensor_share_as(const ebb_tensor_t *t, int ndim, const int64_t *shape, const int64_t *strides,
                                           int64_t offset, ebb_tensor_t **out);
/* Where t lies: its storage's block (NULL for 0 bytes), bytes, allocation stream, device and
 * serial (unique for the process's life: two handles see the same storage exactly when their
 * serials agree), and t's offset (elements) and strides. */
typedef struct ebb__storage_info {
  void *block;
  size_t bytes;
  uint64_t serial;
  ebb_stream_t *stream; /* the block's allocation stream and its id (NULL and 0 on the CPU) */
  uint64_t stream_id;
  bool used_elsewhere;  /* ops recorded a use of the block on another stream (a kernel there) */
  int device;
  int64_t offset;
  int64_t strides[EBB_TENSOR_MAX_DIMS];
} ebb__storage_info;
EBB_HIDDEN void ebb__tensor_storage_info(const ebb_tensor_t *t, ebb__storage_info *out);

/* Whether live tensor t has m's shape, dtype and device (no copy of its geometry). */
EBB_HIDDEN bool ebb__tensor_matches(const ebb_tensor_t *t, const struct ebb__tensor_meta *m);
/* t's metadata into *m. */
EBB_HIDDEN void ebb__tensor_meta_of(const ebb_tensor_t *t, struct ebb__tensor_meta *m);

/* The base of a view: the tensor whose storage the view's chain of view calls started from (a
 * view of a view has the first one's base), NULL for a tensor that is not a view (made by an op,
 * a creation call, a reshape that copied, ebb_tensor_detach). The view holds a reference to
 * it, so the base lives as long as its views. Borrowed. */
EBB_HIDDEN ebb_tensor_t *ebb__tensor_base(const ebb_tensor_t *t);
/* Whether two of t's elements share memory (a stride-0 dim of extent > 1: an expanded tensor). */
EBB_HIDDEN bool ebb__tensor_overlaps(const ebb_tensor_t *t);
/* A copy of t's whole storage (all its bytes, whatever part of them t covers), on its device and
 * made on the device's current stream: a new 1-D contiguous tensor of t's dtype, without a slot,
 * at version 0. What autograd keeps of a saved tensor's storage before an in-place write changes
 * it (its slots then view the copy through ebb__tensor_share_as). Failures (no memory) name fn. */
EBB_HIDDEN ebb_status ebb__tensor_storage_clone(const char *fn, const ebb_tensor_t *t, ebb_tensor_t **out);

/* Inference mode (autograd's scope; the flag lives here because ops marks what it creates):
 * per thread; storage made while it is on belongs to inference tensors, and in-place ops on
 * those are refused outside the mode. */
EBB_HIDDEN void ebb__inference_set(bool on);
EBB_HIDDEN bool ebb__inference_on(void);
EBB_HIDDEN bool ebb__tensor_is_inference(const ebb_tensor_t *t);

/* EBB_EINVAL for NULL, EBB_EFREED for a released tensor, the message naming fn and arg. */
EBB_HIDDEN ebb_status ebb__tensor_check(const ebb_tensor_t *t, const char *fn, const char *arg);
/* The same for element `index` of an array argument (-1: not an array), so the message names
 * arg[index]: "ebb_backward: roots[1] is NULL; expected a tensor". */
EBB_HIDDEN ebb_status ebb__tensor_check_at(const ebb_tensor_t *t, const char *fn, const char *arg, int index);

/* ---- a tensor in a message -----------------------------------------------------------------
 * Every message of ops and autograd that describes a tensor writes it one way: the argument (its
 * role, with "[index]" when index >= 0; NULL role: "tensor"), the tensor's own name in single
 * quotes when it has one (ebb_tensor_set_name), then dtype, shape and device in parentheses:
 *   grad_roots[1] (f32[3, 2] on device 0)      t 'w1' (bf16[4] on the CPU)
 * A released tensor is never read: "roots[0] (0x..., released)"; NULL gives "grad (NULL)".
 * Writes into buf (truncated to cap, always terminated; EBB__DESC_MAX holds a role of 24 bytes,
 * an index, a full-length name and 8 extents of up to 13 digits), allocates nothing, and returns
 * buf for use as a %s argument.
 * Thread-safe for live tensors as far as their names are (a concurrent ebb_tensor_set_name may
 * show either name). */
#define EBB__DESC_MAX 256
EBB_HIDDEN const char *ebb__tensor_desc(const ebb_tensor_t *t, const char *role, int index, char *buf, size_t cap);
/* The same from metadata (a node's record of a forward input or output) and an optional name. */
EBB_HIDDEN const char *ebb__meta_desc(const struct ebb__tensor_meta *m, const char *role, int index, const char *name, char *buf,
                                      size_t cap);

/* The slot of a live handle, and setting it (nothing retained). Callers hold a valid tensor;
 * concurrent setters of one handle are the caller's to order. */
EBB_HIDDEN void *ebb__tensor_slot(const ebb_tensor_t *t);
EBB_HIDDEN void ebb__tensor_set_slot(ebb_tensor_t *t, void *slot);

/* ---- the derivative table --------------------------------------------------------------------
 * One entry per operation that changes values or shape: its forward call, the node name its
 * backward gets, what it saves, which inputs can get gradients, and the backward itself behind
 * one signature, so autograd builds every node from the table and never from per-op glue. */

typedef enum ebb__op_id {
  /* binary (broadcasting) and scalar */
  EBB__OP_ADD, EBB__OP_SUB, EBB__OP_MUL, EBB__OP_DIV,
  EBB__OP_ADD_SCALAR, EBB__OP_SUB_SCALAR, EBB__OP_MUL_SCALAR, EBB__OP_DIV_SCALAR, EBB__OP_POW_SCALAR, EBB__OP_CLAMP,
  /* unary */
  EBB__OP_NEG, EBB__OP_ABS, EBB__OP_EXP, EBB__OP_LOG, EBB__OP_SQRT, EBB__OP_SIN, EBB__OP_COS, EBB__OP_TANH,
  EBB__OP_SIGMOID, EBB__OP_RELU, EBB__OP_GELU, EBB__OP_WHERE,
  /* reductions, matmul, nn */
  EBB__OP_SUM, EBB__OP_MEAN, EBB__OP_AMAX, EBB__OP_MAX_DIM, EBB__OP_MATMUL, EBB__OP_LINEAR,
  EBB__OP_SOFTMAX, EBB__OP_LOG_SOFTMAX, EBB__OP_CROSS_ENTROPY, EBB__OP_MSE_LOSS, EBB__OP_LAYER_NORM,
  EBB__OP_CAT, EBB__OP_STACK,
  /* views */
  EBB__OP_VIEW, EBB__OP_RESHAPE, EBB__OP_TRANSPOSE, EBB__OP_PERMUTE, EBB__OP_SLICE, EBB__OP_NARROW, EBB__OP_SELECT,
  EBB__OP_EXPAND, EBB__OP_SQUEEZE, EBB__OP_UNSQUEEZE,
  /* copies */
  EBB__OP_CONTIGUOUS, EBB__OP_CLONE, EBB__OP_TO_DEVICE, EBB__OP_TO_DTYPE,
  /* in place: input 0 is dst's value before the op, the output dst's value after it */
  EBB__OP_ADD_, EBB__OP_MUL_, EBB__OP_COPY_, EBB__OP_FILL_, EBB__OP_ZERO_,
  /* the in-place family of ops/inplace.c; s[0] is alpha, the scalar, lerp's weight or the
   * value of addcmul_/addcdiv_ (sqrt_ has none) */
  EBB__OP_ADD_SCALED_, EBB__OP_ADD_SCALAR_, EBB__OP_MUL_SCALAR_, EBB__OP_LERP_, EBB__OP_ADDCMUL_, EBB__OP_ADDCDIV_,
  EBB__OP_SQRT_,
  /* autograd's own nodes for in-place ops on views (args->geom says where the view lies):
   * a view's history taken again from its base's after an in-place change, and the base's
   * history after an in-place op on one of its views (PyTorch's CopySlices) */
  EBB__OP_AS_STRIDED, EBB__OP_COPY_SLICES,
  EBB__OP_COUNT
} ebb__op_id;

/* What a backward knows of each forward input without saving it. */
typedef struct ebb__tensor_meta {
  int device;
  ebb_dtype dtype;
  int ndim;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
} ebb__tensor_meta;

/* The forward's non-tensor arguments, normalised as the forward used them (dims in [0, ndim),
 * slice bounds clamped; reduction dims sorted, ndims 0 for all of them). */
typedef struct ebb__op_args {
  double s[2];                       /* scalar, pow's p, clamp's lo/hi, layer_norm's eps */
  int dims[EBB_TENSOR_MAX_DIMS];     /* reduction dims; permute's order */
  int ndims;
  int dim, dim1;                     /* the dim of softmax, cat, stack, slice, select, squeeze,
                                        unsqueeze, max_dim; transpose's two; layer_norm's nnorm */
  int64_t start, end, step;          /* slice [start, end) by step; narrow; select's index */
  bool keepdim;
  const struct ebb__view_geom *geom; /* AS_STRIDED and COPY_SLICES only, else NULL */
} ebb__op_args;

/* Where a view lies in its base's storage, for the nodes that move gradients between the two.
 * The base's shape, dtype and device are the node's input 0 metadata. */
typedef struct ebb__view_geom {
  int64_t base_strides[EBB_TENSOR_MAX_DIMS];
  int64_t base_offset;
  ebb__tensor_meta view;                 /* the view's shape (its dtype and device: the base's) */
  int64_t strides[EBB_TENSOR_MAX_DIMS];  /* the view's */
  int64_t offset;
  /* COPY_SLICES: the in-place op on the view (an EBB__OP_*_ entry) and its arguments; its
   * saved tensors are the node's */
  int inner_op;
  ebb__op_args inner_args;
} ebb__view_geom;

/* g's view geometry of `view` in `base` (a view of base's storage). */
EBB_HIDDEN void ebb__view_geom_of(const ebb_tensor_t *base, const ebb_tensor_t *view, ebb__view_geom *g);

/* What an entry's backward reads (ebb__deriv.save): forward inputs and outputs by position. */
#define EBB__SAVE_NONE 0u
#define EBB__SAVE_IN(i) (1u << (i))
#define EBB__SAVE_OUT(i) (1u << (8 + (i)))

/* Which inputs can get a gradient (ebb__deriv.diff), by position; EBB__DIFF_EACH for an entry
 * taking any number of inputs (nin -1: cat, stack), where every input can. */
#define EBB__DIFF_NONE 0u
#define EBB__DIFF_IN(i) (1u << (i))
#define EBB__DIFF_EACH EBB__DIFF_IN(0)

/* A backward call: the forward's arguments, each input's metadata, the tensors the entry saves
 * (the others NULL; a layer_norm without weight or bias has NULL there too), and which inputs'
 * gradients are wanted. */
typedef struct ebb__bw_ctx {
  const ebb__op_args *args;
  const ebb__tensor_meta *in;           /* [nin] */
  const ebb_tensor_t *const *saved_in;  /* [nin] */
  const ebb_tensor_t *const *saved_out; /* [nout] */
  int nin;
  const bool *need;                     /* [nin]: input i's gradient wanted */
  /* [nout] or NULL: grad_out[k] is held by the engine alone (ebb__tensor_exclusive) and given up
   * after the call, so the backward may write into it and return it, retained, as a gradient
   * (the engine's lean path: no allocation for a node whose gradient keeps its shape). */
  const bool *go_mine;
} ebb__bw_ctx;

/* Fills grad_in[i] (a new reference, with input i's shape, dtype and device) for each wanted
 * input i that can get one, NULL for the others; grad_out[k] is the gradient of output k (NULL
 * for outputs that have none: max_dim's indices). On failure nothing is returned. */
typedef ebb_status (*ebb__backward_fn)(const ebb__bw_ctx *c, const ebb_tensor_t *const *grad_out, ebb_tensor_t **grad_in);

typedef struct ebb__deriv {
  const char *node;     /* the backward node's name: "MulBackward" */
  const char *forward;  /* the call: "ebb_op_mul" */
  int8_t nin;           /* inputs; -1: any number (cat, stack) */
  int8_t nout;
  uint16_t save;        /* what backward reads: EBB__SAVE_NONE, or EBB__SAVE_IN(i) | EBB__SAVE_OUT(k) ... */
  uint8_t diff;         /* inputs that can get a gradient: EBB__DIFF_NONE, EBB__DIFF_IN(i) | ..., or
                           EBB__DIFF_EACH (nin -1: bit 0 stands for every input) */
  ebb__backward_fn backward; /* NULL when diff is 0: the outputs do not depend on the inputs */
} ebb__deriv;

/* ---- the engine's lean path --------------------------------------------------------------------
 * In-place arithmetic on a gradient buffer the engine holds alone (ebb__tensor_exclusive: one
 * handle, contiguous, floating), operands already checked by the caller: b live, on t's device,
 * broadcasting to t's shape. Only the kernel runs (on the current stream of t's device, which the
 * engine sets to the node's stream; the storage records that use as any op's):
 * no argument checks, no in-place hook, no record, no version bump. Errors are the launch's. */
EBB_HIDDEN ebb_status ebb__lean_scale_(ebb_tensor_t *t, double s);               /* t *= s */
EBB_HIDDEN ebb_status ebb__lean_mul_(ebb_tensor_t *t, const ebb_tensor_t *b);    /* t *= b */
EBB_HIDDEN ebb_status ebb__lean_add_(ebb_tensor_t *t, const ebb_tensor_t *b);    /* t += b */

/* The entry of op (op < EBB__OP_COUNT). */
EBB_HIDDEN const ebb__deriv *ebb__deriv_of(ebb__op_id op);

#ifdef __cplusplus
}
#endif

#endif /* EBB_OPS_EXPORT_H */
