// The engine trace (ebb/trace.h) of a backward across two devices: a span per node on the engine
// thread that ran it, with its device, graph task and sequence number; stream tracks with the
// kernels and copies; allocator instants and the device memory counters; a flow for each gradient
// that crossed devices. The exported JSON is read back and checked the way a viewer's importer
// relies on it (tests/support/trace_check.hpp): it parses, slices on one track nest, flows pair
// up inside slices, every track is named. Also ebb-train's trace, as a user makes it.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ebb/trace.h"
#include "ebb_test_util.hpp"
#include "devices_test_util.hpp"
#include "trace_check.hpp"

using namespace ebb_test;

static constexpr int64_t kHostPid = EBB_MAX_DEVICES + 1; // (ebb/trace.h: devices are pid d + 1)

namespace {

std::string slurp(const std::string &path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A temporary file name, removed at scope exit.
struct TmpFile {
  std::string path;
  TmpFile() {
    char p[] = "/tmp/ebb_trace_engine_XXXXXX";
    int fd = mkstemp(p);
    REQUIRE(fd >= 0);
    close(fd);
    path = p;
  }
  ~TmpFile() { std::remove(path.c_str()); }
};

void require_valid(const trace_check::Report &r) {
  for (const auto &e : r.errors) UNSCOPED_INFO(e);
  REQUIRE(r.errors.empty());
}

// Every node of the graph behind t: (name, sequence number).
void graph_nodes(const ebb_node_t *n, std::set<std::pair<std::string, uint64_t>> *out) {
  if (!n) return;
  uint64_t seq = 0;
  EBB_REQUIRE_OK(ebb_node_sequence_nr(n, &seq));
  if (!out->insert({ebb_node_name(n), seq}).second) return;
  int nn = 0;
  EBB_REQUIRE_OK(ebb_node_num_next(n, &nn));
  for (int i = 0; i < nn; i++) {
    const ebb_node_t *x = nullptr;
    int nr = 0;
    EBB_REQUIRE_OK(ebb_node_next(n, i, &x, &nr));
    graph_nodes(x, out);
  }
}

double arg_num(const trace_check::Json &args, const char *k) {
  const trace_check::Json *v = args.get(k);
  return v && v->kind == trace_check::Json::Num ? v->num : -1;
}

} // namespace

TEST_CASE("trace engine: a backward over two devices traces its nodes, streams, allocator and the gradients that cross",
          "[autograd][trace]") {
  EbbSession session;
  EngineSettings keep;
  EBB_NEED_DEVICES(2); // the presets and CMakeLists.txt set EBB_SIM_DEVICES=2
  EBB_REQUIRE_OK(ebb_trace_enable(1 << 16));
  std::set<std::pair<std::string, uint64_t>> nodes;
  {
    Tensor w0 = leaf(0, vals(1), "w0"), w1 = leaf(1, vals(2), "w1");
    Tensor a = scale(w0, 3);  // device 0
    Tensor b = mul(a, a);
    Tensor bb = to_dev(b, 1); // crosses to device 1: its gradient crosses back in the backward
    Tensor c = mul(bb, w1);
    Tensor loss = sum(c);
    graph_nodes(grad_fn(loss), &nodes);
    EBB_REQUIRE_OK(backward({loss}));
    sync_all();
  }
  REQUIRE(nodes.size() >= 6);
  TmpFile f;
  EBB_REQUIRE_OK(ebb_trace_export_json(f.path.c_str()));
  ebb_trace_disable();
  trace_check::Report r;
  trace_check::check(slurp(f.path), &r);
  require_valid(r);
  CHECK(r.display_unit == "ns");
  CHECK(r.process_names[kHostPid] == "host");
  CHECK(r.process_names[1] == "device 0");
  CHECK(r.process_names[2] == "device 1");

  // Every node ran once, as a span with its name, sequence number, device and graph task, on a
  // device worker's track (a backward over two devices runs on the workers).
  std::set<double> tasks;
  for (const auto &nd : nodes) {
    INFO("node " << nd.first << " (seq " << nd.second << ")");
    int found = 0;
    for (const auto &s : r.slices) {
      if (s.name != nd.first || arg_num(s.args, "seq") != (double)nd.second) continue;
      found++;
      CHECK(s.pid == kHostPid);
      std::string track = r.thread_names[{s.pid, s.tid}];
      CHECK(track.find("engine device ") == 0);
      double dev = arg_num(s.args, "device");
      CHECK((dev == 0 || dev == 1));
      CHECK(track == "engine device " + std::to_string((int)dev) + " worker");
      CHECK(arg_num(s.args, "graph_task") >= 0);
      tasks.insert(arg_num(s.args, "graph_task"));
    }
    CHECK(found == (nd.first == "AccumulateGrad" ? 2 : 1)); // (w0's and w1's share UINT64_MAX)
  }
  CHECK(tasks.size() == 1);
  // The gradient of bb crosses from device 1 (ToDeviceBackward's consumer side) to device 0.
  CHECK(r.flows_paired >= 1);
  // Stream tracks in the devices' processes, named after the stream, holding kernel spans.
  int stream_slices = 0;
  for (const auto &s : r.slices)
    if (s.pid != kHostPid) {
      stream_slices++;
      CHECK(r.thread_names[{s.pid, s.tid}].find("stream ") == 0);
    }
  CHECK(stream_slices > 0);
  CHECK(r.slices_by_name.count("copy D2D") + r.slices_by_name.count("copy peer") > 0); // to_dev's copy
  // The allocator: instants, and each device's counter of allocated bytes.
  CHECK(r.by_phase["i"] > 0);
  CHECK(r.counters.count("allocated bytes") == 1);
}

TEST_CASE("trace engine: a span per node on the calling thread when the backward stays on one device",
          "[autograd][trace]") {
  EbbSession session;
  EngineSettings keep;
  EBB_REQUIRE_OK(ebb_trace_enable(1 << 14));
  std::set<std::pair<std::string, uint64_t>> nodes;
  {
    Tensor w = leaf(0, vals(3), "w");
    Tensor loss = sum(mul(scale(w, 2), w));
    graph_nodes(grad_fn(loss), &nodes);
    EBB_REQUIRE_OK(backward({loss}));
    sync_all();
  }
  TmpFile f;
  EBB_REQUIRE_OK(ebb_trace_export_json(f.path.c_str()));
  ebb_trace_disable();
  trace_check::Report r;
  trace_check::check(slurp(f.path), &r);
  require_valid(r);
  for (const auto &nd : nodes) {
    INFO("node " << nd.first);
    int found = 0;
    for (const auto &s : r.slices)
      if (s.name == nd.first && arg_num(s.args, "seq") == (double)nd.second) {
        found++;
        CHECK(r.thread_names[{s.pid, s.tid}] == "engine caller thread");
      }
    CHECK(found == 1); // (one leaf: one AccumulateGrad)
  }
  CHECK(r.flows_paired == 0); // nothing crossed devices
}

// ebb-train's trace (tools/ebb-train.c, --trace) as a user makes it: valid, with every kind of
// record. The counts are printed for the record.
TEST_CASE("trace engine: ebb-train's trace of three steps is valid and holds every kind of event", "[autograd][trace][tools]") {
  const char *bin = std::getenv("EBB_TRAIN");
  if (!bin || !*bin) EBB_SKIP("EBB_TRAIN is not set (tests/autograd/CMakeLists.txt sets it where tools/ is built)");
  char dir[] = "/tmp/ebb_trace_train_XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  std::string d = dir;
  std::string cmd = "cd '" + d + "' && '" + bin + "' --steps 3 --quiet --trace trace.json --snapshot mem.json --timeline mem.html > out.txt 2>&1";
  int rc = std::system(cmd.c_str());
  std::string out = slurp(d + "/out.txt");
  INFO(out);
  REQUIRE(WIFEXITED(rc));
  REQUIRE(WEXITSTATUS(rc) == 0);
  trace_check::Report r;
  trace_check::check(slurp(d + "/trace.json"), &r);
  for (const char *f : {"trace.json", "mem.json", "mem.html", "out.txt"}) std::remove((d + "/" + f).c_str());
  rmdir(dir);
  require_valid(r);
  std::ostringstream counts;
  counts << "ebb-train --steps 3 trace:";
  for (const auto &kv : r.by_phase) counts << " " << kv.first << "=" << kv.second;
  counts << " flows_paired=" << r.flows_paired << " tracks=" << r.thread_names.size() << " counters=" << r.counters.size();
  std::map<std::string, size_t> top;
  for (const char *n : {"copy H2D", "copy D2H", "copy D2D", "copy peer", "offload out", "offload reload", "wait event",
                        "wait event (other device)", "wait stream"})
    if (r.slices_by_name.count(n)) counts << " [" << n << "]=" << r.slices_by_name[n];
  WARN(counts.str());
  CHECK(r.by_phase["X"] > 0);
  CHECK(r.by_phase["i"] > 0);
  CHECK(r.by_phase["C"] > 0);
  CHECK(r.slices_by_name.count("offload out") == 1);
  CHECK(r.slices_by_name.count("offload reload") == 1);
  // Gradients crossing threads (flows) and the device workers come with a second device.
  bool two = false;
  {
    EbbSession session;
    two = ebb_test_have_devices(2, "flows and device workers in ebb-train's trace");
  }
  if (two) {
    CHECK(r.flows_paired > 0);
    bool workers = false;
    for (const auto &kv : r.thread_names) workers |= kv.second.find("engine device") == 0;
    CHECK(workers);
  }
}
