// test_simdrv_env.cpp: settings read at cuInit. test_simdrv_env runs with EBB_SIM_DEVICES=3,
// EBB_SIM_MEM=1G, the largest EBB_SIM_PERTURB seed, EBB_SIM_COMMIT=0 and EBB_SIM_VMM=0;
// test_simdrv_badenv with EBB_SIM_DEVICES=0, test_simdrv_badperturb(_junk) with EBB_SIM_PERTURB=-1
// and =7x, test_simdrv_badcommit with EBB_SIM_COMMIT=yes, test_simdrv_badvmm with EBB_SIM_VMM=2
// and test_simdrv_badfault_* with an EBB_SIM_FAULT naming an unknown entry point, a call number
// below 1 or an unknown CUresult (all EBB_SIMDRV_EXPECT_BAD_ENV=1).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <string>

#include "simdrv_loader.hpp"

TEST_CASE("environment: device count and capacity", "[simdrv][env]") {
  const SimDrv &d = drv();
  if (std::getenv("EBB_SIMDRV_EXPECT_BAD_ENV")) {
    // A bad setting fails cuInit, every time, and nothing else works. The driver prints
    // nothing; ebbsim_init_error names the variable and its value for ebb_init's message.
    CHECK(std::string(d.InitError()).empty());
    CU_EQ(d.Init(0), CUDA_ERROR_INVALID_VALUE);
    std::string why = d.InitError();
    INFO("ebbsim_init_error: " << why);
    const char *vars[] = {"EBB_SIM_DEVICES", "EBB_SIM_PERTURB", "EBB_SIM_COMMIT", "EBB_SIM_VMM", "EBB_SIM_FAULT"};
    bool named = false;
    for (const char *v : vars)
      if (const char *val = std::getenv(v))
        if (why.find(std::string(v) + "='" + val + "'") != std::string::npos) named = true;
    CHECK(named);
    CU_EQ(d.Init(0), CUDA_ERROR_INVALID_VALUE);
    int n = -1;
    CU_EQ(d.DeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    return;
  }
  int n = sim_setup();
  CHECK(n == 3);
  CHECK(std::string(d.InitError()).empty());
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

TEST_CASE("environment: EBB_SIM_COMMIT=0 leaves pages to first touch", "[simdrv][env][commit]") {
  if (std::getenv("EBB_SIMDRV_EXPECT_BAD_ENV")) return;  // the case above checks the bad setting
  const SimDrv &d = drv();
  sim_setup();
  const size_t n = 16 << 20;
  CUdeviceptr dev;
  CU_OK(d.MemAlloc(&dev, n));
  const void *p = reinterpret_cast<const void *>(dev);
  CHECK(mapped_pages(p, n) == 0);  // address space only: pages come at first touch
  std::memset(reinterpret_cast<void *>(dev), 1, n);
  CHECK(mapped_pages(p, n) == n / page());
  CU_OK(d.MemFree(dev));
}

TEST_CASE("environment: EBB_SIM_VMM=0 makes devices without VMM, whose VMM calls are refused", "[simdrv][env][vmm]") {
  if (std::getenv("EBB_SIMDRV_EXPECT_BAD_ENV")) return;  // the first case checks the bad setting
  const SimDrv &d = drv();
  int n = sim_setup();
  for (int i = 0; i < n; i++) {
    int v = -1;
    CU_OK(d.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, i));
    CHECK(v == 0);
  }
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  CU_EQ(d.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_ERROR_NOT_SUPPORTED);
  CUdeviceptr va = 0;
  CU_EQ(d.MemAddressReserve(&va, size_t(2) << 20, 0, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
  CUmemGenericAllocationHandle h = 0;
  CU_EQ(d.MemCreate(&h, size_t(2) << 20, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
  // Plain device memory still works.
  CUdeviceptr p = 0;
  CU_OK(d.MemAlloc(&p, 1 << 20));
  CU_OK(d.MemFree(p));
}
