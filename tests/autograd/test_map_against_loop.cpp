// ebb_map against the explicit loop it stands for (select each slice, run the block, stack):
// values and gradients equal, saving each slice's graph or checkpointing it, on the CPU and on
// the emulated device 0; inputs that need no gradient, an output no gradient reaches, an arg no
// output uses, fn returning its slice unchanged, several outputs, a second backward (with and
// without retain_graph), and a map with nothing to record.
#include <string>
#include <vector>

#include "map_test_util.hpp"

using namespace ebb_test;

namespace {

struct Mode {
  const char *name;
  bool checkpoint;
};
const Mode kModes[] = {{"save", false}, {"checkpoint", true}};

std::vector<int> cpu_and_device0() {
  std::vector<int> d{EBB_DEVICE_CPU};
  int n = 0;
  EBB_REQUIRE_OK(ebb_dev_count(&n));
  if (n > 0) d.push_back(0);
  return d;
}

// ebb_map of the block over x with args (w, b).
std::vector<Tensor> block_map(const ebb_tensor_t *x, const ebb_tensor_t *w, const ebb_tensor_t *b, int nouts, bool checkpoint,
                              BlockCfg *cfg) {
  const ebb_tensor_t *xs[1] = {x}, *args[2] = {w, b};
  ebb_map_options o = {};
  o.checkpoint = checkpoint;
  ebb_tensor_t *out[2] = {nullptr, nullptr};
  EBB_REQUIRE_OK(ebb_map(block_fn, cfg, xs, 1, args, 2, &o, out, nouts));
  std::vector<Tensor> r;
  for (int k = 0; k < nouts; k++) r.emplace_back(out[k]);
  return r;
}

std::vector<const ebb_tensor_t *> ptrs(const std::vector<Tensor> &ts) {
  std::vector<const ebb_tensor_t *> p;
  for (auto &t : ts) p.push_back(t.get());
  return p;
}

void check_all_close(const std::vector<std::vector<double>> &got, const std::vector<std::vector<double>> &want, const char *what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); i++) {
    INFO(what << " " << i);
    EBB_CHECK_CLOSE(got[i], want[i], 1e-12, 1e-10);
  }
}

}  // namespace

TEST_CASE("map: values and gradients equal the explicit loop's, saved or checkpointed, on the CPU and device 0",
          "[autograd][map][loop]") {
  EbbSession session;
  Live live;
  for (int dev : cpu_and_device0()) {
    for (const Mode &mode : kModes) {
      INFO(dev_name(dev) << ", " << mode.name);
      Tensor x = input_on(dev, {5, 3, 4}, 1, true), w = input_on(dev, {4, 4}, 2, true), b = input_on(dev, {4}, 3, true);
      auto ref = block_loop(x, w, b, 2);
      Tensor lref = weighted_loss(ptrs(ref));
      auto gref = grads_of(lref, {x, w, b});

      BlockCfg cfg;
      auto out = block_map(x, w, b, 2, mode.checkpoint, &cfg);
      CHECK(cfg.calls == 5);
      for (int k = 0; k < 2; k++) {
        CHECK(shape_of(out[(size_t)k]) == std::vector<int64_t>{5, 3, 4});
        EBB_CHECK_CLOSE(read(out[(size_t)k]), read(ref[(size_t)k]), 1e-14, 1e-12);
        bool rg = false;
        EBB_REQUIRE_OK(ebb_tensor_requires_grad(out[(size_t)k], &rg));
        CHECK(rg);
        const ebb_node_t *node = nullptr;
        EBB_REQUIRE_OK(ebb_tensor_grad_fn(out[(size_t)k], &node, nullptr));
        CHECK(std::string(ebb_node_name(node)) == "MapBackward");
      }
      Tensor l = weighted_loss(ptrs(out));
      check_all_close(grads_of(l, {x, w, b}), gref, "gradient of input");
      // checkpoint mode ran each slice once more in the backward
      CHECK(cfg.calls == (mode.checkpoint ? 10 : 5));
    }
  }
  live.check();
}

TEST_CASE("map: an arg or an x that does not require a gradient gets none, the others theirs", "[autograd][map][needs-grad]") {
  EbbSession session;
  Live live;
  for (int dev : cpu_and_device0()) {
    for (const Mode &mode : kModes) {
      INFO(dev_name(dev) << ", " << mode.name);
      // w is a constant: x and b get their gradients, w's .grad stays empty.
      Tensor x = input_on(dev, {4, 2, 4}, 11, true), w = input_on(dev, {4, 4}, 12, false), b = input_on(dev, {4}, 13, true);
      auto ref = block_loop(x, w, b, 2);
      Tensor lref = weighted_loss(ptrs(ref));
      auto gref = grads_of(lref, {x, b});
      BlockCfg cfg;
      auto out = block_map(x, w, b, 2, mode.checkpoint, &cfg);
      Tensor l = weighted_loss(ptrs(out));
      EBB_REQUIRE_OK(ebb_backward_one(l));
      check_all_close({grad_of(x), grad_of(b)}, gref, "gradient of x, b");
      Tensor gw;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, gw.out()));
      CHECK(gw.get() == nullptr);

      // x is data: only the args get gradients (the map's x needs none, and none is computed).
      Tensor xd = input_on(dev, {4, 2, 4}, 14, false), w2 = input_on(dev, {4, 4}, 15, true);
      auto ref2 = block_loop(xd, w2, b, 2);
      Tensor lref2 = weighted_loss(ptrs(ref2));
      auto gref2 = grads_of(lref2, {w2, b});
      auto out2 = block_map(xd, w2, b, 2, mode.checkpoint, &cfg);
      Tensor l2 = weighted_loss(ptrs(out2));
      check_all_close(grads_of(l2, {w2, b}), gref2, "gradient of w, b");
    }
  }
  live.check();
}

TEST_CASE("map: an output no gradient reaches counts as zero, and an arg no output uses gets no gradient",
          "[autograd][map][unused]") {
  EbbSession session;
  Live live;
  for (const Mode &mode : kModes) {
    INFO(mode.name);
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2, 4}, 21, true), w = input_on(EBB_DEVICE_CPU, {4, 4}, 22, true),
           b = input_on(EBB_DEVICE_CPU, {4}, 23, true);
    // The loss reads output 0 only: output 1 (z = y * x) sends no gradient into the map.
    auto ref = block_loop(x, w, b, 2);
    Tensor lref = weighted_loss({ref[0].get(), nullptr});
    auto gref = grads_of(lref, {x, w, b});
    BlockCfg cfg;
    auto out = block_map(x, w, b, 2, mode.checkpoint, &cfg);
    Tensor l = weighted_loss({out[0].get(), nullptr});
    check_all_close(grads_of(l, {x, w, b}), gref, "gradient with output 1 unused");

    // fn ignores b: b's .grad stays empty, x and w get theirs.
    BlockCfg nob;
    nob.use_b = false;
    auto out2 = block_map(x, w, b, 1, mode.checkpoint, &nob);
    auto ref2 = block_loop(x, w, b, 1, false);
    Tensor l2 = weighted_loss(ptrs(out2)), lref2 = weighted_loss(ptrs(ref2));
    auto gref2 = grads_of(lref2, {x, w});
    EBB_REQUIRE_OK(ebb_backward_one(l2));
    check_all_close({grad_of(x), grad_of(w)}, gref2, "gradient with b unused");
    Tensor gb;
    EBB_REQUIRE_OK(ebb_tensor_grad(b, gb.out()));
    CHECK(gb.get() == nullptr);
  }
  live.check();
}

namespace {

// fn returning its slice itself (a new reference on the handle it got) and the arg times 2.
ebb_status identity_fn(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *args, int, ebb_tensor_t **outs, int, void *) {
  ebb_status st = ebb_tensor_retain(const_cast<ebb_tensor_t *>(xs[0]));
  if (st) return st;
  outs[0] = const_cast<ebb_tensor_t *>(xs[0]);
  return ebb_op_mul_scalar(args[0], 2.0, &outs[1]);
}

}  // namespace

TEST_CASE("map: fn may return its slice unchanged, the gradient passing through, and an arg's gradient sums over slices",
          "[autograd][map][identity]") {
  EbbSession session;
  Live live;
  for (const Mode &mode : kModes) {
    INFO(mode.name);
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2}, 31, true), a = input_on(EBB_DEVICE_CPU, {2}, 32, true);
    const ebb_tensor_t *xs[1] = {x.get()}, *args[1] = {a.get()};
    ebb_map_options o = {};
    o.checkpoint = mode.checkpoint;
    ebb_tensor_t *out[2] = {nullptr, nullptr};
    EBB_REQUIRE_OK(ebb_map(identity_fn, nullptr, xs, 1, args, 1, &o, out, 2));
    Tensor y(out[0]), z(out[1]);
    CHECK(read(y) == read(x));
    CHECK(shape_of(z) == std::vector<int64_t>{3, 2});
    Tensor l = weighted_loss({y.get(), z.get()});
    auto g = grads_of(l, {x, a});
    // d/dx: the weights of output 0; d/da: 2 * the weights of output 1 summed over slices.
    auto w0 = values(6, 100), w1 = values(6, 101);
    EBB_CHECK_CLOSE(g[0], w0, 1e-15, 0);
    std::vector<double> ga{2 * (w1[0] + w1[2] + w1[4]), 2 * (w1[1] + w1[3] + w1[5])};
    EBB_CHECK_CLOSE(g[1], ga, 1e-14, 1e-14);
  }
  live.check();
}

TEST_CASE("map: a backward again needs retain_graph on the first, and then adds the gradients twice", "[autograd][map][retain]") {
  EbbSession session;
  Live live;
  for (const Mode &mode : kModes) {
    INFO(mode.name);
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2, 4}, 41, true), w = input_on(EBB_DEVICE_CPU, {4, 4}, 42, true),
           b = input_on(EBB_DEVICE_CPU, {4}, 43, true);
    // the loss is a plain sum, whose node saves nothing: the map's node is the one to refuse
    auto ref = block_loop(x, w, b, 1);
    Tensor lref = sum_of(ref[0]);
    auto gref = grads_of(lref, {w});
    BlockCfg cfg;
    auto out = block_map(x, w, b, 1, mode.checkpoint, &cfg);
    Tensor l = sum_of(out[0]);
    const ebb_tensor_t *roots[1] = {l.get()};
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, true, nullptr, 0));
    EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, nullptr, 0));
    std::vector<double> twice = gref[0];
    for (auto &v : twice) v *= 2;
    EBB_CHECK_CLOSE(grad_of(w), twice, 1e-12, 1e-10);
    // The graph's saved tensors (or the slices' graphs) went with the second backward.
    EBB_CHECK_MSG(ebb_backward(roots, nullptr, 1, false, nullptr, 0), EBB_ESTATE, "MapBackward", "retain_graph");
  }
  live.check();
}

TEST_CASE("map: with grad mode off, or no input requiring a gradient, map is the loop and records nothing",
          "[autograd][map][no-grad]") {
  EbbSession session;
  Live live;
  for (int dev : cpu_and_device0()) {
    INFO(dev_name(dev));
    Tensor x = input_on(dev, {4, 3, 4}, 51, true), w = input_on(dev, {4, 4}, 52, true), b = input_on(dev, {4}, 53, false);
    std::vector<Tensor> ref;
    {
      bool was;
      ebb_grad_set_enabled(false, &was);
      ref = block_loop(x, w, b, 2);
      BlockCfg cfg;
      long nodes = ebb_autograd_live_nodes();
      auto out = block_map(x, w, b, 2, false, &cfg);
      CHECK(ebb_autograd_live_nodes() == nodes);
      ebb_grad_set_enabled(was, nullptr);
      for (int k = 0; k < 2; k++) {
        CHECK(read(out[(size_t)k]) == read(ref[(size_t)k]));
        bool rg = true;
        EBB_REQUIRE_OK(ebb_tensor_requires_grad(out[(size_t)k], &rg));
        CHECK_FALSE(rg);
      }
    }
    Tensor xd = input_on(dev, {4, 3, 4}, 51, false), wd = input_on(dev, {4, 4}, 52, false);
    BlockCfg cfg;
    auto out = block_map(xd, wd, b, 2, true, &cfg);
    for (int k = 0; k < 2; k++) {
      CHECK(read(out[(size_t)k]) == read(ref[(size_t)k]));
      bool rg = true;
      EBB_REQUIRE_OK(ebb_tensor_requires_grad(out[(size_t)k], &rg));
      CHECK_FALSE(rg);
    }
  }
  live.check();
}

namespace {

// fn that maps the inner block over the rows of its slice (a map inside a map). The inner
// map's user pointer must outlive its node (a checkpointed one calls fn again in the backward).
struct NestedCfg {
  bool inner_checkpoint;
  BlockCfg cfg;
};
ebb_status nested_fn(const ebb_tensor_t *const *xs, int nxs, const ebb_tensor_t *const *args, int nargs, ebb_tensor_t **outs,
                     int nouts, void *user) {
  auto *nc = static_cast<NestedCfg *>(user);
  ebb_map_options o = {};
  o.checkpoint = nc->inner_checkpoint;
  return ebb_map(block_fn, &nc->cfg, xs, nxs, args, nargs, &o, outs, nouts);
}

}  // namespace

TEST_CASE("map: a map inside fn gives the loop's gradients too", "[autograd][map][nested]") {
  EbbSession session;
  Live live;
  for (const Mode &outer : kModes) {
    for (const Mode &inner : kModes) {
      INFO("outer " << outer.name << ", inner " << inner.name);
      Tensor x = input_on(EBB_DEVICE_CPU, {3, 2, 4}, 61, true), w = input_on(EBB_DEVICE_CPU, {4, 4}, 62, true),
             b = input_on(EBB_DEVICE_CPU, {4}, 63, true);
      // A row-wise block is the block: the loop over the whole [3, 2, 4] is the reference.
      auto ref = block_loop(x, w, b, 2);
      Tensor lref = weighted_loss(ptrs(ref));
      auto gref = grads_of(lref, {x, w, b});
      const ebb_tensor_t *xs[1] = {x.get()}, *args[2] = {w.get(), b.get()};
      ebb_map_options o = {};
      o.checkpoint = outer.checkpoint;
      ebb_tensor_t *out[2] = {nullptr, nullptr};
      NestedCfg nc{inner.checkpoint, {}};
      EBB_REQUIRE_OK(ebb_map(nested_fn, &nc, xs, 1, args, 2, &o, out, 2));
      Tensor y(out[0]), z(out[1]);
      EBB_CHECK_CLOSE(read(y), read(ref[0]), 1e-14, 1e-12);
      Tensor l = weighted_loss({y.get(), z.get()});
      check_all_close(grads_of(l, {x, w, b}), gref, "gradient of input");
    }
  }
  live.check();
}

namespace {

// Two xs sliced together, one of them integer: y = x * to_dtype(k) + a.
ebb_status two_xs_fn(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *args, int, ebb_tensor_t **outs, int, void *) {
  ebb_tensor_t *kf = nullptr, *p = nullptr;
  ebb_status st = ebb_tensor_to_dtype(xs[1], EBB_F64, &kf);
  if (!st) st = ebb_op_mul(xs[0], kf, &p);
  if (!st) st = ebb_op_add(p, args[0], &outs[0]);
  if (kf) ebb_tensor_release(kf);
  if (p) ebb_tensor_release(p);
  return st;
}

}  // namespace

TEST_CASE("map: several xs are sliced together, an integer one among them, and a partial backward computes what it asks for",
          "[autograd][map][xs]") {
  EbbSession session;
  Live live;
  for (const Mode &mode : kModes) {
    INFO(mode.name);
    {
      Tensor x = input_on(EBB_DEVICE_CPU, {3, 2}, 71, true), a = input_on(EBB_DEVICE_CPU, {2}, 72, true);
      Tensor k = make(EBB_DEVICE_CPU, EBB_I64, {3, 2}, {1, 2, 3, 4, 5, 6});
      const ebb_tensor_t *xs[2] = {x.get(), k.get()}, *args[1] = {a.get()};
      ebb_map_options o = {};
      o.checkpoint = mode.checkpoint;
      ebb_tensor_t *out[1] = {nullptr};
      EBB_REQUIRE_OK(ebb_map(two_xs_fn, nullptr, xs, 2, args, 1, &o, out, 1));
      Tensor y(out[0]);
      auto xv = read(x), av = read(a), yv = read(y);
      for (int i = 0; i < 6; i++) CHECK(yv[(size_t)i] == xv[(size_t)i] * (i + 1) + av[(size_t)(i % 2)]);
      Tensor l = weighted_loss({y.get()});
      auto w = values(6, 100);
      // partial: only a's gradient is asked for; x's .grad stays empty
      const ebb_tensor_t *roots[1] = {l.get()}, *only_a[1] = {a.get()};
      EBB_REQUIRE_OK(ebb_backward(roots, nullptr, 1, false, only_a, 1));
      EBB_CHECK_CLOSE(grad_of(a), (std::vector<double>{w[0] + w[2] + w[4], w[1] + w[3] + w[5]}), 1e-14, 1e-14);
      Tensor gx;
      EBB_REQUIRE_OK(ebb_tensor_grad(x, gx.out()));
      CHECK(gx.get() == nullptr);
    }
    {
      // and the gradient of x: each weight times its k
      Tensor x = input_on(EBB_DEVICE_CPU, {3, 2}, 73, true), a = input_on(EBB_DEVICE_CPU, {2}, 74, false);
      Tensor k = make(EBB_DEVICE_CPU, EBB_I64, {3, 2}, {1, 2, 3, 4, 5, 6});
      const ebb_tensor_t *xs[2] = {x.get(), k.get()}, *args[1] = {a.get()};
      ebb_map_options o = {};
      o.checkpoint = mode.checkpoint;
      ebb_tensor_t *out[1] = {nullptr};
      EBB_REQUIRE_OK(ebb_map(two_xs_fn, nullptr, xs, 2, args, 1, &o, out, 1));
      Tensor y(out[0]);
      Tensor l = weighted_loss({y.get()});
      auto g = grads_of(l, {x});
      auto w = values(6, 100);
      std::vector<double> want(6);
      for (int i = 0; i < 6; i++) want[(size_t)i] = w[(size_t)i] * (i + 1);
      EBB_CHECK_CLOSE(g[0], want, 1e-14, 1e-14);
    }
  }
  live.check();
}

namespace {

// outputs: x * a (requires a gradient), a constant (requires none) and an integer tensor.
ebb_status mixed_fn(const ebb_tensor_t *const *xs, int, const ebb_tensor_t *const *args, int, ebb_tensor_t **outs, int, void *) {
  int nd = 0;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  ebb_status st = ebb_tensor_shape(xs[0], &nd, shape);
  if (!st) st = ebb_op_mul(xs[0], args[0], &outs[0]);
  if (!st) st = ebb_tensor_full(EBB_DEVICE_CPU, EBB_F64, nd, shape, 7.0, &outs[1]);
  if (!st) st = ebb_tensor_full(EBB_DEVICE_CPU, EBB_I64, nd, shape, 3.0, &outs[2]);
  return st;
}

}  // namespace

TEST_CASE("map: outputs that require no gradient (a constant, an integer tensor) are stacked and send none back",
          "[autograd][map][outputs]") {
  EbbSession session;
  Live live;
  for (const Mode &mode : kModes) {
    INFO(mode.name);
    Tensor x = input_on(EBB_DEVICE_CPU, {3, 2}, 81, true), a = input_on(EBB_DEVICE_CPU, {2}, 82, true);
    const ebb_tensor_t *xs[1] = {x.get()}, *args[1] = {a.get()};
    ebb_map_options o = {};
    o.checkpoint = mode.checkpoint;
    ebb_tensor_t *out[3] = {nullptr, nullptr, nullptr};
    EBB_REQUIRE_OK(ebb_map(mixed_fn, nullptr, xs, 1, args, 1, &o, out, 3));
    Tensor y(out[0]), c(out[1]), k(out[2]);
    CHECK(read(c) == std::vector<double>(6, 7.0));
    CHECK(read(k) == std::vector<double>(6, 3.0));
    CHECK(dtype_of(k) == EBB_I64);
    bool rg = true;
    EBB_REQUIRE_OK(ebb_tensor_requires_grad(k, &rg));
    CHECK_FALSE(rg);
    // the constant is a floating output of the node: it requires a gradient, which goes nowhere
    Tensor l = weighted_loss({y.get(), c.get()});
    auto g = grads_of(l, {x, a});
    auto w = values(6, 100), xv = read(x), av = read(a);
    std::vector<double> gx(6), ga{0, 0};
    for (int i = 0; i < 6; i++) {
      gx[(size_t)i] = w[(size_t)i] * av[(size_t)(i % 2)];
      ga[(size_t)(i % 2)] += w[(size_t)i] * xv[(size_t)i];
    }
    EBB_CHECK_CLOSE(g[0], gx, 1e-14, 1e-14);
    EBB_CHECK_CLOSE(g[1], ga, 1e-14, 1e-14);
  }
  live.check();
}
