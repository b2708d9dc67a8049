"""No code from a model, ever.

A model directory is data. transformers and mlx-lm can be talked into importing Python that ships with a model
(``auto_map`` / a custom ``tokenizer_class`` in tokenizer_config.json, ``model_file`` in config.json), or into
downloading it from another Hub repo, and transformers asks "run the custom code? [y/N]" on stdin when it is not
told. So: such models are refused before anything is loaded (one line naming the file and the field), and the
tokenizer is loaded with ``trust_remote_code=False``, local files only, the Hub forced offline and stdin shut.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from ..errors import InvalidModel

_NEVER = "mlxinfer never runs code that comes with a model"
_HINT = "use a model whose tokenizer and architecture are built into transformers / mlx-lm"


def _json_object(path: Path) -> dict | None:
    """The file's JSON object; None when absent or not an object (config sanity reports those)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _refuse(path: Path, field: str, what: str, code: str | None = None) -> InvalidModel:
    beside = f" ({code} is beside it)" if code and (path.parent / code).is_file() else ""
    return InvalidModel(f"{path}: '{field}' {what}{beside}; {_NEVER}", hint=_HINT)


def _code_refs(auto_map: Any) -> list[str]:
    """The class references in an auto_map: "module.Class" or "org/repo--module.Class" strings."""
    values = auto_map.values() if isinstance(auto_map, dict) else auto_map if isinstance(auto_map, list) else [auto_map]
    refs: list[str] = []
    for v in values:
        for item in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(item, str) and item:
                refs.append(item)
    return refs


def _describe(refs: list[str]) -> tuple[str, str | None]:
    """'names custom code X' and the .py file it points at (when local)."""
    if not refs:
        return "asks for custom code", None
    ref = refs[0]
    if "--" in ref:  # another Hub repo: transformers would download and run its .py
        repo, _, local = ref.partition("--")
        return f"names custom code '{local}' from Hub repo '{repo}'", None
    module = ref.rsplit(".", 1)[0]
    return f"names custom code '{ref}'", module + ".py"


def _mlx_lm_supports(config: dict) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, KeyError, TypeError, ImportError):
        return False
    return True


def _transformers_knows(model_type) -> bool:
    import mlx_lm  # noqa: F401 - first: it turns off transformers' advisory warnings (e.g. "PyTorch was not found")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


def _builtin_tokenizer_class(name: str) -> bool:
    """Whether transformers (or mlx-lm, which registers its own) provides this tokenizer class."""
    import mlx_lm.tokenizer_utils  # noqa: F401 - registers mlx-lm's tokenizer classes with AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if not name.isidentifier():
        return False
    try:
        return tokenizer_class_from_name(name) is not None
    except Exception:  # noqa: BLE001 - a missing optional dependency of a built-in class still means built-in
        return True


def _has_module(package: str, name: Any) -> bool:
    if not isinstance(name, str) or not name.isidentifier():
        return False
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except (ImportError, ValueError):
        return False


def check_no_remote_code(path: Path) -> None:
    """Refuse a model directory whose config.json or tokenizer_config.json asks for Python shipped with a model."""
    path = Path(path)
    config = _json_object(path / "config.json") or {}
    tok = _json_object(path / "tokenizer_config.json") or {}
    cfg_file, tok_file = path / "config.json", path / "tokenizer_config.json"
    if tok_file.is_file() and not tok:
        try:
            ok = json.loads(tok_file.read_text(encoding="utf-8")) == {}
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise InvalidModel(f"{tok_file} is not a JSON object", hint="the tokenizer files may be broken; "
                               "download or convert the model again")

    for file, data in ((cfg_file, config), (tok_file, tok)):
        if data.get("trust_remote_code"):
            raise _refuse(file, "trust_remote_code", "asks to run custom code")
    if config.get("model_file"):
        code = str(config["model_file"])
        raise _refuse(cfg_file, "model_file", f"names Python code '{code}' that builds the model", code)

    if tok.get("auto_map"):
        what, code = _describe(_code_refs(tok["auto_map"]))
        raise _refuse(tok_file, "auto_map", what + " for the tokenizer", code)
    if "tokenizer_class" in tok and tok["tokenizer_class"] is not None:
        name = tok["tokenizer_class"]
        if not isinstance(name, str) or not _builtin_tokenizer_class(name):
            raise _refuse(tok_file, "tokenizer_class", f"names '{name}', a tokenizer class transformers does not have",
                          _tokenization_py(path))
    # mlx-lm imports mlx_lm.chat_templates.<x> / mlx_lm.tool_parsers.<x> from these: only its own modules may load.
    for field, package in (("chat_template_type", "mlx_lm.chat_templates"), ("tool_parser_type", "mlx_lm.tool_parsers")):
        if tok.get(field) is not None and not _has_module(package, tok[field]):
            raise InvalidModel(f"{tok_file}: '{field}' names '{tok[field]}', which mlx-lm does not provide",
                               hint="remove the field or upgrade mlx-lm")

    auto_map = config.get("auto_map")
    if auto_map:
        refs = _code_refs(auto_map)
        if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
            what, code = _describe(_code_refs({"t": auto_map["AutoTokenizer"]}))
            raise _refuse(cfg_file, "auto_map", what + " for the tokenizer", code)
        # mlx-lm builds the model from model_type with its own code, and transformers (reading config.json for the
        # tokenizer) prefers its built-in class for a model_type it knows: the auto_map is then inert. Phi-3,
        # DeepSeek-V3 ... ship one. Otherwise the model only works with the code, so it is refused.
        missing = [lib for lib, ok in (("mlx-lm", _mlx_lm_supports(config)),
                                       ("transformers", _transformers_knows(config.get("model_type")))) if not ok]
        if missing:
            what, code = _describe(refs)
            raise _refuse(cfg_file, "auto_map", f"{what}, and {' and '.join(missing)} has no built-in "
                          f"'{config.get('model_type')}'", code)


def _tokenization_py(path: Path) -> str | None:
    found = sorted(p.name for p in path.glob("tokenization_*.py"))
    return found[0] if found else None


@contextlib.contextmanager
def _guarded():
    """While a tokenizer loads: nothing may read stdin, reach the network, or print warnings (MLXINFER_DEBUG=1
    keeps the warnings)."""
    from huggingface_hub import constants

    def no_input(prompt: str = "") -> str:
        raise EOFError("mlxinfer never answers questions while loading a model")

    saved_input, saved_offline = builtins.input, constants.HF_HUB_OFFLINE
    builtins.input, constants.HF_HUB_OFFLINE = no_input, True
    loggers = [logging.getLogger(n) for n in ("transformers", "huggingface_hub", "tokenizers")]
    levels = [lg.level for lg in loggers]
    debug = bool(os.environ.get("MLXINFER_DEBUG"))
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.simplefilter("ignore")
                for lg in loggers:
                    lg.setLevel(logging.ERROR + 10)
            yield
    finally:
        builtins.input, constants.HF_HUB_OFFLINE = saved_input, saved_offline
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load_tokenizer(path: Path, eos_token_ids: list[int] | None = None):
    """mlx-lm's tokenizer for a local directory, with remote code, downloads and stdin questions impossible."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    check_no_remote_code(path)
    with _guarded():
        return mlx_load_tokenizer(
            Path(path), {"trust_remote_code": False, "local_files_only": True}, eos_token_ids=eos_token_ids,
        )
