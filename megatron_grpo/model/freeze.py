"""ms-swift's parameter freezing for full training (`--tuner_type full`), applied as
requires_grad before DDP wraps the chunks (its buffers and the optimizer then hold only what
trains), in ms-swift's order:

    --freeze_parameters_ratio R        the first R of the parameters' values, in model order
    --freeze_parameters P [P ...]      every parameter whose name starts with a prefix P
    --freeze_parameters_regex X        every parameter whose name X matches (re.search)
    --trainable_parameters P [P ...]   trains again what starts with P
    --trainable_parameters_regex X     trains again what X matches

The names are the Megatron model's, as ms-swift's Megatron path names them:
`embedding.word_embeddings.weight`, `decoder.layers.3.self_attention.linear_qkv.weight`,
`decoder.final_layernorm.weight`, `output_layer.weight` (a vision-language model:
`language_model.` before those, the tower under `visual.`), with the global numbers the
bridge gives them (bridge.params.global_params): a decoder layer has its index in the whole
model on every pipeline stage (Megatron numbers each stage's layers from 0:
`decoder.layers.0` of the second of two stages of 4 layers is layer 2 here), and an MoE
layer's expert its index among all experts. With tied embeddings
(one matrix for the input embedding and the output layer, two copies under pipeline
parallelism) a rule that names either name freezes both copies.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

import torch

from bridge.params import global_params, unwrap

_TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _aliases(name: str, tied: bool) -> List[str]:
    """The names a rule may give a parameter: a tied embedding's are both of its names."""
    for alias in _TIED:
        if tied and name.endswith(alias):
            stem = name[:-len(alias)]
            return [stem + a for a in _TIED]
    return [name]


def _global_numel(param: torch.nn.Parameter, tp: int) -> int:
    return param.numel() * (tp if getattr(param, "tensor_model_parallel", False) else 1)


def freeze_parameters(chunks, *, ratio: float = 0.0, prefixes: Sequence[str] = (),
                      regex: Optional[str] = None, trainable: Sequence[str] = (),
                      trainable_regex: Optional[str] = None, tp: int = 1) -> dict:
    """Apply the rules (module docstring) to this rank's chunks. Returns what a summary and
    the checks across ranks need: {"matched": the prefixes and regexes that named a
    parameter here, "frozen" / "total": parameter values frozen / in all here (a
    tensor-parallel shard counted as its whole: `tp`), "names": the first names here}."""
    named = list(global_params(chunks))
    tied = any(getattr(m, "share_embeddings_and_output_weights", False)
               for c in chunks for m in unwrap(c).modules())
    frozen = set()
    if ratio > 0:
        sizes = [_global_numel(p, tp) for _, p in named]
        budget, used = int(sum(sizes) * ratio), 0
        for (name, _), size in zip(named, sizes):
            if used + size > budget:
                break
            frozen.add(name)
            used += size
    matched = set()
    for rule_prefixes, rule_regex, freeze in ((prefixes, regex, True),
                                              (trainable, trainable_regex, False)):
        pattern = re.compile(rule_regex) if rule_regex else None
        for name, _ in named:
            names = _aliases(name, tied)
            hits = {p for p in rule_prefixes if any(n.startswith(p) for n in names)}
            if pattern is not None and any(pattern.search(n) for n in names):
                hits.add(rule_regex)
            if hits:
                (frozen.add if freeze else frozen.discard)(name)
                matched |= hits
    for name, param in named:
        param.requires_grad_(name not in frozen)
    return {"matched": matched,
            "frozen": sum(_global_numel(p, tp) for n, p in named if n in frozen),
            "total": sum(_global_numel(p, tp) for _, p in named),
            "names": [n for n, _ in named[:6]]}


def check_and_summarise(results: List[dict], rules: Dict[str, Sequence[str]]) -> str:
    """ValueError for a rule that named no parameter on any rank, or when nothing trains;
    else the summary line. `results`: freeze_parameters' of one model replica's ranks (each
    stage once); `rules`: option -> its prefixes / regexes."""
    matched = set().union(*(r["matched"] for r in results))
    for option, values in rules.items():
        for value in values:
            if value not in matched:
                names = [n for r in results for n in r["names"]][:6]
                raise ValueError(f"--{option} {value!r} names no parameter of the model. Its "
                                 f"names look like {', '.join(names)}, ... (model/freeze.py). "
                                 "Fix: a prefix (or regex) of those")
    frozen, total = sum(r["frozen"] for r in results), sum(r["total"] for r in results)
    if frozen >= total:
        raise ValueError(f"--{' --'.join(rules) or 'freeze_parameters_ratio'}: every parameter "
                         "is frozen, nothing would train. Fix: freeze less, or add "
                         "--trainable_parameters")
    return (f"frozen: {frozen:,} of {total:,} parameter values ({100 * frozen / total:.1f} %) "
            f"by {', '.join('--' + k for k in rules) or '--freeze_parameters_ratio'}")
