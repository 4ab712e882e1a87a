"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name through
`collective_rpc`, so the same code serves the colocated engine (in-process) and the
server's worker processes (by name: no pickled callables cross process boundaries).

Weights are replaced with vLLM's layer-wise reload (`initialize_layerwise_reload` ...
`finalize_layerwise_reload`, the mechanism of vLLM's own weight-transfer engines),
loading eagerly (reload.py): the incoming tensors go through the model's own
`load_weights` (HF names, fusion, TP slicing) straight into a fresh copy of their
layer, which is post-processed again and copied into the live tensors once complete. The re-processing matters on CPU, where vLLM packs linear
weights for oneDNN after loading and empties the `weight` parameters: a plain
`load_weights` into the live model fails there ("Attempted to load weight ... into
parameter (torch.Size([0]))"), after leaving the packed copies of the tensors it did
load stale. Extra memory is one layer at a time when buckets arrive in layer order,
never a second model.
"""
from __future__ import annotations

import os
from typing import Collection, List, Sequence, Tuple

import torch

from ..platform.compat import vllm as compat
from . import reload
from .routing import RoutingCapture
from .verify import fingerprint, vllm_fingerprint_pieces

# A spawned worker of a vision-language server: the patches its parent applied.
compat.inherited_image_patches()


class RolloutWorkerExtension:
    """Mixed into vLLM's Worker: `self` is the worker (model_runner, model_config, ...)."""

    def _mg_model(self) -> torch.nn.Module:
        return compat.worker_model(self)

    def mg_begin_weight_update(self) -> None:
        """Put every layer into reload mode (eager where reload.py supports it)."""
        self._mg_eager = reload.supported() and os.environ.get("MG_EAGER_RELOAD", "1") != "0"
        if self._mg_eager:
            self._mg_layers = reload.begin(self._mg_model())
        else:
            compat.begin_layerwise_reload(self._mg_model())

    def mg_load_weights(self, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (HF name, full tensor); returns how many tensors it held."""
        model = self._mg_model()
        if getattr(self, "_mg_eager", False):
            from . import reload

            with torch.no_grad():
                # Each tensor is copied into its layer as it arrives; what a layer
                # still references of the bucket afterwards is cloned (reload.py).
                reload.load(model, named_tensors)
            return len(named_tensors)
        with torch.no_grad():
            # Layer-wise reload keeps the tensors of a layer it has not finished (a layer
            # split over buckets; the padded embedding, processed last). The producer
            # reuses its bucket buffer, so vLLM must hold copies, not views of it: without
            # the clone a multi-bucket sync silently loads overwritten data.
            model.load_weights((n, t.clone()) for n, t in named_tensors)
        return len(named_tensors)

    def mg_load_weights_file(self, path: str) -> int:
        """Load one bucket from a safetensors file (server mode: the bucket's bytes
        arrive over HTTP and reach the worker processes through the page cache)."""
        from safetensors.torch import load_file

        return self.mg_load_weights(list(load_file(path).items()))

    def mg_finish_weight_update(self) -> None:
        """Process layers still waiting (e.g. attention) and drop derived caches."""
        model = self._mg_model()
        if getattr(self, "_mg_eager", False):
            from . import reload

            layers, self._mg_layers, self._mg_eager = self._mg_layers, ([], []), False
            _reprocess_tied(model, done=reload.finish(model, self.model_config, layers))
        else:
            compat.finish_layerwise_reload(model, self.model_config)
            _reprocess_tied(model)
        compat.repack_cpu_moe_after_update(model)  # MoE on vLLM-CPU: see compat/vllm.py
        compat.reset_worker_caches(self)

    def mg_fingerprint_pieces(self) -> List[dict]:
        """Fingerprints of the HF slices this worker holds (see verify.py)."""
        return vllm_fingerprint_pieces(self._mg_model())

    def mg_capture_routing(self) -> int:
        """Start recording the experts every MoE layer routes each token to (routing.py);
        returns the number of MoE layers."""
        self._mg_routing = RoutingCapture(self)
        return len(self._mg_routing.layers)

    def mg_take_routing(self, sequences: Sequence[Sequence[int]]) -> list:
        """The recorded routing [tokens, layers, k] of each token sequence (routing.py)."""
        return self._mg_routing.take(sequences)

    # ---------------------------------------------------------------- adapter-only LoRA sync
    # The base weights stay as loaded at start; each sync sends the adapter's PEFT
    # tensors (full, unsharded: vLLM's LoRA layers slice them for their TP rank) in
    # buckets, and finish builds the adapter from them under a new id, replacing the old.
    def mg_begin_adapter_update(self) -> None:
        self._mg_adapter = {}

    def mg_load_adapter(self, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> int:
        """Keep one bucket of (PEFT name, full tensor) (copies: the producer reuses its
        buffers)."""
        for name, tensor in named_tensors:
            if name in self._mg_adapter:
                raise ValueError(f"adapter update: {name!r} arrived twice")
            self._mg_adapter[name] = tensor.detach().to("cpu", copy=True)
        return len(named_tensors)

    def mg_load_adapter_file(self, path: str) -> int:
        """One adapter bucket from a safetensors file (server mode, as mg_load_weights_file)."""
        from safetensors.torch import load_file

        return self.mg_load_adapter(list(load_file(path).items()))

    def mg_finish_adapter_update(self, lora_id: int, peft_config: dict) -> int:
        """Register the received tensors as adapter `lora_id`, the only one vLLM holds."""
        tensors, self._mg_adapter = self._mg_adapter, {}
        if not tensors:
            raise ValueError("adapter update: no tensors arrived")
        compat.worker_set_lora(self, lora_id, tensors, peft_config)
        return len(tensors)

    def mg_adapter_fingerprints(self) -> dict:
        """Fingerprints of the adapter this worker holds (see verify.py)."""
        held = compat.worker_lora_tensors(self)
        return {"ids": held["ids"], "active": held["active"],
                "slot_problems": held["slot_problems"],
                "dtypes": sorted({str(t.dtype) for _, t in held["tensors"]}),
                "tensors": {name: fingerprint(t) for name, t in held["tensors"]}}

    def mg_tp_rank(self) -> Tuple[int, int]:
        """(rank, size) of this worker in vLLM's tensor parallel group."""
        return compat.tp_rank_and_size()


WORKER_EXTENSION = f"{RolloutWorkerExtension.__module__}.{RolloutWorkerExtension.__qualname__}"



def _reprocess_tied(model: torch.nn.Module, done: Collection[int] = ()) -> None:
    """Re-run weight post-processing of every module that shares a parameter with
    another (tied embeddings: lm_head.weight is embed_tokens.weight).

    vLLM's layer-wise reload processes a shared parameter through one owner only.
    On CPU the LM head keeps its own oneDNN-packed copy of the weight for the logits
    GEMM, which then stays stale: the model would sample from the old LM head with
    the new embeddings (verify.py's packed-copy check catches exactly this). Only
    unquantized methods are re-run: for them processing is idempotent (on GPU a
    no-op, on CPU a fresh packing of the current weight). `done`: ids of modules
    already processed after this update (reload.py's direct layers).
    """
    owners = {}
    for _, module in model.named_modules():
        for _, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            if id(module) in done:
                continue
            method = getattr(module, "quant_method", None)
            if method is not None and compat.is_unquantized_method(method):
                method.process_weights_after_loading(module)
