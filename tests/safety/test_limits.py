"""Bounded resources outside the template: generate checks the prompt against the context before prefilling (and
refuses empty or undecodable prompts), a long stdin prompt shows progress and is refused after a small part,
and bench checks its flags, the context and the memory a run needs before it starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, error_lines, run, write_tiny_llama

from mlxinfer.bench.memory import available_memory, check_memory, kv_bytes_per_token
from mlxinfer.bench.workload import Case
from mlxinfer.errors import InvalidParameter

CONTEXT = 512  # the tiny llama's context


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def tiny_hf(tiny, tmp_path_factory) -> Path:
    """The tiny model with model_max_length set, as real tokenizer configs have it: transformers then warns on
    stderr about longer inputs, which must not add a second line to the refusal."""
    import json
    import shutil

    model = tmp_path_factory.mktemp("tiny_hf") / "m"
    shutil.copytree(tiny, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": CONTEXT}))
    return model


@pytest.fixture
def env(tmp_path) -> dict:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLXINFER_CACHE": str(tmp_path / "mlxcache")}


# -- generate: the prompt against the context --------------------------------------------------------------

def test_a_prompt_longer_than_the_context_is_refused_before_prefill(tiny_hf, env):
    # The byte-level tokenizer makes one token per byte (and has no BOS): 600 bytes cannot fit in 512.
    proc = run("generate", str(tiny_hf), "--raw", "-p", "a" * 600, env=env)
    assert_one_line_error(proc, "the prompt is 600 tokens", f"holds {CONTEXT}", "shorten the prompt")
    assert proc.stdout == ""


def test_a_prompt_through_the_template_is_counted_too(tiny_hf, env):
    proc = run_in_process("generate", str(tiny_hf), "-p", "b" * 505, env=env)  # + "user: " and "assistant:" > 512
    assert_one_line_error(proc, "the prompt is", f"holds {CONTEXT}")


def test_explicit_max_tokens_must_fit_with_the_prompt(tiny, env):
    proc = run_in_process("generate", str(tiny), "--raw", "-p", "a" * 400, "-n", "200", env=env)
    assert_one_line_error(proc, "400 tokens + 200 to generate", "lower --max-tokens")


def test_default_max_tokens_is_capped_to_the_room_left(tiny, env):
    """Without -n the reply simply ends at the context (as in chat), it is not an error."""
    proc = run("generate", str(tiny), "--raw", "-p", "a" * 500, "--temp", "0", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"/{CONTEXT}" in proc.stderr  # the stats line shows the context used


@pytest.mark.parametrize("args, stdin", [
    (("--raw", "-p", ""), None), (("-p", ""), None), (("-p", "  \n\t "), None), (("-p", "-"), b""),
    (("--raw", "-p", "-"), b"\n\n"),
])
def test_an_empty_prompt_is_refused(tiny, env, args, stdin):
    proc = run_in_process("generate", str(tiny), *args, env=env, input=stdin)
    assert_one_line_error(proc, "the prompt is empty")


def test_invalid_utf8_on_stdin_names_the_byte(tiny, env):
    proc = run("generate", str(tiny), "-p", "-", env=env, input=b"hello \xff\xfe world")
    assert_one_line_error(proc, "stdin is not valid UTF-8", "at byte 6")


def test_a_long_stdin_prompt_shows_progress_and_is_refused_fast(tiny, env):
    """1 MB on stdin: a progress notice at once (stderr is not a terminal: one plain line), then the context check
    refuses it after counting a small part, with the estimate; no reply, no traceback."""
    start = time.monotonic()
    proc = run("generate", str(tiny), "-p", "-", env=env, input=("word " * 200_000).encode(), timeout=120)
    elapsed = time.monotonic() - start
    lines = error_lines(proc)
    assert proc.returncode == 2, lines
    assert len(lines) == 2 and lines[0].startswith("tokenizing a long prompt (1,000,"), lines
    assert lines[1].startswith("error: the prompt is about ") and "estimated from its first" in lines[1], lines
    assert b"Traceback" not in proc.stderr and proc.stdout == b""
    assert elapsed < 30, elapsed


# -- bench: flags, context and memory ---------------------------------------------------------------------
# In this process: these are checks of the flags (-b 0, -p 0 and -r 0 are in tests/bench/test_bench_cli.py);
# the refusal below them runs the real process.

@pytest.mark.parametrize("flags, needles", [
    (("-b", "-4"), ("batch size",)), (("-n", "-1"), ("generation length",)), (("-d", "-1"), ("depth",)),
    (("-r", "1000000000"), ("invalid repetitions 1000000000", "between 1 and")),
    (("--warmup", "99999999"), ("invalid warmup",)), (("--seed", "-1"), ("invalid seed -1",)),
    (("--bandwidth", "inf"), ("invalid bandwidth inf",)), (("--bandwidth", "nan"), ("invalid bandwidth nan",)),
    (("-p", "1-100000000"), ("more than",)),
    (("-p", "600"), ("needs 728 tokens of context", f"holds {CONTEXT}", "lower -d, --prefix-cache, -p or -n")),
])
def test_bench_flags_are_refused_with_one_line(tiny, env, flags, needles):
    proc = run_in_process("bench", str(tiny), *flags, env=env)
    assert_one_line_error(proc, *needles)
    assert proc.stdout == ""


def test_bench_batch_beyond_memory_is_refused_with_its_estimate(tiny, env):
    """The reported case: bench -b 100000 was ended by the OOM killer. The tiny model's KV cache is 512 bytes a
    token (2 layers x 2 kv heads x 16 dims x K,V x float32), so 10^7 sequences of 384 tokens (512 with mlx-lm's
    256-token steps) need ~2.6 TB."""
    start = time.monotonic()
    proc = run("bench", str(tiny), "-b", "10000000", "-p", "256", "-n", "128", env=env)
    line = assert_one_line_error(proc, "pp256+tg128 x b10000000", "of KV cache", "available",
                                 "lower -b, -p, -n or -d")
    assert "~2,621.4 GB of KV cache" in line or "~1,310.7 GB of KV cache" in line, line  # float32 or 16-bit
    assert time.monotonic() - start < 30


def test_kv_estimate_from_the_config():
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token(llama8b, 2) == 2 * 32 * 8 * 128 * 2  # 128 KiB a token in float16
    nested = {"text_config": {**llama8b, "head_dim": 256}}
    assert kv_bytes_per_token(nested, 2) == 2 * 32 * 8 * 256 * 2
    assert kv_bytes_per_token({"num_hidden_layers": 2}, 2) is None  # not enough to say: no estimate


def test_check_memory_counts_batch_depth_prompt_and_generation(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    case = Case("batch", prompt=200, gen=50, depth=6, batch=4)  # 256 tokens a sequence, one KV step
    need = check_memory("m", tmp_path, cfg, [case], on_cpu=True, available=(10**9, "test"))
    assert need == int((2 * 2 * 2 * 16 * 4 * 256 * 4 + 1000) * 1.1)
    with pytest.raises(InvalidParameter, match=r"x b4 on m needs ~0.5 MB of KV cache \+ 0.0 MB of weights, 0.5 MB available"):
        check_memory("m", tmp_path, cfg, [case], on_cpu=True, available=(500_000, "test"))


def test_available_memory_is_read_from_the_system():
    found = available_memory()
    assert found is not None and found[0] > 0


def test_bench_reads_a_big_prompt_file_only_as_far_as_needed(tiny_hf, env, tmp_path):
    """A 1 MB --prompt-file: only the tokens the tests need are made, quickly, and transformers' 'longer than the
    maximum sequence length' warning never reaches stderr."""
    import json

    model = tiny_hf
    text = tmp_path / "prompt.txt"
    text.write_text("lorem ipsum " * 90_000)
    start = time.monotonic()
    proc = run("bench", str(model), "-p", "32", "-n", "4", "-r", "1", "--warmup", "0", "--bandwidth", "10",
               "--prompt-file", str(text), "-o", "json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sequence length" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    record = json.loads(proc.stdout)[0]
    assert record["workload"]["prompt_source"].startswith("file prompt.txt")
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("flags, needles", [
    (("-b", "100000"), ("invalid rows (-b) 100000 for --microbench", "at most 4,096")),
    (("-d", "100000000"), ("invalid context (-d) 100000000", "at most 262,144")),
    (("-r", "0"), ("invalid repetitions 0",)),
])
def test_microbench_shapes_are_bounded(env, flags, needles):
    assert_one_line_error(run_in_process("bench", "--microbench", *flags, env=env), *needles)


def test_tokenize_progress_is_a_bar_on_a_terminal_and_one_notice_elsewhere():
    import io

    from rich.console import Console

    from mlxinfer.ui.progress import tokenize_progress

    plain = io.StringIO()
    with tokenize_progress(Console(file=plain, force_terminal=False)) as progress:
        for done in (0, 16_384, 32_768):
            progress("tokenize", done, 1_000_000)
    assert plain.getvalue() == "tokenizing a long prompt (1,000,000 characters)...\n"
    quiet = io.StringIO()
    with tokenize_progress(Console(file=quiet, force_terminal=False)) as progress:
        progress("tokenize", 500, 500)  # a short prompt reports only its end: no notice
    assert quiet.getvalue() == ""
    tty = io.StringIO()
    with tokenize_progress(Console(file=tty, force_terminal=True, width=100)) as progress:
        progress("tokenize", 0, 1_000_000)
        progress("tokenize", 500_000, 1_000_000)
    assert "Tokenizing the prompt" in tty.getvalue()


def test_stdin_beyond_any_context_is_not_read_whole(tiny, env):
    proc = run("generate", str(tiny), "-p", "-", env=env, input=b"a" * ((128 << 20) + 1), timeout=120)
    assert_one_line_error(proc, "the prompt on stdin is over 128 MB")
