/* optim.c: the fused optimizer update (optim_export.h): SGD and AdamW over a list of parameters,
 * in place, never recorded.
 *
 * It owns nothing between calls: the parameters, gradients and state tensors are the caller's
 * (autograd/optim.c). A call checks every item first, then runs the in-place hook for each
 * parameter and updates them. On the CPU each parameter is one loop that reads its parameter,
 * gradient and state once and writes parameter and state once, with no temporary tensor; the
 * f32 loops are written so that the compiler vectorises them (ops/CMakeLists.txt compiles this
 * file with -O3). On a device the parameters of one dtype share one launch of "ebb.ops.optim"
 * on the device's current stream: their table (optim_kernels.h) is uploaded first on the same
 * stream, then the kernel runs the same per-tensor loops on the emulated driver's engine thread,
 * or the CUDA twin (cuda/optim_kernels.cuh) on a GPU, one block per chunk.
 * Threading: the caller orders calls that share parameters; everything else is per call.
 */
#include <stdlib.h>
#include <string.h>

#include "ops_impl.h"
#include "optim_export.h"
#include "optim_kernels.h"

#define EBB_ALWAYS_INLINE static inline __attribute__((always_inline))
/* The f32 loops are built twice, for the x86-64 baseline (SSE2) and for AVX2 (a target
 * attribute), and each call takes the one the CPU kernels' instruction-set choice allows
 * (ebb__cpu_isa: the processor's, capped by EBB_CPU_VEC). Both give the same bits: the arithmetic
 * is the same IEEE operations (no FMA contraction in either), only wider. Not GCC's
 * target_clones: its ifunc resolver runs while the loader relocates libebb, before a sanitizer's
 * runtime is ready, and ThreadSanitizer's instrumentation of it crashes the process at start. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EBB_OPTIM_AVX2 1
#define EBB_WIDE_BODY(name)                                                                                   \
  static void name(const ebb__optim_args *a, const ebb__optim_tensor *t) { name##_body(a, t); }               \
  __attribute__((target("avx2"))) static void name##_avx2(const ebb__optim_args *a, const ebb__optim_tensor *t) { \
    name##_body(a, t);                                                                                       \
  }
#else
#define EBB_WIDE_BODY(name) \
  static void name(const ebb__optim_args *a, const ebb__optim_tensor *t) { name##_body(a, t); }
#endif

/* ---- the per-tensor loops (CPU tensors, and the emulated driver's kernel) --------------------
 * One loop per dtype; the f32 loops are instantiated for each combination of the flags that
 * change what the loop reads (first step, amsgrad, maximize, nesterov), so no test is left in
 * the loop and it vectorises. bf16, f16 and f64 take the flags at run time. */

EBB_ALWAYS_INLINE void sgd_f32_run(const ebb__optim_args *a, const ebb__optim_tensor *t, int first, uint32_t flags) {
  float *restrict p = (float *)t->p;
  const float *restrict g = (const float *)t->g;
  float *restrict b = (float *)t->s0;
  const float lr = (float)t->lr, wd = (float)t->wd, mom = (float)a->momentum, damp1 = (float)(1.0 - a->dampening);
  const int64_t n = t->n;
  if (b) {
    for (int64_t i = 0; i < n; i++) p[i] = ebb__sgd_f(p[i], g[i], &b[i], first, lr, wd, mom, damp1, flags);
  } else {
    for (int64_t i = 0; i < n; i++) p[i] = ebb__sgd_f(p[i], g[i], NULL, first, lr, wd, 0.0f, damp1, flags);
  }
}

EBB_ALWAYS_INLINE void sgd_f32_body(const ebb__optim_args *a, const ebb__optim_tensor *t) {
  const uint32_t f = a->flags & (EBB__OPTIM_NESTEROV | EBB__OPTIM_MAXIMIZE);
  const int first = t->first != 0;
#define RUN(fi, fl) sgd_f32_run(a, t, fi, fl)
  if (first) {
    if (f == 0) RUN(1, 0);
    else if (f == EBB__OPTIM_NESTEROV) RUN(1, EBB__OPTIM_NESTEROV);
    else if (f == EBB__OPTIM_MAXIMIZE) RUN(1, EBB__OPTIM_MAXIMIZE);
    else RUN(1, EBB__OPTIM_NESTEROV | EBB__OPTIM_MAXIMIZE);
  } else {
    if (f == 0) RUN(0, 0);
    else if (f == EBB__OPTIM_NESTEROV) RUN(0, EBB__OPTIM_NESTEROV);
    else if (f == EBB__OPTIM_MAXIMIZE) RUN(0, EBB__OPTIM_MAXIMIZE);
    else RUN(0, EBB__OPTIM_NESTEROV | EBB__OPTIM_MAXIMIZE);
  }
#undef RUN
}

EBB_ALWAYS_INLINE void adamw_f32_run(const ebb__optim_args *a, const ebb__optim_tensor *t, int first, uint32_t flags) {
  float *restrict p = (float *)t->p;
  const float *restrict g = (const float *)t->g;
  float *restrict m = (float *)t->s0;
  float *restrict v = (float *)t->s1;
  float *restrict vm = (float *)t->s2;
  const float decay = (float)t->decay, step_size = (float)t->step_size, bc2_sqrt = (float)t->bc2_sqrt;
  const float b1 = (float)a->beta1, b1c = (float)(1.0 - a->beta1), b2 = (float)a->beta2, b2c = (float)(1.0 - a->beta2);
  const float eps = (float)a->eps;
  const int64_t n = t->n;
  if (flags & EBB__OPTIM_AMSGRAD) {
    for (int64_t i = 0; i < n; i++)
      p[i] = ebb__adamw_f(p[i], g[i], &m[i], &v[i], &vm[i], first, decay, step_size, bc2_sqrt, b1, b1c, b2, b2c, eps, flags);
  } else {
    for (int64_t i = 0; i < n; i++)
      p[i] = ebb__adamw_f(p[i], g[i], &m[i], &v[i], NULL, first, decay, step_size, bc2_sqrt, b1, b1c, b2, b2c, eps, flags);
  }
}

EBB_ALWAYS_INLINE void adamw_f32_body(const ebb__optim_args *a, const ebb__optim_tensor *t) {
  const uint32_t f = a->flags & (EBB__OPTIM_AMSGRAD | EBB__OPTIM_MAXIMIZE);
  const int first = t->first != 0;
#define RUN(fi, fl) adamw_f32_run(a, t, fi, fl)
  if (first) {
    if (f == 0) RUN(1, 0);
    else if (f == EBB__OPTIM_AMSGRAD) RUN(1, EBB__OPTIM_AMSGRAD);
    else if (f == EBB__OPTIM_MAXIMIZE) RUN(1, EBB__OPTIM_MAXIMIZE);
    else RUN(1, EBB__OPTIM_AMSGRAD | EBB__OPTIM_MAXIMIZE);
  } else {
    if (f == 0) RUN(0, 0);
    else if (f == EBB__OPTIM_AMSGRAD) RUN(0, EBB__OPTIM_AMSGRAD);
    else if (f == EBB__OPTIM_MAXIMIZE) RUN(0, EBB__OPTIM_MAXIMIZE);
    else RUN(0, EBB__OPTIM_AMSGRAD | EBB__OPTIM_MAXIMIZE);
  }
#undef RUN
}

EBB_WIDE_BODY(sgd_f32)
EBB_WIDE_BODY(adamw_f32)

/* bf16 and f16: 16-bit storage, f32 arithmetic, each value rounded back to nearest even once
 * per op's result, as PyTorch's ops on such tensors round each intermediate tensor. */
EBB_ALWAYS_INLINE float ld16(const uint16_t *x, int64_t i, int bf) { return bf ? ebb__bf16_to_f32(x[i]) : ebb__f16_to_f32(x[i]); }
EBB_ALWAYS_INLINE uint16_t st16(float v, int bf) { return bf ? ebb__f32_to_bf16(v) : ebb__f32_to_f16(v); }
EBB_ALWAYS_INLINE float rnd16(float v, int bf) { return bf ? ebb__bf16_to_f32(ebb__f32_to_bf16(v)) : ebb__f16_to_f32(ebb__f32_to_f16(v)); }

static void sgd_16(const ebb__optim_args *a, const ebb__optim_tensor *t, int bf) {
  uint16_t *p = (uint16_t *)t->p, *b = (uint16_t *)t->s0;
  const uint16_t *g = (const uint16_t *)t->g;
  const float lr = (float)t->lr, wd = (float)t->wd, mom = b ? (float)a->momentum : 0.0f, damp1 = (float)(1.0 - a->dampening);
  for (int64_t i = 0; i < t->n; i++) {
    float pv = ld16(p, i, bf), gv = ld16(g, i, bf);
    float d = (a->flags & EBB__OPTIM_MAXIMIZE) ? -gv : gv;
    if (wd != 0.0f) d = rnd16(d + wd * pv, bf);
    if (mom != 0.0f) {
      float bv = t->first ? d : rnd16(rnd16(ld16(b, i, bf) * mom, bf) + damp1 * d, bf);
      b[i] = st16(bv, bf);
      d = (a->flags & EBB__OPTIM_NESTEROV) ? rnd16(d + mom * bv, bf) : bv;
    }
    p[i] = st16(pv + -lr * d, bf);
  }
}

static void adamw_16(const ebb__optim_args *a, const ebb__optim_tensor *t, int bf) {
  uint16_t *p = (uint16_t *)t->p, *m = (uint16_t *)t->s0, *v = (uint16_t *)t->s1, *vm = (uint16_t *)t->s2;
  const uint16_t *g = (const uint16_t *)t->g;
  const float decay = (float)t->decay, step_size = (float)t->step_size, bc2_sqrt = (float)t->bc2_sqrt;
  const float b1 = (float)a->beta1, b1c = (float)(1.0 - a->beta1), b2 = (float)a->beta2, b2c = (float)(1.0 - a->beta2);
  const float eps = (float)a->eps;
  const bool ams = (a->flags & EBB__OPTIM_AMSGRAD) != 0;
  for (int64_t i = 0; i < t->n; i++) {
    float gv = ld16(g, i, bf);
    if (a->flags & EBB__OPTIM_MAXIMIZE) gv = -gv;
    float pv = rnd16(ld16(p, i, bf) * decay, bf);
    float mo = t->first ? 0.0f : ld16(m, i, bf), vo = t->first ? 0.0f : ld16(v, i, bf);
    float mn = rnd16(rnd16(mo * b1, bf) + b1c * gv, bf);
    float vn = rnd16(rnd16(vo * b2, bf) + b2c * (gv * gv), bf);
    m[i] = st16(mn, bf);
    v[i] = st16(vn, bf);
    if (ams) {
      float x = t->first ? 0.0f : ld16(vm, i, bf);
      vn = x > vn ? x : vn;
      vm[i] = st16(vn, bf);
    }
    float denom = rnd16(rnd16(rnd16(sqrtf(vn), bf) / bc2_sqrt, bf) + eps, bf);
    p[i] = st16(pv + -step_size * (mn / denom), bf);
  }
}

static void sgd_f64(const ebb__optim_args *a, const ebb__optim_tensor *t) {
  double *p = (double *)t->p, *b = (double *)t->s0;
  const double *g = (const double *)t->g;
  const double mom = b ? a->momentum : 0.0;
  for (int64_t i = 0; i < t->n; i++) p[i] = ebb__sgd_d(p[i], g[i], b ? &b[i] : NULL, t->first, t->lr, t->wd, mom, 1.0 - a->dampening, a->flags);
}

static void adamw_f64(const ebb__optim_args *a, const ebb__optim_tensor *t) {
  double *p = (double *)t->p, *m = (double *)t->s0, *v = (double *)t->s1, *vm = (double *)t->s2;
  const double *g = (const double *)t->g;
  for (int64_t i = 0; i < t->n; i++)
    p[i] = ebb__adamw_d(p[i], g[i], &m[i], &v[i], vm ? &vm[i] : NULL, t->first, t->decay, t->step_size, t->bc2_sqrt, a->beta1,
                        1.0 - a->beta1, a->beta2, 1.0 - a->beta2, a->eps, a->flags);
}

static void optim_tensor(const ebb__optim_args *a, const ebb__optim_tensor *t) {
  if (t->n == 0) return;
  const bool sgd = a->kind == EBB__OPTIM_SGD;
  switch (a->dtype) {
  case EBB__KDT_F32:
#ifdef EBB_OPTIM_AVX2
    if (ebb__cpu_isa() >= EBB__ISA_AVX2) {
      sgd ? sgd_f32_avx2(a, t) : adamw_f32_avx2(a, t);
      break;
    }
#endif
    sgd ? sgd_f32(a, t) : adamw_f32(a, t);
    break;
  case EBB__KDT_F64: sgd ? sgd_f64(a, t) : adamw_f64(a, t); break;
  case EBB__KDT_BF16: sgd ? sgd_16(a, t, 1) : adamw_16(a, t, 1); break;
  case EBB__KDT_F16: sgd ? sgd_16(a, t, 0) : adamw_16(a, t, 0); break;
  default: break; /* refused before any launch */
  }
}

/* The kernel "ebb.ops.optim" on the emulated driver: each tensor of the table in turn (the
 * chunks are the CUDA blocks' division of the same work). */
void ebb__optim_cpu(void *args) {
  const ebb__optim_args *a = (const ebb__optim_args *)args;
  for (int32_t k = 0; k < a->ntensors; k++) optim_tensor(a, &a->tensors[k]);
}

/* ---- checks ------------------------------------------------------------------------------------ */

static ebb_status check_item(const char *fn, const ebb__optim_item *it) {
  char pd[EBB__DESC_MAX], gd[EBB__DESC_MAX];
  ebb_status st = ebb__tensor_check_at(it->param, fn, "params", it->index);
  if (!st) st = ebb__tensor_check_at(it->grad, fn, "grads", it->index);
  if (st) return st;
  const ebb_tensor_t *p = it->param, *g = it->grad;
  ebb__tensor_desc(p, "params", it->index, pd, sizeof pd);
  if (!ebb_dtype_is_float(p->dtype))
    return ebb__fail(EBB_EINVAL, "%s: %s is not floating; expected an f32, f64, bf16 or f16 parameter", fn, pd);
  if (!ebb__is_contiguous(p))
    return ebb__fail(EBB_EINVAL, "%s: %s is not contiguous; expected a contiguous parameter", fn, pd);
  ebb__tensor_desc(g, "its gradient", -1, gd, sizeof gd);
  if (g->stor->device != p->stor->device)
    return ebb__fail(EBB_EDEVICE, "%s: %s is on another device than %s; expected the parameter's device", fn, gd, pd);
  if (g->dtype != p->dtype || g->ndim != p->ndim || memcmp(g->shape, p->shape, sizeof(int64_t) * (size_t)p->ndim) != 0)
    return ebb__fail(EBB_EINVAL, "%s: %s does not match %s; expected the parameter's shape and dtype", fn, gd, pd);
  for (int k = 0; k < 3; k++)
    EBB_ASSERT(!it->state[k] || (it->state[k]->dtype == p->dtype && it->state[k]->stor->device == p->stor->device &&
                                 ebb__is_contiguous(it->state[k]) &&
                                 ebb__numel(it->state[k]->shape, it->state[k]->ndim) == ebb__numel(p->shape, p->ndim)));
  return EBB_OK;
}

/* ---- one update --------------------------------------------------------------------------------- */

static void fill_tensor(const ebb__optim_hyper *h, const ebb__optim_item *it, const ebb_tensor_t *g, ebb__optim_tensor *t) {
  memset(t, 0, sizeof *t);
  t->p = ebb__tensor_ptr(it->param);
  t->g = ebb__tensor_ptr(g);
  t->s0 = it->state[0] ? ebb__tensor_ptr(it->state[0]) : NULL;
  t->s1 = it->state[1] ? ebb__tensor_ptr(it->state[1]) : NULL;
  t->s2 = it->state[2] ? ebb__tensor_ptr(it->state[2]) : NULL;
  t->n = ebb__numel(it->param->shape, it->param->ndim);
  t->lr = it->lr;
  t->wd = it->weight_decay;
  t->first = it->first;
  if (h->kind == EBB__OPTIM_ADAMW) {
    double st = (double)it->step;
    t->decay = 1.0 - it->lr * it->weight_decay;
    t->step_size = it->lr / (1.0 - pow(h->beta1, st));
    t->bc2_sqrt = sqrt(1.0 - pow(h->beta2, st));
  }
}

static void fill_args(const ebb__optim_hyper *h, int dtype, ebb__optim_args *a) {
  memset(a, 0, sizeof *a);
  a->kind = h->kind;
  a->dtype = dtype;
  a->flags = h->flags;
  a->momentum = h->momentum;
  a->dampening = h->dampening;
  a->beta1 = h->beta1;
  a->beta2 = h->beta2;
  a->eps = h->eps;
}

/* The items idx[0..m) of one device and dtype as one launch: the table uploaded on the device's
 * current stream, then the kernel on the same stream. */
static ebb_status launch_group(const char *fn, const ebb__optim_hyper *h, const ebb__optim_item *items, const ebb_tensor_t *const *grads,
                               const int *idx, int m) {
  const ebb_tensor_t *p0 = items[idx[0]].param;
  const int device = p0->stor->device;
  int64_t nchunks = 0;
  for (int k = 0; k < m; k++) {
    int64_t n = ebb__numel(items[idx[k]].param->shape, items[idx[k]].param->ndim);
    nchunks += (n + EBB__OPTIM_CHUNK - 1) / EBB__OPTIM_CHUNK;
  }
  if (nchunks > INT32_MAX) return ebb__fail(EBB_EINVAL, "%s: %lld chunks of parameters on device %d; expected at most %d", fn,
                                            (long long)nchunks, device, INT32_MAX);
  size_t tbytes = sizeof(ebb__optim_tensor) * (size_t)m, bytes = tbytes + sizeof(ebb__optim_chunk) * (size_t)nchunks;
  bytes = (bytes + 7) & ~(size_t)7;
  unsigned char *host = calloc(1, bytes);
  ebb__operand *ops = calloc((size_t)m * 5 + 1, sizeof *ops);
  if (!host || !ops) {
    free(host);
    free(ops);
    return ebb__fail(EBB_ENOMEM, "%s: no host memory for the table of %d parameters on device %d", fn, m, device);
  }
  ebb__optim_tensor *tab = (ebb__optim_tensor *)host;
  ebb__optim_chunk *ch = (ebb__optim_chunk *)(host + tbytes);
  int nops = 1;
  int64_t c = 0;
  for (int k = 0; k < m; k++) {
    const ebb__optim_item *it = &items[idx[k]];
    fill_tensor(h, it, grads[idx[k]], &tab[k]);
    for (int64_t s = 0; s < tab[k].n; s += EBB__OPTIM_CHUNK) ch[c++] = (ebb__optim_chunk){.tensor = k, .start = s};
    ops[nops++] = (ebb__operand){it->param, true};
    ops[nops++] = (ebb__operand){grads[idx[k]], false};
    for (int j = 0; j < 3; j++)
      if (it->state[j]) ops[nops++] = (ebb__operand){it->state[j], true};
  }
  ebb_tensor_t *dtab = NULL;
  const int64_t words = (int64_t)(bytes / 8);
  ebb_status st = ebb_tensor_from_host(device, EBB_I64, 1, &words, host, bytes, &dtab);
  free(host);
  if (!st) {
    ebb__optim_args a;
    fill_args(h, (int)p0->dtype, &a);
    a.ntensors = m;
    a.nchunks = (int32_t)nchunks;
    unsigned char *base = (unsigned char *)ebb__tensor_ptr(dtab);
    a.tensors = (const ebb__optim_tensor *)base;
    a.chunks = (const ebb__optim_chunk *)(base + tbytes);
    ops[0] = (ebb__operand){dtab, false};
    st = ebb__launch(fn, EBB__K_OPTIM, device, &a, ops, nops, (nchunks > 0 ? nchunks : 1) * 256);
  }
  /* stream-ordered: the table's memory is reused only after the kernel on this stream read it */
  ebb__tensor_put(dtab);
  free(ops);
  return ebb__fail_in(fn, st);
}

ebb_status ebb__optim_fused(const char *fn, const ebb__optim_hyper *h, const ebb__optim_item *items, int n,
                            bool *updated) {
  if (updated)
    for (int i = 0; i < n; i++) updated[i] = false;
  if (n <= 0) return EBB_OK;
  for (int i = 0; i < n; i++) {
    ebb_status st = check_item(fn, &items[i]);
    if (st) return st;
  }
  const ebb_tensor_t **grads = calloc((size_t)n, sizeof *grads);
  ebb_tensor_t **copies = calloc((size_t)n, sizeof *copies);
  void **tok = calloc((size_t)n, sizeof *tok);
  int *idx = calloc((size_t)n, sizeof *idx);
  bool *done = calloc((size_t)n, sizeof *done);
  ebb_status st = grads && copies && tok && idx && done ? EBB_OK : ebb__fail(EBB_ENOMEM, "%s: no host memory for %d parameters", fn, n);
  /* A gradient that is not contiguous is read through a contiguous copy (one kernel). */
  for (int i = 0; !st && i < n; i++) {
    grads[i] = items[i].grad;
    if (!ebb__is_contiguous(items[i].grad) && !(st = ebb__copy_as(fn, items[i].grad, items[i].grad->dtype, &copies[i])))
      grads[i] = copies[i];
  }
  int checked = 0;
  for (; !st && checked < n; checked++) st = ebb__inplace_check(fn, EBB__OP_COPY_, items[checked].param, NULL, 0, NULL, &tok[checked]);
  if (!st) {
    /* one pass per tensor on the CPU; one launch per (device, dtype) group elsewhere */
    for (int i = 0; !st && i < n; i++) {
      if (done[i]) continue;
      const ebb_tensor_t *p = items[i].param;
      if (p->stor->device == EBB_DEVICE_CPU) {
        ebb__optim_args a;
        ebb__optim_tensor t;
        fill_args(h, (int)p->dtype, &a);
        fill_tensor(h, &items[i], grads[i], &t);
        optim_tensor(&a, &t);
        done[i] = true;
        continue;
      }
      int m = 0;
      for (int j = i; j < n; j++) {
        const ebb_tensor_t *q = items[j].param;
        if (!done[j] && q->stor->device == p->stor->device && q->dtype == p->dtype) {
          idx[m++] = j;
          done[j] = true;
        }
      }
      st = launch_group(fn, h, items, grads, idx, m);
      for (int k = 0; st && k < m; k++) done[idx[k]] = false; /* nothing of this group was enqueued */
    }
  }
  /* Every parameter the update reached changed (a failed launch leaves the earlier groups'
   * work queued): their versions move, so no saved value of them passes for current. */
  for (int i = 0; i < checked; i++) {
    bool changed = done && done[i];
    if (changed) atomic_fetch_add_explicit(&items[i].param->stor->version, 1, memory_order_relaxed);
    if (updated) updated[i] = changed;
    ebb__inplace_end(tok[i], changed);
  }
  for (int i = 0; copies && i < n; i++) ebb__tensor_put(copies[i]);
  free(grads);
  free(copies);
  free(tok);
  free(idx);
  free(done);
  return st;
}
