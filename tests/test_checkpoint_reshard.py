"""Checkpoints do not depend on the TP that wrote them, also with fewer kv heads than TP.

The model: a tiny Qwen2 (qkv bias) with 4 query heads, ONE kv head and tied embeddings,
so at TP=2 every rank holds a replica of the kv head (model/kv_replication.py) and at
PP=2 the last stage holds a copy of the embedding.

- `megatron export --to_mcore` at TP2 x PP2 -> `--to_hf` on one process (TP=1) and on
  4 processes (TP=4: 4 replicas) writes the original safetensors bit for bit.
- `--to_mcore` at TP=1 (no replicas) loads at TP=2 (replicas filled in): the logits and
  the loss equal the TP=1 model's and HF transformers'.
- The gradient norm counts each replicated kv head once: at TP=2 x DP=1, TP=2 x DP=2 and
  TP=4 (plain and distributed optimizer) it equals TP=1's, and the clipped steps agree.
- A training checkpoint (distributed optimizer, Adam moments) saved at TP=2 resumes at
  TP=1 x DP=2, gradient clipping on: the next two steps' losses equal those of the TP=2
  run that went on.
- A checkpoint an older version wrote in the replicated layout is refused at another TP
  before any process starts.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os

import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import fixed_batches, run_schedule

SEQ, MBS, VOCAB = 16, 2, 1000


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("reshard") / "hf", family="qwen2",
                           num_layers=4, num_attention_heads=4, num_key_value_heads=1,
                           vocab_size=VOCAB, tie_word_embeddings=True)


def _convert(argv):
    from megatron_grpo.convert import main

    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)


def _tensors(path):
    from tests.harness import hf_tensors as _hf_tensors

    return _hf_tensors(path)


def _assert_same_tensors(got_dir, want_dir):
    got, want = _tensors(got_dir), _tensors(want_dir)
    assert list(got) and sorted(got) == sorted(want), got_dir
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (got_dir, name)


# ---------------------------------------------------------------- export: TP2 x PP2 -> TP1
def _to_mcore_tp2pp2_then_to_hf_tp4(rank, world, hf, root):
    _convert(["--to_mcore", "true", "--model", hf, "--output_dir", os.path.join(root, "mcore"),
              "--tensor_model_parallel_size", "2", "--pipeline_model_parallel_size", "2"])
    _convert(["--to_hf", "true", "--mcore_model", os.path.join(root, "mcore"), "--output_dir",
              os.path.join(root, "hf_tp4"), "--tensor_model_parallel_size", "4"])


def _to_hf_tp1(rank, world, root):
    _convert(["--to_hf", "true", "--mcore_model", os.path.join(root, "mcore"), "--output_dir",
              os.path.join(root, "hf_tp1")])


def test_tp2_pp2_checkpoint_exports_on_one_process(hf_model, tmp_path):
    run_distributed(_to_mcore_tp2pp2_then_to_hf_tp4, 4, args=(str(hf_model), str(tmp_path)),
                    timeout=400)
    run_distributed(_to_hf_tp1, 1, args=(str(tmp_path),), timeout=300)
    _assert_same_tensors(tmp_path / "hf_tp1", hf_model)
    _assert_same_tensors(tmp_path / "hf_tp4", hf_model)


# ---------------------------------------------------------------- load: TP1 -> TP2
def _logits_and_loss(rank, world, hf, mcore, save, save_metadata=None):
    """Build at TP=world, load the HF weights and save (save=True) or load `mcore`; the
    HF-vocab logits [B, S, V] and the token-mean cross-entropy of one fixed batch."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.convert import _sharded_state_dict, megatron_logits
    from bridge.load import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config, unwrap
    from megatron_grpo.model.kv_replication import checkpoint_load_metadata
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world, tp=world))
    config, args = build_transformer_config(hf, tp=world)
    chunks = build_model(config, args)
    if save:
        load_hf_weights(chunks, config, args, hf)
        if rank == 0:
            os.makedirs(mcore)
        torch.distributed.barrier()
        dist_checkpointing.save(_sharded_state_dict(chunks, save_metadata), mcore)
    else:
        meta = checkpoint_load_metadata(mcore, chunks, mcore)
        state = dist_checkpointing.load(_sharded_state_dict(chunks, meta), mcore)
        unwrap(chunks[0]).load_state_dict(state["model"])
    ids, _, labels = fixed_batches(1, MBS, SEQ, VOCAB, seed=3)[0]
    logits = megatron_logits(chunks, config, args, ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return logits, loss, meta if not save else None


def test_tp1_checkpoint_loads_at_tp2_with_replicas(hf_model, tmp_path):
    from transformers import AutoModelForCausalLM

    mcore = str(tmp_path / "mcore_tp1")
    (logits1, loss1, _), = run_distributed(_logits_and_loss, 1,
                                           args=(str(hf_model), mcore, True), timeout=300)
    tp2 = run_distributed(_logits_and_loss, 2, args=(str(hf_model), mcore, False), timeout=300)
    ids, _, labels = fixed_batches(1, MBS, SEQ, VOCAB, seed=3)[0]
    hf = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(input_ids=ids).logits.float()
    torch.testing.assert_close(logits1, reference, atol=1e-4, rtol=0)
    for logits2, loss2, meta in tp2:
        assert meta == {}  # the new layout: no legacy flag
        torch.testing.assert_close(logits2, logits1, atol=1e-5, rtol=0)
        torch.testing.assert_close(loss2, loss1, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- training: TP2 -> TP1
def _trainer(world, tp, hf, dist_opt=True, clip_grad=1.0):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.load import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.model.kv_replication import count_kv_once_in_grad_norm
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world, tp=tp), seed=1234)
    config, args = build_transformer_config(hf, tp=tp)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, hf)  # replicas start equal
    chunks = wrap_ddp(config, chunks, use_distributed_optimizer=dist_opt)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, bf16=False,
                        use_distributed_optimizer=dist_opt, clip_grad=clip_grad), chunks)
    count_kv_once_in_grad_norm(opt, chunks, config, args)  # as train/setup.py does
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4,
                                    lr_warmup_steps=2, lr_decay_steps=6, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=6,
                                    wd_incr_style="constant")
    return chunks, config, args, opt, sched


def _train_step(chunks, config, args, opt, sched, step):
    """One optimizer step on the 2 micro-batches of `step` (split over DP); the mean loss
    over all of them and the gradient norm, on every rank."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.model.kv_replication import sync_replicated_kv_grads

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = fixed_batches(2, MBS, SEQ, VOCAB, seed=100 + step)[dp_rank::dp]
    losses, _ = run_schedule(chunks, batches, SEQ, MBS)
    sync_replicated_kv_grads(chunks, config, args)  # as the trainer does
    ok, grad_norm, _ = opt.step()
    assert ok
    sched.step(increment=1)
    loss = torch.tensor(sum(losses) / len(losses))
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return (loss / dp).item(), float(grad_norm)


# ---------------------------------------------------------------- grad norm: TP=n == TP=1
CLIP = 0.5      # below every step's norm (about 4.5): each step is clipped


def _losses_and_norms(rank, world, hf, tp, dist_opt):
    """(loss, grad norm) of three clipped steps; the first has lr 0 (warm-up), so the
    losses of steps 2 and 3 show the clipped updates of steps 1-2."""
    chunks, config, args, opt, sched = _trainer(world, tp, hf, dist_opt, clip_grad=CLIP)
    return [_train_step(chunks, config, args, opt, sched, step) for step in (1, 2, 3)]


@pytest.mark.parametrize("world,tp,dist_opt", [(2, 2, False), (4, 4, False), (2, 2, True),
                                               (4, 2, True), (4, 4, True)])
def test_grad_norm_counts_each_kv_head_once(hf_model, world, tp, dist_opt):
    """Megatron counts a TP-sharded parameter on every rank, so each of the `tp` replicas of
    the one kv head would enter the norm (TP=2: 4.99 instead of 4.46)."""
    reference = _tp1_reference(str(hf_model))
    assert all(norm > CLIP for _, norm in reference), reference
    results = run_distributed(_losses_and_norms, world, args=(str(hf_model), tp, dist_opt),
                              timeout=400)
    for got in results:
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def _tp1_reference(hf):
    (reference,) = run_distributed(_losses_and_norms, 1, args=(hf, 1, False), timeout=400)
    return reference


def _train_save_continue(rank, world, hf, out, dist_opt=True, sharding="fully_reshardable",
                         steps=(3, 4)):
    from megatron_grpo.checkpoint import save_checkpoint

    chunks, config, args, opt, sched = _trainer(world, 2, hf, dist_opt)
    for step in (1, 2):
        _train_step(chunks, config, args, opt, sched, step)
    save_checkpoint(out, 2, chunks, opt, sched, extra_state={"step": 2},
                    optim_sharding_type=sharding)
    return [_train_step(chunks, config, args, opt, sched, step)[0] for step in steps]


def _resume_tp1_refused(rank, world, hf, out):
    from megatron_grpo.checkpoint import resume

    chunks, config, args, opt, sched = _trainer(world, 1, hf, True)
    try:
        resume(out, chunks, opt, sched)
    except ValueError as e:
        return str(e)
    return None


def _resume_tp1(rank, world, hf, out, dist_opt=True):
    from megatron_grpo.checkpoint import resume

    chunks, config, args, opt, sched = _trainer(world, 1, hf, dist_opt)   # TP=1 x DP=2
    extra = resume(out, chunks, opt, sched)
    return [_train_step(chunks, config, args, opt, sched, extra["step"] + i)[0]
            for i in (1, 2)]


def test_training_checkpoint_tp2_resumes_at_tp1(hf_model, tmp_path):
    out = str(tmp_path / "run")
    continued = run_distributed(_train_save_continue, 2, args=(str(hf_model), out), timeout=400)
    resumed = run_distributed(_resume_tp1, 2, args=(str(hf_model), out), timeout=400)
    assert continued[0] == continued[1] and resumed[0] == resumed[1]
    # Step 3 checks the weights; step 4 also the Adam moments, step count and LR.
    torch.testing.assert_close(resumed[0], continued[0], atol=1e-5, rtol=1e-5)
    meta = json.loads((tmp_path / "run" / "checkpoint-2" / "checkpoint.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["contents"]["optimizer"] == "saved"


def test_flat_optimizer_checkpoint_refuses_another_tp_naming_the_fix(hf_model, tmp_path):
    """The default save (dp_reshardable: each rank's flat buffers, nothing gathered) loads
    under the saving TP/PP only; another TP is refused before any tensor is read."""
    out = str(tmp_path / "run")
    run_distributed(_train_save_continue, 2, args=(str(hf_model), out, True, "dp_reshardable", ()),
                    timeout=400)
    errors = run_distributed(_resume_tp1_refused, 2, args=(str(hf_model), out), timeout=400)
    assert errors[0] == errors[1] and errors[0] is not None
    assert "tp 2 -> 1" in errors[0] and "--dist_ckpt_optim_fully_reshardable true" in errors[0]
    assert "--finetune true" in errors[0]


# ---------------------------------------------------------------- legacy layout
def _legacy_checkpoint(path, layers, groups, heads=4, head_dim=16, hidden=64):
    """A dist checkpoint folder whose linear_qkv has `groups` query groups (its metadata is
    all the layout check reads)."""
    import torch.distributed.checkpoint as dcp

    rows = (heads + 2 * groups) * head_dim
    dcp.save({"decoder.layers.self_attention.linear_qkv.weight":
              torch.zeros(layers, rows, hidden)}, checkpoint_id=str(path), no_dist=True)


def _load_error(rank, world, hf, mcore):
    try:
        _logits_and_loss(rank, world, hf, mcore, False)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_legacy_replicated_checkpoint_loads_at_its_own_tp_only(hf_model, tmp_path):
    """The replicated layout of older versions (written here with the legacy flag) loads
    at the TP that wrote it and is refused, naming that TP, at another one."""
    from megatron_grpo.model.kv_replication import LEGACY_QKV_METADATA_KEY

    mcore = str(tmp_path / "legacy")
    (saved_logits, _, _), _ = run_distributed(
        _logits_and_loss, 2, args=(str(hf_model), mcore, True, {LEGACY_QKV_METADATA_KEY: True}),
        timeout=300)
    for logits, _, meta in run_distributed(_logits_and_loss, 2,
                                           args=(str(hf_model), mcore, False), timeout=300):
        assert meta == {LEGACY_QKV_METADATA_KEY: True}
        torch.testing.assert_close(logits, saved_logits, atol=0, rtol=0)
    error, = run_distributed(_load_error, 1, args=(str(hf_model), mcore), timeout=300)
    assert "saved by an older version at tensor parallel size 2" in error, error


def test_legacy_replicated_checkpoint_refused_before_start_up(hf_model, tmp_path):
    from megatron_grpo.convert import check_args

    mcore = tmp_path / "mcore"
    hf_config = mcore / "hf_config"
    hf_config.mkdir(parents=True)
    (hf_config / "config.json").write_bytes((hf_model / "config.json").read_bytes())
    _legacy_checkpoint(mcore, layers=4, groups=2)  # 1 kv head replicated at TP=2
    base = ["--to_hf", "true", "--mcore_model", str(mcore), "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="saved by an older version at tensor parallel size 2"
                                         ".*use --tensor_model_parallel_size 2"):
        check_args(base, 1)
    check_args(base + ["--tensor_model_parallel_size", "2"], 2)
    # The layout of this version (1 group: the HF kv head) loads anywhere.
    new = tmp_path / "new"
    (new / "hf_config").mkdir(parents=True)
    (new / "hf_config" / "config.json").write_bytes((hf_model / "config.json").read_bytes())
    _legacy_checkpoint(new, layers=4, groups=1)
    base = ["--to_hf", "true", "--mcore_model", str(new), "--output_dir", str(tmp_path / "o")]
    for tp in (1, 2, 4):
        check_args(base + ["--tensor_model_parallel_size", str(tp)], 4)


def test_qkv_blocks_cover_the_hf_grouped_layout():
    """Every head block of the HF-grouped layout is saved exactly once (replica 0)."""
    from megatron_grpo.model.kv_replication import _qkv_blocks

    for heads, kv, tp in ((4, 1, 2), (4, 1, 4), (12, 2, 4), (8, 2, 8)):
        main = [i for r in range(tp) for i, is_kv in _qkv_blocks(heads, kv, tp, r)
                if not is_kv or r % (tp // kv) == 0]
        assert sorted(main) == list(range(kv * (heads // kv + 2))), (heads, kv, tp)
