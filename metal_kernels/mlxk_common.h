// mlxk_common.h — helpers shared by mlxinfer's kernel bodies (prepended to every kernel's header).
//
// Written in Metal vocabulary (device/thread pointers, simd_sum, threadgroup); compat_cuda.h and compat_emu.h
// supply that vocabulary for NVRTC and for the CPU emulator. Only C++14 features (no `if constexpr`), because
// the Metal compiler MLX drives is C++14-based.
#ifndef MLXK_COMMON_H
#define MLXK_COMMON_H

#if defined(__CUDACC__)
#define MK_FUNC __device__ inline
#define MK_TG
#elif defined(MLXK_EMU)
#define MK_FUNC inline
#define MK_TG
#else
#define MK_FUNC inline
#define MK_TG threadgroup
#endif

#define MK_NEG_BIG (-1.0e30f)  // "minus infinity" that keeps exp(m_old - m_new) finite

// ---- affine-quantized weights (MLX layout: row-major uint32 words, low bits first; per-group scale, bias) ----

// Dequantizes VPT consecutive values of one weight row starting at column k (VPT divides the group size, so one
// scale/bias covers them all) and returns sum_i (s * q_i + b) * x_i = s * sum_i q_i x_i + b * sum_i x_i.
template <int BITS, int VPT>
MK_FUNC float qdot(const device uint32_t* wrow, int k, thread const float* xv, float xsum, float s, float b) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  float acc = 0.0f;
  for (int w = 0; w < VPT / PER; ++w) {
    uint32_t word = wrow[k / PER + w];
    for (int i = 0; i < PER; ++i) {
      acc += float((word >> (BITS * i)) & MASK) * xv[w * PER + i];
    }
  }
  return s * acc + b * xsum;
}

// One simdgroup's share of y = x W^T for M activation rows and ROWS consecutive weight rows starting at row0:
// lane `lane` walks K in chunks of VPT values, 32 chunks apart. acc[m * ROWS + r] gets this lane's partial sum;
// the caller reduces it with simd_sum. Rows past N are clamped (read row N-1) and must not be stored.
template <typename T, int GS, int BITS, int M, int ROWS>
MK_FUNC void qmv_partial(const device T* x, const device uint32_t* w, const device T* scales,
                         const device T* biases, int N, int K, int row0, uint lane, thread float* acc) {
  constexpr int PER = 32 / BITS;
  constexpr int VPT = 2 * PER < 16 ? 2 * PER : 16;  // 16 values (two words) at 4 bits, 8 values at 8 bits
  const int KW = K / PER;
  const int KG = K / GS;
  for (int i = 0; i < M * ROWS; ++i) acc[i] = 0.0f;
  for (int k = int(lane) * VPT; k < K; k += 32 * VPT) {
    float xv[M * VPT];
    float xs[M];
    for (int m = 0; m < M; ++m) {
      xs[m] = 0.0f;
      for (int i = 0; i < VPT; ++i) {
        xv[m * VPT + i] = static_cast<float>(x[m * K + k + i]);
        xs[m] += xv[m * VPT + i];
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const int row = row0 + r < N ? row0 + r : N - 1;
      const float s = static_cast<float>(scales[row * KG + k / GS]);
      const float b = static_cast<float>(biases[row * KG + k / GS]);
      for (int m = 0; m < M; ++m) {
        acc[m * ROWS + r] += qdot<BITS, VPT>(w + row * KW, k, xv + m * VPT, xs[m], s, b);
      }
    }
  }
}

// ---- decode attention ----

// Key/value rows read in place from a (B, H, S, D) cache with arbitrary strides (mlx-lm's cache slices are
// strided along S; the last-axis stride is 1 there but is honoured anyway). Lane `lane` holds d = lane + 32 * j.
template <typename T, int D>
struct DenseKV {
  const device T* k;
  const device T* v;
  int64_t kst[4], vst[4];  // (batch, head, seq, dim) strides in elements
  MK_FUNC void load_k(int b, int h, int s, uint lane, thread float* out) const { load(k, kst, b, h, s, lane, out); }
  MK_FUNC void load_v(int b, int h, int s, uint lane, thread float* out) const { load(v, vst, b, h, s, lane, out); }
  MK_FUNC void load(const device T* p, const thread int64_t* st, int b, int h, int s, uint lane,
                    thread float* out) const {
    const device T* row = p + b * st[0] + h * st[1] + s * st[2];
    for (int j = 0; j < (D + 31) / 32; ++j) {
      const int d = int(lane) + 32 * j;
      out[j] = d < D ? static_cast<float>(row[d * st[3]]) : 0.0f;
    }
  }
};

// The same rows from mlx-lm's QuantizedKVCache: packed (B, H, S, D / (32 / BITS)) uint32 plus (B, H, S, D / GS)
// scales and biases, dequantized while loading (no dequantized copy of the cache is ever made).
template <typename T, int D, int GS, int BITS>
struct QuantKV {
  const device uint32_t* kq;
  const device T* kscale;
  const device T* kbias;
  const device uint32_t* vq;
  const device T* vscale;
  const device T* vbias;
  int64_t kq_st[4], ks_st[4], kb_st[4], vq_st[4], vs_st[4], vb_st[4];  // (batch, head, seq, last) strides
  MK_FUNC void load_k(int b, int h, int s, uint lane, thread float* out) const {
    load(kq, kscale, kbias, kq_st, ks_st, kb_st, b, h, s, lane, out);
  }
  MK_FUNC void load_v(int b, int h, int s, uint lane, thread float* out) const {
    load(vq, vscale, vbias, vq_st, vs_st, vb_st, b, h, s, lane, out);
  }
  MK_FUNC void load(const device uint32_t* q, const device T* sc, const device T* bi, const thread int64_t* qs,
                    const thread int64_t* ss, const thread int64_t* bs, int b, int h, int s, uint lane,
                    thread float* out) const {
    constexpr int PER = 32 / BITS;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const device uint32_t* qrow = q + b * qs[0] + h * qs[1] + s * qs[2];
    const device T* srow = sc + b * ss[0] + h * ss[1] + s * ss[2];
    const device T* brow = bi + b * bs[0] + h * bs[1] + s * bs[2];
    for (int j = 0; j < (D + 31) / 32; ++j) {
      const int d = int(lane) + 32 * j;
      if (d < D) {
        const float qv = float((qrow[(d / PER) * qs[3]] >> (BITS * (d % PER))) & MASK);
        out[j] = static_cast<float>(srow[(d / GS) * ss[3]]) * qv + static_cast<float>(brow[(d / GS) * bs[3]]);
      } else {
        out[j] = 0.0f;
      }
    }
  }
};

// Decode attention for one kv head and up to QR query rows (rows = (query head of this kv group, token) pairs),
// over keys [start, stop). Simdgroup sg takes keys start+sg, start+sg+NSG, ...; each keeps an online softmax
// (running max m, denominator l, unnormalised output acc) per row; the simdgroups are then merged through
// threadgroup memory. SPLIT: write the unnormalised partial (out_part, m, l) for the second pass instead of out.
// Reads every key/value row once for all R query heads that share it (GQA), unlike one threadgroup per q head.
template <typename T, int D, int QR, int NSG, bool SPLIT, typename KV>
MK_FUNC void attn_decode(KV kv, const device T* q, float scale, int Hq, int Hkv, int L, int S, bool causal,
                         int b, int h, int row_base, int start, int stop, int split, int nsplit,
                         device T* out, device float* out_part, device float* out_m, device float* out_l,
                         MK_TG float* tg_m, MK_TG float* tg_l, MK_TG float* tg_acc, uint sg, uint lane, uint tid) {
  constexpr int DJ = (D + 31) / 32;
  const int R = Hq / Hkv;
  const int nrows = R * L;
  float qv[QR * DJ], acc[QR * DJ], m[QR], l[QR];
  int last[QR];  // the last key position each row may see
  for (int i = 0; i < QR; ++i) {
    const int row = row_base + i < nrows ? row_base + i : nrows - 1;
    const int head = h * R + row / L, tok = row % L;
    const device T* qrow = q + ((b * Hq + head) * L + tok) * D;
    for (int j = 0; j < DJ; ++j) {
      const int d = int(lane) + 32 * j;
      qv[i * DJ + j] = d < D ? static_cast<float>(qrow[d]) * scale : 0.0f;
      acc[i * DJ + j] = 0.0f;
    }
    m[i] = MK_NEG_BIG;
    l[i] = 0.0f;
    last[i] = causal ? S - L + tok : S - 1;
  }
  float kr[DJ], vr[DJ];
  for (int s = start + int(sg); s < stop; s += NSG) {
    kv.load_k(b, h, s, lane, kr);
    kv.load_v(b, h, s, lane, vr);
    for (int i = 0; i < QR; ++i) {
      float p = 0.0f;
      for (int j = 0; j < DJ; ++j) p += qv[i * DJ + j] * kr[j];
      const float score = simd_sum(p);  // all 32 lanes are here: s and i are uniform in the simdgroup
      if (s <= last[i]) {
        const float m_new = metal::max(m[i], score);
        const float f = metal::exp(m[i] - m_new), e = metal::exp(score - m_new);
        l[i] = l[i] * f + e;
        for (int j = 0; j < DJ; ++j) acc[i * DJ + j] = acc[i * DJ + j] * f + e * vr[j];
        m[i] = m_new;
      }
    }
  }
  // Merge the NSG simdgroups row by row: thread tid < D owns output element d = tid.
  for (int i = 0; i < QR; ++i) {
    if (lane == 0) {
      tg_m[sg] = m[i];
      tg_l[sg] = l[i];
    }
    for (int j = 0; j < DJ; ++j) {
      const int d = int(lane) + 32 * j;
      if (d < D) tg_acc[sg * D + d] = acc[i * DJ + j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int row = row_base + i;
    if (row < nrows && int(tid) < D) {
      float mx = MK_NEG_BIG;
      for (int g = 0; g < NSG; ++g) mx = metal::max(mx, tg_m[g]);
      float den = 0.0f, num = 0.0f;
      for (int g = 0; g < NSG; ++g) {
        const float f = metal::exp(tg_m[g] - mx);
        den += tg_l[g] * f;
        num += tg_acc[g * D + tid] * f;
      }
      const int head = h * R + row / L, tok = row % L;
      const int orow = (b * Hq + head) * L + tok;  // (B, Hq, L) row of the output
      if (SPLIT) {
        out_part[(orow * nsplit + split) * D + tid] = num;
        if (tid == 0) {
          out_m[orow * nsplit + split] = mx;
          out_l[orow * nsplit + split] = den;
        }
      } else {
        out[orow * D + tid] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

#endif
