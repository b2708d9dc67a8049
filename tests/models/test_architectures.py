"""Every tiny architecture of ``tiny_arch.ARCHS`` through mlxinfer: load and report, KV-cache consistency
(prefill + single steps, trim + refeed), greedy parity with mlx-lm's own ``generate_step``, custom kernels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

import mlxinfer
from mlxinfer.engine.loader import apply_dtype_policy
from mlxinfer.engine.sampling import SamplingParams
from tiny_arch import ARCHS, VOCAB, config_for

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=16)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    """Deterministic token ids (specials below 17 avoided: they carry no meaning for a random model)."""
    return np.random.default_rng(seed).integers(17, VOCAB, size=n).tolist()


def forward(model, tokens, cache=None) -> np.ndarray:
    """Logits for every position of ``tokens`` as float32 NumPy: (L, vocab)."""
    out = model(mx.array(tokens)[None], cache=cache)  # (1, L, vocab)
    return np.array(out[0].astype(mx.float32))


# Allowed max |diff| between logits of the same tokens computed along another path (other matmul shapes, masked
# vs cached attention), relative to the largest logit (~20 here). On this CPU backend (float32) the paths agree
# bit for bit; GPU kernels reorder float32 sums (~1e-6 relative) and run float16 models in float16 (eps ~1e-3,
# compounding over 2 layers). A wrong position, mask or cache entry moves logits by O(scale): see the negative
# check in test_kv_cache_matches_one_pass, which needs a difference of 0.1 x scale.
RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str, dtype: str = "float32") -> None:
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= RELATIVE_TOLERANCE[dtype] * scale, f"{what}: max |diff| {err:.3g} vs logit scale {scale:.3g}"


def test_load_reports(arch, tiny):
    """mlxinfer.load reports what the directory holds; floating parameters follow the backend's dtype policy."""
    from mlx_lm.utils import _get_classes

    spec, config = ARCHS[arch], config_for(arch)
    lm = config.get("text_config", config)  # a multimodal layout keeps the language model's fields there
    assert tiny.model_type == config["model_type"]
    assert tiny.context_length == lm["max_position_embeddings"]
    if spec.bits is None:
        assert tiny.quantization == "none (float16)"
    else:
        assert tiny.quantization.startswith(f"{spec.bits}-bit affine, group {spec.group_size}")
    # The parameter count of a quantized model is the count of its unquantized twin built from the same config.
    model_cls, args_cls = _get_classes(config)
    dense = sum(v.size for _, v in tree_flatten(model_cls(args_cls.from_dict(config)).parameters()))
    assert tiny.num_parameters() == dense
    assert tiny.kernels == "builtin"
    assert lm["eos_token_id"] in tiny.eos_token_ids and "<|im_start|>" in tiny.chat_template  # SmolLM2's

    floating = {str(v.dtype) for _, v in tree_flatten(tiny.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    expected = "float32" if tiny.backend == "cpu" else "float16"
    assert tiny.dtype == expected and floating == {"mlx.core." + expected}
    if spec.bits is not None:
        packed = [k for k, v in tree_flatten(tiny.model.parameters()) if v.dtype == mx.uint32]
        assert packed and all(k.endswith("weight") for k in packed)


def test_kv_cache_matches_one_pass(arch, tiny):
    """Prefill N-k tokens into a prompt cache, feed the rest one at a time: the logits at every fed position equal
    one pass over all N tokens. Then trim m tokens and re-feed them as one chunk (what chat's prefix reuse does):
    the last logits match again, and a cache trimmed but fed other tokens does not (the comparison can fail)."""
    n, k, m = 24, 6, 5
    tokens = prompt_ids(n)
    full = forward(tiny.model, tokens)  # (n, vocab)

    cache = make_prompt_cache(tiny.model)
    prefill = forward(tiny.model, tokens[: n - k], cache)
    assert_logits_close(prefill, full[: n - k], "chunked prefill", tiny.dtype)
    for i in range(n - k, n):
        step = forward(tiny.model, [tokens[i]], cache)
        assert_logits_close(step[-1], full[i], f"single step at position {i}", tiny.dtype)
    assert all(c.offset == n for c in cache)

    assert can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, m) == m
    assert all(c.offset == n - m for c in cache)
    refed = forward(tiny.model, tokens[n - m:], cache)
    assert_logits_close(refed, full[n - m:], "re-fed after trim", tiny.dtype)

    trim_prompt_cache(cache, m)
    other = forward(tiny.model, prompt_ids(m, seed=2), cache)[-1]
    assert np.abs(other - full[-1]).max() > 0.1 * np.abs(full[-1]).max(), "different tokens gave the same logits"


def test_sliding_window_cache_after_rotation(tiny_model_dir):
    """Gemma 3 with a window shorter than the prompt: the rotating cache still matches one masked pass, and once
    it has rotated it reports itself untrimmable (so a chat session must prefill again instead of trimming)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model_dir("gemma3_text"), model_config={"sliding_window": 8})
    dtype = apply_dtype_policy(model)
    tokens = prompt_ids(20)
    full = forward(model, tokens)
    cache = make_prompt_cache(model)
    forward(model, tokens[:12], cache)
    for i in range(12, 20):
        assert_logits_close(forward(model, [tokens[i]], cache)[-1], full[i], f"rotated window at position {i}", dtype)
    assert not can_trim_prompt_cache(cache)


def greedy_mlx_lm(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


def test_greedy_tokens_match_mlx_lm(arch, tiny, tiny_model_dir):
    """stream_generate at temperature 0 yields exactly mlx-lm's greedy tokens on a model mlx-lm loaded itself
    (cast to the same activation dtype), from the same chat prompt."""
    import mlx_lm

    ref_model, ref_tok = mlx_lm.load(str(tiny_model_dir(arch)))
    apply_dtype_policy(ref_model)
    prompt = mlxinfer.chat_prompt(tiny, MESSAGES)
    assert prompt == list(ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True))

    final = list(mlxinfer.stream_generate(tiny, prompt, GREEDY, ignore_eos=True))[-1]
    assert final.finish_reason == "length"
    assert len(final.stats.tokens) == GREEDY.max_tokens
    want = greedy_mlx_lm(ref_model, prompt, GREEDY.max_tokens)
    assert final.stats.tokens == want
    assert len(set(want)) >= 4, f"degenerate tiny model (greedy repeats itself): {want}"


def greedy(loaded, prompt, cache=None, max_tokens: int = 8) -> list[int]:
    params = GREEDY.with_values(max_tokens=max_tokens)
    return list(mlxinfer.stream_generate(loaded, prompt, params, cache=cache, ignore_eos=True))[-1].stats.tokens


def test_generation_cache_reuse(arch, tiny):
    """What chat relies on, through stream_generate: after a reply the cache holds prompt + reply, so the next turn
    passes only its new tokens and gets the reply of a fresh cache over the whole history; trimming back to the
    prompt (/retry) regenerates the first reply."""
    prompt, turn2 = prompt_ids(12, seed=3), prompt_ids(5, seed=4)
    cache = make_prompt_cache(tiny.model)
    reply = greedy(tiny, prompt, cache)
    assert [c.offset for c in cache] == [len(prompt) + len(reply)] * len(cache)

    second = greedy(tiny, turn2, cache)
    assert second == greedy(tiny, prompt + reply + turn2)

    # Back to prompt[:-1]: a call needs at least one new token to feed (as Session does for /retry).
    n = len(reply) + len(turn2) + len(second) + 1
    assert trim_prompt_cache(cache, n) == n
    assert greedy(tiny, prompt[-1:], cache) == reply


def test_custom_kernels_same_greedy_tokens(arch, tiny, tiny_model_dir, monkeypatch, float_prefill):
    """kernels="auto" (the backend's custom kernels patched in) gives the greedy tokens of the built-ins."""
    from mlxinfer.kernels.patch import apply_kernels, select_provider

    # The one-op layers' default float16 KV cache rounds keys/values (~1e-3 of the logits: tests/kernels/
    # test_spec_layers.py bounds it); the random tiny models have near-ties that such rounding may flip (phi3 did),
    # so exact token parity is checked with the float32 cache, where the fused maths matches to ~1e-6. For the same
    # reason prefill runs at float32 (``float_prefill``: the AVX2 int8 prefill, ~1-3% of a logit on these models,
    # off; tests/kernels/test_spec_layers.py bounds it, tests/golden holds the real model's text with it).
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    provider, why = select_provider()
    if provider is None:
        pytest.skip(f"no custom kernel provider on this backend: {why}")
    prompt = mlxinfer.chat_prompt(tiny, MESSAGES)
    # Before loading "auto": its attention swap is per mlx-lm module, so it would also reach ``tiny``.
    builtin = list(mlxinfer.stream_generate(tiny, prompt, GREEDY, ignore_eos=True))[-1].stats.tokens
    patched = mlxinfer.load(str(tiny_model_dir(arch)), kernels="auto")
    try:
        assert patched.kernels == provider.name, patched.kernels_detail
        got = list(mlxinfer.stream_generate(patched, prompt, GREEDY, ignore_eos=True))[-1].stats.tokens
    finally:
        apply_kernels(patched.model, "builtin")  # give the mlx-lm modules their own attention back
    assert got == builtin
