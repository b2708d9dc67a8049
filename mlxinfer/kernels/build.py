"""Read the shipped ``.metal`` kernel bodies and turn them into MLX custom kernels, once per process.

A kernel file is a header comment (inputs, outputs, template, grid) followed by ``// [[body]]`` and the body
MLX wraps into a function (``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` generate the signature). Every
kernel's header is ``mlxk_common.h``; on the CUDA route ``compat_cuda.h`` goes first so the same Metal-flavoured
bodies compile under NVRTC. A ``Launch`` is one kernel call described as data, so the GPU runners, the CPU
emulator (tests) and the syntax check all execute exactly the same plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, List, Sequence, Tuple

import mlx.core as mx

from mlxinfer._resources import data_path

BODY_MARKER = "// [[body]]"


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    row_contiguous: bool = True  # False: the body reads strides itself (KV caches read in place)


SPECS = {
    s.name: s
    for s in (
        KernelSpec("qmv", ("x", "w", "scales", "biases", "params"), ("y",)),
        KernelSpec("swiglu", ("x", "wg", "sg", "bg", "wu", "su", "bu", "params"), ("h",)),
        KernelSpec("sdpa_decode", ("q", "k", "v", "params", "fparams"), ("o", "part", "pm", "pl"), False),
        KernelSpec(
            "sdpa_quant", ("q", "kq", "ks", "kb", "vq", "vs", "vb", "params", "fparams"),
            ("o", "part", "pm", "pl"), False,
        ),
        KernelSpec("sdpa_reduce", ("part", "pm", "pl"), ("o",)),
    )
}


@dataclass
class Launch:
    """One kernel call: everything ``kernel(...)`` needs besides the kernel object."""

    kernel: str
    inputs: List[mx.array]
    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shapes: List[Tuple[int, ...]]
    output_dtypes: List[mx.Dtype] = field(default_factory=list)


Runner = Callable[[Launch], Sequence[mx.array]]


def kernel_dir():
    return data_path("metal_kernels")


@functools.lru_cache(maxsize=None)
def read_text(filename: str) -> str:
    return (kernel_dir() / filename).read_text(encoding="utf-8")


def split_kernel(name: str) -> Tuple[str, str]:
    """(header comment part, body) of ``<name>.metal``."""
    text = read_text(f"{name}.metal")
    if BODY_MARKER not in text:
        raise ValueError(f"{name}.metal has no '{BODY_MARKER}' line")
    head, body = text.split(BODY_MARKER, 1)
    return head, body.strip("\n") + "\n"


def kernel_header(name: str, backend: str) -> str:
    """The ``header=`` text for a kernel: compat layer (CUDA only), shared helpers, the file's comment."""
    head, _ = split_kernel(name)
    parts = [read_text("compat_cuda.h")] if backend == "cuda" else []
    parts += [read_text("mlxk_common.h"), head]
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def get_kernel(name: str, backend: str):
    """The MLX custom-kernel object for ``name`` on "metal" (also used for export/syntax) or "cuda"."""
    spec = SPECS[name]
    _, body = split_kernel(name)
    header = kernel_header(name, backend)
    if backend == "cuda":
        return mx.fast.cuda_kernel(
            name=f"mlxk_{name}", input_names=list(spec.inputs), output_names=list(spec.outputs),
            source=body, header=header, ensure_row_contiguous=spec.row_contiguous,
        )
    return mx.fast.metal_kernel(
        name=f"mlxk_{name}", input_names=list(spec.inputs), output_names=list(spec.outputs),
        source=body, header=header, ensure_row_contiguous=spec.row_contiguous,
    )


def gpu_runner(backend: str, *, stream=None, verbose: bool = False) -> Runner:
    """A runner that executes launches with MLX's Metal or CUDA custom kernels."""

    def run(launch: Launch) -> Sequence[mx.array]:
        kernel = get_kernel(launch.kernel, backend)
        kwargs = {} if stream is None else {"stream": stream}
        return kernel(
            inputs=launch.inputs, template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
            output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes, verbose=verbose, **kwargs,
        )

    return run


class Recorder:
    """A runner that only records launches (zeros as outputs): lets tests collect every kernel instance first."""

    def __init__(self):
        self.launches: List[Launch] = []

    def __call__(self, launch: Launch) -> Sequence[mx.array]:
        self.launches.append(launch)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]
