"""In-place weight reload for a live vLLM model: vLLM's layer-wise reload, loading eagerly.

vLLM's own layer-wise reload (vllm.model_executor.model_loader.reload, the mechanism of
its weight-transfer engines) puts every layer back on the meta device, BUFFERS each
incoming tensor (a reference to the caller's tensor) until the layer is complete, then
materialises the layer, replays the buffered loads into it, re-runs weight processing
(on CPU: packing the linear weights for oneDNN) and copies the results into the live
kernel tensors. Buffering references costs twice here: the bridge reuses its bucket
buffer, so the worker had to clone every tensor first (a layer can span buckets), and
the weight loaders run twice (a counting dry run on meta tensors, then the replay).

This module keeps vLLM's machinery (its `initialize_layerwise_reload`, its per-layer
processing `_layerwise_process` and its `finalize_layerwise_reload`, so the result is
the same computation) and changes two things. First, for every ordinary layer the
buffering loader is replaced by an eager one, which on the layer's first incoming tensor
materialises the layer (empty tensors of its checkpoint shapes, as vLLM does before the
replay) and from then on runs the original weight loader straight into it, counting
what it copied (vLLM's own `get_numel_loaded`). When the count reaches the layer's
size the layer is processed and copied into the kernel tensors, exactly as vLLM's
replay would; a layer that never completes (vocab padding) is processed by vLLM's
finalize, whose replay then has nothing left to load. The incoming data is copied once,
when it arrives, so nothing keeps a reference to the caller's tensors and no clone is
needed. Deferred attention layers (processed only at finalize, with their scales
reloaded from the buffer) keep vLLM's buffering loader; what they buffered is cloned
at the end of each bucket (`detach_buffered`). Second, a layer whose live tensors are
still in checkpoint format and whose processing is none or unquantized (norms, the
embedding, an LM head; on GPU every unquantized linear too) is not taken apart at all:
its loaders write into the live tensors and its processing is re-run at the end
(`begin`'s "direct" layers), which saves materialising and copying back e.g. the vocab
matrices. The eager loaders are removed again at the end (`finish`), so vLLM's own
`reload_weights` keeps working between our updates.

Memory: as with vLLM's reload, at most the layers in progress are held twice (one
layer at a time when the tensors arrive in layer order).

vLLM-version specific (the private helpers of reload/layerwise.py in vllm 0.32, each
reached through platform/compat/vllm.py); `supported()` says whether they are there, and
the worker falls back to vLLM's buffering reload (with the clone) when they are not, or
when MG_EAGER_RELOAD=0.
"""
from __future__ import annotations

import inspect
from typing import Iterable, Sequence, Tuple

import torch

from ..platform.compat import vllm as compat


def supported() -> bool:
    return compat.reload_helpers_present()


def begin(model: torch.nn.Module) -> tuple:
    """vLLM's `initialize_layerwise_reload`, then for every ordinary layer either the
    direct path or an eager loader.

    Direct: a layer whose live tensors are still in checkpoint format (same names,
    shapes, dtypes and strides as vLLM recorded at load time) and whose processing, if
    any, is unquantized (see _DIRECT_METHODS) gets its live tensors back at once: the
    weight loaders copy straight into them, and finish() re-runs the processing. On CPU
    that covers norms, the embedding and an LM head (the embedding-like weights keep
    their shape; the linear layers' weights are emptied by the oneDNN packing and take
    the eager path). Returns (direct layers, eager layers) for finish()."""
    compat.begin_layerwise_reload(model)
    skip_load = compat.skip_load_tensors()
    direct, eager = [], []
    for layer in model.modules():
        info = compat.layer_reload_info(layer)
        if not info.can_load() or compat.is_deferred_attention_layer(layer):
            continue
        if _can_go_direct(layer, info):
            compat.place_kernel_tensors(layer, info)
            for tensor in compat.layer_tensors(layer).values():
                tensor.weight_loader = compat.original_weight_loader(tensor)
            info.reset()  # vLLM's finalize leaves it alone
            direct.append(layer)
            continue
        for name, tensor in compat.layer_tensors(layer).items():
            if name not in skip_load:
                tensor.weight_loader = _eager_loader(layer, name,
                                                     compat.original_weight_loader(tensor))
        eager.append(layer)
    return direct, eager


def _can_go_direct(layer: torch.nn.Module, info) -> bool:
    # Processing that may be re-run on the live tensors once new checkpoint-format values
    # are in them: none (nothing to process), or vLLM's unquantized linear / embedding
    # method, a function of the current weights (on CPU, packing a copy for the GEMM; on
    # GPU, nothing) that _reprocess_tied already re-runs for the same reason.
    method = getattr(layer, "quant_method", None)
    if method is not None and not compat.reprocessable_in_place(method):
        return False
    if info.kernel_tensors is None:
        return False
    live = {**info.kernel_tensors[0], **info.kernel_tensors[1]}
    recorded = {**info.restore_metadata[0], **info.restore_metadata[1]}
    # Tensors vLLM never puts on meta (bias, ...) are live either way; the rest must
    # match what the checkpoint format says, one to one.
    skip = compat.skip_tensors()
    live = {k: v for k, v in live.items() if k not in skip}
    if live.keys() != recorded.keys():
        return False
    for name, meta in recorded.items():
        t = live[name]
        if t.shape != meta.shape or t.dtype != meta.dtype or t.stride() != meta.stride():
            return False
    return True


def _eager_loader(layer: torch.nn.Module, param_name: str, original):
    """The eager loader of one parameter, made once and kept on the layer
    ({name: (original loader, eager loader)}) while the original loader stays the same."""
    cache = layer.__dict__.setdefault("_mg_eager_loaders", {})
    cached = cache.get(param_name)
    if cached is not None and cached[0] == original:
        return cached[1]
    loader = _make_eager_loader(layer, param_name, original)
    cache[param_name] = (original, loader)
    return loader


def _make_eager_loader(layer: torch.nn.Module, param_name: str, original):
    info = compat.layer_reload_info(layer)  # one object per layer for its lifetime (reset in place)
    signature = inspect.signature(original)

    def online_process_loader(*args, **kwargs):
        if not info.can_load():  # already processed: excessive loading, ignored (as vLLM)
            return None
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        # The layer's checkpoint-format tensors, fresh (uninitialised) on the device,
        # exactly what vLLM's replay loads into (only tensors still on meta: a no-op
        # after the first call); then its size, as vLLM counts it at every call.
        compat.materialize_layer(layer, info)
        info.load_numel_total = compat.layer_size(layer)
        # The caller may hold the layer's meta tensor (its params dict predates the
        # materialisation): load into the layer's current one.
        bound.arguments["param"] = getattr(layer, param_name)
        numel, ret = compat.numel_loaded(original, bound)
        info.load_numel += numel
        if info.load_numel >= info.load_numel_total:
            compat.process_layer(layer, info)  # nothing buffered: process and copy back
        return ret

    loader = compat.as_reload_loader(online_process_loader, original)
    loader._mg_eager = True
    return loader


def load(model: torch.nn.Module, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Load one bucket; the caller may overwrite its tensors as soon as this returns."""
    model.load_weights(iter(named_tensors))
    detach_buffered(model, named_tensors)


def detach_buffered(model: torch.nn.Module, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """Clone whatever a layer still references of the caller's tensors.

    Left after a bucket: what buffering loaders hold (deferred attention layers), and,
    should a weight loader adopt its input instead of copying it, the tensors of a
    layer still in progress. Both are rare; the check is cheap (the storages of the
    bucket against those of unfinished layers)."""
    storages = {_storage(t) for _, t in named_tensors}
    storages.discard(None)
    if not storages:
        return
    for layer, info in compat.layer_reload_infos():
        if not info.can_load() or info.load_numel <= 0:
            continue
        for _, bound in info.loaded_weights:
            for key, value in list(bound.arguments.items()):
                if key != "param" and isinstance(value, torch.Tensor) and \
                        _storage(value) in storages:
                    bound.arguments[key] = value.clone()
        for name, tensor in compat.layer_tensors(layer).items():
            if _storage(tensor) in storages:
                setattr(layer, name, _adopt_copy(tensor))


def _storage(t: torch.Tensor):
    try:
        return None if t.is_meta else t.untyped_storage().data_ptr()
    except (RuntimeError, ValueError):
        return None


def _adopt_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy of `tensor`, same class and attributes (weight_loader etc.)."""
    copy = tensor.data.clone()
    copy.__class__ = tensor.__class__
    copy.__dict__ = tensor.__dict__.copy()
    return copy


def finish(model: torch.nn.Module, model_config, layers: tuple) -> set:
    """vLLM's finalize (layers still waiting: padding, attention; kernel tensors back),
    and the processing of the direct layers. Returns the ids of the modules processed
    here (a tied LM head among them needs nothing more). `layers`: what begin returned.

    Then the eager loaders are taken off every tensor that may still carry one: the
    layer's and vLLM's recorded meta tensors (which it registers again at the next
    reload, and whose loaders it does not re-wrap when they already look wrapped), so
    that a later reload by vLLM itself (`reload_weights`) runs vLLM's own loaders."""
    direct, eager = layers
    try:
        compat.finish_layerwise_reload(model, model_config)
        done = set()
        for layer in direct:
            if getattr(layer, "quant_method", None) is None:
                continue
            compat.reprocess_weights(layer)   # what vLLM's per-layer step does around it
            done.add(id(layer))
        return done
    finally:
        for layer in eager:
            params, buffers = compat.layer_reload_info(layer).restore_metadata
            for tensor in [*compat.layer_tensors(layer).values(), *params.values(),
                           *buffers.values()]:
                if getattr(getattr(tensor, "weight_loader", None), "_mg_eager", False):
                    tensor.weight_loader = compat.original_weight_loader(tensor)
