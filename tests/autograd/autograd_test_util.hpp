// Helpers the saved-tensor suites share (saved-tensor hooks, allow-mutation, offload): a leaf
// that requires a gradient, a tensor's .grad read back, a sum, and the check that a test left no
// tensor or node alive.
#pragma once

#include <cstdint>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "tensor_test_util.hpp"

namespace ebb_test {

// An f64 leaf on `dev` that requires a gradient, named `name` when given.
inline Tensor leaf_on(int dev, std::vector<double> v, const char *name = nullptr) {
  Tensor t = make(dev, EBB_F64, {static_cast<int64_t>(v.size())}, v);
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

// t's .grad as doubles (it must have one).
inline std::vector<double> grad_of(const ebb_tensor_t *t) {
  Tensor g;
  EBB_REQUIRE_OK(ebb_tensor_grad(t, g.out()));
  REQUIRE(g.get() != nullptr);
  return read(g);
}

// The sum of all of t's elements.
inline Tensor sum_of(const ebb_tensor_t *t) {
  Tensor s;
  EBB_REQUIRE_OK(ebb_op_sum(t, nullptr, 0, false, s.out()));
  return s;
}

// Live tensors and nodes at construction; check() says none was left behind since.
struct Live {
  long tensors = ebb_tensor_live_count(), nodes = ebb_autograd_live_nodes();
  void check() const {
    CHECK(ebb_tensor_live_count() == tensors);
    CHECK(ebb_autograd_live_nodes() == nodes);
  }
};

}  // namespace ebb_test
