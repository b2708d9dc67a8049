"""convert's quality check loads the source tokenizer through engine.trust: remote tokenizer code is refused
with trust's one line (not run, not wrapped as a generic tokenizer failure)."""

from __future__ import annotations

import json

import pytest

from mlxinfer.convert.quality import evaluate
from mlxinfer.errors import InvalidModel


def test_quality_check_refuses_remote_tokenizer_code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (src / "tokenization_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(InvalidModel) as e:
        evaluate(src, tmp_path / "out", max_tokens=16)
    assert "auto_map" in str(e.value) and "quality check" not in str(e.value)
