"""Fixtures for the per-architecture tests: tiny model directories (built once per session) and loaded models."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny_arch  # pytest puts this folder on sys.path (rootdir-less "prepend" import mode)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """``tiny_model_dir(name) -> Path``: the tiny ``name`` model of ``tiny_arch.ARCHS``, built on first use."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = tiny_arch.build(name, root / name, smollm2_dir)
        return built[name]

    return get


@pytest.fixture(scope="module", params=sorted(tiny_arch.ARCHS))
def arch(request) -> str:
    """Each architecture in turn; module scope groups a module's tests by architecture (one load each)."""
    return request.param


@pytest.fixture(scope="module")
def tiny(arch, tiny_model_dir):
    """The tiny ``arch`` model loaded through mlxinfer with MLX's built-in kernels."""
    import mlxinfer

    return mlxinfer.load(str(tiny_model_dir(arch)), kernels="builtin")
