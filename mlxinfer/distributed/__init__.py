"""mlxinfer across machines on MLX's distributed engine (``mlx.launch``): see docs/distributed.md.

``enter()`` (called by chat, generate and bench before loading) joins the group; the loader then calls
``prepare(model, config)`` on the lazily loaded model, which shards it by tensor parallelism where mlx-lm can
(``model.shard``) and the head counts divide, else — or with ``--pipeline`` — splits its layers into stages.
Outside ``mlx.launch`` both do nothing.
"""

from __future__ import annotations

import weakref
from typing import Optional

from .group import DistributedError, World, current, launched  # noqa: F401


def enter(pipeline: bool = False) -> Optional[World]:
    """Join the group when run under ``mlx.launch`` (None otherwise; a group of one changes nothing)."""
    from .group import setup

    world = setup(pipeline)
    return world if world is not None and world.size > 1 else None


def prepare(model, config: dict) -> Optional[str]:
    """Shard ``model`` (lazy: no weight read yet) for this rank; returns a line for the kernel report."""
    world = current()
    if world is None or world.size == 1:
        return None
    from . import pipeline, tensor

    if world.strategy == "tensor":
        reason = tensor.why_not(model, config, world.size)
        if reason is None:
            plan = tensor.shard(model, world)
        else:
            plan = pipeline.split(model, world)
            plan["fallback"] = f"tensor parallel not possible: {reason}"
    else:
        plan = pipeline.split(model, world)
    if plan["strategy"] == "tensor":
        owner = pipeline.layer_owner(model)
        owner["layers"][0] = pipeline.Beat(owner["layers"][0], world)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    plan.update(hidden=int(text.get("hidden_size") or 0), n_layers=int(text.get("num_hidden_layers") or 0))
    world.plan = plan
    if plan["strategy"] == "tensor":
        plan["kernels"] = ("sharded linear layers run MLX's built-in quantized matmul and the fused decoder "
                           "layer steps aside (both take unsharded nn.QuantizedLinear only)")
        plan["model"] = weakref.ref(model)  # describe() reads what the kernels made of each layer group
    return describe(world)


def describe(world: World) -> str:
    """One line: strategy, this rank's layers, fallback, and (tensor parallel, once the kernels are applied)
    what runs each layer group."""
    plan = world.plan
    model = plan["model"]() if plan.get("model") else None
    if model is not None and any(type(m).__module__.startswith("mlxinfer.") for _, m in model.named_modules()):
        from .tensor import kernel_groups

        plan = {**plan, "kernels": kernel_groups(model)}
    line = f"{plan['strategy']} parallel over {world.size} ranks ({world.backend}), rank {world.rank}: layers " \
           f"{plan['layers']}"
    if plan.get("fallback"):
        line += f"; {plan['fallback']}"
    if plan.get("kernels"):
        line += f"; {plan['kernels']}"
    return line
