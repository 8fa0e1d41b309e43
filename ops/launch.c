/* launch.c: the ops module's start and stop, and the launch path every op goes through.
 *
 * Owns: ops' kernel table (one name, CUDA function, argument struct and CPU function per kernel
 * family), ops' kernel image (registered by the module's start) and the cache of declared kernel
 * handles (declared at first use after each ebb_init, dropped by the module's stop, ops_stop);
 * ebb__launch, which runs a CPU kernel on the calling thread or enqueues a device kernel on the
 * device's current stream; the declaration of the operands' storages as used on that stream.
 * Threading: the cache is filled with release stores and read with acquire loads; racing
 * threads declare the same kernel and get the same handle.
 */
#include <stdio.h>

#include "ops_impl.h"
#include "ops_export.h"
#include "optim_kernels.h" /* the optimizer kernel's argument struct, for its registration */

/* The kernels of ops, by id: one name for the registry and the emulated driver, the CUDA
 * function in the fatbin, the argument struct, and the CPU function (CPU tensors call it
 * directly; the emulated driver runs it on a device engine thread). */
static const struct {
  const char *name, *cuda_name;
  size_t arg_bytes;
  ebb_kernel_cpu_fn fn;
} ebb__kernel_defs[EBB__K_COUNT] = {
    [EBB__K_EW] = {"ebb.ops.ew", "ebb_ops_ew", sizeof(ebb__ew_args), ebb__ew_cpu},
    [EBB__K_REDUCE] = {"ebb.ops.reduce", "ebb_ops_reduce", sizeof(ebb__red_args), ebb__reduce_cpu},
    [EBB__K_MATMUL] = {"ebb.ops.matmul", "ebb_ops_matmul", sizeof(ebb__mm_args), ebb__matmul_cpu},
    [EBB__K_ROWS] = {"ebb.ops.rows", "ebb_ops_rows", sizeof(ebb__rows_args), ebb__rows_cpu},
    [EBB__K_OPTIM] = {"ebb.ops.optim", "ebb_ops_optim", sizeof(ebb__optim_args), ebb__optim_cpu},
    /* the GPU's f32 elementwise kernel; the CPU kernels serve it as they serve "ebb.ops.ew" */
    [EBB__K_EW_F32] = {"ebb.ops.ew_f32", "ebb_ops_ew_f32", sizeof(ebb__ew_args), ebb__ew_cpu},
};

static _Atomic(const ebb_kernel_t *) ebb__kernels[EBB__K_COUNT];

#ifdef EBB_HAVE_FATBIN
/* ops' CUDA kernels (ops/cuda/ops_kernels.cu), embedded by ops/CMakeLists.txt. */
extern const unsigned char ebb__fatbin_ops[];
#define EBB__OPS_IMAGE ((const void *)ebb__fatbin_ops)
#else
#define EBB__OPS_IMAGE NULL
#endif
/* ops' image "ebb.ops", registered by the module's start: written before the start returns,
 * read-only until the stop. */
static const ebb_kernel_image_t *ebb__ops_image;

static ebb_status ops_start(void) { return ebb_kernel_add_image("ebb.ops", EBB__OPS_IMAGE, &ebb__ops_image); }

/* The module's stop: the runtime forgets images and declared kernels at the last ebb_shutdown,
 * so does this cache; cuBLAS handles go too. */
static void ops_stop(void) {
  for (int i = 0; i < EBB__K_COUNT; i++) atomic_store_explicit(&ebb__kernels[i], NULL, memory_order_relaxed);
  ebb__ops_image = NULL;
  ebb__blas_stop();
}

static int ops_count(ebb__live_count *out, int max) {
  if (max < 1) return 0;
  out[0] = (ebb__live_count){"tensors", ebb_tensor_live_count()};
  return 1;
}

/* EBB_CPU_VEC caps the instruction set of the CPU kernels (read by kernels_cpu.c when the
 * library loads); checked here with every variable of ebb at the first ebb_init. */
static bool check_cpu_vec(const char *v, char *expected, size_t len) {
  if (!v || !strcmp(v, "baseline") || !strcmp(v, "avx2") || !strcmp(v, "avx512")) return true;
  snprintf(expected, len, "baseline, avx2 or avx512 (the widest instruction set the CPU kernels may use; unset: the widest the processor has)");
  return false;
}

static const ebb__config_var ops_vars[] = {
  {"EBB_CPU_VEC", check_cpu_vec},
};

const ebb__module_desc ebb__module_ops = {
  .name = "ops",
  .layer = EBB__LAYER_OPS,
  .start = ops_start,
  .stop = ops_stop,
  .count = ops_count,
  .vars = ops_vars,
  .nvars = (int)EBB_ARRAY_LEN(ops_vars),
};

static ebb_status tensor_kernel(int kid, const ebb_kernel_t **out) {
  /* acquire: pairs with the release store below (the record is fully written) */
  const ebb_kernel_t *k = atomic_load_explicit(&ebb__kernels[kid], memory_order_acquire);
  if (EBB_LIKELY(k)) {
    *out = k;
    return EBB_OK;
  }
  /* Declaring twice with the same parameters returns the same handle, so racing threads agree
   * without a lock of ours (which would rank below the runtime's locks taken inside). */
  ebb_status st = ebb_kernel_declare_in(ebb__ops_image, ebb__kernel_defs[kid].name, ebb__kernel_defs[kid].arg_bytes, ebb__kernel_defs[kid].fn,
                                     ebb__kernel_defs[kid].cuda_name, &k);
  if (st) return st;
  atomic_store_explicit(&ebb__kernels[kid], k, memory_order_release);
  *out = k;
  return EBB_OK;
}

ebb_status ebb__operands_use(const char *fn, const ebb__operand *ops, int nops, ebb_stream_t *stream) {
  uint64_t sid;
  ebb_status st = ebb__stream_id_of(fn, stream, &sid);
  if (st) return st;
  for (int i = 0; i < nops; i++) {
    st = ebb__storage_use(ops[i].t->stor, stream, sid);
    if (st) return ebb__fail_in(fn, st);
  }
  return EBB_OK;
}

/* Enqueues k on `device`'s current stream over ops[0..nops): declares each storage as used on
 * the stream and, for EBB_CHECK_LAUNCH, as read or written (whole storages: a view's bytes lie
 * inside them, and the declaration is about reachability, not exact extents). */
static ebb_status launch_on_device(const char *fn, const ebb_kernel_t *k, int device, const void *args, const ebb__operand *ops,
                                   int nops, int64_t work) {
  ebb_stream_t *s;
  uint64_t sid;
  ebb_status st = ebb_stream_current(device, &s);
  if (st) return ebb__fail_in(fn, st);
  st = ebb__stream_id_of(fn, s, &sid);
  if (st) return st;
  ebb_buf reads[EBB_OP_LAUNCH_MAX_OPERANDS], writes[EBB_OP_LAUNCH_MAX_OPERANDS];
  int nr = 0, nw = 0;
  for (int i = 0; i < nops; i++) {
    struct ebb__storage *sg = ops[i].t->stor;
    if (!sg->data) continue;
    st = ebb__storage_use(sg, s, sid);
    if (st) return ebb__fail_in(fn, st);
    ebb_buf b = {sg->data, sg->bytes};
    if (ops[i].write && nw < EBB_OP_LAUNCH_MAX_OPERANDS) writes[nw++] = b;
    else if (!ops[i].write && nr < EBB_OP_LAUNCH_MAX_OPERANDS) reads[nr++] = b;
  }
  ebb_launch_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.reads = reads;
  cfg.nreads = nr;
  cfg.writes = writes;
  cfg.nwrites = nw;
  /* 256 threads per block, at most 65535 blocks: grid-stride loops cover the rest */
  int64_t blocks = (work + 255) / 256;
  cfg.block[0] = 256;
  cfg.grid[0] = (unsigned)(blocks < 1 ? 1 : blocks > 65535 ? 65535 : blocks);
  st = ebb_stream_launch(s, k, args, &cfg);
  if (st) {
    char why[512]; /* copied first: ebb__fail writes the buffer ebb_last_error reads */
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: launching kernel '%s' on device %d failed: %s", fn, ebb_kernel_name(k), device, why);
  }
  return EBB_OK;
}

/* CPU tensors run the kernel here and now: there is no stream to order against, and the
 * contract is that CPU results are ready on return. */
ebb_status ebb__launch(const char *fn, int kid, int device, const void *args, const ebb__operand *ops, int nops, int64_t work) {
  if (device == EBB_DEVICE_CPU) {
    ebb__kernel_defs[kid].fn((void *)(uintptr_t)args);
    return EBB_OK;
  }
  const ebb_kernel_t *k;
  ebb_status st = tensor_kernel(kid, &k);
  if (st) return ebb__fail_in(fn, st);
  return launch_on_device(fn, k, device, args, ops, nops, work);
}

/* The public launch of a library's own kernel: the checks a built-in op makes before its
 * launch, then the same path. */
ebb_status ebb_op_launch_kernel(const ebb_kernel_t *k, const void *args, const ebb_op_operand *operands, int n, int64_t work) {
  static const char fn[] = "ebb_op_launch_kernel";
  ebb_kernel_cpu_fn cpu;
  ebb_status st = ebb__kernel_cpu_fn(fn, k, &cpu);
  if (st) return st;
  if (EBB_UNLIKELY(!args)) return ebb__fail(EBB_EINVAL, "%s: kernel '%s': args is NULL; expected its argument struct", fn, ebb_kernel_name(k));
  if (EBB_UNLIKELY(!operands || n < 1 || n > EBB_OP_LAUNCH_MAX_OPERANDS))
    return ebb__fail(EBB_EINVAL, "%s: kernel '%s': %s (n = %d); expected 1..%d tensors it reads or writes", fn, ebb_kernel_name(k),
                     operands ? "operand count out of range" : "operands is NULL", n, EBB_OP_LAUNCH_MAX_OPERANDS);
  int device = 0;
  for (int i = 0; i < n; i++) {
    st = ebb__tensor_check_at(operands[i].t, fn, "operands", i);
    if (st) return st;
    int d = operands[i].t->stor->device;
    if (i == 0) device = d;
    else if (EBB_UNLIKELY(d != device)) {
      char a[160], b[160];
      return ebb__fail(EBB_EDEVICE, "%s: kernel '%s': %s and %s are on different devices; expected one device for all operands", fn,
                       ebb_kernel_name(k), ebb__tensor_desc(operands[0].t, "operands", 0, a, sizeof a),
                       ebb__tensor_desc(operands[i].t, "operands", i, b, sizeof b));
    }
  }
  if (device == EBB_DEVICE_CPU) {
    if (EBB_UNLIKELY(!cpu))
      return ebb__fail(EBB_ENOTSUP, "%s: kernel '%s' has no CPU function; expected one to run on CPU tensors (operands[0] is on the CPU)", fn,
                       ebb_kernel_name(k));
    cpu((void *)(uintptr_t)args);
    return EBB_OK;
  }
  return launch_on_device(fn, k, device, args, operands, n, work);
}
