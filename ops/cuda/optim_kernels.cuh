// optim_kernels.cuh: the CUDA twin of the fused optimizer kernel (ops/optim.c), part of ops'
// fatbin through ops_kernels.cu. One launch per device and dtype: block b takes chunks b,
// b + gridDim.x, ... of the table (optim_kernels.h), each EBB__OPTIM_CHUNK elements of one
// tensor, and its threads update those elements with the element functions the CPU loops use,
// in f32 for f32, bf16 and f16 parameters and f64 for f64 ones. bf16 and f16 values are rounded
// once per element here (the CPU rounds after each op, as PyTorch's separate ops do): the GPU
// result may differ from the CPU's in the last bit of those dtypes. Compiled only; no GPU has
// run it yet.
#include "../optim_kernels.h"

__device__ static inline float optim_ld(const void *p, int64_t i, int dt) {
  if (dt == EBB__KDT_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return dt == EBB__KDT_BF16 ? ebb__bf16_to_f32(h) : ebb__f16_to_f32(h);
}

__device__ static inline void optim_st(void *p, int64_t i, int dt, float v) {
  if (dt == EBB__KDT_F32) ((float *)p)[i] = v;
  else ((uint16_t *)p)[i] = dt == EBB__KDT_BF16 ? ebb__f32_to_bf16(v) : ebb__f32_to_f16(v);
}

extern "C" __global__ void ebb_ops_optim(ebb__optim_args a) {
  const int dt = a.dtype;
  for (int64_t c = blockIdx.x; c < a.nchunks; c += gridDim.x) {
    const ebb__optim_chunk ch = a.chunks[c];
    const ebb__optim_tensor *t = &a.tensors[ch.tensor];
    const int64_t end = ch.start + EBB__OPTIM_CHUNK < t->n ? ch.start + EBB__OPTIM_CHUNK : t->n;
    for (int64_t i = ch.start + threadIdx.x; i < end; i += blockDim.x) {
      if (dt == EBB__KDT_F64) {
        double *p = (double *)t->p;
        const double g = ((const double *)t->g)[i];
        if (a.kind == EBB__OPTIM_SGD) {
          double *b = t->s0 ? &((double *)t->s0)[i] : NULL;
          p[i] = ebb__sgd_d(p[i], g, b, t->first, t->lr, t->wd, b ? a.momentum : 0.0, 1.0 - a.dampening, a.flags);
        } else {
          double *vm = t->s2 ? &((double *)t->s2)[i] : NULL;
          p[i] = ebb__adamw_d(p[i], g, &((double *)t->s0)[i], &((double *)t->s1)[i], vm, t->first, t->decay, t->step_size,
                              t->bc2_sqrt, a.beta1, 1.0 - a.beta1, a.beta2, 1.0 - a.beta2, a.eps, a.flags);
        }
        continue;
      }
      const float p = optim_ld(t->p, i, dt), g = optim_ld(t->g, i, dt);
      float r;
      if (a.kind == EBB__OPTIM_SGD) {
        float b = t->s0 && !t->first ? optim_ld(t->s0, i, dt) : 0.0f;
        r = ebb__sgd_f(p, g, &b, t->first, (float)t->lr, (float)t->wd, t->s0 ? (float)a.momentum : 0.0f,
                       (float)(1.0 - a.dampening), a.flags);
        if (t->s0) optim_st(t->s0, i, dt, b);
      } else {
        float m = t->first ? 0.0f : optim_ld(t->s0, i, dt), v = t->first ? 0.0f : optim_ld(t->s1, i, dt);
        float vm = t->s2 && !t->first ? optim_ld(t->s2, i, dt) : 0.0f;
        r = ebb__adamw_f(p, g, &m, &v, &vm, t->first, (float)t->decay, (float)t->step_size, (float)t->bc2_sqrt, (float)a.beta1,
                         (float)(1.0 - a.beta1), (float)a.beta2, (float)(1.0 - a.beta2), (float)a.eps, a.flags);
        optim_st(t->s0, i, dt, m);
        optim_st(t->s1, i, dt, v);
        if (t->s2) optim_st(t->s2, i, dt, vm);
      }
      optim_st(t->p, i, dt, r);
    }
  }
}
