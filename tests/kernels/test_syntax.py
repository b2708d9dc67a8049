"""The complete Metal source MLX generates for every kernel instance the provider can launch compiles as C++20
with the emulator shim (typos, undeclared names and template errors fail here, not first on a Mac)."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import mlx.core as mx
import pytest

from mlxinfer.kernels import ops
from mlxinfer.kernels.build import Recorder, kernel_dir
from mlxinfer.kernels.emulator import cuda_unit, instance_key, metal_sources

pytestmark = pytest.mark.slow  # runs the C++ front end over ~200 generated kernels

FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def instance_matrix(rows=(1, 3, 8), head_dims=(64, 80, 96, 128, 256)):
    """One launch per distinct generated source across dtypes, bits, group sizes, rows, head dims, passes."""
    rec = Recorder()
    for dtype, bits, gs, m in itertools.product(FLOATS, (4, 8), (32, 64, 128), rows):
        x, s = mx.zeros((m, 256), dtype), mx.zeros((24, 256 // gs), dtype)
        w = mx.zeros((24, 256 * bits // 32), mx.uint32)
        ops.quantized_matmul(x, w, s, s, group_size=gs, bits=bits, run=rec)
        ops.swiglu(x, (w, s, s), (w, s, s), group_size=gs, bits=bits, run=rec)
    for dtype, d, (hq, l), nsplit in itertools.product(FLOATS, head_dims, ((2, 1), (8, 8)), (1, 2)):
        q, k = mx.zeros((1, hq, l, d), dtype), mx.zeros((1, 2, 40, d), dtype)
        ops.sdpa(q, k, k, scale=0.1, mask="causal", run=rec, nsplit=nsplit)
    for dtype, d, gs, bits, nsplit in itertools.product(FLOATS, head_dims[::3], (32, 64, 128), (4, 8), (1, 2)):
        q = mx.zeros((1, 4, 1, d), dtype)
        kt = (mx.zeros((1, 2, 40, d * bits // 32), mx.uint32), *[mx.zeros((1, 2, 40, d // gs), dtype)] * 2)
        ops.quantized_sdpa(q, kt, kt, scale=0.1, mask=None, group_size=gs, bits=bits, run=rec, nsplit=nsplit)
    unique = {instance_key(launch): launch for launch in rec.launches}
    return list(unique.values())


@pytest.fixture(scope="module")
def sources():
    return [src for _, src in metal_sources(instance_matrix())]


def syntax_check(sources, tmp_path, prelude="compat_emu.h"):
    """g++ -fsyntax-only over the sources exactly as MLX would hand them to the Metal compiler (the
    `template [[host_name(...)]]` line included: it is an explicit instantiation, so every body is checked)."""
    cxx = shutil.which("g++")
    assert cxx, "the syntax check needs g++"
    src = tmp_path / "generated.cpp"
    src.write_text("\n".join(sources))
    return subprocess.run(
        [cxx, "-std=c++20", "-fsyntax-only", "-Wno-attributes", "-I", str(kernel_dir()), "-include", prelude,
         str(src)], capture_output=True, text=True,
    )


def test_generated_metal_sources_compile(sources, tmp_path):
    assert len(sources) > 150
    res = syntax_check(sources, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def test_signatures_follow_the_kernel_contract(sources):
    qmv = next(s for s in sources if "custom_kernel_mlxk_qmv_" in s)
    assert "const constant int32_t* params [[buffer(4)]]" in qmv  # tiny arrays go to the constant address space
    assert "uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]" in qmv
    sdpa = next(s for s in sources if "custom_kernel_mlxk_sdpa_decode_" in s)
    assert "const constant int64_t* k_strides" in sdpa  # the cache is read in place, by strides
    assert "template [[host_name(" in sdpa


def test_a_typo_fails_the_check(sources, tmp_path):
    broken = sources[0].replace("simd_sum(", "simd_summ(", 1)
    res = syntax_check([broken], tmp_path)
    assert res.returncode != 0 and "simd_summ" in res.stderr


def test_errors_that_need_the_template_arguments_fail_too(sources, tmp_path):
    # Only visible once T is known: proves the explicit instantiation line makes g++ check every instance.
    broken = sources[0].replace("static_cast<T>(v)", "static_cast<T>(v).no_such_member", 1)
    assert broken != sources[0]
    res = syntax_check([broken], tmp_path)
    assert res.returncode != 0 and "no_such_member" in res.stderr


def test_cuda_route_sources_compile(tmp_path):
    # The same instances as MLX's CUDA backend would wrap them (compat_cuda.h first), against a g++ stand-in
    # for CUDA's headers: catches Metal words compat_cuda.h forgot to map. NVRTC itself only runs on a GPU.
    # A smaller matrix than the Metal one: the bodies are shared, this checks the CUDA mapping and wrapping.
    units = [cuda_unit(launch, f"k{i}")[0] for i, launch in enumerate(instance_matrix(rows=(3,), head_dims=(80, 256)))]
    res = syntax_check(units, tmp_path, prelude="emu_cuda_prelude.h")
    assert res.returncode == 0, res.stderr[-3000:]
