"""The scheduler in this process (no HTTP): what it asks of the model, counted through a wrapper, not timed.

* a burst of fresh prompts is prefilled as one left-padded batched forward, and decodes to the same greedy text
  as each prompt alone; so is a burst continuing prefix-cache hits (only its new tokens);
* while streams decode, a burst's prefill goes in rounds of ``prefill_chunk`` tokens per waiting prompt per
  decoding stream, with decode steps between them;
* decode is pipelined: step N+1 is handed to the model before step N's token is pushed to its client, and a
  sequence ending by its token budget costs no step past it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import mlxinfer
from mlxinfer.engine.prompts import encode_prompt
from mlxinfer.serve import schemas as s
from mlxinfer.serve.metrics import Metrics
from mlxinfer.serve.scheduler import Engine
from mlxinfer.serve.sequence import Ticket

PROMPTS = ["The sky is", "Once upon a time in a land far away, there lived a", "1, 2, 3,", "Paris is the capital of"]


@pytest.fixture(scope="module")
def loaded():
    return mlxinfer.load("smollm2")


class Recorder:
    """The real model, with every forward's input shape (and each ticket push) logged in order."""

    def __init__(self, model, log: list, on_call=None):
        self._model, self._log, self._on_call = model, log, on_call

    def __getattr__(self, name):  # layers, make_cache... as the real model's
        return getattr(self._model, name)

    def __call__(self, inputs, *args, **kwargs):
        self._log.append(("call", tuple(inputs.shape)))
        if self._on_call is not None:
            self._on_call(len([e for e in self._log if e[0] == "call"]))
        return self._model(inputs, *args, **kwargs)


class LoggedTicket(Ticket):
    def __init__(self, job, loop, queue, log):
        super().__init__(job, loop, queue)
        self._log = log

    def push(self, event: tuple) -> None:
        self._log.append(("push", event[0]))
        super().push(event)


def _job(loaded, text: str, n: int) -> s.Job:
    return s.Job("completion", encode_prompt(loaded, text), mlxinfer.SamplingParams(temperature=0), n)


def _run(loaded, texts: list[str], n: int, *, later: list[str] = (), after_calls: int = 0, cancel_at: int = 0,
         stored: str = "", **engine_kw):
    """Submit ``texts`` before the engine starts (they wait together); ``later`` ones from inside the model's
    ``after_calls``-th forward; at forward ``cancel_at`` the second request's client goes away; ``stored``: a
    prompt whose KV cache is in the prefix cache first. Returns (texts in order, None for a cancelled one; the
    log; the engine)."""
    log: list = []
    tickets: list = []
    engine = None
    if stored:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        tokens, cache = encode_prompt(loaded, stored), make_prompt_cache(loaded.model)
        loaded.model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])

    def on_call(count: int) -> None:
        if later and count == after_calls:
            for t in tickets[len(texts):]:
                engine.submit(t)
        if count == cancel_at:
            engine.cancel(tickets[1])

    model = Recorder(loaded.model, log, on_call)
    engine = Engine(dataclasses.replace(loaded, model=model), Metrics(), **engine_kw)
    if stored:
        engine.prefix.store(tokens, cache)

    async def go() -> list[str]:
        loop = asyncio.get_running_loop()
        for text in [*texts, *later]:
            tickets.append(LoggedTicket(_job(loaded, text, n), loop, asyncio.Queue(), log))
        for t in tickets[:len(texts)]:
            engine.submit(t)
        engine.start()
        out = []
        for t in tickets:
            if cancel_at and t is tickets[1]:
                out.append(None)
                continue
            pieces = []
            while True:
                event = await asyncio.wait_for(t.queue.get(), 120)
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "done":
                    break
                else:
                    raise AssertionError(event)
            out.append("".join(pieces))
        return out

    try:
        return asyncio.run(go()), log, engine
    finally:
        engine.stop()


def _alone(loaded, text: str, n: int) -> str:
    return mlxinfer.generate(loaded, encode_prompt(loaded, text), mlxinfer.SamplingParams(temperature=0, max_tokens=n),
                             completion=True)  # the scheduler's jobs here are completions: their first space stays


def test_a_burst_is_prefilled_in_one_batched_forward_and_decodes_as_each_alone(loaded):
    out, log, _ = _run(loaded, PROMPTS, 8, parallel=8)
    calls = [shape for kind, shape in log if kind == "call"]
    longest = max(len(encode_prompt(loaded, p)) for p in PROMPTS)
    assert calls[0] == (len(PROMPTS), longest - 1)  # every prompt but its last token, left-padded, at once
    assert all(shape == (len(PROMPTS), 1) for shape in calls[1:])  # then batched decode steps only
    assert out == [_alone(loaded, p, 8) for p in PROMPTS]


def test_a_burst_of_prefix_cache_hits_prefills_only_its_new_tokens_together(loaded):
    """Requests sharing a stored prefix (a system prompt, an earlier turn) continue from it in one batched
    forward over their new tokens only (right-padded to one width), and decode as each alone."""
    shared = "You are a concise assistant. Answer in one line. Question:"
    texts = [f"{shared} {p}" for p in PROMPTS]
    out, log, engine = _run(loaded, texts, 8, parallel=8, prefix_cache_bytes=64 << 20, stored=shared)
    calls = [shape for kind, shape in log if kind == "call"]
    stored = encode_prompt(loaded, shared)
    hits = [next(i for i, (a, b) in enumerate(zip([*stored, None], encode_prompt(loaded, t))) if a != b)
            for t in texts]  # where each prompt's tokens leave the stored ones
    new = [len(encode_prompt(loaded, t)) - 1 - n for t, n in zip(texts, hits)]
    assert min(hits) >= len(stored) - 1 and engine.prefix.reused_tokens == sum(hits)
    assert calls[0] == (len(texts), max(new))  # the new tokens of every prompt at once, not 4 single prefills
    assert all(shape == (len(texts), 1) for shape in calls[1:])
    assert out == [_alone(loaded, t, 8) for t in texts]


def test_a_cold_burst_sharing_a_start_prefills_it_once(loaded):
    """Fresh prompts arriving together with one long start (a system prompt) and nothing stored: the start is
    prefilled once (one forward of its tokens alone), then the rest of every prompt in one batched forward from
    it; the metrics count each prompt token once, and each reply is the one it gets alone."""
    shared = ("You are a concise assistant. Answer every question in one short line, without any preamble or "
              "apology. Question:")
    texts = [f"{shared} {p}" for p in PROMPTS]
    out, log, engine = _run(loaded, texts, 8, parallel=8, prefix_cache_bytes=64 << 20)
    calls = [shape for kind, shape in log if kind == "call"]
    prompts = [encode_prompt(loaded, t) for t in texts]
    start = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)  # where the prompts part
    assert start >= 16
    assert calls[0] == (1, start)  # the shared start alone, once
    assert calls[1] == (len(texts), max(len(p) - 1 - start for p in prompts))  # then only what follows it
    assert all(shape == (len(texts), 1) for shape in calls[2:])
    assert engine.prefix.hits == len(texts) and engine.prefix.reused_tokens == start * len(texts)
    metrics = engine.metrics
    assert metrics.prefill_tokens._value.get() == start + sum(len(p) - start for p in prompts)
    assert out == [_alone(loaded, t, 8) for t in texts]


def test_a_failing_shared_start_prefill_is_skipped_counted_and_told_once(loaded, monkeypatch):
    """The shared-start prefill is an optimisation: when it raises, the burst prefills every prompt whole (one
    batched forward), the replies are unchanged, /metrics counts the error under its stage, and the operator gets
    one warning line for it, however often it recurs."""
    from mlxinfer.serve import scheduler

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory in the shared start")

    monkeypatch.setattr(scheduler, "prefill_shared_start", broken)
    shared = ("You are a concise assistant. Answer every question in one short line, without any preamble or "
              "apology. Question:")
    texts = [f"{shared} {p}" for p in PROMPTS]
    warnings: list = []
    out, log, engine = _run(loaded, texts, 8, parallel=8, prefix_cache_bytes=64 << 20, on_warning=warnings.append)
    calls = [shape for kind, shape in log if kind == "call"]
    longest = max(len(encode_prompt(loaded, t)) for t in texts)
    assert calls[0] == (len(texts), longest - 1)  # no shared-start forward: every prompt whole, at once
    assert out == [_alone(loaded, t, 8) for t in texts]
    assert engine.metrics.engine_errors.labels(stage="shared_start")._value.get() == 1
    assert warnings == ["the shared-start prefill failed (RuntimeError: out of memory in the shared start); "
                        "requests admitted together prefill their whole prompts"]
    engine._recovered("shared_start", "again")  # a second failure: counted, not told again
    assert engine.metrics.engine_errors.labels(stage="shared_start")._value.get() == 2 and len(warnings) == 1


def test_shared_start_takes_the_largest_group_and_leaves_each_prompt_a_token():
    from mlxinfer.serve.prefix_cache import shared_start

    a = list(range(40))
    assert shared_start([a + [1, 2], a + [3], a[:30] + [9]], min_len=16) == a[:30]
    assert shared_start([a, a], min_len=16) == a[:39]  # each keeps its last token to feed the model
    assert shared_start([a + [1], [7] * 20 + [1], [7] * 20 + [2], [7] * 20 + [3]], min_len=16) == [7] * 20
    assert shared_start([a[:10] + [1], a[:10] + [2]], min_len=16) == []  # too short to be worth a forward
    assert shared_start([a + [1]], min_len=16) == []


def test_a_burst_mixing_hits_fresh_prompts_and_a_whole_hit_decodes_as_each_alone(loaded):
    """One burst: prompts continuing a stored prefix, a prompt sharing nothing with it, and the stored prompt
    itself (nothing left to prefill: it goes straight to decoding) — each reply is the one it gets alone."""
    shared = "You are a concise assistant. Answer in one line. Question:"
    texts = [f"{shared} {PROMPTS[0]}", "Paris is the capital of", shared, f"{shared} {PROMPTS[2]}"]
    out, log, engine = _run(loaded, texts, 8, parallel=8, prefix_cache_bytes=64 << 20, stored=shared)
    assert engine.prefix.hits >= 3
    assert out == [_alone(loaded, t, 8) for t in texts]


LONG = ["Once upon a time in a land far away, there lived a", "The quick brown fox jumps over the lazy dog, and then"]


@pytest.mark.parametrize("running, later, budget", [
    (["The sky is", "1, 2, 3,"], LONG, 12),                   # 2 prompts per 2 streams: 12 tokens a round
    (["The sky is"], [*LONG, "Paris is the capital of"], 36),  # 3 prompts per stream: 3 x 12 a round
])
def test_a_burst_while_streams_decode_is_prefilled_in_budgeted_rounds(loaded, running, later, budget):
    # ``running`` decode; ``later`` arrive at the third forward (a decode step); prefill_chunk 12.
    out, log, _ = _run(loaded, running, 12, later=later, after_calls=3, prefill_chunk=12, parallel=8)
    calls = [shape for kind, shape in log if kind == "call"][3:]  # from the arrival on
    group = [c for c in calls if c[0] == len(later) and c[1] > 1]
    width = max(len(encode_prompt(loaded, p)) for p in later) - 1
    assert sum(c[1] for c in group) == width and all(c[0] * c[1] <= budget for c in group)
    assert len(group) == -(-width // (budget // len(later)))  # as many rounds as the budget needs, no more
    first, last = calls.index(group[0]), len(calls) - 1 - calls[::-1].index(group[-1])
    between = calls[first:last + 1]
    assert sum(1 for c in between if c[1] == 1) >= len(group) - 1  # the running streams stepped between rounds
    assert out == [_alone(loaded, p, 12) for p in [*running, *later]]


def test_decode_is_pipelined_and_stops_at_the_token_budget(loaded):
    n = 6
    out, log, _ = _run(loaded, ["The sky is"], n, parallel=2)
    calls = [i for i, e in enumerate(log) if e[0] == "call"]
    pushes = [i for i, e in enumerate(log) if e == ("push", "text")]
    assert len(calls) == 1 + n  # the prompt, then one decode step per token: none past the budget
    assert calls[2] < pushes[0]  # step 2 was handed to the model before token 1 went out
    assert out == [_alone(loaded, "The sky is", n)]


def test_a_request_cancelled_during_a_batched_prefill_leaves_within_a_step(loaded):
    out, log, engine = _run(loaded, PROMPTS[:3], 8, cancel_at=1, parallel=8)
    calls = [shape for kind, shape in log if kind == "call"]
    # Its row is prefilled with the group (the round's decisions are made at its start, as under mlx.launch),
    # takes at most one decode step, then the other two decode together.
    assert calls[0][0] == 3 and calls[1] in ((3, 1), (2, 1)) and all(shape == (2, 1) for shape in calls[2:])
    assert out[1] is None and [out[0], out[2]] == [_alone(loaded, p, 8) for p in (PROMPTS[0], PROMPTS[2])]
    assert engine.snapshot()["running"] == 0


def test_gemma_sliding_layers_batch_through_the_one_op_layers(tmp_path, smollm2_dir, monkeypatch):
    """Gemma 3 (sliding-window and global layers) in the server: each request gets whole caches, so a burst
    prefills as one forward and decodes as one batch through the one-op layers, the sliding ones included (the
    op applies the window; decoding runs past it), each request gets the text it gets alone, and finished ones
    go to the prefix cache."""
    import sys
    from pathlib import Path

    from mlxinfer.kernels import fused_block

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_arch

    gemma = mlxinfer.load(str(tiny_arch.build("gemma3_text", tmp_path / "gemma", smollm2_dir)), kernels="custom")
    window = gemma.model.model.window_size
    batched = []
    real = fused_block._batch_block

    def watched(block, plan, *a, **k):
        y = real(block, plan, *a, **k)
        batched.append((plan.spec.sliding_window > 0, y is not None))
        return y

    monkeypatch.setattr(fused_block, "_batch_block", watched)
    n = window + 16
    # Not "1, 2, 3,": this random model's greedy reply to it meets a near tie (top-2 logits 4e-4 apart) that
    # the 1-row and 3-row matvecs (other summation orders) may break either way.
    prompts = [p for p in PROMPTS if p != "1, 2, 3,"]
    out, log, engine = _run(gemma, prompts, n, parallel=8, prefix_cache_bytes=64 << 20)
    calls = [shape for kind, shape in log if kind == "call"]
    assert calls[0][0] == len(prompts) and calls[0][1] > 1  # one batched prefill
    assert (True, True) in batched and (False, True) in batched and all(ok for _, ok in batched), set(batched)
    assert len(engine.prefix) > 0
    monkeypatch.setattr(fused_block, "_batch_block", real)
    assert out == [_alone(gemma, p, n) for p in prompts]


async def _reply(ticket: Ticket) -> str:
    """A ticket's text pieces until its "done" event."""
    pieces = []
    while (event := await asyncio.wait_for(ticket.queue.get(), 120))[0] == "text":
        pieces.append(event[1])
    assert event[0] == "done", event
    return "".join(pieces)


def test_a_long_prompt_whose_client_left_stops_prefilling_at_the_next_round(loaded):
    """With nothing decoding, a prompt is prefilled in rounds of IDLE_PREFILL tokens and cancellations are
    answered between rounds: a 1500-token prompt whose client goes away during the first forward costs that
    round only (the whole prompt went through as one 2048-token round before), and the next request runs."""
    from mlxinfer.serve.prefill import IDLE_PREFILL

    log: list = []
    holder: dict = {}

    def on_call(count: int) -> None:
        if count == 1:
            holder["engine"].cancel(holder["long"])

    model = Recorder(loaded.model, log, on_call)
    engine = holder["engine"] = Engine(dataclasses.replace(loaded, model=model), Metrics(), parallel=2)
    long_prompt = (encode_prompt(loaded, "Tell me everything. ") * 400)[:1500]
    job = s.Job("completion", long_prompt, mlxinfer.SamplingParams(temperature=0), 4)

    async def go() -> str:
        loop = asyncio.get_running_loop()
        holder["long"] = Ticket(job, loop, asyncio.Queue())
        engine.submit(holder["long"])
        engine.start()
        while not log:
            await asyncio.sleep(0.01)
        short = Ticket(_job(loaded, "The sky is", 4), loop, asyncio.Queue())
        engine.submit(short)
        return await _reply(short)

    try:
        out = asyncio.run(go())
    finally:
        engine.stop()
    calls = [shape for kind, shape in log if kind == "call"]
    assert calls[0] == (1, IDLE_PREFILL) and IDLE_PREFILL < 1500
    assert sum(shape[1] for shape in calls if shape[0] == 1 and shape[1] > 1) <= IDLE_PREFILL + 4  # + the short one
    assert out == _alone(loaded, "The sky is", 4)


def test_prefill_tokens_count_what_the_forwards_ran(loaded):
    """mlxinfer_prefill_tokens counts prompt tokens as forwards run them (padding not included): a request
    cancelled after its first round adds that round only, where the whole prompt was counted at admission."""
    from mlxinfer.serve.prefill import IDLE_PREFILL

    out, log, engine = _run(loaded, PROMPTS[:2], 4, parallel=8)  # a batched group, padded: counted unpadded
    assert engine.metrics.prefill_tokens._value.get() == sum(len(encode_prompt(loaded, p)) for p in PROMPTS[:2])

    holder: dict = {}
    model = Recorder(loaded.model, [], lambda count: count == 1 and holder["engine"].cancel(holder["t"]))
    engine = holder["engine"] = Engine(dataclasses.replace(loaded, model=model), Metrics(), parallel=2)
    job = s.Job("completion", (encode_prompt(loaded, "Tell me everything. ") * 400)[:1500],
                mlxinfer.SamplingParams(temperature=0), 4)

    async def go() -> None:
        holder["t"] = Ticket(job, asyncio.get_running_loop(), asyncio.Queue())
        engine.submit(holder["t"])
        engine.start()
        while engine.metrics.prefill_tokens._value.get() == 0 or engine.snapshot().get("running"):
            await asyncio.sleep(0.01)

    try:
        asyncio.run(go())
    finally:
        engine.stop()
    assert engine.metrics.prefill_tokens._value.get() == IDLE_PREFILL
    assert engine.metrics.prompt_tokens._value.get() == 1500


def test_a_short_prompt_is_not_kept_waiting_behind_a_long_ones_prefill(loaded):
    """Prompts prefill shortest-first: an editor's "hi" arriving while a 5574-token prompt prefilled waited for
    all of it (19 s on 2 cores); now it is read in the next round and the long prompt goes on after it."""
    from mlxinfer.serve.prefill import IDLE_PREFILL

    log: list = []
    holder: dict = {}

    def on_call(count: int) -> None:
        if count == 1:  # the long prompt's first round runs: the short request arrives now
            holder["loop"].call_soon_threadsafe(holder["submit"])

    model = Recorder(loaded.model, log, on_call)
    engine = Engine(dataclasses.replace(loaded, model=model), Metrics(), parallel=2)
    long_prompt = (encode_prompt(loaded, "Tell me everything. ") * 400)[:1500]
    long_job = s.Job("completion", long_prompt, mlxinfer.SamplingParams(temperature=0), 2)

    async def go() -> str:
        loop = holder["loop"] = asyncio.get_running_loop()
        short = Ticket(_job(loaded, "The sky is", 4), loop, asyncio.Queue())
        holder["submit"] = lambda: engine.submit(short)
        long = Ticket(long_job, loop, asyncio.Queue())
        engine.submit(long)
        engine.start()
        text = await _reply(short)
        await _reply(long)
        return text

    try:
        out = asyncio.run(go())
    finally:
        engine.stop()
    calls = [shape for kind, shape in log if kind == "call"]
    first_short = next(i for i, (rows, width) in enumerate(calls) if rows == 1 and 1 < width < 16)
    long_before = sum(width for rows, width in calls[:first_short] if width >= 16)
    assert long_before <= IDLE_PREFILL < 1500, calls[:first_short + 1]
    assert out == _alone(loaded, "The sky is", 4)
