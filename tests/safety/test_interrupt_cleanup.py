"""SIGTERM and SIGHUP clean up like Ctrl-C; what SIGKILL leaves is swept by the next run, never a live run's.

Real processes on the bundled SmolLM2 GGUF (a few seconds of import and conversion): the signal is sent at a
point the test can see on disk (the temp dir, its GGUF import, its first weight shard). Afterwards: exit
128 + signum, no traceback, no temp dir, no output, nothing in the cache."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safety_cli import MLXINFER, run
from test_gguf_hostile import make_gguf

pytestmark = pytest.mark.slow


def _start(*args: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*MLXINFER, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MLXINFER_CACHE": str(cache)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job may inherit SIG_IGN
    )


def _wait_for(proc: subprocess.Popen, find, timeout: float = 180) -> Path:
    """Poll until ``find()`` returns a path (the moment to signal); the process must still be running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = find()
        if hit:
            return hit
        if proc.poll() is not None:
            raise AssertionError(f"the process ended first ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.005)
    proc.kill()
    raise AssertionError("the point to signal at never came")


def _temp_dirs(where: Path) -> list[Path]:
    return sorted(where.rglob(".*.tmp-*")) + sorted(where.rglob(".*.old-*")) if where.exists() else []


def _first(pattern: str, where: Path):
    def find():
        hits = sorted(where.glob(pattern)) if where.exists() else []
        return hits[0] if hits else None
    return find


def _assert_terminated(proc: subprocess.Popen, signum: int) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == ["terminated"], err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_during_gguf_import_leaves_nothing(tmp_path, bundled_gguf, sig):
    cache = tmp_path / "cache"
    proc = _start("generate", str(bundled_gguf), "-p", "hi", "-n", "1", cache=cache)
    tmp = _wait_for(proc, _first("gguf/.*.tmp-*/model.safetensors", cache))  # tensors are being written
    proc.send_signal(sig)
    _assert_terminated(proc, sig)
    assert not tmp.exists() and _temp_dirs(cache) == []
    assert not (cache / "gguf").exists() or list((cache / "gguf").iterdir()) == []


@pytest.mark.parametrize("point", ["import", "shards"])
def test_sigterm_during_convert_leaves_nothing(tmp_path, bundled_gguf, point):
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = _start("convert", str(bundled_gguf), "-o", str(out), "--bits", "8", "--no-eval", "--shard-size", "20MB",
                  cache=cache)
    pattern = ".out.tmp-*/._gguf.tmp-*/model.safetensors" if point == "import" else ".out.tmp-*/model-*.safetensors"
    _wait_for(proc, _first(pattern, tmp_path))
    proc.send_signal(signal.SIGTERM)
    _assert_terminated(proc, signal.SIGTERM)
    assert not out.exists() and _temp_dirs(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] in ([], ["cache"])


def test_sigkill_leftovers_are_swept_by_the_next_import(tmp_path, bundled_gguf):
    cache = tmp_path / "cache"
    proc = _start("generate", str(bundled_gguf), "-p", "hi", "-n", "1", cache=cache)
    _wait_for(proc, _first("gguf/.*.tmp-*/model.safetensors", cache))
    proc.kill()
    proc.wait(timeout=60)
    (stale,) = [p for p in (cache / "gguf").iterdir() if ".tmp-" in p.name]
    assert f".tmp-{proc.pid}-" in stale.name

    # two leftovers that must survive: a live process's (our pid) and one whose lock a concurrent run holds
    live = cache / "gguf" / f".abc-v4.tmp-{os.getpid()}-live"
    live.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    locked = cache / "gguf" / f".def-v4.tmp-{dead.pid}-locked"  # a dead pid here, but the lock is held
    locked.mkdir()
    import fcntl

    fd = os.open(locked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        small = make_gguf(tmp_path / "small.gguf")
        done = run("generate", str(small), "-p", "hi", "-n", "1", env={"MLXINFER_CACHE": str(cache)})
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
        assert live.exists() and locked.exists()
    finally:
        os.close(fd)


def test_sigkill_leftovers_are_swept_by_the_next_convert(tmp_path, bundled_gguf):
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = _start("convert", str(bundled_gguf), "-o", str(out), "--bits", "8", "--no-eval", cache=cache)
    tmp = _wait_for(proc, _first(".out.tmp-*", tmp_path))
    proc.kill()
    proc.wait(timeout=60)
    assert tmp.exists()
    small = make_gguf(tmp_path / "small.gguf")
    done = run("convert", str(small), "-o", str(out), "--bits", "4", "--no-eval", env={"MLXINFER_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert not tmp.exists() and (out / "config.json").exists() and _temp_dirs(tmp_path) == []


# -- the shared temp-dir code itself (mlxinfer.fsutil), in-process ------------------------------------------
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt(), "terminated"])
def test_atomic_dir_leaves_nothing_on_any_exit(tmp_path, exc):
    from mlxinfer.errors import Terminated
    from mlxinfer.fsutil import AtomicDir

    exc = Terminated(signal.SIGTERM) if exc == "terminated" else exc
    target = tmp_path / "a" / "b" / "out"  # two parent folders it has to create
    with pytest.raises(type(exc)):
        with AtomicDir(target) as d:
            (d.path / "weights").write_bytes(b"x" * 1000)
            raise exc
    assert list(tmp_path.iterdir()) == []  # the temp dir and the folders made for it are gone


def test_atomic_dir_publish_replaces_whole(tmp_path):
    from mlxinfer.fsutil import AtomicDir

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.safetensors").write_text("old")
    with AtomicDir(target) as d:
        (d.path / "new.safetensors").write_text("new")
        d.publish(replace=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["new.safetensors"]


def test_signals_wait_for_cleanup_to_finish(tmp_path):
    """SIGTERM during a cleanup block is delivered after it, so the cleanup is never cut short."""
    from mlxinfer.errors import Terminated
    from mlxinfer.fsutil import signals_deferred

    def handler(signum, _frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    done = []
    try:
        with pytest.raises(Terminated):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("cleanup finished")
        assert done == ["cleanup finished"]
    finally:
        signal.signal(signal.SIGTERM, previous)
