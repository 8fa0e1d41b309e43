// test_simdrv_exec.cpp: streams, engines, events, copies, memset, host functions, modules and
// kernel launches of the emulated driver (runtime/simdrv/sim_exec.c, sim_kernel.c), without the
// timing model (see test_simdrv_timing.cpp for that).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "simdrv_loader.hpp"

namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

TEST_CASE("streams: create, priority clamp, query, synchronize, destroy, bad input", "[simdrv][stream]") {
  const SimDrv &d = drv();
  sim_setup();
  CUstream s = make_stream(-3), lo = make_stream(10), hi = make_stream(-100);
  int p = 99;
  CU_OK(d.StreamGetPriority(s, &p));
  CHECK(p == -3);
  CU_OK(d.StreamGetPriority(lo, &p));
  CHECK(p == 0);  // clamped into [greatest, least] like CUDA
  CU_OK(d.StreamGetPriority(hi, &p));
  CHECK(p == -5);
  CU_OK(d.StreamGetPriority(nullptr, &p));
  CHECK(p == 0);
  CU_OK(d.StreamQuery(s));  // empty: done
  CU_OK(d.StreamSynchronize(s));
  CU_OK(d.StreamDestroy(lo));
  CU_OK(d.StreamCreateWithPriority(&lo, CU_STREAM_DEFAULT, 0));
  CU_OK(d.StreamDestroy(lo));
  CU_EQ(d.StreamCreateWithPriority(nullptr, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CUstream x;
  CU_EQ(d.StreamCreateWithPriority(&x, 0x10, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.StreamGetPriority(s, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.StreamDestroy(s));
  CU_OK(d.StreamDestroy(hi));
  CU_EQ(d.StreamDestroy(nullptr), CUDA_ERROR_INVALID_HANDLE);  // the default stream
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.StreamCreateWithPriority(&x, 0, 0), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.StreamSynchronize(nullptr), CUDA_ERROR_INVALID_CONTEXT);  // no current context
}

TEST_CASE("commands of one stream run in issue order", "[simdrv][stream][order]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction append = get_kernel("append");
  CUstream s = make_stream();
  int *buf = dev_ints(1 + 300);
  AppendArgs a{buf, 0};
  for (int i = 0; i < 300; i++) {
    a.value = i;  // the launch copied the previous value: reusing the struct is fine
    CU_OK(launch(append, s, &a));
  }
  CU_OK(d.StreamSynchronize(s));
  REQUIRE(buf[0] == 300);
  for (int i = 0; i < 300; i++) REQUIRE(buf[1 + i] == i);
  CU_OK(d.StreamDestroy(s));
}

TEST_CASE("host functions run in stream order with kernels and copies", "[simdrv][stream][hostfn]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction append = get_kernel("append");
  CUstream s = make_stream();
  int *buf = dev_ints(64);
  std::vector<AppendArgs> host_args;
  host_args.reserve(20);
  for (int i = 0; i < 20; i++) {
    AppendArgs a{buf, i};
    if (i % 2) {
      host_args.push_back(a);
      CU_OK(d.LaunchHostFunc(s, host_append, &host_args.back()));
    } else {
      CU_OK(launch(append, s, &a));
    }
  }
  CU_OK(d.StreamSynchronize(s));
  REQUIRE(buf[0] == 20);
  for (int i = 0; i < 20; i++) CHECK(buf[1 + i] == i);
  CU_EQ(d.LaunchHostFunc(s, nullptr, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchHostFunc(reinterpret_cast<CUstream>(0xdead0000), host_append, nullptr), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.StreamDestroy(s));
}

namespace {

struct HostFnCalls {
  CUresult query = CUDA_SUCCESS, alloc = CUDA_SUCCESS;
  CUstream s = nullptr;
};

void host_calls_driver(void *user) {
  auto *h = static_cast<HostFnCalls *>(user);
  h->query = drv().StreamQuery(h->s);
  CUdeviceptr p = 0;
  h->alloc = drv().MemAlloc(&p, 256);
}

}  // namespace

TEST_CASE("a host function's driver calls are refused with NOT_PERMITTED, as libcuda refuses them",
          "[simdrv][stream][hostfn]") {
  // CUDA forbids API calls from a host function and libcuda answers them with
  // CUDA_ERROR_NOT_PERMITTED: a caller that makes one must be caught without a GPU.
  const SimDrv &d = drv();
  sim_setup();
  CUstream s = make_stream();
  HostFnCalls h;
  h.s = s;
  CU_OK(d.LaunchHostFunc(s, host_calls_driver, &h));
  CU_OK(d.StreamSynchronize(s));
  CU_EQ(h.query, CUDA_ERROR_NOT_PERMITTED);
  CU_EQ(h.alloc, CUDA_ERROR_NOT_PERMITTED);
  // Other threads are untouched while it runs and after: the refusal is the host function's.
  CU_OK(d.StreamQuery(s));
  CUdeviceptr p = 0;
  CU_OK(d.MemAlloc(&p, 256));
  CU_OK(d.MemFree(p));
  CU_OK(d.StreamDestroy(s));
}

TEST_CASE("the NULL stream is the current context's default stream", "[simdrv][stream]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction append = get_kernel("append");
  int *buf = dev_ints(8);
  AppendArgs a{buf, 5};
  CU_OK(launch(append, nullptr, &a));
  CU_OK(launch(append, reinterpret_cast<CUstream>(0x1), &a));  // CU_STREAM_LEGACY
  CU_OK(d.StreamSynchronize(nullptr));
  CU_OK(d.StreamQuery(nullptr));
  CHECK(buf[0] == 2);
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(launch(append, nullptr, &a), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.StreamQuery(nullptr), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_CASE("modules, functions and launch arguments", "[simdrv][kernel]") {
  const SimDrv &d = drv();
  sim_setup();
  CUmodule mod;
  CUfunction append = get_kernel("append", &mod);
  CUfunction f;
  CU_EQ(d.ModuleGetFunction(&f, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
  CU_EQ(d.ModuleGetFunction(nullptr, mod, "append"), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.ModuleGetFunction(&f, mod, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.ModuleGetFunction(&f, reinterpret_cast<CUmodule>(0x77), "append"), CUDA_ERROR_INVALID_HANDLE);
  CUmodule m2;
  CU_EQ(d.ModuleLoadData(&m2, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.ModuleLoadData(nullptr, "x"), CUDA_ERROR_INVALID_VALUE);

  CUstream s = make_stream();
  int *buf = dev_ints(16);
  AppendArgs a{buf, 1};
  void *params[] = {&a};
  CU_EQ(d.LaunchKernel(append, 0, 1, 1, 1, 1, 1, 0, s, params, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(append, 1, 1, 0, 1, 1, 1, 0, s, params, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(append, 1, 1, 1, 0, 1, 1, 0, s, params, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(append, 1, 1, 1, 1024, 2, 1, 0, s, params, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(append, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(append, 1, 1, 1, 1, 1, 1, 0, s, params, params), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.LaunchKernel(reinterpret_cast<CUfunction>(0x1234), 1, 1, 1, 1, 1, 1, 0, s, params, nullptr),
        CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.LaunchKernel(append, 64, 2, 1, 256, 4, 1, 1024, s, params, nullptr));
  CU_OK(d.StreamSynchronize(s));
  CHECK(buf[0] == 1);  // a CPU kernel runs once per launch, whatever the grid

  // Arguments beyond the inline buffer are copied too.
  CUfunction big = get_kernel("big");
  auto *ba = new BigArgs;
  long result = 0;
  ba->out = &result;
  for (long i = 0; i < 511; i++) ba->words[i] = i;
  CU_OK(launch(big, s, ba));
  std::memset(ba->words, 0, sizeof ba->words);  // the launch has its own copy
  CU_OK(d.StreamSynchronize(s));
  CHECK(result == 511 * 510 / 2);
  delete ba;

  // A module belongs to the context that loaded it.
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CUstream s1 = make_stream();
  CU_EQ(launch(append, s1, &a), CUDA_ERROR_INVALID_CONTEXT);
  CUfunction append1 = get_kernel("append");
  CU_OK(launch(append1, s1, &a));
  CU_OK(d.StreamSynchronize(s1));
  CHECK(buf[0] == 2);

  // Unloading invalidates the module and its functions.
  CU_OK(d.ModuleUnload(mod));
  CU_EQ(d.ModuleUnload(mod), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.ModuleGetFunction(&f, mod, "append"), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_EQ(launch(append, s, &a), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.ModuleLoadData(&m2, "x"), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_CASE("copies in every direction and memset", "[simdrv][copy]") {
  const SimDrv &d = drv();
  sim_setup();
  CUstream s = make_stream();
  const size_t n = 1 << 20;
  std::vector<unsigned char> src(n), back(n);
  for (size_t i = 0; i < n; i++) src[i] = static_cast<unsigned char>(i * 7 + 3);
  CUdeviceptr a, b;
  CU_OK(d.MemAlloc(&a, n));
  CU_OK(d.MemAlloc(&b, n));
  void *pinned;
  CU_OK(d.MemHostAlloc(&pinned, n, 0));
  CU_OK(d.MemcpyHtoDAsync(a, src.data(), n, s));                       // pageable H2D
  CU_OK(d.MemcpyDtoDAsync(b, a, n, s));                                // D2D
  CU_OK(d.MemcpyDtoHAsync(pinned, b, n, s));                           // D2H to pinned
  CU_OK(d.MemsetD8Async(a, 0xee, n / 2, s));                           // memset on the compute engine
  CU_OK(d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(back.data()), a, n, s));  // unified D2H
  CU_OK(d.StreamSynchronize(s));
  CHECK(std::memcmp(pinned, src.data(), n) == 0);
  CHECK(back[0] == 0xee);
  CHECK(back[n / 2 - 1] == 0xee);
  CHECK(back[n / 2] == src[n / 2]);
  CHECK(back[n - 1] == src[n - 1]);
  // Unified H2D and H2H.
  std::vector<unsigned char> h2(n);
  CU_OK(d.MemcpyAsync(a, reinterpret_cast<CUdeviceptr>(pinned), n, s));
  CU_OK(d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(h2.data()), reinterpret_cast<CUdeviceptr>(pinned), n, s));
  CU_OK(d.StreamSynchronize(s));
  CHECK(std::memcmp(reinterpret_cast<void *>(a), src.data(), n) == 0);
  CHECK(h2 == src);
  // Zero bytes: nothing to do, still fine.
  CU_OK(d.MemcpyAsync(a, b, 0, s));
  CU_OK(d.MemsetD8Async(a, 1, 0, s));
  // Bad input: spans past an allocation, NULL pointers, host pointers as device pointers.
  CU_EQ(d.MemcpyHtoDAsync(a + 16, src.data(), n, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyDtoHAsync(back.data(), b + 1, n, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyDtoDAsync(a, b, n + 1, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyAsync(a, b, n + 1, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(back.data()), src.data(), 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyDtoHAsync(back.data(), reinterpret_cast<CUdeviceptr>(src.data()), 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyHtoDAsync(0, src.data(), 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyHtoDAsync(a, nullptr, 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyDtoHAsync(nullptr, a, 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyAsync(0, a, 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemsetD8Async(a, 0, n + 1, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemsetD8Async(reinterpret_cast<CUdeviceptr>(back.data()), 0, 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemsetD8Async(0, 0, 16, s), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.MemcpyHtoDAsync(a, src.data(), 16, reinterpret_cast<CUstream>(0x4242)), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.StreamDestroy(s));
  CU_OK(d.MemFreeHost(pinned));
  CU_OK(d.MemFree(a));
  CU_OK(d.MemFree(b));
}

TEST_CASE("peer copies both ways, with and without peer access", "[simdrv][copy][peer]") {
  const SimDrv &d = drv();
  sim_setup();
  const size_t n = 256 << 10;
  CUdeviceptr d0, d1;
  CU_OK(d.MemAlloc(&d0, n));
  CUstream s0 = make_stream();
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CU_OK(d.MemAlloc(&d1, n));
  CUstream s1 = make_stream();
  std::memset(reinterpret_cast<void *>(d0), 0x10, n);
  std::memset(reinterpret_cast<void *>(d1), 0x21, n);
  // 0 -> 1 on device 1's stream, through cuMemcpyPeerAsync, without peer access enabled.
  CU_OK(d.MemcpyPeerAsync(d1, g_ctx[1], d0, g_ctx[0], n / 2, s1));
  CU_OK(d.StreamSynchronize(s1));
  CHECK(reinterpret_cast<unsigned char *>(d1)[0] == 0x10);
  CHECK(reinterpret_cast<unsigned char *>(d1)[n / 2] == 0x21);
  // 1 -> 0 on device 0's stream, through cuMemcpyAsync (unified addressing), with peer access.
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.CtxEnablePeerAccess(g_ctx[1], 0));
  std::memset(reinterpret_cast<void *>(d1), 0x33, n);
  CU_OK(d.MemcpyAsync(d0, d1, n, s0));
  CU_OK(d.StreamSynchronize(s0));
  CHECK(reinterpret_cast<unsigned char *>(d0)[n - 1] == 0x33);
  // And cuMemcpyDtoDAsync across devices.
  std::memset(reinterpret_cast<void *>(d0), 0x44, n);
  CU_OK(d.MemcpyDtoDAsync(d1, d0, n, s0));
  CU_OK(d.StreamSynchronize(s0));
  CHECK(reinterpret_cast<unsigned char *>(d1)[7] == 0x44);
  // Bad input.
  CU_EQ(d.MemcpyPeerAsync(d1, reinterpret_cast<CUcontext>(0x8), d0, g_ctx[0], n, s0), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.MemcpyPeerAsync(d1, g_ctx[1], d0, nullptr, n, s0), CUDA_ERROR_INVALID_CONTEXT);
  CU_EQ(d.MemcpyPeerAsync(d1, g_ctx[1], d0, g_ctx[0], n + 1, s0), CUDA_ERROR_INVALID_VALUE);
  std::vector<char> host(16);
  CU_EQ(d.MemcpyPeerAsync(reinterpret_cast<CUdeviceptr>(host.data()), g_ctx[1], d0, g_ctx[0], 16, s0),
        CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.StreamDestroy(s0));
  CU_OK(d.StreamDestroy(s1));
  CU_OK(d.MemFree(d0));
  CU_OK(d.MemFree(d1));
}

TEST_CASE("events: record, query, synchronize, elapsed time, bad input", "[simdrv][event]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate_k = get_kernel("gate");
  CUstream s = make_stream();
  CUevent e0 = make_event(), e1 = make_event(CU_EVENT_BLOCKING_SYNC), nt = make_event(CU_EVENT_DISABLE_TIMING);
  float ms = -1;
  CU_OK(d.EventQuery(e0));  // never recorded: complete, as in CUDA
  CU_OK(d.EventSynchronize(e0));
  CU_EQ(d.EventElapsedTime(&ms, e0, e1), CUDA_ERROR_INVALID_HANDLE);  // not recorded
  Gate gate;
  CU_OK(d.EventRecord(e0, s));
  gate.close_on(gate_k, s);
  CU_OK(d.EventRecord(e1, s));
  CU_OK(d.EventRecord(nt, s));
  CU_OK(d.EventQuery(e0));
  CU_EQ(d.EventQuery(e1), CUDA_ERROR_NOT_READY);
  CU_EQ(d.StreamQuery(s), CUDA_ERROR_NOT_READY);
  CU_EQ(d.EventElapsedTime(&ms, e0, e1), CUDA_ERROR_NOT_READY);
  sleep_ms(5);
  gate.open();
  CU_OK(d.EventSynchronize(e1));
  CU_OK(d.EventQuery(e1));
  CU_OK(d.EventElapsedTime(&ms, e0, e1));
  CHECK(ms >= 4.0f);  // the gate was closed for at least 5 ms
  CU_OK(d.EventElapsedTime(&ms, e1, e0));
  CHECK(ms <= -4.0f);
  CU_EQ(d.EventElapsedTime(&ms, e0, nt), CUDA_ERROR_INVALID_HANDLE);  // timing disabled
  CU_EQ(d.EventElapsedTime(nullptr, e0, e1), CUDA_ERROR_INVALID_VALUE);
  CU_OK(d.StreamSynchronize(s));
  // Bad input.
  CUevent x;
  CU_EQ(d.EventCreate(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.EventCreate(&x, 0x80), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.EventRecord(reinterpret_cast<CUevent>(0x55), s), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventQuery(nullptr), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventSynchronize(reinterpret_cast<CUevent>(&x)), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventElapsedTime(&ms, reinterpret_cast<CUevent>(0x55), e1), CUDA_ERROR_INVALID_HANDLE);
  // An event and a stream of different contexts.
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CUstream s1 = make_stream();
  CU_EQ(d.EventRecord(e0, s1), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.StreamDestroy(s1));
  CU_OK(d.CtxSetCurrent(nullptr));
  CU_EQ(d.EventCreate(&x, 0), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(d.EventDestroy(e0));
  CU_OK(d.EventDestroy(e1));
  CU_OK(d.EventDestroy(nt));
  CU_OK(d.StreamDestroy(s));
}

TEST_CASE("cross-stream order comes only from event waits, across devices too", "[simdrv][event][order]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate0 = get_kernel("gate");
  CUstream a = make_stream(), b = make_stream();
  int *buf_b = dev_ints(16), *buf_c = dev_ints(16);  // b and c run on different devices' engines
  CUevent ev = make_event(CU_EVENT_DISABLE_TIMING);
  Gate gate;
  // Stream a is held by the gate; stream b waits for a's event on device 1's engines.
  gate.close_on(gate0, a);
  CU_OK(d.EventRecord(ev, a));
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  CUfunction append1 = get_kernel("append");
  CUstream c = make_stream();  // device 1
  CU_OK(d.StreamWaitEvent(c, ev, 0));
  AppendArgs arg{buf_c, 7};
  CU_OK(launch(append1, c, &arg));
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CUfunction append0 = get_kernel("append");
  CU_OK(d.StreamWaitEvent(b, ev, 0));
  arg.buf = buf_b;
  CU_OK(launch(append0, b, &arg));
  // An unrelated stream is not held back.
  CUstream free_s = make_stream();
  CU_OK(d.LaunchHostFunc(free_s, [](void *) {}, nullptr));
  CU_OK(d.StreamSynchronize(free_s));
  sleep_ms(10);
  CHECK(__atomic_load_n(&buf_b[0], __ATOMIC_ACQUIRE) == 0);  // both waiters still blocked
  CHECK(__atomic_load_n(&buf_c[0], __ATOMIC_ACQUIRE) == 0);
  CU_EQ(d.StreamQuery(b), CUDA_ERROR_NOT_READY);
  CU_EQ(d.StreamQuery(c), CUDA_ERROR_NOT_READY);
  gate.open();
  CU_OK(d.StreamSynchronize(b));
  CU_OK(d.StreamSynchronize(c));
  CHECK(buf_b[0] == 1);
  CHECK(buf_c[0] == 1);
  // Waiting on a never-recorded event, or on a stream's own event, adds nothing.
  CUevent fresh = make_event();
  CU_OK(d.StreamWaitEvent(b, fresh, 0));
  CU_OK(d.EventRecord(fresh, b));
  CU_OK(d.StreamWaitEvent(b, fresh, 0));
  CU_OK(d.StreamSynchronize(b));
  // Bad input.
  CU_EQ(d.StreamWaitEvent(b, fresh, 5), CUDA_ERROR_INVALID_VALUE);
  CU_EQ(d.StreamWaitEvent(b, reinterpret_cast<CUevent>(0x10), 0), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.StreamWaitEvent(reinterpret_cast<CUstream>(0x10), fresh, 0), CUDA_ERROR_INVALID_HANDLE);
  for (CUstream s : {a, b, c, free_s}) CU_OK(d.StreamDestroy(s));
  CU_OK(d.EventDestroy(ev));
  CU_OK(d.EventDestroy(fresh));
}

// The test extension that proves a wait is needed: waits of one stream for events recorded on
// one other stream enqueue nothing while it is on, and only those.
TEST_CASE("ebbsim_skip_waits: one stream's waits for another's events enqueue nothing, counted", "[simdrv][event][skip]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate_k = get_kernel("gate");
  CUstream a = make_stream(), b = make_stream(), c = make_stream(), other = make_stream();
  int *buf_b = dev_ints(8), *buf_c = dev_ints(8);
  CUevent ev = make_event(CU_EVENT_DISABLE_TIMING), ev2 = make_event(CU_EVENT_DISABLE_TIMING);
  Gate gate;
  gate.close_on(gate_k, a);
  CU_OK(d.EventRecord(ev, a));
  unsigned long long skipped = 99;
  CU_OK(d.SkipWaits(b, a, 1, &skipped));
  CHECK(skipped == 0);
  CU_OK(d.StreamWaitEvent(b, ev, 0));  // skipped: b runs ahead of a's gate
  CU_OK(d.StreamWaitEvent(c, ev, 0));  // another waiter still waits
  CU_OK(d.EventRecord(ev2, other));
  CU_OK(d.StreamWaitEvent(b, ev2, 0));  // an event of another stream (complete anyway): not counted
  // Host functions observe the streams' progress (the gate holds the compute engine).
  AppendArgs arg_b{buf_b, 1}, arg_c{buf_c, 1};
  CU_OK(d.LaunchHostFunc(b, host_append, &arg_b));
  CU_OK(d.LaunchHostFunc(c, host_append, &arg_c));
  CU_OK(d.StreamSynchronize(b));
  CHECK(buf_b[0] == 1);
  CU_EQ(d.StreamQuery(c), CUDA_ERROR_NOT_READY);
  CU_OK(d.SkipWaits(nullptr, nullptr, 0, &skipped));
  CHECK(skipped == 1);
  CU_OK(d.StreamWaitEvent(b, ev, 0));  // off: waits again
  CU_OK(d.LaunchHostFunc(b, host_append, &arg_b));
  sleep_ms(10);
  CU_EQ(d.StreamQuery(b), CUDA_ERROR_NOT_READY);
  gate.open();
  CU_OK(d.StreamSynchronize(b));
  CU_OK(d.StreamSynchronize(c));
  CHECK(buf_b[0] == 2);
  CHECK(buf_c[0] == 1);
  // Bad input: a stream that is not live.
  CU_EQ(d.SkipWaits(reinterpret_cast<CUstream>(0x10), a, 1, nullptr), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.SkipWaits(nullptr, nullptr, 0, &skipped));
  CHECK(skipped == 0);
  for (CUstream s : {a, b, c, other}) CU_OK(d.StreamDestroy(s));
  CU_OK(d.EventDestroy(ev));
  CU_OK(d.EventDestroy(ev2));
}

TEST_CASE("a wait captures the event's record at the time of the call", "[simdrv][event][order]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate_k = get_kernel("gate");
  CUstream a = make_stream(), b = make_stream(), idle = make_stream();
  CUevent ev = make_event();
  int *buf = dev_ints(8);
  Gate gate;
  // A kernel on b would share the compute engine with the gate and could not run before it
  // opens anyway: a host function (its own engine) observes b's progress instead.
  gate.close_on(gate_k, a);
  CU_OK(d.EventRecord(ev, a));
  CU_OK(d.StreamWaitEvent(b, ev, 0));   // waits for a's gate
  CU_OK(d.EventRecord(ev, idle));       // re-recording later does not release b
  CU_OK(d.EventSynchronize(ev));
  static AppendArgs arg;
  arg = AppendArgs{buf, 1};
  CU_OK(d.LaunchHostFunc(b, host_append, &arg));
  sleep_ms(10);
  CHECK(__atomic_load_n(&buf[0], __ATOMIC_ACQUIRE) == 0);
  gate.open();
  CU_OK(d.StreamSynchronize(b));
  CHECK(buf[0] == 1);
  for (CUstream s : {a, b, idle}) CU_OK(d.StreamDestroy(s));
  CU_OK(d.EventDestroy(ev));
}

TEST_CASE("cuCtxSynchronize waits for every stream of the device", "[simdrv][ctx]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction append = get_kernel("append");
  std::vector<CUstream> ss;
  int *buf = dev_ints(1 + 8 * 50);
  AppendArgs a{buf, 1};
  for (int i = 0; i < 8; i++) ss.push_back(make_stream(-(i % 6)));
  for (int k = 0; k < 50; k++)
    for (CUstream s : ss) CU_OK(launch(append, s, &a));
  CU_OK(d.CtxSynchronize());
  CHECK(buf[0] == 400);
  for (CUstream s : ss) CU_OK(d.StreamQuery(s));
  for (CUstream s : ss) CU_OK(d.StreamDestroy(s));
}

TEST_CASE("destroyed and bogus handles are refused, never crash", "[simdrv][handles]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate_k = get_kernel("gate"), append = get_kernel("append");
  int *buf = dev_ints(8);
  AppendArgs a{buf, 1};
  // A stream destroyed with work pending: destroy returns at once, the work still runs.
  CUstream s = make_stream();
  Gate gate;
  gate.close_on(gate_k, s);
  CU_OK(launch(append, s, &a));
  CU_OK(d.StreamDestroy(s));
  CU_EQ(d.StreamDestroy(s), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(launch(append, s, &a), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.StreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.StreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
  int p;
  CU_EQ(d.StreamGetPriority(s, &p), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.MemsetD8Async(reinterpret_cast<CUdeviceptr>(buf), 0, 4, s), CUDA_ERROR_INVALID_HANDLE);
  gate.open();
  CU_OK(d.CtxSynchronize());
  CHECK(buf[0] == 1);
  // The slot is reused, the old handle stays dead.
  CUstream s2 = make_stream();
  CU_EQ(d.StreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(d.StreamQuery(s2));
  // Events.
  CUevent e = make_event();
  CU_OK(d.EventRecord(e, s2));
  CU_OK(d.EventDestroy(e));
  CU_EQ(d.EventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventRecord(e, s2), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventQuery(e), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.EventSynchronize(e), CUDA_ERROR_INVALID_HANDLE);
  CU_EQ(d.StreamWaitEvent(s2, e, 0), CUDA_ERROR_INVALID_HANDLE);
  float ms;
  CU_EQ(d.EventElapsedTime(&ms, e, e), CUDA_ERROR_INVALID_HANDLE);
  // Bogus values of every handle type, including pointers to real memory.
  int local = 0;
  void *bogus[] = {reinterpret_cast<void *>(0x10), reinterpret_cast<void *>(&local),
                   reinterpret_cast<void *>(~uintptr_t(0)), reinterpret_cast<void *>(0xE1000001000000FFull),
                   reinterpret_cast<void *>(0xE200000100000000ull)};
  for (void *b : bogus) {
    CU_EQ(d.StreamSynchronize(static_cast<CUstream>(b)), CUDA_ERROR_INVALID_HANDLE);
    CU_EQ(d.StreamDestroy(static_cast<CUstream>(b)), CUDA_ERROR_INVALID_HANDLE);
    CU_EQ(d.EventQuery(static_cast<CUevent>(b)), CUDA_ERROR_INVALID_HANDLE);
    CU_EQ(d.EventDestroy(static_cast<CUevent>(b)), CUDA_ERROR_INVALID_HANDLE);
    CU_EQ(d.ModuleUnload(static_cast<CUmodule>(b)), CUDA_ERROR_INVALID_HANDLE);
    CU_EQ(launch(static_cast<CUfunction>(b), s2, &a), CUDA_ERROR_INVALID_HANDLE);
  }
  CU_OK(d.StreamDestroy(s2));
}

TEST_CASE("8 threads create, use and destroy streams and events concurrently", "[simdrv][threads]") {
  const SimDrv &d = drv();
  sim_setup();
  constexpr int kThreads = 8, kIters = 40;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  std::vector<int *> bufs;
  for (int t = 0; t < kThreads; t++) bufs.push_back(dev_ints(1 + kIters * 2));
  CUfunction append_on[2];
  append_on[0] = get_kernel("append");
  CU_OK(d.CtxSetCurrent(g_ctx[1]));
  append_on[1] = get_kernel("append");
  for (int t = 0; t < kThreads; t++) {
    ts.emplace_back([&, t] {
      auto ok = [&](CUresult r) {
        if (r != CUDA_SUCCESS) failures.fetch_add(1);
      };
      int dev = t % 2;
      ok(d.CtxSetCurrent(g_ctx[dev]));
      CUdeviceptr scratch;
      ok(d.MemAlloc(&scratch, 4096));
      std::vector<unsigned char> host(4096, static_cast<unsigned char>(t)), back(4096);
      for (int i = 0; i < kIters; i++) {
        CUstream s1, s2;
        CUevent e;
        ok(d.StreamCreateWithPriority(&s1, CU_STREAM_NON_BLOCKING, -(i % 6)));
        ok(d.StreamCreateWithPriority(&s2, CU_STREAM_NON_BLOCKING, 0));
        ok(d.EventCreate(&e, i % 2 ? CU_EVENT_DISABLE_TIMING : 0));
        AppendArgs a{bufs[t], 2 * i};
        ok(launch(append_on[dev], s1, &a));
        ok(d.MemcpyHtoDAsync(scratch, host.data(), host.size(), s1));
        ok(d.EventRecord(e, s1));
        ok(d.StreamWaitEvent(s2, e, 0));
        a.value = 2 * i + 1;
        ok(launch(append_on[dev], s2, &a));
        ok(d.MemcpyDtoHAsync(back.data(), scratch, back.size(), s2));
        if (i % 3 == 0) ok(d.StreamSynchronize(s2));
        ok(d.StreamDestroy(s1));  // pending work still completes
        ok(d.EventDestroy(e));
        if (i % 3 != 0) ok(d.StreamSynchronize(s2));
        ok(d.StreamDestroy(s2));
        if (back != host) failures.fetch_add(1);
      }
      ok(d.MemFree(scratch));
    });
  }
  for (auto &th : ts) th.join();
  CHECK(failures.load() == 0);
  for (int t = 0; t < kThreads; t++) {
    REQUIRE(bufs[t][0] == 2 * kIters);
    for (int i = 0; i < 2 * kIters; i++) CHECK(bufs[t][1 + i] == i);
  }
}

TEST_CASE("engine threads are bounded: 64 streams add at most 4 threads per device", "[simdrv][threads]") {
  const SimDrv &d = drv();
  int ndev = sim_setup();
  std::thread([] {}).join();  // sanitizer runtimes start their helper thread with the first thread
  int before = thread_count();
  const size_t kSlice = 4096;  // each stream copies through its own slice
  std::vector<unsigned char> host(kSlice, 1), back(64 * kSlice);
  std::vector<CUstream> all;
  for (int dev = 0; dev < ndev; dev++) {
    CU_OK(d.CtxSetCurrent(g_ctx[dev]));
    CUfunction append = get_kernel("append");
    int *buf = dev_ints(1 + 64);
    CUdeviceptr scratch;
    CU_OK(d.MemAlloc(&scratch, 64 * kSlice));
    for (int i = 0; i < 64; i++) {
      CUstream s = make_stream(-(i % 6));
      AppendArgs a{buf, i};
      CU_OK(launch(append, s, &a));
      CU_OK(d.MemcpyHtoDAsync(scratch + i * kSlice, host.data(), kSlice, s));
      CU_OK(d.MemcpyDtoHAsync(back.data() + i * kSlice, scratch + i * kSlice, kSlice, s));
      CU_OK(d.LaunchHostFunc(s, [](void *) {}, nullptr));
      all.push_back(s);
    }
    CU_OK(d.CtxSynchronize());
    CHECK(buf[0] == 64);
  }
  int after = thread_count();
  INFO("threads before " << before << ", after " << after);
  CHECK(after - before <= 4 * ndev);
  for (CUstream s : all) CU_OK(d.StreamDestroy(s));
}
