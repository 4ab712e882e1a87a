"""`megatron export` of a tiny Qwen3-MoE: HF -> Megatron dist checkpoint at
EP=2 x TP=2 (4 ranks) -> HF at EP=1 on 1 rank (a world of its own) and at EP=4 x ETP=1
reproduces the checkpoint bit for bit, and the exported model loads in transformers
with the original's logits.
"""
from __future__ import annotations

import contextlib
import io
import os

import torch

from tests.harness import run_distributed


def _convert(rank, world_size, argvs):
    from megatron_grpo.convert import main

    logs = []
    for argv in argvs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(argv)
        logs.append(buf.getvalue())
    return logs


def test_moe_export_roundtrip_ep2_tp2_to_one_rank(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.test_moe import _hf_tensors
    from tools.make_tiny_model import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", family="qwen3_moe", vocab_size=999)
    mcore, out1, out4 = (str(tmp_path / n) for n in ("mcore", "hf_1", "hf_ep4"))
    logs = run_distributed(_convert, world_size=4, timeout=300, args=([
        ["--to_mcore", "true", "--model", str(hf), "--output_dir", mcore,
         "--tensor_model_parallel_size", "2", "--expert_model_parallel_size", "2",
         "--test_convert_precision", "true"],
        ["--to_hf", "true", "--mcore_model", mcore, "--output_dir", out4,
         "--expert_model_parallel_size", "4", "--expert_tensor_parallel_size", "1"]],))
    assert "max_abs_diff" in logs[0][0]
    run_distributed(_convert, world_size=1, timeout=300, args=([
        ["--to_hf", "true", "--mcore_model", mcore, "--output_dir", out1]],))
    want = _hf_tensors(hf)
    for out in (out1, out4):
        got = _hf_tensors(out)
        assert sorted(got) == sorted(want), out
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (out, name)
    ids = torch.randint(0, 999, (1, 16), generator=torch.Generator().manual_seed(0))
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for p in (hf, out1)]
    with torch.no_grad():
        a, b = (m(input_ids=ids).logits for m in models)
    assert torch.equal(a, b)
    assert os.path.isfile(os.path.join(out1, "config.json"))
