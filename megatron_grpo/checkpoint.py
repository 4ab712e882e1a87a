"""Atomic, resumable training checkpoints on Megatron's distributed checkpointing.

    save_checkpoint(out, step, chunks, optimizer, scheduler,
                    extra_state={"step": step, "sampler": sampler.state_dict()},
                    save_total_limit=cfg.save_total_limit)
    extra = resume(out, chunks, optimizer, scheduler)   # None on a fresh run
    load_checkpoint(path, chunks, finetune=True)        # weights only: a new run from them

(`resume` is find_latest_checkpoint + load_checkpoint; it also takes a checkpoint-N path.)

Layout of `out/checkpoint-{step}/` (`out/latest` names the newest committed one):

    dist/             Megatron distributed checkpoint: model ("model", or "model0", ...
                      per virtual stage), optimizer, LR scheduler. Tensors are stored by
                      global name and offset: weights and (default sharding) optimizer
                      state load under another TP / PP / VPP / DP, also with fewer kv
                      heads than TP (saved unreplicated: model/kv_replication.py).
    rank_00000.pt ..  per global rank: RNG states and `extra_state`. Restored only under
                      the saving layout (RNG streams belong to a rank); otherwise rank 0's
                      `extra_state` is returned and the RNG is left alone.
    checkpoint.json   written last by rank 0: step, time, layout, what is inside.

ms-swift's checkpoint flags: `save_optim=False` (--no_save_optim) leaves the optimizer
state (Adam moments) out, and a resume from such a checkpoint restarts it with a warning
(the LR scheduler is still saved: the schedule continues); `save_rng=False` (--no_save_rng)
leaves the RNG states out (a resume keeps the generators as they are, with a warning);
`load_checkpoint(..., finetune=True)` (--finetune with --resume PATH) loads the weights
only: the caller starts a new run at step 0.

Atomicity. Everything is written into the hidden sibling `.checkpoint-{step}.tmp`;
after all ranks are done (barrier) rank 0 writes checkpoint.json, fsyncs the tree,
renames the folder to its final name (an atomic rename on one file system) and
replaces `latest` (write a temporary file, fsync, os.replace). A crash at any point
leaves either no `checkpoint-{step}` at all or a complete one; hidden folders are
never considered by `find_latest_checkpoint` and are swept by the next save.
Deletions (save_total_limit) rename first and delete second, for the same reason.
All ranks must see one shared file system (as for Megatron's own checkpoints).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from bridge.hf_checkpoint import copy_hf_side_files

from .model.builder import unwrap
from .model.kv_replication import checkpoint_load_metadata
from .model.lora import is_lora_state, lora_settings
from .platform.compat.megatron import (adam_step_fixed_on_load, in_process_save_results,
                                      is_distributed_optimizer, regroup_loaded_optimizer_state,
                                      torch_adam_distributed_optimizers, torch_optimizers)

logger = logging.getLogger("megatron_grpo.checkpoint")

FORMAT_VERSION = 1
META_FILE = "checkpoint.json"
HF_CONFIG_DIR = "hf_config"   # config.json and tokenizer files beside the weights
LATEST_FILE = "latest"
# How DistributedOptimizer lays out its state on disk (Megatron's names).
# dp_reshardable (the default, as Megatron-LM's and ms-swift's): each rank writes its own
# flat buffers, nothing is gathered; a resume keeps TP/PP/EP (DP may change).
# fully_reshardable (--dist_ckpt_optim_fully_reshardable): the whole state all-gathered
# onto every rank (or DP rank 0 only: --distrib_optim_fully_reshardable_mem_efficient) and
# written as canonical per-parameter tensors, loadable under any TP/PP/DP; the gather
# costs 12 bytes a parameter on those ranks during the save (6 GB each for a 0.5B model).
OPTIM_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


# ---------------------------------------------------------------- RNG states
def collect_rng_state() -> dict:
    """This rank's RNG states: python, numpy, torch CPU, CUDA and Megatron's tracker.

    On a CPU-only machine Megatron's "CUDA" tracker states are CPU generator states
    (platform.cpu), so the same dict covers both cases.
    """
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # get_states() hands out the tracker's own tensors: copy them.
        "tracker": {k: v.clone() for k, v in tracker.get_states().items()},
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of collect_rng_state (the generators continue exactly where they were)."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {k: v.clone() for k, v in state["tracker"].items()})


# ---------------------------------------------------------------- paths
def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in output_dir as (step, path), oldest first.

    Complete means a `checkpoint-N` folder holding checkpoint.json; the temporary
    and being-deleted folders are hidden names and never match.
    """
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, META_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(output_dir: str) -> Optional[str]:
    """The checkpoint to resume from, or None.

    `latest` wins when it names a complete checkpoint (it is the last committed save,
    even if an older run left higher-numbered folders); otherwise the highest step.
    """
    ckpts = list_checkpoints(output_dir)
    try:
        with open(os.path.join(output_dir, LATEST_FILE)) as f:
            name = f.read().strip()
        for _, path in ckpts:
            if os.path.basename(path) == name:
                return path
    except OSError:
        pass
    return ckpts[-1][1] if ckpts else None


def checkpoint_in(path: str) -> Optional[str]:
    """`path` itself when it is a complete checkpoint-N folder, else the newest checkpoint
    of the output_dir `path` (None: it holds none yet)."""
    return path if os.path.isfile(os.path.join(path, META_FILE)) else \
        find_latest_checkpoint(path)


def resume(resume_from: str, chunks: list, optimizer=None, scheduler=None) -> Optional[dict]:
    """Load a checkpoint-N folder, or the latest checkpoint of an output_dir.

    Returns the saved extra_state, or None when an output_dir holds no checkpoint yet
    (a fresh run). Collective.
    """
    path = checkpoint_in(resume_from)
    if path is None:
        return None
    logger.info("resuming from %s", path)
    return load_checkpoint(path, chunks, optimizer, scheduler)


def read_metadata(path: str) -> dict:
    meta_file = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{path} is not a complete checkpoint (no {META_FILE}); pass a "
                         "checkpoint-N folder written by save_checkpoint, or use "
                         "find_latest_checkpoint(output_dir)")
    with open(meta_file) as f:
        return json.load(f)


def _params_dtype(chunks) -> Optional[str]:
    first = next((p for c in chunks for p in c.parameters()), None)
    return str(first.dtype).replace("torch.", "") if first is not None else None


def check_resume_dtype(meta: dict, chunks, path: str) -> None:
    """A run continues in the dtype it was saved in: its optimizer state (fp32 main copies
    of bf16 weights, or none for fp32 ones) only loads into the same kind of optimizer."""
    saved, now = meta.get("params_dtype"), _params_dtype(chunks)
    if saved and now and saved != now:
        flag = "true" if saved == "bfloat16" else "false"
        raise ValueError(
            f"{path} was saved by a run training in {saved}; this run trains in {now}. Fix: "
            f"--bf16 {flag} to resume it (an unset --bf16 follows the dtype in --model's "
            f"config.json), or --finetune true to start a new {now} run from its weights")


# ---------------------------------------------------------------- file helpers
def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path) or ".")


def _remove_dir(path: str) -> None:
    """Hide the folder first (rename), then delete it: a crash never leaves a half
    deleted folder under a name that find_latest_checkpoint would pick."""
    hidden = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleting")
    if os.path.exists(hidden):
        shutil.rmtree(hidden)
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def _sweep_leftovers(output_dir: str) -> None:
    """Remove temporary / half-deleted folders left by saves that crashed."""
    for name in os.listdir(output_dir):
        if name.startswith(".checkpoint-") and name.endswith((".tmp", ".deleting")):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.pt")


def _write_rank_state(path: str, rank: int, state: dict) -> None:
    with open(_rank_file(path, rank), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- state dicts
def _layout() -> dict:
    """The parallel layout the per-rank files belong to."""
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            # MoE: the experts' own split (each EP rank has its own expert RNG stream).
            "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size()}


def _same_layout(saved: dict) -> bool:
    """`saved` (checkpoint.json's layout) is this run's; files written before the layout
    recorded ep/etp had Megatron's defaults (EP 1, expert TP = TP)."""
    return {"ep": 1, "etp": saved.get("tp"), **saved} == _layout()


def _prime_optimizer_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its per-parameter state before a load.

    Its state_dict() reads the Adam step from the per-parameter state, which torch's
    Adam creates only at the first step (it asserts on a fresh optimizer). One step
    with zero gradients and lr = weight_decay = 0 creates that state without moving a
    weight; the load then overwrites it in place. Only where Megatron-Core runs torch's
    own Adam (no Apex / TE fused Adam, e.g. on CPU); `compat.megatron.adam_step_fixed_on_load`
    repairs the rest of that path.
    """
    for opt in torch_adam_distributed_optimizers(optimizer):
        for inner in torch_optimizers(opt):
            if len(inner.state) > 0:
                continue
            saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
            for g in inner.param_groups:
                g["lr"], g["weight_decay"] = 0.0, 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for g, (lr, wd) in zip(inner.param_groups, saved):
                g["lr"], g["weight_decay"] = lr, wd
                for p in g["params"]:
                    p.grad = None


def _optimizer_has_state(optimizer) -> bool:
    """Whether any per-parameter state (Adam moments) exists on this rank."""
    return any(len(o.state) > 0 for o in torch_optimizers(optimizer))


def _any_rank(flag: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return any(flags)


def _layers_partly_frozen(chunks) -> bool:
    """Whether a parameter trains in some decoder layers (or experts) and is frozen in
    others, on any rank (--freeze_parameters decoder.layers.3, say). Megatron stacks a
    parameter's layers into one sharded tensor, so the optimizer state of the training
    layers alone is not a whole tensor, which a fully reshardable save refuses: such a run
    saves its optimizer state as each rank's buffers (dp_reshardable: a resume keeps the
    TP/PP layout)."""
    trains: dict = {}
    for chunk in chunks:
        for name, param in unwrap(chunk).named_parameters():
            key = re.sub(r"\.\d+\.", ".N.", name)    # layers, experts: stacked
            trains.setdefault(key, set()).add(param.requires_grad)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trains)
    merged: dict = {}
    for part in gathered:
        for key, values in part.items():
            merged.setdefault(key, set()).update(values)
    return any(len(values) > 1 for values in merged.values())


def _sharded_state_dict(chunks, optimizer, scheduler, is_loading: bool,
                        optim_sharding_type: str, extra_metadata: Optional[dict] = None) -> dict:
    # Megatron's own key names: "model" for one chunk, "model{i}" per virtual stage.
    # Keys inside are global (layer numbers offset by stage), so the dict structure
    # need not match between save and load.
    metadata = {"distrib_optim_sharding_type": optim_sharding_type,
                # New-style keys without a "chained_{i}." prefix where that is possible.
                "chained_optim_avoid_prefix": True, **(extra_metadata or {})}
    sd: dict[str, Any] = {}
    if len(chunks) == 1:
        sd["model"] = unwrap(chunks[0]).sharded_state_dict(metadata=dict(metadata))
    else:
        for i, chunk in enumerate(chunks):
            sd[f"model{i}"] = unwrap(chunk).sharded_state_dict(metadata=dict(metadata))
    settings = lora_settings(chunks)
    if settings is not None:
        # LoRA: the frozen base comes from --model; a checkpoint holds the adapters and the
        # --modules_to_save parameters only (and, below, their optimizer state: the
        # optimizer holds nothing else).
        for key in [k for k in sd if k.startswith("model")]:
            sd[key] = {k: v for k, v in sd[key].items() if is_lora_state(k, settings)}
    if optimizer is not None:
        if is_loading:
            _prime_optimizer_state(optimizer)
        # The optimizer maps its state onto the model's ShardedTensors by parameter.
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                       metadata=dict(metadata))
    if scheduler is not None and not is_loading:
        # Plain values: rank 0 stores them in dist/common.pt, every rank gets them back.
        sd["scheduler"] = scheduler.state_dict()
    return sd


# ---------------------------------------------------------------- save
def save_checkpoint(output_dir: str, step: int, chunks: list, optimizer=None, scheduler=None,
                    extra_state: Optional[dict] = None, *,
                    save_total_limit: Optional[int] = None,
                    optim_sharding_type: str = "dp_reshardable", mem_efficient: bool = False,
                    hf_config_dir: Optional[str] = None, save_optim: bool = True,
                    save_rng: bool = True) -> str:
    """Write output_dir/checkpoint-{step} atomically on every rank; returns its path.

    chunks: this rank's model chunks (DDP-wrapped or not); optimizer: Megatron's
    (plain, distributed or chained); scheduler: an OptimizerParamScheduler;
    extra_state: this rank's trainer state (step, sampler position, config), anything
    torch.save takes. save_total_limit: keep at most this many checkpoints, deleting
    the oldest (never the one just written). hf_config_dir: the HF model the run
    started from; its config and tokenizer files (not its weights) are copied into
    `hf_config/`, so that `megatron export --to_hf --mcore_model checkpoint-N` can
    convert the checkpoint on its own. save_optim / save_rng False: leave the optimizer
    state / the RNG states out (--no_save_optim / --no_save_rng; module docstring).
    Collective: call on all ranks.
    """
    _check_save_args(step, save_total_limit, optim_sharding_type)
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = checkpoint_path(output_dir, step)
    tmp = os.path.join(output_dir, f".checkpoint-{step}.tmp")
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        _sweep_leftovers(output_dir)
        os.makedirs(os.path.join(tmp, "dist"))  # dist_checkpointing wants it to exist
    dist.barrier()

    started = time.time()
    optim_status = _optimizer_status(optimizer, save_optim)
    if optim_status == "saved" and optim_sharding_type == "fully_reshardable" and \
            _layers_partly_frozen(chunks):
        optim_sharding_type = "dp_reshardable"
    sd = _sharded_state_dict(chunks, optimizer if optim_status == "saved" else None,
                             scheduler, False, optim_sharding_type,
                             {"distrib_optim_fully_reshardable_mem_efficient": True}
                             if mem_efficient else None)
    in_process_save_results()          # a synchronous save: no Manager process to start
    dist_checkpointing.save(sd, os.path.join(tmp, "dist"))
    _write_rank_state(tmp, rank, {"rng": collect_rng_state() if save_rng else None,
                                  "extra_state": extra_state})
    dist.barrier()

    error = None
    if rank == 0:
        try:
            if hf_config_dir:
                copy_hf_side_files(hf_config_dir, os.path.join(tmp, HF_CONFIG_DIR))
            meta = _save_metadata(step, chunks, started, optim_status, optim_sharding_type,
                                  scheduler is not None, save_rng, extra_state, hf_config_dir)
            _commit(output_dir, tmp, final, meta, save_total_limit)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
            error = f"{type(e).__name__}: {e}"
            logger.exception("committing checkpoint %s failed", final)
    status = [error]
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise RuntimeError(f"saving checkpoint {final} failed on rank 0: {status[0]}")
    return final


def _check_save_args(step, save_total_limit, optim_sharding_type: str) -> None:
    """ValueError for a bad step, limit or sharding type, before any rank writes a byte."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if save_total_limit is not None and (not isinstance(save_total_limit, int)
                                         or save_total_limit < 1):
        raise ValueError(f"--save_total_limit must be a positive integer or unset, got "
                         f"{save_total_limit!r}")
    if optim_sharding_type not in OPTIM_SHARDING_TYPES:
        raise ValueError(f"optim_sharding_type {optim_sharding_type!r} is not one of "
                         f"{OPTIM_SHARDING_TYPES}")


def _optimizer_status(optimizer, save_optim: bool) -> Optional[str]:
    """What a checkpoint records of the optimizer: None (none given), "not_saved"
    (--no_save_optim: a resume restarts the optimizer state), "fresh" (never stepped on
    any rank: there is no per-parameter state to save, and loading it would need state
    that is not there, so a new optimizer is that state) or "saved". Collective."""
    if optimizer is None:
        return None
    if not save_optim:
        return "not_saved"
    return "saved" if _any_rank(_optimizer_has_state(optimizer)) else "fresh"


def _save_metadata(step: int, chunks, started: float, optim_status: Optional[str],
                   optim_sharding_type: str, has_scheduler: bool, save_rng: bool,
                   extra_state: Optional[dict], hf_config_dir: Optional[str]) -> dict:
    """checkpoint.json's contents: what is inside, the layout it was saved under (a resume
    checks it) and, for LoRA, the adapter settings and the base model export rebuilds."""
    import megatron.core

    meta = {"format_version": FORMAT_VERSION, "step": step, "time": time.time(),
            "params_dtype": _params_dtype(chunks),
            "versions": {"torch": torch.__version__,
                         "megatron_core": getattr(megatron.core, "__version__", "?")},
            "save_seconds": round(time.time() - started, 3),
            "layout": _layout(), "num_model_chunks": len(chunks),
            "contents": {"model": True, "optimizer": optim_status,
                         "scheduler": has_scheduler, "rng": save_rng,
                         "extra_state": sorted((extra_state or {}).keys())},
            "optim_sharding_type": optim_sharding_type}
    settings = lora_settings(chunks)
    if settings is not None:   # adapters only: export rebuilds the base from HF
        meta["lora"] = {**dataclasses.asdict(settings), "base_model": os.path.abspath(
            hf_config_dir) if hf_config_dir else None}
    return meta


def _commit(output_dir: str, tmp: str, final: str, meta: dict,
            save_total_limit: Optional[int]) -> None:
    """Rank 0, after every rank has written `tmp`: checkpoint.json, fsync, the atomic
    rename to `final`, then `latest` and the pruning of old checkpoints (module docstring,
    "Atomicity": a crash leaves no checkpoint-{step} or a complete one)."""
    _write_atomic(os.path.join(tmp, META_FILE), json.dumps(meta, indent=1))
    _fsync_tree(tmp)
    if os.path.exists(final):  # an earlier run reached this step: replace it
        _remove_dir(final)
    os.rename(tmp, final)
    _fsync_path(output_dir)
    _write_atomic(os.path.join(output_dir, LATEST_FILE), os.path.basename(final))
    if save_total_limit is not None:
        _prune(output_dir, save_total_limit, keep=final)


def _prune(output_dir: str, limit: int, keep: str) -> None:
    """Delete the oldest checkpoints so that at most `limit` remain, never `keep`."""
    others = [p for _, p in list_checkpoints(output_dir) if p != keep]
    excess = len(others) - (limit - 1)
    for path in others[:max(excess, 0)]:
        logger.info("save_total_limit=%d: deleting %s", limit, path)
        _remove_dir(path)


# ---------------------------------------------------------------- load
def _check_dp_reshardable(saved: dict, path: str) -> None:
    """A distributed optimizer's flat buffers (dp_reshardable) load under the saving
    TP / PP / VPP / EP / expert-TP sizes only; ValueError naming the ways out."""
    saved = {"ep": 1, "etp": saved.get("tp"), **saved}
    now = _layout()
    moved = [f"{k} {saved.get(k)} -> {now[k]}" for k in ("tp", "pp", "vpp", "ep", "etp")
             if saved.get(k) != now[k]]
    if moved:
        raise ValueError(
            f"{path}: its optimizer state was saved as each rank's flat buffers "
            f"(dp_reshardable), which load under the saving layout only, and this run changes "
            f"{', '.join(moved)}. Fix: resume with the saving sizes (DP may change), or load "
            "the weights only (--resume PATH --finetune true), or save with "
            "--dist_ckpt_optim_fully_reshardable true to move a run between layouts")


def load_checkpoint(path: str, chunks: list, optimizer=None, scheduler=None, *,
                    load_rng: bool = True, finetune: bool = False) -> Optional[dict]:
    """Restore what save_checkpoint wrote into this rank's objects; returns extra_state.

    optimizer / scheduler None: not restored (e.g. weights only, for evaluation or a
    new run). The model loads under any TP/PP/VPP/DP; the per-rank RNG states and
    extra_state need the saving layout, otherwise rank 0's extra_state is returned
    and the RNG streams are left as they are (with a warning). A checkpoint saved
    without optimizer state (--no_save_optim) leaves `optimizer` as it is (fresh, with
    a warning); one saved without RNG states leaves the generators as they are.
    finetune (ms-swift's --finetune): load the weights only, nothing else, and return
    None: the caller starts a new run (step 0, its own optimizer, schedule, RNG and data
    order) from them. Collective.
    """
    meta = read_metadata(path)
    given_optimizer = optimizer
    if finetune:
        optimizer, scheduler, load_rng = None, None, False
        logger.info("--finetune: loading the weights of %s only; the run starts at step 0",
                    path)
    optimizer = _optimizer_to_load(meta, path, chunks, optimizer)
    if scheduler is not None and not meta["contents"]["scheduler"]:
        raise ValueError(f"{path} holds no LR scheduler state; pass scheduler=None")
    _load_states(path, meta, chunks, optimizer, scheduler)
    if optimizer is None and given_optimizer is not None:
        # Its state not loaded (finetune, no_save_optim, fresh): a mixed-precision optimizer
        # still holds fp32 main params copied from the weights it was built on, and its first
        # step would write them back over the loaded ones.
        given_optimizer.reload_model_params()
    own = _load_rank_state(path, meta, load_rng)
    dist.barrier()
    return None if finetune else own["extra_state"]


def _optimizer_to_load(meta: dict, path: str, chunks, optimizer):
    """`optimizer` if the checkpoint's optimizer state is to be loaded into it, else None
    (saved without it, or before the first step); ValueError where it cannot load (none
    saved, another dtype, another expert parallel size without the distributed optimizer).
    Checked before any tensor is read, so a refused resume changes nothing."""
    contents = meta["contents"]
    if optimizer is not None and contents["optimizer"] == "not_saved":
        logger.warning("checkpoint %s was saved without optimizer state (--no_save_optim): "
                       "the optimizer restarts (Adam moments zero, its step count 0); the LR "
                       "schedule continues", path)
        optimizer = None
    if optimizer is not None and contents["optimizer"] is None:
        raise ValueError(f"{path} holds no optimizer state; pass optimizer=None to load "
                         "the weights only")
    if contents["optimizer"] == "fresh":
        optimizer = None  # saved before the first step: a new optimizer is that state
    if optimizer is None:
        return None
    check_resume_dtype(meta, chunks, path)
    saved_ep, ep = meta["layout"].get("ep", 1), _layout()["ep"]
    if (saved_ep > 1) != (ep > 1) and not is_distributed_optimizer(optimizer):
        # Megatron chains a dense and an expert optimizer at EP > 1 and one at EP = 1; only
        # the distributed optimizer's state is regrouped across that (regroup_loaded_...).
        raise ValueError(f"{path} was saved at --expert_model_parallel_size {saved_ep}; its "
                         f"optimizer state loads at --expert_model_parallel_size {ep} only with "
                         "--use_distributed_optimizer true (on both runs). Fix: resume at "
                         f"--expert_model_parallel_size {saved_ep}, or load the weights only "
                         "(--resume PATH --finetune true)")
    return optimizer


def _load_states(path: str, meta: dict, chunks, optimizer, scheduler) -> None:
    """The distributed checkpoint into the chunks (LoRA: the adapters only, the base came
    from --model), and into `optimizer` / `scheduler` where given (flat optimizer buffers
    only under the saving TP/PP layout: ValueError otherwise). Collective."""
    if optimizer is not None and meta["optim_sharding_type"] == "dp_reshardable" and \
            is_distributed_optimizer(optimizer):
        _check_dp_reshardable(meta["layout"], path)
    from megatron.core import dist_checkpointing

    dist_dir = os.path.join(path, "dist")
    # Replicated kv heads saved by an older version load only at their own TP (ValueError).
    qkv_metadata = checkpoint_load_metadata(dist_dir, chunks, path)
    sd = _sharded_state_dict(chunks, optimizer, None, True, meta["optim_sharding_type"],
                             qkv_metadata)
    loaded = dist_checkpointing.load(sd, dist_dir)
    settings = lora_settings(chunks)   # LoRA: adapters only; the base came from --model
    lora = settings is not None
    for i, chunk in enumerate(chunks):
        missing, _ = unwrap(chunk).load_state_dict(
            loaded["model" if len(chunks) == 1 else f"model{i}"], strict=not lora)
        if lora and any(is_lora_state(k, settings) for k in missing):
            raise RuntimeError(f"checkpoint {path}: adapter tensors missing: "
                               f"{[k for k in missing if is_lora_state(k, settings)][:5]}")
    if optimizer is not None:
        # no_grad: with fp32 weights the distributed optimizer's main params are views
        # of the model's leaf params, and the dp_reshardable loader copies into them.
        # A checkpoint of another expert parallel size chained its optimizers otherwise.
        state = regroup_loaded_optimizer_state(optimizer, loaded["optimizer"])
        with adam_step_fixed_on_load(optimizer), torch.no_grad():
            optimizer.load_state_dict(state)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])


def _load_rank_state(path: str, meta: dict, load_rng: bool) -> dict:
    """This rank's file ({"rng", "extra_state"}), restoring its RNG states when asked and
    the layout is the saving one; under another layout rank 0's file (RNG streams belong
    to a rank, so they are left alone, with a warning)."""
    rank = dist.get_rank()
    same_layout = _same_layout(meta["layout"])
    if not same_layout:
        logger.warning("checkpoint %s was saved with layout %s, now %s: RNG states are not "
                       "restored and rank 0's extra_state is used", path, meta["layout"],
                       _layout())
    # Our own files: full unpickling is needed for python/numpy RNG states.
    own = torch.load(_rank_file(path, rank if same_layout else 0), weights_only=False)
    if same_layout and load_rng:
        if own["rng"] is not None:
            restore_rng_state(own["rng"])
        elif rank == 0:
            logger.warning("checkpoint %s was saved without RNG states (--no_save_rng): the "
                           "random number generators are not restored", path)
    return own
