#!/usr/bin/env python3
"""Time mlxinfer's custom kernels against MLX's built-ins on whatever backend is present.

    python scripts/kernel_bench.py                       # all models, M = 1 and 4, contexts 512/4096/16384
    python scripts/kernel_bench.py --models llama-3.2-1b --rows 1 --contexts 1024 --repeat 5 --json out.json
    python scripts/kernel_bench.py --parity [--model DIR_OR_ALIAS] [--emulate metal|cuda]   # greedy-token parity

On Metal it times the .metal kernels, on CUDA the same bodies through mx.fast.cuda_kernel, on the CPU the native
provider (mlxinfer.native) when it is built; otherwise only the built-in column is filled.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict

import mlx.core as mx

from mlxinfer.errors import MlxinferError
from mlxinfer.kernels.microbench import MODELS, markdown, model_parity, provider_name, run_microbench
from mlxinfer.kernels.patch import backend

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _us(value) -> str:
    return "—" if value is None else f"{value:.1f} µs"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4], help="activation rows M for the matmuls")
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 16384], help="KV lengths")
    ap.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on the CPU, float16 on GPUs")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument("--parity", action="store_true", help="greedy-decode a model with built-in vs custom kernels")
    ap.add_argument("--model", help="for --parity: alias, Hub id, MLX dir or .gguf (default: the bundled model)")
    ap.add_argument("--emulate", choices=["metal", "cuda"], help="for --parity: run the kernels on the CPU emulator")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    if args.parity:
        try:
            r = model_parity(args.model, max_tokens=args.max_tokens, emulate=args.emulate)
        except MlxinferError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"built-in: {r.builtin_tokens}\n{r.kernels}: {r.custom_tokens}\n"
              f"{'EQUAL' if r.equal else 'DIFFERENT'} greedy tokens; max |Δ log-prob| {r.max_logprob_diff:.3g}")
        return 0 if r.equal else 1

    print(f"# kernel micro-benchmark — backend {backend()}, kernels {provider_name()}, MLX {mx.__version__}, "
          f"{platform.machine()}", flush=True)
    rows = run_microbench(
        args.models, dtype=DTYPES.get(args.dtype), rows=args.rows, contexts=args.contexts,
        group_size=args.group_size, bits=args.bits, repeat=args.repeat,
        progress=lambda r: print(f"  {r.kernel:7s} {r.shape}: built-in {_us(r.builtin_us)}, custom {_us(r.custom_us)}",
                                 file=sys.stderr),
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"speedup": r.speedup} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
