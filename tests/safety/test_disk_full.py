"""A disk that fills up during a GGUF import or a conversion: one line naming the cause, exit 2, nothing
half-written left (no output, no temp dir, no cache entry).

Two ways to fill it: a file size limit in the child (``RLIMIT_FSIZE`` with SIGXFSZ ignored, so writes fail with
EFBIG; works anywhere), and a real full file system (a 256 KB tmpfs; only as root where ``mount`` works)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from safety_cli import MLXINFER, assert_one_line_error, write_tiny_llama
from test_gguf_hostile import make_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _run_limited(*args: str, limit: int | None, env: dict) -> subprocess.CompletedProcess:
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([*MLXINFER, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=180, preexec_fn=preexec, env={**os.environ, **env})


def _files(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob("*")) if where.exists() else []


def test_file_size_limit_during_gguf_import(tmp_path):
    small = make_gguf(tmp_path / "small.gguf")  # ~430 KB of float32 weights: the import writes as much
    cache = tmp_path / "cache"
    proc = _run_limited("generate", str(small), "-p", "hi", "-n", "1", limit=150_000,
                        env={"MLXINFER_CACHE": str(cache)})
    assert_one_line_error(proc, "file size limit", "small.gguf", "nothing was kept")
    assert _files(cache) == []


def test_file_size_limit_during_convert(tmp_path, tiny):
    out = tmp_path / "out"
    proc = _run_limited("convert", str(tiny), "-o", str(out), "--dtype", "float32", "--no-eval", limit=100_000,
                        env={})
    assert_one_line_error(proc, "file size limit", "nothing was kept")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_file_size_limit_during_convert_of_a_gguf(tmp_path):
    small = make_gguf(tmp_path / "small.gguf")
    out = tmp_path / "out"
    proc = _run_limited("convert", str(small), "-o", str(out), "--bits", "4", "--no-eval", limit=150_000,
                        env={"MLXINFER_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(proc, "file size limit", "nothing was kept")
    assert [p.name for p in tmp_path.iterdir()] == ["small.gguf"]


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KB tmpfs: writes fail with ENOSPC as on a real full disk."""
    where = tmp_path / "small-disk"
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("needs root and mount for a small tmpfs (the RLIMIT_FSIZE tests cover the rest)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_during_gguf_import(tmp_path, full_disk):
    small = make_gguf(tmp_path / "small.gguf")
    cache = full_disk / "cache"
    proc = _run_limited("generate", str(small), "-p", "hi", "-n", "1", limit=None, env={"MLXINFER_CACHE": str(cache)})
    assert_one_line_error(proc, "no space left", "nothing was kept")
    assert _files(full_disk) == []


def test_full_disk_during_convert(tiny, full_disk):
    out = full_disk / "out"
    proc = _run_limited("convert", str(tiny), "-o", str(out), "--dtype", "float32", "--no-eval", limit=None, env={})
    assert_one_line_error(proc, "space")  # the up-front estimate or the write itself: either way one line
    assert _files(full_disk) == []
