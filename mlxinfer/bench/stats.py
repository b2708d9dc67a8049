"""Summary statistics for benchmark samples: mean ± sample std, min/max and linear-interpolated percentiles.

Pure Python (no NumPy) so the numbers in a report are reproducible from the raw samples stored with it.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (NumPy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1), as llama-bench reports it; 0 for fewer than two samples."""
    n = len(values)
    if n < 2:
        return 0.0
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))


def summarize(values: Iterable[float], *, percentiles: bool = False) -> dict:
    """{n, mean, std, min, max[, p50, p95, p99]} of the samples; all zeros for an empty list."""
    xs = [float(v) for v in values]
    if not xs:
        out = {"n": 0, "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
        return {**out, "p50": 0.0, "p95": 0.0, "p99": 0.0} if percentiles else out
    out = {"n": len(xs), "mean": mean(xs), "std": std(xs), "min": min(xs), "max": max(xs)}
    if percentiles:
        out.update(p50=percentile(xs, 50), p95=percentile(xs, 95), p99=percentile(xs, 99))
    return out


def format_mean_std(summary: dict, digits: int = 2, scale: float = 1.0) -> str:
    """'12.34 ± 0.56' (the ± part is left out for a single sample)."""
    if not summary or not summary.get("n"):
        return "-"
    m = summary["mean"] * scale
    if summary["n"] < 2:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {summary['std'] * scale:.{digits}f}"
