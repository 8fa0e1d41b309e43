// test_simdrv_core.cpp: initialisation, error names, devices and attributes, primary contexts,
// stream priority range and peer access of the emulated driver (runtime/simdrv/sim_core.c).
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <thread>

#include "simdrv_loader.hpp"

TEST_CASE("calls before cuInit return NOT_INITIALIZED", "[simdrv][init]") {
  const SimDrv &d = drv();
  int n = -1;
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr p;
  CUstream s;
  CUevent e;
  CU_EQ(d.DeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
  CHECK(n == -1);
  CU_EQ(d.DeviceGet(&dev, 0), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.DevicePrimaryCtxRetain(&ctx, 0), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.CtxSetCurrent(nullptr), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.MemAlloc(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.StreamCreateWithPriority(&s, 0, 0), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.EventCreate(&e, 0), CUDA_ERROR_NOT_INITIALIZED);
  CU_EQ(d.StreamSynchronize(nullptr), CUDA_ERROR_NOT_INITIALIZED);
  // What works without cuInit, as in CUDA: the version, error names, kernel registration.
  int v = 0;
  CU_OK(d.DriverGetVersion(&v));
  CHECK(v == 13000);
  const char *name = nullptr;
  CU_OK(d.GetErrorName(CUDA_ERROR_NOT_INITIALIZED, &name));
  CHECK(std::string(name) == "CUDA_ERROR_NOT_INITIALIZED");
  CU_EQ(d.Init(1), CUDA_ERROR_INVALID_VALUE);  // flags must be 0
  CU_EQ(d.DeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
  CU_OK(d.Init(0));
  CU_OK(d.Init(0));  // again: fine
  CU_OK(d.DeviceGetCount(&n));
  CHECK(n == 2);  // EBB_SIM_DEVICES=2 from the test environment
}

TEST_CASE("error names and strings cover every CUresult", "[simdrv][errors]") {
  const SimDrv &d = drv();
  const CUresult all[] = {CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY,
                          CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_STUB_LIBRARY,
                          CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_IMAGE,
                          CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_ALREADY_CURRENT, CUDA_ERROR_ALREADY_MAPPED,
                          CUDA_ERROR_NOT_MAPPED, CUDA_ERROR_NOT_MAPPED_AS_POINTER,
                          CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, CUDA_ERROR_INVALID_PTX, CUDA_ERROR_INVALID_SOURCE,
                          CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_ILLEGAL_STATE,
                          CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_READY, CUDA_ERROR_ILLEGAL_ADDRESS,
                          CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                          CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
                          CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                          CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, CUDA_ERROR_LAUNCH_FAILED,
                          CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
                          CUDA_ERROR_UNKNOWN};
  for (CUresult r : all) {
    const char *name = nullptr, *text = nullptr;
    CU_OK(d.GetErrorName(r, &name));
    CU_OK(d.GetErrorString(r, &text));
    REQUIRE(name != nullptr);
    REQUIRE(text != nullptr);
    CHECK(std::strncmp(name, "CUDA_", 5) == 0);
    CHECK(std::strlen(text) > 3);
  }
  const char *s = nullptr;
  CU_OK(d.GetErrorName(CUDA_ERROR_INVALID_VALUE, &s));
  CHECK(std::string(s) == "CUDA_ERROR_INVALID_VALUE");
  CU_OK(d.GetErrorString(CUDA_ERROR_INVALID_VALUE, &s));
  CHECK(std::string(s) == "invalid argument");
  s = "x";
  CU_EQ(d.GetErrorName(static_cast<CUresult>(12345), &s), CUDA_ERROR_INVALID_VALUE);
  CHECK(s == nullptr);
  s = "x";
  CU_EQ(d.GetErrorString(static_cast<CUresult>(12345), &s), CUDA_ERROR_INVALID_VALUE);
  CHECK(s == nullptr);
  CU_EQ(d.GetErrorName(CUDA_SUCCESS, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.GetErrorString(CUDA_SUCCESS, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DriverGetVersion(nullptr), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("devices: count, names, memory, PCI ids and bad ordinals", "[simdrv][device]") {
  const SimDrv &d = drv();
  int n = sim_setup();
  REQUIRE(n == 2);
  for (int i = 0; i < n; i++) {
    CUdevice dev = -1;
    CU_OK(d.DeviceGet(&dev, i));
    CHECK(dev == i);
    char name[64];
    CU_OK(d.DeviceGetName(name, sizeof name, dev));
    CHECK(std::string(name) == "ebb simdrv device " + std::to_string(i));
    size_t total = 0;
    CU_OK(d.DeviceTotalMem(&total, dev));
    CHECK(total == sim_default_capacity(n));  // default EBB_SIM_MEM
    char bus[32];
    CU_OK(d.DeviceGetPCIBusId(bus, sizeof bus, dev));
    CHECK(std::string(bus) == "0000:" + std::to_string(100 + i) + ":00.0");
  }
  char small[6];
  CU_OK(d.DeviceGetName(small, sizeof small, 1));  // truncated, terminated
  CHECK(std::string(small) == "ebb s");
  CUdevice dev;
  char name[64];
  size_t total;
  CU_EQ(d.DeviceGet(&dev, 2), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceGet(&dev, -1), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceGet(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceGetCount(nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceGetName(name, sizeof name, 7), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceGetName(nullptr, 10, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceGetName(name, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceTotalMem(&total, 9), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceTotalMem(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceGetPCIBusId(name, sizeof name, 5), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceGetPCIBusId(nullptr, 16, 0), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("device attributes", "[simdrv][device]") {
  const SimDrv &d = drv();
  sim_setup();
  auto attr = [&](CUdevice_attribute a, CUdevice dev = 1) {
    int v = -12345;
    CU_OK(d.DeviceGetAttribute(&v, a, dev));
    return v;
  };
  CHECK(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) == static_cast<int>(std::thread::hardware_concurrency()));
  CHECK(attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT) == 2);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE) == 32);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK) == 1024);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0) == 0x100);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1) == 0x101);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_INTEGRATED) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_CLOCK_RATE) > 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) > 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) > 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE) > 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_NUMA_ID) == -1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) == -1);
  int v = 7;
  CU_EQ(d.DeviceGetAttribute(&v, static_cast<CUdevice_attribute>(9999), 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DeviceGetAttribute(&v, static_cast<CUdevice_attribute>(2), 0), CUDA_ERROR_INVALID_VALUE);
  CHECK(v == 7);  // untouched on failure
  CU_EQ(d.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 2), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceGetAttribute(nullptr, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0), CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("primary contexts: retain, release, current per thread, device, reset", "[simdrv][ctx]") {
  const SimDrv &d = drv();
  CU_OK(d.Init(0));
  // Start from no retains and no current context, whatever ran before in this process.
  for (int dev = 0; dev < 2; dev++)
    for (int i = 0; i < 1000 && d.DevicePrimaryCtxRelease(dev) == CUDA_SUCCESS; i++) {
    }
  std::thread([&] {
    CUcontext fresh = reinterpret_cast<CUcontext>(0x1);
    CHECK(d.CtxGetCurrent(&fresh) == CUDA_SUCCESS);
    CHECK(fresh == nullptr);  // nothing current on a new thread
  }).join();
  CU_OK(d.CtxSetCurrent(nullptr));
  CUcontext cur = reinterpret_cast<CUcontext>(0x1);
  CU_OK(d.CtxGetCurrent(&cur));
  CHECK(cur == nullptr);
  CUdevice dev;
  CU_EQ(d.CtxGetDevice(&dev), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.CtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
  CUcontext c0, c0b, c1;
  CU_OK(d.DevicePrimaryCtxRetain(&c0, 0));
  CU_OK(d.DevicePrimaryCtxRetain(&c0b, 0));
  CU_OK(d.DevicePrimaryCtxRetain(&c1, 1));
  CHECK(c0 == c0b);  // one primary context per device
  CHECK(c0 != c1);
  CU_OK(d.CtxSetCurrent(c1));
  CU_OK(d.CtxGetCurrent(&cur));
  CHECK(cur == c1);
  CU_OK(d.CtxGetDevice(&dev));
  CHECK(dev == 1);
  CU_OK(d.CtxSynchronize());
  // The current context is per thread.
  std::thread([&] {
    CUcontext other = reinterpret_cast<CUcontext>(0x1);
    CHECK(d.CtxGetCurrent(&other) == CUDA_SUCCESS);
    CHECK(other == nullptr);
    CHECK(d.CtxSetCurrent(c0) == CUDA_SUCCESS);
    CUdevice od = -1;
    CHECK(d.CtxGetDevice(&od) == CUDA_SUCCESS);
    CHECK(od == 0);
  }).join();
  CU_OK(d.CtxGetDevice(&dev));
  CHECK(dev == 1);
  // Refcounting: two retains of device 0, two releases; a third is one too many.
  CU_OK(d.DevicePrimaryCtxRelease(0));
  CU_OK(d.DevicePrimaryCtxRelease(0));
  CU_EQ(d.DevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(d.DevicePrimaryCtxReset(1));
  CU_EQ(d.DevicePrimaryCtxRelease(1), CUDA_ERROR_INVALID_CONTEXT);  // reset dropped the retain
  // Bad input.
  CU_EQ(d.DevicePrimaryCtxRetain(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.DevicePrimaryCtxRetain(&c0, 2), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DevicePrimaryCtxRelease(-1), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DevicePrimaryCtxReset(16), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.CtxSetCurrent(reinterpret_cast<CUcontext>(0x1234)), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.CtxGetCurrent(nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.CtxGetDevice(nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_OK(d.CtxGetCurrent(&cur));
  CHECK(cur == nullptr);
}

TEST_CASE("stream priority range", "[simdrv][ctx]") {
  const SimDrv &d = drv();
  sim_setup();
  int least = 99, greatest = 99;
  CU_OK(d.CtxGetStreamPriorityRange(&least, &greatest));
  CHECK(least == 0);
  CHECK(greatest == -5);
  least = 99;
  CU_OK(d.CtxGetStreamPriorityRange(&least, nullptr));  // either may be NULL
  CHECK(least == 0);
  CU_OK(d.CtxGetStreamPriorityRange(nullptr, &greatest));
  CHECK(greatest == -5);
}

TEST_CASE("peer access: can-access, enable, disable", "[simdrv][peer]") {
  const SimDrv &d = drv();
  sim_setup();
  int can = -1;
  CU_OK(d.DeviceCanAccessPeer(&can, 0, 1));
  CHECK(can == 1);
  CU_OK(d.DeviceCanAccessPeer(&can, 1, 0));
  CHECK(can == 1);
  CU_OK(d.DeviceCanAccessPeer(&can, 1, 1));
  CHECK(can == 0);
  CU_EQ(d.DeviceCanAccessPeer(&can, 0, 2), CUDA_ERROR_INVALID_DEVICE);
  CU_EQ(d.DeviceCanAccessPeer(nullptr, 0, 1), CUDA_ERROR_INVALID_VALUE);

  CU_OK(d.CtxEnablePeerAccess(g_ctx[1], 0));  // current is device 0
  CU_EQ(d.CtxEnablePeerAccess(g_ctx[1], 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  CU_EQ(d.CtxEnablePeerAccess(g_ctx[0], 0), CUDA_ERROR_INVALID_DEVICE);  // itself
  CU_EQ(d.CtxEnablePeerAccess(g_ctx[1], 1), CUDA_ERROR_INVALID_VALUE);   // flags must be 0
  CU_EQ(d.CtxEnablePeerAccess(reinterpret_cast<CUcontext>(0x99), 0), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CU_OK(d.CtxEnablePeerAccess(g_ctx[0], 0));  // the other direction is separate
  CU_OK(d.CtxDisablePeerAccess(g_ctx[0]));
  CU_EQ(d.CtxDisablePeerAccess(g_ctx[0]), CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
  CU_EQ(d.CtxDisablePeerAccess(nullptr), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.CtxDisablePeerAccess(g_ctx[1]));
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.CtxEnablePeerAccess(g_ctx[1], 0), CUDA_ERROR_INVALID_CONTEXT);  // no current context
  CU_EQ(d.CtxDisablePeerAccess(g_ctx[1]), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_CASE("kernel registration", "[simdrv][kernel]") {
  const SimDrv &d = drv();
  auto f1 = [](void *) {};
  auto f2 = [](void *) {};
  ebbsim_kernel_fn k1 = f1, k2 = f2;
  CU_OK(d.RegisterKernel("reg_test", k1, 8));  // before cuInit is fine
  CU_OK(d.RegisterKernel("reg_test", k1, 8));  // same again: fine
  CU_EQ(d.RegisterKernel("reg_test", k2, 8), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.RegisterKernel("reg_test", k1, 16), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.RegisterKernel(nullptr, k1, 8), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.RegisterKernel("", k1, 8), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.RegisterKernel("no_fn", nullptr, 8), CUDA_ERROR_INVALID_VALUE);
  sim_setup();
  CUfunction f = get_kernel("reg_test");
  CHECK(f != nullptr);
}
