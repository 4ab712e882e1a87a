"""Per-family weight mappings, keyed by the family name of `megatron_grpo.model.families`.

    from bridge.mappings import get_mapping
    mapping = get_mapping("qwen3")

Adding a family (e.g. a MoE one): write a table module like `qwen3.py` (new rules and
layouts where the dense ones do not fit) and `register_mapping(MAPPING)` it here.
"""
from __future__ import annotations

from .base import FamilyMapping, Rule, Unit
from .layouts import ModelDims, Piece, export_pieces
from . import llama, moe, qwen2, qwen3, vision

MAPPINGS: dict[str, FamilyMapping] = {}


def register_mapping(mapping: FamilyMapping, *, override: bool = False) -> FamilyMapping:
    if mapping.name in MAPPINGS and not override:
        raise ValueError(f"a bridge mapping for family {mapping.name!r} is already registered")
    MAPPINGS[mapping.name] = mapping
    return mapping


def get_mapping(family: str) -> FamilyMapping:
    """The mapping of `family` (a name, or a `Family` record)."""
    name = getattr(family, "name", family)
    if name not in MAPPINGS:
        raise ValueError(f"no bridge mapping for model family {name!r}; supported families: "
                         f"{sorted(MAPPINGS)}")
    return MAPPINGS[name]


for _module in (llama, qwen2, qwen3):
    register_mapping(_module.MAPPING)
for _mapping in (moe.QWEN3_MOE, moe.QWEN2_MOE, vision.QWEN2_5_VL, vision.QWEN2_VL):
    register_mapping(_mapping)

__all__ = ["FamilyMapping", "Rule", "Unit", "ModelDims", "Piece", "export_pieces", "MAPPINGS",
           "register_mapping", "get_mapping"]
