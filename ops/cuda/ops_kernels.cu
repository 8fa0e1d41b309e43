// ops_kernels.cu: the CUDA twins of ops' CPU kernels (kernels_cpu.c), compiled into ops' own
// fatbin, the image "ebb.ops" (ops/CMakeLists.txt), when nvcc is present. Same names as the CUDA
// names given to ebb_kernel_declare_in, same argument structs (ops_kernels.h) taken by value, same
// arithmetic: elementwise results in f64 rounded once, i64 ops exact, bf16/f16 converted by the
// same bit manipulation, Philox 4x32-10 counted by element index, so a GPU draws the numbers the
// CPU and the emulated driver draw. "Same" by construction: the element math is ops_math.h, the
// text kernels_cpu.c compiles too (its functions are __host__ __device__ here); this file holds
// only the CUDA loops. Each thread handles output elements in a grid-stride loop.
// ebb_ops_matmul is a plain one-thread-per-output kernel, correct but not fast: the fallback
// when cuBLAS (ops/blas_gpu.c) cannot be loaded. Compiled only; no GPU has run these yet.
#include <stdint.h>

#include "../ops_math.h"

// bytes per element by EBB__KDT_* code (ebb__dtype_size on the CPU)
__device__ static const int dt_size[6] = {4, 8, 2, 2, 8, 1};

extern "C" __global__ void ebb_ops_ew(ebb__ew_args a) {
  int64_t n = 1;
  for (int d = 0; d < a.ndim; d++) n *= a.shape[d];
  const int op = a.op, nin = a.nin, dto = a.dt_out;
  const bool ints = ebb__ew_exact_int(&a);
  const int64_t is0 = ebb__d2i(a.s0), is1 = ebb__d2i(a.s1);
  // Contiguous operands (the launch coalesces dims, so most elementwise ops arrive as one dim of
  // unit strides): element i is at offset i everywhere, no per-element division by the shape.
  bool flat = a.ndim == 1 && a.st_out[0] == 1;
  for (int k = 0; k < nin; k++) flat = flat && a.st_in[k][0] == 1;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t rem = i, oo = 0, io[3] = {0, 0, 0};
    if (flat) {
      oo = i;
      for (int k = 0; k < nin; k++) io[k] = i;
    } else {
      for (int d = a.ndim - 1; d >= 0; d--) {
        int64_t c = rem % a.shape[d];
        rem /= a.shape[d];
        oo += c * a.st_out[d];
        for (int k = 0; k < nin; k++) io[k] += c * a.st_in[k][d];
      }
    }
    char *po = (char *)a.out + oo * dt_size[dto];
    const char *pi[3];
    for (int k = 0; k < nin; k++) pi[k] = (const char *)a.in[k] + io[k] * dt_size[a.dt_in[k]];
    switch (op) {
    case EBB__EW_FILL:
      if (dto == EBB__KDT_I64) ebb__sti(po, dto, is0);
      else ebb__store_dt(po, dto, a.s0);
      break;
    case EBB__EW_ARANGE: ebb__store_dt(po, dto, ebb__arange_at(a.s0, a.s1, (uint64_t)i)); break;
    case EBB__EW_RAND:
    case EBB__EW_RANDN: ebb__store_dt(po, dto, ebb__random_at(op, dto, a.seed, a.offset + (uint64_t)i)); break;
    default:
      if (ints) {
        int64_t x = nin > 0 ? ebb__ldi(pi[0], a.dt_in[0]) : 0, y = nin > 1 ? ebb__ldi(pi[1], a.dt_in[1]) : 0;
        int64_t z = nin > 2 ? ebb__ldi(pi[2], a.dt_in[2]) : 0;
        int64_t r = 0; // the op is one of ebb__ew_i's: ints says so
        ebb__ew_i(op, x, y, z, is0, is1, &r);
        ebb__sti(po, dto, r);
      } else {
        double x = nin > 0 ? ebb__load_dt(pi[0], a.dt_in[0]) : 0, y = nin > 1 ? ebb__load_dt(pi[1], a.dt_in[1]) : 0;
        double z = nin > 2 ? ebb__load_dt(pi[2], a.dt_in[2]) : 0;
        ebb__store_dt(po, dto, ebb__ew_f(op, x, y, z, a.s0, a.s1));
      }
      break;
    }
  }
}

extern "C" __global__ void ebb_ops_reduce(ebb__red_args a) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < a.nouter; d++) outer *= a.oshape[d];
  for (int d = 0; d < a.ninner; d++) inner *= a.ishape[d];
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < outer; r += (int64_t)gridDim.x * blockDim.x) {
    int64_t rem = r, ibase = 0, obase = 0;
    for (int d = a.nouter - 1; d >= 0; d--) {
      int64_t c = rem % a.oshape[d];
      rem /= a.oshape[d];
      ibase += c * a.ost_in[d];
      obase += c * a.ost_out[d];
    }
    double acc = ebb__red_init(a.op);
    int64_t best = 0;
    bool nan = false;
    for (int64_t j = 0; j < inner; j++) {
      int64_t jr = j, off = ibase;
      for (int d = a.ninner - 1; d >= 0; d--) {
        off += (jr % a.ishape[d]) * a.ist_in[d];
        jr /= a.ishape[d];
      }
      double v = ebb__load_dt((const char *)a.in + off * dt_size[a.dt_in], a.dt_in);
      if (a.op == EBB__RED_MAX) ebb__red_max_step(&acc, &best, &nan, v, j);
      else acc += v;
    }
    acc = ebb__red_finish(a.op, acc, inner);
    ebb__store_dt((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, acc);
    if (a.idx) a.idx[obase] = best;
  }
}

extern "C" __global__ void ebb_ops_matmul(ebb__mm_args a) {
  const int64_t total = a.batch * a.m * a.n;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t b = t / (a.m * a.n), i = (t / a.n) % a.m, j = t % a.n;
    if (a.dtype == EBB__KDT_F64) {
      const double *A = (const double *)a.a + b * a.sa, *B = (const double *)a.b + b * a.sb;
      double acc = 0;
      for (int64_t q = 0; q < a.k; q++)
        acc += (a.trans_a ? A[q * a.lda + i] : A[i * a.lda + q]) * (a.trans_b ? B[j * a.ldb + q] : B[q * a.ldb + j]);
      double *C = (double *)a.c + b * a.sc + i * a.ldc + j;
      *C = a.beta != 0 ? acc + a.beta * *C : acc; // beta 0: C is never read (it may hold NaN)
    } else {
      const float *A = (const float *)a.a + b * a.sa, *B = (const float *)a.b + b * a.sb;
      float acc = 0;
      for (int64_t q = 0; q < a.k; q++)
        acc += (a.trans_a ? A[q * a.lda + i] : A[i * a.lda + q]) * (a.trans_b ? B[j * a.ldb + q] : B[q * a.ldb + j]);
      float *C = (float *)a.c + b * a.sc + i * a.ldc + j;
      *C = a.beta != 0 ? acc + (float)a.beta * *C : acc;
    }
  }
}

// ---- the fused row kernels (ebb__rows_args; kernels_rows_body.h is the CPU text) ------------
// One block per row (grid-stride over rows when the grid is smaller): the block's threads walk
// the row in strides of blockDim, with block-wide sums and maxima through warp shuffles and one
// shared word per warp. f32 math, as on the CPU. LN_BWD computes the input's gradient only:
// ops/norm.c sends the weight's and bias's row sums (gw_out, gb_out) to the CPU kernels alone.

__device__ static float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

__device__ static float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

// The block's total of v (every thread receives it). sh: 32 shared words.
__device__ static float block_sum(float v, float *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads(); // the previous call's readers of sh[0] are done
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? sh[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

__device__ static float block_max(float v, float *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? sh[lane] : -INFINITY;
    v = warp_max(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

extern "C" __global__ void ebb_ops_rows(ebb__rows_args a) {
  __shared__ float sh[32];
  const int64_t n = a.cols, t0 = threadIdx.x, step = blockDim.x;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float *x = a.x + r * n, *g = a.g ? a.g + r * n : nullptr;
    float *y = a.out + r * n;
    switch (a.op) {
    case EBB__ROWS_SOFTMAX:
    case EBB__ROWS_LOG_SOFTMAX:
    case EBB__ROWS_CE_FWD:
    case EBB__ROWS_CE_BWD: {
      float m = -INFINITY, s = 0.f;
      for (int64_t j = t0; j < n; j += step) m = fmaxf(m, x[j]);
      m = block_max(m, sh);
      for (int64_t j = t0; j < n; j += step) s += expf(x[j] - m);
      s = block_sum(s, sh);
      if (a.op == EBB__ROWS_SOFTMAX) {
        const float inv = 1.f / s;
        for (int64_t j = t0; j < n; j += step) y[j] = expf(x[j] - m) * inv;
      } else if (a.op == EBB__ROWS_LOG_SOFTMAX) {
        const float l = logf(s); // (x - m) - l: l is not added to a large m first
        for (int64_t j = t0; j < n; j += step) y[j] = (x[j] - m) - l;
      } else {
        const int64_t t = a.target[r];
        const bool ok = t >= 0 && t < n;
        if (a.op == EBB__ROWS_CE_FWD) {
          if (t0 == 0) a.out[r] = ok ? (m - x[t]) + logf(s) : NAN;
        } else {
          const float k = (float)((double)a.g[0] * a.s0), ks = k / s;
          for (int64_t j = t0; j < n; j += step) y[j] = ok ? expf(x[j] - m) * ks - (j == t ? k : 0.f) : NAN;
        }
      }
      break;
    }
    case EBB__ROWS_SOFTMAX_BWD: {
      float d = 0.f;
      for (int64_t j = t0; j < n; j += step) d += g[j] * x[j];
      d = block_sum(d, sh);
      for (int64_t j = t0; j < n; j += step) y[j] = x[j] * (g[j] - d);
      break;
    }
    case EBB__ROWS_LOG_SOFTMAX_BWD: {
      float sg = 0.f;
      for (int64_t j = t0; j < n; j += step) sg += g[j];
      sg = block_sum(sg, sh);
      for (int64_t j = t0; j < n; j += step) y[j] = g[j] - expf(x[j]) * sg;
      break;
    }
    case EBB__ROWS_LN_FWD:
    case EBB__ROWS_LN_BWD: {
      float s = 0.f, v = 0.f;
      for (int64_t j = t0; j < n; j += step) s += x[j];
      const float mu = block_sum(s, sh) / (float)n;
      for (int64_t j = t0; j < n; j += step) v += (x[j] - mu) * (x[j] - mu);
      const float rs = (float)rsqrt((double)block_sum(v, sh) / (double)n + a.s0);
      if (a.op == EBB__ROWS_LN_FWD) {
        for (int64_t j = t0; j < n; j += step)
          y[j] = (x[j] - mu) * rs * (a.w ? a.w[j] : 1.f) + (a.b ? a.b[j] : 0.f);
      } else {
        float s1 = 0.f, s2 = 0.f;
        for (int64_t j = t0; j < n; j += step) {
          const float gx = g[j] * (a.w ? a.w[j] : 1.f);
          s1 += gx;
          s2 += gx * (x[j] - mu) * rs;
        }
        const float m1 = block_sum(s1, sh) / (float)n, m2 = block_sum(s2, sh) / (float)n;
        for (int64_t j = t0; j < n; j += step) {
          const float xh = (x[j] - mu) * rs, gx = g[j] * (a.w ? a.w[j] : 1.f);
          y[j] = rs * (gx - m1 - xh * m2);
        }
      }
      break;
    }
    default: break;
    }
  }
}

// The fused optimizer kernel, the CUDA twin of ops/optim.c.
#include "optim_kernels.cuh"
