// A process group of one rank (MPI's singleton: the test runs without mpirun), on the CPU and
// on an emulated device: rank, size, each collective's result, work handles, and the refusals
// of dist.h (NULLs, released handles, another device's tensor, non-contiguous tensors, wrong
// all-gather outputs, dtypes, options, an unavailable backend), each naming what was wrong.
// MPI can be initialised once per process and ebb finalises it at the last ebb_shutdown, so each
// case creates its groups inside one session; every case is its own process (ctest).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ebb/dist.h"
#include "ebb/trace.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Group {
  ebb_pg_t *pg = nullptr;
  ~Group() {
    if (pg) CHECK(ebb_pg_destroy(pg) == EBB_OK);
  }
};

std::vector<int> group_devices() {
  std::vector<int> d = {EBB_DEVICE_CPU};
  int n = 0;
  if (ebb_dev_count(&n) == EBB_OK && n > 0) d.push_back(0);
  return d;
}

}  // namespace

TEST_CASE("world of one: rank 0 of 1, and each collective gives its one-rank result", "[dist][world1]") {
  EbbSession session;
  for (int dev : group_devices()) {
    INFO(dev_name(dev));
    Group g;
    EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, dev, nullptr, &g.pg));
    int rank = -1, size = -1, d = -2;
    ebb_dist_backend b = EBB_DIST_NCCL;
    EBB_REQUIRE_OK(ebb_pg_rank(g.pg, &rank));
    EBB_REQUIRE_OK(ebb_pg_size(g.pg, &size));
    EBB_REQUIRE_OK(ebb_pg_device(g.pg, &d));
    EBB_REQUIRE_OK(ebb_pg_backend(g.pg, &b));
    CHECK(rank == 0);
    CHECK(size == 1);
    CHECK(d == dev);
    CHECK(b == EBB_DIST_MPI);

    Tensor x = make(dev, EBB_F32, {2, 3}, {1, 2, 3, 4, 5, 6});
    ebb_work_t *w = nullptr;
    EBB_REQUIRE_OK(ebb_all_reduce(g.pg, x, EBB_REDUCE_SUM, &w));
    EBB_REQUIRE_OK(ebb_work_wait(w));
    bool done = false;
    EBB_REQUIRE_OK(ebb_work_test(w, &done));
    CHECK(done);
    EBB_REQUIRE_OK(ebb_work_wait(w)); // again: same answer
    EBB_REQUIRE_OK(ebb_work_release(w));
    CHECK(read(x) == std::vector<double>{1, 2, 3, 4, 5, 6});

    // The blocking form (no handle), and the average.
    Tensor y = make(dev, EBB_F64, {4}, {2, 4, 6, 8});
    EBB_REQUIRE_OK(ebb_all_reduce(g.pg, y, EBB_REDUCE_AVG, nullptr));
    CHECK(read(y) == std::vector<double>{2, 4, 6, 8});
    Tensor z = make(dev, EBB_I64, {3}, {7, -8, 9});
    EBB_REQUIRE_OK(ebb_all_reduce(g.pg, z, EBB_REDUCE_SUM, nullptr));
    CHECK(read(z) == std::vector<double>{7, -8, 9});

    Tensor h = make(dev, EBB_BF16, {2}, {1.5, -2});
    EBB_REQUIRE_OK(ebb_broadcast(g.pg, h, 0, nullptr));
    CHECK(read(h) == std::vector<double>{1.5, -2});

    Tensor out;
    EBB_REQUIRE_OK(ebb_tensor_zeros(dev, EBB_F32, 3, std::vector<int64_t>{1, 2, 3}.data(), out.out()));
    EBB_REQUIRE_OK(ebb_all_gather(g.pg, out, x, &w));
    EBB_REQUIRE_OK(ebb_work_wait(w));
    EBB_REQUIRE_OK(ebb_work_release(w));
    CHECK(read(out) == std::vector<double>{1, 2, 3, 4, 5, 6});
    CHECK(shape_of(out) == std::vector<int64_t>{1, 2, 3});

    EBB_REQUIRE_OK(ebb_barrier(g.pg, &w));
    EBB_REQUIRE_OK(ebb_work_wait(w));
    EBB_REQUIRE_OK(ebb_work_release(w));
    EBB_REQUIRE_OK(ebb_barrier(g.pg, nullptr));

    // An empty tensor is a valid, empty collective.
    Tensor e;
    int64_t zero = 0;
    EBB_REQUIRE_OK(ebb_tensor_empty(dev, EBB_F32, 1, &zero, e.out()));
    EBB_REQUIRE_OK(ebb_all_reduce(g.pg, e, EBB_REDUCE_SUM, nullptr));

    // Many in flight, released before they finish: they still run, in order.
    std::vector<Tensor> ts;
    for (int i = 0; i < 16; i++) {
      ts.push_back(make(dev, EBB_F32, {2}, {double(i), double(-i)}));
      ebb_work_t *wi = nullptr;
      EBB_REQUIRE_OK(ebb_all_reduce(g.pg, ts.back(), EBB_REDUCE_SUM, &wi));
      EBB_REQUIRE_OK(ebb_work_release(wi));
    }
    EBB_REQUIRE_OK(ebb_barrier(g.pg, nullptr));
    if (dev != EBB_DEVICE_CPU) {
      ebb_stream_t *cur;
      EBB_REQUIRE_OK(ebb_stream_current(dev, &cur));
      EBB_REQUIRE_OK(ebb_stream_synchronize(cur));
    }
    for (int i = 0; i < 16; i++) CHECK(read(ts[(size_t)i]) == std::vector<double>{double(i), double(-i)});
  }
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("the group and work calls refuse NULLs, released handles and bad options", "[dist][errors]") {
  EbbSession session;
  ebb_pg_t *pg = nullptr;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, nullptr), EBB_EINVAL, "ebb_pg_create", "out is NULL");
  EBB_CHECK_MSG(ebb_pg_create((ebb_dist_backend)7, EBB_DEVICE_CPU, nullptr, &pg), EBB_EINVAL, "backend 7");
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, 99, nullptr, &pg), EBB_EDEVICE, "device 99");
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_NCCL, EBB_DEVICE_CPU, nullptr, &pg), EBB_ENOTSUP, "NCCL", "EBB_DEVICE_CPU");
  ebb_pg_options o = {};
  o.world_size = -1;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg), EBB_EINVAL, "world_size -1");
  o = {};
  o.timeout_ms = -5;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg), EBB_EINVAL, "timeout_ms -5");
  o = {};
  o.version = EBB_PG_OPTIONS_VERSION + 1;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg), EBB_ENOTSUP, "newer");
  o = {};
  o.world_size = 4; // the job has one rank
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg), EBB_EINVAL, "world_size 4", "1 ranks");
  CHECK(pg == nullptr);

  o = {};
  o.version = EBB_PG_OPTIONS_VERSION;
  o.world_size = 1;
  o.timeout_ms = 60000;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &o, &pg));
  int v;
  EBB_CHECK_MSG(ebb_pg_rank(nullptr, &v), EBB_EINVAL, "ebb_pg_rank", "NULL");
  EBB_CHECK_MSG(ebb_pg_rank(pg, nullptr), EBB_EINVAL, "rank is NULL");
  EBB_CHECK_MSG(ebb_pg_size(pg, nullptr), EBB_EINVAL, "size is NULL");
  EBB_CHECK_MSG(ebb_barrier(nullptr, nullptr), EBB_EINVAL, "ebb_barrier", "pg is NULL");
  EBB_CHECK_MSG(ebb_pg_destroy(nullptr), EBB_EINVAL, "ebb_pg_destroy");

  ebb_work_t *w = nullptr;
  EBB_REQUIRE_OK(ebb_barrier(pg, &w));
  EBB_CHECK_MSG(ebb_work_wait(nullptr), EBB_EINVAL, "ebb_work_wait", "NULL");
  EBB_CHECK_MSG(ebb_work_test(w, nullptr), EBB_EINVAL, "done is NULL");
  EBB_CHECK_MSG(ebb_work_release(nullptr), EBB_EINVAL, "ebb_work_release");
  EBB_REQUIRE_OK(ebb_work_release(w));
  bool done;
  EBB_CHECK_MSG(ebb_work_wait(w), EBB_EFREED, "ebb_work_wait", "released");
  EBB_CHECK_MSG(ebb_work_test(w, &done), EBB_EFREED, "ebb_work_test", "released");
  EBB_CHECK_MSG(ebb_work_release(w), EBB_EFREED, "ebb_work_release", "released");

  EBB_REQUIRE_OK(ebb_pg_destroy(pg));
  EBB_CHECK_MSG(ebb_pg_destroy(pg), EBB_EFREED, "ebb_pg_destroy", "destroyed");
  EBB_CHECK_MSG(ebb_pg_rank(pg, &v), EBB_EFREED, "ebb_pg_rank", "destroyed");
  EBB_CHECK_MSG(ebb_barrier(pg, nullptr), EBB_EFREED, "ebb_barrier", "destroyed");
  CHECK(ebb_debug_live_handles() == 0);
}

TEST_CASE("collectives refuse another device's tensors, non-contiguous ones, wrong outputs and dtypes",
          "[dist][errors][tensors]") {
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  Group g;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &g.pg));
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, nullptr, EBB_REDUCE_SUM, nullptr), EBB_EINVAL, "ebb_all_reduce", "t");
  if (ndev > 0) {
    Tensor d = make(0, EBB_F32, {2}, {1, 2});
    EBB_CHECK_MSG(ebb_all_reduce(g.pg, d, EBB_REDUCE_SUM, nullptr), EBB_EDEVICE, "ebb_all_reduce", "on device 0",
                  "expected a tensor on the CPU");
    EBB_CHECK_MSG(ebb_broadcast(g.pg, d, 0, nullptr), EBB_EDEVICE, "ebb_broadcast");
  }
  Tensor m = make(EBB_DEVICE_CPU, EBB_F32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor mt;
  EBB_REQUIRE_OK(ebb_tensor_transpose(m, 0, 1, mt.out()));
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, mt, EBB_REDUCE_SUM, nullptr), EBB_EINVAL, "not contiguous", "f32[3, 2]");
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, m, (ebb_reduce_op)9, nullptr), EBB_EINVAL, "op 9");
  Tensor i = make(EBB_DEVICE_CPU, EBB_I64, {2}, {1, 2});
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, i, EBB_REDUCE_AVG, nullptr), EBB_EINVAL, "EBB_REDUCE_AVG", "i64");
  Tensor bo = make(EBB_DEVICE_CPU, EBB_BOOL, {2}, {1, 0});
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, bo, EBB_REDUCE_SUM, nullptr), EBB_EINVAL, "bool");
  Tensor h = make(EBB_DEVICE_CPU, EBB_F16, {2}, {1, 0});
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, h, EBB_REDUCE_SUM, nullptr), EBB_ENOTSUP, "f16", "MPI");
  EBB_CHECK_MSG(ebb_broadcast(g.pg, m, 1, nullptr), EBB_EINVAL, "root 1", "[0, 1)");
  EBB_CHECK_MSG(ebb_broadcast(g.pg, m, -1, nullptr), EBB_EINVAL, "root -1");

  // all-gather: the output is [size, in's shape] in in's dtype, apart from in.
  Tensor bad;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 2, std::vector<int64_t>{2, 3}.data(), bad.out()));
  EBB_CHECK_MSG(ebb_all_gather(g.pg, bad, m, nullptr), EBB_EINVAL, "ebb_all_gather", "expected f32 [1, 2, 3]");
  Tensor bad64;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F64, 3, std::vector<int64_t>{1, 2, 3}.data(), bad64.out()));
  EBB_CHECK_MSG(ebb_all_gather(g.pg, bad64, m, nullptr), EBB_EINVAL, "f64[1, 2, 3]", "expected f32 [1, 2, 3]");
  Tensor self;
  EBB_REQUIRE_OK(ebb_tensor_view(m, 3, std::vector<int64_t>{1, 2, 3}.data(), self.out()));
  EBB_CHECK_MSG(ebb_all_gather(g.pg, self, m, nullptr), EBB_EINVAL, "share a storage");
  EBB_CHECK_MSG(ebb_all_gather(g.pg, nullptr, m, nullptr), EBB_EINVAL, "out");

  // A released tensor.
  ebb_tensor_t *gone = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, std::vector<int64_t>{2}.data(), &gone));
  EBB_REQUIRE_OK(ebb_tensor_release(gone));
  EBB_CHECK_MSG(ebb_all_reduce(g.pg, gone, EBB_REDUCE_SUM, nullptr), EBB_EFREED, "ebb_all_reduce");

  if (ndev > 0) {
    // A device group refuses CPU tensors and another device's.
    Group gd;
    EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, 0, nullptr, &gd.pg));
    EBB_CHECK_MSG(ebb_all_reduce(gd.pg, m, EBB_REDUCE_SUM, nullptr), EBB_EDEVICE, "on the CPU", "expected a tensor on device 0");
    if (ndev > 1) {
      Tensor d1 = make(1, EBB_F32, {2}, {1, 2});
      EBB_CHECK_MSG(ebb_all_reduce(gd.pg, d1, EBB_REDUCE_SUM, nullptr), EBB_EDEVICE, "on device 1", "on device 0");
    }
  }
}

TEST_CASE("the NCCL backend reports itself unavailable on the emulated driver or without libnccl", "[dist][nccl]") {
  EbbSession session;
  ebb_driver_info di;
  EBB_REQUIRE_OK(ebb_driver_get_info(&di));
  CHECK(ebb_dist_available(EBB_DIST_MPI) == EBB_OK);
  CHECK(ebb_dist_available((ebb_dist_backend)3) == EBB_EINVAL);
  if (di.kind == EBB_DRIVER_CUDA) {
    ebb_status st = ebb_dist_available(EBB_DIST_NCCL);
    if (st != EBB_OK) CHECK(std::string(ebb_last_error()).find("libnccl.so.2") != std::string::npos);
    return;
  }
  EBB_CHECK_MSG(ebb_dist_available(EBB_DIST_NCCL), EBB_ENOTSUP, "NCCL", "needs CUDA devices", "simdrv");
  ebb_pg_t *pg = nullptr;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_NCCL, 0, nullptr, &pg), EBB_ENOTSUP, "ebb_pg_create", "NCCL");
  CHECK(pg == nullptr);
}

TEST_CASE("before ebb_init, dist calls answer EBB_ENOTINIT and leave MPI alone", "[dist][errors]") {
  ebb_pg_t *pg = nullptr;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &pg), EBB_ENOTINIT, "ebb_init");
  EBB_CHECK_MSG(ebb_dist_available(EBB_DIST_MPI), EBB_ENOTINIT, "ebb_init");
}

TEST_CASE("a build without MPI reports both backends unavailable, saying so", "[dist][nompi]") {
  EbbSession session;
#if EBB_TEST_HAVE_MPI
  EBB_REQUIRE_OK(ebb_dist_available(EBB_DIST_MPI));
#else
  EBB_CHECK_MSG(ebb_dist_available(EBB_DIST_MPI), EBB_ENOTSUP, "ebb_dist_available", "no MPI", "libopenmpi-dev");
  EBB_CHECK_MSG(ebb_dist_available(EBB_DIST_NCCL), EBB_ENOTSUP, "no MPI");
  ebb_pg_t *pg = nullptr;
  EBB_CHECK_MSG(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &pg), EBB_ENOTSUP, "ebb_pg_create", "no MPI");
  CHECK(pg == nullptr);
#endif
}

TEST_CASE("collectives issued from several threads at once all run, each with its own result", "[dist][threads]") {
  EbbSession session;
  for (int dev : group_devices()) {
    INFO(dev_name(dev));
    Group g;
    EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, dev, nullptr, &g.pg));
    constexpr int kThreads = 4, kEach = 25;
    std::vector<ebb_tensor_t *> ts((size_t)(kThreads * kEach), nullptr);
    std::vector<ebb_status> sts((size_t)(kThreads * kEach), EBB_EINTERNAL);
    std::vector<std::thread> th;
    for (int k = 0; k < kThreads; k++)
      th.emplace_back([&, k] {
        for (int i = 0; i < kEach; i++) {
          size_t j = (size_t)(k * kEach + i);
          double v[2] = {double(j), double(-(int)j)};
          int64_t n = 2;
          ebb_status st = ebb_tensor_from_host(dev, EBB_F64, 1, &n, v, sizeof v, &ts[j]);
          ebb_work_t *w = nullptr;
          if (!st) st = ebb_all_reduce(g.pg, ts[j], EBB_REDUCE_AVG, i % 2 ? &w : nullptr);
          if (!st && w) {
            st = ebb_work_wait(w);
            ebb_status rs = ebb_work_release(w);
            if (!st) st = rs;
          }
          sts[j] = st;
        }
      });
    for (auto &t : th) t.join();
    EBB_REQUIRE_OK(ebb_barrier(g.pg, nullptr));
    for (size_t j = 0; j < ts.size(); j++) {
      INFO("collective " << j);
      CHECK(sts[j] == EBB_OK);
      if (ts[j]) {
        CHECK(read(ts[j]) == std::vector<double>{double(j), -double(j)});
        ebb_tensor_release(ts[j]);
      }
    }
  }
  CHECK(ebb_debug_live_handles() == 0);
}

namespace {

std::string slurp_and_remove(const std::string &path) {
  std::string s;
  if (FILE *f = fopen(path.c_str(), "rb")) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
    fclose(f);
  }
  remove(path.c_str());
  return s;
}

const ebb_trace_span *find_span(const std::vector<ebb_trace_span> &recs, const char *name, int device) {
  for (const ebb_trace_span &r : recs)
    if (r.kind == EBB_TRACE_SPAN && r.name && !strcmp(r.name, name) && r.device == device) return &r;
  return nullptr;
}

}  // namespace

TEST_CASE("the trace shows each collective on its group's track, with its bytes, number and the issuer's owner",
          "[dist][trace]") {
  EbbSession session;
  EBB_REQUIRE_OK(ebb_trace_enable(1 << 14));
  Group cpu, dev;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &cpu.pg));
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, 0, nullptr, &dev.pg));
  Tensor a = make(EBB_DEVICE_CPU, EBB_F32, {5}, {1, 2, 3, 4, 5});
  Tensor b = make(0, EBB_F64, {3}, {1, 2, 3});
  EBB_REQUIRE_OK(ebb_alloc_owner_push(EBB_OWNER_GRADIENT, "bucket under test"));
  EBB_REQUIRE_OK(ebb_all_reduce(cpu.pg, a, EBB_REDUCE_SUM, nullptr));
  EBB_REQUIRE_OK(ebb_all_reduce(dev.pg, b, EBB_REDUCE_SUM, nullptr));
  EBB_REQUIRE_OK(ebb_alloc_owner_pop());
  EBB_REQUIRE_OK(ebb_barrier(dev.pg, nullptr));
  ebb_stream_t *cur;
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  EBB_REQUIRE_OK(ebb_stream_synchronize(cur)); // past the gates: the communication thread has recorded

  std::vector<ebb_trace_span> recs(1 << 14);
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_trace_snapshot(recs.data(), recs.size(), &n));
  recs.resize(n);
  const ebb_trace_span *c = find_span(recs, "all_reduce", EBB_DEVICE_CPU);
  REQUIRE(c != nullptr);
  CHECK(c->stream == 0); // the communication thread's track
  CHECK(c->bytes == 5 * 4);
  CHECK(c->seq >= 1);
  CHECK(c->end_ns >= c->start_ns);
  REQUIRE(c->owner != nullptr);
  CHECK(std::string(c->owner) == "bucket under test");
  const ebb_trace_span *d = find_span(recs, "all_reduce", 0);
  REQUIRE(d != nullptr);
  CHECK(d->stream != 0); // the communication stream's track
  CHECK(d->bytes == 3 * 8);
  REQUIRE(d->owner != nullptr);
  CHECK(std::string(d->owner) == "bucket under test");
  const ebb_trace_span *bar = find_span(recs, "barrier", 0);
  REQUIRE(bar != nullptr);
  CHECK(bar->stream == d->stream);
  CHECK(bar->owner == nullptr); // issued outside any owner scope
  CHECK(bar->seq == d->seq + 1);

  // The stream's track is named for what it carries; MPI's pinned copies are the group's staging.
  std::string path = "ebb_dist_trace_" + std::to_string(getpid());
  EBB_REQUIRE_OK(ebb_trace_export_json((path + ".json").c_str()));
  std::string json = slurp_and_remove(path + ".json");
  CHECK(json.find("comm mpi stream") != std::string::npos);
  CHECK(json.find("(device 0, rank 0 of 1)") != std::string::npos);
  EBB_REQUIRE_OK(ebb_memory_snapshot_json((path + ".mem.json").c_str()));
  std::string mem = slurp_and_remove(path + ".mem.json");
  CHECK(mem.find("dist mpi staging") != std::string::npos);
  ebb_trace_disable();
}
