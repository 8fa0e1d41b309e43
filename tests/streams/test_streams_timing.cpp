// With the emulated driver's timing model (EBB_SIM_COPY_GBPS=0.05: a copy's data lands over
// bytes / 0.05 ns, 4 MiB in about 84 ms; EBB_SIM_LAUNCH_US=500): a consumer stream sees all of
// what a slow producer copy wrote only when it waits on the producer's event, pageable copies return
// before the device is done, and timing events measure modelled time. No assertion bounds a
// duration from above.
#include <vector>

#include "streams_test_util.hpp"

using namespace streams_test;

namespace {
constexpr size_t kBytes = size_t(4) << 20;
constexpr size_t kInts = kBytes / sizeof(int);

// Snapshots the first and last ints of `a` from inside `c`, after whatever `c` waits for.
void snapshot(const Kernels &k, ebb_stream_t *c, const DevBuf &a, PinnedBuf &out) {
  SnapArgs first{a.ints(), out.ints(), 4};
  SnapArgs last{a.ints() + kInts - 4, out.ints() + 4, 4};
  EBB_REQUIRE_OK(ebb_stream_launch(c, k.snap, &first, nullptr));
  EBB_REQUIRE_OK(ebb_stream_launch(c, k.snap, &last, nullptr));
}
bool all_equal(const PinnedBuf &out, int v) {
  for (int i = 0; i < 8; i++)
    if (out.ints()[i] != v) return false;
  return true;
}
} // namespace

TEST_CASE("timing model: a consumer stream sees the producer's data only through the event", "[streams][timing]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *producer = nullptr, *consumer = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &producer));
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_HIGH, &consumer));
  DevBuf a(0, kBytes);
  PinnedBuf sevens(kBytes), nines(kBytes), out(8 * sizeof(int));
  for (size_t i = 0; i < kInts; i++) {
    sevens.ints()[i] = 7;
    nines.ints()[i] = 9;
  }
  struct CUstream_st *pcu = nullptr;
  EBB_REQUIRE_OK(ebb_stream_cu(producer, &pcu));
  EBB_REQUIRE_OK(ebb__drv_memset_async(0, a.p(), 0, kBytes, pcu));
  EBB_REQUIRE_OK(ebb_stream_synchronize(producer));

  // With the wait: the snapshot runs after the copy has landed.
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &e));
  EBB_REQUIRE_OK(ebb_copy_async(a.p(), sevens.ptr, kBytes, producer));
  EBB_REQUIRE_OK(ebb_event_record(e, producer));
  EBB_REQUIRE_OK(ebb_event_wait(e, consumer));
  snapshot(k, consumer, a, out);
  EBB_REQUIRE_OK(ebb_stream_synchronize(consumer));
  CHECK(all_equal(out, 7));

  // Without it the consumer runs ahead of the producer and reads the old data. A host-function
  // gate holds the producer's copy until the consumer is done, so the read is stale by
  // construction and never races with the copy's writes (a read during the copy is a data race
  // TSan would rightly flag). A gate kernel would also hold the consumer's kernels: the device
  // runs one kernel at a time.
  std::atomic<int> open{0};
  EBB_REQUIRE_OK(ebb_stream_host_func(producer, gate_host_fn, &open));
  EBB_REQUIRE_OK(ebb_copy_async(a.p(), nines.ptr, kBytes, producer));
  snapshot(k, consumer, a, out);
  EBB_REQUIRE_OK(ebb_stream_synchronize(consumer));
  CHECK(all_equal(out, 7));
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_wait_stream(consumer, producer));
  snapshot(k, consumer, a, out);
  EBB_REQUIRE_OK(ebb_stream_synchronize(consumer));
  CHECK(all_equal(out, 9));

  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_stream_release(consumer));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("timing model: a pageable copy returns before the device finishes it", "[streams][timing]") {
  EbbSession session;
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s));
  const size_t n = 2 * kBytes; // two staging chunks, about 170 ms of modelled transfer
  DevBuf d(1, n);
  std::vector<unsigned char> src(n), back(n);
  fill_pattern(src.data(), n, 11);
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), src.data(), n, s));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(s, &idle));
  CHECK_FALSE(idle);
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), d.p(), n, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(check_pattern(back.data(), n, 11));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("timing model: elapsed time between timing events covers the work between them", "[streams][timing]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_HIGH, &s));
  ebb_event_t *t0 = nullptr, *t1 = nullptr;
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_TIMING, &t0));
  EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_TIMING, &t1));
  std::atomic<long> ran{0};
  IncArgs ia{&ran};
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_event_record(t0, s));
  EBB_REQUIRE_OK(ebb_stream_launch(s, k.gate, &ga, nullptr)); // holds t1 back while we check
  for (int i = 0; i < 4; i++) EBB_REQUIRE_OK(ebb_stream_launch(s, k.inc, &ia, nullptr));
  EBB_REQUIRE_OK(ebb_event_record(t1, s));
  float ms = -1;
  EBB_CHECK_FAILS(ebb_event_elapsed(t0, t1, &ms), EBB_ESTATE, "not completed");
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_event_synchronize(t1));
  EBB_REQUIRE_OK(ebb_event_elapsed(t0, t1, &ms));
  CHECK(ms >= 1.0f); // four kernels of at least 0.5 ms each: a floor, never a ceiling
  CHECK(ran.load() == 4);
  EBB_REQUIRE_OK(ebb_event_release(t0));
  EBB_REQUIRE_OK(ebb_event_release(t1));
  REQUIRE(ebb_debug_live_handles() == 0);
}
