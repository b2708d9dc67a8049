"""Run a benchmark: validate everything first, then for each model (and optionally its mlx-lm peer) every test
case with warmup and repetitions, turning the timed samples into self-describing records (see ``report``)."""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InvalidParameter, MlxinferError
from . import measure, provenance
from .hardware import hardware_info, os_info, remeasure_if_exceeded
from .memory import check_memory
from .stats import summarize
from .workload import Case, PromptSource, expand_cases

SCHEMA = "mlxinfer-bench/1"
PEERS = ("mlx-lm",)
MAX_REPETITIONS, MAX_WARMUP = 10_000, 1_000  # beyond these a run would take days: surely a typo
MAX_THREADS = 1024
SEED_MAX = 2**64 - 1
WARMUP_GEN = 4  # warmup runs decode a few tokens: enough to allocate and compile, cheap at any -n
Progress = Callable[[str, int, int], None]  # (what is running, done, total)
# The provenance every record carries (the tests hold the JSON and CSV outputs to it).
PROVENANCE = {
    "model": ("name", "alias", "repo", "revision", "source", "path", "model_type", "params", "params_label",
              "quantization", "bits", "group_size", "quant_mode", "dtype", "weight_bytes", "context_length"),
    "engine": ("name", "version", "git_commit", "git_dirty", "mlx", "mlx_lm", "backend", "kernels", "kernels_detail",
               "kernels_requested", "threads"),
    "hardware": ("chip", "cpu", "gpu", "cpu_cores", "memory_bytes", "bandwidth_gbps", "bandwidth_source",
                 "bandwidth_method", "load_avg_1m"),
    "os": ("system", "release", "machine", "platform", "python"),
    "workload": ("kind", "prompt_tokens", "gen_tokens", "depth", "batch", "prompt_source", "seed", "warmup",
                 "repetitions", "sampler", "ignore_eos", "prefill_step", "kv_bits", "max_kv_size"),
}


@dataclass
class BenchOptions:
    prompts: list[int] = field(default_factory=lambda: [512])
    gens: list[int] = field(default_factory=lambda: [128])
    depths: list[int] = field(default_factory=lambda: [0])
    batches: list[int] | None = None   # None: single-stream tests; a list: batched decode at each size
    prefixes: list[int] = field(default_factory=list)
    repetitions: int = 5
    warmup: int = 1
    seed: int = 0
    prompt_file: Path | None = None
    peer: str | None = None
    kernels: str = "auto"
    bandwidth_gbps: float | None = None
    threads: list[int] | None = None  # -t: native-kernel worker threads to sweep; None: leave them as they are
    llama: bool = False                # llama-bench's separate ppP and tgN tests instead of one ppP+tgN test
    kv_bits: int | None = None         # --kv-bits / --max-kv-size: the cache both engines run with (kv_options)
    max_kv_size: int | None = None

    def kv(self, context_length: int | None = None):
        """The KV-cache options (validated, against ``context_length`` when given); None for a plain cache."""
        from ..engine.kv_options import resolve

        opts = resolve(flags={"kv_bits": self.kv_bits, "max_kv_size": self.max_kv_size},
                       context_length=context_length)
        return opts if opts.active else None

    def cases(self) -> list[Case]:
        return expand_cases(self.prompts, self.gens, self.depths, self.batches, self.prefixes, split=self.llama)

    def validate(self) -> "BenchOptions":
        if not 1 <= self.repetitions <= MAX_REPETITIONS:
            raise InvalidParameter(f"invalid repetitions {self.repetitions}: must be between 1 and {MAX_REPETITIONS}")
        if not 0 <= self.warmup <= MAX_WARMUP:
            raise InvalidParameter(f"invalid warmup {self.warmup}: must be between 0 and {MAX_WARMUP}")
        if not 0 <= self.seed <= SEED_MAX:
            raise InvalidParameter(f"invalid seed {self.seed}: must be between 0 and {SEED_MAX}")
        if self.peer is not None and self.peer not in PEERS:
            raise InvalidParameter(f"unknown peer {self.peer!r}", hint=f"supported: {', '.join(PEERS)}")
        if self.bandwidth_gbps is not None and not 0 < self.bandwidth_gbps < float("inf"):
            raise InvalidParameter(f"invalid bandwidth {self.bandwidth_gbps}: must be a finite number > 0 (GB/s)")
        if self.prompt_file is not None:
            if Path(self.prompt_file).is_dir():
                raise InvalidParameter(f"prompt file {self.prompt_file} is a folder", hint="give a text file")
            if not Path(self.prompt_file).is_file():
                raise InvalidParameter(f"prompt file {self.prompt_file} does not exist", hint="check the path")
            try:
                Path(self.prompt_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidParameter(f"cannot read prompt file {self.prompt_file}: {e}") from None
        for values, name in ((self.prompts, "prompt length"), (self.gens, "generation length")):
            if min(values, default=1) < (0 if self.llama else 1):  # llama-bench: -p 0 / -n 0 skips those tests
                rule = "an integer >= 0" if self.llama else "a positive integer"
                raise InvalidParameter(f"invalid {name} {min(values)}: must be {rule}")
        if self.llama and (self.batches is not None or self.prefixes):
            raise InvalidParameter("--llama-bench runs ppP and tgN tests only, not -b or --prefix-cache",
                                   hint="run those without --llama-bench")
        if self.kv() is not None and (self.batches is not None or self.prefixes):
            raise InvalidParameter("--kv-bits / --max-kv-size apply to single-stream tests, not -b or --prefix-cache",
                                   hint="run those without the KV-cache options")
        if self.threads is not None and not all(1 <= t <= MAX_THREADS for t in self.threads):
            raise InvalidParameter(f"invalid thread count {max(self.threads)}: must be between 1 and {MAX_THREADS}")
        if min(self.depths, default=0) < 0 or min(self.prefixes, default=1) < 1:
            raise InvalidParameter("depths must be >= 0 and prefix lengths >= 1")
        if self.batches is not None and min(self.batches, default=1) < 1:
            raise InvalidParameter("batch sizes must be positive integers")
        return self


def context_length_of(spec, progress=None) -> tuple[Path, int]:
    """The model directory (downloading or importing if needed) and its usable context, without loading weights."""
    import json

    from ..engine.loader import model_dir, check_model_dir

    path = model_dir(spec, progress)
    check_model_dir(path)
    return path, _described(spec, path, json.loads((path / "config.json").read_text())).context_length


def _described(spec, path: Path, config: dict):
    """A LoadedModel without weights: its properties (context length, quantization label) from the config alone."""
    from ..engine.loader import LoadedModel

    return LoadedModel(model=None, tokenizer=None, config=config, path=path, spec=spec, backend="", dtype="")


def check_context(name: str, context: int, cases: list[Case]) -> None:
    worst = max(cases, key=Case.context_needed)
    if worst.context_needed() > context:
        raise InvalidParameter(
            f"{worst.label} needs {worst.context_needed()} tokens of context but {name} holds {context}",
            hint="lower -d, --prefix-cache, -p or -n: their sum must fit",
        )


def run_bench(specs: list, opts: BenchOptions, *, load: Callable | None = None, progress: Progress | None = None,
              on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Benchmark each model spec (already resolved). ``load(spec, kernels=...)`` loads one model (default:
    ``engine.loader.load``). All inputs, including each model's context limit, are checked before any timing."""
    from ..engine.loader import load as default_load
    from ..kernels.patch import resolve_mode

    opts.validate()
    resolve_mode(opts.kernels)  # an unknown --kernels value is bad input too
    check_threads(opts.threads, opts.kernels)
    cases = opts.cases()
    if not cases:
        raise InvalidParameter("nothing to run", hint="give -p/-n lengths above 0" if opts.llama else
                               "give -p/-n lengths or --prefix-cache lengths")
    from ..engine.backend import backend

    for spec in specs:
        path, context = context_length_of(spec)
        check_context(spec.alias or spec.name, context, cases)
        opts.kv(context)  # --max-kv-size within this model's context
        config = json.loads((path / "config.json").read_text())
        check_memory(spec.alias or spec.name, path, config, cases, on_cpu=backend() == "cpu")
    hw = hardware_info(bandwidth_gbps=opts.bandwidth_gbps)
    system = os_info()
    sweep = opts.threads or [None]
    engines = len(sweep) + (1 if opts.peer else 0)
    total = len(specs) * engines * len(cases) * (opts.warmup + opts.repetitions)
    ticker = _Ticker(progress, total)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if on_record:
            on_record(record)

    for spec in specs:
        loaded = (load or default_load)(spec, kernels=opts.kernels)
        source = _prompt_source(loaded, opts)
        common = dict(hardware=hw, system=system, source=source, opts=opts, ticker=ticker, emit=emit)
        kv = opts.kv(loaded.context_length)
        info, timed = provenance.loaded_model_info(loaded), measure.mlxinfer_timed(loaded, kv)
        batch = measure.mlxinfer_batch(loaded)
        before = _native_threads(loaded)
        try:
            for count in sweep:
                engine = {**provenance.engine_info(loaded), "kernels_requested": resolve_mode(opts.kernels),
                          "threads": _set_threads(loaded, count)}
                engine["kernels_detail"] = _with_kv_note(engine["kernels_detail"], loaded.model, kv)
                _run_engine(cases, model=loaded.model, config=loaded.config, timed=timed, batch=batch,
                            engine=engine, model_info=info, **common)
        finally:
            if before is not None:
                _set_threads(loaded, before)
        if opts.peer == "mlx-lm":
            # Kernel swaps are per model instance (kernels.patch): the peer's fresh model is pure mlx-lm.
            spec_, path, backend, context = loaded.spec, loaded.path, loaded.backend, loaded.context_length
            del loaded, timed, batch  # the closures hold the model too: free it before the peer's copy loads
            _free()
            model, tokenizer, config, info = _load_peer(spec_, path, context)
            _run_engine(cases, model=model, config=config, timed=measure.mlx_lm_timed(model, tokenizer),
                        batch=measure.mlx_lm_batch(model),
                        engine={**provenance.peer_engine_info(backend), "kernels_requested": None, "threads": None},
                        model_info=info, **common)
            del model, tokenizer
        else:
            del loaded, timed, batch
        _free()
    return records


def _with_kv_note(detail: str | None, model, kv) -> str | None:
    """The kernel report plus what the custom kernels do about a quantized or capped cache (kv_options)."""
    from ..engine.kv_options import kernel_note

    note = kernel_note(model, kv)
    return f"{detail}; {note}" if note and detail else (note or detail)


def check_threads(threads: list[int] | None, kernels: str = "auto") -> None:
    """-t sets the native CPU kernels' worker pool (in this process, between runs); where those kernels will not
    run, a sweep would only relabel identical runs, so it is refused before anything loads."""
    if threads is None:
        return
    if not all(1 <= t <= MAX_THREADS for t in threads):
        raise InvalidParameter(f"invalid thread count {max(threads)}: must be between 1 and {MAX_THREADS}")
    from ..engine.backend import backend
    from ..kernels.patch import resolve_mode

    why = None
    if backend() != "cpu":
        why = f"the {backend()} backend computes on the GPU"
    elif resolve_mode(kernels) == "builtin":
        why = "MLX's built-in kernels were asked for"
    else:
        from .. import native

        if native.extension() is None:
            why = native.status()
    if why:
        raise InvalidParameter(f"-t sets the worker threads of the native CPU kernels, which do not run here ({why})",
                               hint="drop -t")


def threads_warning(threads: list[int] | None) -> str | None:
    """A line for the CLI when -t asks for more worker threads than this process has cores: the native pool's
    workers spin while they wait, so two of them on one core take turns and that row measures the contention."""
    if not threads:
        return None
    from .hardware import cpu_cores

    cores = cpu_cores()
    over = [t for t in threads if t > cores]
    if not over:
        return None
    counts = ", ".join(str(t) for t in over)
    cores_text = "the 1 core" if cores == 1 else f"the {cores} cores"
    return (f"-t {counts} is more than {cores_text} this process may use: the kernels' workers spin while "
            f"they wait, so {'that row measures' if len(over) == 1 else 'those rows measure'} cores taken in turns, "
            f"not the kernels (use -t up to {cores})")


def _native_threads(loaded) -> int | None:
    """The native kernels' worker threads when this model runs on them (MLXINFER_THREADS or all cores), else None:
    MLX's built-in CPU ops have no thread setting."""
    if loaded.kernels != "cpu-native":
        return None
    from .. import native

    module = native.extension()
    return int(module.num_threads()) if module is not None else None


def _set_threads(loaded, count: int | None) -> int | None:
    """Set the native worker pool to ``count`` (None: leave it) and return the count now in effect."""
    if count is not None:
        if _native_threads(loaded) is None:
            raise MlxinferError(f"-t needs the native CPU kernels, but {loaded.spec.alias or loaded.spec.name} runs "
                                f"{loaded.kernels_detail}", hint="drop -t")
        from .. import native

        native.set_num_threads(count)
    return _native_threads(loaded)


def _free() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def _load_peer(spec, path: Path, context: int):
    """mlx-lm's own load of the same directory: its defaults, including the dtype the weights were saved in."""
    from mlx_lm import load as lm_load

    model, tokenizer, config = lm_load(str(path), return_config=True)
    quant = _described(spec, path, config).quantization
    info = provenance.model_info(spec, path, config, model, dtype=provenance.majority_float_dtype(model),
                                 quantization=quant, context_length=context)
    return model, tokenizer, config, info


def _prompt_source(loaded, opts: BenchOptions) -> PromptSource:
    cfg = loaded.config
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or loaded.tokenizer.vocab_size
    if opts.prompt_file is None:
        return PromptSource(int(vocab), opts.seed)
    from ..engine.prompts import encode_pieces

    text = Path(opts.prompt_file).read_text(encoding="utf-8")
    need = max((c.depth + c.prompt for c in opts.cases()), default=0)
    tokens = encode_pieces(loaded.tokenizer, text, stop_after=need)  # cycled if shorter; a big file not read whole
    label = f"file {Path(opts.prompt_file).name} ({len(tokens)} tokens)"
    return PromptSource(int(vocab), opts.seed, tokens, label=label)


class _Ticker:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, what: str, advance: int = 1) -> None:
        self.done += advance
        if self.progress:
            self.progress(what, self.done, self.total)


def _run_engine(cases, *, model, config, timed, batch, engine, model_info, hardware, system, source, opts, ticker,
                emit):
    weights = measure.weights_read_per_token(model, config)
    kv = opts.kv()
    for case in cases:
        what = f"{engine['name']} {model_info['name']} {case.label}" + (
            f" t{engine['threads']}" if opts.threads and engine.get("threads") is not None else "")
        ticker(what, 0)
        shared: dict = {}  # the prefix cache of a prefix test, filled once and reused by its repetitions
        for _ in range(opts.warmup):
            _measure(case, model, timed, batch, source, shared, gen=min(case.gen, WARMUP_GEN), depth=0, kv=kv)
            ticker(what + " (warmup)")
        samples = []
        for _ in range(opts.repetitions):
            samples.append(_measure(case, model, timed, batch, source, shared, kv=kv))
            ticker(what)
        if case.kind == "prefix":
            results = _prefix_results(samples)
        else:
            results = _decode_results(case, samples, weights, hardware)
            if results["bandwidth_share"] and remeasure_if_exceeded(hardware, results["bandwidth_gbps"]["mean"]):
                results = _decode_results(case, samples, weights, hardware)  # against the new peak
        emit(_record(case, engine, model_info, hardware, system, source, opts, results))
        del shared
        _free()


def _measure(case: Case, model, timed, batch, source: PromptSource, shared: dict, gen: int | None = None,
             depth: int | None = None, kv=None):
    n = case.gen if gen is None else gen
    d = case.depth if depth is None else depth
    if case.kind == "batch":
        rows = [source.take(d + case.prompt, stream=i) for i in range(case.batch)]
        return batch([r[d:] for r in rows], n, [r[:d] for r in rows] if d else None)
    tokens = source.take(case.depth + case.prompt)
    context, prompt = tokens[:case.depth], tokens[case.depth:]
    if case.kind in ("generate", "pp", "tg"):
        return measure.run_stream(timed, model, prompt, n, context[:d] if d else (), kv=kv)
    if "cache" not in shared:
        shared["cache"] = measure.new_cache(model, context)
    return _prefix_sample(model, timed, shared["cache"], context, prompt)


def _prefix_sample(model, timed, cache: list, prefix: list[int], suffix: list[int]) -> tuple[float, float, int]:
    """(cold TTFT: prefix + suffix into an empty cache, warm TTFT: suffix after the shared cached prefix, peak)."""
    from mlx_lm.models.cache import trim_prompt_cache

    cold = measure.run_stream(timed, model, prefix + suffix, 1)
    warm_times, peak = timed(suffix, 1, cache)
    # Back to the shared prefix for the next request; this also drops the step mlx-lm may have computed ahead.
    trim_prompt_cache(cache, cache[0].offset - len(prefix))
    return cold.ttft, warm_times[0], max(cold.peak_memory, peak)


def _prefix_results(samples: list[tuple[float, float, int]]) -> dict:
    cold = summarize([s[0] for s in samples])
    warm = summarize([s[1] for s in samples])
    return {"ttft_cold_s": cold, "ttft_warm_s": warm,
            "ttft_speedup": cold["mean"] / warm["mean"] if warm["mean"] > 0 else 0.0,
            "peak_memory_bytes": max(s[2] for s in samples),
            "samples": {"ttft_cold_s": [s[0] for s in samples], "ttft_warm_s": [s[1] for s in samples]}}


def _decode_results(case: Case, samples: list, weights: int, hardware: dict) -> dict:
    s0 = samples[0]
    layers = len(s0.kv_capacity) if s0.kv_capacity else 1
    kv_end = measure.kv_bytes(s0.kv_per_token, s0.kv_capacity, case.context_needed(), layers)
    # Bytes one decode step reads: the weights once for the whole batch plus every sequence's KV cache, taken at
    # the middle of the decode (the context grows by one token per step).
    kv_mid = measure.kv_bytes(s0.kv_per_token, s0.kv_capacity, case.depth + case.prompt + case.gen / 2, layers)
    step_bytes = weights + case.batch * kv_mid
    bandwidth = [step_bytes * s.decode_tps / case.batch / 1e9 for s in samples]
    peak_bw = hardware.get("bandwidth_gbps")
    latencies = [x for s in samples for x in s.latencies]
    bw = summarize(bandwidth)
    share = bw["mean"] / peak_bw if peak_bw and case.gen > 1 else None
    note = None
    if share is not None and share > 1:
        # More than the peak is not a DRAM figure: the peak is low (a busy probe) or caches served the weights.
        note = (f"above the peak of {peak_bw:.1f} GB/s ({hardware.get('bandwidth_source')}): the peak is too low "
                "or the weights were read from CPU caches")
    decoded = case.gen > 1  # a prefill-only test (llama-bench's ppN) measured no decode: null, not zeros
    return {
        "prefill_tps": summarize([s.prefill_tps for s in samples]),
        "decode_tps": summarize([s.decode_tps for s in samples]) if decoded else None,
        "decode_tps_per_sequence": summarize([s.decode_tps / case.batch for s in samples]) if decoded else None,
        "ttft_s": summarize([s.ttft for s in samples]),
        "e2e_s": summarize([s.e2e for s in samples]),
        "itl_s": summarize(latencies, percentiles=True) if decoded else None,
        "peak_memory_bytes": max(s.peak_memory for s in samples),
        "kv_cache_bytes": int(kv_end * case.batch),
        "weight_bytes_read_per_step": int(weights),
        "decode_bytes_per_step": int(step_bytes),
        "bandwidth_gbps": bw if decoded else None,
        "bandwidth_share": share,
        "bandwidth_note": note,
        "samples": {"prefill_tps": [s.prefill_tps for s in samples], "decode_tps": [s.decode_tps for s in samples],
                    "ttft_s": [s.ttft for s in samples], "e2e_s": [s.e2e for s in samples]},
    }


def _record(case, engine, model_info, hardware, system, source, opts, results) -> dict:
    return {
        "schema": SCHEMA,
        "timestamp": provenance.timestamp(),
        "test": case.label,
        "engine": engine,
        "model": model_info,
        "hardware": {**hardware, "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None},
        "os": system,
        "workload": {"kind": case.kind, "prompt_tokens": case.prompt, "gen_tokens": case.gen, "depth": case.depth,
                     "batch": case.batch, "prompt_source": source.label, "seed": opts.seed, "warmup": opts.warmup,
                     "repetitions": opts.repetitions, "sampler": "greedy", "ignore_eos": True,
                     "prefill_step": measure.PREFILL_STEP, "kv_bits": opts.kv_bits, "max_kv_size": opts.max_kv_size},
        "results": results,
    }
