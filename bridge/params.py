"""This rank's Megatron parameters under global names (the process groups the bridge uses
are in bridge/groups.py).

Megatron names layers per chunk (`decoder.layers.0` is the first layer of every
pipeline chunk); the bridge's rules use global layer indices. The offset of a chunk
is Megatron's own: each `TransformerLayer.layer_number` is 1-based and global
(`get_transformer_layer_offset` + local index), so global = layer_number - 1.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from .moe import global_expert_name

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# In the name of every LoRA adapter parameter (megatron_grpo/model/lora.py names them so) and
# in no base parameter's: adapters are not tensors of the HF checkpoint.
ADAPTER_MARK = "_lora.lora_"
# PEFT's own LoRA layers (the vision tower's adapters, model/lora.py): the factors are
# `<linear>.lora_A.default.weight`, the wrapped base weight `<linear>.base_layer.weight`,
# which is the checkpoint's `<linear>.weight`.
PEFT_MARKS = (".lora_A.default.", ".lora_B.default.")
PEFT_BASE = ".base_layer."


def is_adapter_param(name: str) -> bool:
    return ADAPTER_MARK in name or any(m in name for m in PEFT_MARKS)


def base_name(name: str) -> str:
    """A parameter's name without PEFT's `.base_layer` (a wrapped linear's base weight)."""
    return name.replace(PEFT_BASE, ".")


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (GPTModel has a `decoder`)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def global_params(chunks) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every base parameter of this rank's chunks (global layer
    and, under expert parallelism, global expert numbers: bridge/moe.py; LoRA adapters are
    not HF checkpoint tensors: megatron_grpo/model/lora_peft.py moves them)."""
    for chunk in chunks:
        model = unwrap(chunk)
        layers = model.decoder.layers if hasattr(model, "decoder") else []
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                continue
            name = base_name(name)
            m = _LOCAL_LAYER.match(name)
            if m:
                layer = layers[int(m.group(1))].layer_number - 1
                name = f"decoder.layers.{layer}." + name[m.end():]
                name = global_expert_name(name, model.config)
            yield name, param
