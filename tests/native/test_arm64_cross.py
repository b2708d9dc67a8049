"""The arm64 (NEON) kernels, checked on x86: cross-compiled and run under qemu-aarch64.

Needs ``g++-aarch64-linux-gnu`` and ``qemu-user`` (Debian packages); skipped with the reason where they are
missing. This checks correctness only; arm64 speed has not been measured in this project.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "cpu_kernels" / "src"
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt install g++-aarch64-linux-gnu qemu-user)")


def test_neon_and_portable_kernels_under_qemu(tmp_path):
    """Decode matvec, prefill matmul (bits 4/8, groups 32/64/128), SwiGLU gate and attention (float32 and float16
    KV) of the generic and NEON sets against a float64 reference (tests/native/arm64_harness.cpp)."""
    _need(CXX, QEMU)
    exe = tmp_path / "harness"
    sources = [Path(__file__).with_name("arm64_harness.cpp"), SRC / "qmm_generic.cpp", SRC / "qmm_neon.cpp"]
    subprocess.run([CXX, "-std=c++20", "-O2", "-static", f"-I{SRC}", *map(str, sources), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "neon attention L=30 causal f16 kv" in run.stdout and "0 failure(s)" in run.stdout


def test_every_source_compiles_for_arm64(tmp_path):
    """The MLX-facing sources (primitives, pool, the fused layer) build for arm64 too (compile only: linking
    needs an arm64 libmlx)."""
    _need(CXX)
    import mlx

    include = Path(list(mlx.__path__)[0]) / "include"
    sources = [p for p in sorted(SRC.glob("*.cpp"))
               if p.name not in ("bindings.cpp", "qmm_avx2.cpp", "qmm_avx2int.cpp", "qmm_avx512.cpp", "qmm_vnni.cpp",
                                 "qmm_vnni_i8.cpp", "qmm_vnni_gemm.cpp")]
    assert any(p.name == "layer.cpp" for p in sources)
    for src in sources:
        out = subprocess.run([CXX, "-std=c++20", "-fsyntax-only", f"-I{include}", f"-I{SRC}", str(src)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{src.name}: {out.stderr[-2000:]}"
