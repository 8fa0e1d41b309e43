/* bench_custom_op.c: what a custom op (ebb/custom_op.h) costs against the built-in op it
 * copies: ebb_op_mul's own CPU kernel (ops' strided elementwise kernel, ebb__ew_cpu, with its
 * multiply) registered as the custom op "bench.mul", whose forward launches it through
 * ebb_op_launch_kernel and saves both inputs, and whose backward is ebb_op_mul's derivative
 * entry (grad * b and grad * a, the gradients the node needs only), against ebb_op_mul itself.
 * One step: y = mul(a, b) on f32 CPU tensors of `size` elements that require gradients, then
 * ebb_backward from y with a gradient of ones (accumulating into a's and b's .grad), then y
 * released. The two are timed in interleaved runs of `count` steps each; the line gives the
 * median over `reps` runs of ns per step:
 *   bench=custom_op size=<n> custom_ns=<x> builtin_ns=<y>
 * usage: ebb-bench-custom_op [reps] [sizes...]   (default 11 runs; sizes 1 and 1048576)
 * EBB_BENCH_CUSTOM_OP_IMPL=custom or builtin runs only that one (its figure printed, the other 0),
 * for a callgrind count of one side.
 * The program links the static libebb: the kernel's CPU function and argument struct are ops'
 * own (ops/ops_kernels.h), not part of the public API.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ebb/autograd.h"
#include "ebb/custom_op.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ops_kernels.h"

/* ops' elementwise kernel, the one ebb_op_mul runs on CPU tensors (ops/kernels_cpu.c). */
void ebb__ew_cpu(void *args);

static ebb_status mul_forward(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int nin, const void *args, ebb_tensor_t **out,
                              int nout) {
  (void)nin, (void)args, (void)nout;
  const ebb_custom_op_t *op = ebb_custom_op_of(ctx);
  const ebb_kernel_t *k;
  ebb_status st = ebb_custom_op_kernel_get(op, 0, &k);
  ebb_tensor_info info;
  if (!st) st = ebb_tensor_get_info(in[0], &info);
  if (st) return st;
  ebb_tensor_t *y;
  st = ebb_tensor_empty(info.device, info.dtype, info.ndim, info.shape, &y);
  if (st) return st;
  /* what ebb_op_mul hands the kernel for two contiguous f32 operands: one coalesced dim */
  ebb__ew_args a;
  memset(&a, 0, sizeof a);
  a.op = EBB__EW_MUL;
  a.ndim = 1;
  a.nin = 2;
  a.dt_out = a.dt_in[0] = a.dt_in[1] = EBB__KDT_F32;
  a.shape[0] = info.numel;
  a.st_out[0] = a.st_in[0][0] = a.st_in[1][0] = 1;
  void *pa, *pb;
  st = ebb_tensor_data(y, &a.out);
  if (!st) st = ebb_tensor_data(in[0], &pa);
  if (!st) st = ebb_tensor_data(in[1], &pb);
  a.in[0] = pa;
  a.in[1] = pb;
  ebb_op_operand ops[3] = {{in[0], false}, {in[1], false}, {y, true}};
  if (!st) st = ebb_op_launch_kernel(k, &a, ops, 3, info.numel);
  if (!st) st = ebb_ctx_save_for_backward(ctx, in, 2);
  if (st) {
    ebb_tensor_release(y);
    return st;
  }
  out[0] = y;
  return EBB_OK;
}

static ebb_status mul_backward(ebb_function_ctx *ctx, const ebb_tensor_t *const *grad_outputs, int nout, ebb_tensor_t **grad_inputs,
                               int *ngrad) {
  (void)nout, (void)ngrad;
  const ebb_tensor_t *const *saved;
  int nsaved;
  bool need_a = false, need_b = false;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &saved, &nsaved);
  if (!st) st = ebb_ctx_needs_input_grad(ctx, 0, &need_a);
  if (!st) st = ebb_ctx_needs_input_grad(ctx, 1, &need_b);
  if (st) return st;
  /* ebb_op_mul's derivative entry for operands of one shape: grad * b and grad * a, each an
   * ebb_op_mul (ebb_op_mul_backward gives the same values through its broadcasting checks and
   * sum-to-shape, about 900 instructions a step more: perf/JOURNAL.md) */
  if (need_a) st = ebb_op_mul(grad_outputs[0], saved[1], &grad_inputs[0]);
  if (!st && need_b) st = ebb_op_mul(grad_outputs[0], saved[0], &grad_inputs[1]);
  return st;
}

static const ebb_custom_op_kernel mul_kernel = {
    .name = "bench.mul", .arg_bytes = sizeof(ebb__ew_args), .cpu_fn = ebb__ew_cpu, .cuda_name = NULL};

static const ebb_custom_op_t *register_mul(void) {
  ebb_custom_op_def def;
  memset(&def, 0, sizeof def);
  def.version = EBB_CUSTOM_OP_VERSION;
  def.name = "bench.mul";
  def.ninputs = 2;
  def.noutputs = 1;
  def.forward = mul_forward;
  def.backward = mul_backward;
  def.image_name = "bench.custom_op"; /* CPU only: no GPU code of its own */
  def.kernels = &mul_kernel;
  def.nkernels = 1;
  ebb_custom_op_t *op;
  BENCH_CHECK(ebb_custom_op_register(&def, &op));
  return op;
}

/* ns per step of `count` steps, with the custom op or ebb_op_mul. */
static double run(const ebb_custom_op_t *op, ebb_tensor_t *a, ebb_tensor_t *b, const ebb_tensor_t *g, int count) {
  const ebb_tensor_t *in[2] = {a, b};
  uint64_t t0 = bench_now_ns();
  for (int i = 0; i < count; i++) {
    ebb_tensor_t *y;
    if (op) BENCH_CHECK(ebb_custom_op_call(op, in, NULL, &y));
    else BENCH_CHECK(ebb_op_mul(a, b, &y));
    const ebb_tensor_t *roots[1] = {y}, *groots[1] = {g};
    BENCH_CHECK(ebb_backward(roots, groots, 1, false, NULL, 0));
    BENCH_CHECK(ebb_tensor_release(y));
  }
  return (double)(bench_now_ns() - t0) / count;
}

static void bench_size(const ebb_custom_op_t *op, int64_t size, int reps) {
  ebb_tensor_t *a, *b, *g;
  BENCH_CHECK(ebb_tensor_full(EBB_DEVICE_CPU, EBB_F32, 1, &size, 1.5, &a));
  BENCH_CHECK(ebb_tensor_full(EBB_DEVICE_CPU, EBB_F32, 1, &size, -0.5, &b));
  BENCH_CHECK(ebb_tensor_ones(EBB_DEVICE_CPU, EBB_F32, 1, &size, &g));
  BENCH_CHECK(ebb_tensor_set_requires_grad(a, true));
  BENCH_CHECK(ebb_tensor_set_requires_grad(b, true));
  /* about 20 ms a run at either size */
  int count = size <= 1024 ? 20000 : (int)(2e7 / (double)size) + 1;
  double *vc = calloc((size_t)reps, sizeof *vc), *vb = calloc((size_t)reps, sizeof *vb);
  const char *only = getenv("EBB_BENCH_CUSTOM_OP_IMPL");
  bool do_c = !only || !strcmp(only, "custom"), do_b = !only || !strcmp(only, "builtin");
  if (do_c) run(op, a, b, g, count / 4 + 1); /* warm: .grad buffers, the allocator's caches */
  if (do_b) run(NULL, a, b, g, count / 4 + 1);
  for (int r = 0; r < reps; r++) {
    /* alternate which goes first, so neither always runs on the other's warm caches */
    if (r % 2 == 0) {
      if (do_c) vc[r] = run(op, a, b, g, count);
      if (do_b) vb[r] = run(NULL, a, b, g, count);
    } else {
      if (do_b) vb[r] = run(NULL, a, b, g, count);
      if (do_c) vc[r] = run(op, a, b, g, count);
    }
  }
  printf("bench=custom_op size=%lld custom_ns=%.1f builtin_ns=%.1f\n", (long long)size, bench_median(vc, (size_t)reps),
         bench_median(vb, (size_t)reps));
  fflush(stdout);
  free(vc);
  free(vb);
  BENCH_CHECK(ebb_tensor_release(a));
  BENCH_CHECK(ebb_tensor_release(b));
  BENCH_CHECK(ebb_tensor_release(g));
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 11;
  if (reps < 1) reps = 1;
  BENCH_CHECK(ebb_init());
  const ebb_custom_op_t *op = register_mul();
  if (argc > 2) {
    for (int i = 2; i < argc; i++) bench_size(op, atoll(argv[i]), reps);
  } else {
    bench_size(op, 1, reps);
    bench_size(op, 1048576, reps);
  }
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
