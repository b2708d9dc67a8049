"""`mlxinfer models --json`: every alias, with on-disk state."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_models_json_lists_aliases_and_disk_state(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text(f'[models.local]\npath = "{tmp_path}"\ndescription = "a local dir"\n')
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "models", "--json"], capture_output=True, text=True,
                          env={**os.environ, "MLXINFER_MODELS": str(user)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {r["alias"]: r for r in json.loads(proc.stdout)}
    assert rows["smollm2"]["on_disk"] and rows["smollm2"]["disk_bytes"] > 50_000_000
    assert rows["local"]["on_disk"] and rows["local"]["origin"] == str(user)
    assert rows["qwen3-0.6b"]["on_disk"] is False and rows["qwen3-0.6b"]["source"] == "mlx-community/Qwen3-0.6B-4bit"
    assert len(rows) >= 11
