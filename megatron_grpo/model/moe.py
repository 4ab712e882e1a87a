"""Mixture-of-experts: an HF Qwen2-MoE / Qwen3-MoE config -> Megatron-Core's MoE layer settings.

HF's sparse block (transformers `Qwen3MoeSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`):

    logits = x W_router^T                    # [T, E]
    p = softmax(logits)                      # over all E experts, fp32
    top, idx = topk(p, k)
    top = top / sum(top)   if norm_topk_prob  # else the raw probabilities
    y = sum_j top_j * expert_{idx_j}(x)       # expert(x) = down(silu(gate x) * up x)
    y += sigmoid(x w_shared_gate) * shared(x) # Qwen2-MoE only

Megatron's `TopKRouter` with score function softmax computes the same weights two ways:
- `moe_router_pre_softmax=False` (its default): topk on the logits, then softmax over the k
  chosen logits. softmax is monotone, so the same experts win, and
  exp(l_j) / sum_k exp(l_k) = p_j / sum_k p_k: exactly `norm_topk_prob=True`.
- `moe_router_pre_softmax=True`: softmax over all E, then topk: `norm_topk_prob=False`.
The shared expert with `moe_shared_expert_gate=True` is Megatron's `SharedExpertMLP`, which
multiplies its output by sigmoid(x gate_weight^T), gate_weight [1, hidden]: HF's
`shared_expert_gate.weight`.

Auxiliary losses keep Megatron's meaning: each training micro-batch's router adds
coeff x loss to the gradient through `MoEAuxLossAutoScaler`, scaled by the schedule by
cp / num_microbatches (calculate_per_token_loss is off), and DDP averages over data-parallel
ranks: the gradient of coeff x (mean over micro-batches and DP ranks of the per-micro-batch
loss), beside the GRPO loss with its own global normalisation (train/engine.py).
`step_metrics` logs that mean, unweighted, as `load_balancing_loss` / `z_loss`. Both
count the real tokens only: the engine passes each micro-batch's padding to the routers
(GPTModel's `padding_mask`, train/engine.py `with_token_valid`), so neither the losses
nor their gradients depend on how far a micro-batch is padded (tests/test_moe.py).

Router replay (`--router_replay_mode R3`): each sample carries the experts vLLM routed its
tokens to (rollout/routing.py), [tokens, layers, k]; `set_routing_replay` hands every
router of a chunk its layer's ids before the forward (Megatron's `RouterReplay`, built
with `moe_enable_routing_replay`). The router then takes those experts instead of its own
top-k and weighs them with its own logits, so gradients still reach the router:
    g = softmax over the replayed experts of x W_router^T   (norm_topk_prob; else the
        full softmax gathered at them)
With the weights vLLM sampled with, the trainer's log-probs are vLLM's wherever the two
routers would pick differently (ties, rounding, a drifted router in later mini-batches).

On CPU the experts are `SequentialMLP` (one MLP per local expert; grouped GEMM and the
fused permutation are CUDA kernels) and tokens travel with the all-to-all dispatcher
(gloo has all_to_all; Megatron's all-gather dispatcher refuses variable sequence lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from bridge.params import unwrap
from megatron_grpo.platform.compat.megatron import moe_step_losses

from ..config.hf_model import num_experts
from ..platform.compat import megatron as compat
from .families import Family
from .te import use_transformer_engine

# Megatron's allgather dispatcher raises on variable_seq_lengths (which GRPO batches need).
DISPATCHERS = ("alltoall",)


@dataclass(frozen=True)
class MoEOptions:
    """ms-swift's MoE options of a run (the model's own sizes come from config.json).

    aux_loss_coeff: weight of the load-balancing loss (Megatron's "aux_loss", per
        micro-batch); 0 turns it off (and no loss is computed or logged).
    z_loss_coeff: weight of the router z-loss (mean of logsumexp(logits)^2); None: off.
    expert_capacity_factor: tokens an expert takes at most, as a multiple of its even share
        (capacity = factor * tokens * topk / experts); the rest are dropped. None: no drops.
    token_dispatcher_type: how tokens reach their experts across EP ranks.
    grouped_gemm, permute_fusion: CUDA kernels (Transformer Engine); refused on CPU.
    """

    aux_loss_coeff: float = 0.0
    router_load_balancing_type: str = "aux_loss"
    z_loss_coeff: float | None = None
    expert_capacity_factor: float | None = None
    pad_expert_input_to_capacity: bool = False
    token_drop_policy: str = "probs"
    token_dispatcher_type: str = "alltoall"
    grouped_gemm: bool | None = False     # None: on where Transformer Engine runs
    permute_fusion: bool = False
    router_dtype: str | None = None
    routing_replay: bool = False          # --router_replay_mode R3 (module doc)

    @classmethod
    def from_config(cls, cfg) -> "MoEOptions":
        """The run's options: GRPOConfig.model's `moe_*` fields of the same names, and
        whether the routers replay vLLM's routing (`--router_replay_mode`)."""
        return cls(**{f.name: getattr(cfg.model, "moe_" + f.name) for f in fields(cls)
                      if f.name != "routing_replay"},
                   routing_replay=cfg.model.router_replay_mode == "R3")

    def check(self, on_gpu: bool | None = None) -> None:
        """ValueError naming the option for values this machine cannot run."""
        if on_gpu is None:
            on_gpu = use_transformer_engine()
        if self.token_dispatcher_type not in DISPATCHERS:
            raise ValueError(f"--moe_token_dispatcher_type {self.token_dispatcher_type!r} is not "
                             f"supported; allowed values: {', '.join(DISPATCHERS)}")
        if not on_gpu:
            for flag, on in (("--moe_grouped_gemm", self.grouped_gemm),
                             ("--moe_permute_fusion", self.permute_fusion)):
                if on:
                    raise ValueError(f"{flag} true needs CUDA (Transformer Engine / grouped_gemm "
                                     f"kernels); this machine has no GPU. Fix: {flag} false")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"--moe_aux_loss_coeff {self.aux_loss_coeff} must be >= 0")
        if self.expert_capacity_factor is not None and self.expert_capacity_factor <= 0:
            raise ValueError(f"--moe_expert_capacity_factor {self.expert_capacity_factor} must be "
                             "> 0 (or unset: no token dropping)")
        if self.token_drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe_token_drop_policy {self.token_drop_policy!r}: allowed values "
                             "probs, position")
        if self.pad_expert_input_to_capacity and self.expert_capacity_factor is None:
            raise ValueError("--moe_pad_expert_input_to_capacity true needs "
                             "--moe_expert_capacity_factor")


def check_hf_moe(hf: dict) -> None:
    """Refuse HF MoE configs whose layers are not all sparse (not supported yet)."""
    if hf.get("mlp_only_layers"):
        raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']} (dense layers among "
                         "the MoE ones) is not supported yet; every layer must be sparse")
    if int(hf.get("decoder_sparse_step", 1) or 1) != 1:
        raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']} is not "
                         "supported yet; every layer must be sparse (decoder_sparse_step 1)")
    if not num_experts(hf):
        raise ValueError("config.json of an MoE model has no num_experts")


def moe_config_kwargs(hf: dict, family: Family, *, tp: int, ep: int = 1, etp: int | None = None,
                      options: MoEOptions | None = None) -> dict:
    """TransformerConfig fields of an MoE model (see the module doc for the router)."""
    options = options or MoEOptions()
    options.check()
    check_hf_moe(hf)
    experts = num_experts(hf)
    if experts % ep:
        valid = [e for e in range(1, experts + 1) if experts % e == 0]
        raise ValueError(f"--expert_model_parallel_size {ep} does not divide the model's "
                         f"{experts} experts (num_experts); valid values: {valid}")
    etp = tp if etp is None else etp
    ffn = int(hf["moe_intermediate_size"])
    if ffn % etp:
        raise ValueError(f"--expert_tensor_parallel_size {etp} does not divide the experts' "
                         f"intermediate size {ffn} (moe_intermediate_size)")
    out = dict(
        num_moe_experts=experts,
        moe_router_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=ffn,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
        moe_router_load_balancing_type=(options.router_load_balancing_type
                                        if options.aux_loss_coeff > 0 else "none"),
        moe_aux_loss_coeff=float(options.aux_loss_coeff),
        moe_z_loss_coeff=options.z_loss_coeff,
        moe_expert_capacity_factor=options.expert_capacity_factor,
        moe_pad_expert_input_to_capacity=options.pad_expert_input_to_capacity,
        moe_token_drop_policy=options.token_drop_policy,
        moe_token_dispatcher_type=options.token_dispatcher_type,
        moe_grouped_gemm=_grouped_gemm(options.grouped_gemm),
        moe_permute_fusion=options.permute_fusion,
        moe_router_dtype=options.router_dtype,
        moe_enable_routing_replay=options.routing_replay,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if family.shared_expert:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared:
            if shared % tp:
                raise ValueError(f"--tensor_model_parallel_size {tp} does not divide the shared "
                                 f"expert's size {shared} (shared_expert_intermediate_size)")
            out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out


def _grouped_gemm(value: bool | None) -> bool:
    if value is not None:
        return bool(value)
    return use_transformer_engine()


def set_routing_replay(chunk, routed) -> None:
    """Route the next forward of a model chunk by `routed` [b, s, layers, k] (the expert
    ids of each input token, every layer of the model; a micro-batch's "routed_experts"),
    or by its own routers when None. Megatron's router sees the tokens s-major ([s, b]
    flattened), under sequence parallelism this TP rank's s / tp of them."""
    import torch

    from megatron.core import parallel_state as ps

    replays = compat.router_replays(chunk)
    if routed is None:
        for _, replay in replays:
            compat.stop_routing_replay(replay)
        return
    if not replays:
        raise ValueError("a micro-batch carries routed_experts but the model's routers were "
                         "built without routing replay (--router_replay_mode R3)")
    # Every layer is sparse (check_hf_moe), so vLLM's MoE layer i is the model's layer i.
    ids = routed.transpose(0, 1)                                  # [s, b, layers, k]
    if unwrap(chunk).config.sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = ids.shape[0] // tp
        ids = ids[rank * n:(rank + 1) * n]
    device = next(chunk.parameters()).device
    for layer, replay in replays:
        compat.replay_routing(replay, ids[:, :, layer].reshape(-1, ids.shape[-1])
                              .to(device=device, dtype=torch.long))


def stop_routing_replay(chunks) -> None:
    """Every router of `chunks` back to its own top-k (after a schedule call)."""
    for chunk in chunks:
        set_routing_replay(chunk, None)


def step_metrics(config, num_microbatches: int) -> dict:
    """The MoE losses of the training step that just ran, as ms-swift logs them.

    Megatron's router records each layer's load-balancing loss (and z-loss) per micro-batch,
    unweighted, in its tracker (training forwards only). Here: summed over pipeline stages
    and averaged over data-parallel ranks by Megatron's own reduction, then
        load_balancing_loss = sum over layers and micro-batches / (layers x micro-batches)
    and the tracker is cleared. Collective: every rank calls it after each step."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    return {name: float(values.sum()) / (config.num_layers * max(num_microbatches, 1))
            for name, values in moe_step_losses().items()}
