// ALGORITHMS.md §1 DENSE, §2 SINK_WINDOW, §3 BLOCK_SPARSE, §4 SPARGE, §5 TOKEN_SPARSE, §6 TOKEN_SELECT, §7
// TOKEN_INDICES and §8 DELTA on every backend, as case tables (one row per case: shape, layout, policy, inputs
// pattern, tolerance; case_table.h). The rows pick the kernel paths of the GPU backend: the tensor-core prefill
// kernels (mma.sync, and wgmma on sm_90), the portable kernel (f32, head_dim 96/256), split-KV with its combine
// kernel, the tensor-core and CUDA-core decode kernels (rows off 16-byte boundaries), TOKEN_SPARSE's score kernels and
// budget, TOKEN_SELECT's score kernels and vote, TOKEN_INDICES' key sets and list walk, Δ's query-row map, the λ PV
// skip in the forward tiles; every row runs on the CPU backend too.
// Each is checked against the float64 reference, and on a non-CPU backend against the CPU backend as well.
#include "case_table.h"

#include <limits>
#include <string>
#include <vector>

namespace {

using st::AttentionCase;
using st::decode_row;
using st::prefill_row;
using st::MaskPattern;
using st::Pattern;
using st::SparseInputs;

constexpr int32_t kF32 = SPARSA_DTYPE_F32, kF16 = SPARSA_DTYPE_F16, kBF16 = SPARSA_DTYPE_BF16;

// Prefill and mixed shapes. Defaults: Hq = Hkv = 4, D 64, Sq = Skv = 64, non-causal, padded, dense.
const std::vector<AttentionCase> kPrefillCases = {
    prefill_row("dense_f16_d64_noncausal", kF16).lengths({300, 300}, {300, 300}),
    prefill_row("dense_bf16_d128_causal_sq_lt_skv_gqa4", kBF16).heads(8, 2).dim(128).lengths({77}, {301}).causal(),
    prefill_row("dense_f16_d128_causal_sq_gt_skv_empty_rows", kF16).dim(128).lengths({300}, {129}).causal(),
    prefill_row("decode_f16_d64_gqa8", kF16).heads(8, 1).lengths({1, 1, 1}, {1000, 17, 333}).causal(),
    prefill_row("sink_window_bf16_d128_causal", kBF16).dim(128).sink_window_policy(16, 100).lengths({333}, {333})
        .causal(),
    prefill_row("sink_window_f16_d64_noncausal", kF16).sink_window_policy(3, 70).lengths({200}, {260}),
    prefill_row("block_sparse_f16_d128_causal_64x64", kF16).dim(128).block_sparse_policy(64, 64, 0.5)
        .lengths({257, 257}, {257, 300}).causal(),
    prefill_row("block_sparse_bf16_d64_odd_blocks_32x48", kBF16).block_sparse_policy(32, 48, 0.3)
        .lengths({190}, {250}),
    prefill_row("dense_f32_d64_causal_portable", kF32).lengths({150}, {150}).causal(),
    prefill_row("dense_bf16_d256_portable", kBF16).heads(2, 1).dim(256).lengths({70}, {90}).causal(),
    prefill_row("dense_f16_d96_portable", kF16).dim(96).lengths({40}, {65}),
    prefill_row("varlen_packed_f16_d128_causal", kF16).dim(128).varlen().lengths({5, 130, 64, 1}, {5, 200, 64, 90})
        .causal(),
    prefill_row("paged_ps16_bf16_d128_gqa4_prefill", kBF16).heads(8, 2).dim(128).packed_q().paged(16)
        .lengths({40, 7}, {100, 7}).causal(),
    prefill_row("paged_ps1_f16_d64_decode", kF16).heads(4, 1).paged(1).lengths({1, 1}, {77, 200}).causal(),
    // Few thread blocks, long keys: split-KV + combine.
    prefill_row("decode_split_kv_bf16_d128_gqa4", kBF16).heads(8, 2).dim(128).lengths({1, 1, 1}, {5000, 3000, 77})
        .causal(),
    prefill_row("varlen_split_kv_f16_d64", kF16).varlen().lengths({3, 1}, {4000, 2500}).causal(),
    // The tensor-core kernel with split-KV (9 rows: too many for decode).
    prefill_row("short_prefill_split_kv_f16_d128", kF16).heads(2, 2).dim(128).lengths({9}, {5000}).causal(),
    prefill_row("decode_f32_d128_sink_window_gqa2", kF32).heads(4, 2).dim(128).sink_window_policy(5, 300)
        .lengths({2, 2}, {3000, 700}).causal(),
    prefill_row("padded_seq_lens_f16_d64_no_lse", kF16).lengths({64, 64}, {30, 129}).no_lse(),
};

// Decode shapes (forward_decode.cu: tensor-core and CUDA-core decode kernels, split-KV and combine; token_indices.cu:
// key sets and the list walk). Defaults: Hq 8, Hkv 2, D 128, Sq 1, Skv 1000, causal, padded, dense.
// The split-KV TOKEN_INDICES rows (tests/gpu held them to max |gpu − cpu| <= 1e-2·max |cpu| over the output): per
// element 1.5e-3 + 4e-3·|ref| (about one bf16 ulp), no looser than that wherever max |ref| >= 0.25 (it is ~0.3), and
// the decode LSE bound 1e-3·max(1, |ref|).
const st::Tolerance kIndicesSplitKvTolerance = [] {
  st::Tolerance t = st::decode_tolerance(SPARSA_DTYPE_BF16);
  t.out = t.out_vs_cpu = 1.5e-3;
  t.out_rel = 4e-3;
  return t;
}();

const std::vector<AttentionCase> kDecodeCases = {
    // Dense decode, tensor-core kernel.
    decode_row("gqa1_f16_d64_padded_ragged_b3", kF16).dim(64).heads(4, 4).lengths({1, 1, 1}, {1, 77, 3001}),
    decode_row("gqa4_bf16_d128_paged16_b2", kBF16).paged(16).lengths({1, 1}, {5000, 123}),
    decode_row("gqa8_f16_d128_paged1", kF16).heads(8, 1).paged(1).lengths({1, 1}, {300, 1001}),
    decode_row("gqa8_bf16_d256_long_many_splits", kBF16).dim(256).heads(16, 2).lengths({1}, {40000}),
    decode_row("gqa4_f16_d128_long_needle", kF16).inputs(Pattern::kNeedles).lengths({1}, {70001}),
    decode_row("gqa4_bf16_d64_sinks_packed_kv", kBF16).dim(64).inputs(Pattern::kSinks).packed_kv()
        .lengths({1, 1, 1}, {2049, 15, 9000}),
    // 16 rows: 4 query rows x 4 heads.
    decode_row("gqa4_f16_d64_sq4_packed_q_causal_tail", kF16).dim(64).packed_q().lengths({4, 3, 1}, {4, 700, 2500}),
    decode_row("gqa8_bf16_d128_sq2_noncausal", kBF16).heads(16, 2).lengths({2, 2}, {33, 1500}).causal(false),
    decode_row("gqa1_f16_d128_sq9_short_prefill", kF16).heads(2, 2).lengths({9}, {5000}),
    // Tiles outside the sinks and the window are never loaded.
    decode_row("sink_window_bf16_d128_gqa4", kBF16).sink_window_policy(5, 300).lengths({2, 2}, {20000, 700}),
    decode_row("block_sparse_f16_d64_gqa2", kF16).dim(64).heads(4, 2).block_sparse_policy(64, 64, 0.35)
        .lengths({1, 1}, {3000, 190}),
    // CUDA-core kernel (f32, rows off 16-byte boundaries).
    decode_row("gqa4_f32_d128_paged16", kF32).paged(16).lengths({1, 1}, {2500, 17}),
    decode_row("gqa4_f16_d64_odd_row_stride", kF16).dim(64).kv_rows_padded_by(4).lengths({1, 1}, {999, 4000}),
    // TOKEN_INDICES: key sets + the list walk.
    decode_row("indices_list_per_head_bf16_d128", kBF16).token_indices_policy(8, 900).lengths({1, 1}, {20000, 3000}),
    // H_idx = Hkv: the heads of a group share a list.
    decode_row("indices_list_per_group_f16_d64_blocks_init_local", kF16).dim(64).heads(16, 2)
        .token_indices_policy(2, 300).index_blocks(16).index_init_local(4, 64).paged(16)
        .lengths({1, 1, 1}, {50000, 31, 8000}),
    // H_idx = 1: 5 rows x 4 heads = two row tiles.
    decode_row("indices_list_per_sequence_bf16_d128_sq5", kBF16).token_indices_policy(1, 500).index_init_local(0, 16)
        .lengths({5, 5}, {9000, 40}),
    decode_row("indices_head_map_bf16_d256_paged16", kBF16).dim(256).token_indices_policy(3, 400).with_head_map()
        .paged(16).lengths({1, 1}, {6000, 2000}),
    decode_row("indices_prefill_f16_d128_gqa1", kF16).heads(2, 2).token_indices_policy(2, 60).index_init_local(2, 0)
        .varlen().lengths({70, 33}, {300, 33}),
    // Ascending rows: lists copied without the bitmap; sequence 1 has fewer ids than slots (-1 padding, bitmap).
    decode_row("indices_sorted_rows_bf16_d128", kBF16).token_indices_policy(8, 2000).with_sorted_rows()
        .lengths({1, 1}, {30000, 1500}),
    // Ascending block ids, the last block partial.
    decode_row("indices_sorted_blocks_f16_d64_gqa4", kF16).dim(64).token_indices_policy(2, 50).index_blocks(16)
        .with_sorted_rows().paged(16).lengths({1, 1, 1}, {4001, 9000, 333}),
    decode_row("indices_f32_d64_simt", kF32).dim(64).token_indices_policy(2, 200).lengths({1, 1}, {7000, 500}),
    // One list per query head, long enough that the index-driven kernel splits it (split-KV + combine): three query
    // rows with n_init / n_local, and 600 16-token block ids (9600 keys).
    decode_row("indices_split_kv_per_head_bf16_d128_sq3_init_local", kBF16).token_indices_policy(8, 600)
        .index_init_local(4, 64).lengths({3, 3}, {9000, 9000}).with_tolerance(kIndicesSplitKvTolerance),
    decode_row("indices_split_kv_per_head_bf16_d128_blocks16_init_local", kBF16).token_indices_policy(8, 600)
        .index_blocks(16).index_init_local(16, 128).lengths({1, 1}, {12000, 10000})
        .with_tolerance(kIndicesSplitKvTolerance),
};

// §8 Δ over DENSE, SINK_WINDOW and BLOCK_SPARSE (gpu_delta.cu: the base policy, one kDeltaRows forward launch and the
// correction; the tensor-core kernel for f16/bf16 D 64/128, the portable one for f32 and D 96). Defaults: Hq = Hkv
// = 4, D 128, Sq = Skv = 256, causal, no LSE, SINK_WINDOW (4, 48) base, γ 64, tail_min 128, stats against the CPU.
const std::vector<AttentionCase> kDeltaCases = {
    st::delta_row("sink_window_bf16_d128_gqa4_defaults", kBF16).heads(8, 2).sink_window_policy(4, 200)
        .lengths({1000}, {1000}),
    st::delta_row("dense_base_f16_d64_gqa8_bottom_right", kF16).dim(64).heads(8, 1).dense_policy()
        .lengths({777, 777}, {900, 900}).with_delta(16, 32).inputs(Pattern::kSinks),
    st::delta_row("block_sparse_bf16_d128_odd_lengths", kBF16).block_sparse_policy(64, 64, 0.35)
        .lengths({513}, {513}).with_delta(32, 40),
    st::delta_row("varlen_f16_d128_sink_window_ragged", kF16).varlen()
        .lengths({300, 5, 129, 64, 200}, {300, 5, 150, 64, 260}).with_delta(16, 32),
    st::delta_row("paged_ps16_bf16_d128_gqa4", kBF16).heads(8, 2).packed_q().paged(16).lengths({333, 90}, {400, 90})
        .with_delta(16, 32).inputs(Pattern::kSinks),
    st::delta_row("portable_f32_d64_sink_window", kF32).dim(64).lengths({300}, {300}).with_delta(16, 32),
    st::delta_row("portable_f16_d96_dense_gamma10_tail0", kF16).dim(96).heads(2, 1).dense_policy()
        .lengths({250}, {250}).with_delta(10, 0),
    st::delta_row("short_sequences_all_dense_base_skipped", kBF16).lengths({100, 100}, {100, 100}),
    st::delta_row("sq_exceeds_skv_empty_rows", kF16).lengths({300}, {200}).with_delta(16, 32),
    // Δ over DENSE is dense attention on every row, on a sequence whose anchors' causal horizons span many key tiles
    // (L mod γ = 3 as at 4099: cut 131, 20 anchors, the last reaching 1280 keys).
    st::delta_row("dense_base_bf16_d128_gqa2_long_anchors", kBF16).heads(2, 1).dense_policy().lengths({1411}, {1411}),
};

// Shapes of the Hopper wgmma prefill kernel (forward_wgmma.cu takes f16/bf16 with D 64/128 on sm_90): 128-row query
// tiles split over two consumer warpgroups (tails inside either half), 128-key tiles through a 3-deep ring that wraps,
// bottom-right causal with Sq < Skv and Sq > Skv, GQA 1/4/8, packed and paged (page sizes 1 and 16) K/V, block masks
// whose cells cut tiles, sink/window, large scores (online-softmax rescaling across tiles), and Δ's dense pass through
// the query-row map (kDeltaRows: anchor and tail rows read at their positions, written compact). Defaults as the
// prefill table's.
const std::vector<AttentionCase> kWgmmaCases = {
    // One 128-row tile with a tail in the second consumer half, several key tiles.
    prefill_row("dense_bf16_d128_noncausal_tail", kBF16).dim(128).heads(2, 2).lengths({100}, {700}),
    // 9 key tiles: the 3-slot ring wraps three times.
    prefill_row("dense_f16_d64_noncausal_many_tiles", kF16).heads(2, 2).lengths({257}, {1100}),
    prefill_row("dense_bf16_d64_causal_square_gqa8", kBF16).heads(8, 1).lengths({389}, {389}).causal(),
    // Bottom-right: row i sees keys <= i + 500.
    prefill_row("dense_f16_d128_causal_sq_lt_skv_gqa4", kF16).dim(128).heads(8, 2).lengths({130}, {630}).causal(),
    // The first 171 rows see nothing.
    prefill_row("dense_bf16_d128_causal_sq_gt_skv_empty_rows", kBF16).dim(128).heads(2, 1).lengths({300}, {129})
        .causal(),
    // |q| ~ 6: the running max changes between tiles.
    prefill_row("dense_bf16_d128_large_scores", kBF16).dim(128).heads(2, 2).lengths({200}, {600}).scaled_q(6),
    prefill_row("dense_f16_d64_causal_large_scores_batch3", kF16).heads(4, 4).varlen()
        .lengths({129, 200, 64}, {129, 450, 64}).causal().scaled_q(5),
    prefill_row("varlen_packed_bf16_d128_causal_gqa4", kBF16).dim(128).heads(8, 2).varlen()
        .lengths({5, 130, 257, 1, 64}, {5, 200, 257, 90, 400}).causal(),
    prefill_row("varlen_packed_f16_d64_noncausal", kF16).varlen().lengths({33, 140, 9}, {300, 17, 129}),
    prefill_row("paged_ps16_bf16_d128_gqa4_causal", kBF16).dim(128).heads(8, 2).packed_q().paged(16)
        .lengths({140, 30}, {500, 30}).causal(),
    prefill_row("paged_ps1_f16_d64_prefill", kF16).heads(4, 1).packed_q().paged(1).lengths({150, 40}, {333, 41})
        .causal(),
    prefill_row("padded_seq_lens_bf16_d64_no_lse", kBF16).lengths({200, 200}, {30, 333}).no_lse(),
    prefill_row("block_sparse_bf16_d128_causal_128x128", kBF16).dim(128).heads(2, 2).block_sparse_policy(128, 128, 0.5)
        .lengths({700}, {700}).causal(),
    // Cells cut tiles: the element predicate inside tiles.
    prefill_row("block_sparse_f16_d64_odd_cells_48x80", kF16).heads(2, 1).block_sparse_policy(48, 80, 0.3)
        .lengths({301}, {517}),
    prefill_row("sink_window_bf16_d128_causal_long", kBF16).dim(128).heads(2, 2).sink_window_policy(20, 150)
        .lengths({900}, {900}).causal(),
    prefill_row("sink_window_f16_d64_noncausal", kF16).sink_window_policy(3, 200).lengths({260}, {700}),
    // 2 thread blocks, 40 key tiles.
    prefill_row("short_prefill_f16_d128_long_keys", kF16).dim(128).heads(2, 2).lengths({9}, {5000}).causal(),
    // Δ over SINK_WINDOW, odd Sq: cut = 1111 % 8 + 40 = 47, s_p = 1064, 133 anchors + 47 tail rows = 180 launch rows
    // (two 128-row tiles; the second ends inside its first consumer half). Anchor tiles reach far past their launch
    // index, so the causal horizon must come from the row's position.
    prefill_row("delta_sink_window_bf16_d128_odd", kBF16).dim(128).heads(4, 2).sink_window_policy(16, 200)
        .with_delta(8, 40).lengths({1111}, {1111}).causal().no_lse().with_tolerance(st::delta_tolerance(kBF16)),
    // A tail longer than a consumer half; 170 anchors.
    prefill_row("delta_sink_window_f16_d64_odd", kF16).heads(8, 1).sink_window_policy(16, 200).with_delta(5, 130)
        .lengths({987}, {987}).causal().no_lse().with_tolerance(st::delta_tolerance(kF16)),
    // Δ over DENSE, varlen with Sq < Skv (positions shift by Skv − Sq) and sequences too short for any sparse row
    // (s_p = 0: every row dense, launch row a = position a).
    prefill_row("delta_dense_varlen_bf16_d64", kBF16).heads(4, 4).varlen().with_delta(7, 33)
        .lengths({517, 20, 901}, {700, 20, 901}).causal().no_lse().with_tolerance(st::delta_tolerance(kBF16)),
    prefill_row("delta_dense_varlen_f16_d128_paged", kF16).dim(128).heads(8, 2).packed_q().paged(16)
        .with_delta(64, 128).lengths({1500, 300}, {1600, 300}).causal().no_lse()
        .with_tolerance(st::delta_tolerance(kF16)),
};

// §4 step 7, SPARGE's λ PV skip in the forward kernels, with theta 1 (every block computed, so only the λ test
// decides) on inputs with wide margins (sink_blocks: the even query blocks' later key blocks skipped at λ = −10, the
// odd ones kept): tensor-core tiles (block_q 64 and 128 × block_k 64, f16/bf16) and the portable kernel (f32, and
// block sizes the tensor cores do not take), causal and not, Sq != Skv, GQA. Outputs within the Δ tolerance (4e-4 /
// 8e-3 / 6e-2), PV_BLOCKS_SKIPPED equal to the reference's. Defaults: Hq 4, Hkv 1, D 128, causal, no LSE.
AttentionCase pv_skip_row(std::string name, int32_t dtype) {
  return prefill_row(std::move(name), dtype).heads(4, 1).dim(128).causal().no_lse().without_kv_lengths()
      .with_sink_blocks().with_tolerance(st::delta_tolerance(dtype));
}
constexpr double kSkipLambda = -10;
const std::vector<AttentionCase> kPvSkipCases = {
    pv_skip_row("tensor_cores_bf16_bq128_bk64_causal_gqa4", kBF16).pv_skip_policy(128, 64, kSkipLambda)
        .lengths({300}, {300}),
    pv_skip_row("tensor_cores_f16_bq64_bk64_noncausal_sq_lt_skv", kF16).dim(64).heads(2, 2)
        .pv_skip_policy(64, 64, kSkipLambda).causal(false).lengths({200}, {333}),
    pv_skip_row("tensor_cores_bf16_bq128_bk64_causal_batch2_sq_lt_skv", kBF16).pv_skip_policy(128, 64, kSkipLambda)
        .lengths({257, 257}, {400, 400}),
    pv_skip_row("portable_f32_bq32_bk16_causal", kF32).dim(64).pv_skip_policy(32, 16, kSkipLambda)
        .lengths({190}, {190}),
    // Block sizes the tensor-core tiles do not take.
    pv_skip_row("portable_bf16_bq48_bk40_noncausal", kBF16).dim(64).heads(4, 2).pv_skip_policy(48, 40, kSkipLambda)
        .causal(false).lengths({230}, {250}),
};

// §6 TOKEN_SELECT without a cache (token_select_score.cu: the fp32 score kernel for fp16/bf16 keys, the float64
// DMMA and FMA kernels for the rest, the vote, the device top-k): dense fallbacks, ragged and chunked batches, paged
// and packed K/V, per-kv-head sets, scaled scores, k/v heads off alignment, needle keys that must be selected, tied
// needles across the top-k boundary. On the CPU, selections equal the reference's where the top-k vote is not too
// close to call; off the CPU, the §0 audit (case_table.cpp: decisions outside the scores' error bound agree with the
// reference, the output is the reference's attention over the backend's own sets).
// Defaults: Hq 32, Hkv 8, D 128, Sq 1, Skv 3000, n_init 16, top_k 128, n_local 32; outputs within t·(1 + |ref|).
const std::vector<AttentionCase> kSelectCases = {
    st::select_row("gqa32_8_bf16_decode", kBF16),
    st::select_row("gqa32_8_f16_needles_ragged", kF16).lengths({1, 1}, {2000, 777}).with_needles(2),
    // Sequence 1 falls back to dense (150 <= n_init + top_k + n_local).
    st::select_row("f32_packed_q_and_kv_chunks_one_dense", kF32).dim(64).heads(8, 2).varlen()
        .lengths({4, 1, 7}, {900, 150, 1300}).with_needles(1),
    st::select_row("paged_per_kv_head_bf16", kBF16).packed_q().paged(16).per_kv_head().lengths({2, 1}, {1500, 2100})
        .with_needles(1),
    st::select_row("mha_d80_scale_scores_f16", kF16).dim(80).heads(4, 4).scale_scores().lengths({1}, {1111}),
    st::select_row("gqa16_1_two_head_chunks", kBF16).heads(16, 1).lengths({1}, {2500}).with_needles(1),
    st::select_row("unaligned_kv_rows_gqa4", kF16).dim(64).heads(8, 2).kv_heads_padded_by(3).lengths({1}, {1000}),
    st::select_row("all_dense_chunk", kBF16).dim(64).heads(8, 2).packed_q().lengths({16, 5}, {150, 60}),
    st::select_row("no_sinks_no_window", kBF16).heads(8, 2).token_select_policy(0, 64, 0).lengths({24}, {700}),
    // Named for the float64 kernels' edges (DMMA: a head_dim that ends inside a round, 80 = 2.5 rounds of 32; f32
    // rounds of 16 dims with full 8-head chunks over a ragged packed batch; a group of 12 in chunks of 8 and 4 heads
    // on pages; FMA: head_dim above 128, a group of 2). fp16/bf16 keys in aligned rows score in fp32
    // (score_f32_kernel), so of these rows only the f32 one reaches a float64 kernel (DMMA on sm_90, the FMA kernel
    // on sm_80); the 16-bit rows cover score_f32_kernel's head_dim 80 and 256, its 8- and 4-head chunks and a group
    // of 2.
    st::select_row("mma_gqa4_d80_f16_dim_tail", kF16).dim(80).heads(8, 2).lengths({1}, {1234}).with_needles(1),
    st::select_row("mma_gqa8_f32_d64_ragged_batch", kF32).dim(64).heads(16, 2).varlen()
        .lengths({1, 3, 1}, {3001, 517, 1290}).with_needles(1),
    st::select_row("mma_gqa12_bf16_paged_chunks_8_and_4", kBF16).heads(24, 2).paged(16).lengths({1}, {2222})
        .with_needles(2),
    st::select_row("fma_gqa4_d256_bf16", kBF16).dim(256).heads(8, 2).lengths({1}, {1500}).with_needles(1),
    st::select_row("fma_gqa2_bf16", kBF16).heads(8, 4).lengths({1}, {1700}).with_needles(1),
    // fp32 keys with a group of 2: the float64 FMA score kernel on every GPU (DMMA needs groups of 4 or more).
    st::select_row("fma_gqa2_f32_float64_scores", kF32).heads(8, 4).lengths({1}, {1700}).with_needles(1),
    st::select_row("long_decode_40k_default_shape", kBF16).token_select_policy(128, 2048, 512).lengths({1}, {40000})
        .with_needles(3),
    // More identical needles than top_k: the k-th largest vote falls inside a run of tied candidates, so off the CPU
    // the §0 audit sees decisions inside the fp32 bound next to decided ones.
    st::select_row("tied_needles_across_the_boundary_bf16", kBF16).token_select_policy(16, 64, 32).lengths({1}, {4000})
        .with_needles(150).expect_decisions_inside_bound(),
    st::select_row("tied_needles_paged_ps1_f16_gqa4_d64", kF16).dim(64).heads(8, 2).packed_q().paged(1)
        .token_select_policy(16, 100, 32).lengths({1, 1}, {3100, 2900}).with_needles(180)
        .expect_decisions_inside_bound(),
};

// §5 TOKEN_SPARSE (token_sparse_score.cu: the fp32 tensor-core score kernel for fp16/bf16 with head_dim a multiple
// of 16 up to 128, the float64 one for the rest; 256-key scoring chunks, the coverage budget, the per-head
// top-budget, the gathered causal attention and the zeroed rows): needles and sinks every head of their group must
// keep, runs of tied keys that put the top-budget threshold among tied candidates, ragged and paged batches with
// sequences on both sides of the dense fallback (L <= min_tokens + W), τ 0 and 1, windows wider than a 128-row tile.
// Every backend is audited as §0 states (case_table.cpp: decisions outside the scores' error bound, float64 rounding
// on the CPU, agree with the reference; the budget is one the coverage count can give; the output is the
// reference's attention over the backend's own sets, dropped rows exactly 0 with LSE −inf).
// Defaults: Hq 4, Hkv 2, D 64, Sq = Skv = 512, W 32, pool 7, min_tokens 64, τ 0.3, padded without seq_lens_k;
// outputs within twice the kernel tolerance.
const std::vector<AttentionCase> kTokenSparseCases = {
    st::sparse_row("needles_f16_d64_gqa2", kF16).lengths({900}, {900}).sparse_structure(SparseInputs::kNeedles),
    st::sparse_row("sinks_bf16_d128_gqa8", kBF16).dim(128).heads(8, 1).lengths({1000}, {1000})
        .token_sparse_policy(64, 100, 0.2).sparse_structure(SparseInputs::kSinks),
    // Sequences 1 (90 <= 64 + 32) and 3 run dense, 0 and 2 sparse.
    st::sparse_row("ragged_varlen_needles_f16_d64_gqa4", kF16).heads(4, 1).varlen()
        .lengths({900, 90, 613, 1}, {900, 90, 613, 1}).sparse_structure(SparseInputs::kNeedles),
    // L = min_tokens + W = 96 runs dense; one more token and the sequence is sparse.
    st::sparse_row("fallback_threshold_varlen_f16_d64", kF16).heads(2, 2).varlen()
        .lengths({96, 97, 98, 103, 95}, {96, 97, 98, 103, 95}).token_sparse_policy(32, 64, 0.5),
    st::sparse_row("padded_batch2_f32_d40_no_lse", kF32).dim(40).heads(2, 2).lengths({500, 500}, {500, 500})
        .token_sparse_policy(32, 64, 0.1).no_lse(),
    // W > 128: two window-row tiles per scoring chunk.
    st::sparse_row("wide_window_bf16_d128_gqa2", kBF16).dim(128).heads(2, 1).lengths({1500}, {1500})
        .token_sparse_policy(160, 128, 0.05).sparse_structure(SparseInputs::kNeedles),
    // τ = 1: the budget is min_tokens exactly (a fixed keep fraction, as the benchmark uses).
    st::sparse_row("coverage_one_keeps_min_tokens_bf16_d128", kBF16).dim(128).heads(4, 4).lengths({2048}, {2048})
        .token_sparse_policy(64, 256, 1.0),
    // The default W, min_tokens and τ: several 256-key scoring chunks and a long coverage descent.
    st::sparse_row("long_defaults_f16_d128", kF16).dim(128).heads(2, 1).lengths({2000}, {2000})
        .token_sparse_policy(128, 1024, 0.005).sparse_structure(SparseInputs::kSinks),
    st::sparse_row("paged_kv_sinks_f16_d64", kF16).packed_q().paged(16).lengths({700, 333}, {700, 333})
        .sparse_structure(SparseInputs::kSinks),
    // The top-budget threshold falls among exactly tied candidates: decisions inside the bound on every backend.
    st::sparse_row("tied_runs_bf16_d128_gqa4", kBF16).dim(128).heads(4, 1).lengths({1700}, {1700})
        .token_sparse_policy(64, 256, 0.3).sparse_structure(SparseInputs::kTiedRuns).expect_decisions_inside_bound(),
    st::sparse_row("tied_runs_varlen_f16_d64", kF16).heads(4, 2).varlen().lengths({1200, 700}, {1200, 700})
        .token_sparse_policy(32, 128, 0.4).sparse_structure(SparseInputs::kTiedRuns).expect_decisions_inside_bound(),
    // The list attention's query-row map on the sm_90a kernel (bf16, head_dim 64 / 128): GQA, packed varlen with one
    // sequence just above the dense threshold (150 + 64 = 214 < 230), paged K/V.
    st::sparse_row("row_map_bf16_d128_gqa2", kBF16).dim(128).heads(4, 2).lengths({1000}, {1000})
        .token_sparse_policy(64, 200, 0.3),
    st::sparse_row("row_map_varlen_bf16_d64", kBF16).heads(4, 4).varlen().lengths({700, 230, 1200}, {700, 230, 1200})
        .token_sparse_policy(64, 150, 0.5),
    st::sparse_row("row_map_paged_bf16_d128", kBF16).dim(128).heads(2, 1).paged(16).lengths({900}, {900})
        .token_sparse_policy(64, 256, 1.0),
    // τ = 0: dense causal attention everywhere.
    st::sparse_row("zero_coverage_dense_f16_d64", kF16).lengths({300}, {300}).token_sparse_policy(32, 64, 0.0)
        .expect_no_rows_dropped(),
};

// §3 BLOCK_SPARSE masks whose cells the Hopper kernel walks as gathered 64-key halves (forward_wgmma.h:
// wgmma_gathers_mask_cells: block_q a multiple of 64, block_k 8, 16, 32 or a multiple of 64, not both multiples of
// 128), random (40 % of the cells) and structured (MaskPattern): one cell per row, a diagonal band, only the second
// half of every 128-key tile, rows that see nothing. Elsewhere they take the backend's other block walks.
constexpr double kCellDensity = 0.4;
AttentionCase cells_row(std::string name, int32_t dtype, int bq, int bk, double density = kCellDensity) {
  return prefill_row(std::move(name), dtype).block_sparse_policy(bq, bk, density);
}
const std::vector<AttentionCase> kMaskCellCases = {
    // The last 128-row tile ends inside its first consumer half.
    cells_row("cells_128x64_bf16_d128_noncausal_tail_gqa4", kBF16, 128, 64).dim(128).heads(8, 2)
        .lengths({300}, {1001}),
    cells_row("cells_128x64_f16_d64_causal_square_gqa8", kF16, 128, 64).heads(8, 1).lengths({777}, {777}).causal(),
    // Bottom-right: row i sees keys <= i + 450.
    cells_row("cells_64x64_bf16_d128_causal_sq_lt_skv", kBF16, 64, 64).dim(128).lengths({200}, {650}).causal(),
    cells_row("cells_64x64_f16_d64_noncausal_odd", kF16, 64, 64).heads(4, 2).lengths({333}, {517}),
    // The first 150 rows see nothing.
    cells_row("cells_64x64_bf16_d64_causal_sq_gt_skv", kBF16, 64, 64).heads(2, 1).lengths({420}, {270}).causal(),
    cells_row("cells_256x64_bf16_d64_causal_gqa8", kBF16, 256, 64).heads(8, 1).lengths({600}, {600}).causal(),
    cells_row("cells_192x64_f16_d128_causal", kF16, 192, 64).dim(128).lengths({500}, {530}).causal(),
    cells_row("cells_128x32_f16_d128_noncausal", kF16, 128, 32).dim(128).heads(2, 2).lengths({257}, {901}),
    cells_row("cells_128x32_bf16_d64_causal", kBF16, 128, 32).lengths({400}, {400}).causal(),
    cells_row("cells_64x16_f16_d64_noncausal", kF16, 64, 16, 0.2).lengths({190}, {430}),
    cells_row("cells_128x8_bf16_d128_causal", kBF16, 128, 8, 0.3).dim(128).heads(2, 1).lengths({130}, {300}).causal(),
    cells_row("cells_64x128_f16_d128_noncausal", kF16, 64, 128).dim(128).lengths({300}, {700}),
    // |q| ~ 5: the running max moves between gathered tiles.
    cells_row("cells_128x64_bf16_d128_large_scores", kBF16, 128, 64).dim(128).heads(2, 2).lengths({256}, {1200})
        .scaled_q(5),
    cells_row("cells_128x64_varlen_packed_bf16_d128_causal_gqa4", kBF16, 128, 64).dim(128).heads(8, 2).varlen()
        .lengths({5, 130, 257, 1, 64}, {5, 200, 257, 90, 400}).causal(),
    cells_row("cells_64x32_varlen_packed_f16_d64_noncausal", kF16, 64, 32).varlen()
        .lengths({33, 140, 9}, {300, 17, 129}),
    cells_row("cells_128x64_paged_ps16_bf16_d128_causal_gqa4", kBF16, 128, 64).dim(128).heads(8, 2).packed_q()
        .paged(16).lengths({140, 30}, {500, 30}).causal(),
    cells_row("cells_64x64_padded_seq_lens_f16_d64_no_lse", kF16, 64, 64).lengths({200, 200}, {30, 333}).no_lse(),
    // 2 thread blocks, 80 halves: split-KV shares of the gathered walk.
    cells_row("cells_128x64_split_kv_f16_d128_causal", kF16, 128, 64).dim(128).heads(2, 2).lengths({9}, {5000})
        .causal(),
    cells_row("cells_128x64_one_cell_per_row_bf16_d128", kBF16, 128, 64).mask(MaskPattern::kOneCellPerRow).dim(128)
        .heads(4, 2).lengths({512}, {1000}),
    cells_row("cells_64x32_one_cell_per_row_f16_d64_causal", kF16, 64, 32).mask(MaskPattern::kOneCellPerRow)
        .lengths({450}, {450}).causal(),
    cells_row("cells_64x64_band_f16_d64_causal", kF16, 64, 64).mask(MaskPattern::kBand).lengths({700}, {700})
        .causal(),
    cells_row("cells_128x32_band_bf16_d128_noncausal", kBF16, 128, 32).mask(MaskPattern::kBand).dim(128).heads(2, 1)
        .lengths({600}, {650}),
    cells_row("cells_128x64_second_half_only_bf16_d128", kBF16, 128, 64).mask(MaskPattern::kSecondHalfOnly).dim(128)
        .lengths({400}, {900}),
    cells_row("cells_64x16_second_half_only_f16_d64_causal", kF16, 64, 16).mask(MaskPattern::kSecondHalfOnly)
        .lengths({300}, {380}).causal(),
    cells_row("cells_128x64_empty_rows_bf16_d128_causal", kBF16, 128, 64).mask(MaskPattern::kEmptyRows).dim(128)
        .heads(4, 2).lengths({500}, {500}).causal(),
    cells_row("cells_64x64_empty_rows_f16_d64_noncausal", kF16, 64, 64).mask(MaskPattern::kEmptyRows)
        .lengths({333}, {600}),
};

// §4 SPARGE's prediction in its default cells (block_q 128 × block_k 64), no λ: θ = -1 makes every block
// self-similar (none forced), so the top-k fraction 0.3 alone drops cells; the predicted mask is checked exactly.
// On sm_90 the kept cells are walked as gathered 64-key halves.
AttentionCase prediction_row(std::string name, int32_t dtype) {
  constexpr int kDefaultBlockQ = 128, kDefaultBlockK = 64;
  constexpr double kEveryBlockSelfSimilar = -1, kTopkFraction = 0.3;
  return prefill_row(std::move(name), dtype)
      .sparge_prediction_policy(kDefaultBlockQ, kDefaultBlockK, kEveryBlockSelfSimilar, kTopkFraction);
}
const std::vector<AttentionCase> kSpargePredictionCases = {
    prediction_row("sparge_bf16_d128_noncausal_gqa4", kBF16).dim(128).heads(8, 2).lengths({1000}, {1000}),
    // seq_lens_k: the second sequence is shorter (bottom-right causal).
    prediction_row("sparge_bf16_d128_causal_padded_batch2", kBF16).dim(128).lengths({900, 900}, {900, 650})
        .causal(),
    prediction_row("sparge_f16_d64_noncausal_odd", kF16).heads(4, 1).lengths({517}, {1111}),
    prediction_row("sparge_f16_d64_causal", kF16).heads(4, 1).lengths({777}, {777}).causal(),
};

// §4 SPARGE's whole prediction (θ, TopCdf τ or top-k, forced rows/columns, the sink column) and λ PV skip on smooth
// inputs (case_table.h: slow sinusoids of the position plus noise, so blocks are self-similar and the prediction drops
// cells; noisy blocks forced; a sink direction making key block 0 dominate for λ): the GPU's predict kernels (shared-
// and global-memory sorts of a row's key blocks), its gathered forward walk and PV skip, with per-head parameters,
// ragged and padded batches, Sq > Skv. The predicted mask equals the reference's, and off the CPU the CPU backend's
// with every stats counter. Defaults: F16, Hq 4, Hkv 2, D 64, Sq = Skv = 512, causal, 64 × 64 blocks, θ 0.3, τ 0.9.
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
const std::vector<AttentionCase> kSpargeSmoothCases = {
    // 32 × 64 blocks; GQA 4 in one group (the reference's cost grows with the heads).
    st::sparge_row("large_bf16_d128_causal_gqa4_tau", kBF16).dim(128).heads(4, 1).lengths({4096}, {4096})
        .sparge_prediction_policy(128, 64, 0.3, 0).tau(0.9).noisy_blocks({7}, {21, 40}),
    st::sparge_row("f16_d64_noncausal_tails_topk", kF16).causal(false).lengths({1000}, {1500})
        .sparge_prediction_policy(64, 64, 0.3, 0.3),
    st::sparge_row("varlen_f16_d128_causal_gqa4_ragged", kF16).dim(128).heads(8, 2).varlen()
        .lengths({300, 1000, 17}, {300, 1200, 17}).sparge_prediction_policy(128, 64, 0.3, 0).tau(0.9),
    st::sparge_row("padded_batch_seq_lens_k_bf16_noncausal", kBF16).causal(false).lengths({640, 640}, {700, 333}),
    st::sparge_row("f32_d64_gqa8_small_blocks_sink", kF32).heads(8, 1).lengths({256}, {256})
        .sparge_prediction_policy(32, 16, 0.3, 0).tau(0.9).keep_sink_block().noisy_blocks({}, {3}),
    // 2500 key blocks of 16: more than the GPU sorts in shared memory, so a row's blocks sort in global scratch.
    st::sparge_row("many_key_blocks_global_sort_f16", kF16).causal(false).heads(2, 1).lengths({256}, {40000})
        .sparge_prediction_policy(128, 16, 0.3, 0).tau(0.9).smooth_inputs(64),
    // Queries 0..399 see no key.
    st::sparge_row("causal_sq_gt_skv_empty_blocks_f16", kF16).lengths({700}, {300}),
    st::sparge_row("head_params_theta_tau_topk_f16", kF16).dim(128).lengths({1024}, {1024})
        .sparge_prediction_policy(128, 64, 0.3, 0).tau(0.9)
        .per_head_params({kNan, kNan, kNan, kNan, 1.0f, kNan, kNan, kNan, kNan, 0.6f, kNan, kNan, kNan, kNan, 0.25f,
                          kNan}),
    st::sparge_row("pv_skip_bf16_d128_bq128_bk64", kBF16).dim(128).lengths({1536}, {1536})
        .sparge_prediction_policy(128, 64, 0.3, 0.5).tau(0.9).lambda(-4).sink_direction(14),
    st::sparge_row("pv_skip_f32_small_blocks_head_lambda", kF32).lengths({256}, {256})
        .sparge_prediction_policy(32, 16, 0.3, 0.5).tau(0.9).sink_direction(14)
        .per_head_params({kNan, kNan, kNan, -2.f, kNan, kNan, kNan, -6.f, kNan, kNan, kNan, kNan, kNan, kNan, kNan,
                          -1.f}),
};

// args.query_offsets (§0's o per sequence): a run's rows placed inside a longer sequence whose keys it is given, as a
// context-parallel shard runs them. Causal rows see keys <= i + o, SINK_WINDOW measures from i + o, SPARGE predicts
// over all of the call's keys with the causal pruning at i + o; o = -Sq (no row sees a key) and o = Skv (every row
// sees every key) are the ends of the range; a decode row at o sees a prefix; TOKEN_INDICES rows placed after the
// keys (a context-parallel shard) or inside them, n_local still counted from Skv. Defaults as the prefill table's.
const std::vector<AttentionCase> kQueryOffsetCases = {
    prefill_row("dense_f16_d64_causal_padded_batch2", kF16).lengths({64, 64}, {300, 250}).causal().offsets({100, 0}),
    prefill_row("dense_bf16_d128_causal_gqa4_tiles", kBF16).dim(128).heads(8, 2).lengths({256}, {1024}).causal()
        .offsets({384}),
    prefill_row("dense_f16_d128_causal_range_ends", kF16).dim(128).lengths({50, 50}, {200, 200}).causal()
        .offsets({-50, 200}),
    prefill_row("dense_f32_d64_causal_portable", kF32).lengths({70}, {300}).causal().offsets({129}),
    prefill_row("dense_f16_d64_noncausal_ignored", kF16).lengths({40}, {100}).offsets({3}),
    prefill_row("varlen_f16_d128_causal", kF16).dim(128).varlen().lengths({64, 130, 1}, {300, 500, 40}).causal()
        .offsets({0, 200, 7}),
    prefill_row("paged_ps16_bf16_d128_gqa4_causal", kBF16).heads(8, 2).dim(128).packed_q().paged(16)
        .lengths({40, 7}, {300, 70}).causal().offsets({128, 0}),
    st::decode_row("decode_bf16_d128_prefix_split_kv", kBF16).lengths({1, 1}, {6000, 300}).offsets({2500, 299}),
    prefill_row("sink_window_bf16_d128_causal", kBF16).dim(128).sink_window_policy(16, 100).lengths({200}, {900})
        .causal().offsets({500}),
    prefill_row("sink_window_f16_d64_noncausal", kF16).sink_window_policy(3, 70).lengths({100}, {500})
        .offsets({250}),
    prefill_row("block_sparse_f16_d128_causal_64x64", kF16).dim(128).block_sparse_policy(64, 64, 0.5)
        .lengths({192}, {640}).causal().offsets({256}),
    st::sparge_row("sparge_f16_d64_causal_shard_rows", kF16).lengths({512}, {2048}).offsets({1024})
        .noisy_blocks({2}, {5, 20}),
    st::sparge_row("sparge_bf16_d128_causal_topk_pv_skip", kBF16).dim(128).lengths({512}, {1536})
        .sparge_prediction_policy(128, 64, 0.3, 0.3).tau(0.9).lambda(-4).sink_direction(14).offsets({768}),
    st::decode_row("indices_decode_prefix_bf16_d128", kBF16).token_indices_policy(8, 900).lengths({1, 1}, {20000, 3000})
        .offsets({9000, 2999}),
    st::decode_row("indices_rows_after_keys_f16_d64_sq5_init_local", kF16).dim(64).token_indices_policy(2, 300)
        .index_init_local(4, 64).lengths({5, 5}, {4000, 900}).offsets({4000, 500}),
    st::decode_row("indices_blocks16_bf16_d128_sq3_paged", kBF16).token_indices_policy(8, 200).index_blocks(16)
        .index_init_local(16, 128).paged(16).lengths({3, 3}, {9000, 5000}).offsets({6000, -1}),
};

SPARSA_BACKEND_TABLE(PrefillCases, AttentionCase, kPrefillCases);
SPARSA_BACKEND_TABLE(QueryOffsetCases, AttentionCase, kQueryOffsetCases);
SPARSA_BACKEND_TABLE(SpargeSmoothCases, AttentionCase, kSpargeSmoothCases);
SPARSA_BACKEND_TABLE(SpargePredictionCases, AttentionCase, kSpargePredictionCases);
SPARSA_BACKEND_TABLE(MaskCellCases, AttentionCase, kMaskCellCases);
SPARSA_BACKEND_TABLE(DecodeCases, AttentionCase, kDecodeCases);
SPARSA_BACKEND_TABLE(DeltaCases, AttentionCase, kDeltaCases);
SPARSA_BACKEND_TABLE(WgmmaCases, AttentionCase, kWgmmaCases);
SPARSA_BACKEND_TABLE(PvSkipCases, AttentionCase, kPvSkipCases);
SPARSA_BACKEND_TABLE(SelectCases, AttentionCase, kSelectCases);
SPARSA_BACKEND_TABLE(TokenSparseCases, AttentionCase, kTokenSparseCases);

TEST_P(PrefillCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(QueryOffsetCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(DecodeCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(DeltaCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(WgmmaCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(MaskCellCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(SpargePredictionCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(SpargeSmoothCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(PvSkipCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(SelectCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }
TEST_P(TokenSparseCases, MatchesReference) { st::check_case(ctx(), row(), st::test_seed(0)); }

}  // namespace
