"""Greedy decoding of the bundled SmolLM2 with the native CPU kernels gives the built-in kernels' tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow  # loads the real model and needs the compiled extension

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


def _greedy(model, prompt_tokens, n=32):
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n, sampler=lambda lg: mx.argmax(lg, axis=-1))
    return [int(tok) for tok, _ in steps]


def test_greedy_tokens_match_builtin(native_ext, bundled_gguf):
    import mlxinfer
    from mlxinfer.kernels.patch import apply_kernels

    with mx.stream(mx.cpu):
        loaded = mlxinfer.load(str(bundled_gguf), kernels="custom")
        assert loaded.kernels == "cpu-native", loaded.kernels_detail
        tok = loaded.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
        ]
        native_tokens = [_greedy(loaded.model, p) for p in prompts]
        assert apply_kernels(loaded.model, "builtin").name == "builtin"
        builtin_tokens = [_greedy(loaded.model, p) for p in prompts]
    for prompt, got, want in zip(PROMPTS, native_tokens, builtin_tokens):
        assert len(got) == 32
        assert got == want, f"{prompt!r}: native {tok.decode(got)!r} vs builtin {tok.decode(want)!r}"
