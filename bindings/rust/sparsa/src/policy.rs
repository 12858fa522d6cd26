//! Selection policies (ALGORITHMS.md §1–§8) as one builder: a kind constructor starts from the library's defaults
//! (`sparsa_policy_init`), setters named after the C fields change what you need, `delta` adds §8.
//!
//! ```no_run
//! # use sparsa::Policy;
//! let policy = Policy::sink_window().sink_tokens(4).window(1024).delta(64, 128);
//! ```
use std::ptr;

use sparsa_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::tensor::TensorRef;

/// `sparsa_policy_kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Dense,
    SinkWindow,
    BlockSparse,
    Sparge,
    TokenSparse,
    TokenSelect,
    TokenIndices,
}

impl PolicyKind {
    pub fn code(self) -> i32 {
        (match self {
            PolicyKind::Dense => sys::SPARSA_POLICY_DENSE,
            PolicyKind::SinkWindow => sys::SPARSA_POLICY_SINK_WINDOW,
            PolicyKind::BlockSparse => sys::SPARSA_POLICY_BLOCK_SPARSE,
            PolicyKind::Sparge => sys::SPARSA_POLICY_SPARGE,
            PolicyKind::TokenSparse => sys::SPARSA_POLICY_TOKEN_SPARSE,
            PolicyKind::TokenSelect => sys::SPARSA_POLICY_TOKEN_SELECT,
            PolicyKind::TokenIndices => sys::SPARSA_POLICY_TOKEN_INDICES,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<PolicyKind> {
        use PolicyKind::*;
        [Dense, SinkWindow, BlockSparse, Sparge, TokenSparse, TokenSelect, TokenIndices]
            .into_iter()
            .find(|k| k.code() == code)
    }
}

/// A selection policy and the tensors it borrows for `'a`.
#[derive(Clone)]
pub struct Policy<'a> {
    raw: sys::sparsa_policy,
    block_mask: Option<TensorRef<'a>>,
    sparge_head_params: Option<TensorRef<'a>>,
    indices: Option<TensorRef<'a>>,
    head_map: Option<TensorRef<'a>>,
}

// Integer setters: (method, C field, doc).
macro_rules! int_setters {
    ($(($method:ident, $field:ident, $doc:literal)),* $(,)?) => {
        $( #[doc = $doc] pub fn $method(mut self, value: i32) -> Self { self.raw.$field = value; self } )*
        fn set_int_field(&mut self, name: &str, value: i32) -> bool {
            match name { $( stringify!($field) => self.raw.$field = value, )* _ => return false }
            true
        }
    };
}
macro_rules! float_setters {
    ($(($method:ident, $field:ident, $doc:literal)),* $(,)?) => {
        $( #[doc = $doc] pub fn $method(mut self, value: f32) -> Self { self.raw.$field = value; self } )*
        fn set_float_field(&mut self, name: &str, value: f32) -> bool {
            match name { $( stringify!($field) => self.raw.$field = value, )* _ => return false }
            true
        }
    };
}

impl<'a> Policy<'a> {
    /// The library's defaults for `kind`.
    pub fn new(kind: PolicyKind) -> Self {
        // SAFETY: plain data, filled by the init call (which cannot fail for a valid kind).
        let mut raw: sys::sparsa_policy = unsafe { std::mem::zeroed() };
        check(unsafe { sys::sparsa_policy_init(&mut raw, std::mem::size_of_val(&raw), kind.code()) })
            .expect("sparsa_policy_init of a known kind");
        Policy { raw, block_mask: None, sparge_head_params: None, indices: None, head_map: None }
    }
    /// §1 every (causal-)allowed key.
    pub fn dense() -> Self {
        Self::new(PolicyKind::Dense)
    }
    /// §2 sinks + local window (defaults 128 and 2048).
    pub fn sink_window() -> Self {
        Self::new(PolicyKind::SinkWindow)
    }
    /// §3 the caller's uint8 block mask [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)].
    pub fn block_sparse(mask: TensorRef<'a>) -> Self {
        Self::new(PolicyKind::BlockSparse).block_mask(mask)
    }
    /// §4 SpargeAttn (defaults: blocks 128×64, theta 0.6, tau 0.98, no PV skip).
    pub fn sparge() -> Self {
        Self::new(PolicyKind::Sparge)
    }
    /// §5 Token Sparse Attention (prefill; always causal).
    pub fn token_sparse() -> Self {
        Self::new(PolicyKind::TokenSparse)
    }
    /// §6 TokenSelect (decode / chunked prefill; always causal).
    pub fn token_select() -> Self {
        Self::new(PolicyKind::TokenSelect)
    }
    /// §7 STS: int32 indices [B, H_idx, k] known in advance (-1 = unused slot).
    pub fn token_indices(indices: TensorRef<'a>) -> Self {
        Self::new(PolicyKind::TokenIndices).indices(indices)
    }

    pub fn kind(&self) -> Option<PolicyKind> {
        PolicyKind::from_code(self.raw.kind)
    }

    int_setters!(
        (sink_tokens, sink_tokens, "§2 leading keys every row sees."),
        (window, sink_window, "§2 local window width in keys (C field sink_window)."),
        (block_q, block_q, "§3/§4 query rows per block."),
        (block_k, block_k, "§3/§4 keys per block."),
        (sparge_attention_sink, sparge_attention_sink, "§4 1 = always keep key block 0."),
        (sparge_quantized, sparge_quantized, "§4 1 = int8 Q·Kᵀ (Sage path)."),
        (token_sparse_window, token_sparse_window, "§5 W, the scoring window of last queries."),
        (token_sparse_pool_kernel, token_sparse_pool_kernel, "§5 odd avg-pool kernel."),
        (token_sparse_min_tokens, token_sparse_min_tokens, "§5 minimum budget."),
        (select_n_init, select_n_init, "§6 leading tokens always kept."),
        (select_n_local, select_n_local, "§6 trailing tokens always kept."),
        (select_top_k, select_top_k, "§6 selected candidates."),
        (select_scale_scores, select_scale_scores, "§6 1 = score with scale · q̄·k."),
        (select_per_kv_head, select_per_kv_head, "§6 1 = one selection per kv head."),
        (index_block_size, index_block_size, "§7 1 = token ids, > 1 = block ids of that size."),
        (index_n_init, index_n_init, "§7 leading tokens always included."),
        (index_n_local, index_n_local, "§7 trailing tokens always included."),
        (delta_gamma, delta_gamma, "§8 stride of the dense anchor rows (with the DELTA flag)."),
        (delta_tail_min, delta_tail_min, "§8 minimum dense tail rows (with the DELTA flag)."),
    );
    float_setters!(
        (sparge_theta, sparge_theta, "§4 self-similarity threshold in [-1, 1]."),
        (sparge_tau, sparge_tau, "§4 TopCdf mass in (0, 1]."),
        (sparge_topk_fraction, sparge_topk_fraction, "§4 > 0 selects the top-k variant."),
        (sparge_lambda, sparge_lambda, "§4 PV-skip threshold (natural log, <= 0; -inf = off)."),
        (token_sparse_coverage, token_sparse_coverage, "§5 τ, dropped score mass."),
        (select_cache_theta, select_cache_theta, "§6 cosine threshold of the selection cache."),
    );

    /// §8 Δ-Attention correction with anchor stride `gamma` and dense tail of at least `tail_min` rows.
    pub fn delta(mut self, gamma: i32, tail_min: i32) -> Self {
        self.raw.flags |= sys::SPARSA_POLICY_FLAG_DELTA;
        self.raw.delta_gamma = gamma;
        self.raw.delta_tail_min = tail_min;
        self
    }
    /// §3 the block mask (BLOCK_SPARSE).
    pub fn block_mask(mut self, mask: TensorRef<'a>) -> Self {
        self.block_mask = Some(mask);
        self
    }
    /// §4 per-head f32 [Hq, 4] (theta, tau, topk_fraction, lambda); NaN = the scalar field.
    pub fn sparge_head_params(mut self, params: TensorRef<'a>) -> Self {
        self.sparge_head_params = Some(params);
        self
    }
    /// §7 int32 [B, H_idx, k] token or block ids (TOKEN_INDICES; `token_indices` sets them too).
    pub fn indices(mut self, indices: TensorRef<'a>) -> Self {
        self.indices = Some(indices);
        self
    }
    /// §7 int32 [Hq]: the row of `indices` each query head uses.
    pub fn head_map(mut self, map: TensorRef<'a>) -> Self {
        self.head_map = Some(map);
        self
    }

    /// Sets a scalar field by its C name (`"sink_tokens"`, `"sparge_theta"`, `"flags"`, ...); integer fields take
    /// the value truncated to i32. Used to replay the shared test vectors.
    pub fn set_field(mut self, name: &str, value: f64) -> Result<Self> {
        let known = match name {
            "flags" => {
                self.raw.flags = value as u32;
                true
            }
            _ => self.set_int_field(name, value as i32) || self.set_float_field(name, value as f32),
        };
        if known {
            Ok(self)
        } else {
            Err(Error::new(Status::InvalidArgument, format!("policy: no scalar field named {name}")))
        }
    }

    /// The C struct, its tensor pointers aimed at this policy's descriptors (valid while `self` is borrowed).
    pub(crate) fn as_raw(&self) -> sys::sparsa_policy {
        let pointer = |t: &Option<TensorRef<'a>>| t.as_ref().map_or(ptr::null(), |t| t.raw() as *const _);
        let mut raw = self.raw;
        raw.block_mask = pointer(&self.block_mask);
        raw.sparge_head_params = pointer(&self.sparge_head_params);
        raw.indices = pointer(&self.indices);
        raw.head_map = pointer(&self.head_map);
        raw
    }
}
