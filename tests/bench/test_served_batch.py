"""``mlxinfer bench -b`` times batches through the server's own scheduler (``serve.scheduler.Engine``) in process:
one admission round, one prefill group, then one decode batch, a timestamp per step; contexts (``-d``) are found in
the engine's prefix cache, so only the prompt is prefilled in the timed call."""

from __future__ import annotations

import dataclasses

import pytest

import mlxinfer
from mlxinfer.bench import measure
from mlxinfer.serve import schemas
from mlxinfer.serve.sequence import SeqState, Ticket

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    return mlxinfer.load("smollm2")


class Counting:
    """The real model; counts the tokens of every forward (rows x columns)."""

    def __init__(self, model, tokens: list):
        self._model, self._tokens = model, tokens

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, *args, **kwargs):
        self._tokens.append(tuple(inputs.shape))
        return self._model(inputs, *args, **kwargs)


def test_a_served_batch_is_timed_per_decode_step(loaded):
    for b in (1, 3):
        prompts = [[1 + i, 2, 3, 4, 5, 6] for i in range(b)]
        s = measure.run_served_batch(loaded, prompts, 5)
        assert len(s.token_times) == 5 and s.tokens_per_step == b  # exactly 5 steps: EOS ignored
        assert s.prompt_tokens == 6 * b and s.kv_per_token > 0 and s.peak_memory > 0
        assert all(x >= 0 for x in s.latencies) and s.decode_tps == pytest.approx(4 * b / (s.e2e - s.ttft))


def test_contexts_are_already_cached_when_the_timed_call_starts(loaded):
    calls: list = []
    counted = dataclasses.replace(loaded, model=Counting(loaded.model, calls))
    contexts = [list(range(10, 60)), list(range(100, 140))]
    s = measure.run_served_batch(counted, [[7, 8, 9], [4, 5, 6]], 3, contexts=contexts)
    assert len(s.token_times) == 3 and s.prompt_tokens == 6
    # The contexts were prefilled before the engine ran (batch_cache: one forward each); the engine itself ran
    # one prefill forward of the prompts' first two tokens each, then 3 decode steps of 2 rows.
    engine_calls = calls[len(contexts):]
    assert engine_calls == [(2, 2), (2, 1), (2, 1), (2, 1)]


def test_eos_ends_a_request_unless_it_asks_for_exactly_max_tokens(loaded):
    eos = next(iter(loaded.eos_token_ids))
    params = mlxinfer.SamplingParams(temperature=0)
    for ignore, reasons in ((False, ["stop"]), (True, [None, None, "length"])):
        job = schemas.Job("completion", [1, 2, 3], params, 3, ignore_eos=ignore)
        seq = SeqState(Ticket(job, None, None), [], 0, loaded.tokenizer)
        seq.emit = lambda *args, **kwargs: None  # no client
        got = []
        for _ in range(3):
            got.append(seq.add(eos, None, loaded.eos_token_ids))
            if got[-1] is not None:
                break
        assert got == reasons


def test_a_context_too_short_to_cache_is_prefilled_in_the_timed_call(loaded):
    s = measure.run_served_batch(loaded, [[7, 8, 9], [4, 5, 6]], 2, contexts=[[10, 11], [12, 13]])
    assert len(s.token_times) == 2 and s.prompt_tokens == 10


def test_an_engine_that_dies_fails_the_batch_instead_of_hanging(loaded, monkeypatch):
    from mlxinfer.serve.scheduler import Engine

    def broken(self):
        return None  # the engine thread ends without answering anyone

    monkeypatch.setattr(Engine, "_run", broken)
    with pytest.raises(RuntimeError, match="stopped before answering"):
        measure.run_served_batch(loaded, [[1, 2, 3], [4, 5, 6]], 2)
