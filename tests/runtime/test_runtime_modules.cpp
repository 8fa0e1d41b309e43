// The runtime's module registry, with modules made up by this test: this executable provides
// its own ebb__module_table (runtime_export.h) instead of the generated one, listing two modules
// out of layer order, so what the runtime does with them is observable.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "ebb/status.h"
#include "ebb_test_util.hpp"
#include "runtime_export.h"

namespace {

std::vector<std::string> g_log;  // "start:low", "stop:high", ...
long g_live_high = 0;
bool g_fail_high_start = false;
std::string g_high_var;  // what the check of EBB_TEST_HIGH saw

bool check_high(const char *v, char *expected, size_t len) {
  g_high_var = v ? v : "(unset)";
  if (!v || !std::strcmp(v, "on") || !std::strcmp(v, "off")) return true;
  std::snprintf(expected, len, "on or off");
  return false;
}

ebb_status start_low() {
  g_log.push_back("start:low");
  // Started after the runtime is up: a start may call the runtime's public functions.
  int n = 0;
  return ebb_dev_count(&n);
}
void stop_low() { g_log.push_back("stop:low"); }
ebb_status start_high() {
  g_log.push_back("start:high");
  return g_fail_high_start ? EBB_ENOMEM : EBB_OK;
}
void stop_high() { g_log.push_back("stop:high"); }
int count_high(ebb__live_count *out, int max) {
  if (max < 2) return 0;
  out[0] = {"widgets", g_live_high};
  out[1] = {"gadgets", 0};
  return 2;
}

const ebb__config_var high_vars[] = {{"EBB_TEST_HIGH", check_high}};

const ebb__module_desc mod_low = {"low", EBB__LAYER_STREAMS, nullptr, 0, start_low, stop_low, nullptr};
const ebb__module_desc mod_high = {"high", EBB__LAYER_OPS, high_vars, 1, start_high, stop_high, count_high};

void reset() {
  g_log.clear();
  g_live_high = 0;
  g_fail_high_start = false;
  g_high_var.clear();
}

}  // namespace

// Listed highest layer first on purpose: order comes from the layers, not from the table.
extern "C" const ebb__module_desc *const ebb__module_table[] = {&mod_high, &mod_low, nullptr};

TEST_CASE("modules start in layer order and stop in reverse layer order", "[runtime][modules]") {
  reset();
  EBB_REQUIRE_OK(ebb_init());
  CHECK(g_log == std::vector<std::string>{"start:low", "start:high"});
  EBB_REQUIRE_OK(ebb_init());  // reference-counted: nothing starts again
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK(g_log.size() == 2);
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK(g_log == std::vector<std::string>{"start:low", "start:high", "stop:high", "stop:low"});
}

TEST_CASE("the last shutdown refuses with EBB_EBUSY while a module counts live objects", "[runtime][modules]") {
  reset();
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_init());
  g_live_high = 3;
  // Not the last reference: no check, no teardown.
  EBB_REQUIRE_OK(ebb_shutdown());
  EBB_CHECK_FAILS(ebb_shutdown(), EBB_EBUSY, "3 objects are still live (widgets: 3)");
  CHECK(std::string(ebb_last_error()).find("gadgets") == std::string::npos);  // kinds with none are not listed
  CHECK(ebb_is_initialized());
  CHECK(g_log.size() == 2);  // nothing stopped
  g_live_high = 0;
  EBB_REQUIRE_OK(ebb_shutdown());
  CHECK_FALSE(ebb_is_initialized());
  CHECK(g_log.back() == "stop:low");
}

TEST_CASE("a module's variable is checked at init - one policy for bad values", "[runtime][modules][config]") {
  reset();
  {
    ScopedEnv env("EBB_TEST_HIGH", "maybe");
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, "ebb_init: EBB_TEST_HIGH='maybe' is not valid; expected on or off");
    CHECK_FALSE(ebb_is_initialized());
    CHECK(g_log.empty());  // checked before anything starts
  }
  {
    ScopedEnv env("EBB_TEST_HIGH", "on");
    EBB_REQUIRE_OK(ebb_init());
    CHECK(g_high_var == "on");
    EBB_REQUIRE_OK(ebb_shutdown());
  }
  {
    ScopedEnv env("EBB_TEST_HIGH", "");  // empty reads as unset
    EBB_REQUIRE_OK(ebb_init());
    CHECK(g_high_var == "(unset)");
    EBB_REQUIRE_OK(ebb_shutdown());
  }
}

TEST_CASE("a module that fails to start fails ebb_init and the started ones are stopped", "[runtime][modules]") {
  reset();
  g_fail_high_start = true;
  EBB_CHECK_FAILS(ebb_init(), EBB_ENOMEM, "ebb_init: the high module did not start");
  CHECK_FALSE(ebb_is_initialized());
  CHECK(g_log == std::vector<std::string>{"start:low", "start:high", "stop:high", "stop:low"});
  reset();
  EBB_REQUIRE_OK(ebb_init());
  EBB_REQUIRE_OK(ebb_shutdown());
}

TEST_CASE("the runtime's own variables follow the same policy", "[runtime][modules][config]") {
  reset();
  struct Bad {
    const char *name, *value, *needle;
  } bad[] = {
    {"EBB_TRACE", "lots", "EBB_TRACE='lots' is not valid; expected 0 (off) or the number of spans to keep"},
    {"EBB_TRACE", "-5", "EBB_TRACE='-5'"},
    {"EBB_TRACE_FILE", "/nonexistent-dir-of-ebb/trace.json", "EBB_TRACE_FILE='/nonexistent-dir-of-ebb/trace.json' is not valid"},
    {"EBB_CHECK_LAUNCH", "yes", "EBB_CHECK_LAUNCH='yes' is not valid; expected 0 or 1"},
    {"EBB_LOG", "verbose", "EBB_LOG='verbose' is not valid; expected warn"},
    {"EBB_DRIVER", "gpu", "EBB_DRIVER='gpu' is not valid; expected auto, cuda, sim or a path"},
  };
  for (const Bad &b : bad) {
    ScopedEnv env(b.name, b.value);
    INFO(b.name << "=" << b.value);
    EBB_CHECK_FAILS(ebb_init(), EBB_EINVAL, b.needle);
    CHECK_FALSE(ebb_is_initialized());
  }
  CHECK(g_log.empty());
}

TEST_CASE("warnings go to the replaceable handler - a successful init leaves the last error alone", "[runtime][modules][warn]") {
  reset();
  std::vector<std::string> got;
  ebb_set_warning_handler([](const char *m, void *u) { static_cast<std::vector<std::string> *>(u)->push_back(m); }, &got);
  int hook_calls = 0;
  ebb_set_error_hook([](ebb_status, const char *, void *u) { ++*static_cast<int *>(u); }, &hook_calls);
  {
    ScopedEnv log("EBB_LOG", "info");
    ebb_clear_error();
    EBB_REQUIRE_OK(ebb_init());
    CHECK(std::string(ebb_last_error()).empty());
    CHECK(hook_calls == 0);
    REQUIRE(got.size() == 1);
    CHECK(got[0].find("driver ") == 0);
    EBB_REQUIRE_OK(ebb_shutdown());
  }
  {
    // Silenced: nothing reaches any handler (and nothing is written to stderr).
    ebb_set_warning_handler(nullptr, nullptr);
    ScopedEnv log("EBB_LOG", "info");
    EBB_REQUIRE_OK(ebb_init());
    EBB_REQUIRE_OK(ebb_shutdown());
    CHECK(got.size() == 1);
  }
  ebb_set_error_hook(nullptr, nullptr);
  ebb_set_warning_handler(ebb_warning_to_stderr, nullptr);
}
