"""Rollouts -> padded training micro-batches (token-aligned tensors).

A sample is `prompt_ids + completion_ids`. The model reads tokens[:-1] and predicts
tokens[1:] (the "targets"), so every per-token quantity of a completion token k
(0-based) lives at target position P + k - 1, where P is the prompt length. All
per-token tensors of a micro-batch are [B, S] in that target layout; right padding
needs no attention mask under causal attention (pads only follow real tokens).

Multi-turn samples (rollout/trajectory.py): `completion_ids` is everything after the
prompt (the model's turns and the tool / environment tokens between them) and
`loss_mask` marks the model's tokens. `completion_mask` is then 1 on the model's tokens
only, so everything computed over it (loss, KL, entropy, rollout correction, metrics)
skips the rest; the per-token fields hold one value per model token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..data.cp_split import shard_batch
from ..model.mrope import image_rows, mrope_positions, sample_positions


@dataclass(frozen=True)
class ImageInputs:
    """The images of one prompt, as the model's processor made them (vision-language
    models). The completions of a prompt share one object: nothing is copied per sample.

    pixel_values [patches, C*T*P*P] and image_grid_thw [n_images, 3]: the processor's
    output for this prompt's images, in order; positions [3, P]: the prompt's multimodal
    rotary positions and rope_delta their offset for the tokens after it (completion token
    at index i: i + rope_delta), from model.mrope.mrope_positions; image_mask [P] bool: the
    prompt tokens the images fill (a completion may contain the image token id as text).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    image_mask: torch.Tensor

    @classmethod
    def from_prompt(cls, prompt_ids, pixel_values, image_grid_thw, image_token_id: int,
                    spatial_merge_size: int = 2) -> "ImageInputs":
        """From the processor's expanded prompt ids and image tensors."""
        ids = torch.as_tensor(prompt_ids)
        positions, delta = mrope_positions(ids, image_grid_thw, image_token_id, spatial_merge_size)
        return cls(pixel_values, torch.as_tensor(image_grid_thw).view(-1, 3), positions, delta,
                   ids == image_token_id)


@dataclass
class Sample:
    """One completion of one prompt, as the trainer sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    truncated: bool = False
    rollout_logps: Optional[list[float]] = None    # vLLM's per completion token
    old_logps: Optional[torch.Tensor] = None       # [len(completion)] filled by the trainer
    ref_logps: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)       # prompt index, rewards, text, ...
    loss_mask: Optional[list[int]] = None          # per completion token, 1: the model's
                                                   # (multi-turn); None: all of them
    images: Optional[ImageInputs] = None           # the prompt's images (vision-language)
    routed_experts: Optional[torch.Tensor] = None  # [P + C - 1, layers, k]: the experts vLLM
                                                   # routed each input token to (R3)
    teacher_logps: Optional[torch.Tensor] = None   # --teacher_model's, like old_logps
    teacher_prompt_ids: Optional[list[int]] = None  # OPSD: the prompt the teacher scores the
                                                    # completion with (the row's teacher_prompt)

    @property
    def model_tokens(self) -> int:
        """The completion's length as the metrics count it: the model's tokens (a
        multi-turn trajectory's tool and template spans left out)."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


PER_TOKEN_FIELDS = ("old_logps", "ref_logps", "rollout_logps", "teacher_logps")


def collate(samples: Sequence[Sample], pad_id: int = 0, pad_to_multiple_of: int = 1,
            pad_to_length: int | None = None) -> dict:
    """Pad a micro-batch. Returns a dict of tensors, all [B, S] unless noted.

    input_ids, position_ids, targets: int64 (position_ids [3, B, S] when a sample has
    images; then also pixel_values, image_grid_thw, image_mask: `_image_fields`);
    completion_mask: bool (targets that are
    completion tokens the model wrote: `loss_mask`); advantages [B]; truncated [B] bool;
    lengths [B] int64 (tokens of each row, the rest is padding: what packing keeps);
    old_logps / ref_logps / rollout_logps / teacher_logps (float32, one value per model
    token, 0 elsewhere)
    when every sample has them; routed_experts [B, S, layers, k] int16 (router replay: the
    experts of each input token; padding routed to experts 0..k-1) when every sample has it.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    if min(len(s.prompt_ids) for s in samples) < 1:
        raise ValueError("every sample needs at least one prompt token")
    seq = max(max(lengths), pad_to_length or 0)
    seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    # The rows are padded as Python lists and made tensors in one call each: a torch call
    # per sample and field was most of a batch's collation time (and, on CPU, each goes
    # through the CUDA->CPU mode).
    rows = [list(s.prompt_ids) + list(s.completion_ids) for s in samples]
    input_ids = torch.tensor([r[:-1] + [pad_id] * (seq + 1 - len(r)) for r in rows],
                             dtype=torch.long)                               # [B, S]
    targets = torch.tensor([r[1:] + [pad_id] * (seq + 1 - len(r)) for r in rows],
                           dtype=torch.long)
    # completion_mask: targets p-1 .. p+c-2 are the completion's tokens (all of them the
    # model's unless a loss_mask says otherwise).
    starts = torch.tensor([len(s.prompt_ids) - 1 for s in samples], dtype=torch.long)
    ends = starts + torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.long)
    cols = torch.arange(seq)
    mask = (cols >= starts[:, None]) & (cols < ends[:, None])
    model_tokens = []          # the model's tokens of each sample
    for i, s in enumerate(samples):
        c = len(s.completion_ids)
        if s.loss_mask is None:
            model_tokens.append(c)
            continue
        if len(s.loss_mask) != c:
            raise ValueError(f"loss_mask has {len(s.loss_mask)} values for {c} completion tokens")
        p = len(s.prompt_ids)
        mask[i, p - 1:p - 1 + c] = torch.as_tensor(s.loss_mask, dtype=torch.bool)
        model_tokens.append(sum(1 for m in s.loss_mask if m))
    per_token = {}
    for name in PER_TOKEN_FIELDS:
        if not all(getattr(s, name) is not None for s in samples):
            continue
        values = [torch.as_tensor(getattr(s, name), dtype=torch.float32).reshape(-1)
                  for s in samples]
        for v, n in zip(values, model_tokens):
            if v.numel() != n:
                raise ValueError(f"{name} has {v.numel()} values for {n} completion tokens "
                                 "of the model")
        buf = per_token[name] = torch.zeros((b, seq), dtype=torch.float32)
        # Row-major order of the mask is sample order, then token order: each sample's
        # values land on its model tokens.
        buf[mask] = torch.cat(values) if values else buf.new_empty(0)
    out = {
        "input_ids": input_ids,
        "position_ids": _position_ids(samples, seq),
        "targets": targets,
        "completion_mask": mask,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "truncated": torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        "lengths": torch.tensor(lengths, dtype=torch.long),
    }
    out.update(per_token)
    out.update(_image_fields(samples, seq))
    if samples and all(s.routed_experts is not None for s in samples):
        out["routed_experts"] = _collate_routing(samples, lengths, seq)
    return out


def _collate_routing(samples: Sequence[Sample], lengths: list[int], seq: int) -> torch.Tensor:
    """[B, S, layers, k] int16 expert ids of each input token; pads take experts 0..k-1
    (any distinct ids: a pad's output reaches no loss)."""
    first = torch.as_tensor(samples[0].routed_experts)
    layers, k = first.shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(samples), seq, layers, k).clone()
    for i, (s, n) in enumerate(zip(samples, lengths)):
        r = torch.as_tensor(s.routed_experts)
        if tuple(r.shape) != (n, layers, k):
            raise ValueError(f"routed_experts of sample {i} has shape {tuple(r.shape)}; its "
                             f"{n} input tokens want ({n}, {layers}, {k})")
        out[i, :n] = r
    return out


def _position_ids(samples: Sequence[Sample], seq: int) -> torch.Tensor:
    """[B, S] ramps; [3, B, S] multimodal rotary positions when a sample has images (text
    rows: three equal ramps; rows with images: the prompt's, then i + rope_delta)."""
    ramp = torch.arange(seq).unsqueeze(0).expand(len(samples), -1).contiguous()
    if all(s.images is None for s in samples):
        return ramp
    out = ramp.unsqueeze(0).repeat(3, 1, 1)
    for i, s in enumerate(samples):
        if s.images is not None:
            out[:, i] = sample_positions(s.images.positions, s.images.rope_delta, seq)
    return out


def _image_fields(samples: Sequence[Sample], seq: int) -> dict:
    """pixel_values [patches, D] and image_grid_thw [n, 3] of the micro-batch's images in row
    order (the order of their tokens in input_ids [B, S], which the model fills in order),
    and image_mask [B, S] (the tokens they fill); nothing for text-only micro-batches."""
    rows = [(i, s.images) for i, s in enumerate(samples) if s.images is not None]
    if not rows:
        return {}
    mask = torch.zeros((len(samples), seq), dtype=torch.bool)
    for i, img in rows:
        mask[i, :img.image_mask.numel()] = img.image_mask
    return {"pixel_values": torch.cat([img.pixel_values for _, img in rows]),
            "image_grid_thw": torch.cat([img.image_grid_thw for _, img in rows]),
            "image_mask": mask}


def cp_shard(batch: dict, cp_size: int, cp_rank: int, sp_size: int = 1) -> dict:
    """This context-parallel rank's share of a collated micro-batch (data/cp_split.py).

    Every [B, S] tensor becomes [B, S_pad / cp_size], S_pad = S padded to a multiple of
    2*cp_size (2*cp_size*sp_size under sequence parallelism: sp_size = TP size): the
    load-balanced chunks r and 2*cp-1-r. input_ids and targets are padded with 0,
    position_ids with their own global positions, completion_mask with False (no loss
    on the padding) and the log-probs with 0. The per-sequence advantages [B] and
    truncated [B] are replicated. "seq_len" (an int) keeps S for `gather_from_cp`.

    Vision-language micro-batches: the 3 x [B, S] mrope position_ids are split like a
    [B, S] one (each section alike), image_mask too; pixel_values and image_grid_thw (the
    whole images: every CP rank runs the tower on all of them) are passed as they are, and
    `image_index` [B, S_pad / cp] tells the model which row of the tower's output each of
    its image tokens takes (counted over the whole micro-batch, `image_rows`).
    """
    batch = dict(batch)
    whole = {k: batch.pop(k) for k in ("pixel_values", "image_grid_thw") if k in batch}
    mrope = batch["position_ids"].dim() == 3
    positions = batch.pop("position_ids") if mrope else None
    if "image_mask" in batch:
        batch["image_index"] = image_rows(batch["image_mask"])
    shard = shard_batch(batch, cp_size, cp_rank, sp_size=sp_size)
    out = dict(shard.tensors)
    if mrope:
        out["position_ids"] = torch.stack([
            shard_batch({"position_ids": p}, cp_size, cp_rank, sp_size=sp_size)["position_ids"]
            for p in positions])
    out.update(whole)
    out["seq_len"] = shard.seq_len
    return out


def split_completion_values(values: torch.Tensor, batch: dict) -> list[torch.Tensor]:
    """[B, S] per-token values -> one CPU tensor per sample, a value per model token of
    its completion (inverse of collate; `values` may live on the model's device)."""
    values = values.detach().cpu()
    return [values[i][batch["completion_mask"][i].cpu()] for i in range(values.shape[0])]


def micro_batches(samples: Sequence[Sample], micro_batch_size: int,
                  pad_to_length: int | None = None, **collate_kwargs) -> list[dict]:
    """Consecutive groups of `micro_batch_size` samples, collated to one common length.

    One length for all: Megatron's pipeline schedule sizes its p2p buffers by it.
    """
    if len(samples) % micro_batch_size:
        raise ValueError(f"{len(samples)} samples do not split into micro-batches of "
                         f"--micro_batch_size {micro_batch_size}")
    longest = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    length = max(longest, pad_to_length or 0)
    return [collate(samples[i:i + micro_batch_size], pad_to_length=length, **collate_kwargs)
            for i in range(0, len(samples), micro_batch_size)]


# ---- the data-parallel layout of a generation batch ----------------------------------------
# The batch's n samples form n / per_step optimizer steps of per_step consecutive samples;
# DP rank r trains on every dp-th sample of each step, starting at r:
#     sample i of rank r's share of step k  =  sample k * per_step + r + dp * i of the batch.
# With `group` > 1 (loss_type real: its loss needs each group's rows together) the unit is
# a block of `group` consecutive samples instead of one: rank r takes blocks r, r + dp, ...
# `dp_indices` is the one statement of that rule; `dp_shard` applies it, `dp_unshard` undoes it.

def dp_indices(n: int, per_step: int, dp: int, dp_rank: int, group: int = 1) -> list[list[int]]:
    """Batch indices of DP rank `dp_rank`'s samples, one list per optimizer step."""
    if group > 1 and per_step % (group * dp):
        raise ValueError(f"a step of {per_step} samples does not split into whole groups of "
                         f"{group} over {dp} data-parallel ranks")
    return [[k * per_step + b * group + j for b in range(dp_rank, per_step // group, dp)
             for j in range(group)] for k in range(n // per_step)]


def dp_shard(items: Sequence, per_step: int, dp: int, dp_rank: int, group: int = 1) -> list[list]:
    """DP rank `dp_rank`'s items of a generation batch, one list per optimizer step."""
    return [[items[j] for j in idx] for idx in dp_indices(len(items), per_step, dp, dp_rank, group)]


def dp_unshard(shards: Sequence[Sequence[Sequence]], n: int, per_step: int, group: int = 1) -> list:
    """Inverse of `dp_shard`: `shards[r]` is DP rank r's `dp_shard` (values in its layout)
    -> the n values in batch order. Raises when a rank's share does not fit the layout."""
    dp = len(shards)
    out: list = [None] * n
    filled = [False] * n
    for rank, shard in enumerate(shards):
        idx = dp_indices(n, per_step, dp, rank, group)
        if [len(part) for part in shard] != [len(part) for part in idx]:
            raise ValueError(f"DP rank {rank}'s share has {[len(p) for p in shard]} values per "
                             f"step; the layout of {n} samples wants {[len(p) for p in idx]}")
        for part, where in zip(shard, idx):
            for value, j in zip(part, where):
                out[j], filled[j] = value, True
    if not all(filled):
        raise ValueError(f"dp_unshard: no value for samples "
                         f"{[j for j in range(n) if not filled[j]][:8]} of {n}")
    return out
