import pytest


@pytest.fixture(scope="module")
def native():
    """The native CPU provider with the one-op decoder layer; skips when the extension is not built."""
    from mlxinfer import native as native_mod

    provider = native_mod.provider()
    if provider is None or getattr(provider, "decoder_layer", None) is None:
        pytest.skip(f"native CPU kernels not built: {native_mod.status()}")
    return provider


@pytest.fixture
def float_prefill():
    """Prefill at float32 while the test runs (the AVX2 int8 prefill GEMM, the default there, off): what the
    load-time self-check sees, so layer maths is compared at float parity. Yields whether int8 was on before."""
    from mlxinfer import native as native_mod

    toggle = getattr(native_mod.extension(), "set_int8_prefill", None)
    before = toggle(False) if toggle is not None else False
    try:
        yield before
    finally:
        if toggle is not None:
            toggle(before)
