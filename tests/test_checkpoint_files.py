"""Checkpoint folders: a crash mid-save, save_total_limit, `latest`, RNG round trips, and
ms-swift's --no_save_optim / --no_save_rng / --finetune (what is on disk, what a load does)."""
import json
import os
import random
import signal

import numpy as np
import pytest
import torch

from tests.harness import DistributedTestError, run_distributed
from tests.mcore_utils import setup

from megatron_grpo.checkpoint import (find_latest_checkpoint, list_checkpoints,
                                      load_checkpoint, save_checkpoint)


def _names(out):
    return sorted(os.listdir(out))


# ---------------------------------------------------------------- no processes needed
def _fake_checkpoint(out, step, complete=True):
    path = os.path.join(out, f"checkpoint-{step}")
    os.makedirs(os.path.join(path, "dist"))
    if complete:
        with open(os.path.join(path, "checkpoint.json"), "w") as f:
            json.dump({"step": step}, f)
    return path


def test_find_latest_skips_partial_folders(tmp_path):
    out = str(tmp_path)
    assert find_latest_checkpoint(out) is None
    assert find_latest_checkpoint(os.path.join(out, "missing")) is None
    _fake_checkpoint(out, 3)
    _fake_checkpoint(out, 5)
    _fake_checkpoint(out, 9, complete=False)        # a folder without checkpoint.json
    os.makedirs(os.path.join(out, ".checkpoint-12.tmp", "dist"))  # a crashed save
    os.makedirs(os.path.join(out, "checkpoint-x"))
    assert [s for s, _ in list_checkpoints(out)] == [3, 5]
    assert find_latest_checkpoint(out) == os.path.join(out, "checkpoint-5")
    # `latest` names the last committed save and wins over a higher-numbered folder
    # (one an earlier run left in the same output_dir) ...
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("checkpoint-3\n")
    assert find_latest_checkpoint(out) == os.path.join(out, "checkpoint-3")
    # ... but never points at something incomplete or gone.
    for stale in ("checkpoint-9", "checkpoint-12", "garbage"):
        with open(os.path.join(out, "latest"), "w") as f:
            f.write(stale)
        assert find_latest_checkpoint(out) == os.path.join(out, "checkpoint-5")


def test_bad_arguments_raise_before_any_collective(tmp_path):
    with pytest.raises(ValueError, match="save_total_limit"):
        save_checkpoint(str(tmp_path), 1, [], save_total_limit=0)
    with pytest.raises(ValueError, match="optim_sharding_type.*fully_reshardable"):
        save_checkpoint(str(tmp_path), 1, [], optim_sharding_type="zero")
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(str(tmp_path), -1, [])
    incomplete = _fake_checkpoint(str(tmp_path), 4, complete=False)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(incomplete, [])


# ---------------------------------------------------------------- a crash mid-save
def _weights(chunks):
    return torch.cat([p.detach().flatten() for c in chunks for p in c.parameters()])


def _crashing_run(rank, world, out):
    """Save step 1, train, then die by SIGKILL inside the save of step 2, right after
    Megatron's distributed checkpoint (model and optimizer) has been written."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_grpo.checkpoint as ckpt
    from megatron_grpo.model import wrap_ddp
    from tests.mcore_utils import TINY_QWEN2, fixed_batches, run_schedule

    config, _, chunks = setup(world, tp=2)
    chunks = wrap_ddp(config, chunks)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False),
                                 chunks)
    ckpt.save_checkpoint(out, 1, chunks, opt, extra_state={"step": 1})
    torch.save(_weights(chunks), os.path.join(out, f"weights_at_1.rank{rank}.pt"))
    run_schedule(chunks, fixed_batches(1, 2, 8, TINY_QWEN2["vocab_size"]), 8, 2)
    opt.step()

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt._write_rank_state = die
    ckpt.save_checkpoint(out, 2, chunks, opt, extra_state={"step": 2})
    return "not reached"


def _restart(rank, world, out):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_grpo.model import wrap_ddp

    config, _, chunks = setup(world, tp=2, seed=99)
    chunks = wrap_ddp(config, chunks)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False),
                                 chunks)
    path = find_latest_checkpoint(out)
    extra = load_checkpoint(path, chunks, opt)
    same = torch.equal(_weights(chunks),
                       torch.load(os.path.join(out, f"weights_at_1.rank{rank}.pt")))
    save_checkpoint(out, extra["step"] + 1, chunks, opt, extra_state={"step": 2})
    return os.path.basename(path), extra, same


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    out = str(tmp_path)
    with pytest.raises(DistributedTestError, match="exited with code -9"):
        run_distributed(_crashing_run, 2, args=(out,), timeout=300)
    # The crash happened after the sharded part of step 2 was on disk ...
    partial = os.path.join(out, ".checkpoint-2.tmp")
    assert os.listdir(os.path.join(partial, "dist"))
    assert not os.path.exists(os.path.join(partial, "checkpoint.json"))
    # ... yet nothing that resume would pick up refers to it.
    assert not os.path.exists(os.path.join(out, "checkpoint-2"))
    assert [s for s, _ in list_checkpoints(out)] == [1]
    assert find_latest_checkpoint(out) == os.path.join(out, "checkpoint-1")
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "checkpoint-1"
    with open(os.path.join(out, "checkpoint-1", "checkpoint.json")) as f:
        assert json.load(f)["contents"]["optimizer"] == "fresh"  # saved before any step

    results = run_distributed(_restart, 2, args=(out,), timeout=300)
    for name, extra, same_weights in results:
        assert name == "checkpoint-1" and extra == {"step": 1} and same_weights
    with open(os.path.join(out, "checkpoint-2", "checkpoint.json")) as f:
        assert json.load(f)["contents"]["optimizer"] == "fresh"  # the restart never stepped
    # The next save swept the partial folder and committed step 2.
    assert [n for n in _names(out) if n.startswith(("checkpoint", ".", "latest"))] == \
        ["checkpoint-1", "checkpoint-2", "latest"]
    assert find_latest_checkpoint(out) == os.path.join(out, "checkpoint-2")


# ---------------------------------------------------------------- one rank: limit + RNG
def _draw():
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # the model-parallel stream
        tracked = torch.rand(4)
    return [random.random(), float(np.random.rand()), torch.rand(4), tracked]


def _single_rank(rank, world, out):
    from megatron_grpo.checkpoint import collect_rng_state, restore_rng_state

    _, _, chunks = setup(world, tp=1)
    res = {}
    # RNG: in memory, through a file, and through save/load_checkpoint.
    state = collect_rng_state()
    res["first"] = _draw()
    restore_rng_state(state)
    res["restored"] = _draw()
    torch.save(state, os.path.join(out, "rng.pt"))
    restore_rng_state(torch.load(os.path.join(out, "rng.pt"), weights_only=False))
    res["from_file"] = _draw()
    rng_out = os.path.join(out, "rng_run")
    path = save_checkpoint(rng_out, 7, chunks, extra_state={"step": 7})
    res["after_save"] = _draw()
    _draw()
    load_checkpoint(path, chunks)
    res["after_load"] = _draw()

    # save_total_limit=2 over steps 1..4, then an older step written last.
    lim_out = os.path.join(out, "limit_run")
    listings = []
    for step in (1, 2, 3, 4, 2):
        save_checkpoint(lim_out, step, chunks, extra_state={"step": step}, save_total_limit=2)
        listings.append(sorted(os.listdir(lim_out)))
    res["listings"] = listings
    res["latest"] = os.path.basename(find_latest_checkpoint(lim_out))
    import multiprocessing

    # Megatron's writer would start a `spawn` Manager process for its results (2-3 s at
    # the first save of a process); a synchronous save needs none, and leaves no child.
    res["managers"] = [p.name for p in multiprocessing.active_children() if "Manager" in p.name]
    with open(os.path.join(lim_out, "checkpoint-4", "checkpoint.json")) as f:
        res["meta"] = json.load(f)
    return res


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    return run_distributed(_single_rank, 1, args=(str(tmp_path_factory.mktemp("one")),),
                           timeout=300)[0]


def _same(a, b):
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def test_rng_states_round_trip(single_rank):
    r = single_rank
    assert _same(r["first"], r["restored"]) and _same(r["first"], r["from_file"])
    assert _same(r["after_save"], r["after_load"])
    # Every stream had moved on between the two pairs, and the tracker's stream is
    # not the default one: a restore that skipped any of them would be caught.
    for i in range(4):
        x, y = r["first"][i], r["after_save"][i]
        assert not (torch.equal(x, y) if torch.is_tensor(x) else x == y)
    assert not torch.equal(r["first"][2], r["first"][3])


def test_save_total_limit_removes_oldest_only(single_rank):
    listings = single_rank["listings"]
    assert listings[0] == ["checkpoint-1", "latest"]
    assert listings[1] == ["checkpoint-1", "checkpoint-2", "latest"]
    assert listings[2] == ["checkpoint-2", "checkpoint-3", "latest"]
    assert listings[3] == ["checkpoint-3", "checkpoint-4", "latest"]
    # The one just written survives even though it has the lowest step.
    assert listings[4] == ["checkpoint-2", "checkpoint-4", "latest"]
    assert single_rank["latest"] == "checkpoint-2"
    assert single_rank["managers"] == []
    meta = single_rank["meta"]
    assert meta["step"] == 4 and meta["layout"]["world_size"] == 1
    assert meta["contents"]["optimizer"] is None and meta["contents"]["extra_state"] == ["step"]


# ---------------------------------------------------------------- --no_save_optim / _rng / --finetune
def _stepped(seed):
    """A one-rank model, distributed optimizer and scheduler after one step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_grpo.model import wrap_ddp
    from tests.mcore_utils import TINY_QWEN2, fixed_batches, run_schedule

    config, _, chunks = setup(1, tp=1, seed=seed)
    chunks = wrap_ddp(config, chunks, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3,
                                                 bf16=False, use_distributed_optimizer=True),
                                 chunks)
    sched = OptimizerParamScheduler(opt, init_lr=1e-2, max_lr=1e-2, min_lr=1e-3,
                                    lr_warmup_steps=0, lr_decay_steps=10,
                                    lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=10, wd_incr_style="constant")
    run_schedule(chunks, fixed_batches(1, 2, 8, TINY_QWEN2["vocab_size"]), 8, 2)
    opt.step()
    sched.step(increment=1)
    return chunks, opt, sched


def _dist_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(os.path.join(path, "dist")).read_metadata().state_dict_metadata)


def _save_flags_run(rank, world, out):
    import logging

    from megatron_grpo.platform.compat.megatron import torch_optimizers

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_grpo.checkpoint").addHandler(handler)

    chunks, opt, sched = _stepped(seed=1)
    full = save_checkpoint(out, 1, chunks, opt, sched, extra_state={"step": 1})
    lean = save_checkpoint(out, 2, chunks, opt, sched, extra_state={"step": 2},
                           save_optim=False, save_rng=False)
    saved = _weights(chunks)
    res = {"full_keys": _dist_keys(full), "lean_keys": _dist_keys(lean),
           "lean_rank_file": torch.load(os.path.join(lean, "rank_00000.pt"),
                                        weights_only=False)}

    def fresh_load(path, **kwargs):
        chunks, opt, sched = _stepped(seed=2)           # other weights, its own Adam state
        for o in torch_optimizers(opt):
            o.state.clear()                             # as a new run's (never stepped)
        sched.num_steps = 0
        torch.manual_seed(5)
        rng = torch.get_rng_state()
        warnings.clear()
        extra = load_checkpoint(path, chunks, opt, sched, **kwargs)
        return {"extra": extra, "same_weights": torch.equal(_weights(chunks), saved),
                "adam_state": sum(len(o.state) for o in torch_optimizers(opt)),
                "sched_steps": sched.num_steps,
                "rng_untouched": torch.equal(torch.get_rng_state(), rng),
                "warnings": list(warnings)}

    res["resume_lean"] = fresh_load(lean)
    res["resume_full"] = fresh_load(full)
    res["finetune"] = fresh_load(full, finetune=True)
    return res


def test_no_save_optim_no_save_rng_and_finetune(tmp_path):
    out = str(tmp_path)
    r, = run_distributed(_save_flags_run, 1, args=(out,), timeout=300)
    # On disk: the full checkpoint holds Adam moments, the lean one none; no RNG states.
    assert any(k.startswith("optimizer") for k in r["full_keys"])
    assert not any(k.startswith("optimizer") for k in r["lean_keys"])
    assert {k for k in r["lean_keys"] if not k.startswith("optimizer")} == \
        {k for k in r["full_keys"] if not k.startswith("optimizer")}
    assert r["lean_rank_file"] == {"rng": None, "extra_state": {"step": 2}}
    meta = {n: json.load(open(os.path.join(out, f"checkpoint-{n}", "checkpoint.json")))
            for n in (1, 2)}
    assert meta[1]["contents"]["optimizer"] == "saved" and meta[1]["contents"]["rng"] is True
    assert meta[2]["contents"]["optimizer"] == "not_saved" and meta[2]["contents"]["rng"] is False
    assert meta[2]["contents"]["scheduler"] is True

    # Resume from the lean one: weights and schedule, a fresh optimizer, generators left alone.
    lean = r["resume_lean"]
    assert lean["extra"] == {"step": 2} and lean["same_weights"] and lean["sched_steps"] == 1
    assert lean["adam_state"] == 0 and lean["rng_untouched"]
    assert any("without optimizer state (--no_save_optim)" in w for w in lean["warnings"])
    assert any("without RNG states (--no_save_rng)" in w for w in lean["warnings"])
    # The full one restores everything (the checks above can fail).
    full = r["resume_full"]
    assert full["extra"] == {"step": 1} and full["same_weights"] and full["sched_steps"] == 1
    assert full["adam_state"] > 0 and not full["rng_untouched"] and not full["warnings"]
    # --finetune: the weights only; the caller starts at step 0.
    ft = r["finetune"]
    assert ft["extra"] is None and ft["same_weights"] and ft["sched_steps"] == 0
    assert ft["adam_state"] == 0 and ft["rng_untouched"] and not ft["warnings"]


def _bf16_loads_run(rank, world, out):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_grpo.model import wrap_ddp
    from tests.mcore_utils import TINY_QWEN2, fixed_batches, run_schedule

    def build(seed, distributed):
        config, _, chunks = setup(1, tp=1, seed=seed, dtype="bfloat16")
        chunks = wrap_ddp(config, chunks, use_distributed_optimizer=distributed)
        return chunks, get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-6, bf16=True, params_dtype=torch.bfloat16,
            use_distributed_optimizer=distributed), chunks)

    def one_step(chunks, opt):
        run_schedule(chunks, fixed_batches(1, 2, 8, TINY_QWEN2["vocab_size"]), 8, 2)
        opt.step()

    chunks, opt = build(1, True)
    fresh = save_checkpoint(out, 0, chunks, opt, None, {"step": 0})   # before any step
    saved = {0: _weights(chunks)}
    one_step(chunks, opt)
    full = save_checkpoint(out, 1, chunks, opt, None, {"step": 1})
    lean = save_checkpoint(out, 2, chunks, opt, None, {"step": 2}, save_optim=False)
    saved[1] = saved[2] = _weights(chunks)
    drift = {}
    for distributed in (True, False):
        for name, path, kwargs in (("finetune", full, {"finetune": True}),
                                   ("no_save_optim", lean, {}), ("fresh", fresh, {})):
            chunks, opt = build(2, distributed)              # other weights
            load_checkpoint(path, chunks, opt, None, **kwargs)
            one_step(chunks, opt)
            step = int(path.rsplit("-", 1)[1])
            drift[distributed, name] = (_weights(chunks) - saved[step]).abs().max().item()
            other = (_weights(build(2, distributed)[0]) - saved[step]).abs().max().item()
            drift[distributed, name + " (other weights)"] = other
    return drift


def test_bf16_loads_without_optimizer_state_train_from_the_loaded_weights(tmp_path):
    """In bf16 the optimizer keeps fp32 main copies of the weights it was built on. A load
    that restores no optimizer state (--finetune, a --no_save_optim checkpoint, one saved
    before the first step) must refresh them: the first step then moves the loaded weights
    by about lr, instead of writing the other weights back."""
    r, = run_distributed(_bf16_loads_run, 1, args=(str(tmp_path),), timeout=300)
    for distributed in (True, False):
        for name in ("finetune", "no_save_optim", "fresh"):
            other = r[distributed, name + " (other weights)"]
            assert other > 0.05, r                     # the weights built before the load
            assert r[distributed, name] < other / 20, (distributed, name, r)


def test_resume_refuses_another_dtype_with_the_flag_that_fixes_it():
    """A float32 run's checkpoint continued by a bf16 run (e.g. an unset --bf16 that now
    follows a bf16 --model) stops before loading, naming --bf16 and --finetune."""
    import torch

    from megatron_grpo.checkpoint import check_resume_dtype

    fp32, bf16 = [torch.nn.Linear(2, 2)], [torch.nn.Linear(2, 2).to(torch.bfloat16)]
    check_resume_dtype({"params_dtype": "float32"}, fp32, "ckpt")
    check_resume_dtype({"params_dtype": None}, bf16, "ckpt")          # older metadata: no check
    with pytest.raises(ValueError) as e:
        check_resume_dtype({"params_dtype": "float32"}, bf16, "ckpt")
    assert "ckpt was saved by a run training in float32" in str(e.value)
    assert "--bf16 false to resume it" in str(e.value) and "--finetune true" in str(e.value)
    with pytest.raises(ValueError, match="--bf16 true to resume it"):
        check_resume_dtype({"params_dtype": "bfloat16"}, fp32, "ckpt")
