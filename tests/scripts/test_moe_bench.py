"""scripts/moe_bench.py at test size: both engines run and the line per token count is printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxinfer import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
def test_moe_bench_runs_at_test_size():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "moe_bench.py"), "--hidden", "64", "--inter", "64",
                           "--experts", "4", "--top", "2", "--layers", "1", "--tokens", "1,40", "--repeat", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "token(s)" in line]
    assert len(lines) == 2 and all("builtin" in line and "cpu-native" in line for line in lines), proc.stdout
