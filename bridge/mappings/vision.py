"""Qwen2.5-VL / Qwen2-VL: the Qwen2 table for the language model, the vision tower 1:1.

HF checkpoint (the released layout, which transformers 5 still saves):
    model.embed_tokens / model.layers.* / model.norm / lm_head   -> the dense (Qwen2) rules
    visual.<name>                                                -> visual.model.<name>
The vision tower is HF's own module inside the Megatron model (model/vision.py), replicated
on every TP rank of the first pipeline stage: each of its tensors is one unit with the
`Replicated` layout, owned by stage 0, streamed before the embedding. Its names and shapes
come from a meta-device tower built from config.json's `vision_config` (what transformers
saves), so no per-architecture table is needed. Checkpoints written with the in-memory
names (`model.language_model.*`, `model.visual.*`) load too (`hf_aliases`).
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from .base import FamilyMapping, Rule, Unit
from .dense import dense_rules
from .layouts import REPLICATED

MEGATRON_PREFIX = "visual.model."
HF_PREFIX = "visual."

# One rule stands for every vision tensor (the names come from the tower itself).
VISUAL = Rule((MEGATRON_PREFIX + "*",), (HF_PREFIX + "*",), (("hidden",),), REPLICATED)


def _vision_classes(family: str):
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import \
            Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import \
            Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import \
            Qwen2VisionTransformerPretrainedModel
        return Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel
    raise ValueError(f"model family {family!r} has no vision tower")


def build_hf_vision_tower(family: str, vision_config: dict, dtype: torch.dtype,
                          device: Optional[torch.device | str] = None) -> torch.nn.Module:
    """HF's vision tower (+ merger) of `family` from config.json's `vision_config`, with
    transformers' SDPA attention (what `from_pretrained` picks, so logits match HF's)."""
    config_cls, model_cls = _vision_classes(family)
    with torch.device(device or "cpu"):   # how Qwen2_5_VLModel itself builds its `visual`
        tower = model_cls._from_config(config_cls(**vision_config), attn_implementation="sdpa")
    return tower.to(dtype)


def hf_vision_shapes(family: str, vision_config: dict) -> dict[str, tuple[int, ...]]:
    """HF checkpoint name (`visual.*`) -> shape of every vision tensor, from a meta-device
    tower: the names and shapes transformers itself saves, whatever the architecture."""
    tower = build_hf_vision_tower(family, vision_config, torch.float32, device="meta")
    return {f"visual.{n}": tuple(t.shape) for n, t in tower.state_dict().items()}


@functools.lru_cache(maxsize=8)   # one meta-device tower per config, not one per lookup
def _vision_shapes(family: str, vision_config_json: str) -> tuple:
    return tuple(hf_vision_shapes(family, json.loads(vision_config_json)).items())


class VisionLanguageMapping(FamilyMapping):
    """The dense rules plus one replicated unit per HF vision tensor."""

    hf_aliases = (("model.language_model.", "model."), ("model.visual.", "visual."))
    # vLLM's Qwen2(.5)-VL (`hf_to_vllm_mapper`, 0.32) holds the language model as
    # `language_model.model.*` / `language_model.lm_head.*`; `visual.*` as the checkpoint.
    vllm_aliases = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))

    def _visual_units(self, args) -> dict[str, Unit]:
        """HF name -> unit of every vision tensor, in HF order."""
        shapes = _vision_shapes(self.name, json.dumps(args.hf_config["vision_config"],
                                                      sort_keys=True))
        # order (-1, i, ...): before the embedding's (0, ...), so owned by the first stage.
        return {name: Unit(VISUAL, None, (name,), (tuple(shape),), exported=True,
                           order=(-1, i, 0, 0)) for i, (name, shape) in enumerate(shapes)}

    def resolve(self, global_name, config, args, dims) -> Unit:
        if not global_name.startswith(MEGATRON_PREFIX):
            return super().resolve(global_name, config, args, dims)
        hf_name = HF_PREFIX + global_name[len(MEGATRON_PREFIX):]
        unit = self._visual_units(args).get(hf_name)
        if unit is not None:
            return unit
        raise ValueError(f"Megatron parameter {global_name!r}: the {self.name!r} vision tower "
                         f"of this config.json has no tensor {hf_name!r}")

    def units(self, config, args, dims) -> list[Unit]:
        return sorted(list(self._visual_units(args).values()) + super().units(config, args, dims),
                      key=lambda u: u.order)


QWEN2_5_VL = VisionLanguageMapping("qwen2_5_vl", dense_rules())
QWEN2_VL = VisionLanguageMapping("qwen2_vl", dense_rules())


def sync_filter(freeze_vit: bool, freeze_aligner: bool):
    """`include` for export_hf_weights in a weight sync: the vision tensors that do not train
    (--freeze_vit: the tower but its merger; --freeze_aligner: the merger) never change, and
    the engine loaded them from the checkpoint, so they are left out of the stream. None
    when everything is streamed."""
    if not (freeze_vit or freeze_aligner):
        return None

    def include(name: str) -> bool:
        if not name.startswith(HF_PREFIX):
            return True
        aligner = name[len(HF_PREFIX):].startswith("merger.")
        return not (freeze_aligner if aligner else freeze_vit)

    return include
