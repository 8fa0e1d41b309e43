// In-place ops, views and inference mode (inplace.c, CopySlices and AsStrided) and owner tags
// (owners.c), case by case: each pins one behaviour that a simpler implementation gets wrong
// (said above each case).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

std::string owner_str(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  ebb_owner_cat cat = EBB_OWNER_OTHER;
  const char *n = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_block_owner(p, &cat, &n));
  return std::string(ebb_owner_cat_name(cat)) + "/" + n;
}

// The segments part of a snapshot (live blocks and their owners).
std::string snapshot_text() {
  std::string path = "/tmp/ebb-ag-review2-" + std::to_string(getpid()) + ".json";
  EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::remove(path.c_str());
  // The segments lists (live blocks), not the rings of past actions ("device_traces", "trace").
  std::string s = ss.str(), seg;
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

const ebb_node_t *grad_fn(const ebb_tensor_t *t) {
  const ebb_node_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, nullptr));
  return n;
}

void check_input_meta(const ebb_node_t *n, std::vector<int64_t> shape) {
  INFO(ebb_node_name(n));
  int k = 0;
  EBB_REQUIRE_OK(ebb_node_num_inputs(n, &k));
  REQUIRE(k == 1);
  ebb_node_input_info info;
  EBB_REQUIRE_OK(ebb_node_input_meta(n, 0, &info));
  CHECK(info.dtype == EBB_F64);
  CHECK(info.device == EBB_DEVICE_CPU);
  REQUIRE(info.ndim == (int)shape.size());
  for (size_t d = 0; d < shape.size(); d++) CHECK(info.shape[d] == shape[d]);
}

}  // namespace

// The nodes inplace.c builds (an in-place op's, CopySlices, AsStridedBackward) had in_meta for
// their nin inputs only, while ebb_node_input_meta (and the pre-hook check, and a gradient edge
// used as a root) read entry nin + k, the node's input k: one past the end.
TEST_CASE("review2: ebb_node_input_meta of the nodes in-place ops make describes their output", "[autograd][review2][inplace]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, values(12, 1));
  Tensor z = make(EBB_DEVICE_CPU, EBB_F64, {4}, values(4, 2));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
  Tensor h, r, s;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 1, r.out()));        // r = h[1], [4]
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 1, 0, 2, 1, s.out()));   // s = h[:, 0:2], [3,2]
  EBB_REQUIRE_OK(ebb_op_add_(r, z));
  check_input_meta(grad_fn(h), {3, 4});                        // CopySlices: the base
  check_input_meta(grad_fn(r), {4});                           // AsStridedBackward: the view
  check_input_meta(grad_fn(s), {3, 2});                        // a sibling's AsStridedBackward
  Tensor y;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  EBB_REQUIRE_OK(ebb_op_mul_(y, x));
  CHECK(std::string(ebb_node_name(grad_fn(y))) == "MulInplaceBackward");
  check_input_meta(grad_fn(y), {3, 4});
  // A gradient edge of such a node as a root with no gradient given: its numel comes from there.
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(r, &e));
  CHECK(ebb_backward_edges(&e, nullptr, 1, false, nullptr, 0) == EBB_EINVAL);
  CHECK(std::string(ebb_last_error()).find("4 elements") != std::string::npos);
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  x.reset(), z.reset(), h.reset(), r.reset(), s.reset(), y.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// An unnamed leaf's gradient is named after its own block's owner name, read when the leaf first
// gets a .grad. A leaf that some node saved (retain_graph, or a second graph not run yet) has its
// block tagged saved/<node> meanwhile: read then, the gradient would be named after that node for
// good.
TEST_CASE("review2: an unnamed leaf saved by a node still gets a gradient named after the leaf", "[autograd][review2][owners]") {
  EbbSession session;
  Tensor u = make(EBB_DEVICE_CPU, EBB_F64, {5}, values(5, 3));  // no scope: other/""
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(u, true));
  Tensor v = make(EBB_DEVICE_CPU, EBB_F64, {5}, values(5, 4));
  Tensor y, l;
  EBB_REQUIRE_OK(ebb_op_mul(u, v, y.out()));  // saves u and v
  CHECK(owner_str(u) == "saved/MulBackward");
  EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, nullptr, 0));  // the graph (and the tag) stays
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(u, g.out()));
  REQUIRE(g.get() != nullptr);
  CHECK(owner_str(g) == "gradient/leaf [5] f64");
  l.reset(), y.reset();
  CHECK(owner_str(u) == "other/");
  g.reset(), u.reset(), v.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// mul_ saves dst's old value as a clone the node alone holds: memory kept alive for backward,
// which owners.c tags saved/<node> for every other saved tensor; the clone kept the tag of
// whatever scope the op ran in.
TEST_CASE("review2: the copy of dst's old value mul_ keeps for backward is tagged as saved by its node",
          "[autograd][review2][owners][inplace]") {
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
  CHECK(owner_str(w) == "parameter/w");
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

TEST_CASE("review2: a non-contiguous base with an offset (detach of a slice of a transpose)", "[autograd][review2][inplace][views]") {
  EbbSession session;
  std::vector<double> xv(12), cv(6);
  for (int i = 0; i < 12; i++) xv[i] = i + 1;
  for (int i = 0; i < 6; i++) cv[i] = 10 * (i + 1);
  Tensor xc = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, xv);
  Tensor c = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, cv);
  Tensor src = make(EBB_DEVICE_CPU, EBB_F64, {2}, {0.5, -2.0});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(src, true));
  for (int op = 0; op < 2; op++) {
    INFO("op " << op);
    Tensor t, s, d, v, p, l, dd;
    EBB_REQUIRE_OK(ebb_tensor_transpose(xc, 0, 1, t.out()));      // [4,3]: t[i][j] = x[j][i]
    EBB_REQUIRE_OK(ebb_tensor_slice(t, 0, 1, 3, 1, s.out()));     // [2,3]: s[i][j] = x[j][i+1]
    EBB_REQUIRE_OK(ebb_tensor_detach(s, d.out()));                // not a view for autograd
    EBB_REQUIRE_OK(ebb_tensor_clone(d, dd.out()));                // d's old values
    auto old = read(dd);
    EBB_REQUIRE_OK(ebb_tensor_select(d, 1, 2, v.out()));          // v[i] = d[i][2] = x[2][i+1]
    if (op == 0) EBB_REQUIRE_OK(ebb_tensor_copy_(v, src));
    else EBB_REQUIRE_OK(ebb_op_mul_(v, src));
    EBB_REQUIRE_OK(ebb_op_mul(d, c, p.out()));
    EBB_REQUIRE_OK(ebb_op_sum(p, nullptr, 0, false, l.out()));
    const ebb_tensor_t *roots[1] = {l.get()};
    const ebb_tensor_t *in[1] = {src.get()};
    ebb_tensor_t *g[1] = {nullptr};
    EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, in, 1, true, false, g));
    Tensor gg(g[0]);
    auto r = read(gg);
    REQUIRE(r.size() == 2);
    for (int i = 0; i < 2; i++) {
      double want = cv[i * 3 + 2] * (op == 0 ? 1.0 : old[i * 3 + 2]);
      CHECK(r[i] == Approx(want));
    }
    // the rest of d: x restored by hand for the next round
    bool was;
    ebb_grad_set_enabled(false, &was);
    Tensor xr = make(EBB_DEVICE_CPU, EBB_F64, {3, 4}, xv);
    EBB_REQUIRE_OK(ebb_tensor_copy_(xc, xr));
    ebb_grad_set_enabled(was, nullptr);
  }
  xc.reset(), c.reset(), src.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("review2: copy_ into a view from another dtype and another device", "[autograd][review2][inplace][views]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    Tensor src = make(dev, EBB_F32, {2}, {5, 7});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(src, true));
    Tensor h, v, hh, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
    EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 1, 3, 1, v.out()));
    EBB_REQUIRE_OK(ebb_tensor_copy_(v, src));  // h = [2, 5, 7]
    EBB_REQUIRE_OK(ebb_op_mul(h, h, hh.out()));
    EBB_REQUIRE_OK(ebb_op_sum(hh, nullptr, 0, false, l.out()));
    const ebb_tensor_t *roots[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
    Tensor gx, gs;
    EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
    EBB_REQUIRE_OK(ebb_tensor_grad(src, gs.out()));
    REQUIRE(gs.get() != nullptr);
    CHECK(dtype_of(gs) == EBB_F32);
    CHECK(read(gx) == std::vector<double>{8, 0, 0});
    CHECK(read(gs) == std::vector<double>{10, 14});
  }
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("review2: an inference src refused for mul_ on a view leaves everything as it was", "[autograd][review2][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 2, 3});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  Tensor inf;
  bool was;
  ebb_inference_mode_set_enabled(true, &was);
  inf = make(EBB_DEVICE_CPU, EBB_F64, {2}, {4, 5});
  ebb_inference_mode_set_enabled(was, nullptr);
  Tensor h, v, w;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, v.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 1, 3, 1, w.out()));
  long nodes = ebb_autograd_live_nodes(), handles = ebb_debug_live_handles();
  const ebb_node_t *hn = grad_fn(h), *vn = grad_fn(v);
  uint64_t ver = 0, ver2 = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(h, &ver));
  CHECK(ebb_op_mul_(v, inf) == EBB_EINVAL);
  CHECK(std::string(ebb_last_error()).find("inference") != std::string::npos);
  EBB_REQUIRE_OK(ebb_tensor_version(h, &ver2));
  CHECK(ver == ver2);
  CHECK(grad_fn(h) == hn);
  CHECK(grad_fn(v) == vn);
  CHECK(read(h) == std::vector<double>{2, 4, 6});
  CHECK(ebb_autograd_live_nodes() == nodes);
  CHECK(ebb_debug_live_handles() == handles);
  // add_ saves nothing: allowed
  EBB_REQUIRE_OK(ebb_op_add_(v, inf));
  Tensor l;
  EBB_REQUIRE_OK(ebb_op_sum(w, nullptr, 0, false, l.out()));  // w = [8, 6]
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor gx;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  CHECK(read(gx) == std::vector<double>{0, 2, 2});
  l.reset(), h.reset(), v.reset(), w.reset(), x.reset(), inf.reset(), gx.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("review2: two views changed in turn, the base released, a stale view and a view of a view", "[autograd][review2][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor a = make(EBB_DEVICE_CPU, EBB_F64, {3}, {10, 20, 30});
  Tensor b = make(EBB_DEVICE_CPU, EBB_F64, {2}, {-1, -2});
  for (auto *t : {&x, &a, &b}) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(*t, true));
  Tensor h, r0, c2, tr, q, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 1.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 0, r0.out()));      // row 0
  EBB_REQUIRE_OK(ebb_tensor_transpose(h, 0, 1, tr.out()));   // [3,2]
  EBB_REQUIRE_OK(ebb_tensor_select(tr, 0, 2, c2.out()));     // column 2, a view of a view
  EBB_REQUIRE_OK(ebb_op_mul_(r0, a));                        // h[0] *= a: [10, 40, 90]
  EBB_REQUIRE_OK(ebb_op_mul_(c2, b));                        // h[:,2] *= b: h[0][2] = -90, h[1][2] = -12
  h.reset();
  tr.reset();
  // loss = sum(r0 * r0): r0 = [10, 40, -90] = [x00 a0, x01 a1, x02 a2 b0]
  EBB_REQUIRE_OK(ebb_op_mul(r0, r0, q.out()));
  EBB_REQUIRE_OK(ebb_op_sum(q, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  Tensor gx, ga, gb;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(a, ga.out()));
  EBB_REQUIRE_OK(ebb_tensor_grad(b, gb.out()));
  // d/dx00 = 2*10*a0 = 200; d/dx01 = 2*40*20 = 1600; d/dx02 = 2*(-90)*a2*b0 = 5400; row 1: 0
  CHECK(read(gx) == std::vector<double>{200, 1600, 5400, 0, 0, 0});
  // d/da = 2 r0 * x0 * [1,1,b0]: [2*10*1, 2*40*2, 2*-90*3*-1]
  CHECK(read(ga) == std::vector<double>{20, 160, 540});
  // d/db0 = 2*(-90) * 90 = -16200; d/db1 = 0 (h[1][2] not in the loss)
  CHECK(read(gb) == std::vector<double>{-16200, 0});
  l.reset(), q.reset(), r0.reset(), c2.reset(), x.reset(), a.reset(), b.reset(), gx.reset(), ga.reset(), gb.reset();
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
// the op or backward still succeeds, and must then leave ebb_last_error and the error hook alone.
// owners.c's allocator calls set both: a recording op saving a tensor, every node a backward ran
// (the node's name could not be interned) and a leaf's first gradient each reported a failure.
TEST_CASE("review2: with the owner-name table full, recording and backward succeed without reporting errors",
          "[autograd][review2][owners]") {
  EbbSession session;
  // Fill the process's table of owner names (a fresh process per test case).
  char name[64];
  int filled = 0;
  for (;; filled++) {
    std::snprintf(name, sizeof name, "review2 filler %d", filled);
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

// ops/elementwise.c ebb__inplace: were add_ and mul_ to run the kernel straight from src into
// dst, a src view that partly overlaps dst (a row of dst broadcast over it) would be read after
// some of its elements were written, so the result would depend on the order of the writes, and
// autograd's node (which takes src's value before the op) would describe a value dst does not
// hold. So src on dst's storage in another geometry is read through a copy; identical aliasing
// (x.add_(x)) needs none. copy_ is checked too.
TEST_CASE("review2: add_ from a view that partly overlaps dst reads src as it was before the op",
          "[autograd][review2][inplace]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor c = make(dev, EBB_F64, {3, 2}, {1, 2, 3, 4, 5, 6}), s, s2;
    EBB_REQUIRE_OK(ebb_tensor_slice(c, 0, 0, 2, 1, s.out()));   // rows 0, 1
    EBB_REQUIRE_OK(ebb_tensor_slice(c, 0, 1, 3, 1, s2.out()));  // rows 1, 2
    EBB_REQUIRE_OK(ebb_tensor_copy_(s2, s));                     // rows 1, 2 = the old rows 0, 1
    CHECK(read(c) == std::vector<double>{1, 2, 1, 2, 3, 4});
    Tensor h = make(dev, EBB_F64, {3, 2}, {1, 2, 3, 4, 5, 6}), r;
    EBB_REQUIRE_OK(ebb_tensor_select(h, 0, 0, r.out()));  // r = h[0] = [1, 2], broadcast over h
    ebb_status st = ebb_op_add_(h, r);
    // Either refused, or h + (its row 0 as it was); never row 0 doubled added to the rest.
    if (st == EBB_OK) CHECK(read(h) == std::vector<double>{2, 4, 4, 6, 6, 8});
    else CHECK(st == EBB_EINVAL);
  }
}

// A view whose base was changed in place through another view takes its grad_fn again from the
// base when next read (ebb__grad_fn_now). ebb_tensor_gradient_edge, ebb_register_multi_grad_hook
// ("all") and ebb_register_logging_hooks read m->grad_fn directly: a stale view's old node, which
// is not in the graph its later uses build.
TEST_CASE("review2: a stale view's gradient edge is the node its uses build on", "[autograd][review2][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4});
  Tensor z = make(EBB_DEVICE_CPU, EBB_F64, {2}, {10, 20});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
  Tensor h, s, r, m, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, s.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 2, 4, 1, r.out()));
  EBB_REQUIRE_OK(ebb_op_add_(r, z));  // s is stale now
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(s, &e));
  CHECK(e.node == grad_fn(s));
  CHECK(std::string(ebb_node_name(e.node)) == "AsStridedBackward");
  EBB_REQUIRE_OK(ebb_op_mul_scalar(s, 3.0, m.out()));
  EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
  ebb_gradient_edge le;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(l, &le));
  ebb_tensor_t *g[1] = {nullptr};
  ebb_status st = ebb_grad_edges(&le, nullptr, 1, &e, 1, false, false, g);
  INFO(ebb_last_error());
  CHECK(st == EBB_OK);
  Tensor gg(g[0]);
  if (st == EBB_OK) CHECK(read(gg) == std::vector<double>{3, 3});
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&le));
  gg.reset(), l.reset(), m.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

namespace {
struct MgSeen {
  int calls = 0;
  std::vector<bool> got;
};
ebb_status mg_record(const ebb_tensor_t *const *grads, int n, void *user) {
  auto *s = static_cast<MgSeen *>(user);
  s->calls++;
  s->got.clear();
  for (int i = 0; i < n; i++) s->got.push_back(grads[i] != nullptr);
  return EBB_OK;
}
}  // namespace

TEST_CASE("review2: a multi-grad hook (all) over a stale view waits for the view's gradient", "[autograd][review2][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4});
  Tensor z = make(EBB_DEVICE_CPU, EBB_F64, {2}, {10, 20});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
  Tensor h, s, r, m, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, s.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 2, 4, 1, r.out()));
  EBB_REQUIRE_OK(ebb_op_add_(r, z));  // s is stale now
  MgSeen seen;
  ebb_hook_handle hh;
  ebb_tensor_t *ts[2] = {s.get(), x.get()};
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 2, mg_record, &seen, EBB_MULTI_GRAD_ALL, &hh));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(s, 3.0, m.out()));
  EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  CHECK(seen.calls == 1);
  CHECK(seen.got == std::vector<bool>{true, true});
  EBB_REQUIRE_OK(ebb_hook_remove(hh));
  l.reset(), m.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("review2: logging hooks from a stale view cover the nodes its backward runs", "[autograd][review2][inplace][views]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {4}, {1, 2, 3, 4});
  Tensor z = make(EBB_DEVICE_CPU, EBB_F64, {2}, {10, 20});
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
  Tensor h, s, r;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, h.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 0, 2, 1, s.out()));
  EBB_REQUIRE_OK(ebb_tensor_slice(h, 0, 2, 4, 1, r.out()));
  EBB_REQUIRE_OK(ebb_op_add_(r, z));  // s is stale now
  std::vector<std::string> lines;
  ebb_hook_handle lh;
  const ebb_tensor_t *lroots[1] = {s.get()};
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(
      lroots, 1, [](const char *line, void *u) { static_cast<std::vector<std::string> *>(u)->push_back(line); }, &lines, &lh));
  const ebb_tensor_t *roots[1] = {s.get()};
  Tensor ones = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 1});
  const ebb_tensor_t *gr[1] = {ones.get()};
  EBB_REQUIRE_OK(ebb_backward(roots, gr, 1, false, nullptr, 0));
  std::string all;
  for (auto &ln : lines) all += ln + "\n";
  INFO(all);
  CHECK(all.find("AsStridedBackward") != std::string::npos);
  CHECK(all.find("CopySlices") != std::string::npos);
  EBB_REQUIRE_OK(ebb_hook_remove(lh));
  Tensor gx;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
  CHECK(read(gx) == std::vector<double>{2, 2, 0, 0});
  gx.reset(), ones.reset(), s.reset(), r.reset(), h.reset(), x.reset(), z.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}

// Threads whose nodes save one shared activation (and views of it) and let go in any order, by
// backward or by release, and whose leaves get gradients named meanwhile: the block is tagged
// saved while any node holds it and is the activation's again once all let go (tsan: the table
// and the tags change together under one lock).
TEST_CASE("review2: threads saving one activation give it back once all let go", "[autograd][review2][owners][threads]") {
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
  CHECK(owner_str(x) == "activation/shared act");
  x.reset();
  ws.clear();
  CHECK(ebb_autograd_live_nodes() == 0);
  CHECK(ebb_debug_live_handles() == 0);
}
