// ebb_copy_async in every direction, with the data verified: host (pageable and pinned) to and
// from device, device to device, peer both ways and from either side, multi-chunk pageable
// staging, and the refused cases.
#include <cstring>
#include <string>
#include <vector>

#include "streams_test_util.hpp"

using namespace streams_test;

TEST_CASE("copy: pageable and pinned host to device and back", "[streams][copy]") {
  EbbSession session;
  const size_t n = 100000 + 3; // not a multiple of anything
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s));
  DevBuf d(0, n), d2(0, n);
  std::vector<unsigned char> src(n), back(n, 0);
  fill_pattern(src.data(), n, 1);
  ebb_stream_stats before, after;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&before));
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), src.data(), n, s));  // H2D pageable
  std::memset(src.data(), 0xee, n);                          // src may be reused at once
  EBB_REQUIRE_OK(ebb_copy_async(d2.p(), d.p(), n, s));       // D2D, same device
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), d2.p(), n, s)); // D2H pageable
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(check_pattern(back.data(), n, 1));
  EBB_REQUIRE_OK(ebb_stream_get_stats(&after));
  CHECK(after.staged_bytes - before.staged_bytes == 2 * n);

  PinnedBuf pin(n), pin_back(n);
  fill_pattern(pin.bytes_ptr(), n, 2);
  std::memset(pin_back.ptr, 0, n);
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), pin.ptr, n, s));      // H2D pinned
  EBB_REQUIRE_OK(ebb_copy_async(pin_back.ptr, d.p(), n, s)); // D2H pinned
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(check_pattern(pin_back.bytes_ptr(), n, 2));
  ebb_stream_stats pinned_after;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&pinned_after));
  CHECK(pinned_after.staged_bytes == after.staged_bytes); // pinned memory is never staged
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: pageable copies larger than the staging ring go chunk by chunk", "[streams][copy]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  const size_t n = (size_t(16) << 20) + 12345; // 5 uses of a ring of 4 chunks of 4 MiB: it wraps
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_HIGH, &s));
  DevBuf d(1, n);
  std::vector<unsigned char> src(n), back(n, 0);
  fill_pattern(src.data(), n, 3);
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), src.data(), n, s));
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), d.p(), n, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(check_pattern(back.data(), n, 3));
  ebb_stream_stats st;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&st));
  CHECK(st.staged_bytes == 2 * n);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: a busy staging chunk is waited for, never overwritten", "[streams][copy]") {
  ScopedEnv chunk("EBB_STAGING_CHUNK", "65536");
  ScopedEnv chunks("EBB_STAGING_CHUNKS", "2");
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  const size_t n = 1 << 20; // 16 uses of 2 chunks
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  DevBuf d(0, n);
  std::vector<unsigned char> src(n), back(n, 0);
  fill_pattern(src.data(), n, 4);
  // The stream is held by a gate, so the third chunk must wait for the first: the copy call
  // blocks until the opener thread lets the stream run.
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(s, k.gate, &ga, nullptr));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    open.store(1, std::memory_order_release);
  });
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), src.data(), n, s));
  opener.join();
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), d.p(), n, s));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s));
  CHECK(check_pattern(back.data(), n, 4));
  ebb_stream_stats st;
  EBB_REQUIRE_OK(ebb_stream_get_stats(&st));
  CHECK(st.staging_waits >= 1);
  CHECK(st.staged_bytes == 2 * n);
  EBB_REQUIRE_OK(ebb_stream_release(s));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: peer copies both ways, on a stream of either device", "[streams][copy][peer]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  const size_t n = 300000;
  DevBuf a(0, n), b(1, n), c(0, n);
  PinnedBuf pin(n), out(n);
  fill_pattern(pin.bytes_ptr(), n, 5);
  ebb_stream_t *s0 = nullptr, *s1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_from_pool(0, EBB_PRIO_LOW, &s0));
  EBB_REQUIRE_OK(ebb_stream_from_pool(1, EBB_PRIO_LOW, &s1));
  EBB_REQUIRE_OK(ebb_copy_async(a.p(), pin.ptr, n, s0));
  // Device 0 -> 1 on device 0's stream; the copy waits for nothing on device 1 but device 1's
  // current stream is made to wait for the copy, so the next copy on s1 after a wait is safe.
  EBB_REQUIRE_OK(ebb_copy_async(b.p(), a.p(), n, s0));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(s1, s0));
  // Device 1 -> 0 on device 1's stream.
  EBB_REQUIRE_OK(ebb_copy_async(c.p(), b.p(), n, s1));
  EBB_REQUIRE_OK(ebb_stream_wait_stream(s0, s1));
  EBB_REQUIRE_OK(ebb_copy_async(out.ptr, c.p(), n, s0));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s0));
  CHECK(check_pattern(out.bytes_ptr(), n, 5));

  // Device 0 -> 1 issued on device 1's stream: s1 waits for device 0's current stream first.
  fill_pattern(pin.bytes_ptr(), n, 6);
  ebb_stream_t *cur0 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur0));
  EBB_REQUIRE_OK(ebb_copy_async(a.p(), pin.ptr, n, cur0)); // pending on device 0's current stream
  EBB_REQUIRE_OK(ebb_copy_async(b.p(), a.p(), n, s1));
  EBB_REQUIRE_OK(ebb_copy_async(out.ptr, b.p(), n, s1));
  EBB_REQUIRE_OK(ebb_stream_synchronize(s1));
  CHECK(check_pattern(out.bytes_ptr(), n, 6));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: peer copy orders against the other device's current stream", "[streams][copy][peer]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  const size_t n = 4096;
  DevBuf a(0, n), b(1, n);
  PinnedBuf pin(n), out(n);
  fill_pattern(pin.bytes_ptr(), n, 7);
  ebb_stream_t *mine1 = nullptr, *cur0 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(1, EBB_PRIO_LOW, &mine1));
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur0));
  // Device 0's current stream is held by a gate and then writes src: the peer copy on device
  // 1's stream must wait for it.
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(cur0, k.gate, &ga, nullptr));
  EBB_REQUIRE_OK(ebb_copy_async(a.p(), pin.ptr, n, cur0));
  EBB_REQUIRE_OK(ebb_copy_async(b.p(), a.p(), n, mine1));
  EBB_REQUIRE_OK(ebb_copy_async(out.ptr, b.p(), n, mine1));
  bool idle = true;
  EBB_REQUIRE_OK(ebb_stream_query(mine1, &idle));
  CHECK_FALSE(idle);
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_stream_synchronize(mine1));
  CHECK(check_pattern(out.bytes_ptr(), n, 7));
  EBB_REQUIRE_OK(ebb_stream_release(mine1));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: zero bytes, NULL, overlap, host to host, wrong device, released stream", "[streams][copy]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  ebb_stream_t *s0 = nullptr, *s1 = nullptr;
  EBB_REQUIRE_OK(ebb_stream_default(0, &s0));
  EBB_REQUIRE_OK(ebb_stream_default(1, &s1));
  DevBuf d(0, 1024), d1(1, 1024);
  std::vector<char> h(1024), h2(1024);
  PinnedBuf pin(1024);
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), h.data(), 0, s0));
  EBB_REQUIRE_OK(ebb_copy_async(nullptr, nullptr, 0, s0)); // empty tensors may have no data
  EBB_CHECK_FAILS(ebb_copy_async(nullptr, h.data(), 16, s0), EBB_EINVAL, "dst is NULL");
  EBB_CHECK_FAILS(ebb_copy_async(d.p(), nullptr, 16, s0), EBB_EINVAL, "src is NULL");
  EBB_CHECK_FAILS(ebb_copy_async(d.ints() + 1, d.ints(), 64, s0), EBB_EINVAL, "overlap");
  EBB_CHECK_FAILS(ebb_copy_async(d.p(), d.p(), 64, s0), EBB_EINVAL, "overlap");
  EBB_CHECK_FAILS(ebb_copy_async(h.data(), h2.data(), 64, s0), EBB_EINVAL, "use memcpy");
  EBB_CHECK_FAILS(ebb_copy_async(h.data(), pin.ptr, 64, s0), EBB_EINVAL, "use memcpy");
  EBB_CHECK_FAILS(ebb_copy_async(d1.p(), h.data(), 64, s0), EBB_EDEVICE, "device 1");
  EBB_CHECK_FAILS(ebb_copy_async(d.p(), d.ints() + 128, 64, s1), EBB_EDEVICE, "device 0");
  ebb_stream_t *gone = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &gone));
  EBB_REQUIRE_OK(ebb_stream_release(gone));
  EBB_CHECK_FAILS(ebb_copy_async(d.p(), h.data(), 64, gone), EBB_EFREED, "released");
  EBB_CHECK_FAILS(ebb_copy_async(d.p(), h.data(), 64, nullptr), EBB_EINVAL, "NULL");
  EBB_REQUIRE_OK(ebb_stream_synchronize(s0));
  REQUIRE(ebb_debug_live_handles() == 0);
}

TEST_CASE("copy: a stream released with copies pending still completes them", "[streams][copy]") {
  EbbSession session;
  if (!cpu_kernels()) EBB_SKIP("no CPU kernels on this driver");
  Kernels k;
  const size_t n = (size_t(5) << 20) + 7; // two staging chunks each way
  DevBuf d(0, n);
  std::vector<unsigned char> src(n), back(n, 0);
  fill_pattern(src.data(), n, 8);
  ebb_stream_t *s = nullptr;
  EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
  std::atomic<int> open{0};
  GateArgs ga{&open};
  EBB_REQUIRE_OK(ebb_stream_launch(s, k.gate, &ga, nullptr));
  EBB_REQUIRE_OK(ebb_copy_async(d.p(), src.data(), n, s));
  EBB_REQUIRE_OK(ebb_copy_async(back.data(), d.p(), n, s));
  EBB_REQUIRE_OK(ebb_stream_release(s)); // returns at once; the driver finishes the work
  open.store(1, std::memory_order_release);
  EBB_REQUIRE_OK(ebb_dev_synchronize(0));
  CHECK(check_pattern(back.data(), n, 8));
  REQUIRE(ebb_debug_live_handles() == 0);
}
