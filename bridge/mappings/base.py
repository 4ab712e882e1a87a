"""Declarative name/layout rules: one `Rule` per Megatron parameter kind, one
`FamilyMapping` (a tuple of rules) per model family.

    Rule(megatron=("decoder.layers.{layer}.mlp.linear_fc1.weight",),
         hf=("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
         shapes=(("ffn", "hidden"), ("ffn", "hidden")),
         layout=FUSED_GATE_UP)

`{layer}` is the GLOBAL layer index on both sides here (and `{expert}`, in MoE rules, the
global expert index: `bridge.params` turns an EP rank's local expert numbers into global ones): Megatron names its layers
per chunk (`decoder.layers.0` is the first layer of each pipeline chunk), and
`bridge.params` turns those local names into global ones before they reach a rule.
Shapes name `ModelDims` sizes, so one table serves every model size and TP degree.
Alternative Megatron names (the local layer spec vs Transformer Engine's fused
layer-norm linears) are listed in the same rule: whichever the model has is used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .layouts import Layout, ModelDims

LAYER = "{layer}"
EXPERT = "{expert}"


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter kind <-> the HF tensor(s) it is made of.

    megatron: alternative names of the parameter (first: local spec; others e.g. TE's).
    hf: HF names, in the order the layout's pieces index them.
    shapes: HF shape of each, as `ModelDims` size names.
    layout: how a TP shard is cut from the HF tensors.
    when: a condition name (see `FamilyMapping.conditions`); the rule applies only if true.
    tied_hf: for the output layer: with tied embeddings it is a copy of these HF tensors
        (loaded from them, never exported: the embedding rule exports them once).
    """

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    shapes: tuple[tuple[str, ...], ...]
    layout: Layout
    when: str | None = None
    tied_hf: tuple[str, ...] | None = None

    def __post_init__(self):
        if len(self.hf) != self.layout.num_hf or len(self.shapes) != len(self.hf):
            raise ValueError(f"rule {self.megatron[0]}: layout {type(self.layout).__name__} "
                             f"takes {self.layout.num_hf} HF tensors, got {len(self.hf)} names "
                             f"and {len(self.shapes)} shapes")

    @property
    def per_layer(self) -> bool:
        return LAYER in self.megatron[0]

    @property
    def per_expert(self) -> bool:
        """One parameter per routed expert: sharded by EP (which experts) and ETP."""
        return EXPERT in self.megatron[0]


@dataclass(frozen=True)
class Unit:
    """A rule applied to one layer (or to no layer): what load and export work on."""

    rule: Rule
    layer: int | None
    hf_names: tuple[str, ...]               # where the data comes from (tied: the embedding)
    hf_shapes: tuple[tuple[int, ...], ...]
    exported: bool                          # False for the tied copy of the embedding
    order: tuple[int, int, int, int]        # global HF order of units
    expert: int | None = None               # global expert index (per-expert rules)

    @property
    def layout(self) -> Layout:
        return self.rule.layout


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(re.escape(LAYER), r"(\d+)")
                      .replace(re.escape(EXPERT), r"(\d+)") + r"\Z")


@dataclass(frozen=True)
class FamilyMapping:
    """The rule table of one family, plus HF keys a checkpoint may carry that hold no weight."""

    name: str
    rules: tuple[Rule, ...]
    ignored_hf: tuple[str, ...] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
    _patterns: list = field(init=False, repr=False, compare=False)
    # (stored prefix, canonical prefix) of HF names some writers use (bridge.hf_checkpoint)
    hf_aliases = ()
    # (vLLM prefix, HF prefix): where vLLM's module names differ from the checkpoint's
    # (rollout/verify.py check_weight_sync reads vLLM's tensors back by name)
    vllm_aliases = ()

    def __post_init__(self):
        pats = [(_pattern(name), rule) for rule in self.rules for name in rule.megatron]
        object.__setattr__(self, "_patterns", pats)

    @property
    def first_layer_rule(self) -> int:
        """Index of the first per-layer rule: rules before it come before the layers."""
        return next(i for i, r in enumerate(self.rules) if r.per_layer)

    @staticmethod
    def conditions(config, args) -> dict[str, bool]:
        """Values of the `when` names rules may use."""
        return {"qkv_bias": bool(config.add_qkv_bias), "qk_layernorm": bool(config.qk_layernorm)}

    def active_rules(self, config, args) -> list[Rule]:
        cond = self.conditions(config, args)
        return [r for r in self.rules if r.when is None or cond[r.when]]

    def unit(self, rule: Rule, layer: int | None, dims: ModelDims, tied: bool,
             expert: int | None = None) -> Unit:
        """The unit of `rule` at global `layer` (and global `expert`, per-expert rules)."""
        names = rule.tied_hf if (tied and rule.tied_hf) else rule.hf

        def fill(n: str) -> str:
            if layer is not None:
                n = n.replace(LAYER, str(layer))
            return n.replace(EXPERT, str(expert)) if expert is not None else n

        shapes = tuple(tuple(dims.size(s) for s in shape) for shape in rule.shapes)
        index = self.rules.index(rule)
        order = ((self.first_layer_rule, layer, index, expert or 0) if layer is not None
                 else (index, 0, 0, 0))
        return Unit(rule, layer, tuple(fill(n) for n in names), shapes,
                    exported=not (tied and rule.tied_hf), order=order, expert=expert)

    def resolve(self, global_name: str, config, args, dims: ModelDims) -> Unit:
        """The unit of a Megatron parameter named with its GLOBAL layer index; an unknown
        name (or one whose rule is off for this config) raises."""
        active = self.active_rules(config, args)
        for pat, rule in self._patterns:
            m = pat.match(global_name)
            if m and rule in active:
                layer = int(m.group(1)) if rule.per_layer else None
                if layer is not None and not 0 <= layer < dims.layers:
                    break
                expert = int(m.group(2)) if rule.per_expert else None
                if expert is not None and not 0 <= expert < dims.experts:
                    break
                return self.unit(rule, layer, dims, args.tie_word_embeddings, expert)
        known = sorted({n for r in active for n in r.megatron})
        raise ValueError(f"Megatron parameter {global_name!r} has no rule in the {self.name!r} "
                         f"bridge mapping; known names: {known}")

    def units(self, config, args, dims: ModelDims) -> list[Unit]:
        """Every unit of the full model (all layers), in HF order."""
        out = []
        for rule in self.active_rules(config, args):
            if rule.tied_hf and args.tie_word_embeddings and \
                    config.pipeline_model_parallel_size == 1:
                continue  # one stage: Megatron reuses the embedding, no output parameter
            layers = range(dims.layers) if rule.per_layer else [None]
            experts = range(dims.experts) if rule.per_expert else [None]
            out.extend(self.unit(rule, layer, dims, args.tie_word_embeddings, expert)
                       for layer in layers for expert in experts)
        return sorted(out, key=lambda u: u.order)

    def manifest(self, config, args, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        """HF key -> shape of every tensor the HF checkpoint has, in HF order."""
        out: dict[str, tuple[int, ...]] = {}
        for unit in self.units(config, args, dims):
            if unit.exported:
                out.update(zip(unit.hf_names, unit.hf_shapes))
        return out

    def optional_hf(self, config, args) -> tuple[str, ...]:
        """Regexes of HF keys accepted on load and ignored: rotary caches, and `lm_head.weight`
        in a tied checkpoint (some writers keep it; the embedding is what the model uses)."""
        extra = tuple(re.escape(n) for r in self.rules if r.tied_hf and args.tie_word_embeddings
                      for n in r.hf)
        return tuple(self.ignored_hf) + extra
