"""kernels/cpu_id.py: what names a CPU for tuned kernels. Two hosts that report the same model name
(every AMD virtual machine says `AMD EPYC`) but differ in family, model or caches get different keys."""
from __future__ import annotations

from wallbreaker.kernels.cpu_id import cpu_signature, first_processor, sysfs_caches

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
cache size\t: 1024 KB

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
model\t\t: 99
"""
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2", 1)
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""


def test_the_same_model_name_of_another_family_or_model_is_another_cpu():
    assert first_processor(ZEN4)["model name"] == first_processor(ZEN5)["model name"] == "AMD EPYC"
    assert cpu_signature(ZEN4) == "AuthenticAMD 25/17/1 cache 1024KB"
    assert cpu_signature(ZEN5) == "AuthenticAMD 26/2/1 cache 1024KB"
    caches = "L1d 48K L1i 32K L2 1024K L3 32768K"
    assert cpu_signature(ZEN4, caches) != cpu_signature(ZEN5, caches)
    assert cpu_signature(ZEN4, caches) != cpu_signature(ZEN4, caches.replace("32768K", "16384K"))
    assert cpu_signature(ZEN4, caches).endswith(caches)


def test_an_arm_cpu_is_named_by_its_implementer_and_part():
    assert cpu_signature(GRAVITON) == "arm 0x41/8/0x1/0xd40/1"


def test_sysfs_caches_names_each_level(tmp_path):
    for i, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "32K"),
                                             ("2", "Unified", "2048K"), ("3", "Unified", "32768K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(value + "\n")
    assert sysfs_caches(tmp_path) == "L1d 48K L1i 32K L2 2048K L3 32768K"
    assert sysfs_caches(tmp_path / "none") == ""
