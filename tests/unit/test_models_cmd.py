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


def test_models_shows_converted_records(tmp_path):
    out = tmp_path / "conv"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "mlxinfer": {"converted": {
        "source": "org/src", "recipe": "mixed_4_6", "bits_per_weight": 5.64, "quality": {"kl_mean": 0.154}}}}))
    user = tmp_path / "models.toml"
    user.write_text(f'[models.conv]\npath = "{out}"\n')
    from mlxinfer.models_info import list_models
    from mlxinfer.registry import Registry

    row = {r.alias: r for r in list_models(Registry.load(user_file=user))}["conv"]
    assert row.on_disk and row.quant == "mixed_4_6, 5.64 bpw"
    assert "converted from org/src" in row.description and "KL 0.154" in row.description
