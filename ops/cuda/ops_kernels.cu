// ops_kernels.cu: the CUDA twins of ops' CPU kernels (kernels_cpu.c), compiled into ebb's
// embedded fatbin with the runtime's kernels when nvcc is present. Same names as the CUDA names
// given to ebb_kernel_declare, same argument structs (ops_kernels.h) taken by value, same
// arithmetic: elementwise results in f64 rounded once, i64 ops exact, bf16/f16 converted by the
// same bit manipulation, Philox 4x32-10 counted by element index, so a GPU draws the numbers the
// CPU and the emulated driver draw. Each thread handles output elements in a grid-stride loop.
// ebb_ops_matmul is a plain one-thread-per-output kernel, correct but not fast: the fallback
// when cuBLAS (ops/blas_gpu.c) cannot be loaded. Compiled only; no GPU has run these yet.
#include <stdint.h>

#include "../ops_kernels.h"

// dtype codes of ebb_dtype (tensor.h)
enum { DT_F32 = 0, DT_F64 = 1, DT_BF16 = 2, DT_F16 = 3, DT_I64 = 4, DT_BOOL = 5 };

__device__ static const int dt_size[6] = {4, 8, 2, 2, 8, 1};

__device__ static float bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ static uint16_t f32_to_bf16(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
__device__ static float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0) {
    float f = ldexpf((float)m, -24);
    return sign ? -f : f;
  }
  u = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
  return __uint_as_float(u);
}
__device__ static uint16_t f32_to_f16(float x) {
  uint32_t u = __float_as_uint(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) {
    if (a < 0x33000000u) return sign;
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
    uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  a -= 0x38000000u;
  return (uint16_t)(sign | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
}

__device__ static int64_t d2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

__device__ static double ld(const char *p, int dt) {
  switch (dt) {
  case DT_F32: return *(const float *)p;
  case DT_F64: return *(const double *)p;
  case DT_BF16: return bf16_to_f32(*(const uint16_t *)p);
  case DT_F16: return f16_to_f32(*(const uint16_t *)p);
  case DT_I64: return (double)*(const int64_t *)p;
  default: return *(const unsigned char *)p ? 1.0 : 0.0;
  }
}
__device__ static void st(char *p, int dt, double v) {
  switch (dt) {
  case DT_F32: *(float *)p = (float)v; break;
  case DT_F64: *(double *)p = v; break;
  case DT_BF16: *(uint16_t *)p = f32_to_bf16((float)v); break;
  case DT_F16: *(uint16_t *)p = f32_to_f16((float)v); break;
  case DT_I64: *(int64_t *)p = d2i(v); break;
  default: *(unsigned char *)p = v != 0.0; break;
  }
}
__device__ static int64_t ldi(const char *p, int dt) {
  if (dt == DT_I64) return *(const int64_t *)p;
  if (dt == DT_BOOL) return *(const unsigned char *)p != 0;
  return d2i(ld(p, dt));
}
__device__ static void sti(char *p, int dt, int64_t v) {
  if (dt == DT_I64) *(int64_t *)p = v;
  else if (dt == DT_BOOL) *(unsigned char *)p = v != 0;
  else st(p, dt, (double)v);
}

__device__ static void philox(uint64_t ctr, uint64_t seed, uint32_t out[4]) {
  uint32_t x0 = (uint32_t)ctr, x1 = (uint32_t)(ctr >> 32), x2 = 0, x3 = 0, k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y1 = (uint32_t)p1, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1, y3 = (uint32_t)p0;
    x0 = y0, x1 = y1, x2 = y2, x3 = y3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

__device__ static double uniform(const uint32_t w[4], int dt) {
  switch (dt) {
  case DT_F64: return (double)(((uint64_t)(w[0] >> 5) << 26) | (w[1] >> 6)) * 0x1p-53;
  case DT_BF16: return (double)(w[0] >> 24) * 0x1p-8;
  case DT_F16: return (double)(w[0] >> 21) * 0x1p-11;
  default: return (double)(w[0] >> 8) * 0x1p-24;
  }
}

__device__ static double ew_f(int op, double x, double y, double z, double s0, double s1) {
  switch (op) {
  case EBB__EW_COPY: return x;
  case EBB__EW_NEG: return -x;
  case EBB__EW_ABS: return fabs(x);
  case EBB__EW_EXP: return exp(x);
  case EBB__EW_LOG: return log(x);
  case EBB__EW_SQRT: return sqrt(x);
  case EBB__EW_SIN: return sin(x);
  case EBB__EW_COS: return cos(x);
  case EBB__EW_TANH: return tanh(x);
  case EBB__EW_SIGMOID: return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
  case EBB__EW_RELU: return x > 0 ? x : 0.0;
  case EBB__EW_GELU: return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));
  case EBB__EW_POWS: return pow(x, s0);
  case EBB__EW_CLAMP: return x != x ? x : x < s0 ? s0 : x > s1 ? s1 : x;
  case EBB__EW_ADDS: return x + s0;
  case EBB__EW_MULS: return x * s0;
  case EBB__EW_RSUBS: return s0 - x;
  case EBB__EW_DIVS: return x / s0;
  case EBB__EW_RDIVS: return s0 / x;
  case EBB__EW_SIGN: return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0;
  case EBB__EW_GELU_GRAD:
    return 0.5 * (1.0 + erf(x * 0.70710678118654752440)) + x * exp(-0.5 * x * x) * 0.39894228040143267794;
  case EBB__EW_CLAMP_MASK: return x >= s0 && x <= s1 ? 1.0 : 0.0;
  case EBB__EW_LT_S: return x < s0 ? 1.0 : 0.0;
  case EBB__EW_GT_S: return x > s0 ? 1.0 : 0.0;
  case EBB__EW_SQUARE: return x * x;
  case EBB__EW_ADD: return x + y;
  case EBB__EW_SUB: return x - y;
  case EBB__EW_MUL: return x * y;
  case EBB__EW_DIV: return x / y;
  case EBB__EW_EQ: return x == y;
  case EBB__EW_NE: return x != y;
  case EBB__EW_LT: return x < y;
  case EBB__EW_LE: return x <= y;
  case EBB__EW_GT: return x > y;
  case EBB__EW_GE: return x >= y;
  case EBB__EW_MAXIMUM: return x != x || x > y ? x : y;
  case EBB__EW_WHERE: return x != 0 ? y : z;
  default: return 0.0;
  }
}

__device__ static int64_t ew_i(int op, int64_t x, int64_t y, int64_t z, int64_t s0, int64_t s1) {
  switch (op) {
  case EBB__EW_COPY: return x;
  case EBB__EW_NEG: return (int64_t)(0ull - (uint64_t)x);
  case EBB__EW_ABS: return x < 0 ? (int64_t)(0ull - (uint64_t)x) : x;
  case EBB__EW_RELU: return x > 0 ? x : 0;
  case EBB__EW_CLAMP: return x < s0 ? s0 : x > s1 ? s1 : x;
  case EBB__EW_ADDS: return (int64_t)((uint64_t)x + (uint64_t)s0);
  case EBB__EW_MULS: return (int64_t)((uint64_t)x * (uint64_t)s0);
  case EBB__EW_RSUBS: return (int64_t)((uint64_t)s0 - (uint64_t)x);
  case EBB__EW_SIGN: return (x > 0) - (x < 0);
  case EBB__EW_SQUARE: return (int64_t)((uint64_t)x * (uint64_t)x);
  case EBB__EW_CLAMP_MASK: return x >= s0 && x <= s1;
  case EBB__EW_LT_S: return x < s0;
  case EBB__EW_GT_S: return x > s0;
  case EBB__EW_ADD: return (int64_t)((uint64_t)x + (uint64_t)y);
  case EBB__EW_SUB: return (int64_t)((uint64_t)x - (uint64_t)y);
  case EBB__EW_MUL: return (int64_t)((uint64_t)x * (uint64_t)y);
  case EBB__EW_EQ: return x == y;
  case EBB__EW_NE: return x != y;
  case EBB__EW_LT: return x < y;
  case EBB__EW_LE: return x <= y;
  case EBB__EW_GT: return x > y;
  case EBB__EW_GE: return x >= y;
  case EBB__EW_MAXIMUM: return x > y ? x : y;
  case EBB__EW_WHERE: return x ? y : z;
  default: return 0;
  }
}

__device__ static bool int_op(int op) {
  switch (op) {
  case EBB__EW_COPY: case EBB__EW_NEG: case EBB__EW_ABS: case EBB__EW_RELU: case EBB__EW_CLAMP: case EBB__EW_ADDS:
  case EBB__EW_MULS: case EBB__EW_RSUBS: case EBB__EW_SIGN: case EBB__EW_SQUARE: case EBB__EW_CLAMP_MASK: case EBB__EW_LT_S:
  case EBB__EW_GT_S: case EBB__EW_ADD: case EBB__EW_SUB: case EBB__EW_MUL: case EBB__EW_EQ: case EBB__EW_NE: case EBB__EW_LT:
  case EBB__EW_LE: case EBB__EW_GT: case EBB__EW_GE: case EBB__EW_MAXIMUM: case EBB__EW_WHERE:
    return true;
  default:
    return false;
  }
}

__device__ static bool is_int(int dt) { return dt == DT_I64 || dt == DT_BOOL; }

extern "C" __global__ void ebb_ops_ew(ebb__ew_args a) {
  int64_t n = 1;
  for (int d = 0; d < a.ndim; d++) n *= a.shape[d];
  const int op = a.op, nin = a.nin, dto = a.dt_out;
  bool ints = int_op(op);
  if (op >= EBB__EW_EQ && op <= EBB__EW_GE) ints = true;
  else ints = ints && is_int(dto);
  for (int k = 0; k < nin && ints; k++) ints = is_int(a.dt_in[k]);
  if (op == EBB__EW_WHERE) ints = is_int(dto) && is_int(a.dt_in[1]) && is_int(a.dt_in[2]);
  const int64_t is0 = d2i(a.s0), is1 = d2i(a.s1);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t rem = i, oo = 0, io[3] = {0, 0, 0};
    for (int d = a.ndim - 1; d >= 0; d--) {
      int64_t c = rem % a.shape[d];
      rem /= a.shape[d];
      oo += c * a.st_out[d];
      for (int k = 0; k < nin; k++) io[k] += c * a.st_in[k][d];
    }
    char *po = (char *)a.out + oo * dt_size[dto];
    const char *pi[3];
    for (int k = 0; k < nin; k++) pi[k] = (const char *)a.in[k] + io[k] * dt_size[a.dt_in[k]];
    switch (op) {
    case EBB__EW_FILL:
      if (dto == DT_I64) sti(po, dto, is0);
      else st(po, dto, a.s0);
      break;
    case EBB__EW_ARANGE: st(po, dto, a.s0 + (double)i * a.s1); break;
    case EBB__EW_RAND:
    case EBB__EW_RANDN: {
      uint32_t w[4];
      philox(a.offset + (uint64_t)i, a.seed, w);
      if (op == EBB__EW_RAND) {
        st(po, dto, uniform(w, dto));
      } else {
        double u1 = ((double)w[0] + 1.0) * 0x1p-32, u2 = (double)w[1] * 0x1p-32;
        st(po, dto, sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2));
      }
      break;
    }
    default:
      if (ints) {
        int64_t x = nin > 0 ? ldi(pi[0], a.dt_in[0]) : 0, y = nin > 1 ? ldi(pi[1], a.dt_in[1]) : 0, z = nin > 2 ? ldi(pi[2], a.dt_in[2]) : 0;
        sti(po, dto, ew_i(op, x, y, z, is0, is1));
      } else {
        double x = nin > 0 ? ld(pi[0], a.dt_in[0]) : 0, y = nin > 1 ? ld(pi[1], a.dt_in[1]) : 0, z = nin > 2 ? ld(pi[2], a.dt_in[2]) : 0;
        st(po, dto, ew_f(op, x, y, z, a.s0, a.s1));
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
    double acc = a.op == EBB__RED_MAX ? -INFINITY : 0.0;
    int64_t best = 0;
    bool nan = false;
    for (int64_t j = 0; j < inner; j++) {
      int64_t jr = j, off = ibase;
      for (int d = a.ninner - 1; d >= 0; d--) {
        off += (jr % a.ishape[d]) * a.ist_in[d];
        jr /= a.ishape[d];
      }
      double v = ld((const char *)a.in + off * dt_size[a.dt_in], a.dt_in);
      if (a.op == EBB__RED_MAX) {
        if (!nan && (v != v || v > acc || j == 0)) {
          acc = v;
          best = j;
          nan = v != v;
        }
      } else {
        acc += v;
      }
    }
    if (a.op == EBB__RED_MEAN) acc = inner ? acc / (double)inner : __longlong_as_double(0x7ff8000000000000ll);
    st((char *)a.out + obase * dt_size[a.dt_out], a.dt_out, acc);
    if (a.idx) a.idx[obase] = best;
  }
}

extern "C" __global__ void ebb_ops_matmul(ebb__mm_args a) {
  const int64_t total = a.batch * a.m * a.n;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t b = t / (a.m * a.n), i = (t / a.n) % a.m, j = t % a.n;
    if (a.dtype == DT_F64) {
      const double *A = (const double *)a.a + b * a.sa, *B = (const double *)a.b + b * a.sb;
      double acc = 0;
      for (int64_t q = 0; q < a.k; q++)
        acc += (a.trans_a ? A[q * a.lda + i] : A[i * a.lda + q]) * (a.trans_b ? B[j * a.ldb + q] : B[q * a.ldb + j]);
      ((double *)a.c)[b * a.sc + i * a.ldc + j] = acc;
    } else {
      const float *A = (const float *)a.a + b * a.sa, *B = (const float *)a.b + b * a.sb;
      float acc = 0;
      for (int64_t q = 0; q < a.k; q++)
        acc += (a.trans_a ? A[q * a.lda + i] : A[i * a.lda + q]) * (a.trans_b ? B[j * a.ldb + q] : B[q * a.ldb + j]);
      ((float *)a.c)[b * a.sc + i * a.ldc + j] = acc;
    }
  }
}
