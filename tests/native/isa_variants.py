"""Which native kernel variants a CPU can run (pytest puts this folder on sys.path, as for kernel_cases)."""

from __future__ import annotations

import os


INT8_PREFILL_SETS = ("avx2", "avx2i8", "avx512vnni")  # the sets with the int8 prefill GEMM (opt-in: MLXINFER_PREFILL=int8)


def isa_variants(current: str) -> list:
    """The variants a CPU whose best is ``current`` can run (each CPU that runs one runs those before it)."""
    current = current.split("+")[0]  # "avx2+int8-prefill" (MLXINFER_PREFILL=int8) runs what "avx2" runs
    for order in (["generic", "avx2float", "avx2i8", "avx2", "avx512", "avx512vnni"], ["generic", "neon"]):
        if current in order:
            return order[: order.index(current) + 1]
    return ["generic"]


def kernel_set_name(isa: str, env=None) -> str:
    """The name a process forced to ``isa`` reports: the sets with the int8 prefill GEMM start with it on under
    MLXINFER_PREFILL=int8, and their name says so."""
    env = os.environ if env is None else env
    int8 = isa in INT8_PREFILL_SETS and env.get("MLXINFER_PREFILL") == "int8"
    return isa + ("+int8-prefill" if int8 else "")
