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
