"""LoRA adapters on Megatron-Core's own tensor-parallel linears.

    settings = LoraSettings(rank=8, alpha=16, targets=parse_target_modules(["all-linear"]))
    apply_lora(chunks, config, args, settings)    # before wrap_ddp: base frozen, adapters added
    with adapters_disabled(chunks):               # the reference policy: the base model
        ...

For every targeted HF projection W [out, in] the model computes, as PEFT does,

    y = W x + scale * B (A dropout(x)),   A [r, in], B [out, r],
    scale = alpha / r   (rslora: alpha / sqrt(r)),

with B = 0 at the start (the model starts as the base) and A drawn like PEFT's
(kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))).

Megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`; the adapters are
kept per HF target (q_proj, k_proj, ... each its own A and B), so a PEFT adapter maps
one to one and no rank mixes targets. Each target's B @ A output is placed into the
fused output layout of its linear (per query group `[q heads, k, v]`; `[gate; up]`).

Tensor parallelism (no full-size matrix is gathered):
- column-parallel linear (qkv, fc1; output split over TP): A [r, in] replicated, B
  [out/tp, r] split like the output. Without sequence parallelism `a = A x` is the same
  on every rank; `copy_to_tensor_model_parallel_region(a)` all-reduces its gradient, so
  grad A and the input gradient through the adapter are complete on every rank. With
  sequence parallelism each rank computes `a` for its sequence slice and all-gathers
  the [s, b, r] activations; grad A is then partial per rank and tagged
  `sequence_parallel` (summed over TP by Megatron's finalize_model_grads, like the norms).
- row-parallel linear (proj, fc2; input split over TP): A [r, in/tp] split like the
  input, B [out, r] replicated. `a = sum over ranks A_r x_r` is an all-reduce of
  [s, b, r] (reduce-scatter over the sequence with SP; B's gradient then partial and
  tagged `sequence_parallel`).

Adapters live beside the linear they wrap, as `<linear>_lora` (e.g.
`self_attention.linear_qkv_lora.lora_B.q_proj`), so the base parameters keep their
names and the bridge's tables; `is_adapter_param` tells them apart. Their sharded state
dict (checkpoints) is TP-independent: B of a column-parallel linear and A of a
row-parallel one are saved as slices of the full HF-shaped factor.

--modules_to_save (PEFT's ModulesToSaveWrapper): `embed_tokens` and/or `lm_head` train in
full beside the adapters. Megatron's own parameter (`embedding.word_embeddings.weight`,
`output_layer.weight`, vocab-parallel) is unfrozen before DDP, so it gets gradients and
optimizer state, is saved with the adapters, and the bridge exports it as it is (merged
sync: automatic). The original weights are kept as a frozen clone beside it
(`param.lora_original`, one extra copy of that module's shard, as PEFT keeps
`original_module`) and `adapters_disabled` swaps them in: the reference policy is the base.
Tied embeddings (tie_word_embeddings) are refused.

--tuner_type lora_llm (ms-swift's name; vision-language models, `train_vision`): the
adapters on the language model as above, and the whole vision tower, merger included,
trained in full beside them (ms-swift's `_prepare_full_vit`: `requires_grad` on
`visual.*`, whatever --freeze_vit / --freeze_aligner say). The tower's parameters are
saved with the adapters (`is_lora_state`) and streamed by every sync; no original copy is
kept: as in ms-swift, whose reference policy is the same model with the adapters
disabled, the reference sees the trained tower.

--tuner_type lora with --freeze_vit false / --freeze_aligner false (ms-swift's meaning: its
`all-linear` regex, `get_multimodal_target_regex`, then covers the vision tower's and/or the
merger's linears; `settings.tower` / `settings.aligner`): PEFT's own LoRA layers on HF's
`nn.Linear`s inside the tower (`peft.inject_adapter_in_model` on `visual.model`), same rank,
alpha, dropout and rslora as the language model's. Each wrapped linear's base weight
becomes `<linear>.base_layer.weight` (the bridge strips `.base_layer`: bridge/params.py)
and its factors `<linear>.lora_A.default.weight` / `lora_B` (PEFT's names with the
adapter name, which PEFT's files drop). The tower is replicated over TP, so are its
adapters: A is redrawn like the language model's (seeded by the module's name: equal on
every rank), B = 0, and they are tagged `average_gradients_across_tp_domain` like the
tower's own parameters (HuggingFaceModule tags only what exists when it is set). The
reference policy turns them off with PEFT's `enable_adapters(False)` (PeftModel's
`disable_adapter`), the requires_grad flags put back after. With dropout > 0 each TP rank
draws its own masks in the tower too (its outputs then differ slightly over TP, as any
per-rank dropout).

Simplifications: the local layer spec only (Transformer Engine's fused layer-norm
linears take the un-normed input); no k/v adapters when kv heads are replicated
(fewer kv heads than TP); with dropout > 0 the masks are drawn per rank (still a
dropout, but not bit-equal to TP=1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bridge.params import ADAPTER_MARK as _MARK, is_adapter_param, unwrap  # noqa: F401


from ..config.groups import LORA_TARGET_MODULES as HF_TARGETS  # PEFT names, HF order
# The HF module path of each target inside `model.layers.N`.
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
             "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
             "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
# Megatron linear (path inside a TransformerLayer) -> (parallel kind, HF targets it fuses).
LINEARS = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
# --modules_to_save: PEFT's module name -> the Megatron parameter trained in full.
SAVED_MODULES = {"embed_tokens": "embedding.word_embeddings.weight",
                 "lm_head": "output_layer.weight"}


# The vision tower's parameters (and state-dict keys) in a vision-language model.
VISION_PREFIX = "visual."


def parse_modules_to_save(values) -> tuple[str, ...]:
    """--modules_to_save (or an adapter_config's; PEFT matches by the name's last part)
    -> the allowed module names, in SAVED_MODULES order."""
    values = [values] if isinstance(values, str) else list(values or [])
    names = [str(v).rsplit(".", 1)[-1] for v in values]
    bad = [v for v, n in zip(values, names) if n not in SAVED_MODULES]
    if bad:
        raise ValueError(f"--modules_to_save {' '.join(map(str, values))}: {bad} not supported; "
                         f"allowed: any of {' '.join(SAVED_MODULES)}")
    return tuple(m for m in SAVED_MODULES if m in names)


def parse_target_modules(values) -> tuple[str, ...]:
    """--target_modules: `all-linear` or PEFT names -> the HF targets, in HF order."""
    values = [values] if isinstance(values, str) else list(values or ["all-linear"])
    if "all-linear" in values:
        return HF_TARGETS
    unknown = [v for v in values if v not in HF_TARGETS]
    if unknown:
        raise ValueError(f"--target_modules {' '.join(values)}: {unknown} not supported; allowed: "
                         f"all-linear or any of {', '.join(HF_TARGETS)}")
    return tuple(t for t in HF_TARGETS if t in values)


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = HF_TARGETS
    rslora: bool = False
    seed: int = 42
    modules_to_save: tuple[str, ...] = ()
    # The base is a vision-language model (set by apply_lora): its PEFT files name the
    # language model's layers as transformers holds them (model/lora_peft.py).
    vision: bool = False
    # --tuner_type lora_llm: the vision tower and merger (`visual.*`) train in full.
    train_vision: bool = False
    # --tuner_type lora with --freeze_vit false: adapters on the tower's linears (not the
    # merger's); --freeze_aligner false: on the merger's.
    tower: bool = False
    aligner: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rslora."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _init_a(settings: LoraSettings, layer: int, target: str, in_features: int) -> torch.Tensor:
    """The full A [r, in] of one target, PEFT's kaiming-uniform(a=sqrt(5)) bound 1/sqrt(in),
    from a generator seeded by (seed, layer, target): the same on every rank and at any TP."""
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + layer * 101
                                        + zlib.crc32(target.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(settings.rank, in_features, generator=gen) * 2 - 1) * bound


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: per HF target t, lora_A[t] and lora_B[t].

    forward(x) returns scale * sum_t B_t A_t x in the base linear's local output layout
    (module docstring); `enabled = False` makes the wrapped linear the base one.
    """

    def __init__(self, kind: str, targets: dict[str, tuple[int, int]], settings: LoraSettings,
                 config, layer: int, qkv_groups: tuple[int, int, int] | None,
                 fc1_rows: int | None, dtype, device):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        tp, tp_rank = _tp()
        self.kind, self.scale, self.enabled = kind, settings.scale, True
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        self.qkv_groups = qkv_groups          # (local groups, q rows per group, head_dim)
        self.fc1_rows = fc1_rows              # gate (= up) rows of this rank in linear_fc1
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else None
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        r = settings.rank
        for t, (out_f, in_f) in targets.items():
            a = _init_a(settings, layer, t, in_f)
            if kind == "column":   # A replicated, B split over the output
                b = torch.zeros(out_f // tp, r)
            else:                  # A split over the input, B replicated
                a = a[:, tp_rank * (in_f // tp):(tp_rank + 1) * (in_f // tp)]
                b = torch.zeros(out_f, r)
            self.lora_A[t] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.lora_B[t] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            split = self.lora_B[t] if kind == "column" else self.lora_A[t]
            set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
            partial = self.lora_A[t] if kind == "column" else self.lora_B[t]
            setattr(partial, "sequence_parallel", self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpm

        if self.dropout is not None:
            x = self.dropout(x)
        names = list(self.lora_A)
        A = torch.cat([self.lora_A[t] for t in names])             # [n*r, in(/tp)]
        a = F.linear(x, A)                                         # [s(/tp), b, n*r]
        if self.kind == "column":
            a = (tpm.gather_from_sequence_parallel_region(a) if self.sequence_parallel
                 else tpm.copy_to_tensor_model_parallel_region(a))
        else:
            a = (tpm.reduce_scatter_to_sequence_parallel_region(a) if self.sequence_parallel
                 else tpm.reduce_from_tensor_model_parallel_region(a))
        outs = {t: F.linear(part, self.lora_B[t]) * self.scale
                for t, part in zip(names, a.split(self.lora_A[names[0]].shape[0], dim=-1))}
        return self._fuse(outs, a.shape[:-1], a)

    def _fuse(self, outs: dict[str, torch.Tensor], lead, like) -> torch.Tensor:
        """Place each target's output into the base linear's local output layout."""
        def get(t, rows):
            return outs[t] if t in outs else like.new_zeros(*lead, rows)

        if self.qkv_groups is not None:   # linear_qkv: per local group [q rows, k, v]
            g, q_rows, d = self.qkv_groups
            q = get("q_proj", g * q_rows).reshape(*lead, g, q_rows)
            k = get("k_proj", g * d).reshape(*lead, g, d)
            v = get("v_proj", g * d).reshape(*lead, g, d)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, g * (q_rows + 2 * d))
        if self.fc1_rows is not None:     # linear_fc1: [gate rows; up rows] of this rank
            return torch.cat([get("gate_proj", self.fc1_rows), get("up_proj", self.fc1_rows)],
                             dim=-1)
        return next(iter(outs.values()))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """A checkpoint layout that does not depend on TP: split factors as slices of the
        full HF-shaped factor, replicated ones once."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = 0 if self.kind == "column" else 1
        split = "lora_B" if self.kind == "column" else "lora_A"
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {k: axis for k in state if k.startswith(split + ".")}, sharded_offsets)


def _wrap_forward(linear, adapter: LoraAdapter) -> None:
    """linear(x) -> (base output + adapter(x) when enabled, bias)."""
    base_forward = linear.forward

    def forward(x, *a, **kw):
        out, bias = base_forward(x, *a, **kw)
        if adapter.enabled:
            out = out + adapter(x).to(out.dtype)
        return out, bias

    linear.forward = forward


def _resolve(module, path: str):
    parent = module
    *head, last = path.split(".")
    for p in head:
        parent = getattr(parent, p)
    return parent, last


def apply_lora(chunks, config, args, settings: LoraSettings) -> list[str]:
    """Freeze every parameter of `chunks` and add adapters for `settings.targets` to every
    layer (before DDP wrapping: Megatron's DDP buffers hold trainable parameters only).
    Returns the names of the adapter parameters added (this rank's, local names)."""
    _check_layer_spec(chunks)
    settings = dataclasses.replace(settings, vision=bool(getattr(args.family, "vision", False)))
    tp, _ = _tp()
    kv_heads = args.hf_config.get("num_key_value_heads") or config.num_attention_heads
    saved = {SAVED_MODULES[m] for m in settings.modules_to_save}
    _check_lora_options(chunks, args, settings, tp, kv_heads, saved)
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
    added = _train_in_full(chunks, settings, saved, args)
    added += _add_decoder_adapters(chunks, config, settings, _target_shapes(config, kv_heads), tp)
    if settings.tower or settings.aligner:
        if not settings.vision:
            raise ValueError("--freeze_vit false / --freeze_aligner false with --tuner_type lora "
                             f"put adapters on a vision tower; the model ({args.family.name}) "
                             "has none. Fix: keep the defaults (true, true)")
        for c in chunks:
            added += _add_tower_adapters(unwrap(c), settings)
    for c in chunks:
        unwrap(c).lora_settings = settings
    return added


def _check_layer_spec(chunks) -> None:
    """LoRA wraps the local layer spec's linears; Transformer Engine's fused
    layer-norm linears have no such linear to wrap, so they are refused."""
    if any(hasattr(getattr(layer.self_attention, "linear_qkv", None), "layer_norm_weight")
            for c in chunks for layer in unwrap(c).decoder.layers):
        raise ValueError("--tuner_type lora: the Transformer Engine layer spec is not supported "
                         "yet (LoRA wraps the local spec's linears); run without Transformer "
                         "Engine")


def _check_lora_options(chunks, args, settings: LoraSettings, tp: int, kv_heads: int,
                        saved: set) -> None:
    """Refuse the LoRA options this model or layout cannot honour, before any parameter is
    frozen: k/v adapters on replicated kv heads, --modules_to_save with tied embeddings,
    lora_llm without a vision tower."""
    if kv_heads < tp and {"k_proj", "v_proj"} & set(settings.targets):
        raise ValueError(f"--target_modules k_proj/v_proj with --tensor_model_parallel_size {tp} "
                         f"above the model's {kv_heads} kv heads (replicated kv heads) is not "
                         "supported yet; use --target_modules without k_proj v_proj, or a "
                         f"tensor parallel size <= {kv_heads}")
    if saved and any(getattr(unwrap(c), "share_embeddings_and_output_weights", False)
                     for c in chunks):
        raise ValueError(f"--modules_to_save {' '.join(settings.modules_to_save)} with a model "
                         "that ties lm_head to embed_tokens (tie_word_embeddings) is not "
                         "supported; allowed: untied models. Fix: drop --modules_to_save")
    if settings.train_vision and not settings.vision:
        raise ValueError("--tuner_type lora_llm trains the vision tower beside the adapters; "
                         f"the model ({args.family.name}) has none. Fix: --tuner_type lora")


def _target_shapes(config, kv_heads: int) -> dict:
    """HF target module -> (out, in) of its full (unsplit) weight."""
    heads, d = config.num_attention_heads, config.kv_channels
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    return {"q_proj": (heads * d, hidden), "k_proj": (kv_heads * d, hidden),
            "v_proj": (kv_heads * d, hidden), "o_proj": (hidden, heads * d),
            "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}


def _train_in_full(chunks, settings: LoraSettings, saved: set, args) -> list[str]:
    """Unfreeze what trains whole beside the adapters; returns those parameters' names.
    lora_llm: the vision tower and merger (no original kept). --modules_to_save: the
    embedding / output layer, each with its original kept for the reference policy."""
    added = []
    for c in chunks:
        for name, p in unwrap(c).named_parameters():
            if settings.train_vision and name.startswith(VISION_PREFIX):
                p.requires_grad_(True)
                added.append(name)
    for c in chunks:
        model = unwrap(c)
        found = set()
        for name, p in model.named_parameters():
            if name in saved:
                p.requires_grad_(True)
                p.lora_original = p.detach().clone()
                p.lora_saved = (name, args.vocab_size)   # for lora_peft: name, HF rows
                added.append(name)
                found.add(name)
        # the stage that holds the embedding (output layer) must have it under that name
        want = {n for n, stage in ((SAVED_MODULES["embed_tokens"], "pre_process"),
                                   (SAVED_MODULES["lm_head"], "post_process"))
                if n in saved and getattr(model, stage, False)}
        if want - found:
            raise ValueError(f"--modules_to_save {' '.join(settings.modules_to_save)}: this "
                             f"model has no parameter {sorted(want - found)} (e.g. a vision-"
                             "language model); allowed: text models. Fix: drop --modules_to_save")
    return added


def _add_decoder_adapters(chunks, config, settings: LoraSettings, shapes: dict,
                          tp: int) -> list[str]:
    """A LoraAdapter beside each targeted linear of every decoder layer (fused linears get
    one adapter for all their targets); returns the adapter parameters' local names."""
    heads, d = config.num_attention_heads, config.kv_channels
    groups, ffn = config.num_query_groups or heads, config.ffn_hidden_size
    added = []
    for c in chunks:
        for i, layer in enumerate(unwrap(c).decoder.layers):
            global_layer = layer.layer_number - 1
            for path, (kind, fused) in LINEARS.items():
                targets = {t: shapes[t] for t in fused if t in settings.targets}
                if not targets:
                    continue
                parent, attr = _resolve(layer, path)
                linear = getattr(parent, attr)
                weight = linear.weight
                qkv = (groups // tp, heads // groups * d, d) if attr == "linear_qkv" else None
                fc1 = ffn // tp if attr == "linear_fc1" else None
                adapter = LoraAdapter(kind, targets, settings, config, global_layer, qkv, fc1,
                                      weight.dtype, weight.device)
                parent.add_module(attr + "_lora", adapter)
                _wrap_forward(linear, adapter)
                added += [f"decoder.layers.{i}.{path}_lora.{n}" for n, _ in adapter.named_parameters()]
    return added


# The vision tower's HF module inside the Megatron model (model/vision.py VisionTower).
TOWER_MODULE = "visual.model"
_ALIGNER = "merger"


def tower_linears(tower: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The names (inside the HF tower) of the linears the tower's adapters wrap: ms-swift's
    all-linear over `visual` without `visual.merger` (settings.tower) and over the merger
    (settings.aligner); `nn.Linear` only (patch_embed's Conv3d is none)."""
    def chosen(name):
        aligner = name == _ALIGNER or name.startswith(_ALIGNER + ".")
        return settings.aligner if aligner else settings.tower
    return [n for n, m in tower.named_modules() if isinstance(m, torch.nn.Linear) and chosen(n)]


def _add_tower_adapters(model, settings: LoraSettings) -> list[str]:
    """PEFT's LoRA layers on the tower's linears of `model` (the chunk that holds the tower;
    none elsewhere). Returns the added parameters' names."""
    from peft import LoraConfig, inject_adapter_in_model

    visual = getattr(model, "visual", None)
    if visual is None:
        return []
    names = tower_linears(visual.model, settings)
    inject_adapter_in_model(LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                                       lora_dropout=settings.dropout, use_rslora=settings.rslora,
                                       target_modules=names), visual.model)
    added = []
    with torch.no_grad():
        for name, layer in tower_adapters([model]):
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            a.copy_(_init_a(settings, 0, f"{TOWER_MODULE}.{name}", a.shape[1]))
            b.zero_()
            for factor, p in (("lora_A", a), ("lora_B", b)):
                p.requires_grad_(True)
                p.average_gradients_across_tp_domain = True   # replicated over TP
                added.append(f"{TOWER_MODULE}.{name}.{factor}.default.weight")
    return added


def tower_adapters(chunks):
    """(name inside the HF tower, PEFT LoraLayer) of every tower adapter of `chunks`."""
    from peft.tuners.lora import LoraLayer

    for c in chunks:
        visual = getattr(unwrap(c), "visual", None)
        if visual is None:
            continue
        for name, module in visual.model.named_modules():
            if isinstance(module, LoraLayer):
                yield name, module


def saved_params(chunks):
    """(Megatron name, parameter) of this rank's --modules_to_save parameters."""
    for c in chunks:
        for name, p in unwrap(c).named_parameters():
            if hasattr(p, "lora_saved"):
                yield name, p


def is_lora_state(name: str, settings: LoraSettings | None) -> bool:
    """Whether a state-dict key of a LoRA model is in its checkpoint: adapters and the
    --modules_to_save parameters, and the vision tower under lora_llm (the rest is the
    frozen base, from --model)."""
    return is_adapter_param(name) or (settings is not None and (
        name in {SAVED_MODULES[m] for m in settings.modules_to_save}
        or (settings.train_vision and name.startswith(VISION_PREFIX))))


def adapters(chunks):
    """(global layer, Megatron linear path, LoraAdapter) of every adapter of `chunks`."""
    for c in chunks:
        for layer in unwrap(c).decoder.layers:
            for path in LINEARS:
                parent, attr = _resolve(layer, path)
                adapter = getattr(parent, attr + "_lora", None)
                if adapter is not None:
                    yield layer.layer_number - 1, path, adapter


def lora_settings(chunks) -> LoraSettings | None:
    """The LoraSettings `apply_lora` gave `chunks`, or None (a full-parameter model)."""
    return getattr(unwrap(chunks[0]), "lora_settings", None) if chunks else None


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The base model: every adapter of `chunks` off inside the block (the reference
    policy of a LoRA run, without a second copy of the weights; --modules_to_save
    parameters hold their original data inside). No-op without adapters."""
    found = [a for _, _, a in adapters(chunks)]
    before = [a.enabled for a in found]
    saved = [p for _, p in saved_params(chunks)]
    trained = [p.data for p in saved]
    tower = [m for _, m in tower_adapters(chunks) if not m.disable_adapters]
    grads = [(p, p.requires_grad) for m in tower for p in m.parameters()]
    for a in found:
        a.enabled = False
    for p in saved:
        p.data = p.lora_original
    for m in tower:          # PEFT's disable_adapter (it also clears their requires_grad)
        m.enable_adapters(False)
    try:
        yield
    finally:
        for a, e in zip(found, before):
            a.enabled = e
        for p, t in zip(saved, trained):
            p.data = t
        for m in tower:
            m.enable_adapters(True)
        for p, g in grads:
            p.requires_grad_(g)
