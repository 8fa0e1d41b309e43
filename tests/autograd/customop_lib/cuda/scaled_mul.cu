// The test library's CUDA kernel (scaled_mul_kernel.h): grid-stride over n elements, as
// ebb_op_launch_kernel's grid (256 threads a block, at most 65535 blocks) expects.
#include "../scaled_mul_kernel.h"

template <typename T>
__device__ void smul(const ebbtest_smul_args &a) {
  const T *x = static_cast<const T *>(a.a), *w = static_cast<const T *>(a.b);
  T *y = static_cast<T *>(a.y), *m = static_cast<T *>(a.mask);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < a.n; i += (int64_t)gridDim.x * blockDim.x) {
    T p = x[i] * w[i];
    y[i] = (T)a.alpha * p;
    if (m) m[i] = p > (T)0 ? (T)1 : (T)0;
  }
}

extern "C" __global__ void ebbtest_smul(ebbtest_smul_args a) {
  if (a.dtype == 0) smul<float>(a);
  else smul<double>(a);
}
