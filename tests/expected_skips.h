// The checked list of expected skips. A test may skip only where this list names it (by test and backend) with the
// reason its skip message gives; any other skip, including a backend's unexpected SPARSA_STATUS_UNSUPPORTED, fails
// the test (SkipAudit, installed by tests/test_main.cpp). The table itself lives in expected_skips.cpp.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace st {

enum class SkipKind {
  // BackendTest skips the test on this backend before its body runs (host memory handed to a device context,
  // checks a backend cannot make by design, a rule of device memory on the CPU backend).
  kNotRunHere,
  // The test runs and may skip with this reason (backend unavailable on this machine, an UNSUPPORTED answer).
  kMaySkip,
};

struct ExpectedSkip {
  const char* test;     // "Suite.Name" (a case table: "Suite.Name/row") without the "Backends/" prefix and the
                        // backend suffix ("/CPU", "/CUDA"; a table's "_CPU", "_CUDA"); "*" = any
  const char* backend;  // "CPU", "CUDA", or "*" (any backend, and tests that are not backend-parameterised)
  SkipKind kind;
  const char* reason;   // the skip message must contain this text
  const char* why;      // why the skip is expected
};

// The test's "Suite.Name" and backend ("" for a test that is not backend-parameterised).
struct TestId {
  std::string test, backend;
};
TestId test_id(const ::testing::TestInfo& info);

// The entry that allows a skip of `id` with `message`, or nullptr.
const ExpectedSkip* find_expected_skip(const TestId& id, const std::string& message);
// The kNotRunHere entry of `id`, or nullptr.
const ExpectedSkip* not_run_here(const TestId& id);

// Every table entry must name a registered test and a known backend; returns a description of the first that does
// not, or an empty string.
std::string stale_expected_skip();

// Turns a skip that no entry allows into a failure (a listener runs before gtest's printer, so the test is reported
// FAILED, not SKIPPED).
class SkipAudit : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override;
};

}  // namespace st
