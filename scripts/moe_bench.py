"""Time one mixture-of-experts MLP (mlx-lm's ``SwitchGLU`` with 4-bit ``QuantizedSwitchLinear`` experts) on MLX's
built-in ``gather_qmm`` and on mlxinfer's native CPU kernels, at a real model's shapes, for a decode step (1 token)
and a prompt chunk (the sorted-experts path).

    python scripts/moe_bench.py                        # Qwen3-30B-A3B's MoE layer: 128 experts, top 8, 2048 -> 768
    python scripts/moe_bench.py --experts 64 --top 8 --hidden 2048 --inter 1024 --tokens 1,128

Each timing is the median of --repeat calls; a layer has its own random experts, and the calls cycle through
--layers of them so that decode reads weights from memory, as a real model's 48 layers do (not from the cache).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchGLU

from mlxinfer.kernels import patch


def make_layers(n: int, hidden: int, inter: int, experts: int, bits: int, group: int) -> list:
    out = []
    for _ in range(n):
        m = SwitchGLU(hidden, inter, experts)
        m.update({k: {"weight": mx.random.normal((experts, inter if k != "down_proj" else hidden,
                                                  hidden if k != "down_proj" else inter)) * 0.02}
                  for k in ("gate_proj", "up_proj", "down_proj")})
        for k in ("gate_proj", "up_proj", "down_proj"):
            lin = m[k].to_quantized(group_size=group, bits=bits)
            lin.update({"scales": lin["scales"].astype(mx.float16), "biases": lin["biases"].astype(mx.float16)})
            setattr(m, k, lin)
        mx.eval(m.parameters())
        out.append(m)
    return out


class _Model:  # what apply_kernels walks: named_modules over the MoE layers
    def __init__(self, layers):
        import mlx.nn as nn

        self.inner = nn.Module()
        self.inner.layers = layers

    def apply(self, mode: str) -> str:
        return patch.apply_kernels(self.inner, mode).name


def time_calls(layers: list, x: mx.array, idx: mx.array, repeat: int) -> float:
    times = []
    for i in range(repeat):
        m = layers[i % len(layers)]
        t = time.perf_counter()
        mx.eval(m(x, idx))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top", type=int, default=8, help="experts per token")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4, help="distinct random layers the calls cycle through")
    ap.add_argument("--tokens", default="1,64", help="tokens per call (comma-separated)")
    ap.add_argument("--repeat", type=int, default=16)
    args = ap.parse_args()
    mx.random.seed(0)
    layers = make_layers(args.layers, args.hidden, args.inter, args.experts, args.bits, args.group)
    model = _Model(layers)
    per_expert = 3 * args.hidden * args.inter * (args.bits / 8 + 2 * 2 / args.group)
    print(f"SwitchGLU {args.hidden} -> {args.inter}, {args.experts} experts, top {args.top}, {args.bits}-bit group "
          f"{args.group} (float16 scales); {args.layers} layers cycled")
    for t in [int(v) for v in args.tokens.split(",")]:
        x = mx.random.normal((1, t, args.hidden))
        idx = mx.stack([mx.random.permutation(args.experts)[: args.top] for _ in range(t)])[None].astype(mx.uint32)
        mx.eval(x, idx)
        row = {}
        for mode in ("builtin", "custom"):
            name = model.apply(mode)
            time_calls(layers, x, idx, 2)  # warm up
            row[name] = time_calls(layers, x, idx, args.repeat)
        used = len(set(idx.reshape(-1).tolist()))
        mb = used * per_expert / 1e6
        cells = ", ".join(f"{k} {v * 1e3:.2f} ms ({mb / 1e3 / v:.1f} GB/s)" for k, v in row.items())
        print(f"{t} token(s), {used} experts read ({mb:.1f} MB): {cells}; "
              f"x{row['builtin'] / row['cpu-native']:.1f}")
    model.apply("builtin")


if __name__ == "__main__":
    main()
