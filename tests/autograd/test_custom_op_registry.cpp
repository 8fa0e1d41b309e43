// The custom-op registry (ebb/custom_op.h) and the launch of a library's own kernel
// (ebb_op_launch_kernel, ebb/ops.h): a name registered twice, bad definitions and calls, an op
// called without a backward when a gradient is needed, a kernel image that fails to load, the
// registry's life across ebb_shutdown and ebb_init, and the launch's refusals.
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/custom_op.h"
#include "ebb/ops.h"
#include "scaled_mul.h"
#include "scaled_mul_kernel.h"
#include "sim_fault_env.hpp"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

ebb_custom_op_def smul_def() {
  ebb_custom_op_def def;
  ebbtest_scaled_mul_def(&def);
  return def;
}

ebb_status call2(const ebb_custom_op_t *op, const ebb_tensor_t *x, const ebb_tensor_t *w, Tensor &y, Tensor &mask) {
  const ebb_tensor_t *in[2] = {x, w};
  ebb_tensor_t *out[2] = {nullptr, nullptr};
  ebb_status st = ebb_custom_op_call(op, in, nullptr, out);
  y = Tensor(out[0]);
  mask = Tensor(out[1]);
  return st;
}

}  // namespace

TEST_CASE("custom op registry: a name registered twice is refused, naming it, and the first op stays", "[custom_op][registry]") {
  EbbSession session;
  ebb_custom_op_def def = smul_def();
  ebb_custom_op_t *op = nullptr, *found = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  CHECK(ebb_custom_op_count() == 1);
  ebb_custom_op_t *again = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, &again), EBB_EINVAL, "ebb_custom_op_register", "'ebbtest.scaled_mul'", "registered already");
  CHECK(again == nullptr);
  CHECK(ebb_custom_op_count() == 1);
  EBB_REQUIRE_OK(ebb_custom_op_find("ebbtest.scaled_mul", &found));
  CHECK(found == op);
  CHECK(std::string(ebb_custom_op_name(op)) == "ebbtest.scaled_mul");
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {3}, {1, 2, 3}), w = make(EBB_DEVICE_CPU, EBB_F32, {3}, {2, 2, 2}), y, mask;
  EBB_REQUIRE_OK(call2(op, x, w, y, mask));
  CHECK(read(y) == std::vector<double>{2, 4, 6});
  // Another op may share the image and even the kernel (the same declaration is the same kernel).
  def.name = "ebbtest.scaled_mul2";
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, nullptr));
  EBB_CHECK_MSG(ebb_custom_op_find("ebbtest.nothing", &found), EBB_ENOTFOUND, "ebb_custom_op_find", "'ebbtest.nothing'");
  EBB_CHECK_MSG(ebb_custom_op_find(nullptr, &found), EBB_EINVAL, "ebb_custom_op_find", "name");
  EBB_CHECK_MSG(ebb_custom_op_find("x", nullptr), EBB_EINVAL, "ebb_custom_op_find", "out");
}

TEST_CASE("custom op registry: bad definitions are refused with the op and the field named", "[custom_op][registry][errors]") {
  EbbSession session;
  ebb_custom_op_def def = smul_def();
  EBB_CHECK_MSG(ebb_custom_op_register(nullptr, nullptr), EBB_EINVAL, "ebb_custom_op_register", "def is NULL");
  def.version = 99;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "version is 99");
  def = smul_def();
  def.name = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "name is NULL");
  def.name = "";
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "name is empty");
  std::string longname(EBB_CUSTOM_OP_NAME_MAX + 1, 'n');
  def.name = longname.c_str();
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "name is too long");
  def = smul_def();
  def.ninputs = -1;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "'ebbtest.scaled_mul'", "ninputs is -1");
  def.ninputs = EBB_FUNCTION_MAX_INPUTS + 1;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "ninputs is 65");
  def = smul_def();
  def.noutputs = 0;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "noutputs is 0");
  def.noutputs = EBB_FUNCTION_MAX_OUTPUTS + 1;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "noutputs is 65");
  def = smul_def();
  def.forward = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "forward is NULL");
  def = smul_def();
  def.kernels = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "kernels NULL");
  def = smul_def();
  def.nkernels = EBB_CUSTOM_OP_MAX_KERNELS + 1;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "17 kernels");
  ebb_custom_op_kernel k{};
  k.arg_bytes = 8;
  k.cpu_fn = ebbtest_smul_cpu;
  def = smul_def();
  def.kernels = &k;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "kernels[0] has a NULL name");
  // Kernels the runtime refuses: neither function; a name declared before with other parameters
  // (the runtime's own "ebb.noop"); an image name in use with other bytes (ops' "ebb.ops").
  k.name = "ebbtest.nofn";
  k.cpu_fn = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "'ebbtest.scaled_mul'", "kernels[0] 'ebbtest.nofn'", "neither");
  k.name = "ebb.noop";
  k.cpu_fn = ebbtest_smul_cpu;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "kernels[0] 'ebb.noop'", "declared before with other parameters");
  k.arg_bytes = 0;
  k.name = "ebbtest.zero";
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "'ebbtest.zero'", "arg_bytes 0");
  def = smul_def();
  static const char other_bytes[] = "not ops' image";
  def.image_name = "ebb.ops";
  def.image = other_bytes;
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_EINVAL, "'ebbtest.scaled_mul'", "image 'ebb.ops'", "other contents");
  CHECK(ebb_custom_op_count() == 0);  // nothing was registered by the refusals
  // A corrected definition registers (what a refused one declared blocks nothing).
  def = smul_def();
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, nullptr));
}

TEST_CASE("custom op registry: registering before ebb_init is refused", "[custom_op][registry][errors]") {
  ebb_custom_op_def def = smul_def();
  REQUIRE_FALSE(ebb_is_initialized());
  EBB_CHECK_MSG(ebb_custom_op_register(&def, nullptr), EBB_ENOTINIT, "'ebbtest.scaled_mul'", "ebb_init");
}

TEST_CASE("custom op registry: bad calls name the op and the argument", "[custom_op][registry][errors]") {
  EbbSession session;
  ebb_custom_op_def def = smul_def();
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {3}, {1, 2, 3});
  const ebb_tensor_t *in[2] = {x.get(), x.get()};
  ebb_tensor_t *out[2] = {nullptr, nullptr};
  EBB_CHECK_MSG(ebb_custom_op_call(nullptr, in, nullptr, out), EBB_EINVAL, "ebb_custom_op_call", "NULL");
  const ebb_custom_op_t *bogus = reinterpret_cast<const ebb_custom_op_t *>(&def);
  EBB_CHECK_MSG(ebb_custom_op_call(bogus, in, nullptr, out), EBB_EINVAL, "ebb_custom_op_call", "not a registered op");
  EBB_CHECK_MSG(ebb_custom_op_call(op, in, nullptr, nullptr), EBB_EINVAL, "'ebbtest.scaled_mul'", "outputs is NULL");
  EBB_CHECK_MSG(ebb_custom_op_call(op, nullptr, nullptr, out), EBB_EINVAL, "'ebbtest.scaled_mul'", "inputs is NULL", "2 input");
  const ebb_kernel_t *k = nullptr;
  EBB_CHECK_MSG(ebb_custom_op_kernel_get(op, 1, &k), EBB_EINVAL, "'ebbtest.scaled_mul'", "out of range");
  EBB_CHECK_MSG(ebb_custom_op_kernel_get(op, 0, nullptr), EBB_EINVAL, "out is NULL");
  EBB_CHECK_MSG(ebb_custom_op_kernel_get(nullptr, 0, &k), EBB_EINVAL, "ebb_custom_op_kernel_get");
  CHECK(ebb_custom_op_user(nullptr) == nullptr);
  CHECK(std::string(ebb_custom_op_name(bogus)) == "(invalid op)");
  CHECK(ebb_custom_op_of(nullptr) == nullptr);
  CHECK(out[0] == nullptr);
  CHECK(out[1] == nullptr);
  REQUIRE(ebb_debug_live_handles() == 1);  // x
}

TEST_CASE("custom op registry: ops and their kernels live until the last ebb_shutdown and are registered again after ebb_init",
          "[custom_op][registry][lifetime]") {
  ebb_custom_op_def def = smul_def();
  ebb_custom_op_t *op = nullptr;
  const ebb_kernel_t *k1 = nullptr;
  {
    EbbSession session;
    EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
    EBB_REQUIRE_OK(ebb_custom_op_kernel_get(op, 0, &k1));
  }
  {
    EbbSession session;
    CHECK(ebb_custom_op_count() == 0);
    ebb_custom_op_t *found = nullptr;
    EBB_CHECK_MSG(ebb_custom_op_find("ebbtest.scaled_mul", &found), EBB_ENOTFOUND, "'ebbtest.scaled_mul'");
    Tensor x = make(EBB_DEVICE_CPU, EBB_F32, {2}, {1, 2}), y, mask;
    EBB_CHECK_MSG(call2(op, x, x, y, mask), EBB_EINVAL, "not a registered op", "before the last ebb_shutdown");
    // The old kernel handle is refused by the launch as well.
    ebbtest_smul_args a{};
    ebb_op_operand opd{x.get(), false};
    EBB_CHECK_MSG(ebb_op_launch_kernel(k1, &a, &opd, 1, 1), EBB_EINVAL, "ebb_op_launch_kernel", "not a kernel");
    ebb_custom_op_t *op2 = nullptr;
    EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op2));
    CHECK(op2 != op);
    EBB_REQUIRE_OK(call2(op2, x, x, y, mask));
    CHECK(read(y) == std::vector<double>{1, 4});
  }
}

TEST_CASE("custom op registry: an op without a backward runs forward, and fails naming the op only when a gradient is needed",
          "[custom_op][registry][autograd]") {
  EbbSession session;
  ebb_custom_op_def def = smul_def();
  def.name = "ebbtest.forward_only";
  def.backward = nullptr;
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  for (int dev : devices()) {
    INFO(dev_name(dev));
    Tensor x = make(dev, EBB_F64, {3}, {1, 2, 3}), w = make(dev, EBB_F64, {3}, {1, 1, 1}), y, mask;
    EBB_REQUIRE_OK(call2(op, x, w, y, mask));  // nothing requires a gradient: a plain forward
    EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(w, true));
    EBB_REQUIRE_OK(call2(op, x, w, y, mask));  // recorded: the forward alone fails nothing
    Tensor s;
    EBB_REQUIRE_OK(ebb_op_sum(y, nullptr, 0, false, s.out()));
    EBB_CHECK_MSG(ebb_backward_one(s), EBB_ENOTSUP, "ebbtest.forward_onlyBackward", "'ebbtest.forward_only'", "without a backward",
                  "input 1");
    y.reset();
    mask.reset();
    s.reset();
    bool was = false;
    ebb_grad_set_enabled(false, &was);  // grad mode off: nothing recorded, nothing to fail
    EBB_REQUIRE_OK(call2(op, x, w, y, mask));
    ebb_grad_set_enabled(was, nullptr);
    const ebb_node_t *fn = nullptr;
    int nr = -1;
    EBB_REQUIRE_OK(ebb_tensor_grad_fn(y, &fn, &nr));
    CHECK(fn == nullptr);
  }
  CHECK(ebb_autograd_live_nodes() == 0);
}

TEST_CASE("custom op registry: a kernel image that fails to load fails the call naming the op's kernel, and a later call loads it",
          "[custom_op][registry][faults]") {
  // The emulated driver loads any bytes as an image (it finds CPU functions by name), so a
  // load failure is injected: the first cuModuleLoadData of the process, the op's image on
  // device 0 (nothing else launches a kernel on a device before it here).
  if (!faults_for_this_process("cuModuleLoadData:1:CUDA_ERROR_INVALID_IMAGE")) return;
  EbbSession session;
  ebb_custom_op_def def = smul_def();
  static const unsigned char garbage[64] = {0xde, 0xad, 0xbe, 0xef};
  def.image_name = "ebbtest.garbage";
  def.image = garbage;  // on a GPU these bytes would fail to load; the emulated driver ignores them
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  REQUIRE(ndev > 0);
  Tensor x = make(0, EBB_F32, {4}, {1, 2, 3, 4}), y, mask;
  EBB_CHECK_MSG(call2(op, x, x, y, mask), EBB_EDRIVER, "ebbtest.scaled_mul", "ebbtest.smul", "cuModuleLoadData", "INVALID_IMAGE");
  CHECK(y.get() == nullptr);
  EBB_REQUIRE_OK(call2(op, x, x, y, mask));
  CHECK(read(y) == std::vector<double>{1, 4, 9, 16});
}

TEST_CASE("custom op registry: garbage bytes as an image register and run on the emulated driver, which loads no GPU code",
          "[custom_op][registry]") {
  EbbSession session;
  if (!ebb_test_emulated()) EBB_SKIP("a real driver refuses garbage as an image (the case above has it refused)");
  ebb_custom_op_def def = smul_def();
  static const unsigned char garbage[64] = {0xde, 0xad, 0xbe, 0xef};
  def.image_name = "ebbtest.garbage";
  def.image = garbage;
  ebb_custom_op_t *op = nullptr;
  EBB_REQUIRE_OK(ebb_custom_op_register(&def, &op));
  for (int dev : devices()) {
    Tensor x = make(dev, EBB_F32, {2}, {3, 4}), y, mask;
    EBB_REQUIRE_OK(call2(op, x, x, y, mask));
    CHECK(read(y) == std::vector<double>{9, 16});
  }
}

TEST_CASE("op launch kernel: bad arguments are refused with the kernel and the operand named", "[custom_op][launch][errors]") {
  EbbSession session;
  const ebb_kernel_t *k = nullptr, *gpu_only = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("ebbtest.launch", sizeof(ebbtest_smul_args), ebbtest_smul_cpu, nullptr, &k));
  EBB_REQUIRE_OK(ebb_kernel_declare("ebbtest.gpu_only", sizeof(ebbtest_smul_args), nullptr, "ebbtest_smul", &gpu_only));
  Tensor c = make(EBB_DEVICE_CPU, EBB_F32, {2}, {1, 2}), d = make(0, EBB_F32, {2}, {1, 2});
  ebbtest_smul_args a{};
  ebb_op_operand ops[2] = {{c.get(), false}, {d.get(), true}};
  EBB_CHECK_MSG(ebb_op_launch_kernel(nullptr, &a, ops, 1, 1), EBB_EINVAL, "ebb_op_launch_kernel", "NULL");
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, nullptr, ops, 1, 1), EBB_EINVAL, "'ebbtest.launch'", "args is NULL");
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, nullptr, 1, 1), EBB_EINVAL, "'ebbtest.launch'", "operands is NULL");
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, ops, 0, 1), EBB_EINVAL, "'ebbtest.launch'", "n = 0");
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, ops, EBB_OP_LAUNCH_MAX_OPERANDS + 1, 1), EBB_EINVAL, "n = 17");
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, ops, 2, 1), EBB_EDEVICE, "'ebbtest.launch'", "operands[0]", "operands[1]", "different devices");
  ebb_op_operand null_t{nullptr, false};
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, &null_t, 1, 1), EBB_EINVAL, "ebb_op_launch_kernel", "operands[0]");
  ebb_op_operand freed{released_tensor(), false};
  EBB_CHECK_MSG(ebb_op_launch_kernel(k, &a, &freed, 1, 1), EBB_EFREED, "ebb_op_launch_kernel", "operands[0]");
  EBB_CHECK_MSG(ebb_op_launch_kernel(gpu_only, &a, ops, 1, 1), EBB_ENOTSUP, "'ebbtest.gpu_only'", "no CPU function");
  // On the emulated driver, a kernel without a CPU function cannot run either; a real one finds
  // no GPU function of that name in the images it loaded.
  if (ebb_test_emulated())
    EBB_CHECK_MSG(ebb_op_launch_kernel(gpu_only, &a, &ops[1], 1, 1), EBB_ENOTSUP, "'ebbtest.gpu_only'", "device 0");
  else
    EBB_CHECK_MSG(ebb_op_launch_kernel(gpu_only, &a, &ops[1], 1, 1), EBB_ENOTFOUND, "'ebbtest.gpu_only'", "device 0");
}

TEST_CASE("custom op registry: threads racing to register one name leave one op, and threads calling it get their own results",
          "[custom_op][registry][threads]") {
  EbbSession session;
  const int nthreads = 4;
  std::vector<ebb_status> reg(nthreads, EBB_OK);
  std::vector<ebb_custom_op_t *> ops(nthreads, nullptr);
  {
    std::vector<std::thread> ts;
    std::atomic<bool> go{false};
    for (int i = 0; i < nthreads; i++)
      ts.emplace_back([&, i] {
        while (!go.load()) {
        }
        ebb_custom_op_def def = smul_def();
        reg[i] = ebb_custom_op_register(&def, &ops[i]);
      });
    go = true;
    for (auto &t : ts) t.join();
  }
  int won = 0;
  ebb_custom_op_t *op = nullptr;
  for (int i = 0; i < nthreads; i++) {
    CHECK((reg[i] == EBB_OK || reg[i] == EBB_EINVAL));
    if (reg[i] == EBB_OK) won++, op = ops[i];
  }
  CHECK(won == 1);
  CHECK(ebb_custom_op_count() == 1);
  REQUIRE(op != nullptr);
  // Calls and backwards on every thread at once (CPU tensors: each thread's own leaves).
  std::vector<int> bad(nthreads, 0);
  {
    std::vector<std::thread> ts;
    for (int i = 0; i < nthreads; i++)
      ts.emplace_back([&, i] {
        int64_t n = 16;
        for (int step = 0; step < 50; step++) {
          ebb_tensor_t *x = nullptr, *w = nullptr, *s = nullptr, *gx = nullptr;
          ebb_tensor_t *out[2] = {nullptr, nullptr};
          bool ok = ebb_tensor_full(EBB_DEVICE_CPU, EBB_F64, 1, &n, 1.0 + i, &x) == EBB_OK &&
                    ebb_tensor_full(EBB_DEVICE_CPU, EBB_F64, 1, &n, 2.0, &w) == EBB_OK &&
                    ebb_tensor_set_requires_grad(x, true) == EBB_OK;
          const ebb_tensor_t *in[2] = {x, w};
          ebbtest_smul_params p = {0.5};
          ok = ok && ebb_custom_op_call(op, in, &p, out) == EBB_OK && ebb_op_sum(out[0], nullptr, 0, false, &s) == EBB_OK &&
               ebb_backward_one(s) == EBB_OK && ebb_tensor_grad(x, &gx) == EBB_OK && gx;
          double y[16] = {0}, g[16] = {0};
          if (ok) ok = ebb_tensor_to_host(out[0], y, sizeof y) == EBB_OK && ebb_tensor_to_host(gx, g, sizeof g) == EBB_OK;
          for (int k = 0; ok && k < 16; k++) ok = y[k] == 0.5 * (1.0 + i) * 2.0 && g[k] == 1.0;  // dy/dx = alpha * w
          if (!ok) bad[i]++;
          for (ebb_tensor_t *t : {x, w, s, gx, out[0], out[1]})
            if (t) ebb_tensor_release(t);
        }
      });
    for (auto &t : ts) t.join();
  }
  for (int i = 0; i < nthreads; i++) CHECK(bad[i] == 0);
  CHECK(ebb_autograd_live_nodes() == 0);
  REQUIRE(ebb_debug_live_handles() == 0);
}
