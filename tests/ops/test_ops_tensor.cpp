// Tensors: dtype conversions, creation on the CPU and both emulated devices, the counter-based
// generator, host round trips (synchronous and into pinned memory with an event), views that
// alias and share the version counter, copies across devices, in-place writes, owner names in
// the allocation history, and the refused inputs.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/stream.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

TEST_CASE("tensor: bf16 and f16 conversions round to nearest even", "[ops][tensor]") {
  // Every f16 value survives f16 -> f32 -> f16 (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; h++) {
    float f = ebb_f16_to_f32((uint16_t)h);
    if (std::isnan(f)) {
      CHECK(std::isnan(ebb_f16_to_f32(ebb_f32_to_f16(f))));
      continue;
    }
    INFO("f16 bits " << h);
    REQUIRE(ebb_f32_to_f16(f) == (uint16_t)h);
  }
  for (uint32_t h = 0; h < 65536; h++) {
    float f = ebb_bf16_to_f32((uint16_t)h);
    if (!std::isnan(f)) REQUIRE(ebb_f32_to_bf16(f) == (uint16_t)h);
  }
  // Known values: ties go to even, overflow to infinity, subnormals kept.
  CHECK(ebb_f32_to_f16(1.0f) == 0x3c00);
  CHECK(ebb_f32_to_f16(65504.0f) == 0x7bff);
  CHECK(ebb_f32_to_f16(65520.0f) == 0x7c00);             // halfway past the max: infinity
  CHECK(ebb_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);      // tie between 1 and 1+2^-10: even (1)
  CHECK(ebb_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);  // tie: up to even
  CHECK(ebb_f32_to_f16(0x1p-24f) == 0x0001);             // smallest subnormal
  CHECK(ebb_f32_to_f16(0x1p-25f) == 0x0000);             // tie with zero: even
  CHECK(ebb_f32_to_f16(-2.0f) == 0xc000);
  CHECK(ebb_f32_to_bf16(1.0f) == 0x3f80);
  CHECK(ebb_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);      // tie: even
  CHECK(ebb_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
  CHECK(std::isnan(ebb_bf16_to_f32(ebb_f32_to_bf16(NAN))));
  CHECK(std::isinf(ebb_bf16_to_f32(ebb_f32_to_bf16(INFINITY))));
  CHECK(std::string(ebb_dtype_name(EBB_BF16)) == "bf16");
  CHECK(ebb_dtype_size(EBB_F16) == 2);
  CHECK(ebb_dtype_size((ebb_dtype)99) == 0);
  CHECK(std::string(ebb_dtype_name((ebb_dtype)99)) == "unknown");
}

TEST_CASE("tensor: creation and getters on every device", "[ops][tensor]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    for (int dti = 0; dti < EBB_DTYPE_COUNT; dti++) {
      ebb_dtype dt = (ebb_dtype)dti;
      INFO(ebb_dtype_name(dt));
      std::vector<int64_t> shape{2, 3, 4};
      Tensor z, o, f;
      EBB_REQUIRE_OK(ebb_tensor_zeros(dev, dt, 3, shape.data(), z.out()));
      EBB_REQUIRE_OK(ebb_tensor_ones(dev, dt, 3, shape.data(), o.out()));
      EBB_REQUIRE_OK(ebb_tensor_full(dev, dt, 3, shape.data(), 3.0, f.out()));
      CHECK(read(z) == std::vector<double>(24, 0.0));
      CHECK(read(o) == std::vector<double>(24, 1.0));
      CHECK(read(f) == std::vector<double>(24, dt == EBB_BOOL ? 1.0 : 3.0));
      ebb_tensor_info info;
      EBB_REQUIRE_OK(ebb_tensor_get_info(f, &info));
      CHECK(info.device == dev);
      CHECK(info.dtype == dt);
      CHECK(info.ndim == 3);
      CHECK(info.numel == 24);
      CHECK(info.contiguous);
      CHECK(info.strides[0] == 12);
      CHECK(info.strides[1] == 4);
      CHECK(info.strides[2] == 1);
      CHECK(info.version == 0);
      int d2;
      EBB_REQUIRE_OK(ebb_tensor_device(f, &d2));
      CHECK(d2 == dev);
      int64_t n;
      EBB_REQUIRE_OK(ebb_tensor_numel(f, &n));
      CHECK(n == 24);
      bool c;
      EBB_REQUIRE_OK(ebb_tensor_is_contiguous(f, &c));
      CHECK(c);
    }
    Tensor a, s, e;
    int64_t n_two = 2;
    EBB_REQUIRE_OK(ebb_tensor_arange(dev, EBB_F32, 1.5, 0.5, 5, a.out()));
    CHECK(read(a) == std::vector<double>{1.5, 2.0, 2.5, 3.0, 3.5});
    EBB_REQUIRE_OK(ebb_tensor_arange(dev, EBB_I64, 10, -3, 4, a.out()));
    CHECK(read(a) == std::vector<double>{10, 7, 4, 1});
    Tensor bf, bi;
    EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_BOOL, 1, &n_two, 0.5, bf.out())); // bool: v != 0
    EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_I64, 1, &n_two, -2.75, bi.out())); // i64: truncated
    CHECK(read(bf) == std::vector<double>{1, 1});
    CHECK(read(bi) == std::vector<double>{-2, -2});
    EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_F64, 0, nullptr, -2.25, s.out())); // a scalar
    CHECK(shape_of(s).empty());
    CHECK(read(s) == std::vector<double>{-2.25});
    int64_t zero_shape[2] = {3, 0};
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 2, zero_shape, e.out())); // no elements
    CHECK(read(e).empty());
    void *p = &p;
    EBB_REQUIRE_OK(ebb_tensor_data(e, &p));
    CHECK(p == nullptr);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: rand and randn give the same numbers on every device", "[ops][tensor][rng]") {
  EbbSession session;
  std::vector<int64_t> shape{37, 29};
  for (ebb_dtype dt : {EBB_F32, EBB_F64, EBB_BF16, EBB_F16}) {
    INFO(ebb_dtype_name(dt));
    std::vector<double> ref_u, ref_n;
    for (int dev : devices()) {
      INFO(dev_name(dev));
      Tensor u, n;
      EBB_REQUIRE_OK(ebb_tensor_rand(dev, dt, 2, shape.data(), 1234, 0, u.out()));
      EBB_REQUIRE_OK(ebb_tensor_randn(dev, dt, 2, shape.data(), 1234, 0, n.out()));
      auto vu = read(u), vn = read(n);
      if (ref_u.empty()) {
        ref_u = vu;
        ref_n = vn;
      }
      CHECK(vu == ref_u); // bit-identical across devices
      CHECK(vn == ref_n);
    }
    double mean = 0, mn = 1, mx = 0;
    for (double v : ref_u) mean += v, mn = std::min(mn, v), mx = std::max(mx, v);
    mean /= (double)ref_u.size();
    CHECK(mn >= 0.0);
    CHECK(mx < 1.0);
    CHECK(std::fabs(mean - 0.5) < 0.05);
    double nm = 0, nv = 0;
    for (double v : ref_n) nm += v;
    nm /= (double)ref_n.size();
    for (double v : ref_n) nv += (v - nm) * (v - nm);
    nv /= (double)ref_n.size();
    CHECK(std::fabs(nm) < 0.1);
    CHECK(std::fabs(nv - 1.0) < 0.15);
  }
  // The counter is the element index plus offset: a later draw continues the sequence, and a
  // different seed gives different numbers.
  {
  int64_t n10 = 10, n4 = 4;
  Tensor all, tail, other;
  EBB_REQUIRE_OK(ebb_tensor_rand(0, EBB_F64, 1, &n10, 7, 0, all.out()));
  EBB_REQUIRE_OK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F64, 1, &n4, 7, 6, tail.out()));
  EBB_REQUIRE_OK(ebb_tensor_rand(1, EBB_F64, 1, &n10, 8, 0, other.out()));
  auto va = read(all), vt = read(tail), vo = read(other);
  CHECK(std::vector<double>(va.begin() + 6, va.end()) == vt);
  CHECK(va != vo);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: host round trips in every dtype, synchronous and into pinned memory", "[ops][tensor]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  std::vector<int64_t> shape{5, 7};
  for (int dev : devices()) {
    INFO(dev_name(dev));
    for (int dti = 0; dti < EBB_DTYPE_COUNT; dti++) {
      ebb_dtype dt = (ebb_dtype)dti;
      INFO(ebb_dtype_name(dt));
      auto v = values(35, 3, -4, 4);
      for (auto &x : v) {
        if (dt == EBB_I64) x = std::floor(x * 100);
        if (dt == EBB_BOOL) x = x > 0;
        if (dt == EBB_BF16) x = ebb_bf16_to_f32(ebb_f32_to_bf16((float)x));
        if (dt == EBB_F16) x = ebb_f16_to_f32(ebb_f32_to_f16((float)x));
        if (dt == EBB_F32) x = (float)x;
      }
      Tensor t = make(dev, dt, shape, v);
      CHECK(read(t) == v);
    }
    // Asynchronous read into pinned memory, complete once the event is.
    if (dev == EBB_DEVICE_CPU) continue;
    auto v = values(35, 4);
    Tensor t = make(dev, EBB_F64, shape, v), tt;
    EBB_REQUIRE_OK(ebb_tensor_transpose(t, 0, 1, tt.out())); // not contiguous: copied first
    void *pin = nullptr;
    EBB_REQUIRE_OK(ebb_pinned_alloc(35 * 8, dev, &pin));
    ebb_event_t *ev = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(dev, EBB_EVENT_DEFAULT, &ev));
    EBB_REQUIRE_OK(ebb_tensor_to_host_async(tt, pin, 35 * 8, ev));
    EBB_REQUIRE_OK(ebb_event_synchronize(ev));
    const double *got = static_cast<const double *>(pin);
    for (int i = 0; i < 7; i++)
      for (int j = 0; j < 5; j++) CHECK(got[i * 5 + j] == v[(size_t)(j * 7 + i)]);
    // Pageable memory and a wrong-device event are refused, and nothing is recorded.
    std::vector<double> pageable(35);
    EBB_CHECK_FAILS(ebb_tensor_to_host_async(t, pageable.data(), 35 * 8, ev), EBB_EINVAL, "pinned");
    ebb_event_t *other = nullptr;
    EBB_REQUIRE_OK(ebb_event_create(dev == 0 ? 1 : 0, EBB_EVENT_DEFAULT, &other));
    EBB_CHECK_FAILS(ebb_tensor_to_host_async(t, pin, 35 * 8, other), EBB_EDEVICE, "event");
    EBB_CHECK_FAILS(ebb_tensor_to_host_async(t, pin, 35 * 8, nullptr), EBB_EINVAL, "done");
    EBB_REQUIRE_OK(ebb_event_release(other));
    EBB_REQUIRE_OK(ebb_event_release(ev));
    EBB_REQUIRE_OK(ebb_pinned_free(pin));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: views alias their base and share its version counter", "[ops][tensor][views]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    auto v = values(24, 5);
    Tensor base = make(dev, EBB_F64, {2, 3, 4}, v);
    // view / reshape
    Tensor r, r2;
    int64_t s1[2] = {6, -1};
    EBB_REQUIRE_OK(ebb_tensor_view(base, 2, s1, r.out()));
    CHECK(shape_of(r) == std::vector<int64_t>{6, 4});
    CHECK(read(r) == v);
    bool same = false;
    EBB_REQUIRE_OK(ebb_tensor_same_storage(r, base, &same));
    CHECK(same);
    // transpose: a view; viewing it flat is impossible, reshape copies
    Tensor t;
    EBB_REQUIRE_OK(ebb_tensor_transpose(base, 0, 2, t.out())); // [4,3,2]
    CHECK(shape_of(t) == std::vector<int64_t>{4, 3, 2});
    auto tv = read(t);
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 3; j++)
        for (int k = 0; k < 2; k++) CHECK(tv[(size_t)(i * 6 + j * 2 + k)] == v[(size_t)(k * 12 + j * 4 + i)]);
    int64_t flat = 24;
    EBB_CHECK_FAILS(ebb_tensor_view(t, 1, &flat, r2.out()), EBB_EINVAL, "without a copy");
    EBB_REQUIRE_OK(ebb_tensor_reshape(t, 1, &flat, r2.out()));
    CHECK(read(r2) == tv);
    EBB_REQUIRE_OK(ebb_tensor_same_storage(r2, base, &same));
    CHECK(!same);
    // permute
    Tensor p;
    int perm[3] = {1, 2, 0};
    EBB_REQUIRE_OK(ebb_tensor_permute(base, perm, 3, p.out()));
    CHECK(shape_of(p) == std::vector<int64_t>{3, 4, 2});
    auto pv = read(p);
    CHECK(pv[(size_t)(2 * 8 + 1 * 2 + 1)] == v[(size_t)(1 * 12 + 2 * 4 + 1)]);
    // slice with a step, narrow, select
    Tensor sl, nw, se;
    EBB_REQUIRE_OK(ebb_tensor_slice(base, -1, 1, 100, 2, sl.out())); // columns 1 and 3
    CHECK(shape_of(sl) == std::vector<int64_t>{2, 3, 2});
    auto sv = read(sl);
    CHECK(sv[0] == v[1]);
    CHECK(sv[1] == v[3]);
    CHECK(sv[11] == v[23]);
    EBB_REQUIRE_OK(ebb_tensor_narrow(base, 1, 1, 2, nw.out()));
    CHECK(shape_of(nw) == std::vector<int64_t>{2, 2, 4});
    CHECK(read(nw)[0] == v[4]);
    EBB_REQUIRE_OK(ebb_tensor_select(base, 0, -1, se.out()));
    CHECK(shape_of(se) == std::vector<int64_t>{3, 4});
    CHECK(read(se) == std::vector<double>(v.begin() + 12, v.end()));
    // expand, squeeze, unsqueeze
    Tensor col = make(dev, EBB_F64, {3, 1}, {1, 2, 3}), ex, sq, us;
    int64_t es[3] = {2, 3, 4};
    EBB_REQUIRE_OK(ebb_tensor_expand(col, 3, es, ex.out()));
    auto xv = read(ex);
    CHECK(xv.size() == 24);
    CHECK(xv[23] == 3);
    CHECK(xv[12 + 4] == 2);
    EBB_REQUIRE_OK(ebb_tensor_squeeze(col, 1, sq.out()));
    CHECK(shape_of(sq) == std::vector<int64_t>{3});
    EBB_REQUIRE_OK(ebb_tensor_unsqueeze(sq, 0, us.out()));
    CHECK(shape_of(us) == std::vector<int64_t>{1, 3});
    EBB_REQUIRE_OK(ebb_tensor_unsqueeze(sq, -1, us.out()));
    CHECK(shape_of(us) == std::vector<int64_t>{3, 1});
    // writes through a view reach the base; the version is shared
    uint64_t v0, v1, vb;
    EBB_REQUIRE_OK(ebb_tensor_version(base, &v0));
    EBB_REQUIRE_OK(ebb_tensor_fill_(se, 9.0));
    EBB_REQUIRE_OK(ebb_tensor_version(base, &v1));
    EBB_REQUIRE_OK(ebb_tensor_version(t, &vb));
    CHECK(v1 == v0 + 1);
    CHECK(vb == v1);
    auto after = read(base);
    for (int i = 0; i < 24; i++) CHECK(after[(size_t)i] == (i >= 12 ? 9.0 : v[(size_t)i]));
    // writing an expanded view is refused (its elements alias)
    EBB_CHECK_FAILS(ebb_tensor_fill_(ex, 1.0), EBB_EINVAL, "expanded");
    // contiguous of a contiguous tensor is the same handle; of a transpose, a copy
    Tensor c1, c2;
    EBB_REQUIRE_OK(ebb_tensor_contiguous(base, c1.out()));
    CHECK(c1.get() == base.get());
    EBB_REQUIRE_OK(ebb_tensor_contiguous(t, c2.out()));
    bool ic = false;
    EBB_REQUIRE_OK(ebb_tensor_is_contiguous(c2, &ic));
    CHECK(ic);
    EBB_REQUIRE_OK(ebb_tensor_is_contiguous(t, &ic));
    CHECK(!ic);
    CHECK(read(c2) == read(t));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: copy_ from another view of its own storage reads the values from before the copy", "[ops][tensor][copy]") {
  EbbSession session;
  for (int dev : devices())
    for (int64_t n : {4, 64}) {
      INFO(dev_name(dev) << " " << n << "x" << n);
      auto v = values(n * n, 11, -5, 5);
      Tensor x = make(dev, EBB_F32, {n, n}, v), xt, row;
      EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, xt.out()));
      EBB_REQUIRE_OK(ebb_tensor_copy_(x, xt));  // x = x^T, in place
      auto got = read(x);
      long bad = 0;
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) bad += got[(size_t)(i * n + j)] != (double)(float)v[(size_t)(j * n + i)];
      CHECK(bad == 0);
      // a row of x broadcast over all of x: every row becomes the old row 1
      auto before = read(x);
      EBB_REQUIRE_OK(ebb_tensor_select(x, 0, 1, row.out()));
      EBB_REQUIRE_OK(ebb_tensor_copy_(x, row));
      got = read(x);
      bad = 0;
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) bad += got[(size_t)(i * n + j)] != before[(size_t)(n + j)];
      CHECK(bad == 0);
    }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: copies across devices, dtype conversion and copy_", "[ops][tensor][copy]") {
  EbbSession session;
  auto v = values(60, 6, -3, 3);
  auto devs = devices();
  for (int from : devs)
    for (int to : devs) {
      INFO(dev_name(from) << " -> " << dev_name(to));
      Tensor a = make(from, EBB_F32, {6, 10}, v), at, b;
      EBB_REQUIRE_OK(ebb_tensor_transpose(a, 0, 1, at.out()));
      EBB_REQUIRE_OK(ebb_tensor_to_device(at, to, b.out()));
      int d;
      EBB_REQUIRE_OK(ebb_tensor_device(b, &d));
      CHECK(d == to);
      CHECK(read(b) == read(at));
      // copy_ from another device, broadcasting a row
      Tensor dst, row = make(from, EBB_F64, {10}, std::vector<double>(v.begin(), v.begin() + 10));
      int64_t sh[2] = {3, 10};
      EBB_REQUIRE_OK(ebb_tensor_zeros(to, EBB_F32, 2, sh, dst.out()));
      EBB_REQUIRE_OK(ebb_tensor_copy_(dst, row));
      auto dv = read(dst);
      for (int i = 0; i < 30; i++) CHECK(dv[(size_t)i] == (double)(float)v[(size_t)(i % 10)]);
      uint64_t ver;
      EBB_REQUIRE_OK(ebb_tensor_version(dst, &ver));
      CHECK(ver == 1);
    }
  // dtype conversion: truncation toward zero, saturation, NaN to 0, bool is != 0
  {
  Tensor f = make(0, EBB_F64, {6}, {1.7, -1.7, 1e300, -1e300, NAN, 0.0}), i, bo, cl;
  EBB_REQUIRE_OK(ebb_tensor_to_dtype(f, EBB_I64, i.out()));
  auto iv = read(i);
  CHECK(iv[0] == 1);
  CHECK(iv[1] == -1);
  CHECK(iv[2] == (double)INT64_MAX);
  CHECK(iv[3] == (double)INT64_MIN);
  CHECK(iv[4] == 0);
  EBB_REQUIRE_OK(ebb_tensor_to_dtype(f, EBB_BOOL, bo.out()));
  CHECK(read(bo) == std::vector<double>{1, 1, 1, 1, 1, 0});
  EBB_REQUIRE_OK(ebb_tensor_clone(f, cl.out()));
  bool same = true;
  EBB_REQUIRE_OK(ebb_tensor_same_storage(f, cl, &same));
  CHECK(!same);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: ops follow the current stream, and a storage used on another stream is kept until that work ran", "[ops][tensor][streams]") {
  EbbSession session;
  ebb_stream_t *side = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &side));
  auto v = values(1 << 16, 9);
  {
    Tensor a = make(0, EBB_F32, {1 << 16}, v), b;
    // a was written on the default stream: the side stream waits for it (ordering across
    // streams is the caller's, as in CUDA)
    ebb_stream_t *dflt = nullptr;
    EBB_REQUIRE_OK(ebb_stream_current(0, &dflt));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(side, dflt));
    ebb_stream_guard g;
    EBB_REQUIRE_OK(ebb_stream_guard_enter(&g, side));
    EBB_REQUIRE_OK(ebb_tensor_clone(a, b.out())); // reads a on the side stream
    a.reset();                                    // a's block waits for the side stream's work
    Tensor c;
    int64_t n = 1 << 16;
    EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 1, &n, c.out()));
    EBB_REQUIRE_OK(ebb_stream_guard_exit(&g));
    EBB_REQUIRE_OK(ebb_stream_wait_stream(dflt, side)); // b was written on the side stream
    auto bv = read(b);
    for (size_t i = 0; i < v.size(); i++) REQUIRE(bv[i] == (double)(float)v[i]);
  }
  EBB_REQUIRE_OK(ebb_stream_synchronize(side));
  EBB_REQUIRE_OK(ebb_stream_release(side));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: a named tensor is the owner of its storage in the allocation history", "[ops][tensor][owner]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  int64_t shape[2] = {128, 128};
  Tensor t;
  EBB_REQUIRE_OK(ebb_tensor_empty_named(1, EBB_F32, 2, shape, EBB_OWNER_PARAMETER, "layer0.weight", t.out()));
  char name[64];
  EBB_REQUIRE_OK(ebb_tensor_name(t, name, sizeof name));
  CHECK(std::string(name) == "layer0.weight");
  size_t count = 0;
  EBB_REQUIRE_OK(ebb_alloc_history_get(1, nullptr, 0, &count, nullptr));
  std::vector<ebb_alloc_trace_entry> h(count);
  EBB_REQUIRE_OK(ebb_alloc_history_get(1, h.data(), h.size(), &count, nullptr));
  bool found = false;
  for (auto &e : h)
    found |= e.action == EBB_ACT_ALLOC && e.owner_cat == EBB_OWNER_PARAMETER && std::string(e.owner_name) == "layer0.weight";
  CHECK(found);
  EBB_REQUIRE_OK(ebb_tensor_set_name(t, "renamed"));
  EBB_REQUIRE_OK(ebb_tensor_name(t, name, sizeof name));
  CHECK(std::string(name) == "renamed");
  REQUIRE(ebb_debug_live_handles() == 1); // t is still alive here
  t.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: bad inputs return a status and a message naming the call, argument and shapes", "[ops][tensor][errors]") {
  EbbSession session;
  int64_t shape[2] = {2, 3};
  Tensor t, o;
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 2, shape, t.out()));
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, EBB_F32, 2, shape, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_tensor_zeros(5, EBB_F32, 2, shape, o.out()), EBB_EDEVICE, "device 5");
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, (ebb_dtype)42, 2, shape, o.out()), EBB_EINVAL, "dtype 42");
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, EBB_F32, 9, shape, o.out()), EBB_EINVAL, "ndim 9");
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, EBB_F32, 2, nullptr, o.out()), EBB_EINVAL, "shape is NULL");
  int64_t neg[2] = {2, -3};
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, EBB_F32, 2, neg, o.out()), EBB_EINVAL, "[2, -3]");
  EBB_CHECK_FAILS(ebb_tensor_arange(0, EBB_F32, 0, 1, -1, o.out()), EBB_EINVAL, "n is -1");
  EBB_CHECK_FAILS(ebb_tensor_rand(0, EBB_I64, 2, shape, 1, 0, o.out()), EBB_EINVAL, "i64");
  float buf[6] = {0};
  EBB_CHECK_FAILS(ebb_tensor_from_host(0, EBB_F32, 2, shape, buf, 20, o.out()), EBB_EINVAL, "expected 24 bytes");
  EBB_CHECK_FAILS(ebb_tensor_to_host(t, buf, 8), EBB_EINVAL, "for t (f32[2, 3] on device 0)");
  EBB_CHECK_FAILS(ebb_tensor_to_host(nullptr, buf, 24), EBB_EINVAL, "t is NULL");
  // views with impossible shapes and dims out of range
  int64_t bad[2] = {4, 2};
  EBB_CHECK_FAILS(ebb_tensor_view(t, 2, bad, o.out()), EBB_EINVAL, "cannot view t (f32[2, 3] on device 0) (6 elements) as [4, 2]");
  int64_t two_infer[2] = {-1, -1};
  EBB_CHECK_FAILS(ebb_tensor_view(t, 2, two_infer, o.out()), EBB_EINVAL, "cannot view");
  EBB_CHECK_FAILS(ebb_tensor_transpose(t, 0, 2, o.out()), EBB_EINVAL, "dim1 2 is out of range");
  EBB_CHECK_FAILS(ebb_tensor_select(t, 1, 3, o.out()), EBB_EINVAL, "index 3");
  EBB_CHECK_FAILS(ebb_tensor_narrow(t, 1, 2, 2, o.out()), EBB_EINVAL, "do not fit");
  EBB_CHECK_FAILS(ebb_tensor_slice(t, 0, 0, 2, 0, o.out()), EBB_EINVAL, "step is 0");
  EBB_CHECK_FAILS(ebb_tensor_squeeze(t, 0, o.out()), EBB_EINVAL, "expected 1");
  EBB_CHECK_FAILS(ebb_tensor_unsqueeze(t, 4, o.out()), EBB_EINVAL, "dim 4");
  int dup[2] = {0, 0};
  EBB_CHECK_FAILS(ebb_tensor_permute(t, dup, 2, o.out()), EBB_EINVAL, "twice");
  int64_t ex[2] = {4, 3};
  EBB_CHECK_FAILS(ebb_tensor_expand(t, 2, ex, o.out()), EBB_EINVAL, "cannot be expanded");
  int64_t other[2] = {3, 2};
  Tensor u;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 2, other, u.out()));
  EBB_CHECK_FAILS(ebb_tensor_copy_(t, u), EBB_EINVAL, "does not broadcast");
  EBB_CHECK_FAILS(ebb_tensor_set_name(t, std::string(100, 'x').c_str()), EBB_EINVAL, "longer than");
  // released handles and double release
  ebb_tensor_t *dead = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 2, shape, &dead));
  EBB_REQUIRE_OK(ebb_tensor_release(dead));
  EBB_CHECK_FAILS(ebb_tensor_release(dead), EBB_EFREED, "released tensor");
  EBB_CHECK_FAILS(ebb_tensor_clone(dead, o.out()), EBB_EFREED, "ebb_tensor_clone");
  int64_t n;
  EBB_CHECK_FAILS(ebb_tensor_numel(dead, &n), EBB_EFREED, "ebb_tensor_numel");
  EBB_CHECK_FAILS(ebb_tensor_retain(nullptr), EBB_EINVAL, "NULL");
  REQUIRE(o.get() == nullptr);
  u.reset();
  t.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: calls before ebb_init fail with EBB_ENOTINIT", "[ops][tensor][errors]") {
  int64_t shape[1] = {4};
  ebb_tensor_t *t = nullptr;
  EBB_CHECK_FAILS(ebb_tensor_zeros(0, EBB_F32, 1, shape, &t), EBB_ENOTINIT, "not initialised");
  CHECK(t == nullptr);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("tensor: every call refuses NULL and released tensors with a message naming it", "[ops][tensor][errors]") {
  EbbSession session;
  ebb_tensor_t *dead = nullptr;
  int64_t shape[2] = {2, 2};
  EBB_REQUIRE_OK(ebb_tensor_ones(0, EBB_F32, 2, shape, &dead));
  EBB_REQUIRE_OK(ebb_tensor_release(dead));
  ebb_tensor_t *o = nullptr;
  ebb_tensor_info info;
  int nd, dev;
  int64_t sh[EBB_TENSOR_MAX_DIMS], n;
  ebb_dtype dt;
  bool b;
  uint64_t v;
  void *p;
  char name[16];
  int perm[2] = {1, 0};
  struct Case {
    const char *fn;
    std::function<ebb_status(ebb_tensor_t *)> call;
  } cases[] = {
      {"ebb_tensor_get_info", [&](ebb_tensor_t *t) { return ebb_tensor_get_info(t, &info); }},
      {"ebb_tensor_shape", [&](ebb_tensor_t *t) { return ebb_tensor_shape(t, &nd, sh); }},
      {"ebb_tensor_strides", [&](ebb_tensor_t *t) { return ebb_tensor_strides(t, sh); }},
      {"ebb_tensor_dtype", [&](ebb_tensor_t *t) { return ebb_tensor_dtype(t, &dt); }},
      {"ebb_tensor_device", [&](ebb_tensor_t *t) { return ebb_tensor_device(t, &dev); }},
      {"ebb_tensor_numel", [&](ebb_tensor_t *t) { return ebb_tensor_numel(t, &n); }},
      {"ebb_tensor_is_contiguous", [&](ebb_tensor_t *t) { return ebb_tensor_is_contiguous(t, &b); }},
      {"ebb_tensor_version", [&](ebb_tensor_t *t) { return ebb_tensor_version(t, &v); }},
      {"ebb_tensor_same_storage", [&](ebb_tensor_t *t) { return ebb_tensor_same_storage(t, t, &b); }},
      {"ebb_tensor_data", [&](ebb_tensor_t *t) { return ebb_tensor_data(t, &p); }},
      {"ebb_tensor_name", [&](ebb_tensor_t *t) { return ebb_tensor_name(t, name, sizeof name); }},
      {"ebb_tensor_set_name", [&](ebb_tensor_t *t) { return ebb_tensor_set_name(t, "x"); }},
      {"ebb_tensor_record_stream", [&](ebb_tensor_t *t) { return ebb_tensor_record_stream(t, nullptr); }},
      {"ebb_tensor_bump_version", [&](ebb_tensor_t *t) { return ebb_tensor_bump_version(t); }},
      {"ebb_tensor_view", [&](ebb_tensor_t *t) { return ebb_tensor_view(t, 2, shape, &o); }},
      {"ebb_tensor_reshape", [&](ebb_tensor_t *t) { return ebb_tensor_reshape(t, 2, shape, &o); }},
      {"ebb_tensor_transpose", [&](ebb_tensor_t *t) { return ebb_tensor_transpose(t, 0, 1, &o); }},
      {"ebb_tensor_permute", [&](ebb_tensor_t *t) { return ebb_tensor_permute(t, perm, 2, &o); }},
      {"ebb_tensor_slice", [&](ebb_tensor_t *t) { return ebb_tensor_slice(t, 0, 0, 1, 1, &o); }},
      {"ebb_tensor_narrow", [&](ebb_tensor_t *t) { return ebb_tensor_narrow(t, 0, 0, 1, &o); }},
      {"ebb_tensor_select", [&](ebb_tensor_t *t) { return ebb_tensor_select(t, 0, 0, &o); }},
      {"ebb_tensor_expand", [&](ebb_tensor_t *t) { return ebb_tensor_expand(t, 2, shape, &o); }},
      {"ebb_tensor_squeeze", [&](ebb_tensor_t *t) { return ebb_tensor_squeeze(t, 0, &o); }},
      {"ebb_tensor_unsqueeze", [&](ebb_tensor_t *t) { return ebb_tensor_unsqueeze(t, 0, &o); }},
      {"ebb_tensor_contiguous", [&](ebb_tensor_t *t) { return ebb_tensor_contiguous(t, &o); }},
      {"ebb_tensor_clone", [&](ebb_tensor_t *t) { return ebb_tensor_clone(t, &o); }},
      {"ebb_tensor_to_device", [&](ebb_tensor_t *t) { return ebb_tensor_to_device(t, 1, &o); }},
      {"ebb_tensor_to_dtype", [&](ebb_tensor_t *t) { return ebb_tensor_to_dtype(t, EBB_F64, &o); }},
      {"ebb_tensor_fill_", [&](ebb_tensor_t *t) { return ebb_tensor_fill_(t, 1.0); }},
      {"ebb_tensor_zero_", [&](ebb_tensor_t *t) { return ebb_tensor_zero_(t); }},
      {"ebb_tensor_copy_", [&](ebb_tensor_t *t) { return ebb_tensor_copy_(t, t); }},
      {"ebb_tensor_to_host", [&](ebb_tensor_t *t) { return ebb_tensor_to_host(t, sh, 16); }},
      {"ebb_tensor_retain", [&](ebb_tensor_t *t) { return ebb_tensor_retain(t); }},
  };
  for (auto &c : cases) {
    INFO(c.fn);
    EBB_CHECK_FAILS(c.call(nullptr), EBB_EINVAL, c.fn);
    EBB_CHECK_FAILS(c.call(dead), EBB_EFREED, c.fn);
    CHECK(o == nullptr);
  }
  // the remaining out-parameter and name checks
  Tensor t;
  EBB_REQUIRE_OK(ebb_tensor_ones(EBB_DEVICE_CPU, EBB_F32, 2, shape, t.out()));
  EBB_CHECK_FAILS(ebb_tensor_get_info(t, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_FAILS(ebb_tensor_name(t, nullptr, 4), EBB_EINVAL, "buf is NULL");
  EBB_CHECK_FAILS(ebb_tensor_to_dtype(t, (ebb_dtype)9, &o), EBB_EINVAL, "dtype 9");
  EBB_CHECK_FAILS(ebb_tensor_to_device(t, 7, &o), EBB_EDEVICE, "device 7");
  EBB_CHECK_FAILS(ebb_tensor_empty_named(0, EBB_F32, 2, shape, EBB_OWNER_PARAMETER, nullptr, &o), EBB_EINVAL, "name is NULL");
  EBB_CHECK_FAILS(ebb_tensor_empty_named(0, EBB_F32, 2, shape, (ebb_owner_cat)99, "w", &o), EBB_EINVAL, "");
  EBB_CHECK_FAILS(ebb_tensor_randn(0, EBB_BOOL, 2, shape, 1, 0, &o), EBB_EINVAL, "ebb_tensor_randn: dtype bool");
  CHECK(o == nullptr);
  // bump_version counts, and live_count follows creation and release
  uint64_t v0 = 0, v1 = 0;
  EBB_REQUIRE_OK(ebb_tensor_version(t, &v0));
  EBB_REQUIRE_OK(ebb_tensor_bump_version(t));
  EBB_REQUIRE_OK(ebb_tensor_version(t, &v1));
  CHECK(v1 == v0 + 1);
  long live = ebb_tensor_live_count();
  t.reset();
  CHECK(ebb_tensor_live_count() == live - 1);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("the last shutdown refuses while a tensor is live - a tensor from before a completed shutdown reads EFREED", "[ops][init]") {
  EBB_REQUIRE_OK(ebb_init());
  const int64_t shape[1] = {256};
  ebb_tensor_t *t = nullptr, *c = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 1, shape, &t));
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, shape, &c));
  // The tensors' storages are arena blocks: those are counted too.
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_EBUSY, "tensors: 2");
  CHECK(std::string(ebb_last_error()).find("blocks of the device 0 arena: 1") != std::string::npos);
  CHECK(ebb_is_initialized());
  EBB_REQUIRE_OK(ebb_tensor_release(t));
  EBB_REQUIRE_OK(ebb_tensor_release(c));
  EBB_REQUIRE_OK(ebb_shutdown());
  EbbSession session;
  // Before: EBB_OK with a stray "ebb_arena_free: pointer ... was not allocated" message.
  ebb_clear_error();
  EBB_CHECK_FAILS(ebb_tensor_release(t), EBB_EFREED, "released tensor");
  REQUIRE(ebb_debug_live_handles() == 0);
}
