"""Sampling-parameter validation, stop-string holdback, and the sandboxed chat template."""

from __future__ import annotations

import pytest

from mlxinfer.engine.generate import _holdback
from mlxinfer.engine.sampling import SamplingParams
from mlxinfer.engine.templates import render
from mlxinfer.errors import InvalidModel, InvalidParameter


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": 0.0},
    {"top_p": 1.5}, {"top_p": float("nan")}, {"top_k": -1}, {"top_k": 1.5}, {"top_k": True}, {"min_p": 1.01},
    {"min_p": -0.1}, {"min_p": float("nan")}, {"repeat_penalty": 0.0}, {"repeat_penalty": float("inf")},
    {"max_tokens": 0}, {"max_tokens": -2}, {"repeat_context": 0}, {"seed": -3}, {"seed": 2**64},
    {"seed": 10**22}, {"temperature": "hot"},
])
def test_invalid_sampling_values_are_rejected(bad):
    with pytest.raises(InvalidParameter, match=next(iter(bad))) as e:
        SamplingParams(**bad).validate()
    assert "\n" not in str(e.value) and len(str(e.value)) < 160  # one line, even for a 23-digit seed


def test_range_edges_are_accepted():
    """The edges of every range are real values (min_p 1 keeps only the top token; seed up to 2^64-1, which
    mx.random.seed accepts)."""
    import mlx.core as mx

    from mlxinfer.engine.sampling import SEED_MAX

    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, repeat_penalty=1e-3, max_tokens=-1,
                   seed=SEED_MAX).validate()
    mx.random.seed(SEED_MAX)
    with pytest.raises((TypeError, OverflowError, ValueError)):
        mx.random.seed(SEED_MAX + 1)  # what the upper bound is for: MLX refuses anything above it


def test_sampler_top_k_equal_to_the_vocabulary_means_all_tokens():
    import mlx.core as mx

    from mlxinfer.engine.sampling import make_sampler

    logits = mx.array([[0.0, 1.0, 2.0, 3.0]])
    for k in (4, 3):
        token = make_sampler(SamplingParams(temperature=1.0, top_k=k))(logits)
        assert 0 <= token.item() < 4
    mx.eval(mx.random.state)  # the random state survived


def test_a_failing_sampler_leaves_a_broken_random_state_that_is_repaired():
    """mlx-lm's compiled samplers leave a placeholder in mx.random.state when they raise: the chat's failure path
    must reseed, or every later sampled token fails ("eval an array without a primitive")."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p

    from mlxinfer.engine.sampling import make_sampler, repair_random_state

    assert repair_random_state() is False
    with pytest.raises(ValueError):
        apply_min_p(mx.zeros((1, 8)), 2.0)
    with pytest.raises(RuntimeError):
        mx.eval(mx.random.state)
    assert repair_random_state() is True
    token = make_sampler(SamplingParams(temperature=1.0))(mx.zeros((1, 8)))
    assert 0 <= token.item() < 8


def test_with_values_ignores_none_and_validates():
    p = SamplingParams(temperature=0.7).with_values(temperature=None, top_k=40)
    assert p.temperature == 0.7 and p.top_k == 40
    with pytest.raises(InvalidParameter):
        p.with_values(top_p=2)


def test_coerce_parses_user_text():
    assert SamplingParams.coerce("top_k", "40") == 40
    assert SamplingParams.coerce("temperature", "0.5") == 0.5
    assert SamplingParams.coerce("seed", "none") is None
    with pytest.raises(InvalidParameter, match="unknown setting"):
        SamplingParams.coerce("tmp", "1")
    with pytest.raises(InvalidParameter, match="expected a number"):
        SamplingParams.coerce("temperature", "hot")
    with pytest.raises(InvalidParameter, match="top_k '1.5': expected a whole number"):
        SamplingParams.coerce("top_k", "1.5")


def test_holdback_keeps_possible_stop_prefixes():
    assert _holdback("Hello wor", ["world"]) == 3
    assert _holdback("Hello", ["world"]) == 0
    assert _holdback("a <|e", ["<|end|>", "<|eot|>"]) == 3


def test_template_renders_messages():
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    out = render(tpl, [{"role": "user", "content": "hi"}])
    assert out == "<user>hi<a>"


def test_template_cannot_reach_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidModel, match="Python internals"):
        render(evil, [{"role": "user", "content": "x"}])


def test_template_raise_exception_is_a_clear_error():
    with pytest.raises(InvalidModel, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", [])


def test_template_without_source_uses_fallback():
    assert render(None, [{"role": "user", "content": "hi"}]).endswith("Assistant:")


SMOL_TEMPLATE = (  # SmolLM2-Instruct's own, verbatim in shape
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA31_LIKE = (  # a header every prompt gets, with or without a system message of the user's
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% set rest = messages[1:] %}"
    "{% else %}{% set rest = messages %}{% endif %}<|eot_id|>"
    "{% for m in rest %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}")
REFUSES_SYSTEM = (  # Gemma 2's way: a system message is an error
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}")
PLAIN = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize("template, expected", [
    (SMOL_TEMPLATE, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    (SMOL_TEMPLATE.replace("SmolLM, trained by Hugging Face", "Qwen, created by Alibaba Cloud"),
     "You are a helpful AI assistant named Qwen, created by Alibaba Cloud"),
    (LLAMA31_LIKE, None),     # the date header is there either way: it is not a system prompt in the user's place
    (REFUSES_SYSTEM, None),
    (PLAIN, None),
])
def test_the_system_prompt_a_chat_template_adds_of_its_own_is_found(template, expected):
    """A chat with no system prompt is not a chat without one when the template writes its own: /show and /system
    say what the model reads."""
    from types import SimpleNamespace

    from mlxinfer.engine.prompts import template_system_prompt

    loaded = SimpleNamespace(chat_template=template, tokenizer=SimpleNamespace(bos_token="<s>", eos_token="</s>"))
    assert template_system_prompt(loaded) == expected
