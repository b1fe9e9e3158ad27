// AdamW update and the squared-norm reduction: the CPU reference against the textbook formula in
// double, CUDA against the CPU over edge sizes, determinism, and the AdamW class end to end.
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/adamw.h"
#include "tests/support/checks.h"
#include "train/optimizer.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

AdamWStep make_step(int t, float lr, float wd, float grad_scale) {
  AdamWStep s;
  s.lr = lr;
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.eps = 1e-8f;
  s.weight_decay = wd;
  s.grad_scale = grad_scale;
  s.bias_correction1 = float(1 - std::pow(0.9, t));
  s.bias_correction2 = float(1 - std::pow(0.95, t));
  return s;
}

std::vector<float> floats(const Tensor& t) { return t.to_floats(); }

}  // namespace

// Loshchilov & Hutter, Algorithm 2, in double: m, v, bias corrections, decoupled decay.
TEST(AdamW, CpuMatchesTextbookFormula) {
  Rng rng(test_seed());
  const int64_t n = 1000;
  std::vector<float> p = floats(random_tensor(rng, {n})), m(n, 0.f), v(n, 0.f);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0), vd(n, 0);
  const double lr = 3e-3, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, scale = 0.7;
  for (int t = 1; t <= 5; ++t) {
    std::vector<float> g = floats(random_tensor(rng, {n}, DType::f32, Device::cpu(), -2, 2));
    adamw_cpu(p.data(), g.data(), m.data(), v.data(), n, make_step(t, float(lr), float(wd), float(scale)));
    for (int64_t i = 0; i < n; ++i) {
      double gi = scale * g[size_t(i)];
      md[size_t(i)] = b1 * md[size_t(i)] + (1 - b1) * gi;
      vd[size_t(i)] = b2 * vd[size_t(i)] + (1 - b2) * gi * gi;
      double mhat = md[size_t(i)] / (1 - std::pow(b1, t)), vhat = vd[size_t(i)] / (1 - std::pow(b2, t));
      pd[size_t(i)] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * pd[size_t(i)]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[size_t(i)], pd[size_t(i)], 1e-6 * (1 + std::fabs(pd[size_t(i)]))) << "param " << i;
    ASSERT_NEAR(m[size_t(i)], md[size_t(i)], 1e-6) << "exp_avg " << i;
    ASSERT_NEAR(v[size_t(i)], vd[size_t(i)], 1e-6) << "exp_avg_sq " << i;
  }
}

TEST(AdamW, SumSquaresCpu) {
  std::vector<float> x = {3, 4, -12};
  EXPECT_DOUBLE_EQ(sum_squares_cpu(x.data(), 3), 169.0);
  EXPECT_DOUBLE_EQ(sum_squares_cpu(x.data(), 0), 0.0);
  x[1] = NAN;
  EXPECT_TRUE(std::isnan(sum_squares_cpu(x.data(), 3)));
}

TEST(AdamW, OptimizerClassOnCpu) {
  Rng rng(test_seed());
  Variable w(random_tensor(rng, {4, 5}), true, "w"), b(random_tensor(rng, {5}), true, "b");
  Tensor gw = random_tensor(rng, {4, 5}), gb = random_tensor(rng, {5});
  w.set_grad(gw.clone());
  b.set_grad(gb.clone());
  OptimizerConfig cfg;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.weight_decay = 0.5;
  AdamW opt({w, b}, cfg);
  double want = std::sqrt(sum_squares_cpu(gw.data<float>(), 20) + sum_squares_cpu(gb.data<float>(), 5));
  EXPECT_NEAR(opt.grad_norm(), want, 1e-12);
  // Reference: the kernel on copies; weight decay only on the matrix.
  std::vector<float> pw = floats(w.data()), pb = floats(b.data()), m(20, 0), v(20, 0), mb(5, 0), vb(5, 0);
  adamw_cpu(pw.data(), gw.data<float>(), m.data(), v.data(), 20, make_step(1, 0.01f, 0.5f, 0.25f));
  adamw_cpu(pb.data(), gb.data<float>(), mb.data(), vb.data(), 5, make_step(1, 0.01f, 0.0f, 0.25f));
  opt.step(0.01, 0.25);
  EXPECT_EQ(opt.num_updates(), 1);
  EXPECT_EQ(floats(w.data()), pw);
  EXPECT_EQ(floats(b.data()), pb);
  EXPECT_EQ(floats(opt.exp_avg()[0]), m);
  // A parameter without a gradient is left alone; the norm counts it as zero.
  opt.zero_grad();
  b.set_grad(gb.clone());
  std::vector<float> before = floats(w.data());
  EXPECT_NEAR(opt.grad_norm(), std::sqrt(sum_squares_cpu(gb.data<float>(), 5)), 1e-12);
  opt.step(0.01, 1.0);
  EXPECT_EQ(floats(w.data()), before);
  Variable bad(Tensor::zeros({3}, DType::f64), true, "f64");
  EXPECT_THROW(AdamW({bad}, cfg), DTypeError);
}

// optimizer.router_lr_scale: the MoE routers' gate weights (and only they) step with lr * scale.
TEST(AdamW, RouterLearningRateScale) {
  Rng rng(test_seed());
  const std::vector<std::string> names = {"model.layers.1.mlp.gate.weight", "model.layers.0.mlp.gate_proj.weight",
                                          "model.layers.1.mlp.gate.e_score_correction_bias"};
  Tensor init = random_tensor(rng, {3, 4}), grad = random_tensor(rng, {3, 4});
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  cfg.router_lr_scale = 0.25;
  std::vector<Variable> ps;
  for (const std::string& n : names) {
    ps.push_back(Variable(init.clone(), true, n));
    ps.back().set_grad(grad.clone());
  }
  AdamW opt(ps, cfg);
  opt.step(0.01, 1.0);
  std::vector<float> router = floats(init), other = floats(init), m(12, 0), v(12, 0), m2(12, 0), v2(12, 0);
  adamw_cpu(router.data(), grad.data<float>(), m.data(), v.data(), 12, make_step(1, 0.0025f, 0.1f, 1.0f));
  adamw_cpu(other.data(), grad.data<float>(), m2.data(), v2.data(), 12, make_step(1, 0.01f, 0.1f, 1.0f));
  EXPECT_EQ(floats(ps[0].data()), router);
  EXPECT_EQ(floats(ps[1].data()), other);  // the dense MLP's gate_proj is not a router
  EXPECT_EQ(floats(ps[2].data()), other);  // nor is a name that only contains ".mlp.gate."
  EXPECT_NE(router, other);
  // The scheduled form (the step's scalars, as the trainer's step control gives them) scales it the same.
  std::vector<Variable> qs;
  for (const std::string& n : names) {
    qs.push_back(Variable(init.clone(), true, n));
    qs.back().set_grad(grad.clone());
  }
  AdamW scheduled(qs, cfg);
  StepScalars c{};
  c.apply = 1;
  c.lr = 0.01;
  c.grad_scale = 1.0;
  c.bias_correction1 = float(1 - cfg.beta1);
  c.bias_correction2 = float(1 - cfg.beta2);
  scheduled.step(&c);
  EXPECT_EQ(floats(qs[0].data()), router);
  EXPECT_EQ(floats(qs[1].data()), other);
  EXPECT_EQ(floats(qs[2].data()), other);
}

// Master weights (a sharded optimizer's, parallel/grad_reducer.h): AdamW updates the masters of the ranges and
// writes the parameters' elements there from them; the same values as the in-place update of whole f32
// parameters. A master of the wrong length is refused, naming the parameter.
TEST(AdamW, MastersOfRangesUpdateAsWholeParameters) {
  Rng rng(test_seed());
  const Tensor w0 = random_tensor(rng, {4, 5}), g = random_tensor(rng, {4, 5});
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  Variable whole(w0.clone(), true, "w");
  whole.set_grad(g.clone());
  AdamW plain({whole}, cfg);
  plain.step(0.01, 1.0);
  Variable copy(w0.clone(), true, "w");  // the model's weights: only [6, 15) is this rank's to write
  Tensor master = w0.reshape({20}).slice(0, 6, 15).clone();
  AdamW sharded({copy}, cfg, {{6, 15}}, {master});
  sharded.set_range_grads({g.reshape({20}).slice(0, 6, 15).clone()});
  sharded.step(0.01, 1.0);
  const std::vector<float> want = floats(whole.data()), got = floats(copy.data()), before = floats(w0);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(got[size_t(i)], i >= 6 && i < 15 ? want[size_t(i)] : before[size_t(i)]) << i;
  EXPECT_EQ(floats(master), std::vector<float>(want.begin() + 6, want.begin() + 15));
  EXPECT_TRUE(throws_naming<Error>(
      [&] {
        AdamW({copy}, cfg, {{6, 15}}, {Tensor::zeros({8}, DType::f32)});
      },
      {"master", "'w'", "[9]"}));
  EXPECT_THROW(AdamW({copy}, cfg, {}, {master}), Error);  // without ranges a master is the whole parameter
}

// Whole masters (precision.param_dtype auto in one process): a bf16 parameter with an f32 master of all its
// elements steps as the f32 parameter does and holds the update's cast; a parameter without a master (undefined)
// is its own master, as without masters; a bf16 parameter needs one.
TEST(AdamW, WholeMastersUpdateAsF32Parameters) {
  Rng rng(test_seed());
  const Tensor w0 = random_tensor(rng, {4, 5}), b0 = random_tensor(rng, {5}), g = random_tensor(rng, {4, 5});
  const Tensor gb = random_tensor(rng, {5});
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  Variable w(w0.clone(), true, "w"), b(b0.clone(), true, "b");
  AdamW plain({w, b}, cfg);
  Variable w16(w0.to(DType::bf16), true, "w"), b32(b0.clone(), true, "b");
  Tensor master = w0.reshape({20}).clone();
  AdamW narrow({w16, b32}, cfg, {}, {master, Tensor()});
  for (int t = 0; t < 3; ++t) {
    for (Variable* v : {&w, &w16}) v->set_grad(g.clone());
    for (Variable* v : {&b, &b32}) v->set_grad(gb.clone());
    plain.step(0.01, 1.0);
    narrow.step(0.01, 1.0);
  }
  EXPECT_EQ(floats(master), floats(w.data()));
  EXPECT_EQ(floats(w16.data()), floats(w.data().to(DType::bf16)));
  EXPECT_EQ(floats(b32.data()), floats(b.data()));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { AdamW({w16, b32}, cfg, {}, {Tensor(), Tensor()}); }, {"'w'", "bf16"}));
}

TEST(AdamWCuda, UpdateMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t n : {0, 1, 255, 4097, 1 << 20}) {
    SCOPED_TRACE(n);
    Tensor p = random_tensor(rng, {n}), g = random_tensor(rng, {n}, DType::f32, Device::cpu(), -3, 3);
    Tensor m = random_tensor(rng, {n}, DType::f32, Device::cpu(), -0.1, 0.1);
    Tensor v = random_tensor(rng, {n}, DType::f32, Device::cpu(), 0, 0.1);
    Tensor gp = p.to(Device::cuda()), gg = g.to(Device::cuda()), gm = m.to(Device::cuda()), gv = v.to(Device::cuda());
    AdamWStep s = make_step(3, 1e-3f, 0.1f, 0.5f);
    adamw_cpu(p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), n, s);
    adamw_cuda(gp.data<float>(), gg.data<float>(), gm.data<float>(), gv.data<float>(), n, s, current_stream(0));
    EXPECT_TRUE(all_close(gp, p, 1e-5, 1e-7));
    EXPECT_TRUE(all_close(gm, m, 1e-6, 1e-8));
    EXPECT_TRUE(all_close(gv, v, 1e-6, 1e-8));
  }
}

// The weights' copy (a sharded optimizer's model weights): the updated parameter exactly as a cast of it
// gives, in f32 or bf16, on the CPU and on the GPU; the update itself is the one without a copy.
TEST(AdamW, WeightCopyIsTheCastOfTheUpdate) {
  Rng rng(test_seed());
  const bool cuda = cuda_available();
  for (int64_t n : {0, 1, 255, 4097}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::to_string(n) + " " + dtype_name(dtype));
      Tensor p = random_tensor(rng, {n}), g = random_tensor(rng, {n}, DType::f32, Device::cpu(), -3, 3);
      Tensor m = Tensor::zeros({n}, DType::f32), v = Tensor::zeros({n}, DType::f32);
      const AdamWStep s = make_step(1, 1e-2f, 0.1f, 0.5f);
      Tensor plain = p.clone(), pm = m.clone(), pv = v.clone();
      adamw_cpu(plain.data<float>(), g.data<float>(), pm.data<float>(), pv.data<float>(), n, s);
      Tensor copy = Tensor::zeros({n}, dtype);
      adamw_cpu(p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), n, s, {copy.raw_data(), dtype});
      EXPECT_EQ(floats(p), floats(plain));
      EXPECT_EQ(floats(copy), floats(p.to(dtype)));
      if (!cuda) continue;
      // Three steps, the second skipped (step_control.h: apply false): no copy is written then either.
      Tensor gp = random_tensor(rng, {n}).to(Device::cuda()), gg = g.to(Device::cuda());
      Tensor gm = Tensor::zeros({n}, DType::f32, Device::cuda()), gv = Tensor::zeros({n}, DType::f32, Device::cuda());
      Tensor gcopy = Tensor::zeros({n}, dtype, Device::cuda());
      Tensor cp = gp.to(Device::cpu()), cm = Tensor::zeros({n}, DType::f32), cv = Tensor::zeros({n}, DType::f32);
      Tensor control = Tensor::zeros({int64_t(sizeof(StepScalars))}, DType::u8);
      for (int t = 1; t <= 3; ++t) {
        StepScalars c{};
        c.apply = t != 2;
        c.lr = 1e-2;
        c.grad_scale = 0.5;
        c.bias_correction1 = float(1 - std::pow(0.9, t));
        c.bias_correction2 = float(1 - std::pow(0.95, t));
        std::memcpy(control.raw_data(), &c, sizeof c);
        const Tensor on_device = control.to(Device::cuda());
        if (t == 2) gcopy.zero_();
        adamw_scheduled_cuda(gp.data<float>(), gg.data<float>(), gm.data<float>(), gv.data<float>(), n, s,
                             reinterpret_cast<const StepScalars*>(on_device.raw_data()), 1.0, current_stream(0),
                             {gcopy.raw_data(), dtype});
        if (c.apply)
          adamw_cpu(cp.data<float>(), g.data<float>(), cm.data<float>(), cv.data<float>(), n,
                    scheduled_adamw_step(s, c, 1.0));
        if (t == 2) {
          EXPECT_EQ(floats(gcopy), floats(Tensor::zeros({n}, dtype))) << "a skipped step wrote the copy";
        }
      }
      EXPECT_TRUE(all_close(gp, cp, 1e-5, 1e-7));
      EXPECT_EQ(floats(gcopy), floats(gp.to(dtype)));  // the copy is the device's own update, cast
    }
  }
}

TEST(AdamWCuda, SumSquaresMatchesCpuAndIsDeterministic) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor partials = Tensor::zeros({kReduceMaxBlocks}, DType::f32, Device::cuda());
  Tensor out = Tensor::zeros({1}, DType::f32, Device::cuda());
  for (int64_t n : {0, 1, 31, 1000, 4097, (1 << 20) + 3, 5 << 20}) {
    SCOPED_TRACE(n);
    Tensor x = random_tensor(rng, {n});
    Tensor gx = x.to(Device::cuda());
    sum_squares_cuda(gx.data<float>(), n, out.data<float>(), partials.data<float>(), current_stream(0));
    float first = out.to_floats()[0];
    double want = sum_squares_cpu(x.data<float>(), n);
    EXPECT_NEAR(first, want, 1e-5 * want + 1e-30);
    for (int rep = 0; rep < 3; ++rep) {
      sum_squares_cuda(gx.data<float>(), n, out.data<float>(), partials.data<float>(), current_stream(0));
      float again = out.to_floats()[0];
      EXPECT_EQ(std::memcmp(&again, &first, sizeof first), 0) << "run " << rep << " differs";
    }
    sum_values_cuda(gx.data<float>(), n, out.data<float>(), partials.data<float>(), current_stream(0));
    double plain = 0;
    for (float f : floats(x)) plain += f;
    EXPECT_NEAR(out.to_floats()[0], plain, 1e-4 * std::sqrt(double(n)) + 1e-6);
  }
  Tensor x = Tensor::from_floats({1, 2, NAN, 4}, {4}, DType::f32, Device::cuda());
  sum_squares_cuda(x.data<float>(), 4, out.data<float>(), partials.data<float>(), current_stream(0));
  EXPECT_TRUE(std::isnan(out.to_floats()[0])) << "a NaN gradient must show in the norm";
}

// More parameters than one multi-tensor launch takes (kernels/adamw.h): matrices that decay, vectors that do not,
// a router at its own learning rate, a size of one; norms included.
TEST(AdamWCuda, OptimizerClassMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::vector<Tensor> init, grads;
  std::vector<std::string> names;
  for (int i = 0; i < 2 * kTensorsPerLaunch + 7; ++i) {
    const int64_t n = (i * 37) % 300 + 1;
    const Shape shape = i % 2 ? Shape{3, n} : Shape{n};
    init.push_back(random_tensor(rng, shape));
    grads.push_back(random_tensor(rng, shape));
    std::string name = "p";  // appended, not "p" + ...: GCC 12's -Wrestrict false positive
    name += std::to_string(i);
    names.push_back(i == 5 ? "layers.0.mlp.gate.weight" : name);
  }
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  cfg.router_lr_scale = 0.5;
  auto run = [&](Device dev, double* norm) {
    std::vector<Variable> ps;
    for (size_t i = 0; i < init.size(); ++i) ps.push_back(Variable(init[i].to(dev).clone(), true, names[i]));
    AdamW opt(ps, cfg);
    for (int t = 0; t < 3; ++t) {
      for (size_t i = 0; i < ps.size(); ++i) ps[i].set_grad(grads[i].to(dev).clone());
      *norm = opt.grad_norm();
      opt.step(1e-2, clip_scale(*norm, 1.0));
    }
    return ps;
  };
  double cpu_norm = 0, gpu_norm = 0;
  auto cpu = run(Device::cpu(), &cpu_norm);
  auto gpu = run(Device::cuda(), &gpu_norm);
  EXPECT_NEAR(gpu_norm, cpu_norm, 1e-5 * cpu_norm);
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(all_close(gpu[i].data(), cpu[i].data(), 1e-5, 1e-6)) << i;
}
