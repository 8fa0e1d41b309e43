// builtin.cu: the runtime's own CUDA kernels, compiled into its image "ebb.runtime" when nvcc is
// present (sm_80, sm_90, plus compute_90 PTX for newer GPUs). Each has the same name and one
// argument struct as its CPU twin in runtime/kernel_builtin.c; the struct is passed by value as
// the kernel's single parameter, exactly as cuLaunchKernel's kernelParams[0] points to it.
#include <stddef.h>
#include <stdint.h>

struct ebb_noop_args {
  uint64_t unused;
};

struct ebb_fill_u32_args {
  uint32_t *dst;
  uint64_t n;
  uint32_t value;
};

extern "C" __global__ void ebb_noop(ebb_noop_args a) { (void)a; }

extern "C" __global__ void ebb_fill_u32(ebb_fill_u32_args a) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < a.n; i += (uint64_t)gridDim.x * blockDim.x)
    a.dst[i] = a.value;
}
