"""Small loader rules on hostile configs (no model is built)."""

from __future__ import annotations

import json
import time

from mlxinfer.engine.loader import _eos_ids


def test_eos_ids_are_ordered_unique_and_linear_in_time(tmp_path):
    """A config listing 200k end-of-sequence ids took minutes to de-duplicate (a list scan per id)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3, 7, True]}))
    assert _eos_ids(tmp_path, {"eos_token_id": 3, "text_config": {"eos_token_id": [9, 3]}}) == [3, 9, 7]
    start = time.monotonic()
    assert len(_eos_ids(tmp_path, {"eos_token_id": list(range(200_000)) * 2})) == 200_000
    assert time.monotonic() - start < 10  # a hang guard: the scan took ~200 s


def test_a_tokenizer_panic_is_one_line_about_the_model():
    """tokenizers turns a Rust panic (a tokenizer.json regex that explodes on some text) into pyo3's
    PanicException, a BaseException: it crashed chat and generate with a traceback (exit 1)."""
    import pytest

    from mlxinfer.engine.prompts import _encode, _piece_encoder
    from mlxinfer.errors import InvalidModel

    class PanicException(BaseException):
        pass

    class Broken:
        bos_token = None

        def encode(self, text, add_special_tokens=True):
            raise PanicException("Onig: Regex search error: retry-limit-in-match over")

    with pytest.raises(InvalidModel, match="the model's tokenizer crashed on this text \\(Onig: Regex search"):
        _encode(Broken(), "aaaa!", False)
    with pytest.raises(InvalidModel, match="tokenizer crashed"):
        _piece_encoder(Broken())("aaaa!")
    with pytest.raises(KeyboardInterrupt):  # other BaseExceptions are not touched
        class Interrupting(Broken):
            def encode(self, text, add_special_tokens=True):
                raise KeyboardInterrupt
        _encode(Interrupting(), "x", False)
