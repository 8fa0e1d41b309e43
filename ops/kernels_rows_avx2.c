/* kernels_rows_avx2.c: the fused row kernels for AVX2 with FMA (compiled with -mavx2 -mfma;
 * kernels_rows.c calls them only on a CPU that has both). */
#define ROWS_ISA_AVX2
#include "kernels_rows_body.h"
