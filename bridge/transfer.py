"""A reused buffer for the TP all-gathers that cannot land in place.

When the blocks the TP ranks contribute are not contiguous in the output (row-parallel
weights: rank r holds columns [r*w, (r+1)*w) of every row; q blocks of several query
groups per rank) or need a dtype cast, each rank copies its block into this buffer
(casting on the way), the all-gather runs on the buffer, and every rank copies the
gathered blocks to their places. The buffer is allocated once per export, so the
communication library only ever holds references to long-lived memory, and blocks
larger than it are moved in pieces of whole rows (or of parts of one row).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

_ALIGN = 64
MIN_BYTES = 4096  # room for an all-gather of a few elements per rank
# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _blocks(rows: int, width: int, cap: int) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) tiles of a [rows, width] block, each of at most `cap` elements."""
    if width <= cap:
        step = cap // width
        for r0 in range(0, rows, step):
            yield r0, min(rows, r0 + step), 0, width
    else:
        for r in range(rows):
            for c0 in range(0, width, cap):
                yield r, r + 1, c0, min(width, c0 + cap)


class TransferBuffer:
    """A reused byte buffer of `nbytes` on `device` for all-gathers."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = max(MIN_BYTES, nbytes // _ALIGN * _ALIGN)
        self._buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        size = dtype.itemsize
        return self._buf[offset:offset + n * size].view(dtype).view(shape)

    def all_gather(self, dsts: list[torch.Tensor], src: torch.Tensor, group) -> None:
        """dsts[r][:] = src of group rank r (all [R, W]), one all-gather per buffer load."""
        world = len(dsts)
        dtype = dsts[0].dtype
        size = dtype.itemsize
        # The input block, then (at the next aligned offset) the world's output blocks.
        cap = max(1, (self.nbytes - _ALIGN) // size // (world + 1))
        rows, width = src.shape
        for r0, r1, c0, c1 in _blocks(rows, width, cap):
            shape = (r1 - r0, c1 - c0)
            n = shape[0] * shape[1]
            inp = self._view(0, (n,), dtype)                        # [n]
            out = self._view(-(-n * size // _ALIGN) * _ALIGN, (world * n,), dtype)  # [world*n]
            inp.view(shape).copy_(src[r0:r1, c0:c1])
            _all_gather_single(out, inp, group=group)
            for r, dst in enumerate(dsts):
                dst[r0:r1, c0:c1].copy_(out[r * n:(r + 1) * n].view(shape))
