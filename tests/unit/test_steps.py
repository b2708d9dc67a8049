"""token_steps (the token step under stream_generate) against mlx-lm's generate_step on a tiny random llama."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_repetition_penalty, make_sampler

from mlxinfer.engine.steps import token_steps


@pytest.fixture(scope="module")
def model():
    mx.random.seed(7)
    net = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=500, tie_word_embeddings=True,
    ))
    # Larger weights than the init: peaked logits, so that greedy ties do not happen by chance.
    net.update(nn.utils.tree_map(lambda p: p * 8.0, net.parameters()))
    mx.eval(net.parameters())
    return net


def _ours(model, prompt, n, sampler, greedy, processors=(), step=512):
    cache = make_prompt_cache(model)
    out = list(token_steps(model, prompt, cache=cache, sampler=sampler, greedy=greedy,
                           logits_processors=processors, max_tokens=n, prefill_step_size=step))
    return out, cache


def _theirs(model, prompt, n, sampler, processors=None, step=512):
    cache = make_prompt_cache(model)
    out = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler,
                                       logits_processors=processors, prompt_cache=cache, prefill_step_size=step)]
    return out, cache


PROMPT = [3, 17, 42, 99, 5, 250, 7, 7, 12, 480, 33]


def test_greedy_matches_generate_step_and_cache_holds_every_token(model):
    greedy = make_sampler(temp=0.0)
    ours, c1 = _ours(model, PROMPT, 24, greedy, True, step=4)  # several prefill chunks
    theirs, c2 = _theirs(model, PROMPT, 24, greedy, step=4)
    assert ours == theirs and len(ours) == 24
    assert c1[0].offset == c2[0].offset == len(PROMPT) + 24


def test_repetition_penalty_and_seeded_sampling_match(model):
    penalty = [make_repetition_penalty(1.3, 16)]
    assert _ours(model, PROMPT, 20, make_sampler(temp=0.0), True, penalty)[0] == \
        _theirs(model, PROMPT, 20, make_sampler(temp=0.0), penalty)[0]
    sampler = make_sampler(temp=0.9, top_k=20, min_p=0.02)
    mx.random.seed(11)
    ours = _ours(model, PROMPT, 20, sampler, False)[0]
    mx.random.seed(11)
    assert ours == _theirs(model, PROMPT, 20, sampler)[0]  # shift-invariant samplers: same draws


def test_early_stop_leaves_the_yielded_tokens_in_the_cache_and_progress_is_reported(model):
    cache, seen = make_prompt_cache(model), []
    steps = token_steps(model, PROMPT, cache=cache, sampler=make_sampler(temp=0.0), greedy=True, max_tokens=-1,
                        prefill_step_size=5, prompt_progress=lambda done, total: seen.append((done, total)))
    got = [next(steps) for _ in range(6)]
    steps.close()
    assert len(got) == 6 and cache[0].offset == len(PROMPT) + 6
    assert seen[0] == (0, 11) and seen[-1] == (11, 11) and (5, 11) in seen and (10, 11) in seen


def test_non_finite_logits_are_a_model_error_not_an_empty_reply():
    """Corrupt weights (a NaN scale in a downloaded file) made every logit NaN: greedy argmax gave token 0 or the
    end token and the reply came back empty with exit 0. The first step's logits are checked."""
    from mlxinfer.errors import InvalidModel

    net = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=500, tie_word_embeddings=True,
    ))
    net.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    for greedy in (True, False):
        sampler = make_sampler(temp=0.0 if greedy else 0.7)
        with pytest.raises(InvalidModel, match="not finite"):
            list(token_steps(net, [1, 2, 3], cache=make_prompt_cache(net), sampler=sampler, greedy=greedy,
                             max_tokens=4))
    net.model.layers[1].mlp.down_proj.weight[3, 5] = 0.0
    assert len(list(token_steps(net, [1, 2, 3], cache=make_prompt_cache(net), sampler=make_sampler(temp=0.0),
                                greedy=True, max_tokens=4))) == 4
