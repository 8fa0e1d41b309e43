/* ops_impl.h: what the files of ops/ share; nothing outside ops/ includes it (autograd gets
 * ops_export.h).
 *
 * ops holds tensors (a handle over a refcounted storage shared by its views) and the ops on
 * them. Every op checks its arguments, allocates its result and runs one of ops' kernel families
 * (elementwise, reduction, matmul) through one launch path: on the calling thread for CPU
 * tensors, on the device's current stream otherwise. The kernels' argument structs and element
 * math are written once for the CPU and CUDA (ops_kernels.h, ops_math.h).
 *
 * The files, each with one job; the second half of this header declares what each provides to
 * the others, a section per file in this order (a file with no section shares nothing but its
 * public functions, include/ebb/tensor.h and include/ebb/ops.h):
 *   tensor.c       the dtype table, the record pool, storage and the streams it has declared,
 *                  making, aliasing, sharing and releasing handles, getters, accessors
 *   check.c        argument checks (handles, dims) and the tensor descriptions in messages
 *   hooks.c        autograd's hooks: the recording bracket, the in-place check, inference mode
 *   launch.c       the module's start and stop, the kernel table, ebb__launch, operand use
 *   ew.c           broadcasting, the elementwise launch (ebb__ew_run), and the steps the
 *                  elementwise families share: promotion, checks, result, backward helpers
 *   create.c       factories: empty, full, zeros, ones, arange, rand, randn, from_host
 *   copy.c         copies, casts, moves between devices; copy_, fill_, zero_
 *   views.c        views (view, reshape, permute, transpose, slice, ..., unsqueeze)
 *   binary.c       add, sub, mul, div, add_, mul_, the engine's lean kernels
 *   scalar.c       the ops of a tensor and a scalar, and clamp
 *   unary.c        neg, abs, exp, log, sqrt, sin, cos, tanh, sigmoid, relu, gelu
 *   compare.c      eq, ne, lt, le, gt, ge and where
 *   reduce.c       sum, mean, amax, max_dim, sum_to_shape
 *   matmul.c       matmul
 *   softmax.c      softmax, log_softmax
 *   loss.c         cross_entropy, mse_loss
 *   norm.c         layer_norm
 *   cat.c          cat, stack
 *   rows.c         the launch of the fused row kernels that softmax.c, loss.c and norm.c run
 *   inplace.c      the in-place updates of a training step (add_scaled_, add_scalar_,
 *                  mul_scalar_, lerp_, addcmul_, addcdiv_, sqrt_) and their derivative entries
 *   linear.c       linear (one GEMM with the bias folded in) and its derivative entry
 *   derivatives.c  the derivative table autograd builds its nodes from (ops_export.h)
 *   kernels_cpu.c  the CPU kernels (CPU tensors and the emulated driver's engine threads)
 *   kernels_cpu_vec.c  their vector loops, one table per instruction set chosen at run time
 *                  (declared in kernels_cpu_vec.h, the one header they share with kernels_cpu.c)
 *   kernels_rows.c the fused row kernels (softmax, log_softmax, cross_entropy, layer_norm),
 *                  one text (kernels_rows_body.h) per instruction set, chosen at run time
 *   blas_gpu.c     GPU matmul through a dlopen'ed cuBLAS
 *   optim.c        the fused optimizer update (SGD, AdamW) for autograd's optimizers, through
 *                  export/optim_export.h; its kernel's argument struct is optim_kernels.h's
 * Each public op's backward (ebb_op_<name>_backward) lives beside its forward.
 * The first half holds the records they share.
 *
 * Ownership: a tensor handle holds one reference to its storage, and a view one to its base
 * handle; a storage owns its arena block (device) or host-pool block (CPU), freed
 * stream-ordered when its last handle goes.
 * Threading: handle and storage refcounts are atomic; the record pool's lock is a leaf lock; the
 * rest of ops keeps no shared mutable state beyond the kernel cache and the hook table, both
 * published with release stores and read with acquire loads.
 */
#ifndef EBB_OPS_IMPL_H
#define EBB_OPS_IMPL_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "ebb/tensor.h"
#include "ebb_internal.h"
#include "ebb_list.h"
#include "runtime_export.h"
#include "ebb/ops.h"
#include "ops_export.h"

/* ==============================================================================================
 * The records the files share (tensor.c owns them).
 * ============================================================================================== */

#define EBB__TENSOR_MAGIC 0x65627473u /* "ebts" */
#define EBB__STORAGE_USED 4           /* streams remembered per storage before record_stream */

/* Refcounted storage shared by a tensor and all its views. */
struct ebb__storage {
  _Atomic uint32_t refs;
  int device;                /* EBB_DEVICE_CPU or a device ordinal */
  void *data;                /* arena or host-pool block; NULL for 0 bytes */
  size_t bytes;
  ebb_stream_t *stream;      /* allocation stream (device storage), NULL on the CPU */
  uint64_t stream_id;        /* its id (0 on the CPU) */
  _Atomic uint64_t version;
  uint64_t serial;           /* unique for the process's life (ebb__tensor_storage_info) */
  bool inference;            /* made in inference mode (ebb__inference_on): an inference tensor's */
  /* Ids of other streams already declared to the arena with ebb_arena_record_stream; 0 is an
   * empty entry (ids start at 1). Ids, not handles: a released stream's handle is reused by a
   * later stream, which the arena has never heard of. */
  _Atomic uint64_t used[EBB__STORAGE_USED];
};

struct ebb_tensor {
  _Atomic uint32_t magic;    /* EBB__TENSOR_MAGIC while alive, 0 once released */
  _Atomic uint32_t refs;
  struct ebb_list free_link; /* in the pool's FIFO of released records */
  struct ebb__storage *stor;
  int64_t offset;            /* elements */
  int ndim;
  ebb_dtype dtype;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  int64_t strides[EBB_TENSOR_MAX_DIMS];
  void *autograd;
  struct ebb_tensor *base;   /* a view's base (a reference), NULL when not a view (ebb__tensor_base) */
  char name[EBB_TENSOR_NAME_MAX + 1];
};

/* ---- elements and kernels --------------------------------------------------------------------- */

/* Element loads and stores by dtype, bf16/f16 conversions and the rest of the element math:
 * one text for the CPU kernels and the CUDA ones. It includes ops_kernels.h, the kernels'
 * argument structs and their op codes (EBB__EW_*, EBB__RED_*). */
#include "ops_math.h"

_Static_assert(EBB__KMAX_DIMS == EBB_TENSOR_MAX_DIMS, "kernel structs hold EBB_TENSOR_MAX_DIMS dims");
_Static_assert(EBB__KDT_F32 == (int)EBB_F32 && EBB__KDT_F64 == (int)EBB_F64 && EBB__KDT_BF16 == (int)EBB_BF16 &&
                   EBB__KDT_F16 == (int)EBB_F16 && EBB__KDT_I64 == (int)EBB_I64 && EBB__KDT_BOOL == (int)EBB_BOOL,
               "kernel dtype codes are ebb_dtype's");

/* ops' kernel families, by id (launch.c's kernel table gives each its names and CPU function).
 * EBB__K_EW_F32 is the elementwise family's GPU kernel for contiguous f32/bf16/f16 operands
 * (ebb__ew_flat_f32, ops_math.h); its CPU function is EBB__K_EW's. */
enum ebb__kernel_id { EBB__K_EW = 0, EBB__K_REDUCE, EBB__K_MATMUL, EBB__K_ROWS, EBB__K_OPTIM, EBB__K_EW_F32, EBB__K_COUNT };

/* A tensor an op touches, for the launch: its storage gets record_stream when the launch stream
 * is not its allocation stream. */
typedef ebb_op_operand ebb__operand; /* ebb/ops.h's, which a library's own kernels use too */

/* ==============================================================================================
 * What each file provides to the others.
 * ============================================================================================== */

/* ---- tensor.c: handles and storage ---------------------------------------------------------------
 * (Its accessors for autograd, ebb__tensor_share, _exclusive, _storage_info and the rest, are
 * declared in ops_export.h.) */

EBB_HIDDEN extern const size_t ebb__dtype_size[EBB_DTYPE_COUNT];

EBB_HIDDEN int64_t ebb__numel(const int64_t *shape, int ndim);
EBB_HIDDEN bool ebb__is_contiguous(const ebb_tensor_t *t);
EBB_HIDDEN void *ebb__tensor_ptr(const ebb_tensor_t *t);
/* Row-major strides of shape, with extents of 0 or 1 taken as 1. */
EBB_HIDDEN void ebb__contig_strides(int ndim, const int64_t *shape, int64_t *strides);

/* Creating handles (no reference checks; internal callers hold valid tensors). */
/* A new contiguous tensor with fresh storage (values undefined). */
EBB_HIDDEN ebb_status ebb__tensor_new(const char *fn, int device, ebb_dtype dt, int ndim, const int64_t *shape,
                                      ebb_tensor_t **out);
/* A new handle on t's storage (one more storage reference) with the given geometry; a failure
 * (no host memory for the handle) names fn. */
EBB_HIDDEN ebb_status ebb__tensor_alias(const char *fn, const ebb_tensor_t *t, int ndim, const int64_t *shape, const int64_t *strides,
                                        int64_t offset, ebb_tensor_t **out);
EBB_HIDDEN void ebb__tensor_put(ebb_tensor_t *t);
/* Releases every handle of a local array of tensors (NULL entries allowed): how a composed op
 * drops its temporaries, on success and on failure. */
#define EBB__PUT_ALL(arr)                                                        \
  do {                                                                           \
    for (size_t i_ = 0; i_ < EBB_ARRAY_LEN(arr); i_++) ebb__tensor_put(arr[i_]); \
  } while (0)
/* The end of a two-input backward: on success hands ra to *ga and rb to *gb (each where its
 * out-pointer is non-NULL; ra and rb are NULL where it is NULL) and returns EBB_OK; on failure
 * releases both (NULL allowed) and returns st. */
EBB_HIDDEN ebb_status ebb__grads_out(ebb_status st, ebb_tensor_t *ra, ebb_tensor_t **ga, ebb_tensor_t *rb, ebb_tensor_t **gb);

/* The id of the live stream s (ids are never reused, handles are); a failure names fn. */
EBB_HIDDEN ebb_status ebb__stream_id_of(const char *fn, ebb_stream_t *s, uint64_t *id);
/* Declares stream (whose id is sid) to the arena as a user of s's block, once per stream. */
EBB_HIDDEN ebb_status ebb__storage_use(struct ebb__storage *s, ebb_stream_t *stream, uint64_t sid);

/* ---- check.c: argument checks and messages -------------------------------------------------------
 * (ebb__tensor_check_at, ebb__tensor_desc and ebb__meta_desc are in ops_export.h.) */

/* EBB_EINVAL for NULL, EBB_EFREED for a released tensor, naming `fn` and `arg`. */
EBB_HIDDEN ebb_status ebb__tensor_check(const ebb_tensor_t *t, const char *fn, const char *arg);
/* For a failure of a call made on the user's behalf (another module's, or a public op that a
 * composite op calls): rewrites the thread's last error as "fn: <it>" so the message starts with
 * the call the user made, unless it does already. Returns st. */
EBB_HIDDEN ebb_status ebb__fail_in(const char *fn, ebb_status st);
/* "[2, 3, 4]" into buf (cap >= 16); returns buf. */
EBB_HIDDEN const char *ebb__shape_str(const int64_t *shape, int ndim, char *buf, size_t cap);
#define EBB__SHAPE(t, buf) ebb__shape_str((t)->shape, (t)->ndim, (buf), sizeof(buf))
/* A tensor argument in a message (ops_export.h, ebb__tensor_desc): "grad 'g' (f32[3, 2] on the CPU)". */
#define EBB__DESC(t, role, buf) ebb__tensor_desc((t), (role), -1, (buf), sizeof(buf))
/* Failures about one tensor, "fn: <t described> <fmt...>", and about two, "fn: <a described> and
 * <b described> <fmt...>". Out of line (EBB_COLD), so the checks on every op's path carry no
 * description buffers in their frames. Return st. */
EBB_HIDDEN EBB_COLD ebb_status ebb__fail_about(ebb_status st, const char *fn, const ebb_tensor_t *t, const char *role, const char *fmt,
                                               ...) EBB_PRINTF(5, 6);
EBB_HIDDEN EBB_COLD ebb_status ebb__fail_about2(ebb_status st, const char *fn, const ebb_tensor_t *a, const char *an,
                                                const ebb_tensor_t *b, const char *bn, const char *fmt, ...) EBB_PRINTF(7, 8);
/* Normalises a possibly negative dim against ndim (range [-ndim, ndim)); EBB_EINVAL otherwise. */
EBB_HIDDEN ebb_status ebb__dim(const char *fn, const char *arg, int dim, int ndim, int *out);
/* A live tensor argument of a floating dtype (the nn families' inputs); EBB_EINVAL or
 * EBB_EFREED naming fn and arg otherwise. */
EBB_HIDDEN ebb_status ebb__float_input(const char *fn, const char *arg, const ebb_tensor_t *t);
/* EBB_EINVAL naming fn and the out-argument arg ("out", "grad_x", ...) when out is NULL. */
EBB_HIDDEN ebb_status ebb__need_out(const char *fn, const char *arg, ebb_tensor_t **out);

/* ---- hooks.c: recording for autograd (ops_export.h, the `recorded` hook) ---------------------------
 * Every public op that has a derivative-table entry brackets its work:
 *   const ebb__tensor_hooks *h = ebb__rec_enter();
 *   st = <the op>;
 *   return ebb__rec_done(fn, h, st, EBB__OP_X, in, nin, &out, NULL, &args);
 * With no hooks installed (no autograd) that is one load and a branch. With hooks, a
 * thread-local depth tells the outermost call (which records) from the ones it makes itself.
 * (ebb__tensor_hooks_set, ebb__inference_set/_on and ebb__inplace_watch_add are in ops_export.h.) */
EBB_HIDDEN extern _Atomic(const ebb__tensor_hooks *) ebb__hooks;
EBB_HIDDEN const ebb__tensor_hooks *ebb__rec_enter_slow(const ebb__tensor_hooks *h);
EBB_HIDDEN ebb_status ebb__rec_exit(const char *fn, const ebb__tensor_hooks *h, ebb_status st, ebb__op_id op,
                                    const ebb_tensor_t *const *in, int nin, ebb_tensor_t **out0, ebb_tensor_t **out1,
                                    const ebb__op_args *args);
/* The inplace hook's check before an in-place op changes dst (ops_export.h), given the op's
 * other inputs src[0..nsrc) and its args (NULL: none): one load and a branch without hooks; the
 * hook runs when dst or a src has a slot, or dst's base has one. An inference tensor outside
 * inference mode is refused here. Failures name fn. *token is set for ebb__inplace_end, which
 * every path after a successful check must call (ok: dst changed and its version bumped). */
EBB_HIDDEN ebb_status ebb__inplace_check(const char *fn, int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc,
                                         const ebb__op_args *args, void **token);
EBB_HIDDEN void ebb__inplace_end(void *token, bool ok);
static inline const ebb__tensor_hooks *ebb__rec_enter(void) {
  /* acquire: pairs with the release store in ebb__tensor_hooks_set. */
  const ebb__tensor_hooks *h = atomic_load_explicit(&ebb__hooks, memory_order_acquire);
  return EBB_UNLIKELY(h != NULL) ? ebb__rec_enter_slow(h) : NULL;
}
static inline ebb_status ebb__rec_done(const char *fn, const ebb__tensor_hooks *h, ebb_status st, ebb__op_id op,
                                       const ebb_tensor_t *const *in, int nin, ebb_tensor_t **out0, ebb_tensor_t **out1,
                                       const ebb__op_args *args) {
  return EBB_UNLIKELY(h != NULL) ? ebb__rec_exit(fn, h, st, op, in, nin, out0, out1, args) : st;
}

/* The bracket as one statement, for an op with one output: returns `call`'s status, recorded
 * as `op` with the inputs listed after it and `args` (NULL: none). */
#define EBB__RECORDED(fn, op, args, out, call, ...)                                                                  \
  do {                                                                                                             \
    const ebb__tensor_hooks *rec_h_ = ebb__rec_enter();                                                            \
    ebb_status rec_st_ = (call);                                                                                   \
    const ebb_tensor_t *rec_in_[] = {__VA_ARGS__};                                                                 \
    return ebb__rec_done((fn), rec_h_, rec_st_, (op), rec_in_, (int)EBB_ARRAY_LEN(rec_in_), (out), NULL, (args)); \
  } while (0)

/* ---- launch.c: the launch path ------------------------------------------------------------------- */

/* Runs kernel `kid` on `device`: the CPU function on the calling thread for EBB_DEVICE_CPU,
 * else enqueued on the device's current stream with the operands' storages declared as reads
 * and writes. `work` is the number of GPU threads the kernel wants (one per output element);
 * the CUDA kernels loop over whatever the grid does not cover. */
EBB_HIDDEN ebb_status ebb__launch(const char *fn, int kid, int device, const void *args, const ebb__operand *ops,
                                  int nops, int64_t work);
/* Declares to the arena the operands' use on `stream` (ebb_arena_record_stream where the stream
 * is not their allocation stream), for work enqueued without ebb__launch; failures name fn. */
EBB_HIDDEN ebb_status ebb__operands_use(const char *fn, const ebb__operand *ops, int nops, ebb_stream_t *stream);

/* ---- ew.c: broadcasting, the elementwise launch, the elementwise families' shared steps ---------- */

/* Strides of `t` broadcast to (ndim, shape) (0 along broadcast dims); EBB_EINVAL when it does
 * not broadcast, naming fn and arg. */
EBB_HIDDEN ebb_status ebb__broadcast_strides(const char *fn, const char *arg, const ebb_tensor_t *t, int ndim,
                                             const int64_t *shape, int64_t *strides);
/* The broadcast shape of a's first na dims and b's first nb dims (their ndim, or fewer for
 * matmul's batch dims); EBB_EINVAL describing both tensors by their argument names an and bn. */
EBB_HIDDEN ebb_status ebb__broadcast_shape(const char *fn, const ebb_tensor_t *a, const char *an, int na, const ebb_tensor_t *b,
                                           const char *bn, int nb, int *ndim,
                                           int64_t *shape);
/* Fills the geometry of an elementwise launch from `out` and up to 3 inputs already broadcast to
 * out's shape (strides given per input), coalescing dims. */
EBB_HIDDEN void ebb__ew_geometry(ebb__ew_args *a, const ebb_tensor_t *out, int nin, const ebb_tensor_t *const *in,
                                 const int64_t (*in_strides)[EBB_TENSOR_MAX_DIMS]);
/* Runs one elementwise op writing `out` (already allocated) from inputs broadcast to out's
 * shape. Checks the devices: every input must be on out's device. */
EBB_HIDDEN ebb_status ebb__ew_run(const char *fn, int op, ebb_tensor_t *out, int nin, const ebb_tensor_t *const *in,
                                  double s0, double s1);

/* dt when floating, else f32: the result dtype of an op that needs a floating result. */
EBB_HIDDEN ebb_dtype ebb__float_of(ebb_dtype dt);
/* EBB_EINVAL naming fn when out is NULL. */
EBB_HIDDEN ebb_status ebb__check_out(const char *fn, ebb_tensor_t **out);
/* out = op(in...) with the shape of in broadcast together and dtype dt: checks one device,
 * allocates the result, runs one kernel. */
EBB_HIDDEN ebb_status ebb__ew_new(const char *fn, int op, int nin, const ebb_tensor_t *const *in, ebb_dtype dt, double s0,
                                  double s1, ebb_tensor_t **out);
/* What a binary op's result dtype is: the promoted one (arithmetic, refused for two bools), a
 * floating one (division) or bool (comparisons). */
enum ebb__bin_kind { EBB__ARITH, EBB__DIVIDE, EBB__COMPARE };
/* A public binary op: checks a, b and out, then one kernel (ebb__ew_new). */
EBB_HIDDEN ebb_status ebb__ew_binary(const char *fn, int op, int kind, const ebb_tensor_t *a, const ebb_tensor_t *b,
                                     ebb_tensor_t **out);
/* What a unary op's result dtype is: the input's, or a floating one. */
enum ebb__un_kind { EBB__KEEP, EBB__FLOAT };
/* A public unary op with scalars s0, s1: checks a and out, then one kernel (ebb__ew_new). */
EBB_HIDDEN ebb_status ebb__ew_unary(const char *fn, int op, int kind, const ebb_tensor_t *a, double s0, double s1, ebb_tensor_t **out);
/* A backward's checks of grad and the input x (named xname): live, x floating, one device. */
EBB_HIDDEN ebb_status ebb__ew_bw_check(const char *fn, const ebb_tensor_t *grad, const char *xname, const ebb_tensor_t *x);
/* g summed to x's shape and converted to x's dtype (a new reference). */
EBB_HIDDEN ebb_status ebb__grad_for(const char *fn, const ebb_tensor_t *g, const ebb_tensor_t *x, ebb_tensor_t **out);
/* grad_x = grad * k(x) with k the elementwise kernel `op` (scalars s0, s1); op < 0: grad * s0
 * without reading x; op EBB__EW_GELU_BWD: that binary kernel of (grad, x), one pass. */
EBB_HIDDEN ebb_status ebb__local_backward(const char *fn, const ebb_tensor_t *grad, const ebb_tensor_t *x, int op, double s0,
                                          double s1, ebb_tensor_t **gx);

/* ---- copy.c: copies ------------------------------------------------------------------------------
 * (ebb__tensor_storage_clone is in ops_export.h.) */

/* A contiguous copy of t in dtype dt on t's device (one kernel), recording nothing. */
EBB_HIDDEN ebb_status ebb__copy_as(const char *fn, const ebb_tensor_t *t, ebb_dtype dt, ebb_tensor_t **out);

/* ---- derivatives.c: the derivative table's shared steps ------------------------------------------ */

/* g brought to input m's shape (summing broadcast dims), dtype and device: a new reference in
 * *out. The first step of most table entries' backward (and the in-place family's). */
EBB_HIDDEN ebb_status ebb__grad_fit(const ebb__tensor_meta *m, const ebb_tensor_t *g, ebb_tensor_t **out);

/* ---- inplace.c: the backward of the in-place family (derivative-table entries) -------------- */

EBB_HIDDEN ebb_status ebb__bw_add_scaled_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_add_scalar_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_mul_scalar_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_lerp_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_addcmul_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_addcdiv_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);
EBB_HIDDEN ebb_status ebb__bw_sqrt_(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);

/* ---- linear.c: LinearBackward's entry (ebb_op_linear_backward from the saved x and w) -------- */

EBB_HIDDEN ebb_status ebb__bw_linear(const ebb__bw_ctx *c, const ebb_tensor_t *const *go, ebb_tensor_t **gin);

/* ---- matmul.c: the GEMM launch shared with linear.c ------------------------------------------- */

/* On a GPU (a device without CPU kernels), cuBLAS on the current stream with ops' operands
 * declared there; EBB_ENOTSUP, with no message, on the CPU, on the emulated driver and where
 * cuBLAS cannot be loaded (the caller then launches the matmul kernel, ebb__launch). */
EBB_HIDDEN ebb_status ebb__mm_gpu(const char *fn, int device, const ebb__mm_args *g, const ebb__operand *ops);

/* ---- rows.c: the launch of the fused row kernels (softmax.c, loss.c, norm.c) ------------------ */

/* Whether t can feed a row kernel: f32, contiguous, with elements (0-element tensors take the
 * composed path, which already handles them). */
EBB_HIDDEN bool ebb__rows_ok(const ebb_tensor_t *t);
/* Runs a row kernel on `device`: reads and writes are the tensors behind a's pointers (NULL
 * entries skipped, 8 at most in all), so a device launch declares their storages' uses on its
 * stream. One block of 256 threads per row on a GPU. */
EBB_HIDDEN ebb_status ebb__rows_launch(const char *fn, int device, const ebb__rows_args *a, const ebb_tensor_t *const *reads,
                                       int nr, ebb_tensor_t *const *writes, int nw);

/* ---- kernels_cpu.c: the CPU kernels -------------------------------------------------------------- */

/* The CPU function of each kernel family (launch.c's table), on the argument struct. */
EBB_HIDDEN void ebb__ew_cpu(void *args);
EBB_HIDDEN void ebb__reduce_cpu(void *args);
EBB_HIDDEN void ebb__matmul_cpu(void *args);
/* Philox 4x32-10 of counter (c0..c3) and key (k0, k1); out receives 4 words. */
EBB_HIDDEN void ebb__philox(uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]);

/* ---- kernels_rows.c: the fused row kernels ------------------------------------------------------- */

/* The fused row kernels (ebb__rows_args), the widest instruction set the CPU has. */
EBB_HIDDEN void ebb__rows_cpu(void *args);
/* Instruction sets of the CPU kernels, narrowest first: x86-64's baseline (SSE2; scalars on
 * other machines), AVX2 with FMA, AVX-512 (F, BW, DQ and VL). ebb__cpu_isa (kernels_cpu.c): the
 * widest this CPU has, capped by EBB_CPU_VEC, chosen when the library loads.
 * ebb__rows_run_isa: the row kernel with the given set, capped at the CPU's (tests compare the
 * sets on one machine). */
enum { EBB__ISA_BASE = 0, EBB__ISA_AVX2, EBB__ISA_AVX512 };
EBB_HIDDEN int ebb__cpu_isa(void);
EBB_HIDDEN void ebb__rows_run_isa(const ebb__rows_args *a, int isa);

/* ---- blas_gpu.c: GPU matmul through cuBLAS ------------------------------------------------------- */

/* GPU matmul through cuBLAS on stream `s` of `device`: EBB_ENOTSUP when cuBLAS is not available
 * (the caller then launches the plain CUDA kernel). */
EBB_HIDDEN ebb_status ebb__gpu_gemm(const char *fn, int device, ebb_stream_t *s, const ebb__mm_args *g);
/* Destroys the cuBLAS handles (the ops module's stop, at the last ebb_shutdown). */
EBB_HIDDEN void ebb__blas_stop(void);

/* ---- optim.c: the fused optimizer update -------------------------------------------------------- */

/* The optimizer kernel's CPU function (launch.c's table; its arguments: optim_kernels.h). */
EBB_HIDDEN void ebb__optim_cpu(void *args);

#endif /* EBB_OPS_IMPL_H */
