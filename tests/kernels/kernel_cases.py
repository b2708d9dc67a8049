"""Shapes the kernel tests run everywhere (CPU emulator, CUDA, Metal): edge cases first, few enough to stay fast.

Each ``*_inputs`` builds deterministic inputs; each ``run_*`` runs one case through a ``build.Runner`` and
returns (kernel output, float32 twin from ``kernels.reference``, MLX built-in output). The matmul built-ins
get float32 activations/scales (same quantized matrix): MLX's CPU kernels accumulate float16/bfloat16 in that
dtype, which would swamp the comparison.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from mlxinfer.kernels import ops, reference

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
NAMES = {F16: "f16", BF16: "bf16", F32: "f32"}

# (leading shape of x, N, K, group size, bits, dtype, negated scales)
QMV = [
    ((1,), 20, 96, 32, 4, F32, False),  # N not a multiple of 8, K not a multiple of 512
    ((3,), 33, 320, 64, 4, F16, False),
    ((1, 2), 13, 384, 128, 8, BF16, True),  # 3-D x, negative scales
    ((8,), 16, 256, 64, 8, F16, False),  # M = 8
    ((5,), 40, 640, 32, 4, BF16, True),
]
# (leading shape, N, K, group size, bits, dtype)
SWIGLU = [((1,), 24, 128, 64, 4, F16), ((4,), 17, 96, 32, 8, BF16), ((2,), 9, 256, 128, 4, F32)]
# (B, Hq, Hkv, L, D, S, dtype, mask, forced splits)
SDPA = [
    (1, 2, 2, 1, 64, 1, F32, None, None),  # one key, GQA 1
    (1, 4, 2, 1, 80, 31, F16, None, None),  # GQA 2, head dim 80
    (2, 4, 1, 3, 96, 33, BF16, "causal", None),  # GQA 4, batch 2, 3 queries
    (1, 8, 1, 1, 128, 1000, F16, None, 1),  # GQA 8, 1000 keys in a single pass
    (1, 2, 1, 8, 64, 40, BF16, "causal", None),  # 8 queries (16 rows: two threadgroups per kv head)
    (1, 2, 1, 1, 256, 4097, F32, None, None),  # long context: split-K two-pass path (64 splits)
    (1, 6, 2, 2, 64, 33, F32, "causal", 3),  # GQA 3, forced two-pass on a short cache
]
# (B, Hq, Hkv, L, D, S, dtype, mask, group size, bits, forced splits)
QSDPA = [
    (1, 4, 2, 1, 64, 33, F16, None, 64, 8, None),
    (1, 8, 2, 4, 128, 300, BF16, "causal", 32, 4, None),
    (1, 2, 1, 1, 64, 1500, F32, None, 64, 4, None),  # two-pass
]


def ids(cases):
    return ["-".join(NAMES.get(v, str(v)) for v in c).replace(" ", "") for c in cases]


def qmv_inputs(case, seed=0):
    lead, n, k, gs, bits, dtype, negate = case
    key = mx.random.key(seed)
    kx, kw = mx.random.split(key)
    x = mx.random.normal((*lead, k), key=kx).astype(dtype)
    w, s, b = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group_size=gs, bits=bits)
    if negate:  # the same codes with negated scales and biases: W -> -W
        s, b = -s, -b
    return x, (w, s, b)


def run_qmv(case, run):
    _, _, _, gs, bits, dtype, _ = case
    x, (w, s, b) = qmv_inputs(case)
    got = ops.quantized_matmul(x, w, s, b, group_size=gs, bits=bits, run=run)
    twin = reference.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    builtin = mx.quantized_matmul(x.astype(F32), w, s.astype(F32), b.astype(F32), transpose=True,
                                  group_size=gs, bits=bits).astype(dtype)
    return got, twin, builtin


def run_swiglu(case, run):
    lead, n, k, gs, bits, dtype = case
    keys = mx.random.split(mx.random.key(1), 3)
    x = mx.random.normal((*lead, k), key=keys[0]).astype(dtype)
    gate = mx.quantize(mx.random.normal((n, k), key=keys[1]).astype(dtype), group_size=gs, bits=bits)
    up = mx.quantize(mx.random.normal((n, k), key=keys[2]).astype(dtype), group_size=gs, bits=bits)
    got = ops.swiglu(x, gate, up, group_size=gs, bits=bits, run=run)
    twin = reference.swiglu(x, gate, up, group_size=gs, bits=bits)
    g, u = (mx.quantized_matmul(x.astype(F32), t[0], t[1].astype(F32), t[2].astype(F32), transpose=True,
                                group_size=gs, bits=bits) for t in (gate, up))
    builtin = (g * mx.sigmoid(g) * u).astype(dtype)
    return got, twin, builtin


def sdpa_inputs(case, seed=2):
    b, hq, hkv, l, d, s, dtype = case[:7]
    keys = mx.random.split(mx.random.key(seed), 3)
    cap = (s + 255) // 256 * 256  # mlx-lm's KVCache grows in steps of 256: the live part is a strided slice
    q = mx.random.normal((b, hq, l, d), key=keys[0]).astype(dtype)
    kc = mx.random.normal((b, hkv, cap, d), key=keys[1]).astype(dtype)
    vc = mx.random.normal((b, hkv, cap, d), key=keys[2]).astype(dtype)
    return q, kc[:, :, :s, :], vc[:, :, :s, :]


def run_sdpa(case, run):
    d, mask, nsplit = case[4], case[7], case[8]
    q, k, v = sdpa_inputs(case)
    scale = d ** -0.5
    got = ops.sdpa(q, k, v, scale=scale, mask=mask, run=run, nsplit=nsplit)
    twin = reference.sdpa(q, k, v, scale=scale, mask=mask)
    builtin = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return got, twin, builtin


def run_quantized_sdpa(case, run):
    b, hq, hkv, l, d, s, dtype, mask, gs, bits, nsplit = case
    q, k, v = sdpa_inputs(case)
    cache = QuantizedKVCache(group_size=gs, bits=bits)  # the real layout, including its strided slices
    kt, vt = cache.update_and_fetch(mx.contiguous(k), mx.contiguous(v))
    scale = d ** -0.5
    got = ops.quantized_sdpa(q, kt, vt, scale=scale, mask=mask, group_size=gs, bits=bits, run=run, nsplit=nsplit)
    twin = reference.quantized_sdpa(q, kt, vt, scale=scale, mask=mask, group_size=gs, bits=bits)
    builtin = quantized_scaled_dot_product_attention(q, kt, vt, scale=scale, mask=mask, group_size=gs, bits=bits)
    return got, twin, builtin


# Kernel vs float32 twin: only the final rounding to the output dtype (and summation order) differs.
TWIN_TOL = {F32: 1e-5, F16: 1e-3, BF16: 8e-3}
# Kernel vs MLX built-in: the attention built-ins also round intermediates (scores) to the dtype.
BUILTIN_TOL = {F32: 1e-4, F16: 5e-3, BF16: 3e-2}


def assert_close(got, want, tol, what):
    got, want = got.astype(F32), want.astype(F32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert not mx.isnan(got).any().item(), f"{what}: NaN in kernel output (unwritten element?)"
    # Error relative to the output's scale: long dot products in float16 have absolute, not relative, error.
    err = mx.abs(got - want).max().item() / max(1.0, mx.abs(want).max().item())
    assert err <= tol, f"{what}: max error {err:.3g} (relative to max |output|) > {tol:g}"


def check(result, dtype):
    got, twin, builtin = result
    assert got.dtype == dtype
    assert_close(got, twin, TWIN_TOL[dtype], "kernel vs float32 twin")
    assert_close(got, builtin, BUILTIN_TOL[dtype], "kernel vs MLX built-in")


ALL = [
    pytest.param(run_qmv, c, c[5], id="qmv-" + i) for c, i in zip(QMV, ids(QMV))
] + [
    pytest.param(run_swiglu, c, c[5], id="swiglu-" + i) for c, i in zip(SWIGLU, ids(SWIGLU))
] + [
    pytest.param(run_sdpa, c, c[6], id="sdpa-" + i) for c, i in zip(SDPA, ids(SDPA))
] + [
    pytest.param(run_quantized_sdpa, c, c[6], id="qsdpa-" + i) for c, i in zip(QSDPA, ids(QSDPA))
]


def tiny_llama(seed: int = 0, hidden: int = 128, intermediate: int = 256, group_size: int = 32) -> nn.Module:
    """A 2-layer random-weight 4-bit mlx-lm llama (GQA 2, vocab 300: N not a multiple of 8)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=2, intermediate_size=intermediate,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    model = llama.Model(args)
    nn.quantize(model, group_size=group_size, bits=4)
    mx.eval(model.parameters())
    return model
