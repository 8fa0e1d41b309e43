// Optimizer steps (ebb/optim.h) give PyTorch's values: SGD (momentum, dampening, Nesterov, weight
// decay, maximize) and AdamW (bias correction, decoupled weight decay, amsgrad) over several
// steps, against a reference loop written here in f32 and against numbers torch 1.13 computed,
// on the CPU and on the emulated devices, for f32, f64 and bf16 parameters; parameters without a
// gradient are skipped; state, step counts, learning rates and zero_grad behave as documented;
// a step bumps each updated parameter's version once and records nothing.
#include <cmath>
#include <string>
#include <vector>

#include "autograd_test_util.hpp"
#include "ebb/autograd.h"
#include "ebb/ops.h"
#include "ebb/optim.h"
#include "ebb/trace.h"
#include "tensor_test_util.hpp"

using namespace ebb_test;

namespace {

// Owns a parameter list or an optimizer.
struct Params {
  ebb_params_t *pl = nullptr;
  Params() { EBB_REQUIRE_OK(ebb_params_create(&pl)); }
  ~Params() {
    if (pl) ebb_params_destroy(pl);
  }
  operator ebb_params_t *() const { return pl; }
};
struct Optim {
  ebb_optim_t *o = nullptr;
  ~Optim() {
    if (o) ebb_optim_destroy(o);
  }
  operator ebb_optim_t *() const { return o; }
};

struct Cfg {
  bool adam = false;
  double lr = 0.1, mom = 0, damp = 0, wd = 0, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  bool nesterov = false, amsgrad = false, maximize = false;
};

void make_optim(const Cfg &c, ebb_params_t *pl, Optim &o) {
  if (c.adam) {
    ebb_adamw_options a = ebb_adamw_defaults();
    a.lr = c.lr, a.beta1 = c.b1, a.beta2 = c.b2, a.eps = c.eps, a.weight_decay = c.wd, a.amsgrad = c.amsgrad, a.maximize = c.maximize;
    EBB_REQUIRE_OK(ebb_optim_adamw(pl, &a, &o.o));
  } else {
    ebb_sgd_options s{};
    s.lr = c.lr, s.momentum = c.mom, s.dampening = c.damp, s.weight_decay = c.wd, s.nesterov = c.nesterov, s.maximize = c.maximize;
    EBB_REQUIRE_OK(ebb_optim_sgd(pl, &s, &o.o));
  }
}

// The reference: PyTorch's single-tensor loops, op by op in f32 (torch/optim/sgd.py, adamw.py).
struct Ref {
  std::vector<float> p, b, m, v, vm;
  int64_t step = 0;
  void update(const Cfg &c, const std::vector<double> &gd) {
    const size_t n = p.size();
    step++;
    if (b.empty()) b.assign(n, 0), m.assign(n, 0), v.assign(n, 0), vm.assign(n, 0);
    const float lr = (float)c.lr, wd = (float)c.wd;
    if (!c.adam) {
      for (size_t i = 0; i < n; i++) {
        float g = (float)gd[i];
        float d = c.maximize ? -g : g;
        if (c.wd != 0) d = d + wd * p[i];
        if (c.mom != 0) {
          b[i] = step == 1 ? d : b[i] * (float)c.mom + (float)(1 - c.damp) * d;
          d = c.nesterov ? d + (float)c.mom * b[i] : b[i];
        }
        p[i] = p[i] + -lr * d;
      }
      return;
    }
    const double bc1 = 1 - std::pow(c.b1, (double)step), bc2 = 1 - std::pow(c.b2, (double)step);
    const float step_size = (float)(c.lr / bc1), bc2s = (float)std::sqrt(bc2);
    for (size_t i = 0; i < n; i++) {
      float g = c.maximize ? -(float)gd[i] : (float)gd[i];
      p[i] = p[i] * (float)(1 - c.lr * c.wd);
      m[i] = m[i] * (float)c.b1 + (float)(1 - c.b1) * g;
      v[i] = v[i] * (float)c.b2 + (float)(1 - c.b2) * (g * g);
      float vv = v[i];
      if (c.amsgrad) vv = vm[i] = std::max(vm[i], v[i]);
      float denom = std::sqrt(vv) / bc2s + (float)c.eps;
      p[i] = p[i] + -step_size * (m[i] / denom);
    }
  }
};

std::vector<double> as_double(const std::vector<float> &f) { return std::vector<double>(f.begin(), f.end()); }

// Numbers from torch 1.13 (Debian python3-torch, CPU, foreach=False), made with this loop:
//   p = torch.tensor(P0, dtype=dt, requires_grad=True); opt = <optimizer>([p])
//   for g in G: p.grad = torch.tensor(g, dtype=dt); opt.step()
//   print(', '.join('%.9g' % v for v in p.detach().double().tolist()))
const std::vector<double> P0 = {0.5, -1.5, 2.0, -0.25, 1.0, 0.0};
const std::vector<std::vector<double>> G = {
    {0.1, -0.2, 0.3, 0.4, -0.5, 0.05}, {-0.3, 0.1, 0.2, -0.1, 0.6, -0.05}, {0.25, 0.25, -0.4, 0.0, 0.1, 0.2}};

struct TorchCase {
  const char *name;
  Cfg cfg;
  ebb_dtype dt;
  std::vector<double> want;
};

std::vector<TorchCase> torch_cases() {
  Cfg plain, mom, nest, adam, ams;
  plain.lr = 0.1;                                               // SGD(lr=0.1)
  mom.lr = 0.1, mom.mom = 0.9, mom.damp = 0.1, mom.wd = 0.01;   // SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
  nest.lr = 0.1, nest.mom = 0.9, nest.nesterov = true, nest.wd = 0.01;  // SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
  adam.adam = true, adam.lr = 0.01, adam.wd = 0.1;              // AdamW(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
  ams.adam = true, ams.lr = 0.01, ams.wd = 0.01, ams.amsgrad = true;  // AdamW(lr=0.01, weight_decay=0.01, amsgrad=True)
  return {
      {"sgd", plain, EBB_F32, {0.495000035, -1.51499999, 1.99000001, -0.280000001, 0.979999959, -0.0200000014}},
      {"sgd momentum", mom, EBB_F32, {0.499051988, -1.47748673, 1.90998721, -0.339842409, 1.01846182, -0.0229869559}},
      {"sgd nesterov", nest, EBB_F32, {0.495387048, -1.49393702, 1.90294075, -0.358075649, 0.982016861, -0.0416115932}},
      {"adamw", adam, EBB_F32, {0.492491484, -1.48625541, 1.97405934, -0.267549753, 1.00364721, -0.0153419878}},
      {"adamw amsgrad", ams, EBB_F32, {0.493826419, -1.49028039, 1.9794265, -0.268244386, 1.00636089, -0.0153595041}},
      {"adamw bf16", adam, EBB_BF16, {0.49609375, -1.4921875, 1.984375, -0.267578125, 1.0078125, -0.0153808594}},
      {"sgd momentum bf16", mom, EBB_BF16, {0.5, -1.4765625, 1.9140625, -0.33984375, 1.015625, -0.0229492188}},
  };
}

Tensor param_on(int dev, ebb_dtype dt, const std::vector<double> &v, const char *name = nullptr) {
  Tensor t = make(dev, dt, {(int64_t)v.size()}, v);
  if (name) EBB_REQUIRE_OK(ebb_tensor_set_name(t, name));
  EBB_REQUIRE_OK(ebb_tensor_set_requires_grad(t, true));
  return t;
}

void set_grad(const ebb_tensor_t *p, ebb_dtype dt, const std::vector<double> &g) {
  int dev;
  EBB_REQUIRE_OK(ebb_tensor_device(p, &dev));
  Tensor t = make(dev, dt, {(int64_t)g.size()}, g);
  EBB_REQUIRE_OK(ebb_tensor_set_grad(const_cast<ebb_tensor_t *>(p), t));
}

uint64_t version_of(const ebb_tensor_t *t) {
  uint64_t v;
  EBB_REQUIRE_OK(ebb_tensor_version(t, &v));
  return v;
}

}  // namespace

TEST_CASE("optim: SGD and AdamW give torch 1.13's values after three steps, on the CPU and the devices", "[optim][torch]") {
  EbbSession session;
  Live live;
  {
    for (const auto &tc : torch_cases()) {
      for (int dev : devices()) {
        INFO(tc.name << " on " << dev_name(dev));
        Tensor p = param_on(dev, tc.dt, P0);
        Params pl;
        EBB_REQUIRE_OK(ebb_params_add(pl, p));
        Optim o;
        make_optim(tc.cfg, pl, o);
        for (const auto &g : G) {
          set_grad(p, tc.dt, g);
          EBB_REQUIRE_OK(ebb_optim_step(o));
        }
        // f32: the same ops in the same order, within a few ulps; bf16: within one bf16 ulp.
        double tol = tc.dt == EBB_BF16 ? 8e-3 : 2e-7;
        EBB_CHECK_CLOSE(read(p), tc.want, tol, tol);
        EBB_REQUIRE_OK(ebb_tensor_set_grad(p, nullptr));
      }
    }
  }
  live.check();
}

TEST_CASE("optim: five steps over several parameters match the reference loop, every variant", "[optim][reference]") {
  EbbSession session;
  Live live;
  {
    std::vector<Cfg> cfgs;
    Cfg c;
    c.lr = 0.05;
    cfgs.push_back(c);                                             // plain
    c.mom = 0.9, cfgs.push_back(c);                                // momentum
    c.damp = 0.25, c.wd = 0.02, cfgs.push_back(c);                 // dampening, weight decay
    c.damp = 0, c.nesterov = true, cfgs.push_back(c);              // nesterov
    c.maximize = true, cfgs.push_back(c);                          // maximize
    Cfg a;
    a.adam = true, a.lr = 0.003, a.wd = 0.05;
    cfgs.push_back(a);                                             // adamw
    a.amsgrad = true, cfgs.push_back(a);                           // amsgrad
    a.b1 = 0.5, a.b2 = 0.9, a.eps = 1e-3, a.maximize = true, cfgs.push_back(a);
    // Sizes: one element, a chunk and a bit (the CUDA chunking), an odd size.
    const std::vector<int64_t> sizes = {1, 65536 + 3, 999};
    for (size_t ci = 0; ci < cfgs.size(); ci++) {
      for (int dev : devices()) {
        INFO("config " << ci << " on " << dev_name(dev));
        Params pl;
        std::vector<Tensor> ps;
        std::vector<Ref> refs(sizes.size());
        for (size_t k = 0; k < sizes.size(); k++) {
          auto v = values(sizes[k], (unsigned)(7 + k));
          ps.push_back(param_on(dev, EBB_F32, v));
          refs[k].p.assign(v.begin(), v.end());
          for (auto &x : refs[k].p) x = (float)x;
          EBB_REQUIRE_OK(ebb_params_add(pl, ps.back()));
        }
        Optim o;
        make_optim(cfgs[ci], pl, o);
        for (int s = 0; s < 5; s++) {
          for (size_t k = 0; k < sizes.size(); k++) {
            auto g = values(sizes[k], (unsigned)(100 * s + k), -2.0, 2.0);
            set_grad(ps[k], EBB_F32, g);
            refs[k].update(cfgs[ci], g);
          }
          EBB_REQUIRE_OK(ebb_optim_step(o));
        }
        for (size_t k = 0; k < sizes.size(); k++) EBB_CHECK_CLOSE(read(ps[k]), as_double(refs[k].p), 1e-6, 1e-5);
        int64_t n = 0;
        EBB_REQUIRE_OK(ebb_optim_step_count(o, -1, &n));
        CHECK(n == 5);
        for (auto &p : ps) EBB_REQUIRE_OK(ebb_tensor_set_grad(p, nullptr));
      }
    }
  }
  live.check();
}

TEST_CASE("optim: f64 parameters are updated in f64, bf16 in f32 arithmetic near the f32 result", "[optim][dtypes]") {
  EbbSession session;
  Live live;
  {
    for (int dev : devices()) {
      INFO(dev_name(dev));
      Cfg a;
      a.adam = true, a.lr = 0.01, a.wd = 0.1;
      auto v = values(300, 3);
      Tensor p64 = param_on(dev, EBB_F64, v), p16 = param_on(dev, EBB_BF16, v), p32 = param_on(dev, EBB_F32, v);
      Params pl;
      for (ebb_tensor_t *t : {p64.get(), p16.get(), p32.get()}) EBB_REQUIRE_OK(ebb_params_add(pl, t));
      Optim o;
      make_optim(a, pl, o);
      // f64 reference: the same formula in doubles.
      std::vector<double> p = v, m(v.size(), 0), vv(v.size(), 0);
      for (int s = 1; s <= 3; s++) {
        auto g = values(300, 50 + s);
        for (ebb_tensor_t *t : {p64.get(), p16.get(), p32.get()}) set_grad(t, dtype_of(t), g);
        EBB_REQUIRE_OK(ebb_optim_step(o));
        double bc1 = 1 - std::pow(0.9, s), bc2 = 1 - std::pow(0.999, s);
        for (size_t i = 0; i < p.size(); i++) {
          p[i] *= 1 - 0.01 * 0.1;
          m[i] = m[i] * 0.9 + 0.1 * g[i];
          vv[i] = vv[i] * 0.999 + 0.001 * g[i] * g[i];
          p[i] += -(0.01 / bc1) * (m[i] / (std::sqrt(vv[i]) / std::sqrt(bc2) + 1e-8));
        }
      }
      EBB_CHECK_CLOSE(read(p64), p, 1e-13, 1e-12);
      EBB_CHECK_CLOSE(read(p32), p, 1e-6, 1e-5);
      EBB_CHECK_CLOSE(read(p16), p, 2e-2, 1e-2);
      // State keeps the parameter's dtype and device.
      Tensor m16;
      EBB_REQUIRE_OK(ebb_optim_state(o, 1, "exp_avg", m16.out()));
      REQUIRE(m16.get() != nullptr);
      CHECK(dtype_of(m16) == EBB_BF16);
      int sd;
      EBB_REQUIRE_OK(ebb_tensor_device(m16, &sd));
      CHECK(sd == dev);
      for (ebb_tensor_t *t : {p64.get(), p16.get(), p32.get()}) EBB_REQUIRE_OK(ebb_tensor_set_grad(t, nullptr));
    }
  }
  live.check();
}

TEST_CASE("optim: a step after backward reads .grad, skips parameters without one, and records nothing", "[optim][grad]") {
  EbbSession session;
  Live live;
  {
    for (int dev : devices()) {
      INFO(dev_name(dev));
      Tensor w = param_on(dev, EBB_F32, {1.0, -2.0, 3.0}, "w"), u = param_on(dev, EBB_F32, {5.0, 6.0}, "u");
      Params pl;
      EBB_REQUIRE_OK(ebb_params_add(pl, w));
      EBB_REQUIRE_OK(ebb_params_add(pl, u));
      Optim o;
      ebb_sgd_options s{};
      s.lr = 0.5;
      EBB_REQUIRE_OK(ebb_optim_sgd(pl, &s, &o.o));
      // loss = sum(w * w): grad 2w; u takes no part and has no .grad.
      {
        Tensor sq;
        EBB_REQUIRE_OK(ebb_op_mul(w, w, sq.out()));
        Tensor l = sum_of(sq);
        EBB_REQUIRE_OK(ebb_backward_one(l));
      }
      uint64_t vw = version_of(w), vu = version_of(u);
      EBB_REQUIRE_OK(ebb_optim_step(o));
      EBB_CHECK_CLOSE(read(w), (std::vector<double>{0.0, 0.0, 0.0}), 0, 0);
      EBB_CHECK_CLOSE(read(u), (std::vector<double>{5.0, 6.0}), 0, 0);
      CHECK(version_of(w) == vw + 1);
      CHECK(version_of(u) == vu);
      int64_t n = -1;
      EBB_REQUIRE_OK(ebb_optim_step_count(o, 0, &n));
      CHECK(n == 1);
      EBB_REQUIRE_OK(ebb_optim_step_count(o, 1, &n));
      CHECK(n == 0);
      // The step made no node: w is still a leaf.
      bool leaf = false;
      EBB_REQUIRE_OK(ebb_tensor_is_leaf(w, &leaf));
      CHECK(leaf);
      // grad mode is left as it was
      CHECK(ebb_grad_enabled());
      // zero_grad to zeros keeps the tensor, to none drops it
      Tensor g0;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g0.out()));
      EBB_REQUIRE_OK(ebb_optim_zero_grad(o, false));
      Tensor g1;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g1.out()));
      CHECK(g1.get() == g0.get());
      EBB_CHECK_CLOSE(read(g1), (std::vector<double>{0, 0, 0}), 0, 0);
      EBB_REQUIRE_OK(ebb_optim_zero_grad(o, true));
      Tensor g2;
      EBB_REQUIRE_OK(ebb_tensor_grad(w, g2.out()));
      CHECK(g2.get() == nullptr);
    }
  }
  live.check();
}

TEST_CASE("optim: a node that saved a parameter refuses to run after a step changed it", "[optim][version]") {
  EbbSession session;
  Live live;
  {
    Tensor w = param_on(EBB_DEVICE_CPU, EBB_F32, {1.0, 2.0}, "w");
    Params pl;
    EBB_REQUIRE_OK(ebb_params_add(pl, w));
    Optim o;
    ebb_sgd_options s{};
    s.lr = 0.1;
    EBB_REQUIRE_OK(ebb_optim_sgd(pl, &s, &o.o));
    Tensor sq;
    EBB_REQUIRE_OK(ebb_op_mul(w, w, sq.out()));  // saves w
    Tensor l = sum_of(sq);
    set_grad(w, EBB_F32, {1.0, 1.0});
    EBB_REQUIRE_OK(ebb_optim_step(o));
    EBB_CHECK_MSG(ebb_backward_one(l), EBB_ESTATE, "MulBackward", "modified in place");
    EBB_REQUIRE_OK(ebb_tensor_set_grad(w, nullptr));
  }
  live.check();
}

TEST_CASE("optim: groups keep their own lr and weight decay, lr changes between steps, state appears at the first update",
          "[optim][groups]") {
  EbbSession session;
  Live live;
  {
    Tensor a = param_on(EBB_DEVICE_CPU, EBB_F32, {1.0, 1.0}), b = param_on(0, EBB_F32, {1.0, 1.0});
    Params pl;
    int g = -1;
    EBB_REQUIRE_OK(ebb_params_add(pl, a));
    EBB_REQUIRE_OK(ebb_params_add_group(pl, 0.5, 0.0, &g));
    CHECK(g == 1);
    EBB_REQUIRE_OK(ebb_params_add_to(pl, g, b));
    int n = 0;
    EBB_REQUIRE_OK(ebb_params_count(pl, &n));
    CHECK(n == 2);
    Optim o;
    ebb_sgd_options s{};
    s.lr = 0.1, s.momentum = 0.5;
    EBB_REQUIRE_OK(ebb_optim_sgd(pl, &s, &o.o));
    Tensor st;
    EBB_REQUIRE_OK(ebb_optim_state(o, 0, "momentum_buffer", st.out()));
    CHECK(st.get() == nullptr);
    set_grad(a, EBB_F32, {1.0, 1.0});
    set_grad(b, EBB_F32, {1.0, 1.0});
    EBB_REQUIRE_OK(ebb_optim_step(o));
    EBB_CHECK_CLOSE(read(a), (std::vector<double>{0.9, 0.9}), 1e-7, 1e-7);
    EBB_CHECK_CLOSE(read(b), (std::vector<double>{0.5, 0.5}), 1e-7, 1e-7);
    EBB_REQUIRE_OK(ebb_optim_state(o, 0, "momentum_buffer", st.out()));
    REQUIRE(st.get() != nullptr);
    EBB_CHECK_CLOSE(read(st), (std::vector<double>{1.0, 1.0}), 0, 0);
    // buf = 0.5 * 1 + 1 = 1.5; every group's lr set to 0.2
    EBB_REQUIRE_OK(ebb_optim_set_lr(o, -1, 0.2));
    double lr = 0;
    EBB_REQUIRE_OK(ebb_optim_lr(o, 1, &lr));
    CHECK(lr == 0.2);
    EBB_REQUIRE_OK(ebb_optim_step(o));
    EBB_CHECK_CLOSE(read(a), (std::vector<double>{0.6, 0.6}), 1e-6, 1e-6);
    EBB_CHECK_CLOSE(read(b), (std::vector<double>{0.2, 0.2}), 1e-6, 1e-6);
    // The list may go: the optimizer has its own copy.
    EBB_REQUIRE_OK(ebb_params_destroy(pl.pl));
    pl.pl = nullptr;
    EBB_REQUIRE_OK(ebb_optim_step(o));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(a, nullptr));
    EBB_REQUIRE_OK(ebb_tensor_set_grad(b, nullptr));
  }
  live.check();
}

TEST_CASE("optim: on a device the step runs on the current stream, after the work already there", "[optim][streams]") {
  EbbSession session;
  Live live;
  {
    ebb_stream_t *s = nullptr;
    EBB_REQUIRE_OK(ebb_stream_create(0, EBB_PRIO_LOW, &s));
    ebb_stream_t *prev = nullptr;
    EBB_REQUIRE_OK(ebb_stream_current(0, &prev));
    EBB_REQUIRE_OK(ebb_stream_set_current(s));
    {
      Cfg a;
      a.adam = true, a.lr = 0.01;
      for (int round = 0; round < 4; round++) {
        auto v = values(70000, 11 + round);
        Tensor p = param_on(0, EBB_F32, v), q = param_on(0, EBB_F64, v);
        Params pl;
        EBB_REQUIRE_OK(ebb_params_add(pl, p));
        EBB_REQUIRE_OK(ebb_params_add(pl, q));
        Optim o;
        make_optim(a, pl, o);
        Ref r;
        r.p.assign(v.begin(), v.end());
        for (int k = 0; k < 3; k++) {
          auto g = values(70000, 200 + k);
          // the gradients are written on this stream just before the step reads them
          Tensor gp = make(0, EBB_F32, {70000}, g), gq = make(0, EBB_F64, {70000}, g);
          const ebb_tensor_t *gs[2] = {gp.get(), gq.get()};
          EBB_REQUIRE_OK(ebb_optim_step_grads(o, gs, 2));
          r.update(a, g);
        }
        EBB_CHECK_CLOSE(read(p), as_double(r.p), 1e-6, 1e-5);
        EBB_CHECK_CLOSE(read(q), as_double(r.p), 1e-5, 1e-4);
      }
    }
    EBB_REQUIRE_OK(ebb_stream_set_current(prev));
    EBB_REQUIRE_OK(ebb_stream_release(s));
  }
  live.check();
}

TEST_CASE("optim: a step launches one kernel per device and dtype, whatever the number of parameters", "[optim][launches]") {
  EbbSession session;
  EBB_NEED_DEVICES(2);
  Live live;
  {
    // Device 0: three f32 parameters and one bf16; device 1: two f32; the CPU: one (no launch).
    Params pl;
    std::vector<Tensor> ps;
    struct Spec {
      int dev;
      ebb_dtype dt;
    };
    const Spec specs[] = {{0, EBB_F32}, {0, EBB_F32}, {1, EBB_F32}, {0, EBB_BF16}, {0, EBB_F32}, {1, EBB_F32}, {EBB_DEVICE_CPU, EBB_F32}};
    for (const auto &s : specs) {
      ps.push_back(param_on(s.dev, s.dt, values(100, (unsigned)ps.size())));
      set_grad(ps.back(), s.dt, values(100, 77));
      EBB_REQUIRE_OK(ebb_params_add(pl, ps.back()));
    }
    Optim o;
    Cfg a;
    a.adam = true;
    make_optim(a, pl, o);
    EBB_REQUIRE_OK(ebb_trace_enable(4096));
    EBB_REQUIRE_OK(ebb_optim_step(o));
    std::vector<ebb_trace_span> spans(4096);
    size_t n = 0;
    EBB_REQUIRE_OK(ebb_trace_snapshot(spans.data(), spans.size(), &n));
    ebb_trace_disable();
    int on0 = 0, on1 = 0, other = 0;
    for (size_t i = 0; i < n; i++) {
      if (std::string(spans[i].name) != "ebb.ops.optim") continue;
      if (spans[i].device == 0) on0++;
      else if (spans[i].device == 1) on1++;
      else other++;
    }
    CHECK(on0 == 2);  // f32 and bf16
    CHECK(on1 == 1);
    CHECK(other == 0);
    for (auto &p : ps) EBB_REQUIRE_OK(ebb_tensor_set_grad(p, nullptr));
  }
  live.check();
}
