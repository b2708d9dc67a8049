"""No setting breaks a session: every sampling flag and every /set is validated against the model before any
generation, with one line naming the setting, its allowed range and the value; the settings precedence is one
engine function (registry defaults < session < flags) whose names come from SamplingParams.

The refused flags run the CLI in this process (tests/in_process.py); the chat that goes on after bad /set
commands is a real process."""

from __future__ import annotations

from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, error_lines, run, write_tiny_llama

VOCAB = 256      # the tiny llama's vocabulary
CONTEXT = 512    # and its context


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def env(tmp_path) -> dict:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state")}


@pytest.mark.parametrize("flags, needles", [
    (("--top-k", "1000000000"), ("top_k 1000000000", f"between 0 and {VOCAB}", "vocabulary")),
    (("--top-k", str(VOCAB + 1)), (f"top_k {VOCAB + 1}", f"between 0 and {VOCAB}")),
    (("--top-k", "-1"), ("top_k -1", ">= 0")),
    (("--seed", "1" * 23), ("seed 11111111111111111111111", "between 0 and 18446744073709551615")),
    (("--seed", "-5"), ("seed -5", "between 0 and")),
    (("--temp", "nan"), ("temperature nan", "finite number >= 0")),
    (("--temp", "inf"), ("temperature inf", "finite")),
    (("--top-p", "0"), ("top_p 0.0", "(0, 1]")),
    (("--min-p", "1.5"), ("min_p 1.5", "[0, 1]")),
    (("--repeat-penalty", "0"), ("repeat_penalty 0.0", "> 0")),
    (("--max-tokens", "0"), ("max_tokens 0", ">= 1")),
    (("--max-tokens", "100000"), ("max_tokens 100000", f"between 1 and {CONTEXT}", "context")),
    (("--context", "100000"), ("context 100000", f"between 32 and {CONTEXT}")),
])
def test_chat_flags_are_checked_against_the_model(tiny, env, flags, needles):
    proc = run_in_process("chat", str(tiny), *flags, env=env, input="hello\n")
    assert_one_line_error(proc, *needles)
    assert proc.stdout == ""  # refused before any generation


@pytest.mark.parametrize("flags, needles", [
    (("--seed", "9" * 30), ("seed 999999999999999999999999999999", "between 0 and")),
    (("--min-p", "nan"), ("min_p nan", "[0, 1]")),
])
def test_generate_flags_share_the_validation(tiny, env, flags, needles):
    assert_one_line_error(run_in_process("generate", str(tiny), "-p", "hi", *flags, env=env), *needles)


def test_every_bad_set_is_one_line_and_the_chat_goes_on(tiny, env):
    """The reported case: /set top_k 1000000000 was accepted and every later message failed, even after
    /set top_k 0 and /clear. Now each bad value is refused on the spot and sampling keeps working."""
    bad = [
        ("top_k 1000000000", f"between 0 and {VOCAB}"), ("seed 12345678901234567890123", "18446744073709551615"),
        ("temp nan", "finite"), ("temp -1", ">= 0"), ("top_p 1.01", "(0, 1]"), ("min_p -0.5", "[0, 1]"),
        ("repeat_penalty inf", "> 0"), ("max_tokens 99999", f"between 1 and {CONTEXT}"),
        ("repeat_context 0", ">= 1"), ("context 8", f"between 32 and {CONTEXT}"), ("top_k 2.5", "whole number"),
        ("seed x", "whole number"), ("tmep 1", "did you mean 'temp'"),
    ]
    script = ["/set temp 0.9", "/set top_k 40"] + [f"/set {b}" for b, _ in bad] + [
        f"/set top_k {VOCAB}", "/set seed 18446744073709551615", "/set min_p 1", "first message",
        "/set top_k 0", "/clear", "second message"]
    proc = run("chat", str(tiny), "--max-tokens", "5", env=env, input="\n".join(script) + "\n")
    assert proc.returncode == 2, proc.stderr  # the chat went on; the exit status says that lines failed
    errors = [line for line in error_lines(proc) if line.startswith("error:")]
    assert errors[-1] == f"error: {len(bad)} of the piped messages and commands failed (see the errors above)"
    errors = errors[:-1]
    assert len(errors) == len(bad), errors
    for line, (setting, needle) in zip(errors, bad):
        name, value = setting.split()
        assert needle in line and (name in line or "unknown setting" in line), (setting, line)
    assert "generation failed" not in proc.stderr and "Traceback" not in proc.stderr
    assert f"set top_k = {VOCAB}" in proc.stderr and "set seed = 18446744073709551615" in proc.stderr
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 1  # replies came


def test_settings_precedence_and_names_come_from_one_place():
    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.settings import field_for, resolve, setting_names

    assert setting_names() == ("temp", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_context",
                               "max_tokens", "seed", "context")
    assert [field_for(n) for n in setting_names()[:-1]] == SamplingParams.names()
    assert field_for("temperature") == "temperature" and field_for("top-k") == "top_k" and field_for("x") is None
    registry = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "system": "ignored", "context": 4096}
    saved = {"temperature": 0.5, "top_k": 30, "seed": None, "context": 1024}
    flags = {"temp": 0.8, "top_k": None, "seed": 3}
    p = resolve(registry, saved, flags)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.8, 0.9, 30, 3)
    assert resolve(registry).temperature == 0.2 and resolve().temperature == SamplingParams().temperature


def test_model_checks_use_the_vocabulary_and_context(tmp_path):
    from types import SimpleNamespace

    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.settings import check_for_model, resolve, vocab_size
    from mlxinfer.errors import InvalidParameter

    small = SimpleNamespace(config={"vocab_size": 100}, context_length=128, model=None, tokenizer=None)
    assert vocab_size(small) == 100
    nested = SimpleNamespace(config={"text_config": {"vocab_size": 7}}, context_length=64, model=None,
                             tokenizer=None)
    assert vocab_size(nested) == 7
    check_for_model(SamplingParams(top_k=100, max_tokens=128), small)
    with pytest.raises(InvalidParameter, match=r"top_k 101: must be between 0 and 100"):
        check_for_model(SamplingParams(top_k=101, max_tokens=128), small)
    with pytest.raises(InvalidParameter, match=r"max_tokens 129: must be between 1 and 128"):
        check_for_model(SamplingParams(max_tokens=129), small)
    # The built-in max_tokens default adapts to a short context; a value someone chose does not.
    assert resolve(loaded=small).max_tokens == 128
    with pytest.raises(InvalidParameter, match="max_tokens 512"):
        resolve({"max_tokens": 512}, loaded=small)
