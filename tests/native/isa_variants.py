"""Which native kernel variants a CPU can run (pytest puts this folder on sys.path, as for kernel_cases)."""

from __future__ import annotations


def isa_variants(current: str) -> list:
    """The variants a CPU whose best is ``current`` can run (each CPU that runs one runs those before it)."""
    current = current.split("+")[0]  # "avx2+int8-prefill" (MLXINFER_PREFILL=int8) runs what "avx2" runs
    for order in (["generic", "avx2float", "avx2i8", "avx2", "avx512", "avx512vnni"], ["generic", "neon"]):
        if current in order:
            return order[: order.index(current) + 1]
    return ["generic"]
