"""LoRA adapters between Megatron (model/lora.py) and PEFT's files, and the merged stream.

    settings = peft_settings(adapter_dir)                  # LoraSettings of a PEFT adapter
    load_peft_adapter(chunks, adapter_dir)                 # each rank copies its slices
    factors = gather_adapters(chunks)                      # {PEFT key: full tensor}, every rank
    stream = merge_lora_stream(export_hf_weights(...), factors, settings)   # W + s B A
    for bucket in adapter_stream(chunks, bucket_size_bytes=64 << 20): ...  # adapter-only sync
    save_peft_adapter(out_dir, factors, settings, base_model=hf_dir)

PEFT's names (what `PeftModel.save_pretrained` writes and vLLM's LoRA loader reads):
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. Megatron holds them per HF target (model/lora.py), A or B
split over TP along the dimension its linear splits, so a rank's slice of a PEFT tensor
is an even split along one axis: rows of B (column-parallel: q/k/v, gate/up) or
columns of A (row-parallel: o_proj, down_proj).

Vision-language models (Qwen2.5-VL, settings.vision): transformers holds the language
model's layers as `model.language_model.layers.N` and the vision tower's MLP has its own
gate_proj / up_proj / down_proj, so PEFT on the HF model names the adapter
`base_model.model.model.language_model.layers.N...` and a plain target list would also
wrap the tower. The files therefore use those names (`_file_key`; our keys stay the
checkpoint's `model.layers.N`, as the bridge streams them) and write target_modules as a
regex over the language model's projections only; `peft_settings` reads it back.

--modules_to_save: PEFT saves the trained copy of a module under the base model's name,
`base_model.model.lm_head.weight` [vocab, hidden] (`...model.embed_tokens.weight`), and
loads it from there (peft 0.21). Megatron's parameter is vocab-parallel with padded rows:
rank r holds rows [r n, (r + 1) n) of the padded table, n = padded vocab / tp; the file has
the HF vocab rows only.

--tuner_type lora_llm (settings.train_vision): the trained vision tower and merger go in
the adapter file as PEFT's modules_to_save of `visual` (transformers' `model.visual`):
`base_model.model.model.visual.<HF name after visual.>`, written from the rank that holds
the tower (`vision_state`); `peft_settings` / `load_peft_adapter` read them back.

--tuner_type lora with --freeze_vit false / --freeze_aligner false (settings.tower /
settings.aligner): the tower's adapters are PEFT layers on HF's linears (model/lora.py), so
their PEFT keys are the HF model's: `base_model.model.model.visual.<linear>.lora_A.weight`,
replicated (no TP split), gathered from the first stage; target_modules adds a regex over
the wrapped tower linears (`_tower_regex`), which `peft_settings` reads back.

Merged sync: the bridge streams the base weights as always and each HF tensor a target
covers gets `W += scale * B @ A` in its bucket slot, in place (the slot is a reused
staging buffer, the model's own weights are not touched); the product is computed per
tensor, so no second copy of the model exists. The factors are small (r (in + out) per
target) and are gathered whole once per sync.

Adapter-only sync (--vllm_enable_lora): vLLM keeps the base weights it loaded at start
and gets only the factors, in PEFT names, gathered over TP factor by factor into buckets
(`adapter_stream`); vLLM's LoRA layers apply `scale * B (A x)` themselves. The language
model's factors only: the tower's adapters reach vLLM merged into its tower weights
(rollout/sync.py `WeightSync._sync_merged_tower`).
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterator

import torch
import torch.distributed as dist

from bridge.load import check_checkpoint, load_hf_weights

from ..config.groups import adapter_covers_tower
from .lora import (HF_MODULE, LoraSettings, adapters, apply_lora, lora_settings,
                   parse_modules_to_save, parse_target_modules, saved_params, tower_adapters,
                   unwrap)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(layer: int, target: str, factor: str) -> str:
    """PEFT's saved name of lora_A / lora_B of `target` in `layer`."""
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[target]}.{factor}.weight"


# --modules_to_save: Megatron parameter -> PEFT's key of its trained copy (text models).
SAVED_KEYS = {"embedding.word_embeddings.weight": "base_model.model.model.embed_tokens.weight",
              "output_layer.weight": "base_model.model.lm_head.weight"}


# lora_llm: PEFT's key prefix of the trained tower (modules_to_save "visual"), and the
# Megatron parameter prefix it stands for (model/vision.py: `visual.model.<HF name>`).
VISION_KEY, _VISION_PARAM, VISION_MODULE = "base_model.model.model.visual.", "visual.model.", "visual"


def _vision_params(chunks) -> list[tuple[str, torch.Tensor]]:
    """lora_llm: (PEFT key, parameter) of the trained vision tower on this rank (the first
    pipeline stage holds it, replicated over TP); [] elsewhere or without lora_llm."""
    if not getattr(lora_settings(chunks), "train_vision", False):
        return []
    return [(VISION_KEY + n[len(_VISION_PARAM):], p)
            for c in chunks for n, p in unwrap(c).named_parameters()
            if n.startswith(_VISION_PARAM)]


def vision_state(chunks) -> dict[str, torch.Tensor]:
    """lora_llm: {PEFT key: tensor} of the trained vision tower on this rank ({} elsewhere).
    Not collective."""
    return {key: p.detach().cpu() for key, p in _vision_params(chunks)}


def tower_key(name: str, factor: str) -> str:
    """PEFT's saved name of lora_A / lora_B of the tower linear `name` (inside the tower)."""
    return f"{VISION_KEY}{name}.{factor}.weight"


def _tower_linear(key: str) -> str | None:
    """The tower linear whose lora_A `key` names (tower_key's inverse); None for others."""
    end = ".lora_A.weight"
    return key[len(VISION_KEY):-len(end)] if key.startswith(VISION_KEY) and key.endswith(end) \
        else None


def _tower_params(chunks) -> list[tuple[str, torch.Tensor]]:
    """(PEFT key, factor parameter) of this rank's tower adapters (replicated over TP)."""
    return [(tower_key(name, factor), getattr(layer, factor)["default"].weight)
            for name, layer in tower_adapters(chunks) for factor in ("lora_A", "lora_B")]


def _tower_factors(chunks, source) -> dict[str, torch.Tensor]:
    """{PEFT key: tensor} of this rank's tower adapters (replicated: no gather)."""
    out = {}
    for key, p in _tower_params(chunks):
        t = source(p)
        out[key] = (torch.zeros_like(p) if t is None else t).cpu()
    return out


_TEXT_LAYERS = "base_model.model.model.layers."
_VL_LAYERS = "base_model.model.model.language_model.layers."


def _file_key(key: str, vision: bool) -> str:
    """Our PEFT key -> the adapter file's (vision-language: transformers' names)."""
    return _VL_LAYERS + key[len(_TEXT_LAYERS):] if vision and key.startswith(_TEXT_LAYERS) else key


def _vl_targets_regex(targets, tower: tuple[str, ...] = ()) -> str:
    """PEFT target_modules of a vision-language model: the language model's projections, and
    the tower's wrapped linears (names inside the tower, block numbers as \\d+)."""
    regex = r".*language_model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(targets) + ")"
    return regex + (_tower_regex(tower) if tower else "")


def _tower_regex(names) -> str:
    """`|.*visual\.(...)` over the tower linears `names` (e.g. blocks.0.attn.qkv)."""
    pats = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(n)) for n in names})
    return r"|.*visual\.(" + "|".join(pats) + ")"


def hf_weight_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{HF_MODULE[target]}.weight"


def peft_settings(adapter_dir: str, seed: int = 42) -> LoraSettings:
    """The LoraSettings of a PEFT LoRA adapter folder (--adapters)."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"--adapters {adapter_dir!r}: no {ADAPTER_CONFIG} there; pass a PEFT "
                         "LoRA adapter folder (adapter_config.json + adapter_model.safetensors)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"--adapters {adapter_dir!r}: peft_type {cfg.get('peft_type')!r}; "
                         "allowed: LORA")
    targets = cfg.get("target_modules") or ["all-linear"]
    tower = aligner = False
    if isinstance(targets, str) and targets != "all-linear":   # PEFT: a regex, full match
        tower, aligner = adapter_covers_tower(targets)
        targets = [t for t in HF_MODULE if any(re.fullmatch(targets, f"{prefix}.0.{HF_MODULE[t]}")
                                               for prefix in ("model.layers",
                                                              "model.language_model.layers"))]
    elif isinstance(targets, str):
        targets = [targets]
    else:   # PEFT matches names by suffix; it saves all-linear expanded to module paths
        targets = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    modules = cfg.get("modules_to_save") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    train_vision = VISION_MODULE in modules             # lora_llm's trained tower
    try:
        saved = parse_modules_to_save([m for m in modules if m != VISION_MODULE])
    except ValueError as e:
        raise ValueError(f"--adapters {adapter_dir!r}: {e}") from None
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"--adapters {adapter_dir!r}: bias {cfg['bias']!r}; allowed: none")
    # PEFT options that change the adapter's math or tensors (DoRA's magnitudes, per-module
    # ranks or alphas, LoRA biases, a subset of layers): not in model/lora.py's adapters, and
    # loading them as plain LoRA would train another model than the adapter's.
    unsupported = {k: cfg[k] for k in ("use_dora", "lora_bias", "alpha_pattern", "rank_pattern",
                                       "layers_to_transform", "layers_pattern", "use_qalora")
                   if cfg.get(k) not in (None, False, {}, [])}
    if unsupported:
        raise ValueError(f"--adapters {adapter_dir!r}: {ADAPTER_CONFIG} sets "
                         + ", ".join(f"{k} {v!r}" for k, v in unsupported.items())
                         + "; supported: plain LoRA (one r and lora_alpha for every target, "
                         "every layer; no DoRA, no LoRA bias)")
    return LoraSettings(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                        dropout=float(cfg.get("lora_dropout", 0.0)),
                        targets=parse_target_modules(targets),
                        rslora=bool(cfg.get("use_rslora", False)), seed=seed,
                        modules_to_save=saved, train_vision=train_vision, tower=tower,
                        aligner=aligner)


def _split_axis(kind: str, factor: str) -> int | None:
    """The axis along which TP splits a factor (None: replicated)."""
    if kind == "column":
        return 0 if factor == "lora_B" else None
    return 1 if factor == "lora_A" else None


def load_peft_adapter(chunks, adapter_dir: str) -> None:
    """Copy a PEFT adapter's tensors into the adapters of `chunks` (this rank's slices).
    Every expected tensor must be there with its shape; one ValueError lists problems."""
    from safetensors import safe_open
    from megatron.core import parallel_state as ps

    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise ValueError(f"--adapters {adapter_dir!r}: no {ADAPTER_WEIGHTS} there")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    vision = bool(getattr(lora_settings(chunks), "vision", False))
    work, expected = [], {}
    for layer, _, adapter in adapters(chunks):
        for factor in ("lora_A", "lora_B"):
            for target, param in getattr(adapter, factor).items():
                axis = _split_axis(adapter.kind, factor)
                shape = list(param.shape)
                if axis is not None:
                    shape[axis] *= tp
                key = _file_key(peft_key(layer, target, factor), vision)
                expected[key] = tuple(shape)
                work.append((key, param, axis))
    saved = []
    for name, param in saved_params(chunks):   # vocab-parallel, padded rows
        key, vocab = SAVED_KEYS[name], param.lora_saved[1]
        expected[key] = (vocab, param.shape[1])
        saved.append((key, param))
    tower = _vision_params(chunks) + _tower_params(chunks)
    expected.update({k: tuple(p.shape) for k, p in tower})
    with safe_open(path, framework="pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        # Other stages' layers are in the file too: check only this rank's keys.
        check_checkpoint({k: v for k, v in found.items() if k in expected}, expected,
                         where=f"PEFT adapter {adapter_dir!r}")
        with torch.no_grad():
            for key, param, axis in work:
                full = f.get_tensor(key)
                if axis is not None:
                    n = param.shape[axis]
                    full = full.narrow(axis, tp_rank * n, n)
                param.copy_(full)
            for key, param in saved:
                rows = param.shape[0]
                full = f.get_tensor(key)[tp_rank * rows:(tp_rank + 1) * rows]
                param.zero_()            # vocab padding rows: no data, zero as the bridge does
                param[:full.shape[0]].copy_(full)
            for key, param in tower:
                param.copy_(f.get_tensor(key))


def gather_adapters(chunks, source=None) -> dict[str, torch.Tensor]:
    """{PEFT key: full factor} of the whole model on every rank (CPU tensors), with the
    --modules_to_save tensors (HF vocab rows) under their PEFT keys.

    TP: the split factor is all-gathered along its axis; PP: each stage's factors travel
    to every stage (all_gather_object over the pipeline group). `source(param)` picks
    what to gather (default the data; `lambda p: p.main_grad` gathers gradients).
    LOCKSTEP: collective over the TP and PP groups."""
    from megatron.core import parallel_state as ps

    source = source or (lambda p: p.detach())
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    for layer, _, adapter in adapters(chunks):
        for factor in ("lora_A", "lora_B"):
            for target, param in getattr(adapter, factor).items():
                t = source(param)
                t = torch.zeros_like(param) if t is None else t.contiguous()
                axis = _split_axis(adapter.kind, factor)
                if axis is not None and tp > 1:
                    parts = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(parts, t, group=tp_group)
                    t = torch.cat(parts, dim=axis)
                local[peft_key(layer, target, factor)] = t.cpu()
    for name, param in saved_params(chunks):   # vocab-parallel: rows over TP, padding cut
        t = source(param)
        t = torch.zeros_like(param) if t is None else t.contiguous()
        if tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
            t = torch.cat(parts)
        local[SAVED_KEYS[name]] = t[:param.lora_saved[1]].cpu()
    local.update(_tower_factors(chunks, source))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        everything = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(everything, local, group=ps.get_pipeline_model_parallel_group())
        local = {k: v for part in everything for k, v in part.items()}
    return local


def delta(factors: dict[str, torch.Tensor], settings: LoraSettings, layer: int,
          target: str) -> torch.Tensor | None:
    """scale * B @ A of one target [out, in] in float32, or None when not adapted."""
    return _product(factors, settings, peft_key(layer, target, "lora_A"))


def _product(factors, settings: LoraSettings, a_key: str) -> torch.Tensor | None:
    """scale * B @ A [out, in] (float32) of the factors under `a_key` and its lora_B twin."""
    a = factors.get(a_key)
    if a is None:
        return None
    b = factors[a_key.replace(".lora_A.", ".lora_B.")]
    return (b.float() @ a.float()) * settings.scale


def merge_lora_stream(stream, factors: dict[str, torch.Tensor], settings: LoraSettings
                      ) -> Iterator[list]:
    """The bridge stream with `W + scale * B @ A` in place of every adapted HF weight
    (in the bucket's own slot; float32 product, cast to the stream's dtype)."""
    by_name = {}   # HF weight name -> its lora_A key
    for key in factors:
        linear = _tower_linear(key)
        if linear is not None:
            by_name[f"visual.{linear}.weight"] = key
        elif key.endswith("lora_A.weight"):
            parts = key.split(".")                  # base_model.model.model.layers.N.mod.proj...
            by_name[hf_weight_name(int(parts[4]), parts[6])] = key
    for bucket in stream:
        for name, tensor in bucket:
            hit = by_name.get(name)
            if hit is not None:
                d = _product(factors, settings, hit).to(tensor.device)
                tensor.copy_((tensor.float() + d).to(tensor.dtype))
        yield bucket


def merged_stream(chunks, stream) -> Iterator[list]:
    """`stream` (the bridge's export of `chunks`) merged with their adapters, if any.
    LOCKSTEP: gathers the adapters (collective) when the model has any."""
    settings = lora_settings(chunks)
    if settings is None:
        return stream
    return merge_lora_stream(stream, gather_adapters(chunks), settings)


def adapter_stream(chunks, bucket_size_bytes: int = 64 << 20) -> Iterator[list]:
    """Buckets of (PEFT key, full factor) of the whole model, on every rank, each bucket
    about `bucket_size_bytes` (at least one tensor). TP: a split factor is all-gathered
    along its axis when it is reached (one factor at a time); PP: each stage makes its
    own buckets, and bucket i of every stage travels to every stage together
    (all_gather_object over the pipeline group), so at most PP buckets are held at once.
    LOCKSTEP: collective over the TP and PP groups; iterate to the end on every rank."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()

    def local_buckets():
        bucket, size = [], 0
        for layer, _, adapter in adapters(chunks):
            for target in adapter.lora_A:
                for factor in ("lora_A", "lora_B"):
                    t = getattr(adapter, factor)[target].detach().contiguous()
                    axis = _split_axis(adapter.kind, factor)
                    if axis is not None and tp > 1:
                        parts = [torch.empty_like(t) for _ in range(tp)]
                        dist.all_gather(parts, t, group=tp_group)
                        t = torch.cat(parts, dim=axis)
                    bucket.append((peft_key(layer, target, factor), t))
                    size += t.numel() * t.element_size()
                    if size >= bucket_size_bytes:
                        yield bucket
                        bucket, size = [], 0
        if bucket:
            yield bucket

    if pp == 1:
        yield from local_buckets()
        return
    mine = local_buckets()
    while True:
        part = next(mine, None)
        if part is not None:
            part = [(k, v.cpu()) for k, v in part]
        everything = [None] * pp
        dist.all_gather_object(everything, part, group=ps.get_pipeline_model_parallel_group())
        if all(p is None for p in everything):
            return
        yield [item for p in everything if p for item in p]


def peft_config(settings: LoraSettings, base_model: str | None = None) -> dict:
    """adapter_config.json of `settings`, as PEFT writes it (vLLM reads the same keys)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": list(settings.targets), "use_rslora": settings.rslora,
            "bias": "none", "fan_in_fan_out": False,
            "modules_to_save": (list(settings.modules_to_save)
                                + [VISION_MODULE] * settings.train_vision) or None,
            "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def save_peft_adapter(out_dir: str, factors: dict[str, torch.Tensor], settings: LoraSettings,
                      base_model: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Write `out_dir/adapter_config.json` + `adapter_model.safetensors` as PEFT does."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    config = peft_config(settings, base_model)
    if settings.vision:     # the language model (and the tower's wrapped linears)
        tower = sorted(n for n in map(_tower_linear, factors) if n is not None)
        config["target_modules"] = _vl_targets_regex(settings.targets, tuple(tower))
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {_file_key(k, settings.vision): (v.to(dtype) if dtype else v).contiguous()
               for k, v in factors.items()}
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def prepare_lora_export(chunks, config, args, lora: dict, base_model: str | None) -> None:
    """`megatron export --to_hf` of a LoRA training checkpoint (adapters only): load the base
    HF weights into `chunks` and add the adapters the checkpoint's metadata describes; the
    caller then loads the adapters from the checkpoint. base_model: --model, else the run's."""
    base = base_model or lora.get("base_model")
    if not base or not os.path.isdir(base):
        raise ValueError(f"--model {base!r}: a LoRA checkpoint holds adapters only; pass the "
                         "base HF model folder the run trained on with --model")
    load_hf_weights(chunks, config, args, base)
    fields = {k: v for k, v in lora.items() if k in LoraSettings.__dataclass_fields__}
    fields["targets"] = tuple(fields.get("targets", ()))
    fields["modules_to_save"] = tuple(fields.get("modules_to_save", ()))
    apply_lora(chunks, config, args, LoraSettings(**fields))
