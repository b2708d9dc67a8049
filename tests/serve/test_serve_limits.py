"""Limits and safety of ``mlxinfer serve``: errors in OpenAI's shape (400/401/404/413/429), a cancelled stream
freeing its slot, SIGTERM draining, and refusing to bind a public address without a key."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import API_KEY, assert_openai_error, start_server

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, code, param", [
    (b"{not json", "invalid_json", None),
    (b"[1, 2]", None, None),
    (json.dumps({"messages": MSG, "n": 2}).encode(), "unsupported_value", "n"),
    (json.dumps({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
     "unsupported_value", "tools"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode(), None,
     "messages[0].content"),
    (json.dumps({"messages": MSG, "frobnicate": 1}).encode(), "unsupported_field", "frobnicate"),
    (json.dumps({"messages": MSG, "temperature": -1}).encode(), None, "temperature"),
    (json.dumps({"messages": MSG, "top_k": 10**9}).encode(), None, "top_k"),
    (json.dumps({"messages": MSG, "max_tokens": 0}).encode(), None, "max_tokens"),
    (json.dumps({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}).encode(), None, "stop"),
    (json.dumps({"messages": []}).encode(), None, "messages"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), None, "messages[0].role"),
])
def test_bad_requests_get_400(server, body, code, param):
    r = httpx.post(server.url(CHAT), content=body, headers={"content-type": "application/json"}, timeout=30)
    err = assert_openai_error(r, 400, code)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_over_long_prompts_get_400(server):
    context = server.client().models.list().data[0].model_extra["context_length"]
    long_text = "hello " * (context + 10)
    r = httpx.post(server.url("/v1/completions"), json={"prompt": long_text, "max_tokens": 4}, timeout=60)
    assert_openai_error(r, 400, "context_length_exceeded")
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "hello", "max_tokens": context}, timeout=60)
    assert_openai_error(r, 400, "context_length_exceeded")


def test_token_prompts_are_checked_against_the_vocabulary(server):
    r = httpx.post(server.url("/v1/completions"), json={"prompt": [1, 2, 10**7], "max_tokens": 2}, timeout=30)
    assert "outside the vocabulary" in assert_openai_error(r, 400)["message"]
    r = httpx.post(server.url("/v1/completions"), json={"prompt": [-1, 5], "max_tokens": 2}, timeout=30)
    assert "token id -1 is outside the vocabulary" in assert_openai_error(r, 400)["message"]
    r = httpx.post(server.url("/v1/completions"), json={"prompt": [504, 3458, 314], "max_tokens": 2,
                                                        "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_unknown_model_and_route_get_404(server):
    r = httpx.post(server.url(CHAT), json={"model": "nope", "messages": MSG}, timeout=30)
    assert_openai_error(r, 404, "model_not_found")
    assert_openai_error(httpx.get(server.url("/v1/nothing"), timeout=5), 404)


def test_api_key_is_required(limited):
    import openai

    assert httpx.get(limited.url("/health"), timeout=5).status_code == 200  # health stays open for probes
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert_openai_error(httpx.post(limited.url(CHAT), json={"messages": MSG}, headers=headers, timeout=5),
                            401, "invalid_api_key")
        assert_openai_error(httpx.get(limited.url("/v1/models"), headers=headers, timeout=5), 401)
        assert_openai_error(httpx.get(limited.url("/metrics"), headers=headers, timeout=5), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.url("/v1"), api_key="wrong", max_retries=0).models.list()
    assert limited.client().models.list().data[0].id == "smollm2"


def test_cors_only_for_allowed_origins(limited):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(limited.url(CHAT), headers={"Origin": "http://ui.example", **pre}, timeout=5)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.options(limited.url(CHAT), headers={"Origin": "http://evil.example", **pre}, timeout=5)
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers  # the origin guard
    r = httpx.get(limited.url("/v1/models"), headers={"Origin": "http://ui.example", **limited.headers()}, timeout=5)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"


def test_body_limit_gets_413(limited):
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(limited.url(CHAT), json=big, headers=limited.headers(), timeout=5)
    assert_openai_error(r, 413, "request_too_large")


def _long_stream(server):
    """A request that runs for a long time (counting does not end by itself), as a raw SSE stream."""
    client = httpx.Client(timeout=60)
    body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 2000, "temperature": 0, "stream": True}
    cm = client.stream("POST", server.url("/v1/completions"), json=body, headers=server.headers())
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    return client, cm, lines  # the caller keeps the line iterator: dropping it closes the response


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_full_queue_gets_429_and_a_cancelled_stream_frees_its_slot(limited):
    before = limited.metrics()
    client, cm, _lines = _long_stream(limited)  # takes the only slot
    queued: dict = {}

    def second():
        try:
            queued["reply"] = limited.client().completions.create(model="smollm2", prompt="Hello", max_tokens=3,
                                                                  temperature=0)
        except Exception as e:  # noqa: BLE001 - reported by the assertions below
            queued["error"] = e

    waiter = threading.Thread(target=second)
    waiter.start()
    assert _wait(lambda: limited.health()["queued"] == 1 or "error" in queued), (queued, limited.health())
    r = httpx.post(limited.url("/v1/completions"), json={"prompt": "x", "max_tokens": 2},
                   headers=limited.headers(), timeout=10)
    assert_openai_error(r, 429, "queue_full")
    assert r.headers.get("retry-after")
    time.sleep(1.0)
    assert waiter.is_alive()  # still waiting behind the long stream
    closed = time.monotonic()
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    client.close()
    waiter.join(30)
    assert "error" not in queued and queued["reply"].usage.completion_tokens == 3
    assert time.monotonic() - closed < 10  # not the ~2000 tokens the first request had left
    after = limited.metrics()
    key = ("mlxinfer_requests_total", (("route", "/v1/completions"), ("status", "499")))
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert _wait(lambda: limited.health()["running"] == 0)


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_slot(limited):
    key = ("mlxinfer_requests_total", (("route", "/v1/completions"), ("status", "499")))
    before = limited.metrics().get(key, 0)
    body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 2000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 1.5 s of a ~2000-token reply
        httpx.post(limited.url("/v1/completions"), json=body, headers=limited.headers(), timeout=1.5)
    assert _wait(lambda: limited.health()["running"] == 0, timeout=10)
    assert limited.metrics().get(key, 0) == before + 1
    r = limited.client().completions.create(model="smollm2", prompt="Hello", max_tokens=2)  # the slot is free
    assert r.usage.completion_tokens == 2


def test_timeouts_get_503_and_sigterm_drains_running_requests_and_exits_0(tmp_path):
    """One server for both (a server start is the slow part of these tests)."""
    srv = start_server(tmp_path, "--timeout", "4")
    try:
        long = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 4000, "temperature": 0}
        results: dict = {}

        def streamed():
            with httpx.stream("POST", srv.url("/v1/completions"), json={**long, "stream": True}, timeout=60) as resp:
                results["events"] = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: ")]

        t0 = time.monotonic()
        other = threading.Thread(target=streamed)
        other.start()
        r = httpx.post(srv.url("/v1/completions"), json=long, timeout=60)
        other.join(60)
        assert_openai_error(r, 503, "timeout")
        assert time.monotonic() - t0 < 30
        assert results["events"][-1]["error"]["code"] == "timeout"  # the stream ends with OpenAI's error object
        assert "(the server's --timeout is 4 s)" in results["events"][-1]["error"]["message"]  # (a bare "timed out")
        assert _wait(lambda: srv.health()["running"] == 0)

        with httpx.Client(timeout=60) as client:
            body = {"messages": [{"role": "user", "content": "Count from 1 to 20."}], "max_tokens": 12,
                    "temperature": 0, "stream": True}
            with client.stream("POST", srv.url(CHAT), json=body) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                srv.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the running request finished
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finish[-1] in ("stop", "length")
        assert srv.proc.wait(30) == 0, srv.log_text()
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url("/health"), timeout=2)
    finally:
        srv.stop()


def test_port_0_names_the_port_it_got_and_sighup_drains_like_sigterm(tmp_path):
    """--port 0 announced "http://127.0.0.1:0/v1" while listening elsewhere; now the banner names the real port.
    A hangup (the terminal that started the server closed) stops it like SIGTERM: exit 0, no traceback (it was
    the CLI's Terminated raised inside uvicorn's event loop: 30 lines, exit 129)."""
    import re

    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "mlxinfer", "serve", "smollm2", "--port", "0"], stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: "on http://127.0.0.1:" in log.read_text(), timeout=120), log.read_text()
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text())[1])
        assert port != 0
        assert _wait(lambda: _health_ok(port), timeout=60), log.read_text()
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0, log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _health_ok(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_public_address_without_key_refuses_to_start():
    run = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "smollm2", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                          "MLXINFER_API_KEY": ""})
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: refusing to listen on 0.0.0.0 without an API key")
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("flags, said", [
    (["--parallel", "0"], "error: invalid --parallel 0: must be >= 1"),
    (["--parallel", "100000000"], "error: invalid --parallel 100000000: must be at most 1024 (a few per core is "
                                  "where batched decode stops gaining on a CPU; tens on a GPU)"),
    (["--host", ""], "error: empty --host (give an address, e.g. 127.0.0.1 (the default) or 0.0.0.0)"),
    (["--prefill-chunk", "99999"], "error: invalid --prefill-chunk 99999: must be at most 2048"),
    (["--allow-origin", "not a url"], "error: invalid --allow-origin 'not a url' (give scheme://host[:port], "
                                      "e.g. http://localhost:3000, or '*')"),
    (["--allow-origin", "http://ui.example/app"], "error: invalid --allow-origin 'http://ui.example/app' (give "
                                                  "scheme://host[:port], e.g. http://localhost:3000, or '*')"),
])
def test_bad_server_options_are_one_line(flags, said):
    run = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "smollm2", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [said]


def test_key_from_environment_allows_public_bind_checks(monkeypatch):
    # With a key the public address passes the check (then a taken port still fails before the model loads).
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "--host", "0.0.0.0", "--port", str(port)],
                             capture_output=True, text=True, timeout=60,
                             env={**__import__("os").environ, "MLXINFER_API_KEY": API_KEY})
    assert run.returncode == 2
    assert run.stderr.startswith(f"error: cannot listen on 0.0.0.0:{port}")


def test_a_model_with_non_finite_output_does_not_start(smollm2_dir, tmp_path):
    """A corrupt model (here a NaN norm) answered every request with garbage; one step before the port opens
    refuses it in one line."""
    import shutil

    import mlx.core as mx

    broken = tmp_path / "nan-model"
    shutil.copytree(smollm2_dir, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    norm = weights["model.norm.weight"]
    weights["model.norm.weight"] = mx.full(norm.shape, float("nan"), dtype=norm.dtype)
    mx.save_safetensors(str(broken / "model.safetensors"), weights, metadata={"format": "mlx"})
    run = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", str(broken), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: the model's output is not finite (NaN or inf): its weights are corrupt (download or convert the "
        "model again)"], run.stderr


def test_every_route_is_counted_and_odd_requests_get_openai_errors(server):
    """requests_total counts successes of /v1/models and /metrics too, and 404 / 405 / 499 on any path (unknown
    paths under one 'other' label); a 405 names the allowed method; an unknown model's long name is cut."""
    import socket

    def count(route: str, status: str) -> float:
        return server.metrics().get(("mlxinfer_requests_total", (("route", route), ("status", status))), 0.0)

    before = {k: count(*k) for k in [("/v1/models", "200"), ("/v1/models", "404"), ("other", "404"),
                                     ("/v1/completions", "405"), ("/v1/chat/completions", "499")]}
    m0 = count("/metrics", "200")
    assert httpx.get(server.url("/v1/models"), timeout=5).status_code == 200
    assert_openai_error(httpx.get(server.url("/v1/nothing/" + "x" * 5000), timeout=5), 404)
    r = httpx.get(server.url("/v1/completions"), timeout=5)
    assert_openai_error(r, 405) and r.headers["allow"] == "POST"
    r = httpx.get(server.url("/v1/models/" + "m" * 5000), timeout=5)
    assert len(assert_openai_error(r, 404, "model_not_found")["message"]) < 300
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # hangs up halfway through its body
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": ")
        time.sleep(0.3)
    time.sleep(0.5)
    after = {k: count(*k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {("/v1/models", "200"): 1, ("/v1/models", "404"): 1,
                                                         ("other", "404"): 1,
                                                         ("/v1/completions", "405"): 1,
                                                         ("/v1/chat/completions", "499"): 1}
    assert count("/metrics", "200") >= m0 + 6  # this test's own scrapes
    assert "ClientDisconnect" not in server.log_text()


def _counting_stream(srv, out: dict) -> threading.Thread:
    """A completion that counts for thousands of tokens, streamed; its 'data:' events land in out["events"]."""
    def run():
        body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 4000, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=120) as resp:
                out["events"] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
        except httpx.HTTPError as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    assert _wait(lambda: len(out.get("events", [])) > 3, timeout=60)
    return thread


def test_a_stream_still_running_when_grace_runs_out_ends_with_an_error_event(tmp_path):
    """--grace 2: a second before it runs out the stream gets OpenAI's error object (it was cut mid-chunk with a
    traceback in the log); the server exits 0. A second signal to another draining server ends its requests at
    once, each stream with the same error event."""
    srv = start_server(tmp_path, "--grace", "2")
    out: dict = {}
    try:
        thread = _counting_stream(srv, out)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log_text()
        thread.join(30)
        assert time.monotonic() - t0 < 10
        last = json.loads(out["events"][-1])
        assert last["error"]["code"] == "shutting_down", out["events"][-3:]
        assert "Traceback" not in srv.log_text() and "error" not in out
    finally:
        srv.stop()

    srv = start_server(tmp_path, "--grace", "60")
    out = {}
    try:
        thread = _counting_stream(srv, out)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert srv.proc.poll() is None  # draining: the stream may take its 60 s
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)  # (any second signal)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10  # the second signal does not wait for the grace
        thread.join(30)
        # the stream ends with the error event, not cut mid-chunk with two tracebacks in the log
        assert json.loads(out["events"][-1])["error"]["code"] == "shutting_down", out["events"][-3:]
        assert "Traceback" not in srv.log_text() and "error" not in out
    finally:
        srv.stop()
