"""Qwen2 (Qwen2ForCausalLM): the dense table; q/k/v carry biases (config add_qkv_bias)."""
from .base import FamilyMapping
from .dense import dense_rules

MAPPING = FamilyMapping("qwen2", dense_rules())
