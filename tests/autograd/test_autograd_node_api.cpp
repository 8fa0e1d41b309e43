// The Node API (ebb/autograd.h): input and user metadata, node pre/post hooks and their order,
// gradient edges, the running backward (current node, task id, will_execute), increment_version,
// multi-grad hooks (all/any, per graph task, across threads) and whole-graph logging hooks.
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/stream.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

std::vector<std::string> g_log;

Tensor leaf(std::vector<double> v) {
  Tensor t = make(EBB_DEVICE_CPU, EBB_F64, {static_cast<int64_t>(v.size())}, v);
  REQUIRE(ebb_tensor_set_requires_grad(t, true) == EBB_OK);
  return t;
}

const ebb_node_t *grad_fn(const ebb_tensor_t *t) {
  const ebb_node_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, nullptr));
  REQUIRE(n != nullptr);
  return n;
}

std::vector<double> grad_of(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  return g.get() ? read(g) : std::vector<double>{};
}

Tensor sum(const ebb_tensor_t *t) {
  Tensor l;
  EBB_REQUIRE_OK(ebb_op_sum(t, nullptr, 0, false, l.out()));
  return l;
}

ebb_status backward(const ebb_tensor_t *root, std::vector<const ebb_tensor_t *> inputs = {}, bool retain = false) {
  const ebb_tensor_t *r[1] = {root};
  return ebb_backward(r, nullptr, 1, retain, inputs.empty() ? nullptr : inputs.data(), (int)inputs.size());
}

// A pre-hook that logs its tag and the gradients it sees, and scales gradient 0 by `scale` != 1.
struct Pre {
  explicit Pre(std::string t, double s = 1.0) : tag(std::move(t)), scale(s) {}
  std::string tag;
  double scale = 1.0;
  std::vector<std::vector<double>> seen;
  ebb_hook_handle remove{0};  // removed by this hook when set
  int64_t task = -2;
  const ebb_node_t *current = nullptr;
};

ebb_status pre_hook(const ebb_node_t *, const ebb_tensor_t *const *grads, int n, ebb_tensor_t **replace, void *user) {
  auto *p = static_cast<Pre *>(user);
  g_log.push_back(p->tag);
  p->task = ebb_autograd_current_task_id();
  ebb_autograd_current_node(&p->current);
  p->seen.clear();
  for (int i = 0; i < n; i++) p->seen.push_back(grads[i] ? read(grads[i]) : std::vector<double>{});
  if (p->remove.id) {
    ebb_status st = ebb_hook_remove(p->remove);
    if (st) return st;
    p->remove.id = 0;
  }
  if (p->scale != 1.0 && grads[0]) return ebb_op_mul_scalar(grads[0], p->scale, &replace[0]);
  return EBB_OK;
}

struct Post {
  explicit Post(std::string t, double a = 0.0) : tag(std::move(t)), add(a) {}
  std::string tag;
  double add = 0.0;  // != 0: replace grad_inputs[0] with it + add
  std::vector<std::vector<double>> ins, outs;
};

ebb_status post_hook(const ebb_node_t *, const ebb_tensor_t *const *gin, int nin, const ebb_tensor_t *const *gout, int nout,
                     ebb_tensor_t **replace, void *user) {
  auto *p = static_cast<Post *>(user);
  g_log.push_back(p->tag);
  p->ins.clear();
  p->outs.clear();
  for (int i = 0; i < nin; i++) p->ins.push_back(gin[i] ? read(gin[i]) : std::vector<double>{});
  for (int i = 0; i < nout; i++) p->outs.push_back(gout[i] ? read(gout[i]) : std::vector<double>{});
  if (p->add != 0.0 && nin > 0 && gin[0]) return ebb_op_add_scalar(gin[0], p->add, &replace[0]);
  return EBB_OK;
}

ebb_status tensor_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  g_log.push_back(*static_cast<std::string *>(user));
  return EBB_OK;
}

ebb_status post_acc_hook(const ebb_tensor_t *, void *user) {
  g_log.push_back(*static_cast<std::string *>(user));
  return EBB_OK;
}

ebb_status wrong_shape_pre(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **replace, void *) {
  const int64_t n = 7;
  return ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 1, &n, &replace[0]);
}

ebb_status wrong_dtype_post(const ebb_node_t *, const ebb_tensor_t *const *, int, const ebb_tensor_t *const *, int,
                            ebb_tensor_t **replace, void *) {
  const int64_t n = 3;
  return ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, &n, &replace[0]);
}

ebb_status failing_pre(const ebb_node_t *, const ebb_tensor_t *const *, int, ebb_tensor_t **, void *) {
  return ebb_tensor_set_requires_grad(nullptr, true);  // fails with a message of ebb's own
}

}  // namespace

TEST_CASE("node api: input metadata gives each input's shape, dtype, device and forward stream", "[autograd][node_api]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, values(6, 1)), y;
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, y.out()));
  const ebb_node_t *n = grad_fn(y);
  int ni = 0;
  EBB_REQUIRE_OK(ebb_node_num_inputs(n, &ni));
  CHECK(ni == 1);
  ebb_node_input_info info;
  EBB_REQUIRE_OK(ebb_node_input_meta(n, 0, &info));
  CHECK(info.ndim == 2);
  CHECK(info.shape[0] == 2);
  CHECK(info.shape[1] == 3);
  CHECK(info.dtype == EBB_F32);
  CHECK(info.device == EBB_DEVICE_CPU);
  CHECK(info.stream_id == 0);
  // Two outputs: max_dim's values (f32) and indices (i64) are inputs 0 and 1 of its node.
  Tensor v, idx;
  EBB_REQUIRE_OK(ebb_op_max_dim(x, 1, false, v.out(), idx.out()));
  EBB_REQUIRE_OK(ebb_node_num_inputs(grad_fn(v), &ni));
  CHECK(ni == 2);
  EBB_REQUIRE_OK(ebb_node_input_meta(grad_fn(v), 1, &info));
  CHECK(info.dtype == EBB_I64);
  CHECK(info.ndim == 1);
  CHECK(info.shape[0] == 2);
  // A leaf's AccumulateGrad: one input, the leaf's metadata.
  const ebb_node_t *acc = nullptr;
  int nr = -1;
  EBB_REQUIRE_OK(ebb_node_next(n, 0, &acc, &nr));
  EBB_REQUIRE_OK(ebb_node_num_inputs(acc, &ni));
  CHECK(ni == 1);
  EBB_REQUIRE_OK(ebb_node_input_meta(acc, 0, &info));
  CHECK(info.ndim == 2);
  CHECK(info.dtype == EBB_F32);
  // Bad input.
  EBB_CHECK_FAILS(ebb_node_num_inputs(nullptr, &ni), EBB_EINVAL, "node is NULL");
  EBB_CHECK_FAILS(ebb_node_num_inputs(n, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_node_input_meta(n, 1, &info), EBB_EINVAL, "expected 0 <= i < 1");
  EBB_CHECK_FAILS(ebb_node_input_meta(n, -1, &info), EBB_EINVAL, "MulScalarBackward");
  EBB_CHECK_FAILS(ebb_node_input_meta(n, 0, nullptr), EBB_EINVAL, "out is NULL");
}

TEST_CASE("node api: the forward stream is the current stream of the device when the op ran", "[autograd][node_api][device]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  if (ndev < 1) EBB_SKIP("no device");
  ebb_stream_t *side = nullptr, *def = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &side));
  EBB_REQUIRE_OK(ebb_stream_default(0, &def));
  uint64_t side_id = 0, def_id = 0;
  EBB_REQUIRE_OK(ebb_stream_id(side, &side_id));
  EBB_REQUIRE_OK(ebb_stream_id(def, &def_id));
  REQUIRE(side_id != def_id);
  Tensor x = make(0, EBB_F32, {4}, values(4, 2)), y, z;
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));  // on the default stream
  ebb_stream_guard g;
  EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, side));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(side, def));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(y, 2.0, z.out()));  // on the side stream
  EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
  ebb_node_input_info info;
  EBB_REQUIRE_OK(ebb_node_input_meta(grad_fn(y), 0, &info));
  CHECK(info.device == 0);
  CHECK(info.stream_id == def_id);
  EBB_REQUIRE_OK(ebb_node_input_meta(grad_fn(z), 0, &info));
  CHECK(info.stream_id == side_id);
  EBB_REQUIRE_OK(ebb_stream_synchronize(side));
}

namespace {
struct Destroyed {
  std::mutex mu;
  std::vector<std::string> log;
};
Destroyed *g_destroyed;
void destroy_value(void *v) {
  auto *s = static_cast<std::string *>(v);
  std::lock_guard<std::mutex> lk(g_destroyed->mu);
  g_destroyed->log.push_back(*s);
  delete s;
}
}  // namespace

TEST_CASE("node api: user metadata lives as long as the node - overwrite and remove run the destructor", "[autograd][node_api]") {
  EbbSession session;
  Destroyed d;
  g_destroyed = &d;
  Tensor x = leaf({1, 2}), y = Tensor();
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  const ebb_node_t *n = grad_fn(y);
  EBB_REQUIRE_OK(ebb_node_metadata_set(n, "a", new std::string("a1"), destroy_value));
  void *v = nullptr;
  EBB_REQUIRE_OK(ebb_node_metadata_get(n, "a", &v));
  CHECK(*static_cast<std::string *>(v) == "a1");
  EBB_REQUIRE_OK(ebb_node_metadata_set(n, "a", new std::string("a2"), destroy_value));  // overwrite: a1 goes
  CHECK(d.log == std::vector<std::string>{"a1"});
  EBB_REQUIRE_OK(ebb_node_metadata_get(n, "a", &v));
  CHECK(*static_cast<std::string *>(v) == "a2");
  EBB_REQUIRE_OK(ebb_node_metadata_set(n, "b", new std::string("b1"), destroy_value));
  EBB_REQUIRE_OK(ebb_node_metadata_remove(n, "a"));
  CHECK(d.log == std::vector<std::string>{"a1", "a2"});
  EBB_CHECK_FAILS(ebb_node_metadata_remove(n, "a"), EBB_ENOTFOUND, "\"a\"");
  EBB_CHECK_FAILS(ebb_node_metadata_get(n, "a", &v), EBB_ENOTFOUND, "ExpBackward has no metadata \"a\"");
  EBB_REQUIRE_OK(ebb_node_metadata_set(n, "plain", &d, nullptr));  // no destructor
  EBB_CHECK_FAILS(ebb_node_metadata_set(nullptr, "k", nullptr, nullptr), EBB_EINVAL, "node is NULL");
  EBB_CHECK_FAILS(ebb_node_metadata_set(n, nullptr, nullptr, nullptr), EBB_EINVAL, "key is NULL");
  EBB_CHECK_FAILS(ebb_node_metadata_get(n, "b", nullptr), EBB_EINVAL, "value is NULL");
  // A backward does not end the metadata; the node's free does.
  Tensor l = sum(y);
  EBB_REQUIRE_OK(backward(l));
  CHECK(d.log.size() == 2);
  y.reset();
  CHECK(d.log.size() == 2);  // l's graph still holds the node
  l.reset();
  CHECK(d.log == std::vector<std::string>{"a1", "a2", "b1"});
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("node api: metadata calls on one node from many threads are serialised", "[autograd][node_api][threads]") {
  EbbSession session;
  Destroyed d;
  g_destroyed = &d;
  Tensor x = leaf({1}), y;
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  const ebb_node_t *n = grad_fn(y);
  const int threads = 4, rounds = kSanitized ? 200 : 2000;
  std::atomic<int> bad{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] {
      std::string mine = "k" + std::to_string(t);
      for (int i = 0; i < rounds; i++) {
        if (ebb_node_metadata_set(n, mine.c_str(), new std::string(mine), destroy_value)) bad++;
        if (ebb_node_metadata_set(n, "shared", new std::string("s"), destroy_value)) bad++;
        void *v = nullptr;
        if (ebb_node_metadata_get(n, mine.c_str(), &v) || *static_cast<std::string *>(v) != mine) bad++;
      }
    });
  for (auto &th : pool) th.join();
  CHECK(bad.load() == 0);
  y.reset();  // the last values go with the node
  CHECK(d.log.size() == (size_t)(2 * threads * rounds));
}

TEST_CASE("node hooks: pre-hooks may replace the gradients a node gets, post-hooks the ones it returns", "[autograd][node_api][hooks]") {
  EbbSession session;
  g_log.clear();
  Tensor x = leaf({1, 2, 3}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  l = sum(y);
  Pre pre{"pre", 2.0};
  Post post{"post", 1.0};
  std::string th = "tensor";
  ebb_hook_handle hp, hq, ht;
  EBB_REQUIRE_OK(ebb_node_register_post_hook(grad_fn(y), post_hook, &post, &hq));  // registered first, runs after
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), pre_hook, &pre, &hp));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(y, tensor_hook, &th, &ht));
  EBB_REQUIRE_OK(ebb_tensor_retain_grad(y));
  EBB_REQUIRE_OK(backward(l));
  // Tensor hook, retain_grad (y.grad unscaled), pre-hook (x2), the node (x3), post-hook (+1).
  CHECK(g_log == std::vector<std::string>{"tensor", "pre", "post"});
  CHECK(grad_of(y) == std::vector<double>{1, 1, 1});
  CHECK(pre.seen == std::vector<std::vector<double>>{{1, 1, 1}});
  CHECK(post.outs == std::vector<std::vector<double>>{{2, 2, 2}});  // after the pre-hook
  CHECK(post.ins == std::vector<std::vector<double>>{{6, 6, 6}});
  CHECK(grad_of(x) == std::vector<double>{7, 7, 7});
  CHECK(pre.current == grad_fn(y));
  EBB_REQUIRE_OK(ebb_hook_remove(hp));
  EBB_REQUIRE_OK(ebb_hook_remove(hq));
  EBB_CHECK_FAILS(ebb_hook_remove(hq), EBB_EINVAL, "is not registered");
  EBB_REQUIRE_OK(ebb_hook_remove(ht));
}

TEST_CASE("node hooks: around an AccumulateGrad: tensor hook, pre-hook, post-accumulate hook, post-hook", "[autograd][node_api][hooks]") {
  EbbSession session;
  g_log.clear();
  Tensor a = leaf({1}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 1.0, y.out()));
  l = sum(y);
  ebb_gradient_edge e;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(a, &e));
  CHECK(std::string(ebb_node_name(e.node)) == "AccumulateGrad");
  std::string tt = "tensor pre", pa = "post acc";
  Pre pre{"acc pre", 2.0};  // the gradient 1 becomes 2
  Post post{"acc post"};
  ebb_hook_handle h[4];
  EBB_REQUIRE_OK(ebb_node_register_post_hook(e.node, post_hook, &post, &h[0]));
  EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(a, post_acc_hook, &pa, &h[1]));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(e.node, pre_hook, &pre, &h[2]));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(a, tensor_hook, &tt, &h[3]));
  EBB_REQUIRE_OK(backward(l));
  CHECK(g_log == std::vector<std::string>{"tensor pre", "acc pre", "post acc", "acc post"});
  CHECK(grad_of(a) == std::vector<double>{2});
  CHECK(post.ins.empty());                                      // an AccumulateGrad returns nothing
  CHECK(post.outs == std::vector<std::vector<double>>{{2}});    // what it accumulated
  for (auto &x : h) EBB_REQUIRE_OK(ebb_hook_remove(x));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&e));
  CHECK(e.node == nullptr);
}

TEST_CASE("node hooks: registration order - a hook removed during the backward does not run", "[autograd][node_api][hooks]") {
  EbbSession session;
  g_log.clear();
  Tensor x = leaf({1, 2}), y, l;
  EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
  l = sum(y);
  Pre first{"first"}, second{"second"}, third{"third"};
  ebb_hook_handle h1, h2, h3;
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), pre_hook, &first, &h1));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), pre_hook, &second, &h2));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), pre_hook, &third, &h3));
  first.remove = h2;  // the first removes the second before it runs
  EBB_REQUIRE_OK(backward(l, {}, true));
  CHECK(g_log == std::vector<std::string>{"first", "third"});
  EBB_CHECK_FAILS(ebb_hook_remove(h2), EBB_EINVAL, "is not registered");
  g_log.clear();
  EBB_REQUIRE_OK(backward(l));
  CHECK(g_log == std::vector<std::string>{"first", "third"});
  EBB_REQUIRE_OK(ebb_hook_remove(h1));
  EBB_REQUIRE_OK(ebb_hook_remove(h3));
  // Bad input.
  EBB_CHECK_FAILS(ebb_node_register_pre_hook(nullptr, pre_hook, &first, &h1), EBB_EINVAL, "node is NULL");
  EBB_CHECK_FAILS(ebb_node_register_pre_hook(grad_fn(y), nullptr, &first, &h1), EBB_EINVAL, "fn is NULL");
  EBB_CHECK_FAILS(ebb_node_register_post_hook(grad_fn(y), post_hook, &first, nullptr), EBB_EINVAL, "out is NULL");
}

TEST_CASE("node hooks: a replacement of the wrong shape or dtype fails the backward naming the node", "[autograd][node_api][hooks][errors]") {
  EbbSession session;
  Tensor x = leaf({1, 2, 3}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, y.out()));
  l = sum(y);
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), wrong_shape_pre, nullptr, &h));
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "MulScalarBackward (node");
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "replaced gradient[0] (f64[3] on the CPU) with the replacement (f64[7] on the CPU)");
  EBB_REQUIRE_OK(ebb_hook_remove(h));
  EBB_REQUIRE_OK(ebb_node_register_post_hook(grad_fn(y), wrong_dtype_post, nullptr, &h));
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "a post-hook");
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "replaced grad_input[0] (f64[3] on the CPU) with the replacement (f32[3] on the CPU)");
  EBB_REQUIRE_OK(ebb_hook_remove(h));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(y), failing_pre, nullptr, &h));
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "t is NULL");
  EBB_REQUIRE_OK(ebb_hook_remove(h));
  Tensor none;
  EBB_REQUIRE_OK(ebb_tensor_grad(x, none.out()));
  CHECK(none.get() == nullptr);  // nothing reached .grad
  EBB_REQUIRE_OK(backward(l));   // the graph and engine carry on
  CHECK(grad_of(x) == std::vector<double>{3, 3, 3});
}

TEST_CASE("node hooks: pre-hooks run only for nodes the backward executes", "[autograd][node_api][hooks]") {
  EbbSession session;
  g_log.clear();
  Tensor a = leaf({1}), b = leaf({2}), ya, yb, s, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, ya.out()));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(b, 3.0, yb.out()));
  EBB_REQUIRE_OK(ebb_op_add(ya, yb, s.out()));
  l = sum(s);
  ebb_gradient_edge ea, eb;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(a, &ea));
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(b, &eb));
  Pre pa{"a mul"}, pb{"b mul"}, accb{"b acc"}, acca{"a acc"};
  std::string ta = "a tensor";
  ebb_hook_handle h[5];
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(ya), pre_hook, &pa, &h[0]));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(grad_fn(yb), pre_hook, &pb, &h[1]));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(eb.node, pre_hook, &accb, &h[2]));
  EBB_REQUIRE_OK(ebb_node_register_pre_hook(ea.node, pre_hook, &acca, &h[3]));
  EBB_REQUIRE_OK(ebb_tensor_register_hook(a, tensor_hook, &ta, &h[4]));
  EBB_REQUIRE_OK(backward(l, {a.get()}, true));
  CHECK(g_log == std::vector<std::string>{"a mul", "a tensor", "a acc"});
  CHECK(grad_of(b).empty());
  // ebb_grad: a's AccumulateGrad is reached for the capture but does not execute.
  g_log.clear();
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {a.get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(r, nullptr, 1, in, 1, false, false, g));
  Tensor gt(g[0]);
  CHECK(read(gt) == std::vector<double>{2});
  CHECK(g_log == std::vector<std::string>{"a mul", "a tensor"});
  for (auto &x : h) EBB_REQUIRE_OK(ebb_hook_remove(x));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&ea));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&eb));
}

TEST_CASE("gradient edges: grad and backward through edges - an edge keeps its node alive", "[autograd][node_api][edges]") {
  EbbSession session;
  Tensor x = leaf({1, 2, 3}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul(x, x, y.out()));  // y = x^2
  l = sum(y);
  ebb_gradient_edge ex, ey, el;
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(x, &ex));
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(y, &ey));
  EBB_REQUIRE_OK(ebb_tensor_gradient_edge(l, &el));
  CHECK(ey.node == grad_fn(y));
  CHECK(ey.output_nr == 0);
  CHECK(std::string(ebb_node_name(ex.node)) == "AccumulateGrad");
  // The tensors above the leaf go; the edges still hold the graph.
  const ebb_node_t *mul = grad_fn(y);
  y.reset();
  l.reset();
  uint64_t seq;
  EBB_REQUIRE_OK(ebb_node_sequence_nr(mul, &seq));
  ebb_tensor_t *g[2] = {nullptr, nullptr};
  ebb_gradient_edge ins[2] = {ex, ey};
  EBB_REQUIRE_OK(ebb_grad_edges(&el, nullptr, 1, ins, 2, true, false, g));
  Tensor gx(g[0]), gy(g[1]);
  CHECK(read(gx) == std::vector<double>{2, 4, 6});
  CHECK(read(gy) == std::vector<double>{1, 1, 1});
  // A root edge with a gradient, checked against the node's input metadata.
  Tensor seed = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 10, 100}), bad = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 1});
  const ebb_tensor_t *gr[1] = {seed.get()}, *grb[1] = {bad.get()};
  EBB_REQUIRE_OK(ebb_backward_edges(&ey, gr, 1, true, &ex, 1));
  CHECK(grad_of(x) == std::vector<double>{2, 40, 600});
  EBB_CHECK_FAILS(ebb_backward_edges(&ey, grb, 1, true, nullptr, 0), EBB_EINVAL, "does not match roots[0] (f64[3] on the CPU), input 0 of MulBackward");
  EBB_CHECK_FAILS(ebb_backward_edges(&ey, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "has 3 elements");
  // An input edge to a non-leaf node is refused, for the reason the message gives: an edge names
  // a node's output, not a tensor with a .grad (a non-leaf tensor is a valid ebb_backward input).
  EBB_CHECK_FAILS(ebb_backward_edges(&el, nullptr, 1, true, &ey, 1), EBB_ENOTSUP, "not to a leaf");
  EBB_CHECK_FAILS(ebb_backward_edges(&el, nullptr, 1, true, &ey, 1), EBB_ENOTSUP, "not a tensor, so there is no .grad");
  ebb_gradient_edge off = ey;
  off.output_nr = 1;
  EBB_CHECK_FAILS(ebb_grad_edges(&el, nullptr, 1, &off, 1, true, false, g), EBB_EINVAL, "output_nr 1");
  // Bad input.
  Tensor plain = make(EBB_DEVICE_CPU, EBB_F64, {1}, {1});
  ebb_gradient_edge e;
  EBB_CHECK_FAILS(ebb_tensor_gradient_edge(plain, &e), EBB_EINVAL, "does not require a gradient");
  EBB_CHECK_FAILS(ebb_tensor_gradient_edge(nullptr, &e), EBB_EINVAL, "t");
  EBB_CHECK_FAILS(ebb_tensor_gradient_edge(x, nullptr), EBB_EINVAL, "out is NULL");
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&el));
  EBB_CHECK_FAILS(ebb_gradient_edge_release(&el), EBB_EINVAL, "released already");
  EBB_CHECK_FAILS(ebb_grad_edges(&el, nullptr, 1, &ex, 1, true, false, g), EBB_EINVAL, "ebb_grad_edges: outputs[0] has no node");
  EBB_CHECK_FAILS(ebb_gradient_edge_release(nullptr), EBB_EINVAL, "e is NULL");
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&ey));
  EBB_REQUIRE_OK(ebb_gradient_edge_release(&ex));
  gx.reset();
  gy.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
}

namespace {
struct Probe {
  std::vector<int64_t> ids;
  std::vector<const ebb_node_t *> nodes;
  const ebb_node_t *ask = nullptr;  // ebb_autograd_will_execute(ask) at each call
  std::vector<int> will;
};
ebb_status probe_hook(const ebb_tensor_t *, ebb_tensor_t **, void *user) {
  auto *p = static_cast<Probe *>(user);
  p->ids.push_back(ebb_autograd_current_task_id());
  const ebb_node_t *n = nullptr;
  ebb_autograd_current_node(&n);
  p->nodes.push_back(n);
  if (p->ask) {
    bool w = false;
    ebb_status st = ebb_autograd_will_execute(p->ask, &w);
    if (st) return st;
    p->will.push_back(w);
  }
  return EBB_OK;
}
}  // namespace

TEST_CASE("running backward: the current node, task ids one apart per call, will_execute", "[autograd][node_api]") {
  EbbSession session;
  const ebb_node_t *none = reinterpret_cast<const ebb_node_t *>(&session);  // overwritten with NULL
  EBB_REQUIRE_OK(ebb_autograd_current_node(&none));
  CHECK(none == nullptr);
  CHECK(ebb_autograd_current_task_id() == -1);
  Tensor a = leaf({1}), b = leaf({2}), ya, yb, s, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, ya.out()));
  EBB_REQUIRE_OK(ebb_op_mul_scalar(b, 3.0, yb.out()));
  EBB_REQUIRE_OK(ebb_op_add(ya, yb, s.out()));
  l = sum(s);
  bool w;
  EBB_CHECK_FAILS(ebb_autograd_will_execute(grad_fn(ya), &w), EBB_ESTATE, "no backward is running");
  Probe p;
  p.ask = grad_fn(yb);
  ebb_hook_handle h;
  EBB_REQUIRE_OK(ebb_tensor_register_hook(ya, probe_hook, &p, &h));
  EBB_REQUIRE_OK(backward(l, {}, true));
  EBB_REQUIRE_OK(backward(l, {a.get()}, true));  // partial: b's side does not run
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {ya.get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(r, nullptr, 1, in, 1, true, false, g));
  Tensor gt(g[0]);
  REQUIRE(p.ids.size() == 3);
  CHECK(p.ids[0] >= 0);
  CHECK(p.ids[1] == p.ids[0] + 1);
  CHECK(p.ids[2] == p.ids[1] + 1);
  CHECK(p.nodes == std::vector<const ebb_node_t *>(3, grad_fn(ya)));
  CHECK(p.will == std::vector<int>{1, 0, 0});
  CHECK(ebb_autograd_current_task_id() == -1);
  EBB_CHECK_FAILS(ebb_autograd_will_execute(nullptr, &w), EBB_EINVAL, "node is NULL");
  EBB_REQUIRE_OK(ebb_hook_remove(h));
}

TEST_CASE("increment_version: a saved tensor changed outside autograd fails the backward naming the node", "[autograd][node_api]") {
  EbbSession session;
  Tensor x = leaf({1, 2}), w = make(EBB_DEVICE_CPU, EBB_F64, {2}, {3, 4}), y, l;
  EBB_REQUIRE_OK(ebb_op_mul(x, w, y.out()));  // saves w for x's gradient
  l = sum(y);
  uint64_t v0 = 0, v1 = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(w, &v0));
  ebb_tensor_t *ts[2] = {w.get(), w.get()};
  EBB_REQUIRE_OK(ebb_autograd_increment_version(ts, 2));  // twice is harmless
  EBB_REQUIRE_OK(ebb_tensor_version(w, &v1));
  CHECK(v1 == v0 + 2);
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_ESTATE, "MulBackward");
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_ESTATE, "saved at version 0, now 2");
  EBB_REQUIRE_OK(ebb_autograd_increment_version(nullptr, 0));
  EBB_CHECK_FAILS(ebb_autograd_increment_version(nullptr, 1), EBB_EINVAL, "tensors is NULL");
  ebb_tensor_t *bad[2] = {w.get(), nullptr};
  EBB_CHECK_FAILS(ebb_autograd_increment_version(bad, 2), EBB_EINVAL, "tensors[1] is NULL");
  EBB_REQUIRE_OK(ebb_tensor_version(w, &v0));
  CHECK(v0 == v1);  // nothing bumped on error
}

namespace {
struct MgLog {
  std::mutex mu;
  std::vector<std::vector<std::vector<double>>> calls;  // per call, per tensor (empty: NULL)
  std::vector<int64_t> tasks;
  ebb_status fail = EBB_OK;
};
ebb_status mg_fn(const ebb_tensor_t *const *grads, int n, void *user) {
  auto *m = static_cast<MgLog *>(user);
  std::vector<std::vector<double>> c;
  for (int i = 0; i < n; i++) c.push_back(grads[i] ? read(grads[i]) : std::vector<double>{});
  std::lock_guard<std::mutex> lk(m->mu);
  m->calls.push_back(c);
  m->tasks.push_back(ebb_autograd_current_task_id());
  return EBB_OK;
}
using G = std::vector<std::vector<double>>;
}  // namespace

TEST_CASE("multi-grad hooks: all waits for the gradients the backward computes - any fires once", "[autograd][node_api][multi_grad]") {
  EbbSession session;
  Tensor a = leaf({1}), b = leaf({2}), c = leaf({3}), d = leaf({4}), s1, s2, l;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, s1.out()));  // l = a*b + 2c; d is not used
  EBB_REQUIRE_OK(ebb_op_mul_scalar(c, 2.0, s2.out()));
  Tensor s3;
  EBB_REQUIRE_OK(ebb_op_add(s1, s2, s3.out()));
  l = sum(s3);
  MgLog all, any;
  ebb_hook_handle ha, hy;
  ebb_tensor_t *ts[4] = {a.get(), b.get(), c.get(), d.get()};
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 4, mg_fn, &all, EBB_MULTI_GRAD_ALL, &ha));
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 4, mg_fn, &any, EBB_MULTI_GRAD_ANY, &hy));
  EBB_REQUIRE_OK(backward(l, {}, true));
  REQUIRE(all.calls.size() == 1);
  CHECK(all.calls[0] == G{{2}, {1}, {2}, {}});  // d is not in the graph
  REQUIRE(any.calls.size() == 1);
  int set = 0;
  for (auto &g : any.calls[0]) set += !g.empty();
  CHECK(set == 1);
  // Partial backward: only a and c are computed; b's AccumulateGrad does not run.
  EBB_REQUIRE_OK(backward(l, {a.get(), c.get()}, true));
  REQUIRE(all.calls.size() == 2);
  CHECK(all.calls[1] == G{{2}, {}, {2}, {}});
  CHECK(any.calls.size() == 2);
  CHECK(all.tasks[1] == all.tasks[0] + 1);
  // ebb_grad with respect to b only.
  const ebb_tensor_t *r[1] = {l.get()}, *in[1] = {b.get()};
  ebb_tensor_t *g[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_grad(r, nullptr, 1, in, 1, true, false, g));
  Tensor gt(g[0]);
  REQUIRE(all.calls.size() == 3);
  CHECK(all.calls[2] == G{{}, {1}, {}, {}});
  // One handle removes all the hooks; twice is refused.
  EBB_REQUIRE_OK(ebb_hook_remove(ha));
  EBB_CHECK_FAILS(ebb_hook_remove(ha), EBB_EINVAL, "is not registered");
  EBB_REQUIRE_OK(ebb_hook_remove(hy));
  EBB_REQUIRE_OK(backward(l));
  CHECK(all.calls.size() == 3);
  CHECK(any.calls.size() == 3);
}

namespace {
ebb_status failing_tensor_hook(const ebb_tensor_t *, ebb_tensor_t **, void *) { return ebb_tensor_set_requires_grad(nullptr, true); }
}  // namespace

TEST_CASE("multi-grad hooks: a failing backward does not fire all - bad input", "[autograd][node_api][multi_grad][errors]") {
  EbbSession session;
  Tensor a = leaf({1}), b = leaf({2}), y, s1, l;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, y.out()));  // l = sum(2a * b)
  EBB_REQUIRE_OK(ebb_op_mul(y, b, s1.out()));
  l = sum(s1);
  MgLog all;
  ebb_hook_handle h, hf;
  // a's first hook fails: after y's gradient reached "all" (MulScalarBackward runs before a's
  // AccumulateGrad), so the task's state is partial when the backward fails, and is dropped.
  EBB_REQUIRE_OK(ebb_tensor_register_hook(a, failing_tensor_hook, nullptr, &hf));
  ebb_tensor_t *ts[2] = {y.get(), a.get()};
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 2, mg_fn, &all, EBB_MULTI_GRAD_ALL, &h));
  EBB_CHECK_FAILS(backward(l, {}, true), EBB_EINVAL, "t is NULL");
  CHECK(all.calls.empty());
  EBB_REQUIRE_OK(ebb_hook_remove(hf));
  EBB_REQUIRE_OK(backward(l));
  REQUIRE(all.calls.size() == 1);
  CHECK(all.calls[0] == G{{2}, {4}});
  EBB_REQUIRE_OK(ebb_hook_remove(h));
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(ts, 2, mg_fn, &all, (ebb_multi_grad_mode)7, &h), EBB_EINVAL, "mode 7");
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(nullptr, 2, mg_fn, &all, EBB_MULTI_GRAD_ALL, &h), EBB_EINVAL, "expected an array");
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(ts, 0, mg_fn, &all, EBB_MULTI_GRAD_ALL, &h), EBB_EINVAL, "n > 0");
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(ts, 2, nullptr, &all, EBB_MULTI_GRAD_ALL, &h), EBB_EINVAL, "fn is NULL");
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(ts, 2, mg_fn, &all, EBB_MULTI_GRAD_ANY, nullptr), EBB_EINVAL, "out is NULL");
  ebb_tensor_t *withnull[2] = {a.get(), nullptr};
  EBB_CHECK_FAILS(ebb_register_multi_grad_hook(withnull, 2, mg_fn, &all, EBB_MULTI_GRAD_ALL, &h), EBB_EINVAL, "tensors[1] is NULL");
  y.reset();
  s1.reset();
  l.reset();
  CHECK(ebb_autograd_live_nodes() == 0);  // a removed registration holds no node
}

namespace {
thread_local double t_scale = 0;
struct ThreadCheck {
  std::atomic<int> fired{0}, wrong{0};
};
ebb_status mg_thread_fn(const ebb_tensor_t *const *grads, int n, void *user) {
  auto *c = static_cast<ThreadCheck *>(user);
  c->fired++;
  // This thread's task: a's gradient is b * scale (2 * scale), b's is a * scale (1 * scale).
  // (No Catch2 macro here: they are not thread-safe, and read() uses them.)
  double ga = 0, gb = 0;
  if (n != 2 || !grads[0] || !grads[1] || ebb_tensor_to_host(grads[0], &ga, sizeof ga) ||
      ebb_tensor_to_host(grads[1], &gb, sizeof gb) || ga != 2 * t_scale || gb != 1 * t_scale)
    c->wrong++;
  return EBB_OK;
}
}  // namespace

TEST_CASE("multi-grad hooks: state is per backward call when threads run backward at once", "[autograd][node_api][multi_grad][threads]") {
  EbbSession session;
  Tensor a = leaf({1}), b = leaf({2});
  ThreadCheck all, any;
  ebb_hook_handle ha, hy;
  ebb_tensor_t *ts[2] = {a.get(), b.get()};
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 2, mg_thread_fn, &all, EBB_MULTI_GRAD_ALL, &ha));
  std::atomic<int> any_fired{0};
  auto any_fn = [](const ebb_tensor_t *const *, int, void *u) -> ebb_status {
    (*static_cast<std::atomic<int> *>(u))++;
    return EBB_OK;
  };
  EBB_REQUIRE_OK(ebb_register_multi_grad_hook(ts, 2, any_fn, &any_fired, EBB_MULTI_GRAD_ANY, &hy));
  const int threads = 6, calls = kSanitized ? 40 : 400;
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] {
      t_scale = t + 1;
      for (int i = 0; i < calls; i++) {
        ebb_tensor_t *p = nullptr, *q = nullptr, *l = nullptr;
        bool ok = ebb_op_mul(a, b, &p) == EBB_OK && ebb_op_mul_scalar(p, t_scale, &q) == EBB_OK &&
                  ebb_op_sum(q, nullptr, 0, false, &l) == EBB_OK;
        const ebb_tensor_t *r[1] = {l};
        ok = ok && ebb_backward(r, nullptr, 1, false, nullptr, 0) == EBB_OK;
        if (!ok) failures++;
        for (ebb_tensor_t *x : {p, q, l})
          if (x) ebb_tensor_release(x);
      }
    });
  for (auto &th : pool) th.join();
  CHECK(failures.load() == 0);
  CHECK(all.fired.load() == threads * calls);
  CHECK(all.wrong.load() == 0);
  CHECK(any_fired.load() == threads * calls);
  EBB_REQUIRE_OK(ebb_hook_remove(ha));
  EBB_REQUIRE_OK(ebb_hook_remove(hy));
  a.reset();
  b.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
}

namespace {
struct Lines {
  std::vector<std::string> v;
};
void sink(const char *line, void *user) { static_cast<Lines *>(user)->v.push_back(line); }
void warn_sink(const char *msg, void *user) { static_cast<Lines *>(user)->v.push_back(msg); }
}  // namespace

TEST_CASE("logging hooks: one line per node executed with its gradients' dtypes and shapes", "[autograd][node_api][logging]") {
  EbbSession session;
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, values(6, 3)), v, idx, l;
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  EBB_REQUIRE_OK(ebb_op_max_dim(x, 1, false, v.out(), idx.out()));
  l = sum(v);
  uint64_t sl = 0, sm = 0;
  EBB_REQUIRE_OK(ebb_node_sequence_nr(grad_fn(l), &sl));
  EBB_REQUIRE_OK(ebb_node_sequence_nr(grad_fn(v), &sm));
  Lines lines;
  ebb_hook_handle h;
  const ebb_tensor_t *roots[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(roots, 1, sink, &lines, &h));
  EBB_REQUIRE_OK(backward(l, {}, true));
  CHECK(lines.v == std::vector<std::string>{
                       "Executing: SumBackward (node " + std::to_string(sl) + ") with grad_outputs: [f32[]]",
                       "Executing: MaxBackward (node " + std::to_string(sm) + ") with grad_outputs: [f32[2], None]",
                       "Executing: AccumulateGrad with grad_outputs: [f32[2, 3]]"});
  // With no sink, the lines go to the warning handler.
  Lines warned;
  ebb_set_warning_handler(warn_sink, &warned);
  ebb_hook_handle h2;
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(roots, 1, nullptr, nullptr, &h2));
  EBB_REQUIRE_OK(backward(l, {}, true));
  ebb_set_warning_handler(ebb_warning_to_stderr, nullptr);
  REQUIRE(warned.v.size() == 3);
  CHECK(warned.v[0].find("autograd: Executing: SumBackward") != std::string::npos);
  EBB_REQUIRE_OK(ebb_hook_remove(h2));
  // One handle unregisters every node's hook.
  EBB_REQUIRE_OK(ebb_hook_remove(h));
  lines.v.clear();
  EBB_REQUIRE_OK(backward(l));
  CHECK(lines.v.empty());
  EBB_CHECK_FAILS(ebb_hook_remove(h), EBB_EINVAL, "is not registered");
  // Bad input.
  Tensor plain = make(EBB_DEVICE_CPU, EBB_F32, {1}, {1});
  const ebb_tensor_t *bad[1] = {plain.get()};
  EBB_CHECK_FAILS(ebb_autograd_register_logging_hooks(bad, 1, sink, &lines, &h), EBB_EINVAL, "roots[0] (f32[1] on the CPU) does not require");
  EBB_CHECK_FAILS(ebb_autograd_register_logging_hooks(nullptr, 1, sink, &lines, &h), EBB_EINVAL, "expected an array");
  EBB_CHECK_FAILS(ebb_autograd_register_logging_hooks(roots, 1, sink, &lines, nullptr), EBB_EINVAL, "out is NULL");
}

// ---- gradient edges and logging hooks at the graph's ends -----------------------------------------

// A root edge that reaches an input's node but brings it no gradient (max_dim's indices output)
// leaves the input without one: without allow_unused that is EBB_EINVAL (ebb_grad's contract),
// never EBB_OK with grads[0] NULL.
TEST_CASE("node api: ebb_grad_edges without allow_unused fails for an input no gradient reached", "[autograd][node_api][edges]") {
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
void count_lines(const char *, void *user) { ++*static_cast<int *>(user); }
}  // namespace

// The logging hooks promise a line for every node reachable from the roots, "a leaf's
// AccumulateGrad" included; for a leaf root whose AccumulateGrad did not exist yet, the
// registration makes one and hooks it. Were it dropped at the registration's end, the hook would
// go with it and the backward's AccumulateGrad (a new node) would log nothing, so the handle
// holds those nodes until it is removed (as a multi-grad registration does).
TEST_CASE("node api: logging hooks on a leaf root log its AccumulateGrad", "[autograd][node_api][logging]") {
  EbbSession session;
  Tensor x = leaf({2});
  int lines = 0;
  const ebb_tensor_t *roots[1] = {x.get()};
  ebb_hook_handle h{0};
  EBB_REQUIRE_OK(ebb_autograd_register_logging_hooks(roots, 1, count_lines, &lines, &h));
  EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
  ebb_hook_remove(h);
  x.reset();
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
  CHECK(lines == 1);
}
