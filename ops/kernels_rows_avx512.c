/* kernels_rows_avx512.c: the fused row kernels for AVX-512F (compiled with -mavx512f;
 * kernels_rows.c calls them only on a CPU that has it). */
#define ROWS_ISA_AVX512
#include "kernels_rows_body.h"
