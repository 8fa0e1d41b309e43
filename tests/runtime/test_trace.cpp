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
#include "trace_check.hpp"

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

TEST_CASE("trace: records of every kind export as events a viewer accepts, and overlapping spans on one track are cut to nest",
          "[runtime][trace]") {
  EBB_REQUIRE_OK(ebb_trace_enable(256));
  EBB_REQUIRE_OK(ebb_trace_thread_name("test main"));
  const uint64_t fake = 0xabc0; // a made-up driver stream handle of device 1
  EBB_REQUIRE_OK(ebb_trace_stream_name(1, fake, "stream 7 (device 1, user)"));
  const uint64_t t = ebb_trace_now_ns();
  uint64_t flow = ebb_trace_flow_id();
  CHECK(flow != 0);
  CHECK(ebb_trace_flow_id() != flow);
  auto rec = [](ebb_trace_kind k, const char *name, uint64_t a, uint64_t b) {
    ebb_trace_span r{};
    r.name = name;
    r.kind = k;
    r.start_ns = a;
    r.end_ns = b;
    r.device = 0;
    return r;
  };
  // The thread's track: a parent span, a child, an instant and a flow start inside; a second span
  // with the flow's end (one thread may end its own flow).
  ebb_trace_span parent = rec(EBB_TRACE_SPAN, "parent", t, t + 10000), child = rec(EBB_TRACE_SPAN, "child", t + 1000, t + 2000);
  child.args = EBB_TRACE_ARG_TASK | EBB_TRACE_ARG_SEQ | EBB_TRACE_ARG_BYTES;
  child.task = 3;
  child.seq = 42;
  child.bytes = 4096;
  child.owner = "owner \"q\"";
  ebb_trace_span inst = rec(EBB_TRACE_INSTANT, "alloc", t + 1500, t + 1500), fs = rec(EBB_TRACE_FLOW_START, "gradient", t + 1800, t + 1800);
  fs.id = flow;
  ebb_trace_span later = rec(EBB_TRACE_SPAN, "later", t + 20000, t + 21000), fe = rec(EBB_TRACE_FLOW_END, "gradient", t + 20000, t + 20000);
  fe.id = flow;
  ebb_trace_span ctr = rec(EBB_TRACE_COUNTER, "allocated bytes", t + 1500, t + 1500);
  ctr.bytes = 1 << 20;
  // Recorded out of order: the export sorts.
  for (const ebb_trace_span *r : {&fe, &child, &later, &inst, &parent, &fs, &ctr}) EBB_REQUIRE_OK(ebb_trace_record(r));
  // The stream's track: two enqueues from two threads overlapping without nesting.
  std::thread th([&] {
    ebb_trace_span a = rec(EBB_TRACE_SPAN, "copy H2D", t + 100, t + 600);
    a.device = 1;
    a.stream = fake;
    (void)ebb_trace_record(&a);
  });
  th.join();
  ebb_trace_span b = rec(EBB_TRACE_SPAN, "kernel", t + 300, t + 900);
  b.device = 1;
  b.stream = fake;
  EBB_REQUIRE_OK(ebb_trace_record(&b));
  char path[] = "/tmp/ebb_trace_kinds_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  EBB_REQUIRE_OK(ebb_trace_export_json(path));
  ebb_trace_disable();
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string js = ss.str();
  std::remove(path);
  trace_check::Report r;
  trace_check::check(js, &r);
  for (const auto &e : r.errors) UNSCOPED_INFO(e);
  CHECK(r.errors.empty());
  CHECK(r.by_phase["X"] == 5);
  CHECK(r.by_phase["i"] == 1);
  CHECK(r.by_phase["C"] == 1);
  CHECK(r.flows_paired == 1);
  CHECK(r.counters.count("allocated bytes") == 1);
  bool main_named = false, stream_named = false;
  for (const auto &kv : r.thread_names) {
    main_named |= kv.first.first == EBB_MAX_DEVICES + 1 && kv.second == "test main";
    stream_named |= kv.first.first == 2 && kv.second == "stream 7 (device 1, user)";
  }
  CHECK(main_named);
  CHECK(stream_named);
  for (const auto &s : r.slices) {
    if (s.name == "child") {
      CHECK(s.args.get("graph_task")->num == 3);
      CHECK(s.args.get("seq")->num == 42);
      CHECK(s.args.get("bytes")->num == 4096);
      CHECK(s.args.get("owner")->str == "owner \"q\"");
      CHECK(s.ts == Approx(1.0).margin(1e-9)); // µs from the earliest record, ns digits kept
      CHECK(s.dur == Approx(1.0).margin(1e-9));
    }
    if (s.name == "kernel") CHECK(s.dur == Approx(0.3).margin(1e-9)); // cut at copy H2D's end
  }
}

TEST_CASE("trace: ebb_trace_record, ebb_trace_thread_name and ebb_trace_stream_name refuse bad input", "[runtime][trace]") {
  ebb_trace_span r{};
  r.name = "x";
  EBB_CHECK_FAILS(ebb_trace_record(nullptr), EBB_EINVAL, "rec is NULL");
  r.kind = EBB_TRACE_KIND_COUNT;
  EBB_CHECK_FAILS(ebb_trace_record(&r), EBB_EINVAL, "kind 5");
  r.kind = EBB_TRACE_SPAN;
  r.start_ns = 10;
  r.end_ns = 5;
  EBB_CHECK_FAILS(ebb_trace_record(&r), EBB_EINVAL, "ends (5 ns) before it starts (10 ns)");
  r.kind = EBB_TRACE_FLOW_END;
  r.id = 0;
  EBB_CHECK_FAILS(ebb_trace_record(&r), EBB_EINVAL, "id 0");
  r.kind = EBB_TRACE_INSTANT;
  EBB_REQUIRE_OK(ebb_trace_record(&r)); // valid, tracing off: nothing recorded
  size_t held = 1;
  uint64_t dropped = 1;
  EBB_REQUIRE_OK(ebb_trace_counts(&held, &dropped));
  CHECK(held == 0);
  EBB_CHECK_FAILS(ebb_trace_thread_name(nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_trace_thread_name(""), EBB_EINVAL, "empty");
  EBB_CHECK_FAILS(ebb_trace_stream_name(-1, 0x10, "s"), EBB_EINVAL, "device -1");
  EBB_CHECK_FAILS(ebb_trace_stream_name(EBB_MAX_DEVICES, 0x10, "s"), EBB_EINVAL, "device 16");
  EBB_CHECK_FAILS(ebb_trace_stream_name(0, 0, "s"), EBB_EINVAL, "stream 0");
  EBB_CHECK_FAILS(ebb_trace_stream_name(0, 0x10, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_trace_export_json(""), EBB_EINVAL, "empty");
}

TEST_CASE("trace: names that are not UTF-8, or cut inside a character, export as valid UTF-8", "[runtime][trace]") {
  EBB_REQUIRE_OK(ebb_trace_enable(64));
  // Latin-1 text (0xE9 is é there, a stray lead byte in UTF-8).
  EBB_REQUIRE_OK(ebb_trace_thread_name("caf\xe9 thread"));
  // 62 ASCII bytes then é (2 bytes, 62-63): a name keeps 63 bytes, so the cut falls inside é
  // and must drop it whole.
  const std::string longname = std::string(62, 'a') + "\xc3\xa9" + "tail";
  const uint64_t fake = 0xbee0;
  EBB_REQUIRE_OK(ebb_trace_stream_name(0, fake, longname.c_str()));
  const uint64_t t = ebb_trace_now_ns();
  ebb_trace_span r{};
  r.name = "na\xc3\xafve \xe2\x82 span"; // well-formed ï, then a 3-byte sequence cut short
  r.kind = EBB_TRACE_SPAN;
  r.start_ns = t;
  r.end_ns = t + 1000;
  r.device = 0;
  r.owner = "\xed\xa0\x80\xc0\xaf"; // a surrogate and an overlong '/': neither is UTF-8
  EBB_REQUIRE_OK(ebb_trace_record(&r));
  ebb_trace_span k = r;
  k.name = "kernel";
  k.owner = nullptr;
  k.stream = fake;
  EBB_REQUIRE_OK(ebb_trace_record(&k));
  char path[] = "/tmp/ebb_trace_utf8_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  EBB_REQUIRE_OK(ebb_trace_export_json(path));
  ebb_trace_disable();
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string js = ss.str();
  std::remove(path);
  CHECK(ebb_first_bad_utf8(js) == std::string::npos);
  trace_check::Report rep;
  trace_check::check(js, &rep);
  for (const auto &e : rep.errors) UNSCOPED_INFO(e);
  CHECK(rep.errors.empty());
  // Bytes that are not UTF-8 read back as the code points of their values (\u00XX).
  bool thread_named = false, stream_named = false;
  for (const auto &kv : rep.thread_names) {
    thread_named |= kv.second == "caf\xc3\xa9 thread";
    stream_named |= kv.second == std::string(62, 'a');
  }
  CHECK(thread_named);
  CHECK(stream_named);
  bool seen = false;
  for (const auto &s : rep.slices) {
    if (s.name != "na\xc3\xafve \xc3\xa2\xc2\x82 span") continue;
    seen = true;
    CHECK(s.args.get("owner")->str == "\xc3\xad\xc2\xa0\xc2\x80\xc3\x80\xc2\xaf");
  }
  CHECK(seen);
  // Where Python is around, its json module (strict UTF-8) reads the file too.
  if (std::system("python3 -c 'pass' >/dev/null 2>&1") == 0) {
    char p2[] = "/tmp/ebb_trace_utf8_py_XXXXXX";
    int fd2 = mkstemp(p2);
    REQUIRE(fd2 >= 0);
    REQUIRE(write(fd2, js.data(), js.size()) == (ssize_t)js.size());
    close(fd2);
    CHECK(std::system(("python3 -c 'import json,sys; json.load(open(sys.argv[1], encoding=\"utf-8\"))' " + std::string(p2)).c_str()) == 0);
    std::remove(p2);
  }
}
