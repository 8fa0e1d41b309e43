/* kernels_cpu_vec_avx512.c: kernels_cpu_vec.c built for AVX-512 (F, BW, DQ, VL, with FMA and
 * F16C; flags in ops/CMakeLists.txt), as the table ebb__vec_avx512; run only where the
 * processor and the operating system support them. */
#define EBB__VEC_NAME avx512
#include "kernels_cpu_vec.c"
