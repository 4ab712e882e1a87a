"""tools/quickstart.py: the dtype it runs a shipped config in on this CPU (the CPU's flags
are faked: the machine running the suite has or lacks bf16 instructions either way)."""
import os

from tests.test_config_hf_model import SKYLAKE, ZEN4
from tools.quickstart import config_bf16, dtype_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")



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
