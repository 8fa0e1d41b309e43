// Saved tensors and saved-tensor hooks (ebb/autograd.h): pack once, unpack per use, free once;
// the innermost pair, bound at save time; gradients through identity-like hooks equal to none, on
// the CPU, a device and across devices; the stack carried to device workers; disabling; errors
// from the hooks and from what they return; the version check's message; no reference cycle
// through a node that saves its own output.
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "sanitizers.hpp"
#include "autograd_test_util.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// What a pair of test hooks did, and how they misbehave when asked to.
struct Hooks {
  enum Mode { IDENTITY, HOST_COPY, PACK_FAILS, PACK_FAILS_SILENT, PACK_INPLACE, UNPACK_FAILS, UNPACK_NULL, UNPACK_SHAPE,
              UNPACK_DTYPE, UNPACK_DEVICE, POP_IN_PACK };
  Mode mode = HOST_COPY;
  std::atomic<int> packs{0}, unpacks{0}, frees{0};
  std::atomic<int> off_main{0};
  std::atomic<int> grad_on{0};   // packs that ran with grad mode on  // hooks that ran on another thread than the test's
  std::thread::id main = std::this_thread::get_id();
  ebb_saved_hooks pair() {
    ebb_saved_hooks h = {pack, unpack, free_packed, this};
    return h;
  }
  void seen() {
    if (std::this_thread::get_id() != main) off_main++;
  }

  // The packed value: the saved tensor's device and a copy on the host (IDENTITY: the tensor itself).
  struct Packed {
    int device;
    ebb_tensor_t *t;
  };

  static ebb_status pack(void *user, const ebb_tensor_t *t, void **packed) {
    auto *h = static_cast<Hooks *>(user);
    h->packs++;
    h->seen();
    if (ebb_grad_enabled()) h->grad_on++;  // pack runs with grad mode off
    ebb_tensor_info info;
    ebb_status st = ebb_tensor_get_info(t, &info);
    if (st) return st;
    if (h->mode == PACK_FAILS) return ebb_tensor_set_requires_grad(nullptr, true);  // fails with a message of ebb's
    if (h->mode == PACK_FAILS_SILENT) return EBB_ENOMEM;
    if (h->mode == POP_IN_PACK) {  // ends its own pair while it runs, then packs as HOST_COPY
      st = ebb_saved_tensors_hooks_pop();
      if (st) return st;
    }
    if (h->mode == PACK_INPLACE) {
      st = ebb_tensor_fill_(const_cast<ebb_tensor_t *>(t), 0.0);
      if (st) return st;
    }
    auto *p = new Packed{info.device, nullptr};
    if (h->mode == IDENTITY || h->mode == PACK_INPLACE) {
      st = ebb_tensor_retain(const_cast<ebb_tensor_t *>(t));
      p->t = const_cast<ebb_tensor_t *>(t);
    } else {
      st = info.device == EBB_DEVICE_CPU ? ebb_tensor_clone(t, &p->t) : ebb_tensor_to_device(t, EBB_DEVICE_CPU, &p->t);
    }
    if (st) {
      delete p;
      return st;
    }
    *packed = p;
    return EBB_OK;
  }

  static ebb_status unpack(void *user, void *packed, ebb_tensor_t **out) {
    auto *h = static_cast<Hooks *>(user);
    auto *p = static_cast<Packed *>(packed);
    h->unpacks++;
    h->seen();
    const int64_t seven = 7;
    switch (h->mode) {
      case UNPACK_FAILS: return ebb_tensor_set_requires_grad(nullptr, true);
      case UNPACK_NULL: *out = nullptr; return EBB_OK;
      case UNPACK_SHAPE: return ebb_tensor_zeros(p->device, EBB_F64, 1, &seven, out);
      case UNPACK_DTYPE: return ebb_tensor_to_dtype(p->t, EBB_F32, out);
      case UNPACK_DEVICE: return ebb_tensor_to_device(p->t, p->device == EBB_DEVICE_CPU ? 0 : EBB_DEVICE_CPU, out);
      default: break;
    }
    if (h->mode == IDENTITY || p->device == EBB_DEVICE_CPU) {
      ebb_status st = ebb_tensor_retain(p->t);
      if (!st) *out = p->t;
      return st;
    }
    return ebb_tensor_to_device(p->t, p->device, out);
  }

  static void free_packed(void *user, void *packed) {
    auto *h = static_cast<Hooks *>(user);
    auto *p = static_cast<Packed *>(packed);
    h->frees++;
    ebb_tensor_release(p->t);
    delete p;
  }
};

// Pushes a pair for the scope.
struct Push {
  explicit Push(Hooks &h) {
    ebb_saved_hooks p = h.pair();
    EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&p));
  }
  ~Push() { CHECK(ebb_saved_tensors_hooks_pop() == EBB_OK); }
};



// l = sum(tanh(x * w) * tanh(x * w) + exp(w)), with x and w on `dx`, `dw`; the products on dw's
// device. MulBackward saves its inputs, TanhBackward and ExpBackward their outputs.
Tensor build(const ebb_tensor_t *x, const ebb_tensor_t *w, int dw) {
  Tensor xd, a, b, c, e, s, l;
  EBB_REQUIRE_OK(ebb_tensor_to_device(x, dw, xd.out()));
  EBB_REQUIRE_OK(ebb_op_mul(xd, w, a.out()));
  EBB_REQUIRE_OK(ebb_op_tanh(a, b.out()));
  EBB_REQUIRE_OK(ebb_op_mul(b, b, c.out()));
  EBB_REQUIRE_OK(ebb_op_exp(w, e.out()));
  EBB_REQUIRE_OK(ebb_op_add(c, e, s.out()));
  EBB_REQUIRE_OK(ebb_op_sum(s, nullptr, 0, false, l.out()));
  return l;
}

// The gradients of x and w through build(), with hooks h pushed around the forward (or none).
std::pair<std::vector<double>, std::vector<double>> grads(int dx, int dw, Hooks *h) {
  Tensor x = leaf_on(dx, values(5, 3)), w = leaf_on(dw, values(5, 4));
  Tensor l;
  if (h) {
    Push p(*h);
    l = build(x, w, dw);
  } else {
    l = build(x, w, dw);
  }
  const ebb_tensor_t *r[1] = {l.get()};
  EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
  return {grad_of(x), grad_of(w)};
}


}  // namespace

TEST_CASE("saved hooks: pack once at save time, unpack at each use, free once per packed value", "[autograd][saved-hooks]") {
  EbbSession session;
  Live live;
  {
    Hooks h;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.5, -1, 2});
    Tensor y, z, l;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_mul(x, x, y.out()));  // saves x twice: two packs
      EBB_REQUIRE_OK(ebb_op_exp(y, z.out()));     // saves its output
    }
    EBB_REQUIRE_OK(ebb_op_sum(z, nullptr, 0, false, l.out()));  // after the pop: saves nothing through h
    CHECK(h.packs == 3);
    CHECK(h.unpacks == 0);
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
    CHECK(h.unpacks == 3);
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, true, nullptr, 0));
    CHECK(h.unpacks == 6);
    CHECK(h.frees == 0);  // retain_graph keeps them
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    CHECK(h.unpacks == 9);
    CHECK(h.frees == 3);  // released by the backward without retain_graph
    // d/dx sum(exp(x^2)) = 2x exp(x^2), three backward calls summed
    std::vector<double> want;
    for (double v : {0.5, -1.0, 2.0}) want.push_back(3 * 2 * v * std::exp(v * v));
    EBB_CHECK_CLOSE(grad_of(x), want, 1e-12, 1e-12);
    EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "ExpBackward", "retain_graph");
    CHECK(h.unpacks == 9);
    CHECK(h.frees == 3);
  }
  {
    // A graph released without a backward frees its packed values with its nodes.
    Hooks h;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
    Tensor y, z;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_mul(x, x, y.out()));
      EBB_REQUIRE_OK(ebb_op_tanh(y, z.out()));
    }
    CHECK(h.packs == 3);
    y.reset();
    CHECK(h.frees == 0);  // tanh's node holds mul's
    z.reset();
    CHECK(h.frees == 3);
    CHECK(h.unpacks == 0);
  }
  live.check();
}

TEST_CASE("saved hooks: the innermost pair wins and stays bound to what it saved after a pop", "[autograd][saved-hooks]") {
  EbbSession session;
  Live live;
  {
    Hooks outer, inner;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.25, 0.5});
    Tensor a, b, c, l;
    {
      Push po(outer);
      {
        Push pi(inner);
        EBB_REQUIRE_OK(ebb_op_exp(x, a.out()));  // inner
      }
      EBB_REQUIRE_OK(ebb_op_tanh(a, b.out()));   // outer
    }
    EBB_REQUIRE_OK(ebb_op_exp(b, c.out()));      // none
    EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, l.out()));
    CHECK(inner.packs == 1);
    CHECK(outer.packs == 1);
    {
      Hooks late;  // pushed after the save: not used by the backward
      Push pl(late);
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
      CHECK(late.unpacks == 0);
      CHECK(late.packs == 0);
    }
    CHECK(inner.unpacks == 1);
    CHECK(outer.unpacks == 1);
    CHECK(inner.frees == 1);
    CHECK(outer.frees == 1);
  }
  live.check();
}

TEST_CASE("saved hooks: host-copy hooks give gradients bitwise equal to none, on the CPU, a device and across devices",
          "[autograd][saved-hooks][devices]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  Live live;
  std::vector<std::pair<int, int>> cases{{EBB_DEVICE_CPU, EBB_DEVICE_CPU}, {0, 0}, {EBB_DEVICE_CPU, 0}, {0, 1}};
  for (auto [dx, dw] : cases) {
    INFO("x on " << dev_name(dx) << ", w on " << dev_name(dw));
    for (Hooks::Mode mode : {Hooks::HOST_COPY, Hooks::IDENTITY}) {
      Hooks h;
      h.mode = mode;
      auto plain = grads(dx, dw, nullptr);
      auto hooked = grads(dx, dw, &h);
      CHECK(hooked.first == plain.first);
      CHECK(hooked.second == plain.second);
      CHECK(h.packs == 6);  // mul: 2, tanh: 1, mul: 2 (the same tensor twice), exp: 1
      CHECK(h.grad_on == 0);
      CHECK(h.unpacks == h.packs.load());
      CHECK(h.frees == h.packs.load());
    }
  }
  live.check();
}

TEST_CASE("saved hooks: device workers unpack with the pair bound at save time and see the caller's stack",
          "[autograd][saved-hooks][workers]") {
  EbbSession session;
  Live live;
  ebb_engine_mode mode = ebb_autograd_engine_mode();
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_WORKERS));
  {
    Hooks h;
    Tensor x = leaf_on(0, {0.5, 1.5, -2});
    Tensor side = leaf_on(0, {1, 2, 3});
    Tensor y, l;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
    }
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
    REQUIRE(h.packs == 1);
    // A tensor hook on y (run on device 0's worker) records an op with grad mode on: it saves
    // through the caller's hooks, pushed around the backward; what it pushes and leaves goes at
    // the node's end; popping the caller's pair is refused.
    struct Ctx {
      const ebb_tensor_t *side;
      Tensor made;
      ebb_status pop_st = EBB_OK;
      std::string pop_msg;
      bool enabled = false;
    } ctx{side.get(), Tensor(), EBB_OK, "", false};
    auto hook = [](const ebb_tensor_t *, ebb_tensor_t **, void *user) -> ebb_status {
      auto *c = static_cast<Ctx *>(user);
      bool was;
      ebb_grad_set_enabled(true, &was);
      ebb_status st = ebb_op_tanh(c->side, c->made.out());
      ebb_grad_set_enabled(was, nullptr);
      c->enabled = ebb_saved_tensors_hooks_is_enabled();
      c->pop_st = ebb_saved_tensors_hooks_pop();
      c->pop_msg = ebb_last_error();
      static Hooks stray;
      ebb_saved_hooks sp = stray.pair();
      if (!st) st = ebb_saved_tensors_hooks_push(&sp);  // left pushed: dropped when the node ends
      return st;
    };
    ebb_hook_handle hh;
    EBB_REQUIRE_OK(ebb_tensor_register_hook(y, hook, &ctx, &hh));
    Hooks caller;
    {
      Push p(caller);
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
      CHECK(ebb_saved_tensors_hooks_is_enabled());
    }
    CHECK(h.unpacks == 1);
    CHECK(h.off_main == 1);  // on the worker
    CHECK(h.frees == 1);
    CHECK(caller.packs == 1);  // tanh's output, saved on the worker through the caller's pair
    CHECK(caller.off_main == 1);
    CHECK(ctx.enabled);
    CHECK(ctx.pop_st == EBB_ESTATE);
    CHECK(ctx.pop_msg.find("belongs to the running backward's caller") != std::string::npos);
    std::vector<double> want;
    for (double v : {0.5, 1.5, -2.0}) want.push_back(std::exp(v));
    EBB_CHECK_CLOSE(grad_of(x), want, 1e-12, 1e-12);
    ctx.made.reset();
    CHECK(caller.frees == 1);
  }
  // The calling thread's stack is its own again: nothing left pushed.
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_pop(), EBB_ESTATE, "no saved-tensor hooks pushed");
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
  live.check();
}

TEST_CASE("saved hooks: disable scopes refuse pushes with their message and nest", "[autograd][saved-hooks][errors]") {
  EbbSession session;
  Hooks h;
  ebb_saved_hooks p = h.pair();
  CHECK(ebb_saved_tensors_hooks_is_enabled());
  CHECK(ebb_saved_tensors_hooks_disabled_message() == nullptr);
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_disable("no hooks in the outer part"));
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_push(&p), EBB_ESTATE, "no hooks in the outer part");
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_disable("no hooks in the inner part"));
  CHECK_FALSE(ebb_saved_tensors_hooks_is_enabled());
  CHECK(std::string(ebb_saved_tensors_hooks_disabled_message()) == "no hooks in the inner part");
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_push(&p), EBB_ESTATE, "no hooks in the inner part");
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_enable());
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_push(&p), EBB_ESTATE, "no hooks in the outer part");
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_enable());
  CHECK(ebb_saved_tensors_hooks_is_enabled());
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_enable(), EBB_ESTATE, "no disable scope open");
  // Disabling while hooks are pushed fails with the message; nothing changes.
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&p));
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_disable("hooks are not allowed here"), EBB_ESTATE, "hooks are not allowed here");
  CHECK(ebb_saved_tensors_hooks_is_enabled());
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_pop());
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_pop(), EBB_ESTATE, "no saved-tensor hooks pushed on this thread");
  // Bad arguments.
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_push(nullptr), EBB_EINVAL, "h is NULL");
  ebb_saved_hooks no_unpack = {Hooks::pack, nullptr, nullptr, &h};
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_push(&no_unpack), EBB_EINVAL, "h->unpack is NULL");
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_disable(nullptr), EBB_EINVAL, "message is NULL");
  // The stack is per thread: another thread sees none of this one's scopes.
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_disable("here only"));
  bool other = false;
  std::thread t([&] { other = ebb_saved_tensors_hooks_is_enabled(); });
  t.join();
  CHECK(other);
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_enable());
}

TEST_CASE("saved hooks: a failing pack fails the op, a failing unpack the backward, each naming the node and the tensor",
          "[autograd][saved-hooks][errors]") {
  EbbSession session;
  Live live;
  {
    Hooks h;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2, 3}, "x");
    Tensor y;
    h.mode = Hooks::PACK_FAILS;
    {
      Push p(h);
      EBB_CHECK_MSG(ebb_op_sin(x, y.out()), EBB_EINVAL, "ebb_op_sin", "SinBackward", "saved input 0 'x' (f64[3] on the CPU)",
                    "pack hook failed", "ebb_tensor_set_requires_grad");
      CHECK(y.get() == nullptr);
      h.mode = Hooks::PACK_FAILS_SILENT;
      EBB_CHECK_MSG(ebb_op_sin(x, y.out()), EBB_ENOMEM, "pack hook failed", "returned", "ENOMEM");
    }
    CHECK(h.frees == 0);  // nothing was packed
    // A pack hook that changes its input in place.
    Tensor scratch = leaf_on(EBB_DEVICE_CPU, {4, 5});
    h.mode = Hooks::PACK_INPLACE;
    {
      Push p(h);
      EBB_CHECK_MSG(ebb_op_sin(scratch, y.out()), EBB_EINVAL, "a saved-tensor pack hook modified its input in place",
                    "SinBackward", "saved input 0");
    }
    CHECK(h.frees == 1);  // its packed value is freed
    // An unpack hook's failure fails the backward with the hook's message.
    h.mode = Hooks::HOST_COPY;
    Tensor l;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_tanh(x, y.out()));
    }
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
    h.mode = Hooks::UNPACK_FAILS;
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, true, nullptr, 0), EBB_EINVAL, "ebb_backward", "TanhBackward",
                  "saved output 0 (f64[3] on the CPU)", "unpack hook failed", "ebb_tensor_set_requires_grad");
    CHECK(h.frees == 1);  // the in-place pack's value only: retain_graph keeps tanh's
    l.reset();
    y.reset();
    CHECK(h.frees == 2);
  }
  live.check();
}

TEST_CASE("saved hooks: an unpack returning nothing, or another shape, dtype or device, fails the backward naming both",
          "[autograd][saved-hooks][errors]") {
  EbbSession session;
  Live live;
  struct Case {
    Hooks::Mode mode;
    const char *got;
  };
  for (Case c : {Case{Hooks::UNPACK_NULL, "returned no tensor (NULL)"}, Case{Hooks::UNPACK_SHAPE, "returned a tensor (f64[7] on the CPU)"},
                 Case{Hooks::UNPACK_DTYPE, "returned a tensor (f32[2] on the CPU)"},
                 Case{Hooks::UNPACK_DEVICE, "returned a tensor (f64[2] on device 0)"}}) {
    INFO(c.got);
    Hooks h;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.5, 2}, "x");
    Tensor y, l;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_sin(x, y.out()));  // saves its input
    }
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
    h.mode = c.mode;
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "SinBackward", "saved input 0 'x' (f64[2] on the CPU)",
                  c.got, "expected the saved tensor's shape, dtype and device");
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
    CHECK(g.get() == nullptr);  // nothing written
    l.reset();
    y.reset();
    CHECK(h.frees == 1);
  }
  live.check();
}

TEST_CASE("saved tensors: a change in place after the save fails backward naming the tensor, the node and both versions",
          "[autograd][saved-hooks][errors]") {
  EbbSession session;
  Live live;
  {
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2, 3});
    Tensor a, b, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 2.0, a.out()));
    EBB_REQUIRE_OK(ebb_tensor_set_name(a, "act"));
    EBB_REQUIRE_OK(ebb_op_sin(a, b.out()));  // saves a
    EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, l.out()));
    uint64_t seq = 0;
    const ebb_node_t *fn = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(b, &fn, nullptr));
    EBB_REQUIRE_OK(ebb_node_sequence_nr(fn, &seq));
    EBB_REQUIRE_OK(ebb_op_add_(a, x));
    const ebb_tensor_t *r[1] = {l.get()};
    std::string node = "SinBackward (node " + std::to_string(seq) + ")";
    EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_ESTATE, node.c_str(),
                  "saved input 0 'act' (f64[3] on the CPU)", "saved at version 0, now 1");
    // Through hooks, what the pack kept is what the backward reads: no version check.
    Hooks h;
    Tensor c, l2;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_sin(a, c.out()));
    }
    EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, l2.out()));
    bool was;
    ebb_grad_set_enabled(false, &was);
    EBB_REQUIRE_OK(ebb_tensor_fill_(a, 0.0));
    ebb_grad_set_enabled(was, nullptr);
    const ebb_tensor_t *r2[1] = {l2.get()};
    EBB_REQUIRE_OK(ebb_backward(r2, nullptr, 1, false, nullptr, 0));
    CHECK(h.unpacks == 1);
  }
  live.check();
}

TEST_CASE("saved tensors: a node that saves its own output is freed with its graph (no reference cycle)", "[autograd][saved-hooks]") {
  EbbSession session;
  Live live;
  {
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
    Tensor y, z;
    EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));   // saves y
    EBB_REQUIRE_OK(ebb_op_tanh(y, z.out()));  // saves z
    CHECK(ebb_autograd_live_nodes() > live.nodes);
    y.reset();
    z.reset();
    CHECK(ebb_autograd_live_nodes() == live.nodes);
  }
  live.check();
}

TEST_CASE("saved hooks: an in-place op's saved old value and operand go through the hooks too", "[autograd][saved-hooks][inplace]") {
  EbbSession session;
  Live live;
  auto run = [](Hooks *h) {
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.5, -1.5, 2}), w = leaf_on(EBB_DEVICE_CPU, {3, 0.25, -1});
    Tensor a, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(x, 3.0, a.out()));  // (saves nothing: a may change in place)
    if (h) {
      Push p(*h);
      EBB_REQUIRE_OK(ebb_op_mul_(a, w));  // saves a's old value (a copy) and w
    } else {
      EBB_REQUIRE_OK(ebb_op_mul_(a, w));
    }
    EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, l.out()));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    return std::make_pair(grad_of(x), grad_of(w));
  };
  Hooks h;
  auto plain = run(nullptr);
  auto hooked = run(&h);
  CHECK(hooked.first == plain.first);
  CHECK(hooked.second == plain.second);
  CHECK(h.packs == 2);
  CHECK(h.unpacks == 2);
  CHECK(h.frees == 2);
  live.check();
}

TEST_CASE("saved hooks: threads sharing a graph unpack while one releases it, and the value is freed once, after the last unpack",
          "[autograd][saved-hooks][threads]") {
  EbbSession session;
  Live live;
  for (int round = 0; round < 20; round++) {
    Hooks h;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.5, 1, 1.5});
    Tensor y, l;
    {
      Push p(h);
      EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
    }
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
    const ebb_tensor_t *r[1] = {l.get()};
    const ebb_tensor_t *in[1] = {x.get()};
    ebb_status sa = EBB_OK, sb = EBB_OK;
    std::string ma;
    std::thread a([&] {  // retains: may come after b released the saved tensors
      ebb_tensor_t *g[1] = {nullptr};
      sa = ebb_grad(r, nullptr, 1, in, 1, true, false, g);
      if (sa) ma = ebb_last_error();
      if (g[0]) ebb_tensor_release(g[0]);
    });
    std::thread b([&] {
      ebb_tensor_t *g[1] = {nullptr};
      sb = ebb_grad(r, nullptr, 1, in, 1, false, false, g);
      if (g[0]) ebb_tensor_release(g[0]);
    });
    a.join();
    b.join();
    CHECK(sb == EBB_OK);
    if (sa) {
      CHECK(sa == EBB_ESTATE);
      CHECK(ma.find("retain_graph") != std::string::npos);
    }
    CHECK(h.unpacks == (sa ? 1 : 2));
    CHECK(h.frees == 1);  // b's release, or a's last unpack after it
    y.reset();
    l.reset();
    CHECK(h.frees == 1);
  }
  live.check();
}

TEST_CASE("saved hooks: pairs a hook leaves pushed on the calling thread are dropped when the backward ends",
          "[autograd][saved-hooks]") {
  EbbSession session;
  Live live;
  ebb_engine_mode mode = ebb_autograd_engine_mode();
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(EBB_ENGINE_CALLING_THREAD));
  {
    static Hooks stray;
    Tensor x = leaf_on(EBB_DEVICE_CPU, {1, 2});
    Tensor y, l;
    EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, l.out()));
    struct Seen {
      ebb_status push = EBB_OK, pop = EBB_OK;
    } seen;
    auto hook = [](const ebb_tensor_t *, ebb_tensor_t **, void *user) -> ebb_status {
      auto *s = static_cast<Seen *>(user);
      ebb_saved_hooks sp = stray.pair();
      s->push = ebb_saved_tensors_hooks_push(&sp);
      s->push = s->push ? s->push : ebb_saved_tensors_hooks_push(&sp);  // two, one popped: one left
      s->pop = ebb_saved_tensors_hooks_pop();
      return EBB_OK;
    };
    ebb_hook_handle hh;
    EBB_REQUIRE_OK(ebb_tensor_register_hook(y, hook, &seen, &hh));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    CHECK(seen.push == EBB_OK);
    CHECK(seen.pop == EBB_OK);
    EBB_CHECK_FAILS(ebb_saved_tensors_hooks_pop(), EBB_ESTATE, "no saved-tensor hooks pushed");
  }
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
  live.check();
}

// A hook may call any ebb function, its own pair's pop included: the pair it was called for is
// the one the saved tensor keeps, whatever happens to the stack meanwhile.
TEST_CASE("saved hooks: a pack hook that pops its own pair still packs, unpacks and frees with it", "[autograd][saved-hooks]") {
  EbbSession session;
  const long tensors0 = ebb_tensor_live_count();
  Hooks h;
  h.mode = Hooks::POP_IN_PACK;
  ebb_saved_hooks pair = h.pair();
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&pair));
  {
    Tensor x = leaf_on(EBB_DEVICE_CPU, {0.5, -1.0}), y, loss;
    EBB_REQUIRE_OK(ebb_op_exp(x, y.out()));  // saves its output: one pack, which pops the pair
    CHECK(h.packs == 1);
    EBB_CHECK_FAILS(ebb_saved_tensors_hooks_pop(), EBB_ESTATE, "no saved-tensor hooks pushed");
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, loss.out()));
    const ebb_tensor_t *root = loss;
    EBB_REQUIRE_OK(ebb_backward(&root, nullptr, 1, false, nullptr, 0));
    CHECK(h.unpacks == 1);
    CHECK(h.frees == 1);
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(x, g.out()));
    CHECK(read(g) == std::vector<double>{std::exp(0.5), std::exp(-1.0)});
  }
  CHECK(h.frees == h.packs);
  CHECK(ebb_tensor_live_count() == tensors0);
}
