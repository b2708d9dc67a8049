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


@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float-cache", "quantized-cache"])
def test_cuda_provider_greedy_parity(kv_bits):
    model = kc.tiny_llama(3, hidden=256, intermediate=320, group_size=64)
    model.set_dtype(mx.float16)  # the GPU dtype policy: the model's own half precision
    prompt = mx.array([5, 17, 42, 99, 7, 3])
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32, "quantized_kv_start": 0}
    want = [int(t) for t, _ in generate_step(prompt, model, max_tokens=10, **kw)]
    try:
        report = patch.apply_kernels(model, "custom")
        assert report.name == "cuda-custom", report.detail
        got = [int(t) for t, _ in generate_step(prompt, model, max_tokens=10, **kw)]
    finally:
        patch.apply_kernels(model, "builtin")
    assert got == want
