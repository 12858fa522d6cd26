// A small fork-join pool owned by one CPU backend (one per sparsa_context): num_threads − 1 background workers plus
// the calling thread, which takes part as worker 0. Work items are handed out dynamically (an atomic counter), so
// uneven items (causal query blocks, sparse heads) balance themselves. No global state, no OpenMP.
// A worker that finishes a job watches for the next one for kSpinBeforeBlocking before it blocks, and the caller
// watches for the job's end as long before it blocks: a decode runs several parallel steps back to back, and waking
// blocked threads costs tens of microseconds a step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sparsa::cpu {

class ThreadPool {
 public:
  // num_threads <= 0 means one worker per online core. Throws sparsa::Error (OUT_OF_MEMORY) when a worker thread
  // cannot be started, after joining the ones that were.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_workers_; }

  // Runs fn(item, worker) for every item in [0, n) and returns when all are done. The first exception thrown by
  // any item is rethrown here (the remaining items still run to completion or are skipped, never half-abandoned).
  // Not reentrant: an item must not call parallel_for on the same pool.
  void parallel_for(int64_t n, const std::function<void(int64_t item, int worker)>& fn);

 private:
  void worker_main(int worker);
  void stop_workers() noexcept;  // asks every started worker to leave and joins it
  void run_items(int worker);

  int num_workers_ = 1;
  std::vector<std::thread> threads_;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  // Written under mutex_; read under it or, while spinning, without it (acquire, pairing with the release store).
  std::atomic<uint64_t> generation_{0};  // bumped for every parallel_for, so workers know a new job arrived
  std::atomic<bool> stopping_{false};
  std::atomic<int> busy_workers_{0};  // background workers still inside the current job

  // The current job (valid while a parallel_for is in progress).
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t job_items_ = 0;
  std::atomic<int64_t>* next_item_ = nullptr;
  std::exception_ptr first_error_;
};

}  // namespace sparsa::cpu
