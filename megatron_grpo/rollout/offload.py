"""Megatron's parameters and optimizer state out of device memory while vLLM generates.

    offload_model(policy.chunks)          # after the optimizer step and the weight sync
    offload_optimizer(policy.optimizer)
    completions = engine.generate(...)    # vLLM gets the memory
    onload_optimizer(policy.optimizer)
    onload_model(policy.chunks)           # before the next forward (old/ref log-probs)

How: storage by storage, in place. Each tensor storage (a parameter, the DDP
parameter buffer of the distributed optimizer, an Adam moment) is copied to a
host backup and then resized to 0 bytes; onload resizes it back and copies the
backup in. Every tensor object and every view therefore survives unchanged:
parameters that view DDP's parameter buffer, `main_grad` views of the grad
buffer, the distributed optimizer's fp32 shards (views of the parameter buffer),
the optimizer's `state[param]` entries. Nothing holding a reference (DDP
buckets, optimizer groups, the bridge's export plan) has to be told.
Megatron-Core's own `MegatronOptimizer.offload_to_cpu` (0.16) instead rebinds
`p.data` to a new CPU tensor, which cuts such views and, for the plain fp32
optimizer, moves the model's own parameters; its DDP
`offload_grad_buffers` / `_ParamAndGradBuffer.offload_to_cpu` use the same
resize-to-0 idea as here, for the DDP buffers only.

Where Megatron-Core 0.16.1 keeps the optimizer's tensors (`optimizer` from
`get_megatron_optimizer`, a `ChainedOptimizer` of one wrapper per param group
kind, each with `.optimizer`, a `torch.optim` Adam/SGD):
- `inner.state[p]`: exp_avg, exp_avg_sq (and the `step` counter, a host scalar
  unless capturable) keyed by the tensors the inner optimizer updates;
- `inner.param_groups[i]["params"]`: those tensors. For `FP32Optimizer` they are
  the model's parameters (offload_model's business). For
  `Float16OptimizerWithFloat16Params` they are fp32 main copies
  (`fp32_from_float16_groups`, plus the model's fp32 parameters). For
  `DistributedOptimizer` they are `shard_fp32_from_float16_groups` (fp32 copies
  of bf16/fp16 shards) and `shard_fp32_groups` (views into the DDP parameter
  buffer, i.e. the model's). Owned copies are plain tensors that view nothing;
  the model's are `nn.Parameter`s or views: that is the rule used below.

Gradients are not kept: DDP grad buffers (and any plain `.grad` of a parameter or
of an owned main copy) are freed without a backup and come back as zeros. Call
the offloads between an optimizer step and the next `zero_grad_buffer`, which
the trainer runs at the start of every step anyway.

On CPU the backup is host memory too, so parameters and optimizer state trade
one host copy for another (no saving; two copies of the model per round trip),
while gradient buffers are really freed. The code path is the same as on GPU,
which is what the tests exercise. With CUDA the backups are pinned and kept for
the next round trip (allocating pinned memory is slow), as Megatron keeps its
`param_data_cpu`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence

import torch

from ..platform.compat import megatron as compat

_STATE_ATTR = "_mg_offload_state"


@dataclass
class _Moved:
    storage: torch.UntypedStorage           # the live storage: 0 bytes while offloaded
    nbytes: int
    backup: Optional[torch.UntypedStorage]  # host copy; None: dropped (gradients)


@dataclass
class _OffloadState:
    moved: List[_Moved] = field(default_factory=list)
    offloaded: bool = False
    cache: List[Optional[torch.UntypedStorage]] = field(default_factory=list)  # pinned backups


def _key(storage: torch.UntypedStorage) -> int:
    return storage.data_ptr()


def _storages(tensors: Iterable[torch.Tensor], exclude: set) -> Iterator[torch.UntypedStorage]:
    """Distinct, allocated storages of `tensors`, none whose key is in `exclude` (updated)."""
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or _key(storage) in exclude:
            continue  # nothing to move, or already listed (views, tied weights)
        exclude.add(_key(storage))
        yield storage


def _offload(owner, keep: Iterable[torch.Tensor], drop: Iterable[torch.Tensor], what: str) -> int:
    """Back up the storages of `keep` on the host, free them and those of `drop`.

    Returns the bytes freed. The record lives on `owner` until `_onload(owner)`.
    """
    state: _OffloadState = getattr(owner, _STATE_ATTR, None) or _OffloadState()
    if state.offloaded:
        raise RuntimeError(f"{what} is already offloaded: call the matching onload first "
                           "(a second offload would overwrite the host backup)")
    pin = torch.cuda.is_available()
    seen: set = set()
    kept = list(_storages(keep, seen))      # listed first: a storage in both is kept
    dropped = list(_storages(drop, seen))
    moved = []
    for i, storage in enumerate(kept):
        n = storage.nbytes()
        if not storage.resizable():
            raise RuntimeError(f"{what}: a storage of {n} bytes cannot be resized (memory "
                               "mapped or borrowed from another library), so it cannot be "
                               "offloaded in place")
        backup = state.cache[i] if i < len(state.cache) else None
        if backup is None or backup.nbytes() != n:
            backup = torch.empty(n, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        backup.copy_(storage)                # blocking: done before the storage is freed
        moved.append(_Moved(storage, n, backup))
    for storage in dropped:
        moved.append(_Moved(storage, storage.nbytes(), None))
    freed = 0
    for m in moved:  # free only once every backup is complete
        m.storage.resize_(0)
        freed += m.nbytes
    state.moved, state.offloaded = moved, True
    setattr(owner, _STATE_ATTR, state)
    if pin:
        torch.cuda.empty_cache()             # hand the freed blocks to vLLM
    return freed


def _onload(owner, what: str) -> int:
    """Reallocate what `_offload` freed on `owner`, restore backups, zero dropped ones."""
    state: Optional[_OffloadState] = getattr(owner, _STATE_ATTR, None)
    if state is None or not state.offloaded:
        raise RuntimeError(f"{what} is not offloaded: nothing to onload")
    restored = 0
    for m in state.moved:
        m.storage.resize_(m.nbytes)
        if m.backup is not None:
            m.storage.copy_(m.backup)
        else:
            m.storage.fill_(0)
        restored += m.nbytes
    # Pinned backups are reused next time; plain host ones are freed now.
    state.cache = [m.backup for m in state.moved if m.backup is not None and m.backup.is_pinned()]
    state.moved, state.offloaded = [], False
    return restored


def is_offloaded(obj) -> bool:
    """Whether `obj` (a model chunk or an optimizer) is currently offloaded."""
    state = getattr(obj, _STATE_ATTR, None)
    return bool(state and state.offloaded)


# --------------------------------------------------------------------------- model
def offload_model(chunks: Sequence[torch.nn.Module]) -> int:
    """Move this rank's model chunks (DDP-wrapped or not) off the device.

    Parameters and registered buffers are backed up on the host; gradients (DDP grad
    buffers, `main_grad`, `.grad`) are freed and come back as zeros. Returns the bytes
    freed on the device (on CPU: the bytes moved). Parameters must not be read until
    `onload_model(chunks)`.
    """
    freed = 0
    for chunk in chunks:
        params = list(chunk.parameters())
        # LoRA --modules_to_save: the frozen original kept for the reference (model/lora.py)
        originals = [getattr(p, "lora_original", None) for p in params]
        keep = params + originals + list(torch.nn.Module.buffers(chunk))
        drop = compat.ddp_grad_buffers(chunk) + [getattr(p, "main_grad", None) for p in params] + \
            [p.grad for p in params]
        freed += _offload(chunk, keep, drop, "the model chunk")
    return freed


def onload_model(chunks: Sequence[torch.nn.Module]) -> int:
    """Bring the chunks back: the same tensors, their values restored, gradients zero."""
    return sum(_onload(chunk, "the model chunk") for chunk in chunks)


# --------------------------------------------------------------------------- optimizer
def _owned(t: torch.Tensor) -> bool:
    """An optimizer-owned main copy: not a model parameter, not a view of one."""
    return not isinstance(t, torch.nn.Parameter) and t._base is None


def _optimizer_tensors(optimizer):
    keep, drop = [], []
    for inner in compat.torch_optimizers(optimizer):
        for per_param in inner.state.values():
            keep += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        for group in inner.param_groups:
            for p in group["params"]:
                if _owned(p):
                    keep.append(p)
                    if p.grad is not None and _owned(p.grad):
                        drop.append(p.grad)
    return keep, drop


def offload_optimizer(optimizer) -> int:
    """Move the optimizer state (moments, step counters, fp32 main copies) off the device.

    `optimizer`: what `get_megatron_optimizer` returns (chained, plain, mixed-precision
    or distributed), or a torch optimizer. The model's own parameters are left to
    `offload_model`. Returns the bytes moved.
    """
    keep, drop = _optimizer_tensors(optimizer)
    return _offload(optimizer, keep, drop, "the optimizer")


def onload_optimizer(optimizer) -> int:
    """Bring the optimizer state back (the same tensors, their values restored)."""
    return _onload(optimizer, "the optimizer")
