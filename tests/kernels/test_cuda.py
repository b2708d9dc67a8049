"""The CUDA route: the same kernel bodies through mx.fast.cuda_kernel on an NVIDIA GPU (skipped without one).

Only the kernel runs on the GPU: inputs, float32 twins and MLX's built-ins are computed on the CPU stream (MLX's
CUDA arrays live in managed memory). On the GPU, MLX's float32 matmuls may use TF32 (the twin's error, ~1e-4,
was larger than the kernel's on an H200), and MLX 0.32's CUDA quantized_matmul has no implementation for the
small shapes of quantized-KV attention, so the built-in side would fail rather than the kernel."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

import kernel_cases as kc
from mlxinfer.kernels import patch
from mlxinfer.kernels.build import gpu_runner

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend and an NVIDIA GPU")


@pytest.mark.parametrize("run_case, case, dtype", kc.ALL)
def test_kernel_on_cuda(run_case, case, dtype):
    with mx.stream(mx.cpu):
        kc.check(run_case(case, gpu_runner("cuda", stream=mx.gpu)), dtype)


def _decode(model, kv_bits, n=10):
    """Greedy tokens and log-probabilities on the current default stream (mlx-lm's generate_step runs on a stream
    of its own, created on the GPU at import, so it cannot give the CPU reference)."""
    if kv_bits is None:
        caches = make_prompt_cache(model)
    else:
        caches = [QuantizedKVCache(group_size=32, bits=kv_bits) for _ in model.layers]
    x, tokens, logprobs = mx.array([[5, 17, 42, 99, 7, 3]]), [], []
    for _ in range(n):
        logits = model(x, cache=caches)[0, -1].astype(mx.float32)  # (vocab,)
        lp = logits - mx.logsumexp(logits)
        tokens.append(int(mx.argmax(lp).item()))
        logprobs.append(lp)
        x = mx.array([[tokens[-1]]])
    return tokens, logprobs


@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float-cache", "quantized-cache"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
def test_cuda_provider_decodes_like_builtin(kv_bits, dtype):
    model = kc.tiny_llama(3, hidden=256, intermediate=320, group_size=64)
    model.set_dtype(dtype)
    with mx.stream(mx.cpu):  # the reference: MLX's CUDA built-ins lack the quantized cache's attention shapes
        want, want_lp = _decode(model, kv_bits)
    try:
        report = patch.apply_kernels(model, "custom")
        assert report.name == "cuda-custom", report.detail
        got, got_lp = _decode(model, kv_bits)
    finally:
        patch.apply_kernels(model, "builtin")
    if dtype == mx.float32:
        assert got == want  # greedy-token parity
    else:  # half precision: near-ties may flip a token, so compare the first step's log-probabilities
        assert mx.allclose(got_lp[0], want_lp[0], atol=5e-2).item()
