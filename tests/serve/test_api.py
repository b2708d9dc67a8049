"""The OpenAI routes through the official ``openai`` client against a real server: replies, streams, usage,
logprobs, stop strings, concurrency, the prefix cache and the metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import mlxinfer
from mlxinfer.engine.prompts import encode_prompt

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def local():
    """The same model in this process, same kernels as the server (for prompt token counts and reference text)."""
    return mlxinfer.load("smollm2")


def _reference(local, messages, n: int) -> str:
    tokens = mlxinfer.chat_prompt(local, messages)
    return mlxinfer.generate(local, tokens, mlxinfer.SamplingParams(temperature=0, max_tokens=n))


def test_chat_reply_and_usage(server, local):
    r = server.client().chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "smollm2" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == _reference(local, QUESTION, 24)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(mlxinfer.chat_prompt(local, QUESTION))
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_whole_reply_with_usage(server):
    client = server.client()
    whole = client.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(messages=QUESTION, model="smollm2", temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_whole_and_streamed(server, local):
    client = server.client()
    prompt = "1, 2, 3, 4, 5,"
    r = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=10)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(encode_prompt(local, prompt))
    assert r.choices[0].text == mlxinfer.generate(local, prompt, mlxinfer.SamplingParams(temperature=0, max_tokens=10))
    streamed = list(client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=10,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_reply(server):
    client = server.client()
    full = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    cut = text.index("Paris")
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                                         max_tokens=24, stop=["Paris"], stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24,
                                               stop=["Paris"])
            got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[:cut]
        assert finish == "stop"


def test_logprobs(server):
    r = server.client().chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    c = server.client().completions.create(model="smollm2", prompt="The sky is", temperature=0, max_tokens=4,
                                           logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_seeded_sampling_is_reproducible(server):
    client = server.client()
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Write a word."}], temperature=1.0,
              max_tokens=12, seed=1234)
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_models_and_unknown_model(server):
    import openai

    client = server.client()
    ids = [m.id for m in client.models.list()]
    assert ids == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


QUESTIONS = ["What is 2+2?", "Name a color.", "Tell me a joke about cats.", "Hi!", "What is the capital of Italy?",
             "Say something about the sea.", "Count to five.", "What do bees make?"]


def test_eight_concurrent_greedy_streams_equal_sequential_runs(server):
    client = server.client()

    def ask(q: str) -> str:
        # The last two sample (own seed; a repetition penalty) while the others decode greedily in the same batch.
        extra = {"temperature": 0.9, "seed": 7} if q == QUESTIONS[-1] else {"temperature": 0}
        if q == QUESTIONS[-2]:
            extra["extra_body"] = {"repetition_penalty": 1.3}
        chunks = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                max_tokens=16, stream=True, **extra)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    sequential = [ask(q) for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(ask, QUESTIONS))
    assert concurrent == sequential
    assert server.metrics()[("mlxinfer_decode_batch_size_max", ())] >= 4  # they really decoded together


def test_prefix_cache_reuses_the_conversation(server, local):
    client = server.client()
    first = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16)
    turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And of Germany?"}]
    before = server.metrics()
    second = client.chat.completions.create(model="smollm2", messages=turn2, temperature=0, max_tokens=16)
    after = server.metrics()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(mlxinfer.chat_prompt(local, QUESTION)) - 1
    prefilled = after[("mlxinfer_prefill_tokens_total", ())] - before[("mlxinfer_prefill_tokens_total", ())]
    assert prefilled == second.usage.prompt_tokens - cached
    assert after[("mlxinfer_prefix_cache_hits_total", ())] == before[("mlxinfer_prefix_cache_hits_total", ())] + 1
    assert second.choices[0].message.content == _reference(local, turn2, 16)


def test_metrics_count_what_was_sent(server):
    route = (("route", "/v1/completions"), ("status", "200"))
    bad_route = (("route", "/v1/completions"), ("status", "400"))
    before = server.metrics()
    client = server.client()
    usages = [client.completions.create(model="smollm2", prompt=p, temperature=0, max_tokens=5).usage
              for p in ("Once upon a time", "The weather today")]
    assert httpx.post(server.url("/v1/completions"), json={"prompt": "x", "n": 3}).status_code == 400
    after = server.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("mlxinfer_requests_total", route) == 2
    assert delta("mlxinfer_requests_total", bad_route) == 1
    assert delta("mlxinfer_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("mlxinfer_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 10
    assert delta("mlxinfer_time_to_first_token_seconds_count") == 2
    assert delta("mlxinfer_inter_token_latency_seconds_count") == 8
    for gauge in ("mlxinfer_queue_depth", "mlxinfer_running_sequences", "mlxinfer_kv_cache_bytes",
                  "mlxinfer_prefix_cache_bytes"):
        assert (gauge, ()) in after
    assert after[("mlxinfer_running_sequences", ())] == 0


def test_logprobs_carry_each_tokens_own_bytes_and_stream_with_their_text(server):
    """An emoji spans several byte-level tokens: each entry has its own bytes (OpenAI's 'bytes', and a token
    string 'bytes:\\x..' when they are not whole UTF-8), not U+FFFD; the bytes rebuild the reply; streamed, each
    chunk's entries are the tokens its text completes."""
    msgs = [{"role": "user", "content": "Reply with three emoji only: 🚀🚀🚀"}]
    r = server.client().chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=12,
                                                logprobs=True, top_logprobs=2)
    content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert any(ord(ch) > 0xFFFF for ch in text), text  # the greedy reply has an emoji (4 UTF-8 bytes)
    assert all("\ufffd" not in e.token for e in content)
    assert any(e.token.startswith("bytes:") for e in content)  # a token holding part of a character
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8").lstrip(" ") == text
    for e in content:
        assert all(t.bytes is not None for t in e.top_logprobs)

    stream = server.client().chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=12,
                                                     logprobs=True, stream=True)
    shown = b""
    covered = b""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        shown += (choice.delta.content or "").encode()
        for e in (choice.logprobs.content if choice.logprobs else None) or []:
            covered += bytes(e.bytes)
        assert len(covered.lstrip(b" ")) <= len(shown)  # never an entry ahead of its text
    assert covered.decode().lstrip(" ") == shown.decode() == text


def test_a_completion_keeps_its_leading_space_so_prompt_plus_text_is_the_text(server):
    """"The capital of France is" → "Paris." (the detokenizer drops a reply's first space): prompt + completion
    read "…isParis", and the logprobs' text_offset did not index the text."""
    client = server.client()
    prompt = "Once upon a"
    r = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=4, logprobs=1)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text.startswith(" ") and text == "".join(lp.tokens)
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    streamed = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=4)
    assert not chat.choices[0].message.content.startswith(" ")  # a chat reply still starts with its first word
