/* bench_dnnl.c: oneDNN's CPU primitives (Debian libdnnl-dev 2.6, C API) against ebb's own CPU
 * kernels on the same data, one thread each, to decide where libebb would use oneDNN.
 *
 * Sizes: softmax and log_softmax over the last dim of [4096, 1024] f32, forward and backward;
 * layer_norm over the last dim of [4096, 1024] with weight and bias, forward and backward;
 * gelu (erf), exp and relu on 4 Mi f32; the sum over the last dim of [4096, 1024]; a
 * [1024, 1024] x [1024, 1024] matmul (ebb's goes to OpenBLAS).
 * oneDNN: each primitive is created once before timing (what its primitive cache would give
 * every later call) and only its execution is timed, into preallocated outputs; ebb: the public
 * op, its result allocated and released in each call (ebb's pool makes that cheap; it is what a
 * caller of ebb pays). Layer norm: oneDNN's forward is forward_training (it writes the mean and
 * variance its backward reads); ebb's backward recomputes them from x.
 * Threads: Debian builds oneDNN on OpenMP, so omp_set_num_threads(1) before the first primitive;
 * OpenBLAS through openblas_set_num_threads(1); ebb's CPU ops run on the calling thread.
 * Rounds: every round times every op once for each library, the two taking turns at going
 * first, after one untimed warm-up round (which also takes the largest difference of the two
 * results); the figure is the median over the rounds.
 * Prints, per op: bench=dnnl op=<op> ebb_us=<x> dnnl_us=<y> ratio=<dnnl/ebb> ebb_cpu_us=..
 * dnnl_cpu_us=.. cpu_ratio=.. max_abs_diff=<d> (ratio above 1: ebb faster; the cpu_ figures are
 * the calling thread's CPU time, which on a shared, loaded machine leaves out the waits for a
 * core; max_abs_diff: the largest difference of the two results).
 * usage: ebb-bench-dnnl [--rounds N (>= 1, default 7)] [--op NAME]
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "bench.h"
#include "ebb/ops.h"
#include "ebb/runtime.h"
#include "ebb/tensor.h"

void openblas_set_num_threads(int n);

#define DNNL_CHECK(call)                                                                                \
  do {                                                                                                  \
    dnnl_status_t dnnl_st_ = (call);                                                                    \
    if (dnnl_st_ != dnnl_success) {                                                                     \
      fprintf(stderr, "%s:%d: %s: dnnl status %d\n", __FILE__, __LINE__, #call, (int)dnnl_st_);        \
      exit(1);                                                                                          \
    }                                                                                                   \
  } while (0)

enum { ROWS = 4096, COLS = 1024, MM = 1024, MAX_ARGS = 10 };

static dnnl_engine_t eng;
static dnnl_stream_t strm;

/* the inputs, on the CPU, shared by both libraries */
static ebb_tensor_t *x_t, *g_t, *w_t, *b_t, *ma_t, *mb_t;
static ebb_tensor_t *y_soft, *y_logsoft; /* ebb's forward results, the backward's inputs */

static float *data(const ebb_tensor_t *t) {
  void *p;
  BENCH_CHECK(ebb_tensor_data(t, &p));
  return p;
}

static dnnl_memory_t mem(int nd, const dnnl_dims_t dims, void *ptr) {
  dnnl_memory_desc_t md;
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&md, nd, dims, dnnl_f32, nd == 1 ? dnnl_a : dnnl_ab));
  dnnl_memory_t m;
  DNNL_CHECK(dnnl_memory_create(&m, &md, eng, ptr ? ptr : DNNL_MEMORY_ALLOCATE));
  return m;
}

static float *mem_ptr(dnnl_memory_t m) {
  void *p;
  DNNL_CHECK(dnnl_memory_get_data_handle(m, &p));
  return p;
}

/* one primitive with its arguments */
typedef struct prim {
  dnnl_primitive_t p;
  int nargs;
  dnnl_exec_arg_t args[MAX_ARGS];
} prim;

static prim make(const void *desc, const_dnnl_primitive_desc_t hint, dnnl_primitive_desc_t *pd_out) {
  dnnl_primitive_desc_t pd;
  DNNL_CHECK(dnnl_primitive_desc_create(&pd, desc, NULL, eng, hint));
  prim r = {0};
  DNNL_CHECK(dnnl_primitive_create(&r.p, pd));
  if (pd_out) *pd_out = pd;
  else DNNL_CHECK(dnnl_primitive_desc_destroy(pd));
  return r;
}

static void arg(prim *p, int which, dnnl_memory_t m) {
  p->args[p->nargs].arg = which;
  p->args[p->nargs].memory = m;
  p->nargs++;
}

static void run_prim(const prim *p) {
  DNNL_CHECK(dnnl_primitive_execute(p->p, strm, p->nargs, p->args));
  DNNL_CHECK(dnnl_stream_wait(strm));
}

typedef struct op {
  const char *name;
  ebb_status (*ebb_run)(ebb_tensor_t **outs, int *nouts);
  prim dn;
  dnnl_memory_t dn_out; /* the result compared with ebb's first output */
  int count;            /* calls per timed run */
  double *ebb_ns, *dn_ns, *ebb_cpu, *dn_cpu;
  double diff;
} op;

static const int kLast = 1;

static ebb_status e_softmax(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_softmax(x_t, 1, &o[0]); }
static ebb_status e_softmax_bwd(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_softmax_backward(g_t, y_soft, 1, &o[0]); }
static ebb_status e_logsoftmax(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_log_softmax(x_t, 1, &o[0]); }
static ebb_status e_logsoftmax_bwd(ebb_tensor_t **o, int *n) {
  *n = 1;
  return ebb_op_log_softmax_backward(g_t, y_logsoft, 1, &o[0]);
}
static ebb_status e_ln(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_layer_norm(x_t, 1, w_t, b_t, 1e-5, &o[0]); }
static ebb_status e_ln_bwd(ebb_tensor_t **o, int *n) {
  *n = 3;
  return ebb_op_layer_norm_backward(g_t, x_t, 1, w_t, b_t, 1e-5, &o[0], &o[1], &o[2]);
}
static ebb_status e_gelu(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_gelu(x_t, &o[0]); }
static ebb_status e_exp(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_exp(x_t, &o[0]); }
static ebb_status e_relu(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_relu(x_t, &o[0]); }
static ebb_status e_sum(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_sum(x_t, &kLast, 1, false, &o[0]); }
static ebb_status e_matmul(ebb_tensor_t **o, int *n) { *n = 1; return ebb_op_matmul(ma_t, mb_t, &o[0]); }

/* this thread's CPU time: on a loaded machine it leaves out the time the thread waited for a
 * core, which wall time counts for whichever library was descheduled */
static double cpu_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static double time_ebb(op *o, int keep_diff, double *cpu) {
  double c0 = cpu_now_ns();
  uint64_t t0 = bench_now_ns();
  for (int i = 0; i < o->count; i++) {
    ebb_tensor_t *outs[3];
    int n = 0;
    BENCH_CHECK(o->ebb_run(outs, &n));
    if (keep_diff && i == 0 && o->dn_out) {
      const float *a = data(outs[0]), *b = mem_ptr(o->dn_out);
      int64_t numel;
      BENCH_CHECK(ebb_tensor_numel(outs[0], &numel));
      double d = 0;
      for (int64_t k = 0; k < numel; k++) d = fmax(d, fabs((double)a[k] - b[k]));
      o->diff = d;
    }
    for (int k = 0; k < n; k++) BENCH_CHECK(ebb_tensor_release(outs[k]));
  }
  *cpu = (cpu_now_ns() - c0) / o->count;
  return (double)(bench_now_ns() - t0) / o->count;
}

static double time_dnnl(const op *o, double *cpu) {
  double c0 = cpu_now_ns();
  uint64_t t0 = bench_now_ns();
  for (int i = 0; i < o->count; i++) run_prim(&o->dn);
  *cpu = (cpu_now_ns() - c0) / o->count;
  return (double)(bench_now_ns() - t0) / o->count;
}

int main(int argc, char **argv) {
  int rounds = 7;
  const char *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (strcmp(argv[i], "--op") == 0 && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: ebb-bench-dnnl [--rounds N] [--op NAME]\n");
      return 2;
    }
  }
  if (rounds < 1 || rounds > 1000) {
    fprintf(stderr, "ebb-bench-dnnl: --rounds must be in [1, 1000]\n");
    return 2;
  }
  omp_set_num_threads(1);
  openblas_set_num_threads(1);
  BENCH_CHECK(ebb_init());
  DNNL_CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
  DNNL_CHECK(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));

  const int64_t shape[2] = {ROWS, COLS}, wshape[1] = {COLS}, mshape[2] = {MM, MM};
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 2, shape, 1, 0, &x_t));
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 2, shape, 2, 0, &g_t));
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 1, wshape, 3, 0, &w_t));
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 1, wshape, 4, 0, &b_t));
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 2, mshape, 5, 0, &ma_t));
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, 2, mshape, 6, 0, &mb_t));
  BENCH_CHECK(ebb_op_softmax(x_t, 1, &y_soft));
  BENCH_CHECK(ebb_op_log_softmax(x_t, 1, &y_logsoft));

  const dnnl_dims_t d2 = {ROWS, COLS}, d1 = {COLS}, dsum = {ROWS, 1}, dmm = {MM, MM};
  dnnl_memory_t x = mem(2, d2, data(x_t)), g = mem(2, d2, data(g_t)), w = mem(1, d1, data(w_t)),
                b = mem(1, d1, data(b_t)), ma = mem(2, dmm, data(ma_t)), mb = mem(2, dmm, data(mb_t));
  const dnnl_memory_desc_t *md2 = NULL, *mdm = NULL;
  DNNL_CHECK(dnnl_memory_get_memory_desc(x, &md2));
  DNNL_CHECK(dnnl_memory_get_memory_desc(ma, &mdm));

  op ops[11];
  int nops = 0;
  { /* softmax and log_softmax, forward then backward from oneDNN's own forward result */
    for (int lg = 0; lg < 2; lg++) {
      dnnl_primitive_desc_t fpd;
      prim f, bw;
      dnnl_memory_t y = mem(2, d2, NULL), dx = mem(2, d2, NULL);
      if (lg) {
        dnnl_logsoftmax_desc_t fd, bd;
        DNNL_CHECK(dnnl_logsoftmax_forward_desc_init(&fd, dnnl_forward_training, md2, 1));
        f = make(&fd, NULL, &fpd);
        DNNL_CHECK(dnnl_logsoftmax_backward_desc_init(&bd, md2, md2, 1));
        bw = make(&bd, fpd, NULL);
      } else {
        dnnl_softmax_desc_t fd, bd;
        DNNL_CHECK(dnnl_softmax_forward_desc_init(&fd, dnnl_forward_training, md2, 1));
        f = make(&fd, NULL, &fpd);
        DNNL_CHECK(dnnl_softmax_backward_desc_init(&bd, md2, md2, 1));
        bw = make(&bd, fpd, NULL);
      }
      DNNL_CHECK(dnnl_primitive_desc_destroy(fpd));
      arg(&f, DNNL_ARG_SRC, x), arg(&f, DNNL_ARG_DST, y);
      run_prim(&f);
      arg(&bw, DNNL_ARG_DST, y), arg(&bw, DNNL_ARG_DIFF_DST, g), arg(&bw, DNNL_ARG_DIFF_SRC, dx);
      ops[nops++] = (op){.name = lg ? "log_softmax_fwd" : "softmax_fwd", .ebb_run = lg ? e_logsoftmax : e_softmax, .dn = f, .dn_out = y, .count = 3};
      ops[nops++] = (op){.name = lg ? "log_softmax_bwd" : "softmax_bwd", .ebb_run = lg ? e_logsoftmax_bwd : e_softmax_bwd, .dn = bw, .dn_out = dx, .count = 3};
    }
  }
  { /* layer_norm over the last dim with weight (scale) and bias (shift) */
    dnnl_layer_normalization_desc_t fd, bd;
    const unsigned flags = dnnl_use_scale | dnnl_use_shift;
    DNNL_CHECK(dnnl_layer_normalization_forward_desc_init(&fd, dnnl_forward_training, md2, NULL, 1e-5f, flags));
    dnnl_primitive_desc_t fpd;
    prim f = make(&fd, NULL, &fpd);
    const dnnl_memory_desc_t *stat = dnnl_primitive_desc_query_md(fpd, dnnl_query_exec_arg_md, DNNL_ARG_MEAN);
    dnnl_memory_t mean, var;
    DNNL_CHECK(dnnl_memory_create(&mean, stat, eng, DNNL_MEMORY_ALLOCATE));
    DNNL_CHECK(dnnl_memory_create(&var, stat, eng, DNNL_MEMORY_ALLOCATE));
    DNNL_CHECK(dnnl_layer_normalization_backward_desc_init(&bd, dnnl_backward, md2, md2, stat, 1e-5f, flags));
    prim bw = make(&bd, fpd, NULL);
    DNNL_CHECK(dnnl_primitive_desc_destroy(fpd));
    dnnl_memory_t y = mem(2, d2, NULL), dx = mem(2, d2, NULL), dw = mem(1, d1, NULL), db = mem(1, d1, NULL);
    arg(&f, DNNL_ARG_SRC, x), arg(&f, DNNL_ARG_DST, y), arg(&f, DNNL_ARG_SCALE, w), arg(&f, DNNL_ARG_SHIFT, b);
    arg(&f, DNNL_ARG_MEAN, mean), arg(&f, DNNL_ARG_VARIANCE, var);
    run_prim(&f);
    arg(&bw, DNNL_ARG_SRC, x), arg(&bw, DNNL_ARG_DIFF_DST, g), arg(&bw, DNNL_ARG_SCALE, w), arg(&bw, DNNL_ARG_SHIFT, b);
    arg(&bw, DNNL_ARG_MEAN, mean), arg(&bw, DNNL_ARG_VARIANCE, var), arg(&bw, DNNL_ARG_DIFF_SRC, dx);
    arg(&bw, DNNL_ARG_DIFF_SCALE, dw), arg(&bw, DNNL_ARG_DIFF_SHIFT, db);
    ops[nops++] = (op){.name = "layer_norm_fwd", .ebb_run = e_ln, .dn = f, .dn_out = y, .count = 3};
    ops[nops++] = (op){.name = "layer_norm_bwd", .ebb_run = e_ln_bwd, .dn = bw, .dn_out = dx, .count = 3};
  }
  { /* elementwise, inference (no backward kept) */
    const struct {
      const char *name;
      dnnl_alg_kind_t alg;
      ebb_status (*e)(ebb_tensor_t **, int *);
    } el[3] = {{"gelu", dnnl_eltwise_gelu_erf, e_gelu}, {"exp", dnnl_eltwise_exp, e_exp}, {"relu", dnnl_eltwise_relu, e_relu}};
    for (int i = 0; i < 3; i++) {
      dnnl_eltwise_desc_t d;
      DNNL_CHECK(dnnl_eltwise_forward_desc_init(&d, dnnl_forward_inference, el[i].alg, md2, 0.0f, 0.0f));
      prim p = make(&d, NULL, NULL);
      dnnl_memory_t y = mem(2, d2, NULL);
      arg(&p, DNNL_ARG_SRC, x), arg(&p, DNNL_ARG_DST, y);
      ops[nops++] = (op){.name = el[i].name, .ebb_run = el[i].e, .dn = p, .dn_out = y, .count = 3};
    }
  }
  { /* the sum over the last dim */
    dnnl_reduction_desc_t d;
    dnnl_memory_t y = mem(2, dsum, NULL);
    const dnnl_memory_desc_t *ymd;
    DNNL_CHECK(dnnl_memory_get_memory_desc(y, &ymd));
    DNNL_CHECK(dnnl_reduction_desc_init(&d, dnnl_reduction_sum, md2, ymd, 0.0f, 0.0f));
    prim p = make(&d, NULL, NULL);
    arg(&p, DNNL_ARG_SRC, x), arg(&p, DNNL_ARG_DST, y);
    ops[nops++] = (op){.name = "sum_last", .ebb_run = e_sum, .dn = p, .dn_out = y, .count = 3};
  }
  { /* matmul */
    dnnl_matmul_desc_t d;
    dnnl_memory_t y = mem(2, dmm, NULL);
    DNNL_CHECK(dnnl_matmul_desc_init(&d, mdm, mdm, NULL, mdm));
    prim p = make(&d, NULL, NULL);
    arg(&p, DNNL_ARG_SRC, ma), arg(&p, DNNL_ARG_WEIGHTS, mb), arg(&p, DNNL_ARG_DST, y);
    ops[nops++] = (op){.name = "matmul", .ebb_run = e_matmul, .dn = p, .dn_out = y, .count = 1};
  }

  for (int i = 0; i < nops; i++) {
    ops[i].ebb_ns = calloc((size_t)rounds, sizeof(double));
    ops[i].dn_ns = calloc((size_t)rounds, sizeof(double));
    ops[i].ebb_cpu = calloc((size_t)rounds, sizeof(double));
    ops[i].dn_cpu = calloc((size_t)rounds, sizeof(double));
  }
  for (int r = -1; r < rounds; r++) {
    for (int i = 0; i < nops; i++) {
      op *o = &ops[i];
      if (only && strcmp(only, o->name) != 0) continue;
      /* oneDNN first in the warm-up round (ebb's diff there reads its result), then the two
       * take turns at going first */
      double dn, e, dn_cpu, e_cpu;
      if (r % 2 != 0) dn = time_dnnl(o, &dn_cpu), e = time_ebb(o, r == -1, &e_cpu);
      else e = time_ebb(o, 0, &e_cpu), dn = time_dnnl(o, &dn_cpu);
      if (r >= 0) o->ebb_ns[r] = e, o->dn_ns[r] = dn, o->ebb_cpu[r] = e_cpu, o->dn_cpu[r] = dn_cpu;
    }
  }
  for (int i = 0; i < nops; i++) {
    op *o = &ops[i];
    if (only && strcmp(only, o->name) != 0) continue;
    double e = bench_median(o->ebb_ns, (size_t)rounds) / 1e3, dn = bench_median(o->dn_ns, (size_t)rounds) / 1e3;
    double ec = bench_median(o->ebb_cpu, (size_t)rounds) / 1e3, dc = bench_median(o->dn_cpu, (size_t)rounds) / 1e3;
    printf("bench=dnnl op=%s ebb_us=%.1f dnnl_us=%.1f ratio=%.3f ebb_cpu_us=%.1f dnnl_cpu_us=%.1f cpu_ratio=%.3f "
           "max_abs_diff=%.3g\n",
           o->name, e, dn, dn / e, ec, dc, dc / ec, o->diff);
    free(o->ebb_ns), free(o->dn_ns), free(o->ebb_cpu), free(o->dn_cpu);
  }
  printf("bench=dnnl check=threads omp_max_threads=%d dnnl_version=%d.%d.%d\n", omp_get_max_threads(),
         dnnl_version()->major, dnnl_version()->minor, dnnl_version()->patch);
  /* the process ends here: oneDNN's objects go with it; ebb's tensors are released for its
   * shutdown */
  ebb_tensor_t *ts[] = {x_t, g_t, w_t, b_t, ma_t, mb_t, y_soft, y_logsoft};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) BENCH_CHECK(ebb_tensor_release(ts[i]));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
