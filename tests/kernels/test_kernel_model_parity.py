"""A whole mlx-lm model decoding through the custom kernels (run on the CPU emulator) gives the built-in's tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, llama

from kernel_cases import tiny_llama
from mlxinfer.kernels import patch, selfcheck
from mlxinfer.kernels.build import Recorder
from mlxinfer.kernels.emulator import Emulator
from mlxinfer.kernels.gpu import GpuKernels

pytestmark = pytest.mark.slow  # compiles the generated kernels with g++


class SwitchableRunner:
    """Counts kernels and forwards to ``target``: a Recorder for a dry run, then the emulator."""

    def __init__(self):
        self.target, self.kernels = Recorder(), []

    def __call__(self, launch):
        self.kernels.append(launch.kernel)
        return self.target(launch)


@pytest.fixture(scope="module")
def emulator():
    return Emulator()


@pytest.fixture
def emulated_metal(monkeypatch):
    runner = SwitchableRunner()
    provider = GpuKernels("metal", run=runner, name="metal-emulated")
    monkeypatch.setattr(patch, "select_provider", lambda name=None: (provider, "emulated on the CPU"))
    # The load-time self-check would run the kernels while the runner only records (zeros); this test holds the
    # emulated kernels to the built-ins itself, token by token.
    monkeypatch.setattr(selfcheck, "check_model", lambda model: [])
    yield runner
    llama.scaled_dot_product_attention = base.scaled_dot_product_attention  # even if the test failed midway


def greedy(model, prompt, n, **kw):
    tokens, logits = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n, **kw):
        tokens.append(int(tok))
        logits.append(logprobs)
    return tokens, logits


@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float-cache", "quantized-cache"])
def test_greedy_tokens_match_builtin(emulator, emulated_metal, kv_bits):
    model = tiny_llama(3, hidden=256, intermediate=320, group_size=64)  # head dim 64
    prompt = [5, 17, 42, 99, 7, 3]
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32, "quantized_kv_start": 0}
    want, want_logits = greedy(model, prompt, 6, **kw)
    report = patch.apply_kernels(model, "custom")
    assert report.name == "metal-emulated"
    greedy(model, prompt, 6, **kw)  # dry run (zeros): the kernel instances this decode needs, compiled at once
    emulator.prepare(emulated_metal.target.launches)
    emulated_metal.target = emulator
    got, got_logits = greedy(model, prompt, 6, **kw)
    patch.apply_kernels(model, "builtin")
    assert got == want
    assert max(mx.abs(a - b).max().item() for a, b in zip(got_logits, want_logits)) < 1e-3
    used = set(emulated_metal.kernels)
    assert {"qmv", "swiglu"} <= used
    assert ("sdpa_quant" if kv_bits else "sdpa_decode") in used
