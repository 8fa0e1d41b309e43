// Tensor hooks and post-accumulate hooks (ebb/autograd.h): when they run, what they see, what a
// replacement does, their order around a leaf, removal, and bad input.
#include <thread>
#include <atomic>
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

std::vector<std::string> g_log;

struct Seen {
  std::string tag;
  std::vector<double> grad;
  double scale = 1.0;  // != 1: replace the gradient with grad * scale
};

ebb_status tensor_hook(const ebb_tensor_t *grad, ebb_tensor_t **replace, void *user) {
  auto *s = static_cast<Seen *>(user);
  g_log.push_back(s->tag);
  s->grad = read(grad);
  if (s->scale != 1.0) return ebb_op_mul_scalar(grad, s->scale, replace);
  return EBB_OK;
}

ebb_status post_hook(const ebb_tensor_t *t, void *user) {
  auto *s = static_cast<Seen *>(user);
  g_log.push_back(s->tag);
  Tensor g;
  ebb_status st = ebb_tensor_grad(t, g.out());
  if (!st) s->grad = read(g);
  return st;
}

// Fails with a message of ebb's own (a public call given NULL).
ebb_status failing_hook(const ebb_tensor_t *, ebb_tensor_t **, void *) { return ebb_tensor_set_requires_grad(nullptr, true); }

ebb_status wrong_shape_hook(const ebb_tensor_t *, ebb_tensor_t **replace, void *) {
  const int64_t n = 7;
  return ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 1, &n, replace);
}

Tensor leaf(std::vector<double> v) {
  Tensor t = make(EBB_DEVICE_CPU, EBB_F64, {static_cast<int64_t>(v.size())}, v);
  REQUIRE(ebb_tensor_set_requires_grad(t, true) == EBB_OK);
  return t;
}

}  // namespace

TEST_CASE("hooks: a non-leaf's hook sees its summed gradient and may replace it, a leaf's order is hook, .grad, post hook",
          "[autograd][hooks]") {
  EbbSession session;
  g_log.clear();
  Tensor x = leaf({1, 2, 3}), y, z, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_add(y, y, z.out()));  // y used twice: its hook sees the sum
  EBB_REQUIRE_OK(ebb_op_sum(z, nullptr, 0, false, l.out()));
  Seen on_y{"y", {}, 10.0}, on_x{"x", {}}, post_x{"post", {}};
  ebb_hook_handle hy, hx, hp;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(y, tensor_hook, &on_y, &hy));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(x, tensor_hook, &on_x, &hx));
  EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(x, post_hook, &post_x, &hp));
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
  CHECK(on_y.grad == std::vector<double>{2, 2, 2});      // 1 + 1 from the two uses
  CHECK(on_x.grad == std::vector<double>{40, 40, 40});   // replaced by 10x, then * 2
  CHECK(post_x.grad == std::vector<double>{40, 40, 40}); // .grad already updated
  CHECK(g_log == std::vector<std::string>{"y", "x", "post"});
  // Removed hooks do not run; removing twice is refused.
  EBB_REQUIRE_OK(ebb_hook_remove(hy));
  EBB_CHECK_FAILS(ebb_hook_remove(hy), EBB_EINVAL, "is not registered");
  g_log.clear();
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
  CHECK(g_log == std::vector<std::string>{"x", "post"});
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
  CHECK(read(g) == std::vector<double>{44, 44, 44});  // 40 + 4
  // A hook whose graph is gone: its handle reads as removed.
  l.reset();
  z.reset();
  ebb_hook_handle gone = {0};
  {
    Tensor w;
    EBB_REQUIRE_OK(ebb_op_exp(x, w.out()));
    EBB_REQUIRE_OK(ebb_tensor_register_hook(w, tensor_hook, &on_y, &gone));
  }
  EBB_CHECK_FAILS(ebb_hook_remove(gone), EBB_EINVAL, "is not registered");
  EBB_REQUIRE_OK(ebb_hook_remove(hx));
  EBB_REQUIRE_OK(ebb_hook_remove(hp));
}

TEST_CASE("hooks: ebb_grad captures a leaf's gradient after its hooks", "[autograd][hooks]") {
  EbbSession session;
  Tensor x = leaf({1, 2}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  Seen on_x{"x", {}, 2.0};
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(x, tensor_hook, &on_x, &h));
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {x.get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(r, nullptr, 1, in, 1, false, false, g));
  Tensor gt(g[0]);
  CHECK(read(gt) == std::vector<double>{6, 6});
  Tensor none;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, none.out()));
  CHECK(none.get() == nullptr);
}

TEST_CASE("hooks: bad input and failing hooks are named, the engine carries on", "[autograd][hooks][errors]") {
  EbbSession session;
  Tensor x = leaf({1, 2}), plain = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 2}), y, l;
  ebb_hook_handle h;
  Seen s{"s", {}};
  EBB_CHECK_FAILS(ebb_tensor_register_hook(plain, tensor_hook, &s, &h), EBB_EINVAL, "does not require a gradient");
  EBB_CHECK_FAILS(ebb_tensor_register_hook(x, nullptr, &s, &h), EBB_EINVAL, "fn is NULL");
  EBB_CHECK_FAILS(ebb_tensor_register_hook(nullptr, tensor_hook, &s, &h), EBB_EINVAL, "ebb_tensor_register_hook: ");
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  EBB_CHECK_FAILS(ebb_tensor_register_post_accumulate_hook(y, post_hook, &s, &h), EBB_EINVAL, "produced by ExpBackward");
  EBB_CHECK_FAILS(ebb_hook_remove(ebb_hook_handle{987654321}), EBB_EINVAL, "is not registered");
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  const ebb_tensor_t *r[1] = {l.get()};
  // A replacement of the wrong shape names the node whose gradient it was.
  ebb_hook_handle bad;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(y, wrong_shape_hook, nullptr, &bad));
  EBB_CHECK_FAILS(ebb_backward(r, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "of ExpBackward replaced the gradient (f64[2] on the CPU) with the replacement (f64[7] on the CPU)");
  EBB_REQUIRE_OK(ebb_hook_remove(bad));
  // A failing hook: its status and message reach the caller.
  ebb_hook_handle fail;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(y, failing_hook, nullptr, &fail));
  EBB_CHECK_FAILS(ebb_backward(r, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "ebb_tensor_set_requires_grad: t is NULL");
  EBB_REQUIRE_OK(ebb_hook_remove(fail));
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
  REQUIRE(g.get() != nullptr);
}

TEST_CASE("hooks: retain_grad keeps a non-leaf's gradient, after its other hooks, summed over backward calls",
          "[autograd][hooks][retain_grad]") {
  EbbSession session;
  Tensor x = leaf({1, 2}), y, z, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_mul(y, y, z.out()));
  EBB_REQUIRE_OK(ebb_op_sum(z, nullptr, 0, false, l.out()));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y));  // twice is once
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(x));  // a leaf: nothing to do
  Seen doubler{"double", {}, 2.0};
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(y, tensor_hook, &doubler, &h));  // registered later, runs first
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
  Tensor gy;
  EBB_REQUIRE_OK(ebb_tensor_grad(y, gy.out()));
  REQUIRE(gy.get() != nullptr);
  CHECK(read(gy) == std::vector<double>{12, 24});  // 2y = (6, 12), doubled by the hook first
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
  EBB_REQUIRE_OK(ebb_tensor_grad(y, gy.out()));
  CHECK(read(gy) == std::vector<double>{24, 48});
  // Without retain_grad a non-leaf has no .grad.
  Tensor gz;
  EBB_REQUIRE_OK(ebb_tensor_grad(z, gz.out()));
  CHECK(gz.get() == nullptr);
  // The retained tensor released before a backward: the graph still runs, nothing is written.
  Tensor y2, l2;
  EBB_REQUIRE_OK(ebb_op_exp(x, y2.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y2, nullptr, 0, false, l2.out()));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y2));
  y2.reset();
  const ebb_tensor_t *r2[1] = {l2.get()};
  EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
  Tensor plain = make(EBB_DEVICE_CPU, EBB_F64, {1}, {1.0});
  EBB_CHECK_FAILS(ebb_tensor_retain_grad(plain), EBB_EINVAL, "does not require a gradient");
}

// ---- registration racing backward ---------------------------------------------------------------

namespace {
ebb_status keep_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  ++*static_cast<std::atomic<int> *>(user);
  return EBB_OK;
}
}  // namespace

// Backward calls on threads sharing a leaf while another thread registers and removes hooks on
// that leaf: the engine walks the leaf's hook list without the lock while the registration
// appends to it (hooks.c: "only appended, a release store of the link"), so the append must be
// an atomic store and the walk atomic loads. (TSan reports the plain ones.)
TEST_CASE("hooks: registering hooks on a leaf while other threads run backward through it", "[autograd][hooks][threads]") {
  EbbSession session;
  const int rounds = kSanitized ? 200 : 2000;
  Tensor w = leaf({1, 2, 3});
  std::atomic<int> calls{0}, failures{0};
  std::atomic<bool> stop{false};
  std::thread bw([&] {
    while (!stop.load()) {
      ebb_tensor_t *y = nullptr, *l = nullptr;
      if (ebb_op_mul_scalar(w, 2.0, &y) != EBB_OK || ebb_op_sum(y, nullptr, 0, false, &l) != EBB_OK) failures++;
      const ebb_tensor_t *r[1] = {l};
      if (l && ebb_backward(r, nullptr, 1, false, nullptr, 0) != EBB_OK) failures++;
      if (l) ebb_tensor_release(l);
      if (y) ebb_tensor_release(y);
    }
  });
  for (int i = 0; i < rounds; i++) {
    ebb_hook_handle h{0};
    EBB_REQUIRE_OK(ebb_tensor_register_hook(w, keep_hook, &calls, &h));
    if (i % 2) EBB_REQUIRE_OK(ebb_hook_remove(h));
  }
  stop = true;
  bw.join();
  CHECK(failures.load() == 0);
  w.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
