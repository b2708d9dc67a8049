"""Hostile chat templates: loops, explosions, recursion and errors end fast with one line through the CLI (run in
this process: tests/in_process.py); the limits hold in the engine too, normal renders stay fast, and tojson
behaves like transformers'. --raw around a broken template runs the real process."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, run, write_tiny_llama

from mlxinfer.engine.templates import render
from mlxinfer.errors import InvalidModel

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def env(tmp_path) -> dict:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLXINFER_CACHE": str(tmp_path / "mlxcache")}


def with_template(tiny: Path, dest: Path, template: str) -> Path:
    """A copy of the tiny model whose tokenizer_config.json carries ``template``."""
    shutil.copytree(tiny, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


HOSTILE = {
    "nested loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
                    ("longer than the limit of 2 s",)),
    "string times 10**8": ("{{ 'x' * 10**8 }}", ("100,000,000 characters", "output limit")),
    "10**(10**10)": ("{{ 10**(10**10) }}", ("bits", "over the limit")),
    "huge range": ("{% for i in range(10**9) %}{% endfor %}x", ("range",)),
    "self-calling macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ("recurses without end",)),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}"
                          "{{ f(60) }}x", ("longer than the limit",)),
    "doubling ~": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                   "{% endfor %}{{ ns.s }}", ("output limit",)),
    "ZeroDivisionError": ("{{ 1 // 0 }}", ("ZeroDivisionError",)),
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate\nuser/assistant') }}",
                        ("chat template error: Conversation roles must alternate user/assistant",)),
    "renders nothing": ("{% if false %}x{% endif %}", ("rendered nothing",)),
    "ljust": ("{{ 'x'.ljust(10**9) }}", ("str.ljust", "output limit")),
    "%-width": ("{{ '%0999999999d' % 1 }}", ("%-format width",)),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_one_line_and_fast(tiny, env, tmp_path, name):
    template, needles = HOSTILE[name]
    model = with_template(tiny, tmp_path / "m", template)
    start = time.monotonic()
    proc = run_in_process("generate", str(model), "-p", "hello", env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert_one_line_error(proc, "chat template", *needles)
    assert proc.stdout == ""
    assert elapsed < 20, elapsed  # model load + at most the 2 s render limit


def test_raw_prompt_skips_a_broken_template(tiny, env, tmp_path):
    """The hint says --raw works around a broken template: it must."""
    model = with_template(tiny, tmp_path / "m", "{{ 1 // 0 }}")
    proc = run("generate", str(model), "--raw", "-p", "hello", "-n", "3", env=env)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**8 }}", "{{ [0] * 10**8 }}", "{{ 'x'|center(10**9) }}", "{{ 'x'|indent(10**9) }}",
    "{{ [1]|batch(10**9, 0)|list }}", "{{ '{:>999999999}'.format('x') }}", "{{ '%*d' % (10**9, 1) }}",
    "{{ '%0999999999d'|format(1) }}", "{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}",
    "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "{{ ('\t' * 1000).expandtabs(10**6) }}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ messages|tojson(indent=10**9) }}",
    # Built in C where neither the sandbox nor the deadline could stop them (a serve worker froze for minutes):
    "{{ range(100000)|join('x' * 40000) }}", "{{ '{:>{}}'.format('x', 4000000000) }}",
    "{{ ('x' * 40000).join(['a'] * 100000) }}", "{{ [1]|slice(100000000)|list|length }}",
    "{{ ([[0] * 1000] * 20000)|sum(start=[])|length }}",
])
def test_size_limits_refuse_before_building(template):
    start = time.monotonic()
    with pytest.raises(InvalidModel, match="chat template stopped"):
        render(template, MESSAGES)
    assert time.monotonic() - start < 1.5


def test_time_limit_is_configurable_and_leaves_no_pending_stop(monkeypatch):
    monkeypatch.setenv("MLXINFER_TEMPLATE_TIMEOUT", "0.3")
    start = time.monotonic()
    with pytest.raises(InvalidModel, match="longer than the limit of 0.3 s"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", MESSAGES)
    assert time.monotonic() - start < 2
    time.sleep(0.5)  # a timer from the render must not fire into later code
    assert render("{{ messages[0].content }}", MESSAGES) == "hi"


def test_the_wrapped_filters_still_do_their_job():
    assert render("{{ ['a', 'b', 'c']|join(', ') }}", MESSAGES) == "a, b, c"
    assert render("{{ messages|join('|', attribute='content') }}", MESSAGES) == "hi"
    assert render("{{ [1, 2, 3, 4]|slice(2)|list }}", MESSAGES) == "[[1, 2], [3, 4]]"
    assert render("{{ [1, 2, 3]|sum }} {{ [{'n': 2}, {'n': 3}]|sum(attribute='n', start=1) }}", MESSAGES) == "6 6"
    assert render("{{ '-'.join(['a', 'b']) }} {{ '{:>3}'.format('x') }}", MESSAGES) == "a-b   x"


@pytest.mark.parametrize("template, needle", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ 10.0 ** 1000 }}", "OverflowError"),
    ("{{ foo.bar }}", "undefined"), ("{% for %}", "syntax error on line 1"), ("  \n ", "rendered nothing"),
])
def test_render_errors_are_one_line(template, needle):
    with pytest.raises(InvalidModel) as info:
        render(template, MESSAGES)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_long_legitimate_history_renders_fast_and_a_long_message_fits():
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    history = [{"role": ("user", "assistant")[i % 2], "content": "hello there " * 50} for i in range(200)]
    render(chatml, history)
    start = time.perf_counter()
    out = render(chatml, history)
    assert time.perf_counter() - start < 0.5 and out.count("<|im_start|>") == 201
    # The output limit grows with the input: a 3 MB message is not a template fault.
    big = render(chatml, [{"role": "user", "content": "x" * 3_000_000}])
    assert len(big) > 3_000_000


def test_tojson_is_transformers_tojson():
    """Tool-calling templates emit JSON with tojson: no HTML escaping, UTF-8 kept, indent and sort_keys work."""
    tools = [{"name": "f", "description": "a <b> & 'c' ü → d", "parameters": {"z": 1, "a": [1, 2]}}]
    out = render("{{ tools|tojson }}", MESSAGES, tools=tools)
    assert out == json.dumps(tools, ensure_ascii=False)
    assert "<b> & 'c' ü" in out
    out = render("{{ tools|tojson(indent=2, sort_keys=true) }}", MESSAGES, tools=tools)
    assert out == json.dumps(tools, ensure_ascii=False, indent=2, sort_keys=True)
    assert render("{{ 'x'|tojson(ensure_ascii=true) }}{{ 'é'|tojson(ensure_ascii=true) }}", MESSAGES) == \
        '"x""\\u00e9"'
