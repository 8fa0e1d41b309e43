/* ddp_ranks.c: the multi-process checks of the data-parallel reducer (ebb/ddp.h), run by ctest
 * under `mpirun --oversubscribe -np N` (tests/ddp/CMakeLists.txt). Every rank runs the same
 * program; a failed check prints "rank R: FAIL ..." and the program exits 1, so mpirun's status
 * is the test's. Modes:
 *   grads     a small MLP (two linear layers with a ReLU, plus two side layers that reach the loss
 *             only in some steps: one on every rank in even steps, one on rank 0 only in step 1)
 *             with rank-dependent batches, for three steps, on a CPU group and on a group of one
 *             emulated device per rank; f64 with integer-valued data and weights, so every
 *             rank's reduced .grad must equal exactly the gradient one process computes over the
 *             concatenated batch (the mean over ranks); f32 the same within 1e-6 x max |grad|,
 *             and bitwise equal across ranks. Runs with small bucket caps (several buckets, the
 *             first-step rebuild) and with the defaults, with gradient views and with copies,
 *             and clears .grad to NULL before one step (the reducer copies and re-attaches).
 *   accumulate  gradient accumulation (ebb_reducer_set_sync): two backwards without sync leave
 *             each rank's own summed gradient, the next with sync the mean over ranks of all
 *             three; set_sync is refused while a step is open; twice (before and after the
 *             first-step rebuild), on the CPU and the device.
 *   mismatch  parameter lists that differ between ranks (a shape on rank 1; one parameter more on
 *             the last rank): every rank's ebb_reducer_create fails with EBB_EINVAL naming the
 *             first differing parameter; nothing is left live.
 *   fingerprint  debug mode with buckets that differ between ranks (rank 1 uses other caps): the
 *             first bucket's fingerprint exchange fails the step on every rank, naming the
 *             bucket, instead of a mismatched all-reduce, and within 10 s of the step's start
 *             (checked); the group has a 10 s timeout, and ctest's timeout bounds the whole job.
 * Device groups are MPI's, or NCCL's with EBB_TEST_DIST_BACKEND=nccl (a machine with CUDA GPUs).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ebb/ebb.h"

static int rank_ = -1, size_ = 1, failures;

#define FAIL(...)                             \
  do {                                        \
    fprintf(stderr, "rank %d: FAIL ", rank_); \
    fprintf(stderr, __VA_ARGS__);             \
    fprintf(stderr, "\n");                    \
    failures++;                               \
  } while (0)

#define OK(call)                                                                                      \
  do {                                                                                                \
    ebb_status st_ = (call);                                                                          \
    if (st_ != EBB_OK) {                                                                              \
      FAIL("%s:%d: %s -> %s: %s", __FILE__, __LINE__, #call, ebb_status_name(st_), ebb_last_error()); \
      return;                                                                                         \
    }                                                                                                 \
  } while (0)

enum { D = 8, H = 16, O = 4, B = 3, NP = 6, STEPS = 3 };
static const int64_t shapes[NP][2] = {{H, D}, {H, 0}, {O, H}, {O, 0}, {O, D}, {O, D}};
static const char *names[NP] = {"w1", "b1", "w2", "b2", "w3", "w4"};

/* The backend of device groups: MPI, or NCCL when EBB_TEST_DIST_BACKEND=nccl (for a machine with
 * CUDA GPUs and libnccl.so.2; CPU groups are always MPI's). */
static ebb_dist_backend device_backend(int device) {
  const char *b = getenv("EBB_TEST_DIST_BACKEND");
  return device >= 0 && b && !strcmp(b, "nccl") ? EBB_DIST_NCCL : EBB_DIST_MPI;
}

static int64_t numel_of(int i) { return shapes[i][0] * (shapes[i][1] ? shapes[i][1] : 1); }

/* A tensor from doubles, converted to dt. */
static ebb_tensor_t *make(int device, ebb_dtype dt, int ndim, const int64_t *shape, const double *v, int64_t n) {
  void *buf = malloc((size_t)n * 8 + 1);
  for (int64_t i = 0; i < n; i++) {
    if (dt == EBB_F32) ((float *)buf)[i] = (float)v[i];
    else ((double *)buf)[i] = v[i];
  }
  ebb_tensor_t *t = NULL;
  if (ebb_tensor_from_host(device, dt, ndim, shape, buf, (size_t)n * ebb_dtype_size(dt), &t)) {
    FAIL("ebb_tensor_from_host: %s", ebb_last_error());
    t = NULL;
  }
  free(buf);
  return t;
}

static int read_back(const ebb_tensor_t *t, ebb_dtype dt, double *out, int64_t n) {
  void *buf = malloc((size_t)n * 8 + 1);
  if (ebb_tensor_to_host(t, buf, (size_t)n * ebb_dtype_size(dt))) {
    FAIL("ebb_tensor_to_host: %s", ebb_last_error());
    free(buf);
    return -1;
  }
  for (int64_t i = 0; i < n; i++) out[i] = dt == EBB_F32 ? ((float *)buf)[i] : ((double *)buf)[i];
  free(buf);
  return 0;
}

/* The same parameters on every rank, integer-valued (rank 0's are broadcast anyway). */
static ebb_tensor_t *make_param(int device, ebb_dtype dt, int i) {
  double v[H * D];
  int64_t n = numel_of(i);
  for (int64_t k = 0; k < n; k++) v[k] = (double)((k * 5 + i * 3) % 7) - 3;
  int ndim = shapes[i][1] ? 2 : 1;
  ebb_tensor_t *t = make(device, dt, ndim, shapes[i], v, n);
  if (t && ebb_tensor_set_requires_grad(t, true)) FAIL("set_requires_grad: %s", ebb_last_error());
  if (t) ebb_tensor_set_name(t, names[i]);
  return t;
}

/* Rank r's batch at step s. */
static ebb_tensor_t *make_batch(int device, ebb_dtype dt, int r, int s) {
  double v[B * D];
  for (int k = 0; k < B * D; k++) v[k] = (double)((r * 7 + s * 5 + k * 3) % 5) - 2;
  int64_t shape[2] = {B, D};
  return make(device, dt, 2, shape, v, B * D);
}

static int uses_w3(int r, int s) { (void)r; return s % 2 == 0; }
static int uses_w4(int r, int s) { return r == 0 && s == 1; }

/* loss = sum(linear(relu(linear(x, w1, b1)), w2, b2) [+ linear(x, w3)] [+ linear(x, w4)]). */
static void forward_backward(ebb_tensor_t *const *p, ebb_tensor_t *x, int r, int s) {
  ebb_tensor_t *h = NULL, *a = NULL, *y = NULL, *y3 = NULL, *y4 = NULL, *t = NULL, *loss = NULL;
  OK(ebb_op_linear(x, p[0], p[1], &h));
  OK(ebb_op_relu(h, &a));
  OK(ebb_op_linear(a, p[2], p[3], &y));
  if (uses_w3(r, s)) {
    OK(ebb_op_linear(x, p[4], NULL, &y3));
    OK(ebb_op_add(y, y3, &t));
    ebb_tensor_release(y);
    y = t;
  }
  if (uses_w4(r, s)) {
    OK(ebb_op_linear(x, p[5], NULL, &y4));
    OK(ebb_op_add(y, y4, &t));
    ebb_tensor_release(y);
    y = t;
  }
  OK(ebb_op_sum(y, NULL, 0, false, &loss));
  OK(ebb_backward_one(loss));
  ebb_tensor_release(h);
  ebb_tensor_release(a);
  ebb_tensor_release(y);
  if (y3) ebb_tensor_release(y3);
  if (y4) ebb_tensor_release(y4);
  ebb_tensor_release(loss);
}

/* The reference, on the CPU in one process: the gradients of the batches of ranks [r0, r1) at
 * steps [s0, s1) accumulated, divided by `div`. */
static void reference_range(ebb_dtype dt, int s0, int s1, int r0, int r1, int div, double ref[NP][H * D]) {
  ebb_tensor_t *p[NP];
  for (int i = 0; i < NP; i++) p[i] = make_param(EBB_DEVICE_CPU, dt, i);
  for (int s = s0; s < s1; s++)
    for (int r = r0; r < r1; r++) {
      ebb_tensor_t *x = make_batch(EBB_DEVICE_CPU, dt, r, s);
      forward_backward(p, x, r, s);
      ebb_tensor_release(x);
    }
  for (int i = 0; i < NP; i++) {
    ebb_tensor_t *g = NULL;
    if (ebb_tensor_grad(p[i], &g)) FAIL("reference grad: %s", ebb_last_error());
    if (g) {
      read_back(g, dt, ref[i], numel_of(i));
      ebb_tensor_release(g);
    } else {
      memset(ref[i], 0, sizeof ref[i]);
    }
    for (int64_t k = 0; k < numel_of(i); k++) ref[i][k] /= div;
    ebb_tensor_release(p[i]);
  }
}

/* One step's reference: every rank's batch, the mean of their gradients. */
static void reference(ebb_dtype dt, int s, double ref[NP][H * D]) { reference_range(dt, s, s + 1, 0, size_, size_, ref); }

/* Every parameter's .grad against ref (exact in f64 with integer data, 1e-6 of the largest in f32). */
static void compare_grads(ebb_tensor_t *const *p, ebb_dtype dt, double ref[NP][H * D], const char *what) {
  static double got[H * D];
  for (int i = 0; i < NP; i++) {
    ebb_tensor_t *g = NULL;
    OK(ebb_tensor_grad(p[i], &g));
    if (!g) {
      FAIL("%s: %s has no .grad", what, names[i]);
      continue;
    }
    read_back(g, dt, got, numel_of(i));
    double mx = 0, diff = 0;
    for (int64_t k = 0; k < numel_of(i); k++) {
      mx = fmax(mx, fabs(ref[i][k]));
      diff = fmax(diff, fabs(got[k] - ref[i][k]));
    }
    double tol = dt == EBB_F64 ? 0 : 1e-6 * mx;
    if (diff > tol) FAIL("%s: %s's .grad is off by %g (max |grad| %g, tolerance %g)", what, names[i], diff, mx, tol);
    ebb_tensor_release(g);
  }
}

/* Gradient accumulation: two backwards with sync off keep each rank's own sum (no collective),
 * the third with sync on reduces the sum of all three; set_sync is refused while a step is open. */
static void check_accumulate(int device, ebb_dtype dt) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, NULL, &pg));
  ebb_tensor_t *p[NP];
  for (int i = 0; i < NP; i++) p[i] = make_param(device, dt, i);
  ebb_reducer_options o = {.first_bucket_bytes = 64, .bucket_bytes = 600};
  ebb_reducer_t *red = NULL;
  OK(ebb_reducer_create(pg, p, NP, &o, &red));
  static double ref[NP][H * D];
  char what[96];
  for (int round = 0; round < 2; round++) { /* the second after the first-step rebuild */
    OK(ebb_reducer_zero_grad(red));
    OK(ebb_reducer_set_sync(red, false));
    for (int s = 0; s < 2; s++) {
      ebb_tensor_t *x = make_batch(device, dt, rank_, s);
      forward_backward(p, x, rank_, s);
      ebb_tensor_release(x);
      if (s == 1) OK(ebb_reducer_finish(red)); /* optional while accumulating: returns at once */
    }
    reference_range(dt, 0, 2, rank_, rank_ + 1, 1, ref);
    snprintf(what, sizeof what, "accumulate on %s, round %d, after 2 backwards without sync", device < 0 ? "cpu" : "device", round);
    compare_grads(p, dt, ref, what);
    OK(ebb_reducer_set_sync(red, true));
    ebb_tensor_t *x = make_batch(device, dt, rank_, 2);
    forward_backward(p, x, rank_, 2);
    ebb_tensor_release(x);
    ebb_status st = ebb_reducer_set_sync(red, false);
    if (st != EBB_ESTATE || !strstr(ebb_last_error(), "ebb_reducer_finish first"))
      FAIL("set_sync while a step is open returned %s (%s); expected EBB_ESTATE naming finish", ebb_status_name(st),
           ebb_last_error());
    OK(ebb_reducer_finish(red));
    reference_range(dt, 0, 3, 0, size_, size_, ref);
    snprintf(what, sizeof what, "accumulate on %s, round %d, after the synchronised backward", device < 0 ? "cpu" : "device", round);
    compare_grads(p, dt, ref, what);
  }
  OK(ebb_reducer_destroy(red));
  for (int i = 0; i < NP; i++) ebb_tensor_release(p[i]);
  OK(ebb_pg_destroy(pg));
}

static void check_grads(int device, ebb_dtype dt, const ebb_reducer_options *opts, const char *what) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, NULL, &pg));
  ebb_tensor_t *p[NP];
  for (int i = 0; i < NP; i++) p[i] = make_param(device, dt, i);
  ebb_reducer_t *red = NULL;
  OK(ebb_reducer_create(pg, p, NP, opts, &red));
  int nb0 = 0;
  OK(ebb_reducer_num_buckets(red, &nb0));
  static double ref[NP][H * D], got[H * D];
  for (int s = 0; s < STEPS; s++) {
    if (s == 2) {
      for (int i = 0; i < NP; i++) OK(ebb_tensor_set_grad(p[i], NULL)); /* as an optimizer's zero_grad to NULL */
    } else {
      OK(ebb_reducer_zero_grad(red));
    }
    ebb_tensor_t *x = make_batch(device, dt, rank_, s);
    forward_backward(p, x, rank_, s);
    ebb_tensor_release(x);
    OK(ebb_reducer_finish(red));
    reference(dt, s, ref);
    for (int i = 0; i < NP; i++) {
      ebb_tensor_t *g = NULL;
      OK(ebb_tensor_grad(p[i], &g));
      if (!g) {
        FAIL("%s on %s, step %d: %s has no .grad after ebb_reducer_finish", what, device < 0 ? "cpu" : "device", s, names[i]);
        continue;
      }
      read_back(g, dt, got, numel_of(i));
      /* cross-rank identity: the all-gather of this .grad, row by row */
      int64_t gshape[2] = {size_, numel_of(i)}, n = numel_of(i);
      ebb_tensor_t *flat = NULL, *all = NULL;
      OK(ebb_tensor_reshape(g, 1, &n, &flat));
      OK(ebb_tensor_empty(device, dt, 2, gshape, &all));
      OK(ebb_all_gather(pg, all, flat, NULL));
      static double rows[8 * H * D];
      read_back(all, dt, rows, size_ * n);
      for (int r = 1; r < size_; r++)
        if (memcmp(rows, rows + r * n, (size_t)n * sizeof *rows))
          FAIL("%s on %s, step %d: %s's .grad differs between rank 0 and rank %d", what, device < 0 ? "cpu" : "device", s, names[i], r);
      double mx = 0, diff = 0;
      for (int64_t k = 0; k < n; k++) {
        mx = fmax(mx, fabs(ref[i][k]));
        diff = fmax(diff, fabs(got[k] - ref[i][k]));
      }
      double tol = dt == EBB_F64 ? 0 : 1e-6 * mx;
      if (diff > tol)
        FAIL("%s on %s, step %d: %s's .grad is off by %g (max |grad| %g, tolerance %g)", what, device < 0 ? "cpu" : "device", s,
             names[i], diff, mx, tol);
      ebb_tensor_release(flat);
      ebb_tensor_release(all);
      ebb_tensor_release(g);
    }
  }
  /* The rebuilt buckets cover every parameter once, the same on every rank. */
  int nb = 0, seen[NP] = {0}, layout[2 * NP + 2] = {0}, k = 0;
  OK(ebb_reducer_num_buckets(red, &nb));
  layout[k++] = nb;
  for (int b = 0; b < nb; b++) {
    int ids[NP], cnt = 0;
    OK(ebb_reducer_bucket_info(red, b, NULL, NULL, &cnt, ids, NP));
    for (int j = 0; j < cnt && k < 2 * NP + 2; j++) seen[ids[j]]++, layout[k++] = ids[j];
    if (k < 2 * NP + 2) layout[k++] = -1;
  }
  for (int i = 0; i < NP; i++)
    if (seen[i] != 1) FAIL("%s: parameter %d is in %d buckets", what, i, seen[i]);
  {
    double lv[2 * NP + 2], all[8 * (2 * NP + 2)];
    for (int j = 0; j < 2 * NP + 2; j++) lv[j] = layout[j];
    int64_t n = 2 * NP + 2, gshape[2] = {size_, n};
    ebb_tensor_t *in = make(device, EBB_F64, 1, &n, lv, n), *out = NULL;
    OK(ebb_tensor_empty(device, EBB_F64, 2, gshape, &out));
    OK(ebb_all_gather(pg, out, in, NULL));
    read_back(out, EBB_F64, all, size_ * n);
    for (int r = 1; r < size_; r++)
      if (memcmp(all, all + r * n, (size_t)n * sizeof *all)) FAIL("%s: the bucket layout differs between rank 0 and rank %d", what, r);
    ebb_tensor_release(in);
    ebb_tensor_release(out);
  }
  if (opts && opts->first_bucket_bytes && nb0 < 3) FAIL("%s: %d buckets with small caps; expected several", what, nb0);
  OK(ebb_reducer_destroy(red));
  for (int i = 0; i < NP; i++) ebb_tensor_release(p[i]);
  OK(ebb_pg_destroy(pg));
}

static void check_mismatch(int device) {
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, NULL, &pg));
  for (int variant = 0; variant < 2; variant++) {
    ebb_tensor_t *p[NP + 1];
    int n = 4;
    for (int i = 0; i < n; i++) p[i] = make_param(device, EBB_F32, i);
    if (variant == 0 && rank_ == 1) { /* parameter 2 with another shape */
      ebb_tensor_release(p[2]);
      int64_t sh[2] = {O + 1, H};
      OK(ebb_tensor_zeros(device, EBB_F32, 2, sh, &p[2]));
      OK(ebb_tensor_set_requires_grad(p[2], true));
    }
    if (variant == 1 && rank_ == size_ - 1) p[n++] = make_param(device, EBB_F32, 4);
    ebb_reducer_t *red = NULL;
    ebb_status st = ebb_reducer_create(pg, p, n, NULL, &red);
    const char *want = variant == 0 ? "at parameter 2: rank 0 has f32[4, 16], rank 1 has f32[5, 16]" : "parameter 4 is the first one missing";
    if (st != EBB_EINVAL || !strstr(ebb_last_error(), want))
      FAIL("mismatch %d: ebb_reducer_create returned %s (%s); expected EBB_EINVAL with \"%s\"", variant, ebb_status_name(st),
           ebb_last_error(), want);
    if (!st) ebb_reducer_destroy(red);
    for (int i = 0; i < n; i++) {
      ebb_tensor_t *g = NULL;
      ebb_tensor_grad(p[i], &g);
      if (g) {
        FAIL("mismatch %d: a failed create left a .grad on parameter %d", variant, i);
        ebb_tensor_release(g);
      }
      ebb_tensor_release(p[i]);
    }
  }
  OK(ebb_pg_destroy(pg));
}

static void check_fingerprint(int device) {
  ebb_pg_options po = {0};
  po.timeout_ms = 10000;
  ebb_pg_t *pg = NULL;
  OK(ebb_pg_create(device_backend(device), device, &po, &pg));
  ebb_tensor_t *p[NP];
  for (int i = 0; i < NP; i++) p[i] = make_param(device, EBB_F64, i);
  ebb_reducer_options o = {.first_bucket_bytes = 64, .bucket_bytes = 600, .debug_fingerprint = true};
  if (rank_ == 1) o.bucket_bytes = 2000;
  ebb_reducer_t *red = NULL;
  OK(ebb_reducer_create(pg, p, NP, &o, &red));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ebb_tensor_t *x = make_batch(device, EBB_F64, rank_, 0);
  forward_backward(p, x, rank_, 0);
  ebb_tensor_release(x);
  ebb_status st = ebb_reducer_finish(red);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  /* The promise is a failure within 10 s, not a hang that a timeout ends: a bound on a failure
   * path, far above the step's own time. */
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  if (s >= 10.0) FAIL("fingerprint: the mismatch took %.1f s to fail the step; expected under 10 s", s);
  if (st != EBB_ESTATE || !strstr(ebb_last_error(), "differs between ranks") || !strstr(ebb_last_error(), "bucket"))
    FAIL("fingerprint: ebb_reducer_finish returned %s (%s); expected EBB_ESTATE naming the bucket", ebb_status_name(st),
         ebb_last_error());
  else if (rank_ == 0)
    printf("rank 0: as expected: %s\n", ebb_last_error());
  OK(ebb_reducer_destroy(red));
  for (int i = 0; i < NP; i++) ebb_tensor_release(p[i]);
  OK(ebb_pg_destroy(pg));
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "grads";
  if (ebb_init()) {
    fprintf(stderr, "ebb_init: %s\n", ebb_last_error());
    return 1;
  }
  ebb_pg_t *pg = NULL;
  if (ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, NULL, &pg)) {
    fprintf(stderr, "ebb_pg_create: %s\n", ebb_last_error());
    return 1;
  }
  ebb_pg_rank(pg, &rank_);
  ebb_pg_size(pg, &size_);
  ebb_pg_destroy(pg);
  int ndev = 0;
  ebb_dev_count(&ndev);
  int device = ndev > 0 ? rank_ % ndev : EBB_DEVICE_CPU;
  if (ndev <= 0) FAIL("no device: the emulated driver should give one per rank (EBB_SIM_DEVICES)");
  if (size_ > 8) FAIL("at most 8 ranks");

  if (!strcmp(mode, "grads")) {
    ebb_reducer_options small = {.first_bucket_bytes = 64, .bucket_bytes = 600};
    ebb_reducer_options copies = {.first_bucket_bytes = 64, .bucket_bytes = 600, .copy_grads = true};
    for (int on_dev = 0; on_dev < 2 && !failures; on_dev++) {
      int dev = on_dev ? device : EBB_DEVICE_CPU;
      check_grads(dev, EBB_F64, &small, "f64, small buckets");
      check_grads(dev, EBB_F64, NULL, "f64, default buckets");
      check_grads(dev, EBB_F32, &small, "f32, small buckets");
      check_grads(dev, EBB_F64, &copies, "f64, copies");
    }
  } else if (!strcmp(mode, "accumulate")) {
    check_accumulate(EBB_DEVICE_CPU, EBB_F64);
    check_accumulate(device, EBB_F64);
    check_accumulate(device, EBB_F32);
  } else if (!strcmp(mode, "fingerprint")) {
    check_fingerprint(EBB_DEVICE_CPU);
    check_fingerprint(device);
  } else if (!strcmp(mode, "mismatch")) {
    check_mismatch(EBB_DEVICE_CPU);
    check_mismatch(device);
  } else {
    FAIL("unknown mode %s", mode);
  }
  long live = ebb_debug_live_handles();
  if (live) FAIL("%ld handles live at the end", live);
  if (ebb_shutdown()) FAIL("ebb_shutdown: %s", ebb_last_error());
  if (!failures) printf("rank %d: %s passed\n", rank_, mode);
  return failures ? 1 : 0;
}
