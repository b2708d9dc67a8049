"""``decoder_layer``'s ``write`` / ``first`` (a sliding layer's cache holding only its window, kv_cache.py's
InPlaceRotatingKVCache): the kept keys anywhere in the buffer give the result of a cache holding every position
(RoPE still at ``offset``), nothing before ``first`` is read, this step's keys land at ``write``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from test_decoder_layer import CASES, _case_layer  # noqa: E402 (pytest puts this folder on sys.path)

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

GEMMA = [c for c in CASES if c[12] == "gemma" and c[8] > c[11] > 0]  # past the window: prefill and decode


@pytest.mark.parametrize("case", GEMMA)
def test_kept_window_anywhere_in_the_buffer_gives_the_full_cache_result(native_ext, case):
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    arrays, config = _case_layer(case)
    names = sorted(arrays)
    plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    x = mx.random.normal((B, L, E))
    k_old, v_old = mx.random.normal((B, hkv, offset, D)), mx.random.normal((B, hkv, offset, D))
    full = [native_ext.kv_reserve([B, hkv, offset + L, D], a, valid=offset, half=half) for a in (k_old, v_old)]
    want = native_ext.decoder_layer(x, [arrays[n] for n in names], *full, offset, L > 1, plan)

    kept, junk = window - 1, 5  # the last window - 1 keys after 5 positions the op must not read
    big = mx.full((B, hkv, junk, D), 1e4)
    bufs = [native_ext.kv_reserve([B, hkv, junk + kept + L + 3, D],
                                  mx.concatenate([big, a[:, :, offset - kept:]], axis=2), valid=junk + kept, half=half)
            for a in (k_old, v_old)]
    got = native_ext.decoder_layer(x, [arrays[n] for n in names], *bufs, offset, L > 1, plan, junk + kept, junk)
    mx.eval(want, got)
    scale = float(mx.abs(want[0]).max())
    assert float(mx.abs(got[0] - want[0]).max()) <= 1e-5 * scale
    for g, w in zip(got[1:], want[1:]):  # this step's keys/values (RoPE at offset) written at junk + kept
        assert mx.array_equal(g[:, :, junk + kept:junk + kept + L], w[:, :, offset:offset + L]).item()


def test_write_and_first_are_checked(native_ext):
    case = GEMMA[0]
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    arrays, config = _case_layer(case)
    names = sorted(arrays)
    plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    x = mx.zeros((B, L, E))
    kb = native_ext.kv_reserve([B, hkv, 16, D])
    ws = [arrays[n] for n in names]
    with pytest.raises(ValueError, match="no room"):
        native_ext.decoder_layer(x, ws, kb, kb, offset, True, plan, 16 - L + 1, 0)  # past the buffer's end
    with pytest.raises(ValueError, match="first is past"):
        native_ext.decoder_layer(x, ws, kb, kb, offset, True, plan, 4, 5)
