// Custom autograd functions (ebb/function.h): values and gradients against the same ops called
// directly, the ctx's calls (saved tensors, dirty inputs, non-differentiable outputs,
// materialized gradients, needs_input_grad, user data), the checks on returned gradients, the
// refusals of bad input, offload of saved tensors, threads, and the ctx freed with the graph.
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "autograd_test_util.hpp"
#include "ebb/autograd.h"
#include "ebb/function.h"
#include "ebb/ops.h"
#include "gradcheck.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// ---- ScaledMul: y = x * w * scale (args: a double), saving x and w ---------------------------

ebb_status scaled_mul_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int nin, const void *args, ebb_tensor_t **out,
                          int nout) {
  (void)nin;
  (void)nout;
  double s = *static_cast<const double *>(args);
  ebb_tensor_t *p = nullptr;
  ebb_status st = ebb_op_mul(in[0], in[1], &p);
  if (!st) st = ebb_op_mul_scalar(p, s, &out[0]);
  if (p) ebb_tensor_release(p);
  if (!st) st = ebb_ctx_save_for_backward(ctx, in, 2);
  double *keep = new double(s);
  if (!st) st = ebb_ctx_set_user(ctx, keep, [](void *d) { delete static_cast<double *>(d); });
  else delete keep;
  return st;
}

ebb_status scaled_mul_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int nout, ebb_tensor_t **gin, int *ng) {
  (void)nout;
  (void)ng;
  const ebb_tensor_t *const *sv = nullptr;
  int n = 0;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &sv, &n);
  if (st) return st;
  if (n != 2) return EBB_EINTERNAL;
  double s = *static_cast<double *>(ebb_ctx_user(ctx));
  for (int i = 0; i < 2 && !st; i++) {
    bool need = false;
    st = ebb_ctx_needs_input_grad(ctx, i, &need);
    if (st || !need) continue;
    ebb_tensor_t *p = nullptr;
    st = ebb_op_mul(go[0], sv[1 - i], &p);
    if (!st) st = ebb_op_mul_scalar(p, s, &gin[i]);
    if (p) ebb_tensor_release(p);
  }
  return st;
}

const ebb_function kScaledMul = {EBB_FUNCTION_VERSION, "ScaledMul", 1, scaled_mul_fwd, nullptr, scaled_mul_bwd, nullptr};

Tensor apply1(const ebb_function &f, std::vector<const ebb_tensor_t *> in, const void *args = nullptr) {
  ebb_tensor_t *o[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_function_apply(&f, in.data(), (int)in.size(), args, o));
  return Tensor(o[0]);
}

void backward_sum(const ebb_tensor_t *y, bool retain = false) {
  Tensor l = sum_of(y);
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, retain, nullptr, 0));
}

// A function whose backward is the test's: a lambda-free table of behaviours picked by args.
enum Mode { RET_OK, RET_COUNT, RET_SHAPE, RET_BCAST, RET_DTYPE, RET_DEVICE, RET_FAIL, RET_FOR_INT };
struct Probe {
  Mode mode = RET_OK;
};

ebb_status probe_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *args, ebb_tensor_t **out, int) {
  ebb_status st = ebb_tensor_clone(in[0], &out[0]);
  auto *p = new Probe(*static_cast<const Probe *>(args));
  if (!st) st = ebb_ctx_set_user(ctx, p, [](void *d) { delete static_cast<Probe *>(d); });
  else delete p;
  return st;
}

ebb_status probe_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *ng) {
  auto *p = static_cast<Probe *>(ebb_ctx_user(ctx));
  ebb_tensor_info gi;
  ebb_tensor_get_info(go[0], &gi);
  switch (p->mode) {
    case RET_OK: return ebb_tensor_clone(go[0], &gin[0]);
    case RET_COUNT: *ng = 2; return ebb_tensor_clone(go[0], &gin[0]);
    case RET_SHAPE: {
      int64_t s[1] = {gi.numel + 1};
      return ebb_tensor_zeros(gi.device, gi.dtype, 1, s, &gin[0]);
    }
    case RET_BCAST: {  // [2, n]: sums back to [n]
      int64_t s[2] = {2, gi.numel};
      ebb_tensor_t *z = nullptr;
      ebb_status st = ebb_tensor_zeros(gi.device, gi.dtype, 2, s, &z);
      if (!st) st = ebb_op_add_scalar(z, 1.0, &gin[0]);
      if (z) ebb_tensor_release(z);
      return st;
    }
    case RET_DTYPE: return ebb_tensor_to_dtype(go[0], EBB_F32, &gin[0]);
    case RET_DEVICE: return ebb_tensor_to_device(go[0], gi.device == EBB_DEVICE_CPU ? 0 : EBB_DEVICE_CPU, &gin[0]);
    case RET_FAIL: return ebb_tensor_clone(nullptr, &gin[0]);  // fails with ebb's own message
    case RET_FOR_INT: {
      ebb_status st = ebb_tensor_clone(go[0], &gin[0]);
      if (!st) st = ebb_tensor_clone(go[0], &gin[1]);
      return st;
    }
  }
  return EBB_EINTERNAL;
}

const ebb_function kProbe = {EBB_FUNCTION_VERSION, "Probe", 1, probe_fwd, nullptr, probe_bwd, nullptr};

}  // namespace

TEST_CASE("function: values and gradients equal the same ops called directly, CPU and devices", "[autograd][function]") {
  EbbSession session;
  Live live;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = leaf_on(dev, {0.5, -1.0, 2.0}), w = leaf_on(dev, {1.5, 0.25, -0.75});
    double s = 3.0;
    Tensor y = apply1(kScaledMul, {x, w}, &s);
    const ebb_node_t *fnode = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &fnode, nullptr));
    CHECK(std::string(ebb_node_name(fnode)) == "ScaledMulBackward");
    int nnext = 0;
    EBB_REQUIRE_OK(ebb_node_num_next(fnode, &nnext));
    CHECK(nnext == 2);
    CHECK(read(y) == std::vector<double>{0.5 * 1.5 * 3, -1.0 * 0.25 * 3, 2.0 * -0.75 * 3});
    backward_sum(y);
    CHECK(grad_of(x) == std::vector<double>{1.5 * 3, 0.25 * 3, -0.75 * 3});
    CHECK(grad_of(w) == std::vector<double>{0.5 * 3, -1.0 * 3, 2.0 * 3});
  }
}

TEST_CASE("function: gradcheck of a custom function's backward (f64 finite differences)", "[autograd][function][gradcheck]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO(dev_name(dev));
    double s = -1.25;
    GcForward fwd = [&](const GcInputs &in, ebb_tensor_t **out) { return ebb_function_apply(&kScaledMul, in.data(), 2, &s, out); };
    GcBackward bwd = [&](const ebb_tensor_t *g, const GcInputs &in, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &grads) {
      // The backward through the engine: leaves copied from the inputs, the function applied, ebb_grad.
      std::vector<Tensor> leaves;
      std::vector<const ebb_tensor_t *> lp;
      for (auto *t : in) {
        Tensor c;
        ebb_status st = ebb_tensor_clone(t, c.out());
        if (st) return st;
        if ((st = ebb_tensor_set_requires_grad(c, true))) return st;
        lp.push_back(c.get());
        leaves.push_back(std::move(c));
      }
      ebb_tensor_t *o[1] = {nullptr};
      ebb_status st = ebb_function_apply(&kScaledMul, lp.data(), 2, &s, o);
      if (st) return st;
      Tensor y(o[0]);
      const ebb_tensor_t *outs[1] = {y.get()}, *gos[1] = {g};
      return ebb_grad(outs, gos, 1, lp.data(), 2, false, false, grads.data());
    };
    auto r = gradcheck(dev, {{{2, 3}, values(6, 3)}, {{2, 3}, values(6, 4)}}, fwd, bwd);
    INFO(r.report);
    CHECK(r.ok);
  }
}

TEST_CASE("function: nothing recorded without an input requiring a gradient, and the ctx goes at once", "[autograd][function]") {
  EbbSession session;
  Live live;
  long ctx0 = ebb_function_live_ctx();
  Tensor x = make(EBB_DEVICE_CPU, EBB_F64, {2}, {1, 2}), w = make(EBB_DEVICE_CPU, EBB_F64, {2}, {3, 4});
  double s = 2;
  Tensor y = apply1(kScaledMul, {x, w}, &s);
  bool rg = true;
  EBB_REQUIRE_OK(ebb_tensor_requires_grad(y, &rg));
  CHECK_FALSE(rg);
  CHECK(read(y) == std::vector<double>{6, 16});
  CHECK(ebb_function_live_ctx() == ctx0);
  // Grad mode off: the same, with inputs that require gradients.
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2});
  bool was;
  ebb_grad_set_enabled(false, &was);
  Tensor z = apply1(kScaledMul, {a, w}, &s);
  ebb_grad_set_enabled(was, nullptr);
  EBB_REQUIRE_OK(ebb_tensor_requires_grad(z, &rg));
  CHECK_FALSE(rg);
  CHECK(ebb_function_live_ctx() == ctx0);
}

TEST_CASE("function: the ctx and what it holds are freed with the graph, over many steps", "[autograd][function][leak]") {
  EbbSession session;
  Live live;
  long ctx0 = ebb_function_live_ctx(), nodes0 = ebb_autograd_live_nodes(), handles0 = ebb_debug_live_handles();
  Tensor x = leaf_on(0, {0.5, -1.0, 2.0}), w = leaf_on(0, {1.5, 0.25, -0.75});
  double s = 1.0;
  for (int step = 0; step < 200; step++) {
    Tensor y = apply1(kScaledMul, {x, w}, &s);
    Tensor y2 = apply1(kScaledMul, {y, w}, &s);
    CHECK(ebb_function_live_ctx() == ctx0 + 2);
    if (step % 2) backward_sum(y2);  // half the steps drop the graph without a backward
  }
  CHECK(ebb_function_live_ctx() == ctx0);
  x = Tensor();
  w = Tensor();
  CHECK(ebb_autograd_live_nodes() == nodes0);
  CHECK(ebb_debug_live_handles() == handles0);
}

namespace {

// AddOne_: x += 1 in place, marked dirty and returned.
ebb_status add_one_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *x = const_cast<ebb_tensor_t *>(in[0]);
  ebb_status st = ebb_op_add_scalar_(x, 1.0);
  if (!st) st = ebb_ctx_mark_dirty(ctx, in, 1);
  if (!st) st = ebb_tensor_retain(x);
  if (!st) out[0] = x;
  return st;
}
ebb_status pass_bwd(ebb_function_ctx *, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  return ebb_tensor_clone(go[0], &gin[0]);
}
const ebb_function kAddOne = {0, "AddOne_", 1, add_one_fwd, nullptr, pass_bwd, nullptr};
ebb_status clone_fwd_for_tests(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  return ebb_tensor_clone(in[0], &out[0]);
}

// Dirty without returning it.
ebb_status dirty_lost_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_status st = ebb_ctx_mark_dirty(ctx, in, 1);
  if (!st) st = ebb_tensor_clone(in[0], &out[0]);
  return st;
}
const ebb_function kDirtyLost = {0, "DirtyLost", 1, dirty_lost_fwd, nullptr, pass_bwd, nullptr};

// Marks a tensor that is not an input dirty.
ebb_status dirty_other_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_status st = ebb_tensor_clone(in[0], &out[0]);
  if (!st) {
    const ebb_tensor_t *o[1] = {out[0]};
    st = ebb_ctx_mark_dirty(ctx, o, 1);
  }
  return st;
}
const ebb_function kDirtyOther = {0, "DirtyOther", 1, dirty_other_fwd, nullptr, pass_bwd, nullptr};

}  // namespace

TEST_CASE("function: mark_dirty rebases an input's history onto the function", "[autograd][function][dirty]") {
  EbbSession session;
  Live live;
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
  Tensor b;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, b.out()));  // a non-leaf: b = 2a
  uint64_t v0 = 0, v1 = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(b, &v0));
  ebb_tensor_t *o[1] = {nullptr};
  const ebb_tensor_t *in[1] = {b.get()};
  EBB_REQUIRE_OK(ebb_function_apply(&kAddOne, in, 1, nullptr, o));
  Tensor y(o[0]);
  CHECK(y.get() == b.get());  // the input's own handle
  EBB_REQUIRE_OK(ebb_tensor_version(b, &v1));
  CHECK(v1 > v0);
  const ebb_node_t *gf = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(b, &gf, nullptr));
  CHECK(std::string(ebb_node_name(gf)) == "AddOne_Backward");
  const ebb_node_t *next = nullptr;
  EBB_REQUIRE_OK(ebb_node_next(gf, 0, &next, nullptr));
  CHECK(std::string(ebb_node_name(next)) == "MulScalarBackward");
  CHECK(read(b) == std::vector<double>{3, 5, 7});
  y = Tensor();
  backward_sum(b);
  CHECK(grad_of(a) == std::vector<double>{2, 2, 2});
}

TEST_CASE("function: mark_dirty refusals name the function and the input", "[autograd][function][dirty][errors]") {
  EbbSession session;
  Live live;
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
  ebb_tensor_t *o[1] = {nullptr};
  const ebb_tensor_t *in[1] = {a.get()};
  // A leaf that requires a gradient (changed with grad mode off inside the forward; refused after).
  EBB_CHECK_MSG(ebb_function_apply(&kAddOne, in, 1, nullptr, o), EBB_EINVAL, "'AddOne_'", "input[0]", "leaf that requires a gradient");
  CHECK(o[0] == nullptr);
  Tensor b;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, b.out()));
  in[0] = b.get();
  EBB_CHECK_MSG(ebb_function_apply(&kDirtyLost, in, 1, nullptr, o), EBB_EINVAL, "'DirtyLost' marked", "did not return it");
  EBB_CHECK_MSG(ebb_function_apply(&kDirtyOther, in, 1, nullptr, o), EBB_EINVAL, "is not an input of 'DirtyOther'");
  // A view marked dirty is not supported (its base would need the new history).
  Tensor v;
  EBB_REQUIRE_OK(ebb_tensor_narrow(b, 0, 0, 2, v.out()));
  in[0] = v.get();
  EBB_CHECK_MSG(ebb_function_apply(&kAddOne, in, 1, nullptr, o), EBB_ENOTSUP, "'AddOne_'", "is a view");
}

namespace {

// Split: out0 = x * 2, out1 = x * 3 (marked non-differentiable when args says so); the backward
// records what it saw for each output.
struct SplitSeen {
  bool nondiff = false, materialize = true;
  std::atomic<int> calls{0};
  std::atomic<int> null_out[2] = {{0}, {0}};
  std::atomic<int> zero_out[2] = {{0}, {0}};
};
ebb_status split_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *args, ebb_tensor_t **out, int) {
  auto *seen = static_cast<SplitSeen *>(const_cast<void *>(args));
  ebb_status st = ebb_op_mul_scalar(in[0], 2.0, &out[0]);
  if (!st) st = ebb_op_mul_scalar(in[0], 3.0, &out[1]);
  if (!st) st = ebb_ctx_set_user(ctx, seen, nullptr);
  if (!st && !seen->materialize) st = ebb_ctx_set_materialize_grads(ctx, false);
  return st;
}
ebb_status split_setup(ebb_function_ctx *ctx, const ebb_tensor_t *const *, int, const void *args, ebb_tensor_t *const *out, int) {
  auto *seen = static_cast<const SplitSeen *>(args);
  if (!seen->nondiff) return EBB_OK;
  const ebb_tensor_t *o[1] = {out[1]};
  return ebb_ctx_mark_non_differentiable(ctx, o, 1);
}
ebb_status split_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int nout, ebb_tensor_t **gin, int *) {
  auto *seen = static_cast<SplitSeen *>(ebb_ctx_user(ctx));
  seen->calls++;
  for (int k = 0; k < nout; k++) {
    if (!go[k]) {
      seen->null_out[k]++;
      continue;
    }
    auto v = read(go[k]);
    bool zero = true;
    for (double e : v) zero = zero && e == 0;
    if (zero) seen->zero_out[k]++;
  }
  ebb_tensor_t *a = nullptr;
  ebb_status st = go[0] ? ebb_op_mul_scalar(go[0], 2.0, &a) : EBB_OK;
  if (!st && go[1]) {
    ebb_tensor_t *b = nullptr;
    st = ebb_op_mul_scalar(go[1], 3.0, &b);
    if (!st && a) {
      st = ebb_op_add(a, b, &gin[0]);
      ebb_tensor_release(b);
    } else if (!st) {
      gin[0] = b;
    }
    if (a) ebb_tensor_release(a);
  } else {
    gin[0] = a;
  }
  return st;
}
const ebb_function kSplit = {EBB_FUNCTION_VERSION, "Split", 2, split_fwd, split_setup, split_bwd, nullptr};

}  // namespace

TEST_CASE("function: outputs without a gradient, and missing gradients materialized or not", "[autograd][function]") {
  EbbSession session;
  Live live;
  for (int mode = 0; mode < 3; mode++) {
    SplitSeen seen;
    seen.nondiff = mode == 1;
    seen.materialize = mode != 2;
    INFO("mode " << mode);
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
    ebb_tensor_t *o[2] = {nullptr, nullptr};
    const ebb_tensor_t *in[1] = {x.get()};
    EBB_REQUIRE_OK(ebb_function_apply(&kSplit, in, 1, &seen, o));
    Tensor y0(o[0]), y1(o[1]);
    bool rg = false;
    EBB_REQUIRE_OK(ebb_tensor_requires_grad(y1, &rg));
    CHECK(rg == !seen.nondiff);
    backward_sum(y0);  // only output 0 reaches the loss
    CHECK(seen.calls == 1);
    CHECK(seen.null_out[0] == 0);
    CHECK(seen.zero_out[1] == (seen.materialize ? 1 : 0));
    CHECK(seen.null_out[1] == (seen.materialize ? 0 : 1));
    CHECK(grad_of(x) == std::vector<double>{2, 2});
  }
}

namespace {
std::atomic<int> g_need_fwd{0}, g_need_bwd{0};
ebb_status need_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  int bits = 0;
  for (int i = 0; i < 2; i++) {
    bool b = false;
    ebb_status st = ebb_ctx_needs_input_grad(ctx, i, &b);
    if (st) return st;
    bits |= b << i;
  }
  g_need_fwd = bits;
  ebb_status st = ebb_op_add(in[0], in[1], &out[0]);
  return st;
}
ebb_status need_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  int bits = 0;
  for (int i = 0; i < 2; i++) {
    bool b = false;
    ebb_status st = ebb_ctx_needs_input_grad(ctx, i, &b);
    if (st) return st;
    bits |= b << i;
    if (b && (st = ebb_tensor_clone(go[0], &gin[i]))) return st;
  }
  g_need_bwd = bits;
  return EBB_OK;
}
const ebb_function kNeed = {0, "Need", 1, need_fwd, nullptr, need_bwd, nullptr};
}  // namespace

TEST_CASE("function: needs_input_grad in forward (requires a gradient) and backward (wanted by this backward)", "[autograd][function]") {
  EbbSession session;
  Live live;
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2}), b = leaf_on(EBB_DEVICE_CPU, {3, 4});
  Tensor c = make(EBB_DEVICE_CPU, EBB_F64, {2}, {5, 6});
  Tensor y = apply1(kNeed, {a, c});
  CHECK(g_need_fwd == 1);
  backward_sum(y);
  CHECK(g_need_bwd == 1);
  Tensor z = apply1(kNeed, {a, b});
  CHECK(g_need_fwd == 3);
  Tensor l = sum_of(z);
  const ebb_tensor_t *r[1] = {l.get()}, *only[1] = {b.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, only, 1));  // a partial backward: b only
  CHECK(g_need_bwd == 2);
  ebb_function_ctx *bogus = nullptr;
  bool out = false;
  EBB_CHECK_FAILS(ebb_ctx_needs_input_grad(bogus, 0, &out), EBB_EINVAL, "ctx is NULL");
}

TEST_CASE("function: returned gradients are checked: count, shape (broadcast reduced), dtype, device, non-floating inputs",
          "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  auto run = [&](Mode m, int dev) {
    Probe p;
    p.mode = m;
    Tensor x = leaf_on(dev, {1, 2, 3});
    Tensor y = apply1(kProbe, {x}, &p);
    Tensor l = sum_of(y);
    const ebb_tensor_t *r[1] = {l.get()};
    ebb_clear_error();
    ebb_status st = ebb_backward(r, nullptr, 1, false, nullptr, 0);
    std::vector<double> g;
    if (!st) g = grad_of(x);
    return std::make_pair(st, g);
  };
  CHECK(run(RET_OK, EBB_DEVICE_CPU).second == std::vector<double>{1, 1, 1});
  CHECK(run(RET_BCAST, 0).second == std::vector<double>{2, 2, 2});
  struct Case {
    Mode m;
    int dev;
    const char *needle;
  } cases[] = {{RET_COUNT, EBB_DEVICE_CPU, "returned 2 gradients"},
               {RET_SHAPE, EBB_DEVICE_CPU, "expected its shape"},
               {RET_DTYPE, EBB_DEVICE_CPU, "expected its dtype"},
               {RET_DEVICE, 0, "expected its device"},
               {RET_FAIL, EBB_DEVICE_CPU, "the backward of 'Probe' failed"}};
  for (auto &c : cases) {
    INFO(c.needle);
    auto r = run(c.m, c.dev);
    CHECK(r.first != EBB_OK);
    std::string msg = ebb_last_error();
    INFO(msg);
    CHECK(msg.find(c.needle) != std::string::npos);
    CHECK(msg.find("ProbeBackward") != std::string::npos);
  }
  // A gradient for a non-floating input.
  Probe p;
  p.mode = RET_FOR_INT;
  Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
  Tensor idx = make(EBB_DEVICE_CPU, EBB_I64, {3}, {0, 1, 2});
  Tensor y = apply1(kProbe, {x, idx}, &p);
  Tensor l = sum_of(y);
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "input[1]", "not floating");
}

TEST_CASE("function: no backward defined fails the backward that needs it, naming the function", "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  ebb_function nob = kScaledMul;
  nob.name = "NoBackward";
  nob.backward = nullptr;
  Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2}), w = leaf_on(EBB_DEVICE_CPU, {3, 4});
  double s = 1;
  Tensor y = apply1(nob, {x, w}, &s);
  Tensor l = sum_of(y);
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_ENOTSUP, "NoBackwardBackward", "'NoBackward' was defined without one");
}

namespace {
ebb_status failing_fwd(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_status st = ebb_tensor_clone(in[0], &out[0]);  // set, then fail: apply releases it
  if (st) return st;
  return ebb_op_add(in[0], nullptr, &out[1]);
}
ebb_status silent_fwd(ebb_function_ctx *, const ebb_tensor_t *const *, int, const void *, ebb_tensor_t **, int) { return EBB_ENOTSUP; }
ebb_status null_out_fwd(ebb_function_ctx *, const ebb_tensor_t *const *, int, const void *, ebb_tensor_t **, int) { return EBB_OK; }
ebb_status twice_fwd(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *x = const_cast<ebb_tensor_t *>(in[0]);
  ebb_tensor_retain(x);
  ebb_tensor_retain(x);
  out[0] = x;
  out[1] = x;
  return EBB_OK;
}
ebb_status ctx_misuse_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  const ebb_tensor_t *const *sv = nullptr;
  int n = 0;
  (void)ebb_ctx_saved_tensors(ctx, &sv, &n);  // refused in forward; the forward goes on regardless
  return ebb_tensor_clone(in[0], &out[0]);
}
ebb_status ctx_limit_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  std::vector<const ebb_tensor_t *> many(EBB_FUNCTION_MAX_SAVED + 1, in[0]);
  ebb_status st = ebb_ctx_save_for_backward(ctx, many.data(), (int)many.size());
  if (st) return st;
  return ebb_tensor_clone(in[0], &out[0]);
}
ebb_status ctx_misuse_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  (void)ebb_ctx_save_for_backward(ctx, go, 1);  // refused in backward; the backward goes on regardless
  return ebb_tensor_clone(go[0], &gin[0]);
}
}  // namespace

TEST_CASE("function: bad input to apply and the ctx calls: a status and a message naming the function", "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
  const ebb_tensor_t *in[1] = {x.get()};
  ebb_tensor_t *o[2] = {nullptr, nullptr};
  EBB_CHECK_FAILS(ebb_function_apply(nullptr, in, 1, nullptr, o), EBB_EINVAL, "fn is NULL");
  ebb_function f = {0, "Bad", 1, add_one_fwd, nullptr, pass_bwd, nullptr};
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, nullptr), EBB_EINVAL, "outputs is NULL");
  f.version = 99;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "fn->version is 99");
  f.version = 0;
  f.noutputs = 0;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "'Bad' has noutputs 0");
  f.noutputs = 1;
  f.forward = nullptr;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "the forward of 'Bad' is NULL");
  f.name = "";
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "fn->name is empty");
  std::string longname(200, 'n');
  f.name = longname.c_str();
  f.forward = silent_fwd;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "fn->name is 200 bytes");
  f.name = "Bad";
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, -1, nullptr, o), EBB_EINVAL, "applied to -1 inputs");
  EBB_CHECK_MSG(ebb_function_apply(&f, in, 1, nullptr, o), EBB_ENOTSUP, "the forward of 'Bad' failed", "ENOTSUP");
  f.forward = null_out_fwd;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "left output 0 NULL");
  f.forward = failing_fwd;
  f.noutputs = 2;
  EBB_CHECK_MSG(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "the forward of 'Bad' failed", "ebb_op_add");
  CHECK(o[0] == nullptr);
  f.forward = twice_fwd;
  EBB_CHECK_FAILS(ebb_function_apply(&f, in, 1, nullptr, o), EBB_EINVAL, "the same tensor as outputs 0 and 1");
  // A released input.
  ebb_tensor_t *gone = nullptr;
  int64_t sh[1] = {2};
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 1, sh, &gone));
  EBB_REQUIRE_OK(ebb_tensor_release(gone));
  const ebb_tensor_t *gin[1] = {gone};
  f.forward = silent_fwd;
  f.noutputs = 1;
  EBB_CHECK_FAILS(ebb_function_apply(&f, gin, 1, nullptr, o), EBB_EFREED, "inputs[0]");
  // The ctx's phase rules, from inside the callbacks: a refused call fails the apply (or the
  // backward) even when the callback goes on, so a lost save or mark is never silent.
  ebb_function mis = {0, "Misuse", 1, ctx_misuse_fwd, nullptr, pass_bwd, nullptr};
  EBB_CHECK_MSG(ebb_function_apply(&mis, in, 1, nullptr, o), EBB_EINVAL, "the forward of 'Misuse' went on after a ctx call was refused",
                "saved tensors are read in backward");
  mis.forward = ctx_limit_fwd;
  EBB_CHECK_MSG(ebb_function_apply(&mis, in, 1, nullptr, o), EBB_ELIMIT, "the forward of 'Misuse' failed", "at most 64");
  mis.forward = clone_fwd_for_tests;
  mis.backward = ctx_misuse_bwd;
  Tensor y = apply1(mis, {x});
  Tensor l = sum_of(y);
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "the backward of 'Misuse' went on after a ctx call was refused",
                "called from the backward of 'Misuse'");
  // ctx calls outside any callback.
  EBB_CHECK_FAILS(ebb_ctx_save_for_backward(nullptr, in, 1), EBB_EINVAL, "ctx is NULL");
  EBB_CHECK_FAILS(ebb_ctx_mark_dirty(nullptr, in, 1), EBB_EINVAL, "ctx is NULL");
  EBB_CHECK_FAILS(ebb_ctx_set_user(nullptr, nullptr, nullptr), EBB_EINVAL, "ctx is NULL");
  CHECK(ebb_ctx_user(nullptr) == nullptr);
  CHECK(std::string(ebb_ctx_function_name(nullptr)) == "(invalid ctx)");
}

TEST_CASE("function: a saved tensor changed in place fails the backward, naming the node and the saved tensor", "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
  Tensor a;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 1.0, a.out()));
  Tensor w = make(EBB_DEVICE_CPU, EBB_F64, {2}, {3, 4});
  double s = 1;
  Tensor y = apply1(kScaledMul, {a, w}, &s);
  EBB_REQUIRE_OK(ebb_op_add_scalar_(w, 1.0));
  Tensor l = sum_of(y);
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "ScaledMulBackward", "saved tensor 1", "modified in place");
}

TEST_CASE("function: saved tensors go through an offload scope and come back for backward", "[autograd][function][offload]") {
  EbbSession session;
  Live live;
  const int64_t n = 64 * 1024;
  Tensor x = make(0, EBB_F32, {n}, values(n, 5)), w = make(0, EBB_F32, {n}, values(n, 6));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
  Tensor h;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 1.0, h.out()));  // an activation (not a parameter)
  ebb_offload_stats s0, s1;
  EBB_REQUIRE_OK(ebb_offload_get_stats(&s0));
  ebb_offload_policy p = {};
  p.min_bytes = 1024;
  EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
  double s = 2;
  Tensor y = apply1(kScaledMul, {h, w}, &s);
  EBB_REQUIRE_OK(ebb_offload_scope_exit());
  EBB_REQUIRE_OK(ebb_offload_get_stats(&s1));
  CHECK(s1.tensors_offloaded > s0.tensors_offloaded);
  h = Tensor();
  backward_sum(y);
  auto g = grad_of(x), wv = read(w);
  REQUIRE(g.size() == wv.size());
  for (size_t i = 0; i < g.size(); i += 4097) CHECK(g[i] == Approx(wv[i] * 2));
}

TEST_CASE("function: applied and differentiated on several threads at once", "[autograd][function][threads]") {
  EbbSession session;
  Live live;
  long ctx0 = ebb_function_live_ctx();
  std::atomic<int> bad{0};
  std::vector<std::thread> th;
  for (int t = 0; t < 4; t++)
    th.emplace_back([&, t] {
      int dev = t % 2 ? 0 : EBB_DEVICE_CPU;
      for (int i = 0; i < 50; i++) {
        ebb_tensor_t *x = nullptr, *w = nullptr, *y = nullptr, *l = nullptr, *g = nullptr;
        int64_t sh[1] = {3};
        double s = 1.0 + t;
        bool ok = ebb_tensor_ones(dev, EBB_F64, 1, sh, &x) == EBB_OK && ebb_tensor_ones(dev, EBB_F64, 1, sh, &w) == EBB_OK &&
                  ebb_tensor_set_requires_grad(x, true) == EBB_OK;
        const ebb_tensor_t *in[2] = {x, w};
        ok = ok && ebb_function_apply(&kScaledMul, in, 2, &s, &y) == EBB_OK && ebb_op_sum(y, nullptr, 0, false, &l) == EBB_OK &&
             ebb_backward_one(l) == EBB_OK && ebb_tensor_grad(x, &g) == EBB_OK;
        double host[3] = {0, 0, 0};
        ok = ok && g && ebb_tensor_to_host(g, host, sizeof host) == EBB_OK && host[0] == s && host[2] == s;
        if (!ok) bad++;
        for (ebb_tensor_t *p : {x, w, y, l, g})
          if (p) ebb_tensor_release(p);
      }
    });
  for (auto &t : th) t.join();
  CHECK(bad == 0);
  CHECK(ebb_function_live_ctx() == ctx0);
}

namespace {
// Cube via a reentrant backward: the backward builds x^3 on a detached copy and differentiates it
// with ebb_grad from inside the running backward.
ebb_status cube_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *sq = nullptr;
  ebb_status st = ebb_op_mul(in[0], in[0], &sq);
  if (!st) st = ebb_op_mul(sq, in[0], &out[0]);
  if (sq) ebb_tensor_release(sq);
  if (!st) st = ebb_ctx_save_for_backward(ctx, in, 1);
  return st;
}
ebb_status cube_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  const ebb_tensor_t *const *sv = nullptr;
  int n = 0;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &sv, &n);
  ebb_tensor_t *x = nullptr, *sq = nullptr, *y = nullptr;
  bool was;
  ebb_grad_set_enabled(true, &was);  // (backward runs with grad mode off)
  if (!st) st = ebb_tensor_detach(sv[0], &x);
  if (!st) st = ebb_tensor_set_requires_grad(x, true);
  if (!st) st = ebb_op_mul(x, x, &sq);
  if (!st) st = ebb_op_mul(sq, x, &y);
  ebb_grad_set_enabled(was, nullptr);
  const ebb_tensor_t *outs[1] = {y}, *gos[1] = {go[0]}, *ins[1] = {x};
  if (!st) st = ebb_grad(outs, gos, 1, ins, 1, false, false, &gin[0]);
  for (ebb_tensor_t *t : {x, sq, y})
    if (t) ebb_tensor_release(t);
  return st;
}
const ebb_function kCube = {0, "Cube", 1, cube_fwd, nullptr, cube_bwd, nullptr};

// Fails in backward, on whichever thread runs it.
ebb_status fail_bwd(ebb_function_ctx *, const ebb_tensor_t *const *, int, ebb_tensor_t **, int *) {
  return ebb_tensor_clone(nullptr, nullptr);
}
ebb_status clone_fwd(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  return ebb_tensor_clone(in[0], &out[0]);
}
const ebb_function kFailing = {0, "FailsOnDevice", 1, clone_fwd, nullptr, fail_bwd, nullptr};
}  // namespace

TEST_CASE("function: a backward started inside a custom backward (reentrant) gives the right gradient", "[autograd][function][reentrant]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO(dev_name(dev));
    Tensor x = leaf_on(dev, {1, 2, -3});
    Tensor y = apply1(kCube, {x});
    backward_sum(y);
    CHECK(grad_of(x) == std::vector<double>{3, 12, 27});
  }
}

TEST_CASE("function: a custom backward failing on a device worker fails the caller's backward, naming it", "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  EBB_NEED_DEVICES(2);
  // x on device 0 -> to device 1 -> the failing function there -> back to device 0: a backward over
  // two devices, the function's node on device 1's worker.
  Tensor x = leaf_on(0, {1, 2});
  Tensor x1;
  EBB_REQUIRE_OK(ebb_tensor_to_device(x, 1, x1.out()));
  Tensor y = apply1(kFailing, {x1});
  Tensor y0;
  EBB_REQUIRE_OK(ebb_tensor_to_device(y, 0, y0.out()));
  Tensor l = sum_of(y0);
  const ebb_tensor_t *r[1] = {l.get()};
  ebb_autograd_engine_stats s0, s1;
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s0));
  EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "FailsOnDeviceBackward", "the backward of 'FailsOnDevice' failed");
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s1));
  CHECK(s1.nodes_run_on_workers > s0.nodes_run_on_workers);
}

namespace {
// Changes x in place and returns it; marks it dirty only in setup_context.
ebb_status inplace_fwd(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *x = const_cast<ebb_tensor_t *>(in[0]);
  ebb_status st = ebb_op_add_scalar_(x, 1.0);
  if (!st) st = ebb_tensor_retain(x);
  if (!st) out[0] = x;
  return st;
}
ebb_status dirty_setup(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t *const *, int) {
  return ebb_ctx_mark_dirty(ctx, in, 1);
}
const ebb_function kDirtySetup = {0, "DirtyInSetup", 1, inplace_fwd, dirty_setup, pass_bwd, nullptr};

// Returns its input itself; the backward doubles (a gradient the identity's would not give).
ebb_status id_fwd(ebb_function_ctx *, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *x = const_cast<ebb_tensor_t *>(in[0]);
  ebb_status st = ebb_tensor_retain(x);
  if (!st) out[0] = x;
  return st;
}
ebb_status double_bwd(ebb_function_ctx *, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  return ebb_op_mul_scalar(go[0], 2.0, &gin[0]);
}
const ebb_function kIdDouble = {0, "IdDouble", 1, id_fwd, nullptr, double_bwd, nullptr};

// A refused ctx call whose status the forward ignores.
ebb_status ignore_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_status st = ebb_tensor_clone(in[0], &out[0]);
  const ebb_tensor_t *o[1] = {out[0]};
  (void)ebb_ctx_mark_dirty(ctx, o, 1);  // refused: not an input
  return st;
}
const ebb_function kIgnore = {0, "IgnoresRefusal", 1, ignore_fwd, nullptr, pass_bwd, nullptr};

// Saves NULL then x.
ebb_status save_null_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_status st = ebb_tensor_clone(in[0], &out[0]);
  const ebb_tensor_t *sv[2] = {nullptr, in[0]};
  if (!st) st = ebb_ctx_save_for_backward(ctx, sv, 2);
  return st;
}
ebb_status save_null_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  const ebb_tensor_t *const *sv = nullptr;
  int n = 0;
  ebb_status st = ebb_ctx_saved_tensors(ctx, &sv, &n);
  if (st) return st;
  if (n != 2 || sv[0] != nullptr || sv[1] == nullptr) return EBB_EINTERNAL;
  return ebb_op_mul(go[0], sv[1], &gin[0]);  // d/dx of x * stop(x), as a check that slot 1 is x
}
const ebb_function kSaveNull = {0, "SavesNull", 1, save_null_fwd, nullptr, save_null_bwd, nullptr};
std::atomic<int> g_packs{0}, g_unpacks{0}, g_frees{0};
ebb_status count_pack(void *, const ebb_tensor_t *t, void **p) {
  g_packs++;
  ebb_tensor_retain(const_cast<ebb_tensor_t *>(t));
  *p = const_cast<ebb_tensor_t *>(t);
  return EBB_OK;
}
ebb_status count_unpack(void *, void *p, ebb_tensor_t **o) {
  g_unpacks++;
  ebb_tensor_retain(static_cast<ebb_tensor_t *>(p));
  *o = static_cast<ebb_tensor_t *>(p);
  return EBB_OK;
}
void count_free(void *, void *p) {
  g_frees++;
  ebb_tensor_release(static_cast<ebb_tensor_t *>(p));
}

// inputs (b, v): v a view of b; the forward changes b in place (dirty, returned); the backward
// passes the gradient to both.
ebb_status bv_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int) {
  ebb_tensor_t *b = const_cast<ebb_tensor_t *>(in[0]);
  ebb_status st = ebb_op_add_scalar_(b, 1.0);
  if (!st) st = ebb_ctx_mark_dirty(ctx, in, 1);
  if (!st) st = ebb_tensor_retain(b);
  if (!st) out[0] = b;
  return st;
}
ebb_status bv_bwd(ebb_function_ctx *, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  ebb_status st = ebb_tensor_clone(go[0], &gin[0]);
  if (!st) st = ebb_tensor_clone(go[0], &gin[1]);
  return st;
}
const ebb_function kBaseAndView = {0, "BaseAndView", 1, bv_fwd, nullptr, bv_bwd, nullptr};

// The ctx's user data replaced, materialize switched off from backward, the definition's user pointer.
std::atomic<int> g_destroyed{0}, g_null_seen{0};
int g_def_user = 42;
ebb_status user_fwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *in, int, const void *, ebb_tensor_t **out, int nout) {
  if (ebb_ctx_function_user(ctx) != &g_def_user) return EBB_EINTERNAL;
  if (std::string(ebb_ctx_function_name(ctx)) != "UserData") return EBB_EINTERNAL;
  auto destroy = [](void *d) {
    g_destroyed++;
    delete static_cast<int *>(d);
  };
  ebb_status st = ebb_ctx_set_user(ctx, new int(1), destroy);
  int before = g_destroyed;
  if (!st) st = ebb_ctx_set_user(ctx, new int(2), destroy);  // the first one's destructor runs now
  if (!st && g_destroyed != before + 1) return EBB_EINTERNAL;
  for (int k = 0; k < nout && !st; k++) st = ebb_op_mul_scalar(in[0], 1.0, &out[k]);
  return st;
}
ebb_status user_bwd(ebb_function_ctx *ctx, const ebb_tensor_t *const *go, int, ebb_tensor_t **gin, int *) {
  if (*static_cast<int *>(ebb_ctx_user(ctx)) != 2) return EBB_EINTERNAL;
  if (!go[1]) g_null_seen++;
  ebb_status st = ebb_ctx_set_materialize_grads(ctx, false);  // from the next backward on
  if (!st) st = ebb_tensor_clone(go[0], &gin[0]);
  return st;
}
const ebb_function kUserData = {0, "UserData", 2, user_fwd, nullptr, user_bwd, &g_def_user};
}  // namespace

TEST_CASE("function: mark_dirty from setup_context rebases the input as from forward", "[autograd][function][dirty]") {
  EbbSession session;
  Live live;
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
  Tensor b;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, b.out()));
  ebb_tensor_t *o[1] = {nullptr};
  const ebb_tensor_t *in[1] = {b.get()};
  EBB_REQUIRE_OK(ebb_function_apply(&kDirtySetup, in, 1, nullptr, o));
  Tensor y(o[0]);
  CHECK(y.get() == b.get());
  const ebb_node_t *gf = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(b, &gf, nullptr));
  CHECK(std::string(ebb_node_name(gf)) == "DirtyInSetupBackward");
  y = Tensor();
  backward_sum(b);
  CHECK(grad_of(a) == std::vector<double>{2, 2, 2});
}

TEST_CASE("function: an input returned as-is is a view whose history cannot be rebuilt past the function",
          "[autograd][function][views]") {
  EbbSession session;
  Live live;
  {  // unchanged: the custom backward's gradient
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor x;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 1.0, x.out()));
    Tensor y = apply1(kIdDouble, {x.get()});
    CHECK(y.get() != x.get());
    backward_sum(y);
    CHECK(grad_of(a) == std::vector<double>{2, 2, 2});
  }
  {  // the output changed in place: refused
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor x;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 1.0, x.out()));
    Tensor y = apply1(kIdDouble, {x.get()});
    EBB_CHECK_MSG(ebb_op_add_scalar_(y, 1.0), EBB_EINVAL, "a view a custom function returned", "IdDoubleBackward");
    const ebb_node_t *gf = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &gf, nullptr));
    CHECK(std::string(ebb_node_name(gf)) == "IdDoubleBackward");
  }
  {  // its base changed in place: the output's next use is refused
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor x;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 1.0, x.out()));
    Tensor y = apply1(kIdDouble, {x.get()});
    EBB_REQUIRE_OK(ebb_op_mul_scalar_(x, 3.0));
    Tensor l;
    EBB_CHECK_MSG(ebb_op_sum(y, nullptr, 0, false, l.out()), EBB_EINVAL, "its base was changed in place since", "IdDoubleBackward");
  }
  {  // a non-contiguous input returned unchanged
    Tensor a = make(EBB_DEVICE_CPU, EBB_F64, {2, 3}, {1, 2, 3, 4, 5, 6});
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(a, true));
    Tensor t;
    EBB_REQUIRE_OK(ebb_tensor_transpose(a, 0, 1, t.out()));
    Tensor y = apply1(kIdDouble, {t.get()});
    CHECK(shape_of(y) == std::vector<int64_t>{3, 2});
    backward_sum(y);
    CHECK(grad_of(a) == std::vector<double>(6, 2.0));
  }
}

TEST_CASE("function: a refused ctx call the forward ignores fails the apply", "[autograd][function][errors]") {
  EbbSession session;
  Live live;
  Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
  ebb_tensor_t *o[1] = {nullptr};
  const ebb_tensor_t *in[1] = {a.get()};
  EBB_CHECK_MSG(ebb_function_apply(&kIgnore, in, 1, nullptr, o), EBB_EINVAL, "went on after a ctx call was refused", "is not an input");
  CHECK(o[0] == nullptr);
}

TEST_CASE("function: a view input whose base the forward changes keeps the history it was passed with", "[autograd][function][views]") {
  EbbSession session;
  Live live;
  for (int mode = 0; mode < 2; mode++) {
    INFO((mode ? "ebb_grad" : "ebb_backward"));
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor b, v;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, b.out()));
    int64_t s[1] = {3};
    EBB_REQUIRE_OK(ebb_tensor_view(b, 1, s, v.out()));
    ebb_tensor_t *o[1] = {nullptr};
    const ebb_tensor_t *in[2] = {b.get(), v.get()};
    EBB_REQUIRE_OK(ebb_function_apply(&kBaseAndView, in, 2, nullptr, o));
    Tensor y(o[0]);
    const ebb_node_t *gf = nullptr, *n1 = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &gf, nullptr));
    EBB_REQUIRE_OK(ebb_node_next(gf, 1, &n1, nullptr));
    uint64_t s0 = 0, s1 = 0;
    EBB_REQUIRE_OK(ebb_node_sequence_nr(gf, &s0));
    EBB_REQUIRE_OK(ebb_node_sequence_nr(n1, &s1));
    CHECK(s1 < s0);  // producers before consumers
    Tensor ones = make(EBB_DEVICE_CPU, EBB_F64, {3}, {1, 1, 1});
    const ebb_tensor_t *r[1] = {y.get()}, *gr[1] = {ones.get()}, *ins[1] = {a.get()};
    if (mode == 0) {
      EBB_REQUIRE_OK(ebb_backward(r, gr, 1, false, nullptr, 0));
      CHECK(grad_of(a) == std::vector<double>{4, 4, 4});
    } else {
      ebb_tensor_t *g[1] = {nullptr};
      EBB_REQUIRE_OK(ebb_grad(r, gr, 1, ins, 1, false, false, g));
      Tensor G(g[0]);
      CHECK(read(G) == std::vector<double>{4, 4, 4});
    }
  }
}

TEST_CASE("function: saved-tensor hooks see a function's saved tensors: pushed around apply, and per slot", "[autograd][function][saved]") {
  EbbSession session;
  Live live;
  ebb_saved_hooks h = {count_pack, count_unpack, count_free, nullptr};
  {  // the stack: pack at apply (NULL saves skipped), unpack in backward, free with the node
    g_packs = g_unpacks = g_frees = 0;
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&h));
    Tensor y = apply1(kSaveNull, {a.get()});
    EBB_REQUIRE_OK(ebb_saved_tensors_hooks_pop());
    CHECK(g_packs == 1);
    backward_sum(y);
    CHECK(g_unpacks == 1);
    CHECK(g_frees == 1);
    CHECK(grad_of(a) == std::vector<double>{1, 2, 3});
  }
  {  // per slot, numbered in save order; a slot where NULL was saved holds nothing
    g_packs = g_unpacks = g_frees = 0;
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor y = apply1(kSaveNull, {a.get()});
    const ebb_node_t *gf = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &gf, nullptr));
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(gf, 5, &h), EBB_EINVAL, "saves no tensor at index 5", "1 (tensor 1)",
                  "the order its ctx saved them in, 0..1");
    EBB_CHECK_MSG(ebb_node_saved_register_hooks(gf, 0, &h), EBB_EINVAL, "saves no tensor at index 0");
    EBB_REQUIRE_OK(ebb_node_saved_register_hooks(gf, 1, &h));
    CHECK(g_packs == 1);
    backward_sum(y);
    CHECK(g_unpacks == 1);
    CHECK(grad_of(a) == std::vector<double>{1, 2, 3});
  }
}

TEST_CASE("function: user data replaced, the definition's user pointer, materialize switched off from backward",
          "[autograd][function]") {
  EbbSession session;
  Live live;
  g_destroyed = 0;
  g_null_seen = 0;
  {
    Tensor a = leaf_on(EBB_DEVICE_CPU, {1, 2});
    ebb_tensor_t *o[2] = {nullptr, nullptr};
    const ebb_tensor_t *in[1] = {a.get()};
    EBB_REQUIRE_OK(ebb_function_apply(&kUserData, in, 1, nullptr, o));
    Tensor y0(o[0]), y1(o[1]);
    CHECK(g_destroyed == 1);
    Tensor l = sum_of(y0);
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));  // materialized: zeros for output 1
    CHECK(g_null_seen == 0);
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));  // materialize off since the first
    CHECK(g_null_seen == 1);
  }
  CHECK(g_destroyed == 2);  // the second data went with the node
}

TEST_CASE("function: concurrent backward calls through one function node (retain_graph)", "[autograd][function][threads]") {
  EbbSession session;
  Live live;
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    INFO(dev_name(dev));
    Tensor x = leaf_on(dev, {1, 2, 3}), w = leaf_on(dev, {4, 5, 6});
    double s = 2;
    Tensor y = apply1(kScaledMul, {x, w}, &s);
    Tensor l = sum_of(y);
    const int kThreads = 4, kIters = 25;
    std::atomic<int> bad{0};
    std::vector<std::thread> th;
    for (int t = 0; t < kThreads; t++)
      th.emplace_back([&] {
        for (int i = 0; i < kIters; i++) {
          const ebb_tensor_t *r[1] = {l.get()}, *ins[2] = {x.get(), w.get()};
          ebb_tensor_t *g[2] = {nullptr, nullptr};
          if (ebb_grad(r, nullptr, 1, ins, 2, true, false, g) != EBB_OK) {
            bad++;
            continue;
          }
          double hx[3], hw[3];
          if (ebb_tensor_to_host(g[0], hx, sizeof hx) || ebb_tensor_to_host(g[1], hw, sizeof hw) || hx[0] != 8 || hx[2] != 12 ||
              hw[0] != 2 || hw[2] != 6)
            bad++;
          ebb_tensor_release(g[0]);
          ebb_tensor_release(g[1]);
        }
      });
    for (auto &t : th) t.join();
    CHECK(bad == 0);
  }
}
