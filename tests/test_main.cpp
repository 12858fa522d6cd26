// Entry point of sparsa_tests: gtest with the skip audit (expected_skips.h), so that a skip no entry of the checked
// list allows fails its test, and a list entry that names no test fails the run.
#include <gtest/gtest.h>

#include <iostream>

#include "expected_skips.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string stale = st::stale_expected_skip();
  if (!stale.empty()) {
    std::cerr << "tests/expected_skips.cpp: stale entry: " << stale << "\n";
    return 1;
  }
  // Appended listeners see OnTestEnd before gtest's printer, which then reports the audited result.
  ::testing::UnitTest::GetInstance()->listeners().Append(new st::SkipAudit);
  return RUN_ALL_TESTS();
}
