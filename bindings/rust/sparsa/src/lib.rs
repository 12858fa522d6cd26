//! Safe Rust API of sparsa, a sparse-attention kernel library (over the C ABI in `sparsa-sys`).
//!
//! Handles free themselves on drop, every failure is a `sparsa::Error` carrying the status and the library's
//! message, tensors are views of slices (or, unsafely, of raw device pointers), policies are builders.
//!
//! ```
//! use sparsa::{Attention, Context, Policy, Status, TensorMut, TensorRef};
//!
//! # fn main() -> Result<(), sparsa::Error> {
//! let (b, s, hq, hkv, d) = (1i64, 64i64, 4i64, 2i64, 16i64);
//! let values = |n: i64, seed: u32| -> Vec<f32> {
//!     (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 200) as f32 / 100.0 - 1.0)
//!           .collect()
//! };
//! let (q, k, v) = (values(b * s * hq * d, 1), values(b * s * hkv * d, 2), values(b * s * hkv * d, 3));
//! let mut out = vec![0f32; q.len()];
//! let mut stats = vec![0i64; sparsa::stat::COUNT];
//!
//! let ctx = Context::cpu()?;
//! let (qt, kt, vt) = (TensorRef::new(&q, &[b, s, hq, d])?, TensorRef::new(&k, &[b, s, hkv, d])?,
//!                     TensorRef::new(&v, &[b, s, hkv, d])?);
//! let mut ot = TensorMut::new(&mut out, &[b, s, hq, d])?;
//! let mut st = TensorMut::new(&mut stats, &[sparsa::stat::COUNT as i64])?;
//! // StreamingLLM sinks + window with the Δ-Attention correction.
//! let policy = Policy::sink_window().sink_tokens(4).window(16).delta(16, 16);
//! Attention::new(&qt, &kt, &vt, &mut ot).causal(true).stats(&mut st).run(&ctx, &policy)?;
//! println!("sparsity {:.2}", 1.0 - stats[0] as f64 / stats[1] as f64);
//!
//! // Errors carry the status and the message.
//! let short = TensorRef::new(&k[..(b * s * hkv * 8) as usize], &[b, s, hkv, 8])?;
//! let mut ot = TensorMut::new(&mut out, &[b, s, hq, d])?;
//! let err = Attention::new(&qt, &short, &short, &mut ot).run(&ctx, &Policy::dense()).unwrap_err();
//! assert_eq!(err.status, Status::ShapeMismatch);
//! assert!(err.message.contains("head_dim"));
//! # Ok(())
//! # }
//! ```
mod attention;
mod context;
mod error;
mod policy;
mod tensor;
mod utilities;

pub use attention::{stat, Attention};
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
