"""Bounded memory: a streamed conversion's peak resident memory follows the shard size, not the model size.

Measured in a fresh subprocess (memprobe.py) so the figure is that conversion's alone: peak RSS (VmHWM, reset
before converting) minus the RSS just before converting, with every import done first.

A larger run, for scale (2-core Linux VM, MLX 0.32.4 CPU): an 848 MB float16 llama (444M parameters, largest tensor
64 MB), 64 MB shards: 4-bit +132 MB, float16 copy +71 MB; mlx_lm.convert on the same model: 4-bit +399 MB,
float16 +896 MB (``python tests/convert/memprobe.py SRC OUT 67108864 4`` / ``memprobe.py --mlx-lm SRC OUT 4``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
MB = 1 << 20


def _probe(src: Path, out: Path, shard: int, bits: int | None = None) -> dict:
    args = [sys.executable, str(HERE / "memprobe.py"), str(src), str(out), str(shard)] + ([str(bits)] if bits else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent.parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_src(tmp_path_factory, tok_dir) -> Path:
    from tinymodels import make_hf_model

    # ~76 MB of fp16 weights; the largest tensor (1536 x 512) is 1.5 MB
    return make_hf_model(tmp_path_factory.mktemp("big"), tok_dir, "llama", layers=12, hidden=512,
                         intermediate=1536, vocab=512, shards=3)


def test_peak_memory_follows_shard_size(big_src, tmp_path):
    model_bytes = sum(p.stat().st_size for p in big_src.glob("*.safetensors"))
    assert model_bytes > 8 * 8 * MB  # more than eight shards
    shard = 8 * MB
    # float16 -> float16: the output is as large as the input, the hardest case for memory
    copy = _probe(big_src, tmp_path / "copy", shard)
    quant = _probe(big_src, tmp_path / "q8", shard, bits=8)
    # one shard's results + the source tensors of the tensor being computed + allocator slack
    bound = shard + 4 * 1536 * 512 * 2 + 16 * MB
    assert copy["delta"] < bound, copy
    assert quant["delta"] < bound, quant
    assert copy["delta"] < model_bytes / 3
    # the probe sees memory: with one shard as large as the model, the peak grows to about the model size
    whole = _probe(big_src, tmp_path / "whole", 1 << 40)
    assert whole["delta"] > 0.8 * model_bytes, whole
    print(f"model {model_bytes / MB:.0f} MB, 8 MB shards: fp16 copy +{copy['delta'] / MB:.0f} MB, "
          f"8-bit +{quant['delta'] / MB:.0f} MB; one shard: +{whole['delta'] / MB:.0f} MB")
