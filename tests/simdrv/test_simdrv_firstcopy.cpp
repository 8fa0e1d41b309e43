// test_simdrv_firstcopy.cpp: the first copy into freshly allocated memory costs what any copy
// costs (EBB_SIM_COPY_GBPS=2 set by CMake for this executable: 64 MiB take 33.5 ms modelled).
// On a GPU cuMemAlloc, cuMemHostAlloc and cuMemCreate return committed memory; simdrv commits at
// allocation too, or a first copy would also pay the host's page faults (once measured at six
// times the model) and every overlap or offload figure taken on simdrv would be off.
//
// Each case compares, by events, the first copy into a fresh allocation against the same copy
// repeated: a ratio, not a time. Three fresh allocations each, and the best ratio is checked: a
// scheduling hiccup on this shared machine can slow one first copy, while uncommitted memory
// slows all three. (Measured: with pages left to first touch the best ratio is 2.8 to 3.7,
// first copies 110-165 ms; committed at allocation, about 1.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

#include "simdrv_loader.hpp"

namespace {

constexpr double kGBps = 2.0;
constexpr size_t kBytes = size_t(64) << 20;
constexpr int kTrials = 3;
constexpr double kMaxRatio = 2.0;  // first copy / repeated copy
double model_ms(size_t bytes) { return static_cast<double>(bytes) / (kGBps * 1e9) * 1e3; }

// One copy on s, timed by events recorded around it on the same stream.
float timed_copy(CUstream s, CUdeviceptr dst, CUdeviceptr src, size_t n) {
  const SimDrv &d = drv();
  CUevent e0, e1;
  CU_OK(d.EventCreate(&e0, 0));
  CU_OK(d.EventCreate(&e1, 0));
  CU_OK(d.EventRecord(e0, s));
  CU_OK(d.MemcpyAsync(dst, src, n, s));
  CU_OK(d.EventRecord(e1, s));
  CU_OK(d.EventSynchronize(e1));
  float ms = 0;
  CU_OK(d.EventElapsedTime(&ms, e0, e1));
  CU_OK(d.EventDestroy(e0));
  CU_OK(d.EventDestroy(e1));
  return ms;
}

// For kTrials fresh destinations from `fresh` (released with `release`): the first copy from
// src and the same copy again. Checks the best first/again ratio and that the model holds.
void check_first_copy(const char *what, CUdeviceptr src, const std::function<CUdeviceptr()> &fresh,
                      const std::function<void(CUdeviceptr)> &release) {
  const SimDrv &d = drv();
  CUstream s;
  CU_OK(d.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0));
  timed_copy(s, src, src, 4096);  // start the copy engine outside the measurement
  double best = 1e9;
  std::ostringstream log;
  for (int t = 0; t < kTrials; t++) {
    CUdeviceptr dst = fresh();
    float first = timed_copy(s, dst, src, kBytes);
    float again = timed_copy(s, dst, src, kBytes);
    release(dst);
    log << " [first " << first << " ms, again " << again << " ms]";
    CHECK(again >= model_ms(kBytes) * 0.99);
    best = std::min(best, static_cast<double>(first) / again);
  }
  CU_OK(d.StreamDestroy(s));
  INFO(what << ": model " << model_ms(kBytes) << " ms;" << log.str() << "; best ratio " << best);
  // Under TSan a copy's real cost is several times the model and the first one also faults in
  // TSan's own shadow of the fresh memory: the ratio would measure the sanitizer, not simdrv.
  if (!kTsan) CHECK(best <= kMaxRatio);
}

CUdeviceptr pinned_filled(size_t n, unsigned char v) {
  void *p;
  CU_OK(drv().MemHostAlloc(&p, n, CU_MEMHOSTALLOC_PORTABLE));
  std::memset(p, v, n);
  return reinterpret_cast<CUdeviceptr>(p);
}

}  // namespace

TEST_CASE("first copy into fresh cuMemAlloc memory takes the model's time", "[simdrv][timing][commit]") {
  const SimDrv &d = drv();
  sim_setup();
  CUdeviceptr src = pinned_filled(kBytes, 7);
  CUdeviceptr last = 0;
  check_first_copy(
      "h2d into cuMemAlloc", src,
      [&] {
        CUdeviceptr p;
        CU_OK(d.MemAlloc(&p, kBytes));
        return p;
      },
      [&](CUdeviceptr p) {
        last = reinterpret_cast<const unsigned char *>(p)[kBytes - 1];
        CU_OK(d.MemFree(p));
      });
  CHECK(last == 7);  // the copies happened
  CU_OK(d.MemFreeHost(reinterpret_cast<void *>(src)));
}

TEST_CASE("first copy into fresh cuMemHostAlloc memory takes the model's time", "[simdrv][timing][commit]") {
  const SimDrv &d = drv();
  sim_setup();
  CUdeviceptr src;
  CU_OK(d.MemAlloc(&src, kBytes));
  std::memset(reinterpret_cast<void *>(src), 5, kBytes);
  CUdeviceptr last = 0;
  check_first_copy(
      "d2h into cuMemHostAlloc", src,
      [&] {
        void *p;
        CU_OK(d.MemHostAlloc(&p, kBytes, CU_MEMHOSTALLOC_PORTABLE));
        return reinterpret_cast<CUdeviceptr>(p);
      },
      [&](CUdeviceptr p) {
        last = reinterpret_cast<const unsigned char *>(p)[kBytes - 1];
        CU_OK(d.MemFreeHost(reinterpret_cast<void *>(p)));
      });
  CHECK(last == 5);
  CU_OK(d.MemFree(src));
}

TEST_CASE("first copy into a fresh VMM mapping takes the model's time", "[simdrv][timing][commit][vmm]") {
  const SimDrv &d = drv();
  sim_setup();
  CUdeviceptr src = pinned_filled(kBytes, 9);
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc acc;
  std::memset(&acc, 0, sizeof acc);
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr last = 0;
  check_first_copy(
      "h2d into cuMemCreate + cuMemMap", src,
      [&] {
        CUmemGenericAllocationHandle h;
        CU_OK(d.MemCreate(&h, kBytes, &prop, 0));
        CUdeviceptr va;
        CU_OK(d.MemAddressReserve(&va, kBytes, 0, 0, 0));
        CU_OK(d.MemMap(va, kBytes, 0, h, 0));
        CU_OK(d.MemRelease(h));  // the mapping keeps the chunk alive
        CU_OK(d.MemSetAccess(va, kBytes, &acc, 1));
        return va;
      },
      [&](CUdeviceptr va) {
        last = reinterpret_cast<const unsigned char *>(va)[kBytes - 1];
        CU_OK(d.MemUnmap(va, kBytes));
        CU_OK(d.MemAddressFree(va, kBytes));
      });
  CHECK(last == 9);
  CU_OK(d.MemFreeHost(reinterpret_cast<void *>(src)));
}
