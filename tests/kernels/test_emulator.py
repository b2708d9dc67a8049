"""Every kernel, on the CPU emulator of Metal's execution model, against its float32 twin and MLX's built-in."""

from __future__ import annotations

import pytest

import kernel_cases as kc
from mlxinfer.kernels.build import Recorder
from mlxinfer.kernels.emulator import Emulator

pytestmark = pytest.mark.slow  # compiles the generated kernels with g++ (once; cached by content hash)


@pytest.fixture(scope="module")
def emulator():
    emu, recorder = Emulator(), Recorder()
    for p in kc.ALL:  # record every launch first so all kernel instances compile in one g++ run
        run_case, case, _ = p.values
        run_case(case, recorder)
    emu.prepare(recorder.launches)
    return emu


@pytest.mark.parametrize("run_case, case, dtype", kc.ALL)
def test_kernel_on_emulator(emulator, run_case, case, dtype):
    kc.check(run_case(case, emulator), dtype)


# On the CUDA route each simd_sum is five warp shuffles (ten fiber rounds): the long-context cases stay Metal-only.
CUDA_ROUTE = [p for p in kc.ALL if "-1000-" not in p.id and "-4097-" not in p.id and "-300-" not in p.id
              and "-1500-" not in p.id]


@pytest.fixture(scope="module")
def cuda_route_emulator():
    emu, recorder = Emulator("cuda"), Recorder()
    for p in CUDA_ROUTE:
        run_case, case, _ = p.values
        run_case(case, recorder)
    emu.prepare(recorder.launches)
    return emu


@pytest.mark.parametrize("run_case, case, dtype", CUDA_ROUTE)
def test_cuda_route_on_emulator(cuda_route_emulator, run_case, case, dtype):
    # The CUDA-route source (compat_cuda.h + the same bodies, wrapped like MLX's CUDA backend) on the same fibers.
    kc.check(run_case(case, cuda_route_emulator), dtype)


def test_provider_self_test(emulator):
    from mlxinfer.kernels.gpu import self_test

    recorder = Recorder()
    assert "wrong result" in self_test(recorder)  # zeros; records the instances to compile at once
    emulator.prepare(recorder.launches)
    assert self_test(emulator) is None

    def broken(launch):  # a kernel that "runs" but returns the wrong numbers
        return [o * 2 + 1 for o in emulator(launch)]

    assert "wrong result" in self_test(broken)

    def failing(launch):
        raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: ...")

    assert self_test(failing).startswith("qmv: [metal::Device] Unable to build metal library from source; swiglu: ")
