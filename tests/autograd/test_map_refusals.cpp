// ebb_map's refusals: bad arguments (NULLs, counts, a released tensor, a 0-d x, leading dims
// that differ, zero slices, an options version from the future) and an fn that misbehaves (an
// output left NULL, a shape or dtype that changes between slices or between the forward and a
// checkpointed backward's run, its own failure). Each is a status and a message naming ebb_map,
// the argument and what was expected; nothing is returned and nothing is left alive.
#include <string>
#include <vector>

#include "map_test_util.hpp"

using namespace ebb_test;

namespace {

ebb_status copy_fn(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *, int, ebb_tensor_t **outs, int, void *) {
  return ebb_tensor_clone(xs[0], &outs[0]);
}

// What bad_fn does wrong, and at which call (counting from 0, forward and backward runs alike).
struct Bad {
  enum Kind { SHAPE, DTYPE, NULL_OUT, FAIL_MSG, FAIL_SILENT } kind;
  int at;
  int calls = 0;
};

ebb_status bad_fn(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *, int, ebb_tensor_t **outs, int, void *user) {
  auto *b = static_cast<Bad *>(user);
  bool now = b->calls++ == b->at;
  if (!now) return ebb_op_mul_scalar(xs[0], 3.0, &outs[0]);
  switch (b->kind) {
  case Bad::SHAPE: {
    ebb_tensor_t *v = nullptr;
    ebb_status st = ebb_tensor_narrow(xs[0], 0, 0, 1, &v);
    if (!st) st = ebb_op_mul_scalar(v, 3.0, &outs[0]);
    if (v) ebb_tensor_release(v);
    return st;
  }
  case Bad::DTYPE: return ebb_tensor_to_dtype(xs[0], EBB_F32, &outs[0]);
  case Bad::NULL_OUT: return EBB_OK;
  case Bad::FAIL_MSG: {
    // a failing call of fn's own, whose message the map keeps; and an output made before it
    ebb_status st = ebb_op_mul_scalar(xs[0], 3.0, &outs[0]);
    if (st) return st;
    ebb_tensor_t *never = nullptr;
    return ebb_tensor_select(xs[0], 5, 0, &never); /* dim 5 of a 2-d slice */
  }
  case Bad::FAIL_SILENT: return EBB_EINTERNAL;
  }
  return EBB_OK;
}

}  // namespace

TEST_CASE("map refusals: NULLs, counts, released and 0-d tensors, leading dims, zero slices, options version",
          "[autograd][map][refusals]") {
  EbbSession session;
  Live live;
  {
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2}, 1, true), y = input_on(EBB_DEVICE_CPU, {4, 2}, 2, true);
    Tensor s = make(EBB_DEVICE_CPU, EBB_F64, {}, {1.0}), e = make(EBB_DEVICE_CPU, EBB_F64, {0, 2}, {});
    const ebb_tensor_t *xs[2] = {x.get(), x.get()}, *args[1] = {x.get()};
    ebb_tensor_t *out[1] = {nullptr};
    auto map = [&](ebb_map_fn fn, const ebb_tensor_t *const *xv, int nxs, const ebb_tensor_t *const *av, int nargs,
                   const ebb_map_options *o, ebb_tensor_t **ov, int nouts) {
      return ebb_map(fn, nullptr, xv, nxs, av, nargs, o, ov, nouts);
    };
    EBB_CHECK_MSG(map(nullptr, xs, 1, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "ebb_map: fn is NULL");
    EBB_CHECK_MSG(map(copy_fn, nullptr, 1, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "ebb_map: xs is NULL");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, 0, nullptr, nullptr, 1), EBB_EINVAL, "ebb_map: outputs is NULL");
    EBB_CHECK_MSG(map(copy_fn, xs, 0, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "ebb_map: nxs is 0", "at least 1");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, -1, nullptr, out, 1), EBB_EINVAL, "ebb_map: nargs is -1");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, 1, nullptr, out, 1), EBB_EINVAL, "ebb_map: args is NULL with nargs 1");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, 0, nullptr, out, 0), EBB_EINVAL, "ebb_map: noutputs is 0", "1..64");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, 0, nullptr, out, 65), EBB_EINVAL, "ebb_map: noutputs is 65");
    EBB_CHECK_MSG(map(copy_fn, xs, 40, args, 30, nullptr, out, 1), EBB_EINVAL, "ebb_map: nxs + nargs is 40 + 30", "at most 64");
    const ebb_tensor_t *with_null[2] = {x.get(), nullptr};
    EBB_CHECK_MSG(map(copy_fn, with_null, 2, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "ebb_map: xs[1] is NULL");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, with_null + 1, 1, nullptr, out, 1), EBB_EINVAL, "ebb_map: args[0] is NULL");
    // a 0-d x: nothing to map over
    const ebb_tensor_t *scalar[1] = {s.get()};
    EBB_CHECK_MSG(map(copy_fn, scalar, 1, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "ebb_map: xs[0] (f64[] on the CPU) has 0 dimensions",
                  "expected a tensor with a dim 0");
    // leading dims 3 and 4: both tensors named
    const ebb_tensor_t *differ[2] = {x.get(), y.get()};
    EBB_CHECK_MSG(map(copy_fn, differ, 2, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "xs[0] (f64[3, 2] on the CPU)",
                  "xs[1] (f64[4, 2] on the CPU)", "different leading dims (3, 4)", "expected the same number of slices");
    // zero slices
    const ebb_tensor_t *empty[1] = {e.get()};
    EBB_CHECK_MSG(map(copy_fn, empty, 1, nullptr, 0, nullptr, out, 1), EBB_EINVAL, "xs[0] (f64[0, 2] on the CPU) has a leading dim of 0",
                  "expected at least one slice");
    // an options version from the future
    ebb_map_options future = {};
    future.version = EBB_MAP_OPTIONS_VERSION + 1;
    EBB_CHECK_MSG(map(copy_fn, xs, 1, nullptr, 0, &future, out, 1), EBB_ENOTSUP, "ebb_map: opts->version is 2");
    // a released tensor, among xs and among args
    ebb_tensor_t *gone = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_clone(x, &gone));
    EBB_REQUIRE_OK(ebb_tensor_release(gone));
    const ebb_tensor_t *released[1] = {gone};
    EBB_CHECK_MSG(map(copy_fn, released, 1, nullptr, 0, nullptr, out, 1), EBB_EFREED, "ebb_map: xs[0]");
    EBB_CHECK_MSG(map(copy_fn, xs, 1, released, 1, nullptr, out, 1), EBB_EFREED, "ebb_map: args[0]");
    CHECK(out[0] == nullptr);
    // version 0 and the current one are the defaults
    ebb_map_options v1 = {};
    v1.version = EBB_MAP_OPTIONS_VERSION;
    EBB_REQUIRE_OK(map(copy_fn, xs, 1, nullptr, 0, &v1, out, 1));
    ebb_tensor_release(out[0]);
  }
  live.check();
}

TEST_CASE("map refusals: fn's outputs must keep slice 0's shape, dtype and count, and fn's own failure is kept",
          "[autograd][map][refusals][fn]") {
  EbbSession session;
  Live live;
  for (bool requires_grad : {false, true}) {
    for (bool checkpoint : {false, true}) {
      INFO("requires_grad " << requires_grad << ", checkpoint " << checkpoint);
      Tensor x = input_on(EBB_DEVICE_CPU, {4, 2, 3}, 7, requires_grad);
      const ebb_tensor_t *xs[1] = {x.get()};
      ebb_map_options o = {};
      o.checkpoint = checkpoint;
      ebb_tensor_t *out[1] = {nullptr};
      Bad shape{Bad::SHAPE, 2};
      EBB_CHECK_MSG(ebb_map(bad_fn, &shape, xs, 1, nullptr, 0, &o, out, 1), EBB_EINVAL, "ebb_map: fn gave outputs[0] (f64[1, 3] on the CPU) at slice 2",
                    "slice 0 gave f64[2, 3] on the CPU", "expected the same shape, dtype and device from every slice");
      CHECK(out[0] == nullptr);
      Bad dtype{Bad::DTYPE, 1};
      EBB_CHECK_MSG(ebb_map(bad_fn, &dtype, xs, 1, nullptr, 0, &o, out, 1), EBB_EINVAL, "outputs[0] (f32[2, 3] on the CPU) at slice 1");
      Bad null_out{Bad::NULL_OUT, 3};
      EBB_CHECK_MSG(ebb_map(bad_fn, &null_out, xs, 1, nullptr, 0, &o, out, 1), EBB_EINVAL, "ebb_map: fn left outputs[0] NULL at slice 3");
      Bad fails{Bad::FAIL_MSG, 1};
      EBB_CHECK_MSG(ebb_map(bad_fn, &fails, xs, 1, nullptr, 0, &o, out, 1), EBB_EINVAL, "ebb_map: fn failed at slice 1: ebb_tensor_select");
      Bad silent{Bad::FAIL_SILENT, 0};
      EBB_CHECK_MSG(ebb_map(bad_fn, &silent, xs, 1, nullptr, 0, &o, out, 1), EBB_EINTERNAL, "ebb_map: fn failed at slice 0",
                    "with no message of its own");
      CHECK(out[0] == nullptr);
    }
  }
  live.check();
}

TEST_CASE("map refusals: a checkpointed slice that comes out differently in the backward fails the backward, naming it",
          "[autograd][map][refusals][checkpoint]") {
  EbbSession session;
  Live live;
  {
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2, 3}, 8, true);
    const ebb_tensor_t *xs[1] = {x.get()};
    ebb_map_options o = {};
    o.checkpoint = true;
    // calls 0..2 are the forward; the backward runs slice 2 first (call 3), then slice 1 (call 4)
    for (Bad::Kind kind : {Bad::SHAPE, Bad::FAIL_MSG}) {
      Bad b{kind, 4};
      ebb_tensor_t *out[1] = {nullptr};
      EBB_REQUIRE_OK(ebb_map(bad_fn, &b, xs, 1, nullptr, 0, &o, out, 1));
      Tensor y(out[0]);
      Tensor l = sum_of(y);
      if (kind == Bad::SHAPE)
        EBB_CHECK_MSG(ebb_backward_one(l), EBB_EINVAL, "MapBackward", "ebb_map: fn gave outputs[0] (f64[1, 3] on the CPU) at slice 1 (run again in the backward)");
      else
        EBB_CHECK_MSG(ebb_backward_one(l), EBB_EINVAL, "MapBackward", "ebb_map: fn failed at slice 1 (run again in the backward): ebb_tensor_select");
  }
  // a saved x changed in place before the backward: the node's saved-tensor check refuses it
  Tensor xc = input_on(EBB_DEVICE_CPU, {3, 2, 3}, 9, false), w = input_on(EBB_DEVICE_CPU, {3}, 10, true);
  const ebb_tensor_t *xs2[1] = {xc.get()}, *args[1] = {w.get()};
  auto mul_fn = [](const ebb_tensor_t *const *xv, int, const ebb_tensor_t *const *av, int, ebb_tensor_t **ov, int, void *) {
    return ebb_op_mul(xv[0], av[0], &ov[0]);
  };
  ebb_tensor_t *out[1] = {nullptr};
  EBB_REQUIRE_OK(ebb_map(mul_fn, nullptr, xs2, 1, args, 1, &o, out, 1));
  Tensor y(out[0]);
  Tensor l = sum_of(y);
  EBB_REQUIRE_OK(ebb_tensor_fill_(xc, 0.0));
  EBB_CHECK_MSG(ebb_backward_one(l), EBB_ESTATE, "MapBackward");
  }
  live.check();
}
