"""Pipeline parallel for any decoder-only mlx-lm model: ``model.layers`` split into contiguous stages.

Rank r keeps layers [r*n/size, (r+1)*n/size) and drops the others before any weight is read (the model is
loaded lazily), so it materialises only its stage plus the embedding, final norm and LM head. A forward pass:
rank 0 embeds and runs stage 0, hands the hidden states to rank 1 (``send``/``recv``), ...; the last stage's
output reaches every rank through one ``all_gather`` (a collective that keeps it in every rank's graph), and
every rank computes the same logits and samples the same token from the same seeded generator, so no token
needs sending back. The hand-offs live in a thin wrapper around each stage's first and last layer; the layers
themselves (and the fused kernels swapped into them) are untouched.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .group import DistributedError, World


def layer_owner(model):
    """The module whose ``layers`` list the model's forward loops over (``model.model`` in mlx-lm)."""
    for owner in (getattr(model, "model", None), model):
        if owner is not None and isinstance(owner.get("layers") if isinstance(owner, nn.Module) else None, list):
            return owner
    raise DistributedError(f"cannot split {type(model).__module__}: no list of decoder layers found",
                           hint="pipeline parallel needs a decoder-only mlx-lm model")


def stage_bounds(n_layers: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous, as even as possible; earlier stages take the remainder last (rank 0 also embeds)."""
    return rank * n_layers // size, (rank + 1) * n_layers // size


class _Wrapper(nn.Module):
    """Reads through to the wrapped layer for attributes the model's forward asks of it (e.g. ``use_sliding``)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "layer" and "layer" in self:
                return getattr(self["layer"], name)
            raise


class Beat(_Wrapper):
    """A layer that tells the watchdog a forward pass started (tensor parallel has no stage edges to do it)."""

    def __init__(self, layer: nn.Module, world: World):
        super().__init__()
        self.layer = layer
        self._watchdog = world.watchdog

    def __call__(self, x, *args, **kwargs):
        self._watchdog.beat()
        return self.layer(x, *args, **kwargs)


class StageEdge(_Wrapper):
    """One of a stage's layers with the hand-offs around it: ``recv`` before the stage's first layer (ranks > 0),
    ``send`` + the final ``all_gather`` after its last. Holds the layer as a child, so kernels still find it."""

    def __init__(self, layer: nn.Module, world: World, first: bool, last: bool):
        super().__init__()
        self.layer = layer
        self._rank, self._size, self._group = world.rank, world.size, world.group
        self._first, self._last = first, last
        self._watchdog = world.watchdog

    def __call__(self, x, *args, **kwargs):
        rank, size, group = self._rank, self._size, self._group
        if self._first and self._watchdog is not None:
            self._watchdog.beat()
        if self._first and rank > 0:
            x = mx.distributed.recv_like(x, rank - 1, group=group)
        y = self.layer(x, *args, **kwargs)
        if self._last:
            if rank < size - 1:
                y = mx.distributed.send(y, rank + 1, group=group)
                # Prefill evaluates only the caches, which do not depend on this send; start it now so the
                # next stage is never left waiting for a hand-off nobody evaluates.
                mx.async_eval(y)
            b = y.shape[0]
            y = mx.distributed.all_gather(y, group=group)[(size - 1) * b: size * b]
        return y


def split(model, world: World) -> dict:
    """Keep only this rank's stage in ``model`` (before its weights are evaluated); returns the plan."""
    owner = layer_owner(model)
    layers = owner["layers"]
    n = len(layers)
    if n < world.size:
        raise DistributedError(f"the model has {n} layers, fewer than the {world.size} ranks",
                               hint="run on fewer ranks")
    start, end = stage_bounds(n, world.rank, world.size)
    stage = list(layers[start:end])
    if world.size > 1:
        if len(stage) == 1:
            stage = [StageEdge(stage[0], world, first=True, last=True)]
        else:
            stage[0] = StageEdge(stage[0], world, first=True, last=False)
            stage[-1] = StageEdge(stage[-1], world, first=False, last=True)
    owner["layers"] = stage  # the other ranks' layers (lazy, never read) are dropped here
    return {"strategy": "pipeline", "layers": f"{start}-{end - 1} of {n}", "stage": [start, end]}
