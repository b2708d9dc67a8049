// Checks the arm64 kernel sets without MLX (arm64 only): cross-compiled with the kernel sources and run under qemu-aarch64 by
// test_arm64_cross.py. Each set (portable "generic" and "neon") runs the decode matvec, the prefill matmul, the
// SwiGLU gate and attention on random data; results are compared with a float64 reference. Exit status 0 = all
// within tolerance; the failures are printed otherwise.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "qmm_kernels.h"

using namespace mlxinfer_cpu;

static std::mt19937 rng(7);
static int failures = 0;

static std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

static void check(const std::string& what, const std::vector<float>& got, const std::vector<double>& ref) {
  double worst = 0.0, peak = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - ref[i]));
    peak = std::max(peak, std::fabs(ref[i]));
  }
  const bool ok = worst <= 1e-4 * peak;
  if (!ok) ++failures;
  std::printf("%s %s: max error %.3g of %.3g\n", ok ? "ok  " : "FAIL", what.c_str(), worst, peak);
}

// Element k of row n of an MLX affine-quantized weight (bits per element, little-endian in uint32 words).
static int q_at(const std::vector<uint32_t>& w, int K, int bits, int n, int k) {
  const int per = 32 / bits;
  const uint32_t word = w[(size_t)n * (K / per) + k / per];
  return (word >> (bits * (k % per))) & ((1u << bits) - 1);
}

static int perm(int bits, int p) { return bits == 8 ? p : (p < 16 ? 2 * p : 2 * (p - 16) + 1); }

static void check_matmul(const KernelSet& ks, int M, int N, int K, int gs, int bits) {
  std::uniform_int_distribution<uint32_t> word;
  std::vector<uint32_t> w((size_t)N * K * bits / 32);
  for (auto& x : w) x = word(rng);
  const int ng = K / gs;
  std::vector<float> s = randn((size_t)N * ng, 0.02f), b = randn((size_t)N * ng, 0.1f), x = randn((size_t)M * K);
  std::vector<double> ref((size_t)M * N, 0.0);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        ref[(size_t)m * N + n] += (double)x[(size_t)m * K + k] *
                                  ((double)q_at(w, K, bits, n, k) * s[(size_t)n * ng + k / gs] + b[(size_t)n * ng + k / gs]);
  QmmArgs a{};
  a.M = M, a.K = K, a.N = N, a.group_size = gs, a.bits = bits;
  a.w = reinterpret_cast<const uint8_t*>(w.data());
  a.scales = s.data(), a.biases = b.data(), a.stype = ScaleType::f32;
  std::vector<float> out((size_t)M * N, 0.f);
  a.out = out.data();
  if (M <= 8) {  // decode: x permuted per 32-chunk, group sums for the bias term
    std::vector<float> xp((size_t)M * K), xs((size_t)M * ng, 0.f);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) {
        xp[(size_t)m * K + k] = x[(size_t)m * K + k / 32 * 32 + perm(bits, k % 32)];
        xs[(size_t)m * ng + k / gs] += x[(size_t)m * K + k];
      }
    a.x = xp.data(), a.xsum = xs.data();
    ks.qmv(a, 0, N);
  } else {  // prefill: x packed into m-blocks of pack_m columns, zero-padded
    const int pm = ks.pack_m, mb = (M + pm - 1) / pm;
    std::vector<float> xpack((size_t)mb * K * pm, 0.f), scratch((size_t)kPackN * kKc);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k)
        xpack[(size_t)(m / pm) * K * pm + (size_t)k * pm + m % pm] = x[(size_t)m * K + k / 32 * 32 + perm(bits, k % 32)];
    for (int n0 = 0; n0 < N; n0 += kPackN) ks.qmm(a, xpack.data(), n0, std::min(N, n0 + kPackN), scratch.data());
  }
  check(std::string(ks.isa) + " matmul M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" +
            std::to_string(K) + " g" + std::to_string(gs) + " b" + std::to_string(bits),
        out, ref);
}

// float -> IEEE half bits and back (the ARM compilers' __fp16: this harness is built for arm64 only).
static uint16_t to_half(float f) {
  const __fp16 h = static_cast<__fp16>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
static float from_half(uint16_t b) {
  __fp16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

static void check_attention(const char* isa, SdpaFn fn, int L, bool causal, bool half) {
  const int B = 1, Hq = 4, Hkv = 2, S = 70, D = 64, group = Hq / Hkv;
  std::vector<float> q = randn((size_t)B * Hq * L * D), k = randn((size_t)B * Hkv * S * D), v = randn((size_t)B * Hkv * S * D);
  std::vector<uint16_t> kh(k.size()), vh(v.size());
  if (half) {  // a float16 KV cache: the reference sees the rounded values
    for (size_t i = 0; i < k.size(); ++i) k[i] = from_half(kh[i] = to_half(k[i])), v[i] = from_half(vh[i] = to_half(v[i]));
  }
  const float scale = 0.125f;
  std::vector<double> ref((size_t)B * Hq * L * D, 0.0);
  for (int h = 0; h < Hq; ++h)
    for (int i = 0; i < L; ++i) {
      const int last = causal ? i + S - L : S - 1;
      std::vector<double> sc(last + 1);
      double mx = -1e300, sum = 0.0;
      for (int j = 0; j <= last; ++j) {
        double d = 0.0;
        for (int e = 0; e < D; ++e) d += (double)q[((size_t)h * L + i) * D + e] * k[((size_t)(h / group) * S + j) * D + e];
        sc[j] = d * scale;
        mx = std::max(mx, sc[j]);
      }
      for (auto& x : sc) sum += (x = std::exp(x - mx));
      for (int j = 0; j <= last; ++j)
        for (int e = 0; e < D; ++e)
          ref[((size_t)h * L + i) * D + e] += sc[j] / sum * v[((size_t)(h / group) * S + j) * D + e];
    }
  SdpaArgs a{};
  a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.L = L, a.S = S, a.D = D, a.scale = scale, a.causal = causal;
  a.q = q.data();
  a.k = half ? static_cast<const void*>(kh.data()) : k.data();
  a.v = half ? static_cast<const void*>(vh.data()) : v.data();
  a.kv_half = half;
  const int64_t qs[3] = {(int64_t)Hq * L * D, (int64_t)L * D, D}, ks[3] = {(int64_t)Hkv * S * D, (int64_t)S * D, D};
  for (int d = 0; d < 3; ++d) a.qs[d] = qs[d], a.ks[d] = a.vs[d] = ks[d];
  std::vector<float> out(ref.size(), 0.f);
  a.out = out.data();
  a.heads_last = false;
  // The plan attention.cpp uses without a key split: nq query positions per unit, one key range.
  const int nq = std::max(1, std::min(L, std::max(1, 48 / group)));
  const int units = B * Hkv * ((L + nq - 1) / nq);
  for (int t = 0; t < units; ++t) fn(a, t, nq | (1 << 12));
  check(std::string(isa) + " attention L=" + std::to_string(L) + (causal ? " causal" : "") + (half ? " f16 kv" : ""),
        out, ref);
}

static void check_silu(const KernelSet& ks) {
  std::vector<float> g = randn(1000, 4.f), u = randn(1000), out(1000);
  std::vector<double> ref(1000);
  for (int i = 0; i < 1000; ++i) ref[i] = (double)g[i] / (1.0 + std::exp(-(double)g[i])) * u[i];
  ks.silu_mul(g.data(), u.data(), out.data(), out.size());
  check(std::string(ks.isa) + " silu_mul", out, ref);
}

int main() {
  const KernelSet sets[] = {generic_kernels(), neon_kernels()};
  const SdpaFn sdpas[] = {generic_sdpa(), neon_sdpa()};
  for (int i = 0; i < static_cast<int>(sizeof(sets) / sizeof(sets[0])); ++i) {
    const KernelSet& ks = sets[i];
    for (int bits : {4, 8})
      for (int gs : {32, 64, 128}) {
        check_matmul(ks, 1, 40, 256, gs, bits);
        check_matmul(ks, 3, 33, 384, gs, bits);
        check_matmul(ks, 20, 100, 256, gs, bits);
      }
    check_matmul(ks, 1, 17, 288, 32, 4);  // K % 64 == 32: a half block at the end
    check_silu(ks);
    for (bool half : {false, true}) {
      check_attention(ks.isa, sdpas[i], 1, false, half);
      check_attention(ks.isa, sdpas[i], 5, true, half);
      check_attention(ks.isa, sdpas[i], 30, true, half);
    }
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
