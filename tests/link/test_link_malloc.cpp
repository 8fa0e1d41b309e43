// test_link_malloc.cpp: a program that links libebb.so keeps its own malloc.
//
// libebb must never bring an allocator with it (README, "Dependencies"): Debian's
// jemalloc exports unprefixed malloc/free, so a library depending on it would silently replace
// its host's allocator. This program links libebb and nothing else of ours, and asks the dynamic
// linker which object provides `malloc`, before and after a full ebb_init/ebb_shutdown cycle.
// Sanitizer builds intercept malloc in libasan/libtsan; there only "not libebb, not jemalloc" is
// checked.
#include <dlfcn.h>  // g++ defines _GNU_SOURCE: dladdr, RTLD_DEFAULT, RTLD_NOLOAD

#include <cstdlib>
#include <cstring>
#include <string>

#include <catch2/catch.hpp>

#include "ebb/runtime.h"
#include "ebb_test_util.hpp"

namespace {

// The file name (no directory) of the object defining the symbol at `addr`, "" when unknown.
std::string provider_of(void *addr) {
  Dl_info di;
  if (addr == nullptr || dladdr(addr, &di) == 0 || di.dli_fname == nullptr) return "";
  const char *slash = std::strrchr(di.dli_fname, '/');
  return slash ? slash + 1 : di.dli_fname;
}

void check_malloc_provider(const std::string &who, const char *where) {
  INFO(where << ": malloc comes from '" << who << "'");
  CHECK(who.find("libebb") == std::string::npos);
  CHECK(who.find("jemalloc") == std::string::npos);
#if !defined(EBB_TEST_SANITIZED)
  CHECK(who == "libc.so.6");
#endif
}

}  // namespace

TEST_CASE("a program linking libebb keeps libc's malloc", "[link]") {
  check_malloc_provider(provider_of(dlsym(RTLD_DEFAULT, "malloc")), "before ebb_init");

  EBB_REQUIRE_OK(ebb_init());
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  CHECK(n >= 1);
  EBB_REQUIRE_OK(ebb_shutdown());

  check_malloc_provider(provider_of(dlsym(RTLD_DEFAULT, "malloc")), "after ebb_shutdown");
  // What the process actually calls: the address of malloc as this program binds it.
  void *(*volatile self_malloc)(size_t) = &std::malloc;
  check_malloc_provider(provider_of(reinterpret_cast<void *>(self_malloc)), "program's binding");
}

TEST_CASE("libebb's own lookup scope defines no malloc and loads no jemalloc", "[link]") {
  // RTLD_NOLOAD: a handle to the libebb this program already has, found by its soname.
  void *self = dlopen(EBB_TEST_SONAME, RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(self != nullptr);
  // dlsym through libebb's handle searches libebb and then its dependencies, in load order:
  // the first malloc there is the one libebb's own references would see in isolation.
  check_malloc_provider(provider_of(dlsym(self, "malloc")), "libebb's scope");
  dlclose(self);

  CHECK(dlopen("libjemalloc.so.2", RTLD_NOW | RTLD_NOLOAD) == nullptr);
}
