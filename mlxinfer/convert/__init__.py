"""Model conversion: Hugging Face safetensors or GGUF -> MLX, quantized by recipe, streamed shard by shard.

- ``recipes``: uniform and mixed-precision recipes, TOML per-layer rules -> an mlx-lm quant predicate;
- ``writer``: evaluates lazy tensors and writes them shard by shard (bounded memory);
- ``quality``: KL divergence / perplexity / top-1 agreement against the source on a built-in sample;
- ``card``: README model card and the ``--alias`` entry in the user's models.toml;
- ``pipeline``: ``convert()`` ties them together with an atomic temp-dir-and-rename write.
"""

from .pipeline import ConvertOptions, ConvertResult, InsufficientDisk, OutputExists, convert
from .recipes import BUILTIN as RECIPES
from .source import PickleRefused

__all__ = ["ConvertOptions", "ConvertResult", "InsufficientDisk", "OutputExists", "PickleRefused", "RECIPES", "convert"]
