"""Fixtures for the bench tests: synthetic records (see bench_fakes)."""

from __future__ import annotations

import pytest
from bench_fakes import make_record, stream_sample

from mlxinfer.bench.workload import Case


@pytest.fixture
def records() -> list[dict]:
    """mlxinfer and mlx-lm records for two depths and a prefix-cache case (mlx-lm made 2x slower)."""
    out = []
    for name, speed in (("mlxinfer", 1.0), ("mlx-lm", 2.0)):
        for depth in (0, 64):
            s = [stream_sample(0.5 * speed, [0.1 * speed] * 4, 16), stream_sample(0.6 * speed, [0.12 * speed] * 4, 16)]
            out.append(make_record(Case("generate", 16, 5, depth), s, name))
        out.append(make_record(Case("prefix", 16, 1, 32), [(1.0 * speed, 0.25 * speed, 1 << 20)] * 2, name))
    return out
