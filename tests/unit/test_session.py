"""Session: KV cache reuse across turns, trims for /retry and /undo, interruption, context overflow, save/load.

The model is a tiny random-weight llama with the real SmolLM2 tokenizer and chat template, so turns are fast and
the cache can be checked exactly: after every action the cache must give the same next-token logits as a fresh
prefill of the tokens the session says it holds.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # imports the bundled GGUF once for its tokenizer


@pytest.fixture(scope="module", params=["mlx", "native"])
def tiny(smollm2_dir, request):
    """float32 weights on MLX ops, or 4-bit weights on the native CPU kernels (one op per layer, the KV cache
    written in place: every trim below then exercises its copy-after-trim rule). The native kernels prefill at
    float32 here (the AVX2 int8 prefill off): the cache checks compare a cache built by decode steps with a fresh
    prefill, and int8 prefill x (~3% of a logit on this random model) would hide a wrong position in rounding."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama
    from mlx_lm.utils import load_tokenizer

    from mlxinfer.engine.loader import LoadedModel
    from mlxinfer.kernels.patch import apply_kernels
    from mlxinfer.registry import ModelSpec

    path = smollm2_dir
    tok = load_tokenizer(path)
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=tok.vocab_size, tie_word_embeddings=True)
    net = llama.Model(args)
    kernels = "builtin"
    toggle = None
    if request.param == "native":
        from mlxinfer import native

        if native.extension() is None:
            pytest.skip(native.status())
        toggle = getattr(native.extension(), "set_int8_prefill", None)
        nn.quantize(net, group_size=32, bits=4)
        report = apply_kernels(net, "custom")
        assert "2 decoder layers as one op" in report.detail
        kernels = report.name
    mx.eval(net.parameters())
    before = toggle(False) if toggle is not None else None
    try:
        yield LoadedModel(model=net, tokenizer=tok, config={"max_position_embeddings": 4096}, path=path,
                          spec=ModelSpec(name="tiny", kind="path", path=path), backend="cpu", dtype="float32",
                          kernels=kernels, chat_template=tok.chat_template, eos_token_ids=set(tok.eos_token_ids or []))
    finally:
        if toggle is not None:
            toggle(before)
    apply_kernels(net, "builtin")  # the attention swap is per mlx-lm module


def make_session(tiny, **kw):
    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.session import Session

    params = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 6))
    return Session(tiny, params, **kw)


def run(turn):
    for _ in turn:
        pass
    return turn


def assert_cache_consistent(session):
    """The cache's next-token logits equal a fresh prefill of session._cache_tokens (then undo the probe)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    held = session._cache_tokens
    assert session._cache is not None and held
    assert all(c.offset == len(held) for c in session._cache)
    probe = 42
    warm = session.loaded.model(mx.array([[probe]]), cache=session._cache)[0, -1]
    for c in session._cache:
        c.trim(1)
    cold = session.loaded.model(mx.array([held + [probe]]), cache=make_prompt_cache(session.loaded.model))[0, -1]
    # The native decode matvec rounds x to int16 per group (~3e-5 of the output's scale): a relative bound there.
    tol = 1e-4 if session.loaded.kernels == "builtin" else 1e-3 * mx.abs(cold).max().item()
    assert mx.abs(warm - cold).max().item() <= tol


def test_second_turn_prefills_only_new_tokens(tiny):
    s = make_session(tiny, system="Be brief.")
    t1 = run(s.send("What is the capital of France?"))
    assert t1.reused == 0 and t1.stats.prompt_tokens == len(t1.tokens)
    # the conversation as rendered: prompt + reply, and the reply's end-of-turn tokens the cache takes next turn
    assert 0 <= s.context_used - (len(t1.tokens) + len(t1.stats.tokens)) <= 2
    t2 = run(s.send("And of Italy?"))
    # Everything up to the end of the first reply came from the cache.
    assert t2.reused >= len(t1.tokens) + len(t1.stats.tokens) - 2
    assert t2.stats.prompt_tokens == len(t2.tokens) - t2.reused < len(t2.tokens) // 2
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert_cache_consistent(s)


def test_retry_trims_to_the_prompt_and_regenerates(tiny):
    s = make_session(tiny)
    first = run(s.send("Hello there")).text
    t = run(s.retry())
    assert t.stats.prompt_tokens == 1  # only the last prompt token is fed again
    assert t.text == first  # temperature 0
    assert len(s.messages) == 2
    assert_cache_consistent(s)


def test_undo_drops_the_exchange_and_trims(tiny):
    s = make_session(tiny)
    run(s.send("One"))
    run(s.send("Two"))
    used = s.context_used
    removed = s.undo()
    assert removed == {"role": "user", "content": "Two"}
    assert [m["content"] for m in s.messages][0] == "One" and len(s.messages) == 2
    assert s.context_used < used
    assert_cache_consistent(s)
    t = run(s.send("Three"))
    assert t.reused > 0
    assert_cache_consistent(s)
    assert s.undo() and s.undo() and s.undo() is None and s.messages == []


def test_interrupted_reply_is_kept_and_cache_resynced(tiny):
    s = make_session(tiny, max_tokens=40)
    turn = s.send("Tell me a story")
    for i, _ in enumerate(turn):
        if i == 3:
            turn.cancel()
    assert turn.interrupted and turn.stats.finish_reason == "interrupted"
    assert s.messages[-1] == {"role": "assistant", "content": turn.text, "interrupted": True}
    assert turn.stats.generation_tokens < 40
    assert_cache_consistent(s)
    t2 = run(s.send("Go on"))
    assert t2.reused > 0 and not t2.interrupted
    assert_cache_consistent(s)


def test_breaking_out_of_the_loop_also_interrupts(tiny):
    s = make_session(tiny, max_tokens=40)
    turn = s.send("Tell me a story")
    it = iter(turn)
    next(it)
    next(it)
    it.close()
    assert turn.interrupted and s.messages[-1].get("interrupted")
    assert_cache_consistent(s)


def test_cancel_before_any_text_drops_the_message(tiny):
    s = make_session(tiny)
    run(s.send("First"))
    turn = s.send("Second")
    turn.cancel()
    run(turn)
    assert turn.discarded and [m["content"] for m in s.messages][0] == "First" and len(s.messages) == 2
    # the conversation, not what the cache read of "Second"
    assert s.context_used == len(s.render(generation_prompt=False))


def test_cancel_before_any_text_gives_back_the_turns_dropped_for_the_message(tiny):
    """A long message dropped the oldest turns to fit; Ctrl-C before its reply began dropped the message and kept
    the shortened history (4 messages became 2, and the context count was off)."""
    s = make_session(tiny, system="You are terse.", context=96, max_tokens=8)
    run(s.send("Question one"))
    run(s.send("Question two"))
    history = [dict(m) for m in s.messages]
    turn = s.send("word " * 40)
    assert turn.dropped > 0
    turn.cancel()
    run(turn)
    assert turn.discarded and s.messages == history
    assert_cache_consistent(s)
    t = run(s.send("Question three"))  # and the conversation goes on from there
    assert t.dropped >= 0 and s.messages[-2]["content"] == "Question three"
    assert_cache_consistent(s)


def test_context_overflow_drops_oldest_turns_keeps_system(tiny):
    s = make_session(tiny, system="You are terse.", context=96, max_tokens=8)
    dropped = 0
    for i in range(8):
        t = run(s.send(f"Question number {i} about something"))
        dropped += t.dropped
        assert len(t.tokens) + t.stats.generation_tokens <= 96
    assert dropped > 0
    assert s.messages[0]["role"] == "user"
    assert s.messages[-2]["content"] == "Question number 7 about something"
    assert "You are terse." in tiny.tokenizer.decode(s.render())
    assert_cache_consistent(s)


def test_message_longer_than_the_context_is_refused(tiny):
    from mlxinfer.engine.session import SessionError

    s = make_session(tiny, context=48)
    with pytest.raises(SessionError, match=r"the message takes \d+ tokens with the system prompt and chat template, "
                       r"which leaves no room for a reply in a 48-token context"):
        s.send("word " * 80)  # (it said "needs 48 tokens but the context holds 48" at exactly the limit)
    assert s.messages == []
    with pytest.raises(SessionError, match=r"raise the limit with /set context"):
        s.send("word " * 80)
    whole = make_session(tiny)  # at the model's whole context there is no limit to raise
    full = tiny.context_length
    with pytest.raises(SessionError, match=rf"\(shorten it, or replace the chat template's own system prompt with a "
                                               rf"shorter /system TEXT \({full} tokens is this model's "
                                           r"whole context\)\)"):
        whole.send("word " * (full + 10))


def test_settings_are_validated(tiny):
    from mlxinfer.errors import InvalidParameter

    s = make_session(tiny)
    assert s.set("temp", "0.5") == "temperature" and s.params.temperature == 0.5
    assert s.set("seed", "none") == "seed" and s.params.seed is None
    s.set("context", "512")
    assert s.context_limit == 512
    for name, value in [("temp", "abc"), ("temp", "-1"), ("top_p", "2"), ("context", "10"), ("context", "x"),
                        ("nope", "1")]:
        with pytest.raises(InvalidParameter):
            s.set(name, value)
    assert s.params.temperature == 0.5 and s.context_limit == 512


def test_save_and_load_round_trip(tiny, tmp_path, monkeypatch):
    from mlxinfer.engine import store
    from mlxinfer.engine.session import Session, SessionError

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    s = make_session(tiny, system="Sys", context=256)
    s.set("temp", "0.3")
    run(s.send("Remember the word banana"))
    path = store.save("notes-1", s.to_dict())
    assert path == tmp_path / "mlxinfer" / "sessions" / "notes-1.json"
    assert [p.name for p in path.parent.iterdir()] == ["notes-1.json"]  # no temp files left behind
    assert store.names() == ["notes-1"]
    data = store.load("notes-1")
    back = Session.from_dict(data, tiny)
    assert back.messages == s.messages and back.system == "Sys" and back.context_limit == 256
    assert back.params == s.params and data["model"] == "tiny"
    assert store.list_sessions()[0].messages == 2

    with pytest.raises(SessionError, match="did you mean 'notes-1'"):
        store.load("notes-2")
    for bad in ("../x", ".hidden", "a b", ""):
        with pytest.raises(SessionError):
            store.save(bad, s.to_dict())
    bad = {**data, "settings": {"temperature": "hot"}}
    with pytest.raises(SessionError, match="settings are invalid"):
        Session.from_dict(bad, tiny)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(SessionError, match="not an mlxinfer session"):
        store.load("notes-1")


def test_a_damaged_session_file_says_how_to_get_past_it(tmp_path, monkeypatch):
    from mlxinfer.engine import store
    from mlxinfer.engine.session import SessionError

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    path = store.sessions_dir() / "bad.json"
    path.parent.mkdir(parents=True)
    for damage in (b"{bad", b'{"messages": "caf\xe9"}'):
        path.write_bytes(damage)
        with pytest.raises(SessionError, match=r"session .*bad\.json is damaged \(.+\) \(repair or delete that "
                                               r"file, or use another session name\)"):
            store.load("bad")
    # JSON of the right format, but not a session /load takes ("messages" not a list): listed as unreadable
    path.write_text(json.dumps({"format": "mlxinfer.session", "version": 1, "messages": "nope"}))
    assert [(i.name, i.model, i.messages) for i in store.list_sessions()] == [("bad", "unreadable", 0)]
    # a system prompt that is not text loaded, and then every message failed; an unknown think mode likewise
    good = {"format": "mlxinfer.session", "version": 1, "messages": []}
    for damage, said in (({"system": 123}, "system prompt must be text"), ({"think": "maybe"}, "think mode")):
        path.write_text(json.dumps({**good, **damage}))
        with pytest.raises(SessionError, match=said):
            store.load("bad")


def test_cancel_during_prefill_stops_at_a_chunk_boundary(tiny):
    from mlxinfer.engine.session import CHAT_PREFILL_STEP

    s = make_session(tiny)
    turn = s.send("word " * (2 * CHAT_PREFILL_STEP))
    seen = []

    def progress(done, total):
        seen.append(done)
        if done >= CHAT_PREFILL_STEP:
            turn.cancel()

    turn.on_prefill = progress
    run(turn)
    assert seen == [0, CHAT_PREFILL_STEP] and turn.stats is None  # stopped after the first chunk
    assert turn.discarded and s.messages == []
    # The chunk already computed stays in the cache, to be reused if the message is sent again, but the
    # conversation takes none of it (/show said "messages 0" and "context used 2176/8192").
    assert len(s._cache_tokens) == CHAT_PREFILL_STEP and s.context_used == 0
    assert_cache_consistent(s)
    again = s.send("word " * (2 * CHAT_PREFILL_STEP))
    assert again.reused == CHAT_PREFILL_STEP


class Flaky:
    """The tiny model, raising ``error`` on its ``fail_at``-th call (1 = the prefill of the first chunk)."""

    def __init__(self, inner, fail_at, error=None):
        self.inner, self.calls, self.fail_at = inner, 0, fail_at
        self.error = error or RuntimeError("boom\nsecond line")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [1, 4])
def test_an_error_during_generation_undoes_the_turn(tiny, fail_at):
    """Failing in the prefill or mid-reply: the exception reaches the caller, the messages and the cache are back
    to before the turn (the cache trimmed to its reused prefix, not thrown away), and the next turn works."""
    import dataclasses

    s = make_session(tiny, max_tokens=20)
    run(s.send("Hello"))
    before, held = [dict(m) for m in s.messages], list(s._cache_tokens)
    flaky = Flaky(tiny.model, fail_at)
    s.loaded = dataclasses.replace(tiny, model=flaky)
    turn = s.send("Tell me more")
    with pytest.raises(RuntimeError, match="boom"):
        run(turn)
    assert flaky.calls == fail_at
    assert turn.error is not None and not turn.interrupted and not turn.discarded
    assert s.messages == before
    assert s._cache_tokens == turn.tokens[:turn.reused] and turn.reused > 0
    assert s._cache_tokens == held[:turn.reused]
    assert_cache_consistent(s)
    s.loaded = tiny
    t = run(s.send("Tell me more"))
    assert t.error is None and not t.interrupted and t.reused == turn.reused
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 2
    assert_cache_consistent(s)


def test_a_failed_retry_keeps_the_reply_it_was_replacing(tiny):
    import dataclasses

    s = make_session(tiny)
    run(s.send("Hello"))
    before = [dict(m) for m in s.messages]
    s.loaded = dataclasses.replace(tiny, model=Flaky(tiny.model, 1))
    with pytest.raises(RuntimeError):
        run(s.retry())
    assert s.messages == before
    s.loaded = tiny
    run(s.retry())
    assert len(s.messages) == 2 and s.messages[0] == before[0]
    assert_cache_consistent(s)


def test_a_sampler_error_does_not_break_later_sampling(tiny, monkeypatch):
    """The reported failure: a value mlx-lm's compiled sampler refused left MLX's random state broken, and every
    later message failed ("[eval] Attempting to eval an array without a primitive") even after a fix and
    /clear. Validation now stops such values first, so the sampler is made to refuse one here."""
    import mlx_lm.sample_utils as su

    import mlxinfer.engine.generate as gen

    s = make_session(tiny, max_tokens=5)
    s.set("temp", "0.8")
    monkeypatch.setattr(gen, "make_sampler", lambda params: lambda x: su.apply_min_p(x, 2.0))
    turn = s.send("Hello")
    with pytest.raises(ValueError, match="min_p"):
        run(turn)
    assert turn.error is not None and s.messages == []
    monkeypatch.undo()
    s.clear()
    t = run(s.send("Hello"))
    assert t.error is None and t.stats.generation_tokens > 0 and len(s.messages) == 2


def test_terminated_keeps_the_exchange_even_before_the_first_token(tiny):
    """SIGTERM (Terminated) inside the model call: the chat saves and exits, so the user's message is kept with
    an empty reply marked interrupted rather than dropped (Ctrl-C at that point drops it)."""
    import dataclasses

    from mlxinfer.errors import Terminated

    s = make_session(tiny)
    s.loaded = dataclasses.replace(tiny, model=Flaky(tiny.model, 1, Terminated(15)))
    turn = s.send("Hello")
    with pytest.raises(Terminated):
        run(turn)
    assert turn.terminated and turn.interrupted and not turn.discarded and turn.error is None
    assert s.messages == [{"role": "user", "content": "Hello"},
                          {"role": "assistant", "content": "", "interrupted": True}]
    s.loaded = dataclasses.replace(tiny, model=Flaky(tiny.model, 1, KeyboardInterrupt()))
    s.clear()
    turn = s.send("Hello")
    with pytest.raises(KeyboardInterrupt):
        run(turn)
    assert turn.discarded and s.messages == []
    s.loaded = tiny
    s.send("Sent just before SIGTERM")  # the turn never ran
    s.keep_unanswered()
    assert s.messages[-1] == {"role": "assistant", "content": "", "interrupted": True}
    s.keep_unanswered()
    assert len(s.messages) == 2


def test_settings_are_checked_against_the_model(tiny):
    from mlxinfer.errors import InvalidParameter

    s = make_session(tiny)
    vocab = tiny.tokenizer.vocab_size
    s.set("top_k", str(vocab))  # all tokens: allowed (the sampler treats it as off)
    for name, value, needle in [
        ("top_k", str(vocab + 1), f"between 0 and {vocab}"), ("top_k", "1000000000", "vocabulary"),
        ("max_tokens", "4097", "between 1 and 4096"), ("seed", "1" * 23, "between 0 and 18446744073709551615"),
        ("repeat_context", "5000", "between 1 and 4096"), ("min_p", "nan", "[0, 1]"),
        ("repeat_penalty", "inf", "> 0"), ("context", "4097", "between 32 and 4096"),
    ]:
        with pytest.raises(InvalidParameter, match=name) as e:
            s.set(name, value)
        line = str(e.value)
        assert needle in line and "\n" not in line, line
    assert s.params.top_k == vocab and s.context_limit == 4096


def test_switching_to_a_model_the_settings_do_not_fit_changes_nothing(tiny):
    import dataclasses

    from mlxinfer.errors import InvalidParameter

    s = make_session(tiny)
    run(s.send("Hello"))  # a short reply: only the cache and the setting matter here
    s.set("max_tokens", "3000")
    small = dataclasses.replace(tiny, config={"max_position_embeddings": 1024})
    with pytest.raises(InvalidParameter, match="max_tokens 3000"):
        s.switch_model(small)
    assert s.loaded is tiny and s._cache is not None


def test_a_resumed_session_reports_the_context_its_history_takes(tiny):
    """Issue #16: after --session NAME, /show said 0 tokens used (the cache is filled on the first turn)."""
    from mlxinfer.engine.session import Session

    s = make_session(tiny, system="Sys")
    run(s.send("Remember the word banana"))
    used = s.context_used
    back = Session.from_dict(s.to_dict(), tiny)
    assert back._cache is None
    assert back.context_used == len(back.render(generation_prompt=False)) and abs(back.context_used - used) <= 8
    assert make_session(tiny).context_used == 0


def test_session_lock_is_exclusive_and_released(tmp_path, monkeypatch):
    """flock locks belong to an open file, so two locks in one process conflict like two processes do."""
    from mlxinfer.engine import store

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    data = {"format": "mlxinfer.session", "version": 1, "model": "m", "settings": {}, "messages": []}
    lock = store.SessionLock.acquire("s")
    assert store.lock_path("s").read_text().strip() == str(__import__("os").getpid())
    with pytest.raises(store.SessionBusy, match=r"session 's' is open in another mlxinfer \(pid \d+\)"):
        store.SessionLock.acquire("s")
    store.save("s", data)  # the holder itself may save
    lock.release()
    assert not store.lock_path("s").exists()
    with store.SessionLock.acquire("s") as again:
        assert again.held
    store.lock_path("s").write_text("1\n")  # a live process that is not us (pid 1) has it open
    with pytest.raises(store.SessionBusy, match=r"pid 1\)"):
        store.save("s", data)
    store.lock_path("s").write_text("999999999\n")  # a stale file from a dead process does not block
    store.save("s", data)
    store.SessionLock.acquire("s").release()


def test_default_settings_fit_a_short_context_model(tiny):
    """A model with a context below the built-in max_tokens default (512) still gets a session without flags."""
    import dataclasses

    from mlxinfer.engine.session import Session

    short = dataclasses.replace(tiny, config={"max_position_embeddings": 256})
    s = Session(short)
    assert s.params.max_tokens == 256 and s.context_limit == 256


@pytest.mark.parametrize("name, said", [
    ("my chat", "invalid session name 'my chat' (try 'my-chat'; a name is"),
    ("notes.json", "(try 'notes';"),
    ("café", "invalid session name 'café' (a name is"),  # no 'caf'
    ("x" * 300, "invalid session name '" + "x" * 40 + "…' (a name is"),  # not repeated whole
])
def test_an_invalid_session_name_gets_a_likely_one(name, said):
    from mlxinfer.engine.session import SessionError
    from mlxinfer.engine.store import check_name

    with pytest.raises(SessionError) as e:
        check_name(name)
    assert said in f"{e.value} ({e.value.hint})", f"{e.value} ({e.value.hint})"
