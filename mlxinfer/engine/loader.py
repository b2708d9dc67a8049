"""Load a model argument into a ready-to-run ``LoadedModel``.

spec (registry) -> a local MLX directory (Hub download, GGUF import, or a path) -> mlx-lm builds the architecture ->
backend dtype policy -> custom kernels patched in (``mlxinfer.kernels.patch``) -> tokenizer + chat template.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import DamagedFile, InvalidModel, MlxinferError, one_line
from ..registry import ModelSpec, Registry
from .backend import activation_dtype, backend, keep_freed_buffers

# (stage, done, total): stages "download" (bytes), "hash", "import" and "write" (a GGUF's first import), "load"
Progress = Callable[[str, int, int], None]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
QUANT_PARAMS = ("scales", "biases")  # a quantized layer's own (per-group) parameters


@dataclass
class LoadedModel:
    """A model ready to generate: mlx-lm module + tokenizer + what the UI and bench report about it."""

    model: Any                     # mlx.nn.Module following mlx-lm's contract: model(tokens, cache=cache)
    tokenizer: Any                 # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    path: Path
    spec: ModelSpec
    backend: str                   # "metal" | "cuda" | "cpu"
    dtype: str                     # activation dtype, e.g. "float32"
    kernels: str = "builtin"       # which kernels run, e.g. "cpu-native", "metal-custom", "builtin"
    kernels_detail: str = ""
    chat_template: str | None = None
    eos_token_ids: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.alias or self.spec.name

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")

    @property
    def context_length(self) -> int:
        from .model_checks import text_value

        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if isinstance(value := text_value(self.config, key), int):  # a multimodal checkpoint: in text_config
                break
        else:
            value = 4096
        return min(value, self.spec.context) if self.spec.context else value

    @property
    def quantization(self) -> str:
        q = self.config.get("quantization")
        if not q:
            return "none (" + self.config.get("torch_dtype", "float") + ")"
        mode = q.get("mode", "affine")
        label = f"{q.get('bits')}-bit {mode}, group {q.get('group_size')}"
        overrides = sum(1 for v in q.values() if isinstance(v, dict))
        return label + (f" (+{overrides} layers at other widths)" if overrides else "")

    def num_parameters(self) -> int:
        from mlx_lm.utils import get_total_parameters

        return int(get_total_parameters(self.model))

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def model_dir(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """Materialise the spec as a local MLX model directory."""
    if spec.kind == "hub":
        from ..sources.hub import download_model

        return download_model(spec.repo, spec.revision, progress=progress)
    path = spec.path
    if path is None or not path.exists():
        raise InvalidModel(f"no such file or directory: {path}", hint="check the path")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from ..sources.gguf_import import import_gguf

            return import_gguf(path, progress=progress)
        raise InvalidModel(f"{path} is not a model", hint="give a model directory or a .gguf file")
    return path


def cache_fix(spec: ModelSpec) -> str | None:
    """The hint for damaged weights in the cache copy of ``spec``: the commands that replace it (None for the user's
    own directory). rm takes every revision of a Hub repo: revisions share blobs, so removing one may free nothing."""
    import shlex

    name = shlex.quote(spec.name)
    rm = shlex.quote(spec.repo) if spec.kind == "hub" else name
    if spec.kind != "hub" and not spec.is_gguf:
        return None
    return f"the cached copy is damaged; get it again: mlxinfer rm {rm} --yes && mlxinfer pull {name}"


@contextlib.contextmanager
def damage_hint(fix: str | None):
    """A DamagedFile raised inside gets ``fix`` (a cache_fix) as its hint; unchanged when there is none."""
    try:
        yield
    except DamagedFile as e:
        if fix is None:
            raise
        raise DamagedFile(e.args[0], hint=fix) from None


def check_model_dir(path: Path) -> dict:
    """Fail early, with one clear line, on directories mlx-lm could not load or should not: custom code, a broken
    or absurd config.json, weights that contradict it. Returns the config."""
    from .model_checks import require_regular

    require_regular(path / "config.json")
    if not (path / "config.json").is_file():
        raise InvalidModel(f"{path} has no config.json", hint="give an MLX model directory, a .gguf file or a Hub repo")
    if not list(path.glob("model*.safetensors")):  # what mlx-lm's load_model reads
        if any(p.suffix in _PICKLE_SUFFIXES for p in path.iterdir()):
            raise InvalidModel(
                f"{path} has only pickle weights, which mlxinfer never loads",
                hint="convert a safetensors source with 'mlxinfer convert'",
            )
        raise InvalidModel(f"{path} has no model*.safetensors weights", hint="the download may be incomplete")
    from .model_checks import check_model_files
    from .trust import check_no_remote_code

    for p in path.iterdir():  # what the loaders open: a FIFO there would block the load forever
        if p.suffix in (".json", ".safetensors", ".model", ".jinja", ".txt", ".tiktoken"):
            require_regular(p)
    config = check_model_files(path)
    check_no_remote_code(path)
    return config


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _eos_ids(path: Path, config: dict) -> list[int]:
    ids: dict[int, None] = {}  # ordered and de-duplicated in linear time (a config may list 100k of them)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}  # multimodal layout
    for source in (config, text, _read_json(path / "generation_config.json")):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                ids[v] = None
    return list(ids)


def load_model_dir(path: Path, *, lazy: bool = False):
    """mlx-lm builds the model from the directory; returns (model, config). Errors become one clear line."""
    config = check_model_dir(path)
    from mlx_lm.utils import load_model  # after the checks: importing mlx-lm and transformers takes seconds

    try:
        return load_model(path, lazy=lazy, trust_remote_code=False)
    except MlxinferError:
        raise
    except (TypeError, AttributeError, ZeroDivisionError, OverflowError, IndexError, NameError) as e:
        # (NameError: mlx-lm's UnboundLocalError on a quantization_config that its weights do not match)
        # A config.json that passed the sanity checks but still does not fit the architecture's fields.
        msg = str(e).splitlines()[0] if str(e) else ""
        raise InvalidModel(
            f"{path}/config.json does not fit mlx-lm's '{config.get('model_type')}' model "
            f"({type(e).__name__}: {msg})", hint="the config is corrupt or was written for another architecture",
        ) from None
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "model type" in msg.lower() or "not supported" in msg.lower():
            raise InvalidModel(f"{path}: unsupported architecture ({msg})", hint="upgrade mlx-lm") from None
        raise InvalidModel(
            f"cannot load weights from {path}: {msg}",
            hint="the files may be truncated or corrupt; delete them and download or convert again",
        ) from None


def apply_dtype_policy(model, *, keep_quantized_scales: bool = False) -> str:
    """Cast floating parameters to the backend's activation dtype; returns its name.

    ``keep_quantized_scales``: quantized layers' scales/biases keep their stored (float16/bfloat16) dtype where the
    policy would widen them (float32 activations on the CPU): the native CPU kernels read them as stored, and
    float32 copies would add a sixth of a 4-bit model's bytes to every decode step. The caller must then run
    ``kernels.patch.apply_kernels``, which widens those of the layers no native kernel runs (see there)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    model_dtype = max(set(floats), key=floats.count) if floats else mx.float16
    target = activation_dtype(model_dtype)

    def cast(m, key, value):
        if not nn.Module.valid_parameter_filter(m, key, value):
            return False
        return not (keep_quantized_scales and target == mx.float32 and key in QUANT_PARAMS
                    and isinstance(m.get("scales"), mx.array) and hasattr(m, "group_size"))

    model.apply(lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) and p.dtype != target else p,
                cast)
    return str(target).replace("mlx.core.", "")


def load(
    model: str | Path | ModelSpec | None = None,
    *,
    kernels: str = "auto",
    progress: Progress | None = None,
    registry: Registry | None = None,
) -> LoadedModel:
    """Load an alias, Hub repo id (``org/name[@rev]``), MLX directory or ``.gguf`` file (default: the bundled model).
    ``kernels``: "auto" (custom kernels where they are checked to run, else MLX's built-ins, the reason in
    ``.kernels``), "custom" (fail instead of falling back) or "builtin". ``progress(stage, done, total)``: see
    ``Progress``; nothing is printed. A first load downloads (Hub) or imports (GGUF) into the cache."""
    if isinstance(model, str) and not model.strip():  # "" loaded the default model without a word
        raise InvalidModel("the model name is empty", hint="give an alias, a Hub repo id or a path; None loads "
                           "the bundled default")
    import mlx.core as mx

    from .trust import load_tokenizer

    if isinstance(model, ModelSpec):
        spec = model
    else:
        spec = (registry or Registry.load()).resolve(str(model) if model is not None else None)
    path = model_dir(spec, progress)
    if progress:
        progress("load", 0, 1)
    with damage_hint(cache_fix(spec)):
        net, config = load_model_dir(path, lazy=True)
    from ..distributed import prepare  # under mlx.launch: keep only this rank's shard, before any weight is read

    shard_line = prepare(net, config)
    dtype = apply_dtype_policy(net, keep_quantized_scales=True)  # apply_kernels below settles them
    try:
        mx.eval(net.parameters())
    except (ValueError, RuntimeError) as e:
        raise InvalidModel(f"cannot read weights from {path}: {e}", hint="the files may be truncated") from None

    eos = _eos_ids(path, config)
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=eos or None)
    except MlxinferError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many types for broken tokenizer files
        raise InvalidModel(f"cannot load the tokenizer in {path}: {one_line(e)}",
                           hint="the tokenizer files may be broken; download or convert the model again") from None

    from ..kernels.patch import apply_kernels

    report = apply_kernels(net, kernels)
    keep_freed_buffers()
    loaded = LoadedModel(
        model=net, tokenizer=tokenizer, config=config, path=path, spec=spec, backend=backend(), dtype=dtype,
        kernels=report.name, kernels_detail=report.detail + (f"; {shard_line}" if shard_line else ""),
        chat_template=spec.defaults.get("chat_template") or getattr(tokenizer, "chat_template", None),
        eos_token_ids=set(tokenizer.eos_token_ids or []) | set(eos),
    )
    if progress:
        progress("load", 1, 1)
    return loaded
