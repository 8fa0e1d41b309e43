/* blas_gpu.c: matmul on GPUs through cuBLAS, loaded with dlopen (no build-time dependency, as
 * with libcuda): cublas{S,D}gemmStridedBatched on the device's current stream.
 *
 * Owns: the dlopen'ed library (libcublas.so.13, .12, or libcublas.so), the resolved entry points,
 * and one cuBLAS handle per device, created on first use inside a device guard (so the device's
 * primary context is current, which cuBLAS binds to) and destroyed by the ops module's stop (ebb__blas_stop).
 * When cuBLAS cannot be loaded, ebb__gpu_gemm answers EBB_ENOTSUP (leaving the thread's error
 * message alone) and matmul falls back to its plain CUDA kernel. Devices with CPU kernels (the emulated driver) never come here.
 * Threading: library loading and handle creation take a leaf lock; a handle is then used by
 * any thread (cuBLAS handles are thread-safe when each call sets its stream, as here, under the
 * same lock, since setting the stream and enqueuing must not interleave between threads).
 * Status: compiled, never run: no GPU has been available to this code yet.
 */
#include <dlfcn.h>
#include <stdio.h>

#include "ebb_sync.h"
#include "ops_impl.h"

/* The cuBLAS v2 ABI subset used here (types as cublas_api.h has them). */
typedef struct cublasContext *ebb__cublas_t;
typedef int (*ebb__cublas_create_fn)(ebb__cublas_t *);
typedef int (*ebb__cublas_destroy_fn)(ebb__cublas_t);
typedef int (*ebb__cublas_stream_fn)(ebb__cublas_t, struct CUstream_st *);
typedef int (*ebb__cublas_sgemm_fn)(ebb__cublas_t, int, int, int, int, int, const float *, const float *, int, long long,
                                    const float *, int, long long, const float *, float *, int, long long, int);
typedef int (*ebb__cublas_dgemm_fn)(ebb__cublas_t, int, int, int, int, int, const double *, const double *, int, long long,
                                    const double *, int, long long, const double *, double *, int, long long, int);
enum { EBB__CUBLAS_OP_N = 0, EBB__CUBLAS_OP_T = 1 };

static ebb_mutex ebb__blas_lock = {PTHREAD_MUTEX_INITIALIZER, "cublas", EBB_RANK_LEAF};
static struct {
  int tried; /* 0: not yet, 1: loaded, -1: unavailable */
  void *dl;
  ebb__cublas_create_fn create;
  ebb__cublas_destroy_fn destroy;
  ebb__cublas_stream_fn set_stream;
  ebb__cublas_sgemm_fn sgemm;
  ebb__cublas_dgemm_fn dgemm;
  ebb__cublas_t handle[EBB_MAX_DEVICES];
} ebb__blas;

/* The ops module's stop, at the last ebb_shutdown: destroy the handles (inside a device guard
 * each); keep the library. */
void ebb__blas_stop(void) {
  ebb__cublas_t h[EBB_MAX_DEVICES];
  ebb__mutex_lock(&ebb__blas_lock);
  for (int d = 0; d < EBB_MAX_DEVICES; d++) {
    h[d] = ebb__blas.handle[d];
    ebb__blas.handle[d] = NULL;
  }
  ebb__mutex_unlock(&ebb__blas_lock);
  /* the guards take runtime locks, which rank below ours: no lock held here */
  for (int d = 0; d < EBB_MAX_DEVICES; d++) {
    ebb_dev_guard g;
    if (h[d] && ebb_dev_guard_enter(&g, d) == EBB_OK) {
      ebb__blas.destroy(h[d]);
      ebb_dev_guard_exit(&g);
    }
  }
}

static bool blas_load(void) {
  static const char *const names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
  for (size_t i = 0; i < EBB_ARRAY_LEN(names) && !ebb__blas.dl; i++) ebb__blas.dl = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!ebb__blas.dl) return false;
  /* POSIX guarantees a data pointer round trip for dlsym's result; copy it into the function
   * pointer through memcpy so -Wpedantic builds stay quiet. */
  void *p[5] = {dlsym(ebb__blas.dl, "cublasCreate_v2"), dlsym(ebb__blas.dl, "cublasDestroy_v2"), dlsym(ebb__blas.dl, "cublasSetStream_v2"),
                dlsym(ebb__blas.dl, "cublasSgemmStridedBatched"), dlsym(ebb__blas.dl, "cublasDgemmStridedBatched")};
  for (int i = 0; i < 5; i++)
    if (!p[i]) return false;
  memcpy(&ebb__blas.create, &p[0], sizeof p[0]);
  memcpy(&ebb__blas.destroy, &p[1], sizeof p[1]);
  memcpy(&ebb__blas.set_stream, &p[2], sizeof p[2]);
  memcpy(&ebb__blas.sgemm, &p[3], sizeof p[3]);
  memcpy(&ebb__blas.dgemm, &p[4], sizeof p[4]);
  return true;
}

ebb_status ebb__gpu_gemm(const char *fn, int device, ebb_stream_t *s, const ebb__mm_args *g) {
  if (device < 0 || device >= EBB_MAX_DEVICES) return ebb__fail(EBB_EDEVICE, "%s: device %d has no cuBLAS handle slot", fn, device);
  struct CUstream_st *cs;
  ebb_status st = ebb_stream_cu(s, &cs);
  if (st) return st;
  if (g->m > INT32_MAX || g->n > INT32_MAX || g->k > INT32_MAX || g->batch > INT32_MAX)
    return ebb__fail(EBB_ENOTSUP, "%s: matmul of %lld x %lld x %lld (batch %lld) exceeds cuBLAS's int sizes", fn, (long long)g->m,
                     (long long)g->n, (long long)g->k, (long long)g->batch);
  ebb_dev_guard guard;
  st = ebb_dev_guard_enter(&guard, device);
  if (st) return st;
  ebb__mutex_lock(&ebb__blas_lock);
  if (ebb__blas.tried == 0) ebb__blas.tried = blas_load() ? 1 : -1;
  if (ebb__blas.tried < 0) {
    ebb__mutex_unlock(&ebb__blas_lock);
    ebb_dev_guard_exit(&guard);
    return EBB_ENOTSUP; /* no message: the caller falls back to the plain kernel and succeeds */
  }
  int r = 0;
  if (!ebb__blas.handle[device]) r = ebb__blas.create(&ebb__blas.handle[device]);
  if (r == 0) r = ebb__blas.set_stream(ebb__blas.handle[device], cs);
  if (r == 0) {
    /* Row-major C = A B is column-major C^T = B^T A^T: swap the operands and m, n. */
    int ta = g->trans_a ? EBB__CUBLAS_OP_T : EBB__CUBLAS_OP_N, tb = g->trans_b ? EBB__CUBLAS_OP_T : EBB__CUBLAS_OP_N;
    if (g->dtype == EBB_F64) {
      const double one = 1.0, beta = g->beta;
      r = ebb__blas.dgemm(ebb__blas.handle[device], tb, ta, (int)g->n, (int)g->m, (int)g->k, &one, g->b, (int)g->ldb, g->sb, g->a, (int)g->lda,
                          g->sa, &beta, g->c, (int)g->ldc, g->sc, (int)g->batch);
    } else {
      const float one = 1.0f, beta = (float)g->beta;
      r = ebb__blas.sgemm(ebb__blas.handle[device], tb, ta, (int)g->n, (int)g->m, (int)g->k, &one, g->b, (int)g->ldb, g->sb, g->a, (int)g->lda,
                          g->sa, &beta, g->c, (int)g->ldc, g->sc, (int)g->batch);
    }
  }
  ebb__mutex_unlock(&ebb__blas_lock);
  ebb_dev_guard_exit(&guard);
  if (r != 0) return ebb__fail(EBB_EDRIVER, "%s: cuBLAS gemm on device %d failed with cublasStatus %d", fn, device, r);
  return EBB_OK;
}
