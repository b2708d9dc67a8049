"""Helpers for the serve tests: start a real ``mlxinfer serve`` process, talk to it, check error shapes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, key: str | None):
        self.proc, self.port, self.log, self.key = proc, port, log, key
        self.base = f"http://127.0.0.1:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.key or "unused", max_retries=0, **kw)

    def health(self) -> dict:
        return httpx.get(self.url("/health"), timeout=5).json()

    def metrics(self) -> dict:
        """{(name, labels as a sorted tuple): value} parsed with prometheus_client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url("/metrics"), headers=self.headers(), timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: Path, *args: str, key: str | None = None, timeout: float = 120) -> Server:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "mlxinfer", "serve", "smollm2", "--port", str(port), *args]
    if key:
        cmd += ["--api-key", key]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    server = Server(proc, port, log, key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not come up in {timeout}s:\n{server.log_text()}")


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    """The response is ``status`` with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    assert resp.status_code == status, resp.text
    body = json.loads(resp.text)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err
