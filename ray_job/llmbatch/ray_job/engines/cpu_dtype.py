"""What ``dtype: auto`` means for an engine on a CPU.

vLLM's ``auto`` takes the model's own dtype (bfloat16 for most instruct models) and, on x86, takes
bfloat16 to be native everywhere. A CPU without bfloat16 instructions (AVX-512 BF16, AMX) emulates
it: measured on a 2-core AMD EPYC with AVX2 only, plain ``LLM.chat`` of SmolLM2-135M generated
41.7 tok/s in bfloat16 and 241.2 in float32 (``bench/bench_engine_env.py``, ``docs/benchmarks.md``).
So on such a CPU ``auto`` computes in float32 (more precise than bfloat16, never less); where the CPU
has bfloat16 instructions, or its flags cannot be read, the choice stays vLLM's. An explicit dtype is
always used as given.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llmbatch.schemas.job import Dtype

NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU flags (``/proc/cpuinfo``) that mean bfloat16 is computed natively: x86's AVX-512 BF16 and AMX
BF16, aarch64's BF16 extension."""

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(text: str) -> frozenset[str] | None:
    """The flags of the first processor in ``/proc/cpuinfo``'s text (x86 ``flags``, aarch64
    ``Features``); None when it names none."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def host_cpu_flags(path: Path = CPUINFO) -> frozenset[str] | None:
    """This machine's CPU flags, None where they cannot be read (not Linux, no such file)."""
    try:
        return cpu_flags(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def auto_dtype(dtype: Dtype, flags: Iterable[str] | None) -> Dtype:
    """The dtype to give vLLM for ``dtype`` on a CPU with ``flags``: float32 for ``auto`` on a CPU
    known to lack bfloat16 instructions, else ``dtype`` unchanged."""
    if dtype != "auto" or flags is None:
        return dtype
    return dtype if NATIVE_BF16 & frozenset(flags) else "float32"


def host_auto_dtype() -> Dtype:
    """What ``dtype: auto`` is on this machine's CPU (for plain vLLM runs that must compute as the local
    engine does)."""
    return auto_dtype("auto", host_cpu_flags())
