// Helpers shared by ebb's Catch2 suites.
#pragma once
#include <catch2/catch.hpp>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "ebb/status.h"

// REQUIRE an ebb call to succeed, printing the thread's last error when it does not.
#define EBB_REQUIRE_OK(expr)                                                    \
  do {                                                                          \
    ebb_status st_ = (expr);                                                    \
    INFO(#expr << " -> " << ebb_status_name(st_) << ": " << ebb_last_error()); \
    REQUIRE(st_ == EBB_OK);                                                     \
  } while (0)

// CHECK that a call fails with `code` and that its message holds every needle.
#define EBB_CHECK_MSG(expr, code, ...)                                    \
  do {                                                                    \
    ebb_clear_error();                                                    \
    ebb_status st_ = (expr);                                              \
    std::string msg_ = ebb_last_error();                                  \
    INFO(#expr << " -> " << ebb_status_name(st_) << ": " << msg_);        \
    CHECK(st_ == (code));                                                 \
    for (const std::string &needle_ : std::initializer_list<std::string>{__VA_ARGS__}) { \
      INFO("expected in the message: " << needle_);                       \
      CHECK(msg_.find(needle_) != std::string::npos);                     \
    }                                                                     \
  } while (0)

// CHECK that a call fails with `code` and that its message mentions `needle`.
#define EBB_CHECK_FAILS(expr, code, needle) EBB_CHECK_MSG(expr, code, needle)

// Sets an environment variable for the scope, restoring the previous value after.
struct ScopedEnv {
  std::string name, old;
  bool had;
  ScopedEnv(const char *n, const char *v) : name(n) {
    const char *o = std::getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (v) setenv(n, v, 1);
    else unsetenv(n);
  }
  ~ScopedEnv() {
    if (had) setenv(name.c_str(), old.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

// ebb_init for the scope of a test; checks that nothing the test created is still alive.
// Collects warnings (from any thread) for the scope; the default handler comes back after.
struct Warnings {
  std::mutex mu;
  std::vector<std::string> msgs;
  static void sink(const char *m, void *user) {
    auto *w = static_cast<Warnings *>(user);
    std::lock_guard<std::mutex> l(w->mu);
    w->msgs.emplace_back(m);
  }
  Warnings() { ebb_set_warning_handler(sink, this); }
  ~Warnings() { ebb_set_warning_handler(ebb_warning_to_stderr, nullptr); }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> l(mu);
    return msgs;
  }
  size_t count() {
    std::lock_guard<std::mutex> l(mu);
    return msgs.size();
  }
};

struct EbbSession {
  EbbSession() { EBB_REQUIRE_OK(ebb_init()); }
  // The last shutdown refuses (EBB_EBUSY) while a handle is live: a test that leaks fails here.
  ~EbbSession() {
    ebb_status st = ebb_shutdown();
    INFO("ebb_shutdown: " << ebb_last_error());
    CHECK(st == EBB_OK);
  }
};

// Catch2 v2 has no SKIP: say why in the output and leave the test case.
#define EBB_SKIP(why)            \
  do {                           \
    WARN("skipped: " << (why));  \
    return;                      \
  } while (0)

// How many devices the driver offers (after ebb_init).
inline int ebb_test_device_count() {
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  return n;
}

// Whether the driver ebb loaded is the emulated one (after ebb_init). The suite's environment
// gives it two devices (EBB_SIM_DEVICES=2, tests/CMakeLists.txt); a real machine may have one.
inline bool ebb_test_emulated() {
  ebb_dev_caps c;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &c));
  return c.emulated != 0;
}

// Whether `n` devices exist for a test about several of them. On the emulated driver they must
// (a shortfall fails the test: the suite asks for two); on a real driver with fewer, the test
// says so in its output (a Catch2 WARN) and the caller leaves or leaves that part out.
inline bool ebb_test_have_devices(int n, const char *what) {
  int have = ebb_test_device_count();
  if (have >= n) return true;
  if (ebb_test_emulated()) {
    INFO(what << " needs " << n << " devices; the emulated driver has " << have << " (EBB_SIM_DEVICES)");
    REQUIRE(have >= n);
  }
  WARN("skipped: " << what << " needs " << n << " devices; this driver has " << have);
  return false;
}

// Leaves the test case, loudly, when fewer than `n` devices exist on a real driver.
#define EBB_NEED_DEVICES(n)                                                      \
  do {                                                                           \
    if (!ebb_test_have_devices((n), Catch::getResultCapture().getCurrentTestName().c_str())) return; \
  } while (0)

// The devices of `wanted` that exist (EBB_DEVICE_CPU always does). A device the real driver
// lacks is left out with a WARN naming it; on the emulated driver every one must exist.
inline std::vector<int> ebb_test_existing(std::initializer_list<int> wanted) {
  std::vector<int> out;
  int have = ebb_test_device_count();
  for (int d : wanted) {
    if (d < have) {
      out.push_back(d);
      continue;
    }
    std::string what = "device " + std::to_string(d) + "'s part of this test";
    (void)ebb_test_have_devices(d + 1, what.c_str());
  }
  return out;
}

// The offset of the first byte of `s` that is not part of well-formed UTF-8 (by code point
// value: no overlong form, no surrogate, nothing past U+10FFFF), or npos when all of it is.
// Files that must load in strict readers (Python's json) are held against it.
inline size_t ebb_first_bad_utf8(const std::string &s) {
  for (size_t i = 0; i < s.size();) {
    unsigned c = (unsigned char)s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    if (!len || i + len > s.size()) return i;
    unsigned cp = c & (0x7F >> len);
    for (size_t k = 1; k < len; k++) {
      unsigned d = (unsigned char)s[i + k];
      if ((d & 0xC0) != 0x80) return i;
      cp = cp << 6 | (d & 0x3F);
    }
    unsigned min = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}
