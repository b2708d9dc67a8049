"""Native MLX CPU kernels: custom primitives from ``cpu_kernels/`` (C++, nanobind), used on the CPU backend.

``provider()`` returns a ``KernelProvider`` ("cpu-native") or None; ``status()`` says in one line which build
is in use or why there is none. The extension is ABI-tied to the exact MLX version it was compiled against, so
a build is used only when its stamp matches the running MLX (and, in a source checkout, the current sources):

1. the module next to this file, built by ``pip install`` (setup.py) against the MLX in the build env;
2. else a module built on demand into ``$MLXINFER_CACHE/native/<mlx>-<python>-<sources>/`` (default
   ``$XDG_CACHE_HOME/mlxinfer``) by ``python -m mlxinfer.native build`` (or ``ensure_built()``), e.g. after MLX was
   upgraded; cmake and nanobind are fetched into that cache when the environment lacks them.

``problem()`` is the one line a front end shows when the kernels are off for a reason the user did not choose.

Environment: ``MLXINFER_NATIVE=0`` turns the kernels off; ``MLXINFER_THREADS=N`` sets the worker threads
(default: all cores); ``MLXINFER_ISA=generic|avx2float|avx2|avx2i8|avx512|avx512vnni|avx512vnnii8|avx512amx`` (x86) or
``generic|neon`` (arm64) forces a kernel variant (for tests). Prefill (more than 8 rows) on a CPU with AMX-BF16
(Intel Sapphire Rapids and later, when Linux grants the tile state) runs on AMX tiles by default: set
``avx512amx``, x split into two bf16 parts, float32-grade results (~1e-6 of an output's scale), 4- and 8-bit weights.
Elsewhere prefill of 4-bit weights runs an integer GEMM where the set has one: on the AVX2 integer and AVX-512 VNNI
sets x rounded to int16 per 32-element block by default (~1e-5 of an output's scale; 1.9x the float32 tiles with
VNNI, 1.1-1.3x with AVX2's vpmaddwd; ``MLXINFER_PREFILL=int16`` picks it over AMX); ``MLXINFER_PREFILL=int8`` rounds
it to int8 on the AVX2 integer and VNNI sets (llama.cpp's Q8_0 grade: faster, but it flips near-tied greedy tokens,
e.g. the bundled model's answer to "What is the capital of France?"; the set's name then ends in ``+int8-prefill``);
``MLXINFER_PREFILL=float`` keeps the float32 tiles. ``MLXINFER_DECODE=int8`` rounds decode's x to int8 as well, on
the CPU's int8 set (``avx512vnnii8`` with AVX-512 VNNI: 4- and 8-bit weights; else ``avx2i8``: 4-bit): llama.cpp's
accuracy class, faster for batches of sequences (``mlxinfer serve``), not for one stream.
On the AVX-512 VNNI sets (not AMX, not ``MLXINFER_PREFILL=float``) the 4-bit weights of layers that run as one op
are stored in row tiles (``mlxinfer.kernels.tiling``: 16 rows side by side, what the decode matvecs read fastest);
``MLXINFER_TILED=0`` keeps MLX's row-major layout.
``prefill_problem()``, ``decode_problem()`` and ``tiled_problem()`` are the one line for any other value, which the
kernels ignore.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional, Tuple

from mlxinfer.native import _build

_HERE = Path(__file__).resolve().parent
_REPO_SOURCES = _HERE.parent.parent / "cpu_kernels"
_PACKAGED_SOURCES = _HERE.parent / "data" / "cpu_kernels"

_state: dict = {}  # "module", "where", "reason", "provider" once loaded
BUILD_COMMAND = "python -m mlxinfer.native build"


def source_dir() -> Optional[Path]:
    """The C++ sources: the checkout's ``cpu_kernels/`` (editable install) or the copy shipped in the wheel."""
    for d in (_REPO_SOURCES, _PACKAGED_SOURCES):
        if (d / "CMakeLists.txt").is_file():
            return d
    return None


def cache_dir() -> Path:
    if os.environ.get("MLXINFER_CACHE"):
        root = Path(os.environ["MLXINFER_CACHE"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mlxinfer"
    return root / "native"


def _mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__.split(".dev")[0].split("+")[0]


def _cache_build_dir(mlx_version: str, sources: str) -> Path:
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    return cache_dir() / f"mlx{mlx_version}-{py}-{sources}"


def _check_stamp(directory: Path, mlx_version: str, sources: Optional[str]) -> Tuple[Optional[Path], str]:
    """(module path, "") when ``directory`` holds a build usable now, else (None, why not)."""
    so = directory / _build.module_filename()
    if not so.is_file():
        return None, f"no build in {directory}"
    try:
        stamp = json.loads((directory / _build.STAMP).read_text())
    except (OSError, ValueError):
        return None, f"{so.name} has no build stamp"
    if stamp.get("mlx_version") != mlx_version:
        return None, f"built for MLX {stamp.get('mlx_version')} but MLX {mlx_version} is installed"
    if sources is not None and stamp.get("sources") != sources:
        return None, "built from older cpu_kernels sources"
    return so, ""


def _import(path: Path) -> ModuleType:
    import mlx.core  # noqa: F401  registers mx.array with nanobind and loads libmlx before the extension

    spec = importlib.util.spec_from_file_location(_build.MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _locate() -> Tuple[Optional[Path], str]:
    """(module path, where) for the first usable build, or (None, why none is usable)."""
    mlx_version = _mlx_version()
    src = source_dir()
    sources = _build.sources_hash(src) if src is not None else None
    # A wheel has no sources to compare against; a checkout must match its current sources.
    installed, why_installed = _check_stamp(_HERE, mlx_version, sources if src == _REPO_SOURCES else None)
    if installed is not None:
        return installed, "built at install"
    if sources is not None:
        cached, _ = _check_stamp(_cache_build_dir(mlx_version, sources), mlx_version, sources)
        if cached is not None:
            return cached, f"built in {cached.parent}"
    state = "unusable" if why_installed.startswith("built for") else "not built"
    return None, f"native CPU kernels {state} ({why_installed}); run: {build_command()}"


def _load() -> Optional[ModuleType]:
    if "reason" in _state:
        return _state.get("module")
    if _disabled():
        _state["reason"] = "native CPU kernels disabled by MLXINFER_NATIVE=0"
        return None
    path, where = _locate()
    if path is None:
        _state["reason"] = where
        return None
    try:
        module = _import(path)
    except ImportError as exc:  # e.g. a libmlx symbol that moved: report, fall back to built-ins
        _state["reason"] = f"native CPU kernels failed to load ({exc})"
        return None
    env_threads = os.environ.get("MLXINFER_THREADS", "").strip()
    if env_threads.isdigit() and int(env_threads) > 0:
        module.set_num_threads(int(env_threads))
    _state.update(module=module, where=where, reason="")
    return module


def _disabled() -> bool:
    return os.environ.get("MLXINFER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def problem() -> Optional[str]:
    """One line when the native kernels are off although nobody asked for that (a build for another MLX, none at
    all, a failed load), with the fix; None when they run or MLXINFER_NATIVE=0 turned them off."""
    if _load() is not None or _disabled():
        return None
    reason = _state["reason"].split("; run:")[0]
    return (f"{reason}: decode is several times slower on MLX's built-in kernels; fix: {build_command()} "
            "(MLXINFER_NATIVE=0 hides this)")


# MLXINFER_PREFILL, as cpu_kernels/src/qmm_avx2i8gemm.cpp and select_kernels() (qmm_generic.cpp) read it
PREFILL_MODES = ("int8", "int16", "float")


def prefill_problem() -> Optional[str]:
    """One line when MLXINFER_PREFILL holds a value the kernels do not know (they then keep the default), else
    None."""
    value = os.environ.get("MLXINFER_PREFILL", "")
    if value in PREFILL_MODES or value == "":
        return None
    return (f"MLXINFER_PREFILL={value!r} is not a prefill mode and is ignored (prefill keeps its default); set "
            f"MLXINFER_PREFILL={', '.join(PREFILL_MODES[:-1])} or {PREFILL_MODES[-1]}, or unset it")


# The kernel sets whose decode matvecs round x to int8 (MLXINFER_DECODE=int8 picks the CPU's; MLXINFER_ISA=avx2i8
# or avx512vnnii8 forces one), and the set each one is, x at int16, otherwise.
INT8_DECODE_SETS = {"avx2i8": "avx2", "avx512vnnii8": "avx512vnni"}
# MLXINFER_DECODE, as select_kernels() (qmm_generic.cpp) reads it: int8, or the default int16
DECODE_MODES = ("int8", "int16")


def decode_problem() -> Optional[str]:
    """One line when MLXINFER_DECODE holds a value the kernels do not know, or asks for int8 where the kernel set
    in use has no int8 decode (MLXINFER_ISA forced another, or the CPU lacks AVX2); else None."""
    value = os.environ.get("MLXINFER_DECODE", "")
    if value == "" or value == "int16":
        return None
    if value not in DECODE_MODES:
        return (f"MLXINFER_DECODE={value!r} is not a decode mode and is ignored (decode keeps int16 x); set "
                f"MLXINFER_DECODE={' or '.join(DECODE_MODES)}, or unset it")
    module = _load()
    if module is not None and _base_isa(module) not in INT8_DECODE_SETS:
        return (f"MLXINFER_DECODE=int8 has no effect: the kernel set {_base_isa(module)} has no int8 decode "
                "(MLXINFER_ISA chose it, or the CPU has no AVX2)")
    return None


def tiled_requested() -> bool:
    """MLXINFER_TILED: one-op layers' 4-bit weights and the LM head in row tiles where the kernel set reads them
    (kernels.tiling): on unless it is 0 (an unknown value keeps it on; tiled_problem() names it)."""
    return os.environ.get("MLXINFER_TILED", "").strip() != "0"


def tiled_problem() -> Optional[str]:
    value = os.environ.get("MLXINFER_TILED", "").strip()
    if value in ("", "0", "1"):
        return None
    return f"MLXINFER_TILED={value!r} is not 0 or 1 and is ignored (tiles stay on); set it to 0 or 1, or unset it"


# MLXINFER_ISA, as select_kernels() (cpu_kernels/src/qmm_generic.cpp) reads it; "neon" names arm64's one set
ISA_NAMES = ("generic", "avx2float", "avx2", "avx2i8", "avx512", "avx512vnni", "avx512vnnii8", "avx512amx", "neon")


def isa_problem() -> Optional[str]:
    """One line when MLXINFER_ISA names no kernel set, or one this CPU cannot run (the kernels then pick another
    without a word: a typo such as avx512-vnni ran AVX2), else None."""
    value = os.environ.get("MLXINFER_ISA", "")
    if value == "":
        return None
    if value not in ISA_NAMES:
        return (f"MLXINFER_ISA={value!r} is not a kernel set and is ignored; set one of {', '.join(ISA_NAMES)}, "
                "or unset it (the best set this CPU runs)")
    module = _load()
    if module is not None and _base_isa(module) != value:
        why = "this CPU has no AMX or MLXINFER_PREFILL asks for another GEMM" if value == "avx512amx" else \
            "this CPU cannot run it"
        return f"MLXINFER_ISA={value} is not what runs ({why}): the kernels use {_base_isa(module)}"
    return None


def threads_problem() -> Optional[str]:
    value = os.environ.get("MLXINFER_THREADS", "").strip()
    if value == "" or (value.isdigit() and int(value) > 0):
        return None
    return (f"MLXINFER_THREADS={value!r} is not a positive whole number and is ignored (all cores are used); "
            "set it to 1, 2, ... or unset it")


def settings_problem() -> Optional[str]:
    """The native kernels' environment settings (MLXINFER_ISA, _PREFILL, _DECODE, _TILED, _THREADS) as one line,
    None when they are fine."""
    checks = (isa_problem(), prefill_problem(), decode_problem(), tiled_problem(), threads_problem())
    return "; ".join(line for line in checks if line) or None


def _switch_on(setter: Callable[[bool], bool]) -> bool:
    """A kernel switch's current setting, read by setting and restoring it: the module has setters only."""
    was = setter(True)
    setter(was)
    return bool(was)


def _base_isa(module: ModuleType) -> str:
    """The kernel set's name without what follows '+' ("avx2i8+int8-prefill" -> "avx2i8")."""
    return module.isa().split("+")[0]


def int8_decode_active(module: Optional[ModuleType] = None) -> bool:
    """Whether decode's matvecs round x to int8 now (4-bit weights; on avx512vnnii8 8-bit ones too): a set of
    INT8_DECODE_SETS with its int8 path on (the load-time self-check turns it off while it runs)."""
    module = module if module is not None else _load()
    if module is None or _base_isa(module) not in INT8_DECODE_SETS or not hasattr(module, "set_int8_decode"):
        return False
    return _switch_on(module.set_int8_decode)


def int8_prefill_active(module: Optional[ModuleType] = None) -> bool:
    """Whether prefill's 4-bit GEMMs round x to int8 now: a set with the int8 GEMM and its switch on
    (MLXINFER_PREFILL=int8 starts it so; ``set_int8_prefill``/``int8_activations`` change it at run time)."""
    module = module if module is not None else _load()
    if module is None or not getattr(module, "has_int8_prefill", lambda: False)():
        return False
    return _switch_on(module.set_int8_prefill)


def report_notes() -> list:
    """Clauses for the kernel report: the decode and prefill precision where it is int8, and a bad
    MLXINFER_PREFILL."""
    module = _load()
    notes = []
    if module is not None and int8_decode_active(module):
        isa = _base_isa(module)
        notes.append(f"decode at int8 ({isa}: the matvecs' x rounded per group, llama.cpp's grade; unset "
                     f"MLXINFER_DECODE / MLXINFER_ISA for int16)")
    if module is not None and int8_prefill_active(module):
        notes.append(f"prefill at int8 ({_base_isa(module)}: the 4-bit layers' x rounded per 32-block, "
                     "llama.cpp's Q8_0 grade; unset MLXINFER_PREFILL for the precise path)")
    line = settings_problem()
    if line:
        notes.append(f"warning: {line}")
    return notes


@contextlib.contextmanager
def int8_activations(*, decode: Optional[bool] = None, prefill: Optional[bool] = None,
                     ext: Optional[ModuleType] = None) -> Iterator[None]:
    """The kernels' int8 activation paths on (True) or off (False) while inside, None leaving one as it is: decode
    (the int8 sets' matvecs, int16 x when off) and prefill (the int8 GEMM; off: the precise path, int16 on
    the AVX2 integer and VNNI sets, else float32 tiles). The
    settings found are restored. ``ext``: the extension module (default: the loaded one). A build without such a
    path has nothing to switch (it already runs the precise one)."""
    ext = ext if ext is not None else extension()
    toggles = [(getattr(ext, name, None), on) for name, on in (("set_int8_decode", decode),
                                                                ("set_int8_prefill", prefill)) if on is not None]
    before = [(t, t(on)) for t, on in toggles if t is not None]
    try:
        yield
    finally:
        for t, was in before:
            t(was)


def build_command() -> str:
    """The rebuild command for this interpreter: pipx and uv tool installs have their own, not the ``python``
    on PATH."""
    import shutil

    found = shutil.which("python")
    if found is not None and Path(found).absolute().parent == Path(sys.executable).absolute().parent:
        return BUILD_COMMAND
    return f"{sys.executable} -m mlxinfer.native build"


def reset() -> None:
    """Forget the loaded state so the next call looks again (after a build; tests)."""
    _state.clear()


def extension() -> Optional[ModuleType]:
    """The loaded ``_mlxinfer_cpu`` module, or None (see ``status()``)."""
    return _load()


def status() -> str:
    """One line: which native build is in use (ISA, threads, MLX version) or why none is."""
    module = _load()
    if module is None:
        return _state["reason"]
    return (
        f"native CPU kernels ({module.isa()}, {module.num_threads()} threads, MLX {module.mlx_version}, "
        f"{_state['where']})"
    )


def set_num_threads(n: int) -> None:
    """Worker threads for the native kernels (the calling thread included)."""
    module = _load()
    if module is not None:
        module.set_num_threads(int(n))


def provider():
    """The "cpu-native" KernelProvider, or None when the extension is unavailable (see ``status()``)."""
    module = _load()
    if module is None:
        return None
    if "provider" not in _state:
        from mlxinfer.native.cpu_provider import NativeCpuProvider

        _state["provider"] = NativeCpuProvider(module)
    return _state["provider"]


def ensure_built(log: Optional[Callable[[str], None]] = None, *, install_tools: bool = True) -> Path:
    """Return a usable module path, building into the cache when no usable build exists.

    cmake and nanobind missing from this environment are installed into ``cache_dir()/tools`` first (with this
    interpreter's pip, or uv), so this works on a plain ``pip``/``pipx``/``uv tool`` install that only needs a C++
    compiler. Raises RuntimeError with the reason when it cannot be built (no sources or compiler, build error).
    """
    path, _ = _locate()
    if path is not None:
        return path
    src = source_dir()
    if src is None:
        raise RuntimeError("the cpu_kernels sources are not installed with mlxinfer (reinstall mlxinfer)")
    tools = cache_dir() / "tools"
    missing = _build.missing_tools(tools)
    if missing and install_tools:
        if log:
            log(f"fetching the build tools {', '.join(missing)} into {tools}")
        _build.install_tools(missing, tools, log=log)
    out = _cache_build_dir(_mlx_version(), _build.sources_hash(src))
    built = _build.build(src, out, log=log, tools=tools)
    reset()
    return built
