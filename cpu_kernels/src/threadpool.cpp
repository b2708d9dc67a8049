#include "threadpool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXINFER_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MLXINFER_PAUSE() asm volatile("yield")
#else
#define MLXINFER_PAUSE() ((void)0)
#endif

namespace mlxinfer_cpu {

namespace {
// How long an idle worker spins before sleeping: long enough to span the non-matmul ops of a
// decoder layer, short enough not to burn a core between tokens.
constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr int kYieldEvery = 256;  // pause instructions between yields (64 and 1024 measured the same)
// A round of kYieldEvery pauses takes a few microseconds; one that took longer was preempted, and counts this much.
constexpr auto kRoundMax = std::chrono::microseconds(50);

int default_threads() {
  if (const char* env = std::getenv("MLXINFER_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}
}  // namespace

SpinPool& SpinPool::get() {
  static SpinPool pool;
  return pool;
}

SpinPool::SpinPool() { start(default_threads()); }

SpinPool::~SpinPool() { stop(); }

void SpinPool::start(int nthreads) {
  if (nthreads < 1) nthreads = 1;
  quit_ = false;
  size_ = nthreads;
  // Each worker starts from the generation at creation: one that first runs after a quick stop() must still
  // see that stop's bump (reading the generation in the thread itself could miss it and wait forever).
  const uint64_t gen = generation_.load(std::memory_order_acquire);
  for (int i = 1; i < nthreads; ++i) workers_.emplace_back([this, i, gen] { worker_loop(i, gen); });
}

void SpinPool::stop() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    quit_ = true;
    generation_++;
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void SpinPool::set_size(int n) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (n < 1) n = 1;
  if (n == size_) return;
  stop();
  start(n);
}

namespace {
constexpr int kTaskBits = 20;
constexpr uint64_t kTaskMask = (uint64_t(1) << kTaskBits) - 1;
inline uint64_t job_gen(uint64_t j) { return j >> (2 * kTaskBits); }
inline int job_ntasks(uint64_t j) { return static_cast<int>((j >> kTaskBits) & kTaskMask); }
inline int job_next(uint64_t j) { return static_cast<int>(j & kTaskMask); }
// Set while this thread runs a task: a job started from inside one runs inline (never waits on the pool it holds).
thread_local bool tl_in_task = false;
}  // namespace

void SpinPool::work(uint64_t gen, int thread_index) {
  uint64_t j = job_.load(std::memory_order_acquire);
  while (job_gen(j) == gen && job_next(j) < job_ntasks(j)) {
    if (!job_.compare_exchange_weak(j, j + 1, std::memory_order_acq_rel)) continue;
    // fn_ stays valid: the caller waits for this task before it returns.
    tl_in_task = true;
    (*fn_)(job_next(j), thread_index);
    tl_in_task = false;
    done_.fetch_add(1, std::memory_order_acq_rel);
    j = job_.load(std::memory_order_acquire);
  }
}

void SpinPool::worker_loop(int index, uint64_t seen) {
  while (true) {
    // Spin, then sleep until the generation moves on. Only time spent spinning counts towards kSpin, not
    // time the OS ran another thread after a yield: counting that put the worker to sleep several times a
    // token on a busy 2-core machine, and a sleeping worker wakes too late for the matvec at hand.
    auto last = std::chrono::steady_clock::now();
    std::chrono::steady_clock::duration spun{0};
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      MLXINFER_PAUSE();
      if (++spins == kYieldEvery) {
        spins = 0;
        const auto before_yield = std::chrono::steady_clock::now();
        spun += std::min<std::chrono::steady_clock::duration>(before_yield - last, kRoundMax);
        // Give the core away briefly: on a machine with as many cores as pool threads, the thread that
        // builds the next graph (Python) needs one too (measured: +7% decode tok/s on 2 cores).
        std::this_thread::yield();
        last = std::chrono::steady_clock::now();
        if (spun > kSpin) {
          std::unique_lock<std::mutex> lock(wake_mutex_);
          sleeping_++;
          wake_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleeping_--;
          break;
        }
      }
    }
    seen = generation_.load(std::memory_order_acquire);
    if (quit_.load()) return;
    work(seen & ((uint64_t(1) << 24) - 1), index);
  }
}

void SpinPool::run(int ntasks, const std::function<void(int, int)>& fn) {
  if (ntasks <= 0) return;
  std::unique_lock<std::mutex> guard(run_mutex_, std::defer_lock);
  if (!tl_in_task) guard.try_lock();
  if (tl_in_task || !guard.owns_lock() || workers_.empty() || ntasks == 1 || ntasks > static_cast<int>(kTaskMask)) {
    for (int t = 0; t < ntasks; ++t) fn(t, 0);
    return;
  }
  fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  uint64_t gen;
  {
    // The mutex orders this bump against a worker that is about to sleep.
    std::lock_guard<std::mutex> lock(wake_mutex_);
    gen = (generation_.load(std::memory_order_relaxed) + 1) & ((uint64_t(1) << 24) - 1);
    job_.store((gen << (2 * kTaskBits)) | (uint64_t(ntasks) << kTaskBits), std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (sleeping_.load() > 0) wake_cv_.notify_all();
  work(gen, 0);
  // Workers that never woke up hold no task, so only claimed tasks are waited for; yield while
  // waiting in case the worker holding one shares this core (a loaded machine).
  int spins = 0;
  while (done_.load(std::memory_order_acquire) != ntasks) {
    MLXINFER_PAUSE();
    if (++spins > 2000) std::this_thread::yield();
  }
  fn_ = nullptr;
}

void parallel_rows(size_t rows, size_t cost, const std::function<void(size_t, size_t)>& fn) {
  // ~16k float ops (a few microseconds) or more: a pool job (~1 us to start and join) pays.
  constexpr size_t kMinWork = 16384;
  SpinPool& pool = SpinPool::get();
  const size_t T = static_cast<size_t>(pool.size());
  if (T <= 1 || rows < 2 || rows * cost < kMinWork) {
    if (rows > 0) fn(0, rows);
    return;
  }
  const size_t chunk = (rows + 2 * T - 1) / (2 * T);
  const int tasks = static_cast<int>((rows + chunk - 1) / chunk);
  pool.run(tasks, [&](int t, int) { fn((size_t)t * chunk, std::min(rows, (size_t)(t + 1) * chunk)); });
}

}  // namespace mlxinfer_cpu
