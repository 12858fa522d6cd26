//! The safe API beyond the shared vectors: error statuses and messages, slice checks, handles, builders.
use sparsa::{
    Attention, Context, ContextOptions, Device, Dtype, Policy, PolicyKind, SelectionCache, Status, TensorMut, TensorRef,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 200) as f32 / 100.0 - 1.0).collect()
}

struct Qkv {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
}

const SHAPE_Q: [i64; 4] = [1, 16, 4, 8];
const SHAPE_KV: [i64; 4] = [1, 16, 2, 8];

fn qkv() -> Qkv {
    Qkv { q: values(512, 1), k: values(256, 2), v: values(256, 3), out: vec![0.0; 512] }
}

#[test]
fn dense_run_succeeds_and_writes_out() {
    let ctx = Context::cpu().unwrap();
    let mut t = qkv();
    let (q, k, v) = (
        TensorRef::new(&t.q, &SHAPE_Q).unwrap(),
        TensorRef::new(&t.k, &SHAPE_KV).unwrap(),
        TensorRef::new(&t.v, &SHAPE_KV).unwrap(),
    );
    let mut out = TensorMut::new(&mut t.out, &SHAPE_Q).unwrap();
    Attention::new(&q, &k, &v, &mut out).causal(true).run(&ctx, &Policy::dense()).unwrap();
    // Row 0 of a causal run sees only key 0: out equals v[0] of its kv head.
    assert_eq!(&t.out[..8], &t.v[..8]);
}

#[test]
fn dtype_mismatch_is_reported_with_the_c_message() {
    let ctx = Context::cpu().unwrap();
    let mut t = qkv();
    let half = vec![0u16; 256];
    let (q, k, v) = (
        TensorRef::new(&t.q, &SHAPE_Q).unwrap(),
        TensorRef::f16(&half, &SHAPE_KV).unwrap(),
        TensorRef::new(&t.v, &SHAPE_KV).unwrap(),
    );
    let mut out = TensorMut::new(&mut t.out, &SHAPE_Q).unwrap();
    let err = Attention::new(&q, &k, &v, &mut out).run(&ctx, &Policy::dense()).unwrap_err();
    assert_eq!(err.status, Status::DtypeMismatch);
    assert!(err.message.starts_with("k:"), "{}", err.message);
    assert!(t.out.iter().all(|&x| x == 0.0), "nothing is written on failure");
}

#[test]
fn index_out_of_range_and_wrong_shape() {
    let ctx = Context::cpu().unwrap();
    let mut t = qkv();
    let ids = [0i32, 5, 16];
    let (q, k, v) = (
        TensorRef::new(&t.q, &SHAPE_Q).unwrap(),
        TensorRef::new(&t.k, &SHAPE_KV).unwrap(),
        TensorRef::new(&t.v, &SHAPE_KV).unwrap(),
    );
    let indices = TensorRef::new(&ids, &[1, 1, 3]).unwrap();
    {
        let mut out = TensorMut::new(&mut t.out, &SHAPE_Q).unwrap();
        let err = Attention::new(&q, &k, &v, &mut out).run(&ctx, &Policy::token_indices(indices)).unwrap_err();
        assert_eq!(err.status, Status::IndexOutOfRange, "{err}");
    }
    let mut out = TensorMut::new(&mut t.out[..256], &[1, 16, 2, 8]).unwrap();
    let err = Attention::new(&q, &k, &v, &mut out).run(&ctx, &Policy::dense()).unwrap_err();
    assert_eq!(err.status, Status::ShapeMismatch);
    assert!(err.message.contains("out"), "{}", err.message);
}

#[test]
fn invalid_argument_and_unsupported() {
    let ctx = Context::cpu().unwrap();
    let mut t = qkv();
    let mut sel = vec![0i32; 64];
    let (q, k, v) = (
        TensorRef::new(&t.q, &SHAPE_Q).unwrap(),
        TensorRef::new(&t.k, &SHAPE_KV).unwrap(),
        TensorRef::new(&t.v, &SHAPE_KV).unwrap(),
    );
    {
        let mut out = TensorMut::new(&mut t.out, &SHAPE_Q).unwrap();
        let err = Attention::new(&q, &k, &v, &mut out).run(&ctx, &Policy::sink_window().sink_tokens(-1)).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
    }
    let mut out = TensorMut::new(&mut t.out, &SHAPE_Q).unwrap();
    let mut selected = TensorMut::new(&mut sel, &[1, 4, 16]).unwrap();
    let err =
        Attention::new(&q, &k, &v, &mut out).selected_indices(&mut selected).run(&ctx, &Policy::dense()).unwrap_err();
    assert_eq!(err.status, Status::Unsupported, "{err}");
}

#[test]
fn slices_shorter_than_their_shape_are_refused_before_the_call() {
    let data = vec![0f32; 10];
    let err = TensorRef::new(&data, &[2, 8]).err().unwrap();
    assert_eq!(err.status, Status::ShapeMismatch);
    assert!(TensorRef::strided(&data, &[2, 5], &[5, 1]).is_ok());
    assert!(TensorRef::strided(&data, &[2, 5], &[6, 1]).is_err());
    let err = TensorRef::with_dtype(&data, Dtype::F16, &[10]).err().unwrap();
    assert_eq!(err.status, Status::DtypeMismatch);
}

#[test]
fn unknown_backend_and_handles() {
    let err = Context::new(ContextOptions { device: Device::Rocm(7), ..Default::default() });
    assert!(err.is_err());
    let ctx = Context::cpu().unwrap();
    assert_eq!(ctx.device_type().unwrap(), 1);
    let mut cache = SelectionCache::new(&ctx, 1, 4, 2, 8, 4).unwrap();
    assert_eq!(cache.counts().unwrap(), (0, 0));
    cache.reset().unwrap();
    drop(cache); // Drop destroys the cache, then the context
}

#[test]
fn selection_cache_counts_across_runs() {
    let ctx = Context::cpu().unwrap();
    let (qd, kd, vd) = (values(32, 1), values(64 * 16, 2), values(64 * 16, 3));
    let mut od = vec![0f32; 32];
    let (q, k, v) = (
        TensorRef::new(&qd, &[1, 1, 4, 8]).unwrap(),
        TensorRef::new(&kd, &[1, 64, 2, 8]).unwrap(),
        TensorRef::new(&vd, &[1, 64, 2, 8]).unwrap(),
    );
    let policy = Policy::token_select().select_n_init(2).select_n_local(4).select_top_k(4);
    let mut cache = SelectionCache::new(&ctx, 1, 4, 2, 8, 4).unwrap();
    for _ in 0..3 {
        let mut out = TensorMut::new(&mut od, &[1, 1, 4, 8]).unwrap();
        Attention::new(&q, &k, &v, &mut out).selection_cache(&mut cache).run(&ctx, &policy).unwrap();
    }
    assert_eq!(cache.counts().unwrap(), (2, 1));
}

#[test]
fn policy_builders_and_fields() {
    assert_eq!(Policy::sparge().kind(), Some(PolicyKind::Sparge));
    assert!(Policy::dense().set_field("no_such_field", 1.0).is_err());
    assert!(Policy::sink_window().set_field("sink_window", 16.0).is_ok());
    let (perm, inverse) = sparsa::hilbert_permutation(2, 3, 5).unwrap();
    let mut sorted = perm.clone();
    sorted.sort();
    assert_eq!(sorted, (0..30).collect::<Vec<i32>>());
    assert!(perm.iter().enumerate().all(|(i, &p)| inverse[p as usize] == i as i32));
    assert_eq!(sparsa::version().0.to_string(), env!("CARGO_PKG_VERSION_MAJOR"));
}

#[test]
fn sparge_tune_writes_per_head_parameters_the_policy_accepts() {
    let ctx = Context::cpu().unwrap();
    let (b, s, hq, hkv, d) = (1i64, 256i64, 2i64, 1i64, 16i64);
    // A local band: each query matches the keys near it, so the tuner can find block sparsity.
    let mut q = vec![0f32; (b * s * hq * d) as usize];
    let mut k = vec![0f32; (b * s * hkv * d) as usize];
    for t in 0..s as usize {
        for c in 0..d as usize {
            let phase = (t as f32 / 32.0 + c as f32) * 0.7;
            k[t * d as usize + c] = phase.sin();
            for h in 0..hq as usize {
                q[(t * hq as usize + h) * d as usize + c] = 3.0 * phase.sin();
            }
        }
    }
    let v = values((b * s * hkv * d) as usize, 7);
    let mut out = vec![0f32; q.len()];
    let (qt, kt, vt) = (
        TensorRef::new(&q, &[b, s, hq, d]).unwrap(),
        TensorRef::new(&k, &[b, s, hkv, d]).unwrap(),
        TensorRef::new(&v, &[b, s, hkv, d]).unwrap(),
    );
    let mut params = vec![f32::NAN; (hq * 4) as usize];
    let mut metrics = vec![f32::NAN; (hq * 2) as usize];
    {
        let mut ot = TensorMut::new(&mut out, &[b, s, hq, d]).unwrap();
        let mut pt = TensorMut::new(&mut params, &[hq, 4]).unwrap();
        let mut mt = TensorMut::new(&mut metrics, &[hq, 2]).unwrap();
        let policy = Policy::sparge().block_q(32).block_k(16);
        Attention::new(&qt, &kt, &vt, &mut ot)
            .sparge_tune(&ctx, &policy, Some(sparsa::SpargeTuneOptions::default()), &mut pt, Some(&mut mt))
            .unwrap();
    }
    assert!(params.iter().all(|x| !x.is_nan()), "every parameter written: {params:?}");
    for h in 0..hq as usize {
        assert!((-1.0..=1.0).contains(&params[h * 4]), "theta {params:?}");
        assert!(metrics[h * 2] <= 0.08 + 1e-6, "relative L1 within pv_l1: {metrics:?}");
    }
    // The tuned parameters run as a policy.
    let pt = TensorRef::new(&params, &[hq, 4]).unwrap();
    let mut ot = TensorMut::new(&mut out, &[b, s, hq, d]).unwrap();
    let policy = Policy::sparge().block_q(32).block_k(16).sparge_head_params(pt);
    Attention::new(&qt, &kt, &vt, &mut ot).run(&ctx, &policy).unwrap();
}
