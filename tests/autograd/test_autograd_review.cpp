// The engine and the Node API, case by case: each pins one behaviour that a simpler
// implementation gets wrong (said above each case).
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor leaf(std::vector<double> v) {
  Tensor t = make(EBB_DEVICE_CPU, EBB_F64, {static_cast<int64_t>(v.size())}, v);
  REQUIRE(ebb_tensor_set_requires_grad(t, true) == EBB_OK);
  return t;
}

std::vector<double> grad_of(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  return g.get() ? read(g) : std::vector<double>{};
}

}  // namespace

// retain_grad on y and ebb_backward(inputs = {y}) both put y's gradient into y.grad: it must be
// there once (PyTorch implements backward(inputs=[non-leaf]) with retain_grad itself).
TEST_CASE("review: a retained non-leaf that is also a backward input gets its gradient once", "[autograd][review]") {
  EbbSession session;
  Tensor x = leaf({1, 2, 3}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y));
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {y.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, in, 1));
  CHECK(grad_of(y) == std::vector<double>{1, 1, 1});
  CHECK(grad_of(x).empty());
  // With x as an input too, y's node also runs: still once.
  EBB_REQUIRE_OK(ebb_tensor_set_grad(y, nullptr));
  const ebb_tensor_t *in2[2] = {y.get(), x.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, in2, 2));
  CHECK(grad_of(y) == std::vector<double>{1, 1, 1});
  CHECK(grad_of(x) == std::vector<double>{2, 2, 2});
  for (Tensor *t : {&x, &y, &l}) t->reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

namespace {
// Holds a node's free (its metadata destructor runs after its producers' references were
// dropped, before the producers that went with it are unlinked) until the walkers made `calls`
// more partial backward calls each.
struct Gate {
  std::atomic<int> *walked[2];
  int calls;
};
void gate_wait(void *p) {
  auto *g = static_cast<Gate *>(p);
  int start[2] = {g->walked[0]->load(), g->walked[1]->load()};
  while (g->walked[0]->load() < start[0] + g->calls || g->walked[1]->load() < start[1] + g->calls) std::this_thread::yield();
}
}  // namespace

// Nodes whose last reference went stay linked in their producers' consumer lists until their
// free unlinks them. Two partial backward calls walking up from two different leaves (two
// consumer locks) meet such a node at once: the first's probe takes its count 0 -> 1, the
// second's then reads 1, takes it for alive and keeps a reference: the node is freed twice.
TEST_CASE("review: partial backward calls from two leaves never take a reference on a node being freed",
          "[autograd][review][partial][threads]") {
  EbbSession session;
  const int rounds = kSanitized ? 40 : 500, calls = kSanitized ? 50 : 200, k = 16;
  Tensor a = leaf({1, 2, 3, 4}), b = leaf({5, 6, 7, 8});
  Tensor a3, b3, ra, rb;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 3.0, a3.out()));
  EBB_REQUIRE_OK(ebb_op_sum(a3, nullptr, 0, false, ra.out()));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(b, 3.0, b3.out()));
  EBB_REQUIRE_OK(ebb_op_sum(b3, nullptr, 0, false, rb.out()));
  std::atomic<int> walked[2] = {{0}, {0}}, failures{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> walkers;
  for (int w = 0; w < 2; w++)
    walkers.emplace_back([&, w] {
      const ebb_tensor_t *r[1] = {w ? rb.get() : ra.get()}, *in[1] = {w ? b.get() : a.get()};
      while (!stop.load()) {
        ebb_tensor_t *g[1] = {nullptr};
        if (ebb_grad(r, nullptr, 1, in, 1, true, false, g) != EBB_OK) failures++;
        if (g[0]) ebb_tensor_release(g[0]);
        walked[w]++;
      }
    });
  Gate gate{{&walked[0], &walked[1]}, calls};
  for (int round = 0; round < rounds; round++) {
    // k nodes on both leaves, all consumed by one cat: freeing the cat drops them together.
    std::vector<ebb_tensor_t *> cs(k, nullptr);
    for (auto &c : cs) EBB_REQUIRE_OK(ebb_op_mul(a, b, &c));
    ebb_tensor_t *cat = nullptr;
    EBB_REQUIRE_OK(ebb_op_cat(cs.data(), k, 0, &cat));
    for (auto c : cs) ebb_tensor_release(c);
    const ebb_node_t *cn = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(cat, &cn, nullptr));
    EBB_REQUIRE_OK(ebb_node_metadata_set(cn, "gate", &gate, gate_wait));
    ebb_tensor_release(cat);  // the cat's node goes, its k producers with it, held by the gate meanwhile
  }
  stop = true;
  for (auto &th : walkers) th.join();
  CHECK(failures.load() == 0);
  for (Tensor *t : {&a3, &b3, &ra, &rb}) t->reset();
  a.reset();
  b.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

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
TEST_CASE("review: registering hooks on a leaf while other threads run backward through it", "[autograd][review][hooks][threads]") {
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

// A root edge that reaches an input's node but brings it no gradient (max_dim's indices output)
// leaves the input without one: without allow_unused that is EBB_EINVAL (ebb_grad's contract),
// never EBB_OK with grads[0] NULL.
TEST_CASE("review: ebb_grad_edges without allow_unused fails for an input no gradient reached", "[autograd][review][edges]") {
  EbbSession session;
  Tensor x = leaf({1, 5, 3}), v, idx;
  EBB_REQUIRE_OK(ebb_op_max_dim(x, 0, false, v.out(), idx.out()));
  const ebb_node_t *mx = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(v, &mx, nullptr));
  ebb_gradient_edge root{mx, 1}, in{};  // the indices' input of MaxBackward
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(x, &in));
  ebb_tensor_t *g[1] = {nullptr};
  ebb_status st = ebb_grad_edges(&root, nullptr, 1, &in, 1, true, false, g);
  CHECK(st == EBB_EINVAL);
  CHECK(g[0] == nullptr);
  if (g[0]) ebb_tensor_release(g[0]);
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&in));
  for (Tensor *t : {&x, &v, &idx}) t->reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

namespace {
void count_line(const char *, void *user) { ++*static_cast<int *>(user); }
}  // namespace

// The logging hooks promise a line for every node reachable from the roots, "a leaf's
// AccumulateGrad" included; for a leaf root whose AccumulateGrad did not exist yet, the
// registration makes one and hooks it. Were it dropped at the registration's end, the hook would
// go with it and the backward's AccumulateGrad (a new node) would log nothing, so the handle
// holds those nodes until it is removed (as a multi-grad registration does).
TEST_CASE("review: logging hooks on a leaf root log its AccumulateGrad", "[autograd][review][logging]") {
  EbbSession session;
  Tensor x = leaf({2});
  int lines = 0;
  const ebb_tensor_t *roots[1] = {x.get()};
  ebb_hook_handle h{0};
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(roots, 1, count_line, &lines, &h));
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  ebb_hook_remove(h);
  x.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
  CHECK(lines == 1);
}

// A leaf root whose AccumulateGrad nothing else holds: the call's reference was dropped before
// the task's end, which still read the node (ASan: heap-use-after-free in ebb__task_free).
TEST_CASE("review: backward and grad on a leaf root that nothing else uses", "[autograd][review]") {
  EbbSession session;
  Tensor x = leaf({2});
  const ebb_tensor_t *roots[1] = {x.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  CHECK(grad_of(x) == std::vector<double>{1});
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, roots, 1, false, false, g));
  Tensor gx(g[0]);
  CHECK(read(gx) == std::vector<double>{1});
  gx.reset();
  x.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
