"""Which MLX backend runs here, and the numeric policy that follows from it."""

from __future__ import annotations

import platform


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX runs ops by default in this process (a GPU build with the default
    device set to the CPU counts as 'cpu'). The one definition the loader, kernels and bench share."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "metal"
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "cuda"
    return "cpu"


def activation_dtype(model_dtype):
    """The dtype activations (and so scales/biases/norms) should have on this backend.

    MLX's CPU quantized matmul is ~10x slower with float16 activations than with float32 (measured on this
    class of machine), so on the CPU backend everything floating runs in float32. GPUs keep the model's dtype.
    """
    import mlx.core as mx

    return mx.float32 if backend() == "cpu" else model_dtype


CPU_CACHE_CAP = 2 << 30  # most freed memory kept for reuse on the CPU backend (and at most RAM / 8)


def keep_freed_buffers() -> int | None:
    """On the CPU backend, let MLX keep up to min(RAM / 8, 2 GiB) of freed buffers for reuse (its limit there is
    32 MB): larger intermediates, e.g. a batched prefill's MLP activations, went back to the OS when freed and were
    page-faulted in again by the next op. Dec 6, SmolLM2, 8 x 766 prompt tokens in one batched forward: 28% of
    the time in page faults, 668 -> 954 tok/s with the cache (8 single prefills: ~1000 either way). Only raises the
    limit (a larger one already set stays). Cached buffers count in the process' memory but not in MLX's
    active or peak memory; ``mx.clear_cache()`` frees them. Returns the limit in force (None off the CPU)."""
    import os

    import mlx.core as mx

    if backend() != "cpu":
        return None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    want = min(ram // 8, CPU_CACHE_CAP)
    before = mx.set_cache_limit(want)
    if before > want:
        mx.set_cache_limit(before)
    return max(int(before), want)


def hardware_label() -> str:
    """A short description of the machine, e.g. 'Apple M3 Max' or 'x86_64 Intel(R) Xeon(R) ...'."""
    import mlx.core as mx

    if backend() == "metal":
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return str(info.get("device_name", "Apple GPU"))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return cpu


def release_thread_state() -> None:
    """Call last in a thread (not the main one) that ran MLX work, while Python still runs it.

    MLX keeps per-thread state: the PRNG key, streams' command encoders, the compile cache. Their C++ destructors
    run when the OS thread exits, after ``Thread.join`` has already returned, and the key's takes the GIL to drop
    a Python list. If the interpreter is finalizing by then, CPython ends the thread inside that destructor and the
    process aborts ("terminate called without an active exception"). ``mx.clear_streams()`` frees all of it here,
    with the GIL held, so the exit has nothing left that needs Python.
    """
    import mlx.core as mx

    mx.clear_streams()
