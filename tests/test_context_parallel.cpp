// Context-parallel decode (docs/context_parallel.md), simulated in one process on the CPU backend: the KV cache of
// every sequence is cut by position into G shards, each shard runs the sparsa_cp_select_* steps (TOKEN_SELECT) or
// builds its part of the policy's index set (DENSE, SINK_WINDOW, TOKEN_INDICES), attends to it with LSE, and the
// shards' states are merged with sparsa_merge_states. The oracle is the single-context run over the whole cache:
// TOKEN_SELECT index sets must be equal exactly, outputs within fp32 rounding (kTolF32).
// The shards' step outputs are combined as the collectives would: element-wise max, element-wise int64 sum, and an
// all-gather in reversed shard order (the result must not depend on it).
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "../src/common/fixed_point_sum.h"
#include "test_util.h"

namespace st {
namespace {

SPARSA_BACKEND_SUITE(ContextParallel);

// How the keys of each sequence are cut into shards.
enum class Split { kEven, kRandom };

struct DecodeCase {
  const char* name;
  int B, Hq, Hkv, D;
  std::vector<int> skv;  // per sequence
  int sq;                // query rows of the call (1 = decode)
  int n_init, n_local, top_k;
  bool per_kv_head, scale_scores;
  Pattern pattern;
  int duplicate_keys;    // > 0: that many runs of identical key rows (exact vote ties), some across shard cuts
  int shards;
  Split split;
};

// Per shard: [start, start + length) of every sequence.
struct ShardRange {
  std::vector<int32_t> start, length;
};

std::vector<ShardRange> split_keys(const std::vector<int>& skv, int shards, Split split, Rng& rng) {
  std::vector<ShardRange> out(static_cast<size_t>(shards));
  for (int b = 0; b < int(skv.size()); ++b) {
    std::vector<int> cuts(static_cast<size_t>(shards) + 1);
    cuts[0] = 0;
    cuts[size_t(shards)] = skv[size_t(b)];
    for (int g = 1; g < shards; ++g)
      cuts[size_t(g)] =
          split == Split::kEven ? int(int64_t(skv[size_t(b)]) * g / shards) : rng.integer(0, skv[size_t(b)]);
    std::sort(cuts.begin(), cuts.end());
    for (int g = 0; g < shards; ++g) {
      out[size_t(g)].start.push_back(cuts[size_t(g)]);
      out[size_t(g)].length.push_back(cuts[size_t(g) + 1] - cuts[size_t(g)]);
    }
  }
  return out;
}

// Copies runs of key rows onto earlier rows so that whole candidates tie exactly (every head scores them alike).
void plant_duplicate_keys(ref::Problem& p, int runs, Rng& rng) {
  for (int b = 0; b < p.B; ++b) {
    const int n = p.skv[size_t(b)];
    for (int r = 0; r < runs && n > 2; ++r) {
      const int source = rng.integer(0, n - 1);
      const int copies = rng.integer(1, 6);
      for (int c = 0; c < copies; ++c) {
        const int target = rng.integer(0, n - 1);
        std::copy(p.k_row(b, source, 0), p.k_row(b, source, 0) + size_t(p.Hkv) * p.D,
                  &p.k[size_t(b)][size_t(target) * p.Hkv * p.D]);
      }
    }
  }
}

// Host tensors of a problem (f32, padded) and of its shards.
struct HostKv {
  std::vector<float> k, v;
  std::vector<int32_t> seq_lens;
  int64_t max_len = 1;
};
std::vector<float> queries(const ref::Problem& p) {
  std::vector<float> q;
  for (int b = 0; b < p.B; ++b)
    for (double x : p.q[size_t(b)]) q.push_back(float(x));
  return q;
}
// Keys [start[b], start[b] + length[b]) of every sequence, padded to the longest (at least 1 row).
HostKv gather_keys(const ref::Problem& p, const std::vector<int32_t>& start, const std::vector<int32_t>& length) {
  HostKv kv;
  for (int b = 0; b < p.B; ++b) kv.max_len = std::max<int64_t>(kv.max_len, length[size_t(b)]);
  const size_t row = size_t(p.Hkv) * p.D;
  kv.k.assign(size_t(p.B) * size_t(kv.max_len) * row, 0.f);
  kv.v.assign(kv.k.size(), 0.f);
  for (int b = 0; b < p.B; ++b) {
    for (int t = 0; t < length[size_t(b)]; ++t) {
      for (size_t e = 0; e < row; ++e) {
        const size_t from = size_t(start[size_t(b)] + t) * row + e;
        const size_t to = (size_t(b) * size_t(kv.max_len) + size_t(t)) * row + e;
        kv.k[to] = float(p.k[size_t(b)][from]);
        kv.v[to] = float(p.v[size_t(b)][from]);
      }
    }
    kv.seq_lens.push_back(length[size_t(b)]);
  }
  return kv;
}

// Tensors of one attention call over a HostKv (out/lse owned here).
struct Call {
  sparsa_tensor q, k, v, out, lse, seq_lens;
  std::vector<float> out_data, lse_data;
  sparsa_attention_args args;
  Call(const ref::Problem& p, std::vector<float>& q_data, HostKv& kv) {
    const int64_t sq = p.sq[0];
    q = host_tensor(q_data.data(), SPARSA_DTYPE_F32, {p.B, sq, p.Hq, p.D});
    k = host_tensor(kv.k.data(), SPARSA_DTYPE_F32, {p.B, kv.max_len, p.Hkv, p.D});
    v = host_tensor(kv.v.data(), SPARSA_DTYPE_F32, {p.B, kv.max_len, p.Hkv, p.D});
    out_data.assign(q_data.size(), std::numeric_limits<float>::quiet_NaN());
    lse_data.assign(size_t(p.B) * size_t(p.Hq) * size_t(sq), std::numeric_limits<float>::quiet_NaN());
    out = host_tensor(out_data.data(), SPARSA_DTYPE_F32, {p.B, sq, p.Hq, p.D});
    lse = host_tensor(lse_data.data(), SPARSA_DTYPE_F32, {p.B, p.Hq, sq});
    seq_lens = host_tensor(kv.seq_lens.data(), SPARSA_DTYPE_I32, {p.B});
    args = make_args();
    args.q = &q;
    args.k = &k;
    args.v = &v;
    args.out = &out;
    args.lse = &lse;
    args.seq_lens_k = &seq_lens;
  }
};

// The state of the whole cache after merging the shards: out [B, Sq, Hq, D], lse [B, Hq, Sq].
struct State {
  std::vector<float> out, lse;
};

void merge_into(const Context& ctx, const ref::Problem& p, State& acc, State& shard) {
  const int64_t sq = p.sq[0];
  sparsa_tensor o_a = host_tensor(acc.out.data(), SPARSA_DTYPE_F32, {p.B, sq, p.Hq, p.D});
  sparsa_tensor l_a = host_tensor(acc.lse.data(), SPARSA_DTYPE_F32, {p.B, p.Hq, sq});
  sparsa_tensor o_b = host_tensor(shard.out.data(), SPARSA_DTYPE_F32, {p.B, sq, p.Hq, p.D});
  sparsa_tensor l_b = host_tensor(shard.lse.data(), SPARSA_DTYPE_F32, {p.B, p.Hq, sq});
  ASSERT_EQ(sparsa_merge_states(ctx.get(), &o_a, &l_a, &o_b, &l_b, &o_a, &l_a), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
}

// max |a - b| / max |b| over the whole output.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

sparsa_policy select_policy(const DecodeCase& c) {
  sparsa_policy policy = make_policy(SPARSA_POLICY_TOKEN_SELECT);
  policy.select_n_init = c.n_init;
  policy.select_n_local = c.n_local;
  policy.select_top_k = c.top_k;
  policy.select_per_kv_head = c.per_kv_head ? 1 : 0;
  policy.select_scale_scores = c.scale_scores ? 1 : 0;
  return policy;
}

ref::Problem make_case_problem(const DecodeCase& c, Rng& rng) {
  ref::Problem p = make_problem(c.B, c.Hq, c.Hkv, c.D, std::vector<int>(size_t(c.B), c.sq), c.skv, true);
  fill(p, c.pattern, rng);
  if (c.duplicate_keys > 0) plant_duplicate_keys(p, c.duplicate_keys, rng);
  return p;
}

// Result of the sharded computation: index sets per (b, set) in global positions, and the merged state.
struct ShardedResult {
  std::vector<std::set<int>> sets;
  State state;
};

// One shard's four sparsa_cp_select_* steps, its TOKEN_INDICES run, the combination in between.
ShardedResult run_sharded_token_select(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy,
                                       const std::vector<ShardRange>& shards) {
  const int G = int(shards.size());
  const int64_t B = p.B, Hq = p.Hq, sq = p.sq[0];
  const int64_t n_sets = policy.select_per_kv_head ? p.Hkv : 1;
  const int64_t top_k = policy.select_top_k;
  const int64_t digits = SPARSA_CP_SUM_DIGITS;
  std::vector<float> q_data = queries(p);
  std::vector<int32_t> totals(p.skv.begin(), p.skv.end());
  sparsa_tensor total_t = host_tensor(totals.data(), SPARSA_DTYPE_I32, {B});
  std::vector<HostKv> kv;
  for (const ShardRange& s : shards) kv.push_back(gather_keys(p, s.start, s.length));
  std::vector<std::vector<int32_t>> starts;
  for (const ShardRange& s : shards) starts.push_back(s.start);

  // Step 1, then the max "all-reduce".
  std::vector<double> global_max(size_t(B * Hq), -INFINITY);
  for (int g = 0; g < G; ++g) {
    Call call(p, q_data, kv[size_t(g)]);
    call.args.out = nullptr;  // not needed by the selection steps
    sparsa_tensor start_t = host_tensor(starts[size_t(g)].data(), SPARSA_DTYPE_I32, {B});
    std::vector<double> local(global_max.size(), std::numeric_limits<double>::quiet_NaN());
    sparsa_tensor out_t = host_tensor(local.data(), SPARSA_DTYPE_F64, {B, Hq});
    EXPECT_EQ(sparsa_cp_select_max(ctx.get(), &call.args, &policy, &start_t, &total_t, &out_t), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    for (size_t i = 0; i < local.size(); ++i) global_max[i] = std::max(global_max[i], local[i]);
  }
  sparsa_tensor global_max_t = host_tensor(global_max.data(), SPARSA_DTYPE_F64, {B, Hq});

  // Step 2, then the int64 sum "all-reduce".
  std::vector<int64_t> global_sum(size_t(B * Hq * digits), 0);
  for (int g = 0; g < G; ++g) {
    Call call(p, q_data, kv[size_t(g)]);
    sparsa_tensor start_t = host_tensor(starts[size_t(g)].data(), SPARSA_DTYPE_I32, {B});
    std::vector<int64_t> local(global_sum.size(), -1);
    sparsa_tensor out_t = host_tensor(local.data(), SPARSA_DTYPE_I64, {B, Hq, digits});
    EXPECT_EQ(sparsa_cp_select_sum(ctx.get(), &call.args, &policy, &start_t, &total_t, &global_max_t, &out_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    for (size_t i = 0; i < local.size(); ++i) {
      EXPECT_GE(local[i], 0);
      EXPECT_LT(local[i], int64_t{1} << 32);
      global_sum[i] += local[i];
    }
  }
  sparsa_tensor global_sum_t = host_tensor(global_sum.data(), SPARSA_DTYPE_I64, {B, Hq, digits});

  // Step 3, then the all-gather (reversed shard order).
  const size_t list = size_t(B * n_sets * top_k);
  std::vector<double> all_votes(size_t(G) * list);
  std::vector<int32_t> all_positions(size_t(G) * list);
  for (int g = 0; g < G; ++g) {
    Call call(p, q_data, kv[size_t(g)]);
    sparsa_tensor start_t = host_tensor(starts[size_t(g)].data(), SPARSA_DTYPE_I32, {B});
    const size_t slot = size_t(G - 1 - g) * list;
    sparsa_tensor votes_t = host_tensor(all_votes.data() + slot, SPARSA_DTYPE_F64, {B, n_sets, top_k});
    sparsa_tensor positions_t = host_tensor(all_positions.data() + slot, SPARSA_DTYPE_I32, {B, n_sets, top_k});
    EXPECT_EQ(sparsa_cp_select_topk(ctx.get(), &call.args, &policy, &start_t, &total_t, &global_max_t,
                                    &global_sum_t, &votes_t, &positions_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
  }
  sparsa_tensor all_votes_t = host_tensor(all_votes.data(), SPARSA_DTYPE_F64, {G, B, n_sets, top_k});
  sparsa_tensor all_positions_t = host_tensor(all_positions.data(), SPARSA_DTYPE_I32, {G, B, n_sets, top_k});

  // Step 4 and each shard's TOKEN_INDICES run; merge in shard order.
  ShardedResult result;
  result.sets.resize(size_t(B * n_sets));
  for (int g = 0; g < G; ++g) {
    Call call(p, q_data, kv[size_t(g)]);
    sparsa_tensor start_t = host_tensor(starts[size_t(g)].data(), SPARSA_DTYPE_I32, {B});
    const int64_t cap = kv[size_t(g)].max_len;
    std::vector<int32_t> indices(size_t(B * n_sets * cap), -7);
    sparsa_tensor indices_t = host_tensor(indices.data(), SPARSA_DTYPE_I32, {B, n_sets, cap});
    EXPECT_EQ(sparsa_cp_select_indices(ctx.get(), &call.args, &policy, &start_t, &total_t, &all_votes_t,
                                       &all_positions_t, &indices_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t set = 0; set < n_sets; ++set) {
        for (int64_t i = 0; i < cap; ++i) {
          const int32_t id = indices[size_t((b * n_sets + set) * cap + i)];
          EXPECT_GE(id, -1);
          if (id >= 0) {
            EXPECT_LT(id, shards[size_t(g)].length[size_t(b)]);
            result.sets[size_t(b * n_sets + set)].insert(id + starts[size_t(g)][size_t(b)]);
          }
        }
      }
    }
    sparsa_policy indices_policy = make_policy(SPARSA_POLICY_TOKEN_INDICES);
    indices_policy.indices = &indices_t;
    EXPECT_EQ(sparsa_attention_run(ctx.get(), &call.args, &indices_policy), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    State shard{call.out_data, call.lse_data};
    if (g == 0) {
      result.state = shard;
    } else {
      merge_into(ctx, p, result.state, shard);
    }
  }
  (void)sq;
  return result;
}

// The single-context run over the whole cache: selected sets [B, n_sets, cap] and the state.
struct SingleResult {
  std::vector<std::set<int>> sets;
  State state;
};
SingleResult run_single(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy, int64_t n_sets) {
  std::vector<float> q_data = queries(p);
  std::vector<int32_t> zero(size_t(p.B), 0), lengths(p.skv.begin(), p.skv.end());
  HostKv kv = gather_keys(p, zero, lengths);
  Call call(p, q_data, kv);
  const int64_t cap = kv.max_len;
  std::vector<int32_t> selected(size_t(p.B * n_sets * cap), -7);
  sparsa_tensor selected_t = host_tensor(selected.data(), SPARSA_DTYPE_I32, {p.B, n_sets, cap});
  call.args.selected_indices = &selected_t;
  EXPECT_EQ(sparsa_attention_run(ctx.get(), &call.args, &policy), SPARSA_STATUS_SUCCESS)
      << sparsa_last_error_message();
  SingleResult r;
  r.sets.resize(size_t(p.B * n_sets));
  for (size_t row = 0; row < r.sets.size(); ++row)
    for (int64_t i = 0; i < cap; ++i)
      if (selected[row * size_t(cap) + size_t(i)] >= 0) r.sets[row].insert(selected[row * size_t(cap) + size_t(i)]);
  r.state = State{call.out_data, call.lse_data};
  return r;
}

const std::vector<DecodeCase>& token_select_cases() {
  static const std::vector<DecodeCase> kCases = {
      // name, B, Hq, Hkv, D, skv, sq, n_init, n_local, top_k, per_kv_head, scale, pattern, dups, G, split
      {"random_mha_2", 1, 4, 4, 32, {300}, 1, 8, 16, 32, false, false, Pattern::kRandom, 0, 2, Split::kEven},
      {"random_mha_4", 1, 4, 4, 32, {300}, 1, 8, 16, 32, false, false, Pattern::kRandom, 0, 4, Split::kEven},
      {"sinks_gqa4_4_random_cuts", 2, 8, 2, 32, {257, 400}, 1, 4, 8, 24, false, false, Pattern::kSinks, 0, 4,
       Split::kRandom},
      {"needles_gqa8_ragged_4", 3, 8, 1, 16, {300, 97, 513}, 1, 16, 32, 40, false, false, Pattern::kNeedles, 0, 4,
       Split::kRandom},
      {"band_per_kv_head_2", 2, 8, 2, 32, {350, 211}, 1, 8, 16, 30, true, false, Pattern::kBand, 0, 2, Split::kEven},
      {"per_kv_head_gqa4_4", 1, 8, 2, 32, {500}, 1, 8, 16, 30, true, true, Pattern::kRandom, 0, 4, Split::kRandom},
      {"duplicate_keys_ties_2", 2, 4, 2, 16, {320, 260}, 1, 4, 8, 48, false, false, Pattern::kRandom, 40, 2,
       Split::kRandom},
      {"duplicate_keys_ties_4", 1, 8, 8, 16, {400}, 1, 4, 8, 64, true, false, Pattern::kSinks, 60, 4, Split::kEven},
      {"scaled_scores_3", 1, 4, 1, 64, {450}, 1, 16, 16, 50, false, true, Pattern::kNeedles, 0, 3, Split::kRandom},
      {"dense_fallback_mixed_2", 3, 4, 2, 16, {60, 300, 1}, 1, 8, 16, 40, false, false, Pattern::kRandom, 0, 2,
       Split::kRandom},
      {"chunk_of_three_rows_4", 2, 4, 2, 32, {300, 333}, 3, 8, 16, 32, false, false, Pattern::kBand, 0, 4,
       Split::kRandom},
  };
  return kCases;
}

TEST_P(ContextParallel, TokenSelectSelectionIsTheSingleDeviceOneAndOutputsMatch) {
  int counter = 0;
  for (const DecodeCase& c : token_select_cases()) {
    SCOPED_TRACE(c.name);
    ST_RNG(rng, counter++);
    const ref::Problem p = make_case_problem(c, rng);
    const sparsa_policy policy = select_policy(c);
    const int64_t n_sets = c.per_kv_head ? c.Hkv : 1;
    const SingleResult single = run_single(ctx(), p, policy, n_sets);
    const ShardedResult sharded = run_sharded_token_select(ctx(), p, policy, split_keys(p.skv, c.shards, c.split, rng));
    for (size_t row = 0; row < single.sets.size(); ++row) {
      EXPECT_EQ(sharded.sets[row], single.sets[row]) << "sequence " << row / size_t(n_sets) << " set "
                                                     << row % size_t(n_sets);
    }
    // The chunk case's shards attend causally by their local offset, which is right only for decode (the header's
    // causality note): its selection is compared, its output is not.
    if (c.sq == 1) {
      EXPECT_LE(relative_difference(sharded.state.out, single.state.out), kTolF32);
      EXPECT_LE(relative_difference(sharded.state.lse, single.state.lse), kTolF32);
    }
  }
}

// Every candidate of a sequence has the same key: the whole vote is one tie, broken by position alone.
TEST_P(ContextParallel, TokenSelectAllKeysEqualBreaksTheTieByPositionAcrossShards) {
  for (int shards : {2, 4}) {
    SCOPED_TRACE(shards);
    ST_RNG(rng, shards);
    DecodeCase c{"all_equal", 1, 4, 2, 16, {200}, 1, 4, 4, 20, false, false, Pattern::kRandom, 0, shards,
                 Split::kRandom};
    ref::Problem p = make_case_problem(c, rng);
    for (int t = 1; t < p.skv[0]; ++t)
      std::copy(p.k_row(0, 0, 0), p.k_row(0, 0, 0) + size_t(p.Hkv) * p.D, &p.k[0][size_t(t) * p.Hkv * p.D]);
    const sparsa_policy policy = select_policy(c);
    const ShardedResult sharded = run_sharded_token_select(ctx(), p, policy, split_keys(p.skv, shards, c.split, rng));
    std::set<int> want;
    for (int t = 0; t < c.n_init + c.top_k; ++t) want.insert(t);  // sinks, then the first top_k candidates
    for (int t = p.skv[0] - c.n_local; t < p.skv[0]; ++t) want.insert(t);
    EXPECT_EQ(sharded.sets[0], want);
    EXPECT_EQ(run_single(ctx(), p, policy, 1).sets[0], want);
  }
}

// The normaliser's digits: any order and any split of the terms give the same digits and the same double, close to
// the float64 sum.
TEST(FixedPointSum, IsTheSameInAnyOrderAndSplit) {
  ST_RNG(rng, 0);
  std::vector<double> terms = {1.0, 0.0, 1e-300, 5e-324, 0.5, 0.25, 0.9999999999999999};
  for (int i = 0; i < 5000; ++i) terms.push_back(std::exp(rng.uniform(-60.0, 0.0)));
  double plain = 0;
  for (double t : terms) plain += t;
  const auto digits_of = [](const std::vector<double>& ts, size_t first, size_t last) {
    sparsa::FixedPointSum s;
    for (size_t i = first; i < last; ++i) s.add(ts[i]);
    std::vector<int64_t> d(SPARSA_CP_SUM_DIGITS);
    s.to_digits(d.data());
    return d;
  };
  const std::vector<int64_t> whole = digits_of(terms, 0, terms.size());
  sparsa::FixedPointSum reference;
  ASSERT_TRUE(sparsa::FixedPointSum::from_digits(whole.data(), &reference));
  EXPECT_NEAR(reference.value(), plain, 1e-12 * plain);
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<double> shuffled = terms;
    std::shuffle(shuffled.begin(), shuffled.end(), rng.gen);
    const size_t cut = size_t(rng.integer(0, int(shuffled.size())));
    std::vector<int64_t> a = digits_of(shuffled, 0, cut), b = digits_of(shuffled, cut, shuffled.size());
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    sparsa::FixedPointSum combined;
    ASSERT_TRUE(sparsa::FixedPointSum::from_digits(a.data(), &combined));
    EXPECT_EQ(combined.value(), reference.value());  // bit-identical
  }
  sparsa::FixedPointSum with_nan;
  with_nan.add(0.5);
  with_nan.add(std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(std::isnan(with_nan.value()));
}

// DENSE, SINK_WINDOW and TOKEN_INDICES decode need no selection protocol: each shard attends to its part of the
// policy's index set (the global positions the policy lets the last row see, shifted to local ids) with
// TOKEN_INDICES, and the merged state is the single run's. Written on st::Buffer, so it runs on every backend (the
// GPU path of context-parallel decode for these policies: TOKEN_INDICES with LSE, then merges).
struct KnownSetCase {
  const char* name;
  int kind;
  int shards;
  int Hq, Hkv;
  std::vector<int> skv;
};

// q, k, v, out, lse and seq_lens of one decode call in the context's memory.
struct DeviceCall {
  Buffer q, k, v, out, lse, seq_lens;
  sparsa_tensor q_t, k_t, v_t, out_t, lse_t, seq_lens_t;
  sparsa_attention_args args;
  DeviceCall(const Context& ctx, const ref::Problem& p, const HostKv& kv)
      : q(ctx, SPARSA_DTYPE_F32, {p.B, 1, p.Hq, p.D}),
        k(ctx, SPARSA_DTYPE_F32, {p.B, kv.max_len, p.Hkv, p.D}),
        v(ctx, SPARSA_DTYPE_F32, {p.B, kv.max_len, p.Hkv, p.D}),
        out(ctx, SPARSA_DTYPE_F32, {p.B, 1, p.Hq, p.D}),
        lse(ctx, SPARSA_DTYPE_F32, {p.B, p.Hq, 1}),
        seq_lens(ctx, SPARSA_DTYPE_I32, {p.B}) {
    const std::vector<float> q_data = queries(p);
    std::copy(q_data.begin(), q_data.end(), q.as<float>());
    std::copy(kv.k.begin(), kv.k.end(), k.as<float>());
    std::copy(kv.v.begin(), kv.v.end(), v.as<float>());
    std::copy(kv.seq_lens.begin(), kv.seq_lens.end(), seq_lens.as<int32_t>());
    for (size_t e = 0; e < out.elements(); ++e) out.set(e, std::numeric_limits<double>::quiet_NaN());
    for (size_t e = 0; e < lse.elements(); ++e) lse.set(e, std::numeric_limits<double>::quiet_NaN());
    for (Buffer* b : {&q, &k, &v, &out, &lse, &seq_lens}) b->upload();
    q_t = q.tensor(), k_t = k.tensor(), v_t = v.tensor(), out_t = out.tensor(), lse_t = lse.tensor();
    seq_lens_t = seq_lens.tensor();
    args = make_args();
    args.q = &q_t;
    args.k = &k_t;
    args.v = &v_t;
    args.out = &out_t;
    args.lse = &lse_t;
    args.seq_lens_k = &seq_lens_t;
  }
  std::vector<float> download(Buffer& b) {
    b.download();
    return std::vector<float>(b.as<float>(), b.as<float>() + b.elements());
  }
};

TEST_P(ContextParallel, KnownIndexSetPoliciesMergeToTheSingleDeviceRun) {
  const std::vector<KnownSetCase> cases = {
      {"dense_2", SPARSA_POLICY_DENSE, 2, 4, 4, {300, 77}},
      {"dense_4_gqa4", SPARSA_POLICY_DENSE, 4, 8, 2, {513, 300}},
      {"sink_window_2", SPARSA_POLICY_SINK_WINDOW, 2, 4, 1, {400, 120}},
      {"sink_window_4", SPARSA_POLICY_SINK_WINDOW, 4, 8, 8, {600, 333}},
      {"token_indices_2", SPARSA_POLICY_TOKEN_INDICES, 2, 8, 2, {350, 200}},
      {"token_indices_4", SPARSA_POLICY_TOKEN_INDICES, 4, 4, 4, {500, 260}},
  };
  int counter = 0;
  for (const KnownSetCase& c : cases) {
    SCOPED_TRACE(c.name);
    ST_RNG(rng, counter++);
    const int B = int(c.skv.size()), D = 32, top = 40;
    ref::Problem p = make_problem(B, c.Hq, c.Hkv, D, std::vector<int>(size_t(B), 1), c.skv, true);
    fill(p, Pattern::kNeedles, rng);
    sparsa_policy policy = make_policy(c.kind);
    policy.sink_tokens = 8;
    policy.sink_window = 64;
    // TOKEN_INDICES: per kv head, a random index list of `top` entries with -1 slots and duplicates.
    const int h_idx = c.Hkv;
    Buffer indices(ctx(), SPARSA_DTYPE_I32, {B, h_idx, top});
    int32_t* ids = indices.as<int32_t>();
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < h_idx * top; ++i) ids[size_t(b * h_idx * top + i)] = rng.integer(-1, c.skv[size_t(b)] - 1);
    indices.upload();
    const sparsa_tensor indices_t = indices.tensor();
    if (c.kind == SPARSA_POLICY_TOKEN_INDICES) policy.indices = &indices_t;

    std::vector<int32_t> zero(size_t(B), 0), lengths(p.skv.begin(), p.skv.end());
    DeviceCall single(ctx(), p, gather_keys(p, zero, lengths));
    ASSERT_EQ(sparsa_attention_run(ctx().get(), &single.args, &policy), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    const std::vector<float> want_out = single.download(single.out), want_lse = single.download(single.lse);

    // The global index set of the decode row of (b, index row r): what the policy lets it see.
    const auto visible = [&](int b, int r, int t) {
      const int n = c.skv[size_t(b)];
      switch (c.kind) {
        case SPARSA_POLICY_SINK_WINDOW:
          return t < policy.sink_tokens || (n - 1) - t < policy.sink_window;
        case SPARSA_POLICY_TOKEN_INDICES:
          for (int i = 0; i < top; ++i)
            if (ids[size_t((b * h_idx + r) * top + i)] == t) return true;
          return false;
        default:
          return true;
      }
    };
    // Shard 0's call accumulates the merged state in place.
    const std::vector<ShardRange> shards = split_keys(p.skv, c.shards, Split::kRandom, rng);
    std::vector<std::unique_ptr<DeviceCall>> calls;
    for (int g = 0; g < c.shards; ++g) {
      const ShardRange& s = shards[size_t(g)];
      const HostKv kv = gather_keys(p, s.start, s.length);
      calls.push_back(std::make_unique<DeviceCall>(ctx(), p, kv));
      DeviceCall& call = *calls.back();
      Buffer local(ctx(), SPARSA_DTYPE_I32, {B, h_idx, kv.max_len});
      int32_t* local_ids = local.as<int32_t>();
      std::fill(local_ids, local_ids + local.elements(), -1);
      for (int b = 0; b < B; ++b) {
        for (int r = 0; r < h_idx; ++r) {
          int n = 0;
          for (int t = 0; t < s.length[size_t(b)]; ++t)
            if (visible(b, r, s.start[size_t(b)] + t))
              local_ids[size_t(b * h_idx + r) * size_t(kv.max_len) + size_t(n++)] = t;
        }
      }
      local.upload();
      const sparsa_tensor local_t = local.tensor();
      sparsa_policy shard_policy = make_policy(SPARSA_POLICY_TOKEN_INDICES);
      shard_policy.indices = &local_t;
      ASSERT_EQ(sparsa_attention_run(ctx().get(), &call.args, &shard_policy), SPARSA_STATUS_SUCCESS)
          << sparsa_last_error_message();
      if (g > 0) {
        DeviceCall& acc = *calls.front();
        ASSERT_EQ(sparsa_merge_states(ctx().get(), &acc.out_t, &acc.lse_t, &call.out_t, &call.lse_t, &acc.out_t,
                                      &acc.lse_t),
                  SPARSA_STATUS_SUCCESS)
            << sparsa_last_error_message();
      }
    }
    DeviceCall& merged = *calls.front();
    EXPECT_LE(relative_difference(merged.download(merged.out), want_out), kTolF32);
    EXPECT_LE(relative_difference(merged.download(merged.lse), want_lse), kTolF32);
  }
}

// ---- The steps on every backend: the same bits as the CPU's ----

// kv_start / kv_total live in host memory on every backend (sparsa.h); they are the only host tensors here.
sparsa_tensor shard_positions_tensor(std::vector<int32_t>& values) {
  sparsa_tensor t;
  const int64_t shape[1] = {int64_t(values.size())};
  EXPECT_EQ(sparsa_tensor_init(&t, sizeof t, values.data(), SPARSA_DTYPE_I32, 1, shape), SPARSA_STATUS_SUCCESS);
  return t;
}

uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Everything the four steps produce on one context (every shard's outputs in shard order, the combinations in
// between computed on the host as the collectives would), with q/k/v in `dtype`, all in the context's memory.
struct StepTrace {
  std::vector<uint64_t> max_bits;      // [G, B, Hq]
  std::vector<int64_t> digits;         // [G, B, Hq, digits]
  std::vector<uint64_t> vote_bits;     // [G, B, n_sets, top_k]
  std::vector<int32_t> positions;      // [G, B, n_sets, top_k]
  std::vector<std::set<int>> sets;     // [B · n_sets], global positions
};

StepTrace trace_steps(const Context& ctx, const ref::Problem& p, const sparsa_policy& policy,
                      const std::vector<ShardRange>& shards, int32_t dtype) {
  const int G = int(shards.size());
  const int64_t B = p.B, Hq = p.Hq, sq = p.sq[0], digits = SPARSA_CP_SUM_DIGITS;
  const int64_t n_sets = policy.select_per_kv_head ? p.Hkv : 1, top_k = policy.select_top_k;
  const std::vector<float> q_data = queries(p);
  std::vector<int32_t> totals(p.skv.begin(), p.skv.end());
  const sparsa_tensor total_t = shard_positions_tensor(totals);
  struct Shard {
    std::unique_ptr<Buffer> q, k, seq_lens;
    sparsa_tensor q_t, k_t, seq_lens_t, start_t;
    std::vector<int32_t> start;
    sparsa_attention_args args;
    int64_t cap = 1;
  };
  std::vector<Shard> on(static_cast<size_t>(G));
  for (int g = 0; g < G; ++g) {
    Shard& s = on[size_t(g)];
    const HostKv kv = gather_keys(p, shards[size_t(g)].start, shards[size_t(g)].length);
    s.cap = kv.max_len;
    s.q = std::make_unique<Buffer>(ctx, dtype, std::vector<int64_t>{B, sq, Hq, p.D});
    s.k = std::make_unique<Buffer>(ctx, dtype, std::vector<int64_t>{B, kv.max_len, p.Hkv, p.D});
    s.seq_lens = std::make_unique<Buffer>(ctx, SPARSA_DTYPE_I32, std::vector<int64_t>{B});
    for (size_t e = 0; e < q_data.size(); ++e) s.q->set(e, q_data[e]);
    for (size_t e = 0; e < kv.k.size(); ++e) s.k->set(e, kv.k[e]);
    for (int64_t b = 0; b < B; ++b) s.seq_lens->set(size_t(b), kv.seq_lens[size_t(b)]);
    for (Buffer* b : {s.q.get(), s.k.get(), s.seq_lens.get()}) b->upload();
    s.q_t = s.q->tensor(), s.k_t = s.k->tensor(), s.seq_lens_t = s.seq_lens->tensor();
    s.start = shards[size_t(g)].start;
    s.start_t = shard_positions_tensor(s.start);
    s.args = make_args();
    s.args.q = &s.q_t;
    s.args.k = &s.k_t;
    s.args.v = &s.k_t;  // validated, not read
    s.args.out = nullptr;
    s.args.seq_lens_k = &s.seq_lens_t;
  }
  StepTrace trace;
  // Step 1 and the max "all-reduce".
  std::vector<double> global_max(size_t(B * Hq), -INFINITY);
  for (Shard& s : on) {
    Buffer out(ctx, SPARSA_DTYPE_F64, {B, Hq});
    for (size_t e = 0; e < out.elements(); ++e) out.set(e, std::numeric_limits<double>::quiet_NaN());
    out.upload();
    const sparsa_tensor out_t = out.tensor();
    EXPECT_EQ(sparsa_cp_select_max(ctx.get(), &s.args, &policy, &s.start_t, &total_t, &out_t), SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    out.download();
    for (size_t e = 0; e < global_max.size(); ++e) {
      trace.max_bits.push_back(bits_of(out.as<double>()[e]));
      global_max[e] = std::max(global_max[e], out.as<double>()[e]);
    }
  }
  Buffer global_max_b(ctx, SPARSA_DTYPE_F64, {B, Hq});
  std::copy(global_max.begin(), global_max.end(), global_max_b.as<double>());
  global_max_b.upload();
  const sparsa_tensor global_max_t = global_max_b.tensor();
  // Step 2 and the int64 sum "all-reduce".
  Buffer global_sum_b(ctx, SPARSA_DTYPE_I64, {B, Hq, digits});
  std::fill(global_sum_b.as<int64_t>(), global_sum_b.as<int64_t>() + global_sum_b.elements(), 0);
  for (Shard& s : on) {
    Buffer out(ctx, SPARSA_DTYPE_I64, {B, Hq, digits});
    std::fill(out.as<int64_t>(), out.as<int64_t>() + out.elements(), -1);
    out.upload();
    const sparsa_tensor out_t = out.tensor();
    EXPECT_EQ(sparsa_cp_select_sum(ctx.get(), &s.args, &policy, &s.start_t, &total_t, &global_max_t, &out_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    out.download();
    for (size_t e = 0; e < out.elements(); ++e) {
      trace.digits.push_back(out.as<int64_t>()[e]);
      global_sum_b.as<int64_t>()[e] += out.as<int64_t>()[e];
    }
  }
  global_sum_b.upload();
  const sparsa_tensor global_sum_t = global_sum_b.tensor();
  // Step 3 and the all-gather (reversed shard order).
  const size_t list = size_t(B * n_sets * top_k);
  Buffer all_votes(ctx, SPARSA_DTYPE_F64, {G, B, n_sets, top_k});
  Buffer all_positions(ctx, SPARSA_DTYPE_I32, {G, B, n_sets, top_k});
  for (int g = 0; g < G; ++g) {
    Buffer votes(ctx, SPARSA_DTYPE_F64, {B, n_sets, top_k}), positions(ctx, SPARSA_DTYPE_I32, {B, n_sets, top_k});
    std::fill(votes.as<double>(), votes.as<double>() + list, std::numeric_limits<double>::quiet_NaN());
    std::fill(positions.as<int32_t>(), positions.as<int32_t>() + list, -7);
    votes.upload();
    positions.upload();
    const sparsa_tensor votes_t = votes.tensor(), positions_t = positions.tensor();
    Shard& s = on[size_t(g)];
    EXPECT_EQ(sparsa_cp_select_topk(ctx.get(), &s.args, &policy, &s.start_t, &total_t, &global_max_t, &global_sum_t,
                                    &votes_t, &positions_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    votes.download();
    positions.download();
    const size_t slot = size_t(G - 1 - g) * list;
    for (size_t e = 0; e < list; ++e) {
      trace.vote_bits.push_back(bits_of(votes.as<double>()[e]));
      trace.positions.push_back(positions.as<int32_t>()[e]);
      all_votes.as<double>()[slot + e] = votes.as<double>()[e];
      all_positions.as<int32_t>()[slot + e] = positions.as<int32_t>()[e];
    }
  }
  all_votes.upload();
  all_positions.upload();
  const sparsa_tensor all_votes_t = all_votes.tensor(), all_positions_t = all_positions.tensor();
  // Step 4.
  trace.sets.resize(size_t(B * n_sets));
  for (int g = 0; g < G; ++g) {
    Shard& s = on[size_t(g)];
    Buffer indices(ctx, SPARSA_DTYPE_I32, {B, n_sets, s.cap});
    std::fill(indices.as<int32_t>(), indices.as<int32_t>() + indices.elements(), -7);
    indices.upload();
    const sparsa_tensor indices_t = indices.tensor();
    EXPECT_EQ(sparsa_cp_select_indices(ctx.get(), &s.args, &policy, &s.start_t, &total_t, &all_votes_t,
                                       &all_positions_t, &indices_t),
              SPARSA_STATUS_SUCCESS)
        << sparsa_last_error_message();
    indices.download();
    for (size_t row = 0; row < trace.sets.size(); ++row) {
      for (int64_t i = 0; i < s.cap; ++i) {
        const int32_t id = indices.as<int32_t>()[row * size_t(s.cap) + size_t(i)];
        EXPECT_GE(id, -1);
        if (id >= 0) trace.sets[row].insert(id + s.start[row / size_t(n_sets)]);
      }
    }
  }
  return trace;
}

// Every step's output on this backend, with fp32, fp16 and bf16 q/k/v, equals the CPU backend's on the same values
// (fp32 tensors of the rounded inputs) bit for bit: maxima, fixed-point digits, votes, positions and index sets. On
// the CPU this checks the half-precision paths against the fp32 one; on a GPU it is the device steps' contract
// (gpu_cp_select.cu), and with TokenSelectSelectionIsTheSingleDeviceOneAndOutputsMatch (CPU: sharded == single) it
// makes the device shards' selection the single-device oracle's.
TEST_P(ContextParallel, TokenSelectStepsGiveTheCpuStepsBits) {
  const Context cpu(SPARSA_DEVICE_CPU);
  ASSERT_EQ(cpu.status(), SPARSA_STATUS_SUCCESS);
  int counter = 0;
  for (const DecodeCase& c : token_select_cases()) {
    for (int32_t dtype : {SPARSA_DTYPE_F32, SPARSA_DTYPE_F16, SPARSA_DTYPE_BF16}) {
      SCOPED_TRACE(std::string(c.name) + " dtype " + std::to_string(dtype));
      ST_RNG(rng, counter++);
      const ref::Problem p = rounded(make_case_problem(c, rng), dtype);
      const sparsa_policy policy = select_policy(c);
      const std::vector<ShardRange> shards = split_keys(p.skv, c.shards, c.split, rng);
      const StepTrace want = trace_steps(cpu, p, policy, shards, SPARSA_DTYPE_F32);
      const StepTrace got = trace_steps(ctx(), p, policy, shards, dtype);
      EXPECT_EQ(got.max_bits, want.max_bits);
      EXPECT_EQ(got.digits, want.digits);
      EXPECT_EQ(got.vote_bits, want.vote_bits);
      EXPECT_EQ(got.positions, want.positions);
      EXPECT_EQ(got.sets, want.sets);
    }
  }
}

// Argument errors name the argument and write nothing.
TEST_P(ContextParallel, ArgumentErrorsWriteNothing) {
  ST_RNG(rng, 0);
  const DecodeCase c{"errors", 1, 4, 2, 16, {200}, 1, 4, 4, 20, false, false, Pattern::kRandom, 0, 2, Split::kEven};
  const ref::Problem p = make_case_problem(c, rng);
  sparsa_policy policy = select_policy(c);
  std::vector<float> q_data = queries(p);
  std::vector<int32_t> start = {100}, length = {100}, total = {200};
  HostKv kv = gather_keys(p, start, length);
  Call call(p, q_data, kv);
  sparsa_tensor start_t = host_tensor(start.data(), SPARSA_DTYPE_I32, {1});
  sparsa_tensor total_t = host_tensor(total.data(), SPARSA_DTYPE_I32, {1});
  std::vector<double> max_out(4, 42.0);
  sparsa_tensor max_t = host_tensor(max_out.data(), SPARSA_DTYPE_F64, {1, 4});
  const auto untouched = [&] {
    return std::all_of(max_out.begin(), max_out.end(), [](double x) { return x == 42.0; });
  };

  sparsa_policy dense = make_policy(SPARSA_POLICY_DENSE);
  EXPECT_EQ(sparsa_cp_select_max(ctx().get(), &call.args, &dense, &start_t, &total_t, &max_t),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("policy.kind"), std::string::npos);

  std::vector<int32_t> short_total = {150};
  sparsa_tensor short_total_t = host_tensor(short_total.data(), SPARSA_DTYPE_I32, {1});
  EXPECT_EQ(sparsa_cp_select_max(ctx().get(), &call.args, &policy, &start_t, &short_total_t, &max_t),
            SPARSA_STATUS_INDEX_OUT_OF_RANGE);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("kv_start/kv_total"), std::string::npos);

  SelectionCache cache(ctx(), 1, 4, 2, 16, 20);
  sparsa_attention_args with_cache = call.args;
  with_cache.selection_cache = cache.get();
  EXPECT_EQ(sparsa_cp_select_max(ctx().get(), &with_cache, &policy, &start_t, &total_t, &max_t),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("selection_cache"), std::string::npos);

  std::vector<double> wrong(8, 42.0);
  sparsa_tensor wrong_t = host_tensor(wrong.data(), SPARSA_DTYPE_F64, {2, 4});
  EXPECT_EQ(sparsa_cp_select_max(ctx().get(), &call.args, &policy, &start_t, &total_t, &wrong_t),
            SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("out_max"), std::string::npos);
  EXPECT_TRUE(untouched());

  // Step 4: a cap below the shard's possible set, and gathered lists with too few candidates.
  std::vector<double> votes(20, -INFINITY);
  std::vector<int32_t> positions(20, -1);
  sparsa_tensor votes_t = host_tensor(votes.data(), SPARSA_DTYPE_F64, {1, 1, 1, 20});
  sparsa_tensor positions_t = host_tensor(positions.data(), SPARSA_DTYPE_I32, {1, 1, 1, 20});
  std::vector<int32_t> small(5, 42), enough(100, 42);
  sparsa_tensor small_t = host_tensor(small.data(), SPARSA_DTYPE_I32, {1, 1, 5});
  sparsa_tensor enough_t = host_tensor(enough.data(), SPARSA_DTYPE_I32, {1, 1, 100});
  EXPECT_EQ(sparsa_cp_select_indices(ctx().get(), &call.args, &policy, &start_t, &total_t, &votes_t, &positions_t,
                                     &small_t),
            SPARSA_STATUS_SHAPE_MISMATCH);
  EXPECT_EQ(sparsa_cp_select_indices(ctx().get(), &call.args, &policy, &start_t, &total_t, &votes_t, &positions_t,
                                     &enough_t),
            SPARSA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("top_k"), std::string::npos);
  EXPECT_TRUE(std::all_of(small.begin(), small.end(), [](int32_t x) { return x == 42; }));
  EXPECT_TRUE(std::all_of(enough.begin(), enough.end(), [](int32_t x) { return x == 42; }));
}

}  // namespace
}  // namespace st
