"""What ``dtype: auto`` gives vLLM on a CPU: float32 where bfloat16 would be emulated."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.ray_job.engines.backend_vllm import llm_kwargs
from llmbatch.ray_job.engines.cpu_dtype import auto_dtype, cpu_flags, host_cpu_flags
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def test_auto_dtype_on_a_cpu_without_bf16_instructions_is_float32() -> None:
    avx2 = cpu_flags(
        "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 f16c fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    assert avx2 == frozenset({"fpu", "sse2", "avx", "avx2", "f16c", "fma"})
    assert llm_kwargs("/models/m", EngineConfig(), cpu_flags=avx2)["dtype"] == "float32"
    # bf16 computed natively (AVX-512 BF16, AMX, aarch64's BF16): vLLM's own choice stays
    for native in ("avx512f avx512_bf16", "amx_tile amx_bf16"):
        assert llm_kwargs("/models/m", EngineConfig(), cpu_flags=native.split())["dtype"] == "auto"
    arm = cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert arm is not None and auto_dtype("auto", arm) == "auto"
    # a GPU engine (no CPU flags) and an explicit dtype are left as they are
    assert llm_kwargs("/models/m", EngineConfig())["dtype"] == "auto"
    assert llm_kwargs("/models/m", EngineConfig(dtype="bfloat16"), cpu_flags=avx2)["dtype"] == "bfloat16"


def test_cpu_flags_that_cannot_be_read_leave_auto_to_vllm(tmp_path: Path) -> None:
    assert host_cpu_flags(tmp_path / "absent") is None
    garbled = tmp_path / "cpuinfo"
    garbled.write_bytes(b"\xff\xfe no flags line \x00\nmodel name: ?\n")
    assert host_cpu_flags(garbled) is None
    assert auto_dtype("auto", None) == "auto"


@given(st.text())
def test_cpu_flags_reads_any_text(text: str) -> None:
    flags = cpu_flags(text)
    assert flags is None or all(flag and not flag.isspace() for flag in flags)
