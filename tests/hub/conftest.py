"""Fixtures: a tiny MLX model built once per session, and a fake Hub on 127.0.0.1 with a fresh HF_HOME per test.

To use them outside tests/hub, move these fixtures into tests/conftest.py (they only need fakehub.py on sys.path).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import TINY_REPO, FakeHub, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A random-weight 4-bit llama with the bundled SmolLM2's tokenizer (smollm2_dir: tests/conftest.py)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture
def hf_env(tmp_path, monkeypatch) -> Path:
    """A private, empty HF_HOME; Hub settings from the developer's shell are cleared."""
    home = tmp_path / "hf-home"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return home


@pytest.fixture
def fake_hub(hf_env, tiny_model_dir, monkeypatch):
    """A running fake Hub serving the tiny model as TINY_REPO; HF_ENDPOINT points at it."""
    hub = FakeHub()
    hub.add_model_dir(TINY_REPO, tiny_model_dir, revisions=("main", "v1"))
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    yield hub
    hub.stop()
