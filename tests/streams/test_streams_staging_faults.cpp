// test_streams_staging_faults.cpp: a pinned staging chunk is never reused before the copy that
// used it has run, even when the driver fails the calls that track it. Each use of a chunk
// records its event; when the record fails the copy drains its stream instead, and when that
// wait fails too the copy's work may still read the chunk: its memory is abandoned and the next
// copy gets a new chunk. The copy reports the record's failure either way.
//
// One chunk in the ring (EBB_STAGING_CHUNKS=1, set by CMake), so the second copy claims the
// first one's chunk. The faults come from the emulated driver (EBB_SIM_FAULT: the first
// cuEventRecord and cuStreamSynchronize of the process), so the case needs a process of its
// own, as ctest gives it.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_test_util.hpp"
#include "streams_test_util.hpp"

using namespace streams_test;

TEST_CASE("a staged copy whose chunk can be neither recorded nor waited for keeps the chunk from the next copy",
          "[streams][copy][fault]") {
  REQUIRE(setenv("EBB_SIM_FAULT", "cuEventRecord:1:CUDA_ERROR_UNKNOWN,cuStreamSynchronize:1:CUDA_ERROR_UNKNOWN", 1) == 0);
  ScopedEnv drv("EBB_DRIVER", "sim");
  EBB_REQUIRE_OK(ebb_init());
  {
    constexpr size_t n = 4096;
    ebb_stream_t *s = nullptr, *t = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &t));
    DevBuf d1(0, n), d2(0, n);
    std::vector<unsigned char> a(n, 0xAA), b(n, 0xBB), back(n, 0);
    // s is busy for 300 ms: the first copy's chunk -> d1 runs after that.
    EBB_REQUIRE_OK(ebb_stream_host_func(s, [](void *) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr));
    EBB_CHECK_MSG(ebb_copy_async(d1.p(), a.data(), n, s), EBB_EDRIVER, "cuEventRecord");
    // The second copy, on an idle stream, fills a chunk now: it must not be the one d1's copy
    // has yet to read.
    EBB_REQUIRE_OK(ebb_copy_async(d2.p(), b.data(), n, t));
    EBB_REQUIRE_OK(ebb_stream_synchronize(t));
    EBB_REQUIRE_OK(ebb_stream_synchronize(s));
    EBB_REQUIRE_OK(ebb_copy_async(back.data(), d1.p(), n, s));
    EBB_REQUIRE_OK(ebb_stream_synchronize(s));
    size_t wrong = 0;
    for (unsigned char c : back) wrong += c != 0xAA;
    CHECK(wrong == 0);
    EBB_REQUIRE_OK(ebb_stream_release(s));
    EBB_REQUIRE_OK(ebb_stream_release(t));
  }
  EBB_REQUIRE_OK(ebb_shutdown());
}
