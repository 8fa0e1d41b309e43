/* kernels_cpu.c: ops' CPU kernels and element conversions.
 *
 * The kernels serve two callers with one function each: CPU tensors (called directly on the
 * calling thread by ebb__launch) and the emulated driver (registered through ebb_kernel_declare
 * and run by a device's compute engine thread, with the argument struct copied at launch). They
 * read only their argument struct and the memory it points to, so they are reentrant.
 * Arithmetic: launches whose operands are all f32, bf16 or f16 run in f32 chunks through the
 * vector loops of kernels_cpu_vec.c (a table per instruction set, chosen at load), as libtorch
 * computes f32 tensors: + - * / sqrt and the comparisons give the same results as f64 would,
 * the scalar ops stay in f64 (their scalar need not be an f32), and the transcendental ops
 * (exp, log, sin, cos, tanh, sigmoid, gelu and its gradient, pow) are f32 functions within a
 * few ulp (SLEEF's, and kernels_cpu_vec.c's erf for gelu) instead of f64 ones rounded once.
 * Other launches compute in f64 and round once to the result dtype (integers: exact in i64
 * where the op allows it). Reductions accumulate in f64, sums in a fixed order of partial sums
 * (the same result every run and on every processor); matmul is OpenBLAS's sgemm/dgemm. bf16 and f16 are converted by bit manipulation, rounding to nearest
 * even. The random kernels are Philox 4x32-10 keyed by the seed and counted by element index,
 * so every device and the CPU produce the same numbers. That element math (conversions, loads
 * and stores, Philox, the op switches, the reduction combiners) is ops_math.h's, the one text
 * the CUDA twins (cuda/ops_kernels.cu) compile too; this file owns the loops around it.
 * Matmul also passes a process-wide gate that exit shuts, so no thread is inside OpenBLAS when
 * OpenBLAS tears its thread pool down (see "Leaving OpenBLAS" below).
 */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels_cpu_vec.h"
#include "ops_impl.h"

/* ---- the public conversions and the Philox entry the tests call: the math is ops_math.h's -- */

uint16_t ebb_f32_to_bf16(float x) { return ebb__f32_to_bf16(x); }
float ebb_bf16_to_f32(uint16_t h) { return ebb__bf16_to_f32(h); }
uint16_t ebb_f32_to_f16(float x) { return ebb__f32_to_f16(x); }
float ebb_f16_to_f32(uint16_t h) { return ebb__f16_to_f32(h); }

void ebb__philox(uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]) { ebb__philox4x32(c, k0, k1, out); }

/* ---- the vector loops' table for this processor ------------------------------------------------ */

static const ebb__vec_ops *vec_table;
static int cpu_isa = EBB__ISA_BASE;

/* The widest instruction set the processor and the operating system support (GCC's cpu model
 * checks the saved-state bits too), capped by EBB_CPU_VEC (baseline, avx2 or avx512; ebb_init
 * refuses any other value, launch.c). One choice for every CPU kernel that has per-set builds
 * (the vector loops and the row kernels), made in a constructor, before any kernel can run, so
 * the kernels read plain variables. */
__attribute__((constructor)) static void vec_choose(void) {
  int isa = EBB__ISA_BASE;
#if defined(__x86_64__)
  __builtin_cpu_init();
  /* The AVX2 table converts f16 with F16C instructions: a processor (or a virtual machine's
   * CPU model) may offer AVX2 and FMA without them. */
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    isa = EBB__ISA_AVX2;
  if (isa == EBB__ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    isa = EBB__ISA_AVX512;
  const char *cap = getenv("EBB_CPU_VEC");
  if (cap && strcmp(cap, "baseline") == 0) isa = EBB__ISA_BASE;
  else if (cap && strcmp(cap, "avx2") == 0 && isa > EBB__ISA_AVX2) isa = EBB__ISA_AVX2;
  cpu_isa = isa;
  vec_table = isa == EBB__ISA_AVX512 ? &ebb__vec_avx512 : isa == EBB__ISA_AVX2 ? &ebb__vec_avx2 : &ebb__vec_baseline;
#else
  cpu_isa = isa;
  vec_table = &ebb__vec_baseline; /* the wide tables are built on x86-64 only */
#endif
}

int ebb__cpu_isa(void) { return cpu_isa; }

const ebb__vec_ops *ebb__vec_pick(void) { return vec_table ? vec_table : &ebb__vec_baseline; }

/* ---- the elementwise kernel ----------------------------------------------------------------- */

/* Contiguous f32 (and f64) binary ops and same-dtype copies: the loops the compiler vectorises.
 * Returns false when the launch is not of that shape. */
static bool ew_fast(const ebb__ew_args *a) {
  if (a->ndim != 1 || a->st_out[0] != 1) return false;
  const int64_t n = a->shape[0];
  for (int k = 0; k < a->nin; k++)
    if (a->st_in[k][0] != 1 || a->dt_in[k] != a->dt_out) return false;
  if (a->op == EBB__EW_COPY) {
    memmove(a->out, a->in[0], (size_t)n * ebb__dtype_size[a->dt_out]);
    return true;
  }
  if (a->dt_out == EBB_F32 && a->nin == 2) {
    float *restrict o = a->out;
    const float *restrict x = a->in[0], *restrict y = a->in[1];
    if (o == x || o == y) return false; /* in place: the generic loop handles aliasing */
    switch (a->op) {
    case EBB__EW_ADD: for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i]; return true;
    case EBB__EW_SUB: for (int64_t i = 0; i < n; i++) o[i] = x[i] - y[i]; return true;
    case EBB__EW_MUL: for (int64_t i = 0; i < n; i++) o[i] = x[i] * y[i]; return true;
    case EBB__EW_DIV: for (int64_t i = 0; i < n; i++) o[i] = x[i] / y[i]; return true;
    default: return false;
    }
  }
  if (a->dt_out == EBB_F32 && a->nin == 0 && a->op == EBB__EW_FILL) {
    float *o = a->out, v = (float)a->s0;
    for (int64_t i = 0; i < n; i++) o[i] = v;
    return true;
  }
  return false;
}

#define EBB__CHUNK 256 /* elements per chunk of the generic loops (3 x 2 KiB of f64 on the stack) */

/* n elements of dtype dt, `stride` bytes apart, into f64. */
static void load_row(double *dst, const char *p, int64_t stride, int64_t n, int dt) {
  switch (dt) {
  case EBB_F32:
    for (int64_t i = 0; i < n; i++, p += stride) {
      float v;
      memcpy(&v, p, 4);
      dst[i] = v;
    }
    break;
  case EBB_F64:
    for (int64_t i = 0; i < n; i++, p += stride) memcpy(&dst[i], p, 8);
    break;
  default:
    for (int64_t i = 0; i < n; i++, p += stride) dst[i] = ebb__load_dt(p, dt);
    break;
  }
}

static void store_row(char *p, int64_t stride, const double *src, int64_t n, int dt) {
  switch (dt) {
  case EBB_F32:
    for (int64_t i = 0; i < n; i++, p += stride) {
      float v = (float)src[i];
      memcpy(p, &v, 4);
    }
    break;
  case EBB_F64:
    for (int64_t i = 0; i < n; i++, p += stride) memcpy(p, &src[i], 8);
    break;
  default:
    for (int64_t i = 0; i < n; i++, p += stride) ebb__store_dt(p, dt, src[i]);
    break;
  }
}

/* x[i] = op(x[i], y[i], z[i]) for a chunk: the frequent ops get a loop of their own, in which
 * ebb__ew_f's switch folds away on the constant op (no switch per element, and the loop
 * vectorises); the rest go through ebb__ew_f's switch per element. One formula either way. */
static void op_row(int op, double *restrict x, const double *restrict y, const double *restrict z, int64_t n, double s0,
                        double s1) {
  switch (op) {
  case EBB__EW_COPY: return;
  case EBB__EW_ADD: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_ADD, x[i], y[i], 0, s0, s1); return;
  case EBB__EW_SUB: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_SUB, x[i], y[i], 0, s0, s1); return;
  case EBB__EW_MUL: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_MUL, x[i], y[i], 0, s0, s1); return;
  case EBB__EW_DIV: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_DIV, x[i], y[i], 0, s0, s1); return;
  case EBB__EW_ADDS: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_ADDS, x[i], 0, 0, s0, s1); return;
  case EBB__EW_MULS: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_MULS, x[i], 0, 0, s0, s1); return;
  case EBB__EW_NEG: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_NEG, x[i], 0, 0, s0, s1); return;
  case EBB__EW_SQUARE: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_SQUARE, x[i], 0, 0, s0, s1); return;
  case EBB__EW_EXP: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_EXP, x[i], 0, 0, s0, s1); return;
  case EBB__EW_LOG: for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(EBB__EW_LOG, x[i], 0, 0, s0, s1); return;
  default:
    for (int64_t i = 0; i < n; i++) x[i] = ebb__ew_f(op, x[i], y ? y[i] : 0, z ? z[i] : 0, s0, s1);
    return;
  }
}

/* Whether a launch takes the f32 rows (f32_row): every operand f32, bf16 or f16 (bool allowed
 * for where's condition and a comparison's result), and an op of ebb__vec_ops.ew. */
static bool ew_in_f32(const ebb__ew_args *a) {
  const int op = a->op, dto = a->dt_out;
  if (op < EBB__EW_COPY || op >= EBB__EW_COUNT) return false;
  const bool cmp = (op >= EBB__EW_EQ && op <= EBB__EW_GE) || op == EBB__EW_LT_S || op == EBB__EW_GT_S ||
                   op == EBB__EW_CLAMP_MASK;
  if (!(dto == EBB_F32 || dto == EBB_BF16 || dto == EBB_F16 || (dto == EBB_BOOL && (cmp || op == EBB__EW_COPY))))
    return false;
  for (int k = 0; k < a->nin; k++) {
    const int d = a->dt_in[k];
    if (!(d == EBB_F32 || d == EBB_BF16 || d == EBB_F16 || (d == EBB_BOOL && op == EBB__EW_WHERE && k == 0)))
      return false;
  }
  return true;
}

/* One row of `inner` elements in f32, in chunks of EBB__VEC_CHUNK: an f32 operand with unit
 * stride is read (or written) where it lies, any other is converted through a chunk buffer
 * (stride 0, a broadcast, repeats one element). A chunk's loads all precede its stores, and an
 * operand read in place is read at the index written, so out may alias an input. */
static void f32_row(const ebb__vec_ops *v, const ebb__ew_args *a, char *po, int64_t so, const char *const *pin,
                    const int64_t *si, int64_t inner) {
  float buf[4][EBB__VEC_CHUNK];
  const int nin = a->nin, dto = a->dt_out;
  const char *pi[3] = {pin[0], pin[1], pin[2]};
  const bool out_direct = dto == EBB_F32 && so == 4;
  for (int64_t i0 = 0; i0 < inner; i0 += EBB__VEC_CHUNK) {
    const int64_t m = inner - i0 < EBB__VEC_CHUNK ? inner - i0 : EBB__VEC_CHUNK;
    const float *px[3] = {NULL, NULL, NULL};
    for (int k = 0; k < nin; k++) {
      if (a->dt_in[k] == EBB_F32 && si[k] == 4) {
        px[k] = (const float *)(const void *)pi[k];
      } else {
        v->load(buf[k + 1], pi[k], si[k], m, a->dt_in[k]);
        px[k] = buf[k + 1];
      }
      pi[k] += si[k] * m;
    }
    if (a->op == EBB__EW_COPY && !out_direct) {
      v->store(po, so, px[0], m, dto); /* a cast: straight from the loaded input */
    } else {
      float *o = out_direct ? (float *)(void *)po : buf[0];
      v->ew(a->op, o, px[0], px[1], px[2], m, a->s0, a->s1);
      if (!out_direct) v->store(po, so, buf[0], m, dto);
    }
    po += so * m;
  }
}

/* A copy between same-size elements whose input runs fastest along the next-to-last dim (a
 * transposed view made contiguous): the last two dims are copied in square tiles, so both sides
 * touch a tile's cache lines while they are in L1, instead of the input being walked with one
 * element per cache line. Returns false when the launch is not of that shape. */
#define TILE 64 /* of 16, 32, 64 and 128 elements, the fastest on [4096,1024] f32 (perf/RESULTS.md) */
#define TILE_COPY(T)                                                                                             \
  for (int64_t r0 = 0; r0 < rows; r0 += TILE)                                                                    \
    for (int64_t c0 = 0; c0 < cols; c0 += TILE) {                                                                \
      const int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows, c1 = c0 + TILE < cols ? c0 + TILE : cols;          \
      for (int64_t r = r0; r < r1; r++) {                                                                        \
        T *restrict d = (T *)(void *)po + r * osr;                                                               \
        const T *restrict s = (const T *)(const void *)pi + r * isr;                                             \
        for (int64_t c = c0; c < c1; c++) d[c] = s[c * isc];                                                     \
      }                                                                                                          \
    }

static bool copy_tiled(const ebb__ew_args *a) {
  const int nd = a->ndim;
  if (a->op != EBB__EW_COPY || nd < 2 || a->dt_in[0] != a->dt_out || a->st_out[nd - 1] != 1) return false;
  const int64_t rows = a->shape[nd - 2], cols = a->shape[nd - 1];
  const int64_t osr = a->st_out[nd - 2], isr = a->st_in[0][nd - 2], isc = a->st_in[0][nd - 1];
  if (rows < TILE / 4 || cols < TILE / 4 || isr < 1 || isr >= isc) return false;
  const size_t e = ebb__dtype_size[a->dt_out];
  int64_t planes = 1;
  for (int d = 0; d + 2 < nd; d++) planes *= a->shape[d];
  int64_t idx[EBB_TENSOR_MAX_DIMS] = {0};
  for (int64_t p = 0; p < planes; p++) {
    int64_t oo = 0, io = 0;
    for (int d = 0; d + 2 < nd; d++) {
      oo += idx[d] * a->st_out[d];
      io += idx[d] * a->st_in[0][d];
    }
    char *po = (char *)a->out + oo * (int64_t)e;
    const char *pi = (const char *)a->in[0] + io * (int64_t)e;
    switch (e) {
    case 1: TILE_COPY(uint8_t) break;
    case 2: TILE_COPY(uint16_t) break;
    case 4: TILE_COPY(uint32_t) break;
    default: TILE_COPY(uint64_t) break;
    }
    for (int d = nd - 3; d >= 0; d--) {
      if (++idx[d] < a->shape[d]) break;
      idx[d] = 0;
    }
  }
  return true;
}

/* The generic loop: rows of the innermost dim, each row's base found from the outer index
 * (recomputed per row, not per element), then pointers stepped by byte strides along the row.
 * Floating results go through f64 chunks (load, op, store, each with its switch outside the
 * element loop); i64 results stay per element in i64; the contiguous same-dtype f32 binary
 * ops take the fast path above. */
void ebb__ew_cpu(void *args) {
  const ebb__ew_args *a = args;
  if (ew_fast(a) || copy_tiled(a)) return;
  const int nd = a->ndim, nin = a->nin, op = a->op, dto = a->dt_out;
  const int64_t inner = nd ? a->shape[nd - 1] : 1;
  int64_t outer = 1;
  for (int d = 0; d + 1 < nd; d++) outer *= a->shape[d];
  const size_t eo = ebb__dtype_size[dto];
  size_t ei[3] = {0, 0, 0};
  for (int k = 0; k < nin; k++) ei[k] = ebb__dtype_size[a->dt_in[k]];
  const bool ints = ebb__ew_exact_int(a);
  const ebb__vec_ops *vec = !ints && ew_in_f32(a) ? ebb__vec_pick() : NULL;
  const int64_t is0 = ebb__d2i(a->s0), is1 = ebb__d2i(a->s1);
  /* no dims: one element, strided as if contiguous */
  const int64_t so = (nd ? a->st_out[nd - 1] : 1) * (int64_t)eo;
  int64_t si[3] = {0, 0, 0};
  for (int k = 0; k < nin; k++) si[k] = (nd ? a->st_in[k][nd - 1] : 1) * (int64_t)ei[k];

  int64_t idx[EBB_TENSOR_MAX_DIMS] = {0};
  uint64_t lin = 0; /* row-major index of the output element: the counter of rand/arange */
  for (int64_t r = 0; r < outer; r++) {
    int64_t oo = 0, io[3] = {0, 0, 0};
    for (int d = 0; d + 1 < nd; d++) {
      oo += idx[d] * a->st_out[d];
      for (int k = 0; k < nin; k++) io[k] += idx[d] * a->st_in[k][d];
    }
    char *po = (char *)a->out + oo * (int64_t)eo;
    const char *pi[3] = {NULL, NULL, NULL};
    for (int k = 0; k < nin; k++) pi[k] = (const char *)a->in[k] + io[k] * (int64_t)ei[k];
    switch (op) {
    case EBB__EW_FILL: /* i64 takes the truncated value exactly; bool, like every dtype, v != 0 */
      if (dto == EBB_I64)
        for (int64_t i = 0; i < inner; i++, po += so) ebb__sti(po, dto, is0);
      else
        for (int64_t i = 0; i < inner; i++, po += so) ebb__store_dt(po, dto, a->s0);
      break;
    case EBB__EW_ARANGE:
      for (int64_t i = 0; i < inner; i++, po += so) ebb__store_dt(po, dto, ebb__arange_at(a->s0, a->s1, lin + (uint64_t)i));
      break;
    case EBB__EW_RAND:
    case EBB__EW_RANDN:
      for (int64_t i = 0; i < inner; i++, po += so)
        ebb__store_dt(po, dto, ebb__random_at(op, dto, a->seed, a->offset + lin + (uint64_t)i));
      break;
    default:
      if (vec) {
        f32_row(vec, a, po, so, pi, si, inner);
      } else if (ints) {
        for (int64_t i = 0; i < inner; i++, po += so) {
          int64_t x = nin > 0 ? ebb__ldi(pi[0], a->dt_in[0]) : 0, y = nin > 1 ? ebb__ldi(pi[1], a->dt_in[1]) : 0;
          int64_t z = nin > 2 ? ebb__ldi(pi[2], a->dt_in[2]) : 0;
          int64_t r = 0; /* the op is one of ebb__ew_i's: ints says so */
          ebb__ew_i(op, x, y, z, is0, is1, &r);
          ebb__sti(po, dto, r);
          for (int k = 0; k < nin; k++) pi[k] += si[k];
        }
      } else {
        /* chunks: load every input's piece as f64, apply the op with its switch outside the
         * loop, store; all loads of a chunk precede its stores, so in-place ops are safe */
        double buf[3][EBB__CHUNK];
        for (int64_t i0 = 0; i0 < inner; i0 += EBB__CHUNK) {
          const int64_t m = inner - i0 < EBB__CHUNK ? inner - i0 : EBB__CHUNK;
          for (int k = 0; k < nin; k++) {
            load_row(buf[k], pi[k], si[k], m, a->dt_in[k]);
            pi[k] += si[k] * m;
          }
          op_row(op, buf[0], nin > 1 ? buf[1] : NULL, nin > 2 ? buf[2] : NULL, m, a->s0, a->s1);
          store_row(po, so, buf[0], m, dto);
          po += so * m;
        }
      }
      break;
    }
    lin += (uint64_t)inner;
    for (int d = nd - 2; d >= 0; d--) { /* next row */
      if (++idx[d] < a->shape[d]) break;
      idx[d] = 0;
    }
  }
}

/* ---- reductions --------------------------------------------------------------------------- */

/* One output element per outer iteration, its inner elements visited in row-major order of
 * the reduced dims, accumulated in f64. For max the first maximum wins ties (its inner index
 * is reported) and the first NaN wins over everything. */
/* Reductions whose kept innermost dim lies closer in memory than the reduced ones (a sum over
 * rows of a row-major matrix, say): a chunk of neighbouring outputs is accumulated at once,
 * each inner element j loading one contiguous-ish piece for all of them. Every output still
 * sees its inner elements in row-major order j = 0, 1, ..., so results match the other loop. */
#define COLS 512 /* outputs accumulated at once by reduce_columns */

/* acc[k] += element k of a row of m, `stride` bytes apart: the vector loops for floating
 * inputs (direct for a unit stride, else through an f32 chunk), f64 otherwise. */
static void add_cols(const ebb__vec_ops *v, double *acc, const char *p, int64_t stride, int64_t m, int dt) {
  if (dt == EBB_F32 && stride == 4) {
    v->add_cols_f32(acc, (const float *)(const void *)p, m);
  } else if (dt == EBB_F64 && stride == 8) {
    v->add_cols_f64(acc, (const double *)(const void *)p, m);
  } else if (dt == EBB_F32 || dt == EBB_BF16 || dt == EBB_F16) {
    float buf[COLS];
    v->load(buf, p, stride, m, dt);
    v->add_cols_f32(acc, buf, m);
  } else {
    double buf[COLS];
    load_row(buf, p, stride, m, dt);
    v->add_cols_f64(acc, buf, m);
  }
}

static void reduce_columns(const ebb__red_args *a, int64_t outer, int64_t inner) {
  const ebb__vec_ops *v = ebb__vec_pick();
  const size_t ei = ebb__dtype_size[a->dt_in], eo = ebb__dtype_size[a->dt_out];
  const int no = a->nouter, ni = a->ninner;
  const int64_t olast = a->oshape[no - 1], ostride = a->ost_in[no - 1] * (int64_t)ei;
  const int64_t orows = olast ? outer / olast : 0;
  double buf[COLS], acc[COLS];
  int64_t best[COLS];
  bool nan[COLS];
  int64_t oidx[EBB_TENSOR_MAX_DIMS] = {0};
  for (int64_t orow = 0; orow < orows; orow++) {
    int64_t ibase = 0, obase = 0;
    for (int d = 0; d + 1 < no; d++) {
      ibase += oidx[d] * a->ost_in[d];
      obase += oidx[d] * a->ost_out[d];
    }
    for (int64_t k0 = 0; k0 < olast; k0 += COLS) {
      const int64_t m = olast - k0 < COLS ? olast - k0 : COLS;
      for (int64_t k = 0; k < m; k++) {
        acc[k] = ebb__red_init(a->op);
        best[k] = 0;
        nan[k] = false;
      }
      int64_t iidx[EBB_TENSOR_MAX_DIMS] = {0};
      for (int64_t j = 0; j < inner; j++) {
        int64_t off = ibase + k0 * a->ost_in[no - 1];
        for (int d = 0; d < ni; d++) off += iidx[d] * a->ist_in[d];
        const char *p = (const char *)a->in + off * (int64_t)ei;
        if (a->op == EBB__RED_MAX) {
          load_row(buf, p, ostride, m, a->dt_in);
          for (int64_t k = 0; k < m; k++) ebb__red_max_step(&acc[k], &best[k], &nan[k], buf[k], j);
        } else {
          add_cols(v, acc, p, ostride, m, a->dt_in);
        }
        for (int d = ni - 1; d >= 0; d--) {
          if (++iidx[d] < a->ishape[d]) break;
          iidx[d] = 0;
        }
      }
      for (int64_t k = 0; k < m; k++) {
        double v = ebb__red_finish(a->op, acc[k], inner);
        int64_t o = obase + (k0 + k) * a->ost_out[no - 1];
        ebb__store_dt((char *)a->out + o * (int64_t)eo, a->dt_out, v);
        if (a->idx) a->idx[o] = best[k];
      }
    }
    for (int d = no - 2; d >= 0; d--) {
      if (++oidx[d] < a->oshape[d]) break;
      oidx[d] = 0;
    }
  }
}

static int64_t abs64(int64_t x) { return x < 0 ? -x : x; }

/* The sum of a run of n elements, `stride` bytes apart, in f64: the vector loops' fixed order
 * of partial sums, over the run itself (unit stride) or over f32/f64 chunks of it. */
static double run_sum(const ebb__vec_ops *v, const char *p, int64_t stride, int64_t n, int dt) {
  if (dt == EBB_F32 && stride == 4) return v->sum_f32((const float *)(const void *)p, n);
  if (dt == EBB_F64 && stride == 8) return v->sum_f64((const double *)(const void *)p, n);
  double acc = 0;
  if (dt == EBB_F32 || dt == EBB_BF16 || dt == EBB_F16) {
    float buf[EBB__VEC_CHUNK];
    for (int64_t k0 = 0; k0 < n; k0 += EBB__VEC_CHUNK) {
      const int64_t m = n - k0 < EBB__VEC_CHUNK ? n - k0 : EBB__VEC_CHUNK;
      v->load(buf, p + k0 * stride, stride, m, dt);
      acc += v->sum_f32(buf, m);
    }
  } else {
    double buf[EBB__CHUNK];
    for (int64_t k0 = 0; k0 < n; k0 += EBB__CHUNK) {
      const int64_t m = n - k0 < EBB__CHUNK ? n - k0 : EBB__CHUNK;
      load_row(buf, p + k0 * stride, stride, m, dt);
      acc += v->sum_f64(buf, m);
    }
  }
  return acc;
}

/* Merges neighbouring reduced dims whose strides chain (a contiguous block becomes one run):
 * the row-major order of the inner elements, and so the max's index, is unchanged. */
static void merge_inner(ebb__red_args *a) {
  int n = 0;
  for (int d = 0; d < a->ninner; d++) {
    if (n > 0 && a->ist_in[n - 1] == a->ist_in[d] * a->ishape[d]) {
      a->ishape[n - 1] *= a->ishape[d];
      a->ist_in[n - 1] = a->ist_in[d];
      continue;
    }
    a->ishape[n] = a->ishape[d];
    a->ist_in[n++] = a->ist_in[d];
  }
  a->ninner = n;
}

void ebb__reduce_cpu(void *args) {
  ebb__red_args merged = *(const ebb__red_args *)args;
  merge_inner(&merged);
  const ebb__red_args *a = &merged;
  const ebb__vec_ops *v = ebb__vec_pick();
  if (a->nouter > 0 && a->ninner > 0 && a->oshape[a->nouter - 1] > 1 &&
      abs64(a->ost_in[a->nouter - 1]) < abs64(a->ist_in[a->ninner - 1])) {
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < a->nouter; d++) outer *= a->oshape[d];
    for (int d = 0; d < a->ninner; d++) inner *= a->ishape[d];
    reduce_columns(a, outer, inner);
    return;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < a->nouter; d++) outer *= a->oshape[d];
  for (int d = 0; d < a->ninner; d++) inner *= a->ishape[d];
  const size_t ei = ebb__dtype_size[a->dt_in], eo = ebb__dtype_size[a->dt_out];
  /* the last reduced dim is walked in chunks (load as f64, then accumulate); the others index
   * the start of each such run */
  const int ni = a->ninner;
  const int64_t last = ni ? a->ishape[ni - 1] : 1, lstride = ni ? a->ist_in[ni - 1] * (int64_t)ei : 0;
  const int64_t runs = last ? inner / last : 0;
  double buf[EBB__CHUNK];
  int64_t oidx[EBB_TENSOR_MAX_DIMS] = {0};
  for (int64_t r = 0; r < outer; r++) {
    int64_t ibase = 0, obase = 0;
    for (int d = 0; d < a->nouter; d++) {
      ibase += oidx[d] * a->ost_in[d];
      obase += oidx[d] * a->ost_out[d];
    }
    int64_t iidx[EBB_TENSOR_MAX_DIMS] = {0};
    double acc = ebb__red_init(a->op);
    int64_t best = 0;
    bool nan = false;
    for (int64_t run = 0; run < runs; run++) {
      int64_t off = ibase;
      for (int d = 0; d + 1 < ni; d++) off += iidx[d] * a->ist_in[d];
      const char *p = (const char *)a->in + off * (int64_t)ei;
      if (a->op != EBB__RED_MAX) {
        acc += run_sum(v, p, lstride, last, a->dt_in); /* a fixed order: the same sum every time */
      } else {
        for (int64_t k0 = 0; k0 < last; k0 += EBB__CHUNK) {
          const int64_t m = last - k0 < EBB__CHUNK ? last - k0 : EBB__CHUNK;
          load_row(buf, p + k0 * lstride, lstride, m, a->dt_in);
          for (int64_t k = 0; k < m; k++) ebb__red_max_step(&acc, &best, &nan, buf[k], run * last + k0 + k);
        }
      }
      for (int d = ni - 2; d >= 0; d--) {
        if (++iidx[d] < a->ishape[d]) break;
        iidx[d] = 0;
      }
    }
    acc = ebb__red_finish(a->op, acc, inner);
    ebb__store_dt((char *)a->out + obase * (int64_t)eo, a->dt_out, acc);
    if (a->idx) a->idx[obase] = best;
    for (int d = a->nouter - 1; d >= 0; d--) {
      if (++oidx[d] < a->oshape[d]) break;
      oidx[d] = 0;
    }
  }
}

/* ---- matmul -------------------------------------------------------------------------------- */

/* Leaving OpenBLAS before the process exits.
 *
 * OpenBLAS's own destructor (gotoblas_quit, at exit) stops its thread pool by storing a "quit"
 * mark in each pool thread's job slot and joining the threads. A pool thread that is running a
 * job at that moment overwrites the mark with "idle" when the job ends, then sleeps, and the join
 * never returns: the process hangs in exit. ebb calls OpenBLAS from threads that exit() does not
 * stop (the emulated driver's engines run queued matmuls, user threads run CPU ones), so a
 * program that exits with matmuls in flight hits that window. OpenBLAS serialises concurrent
 * level-3 callers itself (one gemm uses the pool at a time), so callers need no lock of ours; what
 * must not happen is a call in flight when the pool is torn down.
 *
 * So every gemm passes a gate. At exit, blas_close_at_exit shuts it: calls already inside finish
 * (it waits for them, bounded), and a call arriving later parks its thread for good, as a GPU
 * kernel would be cut off by the process ending. The gate closes in an ELF destructor rather
 * than an atexit handler, for two orders: destructors run after every atexit handler and C++
 * static destructor, which may still compute (and sync on) matmuls; and the loader finalises an
 * object before the libraries it depends on, and libebb (or a program linking the ops module)
 * depends on libopenblas, so the gate is shut before gotoblas_quit runs. A dlclose that unloads
 * libebb runs the destructor too, and the statics go with the mapping: a later dlopen starts with
 * the gate open. */
#define BLAS_EXIT_WAIT_NS (10ull * 1000000000ull) /* longest wait at exit or fork for calls inside */
#define BLAS_EXIT_POLL_NS 50000l                  /* how often that wait looks */

/* The gate: open; shut for a fork (callers wait until the fork is done); shut for exit (callers
 * park for good). fork() shuts it too: OpenBLAS's own fork handler tears its pool down the same
 * way exit does, so a call inside would hang the fork; and a child must not inherit the count of
 * calls made by threads it does not have (its exit would wait the whole bound for them). */
enum { BLAS_OPEN, BLAS_FORKING, BLAS_EXITING };
static _Atomic unsigned blas_inside; /* gemm calls between blas_enter and blas_leave */
static _Atomic int blas_gate;

static void blas_pause(void) {
  const struct timespec poll = {0, BLAS_EXIT_POLL_NS};
  nanosleep(&poll, NULL);
}

static void blas_enter(void) {
  for (;;) {
    /* seq_cst, with the load below: pairs with blas_shut's store then load (a Dekker pair):
     * either this call sees the gate shut, or the shutting path sees it counted and waits. */
    atomic_fetch_add_explicit(&blas_inside, 1, memory_order_seq_cst);
    int g = atomic_load_explicit(&blas_gate, memory_order_seq_cst);
    if (g == BLAS_OPEN) return;
    /* seq_cst: as above; the shutting path stops counting this call */
    atomic_fetch_sub_explicit(&blas_inside, 1, memory_order_seq_cst);
    if (g == BLAS_EXITING)
      for (;;) pause(); /* the process is exiting: this thread never runs OpenBLAS again */
    /* acquire: pairs with the release that reopens the gate after the fork */
    while (atomic_load_explicit(&blas_gate, memory_order_acquire) == BLAS_FORKING) blas_pause();
  }
}

static void blas_leave(void) {
  /* seq_cst: pairs with the shutting path's load of the count */
  atomic_fetch_sub_explicit(&blas_inside, 1, memory_order_seq_cst);
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Shuts the gate (state `to`, from open) and waits, bounded, for the calls inside to leave. A
 * call still inside at the deadline is stuck beyond saving, and the caller goes on without it. */
static void blas_shut(int to) {
  int open = BLAS_OPEN;
  /* seq_cst: pairs with blas_enter's increment then load */
  if (!atomic_compare_exchange_strong_explicit(&blas_gate, &open, to, memory_order_seq_cst, memory_order_seq_cst) &&
      to == BLAS_EXITING)
    atomic_store_explicit(&blas_gate, BLAS_EXITING, memory_order_seq_cst); /* exit during a fork's shut */
  const uint64_t deadline = mono_ns() + BLAS_EXIT_WAIT_NS;
  while (atomic_load_explicit(&blas_inside, memory_order_seq_cst) != 0 && mono_ns() < deadline) blas_pause();
}

static void blas_fork_prepare(void) { blas_shut(BLAS_FORKING); }

static void blas_fork_reopen(void) {
  int forking = BLAS_FORKING;
  /* release: pairs with the waiting callers' acquire */
  atomic_compare_exchange_strong_explicit(&blas_gate, &forking, BLAS_OPEN, memory_order_release, memory_order_relaxed);
}

static void blas_fork_child(void) {
  /* The child has only the forking thread, which is inside no call: a count left by a call the
   * prepare gave up waiting for belongs to a thread the child does not have. */
  atomic_store_explicit(&blas_inside, 0, memory_order_relaxed);
  blas_fork_reopen();
}

/* Registered after OpenBLAS's own fork handler (libebb, or a program with the ops module, loads
 * after libopenblas), so this prepare runs before OpenBLAS's; glibc drops the handlers when the
 * object that registered them is unloaded. */
__attribute__((constructor)) static void blas_gate_init(void) {
  (void)pthread_atfork(blas_fork_prepare, blas_fork_reopen, blas_fork_child);
}

__attribute__((destructor)) static void blas_close_at_exit(void) { blas_shut(BLAS_EXITING); }

/* One gemm per batch entry, in row-major form; batch strides of 0 reuse one operand. OpenBLAS
 * runs its own threads inside each call; the whole batch passes the exit gate once. */
void ebb__matmul_cpu(void *args) {
  const ebb__mm_args *a = args;
  blas_enter();
  const enum CBLAS_TRANSPOSE ta = a->trans_a ? CblasTrans : CblasNoTrans, tb = a->trans_b ? CblasTrans : CblasNoTrans;
  for (int64_t b = 0; b < a->batch; b++) {
    if (a->dtype == EBB_F64)
      cblas_dgemm(CblasRowMajor, ta, tb, (int)a->m, (int)a->n, (int)a->k, 1.0, (const double *)a->a + b * a->sa,
                  (int)a->lda, (const double *)a->b + b * a->sb, (int)a->ldb, a->beta, (double *)a->c + b * a->sc,
                  (int)a->ldc);
    else
      cblas_sgemm(CblasRowMajor, ta, tb, (int)a->m, (int)a->n, (int)a->k, 1.0f, (const float *)a->a + b * a->sa,
                  (int)a->lda, (const float *)a->b + b * a->sb, (int)a->ldb, (float)a->beta, (float *)a->c + b * a->sc,
                  (int)a->ldc);
  }
  blas_leave();
}
