"""End to end through the fake Hub: user models.toml alias -> repo -> download with progress -> load -> generate;
then the same offline from the cache, and the CLI's exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import TINY_REPO

import mlxinfer
from mlxinfer.errors import DownloadError, ModelNotFound
from mlxinfer.sources.hub import cached_path


@pytest.fixture
def tiny_alias(fake_hub, tmp_path, monkeypatch) -> str:
    """A user models.toml whose alias 'tiny' points at the fake Hub repo."""
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[models.tiny]\n'
        f'hub = "{TINY_REPO}"\n'
        'description = "tiny random llama on the fake Hub"\n'
        'temperature = 0.0\n'
    )
    monkeypatch.setenv("MLXINFER_MODELS", str(toml))
    return "tiny"


def _greedy(loaded, n: int = 8) -> tuple[list[int], str]:
    params = mlxinfer.SamplingParams(temperature=0.0, max_tokens=n)
    last, text = None, ""
    for r in mlxinfer.stream_generate(loaded, "Hello there", params, ignore_eos=True):
        text += r.text
        last = r
    return last.stats.tokens, text


def test_alias_download_load_generate_then_offline(fake_hub, tiny_alias, monkeypatch):
    stages = []
    loaded = mlxinfer.load(tiny_alias, kernels="builtin", progress=lambda s, d, t: stages.append((s, d, t)))
    downloads = [(d, t) for s, d, t in stages if s == "download"]
    assert downloads and downloads[-1][0] == downloads[-1][1] > 1_000_000  # bytes of the tiny model
    assert loaded.path == cached_path(TINY_REPO)
    assert loaded.config["vocab_size"] == 49152
    tokens, text = _greedy(loaded)
    assert len(tokens) == 8 and all(0 <= t < 49152 for t in tokens)
    assert mlxinfer.generate(loaded, "Hello there", mlxinfer.SamplingParams(temperature=0.0, max_tokens=8),
                             ignore_eos=True) == text

    # Second run offline: no request reaches the Hub, same files, same greedy tokens.
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = mlxinfer.load(tiny_alias, kernels="builtin")
    assert again.path == loaded.path and fake_hub.requests == []
    assert _greedy(again)[0] == tokens

    # And with the server gone (connection refused) and offline mode off.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake_hub.stop()
    assert mlxinfer.load(f"{TINY_REPO}", kernels="builtin").path == loaded.path


def test_load_repo_id_with_revision_and_alias_with_revision(fake_hub, tmp_path, monkeypatch):
    v1 = fake_hub.repos[TINY_REPO].revisions["v1"]
    assert mlxinfer.load(f"{TINY_REPO}@v1", kernels="builtin").path.name == v1
    toml = tmp_path / "models.toml"
    toml.write_text(f'[models.tiny-v1]\nhub = "{TINY_REPO}"\nrevision = "{v1}"\n')
    monkeypatch.setenv("MLXINFER_MODELS", str(toml))
    fake_hub.stop()  # the pinned commit is served from the cache with the server gone
    assert mlxinfer.load("tiny-v1", kernels="builtin").path.name == v1


def test_load_errors_are_mlxinfer_errors(fake_hub, tmp_path, monkeypatch):
    with pytest.raises(ModelNotFound, match="Hub repo 'org/nope' not found"):
        mlxinfer.load("org/nope")
    fake_hub.stop()
    with pytest.raises(DownloadError, match="not in the local cache and the Hub cannot be reached"):
        mlxinfer.load("org/never-seen")


# -- the CLI, as a user runs it ----------------------------------------------------------------------------
def _mlxinfer(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("mlxinfer", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "mlxinfer.cli.main"]
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("MLXINFER_DEBUG", None)
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=120)


def _models_row(alias: str) -> dict:
    r = _mlxinfer("models", "--json")
    assert r.returncode == 0, r.stderr
    return next(row for row in json.loads(r.stdout) if row["alias"] == alias)


def test_cli_generate_from_fake_hub_then_offline(fake_hub, tiny_alias, monkeypatch):
    assert _models_row(tiny_alias)["on_disk"] is False
    r = _mlxinfer("generate", tiny_alias, "-p", "hi", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    row = _models_row(tiny_alias)
    assert row["on_disk"] is True and row["location"] == str(cached_path(TINY_REPO))
    assert row["disk_bytes"] > 1_000_000

    fake_hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = _mlxinfer("generate", tiny_alias, "-p", "hi", "--max-tokens", "5", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 1 <= out["generation_tokens"] <= 5


def test_cli_hub_errors_are_one_line_exit_2(fake_hub):
    r = _mlxinfer("generate", "org/nope", "-p", "hi")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Hub repo 'org/nope' not found" in lines[0], r.stderr

    fake_hub.stop()
    r = _mlxinfer("generate", "org/never-seen", "-p", "hi")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "connect once or set HF_ENDPOINT" in lines[0], r.stderr
