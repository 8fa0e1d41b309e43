// Parameter lists and optimizers refuse bad input with a status and a message that names the call
// and the parameter: NULL handles, destroyed lists and optimizers (twice destroyed included),
// released tensors, non-floating, non-leaf, non-contiguous and duplicate parameters, options out
// of range, gradients of the wrong shape, dtype or device; a refused step changes nothing.
#include <cmath>
#include <limits>
#include <vector>

#include "autograd_test_util.hpp"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/optim.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

Tensor param(int dev, std::vector<double> v, const char *name = nullptr, ebb_dtype dt = EBB_F32) {
  Tensor t = make(dev, dt, {(int64_t)v.size()}, v);
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  if (ebb_dtype_is_float(dt)) EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

const double NaN = std::numeric_limits<double>::quiet_NaN();

}  // namespace

TEST_CASE("optim refusals: parameter lists refuse NULL, destroyed handles and parameters that cannot be updated",
          "[optim][errors]") {
  EbbSession session;
  Live live;
  {
    EBB_CHECK_MSG(ebb_params_create(nullptr), EBB_EINVAL, "ebb_params_create", "out is NULL");
    ebb_params_t *pl = nullptr;
    EBB_REQUIRE_OK(ebb_params_create(&pl));
    Tensor w = param(EBB_DEVICE_CPU, {1, 2, 3, 4}, "w");
    EBB_CHECK_MSG(ebb_params_add(nullptr, w), EBB_EINVAL, "ebb_params_add", "pl is NULL");
    EBB_CHECK_MSG(ebb_params_add(pl, nullptr), EBB_EINVAL, "ebb_params_add", "t");
    EBB_CHECK_MSG(ebb_params_add(pl, const_cast<ebb_tensor_t *>(released_tensor())), EBB_EFREED, "ebb_params_add", "t");
    {
      Tensor i = param(EBB_DEVICE_CPU, {1, 2}, "steps", EBB_I64);
      EBB_CHECK_MSG(ebb_params_add(pl, i), EBB_EINVAL, "ebb_params_add", "'steps'", "not floating");
      Tensor y;
      EBB_REQUIRE_OK(ebb_op_mul_scalar(w, 2.0, y.out()));
      EBB_CHECK_MSG(ebb_params_add(pl, y), EBB_EINVAL, "ebb_params_add", "not a leaf");
      Tensor m = make(EBB_DEVICE_CPU, EBB_F32, {2, 2}, {1, 2, 3, 4}), mt;
      EBB_REQUIRE_OK(ebb_tensor_transpose(m, 0, 1, mt.out()));
      EBB_CHECK_MSG(ebb_params_add(pl, mt), EBB_EINVAL, "ebb_params_add", "not contiguous");
    }
    EBB_REQUIRE_OK(ebb_params_add(pl, w));
    EBB_CHECK_MSG(ebb_params_add(pl, w), EBB_EINVAL, "ebb_params_add", "'w'", "params[0]", "shares its storage");
    {
      Tensor v;
      ebb_grad_set_enabled(false, nullptr);
      EBB_REQUIRE_OK(ebb_tensor_narrow(w, 0, 0, 2, v.out()));
      ebb_grad_set_enabled(true, nullptr);
      EBB_CHECK_MSG(ebb_params_add(pl, v), EBB_EINVAL, "ebb_params_add", "shares its storage");
    }
    int g = 0;
    EBB_CHECK_MSG(ebb_params_add_group(pl, -1.0, 0.0, &g), EBB_EINVAL, "ebb_params_add_group", "lr is -1");
    EBB_CHECK_MSG(ebb_params_add_group(pl, 0.1, NaN, &g), EBB_EINVAL, "ebb_params_add_group", "weight_decay is nan");
    EBB_CHECK_MSG(ebb_params_add_group(pl, 0.1, 0.0, nullptr), EBB_EINVAL, "ebb_params_add_group", "group is NULL");
    Tensor u = param(EBB_DEVICE_CPU, {1}, "u");
    EBB_CHECK_MSG(ebb_params_add_to(pl, 3, u), EBB_EINVAL, "ebb_params_add_to", "group 3 does not exist");
    int n = -1;
    EBB_CHECK_MSG(ebb_params_count(pl, nullptr), EBB_EINVAL, "ebb_params_count", "out is NULL");
    EBB_REQUIRE_OK(ebb_params_count(pl, &n));
    CHECK(n == 1);
    EBB_CHECK_MSG(ebb_params_destroy(nullptr), EBB_EINVAL, "ebb_params_destroy", "NULL");
    EBB_REQUIRE_OK(ebb_params_destroy(pl));
    // destroyed: every call, a second destroy included, reads EBB_EFREED
    EBB_CHECK_MSG(ebb_params_destroy(pl), EBB_EFREED, "ebb_params_destroy", "destroyed");
    EBB_CHECK_MSG(ebb_params_add(pl, u), EBB_EFREED, "ebb_params_add", "destroyed");
    EBB_CHECK_MSG(ebb_params_count(pl, &n), EBB_EFREED, "ebb_params_count", "destroyed");
    ebb_sgd_options s{};
    ebb_optim_t *o = nullptr;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EFREED, "ebb_optim_sgd", "destroyed");
  }
  live.check();
}

TEST_CASE("optim refusals: options out of range, NULL arguments and an empty list are refused at creation", "[optim][errors]") {
  EbbSession session;
  Live live;
  {
    ebb_params_t *pl = nullptr, *empty = nullptr;
    EBB_REQUIRE_OK(ebb_params_create(&pl));
    EBB_REQUIRE_OK(ebb_params_create(&empty));
    Tensor w = param(EBB_DEVICE_CPU, {1, 2});
    EBB_REQUIRE_OK(ebb_params_add(pl, w));
    ebb_optim_t *o = nullptr;
    ebb_sgd_options s{};
    s.lr = 0.1;
    EBB_CHECK_MSG(ebb_optim_sgd(nullptr, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "pl is NULL");
    EBB_CHECK_MSG(ebb_optim_sgd(pl, nullptr, &o), EBB_EINVAL, "ebb_optim_sgd", "opts is NULL");
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, nullptr), EBB_EINVAL, "ebb_optim_sgd", "out is NULL");
    EBB_CHECK_MSG(ebb_optim_sgd(empty, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "empty");
    s.lr = -0.1;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "opts->lr is -0.1", ">= 0");
    s.lr = NaN;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "opts->lr is nan");
    s.lr = 0.1, s.momentum = -1;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "opts->momentum");
    s.momentum = 0, s.weight_decay = -1;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "opts->weight_decay");
    s.weight_decay = 0, s.nesterov = true;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "nesterov", "momentum > 0");
    s.momentum = 0.9, s.dampening = 0.1;
    EBB_CHECK_MSG(ebb_optim_sgd(pl, &s, &o), EBB_EINVAL, "ebb_optim_sgd", "nesterov", "dampening 0");
    ebb_adamw_options a = ebb_adamw_defaults();
    CHECK(a.lr == 1e-3);
    CHECK(a.beta1 == 0.9);
    CHECK(a.beta2 == 0.999);
    CHECK(a.eps == 1e-8);
    CHECK(a.weight_decay == 1e-2);
    CHECK(!a.amsgrad);
    a.beta1 = 1.0;
    EBB_CHECK_MSG(ebb_optim_adamw(pl, &a, &o), EBB_EINVAL, "ebb_optim_adamw", "opts->beta1 is 1", "[0, 1)");
    a.beta1 = 0.9, a.beta2 = -0.5;
    EBB_CHECK_MSG(ebb_optim_adamw(pl, &a, &o), EBB_EINVAL, "ebb_optim_adamw", "opts->beta2 is -0.5");
    a.beta2 = NaN;
    EBB_CHECK_MSG(ebb_optim_adamw(pl, &a, &o), EBB_EINVAL, "ebb_optim_adamw", "opts->beta2 is nan");
    a.beta2 = 0.999, a.eps = -1;
    EBB_CHECK_MSG(ebb_optim_adamw(pl, &a, &o), EBB_EINVAL, "ebb_optim_adamw", "opts->eps");
    a.eps = 1e-8, a.lr = -1;
    EBB_CHECK_MSG(ebb_optim_adamw(pl, &a, &o), EBB_EINVAL, "ebb_optim_adamw", "opts->lr");
    CHECK(o == nullptr);
    EBB_REQUIRE_OK(ebb_params_destroy(pl));
    EBB_REQUIRE_OK(ebb_params_destroy(empty));
  }
  live.check();
}

TEST_CASE("optim refusals: steps refuse bad gradients naming the parameter, and change nothing", "[optim][errors]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  Live live;
  {
    Tensor a = param(0, {1, 2, 3}, "a"), b = param(0, {4, 5}, "b");
    ebb_params_t *pl = nullptr;
    EBB_REQUIRE_OK(ebb_params_create(&pl));
    EBB_REQUIRE_OK(ebb_params_add(pl, a));
    EBB_REQUIRE_OK(ebb_params_add(pl, b));
    ebb_optim_t *o = nullptr;
    ebb_adamw_options opts = ebb_adamw_defaults();
    EBB_REQUIRE_OK(ebb_optim_adamw(pl, &opts, &o));
    EBB_REQUIRE_OK(ebb_params_destroy(pl));
    Tensor ga = make(0, EBB_F32, {3}, {1, 1, 1});
    {
      Tensor wrong_shape = make(0, EBB_F32, {3}, {1, 1, 1}), wrong_dt = make(0, EBB_F64, {2}, {1, 1}),
             wrong_dev = make(1, EBB_F32, {2}, {1, 1}), cpu = make(EBB_DEVICE_CPU, EBB_F32, {2}, {1, 1});
      const ebb_tensor_t *g1[2] = {ga.get(), wrong_shape.get()};
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g1, 2), EBB_EINVAL, "ebb_optim_step_grads", "params[1] 'b'", "f32[2]", "f32[3]",
                    "shape and dtype");
      const ebb_tensor_t *g2[2] = {ga.get(), wrong_dt.get()};
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g2, 2), EBB_EINVAL, "ebb_optim_step_grads", "params[1] 'b'", "f64[2]");
      const ebb_tensor_t *g3[2] = {ga.get(), wrong_dev.get()};
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g3, 2), EBB_EDEVICE, "ebb_optim_step_grads", "params[1] 'b'", "device 1");
      const ebb_tensor_t *g4[2] = {ga.get(), cpu.get()};
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g4, 2), EBB_EDEVICE, "ebb_optim_step_grads", "params[1] 'b'", "CPU");
      const ebb_tensor_t *g5[2] = {ga.get(), released_tensor()};
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g5, 2), EBB_EFREED, "ebb_optim_step_grads", "grads[1]");
      EBB_CHECK_MSG(ebb_optim_step_grads(o, g5, 1), EBB_EINVAL, "ebb_optim_step_grads", "n is 1", "2");
      EBB_CHECK_MSG(ebb_optim_step_grads(o, nullptr, 2), EBB_EINVAL, "ebb_optim_step_grads", "grads is NULL");
    }
    // nothing moved: values, versions, counts
    EBB_CHECK_CLOSE(read(a), (std::vector<double>{1, 2, 3}), 0, 0);
    uint64_t v = 0;
    EBB_REQUIRE_OK(ebb_tensor_version(a, &v));
    int64_t n = -1;
    EBB_REQUIRE_OK(ebb_optim_step_count(o, -1, &n));
    CHECK(n == 0);
    EBB_REQUIRE_OK(ebb_optim_step_count(o, 0, &n));
    CHECK(n == 0);
    // settings and state
    EBB_CHECK_MSG(ebb_optim_set_lr(o, 0, -1.0), EBB_EINVAL, "ebb_optim_set_lr", "lr is -1");
    EBB_CHECK_MSG(ebb_optim_set_lr(o, 0, NaN), EBB_EINVAL, "ebb_optim_set_lr", "lr is nan");
    EBB_CHECK_MSG(ebb_optim_set_lr(o, 5, 0.1), EBB_EINVAL, "ebb_optim_set_lr", "group 5");
    double lr = 0;
    EBB_CHECK_MSG(ebb_optim_lr(o, 1, &lr), EBB_EINVAL, "ebb_optim_lr", "group 1");
    EBB_CHECK_MSG(ebb_optim_lr(o, 0, nullptr), EBB_EINVAL, "ebb_optim_lr", "out is NULL");
    EBB_CHECK_MSG(ebb_optim_step_count(o, 2, &n), EBB_EINVAL, "ebb_optim_step_count", "param 2");
    EBB_CHECK_MSG(ebb_optim_step_count(o, 0, nullptr), EBB_EINVAL, "ebb_optim_step_count", "out is NULL");
    Tensor st;
    EBB_CHECK_MSG(ebb_optim_state(o, 0, "momentum_buffer", st.out()), EBB_EINVAL, "ebb_optim_state", "'momentum_buffer'", "AdamW");
    EBB_CHECK_MSG(ebb_optim_state(o, 9, "exp_avg", st.out()), EBB_EINVAL, "ebb_optim_state", "param 9");
    EBB_CHECK_MSG(ebb_optim_state(o, 0, nullptr, st.out()), EBB_EINVAL, "ebb_optim_state", "name is NULL");
    // NULL and destroyed optimizers, a second destroy included
    EBB_CHECK_MSG(ebb_optim_step(nullptr), EBB_EINVAL, "ebb_optim_step", "opt is NULL");
    EBB_CHECK_MSG(ebb_optim_zero_grad(nullptr, true), EBB_EINVAL, "ebb_optim_zero_grad", "opt is NULL");
    EBB_CHECK_MSG(ebb_optim_destroy(nullptr), EBB_EINVAL, "ebb_optim_destroy", "opt is NULL");
    EBB_REQUIRE_OK(ebb_optim_destroy(o));
    EBB_CHECK_MSG(ebb_optim_destroy(o), EBB_EFREED, "ebb_optim_destroy", "destroyed");
    EBB_CHECK_MSG(ebb_optim_step(o), EBB_EFREED, "ebb_optim_step", "destroyed");
    EBB_CHECK_MSG(ebb_optim_zero_grad(o, false), EBB_EFREED, "ebb_optim_zero_grad", "destroyed");
    EBB_CHECK_MSG(ebb_optim_set_lr(o, 0, 0.1), EBB_EFREED, "ebb_optim_set_lr", "destroyed");
    EBB_CHECK_MSG(ebb_optim_step_count(o, -1, &n), EBB_EFREED, "ebb_optim_step_count", "destroyed");
  }
  live.check();
}

TEST_CASE("optim refusals: a parameter released behind the optimizer's back is EBB_EFREED, naming it", "[optim][errors]") {
  EbbSession session;
  Live live;
  {
    // The optimizer's own reference dropped by a caller's over-release, then a step.
    Tensor t = param(EBB_DEVICE_CPU, {1, 2}, "x");
    ebb_params_t *pl = nullptr;
    EBB_REQUIRE_OK(ebb_params_create(&pl));
    EBB_REQUIRE_OK(ebb_params_add(pl, t));
    ebb_optim_t *o = nullptr;
    ebb_sgd_options s{};
    s.lr = 0.1;
    EBB_REQUIRE_OK(ebb_optim_sgd(pl, &s, &o));
    EBB_REQUIRE_OK(ebb_params_destroy(pl));
    ebb_tensor_t *raw = t.t;
    t.t = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_release(raw));  // the caller's reference
    EBB_REQUIRE_OK(ebb_tensor_release(raw));  // one too many: the optimizer's is gone
    EBB_CHECK_MSG(ebb_optim_step(o), EBB_EFREED, "ebb_optim_step", "params[0]");
    EBB_CHECK_MSG(ebb_optim_zero_grad(o, true), EBB_EFREED, "ebb_optim_zero_grad", "params[0]");
    // Destroying it releases what it holds; the released parameter's release fails quietly inside.
    ebb_optim_destroy(o);
  }
  live.check();
}
