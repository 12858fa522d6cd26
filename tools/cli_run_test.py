"""`sparsa run` round trip: numpy writes q/k/v .npy files, the CLI runs a policy and writes o.npy, numpy reads it and
checks it against its own attention. Covers the CLI's .npy reader (v1 and v2 headers, rank 3 and 4, f4/f2/bf16)
and writer, and the mapping of policy options. Exit 77 (ctest: skipped) when numpy is missing.

Usage: cli_run_test.py <path to sparsa> <scratch dir>
"""
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not importable from", sys.executable, "- skipping")
    sys.exit(77)

from cli_reference import attention, visible_mask  # noqa: E402 (after the numpy check)

SPARSA, WORK = sys.argv[1], sys.argv[2]
shutil.rmtree(WORK, ignore_errors=True)  # demo --save must create its folder itself
os.makedirs(WORK, exist_ok=True)
rng = np.random.default_rng(20261121)


def path(name):
    return os.path.join(WORK, name)


def save(name, array, version=None):
    with open(path(name), "wb") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), version=version)
    return path(name)


def to_bf16_bits(x):
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def run(*args):
    cmd = [SPARSA, "run", "--quiet", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\nexit {done.returncode}\n{done.stdout}{done.stderr}")
    return done.stdout


failures = []


def check(name, got, want, tol):
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    status = "ok" if err <= tol else "FAILED"
    print(f"{status:6} {name}: relative error {err:.2e} (tolerance {tol:.0e})")
    if err > tol:
        failures.append(name)


B, S, HQ, HKV, D = 2, 96, 4, 2, 32
q = rng.standard_normal((B, S, HQ, D)).astype(np.float32)
k = rng.standard_normal((B, S, HKV, D)).astype(np.float32)
v = rng.standard_normal((B, S, HKV, D)).astype(np.float32)
causal = visible_mask(S, S, True)

# f32, rank 4, causal dense; the table is printed.
out = run("--policy", "dense", "--causal", "--q", save("q.npy", q), "--k", save("k.npy", k),
          "--v", save("v.npy", v), "--out", path("o.npy"))
if "DENSE" not in out:
    failures.append("table")
o = np.load(path("o.npy"))
assert o.dtype == np.float32 and o.shape == q.shape, (o.dtype, o.shape)
check("dense f32 [B,S,H,D] causal", o, attention(q, k, v, causal), 1e-5)

# Rank 3 inputs written with a version 2.0 header; non-causal; output keeps rank 3.
run("--policy", "DENSE", "--q", save("q3.npy", q[0], (2, 0)), "--k", save("k3.npy", k[0], (2, 0)),
    "--v", save("v3.npy", v[0], (2, 0)), "--out", path("o3.npy"))
o3 = np.load(path("o3.npy"))
assert o3.shape == q[0].shape, o3.shape
check("dense f32 [S,H,D] non-causal, v2 header", o3[None], attention(q[:1], k[:1], v[:1], np.ones((S, S), bool)), 1e-5)

# float16 in, float16 out.
run("--policy", "dense", "--causal", "--q", save("q16.npy", q.astype(np.float16)),
    "--k", save("k16.npy", k.astype(np.float16)), "--v", save("v16.npy", v.astype(np.float16)),
    "--out", path("o16.npy"))
o16 = np.load(path("o16.npy"))
assert o16.dtype == np.float16, o16.dtype
check("dense f16", o16, attention(q, k, v, causal), 3e-3)

# bfloat16 as uint16 bits with --bf16.
run("--policy", "dense", "--causal", "--bf16", "--q", save("qb.npy", to_bf16_bits(q)),
    "--k", save("kb.npy", to_bf16_bits(k)), "--v", save("vb.npy", to_bf16_bits(v)), "--out", path("ob.npy"))
ob = np.load(path("ob.npy"))
assert ob.dtype == np.uint16, ob.dtype
check("dense bf16 (--bf16)", from_bf16_bits(ob), attention(q, k, v, causal), 2e-2)

# A policy with options: SINK_WINDOW with 4 sinks and a 16-key window (§2).
out = run("--policy", "sink-window", "--causal", "--sink-tokens", "4", "--sink-window=16", "--q", path("q.npy"),
          "--k", path("k.npy"), "--v", path("v.npy"), "--out", path("osw.npy"))
if "SINK_WINDOW" not in out:
    failures.append("sink_window table")
check("SINK_WINDOW sinks 4 window 16", np.load(path("osw.npy")),
      attention(q, k, v, visible_mask(S, S, True, sink_tokens=4, window=16)), 1e-5)

# Refused before any compute: no progress line ("running ...") may appear before the one-line error.
for policy, missing in (("block_sparse", "--block-mask"), ("token_indices", "--indices")):
    done = subprocess.run([SPARSA, "run", "--policy", policy, "--causal", "--q", path("q.npy"), "--k", path("k.npy"),
                           "--v", path("v.npy")], capture_output=True, text=True)
    if done.returncode != 2 or "running" in done.stderr or missing not in done.stderr:
        failures.append(f"{policy} without {missing}: exit {done.returncode}, stderr {done.stderr!r}")
done = subprocess.run([SPARSA, "run", "--policy", "dense", "--delta", "--q", path("q.npy"), "--k", path("k.npy"),
                       "--v", path("v.npy")], capture_output=True, text=True)
if done.returncode != 2 or "running" in done.stderr or "--causal" not in done.stderr:
    failures.append(f"--delta without --causal: exit {done.returncode}, stderr {done.stderr!r}")

# The footer: the unit of "zero rows", negative sparsity under DELTA (dense + anchors computes more than dense), and
# the timing-noise mark when fewer than 3 runs are timed.
out = run("--policy", "dense", "--delta", "--causal", "--delta-gamma", "8", "--delta-tail-min", "8", "--repeat", "1",
          "--q", path("q.npy"), "--k", path("k.npy"), "--v", path("v.npy"))
for needle in ("zero rows = output rows", "sparsity < 0: +DELTA", "~ speedup within timing noise"):
    if needle not in out:
        failures.append(f"footer lacks {needle!r}:\n{out}")
if not any(line.startswith("DENSE+DELTA") and line.rstrip().endswith("~") for line in out.splitlines()):
    failures.append(f"DENSE+DELTA speedup not marked as noise with --repeat 1:\n{out}")

# demo --save creates the folder (and its parents), and what it writes replays with `sparsa run`.
saved = path(os.path.join("saved", "nested"))
done = subprocess.run([SPARSA, "demo", "--n", "512", "--quiet", "--repeat", "1", "--save", saved],
                      capture_output=True, text=True)
if done.returncode != 0 or not all(os.path.isfile(os.path.join(saved, f)) for f in ("q.npy", "k.npy", "v.npy")):
    failures.append(f"demo --save {saved}: exit {done.returncode}, {done.stderr}")
else:
    run("--policy", "dense", "--causal", "--q", os.path.join(saved, "q.npy"), "--k", os.path.join(saved, "k.npy"),
        "--v", os.path.join(saved, "v.npy"))

if failures:
    sys.exit("FAILED: " + ", ".join(failures))
print("cli_run_test: all round trips passed")
