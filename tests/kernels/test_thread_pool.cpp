// The CPU backend's fork-join pool (backends/cpu/thread_pool.h): every item of every job runs exactly once, on a
// worker index of the pool, and parallel_for returns only after all of them; an item's exception comes back from
// parallel_for, no item runs twice, and the pool keeps serving jobs. Pools larger than the machine's cores make
// workers wake late, which is when a job must neither wait for them nor let them touch it after it returned (the
// TSan preset runs this too).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace {

using sparsa::cpu::ThreadPool;

struct PoolCase {
  int threads;
  int jobs;
};

const std::vector<PoolCase> kCases = {{1, 200}, {2, 2000}, {3, 2000}, {8, 2000}, {16, 1000}};

TEST(ThreadPool, EveryItemOfEveryJobRunsOnceOnAWorkerOfThePool) {
  for (const PoolCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << c.threads << " threads");
    ThreadPool pool(c.threads);
    ASSERT_EQ(pool.size(), c.threads);
    std::mt19937 rng(uint32_t(c.threads));
    for (int job = 0; job < c.jobs; ++job) {
      const int n = int(rng() % 40) + 1;
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      std::atomic<int> bad_worker{0};
      pool.parallel_for(n, [&](int64_t item, int worker) {
        if (worker < 0 || worker >= c.threads) bad_worker.fetch_add(1);
        runs[static_cast<size_t>(item)].fetch_add(1);
      });
      ASSERT_EQ(bad_worker.load(), 0) << "job " << job;
      for (int item = 0; item < n; ++item) ASSERT_EQ(runs[static_cast<size_t>(item)].load(), 1) << "job " << job;
    }
  }
}

TEST(ThreadPool, AnItemsExceptionComesBackAndThePoolKeepsWorking) {
  for (const PoolCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << c.threads << " threads");
    ThreadPool pool(c.threads);
    std::mt19937 rng(uint32_t(100 + c.threads));
    for (int job = 0; job < c.jobs; ++job) {
      const int n = int(rng() % 40) + 1;
      const int throwing = job % 2 == 0 ? int(rng() % uint32_t(n)) : -1;
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      bool thrown = false;
      try {
        pool.parallel_for(n, [&](int64_t item, int) {
          runs[static_cast<size_t>(item)].fetch_add(1);
          if (item == throwing) throw std::runtime_error("item failed");
        });
      } catch (const std::runtime_error&) {
        thrown = true;
      }
      ASSERT_EQ(thrown, throwing >= 0) << "job " << job;
      for (int item = 0; item < n; ++item) {
        const int count = runs[static_cast<size_t>(item)].load();
        if (throwing < 0 || item == throwing) {
          ASSERT_EQ(count, 1) << "job " << job << " item " << item;
        } else {
          ASSERT_LE(count, 1) << "job " << job << " item " << item;  // items after a failure may be skipped
        }
      }
    }
  }
}

}  // namespace
