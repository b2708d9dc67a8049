"""Sampling-parameter validation, stop-string holdback, and the sandboxed chat template."""

from __future__ import annotations

import pytest

from mlxinfer.engine.generate import _holdback
from mlxinfer.engine.sampling import SamplingParams
from mlxinfer.engine.templates import render
from mlxinfer.errors import InvalidModel, InvalidParameter


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 1.0},
    {"repeat_penalty": 0.0}, {"max_tokens": 0}, {"seed": -3},
])
def test_invalid_sampling_values_are_rejected(bad):
    with pytest.raises(InvalidParameter, match=next(iter(bad))):
        SamplingParams(**bad).validate()


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
