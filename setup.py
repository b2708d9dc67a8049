"""Build hooks that pyproject.toml cannot express.

The top-level ``models.toml`` and ``metal_kernels/`` are the sources of truth; a wheel carries copies of them
under ``mlxinfer/data/`` so that ``importlib.resources`` finds them after ``pip install``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

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


setup(cmdclass={"build_py": BuildPyWithData})
