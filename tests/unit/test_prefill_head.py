"""The LM head runs only where logits are used: a prompt's positions never go through a 262k-token vocabulary.

``token_steps`` evaluates only the KV cache for all but the last prompt token (MLX is lazy: the chunks' logits are
built but never computed), then one position for the first token. Measured here by peak memory: logits for every
prompt position of a 262,144-token vocabulary would be 128 x 262144 x 4 bytes = 134 MB.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlxinfer.engine.steps import token_steps

VOCAB = 262_144
PROMPT = [(i * 7919) % VOCAB for i in range(1, 129)]
MB = 1 << 20


@pytest.fixture(scope="module")
def big_vocab():
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=True))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.fixture(params=["builtin", "native"])
def kernels(request, big_vocab):
    from mlxinfer.kernels.patch import apply_kernels

    if request.param == "native":
        from mlxinfer import native

        if native.provider() is None:
            pytest.skip(native.status())
        apply_kernels(big_vocab, "custom")
    yield request.param
    apply_kernels(big_vocab, "builtin")


def _extra_peak(fn) -> float:
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    return (mx.get_peak_memory() - base) / MB


def test_prefill_computes_the_head_for_the_last_position_only(big_vocab, kernels):
    def steps():
        cache = make_prompt_cache(big_vocab)
        list(token_steps(big_vocab, PROMPT, cache=cache, sampler=lambda x: mx.argmax(x, axis=-1), greedy=True,
                         max_tokens=1, prefill_step_size=64))

    def full_call():  # the control: what computing every position's logits costs
        mx.eval(big_vocab(mx.array([PROMPT]))[:, -1])

    assert _extra_peak(full_call) > 100  # ~134 MB of logits: the measurement sees the head when it runs
    assert _extra_peak(steps) < 30, "the LM head ran for prompt positions"


def test_tokens_match_the_full_call(big_vocab, kernels):
    """Greedy tokens of the token step (chunked prefill, cache) equal re-running the whole sequence each step."""
    cache = make_prompt_cache(big_vocab)
    got = list(token_steps(big_vocab, PROMPT[:40], cache=cache, sampler=lambda x: mx.argmax(x, axis=-1),
                           greedy=True, max_tokens=6, prefill_step_size=16))
    seq, want = list(PROMPT[:40]), []
    for _ in range(6):
        want.append(mx.argmax(big_vocab(mx.array([seq]))[0, -1]).item())
        seq.append(want[-1])
    assert got == want
