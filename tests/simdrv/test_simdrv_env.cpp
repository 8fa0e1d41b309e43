// test_simdrv_env.cpp: settings read at cuInit. test_simdrv_env runs with EBB_SIM_DEVICES=3,
// EBB_SIM_MEM=1G and the largest EBB_SIM_PERTURB seed; test_simdrv_badenv with EBB_SIM_DEVICES=0,
// test_simdrv_badperturb(_junk) with EBB_SIM_PERTURB=-1 and =7x (EBB_SIMDRV_EXPECT_BAD_ENV=1).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "simdrv_loader.hpp"

TEST_CASE("environment: device count and capacity", "[simdrv][env]") {
  const SimDrv &d = drv();
  if (std::getenv("EBB_SIMDRV_EXPECT_BAD_ENV")) {
    // A bad setting fails cuInit, every time, and nothing else works.
    CU_EQ(d.Init(0), CUDA_ERROR_INVALID_VALUE);
    CU_EQ(d.Init(0), CUDA_ERROR_INVALID_VALUE);
    int n = -1;
    CU_EQ(d.DeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    return;
  }
  int n = sim_setup();
  CHECK(n == 3);
  for (int i = 0; i < n; i++) {
    size_t total = 0;
    CU_OK(d.DeviceTotalMem(&total, i));
    CHECK(total == (size_t(1) << 30));
  }
  char name[64];
  CU_OK(d.DeviceGetName(name, sizeof name, 2));
  CHECK(std::string(name) == "ebb simdrv device 2");
  CUdevice dev;
  CU_EQ(d.DeviceGet(&dev, 3), CUDA_ERROR_INVALID_DEVICE);
}
