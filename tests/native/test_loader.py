"""How mlxinfer.native finds (or refuses) a build, and the fallback when there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxinfer import native
from mlxinfer.native import _build


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """mlxinfer.native looking at an empty package dir and an empty cache."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    monkeypatch.setattr(native, "_HERE", pkg)
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXINFER_NATIVE", raising=False)
    native.reset()
    yield pkg
    native.reset()


def test_missing_extension_falls_back_with_one_line(isolated):
    assert native.provider() is None
    why = native.status()
    assert "not built" in why and "python -m mlxinfer.native build" in why and "\n" not in why


def test_build_for_another_mlx_is_refused(isolated):
    (isolated / _build.module_filename()).write_bytes(b"not a real module")
    (isolated / _build.STAMP).write_text(json.dumps({"mlx_version": "0.0.1", "sources": "x"}))
    assert native.provider() is None
    assert "built for MLX 0.0.1" in native.status()


def test_stale_sources_are_refused(isolated):
    import mlx.core as mx

    (isolated / _build.module_filename()).write_bytes(b"not a real module")
    (isolated / _build.STAMP).write_text(json.dumps({"mlx_version": mx.__version__, "sources": "old"}))
    path, why = native._check_stamp(isolated, native._mlx_version(), _build.sources_hash(native.source_dir()))
    assert path is None and "older cpu_kernels sources" in why


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("MLXINFER_NATIVE", "0")
    native.reset()
    try:
        assert native.provider() is None
        assert native.status() == "native CPU kernels disabled by MLXINFER_NATIVE=0"
    finally:
        monkeypatch.delenv("MLXINFER_NATIVE")
        native.reset()


def test_patch_reports_builtin_when_missing(isolated):
    """The loader path: without the extension, apply_kernels keeps MLX built-ins and says why."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxinfer.kernels.patch import apply_kernels

    model = nn.Sequential(nn.QuantizedLinear(64, 32, group_size=32, bits=4))
    with mx.stream(mx.cpu):
        report = apply_kernels(model, "auto")
    assert report.name == "builtin" and "not built" in report.detail


@pytest.mark.slow
def test_thread_override_from_environment(native_ext):
    code = "from mlxinfer import native; print(native.extension().num_threads()); print(native.status())"
    env = {**os.environ, "MLXINFER_THREADS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    threads, status = out.splitlines()
    assert threads == "3" and "3 threads" in status and f"MLX {native_ext.mlx_version}" in status
