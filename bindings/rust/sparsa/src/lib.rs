#![doc = include_str!("../../README.md")]
mod attention;
mod context;
mod error;
mod policy;
mod tensor;
mod utilities;

pub use attention::{stat, Attention, SpargeTuneOptions, CP_SUM_DIGITS};
pub use context::{Context, ContextOptions, SelectionCache};
pub use error::{Error, Result, Status};
pub use policy::{Policy, PolicyKind};
pub use tensor::{Device, Dtype, Element, TensorMut, TensorRef};
pub use utilities::{
    drift_select_layers, head_mapping, hilbert_permutation, kv_prefetch, merge_states, topk_from_scores,
    PrefetchOutputs,
};

/// The loaded library's version as (major, minor, patch).
pub fn version() -> (u32, u32, u32) {
    // SAFETY: a pure query.
    let encoded = unsafe { sparsa_sys::sparsa_version() };
    (encoded / 10000, encoded / 100 % 100, encoded % 100)
}
