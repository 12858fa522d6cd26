// The checked list of expected skips (see expected_skips.h). Add a row only with the reason the skip is right; a
// backend that starts refusing a case shows up as a failed test until the refusal is either fixed or listed here.
#include "expected_skips.h"

#include <cstring>
#include <vector>

namespace st {

namespace {

constexpr const char* kHostMemory = "passes host memory (host_tensor)";
constexpr const char* kHostMemoryWhy =
    "hands host pointers to the context (utilities and argument checks written against host memory): CPU-only by "
    "design, see host_tensor in test_util.h";

constexpr const char* kContextParallelWhy =
    "simulates the shards in host memory against the single-context CPU run; on the CUDA backend the same steps "
    "run in ContextParallel.TokenSelectStepsGiveTheCpuStepsBits (device memory, bit-compared with the CPU steps)";

const std::vector<ExpectedSkip>& table() {
  static const std::vector<ExpectedSkip> kTable = {
      // A CUDA instance needs a CUDA build and a device.
      {"*", "CUDA", SkipKind::kMaySkip, "but sparsa was built without CUDA", "this build has no CUDA backend"},
      {"*", "CUDA", SkipKind::kMaySkip, "backend: no usable device", "this machine has no CUDA driver or device"},
      {"ContractEdgeCases.ContextCreateReturnsWhenAThreadCannotStart", "*", SkipKind::kMaySkip,
       "address-space limits do not apply under ASan/TSan",
       "the sanitizers reserve shadow memory up front, so an address-space limit cannot make only thread creation "
       "fail; the gcc, clang and aarch64 runs of the suite execute it"},
      {"ApiContext.CudaWithoutCudaIsUnavailableWithAMessage", "*", SkipKind::kMaySkip,
       "this build and machine have CUDA", "the test checks the message of a build or machine without CUDA"},

      // Host memory (the 14 CUDA instances that are CPU-only by design).
      {"BlockSparse.MaskIsRequiredAndMustHaveTheBlockGridShape", "CUDA", SkipKind::kNotRunHere, kHostMemory,
       kHostMemoryWhy},
      {"Common.ErrorsWriteNothingAndNameTheArgument", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Dense.NullPolicyMeansDense", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Layouts.NonUnitLastStrideIsAShapeMismatch", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Layouts.PageIdOutsideTheCacheIsAnIndexError", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Merge.MatchesTheFormulaIncludingMinusInfStates", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Merge.InPlaceAliasingAndNullOutLse", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Merge.PackedLayoutUsesLseOfShapeHeadsByTokens", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Merge.ShapeMismatchWritesNothing", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"Merge.TwoKeyHalvesMergedEqualDense", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"TopK.KOutsideOneToCountIsAShapeMismatch", "CUDA", SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"KvPrefetch.GathersTheSortedUnionAndRemapsIndicesThenDecodeMatchesTheFullCache", "CUDA",
       SkipKind::kNotRunHere, kHostMemory, kHostMemoryWhy},
      {"KvPrefetch.CompactBufferTooSmallIsAShapeMismatch", "CUDA", SkipKind::kNotRunHere, kHostMemory,
       kHostMemoryWhy},
      {"HeadMapping.PicksTheDraftHeadWithTheLargestSummedTopKOverlap", "CUDA", SkipKind::kNotRunHere, kHostMemory,
       kHostMemoryWhy},

      // Context-parallel TOKEN_SELECT written against host memory (the CPU oracle's side of the protocol); the
      // device steps are compared with the CPU steps by ContextParallel.TokenSelectStepsGiveTheCpuStepsBits, and the
      // decode of the other policies (KnownIndexSetPoliciesMergeToTheSingleDeviceRun) runs on every backend.
      {"ContextParallel.TokenSelectSelectionIsTheSingleDeviceOneAndOutputsMatch", "CUDA", SkipKind::kNotRunHere,
       kHostMemory, kContextParallelWhy},
      {"ContextParallel.TokenSelectAllKeysEqualBreaksTheTieByPositionAcrossShards", "CUDA", SkipKind::kNotRunHere,
       kHostMemory, kContextParallelWhy},
      {"ContextParallel.ArgumentErrorsWriteNothing", "CUDA", SkipKind::kNotRunHere, kHostMemory, kContextParallelWhy},

      // Checks a GPU backend does not make by design.
      {"TokenIndices.IndexOutsideItsRangeIsAnErrorNotACrash", "CUDA", SkipKind::kNotRunHere,
       "device index contents are not validated",
       "checking index contents in device memory would need a host synchronisation inside the run, which the ABI "
       "forbids (rule 9); GPU backends ignore such ids instead (docs/gpu.md)"},
      {"TokenIndices.IdsOutsideTheirRangeInDeviceMemoryActAsUnusedSlots", "CPU", SkipKind::kNotRunHere,
       "index contents in host memory are validated",
       "the CPU backend reads its index tensors in host memory and refuses an id outside its range (sparsa.h, "
       "TOKEN_INDICES `indices`), which TokenIndices.IndexOutsideItsRangeIsAnErrorNotACrash checks; the device-memory "
       "rule (ignored like -1) exists only on GPU backends"},
      {"Sparge.IntrospectionMaskIsUnsupportedForOtherPolicies", "CUDA", SkipKind::kMaySkip,
       "block_mask_out",
       "the test asks for SPARGE's mask from DENSE; the GPU backend refuses it with UNSUPPORTED, which the harness "
       "turns into a skip on non-CPU backends"},
  };
  return kTable;
}

bool matches(const ExpectedSkip& e, const TestId& id) {
  const bool test_ok = std::strcmp(e.test, "*") == 0 || id.test == e.test;
  const bool backend_ok = std::strcmp(e.backend, "*") == 0 || id.backend == e.backend;
  return test_ok && backend_ok;
}

}  // namespace

TestId test_id(const ::testing::TestInfo& info) {
  std::string suite = info.test_suite_name(), name = info.name();
  const size_t slash = suite.find('/');
  if (slash != std::string::npos) suite = suite.substr(slash + 1);  // "Backends/Dense" -> "Dense"
  TestId id;
  const size_t last = name.rfind('/');
  if (info.value_param() != nullptr && last != std::string::npos) {  // "Case/CUDA" -> "Case", "CUDA"
    id.backend = name.substr(last + 1);
    name = name.substr(0, last);
    // A case table's "Case/<row>_<backend>" (BackendCaseTest) -> "Case/<row>", "<backend>".
    const size_t underscore = id.backend.rfind('_');
    if (underscore != std::string::npos) {
      name += "/" + id.backend.substr(0, underscore);
      id.backend = id.backend.substr(underscore + 1);
    }
  }
  id.test = suite + "." + name;
  return id;
}

const ExpectedSkip* find_expected_skip(const TestId& id, const std::string& message) {
  for (const ExpectedSkip& e : table()) {
    if (matches(e, id) && message.find(e.reason) != std::string::npos) return &e;
  }
  return nullptr;
}

const ExpectedSkip* not_run_here(const TestId& id) {
  for (const ExpectedSkip& e : table()) {
    if (e.kind == SkipKind::kNotRunHere && matches(e, id)) return &e;
  }
  return nullptr;
}

std::string stale_expected_skip() {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (const ExpectedSkip& e : table()) {
    const bool known_backend = std::strcmp(e.backend, "*") == 0 || std::strcmp(e.backend, "CPU") == 0 ||
                               std::strcmp(e.backend, "CUDA") == 0;
    if (!known_backend) return std::string(e.test) + ": unknown backend " + e.backend;
    bool found = std::strcmp(e.test, "*") == 0;
    for (int s = 0; s < unit.total_test_suite_count() && !found; ++s) {
      const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
      for (int t = 0; t < suite.total_test_count() && !found; ++t) found = matches(e, test_id(*suite.GetTestInfo(t)));
    }
    if (!found) return std::string(e.test) + " on " + e.backend + ": no such test";
  }
  return "";
}

void SkipAudit::OnTestEnd(const ::testing::TestInfo& info) {
  const ::testing::TestResult& result = *info.result();
  if (!result.Skipped()) return;
  std::string message;
  for (int i = 0; i < result.total_part_count(); ++i) {
    if (result.GetTestPartResult(i).skipped()) {
      message = result.GetTestPartResult(i).message();
      break;
    }
  }
  const TestId id = test_id(info);
  if (find_expected_skip(id, message) == nullptr) {
    ADD_FAILURE() << "unexpected skip of " << id.test << (id.backend.empty() ? "" : " on ") << id.backend << ": \""
                  << message << "\"; fix the cause, or list the skip with its reason in tests/expected_skips.cpp";
  }
}

}  // namespace st
