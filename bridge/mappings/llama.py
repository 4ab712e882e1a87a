"""Llama (LlamaForCausalLM): the plain dense table."""
from .base import FamilyMapping
from .dense import dense_rules

MAPPING = FamilyMapping("llama", dense_rules())
