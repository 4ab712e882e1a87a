"""tools/profile_suite.py: a real (small) pytest run, profiled; the file that ran is charged
CPU, and the header's figures are consistent."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow   # a pytest run in a subprocess
def test_profile_suite_charges_the_files_that_ran():
    r = subprocess.run([sys.executable, "tools/profile_suite.py", "-n", "0", "-q", "-p",
                        "no:cacheprovider", "tests/test_algorithms_aggregation.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    head = re.search(r"profile_suite wall_s=([\d.]+) busy_cpu_s=(\d+) capacity_cpu_s=(\d+)",
                     r.stdout)
    assert head, r.stdout
    wall, busy, capacity = float(head[1]), int(head[2]), int(head[3])
    assert busy > 0 and capacity >= wall
    files = r.stdout.split("files by CPU s")[1].split("tests by CPU s")[0]
    charged = re.search(r"([\d.]+)  tests/test_algorithms_aggregation.py  \[(.*)\]", files)
    assert charged and float(charged[1]) > 0 and "pytest" in charged[2], files
    assert "tests/test_algorithms_aggregation.py::" in r.stdout.split("tests by CPU s")[1]


def test_sampler_reads_the_command_line_after_exec():
    """A child seen between fork and exec shows its parent's command line; the sampler
    reads it again at every sweep, so the child is known by what it exec'd (the same pid
    and start time)."""
    import threading
    import time

    from tools import profile_suite

    procs, stop = {}, threading.Event()
    sampler = threading.Thread(target=profile_suite._sample, args=(procs, stop), daemon=True)
    sampler.start()
    pid = os.fork()
    if pid == 0:                      # the child: seen for ~1.5 s before its exec
        try:
            time.sleep(1.5)
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(2.5)",
                                      "mg-exec-marker"])
        finally:
            os._exit(1)               # never back into pytest
    try:
        os.waitpid(pid, 0)
    finally:
        stop.set()
        sampler.join(timeout=10)
    seen = [e for e in procs.values() if e["pid"] == pid]
    assert len(seen) == 1, seen
    assert "mg-exec-marker" in seen[0]["cmd"], seen[0]["cmd"]
