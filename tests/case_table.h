// The attention case table: one row per case (shape, layout, policy, inputs pattern, tolerance), run on every
// backend by SPARSA_BACKEND_TABLE (test_util.h) in the manner of ggml's test-backend-ops. A row's check runs the case
// through the st harness (every layout, poisoned outputs, writes checked) and compares it with the float64 reference
// (tests/reference) per element at the row's tolerance; on a non-CPU backend it also compares with the CPU backend.
// Rows are written as one chained expression each, e.g.
//   prefill_row("dense_bf16_d128_causal", SPARSA_DTYPE_BF16).heads(8, 2).dim(128).lengths({77}, {301}).causal()
#pragma once

#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "test_util.h"

namespace st {

// Per-element bounds: |o − ref| <= out + out_rel·|ref|; |lse − ref| <= max(lse_floor, lse_abs + lse_rel·|ref|), −inf
// exactly. Against the CPU backend (non-CPU rows): |o − o_cpu| <= out_vs_cpu + out_rel·|o_cpu|, the LSE bound likewise.
struct Tolerance {
  double out = 0, out_vs_cpu = 0, out_rel = 0;
  double lse_abs = 0, lse_rel = 0, lse_floor = 0;
  double lse_bound(double want) const;
};
// The GPU kernels' tolerances by output dtype: out 2e-4 (f32), 4e-3 (f16), 3e-2 (bf16).
double kernel_out_tolerance(int32_t dtype);
// Prefill and mixed shapes: LSE within 1e-3 + 1e-4·|ref|; against the CPU backend within twice `out`.
Tolerance prefill_tolerance(int32_t dtype);
// Decode shapes and TOKEN_INDICES: LSE within 1e-3·max(1, |ref|); against the CPU backend within `out`.
Tolerance decode_tolerance(int32_t dtype);
// TOKEN_SELECT rows: out within t·(1 + |ref|), t = 1e-4 (f32), 4e-3 (f16), 3e-2 (bf16); LSE within 2e-3·(1 + |ref|).
Tolerance select_tolerance(int32_t dtype);
// TOKEN_SPARSE rows: out within twice the kernel tolerance (4e-4 / 8e-3 / 6e-2) against the reference (over the
// backend's own sets off the CPU) and against the CPU backend; LSE within 1e-3 + 1e-4·|ref|.
Tolerance token_sparse_tolerance(int32_t dtype);
// Δ rows: out 4e-4 (f32), 8e-3 (f16), 6e-2 (bf16), both against the reference and the CPU backend (the GPU corrects
// the base rows in out's dtype, the CPU stages them in f32); no LSE.
Tolerance delta_tolerance(int32_t dtype);

// BLOCK_SPARSE masks beyond the random one (each cell kept with mask_density), for walks that gather cells: a row r
// of cells of (b, h) keeps one column (r·7 + h·3 + b) mod columns; a band of about one cell around the row block's
// diagonal; only keys 64..127 of every 128-key tile, every fifth such cell dropped; or the random mask with every
// third cell row of a head emptied (those rows see nothing: exact zeros and LSE −inf).
enum class MaskPattern { kRandom, kOneCellPerRow, kBand, kSecondHalfOnly, kEmptyRows };

// TOKEN_SPARSE inputs (0.7·N(0, 1) clamped at ±2.1 in q, k, v), then per kv head a direction u the window queries of
// its group lean on (q += 0.5·u), and keys along u (1.2·u + noise, ~4-5 more score than the rest) that every head of
// the group must keep: four needles between the sinks and the window, or the first four keys (sinks). kTiedRuns:
// keys constant over runs of 24 tokens, so pooled scores tie exactly inside a run and the top-budget threshold falls
// on tied candidates (decisions inside any error bound).
enum class SparseInputs { kRandom, kNeedles, kSinks, kTiedRuns };

struct AttentionCase {
  std::string name;
  // Shape.
  int32_t dtype = SPARSA_DTYPE_F16;
  int q_heads = 4, kv_heads = 4, head_dim = 64;
  std::vector<int> seq_q{64}, seq_k{64};  // per sequence
  bool is_causal = false;
  std::vector<int> query_offsets;  // args.query_offsets per sequence (§0's o); empty = not passed (bottom-right)
  // Layout (RunOptions).
  Layout layout = Layout::kPadded;
  bool kv_lengths = true;  // padded k/v carry seq_lens_k
  bool q_packed = false, kv_packed = false;
  int page_size = 16;
  int64_t kv_row_pad = 0, kv_head_pad = 0;
  bool lse = true;
  // Policy.
  int32_t policy = SPARSA_POLICY_DENSE;
  int sink_tokens = 8, sink_window = 32;
  int block_q = 64, block_k = 64;
  double mask_density = 0.5;  // BLOCK_SPARSE: each mask cell kept with this probability
  MaskPattern mask_pattern = MaskPattern::kRandom;
  // SPARGE with theta 1 (every causal block computed): the λ PV-skip threshold (−inf: no skip).
  double sparge_lambda = -std::numeric_limits<double>::infinity();
  // SPARGE's prediction instead (§4 steps 1-6, λ too when set): theta, tau (TopCdf, read when the top-k fraction is
  // 0), the top-k fraction, key block 0 always kept, and per-head parameters [Hq, 4] (theta, tau, top-k fraction, λ;
  // NaN: the scalar); the predicted mask (block_mask_out) is checked too.
  bool sparge_predicts = false;
  double sparge_theta = 1, sparge_tau = 0.98, sparge_topk_fraction = 0;
  bool sparge_attention_sink = false;
  std::vector<float> sparge_head_params;
  // TOKEN_INDICES: H_idx rows of `index_slots` ids (random, 8 % unused, 8 % repeats of the previous slot).
  int index_heads = 0, index_slots = 0, index_block_size = 1, index_n_init = 0, index_n_local = 0;
  bool head_map = false;     // a permuted head_map (h·3 + 1) mod H_idx
  bool sorted_rows = false;  // rows strictly ascending and duplicate-free, except row 0 of sequence 0
  // TOKEN_SELECT (§6), no selection cache; `needles` candidate keys per sequence point along the sum of their group's
  // query rows (3·sqrt(D) long) and must be selected by every set (when there are no more than top_k of them: more
  // put the top-k threshold inside their tied votes).
  int select_n_init = 16, select_top_k = 128, select_n_local = 32;
  bool select_per_kv_head = false, select_scale_scores = false;
  int needles = 0;
  bool decisions_inside_bound = false;  // the §0 audit (TOKEN_SELECT off the CPU, TOKEN_SPARSE everywhere) must
                                        // find decisions inside the bound
  // TOKEN_SPARSE (§5; causal, Sq == Skv): window W, pool kernel, min_tokens, coverage τ.
  int sparse_window = 32, sparse_pool = 7, sparse_min_tokens = 64;
  double sparse_coverage = 0.3;
  SparseInputs sparse_inputs = SparseInputs::kRandom;
  bool rows_dropped = true;  // the backend's sets drop rows (false: every sequence runs dense)
  // §8 Δ over the policy above (SPARSA_POLICY_FLAG_DELTA; causal, no LSE).
  bool delta = false;
  int gamma = 64, tail_min = 128;
  bool stats_vs_cpu = false;  // non-CPU backends: every stats counter equal to the CPU backend's
  // Inputs.
  Pattern pattern = Pattern::kRandom;
  double q_scale = 1;  // multiplies q: large scores move the running max across key tiles
  // Noise of 0.5·N(0, 1) in q, k, v; key 0 and every row of the even query blocks share a first coordinate scoring
  // kSinkBlockScore: the even blocks' later key blocks fall ~29 below their running max, the odd blocks' gains stay
  // within a few units of 0 (wide margins around any λ in between).
  bool sink_blocks = false;
  // SPARGE's smooth inputs (replace the pattern's values): q and k rows are noise N(0, 1) plus 4 slow sinusoids of the
  // token position (periods smooth_period_blocks·max(block_q, block_k) tokens and its multiples 2-4), so neighbouring
  // tokens are alike, blocks are self-similar and the prediction drops blocks; the listed query/key blocks get 3x the
  // noise, so their rows/columns are forced. sink_strength > 0: every query and the keys of key block 0 share a
  // direction of that length, so key block 0 dominates and later key blocks fall below λ. v is N(0, 1).
  bool smooth = false;
  double smooth_period_blocks = 4;
  std::vector<int> noisy_q_blocks, noisy_k_blocks;
  double sink_strength = 0;
  // Tolerance.
  Tolerance tol;

  AttentionCase& with_dtype(int32_t d) { dtype = d; return *this; }
  AttentionCase& heads(int hq, int hkv) { q_heads = hq; kv_heads = hkv; return *this; }
  AttentionCase& dim(int d) { head_dim = d; return *this; }
  AttentionCase& lengths(std::vector<int> sq, std::vector<int> skv) {
    seq_q = std::move(sq); seq_k = std::move(skv); return *this;
  }
  AttentionCase& causal(bool on = true) { is_causal = on; return *this; }
  AttentionCase& offsets(std::vector<int> o) { query_offsets = std::move(o); return *this; }
  AttentionCase& varlen() { layout = Layout::kVarlen; return *this; }
  AttentionCase& paged(int ps) { layout = Layout::kPaged; page_size = ps; return *this; }
  AttentionCase& packed_q() { q_packed = true; return *this; }
  AttentionCase& packed_kv() { kv_packed = true; return *this; }
  AttentionCase& kv_rows_padded_by(int64_t pad) { kv_row_pad = pad; return *this; }
  AttentionCase& kv_heads_padded_by(int64_t pad) { kv_head_pad = pad; return *this; }
  AttentionCase& no_lse() { lse = false; return *this; }
  AttentionCase& without_kv_lengths() { kv_lengths = false; return *this; }
  AttentionCase& sink_window_policy(int sinks, int window) {
    policy = SPARSA_POLICY_SINK_WINDOW; sink_tokens = sinks; sink_window = window; return *this;
  }
  AttentionCase& block_sparse_policy(int bq, int bk, double density) {
    policy = SPARSA_POLICY_BLOCK_SPARSE; block_q = bq; block_k = bk; mask_density = density; return *this;
  }
  AttentionCase& mask(MaskPattern m) { mask_pattern = m; return *this; }
  AttentionCase& pv_skip_policy(int bq, int bk, double lambda) {
    policy = SPARSA_POLICY_SPARGE; block_q = bq; block_k = bk; sparge_lambda = lambda; return *this;
  }
  AttentionCase& sparge_prediction_policy(int bq, int bk, double theta, double topk_fraction) {
    policy = SPARSA_POLICY_SPARGE; block_q = bq; block_k = bk; sparge_predicts = true; sparge_theta = theta;
    sparge_topk_fraction = topk_fraction; return *this;
  }
  AttentionCase& tau(double t) { sparge_tau = t; return *this; }
  AttentionCase& lambda(double l) { sparge_lambda = l; return *this; }
  AttentionCase& keep_sink_block() { sparge_attention_sink = true; return *this; }
  AttentionCase& per_head_params(std::vector<float> params) { sparge_head_params = std::move(params); return *this; }
  AttentionCase& smooth_inputs(double period_blocks = 4) {
    smooth = true; smooth_period_blocks = period_blocks; return *this;
  }
  AttentionCase& noisy_blocks(std::vector<int> q_blocks, std::vector<int> k_blocks) {
    noisy_q_blocks = std::move(q_blocks); noisy_k_blocks = std::move(k_blocks); return *this;
  }
  AttentionCase& sink_direction(double strength) { sink_strength = strength; return *this; }
  AttentionCase& token_select_policy(int n_init, int top_k, int n_local) {
    policy = SPARSA_POLICY_TOKEN_SELECT; select_n_init = n_init; select_top_k = top_k; select_n_local = n_local;
    return *this;
  }
  AttentionCase& per_kv_head() { select_per_kv_head = true; return *this; }
  AttentionCase& scale_scores() { select_scale_scores = true; return *this; }
  AttentionCase& with_needles(int n) { needles = n; return *this; }
  AttentionCase& expect_decisions_inside_bound() { decisions_inside_bound = true; return *this; }
  AttentionCase& token_sparse_policy(int window, int min_tokens, double coverage) {
    policy = SPARSA_POLICY_TOKEN_SPARSE; sparse_window = window; sparse_min_tokens = min_tokens;
    sparse_coverage = coverage; return *this;
  }
  AttentionCase& sparse_structure(SparseInputs s) { sparse_inputs = s; return *this; }
  AttentionCase& expect_no_rows_dropped() { rows_dropped = false; return *this; }
  AttentionCase& token_indices_policy(int h_idx, int slots) {
    policy = SPARSA_POLICY_TOKEN_INDICES; index_heads = h_idx; index_slots = slots; return *this;
  }
  AttentionCase& index_blocks(int block_size) { index_block_size = block_size; return *this; }
  AttentionCase& index_init_local(int n_init, int n_local) {
    index_n_init = n_init; index_n_local = n_local; return *this;
  }
  AttentionCase& with_head_map() { head_map = true; return *this; }
  AttentionCase& with_sorted_rows() { sorted_rows = true; return *this; }
  AttentionCase& with_delta(int g, int tail) { delta = true; gamma = g; tail_min = tail; return *this; }
  AttentionCase& dense_policy() { policy = SPARSA_POLICY_DENSE; return *this; }
  AttentionCase& inputs(Pattern p) { pattern = p; return *this; }
  AttentionCase& scaled_q(double s) { q_scale = s; return *this; }
  AttentionCase& with_sink_blocks() { sink_blocks = true; return *this; }
  AttentionCase& with_tolerance(Tolerance t) { tol = t; return *this; }
  AttentionCase& stats_against_cpu(bool on) { stats_vs_cpu = on; return *this; }
};
inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

// SPARGE rows on smooth inputs: out within the kernel tolerance (2e-4 / 4e-3 / 3e-2) against the reference and the
// CPU backend; LSE within 2e-3·max(1, |ref|).
Tolerance sparge_tolerance(int32_t dtype);

// A row with the defaults of a prefill table (Hq = Hkv = 4, D 64, Sq = Skv = 64, non-causal, prefill tolerance) and
// of a decode table (Hq 8, Hkv 2, D 128, Sq 1, Skv 1000, causal, decode tolerance).
AttentionCase prefill_row(std::string name, int32_t dtype);
AttentionCase decode_row(std::string name, int32_t dtype);
// A Δ row: Hq = Hkv = 4, D 128, Sq = Skv = 256, causal, no LSE, SINK_WINDOW (4 sinks, window 48) as the base, γ 64,
// tail_min 128, stats compared with the CPU backend, Δ tolerance.
AttentionCase delta_row(std::string name, int32_t dtype);
// A TOKEN_SELECT row: Hq 32, Hkv 8, D 128, Sq 1, Skv 3000, causal, n_init 16, top_k 128, n_local 32, select tolerance.
AttentionCase select_row(std::string name, int32_t dtype);

// A TOKEN_SPARSE row: Hq 4, Hkv 2, D 64, Sq = Skv = 512, causal, W 32, pool 7, min_tokens 64, τ 0.3, token sparse
// tolerance.
AttentionCase sparse_row(std::string name, int32_t dtype);

// A SPARGE prediction row on smooth inputs (AttentionCase::smooth, period 4 blocks): F16, Hq 4, Hkv 2, D 64, Sq = Skv
// = 512, causal, block_q = block_k = 64, θ 0.3, τ 0.9, no top-k, no λ, stats compared with the CPU backend, SPARGE
// tolerance.
AttentionCase sparge_row(std::string name, int32_t dtype);

// Runs the row on ctx and checks it (see the top of this file). `seed` seeds its inputs.
void check_case(const Context& ctx, const AttentionCase& c, uint64_t seed);

}  // namespace st
