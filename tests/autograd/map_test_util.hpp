// What the map suites share: a small block for fn (y = tanh(x W^T + b), z = y * x), the same
// block run as an explicit loop over slices and stacked (the reference), and a loss that weighs
// each output element differently so every gradient entry is checked.
#pragma once

#include <cstdint>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/map.h"
#include "ebb/ops.h"
#include "autograd_test_util.hpp"
#include "tensor_test_util.hpp"

namespace ebb_test {

// fn's switches, through its user pointer.
struct BlockCfg {
  int calls = 0;            // slices run so far (forward and checkpoint runs together)
  bool use_b = true;        // false: the arg b is ignored (no output depends on it)
  bool second = true;       // noutputs 2: z as well
};

// One slice: xs[0] a [R, C] slice, args W [C, C] and b [C].
inline ebb_status block_fn(const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs, ebb_tensor_t **outs,
                           int nouts, void *user) {
  auto *cfg = static_cast<BlockCfg *>(user);
  (void)nxs;
  (void)nargs;
  cfg->calls++;
  ebb_tensor_t *h = nullptr;
  ebb_status st = ebb_op_linear(xs[0], args[0], cfg->use_b ? args[1] : nullptr, &h);
  if (!st) st = ebb_op_tanh(h, &outs[0]);
  if (h) ebb_tensor_release(h);
  if (!st && nouts > 1) st = ebb_op_mul(outs[0], xs[0], &outs[1]);
  return st;
}

// The reference: the loop over slices of x with the same block, each output stacked.
inline std::vector<Tensor> block_loop(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, int nouts, bool use_b = true) {
  int64_t n = shape_of(x)[0];
  std::vector<std::vector<Tensor>> per((size_t)nouts);
  BlockCfg cfg;
  cfg.use_b = use_b;
  for (int64_t s = 0; s < n; s++) {
    Tensor xs;
    EBB_REQUIRE_OK(ebb_tensor_select(x, 0, s, xs.out()));
    const ebb_tensor_t *in[1] = {xs.get()}, *args[2] = {w, b};
    ebb_tensor_t *o[2] = {nullptr, nullptr};
    EBB_REQUIRE_OK(block_fn(in, 1, args, 2, o, nouts, &cfg));
    for (int k = 0; k < nouts; k++) per[(size_t)k].emplace_back(o[k]);
  }
  std::vector<Tensor> out;
  for (int k = 0; k < nouts; k++) {
    std::vector<const ebb_tensor_t *> ts;
    for (auto &t : per[(size_t)k]) ts.push_back(t.get());
    Tensor st;
    EBB_REQUIRE_OK(ebb_op_stack(ts.data(), (int)ts.size(), 0, st.out()));
    out.push_back(std::move(st));
  }
  return out;
}

// sum_k sum(outs[k] * weight_k), weights fixed by the output's shape and k.
inline Tensor weighted_loss(const std::vector<const ebb_tensor_t *> &outs) {
  Tensor total;
  for (size_t k = 0; k < outs.size(); k++) {
    if (!outs[k]) continue;
    int dev = 0;
    EBB_REQUIRE_OK(ebb_tensor_device(outs[k], &dev));
    auto shape = shape_of(outs[k]);
    Tensor w = make(dev, dtype_of(outs[k]), shape, values(numel_of(shape), 100 + (unsigned)k));
    Tensor p, s;
    EBB_REQUIRE_OK(ebb_op_mul(outs[k], w, p.out()));
    EBB_REQUIRE_OK(ebb_op_sum(p, nullptr, 0, false, s.out()));
    if (!total.get()) {
      total = std::move(s);
    } else {
      Tensor t2;
      EBB_REQUIRE_OK(ebb_op_add(total, s, t2.out()));
      total = std::move(t2);
    }
  }
  return total;
}

// ebb_grad of loss with respect to inputs (all must be used), as doubles.
inline std::vector<std::vector<double>> grads_of(const ebb_tensor_t *loss, const std::vector<const ebb_tensor_t *> &inputs,
                                                 bool retain = false) {
  std::vector<ebb_tensor_t *> g(inputs.size(), nullptr);
  const ebb_tensor_t *roots[1] = {loss};
  EBB_REQUIRE_OK(ebb_grad(roots, nullptr, 1, inputs.data(), (int)inputs.size(), retain, false, g.data()));
  std::vector<std::vector<double>> out;
  for (auto *t : g) {
    out.push_back(read(t));
    ebb_tensor_release(t);
  }
  return out;
}

// A leaf on dev of the given shape, deterministic values, requiring a gradient when asked.
inline Tensor input_on(int dev, std::vector<int64_t> shape, unsigned seed, bool requires_grad) {
  Tensor t = make(dev, EBB_F64, shape, values(numel_of(shape), seed));
  if (requires_grad) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

}  // namespace ebb_test
