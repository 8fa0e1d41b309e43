// The kernel registry: declare, find, launch on driver streams, stream order, bad input.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "ebb/runtime.h"
#include "runtime_export.h"  // the driver seam (ebb__drv_*), internal
#include "ebb_test_util.hpp"

namespace {
struct AppendArgs {
  int *buf;   // device memory (host-addressable on the emulated driver)
  int *count; // next index
  int value;
};
void append_kernel(void *a) {
  auto *p = static_cast<AppendArgs *>(a);
  p->buf[(*p->count)++] = p->value;
}
struct FillArgs {
  float *dst;
  size_t n;
  float v;
};
void fill_kernel(void *a) {
  auto *p = static_cast<FillArgs *>(a);
  for (size_t i = 0; i < p->n; i++) p->dst[i] = p->v;
}
} // namespace

TEST_CASE("kernels: declare, redeclare, find, bad declarations", "[runtime][kernel]") {
  EbbSession s;
  const ebb_kernel_t *k = nullptr, *k2 = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("test.fill", sizeof(FillArgs), fill_kernel, "ebb_fill_f32", &k));
  CHECK(std::string(ebb_kernel_name(k)) == "test.fill");
  EBB_REQUIRE_OK(ebb_kernel_declare("test.fill", sizeof(FillArgs), fill_kernel, "ebb_fill_f32", &k2));
  CHECK(k == k2);
  EBB_CHECK_FAILS(ebb_kernel_declare("test.fill", sizeof(FillArgs) + 4, fill_kernel, "ebb_fill_f32", &k2), EBB_EINVAL,
                  "declared before");
  EBB_REQUIRE_OK(ebb_kernel_find("test.fill", &k2));
  CHECK(k == k2);
  EBB_CHECK_FAILS(ebb_kernel_find("test.nope", &k2), EBB_ENOTFOUND, "test.nope");
  EBB_CHECK_FAILS(ebb_kernel_declare(nullptr, 4, fill_kernel, nullptr, &k2), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_kernel_declare("", 4, fill_kernel, nullptr, &k2), EBB_EINVAL, "empty");
  EBB_CHECK_FAILS(ebb_kernel_declare("x", 0, fill_kernel, nullptr, &k2), EBB_EINVAL, "arg_bytes 0");
  EBB_CHECK_FAILS(ebb_kernel_declare("x", 1 << 20, fill_kernel, nullptr, &k2), EBB_EINVAL, "arg_bytes");
  EBB_CHECK_FAILS(ebb_kernel_declare("x", 4, nullptr, nullptr, &k2), EBB_EINVAL, "neither");
  EBB_CHECK_FAILS(ebb_kernel_declare("x", 4, fill_kernel, nullptr, nullptr), EBB_EINVAL, "NULL");
  CHECK(std::string(ebb_kernel_name(nullptr)) == "(invalid kernel)");
}

TEST_CASE("kernels run in stream order and arguments are copied at launch", "[runtime][kernel]") {
  EbbSession s;
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.cpu_kernels) EBB_SKIP("device 0 has no CPU kernels (a GPU): covered by the ops suites");
  const ebb_kernel_t *k = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("test.append", sizeof(AppendArgs), append_kernel, nullptr, &k));
  uint64_t dbuf = 0, dcount = 0;
  EBB_REQUIRE_OK(ebb__drv_mem_alloc(0, 1000 * sizeof(int), &dbuf));
  EBB_REQUIRE_OK(ebb__drv_mem_alloc(0, sizeof(int), &dcount));
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  EBB_REQUIRE_OK(ebb__drv_memset_async(0, (void *)dcount, 0, sizeof(int), st));
  AppendArgs a{(int *)dbuf, (int *)dcount, 0};
  for (int i = 0; i < 1000; i++) {
    a.value = i; // reused at once: the launch must have copied it
    EBB_REQUIRE_OK(ebb_kernel_launch(k, 0, st, &a, nullptr));
  }
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  int count = 0;
  std::vector<int> out(1000);
  std::memcpy(&count, (void *)dcount, sizeof count);
  std::memcpy(out.data(), (void *)dbuf, out.size() * sizeof(int));
  REQUIRE(count == 1000);
  for (int i = 0; i < 1000; i++) REQUIRE(out[i] == i);
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
  EBB_REQUIRE_OK(ebb__drv_mem_free(0, dbuf));
  EBB_REQUIRE_OK(ebb__drv_mem_free(0, dcount));
}

TEST_CASE("kernel launch: bad input", "[runtime][kernel]") {
  EbbSession s;
  const ebb_kernel_t *k = nullptr, *gpu_only = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("test.fill2", sizeof(FillArgs), fill_kernel, nullptr, &k));
  EBB_REQUIRE_OK(ebb_kernel_declare("test.gpu_only", sizeof(FillArgs), nullptr, "ebb_gpu_only", &gpu_only));
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  FillArgs a{nullptr, 0, 1.0f};
  EBB_CHECK_FAILS(ebb_kernel_launch(nullptr, 0, st, &a, nullptr), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_kernel_launch(k, 0, st, nullptr, nullptr), EBB_EINVAL, "test.fill2");
  EBB_CHECK_FAILS(ebb_kernel_launch(k, 0, nullptr, &a, nullptr), EBB_EINVAL, "stream is NULL");
  EBB_CHECK_FAILS(ebb_kernel_launch(k, 7, st, &a, nullptr), EBB_EDEVICE, "device 7");
  int junk = 0;
  EBB_CHECK_FAILS(ebb_kernel_launch((const ebb_kernel_t *)&junk, 0, st, &a, nullptr), EBB_EINVAL, "not a kernel");
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (caps.cpu_kernels) {
    EBB_CHECK_FAILS(ebb_kernel_launch(gpu_only, 0, st, &a, nullptr), EBB_ENOTSUP, "no CPU function");
  } else {
    EBB_CHECK_FAILS(ebb_kernel_launch(k, 0, st, &a, nullptr), EBB_ENOTSUP, "no CUDA function");
  }
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
}

TEST_CASE("kernel launch: declared buffers are checked with EBB_CHECK_LAUNCH=1", "[runtime][kernel]") {
  ScopedEnv check("EBB_CHECK_LAUNCH", "1");
  EbbSession s;
  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  if (!caps.cpu_kernels) EBB_SKIP("needs CPU kernels");
  const ebb_kernel_t *k = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare("test.fill3", sizeof(FillArgs), fill_kernel, nullptr, &k));
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  uint64_t d = 0;
  EBB_REQUIRE_OK(ebb__drv_mem_alloc(0, 64 * sizeof(float), &d));
  FillArgs a{(float *)d, 64, 2.0f};
  ebb_buf w{(void *)d, 64 * sizeof(float)};
  ebb_launch_cfg cfg{};
  cfg.writes = &w;
  cfg.nwrites = 1;
  EBB_REQUIRE_OK(ebb_kernel_launch(k, 0, st, &a, &cfg));
  std::vector<float> host(64);
  ebb_buf bad{host.data(), host.size() * sizeof(float)};
  cfg.writes = &bad;
  EBB_CHECK_FAILS(ebb_kernel_launch(k, 0, st, &a, &cfg), EBB_EDEVICE, "pageable");
  cfg.writes = nullptr;
  EBB_CHECK_FAILS(ebb_kernel_launch(k, 0, st, &a, &cfg), EBB_EINVAL, "NULL");
  EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
  CHECK(((float *)d)[63] == 2.0f);
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
  EBB_REQUIRE_OK(ebb__drv_mem_free(0, d));
}

TEST_CASE("built-in kernels exist on every driver and run", "[runtime][kernel]") {
  EbbSession s;
  const ebb_kernel_t *noop = nullptr, *fill = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_find("ebb.noop", &noop));
  EBB_REQUIRE_OK(ebb_kernel_find("ebb.fill_u32", &fill));
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  for (int d = 0; d < n; d++) {
    CUstream_st *st = nullptr;
    EBB_REQUIRE_OK(ebb__drv_stream_create(d, 0, &st));
    const uint64_t count = 4096;
    uint64_t dbuf = 0;
    EBB_REQUIRE_OK(ebb__drv_mem_alloc(d, count * sizeof(uint32_t), &dbuf));
    ebb_noop_args na{0};
    EBB_REQUIRE_OK(ebb_kernel_launch(noop, d, st, &na, nullptr));
    ebb_fill_u32_args fa{(uint32_t *)dbuf, count, 0xabcd0000u + (uint32_t)d};
    ebb_launch_cfg cfg{};
    cfg.grid[0] = 16;
    cfg.block[0] = 256;
    EBB_REQUIRE_OK(ebb_kernel_launch(fill, d, st, &fa, &cfg));
    std::vector<uint32_t> host(count);
    void *pinned = nullptr;
    EBB_REQUIRE_OK(ebb__drv_pinned_alloc(d, count * sizeof(uint32_t), &pinned));
    EBB_REQUIRE_OK(ebb__drv_memcpy_async(d, pinned, (void *)dbuf, count * sizeof(uint32_t), st));
    EBB_REQUIRE_OK(ebb__drv_stream_synchronize(d, st));
    std::memcpy(host.data(), pinned, count * sizeof(uint32_t));
    for (uint64_t i = 0; i < count; i++) REQUIRE(host[i] == 0xabcd0000u + (uint32_t)d);
    EBB_REQUIRE_OK(ebb__drv_pinned_free(d, pinned));
    EBB_REQUIRE_OK(ebb__drv_mem_free(d, dbuf));
    EBB_REQUIRE_OK(ebb__drv_stream_destroy(d, st));
  }
}

TEST_CASE("kernel images: each module adds its own, kernels are declared against one", "[runtime][kernel][image]") {
  EbbSession s;
  static const char image_a[] = "module image A";  // content unread on the emulated driver
  static const char image_b[] = "module image B";
  const ebb_kernel_image_t *a = nullptr, *a2 = nullptr, *b = nullptr, *none = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.a", image_a, &a));
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.a", image_a, &a2));
  CHECK(a == a2);
  CHECK(std::string(ebb_kernel_image_name(a)) == "test.a");
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.b", image_b, &b));
  CHECK(a != b);
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.none", nullptr, &none));  // a module with no GPU code
  EBB_CHECK_FAILS(ebb_kernel_add_image("test.a", image_b, &a2), EBB_EINVAL, "'test.a' was added before with other contents");
  EBB_CHECK_FAILS(ebb_kernel_add_image("ebb.runtime", image_b, &a2), EBB_EINVAL, "'ebb.runtime'");
  EBB_CHECK_FAILS(ebb_kernel_add_image(nullptr, image_a, &a2), EBB_EINVAL, "NULL");
  EBB_CHECK_FAILS(ebb_kernel_add_image("", image_a, &a2), EBB_EINVAL, "empty");
  EBB_CHECK_FAILS(ebb_kernel_add_image("test.c", image_a, nullptr), EBB_EINVAL, "out is NULL");
  CHECK(std::string(ebb_kernel_image_name(nullptr)) == "(invalid image)");

  const ebb_kernel_t *ka = nullptr, *kb = nullptr, *k2 = nullptr, *gpu_only = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare_in(a, "test.img.fill_a", sizeof(FillArgs), fill_kernel, "fill_a", &ka));
  EBB_REQUIRE_OK(ebb_kernel_declare_in(b, "test.img.fill_b", sizeof(FillArgs), fill_kernel, "fill_b", &kb));
  EBB_REQUIRE_OK(ebb_kernel_declare_in(a, "test.img.fill_a", sizeof(FillArgs), fill_kernel, "fill_a", &k2));
  CHECK(k2 == ka);
  // Kernel names are one name space: the same name in another image is another kernel.
  EBB_CHECK_FAILS(ebb_kernel_declare_in(b, "test.img.fill_a", sizeof(FillArgs), fill_kernel, "fill_a", &k2), EBB_EINVAL,
                  "image 'test.a', now 'test.b'");
  int junk = 0;
  EBB_CHECK_FAILS(ebb_kernel_declare_in((const ebb_kernel_image_t *)&junk, "test.img.x", 4, fill_kernel, nullptr, &k2), EBB_EINVAL,
                  "not an image");
  EBB_REQUIRE_OK(ebb_kernel_declare_in(none, "test.img.gpu_only", sizeof(FillArgs), nullptr, "gpu_only", &gpu_only));

  ebb_dev_caps caps;
  EBB_REQUIRE_OK(ebb_dev_get_caps(0, &caps));
  CUstream_st *st = nullptr;
  EBB_REQUIRE_OK(ebb__drv_stream_create(0, 0, &st));
  if (caps.cpu_kernels) {
    // Both images loaded on device 0 (one driver module each); both kernels run.
    uint64_t d = 0;
    EBB_REQUIRE_OK(ebb__drv_mem_alloc(0, 8 * sizeof(float), &d));
    FillArgs fa{(float *)d, 4, 1.0f}, fb{(float *)d + 4, 4, 2.0f};
    EBB_REQUIRE_OK(ebb_kernel_launch(ka, 0, st, &fa, nullptr));
    EBB_REQUIRE_OK(ebb_kernel_launch(kb, 0, st, &fb, nullptr));
    EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
    std::vector<float> host(8);
    EBB_REQUIRE_OK(ebb__drv_memcpy_async(0, host.data(), (void *)d, 8 * sizeof(float), st));
    EBB_REQUIRE_OK(ebb__drv_stream_synchronize(0, st));
    CHECK(host == std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2});
    EBB_REQUIRE_OK(ebb__drv_mem_free(0, d));
  } else {
    FillArgs f{nullptr, 0, 0.0f};
    EBB_CHECK_FAILS(ebb_kernel_launch(gpu_only, 0, st, &f, nullptr), EBB_ENOTSUP, "its image 'test.none' has no CUDA code");
  }
  EBB_REQUIRE_OK(ebb__drv_stream_destroy(0, st));
}

TEST_CASE("kernel images are forgotten at the last shutdown and added again after init", "[runtime][kernel][image]") {
  static const char image_a[] = "module image A";
  const ebb_kernel_image_t *a = nullptr, *a2 = nullptr;
  {
    EbbSession s;
    EBB_REQUIRE_OK(ebb_kernel_add_image("test.a", image_a, &a));
  }
  EbbSession s;
  const ebb_kernel_t *k = nullptr;
  EBB_CHECK_FAILS(ebb_kernel_declare_in(a, "test.stale", sizeof(FillArgs), fill_kernel, nullptr, &k), EBB_EINVAL, "not an image");
  static const char image_b[] = "another build of module A";
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.a", image_b, &a2));
  // A new image does not take the stale handle's entry: the old handle is still refused, and a
  // kernel declared before the shutdown is not the one declared after it.
  CHECK(a2 != a);
  EBB_CHECK_FAILS(ebb_kernel_declare_in(a, "test.stale", sizeof(FillArgs), fill_kernel, nullptr, &k), EBB_EINVAL, "not an image");
  const ebb_kernel_t *k1 = nullptr, *k2 = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_declare_in(a2, "test.k", sizeof(FillArgs), fill_kernel, nullptr, &k1));
  EBB_REQUIRE_OK(ebb_shutdown());
  EBB_REQUIRE_OK(ebb_init());
  const ebb_kernel_image_t *a3 = nullptr;
  EBB_REQUIRE_OK(ebb_kernel_add_image("test.a", image_b, &a3));
  EBB_REQUIRE_OK(ebb_kernel_declare_in(a3, "test.k", sizeof(FillArgs), fill_kernel, nullptr, &k2));
  CHECK(a3 != a2);
  CHECK(k2 != k1);
  CHECK(std::string(ebb_kernel_name(k1)) == "(invalid kernel)");
}
