"""tools/quickstart.py: the dtype it runs a shipped config in on this CPU (the CPU's flags
are faked: the machine running the suite has or lacks bf16 instructions either way)."""
import os

import pytest

from tools.quickstart import config_bf16, cpu_has_bf16, dtype_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, expected", [
    (ZEN4, True), (SAPPHIRE_RAPIDS, True), (NEOVERSE_V1, True),
    (SKYLAKE, False), (NEOVERSE_N1, False), ("", False),
    # a flag's name elsewhere in the text is not a flag
    ("model name\t: bf16 lover\nflags\t\t: avx2\n", False),
])
def test_cpu_has_bf16_reads_the_flags(cpuinfo, expected):
    assert cpu_has_bf16(cpuinfo) is expected


def test_the_quickstart_trains_in_bf16_where_the_cpu_has_it(tmp_path):
    assert config_bf16(QUICKSTART) is True
    assert dtype_args(QUICKSTART, ZEN4) == []
    assert dtype_args(QUICKSTART, SKYLAKE) == ["--bf16", "false"]
    # a config in float32 (or naming no dtype) is run as it is everywhere
    fp32 = tmp_path / "fp32.yaml"
    fp32.write_text("training:\n  bf16: false\n")
    flat = tmp_path / "flat.yaml"
    flat.write_text("bf16: true\n")
    assert dtype_args(str(fp32), SKYLAKE) == [] and dtype_args(str(flat), SKYLAKE) == \
        ["--bf16", "false"]
    for name in ("quickstart_lora_cpu.yaml", "quickstart_moe_cpu.yaml"):
        assert dtype_args(os.path.join(ROOT, "configs", name), SKYLAKE) == []
