/* dist_ranks.c: the multi-process checks of ebb/dist.h, run by ctest under
 * `mpirun --oversubscribe -np N` (tests/dist/CMakeLists.txt). Every rank runs the same program;
 * each check prints "rank R: FAIL ..." and the program exits 1 on any failure, so mpirun's status
 * is the test's. Modes:
 *   collectives  all-reduce sum and avg (exact on integer-valued f32, f64, i64), broadcast from
 *                the first and last rank, all-gather, barrier, many collectives in flight with
 *                handles, the blocking form; on a CPU group and on a group of one emulated
 *                device per rank (device rank % count).
 *   streams      stream order on a device group: a kernel writes the input just before the
 *                collective on the caller's stream, and the caller's next kernel reads the result.
 *                Run with EBB_SIM_LAUNCH_US=2000 (each kernel keeps the device 2 ms), so either
 *                missing wait reads stale data.
 *   caller-init  the program initialises MPI itself (MPI_THREAD_MULTIPLE) before ebb; ebb leaves
 *                it initialised at shutdown, and the program finalises it.
 *   timeout      rank 1 issues its all-reduce 4 s late; rank 0's group has a 1 s timeout, so its
 *                wait fails with EBB_EIO, later collectives are refused (EBB_ESTATE), and its
 *                destroy answers EBB_EBUSY until the late call lets MPI return, then succeeds.
 *   kill         rank 1 aborts before the first collective; the others issue it and wait. The
 *                test expects mpirun to end the job (non-zero) well before its timeout.
 * Device groups are MPI's, or NCCL's with EBB_TEST_DIST_BACKEND=nccl (a machine with CUDA GPUs).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ebb/dist.h"
#include "ebb/ebb.h"

#if EBB_TEST_CALLER_INIT
#include <mpi.h>
#endif

static int rank_ = -1, failures;

#define FAIL(...)                                  \
  do {                                             \
    fprintf(stderr, "rank %d: FAIL ", rank_);      \
    fprintf(stderr, __VA_ARGS__);                  \
    fprintf(stderr, "\n");                         \
    failures++;                                    \
  } while (0)

#define OK(call)                                                                             \
  do {                                                                                       \
    ebb_status st_ = (call);                                                                 \
    if (st_ != EBB_OK) {                                                                     \
      FAIL("%s:%d: %s -> %s: %s", __FILE__, __LINE__, #call, ebb_status_name(st_), ebb_last_error()); \
      return;                                                                                \
    }                                                                                        \
  } while (0)

/* A tensor of n doubles converted to dt, on device. */
static ebb_tensor_t *make(int device, ebb_dtype dt, int ndim, const int64_t *shape, const double *v, int64_t n) {
  size_t es = ebb_dtype_size(dt);
  unsigned char *buf = malloc((size_t)n * es + 1);
  for (int64_t i = 0; i < n; i++) {
    unsigned char *p = buf + i * (int64_t)es;
    if (dt == EBB_F32) { float f = (float)v[i]; memcpy(p, &f, 4); }
    else if (dt == EBB_F64) memcpy(p, &v[i], 8);
    else if (dt == EBB_I64) { int64_t x = (int64_t)v[i]; memcpy(p, &x, 8); }
    else if (dt == EBB_BF16) { uint16_t h = ebb_f32_to_bf16((float)v[i]); memcpy(p, &h, 2); }
  }
  ebb_tensor_t *t = NULL;
  if (ebb_tensor_from_host(device, dt, ndim, shape, buf, (size_t)n * es, &t)) {
    FAIL("ebb_tensor_from_host: %s", ebb_last_error());
    t = NULL;
  }
  free(buf);
  return t;
}

/* Reads t back as doubles into out (n elements). */
static int read_back(const ebb_tensor_t *t, ebb_dtype dt, double *out, int64_t n) {
  size_t es = ebb_dtype_size(dt);
  unsigned char *buf = malloc((size_t)n * es + 1);
  ebb_status st = ebb_tensor_to_host(t, buf, (size_t)n * es);
  if (st) {
    FAIL("ebb_tensor_to_host: %s", ebb_last_error());
    free(buf);
    return -1;
  }
  for (int64_t i = 0; i < n; i++) {
    unsigned char *p = buf + i * (int64_t)es;
    if (dt == EBB_F32) { float f; memcpy(&f, p, 4); out[i] = f; }
    else if (dt == EBB_F64) memcpy(&out[i], p, 8);
    else if (dt == EBB_I64) { int64_t x; memcpy(&x, p, 8); out[i] = (double)x; }
    else if (dt == EBB_BF16) { uint16_t h; memcpy(&h, p, 2); out[i] = ebb_bf16_to_f32(h); }
  }
  free(buf);
  return 0;
}

static void expect(const char *what, int device, const double *got, const double *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (got[i] != want[i]) {
      FAIL("%s on %s%d: element %lld is %.17g, expected %.17g", what, device < 0 ? "the CPU" : "device ",
           device < 0 ? 0 : device, (long long)i, got[i], want[i]);
      return;
    }
}

/* The backend of device groups: MPI, or NCCL when EBB_TEST_DIST_BACKEND=nccl (for a machine with
 * CUDA GPUs and libnccl.so.2; CPU groups are always MPI's). */
static ebb_dist_backend device_backend(int device) {
  const char *b = getenv("EBB_TEST_DIST_BACKEND");
  return device >= 0 && b && !strcmp(b, "nccl") ? EBB_DIST_NCCL : EBB_DIST_MPI;
}

#define N 1000

static void check_collectives(int device) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, NULL, &pg));
  int rank, size;
  OK(ebb_pg_rank(pg, &rank));
  OK(ebb_pg_size(pg, &size));
  if (rank != rank_) FAIL("group rank %d, expected %d", rank, rank_);
  static double v[N], got[N * 8], want[N * 8];
  int64_t n = N;

  /* all-reduce, sum and average, exact on integers: element i of rank r is r * 1000 + i - 300. */
  const ebb_dtype dts[3] = {EBB_F32, EBB_F64, EBB_I64};
  for (int k = 0; k < 3; k++)
    for (int avg = 0; avg < 2; avg++) {
      if (avg && dts[k] == EBB_I64) continue;
      for (int64_t i = 0; i < n; i++) v[i] = rank * 1000.0 + (double)i - 300;
      ebb_tensor_t *t = make(device, dts[k], 1, &n, v, n);
      if (!t) return;
      ebb_work_t *w = NULL;
      OK(ebb_all_reduce(pg, t, avg ? EBB_REDUCE_AVG : EBB_REDUCE_SUM, &w));
      OK(ebb_work_wait(w));
      OK(ebb_work_release(w));
      read_back(t, dts[k], got, n);
      for (int64_t i = 0; i < n; i++) {
        double s = 1000.0 * size * (size - 1) / 2 + (double)size * ((double)i - 300);
        want[i] = avg ? s / size : s;
      }
      char what[64];
      snprintf(what, sizeof what, "all_reduce %s %s", avg ? "avg" : "sum", ebb_dtype_name(dts[k]));
      expect(what, device, got, want, n);
      ebb_tensor_release(t);
    }

  /* broadcast from the last rank (f64) and from rank 0 (bf16, moved as bytes). */
  for (int k = 0; k < 2; k++) {
    int root = k ? 0 : size - 1;
    ebb_dtype dt = k ? EBB_BF16 : EBB_F64;
    for (int64_t i = 0; i < 64; i++) v[i] = rank * 100 + (double)i;
    int64_t m = 64;
    ebb_tensor_t *t = make(device, dt, 1, &m, v, m);
    if (!t) return;
    OK(ebb_broadcast(pg, t, root, NULL)); /* blocking form on the CPU, stream-ordered on a device */
    read_back(t, dt, got, m);
    for (int64_t i = 0; i < m; i++) want[i] = root * 100 + (double)i;
    expect(k ? "broadcast bf16 from 0" : "broadcast f64 from the last rank", device, got, want, m);
    ebb_tensor_release(t);
  }

  /* all-gather: in [3, 2] = rank * 10 + i, out [size, 3, 2]. */
  {
    int64_t ishape[2] = {3, 2}, oshape[3] = {size, 3, 2}, m = 6;
    for (int64_t i = 0; i < m; i++) v[i] = rank * 10 + (double)i;
    ebb_tensor_t *in = make(device, EBB_F32, 2, ishape, v, m), *out = NULL;
    if (!in) return;
    OK(ebb_tensor_zeros(device, EBB_F32, 3, oshape, &out));
    ebb_work_t *w = NULL;
    OK(ebb_all_gather(pg, out, in, &w));
    OK(ebb_work_wait(w));
    bool done = false;
    OK(ebb_work_test(w, &done));
    if (!done) FAIL("ebb_work_test after ebb_work_wait: not done");
    OK(ebb_work_release(w));
    read_back(out, EBB_F32, got, size * m);
    for (int r = 0; r < size; r++)
      for (int64_t i = 0; i < m; i++) want[r * m + i] = r * 10 + (double)i;
    expect("all_gather", device, got, want, size * m);
    ebb_tensor_release(in);
    ebb_tensor_release(out);
  }

  /* 24 collectives in flight with handles, waited for in reverse; then a barrier. */
  {
    enum { K = 24 };
    ebb_tensor_t *ts[K];
    ebb_work_t *ws[K];
    int64_t m = 8;
    for (int k = 0; k < K; k++) {
      for (int64_t i = 0; i < m; i++) v[i] = k * 1000 + rank + (double)i;
      if (!(ts[k] = make(device, EBB_F64, 1, &m, v, m))) return;
      OK(ebb_all_reduce(pg, ts[k], EBB_REDUCE_SUM, &ws[k]));
    }
    for (int k = K - 1; k >= 0; k--) {
      OK(ebb_work_wait(ws[k]));
      OK(ebb_work_release(ws[k]));
      read_back(ts[k], EBB_F64, got, m);
      for (int64_t i = 0; i < m; i++) want[i] = size * (k * 1000 + (double)i) + (double)size * (size - 1) / 2;
      expect("all_reduce in flight", device, got, want, m);
      ebb_tensor_release(ts[k]);
    }
    ebb_work_t *w = NULL;
    OK(ebb_barrier(pg, &w));
    OK(ebb_work_wait(w));
    OK(ebb_work_release(w));
  }
  OK(ebb_pg_destroy(pg));
}

/* Stream order on a device group: the input is written by a slow kernel on the caller's
 * stream just before the collective, and the result is read by the caller's next kernel. */
static void check_streams(int device) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, NULL, &pg));
  int size;
  OK(ebb_pg_size(pg, &size));
  int64_t n = 4096;
  static double got[4096], want[4096];
  for (int round = 0; round < 4; round++) {
    ebb_tensor_t *a = NULL, *x = NULL, *y = NULL;
    OK(ebb_tensor_full(device, EBB_F32, 1, &n, rank_ + round, &a));
    OK(ebb_op_add_scalar(a, 2, &x)); /* written on the caller's stream, 2 ms */
    OK(ebb_all_reduce(pg, x, EBB_REDUCE_SUM, NULL));
    OK(ebb_op_mul_scalar(x, 3, &y)); /* reads the result on the caller's stream */
    read_back(y, EBB_F32, got, n);
    double s = (double)size * (size - 1) / 2 + (double)size * (round + 2);
    for (int64_t i = 0; i < n; i++) want[i] = 3 * s;
    expect("stream-ordered all_reduce", device, got, want, n);
    /* all-gather of a just-written input, read by the next kernel. */
    int64_t oshape[2] = {size, n};
    ebb_tensor_t *out = NULL, *z = NULL, *b = NULL;
    OK(ebb_op_add_scalar(a, 1, &b)); /* the input, written just before */
    OK(ebb_tensor_empty(device, EBB_F32, 2, oshape, &out));
    OK(ebb_all_gather(pg, out, b, NULL));
    OK(ebb_op_add_scalar(out, 1, &z));
    static double g2[4096 * 8], w2[4096 * 8];
    read_back(z, EBB_F32, g2, size * n);
    for (int r = 0; r < size; r++)
      for (int64_t i = 0; i < n; i++) w2[r * n + i] = r + round + 2;
    expect("stream-ordered all_gather", device, g2, w2, size * n);
    ebb_tensor_release(a);
    ebb_tensor_release(x);
    ebb_tensor_release(y);
    ebb_tensor_release(out);
    ebb_tensor_release(z);
    ebb_tensor_release(b);
  }
  OK(ebb_pg_destroy(pg));
}

static void check_timeout(void) {
  ebb_pg_options o = {0};
  o.timeout_ms = 1000;
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg));
  int64_t n = 4;
  double v[4] = {1, 2, 3, 4}, got[4];
  ebb_tensor_t *t = make(EBB_DEVICE_CPU, EBB_F64, 1, &n, v, n);
  if (!t) return;
  if (rank_ == 1) {
    struct timespec late = {4, 0}; /* well past rank 0's timeout */
    nanosleep(&late, NULL);
    OK(ebb_all_reduce(pg, t, EBB_REDUCE_SUM, NULL));
    read_back(t, EBB_F64, got, n);
    double want[4] = {2, 4, 6, 8};
    expect("the late all_reduce", EBB_DEVICE_CPU, got, want, n);
  } else {
    ebb_work_t *w = NULL;
    OK(ebb_all_reduce(pg, t, EBB_REDUCE_SUM, &w));
    ebb_status st = ebb_work_wait(w);
    if (st != EBB_EIO || !strstr(ebb_last_error(), "did not finish within the group's timeout of 1000 ms"))
      FAIL("a wait past the timeout returned %s (%s); expected EBB_EIO naming the timeout", ebb_status_name(st),
           ebb_last_error());
    OK(ebb_work_release(w));
    st = ebb_barrier(pg, NULL);
    if (st != EBB_ESTATE || !strstr(ebb_last_error(), "failed earlier"))
      FAIL("a collective on the failed group returned %s (%s); expected EBB_ESTATE", ebb_status_name(st), ebb_last_error());
    bool busy_seen = false;
    for (int i = 0; i < 600; i++) { /* until rank 1's late call lets MPI return */
      st = ebb_pg_destroy(pg);
      if (st != EBB_EBUSY) break;
      busy_seen = true;
      struct timespec tick = {0, 50000000};
      nanosleep(&tick, NULL);
    }
    if (st != EBB_OK) FAIL("ebb_pg_destroy of the failed group: %s (%s)", ebb_status_name(st), ebb_last_error());
    if (!busy_seen) FAIL("ebb_pg_destroy did not report the communication thread still blocked (EBB_EBUSY)");
    pg = NULL;
  }
  ebb_tensor_release(t);
  if (pg) OK(ebb_pg_destroy(pg));
}

static void check_kill(void) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, NULL, &pg));
  if (rank_ == 1) {
    fprintf(stderr, "rank 1: aborting on purpose before the first collective\n");
    abort();
  }
  int64_t n = 4;
  double v[4] = {1, 2, 3, 4};
  ebb_tensor_t *t = make(EBB_DEVICE_CPU, EBB_F32, 1, &n, v, n);
  ebb_work_t *w = NULL;
  OK(ebb_all_reduce(pg, t, EBB_REDUCE_SUM, &w));
  ebb_status st = ebb_work_wait(w); /* mpirun ends the job before this returns */
  FAIL("the collective with a dead rank returned %s (%s); expected mpirun to end the job", ebb_status_name(st),
       ebb_last_error());
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "collectives";
#if EBB_TEST_CALLER_INIT
  int provided = 0;
  if (!strcmp(mode, "caller-init")) MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
#endif
  if (ebb_init()) {
    fprintf(stderr, "ebb_init: %s\n", ebb_last_error());
    return 1;
  }
  /* The rank, from a CPU group made only for it. */
  ebb_pg_t *pg = NULL;
  if (ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, NULL, &pg)) {
    fprintf(stderr, "ebb_pg_create: %s\n", ebb_last_error());
    return 1;
  }
  ebb_pg_rank(pg, &rank_);
  ebb_pg_destroy(pg);
  int ndev = 0;
  ebb_dev_count(&ndev);
  int device = ndev > 0 ? rank_ % ndev : EBB_DEVICE_CPU;

  if (!strcmp(mode, "collectives")) {
    check_collectives(EBB_DEVICE_CPU);
    if (ndev > 0) check_collectives(device);
    else FAIL("no device: the emulated driver should give one per rank (EBB_SIM_DEVICES)");
  } else if (!strcmp(mode, "streams")) {
    if (ndev > 0) check_streams(device);
    else FAIL("no device for the stream test");
  } else if (!strcmp(mode, "caller-init")) {
    check_collectives(EBB_DEVICE_CPU);
  } else if (!strcmp(mode, "timeout")) {
    check_timeout();
  } else if (!strcmp(mode, "kill")) {
    check_kill();
  } else {
    FAIL("unknown mode %s", mode);
  }
  long live = ebb_debug_live_handles();
  if (live) FAIL("%ld handles live at the end", live);
  if (ebb_shutdown()) FAIL("ebb_shutdown: %s", ebb_last_error());
#if EBB_TEST_CALLER_INIT
  if (!strcmp(mode, "caller-init")) {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) FAIL("ebb finalised an MPI it had not initialised");
    else MPI_Finalize();
  }
#endif
  if (!failures) printf("rank %d: %s passed\n", rank_, mode);
  return failures ? 1 : 0;
}
