"""Prefill precision for tests: the AVX2 int8 prefill GEMM (the default where it runs) on or off while a block
runs, restored afterwards. Tests that compare layer maths at float parity run with it off, as the load-time
self-check does; tests of the int8 default turn it on."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def int8_prefill(on: bool, ext=None) -> Iterator[bool]:
    """Yields the setting found (False where the kernels have no int8 prefill: prefill is float32 either way)."""
    if ext is None:
        from mlxinfer import native

        ext = native.extension()
    toggle = getattr(ext, "set_int8_prefill", None)
    if toggle is None:
        yield False
        return
    before = toggle(on)
    try:
        yield before
    finally:
        toggle(before)
