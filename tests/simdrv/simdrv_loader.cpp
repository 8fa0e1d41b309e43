// simdrv_loader.cpp: see simdrv_loader.hpp.
#include "simdrv_loader.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

CUcontext g_ctx[16];

namespace {

void *must_sym(void *h, const char *name) {
  void *p = dlsym(h, name);
  INFO("dlsym(" << name << "): " << (p ? "ok" : dlerror()));
  REQUIRE(p != nullptr);
  return p;
}

SimDrv load() {
  const char *path = std::getenv("EBB_SIMDRV_PATH");
  INFO("EBB_SIMDRV_PATH must name the built libebb_simdrv.so");
  REQUIRE(path != nullptr);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  INFO("dlopen: " << (h ? "ok" : dlerror()));
  REQUIRE(h != nullptr);
  SimDrv d{};
#define SIMDRV_LOAD(field, symbol, required) \
  d.field = reinterpret_cast<decltype(d.field)>(must_sym(h, symbol));
  EBB_DRV_ENTRIES(SIMDRV_LOAD)
#undef SIMDRV_LOAD
  d.MemcpyHtoDAsync = reinterpret_cast<decltype(d.MemcpyHtoDAsync)>(must_sym(h, "cuMemcpyHtoDAsync_v2"));
  d.MemcpyDtoHAsync = reinterpret_cast<decltype(d.MemcpyDtoHAsync)>(must_sym(h, "cuMemcpyDtoHAsync_v2"));
  d.MemcpyDtoDAsync = reinterpret_cast<decltype(d.MemcpyDtoDAsync)>(must_sym(h, "cuMemcpyDtoDAsync_v2"));
  d.CtxGetDevice = reinterpret_cast<decltype(d.CtxGetDevice)>(must_sym(h, "cuCtxGetDevice"));
  d.CtxDisablePeerAccess = reinterpret_cast<decltype(d.CtxDisablePeerAccess)>(must_sym(h, "cuCtxDisablePeerAccess"));
  d.DevicePrimaryCtxReset =
      reinterpret_cast<decltype(d.DevicePrimaryCtxReset)>(must_sym(h, "cuDevicePrimaryCtxReset_v2"));
  d.StreamGetPriority = reinterpret_cast<decltype(d.StreamGetPriority)>(must_sym(h, "cuStreamGetPriority"));
  d.RegisterKernel = reinterpret_cast<ebbsim_register_kernel_fn>(must_sym(h, EBBSIM_REGISTER_KERNEL_SYMBOL));
  d.InitError = reinterpret_cast<ebbsim_init_error_fn>(must_sym(h, EBBSIM_INIT_ERROR_SYMBOL));
  d.SkipWaits = reinterpret_cast<ebbsim_skip_waits_fn>(must_sym(h, EBBSIM_SKIP_WAITS_SYMBOL));
  return d;
}

void k_append(void *p) {
  auto *a = static_cast<AppendArgs *>(p);
  int n = a->buf[0];
  a->buf[1 + n] = a->value;
  a->buf[0] = n + 1;
}
void k_fill(void *p) {
  auto *a = static_cast<FillArgs *>(p);
  std::memset(a->p, a->value, a->n);
}
void k_peek(void *p) {
  auto *a = static_cast<PeekArgs *>(p);
  *a->out = *a->in;
}
void k_gate(void *p) {
  auto *a = static_cast<GateArgs *>(p);
  // The flag is a plain int the test thread sets with __atomic_store_n; the acquire load keeps
  // the spin race-free.
  while (__atomic_load_n(a->flag, __ATOMIC_ACQUIRE) == 0) {
  }
}
void k_big(void *p) {
  auto *a = static_cast<BigArgs *>(p);
  long s = 0;
  for (long w : a->words) s += w;
  *a->out = s;
}

}  // namespace

const SimDrv &drv() {
  static SimDrv d = load();
  return d;
}

std::string cu_name(CUresult r) {
  const char *s = nullptr;
  if (drv().GetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

int sim_setup() {
  const SimDrv &d = drv();
  CU_OK(d.Init(0));
  int n = 0;
  CU_OK(d.DeviceGetCount(&n));
  REQUIRE(n >= 1);
  for (int i = 0; i < n; i++) CU_OK(d.DevicePrimaryCtxRetain(&g_ctx[i], i));
  CU_OK(d.CtxSetCurrent(g_ctx[0]));
  CU_OK(d.RegisterKernel("append", k_append, sizeof(AppendArgs)));
  CU_OK(d.RegisterKernel("fill", k_fill, sizeof(FillArgs)));
  CU_OK(d.RegisterKernel("peek", k_peek, sizeof(PeekArgs)));
  CU_OK(d.RegisterKernel("gate", k_gate, sizeof(GateArgs)));
  CU_OK(d.RegisterKernel("big", k_big, sizeof(BigArgs)));
  return n;
}

CUfunction get_kernel(const char *name, CUmodule *mod_out) {
  static const char image[] = "simdrv ignores module images";
  CUmodule mod;
  CU_OK(drv().ModuleLoadData(&mod, image));
  CUfunction f;
  CU_OK(drv().ModuleGetFunction(&f, mod, name));
  if (mod_out) *mod_out = mod;
  return f;
}

CUresult launch(CUfunction f, CUstream s, void *args) {
  void *params[] = {args};
  return drv().LaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr);
}

CUstream make_stream(int prio) {
  CUstream s;
  CU_OK(drv().StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, prio));
  return s;
}

CUevent make_event(unsigned flags) {
  CUevent e;
  CU_OK(drv().EventCreate(&e, flags));
  return e;
}

int *dev_ints(size_t n) {
  CUdeviceptr p;
  CU_OK(drv().MemAlloc(&p, n * sizeof(int)));
  std::memset(reinterpret_cast<void *>(p), 0, n * sizeof(int));
  return reinterpret_cast<int *>(p);
}

void host_append(void *user) {
  auto *a = static_cast<AppendArgs *>(user);
  a->buf[1 + a->buf[0]] = a->value;
  a->buf[0]++;
}

void Gate::close_on(CUfunction gate, CUstream s) { CU_OK(launch(gate, s, &args)); }

int thread_count() {
  DIR *d = opendir("/proc/self/task");
  REQUIRE(d != nullptr);
  int n = 0;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

namespace {
// A cgroup limit file's value, or 0 when absent or unlimited ("max").
size_t cgroup_limit(const char *path) {
  FILE *f = std::fopen(path, "r");
  if (!f) return 0;
  unsigned long long v = 0;
  bool ok = std::fscanf(f, "%llu", &v) == 1;
  std::fclose(f);
  return ok ? static_cast<size_t>(v) : 0;
}
}  // namespace

size_t host_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  REQUIRE(pages > 0);
  REQUIRE(page > 0);
  size_t mem = static_cast<size_t>(pages) * static_cast<size_t>(page);
  // The process's own cgroup and its ancestors (v2 "0::/path", v1 "N:memory:/path").
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string ctrl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1), file;
    std::vector<std::string> mounts;
    if (ctrl.empty()) {
      mounts = {"/sys/fs/cgroup"};
      file = "memory.max";
    } else if (("," + ctrl + ",").find(",memory,") != std::string::npos) {
      mounts = {"/sys/fs/cgroup/" + ctrl};
      if (ctrl != "memory") mounts.push_back("/sys/fs/cgroup/memory");
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    if (path == "/") path.clear();
    for (const std::string &mount : mounts)
      for (std::string p = path;;) {
        size_t lim = cgroup_limit((mount + p + "/" + file).c_str());
        if (lim && lim < mem) mem = lim;
        size_t slash = p.rfind('/');
        if (slash == std::string::npos) break;
        p.resize(slash);
      }
  }
  return mem;
}

size_t sim_default_capacity(int ndev) {
  const size_t granule = size_t(2) << 20, cap = size_t(8) << 30;
  size_t share = host_memory_bytes() / 4 * 3 / static_cast<size_t>(ndev) / granule * granule;
  if (share < granule) share = granule;
  return share < cap ? share : cap;
}

size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

size_t resident_pages(const void *p, size_t n) {
  size_t pages = n / page();
  std::vector<unsigned char> v(pages);
  REQUIRE(mincore(const_cast<void *>(p), n, v.data()) == 0);
  size_t r = 0;
  for (unsigned char c : v) r += c & 1u;
  return r;
}

size_t mapped_pages(const void *p, size_t n) {
  int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  size_t pages = n / page();
  std::vector<uint64_t> v(pages);
  off_t at = static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / page() * sizeof(uint64_t));
  ssize_t got = pread(fd, v.data(), pages * sizeof(uint64_t), at);
  close(fd);
  REQUIRE(got == static_cast<ssize_t>(pages * sizeof(uint64_t)));
  size_t r = 0;
  for (uint64_t e : v) r += (e >> 63) & 1u;
  return r;
}
