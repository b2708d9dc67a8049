"""Run one conversion in this process and print its memory use as JSON (the parent test reads it).

    python memprobe.py SRC OUT SHARD_BYTES [BITS]        # mlxinfer's streamed convert
    python memprobe.py --mlx-lm SRC OUT [BITS]          # mlx_lm.convert, for comparison (not used by tests)

Everything the conversion imports is imported before the baseline is taken, so the figure is the conversion's
own working memory: peak resident set minus the resident set just before converting. The peak is VmHWM from
/proc/self/status, reset just before converting (``5 > /proc/self/clear_refs``); not ru_maxrss, which after
fork+exec also counts the parent's (here: pytest's) size.
"""

import json
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # older kernels: the peak then includes the imports, which only makes the bound stricter
        pass


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(argv: list[str]) -> None:
    import mlx_lm.models.llama  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    from mlxinfer.convert import pipeline  # noqa: F401
    from mlxinfer.convert import ConvertOptions, convert

    if argv[0] == "--mlx-lm":
        from mlx_lm.convert import convert as mlx_convert

        src, out = argv[1], argv[2]
        bits = int(argv[3]) if len(argv) > 3 else None
        reset_peak()
        base = rss_bytes()
        mlx_convert(src, out, quantize=bits is not None, q_bits=bits, q_group_size=64 if bits else None)
    else:
        src, out, shard = argv[0], argv[1], int(argv[2])
        bits = int(argv[3]) if len(argv) > 3 else None
        reset_peak()
        base = rss_bytes()
        convert(src, out, ConvertOptions(bits=bits, eval=False, shard_bytes=shard))
    peak = peak_bytes()
    print(json.dumps({"baseline": base, "peak": peak, "delta": peak - base}))


if __name__ == "__main__":
    main(sys.argv[1:])
