"""Per-chunk math of the fused log-prob/entropy kernel, in plain torch (the CPU backend).

The chunk loop in `logprob.py` computes one logits tile `z = hidden_chunk @ w_chunk^T / temperature`
(fp32, `[ct, cv]`) at a time and hands it to a backend object with two methods:

- `forward_update(z, tgt, m, s, a, zt, compute_entropy, scratch)`: fold the tile into the running
  per-token statistics (updated in place, each `[ct]` fp32):
      m  = running max of z,
      s  = sum_j exp(z_j - m),
      a  = sum_j exp(z_j - m) * (z_j - m)        (only when compute_entropy),
      zt = the target's logit (summed: only one tile holds it).
  `a` is kept relative to the running max rather than as sum exp(z-m)*z: the entropy is then
  log(s) - a/s with no cancellation against m, which would lose digits when logits are large.
- `backward_grad(z, tgt, lse, ent, g_lp, g_ent, scratch)`: turn the recomputed tile into dL/dz, where
      dlogp/dz_j = [j == target] - p_j,
      dH/dz_j    = -p_j * (z_j - E_p[z]) = -p_j * (log p_j + H),
  with p = exp(z - lse) from the global (whole-vocab, whole-TP-group) log-sum-exp.
  The result may be written into `z` or `scratch`.

`scratch` is a second fp32 buffer of the tile's shape, reused from tile to tile (a backend may
ignore it); `z` may be overwritten.

`tgt` `[ct]` int64 is the target's column inside this tile, or -1 when the target lies in
another tile (or on another TP rank). The Triton backend (`triton_logprob.py`) implements the
same two methods with one fused pass each; everything else (matmuls, TP) is shared.
"""
from __future__ import annotations

from typing import Optional

import torch


class TorchChunkOps:
    """The torch implementation of the per-tile statistics and gradient (any device)."""

    name = "torch"

    @staticmethod
    def forward_update(z: torch.Tensor, tgt: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                       a: torch.Tensor, zt: torch.Tensor, compute_entropy: bool,
                       scratch: torch.Tensor) -> None:
        # z, scratch: [ct, cv] fp32 (both overwritten); tgt: [ct] int64;
        # m, s, a, zt: [ct] fp32 (updated in place).
        hit = tgt >= 0
        picked = z.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1)  # [ct]
        zt.add_(torch.where(hit, picked, torch.zeros_like(picked)))

        m_new = torch.maximum(m, z.amax(dim=1))                  # [ct]
        z.sub_(m_new.unsqueeze(1))                               # z - m_new, in place
        e = torch.exp(z, out=scratch)                            # [ct, cv]
        # Rescale the running sums from the old max to the new one; exp(-inf) = 0 covers the
        # first tile (m = -inf, s = a = 0).
        alpha = torch.exp(m - m_new)                             # [ct]
        if compute_entropy:
            # sum e^(z-m_new)(z-m_new) over earlier tiles = alpha * (a + (m - m_new) * s);
            # the where() avoids (-inf) * 0 on the first tile.
            shift = torch.where(s > 0, m - m_new, torch.zeros_like(s)) * s
            s_tile = e.sum(dim=1)
            a.copy_(alpha * (a + shift) + e.mul_(z).sum(dim=1))   # e is spent: no 3rd tile
        else:
            s_tile = e.sum(dim=1)
        s.copy_(alpha * s + s_tile)
        m.copy_(m_new)

    @staticmethod
    def backward_grad(z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor,
                      ent: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
                      g_ent: Optional[torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
        # z: [ct, cv] fp32 logits/temperature; z and scratch are overwritten;
        # lse, ent, g_*: [ct] fp32.
        z.sub_(lse.unsqueeze(1))                                 # log p
        p = torch.exp(z, out=scratch)                            # [ct, cv]
        if g_ent is not None:
            # dz = -p * (g_lp + g_ent * (log p + H)) + g_lp * onehot
            #    = p * (c - g_ent * log p) + g_lp * onehot,  c = -(g_lp + g_ent * H)
            c = -(g_ent * ent) if g_lp is None else -(g_lp + g_ent * ent)
            torch.addcmul(c.unsqueeze(1), z, (-g_ent).unsqueeze(1), out=z)
            dz = z.mul_(p)
        else:
            dz = p.mul_((-g_lp).unsqueeze(1))
        if g_lp is not None:
            hit = tgt >= 0
            add = torch.where(hit, g_lp, torch.zeros_like(g_lp)).unsqueeze(1)
            dz.scatter_add_(1, tgt.clamp(min=0).unsqueeze(1), add)
        return dz
