// Allow-mutation scopes (ebb_allow_mutation_on_saved_enter/exit): a saved tensor changed in place
// inside one gives the gradients of a run that cloned it by hand, on the CPU and a device, through
// views and from other threads; views of one storage share one clone; the backward after the
// scope's exit, nesting and an exit without an enter are errors with messages; without the scope
// the version check stays. And per-tensor hooks on a node's saved slot
// (ebb_node_saved_register_hooks): packed at once, unpacked by the backward, and their errors.
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "sanitizers.hpp"
#include "autograd_test_util.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct AllowMutation {
  AllowMutation() { EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter()); }
  ~AllowMutation() { CHECK(ebb_allow_mutation_on_saved_exit() == EBB_OK); }
};




Tensor add(const ebb_tensor_t *a, const ebb_tensor_t *b) {
  Tensor s;
  EBB_REQUIRE_OK(ebb_op_add(a, b, s.out()));
  return s;
}

Tensor mul(const ebb_tensor_t *a, const ebb_tensor_t *b) {
  Tensor s;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, s.out()));
  return s;
}

void backward(const ebb_tensor_t *l, bool retain = false) {
  const ebb_tensor_t *r[1] = {l};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, retain, nullptr, 0));
}

ebb_status try_backward(const ebb_tensor_t *l, bool retain = false) {
  const ebb_tensor_t *r[1] = {l};
  return ebb_backward(r, nullptr, 1, retain, nullptr, 0);
}

// Allocations (or frees) of the memory pool of `dev` so far (the CPU's pageable pool or a device's arena).
uint64_t allocs(int dev, bool frees = false) {
  ebb_arena_stats s;
  EBB_REQUIRE_OK(dev == EBB_DEVICE_CPU ? ebb_pageable_get_stats(&s) : ebb_arena_get_stats(dev, &s));
  return frees ? s.free_count : s.alloc_count;
}


// l = sum(x * w) + sum(a * a) + sum(a'), a = exp(w), where x (a plain input, no autograd state)
// is filled with 5 and a is doubled in place (a' its new value) after the products saved them.
// With `by_hand`, no scope: the products use clones taken by hand, and the writes go to the
// originals. Returns w's gradient.
std::vector<double> mutated_grads(int dev, bool by_hand) {
  Tensor x = make(dev, EBB_F64, {4}, values(4, 7)), w = leaf_on(dev, values(4, 8), "w");
  Tensor two = make(dev, EBB_F64, {1}, {2.0});
  Tensor a, p, q, l;
  if (by_hand) {
    Tensor xc, ac;
    EBB_REQUIRE_OK(ebb_op_exp(w, a.out()));
    EBB_REQUIRE_OK(ebb_tensor_clone(x, xc.out()));
    EBB_REQUIRE_OK(ebb_tensor_clone(a, ac.out()));  // recorded: CloneBackward, then a's in place on the clone
    p = mul(xc, w);
    q = mul(a, a);
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 5.0));
    EBB_REQUIRE_OK(ebb_op_mul_(ac, two));
    l = add(add(sum_of(p), sum_of(q)), sum_of(ac));
    backward(l);
  } else {
    AllowMutation scope;
    EBB_REQUIRE_OK(ebb_op_exp(w, a.out()));  // saves its output a
    p = mul(x, w);                            // saves x and w
    q = mul(a, a);                            // saves a twice
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 5.0));
    EBB_REQUIRE_OK(ebb_op_mul_(a, two));
    l = add(add(sum_of(p), sum_of(q)), sum_of(a));
    backward(l);
    CHECK(read(x) == std::vector<double>(4, 5.0));  // the write itself happened
  }
  return grad_of(w);
}

}  // namespace

TEST_CASE("allow mutation: saved tensors changed in place give the gradients of clones made by hand, on the CPU and a device",
          "[autograd][allow-mutation][devices]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO("on " << dev_name(dev));
    auto want = mutated_grads(dev, true);
    auto got = mutated_grads(dev, false);
    EBB_CHECK_CLOSE(got, want, 1e-12, 1e-12);
    // d/dw: x as it was, plus 2 a^2 (a * a) and 2 a (the doubled a), a = exp(w)
    std::vector<double> x0 = values(4, 7), w0 = values(4, 8), exact;
    for (size_t i = 0; i < 4; i++) exact.push_back(x0[i] + 2 * std::exp(2 * w0[i]) + 2 * std::exp(w0[i]));
    EBB_CHECK_CLOSE(got, exact, 1e-12, 1e-12);
  }
  live.check();
}

TEST_CASE("allow mutation: views of a saved storage share one clone, made once, and a write through a view is seen",
          "[autograd][allow-mutation][views]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO("on " << dev_name(dev));
    std::vector<double> x0 = values(6, 3), w0 = values(3, 4), x1 = values(6, 5);
    Tensor x = make(dev, EBB_F64, {2, 3}, x0), w = leaf_on(dev, w0), x1t = make(dev, EBB_F64, {2, 3}, x1);
    AllowMutation scope;
    Tensor r0, r1, cols;
    EBB_REQUIRE_OK(ebb_tensor_select(x, 0, 0, r0.out()));
    EBB_REQUIRE_OK(ebb_tensor_select(x, 0, 1, r1.out()));
    EBB_REQUIRE_OK(ebb_tensor_narrow(x, 1, 1, 2, cols.out()));
    Tensor y0 = mul(r0, w), y1 = mul(r1, w), y2 = mul(x, w);  // three nodes saving parts of x's storage
    uint64_t before = allocs(dev);
    EBB_REQUIRE_OK(ebb_tensor_fill_(cols, 7.0));  // through a view none of them saved
    CHECK(allocs(dev) - before == 1);             // one clone for the three
    before = allocs(dev);
    EBB_REQUIRE_OK(ebb_tensor_copy_(x, x1t));  // they hold the clone now: nothing to keep
    CHECK(allocs(dev) - before == 0);
    Tensor y3 = mul(x, w);  // saved after the writes: x1
    before = allocs(dev);
    EBB_REQUIRE_OK(ebb_tensor_zero_(r1));  // through the other row: y3's x is cloned, alone
    CHECK(allocs(dev) - before == 1);
    Tensor l = add(add(sum_of(y0), sum_of(y1)), add(sum_of(y2), sum_of(y3)));
    backward(l);
    std::vector<double> want(3);
    for (int j = 0; j < 3; j++) want[j] = 2 * (x0[j] + x0[3 + j]) + x1[j] + x1[3 + j];
    EBB_CHECK_CLOSE(grad_of(w), want, 1e-12, 1e-12);
  }
  live.check();
}

TEST_CASE("allow mutation: an op's own saved input written by the op (x.mul_(x)) reads its old value",
          "[autograd][allow-mutation][inplace]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO("on " << dev_name(dev));
    std::vector<double> w0 = values(3, 9);
    Tensor w = leaf_on(dev, w0), x, l;
    {
      AllowMutation scope;
      EBB_REQUIRE_OK(ebb_op_exp(w, x.out()));
      EBB_REQUIRE_OK(ebb_op_mul_(x, x));  // its node saves x (src) and x's old value; then x changes
      l = sum_of(x);
      backward(l);
    }
    std::vector<double> want;
    for (double v : w0) want.push_back(2 * std::exp(2 * v));  // d/dw sum(exp(w)^2)
    EBB_CHECK_CLOSE(grad_of(w), want, 1e-12, 1e-12);
  }
  live.check();
}

TEST_CASE("allow mutation: a backward after the scope's exit fails naming the node and the tensor, and the graph is released",
          "[autograd][allow-mutation][errors]") {
  EbbSession session;
  Live live;
  {
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3}), w = leaf_on(EBB_DEVICE_CPU, {4, 5, 6});
    EBB_REQUIRE_OK(ebb_tensor_set_name(x, "x"));
    Tensor l, untouched;
    uint64_t frees = 0;
    {
      AllowMutation scope;
      l = sum_of(mul(x, w));
      untouched = sum_of(mul(w, w));  // never written: it fails after the exit all the same
      EBB_REQUIRE_OK(ebb_tensor_fill_(x, -1.0));
      backward(l, true);  // inside: fine, and kept
      backward(l, true);  // (the second adds into .grad in place, under its lock, with the scope open)
      CHECK(grad_of(w) == std::vector<double>{2, 4, 6});
      frees = allocs(EBB_DEVICE_CPU, true);
    }
    CHECK(allocs(EBB_DEVICE_CPU, true) - frees == 1);  // the exit freed the clone of x, while its graph lives
    EBB_CHECK_MSG(try_backward(l), EBB_ESTATE, "ebb_backward: MulBackward (node ", "saved input 0 'x' (f64[3] on the CPU)",
                  "allow-mutation scope", "exited", "inside the allow-mutation scope its graph was recorded in",
                  "ebb_allow_mutation_on_saved_exit");
    {
      AllowMutation another;  // a new scope is not the one the graph was recorded in
      EBB_CHECK_MSG(try_backward(untouched), EBB_ESTATE, "MulBackward", "saved input 0 (f64[3] on the CPU)", "exited");
    }
    CHECK(grad_of(w) == std::vector<double>{2, 4, 6});  // the failures wrote nothing
  }
  live.check();  // its nodes and what they saved went with the graph
  {
    // A graph released while its scope is still open, and one with a backward that freed its saved tensors.
    Tensor x = make(0, EBB_F64, {2}, {1, 2}), w = leaf_on(0, {3, 4});
    AllowMutation scope;
    Tensor l1 = sum_of(mul(x, w)), l2 = sum_of(mul(x, w));
    l1.reset();
    backward(l2);
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 0.0));
  }
  live.check();
}

TEST_CASE("allow mutation: nesting, and an exit without an enter, are errors, and scopes are per thread",
          "[autograd][allow-mutation][errors]") {
  EbbSession session;
  EBB_CHECK_MSG(ebb_allow_mutation_on_saved_exit(), EBB_ESTATE, "ebb_allow_mutation_on_saved_exit",
                "no allow-mutation scope is open on this thread");
  EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
  EBB_CHECK_MSG(ebb_allow_mutation_on_saved_enter(), EBB_ESTATE, "ebb_allow_mutation_on_saved_enter", "already open",
                "nesting is an error");
  ebb_status other_exit = EBB_OK, other_enter = EBB_EINTERNAL, other_exit2 = EBB_EINTERNAL;
  std::thread th([&] {
    other_exit = ebb_allow_mutation_on_saved_exit();  // the main thread's scope is not this thread's
    other_enter = ebb_allow_mutation_on_saved_enter();
    other_exit2 = ebb_allow_mutation_on_saved_exit();
  });
  th.join();
  CHECK(other_exit == EBB_ESTATE);
  CHECK(other_enter == EBB_OK);
  CHECK(other_exit2 == EBB_OK);
  EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_exit());
  CHECK(ebb_allow_mutation_on_saved_exit() == EBB_ESTATE);
}

TEST_CASE("allow mutation: without the scope the version check stays", "[autograd][allow-mutation][errors]") {
  EbbSession session;
  Live live;
  {
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 2}), w = leaf_on(EBB_DEVICE_CPU, {3, 4});
    EBB_REQUIRE_OK(ebb_tensor_set_name(x, "x"));
    Tensor l = sum_of(mul(x, w));
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 0.0));
    EBB_CHECK_MSG(try_backward(l, true), EBB_ESTATE, "MulBackward", "saved input 0 'x'", "modified in place",
                  "saved at version 0, now 1");
    // Recorded outside a scope, written inside one: not registered, still refused.
    Tensor l2 = sum_of(mul(x, w));
    {
      AllowMutation scope;
      EBB_REQUIRE_OK(ebb_tensor_fill_(x, 1.0));
    }
    EBB_CHECK_MSG(try_backward(l2), EBB_ESTATE, "saved at version 1, now 2");
    // And after a scope: the same.
    Tensor l3 = sum_of(mul(x, w));
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 2.0));
    EBB_CHECK_MSG(try_backward(l3), EBB_ESTATE, "saved at version 2, now 3");
  }
  live.check();
}

TEST_CASE("allow mutation: writes from other threads, graphs released meanwhile, backward on device workers",
          "[autograd][allow-mutation][threads]") {
  EbbSession session;
  Live live;
  ebb_engine_mode mode = ebb_autograd_engine_mode();
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
  {
    const int rounds = 40 / kSanitizerScale;
    for (int dev : {EBB_DEVICE_CPU, 0}) {
      INFO("on " << dev_name(dev));
      for (int r = 0; r < rounds; r++) {
        std::vector<double> x0 = values(4, 11 + r), w0 = values(4, 12);
        Tensor x = make(dev, EBB_F64, {4}, x0), w = leaf_on(dev, w0);
        AllowMutation scope;
        Tensor kept = sum_of(mul(x, w)), dropped = sum_of(mul(x, w));
        // One thread writes x (the clone is made there) while another releases a graph that saved it.
        std::atomic<ebb_status> wst{EBB_EINTERNAL};
        std::thread writer([&] { wst = ebb_tensor_fill_(x, 3.0); });
        std::thread releaser([&] { dropped.reset(); });
        writer.join();
        releaser.join();
        CHECK(wst.load() == EBB_OK);
        backward(kept);  // MulBackward on device 0's worker: reads the clone
        EBB_CHECK_CLOSE(grad_of(w), x0, 0, 0);
      }
    }
  }
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
  live.check();
}

// ---- per-tensor hooks on a saved slot ---------------------------------------------------------------

namespace {

// A pair that keeps a host copy of what it packs, counting its calls.
struct CopyHooks {
  std::atomic<int> packs{0}, unpacks{0}, frees{0};
  bool fail = false;
  struct Packed {
    int device;
    ebb_tensor_t *t;
  };
  ebb_saved_hooks pair() { return ebb_saved_hooks{pack, unpack, free_packed, this}; }
  static ebb_status pack(void *user, const ebb_tensor_t *t, void **packed) {
    auto *h = static_cast<CopyHooks *>(user);
    h->packs++;
    if (h->fail) return ebb_tensor_set_requires_grad(nullptr, true);  // fails with a message of ebb's
    int dev = 0;
    ebb_status st = ebb_tensor_device(t, &dev);
    auto *p = new Packed{dev, nullptr};
    if (!st) st = ebb_tensor_to_device(t, EBB_DEVICE_CPU, &p->t);
    if (st) {
      delete p;
      return st;
    }
    *packed = p;
    return EBB_OK;
  }
  static ebb_status unpack(void *user, void *packed, ebb_tensor_t **out) {
    auto *h = static_cast<CopyHooks *>(user);
    auto *p = static_cast<Packed *>(packed);
    h->unpacks++;
    return ebb_tensor_to_device(p->t, p->device, out);
  }
  static void free_packed(void *user, void *packed) {
    auto *h = static_cast<CopyHooks *>(user);
    auto *p = static_cast<Packed *>(packed);
    h->frees++;
    ebb_tensor_release(p->t);
    delete p;
  }
};

const ebb_node_t *grad_fn(const ebb_tensor_t *t) {
  const ebb_node_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, nullptr));
  REQUIRE(n != nullptr);
  return n;
}

}  // namespace

TEST_CASE("saved register_hooks: packs at once, drops the data, unpacks at each backward, frees once",
          "[autograd][saved-hooks][register-hooks]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO("on " << dev_name(dev));
    CopyHooks h;
    std::vector<double> x0 = values(3, 21), w0 = values(3, 22);
    Tensor x = make(dev, EBB_F64, {3}, x0), w = leaf_on(dev, w0);
    Tensor y = mul(x, w), l = sum_of(y);
    ebb_saved_hooks p = h.pair();
    EBB_REQUIRE_OK(ebb_node_saved_register_hooks(grad_fn(y), 0, &p));  // x
    CHECK(h.packs == 1);
    CHECK(h.unpacks == 0);
    // The node no longer holds x's data: a change to x now is not seen by the backward (the
    // pair's copy is), and fails no version check.
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 9.0));
    backward(l, true);
    CHECK(h.unpacks == 1);
    EBB_CHECK_CLOSE(grad_of(w), x0, 0, 0);
    backward(l);
    CHECK(h.unpacks == 2);
    CHECK(h.frees == 1);  // the backward without retain_graph released it
    std::vector<double> twice;
    for (double v : x0) twice.push_back(2 * v);
    EBB_CHECK_CLOSE(grad_of(w), twice, 0, 0);
  }
  {
    // A node's saved output (ExpBackward, index nin + 0 = 1), released with its graph unused.
    CopyHooks h;
    Tensor w = leaf_on(EBB_DEVICE_CPU, {0.5, 1});
    Tensor y;
    EBB_REQUIRE_OK(ebb_op_exp(w, y.out()));
    ebb_saved_hooks p = h.pair();
    EBB_REQUIRE_OK(ebb_node_saved_register_hooks(grad_fn(y), 1, &p));
    CHECK(h.packs == 1);
    y.reset();
    CHECK(h.frees == 1);
    CHECK(h.unpacks == 0);
  }
  live.check();
}

TEST_CASE("saved register_hooks: errors name the call, the node, the saved tensor and what was expected",
          "[autograd][saved-hooks][register-hooks][errors]") {
  EbbSession session;
  Live live;
  {
    CopyHooks h;
    ebb_saved_hooks p = h.pair();
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 2}), w = leaf_on(EBB_DEVICE_CPU, {3, 4});
    EBB_REQUIRE_OK(ebb_tensor_set_name(x, "x"));
    Tensor y = mul(x, w), e, s = add(w, w);
    EBB_REQUIRE_OK(ebb_op_exp(w, e.out()));
    const ebb_node_t *mn = grad_fn(y), *en = grad_fn(e), *an = grad_fn(s);
    const char *fn = "ebb_node_saved_register_hooks";
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(nullptr, 0, &p), EBB_EINVAL, fn, "node is NULL");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 0, nullptr), EBB_EINVAL, fn, "h is NULL");
    ebb_saved_hooks half = p;
    half.unpack = nullptr;
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 0, &half), EBB_EINVAL, fn, "h->unpack is NULL");
    half = p;
    half.pack = nullptr;
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 0, &half), EBB_EINVAL, fn, "h->pack is NULL");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 2, &p), EBB_EINVAL, fn, "MulBackward (node ", "no tensor at index 2",
                  "saves 0 (input 0) and 1 (input 1)");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, -1, &p), EBB_EINVAL, "no tensor at index -1");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(en, 0, &p), EBB_EINVAL, "ExpBackward", "saves 1 (output 0)");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(an, 0, &p), EBB_EINVAL, "AddBackward", "saves no tensor");
    CHECK(h.packs == 0);
    // A pack that fails: nothing changes, the slot keeps its tensor.
    h.fail = true;
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 0, &p), EBB_EINVAL, fn, "MulBackward", "saved input 0 'x'",
                  "pack hook failed");
    h.fail = false;
    EBB_REQUIRE_OK(ebb_node_saved_register_hooks(mn, 0, &p));
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(mn, 0, &p), EBB_ESTATE, fn, "saved input 0 'x' (f64[2] on the CPU)",
                  "hooks already set", "only one pair per saved tensor");
    // Saved under hooks on the stack: packed already.
    {
      CopyHooks stack_h;
      ebb_saved_hooks sp = stack_h.pair();
      EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&sp));
      Tensor z = mul(w, w);
      EBB_REQUIRE_OK(ebb_saved_tensors_hooks_pop());
      EBB_CHECK_MSG(ebb_node_saved_register_hooks(grad_fn(z), 1, &p), EBB_ESTATE, "hooks already set");
    }
    // Modified in place since it was saved: refused (packing would hide the change).
    Tensor y2 = mul(x, w);
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 0.0));
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(grad_fn(y2), 0, &p), EBB_ESTATE, fn, "saved input 0 'x'", "modified in place");
    // Freed by a backward without retain_graph.
    Tensor l = sum_of(e);
    backward(l);
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(en, 1, &p), EBB_ESTATE, fn, "ExpBackward", "freed", "retain_graph");
    // Saved inside an allow-mutation scope.
    {
      AllowMutation scope;
      Tensor y3 = mul(x, w);
      EBB_CHECK_MSG(ebb_node_saved_register_hooks(grad_fn(y3), 0, &p), EBB_ESTATE, fn, "allow-mutation scope",
                    "only one pair per saved tensor");
    }
    CHECK(h.packs == 2);
    CHECK(h.frees == 0);  // the failed pack made nothing to free; the value set is still the node's
  }
  live.check();
}

TEST_CASE("saved register_hooks: racing a backward that frees the slot, and another call on the node's other slot",
          "[autograd][saved-hooks][register-hooks][threads]") {
  EbbSession session;
  Live live;
  const int rounds = 40 / kSanitizerScale;
  for (int r = 0; r < rounds; r++) {
    CopyHooks h;
    ebb_saved_hooks p = h.pair();
    std::vector<double> x0 = values(3, 30 + r), w0 = values(3, 31);
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, x0), w = leaf_on(EBB_DEVICE_CPU, w0);
    Tensor y = mul(x, w), l = sum_of(y);
    const ebb_node_t *n = grad_fn(y);
    std::atomic<ebb_status> s0{EBB_EINTERNAL}, s1{EBB_EINTERNAL}, sb{EBB_EINTERNAL};
    std::thread a([&] { s0 = ebb_node_saved_register_hooks(n, 0, &p); });
    std::thread b([&] { s1 = ebb_node_saved_register_hooks(n, 1, &p); });
    std::thread c([&] { sb = try_backward(l); });
    a.join();
    b.join();
    c.join();
    CHECK(sb.load() == EBB_OK);
    CHECK((s0.load() == EBB_OK || s0.load() == EBB_ESTATE));  // ESTATE: the backward freed the slot first
    CHECK((s1.load() == EBB_OK || s1.load() == EBB_ESTATE));
    EBB_CHECK_CLOSE(grad_of(w), x0, 0, 0);
    y.reset();
    l.reset();
    CHECK(h.frees == h.packs.load());
  }
  live.check();
}
