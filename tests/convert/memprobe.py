"""Run one conversion in this process and print its memory use as JSON (the parent test reads it).

    python memprobe.py SRC OUT SHARD_BYTES [BITS]        # mlxinfer's streamed convert
    python memprobe.py --mlx-lm SRC OUT [BITS]          # mlx_lm.convert, for comparison (not used by tests)

Everything the conversion imports is imported before the baseline is taken, so the figure is the conversion's
own working memory: peak resident set (ru_maxrss) minus the resident set just before converting.
"""

import json
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main(argv: list[str]) -> None:
    import mlx_lm.models.llama  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    from mlxinfer.convert import pipeline  # noqa: F401
    from mlxinfer.convert import ConvertOptions, convert

    if argv[0] == "--mlx-lm":
        from mlx_lm.convert import convert as mlx_convert

        src, out = argv[1], argv[2]
        bits = int(argv[3]) if len(argv) > 3 else None
        base = rss_bytes()
        mlx_convert(src, out, quantize=bits is not None, q_bits=bits, q_group_size=64 if bits else None)
    else:
        src, out, shard = argv[0], argv[1], int(argv[2])
        bits = int(argv[3]) if len(argv) > 3 else None
        base = rss_bytes()
        convert(src, out, ConvertOptions(bits=bits, eval=False, shard_bytes=shard))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    print(json.dumps({"baseline": base, "peak": peak, "delta": peak - base}))


if __name__ == "__main__":
    main(sys.argv[1:])
