"""Fixtures for the native CPU kernels: the extension module, built here if the install did not build it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def native_ext():
    """The loaded ``_mlxinfer_cpu`` module. Uses the install-time build when it matches the running MLX,
    else compiles ``cpu_kernels/`` into ``$MLXINFER_CACHE/native`` (about a minute on 2 cores)."""
    from mlxinfer import native

    native.reset()
    if native.extension() is None:
        try:
            native.ensure_built()
        except RuntimeError as exc:
            pytest.skip(f"native CPU kernels cannot be built here: {str(exc).splitlines()[0]}")
        native.reset()
    ext = native.extension()
    assert ext is not None, native.status()
    return ext


@pytest.fixture
def float_prefill(native_ext):
    """Prefill on its precise path while the test runs (the opt-in int8 GEMM off even under MLXINFER_PREFILL=int8;
    the int16 GEMM on the AVX2 integer and VNNI sets, else float32 tiles): what the
    load-time self-check sees."""
    from mlxinfer import native

    with native.int8_activations(prefill=False, ext=native_ext):
        yield
