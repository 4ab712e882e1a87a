"""Loss aggregation: per-token coefficients from GLOBAL counts (docs/architecture.md, "Loss normalisation").

Contract. One optimizer step is split over data-parallel ranks and micro-batches in any
way; the loss (and so the gradient) of the step must not depend on that split. Each
micro-batch therefore computes

    loss_local = sum_t coef_t * l_t        (l_t from policy_loss.compute_policy_loss)

with coefficients that depend only on the token's own completion and on global counts,
so that summing loss_local over every micro-batch of every rank gives the step's loss.
The trainer sums `count_partials` over its micro-batches, all-reduces (SUM) over the
data-parallel group, calls `loss_normalizer`, then `token_coefficients` per micro-batch.
Megatron's own scalings (x cp, / num_microbatches, DDP gradient averaging) must be undone
by the caller; this module only defines the target.

Definitions (S = completions of the optimizer step, filtered ones included; n_i = loss
tokens of completion i; m = loss mask, i.e. completion mask minus overlong-filtered
completions):

grpo     mean over completions of the per-completion token mean:
         L = 1/S sum_i 1/max(n_i,1) sum_t m_it l_it;          coef_it = m_it / (max(n_i,1) S).
         TRL/ms-swift: per micro-batch mean of per-sequence means, divided by the
         gradient-accumulation steps and averaged by DDP: the same quantity when every
         micro-batch holds the same number of completions (which they require).
bnpo     token mean over all loss tokens of the optimizer step:
         L = sum m l / max(N_step,1);                         coef = m / max(N_step,1).
         TRL/ms-swift normalise each micro-batch by its OWN token count and then average
         micro-batches and ranks, so their bnpo changes with the split (a micro-batch of
         short completions weighs as much as one of long completions). We use the step's
         token count, the only choice that satisfies the invariance contract; it equals
         theirs when all micro-batches have the same token count.
dr_grpo  sum over the step / (S * max_completion_length)      coef = m / (S * Lmax).
         TRL/ms-swift: per micro-batch sum / (B_micro * Lmax) / accumulation steps: the same.
dapo     token mean over the whole GENERATION batch (all `steps_per_generation` optimizer
         steps of one rollout): coef = m / max(N_gen,1), N_gen = completion tokens of the
         generation batch counted BEFORE the overlong filter (TRL's num_items_in_batch =
         gathered completion lengths; ms-swift Megatron counts completion_mask tokens of the
         generation batch the same way). With steps_per_generation > 1 each optimizer step
         therefore carries only its share of the generation-batch mean, as in TRL.
cispo    normalised like dapo (TRL and ms-swift share the code path).
fipo     normalised like dapo (ms-swift).
sapo     normalised like grpo (ms-swift).
real     its per-token loss is each row's share of its group's loss (policy_loss.real_row_losses),
         weighted like grpo, which gives the mean over the step's groups (S / G of them):
         ms-swift's per micro-batch sum over groups / groups, averaged over micro-batches.
         Its KL term (beta != 0, not kl_in_reward) is normalised apart, as ms-swift's token
         mean of the KL: `real_kl_loss` with the step's loss tokens (the same caveat as bnpo).

Off-policy sequence mask (`off_policy_sequence_mask_delta`): it needs the current
log-probs, so the counts above are those of the loss mask BEFORE it (overlong filter
only). grpo/sapo/real (S rows), dr_grpo, dapo/cispo/fipo do not change; bnpo and real's
KL divide by those tokens, where ms-swift divides by the micro-batch's tokens after it.

Context parallelism: a completion split over CP ranks must count once in S, and n_i must
be its full length (pass `sequence_token_counts`); count partials are then taken on one CP
rank only, or divided by the CP size after an all-reduce over DP x CP.
"""
from __future__ import annotations

from typing import Optional

import torch

from .options import check_option

# Fields of a count-partials vector (float64: exact up to 2**53 tokens, unlike float32's 2**24).
LOSS_TOKENS, COMPLETION_TOKENS, SEQUENCES = 0, 1, 2


def _grpo_norm(step, generation, max_completion_length):
    return step[SEQUENCES]


def _bnpo_norm(step, generation, max_completion_length):
    return step[LOSS_TOKENS]


def _dr_grpo_norm(step, generation, max_completion_length):
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length >= 1, got {max_completion_length!r}")
    return step[SEQUENCES] * max_completion_length


def _generation_token_norm(step, generation, max_completion_length):
    if generation is None:
        raise ValueError("loss_type='dapo'/'cispo'/'fipo' normalise by the generation batch's completion tokens: "
                         "pass generation_counts (equal to step_counts when steps_per_generation == 1)")
    return generation[COMPLETION_TOKENS]


# loss_type -> fn(step_counts [3], generation_counts [3] | None, max_completion_length) -> normaliser
LOSS_NORMALIZERS = {
    "grpo": _grpo_norm,
    "bnpo": _bnpo_norm,
    "dr_grpo": _dr_grpo_norm,
    "dapo": _generation_token_norm,
    "cispo": _generation_token_norm,
    "sapo": _grpo_norm,
    "fipo": _generation_token_norm,
    "real": _grpo_norm,
}

# Which loss types weigh tokens by 1 / (tokens of their own completion).
_PER_SEQUENCE_MEAN = {"grpo", "sapo", "real"}


def count_partials(loss_mask: torch.Tensor, completion_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Counts of one micro-batch -> float64 [3]: (loss tokens, completion tokens, completions).

    loss_mask [B, L] (after the overlong filter); completion_mask [B, L] (before it;
    defaults to loss_mask). Sum these over micro-batches and all-reduce SUM over ranks.
    """
    loss_mask = loss_mask.bool()
    completion_mask = loss_mask if completion_mask is None else completion_mask.bool()
    return torch.stack([
        loss_mask.sum().to(torch.float64),
        completion_mask.sum().to(torch.float64),
        torch.tensor(float(loss_mask.shape[0]), dtype=torch.float64, device=loss_mask.device),
    ])


def counts_from_masks(loss_masks, completion_masks=None) -> torch.Tensor:
    """Global counts [3] from the masks of ALL completions of a step (one-process use, tests)."""
    if completion_masks is None:
        completion_masks = [None] * len(loss_masks)
    return sum(count_partials(m, c) for m, c in zip(loss_masks, completion_masks))


def loss_normalizer(loss_type: str, step_counts: torch.Tensor, *,
                    generation_counts: Optional[torch.Tensor] = None,
                    max_completion_length: Optional[int] = None) -> torch.Tensor:
    """The global denominator of `loss_type` (module docstring) -> 0-d float64, >= 1.

    step_counts: global counts [3] of the optimizer step; generation_counts: of the whole
    generation batch (dapo, cispo, fipo).
    """
    check_option("loss_type", loss_type, LOSS_NORMALIZERS)
    norm = LOSS_NORMALIZERS[loss_type](step_counts, generation_counts, max_completion_length)
    # clamp: a step whose every completion is filtered gives loss 0, not 0/0.
    return torch.as_tensor(norm, dtype=torch.float64).clamp(min=1.0)


def token_coefficients(loss_type: str, loss_mask: torch.Tensor, normalizer: torch.Tensor | float, *,
                       sequence_token_counts: Optional[torch.Tensor] = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights [B, L] such that sum(coef * per_token_loss) is this micro-batch's share.

    loss_mask [B, L]; normalizer from `loss_normalizer`; sequence_token_counts [B]: loss
    tokens of each whole completion when this rank holds only part of it (CP).
    """
    check_option("loss_type", loss_type, LOSS_NORMALIZERS)
    mask = loss_mask.bool()
    norm = torch.as_tensor(normalizer, dtype=torch.float64, device=mask.device)
    coef = mask.to(torch.float64) / norm                                     # [B, L]
    if loss_type in _PER_SEQUENCE_MEAN:
        n = mask.sum(dim=-1) if sequence_token_counts is None else sequence_token_counts
        coef = coef / n.to(torch.float64).clamp(min=1.0).unsqueeze(-1)
    return coef.to(dtype)


def aggregate_loss(per_token_loss: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """sum_t coef_t * l_t -> 0-d: this micro-batch's additive share of the step loss."""
    return (per_token_loss * coefficients.to(per_token_loss.dtype)).sum()


def local_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, loss_type: str,
               normalizer: torch.Tensor | float, **kwargs) -> torch.Tensor:
    """`aggregate_loss` with `token_coefficients`, in the loss's dtype."""
    coef = token_coefficients(loss_type, loss_mask, normalizer, dtype=per_token_loss.dtype, **kwargs)
    return aggregate_loss(per_token_loss, coef)



def real_kl_loss(per_token_kl: torch.Tensor, loss_mask: torch.Tensor, beta: float,
                 step_counts: torch.Tensor) -> torch.Tensor:
    """loss_type='real': beta * sum_t m_t KL_t / max(N_step, 1), this micro-batch's share of
    the KL term (a token mean over the step, module docstring); 0-d in the KL's dtype."""
    norm = loss_normalizer("bnpo", step_counts)
    return beta * local_loss(per_token_kl, loss_mask, "bnpo", norm)
