"""Small modules the local (non-Transformer-Engine) layer spec needs."""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with Megatron's constructor and sequence-parallel support.

    Megatron's `WrappedTorchNorm` refuses sequence parallelism. Under sequence
    parallelism each TP rank normalises its own slice of the sequence, so the
    weight's gradient is partial per rank; tagging it `sequence_parallel` makes
    Megatron's `finalize_model_grads` all-reduce it across the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
