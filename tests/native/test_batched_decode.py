"""Batched decode through the native CPU kernels: rows of different prompt lengths in mlx-lm's left-padded
``BatchKVCache`` (what ``mlxinfer serve`` and ``bench -b`` run) give each row the tokens it gets decoded on its own,
logits close to MLX's built-ins, one decoder_layer op per layer and step, and (where that op declines) no step
falls back to MLX's RoPE, KV update or attention."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as cache_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402

pytestmark = [pytest.mark.slow,  # loads models and needs the compiled extension
              # Float parity with MLX: prefill at float32 (the AVX2 int8 prefill GEMM off, as the load-time
              # self-check runs); tests/kernels/test_spec_layers.py holds the int8 default to its tolerance.
              pytest.mark.usefixtures("float_prefill")]

PROMPTS = [[5 + 13 * j % 397 for j in range(n)] for n in (9, 3, 17, 6)]
STEPS = 6
WATCHED = ("qkv_rope", "rope", "sdpa", "kv_append", "decoder_layer")


@pytest.fixture(scope="module", params=["llama", "qwen3", "smollm2"])
def model(request, native_ext, tmp_path_factory, smollm2_dir):
    import mlxinfer

    name = request.param
    path = smollm2_dir if name == "smollm2" else tiny_arch.build(name, tmp_path_factory.mktemp(name), smollm2_dir)
    loaded = mlxinfer.load(str(path), kernels="custom")
    assert loaded.kernels == "cpu-native", loaded.kernels_detail
    return loaded.model


def _provider(model):
    return next(m._kernel_provider for m in model.layers if "_kernel_provider" in m.__dict__)


def _argmax(logits):
    return mx.argmax(logits[:, -1], axis=-1)


def _alone(model, prompt, steps=STEPS):
    """Greedy tokens and last-position logits of one sequence decoded on its own cache."""
    cache = cache_lib.make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens, rows = [_argmax(logits)], [logits[:, -1]]
    for _ in range(steps):
        logits = model(tokens[-1][:, None], cache=cache)
        tokens.append(_argmax(logits))
        rows.append(logits[:, -1])
    mx.eval(tokens, rows)
    return [t.item() for t in tokens], mx.concatenate(rows)


def _batched(model, prefill: str, calls=None):
    """Greedy tokens (B, STEPS + 1) and logits of PROMPTS decoded together: each row prefilled alone and merged
    (``prefill="merge"``, the server's way) or the left-padded prompts prefilled as one batch ("padded")."""
    if prefill == "merge":
        caches, first = [], []
        for p in PROMPTS:
            c = cache_lib.make_prompt_cache(model)
            first.append(_argmax(model(mx.array([p]), cache=c)))
            caches.append(c)
        cache = [cache_lib.BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
        y, rows = mx.concatenate(first), []
    else:
        width = max(map(len, PROMPTS))
        pads = [width - len(p) for p in PROMPTS]
        cache = [cache_lib.BatchKVCache(pads) for _ in model.layers]
        logits = model(mx.array([[0] * pad + p for pad, p in zip(pads, PROMPTS)]), cache=cache)
        y, rows = _argmax(logits), []
    tokens = [y]
    mx.eval(y)
    if calls is not None:
        calls.clear()  # count the decode steps only
    for _ in range(STEPS):
        logits = model(y[:, None], cache=cache)
        y = _argmax(logits)
        tokens.append(y)
        rows.append(logits[:, -1])
        mx.eval(y)
    return mx.stack(tokens, axis=1).tolist(), mx.stack(rows, axis=1)


@pytest.fixture
def counted(model, monkeypatch):
    """Counts per provider op the calls it took (non-None) and declined, and calls of MLX's built-in RoPE,
    attention and BatchKVCache update (the fallbacks)."""
    calls = collections.Counter()
    provider = _provider(model)
    for name in WATCHED:
        fn = getattr(provider, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **k):
            out = _fn(*a, **k)
            calls[_name if out is not None else _name + " declined"] += 1
            return out

        monkeypatch.setattr(provider, name, wrap)
    for owner, name, label in ((mx.fast, "rope", "builtin rope"),
                               (mx.fast, "scaled_dot_product_attention", "builtin sdpa"),
                               (cache_lib.BatchKVCache, "update_and_fetch", "builtin kv update")):
        fn = getattr(owner, name)

        def builtin(*a, _fn=fn, _label=label, **k):
            calls[_label] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(owner, name, builtin)
    return calls


@pytest.mark.parametrize("prefill", ["merge", "padded"])
def test_rows_get_their_own_greedy_tokens(model, prefill):
    want = [_alone(model, p)[0] for p in PROMPTS]
    got, _ = _batched(model, prefill)
    assert got == want


def test_decode_steps_run_one_op_per_layer(model, counted):
    """A batched step is one decoder_layer op per layer (each row from its own left padding), as one sequence's."""
    _batched(model, "merge", calls=counted)
    assert {k: v / STEPS for k, v in counted.items()} == {"decoder_layer": len(model.layers)}


def test_per_op_batched_steps_make_no_builtin_fallback(model, counted, monkeypatch):
    """Where the one-op layer declines a batch (a provider without ``starts``), the per-op path still runs RoPE,
    the KV update and attention natively."""
    provider = _provider(model)
    counted_layer = provider.decoder_layer
    monkeypatch.setattr(provider, "decoder_layer", lambda *a, starts=None, **k: None if starts is not None
                        else counted_layer(*a, **k))
    _batched(model, "merge", calls=counted)
    per_step = {k: v / STEPS for k, v in counted.items()}
    n = len(model.layers)
    assert not any(k.startswith("builtin") or k.endswith("declined") for k in per_step), per_step
    assert per_step.get("sdpa") == n and per_step.get("kv_append") == n, per_step
    # llama-style attention: q/k/v + RoPE as one op; Qwen3 (q/k norms) runs mlx-lm's attention code, RoPE native.
    assert per_step.get("qkv_rope", 0) == n or per_step.get("rope", 0) == 2 * n, per_step


def test_logits_match_builtin_kernels(model, monkeypatch):
    from mlxinfer.kernels.patch import apply_kernels

    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")  # the built-ins keep float32 keys and values
    try:
        tokens, logits = _batched(model, "merge")
        assert apply_kernels(model, "builtin").name == "builtin"
        want_tokens, want = _batched(model, "merge")
    finally:
        assert apply_kernels(model, "custom").name == "cpu-native"
    assert tokens == want_tokens
    scale = mx.abs(want).max().item()
    assert mx.allclose(logits, want, atol=2e-3 * scale, rtol=0).item(), mx.abs(logits - want).max().item()


def test_rows_join_and_leave_like_the_server(model):
    """The scheduler's moves on a running batch (merge, filter, extend with a new row, extract) with one row
    long enough that decoding grows the buffers past mlx-lm's 256-position step: every row still gets its
    own greedy tokens."""
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "long": [3 + 7 * j % 389 for j in range(252)], "d": PROMPTS[2]}
    want = {k: _alone(model, p, STEPS + 1)[0] for k, p in prompts.items()}
    caches, got = {}, {}
    for k in ("a", "b", "long", "d"):
        caches[k] = cache_lib.make_prompt_cache(model)
        got[k] = [_argmax(model(mx.array([prompts[k]]), cache=caches[k])).item()]
    rows = ["a", "b", "long"]
    batch = [cache_lib.BatchKVCache.merge([caches[k][i] for k in rows]) for i in range(len(model.layers))]

    def step():
        y = _argmax(model(mx.array([[got[k][-1]] for k in rows]), cache=batch)).tolist()
        for k, t in zip(rows, y):
            got[k].append(t)

    for _ in range(3):
        step()
    for bc in batch:  # "b" leaves
        bc.filter([0, 2])
    rows = ["a", "long"]
    step()
    for bc, c in zip(batch, caches["d"]):  # "d" joins
        bc.extend(cache_lib.BatchKVCache.merge([c]))
    rows.append("d")
    for _ in range(STEPS - 4):
        step()
    alone = [bc.extract(0) for bc in batch]  # "a" goes back to its own cache
    got["a"].append(_argmax(model(mx.array([[got["a"][-1]]]), cache=alone)).item())
    assert batch[0]._idx > 256  # the long row crossed a buffer step
    for k in prompts:
        assert got[k] == want[k][:len(got[k])], k
    assert [len(got[k]) for k in ("a", "b", "long", "d")] == [STEPS + 2, 4, STEPS + 1, STEPS - 3]


@pytest.mark.parametrize("name", ["qwen2", "phi4_mini", "smollm3", "gemma3_text"])
def test_other_families_decode_a_batch_as_one_op(name, native_ext, tmp_path, smollm2_dir, monkeypatch):
    """Every family of the spec table decodes a left-padded batch through the one-op layer (q/k/v biases, a fused
    qkv with partial rotary, NoPE layers; Gemma's sliding layers too, over the plain batch cache merged here, as
    the server's whole caches give: the op applies the window), each row getting the tokens it gets alone."""
    import mlxinfer

    loaded = mlxinfer.load(str(tiny_arch.build(name, tmp_path / name, smollm2_dir)), kernels="custom")
    assert loaded.kernels == "cpu-native", loaded.kernels_detail
    model, provider = loaded.model, _provider(loaded.model)
    want = [_alone(model, p)[0] for p in PROMPTS]
    batched = collections.Counter()
    one_op = provider.decoder_layer

    def counting(*a, starts=None, **k):
        out = one_op(*a, starts=starts, **k)
        batched[starts is not None and out is not None] += 1
        return out

    monkeypatch.setattr(provider, "decoder_layer", counting)
    got, _ = _batched(model, "merge")
    assert got == want
    assert batched[True] == STEPS * len(model.layers), batched
