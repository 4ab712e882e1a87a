"""HF safetensors -> this rank's sharded Megatron parameters, in place.

    config, args = build_transformer_config(hf_dir, tp=2, pp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, hf_dir)

Each rank reads only the blocks its own chunks hold (its pipeline stage's layers, its
TP slice of each tensor). Nothing is copied until the whole checkpoint has been
checked against the model: every problem (missing, unexpected and mis-shaped tensors)
is reported in one ValueError. No collective is involved: every rank checks the same
headers and fails the same way, so a bad checkpoint cannot hang the others.
"""
from __future__ import annotations

import os
import re

import torch

from .hf_checkpoint import HFCheckpoint
from .mappings import ModelDims, get_mapping
from .params import global_params

_MAX_LISTED = 50


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f", ... and {more} more" if more > 0 else "")


def check_checkpoint(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                     optional: tuple[str, ...] = (), where: str = "checkpoint") -> None:
    """Raise one ValueError listing missing, unexpected and mis-shaped tensors (if any)."""
    tolerated = [re.compile(p + r"\Z") for p in optional]
    missing = [n for n in expected if n not in found]
    unexpected = sorted(n for n in found if n not in expected
                        and not any(p.match(n) for p in tolerated))
    misshaped = [f"{n} expected {tuple(expected[n])} found {tuple(found[n])}"
                 for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    if not (missing or unexpected or misshaped):
        return
    parts = [f"{where} does not match the model ({len(missing)} missing, {len(unexpected)} "
             f"unexpected, {len(misshaped)} mis-shaped tensors):"]
    if missing:
        parts.append(f"  missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        parts.append(f"  unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    if misshaped:
        parts.append(f"  mis-shaped tensors ({len(misshaped)}): {_listing(misshaped)}")
    raise ValueError("\n".join(parts))


def manifest(config, args) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every tensor the HF checkpoint of this model has, in HF order."""
    return get_mapping(args.family).manifest(config, args, ModelDims.from_config(config, args))


def _check_architecture(hf_dir: str, family) -> None:
    """The checkpoint's config.json, read by transformers' AutoConfig as the model builder
    reads it, names one of the architectures of the family the model was built as
    (`family.name`, `family.architectures`)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        return
    try:
        archs = AutoConfig.from_pretrained(hf_dir).architectures or []
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"checkpoint {hf_dir!r}: transformers cannot read its config.json "
                         f"({e}); the Megatron model was built as {family.name} "
                         f"({', '.join(family.architectures)})") from None
    if archs and not set(archs) & set(family.architectures):
        raise ValueError(f"checkpoint {hf_dir!r} is a {'/'.join(archs)} model (config.json "
                         f"`architectures`) but the Megatron model was built as {family.name} "
                         f"({', '.join(family.architectures)})")


def load_hf_weights(chunks, config, args, hf_dir: str | os.PathLike) -> None:
    """Copy the HF checkpoint in `hf_dir` into `chunks` (this rank's GPTModel chunks)."""
    from megatron.core import parallel_state as ps

    hf_dir = os.fspath(hf_dir)
    _check_architecture(hf_dir, args.family)
    mapping = get_mapping(args.family)
    dims = ModelDims.from_config(config, args)
    tp_rank = ps.get_tensor_model_parallel_rank()
    # Routed experts are split by expert tensor parallelism (and only this EP rank's
    # experts are among the parameters): their own rank and dims.
    etp_rank = ps.get_expert_tensor_parallel_rank() if dims.experts else tp_rank

    with HFCheckpoint(hf_dir, mapping.hf_aliases) as ckpt:
        check_checkpoint(ckpt.shapes(), mapping.manifest(config, args, dims),
                         mapping.optional_hf(config, args), where=f"HF checkpoint {hf_dir!r}")
        # Resolve every parameter before copying any: an unknown name or a model built for
        # another shape must not leave a half-loaded model behind.
        work = []
        for name, param in global_params(chunks):
            unit = mapping.resolve(name, config, args, dims)
            udims, rank = (dims.for_experts(), etp_rank) if unit.rule.per_expert else (dims, tp_rank)
            shard = unit.layout.shard_shape(udims, unit.hf_shapes)
            if tuple(param.shape) != shard:
                raise ValueError(f"Megatron parameter {name} has shape {tuple(param.shape)}, but "
                                 f"the {mapping.name} mapping expects {shard} at tp={udims.tp}: "
                                 "the model was not built from this checkpoint's config")
            work.append((unit, param, udims, rank))

        with torch.no_grad():
            for unit, param, udims, rank in work:
                pieces = unit.layout.pieces(rank, udims, unit.hf_shapes)
                axis = pieces[0].axis if pieces else 0
                covered = sum(p.shard_stop - p.shard_start for p in pieces)
                if axis is not None and covered < param.shape[axis]:
                    param.zero_()  # vocab padding rows: no HF data, keep them zero
                for p in pieces:
                    block = ckpt.read(unit.hf_names[p.hf], p.axis, p.hf_start, p.hf_stop)
                    dst = param if p.axis is None else \
                        param.narrow(p.axis, p.shard_start, p.shard_stop - p.shard_start)
                    dst.copy_(block)
