//! The attention run: a builder over `sparsa_attention_args` that borrows every tensor for the call.
use std::marker::PhantomData;
use std::ptr;

use sparsa_sys as sys;

use crate::context::{Context, SelectionCache};
use crate::error::{check, Result};
use crate::policy::Policy;
use crate::tensor::{TensorMut, TensorRef};

/// Indices into the `stats` output of a run (`sparsa_stat_index`).
pub mod stat {
    pub const PAIRS_COMPUTED: usize = 0;
    pub const PAIRS_DENSE: usize = 1;
    pub const BLOCKS_COMPUTED: usize = 2;
    pub const BLOCKS_TOTAL: usize = 3;
    pub const PV_BLOCKS_SKIPPED: usize = 4;
    pub const CACHE_HITS: usize = 5;
    pub const CACHE_MISSES: usize = 6;
    /// Counters defined by this version.
    pub const COUNT: usize = 7;
}

/// Targets of the SPARGE tuner (`sparsa_sparge_tune_options`); `Default` gives the library's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpargeTuneOptions {
    /// Relative-L1 target of the (theta, tau) search (default 0.07).
    pub l1: f32,
    /// Relative-L1 target of the lambda search (default 0.08).
    pub pv_l1: f32,
    /// Bisection steps for tau and for lambda (default 10).
    pub search_steps: i32,
    /// A head whose best sparsity is at most this goes dense (default 0.1).
    pub dense_below: f32,
    /// Most negative lambda tried (default -20).
    pub lambda_min: f32,
}

impl Default for SpargeTuneOptions {
    fn default() -> Self {
        // SAFETY: plain data filled by the init call, which cannot fail on a valid pointer.
        let mut raw: sys::sparsa_sparge_tune_options = unsafe { std::mem::zeroed() };
        check(unsafe { sys::sparsa_sparge_tune_options_init(&mut raw, std::mem::size_of_val(&raw)) })
            .expect("sparsa_sparge_tune_options_init");
        SpargeTuneOptions {
            l1: raw.l1,
            pv_l1: raw.pv_l1,
            search_steps: raw.search_steps,
            dense_below: raw.dense_below,
            lambda_min: raw.lambda_min,
        }
    }
}

impl SpargeTuneOptions {
    fn as_raw(&self) -> Result<sys::sparsa_sparge_tune_options> {
        // SAFETY: plain data filled by the init call.
        let mut raw: sys::sparsa_sparge_tune_options = unsafe { std::mem::zeroed() };
        check(unsafe { sys::sparsa_sparge_tune_options_init(&mut raw, std::mem::size_of_val(&raw)) })?;
        raw.l1 = self.l1;
        raw.pv_l1 = self.pv_l1;
        raw.search_steps = self.search_steps;
        raw.dense_below = self.dense_below;
        raw.lambda_min = self.lambda_min;
        Ok(raw)
    }
}

/// Digits of one partial normaliser of `Attention::cp_select_sum` (SPARSA_CP_SUM_DIGITS).
pub const CP_SUM_DIGITS: usize = sys::SPARSA_CP_SUM_DIGITS as usize;

/// One attention call. `'a` is the borrow of every tensor (and of the selection cache) it was given.
///
/// q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], out like q (packed [T, H, D] with cu_seqlens; paged caches with
/// page_table + seq_lens_k). Optional outputs are written only when given.
pub struct Attention<'a> {
    q: sys::sparsa_tensor,
    k: sys::sparsa_tensor,
    v: sys::sparsa_tensor,
    out: sys::sparsa_tensor,
    lse: Option<sys::sparsa_tensor>,
    cu_seqlens_q: Option<sys::sparsa_tensor>,
    cu_seqlens_k: Option<sys::sparsa_tensor>,
    page_table: Option<sys::sparsa_tensor>,
    seq_lens_k: Option<sys::sparsa_tensor>,
    selected_indices: Option<sys::sparsa_tensor>,
    block_mask_out: Option<sys::sparsa_tensor>,
    stats: Option<sys::sparsa_tensor>,
    query_offsets: Option<sys::sparsa_tensor>,
    selection_cache: *mut sys::sparsa_selection_cache,
    causal: bool,
    softmax_scale: f32,
    _borrows: PhantomData<&'a mut ()>,
}

impl<'a> Attention<'a> {
    pub fn new(q: &'a TensorRef<'_>, k: &'a TensorRef<'_>, v: &'a TensorRef<'_>, out: &'a mut TensorMut<'_>) -> Self {
        Attention {
            q: *q.raw(),
            k: *k.raw(),
            v: *v.raw(),
            out: *out.raw(),
            lse: None,
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            page_table: None,
            seq_lens_k: None,
            selected_indices: None,
            block_mask_out: None,
            stats: None,
            query_offsets: None,
            selection_cache: ptr::null_mut(),
            causal: false,
            softmax_scale: 0.0,
            _borrows: PhantomData,
        }
    }
    /// Bottom-right causal mask (§0).
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    /// Score scale; 0 = 1/sqrt(D).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = scale;
        self
    }
    /// Output: f32 LSE [B, Hq, Sq] ([Hq, Tq] packed).
    pub fn lse(mut self, lse: &'a mut TensorMut<'_>) -> Self {
        self.lse = Some(*lse.raw());
        self
    }
    /// int32 [B+1] offsets of packed q/out rows.
    pub fn cu_seqlens_q(mut self, t: &'a TensorRef<'_>) -> Self {
        self.cu_seqlens_q = Some(*t.raw());
        self
    }
    /// int32 [B+1] offsets of packed k/v rows.
    pub fn cu_seqlens_k(mut self, t: &'a TensorRef<'_>) -> Self {
        self.cu_seqlens_k = Some(*t.raw());
        self
    }
    /// int32 [B, max_pages] page ids of paged k/v caches (needs seq_lens_k).
    pub fn page_table(mut self, t: &'a TensorRef<'_>) -> Self {
        self.page_table = Some(*t.raw());
        self
    }
    /// int32 [B] key count per sequence.
    pub fn seq_lens_k(mut self, t: &'a TensorRef<'_>) -> Self {
        self.seq_lens_k = Some(*t.raw());
        self
    }
    /// int32 [B]: §0's offset o per sequence (row i aligned with key i + o); default bottom-right. DENSE,
    /// SINK_WINDOW, BLOCK_SPARSE, SPARGE and TOKEN_INDICES without Δ.
    pub fn query_offsets(mut self, t: &'a TensorRef<'_>) -> Self {
        self.query_offsets = Some(*t.raw());
        self
    }
    /// TokenSelect's selection cache (§6.5).
    pub fn selection_cache(mut self, cache: &'a mut SelectionCache<'_>) -> Self {
        self.selection_cache = cache.raw();
        self
    }
    /// Output: int32 [B, H_sel, cap] index sets (TOKEN_SELECT / TOKEN_SPARSE / TOKEN_INDICES).
    pub fn selected_indices(mut self, t: &'a mut TensorMut<'_>) -> Self {
        self.selected_indices = Some(*t.raw());
        self
    }
    /// Output: uint8 SPARGE block mask.
    pub fn block_mask_out(mut self, t: &'a mut TensorMut<'_>) -> Self {
        self.block_mask_out = Some(*t.raw());
        self
    }
    /// Output: int64 [n] counters (see `stat`).
    pub fn stats(mut self, t: &'a mut TensorMut<'_>) -> Self {
        self.stats = Some(*t.raw());
        self
    }

    /// Runs under `policy` (validates everything first; on error nothing is written).
    pub fn run(&mut self, ctx: &Context, policy: &Policy<'_>) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: args and policy point at descriptors owned by self/policy, alive for the call; the descriptors'
        // memory is borrowed for 'a.
        check(unsafe { sys::sparsa_attention_run(ctx.raw(), &args, &raw_policy) })
    }

    /// Validates and grows the context's scratch for this problem; computes nothing.
    pub fn plan(&self, ctx: &Context, policy: &Policy<'_>) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: as in run; nothing is written.
        check(unsafe { sys::sparsa_attention_plan(ctx.raw(), &args, &raw_policy) })
    }

    /// Tunes SPARGE per query head on this call as calibration (§4 tuner; `out` and the optional outputs are not
    /// read): writes f32 `params` [Hq, 4] (theta, tau, topk_fraction, lambda), ready for
    /// `Policy::sparge().sparge_head_params(..)`, and optionally f32 `metrics` [Hq, 2] (relative L1, sparsity).
    /// `policy` gives block sizes, attention_sink and quantized; `options` the targets (None = defaults).
    pub fn sparge_tune(
        &self,
        ctx: &Context,
        policy: &Policy<'_>,
        options: Option<SpargeTuneOptions>,
        params: &mut TensorMut<'_>,
        metrics: Option<&mut TensorMut<'_>>,
    ) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        let raw_options = options.unwrap_or_default().as_raw()?;
        let metrics = metrics.map_or(ptr::null(), |t| t.raw() as *const _);
        // SAFETY: as in run; the descriptors are borrowed for the call.
        check(unsafe { sys::sparsa_sparge_tune(ctx.raw(), &args, &raw_policy, &raw_options, params.raw(), metrics) })
    }

    /// Context-parallel TOKEN_SELECT, step 1 (docs/context_parallel.md): this call's q and k are every query row
    /// and this shard's keys; `out` is not written. `kv_start`, `kv_total`: int32 [B] host memory. Writes f64
    /// `out_max` [B, Hq]; combine across shards with an element-wise max.
    pub fn cp_select_max(
        &self,
        ctx: &Context,
        policy: &Policy<'_>,
        kv_start: &TensorRef<'_>,
        kv_total: &TensorRef<'_>,
        out_max: &mut TensorMut<'_>,
    ) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: as in run; the descriptors are borrowed for the call.
        check(unsafe {
            sys::sparsa_cp_select_max(ctx.raw(), &args, &raw_policy, kv_start.raw(), kv_total.raw(), out_max.raw())
        })
    }

    /// Step 2: `global_max` f64 [B, Hq] (the max over shards) → i64 `out_sum` [B, Hq, SPARSA_CP_SUM_DIGITS];
    /// combine across shards with an element-wise i64 sum.
    pub fn cp_select_sum(
        &self,
        ctx: &Context,
        policy: &Policy<'_>,
        kv_start: &TensorRef<'_>,
        kv_total: &TensorRef<'_>,
        global_max: &TensorRef<'_>,
        out_sum: &mut TensorMut<'_>,
    ) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: as in run.
        check(unsafe {
            sys::sparsa_cp_select_sum(
                ctx.raw(),
                &args,
                &raw_policy,
                kv_start.raw(),
                kv_total.raw(),
                global_max.raw(),
                out_sum.raw(),
            )
        })
    }

    /// Step 3: the shard's best candidates, f64 `votes` and int32 global `positions` [B, n_sets, top_k] (-inf/-1
    /// past its candidates); all-gather them to [G, B, n_sets, top_k].
    #[allow(clippy::too_many_arguments)]
    pub fn cp_select_topk(
        &self,
        ctx: &Context,
        policy: &Policy<'_>,
        kv_start: &TensorRef<'_>,
        kv_total: &TensorRef<'_>,
        global_max: &TensorRef<'_>,
        global_sum: &TensorRef<'_>,
        votes: &mut TensorMut<'_>,
        positions: &mut TensorMut<'_>,
    ) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: as in run.
        check(unsafe {
            sys::sparsa_cp_select_topk(
                ctx.raw(),
                &args,
                &raw_policy,
                kv_start.raw(),
                kv_total.raw(),
                global_max.raw(),
                global_sum.raw(),
                votes.raw(),
                positions.raw(),
            )
        })
    }

    /// Step 4: from every shard's gathered votes and positions [G, B, n_sets, top_k], this shard's part of the
    /// index set as local key ids, int32 `out_indices` [B, n_sets, cap] (ascending, -1-padded), for a TOKEN_INDICES
    /// run with LSE whose states are then merged with `merge_states`.
    #[allow(clippy::too_many_arguments)]
    pub fn cp_select_indices(
        &self,
        ctx: &Context,
        policy: &Policy<'_>,
        kv_start: &TensorRef<'_>,
        kv_total: &TensorRef<'_>,
        all_votes: &TensorRef<'_>,
        all_positions: &TensorRef<'_>,
        out_indices: &mut TensorMut<'_>,
    ) -> Result<()> {
        let (args, raw_policy) = (self.as_raw(), policy.as_raw());
        // SAFETY: as in run.
        check(unsafe {
            sys::sparsa_cp_select_indices(
                ctx.raw(),
                &args,
                &raw_policy,
                kv_start.raw(),
                kv_total.raw(),
                all_votes.raw(),
                all_positions.raw(),
                out_indices.raw(),
            )
        })
    }

    fn as_raw(&self) -> sys::sparsa_attention_args {
        let optional = |t: &Option<sys::sparsa_tensor>| t.as_ref().map_or(ptr::null(), |t| t as *const _);
        // SAFETY: plain data, filled by the init call.
        let mut args: sys::sparsa_attention_args = unsafe { std::mem::zeroed() };
        check(unsafe { sys::sparsa_attention_args_init(&mut args, std::mem::size_of_val(&args)) })
            .expect("sparsa_attention_args_init");
        args.q = &self.q;
        args.k = &self.k;
        args.v = &self.v;
        args.out = &self.out;
        args.lse = optional(&self.lse);
        args.causal = self.causal as i32;
        args.softmax_scale = self.softmax_scale;
        args.cu_seqlens_q = optional(&self.cu_seqlens_q);
        args.cu_seqlens_k = optional(&self.cu_seqlens_k);
        args.page_table = optional(&self.page_table);
        args.seq_lens_k = optional(&self.seq_lens_k);
        args.selection_cache = self.selection_cache;
        args.selected_indices = optional(&self.selected_indices);
        args.block_mask_out = optional(&self.block_mask_out);
        args.stats = optional(&self.stats);
        args.query_offsets = optional(&self.query_offsets);
        args
    }
}
