/* rows.c: the launch of the fused row kernels for softmax.c, loss.c and norm.c: which tensors
 * they take and the launch that declares their operands. (kernels_rows.c holds the kernels' CPU
 * bodies, cuda/ops_kernels.cu their CUDA twin.) Threading: no state of its own.
 */
#include "ops_impl.h"

/* Whether t can feed the row kernel: f32, contiguous, with elements (0-element tensors take the
 * composed path, which already handles them). */
bool ebb__rows_ok(const ebb_tensor_t *t) {
  return t->dtype == EBB_F32 && ebb__is_contiguous(t) && ebb__numel(t->shape, t->ndim) > 0;
}

/* Runs a row kernel on `device`: reads and writes are the tensors behind a's pointers (NULL
 * entries skipped), so a device launch declares their storages' uses on its stream. */
ebb_status ebb__rows_launch(const char *fn, int device, const ebb__rows_args *a, const ebb_tensor_t *const *reads, int nr,
                             ebb_tensor_t *const *writes, int nw) {
  ebb__operand ops[8];
  int n = 0;
  for (int i = 0; i < nr; i++)
    if (reads[i]) ops[n++] = (ebb__operand){reads[i], false};
  for (int i = 0; i < nw; i++)
    if (writes[i]) ops[n++] = (ebb__operand){writes[i], true};
  /* one block of 256 threads per row on a GPU */
  return ebb__launch(fn, EBB__K_ROWS, device, a, ops, n, a->rows * 256);
}
