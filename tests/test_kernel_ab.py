"""benchmarks/kernel_ab.py end to end: this checkout against itself, verify blocks and batches of sequences.

The same kernel on both sides must give the same logits bit for bit (the script reports the largest difference), for
blocks of one sequence and for batches whose every row attends to a cache of its own; the timing table must hold
every k asked for. Tiny settings: a few seconds, the shipped target.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdec.runtime.native_kernel as nk

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


@pytest.mark.parametrize("batch", [False, True], ids=["blocks", "batches"])
def test_kernel_ab_against_itself(batch: bool) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), "--baseline", str(ROOT), "--ks", "1", "3"]
    cmd += ["--context", "20", "--rounds", "2", "--min-seconds", "0.001", "--threads", "1"]
    cmd += ["--batch"] if batch else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    what = "batch" if batch else "block"
    diff = re.search(rf"max relative logit difference A vs B at {what} k=3: (\S+)", out.stdout)
    assert diff is not None, out.stdout
    assert float(diff.group(1)) == 0.0
    # k, A ms, (A least), B ms, (B least), ...
    rows = [re.findall(r"\d+(?:\.\d+)?", line) for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)


def test_kernel_ab_names_an_unknown_shape() -> None:
    """A misspelt shape is a usage error that names it and the known ones, before any checkpoint is loaded."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), "--baseline", str(ROOT), "--shapes", "llama-1b"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "unknown shape 'llama-1b'" in out.stderr and "llama3.2-1b" in out.stderr
    assert "Traceback" not in out.stderr


def test_kernel_ab_times_products_alone() -> None:
    """--products: this checkout against itself on two matrices (an odd one among them), the same products bit for
    bit and a row of the table for every k."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), "--baseline", str(ROOT), "--ks", "1", "9"]
    cmd += ["--products", "300x72", "97x130", "--copies", "2", "--rounds", "2", "--threads", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    diffs = re.findall(r"products (\d+) x (\d+), 2 copies: max absolute difference A vs B at k=9: (\S+)", out.stdout)
    assert [(m, n) for m, n, _ in diffs] == [("300", "72"), ("97", "130")], out.stdout
    assert all(float(d) == 0.0 for _, _, d in diffs)
    rows = [re.findall(r"\d+(?:\.\d+)?", line) for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [int(r[0]) for r in rows] == [1, 9, 1, 9]


def test_kernel_ab_names_a_malformed_product() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "kernel_ab.py"),
        "--baseline",
        str(ROOT),
        "--products",
        "3456by640",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "a product is MxN (outputs x inputs), got '3456by640'" in out.stderr
    assert "Traceback" not in out.stderr
