"""Fixtures: a tiny tokenizer and tiny random-weight Hugging Face models (llama, qwen2, qwen3), built once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tinymodels import make_hf_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def llama_src(tmp_path_factory, tok_dir) -> Path:
    # 8 layers so the "sensitive" selector picks layers 0, 3, 6, 7 (llama.cpp's rule for n = 8).
    return make_hf_model(tmp_path_factory.mktemp("llama"), tok_dir, "llama", layers=8)


@pytest.fixture(scope="session")
def qwen2_src(tmp_path_factory, tok_dir) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen2"), tok_dir, "qwen2", seed=1, shards=1)


@pytest.fixture(scope="session")
def qwen3_src(tmp_path_factory, tok_dir) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen3"), tok_dir, "qwen3", seed=2)


@pytest.fixture(scope="session")
def sources(llama_src, qwen2_src, qwen3_src) -> dict[str, Path]:
    return {"llama": llama_src, "qwen2": qwen2_src, "qwen3": qwen3_src}
