"""What every fault-injection test checks: the real CLI in a subprocess, one stderr line, the exit code, no
traceback. Hostile inputs are crafted at test time by each test module; the tiny model below is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MLXINFER = [sys.executable, "-m", "mlxinfer"]


def run(*args: str, env: dict | None = None, input: str | bytes | None = None, timeout: float = 120,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``mlxinfer ARGS``; stdin is closed unless ``input`` is given (str or bytes)."""
    text = not isinstance(input, bytes)
    return subprocess.run(
        [*MLXINFER, *args], capture_output=True, text=text, timeout=timeout, cwd=cwd,
        env={**os.environ, **(env or {})}, input=input,
        stdin=subprocess.DEVNULL if input is None else None,
        **({"errors": "replace"} if text else {}),
    )


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode("utf-8", "replace")
    return [line for line in err.splitlines() if line.strip()]


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """Exit ``code``, exactly one non-empty stderr line starting with 'error: ', no traceback; returns the line."""
    lines = error_lines(proc)
    assert proc.returncode == code, (proc.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


def write_tiny_llama(d: Path, *, chatty: bool = False, **config_overrides) -> Path:
    """A tiny random-weight llama in MLX format (config.json + model.safetensors + a byte-level tokenizer).

    Weights are seeded. ``chatty``: an untied LM head whose rows for EOS and for bytes >= 0x80 are zero, so
    greedy decoding never ends and every token is a complete ASCII byte on stdout (the max of ~127 random
    logits is positive): tests that wait for output or break a pipe need the reply to be visible.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    d.mkdir(parents=True, exist_ok=True)
    mx.random.seed(1234)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           max_position_embeddings=512, tie_word_embeddings=not chatty)
    model = llama.Model(args)
    if chatty:
        silent = mx.array([[0.0 if tok == 0 or byte >= 0x80 else 1.0] for tok, byte in enumerate(_token_bytes())])
        model.lm_head.weight = model.lm_head.weight * silent  # (vocab, hidden): token 0 is EOS
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {**vars(args), **config_overrides}
    (d / "config.json").write_text(json.dumps(config))
    _write_byte_tokenizer(d)
    return d


def _token_bytes() -> list[int]:
    """The byte each id of ``_write_byte_tokenizer``'s vocabulary decodes to (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in to_char:
            to_char[b] = chr(256 + extra)
            extra += 1
    by_char = {ch: b for b, ch in to_char.items()}
    from tokenizers.pre_tokenizers import ByteLevel

    return [by_char[ch] for ch in sorted(ByteLevel.alphabet())]


def _write_byte_tokenizer(d: Path) -> None:
    """A 256-token byte-level BPE tokenizer (no merges) so the tiny model can chat through the real code paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": sorted(alphabet)[0],
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))
