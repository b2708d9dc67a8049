"""scripts/tiles_ab.py on the bundled model: both layouts load in one process and the line names both timings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxinfer import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")
def test_tiles_ab_times_both_layouts():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiles_ab.py"), "--steps", "3", "--layers"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    tiled = int(re.search(r"\((\d+) layers tiled\)", line).group(1))
    assert ("ms with row tiles" in line and "ms with MLX's layout" in line
            and tiled == (30 if native.provider().tiled_weights() else 0)), line
    # --symmetric compares symmetric tiles with bias-reading ones: the bundled model's Q4_1 layers have none.
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiles_ab.py"), "--steps", "1", "--symmetric"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no symmetric tiled layer to compare" in proc.stderr, proc.stderr[-2000:]
