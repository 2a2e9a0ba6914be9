"""What this machine's CPU offers, read once from ``/proc/cpuinfo`` (empty where it cannot be read), and the
environment switches that turn the fast paths built on it off."""

from __future__ import annotations

import functools
import os
from pathlib import Path

# What an environment switch reads as "off" / "on" (any case, spaces around ignored).
OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity; every CPU where that cannot be read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its feature off (one of ``OFF``); unset is on."""
    return os.environ.get(name, "").strip().lower() in OFF


@functools.cache
def _first_cpu() -> dict[str, str]:
    """The first CPU's block of ``/proc/cpuinfo`` as fields (``"flags"``, ``"vendor_id"``, ``"cpu family"``, ...)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU's block ends at the first blank line
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU (``avx2``, ``avx512_bf16``, ...)."""
    return frozenset(_first_cpu().get("flags", "").split())


def cpu_model() -> tuple[str, int, int]:
    """(vendor, family, model) of the first CPU (``("AuthenticAMD", 25, 17)`` on a Zen 4 EPYC); ("", 0, 0) where
    /proc/cpuinfo cannot be read."""
    fields = _first_cpu()

    def number(key: str) -> int:
        try:
            return int(fields.get(key, "0"))
        except ValueError:
            return 0

    return fields.get("vendor_id", ""), number("cpu family"), number("model")


@functools.cache
def last_level_cache_bytes() -> int:
    """Bytes of the first CPU's largest cache (its L3 on x86 servers), from sysfs; 0 where it cannot be read."""
    best = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best
