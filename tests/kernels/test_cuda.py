"""The CUDA route: the same kernel bodies through mx.fast.cuda_kernel on an NVIDIA GPU (skipped without one)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import kernel_cases as kc
from mlxinfer.kernels import patch
from mlxinfer.kernels.build import gpu_runner

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend and an NVIDIA GPU")


@pytest.mark.parametrize("run_case, case, dtype", kc.ALL)
def test_kernel_on_cuda(run_case, case, dtype):
    with mx.stream(mx.gpu):
        kc.check(run_case(case, gpu_runner("cuda")), dtype)


def _decode(model, kv_bits, n=10):
    prompt = mx.array([5, 17, 42, 99, 7, 3])
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32, "quantized_kv_start": 0}
    steps = list(generate_step(prompt, model, max_tokens=n, **kw))
    return [int(t) for t, _ in steps], [lp.astype(mx.float32) for _, lp in steps]


@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float-cache", "quantized-cache"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
def test_cuda_provider_decodes_like_builtin(kv_bits, dtype):
    model = kc.tiny_llama(3, hidden=256, intermediate=320, group_size=64)
    model.set_dtype(dtype)
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
