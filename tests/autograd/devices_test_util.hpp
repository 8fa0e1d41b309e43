// Helpers of the engine tests that run across devices and streams under the emulated driver's
// timing model (test_autograd_devices): streams the test owns, a stream made current for a
// scope, a backlog of kernels, the engine's settings restored at scope exit, warnings collected
// from any thread, and small tensor and graph helpers.
//
// Each test file that includes this runs with EBB_SIM_LAUNCH_US set (tests/autograd/CMakeLists.txt).
#pragma once

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_cuda.h"
#include "sanitizers.hpp"
#include "tensor_test_util.hpp"

namespace ebb_test {

// Kernels queued on a stream before the work a test checks: under the timing model that work
// runs this many kernel durations later (2 ms each). More under a sanitizer, whose slower host
// side must still issue the work checked before the backlog drains.
constexpr int kBacklog = kSanitized ? 64 : 24;

using Stats = ebb_autograd_engine_stats;

inline Stats stats() {
  Stats s;
  EBB_REQUIRE_OK(ebb_autograd_get_engine_stats(&s));
  return s;
}

inline uint64_t sid(const ebb_stream_t *s) {
  uint64_t id = 0;
  EBB_REQUIRE_OK(ebb_stream_id(s, &id));
  return id;
}

inline ebb_stream_t *current(int dev) {
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_current(dev, &s));
  return s;
}

// A stream the test owns.
struct Stream {
  ebb_stream_t *s = nullptr;
  explicit Stream(int dev, ebb_stream_prio prio = EBB_PRIO_LOW) { EBB_REQUIRE_OK(ebb_stream_create(dev, prio, &s)); }
  Stream(const Stream &) = delete;
  Stream &operator=(const Stream &) = delete;
  ~Stream() {
    if (s) ebb_stream_release(s);
  }
  operator ebb_stream_t *() const { return s; }
  uint64_t id() const { return sid(s); }
};

// `s` current on its device (and that device current) for the scope.
struct OnStream {
  ebb_stream_guard g{};
  explicit OnStream(ebb_stream_t *s) { EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, s)); }
  OnStream(const OnStream &) = delete;
  OnStream &operator=(const OnStream &) = delete;
  ~OnStream() { ebb_stream_guard_exit(&g); }
};

// Keeps `s` busy for n kernels: work issued to it afterwards runs n kernel durations later.
inline void busy(ebb_stream_t *s, int n) {
  const ebb_kernel_t *k = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_find("ebb.noop", &k));
  ebb_noop_args a{0};
  for (int i = 0; i < n; i++) EBB_REQUIRE_OK(ebb_stream_launch(s, k, &a, nullptr));
}

// The engine's process-wide settings, restored at scope exit.
struct EngineSettings {
  ebb_engine_mode mode;
  int depth;
  bool warn, follow;
  EngineSettings()
      : mode(ebb_autograd_engine_mode()), depth(ebb_autograd_max_reentrant_depth()),
        warn(ebb_autograd_warn_on_accumulate_grad_stream_mismatch()), follow(ebb_autograd_accumulate_grad_follows_producer()) {}
  ~EngineSettings() {
    ebb_autograd_set_engine_mode(mode);
    ebb_autograd_set_max_reentrant_depth(depth);
    ebb_autograd_set_warn_on_accumulate_grad_stream_mismatch(warn);
    ebb_autograd_set_accumulate_grad_follows_producer(follow);
  }
};

// Whether `n` appears in s as a whole number (not inside a longer one).
inline bool has_number(const std::string &s, uint64_t n) {
  std::string d = std::to_string(n);
  for (size_t p = s.find(d); p != std::string::npos; p = s.find(d, p + 1)) {
    bool before = p > 0 && std::isdigit((unsigned char)s[p - 1]);
    bool after = p + d.size() < s.size() && std::isdigit((unsigned char)s[p + d.size()]);
    if (!before && !after) return true;
  }
  return false;
}

inline std::string lower(std::string s) {
  for (auto &c : s) c = (char)std::tolower((unsigned char)c);
  return s;
}

// ---- tensors ------------------------------------------------------------------------------------

inline Tensor leaf(int dev, const std::vector<double> &v, const char *name = nullptr) {
  Tensor t = make(dev, EBB_F64, {(int64_t)v.size()}, v);
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  return t;
}

inline Tensor scale(const ebb_tensor_t *a, double k) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(a, k, r.out()));
  return r;
}

inline Tensor mul(const ebb_tensor_t *a, const ebb_tensor_t *b) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_op_mul(a, b, r.out()));
  return r;
}

inline Tensor sum(const ebb_tensor_t *a) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, r.out()));
  return r;
}

inline Tensor to_dev(const ebb_tensor_t *a, int dev) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_to_device(a, dev, r.out()));
  return r;
}

inline Tensor full(int dev, int64_t n, double v) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_F64, 1, &n, v, r.out()));
  return r;
}

inline ebb_status backward(std::vector<const ebb_tensor_t *> roots, std::vector<const ebb_tensor_t *> grads = {},
                    bool retain = false) {
  return ebb_backward(roots.data(), grads.empty() ? nullptr : grads.data(), (int)roots.size(), retain, nullptr, 0);
}

inline const ebb_node_t *grad_fn(const ebb_tensor_t *t) {
  const ebb_node_t *n = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad_fn(t, &n, nullptr));
  REQUIRE(n != nullptr);
  return n;
}

inline const ebb_node_t *next_of(const ebb_node_t *n, int i) {
  const ebb_node_t *x = nullptr;
  int nr = 0;
  EBB_REQUIRE_OK(ebb_node_next(n, i, &x, &nr));
  REQUIRE(x != nullptr);
  return x;
}

inline uint64_t node_stream(const ebb_node_t *n) {
  ebb_node_input_info info;
  EBB_REQUIRE_OK(ebb_node_input_meta(n, 0, &info));
  return info.stream_id;
}

// t's .grad as work issued next on the calling thread's current stream of its device sees it:
// read by an op on that stream, then copied to the host. Empty when t has no .grad.
inline std::vector<double> grad_seen(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  if (!g.get()) return {};
  Tensor r = scale(g, 1.0);
  return read(r);
}

inline bool same(const std::vector<double> &got, const std::vector<double> &want) { return mismatch(got, want, 1e-9, 1e-12) == -1; }

inline std::vector<double> times(const std::vector<double> &a, double k) {
  std::vector<double> r(a);
  for (auto &x : r) x *= k;
  return r;
}

// Leaf values for try t: different every try, so memory left by an earlier try never holds
// this try's answer.
inline std::vector<double> vals(int t, int n = 8) {
  std::vector<double> v((size_t)n);
  for (int i = 0; i < n; i++) v[(size_t)i] = (double)((i % 5) - 2 + (i == 2)) * 0.5 + (double)(t + 1) * 1.25;
  return v;
}

inline void sync_all() {
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  for (int d = 0; d < n; d++) EBB_REQUIRE_OK(ebb_dev_synchronize(d));
}

// The emulated driver with two devices and its timing model on: what the stream tests need.
inline bool timed_two_devices(std::string *why) {
  // The driver first: a real one (which may have a single device) skips before the count does.
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.emulated) {
    *why = "not the emulated driver: the timing model that makes a missing wait visible is the emulator's";
    return false;
  }
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  REQUIRE(n >= 2);  // the presets and CMakeLists.txt set EBB_SIM_DEVICES=2
  const char *us = std::getenv("EBB_SIM_LAUNCH_US");
  INFO("EBB_SIM_LAUNCH_US must be set (>= 1000) for this executable: tests/autograd/CMakeLists.txt does");
  REQUIRE(us != nullptr);
  REQUIRE(std::atof(us) >= 1000);
  return true;
}

#define EBB_NEED_TIMED_DEVICES()            \
  do {                                      \
    std::string why_;                       \
    if (!timed_two_devices(&why_)) EBB_SKIP(why_); \
  } while (0)

// For the scope, when `on`: the emulated driver skips every wait of stream `waiter` for an event
// recorded on stream `producer` (ebbsim_skip_waits, ebb_cuda.h), so a test shows that a hand-off
// the engine makes between them is needed. Found in the driver ebb loaded (the emulated one:
// EBB_NEED_TIMED_DEVICES). `skipped` counts the waits skipped, for the caller to check that the
// wait it means to remove was made at all.
struct SkipWaits {
  ebbsim_skip_waits_fn fn = nullptr;
  unsigned long long *skipped;
  SkipWaits(bool on, ebb_stream_t *waiter, ebb_stream_t *producer, unsigned long long *skipped_out) : skipped(skipped_out) {
    if (!on) return;
    ebb_driver_info info;
    EBB_REQUIRE_OK(ebb_driver_get_info(&info));
    void *dl = dlopen(info.path, RTLD_NOW | RTLD_NOLOAD);  // ebb's own handle stays: this one only counts up
    REQUIRE(dl != nullptr);
    // POSIX guarantees that dlsym's object pointer converts to a function pointer.
    fn = reinterpret_cast<ebbsim_skip_waits_fn>(dlsym(dl, EBBSIM_SKIP_WAITS_SYMBOL));
    dlclose(dl);
    REQUIRE(fn != nullptr);
    CUstream w = nullptr, p = nullptr;
    EBB_REQUIRE_OK(ebb_stream_cu(waiter, &w));
    EBB_REQUIRE_OK(ebb_stream_cu(producer, &p));
    REQUIRE(fn(w, p, 1, nullptr) == CUDA_SUCCESS);
  }
  SkipWaits(const SkipWaits &) = delete;
  SkipWaits &operator=(const SkipWaits &) = delete;
  ~SkipWaits() {
    unsigned long long n = 0;
    if (fn && fn(nullptr, nullptr, 0, &n) == CUDA_SUCCESS && skipped) *skipped += n;
  }
};

}  // namespace ebb_test
