// test_simdrv_mem.cpp: device memory, pinned and registered host memory, pointer attributes and
// VMM of the emulated driver (runtime/simdrv/sim_mem.c).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "simdrv_loader.hpp"

namespace {

template <class T>
T attr(CUpointer_attribute a, CUdeviceptr p) {
  T v{};
  CU_OK(drv().PointerGetAttribute(&v, a, p));
  return v;
}

CUmemAllocationProp dev_prop(int dev) {
  CUmemAllocationProp p;
  std::memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  return p;
}

const size_t G = size_t(2) << 20;  // the VMM granularity simdrv reports

}  // namespace

TEST_CASE("cuMemAlloc/cuMemFree: alignment, accounting, bad input", "[simdrv][mem]") {
  const SimDrv &d = drv();
  sim_setup();
  size_t free0, total;
  CU_OK(d.MemGetInfo(&free0, &total));
  CHECK(total == sim_default_capacity(2));
  CHECK(free0 == total);
  CUdeviceptr a, b;
  CU_OK(d.MemAlloc(&a, 1000));
  CU_OK(d.MemAlloc(&b, 3));
  CHECK(a % 256 == 0);
  CHECK(b % 256 == 0);
  std::memset(reinterpret_cast<void *>(a), 0x5a, 1000);  // host-addressable, as simdrv documents
  size_t free1;
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free0 - free1 == 1024 + 256);  // charged in 256-byte units
  // Device 1's accounting is separate.
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  size_t free_d1;
  CU_OK(d.MemGetInfo(&free_d1, &total));
  CHECK(free_d1 == total);
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.MemFree(a));
  CU_OK(d.MemFree(b));
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == free0);
  CU_EQ(d.MemFree(a), CUDA_ERROR_INVALID_VALUE);  // double free
  CU_EQ(d.MemFree(12345), CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr c;
  CU_OK(d.MemAlloc(&c, 4096));
  CU_EQ(d.MemFree(c + 256), CUDA_ERROR_INVALID_VALUE);  // interior pointer
  CU_OK(d.MemFree(c));
  CU_EQ(d.MemAlloc(&c, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemAlloc(nullptr, 16), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemAlloc(&c, total + 1), CUDA_ERROR_OUT_OF_MEMORY);  // past the capacity
  CU_EQ(d.MemGetInfo(nullptr, &total), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.MemAlloc(&c, 16), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.MemGetInfo(&free1, &total), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_CASE("freeing NULL succeeds as free(NULL) does with libcuda - unregistering NULL does not", "[simdrv][mem]") {
  const SimDrv &d = drv();
  sim_setup();
  size_t free0, free1, total;
  CU_OK(d.MemGetInfo(&free0, &total));
  CU_EQ(d.MemFree(0), CUDA_SUCCESS);
  CU_EQ(d.MemFreeHost(nullptr), CUDA_SUCCESS);
  CU_EQ(d.MemHostUnregister(nullptr), CUDA_ERROR_INVALID_VALUE);  // libcuda says so too
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == free0);
  // Twice, and with no context current: still nothing to do.
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.MemFree(0), CUDA_SUCCESS);
  CU_EQ(d.MemFreeHost(nullptr), CUDA_SUCCESS);
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  // A real pointer after the NULL frees is still freed exactly once.
  CUdeviceptr a;
  CU_OK(d.MemAlloc(&a, 4096));
  CU_OK(d.MemFree(a));
  CU_EQ(d.MemFree(a), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("memory is committed at allocation, as a GPU's: resident and mapped before first use",
          "[simdrv][mem][commit]") {
  const SimDrv &d = drv();
  sim_setup();
  // 16 MiB each: above a usual 8 MiB RLIMIT_MEMLOCK, so pinned memory cannot owe its pages to mlock.
  const size_t n = 16 << 20;
  CUdeviceptr dev;
  CU_OK(d.MemAlloc(&dev, n));
  const void *dp = reinterpret_cast<const void *>(dev);
  CHECK(resident_pages(dp, n) == n / page());
  CHECK(mapped_pages(dp, n) == n / page());
  void *pinned;
  CU_OK(d.MemHostAlloc(&pinned, n, CU_MEMHOSTALLOC_PORTABLE));
  CHECK(resident_pages(pinned, n) == n / page());
  CHECK(mapped_pages(pinned, n) == n / page());
  // VMM: cuMemCreate allocates the chunk's pages (the memfd's, which mincore counts only once
  // they are first written); cuMemSetAccess fills the page tables, so the mapping is in place
  // when access is granted, as on a GPU.
  CUmemAllocationProp prop = dev_prop(0);
  CUmemGenericAllocationHandle h;
  CU_OK(d.MemCreate(&h, 4 * G, &prop, 0));
  CUdeviceptr va;
  CU_OK(d.MemAddressReserve(&va, 4 * G, 0, 0, 0));
  CU_OK(d.MemMap(va, 4 * G, 0, h, 0));
  const void *vp = reinterpret_cast<const void *>(va);
  CUmemAccessDesc acc;
  std::memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(d.MemSetAccess(va, 4 * G, &acc, 1));
  CHECK(resident_pages(vp, 4 * G) == 4 * G / page());
  CHECK(mapped_pages(vp, 4 * G) == 4 * G / page());
  CU_OK(d.MemUnmap(va, 4 * G));
  CU_OK(d.MemRelease(h));
  CU_OK(d.MemAddressFree(va, 4 * G));
  CU_OK(d.MemFreeHost(pinned));
  CU_OK(d.MemFree(dev));
}

TEST_CASE("an allocation past capacity fails before committing anything", "[simdrv][mem][commit]") {
  const SimDrv &d = drv();
  sim_setup();
  size_t free0, total;
  CU_OK(d.MemGetInfo(&free0, &total));
  // Terabytes: were any of it committed first, this process would not survive to check.
  CUdeviceptr p;
  CU_EQ(d.MemAlloc(&p, size_t(1) << 42), CUDA_ERROR_OUT_OF_MEMORY);
  CUmemAllocationProp prop = dev_prop(0);
  CUmemGenericAllocationHandle h;
  CU_EQ(d.MemCreate(&h, size_t(1) << 42, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  size_t free1;
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == free0);
}

TEST_CASE("pointer attributes of device, pinned and registered memory", "[simdrv][mem][pointer]") {
  const SimDrv &d = drv();
  sim_setup();
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CUdeviceptr dp;
  CU_OK(d.MemAlloc(&dp, 10000));
  CHECK(attr<unsigned>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp + 5000) == CU_MEMORYTYPE_DEVICE);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dp + 9999) == 1);
  CHECK(attr<CUcontext>(CU_POINTER_ATTRIBUTE_CONTEXT, dp) == g_ctx[1]);
  CHECK(attr<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, dp + 123) == dp);
  CHECK(attr<size_t>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, dp + 123) == 10000);
  CHECK(attr<CUdeviceptr>(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, dp + 8) == dp + 8);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_IS_MANAGED, dp) == 0);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_MAPPED, dp) == 1);
  void *hp = nullptr;
  CU_EQ(d.PointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, dp), CUDA_ERROR_INVALID_VALUE);
  unsigned mt = 0;
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp + 10000), CUDA_ERROR_INVALID_VALUE);

  // Pinned host memory: host type, the allocating context's device.
  void *pinned = nullptr;
  CU_OK(d.MemHostAlloc(&pinned, 5000, CU_MEMHOSTALLOC_PORTABLE));
  std::memset(pinned, 1, 5000);
  auto pp = reinterpret_cast<CUdeviceptr>(pinned);
  CHECK(attr<unsigned>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pp + 4999) == CU_MEMORYTYPE_HOST);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pp) == 1);
  CHECK(attr<void *>(CU_POINTER_ATTRIBUTE_HOST_POINTER, pp + 1) == static_cast<char *>(pinned) + 1);
  CHECK(attr<size_t>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, pp + 10) == 5000);

  // Registered host memory.
  std::vector<char> host(3000);
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.MemHostRegister(host.data(), host.size(), 0));
  auto hr = reinterpret_cast<CUdeviceptr>(host.data());
  CHECK(attr<unsigned>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hr + 100) == CU_MEMORYTYPE_HOST);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, hr) == 0);
  CHECK(attr<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, hr + 2999) == hr);

  // Pageable memory is unknown to the driver, as in CUDA.
  int pageable = 0;
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(&pageable)),
        CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.PointerGetAttribute(nullptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.PointerGetAttribute(&mt, static_cast<CUpointer_attribute>(999), dp), CUDA_ERROR_INVALID_VALUE);

  CU_OK(d.MemHostUnregister(host.data()));
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hr), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemFreeHost(pinned));
  CU_OK(d.MemFree(dp));
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("pointer lookup stays right with many ranges", "[simdrv][mem][pointer]") {
  const SimDrv &d = drv();
  sim_setup();
  std::vector<CUdeviceptr> ptrs;
  for (int i = 0; i < 500; i++) {
    CUdeviceptr p;
    CU_OK(d.MemAlloc(&p, 100 + size_t(i)));
    ptrs.push_back(p);
  }
  for (int i = 0; i < 500; i += 2) CU_OK(d.MemFree(ptrs[i]));
  for (int i = 1; i < 500; i += 2) {
    CHECK(attr<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptrs[i] + 50) == ptrs[i]);
    CHECK(attr<size_t>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptrs[i]) == 100 + size_t(i));
  }
  unsigned mt;
  for (int i = 0; i < 500; i += 2)
    CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptrs[i]), CUDA_ERROR_INVALID_VALUE);
  for (int i = 1; i < 500; i += 2) CU_OK(d.MemFree(ptrs[i]));
}

TEST_CASE("pinned host memory: alloc, free, bad input", "[simdrv][mem][host]") {
  const SimDrv &d = drv();
  sim_setup();
  void *p = nullptr;
  CU_OK(d.MemHostAlloc(&p, 1 << 20, 0));
  REQUIRE(p != nullptr);
  std::memset(p, 7, 1 << 20);
  CU_EQ(d.MemFreeHost(static_cast<char *>(p) + 64), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemFreeHost(p));
  CU_EQ(d.MemFreeHost(p), CUDA_ERROR_INVALID_VALUE);
  int local;
  CU_EQ(d.MemFreeHost(&local), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostAlloc(nullptr, 16, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostAlloc(&p, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostAlloc(&p, 16, 0x100), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.MemHostAlloc(&p, 16, 0), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_CASE("host register: overlap, unregister, bad input", "[simdrv][mem][host]") {
  const SimDrv &d = drv();
  sim_setup();
  std::vector<char> buf(1 << 16);
  CU_OK(d.MemHostRegister(buf.data(), 4096, CU_MEMHOSTREGISTER_PORTABLE));
  CU_EQ(d.MemHostRegister(buf.data(), 4096, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  CU_EQ(d.MemHostRegister(buf.data() + 100, 10, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  CU_OK(d.MemHostRegister(buf.data() + 4096, 4096, 0));  // adjacent is fine
  CU_EQ(d.MemHostUnregister(buf.data() + 100), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  CU_OK(d.MemHostUnregister(buf.data()));
  CU_EQ(d.MemHostUnregister(buf.data()), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  CU_OK(d.MemHostUnregister(buf.data() + 4096));
  CU_EQ(d.MemHostRegister(nullptr, 16, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostRegister(buf.data(), 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostRegister(buf.data(), 16, 0x1000), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemHostUnregister(nullptr), CUDA_ERROR_INVALID_VALUE);
  // Device memory cannot be registered again.
  CUdeviceptr dp;
  CU_OK(d.MemAlloc(&dp, 4096));
  CU_EQ(d.MemHostRegister(reinterpret_cast<void *>(dp), 64, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  CU_OK(d.MemFree(dp));
}

TEST_CASE("VMM: reserve, create, map, set access, unmap, remap keeps contents", "[simdrv][vmm]") {
  const SimDrv &d = drv();
  sim_setup();
  CUmemAllocationProp prop = dev_prop(1);
  size_t g = 0;
  CU_OK(d.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CHECK(g == G);
  CU_OK(d.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CHECK(g == G);

  CUdeviceptr va;
  CU_OK(d.MemAddressReserve(&va, 4 * G, 0, 0, 0));
  CHECK(va % G == 0);
  CUmemGenericAllocationHandle h1, h2;
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  size_t free0, total;
  CU_OK(d.MemGetInfo(&free0, &total));
  CU_OK(d.MemCreate(&h1, 2 * G, &prop, 0));
  CU_OK(d.MemCreate(&h2, G, &prop, 0));
  size_t free1;
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free0 - free1 == 3 * G);  // physical memory is charged at create

  CU_OK(d.MemMap(va, 2 * G, 0, h1, 0));
  CU_OK(d.MemMap(va + 2 * G, G, 0, h2, 0));  // next to it: an expandable segment
  unsigned mt;
  CHECK(attr<unsigned>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + G) == CU_MEMORYTYPE_DEVICE);
  CHECK(attr<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va + 2 * G + 5) == 1);
  CHECK(attr<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, va + 2 * G + 5) == va + 2 * G);
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + 3 * G), CUDA_ERROR_INVALID_VALUE);

  CUmemAccessDesc acc;
  std::memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 1;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // No access yet: copies into the range are refused rather than faulting.
  std::vector<unsigned char> host(3 * G, 0xab);
  CU_EQ(d.MemcpyHtoDAsync(va, host.data(), 16, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemSetAccess(va, 3 * G, &acc, 1));
  // A copy may span both mappings.
  CU_OK(d.MemcpyHtoDAsync(va, host.data(), 3 * G, nullptr));
  CU_OK(d.CtxSynchronize());
  auto *bytes = reinterpret_cast<unsigned char *>(va);
  CHECK(bytes[0] == 0xab);
  CHECK(bytes[3 * G - 1] == 0xab);
  bytes[G + 17] = 0x11;

  // Unmap h1 and map it elsewhere in the reservation: the contents come along.
  CU_EQ(d.MemUnmap(va, G), CUDA_ERROR_INVALID_VALUE);  // not a whole mapping
  CU_OK(d.MemUnmap(va, 2 * G));
  CU_EQ(d.PointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemMap(va + 3 * G, 2 * G, 0, h1, 0), CUDA_ERROR_INVALID_VALUE);  // past the reservation
  CU_EQ(d.MemMap(va + G, 2 * G, 0, h1, 0), CUDA_ERROR_INVALID_VALUE);      // over h2's mapping, as libcuda
  CU_OK(d.MemMap(va, 2 * G, 0, h1, 0));
  CU_OK(d.MemSetAccess(va, 2 * G, &acc, 1));
  CHECK(bytes[G + 17] == 0x11);
  CHECK(bytes[2 * G - 1] == 0xab);

  // Release while mapped: memory stays until the last unmap, then capacity comes back.
  CU_OK(d.MemRelease(h1));
  CU_EQ(d.MemRelease(h1), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.MemMap(va + 3 * G, G, 0, h1, 0), CUDA_ERROR_INVALID_HANDLE);
  CHECK(bytes[G + 17] == 0x11);
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free0 - free1 == 3 * G);
  CU_EQ(d.MemAddressFree(va, 4 * G), CUDA_ERROR_INVALID_VALUE);  // still mapped
  CU_OK(d.MemUnmap(va, 3 * G));  // both mappings at once
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free0 - free1 == G);  // h1 gone, h2 still created
  CU_OK(d.MemRelease(h2));
  CU_OK(d.MemGetInfo(&free1, &total));
  CHECK(free1 == free0);
  CU_EQ(d.MemAddressFree(va, 2 * G), CUDA_ERROR_INVALID_VALUE);  // not the reserved size
  CU_OK(d.MemAddressFree(va, 4 * G));
  CU_EQ(d.MemAddressFree(va, 4 * G), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("VMM: bad input", "[simdrv][vmm]") {
  const SimDrv &d = drv();
  sim_setup();
  CUmemAllocationProp prop = dev_prop(0);
  size_t g;
  CU_EQ(d.MemGetAllocationGranularity(nullptr, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemGetAllocationGranularity(&g, nullptr, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemGetAllocationGranularity(&g, &prop, static_cast<CUmemAllocationGranularity_flags>(7)),
        CUDA_ERROR_INVALID_VALUE);
  CUmemAllocationProp bad = dev_prop(5);
  CU_EQ(d.MemGetAllocationGranularity(&g, &bad, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_ERROR_INVALID_DEVICE);

  CUdeviceptr va;
  CU_EQ(d.MemAddressReserve(&va, G + 1, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemAddressReserve(&va, 0, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemAddressReserve(nullptr, G, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemAddressReserve(&va, G, 3 * G, 0, 0), CUDA_ERROR_INVALID_VALUE);  // alignment not a power of 2
  CU_OK(d.MemAddressReserve(&va, 2 * G, 8 * G, 0, 0));
  CHECK(va % (8 * G) == 0);

  CUmemGenericAllocationHandle h;
  CU_EQ(d.MemCreate(&h, G / 2, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemCreate(nullptr, G, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemCreate(&h, G, nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemCreate(&h, G, &bad, 0), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.MemCreate(&h, size_t(16) << 30, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CU_OK(d.MemCreate(&h, G, &prop, 0));
  CU_EQ(d.MemMap(va + 1, G, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemMap(va, G, G, h, 0), CUDA_ERROR_INVALID_VALUE);  // offset past the chunk
  CU_EQ(d.MemMap(va, 2 * G, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  // longer than the chunk
  CU_EQ(d.MemMap(va, G, 0, 0xdeadbeef, 0), CUDA_ERROR_INVALID_HANDLE);
  int local;
  CU_EQ(d.MemMap(reinterpret_cast<CUdeviceptr>(&local) & ~(CUdeviceptr)(G - 1), G, 0, h, 0),
        CUDA_ERROR_INVALID_VALUE);  // not reserved
  CUmemAccessDesc acc;
  std::memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_EQ(d.MemSetAccess(va, G, &acc, 1), CUDA_ERROR_INVALID_VALUE);  // nothing mapped there
  CU_OK(d.MemMap(va, G, 0, h, 0));
  CU_EQ(d.MemSetAccess(va, 2 * G, &acc, 1), CUDA_ERROR_INVALID_VALUE);  // half unmapped
  CU_EQ(d.MemSetAccess(va, G, nullptr, 1), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemSetAccess(va, G, &acc, 0), CUDA_ERROR_INVALID_VALUE);
  CUmemAccessDesc badacc = acc;
  badacc.location.id = 9;
  CU_EQ(d.MemSetAccess(va, G, &badacc, 1), CUDA_ERROR_INVALID_DEVICE);
  badacc = acc;
  badacc.flags = static_cast<CUmemAccess_flags>(2);
  CU_EQ(d.MemSetAccess(va, G, &badacc, 1), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemSetAccess(va, G, &acc, 1));
  CU_EQ(d.MemUnmap(va + G, G), CUDA_ERROR_INVALID_VALUE);  // not mapped
  CU_EQ(d.MemRelease(0x1234), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.MemUnmap(va, G));
  CU_EQ(d.MemUnmap(va, G), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemRelease(h));
  CU_EQ(d.MemAddressFree(0, G), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemAddressFree(va, 2 * G));
}
