// The driver seam: each wrapper's behaviour and its bad input, through the loaded driver.
#include <cstring>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "ebb_test_util.hpp"

TEST_CASE("seam: device memory, pointer kinds, async copies round trip", "[runtime][seam]") {
  EbbSession s;
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  const size_t bytes = 1 << 20;
  uint64_t d0 = 0;
  EBB_REQUIRE_OK(ebb__drv_mem_alloc(0, bytes, &d0));
  void *pinned = nullptr;
  EBB_REQUIRE_OK(ebb__drv_pinned_alloc(0, bytes, &pinned));
  std::vector<unsigned char> pageable(bytes), back(bytes);
  for (size_t i = 0; i < bytes; i++) pageable[i] = (unsigned char)(i * 7 + 3);

  ebb_ptr_info pi;
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, (void *)(d0 + 100), &pi));
  CHECK(pi.type == EBB_MEMTYPE_DEVICE);
  CHECK(pi.device == 0);
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, pinned, &pi));
  CHECK(pi.type == EBB_MEMTYPE_PINNED);
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, pageable.data(), &pi));
  CHECK(pi.type == EBB_MEMTYPE_PAGEABLE);
  CHECK(pi.device == -1);
  EBB_CHECK_FAILS(ebb__drv_ptr_info(0, pageable.data(), nullptr), EBB_EINVAL, "NULL");

  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  std::memcpy(pinned, pageable.data(), bytes);
  EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, (void *)d0, pinned, bytes, st));
  if (n > 1) {
    uint64_t d1 = 0;
    EBB_REQUIRE_OK(ebb__drv_mem_alloc(1, bytes, &d1));
    EBB_REQUIRE_OK(ebb__drv_ptr_info(0, (void *)d1, &pi));
    CHECK(pi.device == 1);
    EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, (void *)d1, (void *)d0, bytes, st));
    EBB_REQUIRE_OK(ebb__drv_memset_async(0, (void *)d0, 0, bytes, st));
    EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, (void *)d0, (void *)d1, bytes, st));
    EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
    EBB_REQUIRE_OK(ebb__drv_mem_free(1, d1));
  }
  std::memset(pinned, 0, bytes);
  EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, pinned, (void *)d0, bytes, st));
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  CHECK(std::memcmp(pinned, pageable.data(), bytes) == 0);
  bool idle = false;
  EBB_REQUIRE_OK(ebb__drv_stream_query(0, st, &idle));
  CHECK(idle);
  EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, pinned, (void *)d0, 0, st)); // zero bytes: nothing to do

  EBB_CHECK_FAILS(ebb__drv_memcpy_async(0, nullptr, pinned, 4, st), EBB_EINVAL, "dst");
  EBB_CHECK_FAILS(ebb__drv_memcpy_async(0, pinned, nullptr, 4, st), EBB_EINVAL, "src");
  EBB_CHECK_FAILS(ebb__drv_memcpy_async(0, pinned, (void *)d0, 4, nullptr), EBB_EINVAL, "stream");
  EBB_CHECK_FAILS(ebb__drv_mem_alloc(0, 0, &d0), EBB_EINVAL, "0 bytes");
  EBB_CHECK_FAILS(ebb__drv_mem_alloc(n, 16, &d0), EBB_EDEVICE, "does not exist");
  EBB_CHECK_FAILS(ebb__drv_mem_alloc(0, 16, nullptr), EBB_EINVAL, "NULL");
  // Freeing NULL is a no-op, as free(NULL) and the driver: it succeeds and leaves the last
  // error alone; a bad device is still reported.
  EBB_CHECK_FAILS(ebb__drv_mem_free(n, 0), EBB_EDEVICE, "does not exist");
  std::string before = ebb_last_error();
  EBB_REQUIRE_OK(ebb__drv_mem_free(0, 0));
  EBB_REQUIRE_OK(ebb__drv_pinned_free(0, nullptr));
  CHECK(ebb_last_error() == before);

  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
  EBB_REQUIRE_OK(ebb__drv_pinned_free(0, pinned));
  EBB_REQUIRE_OK(ebb__drv_mem_free(0, d0));
  // The driver reports a double free; the seam names the call.
  EBB_CHECK_FAILS(ebb__drv_mem_free(0, d0), EBB_EINVAL, "cuMemFree");
  EBB_CHECK_FAILS(ebb__drv_pinned_free(0, pinned), EBB_EINVAL, "cuMemFreeHost");
  EBB_CHECK_FAILS(ebb__drv_host_unregister(0, nullptr), EBB_EINVAL, "NULL");
}

TEST_CASE("seam: out of memory is ENOMEM with the device and size", "[runtime][seam]") {
  EbbSession s;
  ebb_dev_caps c;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &c));
  uint64_t p = 0;
  EBB_CHECK_FAILS(ebb__drv_mem_alloc(0, c.total_mem + (1ull << 30), &p), EBB_ENOMEM, "device 0");
}

TEST_CASE("seam: events record, wait, query, synchronize, elapsed", "[runtime][seam]") {
  EbbSession s;
  CUstream_st *a = nullptr, *b = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &a));
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, -1, &b));
  CUevent_st *e0 = nullptr, *e1 = nullptr, *notiming = nullptr;
  EBB_REQUIRE_OK(ebb__drv_event_create(0, true, &e0));
  EBB_REQUIRE_OK(ebb__drv_event_create(0, true, &e1));
  EBB_REQUIRE_OK(ebb__drv_event_create(0, false, &notiming));
  EBB_REQUIRE_OK(ebb__drv_event_record(0, e0, a));
  EBB_REQUIRE_OK(ebb__drv_stream_wait_event(0, b, 0, e0));
  EBB_REQUIRE_OK(ebb__drv_event_record(0, e1, b));
  EBB_REQUIRE_OK(ebb__drv_event_synchronize(0, e1));
  bool done = false;
  EBB_REQUIRE_OK(ebb__drv_event_query(0, e1, &done));
  CHECK(done);
  float ms = -1;
  EBB_REQUIRE_OK(ebb__drv_event_elapsed(0, e0, e1, &ms));
  CHECK(ms >= 0);
  EBB_REQUIRE_OK(ebb__drv_event_record(0, notiming, a));
  EBB_REQUIRE_OK(ebb__drv_event_synchronize(0, notiming));
  EBB_CHECK_FAILS(ebb__drv_event_elapsed(0, e0, notiming, &ms), EBB_EINVAL, "cuEventElapsedTime");
  EBB_CHECK_FAILS(ebb__drv_event_elapsed(0, e0, e1, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb__drv_event_record(0, nullptr, a), EBB_EINVAL, "event");
  EBB_CHECK_FAILS(ebb__drv_stream_wait_event(0, a, 0, nullptr), EBB_EINVAL, "event");
  EBB_CHECK_FAILS(ebb__drv_event_create(0, true, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb__drv_stream_create(9, 0, &a), EBB_EDEVICE, "device 9");
  static int calls = 0;
  calls = 0;
  EBB_REQUIRE_OK(ebb__drv_launch_host_func(0, a, [](void *u) { (*(int *)u)++; }, &calls));
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, a));
  CHECK(calls == 1);
  EBB_CHECK_FAILS(ebb__drv_launch_host_func(0, a, nullptr, nullptr), EBB_EINVAL, "fn");
  for (auto *e : {e0, e1, notiming}) EBB_REQUIRE_OK(ebb__drv_event_destroy(0, e));
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, a));
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, b));
  EBB_CHECK_FAILS(ebb__drv_stream_destroy(0, nullptr), EBB_EINVAL, "NULL");
}

TEST_CASE("seam: VMM reserve, create, map, unmap keeps contents", "[runtime][seam]") {
  EbbSession s;
  ebb_dev_caps c;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &c));
  if (!c.vmm) EBB_SKIP("device 0 has no VMM");
  size_t g = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_granularity(0, &g));
  REQUIRE(g > 0);
  uint64_t va = 0, h = 0;
  EBB_REQUIRE_OK(ebb__drv_vmm_reserve(0, 4 * g, &va));
  EBB_REQUIRE_OK(ebb__drv_vmm_create(0, g, &h));
  EBB_REQUIRE_OK(ebb__drv_vmm_map(va + g, g, h, 0));
  ebb_ptr_info pi;
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, (void *)(va + g + 10), &pi));
  CHECK(pi.type == EBB_MEMTYPE_DEVICE);
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  EBB_REQUIRE_OK(ebb__drv_memset_async(0, (void *)(va + g), 0x5a, g, st));
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  EBB_REQUIRE_OK(ebb__drv_vmm_unmap(va + g, g));
  EBB_REQUIRE_OK(ebb__drv_vmm_map(va + 3 * g, g, h, 0)); // same memory, another address
  void *pinned = nullptr;
  EBB_REQUIRE_OK(ebb__drv_pinned_alloc(0, g, &pinned));
  EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, pinned, (void *)(va + 3 * g), g, st));
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  CHECK(((unsigned char *)pinned)[g - 1] == 0x5a);
  // already mapped: libcuda answers CUDA_ERROR_INVALID_VALUE, and so does the emulated driver
  EBB_CHECK_FAILS(ebb__drv_vmm_map(va + 3 * g, g, h, 0), EBB_EINVAL, "cuMemMap");
  EBB_REQUIRE_OK(ebb__drv_vmm_unmap(va + 3 * g, g));
  EBB_REQUIRE_OK(ebb__drv_vmm_release(h));
  EBB_REQUIRE_OK(ebb__drv_vmm_free(va, 4 * g));
  EBB_CHECK_FAILS(ebb__drv_vmm_granularity(0, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb__drv_vmm_reserve(5, g, &va), EBB_EDEVICE, "device 5");
  EBB_CHECK_FAILS(ebb__drv_vmm_free(0, g), EBB_EINVAL, "0");
  EBB_REQUIRE_OK(ebb__drv_pinned_free(0, pinned));
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
}

TEST_CASE("seam: host register and unregister", "[runtime][seam]") {
  EbbSession s;
  ebb_dev_caps c;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &c));
  if (!c.host_register) EBB_SKIP("no host register");
  std::vector<char> buf(1 << 16);
  EBB_REQUIRE_OK(ebb__drv_host_register(0, buf.data(), buf.size()));
  ebb_ptr_info pi;
  EBB_REQUIRE_OK(ebb__drv_ptr_info(0, buf.data() + 5, &pi));
  CHECK(pi.type == EBB_MEMTYPE_PINNED);
  EBB_CHECK_FAILS(ebb__drv_host_register(0, buf.data(), buf.size()), EBB_ESTATE, "cuMemHostRegister");
  EBB_REQUIRE_OK(ebb__drv_host_unregister(0, buf.data()));
  EBB_CHECK_FAILS(ebb__drv_host_unregister(0, buf.data()), EBB_ESTATE, "cuMemHostUnregister");
  EBB_CHECK_FAILS(ebb__drv_host_register(0, buf.data(), 0), EBB_EINVAL, "0 bytes");
}
