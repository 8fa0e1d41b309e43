// test_simdrv_fault.cpp: EBB_SIM_FAULT (the n-th call of an entry point, or of any, fails once
// with a chosen CUresult) and sticky errors (after a kernel-fault error such as
// CUDA_ERROR_LAUNCH_FAILED, every later call in that context returns it, as on a GPU).
//
// The driver reads EBB_SIM_FAULT once, at cuInit, so each case sets it before its own cuInit and
// needs a process of its own, as ctest gives every case. Run together in one process, the cases
// after the first skip themselves with a warning. Bad values are refused by test_simdrv_env.cpp's
// test_simdrv_badfault_* entries.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "simdrv_loader.hpp"
#include "sim_fault_env.hpp"

TEST_CASE("EBB_SIM_FAULT fails the n-th call of an entry once, with the entry's default or the given CUresult",
          "[simdrv][fault]") {
  // cuMemAlloc by its exported name, cuMemGetInfo by its cuda.h name (exported as _v2), a
  // CUresult by name and one by number.
  if (!faults_for_this_process("cuMemAlloc_v2:2,cuMemGetInfo:3:CUDA_ERROR_INVALID_VALUE,cuStreamQuery:1:999,"
                               "cuMemHostAlloc:1,cuEventCreate:2"))
    return;
  const SimDrv &d = drv();
  sim_setup();
  CHECK(std::string(d.InitError()).empty());

  CUdeviceptr p1 = 0, p2 = 0, p3 = 0;
  CU_OK(d.MemAlloc(&p1, 4096));
  CU_EQ(d.MemAlloc(&p2, 4096), CUDA_ERROR_OUT_OF_MEMORY);  // the 2nd call: an allocation's default
  CHECK(p2 == 0);
  CU_OK(d.MemAlloc(&p2, 4096));  // once only
  CU_OK(d.MemAlloc(&p3, 4096));

  size_t f = 0, t = 0;
  CU_OK(d.MemGetInfo(&f, &t));
  CU_OK(d.MemGetInfo(&f, &t));
  CU_EQ(d.MemGetInfo(&f, &t), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.MemGetInfo(&f, &t));

  CU_EQ(d.StreamQuery(nullptr), CUDA_ERROR_UNKNOWN);  // 999
  CU_OK(d.StreamQuery(nullptr));

  void *h = nullptr;
  CU_EQ(d.MemHostAlloc(&h, 4096, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CU_OK(d.MemHostAlloc(&h, 4096, 0));
  CU_OK(d.MemFreeHost(h));

  // Not an allocation: CUDA_ERROR_LAUNCH_FAILED by default, and that error is sticky.
  CUevent e1 = nullptr, e2 = nullptr;
  CU_OK(d.EventCreate(&e1, 0));
  CU_EQ(d.EventCreate(&e2, 0), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.MemAlloc(&p1, 4096), CUDA_ERROR_LAUNCH_FAILED);
  CU_OK(d.EventDestroy(e1));
  for (CUdeviceptr p : {p1, p2, p3}) CU_OK(d.MemFree(p));
}

TEST_CASE("EBB_SIM_FAULT=* fails the n-th call of any entry point", "[simdrv][fault]") {
  if (!faults_for_this_process("*:5,*:7:CUDA_ERROR_INVALID_HANDLE")) return;
  const SimDrv &d = drv();
  CU_OK(d.Init(0));  // cuInit itself is not counted
  int n = 0;
  CUdevice dev = -1;
  CUcontext ctx = nullptr;
  CU_OK(d.DeviceGetCount(&n));              // 1
  CU_OK(d.DeviceGet(&dev, 0));              // 2
  CU_OK(d.DevicePrimaryCtxRetain(&ctx, 0)); // 3
  CU_OK(d.CtxSetCurrent(ctx));              // 4
  CUdeviceptr p = 0;
  CU_EQ(d.MemAlloc(&p, 4096), CUDA_ERROR_OUT_OF_MEMORY);  // 5: the default of the entry it hits
  size_t f = 0, t = 0;
  CU_OK(d.MemGetInfo(&f, &t));              // 6
  CUstream s = nullptr;
  CU_EQ(d.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0), CUDA_ERROR_INVALID_HANDLE);  // 7
  // Neither error is sticky: the context works on.
  CU_OK(d.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0));
  CU_OK(d.MemAlloc(&p, 4096));
  CU_OK(d.StreamSynchronize(s));
  CU_OK(d.StreamDestroy(s));
  CU_OK(d.MemFree(p));
}

TEST_CASE("EBB_SIM_FAULT numbers the calls of many threads exactly: one fails", "[simdrv][fault][threads]") {
  if (!faults_for_this_process("cuMemGetInfo_v2:1000:CUDA_ERROR_UNKNOWN")) return;
  const SimDrv &d = drv();
  sim_setup();
  const int nthreads = 8, per = 500;
  std::atomic<int> failed{0}, other{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < nthreads; i++) {
    ts.emplace_back([&] {
      if (d.CtxSetCurrent(g_ctx[0]) != CUDA_SUCCESS) other++;
      for (int k = 0; k < per; k++) {
        size_t f = 0, t = 0;
        CUresult r = d.MemGetInfo(&f, &t);
        if (r == CUDA_ERROR_UNKNOWN) failed++;
        else if (r != CUDA_SUCCESS) other++;
      }
    });
  }
  for (auto &t : ts) t.join();
  CHECK(failed == 1);
  CHECK(other == 0);
}

TEST_CASE("a sticky error poisons its context: every later call there returns it, other devices work on",
          "[simdrv][fault][sticky]") {
  if (!faults_for_this_process("cuEventQuery:2")) return;
  const SimDrv &d = drv();
  int n = sim_setup();
  REQUIRE(n >= 2);
  CUfunction append = get_kernel("append");
  int *buf = dev_ints(8);
  AppendArgs a{buf, 1};
  CUstream s = make_stream();
  CUevent e = make_event();
  CU_OK(launch(append, s, &a));
  CU_OK(d.EventRecord(e, s));
  CU_OK(d.EventSynchronize(e));
  CU_OK(d.EventQuery(e));                           // 1st
  CU_EQ(d.EventQuery(e), CUDA_ERROR_LAUNCH_FAILED);  // 2nd: the injected fault, sticky by default

  // Every later call in device 0's context fails with it, queries and waits included (nothing
  // waits on work that a failed context will never finish).
  CU_EQ(d.EventQuery(e), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.EventSynchronize(e), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.EventRecord(e, s), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.StreamQuery(s), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.StreamSynchronize(s), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.StreamSynchronize(nullptr), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.CtxSynchronize(), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(launch(append, s, &a), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.MemsetD8Async(reinterpret_cast<CUdeviceptr>(buf), 0, 4, s), CUDA_ERROR_LAUNCH_FAILED);
  CUdeviceptr p = 0;
  CU_EQ(d.MemAlloc(&p, 4096), CUDA_ERROR_LAUNCH_FAILED);
  CUstream s2 = nullptr;
  CU_EQ(d.StreamCreateWithPriority(&s2, CU_STREAM_NON_BLOCKING, 0), CUDA_ERROR_LAUNCH_FAILED);
  CUevent e2 = nullptr;
  CU_EQ(d.EventCreate(&e2, 0), CUDA_ERROR_LAUNCH_FAILED);

  // Device queries, context selection and teardown still work.
  CUdevice dev = -1;
  CU_OK(d.CtxGetDevice(&dev));
  CHECK(dev == 0);
  CU_OK(d.DeviceGet(&dev, 0));
  int v = 0;
  CU_OK(d.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
  const char *name = nullptr;
  CU_OK(d.GetErrorName(CUDA_ERROR_LAUNCH_FAILED, &name));

  // The stream's context answers with the error whichever context is current.
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CU_EQ(d.StreamQuery(s), CUDA_ERROR_LAUNCH_FAILED);
  CU_EQ(d.EventQuery(e), CUDA_ERROR_LAUNCH_FAILED);
  // Device 1 works on.
  CUstream s1 = make_stream();
  CUdeviceptr p1 = 0;
  CU_OK(d.MemAlloc(&p1, 4096));
  CU_OK(d.MemsetD8Async(p1, 7, 4096, s1));
  CU_OK(d.StreamSynchronize(s1));
  CHECK(reinterpret_cast<unsigned char *>(p1)[4095] == 7);
  CU_OK(d.MemFree(p1));
  CU_OK(d.StreamDestroy(s1));

  // Teardown in the failed context succeeds, and a reset gives it a fresh start.
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.StreamDestroy(s));
  CU_OK(d.EventDestroy(e));
  CU_OK(d.MemFree(reinterpret_cast<CUdeviceptr>(buf)));
  CU_OK(d.DevicePrimaryCtxReset(0));
  CU_OK(d.DevicePrimaryCtxRetain(&g_ctx[0], 0));
  CU_OK(d.MemAlloc(&p, 4096));
  CU_OK(d.MemFree(p));
}
