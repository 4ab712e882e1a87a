"""Supported Hugging Face model families and how their configs map to Megatron.

A family is a small declarative record; adding one (e.g. a MoE family) means
adding a record here and a weight mapping in `bridge/mappings/`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]   # HF `architectures` entries
    model_types: tuple[str, ...]     # HF `model_type` values
    qkv_bias: bool | None            # None: read `attention_bias` from the config
    qk_layernorm: bool               # Qwen3: RMSNorm on q and k per head
    moe: bool = False                # sparse MLP: routed experts (model/moe.py)
    shared_expert: bool = False      # Qwen2-MoE: an always-on expert behind a sigmoid gate
    vision: bool = False             # vision-language: HF vision tower + mrope (model/vision.py)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("LlamaForCausalLM",), ("llama",), qkv_bias=None, qk_layernorm=False),
    "qwen2": Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, qk_layernorm=False),
    "qwen3": Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qkv_bias=None, qk_layernorm=True),
    "qwen2_moe": Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), qkv_bias=True,
                        qk_layernorm=False, moe=True, shared_expert=True),
    "qwen3_moe": Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qkv_bias=None,
                        qk_layernorm=True, moe=True),
    # The language model is Qwen2's with multimodal rotary positions; the vision tower and
    # merger are HF's own modules on the first pipeline stage (model/vision.py).
    "qwen2_5_vl": Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), ("qwen2_5_vl",),
                         qkv_bias=True, qk_layernorm=False, vision=True),
    "qwen2_vl": Family("qwen2_vl", ("Qwen2VLForConditionalGeneration",), ("qwen2_vl",),
                       qkv_bias=True, qk_layernorm=False, vision=True),
}


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.architectures]


def detect_family(hf_config: dict) -> Family:
    """The family of an HF config dict; a clear error for anything else."""
    archs = hf_config.get("architectures") or []
    for family in FAMILIES.values():
        if any(a in family.architectures for a in archs):
            return family
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if not archs and model_type in family.model_types:
            return family
    raise ValueError(
        f"unsupported model architecture {archs or model_type!r} (config.json `architectures`"
        f" / `model_type`); supported architectures: {', '.join(supported_architectures())}")
