"""How mlxinfer.native finds (or refuses) a build, and the fallback when there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_mismatch_is_a_visible_problem_with_a_fix(isolated):
    """A build for another MLX is named as the reason, with the command that fixes it, in one line."""
    (isolated / _build.module_filename()).write_bytes(b"not a real module")
    (isolated / _build.STAMP).write_text(json.dumps({"mlx_version": "0.32.3", "sources": "x"}))
    line = native.problem()
    assert line is not None and "\n" not in line
    assert "unusable (built for MLX 0.32.3 but MLX" in line and "mlxinfer.native build" in line
    assert "slower" in line


def test_no_problem_when_loaded_or_disabled(monkeypatch, isolated):
    monkeypatch.setenv("MLXINFER_NATIVE", "0")
    native.reset()
    assert native.problem() is None


def test_build_command_names_this_interpreter_when_python_is_another(monkeypatch, tmp_path):
    """pipx / uv tool installs: the `python` on PATH is not the one mlxinfer runs in."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\n")
    (other / "python").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    assert native.build_command() == f"{sys.executable} -m mlxinfer.native build"
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    if os.path.exists(os.path.join(os.path.dirname(sys.executable), "python")):
        assert native.build_command() == "python -m mlxinfer.native build"


def test_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("MLXINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "mlxinfer" / "native"
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "own"))
    assert native.cache_dir() == tmp_path / "own" / "native"


def test_missing_tools_are_fetched_into_the_cache_not_the_environment(monkeypatch, tmp_path):
    """Without cmake/nanobind, ensure_built installs them with --target into the cache, then builds with them."""
    calls = {}
    monkeypatch.setattr(native, "_HERE", tmp_path / "pkg")
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "missing_tools", lambda tools=None: [_build.NANOBIND])
    monkeypatch.setattr(_build, "install_tools", lambda reqs, target, log=None: calls.update(reqs=reqs, target=target))

    def fake_build(src, out, log=None, tools=None):
        calls.update(out=out, tools=tools)
        raise RuntimeError("stop here")

    monkeypatch.setattr(_build, "build", fake_build)
    native.reset()
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            native.ensure_built()
    finally:
        native.reset()
    assert calls["reqs"] == [_build.NANOBIND] and calls["target"] == tmp_path / "cache" / "native" / "tools"
    assert calls["tools"] == calls["target"] and str(calls["out"]).startswith(str(tmp_path / "cache" / "native"))


def test_install_tools_uses_target_and_reports_failure(monkeypatch, tmp_path):
    seen = []

    class Proc:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for nanobind==3.1.0"

    monkeypatch.setattr(_build.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Proc())
    with pytest.raises(RuntimeError, match="installing nanobind==3.1.0 failed: ERROR: No matching"):
        _build.install_tools([_build.NANOBIND], tmp_path / "tools")
    assert "--target" in seen[0] and str(tmp_path / "tools") in seen[0] and seen[0][-1] == _build.NANOBIND


@pytest.mark.slow
def test_plain_install_rebuild_for_another_mlx(tmp_path):
    """The advertised fix, end to end: the installed build is for another MLX and nanobind is not installed in
    this environment; `python -m mlxinfer.native build` fetches it into the cache, compiles the sources into
    $XDG_CACHE_HOME/mlxinfer/native and the kernels load from there."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys, pathlib\n"
        "from mlxinfer import native\n"
        "from mlxinfer.native import _build, __main__ as cli\n"
        f"pkg = pathlib.Path({str(tmp_path / 'pkg')!r}); pkg.mkdir()\n"
        "(pkg / _build.module_filename()).write_bytes(b'x')\n"
        "(pkg / _build.STAMP).write_text(json.dumps({'mlx_version': '0.0.1', 'sources': 'x'}))\n"
        "native._HERE = pkg\n"
        "assert native.problem() and 'built for MLX 0.0.1' in native.problem()\n"
        "native.reset()\n"
        "rc = cli.main(['build'])\n"
        "print('RC', rc, native.problem(), native.status())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLXINFER_CACHE", "MLXINFER_NATIVE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    if "no C++ compiler" in proc.stderr:
        pytest.skip("no C++ compiler here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RC 0 None native CPU kernels (") and str(tmp_path / "xdg" / "mlxinfer" / "native") in last
    if not _build.missing_tools():  # nanobind was already here: nothing to fetch
        return
    assert (tmp_path / "xdg" / "mlxinfer" / "native" / "tools" / "nanobind").is_dir()


_MISMATCH_RUN = """
import json, pathlib, sys
from mlxinfer import native
from mlxinfer.native import _build
pkg = pathlib.Path(sys.argv[1])
pkg.mkdir(exist_ok=True)
(pkg / _build.module_filename()).write_bytes(b"x")
(pkg / _build.STAMP).write_text(json.dumps({"mlx_version": "0.32.3", "sources": "x"}))
native._HERE = pkg  # an install whose module was built for MLX 0.32.3
from mlxinfer.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["generate", "smollm2", "-p", "Hi", "--max-tokens", "2", "--temp", "0"],
    ["chat", "smollm2", "--max-tokens", "2", "--temp", "0"],
    ["bench", "smollm2", "-p", "8", "-n", "2", "-r", "1", "--warmup", "0"],
], ids=["generate", "chat", "bench"])
def test_mismatch_is_one_warning_line_in_each_command(args, tmp_path, smollm2_dir):
    """The case that cost 6.2 instead of 79.9 tok/s silently: now one line on stderr, naming the versions and the
    fix, in generate, chat (piped) and bench; none with --kernels builtin (asked for)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLXINFER_NATIVE", "MLXINFER_KERNELS")}
    env["NO_COLOR"] = "1"
    run = [sys.executable, "-c", _MISMATCH_RUN, str(tmp_path / "pkg"), *args]
    proc = subprocess.run(run, input="Hi\n", capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, proc.stderr
    assert "built for MLX 0.32.3 but MLX" in warnings[0] and "mlxinfer.native build" in warnings[0]
    if args[0] == "generate":
        quiet = subprocess.run([*run, "--kernels", "builtin"], input="", capture_output=True, text=True, env=env,
                               timeout=300)
        assert quiet.returncode == 0 and "warning:" not in quiet.stderr, quiet.stderr


def test_installer_for_venvs_without_pip(monkeypatch):
    """uv tool installs (and pipx's uv backend) make venvs without pip: uv, else a pip on PATH pointed at this
    interpreter (used by `python -m mlxinfer.native build` and `mlxinfer pull`)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    paths = {"uv": "/x/uv", "pip3": "/usr/bin/pip3"}
    monkeypatch.setattr(_build.shutil, "which", lambda name, **kw: paths.get(name))
    assert _build.installer() == ["uv", "pip", "install", "--python", sys.executable]
    del paths["uv"]
    assert _build.installer() == ["/usr/bin/pip3", "--python", sys.executable, "install"]
    paths.clear()
    assert _build.installer() is None
    with pytest.raises(RuntimeError, match="no pip or uv"):
        _build.install_tools([_build.NANOBIND], Path("/nonexistent"))


def test_mlx_headers_found_past_a_stray_mlx_folder(tmp_path, monkeypatch):
    """MLX makes /tmp/mlx/<version>/; run from /tmp, that folder was mlx.__path__[0] and the build looked for the
    headers there."""
    (tmp_path / "mlx" / "0.32.3").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    root = _build.mlx_root()
    assert root != tmp_path / "mlx" and (root / "include" / "mlx" / "version.h").is_file()
    import mlx.core as mx

    assert _build.mlx_header_version() == mx.__version__.split(".dev")[0]
