// bench_ops_peer.cpp: ebb's CPU ops against libtorch's in one process, f32, one thread each (the
// peer benchmark for ops/; built when Debian's libtorch-dev is installed).
//
// What is timed. Each case is one call of an op on CPU tensors, its result released ("fwd"), or
// the op recorded, a backward through autograd and the graph released ("fwdbwd"): ebb records
// with grad mode on and runs its engine (ebb_backward with a gradient seed when the output has
// more than one element, ebb_backward_one for cross_entropy's scalar loss), libtorch runs
// .backward() with the same seed; both clear the inputs' .grad to none before each call (inside
// the timed call, as a training loop would), so every backward writes a fresh gradient. The
// inputs are made by ebb (ebb_tensor_randn) and copied into libtorch tensors, so both sides see
// the same numbers; max_abs_diff compares ebb's result (and, for fwdbwd, every input gradient)
// with libtorch's from one untimed call before the rounds, so a wrong kernel shows next to its
// time. Two training steps, MLP 784-1024-1024-10 batch 256 and 32-32-32-10 batch 8 (ReLU,
// cross-entropy), are timed as forward + backward + an SGD update written from today's ops on both
// sides (matmul, broadcast add, relu, cross_entropy, then p += grad * -lr with mul_scalar and
// add_, grads cleared to none); and as each library's own layer and optimizer (variant
// linear_sgd): libtorch's torch::nn::Linear (at::linear) with torch::optim::SGD against ebb's
// ebb_op_linear with its fused SGD step (ebb_optim_sgd), grads cleared to none on both sides (the
// fastest setting). That line's ratio is libtorch linear_sgd's step over ebb's.
//
// How. In each round every selected case runs ebb then libtorch: one warm-up sample, then 9
// samples, each of k calls (k = 1 unless a call takes under 1 ms: then as many as fill 1 ms, so a
// 1-element add is not timed at the clock's resolution); the round's figure per side is the
// median sample's time divided by k. Over the rounds (default 9, at least 7 for the figures in RESULTS.md)
// each side's figure is the median of its round medians and the ratio is the median of the
// per-round ratios, libtorch's time / ebb's: above 1, ebb is faster.
//
// One thread each. OpenBLAS reads OPENBLAS_NUM_THREADS when it is loaded, before main, and this
// process may hold two copies of it (libebb's libopenblas.so.0 and libtorch's libblas.so.3, which
// Debian's openblas-pthread ships as a second build): the program re-executes itself with
// OPENBLAS_NUM_THREADS=1 and OMP_NUM_THREADS=1 unless they are set so already, then calls
// openblas_set_num_threads(1) and at::set_num_threads(1). It checks the result: per side, the
// process's CPU time over the calling thread's during the timed samples, whose largest value over
// the cases is printed (`check=threads`): 1.00 when all the work ran on the calling thread
// whatever the machine's load; a pool of BLAS or OpenMP threads doing the work would show more.
//
// The process allocator. Like every ebb program this links jemalloc (ebb_program), which
// libtorch's CPU allocator (posix_memalign/free) then uses too. That is the fair setting: ebb's
// CPU tensors come from its own caching host pool, never from malloc, so with jemalloc neither
// side pays for fresh pages in a warm loop (the page-fault count does not grow with the rounds).
// Under glibc's malloc, libtorch's 16 MiB results are returned to the system (trimmed or
// unmapped) and faulted in again on some calls: a cost of that allocator, not of libtorch's
// kernels, which would flatter ebb (perf/JOURNAL.md has the counts).
//
// Output:
//   bench=ops_peer op=<name> pass=<fwd|fwdbwd> shape=<AxB> ebb_ms=X libtorch_ms=Y ratio=R max_abs_diff=D
//   bench=mlp_step model=<big|small> variant=<ops|linear_sgd> impl=<ebb|libtorch> step_ms=X
//   bench=mlp_step model=<big|small> variant=<ops|linear_sgd> ratio=R max_abs_diff=D
//   bench=ops_peer check=threads openblas_threads=1 torch_threads=1 ebb_cpu_per_thread_cpu_max=C ebb_max_at=<op/pass>
//     libtorch_cpu_per_thread_cpu_max=C libtorch_max_at=<op/pass>   (one line)
// usage: ebb-bench-ops_peer [--rounds N | N] [--op name,name,...] [--list]
//   --op runs only the named cases (both passes of an op; mlp_big, mlp_small for the steps).
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "ebb/ebb.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace {

double cpu_ns(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Tensors made for the cases, released before ebb_shutdown.
std::vector<ebb_tensor_t *> g_owned;

ebb_tensor_t *keep(ebb_tensor_t *t) {
  g_owned.push_back(t);
  return t;
}

ebb_tensor_t *randn(std::vector<int64_t> shape, uint64_t seed) {
  ebb_tensor_t *t;
  BENCH_CHECK(ebb_tensor_randn(EBB_DEVICE_CPU, EBB_F32, static_cast<int>(shape.size()), shape.data(), seed, 0, &t));
  return keep(t);
}

ebb_tensor_t *targets(int64_t n, int64_t classes, uint64_t seed) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto &x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(classes));
  }
  ebb_tensor_t *t;
  BENCH_CHECK(ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_I64, 1, &n, v.data(), v.size() * sizeof(int64_t), &t));
  return keep(t);
}

// A libtorch tensor holding a copy of ebb tensor t's values (contiguous CPU f32 or i64).
torch::Tensor to_torch(const ebb_tensor_t *t) {
  ebb_tensor_info info;
  BENCH_CHECK(ebb_tensor_get_info(t, &info));
  if (!info.contiguous || info.device != EBB_DEVICE_CPU) {
    std::fprintf(stderr, "to_torch: not a contiguous CPU tensor\n");
    std::exit(1);
  }
  void *p;
  BENCH_CHECK(ebb_tensor_data(t, &p));
  std::vector<int64_t> sizes(info.shape, info.shape + info.ndim);
  auto dt = info.dtype == EBB_I64 ? torch::kLong : torch::kFloat;
  return torch::from_blob(p, sizes, torch::TensorOptions().dtype(dt)).clone();
}

double max_abs_diff(const torch::Tensor &torch_result, const ebb_tensor_t *ebb_result) {
  torch::NoGradGuard ng;
  torch::Tensor e = to_torch(ebb_result);
  if (e.sizes() != torch_result.sizes()) return INFINITY;
  return (torch_result.to(torch::kDouble) - e.to(torch::kDouble)).abs().max().item<double>();
}

ebb_tensor_t *clone_requiring_grad(const ebb_tensor_t *t) {
  ebb_tensor_t *c;
  BENCH_CHECK(ebb_tensor_clone(t, &c));
  BENCH_CHECK(ebb_tensor_set_requires_grad(c, true));
  return keep(c);
}

// ---- one timed implementation of a case -----------------------------------------------------

struct Impl {
  std::function<void()> call;
  long k = 0;                     // calls per sample, fixed in the first round
  std::vector<double> round_ms;   // the median sample of each round, per call
  double process_cpu = 0, thread_cpu = 0;  // over every timed sample
};

constexpr int kSamples = 9;
constexpr double kMinSampleNs = 1e6;

void measure(Impl &im) {
  if (im.k == 0) {
    im.call();  // the first call ever: pools and caches fill
    uint64_t t0 = bench_now_ns();
    im.call();
    double one = static_cast<double>(bench_now_ns() - t0);
    im.k = one >= kMinSampleNs ? 1 : std::min(100000L, static_cast<long>(std::ceil(kMinSampleNs / std::max(one, 1.0))));
  } else {
    for (long i = 0; i < im.k; i++) im.call();  // the round's warm-up sample
  }
  std::vector<double> ns;
  for (int s = 0; s < kSamples; s++) {
    double p0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID), c0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < im.k; i++) im.call();
    double dt = static_cast<double>(bench_now_ns() - t0);
    im.thread_cpu += cpu_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
    im.process_cpu += cpu_ns(CLOCK_PROCESS_CPUTIME_ID) - p0;
    ns.push_back(dt / static_cast<double>(im.k));
  }
  im.round_ms.push_back(median(ns) / 1e6);
}

// ---- the cases ------------------------------------------------------------------------------

enum Kind { OP, MLP };

struct Case {
  Kind kind;
  std::string key;   // what --op matches: the op's name, or mlp_big / mlp_small
  std::string op, pass, shape, model;
  double diff = 0;
  std::function<double()> check;  // one untimed call per side; the largest difference
  std::vector<Impl> impls;        // ebb, libtorch[, libtorch linear_sgd, ebb linear_sgd]
};

using EbbFwd = std::function<ebb_tensor_t *(const std::vector<ebb_tensor_t *> &)>;
using TorchFwd = std::function<torch::Tensor(const std::vector<torch::Tensor> &)>;

// A forward-only case on inputs `in` (ebb's; libtorch gets copies).
Case op_fwd(const std::string &op, const std::string &shape, std::vector<ebb_tensor_t *> in, EbbFwd ef, TorchFwd tf) {
  std::vector<torch::Tensor> tin;
  for (auto *t : in) tin.push_back(to_torch(t));
  Case c{OP, op, op, "fwd", shape, "", 0, nullptr, {}};
  c.check = [=] {
    ebb_tensor_t *y = ef(in);
    double d = max_abs_diff(tf(tin), y);
    BENCH_CHECK(ebb_tensor_release(y));
    return d;
  };
  c.impls.resize(2);
  c.impls[0].call = [=] { BENCH_CHECK(ebb_tensor_release(ef(in))); };
  c.impls[1].call = [=] { tf(tin); };
  return c;
}

// A forward + backward case: the inputs flagged in `grad` require gradients; a non-scalar
// output is seeded with a fixed random gradient of its shape, the same on both sides.
Case op_fwdbwd(const std::string &op, const std::string &shape, std::vector<ebb_tensor_t *> in, std::vector<bool> grad, EbbFwd ef,
               TorchFwd tf) {
  std::vector<ebb_tensor_t *> ein;
  std::vector<torch::Tensor> tin;
  std::vector<size_t> gi;
  for (size_t i = 0; i < in.size(); i++) {
    if (grad[i]) {
      ein.push_back(clone_requiring_grad(in[i]));
      tin.push_back(to_torch(in[i]).requires_grad_(true));
      gi.push_back(i);
    } else {
      ein.push_back(in[i]);
      tin.push_back(to_torch(in[i]));
    }
  }
  ebb_tensor_t *seed = nullptr;
  torch::Tensor tseed;
  {
    bool was;
    ebb_grad_set_enabled(false, &was);
    ebb_tensor_t *probe = ef(in);
    ebb_grad_set_enabled(was, nullptr);
    int64_t n;
    BENCH_CHECK(ebb_tensor_numel(probe, &n));
    if (n > 1) {
      int nd;
      int64_t s[EBB_TENSOR_MAX_DIMS];
      BENCH_CHECK(ebb_tensor_shape(probe, &nd, s));
      seed = randn(std::vector<int64_t>(s, s + nd), 99);
      tseed = to_torch(seed);
    }
    BENCH_CHECK(ebb_tensor_release(probe));
  }
  auto ebb_step = [=] {
    for (size_t i : gi) BENCH_CHECK(ebb_tensor_set_grad(ein[i], nullptr));
    ebb_tensor_t *y = ef(ein);
    if (seed) {
      const ebb_tensor_t *roots[1] = {y}, *seeds[1] = {seed};
      BENCH_CHECK(ebb_backward(roots, seeds, 1, false, nullptr, 0));
    } else {
      BENCH_CHECK(ebb_backward_one(y));
    }
    return y;
  };
  auto torch_step = [=] {
    for (size_t i : gi) tin[i].mutable_grad().reset();
    torch::Tensor y = tf(tin);
    if (tseed.defined())
      y.backward(tseed);
    else
      y.backward();
    return y;
  };
  Case c{OP, op, op, "fwdbwd", shape, "", 0, nullptr, {}};
  c.check = [=] {
    ebb_tensor_t *y = ebb_step();
    torch::Tensor ty = torch_step();
    double d = max_abs_diff(ty, y);
    BENCH_CHECK(ebb_tensor_release(y));
    for (size_t i : gi) {
      ebb_tensor_t *g;
      BENCH_CHECK(ebb_tensor_grad(ein[i], &g));
      d = std::max(d, g ? max_abs_diff(tin[i].grad(), g) : INFINITY);
      if (g) BENCH_CHECK(ebb_tensor_release(g));
    }
    return d;
  };
  c.impls.resize(2);
  c.impls[0].call = [=] { BENCH_CHECK(ebb_tensor_release(ebb_step())); };
  c.impls[1].call = [=] { torch_step(); };
  return c;
}

// The tensor an ebb call returns through its out-parameter `&y`: RESULT(ebb_op_exp(x, &y)).
#define RESULT(call)      \
  ([&] {                  \
    ebb_tensor_t *y;      \
    BENCH_CHECK(call);    \
    return y;             \
  }())

// Both passes of an op (or only the one asked for).
void add_op(std::vector<Case> &cases, bool fwd, bool bwd, const std::string &op, const std::string &shape,
            std::vector<ebb_tensor_t *> in, std::vector<bool> grad, EbbFwd ef, TorchFwd tf) {
  if (fwd) cases.push_back(op_fwd(op, shape, in, ef, tf));
  if (bwd) cases.push_back(op_fwdbwd(op, shape, in, grad, ef, tf));
}

// ---- the MLP training step ------------------------------------------------------------------

struct Mlp {
  std::vector<int64_t> sizes;  // in, hidden..., out
  int64_t batch;
  double lr = 0.01;
  ebb_tensor_t *x, *y;
  std::vector<ebb_tensor_t *> w, b;  // ebb's parameters, w [in, out]
  torch::Tensor tx, ty;
  std::vector<torch::Tensor> tw, tb;  // the same layout for the ops variant
  std::vector<torch::nn::Linear> lin;
  std::vector<torch::Tensor> lin_params;
  std::shared_ptr<torch::optim::SGD> opt;
  // ebb's linear_sgd variant: ebb_op_linear's layout (lw [out, in]) and the fused SGD step
  std::vector<ebb_tensor_t *> lw, lb;
  ebb_params_t *params = nullptr;
  ebb_optim_t *sgd = nullptr;
  ~Mlp() {  // with the cases, before the kept tensors go and ebb_shutdown
    if (sgd) BENCH_CHECK(ebb_optim_destroy(sgd));
    if (params) BENCH_CHECK(ebb_params_destroy(params));
  }
};

// Forward through the layers (layer(l, h) gives layer l's pre-activation), ReLU between them,
// cross-entropy, backward: the part both of ebb's steps share.
void ebb_mlp_forward_backward(Mlp &m, size_t layers, const std::function<ebb_tensor_t *(size_t, ebb_tensor_t *)> &layer) {
  ebb_tensor_t *h = m.x;
  BENCH_CHECK(ebb_tensor_retain(h));
  for (size_t l = 0; l < layers; l++) {
    ebb_tensor_t *z = layer(l, h);
    BENCH_CHECK(ebb_tensor_release(h));
    if (l + 1 < layers) {
      BENCH_CHECK(ebb_op_relu(z, &h));
      BENCH_CHECK(ebb_tensor_release(z));
    } else {
      h = z;
    }
  }
  ebb_tensor_t *loss;
  BENCH_CHECK(ebb_op_cross_entropy(h, m.y, &loss));
  BENCH_CHECK(ebb_tensor_release(h));
  BENCH_CHECK(ebb_backward_one(loss));
  BENCH_CHECK(ebb_tensor_release(loss));
}

void ebb_mlp_step(Mlp &m) {
  ebb_mlp_forward_backward(m, m.w.size(), [&m](size_t l, ebb_tensor_t *h) {
    ebb_tensor_t *mm, *z;
    BENCH_CHECK(ebb_op_matmul(h, m.w[l], &mm));
    BENCH_CHECK(ebb_op_add(mm, m.b[l], &z));
    BENCH_CHECK(ebb_tensor_release(mm));
    return z;
  });
  bool was;
  ebb_grad_set_enabled(false, &was);
  for (size_t l = 0; l < m.w.size(); l++) {
    for (ebb_tensor_t *p : {m.w[l], m.b[l]}) {
      ebb_tensor_t *g, *u;
      BENCH_CHECK(ebb_tensor_grad(p, &g));
      BENCH_CHECK(ebb_op_mul_scalar(g, -m.lr, &u));
      BENCH_CHECK(ebb_op_add_(p, u));
      BENCH_CHECK(ebb_tensor_release(u));
      BENCH_CHECK(ebb_tensor_release(g));
      BENCH_CHECK(ebb_tensor_set_grad(p, nullptr));
    }
  }
  ebb_grad_set_enabled(was, nullptr);
}

void ebb_mlp_step_linear(Mlp &m) {
  BENCH_CHECK(ebb_optim_zero_grad(m.sgd, true));
  ebb_mlp_forward_backward(m, m.lw.size(), [&m](size_t l, ebb_tensor_t *h) {
    ebb_tensor_t *z;
    BENCH_CHECK(ebb_op_linear(h, m.lw[l], m.lb[l], &z));
    return z;
  });
  BENCH_CHECK(ebb_optim_step(m.sgd));
}

void torch_mlp_step_ops(Mlp &m) {
  torch::Tensor h = m.tx;
  for (size_t l = 0; l < m.tw.size(); l++) {
    h = torch::matmul(h, m.tw[l]) + m.tb[l];
    if (l + 1 < m.tw.size()) h = torch::relu(h);
  }
  torch::Tensor loss = torch::cross_entropy_loss(h, m.ty);
  loss.backward();
  torch::NoGradGuard ng;
  for (size_t l = 0; l < m.tw.size(); l++) {
    for (torch::Tensor *p : {&m.tw[l], &m.tb[l]}) {
      p->add_(p->grad().mul(-m.lr));
      p->mutable_grad().reset();
    }
  }
}

void torch_mlp_step_linear(Mlp &m) {
  for (auto &p : m.lin_params) p.mutable_grad().reset();
  torch::Tensor h = m.tx;
  for (size_t l = 0; l < m.lin.size(); l++) {
    h = m.lin[l]->forward(h);
    if (l + 1 < m.lin.size()) h = torch::relu(h);
  }
  torch::Tensor loss = torch::cross_entropy_loss(h, m.ty);
  loss.backward();
  m.opt->step();
}

Case mlp_case(const std::string &model, std::vector<int64_t> sizes, int64_t batch) {
  auto m = std::make_shared<Mlp>();
  m->sizes = sizes;
  m->batch = batch;
  m->x = randn({batch, sizes[0]}, 11);
  m->y = targets(batch, sizes.back(), 12);
  m->tx = to_torch(m->x);
  m->ty = to_torch(m->y);
  for (size_t l = 0; l + 1 < sizes.size(); l++) {
    // Kaiming-like scale, so the steps stay finite over the whole run.
    ebb_tensor_t *w0 = randn({sizes[l], sizes[l + 1]}, 20 + l), *w;
    BENCH_CHECK(ebb_op_mul_scalar(w0, std::sqrt(2.0 / static_cast<double>(sizes[l])), &w));
    ebb_tensor_t *b;
    BENCH_CHECK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, &sizes[l + 1], &b));
    BENCH_CHECK(ebb_tensor_set_requires_grad(w, true));
    BENCH_CHECK(ebb_tensor_set_requires_grad(b, true));
    m->w.push_back(keep(w));
    m->b.push_back(keep(b));
    m->tw.push_back(to_torch(w).requires_grad_(true));
    m->tb.push_back(to_torch(b).requires_grad_(true));
    torch::nn::Linear lin(sizes[l], sizes[l + 1]);
    {
      torch::NoGradGuard ng;
      lin->weight.copy_(to_torch(w).t());
      lin->bias.copy_(to_torch(b));
    }
    m->lin.push_back(lin);
    ebb_tensor_t *wt, *lw, *lb;
    bool was;
    ebb_grad_set_enabled(false, &was);  // copies of the parameters, not part of a graph
    BENCH_CHECK(ebb_tensor_transpose(w, 0, 1, &wt));
    BENCH_CHECK(ebb_tensor_contiguous(wt, &lw));
    BENCH_CHECK(ebb_tensor_release(wt));
    BENCH_CHECK(ebb_tensor_clone(b, &lb));
    ebb_grad_set_enabled(was, nullptr);
    BENCH_CHECK(ebb_tensor_set_requires_grad(lw, true));
    BENCH_CHECK(ebb_tensor_set_requires_grad(lb, true));
    m->lw.push_back(keep(lw));
    m->lb.push_back(keep(lb));
  }
  BENCH_CHECK(ebb_params_create(&m->params));
  for (size_t l = 0; l < m->lw.size(); l++) {
    BENCH_CHECK(ebb_params_add(m->params, m->lw[l]));
    BENCH_CHECK(ebb_params_add(m->params, m->lb[l]));
  }
  ebb_sgd_options so = {};
  so.lr = m->lr;
  BENCH_CHECK(ebb_optim_sgd(m->params, &so, &m->sgd));
  for (auto &l : m->lin)
    for (auto &p : l->parameters()) m->lin_params.push_back(p);
  m->opt = std::make_shared<torch::optim::SGD>(m->lin_params, torch::optim::SGDOptions(m->lr));

  Case c{MLP, "mlp_" + model, "", "", "", model, 0, nullptr, {}};
  // One step of each from the same parameters; the parameters after it are compared (ebb's
  // against the ops variant's, the ops variant's against linear_sgd's, transposed, and ebb's
  // linear_sgd against libtorch's).
  c.check = [m] {
    ebb_mlp_step(*m);
    torch_mlp_step_ops(*m);
    torch_mlp_step_linear(*m);
    ebb_mlp_step_linear(*m);
    double d = 0;
    for (size_t l = 0; l < m->w.size(); l++) {
      d = std::max(d, max_abs_diff(m->tw[l], m->w[l]));
      d = std::max(d, max_abs_diff(m->tb[l], m->b[l]));
      torch::NoGradGuard ng;
      d = std::max(d, (m->lin[l]->weight.t() - m->tw[l]).abs().max().item<double>());
      d = std::max(d, (m->lin[l]->bias - m->tb[l]).abs().max().item<double>());
      d = std::max(d, max_abs_diff(m->lin[l]->weight, m->lw[l]));
      d = std::max(d, max_abs_diff(m->lin[l]->bias, m->lb[l]));
    }
    return d;
  };
  c.impls.resize(4);
  c.impls[0].call = [m] { ebb_mlp_step(*m); };
  c.impls[1].call = [m] { torch_mlp_step_ops(*m); };
  c.impls[2].call = [m] { torch_mlp_step_linear(*m); };
  c.impls[3].call = [m] { ebb_mlp_step_linear(*m); };
  return c;
}

std::vector<Case> make_cases(const std::set<std::string> &only) {
  auto want = [&](const std::string &k) { return only.empty() || only.count(k) > 0; };
  std::vector<Case> cs;
  const std::string S = "4096x1024";
  ebb_tensor_t *x = randn({4096, 1024}, 1), *x2 = randn({4096, 1024}, 2);
  const int last = 1, first = 0;

  if (want("softmax"))
    add_op(cs, true, true, "softmax", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_softmax(in[0], 1, &y)); },
           [](auto &in) { return torch::softmax(in[0], 1); });
  if (want("log_softmax"))
    add_op(cs, true, true, "log_softmax", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_log_softmax(in[0], 1, &y)); },
           [](auto &in) { return torch::log_softmax(in[0], 1); });
  if (want("sum_last"))
    add_op(cs, true, false, "sum_last", S, {x}, {true},
           [=](auto &in) { return RESULT(ebb_op_sum(in[0], &last, 1, false, &y)); },
           [](auto &in) { return in[0].sum(1); });
  if (want("sum_first"))
    add_op(cs, true, false, "sum_first", S, {x}, {true},
           [=](auto &in) { return RESULT(ebb_op_sum(in[0], &first, 1, false, &y)); },
           [](auto &in) { return in[0].sum(0); });
  if (want("mean"))
    add_op(cs, true, false, "mean", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_mean(in[0], nullptr, 0, false, &y)); },
           [](auto &in) { return in[0].mean(); });
  if (want("mul_scalar"))
    add_op(cs, true, false, "mul_scalar", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_mul_scalar(in[0], 0.5, &y)); },
           [](auto &in) { return in[0].mul(0.5); });
  if (want("exp"))
    add_op(cs, true, false, "exp", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_exp(in[0], &y)); },
           [](auto &in) { return torch::exp(in[0]); });
  if (want("gelu"))
    add_op(cs, true, true, "gelu", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_gelu(in[0], &y)); },
           [](auto &in) { return torch::gelu(in[0]); });
  if (want("relu"))
    add_op(cs, true, false, "relu", S, {x}, {true},
           [](auto &in) { return RESULT(ebb_op_relu(in[0], &y)); },
           [](auto &in) { return torch::relu(in[0]); });
  if (want("layer_norm")) {
    ebb_tensor_t *w = randn({1024}, 3), *b = randn({1024}, 4);
    add_op(cs, true, true, "layer_norm", S, {x, w, b}, {true, true, true},
           [](auto &in) { return RESULT(ebb_op_layer_norm(in[0], 1, in[1], in[2], 1e-5, &y)); },
           [](auto &in) { return torch::layer_norm(in[0], {1024}, in[1], in[2], 1e-5); });
  }
  if (want("cross_entropy")) {
    ebb_tensor_t *logits = randn({4096, 1000}, 5), *t = targets(4096, 1000, 6);
    add_op(cs, true, true, "cross_entropy", "4096x1000", {logits, t}, {true, false},
           [](auto &in) { return RESULT(ebb_op_cross_entropy(in[0], in[1], &y)); },
           [](auto &in) { return torch::cross_entropy_loss(in[0], in[1]); });
  }
  if (want("transpose_contiguous"))
    add_op(cs, true, false, "transpose_contiguous", S, {x}, {true},
           [](auto &in) {
             ebb_tensor_t *v, *y;
             BENCH_CHECK(ebb_tensor_transpose(in[0], 0, 1, &v));
             BENCH_CHECK(ebb_tensor_contiguous(v, &y));
             BENCH_CHECK(ebb_tensor_release(v));
             return y;
           },
           [](auto &in) { return in[0].t().contiguous(); });
  if (want("add"))
    add_op(cs, true, false, "add", S, {x, x2}, {true, true},
           [](auto &in) { return RESULT(ebb_op_add(in[0], in[1], &y)); },
           [](auto &in) { return in[0] + in[1]; });
  if (want("matmul")) {
    ebb_tensor_t *a = randn({1024, 1024}, 7), *b = randn({1024, 1024}, 8);
    add_op(cs, true, false, "matmul", "1024x1024x1024", {a, b}, {true, true},
           [](auto &in) { return RESULT(ebb_op_matmul(in[0], in[1], &y)); },
           [](auto &in) { return torch::matmul(in[0], in[1]); });
  }
  if (want("cat")) {
    ebb_tensor_t *a = randn({2048, 1024}, 9), *b = randn({2048, 1024}, 10);
    add_op(cs, true, false, "cat", "2x2048x1024", {a, b}, {true, true},
           [](auto &in) {
             const ebb_tensor_t *ts[2] = {in[0], in[1]};
             return RESULT(ebb_op_cat(ts, 2, 0, &y));
           },
           [](auto &in) { return torch::cat({in[0], in[1]}, 0); });
  }
  if (want("add_1elem")) {
    ebb_tensor_t *a = randn({1}, 13), *b = randn({1}, 14);
    add_op(cs, true, false, "add_1elem", "1", {a, b}, {true, true},
           [](auto &in) { return RESULT(ebb_op_add(in[0], in[1], &y)); },
           [](auto &in) { return in[0] + in[1]; });
  }
  if (want("mlp_big")) cs.push_back(mlp_case("big", {784, 1024, 1024, 10}, 256));
  if (want("mlp_small")) cs.push_back(mlp_case("small", {32, 32, 32, 10}, 8));
  return cs;
}

const char *const kAllKeys[] = {"softmax", "log_softmax", "sum_last", "sum_first", "mean", "mul_scalar", "exp", "gelu",
                                "relu", "layer_norm", "cross_entropy", "transpose_contiguous", "add", "matmul", "cat",
                                "add_1elem", "mlp_big", "mlp_small"};

int usage() {
  std::fprintf(stderr, "usage: ebb-bench-ops_peer [--rounds N | N] [--op name,name,...] [--list]\n");
  return 2;
}

}  // namespace

int main(int argc, char **argv) {
  // One BLAS thread in every OpenBLAS copy of the process: they read the variable when loaded.
  const char *ob = std::getenv("OPENBLAS_NUM_THREADS"), *omp = std::getenv("OMP_NUM_THREADS");
  if (!ob || std::strcmp(ob, "1") != 0 || !omp || std::strcmp(omp, "1") != 0) {
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    setenv("OMP_NUM_THREADS", "1", 1);
    execv("/proc/self/exe", argv);
    std::perror("ebb-bench-ops_peer: re-executing with OPENBLAS_NUM_THREADS=1");
    return 1;
  }
  int rounds = 9;
  std::set<std::string> only;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (a == "--op" && i + 1 < argc) {
      std::stringstream ss(argv[++i]);
      std::string k;
      while (std::getline(ss, k, ',')) {
        if (std::find(std::begin(kAllKeys), std::end(kAllKeys), k) == std::end(kAllKeys)) {
          std::fprintf(stderr, "ebb-bench-ops_peer: unknown op '%s' (--list shows them)\n", k.c_str());
          return 2;
        }
        only.insert(k);
      }
    } else if (a == "--list") {
      for (const char *k : kAllKeys) std::printf("%s\n", k);
      return 0;
    } else if (!a.empty() && std::isdigit(static_cast<unsigned char>(a[0]))) {
      rounds = std::atoi(a.c_str());
    } else {
      return usage();
    }
  }
  if (rounds < 1 || rounds > 1000) return usage();
  if (rounds < 7) std::fprintf(stderr, "ebb-bench-ops_peer: %d rounds; figures for RESULTS.md take at least 7\n", rounds);

  openblas_set_num_threads(1);
  at::set_num_threads(1);
  BENCH_CHECK(ebb_init());
  {
    std::vector<Case> cases = make_cases(only);
    for (auto &c : cases) c.diff = c.check();
    for (int r = 0; r < rounds; r++)
      for (auto &c : cases)
        for (auto &im : c.impls) measure(im);

    double ebb_cpw = 0, torch_cpw = 0;
    std::string ebb_worst, torch_worst;
    for (auto &c : cases) {
      std::vector<double> ratios;
      for (int r = 0; r < rounds; r++) ratios.push_back(c.impls[1].round_ms[r] / c.impls[0].round_ms[r]);
      double e = median(c.impls[0].round_ms), t = median(c.impls[1].round_ms);
      if (c.kind == OP) {
        std::printf("bench=ops_peer op=%s pass=%s shape=%s ebb_ms=%.4g libtorch_ms=%.4g ratio=%.3f max_abs_diff=%.3g\n",
                    c.op.c_str(), c.pass.c_str(), c.shape.c_str(), e, t, median(ratios), c.diff);
      } else {
        std::vector<double> lratios;
        for (int r = 0; r < rounds; r++) lratios.push_back(c.impls[2].round_ms[r] / c.impls[3].round_ms[r]);
        const char *m = c.model.c_str();
        std::printf("bench=mlp_step model=%s variant=ops impl=ebb step_ms=%.4g\n", m, e);
        std::printf("bench=mlp_step model=%s variant=ops impl=libtorch step_ms=%.4g\n", m, t);
        std::printf("bench=mlp_step model=%s variant=linear_sgd impl=ebb step_ms=%.4g\n", m, median(c.impls[3].round_ms));
        std::printf("bench=mlp_step model=%s variant=linear_sgd impl=libtorch step_ms=%.4g\n", m, median(c.impls[2].round_ms));
        std::printf("bench=mlp_step model=%s variant=ops ratio=%.3f max_abs_diff=%.3g\n", m, median(ratios), c.diff);
        std::printf("bench=mlp_step model=%s variant=linear_sgd ratio=%.3f max_abs_diff=%.3g\n", m, median(lratios), c.diff);
      }
      std::string name = c.key + (c.kind == OP ? "/" + c.pass : "");
      for (size_t i = 0; i < c.impls.size(); i++) {
        double cpw = c.impls[i].process_cpu / c.impls[i].thread_cpu;
        const bool ebb_impl = i == 0 || i == 3;  // impls: ebb, libtorch, libtorch linear_sgd, ebb linear_sgd
        if (ebb_impl && cpw > ebb_cpw) ebb_cpw = cpw, ebb_worst = name;
        if (!ebb_impl && cpw > torch_cpw) torch_cpw = cpw, torch_worst = name;
      }
      std::fflush(stdout);
    }
    std::printf("bench=ops_peer check=threads openblas_threads=%d torch_threads=%d ebb_cpu_per_thread_cpu_max=%.3f ebb_max_at=%s "
                "libtorch_cpu_per_thread_cpu_max=%.3f libtorch_max_at=%s\n",
                openblas_get_num_threads(), at::get_num_threads(), ebb_cpw, ebb_worst.c_str(), torch_cpw, torch_worst.c_str());
  }
  for (auto *t : g_owned) BENCH_CHECK(ebb_tensor_release(t));
  BENCH_CHECK(ebb_shutdown());
  return 0;
}
