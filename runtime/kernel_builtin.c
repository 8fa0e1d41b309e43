/* kernel_builtin.c: the kernels every driver has, declared at ebb_init.
 *
 * Their CPU functions run on the emulated driver; their CUDA twins of the same name live in
 * runtime/cuda/builtin.cu and reach a GPU through the runtime's own image, "ebb.runtime". The argument structs
 * are public (runtime.h) so callers fill them directly.
 */
#include "runtime_impl.h"

static void noop_cpu(void *args) { (void)args; }

static void fill_u32_cpu(void *args) {
  const ebb_fill_u32_args *a = args;
  for (uint64_t i = 0; i < a->n; i++) a->dst[i] = a->value;
}

ebb_status ebb__kernels_builtin_init(void) {
  ebb_status st = ebb__kernels_add_runtime_image();
  const ebb_kernel_t *k = NULL;
  if (st == EBB_OK) st = ebb_kernel_declare("ebb.noop", sizeof(ebb_noop_args), noop_cpu, "ebb_noop", &k);
  if (st == EBB_OK) st = ebb_kernel_declare("ebb.fill_u32", sizeof(ebb_fill_u32_args), fill_u32_cpu, "ebb_fill_u32", &k);
  return st;
}
