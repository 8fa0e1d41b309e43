// test_simdrv_perturb.cpp: the perturbation mode (EBB_SIM_PERTURB, sim_exec.c) keeps every order
// CUDA guarantees while it shuffles what CUDA leaves open. This executable runs with its own seed
// (EBB_SIM_PERTURB=20261124, set in CMakeLists.txt) so it tests the mode whatever the preset says.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "simdrv_loader.hpp"

TEST_CASE("perturbed: stream order and event order still hold", "[simdrv][perturb][order]") {
  const SimDrv &d = drv();
  int ndev = sim_setup();
  constexpr int kStreams = 4, kBatch = 40, kEventsPerStream = 2;
  const int rounds = 2000 / kSanitizerScale;
  // A chain of rounds hops from stream to stream (of mixed priorities, half of them on device 1
  // when there is one), each round waiting for the previous round's event and then appending to
  // one shared log with a kernel (compute engine), a host function (host engine) or a copy of the
  // log's count (a copy engine). Only the events order the shared log, so any reordering beyond
  // what CUDA allows shows up as a log out of order or a copy that saw the wrong count. Each
  // stream also appends to its own log, with no waits between streams, for stream order.
  std::vector<CUstream> ss;
  std::vector<CUfunction> fn;  // the append kernel of each stream's device
  std::vector<CUevent> evs;    // kEventsPerStream per stream, created in the stream's context
  for (int i = 0; i < kStreams; i++) {
    int dev = ndev > 1 ? i * 2 / kStreams : 0;
    CU_OK(d.CtxSetCurrent(g_ctx[dev]));
    ss.push_back(make_stream(-(i % 3)));
    fn.push_back(get_kernel("append"));
    for (int k = 0; k < kEventsPerStream; k++) {
      CUevent e;
      CU_OK(d.EventCreate(&e, CU_EVENT_DISABLE_TIMING));
      evs.push_back(e);
    }
  }
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  int *log = dev_ints(1 + rounds);
  int *marks = dev_ints(rounds);
  std::vector<int *> own;
  for (int i = 0; i < kStreams; i++) own.push_back(dev_ints(1 + rounds));
  std::vector<AppendArgs> host_args(rounds);  // host functions read their argument when they run
  std::vector<int> want_marks(rounds, -1);
  int appended = 0;
  CUevent prev = nullptr;
  for (int r = 0; r < rounds; r++) {
    int i = r % kStreams;
    CUstream s = ss[i];
    AppendArgs mine{own[i], r};
    CU_OK(launch(fn[i], s, &mine));
    if (prev) CU_OK(d.StreamWaitEvent(s, prev, 0));
    if (r % 3 == 0) {
      AppendArgs a{log, r};
      CU_OK(launch(fn[i], s, &a));
      appended++;
    } else if (r % 3 == 1) {
      host_args[r] = AppendArgs{log, r};
      CU_OK(d.LaunchHostFunc(s, host_append, &host_args[r]));
      appended++;
    } else {
      want_marks[r] = appended;  // a peer copy when s is on device 1
      CU_OK(d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(marks + r), reinterpret_cast<CUdeviceptr>(log), sizeof(int), s));
    }
    prev = evs[i * kEventsPerStream + (r / kStreams) % kEventsPerStream];
    CU_OK(d.EventRecord(prev, s));
    if (r % kBatch == kBatch - 1) {
      // The event completes after all the work before it on its stream, and the chain put every
      // earlier round before that: synchronizing on it alone must leave the shared log complete.
      CU_OK(d.EventSynchronize(prev));
      REQUIRE(__atomic_load_n(&log[0], __ATOMIC_ACQUIRE) == appended);
    }
  }
  for (CUstream s : ss) CU_OK(d.StreamSynchronize(s));
  REQUIRE(log[0] == appended);
  int last = -1, bad_log = 0;
  for (int k = 0; k < appended; k++) {
    if (log[1 + k] <= last) bad_log++;
    last = log[1 + k];
  }
  CHECK(bad_log == 0);
  int bad_marks = 0;
  for (int r = 0; r < rounds; r++)
    if (want_marks[r] >= 0 && marks[r] != want_marks[r]) bad_marks++;
  CHECK(bad_marks == 0);
  for (int i = 0; i < kStreams; i++) {
    int *o = own[i], n = 0;
    for (int r = i; r < rounds; r += kStreams) n += o[1 + r / kStreams] == r;
    CHECK(o[0] == (rounds - i + kStreams - 1) / kStreams);
    CHECK(n == o[0]);
  }
  for (CUstream s : ss) CU_OK(d.StreamDestroy(s));
  for (CUevent e : evs) CU_OK(d.EventDestroy(e));
}

TEST_CASE("perturbed: copies of independent streams on one copy engine run out of issue order",
          "[simdrv][perturb][order]") {
  const SimDrv &d = drv();
  sim_setup();
  // Stream a copies host -> x, stream b then copies x -> y with no wait between them. Both are
  // copies within device 0 on its COPY0 engine, so unperturbed they always run in issue order
  // and b reads a's data; perturbed, b must sometimes run first and read the old contents. With
  // an event wait b must always read the new data.
  CUstream a = make_stream(0), b = make_stream(0);
  CUevent ev;
  CU_OK(d.EventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  constexpr size_t kN = 256;
  int *x = dev_ints(kN), *y = dev_ints(kN);
  void *src_v = nullptr;
  CU_OK(d.MemHostAlloc(&src_v, kN * sizeof(int), 0));
  int *src = static_cast<int *>(src_v);
  auto attempt = [&](int v, bool wait) {  // returns the value b saw: v (fresh) or v - 1 (stale)
    for (size_t i = 0; i < kN; i++) src[i] = v;
    CU_OK(d.MemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(x), src, kN * sizeof(int), a));
    if (wait) {
      CU_OK(d.EventRecord(ev, a));
      CU_OK(d.StreamWaitEvent(b, ev, 0));
    }
    CU_OK(d.MemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(y), reinterpret_cast<CUdeviceptr>(x), kN * sizeof(int), b));
    CU_OK(d.StreamSynchronize(a));
    CU_OK(d.StreamSynchronize(b));
    for (size_t i = 1; i < kN; i++) REQUIRE(y[i] == y[0]);  // one engine: never a torn copy
    return y[0];
  };
  int v = 0, fresh = 0, stale = 0;
  for (int i = 0; i < 200 / kSanitizerScale; i++) {
    ++v;
    REQUIRE(attempt(v, true) == v);
  }
  for (int i = 0; i < 400 && stale == 0; i++) {
    ++v;
    int got = attempt(v, false);
    REQUIRE((got == v || got == v - 1));
    (got == v ? fresh : stale)++;
  }
  INFO("without the wait: " << fresh << " fresh reads before the first stale one");
  CHECK(stale == 1);
  CU_OK(d.MemFreeHost(src_v));
  CU_OK(d.StreamDestroy(a));
  CU_OK(d.StreamDestroy(b));
  CU_OK(d.EventDestroy(ev));
}
