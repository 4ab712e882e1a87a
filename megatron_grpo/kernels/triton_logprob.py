"""Triton per-tile kernels for the fused log-prob/entropy (GPU backend).

Same interface as `torch_chunk.TorchChunkOps` (see its docstring for the math): the chunk loop,
the logits matmuls (cuBLAS through torch.mm) and the TP collectives in `logprob.py` are shared;
Triton replaces the per-tile elementwise work, which torch spreads over about five passes
over the `[ct, cv]` tile, with one pass each:

- `_fwd_stats_kernel`: one program per token row walks its tile row in BLOCK-wide pieces and
  updates the running (max, sum exp, sum p*(z-max), target logit) online;
- `_bwd_grad_kernel`: one program per (row, BLOCK of columns) writes dL/dz over the tile.

STATUS: the kernels' arithmetic is checked on CPU with Triton's interpreter
(TRITON_INTERPRET=1, tests/test_kernels_triton.py); compiled on a GPU they are UNVERIFIED
(no GPU was available when this was written): check values, gradients and speed there
before relying on them. This module is imported only when a CUDA tensor (or backend="triton")
asks for it; `triton_available()` says whether `triton` imports.
"""
from __future__ import annotations

from typing import Optional

import torch

try:  # triton is optional: absent on most CPU installs
    import triton
    import triton.language as tl

    _TRITON_ERROR: Optional[BaseException] = None
except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    tl = None
    _TRITON_ERROR = exc

# Columns handled per step; a power of two (tl.arange needs one).
_BLOCK_FWD = 1024
_BLOCK_BWD = 1024


def triton_available() -> bool:
    """True when `triton` imports (it can then run on CUDA, or on CPU in interpreter mode)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _fwd_stats_kernel(z_ptr, stride_z, tgt_ptr, m_ptr, s_ptr, a_ptr, zt_ptr, n_cols,
                          COMPUTE_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        a = tl.load(a_ptr + row)
        zt = tl.load(zt_ptr + row)
        tgt = tl.load(tgt_ptr + row)                       # column in this tile, or -1
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(z_row + cols, mask=mask, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            alpha = tl.exp(m - m_new)                      # 0 on the first block (m = -inf)
            # Masked columns: d = 0 and e = 0, so no -inf * 0 = NaN is ever formed.
            d = tl.where(mask, x - m_new, 0.0)
            e = tl.where(mask, tl.exp(d), 0.0)
            if COMPUTE_ENTROPY:
                # Rescale a to the new max; on the first block s = 0 and m = -inf.
                shift = tl.where(s > 0, m - m_new, 0.0) * s
                a = alpha * (a + shift) + tl.sum(e * d, axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            m = m_new
            zt += tl.sum(tl.where(cols == tgt, x, 0.0), axis=0)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(a_ptr + row, a)
        tl.store(zt_ptr + row, zt)

    @triton.jit
    def _bwd_grad_kernel(z_ptr, stride_z, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, n_cols,
                         HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        ptrs = z_ptr + row.to(tl.int64) * stride_z + cols
        x = tl.load(ptrs, mask=mask, other=0.0)
        logp = x - tl.load(lse_ptr + row)
        p = tl.exp(logp)
        dz = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_GLP:   # d logp / dz_j = [j == target] - p_j
            glp = tl.load(glp_ptr + row)
            tgt = tl.load(tgt_ptr + row)
            dz += tl.where(cols == tgt, glp, 0.0) - glp * p
        if HAS_GENT:  # d H / dz_j = -p_j (log p_j + H)
            gent = tl.load(gent_ptr + row)
            ent = tl.load(ent_ptr + row)
            dz -= gent * p * (logp + ent)
        tl.store(ptrs, dz, mask=mask)


class TritonChunkOps:
    """The Triton implementation of the per-tile statistics and gradient."""

    name = "triton"

    @staticmethod
    def forward_update(z: torch.Tensor, tgt: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                       a: torch.Tensor, zt: torch.Tensor, compute_entropy: bool,
                       scratch: torch.Tensor) -> None:
        # z: [ct, cv] fp32, contiguous; [ct] vectors contiguous; scratch is not needed.
        ct, cv = z.shape
        _fwd_stats_kernel[(ct,)](z, z.stride(0), tgt.contiguous(), m, s, a, zt, cv,
                                 COMPUTE_ENTROPY=bool(compute_entropy), BLOCK=_BLOCK_FWD)

    @staticmethod
    def backward_grad(z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor,
                      ent: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
                      g_ent: Optional[torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
        ct, cv = z.shape   # dL/dz is written over z; scratch is not needed
        # Unused pointers get any valid tensor; the constexpr flags compile their loads out.
        _bwd_grad_kernel[(ct, triton.cdiv(cv, _BLOCK_BWD))](
            z, z.stride(0), tgt.contiguous(), lse,
            ent if ent is not None else lse, g_lp if g_lp is not None else lse,
            g_ent if g_ent is not None else lse, cv,
            HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None, BLOCK=_BLOCK_BWD)
        return z
