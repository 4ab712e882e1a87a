"""Megatron-Core beyond its public API: every internal name megatron-grpo uses, each
behind a small function (see compat/__init__.py for the rules).

Public and used directly elsewhere: `parallel_state`, `tensor_parallel` (its
public functions), `GPTModel` and the layer specs, `TransformerConfig`,
`DistributedDataParallel`, `get_megatron_optimizer`, `get_forward_backward_func`,
`dist_checkpointing`.

What is not, by user:
- platform/cpu.py: the CPU layer replaces the RNG tracker's CUDA state functions
  (private) and the default causal mask (built with device="cuda").
- model/cp_attention.py: the rotary embedding's CP slicing (built with pin_memory,
  which a CPU-only torch refuses).
- rollout/offload.py: where DDP keeps its gradient buffers and where the Megatron
  optimizers keep their torch optimizers (instance attributes, no accessor).

Megatron modules import such functions by name, so replacing one means replacing
every reference in every loaded `megatron.core` module (`_rebind`).

Verified on megatron-core 0.16.1 (Python 3.11, CPU); the range is setup.py's.
Not here yet: megatron_grpo/checkpoint.py's DistributedOptimizer patch
(`_set_main_param_and_optimizer_states`, `distrib_optimizer.HAVE_APEX_OR_TE`).
"""
from __future__ import annotations

import sys
from typing import Callable, List

from . import check_version as _check_range

LOWER, UPPER = (0, 16), (0, 20)     # setup.py's megatron-core>=0.16,<0.20
VERIFIED = "megatron-core 0.16.1"

PRIVATE_NAMES = (
    # platform/cpu.py
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron.core.transformer.utils:get_default_causal_mask",
    # model/cp_attention.py
    "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
    # rollout/offload.py (instance attributes of these classes: buffers,
    # expert_parallel_buffers, grad_data; chained_optimizers, optimizer, is_stub_optimizer)
    "megatron.core.distributed:DistributedDataParallel",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer",
    "megatron.core.optimizer.optimizer:ChainedOptimizer",
)
RNG_LOGGER = "megatron.core.tensor_parallel.random"   # the RNG tracker's logger

_checked = False


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_version() -> None:
    """Raise UntestedVersionError (once per call until it passes) on a Megatron-Core
    outside LOWER..UPPER; every function here calls it first."""
    global _checked
    if not _checked:
        _check_range("Megatron-Core", installed_version(), LOWER, UPPER, VERIFIED, "megatron")
        _checked = True


def _rebind(module, name: str, replacement: Callable) -> Callable:
    """Replace function `module.name` by `replacement` there and in every loaded
    megatron.core module that imported it by name; returns the original."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron.core") and \
                getattr(mod, name, None) is original:
            setattr(mod, name, replacement)
    return original


# ------------------------------------------------------------------ CPU layer
def set_cuda_rng_state_functions(get_state: Callable, set_state: Callable) -> None:
    """Make the RNG tracker read and write generator states with these functions.

    The tracker (`tensor_parallel.random`) calls its private `_get_cuda_rng_state` /
    `_set_cuda_rng_state`, which use the CUDA generator; there is no hook to give it
    another. Signatures in 0.16: get(device="cuda", clone=False, graph_safe=False),
    set(new_state, device=-1, graph_safe=False)."""
    check_version()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def set_default_causal_mask(fn: Callable[[int], object]) -> None:
    """Replace `transformer.utils.get_default_causal_mask(sq)` (it builds the mask with
    device="cuda"), everywhere it was imported."""
    check_version()
    from megatron.core.transformer import utils as tutils

    _rebind(tutils, "get_default_causal_mask", fn)


def rope_cp_slicing() -> Callable:
    """The rotary embedding's CP slicing now in use (`get_pos_emb_on_this_cp_rank`)."""
    check_version()
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.get_pos_emb_on_this_cp_rank


def set_rope_cp_slicing(fn: Callable) -> None:
    """Replace `rope_utils.get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group)`
    (its index tensor uses pin_memory=True), everywhere it was imported."""
    check_version()
    from megatron.core.models.common.embeddings import rope_utils

    _rebind(rope_utils, "get_pos_emb_on_this_cp_rank", fn)


# ------------------------------------------------------------------ offload.py
def ddp_grad_buffers(chunk) -> list:
    """grad_data of a DistributedDataParallel chunk's buffers (dense and expert), []
    for an unwrapped module. Instance attributes in 0.16 (`buffers` on a plain
    nn.Module is a method, hence vars())."""
    check_version()
    attrs = vars(chunk)
    buffers = list(attrs.get("buffers", []) or []) + \
        list(attrs.get("expert_parallel_buffers", []) or [])
    return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]


def torch_optimizers(optimizer) -> List:
    """The torch optimizers inside what `get_megatron_optimizer` returns (chained,
    mixed-precision, distributed: `chained_optimizers`, `optimizer`,
    `is_stub_optimizer` in 0.16), or [optimizer] for a torch optimizer."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    check_version()
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if getattr(optimizer, "is_stub_optimizer", False) or inner is None:
        return []  # a rank with no parameters in this group (e.g. an empty PP stage group)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"offload_optimizer: {type(optimizer).__name__}.optimizer is a "
                        f"{type(inner).__name__}, not a torch.optim.Optimizer")
    return [inner]
