"""Import a GGUF file as a plain MLX model directory (config.json, model.safetensors, tokenizer files).

- Q4_0/Q4_1/Q8_0/Q5_0/Q5_1 repack bit for bit onto MLX affine quantization (group size 32), Q4_K/Q5_K up to
  float16 rounding of their per-32 scales (``gguf_quants``).
- Other K-quants, IQ and block types are dequantized by the ``gguf`` package and re-quantized with
  ``mx.quantize`` (group size 32) at the closest MLX bit width; F32/F16/BF16 matrices are kept as they are.
- Architectures: llama (and mistral), qwen2, qwen3, gemma3, phi3, olmo2, mistral3 (``gguf_config.ARCHS``). llama.cpp
  permutes the rows of llama-family Q/K projections for its interleaved RoPE; we undo that so the result has the
  Hugging Face layout and runs with mlx-lm's default (non-traditional) RoPE. Gemma's norms are stored as 1 + w: shifted back.
- The tokenizer is rebuilt from the metadata (``gguf_tokenizer``); ``general.*`` lands in config.json's
  "mlxinfer" section for the chat header.
The whole file is validated first (``gguf_config``, ``gguf_checks``); the result is written once per file content
(sha256) under the cache directory, atomically (``fsutil.AtomicDir``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import InvalidModel
from ..fsutil import AtomicDir, atomic_write_text, sweep_stale, write_failure
from .gguf_config import (ARCHS, NORM_SHIFT, generation_config, header_info, hf_name, llama3_rope_scaling,
                          llm_config, phi3_longrope)
from .gguf_checks import check_layers, check_shapes
from .gguf_file import GgufTensor, read_gguf
from .gguf_quants import REPACK_BITS, repack
from .gguf_tokenizer import check_tokenizer, write_tokenizer

IMPORT_VERSION = 4
Progress = Callable[[str, int, int], None]  # (stage, done, total)

_FLOAT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# Types the gguf package dequantizes, with the MLX bit width we re-quantize them to (at least their bits/weight).
# Q6_K (16-weight sub-blocks, which MLX's group sizes cannot hold) goes to 8 bits: on a real Gemma 3 Q4_K_M,
# re-quantizing its Q6_K tensors to 6 bits added 2.0% relative RMS error, to 8 bits 0.5%.
_REQUANT_BITS = {
    "Q2_K": 3, "Q3_K": 4, "Q6_K": 8, "IQ1_S": 2, "IQ1_M": 2,
    "IQ2_XXS": 3, "IQ2_XS": 3, "IQ2_S": 3, "IQ3_XXS": 4, "IQ3_S": 4, "IQ4_NL": 4, "IQ4_XS": 4, "TQ1_0": 2,
    "TQ2_0": 2, "MXFP4": 4, "NVFP4": 4,
}
GROUP = 32


def cache_root() -> Path:
    if os.environ.get("MLXINFER_CACHE"):
        return Path(os.environ["MLXINFER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxinfer"


def _digest_memo() -> Path:
    return cache_root() / "gguf" / "digests.json"


def _memo_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def file_digest(path: Path) -> str:
    """sha256 of the file; remembered by (path, size, mtime) once an import succeeded, so it is hashed once."""
    try:
        memo = json.loads(_digest_memo().read_text())
    except (OSError, ValueError):
        memo = {}
    if _memo_key(path) in memo:
        return memo[_memo_key(path)]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _remember_digest(path: Path, digest: str) -> None:
    try:
        memo = json.loads(_digest_memo().read_text())
    except (OSError, ValueError):
        memo = {}
    if memo.get(_memo_key(path)) != digest:
        memo[_memo_key(path)] = digest
        atomic_write_text(_digest_memo(), json.dumps(memo))


def imported_dir(path: Path) -> Path:
    """Where the MLX directory for this GGUF file lives (whether or not it exists yet)."""
    return cache_root() / "gguf" / f"{file_digest(Path(path))[:24]}-v{IMPORT_VERSION}"


# ------------------------------------------------------------------------------------------- tensor mapping
def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row index that undoes llama.cpp's Q/K permutation: W_hf = W_gguf[idx]."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


# -------------------------------------------------------------------------------------------- conversion
def _decode(t: GgufTensor, perm: np.ndarray | None, path: Path) -> tuple[str, Any, Any]:
    """The numpy half of a tensor's conversion (runs in worker threads: numpy releases the GIL).
    ``perm`` reorders rows (Q/K un-permutation). -> ("q", (packed, scales, biases), bits) | ("f", array, kind)
    | ("r", float32 array to re-quantize, bits)."""
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    if t.kind in REPACK_BITS:
        w, s, b = repack(t.kind, t.data, rows)
        return "q", ((w[perm], s[perm], b[perm]) if perm is not None else (w, s, b)), REPACK_BITS[t.kind]
    if t.kind in _FLOAT:
        arr = t.data.view(_FLOAT[t.kind]).reshape(t.shape)
        return "f", (arr[perm] if perm is not None else arr), t.kind
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.type_id)).reshape(t.shape)
    except NotImplementedError as e:
        raise InvalidModel(f"{path.name}: cannot dequantize {t.kind} tensor '{t.name}' ({e})") from None
    arr = (arr[perm] if perm is not None else arr).astype(np.float32)
    if arr.ndim == 1 or arr.shape[-1] % GROUP:
        return "f", arr, "F32"
    return "r", arr, _REQUANT_BITS[t.kind]


_ST_BYTES = {"U32": 4, "F16": 2, "BF16": 2, "F32": 4}


def _plan(t: GgufTensor, prefix: str, suffix: str) -> tuple[list[tuple[str, str, list[int]]], int | None]:
    """The safetensors entries (name, dtype, shape) a tensor becomes, known before decoding it, and its bits."""
    lead, n = t.shape[:-1], t.shape[-1]
    bits = REPACK_BITS.get(t.kind)
    if bits is None and t.kind in _REQUANT_BITS and len(t.shape) > 1 and n % GROUP == 0:
        bits = _REQUANT_BITS[t.kind]
    if bits is not None and suffix == "weight":
        return [(f"{prefix}.weight", "U32", [*lead, n * bits // 32]), (f"{prefix}.scales", "F16", [*lead, n // GROUP]),
                (f"{prefix}.biases", "F16", [*lead, n // GROUP])], bits
    keep = t.kind in ("F16", "BF16", "F32") and len(t.shape) > 1  # norms and biases become float32
    return [(f"{prefix}.{suffix}", t.kind if keep else "F32", t.shape)], None


def _arrays(tag: str, data, extra) -> list[np.ndarray]:
    """A decoded tensor as the arrays of its plan, in order (main thread: ``mx.quantize`` for re-quantizing)."""
    if tag == "q":
        return list(data)
    if tag == "f":
        keep = extra in ("F16", "BF16", "F32") and data.ndim > 1  # BF16 stays raw uint16: the same bytes
        return [data if keep else data.astype(np.float32)]
    import mlx.core as mx

    w, s, b = mx.quantize(mx.array(data), group_size=GROUP, bits=extra)
    return [np.array(w), np.array(s.astype(mx.float16)), np.array(b.astype(mx.float16))]


def _write_safetensors(path: Path, plan: list[tuple[str, str, list[int]]], chunks) -> None:
    """Stream ``chunks`` (numpy arrays in plan order) into a safetensors file whose header is known up front."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, dtype, shape in plan:
        size = math.prod(shape) * _ST_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    try:
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for (name, _, _), arr in zip(plan, chunks):
                data = np.ascontiguousarray(arr)
                if data.nbytes != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                    raise InvalidModel(f"{path.name}: tensor '{name}' has {data.nbytes} bytes, not the expected size")
                f.write(memoryview(data).cast("B"))
    finally:
        if hasattr(chunks, "close"):  # stop the decoding threads now, not when the traceback is freed
            chunks.close()


def convert_gguf(path: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Convert ``path`` into an MLX model directory at ``out_dir`` (written atomically).

    Tensors are decoded in order and streamed into model.safetensors, so memory stays at a few tensors."""
    path, out_dir = Path(path), Path(out_dir)
    g = read_gguf(path)
    arch = g.meta.get("general.architecture")
    if arch not in ARCHS:
        raise InvalidModel(
            f"{path.name}: unsupported GGUF architecture '{arch}'", hint=f"supported: {', '.join(sorted(ARCHS))}")
    for t in g.tensors:  # fail before any work
        if t.kind not in REPACK_BITS and t.kind not in _FLOAT and t.kind not in _REQUANT_BITS:
            raise InvalidModel(f"{path.name}: unsupported GGUF tensor type {t.kind} in '{t.name}'",
                               hint="re-export the model as Q8_0, Q4_0, Q4_K or F16")
    check_tokenizer(g.meta)  # before the slow part
    names = {t.name for t in g.tensors}
    try:  # metadata messages name the key; say which file too
        config = llm_config(g.meta, arch, has_output="output.weight" in names)
        gen = generation_config(g.meta)
    except InvalidModel as e:
        raise InvalidModel(f"{path.name}: {e.args[0]}", hint=e.hint) from None
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    check_layers(path, arch, g.tensors, config["num_hidden_layers"])

    present: dict[str, tuple[str, list[int]]] = {}
    rope_factors: dict[str, GgufTensor] = {}
    for t in g.tensors:
        hf = hf_name(t.name, arch)
        if hf is None:
            if t.name == "rope_freqs.weight" and t.kind == "F32":
                if t.shape != [config["head_dim"] // 2]:
                    raise InvalidModel(f"{path.name}: tensor 'rope_freqs.weight' is {t.shape}, not "
                                       f"[{config['head_dim'] // 2}] (half the head size)", hint="the file is corrupt")
                # mlx-lm recomputes these factors from config.json's rope_scaling
                config["rope_scaling"] = llama3_rope_scaling(
                    t.data.view(np.float32), config["rope_theta"], config["head_dim"])
                continue
            if arch == "phi3" and t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
                rope_factors[t.name.split(".")[0]] = t
                continue
            raise InvalidModel(f"{path.name}: unknown tensor '{t.name}' for architecture '{arch}'")
        if hf in present:
            raise InvalidModel(f"{path.name}: tensor '{t.name}' appears twice", hint="the file is corrupt")
        present[hf] = (t.name, t.shape)
    if rope_factors:
        if len(rope_factors) != 2 or any(t.kind != "F32" for t in rope_factors.values()):
            raise InvalidModel(f"{path.name}: LongRoPE needs both 'rope_factors_long' and 'rope_factors_short' as F32",
                               hint="the file is corrupt")
        try:
            config["rope_scaling"] = phi3_longrope(*(rope_factors[k].data.view(np.float32) for k in
                                                     ("rope_factors_long", "rope_factors_short")), config)
        except InvalidModel as e:
            raise InvalidModel(f"{path.name}: {e.args[0]}", hint=e.hint) from None
    check_shapes(path, arch, config, present)  # every tensor against the metadata, before any byte is written

    jobs = []  # (tensor, prefix, suffix, row permutation or None, norm shift)
    for t in g.tensors:
        hf = hf_name(t.name, arch)
        if hf is None:
            continue
        prefix, suffix = hf.rsplit(".", 1)
        if suffix != "weight" and t.kind not in _FLOAT:
            raise InvalidModel(f"{path.name}: '{t.name}' is stored as {t.kind}; biases must be float")
        perm = None
        if ARCHS[arch][2] and prefix.endswith(("q_proj", "k_proj")):
            rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else t.shape[0]
            perm = _unpermute_rows(rows, n_heads if prefix.endswith("q_proj") else n_kv)
        shift = NORM_SHIFT.get(arch, 0.0) if hf.endswith("norm.weight") else 0.0
        jobs.append((t, prefix, suffix, perm, shift))

    def decode(job):
        try:
            tag, data, extra = _decode(job[0], job[3], path)
            if job[4] and tag == "f":  # Gemma's norm weights: back from llama.cpp's 1 + w
                data = data.astype(np.float32) - np.float32(job[4])
            return tag, data, extra
        except (ValueError, IndexError, ZeroDivisionError) as e:  # shapes that do not fit the data
            raise InvalidModel(f"{path.name}: tensor '{job[0].name}' is damaged ({e})",
                               hint="download the file again") from None

    plans = [_plan(t, prefix, suffix) for t, prefix, suffix, *_ in jobs]
    bits_of = {job[1]: bits for job, (_, bits) in zip(jobs, plans) if bits is not None}
    if bits_of:
        main_bits = max(set(bits_of.values()), key=list(bits_of.values()).count)
        quant: dict[str, Any] = {"group_size": GROUP, "bits": main_bits, "mode": "affine"}
        quant.update({p: {"group_size": GROUP, "bits": b} for p, b in bits_of.items() if b != main_bits})
        config["quantization"] = config["quantization_config"] = quant
    config["mlxinfer"] = {**header_info(g.meta, path), "import_version": IMPORT_VERSION}

    def chunks():
        """Decoded arrays in plan order; tensors are decoded a bounded window ahead in worker threads."""
        workers = max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            for start in range(0, len(jobs), 2 * workers):
                window = jobs[start:start + 2 * workers]
                for k, decoded in enumerate(pool.map(decode, window)):
                    arrays = _arrays(*decoded)
                    if progress:
                        progress("import", start + k + 1, len(jobs))
                    yield from arrays

    tok_meta = {k: v for k, v in g.meta.items() if k.startswith("tokenizer.")}
    config.update(gen)
    with AtomicDir(out_dir) as staging:  # removed on any error, Ctrl-C or SIGTERM/SIGHUP (Terminated)
        tmp = staging.path
        try:
            write_tokenizer(tok_meta, tmp, context_length=config["max_position_embeddings"])
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
            _write_safetensors(tmp / "model.safetensors", [e for plan, _ in plans for e in plan], chunks())
        except (OSError, RuntimeError) as e:  # judged while the temp dir still fills the disk
            failure = write_failure(e, out_dir.parent, f"the import of {path.name}")
            if failure is None:
                raise
            raise failure from None
        if progress:
            progress("write", 0, 1)
        if not _complete(out_dir):  # a concurrent import of the same file may have finished first: keep its copy
            staging.publish(replace=True)
        if progress:
            progress("write", 1, 1)
    return out_dir


def _complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def import_gguf(path: Path, progress: Progress | None = None) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use. A failed import leaves nothing in the
    cache; what killed imports left (their process gone) is swept here."""
    path = Path(path)
    if not path.is_file():
        raise InvalidModel(f"{path}: no such GGUF file", hint="check the path")
    sweep_stale(cache_root() / "gguf")
    if progress:
        progress("hash", 0, 1)
    digest = file_digest(path)
    if progress:
        progress("hash", 1, 1)
    target = cache_root() / "gguf" / f"{digest[:24]}-v{IMPORT_VERSION}"
    if not _complete(target):
        convert_gguf(path, target, progress)
    _remember_digest(path, digest)  # only now: a failed import leaves nothing in the cache
    return target
