// What a map keeps alive: after many training steps through ebb_map (saved or checkpointed, on
// the CPU and device 0, with the graph dropped after a backward, without one, and after a
// failing fn), live nodes, function ctx objects and handles are back where they started.
#include <vector>

#include "ebb/function.h"
#include "map_test_util.hpp"

using namespace ebb_test;

TEST_CASE("map lifetimes: nodes, ctx objects and handles go back to their start after many steps", "[autograd][map][lifetimes]") {
  EbbSession session;
  long handles0 = ebb_debug_live_handles(), nodes0 = ebb_autograd_live_nodes(), ctx0 = ebb_function_live_ctx();
  long tensors0 = ebb_tensor_live_count();
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  std::vector<int> devs{EBB_DEVICE_CPU};
  if (ndev > 0) devs.push_back(0);
  for (int dev : devs) {
    Tensor w = input_on(dev, {4, 4}, 2, true), b = input_on(dev, {4}, 3, true);
    for (int step = 0; step < 40; step++) {
      INFO(dev_name(dev) << ", step " << step);
      Tensor x = input_on(dev, {6, 2, 4}, 100 + (unsigned)step, step % 2 == 0);
      const ebb_tensor_t *xs[1] = {x.get()}, *args[2] = {w.get(), b.get()};
      ebb_map_options o = {};
      o.checkpoint = step % 4 >= 2;
      BlockCfg cfg;
      ebb_tensor_t *out[2] = {nullptr, nullptr};
      EBB_REQUIRE_OK(ebb_map(block_fn, &cfg, xs, 1, args, 2, &o, out, 2));
      Tensor y(out[0]), z(out[1]);
      CHECK(ebb_function_live_ctx() == ctx0 + 1);
      if (step % 8 != 7) {
        Tensor l = weighted_loss({y.get(), step % 3 ? z.get() : nullptr});
        // every fifth step keeps the graph for a second backward
        if (step % 5 == 0) {
          const ebb_tensor_t *roots[1] = {l.get()};
          EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, nullptr, 0));
        }
        EBB_REQUIRE_OK(ebb_backward_one(l));
      }
      // step % 8 == 7: the graph is dropped without a backward
    }
    CHECK(ebb_autograd_live_nodes() == nodes0);
    CHECK(ebb_function_live_ctx() == ctx0);
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(b, nullptr));
  }
  CHECK(ebb_autograd_live_nodes() == nodes0);
  CHECK(ebb_function_live_ctx() == ctx0);
  CHECK(ebb_tensor_live_count() == tensors0);
  CHECK(ebb_debug_live_handles() == handles0);
}

namespace {

// fails at the third slice, after giving outputs for the first two
ebb_status fail_third(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *args, int, ebb_tensor_t **outs, int, void *user) {
  int *calls = static_cast<int *>(user);
  if ((*calls)++ == 2) return EBB_ENOMEM;
  return ebb_op_mul(xs[0], args[0], &outs[0]);
}

}  // namespace

TEST_CASE("map lifetimes: a map whose fn fails part way, or whose backward fails, leaves nothing alive", "[autograd][map][lifetimes]") {
  EbbSession session;
  long handles0 = ebb_debug_live_handles(), nodes0 = ebb_autograd_live_nodes(), ctx0 = ebb_function_live_ctx();
  long tensors0 = ebb_tensor_live_count();
  {
    Tensor x = input_on(EBB_DEVICE_CPU, {4, 3}, 1, true), w = input_on(EBB_DEVICE_CPU, {3}, 2, true);
    const ebb_tensor_t *xs[1] = {x.get()}, *args[1] = {w.get()};
    for (bool checkpoint : {false, true}) {
      ebb_map_options o = {};
      o.checkpoint = checkpoint;
      int calls = 0;
      ebb_tensor_t *out[1] = {nullptr};
      CHECK(ebb_map(fail_third, &calls, xs, 1, args, 1, &o, out, 1) == EBB_ENOMEM);
      CHECK(out[0] == nullptr);
      // the backward's run fails (checkpoint mode: the second slice it runs again, slice 2)
      calls = -3;
      if (checkpoint) {
        EBB_REQUIRE_OK(ebb_map(fail_third, &calls, xs, 1, args, 1, &o, out, 1));
        Tensor y(out[0]);
        Tensor l = sum_of(y);
        CHECK(ebb_backward_one(l) == EBB_ENOMEM);
      }
    }
  }
  CHECK(ebb_autograd_live_nodes() == nodes0);
  CHECK(ebb_function_live_ctx() == ctx0);
  CHECK(ebb_tensor_live_count() == tensors0);
  CHECK(ebb_debug_live_handles() == handles0);
}
