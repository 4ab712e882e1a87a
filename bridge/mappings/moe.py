"""Qwen3-MoE (Qwen3MoeForCausalLM) and Qwen2-MoE (Qwen2MoeForCausalLM): the dense
attention rules plus Megatron's MoE layer in place of the MLP.

HF (per layer, as checkpoints store it; transformers 5 fuses experts only in memory):
    mlp.gate.weight [E, hidden]                         -> mlp.router.weight (replicated)
    mlp.experts.{e}.gate_proj / up_proj [moe_ffn, hidden] -> local_experts.{e'}.linear_fc1
    mlp.experts.{e}.down_proj [hidden, moe_ffn]          -> local_experts.{e'}.linear_fc2
    Qwen2-MoE also: mlp.shared_expert.{gate,up,down}_proj -> mlp.shared_experts.linear_fc1/2
    (TP-split like a dense MLP), mlp.shared_expert_gate.weight [1, hidden] -> gate_weight.
`{expert}` is the global expert index e; EP rank r holds e = r * E/ep + e' (its local e').
Routed experts are split by expert tensor parallelism (ETP), not TP: the loader and the
export use `ModelDims.for_experts()` and the ETP group for per-expert rules.
The grouped-GEMM experts of Transformer Engine (`mlp.experts.linear_fc1.weight{e'}`) are
listed as alternative names.
"""
from .base import FamilyMapping, Rule
from .dense import (ATTN_OUT, EMBEDDING, FINAL_NORM, H, INPUT_NORM, L, MLP_NORM, OUTPUT,
                    QKV_BIAS, QKV_WEIGHT)
from .layouts import FUSED_GATE_UP, REPLICATED, ROW
from .qwen3 import K_NORM, Q_NORM

E = "mlp.experts.{expert}."

ROUTER = Rule((L + "mlp.router.weight",), (H + "mlp.gate.weight",), (("experts", "hidden"),),
              REPLICATED)

EXPERT_IN = Rule((L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                  L + "mlp.experts.linear_fc1.weight{expert}"),
                 (H + E + "gate_proj.weight", H + E + "up_proj.weight"),
                 (("moe_ffn", "hidden"), ("moe_ffn", "hidden")), FUSED_GATE_UP)

EXPERT_OUT = Rule((L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                   L + "mlp.experts.linear_fc2.weight{expert}"),
                  (H + E + "down_proj.weight",), (("hidden", "moe_ffn"),), ROW)

SHARED_IN = Rule((L + "mlp.shared_experts.linear_fc1.weight",),
                 (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"),
                 (("shared_ffn", "hidden"), ("shared_ffn", "hidden")), FUSED_GATE_UP)

SHARED_OUT = Rule((L + "mlp.shared_experts.linear_fc2.weight",),
                  (H + "mlp.shared_expert.down_proj.weight",), (("hidden", "shared_ffn"),), ROW)

SHARED_GATE = Rule((L + "mlp.shared_experts.gate_weight",), (H + "mlp.shared_expert_gate.weight",),
                   (("one", "hidden"),), REPLICATED)


def moe_rules(extra_attention=(), shared=()) -> tuple[Rule, ...]:
    """embedding, per layer [norm, qkv(, bias), *extra_attention, o_proj, norm, router,
    experts, *shared], norm, head."""
    return (EMBEDDING, INPUT_NORM, QKV_WEIGHT, QKV_BIAS, *extra_attention, ATTN_OUT, MLP_NORM,
            ROUTER, EXPERT_IN, EXPERT_OUT, *shared, FINAL_NORM, OUTPUT)


QWEN3_MOE = FamilyMapping("qwen3_moe", moe_rules((Q_NORM, K_NORM)))
QWEN2_MOE = FamilyMapping("qwen2_moe", moe_rules(shared=(SHARED_IN, SHARED_OUT, SHARED_GATE)))
