"""Chat with Gemma 3 past its sliding window on the native one-op layers (the sliding layers' caches hold only
their window, ``kernels.kv_cache.InPlaceRotatingKVCache``): a conversation with a second turn (cache reuse),
/retry and /undo (a rotated cache cannot be trimmed: the session prefills again), then a new turn, gives the
replies of MLX's built-ins, also with --max-kv-size and --kv-bits; a saved session resumes with the same reply.
Prefill runs at float32 (``float_prefill``): the int8 default's rounding could flip near-ties of a random model.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlxinfer
from mlxinfer.engine.kv_options import KVOptions

pytestmark = pytest.mark.slow  # the tiny model copies the bundled GGUF's tokenizer

MAX_TOKENS = 24  # with the chat template, the second turn is past the tiny Gemma's window of 64


def _chat(loaded, kv: KVOptions | None) -> tuple[list, list]:
    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.session import Session

    s = Session(loaded, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), system="Be brief.", kv=kv)
    replies = []

    def run(turn):
        for _ in turn:
            pass
        replies.append(list(turn.stats.tokens))
        return turn

    run(s.send("Tell me about the sea."))
    second = run(s.send("And the mountains?"))
    assert second.reused > 0  # the first exchange came from the cache
    run(s.retry())
    s.undo()
    run(s.send("What about rivers?"))
    back = Session.from_dict(s.to_dict(), loaded, s.params, kv=kv)  # a saved session, resumed
    run(back.send("And lakes?"))
    # Greedy tokens of a random model hide small errors: the next-token logits of the cache the session holds.
    probe = loaded.model(mx.array([[42]]), cache=s._cache)[0, -1]
    return replies, s._cache, probe


@pytest.mark.parametrize("kv", [None, KVOptions(max_size=96), KVOptions(bits=8, group_size=32)],
                         ids=["default", "max-kv-size", "kv-bits"])
def test_gemma_chat_matches_builtin(tiny_model_dir, monkeypatch, kv, float_prefill):
    from mlxinfer.kernels import fused_block
    from mlxinfer.kernels.kv_cache import InPlaceRotatingKVCache
    from mlxinfer.kernels.patch import apply_kernels

    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")  # token parity on a random model: no float16 rounding
    path = str(tiny_model_dir("gemma3_text"))
    builtin = mlxinfer.load(path, kernels="builtin")
    want, _, want_probe = _chat(builtin, kv)
    native = mlxinfer.load(path, kernels="auto")
    ring_calls, declined = [], []
    real = fused_block.native_block

    def counted(block, x, mask, cache):
        y = real(block, x, mask, cache)
        if isinstance(cache, InPlaceRotatingKVCache):
            (ring_calls if y is not None else declined).append(x.shape[1])
        return y

    monkeypatch.setattr(fused_block, "native_block", counted)
    try:
        if "decoder layers as one op" not in native.kernels_detail:
            pytest.skip(f"no one-op layers here: {native.kernels_detail}")
        got, cache, got_probe = _chat(native, kv)
    finally:
        apply_kernels(native.model, "builtin")
    assert got == want and all(len(r) > 0 for r in got), (got, want)
    err = float(mx.abs(got_probe - want_probe).max()) / float(mx.abs(want_probe).max())
    assert err < (5e-4 if kv is None or kv.bits is None else 5e-2), err  # as tests/kernels/test_spec_layers.py
    assert ring_calls and not declined  # the sliding layer ran as one op on its windowed cache every time
    window = native.model.args.sliding_window
    sliding = [c for c in cache if type(c) is InPlaceRotatingKVCache]
    assert sliding and all(c.offset > window and c.keys.shape[2] <= window + window // 4 for c in sliding)
