// The reducer in a world of one rank (MPI's singleton: no launcher), on the CPU and on an
// emulated device: the reduced gradient of one rank is its own, buckets follow the caps (a
// parameter larger than the cap alone in its bucket), and the refusals of ebb/ddp.h (NULLs, a
// bucket cap below 0, a parameter on another device than the group's, one that is not a leaf
// requiring a gradient, a destroyed reducer), each naming what was wrong.
#include <string>
#include <vector>

#include "ebb/autograd.h"
#include "ebb/ddp.h"
#include "ebb/dist.h"
#include "ebb/trace.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

struct Group {
  ebb_pg_t *pg = nullptr;
  ~Group() {
    if (pg) CHECK(ebb_pg_destroy(pg) == EBB_OK);
  }
};

ebb_tensor_t *param(int dev, std::vector<int64_t> shape, double v) {
  ebb_tensor_t *t = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_full(dev, EBB_F32, (int)shape.size(), shape.data(), v, &t));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

}  // namespace

TEST_CASE("reducer, bad input that needs no group: NULL group, handle or output, no parameters", "[ddp]") {
  // Runs in a build without MPI too: nothing here creates a group.
  EbbSession session;
  ebb_tensor_t *p = param(EBB_DEVICE_CPU, {4}, 1);
  ebb_reducer_t *r = nullptr;
  CHECK(ebb_reducer_create(nullptr, &p, 1, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("pg is NULL"));
  CHECK(r == nullptr);
  CHECK(ebb_reducer_create(nullptr, &p, 1, nullptr, nullptr) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("out is NULL"));
  CHECK(ebb_reducer_finish(nullptr) == EBB_EINVAL);
  CHECK(ebb_reducer_zero_grad(nullptr) == EBB_EINVAL);
  CHECK(ebb_reducer_set_sync(nullptr, false) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("ebb_reducer_set_sync"));
  CHECK(ebb_reducer_destroy(nullptr) == EBB_EINVAL);
  int nb = 0;
  CHECK(ebb_reducer_num_buckets(nullptr, &nb) == EBB_EINVAL);
  CHECK(ebb_reducer_bucket_info(nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0) == EBB_EINVAL);
  ebb_tensor_release(p);
}

#if EBB_TEST_HAVE_MPI
TEST_CASE("reducer, world of one: .grad after finish is the rank's own gradient, and buckets follow the caps", "[ddp][world1]") {
  EbbSession session;
  std::vector<int> devs = {EBB_DEVICE_CPU};
  int n = 0;
  if (ebb_dev_count(&n) == EBB_OK && n > 0) devs.push_back(0);
  for (int dev : devs) {
    INFO(dev_name(dev));
    Group g;
    EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, dev, nullptr, &g.pg));
    // 3 parameters: 16 floats (64 B), 100 floats (400 B: larger than the cap), 8 floats (32 B).
    ebb_tensor_t *p[3] = {param(dev, {16}, 1), param(dev, {10, 10}, 2), param(dev, {8}, 3)};
    ebb_reducer_options o = {};
    o.first_bucket_bytes = 40;
    o.bucket_bytes = 100;
    o.no_rebuild = true;
    ebb_reducer_t *r = nullptr;
    EBB_REQUIRE_OK(ebb_reducer_create(g.pg, p, 3, &o, &r));
    int nb = 0;
    EBB_REQUIRE_OK(ebb_reducer_num_buckets(r, &nb));
    CHECK(nb == 3);  // reverse order: {2} (32 B <= 40), {1} alone (400 B > cap), {0}
    int ids[3] = {-1, -1, -1}, cnt = 0;
    int64_t numel = 0;
    EBB_REQUIRE_OK(ebb_reducer_bucket_info(r, 1, &numel, nullptr, &cnt, ids, 3));
    CHECK(cnt == 1);
    CHECK(ids[0] == 1);
    CHECK(numel == 100);
    // loss = sum(p0 * 2) + sum(p1 * 3) (p2 unused): grads 2, 3 and 0.
    for (int step = 0; step < 2; step++) {
      EBB_REQUIRE_OK(ebb_reducer_zero_grad(r));
      ebb_tensor_t *a = nullptr, *b = nullptr, *sa = nullptr, *sb = nullptr, *loss = nullptr;
      EBB_REQUIRE_OK(ebb_op_mul_scalar(p[0], 2, &a));
      EBB_REQUIRE_OK(ebb_op_mul_scalar(p[1], 3, &b));
      EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, &sa));
      EBB_REQUIRE_OK(ebb_op_sum(b, nullptr, 0, false, &sb));
      EBB_REQUIRE_OK(ebb_op_add(sa, sb, &loss));
      EBB_REQUIRE_OK(ebb_backward_one(loss));
      EBB_REQUIRE_OK(ebb_reducer_finish(r));
      const double want[3] = {2, 3, 0};
      for (int i = 0; i < 3; i++) {
        ebb_tensor_t *gr = nullptr;
        EBB_REQUIRE_OK(ebb_tensor_grad(p[i], &gr));
        REQUIRE(gr != nullptr);
        std::vector<double> v = read(gr);
        for (double x : v) CHECK(x == want[i]);
        ebb_tensor_release(gr);
      }
      for (ebb_tensor_t *t : {a, b, sa, sb, loss}) ebb_tensor_release(t);
    }
    EBB_REQUIRE_OK(ebb_reducer_destroy(r));
    CHECK(ebb_reducer_destroy(r) == EBB_EFREED);
    CHECK(ebb_reducer_finish(r) == EBB_EFREED);
    CHECK(ebb_reducer_set_sync(r, true) == EBB_EFREED);
    // The gradients stay readable after the reducer is gone.
    ebb_tensor_t *gr = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad(p[1], &gr));
    REQUIRE(gr != nullptr);
    CHECK(read(gr)[0] == 3.0);
    ebb_tensor_release(gr);
    for (ebb_tensor_t *t : p) ebb_tensor_release(t);
  }
}

TEST_CASE("reducer, world of one: the trace names each bucket's all-reduce, issued in bucket order", "[ddp][world1][trace]") {
  EbbSession session;
  EBB_REQUIRE_OK(ebb_trace_enable(1 << 14));
  Group g;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, 0, nullptr, &g.pg));
  ebb_tensor_t *p[3] = {param(0, {16}, 1), param(0, {10, 10}, 2), param(0, {8}, 3)};
  ebb_reducer_options o = {};
  o.first_bucket_bytes = 40;
  o.bucket_bytes = 100;
  o.no_rebuild = true;
  ebb_reducer_t *r = nullptr;
  EBB_REQUIRE_OK(ebb_reducer_create(g.pg, p, 3, &o, &r));
  ebb_tensor_t *s0 = nullptr, *s2 = nullptr, *loss = nullptr;
  EBB_REQUIRE_OK(ebb_op_sum(p[0], nullptr, 0, false, &s0)); // p1 unused: its bucket is issued as ready
  EBB_REQUIRE_OK(ebb_op_sum(p[2], nullptr, 0, false, &s2));
  EBB_REQUIRE_OK(ebb_op_add(s0, s2, &loss));
  EBB_REQUIRE_OK(ebb_backward_one(loss));
  EBB_REQUIRE_OK(ebb_reducer_finish(r));
  ebb_stream_t *cur;
  EBB_REQUIRE_OK(ebb_stream_current(0, &cur));
  EBB_REQUIRE_OK(ebb_stream_synchronize(cur));
  std::vector<ebb_trace_span> recs(1 << 14);
  size_t n = 0;
  EBB_REQUIRE_OK(ebb_trace_snapshot(recs.data(), recs.size(), &n));
  std::vector<std::string> owners;
  uint64_t last_seq = 0;
  for (size_t i = 0; i < n; i++) {
    const ebb_trace_span &s = recs[i];
    if (s.kind != EBB_TRACE_SPAN || !s.name || std::string(s.name) != "all_reduce" || s.device != 0) continue;
    CHECK(s.seq > last_seq); // recorded as the communication thread ran them: in issue order
    last_seq = s.seq;
    owners.push_back(s.owner ? s.owner : "(none)");
  }
  // The broadcast of rank 0's values at creation is not an all-reduce; the buckets' are, in order.
  CHECK(owners == std::vector<std::string>{"ddp bucket 0", "ddp bucket 1", "ddp bucket 2"});
  for (ebb_tensor_t *t : {s0, s2, loss}) ebb_tensor_release(t);
  EBB_REQUIRE_OK(ebb_reducer_destroy(r));
  for (ebb_tensor_t *t : p) ebb_tensor_release(t);
  ebb_trace_disable();
}

TEST_CASE("reducer, bad input: NULLs, counts, caps, devices, non-parameters, options version", "[ddp][world1]") {
  EbbSession session;
  Group g;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &g.pg));
  ebb_tensor_t *p = param(EBB_DEVICE_CPU, {4}, 1);
  ebb_reducer_t *r = nullptr;
  CHECK(ebb_reducer_create(nullptr, &p, 1, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("pg is NULL"));
  CHECK(ebb_reducer_create(g.pg, nullptr, 1, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("params is NULL"));
  CHECK(ebb_reducer_create(g.pg, &p, 0, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("n is 0"));
  CHECK(ebb_reducer_create(g.pg, &p, 1, nullptr, nullptr) == EBB_EINVAL);
  ebb_tensor_t *with_null[2] = {p, nullptr};
  CHECK(ebb_reducer_create(g.pg, with_null, 2, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("params[1] is NULL"));
  ebb_tensor_t *twice[2] = {p, p};
  CHECK(ebb_reducer_create(g.pg, twice, 2, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("shares its storage"));
  ebb_reducer_options o = {};
  o.bucket_bytes = -1;
  CHECK(ebb_reducer_create(g.pg, &p, 1, &o, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("bucket cap is negative"));
  o = {};
  o.version = EBB_REDUCER_OPTIONS_VERSION + 1;
  CHECK(ebb_reducer_create(g.pg, &p, 1, &o, &r) == EBB_ENOTSUP);
  ebb_tensor_t *plain = nullptr;
  int64_t four = 4;
  EBB_REQUIRE_OK(ebb_tensor_zeros(EBB_DEVICE_CPU, EBB_F32, 1, &four, &plain));
  CHECK(ebb_reducer_create(g.pg, &plain, 1, nullptr, &r) == EBB_EINVAL);
  CHECK_THAT(ebb_last_error(), Catch::Contains("does not require a gradient"));
  int ndev = 0;
  if (ebb_dev_count(&ndev) == EBB_OK && ndev > 0) {
    ebb_tensor_t *dp = param(0, {4}, 1);
    CHECK(ebb_reducer_create(g.pg, &dp, 1, nullptr, &r) == EBB_EDEVICE);
    CHECK_THAT(ebb_last_error(), Catch::Contains("is on device 0, the group on the CPU"));
    ebb_tensor_release(dp);
  }
  CHECK(ebb_reducer_finish(nullptr) == EBB_EINVAL);
  CHECK(ebb_reducer_zero_grad(nullptr) == EBB_EINVAL);
  CHECK(ebb_reducer_destroy(nullptr) == EBB_EINVAL);
  int nb = 0;
  CHECK(ebb_reducer_num_buckets(nullptr, &nb) == EBB_EINVAL);
  // A cap of 0 is the default: one bucket for a small model.
  o = {};
  EBB_REQUIRE_OK(ebb_reducer_create(g.pg, &p, 1, &o, &r));
  EBB_REQUIRE_OK(ebb_reducer_num_buckets(r, &nb));
  CHECK(nb == 1);
  CHECK(ebb_reducer_bucket_info(r, 1, nullptr, nullptr, nullptr, nullptr, 0) == EBB_EINVAL);
  // A finish with no backward: every parameter unused, reduced as it stands.
  EBB_REQUIRE_OK(ebb_reducer_finish(r));
  EBB_REQUIRE_OK(ebb_reducer_destroy(r));
  ebb_tensor_release(plain);
  ebb_tensor_release(p);
}
#endif

#if EBB_TEST_HAVE_MPI
namespace {
struct Order {
  std::vector<int> seen;
};
struct OrderHook {
  Order *o;
  int index;
};
ebb_status record_order(const ebb_tensor_t *, void *user) {
  auto *h = static_cast<OrderHook *>(user);
  h->o->seen.push_back(h->index);
  return EBB_OK;
}
}  // namespace

TEST_CASE("reducer, world of one: after the first step the buckets follow the order the gradients came in", "[ddp][world1]") {
  EbbSession session;
  Group g;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &g.pg));
  // Four parameters of 16 bytes and caps of 16: a bucket each. The loss uses them as
  // sum(((p3 * p2) * p1) * p0): the engine reaches p0 first, against the reverse order's guess.
  ebb_tensor_t *p[4] = {param(EBB_DEVICE_CPU, {4}, 1), param(EBB_DEVICE_CPU, {4}, 2), param(EBB_DEVICE_CPU, {4}, 3),
                        param(EBB_DEVICE_CPU, {4}, 4)};
  ebb_reducer_options o = {};
  o.first_bucket_bytes = 16;
  o.bucket_bytes = 16;
  ebb_reducer_t *r = nullptr;
  EBB_REQUIRE_OK(ebb_reducer_create(g.pg, p, 4, &o, &r));
  auto bucket_order = [&] {
    std::vector<int> v;
    int nb = 0;
    EBB_REQUIRE_OK(ebb_reducer_num_buckets(r, &nb));
    for (int b = 0; b < nb; b++) {
      int ids[4], cnt = 0;
      EBB_REQUIRE_OK(ebb_reducer_bucket_info(r, b, nullptr, nullptr, &cnt, ids, 4));
      for (int k = 0; k < cnt; k++) v.push_back(ids[k]);
    }
    return v;
  };
  CHECK(bucket_order() == std::vector<int>({3, 2, 1, 0}));  // reverse parameter order at first
  Order order;
  OrderHook hooks[4];
  ebb_hook_handle hh[4];
  for (int i = 0; i < 4; i++) {
    hooks[i] = {&order, i};
    EBB_REQUIRE_OK(ebb_tensor_register_post_accumulate_hook(p[i], record_order, &hooks[i], &hh[i]));
  }
  for (int step = 0; step < 2; step++) {
    order.seen.clear();
    EBB_REQUIRE_OK(ebb_reducer_zero_grad(r));
    ebb_tensor_t *a = nullptr, *b = nullptr, *c = nullptr, *loss = nullptr;
    EBB_REQUIRE_OK(ebb_op_mul(p[3], p[2], &a));
    EBB_REQUIRE_OK(ebb_op_mul(a, p[1], &b));
    EBB_REQUIRE_OK(ebb_op_mul(b, p[0], &c));
    EBB_REQUIRE_OK(ebb_op_sum(c, nullptr, 0, false, &loss));
    EBB_REQUIRE_OK(ebb_backward_one(loss));
    EBB_REQUIRE_OK(ebb_reducer_finish(r));
    REQUIRE(order.seen.size() == 4);
    CHECK(order.seen[0] == 0);
    CHECK(bucket_order() == order.seen);  // rebuilt once, in the order of the first step
    ebb_tensor_t *gr = nullptr;
    EBB_REQUIRE_OK(ebb_tensor_grad(p[0], &gr));
    CHECK(read(gr)[0] == 2.0 * 3.0 * 4.0);  // p0's gradient: p1 * p2 * p3  // the gradient survived the move to the new bucket
    ebb_tensor_release(gr);
    for (ebb_tensor_t *t : {a, b, c, loss}) ebb_tensor_release(t);
  }
  for (auto h : hh) EBB_REQUIRE_OK(ebb_hook_remove(h));
  EBB_REQUIRE_OK(ebb_reducer_destroy(r));
  for (ebb_tensor_t *t : p) ebb_tensor_release(t);
}
#endif

#if EBB_TEST_HAVE_MPI
TEST_CASE("reducer, world of one: a second backward before ebb_reducer_finish fails, naming finish", "[ddp][world1]") {
  EbbSession session;
  Group g;
  EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, nullptr, &g.pg));
  ebb_tensor_t *p = param(EBB_DEVICE_CPU, {4}, 1);
  ebb_reducer_t *r = nullptr;
  EBB_REQUIRE_OK(ebb_reducer_create(g.pg, &p, 1, nullptr, &r));
  ebb_tensor_t *a = nullptr, *l1 = nullptr, *l2 = nullptr;
  EBB_REQUIRE_OK(ebb_op_mul_scalar(p, 2, &a));
  EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, &l1));
  EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, &l2));
  const ebb_tensor_t *roots1[1] = {l1};
  EBB_REQUIRE_OK(ebb_backward(roots1, nullptr, 1, true, nullptr, 0));
  CHECK(ebb_backward_one(l2) == EBB_ESTATE);
  CHECK_THAT(ebb_last_error(), Catch::Contains("before ebb_reducer_finish"));
  EBB_REQUIRE_OK(ebb_reducer_finish(r));  // the first backward's step completes
  // The next step works as usual.
  EBB_REQUIRE_OK(ebb_reducer_zero_grad(r));
  EBB_REQUIRE_OK(ebb_backward_one(l1));
  EBB_REQUIRE_OK(ebb_reducer_finish(r));
  ebb_tensor_t *gr = nullptr;
  EBB_REQUIRE_OK(ebb_tensor_grad(p, &gr));
  CHECK(read(gr)[0] == 2.0);
  ebb_tensor_release(gr);
  for (ebb_tensor_t *t : {a, l1, l2}) ebb_tensor_release(t);
  EBB_REQUIRE_OK(ebb_reducer_destroy(r));
  ebb_tensor_release(p);
}
#endif

namespace {

// loss = sum over i of sum(p[i] * k[i]) for the k[i] not 0; backward through it.
void backward_scaled(ebb_tensor_t *const *p, const double *k, int n) {
  ebb_tensor_t *loss = nullptr;
  for (int i = 0; i < n; i++) {
    if (k[i] == 0) continue;
    ebb_tensor_t *a = nullptr, *s = nullptr;
    EBB_REQUIRE_OK(ebb_op_mul_scalar(p[i], k[i], &a));
    EBB_REQUIRE_OK(ebb_op_sum(a, nullptr, 0, false, &s));
    ebb_tensor_release(a);
    if (!loss) {
      loss = s;
    } else {
      ebb_tensor_t *l2 = nullptr;
      EBB_REQUIRE_OK(ebb_op_add(loss, s, &l2));
      ebb_tensor_release(loss);
      ebb_tensor_release(s);
      loss = l2;
    }
  }
  EBB_REQUIRE_OK(ebb_backward_one(loss));
  ebb_tensor_release(loss);
}

}  // namespace

TEST_CASE("reducer, world of one: accumulation after .grad was cleared to NULL keeps what each backward added, "
          "parameters unused in the synchronised backward included", "[ddp][world1]") {
  EbbSession session;
  std::vector<int> devs{EBB_DEVICE_CPU};
  int ndev = 0;
  if (ebb_dev_count(&ndev) == EBB_OK && ndev > 0) devs.push_back(0);
  for (int dev : devs)
    for (bool copies : {false, true}) {
      INFO(dev_name(dev) << (copies ? ", copy_grads" : ", views"));
      Group g;
      EBB_REQUIRE_OK(ebb_pg_create(EBB_DIST_MPI, dev, nullptr, &g.pg));
      ebb_tensor_t *p[3] = {param(dev, {16}, 1), param(dev, {10, 10}, 2), param(dev, {8}, 3)};
      ebb_reducer_options o = {};
      o.first_bucket_bytes = 40;
      o.bucket_bytes = 100;
      o.copy_grads = copies;
      ebb_reducer_t *r = nullptr;
      EBB_REQUIRE_OK(ebb_reducer_create(g.pg, p, 3, &o, &r));
      for (int step = 0; step < 2; step++) { // the second after the first-step rebuild
        INFO("step " << step);
        if (step == 0) {
          for (ebb_tensor_t *t : p) EBB_REQUIRE_OK(ebb_tensor_set_grad(t, nullptr)); // an optimizer's zero_grad
        } else {
          EBB_REQUIRE_OK(ebb_reducer_zero_grad(r));
        }
        EBB_REQUIRE_OK(ebb_reducer_set_sync(r, false));
        const double k1[3] = {1, 2, 0}, k2[3] = {0, 0, 4}, k3[3] = {8, 0, 0};
        backward_scaled(p, k1, 3);
        backward_scaled(p, k2, 3);
        EBB_REQUIRE_OK(ebb_reducer_set_sync(r, true));
        backward_scaled(p, k3, 3); // p1 and p2 unused in the synchronised backward
        EBB_REQUIRE_OK(ebb_reducer_finish(r));
        const double want[3] = {9, 2, 4};
        for (int i = 0; i < 3; i++) {
          ebb_tensor_t *gr = nullptr;
          EBB_REQUIRE_OK(ebb_tensor_grad(p[i], &gr));
          REQUIRE(gr != nullptr);
          std::vector<double> v = read(gr);
          for (double x : v) CHECK(x == want[i]);
          ebb_tensor_release(gr);
        }
      }
      EBB_REQUIRE_OK(ebb_reducer_destroy(r));
      for (ebb_tensor_t *t : p) ebb_tensor_release(t);
    }
}
