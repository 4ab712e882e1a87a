"""The Triton per-tile kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1).

This checks their arithmetic (masking, online rescaling, gradient formula) against the same
float64 reference as the torch path. It does not compile them for a GPU: on CUDA they are
unverified until run there. The interpreter must be switched on before `triton` is imported,
so the kernel runs in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, torch
from megatron_grpo.kernels import triton_logprob, vocab_parallel_logprobs
from tests.test_kernels_logprob import make_inputs, reference, rel

# Blocks narrower than the 300-column tiles: the forward loop runs over 3 blocks, the last
# one ragged, and the backward grid has a masked tail.
triton_logprob._BLOCK_FWD = 128
triton_logprob._BLOCK_BWD = 128
out = {}
hidden, weight, targets, c_lp, c_ent = make_inputs(37, 16, 1003, seed=21)
zero = torch.zeros_like(c_lp)
kw = dict(temperature=0.7, chunk_size_tokens=8, chunk_size_vocab=300, backend="triton")
for name, a, b, entropy in (("both", c_lp, c_ent, True), ("entropy_only", zero, c_ent, True),
                            ("logp_only", c_lp, zero, False)):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, w, targets, compute_entropy=entropy, **kw)
    loss = (b * ent).sum() if name == "entropy_only" else (a * logp).sum()
    if name == "both":
        loss = loss + (b * ent).sum()
    loss.backward()
    r = reference(hidden, weight, targets, 0.7, a, b)
    out[name] = {"logp": rel(logp.detach(), r[0]), "grad_hidden": rel(h.grad, r[2]),
                 "grad_weight": rel(w.grad, r[3])}
    if entropy:
        out[name]["entropy"] = rel(ent.detach(), r[1])
print(json.dumps(out))
"""


@pytest.mark.slow  # the Triton interpreter in a subprocess
def test_triton_kernels_in_interpreter_match_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errors) == {"both", "entropy_only", "logp_only"}
    for case, errs in errors.items():
        for name, err in errs.items():
            assert err <= 1e-5, (case, name, err)
