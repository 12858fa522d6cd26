// Fork-join pool: see thread_pool.h.
#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <system_error>

#include "../../src/error.h"

namespace sparsa::cpu {
namespace {

// How long a worker watches for the next job, and the caller for the end of its job, before blocking. TOKEN_SELECT's
// decode runs about fifteen parallel steps; on the 16-core Xeon with 8 threads a step with nothing to do took about
// 50 µs when every step woke blocked workers.
constexpr auto kSpinBeforeBlocking = std::chrono::microseconds(100);
constexpr int kSpinsPerClockRead = 64;

inline void relax_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or kSpinBeforeBlocking has passed; returns done().
template <typename Done>
bool spin_until(const Done& done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeBlocking;
  for (int spins = 1;; ++spins) {
    if (done()) return true;
    relax_cpu();
    if (spins % kSpinsPerClockRead == 0 && std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()),
                                                      SPARSA_MAX_NUM_THREADS));
  }
  num_workers_ = num_threads;
  threads_.reserve(static_cast<size_t>(num_workers_ - 1));
  try {
    for (int w = 1; w < num_workers_; ++w) threads_.emplace_back([this, w] { worker_main(w); });
  } catch (const std::system_error& e) {
    // The system refused a thread (limits, memory): stop the workers already started, then report. Without this
    // the constructor would leave joinable threads behind (std::terminate) or workers waiting forever.
    const size_t started = threads_.size();
    stop_workers();
    fail(SPARSA_STATUS_OUT_OF_MEMORY, "options.num_threads: could not start worker thread ", started + 1, " of ",
         num_workers_ - 1, " (", e.what(), ")");
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  work_ready_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void ThreadPool::run_items(int worker) {
  for (;;) {
    const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
    if (item >= job_items_) return;
    try {
      (*job_)(item, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_error_) first_error_ = std::current_exception();
      next_item_.store(job_items_, std::memory_order_relaxed);  // stop handing out items
    }
  }
}

void ThreadPool::worker_main(int worker) {
  uint64_t seen_generation = 0;
  const auto job_or_stop = [&] {
    return stopping_.load(std::memory_order_acquire) ||
           generation_.load(std::memory_order_acquire) != seen_generation;
  };
  for (;;) {
    if (!spin_until(job_or_stop)) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, job_or_stop);
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    seen_generation = generation_.load(std::memory_order_seq_cst);
    inside_.fetch_add(1, std::memory_order_seq_cst);
    if (open_job_.load(std::memory_order_seq_cst) == seen_generation) run_items(worker);
    // The caller checks the count under mutex_ before it blocks, so the last worker out notifies under mutex_ too.
    if (inside_.fetch_sub(1, std::memory_order_seq_cst) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      work_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (num_workers_ == 1 || n == 1) {
    for (int64_t item = 0; item < n; ++item) fn(item, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_items_ = n;
    next_item_.store(0, std::memory_order_relaxed);
    first_error_ = nullptr;
    // Open before announcing, so that a worker that sees the new generation finds its job open.
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    open_job_.store(generation, std::memory_order_seq_cst);
    generation_.store(generation, std::memory_order_seq_cst);
  }
  work_ready_.notify_all();
  run_items(0);  // returns once every item is handed out: the rest are with workers inside the job
  open_job_.store(0, std::memory_order_seq_cst);
  const auto none_inside = [this] { return inside_.load(std::memory_order_seq_cst) == 0; };
  if (!spin_until(none_inside)) {
    std::unique_lock<std::mutex> lock(mutex_);
    work_done_.wait(lock, none_inside);
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = first_error_;
    first_error_ = nullptr;
    job_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace sparsa::cpu
