"""Sliding-window layers (Gemma 3's local layers, OLMo 3's sliding ones) on the one-op path keep only their window
(``kv_cache.InPlaceRotatingKVCache``): buffers O(window) after hundreds of decode steps while the global layer's
grow, logits still those of MLX's built-ins (mlx-lm's RotatingKVCache) over prefill, decode, a second prefill past
the window, trim and a restored state, and a state someone took is never changed by later in-place writes.

Tolerance: as tests/kernels/test_spec_layers.py with MLXINFER_KV_DTYPE=float32 and float32 prefill (measured there ~1e-4 relative to
the largest |logit| with the int16-activation decode matvec); a wrong window or position gives 1e-1 and more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as cache_lib

from mlxinfer.engine.kv_options import KVOptions, make_cache
from mlxinfer.kernels import patch
from mlxinfer.kernels.kv_cache import InPlaceKVCache, InPlaceRotatingKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402

WINDOW = 16
REL_TOL = 5e-4
PROMPT = [1, 17, 923, 4, 88, 1203, 5, 77, 311, 9, 40, 2048, 3, 61, 500, 12, 7, 1999, 25, 8, 640, 33, 2, 91]
TURN = [5, 600, 42, 7, 1500, 3, 88, 19, 230, 4, 71, 12, 900, 6, 33, 2, 450, 8, 61, 17]  # a second prefill (20)


# Layer 0 sliding, layer 1 global (gemma3_text's pattern 2 and olmo3's tiny config say so already); head_dim 32
# for --kv-bits (a multiple of its group).
_SLIDING_FIRST = {"gemma3_text": {}, "olmo3": {},
                  "ministral3": {"layer_types": ["sliding_attention", "full_attention"], "head_dim": 32}}


@pytest.fixture(params=sorted(_SLIDING_FIRST))
def model(native, monkeypatch, float_prefill, request):
    """A tiny model whose layer 0 is a sliding-window layer (window WINDOW) and layer 1 a global one."""
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    m = tiny_arch.make_model(request.param, overrides={"sliding_window": WINDOW, **_SLIDING_FIRST[request.param]})
    yield m
    patch.apply_kernels(m, "builtin")


def _step(model, cache, tokens: list) -> mx.array:
    return model(mx.array([tokens]), cache=cache)[0, -1]


def _greedy_tokens(model, steps: int) -> list:
    cache = cache_lib.make_prompt_cache(model)
    logits, out = _step(model, cache, PROMPT), []
    for _ in range(steps):
        out.append(int(mx.argmax(logits)))
        logits = _step(model, cache, [out[-1]])
    return out


def _run(model, script: list, on_step=None) -> mx.array:
    """Logits after each call of ``script`` (lists of tokens; a "trim N" string trims every layer by N)."""
    cache = cache_lib.make_prompt_cache(model)
    out = []
    for i, item in enumerate(script):
        if isinstance(item, str):
            assert cache_lib.can_trim_prompt_cache(cache)
            cache_lib.trim_prompt_cache(cache, int(item.split()[1]))
            continue
        out.append(_step(model, cache, item))
        mx.eval(out[-1])
        if on_step is not None:
            on_step(i, cache)
    return mx.stack(out)


def _rel_err(got: mx.array, want: mx.array) -> float:
    return float(mx.abs(got - want).max()) / float(mx.abs(want).max())


def test_sliding_layer_holds_its_window_over_200_decode_steps(model):
    tokens = _greedy_tokens(model, 230)
    script = [PROMPT] + [[t] for t in tokens[:200]] + [TURN] + [[t] for t in tokens[200:]]
    patch.apply_kernels(model, "builtin")
    want = _run(model, script)
    assert "2 decoder layers as one op" in patch.apply_kernels(model, "auto").detail
    sizes = {}

    def measure(i, cache):
        if i == 200:  # after the prompt and 200 decode steps
            assert type(cache[0]) is InPlaceRotatingKVCache and type(cache[1]) is InPlaceKVCache
            sizes.update(sliding=cache[0].keys.shape[2], sliding_bytes=cache[0].nbytes,
                         global_=cache[1].keys.shape[2], offset=cache[0].offset, kept=cache[0].size())

    got = _run(model, script, measure)
    assert _rel_err(got, want) < REL_TOL, _rel_err(got, want)
    assert sizes["offset"] == 224 and sizes["kept"] == WINDOW
    # The sliding layer: its window and room for window/4 more steps; the global layer: every position.
    assert sizes["sliding"] <= WINDOW + WINDOW // 4 and sizes["global_"] >= 224, sizes
    assert sizes["sliding_bytes"] <= 2 * 2 * 4 * 32 * (WINDOW + WINDOW // 4)  # k + v, 2 heads x 32 float32


def test_trim_within_the_window_and_a_restored_state_match_builtin(model):
    """/undo and regenerate trim (allowed while nothing has left the window); a saved session's state, restored
    into mlx-lm's own cache classes (what its load_prompt_cache makes), continues as the original would."""
    short = PROMPT[:10]
    tokens = _greedy_tokens(model, 40)
    script = [short] + [[t] for t in tokens[:3]] + ["trim 4"] + [[t] for t in tokens[3:40]]
    patch.apply_kernels(model, "builtin")
    want = _run(model, script)
    patch.apply_kernels(model, "auto")
    assert _rel_err(_run(model, script), want) < REL_TOL

    cache = cache_lib.make_prompt_cache(model)
    _step(model, cache, PROMPT)
    for t in tokens[:30]:
        _step(model, cache, [t])
    saved = [(type(c).__mro__[1], c.state) for c in cache]  # the mlx-lm class each one extends
    mx.eval([s for _, s in saved])
    restored = [cls.from_state(state) for cls, state in saved]
    for t in tokens[30:40]:
        a, b = _step(model, cache, [t]), _step(model, restored, [t])
        assert float(mx.abs(a - b).max()) <= 1e-5 * float(mx.abs(a).max())
    assert type(restored[0]) is InPlaceRotatingKVCache  # taken over by the op (mlx-lm's RotatingKVCache before)

    # mlx-lm's own ring, rotated (54 positions in 16), taken over by the op mid-conversation.
    patch.apply_kernels(model, "builtin")
    cache = cache_lib.make_prompt_cache(model)
    _step(model, cache, PROMPT)
    for t in tokens[:30]:
        _step(model, cache, [t])
    assert type(cache[0]) is cache_lib.RotatingKVCache and 0 < cache[0]._idx < cache[0].offset
    mx.eval([c.state for c in cache])
    # Copies: mlx-lm's ring update (keys[..., i, :] = k) changes the Python array objects a shared state holds.
    twin = [type(c).from_state(tuple(x + 0 if isinstance(x, mx.array) else x for x in c.state)) for c in cache]
    want = mx.stack([_step(model, twin, [t]) for t in tokens[30:40]])
    patch.apply_kernels(model, "auto")
    got = mx.stack([_step(model, cache, [t]) for t in tokens[30:40]])
    assert type(cache[0]) is InPlaceRotatingKVCache and _rel_err(got, want) < REL_TOL


@pytest.mark.parametrize("opts", [KVOptions(max_size=32), KVOptions(bits=8, group_size=32)],
                         ids=["max-kv-size", "kv-bits"])
def test_kv_options_keep_the_sliding_layers_and_match_builtin(model, opts):
    """--max-kv-size / --kv-bits change the global layer's cache only (as mlx-lm: its sliding layers stay
    rotating); the sliding layer still runs as one op on its window."""
    tokens = _greedy_tokens(model, 40)

    def run():
        cache = make_cache(model, opts)
        out = [_step(model, cache, PROMPT)] + [_step(model, cache, [t]) for t in tokens]
        return cache, mx.stack(out)

    patch.apply_kernels(model, "builtin")
    _, want = run()
    patch.apply_kernels(model, "auto")
    cache, got = run()
    assert type(cache[0]) is InPlaceRotatingKVCache and cache[0].keys.shape[2] <= WINDOW + WINDOW // 4
    assert type(cache[1]) in (cache_lib.RotatingKVCache, cache_lib.QuantizedKVCache)
    tol = REL_TOL if opts.bits is None else 5e-2  # quantized keys: MLX's quantized attention vs its own
    assert _rel_err(got, want) < tol, _rel_err(got, want)


def test_a_taken_state_is_not_changed_by_later_steps(model):
    """The op writes the buffers in place: a state taken earlier (what mx.eval(cache.state) or a copy holds) keeps
    its keys while later steps move the window on and move it to fresh buffers."""
    patch.apply_kernels(model, "auto")
    cache = cache_lib.make_prompt_cache(model)
    _step(model, cache, PROMPT)
    for t in range(5):
        _step(model, cache, [100 + t])
    k, v = cache[0].state[:2]
    before = (np.array(k), np.array(v))
    for t in range(3 * WINDOW):
        _step(model, cache, [200 + t])
        mx.eval(cache[0].state)
    assert np.array_equal(np.array(k), before[0]) and np.array_equal(np.array(v), before[1])
    assert k.shape[2] == WINDOW and cache[0].size() == WINDOW


def test_whole_caches_prefill_past_the_window_in_one_call_match_builtin(model):
    """The server's whole caches (``kv_cache.whole_caches``: the sliding layer keeps every position): a 44-token
    prefill (window 16) in one call, each query attending its own last 16 keys in the op's attention kernel, then
    decode steps, against MLX's built-ins on mlx-lm's rotating cache."""
    from mlxinfer.kernels.kv_cache import whole_caches

    tokens = _greedy_tokens(model, 12)
    patch.apply_kernels(model, "builtin")
    want = _run(model, [PROMPT + TURN] + [[t] for t in tokens])
    patch.apply_kernels(model, "auto")
    cache = whole_caches(model)
    assert type(cache[0]) is InPlaceKVCache
    got = [_step(model, cache, PROMPT + TURN)] + [_step(model, cache, [t]) for t in tokens]
    assert cache[0].offset == len(PROMPT + TURN) + len(tokens) <= cache[0].keys.shape[2]  # every position kept
    assert _rel_err(mx.stack(got), want) < REL_TOL


def test_batched_rows_and_an_extracted_row_match_alone(model):
    """The server's way: rows prefilled alone, merged by mlx-lm (the sliding layer's caches into a
    BatchRotatingKVCache), decoded together past the window, then one row extracted (mlx-lm's RotatingKVCache,
    taken over by the op) decoding alone again: the logits of that row decoded alone all the way."""
    patch.apply_kernels(model, "auto")
    prompts, together, after = [PROMPT, PROMPT[5:15]], 12, 12
    tokens = _greedy_tokens(model, together + after)
    alone = cache_lib.make_prompt_cache(model)
    want = [_step(model, alone, PROMPT)] + [_step(model, alone, [t]) for t in tokens]

    caches = [cache_lib.make_prompt_cache(model) for _ in prompts]
    got = [_step(model, caches[0], prompts[0])]
    _step(model, caches[1], prompts[1])
    batch = [layer[0].merge(list(layer)) for layer in zip(*caches)]
    assert type(batch[0]) is cache_lib.BatchRotatingKVCache
    for t in tokens[:together]:
        got.append(model(mx.array([[t], [t]]), cache=batch)[0, -1])
    row = [c.extract(0) for c in batch]
    got += [_step(model, row, [t]) for t in tokens[together:]]
    assert type(row[0]) is InPlaceRotatingKVCache and row[0].offset == len(PROMPT) + len(tokens)
    assert _rel_err(mx.stack(got), mx.stack(want)) < REL_TOL


def test_a_multimodal_wrapper_gets_its_text_models_window_caches(native, monkeypatch, float_prefill):
    """mlx-lm's mistral3 (Ministral 3 in mlx-community's multimodal layout) has no make_cache, so mlx-lm gives its
    sliding layers plain caches that grow with the context. mlxinfer asks the text model (ministral3): a
    RotatingKVCache of the window on MLX's built-ins, the op's in-place one with the kernels; logits as those of
    the built-ins on mlx-lm's plain caches (the window mask keeps that maths right) over 60 decode steps."""
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    text = {**tiny_arch.config_for("ministral3"), "sliding_window": WINDOW, "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"]}
    model = tiny_arch.make_model("mistral3", overrides={"text_config": text})
    try:
        assert not hasattr(model, "make_cache")  # mlx-lm's wrapper as it is
        tokens = _greedy_tokens(model, 60)
        script = [PROMPT] + [[t] for t in tokens]
        want = _run(model, script)  # make_prompt_cache: a plain KVCache per layer
        builtin = make_cache(model)
        assert type(builtin[0]) is cache_lib.RotatingKVCache and builtin[0].max_size == WINDOW
        assert type(builtin[1]) is cache_lib.KVCache
        assert "2 decoder layers as one op" in patch.apply_kernels(model, "auto").detail
        sizes = {}

        def measure(i, cache):
            if i == len(script) - 1:
                sizes.update(kind=type(cache[0]), sliding=cache[0].keys.shape[2], offset=cache[0].offset)

        got = _run(model, script, measure)
        assert sizes["kind"] is InPlaceRotatingKVCache and sizes["offset"] == len(PROMPT) + 60
        assert sizes["sliding"] <= WINDOW + WINDOW // 4, sizes
        assert _rel_err(got, want) < REL_TOL, _rel_err(got, want)
    finally:
        patch.apply_kernels(model, "builtin")
