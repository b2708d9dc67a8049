"""Build the native CPU extension (``cpu_kernels/`` -> ``_mlxinfer_cpu*.so``) with CMake + nanobind.

Standard library only: ``setup.py`` loads this file by path inside pip's isolated build environment, where
mlxinfer itself is not importable. The extension's C++ ABI is tied to the exact MLX it was compiled against,
so every build writes a stamp (``_mlxinfer_cpu.json``: MLX version from the headers, source hash) next to the
module; the loader refuses a module whose stamp does not match the running MLX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Optional

MODULE = "_mlxinfer_cpu"
STAMP = MODULE + ".json"
_SOURCE_SUFFIXES = {".cpp", ".h", ".inc", ".txt"}


def module_filename() -> str:
    return MODULE + sysconfig.get_config_var("EXT_SUFFIX")


def sources_hash(source_dir: Path) -> str:
    """sha256 over the kernel sources (names and bytes), so a stale build is detectable."""
    h = hashlib.sha256()
    for p in sorted(source_dir.rglob("*")):
        if p.is_file() and p.suffix in _SOURCE_SUFFIXES:
            h.update(p.relative_to(source_dir).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def mlx_root(python: str = sys.executable) -> Path:
    """The installed mlx package folder (headers, libmlx, CMake config). mlx is a namespace package, so a stray
    ``mlx/`` folder in the working directory (MLX itself makes ``/tmp/mlx/<version>/``) can come first in its
    ``__path__``: take the entry that holds the headers."""
    out = subprocess.run(
        [python, "-c", "import mlx; print('\\n'.join(mlx.__path__))"], check=True, capture_output=True, text=True,
    ).stdout.split("\n")
    for entry in out:
        if entry.strip() and (Path(entry.strip()) / "include" / "mlx" / "version.h").is_file():
            return Path(entry.strip())
    raise RuntimeError(f"the installed MLX has no C++ headers (looked in {', '.join(o for o in out if o.strip())})")


def mlx_header_version(python: str = sys.executable) -> str:
    """major.minor.patch of the MLX headers the build will compile against (read from mlx/version.h)."""
    header = mlx_root(python) / "include" / "mlx" / "version.h"
    text = header.read_text()
    parts = [re.search(rf"#define MLX_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError(f"cannot read the MLX version from {header}")
    return ".".join(m.group(1) for m in parts)


NANOBIND = "nanobind==3.1.0"
CMAKE = "cmake>=3.25"


def _tools_env(tools: Optional[Path]) -> dict:
    """The environment for cmake and the compiler: ``tools`` (a ``pip install --target`` folder) first on PATH
    and PYTHONPATH, so its cmake and nanobind are found without touching the running environment."""
    env = dict(os.environ)
    if tools is not None:
        env["PATH"] = os.pathsep.join([str(tools / "bin"), env.get("PATH", "")])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(tools), env.get("PYTHONPATH", "")] if p)
    return env


def missing_tools(tools: Optional[Path] = None) -> list:
    """The PyPI requirements (cmake, nanobind) this environment (plus ``tools``) lacks for a build."""
    env = _tools_env(tools)
    missing = []
    if shutil.which("cmake", path=env["PATH"]) is None:
        missing.append(CMAKE)
    probe = subprocess.run([sys.executable, "-c", "import nanobind"], env=env, capture_output=True)
    if probe.returncode != 0:
        missing.append(NANOBIND)
    return missing


def installer() -> Optional[list]:
    """The command prefix that installs packages for this interpreter: its own pip; else uv (uv tool installs, and
    pipx's uv backend, make venvs without pip); else a pip on PATH pointed at it (pip >= 22.3 ``--python``)."""
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install"]
    if shutil.which("uv"):
        return ["uv", "pip", "install", "--python", sys.executable]
    for pip in ("pip3", "pip"):
        found = shutil.which(pip)
        if found:
            return [found, "--python", sys.executable, "install"]
    return None


def install_tools(requirements: list, target: Path, log: Optional[Callable[[str], None]] = None) -> None:
    """Install build requirements into ``target``, leaving the running environment as it is. Raises RuntimeError
    when that is not possible."""
    prefix = installer()
    if prefix is None:
        raise RuntimeError(f"cannot install {' and '.join(requirements)}: no pip or uv for {sys.executable}")
    cmd = [*prefix, "--quiet", "--upgrade", "--target", str(target), *requirements]
    if log:
        log(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"installing {' and '.join(requirements)} failed: {tail[0]}")


def toolchain_problem(tools: Optional[Path] = None) -> Optional[str]:
    """None when cmake, nanobind and a C++ compiler are available, else what is missing (one line)."""
    missing = missing_tools(tools)
    if CMAKE in missing:
        return "cmake is not installed (pip install 'cmake>=3.25')"
    cxx = os.environ.get("CXX")
    if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler found (install g++ or clang++)"
    if NANOBIND in missing:
        return f"nanobind is not installed (pip install {NANOBIND})"
    return None


def _rpath_flags() -> list:
    """Find libmlx next to the installed module (site-packages/mlx/lib) rather than in the temporary build
    environment the linker saw; mlx.core loads it first anyway, so this only keeps the module relocatable."""
    origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    flag = f"-Wl,-rpath,{origin}/../../mlx/lib"
    return ["-DCMAKE_SKIP_BUILD_RPATH=ON", f"-DCMAKE_MODULE_LINKER_FLAGS={flag}",
            f"-DCMAKE_SHARED_LINKER_FLAGS={flag}"]


def build(source_dir: Path, output_dir: Path, *, jobs: Optional[int] = None,
          log: Optional[Callable[[str], None]] = None, tools: Optional[Path] = None) -> Path:
    """Configure and compile ``source_dir`` into ``output_dir/<module>``; returns the module path.

    The module and its stamp are moved into place atomically, so a concurrent loader never sees half a file.
    Raises RuntimeError (with the tail of the compiler output) when the build fails.
    """
    source_dir, output_dir = Path(source_dir).resolve(), Path(output_dir).resolve()
    problem = toolchain_problem(tools)
    if problem:
        raise RuntimeError(problem)
    output_dir.mkdir(parents=True, exist_ok=True)
    version = mlx_header_version()
    with tempfile.TemporaryDirectory(prefix="mlxinfer-native-") as tmp:
        out_tmp = Path(tmp) / "out"
        configure = [
            "cmake", "-S", str(source_dir), "-B", str(Path(tmp) / "build"), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-DMLXINFER_OUTPUT_DIR={out_tmp}", *_rpath_flags(),
            f"-DMLX_ROOT={mlx_root() / 'share' / 'cmake' / 'MLX'}",
        ]
        compile_ = ["cmake", "--build", str(Path(tmp) / "build"), f"-j{jobs or os.cpu_count() or 1}"]
        for cmd in (configure, compile_):
            if log:
                log(" ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_tools_env(tools))
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
                raise RuntimeError(f"native CPU kernel build failed ({cmd[1]}):\n{tail}")
        built = out_tmp / module_filename()
        if not built.exists():
            raise RuntimeError(f"native CPU kernel build produced no {built.name}")
        target = output_dir / built.name
        staged = output_dir / (built.name + ".tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)
        stamp = {"mlx_version": version, "sources": sources_hash(source_dir), "python": sys.version.split()[0]}
        tmp_stamp = output_dir / (STAMP + ".tmp")
        tmp_stamp.write_text(json.dumps(stamp))
        os.replace(tmp_stamp, output_dir / STAMP)
    return target
