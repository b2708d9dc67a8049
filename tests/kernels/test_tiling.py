"""Row tiles in a model (kernels.tiling through kernels.patch): the one-op layers' 4-bit weights are tiled after
the self-check where the kernel set reads tiles, the logits stay those of MLX's layout, every way out (kernels
off, a call the op does not take, a tiled path that disagrees) puts MLX's layout back, and MLXINFER_TILED=0
keeps it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import llama

from kernel_cases import tiny_llama
from mlxinfer import native as native_mod
from mlxinfer.kernels import fused_block, patch, selfcheck, tiling


@pytest.fixture
def tiles(native):
    if not native.tiled_weights():
        pytest.skip(f"this kernel set does not read tiles ({native_mod.extension().isa()})")
    return native


def llama_with_head(tied: bool, head_bits: int = 4) -> nn.Module:
    """tiny_llama's shapes with a vocabulary of 320 (whole tiles), the head tied to the embedding or not, 4- or
    8-bit (as GGUF imports often store it)."""
    mx.random.seed(3)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320, rope_theta=10000.0, tie_word_embeddings=tied,
    )
    model = llama.Model(args)
    head = "model.embed_tokens" if tied else "lm_head"
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda path, m: hasattr(m, "to_quantized") and (
                    {"group_size": 32, "bits": head_bits} if path == head else True))
    mx.eval(model.parameters())
    return model


def run(model, tokens=(1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31), steps=32):
    """Logits of an 11-token prefill (the GEMM path) and 32 greedy decode steps (the matvecs)."""
    cache = cache_lib.make_prompt_cache(model)
    out = [model(mx.array([list(tokens)]), cache=cache)[:, -1]]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=cache)[:, -1])
    mx.eval(out)
    return mx.concatenate(out)


def weights(model) -> dict:
    return {k: v for k, v in tree_flatten(model.parameters())}


def break_tiles(monkeypatch) -> None:
    """A tiled path that computes something else: tiles whose scales are doubled (undone by untiling)."""
    tile, untile = tiling.tile, tiling.untile
    monkeypatch.setattr(tiling, "tile", lambda w, s, b: tile(w, s * 2, b))
    monkeypatch.setattr(tiling, "untile", lambda w, s, b: (lambda u: (u[0], u[1] / 2, u[2]))(untile(w, s, b)))


def tiled_blocks(model) -> int:
    return sum(tiling.is_tiled(b) for b in model.model.layers)


def test_tiled_model_matches_row_major_and_comes_back(tiles, monkeypatch):
    original = weights(tiny_llama())
    model = tiny_llama()
    monkeypatch.setenv("MLXINFER_TILED", "0")
    patch.apply_kernels(model, "auto")
    assert tiled_blocks(model) == 0
    expected = run(model)
    monkeypatch.delenv("MLXINFER_TILED")
    report = patch.apply_kernels(model, "auto")
    assert "2 decoder layers' weights in row tiles" in report.detail, report.detail
    assert tiled_blocks(model) == 2
    q = model.model.layers[0].self_attn.q_proj
    assert not mx.array_equal(q["weight"], original["model.layers.0.self_attn.q_proj.weight"]).item()
    got = run(model)
    err = float(mx.abs(got - expected).max() / mx.abs(expected).max())
    assert err < 1e-4, err
    patch.apply_kernels(model, "builtin")  # kernels off: MLX's layout, bit for bit
    assert tiled_blocks(model) == 0
    assert all(mx.array_equal(v, original[k]).item() for k, v in weights(model).items())


def test_a_call_the_op_does_not_take_untiles_first(tiles):
    model = tiny_llama()
    patch.apply_kernels(model, "auto")
    block = model.model.layers[0]
    assert tiling.is_tiled(block)
    x = mx.random.normal((1, 3, 128)).astype(mx.float16)  # not float32: the op declines, per-op/MLX code runs
    assert fused_block.native_block(block, x, "causal", cache_lib.KVCache()) is None and tiling.is_tiled(block)
    y = block(x, "causal", cache_lib.KVCache())
    assert not tiling.is_tiled(block) and tiling.is_tiled(model.model.layers[1])
    patch.apply_kernels(model, "builtin")
    ref = block(x, "causal", cache_lib.KVCache())
    assert mx.allclose(y.astype(mx.float32), ref.astype(mx.float32), atol=2e-2, rtol=2e-2).item()


def test_a_tiled_path_that_disagrees_keeps_mlx_layout(tiles, monkeypatch):
    model = tiny_llama()
    original = weights(model)
    patch.apply_kernels(model, "builtin")
    expected = run(model, steps=3)
    break_tiles(monkeypatch)
    report = patch.apply_kernels(model, "auto")
    assert "disagreed with itself on MLX's layout" in report.detail and "row tiles" in report.detail, report.detail
    assert "decoder layers as one op" in report.detail and tiled_blocks(model) == 0
    got = run(model, steps=3)
    assert mx.allclose(got, expected, atol=2e-3, rtol=2e-3).item(), float(mx.abs(got - expected).max())
    with pytest.raises(Exception, match="row tiles"):
        patch.apply_kernels(model, "custom")
    patch.apply_kernels(model, "builtin")
    assert all(mx.array_equal(v, original[k]).item() for k, v in weights(model).items())


def test_a_call_without_a_cache_runs_on_mlx_layout(tiles):
    model = tiny_llama()
    patch.apply_kernels(model, "builtin")
    expected = model(mx.array([[2, 4, 6, 8]]))
    patch.apply_kernels(model, "auto")
    assert tiled_blocks(model) == 2
    got = model(mx.array([[2, 4, 6, 8]]))  # no cache: the blocks' own code, never the op
    assert tiled_blocks(model) == 0
    assert mx.allclose(got, expected, atol=1e-3, rtol=1e-3).item(), float(mx.abs(got - expected).max())


def test_setting_values(monkeypatch):
    monkeypatch.setenv("MLXINFER_TILED", "0")
    assert not native_mod.tiled_requested() and native_mod.tiled_problem() is None
    monkeypatch.setenv("MLXINFER_TILED", "off")
    assert native_mod.tiled_requested()
    assert native_mod.tiled_problem().startswith("MLXINFER_TILED='off' is not 0 or 1")
    assert "MLXINFER_TILED" in native_mod.settings_problem()
    monkeypatch.delenv("MLXINFER_TILED")
    assert native_mod.tiled_requested() and native_mod.tiled_problem() is None


def test_selfcheck_reports_tiles_count(tiles):
    model = tiny_llama()
    patch.apply_kernels(model, "auto")
    assert tiled_blocks(model) == 2
    assert selfcheck.tile_checked(model) == (0, [])  # already tiled: nothing more to do


@pytest.mark.parametrize("tied,bits", [(True, 4), (False, 4), (True, 8), (False, 8)])
def test_the_lm_head_in_tiles(tiles, monkeypatch, tied, bits):
    model = llama_with_head(tied, bits)
    original = weights(model)
    monkeypatch.setenv("MLXINFER_TILED", "0")
    patch.apply_kernels(model, "auto")
    expected = run(model)
    monkeypatch.delenv("MLXINFER_TILED")
    report = patch.apply_kernels(model, "auto")
    assert "2 decoder layers' and the LM head's weights in row tiles" in report.detail, report.detail
    head = model.model.embed_tokens if tied else model.lm_head
    assert tiling.tiles_of(head) is head and head.bits == bits
    if not tied:  # the untied input embedding is read a row at a time: left as it is
        assert tiling.tiles_of(model.model.embed_tokens) is None
    got = run(model)
    assert float(mx.abs(got - expected).max() / mx.abs(expected).max()) < 1e-4
    ids = mx.array([[0, 5, 17, 160, 319]])
    rows = model.model.embed_tokens(ids)
    patch.apply_kernels(model, "builtin")
    assert all(mx.array_equal(v, original[k]).item() for k, v in weights(model).items())
    assert mx.array_equal(rows, model.model.embed_tokens(ids)).item()  # the tiled lookup is exact


def test_a_tiled_blocks_linear_called_alone_untiles_the_block(tiles):
    model = tiny_llama()
    patch.apply_kernels(model, "auto")
    block = model.model.layers[0]
    q = block.self_attn.q_proj
    assert tiling.tiles_of(q) is block
    x = mx.random.normal((1, 2, 128))
    y = q(x)  # not through the op: the block's weights go back first
    assert not tiling.is_tiled(block) and tiling.tiles_of(q) is None
    patch.apply_kernels(model, "builtin")
    assert mx.allclose(y, q(x), atol=1e-3, rtol=1e-3).item()


def test_a_head_whose_tiles_disagree_keeps_mlx_layout(tiles, monkeypatch):
    model = llama_with_head(True)
    patch.apply_kernels(model, "builtin")
    expected = run(model, steps=3)
    break_tiles(monkeypatch)
    report = patch.apply_kernels(model, "auto")
    assert "self-check: the fused path of model.embed_tokens" in report.detail, report.detail
    assert tiling.tiles_of(model.model.embed_tokens) is None
    got = run(model, steps=3)
    assert mx.allclose(got, expected, atol=2e-3, rtol=2e-3).item(), float(mx.abs(got - expected).max())


def test_applying_kernels_leaves_no_freed_buffers_behind(native):
    """The arrays kernels replace (tiles are new arrays) and the self-checks' intermediates are returned at load,
    not by the first prompt's prefill (its mx.clear_cache after the chunk took ~25 ms of a Gemma-3-270M TTFT)."""
    model = tiny_llama()
    old = mx.set_cache_limit(1 << 30)  # as the loader sets it on the CPU backend: freed buffers stay cached
    try:
        patch.apply_kernels(model, "custom")
        assert mx.get_cache_memory() == 0
    finally:
        mx.set_cache_limit(old)


def make_symmetric(model, keep: str = "") -> None:
    """Every quantized layer's biases set to -2^(bits-1) * scales (a Q4_0 / Q8_0 import's form), but ``keep``'s."""
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and path != keep:
            m["biases"] = m["scales"] * -(2 ** (m.bits - 1))
    mx.eval(model.parameters())


@pytest.mark.parametrize("head_bits", [4, 8])
def test_symmetric_weights_decode_without_reading_their_biases(tiles, monkeypatch, head_bits):
    model = llama_with_head(tied=False, head_bits=head_bits)  # untied: the lookup reads the embedding's biases
    make_symmetric(model, keep="model.layers.1.mlp.down_proj")  # layer 1: one linear with real biases
    monkeypatch.setenv("MLXINFER_TILED", "0")
    patch.apply_kernels(model, "auto")
    expected = run(model)
    monkeypatch.delenv("MLXINFER_TILED")
    patch.apply_kernels(model, "auto")
    layers, head = model.model.layers, model.lm_head
    assert tiled_blocks(model) == 2 and tiling.is_tiled(head)
    assert tiling.is_symmetric(layers[0]) and not tiling.is_symmetric(layers[1]) and tiling.is_symmetric(head)
    got = run(model)
    assert float(mx.abs(got - expected).max() / mx.abs(expected).max()) < 1e-4
    # Decode never reads a symmetric block's or head's biases: NaN there after the prefill changes nothing.
    cache = cache_lib.make_prompt_cache(model)
    out = [model(mx.array([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31]]), cache=cache)[:, -1]]
    for m in [*layers[0]._tiled, head]:
        m["biases"] = mx.full(m["biases"].shape, float("nan"), m["biases"].dtype)
    for _ in range(8):
        out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=cache)[:, -1])
    decoded = mx.concatenate(out)
    assert float(mx.abs(decoded - expected[:9]).max() / mx.abs(expected).max()) < 1e-4


def test_a_symmetric_path_that_disagrees_keeps_mlx_layout(tiles, monkeypatch):
    """The symmetric plan runs the self-check before use like any tiled one: with tiling.symmetric lying (these
    biases are -4 * scales, not -8 *), the first layer's output moves, so no layer is tiled, one finding says so,
    and the output stays right; --kernels custom fails."""
    model = llama_with_head(tied=False)
    for m in model.model.layers:
        for _, lin in m.named_modules():
            if isinstance(lin, nn.QuantizedLinear):
                lin["biases"] = lin["scales"] * -4
    patch.apply_kernels(model, "builtin")
    expected = run(model)
    monkeypatch.setattr(tiling, "symmetric", lambda linears: True)
    report = patch.apply_kernels(model, "auto")
    assert tiled_blocks(model) == 0 and "model.layers.0 (+1 alike) on row tiles" in report.detail, report.detail
    got = run(model)
    assert float(mx.abs(got - expected).max() / mx.abs(expected).max()) < 1e-3
    with pytest.raises(patch.MlxinferError):
        patch.apply_kernels(model, "custom")
