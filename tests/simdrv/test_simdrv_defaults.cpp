// test_simdrv_defaults.cpp: the default capacity (EBB_SIM_MEM unset) with many devices
// (EBB_SIM_DEVICES=16 set by CMake for this executable). simdrv commits memory at allocation, so
// every emulated device full must fit in the host's memory: a full device then meets
// CUDA_ERROR_OUT_OF_MEMORY from the driver, never the kernel's OOM killer.
#include <catch2/catch.hpp>

#include <cstdlib>

#include "simdrv_loader.hpp"

TEST_CASE("default capacity: every device full fits in the host's memory", "[simdrv][env][commit]") {
  unsetenv("EBB_SIM_MEM");  // read at cuInit, below
  const SimDrv &d = drv();
  int n = sim_setup();
  REQUIRE(n == 16);
  const size_t host = host_memory_bytes();
  size_t sum = 0;
  for (int i = 0; i < n; i++) {
    size_t total = 0;
    CU_OK(d.DeviceTotalMem(&total, i));
    INFO("device " << i << ": " << total << " bytes of a host's " << host);
    CHECK(total == sim_default_capacity(n));
    CHECK(total % (size_t(2) << 20) == 0);  // whole VMM granules
    CHECK(total <= (size_t(8) << 30));
    sum += total;
  }
  INFO(n << " devices hold " << sum << " bytes of a host's " << host);
  CHECK(sum <= host / 4 * 3);  // a quarter left to the program's own memory and the system
}
