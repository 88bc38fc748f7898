"""What names a CPU for tuned kernels: vendor, family, model, stepping and cache sizes.

The model-name string does not: every AMD virtual machine reports `AMD EPYC` whether it runs on a
Zen 3, a Zen 4 or a Zen 5, and those want different tile shapes. The numbers in /proc/cpuinfo and
the cache sizes in sysfs tell them apart. `cpu_signature` is a pure function of that text so that a
test can hand it two hosts.
"""
from __future__ import annotations

import platform
from pathlib import Path

_X86 = ("vendor_id", "cpu family", "model", "stepping")
_ARM = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision")
_CACHE_NAMES = {("1", "Data"): "L1d", ("1", "Instruction"): "L1i"}


def first_processor(cpuinfo: str) -> dict[str, str]:
    """The fields of the first processor block of /proc/cpuinfo text (the first value of a field)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_signature(cpuinfo: str, caches: str = "") -> str:
    """`GenuineIntel 6/167/1 L1d 48K L1i 64K L2 2048K L3 491520K` from /proc/cpuinfo text and the
    caches (`sysfs_caches`); where sysfs says nothing, cpuinfo's own `cache size` line stands in.
    A CPU that gives none of the numbers falls back to its model name."""
    fields = first_processor(cpuinfo)
    if all(k in fields for k in _X86[:3]):
        ident = f"{fields['vendor_id']} {fields['cpu family']}/{fields['model']}/{fields.get('stepping', '?')}"
    elif any(k in fields for k in _ARM):
        ident = "arm " + "/".join(fields.get(k, "?") for k in _ARM)
    else:
        ident = fields.get("model name") or platform.processor() or platform.machine()
    if not caches and "cache size" in fields:
        caches = "cache " + fields["cache size"].replace(" ", "")
    return f"{ident} {caches}".strip()


def sysfs_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> str:
    """CPU 0's caches as `L1d 48K L1i 64K L2 2048K L3 491520K` ('' where sysfs has none)."""
    parts = []
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        parts.append(f"{_CACHE_NAMES.get((level, kind), 'L' + level)} {size}")
    return " ".join(parts)


def this_cpu() -> str:
    """This host's `cpu_signature`."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return cpu_signature(cpuinfo, sysfs_caches())
