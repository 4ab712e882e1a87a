"""Whole-checkpoint conversion behind `megatron export`, run inside every rank torchrun started.

    NPROC_PER_NODE=2 megatron export --to_mcore true --model HF_DIR --output_dir MCORE_DIR \\
        --tensor_model_parallel_size 2 [--pipeline_model_parallel_size P] \\
        [--virtual_pipeline_model_parallel_size V] [--test_convert_precision true] \\
        [--expert_model_parallel_size E] [--expert_tensor_parallel_size T]   # MoE models
    megatron export --to_hf true --mcore_model MCORE_DIR --output_dir HF_OUT

--to_mcore: HF safetensors -> the bridge's load -> a Megatron distributed checkpoint
(`dist_checkpointing`, so it loads under any other TP/PP/VPP, kv heads fewer than TP
included: model/kv_replication.py), plus the HF config and
tokenizer files in `MCORE_DIR/hf_config/` (what --to_hf needs to rebuild the model).
--to_hf: the distributed checkpoint loaded at this run's TP/PP -> the bridge's export
stream -> safetensors shards (rank 0 writes) plus the config and tokenizer files.
--test_convert_precision: both models on one sample; prints max and mean |logit diff|.

An output folder that already holds files is left alone unless --overwrite true; the
output is written to `<output_dir>.tmp` first and renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bridge.export import export_hf_weights
from bridge.hf_checkpoint import copy_hf_side_files, write_hf_checkpoint
from bridge.load import load_hf_weights
from bridge.params import unwrap
from megatron_grpo.checkpoint import HF_CONFIG_DIR, META_FILE as TRAIN_META, find_latest_checkpoint
from megatron_grpo.config.hf_model import head_size, model_config
from megatron_grpo.model import build_model, build_transformer_config
from megatron_grpo.model.kv_replication import (checkpoint_load_metadata, legacy_replicated_layout,
                                                saved_query_groups)
from megatron_grpo.model.lora import is_lora_state, lora_settings
from megatron_grpo.model.lora_peft import (gather_adapters, merged_stream, prepare_lora_export,
                                           save_peft_adapter, vision_state)
from megatron_grpo.config.export import ExportConfig, parse_export_args
from megatron_grpo.config.parallel import ParallelDims
from megatron_grpo.platform import init_parallel, init_process_group
from megatron_grpo.platform.compat.megatron import in_process_save_results

META_FILE = "megatron_grpo_convert.json"


def check_args(argv: list[str], world_size: int) -> ExportConfig:
    """Everything checkable before any process starts; ValueError naming the option."""
    a = parse_export_args(argv)
    src_flag, src = ("--model", a.model) if a.to_mcore else ("--mcore_model", a.mcore_model)
    if not src or not os.path.isdir(src):
        raise ValueError(f"{src_flag} {src!r}: not a folder; it must name the checkpoint to convert")
    unused = [("--mcore_model", a.mcore_model), ("--merge_lora", a.merge_lora)] if a.to_mcore \
        else []
    src = None
    if a.to_hf:
        src = mcore_source(a.mcore_model)    # raises naming what is missing
        _check_qkv_layout(a, src)
        if not src.lora:
            unused += [("--model", a.model), ("--merge_lora", a.merge_lora)]
    given = [f"{flag} {'true' if value is True else value}" for flag, value in unused if value]
    if given:
        raise ValueError(f"{', '.join(given)}: not used by this export ("
                         + ("--to_mcore reads --model" if a.to_mcore else
                            "--to_hf of a checkpoint without LoRA adapters") + "). Fix: drop it")
    if a.test_convert_precision:
        hf_dir = a.model if a.to_mcore else src.hf_dir
        if model_config(hf_dir, "model" if a.to_mcore else "mcore_model").vision is not None:
            raise ValueError("--test_convert_precision true compares text-only logits with "
                             "transformers' AutoModelForCausalLM, which does not load a "
                             "vision-language model. Fix: drop it (the weights convert the same)")
    a.dims = ParallelDims.from_options(a, world_size)   # raises naming the sizes
    if a.context_parallel_size > 1 and a.test_convert_precision:
        raise ValueError("--test_convert_precision true runs a full-sequence forward; use it "
                         "with --context_parallel_size 1 (CP does not change the weights)")
    if os.path.isdir(a.output_dir) and os.listdir(a.output_dir) and not a.overwrite:
        raise ValueError(f"--output_dir {a.output_dir!r} already holds files; pass "
                         "--overwrite true to replace them, or choose another folder")
    return a


@dataclass
class McoreSource:
    """Where --to_hf reads from: a `--to_mcore` folder or a training checkpoint."""
    dist_dir: str                  # the Megatron distributed checkpoint
    hf_dir: str                    # config.json and tokenizer files
    saved_tp: int | None           # tensor parallel size it was saved at, when recorded
    params_dtype: str | None       # dtype of the saved weights, when recorded
    path: str                      # the folder, after resolving a run folder
    lora: dict | None = None       # a LoRA run's checkpoint: settings and base model


def mcore_source(path: str) -> McoreSource:
    """Resolve --mcore_model: a folder written by `--to_mcore`, a training checkpoint
    (`output_dir/checkpoint-N`, model weights in its `dist/`), or a training run's
    output_dir (its newest checkpoint)."""
    if not os.path.isfile(os.path.join(path, TRAIN_META)) and \
            not os.path.isfile(os.path.join(path, HF_CONFIG_DIR, "config.json")):
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"--mcore_model {path!r} is neither a folder written by `megatron "
                             f"export --to_mcore` ({HF_CONFIG_DIR}/config.json), nor a training "
                             f"checkpoint (checkpoint-N/ with {TRAIN_META}), nor a run folder "
                             "holding one")
        path = latest
    hf_dir = os.path.join(path, HF_CONFIG_DIR)
    if os.path.isfile(os.path.join(path, TRAIN_META)):          # a training checkpoint
        with open(os.path.join(path, TRAIN_META)) as f:
            meta = json.load(f)
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise ValueError(f"--mcore_model {path!r}: this training checkpoint holds no "
                             f"{HF_CONFIG_DIR}/config.json (saved by an older version); copy the "
                             f"base model's config.json and tokenizer files into {hf_dir}")
        return McoreSource(os.path.join(path, "dist"), hf_dir, meta["layout"]["tp"],
                           meta.get("params_dtype"), path, meta.get("lora"))
    saved_tp = saved_dtype = None
    if os.path.isfile(os.path.join(path, META_FILE)):
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
        saved_tp, saved_dtype = meta["tensor_model_parallel_size"], meta.get("dtype")
    return McoreSource(path, hf_dir, saved_tp, saved_dtype, path)


def _check_qkv_layout(a: ExportConfig, src: McoreSource) -> None:
    """A checkpoint loads at any TP, except one an older version wrote with fewer kv heads
    than TP (a replicated, TP-dependent layout): that one only at the TP that wrote it."""
    hf = model_config(src.hf_dir, "mcore_model").language   # a VL model's language part
    heads = hf["num_attention_heads"]
    legacy_replicated_layout(saved_query_groups(src.dist_dir, heads, head_size(hf)), heads=heads,
                             kv_heads=hf.get("num_key_value_heads") or heads,
                             tp=a.tensor_model_parallel_size, where=repr(a.mcore_model))


def _default_dtype(hf_config: dict) -> str:
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def _sharded_state_dict(chunks, metadata: dict | None = None) -> dict:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict(metadata=dict(metadata or {}))}
    return {f"model{i}": unwrap(c).sharded_state_dict(metadata=dict(metadata or {}))
            for i, c in enumerate(chunks)}


def _finish(tmp: str, out: str) -> None:
    """Rank 0: replace `out` by the completed `tmp`."""
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


def _begin(out: str, rank: int) -> str:
    tmp = out.rstrip("/") + ".tmp"
    if rank == 0:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    dist.barrier()
    return tmp


def megatron_logits(chunks, config, args, ids):
    """HF-vocab logits [B, S, V] of the model, on every rank (forward_only schedule).

    With virtual pipeline chunks the interleaved schedule refuses fewer micro-batches than
    `microbatch_group_size_per_vp_stage` (>= PP): the same batch then runs that many times
    and the first result is kept."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = ids.shape
    device = next(chunks[0].parameters()).device
    ids = ids.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)

    def step(data_iterator, model):
        next(data_iterator)
        output = model(ids, positions, None)

        def collect(out):
            full = gather_from_tensor_model_parallel_region(out)[..., :args.vocab_size]
            return torch.zeros((), device=device), {"logits": full.float().detach().clone()}

        return output, collect

    for c in chunks:
        c.eval()
    n = config.microbatch_group_size_per_vp_stage if len(chunks) > 1 else 1
    data = [iter([None] * n) for _ in chunks] if len(chunks) > 1 else iter([None])
    with torch.no_grad():
        result = get_forward_backward_func()(
            forward_step_func=step, data_iterator=data, model=chunks, num_microbatches=n,
            seq_length=seq, micro_batch_size=batch, forward_only=True)
    logits = torch.empty((batch, seq, args.vocab_size), dtype=torch.float32, device=device)
    # The last stage's ranks hold them; the last rank of the world is one of those.
    last = dist.get_world_size() - 1
    if dist.get_rank() == last:
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            raise RuntimeError("the last rank of the world is not on the last pipeline stage")
        logits.copy_(result[0]["logits"])
    dist.broadcast(logits, src=last)
    return logits


def _precision(chunks, config, args, hf_dir: str, dtype: str) -> None:
    """Print max and mean |logit diff| of Megatron vs HF transformers on one sample."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (1, 32), generator=gen)
    ours = megatron_logits(chunks, config, args, ids).cpu()
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            theirs = hf(input_ids=ids).logits.float()
        diff = (ours - theirs).abs()
        print(f"test_convert_precision: max_abs_diff={diff.max().item():.3e} "
              f"mean_abs_diff={diff.mean().item():.3e} (Megatron vs HF transformers, {dtype}, "
              f"{ids.shape[1]} tokens)", flush=True)
    dist.barrier()


def main(argv: list[str]) -> int:

    init_process_group()
    a = check_args(argv, dist.get_world_size())
    rank = dist.get_rank()
    dist.barrier()  # every rank has checked the output folder before anything is written
    dims = init_parallel(a.dims)
    tp, pp, vpp, cp, ep, etp = dims.tp, dims.pp, dims.vpp, dims.cp, dims.ep, dims.etp
    from megatron.core import dist_checkpointing

    src = None if a.to_mcore else mcore_source(a.mcore_model)
    hf_src = a.model if a.to_mcore else src.hf_dir
    # --torch_dtype unset: the checkpoint's (--to_hf: the weights' as saved, a training run's
    # --bf16 included; else, and for --to_mcore, the HF config's).
    dtype = a.torch_dtype or (src is not None and src.params_dtype) or \
        _default_dtype(model_config(hf_src, "model" if a.to_mcore else "mcore_model").language)
    # Build in the dtype the weights were saved in (a training checkpoint may differ from
    # the HF config's); the export casts to `dtype`.
    build_dtype = (src.params_dtype if src is not None and src.params_dtype else dtype)
    config, args = build_transformer_config(hf_src, tp=tp, pp=pp, vpp=vpp, cp=cp,
                                            dtype=build_dtype, ep=ep, etp=etp)
    chunks = build_model(config, args)
    if src is not None and src.lora:   # adapters on the base the run started from
        prepare_lora_export(chunks, config, args, src.lora, a.model)
    tmp = _begin(a.output_dir, rank)
    if a.to_mcore:
        load_hf_weights(chunks, config, args, a.model)
        in_process_save_results()      # a synchronous save: no Manager process to start
        dist_checkpointing.save(_sharded_state_dict(chunks), tmp)
        if rank == 0:
            copy_hf_side_files(a.model, os.path.join(tmp, HF_CONFIG_DIR))
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump({"source": os.path.abspath(a.model), "family": args.family.name,
                           "dtype": dtype, "tensor_model_parallel_size": tp,
                           "pipeline_model_parallel_size": pp,
                           "virtual_pipeline_model_parallel_size": vpp,
                           "expert_model_parallel_size": ep,
                           "expert_tensor_parallel_size": etp}, f, indent=2)
        reference = a.model
    else:
        if rank == 0:
            print(f"megatron export: reading {src.path}", flush=True)
        metadata = checkpoint_load_metadata(src.dist_dir, chunks, repr(a.mcore_model))
        sd = _sharded_state_dict(chunks, metadata)
        if src.lora:    # the checkpoint holds the adapters only
            settings = lora_settings(chunks)   # adapters and --modules_to_save parameters
            sd = {k: {n: t for n, t in v.items() if is_lora_state(n, settings)}
                  for k, v in sd.items()}
        state = dist_checkpointing.load(sd, src.dist_dir)
        for i, chunk in enumerate(chunks):   # LoRA: the adapters only (base from HF)
            unwrap(chunk).load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"],
                                          strict=not src.lora)
        if src.lora and a.merge_lora is False:    # the PEFT adapter (unset: merged)
            factors = gather_adapters(chunks)
            if rank == 0:   # lora_llm: rank 0 (first pipeline stage) holds the trained tower
                factors.update(vision_state(chunks))
                save_peft_adapter(tmp, factors, lora_settings(chunks),
                                  base_model=a.model or src.lora.get("base_model"),
                                  dtype=getattr(torch, dtype))
        else:
            stream = merged_stream(chunks, export_hf_weights(
                chunks, config, args, bucket_size_bytes=512 << 20, dtype=getattr(torch, dtype)))
            write_hf_checkpoint(stream, tmp, a.max_shard_bytes, write=rank == 0)
            if rank == 0:
                copy_hf_side_files(hf_src, tmp, dtype=getattr(torch, dtype))
        reference = tmp
    dist.barrier()
    if a.test_convert_precision:
        _precision(chunks, config, args, reference, dtype)
    if rank == 0:
        _finish(tmp, a.output_dir)
        print(f"megatron export: wrote {a.output_dir}", flush=True)
    dist.barrier()
    return 0
