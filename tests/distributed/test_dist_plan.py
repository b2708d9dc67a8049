"""The split and the tensor-parallel checks, in one process (no launcher): stage bounds, why tensor parallel is
refused, and a stage cut from a real (tiny) mlx-lm llama whose forward still finds what it asks of its layers."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from dist_cli import tiny_llama

from mlxinfer.distributed import pipeline, tensor
from mlxinfer.distributed.group import World


@pytest.mark.parametrize("n,size,expected", [
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 7), (7, 15), (15, 22), (22, 30)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_stage_bounds_are_contiguous_and_cover_every_layer(n, size, expected):
    assert [pipeline.stage_bounds(n, r, size) for r in range(size)] == expected


SMOLLM2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "intermediate_size": 1536, "quantization": {"group_size": 32, "bits": 4}}


def test_tensor_parallel_refusals_name_the_reason():
    shardable = types.SimpleNamespace(shard=lambda group: None)
    assert tensor.why_not(shardable, SMOLLM2, 2) == "9 attention heads do not divide by 2 ranks"
    assert tensor.why_not(shardable, SMOLLM2, 3) is None  # 9 / 3 heads, 3 / 3 KV heads, 192 and 512 per rank
    even = {**SMOLLM2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
            "intermediate_size": 1024, "quantization": {"group_size": 64, "bits": 4}}
    assert tensor.why_not(shardable, even, 2) is None
    wide_groups = {**even, "num_key_value_heads": 8, "quantization": {"group_size": 128, "bits": 4}}
    assert tensor.why_not(shardable, wide_groups, 8) == (
        "the attention output (512) split 8 ways is not a multiple of the quantization group 128")
    assert "has no shard()" in tensor.why_not(object(), {"model_type": "gemma3"}, 2)


def _world(rank: int, size: int) -> World:
    return World(group=None, rank=rank, size=size, backend="ring", strategy="pipeline", timeout=60,
                 watchdog=types.SimpleNamespace(beat=lambda: None))


def test_split_keeps_only_this_ranks_layers_and_wraps_the_edges(tmp_path):
    from pathlib import Path

    from mlx_lm.utils import load_model

    model, _ = load_model(Path(tiny_llama(tmp_path / "m", layers=5)), lazy=True)
    originals = list(model.model.layers)
    plan = pipeline.split(model, _world(1, 2))
    stage = model.model.layers
    assert plan["layers"] == "2-4 of 5" and len(stage) == 3
    assert isinstance(stage[0], pipeline.StageEdge) and isinstance(stage[-1], pipeline.StageEdge)
    assert stage[0].layer is originals[2] and stage[1] is originals[3] and stage[2].layer is originals[4]
    assert stage[0].use_sliding is False  # the llama forward reads it from each layer
    assert len(model.layers) == 3  # caches are made per kept layer (mlx-lm's make_prompt_cache)


def test_split_refuses_more_ranks_than_layers(tmp_path):
    from pathlib import Path

    from mlx_lm.utils import load_model

    from mlxinfer.distributed.group import DistributedError

    model, _ = load_model(Path(tiny_llama(tmp_path / "m", layers=2)), lazy=True)
    with pytest.raises(DistributedError, match="fewer than the 3 ranks"):
        pipeline.split(model, _world(0, 3))


def test_tensor_parallel_kernel_report_names_what_runs_each_layer_group(tmp_path):
    """mlx's sharded layers on a group of one (same classes as on N ranks), then the kernels: the report lists
    the sharded projections as MLX built-in and the norms, RoPE, attention and embedding as custom kernels."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from mlxinfer.kernels.patch import apply_kernels

    model, _ = load_model(Path(tiny_llama(tmp_path / "q4", bits=4)), lazy=True)
    model.shard(mx.distributed.init())
    mx.eval(model.parameters())
    report = apply_kernels(model, "auto")
    line = tensor.kernel_groups(model)
    assert line.startswith("sharded linear layers run MLX's built-in quantized matmul (down_proj, gate_proj, k_proj, "
                           "o_proj, q_proj, up_proj, v_proj:")
    if report.name != "builtin":  # the native kernels are built here; then these layers run them
        assert "input_layernorm, norm, post_attention_layernorm (KernelRMSNorm)" in line
        assert "embed_tokens (KernelQuantizedEmbedding)" in line
