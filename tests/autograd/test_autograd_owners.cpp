// Who holds autograd's memory, as the allocator's owners tell it (ebb/alloc.h): a leaf's .grad
// is its gradient, an activation a node saved is saved by that node (and its own again once the
// node lets go), a backward's temporaries are the node's, so snapshots and OOM reports name them;
// and ebb_shutdown refuses while a graph is alive, naming its nodes.
#include <thread>
#include <cmath>
#include <algorithm>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/runtime.h"
#include "sanitizers.hpp"
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

// A memory snapshot's JSON, written to a file of this process's and read back.
std::string snapshot_json() {
  std::string path = "/tmp/ebb-ag-owners-" + std::to_string(getpid()) + ".json";
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::remove(path.c_str());
  return ss.str();
}

// The "owner" object a snapshot gives the block at t's data pointer ("" when not found).
std::string snapshot_owner(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  std::string s = snapshot_json(), key = "{\"address\":" + std::to_string((unsigned long long)(uintptr_t)p) + ",";
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

// ---- tags of in-place clones and unnamed leaves, a full name table, threads ------------------------

namespace {

// The segments part of a snapshot (live blocks and their owners).
std::string snapshot_text() {
  // The segments lists (live blocks), not the rings of past actions ("device_traces", "trace").
  std::string s = snapshot_json(), seg;
  for (size_t at = s.find("\"segments\":["); at != std::string::npos; at = s.find("\"segments\":[", at + 1)) {
    size_t end = std::min(s.find("\"trace\":", at), s.find("\"device_traces\"", at));
    seg += s.substr(at, end == std::string::npos ? std::string::npos : end - at);
  }
  return seg;
}

size_t count_of(const std::string &s, const std::string &what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}
}  // namespace

// An unnamed leaf's gradient is named after its own block's owner name, read when the leaf first
// gets a .grad. A leaf that some node saved (retain_graph, or a second graph not run yet) has its
// block tagged saved/<node> meanwhile: read then, the gradient would be named after that node for
// good.
TEST_CASE("owners: an unnamed leaf saved by a node still gets a gradient named after the leaf", "[autograd][owners]") {
  EbbSession session;
  Tensor u = make(EBB_DEVICE_CPU, EBB_F64, {5}, values(5, 3));  // no scope: other/""
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(u, true));
  Tensor v = make(EBB_DEVICE_CPU, EBB_F64, {5}, values(5, 4));
  Tensor y, l;
  EBB_REQUIRE_OK(ebb_op_mul(u, v, y.out()));  // saves u and v
  CHECK(str(owner_of(u)) == "saved/MulBackward");
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, nullptr, 0));  // the graph (and the tag) stays
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(u, g.out()));
  REQUIRE(g.get() != nullptr);
  CHECK(str(owner_of(g)) == "gradient/leaf [5] f64");
  l.reset(), y.reset();
  CHECK(str(owner_of(u)) == "other/");
  g.reset(), u.reset(), v.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// mul_ saves dst's old value as a clone the node alone holds: memory kept alive for backward,
// which owners.c tags saved/<node> as every other saved tensor, not with the tag of whatever
// scope the op ran in.
TEST_CASE("owners: the copy of dst's old value mul_ keeps for backward is tagged as saved by its node",
          "[autograd][owners][inplace]") {
  EbbSession session;
  const int64_t n = 333;
  Tensor w, x, y;
  EBB_REQUIRE_OK(ebb_tensor_empty_named(EBB_DEVICE_CPU, EBB_F64, 1, &n, EBB_OWNER_PARAMETER, "w", w.out()));
  EBB_REQUIRE_OK(ebb_tensor_fill_(w, 0.5));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "fwd"));
  x = make(EBB_DEVICE_CPU, EBB_F64, {n}, values(n, 5));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 2.0, y.out()));  // y, a non-leaf; saves nothing
  const std::string tag = "{\"category\":\"saved\",\"name\":\"MulInplaceBackward\"}";
  size_t before = count_of(snapshot_text(), tag);
  EBB_REQUIRE_OK(ebb_op_mul_(y, w));  // saves y's old value (a clone) and w (a parameter: keeps its tag)
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  CHECK(str(owner_of(w)) == "parameter/w");
  CHECK(count_of(snapshot_text(), tag) == before + 1);
  Tensor l;
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  CHECK(count_of(snapshot_text(), tag) == before);
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
  auto gw = read(g), wv = read(w);
  for (int64_t i = 0; i < n; i++) CHECK(std::fabs(gw[(size_t)i] - 4 * wv[(size_t)i]) < 1e-12);  // d/dw sum(2w * w)
  g.reset(), l.reset(), y.reset(), x.reset(), w.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

namespace {
int g_hook_calls = 0;
std::string g_hook_msg;
void count_hook(ebb_status, const char *msg, void *) {
  g_hook_calls++;
  g_hook_msg = msg;
}
}  // namespace
// Owner tags are bookkeeping: when the allocator cannot tag (its table of interned names full),
// the op or backward still succeeds, and must then leave ebb_last_error and the error hook alone,
// though each of owners.c's allocator calls fails: a recording op saving a tensor, every node a
// backward runs (the node's name cannot be interned) and a leaf's first gradient.
TEST_CASE("owners: with the owner-name table full, recording and backward succeed without reporting errors",
          "[autograd][owners]") {
  EbbSession session;
  // Fill the process's table of owner names (a fresh process per test case).
  char name[64];
  int filled = 0;
  for (;; filled++) {
    std::snprintf(name, sizeof name, "owner name filler %d", filled);
    ebb_status st = ebb_alloc_owner_push(EBB_OWNER_OTHER, name);
    if (st == EBB_ELIMIT) break;
    EBB_REQUIRE_OK(st);
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());
    REQUIRE(filled < (1 << 17));
  }
  Tensor u = make(EBB_DEVICE_CPU, EBB_F64, {6}, values(6, 3));
  Tensor v = make(EBB_DEVICE_CPU, EBB_F64, {6}, values(6, 4));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(u, true));
  CHECK(ebb_tensor_requires_grad(nullptr, nullptr) == EBB_EINVAL);  // a known last error
  const std::string before = ebb_last_error();
  g_hook_calls = 0;
  ebb_set_error_hook(count_hook, nullptr);
  Tensor y, l;
  EBB_REQUIRE_OK(ebb_op_mul(u, v, y.out()));  // saves u and v: their tag needs "MulBackward"
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  ebb_set_error_hook(nullptr, nullptr);
  INFO("hook saw: " << g_hook_msg);
  CHECK(g_hook_calls == 0);
  CHECK(ebb_last_error() == before);
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(u, g.out()));
  CHECK(read(g) == read(v));
  g.reset(), l.reset(), y.reset(), u.reset(), v.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// Threads whose nodes save one shared activation (and views of it) and let go in any order, by
// backward or by release, and whose leaves get gradients named meanwhile: the block is tagged
// saved while any node holds it and is the activation's again once all let go (tsan: the table
// and the tags change together under one lock).
TEST_CASE("owners: threads saving one activation give it back once all let go", "[autograd][owners][threads]") {
  EbbSession session;
  const int threads = 8, rounds = 200 / kSanitizerScale;
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "shared act"));
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {64}, values(64, 7));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  std::vector<std::thread> ts;
  std::vector<int> bad(threads, 0);
  std::vector<Tensor> ws;  // (made here: Catch's assertions are not for other threads)
  for (int t = 0; t < threads; t++) ws.push_back(make(EBB_DEVICE_CPU, EBB_F64, {64}, values(64, 100 + t)));
  for (int t = 0; t < threads; t++)
    ts.emplace_back([&, t] {
      ebb_tensor_t *w = ws[t].get();
      if (ebb_tensor_set_requires_grad(w, true)) bad[t]++;
      for (int r = 0; r < rounds; r++) {
        Tensor xs, y, y2, l;
        if (ebb_tensor_slice(x, 0, r % 3, 64, 1, xs.out())) bad[t]++;          // a view of the shared block
        Tensor w2;
        if (ebb_tensor_slice(w, 0, r % 3, 64, 1, w2.out())) bad[t]++;
        if (ebb_op_mul(w2, xs, y.out()) || ebb_op_mul(y, xs, y2.out())) bad[t]++;  // two nodes save it
        if (ebb_op_sum(y2, nullptr, 0, false, l.out())) bad[t]++;
        if (r % 2 == 0) {
          const ebb_tensor_t *roots[1] = {l.get()};
          if (ebb_backward(roots, nullptr, 1, r % 4 == 0, nullptr, 0)) bad[t]++;
        }
      }
      Tensor g;
      if (ebb_tensor_grad(w, g.out()) || !g.get()) bad[t]++;
    });
  for (auto &th : ts) th.join();
  for (int t = 0; t < threads; t++) CHECK(bad[t] == 0);
  CHECK(str(owner_of(x)) == "activation/shared act");
  x.reset();
  ws.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}
