//! The plain functions beside the run (§0 merge, §4 Hilbert order, §5 drift, §7 top-k / head mapping / prefetch).
use std::ptr;

use sparsa_sys as sys;

use crate::context::Context;
use crate::error::{check, Error, Result, Status};
use crate::tensor::{TensorMut, TensorRef};

fn optional_mut(t: &Option<&mut TensorMut<'_>>) -> *const sys::sparsa_tensor {
    t.as_ref().map_or(ptr::null(), |t| t.raw() as *const _)
}

/// Merges two partial attention states over disjoint key sets (§0): o [B, S, H, D] (or [T, H, D]), lse f32
/// [B, H, S] (or [H, T]). `out_lse` may be None.
pub fn merge_states(
    ctx: &Context,
    o_a: &TensorRef<'_>,
    lse_a: &TensorRef<'_>,
    o_b: &TensorRef<'_>,
    lse_b: &TensorRef<'_>,
    out: &mut TensorMut<'_>,
    out_lse: Option<&mut TensorMut<'_>>,
) -> Result<()> {
    // SAFETY: every descriptor is borrowed for the call; optional ones may be null.
    check(unsafe {
        sys::sparsa_merge_states(
            ctx.raw(),
            o_a.raw(),
            lse_a.raw(),
            o_b.raw(),
            lse_b.raw(),
            out.raw(),
            optional_mut(&out_lse),
        )
    })
}

/// The `k` best token ids (block_size 1) or block ids of f32 scores [B, H, N] into int32 `out` [B, H, k],
/// each row ascending; ties go to the smaller id.
pub fn topk_from_scores(
    ctx: &Context,
    scores: &TensorRef<'_>,
    k: i32,
    block_size: i32,
    out: &mut TensorMut<'_>,
) -> Result<()> {
    // SAFETY: descriptors borrowed for the call.
    check(unsafe { sys::sparsa_topk_from_scores(ctx.raw(), scores.raw(), k, block_size, out.raw()) })
}

/// STS head mapping (host memory): draft f32 [T, Hd, N], target f32 [T, Ht, N] → int32 `out` [Ht].
pub fn head_mapping(draft: &TensorRef<'_>, target: &TensorRef<'_>, k: i32, out: &mut TensorMut<'_>) -> Result<()> {
    // SAFETY: descriptors borrowed for the call.
    check(unsafe { sys::sparsa_head_mapping(draft.raw(), target.raw(), k, out.raw()) })
}

/// The 3-D Hilbert order of a t×h×w grid: (perm, inverse), each of t*h*w entries.
pub fn hilbert_permutation(t: i32, h: i32, w: i32) -> Result<(Vec<i32>, Vec<i32>)> {
    let n = (t as i64) * (h as i64) * (w as i64);
    if t < 0 || h < 0 || w < 0 || n > i32::MAX as i64 {
        return Err(Error::new(Status::InvalidArgument, format!("hilbert_permutation: grid {t}x{h}x{w} out of range")));
    }
    let (mut perm, mut inverse) = (vec![0i32; n as usize], vec![0i32; n as usize]);
    // SAFETY: both buffers hold exactly t*h*w entries, the capacity passed.
    check(unsafe { sys::sparsa_hilbert_permutation(t, h, w, perm.as_mut_ptr(), inverse.as_mut_ptr(), n) })?;
    Ok((perm, inverse))
}

/// Drift-based layer selection (host memory): h_in/h_out [L, T, D] → ratio f32 [L] and sparse u8 [L] (either
/// optional).
pub fn drift_select_layers(
    h_in: &TensorRef<'_>,
    h_out: &TensorRef<'_>,
    delta: f32,
    ratio: Option<&mut TensorMut<'_>>,
    sparse: Option<&mut TensorMut<'_>>,
) -> Result<()> {
    // SAFETY: descriptors borrowed for the call; optional ones may be null.
    check(unsafe {
        sys::sparsa_drift_select_layers(h_in.raw(), h_out.raw(), delta, optional_mut(&ratio), optional_mut(&sparse))
    })
}

/// The outputs of `kv_prefetch` (borrowed for the call).
pub struct PrefetchOutputs<'o, 'a> {
    /// [B, C, Hkv, D] compact K rows; rows past each union are left untouched.
    pub k_dst: &'o mut TensorMut<'a>,
    pub v_dst: &'o mut TensorMut<'a>,
    /// int32 [B, C]: original token id of each compact row, ascending, -1-padded.
    pub positions: &'o mut TensorMut<'a>,
    /// int32 [B, H_idx, k]: each index replaced by its compact row.
    pub remapped: &'o mut TensorMut<'a>,
    /// int32 [B]: union sizes (optional).
    pub counts: Option<&'o mut TensorMut<'a>>,
}

/// Copies the K/V rows `indices` [B, H_idx, k] selects from host k_src/v_src [B, N, Hkv, D] into compact buffers
/// on the context's device (asynchronously on its stream; a plain gather on CPU).
pub fn kv_prefetch(
    ctx: &Context,
    k_src: &TensorRef<'_>,
    v_src: &TensorRef<'_>,
    indices: &TensorRef<'_>,
    outputs: PrefetchOutputs<'_, '_>,
) -> Result<()> {
    // SAFETY: descriptors borrowed for the call; counts may be null.
    check(unsafe {
        sys::sparsa_kv_prefetch(
            ctx.raw(),
            k_src.raw(),
            v_src.raw(),
            indices.raw(),
            outputs.k_dst.raw(),
            outputs.v_dst.raw(),
            outputs.positions.raw(),
            outputs.remapped.raw(),
            optional_mut(&outputs.counts),
        )
    })
}
