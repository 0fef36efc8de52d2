"""Machine description for reports: /proc/cpuinfo parsing, the one-line description, read bandwidth."""

from __future__ import annotations

import json
import math
import os

from perf.benchlib.machine import FLAGS_THAT_MATTER, Machine, cpu_flags, cpu_model, measure, read_bandwidth

AMX_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_vnni
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Some Other Name
flags\t\t: fpu sse2
"""

AVX2_CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_parses_model_and_first_flags_line():
    assert cpu_model(AMX_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    flags = cpu_flags(AMX_CPUINFO)
    assert {"amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512f", "avx2"} <= flags
    assert "spectre_v1" not in flags
    assert cpu_model(AVX2_CPUINFO) == "AMD EPYC 7B13"
    assert cpu_flags(AVX2_CPUINFO) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})


def test_missing_fields():
    assert cpu_model("processor\t: 0\n") == "unknown"
    assert cpu_flags("processor\t: 0\n") == frozenset()


def test_measure_without_bandwidth_keeps_flags_in_order():
    amx = measure(AMX_CPUINFO, bandwidth=False)
    assert amx.flags == FLAGS_THAT_MATTER
    assert amx.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert amx.cores == len(os.sched_getaffinity(0))
    assert amx.read_gb_s_one_core is None and amx.read_gb_s_all_cores is None
    assert measure(AVX2_CPUINFO, bandwidth=False).flags == ("avx2",)


def test_describe_names_what_is_missing():
    avx2 = Machine("AMD EPYC", 2, ("avx2",), 21.34, 30.06)
    assert avx2.describe() == (
        "2 cores (AMD EPYC), flags avx2 (no AMX, no avx512_bf16), "
        "read bandwidth 21.3 GB/s on one core, 30.1 GB/s on all 2"
    )
    full = Machine("Xeon", 8, FLAGS_THAT_MATTER, None, None).describe()
    assert "no AMX" not in full and "no avx512_bf16" not in full
    assert all(flag in full for flag in FLAGS_THAT_MATTER)
    assert full.count("not measured") == 2
    bf16_only = Machine("Zen 4", 4, ("avx512_bf16", "avx512f", "avx2"), None, None).describe()
    assert "no AMX" in bf16_only and "no avx512_bf16" not in bf16_only
    amx_only = Machine("odd", 1, ("amx_tile", "avx2"), None, None).describe()
    assert "no AMX" not in amx_only and "no avx512_bf16" in amx_only
    assert amx_only.startswith("1 core (odd)")


def test_dict_round_trip():
    for machine in (
        Machine("AMD EPYC", 2, ("avx2",), 21.3, 30.1),
        Machine("Xeon", 8, FLAGS_THAT_MATTER, None, None),
    ):
        d = json.loads(json.dumps(machine.to_dict()))
        assert Machine.from_dict(d) == machine


def test_read_bandwidth_one_core():
    core = min(os.sched_getaffinity(0))
    gb_s = read_bandwidth((core,), mib=16, reps=2)
    assert math.isfinite(gb_s) and gb_s > 0
