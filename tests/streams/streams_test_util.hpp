// Helpers shared by the streams suites: CPU kernels for the emulated driver (a gate that holds a
// stream until the test opens it, an append that records execution order, a snapshot that reads
// device memory from inside a stream) and RAII buffers.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "ebb/runtime.h"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "ebb/stream.h"
#include "ebb_test_util.hpp"

namespace streams_test {

// Holds its stream until *open != 0. Gives up after 10 s so a broken test fails instead of hanging.
struct GateArgs {
  std::atomic<int> *open;
};
inline void gate_kernel(void *a) {
  auto *g = static_cast<GateArgs *>(a);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g->open->load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

// The same gate as a host function (ebb_stream_host_func(s, gate_host_fn, &open)): it holds its
// stream from the driver's host engine, leaving the device's compute engine free for kernels of
// other streams (the emulated driver runs one kernel at a time per device, as a GPU running
// one large kernel would).
inline void gate_host_fn(void *open) {
  GateArgs g{static_cast<std::atomic<int> *>(open)};
  gate_kernel(&g);
}

// buf[(*count)++] = value: the order of the appends is the order the stream ran them.
struct AppendArgs {
  int *buf;
  int *count;
  int value;
};
inline void append_kernel(void *a) {
  auto *p = static_cast<AppendArgs *>(a);
  p->buf[(*p->count)++] = p->value;
}

// out[i] = src[i] for n ints: a kernel that reads device memory at the point it runs.
struct SnapArgs {
  const int *src;
  int *out;
  size_t n;
};
inline void snap_kernel(void *a) {
  auto *p = static_cast<SnapArgs *>(a);
  std::memcpy(p->out, p->src, p->n * sizeof(int));
}

// *counter += 1.
struct IncArgs {
  std::atomic<long> *counter;
};
inline void inc_kernel(void *a) { static_cast<IncArgs *>(a)->counter->fetch_add(1, std::memory_order_relaxed); }

struct Kernels {
  const ebb_kernel_t *gate = nullptr, *append = nullptr, *snap = nullptr, *inc = nullptr;
  Kernels() {
    EBB_REQUIRE_OK(ebb_kernel_declare("streams_test.gate", sizeof(GateArgs), gate_kernel, nullptr, &gate));
    EBB_REQUIRE_OK(ebb_kernel_declare("streams_test.append", sizeof(AppendArgs), append_kernel, nullptr, &append));
    EBB_REQUIRE_OK(ebb_kernel_declare("streams_test.snap", sizeof(SnapArgs), snap_kernel, nullptr, &snap));
    EBB_REQUIRE_OK(ebb_kernel_declare("streams_test.inc", sizeof(IncArgs), inc_kernel, nullptr, &inc));
  }
};

// Whether the devices run CPU kernels (the emulated driver). The tests that hold streams with
// CPU kernels return early otherwise.
inline bool cpu_kernels() {
  ebb_dev_caps caps;
  return ebb_dev_get_caps(0, &caps) == EBB_OK && caps.cpu_kernels;
}

// Creates and releases `n` streams of `device`: a released slot is reused only once 1024 more
// have been released after it (stream.h), so this brings the oldest released slot back.
inline void churn_streams(int device, int n) {
  for (int i = 0; i < n; i++) {
    ebb_stream_t *t = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(device, EBB_PRIO_LOW, &t));
    EBB_REQUIRE_OK(ebb_stream_release(t));
  }
}

// Device memory of `device`, freed at scope exit.
struct DevBuf {
  int device;
  uint64_t ptr = 0;
  size_t bytes;
  DevBuf(int dev, size_t n) : device(dev), bytes(n) { EBB_REQUIRE_OK(ebb__drv_mem_alloc(dev, n, &ptr)); }
  ~DevBuf() {
    if (ptr) ebb__drv_mem_free(device, ptr);
  }
  void *p() const { return reinterpret_cast<void *>(static_cast<uintptr_t>(ptr)); }
  int *ints() const { return static_cast<int *>(p()); }
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
};

// Pinned host memory, freed at scope exit.
struct PinnedBuf {
  void *ptr = nullptr;
  size_t bytes;
  int device;
  explicit PinnedBuf(size_t n, int dev = 0) : bytes(n), device(dev) { EBB_REQUIRE_OK(ebb__drv_pinned_alloc(dev, n, &ptr)); }
  ~PinnedBuf() {
    if (ptr) ebb__drv_pinned_free(device, ptr);
  }
  int *ints() const { return static_cast<int *>(ptr); }
  unsigned char *bytes_ptr() const { return static_cast<unsigned char *>(ptr); }
  PinnedBuf(const PinnedBuf &) = delete;
  PinnedBuf &operator=(const PinnedBuf &) = delete;
};

// A pattern that differs at every 8-byte word and between seeds, to catch misplaced chunks.
// Word-wise so that multi-MiB buffers stay fast under the sanitizers.
inline uint64_t pattern_word(size_t i, unsigned seed) {
  uint64_t z = (uint64_t(i) + 1) * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 29);
}
inline void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i * 8 < n; i++) {
    uint64_t w = pattern_word(i, seed);
    std::memcpy(p + i * 8, &w, n - i * 8 < 8 ? n - i * 8 : 8);
  }
}
inline bool check_pattern(const unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i * 8 < n; i++) {
    uint64_t w = pattern_word(i, seed);
    if (std::memcmp(p + i * 8, &w, n - i * 8 < 8 ? n - i * 8 : 8) != 0) return false;
  }
  return true;
}

} // namespace streams_test
