"""`sparsa run --policies LIST --qkv-dir DIR`: numpy writes Q/K/V dumps of three "layers", the CLI evaluates several
policies on all of them; the reported errors are checked against numpy's own attention, and bad lists are refused
with exit status 2. Exit 77 (ctest: skipped) when numpy is missing.

Usage: cli_run_policies_test.py <path to sparsa> <scratch dir>
"""
import json
import os
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not importable from", sys.executable, "- skipping")
    sys.exit(77)



from cli_reference import attention, visible_mask  # noqa: E402 (after the numpy check)


SPARSA, WORK = sys.argv[1], sys.argv[2]
DUMPS = os.path.join(WORK, "dumps")
os.makedirs(DUMPS, exist_ok=True)
rng = np.random.default_rng(20261125)
B, S, HQ, HKV, D = 1, 320, 4, 1, 32
SINKS, WINDOW = 4, 48
failures = []

reference = {}
for layer in range(3):
    name = f"layer{layer:02d}"
    # queries near one direction per head, as in a trained layer: neighbouring rows' sparse errors agree, so Δ's
    # anchor-row correction helps (on i.i.d. random queries it need not)
    q = (2 * rng.standard_normal((B, 1, HQ, D)) + 0.3 * rng.standard_normal((B, S, HQ, D))).astype(np.float32)
    k = rng.standard_normal((B, S, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, S, HKV, D)).astype(np.float32)
    for suffix, array in (("q", q), ("k", k), ("v", v)):
        np.save(os.path.join(DUMPS, f"{name}.{suffix}.npy"), array[0] if layer == 2 else array)  # rank 3 too
    dense = attention(q, k, v, visible_mask(S, S, True))
    window = attention(q, k, v, visible_mask(S, S, True, sink_tokens=SINKS, window=WINDOW))
    reference[name] = np.linalg.norm(window - dense) / np.linalg.norm(dense)


def run(*args):
    return subprocess.run([SPARSA, "run", "--quiet", *args], capture_output=True, text=True)


json_path = os.path.join(WORK, "policies.json")
done = run("--policies", "dense,sink_window,sink_window+delta,sparge,token_sparse,token_select", "--qkv-dir", DUMPS,
           "--causal", "--sink-tokens", str(SINKS), "--sink-window", str(WINDOW), "--ts-min-tokens", "64",
           "--select-n-init", "16", "--select-n-local", "32", "--select-top-k", "64", "--delta-gamma", "32",
           "--delta-tail-min", "32", "--threads", "2", "--json", json_path)
print(done.stdout, done.stderr)
if done.returncode != 0:
    sys.exit(f"FAILED: exit {done.returncode}")
for label in ("DENSE", "SINK_WINDOW+DELTA", "TOKEN_SELECT", "layer02"):
    if label not in done.stdout:
        failures.append(f"{label} missing from the table")
results = {r["policy"]: r for r in json.load(open(json_path))["results"]}
if max(results["DENSE"]["rel_error"]) != 0.0 or results["DENSE"]["sparsity"] != 0.0:
    failures.append("DENSE is not exact against itself")
for i, name in enumerate(sorted(reference)):
    got = results["SINK_WINDOW"]["rel_error"][i]
    if abs(got - reference[name]) > 1e-4 * reference[name]:
        failures.append(f"SINK_WINDOW {name}: CLI error {got:.6f}, numpy {reference[name]:.6f}")
    if not results["SINK_WINDOW"]["sparsity_per_dump"][i] > 0.5:
        failures.append(f"SINK_WINDOW {name}: sparsity {results['SINK_WINDOW']['sparsity_per_dump'][i]}")
if not results["SINK_WINDOW+DELTA"]["rel_error_mean"] < results["SINK_WINDOW"]["rel_error_mean"]:
    failures.append("Δ did not lower SINK_WINDOW's error")

for bad in (["--policies", "dense,nonsense", "--qkv-dir", DUMPS], ["--policies", "block_sparse", "--qkv-dir", DUMPS],
            ["--policies", "dense", "--qkv-dir", os.path.join(WORK, "missing")], ["--policies", "dense"]):
    done = run(*bad)
    if done.returncode != 2 or len(done.stderr.strip().splitlines()) != 1:
        failures.append(f"{bad}: exit {done.returncode}, stderr {done.stderr!r} (expected one line, exit 2)")

if failures:
    sys.exit("FAILED: " + "; ".join(failures))
print("cli_run_policies_test: passed")
