import pytest


@pytest.fixture(scope="module")
def native():
    """The native CPU provider with the one-op decoder layer; skips when the extension is not built."""
    from mlxinfer import native as native_mod

    provider = native_mod.provider()
    if provider is None or getattr(provider, "decoder_layer", None) is None:
        pytest.skip(f"native CPU kernels not built: {native_mod.status()}")
    return provider

