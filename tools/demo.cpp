// `sparsa demo`: every policy on one structured long-context input, in one table against dense attention.
//
// The input is built to look like the attention of a long-context model, so that sparse policies have something to
// find: attention sinks (the first few keys attract every query), a local band (queries and keys share smooth
// positional features, so nearby keys score high) and planted needles (a few distant keys that match the queries of
// the last chunk, which a sparse policy must retrieve). Prefill policies run all N rows; the decode-style policies
// (TOKEN_SELECT, TOKEN_INDICES) run the last chunk of rows against the whole context.
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "cli_common.h"
#include "cli_options.h"
#include "npy.h"
#include "policy_eval.h"

namespace sparsa_cli {
namespace {

struct DemoSettings {
  int64_t batch = 1;
  int64_t num_q_heads = 8;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 128;
  int64_t seq_len = 4096;
  int64_t chunk = 64;  // rows of the decode-style runs
  int32_t threads = 0;
  uint64_t seed = 20261121;
  std::string save_dir;  // write q/k/v .npy here, to replay with `sparsa run`
  EvalSettings eval;
};

// Shape of the planted structure.
constexpr int kSinkKeys = 4;            // keys every query attends to
constexpr double kSinkKeyNorm = 16.0;   // |sink direction| in sink keys
constexpr double kSinkQueryNorm = 6.0;  // |sink direction| in every query
constexpr int kPositionalPairs = 16;    // cos/sin feature pairs in dims [0, 32)
constexpr double kPositionalAmp = 2.2;  // q·k of a key at distance 0 gains 16·2.2² ≈ 77
constexpr double kSlowestPeriod = 2048.0;
constexpr double kFastestPeriod = 8.0;
constexpr int kNeedles = 8;
constexpr double kNeedleKeyNorm = 14.0;
constexpr double kNeedleQueryNorm = 8.0;
constexpr int64_t kNeedleQueryRows = 64;  // the last rows (the decode-style chunk) carry needle queries
// SpargeAttn's default theta (0.6) finds no self-similar key block in this input (noise dominates a block's mean),
// which makes it dense; 0.2 lets the prediction work.
constexpr float kDemoSpargeTheta = 0.2f;
constexpr double kKeyNoise = 0.3;    // key noise std
constexpr double kQueryNoise = 0.5;  // query noise std; values have std 1

// Deterministic normal numbers (splitmix64 + Box–Muller), identical on every platform.
class NormalRng {
 public:
  explicit NormalRng(uint64_t seed) : state_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (double(next_u64() >> 11) + 0.5) / 9007199254740992.0;  // (0, 1), 2^53 steps
    const double u2 = double(next_u64() >> 11) / 9007199254740992.0;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * M_PI * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

std::vector<double> unit_vector(NormalRng& rng, int64_t dim) {
  std::vector<double> u(static_cast<size_t>(dim));
  double norm = 0.0;
  for (double& x : u) {
    x = rng.next();
    norm += x * x;
  }
  for (double& x : u) x /= std::sqrt(norm);
  return u;
}

// Adds the positional features of token t to a row (dims [0, 2·kPositionalPairs)).
void add_positional(float* row, int64_t t) {
  for (int c = 0; c < kPositionalPairs; ++c) {
    const double period =
        kFastestPeriod * std::pow(kSlowestPeriod / kFastestPeriod, double(c) / (kPositionalPairs - 1));
    const double angle = 2.0 * M_PI * double(t) / period;
    row[2 * c] += float(kPositionalAmp * std::cos(angle));
    row[2 * c + 1] += float(kPositionalAmp * std::sin(angle));
  }
}

void add_scaled(float* row, const std::vector<double>& direction, double scale) {
  for (size_t c = 0; c < direction.size(); ++c) row[c] += float(scale * direction[c]);
}

int64_t needle_position(int n, int64_t seq_len) {  // spread over the first three quarters of the context
  return kSinkKeys + (3 * seq_len / 4) * (n + 1) / (kNeedles + 1);
}

AttentionInputs make_structured_input(const DemoSettings& s) {
  NormalRng rng(s.seed);
  AttentionInputs in;
  in.causal = true;
  in.q = HostTensor(SPARSA_DTYPE_F32, {s.batch, s.seq_len, s.num_q_heads, s.head_dim});
  in.k = HostTensor(SPARSA_DTYPE_F32, {s.batch, s.seq_len, s.num_kv_heads, s.head_dim});
  in.v = HostTensor(SPARSA_DTYPE_F32, {s.batch, s.seq_len, s.num_kv_heads, s.head_dim});
  for (int64_t i = 0; i < in.q.element_count(); ++i) in.q.data<float>()[i] = float(kQueryNoise * rng.next());
  for (int64_t i = 0; i < in.k.element_count(); ++i) in.k.data<float>()[i] = float(kKeyNoise * rng.next());
  for (int64_t i = 0; i < in.v.element_count(); ++i) in.v.data<float>()[i] = float(rng.next());

  const std::vector<double> sink = unit_vector(rng, s.head_dim);
  std::vector<std::vector<double>> needles;
  for (int n = 0; n < kNeedles; ++n) needles.push_back(unit_vector(rng, s.head_dim));

  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq_len; ++t) {
      for (int64_t h = 0; h < s.num_q_heads; ++h) {
        float* q = in.q.data<float>() + ((b * s.seq_len + t) * s.num_q_heads + h) * s.head_dim;
        add_positional(q, t);
        add_scaled(q, sink, kSinkQueryNorm);
        // Each head of the last rows looks for its own needle (a retrieval head).
        if (t >= s.seq_len - kNeedleQueryRows) add_scaled(q, needles[size_t(h % kNeedles)], kNeedleQueryNorm);
      }
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        float* k = in.k.data<float>() + ((b * s.seq_len + t) * s.num_kv_heads + h) * s.head_dim;
        add_positional(k, t);
        if (t < kSinkKeys) add_scaled(k, sink, kSinkKeyNorm);
      }
    }
    for (int n = 0; n < kNeedles; ++n) {
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        float* k =
            in.k.data<float>() + ((b * s.seq_len + needle_position(n, s.seq_len)) * s.num_kv_heads + h) * s.head_dim;
        add_scaled(k, needles[size_t(n)], kNeedleKeyNorm);
      }
    }
  }
  return in;
}

// The last `rows` query rows of `full` against all its keys (decode / chunked prefill).
AttentionInputs last_rows(const AttentionInputs& full, int64_t rows) {
  AttentionInputs chunk = full;
  const int64_t batch = full.q.shape[0], seq = full.q.shape[1], row_elems = full.q.shape[2] * full.q.shape[3];
  chunk.q = HostTensor(full.q.dtype, {batch, rows, full.q.shape[2], full.q.shape[3]});
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(full.q.data<float>() + (b * seq + seq - rows) * row_elems, rows * row_elems,
                chunk.q.data<float>() + b * rows * row_elems);
  }
  return chunk;
}

// BLOCK_SPARSE input: key block 0 (sinks) plus a band of `band` keys behind each query block.
HostTensor banded_block_mask(const DemoSettings& s, int32_t block_q, int32_t block_k, int64_t band) {
  const int64_t q_blocks = (s.seq_len + block_q - 1) / block_q, k_blocks = (s.seq_len + block_k - 1) / block_k;
  HostTensor mask(SPARSA_DTYPE_U8, {s.batch, s.num_q_heads, q_blocks, k_blocks});
  for (int64_t bh = 0; bh < s.batch * s.num_q_heads; ++bh) {
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t key_end = (kb + 1) * block_k, query_start = qb * block_q;
        const bool in_band = key_end > query_start - band;
        mask.data<uint8_t>()[(bh * q_blocks + qb) * k_blocks + kb] = (kb == 0 || in_band) ? 1 : 0;
      }
    }
  }
  return mask;
}

// A cheap draft of each kv head's attention for the chunk (STS: a draft model's attention, known in advance): the
// softmax attention of every kDraftRowStride-th query row of its group, summed.
constexpr int64_t kDraftRowStride = 4;

HostTensor draft_scores(const AttentionInputs& chunk) {
  const int64_t batch = chunk.k.shape[0], seq = chunk.k.shape[1], hkv = chunk.k.shape[2], dim = chunk.k.shape[3];
  const int64_t rows = chunk.q.shape[1], hq = chunk.q.shape[2], group = hq / hkv;
  HostTensor scores(SPARSA_DTYPE_F32, {batch, hkv, seq});
  const double scale = 1.0 / std::sqrt(double(dim));
  std::vector<double> logits(static_cast<size_t>(seq));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / group;
      float* out = scores.data<float>() + (b * hkv + hk) * seq;
      for (int64_t i = 0; i < rows; i += kDraftRowStride) {
        const float* q = chunk.q.data<float>() + ((b * rows + i) * hq + h) * dim;
        const int64_t visible = seq - rows + i + 1;  // causal, bottom-right
        double max_logit = -INFINITY;
        for (int64_t t = 0; t < visible; ++t) {
          const float* k = chunk.k.data<float>() + ((b * seq + t) * hkv + hk) * dim;
          double dot = 0.0;
          for (int64_t c = 0; c < dim; ++c) dot += double(q[c]) * k[c];
          logits[size_t(t)] = scale * dot;
          max_logit = std::max(max_logit, logits[size_t(t)]);
        }
        double total = 0.0;
        for (int64_t t = 0; t < visible; ++t) total += (logits[size_t(t)] = std::exp(logits[size_t(t)] - max_logit));
        for (int64_t t = 0; t < visible; ++t) out[t] += float(logits[size_t(t)] / total);
      }
    }
  }
  return scores;
}

void save_inputs(const AttentionInputs& in, const std::string& dir) {
  const std::pair<const char*, const HostTensor*> files[] = {{"q.npy", &in.q}, {"k.npy", &in.k}, {"v.npy", &in.v}};
  for (const auto& [name, tensor] : files) {
    NpyArray array;
    array.descr = "<f4";
    array.shape = tensor->shape;
    array.bytes = tensor->bytes;
    write_npy(dir + "/" + name, array);
  }
}

sparsa_policy make_policy(int32_t kind) {
  sparsa_policy p;
  check(sparsa_policy_init(&p, sizeof p, kind), "sparsa_policy_init");
  return p;
}

DemoSettings parse_demo_args(const std::vector<std::string>& args, std::vector<Option>* table_out) {
  DemoSettings s;
  std::vector<Option> table = {
      {"--n", "N", "context length (default 4096; 512..65536)",
       [&](const std::string& v) { s.seq_len = parse_int("--n", v, 512, 65536); }},
      {"--threads", "T", "CPU worker threads (default 0 = one per core)",
       [&](const std::string& v) { s.threads = int32_t(parse_int("--threads", v, 0, 1024)); }},
      {"--heads", "HQ:HKV", "query and kv heads (default 8:2)",
       [&](const std::string& v) {
         const size_t colon = v.find(':');
         if (colon == std::string::npos) throw UsageError("--heads: expected HQ:HKV, got '" + v + "'");
         s.num_q_heads = parse_int("--heads", v.substr(0, colon), 1, 256);
         s.num_kv_heads = parse_int("--heads", v.substr(colon + 1), 1, 256);
         if (s.num_q_heads % s.num_kv_heads != 0) throw UsageError("--heads: HQ must be a multiple of HKV, got " + v);
       }},
      {"--head-dim", "D", "head dimension (default 128; 32..256)",
       [&](const std::string& v) { s.head_dim = parse_int("--head-dim", v, 32, 256); }},
      {"--repeat", "R", "timed runs per policy, fastest counts (default 3; fewer marks the speedup as noise)",
       [&](const std::string& v) { s.eval.repeat = int(parse_int("--repeat", v, 1, 1000)); }},
      {"--seed", "S", "seed of the synthetic input (default 20261121)",
       [&](const std::string& v) { s.seed = uint64_t(parse_int("--seed", v, 0, INT64_MAX)); }},
      {"--save", "DIR", "also write the input as DIR/q.npy, k.npy, v.npy (replay with sparsa run); DIR is created",
       [&](const std::string& v) { s.save_dir = v; }},
      {"--quiet", "", "no progress lines on stderr", [&](const std::string&) { s.eval.progress = false; }},
  };
  parse_options(args, table, "demo");
  if (table_out) *table_out = table;
  return s;
}

}  // namespace

void print_demo_help(std::ostream& os) {
  std::vector<Option> table;
  parse_demo_args({}, &table);
  os << "usage: sparsa demo [options]\n\n"
        "Builds a structured long-context input on the CPU (attention sinks, a local band, planted needles), runs\n"
        "every policy on it and prints one table: achieved sparsity, relative error vs dense, time, speedup.\n"
        "Prefill policies run all rows causally; TOKEN_SELECT and TOKEN_INDICES run the last 64 rows (decode-style)\n"
        "against the whole context, compared with dense attention of those rows.\n\noptions:\n";
  print_options(os, table);
}

int run_demo(const std::vector<std::string>& args) {
  const DemoSettings s = parse_demo_args(args, nullptr);
  const int64_t n = s.seq_len;
  if (!s.save_dir.empty()) make_output_folder(s.save_dir);  // before any compute: a bad folder fails fast
  // Policy sizes scale with N: a window of N/8 keys, 64 sink tokens, a local tail of 256 tokens for decode policies.
  const int32_t sinks = 64, local = 256, window = int32_t(n / 8), block_q = 128, block_k = 64;

  if (s.eval.progress) std::cerr << "sparsa: building the structured input (N=" << n << ") ...\n";
  const AttentionInputs prefill = make_structured_input(s);
  if (!s.save_dir.empty()) save_inputs(prefill, s.save_dir);
  const AttentionInputs chunk = last_rows(prefill, s.chunk);
  const std::string all_rows = "all " + std::to_string(n), chunk_rows = "last " + std::to_string(s.chunk);

  const ContextPtr ctx = make_context(s.threads);

  // Policy inputs that must outlive the runs.
  const HostTensor mask = banded_block_mask(s, block_q, block_k, window);
  const sparsa_tensor mask_view = mask.view();
  constexpr int32_t kIndexBlock = 16;
  const int32_t index_blocks = int32_t(std::max<int64_t>(1, n / 8 / kIndexBlock));
  const HostTensor scores = draft_scores(chunk);
  HostTensor indices(SPARSA_DTYPE_I32, {s.batch, s.num_kv_heads, index_blocks});
  const sparsa_tensor scores_view = scores.view(), indices_view = indices.view();
  check(sparsa_topk_from_scores(ctx.get(), &scores_view, index_blocks, kIndexBlock, &indices_view),
        "sparsa_topk_from_scores");

  std::vector<PolicyResult> results;
  const DenseReference dense = run_dense_reference(ctx.get(), prefill, s.eval, all_rows);
  results.push_back(dense_result(dense, all_rows, s.batch * n * s.num_q_heads));
  auto prefill_case = [&](const std::string& label, const sparsa_policy& p, bool exclude_zero_rows) {
    results.push_back(evaluate_policy(ctx.get(), prefill, dense, label, all_rows, p, exclude_zero_rows, s.eval));
  };

  sparsa_policy sink_window = make_policy(SPARSA_POLICY_SINK_WINDOW);
  sink_window.sink_tokens = sinks;
  sink_window.sink_window = window;
  prefill_case("SINK_WINDOW", sink_window, false);

  sparsa_policy block_sparse = make_policy(SPARSA_POLICY_BLOCK_SPARSE);
  block_sparse.block_q = block_q;
  block_sparse.block_k = block_k;
  block_sparse.block_mask = &mask_view;
  prefill_case("BLOCK_SPARSE (band)", block_sparse, false);

  sparsa_policy sparge = make_policy(SPARSA_POLICY_SPARGE);
  sparge.sparge_attention_sink = 1;
  sparge.sparge_theta = kDemoSpargeTheta;
  prefill_case("SPARGE", sparge, false);

  sparsa_policy token_sparse = make_policy(SPARSA_POLICY_TOKEN_SPARSE);
  token_sparse.token_sparse_min_tokens = int32_t(n / 8);
  prefill_case("TOKEN_SPARSE", token_sparse, true);

  sparsa_policy delta = sink_window;
  delta.flags |= SPARSA_POLICY_FLAG_DELTA;
  prefill_case("SINK_WINDOW+DELTA", delta, false);

  // Decode-style policies on the last chunk, against dense attention of the same rows.
  const DenseReference chunk_dense = run_dense_reference(ctx.get(), chunk, s.eval, chunk_rows);
  results.push_back(dense_result(chunk_dense, chunk_rows, s.batch * s.chunk * s.num_q_heads));

  sparsa_policy token_select = make_policy(SPARSA_POLICY_TOKEN_SELECT);
  token_select.select_n_init = sinks;
  token_select.select_n_local = local;
  token_select.select_top_k = window;
  results.push_back(
      evaluate_policy(ctx.get(), chunk, chunk_dense, "TOKEN_SELECT", chunk_rows, token_select, false, s.eval));

  sparsa_policy token_indices = make_policy(SPARSA_POLICY_TOKEN_INDICES);
  token_indices.indices = &indices_view;
  token_indices.index_block_size = kIndexBlock;
  token_indices.index_n_init = sinks;
  token_indices.index_n_local = local;
  results.push_back(evaluate_policy(ctx.get(), chunk, chunk_dense, "TOKEN_INDICES (draft)", chunk_rows, token_indices,
                                    false, s.eval));

  std::cout << "sparsa " << sparsa_version_string() << " demo: B=" << s.batch << " N=" << n << " Hq=" << s.num_q_heads
            << " Hkv=" << s.num_kv_heads << " D=" << s.head_dim
            << " f32 causal, threads=" << (s.threads ? std::to_string(s.threads) : std::string("auto")) << "\n";
  print_results(std::cout, results);
  return 0;
}

}  // namespace sparsa_cli
