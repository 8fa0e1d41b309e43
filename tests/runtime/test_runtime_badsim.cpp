// test_runtime_badsim.cpp: a bad EBB_SIM_* setting (this executable runs with EBB_SIM_MEM=12Q):
// ebb_init fails with a message naming the variable and its value, and nothing is printed (the
// emulated driver reports through ebbsim_init_error, never stderr). Its own executable: the
// driver reads its settings once per process.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include "ebb/runtime.h"
#include "ebb/status.h"
#include "ebb_test_util.hpp"

static void check_bad_setting(const char *driver) {
  ScopedEnv e("EBB_DRIVER", driver);
  // Capture fd 2 for the call: the library and its driver must write nothing there.
  std::fflush(stderr);
  FILE *cap = std::tmpfile();
  REQUIRE(cap != nullptr);
  int saved = dup(2);
  REQUIRE(saved >= 0);
  REQUIRE(dup2(fileno(cap), 2) == 2);
  ebb_clear_error();
  ebb_status st = ebb_init();
  std::string msg = ebb_last_error();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  long printed = std::ftell(cap) >= 0 ? (std::fseek(cap, 0, SEEK_END), std::ftell(cap)) : -1;
  std::fclose(cap);
  INFO("ebb_init -> " << ebb_status_name(st) << ": " << msg);
  CHECK(st == EBB_EINVAL);  // a bad configuration value, as for every EBB_* variable
  CHECK(msg.find("EBB_SIM_MEM='12Q'") != std::string::npos);
  CHECK(msg.find("CUDA_ERROR_INVALID_VALUE") != std::string::npos);
  CHECK(printed == 0);
  CHECK_FALSE(ebb_is_initialized());
}

TEST_CASE("a bad emulated-driver setting fails ebb_init by name, silently", "[runtime][driver][env]") {
  SECTION("EBB_DRIVER=sim") { check_bad_setting("sim"); }
  SECTION("EBB_DRIVER=<path of the emulated driver>") {
    const char *path = std::getenv("EBB_SIMDRV_PATH");
    REQUIRE(path != nullptr);
    check_bad_setting(path);
  }
  SECTION("EBB_DRIVER=auto, no GPU") {
    if (access("/dev/nvidia0", F_OK) == 0) EBB_SKIP("a GPU answers here: auto would not try the emulated driver");
    check_bad_setting("auto");
  }
}
