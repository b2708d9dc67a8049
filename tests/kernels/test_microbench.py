"""The kernel micro-benchmark runs on any backend and reports custom vs built-in per shape."""

from __future__ import annotations

import mlx.core as mx

from mlxinfer.kernels import microbench


class BuiltinTwin:
    """A provider that computes with MLX itself, so the benchmark's error column must be ~0."""

    name = "twin"

    def quantized_matmul(self, x, w, scales, biases, *, group_size, bits, mode="affine"):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    def sdpa(self, q, k, v, *, scale, mask):
        return None  # declines: the row keeps only the built-in time


def test_microbench_rows(monkeypatch):
    monkeypatch.setitem(microbench.MODELS, "tiny", (128, 256, 4, 2, 64))
    monkeypatch.setattr(microbench, "select_provider", lambda name=None: (BuiltinTwin(), "test"))
    seen = []
    rows = microbench.run_microbench(["tiny"], rows=(1,), contexts=(40,), repeat=2, progress=seen.append)
    assert [r.kernel for r in rows] == ["qmv"] * 4 + ["swiglu", "sdpa", "sdpa-q8"] and seen == rows
    qmv = rows[0]
    assert qmv.custom_us > 0 and qmv.builtin_us > 0 and qmv.max_abs_err == 0.0 and qmv.speedup > 0
    assert rows[4].custom_us is None  # no swiglu method: not timed
    assert rows[5].custom_us is None and rows[5].speedup is None  # declined
    table = microbench.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "tiny: q/o M=1 256x128 4b/g64" in table


def test_a_builtin_mlx_lacks_leaves_its_column_empty():
    # MLX's CUDA backend has no quantized_matmul for q8 attention's shapes and fails when evaluated; the custom
    # kernel is still timed and the row says "—" for the built-in instead of ending the whole benchmark.
    def missing():
        raise RuntimeError('[quantized_matmul] No implementation for problem shape: 1x512x64x32')

    x = mx.ones((1, 64))
    row = microbench._row("sdpa-q8", "S=512", mx.float32, missing, lambda: x * 2, repeat=2)
    assert row.builtin_us is None and row.custom_us > 0 and row.max_abs_err is None and row.speedup is None
    assert "| sdpa-q8 | S=512 | float32 | — |" in microbench.markdown([row])
