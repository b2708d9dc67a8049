"""A bad network or a Hub that misbehaves: each failure is one line, exit 2, with the hint that fits the cause, and a
stalled Hub fails fast (MLXINFER_HUB_TIMEOUT is shortened here; the default is 10 s per request, ~30 s at most).
A truncated download still resumes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from safety_cli import assert_one_line_error, run, write_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[1] / "hub"))
from fakehub import FakeHub  # noqa: E402

REPO = "org/tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def hub(tiny):
    h = FakeHub()
    h.add_model_dir(REPO, tiny)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def env(tmp_path, hub, monkeypatch) -> dict:
    """A private HF_HOME and caches, the fake Hub as HF_ENDPOINT; the developer's Hub settings cleared."""
    values = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "",
              "TRANSFORMERS_OFFLINE": "", "HF_TOKEN": "", "HF_HUB_CACHE": "", "HUGGINGFACE_HUB_CACHE": "",
              "HF_HUB_DISABLE_TELEMETRY": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"),
              "MLXINFER_CACHE": str(tmp_path / "mlxinfer"), "MLXINFER_HUB_TIMEOUT": "1"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def _generate(env: dict, repo: str = REPO, **extra) -> tuple:
    start = time.monotonic()
    proc = run("generate", repo, "-p", "hi", "--max-tokens", "2", env={**env, **extra}, timeout=90)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("status, needles", [
    (404, ("HTTP 404", "no such repo or revision")),
    (401, ("HTTP 401", "private or gated", "hf auth login")),
    (403, ("HTTP 403", "private or gated", "hf auth login")),
    (500, ("HTTP 500", "server error", "try again later")),
    (503, ("HTTP 503", "server error", "try again later")),
])
def test_http_errors_on_every_route_get_the_matching_hint(hub, env, status, needles):
    hub.status = status
    proc, _ = _generate(env)
    line = assert_one_line_error(proc, REPO, *needles)
    assert "cannot be reached" not in line
    if status < 500:
        assert "try again later" not in line


@pytest.mark.parametrize("mode", ["garbage", "garbage_files"])
def test_a_server_that_is_not_the_hub(hub, env, mode):
    """An HTML page instead of the API's JSON, or instead of the files (a login page, a plain web server)."""
    hub.mode = mode
    proc, _ = _generate(env)
    assert_one_line_error(proc, REPO, "not the Hugging Face Hub API", "HF_ENDPOINT")


def test_stalled_hub_fails_fast(hub, env):
    hub.mode = "stall"
    proc, elapsed = _generate(env)
    assert_one_line_error(proc, REPO, "did not answer within 1 s", "not in the local cache")
    assert elapsed < 20, elapsed


def test_hub_that_answers_but_stalls_on_files_fails_fast(hub, env):
    hub.mode = "stall_files"
    proc, elapsed = _generate(env)
    assert_one_line_error(proc, REPO, "sent nothing for 2 s", "check the connection")
    assert elapsed < 20, elapsed


def test_offline_mode_and_not_cached_says_offline(env):
    proc, _ = _generate(env, HF_HUB_OFFLINE="1")
    assert_one_line_error(proc, REPO, "offline mode is on", "unset HF_HUB_OFFLINE")


def _fill_cache(env: dict) -> None:
    """A first, successful download: with a generous timeout, since a loaded machine can make a healthy Hub slow."""
    proc, _ = _generate(env, MLXINFER_HUB_TIMEOUT="30")
    assert proc.returncode == 0, proc.stderr


def test_offline_mode_uses_the_cache(hub, env):
    _fill_cache(env)
    hub.requests.clear()
    proc, _ = _generate(env, HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []


def test_the_cache_still_serves_when_the_hub_stalls_or_talks_nonsense(hub, env):
    _fill_cache(env)
    for mode in ("stall", "garbage"):
        hub.mode = mode
        proc, elapsed = _generate(env)
        assert proc.returncode == 0, (mode, proc.stderr)
        assert elapsed < 20


def test_default_timeouts_bound_a_stall_to_about_30_s(monkeypatch):
    from mlxinfer.sources import hub_net as hub

    monkeypatch.delenv("MLXINFER_HUB_TIMEOUT", raising=False)
    assert hub.hub_timeout() == 10
    assert hub.STALL_REQUESTS * hub.hub_timeout() + hub.hub_timeout() <= 30
    for bad in ("abc", "0", "-5", "1e9"):
        monkeypatch.setenv("MLXINFER_HUB_TIMEOUT", bad)
        assert hub.hub_timeout() == 10


def test_every_request_gets_a_timeout(monkeypatch):
    """huggingface_hub passes timeout=None (wait forever) for its API calls; the request hook caps it."""
    import httpx2

    from mlxinfer.sources import hub_net as hub

    monkeypatch.setenv("MLXINFER_HUB_TIMEOUT", "7")
    request = httpx2.Request("GET", "http://127.0.0.1/api/models/a/b",
                             extensions={"timeout": {"connect": None, "read": None, "write": 60, "pool": 2}})
    hub._bound_request(request)
    assert request.extensions["timeout"] == {"connect": 7, "read": 7, "write": 7, "pool": 2}


def test_truncated_download_resumes(hub, env, tiny):
    """The connection dies halfway through the weights once; huggingface_hub resumes with a Range request from
    the bytes it kept (it writes in 10 MB chunks, so the file is made bigger than one)."""
    from mlxinfer.sources.hub import download_model

    weights = bytes(range(256)) * (96 * 1024)  # 24 MB
    files = {"config.json": (tiny / "config.json").read_bytes(), "model.safetensors": weights}
    hub.add_repo("org/flaky-once", files, dropped=("model.safetensors",))
    hub.repos["org/flaky-once"].drop_times = 1
    path = download_model("org/flaky-once")
    assert (path / "model.safetensors").read_bytes() == weights
    resumed = [rng for name, rng in hub.ranges if name == "model.safetensors"]
    assert resumed and all(r.startswith("bytes=") and r != "bytes=0-" for r in resumed), hub.ranges
