// test_simdrv_oom.cpp: the capacity limit (EBB_SIM_MEM=64M set by CMake for this executable):
// allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY and freeing gives the memory back.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "simdrv_loader.hpp"

namespace {
const size_t MiB = size_t(1) << 20;
}

TEST_CASE("OOM at capacity and recovery after free", "[simdrv][oom]") {
  const SimDrv &d = drv();
  sim_setup();
  size_t free0, total;
  CU_OK(d.MemGetInfo(&free0, &total));
  CHECK(total == 64 * MiB);
  CHECK(free0 == 64 * MiB);
  size_t t1;
  CU_OK(d.DeviceTotalMem(&t1, 1));
  CHECK(t1 == 64 * MiB);
  std::vector<CUdeviceptr> blocks;
  for (int i = 0; i < 8; i++) {
    CUdeviceptr p;
    CU_OK(d.MemAlloc(&p, 8 * MiB));
    blocks.push_back(p);
  }
  CUdeviceptr p;
  CU_EQ(d.MemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
  size_t free1;
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == 0);
  // The other device is unaffected.
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CU_OK(d.MemAlloc(&p, 32 * MiB));
  CU_OK(d.MemFree(p));
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  // Free one block: exactly that much fits again.
  CU_OK(d.MemFree(blocks.back()));
  blocks.pop_back();
  CU_EQ(d.MemAlloc(&p, 8 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
  CU_OK(d.MemAlloc(&p, 8 * MiB));
  blocks.push_back(p);
  for (CUdeviceptr b : blocks) CU_OK(d.MemFree(b));
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == 64 * MiB);
  CU_OK(d.MemAlloc(&p, 64 * MiB));  // all of it
  CU_OK(d.MemFree(p));
}

TEST_CASE("VMM chunks count against capacity until released and unmapped", "[simdrv][oom][vmm]") {
  const SimDrv &d = drv();
  sim_setup();
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle h1, h2;
  CU_OK(d.MemCreate(&h1, 48 * MiB, &prop, 0));
  CU_EQ(d.MemCreate(&h2, 32 * MiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CUdeviceptr p;
  CU_EQ(d.MemAlloc(&p, 32 * MiB), CUDA_ERROR_OUT_OF_MEMORY);  // one budget for both kinds
  CUdeviceptr va;
  CU_OK(d.MemAddressReserve(&va, 48 * MiB, 0, 0, 0));
  CU_OK(d.MemMap(va, 48 * MiB, 0, h1, 0));
  CU_OK(d.MemRelease(h1));
  CU_EQ(d.MemCreate(&h2, 32 * MiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);  // still mapped
  CU_OK(d.MemUnmap(va, 48 * MiB));
  CU_OK(d.MemCreate(&h2, 32 * MiB, &prop, 0));  // recovered
  CU_OK(d.MemRelease(h2));
  CU_OK(d.MemAddressFree(va, 48 * MiB));
  size_t free1, total;
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == total);
}
