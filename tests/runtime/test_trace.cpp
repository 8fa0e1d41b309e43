// The trace ring: off by default, spans recorded when on, wrap-around, Chrome JSON export.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

#include "ebb/trace.h"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "ebb_test_util.hpp"

TEST_CASE("trace: off by default records nothing", "[runtime][trace]") {
  CHECK_FALSE(ebb_trace_enabled());
  ebb_trace_span_add("x", 0, 0, 1, 2);
  size_t held = 1;
  uint64_t dropped = 1;
  EBB_REQUIRE_OK(ebb_trace_counts(&held, &dropped));
  CHECK(held == 0);
  CHECK(dropped == 0);
  EBB_CHECK_FAILS(ebb_trace_enable(0), EBB_EINVAL, "capacity 0");
  EBB_CHECK_FAILS(ebb_trace_counts(nullptr, &dropped), EBB_EINVAL, "NULL");
}

TEST_CASE("trace: spans from several threads, wrap-around, JSON export", "[runtime][trace]") {
  EBB_REQUIRE_OK(ebb_trace_enable(100)); // rounded to 128
  const char *name = ebb_trace_intern("work \"quoted\"");
  CHECK(name == ebb_trace_intern("work \"quoted\""));
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; t++)
    ts.emplace_back([t, name] {
      for (int i = 0; i < 100; i++) {
        uint64_t a = ebb_trace_now_ns();
        ebb_trace_span_add(name, t % 2, 0x1000 + t, a, a + 10);
      }
    });
  for (auto &t : ts) t.join();
  // The ring keeps the newest 128 of the 400: which threads they came from depends on the
  // scheduler, so one span per device is added last for the export checks below.
  for (int d = 0; d < 2; d++) {
    uint64_t a = ebb_trace_now_ns();
    ebb_trace_span_add(name, d, 0x2000, a, a + 10);
  }
  size_t held = 0;
  uint64_t dropped = 0;
  EBB_REQUIRE_OK(ebb_trace_counts(&held, &dropped));
  CHECK(held == 128);
  CHECK(dropped == 402 - 128);
  std::vector<ebb_trace_span> spans(200);
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_trace_snapshot(spans.data(), spans.size(), &n));
  CHECK(n == 128);
  for (size_t i = 0; i < n; i++) CHECK(spans[i].end_ns - spans[i].start_ns == 10);
  char path[] = "/tmp/ebb_trace_test_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  EBB_REQUIRE_OK(ebb_trace_export_json(path));
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string js = ss.str();
  CHECK(js.find("\"traceEvents\"") != std::string::npos);
  CHECK(js.find("\"ph\":\"X\"") != std::string::npos);
  CHECK(js.find("work \\\"quoted\\\"") != std::string::npos); // escaped
  CHECK(js.find("\"device 1\"") != std::string::npos);
  std::remove(path);
  EBB_CHECK_FAILS(ebb_trace_export_json("/nonexistent/dir/x.json"), EBB_EIO, "/nonexistent/dir/x.json");
  EBB_CHECK_FAILS(ebb_trace_export_json(nullptr), EBB_EINVAL, "NULL");
  ebb_trace_disable();
  CHECK_FALSE(ebb_trace_enabled());
}

TEST_CASE("trace: kernel launches are traced when on (EBB_TRACE)", "[runtime][trace]") {
  ScopedEnv e("EBB_TRACE", "1024");
  EbbSession s;
  CHECK(ebb_trace_enabled());
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.cpu_kernels) EBB_SKIP("needs CPU kernels");
  const ebb_kernel_t *k = nullptr;
  struct A { int x; };
  EBB_REQUIRE_OK(ebb_kernel_declare("test.traced", sizeof(A), [](void *) {}, nullptr, &k));
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  A a{1};
  for (int i = 0; i < 5; i++) EBB_REQUIRE_OK(ebb_kernel_launch(k, 0, st, &a, nullptr));
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  std::vector<ebb_trace_span> spans(64);
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_trace_snapshot(spans.data(), spans.size(), &n));
  int found = 0;
  for (size_t i = 0; i < n; i++)
    if (std::string(spans[i].name) == "test.traced") {
      found++;
      CHECK(spans[i].device == 0);
      CHECK(spans[i].stream == (uint64_t)(uintptr_t)st);
    }
  CHECK(found == 5);
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
  ebb_trace_disable();
}
