// A stream released while a backward uses it, and what a failed backward says it wrote.
//
// A backward holds the streams its nodes run on and the caller's current streams from its start
// to its return: a release asked meanwhile (by a hook, or another thread) returns at once and is
// carried out when the backward returns, so no step of the backward meets a released stream. A
// stream released between the forward and the backward is not held: its nodes run on the
// caller's current stream, after that stream's work (which made what they read).
//
// Runs with the emulated driver's timing model (EBB_SIM_LAUNCH_US, set by CMakeLists.txt): a
// stream that reads before another stream's pending write sees stale memory.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "devices_test_util.hpp"

using namespace ebb_test;

namespace {

// A tensor hook that releases `s` the first time it runs and keeps the release's answer.
struct Releaser {
  ebb_stream_t *s = nullptr;
  std::atomic<int> calls{0};
  ebb_status st = EBB_OK;
};

ebb_status release_once(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  auto *r = static_cast<Releaser *>(user);
  if (r->calls.fetch_add(1) == 0) r->st = ebb_stream_release(r->s);
  return EBB_OK;
}

// Counts the error hook's calls (a backward that succeeds must not call it).
std::atomic<int> g_error_calls{0};
void count_error(ebb_status, const char *, void *) { g_error_calls.fetch_add(1); }

struct ErrorHookCount {
  ErrorHookCount() {
    g_error_calls = 0;
    ebb_set_error_hook(count_error, nullptr);
  }
  ~ErrorHookCount() { ebb_set_error_hook(nullptr, nullptr); }
};

ebb_stream_t *current_default() {
  ebb_stream_t *d = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &d));
  return d;
}

void register_hook(ebb_tensor_t *t, ebb_tensor_hook_fn fn, void *user) {
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(t, fn, user, &h));
}

}  // namespace

TEST_CASE("a hook that releases the stream a leaf's AccumulateGrad was recorded on does not fail the backward",
          "[autograd][streams][release]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  ErrorHookCount errors;
  for (int where = 0; where < 2; where++) {
    DYNAMIC_SECTION((where == 0 ? "the hook of a node on another stream" : "the leaf's own hook")) {
      auto v = vals(where);
      Tensor w = leaf(0, v, "w");
      sync_all();
      Releaser rel;
      EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &rel.s));
      Stream p(0);
      Tensor a, y, loss;
      {
        OnStream g(rel.s);  // w's AccumulateGrad and a's node are recorded on the stream released later
        a = scale(w, 2);
      }
      {
        OnStream g(p);
        y = scale(a, 3);
        loss = sum(y);
      }
      register_hook(where == 0 ? y.get() : w.get(), release_once, &rel);
      busy(p, kBacklog);  // y's gradient, made on p, is late: the consumer on the released stream must wait for it
      ebb_clear_error();
      ebb_status st = backward({loss});
      INFO(ebb_last_error());
      REQUIRE(st == EBB_OK);
      CHECK(std::string(ebb_last_error()).empty());
      CHECK(g_error_calls.load() == 0);
      CHECK(rel.calls.load() == 1);
      CHECK(rel.st == EBB_OK);
      CHECK(same(grad_seen(w), std::vector<double>(v.size(), 6.0)));
      // The release was carried out when the backward returned: the handle reads released.
      EBB_CHECK_FAILS(ebb_stream_release(rel.s), EBB_EFREED, "released");
      g_error_calls = 0;
    }
  }
}

TEST_CASE("a hook that releases the caller's current stream does not fail the backward", "[autograd][streams][release]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  ErrorHookCount errors;
  auto v = vals(2);
  Tensor w = leaf(0, v);
  sync_all();
  Releaser rel;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &rel.s));
  Stream p(0);
  Tensor loss;
  {
    OnStream g(p);
    Tensor y = scale(w, 4);
    register_hook(y, release_once, &rel);
    loss = sum(y);
  }
  busy(p, kBacklog);
  ebb_status st;
  {
    OnStream g(rel.s);  // the caller's current stream: the end of the backward records on it
    st = backward({loss});
  }
  INFO(ebb_last_error());
  REQUIRE(st == EBB_OK);
  CHECK(g_error_calls.load() == 0);
  CHECK(rel.st == EBB_OK);
  EBB_CHECK_FAILS(ebb_stream_release(rel.s), EBB_EFREED, "released");  // carried out when the backward returned
  sync_all();
  CHECK(same(grad_seen(w), std::vector<double>(v.size(), 4.0)));
}

namespace {
// Releases the caller's current stream (deferred: the outer backward holds it), then runs a
// backward of its own and reads its .grad on its current stream, still that stream.
struct Inner {
  ebb_stream_t *s = nullptr;
  const ebb_tensor_t *loss = nullptr, *w = nullptr;
  int calls = 0;
  ebb_status rel = EBB_EINTERNAL, bw = EBB_EINTERNAL;
  ebb_stream_t *cur = nullptr;
  std::vector<double> seen;
  std::string err;
};

ebb_status release_then_backward(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  auto *c = static_cast<Inner *>(user);
  if (c->calls++) return EBB_OK;
  c->rel = ebb_stream_release(c->s);
  ebb_stream_t *def = nullptr;
  if (ebb_stream_default(0, &def)) return EBB_EINTERNAL;
  busy(def, kBacklog);  // the default stream is late: results left there would be read stale
  c->bw = ebb_backward(&c->loss, nullptr, 1, false, nullptr, 0);
  if (c->bw) c->err = ebb_last_error();
  ebb_stream_current(0, &c->cur);
  c->seen = grad_seen(c->w);
  return EBB_OK;
}
}  // namespace

namespace {
// Two graphs recorded on a created stream s: loss = sum(2 w) through y (where a hook goes), and
// loss2 = sum(5 w2), whose .grad (5 everywhere) the checks read.
struct TwoGraphs {
  std::vector<double> v, v2;
  Tensor w, w2, y, loss, loss2;
  ebb_stream_t *s = nullptr;
  explicit TwoGraphs(int t) : v(vals(t)), v2(vals(t + 1)), w(leaf(0, v)), w2(leaf(0, v2)) {
    sync_all();
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    OnStream g(s);
    y = scale(w, 2);
    loss = sum(y);
    loss2 = sum(scale(w2, 5));
  }
  std::vector<double> fives() const { return std::vector<double>(v2.size(), 5.0); }
};
}  // namespace

TEST_CASE("a backward inside a hook, after the hook released the caller's stream, still writes its results for that stream",
          "[autograd][streams][release]") {
  // The inner backward's caller stream has a release asked while the outer backward holds it:
  // the inner one joins the hold, runs there and makes it wait for its .grad.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  TwoGraphs gr(1);
  sync_all();
  Inner c;
  c.s = gr.s;
  c.loss = gr.loss2;
  c.w = gr.w2;
  register_hook(gr.y, release_then_backward, &c);
  ebb_status st;
  {
    OnStream g(c.s);
    st = backward({gr.loss});
  }
  INFO(ebb_last_error() << " / inner: " << c.err);
  REQUIRE(st == EBB_OK);
  CHECK(c.rel == EBB_OK);
  CHECK(c.bw == EBB_OK);
  CHECK(c.cur == c.s);
  CHECK(same(c.seen, gr.fives()));
  EBB_CHECK_FAILS(ebb_stream_release(c.s), EBB_EFREED, "released");
}

TEST_CASE("a backward whose current stream another thread's backward holds, released meanwhile, writes its results for it",
          "[autograd][streams][release][threads]") {
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  TwoGraphs gr(3);
  ebb_stream_t *s = gr.s;
  sync_all();
  // The other thread's backward parks in a hook, holding s.
  struct Park {
    std::mutex mu;
    std::condition_variable cv;
    bool in = false, go = false;
  } park;
  auto parked = [](const ebb_tensor_t *, ebb_tensor_t **, void *u) -> ebb_status {
    auto *p = static_cast<Park *>(u);
    std::unique_lock<std::mutex> l(p->mu);
    p->in = true;
    p->cv.notify_all();
    p->cv.wait(l, [&] { return p->go; });
    return EBB_OK;
  };
  register_hook(gr.y, parked, &park);
  ebb_status other = EBB_EINTERNAL;
  std::thread t([&] {
    ebb_stream_guard g{};
    if (ebb_stream_guard_enter(&g, s) != EBB_OK) return;
    other = backward({gr.loss});
    ebb_stream_guard_exit(&g);
  });
  {
    std::unique_lock<std::mutex> l(park.mu);
    park.cv.wait(l, [&] { return park.in; });
  }
  ebb_status rel = ebb_stream_release(s);  // deferred: the other thread's backward holds s
  std::vector<double> seen;
  ebb_status st;
  ebb_stream_t *cur = nullptr;
  {
    OnStream g(s);  // still live until the holder returns
    busy(current_default(), kBacklog);
    st = backward({gr.loss2});
    cur = current(0);
    seen = grad_seen(gr.w2);
  }
  {
    std::lock_guard<std::mutex> l(park.mu);
    park.go = true;
  }
  park.cv.notify_all();
  t.join();
  CHECK(rel == EBB_OK);
  CHECK(other == EBB_OK);
  REQUIRE(st == EBB_OK);
  CHECK(cur == s);
  CHECK(same(seen, gr.fives()));
  EBB_CHECK_FAILS(ebb_stream_release(s), EBB_EFREED, "released");
}

TEST_CASE("a stream released between the forward and the backward: its nodes run on the caller's stream after its work",
          "[autograd][streams][release]") {
  // The forward's work on s is late (a backlog): the backward, on the caller's default stream,
  // must wait for it before it reads x, which the forward made there.
  EbbSession session;
  EBB_NEED_TIMED_DEVICES();
  ErrorHookCount errors;
  auto v = vals(3);
  Tensor w = leaf(0, v);
  sync_all();
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  Tensor loss;
  std::vector<double> xs(v.size());
  for (size_t i = 0; i < xs.size(); i++) xs[i] = 2.75 + (double)i;
  {
    OnStream g(s);
    busy(s, kBacklog);
    Tensor x0 = make(0, EBB_F64, {(int64_t)xs.size()}, std::vector<double>(xs.size(), 0.0));
    Tensor x = mul(x0, x0);  // zeros, late
    Tensor xv = make(0, EBB_F64, {(int64_t)xs.size()}, xs);
    Tensor xx;
    EBB_REQUIRE_OK(ebb_op_add(x, xv, xx.out()));  // x = xs, written late on s
    Tensor y = mul(w, xx);
    loss = sum(y);
  }
  EBB_REQUIRE_OK(ebb_stream_release(s));
  ebb_status st = backward({loss});
  INFO(ebb_last_error());
  REQUIRE(st == EBB_OK);
  CHECK(g_error_calls.load() == 0);
  CHECK(same(grad_seen(w), xs));
}

// ---- a failed backward says which .grad it wrote --------------------------------------------------

namespace {
ebb_status fail_hook(const ebb_tensor_t *, ebb_tensor_t **, void *) {
  return EBB_EINVAL;
}
ebb_status fail_post_hook(const ebb_tensor_t *, void *) {
  return EBB_EINVAL;
}
}  // namespace

TEST_CASE("a backward that fails names the leaves whose .grad it had written, or says none was", "[autograd][errors]") {
  EbbSession session;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    for (int at = 0; at < 2; at++) {
      DYNAMIC_SECTION("device " << dev << (at == 0 ? ", failing before any leaf" : ", failing after w1's .grad")) {
        Tensor w1 = leaf(dev, vals(0, 3), "w1");
        Tensor w2 = leaf(dev, {1, 2, 3, 4});
        Tensor a = sum(scale(w1, 2));
        Tensor b = sum(scale(w2, 3));
        Tensor loss;
        EBB_REQUIRE_OK(ebb_op_add(a, b, loss.out()));
        ebb_hook_handle h;
        if (at == 0) register_hook(loss, fail_hook, nullptr);  // at the first node, before either AccumulateGrad
        else EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(w1, fail_post_hook, nullptr, &h));  // after w1's .grad
        ebb_status st = backward({loss});
        std::string msg = ebb_last_error();
        INFO(msg);
        CHECK(st == EBB_EINVAL);
        Tensor g1, g2;
        EBB_REQUIRE_OK(ebb_tensor_grad(w1, g1.out()));
        EBB_REQUIRE_OK(ebb_tensor_grad(w2, g2.out()));
        if (at == 0) {
          CHECK(g1.get() == nullptr);
          CHECK(g2.get() == nullptr);
          CHECK(msg.find("no .grad was changed") != std::string::npos);
        } else {
          REQUIRE(g1.get() != nullptr);
          CHECK(msg.find("the leaf 'w1' (f64[3] on ") != std::string::npos);
          CHECK(msg.find("no .grad was changed") == std::string::npos);
          CHECK((msg.find("the leaf (f64[4] on ") != std::string::npos) == (g2.get() != nullptr));
        }
      }
    }
  }
}
