"""The server's parts without a server: the prefix cache's matching and memory bound, request validation rules."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxinfer.serve import schemas as s
from mlxinfer.serve.prefix_cache import PrefixCache


def _cache(n: int, layers: int = 2, fill: float = 1.0) -> list:
    out = []
    for i in range(layers):
        c = KVCache()
        c.keys = mx.full((1, 2, n, 4), fill + i, dtype=mx.float16)
        c.values = mx.full((1, 2, n, 4), -fill - i, dtype=mx.float16)
        c.offset = n
        out.append(c)
    return out


def test_lookup_takes_the_longest_prefix_and_leaves_a_token_to_feed():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), _cache(10, fill=1))
    pc.store([0, 1, 2, 3, 4, 50, 51, 52], _cache(8, fill=2))
    n, caches = pc.lookup(list(range(20)))
    assert n == 10 and caches[0].offset == 10 and caches[0].keys.shape[2] == 10
    assert caches[1].keys[0, 0, 0, 0].item() == 2  # layer 1 of the first entry (fill 1 + layer index)
    n, _ = pc.lookup(list(range(10)))  # the whole prompt is cached: one token is still fed to the model
    assert n == 9
    n, caches = pc.lookup([0, 1, 2, 3, 4, 50, 51, 52, 53])
    assert n == 8 and caches[0].keys[0, 0, 0, 0].item() == 2
    assert pc.lookup([7, 7, 7, 7, 7, 7]) == (0, None)
    assert (pc.lookups, pc.hits, pc.reused_tokens) == (4, 3, 27)


def test_a_hit_is_not_changed_by_the_request_that_reuses_it():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(8)), _cache(8))
    _, caches = pc.lookup(list(range(12)))
    caches[0].update_and_fetch(mx.zeros((1, 2, 4, 4), mx.float16), mx.zeros((1, 2, 4, 4), mx.float16))
    _, again = pc.lookup(list(range(12)))
    assert again[0].offset == 8 and again[0].keys[0, 0, 7, 0].item() == 1


def test_memory_bound_evicts_least_recently_used_and_covered_prefixes():
    one = sum(c.keys.nbytes + c.values.nbytes for c in _cache(10))
    pc = PrefixCache(2 * one + 10)
    pc.store(list(range(10)), _cache(10))
    pc.store(list(range(100, 110)), _cache(10))
    pc.lookup(list(range(11)))  # touch the first: the second becomes the oldest
    pc.store(list(range(200, 210)), _cache(10))
    assert len(pc) == 2 and pc.nbytes <= pc.max_bytes
    assert pc.lookup(list(range(100, 111)))[0] == 0
    assert pc.lookup(list(range(11)))[0] == 10
    pc.store(list(range(15)), _cache(15))  # covers range(10): that entry goes, and the oldest for room
    assert len(pc) == 1 and pc.lookup(list(range(11)))[0] == 10 and pc.lookup(list(range(15, 0, -1)))[0] == 0
    assert pc.lookup(list(range(200, 211)))[0] == 0
    assert PrefixCache(0).lookup([1, 2, 3, 4, 5]) == (0, None)


def test_a_rotating_layer_cache_is_not_stored():
    """A sliding-window layer's cache (Gemma 3) holds only its window: not a prefix anyone could reuse."""
    cache = _cache(10)
    ring = RotatingKVCache(max_size=4)
    for _ in range(10):
        ring.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), [ring, *cache])
    assert len(pc) == 0 and pc.lookup(list(range(11))) == (0, None)
    pc.store(list(range(10)), cache)
    assert len(pc) == 1


def test_max_tokens_rules():
    assert s.max_tokens({}, "chat", 10, 100, 512) == 90          # the default is capped by the room left
    assert s.max_tokens({}, "chat", 10, 100, 20) == 20
    assert s.max_tokens({"max_completion_tokens": 5, "max_tokens": 50}, "chat", 10, 100, 20) == 5
    with pytest.raises(s.ApiError) as e:
        s.max_tokens({"max_tokens": 91}, "chat", 10, 100, 20)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(s.ApiError):
        s.max_tokens({}, "completion", 100, 100, 20)
    with pytest.raises(s.ApiError):
        s.max_tokens({"max_tokens": True}, "chat", 1, 100, 20)


@pytest.mark.parametrize("data, param", [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
])
def test_field_rules(data, param):
    with pytest.raises(s.ApiError) as e:
        s.chat_messages(data)
        s.logprobs_setting(data, "chat")
        s.stream_settings(data)
        s._stop(data)
        s.sampling_values(data)
    assert e.value.status == 400 and e.value.param == param


def test_text_parts_and_developer_role_are_accepted():
    msgs = s.chat_messages({"messages": [{"role": "developer", "content": "Be brief."},
                                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]},
                                         {"role": "assistant", "content": None}]})
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
                    {"role": "assistant", "content": ""}]


def test_a_failing_step_fails_its_requests_not_the_engine():
    import asyncio
    import dataclasses

    import mlxinfer
    from mlxinfer.engine.prompts import encode_prompt
    from mlxinfer.serve.metrics import Metrics
    from mlxinfer.serve.scheduler import Engine
    from mlxinfer.serve.sequence import Ticket

    loaded = mlxinfer.load("smollm2")

    class Flaky:
        calls = 0

        def __getattr__(self, name):  # layers, make_cache... as the real model's
            return getattr(loaded.model, name)

        def __call__(self, *args, **kwargs):
            Flaky.calls += 1
            if Flaky.calls == 3:  # the third forward pass (a decode step) fails
                raise RuntimeError("simulated failure")
            return loaded.model(*args, **kwargs)

    engine = Engine(dataclasses.replace(loaded, model=Flaky()), Metrics(), parallel=2)
    job = s.Job("completion", encode_prompt(loaded, "The sky is"),
                mlxinfer.SamplingParams(temperature=0), 6)

    async def run() -> list:
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(2):
            t = Ticket(job, loop, asyncio.Queue())
            engine.submit(t)
            events = []
            while not events or events[-1][0] == "text":
                events.append(await asyncio.wait_for(t.queue.get(), 60))
            out.append(events[-1])
        return out

    engine.start()
    try:
        first, second = asyncio.run(run())
    finally:
        engine.stop()
    assert first[0] == "error" and first[1].status == 500 and "simulated failure" in first[1].message
    assert second[0] == "done" and second[2]["completion_tokens"] == 6

    # A request that fails before it runs (here: no KV cache can be made for this "model") still gets its error.
    engine = Engine(dataclasses.replace(loaded, model=object()), Metrics())
    engine.start()
    try:
        failed, _ = asyncio.run(run())
    finally:
        engine.stop()
    assert failed[0] == "error" and failed[1].status == 500


def test_a_burst_is_bounded_by_parallel_plus_queue_size():
    """Requests that arrive before the engine thread admits any all wait at first: the bound counts them with
    the running ones (it let a whole burst queue while nothing ran yet). The engine thread is not started."""
    import asyncio

    import mlxinfer
    from mlxinfer.serve.metrics import Metrics
    from mlxinfer.serve.scheduler import Engine
    from mlxinfer.serve.sequence import Ticket

    engine = Engine(mlxinfer.load("smollm2"), Metrics(), parallel=2, queue_size=3)
    job = s.Job("completion", [1, 2, 3], mlxinfer.SamplingParams(temperature=0), 4)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(5):
            engine.submit(Ticket(job, loop, asyncio.Queue()))
        with pytest.raises(s.ApiError) as e:
            engine.submit(Ticket(job, loop, asyncio.Queue()))
    finally:
        loop.close()
    assert e.value.status == 429 and e.value.code == "queue_full"
    assert "(0 sequences running, 5 requests queued)" in e.value.message  # (it said "1 sequences")


def test_json_nested_too_deeply_is_a_400():
    with pytest.raises(s.ApiError) as e:
        s.parse_json(b"[" * 100_000)
    assert e.value.status == 400 and e.value.code == "invalid_json" and "deeply" in e.value.message


def _chat(*messages, **fields) -> dict:
    return {"messages": list(messages), **fields}


@pytest.mark.parametrize("data, param, needle", [
    (_chat({"role": "user", "content": "x", "name": "bob"}), "messages[0].name", "participant names"),
    (_chat({"role": "user", "content": "x", "frob": 1}), "messages[0].frob", "unsupported field"),
    (_chat({"role": "user", "content": "bad \ud800 text"}), "messages[0].content", "lone surrogate"),
    (_chat({"role": "user", "content": "x"}, stop=["y" * 1001]), "stop", "at most 1000 characters"),
    (_chat({"role": "user", "content": "x"}, temperature=2.5), "temperature", "between 0 and 2"),
    (_chat({"role": "user", "content": "x"}, temperature=1e308), "temperature", "between 0 and 2"),
    (_chat({"role": "user", "content": "x"}, repetition_penalty=1.1, repeat_penalty=1.2), "repeat_penalty", "not both"),
    (_chat({"role": "user", "content": "x"}, max_completion_tokens=5, max_tokens="x"), "max_tokens", "whole number"),
])
def test_request_rules_refuse_what_would_be_ignored_or_fail_deeper(data, param, needle):
    with pytest.raises(s.ApiError) as e:
        s.chat_messages(data)
        s._stop(data)
        s.sampling_values(data)
        s.max_tokens(data, "chat", 3, 100, 20)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_request_rules_accept_what_openai_accepts():
    """An assistant message as the SDK sends it back (empty refusal, tool_calls, annotations) is fine; a negative
    seed (OpenAI's is a signed 64-bit integer) maps onto the sampler's unsigned one; 0 <= temperature <= 2."""
    msgs = s.chat_messages(_chat({"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": [],
                                  "annotations": [], "audio": None, "function_call": None}))
    assert msgs[1] == {"role": "assistant", "content": "yo"}
    assert s.sampling_values({"seed": -1}) == {"seed": 2**64 - 1}
    assert s.sampling_values({"seed": -(2**63)}) == {"seed": 2**63}
    assert s.sampling_values({"temperature": 2}) == {"temperature": 2}
    with pytest.raises(s.ApiError):
        s.completion_prompt({"prompt": "a \udfff b"})
