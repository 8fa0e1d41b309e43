// Saved tensors offloaded to pinned memory (ebb/autograd.h, "offloaded saved tensors"): gradients
// bitwise equal to no offload over several steps, with views, a second user stream, two devices,
// device workers and retain_graph; the engine's reloads from the first backward; storage dedupe;
// what stays on the device and why; the device budget; a backward that fails half-way; the pools
// left empty; the policy's and the saves' bad input. The executable runs with the emulated
// driver's link model on (EBB_SIM_COPY_GBPS) and its kernels taking time (EBB_SIM_LAUNCH_US), so
// a copy lands in pieces and a reader that skips an event reads old or poisoned memory.
#include <atomic>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/stream.h"
#include "autograd_test_util.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

constexpr int64_t kBatch = 32, kWidth = 64; // activations of 8 KiB in f32


ebb_offload_policy every_tensor() {
  ebb_offload_policy p = {};
  p.min_bytes = 1;  // every device tensor that is not a parameter
  p.poison = true;
  return p;
}

struct Scope {
  explicit Scope(const ebb_offload_policy &p) { EBB_REQUIRE_OK(ebb_offload_scope_enter(&p)); }
  ~Scope() { CHECK(ebb_offload_scope_exit() == EBB_OK); }
};

// Layers on devs[i % devs.size()]: h = tanh(h @ w_i); every other layer multiplies h by a view
// of itself (MulBackward saves two handles on one storage, TanhBackward saved it too).
struct Net {
  std::vector<int> devs;
  std::vector<Tensor> w;
  Tensor x;
  Net(std::vector<int> d, int layers) : devs(std::move(d)) {
    x = make(devs[0], EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 7));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(x, true));
    for (int i = 0; i < layers; i++) {
      Tensor t = make(devs[i % devs.size()], EBB_F32, {kWidth, kWidth}, values(kWidth * kWidth, 100 + i, -0.2, 0.2));
      EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
      w.push_back(std::move(t));
    }
  }
  // New input values (seeded): each step's activations differ from the last one's, so a reload
  // that reads a pinned block before its copy out landed reads another step's values.
  void set_input(unsigned seed) {
    Tensor v = make(devs[0], EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, seed));
    bool was;
    ebb_grad_set_enabled(false, &was);
    EBB_REQUIRE_OK(ebb_tensor_copy_(x, v));
    ebb_grad_set_enabled(was, nullptr);
  }
  Tensor forward() const {
    Tensor h;
    EBB_REQUIRE_OK(ebb_tensor_view(x, 2, std::vector<int64_t>{kBatch, kWidth}.data(), h.out()));
    for (size_t i = 0; i < w.size(); i++) {
      int d = devs[i % devs.size()];
      Tensor hd, a, b;
      EBB_REQUIRE_OK(ebb_tensor_to_device(h, d, hd.out()));
      EBB_REQUIRE_OK(ebb_op_matmul(hd, w[i], a.out()));
      EBB_REQUIRE_OK(ebb_op_tanh(a, b.out()));
      if (i % 2) {
        Tensor v, m;
        EBB_REQUIRE_OK(ebb_tensor_view(b, 2, std::vector<int64_t>{kBatch, kWidth}.data(), v.out()));
        EBB_REQUIRE_OK(ebb_op_mul(b, v, m.out()));
        b = std::move(m);
      }
      h = std::move(b);
    }
    Tensor l;
    EBB_REQUIRE_OK(ebb_op_sum(h, nullptr, 0, false, l.out()));
    return l;
  }
  // One step: forward (under the policy when given), backward(s), the gradients read and cleared.
  // fwd_stream: the forward runs there (the backward on the caller's current stream).
  std::vector<std::vector<double>> step(const ebb_offload_policy *p, int backwards = 1, ebb_stream_t *fwd_stream = nullptr) {
    Tensor l;
    ebb_stream_guard fg;
    if (fwd_stream) {
      ebb_stream_t *cur = nullptr;  // (x was written there)
      EBB_REQUIRE_OK(ebb_stream_current(devs[0], &cur));
      EBB_REQUIRE_OK(ebb_stream_wait_stream(fwd_stream, cur));
      EBB_REQUIRE_OK(ebb_stream_guard_enter(&fg, fwd_stream));
    }
    if (p) {
      Scope s(*p);
      l = forward();
    } else {
      l = forward();
    }
    if (fwd_stream) EBB_REQUIRE_OK(ebb_stream_guard_exit(&fg));
    const ebb_tensor_t *r[1] = {l.get()};
    for (int b = 0; b < backwards; b++) EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, b + 1 < backwards, nullptr, 0));
    std::vector<const Tensor *> leaves{&x};
    for (const Tensor &t : w) leaves.push_back(&t);
    std::vector<std::vector<double>> g;
    for (const Tensor *t : leaves) {
      Tensor gt;
      EBB_REQUIRE_OK(ebb_tensor_grad(*t, gt.out()));
      REQUIRE(gt.get() != nullptr);
      g.push_back(read(gt));
      EBB_REQUIRE_OK(ebb_tensor_set_grad(*t, nullptr));
    }
    return g;
  }
};

ebb_offload_stats stats() {
  ebb_offload_stats s;
  EBB_REQUIRE_OK(ebb_offload_get_stats(&s));
  return s;
}

size_t pinned_allocated() {
  ebb_arena_stats s;
  EBB_REQUIRE_OK(ebb_pinned_get_stats(&s));
  return s.allocated_bytes.current;
}

}  // namespace

TEST_CASE("offload: gradients bitwise equal to no offload, step after step, on one device", "[autograd][offload]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 6);
    ebb_offload_reset_stats();
    ebb_offload_policy p = every_tensor();
    for (unsigned s = 0; s < 4; s++) {
      INFO("step " << s);
      net.set_input(s);
      auto want = net.step(nullptr);
      net.set_input(s);
      auto got = net.step(&p);
      CHECK(got == want);  // bitwise: the same kernels on the same values
    }
    ebb_offload_stats st = stats();
    // Per step: 6 matmul inputs (the first one is x's view: x is a parameter-like leaf... it
    // requires grad, so it stays), tanh outputs and the mul's two views of one storage.
    CHECK(st.tensors_offloaded > 0);
    CHECK(st.bytes_offloaded == st.tensors_offloaded * kBatch * kWidth * 4);
    CHECK(st.deduplicated >= 4 * 3);  // per step, each of the 3 muls saves a second handle on b
    CHECK(st.kept_params >= 4 * 6);   // the weights
    CHECK(st.bytes_prefetched + st.bytes_reloaded_on_demand > 0);
    CHECK(st.bytes_prefetched > 0);   // the engine reloaded ahead from the first backward on
    CHECK(st.pinned_bytes == 0);      // all freed with the graphs
    CHECK(st.device_bytes_saved == 0);
    CHECK(st.pinned_peak_bytes > 0);
    CHECK(pinned_allocated() == 0);
  }
  live.check();
}

TEST_CASE("offload: retain_graph reloads for each backward, a second user stream, no pinned memory from the driver after step one",
          "[autograd][offload][streams]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 5);
    ebb_offload_policy p = every_tensor();
    ebb_stream_t *user = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &user));
    {
      ebb_stream_guard g;
      EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, user));
      auto check_step = [&](unsigned seed) {
        net.set_input(seed);
        auto want = net.step(nullptr, 3);  // three backward calls summed
        net.set_input(seed);
        CHECK(net.step(&p, 3) == want);
      };
      check_step(1);
      ebb_arena_stats s1;
      EBB_REQUIRE_OK(ebb_pinned_get_stats(&s1));
      for (unsigned s = 2; s < 5; s++) check_step(s);
      ebb_arena_stats s2;
      EBB_REQUIRE_OK(ebb_pinned_get_stats(&s2));
      CHECK(s2.num_device_alloc == s1.num_device_alloc);  // the pinned pool's cache serves later steps
      EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
    }
    // The forward on the user stream, the backward called from the default stream: the first
    // reloads are issued on the caller's stream, which the forward's never waited on.
    for (unsigned s = 5; s < 8; s++) {
      net.set_input(s);
      auto want = net.step(nullptr, 1, user);
      net.set_input(s);
      CHECK(net.step(&p, 1, user) == want);
    }
    EBB_REQUIRE_OK(ebb_stream_release(user));
    CHECK(pinned_allocated() == 0);
  }
  live.check();
}

TEST_CASE("offload: two devices, on the calling thread and on device workers", "[autograd][offload][devices]") {
  EbbSession session;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  if (n < 2) EBB_SKIP("needs two devices");
  Live live;
  ebb_engine_mode mode = ebb_autograd_engine_mode();
  {
    Net net({0, 1}, 6);
    ebb_offload_policy p = every_tensor();
    unsigned seed = 0;
    for (ebb_engine_mode m : {EBB_ENGINE_AUTO, EBB_ENGINE_WORKERS, EBB_ENGINE_CALLING_THREAD}) {
      INFO("engine mode " << (int)m);
      EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(m));
      for (int s = 0; s < 2; s++, seed++) {
        net.set_input(seed);
        auto want = net.step(nullptr);
        net.set_input(seed);
        CHECK(net.step(&p) == want);
      }
    }
  }
  EBB_REQUIRE_OK(ebb_autograd_set_engine_mode(mode));
  CHECK(pinned_allocated() == 0);
  live.check();
}

TEST_CASE("offload: what stays on the device, and why", "[autograd][offload]") {
  EbbSession session;
  Live live;
  {
    ebb_offload_reset_stats();
    Tensor w = make(0, EBB_F32, {kWidth, kWidth}, values(kWidth * kWidth, 3));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    Tensor c = make(EBB_DEVICE_CPU, EBB_F32, {kWidth}, values(kWidth, 4));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(c, true));
    Tensor small = make(0, EBB_F32, {4}, values(4, 5));
    Tensor a, b, e, l;
    {
      ebb_offload_policy p = {};
      p.min_bytes = 1024;
      Scope s(p);
      EBB_REQUIRE_OK(ebb_op_exp(w, a.out()));        // w: a parameter (stays); a: offloaded
      EBB_REQUIRE_OK(ebb_op_mul(small, small, b.out()));  // 16 bytes: small (stays, twice)
      EBB_REQUIRE_OK(ebb_op_exp(c, e.out()));        // CPU: stays (and its output)
    }
    ebb_offload_stats st = stats();
    CHECK(st.kept_params == 0);  // ExpBackward saves its output, not w
    CHECK(st.tensors_offloaded == 1);
    CHECK(st.kept_small == 0);   // b's inputs need no grad: MulBackward was not recorded
    CHECK(st.kept_cpu == 1);
    Tensor m;
    {
      ebb_offload_policy p = {};
      p.min_bytes = 1024;
      Scope s(p);
      EBB_REQUIRE_OK(ebb_op_mul(w, a, m.out()));  // saves w (a parameter: stays) and a (offloaded again: another scope)
    }
    st = stats();
    CHECK(st.kept_params == 1);
    CHECK(st.tensors_offloaded == 2);
    {
      ebb_offload_policy p = {};
      p.min_bytes = 1024;
      p.offload_params = true;
      Scope s(p);
      Tensor m2;
      EBB_REQUIRE_OK(ebb_op_mul(w, w, m2.out()));  // w twice: one copy
      st = stats();
      CHECK(st.tensors_offloaded == 3);
      CHECK(st.deduplicated == 1);
    }
    // Gradients through offloaded tensors still right: d/dw sum(w * exp(w)) = exp(w) (1 + w).
    Tensor l2;
    EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l2.out()));
    const ebb_tensor_t *r[1] = {l2.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
    auto wv = read(w), gv = read(g);
    std::vector<double> want;
    for (double v : wv) want.push_back(std::exp((float)v) * (1 + v));
    EBB_CHECK_CLOSE(gv, want, 1e-5, 1e-5);
  }
  CHECK(pinned_allocated() == 0);
  live.check();
}

TEST_CASE("offload: the pinned budget keeps what it cannot take on the device, counted", "[autograd][offload]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 6);
    auto want = net.step(nullptr);
    ebb_offload_reset_stats();
    ebb_offload_policy p = every_tensor();
    p.pinned_budget_bytes = 3 * kBatch * kWidth * 4;  // three activations
    CHECK(net.step(&p) == want);
    ebb_offload_stats st = stats();
    CHECK(st.tensors_offloaded == 3);
    CHECK(st.kept_pinned_budget > 0);
    CHECK(st.pinned_peak_bytes <= (uint64_t)p.pinned_budget_bytes);
  }
  live.check();
}

TEST_CASE("offload: under a device budget only what must leave leaves, newest kept, and resident bytes stay within it",
          "[autograd][offload]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 8);
    auto want = net.step(nullptr);
    ebb_offload_reset_stats();
    const int64_t act = kBatch * kWidth * 4;
    ebb_offload_policy p = every_tensor();
    p.device_budget_bytes = 4 * act;
    // The device's allocated bytes at the end of the forward: parameters, the kept activations,
    // and one layer's temporaries; without offload, every activation.
    uint64_t away_after_forward = 0;
    auto forward_peak = [&](const ebb_offload_policy *pp) {
      EBB_REQUIRE_OK(ebb_arena_reset_peak(0));
      Tensor l;
      if (pp) {
        Scope s(*pp);
        l = net.forward();
      } else {
        l = net.forward();
      }
      ebb_arena_stats a;
      EBB_REQUIRE_OK(ebb_arena_get_stats(0, &a));
      away_after_forward = stats().device_bytes_saved;
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
      EBB_REQUIRE_OK(ebb_tensor_set_grad(net.x, nullptr));
      for (auto &w : net.w) EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
      return a.allocated_bytes.peak;
    };
    const uint64_t params = (8 * kWidth * kWidth + kBatch * kWidth) * 4;
    const uint64_t peak_none = forward_peak(nullptr);
    ebb_offload_reset_stats();
    const uint64_t peak_budget = forward_peak(&p);
    ebb_offload_stats st = stats();
    // 8 layers save 8 matmul inputs (copies made by ebb_tensor_to_device) and 8 tanh outputs,
    // 4 of them also saved twice by a mul (deduplicated): 16 storages of `act` bytes, all copied
    // out as they are saved, of which the budget keeps the newest 4 on the device.
    CHECK(st.tensors_offloaded == 16);
    CHECK(away_after_forward == 12 * (uint64_t)act);
    CHECK(st.bytes_prefetched == 12 * (uint64_t)act);  // all brought back ahead, within the budget
    CHECK(peak_none >= params + 16 * (uint64_t)act);
    CHECK(peak_budget <= params + (uint64_t)p.device_budget_bytes + 4 * (uint64_t)act);  // + one layer's temporaries
    INFO("forward peak without offload " << peak_none << ", with a budget of 4 activations " << peak_budget);
    // From the second budgeted forward on, ebb knows what a forward saves here: it copies out
    // only the oldest 12 that will have to leave, and two more of slack.
    ebb_offload_reset_stats();
    CHECK(net.step(&p) == want);
    st = stats();
    CHECK(st.tensors_offloaded >= 12);
    CHECK(st.tensors_offloaded <= 14);
    CHECK(st.bytes_prefetched == 12 * (uint64_t)act);
  }
  live.check();
}

TEST_CASE("offload: a backward that fails half-way leaves nothing behind, and the next one works", "[autograd][offload][errors]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 6);
    auto want = net.step(nullptr);
    ebb_offload_policy p = every_tensor();
    Tensor l;
    {
      Scope s(p);
      l = net.forward();
    }
    // A hook on the loss's gradient path that fails: the backward stops after the first node.
    struct Fail {
      static ebb_status hook(const ebb_tensor_t *, ebb_tensor_t **, void *) {
        return ebb_tensor_set_requires_grad(nullptr, true);
      }
    };
    ebb_hook_handle h;
    EBB_REQUIRE_OK(ebb_tensor_register_hook(l, Fail::hook, nullptr, &h));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_CHECK_FAILS(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_EINVAL, "t is NULL");
    l.reset();
    for (const Tensor *t : {&net.x}) EBB_REQUIRE_OK(ebb_tensor_set_grad(*t, nullptr));
    for (auto &t : net.w) EBB_REQUIRE_OK(ebb_tensor_set_grad(t, nullptr));
    CHECK(pinned_allocated() == 0);
    CHECK(stats().device_bytes_saved == 0);
    CHECK(net.step(&p) == want);
  }
  CHECK(pinned_allocated() == 0);
  live.check();
}

TEST_CASE("offload: the reloaded blocks and the pinned copies are the saving node's in the memory history",
          "[autograd][offload][history]") {
  EbbSession session;
  Live live;
  {
    Net net({0}, 4);
    ebb_offload_policy p = every_tensor();
    size_t before = 0;
    EBB_REQUIRE_OK(ebb_alloc_history_get(0, nullptr, 0, &before, nullptr));
    net.step(&p);
    size_t n = 0;
    EBB_REQUIRE_OK(ebb_alloc_history_get(0, nullptr, 0, &n, nullptr));
    std::vector<ebb_alloc_trace_entry> h(n);
    EBB_REQUIRE_OK(ebb_alloc_history_get(0, h.data(), n, &n, nullptr));
    int reload_allocs = 0;
    for (const auto &e : h)
      if (e.action == EBB_ACT_ALLOC && e.owner_cat == EBB_OWNER_SAVED &&
          (std::string(e.owner_name) == "TanhBackward" || std::string(e.owner_name) == "MatmulBackward" ||
           std::string(e.owner_name) == "MulBackward"))
        reload_allocs++;
    CHECK(reload_allocs > 0);
    // While a graph's tensors are offloaded, a snapshot shows their pinned copies in the pinned
    // pool, owned by the saving nodes.
    Tensor l;
    {
      Scope s(p);
      l = net.forward();
    }
    // (in the test's working directory, the build tree; one name per process)
    const std::string path = "offload-snapshot-" + std::to_string(getpid()) + ".json";
    EBB_REQUIRE_OK(ebb_memory_snapshot_json(path.c_str()));
    std::FILE *f = std::fopen(path.c_str(), "r");
    REQUIRE(f != nullptr);
    std::string json;
    char buf[4096];
    for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) json.append(buf, got);
    std::fclose(f);
    std::remove(path.c_str());
    size_t pools = json.find("\"host_pools\"");
    REQUIRE(pools != std::string::npos);
    const std::string host = json.substr(pools);
    CHECK(host.find("\"category\":\"saved\",\"name\":\"TanhBackward\"") != std::string::npos);
  }
  live.check();
}

TEST_CASE("offload: bad policies, saves the policy cannot take, and scopes ended out of order", "[autograd][offload][errors]") {
  EbbSession session;
  Live live;
  EBB_CHECK_FAILS(ebb_offload_scope_enter(nullptr), EBB_EINVAL, "policy is NULL");
  ebb_offload_policy p = {};
  p.version = EBB_OFFLOAD_POLICY_VERSION + 1;
  EBB_CHECK_FAILS(ebb_offload_scope_enter(&p), EBB_ENOTSUP, "policy->version");
  p = {};
  p.pinned_budget_bytes = -1;
  EBB_CHECK_FAILS(ebb_offload_scope_enter(&p), EBB_EINVAL, "policy->pinned_budget_bytes is -1");
  p = {};
  p.device_budget_bytes = -5;
  EBB_CHECK_FAILS(ebb_offload_scope_enter(&p), EBB_EINVAL, "policy->device_budget_bytes is -5");
  p = {};
  p.min_bytes = 4096;
  p.prefetch_window_bytes = 1024;
  EBB_CHECK_FAILS(ebb_offload_scope_enter(&p), EBB_EINVAL, "prefetch_window_bytes is 1024");
  EBB_CHECK_FAILS(ebb_offload_scope_exit(), EBB_ESTATE, "no offload scope open");
  EBB_CHECK_FAILS(ebb_offload_get_stats(nullptr), EBB_EINVAL, "ebb_offload_get_stats: out is NULL");
  // Disabled hooks refuse an offload scope too, with the disable's message.
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_disable("no offload in this region"));
  p = {};
  EBB_CHECK_FAILS(ebb_offload_scope_enter(&p), EBB_ESTATE, "no offload in this region");
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_enable());
  // Scopes and hooks end in reverse order.
  struct Id {
    static ebb_status pack(void *, const ebb_tensor_t *t, void **packed) {
      *packed = const_cast<ebb_tensor_t *>(t);
      return ebb_tensor_retain(const_cast<ebb_tensor_t *>(t));
    }
    static ebb_status unpack(void *, void *packed, ebb_tensor_t **out) {
      *out = static_cast<ebb_tensor_t *>(packed);
      return ebb_tensor_retain(*out);
    }
    static void free_packed(void *, void *packed) { ebb_tensor_release(static_cast<ebb_tensor_t *>(packed)); }
  };
  ebb_saved_hooks hk = {Id::pack, Id::unpack, Id::free_packed, nullptr};
  EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_push(&hk));
  EBB_CHECK_FAILS(ebb_offload_scope_exit(), EBB_ESTATE, "is a pair of saved-tensor hooks, not an offload scope");
  EBB_REQUIRE_OK(ebb_saved_tensors_hooks_pop());
  EBB_CHECK_FAILS(ebb_saved_tensors_hooks_pop(), EBB_ESTATE, "is an offload scope, not a pair of saved-tensor hooks");
  EBB_REQUIRE_OK(ebb_offload_scope_exit());
  {
    // A saved storage larger than the window, or than the device budget.
    Tensor a = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 1));
    EBB_REQUIRE_OK(ebb_tensor_set_name(a, "act"));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(a, true));
    Tensor b, c;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(a, 2.0, b.out()));  // b needs a gradient, is not a leaf
    ebb_offload_policy q = {};
    q.min_bytes = 1;
    q.prefetch_window_bytes = 4096;
    {
      Scope s(q);
      EBB_CHECK_MSG(ebb_op_exp(b, c.out()), EBB_EINVAL, "ExpBackward", "8192 bytes", "prefetch window (4096 bytes)");
    }
    q.prefetch_window_bytes = 0;
    q.device_budget_bytes = 2048;
    {
      Scope s(q);
      EBB_CHECK_MSG(ebb_op_tanh(b, c.out()), EBB_EINVAL, "TanhBackward", "device budget (2048 bytes)");
    }
  }
  live.check();
}

TEST_CASE("offload: an in-place change before the copy was seen done fails the backward with both versions",
          "[autograd][offload][errors]") {
  EbbSession session;
  Live live;
  {
    Tensor w = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 11));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    Tensor a, b, l;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, a.out()));
    EBB_REQUIRE_OK(ebb_tensor_set_name(a, "act"));
    {
      ebb_offload_policy p = every_tensor();
      Scope s(p);
      EBB_REQUIRE_OK(ebb_op_mul(a, w, b.out()));  // saves a (offloaded) and w (a parameter)
    }
    {
      bool was;
      ebb_grad_set_enabled(false, &was);
      EBB_REQUIRE_OK(ebb_op_add_scalar(a, 1.0, l.out()));
      EBB_REQUIRE_OK(ebb_tensor_copy_(a, l));  // the saved tensor changes (version 1)
      ebb_grad_set_enabled(was, nullptr);
    }
    EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, l.out()));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_CHECK_MSG(ebb_backward(r, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "MulBackward", "saved input 0", "'act'",
                  "saved at version 0, now at least 1");
  }
  live.check();
}

TEST_CASE("offload: each dtype and strided views come back exactly as saved, and the device memory is not held",
          "[autograd][offload]") {
  EbbSession session;
  Live live;
  for (ebb_dtype dt : {EBB_F32, EBB_F64, EBB_BF16, EBB_F16}) {
    INFO("dtype " << ebb_dtype_name(dt));
    Tensor w = make(0, dt, {kWidth, kBatch}, values(kWidth * kBatch, 21, -0.5, 0.5));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    // y = sum(exp(w * 1)^T @ exp(w * 1)): MatmulBackward saves two transposed views (strided) of
    // one storage, ExpBackward its output (the same storage); MulScalar saves nothing.
    auto run = [&](const ebb_offload_policy *p, uint64_t *held) {
      Tensor a, e, et, m, l;
      std::vector<Tensor> keep;
      {
        if (p) EBB_REQUIRE_OK(ebb_offload_scope_enter(p));
        EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, a.out()));
        EBB_REQUIRE_OK(ebb_op_exp(a, e.out()));
        EBB_REQUIRE_OK(ebb_tensor_transpose(e, 0, 1, et.out()));
        EBB_REQUIRE_OK(ebb_op_matmul(et, e, m.out()));
        EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
        // Two more saves on the device retire e's copied-out original (a device holds the
        // newest two until the backward reads them).
        for (int i = 0; i < 2; i++) {
          Tensor z = make(0, dt, {kWidth, kBatch}, values(kWidth * kBatch, 30 + i)), zr, ze;
          EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(z, true));
          EBB_REQUIRE_OK(ebb_op_mul_scalar(z, 1.0, zr.out()));
          EBB_REQUIRE_OK(ebb_op_exp(zr, ze.out()));
          keep.push_back(std::move(ze)); // (alive until the measure, in both runs)
        }
        if (p) EBB_REQUIRE_OK(ebb_offload_scope_exit());
      }
      a.reset();
      e.reset();
      et.reset();
      m.reset();
      ebb_arena_stats st;
      EBB_REQUIRE_OK(ebb_arena_get_stats(0, &st));
      *held = st.allocated_bytes.current;
      keep.clear();
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
      Tensor g;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
      auto v = read(g);
      EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
      return v;
    };
    uint64_t held_none = 0, held_off = 0;
    auto want = run(nullptr, &held_none);
    ebb_offload_policy p = every_tensor();
    ebb_offload_reset_stats();
    auto got = run(&p, &held_off);
    CHECK(got == want);
    ebb_offload_stats s = stats();
    CHECK(s.tensors_offloaded == 3);  // e's storage, saved three times, and the two exp outputs after
    CHECK(s.deduplicated == 2);
    // Between forward and backward the device holds w and the loss, not e (nor its views).
    const uint64_t e_bytes = kWidth * kBatch * ebb_dtype_size(dt);
    CHECK(held_off + e_bytes <= held_none);
  }
  live.check();
}

TEST_CASE("offload: an in-place op that is refused leaves the offloaded record as saved", "[autograd][offload][errors]") {
  EbbSession session;
  {
    Tensor w = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 11));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    Tensor b, l, one;
    ebb_offload_policy p = every_tensor();
    p.offload_params = true;
    {
      Scope s(p);
      EBB_REQUIRE_OK(ebb_op_exp(w, b.out()));   // ExpBackward saves its output b (offloaded)
      Tensor c;
      EBB_REQUIRE_OK(ebb_op_mul(w, w, c.out()));  // saves w (a parameter, offloaded)
      b = std::move(c);
    }
    one = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 3));
    // grad mode on: a leaf that requires grad cannot change in place: refused, w unchanged
    CHECK(ebb_op_add_(w, one) == EBB_EINVAL);
    EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, l.out()));
    const ebb_tensor_t *r[1] = {l.get()};
    ebb_status st = ebb_backward(r, nullptr, 1, false, nullptr, 0);
    INFO(ebb_last_error());
    CHECK(st == EBB_OK);
  }
}

TEST_CASE("offload: a scope left open across ebb_shutdown ends without harm", "[autograd][offload][errors]") {
  REQUIRE(ebb_init() == EBB_OK);
  ebb_offload_policy p = {};
  REQUIRE(ebb_offload_scope_enter(&p) == EBB_OK);
  REQUIRE(ebb_shutdown() == EBB_OK);
  ebb_status st = ebb_offload_scope_exit();
  CHECK((st == EBB_OK || st == EBB_ENOTINIT));
}

TEST_CASE("offload: under a device budget a tensor made on a stalled stream is copied out after it, whatever stream saves next", "[autograd][offload][streams]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  {
    const int64_t act = kBatch * kWidth * 4;
    ebb_stream_t *s1 = nullptr, *s2 = nullptr, *def = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s1));
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &s2));
    EBB_REQUIRE_OK(ebb_stream_current(0, &def));
    Tensor w = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 5));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    std::vector<Tensor> zs;
    for (int i = 0; i < 3; i++) {
      zs.push_back(make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 60 + i)));
      EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(zs.back(), true));
    }
    {  // own free blocks on s1 and s2 (held at once, then freed), so no allocation below steals and waits
      std::vector<Tensor> warm[2];
      ebb_stream_t *ws[2] = {s1, s2};
      for (int k = 0; k < 2; k++) {
        ebb_stream_guard g;
        EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, ws[k]));
        warm[k].resize(64);
        for (auto &t : warm[k]) EBB_REQUIRE_OK(ebb_tensor_empty(0, EBB_F32, 2, std::vector<int64_t>{kBatch, kWidth}.data(), t.out()));
        EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
      }
      for (int k = 0; k < 2; k++) {
        warm[k].clear();
        EBB_REQUIRE_OK(ebb_stream_synchronize(ws[k]));
      }
    }
    EBB_REQUIRE_OK(ebb_stream_synchronize(def));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(s1, def));
    Tensor e, l;
    std::vector<Tensor> keep;
    ebb_offload_policy p = every_tensor();
    p.poison = false;
    p.device_budget_bytes = 2 * act;
    {
      ebb_stream_guard g1;
      EBB_REQUIRE_OK(ebb_stream_guard_enter(&g1, s1));
      {
        struct Sleep { static void fn(void *) { struct timespec ts = {0, 300000000}; nanosleep(&ts, nullptr); } };
        // s1 stalls 300 ms behind a host function of device 1 (device 0's host thread stays free)
        ebb_stream_t *s3 = nullptr;
        ebb_event_t *ev = nullptr;
        EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s3));
        EBB_REQUIRE_OK(ebb_event_create(1, EBB_EVENT_DEFAULT, &ev));
        EBB_REQUIRE_OK(ebb_stream_host_func(s3, Sleep::fn, nullptr));
        EBB_REQUIRE_OK(ebb_event_record(ev, s3));
        EBB_REQUIRE_OK(ebb_event_wait(ev, s1));
        EBB_REQUIRE_OK(ebb_event_release(ev));
        EBB_REQUIRE_OK(ebb_stream_release(s3));
      }
      Scope s(p);
      Tensor a;
      EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, a.out()));
      EBB_REQUIRE_OK(ebb_op_exp(a, e.out()));  // ExpBackward saves e, made on s1
      {
        // Independent work on s2 (it reads nothing of s1's): its saves push e out of the budget.
        ebb_stream_guard g2;
        EBB_REQUIRE_OK(ebb_stream_guard_enter(&g2, s2));
        for (int i = 0; i < 3; i++) {
          Tensor &z = zs[i], zr, ze;
          EBB_REQUIRE_OK(ebb_op_mul_scalar(z, 1.0, zr.out()));
          EBB_REQUIRE_OK(ebb_op_exp(zr, ze.out()));
          keep.push_back(std::move(ze));
        }
        EBB_REQUIRE_OK(ebb_stream_guard_exit(&g2));
      }
      EBB_REQUIRE_OK(ebb_op_sum(e, nullptr, 0, false, l.out()));
      EBB_REQUIRE_OK(ebb_stream_guard_exit(&g1));
    }
    EBB_REQUIRE_OK(ebb_stream_wait_stream(def, s1));
    const ebb_tensor_t *r[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    Tensor g;
    EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
    auto gv = read(g), wv = read(w);
    std::vector<double> want;
    for (double v : wv) want.push_back(std::exp((float)v));
    EBB_CHECK_CLOSE(gv, want, 1e-5, 1e-5);
    keep.clear();
    e.reset(); l.reset(); g.reset();
    EBB_REQUIRE_OK(ebb_stream_release(s1));
    EBB_REQUIRE_OK(ebb_stream_release(s2));
  }
}

// Inside an allow-mutation scope an offloaded tensor needs no clone: its pinned copy is the saved
// value, so a write lets its device original go (after the copy) and the backward reloads it.
TEST_CASE("offload: under allow-mutation, an in-place write to an offloaded tensor leaves the backward the saved value",
          "[autograd][offload][allow-mutation]") {
  EbbSession session;
  Live live;
  for (bool budget : {false, true}) {
    INFO("device budget " << budget);
    Tensor w = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, 41, -0.5, 0.5));
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    // l = sum(exp(w) * w): ExpBackward saves e = exp(w); MulBackward saves e and w.
    auto grad = [&](bool write, bool offload) {
      Tensor a, e, m, l, g;
      EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
      ebb_offload_policy p = every_tensor();
      if (budget) p.device_budget_bytes = 4 * kBatch * kWidth * 4;  // e stays on the device: copied at the write
      if (offload) EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
      EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, a.out()));
      EBB_REQUIRE_OK(ebb_op_exp(a, e.out()));
      EBB_REQUIRE_OK(ebb_op_mul(e, w, m.out()));
      EBB_REQUIRE_OK(ebb_op_sum(m, nullptr, 0, false, l.out()));
      if (offload) EBB_REQUIRE_OK(ebb_offload_scope_exit());
      if (write) {
        bool was;
        ebb_grad_set_enabled(false, &was);
        EBB_REQUIRE_OK(ebb_tensor_fill_(e, 7.0));  // the saved e changes on the device
        ebb_grad_set_enabled(was, nullptr);
      }
      const ebb_tensor_t *r[1] = {l.get()};
      EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
      EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_exit());
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
      auto v = read(g);
      EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
      return v;
    };
    auto want = grad(false, false);
    CHECK(grad(true, false) == want);  // allow-mutation's clone, without offload
    CHECK(grad(true, true) == want);   // the pinned copy, with offload
    CHECK(grad(false, true) == want);
  }
  CHECK(pinned_allocated() == 0);
  live.check();
}

// ---- offloaded tensors and allow-mutation scopes together ----------------------------------------

namespace mixed {
constexpr int64_t act = kBatch * kWidth * 4;
ebb_status try_backward(const ebb_tensor_t *l, bool retain = false) {
  const ebb_tensor_t *r[1] = {l};
  return ebb_backward(r, nullptr, 1, retain, nullptr, 0);
}
Tensor leaf(unsigned seed) {
  Tensor t = make(0, EBB_F32, {kBatch, kWidth}, values(kBatch * kWidth, seed, -0.5, 0.5));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}
ebb_status fill_nograd(ebb_tensor_t *t, double v) {
  bool was;
  ebb_grad_set_enabled(false, &was);
  ebb_status st = ebb_tensor_fill_(t, v);
  ebb_grad_set_enabled(was, nullptr);
  return st;
}
ebb_tensor_t *g_target;
ebb_status write_hook(const ebb_tensor_t *, ebb_tensor_t **, void *) { return fill_nograd(g_target, 7.0); }
}  // namespace mixed

TEST_CASE("offload: a save inside an allow-mutation scope survives a write, though the same storage was saved outside it", "[autograd][offload][allow-mutation]") {
  EbbSession session;
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    Tensor w = mixed::leaf(1), c = mixed::leaf(2), d = mixed::leaf(3), x, A, B;
    ebb_offload_policy p = every_tensor();
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
    EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, x.out()));
    EBB_REQUIRE_OK(ebb_op_mul(x, c, A.out()));  // saves x outside the allow-mutation scope
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
    EBB_REQUIRE_OK(ebb_op_mul(x, d, B.out()));  // saves x inside it
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_exit());
    Tensor lB = sum_of(B);
    EBB_REQUIRE_OK(mixed::fill_nograd(x, 7.0));
    ebb_status st = mixed::try_backward(lB);
    INFO(ebb_last_error());
    CHECK(st == EBB_OK);  // B was saved inside the scope: survives the write
    CHECK(ebb_allow_mutation_on_saved_exit() == EBB_OK);
  }
}

TEST_CASE("offload: a save outside an allow-mutation scope fails its version check, though the same storage was saved inside one", "[autograd][offload][allow-mutation]") {
  EbbSession session;
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    Tensor w = mixed::leaf(1), c = mixed::leaf(2), d = mixed::leaf(3), x, A, B;
    ebb_offload_policy p = every_tensor();
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
    EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, x.out()));
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
    EBB_REQUIRE_OK(ebb_op_mul(x, c, A.out()));  // inside
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_exit());
    EBB_REQUIRE_OK(ebb_op_mul(x, d, B.out()));  // outside
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_exit());
    Tensor lB = sum_of(B);
    EBB_REQUIRE_OK(mixed::fill_nograd(x, 7.0));
    ebb_status st = mixed::try_backward(lB);
    CHECK(st == EBB_ESTATE);  // saved outside any allow-mutation scope: the version check
  }
}

TEST_CASE("offload: under allow-mutation a write to a kept tensor that cannot be copied is refused before it changes anything", "[autograd][offload][allow-mutation]") {
  EbbSession session;
  Tensor w = mixed::leaf(5);
  auto chain = [&](int n, std::vector<Tensor> &es) -> const ebb_tensor_t * {
    Tensor h0;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, h0.out()));
    es.push_back(std::move(h0));
    for (int i = 0; i < n; i++) {
      Tensor e;
      EBB_REQUIRE_OK(ebb_op_tanh(es.back(), e.out()));  // TanhBackward saves e
      es.push_back(std::move(e));
    }
    return es.back().get();
  };
  ebb_offload_policy p = every_tensor();
  p.device_budget_bytes = 4 * mixed::act;
  {  // prime: a budgeted forward that saved 2 activations (the next ones copy what would leave then)
    std::vector<Tensor> es;
    EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
    chain(2, es);
    EBB_REQUIRE_OK(ebb_offload_scope_exit());
  }
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    std::vector<Tensor> es;
    ebb_offload_policy q = p;
    q.pinned_budget_bytes = mixed::act;
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_enter(&q));
    ebb_offload_reset_stats();
    const ebb_tensor_t *h = chain(6, es);
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_exit());
    ebb_offload_stats s = stats();
    INFO("offloaded " << s.tensors_offloaded << " kept_pinned_budget " << s.kept_pinned_budget);
    Tensor l = sum_of(h);
    if (offload) EBB_CHECK_MSG(mixed::fill_nograd(es[3], 7.0), EBB_ENOMEM, "ebb_tensor_fill_", "pinned budget");
    else EBB_REQUIRE_OK(mixed::fill_nograd(es[3], 7.0));  // allow-mutation's clone
    ebb_status st = mixed::try_backward(l);
    INFO(ebb_last_error());
    CHECK(st == EBB_OK);
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_exit());
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
  }
}

// A write from a tensor hook during the backward (same thread, before the node reading the
// tensor runs), to a tensor saved inside an allow-mutation scope, whose record the backward holds.
TEST_CASE("offload: under allow-mutation a write during the backward to a tensor the backward holds leaves it the saved value", "[autograd][offload][allow-mutation]") {
  EbbSession session;
  Tensor w = mixed::leaf(9);
  std::vector<double> want;
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    std::vector<Tensor> es;
    ebb_offload_policy p = every_tensor();
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_enter());
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_enter(&p));
    Tensor h0;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 1.0, h0.out()));
    es.push_back(std::move(h0));
    for (int i = 0; i < 8; i++) {
      Tensor e;
      EBB_REQUIRE_OK(ebb_op_tanh(es.back(), e.out()));
      es.push_back(std::move(e));
    }
    const ebb_tensor_t *h = es.back().get();
    if (offload) EBB_REQUIRE_OK(ebb_offload_scope_exit());
    mixed::g_target = es[3].get();
    ebb_hook_handle hh;
    EBB_REQUIRE_OK(ebb_tensor_register_hook(es[7], mixed::write_hook, nullptr, &hh));
    Tensor l = sum_of(h);
    ebb_status st = mixed::try_backward(l);
    INFO(ebb_last_error());
    CHECK(st == EBB_OK);
    EBB_REQUIRE_OK(ebb_allow_mutation_on_saved_exit());
    if (st == EBB_OK) {
      Tensor g;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g.out()));
      if (!offload) want = read(g);
      else CHECK(read(g) == want);
    }
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
  }
}

// Work for threads, without Catch2's macros (not thread-safe): a failed call sets `bad` and ends
// the step. One step of net (forward in the scope of p, when given, from input values `in`,
// backward, gradients read into *g and cleared).
namespace threaded {
#define T_OK(x)                     \
  do {                              \
    if ((x) != EBB_OK) {            \
      bad++;                        \
      return;                       \
    }                               \
  } while (0)

void read_into(const ebb_tensor_t *t, std::vector<double> *out, std::atomic<int> &bad) {
  int64_t n = 0;
  T_OK(ebb_tensor_numel(t, &n));
  std::vector<float> buf((size_t)n);
  T_OK(ebb_tensor_to_host(t, buf.data(), buf.size() * sizeof(float)));
  out->assign(buf.begin(), buf.end());
}

void step(const Net &net, const ebb_offload_policy *p, const std::vector<float> &in, std::vector<std::vector<double>> *g,
          std::atomic<int> &bad) {
  bool was;
  ebb_grad_set_enabled(false, &was);
  ebb_status st = EBB_OK;
  ebb_tensor_t *v = nullptr;
  const int64_t shape[2] = {kBatch, kWidth};
  T_OK(ebb_tensor_from_host(net.devs[0], EBB_F32, 2, shape, in.data(), in.size() * sizeof(float), &v));
  ebb_status cst = ebb_tensor_copy_(net.x, v);
  ebb_tensor_release(v);
  ebb_grad_set_enabled(was, nullptr);
  T_OK(cst);
  if (p) T_OK(ebb_offload_scope_enter(p));
  ebb_tensor_t *h = nullptr;
  T_OK(ebb_tensor_view(net.x, 2, shape, &h));
  for (size_t i = 0; i < net.w.size(); i++) {
    ebb_tensor_t *a = nullptr, *b = nullptr;
    st = ebb_op_matmul(h, net.w[i], &a);
    if (!st) st = ebb_op_tanh(a, &b);
    ebb_tensor_release(h);
    if (a) ebb_tensor_release(a);
    h = b;
    if (st) break;
  }
  ebb_tensor_t *l = nullptr;
  if (!st) st = ebb_op_sum(h, nullptr, 0, false, &l);
  if (h) ebb_tensor_release(h);
  if (p) T_OK(ebb_offload_scope_exit());
  T_OK(st);
  const ebb_tensor_t *r[1] = {l};
  st = ebb_backward(r, nullptr, 1, false, nullptr, 0);
  ebb_tensor_release(l);
  T_OK(st);
  g->clear();
  std::vector<const ebb_tensor_t *> leaves{net.x};
  for (const Tensor &t : net.w) leaves.push_back(t);
  for (const ebb_tensor_t *t : leaves) {
    ebb_tensor_t *gt = nullptr;
    T_OK(ebb_tensor_grad(t, &gt));
    if (!gt) {
      bad++;
      return;
    }
    g->emplace_back();
    read_into(gt, &g->back(), bad);
    ebb_tensor_release(gt);
    T_OK(ebb_tensor_set_grad(const_cast<ebb_tensor_t *>(t), nullptr));
  }
}
#undef T_OK
}  // namespace threaded

// Threads: two threads train their own nets in their own offload scopes on one device at once
// (one global offload state, one pending and one held list per device, shared streams), and two
// threads run retain_graph backwards over one shared offloaded graph at once (two plans holding
// the same records). Gradients as without offload; tsan watches the rest.
TEST_CASE("offload: threads offload and reload at once, on their own graphs and on a shared one", "[autograd][offload][threads]") {
  EbbSession session;
  Live live;
  {
    Net a({0}, 5), b({0}, 5);
    std::vector<std::vector<float>> ins;
    for (unsigned s = 0; s < 6; s++) {
      auto v = values(kBatch * kWidth, 200 + s);
      ins.emplace_back(v.begin(), v.end());
    }
    ebb_offload_policy p = every_tensor();
    std::atomic<int> bad{0};
    // The expected gradients, one thread at a time and without offload.
    std::vector<std::vector<std::vector<double>>> want(6), got(6);
    for (unsigned s = 0; s < 3; s++) {
      threaded::step(a, nullptr, ins[s], &want[s], bad);
      threaded::step(b, nullptr, ins[3 + s], &want[3 + s], bad);
    }
    REQUIRE(bad == 0);
    auto train = [&](const Net &net, unsigned base) {
      for (unsigned s = 0; s < 3; s++) threaded::step(net, &p, ins[base + s], &got[base + s], bad);
    };
    std::thread ta(train, std::cref(a), 0u), tb(train, std::cref(b), 3u);
    ta.join();
    tb.join();
    CHECK(bad == 0);
    CHECK(got == want);

    // One graph, offloaded, two threads' backwards at once (retain_graph), then the last one.
    Net c({0}, 5);
    c.set_input(7);
    auto once = c.step(nullptr);  // one backward's gradients
    c.set_input(7);
    Tensor l;
    {
      Scope s(p);
      l = c.forward();
    }
    const ebb_tensor_t *r[1] = {l.get()};
    std::atomic<int> failed{0};
    auto back = [&]() {
      if (ebb_backward(r, nullptr, 1, true, nullptr, 0) != EBB_OK) failed++;
    };
    std::thread t1(back), t2(back);
    t1.join();
    t2.join();
    CHECK(failed == 0);
    EBB_REQUIRE_OK(ebb_backward(r, nullptr, 1, false, nullptr, 0));
    // Three backwards summed into each .grad: 3x one backward's, within float rounding of the sums.
    std::vector<const Tensor *> leaves{&c.x};
    for (const Tensor &t : c.w) leaves.push_back(&t);
    for (size_t i = 0; i < leaves.size(); i++) {
      Tensor g;
      EBB_REQUIRE_OK(ebb_tensor_grad(*leaves[i], g.out()));
      std::vector<double> want3;
      for (double v : once[i]) want3.push_back(3 * v);
      EBB_CHECK_CLOSE(read(g), want3, 1e-5, 1e-4);
    }
  }
  CHECK(pinned_allocated() == 0);
  live.check();
}
