"""Whether this machine builds Transformer Engine layers (a GPU with TE installed) or
Megatron's local ones (CPU, or no TE)."""
from __future__ import annotations

import torch

try:  # Transformer Engine exists only on GPU machines.
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or a broken CUDA install
    HAVE_TE = False


def use_transformer_engine() -> bool:
    return HAVE_TE and torch.cuda.is_available()
