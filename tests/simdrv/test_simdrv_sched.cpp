// test_simdrv_sched.cpp: the unperturbed scheduler's own policy, which CUDA does not promise and
// the perturbation mode deliberately breaks: an engine serves ready streams by priority, FIFO
// within one. This executable runs with EBB_SIM_PERTURB=0 (CMakeLists.txt); what every mode must
// keep (stream order, event order) is tested in test_simdrv_exec.cpp and test_simdrv_perturb.cpp.
#include <catch2/catch.hpp>

#include <cstring>

#include "simdrv_loader.hpp"

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
