"""docs/ms-swift.md is generated from swift_flags.py and the option groups: keep it current."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a subprocess that imports the option groups
def test_doc_up_to_date():
    r = subprocess.run([sys.executable, "tools/ms_swift_flags.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_doc_lists_every_flag_once():
    from megatron_grpo.config import swift_flags as sf

    text = open(os.path.join(ROOT, "docs", "ms-swift.md"), encoding="utf-8").read()
    for name in sf.all_flags():
        assert text.count(f"| `--{name}` |") == 1, name
