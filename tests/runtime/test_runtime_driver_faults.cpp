// test_runtime_driver_faults.cpp: what ebb makes of a failing driver call, with faults injected
// by the emulated driver (EBB_SIM_FAULT). A failure ends in a clean status and a message naming
// the CUDA error, and the calls after it are untouched by it; a sticky error (a kernel's fault
// on a GPU) puts the device in an error state that every later call reports at once, and
// ebb_shutdown still completes.
//
// The driver reads EBB_SIM_FAULT once per process, at its cuInit, so each case sets it before
// its first ebb_init and needs a process of its own, as ctest gives every case. Run together,
// the cases after the first skip themselves with a warning.
#include <cstdlib>
#include <string>

#include "ebb/runtime.h"
#include "ebb/status.h"
#include "ebb_test_util.hpp"
#include "sim_fault_env.hpp"

namespace {

struct HookCount {
  int calls = 0;
  std::string last;
  static void fn(ebb_status, const char *m, void *user) {
    auto *h = static_cast<HookCount *>(user);
    h->calls++;
    h->last = m;
  }
  HookCount() { ebb_set_error_hook(fn, this); }
  ~HookCount() { ebb_set_error_hook(nullptr, nullptr); }
};

}  // namespace

TEST_CASE("a failing driver call ends in a clean status naming the CUDA error, and the next call is untouched by it",
          "[runtime][driver][fault]") {
  if (!faults_for_this_process("cuMemGetInfo:2:CUDA_ERROR_UNKNOWN")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EbbSession session;
  HookCount hook;
  size_t f = 0, t = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &f, &t));
  ebb_clear_error();
  size_t f2 = 1, t2 = 1;
  ebb_status st = ebb_dev_mem_info(0, &f2, &t2);
  std::string msg = ebb_last_error();
  INFO(ebb_status_name(st) << ": " << msg);
  CHECK(st == EBB_EDRIVER);
  CHECK(msg.find("ebb_dev_mem_info") != std::string::npos);
  CHECK(msg.find("cuMemGetInfo") != std::string::npos);
  CHECK(msg.find("CUDA_ERROR_UNKNOWN") != std::string::npos);
  CHECK(f2 == 1);  // out-parameters written only on success
  CHECK(t2 == 1);
  CHECK(hook.calls == 1);
  CHECK(hook.last == msg);
  // Not sticky: the device works on, and a call that succeeds leaves the message and the hook alone.
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &f2, &t2));
  CHECK(t2 == t);
  CHECK(std::string(ebb_last_error()) == msg);
  CHECK(hook.calls == 1);
  EBB_REQUIRE_OK(ebb_dev_status(0));
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  CHECK(hook.calls == 1);
}

TEST_CASE("a sticky driver error puts the device in an error state that every later call reports at once",
          "[runtime][driver][fault][sticky]") {
  // The first cuCtxSynchronize fails with the default for a non-allocation: LAUNCH_FAILED.
  if (!faults_for_this_process("cuCtxSynchronize:1")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EBB_REQUIRE_OK(ebb_init());
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  REQUIRE(n >= 2);
  const std::string state =
      "device 0 is in an error state after CUDA_ERROR_LAUNCH_FAILED in cuCtxSynchronize; release every handle and call "
      "ebb_shutdown";
  EBB_CHECK_FAILS(ebb_dev_synchronize(0), EBB_EDEVICE, "ebb_dev_synchronize: " + state);
  // From now on device 0 answers at once with its state, whatever the call.
  EBB_CHECK_FAILS(ebb_dev_status(0), EBB_EDEVICE, "ebb_dev_status: " + state);
  EBB_CHECK_FAILS(ebb_dev_synchronize(0), EBB_EDEVICE, "ebb_dev_synchronize: " + state);
  size_t f = 0, t = 0;
  EBB_CHECK_FAILS(ebb_dev_mem_info(0, &f, &t), EBB_EDEVICE, "ebb_dev_mem_info: " + state);
  // Device 1 works on.
  EBB_REQUIRE_OK(ebb_dev_status(1));
  EBB_REQUIRE_OK(ebb_dev_synchronize(1));
  EBB_REQUIRE_OK(ebb_dev_mem_info(1, &f, &t));
  // Shutdown completes; the last one destroys the contexts, so a new init starts afresh.
  EBB_REQUIRE_OK(ebb_shutdown());
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_dev_status(0));
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_REQUIRE_OK(ebb_shutdown());
}

TEST_CASE("a device attribute the driver fails to report fails ebb_init naming it, never a device read as emulated",
          "[runtime][driver][fault]") {
  // Read as 0, a compute capability would make a GPU look emulated, a VMM attribute turn off
  // expandable segments: the failure is ebb_init's.
  if (!faults_for_this_process("cuDeviceGetAttribute:1:CUDA_ERROR_INVALID_VALUE")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  HookCount hook;
  ebb_clear_error();
  ebb_status st = ebb_init();
  std::string msg = ebb_last_error();
  INFO(ebb_status_name(st) << ": " << msg);
  CHECK(st != EBB_OK);
  CHECK(msg.find("ebb_init") != std::string::npos);
  CHECK(msg.find("cuDeviceGetAttribute(") != std::string::npos);
  CHECK(msg.find("CUDA_ERROR_INVALID_VALUE") != std::string::npos);
  CHECK(hook.calls == 1);
  // The fault fired once: the next ebb_init finds every attribute.
  EBB_REQUIRE_OK(ebb_init());
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  CHECK(caps.emulated);
  EBB_REQUIRE_OK(ebb_shutdown());
}

TEST_CASE("a second device's sticky error is that device's error state, not the first failed device's",
          "[runtime][driver][fault][sticky]") {
  // The first two cuCtxSynchronize calls fail (LAUNCH_FAILED): device 0's, then device 1's.
  if (!faults_for_this_process("cuCtxSynchronize:1,cuCtxSynchronize:2")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  EBB_REQUIRE_OK(ebb_init());
  EBB_CHECK_FAILS(ebb_dev_synchronize(0), EBB_EDEVICE, "device 0 is in an error state");
  EBB_CHECK_FAILS(ebb_dev_synchronize(1), EBB_EDEVICE, "device 1 is in an error state");
  EBB_CHECK_FAILS(ebb_dev_status(1), EBB_EDEVICE, "ebb_dev_status: device 1 is in an error state");
  EBB_CHECK_FAILS(ebb_dev_status(0), EBB_EDEVICE, "ebb_dev_status: device 0 is in an error state");
  EBB_REQUIRE_OK(ebb_shutdown());
}

TEST_CASE("a failing device count fails ebb_init naming cuDeviceGetCount and the CUDA error, never \"no device\"",
          "[runtime][driver][fault]") {
  if (!faults_for_this_process("cuDeviceGetCount:1")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  ebb_status st = ebb_init();
  std::string msg = ebb_last_error();
  INFO(ebb_status_name(st) << ": " << msg);
  CHECK(st != EBB_OK);
  CHECK(msg.find("cuDeviceGetCount failed with CUDA_ERROR_LAUNCH_FAILED") != std::string::npos);
  CHECK(msg.find("no device") == std::string::npos);
  CHECK_FALSE(ebb_is_initialized());
}

TEST_CASE("a sticky fault met making a device's context current is that device's error state, not the device left",
          "[runtime][driver][fault][sticky]") {
  // ebb_init makes device 0's context current, then device 1's (the second call).
  if (!faults_for_this_process("cuCtxSetCurrent:2")) return;
  ScopedEnv drv("EBB_DRIVER", "sim");
  ebb_status st = ebb_init();
  std::string msg = ebb_last_error();
  INFO(ebb_status_name(st) << ": " << msg);
  REQUIRE(st == EBB_EDEVICE);
  CHECK(msg.find("device 1 is in an error state after CUDA_ERROR_LAUNCH_FAILED in cuCtxSetCurrent") != std::string::npos);
  CHECK(msg.find("device 0 is in an error state") == std::string::npos);
}
