// What autograd needs from ops, tested without autograd: ebb_tensor_record_stream (public), and
// the lifecycle hooks of ops_export.h (white-box: a fake "autograd" installs them), which free a
// slot's state when its handle dies and let a view take its base's history.
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>
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
  // late_read_fn reads device memory on the host: only the emulated driver's is host-addressable.
  if (!ebb_test_emulated()) EBB_SKIP("a host function reads device memory, which only the emulated driver allows");
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
  EBB_NEED_DEVICES(2);
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
  EBB_CHECK_FAILS(ebb_tensor_record_stream(d, s1), EBB_EDEVICE, "is on device 1 but t (f32[16] on device 0) is not");
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

// The library's failure helper (runtime/export/ebb_internal.h, C only): sets the thread's message.
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

const ebb__tensor_hooks g_hooks = {fake_released, fake_viewed, nullptr, nullptr, nullptr};

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

// ---- recording: every public op with a derivative-table entry reports itself once -----------

namespace {

struct Rec {
  int op;
  int nin, nout;
  ebb__op_args args;
};
std::vector<Rec> g_recs;
bool g_fail_record = false;

ebb_status fake_recorded(int op, const ebb_tensor_t *const *in, int nin, ebb_tensor_t *const *out, int nout,
                         const ebb__op_args *args) {
  (void)in;
  (void)out;
  g_recs.push_back({op, nin, nout, *args});
  if (g_fail_record) return ebb__fail(EBB_ENOMEM, "no host memory for the node (test)");
  return EBB_OK;
}

int g_inplace_calls = 0;
struct InplaceRec {
  int op;
  int nsrc;
  double s0;  // args->s[0], NaN without args
};
std::vector<InplaceRec> g_inplace;
ebb_status fake_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const ebb__op_args *args, void **token) {
  (void)dst;
  (void)src;
  (void)token;
  g_inplace_calls++;
  g_inplace.push_back({op, nsrc, args ? args->s[0] : NAN});
  return op == EBB__OP_MUL_ ? ebb__fail(EBB_ENOTSUP, "refused by the test") : EBB_OK;
}

const ebb__tensor_hooks g_rec_hooks = {nullptr, nullptr, fake_recorded, fake_inplace, nullptr};

struct RecordingInstalled {
  RecordingInstalled() {
    g_recs.clear();
    g_fail_record = false;
    ebb__tensor_hooks_set(&g_rec_hooks);
  }
  ~RecordingInstalled() { ebb__tensor_hooks_set(nullptr); }
};

}  // namespace

TEST_CASE("recording: each public op with state on an input reports its table entry once, with normalised args",
          "[ops][lifecycle][record]") {
  EbbSession session;
  RecordingInstalled rec;
  int marker = 0;  // any non-NULL slot: this fake has no state to free (no released hook)
  const int64_t s23[2] = {2, 3};
  Tensor x, y, plain, tgt;
  EBB_REQUIRE_OK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F64, 2, s23, 1, 0, x.out()));
  EBB_REQUIRE_OK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F64, 2, s23, 2, 0, y.out()));
  EBB_REQUIRE_OK(ebb_tensor_rand(EBB_DEVICE_CPU, EBB_F64, 2, s23, 3, 0, plain.out()));
  const int64_t two = 2;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_I64, 1, &two, tgt.out()));
  ebb__tensor_set_slot(x, &marker);
  // Views with state of their own: a strided one for contiguous (which copies only such a
  // tensor), one with a dim of extent 1 for squeeze.
  Tensor xt, xu;
  EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, xt.out()));
  EBB_REQUIRE_OK(ebb_tensor_unsqueeze(x, 0, xu.out()));
  ebb__tensor_set_slot(xt, &marker);
  ebb__tensor_set_slot(xu, &marker);
  // Every op the test saw reported (to the recorded or the inplace hook), for the check at the
  // end that the table leaves no op of the derivative table out.
  std::set<int> seen;
  struct Call {
    ebb__op_id op;
    std::function<ebb_status(ebb_tensor_t **)> f;
  };
  const int d1[1] = {-1}, perm[2] = {1, 0};
  const int64_t flat[1] = {6}, big[3] = {4, 2, 3};
  const ebb_tensor_t *pair[2] = {x.get(), y.get()};
  std::vector<Call> calls = {
      {EBB__OP_ADD, [&](ebb_tensor_t **o) { return ebb_op_add(plain, x, o); }},
      {EBB__OP_SUB, [&](ebb_tensor_t **o) { return ebb_op_sub(x, y, o); }},
      {EBB__OP_MUL, [&](ebb_tensor_t **o) { return ebb_op_mul(x, y, o); }},
      {EBB__OP_DIV, [&](ebb_tensor_t **o) { return ebb_op_div(x, y, o); }},
      {EBB__OP_ADD_SCALAR, [&](ebb_tensor_t **o) { return ebb_op_add_scalar(x, 2.0, o); }},
      {EBB__OP_SUB_SCALAR, [&](ebb_tensor_t **o) { return ebb_op_sub_scalar(x, 2.0, o); }},
      {EBB__OP_MUL_SCALAR, [&](ebb_tensor_t **o) { return ebb_op_mul_scalar(x, 2.0, o); }},
      {EBB__OP_DIV_SCALAR, [&](ebb_tensor_t **o) { return ebb_op_div_scalar(x, 2.0, o); }},
      {EBB__OP_POW_SCALAR, [&](ebb_tensor_t **o) { return ebb_op_pow_scalar(x, 2.0, o); }},
      {EBB__OP_CLAMP, [&](ebb_tensor_t **o) { return ebb_op_clamp(x, 0.1, 0.5, o); }},
      {EBB__OP_NEG, [&](ebb_tensor_t **o) { return ebb_op_neg(x, o); }},
      {EBB__OP_ABS, [&](ebb_tensor_t **o) { return ebb_op_abs(x, o); }},
      {EBB__OP_EXP, [&](ebb_tensor_t **o) { return ebb_op_exp(x, o); }},
      {EBB__OP_LOG, [&](ebb_tensor_t **o) { return ebb_op_log(x, o); }},
      {EBB__OP_SQRT, [&](ebb_tensor_t **o) { return ebb_op_sqrt(x, o); }},
      {EBB__OP_SIN, [&](ebb_tensor_t **o) { return ebb_op_sin(x, o); }},
      {EBB__OP_COS, [&](ebb_tensor_t **o) { return ebb_op_cos(x, o); }},
      {EBB__OP_TANH, [&](ebb_tensor_t **o) { return ebb_op_tanh(x, o); }},
      {EBB__OP_SIGMOID, [&](ebb_tensor_t **o) { return ebb_op_sigmoid(x, o); }},
      {EBB__OP_RELU, [&](ebb_tensor_t **o) { return ebb_op_relu(x, o); }},
      {EBB__OP_GELU, [&](ebb_tensor_t **o) { return ebb_op_gelu(x, o); }},
      {EBB__OP_WHERE, [&](ebb_tensor_t **o) {
         Tensor c;
         ebb_status st = ebb_op_gt(plain, y, c.out());
         return st ? st : ebb_op_where(c, x, y, o);
       }},
      {EBB__OP_SUM, [&](ebb_tensor_t **o) { return ebb_op_sum(x, d1, 1, false, o); }},
      {EBB__OP_MEAN, [&](ebb_tensor_t **o) { return ebb_op_mean(x, nullptr, 0, false, o); }},
      {EBB__OP_AMAX, [&](ebb_tensor_t **o) { return ebb_op_amax(x, d1, 1, true, o); }},
      {EBB__OP_MAX_DIM, [&](ebb_tensor_t **o) {
         Tensor idx;
         return ebb_op_max_dim(x, -1, false, o, idx.out());
       }},
      {EBB__OP_MATMUL, [&](ebb_tensor_t **o) {
         Tensor t;
         ebb_status st = ebb_tensor_transpose(plain, 0, 1, t.out());
         return st ? st : ebb_op_matmul(x, t, o);
       }},
      {EBB__OP_LINEAR, [&](ebb_tensor_t **o) { return ebb_op_linear(plain, x, nullptr, o); }},
      {EBB__OP_SOFTMAX, [&](ebb_tensor_t **o) { return ebb_op_softmax(x, -1, o); }},
      {EBB__OP_LOG_SOFTMAX, [&](ebb_tensor_t **o) { return ebb_op_log_softmax(x, 0, o); }},
      {EBB__OP_CROSS_ENTROPY, [&](ebb_tensor_t **o) { return ebb_op_cross_entropy(x, tgt, o); }},
      {EBB__OP_MSE_LOSS, [&](ebb_tensor_t **o) { return ebb_op_mse_loss(x, y, o); }},
      {EBB__OP_LAYER_NORM, [&](ebb_tensor_t **o) { return ebb_op_layer_norm(x, 1, nullptr, nullptr, 1e-5, o); }},
      {EBB__OP_CAT, [&](ebb_tensor_t **o) { return ebb_op_cat(pair, 2, -1, o); }},
      {EBB__OP_STACK, [&](ebb_tensor_t **o) { return ebb_op_stack(pair, 2, -1, o); }},
      {EBB__OP_VIEW, [&](ebb_tensor_t **o) { return ebb_tensor_view(x, 1, flat, o); }},
      {EBB__OP_RESHAPE, [&](ebb_tensor_t **o) { return ebb_tensor_reshape(x, 1, flat, o); }},
      {EBB__OP_TRANSPOSE, [&](ebb_tensor_t **o) { return ebb_tensor_transpose(x, -1, 0, o); }},
      {EBB__OP_PERMUTE, [&](ebb_tensor_t **o) { return ebb_tensor_permute(x, perm, 2, o); }},
      {EBB__OP_SLICE, [&](ebb_tensor_t **o) { return ebb_tensor_slice(x, -1, -2, 100, 1, o); }},
      {EBB__OP_NARROW, [&](ebb_tensor_t **o) { return ebb_tensor_narrow(x, 1, 1, 2, o); }},
      {EBB__OP_SELECT, [&](ebb_tensor_t **o) { return ebb_tensor_select(x, 0, -1, o); }},
      {EBB__OP_EXPAND, [&](ebb_tensor_t **o) { return ebb_tensor_expand(x, 3, big, o); }},
      {EBB__OP_SQUEEZE, [&](ebb_tensor_t **o) { return ebb_tensor_squeeze(xu, 0, o); }},
      {EBB__OP_UNSQUEEZE, [&](ebb_tensor_t **o) { return ebb_tensor_unsqueeze(x, 0, o); }},
      {EBB__OP_CONTIGUOUS, [&](ebb_tensor_t **o) { return ebb_tensor_contiguous(xt, o); }},
      {EBB__OP_CLONE, [&](ebb_tensor_t **o) { return ebb_tensor_clone(x, o); }},
      {EBB__OP_TO_DEVICE, [&](ebb_tensor_t **o) { return ebb_tensor_to_device(x, 0, o); }},
      {EBB__OP_TO_DTYPE, [&](ebb_tensor_t **o) { return ebb_tensor_to_dtype(x, EBB_F32, o); }},
  };
  for (auto &c : calls) {
    const ebb__deriv *e = ebb__deriv_of(c.op);
    INFO(e->forward);
    g_recs.clear();
    Tensor out;
    EBB_REQUIRE_OK(c.f(out.out()));
    // Exactly one record, the call's own: composites (softmax, cross_entropy, layer_norm, ...)
    // make inner calls on the same inputs, which record nothing.
    REQUIRE(g_recs.size() == 1);
    CHECK(g_recs[0].op == c.op);
    CHECK(g_recs[0].nout == e->nout);
    if (e->nin > 0) CHECK(g_recs[0].nin == e->nin);
    seen.insert(g_recs[0].op);
  }
  auto args_of = [&](std::function<ebb_status(ebb_tensor_t **)> f) {
    g_recs.clear();
    Tensor out;
    REQUIRE(f(out.out()) == EBB_OK);
    REQUIRE(g_recs.size() == 1);
    return g_recs[0].args;
  };
  // Arguments as the table documents them: dims normalised, slice bounds clamped.
  ebb__op_args a = args_of([&](ebb_tensor_t **o) { return ebb_op_sum(x, d1, 1, false, o); });
  CHECK((a.ndims == 1 && a.dims[0] == 1 && !a.keepdim));
  a = args_of([&](ebb_tensor_t **o) { return ebb_op_mean(x, nullptr, 0, true, o); });
  CHECK((a.ndims == 0 && a.keepdim));
  a = args_of([&](ebb_tensor_t **o) { return ebb_tensor_slice(x, -1, -2, 100, 1, o); });
  CHECK((a.dim == 1 && a.start == 1 && a.end == 3 && a.step == 1));
  a = args_of([&](ebb_tensor_t **o) { return ebb_tensor_select(x, 0, -1, o); });
  CHECK((a.dim == 0 && a.start == 1));
  a = args_of([&](ebb_tensor_t **o) { return ebb_tensor_transpose(x, -1, 0, o); });
  CHECK((a.dim == 1 && a.dim1 == 0));
  a = args_of([&](ebb_tensor_t **o) { return ebb_op_clamp(x, 0.1, 0.5, o); });
  CHECK((a.s[0] == 0.1 && a.s[1] == 0.5));
  a = args_of([&](ebb_tensor_t **o) { return ebb_op_softmax(x, -1, o); });
  CHECK(a.dim == 1);
  // max_dim: two outputs, the values and the indices.
  {
    g_recs.clear();
    Tensor v, i;
    EBB_REQUIRE_OK(ebb_op_max_dim(x, -1, false, v.out(), i.out()));
    REQUIRE(g_recs.size() == 1);
    CHECK((g_recs[0].op == EBB__OP_MAX_DIM && g_recs[0].nout == 2 && g_recs[0].args.dim == 1));
  }
  // No state on any input: nothing recorded; contiguous of a contiguous tensor is the tensor
  // itself: nothing recorded either.
  g_recs.clear();
  {
    Tensor o1, o2;
    EBB_REQUIRE_OK(ebb_op_mul(plain, y, o1.out()));
    EBB_REQUIRE_OK(ebb_tensor_contiguous(x, o2.out()));
    CHECK(o2.get() == x.get());
  }
  CHECK(g_recs.empty());
  // A failing hook fails the call, naming it, and leaves no output behind.
  g_fail_record = true;
  long live = ebb_tensor_live_count();
  ebb_tensor_t *o = nullptr;
  EBB_CHECK_FAILS(ebb_op_exp(x, &o), EBB_ENOMEM, "ebb_op_exp: no host memory for the node (test)");
  CHECK(o == nullptr);
  CHECK(ebb_tensor_live_count() == live);
  g_fail_record = false;
  // In-place ops ask the inplace hook first when dst or src has state; a refusal changes nothing.
  {
    Tensor d;
    EBB_REQUIRE_OK(ebb_tensor_clone(plain, d.out()));
    auto before = read(d);
    g_inplace_calls = 0;
    g_inplace.clear();
    EBB_CHECK_FAILS(ebb_op_mul_(d, x), EBB_ENOTSUP, "ebb_op_mul_: refused by the test");
    CHECK(read(d) == before);
    EBB_REQUIRE_OK(ebb_op_add_(d, x));      // asked, allowed
    EBB_REQUIRE_OK(ebb_op_add_(d, plain));  // no state: not asked
    EBB_REQUIRE_OK(ebb_tensor_copy_(d, x));
    EBB_REQUIRE_OK(ebb_tensor_fill_(x, 1.0));
    CHECK(g_inplace_calls == 4);
    REQUIRE(g_inplace.size() == 4);
    const int asked[4] = {EBB__OP_MUL_, EBB__OP_ADD_, EBB__OP_COPY_, EBB__OP_FILL_};
    for (int i = 0; i < 4; i++) {
      CHECK(g_inplace[i].op == asked[i]);
      seen.insert(g_inplace[i].op);
    }
    // The in-place family: the hook gets the op's table entry, its other inputs and its scalar.
    struct InplaceCall {
      ebb__op_id op;
      int nsrc;
      double s0;
      std::function<ebb_status()> f;
    };
    const std::vector<InplaceCall> family = {
        {EBB__OP_ADD_SCALED_, 1, -0.5, [&] { return ebb_op_add_scaled_(d, x, -0.5); }},
        {EBB__OP_ADD_SCALAR_, 0, 2.0, [&] { return ebb_op_add_scalar_(x, 2.0); }},
        {EBB__OP_MUL_SCALAR_, 0, 3.0, [&] { return ebb_op_mul_scalar_(x, 3.0); }},
        {EBB__OP_LERP_, 1, 0.25, [&] { return ebb_op_lerp_(d, x, 0.25); }},
        {EBB__OP_ADDCMUL_, 2, 0.5, [&] { return ebb_op_addcmul_(d, plain, x, 0.5); }},
        {EBB__OP_ADDCDIV_, 2, 0.75, [&] { return ebb_op_addcdiv_(d, x, plain, 0.75); }},
        {EBB__OP_SQRT_, 0, NAN, [&] { return ebb_op_sqrt_(x); }},
        {EBB__OP_ZERO_, 0, NAN, [&] { return ebb_op_zero_(x); }},
    };
    for (const auto &c : family) {
      INFO(ebb__deriv_of(c.op)->forward);
      g_inplace.clear();
      EBB_REQUIRE_OK(c.f());
      REQUIRE(g_inplace.size() == 1);
      CHECK(g_inplace[0].op == c.op);
      CHECK(g_inplace[0].nsrc == c.nsrc);
      CHECK(g_inplace[0].nsrc == ebb__deriv_of(c.op)->nin - 1);
      if (std::isnan(c.s0)) CHECK(std::isnan(g_inplace[0].s0));
      else CHECK(g_inplace[0].s0 == c.s0);
      seen.insert(g_inplace[0].op);
    }
    // A src with state on a dst without any: asked too (addcmul_'s t2 is x).
    g_inplace.clear();
    Tensor e;
    EBB_REQUIRE_OK(ebb_tensor_clone(plain, e.out()));
    EBB_REQUIRE_OK(ebb_op_addcmul_(e, plain, x, 1.0));
    CHECK(g_inplace.size() == 1);
    EBB_REQUIRE_OK(ebb_op_addcmul_(e, plain, plain, 1.0));  // no state anywhere: not asked
    CHECK(g_inplace.size() == 1);
  }
  // Every entry of the derivative table has a row above (calls, the in-place checks), so an op
  // added without one fails here (docs/architecture.md, "Where to add an op", step 6). Only
  // autograd's own nodes for in-place ops on views are never reported by an ops call.
  const std::set<int> autograd_own = {EBB__OP_AS_STRIDED, EBB__OP_COPY_SLICES};
  for (int op = 0; op < EBB__OP_COUNT; op++) {
    if (autograd_own.count(op)) continue;
    INFO("op " << op << " (" << ebb__deriv_of((ebb__op_id)op)->forward
               << ") has no row in this test's recording table: add its call to `calls` (or, in place, to the inplace checks)");
    CHECK(seen.count(op) == 1);
  }
  ebb__tensor_set_slot(x, nullptr);
  ebb__tensor_set_slot(xt, nullptr);
  ebb__tensor_set_slot(xu, nullptr);
  xt.reset();
  xu.reset();
  x.reset();
  y.reset();
  plain.reset();
  tgt.reset();
  REQUIRE(ebb_debug_live_handles() == 0);
}
