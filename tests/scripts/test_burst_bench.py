"""scripts/burst_bench.py runs one round on the bundled model and prints one line per round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_burst_bench_runs_one_round(smollm2_dir):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "burst_bench.py"), "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shared start: 8 prompts of ~") and "first tokens p50" in lines[0]
