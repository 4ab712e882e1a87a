"""Evaluation: the validation split, which prompts each evaluation takes, its metrics,
and the configuration checks of --eval_steps / --split_dataset_ratio / --val_dataset."""
import json
import logging
import math
import os

import pytest
import torch

from megatron_grpo.config import parse_rlhf_args
from megatron_grpo.data import load_datasets, load_prompt_dataset, split_validation
from megatron_grpo.data.split import prompt_key
from megatron_grpo.train.batch import Sample
from megatron_grpo.train.evaluate import evaluation_metrics, evaluation_prompts, should_evaluate
from megatron_grpo.train.rollout_step import GenerationBatch

from tests.test_config_validate import COUNTDOWN, ROOT, args, error_of, model_dir  # noqa: F401

ARITHMETIC = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "arithmetic.jsonl")


def _keys(ds):
    return [prompt_key(m) for m in ds.messages]


# ---------------------------------------------------------------- the split
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.25, 0.5])
def test_split_sizes_disjoint_and_complete(ratio):
    ds = load_prompt_dataset([ARITHMETIC], seed=1)
    n = len(set(_keys(ds)))
    train, val = split_validation(ds, ratio, seed=3)
    k = max(int(n * ratio), 1)                 # ms-swift: at least one held out
    assert len(val) == k and len(set(_keys(val))) == k
    assert not set(_keys(train)) & set(_keys(val))
    assert len(train) + len(val) == len(ds)
    # Rows keep their columns: every validation row is the dataset row with that prompt.
    rows = {prompt_key(m): ds.columns["solution"][i] for i, m in enumerate(ds.messages)}
    assert [rows[key] for key in _keys(val)] == val.columns["solution"]


def test_split_is_deterministic_with_the_seed():
    ds = load_prompt_dataset([ARITHMETIC], seed=1)
    a = split_validation(ds, 0.1, seed=5)[1]
    b = split_validation(ds, 0.1, seed=5)[1]
    c = split_validation(ds, 0.1, seed=6)[1]
    assert _keys(a) == _keys(b)
    assert _keys(a) != _keys(c)


def test_split_without_shuffle_holds_out_the_last_prompts():
    ds = load_prompt_dataset([ARITHMETIC], seed=1)
    train, val = split_validation(ds, 0.1, seed=5, shuffle=False)
    assert _keys(val) == _keys(ds)[-len(val):]
    assert _keys(train) == _keys(ds)[:len(train)]


def test_split_with_repeated_rows_keeps_every_copy_on_one_side(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"query": f"q{i}", "solution": str(i)}) + "\n"
                            for i in range(10)))
    ds = load_prompt_dataset([f"{path}#35"], seed=0)     # 3 full copies + 5 drawn rows
    assert len(ds) == 35
    train, val = split_validation(ds, 0.2, seed=0)
    assert len(val) == 2                              # 20% of 10 distinct prompts, once each
    assert not set(_keys(train)) & set(_keys(val))
    held = set(_keys(val))
    assert len(train) == sum(1 for key in _keys(ds) if key not in held)


def test_split_ratio_zero_and_too_large():
    ds = load_prompt_dataset([ARITHMETIC], seed=1)
    train, val = split_validation(ds, 0.0, seed=1)
    assert train is ds and val is None
    train, val = split_validation(ds.subset([0, 1]), 0.5, seed=1)
    assert (len(train), len(val)) == (1, 1)
    with pytest.raises(ValueError, match=r"--split_dataset_ratio 0\.5 holds out 1 of the 1 "
                                         "distinct prompts of --dataset, leaving none"):
        split_validation(ds.subset([0, 0]), 0.5, seed=1)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        split_validation(ds, 1.0, seed=1)


def test_load_datasets_val_dataset_read_like_dataset(tmp_path, model_dir):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"question": f"v{i}", "answer": str(i)}) + "\n"
                           for i in range(6)))
    cfg = parse_rlhf_args(args(model_dir, "--val_dataset", str(val), "--columns",
                               '{"question": "query", "answer": "solution"}',
                               "--system", "be brief"))
    train, v = load_datasets(cfg.data, cfg.evaluation, seed=cfg.training.seed)
    assert len(train) == len(load_prompt_dataset([COUNTDOWN]))          # no split
    assert [m[-1]["content"] for m in v.messages] == [f"v{i}" for i in range(6)]
    assert v.messages[0][0] == {"role": "system", "content": "be brief"}
    assert v.columns["solution"] == [str(i) for i in range(6)]
    cfg.evaluation.val_dataset_shuffle = True
    _, shuffled = load_datasets(cfg.data, cfg.evaluation, seed=cfg.training.seed)
    assert sorted(_keys(shuffled)) == sorted(_keys(v)) and _keys(shuffled) != _keys(v)
    # Errors name --val_dataset, not --dataset.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt column"}) + "\n")
    cfg.evaluation.val_dataset = [str(bad)]
    with pytest.raises(ValueError, match=r"^--val_dataset .*bad\.jsonl.*no prompt column"):
        load_datasets(cfg.data, cfg.evaluation, seed=1)


# ---------------------------------------------------------------- when and which prompts
def test_should_evaluate_every_eval_steps_and_after_the_last():
    assert [s for s in range(1, 8) if should_evaluate(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 7) if should_evaluate(s, 3, 6)] == [3, 6]


def test_evaluation_prompts_whole_set_or_cyclic_windows():
    assert evaluation_prompts(5, 4, eval_steps=2, eval_iters=-1, prompts_per_iter=2) == \
        [0, 1, 2, 3, 4]
    # eval_iters 1 x 2 prompts: evaluations at steps 2, 4, 6 and the last step 7 continue
    # through the 5 prompts: [0 1] [2 3] [4 0] [1 2].
    got = [evaluation_prompts(5, s, eval_steps=2, eval_iters=1, prompts_per_iter=2)
           for s in (2, 4, 6, 7)]
    assert got == [[0, 1], [2, 3], [4, 0], [1, 2]]


# ---------------------------------------------------------------- metrics
def _batch(rewards, lengths, truncated):
    samples = [Sample(prompt_ids=[1], completion_ids=[5] * n, truncated=t)
               for n, t in zip(lengths, truncated)]
    return GenerationBatch(samples, ["x"] * len(samples), ["p"] * len(samples),
                           torch.tensor(rewards, dtype=torch.float32))


def test_evaluation_metrics_against_float64_by_hand():
    rewards = [[1.0, 0.5], [0.0, 0.5], [1.0, float("nan")], [1.0, 0.0], [0.0, 1.0], [0.0, 0.25]]
    batch = _batch(rewards, [3, 5, 8, 2, 8, 4], [False, False, True, False, True, False])
    m = evaluation_metrics(batch, 3, ["acc", "fmt"], reward_weights=[1.0, 2.0])
    total = [r[0] + (0.0 if math.isnan(r[1]) else 2 * r[1]) for r in rewards]   # NaN: no reward
    groups = [total[:3], total[3:]]

    def std(xs):
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))

    assert m["eval/reward"] == pytest.approx(sum(total) / 6, abs=1e-12)
    assert m["eval/reward_std"] == pytest.approx((std(groups[0]) + std(groups[1])) / 2, abs=1e-12)
    assert m["eval/frac_reward_zero_std"] == 0.0
    assert m["eval/rewards/acc/mean"] == pytest.approx(0.5)
    assert m["eval/rewards/acc/std"] == pytest.approx(std([1, 0, 1, 1, 0, 0]))
    assert m["eval/rewards/fmt/mean"] == pytest.approx((0.5 + 0.5 + 0 + 1 + 0.25) / 5)
    assert m["eval/completions/mean_length"] == pytest.approx(30 / 6)
    assert (m["eval/completions/min_length"], m["eval/completions/max_length"]) == (2, 8)
    assert m["eval/completions/clipped_ratio"] == pytest.approx(2 / 6)
    # Multi-turn: the lengths count the model's tokens (loss mask 1), as training's
    # completions/* do, not the tool's answers in between.
    for s, mask in zip(batch.samples, ([1, 0, 1], [1] * 5, [1, 1, 0, 0, 0, 0, 1, 1])):
        s.loss_mask = mask
    m = evaluation_metrics(batch, 3, ["acc", "fmt"], reward_weights=[1.0, 2.0])
    assert m["eval/completions/mean_length"] == pytest.approx((2 + 5 + 4 + 2 + 8 + 4) / 6)
    assert m["eval/completions/min_length"] == 2


# ---------------------------------------------------------------- configuration
def test_eval_options_resolve_as_ms_swift(model_dir):
    cfg = parse_rlhf_args(args(model_dir, "--split_dataset_ratio", "0.1", "--save_steps", "7"))
    e = cfg.evaluation
    assert (e.eval_steps, e.eval_iters, e.num_generations_eval) == (7, -1, cfg.grpo.num_generations)
    cfg = parse_rlhf_args(args(model_dir, "--eval_interval", "3", "--val_dataset", COUNTDOWN,
                               "--num_generations_eval", "2", "--eval_iters", "2"))
    assert (cfg.evaluation.eval_steps, cfg.evaluation.num_generations_eval) == (3, 2)


def test_eval_steps_without_validation_set_warns_and_runs(model_dir, caplog):
    # ms-swift's own example scripts pass --eval_steps without a validation set.
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir, "--eval_steps", "1000"))
    assert cfg.evaluation.eval_steps == 1000
    assert "--eval_steps 1000: no validation set, so nothing is evaluated" in caplog.text
    assert "--val_dataset FILE or --split_dataset_ratio" in caplog.text


def test_val_dataset_replaces_the_split(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir, "--val_dataset", COUNTDOWN,
                                   "--split_dataset_ratio", "0.1"))
    assert cfg.evaluation.split_dataset_ratio == 0.0
    assert "--split_dataset_ratio 0.1 has no effect with --val_dataset" in caplog.text


def test_eval_problems_collected_in_one_message(model_dir, tmp_path):
    message = error_of(args(model_dir, "--split_dataset_ratio", "1.0", "--eval_steps", "0",
                            "--eval_iters", "-2", "--num_generations_eval", "0", "--epsilon", "2"))
    assert message.startswith("5 problems")
    assert "--split_dataset_ratio 1.0 is not valid: it must be in [0, 1)" in message
    assert "--eval_steps 0 is not valid: it must be >= 1" in message
    assert "--eval_iters -2 is not valid" in message
    assert "--num_generations_eval 0 is not valid" in message
    assert "--epsilon 2.0 must be in (0, 1)" in message


@pytest.mark.parametrize("extra, expected", [
    (["--split_dataset_ratio", "-0.1"], "--split_dataset_ratio -0.1 is not valid"),
    (["--val_dataset", "missing.jsonl"], "--val_dataset 'missing.jsonl': file 'missing.jsonl' "
                                         "not found"),
    (["--val_dataset", "org/name"], "--val_dataset 'org/name': no such local file, and "
                                    "megatron-grpo does not download datasets"),
    (["--val_dataset", f"{COUNTDOWN}#x"], "--val_dataset"),
    (["--val_dataset", COUNTDOWN, "--eval_iters", "1", "--num_generations_eval", "32"],
     "--num_generations_eval 32 is larger than --global_batch_size 16"),
])
def test_eval_problem_lines(model_dir, extra, expected):
    assert expected in error_of(args(model_dir, *extra))

