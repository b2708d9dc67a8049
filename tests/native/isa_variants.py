"""Which native kernel variants a CPU can run (pytest puts this folder on sys.path, as for kernel_cases)."""

from __future__ import annotations

import os
import subprocess
import sys


# The sets with the int8 prefill GEMM (opt-in: MLXINFER_PREFILL=int8).
INT8_PREFILL_SETS = ("avx2", "avx2i8", "avx512vnni", "avx512vnnii8")
INT8_DECODE_SETS = ("avx2i8", "avx512vnnii8")  # the sets whose 4-bit decode rounds x to int8 (opt-in: MLXINFER_ISA)
AMX_SET = "avx512amx"  # the VNNI set with the AMX-BF16 prefill: only under the default prefill


def isa_variants(current: str) -> list:
    """The variants a CPU whose best is ``current`` can run (each CPU that runs one runs those before it)."""
    current = current.split("+")[0]  # "avx2+int8-prefill" (MLXINFER_PREFILL=int8) runs what "avx2" runs
    x86 = ["generic", "avx2float", "avx2i8", "avx2", "avx512", "avx512vnnii8", "avx512vnni", AMX_SET]
    for order in (x86, ["generic", "neon"]):
        if current in order:
            return order[: order.index(current) + 1]
    return ["generic"]


def kernel_set_name(isa: str, env=None) -> str:
    """The name a process forced to ``isa`` reports: the sets with the int8 prefill GEMM start with it on under
    MLXINFER_PREFILL=int8, and their name says so; the AMX set is the VNNI one under any prefill but the default."""
    env = os.environ if env is None else env
    prefill = env.get("MLXINFER_PREFILL")
    if isa == AMX_SET and prefill in ("int8", "int16", "float"):
        isa = "avx512vnni"  # another prefill asked for: the VNNI set without AMX
    int8 = isa in INT8_PREFILL_SETS and prefill == "int8"
    return isa + ("+int8-prefill" if int8 else "")


_KEEP = object()


def run_under_isa(script: str, isa=None, *args, threads="2", prefill=_KEEP, timeout=600, env=None):
    """Runs ``python -c script *args`` in a process forced to kernel set ``isa`` (None: the CPU's best) on
    ``threads`` threads (None: the default), with MLXINFER_PREFILL set to ``prefill`` (None: unset; default: as
    inherited): the kernel set is chosen once per process, so each variant needs its own. Returns the
    CompletedProcess (text output captured)."""
    run_env = {**(os.environ if env is None else env)}
    for key, value in (("MLXINFER_ISA", isa), ("MLXINFER_THREADS", threads)):
        if value is None:
            run_env.pop(key, None)
        else:
            run_env[key] = value
    if prefill is None:
        run_env.pop("MLXINFER_PREFILL", None)
    elif prefill is not _KEEP:
        run_env["MLXINFER_PREFILL"] = prefill
    return subprocess.run([sys.executable, "-c", script, *args], env=run_env, capture_output=True, text=True,
                          timeout=timeout)
