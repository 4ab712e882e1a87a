"""Megatron-Core beyond its public API: every internal name megatron-grpo uses, each
behind a small function (see compat/__init__.py for the rules).

Public and used directly elsewhere: `parallel_state`, `tensor_parallel` (its
public functions), `GPTModel` and the layer specs, `TransformerConfig`,
`DistributedDataParallel`, `get_megatron_optimizer`, `get_forward_backward_func`,
`dist_checkpointing`.

What is not, by user:
- platform/cpu.py: the CPU layer replaces the RNG tracker's CUDA state functions
  (private) and the default causal mask (built with device="cuda").
- platform/cpu.py also: the first-dim gather / reduce-scatter of `tensor_parallel.mappings`
  with uneven split sizes (the MoE dispatcher's, under ETP): gloo needs equal sizes.
- model/cp_attention.py: the rotary embedding's CP slicing (built with pin_memory,
  which a CPU-only torch refuses).
- rollout/offload.py: where DDP keeps its gradient buffers and where the Megatron
  optimizers keep their torch optimizers (instance attributes, no accessor).
- model/kv_replication.py: which grads the optimizers' gradient norm counts
  (`get_main_grads_for_grad_norm`, per instance) and how their main parameters map onto
  the model's (the optimizers' parameter groups, the distributed optimizer's ranges).

Megatron modules import such functions by name, so replacing one means replacing
every reference in every loaded `megatron.core` module (`_rebind`).

- model/builder.py (MoE models): `moe_utils.te_general_gemm`, a name 0.16.1 uses without
  defining it when Transformer Engine is absent, and `moe_utils.maybe_move_tensor_to_cpu`
  (split sizes of CPU tensors as numpy): moe_without_transformer_engine.
- checkpoint.py: which DistributedOptimizers run torch's own Adam
  (`distrib_optimizer.HAVE_APEX_OR_TE`), and a per-instance wrapper of
  `DistributedOptimizer._set_main_param_and_optimizer_states` that repairs the Adam `step`
  on load; and the results queue of `FileSystemWriterAsync` (`in_process_save_results`).
- platform/__init__.py: `destroy_model_parallel` also destroys the process groups
  parallel_state made (its list of them, `_global_process_group_list`), which Megatron's
  own only forgets.
- cli.py: megatron.core imported with wandb hidden (`import_core`): Megatron's optional
  `wandb` module globals stay None in a run that does not report to wandb.

Verified on megatron-core 0.16.1 (Python 3.11, CPU); the range is setup.py's.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import queue
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
    # platform/cpu.py: the buckets' collectives (module globals)
    "megatron.core.distributed.param_and_grad_buffer:dist_reduce_scatter_func",
    "megatron.core.distributed.param_and_grad_buffer:dist_all_gather_func",
    "megatron.core.optimizer.optimizer:ChainedOptimizer",
    # model/kv_replication.py (instance attributes: float16_groups, fp32_from_float16_groups,
    # fp32_from_fp32_groups; model_float16_groups, model_fp32_groups, shard_fp32_groups,
    # shard_float16_groups, shard_fp32_from_float16_groups)
    "megatron.core.optimizer.optimizer:MegatronOptimizer.get_main_grads_for_grad_norm",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_model_param_range_map",
    # checkpoint.py (instance attributes: model_param_group_index_map, optimizer,
    # chained_optimizers, is_stub_optimizer; the optimizer state dict's layout)
    "megatron.core.optimizer.distrib_optimizer:HAVE_APEX_OR_TE",
    "megatron.core.optimizer.distrib_optimizer:"
    "DistributedOptimizer._set_main_param_and_optimizer_states",
    # model/builder.py and platform/cpu.py (MoE on CPU), model/moe.py (aux-loss metrics)
    "megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
    "megatron.core.transformer.moe.moe_utils:get_moe_layer_wise_logging_tracker",
    "megatron.core.transformer.moe.moe_utils:reduce_aux_losses_tracker_across_ranks",
    "megatron.core.transformer.moe.moe_utils:clear_aux_losses_tracker",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
    # model/moe.py: router replay (a TopKRouter's `router_replay`, `layer_number`)
    "megatron.core.transformer.moe.router:TopKRouter",
    "megatron.core.transformer.moe.router_replay:RouterReplay.set_target_indices",
    "megatron.core.transformer.moe.router_replay:RouterReplay.set_router_replay_action",
    "megatron.core.transformer.moe.router_replay:RouterReplay.clear_indices",
    "megatron.core.transformer.moe.router_replay:RouterReplay.clear_router_replay_action",
    "megatron.core.transformer.moe.router_replay:RouterReplayAction.REPLAY_FORWARD",
    # checkpoint.py: the save's results queue (module global, made on first use)
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
    # cli.py (import_core): the optional `wandb` of the modules megatron.core imports
    "megatron.core.inference.contexts.dynamic_context:HAVE_WANDB",
    "megatron.core.timers:wandb",
    # platform/__init__.py (destroy_model_parallel): the groups parallel_state made
    "megatron.core.parallel_state:_global_process_group_list",
)
RNG_LOGGER = "megatron.core.tensor_parallel.random"   # the RNG tracker's logger

_checked = False


def import_core(hide: tuple = ("wandb",)) -> None:
    """Import megatron.core with the optional packages `hide` unimportable meanwhile.

    `import megatron.core` imports wandb (its inference contexts and timers, for their own
    logging, each inside `try: import wandb / except ImportError`): 0.9-1.0 CPU s of every
    rank's start-up (tools/profile_startup.py), for code this project never runs. A None
    in sys.modules makes such an import raise ImportError (the import system's rule), so
    those modules do without; the entry goes again afterwards, and a run that reports to
    wandb imports it itself (pass hide=() then, so that Megatron sees it too). A no-op
    once megatron.core is imported."""
    if "megatron.core" in sys.modules:
        return
    hidden = [name for name in hide if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        import megatron.core  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def destroy_model_parallel() -> None:
    """`parallel_state.destroy_model_parallel()`, and the process groups it made destroyed.

    Megatron's version sets its globals to None and destroys only its gloo data-parallel
    groups: every other group stays registered in torch.distributed, and a gloo group
    keeps three threads (two workers, one TCP loop) until the process group is destroyed.
    A process that sets up Megatron's groups again and again (a test world running one
    parallel layout after another) piled them up: 36 set-ups in each of 4 ranks on 2
    cores left ~1,600 threads per rank, and the kernel time of their polling loops
    made the same set-ups and collectives take 473 s instead of seconds. The groups are
    those `create_group` listed for this rank (`_global_process_group_list`, None for
    the default group, which stays). They go first: Megatron's own destroy then skips its
    gloo groups, which are gone already (it checks)."""
    check_version()
    import torch.distributed as dist
    from megatron.core import parallel_state

    for group in parallel_state._global_process_group_list or []:   # each group once
        if group is not None:
            dist.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
    # A group's threads end with its last reference. Models built under the old layout
    # hold theirs (DDP, optimizers) in reference cycles: collected now, not whenever the
    # collector next runs (a test world's second layout otherwise kept 16 of 21 alive).
    gc.collect()


def in_process_save_results() -> None:
    """Have `dist_checkpointing.save` collect its writers' results in a plain queue.

    Megatron's file writer forks one process per write bucket; their results reach the
    saving process through a local queue, and from there go into a module-level
    "global" queue that it creates on first use as a `spawn` Manager queue, meant for
    asynchronous saves, whose writer runs in another process. Starting that Manager
    means a fresh interpreter with the caller's imports: 2-3 s at the first save of
    every process (most of a small model's save). Our saves are synchronous
    (checkpoint.py: `dist_checkpointing.save`, no async request), so the put and the get
    happen in this process and a `queue.Queue` does the same job. Call before a save;
    a queue already made (by an earlier save) is kept."""
    check_version()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


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


def set_buffer_collectives(reduce_scatter: Callable, all_gather: Callable) -> None:
    """Replace the collectives Megatron's gradient / parameter buffers call per bucket
    (`param_and_grad_buffer.dist_reduce_scatter_func(out, in, op=, group=, async_op=)`
    and `dist_all_gather_func(out, in, group=, async_op=)`, module globals chosen at
    import). `reduce_scatter(original, ...)` and `all_gather(original, ...)` receive the
    original first."""
    check_version()
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for name, fn in (("dist_reduce_scatter_func", reduce_scatter),
                     ("dist_all_gather_func", all_gather)):
        original = getattr(pgb, name)
        if getattr(original, "_mg_wrapped", False):
            continue
        wrapper = functools.partial(fn, original)
        wrapper._mg_wrapped = True
        setattr(pgb, name, wrapper)


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


def wrap_uneven_first_dim_collectives(gather: Callable, reduce_scatter: Callable) -> None:
    """Wrap `tensor_parallel.mappings._gather_along_first_dim(input_, group,
    output_split_sizes=None, use_global_buffer=False)` and `_reduce_scatter_along_first_dim(
    input_, group, input_split_sizes=None, use_global_buffer=False)`: `gather(original, ...)`
    and `reduce_scatter(original, ...)` receive the original first (private, 0.16)."""
    check_version()
    from megatron.core.tensor_parallel import mappings

    for name, wrapper in (("_gather_along_first_dim", gather),
                          ("_reduce_scatter_along_first_dim", reduce_scatter)):
        original = getattr(mappings, name)
        if not getattr(original, "_megatron_grpo", False):
            fn = functools.partial(wrapper, original)
            fn._megatron_grpo = True
            _rebind(mappings, name, fn)


def moe_step_losses() -> dict:
    """The MoE router losses recorded since the last call ({name: per-layer sums over the
    micro-batches}, e.g. load_balancing_loss, z_loss), reduced by Megatron (summed over
    pipeline stages, averaged over data-parallel ranks); the record is then cleared.
    A loss Megatron records without a reduce group (the z-loss: each rank's mean over its
    own tokens) is averaged here over the tensor x context and data-parallel ranks, which
    Megatron leaves to whoever logs it. Collective over the world when anything was
    recorded."""
    check_version()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    local = [name for name, v in tracker.items() if v.get("reduce_group") is None
             and v.get("avg_group") is None]
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    for name in local:
        values = tracker[name]["values"]
        for group in (ps.get_tensor_and_context_parallel_group(), ps.get_data_parallel_group()):
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)
    out = {name: v["values"].detach().clone() for name, v in sorted(tracker.items())}
    moe_utils.clear_aux_losses_tracker()
    return out


def router_replays(chunk) -> list:
    """(0-based layer index in the whole model, RouterReplay) of each MoE router of a model
    chunk built with `moe_enable_routing_replay` (megatron-core >= 0.16)."""
    check_version()
    from megatron.core.transformer.moe.router import TopKRouter

    return [(int(m.layer_number) - 1, m.router_replay) for m in chunk.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def replay_routing(replay, topk_ids) -> None:
    """Make the router of `replay` route its next forward's tokens [tokens, k] to
    `topk_ids` (its gate weights still come from its own logits, gathered there)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay.set_target_indices(topk_ids)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stop_routing_replay(replay) -> None:
    """Back to the router's own top-k; drops the ids it kept (it keeps every target it
    was given, for recomputation in backward)."""
    replay.clear_indices()
    replay.clear_router_replay_action()


def moe_without_transformer_engine() -> None:
    """Let Megatron's MoE router run without Transformer Engine.

    `transformer.moe.moe_utils` imports `te_general_gemm` only when TE is present, yet its
    `RouterGatingLinearFunction` tests `te_general_gemm is not None` unconditionally
    (NameError in 0.16.1 without TE). Defining the name as None selects its torch path."""
    import torch

    check_version()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The all-to-all dispatcher hands its split sizes to all_to_all_single after
    # `maybe_move_tensor_to_cpu(t, as_numpy=True)`, which converts only CUDA tensors: CPU
    # ones stay tensors, which torch's all_to_all_single refuses as split sizes.
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_megatron_grpo", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megatron_grpo = True
    _rebind(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


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



# ------------------------------------------------------------------ kv_replication.py
def _leaf_optimizers(optimizer) -> List:
    """The Megatron optimizers inside a ChainedOptimizer (or [optimizer]), stubs left out."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _leaf_optimizers(c)]
    return [] if getattr(optimizer, "is_stub_optimizer", False) else [optimizer]


def _model_and_main_params(opt):
    """(model parameter, main parameter, offset of the main parameter in the flattened
    model parameter) for each parameter a leaf Megatron optimizer steps.

    0.16: the distributed optimizer steps flat shards `model.view(-1)[start:end]` (fp32
    copies of fp16/bf16 ones unless precision-aware); the float16 optimizer steps full fp32
    copies of fp16/bf16 parameters and fp32 ones as they are; FP32Optimizer the model's own.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if isinstance(opt, DistributedOptimizer):
        aware = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        low = opt.shard_float16_groups if aware else opt.shard_fp32_from_float16_groups
        for models, mains in [*zip(opt.model_float16_groups, low),
                              *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]:
            for model, main in zip(models, mains):
                if main is not None:
                    yield model, main, opt._get_model_param_range_map(model)["param"].start
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            yield from ((model, main, 0) for model, main in zip(models, mains))
        yield from ((p, p, 0) for group in opt.fp32_from_fp32_groups for p in group)
    else:
        yield from ((p, p, 0) for p in opt.get_parameters())


def restrict_grad_norm(optimizer, counted: dict) -> None:
    """Make the optimizer's gradient norm (for clipping and the one `step` returns) count
    only some elements of some model parameters.

    `counted` maps a model parameter to the `(start, end)` ranges of its flattened
    elements that enter the norm; the others are left out (the update still uses them).
    Parameters not in `counted` count as Megatron decides (shared and TP-duplicate
    parameters once). The hook: every leaf optimizer's `get_main_grads_for_grad_norm`,
    replaced per instance, which all of `clip_grad_norm`, `get_grad_norm` and
    ChainedOptimizer's norm call; its grads are the main parameters' `.grad` (or
    `.decoupled_grad`, precision-aware), found by identity and replaced by views of the
    counted ranges.
    """
    check_version()
    for opt in _leaf_optimizers(optimizer):
        spans = [(main, start, counted[model])
                 for model, main, start in _model_and_main_params(opt) if model in counted]
        if not spans:
            continue

        def grads_for_norm(_original=opt.get_main_grads_for_grad_norm, _spans=spans):
            grads = _original()
            pieces = {}
            for main, start, ranges in _spans:
                for grad in (main.grad, getattr(main, "decoupled_grad", None)):
                    if grad is None:
                        continue
                    flat = grad.view(-1)
                    pieces[id(grad)] = [flat[max(a - start, 0):b - start] for a, b in ranges
                                        if a - start < flat.numel() and b - start > 0]
            return [piece for g in grads for piece in pieces.get(id(g), [g])]

        opt.get_main_grads_for_grad_norm = grads_for_norm



# ------------------------------------------------------------------ checkpoint.py
def torch_adam_distributed_optimizers(optimizer) -> List:
    """The DistributedOptimizers in `optimizer` (chained or not) that run torch's own Adam:
    all of them when neither Apex nor Transformer Engine is installed (0.16's
    `distrib_optimizer.HAVE_APEX_OR_TE`, e.g. on CPU), none otherwise (fused Adam)."""
    check_version()
    from megatron.core.optimizer import distrib_optimizer as dopt

    if getattr(dopt, "HAVE_APEX_OR_TE", True):
        return []
    return [o for o in _leaf_optimizers(optimizer) if isinstance(o, dopt.DistributedOptimizer)]


@contextlib.contextmanager
def adam_step_fixed_on_load(optimizer):
    """Two repairs around DistributedOptimizer.load_state_dict on torch's Adam (0.16).

    1. load_state_dict first restores `step` from the saved param groups, then its
       per-parameter loaders (`_set_main_param_and_optimizer_states`) copy every key of
       the live state: with `step` missing from the loaded tensors (fully_reshardable:
       KeyError) or holding a placeholder (dp_reshardable: the value of the state primed
       for loading). During the load a per-instance wrapper hands the restored live `step`
       in, making that copy a no-op.
    2. It gives every parameter the *same* `step` tensor; torch's foreach Adam then adds
       1 to it once per parameter per step and the bias correction drifts (resumed runs
       diverge from the second step on). Afterwards each parameter gets its own copy.
    Nothing to do with fused Adam (Apex / Transformer Engine): Megatron's code runs as is.
    """
    import torch

    patched = []
    for opt in torch_adam_distributed_optimizers(optimizer):
        original = opt._set_main_param_and_optimizer_states

        def setter(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            live = _opt.optimizer.state[main_param]
            if "step" in live:
                tensors = {**tensors, "step": live["step"]}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = setter
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method
    for opt in patched:
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def is_distributed_optimizer(optimizer) -> bool:
    """Every optimizer in `optimizer` (chained or not; stubs aside) is Megatron's
    DistributedOptimizer."""
    check_version()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return all(isinstance(o, DistributedOptimizer) for o in _leaf_optimizers(optimizer))


def regroup_loaded_optimizer_state(optimizer, loaded: dict):
    """What `dist_checkpointing.load` returned for `optimizer.sharded_state_dict(...)`, in the
    shape `optimizer.load_state_dict` takes, also when the checkpoint's optimizer was chained
    differently from this one.

    Megatron (0.16) chains one optimizer for the dense parameters and one for the experts
    when expert parallel size > 1 (their grads reduce over other groups), and one optimizer
    for all when it is 1. The per-parameter state (fully_reshardable) is stored by parameter
    name and loads into either; the plain part (each optimizer's param groups: `step`, lr,
    the identifiers wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) is stored as
    rank 0 wrote it: `{"optimizer": {"param_groups": [...]}, ...}` for one optimizer,
    `{0: {...}, 1: {...}}` for a chain. After an EP change those no longer line up (a
    KeyError or "Expected 2 entries" inside Megatron): each live param group then takes the
    saved one with its wd/lr identifiers (is_expert_parallel preferred equal, else the
    dense one), keeping its own is_expert_parallel. Returns `loaded` unchanged when the
    shapes match, and for other optimizers than the distributed one (whose EP changes
    are not handled here).
    """
    check_version()
    chained = getattr(optimizer, "chained_optimizers", None)
    subs = list(chained) if chained is not None else [optimizer]   # a chain of 1 at EP=1

    def saved_parts(d):  # the plain dicts rank 0 saved, one per optimizer it had
        if "optimizer" in d:
            return [d]
        return [d[k] for k in sorted(k for k in d if isinstance(k, int)) if "optimizer" in d[k]]

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    saved = saved_parts(loaded)
    if len(saved) == len(subs) or not saved or not all(
            isinstance(o, DistributedOptimizer) or getattr(o, "is_stub_optimizer", False)
            for o in subs):
        return loaded   # the same chain, or not the distributed optimizer's format
    groups = [g for part in saved for g in part["optimizer"]["param_groups"]]
    extra = {k: v for k, v in saved[0].items() if k not in ("optimizer", "param_state")}

    def match(live: dict) -> dict:
        ident = ("wd_mult", "lr_mult", "is_decoupled_lr")
        same = [g for g in groups if all(g.get(k) == live.get(k) for k in ident)]
        if not same:
            raise ValueError(f"checkpoint optimizer: no saved param group with "
                             f"{ {k: live.get(k) for k in ident} } (saved: "
                             f"{[{k: g.get(k) for k in ident} for g in groups]})")
        exact = [g for g in same if g.get("is_expert_parallel") == live.get("is_expert_parallel")]
        return {**(exact or same)[0], "is_expert_parallel": live.get("is_expert_parallel")}

    parts = []
    for i, sub in enumerate(subs):
        own = loaded[i] if len(subs) > 1 else loaded   # the sharded tensors follow the request
        part = {k: v for k, v in own.items() if not isinstance(k, int)}
        live = [] if getattr(sub, "is_stub_optimizer", False) else sub.optimizer.param_groups
        part.update(extra)
        part["optimizer"] = {"param_groups": [match(g) for g in live]}
        parts.append(part)
    return parts if len(subs) > 1 else parts[0]
