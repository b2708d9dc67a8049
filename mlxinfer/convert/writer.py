"""Write lazily computed weights shard by shard, so peak memory stays near one shard, not the model size.

The input is a flat ``{name: mx.array}`` dict whose arrays are still *lazy*: file-backed loads from the source
safetensors (``mx.load`` reads nothing until evaluated), cast and quantized by MLX ops. Shards are planned from
``nbytes`` (known without evaluating). For each shard we evaluate its tensors one at a time, save the shard and
drop every reference to them, so MLX frees both the result and the source data it was computed from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Progress = Callable[[str, int, int], None]
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class WriteStats:
    files: list[str]
    total_bytes: int
    tensors: int


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_bytes``; a bigger tensor gets a shard of its own.

    The order is the model's module order, so a layer's weight/scales/biases (one quantize op) share a shard.
    """
    shards: list[list[str]] = []
    size = 0
    for name, n in sizes.items():
        if not shards or (size + n > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(
    weights: dict,
    out_dir: Path,
    *,
    max_shard_bytes: int,
    total_parameters: int,
    progress: Progress | None = None,
    after_tensor: Callable[[str], None] | None = None,
) -> WriteStats:
    """Evaluate and save ``weights`` (emptied as it goes) into ``out_dir`` as sharded safetensors + index.

    ``progress("convert", done_tensors, total_tensors)`` is called after each tensor. ``after_tensor(name)`` is a
    test hook (inject a failure mid-write).
    """
    import mlx.core as mx

    sizes = {k: int(v.nbytes) for k, v in weights.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = shard_names(len(shards))
    total = len(sizes)
    weight_map: dict[str, str] = {}
    done = 0
    if progress:
        progress("convert", 0, total)
    for keys, fname in zip(shards, names):
        shard = {}
        for key in keys:
            arr = weights.pop(key)  # drop the dict's reference: after saving, nothing holds this tensor
            mx.eval(arr)
            shard[key] = arr
            del arr
            done += 1
            if after_tensor:
                after_tensor(key)
            if progress:
                progress("convert", done, total)
        mx.save_safetensors(str(out_dir / fname), shard, metadata={"format": "mlx"})
        for key in shard:
            weight_map[key] = fname
        del shard
        mx.clear_cache()  # return freed buffers to the OS instead of MLX's cache
    index = {
        "metadata": {"total_size": sum(sizes.values()), "total_parameters": int(total_parameters)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=4))
    file_bytes = sum(os.path.getsize(out_dir / n) for n in names)
    return WriteStats(files=names, total_bytes=file_bytes, tensors=total)
