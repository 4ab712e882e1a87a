"""LoRA end to end: `megatron rlhf --tuner_type lora` on 2 CPU processes (TP=2) with a
colocated vLLM engine, merged sync verified inside vLLM, resume, and the PEFT adapter.

One run of 3 steps (beta > 0: the reference is the policy with adapters off), then a
resumed run to step 4 with adapter-only sync (--vllm_enable_lora true, checked too). Checked: `--check_weight_sync` passes after every merged sync
(vLLM holds exactly W + s B A of every adapted tensor, which test_lora.py holds equal to
peft's merge_and_unload); the KL is 0 until a step with a gradient (B = 0: the policy
is the base) and not after; checkpoints hold adapter tensors only; final_hf/ is a PEFT adapter that peft loads,
and with adapters it changes the logits of the base.
"""
import json
import os

import pytest
import torch

from tests import cli_zygote
from tests.test_trainer_e2e import _argv, _metrics, _run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    return str(make_tiny_model(d / "qwen2", family="qwen2", num_layers=2, hidden_size=128,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=256, vocab_size=999))


def _checkpoint_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(path, "dist")).read_metadata() \
        if os.path.isdir(os.path.join(path, "dist")) else FileSystemReader(path).read_metadata()
    return list(meta.state_dict_metadata)


def test_lora_run_sync_resume_and_adapter(tiny, tmp_path):
    out = str(tmp_path / "run")
    lora = dict(tuner_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                merge_lora="false", target_modules="all-linear", tensor_model_parallel_size=2, beta=0.04,
                lr=2e-2, check_weight_sync="true", save_steps=1000,   # after the last step
                use_distributed_optimizer="false", lr_decay_style="constant")
    r = _run(_argv(tiny, out, train_iters=3, **lora))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    # KL(policy || base) is 0 until an update changed the adapters (B = 0 at the start),
    # then not: the reference is the base, the policy is not.
    first = next(i for i, row in enumerate(rows) if row["grad_norm"] > 0)
    assert first < 2, rows
    assert all(row["kl"] == 0.0 for row in rows[:first + 1]), rows
    assert all(row["kl"] != 0.0 for row in rows[first + 1:]), rows

    ckpt = os.path.join(out, "checkpoint-3")
    model_keys = [k for k in _checkpoint_keys(ckpt)
                  if not k.startswith(("optimizer", "chained", "scheduler", "rng", "common"))]
    assert model_keys and all("_lora.lora_" in k for k in model_keys), model_keys[:5]

    adapter = os.path.join(out, "final_hf")
    assert os.path.isfile(os.path.join(adapter, "adapter_config.json"))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(5, 25).view(2, 10)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-4

    # Resumed from checkpoint-3 with adapter-only sync: vLLM keeps the base it loaded and
    # gets the adapter at the start and after step 4, each checked (--check_weight_sync).
    r = _run(_argv(tiny, out, train_iters=4, vllm_enable_lora="true", **lora))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[3]["kl"] != 0.0     # the resumed policy holds the trained adapters
    with open(os.path.join(out, "final_hf", "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4

    # `megatron export --to_hf` of the run (its newest checkpoint, adapters only, saved at
    # TP=2; converted at TP=1 on the base the run trained on): the PEFT adapter equals the
    # run's final_hf/ (--merge_lora false), and the merged model (the default) equals peft's
    # merge.
    import subprocess

    from safetensors.torch import load_file

    from tests.harness import hf_tensors as _hf_tensors
    from tests.test_trainer_e2e import ROOT, _free_port

    ports = [_free_port()]
    while len(ports) < 2:
        ports += [p for p in [_free_port()] if p not in ports]

    def export(dst, port, *extra):    # one process each: the two run side by side
        with open(f"{dst}.log", "w") as log:
            return subprocess.Popen(cli_zygote.command("export", "--to_hf", "true",
                                                       "--mcore_model", out, "--output_dir", dst,
                                                       *extra),
                                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env=cli_zygote.env(OMP_NUM_THREADS="1", MASTER_PORT=str(port)))

    exports = [export(str(tmp_path / "adapter"), ports[0], "--merge_lora", "false"),
               export(str(tmp_path / "merged"), ports[1])]     # merged: the default
    try:
        for p, dst in zip(exports, ("adapter", "merged")):
            assert p.wait(timeout=300) == 0, (tmp_path / f"{dst}.log").read_text()[-4000:]
    finally:
        for p in exports:
            if p.poll() is None:
                p.kill()
                p.wait()
    want = load_file(os.path.join(out, "final_hf", "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    got = _hf_tensors(tmp_path / "merged")
    assert sorted(got) == sorted(k for k in merged if k != "lm_head.weight" or k in got)
    for name, t in got.items():
        assert (t - merged[name]).abs().max() <= 1e-5, name
