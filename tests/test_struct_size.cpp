// The extensible-struct rules of sparsa.h ("Caller-filled structs", the kernel's copy_struct_from_user), played by
// an older and a newer caller with guard bytes after each struct:
//   - an older caller: the struct truncated to its sparsa 0.1 size (SPARSA_*_SIZE_V0_1), guard bytes right after;
//   - a newer caller: a bigger struct (sizeof + kNewerTail) whose unknown tail is zero (accepted) or not (refused
//     with SPARSA_STATUS_STRUCT_SIZE and a message naming the struct and the sizes);
//   - sizes below 0.1's or above SPARSA_STRUCT_SIZE_MAX are refused.
// Every init function and, for each struct, the entry points that read it; guard bytes must stay untouched, a
// refused call writes no output, an accepted one computes what the plain struct computes.
// 0.2 appended no field, so each struct's 0.1 size is still its sizeof; read_caller_struct and
// write_caller_struct (src/caller_struct.h) are also run on a struct with an appended field, where an older caller's struct really is shorter.
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../src/caller_struct.h"

// A struct whose later version appended `appended` (first release: struct_size and `first` only, 8 bytes).
struct appended_struct {
  uint32_t struct_size;
  int32_t first;
  int32_t appended;
  int32_t reserved0;
};
template <>
struct sparsa::CallerStructTraits<appended_struct> {
  static constexpr const char* type_name = "appended_struct";
  static constexpr uint32_t first_size = 8;
};

namespace {

constexpr unsigned char kGuardByte = 0xA5;
constexpr size_t kGuardBytes = 32;
constexpr uint32_t kNewerTail = 16;       // bytes a hypothetical newer sparsa appended
constexpr uint32_t kNonZeroTailByte = 5;  // which of them a newer caller set
constexpr float kPoison = -1234.5f;

enum class Caller { kOlder, kNewerZeroTail, kNewerNonZeroTail, kBelowFirstSize, kAboveMax };
const Caller kCallers[] = {Caller::kOlder, Caller::kNewerZeroTail, Caller::kNewerNonZeroTail, Caller::kBelowFirstSize,
                           Caller::kAboveMax};
const char* caller_name(Caller c) {
  switch (c) {
    case Caller::kOlder:
      return "older (0.1 size)";
    case Caller::kNewerZeroTail:
      return "newer, zero tail";
    case Caller::kNewerNonZeroTail:
      return "newer, non-zero tail";
    case Caller::kBelowFirstSize:
      return "below 0.1 size";
    default:
      return "above SPARSA_STRUCT_SIZE_MAX";
  }
}
bool accepted(Caller c) { return c == Caller::kOlder || c == Caller::kNewerZeroTail; }
// What the refusal's message must contain besides the struct's name.
const char* refusal_words(Caller c) {
  switch (c) {
    case Caller::kNewerNonZeroTail:
      return "is not zero";
    case Caller::kBelowFirstSize:
      return "is below the smallest";
    default:
      return "above SPARSA_STRUCT_SIZE_MAX";
  }
}

template <typename S>
struct Layout;
template <>
struct Layout<sparsa_tensor> {
  static constexpr uint32_t first = SPARSA_TENSOR_SIZE_V0_1;
  static constexpr const char* name = "sparsa_tensor";
};
template <>
struct Layout<sparsa_context_options> {
  static constexpr uint32_t first = SPARSA_CONTEXT_OPTIONS_SIZE_V0_1;
  static constexpr const char* name = "sparsa_context_options";
};
template <>
struct Layout<sparsa_policy> {
  static constexpr uint32_t first = SPARSA_POLICY_SIZE_V0_1;
  static constexpr const char* name = "sparsa_policy";
};
template <>
struct Layout<sparsa_attention_args> {
  static constexpr uint32_t first = SPARSA_ATTENTION_ARGS_SIZE_V0_1;
  static constexpr const char* name = "sparsa_attention_args";
};
template <>
struct Layout<sparsa_sparge_tune_options> {
  static constexpr uint32_t first = SPARSA_SPARGE_TUNE_OPTIONS_SIZE_V0_1;
  static constexpr const char* name = "sparsa_sparge_tune_options";
};

template <typename S>
uint32_t caller_size(Caller c) {
  switch (c) {
    case Caller::kOlder:
      return Layout<S>::first;
    case Caller::kNewerZeroTail:
    case Caller::kNewerNonZeroTail:
      return uint32_t(sizeof(S)) + kNewerTail;
    case Caller::kBelowFirstSize:
      return Layout<S>::first - 4;
    default:
      return SPARSA_STRUCT_SIZE_MAX + 8;
  }
}

// A caller's struct of `size` bytes in a buffer followed by guard bytes. The bytes the caller knows are copied from
// `fields`; a newer caller's unknown tail is zero, except one byte for kNewerNonZeroTail.
template <typename S>
class CallerStruct {
 public:
  CallerStruct(const S& fields, Caller caller) : size_(caller_size<S>(caller)) {
    // An above-max size is only declared, never backed: the library must refuse it before reading past sizeof.
    const size_t backed = caller == Caller::kAboveMax ? sizeof(S) : size_;
    bytes_.assign(backed + kGuardBytes, kGuardByte);
    std::memset(bytes_.data(), 0, backed);
    std::memcpy(bytes_.data(), &fields, std::min<size_t>(backed, sizeof(S)));
    std::memcpy(bytes_.data(), &size_, sizeof size_);  // struct_size is the first field
    if (caller == Caller::kNewerNonZeroTail) bytes_[sizeof(S) + kNonZeroTailByte] = 1;
    backed_ = backed;
  }
  S* get() { return reinterpret_cast<S*>(bytes_.data()); }
  bool guard_intact() const {
    for (size_t i = backed_; i < bytes_.size(); ++i) {
      if (bytes_[i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  uint32_t size_;
  size_t backed_ = 0;
  std::vector<unsigned char> bytes_;
};

// ---- Init functions: exactly `size` bytes written, defaults then zero, refused sizes write nothing --------------

using InitFn = std::function<sparsa_status(void* s, size_t size)>;

template <typename S>
void check_init(const InitFn& init) {
  SCOPED_TRACE(Layout<S>::name);
  S reference;
  ASSERT_EQ(init(&reference, sizeof reference), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ASSERT_EQ(reference.struct_size, sizeof(S));
  for (Caller caller : kCallers) {
    SCOPED_TRACE(caller_name(caller));
    const size_t size = caller_size<S>(caller);
    const size_t backed = caller == Caller::kAboveMax ? sizeof(S) : size;
    std::vector<unsigned char> buffer(backed + kGuardBytes, kGuardByte);
    const sparsa_status status = init(buffer.data(), size);
    for (size_t i = backed; i < buffer.size(); ++i) ASSERT_EQ(buffer[i], kGuardByte) << "guard byte " << i;
    if (caller == Caller::kNewerNonZeroTail) continue;  // the same size as kNewerZeroTail for an init
    if (!accepted(caller)) {
      EXPECT_EQ(status, SPARSA_STATUS_STRUCT_SIZE);
      const std::string message = sparsa_last_error_message();
      EXPECT_NE(message.find(Layout<S>::name), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(size)), std::string::npos) << message;
      for (size_t i = 0; i < backed; ++i) ASSERT_EQ(buffer[i], kGuardByte) << "a refused init wrote byte " << i;
      continue;
    }
    ASSERT_EQ(status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    uint32_t written_size = 0;
    std::memcpy(&written_size, buffer.data(), sizeof written_size);
    EXPECT_EQ(written_size, size);
    // The fields (after struct_size) equal the full-size defaults as far as the caller's size reaches, then zero.
    const auto* expected = reinterpret_cast<const unsigned char*>(&reference);
    for (size_t i = sizeof(uint32_t); i < size; ++i) {
      ASSERT_EQ(buffer[i], i < sizeof(S) ? expected[i] : 0) << "byte " << i;
    }
  }
}

TEST(StructSize, InitWritesExactlyTheCallersSize) {
  float data[6] = {};
  const int64_t shape[2] = {2, 3};
  check_init<sparsa_tensor>([&](void* s, size_t size) {
    return sparsa_tensor_init(static_cast<sparsa_tensor*>(s), size, data, SPARSA_DTYPE_F32, 2, shape);
  });
  check_init<sparsa_context_options>([](void* s, size_t size) {
    return sparsa_context_options_init(static_cast<sparsa_context_options*>(s), size);
  });
  for (int32_t kind = SPARSA_POLICY_DENSE; kind <= SPARSA_POLICY_TOKEN_INDICES; ++kind) {
    SCOPED_TRACE(sparsa_policy_kind_name(kind));
    check_init<sparsa_policy>(
        [kind](void* s, size_t size) { return sparsa_policy_init(static_cast<sparsa_policy*>(s), size, kind); });
  }
  check_init<sparsa_attention_args>([](void* s, size_t size) {
    return sparsa_attention_args_init(static_cast<sparsa_attention_args*>(s), size);
  });
  check_init<sparsa_sparge_tune_options>([](void* s, size_t size) {
    return sparsa_sparge_tune_options_init(static_cast<sparsa_sparge_tune_options*>(s), size);
  });
}

TEST(StructSize, MacrosPassTheCallersSizeof) {
  sparsa_policy p;
  ASSERT_EQ(SPARSA_POLICY_INIT(&p, SPARSA_POLICY_SPARGE), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(p.struct_size, sizeof p);
  EXPECT_EQ(p.reserved0, 0);
  sparsa_attention_args a;
  ASSERT_EQ(SPARSA_ATTENTION_ARGS_INIT(&a), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(a.struct_size, sizeof a);
  sparsa_context_options o;
  ASSERT_EQ(SPARSA_CONTEXT_OPTIONS_INIT(&o), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(o.struct_size, sizeof o);
  EXPECT_EQ(o.reserved0, 0);
  sparsa_sparge_tune_options t;
  ASSERT_EQ(SPARSA_SPARGE_TUNE_OPTIONS_INIT(&t), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(t.struct_size, sizeof t);
  float data[4] = {};
  const int64_t shape[1] = {4};
  sparsa_tensor tensor;
  ASSERT_EQ(SPARSA_TENSOR_INIT(&tensor, data, SPARSA_DTYPE_F32, 1, shape), SPARSA_STATUS_SUCCESS);
  EXPECT_EQ(tensor.struct_size, sizeof tensor);
}

// ---- read_caller_struct / write_caller_struct on a struct with an appended field ----------------------------------

constexpr int32_t kAppendedDefault = 77;
constexpr appended_struct kAppendedDefaults{sizeof(appended_struct), 5, kAppendedDefault, 0};

TEST(StructSize, OlderCallersStructIsReadAndWrittenOnlyUpToItsSize) {
  // An older caller: 8 bytes of struct, then guard bytes where the newer fields would be.
  unsigned char older[8 + kGuardBytes];
  std::memset(older, kGuardByte, sizeof older);
  sparsa::write_caller_struct(older, 8, "older", kAppendedDefaults);  // an init function's write
  for (size_t i = 8; i < sizeof older; ++i) ASSERT_EQ(older[i], kGuardByte) << "init wrote byte " << i;
  uint32_t size = 0;
  int32_t first = 0;
  std::memcpy(&size, older, 4);
  std::memcpy(&first, older + 4, 4);
  EXPECT_EQ(size, 8u);
  EXPECT_EQ(first, 5);
  first = 9;
  std::memcpy(older + 4, &first, 4);
  // The read takes the caller's field and the default of the field it does not have (not the guard bytes).
  const appended_struct read =
      sparsa::read_caller_struct(*reinterpret_cast<const appended_struct*>(older), "older", kAppendedDefaults);
  EXPECT_EQ(read.first, 9);
  EXPECT_EQ(read.appended, kAppendedDefault);
  EXPECT_EQ(read.struct_size, sizeof(appended_struct));  // the library-side copy is complete
  for (size_t i = 8; i < sizeof older; ++i) ASSERT_EQ(older[i], kGuardByte);
  // Below the first release's size: refused, nothing written.
  unsigned char tiny[4 + kGuardBytes];
  std::memset(tiny, kGuardByte, sizeof tiny);
  EXPECT_THROW(sparsa::write_caller_struct(tiny, 4, "tiny", kAppendedDefaults), sparsa::Error);
  for (unsigned char b : tiny) ASSERT_EQ(b, kGuardByte);
}

TEST(StructSize, NewerCallersTailMustBeZero) {
  unsigned char newer[sizeof(appended_struct) + 8 + kGuardBytes];
  std::memset(newer, kGuardByte, sizeof newer);
  sparsa::write_caller_struct(newer, sizeof(appended_struct) + 8, "newer", kAppendedDefaults);
  for (size_t i = sizeof(appended_struct); i < sizeof(appended_struct) + 8; ++i) ASSERT_EQ(newer[i], 0);
  for (size_t i = sizeof(appended_struct) + 8; i < sizeof newer; ++i) ASSERT_EQ(newer[i], kGuardByte);
  const auto* as_struct = reinterpret_cast<const appended_struct*>(newer);
  EXPECT_EQ(sparsa::read_caller_struct(*as_struct, "newer", kAppendedDefaults).appended, kAppendedDefault);
  newer[sizeof(appended_struct) + 7] = 1;
  try {
    sparsa::read_caller_struct(*as_struct, "newer", kAppendedDefaults);
    ADD_FAILURE() << "a non-zero unknown tail was accepted";
  } catch (const sparsa::Error& e) {
    EXPECT_EQ(e.status(), SPARSA_STATUS_STRUCT_SIZE);
    EXPECT_NE(std::string(e.what()).find("newer.struct_size: 24 is larger than this sparsa's appended_struct (16 "
                                         "bytes) and byte 23 past it is not zero"),
              std::string::npos)
        << e.what();
  }
}

// ---- Entry points: each reads each caller struct through its struct_size ------------------------------------------

constexpr int64_t kB = 1, kS = 8, kH = 2, kD = 4;

sparsa_tensor tensor_of(void* data, int32_t dtype, std::vector<int64_t> shape) {
  sparsa_tensor t;
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, data, dtype, int32_t(shape.size()), shape.data()), SPARSA_STATUS_SUCCESS);
  return t;
}

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * float(int(i % 13) - 6);
  return v;
}

class EntryPoints : public testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(sparsa_context_create(nullptr, &ctx_), SPARSA_STATUS_SUCCESS); }
  void TearDown() override { sparsa_context_destroy(ctx_); }

  // Runs `call` once plainly and once per Caller with the struct `swap` replaces, comparing each result with the
  // plain one (accepted) or with an untouched, poisoned output (refused).
  template <typename S>
  void check(const char* what, const std::function<sparsa_status(S* swapped, std::vector<float>* out)>& call,
             const S& plain) {
    SCOPED_TRACE(what);
    std::vector<float> expected;
    S copy = plain;
    ASSERT_EQ(call(&copy, &expected), SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
    for (Caller caller : kCallers) {
      SCOPED_TRACE(caller_name(caller));
      CallerStruct<S> placed(plain, caller);
      std::vector<float> got;
      const sparsa_status status = call(placed.get(), &got);
      EXPECT_TRUE(placed.guard_intact());
      if (accepted(caller)) {
        EXPECT_EQ(status, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
        ASSERT_EQ(got.size(), expected.size());
        // bitwise (memcmp) where there is an output: plan() writes none, and memcmp must not see null pointers
        EXPECT_TRUE(got.empty() || std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);
        continue;
      }
      EXPECT_EQ(status, SPARSA_STATUS_STRUCT_SIZE);
      const std::string message = sparsa_last_error_message();
      EXPECT_NE(message.find(Layout<S>::name), std::string::npos) << message;
      EXPECT_NE(message.find(refusal_words(caller)), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(caller_size<S>(caller))), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(sizeof(S))), std::string::npos) << message;
      for (float x : got) ASSERT_EQ(x, kPoison) << "a refused call wrote its output";
    }
  }

  sparsa_context* ctx_ = nullptr;
};

// The attention run (and plan, and the tuner): args, policy, a tensor in args, a tensor in the policy, an output.
class AttentionRun {
 public:
  AttentionRun()
      : q_(ramp(kB * kS * kH * kD, 0.1f)), k_(ramp(kB * kS * kH * kD, -0.07f)), v_(ramp(kB * kS * kH * kD, 0.05f)),
        mask_(size_t(kB * kH), 1) {
    tq_ = tensor_of(q_.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
    tk_ = tensor_of(k_.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
    tv_ = tensor_of(v_.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
    tmask_ = tensor_of(mask_.data(), SPARSA_DTYPE_U8, {kB, kH, 1, 1});
    EXPECT_EQ(sparsa_attention_args_init(&args_, sizeof args_), SPARSA_STATUS_SUCCESS);
    EXPECT_EQ(sparsa_policy_init(&policy_, sizeof policy_, SPARSA_POLICY_BLOCK_SPARSE), SPARSA_STATUS_SUCCESS);
    policy_.block_q = int32_t(kS);
    policy_.block_k = int32_t(kS);
    policy_.block_mask = &tmask_;
    args_.causal = 1;
  }
  // Runs with the given policy, q and out descriptors (NULL = the plain ones); `out` gets the output, poisoned first.
  sparsa_status run(sparsa_context* ctx, const sparsa_policy* policy, const sparsa_tensor* q,
                    const sparsa_tensor* out_desc, std::vector<float>* out) {
    sparsa_tensor tout;
    sparsa_attention_args a = filled_args(out, &tout);
    if (q) a.q = q;
    if (out_desc) a.out = out_desc;
    return sparsa_attention_run(ctx, &a, policy ? policy : &policy_);
  }
  sparsa_attention_args filled_args(std::vector<float>* out, sparsa_tensor* tout) {
    out->assign(size_t(kB * kS * kH * kD), kPoison);
    *tout = tensor_of(out->data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
    sparsa_attention_args a = args_;
    a.q = &tq_;
    a.k = &tk_;
    a.v = &tv_;
    a.out = tout;
    return a;
  }
  sparsa_policy policy_;
  sparsa_tensor tq_, tk_, tv_, tmask_;

 private:
  std::vector<float> q_, k_, v_;
  std::vector<uint8_t> mask_;
  sparsa_attention_args args_;
};

TEST_F(EntryPoints, AttentionRunReadsEveryStructThroughItsSize) {
  AttentionRun r;
  // args: its tensor pointers are the plain ones; only the args struct itself is the caller's buffer.
  std::vector<float> out_for_args;
  sparsa_tensor tout;
  const sparsa_attention_args args = r.filled_args(&out_for_args, &tout);
  check<sparsa_attention_args>(
      "args",
      [&](sparsa_attention_args* a, std::vector<float>* out) {
        std::fill(out_for_args.begin(), out_for_args.end(), kPoison);
        const sparsa_status s = sparsa_attention_run(ctx_, a, &r.policy_);
        *out = out_for_args;
        return s;
      },
      args);
  check<sparsa_policy>(
      "policy", [&](sparsa_policy* p, std::vector<float>* out) { return r.run(ctx_, p, nullptr, nullptr, out); },
      r.policy_);
  check<sparsa_tensor>(
      "q (a tensor inside args)",
      [&](sparsa_tensor* q, std::vector<float>* out) { return r.run(ctx_, nullptr, q, nullptr, out); }, r.tq_);
  check<sparsa_tensor>(
      "policy.block_mask (a tensor inside the policy)",
      [&](sparsa_tensor* mask, std::vector<float>* out) {
        sparsa_policy p = r.policy_;
        p.block_mask = mask;
        return r.run(ctx_, &p, nullptr, nullptr, out);
      },
      r.tmask_);
  std::vector<float> out_buffer(size_t(kB * kS * kH * kD), kPoison);
  const sparsa_tensor out_desc = tensor_of(out_buffer.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
  check<sparsa_tensor>(
      "out (an output tensor)",
      [&](sparsa_tensor* o, std::vector<float>* out) {
        std::fill(out_buffer.begin(), out_buffer.end(), kPoison);
        std::vector<float> ignored;
        const sparsa_status s = r.run(ctx_, nullptr, nullptr, o, &ignored);
        *out = out_buffer;
        return s;
      },
      out_desc);
}

TEST_F(EntryPoints, PlanReadsArgsAndPolicyThroughTheirSize) {
  AttentionRun r;
  std::vector<float> out_buffer;
  sparsa_tensor tout;
  const sparsa_attention_args args = r.filled_args(&out_buffer, &tout);
  check<sparsa_attention_args>(
      "plan args",
      [&](sparsa_attention_args* a, std::vector<float>* out) {
        out->clear();
        return sparsa_attention_plan(ctx_, a, &r.policy_);
      },
      args);
  check<sparsa_policy>(
      "plan policy",
      [&](sparsa_policy* p, std::vector<float>* out) {
        out->clear();
        sparsa_attention_args a = args;
        return sparsa_attention_plan(ctx_, &a, p);
      },
      r.policy_);
}

TEST_F(EntryPoints, ContextCreateReadsOptionsThroughTheirSize) {
  sparsa_context_options options;
  ASSERT_EQ(sparsa_context_options_init(&options, sizeof options), SPARSA_STATUS_SUCCESS);
  options.num_threads = 1;
  check<sparsa_context_options>(
      "options",
      [](sparsa_context_options* o, std::vector<float>* out) {
        sparsa_context* ctx = reinterpret_cast<sparsa_context*>(0x1);  // must stay untouched on failure
        const sparsa_status s = sparsa_context_create(o, &ctx);
        out->assign(1, s == SPARSA_STATUS_SUCCESS ? 1.f : kPoison);
        if (s == SPARSA_STATUS_SUCCESS) {
          sparsa_context_destroy(ctx);
        } else {
          EXPECT_EQ(ctx, reinterpret_cast<sparsa_context*>(0x1));
        }
        return s;
      },
      options);
}

TEST_F(EntryPoints, SpargeTuneReadsOptionsArgsAndPolicyThroughTheirSize) {
  AttentionRun r;
  std::vector<float> unused;
  sparsa_tensor tout;
  const sparsa_attention_args args = r.filled_args(&unused, &tout);
  sparsa_policy policy;
  ASSERT_EQ(sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_SPARGE), SPARSA_STATUS_SUCCESS);
  policy.block_q = int32_t(kS);
  policy.block_k = int32_t(kS);
  sparsa_sparge_tune_options options;
  ASSERT_EQ(sparsa_sparge_tune_options_init(&options, sizeof options), SPARSA_STATUS_SUCCESS);
  options.search_steps = 2;
  auto tune = [&](const sparsa_attention_args* a, const sparsa_policy* p, const sparsa_sparge_tune_options* o,
                  std::vector<float>* out) {
    out->assign(size_t(kH * 4), kPoison);
    const sparsa_tensor params = tensor_of(out->data(), SPARSA_DTYPE_F32, {kH, 4});
    return sparsa_sparge_tune(ctx_, a, p, o, &params, nullptr);
  };
  check<sparsa_sparge_tune_options>(
      "tune options",
      [&](sparsa_sparge_tune_options* o, std::vector<float>* out) { return tune(&args, &policy, o, out); }, options);
  check<sparsa_attention_args>(
      "tune args", [&](sparsa_attention_args* a, std::vector<float>* out) { return tune(a, &policy, &options, out); },
      args);
  check<sparsa_policy>(
      "tune policy", [&](sparsa_policy* p, std::vector<float>* out) { return tune(&args, p, &options, out); }, policy);
}

TEST_F(EntryPoints, UtilitiesReadTensorsThroughTheirSize) {
  // top-k from scores: an input and an output tensor.
  std::vector<float> scores = ramp(size_t(kB * kH * kS), 0.3f);
  const sparsa_tensor tscores = tensor_of(scores.data(), SPARSA_DTYPE_F32, {kB, kH, kS});
  std::vector<int32_t> indices(size_t(kB * kH * 2));
  const sparsa_tensor tindices = tensor_of(indices.data(), SPARSA_DTYPE_I32, {kB, kH, 2});
  auto topk = [&](const sparsa_tensor* s, const sparsa_tensor* o, std::vector<float>* out) {
    std::fill(indices.begin(), indices.end(), -77);
    const sparsa_status status = sparsa_topk_from_scores(ctx_, s, 2, 1, o);
    out->clear();
    for (int32_t i : indices) out->push_back(i == -77 ? kPoison : float(i));
    return status;
  };
  check<sparsa_tensor>(
      "topk scores", [&](sparsa_tensor* s, std::vector<float>* out) { return topk(s, &tindices, out); }, tscores);
  check<sparsa_tensor>(
      "topk out_indices", [&](sparsa_tensor* o, std::vector<float>* out) { return topk(&tscores, o, out); }, tindices);

  // head mapping (no context).
  std::vector<float> draft = ramp(size_t(2 * 2 * kS), 0.2f), target = ramp(size_t(2 * 3 * kS), -0.1f);
  const sparsa_tensor tdraft = tensor_of(draft.data(), SPARSA_DTYPE_F32, {2, 2, kS});
  const sparsa_tensor ttarget = tensor_of(target.data(), SPARSA_DTYPE_F32, {2, 3, kS});
  check<sparsa_tensor>(
      "head_mapping draft",
      [&](sparsa_tensor* d, std::vector<float>* out) {
        std::vector<int32_t> map(3, -77);
        const sparsa_tensor tmap = tensor_of(map.data(), SPARSA_DTYPE_I32, {3});
        const sparsa_status status = sparsa_head_mapping(d, &ttarget, 2, &tmap);
        out->clear();
        for (int32_t i : map) out->push_back(i == -77 ? kPoison : float(i));
        return status;
      },
      tdraft);

  // drift layer selection (no context).
  std::vector<float> h_in = ramp(size_t(3 * 2 * kD), 0.5f), h_out = ramp(size_t(3 * 2 * kD), 0.4f);
  const sparsa_tensor tin = tensor_of(h_in.data(), SPARSA_DTYPE_F32, {3, 2, kD});
  const sparsa_tensor tout = tensor_of(h_out.data(), SPARSA_DTYPE_F32, {3, 2, kD});
  check<sparsa_tensor>(
      "drift h_in",
      [&](sparsa_tensor* h, std::vector<float>* out) {
        out->assign(3, kPoison);
        const sparsa_tensor ratio = tensor_of(out->data(), SPARSA_DTYPE_F32, {3});
        return sparsa_drift_select_layers(h, &tout, 0.5f, &ratio, nullptr);
      },
      tin);

  // merge of partial states.
  std::vector<float> o_a = ramp(size_t(kB * kS * kH * kD), 0.1f), o_b = ramp(size_t(kB * kS * kH * kD), -0.2f);
  std::vector<float> lse_a = ramp(size_t(kB * kH * kS), 0.3f), lse_b = ramp(size_t(kB * kH * kS), 0.1f);
  const sparsa_tensor to_a = tensor_of(o_a.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
  const sparsa_tensor to_b = tensor_of(o_b.data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
  const sparsa_tensor tl_a = tensor_of(lse_a.data(), SPARSA_DTYPE_F32, {kB, kH, kS});
  const sparsa_tensor tl_b = tensor_of(lse_b.data(), SPARSA_DTYPE_F32, {kB, kH, kS});
  check<sparsa_tensor>(
      "merge o_a",
      [&](sparsa_tensor* a, std::vector<float>* out) {
        out->assign(size_t(kB * kS * kH * kD), kPoison);
        const sparsa_tensor tmerged = tensor_of(out->data(), SPARSA_DTYPE_F32, {kB, kS, kH, kD});
        return sparsa_merge_states(ctx_, a, &tl_a, &to_b, &tl_b, &tmerged, nullptr);
      },
      to_a);
}

}  // namespace
