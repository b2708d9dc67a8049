"""Synthetic benchmark records built by the real record code from fake timings (no model needed)."""

from __future__ import annotations

from mlxinfer.bench import runner
from mlxinfer.bench.measure import Sample
from mlxinfer.bench.workload import Case, PromptSource

HARDWARE = {"chip": "Test CPU", "cpu": "Test CPU", "gpu": None, "cpu_cores": 2, "memory_bytes": 8 << 30,
            "bandwidth_gbps": 10.0, "bandwidth_source": "given with --bandwidth", "bandwidth_method": "given"}
SYSTEM = {"system": "Linux", "release": "6", "machine": "x86_64", "platform": "Linux-6-x86_64", "python": "3.11"}


def engine(name: str = "mlxinfer", threads: int | None = None) -> dict:
    return {"name": name, "version": "0.1.0", "git_commit": "abc1234def", "git_dirty": False, "mlx": "0.32.4",
            "mlx_lm": "0.32.2", "backend": "cpu", "kernels": "builtin", "kernels_detail": "MLX built-in kernels",
            "kernels_requested": "auto", "threads": threads}


def model(name: str = "tiny") -> dict:
    return {"name": name, "alias": name, "repo": None, "revision": "sha256:00", "source": "/m.gguf", "path": "/m",
            "model_type": "llama", "params": 1_000_000, "params_label": "1M", "quantization": "4-bit affine, group 32",
            "bits": 4, "group_size": 32, "quant_mode": "affine", "dtype": "float32", "weight_bytes": 1 << 20,
            "context_length": 2048}


def stream_sample(ttft: float, gaps: list[float], prompt: int, batch: int = 1) -> Sample:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return Sample(prompt_tokens=prompt * batch, token_times=times, tokens_per_step=batch, peak_memory=5 << 20,
                  kv_per_token=1000)


def make_record(case: Case, samples: list, engine_name: str = "mlxinfer", model_name: str = "tiny",
                weights: int = 1 << 20, threads: int | None = None, hardware: dict | None = None) -> dict:
    opts = runner.BenchOptions(repetitions=len(samples), warmup=1)
    if case.kind == "prefix":
        results = runner._prefix_results(samples)
    else:
        results = runner._decode_results(case, samples, weights, hardware or HARDWARE)
    return runner._record(case, engine(engine_name, threads), model(model_name), hardware or HARDWARE, SYSTEM,
                          PromptSource(100, 0), opts, results)
