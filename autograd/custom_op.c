/* custom_op.c: the registry of custom ops (ebb/custom_op.h): named ops a library adds, each a
 * custom function (ebb/function.h) with its kernels declared in the library's own image.
 *
 * Owns: a fixed table of op records, each holding the op's copied name and flags, the
 * ebb_function its calls apply (its name is the record's, its user pointer the record itself) and
 * the handles of the kernels declared at registration. A call is one check of the handle and one
 * ebb_function_apply: the op costs what a custom function costs, nothing per call beyond it.
 * Two callbacks stand in for the definition's where the definition needs help: setup_context,
 * when some output is declared non-differentiable (it marks them, then runs the definition's own
 * setup_context), and backward, when none was registered (it fails naming the op).
 *
 * Lifetime: records are the runtime session's, as kernels are: the module's stop (the last
 * ebb_shutdown, through autograd's stop in graph.c) clears them. Each session takes its entries
 * after the previous session's, wrapping around, so a handle from before a completed shutdown
 * points at a cleared entry (refused) rather than at a new op, until EBB_CUSTOM_OP_MAX ops have
 * been registered since. Records are never freed: a handle is always a readable pointer.
 * Threading: registration and lookup by name take the registry lock (a leaf: the runtime calls
 * that declare kernels are made before it is taken); a record is written in full before its
 * magic is stored with release, and calls read the magic with acquire, so a call never sees a
 * half-written op.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "ebb/custom_op.h"
#include "ebb/function.h"
#include "ebb/ops.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "autograd_impl.h"

#define EBB__COP_MAGIC 0x6562636fu /* "ebco" */

struct ebb_custom_op {
  _Atomic uint32_t magic;               /* EBB__COP_MAGIC while registered, 0 otherwise */
  char name[EBB_CUSTOM_OP_NAME_MAX + 1];
  int ninputs;
  uint64_t nondiff;                     /* bit k: output k declared non-differentiable */
  ebb_function_setup_fn setup_context;  /* the definition's, run by mark_then_setup */
  void *user;                           /* the definition's user pointer */
  ebb_function fn;                      /* what calls apply: name = this->name, user = this */
  int nkernels;
  const ebb_kernel_t *kernels[EBB_CUSTOM_OP_MAX_KERNELS];
};

static ebb_mutex ebb__cop_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.custom_ops", EBB_RANK_LEAF};
static struct ebb_custom_op ebb__cops[EBB_CUSTOM_OP_MAX];
/* This session's ops are entries base .. base + count - 1 (mod EBB_CUSTOM_OP_MAX); under the
 * lock. count is read without it by ebb_custom_op_count (relaxed: a figure for tests). */
static int ebb__cop_base;
static _Atomic int ebb__cop_count;
#define EBB__COP(i) (&ebb__cops[(ebb__cop_base + (i)) % EBB_CUSTOM_OP_MAX])

/* Whether op is a record of this session. acquire: pairs with the release store of the magic at
 * registration, so the record's fields are visible. */
static inline bool op_live(const ebb_custom_op_t *op) {
  return op && atomic_load_explicit(&((ebb_custom_op_t *)op)->magic, memory_order_acquire) == EBB__COP_MAGIC;
}

static ebb_status bad_op(const char *fn, const ebb_custom_op_t *op) {
  return ebb__fail(EBB_EINVAL, "%s: op handle %p is %s; expected one from ebb_custom_op_register or ebb_custom_op_find of this ebb_init", fn,
                   (const void *)op, op ? "not a registered op (or one from before the last ebb_shutdown)" : "NULL");
}

/* ---- the callbacks that stand in for the definition's ------------------------------------------ */

/* setup_context of an op with non-differentiable outputs: marks them, then the definition's. */
static ebb_status mark_then_setup(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs, const void *args,
                                  ebb_tensor_t *const *outputs, int noutputs) {
  const struct ebb_custom_op *op = ebb_ctx_function_user(ctx);
  const ebb_tensor_t *nd[EBB_FUNCTION_MAX_OUTPUTS];
  int n = 0;
  for (int k = 0; k < noutputs && k < EBB_FUNCTION_MAX_OUTPUTS; k++)
    if ((op->nondiff >> k & 1) && outputs[k]) nd[n++] = outputs[k];
  if (n) {
    ebb_status st = ebb_ctx_mark_non_differentiable(ctx, nd, n);
    if (st) return st;
  }
  return op->setup_context ? op->setup_context(ctx, inputs, ninputs, args, outputs, noutputs) : EBB_OK;
}

/* backward of an op registered without one: reached only when a gradient must flow through it. */
static ebb_status no_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *grad_outputs, int noutputs,
                              ebb_tensor_t **grad_inputs, int *ngrad_inputs) {
  (void)grad_outputs, (void)noutputs, (void)grad_inputs, (void)ngrad_inputs;
  const struct ebb_custom_op *op = ebb_ctx_function_user(ctx);
  int need = -1;
  for (int i = 0; i < op->ninputs && need < 0; i++) {
    bool b = false;
    if (ebb_ctx_needs_input_grad(ctx, i, &b) == EBB_OK && b) need = i;
  }
  char which[48] = "";
  if (need >= 0) snprintf(which, sizeof which, " (input %d needs one)", need);
  return ebb__fail(EBB_ENOTSUP,
                   "custom op '%s': a gradient has to flow through it%s and it was registered without a backward; expected "
                   "ebb_custom_op_def.backward, or inputs that require no gradient",
                   op->name, which);
}

/* ---- registration --------------------------------------------------------------------------------- */

static ebb_status check_def(const char *fn, const ebb_custom_op_def *def) {
  if (!def) return ebb__fail(EBB_EINVAL, "%s: def is NULL; expected an op definition", fn);
  if (def->version != 0 && def->version != EBB_CUSTOM_OP_VERSION)
    return ebb__fail(EBB_EINVAL, "%s: def->version is %u; expected 0 or %d (EBB_CUSTOM_OP_VERSION)", fn, def->version, EBB_CUSTOM_OP_VERSION);
  if (!def->name || !def->name[0] || strlen(def->name) > EBB_CUSTOM_OP_NAME_MAX)
    return ebb__fail(EBB_EINVAL, "%s: def->name is %s; expected 1..%d bytes", fn, !def->name ? "NULL" : !def->name[0] ? "empty" : "too long",
                     EBB_CUSTOM_OP_NAME_MAX);
  const char *nm = def->name;
  if (def->ninputs < 0 || def->ninputs > EBB_FUNCTION_MAX_INPUTS)
    return ebb__fail(EBB_EINVAL, "%s: op '%s': ninputs is %d; expected 0..%d", fn, nm, def->ninputs, EBB_FUNCTION_MAX_INPUTS);
  if (def->noutputs < 1 || def->noutputs > EBB_FUNCTION_MAX_OUTPUTS)
    return ebb__fail(EBB_EINVAL, "%s: op '%s': noutputs is %d; expected 1..%d", fn, nm, def->noutputs, EBB_FUNCTION_MAX_OUTPUTS);
  if (!def->forward) return ebb__fail(EBB_EINVAL, "%s: op '%s': forward is NULL; expected the function that computes its outputs", fn, nm);
  if (def->nkernels < 0 || def->nkernels > EBB_CUSTOM_OP_MAX_KERNELS || (def->nkernels > 0 && !def->kernels))
    return ebb__fail(EBB_EINVAL, "%s: op '%s': %d kernels%s; expected 0..%d in a non-NULL array", fn, nm, def->nkernels,
                     def->nkernels > 0 && !def->kernels ? " with kernels NULL" : "", EBB_CUSTOM_OP_MAX_KERNELS);
  for (int i = 0; i < def->nkernels; i++)
    if (!def->kernels[i].name || !def->kernels[i].name[0])
      return ebb__fail(EBB_EINVAL, "%s: op '%s': kernels[%d] has %s name; expected its registry name", fn, nm, i,
                       def->kernels[i].name ? "an empty" : "a NULL");
  return EBB_OK;
}

/* The image and kernels of def, declared with the runtime (outside the registry lock: these
 * calls take the runtime's kernel lock). A kernel declared before with the same parameters is
 * the same kernel, so a failed registration leaves nothing that blocks a corrected one. */
static ebb_status declare_kernels(const char *fn, const ebb_custom_op_def *def, const ebb_kernel_t **out) {
  if (def->nkernels == 0) return EBB_OK;
  const char *iname = def->image_name ? def->image_name : def->name;
  const ebb_kernel_image_t *img;
  char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
  ebb_status st = ebb_kernel_add_image(iname, def->image, &img);
  if (st) {
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: op '%s': its image '%s' was refused: %s", fn, def->name, iname, why);
  }
  for (int i = 0; i < def->nkernels; i++) {
    const ebb_custom_op_kernel *k = &def->kernels[i];
    st = ebb_kernel_declare_in(img, k->name, k->arg_bytes, k->cpu_fn, k->cuda_name, &out[i]);
    if (st) {
      snprintf(why, sizeof why, "%s", ebb_last_error());
      return ebb__fail(st, "%s: op '%s': kernels[%d] '%s' could not be declared in image '%s': %s", fn, def->name, i, k->name, iname, why);
    }
  }
  return EBB_OK;
}

ebb_status ebb_custom_op_register(const ebb_custom_op_def *def, ebb_custom_op_t **out) {
  static const char fn[] = "ebb_custom_op_register";
  ebb_status st = check_def(fn, def);
  if (st) return st;
  if (!ebb_is_initialized()) return ebb__fail(EBB_ENOTINIT, "%s: op '%s': ebb is not initialised; call ebb_init first", fn, def->name);
  const ebb_kernel_t *kernels[EBB_CUSTOM_OP_MAX_KERNELS];
  st = declare_kernels(fn, def, kernels);
  if (st) return st;
  uint64_t nondiff = 0;
  if (def->differentiable)
    for (int k = 0; k < def->noutputs; k++)
      if (!def->differentiable[k]) nondiff |= 1ull << k;

  ebb__mutex_lock(&ebb__cop_mu);
  int count = atomic_load_explicit(&ebb__cop_count, memory_order_relaxed);
  for (int i = 0; i < count; i++) {
    if (strcmp(EBB__COP(i)->name, def->name) == 0) {
      ebb__mutex_unlock(&ebb__cop_mu);
      return ebb__fail(EBB_EINVAL, "%s: an op named '%s' is registered already (%d inputs, %d outputs); expected a name not in use", fn,
                       def->name, EBB__COP(i)->ninputs, EBB__COP(i)->fn.noutputs);
    }
  }
  if (count == EBB_CUSTOM_OP_MAX) {
    ebb__mutex_unlock(&ebb__cop_mu);
    return ebb__fail(EBB_ELIMIT, "%s: %d ops registered already (the maximum); '%s' not added", fn, EBB_CUSTOM_OP_MAX, def->name);
  }
  struct ebb_custom_op *op = EBB__COP(count);
  snprintf(op->name, sizeof op->name, "%s", def->name);
  op->ninputs = def->ninputs;
  op->nondiff = nondiff;
  op->setup_context = def->setup_context;
  op->user = def->user;
  op->fn = (ebb_function){
      .version = EBB_FUNCTION_VERSION,
      .name = op->name,
      .noutputs = def->noutputs,
      .forward = def->forward,
      /* the definition's own callbacks when they need no help: a call then costs one apply */
      .setup_context = nondiff ? mark_then_setup : def->setup_context,
      .backward = def->backward ? def->backward : no_backward,
      .user = op,
  };
  op->nkernels = def->nkernels;
  for (int i = 0; i < def->nkernels; i++) op->kernels[i] = kernels[i];
  /* release: pairs with the acquire in op_live; the record is complete */
  atomic_store_explicit(&op->magic, EBB__COP_MAGIC, memory_order_release);
  atomic_store_explicit(&ebb__cop_count, count + 1, memory_order_relaxed);
  ebb__mutex_unlock(&ebb__cop_mu);
  if (out) *out = op;
  return EBB_OK;
}

ebb_status ebb_custom_op_find(const char *name, ebb_custom_op_t **out) {
  static const char fn[] = "ebb_custom_op_find";
  if (!name || !out) return ebb__fail(EBB_EINVAL, "%s: %s is NULL; expected an op name and a handle to fill", fn, !name ? "name" : "out");
  ebb__mutex_lock(&ebb__cop_mu);
  int count = atomic_load_explicit(&ebb__cop_count, memory_order_relaxed);
  for (int i = 0; i < count; i++) {
    if (strcmp(EBB__COP(i)->name, name) == 0) {
      *out = EBB__COP(i);
      ebb__mutex_unlock(&ebb__cop_mu);
      return EBB_OK;
    }
  }
  ebb__mutex_unlock(&ebb__cop_mu);
  return ebb__fail(EBB_ENOTFOUND, "%s: no op named '%s' is registered (%d ops are)", fn, name, count);
}

/* ---- calls and accessors ---------------------------------------------------------------------- */

ebb_status ebb_custom_op_call(const ebb_custom_op_t *op, const ebb_tensor_t *const *inputs, const void *args, ebb_tensor_t **outputs) {
  if (EBB_UNLIKELY(!op_live(op))) return bad_op("ebb_custom_op_call", op);
  if (EBB_UNLIKELY(!outputs))
    return ebb__fail(EBB_EINVAL, "ebb_custom_op_call: op '%s': outputs is NULL; expected room for %d output handles", op->name, op->fn.noutputs);
  if (EBB_UNLIKELY(!inputs && op->ninputs > 0))
    return ebb__fail(EBB_EINVAL, "ebb_custom_op_call: op '%s': inputs is NULL; expected %d input tensors", op->name, op->ninputs);
  return ebb_function_apply(&op->fn, inputs, op->ninputs, args, outputs);
}

ebb_status ebb_custom_op_kernel_get(const ebb_custom_op_t *op, int i, const ebb_kernel_t **out) {
  if (EBB_UNLIKELY(!op_live(op))) return bad_op("ebb_custom_op_kernel_get", op);
  if (EBB_UNLIKELY(i < 0 || i >= op->nkernels || !out))
    return ebb__fail(EBB_EINVAL, "ebb_custom_op_kernel_get: op '%s': %s; expected 0 <= i < %d and a handle to fill", op->name,
                     out ? "kernel index out of range" : "out is NULL", op->nkernels);
  *out = op->kernels[i];
  return EBB_OK;
}

ebb_custom_op_t *ebb_custom_op_of(const ebb_function_ctx *ctx) {
  if (!ctx) return NULL;
  /* The function's user pointer is the op's record for a custom op's ctx; any other function's
   * is the caller's and is not read: only a pointer to a record of the table can be an op. */
  uintptr_t p = (uintptr_t)ebb_ctx_function_user(ctx), lo = (uintptr_t)ebb__cops, hi = (uintptr_t)(ebb__cops + EBB_CUSTOM_OP_MAX);
  if (p < lo || p >= hi || (p - lo) % sizeof ebb__cops[0]) return NULL;
  ebb_custom_op_t *op = (ebb_custom_op_t *)p;
  return op_live(op) ? op : NULL;
}

void *ebb_custom_op_user(const ebb_custom_op_t *op) { return op_live(op) ? op->user : NULL; }

const char *ebb_custom_op_name(const ebb_custom_op_t *op) { return op_live(op) ? op->name : "(invalid op)"; }

int ebb_custom_op_count(void) { return atomic_load_explicit(&ebb__cop_count, memory_order_relaxed); }

/* The module's stop (autograd's, at the last ebb_shutdown, once no node is live): forgets this
 * session's ops, as the runtime forgets their kernels. */
void ebb__custom_ops_stop(void) {
  ebb__mutex_lock(&ebb__cop_mu);
  int count = atomic_load_explicit(&ebb__cop_count, memory_order_relaxed);
  for (int i = 0; i < count; i++) atomic_store_explicit(&EBB__COP(i)->magic, 0, memory_order_relaxed);
  ebb__cop_base = (ebb__cop_base + count) % EBB_CUSTOM_OP_MAX;
  atomic_store_explicit(&ebb__cop_count, 0, memory_order_relaxed);
  ebb__mutex_unlock(&ebb__cop_mu);
}
