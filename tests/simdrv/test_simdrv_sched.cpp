// test_simdrv_sched.cpp: the unperturbed scheduler's own policy, which CUDA does not promise and
// the perturbation mode deliberately breaks: an engine serves ready streams by priority, FIFO
// within one. This executable runs with EBB_SIM_PERTURB=0 (CMakeLists.txt); what every mode must
// keep (stream order, event order) is tested in test_simdrv_exec.cpp and test_simdrv_perturb.cpp.
#include <catch2/catch.hpp>

#include <cstring>

#include "simdrv_loader.hpp"

namespace {

// Holds a device's compute engine busy until opened: a "gate" kernel spins on the flag.
struct Gate {
  int flag = 0;
  GateArgs args{&flag};
  void close_on(CUfunction gate, CUstream s) { CU_OK(launch(gate, s, &args)); }
  void open() { __atomic_store_n(&flag, 1, __ATOMIC_RELEASE); }
};

CUstream make_stream(int prio = 0) {
  CUstream s;
  CU_OK(drv().StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, prio));
  return s;
}

int *dev_ints(size_t n) {
  CUdeviceptr p;
  CU_OK(drv().MemAlloc(&p, n * sizeof(int)));
  std::memset(reinterpret_cast<void *>(p), 0, n * sizeof(int));
  return reinterpret_cast<int *>(p);
}

}  // namespace

TEST_CASE("engines prefer higher-priority streams", "[simdrv][stream][priority]") {
  const SimDrv &d = drv();
  sim_setup();
  CUfunction gate_k = get_kernel("gate"), append = get_kernel("append");
  CUstream g = make_stream(-5), low = make_stream(0), high = make_stream(-5), mid = make_stream(-2);
  int *buf = dev_ints(64);
  Gate gate;
  gate.close_on(gate_k, g);
  AppendArgs a{buf, 0};
  for (int i = 0; i < 5; i++) {
    a.value = 1;
    CU_OK(launch(append, low, &a));
    a.value = 2;
    CU_OK(launch(append, mid, &a));
    a.value = 3;
    CU_OK(launch(append, high, &a));
  }
  gate.open();
  CU_OK(d.CtxSynchronize());
  REQUIRE(buf[0] == 15);
  for (int i = 0; i < 5; i++) CHECK(buf[1 + i] == 3);
  for (int i = 5; i < 10; i++) CHECK(buf[1 + i] == 2);
  for (int i = 10; i < 15; i++) CHECK(buf[1 + i] == 1);
  for (CUstream s : {g, low, high, mid}) CU_OK(d.StreamDestroy(s));
}
