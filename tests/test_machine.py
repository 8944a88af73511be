"""engram/compute/machine.py: the processor every timing and result names."""

from pathlib import Path

import pytest

from engram.compute import machine


def test_cpu_id_tells_processors_apart():
    zen3 = "vendor_id : AuthenticAMD\ncpu family : 25\nmodel : 1\nmodel name : AMD EPYC\n" \
           "flags : avx2"
    zen5 = "vendor_id : AuthenticAMD\ncpu family : 26\nmodel : 2\nmodel name : AMD EPYC\n" \
           "flags : avx2 avx512f"
    assert machine.cpu_id(zen3) == "AMD EPYC (family 25 model 1, avx2)"
    assert machine.cpu_id(zen5) == "AMD EPYC (family 26 model 2, avx512f)"
    assert machine.cpu_vendor(zen3) == "AuthenticAMD" and machine.cpu_vendor("no such line") == ""


def test_this_machine_is_read_from_proc_cpuinfo():
    path = Path("/proc/cpuinfo")
    if not path.exists():
        pytest.skip("no /proc/cpuinfo here")
    text = path.read_text()
    assert machine.cpu_id() == machine.cpu_id(text) and "(family " in machine.cpu_id()
    assert machine.cpuinfo("no such field") == ""
