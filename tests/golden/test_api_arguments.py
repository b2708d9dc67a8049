"""The Python API checks its arguments as the CLI does: one InvalidParameter line, not a ValueError from MLX, an
AttributeError deep inside, or garbage from token ids outside the vocabulary; a prompt must fit the context and
a reply stops at its end (it ran past the context before)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import mlxinfer
from mlxinfer import SamplingParams
from mlxinfer.engine.prompts import chat_prompt
from mlxinfer.errors import InvalidParameter

GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.mark.parametrize("prompt, said", [
    ("", "the prompt is empty"), ("   ", "the prompt is empty"), ([], "the prompt is empty"),
    (None, "the prompt must be text or a list of token ids, not NoneType"),
    (b"hello", "the prompt must be text or a list of token ids, not bytes"),
    (["a", "b"], "prompt token 'a' is not a token id of this model (0 to 49151)"),
    ([10**9], "prompt token 1000000000 is not a token id"), ([-1, 5], "prompt token -1 is not a token id"),
])
def test_bad_prompts_are_one_line(smollm2, prompt, said):
    with pytest.raises(InvalidParameter, match=said.replace("(", r"\(").replace(")", r"\)")):
        mlxinfer.generate(smollm2, prompt, GREEDY)


def test_bad_model_and_params_are_one_line(smollm2):
    with pytest.raises(InvalidParameter, match="generation needs a model from mlxinfer.load"):
        mlxinfer.generate(None, "hi", GREEDY)
    with pytest.raises(InvalidParameter, match="params must be a SamplingParams, not dict"):
        mlxinfer.generate(smollm2, "hi", {"temperature": 0})
    with pytest.raises(InvalidParameter, match="stop strings must be non-empty"):
        mlxinfer.generate(smollm2, "hi", GREEDY, stop=[""])


@pytest.mark.parametrize("cap", [None, 2048], ids=["model", "registry-cap"])
def test_the_context_bounds_prompt_and_reply(smollm2, cap):
    """A prompt must fit the context and the reply stops at its end: the model's own (8192) and a models.toml
    ``context`` cap below it. The reply's bound runs under the cap only (a 2043-token prompt rather than 8187:
    35 s of the suite; attention over long contexts has its own kernel tests)."""
    loaded = replace(smollm2, spec=replace(smollm2.spec, context=cap))
    context = loaded.context_length
    assert context == (cap or 8192)
    words = chat_prompt(loaded, [{"role": "user", "content": "hello " * (context + 100)}])
    with pytest.raises(InvalidParameter, match=rf"the prompt has {len(words)} tokens and the model's context holds "
                                               rf"{context}"):
        mlxinfer.generate(loaded, words, GREEDY)
    if cap is not None:
        near = words[: context - 5]
        last = list(mlxinfer.stream_generate(loaded, near, SamplingParams(temperature=0, max_tokens=300),
                                             ignore_eos=True))[-1]
        assert last.stats.generation_tokens == 5 and last.finish_reason == "length"


def test_one_stop_string_is_one_stop(smollm2):
    """stop="Paris" was read as the stops P, a, r, i, s."""
    whole = mlxinfer.generate(smollm2, chat_prompt(smollm2, [{"role": "user", "content": "What is the capital of "
                                                                                        "France?"}]),
                              SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in whole
    cut = mlxinfer.generate(smollm2, chat_prompt(smollm2, [{"role": "user", "content": "What is the capital of "
                                                                                      "France?"}]),
                            SamplingParams(temperature=0, max_tokens=16), stop="Paris")
    assert cut == whole[: whole.index("Paris")]


@pytest.mark.parametrize("messages, said", [
    ("hi", "messages must be a list"), ({"role": "user"}, "messages must be a list"),
    ([{"role": "user"}], r"message 0 \(user\): 'content' must be text, not NoneType"),
    ([{"role": "user", "content": 5}], r"message 0 \(user\): 'content' must be text, not int"),
    ([{"content": "hi"}], r"message 0 has no 'role'"), (["hi"], r"message 0 must be a dict"),
])
def test_bad_messages_are_the_callers_not_the_templates(smollm2, messages, said):
    """They were reported as "the model's chat template is broken: fix chat_template in its tokenizer_config"."""
    with pytest.raises(InvalidParameter, match=said):
        chat_prompt(smollm2, messages)


def test_a_text_completion_keeps_its_first_space_a_chat_reply_does_not(smollm2):
    """mlx-lm's detokenizers drop a text's first space: "The capital of France is" + "Paris." was the completion
    (generate --raw and the API on text); a chat reply still starts with its first word."""
    import subprocess
    import sys

    params = SamplingParams(temperature=0, max_tokens=2)
    assert mlxinfer.generate(smollm2, "The capital of France is", params) == " Paris."
    tokens = chat_prompt(smollm2, [{"role": "user", "content": "What is the capital of France?"}])
    assert not mlxinfer.generate(smollm2, tokens, params).startswith(" ")
    out = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "--raw", "-p", "The capital of France is",
                          "--temp", "0", "-n", "2"], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith(" Paris.")


@pytest.mark.parametrize("kwargs, said", [
    ({"prefill_step_size": -1}, "prefill_step_size must be a whole number >= 1, not -1"),  # heap corruption before
    ({"prefill_step_size": 0}, "prefill_step_size must be a whole number >= 1, not 0"),
    ({"cache": "abc"}, "cache must be a prompt cache"), ({"cache": [1, 2]}, "cache must be a prompt cache"),
    ({"params": SamplingParams(top_k=10**6)}, "invalid top_k 1000000: must be between 0 and 49152"),
])
def test_every_api_argument_is_checked_before_the_kernels_see_it(smollm2, kwargs, said):
    """A negative prefill_step_size went into the native in-place KV cache (malloc: smallbin double linked list
    corrupted), a string cache failed deep inside, top_k above the vocabulary was taken where chat refuses it."""
    params = kwargs.pop("params", GREEDY)
    with pytest.raises(InvalidParameter, match=re.escape(said)):
        mlxinfer.generate(smollm2, "hello there my friend", params, **kwargs)


def test_a_given_cache_counts_against_the_context(smollm2):
    """With cache= the context check was skipped: 9000 tokens went into an 8192-token model."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(smollm2.model)
    with pytest.raises(InvalidParameter, match="the prompt has 9000 tokens and the model's context holds 8192"):
        mlxinfer.generate(smollm2, [1] * 9000, GREEDY, cache=cache)
    for layer in cache:  # as if 8003 tokens had been read (the check runs before any is): 8000 took a minute
        layer.offset = 8003
    with pytest.raises(InvalidParameter, match="the cache holds 8003 tokens, the prompt has 200, the model's"):
        mlxinfer.generate(smollm2, [1] * 200, GREEDY, cache=cache)


def test_a_prompt_piped_with_echo_is_the_prompt_given_with_p(smollm2):
    """`echo "..." | mlxinfer generate -p -` kept echo's newline: 38 prompt tokens, not 37, and another answer."""
    import json
    import subprocess
    import sys

    def run(*args, stdin=None):
        proc = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", *args, "--temp", "0", "-n", "8",
                               "--json"], input=stdin, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    question = "What is the capital of France?"
    piped, given = run("-p", "-", stdin=question + "\n"), run("-p", question)
    assert piped["prompt_tokens"] == given["prompt_tokens"] and piped["text"] == given["text"]


def test_a_session_without_params_takes_the_models_defaults_as_chat_does(smollm2):
    """Session(m) sampled at SamplingParams' 0.7 / 1.0 where `mlxinfer chat` uses the model's models.toml 0.2 / 0.9."""
    defaults = smollm2.spec.defaults
    params = mlxinfer.Session(smollm2).params
    assert (params.temperature, params.top_p) == (defaults["temperature"], defaults["top_p"]) == (0.2, 0.9)


@pytest.mark.parametrize("make, said", [
    (lambda m: mlxinfer.Session("smollm2"), "a Session needs a model from mlxinfer.load(...), not str"),
    (lambda m: mlxinfer.Session(m, {"temperature": 0}), "params must be a SamplingParams, not dict"),
    (lambda m: mlxinfer.Session(m).send(5), "a message must be text, not int"),
    (lambda m: mlxinfer.Session(m, messages="hi"), "messages must be a list"),
    (lambda m: mlxinfer.Session(m, messages=[{"role": "system", "content": "Be brief."}]),
     "message 0 is a system message (pass it as Session(..., system=TEXT))"),
    (lambda m: mlxinfer.Session(m, messages=[{"role": "robot", "content": "x"}]), "message 0 must be"),
    (lambda m: mlxinfer.Session(m, messages=[{"role": "user"}]), "message 0 must be"),
    (lambda m: mlxinfer.chat_prompt("smollm2", [{"role": "user", "content": "Hi"}]),
     "a chat prompt needs a model from mlxinfer.load(...), not str"),
])
def test_a_sessions_arguments_are_checked_as_its_save_and_load_check_them(smollm2, make, said):
    """Each was an AttributeError or a ValueError from deep inside; a system message or a role 'robot' was taken
    and then refused by the session's own from_dict."""
    with pytest.raises(InvalidParameter, match=re.escape(said)):
        make(smollm2)


def test_a_turn_left_unrun_cannot_run_after_a_later_one(smollm2):
    """It generated on top of the later turn's cache and appended a second assistant message in a row."""
    from mlxinfer.engine.session import SessionError

    s = mlxinfer.Session(smollm2, SamplingParams(temperature=0, max_tokens=4))
    first, second = s.send("Hi"), s.send("What is 2+2?")
    "".join(r.text for r in second)
    with pytest.raises(SessionError, match="replaced by a later send or retry"):
        "".join(r.text for r in first)
    stale = s.send("And 3+3?")
    s.undo()
    with pytest.raises(SessionError, match="replaced"):
        list(stale)
    assert [m["role"] for m in s.messages] == ["user", "assistant"]


def test_an_empty_model_name_is_refused_not_read_as_the_default():
    from mlxinfer.errors import InvalidModel

    with pytest.raises(InvalidModel, match="the model name is empty"):
        mlxinfer.load("  ")


def test_the_api_lists_its_names_and_errors_before_they_are_used():
    """dir(mlxinfer) showed the lazily imported names only once used; SessionError was not reachable from the
    package (the errors a caller catches: MlxinferError and its kinds)."""
    import subprocess
    import sys

    code = "import mlxinfer; print(sorted(set(mlxinfer.__all__) - set(dir(mlxinfer))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "[]"
    assert issubclass(mlxinfer.SessionError, mlxinfer.MlxinferError)
    assert issubclass(mlxinfer.InvalidParameter, mlxinfer.MlxinferError)


def test_the_readmes_python_example_runs(tmp_path):
    """README's Python API section, run as written (a docs example that fails is a bug)."""
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and len(proc.stdout.splitlines()) >= 4  # library code prints nothing of its own


def test_a_chat_counts_its_context_the_same_live_resumed_and_after_a_change(smollm2):
    """Live /show said 53 tokens, resumed 59 (the next reply's header counted), after /undo a third number, and
    after a /system change 6 for a 2-message chat (the trimmed cache's count)."""
    s = mlxinfer.Session(smollm2, SamplingParams(temperature=0, max_tokens=20))
    "".join(r.text for r in s.send("Say hi."))
    live = s.context_used
    assert live == mlxinfer.Session.from_dict(s.to_dict(), smollm2).context_used
    "".join(r.text for r in s.send("And bye."))
    s.undo()
    assert s.context_used == live
    s.set_system("You are a pirate.")
    assert s.context_used == mlxinfer.Session.from_dict(s.to_dict(), smollm2).context_used > 30
