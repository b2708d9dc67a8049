"""``python -m mlxinfer.native [status|build]``: show or (re)build the native CPU kernels."""

from __future__ import annotations

import sys

from mlxinfer import native


def main(argv: list) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "build":
        try:
            path = native.ensure_built(log=lambda line: print(line, file=sys.stderr))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"built: {path}")
    elif cmd != "status":
        print("usage: python -m mlxinfer.native [status|build]", file=sys.stderr)
        return 2
    print(native.status())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
