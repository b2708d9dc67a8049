// The QuantizedMatmul primitive: graph-building op + eval_cpu that runs the ISA kernels on the pool.
#include "dispatch.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "qmm_float.h"
#include "qmm_kernels.h"
#include "threadpool.h"

namespace mlxinfer_cpu {

// Row-major copy of a strided array (libmlx does not export its own copy helpers). The innermost dims that are
// already contiguous in `a` go as one memcpy per run: a KV buffer sliced along its length (mlx-lm's BatchKVCache
// filter drops leading padding that way) is a few thousand runs, not one call per element (~0.4 s a step for
// SmolLM2's 30 layers at batch 7 element by element).
mx::array row_contiguous_copy(const mx::array& a) {
  mx::array c(a.shape(), a.dtype(), nullptr, {});
  c.set_data(mx::allocator::malloc(c.nbytes()));
  const size_t item = a.itemsize();
  const char* src = a.data<char>();
  char* dst = c.data<char>();
  const int nd = a.ndim();
  if (a.size() == 0) return c;
  // run: the product of the trailing dims whose strides are row-major (size-1 dims never break a run)
  int inner = nd;
  int64_t run = 1;
  while (inner > 0 && (a.shape(inner - 1) == 1 || a.strides()[inner - 1] == run)) {
    run *= a.shape(inner - 1);
    --inner;
  }
  const size_t run_bytes = (size_t)run * item;
  std::vector<int> idx(inner, 0);
  int64_t off = 0;  // element offset of the current run in `a`
  for (size_t done = 0; done < a.size(); done += run) {
    std::memcpy(dst + done * item, src + off * (int64_t)item, run_bytes);
    for (int d = inner - 1; d >= 0; --d) {  // the next outer index, keeping the offset incrementally
      off += a.strides()[d];
      if (++idx[d] < a.shape(d)) break;
      off -= (int64_t)idx[d] * a.strides()[d];
      idx[d] = 0;
    }
  }
  return c;
}

namespace {

class NativeQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  NativeQuantizedMatmul(mx::Stream s, int group_size, int bits, bool tiled, bool symmetric)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), tiled_(tiled), symmetric_(symmetric) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] quantized_matmul runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeQuantizedMatmul*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->tiled_ == tiled_ &&
           o->symmetric_ == symmetric_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(0);
    return {s};
  }

 private:
  int group_size_;
  int bits_;
  bool tiled_;
  bool symmetric_;
};

template <typename T>
void to_float(const mx::array& a, float* dst, size_t count) {
  const T* p = a.data<T>();
  for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(p[i]);
}

// x (M, K) as float32; returns a pointer into x when it already is float32.
const float* x_as_float(const mx::array& x, std::vector<float>& buf) {
  if (x.dtype() == mx::float32) return x.data<float>();
  buf.resize(x.size());
  if (x.dtype() == mx::float16) {
    to_float<mx::float16_t>(x, buf.data(), x.size());
  } else {
    to_float<mx::bfloat16_t>(x, buf.data(), x.size());
  }
  return buf.data();
}

constexpr int64_t kSerialWeights = 128 * 1024;
constexpr int64_t kTaskBytes = 256 * 1024;  // most packed weight bytes one decode task reads

// Off: KernelSet::int8_x sets prepare int16 x instead (the load-time self-check compares formulas, not rounding).
std::atomic<bool> int8_decode{true};
// On: prefill of 4-bit weights runs the set's int8 GEMM (MLXINFER_PREFILL=int8 starts it on); off: its precise path
// (the int16 GEMM where the set has one: avx2, avx2i8, avx512vnni; else the float32 tiles).
std::atomic<bool> int8_prefill{int8_prefill_requested()};


// x for the integer decode kernels, as type Q (layouts in QmmArgs): each weight group of each row is rounded with
// its own scale d = max|x| / (32767 for int16, 127 for int8), so one outlier only coarsens its own group. prep
// fills (q, d, corr, sum) for kpad / gpad; field is where the kernels read q.
template <typename Q, typename Prep>
void prep_int_x(int M, int K, int group_size, int kalign, std::vector<QmmArgs>& args, const Q* QmmArgs::*field,
                Prep prep) {
  thread_local std::vector<Q> xq;
  thread_local std::vector<float> xd, xs, xc;
  const int kpad = (K + kalign - 1) / kalign * kalign;
  const int gpad = (K / group_size + 1 + 15) / 16 * 16;  // one spare group: a 64-block reads two group scales
  xq.assign((size_t)M * kpad, 0);
  xd.assign((size_t)M * gpad, 0.f);
  xs.assign((size_t)M * gpad, 0.f);
  xc.assign((size_t)M * gpad, 0.f);
  prep(kpad, gpad, xq.data(), xd.data(), xc.data(), xs.data());
  for (auto& a : args) {
    a.*field = xq.data();
    a.xd = xd.data();
    a.xcorr = xc.data();
    a.xsum = xs.data();
    a.kpad = kpad;
    a.gpad = gpad;
  }
}

// The integer GEMM's x preparation (rows independent, row-major buffers: q (mpad, K), d (mpad, K / 32), sum and
// corr (mpad, K / gs)) in row chunks on the pool, the padding rows [M, mpad) zeroed once.
template <typename Q>
void prep_gemm_rows(void (*prep)(const float*, int, int, int, int, Q*, float*, float*, float*), const float* xf, int M,
                    int K, int gs, int mpad, Q* q, float* d, float* sum, float* corr) {
  const size_t nblk = K / 32, ng = K / gs;
  parallel_rows(M, 4 * (size_t)K, [&](size_t r0, size_t r1) {
    const int n = static_cast<int>(r1 - r0);
    prep(xf + r0 * K, n, K, gs, n, q + r0 * K, d + r0 * nblk, sum + r0 * ng, corr + r0 * ng);
  });
  std::memset(q + (size_t)M * K, 0, (size_t)(mpad - M) * K * sizeof(Q));
  std::fill(d + (size_t)M * nblk, d + (size_t)mpad * nblk, 0.f);
  std::fill(sum + (size_t)M * ng, sum + (size_t)mpad * ng, 0.f);
  std::fill(corr + (size_t)M * ng, corr + (size_t)mpad * ng, 0.f);
}

void prep_int16_x(const KernelSet& ks, const float* xf, int M, int K, int group_size, int bits,
                  std::vector<QmmArgs>& args) {
  prep_int_x<int16_t>(M, K, group_size, 64, args, &QmmArgs::xq,
                      [&](int kpad, int gpad, int16_t* q, float* d, float* c, float* sum) {
                        ks.prep_x16(xf, M, K, group_size, bits, kpad, gpad, q, d, c, sum);
                      });
}

// 4-bit weights (KernelSet::int8_x), 8-bit ones where the set has int8_x8.
void prep_int8_x(const KernelSet& ks, const float* xf, int M, int K, int group_size, int bits,
                 std::vector<QmmArgs>& args) {
  prep_int_x<int8_t>(M, K, group_size, ks.int8_kpad, args, &QmmArgs::xb,
                     [&](int kpad, int gpad, int8_t* q, float* d, float* c, float* sum) {
                       ks.prep_x8(xf, M, K, group_size, bits, kpad, gpad, q, d, c, sum);
                     });
}

// Store float32 results into out (float32: already there; float16/bfloat16: rounded once).
template <typename F>
void store_out(mx::array& out, size_t count, F value) {
  if (out.dtype() == mx::float32) {
    float* o = out.data<float>();
    for (size_t i = 0; i < count; ++i) o[i] = value(i);
  } else if (out.dtype() == mx::float16) {
    auto* o = out.data<mx::float16_t>();
    for (size_t i = 0; i < count; ++i) o[i] = static_cast<mx::float16_t>(value(i));
  } else {
    auto* o = out.data<mx::bfloat16_t>();
    for (size_t i = 0; i < count; ++i) o[i] = static_cast<mx::bfloat16_t>(value(i));
  }
}

void run_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
             const mx::array& biases, mx::array& out, int group_size, int bits, bool tiled, bool symmetric) {
  QWeight qw{&w, &scales, &biases, nullptr};
  qw.tiled = tiled;
  qw.symmetric = symmetric;
  if (out.dtype() == mx::float32) {
    qw.out = out.data<float>();
    qmm_float(x, {qw}, group_size, bits);
    return;
  }
  thread_local std::vector<float> obuf;
  obuf.resize(out.size());
  qw.out = obuf.data();
  qmm_float(x, {qw}, group_size, bits);
  const float* of = obuf.data();
  store_out(out, out.size(), [of](size_t i) { return of[i]; });
}

// silu(x @ Wg.T) * (x @ Wu.T): both matvecs in one pool job, then the gate in the same pass.
void run_swiglu(const std::vector<mx::array>& in, mx::array& out, int group_size, int bits, float eps) {
  thread_local std::vector<float> gbuf, ubuf;
  gbuf.resize(out.size());
  ubuf.resize(out.size());
  const mx::array x = in.size() == 8 ? rms_normed(in[0], in[7], eps) : in[0];
  qmm_float(x, {{&in[1], &in[2], &in[3], gbuf.data()}, {&in[4], &in[5], &in[6], ubuf.data()}}, group_size,
            bits);
  // The gate in place (vectorised exp), then one rounding into out's dtype.
  select_kernels().silu_mul(gbuf.data(), ubuf.data(), gbuf.data(), out.size());
  const float* h = gbuf.data();
  store_out(out, out.size(), [h](size_t i) { return h[i]; });
}

class NativeSwiglu : public mx::UnaryPrimitive {
 public:
  NativeSwiglu(mx::Stream s, int group_size, int bits, float norm_eps)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), norm_eps_(norm_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer_cpu] swiglu runs on the CPU stream only");
  }
  const char* name() const override { return "MlxinferSwiglu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const NativeSwiglu*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->norm_eps_ == norm_eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(0);
    return {s};
  }

 private:
  int group_size_;
  int bits_;
  float norm_eps_;  // with an 8th input (an RMSNorm weight): x is normalised first
};

void NativeSwiglu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int gs = group_size_, bits = bits_;
  const float eps = norm_eps_;
  dispatch_contiguous(stream(), inputs, out,
                      [gs, bits, eps](std::vector<mx::array>& in, mx::array& o) { run_swiglu(in, o, gs, bits, eps); });
}

void NativeQuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int gs = group_size_, bits = bits_;
  const bool tiled = tiled_, symmetric = symmetric_;
  dispatch_contiguous(stream(), inputs, out, [gs, bits, tiled, symmetric](std::vector<mx::array>& in, mx::array& o) {
    run_qmm(in[0], in[1], in[2], in[3], o, gs, bits, tiled, symmetric);
    if (in.size() == 5) {  // + residual (float32, the output's shape): a transformer block's skip connection
      float* y = o.data<float>();
      const float* r = in[4].data<float>();
      for (size_t i = 0; i < o.size(); ++i) y[i] += r[i];
    }
  });
}

bool is_float(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

}  // namespace

namespace {
struct RowTask {
  int w, n0, n1;
};

// Output rows of every weight in chunks of at most `rows`: the pool's tasks.
std::vector<RowTask> split_rows(const std::vector<QmmArgs>& args, int rows) {
  std::vector<RowTask> tasks;
  for (int i = 0; i < static_cast<int>(args.size()); ++i)
    for (int n0 = 0; n0 < args[i].N; n0 += rows) tasks.push_back({i, n0, std::min(args[i].N, n0 + rows)});
  return tasks;
}
}  // namespace

bool set_int8_decode(bool on) { return int8_decode.exchange(on, std::memory_order_relaxed); }
PrefillMode prefill_mode() {
  const char* env = std::getenv("MLXINFER_PREFILL");
  if (!env) return PrefillMode::dflt;
  if (std::strcmp(env, "int8") == 0) return PrefillMode::int8;
  if (std::strcmp(env, "int16") == 0) return PrefillMode::int16;
  if (std::strcmp(env, "float") == 0) return PrefillMode::float32;
  return PrefillMode::dflt;
}

bool int8_prefill_requested() { return prefill_mode() == PrefillMode::int8; }

bool int8_decode_requested() {
  const char* env = std::getenv("MLXINFER_DECODE");
  return env && std::strcmp(env, "int8") == 0;
}

bool set_int8_prefill(bool on) { return int8_prefill.exchange(on, std::memory_order_relaxed); }

bool tiled_weights_supported() {
  const KernelSet& ks = select_kernels();
  return ks.qmv_tiled && ks.int16_x && ks.qmm_i16 && ks.qmm_i8 && !ks.qmm_bf16;
}

void qmm_float(const mx::array& x, const std::vector<QWeight>& ws, int group_size, int bits) {
  thread_local std::vector<float> xbuf;
  const int K = x.shape(-1);
  qmm_float(x_as_float(x, xbuf), static_cast<int>(x.size() / K), K, ws, group_size, bits);
}

void qmm_float(const float* xf, int M, int K, const std::vector<QWeight>& ws, int group_size, int bits) {
  const KernelSet& ks = select_kernels();
  SpinPool& pool = SpinPool::get();
  const int ng = K / group_size;
  const int nw = static_cast<int>(ws.size());

  thread_local std::vector<float> xprep, xsum, scratch;
  std::vector<QmmArgs> args(nw);
  for (int i = 0; i < nw; ++i) {
    QmmArgs& a = args[i];
    a.M = M;
    a.K = K;
    const bool expert = ws[i].expert >= 0;  // one (N, ...) slice of an (E, N, ...) stack: rows start e * N on
    a.N = ws[i].w->shape(expert ? 1 : 0);
    a.group_size = group_size;
    a.bits = bits;
    const mx::Dtype st = ws[i].scales->dtype();
    a.stype = st == mx::float32 ? ScaleType::f32 : st == mx::float16 ? ScaleType::f16 : ScaleType::bf16;
    const size_t row0 = expert ? (size_t)ws[i].expert * a.N : 0, sitem = mx::size_of(st);
    a.w = reinterpret_cast<const uint8_t*>(ws[i].w->data<uint32_t>()) + row0 * ((size_t)K * bits / 8);
    a.scales = ws[i].scales->data<char>() + row0 * (K / group_size) * sitem;
    a.biases = ws[i].biases->data<char>() + row0 * (K / group_size) * sitem;
    a.out = ws[i].out;
    a.tiled = ws[i].tiled;
    a.symmetric = ws[i].symmetric;
    if (a.tiled != ws[0].tiled || (a.tiled && a.N % kTileRows != 0))
      throw std::invalid_argument("[mlxinfer_cpu] tiled weights: N a multiple of 16, all of a call alike");
  }
  const bool tiled = nw > 0 && ws[0].tiled;
  if (tiled && !tiled_weights_supported())
    throw std::invalid_argument(std::string("[mlxinfer_cpu] kernel set ") + ks.isa + " does not read tiled weights");
  if (tiled && bits == 8 && M > 8) {
    // No prefill GEMM reads 8-bit tiles (a tiled 8-bit weight is an LM head: its prefill is one row): the decode
    // matvec, 8 x rows at a time.
    for (int m0 = 0; m0 < M; m0 += 8) {
      std::vector<QWeight> part = ws;
      for (int i = 0; i < nw; ++i) part[i].out = ws[i].out + (size_t)m0 * args[i].N;
      qmm_float(xf + (size_t)m0 * K, std::min(8, M - m0), K, part, group_size, bits);
    }
    return;
  }
  const int T = pool.size();
  // Read once: the branch below and the GEMM it picks must agree even if set_int8_prefill runs meanwhile.
  const bool i8 = bits == 4 && ks.qmm_i8 && int8_prefill.load(std::memory_order_relaxed);

  if (M <= 8 && tiled) {
    if (ks.int8_x && int8_decode.load(std::memory_order_relaxed)) {
      prep_int_x<int8_t>(M, K, group_size, 64, args, &QmmArgs::xb,
                         [&](int kpad, int gpad, int8_t* q, float* d, float* c, float* sum) {
                           ks.prep_x8_tiled(xf, M, K, group_size, bits, kpad, gpad, q, d, c, sum);
                         });
    } else {
      prep_int16_x(ks, xf, M, K, group_size, bits, args);
    }
  } else if (M <= 8 && ks.int8_x && (bits == 4 || ks.int8_x8) && int8_decode.load(std::memory_order_relaxed)) {
    prep_int8_x(ks, xf, M, K, group_size, bits, args);
  } else if (M <= 8 && ks.int16_x) {
    prep_int16_x(ks, xf, M, K, group_size, bits, args);
  } else if (M <= 8) {
    xprep.resize((size_t)M * K);
    xsum.resize((size_t)M * ng);
    for (int m = 0; m < M; ++m) {
      const float* xr = xf + (size_t)m * K;
      float* dr = xprep.data() + (size_t)m * K;
      for (int c = 0; c < K; c += 32)
        for (int p = 0; p < 32; ++p) dr[c + p] = xr[c + (bits == 4 ? perm4(p) : p)];
      for (int g = 0; g < ng; ++g) {
        float s = 0.f;
        for (int k = 0; k < group_size; ++k) s += xr[g * group_size + k];
        xsum[(size_t)m * ng + g] = s;
      }
    }
    for (auto& a : args) {
      a.x = xprep.data();
      a.xsum = xsum.data();
    }
  }
  if (M <= 8) {
    // ~4 tasks per thread balance the load, and no task reads more than kTaskBytes of weights: the thread
    // that ends first then waits at most one short task (an 8-bit LM head in 8 tasks of ~4 MB left one
    // thread idle for ~half of one). Rows per task stay a multiple of 8.
    int64_t total = 0;
    for (const auto& a : args) total += a.N;
    int rows = static_cast<int>((total + 4 * T - 1) / (4 * T));
    rows = std::min<int64_t>(rows, kTaskBytes / std::max<int64_t>(1, (int64_t)K * bits / 8));
    rows = std::max(16, (rows + 7) / 8 * 8);
    if (tiled) rows = (rows + kTileRows - 1) / kTileRows * kTileRows;  // whole tiles
    // A tiny matvec (e.g. a 192x576 k/v projection, ~10 us) costs less than waking a second thread.
    if (total * K < kSerialWeights) rows = 1 << 30;
    const std::vector<RowTask> tasks = split_rows(args, rows);
    pool.run(static_cast<int>(tasks.size()), [&](int t, int) {
      (tiled ? ks.qmv_tiled : ks.qmv)(args[tasks[t].w], tasks[t].n0, tasks[t].n1);
    });
  } else if (!i8 && ks.qmm_bf16 && !tiled) {
    // AMX-BF16 prefill: x split into bf16 hi + lo tiles once (layout in XBf16), weights expanded per task.
    const int mblocks = (M + kBf16RowBlock - 1) / kBf16RowBlock;
    // In floats: 16 rows x K x (hi, lo) bf16 per m-block, then the group sums.
    const size_t ntile = (size_t)mblocks * K * kBf16RowBlock, nsum = (size_t)mblocks * ng * kBf16RowBlock;
    mx::array buf(mx::Shape{static_cast<int>(ntile + nsum + 16)}, mx::float32, nullptr, {});
    buf.set_data(mx::allocator::malloc(buf.nbytes()));
    // Tiles are loaded 64 bytes a row: align them to a cache line.
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data<float>()) + 63) & ~uintptr_t(63));
    uint16_t* tiles = reinterpret_cast<uint16_t*>(base);
    float* sums = base + ntile;
    // Each row block splits on its own: on the pool (~1 ns an element, a tenth of a short prompt's GEMM alone).
    pool.run(mblocks, [&](int t, int) { ks.prep_x_bf16(xf, M, K, group_size, tiles, sums, t, t + 1); });
    const std::vector<RowTask> tasks = split_rows(args, kPackN);
    // Slabs of kAmxSlabBlocks row blocks, each through every task before the next: a slab's x stays in the
    // cores' L2 while their tasks read it, where each task sweeping all of a long x read it from L3 (Dec 6, 2
    // threads, 3 interleaved runs, GMAC/s: 512 x 2048 x 8192 259-267 -> 316-331, 6128 x 1536 x 576 108-116 ->
    // 137-141, 6128 x 576 x 1536 101-103 -> 115-118; 128 rows are one slab either way).
    constexpr int kAmxSlabBlocks = 8;
    for (int mb0 = 0; mb0 < mblocks; mb0 += kAmxSlabBlocks) {
      const int rows = std::min(M - mb0 * kBf16RowBlock, kAmxSlabBlocks * kBf16RowBlock);
      const XBf16 xb{rows, tiles + (size_t)mb0 * K * kBf16RowBlock * 2, sums + (size_t)mb0 * ng * kBf16RowBlock};
      std::vector<QmmArgs> sargs = args;
      for (auto& a : sargs) a.out += (size_t)mb0 * kBf16RowBlock * a.N;
      pool.run(static_cast<int>(tasks.size()), [&](int t, int) {
        ks.qmm_bf16(sargs[tasks[t].w], xb, tasks[t].n0, tasks[t].n1);
      });
    }
  } else if (i8 || (bits == 4 && ks.qmm_i16)) {
    // Integer prefill: x rounded to int8 (or int16) per 32-block once (layout in XInt8), weights unpacked per
    // task. One MLX allocation, as for the packed float x below.
    const int mpad = (M + kI8RowBlock - 1) / kI8RowBlock * kI8RowBlock;
    const size_t nd = (size_t)mpad * (K / 32), ns = (size_t)mpad * ng, nq = ((size_t)mpad * K * (i8 ? 1 : 2) + 3) / 4;
    mx::array buf(mx::Shape{static_cast<int>(nd + 2 * ns + nq)}, mx::float32, nullptr, {});
    buf.set_data(mx::allocator::malloc(buf.nbytes()));
    float* d = buf.data<float>();
    void* q = d + nd + 2 * ns;
    XInt8 xi{nullptr, d, d + nd, d + nd + ns, mpad};
    if (i8) {
      xi.q = static_cast<int8_t*>(q);
      prep_gemm_rows(ks.prep_x8_gemm, xf, M, K, group_size, mpad, static_cast<int8_t*>(q), d, d + nd, d + nd + ns);
    } else {
      xi.q16 = static_cast<int16_t*>(q);
      prep_gemm_rows(ks.prep_x16_gemm, xf, M, K, group_size, mpad, static_cast<int16_t*>(q), d, d + nd, d + nd + ns);
    }
    const QmmI8Fn gemm = i8 ? ks.qmm_i8 : ks.qmm_i16;
    scratch.resize((size_t)T * kPackN * kKc);
    float* scr = scratch.data();
    const std::vector<RowTask> tasks = split_rows(args, kPackN);
    pool.run(static_cast<int>(tasks.size()), [&](int t, int tid) {
      gemm(args[tasks[t].w], xi, tasks[t].n0, tasks[t].n1, scr + (size_t)tid * kPackN * kKc);
    });
  } else {
    const int pm = ks.pack_m;
    const int mblocks = (M + pm - 1) / pm;
    // The packed x of a prefill chunk (up to tens of MB) comes from MLX's allocator: counted in its peak memory
    // and back in its cache when this call returns, not held by this thread for the life of the process.
    mx::array packed(mx::Shape{static_cast<int>((size_t)mblocks * K * pm)}, mx::float32, nullptr, {});
    packed.set_data(mx::allocator::malloc(packed.nbytes()));
    std::memset(packed.data<float>(), 0, packed.nbytes());
    for (int m = 0; m < M; ++m) {
      const float* xr = xf + (size_t)m * K;
      float* dst = packed.data<float>() + (size_t)(m / pm) * K * pm + (m % pm);
      for (int c = 0; c < K; c += 32)
        for (int p = 0; p < 32; ++p) dst[(size_t)(c + p) * pm] = xr[c + (bits == 4 ? perm4(p) : p)];
    }
    for (const auto& a : args) std::fill(a.out, a.out + (size_t)M * a.N, 0.f);
    scratch.resize((size_t)T * kPackN * kKc);
    float* scr = scratch.data();
    const float* xp = packed.data<float>();
    const std::vector<RowTask> tasks = split_rows(args, kPackN);
    pool.run(static_cast<int>(tasks.size()), [&](int t, int tid) {
      ks.qmm(args[tasks[t].w], xp, tasks[t].n0, tasks[t].n1, scr + (size_t)tid * kPackN * kKc);
    });
  }
}

int check_quantized_weight(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 int group_size, int bits, const char* op) {
  if (x.ndim() < 1 || !is_float(x.dtype()))
    throw std::invalid_argument(std::string("[mlxinfer_cpu.") + op + "] x must be float32, float16 or bfloat16");
  return check_quantized_weight(x.shape(-1), w, scales, biases, group_size, bits, op);
}

int check_quantized_weight(int x_k, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, const char* op, bool experts) {
  auto fail = [op](const std::string& msg) { throw std::invalid_argument(std::string("[mlxinfer_cpu.") + op + "] " + msg); };
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  const int lead = experts ? 1 : 0;  // a stack of experts: (E, N, ...) throughout
  if (w.dtype() != mx::uint32 || w.ndim() != 2 + lead)
    fail(experts ? "w must be a 3-D uint32 array (experts, N, K * bits / 32)" : "w must be a 2-D uint32 array");
  if (!is_float(scales.dtype()) || biases.dtype() != scales.dtype()) fail("scales and biases must share a float dtype");
  const int N = w.shape(lead);
  const int K = w.shape(lead + 1) * 32 / bits;
  if (x_k != K) fail("x's last dim does not match the quantized weight");
  mx::Shape want{N, K / group_size};
  if (experts) want.insert(want.begin(), w.shape(0));
  if (scales.shape() != want || biases.shape() != scales.shape())
    fail(experts ? "scales/biases must have shape (experts, N, K / group_size)"
                 : "scales/biases must have shape (N, K / group_size)");
  if (K / group_size > 4096) fail("K / group_size too large");
  return N;
}


mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, const std::optional<mx::array>& residual,
                           bool tiled, bool symmetric) {
  const int N = check_quantized_weight(x, w, scales, biases, group_size, bits, "quantized_matmul");
  if (tiled && (N % kTileRows != 0 || !tiled_weights_supported()))
    throw std::invalid_argument("[mlxinfer_cpu.quantized_matmul] tiled weights need N a multiple of 16 and a kernel "
                                "set that reads them (tiled_weights_supported)");
  mx::Shape shape = x.shape();
  shape.back() = N;
  const mx::Dtype dtype = mx::promote_types(x.dtype(), scales.dtype());
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (residual) {
    if (dtype != mx::float32 || residual->dtype() != mx::float32 || residual->shape() != shape)
      throw std::invalid_argument("[mlxinfer_cpu.quantized_matmul] residual must be float32 with the output's shape");
    inputs.push_back(*residual);
  }
  return mx::array(shape, dtype,
                   std::make_shared<NativeQuantizedMatmul>(mx::to_stream({}, mx::Device::cpu), group_size, bits, tiled,
                                                          symmetric),
                   std::move(inputs));
}

mx::array swiglu(const mx::array& x, const mx::array& wg, const mx::array& sg, const mx::array& bg,
                 const mx::array& wu, const mx::array& su, const mx::array& bu, int group_size, int bits,
                 const std::optional<mx::array>& norm_weight, float norm_eps) {
  const int N = check_quantized_weight(x, wg, sg, bg, group_size, bits, "swiglu");
  if (check_quantized_weight(x, wu, su, bu, group_size, bits, "swiglu") != N || su.dtype() != sg.dtype())
    throw std::invalid_argument("[mlxinfer_cpu.swiglu] gate and up weights must match");
  mx::Shape shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs = {x, wg, sg, bg, wu, su, bu};
  if (norm_weight) {
    if (x.dtype() != mx::float32 || norm_weight->dtype() != mx::float32 || norm_weight->ndim() != 1 ||
        norm_weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("[mlxinfer_cpu.swiglu] norm weight must be float32 (K,) with float32 x");
    inputs.push_back(*norm_weight);
  }
  return mx::array(shape, mx::promote_types(x.dtype(), sg.dtype()),
                   std::make_shared<NativeSwiglu>(mx::to_stream({}, mx::Device::cpu), group_size, bits, norm_eps),
                   std::move(inputs));
}

}  // namespace mlxinfer_cpu
