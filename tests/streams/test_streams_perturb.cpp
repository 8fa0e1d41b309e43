// Under the emulated driver's perturbation mode (EBB_SIM_PERTURB, set for this executable in
// CMakeLists.txt whatever the preset says) a forgotten event shows up as wrong data: a copy on
// one stream that consumes what a copy on another stream produced reads the new data when it
// waits on the producer's event, and reads the old data, within a bounded number of attempts,
// when that wait is removed. Without the mode both copies run on one copy engine in issue order,
// and the missing wait goes unnoticed. The "removed wait" case asserts that stale data IS seen,
// so it fails if the mode ever stops perturbing.
#include "sanitizers.hpp"
#include "streams_test_util.hpp"

using namespace streams_test;

namespace {

constexpr size_t kInts = 1024;

// A producer stream uploads a value into `staged`; a consumer stream copies `staged` into
// `result` (both copies within device 0) and downloads it. `wait` says whether the consumer waits
// on the producer's event first, as correct code must.
struct HandOff {
  ebb_stream_t *producer = nullptr, *consumer = nullptr;
  ebb_event_t *ready = nullptr;
  DevBuf staged{0, kInts * sizeof(int)}, result{0, kInts * sizeof(int)};
  PinnedBuf up{kInts * sizeof(int)}, down{kInts * sizeof(int)};
  int value = 0;

  HandOff() {
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &producer));
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &consumer));
    EBB_REQUIRE_OK(ebb_event_create(0, EBB_EVENT_DEFAULT, &ready));
    std::memset(up.ptr, 0, up.bytes);
    EBB_REQUIRE_OK(ebb_copy_async(staged.p(), up.ptr, up.bytes, producer));
    EBB_REQUIRE_OK(ebb_stream_synchronize(producer));
  }
  ~HandOff() {
    ebb_event_release(ready);
    ebb_stream_release(producer);
    ebb_stream_release(consumer);
  }

  // One hand-off of value + 1; returns what the consumer read: the new value, or the previous one.
  int run(bool wait) {
    ++value;
    for (size_t i = 0; i < kInts; i++) up.ints()[i] = value;
    EBB_REQUIRE_OK(ebb_copy_async(staged.p(), up.ptr, up.bytes, producer));
    if (wait) {
      EBB_REQUIRE_OK(ebb_event_record(ready, producer));
      EBB_REQUIRE_OK(ebb_event_wait(ready, consumer));
    }
    EBB_REQUIRE_OK(ebb_copy_async(result.p(), staged.p(), kInts * sizeof(int), consumer));
    EBB_REQUIRE_OK(ebb_copy_async(down.ptr, result.p(), kInts * sizeof(int), consumer));
    EBB_REQUIRE_OK(ebb_stream_synchronize(consumer));
    // The producer is synchronized before `up` is rewritten: the host must not race its read.
    EBB_REQUIRE_OK(ebb_stream_synchronize(producer));
    int got = down.ints()[0];
    for (size_t i = 1; i < kInts; i++) REQUIRE(down.ints()[i] == got); // one engine: never torn
    return got;
  }
};

} // namespace

TEST_CASE("perturbed: a consumer copy that waits on the producer's event always reads fresh data",
          "[streams][perturb]") {
  EbbSession session;
  {
    HandOff h;
    for (int i = 0; i < 200 / kSanitizerScale; i++) {
      int got = h.run(true);
      REQUIRE(got == h.value);
    }
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("perturbed: with the wait removed, a consumer copy reads stale data", "[streams][perturb]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("stale reads are forced by the emulated driver's perturbation mode");
  {
    HandOff h;
    // A perturbed run puts the consumer's copy first about a third of the time; 400 attempts
    // without one stale read would mean the mode has stopped perturbing.
    int fresh = 0, stale = 0;
    for (int i = 0; i < 400 && stale == 0; i++) {
      int got = h.run(false);
      REQUIRE((got == h.value || got == h.value - 1));
      (got == h.value ? fresh : stale)++;
    }
    INFO(fresh << " fresh reads before the first stale one");
    CHECK(stale == 1);
  }
  REQUIRE(ebb_debug_live_handles() == 0);
}
