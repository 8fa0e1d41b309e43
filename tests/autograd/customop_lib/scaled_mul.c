/* scaled_mul.c: the test library's op "ebbtest.scaled_mul" (scaled_mul.h): its CPU kernel, its
 * forward, setup_context and backward, written against ebb's public headers only, as a
 * third-party library would be. */
#include "scaled_mul.h"

#include <stdlib.h>
#include <string.h>

#include "ebb/ops.h"
#include "scaled_mul_kernel.h"

long ebbtest_forward_calls, ebbtest_backward_calls;

#ifdef EBB_HAVE_FATBIN
extern const unsigned char ebbtest_fatbin[]; /* cuda/scaled_mul.cu, embedded by the build */
const void *ebbtest_image(void) { return ebbtest_fatbin; }
#else
const void *ebbtest_image(void) { return NULL; }
#endif

void ebbtest_smul_cpu(void *args) {
  const ebbtest_smul_args *a = args;
  if (a->dtype == 0) {
    const float *x = a->a, *w = a->b;
    float *y = a->y, *m = a->mask, al = (float)a->alpha;
    for (int64_t i = 0; i < a->n; i++) {
      float p = x[i] * w[i];
      y[i] = al * p;
      if (m) m[i] = p > 0.0f ? 1.0f : 0.0f;
    }
  } else {
    const double *x = a->a, *w = a->b;
    double *y = a->y, *m = a->mask;
    for (int64_t i = 0; i < a->n; i++) {
      double p = x[i] * w[i];
      y[i] = a->alpha * p;
      if (m) m[i] = p > 0.0 ? 1.0 : 0.0;
    }
  }
}

/* out = alpha * a * b (and the mask when given) through the op's kernel; a, b contiguous. */
static ebb_status launch(const ebb_function_ctx *ctx, double alpha, const ebb_tensor_t *a, const ebb_tensor_t *b, ebb_tensor_t **out,
                         ebb_tensor_t **mask) {
  const ebb_kernel_t *k;
  ebb_status st = ebb_custom_op_kernel_get(ebb_custom_op_of(ctx), 0, &k);
  if (st) return st;
  ebb_tensor_info info;
  st = ebb_tensor_get_info(a, &info);
  if (st) return st;
  int64_t n = 1;
  for (int d = 0; d < info.ndim; d++) n *= info.shape[d];
  ebbtest_smul_args args;
  memset(&args, 0, sizeof args);
  args.n = n;
  args.dtype = info.dtype == EBB_F32 ? 0 : 1;
  args.alpha = alpha;
  ebb_tensor_t *y = NULL, *m = NULL;
  st = ebb_tensor_empty(info.device, info.dtype, info.ndim, info.shape, &y);
  if (!st && mask) st = ebb_tensor_empty(info.device, info.dtype, info.ndim, info.shape, &m);
  void *pa = NULL, *pb = NULL;
  if (!st) st = ebb_tensor_data(a, &pa);
  if (!st) st = ebb_tensor_data(b, &pb);
  args.a = pa;
  args.b = pb;
  if (!st) st = ebb_tensor_data(y, &args.y);
  if (!st && m) st = ebb_tensor_data(m, &args.mask);
  ebb_op_operand ops[4] = {{a, false}, {b, false}, {y, true}, {m, true}};
  if (!st) st = ebb_op_launch_kernel(k, &args, ops, m ? 4 : 3, n);
  if (st) {
    if (y) ebb_tensor_release(y);
    if (m) ebb_tensor_release(m);
    return st;
  }
  *out = y;
  if (mask) *mask = m;
  return EBB_OK;
}

/* A contiguous tensor with t's values: a new reference (t itself when it is contiguous). */
static ebb_status contiguous(const ebb_tensor_t *t, ebb_tensor_t **out) {
  bool c = false;
  ebb_status st = ebb_tensor_is_contiguous(t, &c);
  if (st) return st;
  if (!c) return ebb_tensor_contiguous(t, out);
  st = ebb_tensor_retain((ebb_tensor_t *)t);
  if (!st) *out = (ebb_tensor_t *)t;
  return st;
}

static ebb_status smul_forward(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs, const void *args,
                               ebb_tensor_t **outputs, int noutputs) {
  (void)ninputs, (void)noutputs;
  __atomic_fetch_add(&ebbtest_forward_calls, 1, __ATOMIC_RELAXED);
  const ebbtest_smul_params *p = args;
  ebb_tensor_info xi, wi;
  ebb_status st = ebb_tensor_get_info(inputs[0], &xi);
  if (!st) st = ebb_tensor_get_info(inputs[1], &wi);
  if (st) return st;
  if (xi.ndim != wi.ndim || memcmp(xi.shape, wi.shape, sizeof(int64_t) * (size_t)xi.ndim) != 0 || xi.dtype != wi.dtype ||
      (xi.dtype != EBB_F32 && xi.dtype != EBB_F64))
    return EBB_EINVAL; /* x and w of one shape and one floating dtype */
  ebb_tensor_t *x = NULL, *w = NULL;
  st = contiguous(inputs[0], &x);
  if (!st) st = contiguous(inputs[1], &w);
  if (!st) st = launch(ctx, p ? p->alpha : 1.0, x, w, &outputs[0], &outputs[1]);
  if (x) ebb_tensor_release(x);
  if (w) ebb_tensor_release(w);
  return st;
}

static ebb_status smul_setup(ebb_function_ctx *ctx, const ebb_tensor_t *const *inputs, int ninputs, const void *args,
                             ebb_tensor_t *const *outputs, int noutputs) {
  (void)outputs, (void)noutputs;
  const ebbtest_smul_params *p = args;
  /* alpha for backward: the args are the caller's and gone by then */
  double *alpha = NULL;
  bool need = false;
  for (int i = 0; i < ninputs; i++) {
    bool b = false;
    ebb_status st = ebb_ctx_needs_input_grad(ctx, i, &b);
    if (st) return st;
    need = need || b;
  }
  if (!need) return EBB_OK;
  alpha = malloc(sizeof *alpha);
  if (!alpha) return EBB_ENOMEM;
  *alpha = p ? p->alpha : 1.0;
  ebb_status st = ebb_ctx_set_user(ctx, alpha, free);
  if (st) {
    free(alpha);
    return st;
  }
  return ebb_ctx_save_for_backward(ctx, inputs, 2);
}

static ebb_status smul_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *grad_outputs, int noutputs, ebb_tensor_t **grad_inputs,
                                int *ngrad_inputs) {
  (void)noutputs;
  __atomic_fetch_add(&ebbtest_backward_calls, 1, __ATOMIC_RELAXED);
  const ebb_tensor_t *const *saved;
  int nsaved;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &saved, &nsaved);
  if (st) return st;
  const double *alpha = ebb_ctx_user(ctx);
  ebb_tensor_t *g = NULL;
  st = contiguous(grad_outputs[0], &g);
  for (int i = 0; i < 2 && !st; i++) {
    bool need = false;
    st = ebb_ctx_needs_input_grad(ctx, i, &need);
    if (!st && need) st = launch(ctx, *alpha, g, saved[1 - i], &grad_inputs[i], NULL);
  }
  if (g) ebb_tensor_release(g);
  *ngrad_inputs = 2;
  return st;
}

static const ebb_custom_op_kernel ebbtest_kernels[1] = {
    {.name = "ebbtest.smul", .arg_bytes = sizeof(ebbtest_smul_args), .cpu_fn = ebbtest_smul_cpu, .cuda_name = "ebbtest_smul"},
};
static const bool ebbtest_differentiable[2] = {true, false};

void ebbtest_scaled_mul_def(ebb_custom_op_def *def) {
  memset(def, 0, sizeof *def);
  def->version = EBB_CUSTOM_OP_VERSION;
  def->name = "ebbtest.scaled_mul";
  def->ninputs = 2;
  def->noutputs = 2;
  def->differentiable = ebbtest_differentiable;
  def->forward = smul_forward;
  def->setup_context = smul_setup;
  def->backward = smul_backward;
  def->image_name = "ebbtest";
  def->image = ebbtest_image();
  def->kernels = ebbtest_kernels;
  def->nkernels = 1;
}
