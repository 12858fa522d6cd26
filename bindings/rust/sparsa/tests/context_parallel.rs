//! Context-parallel TOKEN_SELECT decode (docs/context_parallel.md) on two simulated shards of one sequence: the
//! shards' index sets together equal the single-context selection, and the merged state its output.
use sparsa::{merge_states, Attention, Context, Policy, TensorMut, TensorRef, CP_SUM_DIGITS};

const N: usize = 200;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const TOP_K: usize = 20;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 200) as f32 / 100.0 - 1.0).collect()
}

fn policy<'a>() -> Policy<'a> {
    Policy::token_select().select_n_init(4).select_n_local(8).select_top_k(TOP_K as i32).select_cache_theta(1.0)
}

#[test]
fn two_shards_select_what_one_context_selects_and_merge_to_its_output() {
    let ctx = Context::cpu().unwrap();
    let (q, k, v) = (values(HQ * D, 1), values(N * HKV * D, 2), values(N * HKV * D, 3));
    let q_shape = [1, 1, HQ as i64, D as i64];
    let q_t = TensorRef::new(&q, &q_shape).unwrap();

    // One context over the whole cache.
    let (mut want_out, mut want_lse, mut selected) = (vec![0f32; HQ * D], vec![0f32; HQ], vec![-7i32; N]);
    {
        let kv_shape = [1, N as i64, HKV as i64, D as i64];
        let (k_t, v_t) = (TensorRef::new(&k, &kv_shape).unwrap(), TensorRef::new(&v, &kv_shape).unwrap());
        let mut out = TensorMut::new(&mut want_out, &q_shape).unwrap();
        let mut lse = TensorMut::new(&mut want_lse, &[1, HQ as i64, 1]).unwrap();
        let mut sel = TensorMut::new(&mut selected, &[1, 1, N as i64]).unwrap();
        Attention::new(&q_t, &k_t, &v_t, &mut out)
            .lse(&mut lse)
            .selected_indices(&mut sel)
            .run(&ctx, &policy())
            .unwrap();
    }
    let want_set: Vec<i32> = selected.iter().copied().filter(|&t| t >= 0).collect();

    // Two shards: keys [0, 77) and [77, 200).
    let cuts = [0usize, 77, N];
    let shard_kv = |g: usize, x: &[f32]| x[cuts[g] * HKV * D..cuts[g + 1] * HKV * D].to_vec();
    let total = [N as i32];
    let total_t = TensorRef::new(&total, &[1]).unwrap();
    let starts: Vec<[i32; 1]> = (0..2).map(|g| [cuts[g] as i32]).collect();
    let (ks, vs): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (0..2).map(|g| (shard_kv(g, &k), shard_kv(g, &v))).unzip();
    let shard_shape = |g: usize| [1, (cuts[g + 1] - cuts[g]) as i64, HKV as i64, D as i64];

    let mut global_max = vec![f64::NEG_INFINITY; HQ];
    let mut global_sum = vec![0i64; HQ * CP_SUM_DIGITS];
    let mut all_votes = vec![0f64; 2 * TOP_K];
    let mut all_positions = vec![0i32; 2 * TOP_K];
    let mut sets = Vec::new();
    let mut states: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    for step in 1..=4 {
        for g in 0..2 {
            let shape = shard_shape(g);
            let (k_t, v_t) = (TensorRef::new(&ks[g], &shape).unwrap(), TensorRef::new(&vs[g], &shape).unwrap());
            let start_t = TensorRef::new(&starts[g], &[1]).unwrap();
            let mut unused = vec![0f32; HQ * D];
            let mut unused_t = TensorMut::new(&mut unused, &q_shape).unwrap();
            let call = Attention::new(&q_t, &k_t, &v_t, &mut unused_t);
            match step {
                1 => {
                    let mut local = vec![0f64; HQ];
                    call.cp_select_max(
                        &ctx,
                        &policy(),
                        &start_t,
                        &total_t,
                        &mut TensorMut::new(&mut local, &[1, HQ as i64]).unwrap(),
                    )
                    .unwrap();
                    global_max.iter_mut().zip(&local).for_each(|(m, &x)| *m = m.max(x));
                }
                2 => {
                    let mut local = vec![0i64; global_sum.len()];
                    let max_t = TensorRef::new(&global_max, &[1, HQ as i64]).unwrap();
                    let mut sum_t = TensorMut::new(&mut local, &[1, HQ as i64, CP_SUM_DIGITS as i64]).unwrap();
                    call.cp_select_sum(&ctx, &policy(), &start_t, &total_t, &max_t, &mut sum_t).unwrap();
                    global_sum.iter_mut().zip(&local).for_each(|(s, &x)| *s += x);
                }
                3 => {
                    let max_t = TensorRef::new(&global_max, &[1, HQ as i64]).unwrap();
                    let sum_t = TensorRef::new(&global_sum, &[1, HQ as i64, CP_SUM_DIGITS as i64]).unwrap();
                    let list = [1, 1, TOP_K as i64];
                    let mut votes = TensorMut::new(&mut all_votes[g * TOP_K..(g + 1) * TOP_K], &list).unwrap();
                    let mut positions = TensorMut::new(&mut all_positions[g * TOP_K..(g + 1) * TOP_K], &list).unwrap();
                    call.cp_select_topk(
                        &ctx,
                        &policy(),
                        &start_t,
                        &total_t,
                        &max_t,
                        &sum_t,
                        &mut votes,
                        &mut positions,
                    )
                    .unwrap();
                }
                _ => {
                    let gathered = [2, 1, 1, TOP_K as i64];
                    let votes = TensorRef::new(&all_votes, &gathered).unwrap();
                    let positions = TensorRef::new(&all_positions, &gathered).unwrap();
                    let cap = shape[1];
                    let mut ids = vec![-7i32; cap as usize];
                    call.cp_select_indices(
                        &ctx,
                        &policy(),
                        &start_t,
                        &total_t,
                        &votes,
                        &positions,
                        &mut TensorMut::new(&mut ids, &[1, 1, cap]).unwrap(),
                    )
                    .unwrap();
                    sets.extend(ids.iter().filter(|&&t| t >= 0).map(|&t| t + cuts[g] as i32));
                    // The shard's partial state over its part of the index set.
                    let (mut out, mut lse) = (vec![0f32; HQ * D], vec![0f32; HQ]);
                    {
                        let ids_t = TensorRef::new(&ids, &[1, 1, cap]).unwrap();
                        let mut out_t = TensorMut::new(&mut out, &q_shape).unwrap();
                        let mut lse_t = TensorMut::new(&mut lse, &[1, HQ as i64, 1]).unwrap();
                        Attention::new(&q_t, &k_t, &v_t, &mut out_t)
                            .lse(&mut lse_t)
                            .run(&ctx, &Policy::token_indices(ids_t))
                            .unwrap();
                    }
                    states.push((out, lse));
                }
            }
        }
    }
    sets.sort_unstable();
    assert_eq!(sets, want_set);

    let (mut out, mut lse) = (vec![0f32; HQ * D], vec![0f32; HQ]);
    merge_states(
        &ctx,
        &TensorRef::new(&states[0].0, &q_shape).unwrap(),
        &TensorRef::new(&states[0].1, &[1, HQ as i64, 1]).unwrap(),
        &TensorRef::new(&states[1].0, &q_shape).unwrap(),
        &TensorRef::new(&states[1].1, &[1, HQ as i64, 1]).unwrap(),
        &mut TensorMut::new(&mut out, &q_shape).unwrap(),
        Some(&mut TensorMut::new(&mut lse, &[1, HQ as i64, 1]).unwrap()),
    )
    .unwrap();
    let scale = want_out.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = out.iter().zip(&want_out).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= 1e-5 * scale, "merged output differs by {diff} (scale {scale})");
    for (a, b) in lse.iter().zip(&want_lse) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "lse {a} vs {b}");
    }
}
