// The derivative table (ops_export.h, white-box): every entry's backward, called as autograd will
// call it (the inputs' metadata, only the tensors the entry says it saves, the wanted inputs),
// against central finite differences of its forward, on the CPU and a device; and the table's
// own shape: every operation has an entry, names are unique, saves and gradients are declared;
// and autograd.h's list of recorded calls against the table.
#include <cctype>
#include <deque>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gradcheck.hpp"
#include "ops_export.h"  // the derivative table, internal

using namespace ebb_test;

namespace {

int g_unasked = 0;

struct Case {
  ebb__op_id op;
  std::vector<GcInput> in;
  ebb__op_args args;
  GcForward fwd;
};

GcInput inp(std::vector<int64_t> shape, unsigned seed, double lo = -1.0, double hi = 1.0) {
  return GcInput{shape, values(numel_of(shape), seed, lo, hi)};
}
GcInput fixed(std::vector<int64_t> shape, std::vector<double> v, ebb_dtype dt) { return GcInput{shape, v, dt, false}; }

ebb__op_args args_none() { return ebb__op_args{}; }

// The backward through the table: metadata of every input, the saved tensors per the entry's
// mask (max_dim's indices recomputed from its forward), need = the differentiable inputs.
// With give_grad, the backward gets a copy of grad that it may use for its result (the engine's
// lean path: go_mine), as the engine gives a buffer it holds alone.
GcBackward through_table(const Case &c, bool give_grad = false) {
  return [c, give_grad](const ebb_tensor_t *grad, const GcInputs &in, const ebb_tensor_t *out, std::vector<ebb_tensor_t *> &grads) {
    const ebb__deriv *e = ebb__deriv_of(c.op);
    const int n = static_cast<int>(in.size());
    // CopySlices saves what its in-place op saves (as autograd's inplace hook does)
    const unsigned save = c.op == EBB__OP_COPY_SLICES ? ebb__deriv_of(static_cast<ebb__op_id>(c.args.geom->inner_op))->save : e->save;
    std::vector<ebb__tensor_meta> meta(n);
    std::vector<const ebb_tensor_t *> saved_in(n, nullptr);
    for (int i = 0; i < n; i++) {
      ebb_tensor_info info;
      ebb_status st = ebb_tensor_get_info(in[i], &info);
      if (st) return st;
      meta[i].device = info.device;
      meta[i].dtype = info.dtype;
      meta[i].ndim = info.ndim;
      for (int d = 0; d < info.ndim; d++) meta[i].shape[d] = info.shape[d];
      if (i < 8 && (save & EBB__SAVE_IN(i))) saved_in[i] = in[i];
    }
    Tensor values, indices;
    const ebb_tensor_t *saved_out[2] = {nullptr, nullptr};
    if (e->save & EBB__SAVE_OUT(0)) saved_out[0] = out;
    if (c.op == EBB__OP_MAX_DIM) {
      ebb_status st = ebb_op_max_dim(in[0], c.args.dim, c.args.keepdim, values.out(), indices.out());
      if (st) return st;
      saved_out[1] = indices;
    }
    bool need[16];
    for (int i = 0; i < n; i++) need[i] = c.in[i].differentiable;
    const bool mine[2] = {give_grad, false};
    ebb__bw_ctx ctx{&c.args, meta.data(), saved_in.data(), saved_out, n, need, mine};
    Tensor own;
    if (give_grad) {
      ebb_status st = ebb_tensor_clone(grad, own.out());
      if (st) return st;
    }
    const ebb_tensor_t *go[2] = {give_grad ? own.get() : grad, nullptr};
    std::vector<ebb_tensor_t *> gin(n, nullptr);
    ebb_status st = e->backward(&ctx, go, gin.data());
    if (st) return st;
    for (int i = 0; i < n; i++) {
      if (!c.in[i].differentiable && gin[i]) {
        ebb_tensor_release(gin[i]);  // a gradient nobody asked for, for an input that has none
        g_unasked++;
        continue;
      }
      grads[i] = gin[i];
    }
    return EBB_OK;
  };
}

}  // namespace

namespace {

ebb__op_args with_dim(int d, int d1 = 0) {
  ebb__op_args a{};
  a.dim = d;
  a.dim1 = d1;
  return a;
}
ebb__op_args with_s(double s0, double s1 = 0) {
  ebb__op_args a{};
  a.s[0] = s0;
  a.s[1] = s1;
  return a;
}
ebb__op_args with_dims(std::vector<int> dims, bool keepdim) {
  ebb__op_args a{};
  for (size_t k = 0; k < dims.size(); k++) a.dims[k] = dims[k];
  a.ndims = static_cast<int>(dims.size());
  a.keepdim = keepdim;
  return a;
}
ebb__op_args with_slice(int dim, int64_t start, int64_t end, int64_t step) {
  ebb__op_args a{};
  a.dim = dim;
  a.start = start;
  a.end = end;
  a.step = step;
  return a;
}

// Views for autograd's view nodes: t -> a view of it (a new reference).
using ViewFn = ebb_status (*)(const ebb_tensor_t *, ebb_tensor_t **);
ebb_status slice_of_t(const ebb_tensor_t *t, ebb_tensor_t **out) {  // [3,4] -> [4,3] -> [4,2]
  Tensor tt;
  ebb_status st = ebb_tensor_transpose(t, 0, 1, tt.out());
  return st ? st : ebb_tensor_slice(tt, 1, 1, 3, 1, out);
}
ebb_status expanded(const ebb_tensor_t *t, ebb_tensor_t **out) {  // [3] -> [1,3] -> [2,3]
  Tensor u;
  const int64_t shape[2] = {2, 3};
  ebb_status st = ebb_tensor_unsqueeze(t, 0, u.out());
  return st ? st : ebb_tensor_expand(u, 2, shape, out);
}
ebb_status row_part(const ebb_tensor_t *t, ebb_tensor_t **out) {  // [3,4] -> row 1 -> [2] at 1
  Tensor r;
  ebb_status st = ebb_tensor_select(t, 0, 1, r.out());
  return st ? st : ebb_tensor_slice(r, 0, 1, 3, 1, out);
}
// The view's values, copied out (a forward whose gradient is AsStridedBackward's).
ebb_status through_view(const ebb_tensor_t *t, ViewFn view, ebb_tensor_t **out) {
  Tensor v;
  ebb_status st = view(t, v.out());
  return st ? st : ebb_tensor_clone(v, out);
}
// An in-place op on a view of d.
ebb_status on_view(ebb_tensor_t *d, ViewFn view, const std::function<ebb_status(ebb_tensor_t *)> &op) {
  Tensor v;
  ebb_status st = view(d, v.out());
  return st ? st : op(v);
}
// args.geom for a view of a contiguous base of `shape` on dev (kept for the whole run).
ebb__op_args with_geom(int dev, std::vector<int64_t> shape, int inner, ViewFn view) {
  static std::deque<ebb__view_geom> geoms;
  Tensor base, v;
  EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F64, static_cast<int>(shape.size()), shape.data(), base.out()));
  EBB_REQUIRE_OK(view(base, v.out()));
  geoms.emplace_back();
  ebb__view_geom_of(base, v, &geoms.back());
  geoms.back().inner_op = inner;
  ebb__op_args a{};
  a.geom = &geoms.back();
  return a;
}

// A forward that applies an in-place op to a clone of input 0 (the inputs stay as they were).
GcForward inplace(std::function<ebb_status(ebb_tensor_t *, const GcInputs &)> op) {
  return [op](const GcInputs &x, ebb_tensor_t **out) {
    ebb_status st = ebb_tensor_clone(x[0], out);
    if (!st) st = op(*out, x);
    return st;
  };
}

std::vector<Case> cases(int dev) {
  const int other = dev == EBB_DEVICE_CPU ? 0 : EBB_DEVICE_CPU;
  std::vector<Case> c;
  auto bin = [&](ebb__op_id op, ebb_status (*f)(const ebb_tensor_t *, const ebb_tensor_t *, ebb_tensor_t **), double lo, double hi) {
    c.push_back({op, {inp({2, 3}, 11), inp({3}, 12, lo, hi)}, args_none(), [f](const GcInputs &x, ebb_tensor_t **o) { return f(x[0], x[1], o); }});
  };
  bin(EBB__OP_ADD, ebb_op_add, -1, 1);
  bin(EBB__OP_SUB, ebb_op_sub, -1, 1);
  bin(EBB__OP_MUL, ebb_op_mul, -1, 1);
  bin(EBB__OP_DIV, ebb_op_div, 0.5, 2);
  auto sc = [&](ebb__op_id op, ebb_status (*f)(const ebb_tensor_t *, double, ebb_tensor_t **), double s, double lo, double hi) {
    c.push_back({op, {inp({2, 3}, 13, lo, hi)}, with_s(s), [f, s](const GcInputs &x, ebb_tensor_t **o) { return f(x[0], s, o); }});
  };
  sc(EBB__OP_ADD_SCALAR, ebb_op_add_scalar, 0.5, -1, 1);
  sc(EBB__OP_SUB_SCALAR, ebb_op_sub_scalar, 0.5, -1, 1);
  sc(EBB__OP_MUL_SCALAR, ebb_op_mul_scalar, -1.5, -1, 1);
  sc(EBB__OP_DIV_SCALAR, ebb_op_div_scalar, 4.0, -1, 1);
  sc(EBB__OP_POW_SCALAR, ebb_op_pow_scalar, 2.5, 0.5, 2);
  c.push_back({EBB__OP_CLAMP, {inp({2, 3}, 14, -2, 2)}, with_s(-0.7, 0.9),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_clamp(x[0], -0.7, 0.9, o); }});
  auto un = [&](ebb__op_id op, ebb_status (*f)(const ebb_tensor_t *, ebb_tensor_t **), double lo, double hi) {
    c.push_back({op, {inp({2, 3}, 15, lo, hi)}, args_none(), [f](const GcInputs &x, ebb_tensor_t **o) { return f(x[0], o); }});
  };
  un(EBB__OP_NEG, ebb_op_neg, -1, 1);
  un(EBB__OP_ABS, ebb_op_abs, 0.2, 1);  // away from the kink
  un(EBB__OP_EXP, ebb_op_exp, -1, 1);
  un(EBB__OP_LOG, ebb_op_log, 0.5, 2);
  un(EBB__OP_SQRT, ebb_op_sqrt, 0.5, 2);
  un(EBB__OP_SIN, ebb_op_sin, -1, 1);
  un(EBB__OP_COS, ebb_op_cos, -1, 1);
  un(EBB__OP_TANH, ebb_op_tanh, -1, 1);
  un(EBB__OP_SIGMOID, ebb_op_sigmoid, -1, 1);
  un(EBB__OP_RELU, ebb_op_relu, 0.2, 1);
  un(EBB__OP_GELU, ebb_op_gelu, -1, 1);
  c.push_back({EBB__OP_WHERE, {fixed({2, 3}, {1, 0, 1, 0, 0, 1}, EBB_BOOL), inp({2, 3}, 16), inp({3}, 17)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_where(x[0], x[1], x[2], o); }});
  c.push_back({EBB__OP_SUM, {inp({2, 3, 4}, 18)}, with_dims({0, 2}, false), [](const GcInputs &x, ebb_tensor_t **o) {
                 int d[2] = {0, 2};
                 return ebb_op_sum(x[0], d, 2, false, o);
               }});
  c.push_back({EBB__OP_MEAN, {inp({2, 3, 4}, 19)}, with_dims({1}, true), [](const GcInputs &x, ebb_tensor_t **o) {
                 int d[1] = {1};
                 return ebb_op_mean(x[0], d, 1, true, o);
               }});
  c.push_back({EBB__OP_MEAN, {inp({2, 3}, 20)}, with_dims({}, false),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_mean(x[0], nullptr, 0, false, o); }});
  c.push_back({EBB__OP_AMAX, {inp({3, 4}, 21)}, with_dims({1}, false), [](const GcInputs &x, ebb_tensor_t **o) {
                 int d[1] = {1};
                 return ebb_op_amax(x[0], d, 1, false, o);
               }});
  {
    ebb__op_args a = with_dim(1);
    a.keepdim = true;
    c.push_back({EBB__OP_MAX_DIM, {inp({3, 4}, 22)}, a, [](const GcInputs &x, ebb_tensor_t **o) {
                   Tensor idx;
                   return ebb_op_max_dim(x[0], 1, true, o, idx.out());
                 }});
  }
  c.push_back({EBB__OP_MATMUL, {inp({2, 3}, 23), inp({3, 4}, 24)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_matmul(x[0], x[1], o); }});
  c.push_back({EBB__OP_SOFTMAX, {inp({2, 5}, 25)}, with_dim(1), [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_softmax(x[0], 1, o); }});
  c.push_back({EBB__OP_LOG_SOFTMAX, {inp({2, 5}, 26)}, with_dim(0),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_log_softmax(x[0], 0, o); }});
  c.push_back({EBB__OP_CROSS_ENTROPY, {inp({3, 4}, 27), fixed({3}, {2, 0, 3}, EBB_I64)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_cross_entropy(x[0], x[1], o); }});
  c.push_back({EBB__OP_MSE_LOSS, {inp({2, 3}, 28), inp({2, 3}, 29)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_mse_loss(x[0], x[1], o); }});
  {
    ebb__op_args a = with_s(1e-5);
    a.dim = 1;  // nnorm
    c.push_back({EBB__OP_LAYER_NORM, {inp({3, 4}, 30), inp({4}, 31), inp({4}, 32)}, a,
                 [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_layer_norm(x[0], 1, x[1], x[2], 1e-5, o); }});
  }
  c.push_back({EBB__OP_CAT, {inp({2, 3}, 33), inp({2, 1}, 34), inp({2, 2}, 35)}, with_dim(1),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_cat(x.data(), 3, 1, o); }});
  c.push_back({EBB__OP_STACK, {inp({2, 3}, 36), inp({2, 3}, 37)}, with_dim(1),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_stack(x.data(), 2, 1, o); }});
  c.push_back({EBB__OP_VIEW, {inp({2, 6}, 38)}, args_none(), [](const GcInputs &x, ebb_tensor_t **o) {
                 int64_t s[3] = {3, 2, 2};
                 return ebb_tensor_view(x[0], 3, s, o);
               }});
  c.push_back({EBB__OP_RESHAPE, {inp({2, 6}, 39)}, args_none(), [](const GcInputs &x, ebb_tensor_t **o) {
                 int64_t s[1] = {12};
                 return ebb_tensor_reshape(x[0], 1, s, o);
               }});
  c.push_back({EBB__OP_TRANSPOSE, {inp({2, 3, 4}, 40)}, with_dim(0, 2),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_transpose(x[0], 0, 2, o); }});
  {
    ebb__op_args a = with_dims({2, 0, 1}, false);
    c.push_back({EBB__OP_PERMUTE, {inp({2, 3, 4}, 41)}, a, [](const GcInputs &x, ebb_tensor_t **o) {
                   int p[3] = {2, 0, 1};
                   return ebb_tensor_permute(x[0], p, 3, o);
                 }});
  }
  c.push_back({EBB__OP_SLICE, {inp({3, 7}, 42)}, with_slice(1, 1, 6, 2),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_slice(x[0], 1, 1, 6, 2, o); }});
  c.push_back({EBB__OP_NARROW, {inp({5, 3}, 43)}, with_slice(0, 1, 4, 1),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_narrow(x[0], 0, 1, 3, o); }});
  c.push_back({EBB__OP_SELECT, {inp({3, 4}, 44)}, with_slice(1, 2, 0, 0),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_select(x[0], 1, 2, o); }});
  c.push_back({EBB__OP_EXPAND, {inp({3, 1}, 45)}, args_none(), [](const GcInputs &x, ebb_tensor_t **o) {
                 int64_t s[3] = {2, 3, 4};
                 return ebb_tensor_expand(x[0], 3, s, o);
               }});
  c.push_back({EBB__OP_SQUEEZE, {inp({3, 1, 2}, 46)}, with_dim(1),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_squeeze(x[0], 1, o); }});
  c.push_back({EBB__OP_UNSQUEEZE, {inp({3, 2}, 47)}, with_dim(2),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_unsqueeze(x[0], 2, o); }});
  c.push_back({EBB__OP_CLONE, {inp({3, 2}, 49)}, args_none(), [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_clone(x[0], o); }});
  c.push_back({EBB__OP_TO_DEVICE, {inp({3, 2}, 50)}, args_none(),
               [other](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_to_device(x[0], other, o); }});
  c.push_back({EBB__OP_TO_DTYPE, {inp({3, 2}, 51)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_tensor_to_dtype(x[0], EBB_F32, o); }});
  c.push_back({EBB__OP_ADD_, {inp({2, 3}, 52), inp({3}, 53)}, args_none(),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_add_(d, x[1]); })});
  c.push_back({EBB__OP_MUL_, {inp({2, 3}, 54), inp({3}, 55)}, args_none(),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_mul_(d, x[1]); })});
  {
    GcInput dst = inp({2, 3}, 56);
    dst.differentiable = false;  // its old value is overwritten: no gradient
    c.push_back({EBB__OP_COPY_, {dst, inp({3}, 57)}, args_none(),
                 inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_tensor_copy_(d, x[1]); })});
  }
  // The in-place family (ops/inplace.c): src broadcast to dst where it has one.
  c.push_back({EBB__OP_ADD_SCALED_, {inp({2, 3}, 70), inp({3}, 71)}, with_s(-1.5),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_add_scaled_(d, x[1], -1.5); })});
  c.push_back({EBB__OP_ADD_SCALAR_, {inp({2, 3}, 72)}, with_s(0.5),
               inplace([](ebb_tensor_t *d, const GcInputs &) { return ebb_op_add_scalar_(d, 0.5); })});
  c.push_back({EBB__OP_MUL_SCALAR_, {inp({2, 3}, 73)}, with_s(-2.0),
               inplace([](ebb_tensor_t *d, const GcInputs &) { return ebb_op_mul_scalar_(d, -2.0); })});
  for (double w : {0.3, 0.8})  // both of lerp's formulas (from dst below 0.5, from end above)
    c.push_back({EBB__OP_LERP_, {inp({2, 3}, 74), inp({3}, 75)}, with_s(w),
                 inplace([w](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_lerp_(d, x[1], w); })});
  c.push_back({EBB__OP_ADDCMUL_, {inp({2, 3}, 76), inp({3}, 77), inp({2, 1}, 78)}, with_s(0.5),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_addcmul_(d, x[1], x[2], 0.5); })});
  c.push_back({EBB__OP_ADDCDIV_, {inp({2, 3}, 79), inp({2, 3}, 80), inp({3}, 81, 0.5, 2)}, with_s(-0.7),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return ebb_op_addcdiv_(d, x[1], x[2], -0.7); })});
  c.push_back({EBB__OP_SQRT_, {inp({2, 3}, 82, 0.5, 2)}, args_none(),
               inplace([](ebb_tensor_t *d, const GcInputs &) { return ebb_op_sqrt_(d); })});
  // linear: x with two leading dims, w [4, 3], b [4].
  c.push_back({EBB__OP_LINEAR, {inp({2, 2, 3}, 83), inp({4, 3}, 84), inp({4}, 85)}, args_none(),
               [](const GcInputs &x, ebb_tensor_t **o) { return ebb_op_linear(x[0], x[1], x[2], o); }});
  // autograd's nodes for views: where the view lies comes from a base of the forward's shape.
  // AsStridedBackward: a view (a slice of a transpose) and an expanded one, copied out.
  c.push_back({EBB__OP_AS_STRIDED, {inp({3, 4}, 60)}, with_geom(dev, {3, 4}, EBB__OP_COUNT, slice_of_t),
               [](const GcInputs &x, ebb_tensor_t **o) { return through_view(x[0], slice_of_t, o); }});
  c.push_back({EBB__OP_AS_STRIDED, {inp({3}, 61)}, with_geom(dev, {3}, EBB__OP_COUNT, expanded),
               [](const GcInputs &x, ebb_tensor_t **o) { return through_view(x[0], expanded, o); }});
  // CopySlices: the base after dst += src / dst = src through a view of a copy of it.
  c.push_back({EBB__OP_COPY_SLICES, {inp({3, 4}, 62), inp({2}, 63)}, with_geom(dev, {3, 4}, EBB__OP_ADD_, row_part),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return on_view(d, row_part, [&](ebb_tensor_t *v) { return ebb_op_add_(v, x[1]); }); })});
  c.push_back({EBB__OP_COPY_SLICES, {inp({3, 4}, 64), inp({2}, 65)}, with_geom(dev, {3, 4}, EBB__OP_COPY_, slice_of_t),
               inplace([](ebb_tensor_t *d, const GcInputs &x) { return on_view(d, slice_of_t, [&](ebb_tensor_t *v) { return ebb_tensor_copy_(v, x[1]); }); })});
  // ... and after dst += 0.5 * t1 * t2 through a view: three inputs, the op's scalar in the
  // geometry's record of it.
  {
    ebb__op_args a = with_geom(dev, {3, 4}, EBB__OP_ADDCMUL_, row_part);
    const_cast<ebb__view_geom *>(a.geom)->inner_args = with_s(0.5);
    c.push_back({EBB__OP_COPY_SLICES, {inp({3, 4}, 66), inp({2}, 67), inp({1}, 68)}, a,
                 inplace([](ebb_tensor_t *d, const GcInputs &x) {
                   return on_view(d, row_part, [&](ebb_tensor_t *v) { return ebb_op_addcmul_(v, x[1], x[2], 0.5); });
                 })});
  }
  return c;
}

}  // namespace

TEST_CASE("derivatives: every entry's backward, as autograd calls it, matches finite differences", "[ops][derivatives]") {
  EbbSession session;
  for (int dev : devices()) {
    for (const Case &c : cases(dev)) {
      const ebb__deriv *e = ebb__deriv_of(c.op);
      INFO(dev_name(dev) << ": " << e->node << " (" << e->forward << ")");
      g_unasked = 0;
      // To f32, the forward rounds: a wider step and tolerance for its finite differences.
      const bool f32 = c.op == EBB__OP_TO_DTYPE;
      EBB_CHECK_GRADCHECK(dev, c.in, c.fwd, through_table(c), f32 ? 1e-2 : 1e-6, f32 ? 1e-4 : 1e-6, f32 ? 1e-4 : 1e-5);
      CHECK(g_unasked == 0);
      // The same with the gradient given up to the backward (the engine's lean path).
      EBB_CHECK_GRADCHECK(dev, c.in, c.fwd, through_table(c, true), f32 ? 1e-2 : 1e-6, f32 ? 1e-4 : 1e-6, f32 ? 1e-4 : 1e-5);
      CHECK(g_unasked == 0);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("derivatives: the table has an entry for every operation, each well formed", "[ops][derivatives]") {
  EbbSession session;  // (the view cases are built on tensors)
  std::set<std::string> nodes, forwards;
  for (int op = 0; op < EBB__OP_COUNT; op++) {
    const ebb__deriv *e = ebb__deriv_of(static_cast<ebb__op_id>(op));
    REQUIRE(e != nullptr);
    INFO("entry " << op);
    REQUIRE(e->node != nullptr);
    REQUIRE(e->forward != nullptr);
    INFO(e->node);
    CHECK(nodes.insert(e->node).second);
    CHECK(forwards.insert(e->forward).second);
    CHECK((std::string(e->node).find("Backward") != std::string::npos || std::string(e->node) == "CopySlices"));
    CHECK((e->nin == -1 || (e->nin >= 1 && e->nin <= 8)));
    CHECK((e->nout == 1 || e->nout == 2));
    CHECK((e->diff == 0) == (e->backward == nullptr));
    if (e->nin > 0) {
      CHECK((e->diff >> e->nin) == 0);  // no gradient for an input it does not have
      CHECK(((e->save & 0xff) >> e->nin) == 0);
    }
    CHECK((e->save >> 8) >> e->nout == 0);
  }
  CHECK(ebb__deriv_of(EBB__OP_COUNT) == nullptr);
  // Every differentiable entry has a finite-difference case above (contiguous by hand below).
  std::set<int> tested;
  for (const Case &c : cases(EBB_DEVICE_CPU)) tested.insert(c.op);
  tested.insert(EBB__OP_CONTIGUOUS);  // by hand in the next case (its forward needs a non-contiguous input)
  for (int op = 0; op < EBB__OP_COUNT; op++)
    if (ebb__deriv_of(static_cast<ebb__op_id>(op))->diff) CHECK(tested.count(op) == 1);
}

// autograd.h lists the calls that record a node; the list must name every public call the table
// has an entry for (the entries for AsStrided and CopySlices are made by autograd itself).
TEST_CASE("derivatives: autograd.h's list of recorded calls names every call of the table", "[ops][derivatives][docs]") {
  std::ifstream f(EBB_AUTOGRAD_HEADER);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string h = ss.str();
  auto named = [&](const std::string &call) {
    auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    for (size_t p = h.find(call); p != std::string::npos; p = h.find(call, p + 1))
      if ((p == 0 || !word(h[p - 1])) && (p + call.size() >= h.size() || !word(h[p + call.size()]))) return true;
    return false;
  };
  int listed = 0;
  for (int op = 0; op < EBB__OP_COUNT; op++) {
    const ebb__deriv *e = ebb__deriv_of(static_cast<ebb__op_id>(op));
    if (std::string(e->forward).rfind("ebb_", 0) != 0) continue;  // "(an in-place op on a view)"
    INFO(e->forward << " (" << e->node << ")");
    CHECK(named(e->forward));
    listed++;
  }
  CHECK(listed > 40);
}

TEST_CASE("derivatives: contiguous, fill_ and zero_ through the table", "[ops][derivatives]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    // contiguous of a transposed [2,3] view: the gradient comes back in the view's shape and
    // dtype (a plain pass-through, nothing saved).
    auto v = values(6, 58);
    Tensor x = make(dev, EBB_F64, {2, 3}, v), t, g;
    EBB_REQUIRE_OK(ebb_tensor_transpose(x, 0, 1, t.out()));
    ebb__tensor_meta m{};
    m.device = dev;
    m.dtype = EBB_F64;
    m.ndim = 2;
    m.shape[0] = 3;
    m.shape[1] = 2;
    auto gv = values(6, 59);
    g = make(dev, EBB_F64, {3, 2}, gv);
    ebb__op_args a{};
    const ebb_tensor_t *saved[1] = {nullptr}, *outs[1] = {nullptr}, *go[1] = {g.get()};
    bool need[1] = {true};
    ebb__bw_ctx ctx{&a, &m, saved, outs, 1, need, nullptr};
    ebb_tensor_t *gin[1] = {nullptr};
    EBB_REQUIRE_OK(ebb__deriv_of(EBB__OP_CONTIGUOUS)->backward(&ctx, go, gin));
    Tensor r(gin[0]);
    CHECK(shape_of(r) == std::vector<int64_t>{3, 2});
    CHECK(read(r) == gv);
    // A wanted-nothing call returns nothing and succeeds.
    need[0] = false;
    gin[0] = nullptr;
    EBB_REQUIRE_OK(ebb__deriv_of(EBB__OP_CONTIGUOUS)->backward(&ctx, go, gin));
    CHECK(gin[0] == nullptr);
  }
  // fill_ and zero_: the result does not depend on the old value, so no backward at all.
  CHECK(ebb__deriv_of(EBB__OP_FILL_)->backward == nullptr);
  CHECK(ebb__deriv_of(EBB__OP_ZERO_)->backward == nullptr);
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("derivatives: a gradient the engine gives up is reused, one it keeps is not written", "[ops][derivatives]") {
  EbbSession session;
  for (int dev : devices()) {
    INFO(dev_name(dev));
    ebb__tensor_meta m{};
    m.device = dev;
    m.dtype = EBB_F64;
    m.ndim = 1;
    m.shape[0] = 3;
    ebb__tensor_meta mm[2] = {m, m};
    ebb__op_args a{};
    a.s[0] = 2.0;
    Tensor x = make(dev, EBB_F64, {3}, {1, 2, 3}), y = make(dev, EBB_F64, {3}, {4, 5, 6});
    for (bool give : {false, true}) {
      INFO("go_mine " << give);
      Tensor g = make(dev, EBB_F64, {3}, {1, 1, 1});
      const bool mine[2] = {give, false};
      bool need[2] = {true, true};
      // MulScalarBackward: 2 * g, in g itself when given.
      const ebb_tensor_t *saved[2] = {nullptr, nullptr}, *outs[1] = {nullptr}, *go[1] = {g.get()};
      ebb__bw_ctx c1{&a, &m, saved, outs, 1, need, mine};
      ebb_tensor_t *gin[2] = {nullptr, nullptr};
      EBB_REQUIRE_OK(ebb__deriv_of(EBB__OP_MUL_SCALAR)->backward(&c1, go, gin));
      Tensor r(gin[0]);
      CHECK(read(r) == std::vector<double>{2, 2, 2});
      CHECK((gin[0] == g.get()) == give);
      CHECK(read(g) == (give ? std::vector<double>{2, 2, 2} : std::vector<double>{1, 1, 1}));
      // MulBackward of x * y: g*y for x, g*x for y; one of them in g when given.
      Tensor g2 = make(dev, EBB_F64, {3}, {1, 1, 1});
      const ebb_tensor_t *sv[2] = {x.get(), y.get()}, *go2[1] = {g2.get()};
      ebb__bw_ctx c2{&a, mm, sv, outs, 2, need, mine};
      ebb_tensor_t *gin2[2] = {nullptr, nullptr};
      EBB_REQUIRE_OK(ebb__deriv_of(EBB__OP_MUL)->backward(&c2, go2, gin2));
      Tensor ga(gin2[0]), gb(gin2[1]);
      CHECK(read(ga) == std::vector<double>{4, 5, 6});
      CHECK(read(gb) == std::vector<double>{1, 2, 3});
      CHECK((gin2[0] == g2.get() || gin2[1] == g2.get()) == give);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
