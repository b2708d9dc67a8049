// compat_emu.h — run MLX-generated Metal kernel source as C++20 on the CPU (test infrastructure only).
//
// Execution model: threadgroups run one after another; the threads of one threadgroup are cooperative fibers
// (ucontext) on one OS thread, resumed in a freshly shuffled order on every sweep (fixed seed: reproducible), so a
// thread that reads another's threadgroup data without a barrier in between sees it stale in most runs. threadgroup_barrier blocks a fiber until every thread of
// the threadgroup arrives; simd_* collectives block until all 32 lanes of the simdgroup arrive, exchange values
// through a per-simdgroup slot array, and block again before anyone may reuse the slots. A barrier that some
// threads never reach (divergence) is reported as an error instead of hanging. Threadgroup memory: the body's
// `threadgroup T buf[N]` becomes a function-level `static` (safe because threadgroups never overlap).
//
// Not checked here: Metal address-space rules (device/constant/thread/threadgroup are erased), Metal-specific
// compile errors, float16 rounding of intermediate `half` arithmetic, races that need preemption between two
// barriers (fibers switch only at barriers and collectives), memory ordering, device-memory races across
// threadgroups (they never overlap here).
#ifndef MLXK_COMPAT_EMU_H
#define MLXK_COMPAT_EMU_H
#define MLXK_EMU 1

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

struct uint3 {
  uint32_t x, y, z;
};
typedef uint32_t uint;
typedef uint16_t ushort;
typedef uint8_t uchar;
typedef _Float16 half;
typedef half float16_t;

// bfloat16 with round-to-nearest-even from float, like Metal's bfloat (NaN handling omitted).
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

#ifndef MLXK_EMU_CUDA  // the CUDA flavour (emu_cuda_prelude.h) gets these from compat_cuda.h instead
namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
}  // namespace metal
#endif

namespace mlxemu {

constexpr int kSimd = 32;
constexpr size_t kStack = 64 * 1024;
enum State { kRunnable, kAtBarrier, kAtSimd, kDone };

struct Attrs {  // the Metal [[attribute]] values of one thread
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
};

struct Group {  // the state of the threadgroup being run
  std::vector<ucontext_t> ctx;
  std::vector<State> state;
  std::vector<Attrs> attrs;
  std::vector<char> stacks;
  std::vector<int> simd_arrived;
  std::vector<unsigned char> slots;  // [simdgroup][lane][16 bytes]
  ucontext_t sched;
  int current = 0, n = 0, tg_arrived = 0;
  const std::function<void(const Attrs&)>* kernel = nullptr;
};
inline Group* G = nullptr;

inline void entry() {
  (*G->kernel)(G->attrs[G->current]);
  G->state[G->current] = kDone;  // then uc_link returns to the scheduler
}

inline void yield_as(State s) {
  G->state[G->current] = s;
  swapcontext(&G->ctx[G->current], &G->sched);
}

inline void barrier() {
  if (++G->tg_arrived == G->n) {
    G->tg_arrived = 0;
    for (auto& s : G->state) s = s == kAtBarrier ? kRunnable : s;
    return;
  }
  yield_as(kAtBarrier);
}

inline void simd_barrier() {
  int sg = G->current / kSimd;
  if (++G->simd_arrived[sg] == kSimd) {
    G->simd_arrived[sg] = 0;
    for (int i = sg * kSimd; i < (sg + 1) * kSimd; ++i) G->state[i] = G->state[i] == kAtSimd ? kRunnable : G->state[i];
    return;
  }
  yield_as(kAtSimd);
}

inline unsigned char* slot(int tid) { return &G->slots[size_t(tid) * 16]; }

template <typename U>
U exchange(U x, int src_lane) {  // every lane publishes x, then reads lane src_lane's value
  static_assert(sizeof(U) <= 16, "simd value too large");
  int tid = G->current, base = tid / kSimd * kSimd;
  std::memcpy(slot(tid), &x, sizeof(U));
  simd_barrier();
  U r;
  std::memcpy(&r, slot(base + (src_lane & (kSimd - 1))), sizeof(U));
  simd_barrier();
  return r;
}

template <typename U, typename Op>
U reduce(U x, Op op) {  // lane-order reduction; every lane gets the result
  int tid = G->current, base = tid / kSimd * kSimd;
  std::memcpy(slot(tid), &x, sizeof(U));
  simd_barrier();
  U acc;
  std::memcpy(&acc, slot(base), sizeof(U));
  for (int i = 1; i < kSimd; ++i) {
    U v;
    std::memcpy(&v, slot(base + i), sizeof(U));
    acc = op(acc, v);
  }
  simd_barrier();
  return acc;
}

// Runs `kernel` for every thread of the grid; returns nullptr or an error message.
inline const char* launch(uint3 grid, uint3 tg, const std::function<void(const Attrs&)>& kernel) {
  static thread_local char err[256];
  uint3 tgs{grid.x < tg.x ? grid.x : tg.x, grid.y < tg.y ? grid.y : tg.y, grid.z < tg.z ? grid.z : tg.z};
  int n = int(tgs.x * tgs.y * tgs.z);
  if (n % kSimd != 0 || n > 1024) return "threadgroup size must be a multiple of 32 and at most 1024";
  if (grid.x % tgs.x || grid.y % tgs.y || grid.z % tgs.z) return "grid must be a multiple of the threadgroup";
  uint3 groups{grid.x / tgs.x, grid.y / tgs.y, grid.z / tgs.z};
  Group g;
  g.n = n;
  g.kernel = &kernel;
  g.ctx.resize(n);
  g.state.resize(n);
  g.attrs.resize(n);
  g.stacks.resize(n * kStack);
  g.simd_arrived.assign(n / kSimd, 0);
  g.slots.assign(size_t(n) * 16, 0);
  G = &g;
  std::vector<int> order(n);
  for (int t = 0; t < n; ++t) order[t] = t;
  uint32_t rng = 12345u;  // xorshift32: a fixed, reproducible sequence of schedules
  for (uint gz = 0; gz < groups.z; ++gz)
    for (uint gy = 0; gy < groups.y; ++gy)
      for (uint gx = 0; gx < groups.x; ++gx) {
        for (int t = 0; t < n; ++t) {
          uint3 local{uint(t) % tgs.x, uint(t) / tgs.x % tgs.y, uint(t) / (tgs.x * tgs.y)};
          Attrs& a = g.attrs[t];
          a.threadgroup_position_in_grid = {gx, gy, gz};
          a.thread_position_in_threadgroup = local;
          a.thread_position_in_grid = {gx * tgs.x + local.x, gy * tgs.y + local.y, gz * tgs.z + local.z};
          a.threads_per_threadgroup = tgs;
          a.threadgroups_per_grid = groups;
          a.threads_per_grid = a.grid_size = grid;
          a.thread_index_in_threadgroup = t;
          a.simdgroup_index_in_threadgroup = t / kSimd;
          a.thread_index_in_simdgroup = t % kSimd;
          a.simdgroups_per_threadgroup = n / kSimd;
          a.threads_per_simdgroup = a.thread_execution_width = kSimd;
          getcontext(&g.ctx[t]);
          g.ctx[t].uc_stack.ss_sp = &g.stacks[size_t(t) * kStack];
          g.ctx[t].uc_stack.ss_size = kStack;
          g.ctx[t].uc_link = &g.sched;
          makecontext(&g.ctx[t], entry, 0);
          g.state[t] = kRunnable;
        }
        for (bool progress = true; progress;) {  // sweep until nobody can run
          progress = false;
          for (int i = n - 1; i > 0; --i) {  // Fisher-Yates
            rng ^= rng << 13, rng ^= rng >> 17, rng ^= rng << 5;
            int j = int(rng % uint32_t(i + 1)), tmp = order[i];
            order[i] = order[j], order[j] = tmp;
          }
          for (int t : order) {
            if (g.state[t] != kRunnable) continue;
            g.current = t;
            swapcontext(&g.sched, &g.ctx[t]);
            progress = true;
          }
        }
        int done = 0;
        for (auto s : g.state) done += s == kDone;
        if (done != n) {
          std::snprintf(err, sizeof err,
                        "barrier divergence in threadgroup (%u,%u,%u): %d of %d threads finished, the rest wait",
                        gx, gy, gz, done, n);
          G = nullptr;
          return err;
        }
      }
  G = nullptr;
  return nullptr;
}

}  // namespace mlxemu

#ifndef MLXK_EMU_CUDA
inline void threadgroup_barrier(mem_flags) { mlxemu::barrier(); }
inline void simdgroup_barrier(mem_flags) { mlxemu::simd_barrier(); }
template <typename U>
U simd_sum(U x) { return mlxemu::reduce(x, [](U a, U b) { return U(a + b); }); }
template <typename U>
U simd_max(U x) { return mlxemu::reduce(x, [](U a, U b) { return a > b ? a : b; }); }
template <typename U>
U simd_min(U x) { return mlxemu::reduce(x, [](U a, U b) { return a < b ? a : b; }); }
template <typename U>
U simd_shuffle(U x, ushort lane) { return mlxemu::exchange(x, lane); }
template <typename U>
U simd_broadcast(U x, ushort lane) { return mlxemu::exchange(x, lane); }
template <typename U>
U simd_shuffle_xor(U x, ushort mask) {
  return mlxemu::exchange(x, int(mlxemu::G->current % mlxemu::kSimd) ^ mask);
}
template <typename U>
U simd_shuffle_down(U x, ushort delta) {  // lanes past the end read their own value, as on Metal
  int lane = mlxemu::G->current % mlxemu::kSimd;
  return mlxemu::exchange(x, lane + delta < mlxemu::kSimd ? lane + delta : lane);
}

// Metal address-space words and [[attributes]]: erased. Defined last so they cannot break the headers above.
#define device
#define constant
#define thread
#define threadgroup static
#define METAL_FUNC inline
#endif  // MLXK_EMU_CUDA

#endif
