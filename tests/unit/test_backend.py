"""engine.backend: MLX's buffer cache on the CPU backend (``keep_freed_buffers``, called by ``mlxinfer.load``)."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from mlxinfer.engine import backend as b


@pytest.fixture
def restore_cache_limit():
    before = mx.set_cache_limit(32 << 20)
    yield
    mx.set_cache_limit(before)


@pytest.mark.skipif(b.backend() != "cpu", reason="the CPU backend's setting")
def test_freed_buffers_are_kept_up_to_an_eighth_of_ram_or_2_gib(restore_cache_limit):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    want = min(ram // 8, b.CPU_CACHE_CAP)
    assert b.keep_freed_buffers() == want
    assert mx.set_cache_limit(want) == want  # the limit in force (set_cache_limit returns the previous one)
    # A larger limit set by the user stays.
    mx.set_cache_limit(want * 2)
    assert b.keep_freed_buffers() == want * 2 and mx.set_cache_limit(want * 2) == want * 2


@pytest.mark.slow
@pytest.mark.skipif(b.backend() != "cpu", reason="the CPU backend's setting")
def test_load_raises_the_cache_limit(restore_cache_limit, smollm2_dir):
    import mlxinfer

    mlxinfer.load(str(smollm2_dir))
    assert mx.set_cache_limit(32 << 20) >= min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8,
                                               b.CPU_CACHE_CAP)
