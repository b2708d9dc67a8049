"""``mlxinfer bench``: benchmark local inference with full provenance.

``workload`` (lengths in llama-bench syntax, test cases, seeded prompts) -> ``runner.run_bench`` (warmup,
repetitions; timed primitives in ``measure``) -> records carrying ``provenance`` and ``hardware`` -> ``report``
(Markdown, CSV, JSON, JSONL, comparisons, depth chart). ``stats`` holds the summary statistics; ``kernels`` wraps
the kernel micro-benchmark. Nothing here prints: the CLI (``mlxinfer.cli.bench``) renders.
"""
