// Black-box tests of runtime.h and status.h: status table, errors, init/shutdown, driver choice,
// devices, guards and topology, on whatever driver EBB_DRIVER selects (the emulated driver with
// 2 devices on machines without a GPU).
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

#include "ebb/runtime.h"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "ebb/status.h"
#include "ebb_test_util.hpp"

TEST_CASE("status names and texts come from one table", "[runtime][status]") {
  CHECK(std::string(ebb_status_name(EBB_OK)) == "EBB_OK");
  CHECK(std::string(ebb_status_name(EBB_EINVAL)) == "EBB_EINVAL");
  CHECK(std::string(ebb_status_str(EBB_ENOMEM)) == "out of memory");
  CHECK(std::string(ebb_status_name((ebb_status)-999)) == "EBB_UNKNOWN");
  CHECK(std::string(ebb_status_str((ebb_status)42)) == "unknown status");
#define CHECK_ONE(name, value, text)                          \
  CHECK(std::string(ebb_status_name(EBB_##name)) == "EBB_" #name); \
  CHECK(std::string(ebb_status_str(EBB_##name)) == text);     \
  CHECK((int)EBB_##name == value);
  EBB_STATUS_MAP(CHECK_ONE)
#undef CHECK_ONE
}

static int g_hook_calls;
static ebb_status g_hook_status;
static void hook(ebb_status st, const char *msg, void *user) {
  g_hook_calls++;
  g_hook_status = st;
  CHECK(msg != nullptr);
  CHECK(user == &g_hook_calls);
}

TEST_CASE("calls before ebb_init fail with ENOTINIT and say what to do", "[runtime][init]") {
  REQUIRE_FALSE(ebb_is_initialized());
  int n = 0;
  EBB_CHECK_FAILS(ebb_dev_count(&n), EBB_ENOTINIT, "ebb_init");
  ebb_dev_caps caps;
  EBB_CHECK_FAILS(ebb_dev_get_caps(0, &caps), EBB_ENOTINIT, "ebb_dev_get_caps");
  EBB_CHECK_FAILS(ebb_dev_status(0), EBB_ENOTINIT, "ebb_dev_status");
  EBB_CHECK_FAILS(ebb_dev_set_current(0), EBB_ENOTINIT, "ebb_init");
  const ebb_kernel_t *k = nullptr;
  EBB_CHECK_FAILS(ebb_kernel_declare("k", 4, nullptr, "k", &k), EBB_ENOTINIT, "ebb_init");
  uint64_t p = 0;
  EBB_CHECK_FAILS(ebb__drv_mem_alloc(0, 16, &p), EBB_ENOTINIT, "ebb__drv_mem_alloc");
  ebb_driver_info info;
  EBB_CHECK_FAILS(ebb_driver_get_info(&info), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_ENOTINIT, "ebb_shutdown");
}

TEST_CASE("error hook sees every failure - last error is per thread", "[runtime][status]") {
  ebb_set_error_hook(hook, &g_hook_calls);
  g_hook_calls = 0;
  int n;
  CHECK(ebb_dev_count(&n) == EBB_ENOTINIT);
  CHECK(g_hook_calls == 1);
  CHECK(g_hook_status == EBB_ENOTINIT);
  ebb_set_error_hook(nullptr, nullptr);
  CHECK(ebb_dev_count(&n) == EBB_ENOTINIT);
  CHECK(g_hook_calls == 1);
  std::string other;
  std::thread t([&] { other = ebb_last_error(); });
  t.join();
  CHECK(other.empty());
  CHECK(std::string(ebb_last_error()).find("ebb_dev_count") != std::string::npos);
  ebb_clear_error();
  CHECK(std::string(ebb_last_error()).empty());
}

// Module start and stop order: test_runtime_modules.cpp.
TEST_CASE("init is reference-counted", "[runtime][init]") {
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK(ebb_is_initialized());
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK_FALSE(ebb_is_initialized());
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_ENOTINIT, "more ebb_shutdown");
  // A new init after a full shutdown works again.
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_shutdown());
}

TEST_CASE("EBB_DRIVER chooses the driver and reports why", "[runtime][driver]") {
  {
    ScopedEnv e("EBB_DRIVER", "bogus");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "bogus");
  }
  {
    ScopedEnv e("EBB_DRIVER", "/nonexistent/libcuda.so");
    EBB_CHECK_FAILS(ebb_init(), EBB_EDRIVER, "/nonexistent/libcuda.so");
  }
  {
    ScopedEnv e("EBB_DRIVER", "sim");
    EbbSession s;
    ebb_driver_info info;
    EBB_REQUIRE_OK(ebb_driver_get_info(&info));
    CHECK(info.kind == EBB_DRIVER_EMULATED);
    CHECK(std::string(info.name) == "simdrv");
    CHECK(std::string(info.reason) == "EBB_DRIVER=sim");
    CHECK(info.version >= 12000);
    CHECK(info.device_count == 2);
    EBB_CHECK_FAILS(ebb_driver_get_info(nullptr), EBB_EINVAL, "NULL");
  }
  {
    ScopedEnv e("EBB_DRIVER", nullptr);
    EbbSession s;
    ebb_driver_info info;
    EBB_REQUIRE_OK(ebb_driver_get_info(&info));
    CHECK(std::string(info.reason).rfind("auto:", 0) == 0);
    if (info.kind == EBB_DRIVER_EMULATED) {
      // No GPU here: the reason says what happened to libcuda.so.1.
      CHECK(std::string(info.reason).find("libcuda.so.1") != std::string::npos);
    }
  }
  {
    // The CUDA toolkit's stub libcuda loads but its cuInit fails: that must read as "no GPU".
    const char *stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
    if (access(stub, R_OK) == 0) {
      ScopedEnv e("EBB_DRIVER", stub);
      EBB_CHECK_FAILS(ebb_init(), EBB_EDRIVER, "CUDA_ERROR_STUB_LIBRARY (34): no GPU here");
    }
  }
  {
    ScopedEnv e("EBB_DRIVER", "sim");
    ScopedEnv p("EBB_SIMDRV_PATH", "/nonexistent/libebb_simdrv.so");
    EBB_CHECK_FAILS(ebb_init(), EBB_ENOTFOUND, "/nonexistent/libebb_simdrv.so");
  }
}

TEST_CASE("devices: count, capabilities, bad ordinals", "[runtime][device]") {
  EbbSession s;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  REQUIRE(n >= 1);
  for (int d = 0; d < n; d++) {
    ebb_dev_caps c;
    EBB_REQUIRE_OK(ebb_dev_get_caps(d, &c));
    CHECK(c.ordinal == d);
    CHECK(std::strlen(c.name) > 0);
    CHECK(c.total_mem > 0);
    CHECK(c.prio_greatest <= c.prio_least);
    CHECK(c.unified_addressing);
    CHECK(c.mem_clock_khz >= 0);
    CHECK(c.mem_bus_bits >= 0);
    if (c.emulated) {
      CHECK(c.cpu_kernels);
      CHECK(c.async_engines >= 2);
      CHECK(c.peak_mem_gbps == 0.0);  // the host's memory: no device peak to judge against
    } else if (c.mem_clock_khz > 0 && c.mem_bus_bits > 0) {
      CHECK(c.peak_mem_gbps == Approx(2.0 * c.mem_clock_khz * 1e3 * c.mem_bus_bits / 8 / 1e9));
    }
  }
  ebb_dev_caps c;
  EBB_CHECK_FAILS(ebb_dev_get_caps(n, &c), EBB_EDEVICE, std::to_string(n));
  EBB_CHECK_FAILS(ebb_dev_get_caps(-1, &c), EBB_EDEVICE, "-1");
  EBB_CHECK_FAILS(ebb_dev_get_caps(0, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_dev_count(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_dev_set_current(n + 3), EBB_EDEVICE, std::to_string(n + 3));
  size_t fr = 0, tot = 0;
  EBB_REQUIRE_OK(ebb_dev_mem_info(0, &fr, &tot));
  CHECK(tot > 0);
  CHECK(fr <= tot);
  EBB_CHECK_FAILS(ebb_dev_mem_info(0, nullptr, &tot), EBB_EINVAL, "non-NULL");
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  EBB_CHECK_FAILS(ebb_dev_synchronize(n), EBB_EDEVICE, "does not exist");
  EBB_REQUIRE_OK(ebb_dev_status(0));  // a healthy device
  EBB_CHECK_FAILS(ebb_dev_status(n), EBB_EDEVICE, "ebb_dev_status");
  EBB_CHECK_FAILS(ebb_dev_status(-1), EBB_EDEVICE, "-1");
}

TEST_CASE("current device is per thread - guards nest and restore", "[runtime][device]") {
  EbbSession s;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  int cur = -1;
  EBB_REQUIRE_OK(ebb_dev_get_current(&cur));
  CHECK(cur == 0);
  int last = n - 1;
  EBB_REQUIRE_OK(ebb_dev_set_current(last));
  int other = -1;
  std::thread t([&] { ebb_dev_get_current(&other); });
  t.join();
  CHECK(other == 0);
  ebb_dev_guard g1, g2;
  EBB_REQUIRE_OK(ebb_dev_guard_enter(&g1, 0));
  EBB_REQUIRE_OK(ebb_dev_get_current(&cur));
  CHECK(cur == 0);
  EBB_REQUIRE_OK(ebb_dev_guard_enter(&g2, last));
  EBB_REQUIRE_OK(ebb_dev_get_current(&cur));
  CHECK(cur == last);
  EBB_REQUIRE_OK(ebb_dev_guard_exit(&g2));
  EBB_REQUIRE_OK(ebb_dev_get_current(&cur));
  CHECK(cur == 0);
  EBB_REQUIRE_OK(ebb_dev_guard_exit(&g1));
  EBB_REQUIRE_OK(ebb_dev_get_current(&cur));
  CHECK(cur == last);
  EBB_CHECK_FAILS(ebb_dev_guard_exit(&g1), EBB_ESTATE, "already exited");
  EBB_CHECK_FAILS(ebb_dev_guard_enter(nullptr, 0), EBB_EINVAL, "NULL");
  ebb_dev_guard g3;
  EBB_CHECK_FAILS(ebb_dev_guard_enter(&g3, n), EBB_EDEVICE, "does not exist");
  EBB_REQUIRE_OK(ebb_dev_set_current(0));
}

TEST_CASE("peer access between devices", "[runtime][device]") {
  EbbSession s;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  bool can = true;
  EBB_REQUIRE_OK(ebb_dev_can_access_peer(0, 0, &can));
  CHECK_FALSE(can);
  EBB_CHECK_FAILS(ebb_dev_enable_peer(0, 0), EBB_EINVAL, "same");
  EBB_CHECK_FAILS(ebb_dev_can_access_peer(0, n, &can), EBB_EDEVICE, "peer");
  if (n < 2) return;
  EBB_REQUIRE_OK(ebb_dev_can_access_peer(0, 1, &can));
  if (can) {
    EBB_REQUIRE_OK(ebb_dev_enable_peer(0, 1));
    EBB_REQUIRE_OK(ebb_dev_enable_peer(0, 1)); // idempotent
  }
}

TEST_CASE("topology: nearest NUMA node and cores - binding", "[runtime][topo]") {
  EbbSession s;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  for (int d = 0; d < n; d++) {
    ebb_topo t;
    EBB_REQUIRE_OK(ebb_dev_get_topo(d, &t));
    CHECK(t.numa_node >= 0);
    CHECK(t.numa_node < t.numa_nodes);
    CHECK(t.ncores >= 1);
    CHECK(std::strlen(t.cpus) > 0);
  }
  ebb_topo t;
  EBB_CHECK_FAILS(ebb_dev_get_topo(n, &t), EBB_EDEVICE, "does not exist");
  EBB_CHECK_FAILS(ebb_dev_get_topo(0, nullptr), EBB_EINVAL, "NULL");
  std::thread th([] {
    ebb_status st = ebb_thread_bind_device(0);
    CHECK((st == EBB_OK || st == EBB_ENOTSUP));
  });
  th.join();
  EBB_CHECK_FAILS(ebb_thread_bind_device(-2), EBB_EDEVICE, "-2");
}

// A muted step (a best-effort one inside a call that succeeds) keeps its failure for the scope
// that muted it, which may report it as a warning: a mute nested inside, after the failure, must
// not wipe it, and the caller's last error stays untouched throughout.
extern "C" {  // as runtime/export/ebb_internal.h declares them (C++ tests cannot include it)
ebb_status ebb__fail(ebb_status status, const char *fmt, ...);
void ebb__fail_mute(bool on);
const char *ebb__muted_error(void);
}

TEST_CASE("a nested mute keeps the failure the outer muted scope captured", "[runtime][errors]") {
  CHECK(ebb_dev_synchronize(-3) != EBB_OK);  // the caller's own last error
  const std::string mine = ebb_last_error();
  ebb__fail_mute(true);
  CHECK(ebb__fail(EBB_EINVAL, "the outer step failed") == EBB_EINVAL);
  ebb__fail_mute(true);  // a best-effort step after it, which succeeds
  ebb__fail_mute(false);
  CHECK(std::string(ebb__muted_error()) == "the outer step failed");
  ebb__fail_mute(false);
  CHECK(std::string(ebb_last_error()) == mine);
}
