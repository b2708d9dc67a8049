"""``convert()``: source -> lazily loaded mlx-lm model -> cast / (de)quantize -> streamed shards -> quality -> rename.

Everything is written into a temporary directory next to OUT_DIR (``fsutil.AtomicDir``) and renamed into place at
the end, so an error, Ctrl-C, SIGTERM or a full disk leaves no partial OUT_DIR. Where ``-o`` may point and what
``--force`` may replace is decided by ``output`` before any work.
"""

from __future__ import annotations

import datetime as _dt
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InvalidModel, InvalidParameter, MlxinferError
from ..fsutil import AtomicDir, write_failure
from . import recipes as R
from .output import OutputExists, check_not_source, check_output_path, check_replaceable, disk_error, is_model_file  # noqa: F401,E501
from .requant import check_requantize
from .source import SourceInfo, resolve_source

Progress = Callable[[str, int, int], None]
DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_SHARD_BYTES = 1 << 30
# Quality check is on by default up to this many source parameters (two models run the sample).
AUTO_EVAL_MAX_PARAMS = 4_000_000_000
AUTO_EVAL_MAX_PARAMS_CPU = 200_000_000
# Not copied from the source: what convert writes itself, and clutter. The rest of output.MODEL_FILES (tokenizer,
# generation settings, chat template, licence) is copied; nothing else, so an output is always a model directory.
SKIP_FILES = {"config.json", "README.md", ".gitattributes", ".DS_Store"}


class InsufficientDisk(MlxinferError):
    pass


@dataclass
class ConvertOptions:
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    recipe: str | None = None          # built-in name or path of a TOML rules file
    dtype: str | None = None           # for unquantized tensors; default: the source's torch_dtype
    dequantize: bool = False
    requantize: bool = False           # allow rounding an already-quantized source to as few bits again
    force: bool = False
    eval: bool | None = None           # None: on for small models
    eval_tokens: int | None = None     # None: 2048 on GPU backends, 128 on CPU
    shard_bytes: int = DEFAULT_SHARD_BYTES
    revision: str | None = None        # Hub sources
    alias: str | None = None

    @property
    def quantizes(self) -> bool:
        return bool(self.bits or self.recipe or self.mode or self.group_size)


@dataclass
class ConvertResult:
    out_dir: Path
    source: SourceInfo
    recipe: str
    parameters: int
    size_before: int
    size_after: int
    bits_per_weight: float
    seconds: float
    shards: list[str]
    quality: object | None = None      # quality.QualityReport
    alias_file: Path | None = None
    notes: list[str] = field(default_factory=list)


def plan_recipe(opts: ConvertOptions) -> R.Recipe | None:
    """The validated recipe, or None when nothing is quantized."""
    for flag, value, allowed in (("--bits", opts.bits, R.BITS), ("--group-size", opts.group_size, R.GROUP_SIZES)):
        if value is not None and value <= 0:  # 0 read as "not given" kept the source as it was, with exit 0
            raise InvalidParameter(f"{flag} {value} is not supported", hint=f"use one of {allowed}")
    if opts.dequantize and opts.quantizes:
        raise InvalidParameter("--dequantize cannot be combined with --bits/--group-size/--mode/--recipe")
    if opts.dequantize and opts.requantize:
        raise InvalidParameter("--requantize cannot be combined with --dequantize (it allows quantizing again)",
                               hint="drop one of them")
    if not opts.quantizes:
        return None
    if opts.recipe:
        base = R.load_recipe(opts.recipe)
        high = max((r.bits or 0 for r in base.rules), default=0) if opts.recipe in R.BUILTIN else 0
        if opts.bits and high and opts.bits >= high:  # mixed_4_6 --bits 8: the "kept finer" layers became coarser
            raise InvalidParameter(f"--recipe {opts.recipe} keeps its sensitive layers at {high} bits: --bits "
                                   f"{opts.bits} for the rest leaves nothing finer",
                                   hint=f"drop --recipe for a uniform {opts.bits}-bit model, or give --bits "
                                        f"below {high}")
        recipe = base.with_overrides(opts.bits, opts.group_size, opts.mode)
    else:
        recipe = R.uniform(opts.bits, opts.group_size, opts.mode)
    R.validate(recipe)
    return recipe


def _check_disk(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    need = int(need * 1.02) + (16 << 20)
    if free < need:
        raise InsufficientDisk(f"not enough disk space in {where} for {what}: "
                               f"{need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free",
                               hint="free space or choose another -o")


def _eval_defaults(opts: ConvertOptions, params: int) -> tuple[bool, int]:
    from ..engine.backend import backend

    on_cpu = backend() == "cpu"
    tokens = opts.eval_tokens or (128 if on_cpu else 2048)
    if opts.eval is not None:
        return opts.eval, tokens
    # MLX's CPU matmul is slow (~2 GFLOP/s here): by default check only models it runs in about a minute.
    return params <= (AUTO_EVAL_MAX_PARAMS_CPU if on_cpu else AUTO_EVAL_MAX_PARAMS), tokens


def _source_license(src_dir: Path, config: dict) -> str | None:
    """The source's license: its model card's front matter, else what a GGUF import recorded from the file."""
    record = config.get("mlxinfer") if isinstance(config.get("mlxinfer"), dict) else {}
    recorded = record.get("license") if isinstance(record.get("license"), str) else None
    from .card import card_license

    return card_license(src_dir) or recorded


def _copy_side_files(src: Path, dst: Path) -> None:
    """The tokenizer, license and other small files, as files. A symlink is followed only to a file inside the
    source (a Hub snapshot's links to its repo's blobs): one pointing elsewhere (a LICENSE linked to ~/.ssh/id_rsa
    in a cloned repo) would copy that file, readable by all, into a folder users publish."""
    root = src.parent.parent if src.parent.name == "snapshots" else src  # the Hub cache: models--org--name
    root = root.resolve()
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in SKIP_FILES or not is_model_file(p.name):
            continue
        if p.name.endswith((".safetensors", ".index.json")):
            continue
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            raise InvalidModel(f"{p} links to {p.resolve()}, outside the model folder: not copied into a converted "
                               "model", hint="replace the link with the file itself, or remove it")
        shutil.copyfile(p, dst / p.name)


def _source_dtype(config: dict) -> str | None:
    for value in (config.get("torch_dtype"), config.get("dtype"), (config.get("text_config") or {}).get("dtype")):
        if value in DTYPES:
            return value
    return None


def _prepare_model(src_dir: Path, opts: ConvertOptions, recipe: R.Recipe | None, notes: list[str]):
    """The lazily loaded, cast and (de)quantized mlx-lm model and its output config. Nothing is evaluated."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import dequantize_model

    from ..engine.loader import load_model_dir

    model, config = load_model_dir(src_dir, lazy=True)
    quantized_source = "quantization" in config
    if opts.dequantize and not quantized_source:
        raise InvalidParameter(f"--dequantize: {src_dir} is not quantized", hint="drop --dequantize")
    if opts.dequantize or (recipe is not None and quantized_source):  # requant.check_requantize allowed it
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)

    dtype = opts.dtype or _source_dtype(config) or ("float16" if opts.dequantize else None)
    if dtype:
        target = getattr(mx, dtype)
        cast_ok = getattr(model, "cast_predicate", lambda _: True)

        def cast(k, v):
            return v.astype(target) if cast_ok(k) and mx.issubdtype(v.dtype, mx.floating) else v

        model.update(tree_map_with_path(cast, model.parameters()))
        config["torch_dtype"] = dtype

    if recipe is not None:
        config["quantization"] = apply_recipe(model, recipe)
        config["quantization_config"] = config["quantization"]
    return model, config, dtype


def apply_recipe(model, recipe: R.Recipe) -> dict:
    """Quantize ``model`` in place (lazily) with MLX's ``nn.quantize``; returns config.json's quantization section.

    Like mlx-lm's ``quantize_model`` but each layer's own group size decides whether it can be quantized (a rule
    may give a narrow layer a smaller group than the default), and a model's own ``quant_predicate`` (e.g. MoE
    routers kept in float) still has the last word.
    """
    import mlx.nn as nn

    d = recipe.default
    section = d.as_dict()
    if recipe.mlx_lm is None:  # a built-in's rules only describe mlx-lm's choices: some name other architectures
        paths = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
        R.check_rules_select(recipe, paths, R.count_layers(model))
    decide = R.predicate(recipe, model)
    model_rule = getattr(model, "quant_predicate", None)

    def class_predicate(path: str, module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        decision = decide(path, module)
        if decision and model_rule is not None:
            own = model_rule(path, module)
            if own is False or isinstance(own, dict):
                decision = own
        if isinstance(decision, dict):
            section[path] = decision
        return decision

    nn.quantize(model, d.group_size, d.bits, mode=d.mode, class_predicate=class_predicate)
    return section


def convert(
    source: str,
    out_dir: str | Path,
    opts: ConvertOptions | None = None,
    *,
    progress: Progress | None = None,
    after_tensor: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Convert ``source`` into an MLX model directory at ``out_dir``.

    ``progress(stage, done, total)`` stages: "download" (bytes), "import" (GGUF tensors), "convert" (tensors),
    "eval" (tokens). ``after_tensor`` is a test hook called after each tensor is computed.
    """
    from . import card

    opts = opts or ConvertOptions()
    started = time.perf_counter()
    out = check_output_path(out_dir)  # empty, cwd, home, /, below a file, /proc, read-only: before any work
    if Path(source).expanduser().exists():  # a local source: say so before "already exists" (again once resolved)
        check_not_source(out, Path(source).expanduser())
    check_replaceable(out, opts.force)
    recipe = plan_recipe(opts)
    if opts.dtype and opts.dtype not in DTYPES:
        raise InvalidParameter(f"--dtype {opts.dtype} is not supported", hint=f"use one of {', '.join(DTYPES)}")
    if opts.alias is not None:  # '' too: refused like an empty -o, not skipped
        card.check_alias_free(opts.alias, opts.force)
    if opts.shard_bytes < 1:
        raise InvalidParameter("the shard size must be positive", hint="write --shard-size like 512MB or 2GB")
    info = resolve_source(source, revision=opts.revision, progress=progress)
    check_not_source(out, info.path)
    size_before = info.size_bytes()
    requant_note = check_requantize(info, recipe, opts.requantize)  # before any work: it may refuse

    notes: list[str] = [requant_note] if requant_note else []
    with AtomicDir(out, describe_error=lambda e: disk_error(e, out)) as staging:
        _check_disk(out.parent, size_before if info.is_gguf else 0, "the conversion")
        try:
            meta, stats, quality, dtype = _build(staging.path, info, opts, recipe, notes, size_before, out,
                                                 progress=progress, after_tensor=after_tensor)
        except (OSError, RuntimeError) as e:  # judged while the temp dir still fills the disk
            failure = write_failure(e, out.parent, f"the converted model {out.name}",
                                    limit_hint=" or write smaller files (--shard-size)")
            if failure is None:
                raise
            raise failure from None
        check_replaceable(out, opts.force)  # again: it may have appeared meanwhile
        staging.publish(replace=True)

    alias_file = None
    if opts.alias is not None:
        alias_file = card.add_alias(opts.alias, out, description=f"converted from {info.label}",
                                    quant=recipe.label() if recipe else (dtype or ""), replace=opts.force)
    return ConvertResult(
        out_dir=out, source=info, recipe=meta["recipe"], parameters=meta["parameters"], size_before=size_before,
        size_after=stats.total_bytes, bits_per_weight=meta["bits_per_weight"],
        seconds=time.perf_counter() - started, shards=stats.files, quality=quality, alias_file=alias_file,
        notes=notes,
    )


def _build(tmp: Path, info: SourceInfo, opts: ConvertOptions, recipe: R.Recipe | None, notes: list[str],
           size_before: int, out: Path, *, progress: Progress | None, after_tensor):
    """Everything ``convert`` writes, into ``tmp``. -> (model card facts, write stats, quality report, dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters, save_config

    from .. import __version__
    from . import card, writer
    from .quality import NotFinite, evaluate

    src_dir = info.path
    if info.is_gguf:
        from ..sources.gguf_import import convert_gguf, imported_dir

        cached = imported_dir(info.path)
        if (cached / "config.json").exists() and (cached / "model.safetensors").exists():
            src_dir = cached
        else:  # import into our temp dir (removed with it) rather than filling the cache with a copy
            src_dir = convert_gguf(info.path, tmp / "_gguf", progress=progress)

    _copy_side_files(src_dir, tmp)  # first: a link it refuses stops the run before the weights are written
    model, config, dtype = _prepare_model(src_dir, opts, recipe, notes)
    parameters = int(get_total_parameters(model))
    weights = dict(tree_flatten(model.parameters()))
    # Drop the model's references: from here the dict holds the only handle on each lazy tensor.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    del model
    _check_disk(tmp, sum(int(v.nbytes) for v in weights.values()), "the converted weights")
    stats = writer.write_shards(weights, tmp, max_shard_bytes=opts.shard_bytes, total_parameters=parameters,
                                progress=progress, after_tensor=after_tensor)
    del weights

    recipe_label = (recipe.label() if recipe else
                    "dequantized" if opts.dequantize else "kept as in the source (no quantization)")
    meta = {
        "source": info.label, "repo": info.repo, "revision": info.revision, "format": info.kind,
        "recipe": recipe_label, "recipe_source": recipe.source if recipe else None,
        "dtype": dtype, "mlxinfer_version": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "parameters": parameters, "size_before": size_before, "size_after": stats.total_bytes,
        "bits_per_weight": round(stats.total_bytes * 8 / max(parameters, 1), 4),
        "name": out.name, "out_dir": str(out), "license": _source_license(src_dir, config),
    }
    converted = {k: v for k, v in meta.items() if k not in ("name", "out_dir")}
    if isinstance(config.get("mlxinfer"), dict):  # e.g. the GGUF import's record: keep it with ours
        converted["source_metadata"] = config["mlxinfer"]
    config["mlxinfer"] = {"converted": converted}
    save_config(dict(config), tmp / "config.json")

    quality = None
    run_eval, eval_tokens = _eval_defaults(opts, parameters)
    if run_eval:
        try:
            quality = evaluate(src_dir, tmp, max_tokens=eval_tokens, progress=progress)
        except NotFinite:
            raise
        except (MlxinferError, ValueError, RuntimeError) as e:
            if opts.eval:  # asked for explicitly: the report is part of the job
                raise
            notes.append(f"quality check skipped: {e}")  # the conversion itself is fine: keep it
        if quality is not None and opts.eval_tokens and quality.tokens < opts.eval_tokens:
            notes.append(f"--eval-tokens {opts.eval_tokens} is more than the built-in sample holds with this "
                         f"tokenizer: compared all {quality.tokens} of its positions")
        if quality is not None:
            config["mlxinfer"]["converted"]["quality"] = quality.as_dict()
            save_config(dict(config), tmp / "config.json")
    (tmp / "README.md").write_text(card.model_card(meta, quality.rows() if quality else None))
    if notes:
        config["mlxinfer"]["converted"]["notes"] = notes
        save_config(dict(config), tmp / "config.json")
    shutil.rmtree(tmp / "_gguf", ignore_errors=True)
    return meta, stats, quality, dtype
