"""Mixture-of-experts projections on the native CPU kernels (``layers.KernelQuantizedSwitchLinear`` ->
``gather_qmm``): a tiny Qwen3-MoE model's logits against MLX's built-ins over a prompt long enough for mlx-lm's
sorted-experts path (40 tokens x 2 experts >= 64 rows) and decode steps, the same greedy tokens, the report line,
and the experts' float16 scales kept as stored (the kernel reads them; MLX's own path gets float32).

Tolerance as tests/kernels/test_spec_layers.py's float32 cache: int16 decode activations, ~1e-4 of the largest
logit; a wrong expert moves logits by a large share of their spread."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxinfer.kernels import layers, patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402

PROMPT = [(17 * i + 5) % 40000 + 3 for i in range(40)]  # 40 tokens: 80 expert rows, mlx-lm sorts them


def _run(model, steps: int = 12):
    cache = cache_lib.make_prompt_cache(model)
    logits = [model(mx.array([PROMPT]), cache=cache)[0, -1]]
    tokens = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits[-1])))
        logits.append(model(mx.array([[tokens[-1]]]), cache=cache)[0, -1])
    return mx.stack(logits), tokens


def test_experts_match_builtin_and_report(native, float_prefill, monkeypatch):
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    model = tiny_arch.make_model("qwen3_moe")
    patch.apply_kernels(model, "builtin")
    want, tokens = _run(model)
    report = patch.apply_kernels(model, "auto")
    switch = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert switch and all(type(m) is layers.KernelQuantizedSwitchLinear for m in switch)
    assert f"{len(switch)} MoE expert projections" in report.detail, report.detail
    got, got_tokens = _run(model)
    err = float(mx.abs(got - want).max()) / float(mx.abs(want).max())
    assert err < 5e-4, err
    assert got_tokens == tokens
    patch.apply_kernels(model, "builtin")
    assert all(type(m) is QuantizedSwitchLinear for m in switch)


def test_experts_keep_half_scales(native):
    """A checkpoint's float16 expert scales stay float16 under the kernels (half the scale bytes a token reads)."""
    model = tiny_arch.make_model("qwen3_moe")
    switch = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    for m in switch:
        m.update({"scales": m["scales"].astype(mx.float16), "biases": m["biases"].astype(mx.float16)})
    patch.apply_kernels(model, "auto")
    assert all(m["scales"].dtype == mx.float16 for m in switch)
    patch.apply_kernels(model, "builtin")  # MLX's gather_qmm: widened to float32
    assert all(m["scales"].dtype == mx.float32 for m in switch)
