"""What this machine's CPU offers, read once from ``/proc/cpuinfo`` (empty where it cannot be read)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU (``avx2``, ``avx512_bf16``, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> tuple[str, int, int]:
    """(vendor, family, model) of the first CPU (``("AuthenticAMD", 25, 17)`` on a Zen 4 EPYC); ("", 0, 0) where
    /proc/cpuinfo cannot be read."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        return "", 0, 0

    def number(key: str) -> int:
        try:
            return int(fields.get(key, "0"))
        except ValueError:
            return 0

    return fields.get("vendor_id", ""), number("cpu family"), number("model")
