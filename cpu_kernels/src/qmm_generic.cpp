// Portable kernels (any CPU; the compiler may auto-vectorise the fixed-width loops).
#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <string>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_generic {

struct V {
  static constexpr int W = 8;
  float f[8];
  static V zero() { return V{}; }
  static V load(const float* p) {
    V a;
    std::memcpy(a.f, p, sizeof(a.f));
    return a;
  }
  static void store(float* p, V a) { std::memcpy(p, a.f, sizeof(a.f)); }
  static V load_h(const uint16_t* p);  // 8 IEEE halves (defined after half_to_float, in qmm_impl.inc)
  static V set1(float x) {
    V a;
    for (int i = 0; i < 8; ++i) a.f[i] = x;
    return a;
  }
  static V add(V a, V b) {
    for (int i = 0; i < 8; ++i) a.f[i] += b.f[i];
    return a;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < 8; ++i) a.f[i] *= b.f[i];
    return a;
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < 8; ++i) c.f[i] += a.f[i] * b.f[i];
    return c;
  }
  static float reduce(V a) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += a.f[i];
    return s;
  }
};

static inline void load_q4(const uint8_t* p, V* q) {
  for (int i = 0; i < 16; ++i) {
    q[i / 8].f[i % 8] = static_cast<float>(p[i] & 0x0f);
    q[2 + i / 8].f[i % 8] = static_cast<float>(p[i] >> 4);
  }
}

static inline void load_q8(const uint8_t* p, V* q) {
  for (int i = 0; i < 32; ++i) q[i / 8].f[i % 8] = static_cast<float>(p[i]);
}

constexpr int kPackM = 16;

#include "qmm_impl.inc"

V V::load_h(const uint16_t* p) {
  V a;
  for (int i = 0; i < 8; ++i) a.f[i] = half_to_float(p[i]);
  return a;
}

#include "attn_impl.inc"

}  // namespace isa_generic

SdpaFn generic_sdpa() { return isa_generic::sdpa_rows; }

KernelSet generic_kernels() { return {"generic", isa_generic::kPackM, isa_generic::qmv, isa_generic::qmm, false, isa_generic::silu_mul}; }

const KernelSet& select_kernels() {
  static const KernelSet chosen = [] {
    const char* force = std::getenv("MLXINFER_ISA");
    std::string want = force ? force : "";
    // A name that is no set (a typo) is ignored: the best set, as unset (mlxinfer.native.isa_problem() says so).
    static const char* const kNames[] = {"generic", "avx2float", "avx2", "avx2i8", "avx512", "avx512vnni",
                                         "avx512vnnii8", "avx512amx", "neon"};
    if (std::none_of(std::begin(kNames), std::end(kNames), [&](const char* n) { return want == n; })) want.clear();
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    const bool has512 = __builtin_cpu_supports("avx512f");
    const bool has2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool vnni = has512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    if (want == "generic") return generic_kernels();
    if (want.empty() && int8_decode_requested()) {  // llama.cpp's accuracy class for decode, on this CPU's best set
      if (vnni) return with_integer_prefill(avx512vnnii8_kernels());
      if (has2) return with_integer_prefill(avx2i8_kernels());
    }
    if (want == "avx2float" && has2) {  // AVX2 with the float32 decode kernel (the int16 one's predecessor)
      KernelSet ks = avx2_kernels();
      ks.isa = "avx2float";
      return ks;
    }
    if (want == "avx2" && has2) return with_integer_prefill(avx2int_kernels());
    if (want == "avx2i8" && has2) return with_integer_prefill(avx2i8_kernels());
    // AMX-BF16 prefill on the VNNI set where the CPU and OS allow it, under the default (precise) prefill only:
    // MLXINFER_PREFILL=int8|int16|float asks for another GEMM.
    if ((want.empty() || want == "avx512amx") && vnni && prefill_mode() == PrefillMode::dflt && amx_bf16_usable()) {
      KernelSet ks = with_amx_prefill(with_integer_prefill(avx512vnni_kernels()));
      ks.isa = "avx512amx";
      return ks;
    }
    if (want == "avx512vnnii8" && vnni) return with_integer_prefill(avx512vnnii8_kernels());
    if ((want.empty() || want == "avx512vnni" || want == "avx512amx") && vnni)
      return with_integer_prefill(avx512vnni_kernels());
    if ((want.empty() || want == "avx512") && has512) return avx512_kernels();
    if (has2) return with_integer_prefill(avx2int_kernels());
#elif defined(__aarch64__)
    if (want != "generic") return neon_kernels();  // ASIMD is part of every arm64 CPU
#endif
    return generic_kernels();
  }();
  return chosen;
}

}  // namespace mlxinfer_cpu

namespace mlxinfer_cpu {

SdpaFn select_sdpa() {
  static const SdpaFn chosen = [] {
    std::string isa = select_kernels().isa;
    isa = isa.substr(0, isa.find('+'));  // "avx2+int8-prefill": the attention is the base set's
#if defined(__x86_64__) || defined(_M_X64)
    if (isa == "avx512" || isa == "avx512vnni" || isa == "avx512vnnii8" || isa == "avx512amx") return avx512_sdpa();
    if (isa == "avx2" || isa == "avx2float" || isa == "avx2i8") return avx2_sdpa();
#elif defined(__aarch64__)
    if (isa == "neon") return neon_sdpa();
#endif
    return generic_sdpa();
  }();
  return chosen;
}

}  // namespace mlxinfer_cpu
