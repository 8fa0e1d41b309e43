// A custom op in the graph as a built-in op is: its node "<name>Backward" in the Node API (name,
// sequence number, edges to its inputs' nodes, input metadata, hooks), a span of that name in the
// engine trace, and the allocator's owner tags of what it saves and what its backward allocates,
// each compared with ebb_op_mul's MulBackward in the same situation.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/custom_op.h"
#include "ebb/trace.h"
#include "scaled_mul.h"
#include "tensor_test_util.hpp"
#include "trace_check.hpp"

using namespace ebb_test;

namespace {

const char *const kNode = "ebbtest.scaled_mulBackward";

ebb_custom_op_t *register_smul() {
  ebb_custom_op_def def;
  ebbtest_scaled_mul_def(&def);
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  return op;
}

Tensor call_y(const ebb_custom_op_t *op, const ebb_tensor_t *x, const ebb_tensor_t *w) {
  const ebb_tensor_t *in[2] = {x, w};
  ebb_tensor_t *out[2] = {nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_custom_op_call(op, in, nullptr, out));
  EBB_REQUIRE_OK(ebb_tensor_release(out[1]));
  return Tensor(out[0]);
}

// "category/name" of the block t's data starts (t made by an op or a constructor).
std::string owner_of(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  ebb_owner_cat cat = EBB_OWNER_OTHER;
  const char *n = nullptr;
  EBB_REQUIRE_OK(ebb_alloc_block_owner(p, &cat, &n));
  return std::string(ebb_owner_cat_name(cat)) + "/" + n;
}

int pre_hook_calls = 0;
ebb_status count_pre_hook(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *) {
  pre_hook_calls++;
  return EBB_OK;
}

}  // namespace

TEST_CASE("custom op graph: its node is '<name>Backward' in the Node API with an edge to each input", "[custom_op][node_api]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(dev, EBB_F64, {2, 3}, values(6, 1)), w = make(dev, EBB_F64, {2, 3}, values(6, 2));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    Tensor y = call_y(op, x, w);
    const ebb_node_t *fn = nullptr;
    int nr = -1;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &fn, &nr));
    REQUIRE(fn != nullptr);
    CHECK(std::string(ebb_node_name(fn)) == kNode);
    CHECK(nr == 0);
    uint64_t seq = 0;
    EBB_REQUIRE_OK(ebb_node_sequence_nr(fn, &seq));
    int nn = 0;
    EBB_REQUIRE_OK(ebb_node_num_next(fn, &nn));
    CHECK(nn == 2);
    const ebb_node_t *next = nullptr;
    int input_nr = -1;
    EBB_REQUIRE_OK(ebb_node_next(fn, 0, &next, &input_nr));
    REQUIRE(next != nullptr);
    CHECK(std::string(ebb_node_name(next)) == "AccumulateGrad");
    EBB_REQUIRE_OK(ebb_node_next(fn, 1, &next, &input_nr));
    CHECK(next == nullptr);  // w requires no gradient
    int nin = 0;
    EBB_REQUIRE_OK(ebb_node_num_inputs(fn, &nin));
    CHECK(nin == 2);  // one per output of the op
    ebb_node_input_info meta;
    EBB_REQUIRE_OK(ebb_node_input_meta(fn, 0, &meta));
    CHECK(meta.ndim == 2);
    CHECK(meta.shape[0] == 2);
    CHECK(meta.shape[1] == 3);
    ebb_hook_handle h;
    pre_hook_calls = 0;
    EBB_REQUIRE_OK(ebb_node_register_pre_hook(fn, count_pre_hook, nullptr, &h));
    Tensor s;
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, s.out()));
    EBB_REQUIRE_OK(ebb_backward_one(s));
    CHECK(pre_hook_calls == 1);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("custom op graph: the engine trace holds a span named by its node, as for a built-in op", "[custom_op][trace]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  EBB_REQUIRE_OK(ebb_trace_enable(1 << 14));
  for (int dev : devices()) {
    Tensor x = make(dev, EBB_F32, {8}, values(8, 1)), w = make(dev, EBB_F32, {8}, values(8, 2)), y2, s, s2;
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    Tensor y = call_y(op, x, w);
    EBB_REQUIRE_OK(ebb_op_mul(y, w, y2.out()));
    EBB_REQUIRE_OK(ebb_op_sum(y2, nullptr, 0, false, s.out()));
    EBB_REQUIRE_OK(ebb_backward_one(s));
    if (dev != EBB_DEVICE_CPU) EBB_REQUIRE_OK(ebb_dev_synchronize(dev));
  }
  char path[] = "/tmp/ebb_custom_op_trace_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  EBB_REQUIRE_OK(ebb_trace_export_json(path));
  ebb_trace_disable();
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::remove(path);
  trace_check::Report r;
  trace_check::check(ss.str(), &r);
  for (const auto &e : r.errors) UNSCOPED_INFO(e);
  REQUIRE(r.errors.empty());
  int custom = 0, mul = 0, kernel = 0;
  for (const auto &sl : r.slices) {
    custom += sl.name == kNode;
    mul += sl.name == "MulBackward";
    kernel += sl.name == "ebbtest.smul";  // the op's kernel on the device's stream track
  }
  CHECK(custom == (int)devices().size());
  CHECK(mul == (int)devices().size());
  CHECK(kernel == 2 * ((int)devices().size() - 1));  // on each device: the forward, backward's one gradient
}

TEST_CASE("custom op graph: what it saves and what its backward allocates carry its node's name, as MulBackward's do",
          "[custom_op][owners]") {
  EbbSession session;
  ebb_custom_op_t *op = register_smul();
  for (int dev : devices()) {
    INFO(dev_name(dev));
    const int64_t n = 300;
    Tensor w = make(dev, EBB_F64, {n}, values(n, 3));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "fwd"));
    Tensor x = make(dev, EBB_F64, {n}, values(n, 4)), x2 = make(dev, EBB_F64, {n}, values(n, 5));
    Tensor y = call_y(op, x, w), y2;
    EBB_REQUIRE_OK(ebb_op_mul(x2, w, y2.out()));
    EBB_REQUIRE_OK(ebb_alloc_owner_pop());
    // Saved: the activation x by the custom node, x2 by the built-in one.
    CHECK(owner_of(x) == std::string("saved/") + kNode);
    CHECK(owner_of(x2) == "saved/MulBackward");
    // The forward's outputs are the caller's scope's, a built-in's as a custom op's.
    CHECK(owner_of(y) == "activation/fwd");
    CHECK(owner_of(y2) == "activation/fwd");
    // What each backward makes: the gradient ebb_grad hands back, allocated inside the node.
    Tensor g = make(dev, EBB_F64, {n}, values(n, 6));
    const ebb_tensor_t *wi[1] = {w.get()}, *gr[1] = {g.get()}, *r1[1] = {y.get()}, *r2[1] = {y2.get()};
    ebb_tensor_t *gw = nullptr, *gw2 = nullptr;
    EBB_REQUIRE_OK(ebb_grad(r1, gr, 1, wi, 1, false, false, &gw));
    EBB_REQUIRE_OK(ebb_grad(r2, gr, 1, wi, 1, false, false, &gw2));
    Tensor hold1(gw), hold2(gw2);
    CHECK(owner_of(gw) == std::string("backward/") + kNode);
    CHECK(owner_of(gw2) == "backward/MulBackward");
    // The nodes are gone: what they saved is the activation's again.
    CHECK(owner_of(x) == "activation/fwd");
    CHECK(owner_of(x2) == "activation/fwd");
  }
  CHECK(ebb_autograd_live_nodes() == 0);
}
