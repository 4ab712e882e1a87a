"""Checkpoints resume training bit-identically and reload weights under another TP.

Dropout is switched on (hidden and attention) so that a resume that failed to restore
the torch generator or Megatron's RNG tracker would draw other masks and diverge.
The LoRA case (adapters on every linear, with dropout on their input too; the base
frozen but for --modules_to_save embed_tokens and lm_head) holds that a checkpoint of
adapters, those two parameters and their optimizer state alone resumes exactly: the same losses, adapter weights and learning rate as the uninterrupted run.
"""
import os

import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2, fixed_batches, run_schedule, setup

SEQ, MBS, VOCAB = 16, 2, TINY_QWEN2["vocab_size"]
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)


def _trainer(world, tp, dist_opt, seed, lora=False):
    """Model, optimizer and a warm-up + cosine LR schedule (the LR changes every step).
    lora: rank-4 adapters on every linear (dropout 0.1), the base frozen but for the
    embedding and output layer (--modules_to_save embed_tokens lm_head)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_grpo.model import wrap_ddp
    from megatron_grpo.model.lora import LoraSettings, apply_lora

    config, args, chunks = setup(world, tp=tp, seed=seed, **DROPOUT)
    if lora:
        apply_lora(chunks, config, args, LoraSettings(
            rank=4, alpha=8, dropout=0.1, modules_to_save=("embed_tokens", "lm_head")))
    chunks = wrap_ddp(config, chunks, use_distributed_optimizer=dist_opt)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                        bf16=False, use_distributed_optimizer=dist_opt, clip_grad=1.0),
        chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4,
                                    lr_warmup_steps=2, lr_decay_steps=6, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=6,
                                    wd_incr_style="constant")
    return chunks, opt, sched


def _train_step(chunks, opt, sched, step):
    """One optimizer step on the batch of `step` (the data position); the mean loss."""
    from megatron.core import parallel_state as ps

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = fixed_batches(2, MBS, SEQ, VOCAB, seed=100 + step)[dp_rank::dp]
    losses, _ = run_schedule(chunks, batches, SEQ, MBS)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)
    return sum(losses) / len(losses)


def _state(chunks, opt):
    weights = [p.detach().clone() for c in chunks for p in c.parameters()]
    return weights, opt.param_groups[0]["lr"]


def _eval_logits(chunks):
    for c in chunks:
        c.eval()
    _, logits = run_schedule(chunks, fixed_batches(1, MBS, SEQ, VOCAB, seed=5), SEQ, MBS,
                             forward_only=True, collect_logits=True)
    for c in chunks:
        c.train()
    return logits[0][..., :VOCAB]


def _first_run(rank, world, out, tp, dist_opt, sharding="fully_reshardable", lora=False):
    """Train 2 steps, save, train 2 more: the reference for the resumed run."""
    from megatron_grpo.checkpoint import save_checkpoint

    chunks, opt, sched = _trainer(world, tp, dist_opt, seed=1234, lora=lora)
    for step in (1, 2):
        _train_step(chunks, opt, sched, step)
    logits = _eval_logits(chunks)  # eval mode: draws no random numbers
    save_checkpoint(out, 2, chunks, opt, sched,
                    extra_state={"step": 2, "sampler": {"epoch": 0, "position": 2 * (rank + 1)},
                                 "config": {"tp": tp}},
                    optim_sharding_type="fully_reshardable" if sharding == "mem_efficient"
                    else sharding, mem_efficient=sharding == "mem_efficient")
    losses = [_train_step(chunks, opt, sched, step) for step in (3, 4)]
    return losses, *_state(chunks, opt), logits


def _resumed_run(rank, world, out, tp, dist_opt, lora=False):
    import random

    from megatron_grpo.checkpoint import find_latest_checkpoint, resume

    # Other initial weights and RNG streams: only the checkpoint can make them agree.
    # (LoRA: the frozen base is the run's --model, not in the checkpoint: the same seed
    # builds the same base here; the adapters start from their initial values.)
    chunks, opt, sched = _trainer(world, tp, dist_opt, seed=1234 if lora else 999, lora=lora)
    random.seed(7)
    torch.manual_seed(7)
    before = _state(chunks, opt)[0]
    extra = resume(out, chunks, opt, sched)  # what the trainer calls
    path = find_latest_checkpoint(out)
    losses = [_train_step(chunks, opt, sched, step) for step in (extra["step"] + 1,
                                                                 extra["step"] + 2)]
    return losses, *_state(chunks, opt), extra, before, os.path.basename(path)


@pytest.fixture(scope="module")
def tp2_plain_first_run(tmp_path_factory):
    """The TP=2 plain-optimizer reference run, shared by the resume and TP=1 tests."""
    out = str(tmp_path_factory.mktemp("tp2_plain"))
    return out, run_distributed(_first_run, 2, args=(out, 2, False), timeout=300)


@pytest.mark.parametrize("tp,dist_opt,sharding,lora", [
    (2, False, None, False), (1, True, "dp_reshardable", False),
    pytest.param(1, True, "fully_reshardable", False, marks=pytest.mark.slow),
    pytest.param(1, True, "mem_efficient", False, marks=pytest.mark.slow),
    pytest.param(2, True, "fully_reshardable", False, marks=pytest.mark.slow),
    pytest.param(1, True, "fully_reshardable", True, marks=pytest.mark.slow)],
    ids=["tp2-plain", "dp2-distopt", "dp2-distopt-fully_reshardable",
         "dp2-distopt-fully_reshardable-mem_efficient", "tp2-distopt", "dp2-distopt-lora"])
def test_resume_is_bit_identical(tmp_path, request, tp, dist_opt, sharding, lora):
    if not dist_opt:
        out, first = request.getfixturevalue("tp2_plain_first_run")
    else:
        out = str(tmp_path)
        first = run_distributed(_first_run, 2, args=(out, tp, dist_opt, sharding, lora),
                                timeout=300)
    resumed = run_distributed(_resumed_run, 2, args=(out, tp, dist_opt, lora), timeout=300)
    for rank in range(2):
        ref_losses, ref_w, ref_lr, _ = first[rank]
        losses, w, lr, extra, before, name = resumed[rank]
        assert name == "checkpoint-2"
        # Per-rank extra_state comes back to its own rank.
        assert extra == {"step": 2, "sampler": {"epoch": 0, "position": 2 * (rank + 1)},
                         "config": {"tp": tp}}
        assert not all(torch.equal(a, b) for a, b in zip(before, ref_w))
        assert losses == ref_losses  # exact: same weights, Adam moments, LR, data, masks
        assert lr == ref_lr
        assert len(w) == len(ref_w) and all(torch.equal(a, b) for a, b in zip(w, ref_w))


def _load_weights_tp1(rank, world, path):
    from megatron_grpo.checkpoint import load_checkpoint

    _, _, chunks = setup(world, tp=1, seed=999, **DROPOUT)
    extra = load_checkpoint(path, chunks)  # weights only, another layout
    return _eval_logits(chunks), extra


def test_tp2_checkpoint_loads_at_tp1(tp2_plain_first_run):
    out, first = tp2_plain_first_run
    logits_tp1, extra = run_distributed(_load_weights_tp1, 1,
                                        args=(os.path.join(out, "checkpoint-2"),))[0]
    # The TP=2 run's logits at the checkpoint (gathered over TP) from one TP=1 rank.
    torch.testing.assert_close(logits_tp1, first[0][3], atol=1e-5, rtol=0)
    assert extra["step"] == 2 and extra["sampler"]["position"] == 2  # rank 0's
