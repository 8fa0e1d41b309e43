// test_streams_device_error.cpp: a sticky driver error (CUDA_ERROR_LAUNCH_FAILED, as a kernel's
// fault leaves on a GPU) met while waiting for a stream: the wait ends at once with the device's
// error state, every later call that gives the device work or waits for it reports that state at
// once, releases still work and ebb_shutdown completes. The fault is injected by the emulated
// driver (EBB_SIM_FAULT, set below before the first ebb_init: this case needs its own process,
// as ctest gives it).
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "ebb/stream.h"
#include "ebb_test_util.hpp"
#include "streams_test_util.hpp"

TEST_CASE("a sticky fault during a stream synchronize ends it at once in the device error state, which every later call reports, and shutdown completes",
          "[streams][fault][sticky]") {
  // The first cuEventQuery is the synchronize's first poll of its event.
  REQUIRE(setenv("EBB_SIM_FAULT", "cuEventQuery:1:CUDA_ERROR_LAUNCH_FAILED", 1) == 0);
  ScopedEnv drv("EBB_DRIVER", "sim");
  EBB_REQUIRE_OK(ebb_init());
  ebb_stream_t *s = nullptr, *s1 = nullptr;
  ebb_event_t *e = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  EBB_REQUIRE_OK(ebb_event_create(0, 0, &e));
  const std::string state = "device 0 is in an error state after CUDA_ERROR_LAUNCH_FAILED in cuEventQuery; release every "
                            "handle and call ebb_shutdown";
  auto t0 = std::chrono::steady_clock::now();
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EDEVICE, state);
  // Later calls on the device: the same state, without asking the driver again.
  EBB_CHECK_FAILS(ebb_stream_synchronize(s), EBB_EDEVICE, state);
  bool idle = false;
  EBB_CHECK_FAILS(ebb_stream_query(s, &idle), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_event_record(e, s), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_dev_synchronize(0), EBB_EDEVICE, "ebb_dev_synchronize: " + state);
  EBB_CHECK_FAILS(ebb_dev_status(0), EBB_EDEVICE, "ebb_dev_status: " + state);
  ebb_stream_t *s2 = nullptr;
  EBB_CHECK_FAILS(ebb_stream_create(0, EBB_PRIO_LOW, &s2), EBB_EDEVICE, state);
  CHECK(s2 == nullptr);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 5.0);  // nothing polled or waited on the failed device
  // Device 1 works on.
  EBB_REQUIRE_OK(ebb_dev_set_current(1));
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s1));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  EBB_REQUIRE_OK(ebb_dev_status(1));
  EBB_REQUIRE_OK(ebb_stream_release(s1));
  EBB_REQUIRE_OK(ebb_dev_set_current(0));
  // Releases work in the error state, and then shutdown completes.
  EBB_REQUIRE_OK(ebb_event_release(e));
  EBB_REQUIRE_OK(ebb_stream_release(s));
  CHECK(ebb_debug_live_handles() == 0);
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK_FALSE(ebb_is_initialized());
}

// Calls on a stream or event are judged by that object's device, never by the calling thread's
// current device: with failed device 0 current, device 1's streams and events work on; with
// healthy device 1 current, device 0's streams are refused with device 0's state, and so is a
// device 1 stream's wait on a device 0 event (which would never complete).
TEST_CASE("the error state is judged by the device of the stream or event a call names, not by the thread's current device",
          "[streams][fault][sticky]") {
  REQUIRE(setenv("EBB_SIM_FAULT", "cuEventQuery:1:CUDA_ERROR_LAUNCH_FAILED", 1) == 0);
  ScopedEnv drv("EBB_DRIVER", "sim");
  EBB_REQUIRE_OK(ebb_init());
  ebb_stream_t *s0 = nullptr, *s1 = nullptr;
  ebb_event_t *e0 = nullptr, *e1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s0));
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &s1));
  EBB_REQUIRE_OK(ebb_event_create(0, 0, &e0));
  EBB_REQUIRE_OK(ebb_event_create(1, 0, &e1));
  EBB_REQUIRE_OK(ebb_event_record(e0, s0));
  const std::string state = "device 0 is in an error state after CUDA_ERROR_LAUNCH_FAILED in cuEventQuery";
  EBB_CHECK_FAILS(ebb_stream_synchronize(s0), EBB_EDEVICE, state);

  // The failed device current: device 1's objects still work.
  EBB_REQUIRE_OK(ebb_dev_set_current(0));
  EBB_REQUIRE_OK(ebb_event_record(e1, s1));
  EBB_REQUIRE_OK(ebb_event_wait(e1, s1));
  EBB_REQUIRE_OK(ebb_event_synchronize(e1));
  bool done = false;
  EBB_REQUIRE_OK(ebb_event_query(e1, &done));
  CHECK(done);
  EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  bool idle = false;
  EBB_REQUIRE_OK(ebb_stream_query(s1, &idle));
  CHECK(idle);
  {
    streams_test::DevBuf dev1(1, 256);
    streams_test::PinnedBuf pinned(256, 1);
    EBB_REQUIRE_OK(ebb_copy_async(dev1.p(), pinned.ptr, 256, s1));
    EBB_REQUIRE_OK(ebb_copy_async(pinned.ptr, dev1.p(), 256, s1));
    EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  }

  // Pinned host memory is portable: a failed device as its hint, another live device serves.
  {
    streams_test::PinnedBuf hinted(4 << 20, 0);
    std::vector<unsigned char> pages(1 << 16);
    EBB_REQUIRE_OK(ebb__drv_host_register(0, pages.data(), pages.size()));
    EBB_REQUIRE_OK(ebb__drv_host_unregister(0, pages.data()));
  }

  // A healthy device current: device 0's objects, and waits on them, are refused by its state.
  EBB_REQUIRE_OK(ebb_dev_set_current(1));
  EBB_CHECK_FAILS(ebb_stream_query(s0, &idle), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_event_record(e0, s0), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_event_query(e0, &done), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_event_wait(e0, s1), EBB_EDEVICE, state);
  EBB_CHECK_FAILS(ebb_stream_wait_stream(s1, s0), EBB_EDEVICE, state);
  EBB_REQUIRE_OK(ebb_dev_status(1));

  for (ebb_event_t *e : {e0, e1}) EBB_REQUIRE_OK(ebb_event_release(e));
  for (ebb_stream_t *s : {s0, s1}) EBB_REQUIRE_OK(ebb_stream_release(s));
  CHECK(ebb_debug_live_handles() == 0);
  EBB_REQUIRE_OK(ebb_shutdown());
}
