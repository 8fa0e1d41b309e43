// What autograd needs from ops, tested without autograd: ebb_tensor_record_stream (public), and
// the lifecycle hooks of ops_export.h (white-box: a fake "autograd" installs them), which free a
// slot's state when its handle dies and let a view take its base's history.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "ebb/alloc.h"
#include "ebb/stream.h"
#include "ops_export.h"  // the lifecycle hooks, internal
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

void hold_fn(void *u) {
  auto *open = static_cast<std::atomic<int> *>(u);
  while (!open->load(std::memory_order_acquire)) {
  }
}

// A host function that reads n floats from device memory (host-addressable on the emulated
// driver) into out: work the caller enqueues itself, which ebb cannot see.
struct LateRead {
  const float *src;
  std::vector<float> out;
};
void late_read_fn(void *u) {
  auto *r = static_cast<LateRead *>(u);
  std::memcpy(r->out.data(), r->src, r->out.size() * sizeof(float));
}

}  // namespace

// A view's storage read on another stream by the caller's own work, declared with
// ebb_tensor_record_stream: after every handle is released, a new tensor of the same size does not
// get the block while that work is queued, so the late read sees the original values. Without
// the declaration the block is reused at once (checked below too, so the test proves itself).
TEST_CASE("record_stream: a view used on another stream keeps its storage from reuse until that work ran",
          "[ops][tensor][streams]") {
  EbbSession session;
  const int64_t n = int64_t(1) << 20;  // 4 MiB: a block of its own (no slab), reused first-fit
  for (bool declare : {false, true}) {
    INFO((declare ? "declared" : "not declared"));
    ebb_stream_t *side = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &side));
    Tensor a, v;
    EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &n, 1.0, a.out()));
    int64_t two[2] = {1024, 1024};
    EBB_REQUIRE_OK(ebb_tensor_view(a, 2, two, v.out()));
    ebb_stream_t *def = nullptr;
    EBB_REQUIRE_OK(ebb_stream_current(0, &def));
    EBB_REQUIRE_OK(ebb_stream_synchronize(def));  // a holds its 1.0s
    void *data = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_data(a, &data));
    std::atomic<int> open{0};
    LateRead r{static_cast<const float *>(data), std::vector<float>(n, -1.f)};
    EBB_REQUIRE_OK(ebb_stream_host_func(side, hold_fn, &open));
    EBB_REQUIRE_OK(ebb_stream_host_func(side, late_read_fn, &r));
    if (declare) EBB_REQUIRE_OK(ebb_tensor_record_stream(v, side));
    a.reset();
    v.reset();  // the last handle: the block goes back, stream-ordered
    Tensor b;
    EBB_REQUIRE_OK(ebb_tensor_full(0, EBB_F32, 1, &n, 2.0, b.out()));
    EBB_REQUIRE_OK(ebb_stream_synchronize(def));  // b written
    void *bdata = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_data(b, &bdata));
    open.store(1, std::memory_order_release);
    EBB_REQUIRE_OK(ebb_stream_synchronize(side));
    long wrong = 0;
    for (float x : r.out) wrong += x != 1.f;
    if (declare) {
      CHECK(bdata != data);
      CHECK(wrong == 0);
    } else {
      CHECK(bdata == data);  // reused at once: what the declaration prevents
      CHECK(wrong == n);
    }
    b.reset();
    EBB_REQUIRE_OK(ebb_stream_release(side));
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("record_stream: bad input is refused with a message", "[ops][tensor][streams][errors]") {
  EbbSession session;
  const int64_t n = 16;
  Tensor d, c;
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 1, &n, d.out()));
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, &n, c.out()));
  ebb_stream_t *s0 = nullptr, *s1 = nullptr, *gone = nullptr;
  EBB_REQUIRE_OK(ebb_stream_current(0, &s0));
  EBB_REQUIRE_OK(ebb_stream_current(1, &s1));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &gone));
  EBB_REQUIRE_OK(ebb_stream_release(gone));
  EBB_CHECK_FAILS(ebb_tensor_record_stream(nullptr, s0), EBB_EINVAL, "ebb_tensor_record_stream: ");
  EBB_CHECK_FAILS(ebb_tensor_record_stream(d, nullptr), EBB_EINVAL, "stream is NULL; expected a stream of device 0");
  EBB_CHECK_FAILS(ebb_tensor_record_stream(d, gone), EBB_EFREED, "ebb_tensor_record_stream: ");
  EBB_CHECK_FAILS(ebb_tensor_record_stream(d, s1), EBB_EDEVICE, "is on device 1 but tensor [16] is on device 0");
  EBB_CHECK_FAILS(ebb_tensor_record_stream(c, s0), EBB_EINVAL, "is a CPU tensor");
  ebb_tensor_t *dead = d.get();
  d.reset();
  EBB_CHECK_FAILS(ebb_tensor_record_stream(dead, s0), EBB_EFREED, "ebb_tensor_record_stream: ");
  // Its own allocation stream, and twice: no-ops that succeed and leave the last error alone.
  Tensor e;
  EBB_REQUIRE_OK(ebb_tensor_zeros(0, EBB_F32, 1, &n, e.out()));
  ebb_set_error_hook(nullptr, nullptr);
  ebb_clear_error();
  EBB_REQUIRE_OK(ebb_tensor_record_stream(e, s0));
  EBB_REQUIRE_OK(ebb_tensor_record_stream(e, s0));
  CHECK(std::string(ebb_last_error()).empty());
  e.reset();
  c.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}

// ---- lifecycle hooks -------------------------------------------------------------------------

// The library's failure helper (common/ebb_internal.h, C only): sets the thread's message.
extern "C" ebb_status ebb__fail(ebb_status status, const char *fmt, ...);

namespace {

// A stand-in for autograd's per-tensor state: which tensor it was made for, and how it came.
struct FakeState {
  std::string origin;  // "root" or the view call that made it
  FakeState *base;
};
std::atomic<int> g_released{0}, g_viewed{0};
std::vector<std::string> g_view_calls;
bool g_fail_views = false;

void fake_released(ebb_tensor_t *t, void *slot) {
  (void)t;
  g_released++;
  delete static_cast<FakeState *>(slot);
}

ebb_status fake_viewed(const ebb_tensor_t *base, ebb_tensor_t *view, const char *fn) {
  g_viewed++;
  g_view_calls.emplace_back(fn);
  if (g_fail_views) return ebb__fail(EBB_ENOMEM, "no host memory for the view's history (test)");
  ebb__tensor_set_slot(view, new FakeState{fn, static_cast<FakeState *>(ebb__tensor_slot(base))});
  return EBB_OK;
}

const ebb__tensor_hooks g_hooks = {fake_released, fake_viewed};

struct HooksInstalled {
  HooksInstalled() {
    g_released = 0;
    g_viewed = 0;
    g_view_calls.clear();
    g_fail_views = false;
    ebb__tensor_hooks_set(&g_hooks);
  }
  ~HooksInstalled() { ebb__tensor_hooks_set(nullptr); }
};

}  // namespace

TEST_CASE("lifecycle hooks: views of a tensor with state get the base's history, releases free it",
          "[ops][tensor][lifecycle]") {
  EbbSession session;
  HooksInstalled hooks;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    g_released = 0;
    g_viewed = 0;
    g_view_calls.clear();
    const int64_t shape[3] = {2, 3, 4};
    Tensor t, plain;
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 3, shape, t.out()));
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 3, shape, plain.out()));
    auto *root = new FakeState{"root", nullptr};
    ebb__tensor_set_slot(t, root);
    const int64_t flat[1] = {24}, big[4] = {5, 2, 3, 4};
    const int perm[3] = {2, 0, 1};
    std::vector<Tensor> views(10);
    EBB_REQUIRE_OK(ebb_tensor_view(t, 1, flat, views[0].out()));
    EBB_REQUIRE_OK(ebb_tensor_reshape(t, 1, flat, views[1].out()));
    EBB_REQUIRE_OK(ebb_tensor_transpose(t, 0, 2, views[2].out()));
    EBB_REQUIRE_OK(ebb_tensor_permute(t, perm, 3, views[3].out()));
    EBB_REQUIRE_OK(ebb_tensor_slice(t, 2, 0, 4, 2, views[4].out()));
    EBB_REQUIRE_OK(ebb_tensor_narrow(t, 1, 1, 2, views[5].out()));
    EBB_REQUIRE_OK(ebb_tensor_select(t, 0, 1, views[6].out()));
    EBB_REQUIRE_OK(ebb_tensor_expand(t, 4, big, views[7].out()));
    EBB_REQUIRE_OK(ebb_tensor_unsqueeze(t, 0, views[8].out()));
    EBB_REQUIRE_OK(ebb_tensor_squeeze(views[8], 0, views[9].out()));  // a view of a view
    const char *want[] = {"ebb_tensor_view",   "ebb_tensor_reshape", "ebb_tensor_transpose", "ebb_tensor_permute",
                          "ebb_tensor_slice",  "ebb_tensor_narrow",  "ebb_tensor_select",    "ebb_tensor_expand",
                          "ebb_tensor_unsqueeze", "ebb_tensor_squeeze"};
    REQUIRE(g_view_calls.size() == 10);
    for (int i = 0; i < 10; i++) {
      CHECK(g_view_calls[i] == want[i]);
      auto *st = static_cast<FakeState *>(ebb__tensor_slot(views[i]));
      REQUIRE(st != nullptr);
      CHECK(st->origin == want[i]);
      CHECK(st->base == (i == 9 ? static_cast<FakeState *>(ebb__tensor_slot(views[8])) : root));
    }
    // A tensor without state costs nothing: its views run no hook.
    Tensor pv;
    EBB_REQUIRE_OK(ebb_tensor_view(plain, 1, flat, pv.out()));
    CHECK(g_viewed.load() == 10);
    CHECK(ebb__tensor_slot(pv) == nullptr);
    // Releases: a retained handle frees its state at its last release only.
    EBB_REQUIRE_OK(ebb_tensor_retain(t));
    EBB_REQUIRE_OK(ebb_tensor_release(t));
    CHECK(g_released.load() == 0);
    views.clear();
    CHECK(g_released.load() == 10);
    t.reset();
    CHECK(g_released.load() == 11);
    pv.reset();
    plain.reset();
    CHECK(g_released.load() == 11);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("lifecycle hooks: a failing view hook fails the view call, naming it, and leaks nothing",
          "[ops][tensor][lifecycle][errors]") {
  EbbSession session;
  HooksInstalled hooks;
  const int64_t shape[2] = {4, 4};
  Tensor t;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 2, shape, t.out()));
  ebb__tensor_set_slot(t, new FakeState{"root", nullptr});
  g_fail_views = true;
  ebb_tensor_t *v = nullptr;
  EBB_CHECK_FAILS(ebb_tensor_transpose(t, 0, 1, &v), EBB_ENOMEM, "ebb_tensor_transpose: no host memory for the view's history");
  CHECK(v == nullptr);
  CHECK(ebb_tensor_live_count() == 1);
  g_fail_views = false;
  t.reset();
  CHECK(g_released.load() == 1);
  REQUIRE(ebb_debug_live_handles() == 0);
}
