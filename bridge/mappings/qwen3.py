"""Qwen3 (Qwen3ForCausalLM): the dense table plus RMSNorm on q and k per head."""
from .base import FamilyMapping, Rule
from .dense import H, L, dense_rules
from .layouts import REPLICATED

Q_NORM = Rule((L + "self_attention.q_layernorm.weight",), (H + "self_attn.q_norm.weight",),
              (("head_dim",),), REPLICATED)
K_NORM = Rule((L + "self_attention.k_layernorm.weight",), (H + "self_attn.k_norm.weight",),
              (("head_dim",),), REPLICATED)

MAPPING = FamilyMapping("qwen3", dense_rules(Q_NORM, K_NORM))
