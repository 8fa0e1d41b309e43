// Adversarial review of in-place ops, views and inference mode (inplace.c, CopySlices and
// AsStrided) and of owner tags (owners.c): each case here failed on the code it was written
// against, and pins the fix.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
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

// An unnamed leaf's gradient was named after its own block's owner name, read when the leaf
// first gets a .grad; a leaf that some node saved (retain_graph, or a second graph not run yet)
// then had its block tagged saved/<node>, and its gradient was named after that node for good.
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
