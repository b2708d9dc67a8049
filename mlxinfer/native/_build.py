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


def mlx_header_version(python: str = sys.executable) -> str:
    """major.minor.patch of the MLX headers the build will compile against (read from mlx/version.h)."""
    out = subprocess.run(
        [python, "-c", "import mlx, os; print(os.path.join(list(mlx.__path__)[0], 'include', 'mlx', 'version.h'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    text = Path(out).read_text()
    parts = [re.search(rf"#define MLX_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError(f"cannot read the MLX version from {out}")
    return ".".join(m.group(1) for m in parts)


def toolchain_problem() -> Optional[str]:
    """None when cmake and a C++ compiler are on PATH, else what is missing (one line)."""
    if shutil.which("cmake") is None:
        return "cmake is not installed"
    cxx = os.environ.get("CXX")
    if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler found (install g++ or clang++)"
    try:
        import nanobind  # noqa: F401  (only its CMake files and sources are used)
    except ImportError:
        return "nanobind is not installed (pip install nanobind==3.1.0)"
    return None


def build(source_dir: Path, output_dir: Path, *, jobs: Optional[int] = None,
          log: Optional[Callable[[str], None]] = None) -> Path:
    """Configure and compile ``source_dir`` into ``output_dir/<module>``; returns the module path.

    The module and its stamp are moved into place atomically, so a concurrent loader never sees half a file.
    Raises RuntimeError (with the tail of the compiler output) when the build fails.
    """
    source_dir, output_dir = Path(source_dir).resolve(), Path(output_dir).resolve()
    problem = toolchain_problem()
    if problem:
        raise RuntimeError(problem)
    output_dir.mkdir(parents=True, exist_ok=True)
    version = mlx_header_version()
    with tempfile.TemporaryDirectory(prefix="mlxinfer-native-") as tmp:
        out_tmp = Path(tmp) / "out"
        configure = [
            "cmake", "-S", str(source_dir), "-B", str(Path(tmp) / "build"), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-DMLXINFER_OUTPUT_DIR={out_tmp}",
        ]
        compile_ = ["cmake", "--build", str(Path(tmp) / "build"), f"-j{jobs or os.cpu_count() or 1}"]
        for cmd in (configure, compile_):
            if log:
                log(" ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True)
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
