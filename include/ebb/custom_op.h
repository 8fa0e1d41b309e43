/* ebb/custom_op.h: named ops that a library adds to ebb, with their own kernels and their
 * backward, called from C like a built-in op.
 *
 * The C counterpart of PyTorch's torch.library.custom_op with register_autograd. A definition
 * (ebb_custom_op_def) gives the op's name, its counts, which outputs are differentiable, the
 * callbacks of a custom function (ebb/function.h: forward, optional setup_context, backward) and
 * the op's kernels. Registering it copies what it needs (the name, the flags) and declares the
 * kernels in the library's own kernel image through the runtime's image mechanism
 * (ebb_kernel_add_image, ebb_kernel_declare_in of ebb/runtime.h): each kernel has a CPU function
 * (run on the calling thread for CPU tensors, on the emulated driver's engine threads for its
 * devices) and the name of its CUDA function in the image (a fatbin or cubin the library ships),
 * so a third-party library builds and embeds its own image as ebb's modules do theirs. The
 * forward and backward launch those kernels on tensors with ebb_op_launch_kernel (ebb/ops.h),
 * the path every built-in op's launch takes: the device's current stream, the operands'
 * storages declared as used there, CPU tensors done on return.
 *
 * A call (ebb_custom_op_call) is one ebb_function_apply of the op's function: with grad mode on
 * and an input requiring a gradient it records one node named "<name>Backward", which shows in
 * the Node API (ebb_node_name, its edges, metadata, hooks), the engine trace (its spans carry
 * the node name) and the allocator's owner tags (what its backward allocates is
 * (EBB_OWNER_BACKWARD, "<name>Backward"), what it saves is (EBB_OWNER_SAVED, "<name>Backward"))
 * as a built-in op's node does. What the forward allocates belongs, as a built-in op's outputs
 * do, to the caller's innermost owner scope (ebb_alloc_owner_push).
 *
 * An op registered without a backward is still callable: its outputs then carry a node whose
 * backward fails (EBB_ENOTSUP, naming the op) when a gradient has to flow through it; with
 * nothing requiring a gradient (or grad mode off) nothing is recorded and nothing fails.
 *
 * Lifetime: the registry is the runtime's session's, as kernels and images are: ops are
 * registered after ebb_init and forgotten at the last ebb_shutdown (with the kernels they
 * declared); a library registers its ops again after the next ebb_init. An op handle from before
 * a completed last ebb_shutdown is refused (EBB_EINVAL, "not a registered op") until
 * EBB_CUSTOM_OP_MAX ops have been registered since (its entry is then reused).
 *
 * Threading: every function is thread-safe; one op may be called on many threads at once.
 */
#ifndef EBB_CUSTOM_OP_H
#define EBB_CUSTOM_OP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/function.h"
#include "ebb/runtime.h"
#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EBB_CUSTOM_OP_NAME_MAX 63    /* bytes of an op's name, without the terminating NUL */
#define EBB_CUSTOM_OP_MAX_KERNELS 16 /* kernels one op declares */
#define EBB_CUSTOM_OP_MAX 256        /* ops registered from ebb_init to the last ebb_shutdown */

typedef struct ebb_custom_op ebb_custom_op_t;

/* One kernel of an op, declared in the op's image (ebb_kernel_declare_in). */
typedef struct ebb_custom_op_kernel {
  const char *name;         /* the kernel's registry name, unique across images ("mylib.scaled_mul") */
  size_t arg_bytes;         /* its argument struct's size, 1..4096 */
  ebb_kernel_cpu_fn cpu_fn; /* CPU tensors and the emulated driver; NULL: none (GPU only) */
  const char *cuda_name;    /* its function in the image; NULL: none (CPU only) */
} ebb_custom_op_kernel;

/* Versions: 0 or EBB_CUSTOM_OP_VERSION (a later header may add fields at the end). */
#define EBB_CUSTOM_OP_VERSION 1
typedef struct ebb_custom_op_def {
  uint32_t version;
  const char *name;                    /* 1..EBB_CUSTOM_OP_NAME_MAX bytes, unique; copied */
  int ninputs;                         /* 0..EBB_FUNCTION_MAX_INPUTS tensors per call */
  int noutputs;                        /* 1..EBB_FUNCTION_MAX_OUTPUTS */
  const bool *differentiable;          /* noutputs flags, read at registration (copied): false
                                          marks the output non-differentiable in every call
                                          (ebb_ctx_mark_non_differentiable); NULL: all are
                                          (non-floating outputs never are) */
  ebb_function_forward_fn forward;     /* required */
  ebb_function_setup_fn setup_context; /* optional */
  ebb_function_backward_fn backward;   /* NULL: none (see above) */
  void *user;                          /* for the callbacks: ebb_custom_op_user */
  /* The op's kernels and the image they live in. image_name NULL: the op's name. image: the
   * library's fatbin or cubin, readable until the last ebb_shutdown; NULL: no GPU code (the
   * kernels run on CPU tensors and the emulated driver only). Several ops may share one image:
   * the same name with the same image is the same image. */
  const char *image_name;
  const void *image;
  const ebb_custom_op_kernel *kernels; /* nkernels entries; may be NULL when nkernels is 0 */
  int nkernels;                        /* 0..EBB_CUSTOM_OP_MAX_KERNELS */
} ebb_custom_op_def;

/* Registers the op `def` describes and puts its handle in *out (out may be NULL: find it by name
 * later). The definition is read during the call only, except its callbacks, user pointer and
 * image bytes, which must stay valid until the last ebb_shutdown.
 * Failures (nothing registered): EBB_EINVAL for a NULL def, an unknown version, a NULL, empty or
 * too long name, counts out of range, a NULL forward, kernels NULL with nkernels > 0, a kernel
 * without a name, or an image or kernel the runtime refuses (an image name added before with
 * other bytes; a kernel name declared before with other parameters, in another image, or with
 * neither function), or a name an op registered already has (the op there stays); EBB_ELIMIT past
 * EBB_CUSTOM_OP_MAX ops or the runtime's image or kernel tables; EBB_ENOTINIT before ebb_init.
 * Messages name the op and, for a kernel, the kernel and the runtime's reason. */
EBB_API ebb_status ebb_custom_op_register(const ebb_custom_op_def *def, ebb_custom_op_t **out);

/* The registered op called `name`. EBB_ENOTFOUND when there is none; EBB_EINVAL for NULL. */
EBB_API ebb_status ebb_custom_op_find(const char *name, ebb_custom_op_t **out);

/* Runs op on inputs[0..ninputs) (NULL entries: optional inputs not given; inputs may be NULL
 * when the op takes none) and puts its noutputs results, new references, in outputs[0..): one
 * ebb_function_apply of the op's function (ebb/function.h: recording, the ctx, errors), with
 * `args` passed to the callbacks as given. On failure nothing is returned in outputs.
 * EBB_EINVAL for a NULL or unregistered op (one from before the last ebb_shutdown included),
 * NULL outputs, or NULL inputs when the op takes some; the errors of ebb_function_apply, named
 * by the op. */
EBB_API ebb_status ebb_custom_op_call(const ebb_custom_op_t *op, const ebb_tensor_t *const *inputs, const void *args,
                                      ebb_tensor_t **outputs);

/* The op's kernel i (in the definition's order), for its forward and backward to launch with
 * ebb_op_launch_kernel. EBB_EINVAL for a NULL or unregistered op, i outside [0, nkernels) or
 * NULL out. */
EBB_API ebb_status ebb_custom_op_kernel_get(const ebb_custom_op_t *op, int i, const ebb_kernel_t **out);

/* The op whose callback runs with ctx: the forward, setup_context and backward of a custom op
 * get their op from their ctx (ebb_ctx_function_user(ctx) is the op's handle, not the
 * definition's user pointer). NULL when ctx is NULL or not a custom op's. */
EBB_API ebb_custom_op_t *ebb_custom_op_of(const ebb_function_ctx *ctx);
/* The definition's user pointer (NULL for a NULL or unregistered op). */
EBB_API void *ebb_custom_op_user(const ebb_custom_op_t *op);
/* The op's name ("(invalid op)" for a NULL or unregistered op). */
EBB_API const char *ebb_custom_op_name(const ebb_custom_op_t *op);
/* Ops registered since the last completed ebb_shutdown. */
EBB_API int ebb_custom_op_count(void);

#ifdef __cplusplus
}
#endif

#endif /* EBB_CUSTOM_OP_H */
