"""Build hooks that pyproject.toml cannot express.

The top-level ``models.toml`` and ``metal_kernels/`` are the sources of truth; a wheel carries copies of them
under ``mlxinfer/data/`` so that ``importlib.resources`` finds them after ``pip install``.

``cpu_kernels/`` is compiled into ``mlxinfer/native/_mlxinfer_cpu*.so`` (CMake + nanobind, against the MLX in
the build environment) when a C++ toolchain is there. The build is optional: without a compiler the install
still succeeds and mlxinfer runs on MLX's built-in kernels (``python -m mlxinfer.native status`` says why).
``MLXINFER_BUILD_NATIVE=0`` skips it (a pure ``py3-none-any`` wheel; ``python -m mlxinfer.native build`` can
compile the shipped sources later).

Wheel tags: without the native module the wheel is ``py3-none-any``. With it, setuptools tags the wheel
``cpXY-cpXY-linux_x86_64`` (macOS: ``macosx_<target>_arm64``, already acceptable to PyPI); on Linux, retag it with
auditwheel, leaving MLX's own library to the mlx wheel it comes from:
    auditwheel repair --exclude libmlx.so -w dist/ dist/mlxinfer-*-linux_x86_64.whl
(tests/packaging/test_wheel.py does exactly this.)
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).parent.resolve()


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        data = Path(self.build_lib) / "mlxinfer" / "data"
        data.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "models.toml", data / "models.toml")
        kernels = ROOT / "metal_kernels"
        if kernels.is_dir():
            shutil.copytree(kernels, data / "metal_kernels", dirs_exist_ok=True)
        # The native kernel sources too, so an installed mlxinfer can rebuild them for another MLX version.
        cpu = ROOT / "cpu_kernels"
        if cpu.is_dir():
            shutil.copytree(cpu, data / "cpu_kernels", dirs_exist_ok=True)


def _native_build_module():
    # By path: mlxinfer itself is not importable inside pip's isolated build environment.
    spec = importlib.util.spec_from_file_location("_mlxinfer_native_build", ROOT / "mlxinfer" / "native" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """Build the native CPU kernels when possible; a failure is a warning, never a failed install."""

    def run(self):
        for ext in self.extensions:
            self.build_extension(ext)

    def build_extension(self, ext):
        # Inplace (editable install): next to mlxinfer/native/__init__.py; otherwise into build_lib.
        target_dir = Path(self.get_ext_fullpath(ext.name)).parent
        if self.inplace:
            target_dir = ROOT / "mlxinfer" / "native"
        try:
            _native_build_module().build(ROOT / "cpu_kernels", target_dir)
        except Exception as exc:  # noqa: BLE001  (no compiler, no cmake, compile error: fall back to MLX)
            print(
                f"warning: mlxinfer native CPU kernels were not built ({str(exc).splitlines()[0]}); "
                "MLX built-in kernels will be used. Details: python -m mlxinfer.native build",
                file=sys.stderr,
            )

    def get_outputs(self):
        # Only what was really built, so editable/wheel packaging never asks for a missing file.
        outputs = []
        for ext in self.extensions:
            d = Path(self.get_ext_fullpath(ext.name)).parent
            outputs += [str(p) for p in d.glob("_mlxinfer_cpu*") if p.suffix in (".so", ".pyd", ".json")]
        return outputs


def _native_enabled() -> bool:
    return os.environ.get("MLXINFER_BUILD_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


class WheelTags(bdist_wheel):
    """A wheel whose native module was not built (switched off, or no compiler) is pure Python: tag it so."""

    def get_tag(self):
        build_lib = Path(self.get_finalized_command("build").build_lib)
        if not any((build_lib / "mlxinfer" / "native").glob("_mlxinfer_cpu*.so")):
            return "py3", "none", "any"
        return super().get_tag()


setup(
    cmdclass={"build_py": BuildPyWithData, "build_ext": BuildNative, "bdist_wheel": WheelTags},
    ext_modules=[Extension("mlxinfer.native._mlxinfer_cpu", sources=[])] if _native_enabled() else [],
)
