// A driver without VMM (the emulated driver with EBB_SIM_VMM=0): the device arenas use classic
// segments. test_alloc_novmm_asked runs with EBB_ALLOC_CONF=expandable_segments:1: ebb_init warns
// once per device that the setting cannot be honoured there, and allocations still succeed
// (they failed with an out-of-memory report that hid the cause). test_alloc_novmm runs with
// EBB_ALLOC_CONF unset: classic segments, no warning.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "alloc_test_util.hpp"

using namespace alloc_test;

namespace {

bool asked_expandable() {
  const char *c = std::getenv("EBB_ALLOC_CONF");
  return c && std::strstr(c, "expandable_segments:1");
}

}  // namespace

TEST_CASE("a driver without VMM: classic segments on every device, and a warning when expandable segments were asked for",
          "[alloc][expandable][novmm]") {
  Warnings w;
  EbbSession session;
  int ndev = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&ndev));
  ebb_dev_caps caps{};
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (caps.vmm) EBB_SKIP("the driver has VMM (this executable needs the emulated driver with EBB_SIM_VMM=0)");
  std::vector<std::string> got = w.take();
  if (asked_expandable()) {
    REQUIRE(got.size() == (size_t)ndev);
    for (int d = 0; d < ndev; d++) {
      INFO("warning " << d << ": " << got[(size_t)d]);
      CHECK(got[(size_t)d].find("expandable_segments:1") != std::string::npos);
      CHECK(got[(size_t)d].find("no VMM") != std::string::npos);
      CHECK(got[(size_t)d].find("device " + std::to_string(d) + "'s driver") != std::string::npos);
      CHECK(got[(size_t)d].find("classic segments") != std::string::npos);
    }
  } else {
    CHECK(got.empty());
  }
  for (int d = 0; d < ndev; d++) {
    INFO("device " << d);
    ebb_stream_t *s = default_stream(d);
    void *a = nullptr, *b = nullptr;
    ebb_clear_error();
    EBB_REQUIRE_OK(ebb_arena_alloc(d, 5 * MiB, s, &a));  // a large segment: 20 MiB, not 6 MiB of granules
    CHECK(stats(d).reserved_bytes.current == 20 * MiB);
    EBB_REQUIRE_OK(ebb_arena_alloc(d, 4096, s, &b));  // a small segment of its own: 2 MiB
    CHECK(stats(d).reserved_bytes.current == 22 * MiB);
    CHECK(stats(d).segments.current == 2);
    CHECK(std::string(ebb_last_error()).empty());
    EBB_REQUIRE_OK(ebb_arena_free(a));
    EBB_REQUIRE_OK(ebb_arena_free(b));
    EBB_REQUIRE_OK(ebb_arena_empty_cache(d));
    CHECK(stats(d).reserved_bytes.current == 0);
  }
}
