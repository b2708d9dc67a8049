"""--kv-bits / --max-kv-size: validation and precedence, the caches made, the native CPU path stepping aside
(same tokens as MLX's built-in layers with the same cache), chat sessions past the cap, and the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mlxinfer.engine.kv_options import KVOptions, make_cache, maybe_quantize, resolve
from mlxinfer.errors import InvalidParameter

MLXINFER = [sys.executable, "-m", "mlxinfer"]


@pytest.mark.parametrize("opts, needle", [
    (KVOptions(bits=3), "invalid --kv-bits 3: use 4 or 8"),
    (KVOptions(bits=True), "invalid --kv-bits True"),
    (KVOptions(bits=8, group_size=48), "invalid KV group size 48"),
    (KVOptions(max_size=31), "invalid --max-kv-size 31: must be between 32 and"),
    (KVOptions(bits=8, max_size=64), "cannot be combined"),
    (KVOptions(bits=8, quantized_start=-1), "quantized KV start"),
])
def test_invalid_options_are_one_clear_error(opts, needle):
    with pytest.raises(InvalidParameter) as e:
        opts.validate()
    assert needle in str(e.value)


def test_max_size_is_checked_against_the_context():
    KVOptions(max_size=128).validate(128)
    with pytest.raises(InvalidParameter, match="between 32 and 128"):
        KVOptions(max_size=129).validate(128)


def test_precedence_registry_session_flags():
    assert resolve({"kv_bits": 4}, None, None) == KVOptions(bits=4)
    assert resolve({"kv_bits": 4}, {"kv_bits": 8}, None) == KVOptions(bits=8)
    assert resolve({"kv_bits": 4}, {"kv_bits": 8}, {"kv_bits": None, "max_kv_size": None}) == KVOptions(bits=8)
    assert resolve(None, {"max_kv_size": 64, "temperature": 0.3}, {"max-kv-size": 96}) == KVOptions(max_size=96)
    assert KVOptions(bits=8).as_dict()["kv_bits"] == 8
    # one kind of cache per layer: a flag for the other kind replaces what the session or registry chose
    assert resolve({"kv_bits": 4}, {"max_kv_size": 64}, None) == KVOptions(max_size=64)
    assert resolve(None, {"max_kv_size": 64}, {"kv_bits": 8}) == KVOptions(bits=8)
    with pytest.raises(InvalidParameter, match="cannot be combined"):
        resolve(None, None, {"kv_bits": 8, "max_kv_size": 64})


def _tiny(quantized: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    mx.random.seed(1)
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           tie_word_embeddings=True)
    net = llama.Model(args)
    if quantized:
        nn.quantize(net, group_size=32, bits=4)
    mx.eval(net.parameters())
    return net


def _greedy(net, prompt, n, opts):
    from mlxinfer.engine.steps import token_steps

    cache = make_cache(net, opts)
    steps = token_steps(net, prompt, cache=cache, sampler=lambda logits: logits.argmax(axis=-1), greedy=True,
                        max_tokens=n, prefill_step_size=16,
                        after_call=(lambda c: maybe_quantize(c, opts)) if opts and opts.quantized_start else None)
    return list(steps), cache


def test_caches_made_and_8bit_close_to_full_precision():
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    net = _tiny(quantized=False)
    prompt = list(range(3, 43))
    assert all(type(c) is KVCache for c in make_cache(net, KVOptions()))
    full, _ = _greedy(net, prompt, 8, None)
    q8, cache = _greedy(net, prompt, 8, KVOptions(bits=8))
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in cache)
    assert q8[:4] == full[:4]
    _, cache = _greedy(net, prompt, 40, KVOptions(max_size=32))  # 80 tokens through a 32-token window
    assert [(type(c).__name__, c.offset) for c in cache] == [("RotatingKVCache", 80)] * 2
    _, cache = _greedy(net, prompt, 4, KVOptions(bits=4, quantized_start=30))  # quantized once it holds 30
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 4 for c in cache)


def test_a_head_dim_the_group_does_not_divide_is_refused():
    from mlx_lm.models import llama

    net = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      vocab_size=32, head_dim=48))
    with pytest.raises(InvalidParameter, match="heads have 48 dimensions"):
        make_cache(net, KVOptions(bits=8))
    make_cache(net, KVOptions(max_size=64))


def test_a_backend_without_quantized_attention_is_refused_before_generating(monkeypatch):
    # MLX 0.32.4 on CUDA (an H200) raised this when evaluating attention over a QuantizedKVCache: the probe at
    # cache creation turns it into one clear line instead of a failure mid-generation.
    from mlx_lm.models import base

    from mlxinfer.engine import kv_options

    def unsupported(q, keys, values, **kw):
        import mlx.core as mx

        return mx.zeros(q.shape) if q.shape[2] == 1 else _fails()

    def _fails():
        raise RuntimeError('[quantized_matmul] No implementation for problem shape: 1x33x64x4, transpose: true')

    net = _tiny(quantized=False)
    kv_options.quantized_attention_problem.cache_clear()
    try:
        assert kv_options.quantized_attention_problem(64, 32, 8) is None  # this machine's MLX runs it
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", unsupported)
        kv_options.quantized_attention_problem.cache_clear()
        with pytest.raises(InvalidParameter, match=r"--kv-bits does not work .*No implementation for problem shape"):
            make_cache(net, KVOptions(bits=8))  # decode worked, the 16-query prefill did not
        make_cache(net, KVOptions(max_size=64))  # other caches are unaffected
    finally:
        kv_options.quantized_attention_problem.cache_clear()


def test_a_model_whose_head_dim_is_unknown_gets_a_quantized_cache_at_any_group_size():
    # No model args to read the head dim from: the probe must not build keys the group cannot split.
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    class NoArgs:
        layers = [object()]

        def make_cache(self):
            return [KVCache()]

    for group in (32, 64, 128):
        cache = make_cache(NoArgs(), KVOptions(bits=8, group_size=group))
        assert isinstance(cache[0], QuantizedKVCache) and cache[0].group_size == group


def test_a_model_without_plain_kv_cache_is_refused():
    from mlx_lm.models.cache import ArraysCache

    class Recurrent:
        layers = [object()]

        def make_cache(self):
            return [ArraysCache(2)]

    with pytest.raises(InvalidParameter, match="--kv-bits does not apply to this model.*ArraysCache"):
        make_cache(Recurrent(), KVOptions(bits=8))
    assert isinstance(make_cache(Recurrent(), KVOptions())[0], ArraysCache)


@pytest.mark.parametrize("opts", [KVOptions(bits=8), KVOptions(max_size=32)], ids=["8bit", "rotating"])
def test_native_path_steps_aside_and_matches_builtin(opts):
    """The one-op layers write a float cache in place: with these caches they must decline and the tokens be the
    built-in layers' ones, and the kernel note must say so."""
    from mlxinfer import native
    from mlxinfer.engine.kv_options import kernel_note
    from mlxinfer.kernels.patch import apply_kernels

    if native.extension() is None:
        pytest.skip(native.status())
    net = _tiny(quantized=True)
    prompt = list(range(5, 45))
    builtin, _ = _greedy(net, prompt, 30, opts)
    assert kernel_note(net, opts) is None
    report = apply_kernels(net, "custom")
    try:
        assert "2 decoder layers as one op" in report.detail
        custom, _ = _greedy(net, prompt, 30, opts)
        note = kernel_note(net, opts)
    finally:
        apply_kernels(net, "builtin")
    assert custom == builtin
    assert note.startswith(f"KV cache {opts.describe()}: 2 one-op decoder layers step aside")
    assert ("MLX's built-in quantized attention" in note) == (opts.bits is not None)


@pytest.fixture(scope="module")
def smollm2_auto(smollm2_dir):
    """The bundled model with the kernels a user gets (native on this CPU when built): the caches of these options
    run through its fallbacks, and it is several times faster than the built-in layers."""
    import mlxinfer

    return mlxinfer.load("smollm2", kernels="auto")


@pytest.mark.slow
def test_session_goes_past_the_cap_and_saves_its_kv_settings(smollm2_auto):
    smollm2 = smollm2_auto
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.session import Session

    s = Session(smollm2, SamplingParams(temperature=0.0, max_tokens=10), kv=KVOptions(max_size=40))
    for text in ("Hi there, tell me a story.", "More, please."):
        turn = s.send(text)
        list(turn)
        assert turn.error is None and turn.stats.finish_reason in ("stop", "length")
    assert s.context_used > 40 and all(isinstance(c, RotatingKVCache) for c in s._cache)
    data = json.loads(json.dumps(s.to_dict()))
    assert data["settings"]["max_kv_size"] == 40 and data["settings"]["kv_bits"] is None
    back = Session.from_dict(data, smollm2)
    assert back.kv == KVOptions(max_size=40)
    list(back.send("Thanks."))
    assert back.messages[-1]["role"] == "assistant"
    # /set names in /set's messages (they said "--kv-bits", the command-line flag)
    with pytest.raises(InvalidParameter, match=r"kv_bits and max_kv_size cannot be combined .*\(turn the other off "
                                               r"first: /set max_kv_size off\)"):
        back.set("kv-bits", "8")  # with max_kv_size still set: refused, nothing changed
    with pytest.raises(InvalidParameter, match=r"^invalid kv_bits 3: use 4 or 8"):
        back.set("kv_bits", "3")
    assert back.kv == KVOptions(max_size=40) and back._cache is not None
    back.set("max_kv_size", "off")
    back.set("kv-bits", "8")
    assert back.kv == KVOptions(bits=8) and back._cache is None
    list(back.send("Bye."))
    assert all(isinstance(c, QuantizedKVCache) for c in back._cache)


@pytest.mark.slow
def test_8bit_greedy_keeps_the_answer(smollm2_auto):
    smollm2 = smollm2_auto
    from mlxinfer.engine.generate import stream_generate
    from mlxinfer.engine.prompts import chat_prompt
    from mlxinfer.engine.sampling import SamplingParams

    # Not "...of France?": its first two tokens are 0.08 apart at float32 and 0.003 apart on MLX's own 8-bit KV
    # path, so any float32-grade change to the prefill decides them (Dec 6: the AMX prefill picks "L'" there, the
    # int16 GEMM "The"). Germany's answer leads by 0.55-0.66 on every path, more than 8-bit KV moves it (~0.2).
    tokens = chat_prompt(smollm2, [{"role": "user", "content": "What is the capital of Germany?"}])
    params = SamplingParams(temperature=0.0, max_tokens=8)
    full = [r for r in stream_generate(smollm2, tokens, params)][-1].stats.tokens
    q8 = [r for r in stream_generate(smollm2, tokens, params, kv=KVOptions(bits=8))][-1].stats.tokens
    assert q8[:6] == full[:6]


@pytest.mark.slow
def test_cli_generate_with_kv_bits_json_and_refusals():
    env = {**os.environ, "MLXINFER_KERNELS": "auto"}
    run = lambda *a: subprocess.run([*MLXINFER, *a], capture_output=True, text=True, timeout=300, env=env,  # noqa: E731
                                    stdin=subprocess.DEVNULL)
    p = run("generate", "smollm2", "-p", "What is the capital of Germany?", "--temp", "0", "-n", "12",
            "--kv-bits", "8", "--json")  # not France: see test_8bit_greedy_keeps_the_answer
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "Berlin" in out["text"] and out["kv_cache"]["kv_bits"] == 8
    if out["kernels"] != "builtin":
        assert "step aside" in out["kv_cache"]["kernel_note"]
    from in_process import run_in_process  # refused before loading: no subprocess needed

    for args, needle in ((("--kv-bits", "3"), "invalid --kv-bits 3"),
                         (("--kv-bits", "8", "--max-kv-size", "64"), "cannot be combined")):
        p = run_in_process("generate", "smollm2", "-p", "hi", *args, env={"MLXINFER_KERNELS": "auto"})
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], p.stderr


@pytest.mark.slow
def test_cli_chat_session_past_the_cap_then_resumed_with_another_cache(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state")}

    def chat(stdin: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([*MLXINFER, "chat", "smollm2", "--plain", "--session", "kvs", "--temp", "0", "-n",
                               "16", *flags], input=stdin, capture_output=True, text=True, timeout=300, env=env)

    p = chat("Hello, who are you?\nTell me more about that.\n/show\n", "--max-kv-size", "32")
    assert p.returncode == 0 and "error" not in p.stderr.lower(), p.stderr
    shown = p.stdout + p.stderr  # plain mode: replies on stdout, tables and notices on stderr
    used = int(re.search(r"context used\s+(\d+)/", shown)[1])
    assert used > 32 and re.search(r"KV cache\s+at most 32 tokens \(rotating\)", shown)
    # Said once when the window first rotates (the chat went on without a word; the stats line: below).
    assert shown.count("the KV cache window is full: the model now sees the last 32 tokens") == 1, shown
    saved = json.loads((tmp_path / "data" / "mlxinfer" / "sessions" / "kvs.json").read_text())
    assert saved["settings"]["max_kv_size"] == 32 and len(saved["messages"]) == 4

    p = chat("And then?\n/show\n", "--kv-bits", "8")  # a flag for the other kind of cache replaces the saved one
    assert p.returncode == 0 and "error" not in p.stderr.lower(), p.stderr
    shown = p.stdout + p.stderr
    assert re.search(r"kv_bits\s+8", shown) and re.search(r"max_kv_size\s+off", shown)
    saved = json.loads((tmp_path / "data" / "mlxinfer" / "sessions" / "kvs.json").read_text())
    assert saved["settings"]["kv_bits"] == 8 and saved["settings"]["max_kv_size"] is None
    assert len(saved["messages"]) == 6


def test_the_stats_line_names_a_full_window():
    """--max-kv-size 64: the stats line climbed 'context 65/8192' ... '154/8192' with no sign of the window."""
    from types import SimpleNamespace

    from mlxinfer.ui.console_out import stats_text

    stats = SimpleNamespace(generation_tokens=5, generation_tps=10.0, prompt_tokens=3, prompt_tps=30.0, ttft=0.1,
                            peak_memory=2**20, finish_reason="stop")
    assert " · context 154/8192, window 64 · " in stats_text(stats, context=(154, 8192), window=64)
    assert " · context 40/8192 · " in stats_text(stats, context=(40, 8192))
    one = SimpleNamespace(**{**vars(stats), "generation_tokens": 1, "generation_tps": 0.0})
    assert stats_text(one).startswith("1 token · prompt 3 tokens 30.0 tok/s")  # not "1 token 0.0 tok/s"
