// NEON kernels for arm64 (Apple Silicon, Graviton, ...): the shared float32 bodies (qmm_impl.inc, attn_impl.inc)
// over an 8-lane vector made of two float32x4_t, with the nibble/byte unpack in NEON. ASIMD is part of every
// arm64 CPU, so select_kernels() takes this set there unless MLXINFER_ISA=generic.
// Verified on x86 by tests/native/test_arm64_cross.py (cross-compiled, run under qemu-aarch64, against the
// portable set and a float64 reference); no arm64 timing has been measured in this project.
#include <arm_neon.h>

#include <cmath>
#include <cstring>

#include "qmm_kernels.h"

namespace mlxinfer_cpu {
namespace isa_neon {

struct V {
  static constexpr int W = 8;
  float32x4_t a, b;
  static V zero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
  static V load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
  static V load_h(const uint16_t* p) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
  }
  static void store(float* p, V v) {
    vst1q_f32(p, v.a);
    vst1q_f32(p + 4, v.b);
  }
  static V set1(float f) { return {vdupq_n_f32(f), vdupq_n_f32(f)}; }
  static V add(V x, V y) { return {vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)}; }
  static V mul(V x, V y) { return {vmulq_f32(x.a, y.a), vmulq_f32(x.b, y.b)}; }
  static V fma(V x, V y, V c) { return {vfmaq_f32(c.a, x.a, y.a), vfmaq_f32(c.b, x.b, y.b)}; }
  static float reduce(V v) { return vaddvq_f32(vaddq_f32(v.a, v.b)); }
};

// 8 bytes -> 8 floats.
static inline V u8_to_f(uint8x8_t b) {
  const uint16x8_t w = vmovl_u8(b);
  return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)))};
}

static inline void load_q4(const uint8_t* p, V* q) {
  const uint8x16_t b = vld1q_u8(p);
  const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(0x0f));
  const uint8x16_t hi = vshrq_n_u8(b, 4);
  q[0] = u8_to_f(vget_low_u8(lo));
  q[1] = u8_to_f(vget_high_u8(lo));
  q[2] = u8_to_f(vget_low_u8(hi));
  q[3] = u8_to_f(vget_high_u8(hi));
}

static inline void load_q8(const uint8_t* p, V* q) {
  for (int i = 0; i < 4; ++i) q[i] = u8_to_f(vld1_u8(p + 8 * i));
}

constexpr int kPackM = 16;

#include "qmm_impl.inc"
#include "attn_impl.inc"

}  // namespace isa_neon

SdpaFn neon_sdpa() { return isa_neon::sdpa_rows; }

KernelSet neon_kernels() { return {"neon", isa_neon::kPackM, isa_neon::qmv, isa_neon::qmm, false, isa_neon::silu_mul}; }

}  // namespace mlxinfer_cpu
