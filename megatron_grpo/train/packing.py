"""Padded micro-batches -> packed (THD) micro-batches, for `--padding_free true`.

A padded micro-batch (`batch.collate`) is [B, S]: row i holds n_i = len(prompt) +
len(completion) - 1 model tokens and S - n_i pads, which every layer computes anyway.
Packed, the rows sit one after the other in a single row of T = sum_i n_i tokens and
the attention keeps them apart by their boundaries (`cu_seqlens`, Megatron's
`PackedSeqParams` with qkv_format "thd"); RoPE restarts in every sequence.

    rows (n = 3, 5):   [a0 a1 a2 p p]        packed: [a0 a1 a2 b0 b1 b2 b3 b4]
                       [b0 b1 b2 b3 b4]      cu_seqlens = [0, 3, 8]

Lengths. Under CP each sequence is padded to m_i, a multiple of 2*cp, and split into
2*cp chunks (Megatron's THD convention, data/cp_split.py); m_i = n_i otherwise. The
packed length sum_i m_i is then padded up to `total_length` (every micro-batch of one
pipeline schedule call needs the same length: the p2p buffers) and to a multiple of
2*cp*sp (sp: the TP size under sequence parallelism). That padding is a filler: one or
more sequences no longer than the longest real one, attending to themselves only, their
outputs dropped.

What `pack_micro_batch` returns for CP rank r (all of it from the padded batch):

    input_ids, position_ids, targets  [1, T/cp]   model inputs and the kernel's targets;
                                                   positions restart at 0 per sequence
    cu_seqlens, cu_seqlens_padded     [k+1] int32  real / padded boundaries (k sequences
                                                   incl. the filler); max_seqlen: int
    row_index, row_valid              [B, L]       the row view: slot (i, j) is this rank's
                                                   j-th token of sequence i, at row_index in
                                                   the packed [T/cp]; valid: a real token
    completion_mask, *_logps          [B, L]       the padded batch's per-token tensors in
                                                   the row view (False / 0 where not valid)
    advantages, truncated, lengths    [B]          as they were
    row_positions_all (cp > 1)        [cp, B, L]   every rank's row positions, to gather

Vision-language micro-batches (position_ids [3, B, S], images): image_mask and
`image_index` (model/mrope.py image_rows: each image token's row of the tower's output,
counted over the unpacked micro-batch) are packed like input_ids; pixel_values and image_grid_thw
pass as they are; position_ids become the WHOLE packed row's mrope positions [3, 1, T]
(every CP rank's tokens): Megatron's THD rotary code takes each sequence's chunks from
that row by the padded offsets (`_apply_rotary_pos_emb_thd`, freqs of length T), and
model/vision.py switches the mrope module's own CP slice off.

L = S for cp = 1 (the row view is then the padded layout itself); max_i m_i / cp under CP
(the layout of a CP shard). The loss runs on the row view exactly as on a padded batch or
CP shard, so packing changes neither the loss nor its normalisation (docs/architecture.md, "Loss normalisation").
"""
from __future__ import annotations

from typing import Optional

import torch

from ..data.cp_split import local_positions, packed_local_positions, pad_sequence

# Per-token tensors that feed the model (packed); every other [B, S] tensor goes to the
# row view for the loss.
MODEL_INPUTS = ("input_ids", "position_ids", "targets", "routed_experts", "image_mask",
                "image_index", "token_valid")
WHOLE = ("pixel_values", "image_grid_thw")     # the images: not per token


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _sequence_multiple(cp_size: int) -> int:
    return 2 * cp_size if cp_size > 1 else 1


def packed_length(batch: dict, cp_size: int = 1, sp_size: int = 1) -> int:
    """T of `batch` packed (before any common `total_length`): sum of its sequences'
    padded lengths, rounded up to a multiple of 2*cp*sp."""
    step = _sequence_multiple(cp_size)
    total = sum(_round_up(int(n), step) for n in batch["lengths"].tolist())
    return _round_up(total, step * sp_size)


def _row_positions(padded: list[int], lengths: list[int], cu: list[int], cp_size: int,
                   cp_rank: int, width: int, pad_col: int):
    """Row view of CP rank `cp_rank`: (index into its packed tokens, position in the padded
    row) per slot [B, width]; invalid slots: index 0, position pad_col."""
    b = len(padded)
    index = torch.zeros((b, width), dtype=torch.long)
    position = torch.full((b, width), pad_col, dtype=torch.long)
    for i, m in enumerate(padded):
        k = m // cp_size
        index[i, :k] = cu[i] // cp_size + torch.arange(k)
        position[i, :k] = local_positions(m, cp_size, cp_rank)
    valid = position < torch.tensor(lengths).unsqueeze(1)
    return index.masked_fill(~valid, 0), position.masked_fill(~valid, pad_col), valid


def pack_micro_batch(batch: dict, *, cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1,
                     total_length: Optional[int] = None) -> dict:
    """The packed micro-batch of CP rank `cp_rank` (module docstring) from a collated one."""
    if "lengths" not in batch:
        raise ValueError("pack_micro_batch needs the 'lengths' of a batch from train.batch.collate")
    if "image_mask" in batch:
        from ..model.mrope import image_rows

        batch = dict(batch, image_index=image_rows(batch["image_mask"]))
    lengths = [int(n) for n in batch["lengths"].tolist()]
    b, s = batch["input_ids"].shape
    step = _sequence_multiple(cp_size)
    padded = [_round_up(n, step) for n in lengths]
    real_total = sum(padded)
    total = _round_up(max(real_total, total_length or 0), step * sp_size)
    filler = total - real_total
    # The filler as pieces no longer than the longest sequence: attention cost and RoPE
    # length stay those of the real sequences (each piece a multiple of 2*cp too).
    longest = max(padded)
    fill = [longest] * (filler // longest) + ([filler % longest] if filler % longest else [])
    segments, real = padded + fill, lengths + fill
    cu = [0] + torch.tensor(segments).cumsum(0).tolist()
    cu_real = [0] + torch.tensor(real).cumsum(0).tolist()
    # Widen the padded batch so that a pad column exists past every sequence: CP padding
    # and the filler read it (pad values: 0 / False).
    width = max(s, max(padded)) + 1
    pad_col = width - 1
    rows = torch.cat([torch.full((m,), i) for i, m in enumerate(padded)]
                     + ([torch.zeros(filler, dtype=torch.long)] if filler else []))
    cols = torch.cat([torch.arange(m) for m in padded]
                     + ([torch.full((filler,), pad_col)] if filler else []))
    positions = torch.cat([torch.arange(m) for m in segments])     # restart per sequence
    mine = packed_local_positions(cu, cp_size, cp_rank)              # [T / cp]

    def packed(t: torch.Tensor) -> torch.Tensor:                     # [B, S] -> [1, T / cp]
        return pad_sequence(t, width, 1, 0)[rows, cols][mine].unsqueeze(0)

    view = max(padded) // cp_size if cp_size > 1 else s
    index, position, valid = _row_positions(padded, lengths, cu, cp_size, cp_rank, view, pad_col)
    out = {}
    for name, t in batch.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or name in WHOLE:
            out[name] = t                                   # per-sequence values, as they are
        elif name == "position_ids" and t.dim() == 3:       # mrope: the whole row [3, 1, T]
            out[name] = pad_sequence(t, width, 2, 0)[:, rows, cols].unsqueeze(1)
        elif name in MODEL_INPUTS:
            out[name] = positions[mine].unsqueeze(0) if name == "position_ids" else packed(t)
        else:                                               # loss inputs -> the row view
            out[name] = pad_sequence(t, width, 1, 0).gather(1, position.to(t.device))
    out.update(row_index=index, row_valid=valid,
               cu_seqlens=torch.tensor(cu_real, dtype=torch.int32),
               cu_seqlens_padded=torch.tensor(cu, dtype=torch.int32),
               max_seqlen=max(segments), seq_len=s)
    if cp_size > 1:
        out["row_positions_all"] = torch.stack([
            _row_positions(padded, lengths, cu, cp_size, r, view, pad_col)[1]
            for r in range(cp_size)])
    return out


def packed_seq_params(batch: dict):
    """Megatron's PackedSeqParams (THD) of a packed micro-batch (tensors on its device).

    On CPU our core attention reads the padded boundaries (model/cp_attention.py). On GPU
    Transformer Engine's attention takes all of it as is (Megatron turns the causal mask
    into padding_causal for thd; under CP TE wants each sequence padded to 2*cp, as here):
    written for it but NOT yet run on a GPU."""
    from megatron.core.packed_seq_params import PackedSeqParams

    m = int(batch["max_seqlen"])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch["cu_seqlens"],
                           cu_seqlens_kv=batch["cu_seqlens"],
                           cu_seqlens_q_padded=batch["cu_seqlens_padded"],
                           cu_seqlens_kv_padded=batch["cu_seqlens_padded"],
                           max_seqlen_q=m, max_seqlen_kv=m)


def to_rows(packed_values: Optional[torch.Tensor], batch: dict) -> Optional[torch.Tensor]:
    """Per-token outputs on the packed tokens [1, T/cp] -> the row view [B, L] (0 where not
    valid; a batch that is not packed: as is). Differentiable (a gather)."""
    if packed_values is None or "row_index" not in batch:
        return packed_values
    rows = packed_values[0][batch["row_index"]]
    return torch.where(batch["row_valid"], rows, torch.zeros_like(rows))
