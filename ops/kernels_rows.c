/* kernels_rows.c: the fused row kernels' entry (ebb.ops.rows: softmax, log_softmax,
 * cross_entropy and layer_norm, forward and backward; ops_kernels.h says what each computes).
 * One loop text (kernels_rows_body.h) is compiled for the baseline x86-64 set (SSE2), for AVX2
 * with FMA and for AVX-512F (kernels_rows_avx2.c, kernels_rows_avx512.c, each with its own
 * flags); the set is the one every CPU kernel uses (ebb__cpu_isa, kernels_cpu.c): the widest
 * the CPU has, never more, so the library runs on any x86-64 and uses what the machine offers. Elsewhere the text is compiled
 * once, for scalars. Like every CPU kernel: reentrant, reads only its argument struct and what
 * it points to.
 */
#if defined(__x86_64__)
#define ROWS_ISA_SSE2
#else
#define ROWS_ISA_SCALAR
#endif
#include "kernels_rows_body.h"

#include "ops_impl.h"

typedef void (*rows_run_fn)(const ebb__rows_args *a, int64_t r0, int64_t r1);

#if defined(__x86_64__)
void ebb__rows_run_avx2(const ebb__rows_args *a, int64_t r0, int64_t r1);
void ebb__rows_run_avx512(const ebb__rows_args *a, int64_t r0, int64_t r1);

static rows_run_fn rows_variant(int isa) {
  switch (isa) {
  case EBB__ISA_AVX512: return ebb__rows_run_avx512;
  case EBB__ISA_AVX2: return ebb__rows_run_avx2;
  default: return ebb__rows_run_sse2;
  }
}
#else
static rows_run_fn rows_variant(int isa) {
  (void)isa;
  return ebb__rows_run_scalar;
}
#endif

void ebb__rows_run_isa(const ebb__rows_args *a, int isa) {
  if (a->op == EBB__ROWS_LN_BWD) {
    if (a->gw_out) memset(a->gw_out, 0, (size_t)a->cols * sizeof(float));
    if (a->gb_out) memset(a->gb_out, 0, (size_t)a->cols * sizeof(float));
  }
  if (isa > ebb__cpu_isa()) isa = ebb__cpu_isa();
  rows_variant(isa)(a, 0, a->rows);
}

void ebb__rows_cpu(void *args) { ebb__rows_run_isa(args, ebb__cpu_isa()); }
