"""Run the Metal kernels on the CPU: test infrastructure for machines without Apple hardware.

1. MLX generates the complete Metal source of each kernel instance (``mx.export_function`` with a GPU stream and
   ``verbose=True`` prints it even on the CPU build; we capture file descriptor 1).
2. That exact source is compiled by g++ (C++20) after ``metal_kernels/compat_emu.h``, which emulates Metal's
   execution model with cooperative fibers (see that header for what it does and does not check), together with
   one small generated ``extern "C"`` launcher per instance.
3. ``Emulator`` is a ``build.Runner``: it binds numpy views of the inputs (strided ones in place), runs the
   launch and returns MLX arrays. The shared library is cached by content hash, so it is compiled once.

``Emulator("cuda")`` runs the CUDA route instead: the source MLX's CUDA backend would build (``compat_cuda.h`` +
the same bodies, wrapped as in mlx/backend/cuda/custom_kernel.cpp) on the same fibers, with
``emu_cuda_prelude.h`` standing in for CUDA's headers (threadIdx, __shfl_*_sync, __syncthreads, __half).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from mlxinfer.kernels.build import SPECS, Launch, get_kernel, kernel_dir, kernel_header, split_kernel

CXX_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-w"]
_SOURCE_RE = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", re.S)
_SIGNATURE_RE = re.compile(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", re.S)
_PARAM_RE = re.compile(r"^\s*(.*?)\s*(\w+) \[\[(.*)\]\]$")
PRELUDES = {"metal": "compat_emu.h", "cuda": "emu_cuda_prelude.h"}
MAX_NDIM = 10  # shape/strides arrays are padded to this (CUDA passes fixed-size arrays; Metal reads a prefix)
_CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.uint32: "uint32_t",
               mx.int32: "int32_t"}
_NP = {mx.float16: np.float16, mx.bfloat16: np.uint16, mx.float32: np.float32, mx.uint32: np.uint32,
       mx.int32: np.int32}


class EmulatorError(RuntimeError):
    pass


def instance_key(launch: Launch) -> Tuple:
    """What determines the generated source: kernel, template values, input dtypes/placement, output dtypes."""
    ins = tuple((str(a.dtype), a.ndim == 0, a.size < 8) for a in launch.inputs)
    return (launch.kernel, tuple((n, str(v)) for n, v in launch.template), ins, tuple(map(str, launch.output_dtypes)))


def metal_sources(launches: Sequence[Launch]) -> List[Tuple[str, str]]:
    """(MLX kernel name, full generated Metal source) for each launch, in order, from one export."""
    flat = [a for launch in launches for a in launch.inputs]

    def traced(*arrays):
        outs, i = [], 0
        for launch in launches:
            ins = list(arrays[i:i + len(launch.inputs)])
            i += len(launch.inputs)
            outs += get_kernel(launch.kernel, "metal")(
                inputs=ins, template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
                output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes, stream=mx.gpu, verbose=True,
            )
        return outs

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "stdout.txt"
        saved = os.dup(1)
        try:
            with open(log, "wb") as f:
                os.dup2(f.fileno(), 1)  # MLX prints from C++ straight to file descriptor 1
                mx.export_function(str(Path(tmp) / "k.mlxfn"), traced, *flat)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        found = _SOURCE_RE.findall(log.read_text(encoding="utf-8"))
    if len(found) != len(launches):
        raise EmulatorError(f"expected {len(launches)} generated kernels, MLX printed {len(found)}")
    return found


@dataclass
class Param:
    ctype: str  # e.g. "const device float16_t*" or "const constant int&" or "uint3"
    name: str
    is_buffer: bool


def parse_signature(source: str) -> Tuple[str, str, List[Param]]:
    """(function name, template arguments like "<float, 64, 4, 1>", parameters) of a generated kernel."""
    sig = _SIGNATURE_RE.search(source)
    if sig is None:
        raise EmulatorError("no [[kernel]] signature in the generated source")
    params = []
    for line in sig.group(2).split(",\n"):
        m = _PARAM_RE.match(line)
        if m is None:
            raise EmulatorError(f"cannot parse kernel parameter {line!r}")
        params.append(Param(m.group(1), m.group(2), m.group(3).startswith("buffer(")))
    inst = re.search(r"decltype\(" + sig.group(1) + r"(<.*?>)?\)", source)
    return sig.group(1), (inst.group(1) or "") if inst else "", params


def launcher(name: str, targs: str, params: List[Param], call: str = "") -> str:
    """An ``extern "C"`` entry point that runs kernel ``name`` over a grid, its buffers passed as void* a[]."""
    args, i = [], 0
    for p in params:
        if p.is_buffer:
            base = p.ctype.rstrip("&*").strip().replace("__grid_constant__ ", "")
            base = {"const Shape": "const mlx::core::cu::Shape", "const Strides": "const mlx::core::cu::Strides"}.get(
                base, base)
            args.append(f"({p.ctype})a[{i}]" if p.ctype.endswith("*") else f"*({base}*)a[{i}]")
            i += 1
        else:
            args.append(f"t.{p.name}")
    return (
        f'extern "C" const char* launch_{name}(void** a, unsigned gx, unsigned gy, unsigned gz, unsigned tx,'
        f" unsigned ty, unsigned tz) {{\n  return mlxemu::launch({{gx, gy, gz}}, {{tx, ty, tz}},"
        f" [&](const mlxemu::Attrs& t) {{ {call}{name}{targs}({', '.join(args)}); }});\n}}\n"
    )


def metal_unit(src: str) -> Tuple[str, str, List[Param]]:
    """(C++ for one MLX-generated Metal kernel plus its launcher, function name, parameters)."""
    body = "\n".join(ln for ln in src.splitlines() if not ln.startswith("template [[host_name("))
    name, targs, params = parse_signature(src)
    return body + "\n" + launcher(name, targs, params), name, params


def cuda_unit(launch: Launch, name: str) -> Tuple[str, str, List[Param]]:
    """The source mlx/backend/cuda/custom_kernel.cpp (build_kernel) generates for ``launch``, plus a launcher."""
    spec = SPECS[launch.kernel]
    _, body = split_kernel(launch.kernel)
    params = []
    for n, a in zip(spec.inputs, launch.inputs):
        params.append(Param(f"const {_CUDA_TYPES[a.dtype]}*", n, True))
        for suffix, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if a.ndim > 0 and n + suffix in body:
                params.append(Param(f"const __grid_constant__ {ctype}", n + suffix, True))
    params += [Param(f"{_CUDA_TYPES[d]}*", n, True) for n, d in zip(spec.outputs, launch.output_dtypes)]
    consts = []
    for n, v in launch.template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {n} = {v};")
        else:
            consts.append(f"  using {n} = {_CUDA_TYPES[v]};")
    src = (
        kernel_header(launch.kernel, "cuda") + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        f"__global__ void {name}(\n" + ",\n".join(f"    {p.ctype} {p.name}" for p in params) + ") {\n"
        + "\n".join(consts) + "\n\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"
    )
    return src + launcher(name, "", params, call="mlx::core::cu::"), name, params


def cache_dir() -> Path:
    root = os.environ.get("MLXINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlxinfer")
    return Path(root) / "kernel-emulator"


def compile_library(tu: str, prelude: str = "compat_emu.h") -> Path:
    """Compile (or reuse) the shared library for a translation unit; returns its path."""
    shims = [(kernel_dir() / f).read_text(encoding="utf-8") for f in sorted(set(PRELUDES.values()))]
    digest = hashlib.sha256("\0".join([tu, prelude, *shims, *CXX_FLAGS]).encode()).hexdigest()[:20]
    out = cache_dir() / f"emu-{digest}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        raise EmulatorError("the kernel emulator needs g++ (apt-get install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "tu.cpp", Path(tmp) / "lib.so"
        src.write_text(tu, encoding="utf-8")
        cmd = [cxx, *CXX_FLAGS, "-I", str(kernel_dir()), "-include", prelude, str(src), "-o", str(lib)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise EmulatorError(f"g++ failed on the generated kernels:\n{res.stderr[-4000:]}")
        os.replace(lib, out)  # atomic: a concurrent session sees the old file or the whole new one
    return out


def _host_view(a: mx.array, contiguous: bool) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    view = np.asarray(memoryview(a))  # keeps MLX's strides and offset: strided inputs stay in place
    return np.ascontiguousarray(view) if contiguous else view


class Emulator:
    """A ``build.Runner`` that executes launches on the CPU emulator, as Metal ("metal") or CUDA ("cuda") source."""

    def __init__(self, flavor: str = "metal"):
        if flavor not in PRELUDES:
            raise ValueError(f"unknown emulator flavor {flavor!r}")
        self.flavor = flavor
        self._fns: Dict[Tuple, Tuple[ctypes._CFuncPtr, List[Param]]] = {}
        self._libs: list = []

    def prepare(self, launches: Sequence[Launch]) -> None:
        """Generate and compile every not-yet-built kernel instance among ``launches`` in one library."""
        todo: Dict[Tuple, Launch] = {}
        for launch in launches:
            key = instance_key(launch)
            if key not in self._fns:
                todo.setdefault(key, launch)
        if not todo:
            return
        if self.flavor == "metal":
            units = [metal_unit(src) for _, src in metal_sources(list(todo.values()))]
        else:
            units = [cuda_unit(launch, "k_" + hashlib.sha1(repr(key).encode()).hexdigest()[:16])
                     for key, launch in todo.items()]
        tu = "\n".join(u[0] for u in units)
        lib = ctypes.CDLL(str(compile_library(tu, PRELUDES[self.flavor])))
        self._libs.append(lib)
        for key, (_, name, params) in zip(todo, units):
            fn = getattr(lib, f"launch_{name}")
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 6
            self._fns[key] = (fn, params)

    def __call__(self, launch: Launch) -> List[mx.array]:
        self.prepare([launch])
        fn, params = self._fns[instance_key(launch)]
        spec = SPECS[launch.kernel]
        mx.eval(launch.inputs)
        views = {n: _host_view(a, spec.row_contiguous) for n, a in zip(spec.inputs, launch.inputs)}
        outs = {}
        for n, shape, dtype in zip(spec.outputs, launch.output_shapes, launch.output_dtypes):
            # Poison: an element the kernel forgets to write shows up as NaN.
            fill = 0x7FC0 if dtype == mx.bfloat16 else np.nan
            outs[n] = np.full(shape, fill, dtype=_NP[dtype])
        keep, ptrs = [], []
        for p in (p for p in params if p.is_buffer):
            if p.name in views or p.name in outs:
                arr = views.get(p.name, outs.get(p.name))
            else:
                base, _, what = p.name.rpartition("_")
                v = views[base]
                pad = [0] * (MAX_NDIM - v.ndim)
                arr = {"shape": np.array([*v.shape, *pad], np.int32),
                       "strides": np.array([*(s // v.itemsize for s in v.strides), *pad], np.int64),
                       "ndim": np.array([v.ndim], np.int32)}[what]
            keep.append(arr)
            ptrs.append(arr.ctypes.data)
        err = fn((ctypes.c_void_p * len(ptrs))(*ptrs), *launch.grid, *launch.threadgroup)
        if err:
            raise EmulatorError(f"{launch.kernel}: {err.decode()}")
        results = []
        for n, dtype in zip(spec.outputs, launch.output_dtypes):
            a = mx.array(outs[n])
            results.append(a.view(mx.bfloat16) if dtype == mx.bfloat16 else a)
        return results
