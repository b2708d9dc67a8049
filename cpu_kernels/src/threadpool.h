// A small persistent thread pool tuned for decode: ~200 tiny matmuls per token, so waking
// workers must cost microseconds. Workers spin briefly after each job before sleeping.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxinfer_cpu {

class SpinPool {
 public:
  static SpinPool& get();
  ~SpinPool();

  // Total threads that run a job, the calling thread included.
  int size() const { return size_; }
  void set_size(int n);

  // Runs fn(task, thread_index) for task in [0, ntasks); the caller takes part. Blocks until done.
  void run(int ntasks, const std::function<void(int, int)>& fn);

 private:
  SpinPool();
  void start(int nthreads);
  void stop();
  void worker_loop(int index, uint64_t seen);
  void work(uint64_t gen, int thread_index);

  int size_{1};
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time; a concurrent caller runs its job alone
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  // Job word: generation (24 bits) | ntasks (20 bits) | next unclaimed task (20 bits). Claiming a
  // task with one CAS means a worker that wakes late can never take a task of a newer job.
  std::atomic<uint64_t> job_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> quit_{false};
  const std::function<void(int, int)>* fn_{nullptr};
};

// fn(r0, r1) over rows [0, rows): on the pool in about two chunks a thread when rows x cost (about the float ops a
// row takes) is worth waking the other threads (a prompt's rows), else inline in one call (a decode step's row).
// For the row-wise work between a layer's matmuls (norms, RoPE, activations, residuals): serial, it left the
// other threads idle for ~30% of a small model's prefill. Call it outside pool tasks (a nested call runs inline).
void parallel_rows(size_t rows, size_t cost, const std::function<void(size_t, size_t)>& fn);

}  // namespace mlxinfer_cpu
