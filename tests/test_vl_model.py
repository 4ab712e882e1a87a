"""Qwen2.5-VL on Megatron (model/vision.py, bridge/mappings/vision.py) against HF transformers.

One 2-rank gloo world runs every layout on the tiny Qwen2.5-VL of tools/make_tiny_vl_model.py
and a batch of two image prompts (PIL-drawn images, the model's own processor, right
padding, the images of both rows in one pixel_values): the bridge loads the checkpoint,
the model runs the vision tower, replaces the image rows and takes HF's mrope positions.
References are independent: HF's logits (fp32, 1e-4) and HF's autograd gradients of the
vision tower under the same loss (TP=1 and TP=2 must both equal them), and the original
checkpoint for the `megatron export` round trip (bit for bit), whose output transformers
loads with equal logits.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import lora_model, randomize_lora_b
from tests.test_vl_tiny_model import IMAGES, PROMPTS, encode, hf_logits
from tests.vl_compat import load_processor
from tools.make_tiny_vl_model import make_tiny_vl_model

# (tp, pp, sequence_parallel); TP=1 runs with DP=2 on identical data.
LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]
GRAD_LAYOUTS = {(1, 1, False), (2, 1, False), (2, 1, True)}
PAD = 0


def _inputs(model_dir, hf):
    """Two image prompts as one right-padded batch, with per-row HF references."""
    from megatron_grpo.model.vision import mrope_positions, sample_positions

    processor = load_processor(model_dir)
    encs = [encode(processor, p, img()) for p, img in zip(PROMPTS, IMAGES)]
    n = max(e["input_ids"].shape[1] for e in encs)
    n += n % 2                      # sequence parallel splits the sequence over TP=2
    ids = torch.full((2, n), PAD, dtype=torch.long)
    pos = torch.zeros((3, 2, n), dtype=torch.long)
    lengths = []
    for i, e in enumerate(encs):
        row = e["input_ids"][0]
        ids[i, :len(row)] = row
        p, delta = mrope_positions(row, e["image_grid_thw"], hf.config.image_token_id)
        pos[:, i] = sample_positions(p, delta, n)
        lengths.append(len(row))
    return dict(ids=ids, pos=pos, lengths=lengths, encs=encs,
                pixel_values=torch.cat([e["pixel_values"] for e in encs]),
                image_grid_thw=torch.cat([e["image_grid_thw"] for e in encs]),
                pixel_values_of=[e["pixel_values"] for e in encs],
                image_grid_thw_of=[e["image_grid_thw"] for e in encs],
                image_token_id=hf.config.image_token_id)


def _loss_terms(logits, ids, lengths, vocab):
    """Sum over rows of next-token CE on the real tokens, and the token count."""
    total, count = 0.0, 0
    for i, n in enumerate(lengths):
        total = total + torch.nn.functional.cross_entropy(
            logits[i, :n - 1, :vocab].float(), ids[i, 1:n], reduction="sum")
        count += n - 1
    return total, count


def _world(rank, world_size, model_dir, batch, root, qwen2_vl):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import load_hf_weights
    from megatron_grpo.convert import main as convert
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.model.vision import apply_freeze
    from megatron_grpo.platform import ParallelDims, init_parallel

    ids, pos = batch["ids"], batch["pos"]
    out = {}
    for tp, pp, sp in LAYOUTS:
        init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp), seed=1)
        config, args = build_transformer_config(model_dir, tp=tp, pp=pp, sequence_parallel=sp)
        chunks = build_model(config, args)
        load_hf_weights(chunks, config, args, model_dir)
        trainable = {}
        for flags in ((True, True, False), (False, True, False), (False, False, True)):
            apply_freeze(chunks, freeze_vit=flags[0], freeze_aligner=flags[1], freeze_llm=flags[2])
            trainable[flags] = sorted(n for c in chunks for n, p in c.named_parameters()
                                      if p.requires_grad)
        apply_freeze(chunks, freeze_vit=False, freeze_aligner=False)
        grads = (tp, pp, sp) in GRAD_LAYOUTS
        if grads:
            chunks = wrap_ddp(config, chunks)
        count = sum(n - 1 for n in batch["lengths"])

        def step(data_iterator, model):
            next(data_iterator)
            output = model(ids, pos, None, pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"])

            def loss_fn(o):
                full = gather_from_tensor_model_parallel_region(o)[..., :args.vocab_size]
                loss, _ = _loss_terms(full, ids, batch["lengths"], args.vocab_size)
                return loss / count, {"logits": full.detach().float().clone()}
            return output, loss_fn

        for c in chunks:
            c.train() if grads else c.eval()
        data = [iter([None]) for _ in chunks] if len(chunks) > 1 else iter([None])
        with contextlib.nullcontext() if grads else torch.no_grad():
            result = get_forward_backward_func()(
                forward_step_func=step, data_iterator=data, model=chunks, num_microbatches=1,
                seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=not grads)
        visual = {n[len("module.visual.model."):]: p.main_grad.clone()
                  for c in chunks for n, p in c.named_parameters()
                  if n.startswith("module.visual.model.")} if grads else {}
        out[tp, pp, sp] = dict(logits=result[0]["logits"] if result else None,
                               visual_grads=visual, trainable=trainable)
        if (tp, pp, sp) == (1, 2, False):  # a sync's stream with the tower (not merger) frozen
            from bridge import export_hf_weights
            from bridge.mappings.vision import sync_filter

            out["sync_stream"] = {n: t.clone() for bucket in export_hf_weights(
                chunks, config, args, bucket_size_bytes=64 << 10,
                include=sync_filter(freeze_vit=True, freeze_aligner=False)) for n, t in bucket}
        if (tp, pp, sp) == (2, 1, True):   # the trainer's path: Samples -> micro-batches
            out["trainer_logps"] = _trainer_logps(chunks, batch, args.vocab_size)
            out["packed_logps"] = _trainer_logps(_packed_chunks(config, args, model_dir),
                                                 batch, args.vocab_size)

    out["qwen2_vl"] = _qwen2_vl_phase(world_size, qwen2_vl)
    out["cp2"] = _cp_phase(world_size, model_dir, batch)
    out["lora"] = _lora_phase(world_size, model_dir, batch, root)

    # megatron export: HF -> Megatron at TP=2 -> HF at TP=1 and at PP=2.
    mcore = os.path.join(root, "mcore")
    with contextlib.redirect_stdout(io.StringIO()):
        convert(["--to_mcore", "true", "--model", model_dir, "--output_dir", mcore,
                 "--tensor_model_parallel_size", "2"])
        convert(["--to_hf", "true", "--mcore_model", mcore, "--output_dir",
                 os.path.join(root, "hf_tp1")])
        convert(["--to_hf", "true", "--mcore_model", mcore, "--output_dir",
                 os.path.join(root, "hf_pp2"), "--pipeline_model_parallel_size", "2"])
    return out


def _cp_phase(world_size, model_dir, batch):
    """CP=2, the tower trained: each rank feeds its chunks of the ids, image mask and mrope
    positions (train/batch.py cp_shard) with the whole images; the full logits (gathered
    over CP) and the tower's gradients of the same loss as the other layouts; the trainer's
    completion log-probs (engine.forward_logprobs shards the micro-batch itself)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bridge import load_hf_weights
    from megatron_grpo.data.cp_split import gather_from_cp
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.model.vision import apply_freeze
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train.batch import cp_shard

    init_parallel(ParallelDims(world_size=world_size, cp=2), seed=1)
    config, args = build_transformer_config(model_dir, cp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    apply_freeze(chunks, freeze_vit=False, freeze_aligner=False)
    chunks = wrap_ddp(config, chunks)
    ids = batch["ids"]
    targets, weight = torch.zeros_like(ids), torch.zeros(ids.shape)
    for i, n in enumerate(batch["lengths"]):
        targets[i, :n - 1], weight[i, :n - 1] = ids[i, 1:n], 1.0
    shard = cp_shard({"input_ids": ids, "position_ids": batch["pos"], "targets": targets,
                      "weight": weight, "image_mask": ids == batch["image_token_id"],
                      "pixel_values": batch["pixel_values"],
                      "image_grid_thw": batch["image_grid_thw"]},
                     2, ps.get_context_parallel_rank())
    count = weight.sum()

    def step(data_iterator, model):
        next(data_iterator)
        output = model(shard["input_ids"], shard["position_ids"], None,
                       pixel_values=shard["pixel_values"], image_grid_thw=shard["image_grid_thw"],
                       image_mask=shard["image_mask"], image_index=shard["image_index"])

        def loss_fn(o):          # this rank's tokens' share (the schedule and DDP: engine.py)
            logits = o[..., :args.vocab_size].float()
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), shard["targets"],
                                                   reduction="none")
            loss = (ce * shard["weight"]).sum() / count
            return loss, {"logits": gather_from_cp(logits, seq_len=ids.shape[1])}
        return output, loss_fn

    packed_chunks = _packed_chunks(config, args, model_dir)
    packed = _trainer_logps(packed_chunks, batch, args.vocab_size)
    packed_text = _trainer_logps(packed_chunks, batch, args.vocab_size, text=True)
    padded_text = _trainer_logps(chunks, batch, args.vocab_size, text=True)
    chunks[0].train()
    result = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([None]), model=chunks, num_microbatches=1,
        seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=False)
    return dict(logits=result[0]["logits"],
                trainer_logps=_trainer_logps(chunks, batch, args.vocab_size),
                packed_logps=packed, packed_text=packed_text, padded_text=padded_text,
                visual_grads={n[len("module.visual.model."):]: p.main_grad.clone()
                              for n, p in chunks[0].named_parameters()
                              if n.startswith("module.visual.model.")})


def _lora_phase(world_size, model_dir, batch, root):
    """LoRA on the language model at TP=2 (every target, the tower frozen): logits with B = 0
    and with random B, the merged stream a sync sends, and the PEFT adapter rank 0 writes."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import export_hf_weights
    from megatron_grpo.model import build_transformer_config
    from megatron_grpo.model.lora import LoraSettings, lora_settings
    from megatron_grpo.model.lora_peft import gather_adapters, merged_stream, save_peft_adapter
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=2), seed=1)
    config, args = build_transformer_config(model_dir, tp=2)
    chunks = lora_model(config, args, model_dir, LoraSettings(rank=4, alpha=8, dropout=0.0))
    chunks[0].eval()

    def logits():
        with torch.no_grad():
            out = chunks[0](batch["ids"], batch["pos"], None, pixel_values=batch["pixel_values"],
                            image_grid_thw=batch["image_grid_thw"])
        return gather_from_tensor_model_parallel_region(out)[..., :args.vocab_size].clone()

    base = logits()
    randomize_lora_b(chunks, torch.Generator().manual_seed(7))   # equal on both ranks
    trainable = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    factors = gather_adapters(chunks)
    merged = {n: t.clone() for bucket in merged_stream(chunks, export_hf_weights(
        chunks, config, args, bucket_size_bytes=64 << 10)) for n, t in bucket}
    if torch.distributed.get_rank() == 0:
        save_peft_adapter(os.path.join(root, "vl_adapter"), factors, lora_settings(chunks),
                          base_model=model_dir)
    return dict(base=base, adapted=logits(), merged=merged, trainable=trainable,
                lora_llm=_lora_llm_phase(config, args, model_dir, batch, root),
                tower=_tower_lora_phase(config, args, model_dir, batch, root))


def _tower_lora_phase(config, args, model_dir, batch, root):
    """--tuner_type lora --freeze_vit false --freeze_aligner false at TP=2: adapters (random
    B) on the language model and on every linear of the tower and merger. Returns the logits
    with the adapters on and off, the tower adapters' gradients of _world's loss (after a
    reference forward with the adapters off), the tower in a merged sync stream, and
    whether a LoRA checkpoint round trip into a fresh model, and loading the PEFT adapter
    rank 0 wrote (--adapters), restore every adapter; `megatron export` writes the
    checkpoint's adapter."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import export_hf_weights
    from megatron_grpo.checkpoint import load_checkpoint, save_checkpoint
    from megatron_grpo.model import wrap_ddp
    from megatron_grpo.model.lora import (LoraSettings, adapters, adapters_disabled,
                                          lora_settings, tower_adapters)
    from megatron_grpo.model.lora_peft import (gather_adapters, load_peft_adapter, merged_stream,
                                               save_peft_adapter)
    from megatron_grpo.platform import ParallelDims, init_parallel

    # the lora_llm phase's `megatron export` left its own parallel state
    init_parallel(ParallelDims(world_size=torch.distributed.get_world_size(), tp=2), seed=1)

    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, tower=True, aligner=True)

    def build():
        return lora_model(config, args, model_dir, settings)

    chunks = build()
    randomize_lora_b(chunks, torch.Generator().manual_seed(13))   # equal on both ranks
    trainable = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    stream = {n: t.clone() for bucket in merged_stream(chunks, export_hf_weights(
        chunks, config, args, bucket_size_bytes=64 << 10)) for n, t in bucket
        if n.startswith("visual.")}
    factors = gather_adapters(chunks)
    if torch.distributed.get_rank() == 0:
        save_peft_adapter(os.path.join(root, "vl_tower_adapter"), factors, lora_settings(chunks),
                          base_model=model_dir)
    ckpt = save_checkpoint(os.path.join(root, "tower_lora_ckpt"), 1, chunks, save_rng=False,
                           hf_config_dir=model_dir)

    chunks = wrap_ddp(config, chunks)
    ids, count = batch["ids"], sum(n - 1 for n in batch["lengths"])
    seen = {}

    def step(data_iterator, model):
        next(data_iterator)
        output = model(ids, batch["pos"], None, pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"])

        def loss_fn(o):
            full = gather_from_tensor_model_parallel_region(o)[..., :args.vocab_size]
            seen["logits"] = full.detach().clone()
            loss, _ = _loss_terms(full, ids, batch["lengths"], args.vocab_size)
            return loss / count, {}
        return output, loss_fn

    def run(forward_only):
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]),
                                    model=chunks, num_microbatches=1, seq_length=ids.shape[1],
                                    micro_batch_size=ids.shape[0], forward_only=forward_only)
        return seen["logits"]

    chunks[0].train()
    with adapters_disabled(chunks), torch.no_grad():   # the reference policy's forward
        off = run(True)
    on = run(False)
    grads = {f"{n}.{f}": getattr(layer, f)["default"].weight.main_grad.clone()
             for n, layer in tower_adapters(chunks) for f in ("lora_A", "lora_B")}

    fresh = build()
    load_checkpoint(ckpt, fresh, load_rng=False)
    loaded = build()                                 # --adapters: the PEFT folder back
    load_peft_adapter(loaded, os.path.join(root, "vl_tower_adapter"))
    from megatron_grpo.convert import main as convert   # the PEFT export of the checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        convert(["--to_hf", "true", "--mcore_model", ckpt, "--merge_lora", "false",
                 "--output_dir", os.path.join(root, "tower_lora_export")])

    def same(other):
        pairs = [(x, y) for (_, a), (_, b) in zip(tower_adapters(chunks), tower_adapters(other))
                 for x, y in ((a.lora_A["default"].weight, b.lora_A["default"].weight),
                              (a.lora_B["default"].weight, b.lora_B["default"].weight))]
        pairs += [(x, y) for (_, _, a), (_, _, b) in zip(adapters(chunks), adapters(other))
                  for x, y in zip(a.parameters(), b.parameters())]
        return len(pairs) == 2 * (12 + 2 * 7) and all(torch.equal(x, y) for x, y in pairs)
    return dict(trainable=trainable, stream=stream, on=on, off=off, grads=grads,
                restored=same(fresh), loaded=same(loaded))


def _lora_llm_phase(config, args, model_dir, batch, root):
    """--tuner_type lora_llm at TP=2: adapters (random B) on the language model and the whole
    tower trained in full, the tower moved off the checkpoint first (so that what is saved,
    streamed and exported is the trained one). Returns the tower's gradients of the same
    loss as _world, the tower seen with the adapters off (the reference), the tower in a
    merged sync stream, and the tower after a LoRA checkpoint round trip into a fresh
    model; rank 0 writes the PEFT adapter (adapters + modules_to_save visual)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import export_hf_weights
    from megatron_grpo.checkpoint import load_checkpoint, save_checkpoint
    from megatron_grpo.model import wrap_ddp
    from megatron_grpo.model.lora import LoraSettings, adapters, adapters_disabled, lora_settings
    from megatron_grpo.model.lora_peft import (gather_adapters, merged_stream, save_peft_adapter,
                                               vision_state)

    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, train_vision=True)

    def build():
        return lora_model(config, args, model_dir, settings)

    chunks = build()
    g = torch.Generator().manual_seed(11)          # equal on both ranks (replicated tower)
    randomize_lora_b(chunks, g)
    with torch.no_grad():
        for n, p in chunks[0].named_parameters():
            if n.startswith("visual."):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    trainable = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    tower = {n[len("visual.model."):]: p.detach().clone()
             for n, p in chunks[0].named_parameters() if n.startswith("visual.model.")}
    with adapters_disabled(chunks):
        off = {n[len("visual.model."):]: p.detach().clone()
               for n, p in chunks[0].named_parameters() if n.startswith("visual.model.")}
    stream = {n: t.clone() for bucket in merged_stream(chunks, export_hf_weights(
        chunks, config, args, bucket_size_bytes=64 << 10)) for n, t in bucket
        if n.startswith("visual.")}
    factors = gather_adapters(chunks)
    if torch.distributed.get_rank() == 0:
        factors.update(vision_state(chunks))
        save_peft_adapter(os.path.join(root, "vl_llm_adapter"), factors, lora_settings(chunks),
                          base_model=model_dir)
    ckpt = save_checkpoint(os.path.join(root, "lora_llm_ckpt"), 1, chunks, save_rng=False,
                           hf_config_dir=model_dir)

    chunks = wrap_ddp(config, chunks)
    ids, count = batch["ids"], sum(n - 1 for n in batch["lengths"])

    def step(data_iterator, model):
        next(data_iterator)
        output = model(ids, batch["pos"], None, pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"])

        def loss_fn(o):
            full = gather_from_tensor_model_parallel_region(o)[..., :args.vocab_size]
            loss, _ = _loss_terms(full, ids, batch["lengths"], args.vocab_size)
            return loss / count, {}
        return output, loss_fn

    chunks[0].train()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=chunks,
                                num_microbatches=1, seq_length=ids.shape[1],
                                micro_batch_size=ids.shape[0], forward_only=False)
    grads = {n[len("module.visual.model."):]: p.main_grad.clone()
             for n, p in chunks[0].named_parameters() if n.startswith("module.visual.model.")}

    fresh = build()
    load_checkpoint(ckpt, fresh, load_rng=False)
    from megatron_grpo.convert import main as convert   # the PEFT export of the checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        convert(["--to_hf", "true", "--mcore_model", ckpt, "--merge_lora", "false",
                 "--output_dir", os.path.join(root, "lora_llm_export")])
    restored = {n[len("visual.model."):]: p.detach().clone()
                for n, p in fresh[0].named_parameters() if n.startswith("visual.model.")}
    return dict(trainable=trainable, tower=tower, off=off, stream=stream, grads=grads,
                restored=restored, adapters_restored=all(
                    torch.equal(a, b) for (_, _, x), (_, _, y) in zip(adapters(chunks),
                                                                      adapters(fresh))
                    for a, b in zip(x.parameters(), y.parameters())))


COMPLETIONS = [[5, 17, 42, 9], [7, 8]]


def _samples(batch, image_token_id):
    """Trainer samples of the two prompts with fixed completions (train/batch.py)."""
    from megatron_grpo.train.batch import ImageInputs, Sample

    out = []
    for i, completion in enumerate(COMPLETIONS):
        n = batch["lengths"][i]
        prompt = batch["ids"][i, :n].tolist()
        images = ImageInputs.from_prompt(prompt, batch["pixel_values_of"][i],
                                         batch["image_grid_thw_of"][i], image_token_id)
        out.append(Sample(prompt_ids=prompt, completion_ids=completion, images=images))
    return out


def _packed_chunks(config, args, model_dir):
    """The model built for packed micro-batches (--padding_free true: the engine packs them,
    train/packing.py, under the current TP / CP)."""
    from bridge import load_hf_weights
    from megatron_grpo.model import build_model

    chunks = build_model(config, args, padding_free=True)
    load_hf_weights(chunks, config, args, model_dir)
    for c in chunks:
        c.eval()
    return chunks


TEXT_SAMPLES = [([1, 5, 9, 33, 60, 7], [12, 40, 3]), ([4, 8, 15, 16], [23, 42])]


def _trainer_logps(chunks, batch, vocab, text=False):
    """Completion log-probs through the trainer's forward (micro_batches + forward_logprobs);
    text: two text-only samples instead (no images: the [B, S] position path)."""
    from megatron_grpo.train.batch import Sample, micro_batches, split_completion_values
    from megatron_grpo.train.engine import forward_logprobs

    samples = [Sample(prompt_ids=p, completion_ids=c) for p, c in TEXT_SAMPLES] if text else \
        _samples(batch, batch["image_token_id"])
    mbs = micro_batches(samples, 2, pad_to_multiple_of=2)
    out = forward_logprobs(chunks, mbs, temperature=1.0, vocab_size=vocab)
    return None if out is None else split_completion_values(out[0]["logps"], mbs[0])


def _hf_reference(hf, batch):
    """HF logits per row and the vision tower's gradients of the same loss."""
    hf.zero_grad()
    logits, total = [], 0.0
    count = sum(n - 1 for n in batch["lengths"])
    for e in batch["encs"]:
        out = hf(input_ids=e["input_ids"], mm_token_type_ids=e["mm_token_type_ids"],
                 pixel_values=e["pixel_values"], image_grid_thw=e["image_grid_thw"],
                 use_cache=False).logits
        ids = e["input_ids"]
        total = total + torch.nn.functional.cross_entropy(out[0, :-1], ids[0, 1:], reduction="sum")
        logits.append(out[0].detach())
    (total / count).backward()
    completion_logps = []
    with torch.no_grad():
        for e, completion in zip(batch["encs"], COMPLETIONS):
            p = e["input_ids"].shape[1]
            logp = torch.log_softmax(hf_logits(hf, e, completion), -1)
            completion_logps.append(logp[torch.arange(p - 1, p - 1 + len(completion)),
                                         torch.tensor(completion)])
    grads = {n[len("model.visual."):]: p.grad.clone() for n, p in hf.named_parameters()
             if n.startswith("model.visual.")}
    hf.zero_grad()
    return logits, grads, completion_logps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def world(tmp_path_factory, model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    batch = _inputs(model_dir, hf)
    ref_logits, ref_grads, ref_logps = _hf_reference(hf, batch)
    root = tmp_path_factory.mktemp("vl_convert")
    qwen2_vl = _qwen2_vl_inputs(tmp_path_factory.mktemp("vl") / "tiny-qwen2-vl")
    results = run_distributed(_world, world_size=2, timeout=600,
                              args=(str(model_dir), {k: v for k, v in batch.items() if k != "encs"},
                                    str(root), {k: v for k, v in qwen2_vl.items() if k != "ref"}))
    return dict(model_dir=model_dir, root=root, batch=batch, results=results,
                ref_logits=ref_logits, ref_grads=ref_grads, ref_logps=ref_logps,
                qwen2_vl=qwen2_vl)


def test_mrope_positions_equal_hf_get_rope_index(world):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig.from_pretrained(world["model_dir"])
    for i, e in enumerate(world["batch"]["encs"]):
        # get_rope_index reads only the config: call it unbound on a stand-in holding one.
        ref, delta = Qwen2_5_VLModel.get_rope_index(
            type("M", (), {"config": config, "get_vision_position_ids":
                           Qwen2_5_VLModel.get_vision_position_ids})(),
            e["input_ids"], e["mm_token_type_ids"], e["image_grid_thw"])
        n = world["batch"]["lengths"][i]
        assert torch.equal(world["batch"]["pos"][:, i, :n], ref[:, 0])
        # Past the prompt (completion tokens, padding): i + rope_delta in all three.
        tail = world["batch"]["pos"][:, i, n:]
        assert torch.equal(tail, (torch.arange(n, n + tail.shape[1]) + int(delta)).expand(3, -1))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}_pp{l[1]}{'_sp' if l[2] else ''}")
def test_logits_equal_hf_on_image_prompts(world, layout):
    batch = world["batch"]
    seen = [r[layout]["logits"] for r in world["results"] if r[layout]["logits"] is not None]
    assert seen   # the last pipeline stage's ranks report them
    for logits in seen:
        for i, ref in enumerate(world["ref_logits"]):
            n = batch["lengths"][i]
            assert (logits[i, :n].double() - ref.double()).abs().max() <= 1e-4, (layout, i)


@pytest.mark.parametrize("layout", sorted(GRAD_LAYOUTS),
                         ids=lambda l: f"tp{l[0]}{'_sp' if l[2] else ''}")
def test_vision_tower_gradients_equal_hf(world, layout):
    """--freeze_vit false --freeze_aligner false: every vision tensor's gradient equals HF's
    (on every rank: TP ranks average equal gradients)."""
    ref = world["ref_grads"]
    for r in world["results"]:
        grads = r[layout]["visual_grads"]
        assert sorted(grads) == sorted(ref)
        for name, g in grads.items():
            scale = ref[name].abs().max().item()
            assert (g - ref[name]).abs().max().item() <= 1e-5 + 1e-4 * scale, (layout, name)
        assert any(g.abs().max() > 0 for g in grads.values())


def test_context_parallel_logits_and_tower_gradients(world):
    """CP=2 (train/batch.py cp_shard: chunks of the ids, image mask and 3 x S positions,
    the whole images on both ranks): logits and the trainer's completion log-probs equal
    HF's, and the tower's gradients (DDP sums the ranks' partial ones) equal HF's and
    CP=1's on every rank."""
    batch = world["batch"]
    for r in world["results"]:
        cp = r["cp2"]
        for i, ref in enumerate(world["ref_logits"]):
            n = batch["lengths"][i]
            assert (cp["logits"][i, :n].double() - ref.double()).abs().max() <= 1e-4, i
        for ours, ref in zip(cp["trainer_logps"], world["ref_logps"]):
            assert (ours.double() - ref).abs().max() <= 1e-5
        cp1 = r[1, 1, False]["visual_grads"]
        assert sorted(cp["visual_grads"]) == sorted(world["ref_grads"])
        for name, g in cp["visual_grads"].items():
            for ref in (world["ref_grads"][name], cp1[name]):
                assert (g - ref).abs().max().item() <= 1e-5 + 1e-4 * ref.abs().max().item(), name


def test_lora_on_the_language_model_equals_peft(world):
    """LoRA (every target, TP=2) on Qwen2.5-VL: only adapters train (the tower frozen);
    with B = 0 the logits are HF's; with random B the logits equal PEFT's on HF's model
    loading the adapter we write (its names and regex keep PEFT off the tower's own
    gate/up/down_proj), and the merged sync stream equals PEFT's merge_and_unload."""
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    batch = world["batch"]
    results = [r["lora"] for r in world["results"]]
    assert all(r["trainable"] and all("_lora.lora_" in n for n in r["trainable"])
               for r in results)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(world["model_dir"],
                                                            dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, world["root"] / "vl_adapter").eval()
    wrapped = [n for n, _ in peft.named_parameters() if "lora_A" in n]
    assert wrapped and not any("visual" in n for n in wrapped)
    assert len(wrapped) == 2 * 7          # 2 layers x every target
    with torch.no_grad():
        ref = [peft(**e, use_cache=False).logits[0] for e in batch["encs"]]
    for r in results:
        for i, (base, adapted) in enumerate(zip(world["ref_logits"], ref)):
            n = batch["lengths"][i]
            assert (r["base"][i, :n] - base).abs().max() <= 1e-4
            assert (r["adapted"][i, :n] - adapted).abs().max() <= 1e-4
            assert (adapted - base).abs().max() > 1e-2       # the adapters matter
    merged = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
              for k, v in peft.merge_and_unload().state_dict().items()}
    for r in results:
        assert set(r["merged"]) <= set(merged)
        for name, t in r["merged"].items():
            assert (t - merged[name]).abs().max() <= 1e-5, name


def test_lora_llm_trains_the_tower_beside_the_adapters(world):
    """--tuner_type lora_llm (TP=2): the adapters and every tower tensor train; the tower's
    gradients equal those of HF + PEFT loading the adapter we wrote (the trained tower as
    modules_to_save `visual`, random B), whose logits it also reproduces; the reference
    (adapters off) keeps the trained tower, as ms-swift's; a merged sync streams it; a LoRA
    checkpoint round trip restores it and the adapters, and `megatron export` of that
    checkpoint writes the same PEFT adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    batch = world["batch"]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(world["model_dir"],
                                                            dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, world["root"] / "vl_llm_adapter", is_trainable=True)
    prefix = "base_model.model.model.visual.modules_to_save.default."
    for n, p in peft.named_parameters():
        p.requires_grad_(n.startswith(prefix))
    total, count = 0.0, sum(n - 1 for n in batch["lengths"])
    for e in batch["encs"]:
        out = peft(**e, use_cache=False).logits
        total = total + torch.nn.functional.cross_entropy(out[0, :-1], e["input_ids"][0, 1:],
                                                          reduction="sum")
    (total / count).backward()
    ref = {n[len(prefix):]: p.grad for n, p in peft.named_parameters() if n.startswith(prefix)}
    trained = {n[len(prefix):]: p.detach() for n, p in peft.named_parameters()
               if n.startswith(prefix)}
    original = {k[len("visual."):]: v for k, v in load_file(
        world["model_dir"] / "model.safetensors").items() if k.startswith("visual.")}
    written = load_file(world["root"] / "vl_llm_adapter" / "adapter_model.safetensors")
    exported = load_file(world["root"] / "lora_llm_export" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(written)         # megatron export of the checkpoint
    assert all(torch.equal(exported[k], t) for k, t in written.items())
    for r in (r["lora"]["lora_llm"] for r in world["results"]):
        tower = [n for n in r["trainable"] if n.startswith("visual.model.")]
        assert len(tower) == len(original) and \
            all(n.startswith("visual.model.") or "_lora.lora_" in n for n in r["trainable"])
        assert sorted(r["grads"]) == sorted(ref) == sorted(original)
        for name, g in r["grads"].items():
            scale = ref[name].abs().max().item()
            assert (g - ref[name]).abs().max().item() <= 1e-5 + 1e-4 * scale, name
            assert torch.equal(r["tower"][name], trained[name]), name      # the export's
            assert not torch.equal(r["tower"][name], original[name]), name  # moved
            for seen in (r["off"][name], r["stream"]["visual." + name], r["restored"][name]):
                assert torch.equal(seen, r["tower"][name]), name
        assert any(g.abs().max() > 0 for g in r["grads"].values()) and r["adapters_restored"]


def test_lora_on_the_tower_equals_peft(world):
    """--tuner_type lora --freeze_vit false --freeze_aligner false (TP=2): adapters on every
    linear of the tower and merger (ms-swift's all-linear), only adapters train; the logits
    equal PEFT's on HF's model loading the adapter we wrote, and with the adapters off HF's;
    the tower adapters' gradients equal PEFT's (autograd, the same loss); the merged sync
    stream's tower equals PEFT's merge_and_unload; a LoRA checkpoint round trip restores
    the tower adapters (so does loading the adapter: --adapters) and `megatron export` of it
    writes the same adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    batch = world["batch"]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(world["model_dir"],
                                                            dtype=torch.float32)
    linears = [n for n, m in hf.model.visual.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 5 + 2      # 2 blocks x (qkv, proj, gate, up, down) + merger
    peft = PeftModel.from_pretrained(hf, world["root"] / "vl_tower_adapter", is_trainable=True)
    prefix = "base_model.model.model.visual."
    wrapped = sorted(n[len(prefix):] for n, p in peft.named_parameters()
                     if n.startswith(prefix) and ".lora_" in n)
    assert wrapped == sorted(f"{n}.lora_{f}.default.weight" for n in linears for f in "AB")
    assert sum(".language_model." in n and "lora_A" in n for n, _ in peft.named_parameters()) \
        == 2 * 7
    for n, p in peft.named_parameters():
        p.requires_grad_(n.startswith(prefix) and ".lora_" in n)
    total, count, logits = 0.0, sum(n - 1 for n in batch["lengths"]), []
    for e in batch["encs"]:
        out = peft(**e, use_cache=False).logits
        logits.append(out[0].detach())
        total = total + torch.nn.functional.cross_entropy(out[0, :-1], e["input_ids"][0, 1:],
                                                          reduction="sum")
    (total / count).backward()
    ref = {n[len(prefix):].replace(".default.weight", ""): p.grad
           for n, p in peft.named_parameters() if n.startswith(prefix) and ".lora_" in n}
    merged = {k.replace("model.visual.", "visual."): v
              for k, v in peft.merge_and_unload().state_dict().items()
              if k.startswith("model.visual.")}
    written = load_file(world["root"] / "vl_tower_adapter" / "adapter_model.safetensors")
    exported = load_file(world["root"] / "tower_lora_export" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(written)
    assert all(torch.equal(exported[k], t) for k, t in written.items())
    for r in (r["lora"]["tower"] for r in world["results"]):
        tower = [n for n in r["trainable"] if n.startswith("visual.")]
        assert len(tower) == 2 * len(linears) and \
            all(".lora_A.default." in n or ".lora_B.default." in n or "_lora.lora_" in n
                for n in r["trainable"])
        for i, (base, adapted) in enumerate(zip(world["ref_logits"], logits)):
            n = batch["lengths"][i]
            assert (r["on"][i, :n] - adapted).abs().max() <= 1e-5, i
            assert (r["off"][i, :n] - base).abs().max() <= 1e-4, i
            assert (adapted - base).abs().max() > 1e-2
        assert sorted(r["grads"]) == sorted(ref)
        for name, g in r["grads"].items():
            scale = ref[name].abs().max().item()
            assert (g - ref[name]).abs().max().item() <= 1e-5 + 1e-4 * scale, name
        assert any(g.abs().max() > 0 for g in r["grads"].values())
        assert sorted(r["stream"]) == sorted(merged)
        for name, t in r["stream"].items():
            assert (t - merged[name]).abs().max() <= 1e-5, name
        assert r["restored"] and r["loaded"]


def test_freeze_options_choose_what_trains(world):
    trainable = world["results"][0][1, 1, False]["trainable"]
    vit = [n for n in trainable[False, False, True] if n.startswith("visual.model.")]
    assert vit and all(n.startswith("visual.model.") for n in trainable[False, False, True])
    default = trainable[True, True, False]
    assert default and not any(n.startswith("visual.") for n in default)
    assert "embedding.word_embeddings.weight" in default
    no_aligner = trainable[False, True, False]
    assert set(no_aligner) - set(default) == {n for n in vit if ".merger." not in n}


def test_freeze_option_errors():
    from megatron_grpo.model.vision import apply_freeze

    with pytest.raises(ValueError, match="--freeze_vit false .*text-only"):
        apply_freeze([torch.nn.Linear(2, 2)], freeze_vit=False)
    apply_freeze([torch.nn.Linear(2, 2)])       # the defaults are fine on a text model


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(world):
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    original = load_file(world["model_dir"] / "model.safetensors")
    for out in ("hf_tp1", "hf_pp2"):
        folder = world["root"] / out
        exported = {}
        for f in sorted(folder.glob("*.safetensors")):
            exported.update(load_file(f))
        assert sorted(exported) == sorted(original), out
        for name, t in original.items():
            assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), (out, name)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(world["root"] / "hf_tp1",
                                                               dtype=torch.float32).eval()
    e = world["batch"]["encs"][0]
    with torch.no_grad():
        logits = model(**e, use_cache=False).logits[0]
    assert (logits - world["ref_logits"][0]).abs().max() <= 1e-6


def test_manifest_is_the_checkpoint_under_either_naming(model_dir, tmp_path):
    """The bridge's manifest (language rules + the meta-device tower's tensors) is exactly
    the checkpoint transformers saved, at TP=1 and TP=2 x PP=2; a checkpoint written with
    the in-memory names (model.language_model.*, model.visual.*) reads the same."""
    from safetensors.torch import load_file, save_file

    from bridge import manifest
    from bridge.hf_checkpoint import HFCheckpoint
    from bridge.mappings import get_mapping
    from megatron_grpo.model import build_transformer_config

    with HFCheckpoint(model_dir) as ckpt:
        found = ckpt.shapes()
    for tp, pp in ((1, 1), (2, 2)):
        config, args = build_transformer_config(model_dir, tp=tp, pp=pp)
        assert args.position_embedding_type == "mrope" and config.mrope_section == [4, 6, 6]
        assert manifest(config, args) == found
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v
               for k, v in load_file(model_dir / "model.safetensors").items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    with HFCheckpoint(tmp_path, get_mapping("qwen2_5_vl").hf_aliases) as ckpt:
        assert ckpt.shapes() == found
        name = "visual.blocks.0.attn.qkv.weight"
        assert torch.equal(ckpt.read(name, 0, 0, 8), renamed["model." + name][:8])


def test_trainer_forward_takes_images_per_sample(world):
    """Samples carrying their prompt's ImageInputs, collated by train/batch.py and run by
    engine.forward_logprobs (TP=2 with SP): the completion log-probs are HF's."""
    seen = [r["trainer_logps"] for r in world["results"] if r["trainer_logps"] is not None]
    assert seen
    for logps in seen:
        for ours, ref in zip(logps, world["ref_logps"]):
            assert (ours.double() - ref).abs().max() <= 1e-5


def test_padding_free_takes_images_and_mrope_positions(world):
    """--padding_free true (train/packing.py): packed micro-batches of the two image prompts
    at TP=2+SP and at CP=2 give HF's completion log-probs; two text-only samples in a VL
    model (the [B, S] position path) give the same log-probs packed as padded at CP=2."""
    seen = [r["packed_logps"] for r in world["results"] if r["packed_logps"] is not None]
    seen += [r["cp2"]["packed_logps"] for r in world["results"]]
    assert len(seen) == 2 * len(world["results"])
    for logps in seen:
        for ours, ref in zip(logps, world["ref_logps"]):
            assert (ours.double() - ref).abs().max() <= 1e-5
    for r in world["results"]:
        for ours, ref in zip(r["cp2"]["packed_text"], r["cp2"]["padded_text"]):
            assert ours.shape == ref.shape and (ours - ref).abs().max() <= 1e-5


def test_collate_carries_images_and_positions(world):
    """A completion holding the image token id as text stays text: image_mask covers the
    prompt only; positions continue with rope_delta; images concatenate in row order."""
    from megatron_grpo.train.batch import Sample, collate

    batch = world["batch"]
    image_id = batch["image_token_id"]
    samples = _samples(batch, image_id)
    samples[0].completion_ids = [5, image_id, 9]
    text = Sample(prompt_ids=[1, 2, 3], completion_ids=[4])
    mb = collate([samples[1], text, samples[0]])
    n0, n1 = batch["lengths"]
    assert mb["position_ids"].shape == (3, 3, mb["input_ids"].shape[1])
    assert torch.equal(mb["position_ids"][:, 1, :3], torch.arange(3).expand(3, -1))
    assert torch.equal(mb["position_ids"][:, 2, :n0], batch["pos"][:, 0, :n0])
    assert torch.equal(mb["position_ids"][:, 2, n0:n0 + 2],
                       (torch.arange(n0, n0 + 2) + samples[0].images.rope_delta).expand(3, -1))
    assert mb["input_ids"][2, n0 + 1] == image_id and not mb["image_mask"][2, n0:].any()
    assert int(mb["image_mask"].sum()) == int((batch["ids"] == image_id).sum())
    assert torch.equal(mb["pixel_values"], torch.cat(batch["pixel_values_of"][::-1]))
    assert torch.equal(mb["image_grid_thw"], torch.cat(batch["image_grid_thw_of"][::-1]))
    assert "pixel_values" not in collate([text])


def test_sync_stream_leaves_frozen_vision_weights_out(world):
    """--freeze_vit true --freeze_aligner false: a sync streams the merger and the language
    model (every rank, PP=2: the tower lives on stage 0), the original tensors exactly."""
    from bridge.mappings.vision import sync_filter
    from safetensors.torch import load_file

    original = load_file(world["model_dir"] / "model.safetensors")
    want = {n for n in original if not n.startswith("visual.") or n.startswith("visual.merger.")}
    for r in world["results"]:
        stream = r["sync_stream"]
        assert set(stream) == want
        assert all(torch.equal(t, original[n]) for n, t in stream.items())
    assert sync_filter(False, False) is None


# --------------------------------------------------------------------------- Qwen2-VL
def _qwen2_vl_inputs(path):
    """A tiny Qwen2-VL (tools/make_tiny_vl_model.py family qwen2_vl: its vision blocks differ
    from 2.5's: LayerNorm, fc1/fc2 MLP, no windows), the first test prompt through its own
    processor (compat's image-only Qwen2VLProcessor without torchvision), HF's logits."""
    from transformers import Qwen2VLForConditionalGeneration

    from megatron_grpo.model.mrope import mrope_positions
    from megatron_grpo.platform.compat import transformers as compat_transformers
    from tests.test_vl_tiny_model import hf_logits

    make_tiny_vl_model(path, family="qwen2_vl")
    processor = compat_transformers.load_processor(str(path), "qwen2_vl")
    enc = encode(processor, PROMPTS[0], IMAGES[0]())
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pos, _ = mrope_positions(enc["input_ids"][0], enc["image_grid_thw"], hf.config.image_token_id)
    return dict(path=str(path), ids=enc["input_ids"], pos=pos[:, None],
                pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                processor=type(processor).__mro__[1].__name__, ref=hf_logits(hf, enc))


def _qwen2_vl_phase(world_size, q):
    """Qwen2-VL at TP=2: the logits on the image prompt and the bridge's manifest."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import load_hf_weights, manifest
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=2), seed=1)
    config, args = build_transformer_config(q["path"], tp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, q["path"])
    chunks[0].eval()
    with torch.no_grad():
        out = chunks[0](q["ids"], q["pos"], None, pixel_values=q["pixel_values"],
                        image_grid_thw=q["image_grid_thw"])
    return dict(logits=gather_from_tensor_model_parallel_region(out)[..., :args.vocab_size],
                names=manifest(config, args))


def test_qwen2_vl_logits_equal_hf(world):
    """Qwen2-VL goes through the same code: its own processor loads without torchvision
    (compat's image-only Qwen2VLProcessor), the bridge's manifest is its checkpoint and the
    logits at TP=2 on an image prompt (a PIL image, 12 image tokens) are HF's."""
    from safetensors import safe_open

    q = world["qwen2_vl"]
    assert q["processor"] == "Qwen2VLProcessor"
    assert int((q["ids"] == world["batch"]["image_token_id"]).sum()) == 12
    with safe_open(os.path.join(q["path"], "model.safetensors"), "pt") as f:
        names = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert any(".mlp.fc1." in k for k in names)     # Qwen2-VL's tower, not 2.5's
    for r in world["results"]:
        assert r["qwen2_vl"]["names"] == names
        assert (r["qwen2_vl"]["logits"][0].double() - q["ref"]).abs().max() <= 1e-4
