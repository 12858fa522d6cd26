"""The GPU benchmark scripts (bench/gpu) build their structs through this binding: their CPU check must pass.

It runs in its own interpreter because it replaces torch and triton with stubs."""
import os
import subprocess
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "gpu")


def test_bench_scripts_build_their_structs_through_the_binding():
    library = os.environ.get("SPARSA_LIBRARY")
    if not library:
        pytest.fail("SPARSA_LIBRARY is not set (ctest sets it to the freshly built library)")
    result = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "check_on_cpu.py"), library, BENCH_DIR],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bench/gpu CPU check: OK" in result.stdout
