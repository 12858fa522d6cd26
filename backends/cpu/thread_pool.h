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
  // A job is open from parallel_for's start until all its items are handed out; the caller then waits only for the
  // workers inside it, not for every worker, so one the host has not scheduled since the job began is not waited
  // for. Waiting for every worker to check in, each of TOKEN_SELECT's fifteen or so steps waited for the slowest
  // to wake, item or not: on the H200 host's Xeon with 16 threads beside four busy processes TOKEN_SELECT at 8K keys
  // took 2.4-3.9 ms, 0.6-0.9 this way. A worker enters (inside_ + 1), then takes items only if the job it woke for
  // is still open; the caller closes the job (open_job_ = 0), then waits for inside_ == 0, so no worker touches a
  // job after parallel_for returns. Those stores and loads are sequentially consistent: a worker's enter-then-check
  // against the caller's close-then-wait needs it.
  std::atomic<uint64_t> generation_{0};  // bumped for every parallel_for, so workers know a new job arrived
  std::atomic<uint64_t> open_job_{0};    // the open job's generation; 0: none
  std::atomic<int> inside_{0};           // background workers entered into a job and not yet left
  std::atomic<bool> stopping_{false};

  // The current job: written by the caller while no worker is inside one, read by workers inside the open job.
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t job_items_ = 0;
  std::atomic<int64_t> next_item_{0};
  std::exception_ptr first_error_;
};

}  // namespace sparsa::cpu
