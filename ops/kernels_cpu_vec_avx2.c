/* kernels_cpu_vec_avx2.c: kernels_cpu_vec.c built for AVX2 with FMA and F16C (flags in
 * ops/CMakeLists.txt), as the table ebb__vec_avx2; run only where the processor has them. */
#define EBB__VEC_NAME avx2
#include "kernels_cpu_vec.c"
