// Torch bindings of the native kernels (torch.ops.specmoe_kernels.*): the ISA choice and its self-test, the
// dense product `linear`, and `moe`, every routed assignment of one MoE layer's slot group in one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "gemv.h"

namespace smk {
namespace {

// `blas_rows` (an op argument): rows per weight above which a product takes the BLAS path (prefill: faster, but a
// row's bits then depend on how many rows came with it); 0: never (a deterministic model)

struct Isa {
  std::string name = "ref";
  KernelFn fn = nullptr;
  std::string note;
};

bool cpu_has(const char* what) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (!std::strcmp(what, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                         __builtin_cpu_supports("f16c");
  if (!std::strcmp(what, "avx512")) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  (void)what;
  return false;
}

// The SIMD kernel against the portable one on small random problems of every format (row tails, odd outputs,
// k tails, biases): a path that disagrees is not used on this machine.
bool self_test(KernelFn fn, std::string* why) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t K = 224, N = 11, G = 32;  // K: 14 vectors of 16 (int4: whole groups); the others use Kt
  const int64_t Kt = 200;                 // 12 vectors of 16 + a tail of 8
  std::vector<float> x(7 * K), wf(N * K), bias(N), scale(N), y0(7 * N), y1(7 * N);
  for (auto& v : x) v = u(rng);
  for (auto& v : wf) v = u(rng);
  for (auto& v : bias) v = u(rng);
  for (auto& v : scale) v = 0.01f + std::fabs(u(rng));
  std::vector<uint16_t> w16(N * K), gs(N * K / G, 0x2000);  // fp16 0x2000: 2^-7
  std::vector<uint8_t> w8(N * K), w4(N * K / 2);
  for (int64_t i = 0; i < N * K; ++i) {
    uint32_t b;
    std::memcpy(&b, &wf[i], 4);
    w16[i] = uint16_t(b >> 16);
    w8[i] = uint8_t(int8_t(std::lround(wf[i] * 127)));
  }
  for (int64_t i = 0; i < N * K / 2; ++i) w4[i] = uint8_t(rng() & 0xff);
  const char* names[] = {"f32", "bf16", "i8", "i4"};
  for (int f = 0; f < 4; ++f) {
    Weight W;
    W.bias = bias.data();
    int64_t k = Kt;  // columns used (rows keep their stride K)
    if (f == 0) { W.fmt = F32; W.w = reinterpret_cast<const uint8_t*>(wf.data()); W.ld_bytes = 4 * K; }
    if (f == 1) { W.fmt = BF16; W.w = reinterpret_cast<const uint8_t*>(w16.data()); W.ld_bytes = 2 * K; }
    if (f == 2) { W.fmt = I8; W.w = w8.data(); W.ld_bytes = K; W.row_scale = scale.data(); }
    if (f == 3) { W.fmt = I4; W.w = w4.data(); W.ld_bytes = K / 2; W.gscale = gs.data(); W.group = G; k = K; }
    for (int64_t m = 1; m <= 7; ++m) {
      kernel_ref()(x.data(), K, m, W, k, 0, N, y0.data(), N);
      fn(x.data(), K, m, W, k, 0, N, y1.data(), N);
      for (int64_t i = 0; i < m * N; ++i) {
        if (!(std::fabs(y0[i] - y1[i]) <= 1e-4f * (1.f + std::fabs(y0[i])))) {
          *why = std::string("self-test failed on ") + names[f];
          return false;
        }
      }
    }
  }
  return true;
}

std::mutex isa_mu;
Isa* isa_state = nullptr;

Isa choose(const std::string& want) {
  Isa isa;
  isa.fn = kernel_ref();
  struct Cand { const char* name; KernelFn (*get)(); };
  const Cand cands[] = {{"avx512", kernel_avx512}, {"avx2", kernel_avx2}};
  for (const auto& c : cands) {
    if (want != "auto" && want != c.name) continue;
    if (!cpu_has(c.name)) {
      if (want == c.name) isa.note = std::string("this CPU lacks ") + c.name;
      continue;
    }
    std::string why;
    KernelFn fn = c.get();
    if (!self_test(fn, &why)) {
      isa.note += (isa.note.empty() ? "" : "; ") + std::string(c.name) + ": " + why;
      continue;
    }
    isa.name = c.name;
    isa.fn = fn;
    return isa;
  }
  return isa;
}

const Isa& current() {
  std::lock_guard<std::mutex> g(isa_mu);
  if (!isa_state) isa_state = new Isa(choose("auto"));
  return *isa_state;
}

std::string isa_info() {
  const Isa& i = current();
  return i.note.empty() ? i.name : i.name + " (" + i.note + ")";
}

std::string set_isa(std::string want) {
  Isa next = choose(want);
  std::lock_guard<std::mutex> g(isa_mu);
  delete isa_state;
  isa_state = new Isa(next);
  return next.note.empty() ? next.name : next.name + " (" + next.note + ")";
}

int bias_fmt(const at::Tensor& b) {
  if (b.scalar_type() == at::kBFloat16) return BF16;
  if (b.scalar_type() == at::kHalf) return F16;
  TORCH_CHECK(b.scalar_type() == at::kFloat, "specmoe kernels: bias must be fp32, bf16 or fp16");
  return F32;
}

// A [N, K] weight (any row stride, unit column stride) in its stored format → Weight. int8: `scale` [N] fp32;
// int4 (uint8 [N, K/2]): `scale` fp16 [N, K/group].
Weight describe(const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t group, int64_t* K) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "specmoe kernels: the weight must be 2-D with unit column stride");
  Weight W;
  W.w = static_cast<const uint8_t*>(w.data_ptr());
  W.ld_bytes = w.stride(0) * w.element_size();
  *K = w.size(1);
  switch (w.scalar_type()) {
    case at::kFloat: W.fmt = F32; break;
    case at::kBFloat16: W.fmt = BF16; break;
    case at::kHalf: W.fmt = F16; break;
    case at::kChar:
      W.fmt = I8;
      TORCH_CHECK(scale && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                      scale->numel() == w.size(0), "specmoe kernels: int8 weights need one fp32 scale per row");
      W.row_scale = scale->data_ptr<float>();
      break;
    case at::kByte:
      W.fmt = I4;
      *K = 2 * w.size(1);
      TORCH_CHECK((group == 32 || group == 64) && *K % group == 0,
                  "specmoe kernels: int4 rows must be whole groups of 32 or 64 weights");
      TORCH_CHECK(scale && scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                      scale->numel() == w.size(0) * (*K / group),
                  "specmoe kernels: int4 weights need one fp16 scale per group");
      W.gscale = reinterpret_cast<const uint16_t*>(scale->data_ptr());
      W.group = group;
      W.gshift = group == 64 ? 6 : 5;
      break;
    default: TORCH_CHECK(false, "specmoe kernels: unsupported weight dtype ", w.scalar_type());
  }
  return W;
}

// y [m, N] (row stride ldy) = x [m, K] (row stride ldx) · Wᵀ, threads over output channels.
void gemm(const float* x, int64_t ldx, int64_t m, const Weight& W, int64_t K, int64_t N, float* y, int64_t ldy) {
  KernelFn fn = current().fn;
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) { fn(x, ldx, m, W, K, b, e, y, ldy); });
}

// The stored weight as an fp32 matrix (the BLAS path of a many-row product).
at::Tensor dequant(const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t group) {
  if (w.scalar_type() == at::kChar) return w.to(at::kFloat) * scale->unsqueeze(1);
  if (w.scalar_type() == at::kByte) {
    auto n = at::stack({w.bitwise_and(15), w.bitwise_right_shift(4)}, 2).reshape({w.size(0), -1});
    auto v = (n.to(at::kFloat) - 8).view({w.size(0), -1, group});
    return (v * scale->to(at::kFloat).view({w.size(0), -1, 1})).view({w.size(0), -1});
  }
  return w.to(at::kFloat);
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scale, int64_t group, int64_t blas_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "specmoe kernels: CPU tensors only");
  int64_t K;
  Weight W = describe(w, scale, group, &K);
  TORCH_CHECK(x_in.size(-1) == K, "specmoe kernels: x has ", x_in.size(-1), " features, the weight ", K);
  const int64_t N = w.size(0);
  at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "specmoe kernels: bias must be [N], contiguous");
    W.bias = bias->data_ptr();
    W.bias_fmt = bias_fmt(*bias);
  }
  at::Tensor y;
  if (blas_rows > 0 && m > blas_rows) {  // prefill: the weight is read once per many rows, BLAS is the faster product
    y = bias ? at::addmm(bias->to(at::kFloat), x, dequant(w, scale, group).t()) : at::mm(x, dequant(w, scale, group).t());
  } else {
    y = at::empty({m, N}, x.options());
    gemm(x.data_ptr<float>(), K, m, W, K, N, y.data_ptr<float>(), N);
  }
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape).to(x_in.scalar_type());
}

// y = w · (x · rsqrt(mean(x²) + eps)) for each row of fp32 x [..., D] (w fp32 [D] or [P, D]: row r takes weight row
// r % P, e.g. per-head q/k norms; or none), as transformers' RMSNorm
// computes it in fp32: the sum of squares in 8 interleaved partial sums added in a fixed order, rows independent (split
// over threads only when large), so a row's bits never depend on the rows beside it. One op for what the torch path
// does in five (a decode step's norms are tiny, and dispatch was most of their cost).
at::Tensor rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& w, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "specmoe kernels: rms_norm wants fp32 CPU x");
  const int64_t D = x_in.size(-1);
  at::Tensor x = x_in.contiguous(), wc;
  const int64_t n = D ? x.numel() / D : 0;
  const float* wp = nullptr;
  int64_t P = 1;  // weight rows: row r of x takes weight row r % P (per-head q/k norms: [heads, D])
  if (w) {
    wc = w->to(at::kFloat).contiguous();
    P = D ? wc.numel() / D : 1;
    TORCH_CHECK(D && wc.numel() == P * D && P > 0 && n % P == 0, "specmoe kernels: rms_norm weight of ", wc.numel(),
                " values does not tile ", n, " rows of ", D);
    wp = wc.data_ptr<float>();
  }
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps), inv_d = 1.f / static_cast<float>(D);
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xp + r * D;
      float* b = yp + r * D;
      float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t k = 0;
      for (; k + 8 <= D; k += 8)
        for (int l = 0; l < 8; ++l) s[l] += a[k + l] * a[k + l];
      for (; k < D; ++k) s[k & 7] += a[k] * a[k];
      const float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      const float inv = 1.f / std::sqrt(t * inv_d + e);
      if (wp) {
        const float* wr = wp + (r % P) * D;
        for (k = 0; k < D; ++k) b[k] = wr[k] * (a[k] * inv);
      } else {
        for (k = 0; k < D; ++k) b[k] = a[k] * inv;
      }
    }
  };
  if (n * D < (1 << 18)) {
    rows(0, n);
  } else {
    at::parallel_for(0, n, 1, rows);
  }
  return y;
}

float silu(float g) { return g / (1.f + std::exp(-g)); }

// Every assignment of one MoE layer that falls on this slot group, in one call. x [T, D] fp32; slot [T·Kr] int64 the
// slot of each assignment (>= S: another group's, skipped; assignment a reads token a / Kr); gate_up [S, G, D] and
// down [S, D, I] in their stored format (int8 / int4 with their scales), optional biases [S, G] / [S, D];
// act 0: SwiGLU (gate_up = [gate; up]), 1: ReLU (gate_up = fc1), 2: GPT-OSS's clamped SwiGLU (limit, alpha);
// row_scale [T·Kr] (Llama-4): each assignment reads its token times it. Writes y [T·Kr, D] fp32 rows of this group.
void moe(const at::Tensor& x_in, const at::Tensor& slot_t, const at::Tensor& gate_up, const at::Tensor& down,
         const c10::optional<at::Tensor>& gub, const c10::optional<at::Tensor>& db,
         const c10::optional<at::Tensor>& gu_scale, const c10::optional<at::Tensor>& d_scale, int64_t group,
         int64_t act, double limit, double alpha, const c10::optional<at::Tensor>& row_scale, int64_t Kr,
         int64_t blas_rows, at::Tensor y) {
  TORCH_CHECK(x_in.dim() == 2 && y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "specmoe kernels: moe wants x [T, D] and a contiguous fp32 y [T*K, D]");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor slot = slot_t.to(at::kLong).contiguous();
  const int64_t S = gate_up.size(0), G = gate_up.size(1), D = x.size(1);
  const int64_t I = down.scalar_type() == at::kByte ? 2 * down.size(2) : down.size(2);  // int4: two per byte
  const int64_t A = slot.numel();
  TORCH_CHECK(y.size(0) == A && y.size(1) == D && down.size(1) == D, "specmoe kernels: moe shapes disagree");
  const int64_t* sl = slot.data_ptr<int64_t>();
  // counting sort of the assignments by slot (stable: each slot's rows in assignment order)
  std::vector<int64_t> cnt(S + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) cnt[std::min(sl[a], S)]++;
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 1; s <= S; ++s) start[s] = start[s - 1] + cnt[s - 1];
  {
    std::vector<int64_t> pos(start);
    for (int64_t a = 0; a < A; ++a) order[pos[std::min(sl[a], S)]++] = a;
  }
  const int64_t n = start[S];  // assignments of this group
  if (n == 0) return;
  struct Job { int64_t s, r0, m; Weight wi, wo; };
  std::vector<Job> jobs;
  for (int64_t s = 0; s < S; ++s) {
    if (!cnt[s]) continue;
    Job j{s, start[s], cnt[s], {}, {}};
    int64_t k;
    j.wi = describe(gate_up[s], gu_scale ? c10::optional<at::Tensor>((*gu_scale)[s]) : c10::nullopt, group, &k);
    j.wo = describe(down[s], d_scale ? c10::optional<at::Tensor>((*d_scale)[s]) : c10::nullopt, group, &k);
    if (gub) { j.wi.bias = (*gub)[s].data_ptr(); j.wi.bias_fmt = bias_fmt(*gub); }
    if (db) { j.wo.bias = (*db)[s].data_ptr(); j.wo.bias_fmt = bias_fmt(*db); }
    jobs.push_back(j);
  }
  // the rows in slot order (each times its assignment's scale, Llama-4)
  at::Tensor xs = at::empty({n, D}, x.options()), h = at::empty({n, G}, x.options());
  at::Tensor a_t = act == 1 ? h : at::empty({n, I}, x.options()), ys = at::empty({n, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::Tensor rsc = row_scale ? row_scale->to(at::kFloat).contiguous() : at::Tensor();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = order[i];
    const float* src = xp + (a / Kr) * D;
    if (row_scale) {
      const float c = rsc.data_ptr<float>()[a];
      for (int64_t d = 0; d < D; ++d) xsp[i * D + d] = src[d] * c;
    } else {
      std::memcpy(xsp + i * D, src, D * sizeof(float));
    }
  }
  // one parallel pass per projection over (slot, output channel); a many-row slot (prefill) takes BLAS
  auto project = [&](bool in, const at::Tensor& src, int64_t ld_src, at::Tensor& dst, int64_t N, int64_t Kd) {
    const float* sp = src.data_ptr<float>();
    float* dp = dst.data_ptr<float>();
    std::vector<int64_t> small;
    for (int64_t j = 0; j < (int64_t)jobs.size(); ++j) {
      const Job& jb = jobs[j];
      if (blas_rows <= 0 || jb.m <= blas_rows) { small.push_back(j); continue; }
      const at::Tensor& w = in ? gate_up : down;
      const auto& sc = in ? gu_scale : d_scale;
      at::Tensor wf = dequant(w[jb.s], sc ? c10::optional<at::Tensor>((*sc)[jb.s]) : c10::nullopt, group);
      at::Tensor out = dst.narrow(0, jb.r0, jb.m);
      at::mm_out(out, src.narrow(0, jb.r0, jb.m), wf.t());
      const auto& b = in ? gub : db;
      if (b) out.add_((*b)[jb.s].to(at::kFloat));
    }
    if (small.empty()) return;
    KernelFn fn = current().fn;
    const int64_t total = (int64_t)small.size() * N;
    const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(Kd, 1));
    at::parallel_for(0, total, grain, [&](int64_t b, int64_t e) {
      while (b < e) {
        const Job& jb = jobs[small[b / N]];
        const int64_t o0 = b % N, o1 = std::min(N, o0 + (e - b));
        fn(sp + jb.r0 * ld_src, ld_src, jb.m, in ? jb.wi : jb.wo, Kd, o0, o1, dp + jb.r0 * N, N);
        b += o1 - o0;
      }
    });
  };
  project(true, xs, D, h, G, D);
  float* hp = h.data_ptr<float>();
  float* ap = a_t.data_ptr<float>();
  if (act == 1) {
    for (int64_t i = 0; i < n * G; ++i) hp[i] = hp[i] > 0.f ? hp[i] : 0.f;
  } else {
    const float lim = float(limit), al = float(alpha);
    for (int64_t i = 0; i < n; ++i) {
      const float* g = hp + i * G;
      const float* u = g + I;
      float* o = ap + i * I;
      if (act == 0) {
        for (int64_t c = 0; c < I; ++c) o[c] = silu(g[c]) * u[c];
      } else {
        for (int64_t c = 0; c < I; ++c) {
          const float gc = std::min(g[c], lim), uc = std::min(std::max(u[c], -lim), lim);
          o[c] = (uc + 1.f) * (gc / (1.f + std::exp(-gc * al)));
        }
      }
    }
  }
  project(false, a_t, I, ys, D, I);
  float* yp = y.data_ptr<float>();
  const float* ysp = ys.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(yp + order[i] * D, ysp + i * D, D * sizeof(float));
}

}  // namespace
}  // namespace smk

TORCH_LIBRARY(specmoe_kernels, m) {
  m.def("isa() -> str", &smk::isa_info);
  m.def("set_isa(str want) -> str", &smk::set_isa);
  m.def("linear(Tensor x, Tensor w, Tensor? bias, Tensor? scale, int group, int blas_rows) -> Tensor", &smk::linear);
  m.def("rms_norm(Tensor x, Tensor? w, float eps) -> Tensor", &smk::rms_norm);
  m.def("moe(Tensor x, Tensor slot, Tensor gate_up, Tensor down, Tensor? gate_up_bias, Tensor? down_bias, "
        "Tensor? gate_up_scale, Tensor? down_scale, int group, int act, float limit, float alpha, Tensor? row_scale, "
        "int k, int blas_rows, Tensor(a!) y) -> ()", &smk::moe);
}
