// The engine over devices, streams and threads, case by case: each pins one behaviour that a
// simpler engine gets wrong (said above each case).
//
// Runs with the emulated driver's timing model (EBB_SIM_LAUNCH_US, set by CMakeLists.txt), so a
// stream that reads before another stream's pending write sees stale memory. Hooks may run on
// device worker or pool threads: they only record what they see, and the test thread checks it
// afterwards (Catch2's assertions are not thread-safe).
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "devices_test_util.hpp"

using namespace ebb_test;

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

// ---- follow-producer ----------------------------------------------------------------------------

TEST_CASE("review3: follow-producer moving an accumulator to another stream orders the move after .grad's pending writes",
          "[autograd][review3][accumulate]") {
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

TEST_CASE("review3: an accumulator whose recorded stream was released: the warning says so, follow-producer moves it",
          "[autograd][review3][accumulate]") {
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

// ---- the reentrant pool ------------------------------------------------------------------------

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
        std::fprintf(stderr, "review3: %s did not return in %d s: deadlocked\n", what, seconds);
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

TEST_CASE("review3: two device workers handing reentrant backward calls to one idle pool thread at once do not deadlock",
          "[autograd][review3][reentrant]") {
  const char *env = std::getenv("EBB_REVIEW3_POOL_ROUNDS");
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

// ---- the lean path: in-place sums into buffers ---------------------------------------------------

TEST_CASE("review3: a gradient handed to two consumers on different streams is not summed into in place while one may still read it",
          "[autograd][review3][lean]") {
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

// ---- thread-local state on the engine's threads --------------------------------------------------

namespace {

// A node pre-hook that turns a thread-local mode on and forgets to turn it off again.
ebb_status leak_mode(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *user) {
  if (*static_cast<const bool *>(user)) ebb_inference_mode_set_enabled(true, nullptr);
  else ebb_grad_set_enabled(true, nullptr);
  return EBB_OK;
}

}  // namespace

TEST_CASE("review3: a hook that leaves grad or inference mode on does not change the nodes that run after it on that thread",
          "[autograd][review3][threads]") {
  // A hook on a device-1 node (device 1's worker) leaves a mode on. The worker runs nodes of
  // every backward after that: they must run as the engine runs nodes (grad mode off, no
  // inference mode), not in what the hook left. PyTorch restores the thread's state around each
  // node. Left on, inference mode made the next gradients on that worker inference tensors: a
  // .grad that the next accumulation outside inference mode cannot add into. (Grad mode left on
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

TEST_CASE("review3: ebb_node_input_meta on an accumulator that follow-producer moves on another thread reads one stream or the other",
          "[autograd][review3][accumulate][threads]") {
  // The move happens under the engine's lock for node streams; the Node API read the stream id
  // without it (a data race, reported under TSan). A reader on one thread, backward calls moving
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

