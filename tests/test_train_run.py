"""train/run.py: which checkpoint a run starts from, for each validated --resume."""
import json

import pytest

from megatron_grpo.checkpoint import META_FILE
from megatron_grpo.config import ConfigError, parse_rlhf_args
from megatron_grpo.train.run import resume_path
from tests.test_config_parse import base


def test_resume_false_starts_a_new_run_beside_checkpoints(tmp_path):
    out = tmp_path / "out"
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / META_FILE).write_text("{}")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))

    def start(*flags):
        cfg = parse_rlhf_args(base(str(model), "--output_dir", str(out), *flags))
        return resume_path(cfg.logging.resume, cfg.logging.output_dir)

    newest = str(out / "checkpoint-4")
    assert start() == newest                       # a rerun continues (README)
    assert start("--resume", "true") == newest
    assert start("--resume", "auto") == newest
    assert start("--resume", str(out / "checkpoint-2")) == str(out / "checkpoint-2")
    assert start("--resume", "false") is None
    assert start("--resume", "false", "--finetune", "true") is None
    for word in ("none", "None", "null"):     # the word, not the None of an unset option
        assert start("--resume", word) is None
    assert resume_path(None, str(tmp_path / "nothing-yet")) is None
    # An earlier run's output_dir: its newest checkpoint (as --resume auto does there).
    other = tmp_path / "elsewhere"
    assert start("--resume", str(out), "--output_dir", str(other)) == newest
    # A folder without any checkpoint fails at the option checks, before any start-up.
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        start("--resume", str(model))


def test_a_resumed_run_keeps_the_generators_its_checkpoint_restored(monkeypatch):
    """Building the sampler leaves the generators as the checkpoint restored them; a
    colocated vLLM engine seeds them (test_rollout_colocate.py checks that it does), which
    a stand-in builder does here."""
    import random

    import numpy as np
    import torch

    from megatron_grpo.train import run

    def reseeding_builder(cfg):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        return "engine"

    monkeypatch.setattr(run, "build_sampler", reseeding_builder)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    assert run.build_sampler_keeping_generators(None) == "engine"
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_batch_saved_mid_way_is_trained_on_only_with_the_same_teacher(monkeypatch, capsys):
    """A checkpoint saved in the middle of a generation batch holds that batch; a resume
    trains its rest only in the saving layout and with a teacher where the batch had one
    (its samples carry the teacher's log-probs, which the loss would use), else it says why
    and starts a new rollout."""
    import types

    from megatron_grpo.train import run

    monkeypatch.setattr(run, "_layout", lambda: {"world": 2})
    monkeypatch.setattr(run, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    saved = {"rollout": "batch", "next": 1, "layout": {"world": 2}}
    assert run._pending_batch(saved, "ckpt") == ("batch", 1)
    assert run._pending_batch(dict(saved, teacher="T"), "ckpt", True) == ("batch", 1)
    assert run._pending_batch(dict(saved, teacher="T"), "ckpt") is None
    assert "ckpt was saved in the middle of a generation batch with a teacher, and this run " \
           "has none" in capsys.readouterr().err
    assert run._pending_batch(saved, "ckpt", True) is None
    assert "without a teacher, and this run has one" in capsys.readouterr().err
    assert run._pending_batch(dict(saved, layout={"world": 4}), "ckpt") is None
    assert "by another layout ({'world': 4}, now {'world': 2})" in capsys.readouterr().err
