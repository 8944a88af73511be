"""The machine a timing or result was measured on, as every record names it.

A virtual machine may show only 'AMD EPYC' for a Zen 2, a Zen 4 and a Zen 5 alike, and they ran
this package's training 2x apart; so the record carries the family and model numbers and the
widest vector ISA too, read from /proc/cpuinfo. engram/compute/gemm.py keys its measured routes by it.
"""

from __future__ import annotations

import platform


def cpuinfo(field: str, text: str | None = None) -> str:
    """The first value of ``field`` in /proc/cpuinfo's text (or ``text``), or ''."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read(1 << 16)
        except OSError:
            return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


def cpu_vendor(text: str | None = None) -> str:
    """The x86 vendor id ('AuthenticAMD', 'GenuineIntel', ...), or ''."""
    return cpuinfo("vendor_id", text)


def cpu_id(text: str | None = None) -> str:
    """The processor as records name it: model name, family/model numbers and widest vector ISA,
    e.g. 'AMD EPYC (family 26 model 2, avx512f)'."""
    flags = set(cpuinfo("flags", text).split())
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse2", "asimd") if f in flags), "")
    name = cpuinfo("model name", text) or platform.processor() or platform.machine()
    fam, model = cpuinfo("cpu family", text), cpuinfo("model", text)
    return f"{name} (family {fam or '?'} model {model or '?'}, {isa or '?'})"
