// The engine across devices, streams and threads (ebb/autograd.h, "the engine: devices, streams,
// threads"): each node's backward and its hooks run on its forward stream; gradients
// handed between streams and devices are waited for, and each of those waits is
// shown to be needed (the test reads wrong values when the emulated driver skips it);
// events per edge; the AccumulateGrad stream-mismatch warning and the follow-producer policy;
// engine modes; multi-device backward with several roots and from several threads;
// errors from a device worker; reentrant backward at and past the depth limit, and hand-offs of
// several workers to the pool at once; in-place sums into a gradient other streams may still read;
// modes a hook leaves on an engine thread.
//
// Runs with the emulated driver's timing model (EBB_SIM_LAUNCH_US, set by CMakeLists.txt): every
// kernel keeps its device's compute engine busy for that long, so a backlog of kernels on one
// stream holds that stream's later work back while other streams go on, and a reader on another
// stream that does not wait reads what was in memory before. The presets add EBB_SIM_PERTURB.
// Hooks may run on device worker threads: they only record what they see (under a mutex), and
// the test thread checks it afterwards (Catch2's assertions are not thread-safe).
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "devices_test_util.hpp"

using namespace ebb_test;

namespace {

// Set by wrong_tries: the scenarios below have the emulated driver skip the one wait they pin
// (SkipWaits), and count the waits it skipped.
bool g_skip_wait = false;
unsigned long long g_skipped_waits = 0;

// Tries of a scenario with a wait dropped (each should read wrong values) and without.
constexpr int kTries = 3;

// ---- probes: which stream and thread hooks run on ----------------------------------------------

struct Probe {
  std::mutex mu;
  std::vector<std::string> wrong;                 // a hook that ran with another stream current
  std::map<std::string, int> runs;                // per label
  std::map<int, std::set<std::thread::id>> threads;  // per device (-1: CPU)
  // Called from hooks: the current stream of `dev` on this thread must be `want`.
  void note(const std::string &label, int dev, uint64_t want) {
    uint64_t got = 0;
    ebb_stream_t *s = nullptr;
    bool ok = dev < 0 || (ebb_stream_current(dev, &s) == EBB_OK && ebb_stream_id(s, &got) == EBB_OK);
    std::lock_guard<std::mutex> l(mu);
    runs[label]++;
    threads[dev].insert(std::this_thread::get_id());
    if (!ok)
      wrong.push_back(label + ": no current stream");
    else if (dev >= 0 && got != want)
      wrong.push_back(label + ": ran on stream " + std::to_string(got) + ", its forward stream is " + std::to_string(want));
  }
};

// A node pre-hook on every node: the node's device's current stream must be its forward stream
// (ebb_node_input_meta's stream_id).
ebb_status probe_pre(const ebb_node_t *node, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  ebb_node_input_info info;
  ebb_status st = ebb_node_input_meta(node, 0, &info);
  if (st) return st;
  uint64_t seq = 0;
  ebb_node_sequence_nr(node, &seq);
  static_cast<Probe *>(user)->note(std::string(ebb_node_name(node)) + "#" + std::to_string(seq), info.device, info.stream_id);
  return EBB_OK;
}

void collect(const ebb_node_t *n, std::vector<const ebb_node_t *> &out) {
  if (!n || std::find(out.begin(), out.end(), n) != out.end()) return;
  out.push_back(n);
  int k = 0;
  EBB_REQUIRE_OK(ebb_node_num_next(n, &k));
  for (int i = 0; i < k; i++) {
    const ebb_node_t *x = nullptr;
    int nr = 0;
    EBB_REQUIRE_OK(ebb_node_next(n, i, &x, &nr));
    collect(x, out);
  }
}

// Registers probe_pre on every node reachable from the roots; returns how many.
size_t probe_graph(std::vector<const ebb_tensor_t *> roots, Probe *p) {
  std::vector<const ebb_node_t *> nodes;
  for (auto *r : roots) collect(grad_fn(r), nodes);
  for (auto *n : nodes) {
    ebb_hook_handle h;
    EBB_REQUIRE_OK(ebb_node_register_pre_hook(n, probe_pre, p, &h));
  }
  return nodes.size();
}

struct TensorProbe {
  Probe *p;
  std::string label;
  int dev;
  uint64_t want;
};

ebb_status probe_tensor_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  auto *tp = static_cast<TensorProbe *>(user);
  tp->p->note(tp->label, tp->dev, tp->want);
  return EBB_OK;
}

ebb_status probe_post_acc(const ebb_tensor_t *, void *user) {
  auto *tp = static_cast<TensorProbe *>(user);
  tp->p->note(tp->label, tp->dev, tp->want);
  return EBB_OK;
}

int total_runs(Probe &p) {
  int n = 0;
  for (auto &kv : p.runs) n += kv.second;
  return n;
}

// ---- scenarios of the backward's stream rules, each returning whether the values came out right ---
// Every one runs on device `dev` with streams of its own, makes the stream that produces a
// gradient slow (a backlog), and reads the result with an op on the caller's current stream.
// Under g_skip_wait, the driver skips the waits of the stream pair the scenario names (the
// backward makes no other wait between those two streams).

// A gradient crossing streams: producer (MulBackward, SumBackward) on sp, consumer
// (MulScalarBackward, and the leaf's AccumulateGrad) on sc. Needs the consumer's wait: sc for
// sp. (One gradient into a's slot: a * a would send two, summed on sc after the accumulation's
// waits.)
bool scenario_cross_stream(int dev, int t) {
  Stream sp(dev), sc(dev);
  auto wv = vals(t), cv = vals(t + 3);
  Tensor w = leaf(dev, wv), c = make(dev, EBB_F64, {(int64_t)cv.size()}, cv), a, b, loss;
  sync_all();
  {
    OnStream g(sc);
    a = scale(w, 3);  // the consumer
  }
  EBB_REQUIRE_OK(ebb_stream_wait_stream(sp, sc));
  {
    OnStream g(sp);
    b = mul(a, c);  // the producer of a's gradient (c needs none)
    loss = sum(b);
  }
  busy(sp, kBacklog);
  {
    SkipWaits skip(g_skip_wait, sc, sp, &g_skipped_waits);
    EBB_REQUIRE_OK(backward({loss}));
  }
  return same(grad_seen(w), times(cv, 3.0));  // d/dw sum(3 w c)
}

// The root's gradient, made on the caller's current stream after a backlog there, consumed by a
// node on another stream. Needs the consumer's wait for the caller's stream: s1 for it.
bool scenario_root_grad(int dev, int t) {
  Stream s1(dev);
  auto wv = vals(t);
  Tensor w = leaf(dev, wv), y;
  sync_all();
  {
    OnStream g(s1);
    y = scale(w, 2);  // a root of 8 elements: its gradient is given
  }
  busy(current(dev), kBacklog);
  Tensor gy = full(dev, (int64_t)wv.size(), 1.5 + t);  // written by a kernel behind the backlog
  {
    SkipWaits skip(g_skip_wait, s1, current(dev), &g_skipped_waits);
    EBB_REQUIRE_OK(backward({y}, {gy}));
  }
  return same(grad_seen(w), std::vector<double>(wv.size(), 2 * (1.5 + t)));
}

// Several producers into one input: a's gradient comes from s1 (slow) and s2 and is summed on
// the consumer's stream sc (the consumer is on the gradients' device: sums are made on its stream).
// Needs the accumulation stream's waits: sc for s1 (a's only consumer is on sc, so sc waits for
// s1 only to sum).
bool scenario_accumulate(int dev, int t) {
  Stream sc(dev), s1(dev), s2(dev);
  auto wv = vals(t);
  Tensor w = leaf(dev, wv), a, p1, l1, p2, l2;
  sync_all();
  {
    OnStream g(sc);
    a = scale(w, 2);  // the consumer of both gradients
  }
  EBB_REQUIRE_OK(ebb_stream_wait_stream(s1, sc));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(s2, sc));
  {
    OnStream g(s1);
    p1 = scale(a, 3 + t);
    l1 = sum(p1);
  }
  {
    OnStream g(s2);
    p2 = scale(a, 5);
    l2 = sum(p2);
  }
  busy(s1, kBacklog);
  {
    SkipWaits skip(g_skip_wait, sc, s1, &g_skipped_waits);
    EBB_REQUIRE_OK(backward({l1, l2}));
  }
  return same(grad_seen(w), std::vector<double>(wv.size(), 2.0 * (3 + t + 5)));
}

// The end of a backward: everything ran on s0 behind a backlog; the caller, on a stream of its
// own, reads .grad with an op right after ebb_backward returns. Needs the leaf streams' sync:
// the caller's stream for s0.
bool scenario_leaf_sync(int dev, int t) {
  Stream s0(dev), caller(dev);
  auto wv = vals(t);
  Tensor w = leaf(dev, wv), loss;
  sync_all();
  {
    OnStream g(s0);
    Tensor sq = mul(w, w);
    loss = sum(sq);
  }
  busy(s0, kBacklog);
  OnStream g(caller);
  {
    SkipWaits skip(g_skip_wait, caller, s0, &g_skipped_waits);
    EBB_REQUIRE_OK(backward({loss}));
  }
  return same(grad_seen(w), times(wv, 2.0));
}

// A retained non-leaf: retain_grad writes its .grad on the stream of the node that made it (a's
// forward stream s, behind a backlog). a is w moved from the other device to `dev`, so no leaf's
// .grad is written on `dev`: only the end sync orders the caller's stream there after s. The
// caller, on streams of its own on both devices, reads a's .grad right after ebb_backward
// returns. Needs the retaining stream among those the end sync waits for: c for s.
bool scenario_retain_sync(int dev, int t) {
  Warnings quiet;  // w's AccumulateGrad (the other device) gets its gradient from s: the mismatch warning
  int other = 1 - dev;
  Stream s(dev), c(dev), co(other);
  auto wv = vals(t);
  Tensor w = leaf(other, wv), a, loss;
  sync_all();
  {
    OnStream g(s);
    a = to_dev(w, dev);
    EBB_REQUIRE_OK(ebb_tensor_retain_grad(a));
    loss = sum(mul(a, a));
  }
  busy(s, kBacklog);
  OnStream go(co);
  OnStream gc(c);
  {
    SkipWaits skip(g_skip_wait, c, s, &g_skipped_waits);
    EBB_REQUIRE_OK(backward({loss}));
  }
  return same(grad_seen(a), times(wv, 2.0));  // d/da sum(a^2)
}

// A second backward into a retained .grad: backward 1 (retain_graph) writes a's .grad on a's
// forward stream s behind a backlog, then s is released; backward 2, from a caller on another
// stream c2, runs a's node on c2 (its forward stream is gone) and adds into that .grad in place.
// Needs c2 to wait for .grad's last write on s first (as a leaf's .grad would).
bool scenario_retain_twice(int dev, int t) {
  Stream c1(dev), c2(dev);
  auto wv = vals(t);
  Tensor w = leaf(dev, wv), a, loss;
  sync_all();
  {
    Stream s(dev);
    {
      OnStream g(s);
      a = scale(w, 3);
      EBB_REQUIRE_OK(ebb_tensor_retain_grad(a));
      loss = sum(mul(a, a));
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(c2, s));  // backward 2 reads the forward's saved values, not backward 1's work
    busy(s, kBacklog);
    OnStream g(c1);
    EBB_REQUIRE_OK(backward({loss}, {}, true));
  }  // s released, its work still queued
  OnStream g(c2);
  EBB_REQUIRE_OK(backward({loss}));
  return same(grad_seen(a), times(wv, 12.0));  // twice d/da sum(a^2) = 2 * 2 * 3w
}

using Scenario = bool (*)(int, int);

// Runs a scenario kTries times, with the wait it pins skipped by the driver when `skip`: returns
// how many tries read wrong values.
int wrong_tries(Scenario sc, bool skip, int dev) {
  int wrong = 0;
  g_skip_wait = skip;
  for (int t = 0; t < kTries; t++) {
    bool ok = sc(dev, t);
    sync_all();  // the next try starts from idle devices
    if (!ok) wrong++;
  }
  g_skip_wait = false;
  return wrong;
}

// A scenario with its waits in place, on each device, under the two engine paths that can run
// it (the calling thread's, the device workers'): right values every time. `extra` (may be null)
// runs after it in each round, with that mode set.
void check_each_mode_and_device(Scenario sc, void (*extra)(int dev) = nullptr) {
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_WORKERS})
    for (int dev : {0, 1}) {
      INFO("mode " << mode << ", device " << dev);
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
      CHECK(sc(dev, dev));
      if (extra) extra(dev);
    }
}

// A scenario with its waits in place, kTries times on each device under each of `modes`, a
// different try number (so different values) in every round: right values every time.
void check_tries_each(Scenario sc, std::initializer_list<ebb_engine_mode> modes) {
  for (ebb_engine_mode mode : modes)
    for (int dev : {0, 1}) {
      INFO("mode " << mode << ", device " << dev);
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
      for (int t = 0; t < kTries; t++) CHECK(sc(dev, t + 4 * dev + 8 * mode));
      sync_all();
    }
}

// The proof pattern: the engine makes the wait (the driver skipped at least one), and without it
// the values are wrong (at least once in kTries; with the backlog it should be every time), with
// it right every time.
void prove_wait(Scenario sc, const char *what) {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (int dev : {0, 1}) {
    INFO(what << " on device " << dev);
    g_skipped_waits = 0;
    int without = wrong_tries(sc, true, dev);
    INFO("wrong values in " << without << " of " << kTries << " tries without the wait (" << g_skipped_waits << " waits skipped)");
    CHECK(g_skipped_waits >= 1);
    CHECK(without >= 1);
    int with = wrong_tries(sc, false, dev);
    INFO("wrong values in " << with << " of " << kTries << " tries with the wait");
    CHECK(with == 0);
  }
  sync_all();
}

// A graph over two devices with side streams, the forward moving tensors 0 -> 1 -> 0 -> 1:
//   a0 = w0 * w0 (dev 0, s0) ; a1 = to(a0, 1) (s1) ; b1 = a1 * w1 (s1) ; b0 = to(b1, 0) (s0) ;
//   c0 = b0 * w0 (s0) ; c1 = to(c0, 1) (s1) ; loss = sum(c1) (dev 1, s1)
// loss = sum(w0^3 w1): d/dw0 = 3 w0^2 w1, d/dw1 = w0^3.
struct PingPong {
  Tensor w0, w1, loss;
  std::vector<double> v0, v1;
  PingPong(ebb_stream_t *s0, ebb_stream_t *s1, int t) {
    v0 = vals(t);
    v1 = vals(t + 7);
    w0 = leaf(0, v0, "w0");
    w1 = leaf(1, v1, "w1");
    sync_all();
    OnStream g0(s0);
    OnStream g1(s1);
    Tensor a0 = mul(w0, w0);
    Tensor a1 = to_dev(a0, 1);
    Tensor b1 = mul(a1, w1);
    Tensor b0 = to_dev(b1, 0);
    Tensor c0 = mul(b0, w0);
    Tensor c1 = to_dev(c0, 1);
    loss = sum(c1);
  }
  std::vector<double> want0() const {
    std::vector<double> r(v0.size());
    for (size_t i = 0; i < r.size(); i++) r[i] = 3 * v0[i] * v0[i] * v1[i];
    return r;
  }
  std::vector<double> want1() const {
    std::vector<double> r(v0.size());
    for (size_t i = 0; i < r.size(); i++) r[i] = v0[i] * v0[i] * v0[i];
    return r;
  }
};

// Holds a stream from the driver's host-function thread until opened (a hang breaker after 30 s,
// which the test reports): work unrelated to a backward, which a device-wide sync would wait for.
struct Gate {
  std::atomic<int> open{0};
  std::atomic<int> broke{0};
  static void fn(void *user) {
    auto *g = static_cast<Gate *>(user);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!g->open.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (!g->open.load(std::memory_order_acquire)) g->broke.store(1, std::memory_order_release);
  }
};

}  // namespace

// ---- 1. the stream rules on two devices with side streams -------------------------------------------

TEST_CASE("engine devices: each node's backward and its hooks run on the node's forward stream",
          "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (int d1 : {0, 1}) {
    // d1 == 1: the graph spans two devices (device workers); d1 == 0: one device (calling thread).
    INFO("second half of the graph on device " << d1);
    Stream s0a(0), s0b(0), s1a(d1);
    auto v0 = vals(1), v1 = vals(2);
    Tensor w0 = leaf(0, v0, "w0"), w1 = leaf(d1, v1, "w1"), a, b, bb, c, loss;
    sync_all();
    {
      OnStream g(s0a);
      a = scale(w0, 3);  // MulScalarBackward and w0's AccumulateGrad on s0a
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(s0b, s0a));
    {
      OnStream g0(s0b);
      b = mul(a, a);  // MulBackward on s0b
      EBB_REQUIRE_OK(ebb_stream_wait_stream(s1a, s0b));
      OnStream g1(s1a);
      bb = to_dev(b, d1);  // ToDeviceBackward on s1a
      c = mul(bb, w1);     // MulBackward and w1's AccumulateGrad on s1a
      loss = sum(c);       // SumBackward on s1a
    }
    // The forward streams were recorded (else the probe below would check nothing).
    REQUIRE(node_stream(grad_fn(a)) == s0a.id());
    REQUIRE(node_stream(next_of(grad_fn(a), 0)) == s0a.id());
    REQUIRE(node_stream(grad_fn(b)) == s0b.id());
    REQUIRE(node_stream(grad_fn(bb)) == s1a.id());
    REQUIRE(node_stream(grad_fn(c)) == s1a.id());
    REQUIRE(node_stream(grad_fn(loss)) == s1a.id());

    Probe probe;
    size_t nodes = probe_graph({loss}, &probe);
    CHECK(nodes == 7);
    TensorProbe tw0{&probe, "w0's tensor hook", 0, s0a.id()}, pw0{&probe, "w0's post-accumulate hook", 0, s0a.id()},
        ta{&probe, "a's tensor hook", 0, s0a.id()}, tbb{&probe, "bb's tensor hook", d1, s1a.id()},
        pw1{&probe, "w1's post-accumulate hook", d1, s1a.id()};
    ebb_hook_handle h;
    EBB_REQUIRE_OK(ebb_tensor_register_hook(w0, probe_tensor_hook, &tw0, &h));
    EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(w0, probe_post_acc, &pw0, &h));
    EBB_REQUIRE_OK(ebb_tensor_register_hook(a, probe_tensor_hook, &ta, &h));
    EBB_REQUIRE_OK(ebb_tensor_register_hook(bb, probe_tensor_hook, &tbb, &h));
    EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(w1, probe_post_acc, &pw1, &h));

    busy(s0b, kBacklog / 2);
    busy(s1a, kBacklog / 2);
    Stats before = stats();
    EBB_REQUIRE_OK(backward({loss}));
    Stats after = stats();
    {
      std::lock_guard<std::mutex> l(probe.mu);
      std::string all;
      for (auto &w : probe.wrong) all += w + "\n";
      INFO(all);
      CHECK(probe.wrong.empty());
      CHECK(total_runs(probe) == (int)nodes + 5);
      if (d1 == 0) CHECK(probe.threads[0] == std::set<std::thread::id>{std::this_thread::get_id()});
    }
    if (d1 == 1)
      CHECK(after.nodes_run_on_workers > before.nodes_run_on_workers);
    else
      CHECK(after.nodes_run_on_workers == before.nodes_run_on_workers);
    std::vector<double> want0(v0.size()), want1(v0.size());
    for (size_t i = 0; i < v0.size(); i++) {
      want0[i] = 18 * v0[i] * v1[i];
      want1[i] = 9 * v0[i] * v0[i];
    }
    EBB_CHECK_CLOSE(grad_seen(w0), want0, 1e-9, 1e-12);
    EBB_CHECK_CLOSE(grad_seen(w1), want1, 1e-9, 1e-12);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: a node reads its saved forward values in its forward stream's order",
          "[autograd][devices][streams]") {
  // The forward itself runs late (behind a backlog on its side stream s) and the caller's stream
  // does not wait for it: a node run on the caller's stream would read its saved input before
  // the forward wrote it; on its forward stream it reads it after.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_WORKERS})
    for (int dev : {0, 1}) {
      INFO("mode " << mode << ", device " << dev);
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
      Stream s(dev);
      auto v = vals(dev + 2 * (int)mode);
      Tensor w = leaf(dev, v), loss;
      sync_all();
      busy(s, kBacklog);
      {
        OnStream g(s);
        Tensor a = scale(w, 3), b = mul(a, a);  // MulBackward saves a, written behind the backlog
        loss = sum(b);
      }
      EBB_REQUIRE_OK(backward({loss}));
      EBB_CHECK_CLOSE(grad_seen(w), times(v, 18.0), 1e-9, 1e-12);
    }
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: a node whose forward stream was released runs on the caller's current stream",
          "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  auto v = vals(3);
  Tensor w = leaf(0, v), y, loss;
  sync_all();
  uint64_t gone = 0;
  {
    Stream tmp(0);
    gone = tmp.id();
    OnStream g(tmp);
    y = scale(w, 4);
    loss = sum(y);
    EBB_REQUIRE_OK(ebb_stream_synchronize(tmp));
  }  // tmp released: the nodes' stream is gone
  REQUIRE(node_stream(grad_fn(loss)) == gone);
  Stream caller(0);
  Probe probe;
  struct Want {
    Probe *p;
    uint64_t want;
  } want{&probe, caller.id()};
  // The probe compares with the node's recorded (released) stream; this hook checks the caller's.
  auto on_caller = [](const ebb_node_t *node, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) -> ebb_status {
    auto *wt = static_cast<Want *>(user);
    wt->p->note(std::string("(caller's stream) ") + ebb_node_name(node), 0, wt->want);
    return EBB_OK;
  };
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(loss), on_caller, &want, &h));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), on_caller, &want, &h));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(next_of(grad_fn(y), 0), on_caller, &want, &h));
  OnStream g(caller);
  EBB_REQUIRE_OK(backward({loss}));
  {
    std::lock_guard<std::mutex> l(probe.mu);
    std::string all;
    for (auto &s : probe.wrong) all += s + "\n";
    INFO(all);
    CHECK(probe.wrong.empty());
    CHECK(probe.runs["(caller's stream) SumBackward"] == 1);
    CHECK(probe.runs["(caller's stream) MulScalarBackward"] == 1);
    CHECK(probe.runs["(caller's stream) AccumulateGrad"] == 1);
  }
  EBB_CHECK_CLOSE(grad_seen(w), std::vector<double>(v.size(), 4.0), 1e-12, 0);
}

TEST_CASE("engine devices: a gradient crossing streams is waited for by its consumer", "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  check_each_mode_and_device(scenario_cross_stream);
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: the root's gradient made on the caller's stream is waited for by a node on another stream",
          "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  // The implicit 1 of a scalar root counts as produced on the caller's stream too.
  check_each_mode_and_device(scenario_root_grad, [](int dev) {
    Stream s1(dev);
    auto v = vals(4);
    Tensor w = leaf(dev, v), loss;
    sync_all();
    {
      OnStream g(s1);
      Tensor y = scale(w, 6);
      loss = sum(y);
    }
    busy(current(dev), kBacklog);
    EBB_REQUIRE_OK(backward({loss}));
    EBB_CHECK_CLOSE(grad_seen(w), std::vector<double>(v.size(), 6.0), 1e-12, 0);
  });
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: several producers on different streams into one input are all waited for",
          "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  check_each_mode_and_device(scenario_accumulate);
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: after ebb_backward returns, work on the caller's current stream sees .grad",
          "[autograd][devices][streams]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  check_each_mode_and_device(scenario_leaf_sync);
  // Over two devices, each device's caller stream waits for its own leaves.
  Stream s0(0), s1(1), c0(0), c1(1);
  PingPong g(s0, s1, 5);
  busy(s0, kBacklog);
  busy(s1, kBacklog);
  OnStream o0(c0);
  OnStream o1(c1);
  EBB_REQUIRE_OK(backward({g.loss}));
  EBB_CHECK_CLOSE(grad_seen(g.w0), g.want0(), 1e-9, 1e-12);
  EBB_CHECK_CLOSE(grad_seen(g.w1), g.want1(), 1e-9, 1e-12);
}

TEST_CASE("engine devices: after ebb_backward returns, work on the caller's current stream sees a retained non-leaf's .grad",
          "[autograd][devices][streams][retain]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  // Two devices: the calling thread's path and the workers' (what AUTO picks here).
  check_tries_each(scenario_retain_sync, {EBB_ENGINE_CALLING_THREAD, EBB_ENGINE_WORKERS});
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: a second backward adds into a retained .grad after its last write on another stream",
          "[autograd][devices][streams][retain]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  // One device: the calling thread's path (AUTO) and a worker's.
  check_tries_each(scenario_retain_twice, {EBB_ENGINE_AUTO, EBB_ENGINE_WORKERS});
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- 2. a forward that moved tensors between devices ------------------------------------------------

TEST_CASE("engine devices: a forward moving tensors 0 to 1 and back gets right gradients on both devices, with no device-wide sync",
          "[autograd][devices][multi]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_CALLING_THREAD, EBB_ENGINE_WORKERS}) {
    INFO("mode " << mode);
    EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
    Stream s0(0), s1(1), u0(0), u1(1);
    PingPong g(s0, s1, (int)mode);
    // Work unrelated to the backward holds u0 and u1 until the backward has returned: a
    // device-wide sync in the engine would wait for it (and break the gate after 30 s).
    Gate gate0, gate1;
    EBB_REQUIRE_OK(ebb_stream_host_func(u0, Gate::fn, &gate0));
    EBB_REQUIRE_OK(ebb_stream_host_func(u1, Gate::fn, &gate1));
    busy(s0, kBacklog / 2);
    busy(s1, kBacklog / 2);
    ebb_status st = backward({g.loss});
    gate0.open.store(1, std::memory_order_release);
    gate1.open.store(1, std::memory_order_release);
    EBB_REQUIRE_OK(ebb_stream_synchronize(u0));
    EBB_REQUIRE_OK(ebb_stream_synchronize(u1));
    INFO("ebb_backward: " << ebb_last_error());
    REQUIRE(st == EBB_OK);
    CHECK(gate0.broke.load() == 0);  // the backward returned while device 0 had unrelated work pending
    CHECK(gate1.broke.load() == 0);
    EBB_CHECK_CLOSE(grad_seen(g.w0), g.want0(), 1e-9, 1e-12);
    EBB_CHECK_CLOSE(grad_seen(g.w1), g.want1(), 1e-9, 1e-12);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("engine devices: gradients summed across devices (a device-1 producer into a device-0 input) are right",
          "[autograd][devices][multi]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  // a (dev 0, s0) feeds a product on device 0 (stream s0b) and, moved, one on device 1 (s1,
  // slow): a's input gets one gradient from each device, the one from device 1 through the copy.
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_CALLING_THREAD}) {
    INFO("mode " << mode);
    EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
    Stream s0(0), s0b(0), s1(1);
    auto v = vals(6);
    Tensor w = leaf(0, v, "w"), a, p0, l0, p1, l1;
    sync_all();
    {
      OnStream g(s0);
      a = scale(w, 2);
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(s0b, s0));
    {
      OnStream g(s0b);
      p0 = scale(a, 3);
      l0 = sum(p0);
    }
    {
      OnStream g0(s0);
      OnStream g1(s1);
      Tensor a1 = to_dev(a, 1);
      p1 = scale(a1, 7);
      l1 = sum(p1);
    }
    busy(s1, kBacklog);
    EBB_REQUIRE_OK(backward({l0, l1}));
    EBB_CHECK_CLOSE(grad_seen(w), std::vector<double>(v.size(), 2.0 * (3 + 7)), 1e-12, 0);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- 3. each wait is needed ---------------------------------------------------------------------------

TEST_CASE("engine devices: without the consumer's wait a gradient crossing streams reads stale data",
          "[autograd][devices][proof]") {
  prove_wait(scenario_cross_stream, "a gradient crossing streams");
}

TEST_CASE("engine devices: without the consumer's wait the root's gradient reads stale data", "[autograd][devices][proof]") {
  prove_wait(scenario_root_grad, "the root's gradient on the caller's stream");
}

TEST_CASE("engine devices: without the accumulation stream's waits several producers sum stale data",
          "[autograd][devices][proof]") {
  prove_wait(scenario_accumulate, "two producers into one input");
}

TEST_CASE("engine devices: without the leaf streams' sync the caller's stream reads .grad too early",
          "[autograd][devices][proof]") {
  prove_wait(scenario_leaf_sync, "the caller's stream after backward");
}

TEST_CASE("engine devices: without the leaf streams' sync the caller's stream reads a retained non-leaf's .grad too early",
          "[autograd][devices][proof][retain]") {
  prove_wait(scenario_retain_sync, "the caller's stream after backward, a retained non-leaf's .grad");
}

// ---- 4. events ------------------------------------------------------------------------------------------

TEST_CASE("engine devices: no event on a graph all on one stream, one per cross-stream edge, at most one per producer plus one when summing",
          "[autograd][devices][events]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  EBB_CHECK_FAILS(ebb_autograd_get_engine_stats(nullptr), EBB_EINVAL, "ebb_autograd_get_engine_stats");

  SECTION("one stream") {
    // Everything on one side stream, the caller on it too: a leaf used twice (its input summed)
    // and a chain; then the same on the default stream.
    for (int side : {1, 0}) {
      INFO((side ? "a side stream" : "the default stream"));
      Stream s(0);
      ebb_stream_t *on = side ? s.s : current(0);
      auto v = vals(1);
      Tensor w = leaf(0, v), loss;
      sync_all();
      OnStream g(on);
      Tensor a = mul(w, w), b = scale(a, 3), c = mul(b, w);
      loss = sum(c);  // sum(3 w^3)
      Stats before = stats();
      EBB_REQUIRE_OK(backward({loss}));
      Stats after = stats();
      CHECK(after.backward_calls == before.backward_calls + 1);
      CHECK(after.nodes_run > before.nodes_run);
      CHECK(after.events_recorded == before.events_recorded);
      CHECK(after.stream_waits == before.stream_waits);
      CHECK(after.cross_stream_edges == before.cross_stream_edges);
      std::vector<double> want(v.size());
      for (size_t i = 0; i < v.size(); i++) want[i] = 9 * v[i] * v[i];
      EBB_CHECK_CLOSE(grad_seen(w), want, 1e-9, 1e-12);
    }
  }

  SECTION("a chain whose every edge crosses streams") {
    // o1..o7 alternate sA, sB (o1, o7 and the loss on sA; the caller on sA too): the six edges
    // between them cross streams, nothing else does.
    Stream sA(0), sB(0);
    auto v = vals(2);
    Tensor w = leaf(0, v), loss;
    sync_all();
    std::vector<Tensor> ys;
    const int k = 7;
    for (int i = 0; i < k; i++) {
      ebb_stream_t *s = i % 2 == 0 ? sA.s : sB.s;
      if (i > 0) EBB_REQUIRE_OK(ebb_stream_wait_stream(s, i % 2 == 0 ? sB.s : sA.s));
      OnStream g(s);
      ys.push_back(scale(i == 0 ? w.get() : ys.back().get(), 2));
    }
    {
      OnStream g(sA);
      loss = sum(ys.back());
    }
    busy(sB, kBacklog);
    OnStream g(sA);
    Stats before = stats();
    EBB_REQUIRE_OK(backward({loss}));
    Stats after = stats();
    CHECK(after.cross_stream_edges - before.cross_stream_edges == (uint64_t)(k - 1));
    CHECK(after.events_recorded - before.events_recorded == (uint64_t)(k - 1));
    CHECK(after.stream_waits - before.stream_waits == (uint64_t)(k - 1));
    EBB_CHECK_CLOSE(grad_seen(w), std::vector<double>(v.size(), 128.0), 1e-12, 0);
  }

  SECTION("three producers on three streams into one input") {
    // a = w * 2 on sc; p_i = a * k_i on s_i, each its own root l_i; the caller on sc. Root
    // hand-offs: 3 cross-stream edges (one event each at most); a's input: 3 producers summed
    // on sc (one event each at most, plus one to the consumer); no leaf sync (leaf on sc).
    Stream sc(0), s1(0), s2(0), s3(0);
    auto v = vals(3);
    Tensor w = leaf(0, v), a;
    sync_all();
    {
      OnStream g(sc);
      a = scale(w, 2);
    }
    std::vector<Tensor> ps, ls;
    ebb_stream_t *ss[3] = {s1, s2, s3};
    for (int i = 0; i < 3; i++) {
      EBB_REQUIRE_OK(ebb_stream_wait_stream(ss[i], sc));
      OnStream g(ss[i]);
      ps.push_back(scale(a, 3 + i));
      ls.push_back(sum(ps.back()));
    }
    busy(s2, kBacklog);
    OnStream g(sc);
    Stats before = stats();
    EBB_REQUIRE_OK(backward({ls[0], ls[1], ls[2]}));
    Stats after = stats();
    uint64_t events = after.events_recorded - before.events_recorded;
    INFO("events " << events << ", cross-stream edges " << after.cross_stream_edges - before.cross_stream_edges
                   << ", waits " << after.stream_waits - before.stream_waits);
    CHECK(events >= 3);           // the summing stream waits for each of three other streams
    CHECK(events <= 3 + 3 + 1);   // root hand-offs + one per producer + one to the consumer
    CHECK(after.stream_waits - before.stream_waits >= 3);
    EBB_CHECK_CLOSE(grad_seen(w), std::vector<double>(v.size(), 2.0 * (3 + 4 + 5)), 1e-12, 0);
  }
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- 5. the AccumulateGrad stream mismatch ------------------------------------------------------------

namespace {

// The warm-up: w's AccumulateGrad made by a forward on s0 and kept alive by that graph (its loss
// kept); then each step's forward on s1 (MulScalarBackward, the producer) and backward with the
// caller on s1.
struct WarmUp {
  Tensor w, warm_loss;
  std::vector<double> v;
  WarmUp(int dev, const char *name) {
    v = vals(9);
    w = leaf(dev, v, name);
    sync_all();
  }
  void warm(ebb_stream_t *s0) {
    OnStream g(s0);
    Tensor y = scale(w, 2);
    warm_loss = sum(y);
  }
  // One step on s: forward, backward with the caller on s.
  ebb_status step(ebb_stream_t *s, double k = 3) {
    OnStream g(s);
    Tensor y = scale(w, k), loss = sum(y);
    return backward({loss});
  }
};

}  // namespace

TEST_CASE("engine devices: a kept-alive AccumulateGrad from a warm-up on another stream warns once per leaf and stream pair",
          "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  REQUIRE(ebb_autograd_warn_on_accumulate_grad_stream_mismatch());  // on by default
  REQUIRE_FALSE(ebb_autograd_accumulate_grad_follows_producer());   // off by default
  Stream s0(0), s1(0), s2(0);
  WarmUp wu(0, "warm_weight");
  wu.warm(s0);
  const ebb_node_t *acc = nullptr;
  {
    ebb_gradient_edge e;
    EBB_REQUIRE_OK(ebb_tensor_gradient_edge(wu.w, &e));
    acc = e.node;
    EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  }
  REQUIRE(node_stream(acc) == s0.id());
  busy(s1, kBacklog);
  Stats before = stats();
  EBB_REQUIRE_OK(wu.step(s1));
  Stats after = stats();
  auto msgs = warn.take();
  REQUIRE(msgs.size() == 1);
  const std::string &m = msgs[0];
  INFO("warning: " << m);
  CHECK(m.find("warm_weight") != std::string::npos);
  CHECK(has_number(m, s0.id()));
  CHECK(has_number(m, s1.id()));
  CHECK(m.find("MulScalarBackward") != std::string::npos);
  CHECK(lower(m).find("graph") != std::string::npos);  // what keeps it alive: an earlier graph's nodes
  CHECK(after.accumulate_grad_stream_mismatches - before.accumulate_grad_stream_mismatches == 1);
  CHECK(after.accumulate_grad_warnings - before.accumulate_grad_warnings == 1);
  CHECK(after.accumulate_grad_followed == before.accumulate_grad_followed);
  CHECK(after.stream_waits > before.stream_waits);  // the accumulator's stream waits for the producer's
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
  }
  // The same pair again: counted, not warned.
  before = stats();
  busy(s1, kBacklog);
  EBB_REQUIRE_OK(wu.step(s1));
  after = stats();
  CHECK(warn.count() == 1);
  CHECK(after.accumulate_grad_stream_mismatches - before.accumulate_grad_stream_mismatches == 1);
  CHECK(after.accumulate_grad_warnings == before.accumulate_grad_warnings);
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 6.0), 1e-12, 0);
  }
  // Another pair (s0, s2): a new warning.
  EBB_REQUIRE_OK(wu.step(s2));
  msgs = warn.take();
  REQUIRE(msgs.size() == 2);
  CHECK(has_number(msgs[1], s2.id()));
  CHECK(stats().accumulate_grad_warnings - before.accumulate_grad_warnings == 1);
  REQUIRE(node_stream(acc) == s0.id());  // the default policy leaves the accumulator where it was
  wu.warm_loss.reset();
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: an AccumulateGrad kept by a stashed gradient edge warns, naming the edge",
          "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  Stream s0(0), s1(0);
  WarmUp wu(0, "stashed_weight");
  ebb_gradient_edge e;
  {
    OnStream g(s0);
    EBB_REQUIRE_OK(ebb_tensor_gradient_edge(wu.w, &e));  // the accumulator made on s0 and stashed
  }
  REQUIRE(node_stream(e.node) == s0.id());
  Stats before = stats();
  busy(s1, kBacklog);
  EBB_REQUIRE_OK(wu.step(s1));
  Stats after = stats();
  auto msgs = warn.take();
  REQUIRE(msgs.size() == 1);
  INFO("warning: " << msgs[0]);
  CHECK(msgs[0].find("stashed_weight") != std::string::npos);
  CHECK(has_number(msgs[0], s0.id()));
  CHECK(has_number(msgs[0], s1.id()));
  CHECK(lower(msgs[0]).find("edge") != std::string::npos);  // what keeps it alive: a gradient-edge handle
  CHECK(after.accumulate_grad_stream_mismatches - before.accumulate_grad_stream_mismatches == 1);
  CHECK(after.accumulate_grad_warnings - before.accumulate_grad_warnings == 1);
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
  }
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: no AccumulateGrad warning when the streams agree, nor for CPU tensors",
          "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  Stream s0(0), s1(0);
  Stats before = stats();
  {
    // Forward and backward on s1; the graph goes; then forward on s0 and backward with the
    // caller on the default stream: a new accumulator, made on s0, which is the producer's.
    WarmUp wu(0, "agreeing_weight");
    EBB_REQUIRE_OK(wu.step(s1));
    CHECK(ebb_autograd_live_nodes() == 0);  // nothing kept the accumulator
    Tensor loss;
    {
      OnStream g(s0);
      Tensor y = scale(wu.w, 5);
      loss = sum(y);
    }
    REQUIRE(node_stream(next_of(next_of(grad_fn(loss), 0), 0)) == s0.id());
    busy(s0, kBacklog);
    EBB_REQUIRE_OK(backward({loss}));
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 8.0), 1e-12, 0);
  }
  {
    // The warm-up scenario on CPU tensors (side streams current on device 0 all the while).
    WarmUp wu(EBB_DEVICE_CPU, "cpu_weight");
    wu.warm(s0);
    EBB_REQUIRE_OK(wu.step(s1));
    EBB_REQUIRE_OK(wu.step(s1));
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 6.0), 1e-12, 0);
  }
  Stats after = stats();
  auto msgs = warn.take();
  INFO((msgs.empty() ? std::string() : msgs[0]));
  CHECK(msgs.empty());
  CHECK(after.accumulate_grad_stream_mismatches == before.accumulate_grad_stream_mismatches);
  CHECK(after.accumulate_grad_warnings == before.accumulate_grad_warnings);
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

// A leaf on device 1 used on device 0 through ebb_tensor_to_device: its gradient is made on a
// device 0 stream (ToDeviceBackward's) and must cross to device 1, where the accumulator runs,
// whatever stream that has. That hand-off is no stale accumulator and no follow-producer case:
// no warning, no mismatch counted, the gradient right. The same leaf with a kept-alive warm-up
// accumulator on device 1 and a producer on another device 1 stream still warns.
TEST_CASE("engine devices: no AccumulateGrad warning for a leaf whose gradient comes from another device",
          "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  for (bool follow : {false, true}) {
    INFO("follow-producer " << follow);
    ebb_autograd_set_accumulate_grad_follows_producer(follow);
    Stream s1(1);
    WarmUp wu(1, "remote_weight");
    Stats before = stats();
    Tensor loss;
    {
      OnStream g(s1);  // the accumulator is made on s1 (the forward's stream on device 1)
      Tensor w0 = to_dev(wu.w, 0);
      Tensor y = scale(w0, 3);
      loss = sum(y);
    }
    const ebb_node_t *acc = next_of(next_of(next_of(grad_fn(loss), 0), 0), 0);
    REQUIRE(std::string(ebb_node_name(next_of(next_of(grad_fn(loss), 0), 0))) == "ToDeviceBackward");
    REQUIRE(std::string(ebb_node_name(acc)) == "AccumulateGrad");
    REQUIRE(node_stream(acc) == s1.id());
    busy(current(0), kBacklog);
    EBB_REQUIRE_OK(backward({loss}));
    Stats after = stats();
    auto msgs = warn.take();
    INFO((msgs.empty() ? std::string() : msgs[0]));
    CHECK(msgs.empty());
    CHECK(after.accumulate_grad_stream_mismatches == before.accumulate_grad_stream_mismatches);
    CHECK(after.accumulate_grad_warnings == before.accumulate_grad_warnings);
    CHECK(after.accumulate_grad_followed == before.accumulate_grad_followed);
    CHECK(after.cross_stream_edges > before.cross_stream_edges);  // the hand-off is still made
    CHECK(node_stream(acc) == s1.id());                            // and the accumulator stays
    {
      OnStream g(s1);
      EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
    }
    loss.reset();
    sync_all();
    CHECK(ebb_autograd_live_nodes() == 0);
  }
  ebb_autograd_set_accumulate_grad_follows_producer(false);
  // On one device the mismatch is still warned about: a warm-up accumulator on s0 of device 1,
  // kept alive, and a step on s1 of device 1.
  Stream s0(1), s1(1);
  WarmUp wu(1, "local_weight");
  wu.warm(s0);
  Stats before = stats();
  busy(s1, kBacklog);
  EBB_REQUIRE_OK(wu.step(s1));
  Stats after = stats();
  auto msgs = warn.take();
  REQUIRE(msgs.size() == 1);
  INFO("warning: " << msgs[0]);
  CHECK(msgs[0].find("local_weight") != std::string::npos);
  CHECK(has_number(msgs[0], s0.id()));
  CHECK(has_number(msgs[0], s1.id()));
  CHECK(after.accumulate_grad_stream_mismatches - before.accumulate_grad_stream_mismatches == 1);
  CHECK(after.accumulate_grad_warnings - before.accumulate_grad_warnings == 1);
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
  }
  wu.warm_loss.reset();
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: with the mismatch warning off a mismatch is counted but not warned", "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(false);
  CHECK_FALSE(ebb_autograd_warn_on_accumulate_grad_stream_mismatch());
  Stream s0(0), s1(0);
  WarmUp wu(0, "quiet_weight");
  wu.warm(s0);
  Stats before = stats();
  busy(s1, kBacklog);
  EBB_REQUIRE_OK(wu.step(s1));
  Stats after = stats();
  CHECK(warn.count() == 0);
  CHECK(after.accumulate_grad_stream_mismatches - before.accumulate_grad_stream_mismatches == 1);
  CHECK(after.accumulate_grad_warnings == before.accumulate_grad_warnings);
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
  }
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(true);
  CHECK(ebb_autograd_warn_on_accumulate_grad_stream_mismatch());
  // On again: this pair was never warned about, so it is now.
  EBB_REQUIRE_OK(wu.step(s1));
  CHECK(warn.count() == 1);
  wu.warm_loss.reset();
  sync_all();
}

TEST_CASE("engine devices: with follow-producer the accumulator moves to the producer's stream, no wait and no warning",
          "[autograd][devices][accumulate]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  ebb_autograd_set_accumulate_grad_follows_producer(true);
  CHECK(ebb_autograd_accumulate_grad_follows_producer());
  Stream s0(0), s1(0);
  WarmUp wu(0, "following_weight");
  wu.warm(s0);
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(wu.w, &e));  // to read the accumulator's stream (kept already)
  REQUIRE(node_stream(e.node) == s0.id());
  busy(s1, kBacklog);
  Stats before = stats();
  EBB_REQUIRE_OK(wu.step(s1));
  Stats after = stats();
  CHECK(warn.count() == 0);
  CHECK(after.accumulate_grad_followed - before.accumulate_grad_followed == 1);
  CHECK(after.accumulate_grad_warnings == before.accumulate_grad_warnings);
  CHECK(after.stream_waits == before.stream_waits);  // root, producer, accumulator and caller all on s1
  CHECK(node_stream(e.node) == s1.id());
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 3.0), 1e-12, 0);
  }
  // The next step: the accumulator stays on s1, nothing to follow, wait or warn about.
  before = stats();
  busy(s1, kBacklog);
  EBB_REQUIRE_OK(wu.step(s1));
  after = stats();
  CHECK(warn.count() == 0);
  CHECK(after.accumulate_grad_followed == before.accumulate_grad_followed);
  CHECK(after.stream_waits == before.stream_waits);
  CHECK(after.accumulate_grad_stream_mismatches == before.accumulate_grad_stream_mismatches);
  {
    OnStream g(s1);
    EBB_CHECK_CLOSE(grad_seen(wu.w), std::vector<double>(wu.v.size(), 6.0), 1e-12, 0);
  }
  ebb_autograd_set_accumulate_grad_follows_producer(false);
  CHECK_FALSE(ebb_autograd_accumulate_grad_follows_producer());
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  wu.warm_loss.reset();
  sync_all();
}

namespace {

// The AccumulateGrad of leaf w (kept alive by a graph the caller holds).
const ebb_node_t *acc_of(const ebb_tensor_t *w) {
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(w, &e));
  const ebb_node_t *n = e.node;
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  return n;
}

}  // namespace

TEST_CASE("engine devices: follow-producer moving an accumulator to another stream orders the move after .grad's pending writes",
          "[autograd][devices][accumulate]") {
  // The warm-up ran a backward on s0 (behind a backlog there): .grad is written on s0, late. The
  // accumulator, kept alive, then follows the producer to s1. Its first add into .grad on s1 must
  // come after s0's write of .grad, as it did on s0 without the policy; the user never touched
  // .grad on s1, so ordering it is the engine's job.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(false);
  for (bool follow : {false, true}) {
    INFO("follow-producer " << follow);
    ebb_autograd_set_accumulate_grad_follows_producer(false);
    Stream s0(0), s1(0), s2(0);
    auto v = vals(follow ? 2 : 1);
    Tensor w = leaf(0, v), warm_loss;
    sync_all();
    {
      OnStream g(s0);
      Tensor y = scale(w, 2);
      warm_loss = sum(y);
      busy(s0, kBacklog);
      EBB_REQUIRE_OK(backward({warm_loss}, {}, true));  // .grad = 2, written on s0 behind the backlog
    }
    const ebb_node_t *acc = acc_of(w);
    REQUIRE(node_stream(acc) == s0.id());
    ebb_autograd_set_accumulate_grad_follows_producer(follow);
    Stats before = stats();
    {
      OnStream g(s1);
      Tensor y = scale(w, 3), loss = sum(y);
      EBB_REQUIRE_OK(backward({loss}));
      CHECK(grad_seen(w) == std::vector<double>(v.size(), 5.0));
    }
    CHECK(stats().accumulate_grad_followed - before.accumulate_grad_followed == (follow ? 1u : 0u));
    CHECK(node_stream(acc) == (follow ? s1.id() : s0.id()));
    // And again from s2, behind a backlog on s1 (where the last add into .grad was made when
    // following): the next move waits for s1 too.
    busy(s1, kBacklog);
    {
      OnStream g(s2);
      Tensor y = scale(w, 4), loss = sum(y);
      EBB_REQUIRE_OK(backward({loss}));
      CHECK(grad_seen(w) == std::vector<double>(v.size(), 9.0));
    }
    CHECK(node_stream(acc) == (follow ? s2.id() : s0.id()));
    warm_loss.reset();
    sync_all();
  }
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: an accumulator whose recorded stream was released: the warning says so, follow-producer moves it",
          "[autograd][devices][accumulate]") {
  // The accumulator was made on a stream since released: it runs on the caller's current stream
  // (the header's rule). The mismatch warning names that, not "the stream current when it was
  // made"; with follow-producer, a producer on another stream takes it over, for this backward
  // and the next ones, as for a live stream.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;
  Stream s1(0);
  auto v = vals(3);
  Tensor w = leaf(0, v), warm_loss;
  sync_all();
  uint64_t gone = 0;
  {
    Stream tmp(0);
    gone = tmp.id();
    OnStream g(tmp);
    Tensor y = scale(w, 2);
    warm_loss = sum(y);
    EBB_REQUIRE_OK(ebb_stream_synchronize(tmp));
  }
  const ebb_node_t *acc = acc_of(w);
  REQUIRE(node_stream(acc) == gone);
  uint64_t caller = sid(current(0));
  // One step, the producer on s1, the caller on its default stream: the accumulator runs there.
  auto step = [&] {
    Tensor loss;
    {
      OnStream g(s1);
      Tensor y = scale(w, 3);
      loss = sum(y);
    }
    EBB_REQUIRE_OK(backward({loss}));
  };
  step();
  auto msgs = warn.take();
  REQUIRE(msgs.size() == 1);
  INFO("warning: " << msgs[0]);
  CHECK(has_number(msgs[0], caller));
  CHECK(has_number(msgs[0], gone));
  CHECK(has_number(msgs[0], s1.id()));
  CHECK(msgs[0].find("released") != std::string::npos);
  CHECK(msgs[0].find("the stream current when it was made") == std::string::npos);
  CHECK(node_stream(acc) == gone);
  ebb_autograd_set_accumulate_grad_follows_producer(true);
  Stats before = stats();
  step();
  Stats after = stats();
  CHECK(after.accumulate_grad_followed - before.accumulate_grad_followed == 1);
  CHECK(node_stream(acc) == s1.id());
  CHECK(warn.count() == 1);
  CHECK(grad_seen(w) == std::vector<double>(v.size(), 6.0));
  warm_loss.reset();
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: ebb_node_input_meta on an accumulator that follow-producer moves on another thread reads one stream or the other",
          "[autograd][devices][accumulate][threads]") {
  // The move happens under the engine's lock for node streams, and the Node API reads the stream
  // id under it too (without it: a data race, which TSan reports). A reader on one thread, backward calls moving
  // the accumulator between s1 and s2 on another.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(false);
  ebb_autograd_set_accumulate_grad_follows_producer(true);
  Stream s0(0), s1(0), s2(0);
  const uint64_t ids[3] = {s0.id(), s1.id(), s2.id()};
  Tensor w = leaf(0, vals(4)), warm_loss;
  sync_all();
  {
    OnStream g(s0);
    Tensor y = scale(w, 2);
    warm_loss = sum(y);  // keeps the accumulator, made on s0
  }
  const ebb_node_t *acc = acc_of(w);
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, strange{0};
  std::thread reader([&] {
    while (!stop.load(std::memory_order_acquire)) {
      ebb_node_input_info info;
      if (ebb_node_input_meta(acc, 0, &info) != EBB_OK || (info.stream_id != ids[0] && info.stream_id != ids[1] && info.stream_id != ids[2]))
        strange++;
      reads++;
      std::this_thread::yield();
    }
  });
  const int steps = kSanitized ? 10 : 40;
  Stats before = stats();
  while (reads.load() == 0) std::this_thread::yield(); /* (a loaded machine may start the reader late) */
  for (int i = 0; i < steps; i++) {
    OnStream g(i % 2 ? s2 : s1);
    Tensor y = scale(w, 1), loss = sum(y);
    EBB_REQUIRE_OK(backward({loss}));
  }
  stop.store(true, std::memory_order_release);
  reader.join();
  CHECK(stats().accumulate_grad_followed - before.accumulate_grad_followed == (uint64_t)steps);
  CHECK(strange.load() == 0);
  CHECK(reads.load() > 0);
  CHECK(node_stream(acc) == ids[steps % 2 ? 1 : 2]);
  sync_all();  // (.grad was last written on s1 or s2, which this thread's current stream did not wait for)
  CHECK(grad_seen(w) == std::vector<double>(8, (double)steps));
  warm_loss.reset();
  sync_all();
}

// ---- 6. engine modes and settings --------------------------------------------------------------------

namespace {

struct ModeRun {
  std::vector<double> g0, g1;
  uint64_t on_workers = 0;
  std::set<std::thread::id> threads;
};

// w0 (dev 0) and w1 (dev d1), side streams, loss = sum((2 w0)' * w1 * w1) with the first factor
// moved to d1; hooks record the threads nodes run on.
ModeRun run_graph(int d1, int t) {
  ModeRun r;
  Stream s0(0), s1(d1);
  auto v0 = vals(t), v1 = vals(t + 1);
  Tensor w0 = leaf(0, v0), w1 = leaf(d1, v1), loss;
  sync_all();
  {
    OnStream g0(s0);
    OnStream g1(s1);
    Tensor a = scale(w0, 2), a1 = to_dev(a, d1), b = mul(a1, w1), c = mul(b, w1);
    loss = sum(c);
  }
  Probe probe;
  probe_graph({loss}, &probe);
  busy(s0, kBacklog / 4);
  Stats before = stats();
  EBB_REQUIRE_OK(backward({loss}));
  r.on_workers = stats().nodes_run_on_workers - before.nodes_run_on_workers;
  {
    std::lock_guard<std::mutex> l(probe.mu);
    for (auto &kv : probe.threads) r.threads.insert(kv.second.begin(), kv.second.end());
    std::string all;
    for (auto &w : probe.wrong) all += w + "\n";
    INFO(all);
    CHECK(probe.wrong.empty());
  }
  r.g0 = grad_seen(w0);
  r.g1 = grad_seen(w1);
  std::vector<double> want0(v0.size()), want1(v0.size());
  for (size_t i = 0; i < v0.size(); i++) {
    want0[i] = 2 * v1[i] * v1[i];
    want1[i] = 4 * v0[i] * v1[i];
  }
  EBB_CHECK_CLOSE(r.g0, want0, 1e-9, 1e-12);
  EBB_CHECK_CLOSE(r.g1, want1, 1e-9, 1e-12);
  return r;
}

}  // namespace

TEST_CASE("engine devices: engine modes choose the calling thread or the device workers", "[autograd][devices][modes]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  CHECK(ebb_autograd_engine_mode() == EBB_ENGINE_AUTO);
  auto me = std::this_thread::get_id();
  // One device: AUTO stays on the calling thread; WORKERS hands the nodes to device 0's worker,
  // with the same gradients.
  ModeRun autorun = run_graph(0, 1);
  CHECK(autorun.on_workers == 0);
  CHECK(autorun.threads == std::set<std::thread::id>{me});
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
  CHECK(ebb_autograd_engine_mode() == EBB_ENGINE_WORKERS);
  ModeRun workers = run_graph(0, 1);
  CHECK(workers.on_workers > 0);
  CHECK(workers.threads.count(me) == 0);
  CHECK(workers.g0 == autorun.g0);
  CHECK(workers.g1 == autorun.g1);
  // Two devices: AUTO uses the workers; CALLING_THREAD runs everything on the caller.
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_AUTO));
  ModeRun two_auto = run_graph(1, 2);
  CHECK(two_auto.on_workers > 0);
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_CALLING_THREAD));
  ModeRun two_calling = run_graph(1, 2);
  CHECK(two_calling.on_workers == 0);
  CHECK(two_calling.threads == std::set<std::thread::id>{me});
  CHECK(two_calling.g0 == two_auto.g0);
  CHECK(two_calling.g1 == two_auto.g1);
  // Bad values leave the settings as they were.
  EBB_CHECK_FAILS(ebb_autograd_set_engine_mode(static_cast<ebb_engine_mode>(3)), EBB_EINVAL, "ebb_autograd_set_engine_mode");
  CHECK(ebb_autograd_engine_mode() == EBB_ENGINE_CALLING_THREAD);
  CHECK(ebb_autograd_max_reentrant_depth() == 60);  // the default
  EBB_CHECK_FAILS(ebb_autograd_set_max_reentrant_depth(0), EBB_EINVAL, "ebb_autograd_set_max_reentrant_depth");
  EBB_CHECK_FAILS(ebb_autograd_set_max_reentrant_depth(100000), EBB_EINVAL, "ebb_autograd_set_max_reentrant_depth");
  EBB_CHECK_FAILS(ebb_autograd_set_max_reentrant_depth(1025), EBB_EINVAL, "ebb_autograd_set_max_reentrant_depth");
  EBB_CHECK_FAILS(ebb_autograd_set_max_reentrant_depth(-1), EBB_EINVAL, "ebb_autograd_set_max_reentrant_depth");
  CHECK(ebb_autograd_max_reentrant_depth() == 60);
  EBB_REQUIRE_OK(ebb_autograd_set_max_reentrant_depth(1));
  CHECK(ebb_autograd_max_reentrant_depth() == 1);
  EBB_REQUIRE_OK(ebb_autograd_set_max_reentrant_depth(1024));
  CHECK(ebb_autograd_max_reentrant_depth() == 1024);
  sync_all();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- 7. several devices at once ------------------------------------------------------------------

TEST_CASE("engine devices: one backward over two branches, each with its own loss on its device, and a CPU branch",
          "[autograd][devices][multi]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Stream s0(0), s1(1);
  auto v0 = vals(1), v1 = vals(2), vc = vals(3);
  Tensor w0 = leaf(0, v0), w1 = leaf(1, v1), wc = leaf(EBB_DEVICE_CPU, vc), l0, l1, lc;
  sync_all();
  {
    OnStream g0(s0);
    OnStream g1(s1);
    Tensor a0 = mul(w0, w0), b0 = scale(a0, 3);
    l0 = sum(b0);  // sum(3 w0^2) on device 0
    Tensor a1 = mul(w1, w1), b1 = mul(a1, w1);
    l1 = sum(b1);  // sum(w1^3) on device 1
    Tensor ac = scale(wc, 5);
    lc = sum(ac);  // on the CPU
  }
  Probe probe;
  probe_graph({l0, l1, lc}, &probe);
  busy(s0, kBacklog / 2);
  busy(s1, kBacklog / 2);
  Stats before = stats();
  EBB_REQUIRE_OK(backward({l0, l1, lc}));
  Stats after = stats();
  CHECK(after.nodes_run_on_workers > before.nodes_run_on_workers);
  CHECK(after.backward_calls == before.backward_calls + 1);
  {
    std::lock_guard<std::mutex> l(probe.mu);
    std::string all;
    for (auto &w : probe.wrong) all += w + "\n";
    INFO(all);
    CHECK(probe.wrong.empty());
    auto me = std::this_thread::get_id();
    // Each device's nodes on that device's worker; the CPU's on the calling thread.
    CHECK(probe.threads[0].size() == 1);
    CHECK(probe.threads[1].size() == 1);
    CHECK(probe.threads[0].count(me) == 0);
    CHECK(probe.threads[1].count(me) == 0);
    CHECK(probe.threads[0] != probe.threads[1]);
    CHECK(probe.threads[EBB_DEVICE_CPU] == std::set<std::thread::id>{me});
  }
  std::vector<double> want0(v0.size()), want1(v0.size());
  for (size_t i = 0; i < v0.size(); i++) {
    want0[i] = 6 * v0[i];
    want1[i] = 3 * v1[i] * v1[i];
  }
  EBB_CHECK_CLOSE(grad_seen(w0), want0, 1e-9, 1e-12);
  EBB_CHECK_CLOSE(grad_seen(w1), want1, 1e-9, 1e-12);
  EBB_CHECK_CLOSE(grad_seen(wc), std::vector<double>(vc.size(), 5.0), 1e-12, 0);
  sync_all();
}

TEST_CASE("engine devices: concurrent multi-device backward calls from four threads sharing leaves sum exactly",
          "[autograd][devices][threads]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Warnings warn;  // threads on different pool streams share the leaves' accumulators: mismatches are expected
  const int nthreads = 4, iters = std::max(2, 12 / kSanitizerScale);
  std::vector<double> v0 = {1, 2, 3, -1, 0.5, 4, -2, 1.5}, v1 = {2, -1, 0.5, 3, 1, -2, 1, 0.25};
  Tensor w0 = leaf(0, v0, "shared0"), w1 = leaf(1, v1, "shared1");
  sync_all();
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_error;
  std::vector<std::thread> ts;
  for (int th = 0; th < nthreads; th++)
    ts.emplace_back([&, th] {
      auto fail = [&](const char *what) {
        std::lock_guard<std::mutex> l(mu);
        if (first_error.empty()) first_error = std::string(what) + ": " + ebb_last_error();
        failures++;
      };
      ebb_stream_t *p0 = nullptr, *p1 = nullptr;
      if (ebb_stream_from_pool(0, EBB_PRIO_LOW, &p0) || ebb_stream_from_pool(1, EBB_PRIO_LOW, &p1)) return fail("pool");
      ebb_stream_guard g0, g1;
      if (ebb_stream_guard_enter(&g0, p0)) return fail("guard 0");
      if (ebb_stream_guard_enter(&g1, p1)) return fail("guard 1");
      for (int it = 0; it < iters; it++) {
        // loss = sum(to(w0 * k, 1) * w1) + sum(w1 * k) on device 1: d/dw0 = k w1, d/dw1 = k w0 + k.
        ebb_tensor_t *a = nullptr, *a1 = nullptr, *b = nullptr, *l = nullptr, *c = nullptr, *lc = nullptr;
        double k = th + 1;
        ebb_status st = ebb_op_mul_scalar(w0, k, &a);
        if (!st) st = ebb_tensor_to_device(a, 1, &a1);
        if (!st) st = ebb_op_mul(a1, w1, &b);
        if (!st) st = ebb_op_sum(b, nullptr, 0, false, &l);
        if (!st) st = ebb_op_mul_scalar(w1, k, &c);
        if (!st) st = ebb_op_sum(c, nullptr, 0, false, &lc);
        if (!st) {
          const ebb_tensor_t *roots[2] = {l, lc};
          st = ebb_backward(roots, nullptr, 2, false, nullptr, 0);
        }
        if (st) fail("forward or backward");
        for (ebb_tensor_t *x : {a, a1, b, l, c, lc})
          if (x) ebb_tensor_release(x);
        if (st) break;
      }
      // This thread's streams waited for its leaves; the test thread reads after them.
      if (ebb_stream_synchronize(p0) || ebb_stream_synchronize(p1)) fail("synchronize");
      ebb_stream_guard_exit(&g1);
      ebb_stream_guard_exit(&g0);
    });
  for (auto &t : ts) t.join();
  INFO(first_error);
  REQUIRE(failures.load() == 0);
  double ksum = 0;
  for (int th = 0; th < nthreads; th++) ksum += th + 1;
  std::vector<double> want0(v0.size()), want1(v0.size());
  for (size_t i = 0; i < v0.size(); i++) {
    want0[i] = iters * ksum * v1[i];
    want1[i] = iters * ksum * (v0[i] + 1);
  }
  CHECK(grad_seen(w0) == want0);  // exact: every partial sum is a small dyadic number
  CHECK(grad_seen(w1) == want1);
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

// ---- 8. an error on a device worker ------------------------------------------------------------------

namespace {

// Fails with a message of ebb's own (a public call given NULL), on whatever thread it runs.
ebb_status failing_pre(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  static_cast<std::atomic<int> *>(user)->fetch_add(1);
  return ebb_tensor_set_name(nullptr, "x");
}

}  // namespace

TEST_CASE("engine devices: an error in a device-1 node's hook ends the task on both devices and names the node and device",
          "[autograd][devices][errors]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  Stream s0(0), s1(1);
  auto v0 = vals(1), v1 = vals(2);
  Tensor w0 = leaf(0, v0, "w0"), w1 = leaf(1, v1, "w1");
  sync_all();
  // Two roots: a device-0 branch (keeps device 0's worker busy) and a two-device branch whose
  // MulBackward on device 1 fails.
  auto build = [&](Tensor &l0, Tensor &l1, Tensor &c) {
    OnStream g0(s0);
    OnStream g1(s1);
    Tensor a0 = mul(w0, w0), b0 = scale(a0, 2);
    l0 = sum(b0);
    Tensor a = scale(w0, 2), a1 = to_dev(a, 1);
    c = mul(a1, w1);
    l1 = sum(c);
  };
  std::vector<std::string> expected_msg;
  {
    ebb_clear_error();
    ebb_tensor_set_name(nullptr, "x");
    expected_msg.emplace_back(ebb_last_error());  // the hook's own message, as this thread gets it
  }
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_CALLING_THREAD}) {
    INFO("mode " << mode);
    EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
    Tensor l0, l1, c;
    build(l0, l1, c);
    std::atomic<int> calls{0};
    ebb_hook_handle h;
    EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(c), failing_pre, &calls, &h));
    busy(s0, kBacklog / 4);
    ebb_clear_error();
    ebb_status st = backward({l0, l1});
    std::string msg = ebb_last_error();
    INFO("ebb_backward -> " << ebb_status_name(st) << ": " << msg);
    CHECK(st == EBB_EINVAL);  // the hook's status
    CHECK(calls.load() == 1);
    CHECK(msg.find("MulBackward") != std::string::npos);
    CHECK(msg.find("device 1") != std::string::npos);
    CHECK(msg.find(expected_msg[0]) != std::string::npos);  // the hook's message kept
    // The process and the engine go on: a fresh graph, the hook gone, backs up right.
    EBB_REQUIRE_OK(ebb_hook_remove(h));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w0, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w1, nullptr));
    Tensor m0, m1, d;
    build(m0, m1, d);
    EBB_REQUIRE_OK(backward({m0, m1}));
    std::vector<double> want0(v0.size()), want1(v0.size());
    for (size_t i = 0; i < v0.size(); i++) {
      want0[i] = 4 * v0[i] + 2 * v1[i];
      want1[i] = 2 * v0[i];
    }
    EBB_CHECK_CLOSE(grad_seen(w0), want0, 1e-9, 1e-12);
    EBB_CHECK_CLOSE(grad_seen(w1), want1, 1e-9, 1e-12);
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w0, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w1, nullptr));
  }
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);  // the failed task dropped what it held
}

namespace {

// The error hook's calls and the thread each came on (a device worker's, possibly).
struct HookLog {
  std::mutex mu;
  std::vector<std::pair<std::thread::id, std::string>> calls;
  static void fn(ebb_status, const char *m, void *user) {
    auto *l = static_cast<HookLog *>(user);
    std::lock_guard<std::mutex> g(l->mu);
    l->calls.emplace_back(std::this_thread::get_id(), m);
  }
};

// What a failing pre-hook saw: its thread, and that thread's last error when it started.
struct Refusal {
  std::mutex mu;
  std::thread::id thread;
  std::string last_error_at_entry;
  bool own_call = false;  // fail through an ebb call of its own (else return a status, no message)
};

ebb_status refusing_pre(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  auto *r = static_cast<Refusal *>(user);
  {
    std::lock_guard<std::mutex> g(r->mu);
    r->thread = std::this_thread::get_id();
    r->last_error_at_entry = ebb_last_error();
  }
  return r->own_call ? ebb_tensor_set_name(nullptr, "x") : EBB_EINVAL;
}

}  // namespace

TEST_CASE("engine devices: a node failing on a device worker is one failure, reported on the thread that called ebb_backward",
          "[autograd][devices][errors]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  const auto me = std::this_thread::get_id();
  for (ebb_engine_mode mode : {EBB_ENGINE_CALLING_THREAD, EBB_ENGINE_WORKERS})
    for (int dev : {0, 1}) {
      INFO("mode " << mode << ", device " << dev);
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
      Stream s(dev);
      Tensor w = leaf(dev, vals(dev), "w"), l, c;
      sync_all();  // w's upload (the default stream) lands before s reads it
      {
        OnStream g(s);
        Tensor a = scale(w, 2);
        c = mul(a, a);
        l = sum(c);
      }
      Refusal r;
      ebb_hook_handle h;
      EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(c), refusing_pre, &r, &h));
      HookLog log;
      ebb_set_error_hook(HookLog::fn, &log);
      // Twice: the second run's hook sees what the first left as its thread's last error.
      for (int run = 0; run < 2; run++) {
        INFO("run " << run);
        ebb_clear_error();
        {
          std::lock_guard<std::mutex> g(log.mu);
          log.calls.clear();
        }
        ebb_status st = backward({l}, {}, true);
        std::string msg = ebb_last_error();
        INFO("ebb_backward -> " << ebb_status_name(st) << ": " << msg);
        CHECK(st == EBB_EINVAL);
        CHECK(msg.find("MulBackward") != std::string::npos);
        CHECK(msg.find("device " + std::to_string(dev)) != std::string::npos);
        std::lock_guard<std::mutex> g(log.mu);
        CHECK(log.calls.size() == 1);  // one failed call (the hook's own status has no message of ebb's)
        for (auto &call : log.calls) {
          CHECK(call.first == me);
          CHECK(call.second == msg);
        }
        std::lock_guard<std::mutex> gr(r.mu);
        if (mode == EBB_ENGINE_WORKERS) {
          CHECK(r.thread != me);  // it did run on the worker
          // The engine's message is the caller's: the worker's own last error never got it.
          CHECK(r.last_error_at_entry.find("MulBackward") == std::string::npos);
        }
      }
      // A hook that fails through a call of its own: that call's failure, on the thread it ran
      // on, then the backward's, on the caller, keeping the call's message.
      r.own_call = true;
      {
        std::lock_guard<std::mutex> g(log.mu);
        log.calls.clear();
      }
      ebb_status st = backward({l});
      std::string msg = ebb_last_error();
      ebb_set_error_hook(nullptr, nullptr);
      CHECK(st == EBB_EINVAL);
      CHECK(msg.find("ebb_tensor_set_name") != std::string::npos);
      std::lock_guard<std::mutex> g(log.mu);
      CHECK(log.calls.size() == 2);
      if (log.calls.size() == 2) {
        CHECK(log.calls[0].first == r.thread);
        CHECK(log.calls[0].second.find("ebb_tensor_set_name") == 0);
        CHECK(log.calls[1].first == me);
        CHECK(log.calls[1].second == msg);
      }
      EBB_REQUIRE_OK(ebb_hook_remove(h));
      sync_all();
    }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// A device worker binds itself to its device's cores when it starts, best effort: where the OS
// refuses (a container's cpuset) or hwloc did not load, the thread stays where it is. That refusal
// is the engine's own step, not a failure of the backward that started the worker, which
// succeeds: the error hook must not hear of it (it did, on the worker thread, once per worker).
// The refusal is made certain with a synthetic hwloc topology whose second NUMA node's cores
// (64-127) this machine does not have, device 1's cores under the emulated driver's placement.
TEST_CASE("engine devices: a worker whose core binding the OS refuses leaves the error hook alone when the backward succeeds",
          "[autograd][devices][errors]") {
  struct Env {  // hwloc reads these when ebb_init loads the topology; gone for later sessions
    Env() {
      setenv("HWLOC_SYNTHETIC", "node:2 core:64 pu:1", 1);
      setenv("HWLOC_THISSYSTEM", "1", 1);
    }
    ~Env() {
      unsetenv("HWLOC_SYNTHETIC");
      unsetenv("HWLOC_THISSYSTEM");
    }
  } env;
  HookLog log;
  ebb_set_error_hook(HookLog::fn, &log);
  {
    EbbSession session;
    EBB_NEED_TIMED_DEVICES();
    EngineSettings keep;
    // The setup took: binding a thread to device 1 is refused (else there is nothing to test).
    if (ebb_thread_bind_device(1) != EBB_ENOTSUP) {
      ebb_set_error_hook(nullptr, nullptr);
      EBB_SKIP("binding to device 1's cores was not refused under the synthetic topology");
    }
    ebb_tensor_set_name(nullptr, "x");  // a last error of the caller's own, which must stay
    std::string before = ebb_last_error();
    EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
    auto v0 = vals(0), v1 = vals(1);
    Tensor w0 = leaf(0, v0), w1 = leaf(1, v1);
    Tensor l0 = sum(scale(w0, 2)), l1 = sum(scale(w1, 3));
    {
      std::lock_guard<std::mutex> g(log.mu);
      log.calls.clear();
    }
    ebb_status st = backward({l0, l1});  // starts both device workers
    std::string after = ebb_last_error();
    ebb_set_error_hook(nullptr, nullptr);
    CHECK(st == EBB_OK);
    CHECK(stats().nodes_run_on_workers > 0);
    CHECK(same(grad_seen(w0), std::vector<double>(v0.size(), 2.0)));
    CHECK(same(grad_seen(w1), std::vector<double>(v1.size(), 3.0)));
    CHECK(after == before);
    std::lock_guard<std::mutex> g(log.mu);
    for (auto &c : log.calls) UNSCOPED_INFO("error hook called: " << c.second);
    CHECK(log.calls.empty());
  }
  ebb_set_error_hook(nullptr, nullptr);
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- 9. reentrant backward -----------------------------------------------------------------------------

namespace {

// Level k of a nest: leaf w_k, loss_k = sum(w_k * (k + 1)) on device dev_k (a two-device level
// moves it: sum(to(w_k * (k + 1), other)) ). w_k's tensor hook runs the backward of level k + 1,
// so the backward of level 0 nests `depth` more inside it.
struct Nest {
  struct Level {
    Tensor w, loss;
    std::vector<double> v;
    int k = 0;
    Nest *nest = nullptr;
  };
  std::vector<Level> levels;
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_error;
  std::set<std::thread::id> threads;

  static ebb_status hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
    auto *lv = static_cast<Level *>(user);
    Nest *n = lv->nest;
    {
      std::lock_guard<std::mutex> l(n->mu);
      n->threads.insert(std::this_thread::get_id());
    }
    if ((size_t)lv->k + 1 >= n->levels.size()) return EBB_OK;
    const ebb_tensor_t *r[1] = {n->levels[(size_t)lv->k + 1].loss.get()};
    ebb_status st = ebb_backward(r, nullptr, 1, false, nullptr, 0);
    if (st) {
      std::lock_guard<std::mutex> l(n->mu);
      if (n->first_error.empty()) n->first_error = ebb_last_error();
      n->failures++;
    }
    return st;
  }

  // depth: backward calls nested inside level 0's. two_devices: each level's leaf on device
  // k % 2 and its loss on the other device.
  Nest(int depth, bool two_devices) : levels((size_t)depth + 1) {
    for (int k = 0; k <= depth; k++) {
      Level &lv = levels[(size_t)k];
      lv.k = k;
      lv.nest = this;
      int dev = two_devices ? k % 2 : 0;
      lv.v = vals(k, 4);
      lv.w = leaf(dev, lv.v);
      Tensor y = scale(lv.w, k + 1);
      if (two_devices) {
        Tensor y1 = to_dev(y, 1 - dev);
        lv.loss = sum(y1);
      } else {
        lv.loss = sum(y);
      }
      ebb_hook_handle h;
      EBB_REQUIRE_OK(ebb_tensor_register_hook(lv.w, hook, &lv, &h));
    }
    sync_all();
  }

  void check() {
    INFO(first_error);
    CHECK(failures.load() == 0);
    for (auto &lv : levels) {
      INFO("level " << lv.k);
      EBB_CHECK_CLOSE(grad_seen(lv.w), std::vector<double>(lv.v.size(), (double)(lv.k + 1)), 1e-12, 0);
    }
  }
};

}  // namespace

TEST_CASE("engine devices: reentrant backward nested to the depth limit runs on the thread, past it on a pool thread",
          "[autograd][devices][reentrant]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  const int limit = 4;
  EBB_REQUIRE_OK(ebb_autograd_set_max_reentrant_depth(limit));
  {
    // Exactly `limit` nested calls: all on the calling thread (one device, AUTO).
    Nest nest(limit, false);
    Stats before = stats();
    const ebb_tensor_t *r[1] = {nest.levels[0].loss.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Stats after = stats();
    nest.check();
    CHECK(after.reentrant_backwards - before.reentrant_backwards == (uint64_t)limit);
    CHECK(after.reentrant_handoffs == before.reentrant_handoffs);
    CHECK(after.backward_calls - before.backward_calls == (uint64_t)limit + 1);
    CHECK(nest.threads == std::set<std::thread::id>{std::this_thread::get_id()});
  }
  {
    // Two past the limit: the deeper calls move to a pool thread, the values are the same.
    Nest nest(limit + 2, false);
    Stats before = stats();
    const ebb_tensor_t *r[1] = {nest.levels[0].loss.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Stats after = stats();
    nest.check();
    CHECK(after.reentrant_backwards - before.reentrant_backwards == (uint64_t)limit + 2);
    CHECK(after.reentrant_handoffs - before.reentrant_handoffs >= 1);
    CHECK(nest.threads.size() >= 2);
  }
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("engine devices: a reentrant backward from a device worker that needs the other device's worker does not deadlock",
          "[autograd][devices][reentrant]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (int limit : {60, 1}) {
    // Each level crosses devices, so each nested backward runs nodes on both workers, one of
    // which is running the hook that waits for it. Levels alternate devices: each worker starts
    // two of the four nested calls (its second inside its first), so with limit 1 its second
    // goes to a pool thread, which serves the worker's queue while the worker waits.
    INFO("depth limit " << limit);
    EBB_REQUIRE_OK(ebb_autograd_set_max_reentrant_depth(limit));
    Nest nest(4, true);
    Stats before = stats();
    const ebb_tensor_t *r[1] = {nest.levels[0].loss.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Stats after = stats();
    nest.check();
    CHECK(after.reentrant_backwards - before.reentrant_backwards == 4);
    CHECK(after.nodes_run_on_workers > before.nodes_run_on_workers);
    if (limit == 1)
      CHECK(after.reentrant_handoffs - before.reentrant_handoffs >= 1);
    else
      CHECK(after.reentrant_handoffs == before.reentrant_handoffs);
  }
  sync_all();
  CHECK(ebb_autograd_live_nodes() == 0);
}

namespace {

struct OrderLog {
  std::mutex mu;
  std::vector<std::string> v;
  void add(const std::string &s) {
    std::lock_guard<std::mutex> l(mu);
    v.push_back(s);
  }
};

struct Tagged {
  OrderLog *log;
  const char *tag;
};

ebb_status log_pre(const ebb_node_t *node, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  auto *t = static_cast<Tagged *>(user);
  t->log->add(std::string(t->tag) + ":" + ebb_node_name(node));
  return EBB_OK;
}

struct InnerCall {
  OrderLog *log;
  const ebb_tensor_t *root;
};

ebb_status run_inner(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  auto *c = static_cast<InnerCall *>(user);
  c->log->add("begin");
  const ebb_tensor_t *r[1] = {c->root};
  ebb_status st = ebb_backward(r, nullptr, 1, false, nullptr, 0);
  c->log->add("end");
  return st;
}

}  // namespace

TEST_CASE("engine devices: a backward started in a hook on a device worker counts as reentrant and finishes before the outer one goes on",
          "[autograd][devices][reentrant]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));  // device 0's nodes on its worker
  // Made first, the inner graph's nodes have the smallest sequence numbers, the chain of the
  // outer's second root (made next) larger ones, the chain through h (made last) the largest:
  // h's AccumulateGrad runs, and its hook starts the inner backward, while the second chain still
  // waits in device 0's queue. The inner backward is deeper: its nodes go first.
  auto vv = vals(1, 4), vu = vals(2, 4), vh = vals(3, 4);
  Tensor v = leaf(0, vv), u = leaf(0, vu), h = leaf(0, vh);
  sync_all();
  Tensor iv = scale(v, 2), inner = sum(iv);
  Tensor x1 = scale(u, 1), x2 = scale(x1, 1), x3 = scale(x2, 1), r2 = sum(x3);
  Tensor hy = scale(h, 3), r1 = sum(hy);
  OrderLog log;
  Tagged tin{&log, "inner"}, tout{&log, "outer"};
  std::vector<const ebb_node_t *> in_nodes, out_nodes;
  collect(grad_fn(inner), in_nodes);
  collect(grad_fn(r1), out_nodes);
  collect(grad_fn(r2), out_nodes);
  ebb_hook_handle hd;
  for (auto *n : in_nodes) EBB_REQUIRE_OK(ebb_node_register_pre_hook(n, log_pre, &tin, &hd));
  for (auto *n : out_nodes) EBB_REQUIRE_OK(ebb_node_register_pre_hook(n, log_pre, &tout, &hd));
  InnerCall call{&log, inner.get()};
  EBB_REQUIRE_OK(ebb_tensor_register_hook(h, run_inner, &call, &hd));
  Stats before = stats();
  EBB_REQUIRE_OK(backward({r1, r2}));
  Stats after = stats();
  CHECK(after.reentrant_backwards - before.reentrant_backwards == 1);
  CHECK(after.nodes_run_on_workers > before.nodes_run_on_workers);
  std::vector<std::string> order;
  {
    std::lock_guard<std::mutex> l(log.mu);
    order = log.v;
  }
  std::string all;
  for (auto &s : order) all += s + "\n";
  INFO(all);
  auto b = std::find(order.begin(), order.end(), "begin"), e = std::find(order.begin(), order.end(), "end");
  REQUIRE(b != order.end());
  REQUIRE(e != order.end());
  CHECK(std::count_if(b, e, [](const std::string &s) { return s.rfind("inner:", 0) == 0; }) == 3);
  CHECK(std::count_if(b, e, [](const std::string &s) { return s.rfind("outer:", 0) == 0; }) == 0);
  EBB_CHECK_CLOSE(grad_seen(v), std::vector<double>(vv.size(), 2.0), 1e-12, 0);
  EBB_CHECK_CLOSE(grad_seen(u), std::vector<double>(vu.size(), 1.0), 1e-12, 0);
  EBB_CHECK_CLOSE(grad_seen(h), std::vector<double>(vh.size(), 3.0), 1e-12, 0);
}

namespace {

// Two device workers hand a reentrant backward to the pool at the same moment, while exactly one
// pool thread is idle. Per device i: the outer loss lo[i] (all on device i) has a leaf whose hook
// runs the middle backward lm[i] (device i alone: on the worker itself, one level down); the
// middle leaf's hook meets the other worker's at a barrier, then runs the inner backward ln[i],
// which is past the depth limit (1) and goes to a pool thread. ln[i] crosses to the other
// device, so it needs the other worker's queue served: by that worker's own pool thread while it
// waits. Two hand-offs queued for one pool thread leave the second worker's queue unserved
// while the first's inner backward waits for it.
struct PoolRace {
  struct Side {
    PoolRace *race = nullptr;
    int i = 0;
    Tensor h, lo, m, lm, n, ln;
  };
  Side side[2];
  std::atomic<int> arrived{0};
  bool barrier = false;
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_error;

  void fail(const char *what) {
    std::lock_guard<std::mutex> l(mu);
    if (first_error.empty()) first_error = std::string(what) + ": " + ebb_last_error();
    failures++;
  }

  static ebb_status outer_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
    auto *s = static_cast<Side *>(user);
    const ebb_tensor_t *r[1] = {s->lm.get()};
    ebb_status st = ebb_backward(r, nullptr, 1, true, nullptr, 0);
    if (st) s->race->fail("middle backward");
    return st;
  }

  static ebb_status middle_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
    auto *s = static_cast<Side *>(user);
    PoolRace *r = s->race;
    if (r->barrier) {  // both workers hand off together (a give-up after 2 s: only less likely then)
      r->arrived.fetch_add(1);
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (r->arrived.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    const ebb_tensor_t *roots[1] = {s->ln.get()};
    ebb_status st = ebb_backward(roots, nullptr, 1, true, nullptr, 0);
    if (st) r->fail("inner backward");
    return st;
  }

  PoolRace() {
    for (int i = 0; i < 2; i++) {
      Side &s = side[i];
      s.race = this;
      s.i = i;
      s.h = leaf(i, vals(i, 4));
      s.m = leaf(i, vals(i + 2, 4));
      s.n = leaf(i, vals(i + 4, 4));
      Tensor a = scale(s.h, 1);
      s.lo = sum(a);
      Tensor b = scale(s.m, 1);
      s.lm = sum(b);
      Tensor c = scale(s.n, 1), c1 = to_dev(c, 1 - i);
      s.ln = sum(c1);
      ebb_hook_handle hd;
      EBB_REQUIRE_OK(ebb_tensor_register_hook(s.h, outer_hook, &s, &hd));
      EBB_REQUIRE_OK(ebb_tensor_register_hook(s.m, middle_hook, &s, &hd));
    }
    sync_all();
  }
};

// Ends the process with a message when `done` is not set within the limit: a deadlocked backward
// never returns, and ctest's timeout would say less.
struct HangBreaker {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread th;
  HangBreaker(const char *what, int seconds) {
    th = std::thread([this, what, seconds] {
      std::unique_lock<std::mutex> l(mu);
      if (!cv.wait_for(l, std::chrono::seconds(seconds), [this] { return done; })) {
        std::fprintf(stderr, "engine devices: %s did not return in %d s: deadlocked\n", what, seconds);
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  ~HangBreaker() {
    {
      std::lock_guard<std::mutex> l(mu);
      done = true;
    }
    cv.notify_all();
    th.join();
  }
};

}  // namespace

TEST_CASE("engine devices: two device workers handing reentrant backward calls to one idle pool thread at once do not deadlock",
          "[autograd][devices][reentrant]") {
  const char *env = std::getenv("EBB_TEST_REENTRANT_POOL_ROUNDS");
  const int rounds = env ? std::atoi(env) : (kSanitized ? 15 : 40);
  int handoffs_seen = 0;
  for (int round = 0; round < rounds; round++) {
    INFO("round " << round);
    EbbSession session;  // a fresh engine each round: no pool thread yet
    {
      std::string why;
      if (!timed_two_devices(&why)) EBB_SKIP(why);
    }
    EngineSettings keep;
    EBB_REQUIRE_OK(ebb_autograd_set_max_reentrant_depth(1));
    PoolRace race;
    // One hand-off from the calling thread (device 0 alone): it leaves one idle pool thread.
    {
      HangBreaker hb("the warm-up backward", 60);
      const ebb_tensor_t *r[1] = {race.side[0].lo.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
    }
    REQUIRE(stats().reentrant_handoffs == 1);
    race.barrier = true;
    Stats before = stats();
    {
      HangBreaker hb("the backward over both devices", 20);
      const ebb_tensor_t *r[2] = {race.side[0].lo.get(), race.side[1].lo.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 2, true, nullptr, 0));
    }
    Stats after = stats();
    handoffs_seen += (int)(after.reentrant_handoffs - before.reentrant_handoffs);
    {
      std::lock_guard<std::mutex> l(race.mu);
      INFO(race.first_error);
      CHECK(race.failures.load() == 0);
    }
    CHECK(after.reentrant_handoffs - before.reentrant_handoffs == 2);
    // h: one outer backward each (device 0 twice: the warm-up); m and n: once per outer.
    CHECK(grad_seen(race.side[0].h) == std::vector<double>(4, 2.0));
    CHECK(grad_seen(race.side[1].h) == std::vector<double>(4, 1.0));
    CHECK(grad_seen(race.side[0].n) == std::vector<double>(4, 2.0));
    CHECK(grad_seen(race.side[1].n) == std::vector<double>(4, 1.0));
    sync_all();
  }
  CHECK(handoffs_seen == 2 * rounds);
}

// ---- 10. the lean path: in-place sums into buffers ---------------------------------------------------

TEST_CASE("engine devices: a gradient handed to two consumers on different streams is not summed into in place while one may still read it",
          "[autograd][devices][lean]") {
  // AddBackward (P, on sp) hands one tensor T to both its inputs: X's slot (MulScalarBackward on
  // sx) and G's slot (MulScalarBackward on sg), which also gets Q's gradient later. X runs before
  // Q delivers and reads T on sx, behind a backlog there; it then lets T go, so T is G's slot's
  // alone by count. Q's sum into G's slot on sg must not write T in place: sx has not read it yet.
  //   y = w2 * 2 (sg) ; q = y * 5 (sq) ; lq = sum(q) (sq) ; x = w * 3 (sx) ; z = x + y (sp) ;
  //   l = sum(z * 2) (sp). d/dw (l + lq) = 6, d/dw2 = 2 * (2 + 5) = 14.
  // Recorded in this order, the backward runs l's nodes, P, X, then lq's SumBackward, Q, G.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_WORKERS}) {
    INFO("mode " << mode);
    EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
    Stream sg(0), sq(0), sx(0), sp(0);
    Tensor w = leaf(0, vals(1)), w2 = leaf(0, vals(2)), y, lq, x, l;
    sync_all();
    {
      OnStream g(sg);
      y = scale(w2, 2);
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(sq, sg));
    {
      OnStream g(sq);
      Tensor q = scale(y, 5);
      lq = sum(q);
    }
    {
      OnStream g(sx);
      x = scale(w, 3);
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(sp, sx));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(sp, sg));
    {
      OnStream g(sp);
      Tensor z;
      EBB_REQUIRE_OK(ebb_op_add(x, y, z.out()));
      Tensor zz = scale(z, 2);  // its backward makes T a dense tensor of its own (sum's is a broadcast view)
      l = sum(zz);
    }
    busy(sx, kBacklog);
    EBB_REQUIRE_OK(backward({l, lq}));
    CHECK(grad_seen(w) == std::vector<double>(8, 6.0));
    CHECK(grad_seen(w2) == std::vector<double>(8, 14.0));
    sync_all();
  }
  CHECK(ebb_autograd_live_nodes() == 0);
}

// ---- 11. thread-local state on the engine's threads --------------------------------------------------

namespace {

// A node pre-hook that turns a thread-local mode on and forgets to turn it off again.
ebb_status leak_mode(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  if (*static_cast<const bool *>(user)) ebb_inference_mode_set_enabled(true, nullptr);
  else ebb_grad_set_enabled(true, nullptr);
  return EBB_OK;
}

}  // namespace

TEST_CASE("engine devices: a hook that leaves grad or inference mode on does not change the nodes that run after it on that thread",
          "[autograd][devices][threads]") {
  // A hook on a device-1 node (device 1's worker) leaves a mode on. The worker runs nodes of
  // every backward after that: they must run as the engine runs nodes (grad mode off, no
  // inference mode), not in what the hook left. PyTorch restores the thread's state around each
  // node. Left on, inference mode would make the next gradients on that worker inference tensors:
  // a .grad that the next accumulation outside inference mode cannot add into. (Grad mode left on
  // is checked the same way: no graph recorded by the backward's own ops.)
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  EngineSettings keep;
  for (ebb_engine_mode mode : {EBB_ENGINE_AUTO, EBB_ENGINE_CALLING_THREAD})
    for (bool inference : {true, false}) {
      INFO("mode " << mode << (inference ? ", inference mode left on" : ", grad mode left on"));
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
      bool grad_was = ebb_grad_enabled();
      auto v0 = vals(1), v1 = vals(2);
      Tensor w0 = leaf(0, v0), w1 = leaf(1, v1);
      sync_all();
      {
        // The hook's own node (MulScalarBackward on device 1) runs after the hook as it left the
        // thread; the nodes after it must not.
        Tensor a = scale(w0, 2), a1 = to_dev(a, 1), b = scale(a1, 3), l = sum(b);
        const ebb_node_t *n = nullptr;
        EBB_REQUIRE_OK(ebb_tensor_grad_fn(b, &n, nullptr));
        ebb_hook_handle h;
        EBB_REQUIRE_OK(ebb_node_register_pre_hook(n, leak_mode, &inference, &h));
        EBB_REQUIRE_OK(backward({l}));
      }
      // The calling thread is the user's: what a hook left there is theirs to see (restored at
      // the end of the backward as the engine found it).
      ebb_inference_mode_set_enabled(false, nullptr);
      ebb_grad_set_enabled(grad_was, nullptr);
      long nodes = ebb_autograd_live_nodes();
      {
        // Two devices again: device 1's nodes on its worker (AUTO), MulBackward saving w1.
        Tensor a = scale(w0, 2), a1 = to_dev(a, 1), c, l;
        EBB_REQUIRE_OK(ebb_op_mul(a1, w1, c.out()));
        l = sum(c);
        ebb_status st = backward({l});
        INFO(ebb_last_error());
        REQUIRE(st == EBB_OK);
        CHECK(ebb_autograd_live_nodes() == nodes + 6);  // this graph's nodes only (none recorded by the backward)
      }
      for (const ebb_tensor_t *w : {w0.get(), w1.get()}) {
        Tensor g;
        EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
        REQUIRE(g.get() != nullptr);
        bool inf = true, req = true;
        EBB_REQUIRE_OK(ebb_tensor_is_inference(g, &inf));
        EBB_REQUIRE_OK(ebb_tensor_requires_grad(g, &req));
        CHECK_FALSE(inf);
        CHECK_FALSE(req);
      }
      {
        // And .grad can still be added into on the calling thread (device 1 alone).
        Tensor b = scale(w1, 3), l = sum(b);
        ebb_status st = backward({l});
        INFO(ebb_last_error());
        CHECK(st == EBB_OK);
      }
      std::vector<double> want1(v1.size());
      for (size_t i = 0; i < v1.size(); i++) want1[i] = 2 * v0[i] + 3;
      CHECK(grad_seen(w1) == want1);
      sync_all();
    }
  CHECK(ebb_autograd_live_nodes() == 0);
}
