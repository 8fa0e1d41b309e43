// Messages name the call the user made, never an internal helper or another module's call made
// on the user's behalf: every creation call before ebb_init, and out of memory on a small
// emulated device (EBB_SIM_MEM=256M, set in CMakeLists.txt) in creators and in composite ops,
// whose report also names the tensor that did not fit (shape, dtype, bytes, device).
#include <functional>
#include <string>
#include <vector>

#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Case {
  const char *fn;
  std::function<ebb_status(ebb_tensor_t **)> call;
};

// The creation calls with a given device and shape (from_host gets a buffer of the right size
// only when it is small: the OOM cases skip it).
std::vector<Case> creators(int dev, int ndim, const int64_t *shape, const void *src, size_t bytes) {
  return {
      {"ebb_tensor_empty", [=](ebb_tensor_t **o) { return ebb_tensor_empty(dev, EBB_F32, ndim, shape, o); }},
      {"ebb_tensor_empty_named",
       [=](ebb_tensor_t **o) { return ebb_tensor_empty_named(dev, EBB_F32, ndim, shape, EBB_OWNER_ACTIVATION, "act", o); }},
      {"ebb_tensor_zeros", [=](ebb_tensor_t **o) { return ebb_tensor_zeros(dev, EBB_F32, ndim, shape, o); }},
      {"ebb_tensor_ones", [=](ebb_tensor_t **o) { return ebb_tensor_ones(dev, EBB_F32, ndim, shape, o); }},
      {"ebb_tensor_full", [=](ebb_tensor_t **o) { return ebb_tensor_full(dev, EBB_F32, ndim, shape, 2.0, o); }},
      {"ebb_tensor_arange",
       [=](ebb_tensor_t **o) { return ebb_tensor_arange(dev, EBB_F32, 0, 1, ebb_test::numel_of({shape, shape + ndim}), o); }},
      {"ebb_tensor_rand", [=](ebb_tensor_t **o) { return ebb_tensor_rand(dev, EBB_F32, ndim, shape, 1, 0, o); }},
      {"ebb_tensor_randn", [=](ebb_tensor_t **o) { return ebb_tensor_randn(dev, EBB_F32, ndim, shape, 1, 0, o); }},
      {"ebb_tensor_from_host",
       [=](ebb_tensor_t **o) { return ebb_tensor_from_host(dev, EBB_F32, ndim, shape, src, bytes, o); }},
  };
}

bool starts_with(const std::string &s, const std::string &p) { return s.rfind(p, 0) == 0; }

// Runs a case that must fail with `want`, no tensor out, and a message starting with the call's
// name; returns the message for further checks.
std::string run_failing(const Case &c, ebb_status want) {
  ebb_tensor_t *o = nullptr;
  ebb_clear_error();
  ebb_status st = c.call(&o);
  std::string msg = ebb_last_error();
  INFO(c.fn << " -> " << ebb_status_name(st) << ": " << msg);
  CHECK(st == want);
  CHECK(starts_with(msg, std::string(c.fn) + ": "));
  CHECK(o == nullptr);
  if (o) ebb_tensor_release(o);
  return msg;
}

} // namespace

TEST_CASE("errors: every creation call before ebb_init names itself", "[ops][errors]") {
  REQUIRE_FALSE(ebb_is_initialized());
  int64_t shape[2] = {2, 3};
  float src[6] = {0};
  for (int dev : {EBB_DEVICE_CPU, 0}) {
    for (auto &c : creators(dev, 2, shape, src, sizeof src)) {
      INFO(c.fn << " on " << dev_name(dev));
      run_failing(c, EBB_ENOTINIT);
    }
  }
}

TEST_CASE("errors: out of memory in a creation call names it and the tensor", "[ops][errors][oom]") {
  EbbSession session;
  int64_t shape[2] = {16384, 16384}; // 1 GiB of f32 on a 256 MiB device
  for (auto &c : creators(0, 2, shape, nullptr, 0)) {
    if (std::string(c.fn) == "ebb_tensor_from_host") continue; // (would need a 1 GiB source)
    std::string msg = run_failing(c, EBB_ENOMEM);
    INFO(msg);
    std::string want = std::string(c.fn) + ": out of memory for a " +
                       (std::string(c.fn) == "ebb_tensor_arange" ? "[268435456]" : "[16384, 16384]") + " f32 tensor (1 GiB) on device 0: ";
    CHECK(starts_with(msg, want));
    CHECK(msg.find("ebb_arena_alloc") == std::string::npos);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("errors: out of memory for a CPU tensor names the call and the tensor", "[ops][errors][oom]") {
  EbbSession session;
  int64_t shape[1] = {int64_t(1) << 44}; // 64 TiB of f32: no host mapping holds it
  Case c{"ebb_tensor_empty", [&](ebb_tensor_t **o) { return ebb_tensor_empty(EBB_DEVICE_CPU, EBB_F32, 1, shape, o); }};
  std::string msg = run_failing(c, EBB_ENOMEM);
  INFO(msg);
  CHECK(starts_with(msg, "ebb_tensor_empty: out of memory for a [17592186044416] f32 tensor (64 TiB) on the CPU: "));
  // The allocator's report follows whole: its own call's name is dropped, not a part of it.
  std::string tail = msg.substr(msg.find("on the CPU: ") + 12);
  CHECK(starts_with(tail, "host pool"));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("errors: out of memory inside a composite op names the op the user called", "[ops][errors][oom]") {
  EbbSession session;
  // 160 MiB of f32 on a 256 MiB device: a second tensor of its size does not fit.
  int64_t shape[2] = {10240, 4096};
  Tensor x, g, t;
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 2, shape, x.out()));
  EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, t.out()));
  int64_t gshape[1] = {10240};
  EBB_REQUIRE_OK(ebb_tensor_ones(0, EBB_F32, 1, gshape, g.out()));
  int one = 1;
  std::vector<Case> ops{
      {"ebb_op_add", [&](ebb_tensor_t **o) { return ebb_op_add(x, x, o); }},
      {"ebb_op_exp", [&](ebb_tensor_t **o) { return ebb_op_exp(x, o); }},
      {"ebb_op_softmax", [&](ebb_tensor_t **o) { return ebb_op_softmax(x, 1, o); }},
      {"ebb_op_log_softmax", [&](ebb_tensor_t **o) { return ebb_op_log_softmax(x, 1, o); }},
      {"ebb_op_softmax_backward", [&](ebb_tensor_t **o) { return ebb_op_softmax_backward(x, x, 1, o); }},
      {"ebb_op_mse_loss", [&](ebb_tensor_t **o) { return ebb_op_mse_loss(x, x, o); }},
      {"ebb_op_layer_norm", [&](ebb_tensor_t **o) { return ebb_op_layer_norm(x, 1, nullptr, nullptr, 1e-5, o); }},
      {"ebb_op_linear", [&](ebb_tensor_t **o) { return ebb_op_linear(x, x, nullptr, o); }},  // [10240, 10240]: 400 MiB
      {"ebb_op_sum_backward", [&](ebb_tensor_t **o) { return ebb_op_sum_backward(g, x, &one, 1, false, o); }},
      {"ebb_op_mul_backward", [&](ebb_tensor_t **o) { return ebb_op_mul_backward(x, x, x, o, nullptr); }},
      {"ebb_tensor_clone", [&](ebb_tensor_t **o) { return ebb_tensor_clone(x, o); }},
      {"ebb_tensor_contiguous", [&](ebb_tensor_t **o) { return ebb_tensor_contiguous(t, o); }},
      {"ebb_tensor_reshape", [&](ebb_tensor_t **o) {
         int64_t flat = -1;
         return ebb_tensor_reshape(t, 1, &flat, o);
       }},
  };
  for (auto &c : ops) {
    std::string msg = run_failing(c, EBB_ENOMEM);
    INFO(msg);
    CHECK(msg.find("out of memory for a [") != std::string::npos);
  }
  x.reset(), g.reset(), t.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("errors: ebb_init refuses an EBB_CPU_VEC it does not know and accepts the three sets", "[ops][errors][config]") {
  {
    ScopedEnv env("EBB_CPU_VEC", "sse4");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "EBB_CPU_VEC='sse4' is not valid; expected baseline, avx2 or avx512");
    CHECK_FALSE(ebb_is_initialized());
  }
  for (const char *v : {"baseline", "avx2", "avx512"}) {
    ScopedEnv env("EBB_CPU_VEC", v);
    INFO(v);
    EBB_REQUIRE_OK(ebb_init());
    EBB_REQUIRE_OK(ebb_shutdown());
  }
}
