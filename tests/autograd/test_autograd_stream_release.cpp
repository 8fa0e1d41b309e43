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
#include <string>
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
  sync_all();
  CHECK(same(grad_seen(w), std::vector<double>(v.size(), 4.0)));
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
          CHECK(msg.find("'w1' f64[3]") != std::string::npos);
          CHECK(msg.find("no .grad was changed") == std::string::npos);
          CHECK((msg.find("a leaf f64[4]") != std::string::npos) == (g2.get() != nullptr));
        }
      }
    }
  }
}
