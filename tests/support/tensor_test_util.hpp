// Helpers for suites that use tensors (tests/ops, tests/autograd): an owning handle, building a
// tensor of any dtype from doubles, reading one back as doubles, and the devices to run on
// (the CPU and every driver device).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "ebb/ops.h"
#include "ebb/tensor.h"
#include "ebb_test_util.hpp"

namespace ebb_test {

// Owns one reference to a tensor; releases it at scope exit.
struct Tensor {
  ebb_tensor_t *t = nullptr;
  Tensor() = default;
  explicit Tensor(ebb_tensor_t *p) : t(p) {}
  Tensor(const Tensor &) = delete;
  Tensor &operator=(const Tensor &) = delete;
  Tensor(Tensor &&o) noexcept : t(o.t) { o.t = nullptr; }
  Tensor &operator=(Tensor &&o) noexcept {
    reset();
    t = o.t;
    o.t = nullptr;
    return *this;
  }
  ~Tensor() { reset(); }
  void reset() {
    if (t) ebb_tensor_release(t);
    t = nullptr;
  }
  ebb_tensor_t **out() {
    reset();
    return &t;
  }
  operator ebb_tensor_t *() const { return t; }
  ebb_tensor_t *get() const { return t; }
};

// One value of `dt` from a double (the library's own conversions for bf16 and f16).
inline void put_value(unsigned char *p, ebb_dtype dt, double v) {
  switch (dt) {
  case EBB_F32: { float f = (float)v; std::memcpy(p, &f, 4); break; }
  case EBB_F64: std::memcpy(p, &v, 8); break;
  case EBB_BF16: { uint16_t h = ebb_f32_to_bf16((float)v); std::memcpy(p, &h, 2); break; }
  case EBB_F16: { uint16_t h = ebb_f32_to_f16((float)v); std::memcpy(p, &h, 2); break; }
  case EBB_I64: { int64_t i = (int64_t)v; std::memcpy(p, &i, 8); break; }
  default: *p = v != 0; break;
  }
}

inline double get_value(const unsigned char *p, ebb_dtype dt) {
  switch (dt) {
  case EBB_F32: { float f; std::memcpy(&f, p, 4); return f; }
  case EBB_F64: { double d; std::memcpy(&d, p, 8); return d; }
  case EBB_BF16: { uint16_t h; std::memcpy(&h, p, 2); return ebb_bf16_to_f32(h); }
  case EBB_F16: { uint16_t h; std::memcpy(&h, p, 2); return ebb_f16_to_f32(h); }
  case EBB_I64: { int64_t i; std::memcpy(&i, p, 8); return (double)i; }
  default: return *p ? 1.0 : 0.0;
  }
}

inline int64_t numel_of(const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

// A tensor on `device` holding `values` (row-major) converted to dt.
inline Tensor make(int device, ebb_dtype dt, const std::vector<int64_t> &shape, const std::vector<double> &values) {
  REQUIRE((int64_t)values.size() == numel_of(shape));
  size_t es = ebb_dtype_size(dt);
  std::vector<unsigned char> buf(values.size() * es + 1);
  for (size_t i = 0; i < values.size(); i++) put_value(buf.data() + i * es, dt, values[i]);
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_from_host(device, dt, (int)shape.size(), shape.data(), buf.data(), values.size() * es, r.out()));
  return r;
}

// Deterministic values in [lo, hi): a small LCG, so tests do not depend on the library's RNG.
inline std::vector<double> values(int64_t n, unsigned seed, double lo = -1.0, double hi = 1.0) {
  std::vector<double> v((size_t)n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto &x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = lo + (hi - lo) * (double)(s >> 11) * 0x1p-53;
  }
  return v;
}

// The elements of t (row-major) as doubles, read back synchronously.
inline std::vector<double> read(const ebb_tensor_t *t) {
  ebb_tensor_info info;
  EBB_REQUIRE_OK(ebb_tensor_get_info(t, &info));
  size_t es = ebb_dtype_size(info.dtype);
  std::vector<unsigned char> buf((size_t)info.numel * es + 1);
  EBB_REQUIRE_OK(ebb_tensor_to_host(t, buf.data(), (size_t)info.numel * es));
  std::vector<double> v((size_t)info.numel);
  for (size_t i = 0; i < v.size(); i++) v[i] = get_value(buf.data() + i * es, info.dtype);
  return v;
}

inline std::vector<int64_t> shape_of(const ebb_tensor_t *t) {
  int nd = 0;
  int64_t s[EBB_TENSOR_MAX_DIMS];
  EBB_REQUIRE_OK(ebb_tensor_shape(t, &nd, s));
  return std::vector<int64_t>(s, s + nd);
}

inline ebb_dtype dtype_of(const ebb_tensor_t *t) {
  ebb_dtype dt;
  EBB_REQUIRE_OK(ebb_tensor_dtype(t, &dt));
  return dt;
}

// The CPU and every driver device.
inline std::vector<int> devices() {
  std::vector<int> d{EBB_DEVICE_CPU};
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  for (int i = 0; i < n; i++) d.push_back(i);
  return d;
}

inline std::string dev_name(int d) { return d == EBB_DEVICE_CPU ? std::string("cpu") : "device " + std::to_string(d); }

// Index of the first element where |got - want| > atol + rtol |want| (NaNs must match), or -1.
inline long mismatch(const std::vector<double> &got, const std::vector<double> &want, double atol, double rtol) {
  if (got.size() != want.size()) return 0;
  for (size_t i = 0; i < got.size(); i++) {
    if (std::isnan(want[i]) || std::isnan(got[i])) {
      if (std::isnan(want[i]) != std::isnan(got[i])) return (long)i;
      continue;
    }
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return (long)i;
      continue;
    }
    if (std::fabs(got[i] - want[i]) > atol + rtol * std::fabs(want[i])) return (long)i;
  }
  return -1;
}

#define EBB_CHECK_CLOSE(got, want, atol, rtol)                                                         \
  do {                                                                                                 \
    auto g_ = (got);                                                                                   \
    auto w_ = (want);                                                                                  \
    long at_ = ebb_test::mismatch(g_, w_, (atol), (rtol));                                             \
    INFO("sizes " << g_.size() << " vs " << w_.size() << "; first mismatch at " << at_ << ": got "    \
                  << (at_ >= 0 && (size_t)at_ < g_.size() ? g_[at_] : NAN) << " want "                  \
                  << (at_ >= 0 && (size_t)at_ < w_.size() ? w_[at_] : NAN));                            \
    CHECK(at_ == -1);                                                                                  \
  } while (0)

// Row-major strides of a shape, and the broadcast index of an output element in an input.
inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t> &shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    s[i] = acc;
    acc *= shape[i];
  }
  return s;
}

inline int64_t broadcast_index(int64_t lin, const std::vector<int64_t> &out, const std::vector<int64_t> &in) {
  auto os = contiguous_strides(out), is = contiguous_strides(in);
  int64_t idx = 0;
  size_t off = out.size() - in.size();
  for (size_t d = 0; d < out.size(); d++) {
    int64_t c = (lin / os[d]) % out[d];
    if (d >= off && in[d - off] != 1) idx += c * is[d - off];
  }
  return idx;
}

inline std::vector<int64_t> broadcast_shape(const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
  size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> r(n);
  for (size_t i = 0; i < n; i++) {
    int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    r[i] = x == 1 ? y : x;
  }
  return r;
}

// ---- a released tensor at each position of a call -------------------------------------------------

using TensorArgs = std::vector<const ebb_tensor_t *>;

// A call with its tensor arguments: `call` runs it with args (one per tensor position, arrays
// flattened) and undoes what a success made (releases results, removes hooks).
struct ReleasedCase {
  const char *fn;
  TensorArgs args;
  std::function<ebb_status(const TensorArgs &)> call;
};

// A tensor released just now (a fresh one for each use, so the stale handle is never a record
// reused since).
inline const ebb_tensor_t *released_tensor() {
  ebb_tensor_t *t = nullptr;
  int64_t shape[2] = {2, 3};
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 2, shape, &t));
  EBB_REQUIRE_OK(ebb_tensor_release(t));
  return t;
}

// Runs c with all-live arguments (it must succeed), then with a released tensor at each
// position: EBB_EFREED with a message that starts with the call's name.
inline void check_released_case(const ReleasedCase &c) {
  INFO(c.fn);
  {
    ebb_status st = c.call(c.args);
    INFO("with live tensors -> " << ebb_status_name(st) << ": " << ebb_last_error());
    REQUIRE(st == EBB_OK);
  }
  for (size_t k = 0; k < c.args.size(); k++) {
    TensorArgs a = c.args;
    a[k] = released_tensor();
    INFO("a released tensor at tensor position " << k);
    EBB_CHECK_FAILS(c.call(a), EBB_EFREED, std::string(c.fn) + ": ");
    CHECK(std::string(ebb_last_error()).rfind(std::string(c.fn) + ": ", 0) == 0);
  }
}

} // namespace ebb_test
