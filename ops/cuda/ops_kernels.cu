// ops_kernels.cu: the CUDA twins of ops' CPU kernels (kernels_cpu.c), compiled into ops' own
// fatbin, the image "ebb.ops" (ops/CMakeLists.txt), when nvcc is present. Same names as the CUDA
// names given to ebb_kernel_declare_in, same argument structs (ops_kernels.h) taken by value, same
// arithmetic: the generic elementwise kernel computes in f64 rounded once, i64 ops exact, bf16/f16
// converted by the same bit manipulation, Philox 4x32-10 counted by element index, so a GPU draws
// the numbers the CPU and the emulated driver draw; contiguous f32/bf16/f16 operands take the f32
// kernel (ebb_ops_ew_f32, below), which computes what the CPU's f32 loops compute. "Same" by
// construction: the element math is ops_math.h, the text kernels_cpu.c compiles too (its
// functions are __host__ __device__ here); this file holds only the CUDA loops. Each thread
// handles output elements in a grid-stride loop. Reductions accumulate in f64 without atomics
// (deterministic; see the reductions' section). ebb_ops_matmul is a plain one-thread-per-output
// kernel, correct but not fast: the fallback when cuBLAS (ops/blas_gpu.c) cannot be loaded.
// Compiled only; no GPU has run these yet.
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

// ---- the f32 elementwise kernel (ebb__ew_flat_f32 chooses it) -------------------------------
// One dim, unit-stride operands (or a broadcast element), f32/bf16/f16 storage, f32 math: the
// ops and formulas of the CPU kernels' f32 loops (kernels_cpu_vec.c), so a device gives what the
// CPU gives. + - * / sqrt round once in f32 as there; the scalar ops, the scalar comparisons and
// the fused updates compute in f64 where the CPU does (with explicit round-to-nearest intrinsics,
// so nvcc's contraction into fma changes nothing); exp, log, sin, cos, tanh, pow, erf are CUDA's
// f32 functions (a few ulp, where the CPU has SLEEF's, under 1 ulp: the last bits may differ).
// Each thread takes groups of 4 elements in a grid-stride loop, with one 16-byte (f32), 8-byte
// (bf16, f16) or 4-byte (bool) load or store per operand and group when every operand's pointer
// is aligned to that; the elements past the last group, or all of them when a pointer is not
// aligned, go one at a time.

__device__ static __forceinline__ float ld1(const void *p, int dt, int64_t i) {
  switch (dt) {
  case EBB__KDT_F32: return ((const float *)p)[i];
  case EBB__KDT_BF16: return ebb__bf16_to_f32(((const uint16_t *)p)[i]);
  case EBB__KDT_F16: return ebb__f16_to_f32(((const uint16_t *)p)[i]);
  default: return ((const unsigned char *)p)[i] ? 1.f : 0.f; // bool
  }
}

__device__ static __forceinline__ void st1(void *p, int dt, int64_t i, float v) {
  switch (dt) {
  case EBB__KDT_F32: ((float *)p)[i] = v; break;
  case EBB__KDT_BF16: ((uint16_t *)p)[i] = ebb__f32_to_bf16(v); break;
  case EBB__KDT_F16: ((uint16_t *)p)[i] = ebb__f32_to_f16(v); break;
  default: ((unsigned char *)p)[i] = v != 0.f; break;
  }
}

// Elements 4g .. 4g+3 of p in one load (p aligned to 4 elements).
__device__ static __forceinline__ void ld4(const void *p, int dt, int64_t g, float v[4]) {
  if (dt == EBB__KDT_F32) {
    const float4 q = ((const float4 *)p)[g];
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else if (dt == EBB__KDT_BF16 || dt == EBB__KDT_F16) {
    const uint2 q = ((const uint2 *)p)[g]; // little-endian: element 4g in q.x's low half
    const uint16_t h[4] = {(uint16_t)(q.x & 0xffffu), (uint16_t)(q.x >> 16), (uint16_t)(q.y & 0xffffu), (uint16_t)(q.y >> 16)};
    for (int j = 0; j < 4; j++) v[j] = dt == EBB__KDT_BF16 ? ebb__bf16_to_f32(h[j]) : ebb__f16_to_f32(h[j]);
  } else {
    const uint32_t q = ((const uint32_t *)p)[g];
    for (int j = 0; j < 4; j++) v[j] = (q >> (8 * j)) & 0xffu ? 1.f : 0.f;
  }
}

__device__ static __forceinline__ void st4(void *p, int dt, int64_t g, const float v[4]) {
  if (dt == EBB__KDT_F32) {
    ((float4 *)p)[g] = make_float4(v[0], v[1], v[2], v[3]);
  } else if (dt == EBB__KDT_BF16 || dt == EBB__KDT_F16) {
    uint16_t h[4];
    for (int j = 0; j < 4; j++) h[j] = dt == EBB__KDT_BF16 ? ebb__f32_to_bf16(v[j]) : ebb__f32_to_f16(v[j]);
    ((uint2 *)p)[g] = make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16, (uint32_t)h[2] | (uint32_t)h[3] << 16);
  } else {
    uint32_t q = 0;
    for (int j = 0; j < 4; j++) q |= (uint32_t)(v[j] != 0.f) << (8 * j);
    ((uint32_t *)p)[g] = q;
  }
}

__device__ static __forceinline__ float gelu_grad_f(float x) {
  return 0.5f * (1.f + erff(x * 0.70710678118654752440f)) + x * expf(-0.5f * x * x) * 0.39894228040143267794f;
}

// One element of op in f32 (kernels_cpu_vec.c's `ew` loop, element by element). s0f: s0 is an
// f32, so the scalar ops are the f32 operation itself.
__device__ static __forceinline__ float ew_f32(int op, float x, float y, float z, double s0, double s1, bool s0f) {
  const float f0 = (float)s0;
  switch (op) {
  case EBB__EW_COPY: return x;
  case EBB__EW_NEG: return -x;
  case EBB__EW_ABS: return fabsf(x);
  case EBB__EW_EXP: return expf(x);
  case EBB__EW_LOG: return logf(x);
  case EBB__EW_SQRT: return sqrtf(x);
  case EBB__EW_SIN: return sinf(x);
  case EBB__EW_COS: return cosf(x);
  case EBB__EW_TANH: return tanhf(x);
  case EBB__EW_SIGMOID: { // e = exp(-|x|) <= 1: never inf/inf
    const float e = expf(-fabsf(x));
    return __fdiv_rn(x >= 0.f ? 1.f : e, 1.f + e);
  }
  case EBB__EW_RELU: return x > 0.f ? x : 0.f;
  case EBB__EW_GELU: return 0.5f * x * (1.f + erff(x * 0.70710678118654752440f));
  case EBB__EW_GELU_GRAD: return gelu_grad_f(x);
  case EBB__EW_GELU_BWD: return __fmul_rn(x, gelu_grad_f(y)); // x: the gradient, y: gelu's input
  case EBB__EW_POWS:
    if (s0 == 2.0) return __fmul_rn(x, x);
    if (s0 == 1.0) return x;
    return s0f ? powf(x, f0) : (float)pow((double)x, s0);
  case EBB__EW_CLAMP: { // compared in f64: the bounds need not be f32; NaN stays, the lower bound wins
    const float r = (double)x > s1 ? (float)s1 : x;
    return (double)x < s0 ? f0 : r;
  }
  case EBB__EW_ADDS: return s0f ? __fadd_rn(x, f0) : (float)__dadd_rn((double)x, s0);
  case EBB__EW_MULS: return s0f ? __fmul_rn(x, f0) : (float)__dmul_rn((double)x, s0);
  case EBB__EW_RSUBS: return s0f ? __fsub_rn(f0, x) : (float)__dsub_rn(s0, (double)x);
  case EBB__EW_DIVS: return s0f ? __fdiv_rn(x, f0) : (float)__ddiv_rn((double)x, s0);
  case EBB__EW_RDIVS: return s0f ? __fdiv_rn(f0, x) : (float)__ddiv_rn(s0, (double)x);
  case EBB__EW_SIGN: return x > 0.f ? 1.f : x < 0.f ? -1.f : 0.f;
  case EBB__EW_CLAMP_MASK: return (double)x >= s0 && (double)x <= s1 ? 1.f : 0.f;
  case EBB__EW_LT_S: return (double)x < s0 ? 1.f : 0.f;
  case EBB__EW_GT_S: return (double)x > s0 ? 1.f : 0.f;
  case EBB__EW_SQUARE: return __fmul_rn(x, x);
  case EBB__EW_ADD: return __fadd_rn(x, y);
  case EBB__EW_SUB: return __fsub_rn(x, y);
  case EBB__EW_MUL: return __fmul_rn(x, y);
  case EBB__EW_DIV: return __fdiv_rn(x, y);
  case EBB__EW_EQ: return x == y ? 1.f : 0.f;
  case EBB__EW_NE: return x != y ? 1.f : 0.f;
  case EBB__EW_LT: return x < y ? 1.f : 0.f;
  case EBB__EW_LE: return x <= y ? 1.f : 0.f;
  case EBB__EW_GT: return x > y ? 1.f : 0.f;
  case EBB__EW_GE: return x >= y ? 1.f : 0.f;
  case EBB__EW_MAXIMUM: return x != x || x > y ? x : y;
  case EBB__EW_WHERE: return x != 0.f ? y : z;
  // the fused updates: ebb__ew_f's formulas in f64, in its order of operations
  case EBB__EW_ADD_SCALED: return (float)__dadd_rn((double)x, __dmul_rn(s0, (double)y));
  case EBB__EW_ADDCMUL: return (float)__dadd_rn((double)x, __dmul_rn(__dmul_rn(s0, (double)y), (double)z));
  case EBB__EW_ADDCDIV: return (float)__dadd_rn((double)x, __ddiv_rn(__dmul_rn(s0, (double)y), (double)z));
  case EBB__EW_LERP:
    if (s0 < 0.5) return (float)__dadd_rn((double)x, __dmul_rn(s0, __dsub_rn((double)y, (double)x)));
    return (float)__dsub_rn((double)y, __dmul_rn(__dsub_rn((double)y, (double)x), 1.0 - s0));
  default: return (float)ebb__ew_f(op, x, y, z, s0, s1); // an op without an f32 formula: f64, as on the CPU
  }
}

extern "C" __global__ void ebb_ops_ew_f32(ebb__ew_args a) {
  const int64_t n = a.shape[0];
  const int op = a.op, nin = a.nin, dto = a.dt_out;
  const bool s0f = (double)(float)a.s0 == a.s0;
  // broadcast inputs (stride 0) are one element, read once; the rest must be aligned to a group
  // of 4 elements for the grouped loads
  float bval[3] = {0.f, 0.f, 0.f};
  bool bc[3] = {false, false, false};
  bool vec = ((uintptr_t)a.out % (uintptr_t)(4 * dt_size[dto])) == 0;
#pragma unroll
  for (int k = 0; k < 3; k++) {
    if (k < nin) {
      bc[k] = a.st_in[k][0] == 0;
      if (bc[k]) bval[k] = ld1(a.in[k], a.dt_in[k], 0);
      else vec = vec && ((uintptr_t)a.in[k] % (uintptr_t)(4 * dt_size[a.dt_in[k]])) == 0;
    }
  }
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t done = 0;
  if (vec) {
    const int64_t groups = n / 4;
    for (int64_t g = tid; g < groups; g += nth) {
      float x[3][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int k = 0; k < 3; k++) {
        if (k < nin) {
          if (bc[k]) x[k][0] = x[k][1] = x[k][2] = x[k][3] = bval[k];
          else ld4(a.in[k], a.dt_in[k], g, x[k]);
        }
      }
      float r[4];
#pragma unroll
      for (int j = 0; j < 4; j++) r[j] = ew_f32(op, x[0][j], x[1][j], x[2][j], a.s0, a.s1, s0f);
      st4(a.out, dto, g, r);
    }
    done = groups * 4;
  }
  for (int64_t i = done + tid; i < n; i += nth) {
    float x[3] = {0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 3; k++)
      if (k < nin) x[k] = bc[k] ? bval[k] : ld1(a.in[k], a.dt_in[k], i);
    st1(a.out, dto, i, ew_f32(op, x[0], x[1], x[2], a.s0, a.s1, s0f));
  }
}

// ---- reductions ------------------------------------------------------------------------------
// Every reduction accumulates in f64 from elements loaded in their own dtype, with no atomics:
// a given input gives the same bits on every run and every GPU. When each output combines one
// contiguous run of the input (ebb__red_run: a sum over the last dims, or of a whole tensor),
// a block of 256 threads takes each output (reduce.c launches 256 threads per output): the run
// is cut into groups of 4 elements, group q going to thread q % 256, which adds its groups'
// elements in order (one 16-byte load per group where an f32 row is aligned, else four loads:
// the same additions either way, so the address does not change the result); the threads'
// partial sums then meet in a fixed tree (warp shuffles, then one word per warp). The max
// keeps the first maximum and the first NaN, as the CPU does, whatever the tree. The order of
// the f64 additions differs from the CPU's (32 partial sums), so a sum may differ from the CPU's
// in the last bits of its f64 total, which the rounding to f32 hides all but rarely. A
// reduction over one dim whose outputs lie side by side in the input (ebb__red_cols: a sum over
// the first dim) gives each 8 adjacent outputs a block: 32 thread rows take every 32nd element
// of the reduced dim (each row of 8 threads reads 32 adjacent bytes of f32), and row 0 adds the
// 32 partials in order. Other layouts take one thread per output, walking its elements in
// order. Few outputs still leave most of the GPU idle: a whole-tensor mean is one block.

struct max_part {
  double v;
  int64_t j; // INT64_MAX: no element yet
  bool nan;
};

// The max of two partials over disjoint elements: the first NaN, else the larger value, the
// first index on a tie (what a walk in index order keeps).
__device__ static __forceinline__ max_part max_join(max_part a, max_part b) {
  if (a.nan || b.nan) return a.nan && (!b.nan || a.j < b.j) ? a : b;
  if (b.j == INT64_MAX) return a;
  if (a.j == INT64_MAX) return b;
  return b.v > a.v || (b.v == a.v && b.j < a.j) ? b : a;
}

__device__ static __forceinline__ void max_take(max_part *p, double v, int64_t j) {
  max_part e = {v, j, v != v};
  *p = max_join(*p, e);
}

// The block's total of v, in a fixed order (every thread receives it). sh: 32 shared words.
__device__ static double block_sum_f64(double v, double *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads(); // the previous row's readers of sh[0] are done
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? sh[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

__device__ static max_part warp_max_part(max_part p) {
  for (int o = 16; o > 0; o >>= 1) {
    max_part q;
    q.v = __shfl_down_sync(0xffffffffu, p.v, o);
    q.j = __shfl_down_sync(0xffffffffu, p.j, o);
    q.nan = __shfl_down_sync(0xffffffffu, (int)p.nan, o) != 0;
    p = max_join(p, q);
  }
  return p;
}

// The block's max (thread 0 receives it).
__device__ static max_part block_max_part(max_part p, max_part *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  p = warp_max_part(p);
  __syncthreads();
  if (lane == 0) sh[warp] = p;
  __syncthreads();
  if (warp == 0) {
    max_part none = {-INFINITY, INT64_MAX, false};
    p = warp_max_part(lane < nwarps ? sh[lane] : none);
  }
  return p;
}

// One output's run of `inner` elements at p (dtype dt), by the whole block.
__device__ static void reduce_run(const ebb__red_args &a, const char *p, int64_t inner, int64_t obase, double *sh,
                                  max_part *shm) {
  const int dt = a.dt_in;
  const int64_t groups = (inner + 3) / 4;
  if (a.op == EBB__RED_MAX) {
    max_part m = {-INFINITY, INT64_MAX, false};
    for (int64_t q = threadIdx.x; q < groups; q += blockDim.x)
      for (int64_t j = 4 * q; j < 4 * q + 4 && j < inner; j++) max_take(&m, ebb__load_dt(p + j * dt_size[dt], dt), j);
    m = block_max_part(m, shm);
    if (threadIdx.x == 0) {
      ebb__store_dt((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, m.v);
      if (a.idx) a.idx[obase] = m.j;
    }
    return;
  }
  double acc = 0.0;
  const bool f32x4 = dt == EBB__KDT_F32 && ((uintptr_t)p & 15u) == 0;
  for (int64_t q = threadIdx.x; q < groups; q += blockDim.x) {
    if (f32x4 && 4 * q + 4 <= inner) {
      const float4 v = ((const float4 *)p)[q];
      acc += (double)v.x;
      acc += (double)v.y;
      acc += (double)v.z;
      acc += (double)v.w;
    } else {
      for (int64_t j = 4 * q; j < 4 * q + 4 && j < inner; j++) acc += ebb__load_dt(p + j * dt_size[dt], dt);
    }
  }
  acc = block_sum_f64(acc, sh);
  if (threadIdx.x == 0) ebb__store_dt((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, ebb__red_finish(a.op, acc, inner));
}

extern "C" __global__ void ebb_ops_reduce(ebb__red_args a) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < a.nouter; d++) outer *= a.oshape[d];
  for (int d = 0; d < a.ninner; d++) inner *= a.ishape[d];
  if (ebb__red_run(&a)) { // a block per output
    __shared__ double sh[32];
    __shared__ max_part shm[32];
    for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
      int64_t rem = r, ibase = 0, obase = 0;
      for (int d = a.nouter - 1; d >= 0; d--) {
        int64_t c = rem % a.oshape[d];
        rem /= a.oshape[d];
        ibase += c * a.ost_in[d];
        obase += c * a.ost_out[d];
      }
      reduce_run(a, (const char *)a.in + ibase * dt_size[a.dt_in], inner, obase, sh, shm);
    }
    return;
  }
  if (ebb__red_cols(&a)) { // 8 adjacent outputs per block, its 32 thread rows splitting the reduced dim
    __shared__ double shc[32][8];
    __shared__ max_part shcm[32][8];
    const int col = threadIdx.x & 7, row = threadIdx.x >> 3, rows = (blockDim.x >> 3) < 32 ? (blockDim.x >> 3) : 32;
    const int64_t tiles = (outer + 7) / 8;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int64_t r = t * 8 + col;
      int64_t rem = r, ibase = 0, obase = 0;
      for (int d = a.nouter - 1; d >= 0; d--) {
        int64_t c = rem % a.oshape[d];
        rem /= a.oshape[d];
        ibase += c * a.ost_in[d];
        obase += c * a.ost_out[d];
      }
      double acc = 0.0;
      max_part m = {-INFINITY, INT64_MAX, false};
      if (r < outer && row < rows)
        for (int64_t j = row; j < inner; j += rows) {
          const double v = ebb__load_dt((const char *)a.in + (ibase + j * a.ist_in[0]) * dt_size[a.dt_in], a.dt_in);
          if (a.op == EBB__RED_MAX) max_take(&m, v, j);
          else acc += v;
        }
      __syncthreads(); // the previous tile's readers are done
      if (row < rows) {
        shc[row][col] = acc;
        shcm[row][col] = m;
      }
      __syncthreads();
      if (row == 0 && r < outer) { // the thread rows' partials in a fixed order
        if (a.op == EBB__RED_MAX) {
          for (int k = 1; k < rows; k++) m = max_join(m, shcm[k][col]);
          ebb__store_dt((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, m.v);
          if (a.idx) a.idx[obase] = m.j;
        } else {
          for (int k = 1; k < rows; k++) acc += shc[k][col];
          ebb__store_dt((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, ebb__red_finish(a.op, acc, inner));
        }
      }
    }
    return;
  }
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
      int64_t off = ibase;
      if (a.ninner == 1) {
        off += j * a.ist_in[0]; // one reduced dim (a sum over the first dim): no division
      } else {
        int64_t jr = j;
        for (int d = a.ninner - 1; d >= 0; d--) {
          off += (jr % a.ishape[d]) * a.ist_in[d];
          jr /= a.ishape[d];
        }
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
