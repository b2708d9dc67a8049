"""The converted model's README card and its alias in the user's models.toml."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..errors import ConfigError, InvalidParameter, printable
from ..fsutil import current_umask

def card_license(directory: Path) -> str | None:
    """``license:`` from a model card's YAML front matter (``README.md``), if any."""
    try:
        text = (Path(directory) / "README.md").read_text(errors="replace")
    except OSError:
        return None
    m = re.match(r"---\s*\n(.*?)\n---", text, re.S)
    if not m:
        return None
    lic = re.search(r"^license:\s*['\"]?([^'\"\n]+)", m.group(1), re.M)
    return lic.group(1).strip() if lic else None


def model_card(meta: dict, quality_rows: list[tuple[str, str]] | None) -> str:
    """Markdown with a Hugging Face front matter block (library_name: mlx) and the conversion facts."""
    src = meta["source"]
    front = ["---", "library_name: mlx", "pipeline_tag: text-generation", "tags:", "- mlx", "- mlxinfer"]
    if meta.get("license"):  # the source's terms still apply to its conversion
        front.append(f"license: {meta['license']}")
    if meta.get("repo"):
        front.append(f"base_model: {meta['repo']}")
    front.append("---")
    lines = [
        *front, "",
        f"# {meta['name']}", "",
        f"Converted to MLX by mlxinfer {meta['mlxinfer_version']} on {meta['date']}.", "",
        "| | |", "|---|---|",
        f"| Source | `{src}` |",
        f"| Revision | `{meta.get('revision') or 'n/a'}` |",
        f"| Recipe | {meta['recipe']} |",
        f"| Unquantized tensors | {meta.get('dtype') or 'as in the source'} |",
        f"| Parameters | {meta['parameters']:,} |",
        f"| Size | {meta['size_before']:,} bytes → {meta['size_after']:,} bytes |",
        f"| Bits per weight | {meta['bits_per_weight']:.2f} |",
        "",
    ]
    if quality_rows:
        lines += [
            "## Quality against the source", "",
            "Next-token distributions of this model vs. the source model on mlxinfer's built-in text sample.", "",
            "| Metric | Value |", "|---|---|",
            *[f"| {k} | {v} |" for k, v in quality_rows], "",
        ]
    else:
        lines += ["## Quality against the source", "", "Not measured (run convert with --eval).", ""]
    lines += [
        "## Use", "",
        "```bash",
        f"mlxinfer chat {meta.get('out_dir', '.')}",
        "```", "",
        "```python",
        "from mlx_lm import load, generate",
        f"model, tokenizer = load({str(meta.get('out_dir', '.'))!r})",
        "```", "",
    ]
    return "\n".join(lines)


def check_alias(name: str) -> None:
    if not name.strip():
        raise InvalidParameter("--alias is empty", hint="give the name to add to models.toml, e.g. --alias my-model, "
                               "or drop --alias")
    from ..registry import ALIAS_EXAMPLE, alias_problem

    problem = alias_problem(name)
    if problem:
        raise InvalidParameter(f"alias {printable(repr(name))} {problem}",
                               hint=f"pick another --alias, {ALIAS_EXAMPLE}")


def check_alias_free(name: str, replace: bool, user_file: Path | None = None) -> None:
    """Refuse a malformed alias, or one that exists already unless ``replace`` (checked before converting)."""
    from ..registry import Registry, user_registry_path

    check_alias(name)
    registry = Registry.load(user_file)
    if name in registry.aliases() and not replace:
        raise InvalidParameter(f"alias '{name}' already exists (in {registry.origin(name)})",
                               hint="pick another --alias, or add --force to replace it")
    # add_alias writes a temp file beside models.toml and renames it: that folder (or the first of its parents
    # that exists, which it creates) must take writes, else the model would be converted and the alias not added.
    target = Path(user_file or user_registry_path())
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidParameter(f"cannot add alias '{name}': {folder} is not writable (for {target})",
                               hint="drop --alias, or set MLXINFER_MODELS to a file in a writable folder")


def _remove_table(text: str, alias: str) -> str:
    """Drop the ``[models.ALIAS]`` table (header to the next table header) from TOML text."""
    header = re.compile(rf'^\s*\[\s*models\s*\.\s*("{re.escape(alias)}"|{re.escape(alias)})\s*\]\s*(#.*)?$')
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if header.match(line):
            skipping = True
            continue
        if skipping and re.match(r"^\s*\[", line):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def add_alias(name: str, path: Path, *, description: str = "", quant: str = "", replace: bool = False,
              user_file: Path | None = None) -> Path:
    """Append ``[models.NAME] path = ...`` to the user's models.toml (atomic; the existing text is kept).

    An alias the user file already defines is only replaced with ``replace=True``; an alias from the packaged
    registry is shadowed by the user entry only with ``replace=True`` too.
    """
    from ..registry import Registry, user_registry_path

    user_file = user_file or user_registry_path()
    check_alias_free(name, replace, user_file)
    text = user_file.read_text() if user_file.exists() else ""
    if replace:
        text = _remove_table(text, name)
    if text and not text.endswith("\n"):
        text += "\n"
    entry = [f"\n[models.{_toml_str(name) if '.' in name else name}]", f"path = {_toml_str(str(Path(path).resolve()))}"]
    if description:
        entry.append(f"description = {_toml_str(description)}")
    if quant:
        entry.append(f"quant = {_toml_str(quant)}")
    new_text = text + "\n".join(entry) + "\n"
    user_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=user_file.parent, prefix=f".{user_file.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_text)
        try:
            Registry.load(Path(tmp))  # never replace a working file with one the registry cannot read
        except ConfigError as e:
            raise ConfigError(f"adding alias '{name}' would break {user_file}: {e}") from None
        # The file keeps its mode (a new one gets the umask's), not mkstemp's 0600.
        os.chmod(tmp, user_file.stat().st_mode & 0o7777 if user_file.exists() else 0o666 & ~current_umask())
        os.replace(tmp, user_file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return user_file
