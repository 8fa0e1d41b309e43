// Fault injection for tests: EBB_SIM_FAULT is read by the emulated driver once per process, at
// its cuInit, so a case that sets it needs a process of its own (ctest gives every case one).
#pragma once
#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>

// Sets EBB_SIM_FAULT for this process's cuInit, and EBB_DRIVER=sim: faults are injected by the
// emulated driver, so a case that asks for them runs on it whatever driver ctest was given
// (tools/gpu-check.sh runs the suite with EBB_DRIVER=cuda). False (with a warning) when another
// case already started the driver with another value in this process.
inline bool faults_for_this_process(const char *value) {
  static std::string first;
  if (!first.empty() && first != value) {
    WARN("skipped: the driver already started with EBB_SIM_FAULT=" << first << "; run this case alone (ctest does)");
    return false;
  }
  first = value;
  REQUIRE(setenv("EBB_SIM_FAULT", value, 1) == 0);
  REQUIRE(setenv("EBB_DRIVER", "sim", 1) == 0);
  return true;
}
