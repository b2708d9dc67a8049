"""Time one batched decode step (L=1, B rows, mlx-lm's left-padded BatchKVCache as `mlxinfer serve` and
`mlxinfer bench -b` run it) at B=1,4,8 with the native kernels and the built-ins, and count per step the native
op calls taken ("sdpa"), declined ("sdpa-") and MLX's built-in RoPE / attention / BatchKVCache update calls
("mx:rope", "mx:sdpa", "mx:kv") that run instead. Wall and CPU time per step are medians over the steps.

Usage: python scripts/batch_decode_bench.py PATH_TO_GGUF_OR_MODEL_DIR [custom|builtin|custom,builtin] [1,4,8]
"""
import time, sys, collections
import mlx.core as mx
import mlxinfer
from mlx_lm.models import cache as cache_lib
from mlxinfer.kernels.patch import apply_kernels
mx.set_default_device(mx.cpu)
path = sys.argv[1]
loaded = mlxinfer.load(path, kernels="custom")
model = loaded.model
print("kernels:", loaded.kernels)
calls = collections.Counter()
prov = None
for l in model.layers:
    prov = getattr(l, "_kernel_provider", None)
    if prov: break
if prov is not None:
    for name in ("decoder_layer", "qkv_rope", "rope", "sdpa", "kv_append"):
        f = getattr(prov, name, None)
        if f is None: continue
        def wrap(f=f, name=name):
            def g(*a, **k):
                out = f(*a, **k)
                calls[name if out is not None else name + "-"] += 1
                return out
            return g
        try: setattr(prov, name, wrap())
        except Exception as e: print("cannot wrap", name, e)
for owner, name, label in ((mx.fast, "rope", "mx:rope"), (mx.fast, "scaled_dot_product_attention", "mx:sdpa"),
                           (cache_lib.BatchKVCache, "update_and_fetch", "mx:kv")):
    def count(f=getattr(owner, name), label=label):
        def g(*a, **k):
            calls[label] += 1
            return f(*a, **k)
        return g
    setattr(owner, name, count())
def step_time(B, steps=12):
    prompts = [[1 + (7 * i + j) % 400 for j in range(20 + 3 * i)] for i in range(B)]
    caches, first = [], []
    for p in prompts:
        c = cache_lib.make_prompt_cache(model)
        first.append(mx.argmax(model(mx.array([p]), cache=c)[:, -1], axis=-1)); caches.append(c)
    if B == 1:
        merged = caches[0]
    else:
        merged = [cache_lib.BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
    y = mx.concatenate(first); mx.eval(y)
    for _ in range(2):
        y = mx.argmax(model(y[:, None], cache=merged)[:, -1], axis=-1); mx.eval(y)
    calls.clear()
    times, cpu = [], []  # medians: on a shared machine a mean is mostly other processes' bursts
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        y = mx.argmax(model(y[:, None], cache=merged)[:, -1], axis=-1); mx.eval(y)
        times.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
    return sorted(times)[steps // 2], sorted(cpu)[steps // 2], {k: v / steps for k, v in calls.items()}
for mode in (sys.argv[2] if len(sys.argv) > 2 else "custom,builtin").split(","):
    apply_kernels(model, mode)
    for B in map(int, (sys.argv[3] if len(sys.argv) > 3 else "1,4,8").split(",")):
        dt, cpu, c = step_time(B, 24 if mode == "custom" else 8)
        # CPU time (all threads) per step: the work, less sensitive to a loaded machine than the wall time
        # (run with MLXINFER_THREADS=1 so that no pool thread spins while it waits).
        print(f"{mode:8s} B={B}: {dt*1e3:7.1f} ms/step {B/dt:6.1f} tok/s aggregate | cpu {cpu*1e3:6.1f} ms/step "
              f"{B/cpu:6.1f} tok/cpu-s  calls/step={c}", flush=True)
