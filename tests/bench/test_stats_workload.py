"""Statistics and workload parsing: pure functions, no model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mlxinfer.bench.stats import format_mean_std, percentile, summarize
from mlxinfer.bench.workload import Case, PromptSource, expand_cases, parse_int_list
from mlxinfer.errors import InvalidParameter


@pytest.mark.parametrize("seed", range(5))
def test_summary_is_consistent_and_matches_numpy(seed):
    rng = random.Random(seed)
    xs = [rng.lognormvariate(0, 1) for _ in range(rng.randint(1, 200))]
    s = summarize(xs, percentiles=True)
    assert s["n"] == len(xs)
    assert s["min"] <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"]
    assert s["min"] <= s["mean"] <= s["max"]
    for q in (50, 95, 99):
        assert s[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)))
    assert s["mean"] == pytest.approx(float(np.mean(xs)))
    assert s["std"] == pytest.approx(float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0)


def test_summary_edge_cases():
    assert summarize([])["n"] == 0 and summarize([], percentiles=True)["p99"] == 0.0
    one = summarize([3.0], percentiles=True)
    assert one["std"] == 0 and one["p50"] == one["p99"] == 3.0
    assert format_mean_std(one) == "3.00" and format_mean_std(summarize([1.0, 3.0]), 1) == "2.0 ± 1.4"
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@pytest.mark.parametrize("text,expected", [
    ("512", [512]), ("128,256", [128, 256]), ("1-4", [1, 2, 3, 4]), ("128-512+128", [128, 256, 384, 512]),
    ("64-1024*2", [64, 128, 256, 512, 1024]), ("16,64-256*2,16", [16, 64, 128, 256]), (" 8 , 9 ", [8, 9]),
])
def test_llama_bench_list_syntax(text, expected):
    assert parse_int_list(text, "prompt length") == expected


@pytest.mark.parametrize("text,needle", [
    ("0", "must be a positive integer"), ("-5", "must be a positive integer"), ("abc", "cannot read"),
    ("8,,9", "empty value"), ("512-128", "empty"), ("1-8*1", "never advances"), ("1-8+0", "never advances"),
    ("1-100000", "more than"),
])
def test_bad_lists_are_rejected(text, needle):
    with pytest.raises(InvalidParameter, match=needle):
        parse_int_list(text, "prompt length")


def test_depth_allows_zero_but_not_negative():
    assert parse_int_list("0,512", "depth", minimum=0) == [0, 512]
    with pytest.raises(InvalidParameter, match=">= 0"):
        parse_int_list("-1", "depth", minimum=0)


def test_cases_cover_every_combination_and_label_them():
    cases = expand_cases([16, 32], [8], [0, 64], None, [128])
    assert [c.label for c in cases] == ["pp16+tg8", "pp32+tg8", "pp16+tg8 @ d64", "pp32+tg8 @ d64",
                                        "prefix128+pp16", "prefix128+pp32"]
    batch = expand_cases([16], [8], [0], [1, 4])
    assert [(c.kind, c.batch, c.label) for c in batch] == [("batch", 1, "pp16+tg8 x b1"), ("batch", 4, "pp16+tg8 x b4")]
    assert Case("generate", 16, 8, 100).context_needed() == 124


def test_prompt_tokens_are_seeded_and_in_range():
    a, b = PromptSource(1000, seed=1), PromptSource(1000, seed=2)
    assert a.take(64) == PromptSource(1000, seed=1).take(64) != b.take(64)
    assert a.take(64, stream=1) != a.take(64, stream=0)
    assert all(0 <= t < 1000 for t in a.take(500))
    f = PromptSource(1000, file_tokens=[5, 6, 7])
    assert f.take(7) == [5, 6, 7, 5, 6, 7, 5] and "file" in f.label
    with pytest.raises(InvalidParameter):
        PromptSource(1000, file_tokens=[])
