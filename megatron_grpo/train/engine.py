"""Megatron glue: per-token log-probs through the pipeline schedule, and one GRPO step.

This is the one place where Megatron's own loss scalings meet ours.
The pure GRPO math (megatron_grpo.algorithms) defines, per micro-batch, an additive
share `L_mb` of the optimizer step's loss, so that sum over micro-batches and DP ranks
of L_mb is the global loss of `loss_type`. Megatron then scales what the loss function
returns before backward and reduction:

  * the schedule multiplies it by the CP size and divides by num_microbatches M
    (legacy 2-output loss functions, `calculate_per_token_loss=False`);
  * DDP scales gradients by 1 / (dp * cp) before summing them over the DP x CP group.

Net factor on our gradient: cp / M / (dp * cp) = 1 / (M * dp). We return
`L_mb * M * dp`, so the summed gradient is exactly d(sum L_mb)/d(theta).
`megatron_loss_scale` holds that rule and tests/test_train_engine.py holds us to it.
(dp is the data-parallel size WITHOUT CP: Megatron's get_data_parallel_world_size().)

Context parallelism (CP). Each CP rank gets its load-balanced chunks of every [B, S]
tensor of the micro-batch (`batch.cp_shard`) and runs the kernel on its [S/cp, B, h]
hidden states. Its loss is its own tokens' share: sum_t coef_t * l_t over local
tokens, with coefficients from whole-row counts, so the CP ranks' shares add up to
L_mb; the gradient summed over DP x CP by DDP is then again d(sum L_mb)/d(theta) with
the same factor, cp * 1/(dp * cp) * M * dp / M = 1 (the x cp of the schedule and the
1/cp of DDP cancel). Per-sequence quantities (sequence-level importance ratio, rollout
IS sequence ratio, grpo's per-completion token counts, per-completion metrics) need
whole rows: each rank all-reduces its per-row partial sums over the CP group
(`_SumOverCP`) instead of gathering log-probs. Metric partials are then identical on
every CP rank and reduced over DP only.

The last pipeline stage runs GPTModel up to its final norm only (`_hidden_only`); the
fused vocab-parallel kernel turns hidden states into log-probs and entropy without
materialising logits.

Packed micro-batches (`--padding_free true`: chunks built with `padding_free`). Each
padded micro-batch is packed here (train/packing.py) into [1, T] tokens and
PackedSeqParams (under CP: this rank's chunks of every sequence); the kernel's
log-probs and entropy on the packed tokens are put back into the row view [B, L] (the
padded layout for cp=1, a CP shard's layout under CP) and the loss below runs on that
unchanged, so every factor above holds as it is. The schedule sees micro-batches of
size 1 and length T; under PP every micro-batch of one call is packed to the same T.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..algorithms import (compute_policy_loss, entropy_threshold, local_loss, merge_partials,
                          policy_metric_partials, rollout_metric_partials, stack_partials,
                          unstack_partials)
from ..algorithms.aggregation import real_kl_loss
from ..algorithms.policy_loss import LossConfig, loss_mask_after_overlong_filter
from ..data.cp_split import gather_from_cp, gather_rows_from_cp
from ..kernels import vocab_parallel_logprobs
from ..model.builder import unwrap
from ..model.moe import set_routing_replay, stop_routing_replay
from ..platform import device
from .batch import cp_shard
from .packing import pack_micro_batch, packed_length, packed_seq_params, to_rows


@dataclass(frozen=True)
class LossOptions(LossConfig):
    """The loss options of the GRPO step: the loss's own (`LossConfig`, passed whole to
    `compute_policy_loss`) plus what the Megatron glue needs around it.
    Built once from the run's options by `train.setup.loss_options`."""

    temperature: float = 1.0        # divides the logits (the sampling temperature)
    log_entropy: bool = False       # entropy metrics (computes the entropy)


@contextlib.contextmanager
def _hidden_only(model):
    """Make GPTModel return the final-norm hidden states [s, b, h] instead of logits."""
    m = unwrap(model)
    saved = m.post_process
    m.post_process = False      # GPTModel skips its output layer; the block still norms
    try:
        yield
    finally:
        m.post_process = saved


def output_weight(model) -> torch.Tensor:
    """This TP rank's vocab shard [V_pad/tp, h] of the output (or tied embedding) weight."""
    m = unwrap(model)
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


def megatron_loss_scale(num_microbatches: int) -> float:
    """Factor that undoes Megatron's scalings (module docstring): M * dp."""
    from megatron.core import parallel_state as ps

    return float(num_microbatches * ps.get_data_parallel_world_size())


def _logprobs_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float, vocab_size: int, compute_entropy: bool):
    """hidden [s, b, h] (or its SP shard) + targets [b, s] -> logps, entropy [b, s] fp32."""
    from megatron.core import parallel_state as ps

    config = unwrap(model).config
    b, s = targets.shape
    logp, ent = vocab_parallel_logprobs(
        hidden.reshape(-1, hidden.shape[-1]), output_weight(model),
        targets.t().reshape(-1),                                    # s-major like hidden
        temperature=temperature, tp_group=ps.get_tensor_model_parallel_group(),
        sequence_parallel=config.sequence_parallel, compute_entropy=compute_entropy,
        vocab_size=vocab_size)
    logp = logp.view(s, b).t()
    ent = ent.view(s, b).t() if ent is not None else None
    return logp, ent


class _SumOverCP(torch.autograd.Function):
    """y = sum over the CP ranks of x (all-reduce); backward all-reduces the gradient too.

    Why the backward all-reduces: y is replicated, and every CP rank r feeds it into its
    own local loss L_r (its own tokens). The objective is sum_r L_r (DDP sums the CP
    ranks' gradients), so dObjective/dx_r = sum_r' dL_r'/dy * dy/dx_r = sum_r' dL_r'/dy:
    the upstream gradients of ALL ranks, i.e. an all-reduce of the upstream gradient.
    (Megatron's TP reduce has an identity backward because there every rank computes the
    same loss from y and only one copy of it counts; here each rank's loss differs.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        y = x.detach().clone().contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def cp_sequence_sums():
    """The `sequence_sums` hook of algorithms under CP ([B, k] per-row partial sums ->
    whole-row sums over the CP group, differentiable), or None without CP."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return None
    group = ps.get_context_parallel_group()
    return lambda partial: _SumOverCP.apply(partial, group)


def padding_free(chunks) -> bool:
    """Whether the chunks were built for packed micro-batches (model.build_model)."""
    return bool(getattr(unwrap(chunks[0]), "padding_free", False))


def _cp_micro_batches(chunks, micro_batches: list[dict]) -> list[dict]:
    """Each micro-batch as this rank feeds it to the model: packed (padding_free), this
    CP rank's chunks, or unchanged."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    # Under sequence parallelism each CP rank's tokens are split again over TP.
    sp = (ps.get_tensor_model_parallel_world_size()
          if unwrap(chunks[0]).config.sequence_parallel else 1)
    rank = ps.get_context_parallel_rank()
    if unwrap(chunks[0]).config.num_moe_experts:
        micro_batches = [with_token_valid(mb) for mb in micro_batches]
    if padding_free(chunks):
        # One length for every micro-batch of the call under PP (the p2p buffers).
        common = max(packed_length(mb, cp, sp) for mb in micro_batches) \
            if ps.get_pipeline_model_parallel_world_size() > 1 else None
        return [pack_micro_batch(mb, cp_size=cp, cp_rank=rank, sp_size=sp, total_length=common)
                for mb in micro_batches]
    if cp == 1:
        return micro_batches
    return [cp_shard(mb, cp, rank, sp) for mb in micro_batches]


def with_token_valid(batch: dict) -> dict:
    """`batch` plus "token_valid" [B, S] bool: the tokens of each row before its padding
    (from "lengths"). An MoE model's routers leave the others out of the load-balancing
    and z losses (Megatron's padding_mask); CP shards and packing pad it with False."""
    if "lengths" not in batch:
        return batch
    cols = torch.arange(batch["input_ids"].shape[1], device=batch["lengths"].device)
    return dict(batch, token_valid=cols < batch["lengths"][:, None])


def _padding_mask(model, token_valid: torch.Tensor) -> torch.Tensor:
    """GPTModel's padding_mask (True: padding) for this rank's tokens [b, s]. Under
    sequence parallelism the stage that embeds splits it over TP itself (as it splits the
    embeddings); a later stage's MoE layers see [b, s/tp] and get this TP rank's part."""
    from megatron.core import tensor_parallel

    m = unwrap(model)
    mask = ~token_valid
    if m.config.sequence_parallel and not m.pre_process:
        mask = tensor_parallel.scatter_to_sequence_parallel_region(
            mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
    return mask


def _model_forward(model, batch: dict) -> torch.Tensor:
    """GPTModel up to the final norm on a micro-batch, packed or not; with router replay
    (a "routed_experts" entry) its MoE routers take the experts vLLM chose, and with
    "token_valid" (MoE models, `with_token_valid`) they leave the padding out of their
    auxiliary losses."""
    if "routed_experts" in batch:
        set_routing_replay(model, batch["routed_experts"])
    kwargs = {"packed_seq_params": packed_seq_params(batch)} if "cu_seqlens" in batch else {}
    if "token_valid" in batch:
        kwargs["padding_mask"] = _padding_mask(model, batch["token_valid"])
    # Vision-language micro-batches (train/batch.py ImageInputs): the images, for the
    # first stage's vision tower (model/vision.py); other stages ignore them.
    kwargs.update({k: batch[k] for k in ("pixel_values", "image_grid_thw", "image_mask",
                                          "image_index")
                   if k in batch})
    with _hidden_only(model):
        return model(batch["input_ids"], batch["position_ids"], None, **kwargs)


def _gather_cp(local: Optional[torch.Tensor], batch: dict) -> Optional[torch.Tensor]:
    """[b, S_pad/cp] of each CP rank (or a packed micro-batch's row view) -> [b, S] in
    sequence order (no autograd); as is without CP."""
    if local is None:
        return local
    if "row_positions_all" in batch:
        return gather_rows_from_cp(local, batch["row_positions_all"], batch["seq_len"])
    if "seq_len" not in batch or "row_index" in batch:
        return local
    return gather_from_cp(local, seq_len=batch["seq_len"])


def _cp_entropy_threshold(ent: torch.Tensor, batch: dict, opts: "LossOptions") -> torch.Tensor:
    """The micro-batch's top_entropy_quantile threshold from the entropies of all of its
    loss tokens, gathered over CP (the quantile is not a sum: it needs every value)."""
    mask = loss_mask_after_overlong_filter(batch["completion_mask"], batch["truncated"],
                                           opts.overlong_filter)
    full_mask = _gather_cp(mask.to(torch.uint8), batch).bool()          # [b, S]
    return entropy_threshold(_gather_cp(ent.detach(), batch), opts.top_entropy_quantile,
                             full_mask)


def _run_schedule(chunks, micro_batches: list[dict], forward_step, forward_only: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Collated on the host; the model may live on an accelerator.
    dev = next(p.device for c in chunks for p in c.parameters())
    micro_batches = [{k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v
                      for k, v in mb.items()} for mb in micro_batches]
    seq = max(mb["input_ids"].shape[1] for mb in micro_batches)
    mbs = micro_batches[0]["input_ids"].shape[0]
    if ps.get_pipeline_model_parallel_world_size() > 1 and \
            any(mb["input_ids"].shape[1] != seq for mb in micro_batches):
        # The pipeline's p2p buffers are sized by seq_length; keep every micro-batch equal.
        raise ValueError("all micro-batches of one schedule call must have the same length; "
                         "collate them with a common pad length")
    iters = ([iter(micro_batches) for _ in chunks] if len(chunks) > 1
             else iter(micro_batches))
    # The schedule wants the FULL sequence length: it divides by cp (and tp under SP)
    # to size its p2p buffers; CP micro-batches hold S_pad / cp positions.
    seq *= ps.get_context_parallel_world_size()
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters, model=chunks,
            num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=mbs,
            forward_only=forward_only)
    finally:
        if any("routed_experts" in mb for mb in micro_batches):
            stop_routing_replay(chunks)


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


@torch.no_grad()
def forward_logprobs(chunks, micro_batches: list[dict], *, temperature: float, vocab_size: int,
                     compute_entropy: bool = False) -> Optional[list[dict]]:
    """Per-token log-probs (and entropy) [b, s] of each micro-batch, forward only.

    Returns the list on the last pipeline stage and None on the others. Under CP the
    values are gathered over the CP group back to the micro-batch's [b, s] (they become
    old/ref log-probs of whole samples; a forward-only gather of [b, s] floats).
    """
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        hidden = _model_forward(model, batch)

        def loss_fn(h):
            logp, ent = _logprobs_from_hidden(model, h, batch["targets"], temperature=temperature,
                                              vocab_size=vocab_size,
                                              compute_entropy=compute_entropy)
            logp, ent = to_rows(logp, batch), to_rows(ent, batch)     # packed -> [b, s]
            zero = h.new_zeros(())
            return zero, {"logps": _gather_cp(logp, batch), "entropy": _gather_cp(ent, batch)}
        return hidden, loss_fn

    for c in chunks:
        c.eval()
    out = _run_schedule(chunks, _cp_micro_batches(chunks, micro_batches), forward_step,
                        forward_only=True)
    for c in chunks:
        c.train()
    return out if is_last_stage() else None


def step_entropy_threshold(chunks, micro_batches: list[dict], opts: LossOptions, *,
                           vocab_size: int) -> Optional[torch.Tensor]:
    """top_entropy_quantile's threshold for one optimizer step: the (1 - q) quantile of the
    entropies of every loss token of the step (all micro-batches of all DP ranks), from a
    forward-only pass with the weights the step's training pass will use.

    A per-micro-batch quantile would make the step's loss depend on how it is split into
    micro-batches and DP ranks; this one does not (docs/architecture.md, "Loss normalisation"). Costs a
    forward pass per step. Returns the 0-d float64 threshold on the last pipeline stage,
    None elsewhere (only the last stage computes the loss).
    """
    from megatron.core import parallel_state as ps

    outs = forward_logprobs(chunks, micro_batches, temperature=opts.temperature,
                            vocab_size=vocab_size, compute_entropy=True)
    if outs is None:
        return None
    values = []
    for batch, out in zip(micro_batches, outs):
        mask = loss_mask_after_overlong_filter(batch["completion_mask"], batch["truncated"],
                                               opts.overlong_filter)
        ent = out["entropy"]
        values.append(ent[mask.bool().to(ent.device)].to(torch.float64))
    local = torch.cat(values)
    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1:     # every DP rank's tokens (variable counts: pad)
        n = torch.tensor([local.numel()], device=local.device)
        sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, n, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.float64, device=local.device)
        padded[:local.numel()] = local
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        local = torch.cat([x[:int(s.item())] for x, s in zip(pieces, sizes)])
    return entropy_threshold(local, opts.top_entropy_quantile)


def train_micro_batches(chunks, micro_batches: list[dict], opts: LossOptions, *,
                        normalizer: torch.Tensor, vocab_size: int,
                        entropy_threshold_value: Optional[torch.Tensor] = None,
                        step_counts: Optional[torch.Tensor] = None) -> dict:
    """Forward + backward of one optimizer step's micro-batches on this rank.

    `normalizer` is the global denominator from `algorithms.loss_normalizer` (counts
    all-reduced over DP beforehand). Returns metric partials of this rank (last stage;
    empty elsewhere) and this rank's share of the step loss under "loss". Under CP
    `micro_batches` are still whole [B, S] micro-batches (every CP rank passes the same
    ones); each CP rank takes its chunks here, and the partials (loss included) are
    those of whole completions, equal on every CP rank: reduce them over DP only.
    `entropy_threshold_value`: top_entropy_quantile's threshold for the whole step
    (`step_entropy_threshold`); None computes it per micro-batch.
    `step_counts`: the step's global count partials, for loss_type real's KL term (a token
    mean over the step, normalised apart from its group loss: algorithms/aggregation.py).
    """
    from megatron.core import parallel_state as ps

    num_mb = len(micro_batches)
    scale = megatron_loss_scale(num_mb)
    need_entropy = opts.log_entropy or opts.top_entropy_quantile < 1.0
    seq_sums = cp_sequence_sums()       # None without CP: every row is whole
    parts = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        hidden = _model_forward(model, batch)

        def loss_fn(h):
            logp, ent = _logprobs_from_hidden(model, h, batch["targets"],
                                              temperature=opts.temperature,
                                              vocab_size=vocab_size, compute_entropy=need_entropy)
            logp, ent = to_rows(logp, batch), to_rows(ent, batch)   # packed -> the row view
            cp_kwargs, coef_kwargs = {}, {}
            if opts.top_entropy_quantile < 1.0 and entropy_threshold_value is not None:
                cp_kwargs["entropy_threshold_value"] = entropy_threshold_value
            if seq_sums is not None:
                cp_kwargs["sequence_sums"] = seq_sums
                if opts.top_entropy_quantile < 1.0 and entropy_threshold_value is None:
                    cp_kwargs["entropy_threshold_value"] = _cp_entropy_threshold(ent, batch, opts)
            out = compute_policy_loss(
                logp, batch["advantages"], batch["completion_mask"], opts,
                old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"), entropy=ent,
                truncated=batch["truncated"], rollout_logps=batch.get("rollout_logps"),
                teacher_logps=batch.get("teacher_logps"), **cp_kwargs)
            if seq_sums is not None:
                # grpo's 1/n_i needs each completion's loss tokens on every CP rank.
                n = out.loss_mask.sum(dim=-1, keepdim=True).to(torch.float64)    # [B, 1]
                coef_kwargs["sequence_token_counts"] = seq_sums(n)[:, 0]
            loss = local_loss(out.per_token_loss, out.loss_mask, opts.loss_type, normalizer,
                              **coef_kwargs)
            if opts.loss_type == "real" and out.per_token_kl is not None:
                loss = loss + real_kl_loss(out.per_token_kl, out.loss_mask, opts.beta, step_counts)
            metric_kwargs = {"sequence_sums": seq_sums} if seq_sums is not None else {}
            p = policy_metric_partials(out, loss_type=opts.loss_type, epsilon=opts.epsilon,
                                       epsilon_high=opts.epsilon_high,
                                       entropy=ent if opts.log_entropy else None,
                                       **metric_kwargs)
            if batch.get("rollout_logps") is not None:
                old = batch.get("old_logps")
                old = logp.detach() if old is None else old
                p = merge_partials(p, rollout_metric_partials(
                    old, batch["rollout_logps"], batch["completion_mask"],
                    rollout_importance_sampling_mode=opts.rollout_importance_sampling_mode,
                    rollout_importance_sampling_threshold=opts.
                    rollout_importance_sampling_threshold, **metric_kwargs))
            reported = loss.detach().clone()
            if seq_sums is not None:    # the micro-batch's share: sum of the CP ranks' shares
                dist.all_reduce(reported, group=ps.get_context_parallel_group())
            p["sum"]["loss"] = reported.to(torch.float64)
            parts.append(p)
            return loss * scale, {"loss": reported}
        return hidden, loss_fn

    _run_schedule(chunks, _cp_micro_batches(chunks, micro_batches), forward_step,
                  forward_only=False)
    return merge_partials(*parts) if parts else {"sum": {}, "min": {}, "max": {}}


def reduce_partials(partials: dict, group=None) -> dict:
    """All-reduce metric partials (SUM/MIN/MAX per op) over `group` (default: DP).

    DP without CP: under CP every CP rank already holds the partials of whole
    completions (train_micro_batches), so the CP group must not be summed again.
    """
    from megatron.core import parallel_state as ps

    group = group or ps.get_data_parallel_group()
    stacked = {op: t.to(device()) for op, t in stack_partials(partials).items()}
    world = dist.get_world_size(group)
    sizes = [stacked[op].numel() for op in ("sum", "min", "max")]
    if world > 1 and sum(sizes):
        # One all-gather of [sum | -min | max] rather than a SUM and a MAX all-reduce: on a
        # small CPU node a gloo collective costs ~1 ms of latency, far more than the few
        # numbers it carries. Reduced here in rank order, the same on every rank;
        # min(x) = -max(-x), exactly.
        flat = torch.cat([stacked["sum"].double(), -stacked["min"].double(),
                          stacked["max"].double()])
        rows = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(rows, flat, group=group)
        sums, neg_mins, maxes = torch.stack(rows).split(sizes, dim=1)   # [world, n] each
        for op, part in (("sum", sums.sum(dim=0)), ("min", -neg_mins.amax(dim=0)),
                         ("max", maxes.amax(dim=0))):
            stacked[op] = part.to(stacked[op].dtype)
    return unstack_partials(stacked, partials)
