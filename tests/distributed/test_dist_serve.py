"""``mlxinfer serve`` under ``mlx.launch``: rank 0 owns the port, rank 1 follows every round of its scheduler.

Replies through the official ``openai`` client (whole, streamed, sampled with a seed, two at once) equal a
single-process server's; SIGTERM to rank 0 lets a running stream finish and then every rank exits 0; a rank that
dies mid-reply makes rank 0 end with one line naming it within the timeout (the client sees a 503 or a dropped
stream, never a hang).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from dist_cli import MLXINFER, launch_cmd, needs_launch, rank_pids, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_helpers import free_port  # noqa: E402

pytestmark = needs_launch
STORY = [{"role": "user", "content": "tell me a story"}]


class Running:
    def __init__(self, cmd: list[str], tmp: Path, port: int, env: dict | None = None):
        self.port, self.err_path = port, tmp / f"err-{port}.txt"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "MLXINFER_DIST_TIMEOUT": "20", **(env or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.err()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise AssertionError("the server did not come up:\n" + self.err())

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _answers(srv: Running, model: str) -> dict:
    c = srv.client()
    whole = c.chat.completions.create(model=model, messages=STORY, temperature=0, max_tokens=12)
    chunks = c.chat.completions.create(model=model, messages=STORY, temperature=1, seed=7, max_tokens=24,
                                       stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    done = c.completions.create(model=model, prompt="once upon", temperature=1, seed=3, max_tokens=16)
    return {"whole": (whole.choices[0].message.content, whole.usage.completion_tokens), "streamed": streamed,
            "completion": (done.choices[0].text, done.usage.completion_tokens)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "q4", bits=4)  # 4-bit: mlx's quantized sharded layers


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    port = free_port()
    one = Running([*MLXINFER, "serve", model, "--port", str(port)], tmp_path_factory.mktemp("one"), port)
    try:
        return _answers(one, model)
    finally:
        one.proc.send_signal(signal.SIGTERM)
        one.proc.wait(60)


def test_tensor_parallel_answers_like_one_process_and_drains_on_sigterm(model, reference, tmp_path):
    port = free_port()
    srv = Running(launch_cmd("serve", model, "--port", str(port)), tmp_path, port)
    try:
        assert _answers(srv, model) == reference
        c = srv.client()
        with ThreadPoolExecutor(2) as pool:  # two at once: one batched forward pass per step on both ranks
            both = list(pool.map(lambda p: c.completions.create(model=model, prompt=p, temperature=0,
                                                                 max_tokens=20), ["abc", "a much longer prompt"]))
        assert [r.usage.completion_tokens for r in both] == [20, 20]
        stream = c.completions.create(model=model, prompt="go on", temperature=0, max_tokens=150, stream=True)
        assert next(iter(stream)).choices is not None
        leader = rank_pids(srv.proc.pid, 0)
        assert len(leader) == 1
        os.kill(leader[0], signal.SIGTERM)  # a drain: the running stream finishes, then every rank stops
        finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
        assert finishes == ["length"]
        assert srv.proc.wait(60) == 0
    finally:
        srv.close()
    err = srv.err()
    assert "exited with code" not in err and "Traceback" not in err, err
    assert err.count("mlxinfer serve: stopped") == 1 and err.count("parallel over 2 ranks") == 1, err  # rank 1 silent
    assert "tensor parallel over 2 ranks (ring), rank 0" in err


def test_pipeline_answers_like_one_process_and_a_dying_rank_ends_rank_0_with_one_line(model, reference, tmp_path):
    port = free_port()
    srv = Running(launch_cmd("serve", model, "--port", str(port), "--pipeline"), tmp_path, port)
    try:
        assert _answers(srv, model) == reference
        stream = srv.client().completions.create(model=model, prompt="go on", temperature=1, seed=1,
                                                 max_tokens=480, stream=True)
        assert next(iter(stream)).choices is not None
        for pid in rank_pids(srv.proc.pid, 1):
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception) as caught:  # the 503 event (openai.APIError) or a dropped connection
            for _ in stream:
                pass
        srv.proc.wait(60)
        assert time.monotonic() - killed < 30  # within MLXINFER_DIST_TIMEOUT (20 s) and then some, not a hang
    finally:
        srv.close()
    err = srv.err()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 of 2 ") and "rank 1" in errors[0][20:], err
    assert "Traceback" not in err
    assert "rank 1" in str(caught.value) or "connection" in str(caught.value).lower()
    assert "pipeline parallel over 2 ranks (ring), rank 0: layers 0-1 of 4" in err
