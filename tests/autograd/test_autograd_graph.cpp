// The autograd graph (ebb/autograd.h): what ops record when an input requires a gradient, on the
// CPU and a device: node names from the derivative table, next edges to the producers and to the
// leaves' AccumulateGrad, grad mode, detach, leaves, lifetimes (a graph goes with its last
// tensor, a deep chain without recursion), and bad input.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor leaf(int dev, std::vector<int64_t> shape, unsigned seed, bool requires_grad = true) {
  Tensor t = make(dev, EBB_F32, shape, values(numel_of(shape), seed));
  if (requires_grad) REQUIRE(ebb_tensor_set_requires_grad(t, true) == EBB_OK);
  return t;
}

const ebb_node_t *grad_fn(const ebb_tensor_t *t, int *nr = nullptr) {
  const ebb_node_t *n = nullptr;
  REQUIRE(ebb_tensor_grad_fn(t, &n, nr) == EBB_OK);
  return n;
}

bool requires(const ebb_tensor_t *t) {
  bool b = false;
  REQUIRE(ebb_tensor_requires_grad(t, &b) == EBB_OK);
  return b;
}

const ebb_node_t *next_of(const ebb_node_t *n, int i, int *input_nr = nullptr) {
  const ebb_node_t *x = nullptr;
  REQUIRE(ebb_node_next(n, i, &x, input_nr) == EBB_OK);
  return x;
}

}  // namespace

TEST_CASE("graph: an op on a tensor that requires grad records a node named by the table, with edges to its inputs",
          "[autograd][graph]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    {
      Tensor w = leaf(dev, {3, 4}, 1), x = leaf(dev, {2, 3}, 2, false), b = leaf(dev, {4}, 3);
      Tensor h, y, loss;
      EBB_REQUIRE_OK(ebb_op_matmul(x, w, h.out()));
      EBB_REQUIRE_OK(ebb_op_add(h, b, y.out()));
      EBB_REQUIRE_OK(ebb_op_mean(y, nullptr, 0, false, loss.out()));
      CHECK(requires(h));
      CHECK(requires(loss));
      CHECK_FALSE(requires(x));
      bool is_leaf = true;
      EBB_REQUIRE_OK(ebb_tensor_is_leaf(loss, &is_leaf));
      CHECK_FALSE(is_leaf);
      EBB_REQUIRE_OK(ebb_tensor_is_leaf(w, &is_leaf));
      CHECK(is_leaf);
      CHECK(grad_fn(w) == nullptr);
      const ebb_node_t *mean = grad_fn(loss), *add = next_of(mean, 0), *mm = nullptr;
      CHECK(std::string(ebb_node_name(mean)) == "MeanBackward");
      CHECK(std::string(ebb_node_name(add)) == "AddBackward");
      CHECK(add == grad_fn(y));
      mm = next_of(add, 0);
      CHECK(mm == grad_fn(h));
      CHECK(std::string(ebb_node_name(mm)) == "MatmulBackward");
      int n = 0;
      EBB_REQUIRE_OK(ebb_node_num_next(mm, &n));
      CHECK(n == 2);
      CHECK(next_of(mm, 0) == nullptr);  // x needs no gradient
      const ebb_node_t *accw = next_of(mm, 1), *accb = next_of(add, 1);
      CHECK(std::string(ebb_node_name(accw)) == "AccumulateGrad");
      CHECK(std::string(ebb_node_name(accb)) == "AccumulateGrad");
      CHECK(accw != accb);
      EBB_REQUIRE_OK(ebb_node_num_next(accw, &n));
      CHECK(n == 0);
      // The same leaf used twice shares its AccumulateGrad.
      Tensor w2;
      EBB_REQUIRE_OK(ebb_op_mul(w, w, w2.out()));
      CHECK(next_of(grad_fn(w2), 0) == accw);
      CHECK(next_of(grad_fn(w2), 1) == accw);
      // Sequence numbers grow with creation; AccumulateGrad runs first.
      uint64_t s_mm = 0, s_add = 0, s_acc = 0;
      EBB_REQUIRE_OK(ebb_node_sequence_nr(mm, &s_mm));
      EBB_REQUIRE_OK(ebb_node_sequence_nr(add, &s_add));
      EBB_REQUIRE_OK(ebb_node_sequence_nr(accw, &s_acc));
      CHECK(s_add > s_mm);
      CHECK(s_acc == UINT64_MAX);
    }
    CHECK(ebb_autograd_live_nodes() == 0);  // the graph went with its tensors
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("graph: multi-output ops, views and outputs without gradients", "[autograd][graph]") {
  EbbSession session;
  Tensor x = leaf(EBB_DEVICE_CPU, {3, 4}, 4);
  Tensor v, i, t, s;
  EBB_REQUIRE_OK(ebb_op_max_dim(x, 1, false, v.out(), i.out()));
  CHECK(std::string(ebb_node_name(grad_fn(v))) == "MaxBackward");
  CHECK_FALSE(requires(i));  // indices (i64) have no gradient
  CHECK(grad_fn(i) == nullptr);
  EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, t.out()));
  CHECK(std::string(ebb_node_name(grad_fn(t))) == "TransposeBackward");
  EBB_REQUIRE_OK(ebb_tensor_select(t, 0, 2, s.out()));
  CHECK(std::string(ebb_node_name(grad_fn(s))) == "SelectBackward");
  CHECK(next_of(grad_fn(s), 0) == grad_fn(t));
  // A comparison's bool output has no gradient, and neither does a where's condition.
  Tensor c, w;
  EBB_REQUIRE_OK(ebb_op_gt(x, x, c.out()));
  CHECK_FALSE(requires(c));
  EBB_REQUIRE_OK(ebb_op_where(c, x, x, w.out()));
  CHECK(next_of(grad_fn(w), 0) == nullptr);
  CHECK(next_of(grad_fn(w), 1) != nullptr);
}

TEST_CASE("graph: max_dim without indices (NULL) still records a MaxBackward that places the gradient at the maximum",
          "[autograd][graph]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(dev, EBB_F32, {2, 3}, {1, 7, 3, 9, -2, 9});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    Tensor v, loss, g;
    EBB_REQUIRE_OK(ebb_op_max_dim(x, 1, false, v.out(), nullptr));
    CHECK(std::string(ebb_node_name(grad_fn(v))) == "MaxBackward");
    EBB_REQUIRE_OK(ebb_op_sum(v, nullptr, 0, false, loss.out()));
    const ebb_tensor_t *roots[1] = {loss.get()};
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
    EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
    REQUIRE(g.get() != nullptr);
    CHECK(read(g) == std::vector<double>{0, 1, 0, 1, 0, 0});  // the first maximum of each row
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("graph: grad mode off records nothing, per thread, detach cuts the graph", "[autograd][graph][mode]") {
  EbbSession session;
  Tensor x = leaf(EBB_DEVICE_CPU, {4}, 5), y, z, d, e;
  CHECK(ebb_grad_enabled());
  bool was = false;
  ebb_grad_set_enabled(false, &was);
  CHECK(was);
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  CHECK_FALSE(requires(y));
  // Another thread's mode is its own.
  bool other = false;
  std::thread([&] { other = ebb_grad_enabled(); }).join();
  CHECK(other);
  ebb_grad_set_enabled(was, nullptr);
  EBB_REQUIRE_OK(ebb_op_exp(x, z.out()));
  CHECK(requires(z));
  EBB_REQUIRE_OK(ebb_tensor_detach(z, d.out()));
  CHECK_FALSE(requires(d));
  CHECK(grad_fn(d) == nullptr);
  bool same = false;
  EBB_REQUIRE_OK(ebb_tensor_same_storage(d, z, &same));
  CHECK(same);
  EBB_REQUIRE_OK(ebb_op_mul_scalar(d, 2.0, e.out()));
  CHECK_FALSE(requires(e));
}

TEST_CASE("graph: a chain of many nodes is freed without recursion", "[autograd][graph][lifetime]") {
  EbbSession session;
  const int n = kSanitized ? 20000 : 200000;
  Tensor x = leaf(EBB_DEVICE_CPU, {1}, 6), y;
  EBB_REQUIRE_OK(ebb_tensor_clone(x, y.out()));
  for (int i = 0; i < n; i++) {
    Tensor next;
    EBB_REQUIRE_OK(i % 2 ? ebb_op_mul_scalar(y, 1.0001, next.out()) : ebb_op_add_scalar(y, 0.0001, next.out()));
    y = std::move(next);
  }
  CHECK(ebb_autograd_live_nodes() == n + 2);  // + clone + AccumulateGrad
  y.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  x.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("graph: bad input is refused with a message naming the call", "[autograd][graph][errors]") {
  EbbSession session;
  Tensor x = leaf(EBB_DEVICE_CPU, {2}, 7), y, k;
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  EBB_CHECK_FAILS(ebb_tensor_set_requires_grad(y, false), EBB_EINVAL, "produced by ExpBackward");
  const int64_t two = 2;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_I64, 1, &two, k.out()));
  EBB_CHECK_FAILS(ebb_tensor_set_requires_grad(k, true), EBB_EINVAL, "dtype i64; only floating tensors have gradients");
  EBB_CHECK_FAILS(ebb_tensor_set_requires_grad(nullptr, true), EBB_EINVAL, "ebb_tensor_set_requires_grad: ");
  bool b;
  EBB_CHECK_FAILS(ebb_tensor_requires_grad(x, nullptr), EBB_EINVAL, "out is NULL");
  ebb_tensor_t *dead = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_clone(x, &dead));
  EBB_REQUIRE_OK(ebb_tensor_release(dead));
  EBB_CHECK_FAILS(ebb_tensor_requires_grad(dead, &b), EBB_EFREED, "ebb_tensor_requires_grad: ");
  EBB_CHECK_FAILS(ebb_tensor_is_leaf(dead, &b), EBB_EFREED, "ebb_tensor_is_leaf: ");
  const ebb_node_t *n = grad_fn(y), *m = nullptr;
  EBB_CHECK_FAILS(ebb_node_next(n, 1, &m, nullptr), EBB_EINVAL, "edge 1 of ExpBackward, which has 1");
  EBB_CHECK_FAILS(ebb_node_next(nullptr, 0, &m, nullptr), EBB_EINVAL, "node is NULL");
  CHECK(std::string(ebb_node_name(nullptr)) == "(invalid node)");
  // Turning it off on a leaf is fine, and affects later ops only.
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, false));
  Tensor z;
  EBB_REQUIRE_OK(ebb_op_exp(x, z.out()));
  CHECK_FALSE(requires(z));
  CHECK(requires(y));
}

// ---- lifetimes: partial walks meeting nodes being freed ----------------------------------------

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
TEST_CASE("graph: partial backward calls from two leaves never take a reference on a node being freed",
          "[autograd][graph][lifetime][partial][threads]") {
  EbbSession session;
  const int rounds = kSanitized ? 40 : 500, calls = kSanitized ? 50 : 200, k = 16;
  Tensor a = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4}), b = make(EBB_DEVICE_CPU, EBB_F64, {4}, {5, 6, 7, 8});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(a, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(b, true));
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
