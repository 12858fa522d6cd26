//! Runs every shared test vector (tests/vectors/*.spv, format in tests/vectors/FORMAT.md) through the safe API and
//! compares every output byte for byte.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sparsa::{
    Attention, Context, Dtype, Policy, PolicyKind, PrefetchOutputs, SelectionCache, Status, TensorMut, TensorRef,
};

const MAGIC: &[u8; 8] = b"SPARSAV1";
const POISON: u8 = 0xA5;

// ---- Typed buffers ---------------------------------------------------------------------------------------------

/// Tensor data in a typed (so properly aligned) vector; halves are kept as u16 bits.
#[derive(Clone, Debug)]
enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bits16(Vec<u16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    I8(Vec<i8>),
}

#[derive(Clone, Debug)]
struct Tensor {
    dtype: Dtype,
    shape: Vec<i64>,
    data: Data,
}

macro_rules! decode {
    ($bytes:expr, $t:ty) => {
        $bytes.chunks_exact(std::mem::size_of::<$t>()).map(|c| <$t>::from_le_bytes(c.try_into().unwrap())).collect()
    };
}

impl Tensor {
    fn from_bytes(dtype: Dtype, shape: Vec<i64>, bytes: &[u8]) -> Tensor {
        let data = match dtype {
            Dtype::F32 => Data::F32(decode!(bytes, f32)),
            Dtype::F64 => Data::F64(decode!(bytes, f64)),
            Dtype::F16 | Dtype::BF16 => Data::Bits16(decode!(bytes, u16)),
            Dtype::I32 => Data::I32(decode!(bytes, i32)),
            Dtype::I64 => Data::I64(decode!(bytes, i64)),
            Dtype::U8 => Data::U8(bytes.to_vec()),
            Dtype::I8 => Data::I8(bytes.iter().map(|&b| b as i8).collect()),
        };
        Tensor { dtype, shape, data }
    }

    /// Same shape and dtype, every byte `fill`.
    fn filled(&self, fill: u8) -> Tensor {
        let n = self.bytes().len();
        Tensor::from_bytes(self.dtype, self.shape.clone(), &vec![fill; n])
    }

    fn bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::Bits16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::U8(v) => v.clone(),
            Data::I8(v) => v.iter().map(|&x| x as u8).collect(),
        }
    }

    fn view(&self) -> TensorRef<'_> {
        let shape = &self.shape;
        match &self.data {
            Data::F32(v) => TensorRef::new(v, shape),
            Data::F64(v) => TensorRef::new(v, shape),
            Data::Bits16(v) if self.dtype == Dtype::F16 => TensorRef::f16(v, shape),
            Data::Bits16(v) => TensorRef::bf16(v, shape),
            Data::I32(v) => TensorRef::new(v, shape),
            Data::I64(v) => TensorRef::new(v, shape),
            Data::U8(v) => TensorRef::new(v, shape),
            Data::I8(v) => TensorRef::new(v, shape),
        }
        .expect("input view")
    }

    fn view_mut(&mut self) -> TensorMut<'_> {
        let shape = self.shape.clone();
        let dtype = self.dtype;
        match &mut self.data {
            Data::F32(v) => TensorMut::new(v, &shape),
            Data::F64(v) => TensorMut::new(v, &shape),
            Data::Bits16(v) => TensorMut::with_dtype(v, dtype, &shape),
            Data::I32(v) => TensorMut::new(v, &shape),
            Data::I64(v) => TensorMut::new(v, &shape),
            Data::U8(v) => TensorMut::new(v, &shape),
            Data::I8(v) => TensorMut::new(v, &shape),
        }
        .expect("output view")
    }

    fn i32s(&self) -> &[i32] {
        match &self.data {
            Data::I32(v) => v,
            other => panic!("expected int32 data, got {other:?}"),
        }
    }
}

// ---- The reader ------------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Entry {
    Tensor(Tensor),
    I64(i64),
    F64(f64),
    Str(String),
}

struct Reader<'b> {
    blob: &'b [u8],
    pos: usize,
}

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize) -> &'b [u8] {
        let out = &self.blob[self.pos..self.pos + n];
        self.pos += n;
        out
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
}

fn read_vector(path: &Path) -> BTreeMap<String, Entry> {
    let blob = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&blob[..8], MAGIC, "{}: bad magic", path.display());
    let mut r = Reader { blob: &blob, pos: 8 };
    let mut entries = BTreeMap::new();
    for _ in 0..r.u32() {
        let name_len = r.u16() as usize;
        let name = String::from_utf8(r.take(name_len).to_vec()).unwrap();
        let entry = match r.u8() {
            1 => {
                let dtype = Dtype::from_code(r.u32() as i32).expect("known dtype");
                let ndim = r.u8() as usize;
                let shape: Vec<i64> = (0..ndim).map(|_| r.u64() as i64).collect();
                let nbytes = r.u64() as usize;
                Entry::Tensor(Tensor::from_bytes(dtype, shape, r.take(nbytes)))
            }
            2 => Entry::I64(r.u64() as i64),
            3 => Entry::F64(f64::from_bits(r.u64())),
            4 => {
                let len = r.u32() as usize;
                Entry::Str(String::from_utf8(r.take(len).to_vec()).unwrap())
            }
            other => panic!("{}: entry {name} of unknown type {other}", path.display()),
        };
        entries.insert(name, entry);
    }
    assert_eq!(r.pos, blob.len(), "{}: trailing bytes", path.display());
    entries
}

fn vectors_dir() -> PathBuf {
    std::env::var_os("SPARSA_VECTORS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/vectors"))
}

fn vector_paths() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(vectors_dir())
        .expect("tests/vectors readable")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().map_or(false, |e| e == "spv"))
        .collect();
    paths.sort();
    paths
}

// ---- One case ----------------------------------------------------------------------------------------------------

struct Case {
    name: String,
    entries: BTreeMap<String, Entry>,
    inputs: BTreeMap<String, Tensor>,
    outputs: BTreeMap<String, Tensor>,
}

impl Case {
    fn load(path: &Path) -> Case {
        let entries = read_vector(path);
        let call = match entries.get("call").or_else(|| entries.get("op")) {
            Some(Entry::Str(s)) => s.clone(),
            _ => panic!("{}: no op", path.display()),
        };
        let (mut inputs, mut outputs) = (BTreeMap::new(), BTreeMap::new());
        for (key, entry) in &entries {
            if let Entry::Tensor(t) = entry {
                if let Some(name) = key.strip_prefix("in.") {
                    inputs.insert(name.to_string(), t.clone());
                } else if let Some(name) = key.strip_prefix("out.") {
                    let zero_filled = call == "kv_prefetch" && (name == "k_dst" || name == "v_dst");
                    outputs.insert(name.to_string(), t.filled(if zero_filled { 0 } else { POISON }));
                }
            }
        }
        Case { name: path.file_name().unwrap().to_string_lossy().into_owned(), entries, inputs, outputs }
    }

    fn string(&self, name: &str) -> Option<&str> {
        match self.entries.get(name) {
            Some(Entry::Str(s)) => Some(s),
            _ => None,
        }
    }
    fn int(&self, name: &str) -> Option<i64> {
        match self.entries.get(name) {
            Some(Entry::I64(v)) => Some(*v),
            _ => None,
        }
    }
    fn float(&self, name: &str) -> Option<f64> {
        match self.entries.get(name) {
            Some(Entry::F64(v)) => Some(*v),
            _ => None,
        }
    }
    fn call(&self) -> &str {
        self.string("call").or_else(|| self.string("op")).unwrap()
    }

    fn policy(&self) -> Policy<'_> {
        let kind = PolicyKind::from_code(self.int("policy.kind").expect("policy.kind") as i32).expect("known kind");
        let mut policy = Policy::new(kind);
        for (key, entry) in &self.entries {
            let field = match key.strip_prefix("policy.") {
                Some(field) => field,
                None => continue,
            };
            let value = match entry {
                Entry::I64(v) => *v as f64,
                Entry::F64(v) => *v,
                _ => panic!("{}: {key} is not a scalar", self.name),
            };
            if field != "kind" {
                policy = policy.set_field(field, value).unwrap();
            }
        }
        if let Some(t) = self.inputs.get("block_mask") {
            policy = policy.block_mask(t.view());
        }
        if let Some(t) = self.inputs.get("sparge_head_params") {
            policy = policy.sparge_head_params(t.view());
        }
        if let Some(t) = self.inputs.get("indices") {
            policy = policy.indices(t.view());
        }
        if let Some(t) = self.inputs.get("head_map") {
            policy = policy.head_map(t.view());
        }
        policy
    }
}

/// Runs the case's call; Ok(Some((hits, misses))) for selection-cache cases.
fn run(ctx: &Context, case: &mut Case) -> sparsa::Result<Option<(i64, i64)>> {
    let i = &case.inputs;
    let mut o = std::mem::take(&mut case.outputs);
    let result = match case.call() {
        "attention" => run_attention(ctx, case, &mut o),
        "merge_states" => {
            let (mut out, mut out_lse) = (o.remove("out").unwrap(), o.remove("out_lse").unwrap());
            let r = sparsa::merge_states(
                ctx,
                &i["o_a"].view(),
                &i["lse_a"].view(),
                &i["o_b"].view(),
                &i["lse_b"].view(),
                &mut out.view_mut(),
                Some(&mut out_lse.view_mut()),
            );
            o.insert("out".into(), out);
            o.insert("out_lse".into(), out_lse);
            r.map(|_| None)
        }
        "topk_from_scores" => {
            let out = o.get_mut("indices").unwrap();
            sparsa::topk_from_scores(
                ctx,
                &i["scores"].view(),
                case.int("arg.k").unwrap() as i32,
                case.int("arg.block_size").unwrap() as i32,
                &mut out.view_mut(),
            )
            .map(|_| None)
        }
        "head_mapping" => sparsa::head_mapping(
            &i["draft"].view(),
            &i["target"].view(),
            case.int("arg.k").unwrap() as i32,
            &mut o.get_mut("map").unwrap().view_mut(),
        )
        .map(|_| None),
        "hilbert_permutation" => {
            let (t, h, w) = (case.int("arg.t").unwrap(), case.int("arg.h").unwrap(), case.int("arg.w").unwrap());
            sparsa::hilbert_permutation(t as i32, h as i32, w as i32).map(|(perm, inverse)| {
                o.get_mut("perm").unwrap().data = Data::I32(perm);
                o.get_mut("inverse").unwrap().data = Data::I32(inverse);
                None
            })
        }
        "drift_select_layers" => {
            let (mut ratio, mut sparse) = (o.remove("ratio").unwrap(), o.remove("sparse").unwrap());
            let r = sparsa::drift_select_layers(
                &i["h_in"].view(),
                &i["h_out"].view(),
                case.float("arg.delta").unwrap() as f32,
                Some(&mut ratio.view_mut()),
                Some(&mut sparse.view_mut()),
            );
            o.insert("ratio".into(), ratio);
            o.insert("sparse".into(), sparse);
            r.map(|_| None)
        }
        "kv_prefetch" => {
            let mut taken: Vec<Tensor> =
                ["k_dst", "v_dst", "positions", "remapped", "counts"].iter().map(|n| o.remove(*n).unwrap()).collect();
            let (k_dst, v_dst, positions, remapped, counts) = match &mut taken[..] {
                [k_dst, v_dst, positions, remapped, counts] => (k_dst, v_dst, positions, remapped, counts),
                _ => unreachable!(),
            };
            let r = sparsa::kv_prefetch(
                ctx,
                &i["k_src"].view(),
                &i["v_src"].view(),
                &i["indices"].view(),
                PrefetchOutputs {
                    k_dst: &mut k_dst.view_mut(),
                    v_dst: &mut v_dst.view_mut(),
                    positions: &mut positions.view_mut(),
                    remapped: &mut remapped.view_mut(),
                    counts: Some(&mut counts.view_mut()),
                },
            );
            for (name, t) in ["k_dst", "v_dst", "positions", "remapped", "counts"].iter().zip(taken) {
                o.insert(name.to_string(), t);
            }
            r.map(|_| None)
        }
        other => panic!("{}: unknown op {other}", case.name),
    };
    case.outputs = o;
    result
}

fn run_attention(ctx: &Context, case: &Case, o: &mut BTreeMap<String, Tensor>) -> sparsa::Result<Option<(i64, i64)>> {
    let i = &case.inputs;
    let policy = case.policy();
    let runs = case.int("arg.cache_runs").unwrap_or(0);
    let mut cache = if runs > 0 {
        let d = i["cache_dims"].i32s();
        Some(SelectionCache::new(ctx, d[0], d[1], d[2], d[3], d[4])?)
    } else {
        None
    };
    let (q, k, v) = (i["q"].view(), i["k"].view(), i["v"].view());
    let optional_in: BTreeMap<&str, TensorRef<'_>> = ["cu_seqlens_q", "cu_seqlens_k", "page_table", "seq_lens_k"]
        .iter()
        .filter_map(|n| i.get(*n).map(|t| (*n, t.view())))
        .collect();
    let mut out_tensor = o.remove("out").unwrap();
    let mut extras: BTreeMap<String, Tensor> = ["lse", "selected_indices", "block_mask_out", "stats"]
        .iter()
        .filter_map(|n| o.remove(*n).map(|t| (n.to_string(), t)))
        .collect();
    let mut result = Ok(());
    for _ in 0..runs.max(1) {
        let mut out = out_tensor.view_mut();
        let mut extra_views: BTreeMap<String, TensorMut<'_>> =
            extras.iter_mut().map(|(n, t)| (n.clone(), t.view_mut())).collect();
        let mut call = Attention::new(&q, &k, &v, &mut out)
            .causal(case.int("arg.causal").unwrap_or(0) != 0)
            .softmax_scale(case.float("arg.softmax_scale").unwrap_or(0.0) as f32);
        for (name, t) in &optional_in {
            call = match *name {
                "cu_seqlens_q" => call.cu_seqlens_q(t),
                "cu_seqlens_k" => call.cu_seqlens_k(t),
                "page_table" => call.page_table(t),
                _ => call.seq_lens_k(t),
            };
        }
        for (name, t) in extra_views.iter_mut() {
            call = match name.as_str() {
                "lse" => call.lse(t),
                "selected_indices" => call.selected_indices(t),
                "block_mask_out" => call.block_mask_out(t),
                _ => call.stats(t),
            };
        }
        if let Some(cache) = cache.as_mut() {
            call = call.selection_cache(cache);
        }
        result = call.run(ctx, &policy);
        if result.is_err() {
            break;
        }
    }
    o.insert("out".into(), out_tensor);
    o.append(&mut extras);
    result?;
    Ok(match cache {
        Some(c) => Some(c.counts()?),
        None => None,
    })
}

fn compare(case: &Case) {
    for (key, entry) in &case.entries {
        let (name, expected) = match (key.strip_prefix("out."), entry) {
            (Some(name), Entry::Tensor(expected)) => (name, expected),
            _ => continue,
        };
        let (got, want) = (case.outputs[name].bytes(), expected.bytes());
        if got != want {
            let size = expected.dtype.size();
            let first =
                (0..want.len() / size).find(|j| got[j * size..(j + 1) * size] != want[j * size..(j + 1) * size]);
            panic!("{}: out.{name} differs; first differing element {first:?}", case.name);
        }
    }
}

fn check_case(ctx: &Context, path: &Path) {
    let mut case = Case::load(path);
    let outcome = run(ctx, &mut case);
    if let Some(status) = case.int("expect.status") {
        let err = outcome.expect_err(&format!("{}: expected status {status}", case.name));
        assert_eq!(err.status, Status::from_code(status as i32), "{}: {err}", case.name);
        let message = case.string("expect.message").unwrap();
        assert!(err.message.contains(message), "{}: message {:?} lacks {:?}", case.name, err.message, message);
    } else {
        let counts = outcome.unwrap_or_else(|e| panic!("{}: {e}", case.name));
        if let Some((hits, misses)) = counts {
            assert_eq!(Some(hits), case.int("out.cache_hits"), "{}", case.name);
            assert_eq!(Some(misses), case.int("out.cache_misses"), "{}", case.name);
        }
    }
    compare(&case); // error cases: outputs must still hold their fill
}

#[test]
fn every_vector_matches_exactly() {
    let ctx = Context::cpu().unwrap();
    let paths = vector_paths();
    assert!(paths.len() >= 20, "expected the committed vectors in {}", vectors_dir().display());
    let failed: Vec<String> = paths
        .iter()
        .filter(|path| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_case(&ctx, path))).is_err())
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(failed.is_empty(), "{} of {} vectors failed: {failed:?}", failed.len(), paths.len());
}

#[test]
fn vectors_cover_every_op_and_policy() {
    let (mut ops, mut kinds) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    for path in vector_paths() {
        let case = Case::load(&path);
        ops.insert(case.call().to_string());
        if let Some(kind) = case.int("policy.kind") {
            kinds.insert(kind);
        }
    }
    for op in [
        "attention",
        "merge_states",
        "topk_from_scores",
        "head_mapping",
        "hilbert_permutation",
        "drift_select_layers",
        "kv_prefetch",
    ] {
        assert!(ops.contains(op), "no vector for {op}");
    }
    assert_eq!(kinds.len(), 7, "policy kinds covered: {kinds:?}");
}
