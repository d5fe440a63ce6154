"""What this machine's CPU is, from /proc/cpuinfo: read once per process and shared by the cost
model's machine key, the C++ kernels' build key, the benchmarks' records and the dtype choice."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache  # the CPU does not change under a running process
def cpu_info() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields ("model name", "flags", ...); empty where /proc is
    not readable (not Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def native_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX-512 BF16 or AMX): where bfloat16
    is the fast mode; on AVX2-only CPUs oneDNN emulates it several times slower than float32
    (docs/benchmarks.md). False where the flags are not readable."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_amx() -> bool:
    """Whether this CPU has AMX bfloat16 tiles: where torch's CPU flash attention multiplies
    bfloat16 blocks itself rather than through float32 BLAS (services/engine/attention/
    blocked_prefill.py). False where the flags are not readable."""
    return "amx_bf16" in cpu_flags()


def cpu_flags() -> list[str]:
    """The first CPU's /proc/cpuinfo flags (empty where not readable)."""
    return cpu_info().get("flags", "").split()
