"""Greedy decoding of the bundled SmolLM2 with the native CPU kernels gives the built-in kernels' tokens, in the
same loop (mlx-lm's ``generate_step``): the kernels are the only difference."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow  # loads the real model and needs the compiled extension

# The golden parity test's prompts: the built-in reference (tests/conftest.py: mlx_lm_greedy) is computed once.
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]


def _greedy(model, prompt_tokens, n=32):
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n, sampler=lambda lg: mx.argmax(lg, axis=-1))
    return [int(tok) for tok, _ in steps]


def test_greedy_tokens_match_builtin(native_ext, bundled_gguf, mlx_lm_greedy):
    import mlxinfer

    with mx.stream(mx.cpu):
        loaded = mlxinfer.load(str(bundled_gguf), kernels="custom")
        assert loaded.kernels == "cpu-native", loaded.kernels_detail
        tok = loaded.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
        ]
        native_tokens = [_greedy(loaded.model, p) for p in prompts]
    for prompt, tokens, got in zip(PROMPTS, prompts, native_tokens):
        want = mlx_lm_greedy(list(tokens), device=mx.cpu)
        assert len(got) == 32
        assert got == want, f"{prompt!r}: native {tok.decode(got)!r} vs builtin {tok.decode(want)!r}"
