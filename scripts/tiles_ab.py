"""Row tiles against MLX's layout in one process: the same model loaded twice (``MLXINFER_TILED=1``, then ``0``), decode
steps alternated between the two, medians. On a shared VM whose speed drifts by tens of per cent between runs, this
is the comparison that holds (docs/benchmarks.md, "Row tiles").

    python scripts/tiles_ab.py                       # the bundled model, whole decode steps
    python scripts/tiles_ab.py model.gguf --layers   # the decoder layers alone (no LM head)
    python scripts/tiles_ab.py model.gguf --symmetric  # tiles both, biases skipped (Q4_0/Q8_0) vs read
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="what mlxinfer.load takes (default: the bundled model)")
    ap.add_argument("--steps", type=int, default=80, help="decode steps per layout")
    ap.add_argument("--layers", action="store_true", help="time the decoder layers alone")
    ap.add_argument("--symmetric", action="store_true",
                    help="both models tiled; the second reads the biases of symmetric weights (tiling.symmetric off)")
    args = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxinfer.engine.loader import load
    from mlxinfer.kernels import tiling

    models = {}
    for layout in ("1", "0"):  # read when the kernels are applied, i.e. at load
        os.environ["MLXINFER_TILED"] = "1" if args.symmetric else layout
        if args.symmetric and layout == "0":
            tiling.symmetric = lambda linears: False
        models[layout] = load(args.model).model
    tiled = sum(tiling.is_tiled(b) for b in models["1"].layers)
    symmetric = sum(tiling.is_symmetric(b) for b in models["1"].layers)
    if args.symmetric and not symmetric:
        raise SystemExit(f"{args.model or 'bundled model'}: no symmetric tiled layer to compare")

    def width(model) -> int:
        return model.layers[0].self_attn.q_proj["weight"].shape[1] * 32 // model.layers[0].self_attn.q_proj.bits

    def prefill(model):
        cache = make_prompt_cache(model)
        if args.layers:
            h = mx.random.normal((1, 16, width(model)))
            for layer, c in zip(model.layers, cache):
                h = layer(h, "causal", c)
            mx.eval(h)
        else:
            mx.eval(model(mx.array([list(range(1, 17))]), cache=cache))
        return cache

    def step(model, cache, i: int) -> float:
        if args.layers:
            h = mx.random.normal((1, 1, width(model)))
            mx.eval(h)
            t0 = time.perf_counter()
            for layer, c in zip(model.layers, cache):
                h = layer(h, None, c)
            mx.eval(h)
        else:
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[i % 100 + 1]]), cache=cache))
        return time.perf_counter() - t0

    caches = {k: prefill(m) for k, m in models.items()}
    times: dict = {"1": [], "0": []}
    for i in range(args.steps):
        for layout, model in models.items():
            times[layout].append(step(model, caches[layout], i))
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    what = "decoder layers" if args.layers else "decode step"
    a, b = (f"symmetric tiles ({symmetric} layers)", "tiles reading the biases") if args.symmetric else \
        (f"row tiles ({tiled} layers tiled)", "MLX's layout")
    line = (f"{args.model or 'bundled model'}: {what} {med['1']:.2f} ms with {a}, {med['0']:.2f} ms with {b}: "
            f"{med['0'] / med['1']:.2f}x (median of {args.steps}, alternated)")
    print(line)
    return line


if __name__ == "__main__":
    main()
