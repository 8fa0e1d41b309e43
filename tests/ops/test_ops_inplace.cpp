// The in-place updates of ops.h (add_scaled_, add_scalar_, mul_scalar_, lerp_, addcmul_,
// addcdiv_, sqrt_, zero_): values against the same formula composed from out-of-place ops in
// f64, on the CPU and every emulated device, in f32, f64, bf16 and f16 (and i64 where the op
// takes integers), with broadcasting, strided dst and srcs that overlap dst; the version moves
// once and the storage stays; bad input refused with dst unchanged.
#include <atomic>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "ebb/stream.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

const ebb_dtype kFloats[] = {EBB_F32, EBB_F64, EBB_BF16, EBB_F16};

// One rounding to dt of an f64 result, relative (plus a little absolute room near 0).
double tol_of(ebb_dtype dt) {
  switch (dt) {
  case EBB_BF16: return 1.0 / 128;
  case EBB_F16: return 1.0 / 1024;
  case EBB_F32: return 1e-6;
  default: return 1e-13;
  }
}

Tensor as_f64(const ebb_tensor_t *t) {
  Tensor r;
  EBB_REQUIRE_OK(ebb_tensor_to_dtype(t, EBB_F64, r.out()));
  return r;
}

uint64_t version_of(const ebb_tensor_t *t) {
  uint64_t v = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(t, &v));
  return v;
}

void *data_of(const ebb_tensor_t *t) {
  void *p = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_data(t, &p));
  return p;
}

void hold_fn(void *u) {
  auto *open = static_cast<std::atomic<int> *>(u);
  while (!open->load(std::memory_order_acquire)) {
  }
}

// An op under test: the in-place call on dst with srcs, and its reference from out-of-place ops
// on f64 copies (d: dst's old value, s: the srcs), a new tensor in *out.
struct OpCase {
  const char *name;
  std::vector<std::vector<int64_t>> src_shapes;
  double lo, hi;  // the values of dst and the srcs
  std::function<ebb_status(ebb_tensor_t *, const std::vector<Tensor> &)> apply;
  std::function<ebb_status(const ebb_tensor_t *, const std::vector<Tensor> &, ebb_tensor_t **)> ref;
};

std::vector<OpCase> op_cases() {
  return {
      {"add_scaled_", {{3}}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &s) { return ebb_op_add_scaled_(d, s[0], -0.75); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &s, ebb_tensor_t **o) {
         Tensor t;
         ebb_status st = ebb_op_mul_scalar(s[0], -0.75, t.out());
         return st ? st : ebb_op_add(d, t, o);
       }},
      {"add_scalar_", {}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &) { return ebb_op_add_scalar_(d, 1.5); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &, ebb_tensor_t **o) { return ebb_op_add_scalar(d, 1.5, o); }},
      {"mul_scalar_", {}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &) { return ebb_op_mul_scalar_(d, -3.0); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &, ebb_tensor_t **o) { return ebb_op_mul_scalar(d, -3.0, o); }},
      {"lerp_", {{2, 1, 3}}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &s) { return ebb_op_lerp_(d, s[0], 0.25); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &s, ebb_tensor_t **o) {
         Tensor diff, t;
         ebb_status st = ebb_op_sub(s[0], d, diff.out());
         if (!st) st = ebb_op_mul_scalar(diff, 0.25, t.out());
         return st ? st : ebb_op_add(d, t, o);
       }},
      {"lerp_ (weight above 1/2)", {{3}}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &s) { return ebb_op_lerp_(d, s[0], 0.9); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &s, ebb_tensor_t **o) {
         Tensor diff, t;
         ebb_status st = ebb_op_sub(s[0], d, diff.out());
         if (!st) st = ebb_op_mul_scalar(diff, 0.9, t.out());
         return st ? st : ebb_op_add(d, t, o);
       }},
      {"addcmul_", {{4, 3}, {1, 3}}, -1, 1,
       [](ebb_tensor_t *d, const std::vector<Tensor> &s) { return ebb_op_addcmul_(d, s[0], s[1], 0.5); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &s, ebb_tensor_t **o) {
         Tensor p, t;
         ebb_status st = ebb_op_mul(s[0], s[1], p.out());
         if (!st) st = ebb_op_mul_scalar(p, 0.5, t.out());
         return st ? st : ebb_op_add(d, t, o);
       }},
      {"addcdiv_", {{3}, {4, 3}}, 0.5, 2,
       [](ebb_tensor_t *d, const std::vector<Tensor> &s) { return ebb_op_addcdiv_(d, s[0], s[1], -0.25); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &s, ebb_tensor_t **o) {
         Tensor p, t;
         ebb_status st = ebb_op_div(s[0], s[1], p.out());
         if (!st) st = ebb_op_mul_scalar(p, -0.25, t.out());
         return st ? st : ebb_op_add(d, t, o);
       }},
      {"sqrt_", {}, 0.1, 4, [](ebb_tensor_t *d, const std::vector<Tensor> &) { return ebb_op_sqrt_(d); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &, ebb_tensor_t **o) { return ebb_op_sqrt(d, o); }},
      {"zero_", {}, -1, 1, [](ebb_tensor_t *d, const std::vector<Tensor> &) { return ebb_op_zero_(d); },
       [](const ebb_tensor_t *d, const std::vector<Tensor> &, ebb_tensor_t **o) { return ebb_op_mul_scalar(d, 0.0, o); }},
  };
}

// Runs c on dst (of dst's dtype, its srcs of the same dtype) and checks dst against the
// reference, the version and the storage.
void check_case(const OpCase &c, int dev, ebb_dtype dt, ebb_tensor_t *dst, unsigned seed) {
  INFO(c.name << " on " << dev_name(dev) << " in " << ebb_dtype_name(dt));
  std::vector<Tensor> srcs, srcs64;
  for (size_t i = 0; i < c.src_shapes.size(); i++) {
    srcs.push_back(make(dev, dt, c.src_shapes[i], values(numel_of(c.src_shapes[i]), seed + 10 + (unsigned)i, c.lo, c.hi)));
    srcs64.push_back(as_f64(srcs.back()));
  }
  Tensor old64 = as_f64(dst), want;
  EBB_REQUIRE_OK(c.ref(old64, srcs64, want.out()));
  const uint64_t v0 = version_of(dst);
  void *p0 = data_of(dst);
  EBB_REQUIRE_OK(c.apply(dst, srcs));
  CHECK(version_of(dst) == v0 + 1);
  CHECK(data_of(dst) == p0);
  CHECK(dtype_of(dst) == dt);
  EBB_CHECK_CLOSE(read(dst), read(want), tol_of(dt), tol_of(dt));
}

}  // namespace

TEST_CASE("inplace ops: values match the out-of-place formula in f64, on every device and floating dtype",
          "[ops][inplace][values]") {
  EbbSession session;
  const std::vector<int64_t> shape = {2, 4, 3};
  for (int dev : devices())
    for (ebb_dtype dt : kFloats)
      for (const OpCase &c : op_cases()) {
        Tensor dst = make(dev, dt, shape, values(numel_of(shape), 1, c.lo, c.hi));
        check_case(c, dev, dt, dst, 2);
      }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace ops: a strided dst (a transposed view) is updated where it lies, its base seeing the change",
          "[ops][inplace][values]") {
  EbbSession session;
  for (int dev : devices())
    for (const OpCase &c : op_cases()) {
      // base [3, 4]; dst = its transpose [4, 3]: the srcs broadcast to [4, 3]
      std::vector<OpCase> one = {c};
      for (auto &s : one[0].src_shapes)
        if (s.size() > 2) s = {s.back()};  // lerp_'s [2, 1, 3] does not fit a 2-D dst
      Tensor base = make(dev, EBB_F64, {3, 4}, values(12, 3, c.lo, c.hi)), dst;
      EBB_REQUIRE_OK(ebb_tensor_transpose(base, 0, 1, dst.out()));
      check_case(one[0], dev, EBB_F64, dst, 4);
      Tensor back;
      EBB_REQUIRE_OK(ebb_tensor_transpose(dst, 0, 1, back.out()));
      CHECK(read(back) == read(base));  // the same elements, seen through the base
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace ops: add_scaled_, add_scalar_ and mul_scalar_ stay exact on i64 with integer scalars", "[ops][inplace][values]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor d = make(dev, EBB_I64, {4}, {1, -2, 3, 1 << 20});
    Tensor s = make(dev, EBB_I64, {4}, {10, 20, 30, 40});
    EBB_REQUIRE_OK(ebb_op_add_scaled_(d, s, -3));
    CHECK(read(d) == std::vector<double>{-29, -62, -87, (1 << 20) - 120});
    EBB_REQUIRE_OK(ebb_op_add_scalar_(d, 5));
    EBB_REQUIRE_OK(ebb_op_mul_scalar_(d, -2));
    CHECK(read(d) == std::vector<double>{48, 114, 164, -2.0 * ((1 << 20) - 115)});
    // bool src into i64 dst promotes to i64: allowed (true is 1)
    Tensor b = make(dev, EBB_BOOL, {4}, {1, 0, 1, 0});
    EBB_REQUIRE_OK(ebb_op_add_scaled_(d, b, 2));
    CHECK(read(d)[0] == 50);
    // zero_ takes any dtype
    EBB_REQUIRE_OK(ebb_op_zero_(d));
    EBB_REQUIRE_OK(ebb_op_zero_(b));
    CHECK(read(d) == std::vector<double>(4, 0.0));
    CHECK(read(b) == std::vector<double>(4, 0.0));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace ops: a src on dst's storage is read as it was before the op", "[ops][inplace][overlap]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    // x.add_scaled_(x, 2) reads each element before writing it: 3x.
    Tensor x = make(dev, EBB_F64, {2, 3}, {1, 2, 3, 4, 5, 6});
    EBB_REQUIRE_OK(ebb_op_add_scaled_(x, x, 2.0));
    CHECK(read(x) == std::vector<double>{3, 6, 9, 12, 15, 18});
    // Row 0 of x broadcast over x: every row gets row 0's old values, including row 0 itself.
    Tensor y = make(dev, EBB_F64, {2, 3}, {1, 2, 3, 4, 5, 6}), row;
    EBB_REQUIRE_OK(ebb_tensor_select(y, 0, 0, row.out()));
    EBB_REQUIRE_OK(ebb_op_addcmul_(y, row, row, 1.0));
    CHECK(read(y) == std::vector<double>{2, 6, 12, 5, 9, 15});
    // lerp_ towards its own transpose (a square matrix): the old values on both sides.
    Tensor z = make(dev, EBB_F64, {2, 2}, {1, 2, 3, 4}), zt;
    EBB_REQUIRE_OK(ebb_tensor_transpose(z, 0, 1, zt.out()));
    EBB_REQUIRE_OK(ebb_op_lerp_(z, zt, 0.5));
    CHECK(read(z) == std::vector<double>{1, 2.5, 2.5, 4});
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("inplace ops: bad input is refused with a message naming the call and the tensors, and dst is unchanged",
          "[ops][inplace][errors]") {
  EbbSession session;
  {  // (the tensors go before the liveness check)
    Tensor d = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, values(6, 5));
    const auto before = read(d);
    Tensor s = make(EBB_DEVICE_CPU, EBB_F32, {3}, values(3, 6));
    // NULL
    EBB_CHECK_FAILS(ebb_op_add_scaled_(nullptr, s, 1.0), EBB_EINVAL, "ebb_op_add_scaled_: dst is NULL");
    EBB_CHECK_FAILS(ebb_op_add_scaled_(d, nullptr, 1.0), EBB_EINVAL, "ebb_op_add_scaled_: src is NULL");
    EBB_CHECK_FAILS(ebb_op_lerp_(d, nullptr, 0.5), EBB_EINVAL, "ebb_op_lerp_: end is NULL");
    EBB_CHECK_FAILS(ebb_op_addcmul_(d, s, nullptr, 1.0), EBB_EINVAL, "ebb_op_addcmul_: t2 is NULL");
    EBB_CHECK_FAILS(ebb_op_addcdiv_(d, nullptr, s, 1.0), EBB_EINVAL, "ebb_op_addcdiv_: t1 is NULL");
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(nullptr, 2.0), EBB_EINVAL, "ebb_op_mul_scalar_: dst is NULL");
    EBB_CHECK_FAILS(ebb_op_add_scalar_(nullptr, 2.0), EBB_EINVAL, "ebb_op_add_scalar_: dst is NULL");
    EBB_CHECK_FAILS(ebb_op_sqrt_(nullptr), EBB_EINVAL, "ebb_op_sqrt_: dst is NULL");
    EBB_CHECK_FAILS(ebb_op_zero_(nullptr), EBB_EINVAL, "ebb_op_zero_: dst is NULL");
    // A shape that would change dst's: the message names both tensors and dst's shape.
    Tensor wide = make(EBB_DEVICE_CPU, EBB_F32, {4, 2, 3}, values(24, 7));
    EBB_CHECK_FAILS(ebb_op_add_scaled_(d, wide, 1.0), EBB_EINVAL,
                    "ebb_op_add_scaled_: src (f32[4, 2, 3] on the CPU) does not broadcast to the shape of dst (f32[2, 3] on the CPU), "
                    "and an in-place op cannot change dst's shape; expected src of a shape that broadcasts to [2, 3]");
    Tensor s4 = make(EBB_DEVICE_CPU, EBB_F32, {4}, values(4, 8));
    EBB_CHECK_FAILS(ebb_op_addcmul_(d, s, s4, 1.0), EBB_EINVAL, "ebb_op_addcmul_: t2 (f32[4] on the CPU) does not broadcast to the shape of dst");
    EBB_CHECK_FAILS(ebb_op_lerp_(d, s4, 0.5), EBB_EINVAL, "ebb_op_lerp_: end (f32[4] on the CPU) does not broadcast");
    // dtypes: a src dst cannot hold; a dst of the wrong kind; a non-integer scalar on i64
    Tensor s64 = make(EBB_DEVICE_CPU, EBB_F64, {3}, values(3, 9));
    EBB_CHECK_FAILS(ebb_op_add_scaled_(d, s64, 1.0), EBB_EINVAL,
                    "ebb_op_add_scaled_: dst (f32[2, 3] on the CPU) and src (f64[3] on the CPU) do not fit: the result (f64) cannot be "
                    "stored in dst in place");
    EBB_CHECK_FAILS(ebb_op_addcdiv_(d, s, s64, 1.0), EBB_EINVAL, "ebb_op_addcdiv_: dst (f32[2, 3] on the CPU) and t2 (f64[3] on the CPU)");
    Tensor i = make(EBB_DEVICE_CPU, EBB_I64, {3}, {1, 2, 3}), bl = make(EBB_DEVICE_CPU, EBB_BOOL, {3}, {1, 0, 1});
    EBB_CHECK_FAILS(ebb_op_lerp_(i, i, 0.5), EBB_EINVAL, "ebb_op_lerp_: dst (i64[3] on the CPU) has dtype i64; expected a floating dtype");
    EBB_CHECK_FAILS(ebb_op_sqrt_(i), EBB_EINVAL, "ebb_op_sqrt_: dst (i64[3] on the CPU) has dtype i64");
    EBB_CHECK_FAILS(ebb_op_addcmul_(i, i, i, 1.0), EBB_EINVAL, "expected a floating dtype");
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(bl, 2.0), EBB_EINVAL, "ebb_op_mul_scalar_: dst (bool[3] on the CPU) has dtype bool");
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(i, 0.5), EBB_EINVAL,
                    "ebb_op_mul_scalar_: dst (i64[3] on the CPU) cannot hold the result of the scalar 0.5 in place");
    EBB_CHECK_FAILS(ebb_op_add_scaled_(i, i, 0.5), EBB_EINVAL, "ebb_op_add_scaled_: dst (i64[3] on the CPU) cannot hold");
    Tensor f = make(EBB_DEVICE_CPU, EBB_F32, {3}, {1, 2, 3});
    EBB_CHECK_FAILS(ebb_op_add_scaled_(i, f, 1.0), EBB_EINVAL, "the result (f32) cannot be stored in dst in place");
    CHECK(read(i) == std::vector<double>{1, 2, 3});
    // An expanded dst: its elements alias.
    Tensor one = make(EBB_DEVICE_CPU, EBB_F32, {1, 3}, {1, 2, 3}), ex;
    const int64_t s23[2] = {2, 3};
    EBB_REQUIRE_OK(ebb_tensor_expand(one, 2, s23, ex.out()));
    EBB_CHECK_FAILS(ebb_op_mul_scalar_(ex, 2.0), EBB_EINVAL, "ebb_op_mul_scalar_: dst (f32[2, 3] on the CPU) is expanded along dim 0");
    EBB_CHECK_FAILS(ebb_op_zero_(ex), EBB_EINVAL, "is expanded along dim 0");
    // Another device.
    int n = 0;
    EBB_REQUIRE_OK(ebb_dev_count(&n));
    if (n > 0) {
      Tensor sd = make(0, EBB_F32, {3}, values(3, 10));
      EBB_CHECK_FAILS(ebb_op_add_scaled_(d, sd, 1.0), EBB_EDEVICE,
                      "ebb_op_add_scaled_: src (f32[3] on device 0) and dst (f32[2, 3] on the CPU) are on different devices");
      EBB_CHECK_FAILS(ebb_op_addcmul_(d, s, sd, 1.0), EBB_EDEVICE, "ebb_op_addcmul_: t2 (f32[3] on device 0) and dst");
    }
    // A released handle.
    ebb_tensor_t *gone = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_clone(s, &gone));
    EBB_REQUIRE_OK(ebb_tensor_release(gone));
    EBB_CHECK_FAILS(ebb_op_lerp_(d, gone, 0.5), EBB_EFREED, "ebb_op_lerp_: end");
    EBB_CHECK_FAILS(ebb_op_sqrt_(gone), EBB_EFREED, "ebb_op_sqrt_: dst");
    // Nothing above changed dst or its version.
    CHECK(read(d) == before);
    CHECK(version_of(d) == 0);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

// The updates run on the device's current stream like any op: on a side stream, held back by a
// host function, the srcs they read (one of them a view of dst, read through a copy) are released
// and their blocks handed to a new tensor on the default stream, which writes them; the queued
// updates still read the srcs' old values.
TEST_CASE("inplace ops: queued on a side stream, they read their srcs as they were even after the srcs' release",
          "[ops][inplace][streams]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  if (ndev == 0) return;
  {
    const int64_t len = int64_t(1) << 20;  // 4 MiB of f32: blocks of their own, reused first-fit
    const int64_t two[2] = {2, len / 2};
    Tensor p, g, half;
    EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 2, two, 1.0, p.out()));
    EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &len, 2.0, g.out()));
    Tensor g2;
    EBB_REQUIRE_OK(ebb_tensor_view(g, 2, two, g2.out()));
    g.reset();
    ebb_stream_t *def = nullptr, *side = nullptr;
    EBB_REQUIRE_OK(ebb_stream_current(0, &def));
    EBB_REQUIRE_OK(ebb_stream_synchronize(def));
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &side));
    std::atomic<int> open{0};
    EBB_REQUIRE_OK(ebb_stream_host_func(side, hold_fn, &open));
    EBB_REQUIRE_OK(ebb_stream_set_current(side));
    EBB_REQUIRE_OK(ebb_op_addcmul_(p, g2, g2, 0.5));      // p = 1 + 0.5 * 4 = 3
    EBB_REQUIRE_OK(ebb_op_lerp_(p, g2, 0.25));           // p = 3 + 0.25 (2 - 3) = 2.75
    EBB_REQUIRE_OK(ebb_tensor_select(p, 0, 0, half.out()));
    EBB_REQUIRE_OK(ebb_op_add_scaled_(p, half, 1.0));    // row 0 broadcast over p: 5.5 everywhere
    EBB_REQUIRE_OK(ebb_stream_set_current(def));
    g2.reset();
    half.reset();
    Tensor other;
    EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &len, -7.0, other.out()));  // may take g's block: not while it is queued
    EBB_REQUIRE_OK(ebb_stream_synchronize(def));
    open.store(1, std::memory_order_release);
    EBB_REQUIRE_OK(ebb_stream_synchronize(side));
    auto v = read(p);
    long wrong = 0;
    for (double x : v) wrong += x != 5.5;
    CHECK(wrong == 0);
    CHECK(read(other)[0] == -7.0);
    p.reset();
    other.reset();
    EBB_REQUIRE_OK(ebb_stream_release(side));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
