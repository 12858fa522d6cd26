"""Runs every shared test vector (tests/vectors/*.spv) through the Python API and compares outputs byte for byte."""
import os

import numpy
import pytest

import sparsa
from sparsa.errors import error_for_status
import spv

POISON = 0xA5
ZERO_FILLED_OUTPUTS = {"kv_prefetch": {"k_dst", "v_dst"}}  # rows past the union are never written


def _as_input(entry):
    array = entry.array()
    return sparsa.Reinterpret(array, sparsa.BF16) if entry.dtype == sparsa.BF16 else array


def _bare(obj):
    return obj.base if isinstance(obj, sparsa.Reinterpret) else obj


class Case:
    """One vector: its inputs as numpy arrays and its outputs as poisoned arrays to be written."""

    def __init__(self, path):
        self.name = os.path.basename(path)
        self.entries = spv.read(path)
        self.op = self.entries["op"]
        self.call = self.entries.get("call", self.op)
        self.inputs = {k[3:]: _as_input(v) for k, v in self.entries.items() if k.startswith("in.")}
        zero_filled = ZERO_FILLED_OUTPUTS.get(self.call, set())
        self.outputs, self.expected = {}, {}
        for key, value in self.entries.items():
            if key.startswith("out.") and isinstance(value, spv.TensorEntry):
                name = key[4:]
                array = value.array(fill=0 if name in zero_filled else POISON)
                self.outputs[name] = sparsa.Reinterpret(array, sparsa.BF16) if value.dtype == sparsa.BF16 else array
                self.expected[name] = value.data

    def arg(self, name, default=None):
        return self.entries.get("arg." + name, default)

    def policy(self):
        fields = {k[7:]: v for k, v in self.entries.items() if k.startswith("policy.")}
        tensors = {name: self.inputs[name] for name in ("block_mask", "sparge_head_params", "indices", "head_map")
                   if name in self.inputs}
        return sparsa.Policy.from_c_fields(fields, tensors)


def _run_attention(ctx, case):
    cache, runs = None, case.arg("cache_runs", 0)
    if runs:
        cache = sparsa.SelectionCache(ctx, *(int(x) for x in case.inputs["cache_dims"]))
    o, i = case.outputs, case.inputs
    try:
        for _ in range(max(runs, 1)):
            sparsa.attention(ctx, i["q"], i["k"], i["v"], o["out"], policy=case.policy(),
                             causal=bool(case.arg("causal")), softmax_scale=case.arg("softmax_scale", 0.0),
                             lse=o.get("lse"), cu_seqlens_q=i.get("cu_seqlens_q"),
                             cu_seqlens_k=i.get("cu_seqlens_k"), page_table=i.get("page_table"),
                             seq_lens_k=i.get("seq_lens_k"), selection_cache=cache,
                             selected_indices=o.get("selected_indices"), block_mask_out=o.get("block_mask_out"),
                             stats=o.get("stats"))
        return cache.counts() if cache else None
    finally:
        if cache:
            cache.close()


def _run(ctx, case):
    """Runs the case's call; returns the selection-cache counts for cache cases, else None."""
    i, o = case.inputs, case.outputs
    if case.call == "attention":
        return _run_attention(ctx, case)
    if case.call == "merge_states":
        sparsa.merge_states(ctx, i["o_a"], i["lse_a"], i["o_b"], i["lse_b"], o["out"], o["out_lse"])
    elif case.call == "topk_from_scores":
        sparsa.topk_from_scores(ctx, i["scores"], case.arg("k"), case.arg("block_size"), o["indices"])
    elif case.call == "head_mapping":
        sparsa.head_mapping(i["draft"], i["target"], case.arg("k"), o["map"])
    elif case.call == "hilbert_permutation":
        perm, inverse = sparsa.hilbert_permutation(case.arg("t"), case.arg("h"), case.arg("w"))
        o["perm"][...], o["inverse"][...] = perm, inverse
    elif case.call == "drift_select_layers":
        sparsa.drift_select_layers(i["h_in"], i["h_out"], case.arg("delta"), o["ratio"], o["sparse"])
    elif case.call == "kv_prefetch":
        sparsa.kv_prefetch(ctx, i["k_src"], i["v_src"], i["indices"], o["k_dst"], o["v_dst"], o["positions"],
                           o["remapped"], o["counts"])
    else:
        raise AssertionError(f"unknown op {case.call}")
    return None


def _compare(case):
    for name, expected in case.expected.items():
        got = _bare(case.outputs[name]).tobytes()
        if got != expected:
            got_array = _bare(case.outputs[name]).reshape(-1)
            want = numpy.frombuffer(expected, dtype=got_array.dtype)
            differing = [j for j in range(got_array.size) if got_array[j:j + 1].tobytes() != want[j:j + 1].tobytes()]
            first = differing[0]
            pytest.fail(f"{case.name}: out.{name}: {len(differing)} of {got_array.size} elements differ; first at "
                        f"flat index {first}: got {got_array[first]!r}, expected {want[first]!r}")


@pytest.fixture(scope="module")
def ctx():
    with sparsa.Context() as context:
        yield context


@pytest.mark.parametrize("path", spv.vector_paths(), ids=os.path.basename)
def test_vector(ctx, path):
    case = Case(path)
    if "expect.status" in case.entries:
        expected_class = type(error_for_status(case.entries["expect.status"], ""))
        with pytest.raises(sparsa.Error) as raised:
            _run(ctx, case)
        assert type(raised.value) is expected_class, f"{case.name}: got {raised.value!r}"
        assert raised.value.status == case.entries["expect.status"]
        assert case.entries["expect.message"] in raised.value.message
        _compare(case)  # a failed call writes nothing: outputs still hold their fill
        return
    counts = _run(ctx, case)
    _compare(case)
    if counts is not None:
        assert counts == (case.entries["out.cache_hits"], case.entries["out.cache_misses"])


def test_every_op_and_policy_is_covered():
    ops, kinds = set(), set()
    for path in spv.vector_paths():
        entries = spv.read(path)
        ops.add(entries.get("call", entries["op"]))
        if "policy.kind" in entries:
            kinds.add(entries["policy.kind"])
    assert ops >= {"attention", "merge_states", "topk_from_scores", "head_mapping", "hilbert_permutation",
                   "drift_select_layers", "kv_prefetch"}
    assert kinds == set(range(7))
