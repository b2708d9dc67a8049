"""Random-weight GGUFs at the real shapes of popular models, for ``cpu_bench.py --arch`` and its tests.

One file is the ground truth for both engines: llama.cpp loads it directly, mlxinfer through its GGUF import.
The 2-D weights are random Q4_0/Q4_1 blocks (random 4-bit codes, float16 scales sized for a 1/sqrt(fan-in)
spread), written block by block, so even Phi-4-mini's 3.8B weights take seconds and no float copy; norms are F32
around 1. Tensor names, layouts and metadata are what llama.cpp's converter writes for that architecture
(llama Q/K rows permuted for its RoPE, Gemma norms stored as 1 + w, Phi-3's fused qkv and gate+up rows).
``reference_model`` builds the mlx-lm model of the same weights independently of mlxinfer's import: the tests
compare the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class Arch:
    """The shapes of a model, from its Hugging Face config.json."""

    gguf_arch: str  # llama / qwen3 / gemma3 / phi3 / olmo2 / mistral3
    source: str  # the model whose config.json these values copy
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # intermediate_size
    vocab: int
    rope_theta: float
    eps: float  # rms_norm_eps
    context: int  # max_position_embeddings
    tied: bool = True  # tie_word_embeddings
    rope_local_theta: float = 0.0  # gemma3: rope_local_base_freq of the sliding-window layers
    sliding_window: int = 0  # gemma3: every 6th layer global, the others see this many tokens
    rotary_dims: int = 0  # phi3: partial_rotary_factor * head_dim (0: the whole head)
    llama3_rope: tuple = ()  # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    yarn: tuple = ()  # mistral3: (factor, original_max_position_embeddings, beta_fast, beta_slow)
    attn_temp: float = 0.0  # mistral3: llama_4_scaling_beta (queries x 1 + beta log(1 + floor(pos / original)))


ARCHS: dict[str, Arch] = {
    "smollm2-135m": Arch("llama", "HuggingFaceTB/SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, 100000.0, 1e-5,
                         8192),
    "llama-3.2-1b": Arch("llama", "meta-llama/Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, 1e-5,
                         131072, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "qwen3-0.6b": Arch("qwen3", "Qwen/Qwen3-0.6B", 1024, 28, 16, 8, 128, 3072, 151936, 1e6, 1e-6, 40960),
    "gemma3-270m": Arch("gemma3", "google/gemma-3-270m", 640, 18, 4, 1, 256, 2048, 262144, 1e6, 1e-6, 32768,
                        rope_local_theta=10000.0, sliding_window=512),
    "gemma3-1b": Arch("gemma3", "google/gemma-3-1b-it", 1152, 26, 4, 1, 256, 6912, 262144, 1e6, 1e-6, 32768,
                      rope_local_theta=10000.0, sliding_window=512),
    # LongRoPE left out (its factors change RoPE's frequencies, not the cost), so the context is the original 4k
    "phi4-mini": Arch("phi3", "microsoft/Phi-4-mini-instruct", 3072, 32, 24, 8, 128, 8192, 200064, 10000.0, 1e-5,
                      4096, rotary_dims=96),
    "olmo2-1b": Arch("olmo2", "allenai/OLMo-2-0425-1B", 2048, 16, 16, 16, 128, 8192, 100352, 500000.0, 1e-6, 4096,
                     tied=False),
    # the text model of Ministral 3 3B (its config.json's text_config)
    "ministral3-3b": Arch("mistral3", "mistralai/Ministral-3-3B-Instruct-2512", 3072, 26, 32, 8, 128, 9216, 131072,
                          1e6, 1e-5, 262144, yarn=(16.0, 16384, 32.0, 1.0), attn_temp=0.1),
}
SWA_PATTERN = 6  # gemma3: layers 5, 11, 17, ... attend globally (llama.cpp and mlx-lm both fix it at 6)
QTYPES = ("Q4_0", "Q4_1")


def with_shape(arch: Arch, overrides: str) -> Arch:
    """``layers=8,vocab=32000``: the table's shapes with some fields replaced (a scaled-down model)."""
    fields = {f.name: f.type for f in dataclasses.fields(Arch)}
    changes = {}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in fields or key in ("gguf_arch", "source", "llama3_rope", "yarn"):
            raise ValueError(f"--shape: unknown field {key!r} (one of hidden, layers, heads, kv_heads, head_dim, "
                             "ffn, vocab, rope_theta, eps, context, tied, rope_local_theta, sliding_window, rotary_dims)")
        changes[key] = (value.lower() in ("1", "true", "yes")) if key == "tied" else (
            float(value) if fields[key] in ("float", float) else int(value))
    if "head_dim" in changes and arch.rotary_dims and "rotary_dims" not in changes:  # keep the rotary share
        changes["rotary_dims"] = 2 * round(arch.rotary_dims / arch.head_dim * changes["head_dim"] / 2)
    return dataclasses.replace(arch, **changes)


def tiny(arch: Arch) -> Arch:
    """The same architecture at test size (KBs): 2 layers (6 for gemma3, so one is global), 4-token window, an
    original context of 4 for YaRN (so that a short prompt crosses the llama-4 query scale's steps)."""
    return dataclasses.replace(
        arch, hidden=64, layers=6 if arch.gguf_arch == "gemma3" else 2, heads=4,
        kv_heads=1 if arch.kv_heads == 1 else 2, head_dim=16, ffn=128, vocab=512, context=256,
        sliding_window=4 if arch.sliding_window else 0, rotary_dims=12 if arch.rotary_dims else 0,
        yarn=(arch.yarn[0], 4, *arch.yarn[2:]) if arch.yarn else ())


# ------------------------------------------------------------------------------------------ tensors
def _llama_permute(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order llama.cpp's converter gives Q/K (its interleaved RoPE): W_gguf = W_hf[idx]."""
    return np.arange(n_rows).reshape(n_heads, 2, n_rows // n_heads // 2).swapaxes(1, 2).reshape(-1)


def tensors(a: Arch) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows, cols), Hugging Face name) of every tensor, in file order."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    out = [("token_embd.weight", (a.vocab, a.hidden), "model.embed_tokens.weight")]
    if not a.tied:
        out.append(("output.weight", (a.vocab, a.hidden), "lm_head.weight"))
    out.append(("output_norm.weight", (a.hidden,), "model.norm.weight"))
    if a.llama3_rope:
        out.append(("rope_freqs.weight", (a.head_dim // 2,), ""))
    gemma, phi, olmo = a.gguf_arch == "gemma3", a.gguf_arch == "phi3", a.gguf_arch == "olmo2"
    for i in range(a.layers):
        hf = f"model.layers.{i}."
        blk = [] if olmo else [("attn_norm", (a.hidden,), "input_layernorm")]  # OLMo 2: no pre norms
        if phi:
            blk.append(("attn_qkv", (q + 2 * kv, a.hidden), "self_attn.qkv_proj"))
        else:
            blk += [("attn_q", (q, a.hidden), "self_attn.q_proj"), ("attn_k", (kv, a.hidden), "self_attn.k_proj"),
                    ("attn_v", (kv, a.hidden), "self_attn.v_proj")]
        if a.gguf_arch in ("qwen3", "gemma3"):
            blk += [("attn_q_norm", (a.head_dim,), "self_attn.q_norm"),
                    ("attn_k_norm", (a.head_dim,), "self_attn.k_norm")]
        if olmo:  # over the whole projection
            blk += [("attn_q_norm", (q,), "self_attn.q_norm"), ("attn_k_norm", (kv,), "self_attn.k_norm")]
        blk.append(("attn_output", (a.hidden, q), "self_attn.o_proj"))
        if olmo:
            blk.append(("post_attention_norm", (a.hidden,), "post_attention_layernorm"))
        elif gemma:
            blk += [("post_attention_norm", (a.hidden,), "post_attention_layernorm"),
                    ("ffn_norm", (a.hidden,), "pre_feedforward_layernorm"),
                    ("post_ffw_norm", (a.hidden,), "post_feedforward_layernorm")]
        else:
            blk.append(("ffn_norm", (a.hidden,), "post_attention_layernorm"))
        if phi:
            blk.append(("ffn_up", (2 * a.ffn, a.hidden), "mlp.gate_up_proj"))
        else:
            blk += [("ffn_gate", (a.ffn, a.hidden), "mlp.gate_proj"), ("ffn_up", (a.ffn, a.hidden), "mlp.up_proj")]
        blk.append(("ffn_down", (a.hidden, a.ffn), "mlp.down_proj"))
        if olmo:
            blk.append(("post_ffw_norm", (a.hidden,), "post_feedforward_layernorm"))
        out += [(f"blk.{i}.{name}.weight", shape, f"{hf}{h}.weight") for name, shape, h in blk]
    return out


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: str, std: float) -> np.ndarray:
    """Random Q4_0 / Q4_1 blocks (32 weights each) whose weights spread about ``std``: uniform 4-bit codes
    (std 4.61 codes) times a float16 scale varying +-25% per block; Q4_1's minimum centres them on zero."""
    rows, cols = shape
    n = rows * cols // 32
    d = (std / 4.61 * rng.uniform(0.75, 1.25, n)).astype(np.float16)
    parts = [d.view(np.uint8).reshape(n, 2)]
    if qtype == "Q4_1":
        parts.append((-7.5 * d.astype(np.float32)).astype(np.float16).view(np.uint8).reshape(n, 2))
    parts.append(rng.integers(0, 256, (n, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def llama3_factors(a: Arch) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.x RoPE scaling."""
    factor, low, high, orig = a.llama3_rope
    freqs = a.rope_theta ** -(np.arange(0, a.head_dim, 2, dtype=np.float64) / a.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    out = np.where(wavelen < orig / high, 1.0,
                   np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _data(a: Arch, qtype: str, seed: int) -> Iterator[tuple[str, np.ndarray, str]]:
    """(GGUF name, stored array, Hugging Face name) per tensor; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    for name, shape, hf in tensors(a):
        if name == "rope_freqs.weight":
            yield name, llama3_factors(a), hf
        elif len(shape) == 1:  # norms: 1 + small noise (for Gemma the stored 1 + w)
            yield name, (1 + rng.normal(0, 0.1, shape)).astype(np.float32), hf
        else:
            yield name, random_blocks(rng, shape, qtype, 1 / math.sqrt(shape[1])), hf


# ------------------------------------------------------------------------------------------- the file
def vocabulary(n: int) -> tuple[list[str], list[int], list[str]]:
    """A valid byte-level BPE vocabulary of ``n`` tokens (prompts are token ids, so its text is moot): three
    control tokens, the 256 byte symbols, a few merges, then filler tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    byte_chars = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars + ["Ġt", "he", "Ġthe", "in", "Ġa"]
    if n < len(tokens):
        raise ValueError(f"vocab must be at least {len(tokens)}")
    tokens += [f"<filler{i}>" for i in range(n - len(tokens))]
    return tokens, [3, 3, 3] + [1] * (n - 3), merges


def gguf_path(directory: Path, key: str, a: Arch, qtype: str, seed: int) -> Path:
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(a), qtype, seed, 1]).encode()).hexdigest()[:10]
    return Path(directory) / f"random-{key}-{qtype}-{digest}.gguf"


def write_gguf(path: Path, a: Arch, qtype: str = "Q4_0", seed: int = 0, *, extra_tensors: dict | None = None,
               extra_meta: dict | None = None) -> Path:
    """Write the random GGUF (temp file, then rename; kept if it exists: same name, same content).
    ``extra_tensors`` (F32 arrays) and ``extra_meta`` (uint32 / float32 / string values) are for tests."""
    import gguf

    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    qt = gguf.GGMLQuantizationType[qtype]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), a.gguf_arch)
    w.add_name(f"random {a.source} shapes")
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    w.add_context_length(a.context)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_layer_norm_rms_eps(a.eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_rope_dimension_count(a.rotary_dims or a.head_dim)
    if a.gguf_arch == "gemma3":
        w.add_sliding_window(a.sliding_window)
        w.add_float32(f"{a.gguf_arch}.rope.freq_base_swa", a.rope_local_theta)
    if a.yarn:  # as llama.cpp's converter writes Ministral 3
        factor, orig, fast, slow = a.yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_yarn_beta_fast(fast)
        w.add_rope_scaling_yarn_beta_slow(slow)
    if a.attn_temp:
        w.add_attn_temperature_scale(a.attn_temp)
        w.add_attn_temperature_length(a.yarn[1] if a.yarn else a.context)
    tokens, types, merges = vocabulary(a.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for key, value in (extra_meta or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(key, value)
    specs = tensors(a)
    block_bytes = gguf.GGML_QUANT_SIZES[qt][1]
    for name, shape, _ in specs:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            byte_shape = (shape[0], shape[1] // 32 * block_bytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qt)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, arr, _ in _data(a, qtype, seed):
            w.write_tensor_data(arr)
        for arr in (extra_tensors or {}).values():
            w.write_tensor_data(arr)
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------------------ the reference
def hf_config(a: Arch) -> dict:
    """The Hugging Face config.json of the model (what mlx-lm builds), from the table alone."""
    cfg = {"hidden_size": a.hidden, "num_hidden_layers": a.layers, "intermediate_size": a.ffn,
           "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
           "rms_norm_eps": a.eps, "vocab_size": a.vocab, "rope_theta": a.rope_theta,
           "tie_word_embeddings": a.tied, "max_position_embeddings": a.context}
    if a.gguf_arch == "llama":
        cfg["model_type"] = "llama"
        if a.llama3_rope:
            factor, low, high, orig = a.llama3_rope
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                   "high_freq_factor": high, "original_max_position_embeddings": orig}
    elif a.gguf_arch == "qwen3":
        cfg["model_type"] = "qwen3"
    elif a.gguf_arch == "gemma3":
        cfg.update(model_type="gemma3_text", rope_local_base_freq=a.rope_local_theta, sliding_window=a.sliding_window,
                   sliding_window_pattern=SWA_PATTERN, query_pre_attn_scalar=a.head_dim)
    elif a.gguf_arch == "phi3":
        cfg.update(model_type="phi3", partial_rotary_factor=(a.rotary_dims or a.head_dim) / a.head_dim)
    elif a.gguf_arch == "olmo2":
        cfg["model_type"] = "olmo2"
    elif a.gguf_arch == "mistral3":
        params = {"rope_theta": cfg.pop("rope_theta"), "llama_4_scaling_beta": a.attn_temp,
                  "original_max_position_embeddings": a.yarn[1] if a.yarn else a.context}
        if a.yarn:
            factor, orig, fast, slow = a.yarn
            params.update(rope_type="yarn", type="yarn", factor=factor, beta_fast=fast, beta_slow=slow, mscale=1.0,
                          mscale_all_dim=1.0)
        cfg.update(model_type="ministral3", rope_parameters=params)
    return cfg


def hf_weights(a: Arch, qtype: str = "Q4_0", seed: int = 0) -> dict[str, np.ndarray]:
    """The file's weights as float32 in Hugging Face layout: dequantized, llama Q/K rows un-permuted, Gemma norms
    back from 1 + w. Small shapes only (it holds every weight in float32)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    out = {}
    for name, arr, hf in _data(a, qtype, seed):
        if not hf:
            continue
        if arr.dtype == np.uint8:
            arr = gguf.quants.dequantize(arr, qt).astype(np.float32)
            if a.gguf_arch in ("llama", "mistral3") and name.endswith(("attn_q.weight", "attn_k.weight")):
                n = a.heads if name.endswith("attn_q.weight") else a.kv_heads
                hf_rows = np.empty_like(arr)
                hf_rows[_llama_permute(arr.shape[0], n)] = arr  # W_gguf[i] = W_hf[perm[i]]
                arr = hf_rows
        elif a.gguf_arch == "gemma3":
            arr = arr - 1
        out[hf] = arr
    return out


def reference_model(a: Arch, qtype: str = "Q4_0", seed: int = 0):
    """The mlx-lm model of the file's weights in float32, built from ``hf_config`` (not from the import)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(hf_config(a))
    model = model_class(args_class.from_dict(hf_config(a)))
    weights = {k: mx.array(v) for k, v in hf_weights(a, qtype, seed).items()}
    if hasattr(model, "sanitize"):  # as mlx-lm's load: gemma3 drops its lm_head when the file has none
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


LLAMA_CHECK = r"""  # run by llama-cpp-python's Python
import json, sys
import numpy as np
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["model"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"], n_ctx=cfg["ctx"],
            n_batch=cfg["ctx"], logits_all=True, verbose=False)
prompt = cfg["prompt"]
llm.eval(prompt)
prefill = np.array(llm.scores[: len(prompt)], dtype=np.float32)
decode = []
for tok in cfg["follow"]:
    llm.eval([tok]); decode.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
np.savez(cfg["out"], prefill=prefill, decode=np.stack(decode))
"""


# llama.cpp's system-info names (``llama_print_system_info``) -> the /proc/cpuinfo flag each needs.
_LLAMA_ISA_FLAGS = {"AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni",
                    "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
                    "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16"}


def missing_isa(system_info: str, cpu_flags: set[str]) -> list[str]:
    """The instruction sets a llama.cpp build says it uses ("AVX_VNNI = 1 | ...") that ``cpu_flags`` lacks."""
    used = [part.split("=")[0].strip() for part in system_info.replace("CPU :", "|").split("|")
            if part.strip().endswith("= 1")]
    return [name for name in used if name in _LLAMA_ISA_FLAGS and _LLAMA_ISA_FLAGS[name] not in cpu_flags]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def llama_failure(proc, gguf: Path, llama_python: str | None = None) -> str:
    """One line on why the llama.cpp subprocess failed (for SIGILL: the build's instruction sets this CPU lacks,
    when ``llama_python`` can say which ones it uses)."""
    if proc.returncode == -4:  # SIGILL
        lacking: list[str] = []
        if llama_python:
            info = subprocess.run([llama_python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info()"
                                   ".decode())"], capture_output=True, text=True)
            if info.returncode == 0:
                lacking = missing_isa(info.stdout, _cpu_flags())
        what = (f"it was built with {', '.join(lacking)}, which this CPU lacks; rebuild llama-cpp-python with "
                + " ".join(f"-DGGML_{n}=OFF" for n in lacking) if lacking else
                "its build uses instructions this CPU lacks; rebuild llama-cpp-python without them (or with "
                "GGML_NATIVE=ON)")
        return (f"llama.cpp died with SIGILL on {gguf.name}: {what} (pip install --no-cache-dir --force-reinstall "
                "--no-deps --no-binary llama-cpp-python llama-cpp-python: pip's cache would hand back the same build)")
    return f"llama.cpp failed on {gguf.name}: {(proc.stderr.strip().splitlines() or [f'exit {proc.returncode}'])[-1]}"


def check_logits(gguf: Path, a: Arch, *, llama_python: str | None, threads: int, n_prompt: int,
                 n_follow: int) -> dict:
    """mlxinfer's logits (built-in and native kernels) against llama.cpp's on the same file: the prompt in one
    pass, then single-token decode steps. Without llama.cpp, native against built-in."""
    import tempfile

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import mlxinfer
    from mlxinfer.kernels.patch import apply_kernels

    prompt, follow = prompt_ids(a, n_prompt), prompt_ids(a, n_follow, seed=2)
    model = mlxinfer.load(str(gguf), kernels="builtin").model
    got = {}
    for engine in ("builtin", "native"):
        apply_kernels(model, engine if engine == "builtin" else "custom")
        cache = make_prompt_cache(model)
        pre = np.array(model(mx.array(prompt)[None], cache=cache)[0].astype(mx.float32))
        dec = [np.array(model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)) for t in follow]
        got[engine] = (pre, np.stack(dec))
    if llama_python:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = {"model": str(gguf), "threads": threads, "ctx": len(prompt) + len(follow) + 16,
                   "prompt": prompt, "follow": follow, "out": f"{tmp}/logits.npz"}
            proc = subprocess.run([llama_python, "-c", LLAMA_CHECK, json.dumps(cfg)], capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(llama_failure(proc, gguf, llama_python))
            with np.load(cfg["out"]) as f:
                ref_name, ref = "llama.cpp", (f["prefill"], f["decode"])
    else:
        ref_name, ref = "mlxinfer builtin (no llama.cpp)", got.pop("builtin")
    out: dict = {"reference": ref_name, "logit_std": float(ref[0].std()), "prompt_tokens": len(prompt),
                 "decode_steps": len(follow)}
    for engine, (pre, dec) in got.items():
        row = {}
        for phase, mine, theirs in (("prefill", pre, ref[0]), ("decode", dec, ref[1])):
            row[f"{phase}_max_abs_diff"] = float(np.abs(mine - theirs).max())
            row[f"{phase}_top1_agree"] = float((mine.argmax(-1) == theirs.argmax(-1)).mean())
        out[engine] = row
    return out


def prompt_ids(a: Arch, n: int, seed: int = 1) -> list[int]:
    """Prompt token ids: seeded, past the control and byte tokens."""
    return np.random.default_rng(seed).integers(300, a.vocab, n).tolist()
