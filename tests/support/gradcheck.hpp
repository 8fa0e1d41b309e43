// gradcheck: checks a backward formula against central finite differences in f64.
//
// The loss is L(x) = sum(forward(x) * w) for a fixed random weight w of the output's shape, so
// the gradient of L with respect to input i is exactly what backward(w, ...) must return. For
// every element j of every differentiable input, (L(x + h e_j) - L(x - h e_j)) / 2h is compared
// with the analytic gradient within atol + rtol |numeric|. Inputs are built on `device` from
// f64 values (non-differentiable inputs such as class indices may have another dtype). Reusable
// by any suite (tests/ops, tests/autograd).
#pragma once
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tensor_test_util.hpp"

namespace ebb_test {

struct GcInput {
  std::vector<int64_t> shape;
  std::vector<double> values;
  ebb_dtype dtype = EBB_F64;
  bool differentiable = true;
};

using GcInputs = std::vector<const ebb_tensor_t *>;
// forward(inputs, &out)
using GcForward = std::function<ebb_status(const GcInputs &, ebb_tensor_t **)>;
// backward(grad_out, inputs, out, grads): grads has one slot per input, to fill for the
// differentiable ones (the helper releases what it gets).
using GcBackward = std::function<ebb_status(const ebb_tensor_t *, const GcInputs &, const ebb_tensor_t *, std::vector<ebb_tensor_t *> &)>;

struct GcResult {
  bool ok = true;
  std::string report;
};

inline double gc_loss(int device, const GcForward &fwd, const std::vector<GcInput> &in, const std::vector<double> &w, std::string &err) {
  std::vector<Tensor> ts;
  GcInputs ptrs;
  for (auto &i : in) {
    ts.push_back(make(device, i.dtype, i.shape, i.values));
    ptrs.push_back(ts.back().get());
  }
  Tensor out;
  ebb_status st = fwd(ptrs, out.out());
  if (st != EBB_OK) {
    err = std::string("forward failed: ") + ebb_last_error();
    return NAN;
  }
  auto y = read(out);
  if (y.size() != w.size()) {
    err = "forward output changed size";
    return NAN;
  }
  double l = 0;
  for (size_t k = 0; k < y.size(); k++) l += y[k] * w[k];
  return l;
}

inline GcResult gradcheck(int device, std::vector<GcInput> in, const GcForward &fwd, const GcBackward &bwd, double h = 1e-6,
                          double atol = 1e-6, double rtol = 1e-5) {
  GcResult r;
  std::ostringstream rep;
  std::vector<Tensor> ts;
  GcInputs ptrs;
  for (auto &i : in) {
    ts.push_back(make(device, i.dtype, i.shape, i.values));
    ptrs.push_back(ts.back().get());
  }
  Tensor out;
  if (fwd(ptrs, out.out()) != EBB_OK) return {false, std::string("forward failed: ") + ebb_last_error()};
  auto oshape = shape_of(out);
  auto w = values(numel_of(oshape), 977, -1.0, 1.0);
  Tensor wt = make(device, dtype_of(out), oshape, w);
  std::vector<ebb_tensor_t *> grads(in.size(), nullptr);
  if (bwd(wt, ptrs, out, grads) != EBB_OK) return {false, std::string("backward failed: ") + ebb_last_error()};
  for (size_t i = 0; i < in.size(); i++) {
    Tensor g(grads[i]);
    if (!in[i].differentiable) continue;
    if (!g.get()) {
      rep << "input " << i << ": backward gave no gradient\n";
      r.ok = false;
      continue;
    }
    if (shape_of(g) != in[i].shape || dtype_of(g) != in[i].dtype) {
      rep << "input " << i << ": gradient has the wrong shape or dtype\n";
      r.ok = false;
      continue;
    }
    auto an = read(g);
    for (size_t j = 0; j < in[i].values.size(); j++) {
      std::string err;
      auto plus = in, minus = in;
      plus[i].values[j] += h;
      minus[i].values[j] -= h;
      double lp = gc_loss(device, fwd, plus, w, err), lm = gc_loss(device, fwd, minus, w, err);
      if (!err.empty()) return {false, err};
      double num = (lp - lm) / (2 * h);
      if (!(std::fabs(num - an[j]) <= atol + rtol * std::fabs(num))) {
        rep << "input " << i << " element " << j << ": analytic " << an[j] << " numeric " << num << "\n";
        r.ok = false;
      }
    }
  }
  r.report = rep.str();
  return r;
}

#define EBB_CHECK_GRADCHECK(...)                    \
  do {                                              \
    ebb_test::GcResult gc_ = ebb_test::gradcheck(__VA_ARGS__); \
    INFO(gc_.report);                               \
    CHECK(gc_.ok);                                  \
  } while (0)

} // namespace ebb_test
