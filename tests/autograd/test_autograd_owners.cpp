// Who holds autograd's memory, as the allocator's owners tell it (ebb/alloc.h): a leaf's .grad
// is its gradient, an activation a node saved is saved by that node (and its own again once the
// node lets go), a backward's temporaries are the node's, so snapshots and OOM reports name them;
// and ebb_shutdown refuses while a graph is alive, naming its nodes.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/runtime.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Owner {
  ebb_owner_cat cat = EBB_OWNER_OTHER;
  std::string name;
};

// The owner of the block t's storage starts at (t made by an op or a constructor: offset 0).
Owner owner_of(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  Owner o;
  const char *n = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_block_owner(p, &o.cat, &n));
  o.name = n;
  return o;
}

std::string str(const Owner &o) { return std::string(ebb_owner_cat_name(o.cat)) + "/" + o.name; }

// The "owner" object a snapshot gives the block at t's data pointer ("" when not found).
std::string snapshot_owner(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  std::string path = "/tmp/ebb-ag-owners-" + std::to_string(getpid()) + ".json";
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::remove(path.c_str());
  std::string s = ss.str(), key = "{\"address\":" + std::to_string((unsigned long long)(uintptr_t)p) + ",";
  size_t at = s.find(key);
  if (at == std::string::npos) return "";
  size_t o = s.find("\"owner\":", at), e = s.find('}', o);
  return s.substr(o + 8, e - o - 7);
}

}  // namespace

TEST_CASE("owners: a leaf's .grad is its gradient and an activation a node saved is saved by it until backward",
          "[autograd][owners]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    const int64_t n = 300;  // 2.3 KiB of f64: slab slots on the host pool and the device arena
    Tensor w, x, u, y, e, l;
    EBB_REQUIRE_OK(ebb_tensor_empty_named(dev, EBB_F64, 1, &n, EBB_OWNER_PARAMETER, "w1", w.out()));
    EBB_REQUIRE_OK(ebb_tensor_fill_(w, 0.5));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    u = make(dev, EBB_F64, {n}, values(n, 1));  // an unnamed leaf
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(u, true));
    EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "fwd"));
    x = make(dev, EBB_F64, {n}, values(n, 2));
    EBB_REQUIRE_OK(ebb_op_mul(w, x, y.out()));  // saves w (a parameter) and x (an activation)
    EBB_REQUIRE_OK(ebb_op_mul(y, u, e.out()));  // saves y and u
    Tensor ex;
    EBB_REQUIRE_OK(ebb_op_exp(e, ex.out()));    // saves its output
    EBB_REQUIRE_OK(ebb_op_sum(ex, nullptr, 0, false, l.out()));
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());

    CHECK(str(owner_of(w)) == "parameter/w1");  // a parameter stays one when saved
    CHECK(str(owner_of(x)) == "saved/MulBackward");
    CHECK(str(owner_of(y)) == "saved/MulBackward");
    CHECK(str(owner_of(ex)) == "saved/ExpBackward");
    CHECK(str(owner_of(l)) == "activation/fwd");  // saved by nobody
    CHECK(snapshot_owner(x) == "{\"category\":\"saved\",\"name\":\"MulBackward\"}");

    const ebb_tensor_t *roots[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
    // The nodes let go of what they saved: the blocks are their allocators' again.
    CHECK(str(owner_of(x)) == "activation/fwd");
    CHECK(str(owner_of(y)) == "activation/fwd");
    CHECK(str(owner_of(ex)) == "activation/fwd");
    Tensor gw, gu;
    EBB_REQUIRE_OK(ebb_tensor_grad(w, gw.out()));
    EBB_REQUIRE_OK(ebb_tensor_grad(u, gu.out()));
    REQUIRE(gw.get() != nullptr);
    REQUIRE(gu.get() != nullptr);
    CHECK(str(owner_of(gw)) == "gradient/w1");
    CHECK(str(owner_of(gu)) == "gradient/leaf [300] f64");
    CHECK(snapshot_owner(gw) == "{\"category\":\"gradient\",\"name\":\"w1\"}");
    // A second backward adds into .grad in place: the same block, still the gradient.
    void *p0 = nullptr, *p1 = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_data(gw, &p0));
    Tensor y2, l2;
    EBB_REQUIRE_OK(ebb_op_mul(w, x, y2.out()));
    EBB_REQUIRE_OK(ebb_op_sum(y2, nullptr, 0, false, l2.out()));
    const ebb_tensor_t *r2[1] = {l2.get()};
    EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
    EBB_REQUIRE_OK(ebb_tensor_grad(w, gw.out()));
    EBB_REQUIRE_OK(ebb_tensor_data(gw, &p1));
    CHECK(p0 == p1);
    CHECK(str(owner_of(gw)) == "gradient/w1");
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("owners: a block saved by two nodes is its owner's again only when both let go, and a named leaf's grad takes the name",
          "[autograd][owners]") {
  EbbSession session;
  Tensor w = make(EBB_DEVICE_CPU, EBB_F64, {4}, values(4, 3));
  EBB_REQUIRE_OK(ebb_tensor_set_name(w, "embedding"));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "h"));
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, values(4, 4));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  Tensor a, b, la, lb;
  EBB_REQUIRE_OK(ebb_op_mul(w, x, a.out()));  // saves x
  EBB_REQUIRE_OK(ebb_op_div(w, x, b.out()));  // saves x too
  CHECK(str(owner_of(x)) == "saved/MulBackward");  // the first saver names it
  EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, la.out()));
  EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, lb.out()));
  const ebb_tensor_t *ra[1] = {la.get()};
  EBB_REQUIRE_OK(ebb_backward(ra, nullptr, 1, false, nullptr, 0));
  CHECK(owner_of(x).cat == EBB_OWNER_SAVED);  // DivBackward still holds it
  // A graph released without a backward lets go too.
  lb.reset();
  b.reset();
  CHECK(str(owner_of(x)) == "activation/h");
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
  CHECK(str(owner_of(g)) == "gradient/embedding");
  // retain_graph keeps the saved tensors, and their tag, until the graph goes.
  Tensor c, lc;
  EBB_REQUIRE_OK(ebb_op_mul(w, x, c.out()));
  EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, lc.out()));
  const ebb_tensor_t *rc[1] = {lc.get()};
  EBB_REQUIRE_OK(ebb_backward(rc, nullptr, 1, true, nullptr, 0));
  CHECK(str(owner_of(x)) == "saved/MulBackward");
  lc.reset();
  c.reset();
  CHECK(str(owner_of(x)) == "activation/h");
  la.reset();
  a.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("owners: an OOM during backward names the node that asked, and the engine carries on", "[autograd][owners][oom]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  if (ndev == 0) EBB_SKIP("no device");
  const int64_t n = 6 << 20;  // 24 MiB of f32
  Tensor x, y, l;
  EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &n, 0.25, x.out()));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  // No room for one more tensor of x's size: ExpBackward's product is the first to ask
  // (SumBackward's gradient is an expanded view).
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_REQUIRE_OK(ebb_arena_empty_cache(0));
  ebb_arena_stats s;
  EBB_REQUIRE_OK(ebb_arena_get_stats(0, &s));
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, s.reserved_bytes.current + (4 << 20)));
  const ebb_tensor_t *roots[1] = {l.get()};
  ebb_status st = ebb_backward(roots, nullptr, 1, true, nullptr, 0);
  std::string msg = ebb_last_error();
  INFO(msg);
  CHECK(st == EBB_ENOMEM);
  CHECK(msg.find("ebb_backward: ExpBackward (node ") == 0);
  CHECK(msg.find("out of memory") != std::string::npos);
  CHECK(msg.find("for backward/ExpBackward") != std::string::npos);
  Tensor none;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, none.out()));
  CHECK(none.get() == nullptr);  // the task ended there: nothing reached the leaf
  // With room again the same graph (retained) runs to the end.
  EBB_REQUIRE_OK(ebb_arena_set_limit(0, 0));
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
  REQUIRE(g.get() != nullptr);
  CHECK(str(owner_of(g)) == "gradient/leaf [6291456] f32");
}

TEST_CASE("shutdown: a live graph makes ebb_shutdown refuse, naming its nodes, and shuts down once it is released",
          "[autograd][owners][shutdown]") {
  EBB_REQUIRE_OK(ebb_init());
  ebb_tensor_t *x = nullptr, *y = nullptr, *l = nullptr;
  const int64_t n = 3;
  EBB_REQUIRE_OK(ebb_tensor_ones(EBB_DEVICE_CPU, EBB_F32, 1, &n, &x));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_exp(x, &y));
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, &l));
  // The user drops every tensor but the loss: its graph still holds two nodes, the saved exp and
  // the leaf (through AccumulateGrad).
  EBB_REQUIRE_OK(ebb_tensor_release(x));
  EBB_REQUIRE_OK(ebb_tensor_release(y));
  CHECK(ebb_autograd_live_nodes() == 3);  // SumBackward, ExpBackward, AccumulateGrad
  ebb_status st = ebb_shutdown();
  std::string msg = ebb_last_error();
  INFO(msg);
  CHECK(st == EBB_EBUSY);
  CHECK(msg.find("autograd nodes: 3") != std::string::npos);
  EBB_REQUIRE_OK(ebb_tensor_release(l));
  CHECK(ebb_autograd_live_nodes() == 0);
  EBB_REQUIRE_OK(ebb_shutdown());
}
