"""Fused layers at real shapes: random Q4_0 weights with the real hidden size, heads, KV heads, head size,
intermediate size and RoPE settings of Llama-3.2-1B, Gemma-3-270M, OLMo-2-1B and Ministral-3-3B
(scripts/bench_arch.py's table; fewer layers and a small vocabulary for time), through the GGUF import, native
kernels against MLX's built-ins over a 24-token prefill and 8 decode steps.

The tiny models of test_spec_layers.py cover every family's layer variants; these cover what only real sizes
reach: K = 8192 in down_proj (16 blocks of the prefill GEMM's 512-k tiles), Gemma's 256-wide heads with one KV
head for four query heads (both its sliding layers, window 16 here so that the prompt runs past it, and its
global one), Llama 3's RoPE scaling, 32 query heads on 8 KV heads, OLMo 2's q/k norms over 2048-wide rows,
Ministral 3's YaRN periods on 128-wide heads (its llama-4 query scale is 1 below 16384 positions: the tiny models
and test_decoder_layer.py cover it).

Tolerances, as max |logit difference| / logit standard deviation (measured on this AVX2 CPU): float32 prefill
activations 4.8e-5 to 5.7e-5 (rounding of the float16 KV cache and the int16 decode activations) -> ``FLOAT_TOL``;
the opt-in int8 prefill activations (MLXINFER_PREFILL=int8, llama.cpp's Q8_0 grade) 1.1e-2 to 1.2e-2, top-1 all
equal -> ``INT8_TOL``. A changed formula moves logits by
a sizeable share of their spread and flips the top-1 token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlxinfer
from mlxinfer import native
from mlxinfer.native import int8_activations
from mlxinfer.kernels.patch import apply_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_arch  # noqa: E402

FLOAT_TOL = 1e-3
INT8_TOL = 3e-2
CASES = {
    "llama-3.2-1b": "layers=1,vocab=1024",
    "gemma3-270m": "layers=6,vocab=1024,sliding_window=16",  # mlx-lm's gemma3 needs its 6-layer pattern
    "olmo2-1b": "layers=1,vocab=1024",
    "ministral3-3b": "layers=1,vocab=1024",
}

pytestmark = pytest.mark.skipif(native.problem() is not None, reason=f"native kernels: {native.problem()}")


def _logits(model, prompt: list[int], follow: list[int]) -> np.ndarray:
    cache = make_prompt_cache(model)
    pre = model(mx.array(prompt)[None], cache=cache)[0]  # (L, vocab)
    dec = [model(mx.array([[t]]), cache=cache)[0, -1] for t in follow]
    return np.array(mx.concatenate([pre, mx.stack(dec)]).astype(mx.float32))


@pytest.fixture(scope="module", params=list(CASES))
def real_model(request, tmp_path_factory, monkeypatch_module):
    key = request.param
    arch = bench_arch.with_shape(bench_arch.ARCHS[key], CASES[key])
    tmp = tmp_path_factory.mktemp(key)
    monkeypatch_module.setenv("MLXINFER_CACHE", str(tmp / "cache"))  # the GGUF import's MLX copy goes here
    path = bench_arch.write_gguf(tmp / f"{key}.gguf", arch, "Q4_0")
    model = mlxinfer.load(str(path), kernels="builtin").model
    prompt, follow = bench_arch.prompt_ids(arch, 24), bench_arch.prompt_ids(arch, 8, seed=2)
    want = _logits(model, prompt, follow)
    report = apply_kernels(model, "custom")
    assert report.name == "cpu-native", report.detail
    yield key, model, prompt, follow, want
    apply_kernels(model, "builtin")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / want.std())


def test_native_layers_match_builtins_at_real_shapes(real_model):
    key, model, prompt, follow, want = real_model
    with int8_activations(prefill=False):
        got = _logits(model, prompt, follow)
    assert _relative(got, want) < FLOAT_TOL, key
    assert (got.argmax(-1) == want.argmax(-1)).all(), key


def test_int8_prefill_stays_within_its_stated_error_at_real_shapes(real_model):
    key, model, prompt, follow, want = real_model
    with int8_activations(prefill=True):
        got = _logits(model, prompt, follow)
    assert _relative(got, want) < INT8_TOL, key
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9, key
