"""Every tensor of a GGUF against what its metadata promises, before the import writes a byte.

The expected names and shapes come from the mlx-lm model that will load the result, built from the generated
config.json (its parameters are lazy MLX arrays: nothing is allocated). Metadata sizes are already bounded by
``gguf_config.llm_config``, and the layer count may not exceed the layers the file holds, so this build is
never larger than the file. Like llama.cpp's own loader, any difference is an error: a missing or extra tensor,
a shape that does not fit, a zero dimension.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InvalidModel
from .gguf_config import gguf_name
from .gguf_file import GgufTensor

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_HINT = "the file is corrupt or its metadata does not belong to its tensors"


def _dims(shape) -> str:
    return " x ".join(str(d) for d in shape)


def check_layers(path: Path, arch: str, tensors: list[GgufTensor], n_layers: int) -> None:
    """``{arch}.block_count`` against the ``blk.N`` tensors present, and no zero dimension anywhere."""
    layers = set()
    for t in tensors:
        if not t.shape or 0 in t.shape:
            raise InvalidModel(f"{path.name}: tensor '{t.name}' has a zero dimension ({_dims(t.shape) or 'no dims'})",
                               hint=_HINT)
        m = _BLOCK_RE.match(t.name)
        if m:
            layer = int(m.group(1))
            if layer >= n_layers:
                raise InvalidModel(f"{path.name}: tensor '{t.name}' is beyond '{arch}.block_count' {n_layers}",
                                   hint=_HINT)
            layers.add(layer)
    if len(layers) < n_layers:
        raise InvalidModel(f"{path.name}: '{arch}.block_count' is {n_layers} but the file holds tensors for "
                           f"{len(layers)} layers", hint=_HINT)


def check_shapes(path: Path, arch: str, config: dict, present: dict[str, tuple[str, list[int]]]) -> None:
    """``present``: Hugging Face name -> (GGUF name, shape) of every tensor the import would write."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        raise InvalidModel(f"{path.name}: its metadata does not describe a model mlx-lm can build ({e})",
                           hint=_HINT) from None
    if hasattr(model, "sanitize"):  # as mlx-lm's load does (gemma3 drops its lm_head here), on lazy zeros
        import mlx.core as mx

        try:
            stand_ins = model.sanitize({hf: mx.zeros(shape, dtype=mx.float16) for hf, (_, shape) in present.items()})
        except (ValueError, TypeError, OverflowError) as e:
            raise InvalidModel(f"{path.name}: its tensors do not fit a {arch} model ({e})", hint=_HINT) from None
        present = {hf: (present.get(hf, (hf, None))[0], list(v.shape)) for hf, v in stand_ins.items()}
    expected = {name: list(v.shape) for name, v in tree_flatten(model.parameters())}
    del model
    for hf, (name, shape) in present.items():
        want = expected.get(hf)
        if want is None:
            raise InvalidModel(f"{path.name}: tensor '{name}' is not part of a {arch} model with this metadata",
                               hint=_HINT)
        if list(shape) != want:
            raise InvalidModel(f"{path.name}: tensor '{name}' is {_dims(shape)} but the {arch}.* metadata "
                               f"(embedding_length, head_count, feed_forward_length, vocabulary) needs "
                               f"{_dims(want)}", hint=_HINT)
    missing = [hf for hf in expected if hf not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InvalidModel(f"{path.name}: the file lacks tensor '{gguf_name(missing[0], arch)}'{more}, which its "
                           f"{arch}.* metadata needs", hint=_HINT)
