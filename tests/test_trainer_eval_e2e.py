"""End to end: `megatron rlhf` with evaluation on held-out prompts (2 CPU processes, a tiny
Qwen2, real vLLM). What a user looks at: the eval/* keys of metrics.jsonl at the steps
ms-swift evaluates, and eval_completions.jsonl, whose completions the reward function
re-scores to the logged eval reward. Server mode (TP=2, --val_dataset, --eval_iters) runs in
tests/test_example_ms_swift.py, on the example server script's run, with these checks."""
import json
import math
import os

import pytest

from tests.test_trainer_e2e import ROOT, _argv, _check_metrics, _metrics, _run, tiny  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ARITHMETIC = os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl")
EVAL_KEYS = ["eval/reward", "eval/reward_std", "eval/frac_reward_zero_std",
             "eval/rewards/digits/mean", "eval/rewards/digits/std", "eval/completions/mean_length",
             "eval/completions/min_length", "eval/completions/max_length",
             "eval/completions/clipped_ratio", "timing/eval"]


def _digits(text):        # examples/plugins/digits_reward.py, written out again
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_eval(out, eval_steps, prompts_per_eval, generations):
    """eval/* at exactly `eval_steps`, finite, and equal to the re-scored logged completions."""
    rows = {r["step"]: r for r in _metrics(out)}
    for step, r in rows.items():
        if step not in eval_steps:
            assert not any(k.startswith("eval/") for k in r), f"eval/* at step {step}"
            continue
        for k in EVAL_KEYS:
            assert r.get(k) is not None and math.isfinite(r[k]), f"step {step}: {k}={r.get(k)}"
    completions = _rows(os.path.join(out, "eval_completions.jsonl"))
    assert sorted({c["step"] for c in completions}) == sorted(eval_steps)
    for step in eval_steps:
        mine = [c for c in completions if c["step"] == step]
        assert len(mine) == prompts_per_eval * generations
        scores = [_digits(c["completion"]) for c in mine]
        for c, s in zip(mine, scores):
            assert c["digits"] == pytest.approx(s, abs=1e-6)     # float32 in the table
        mean = sum(scores) / len(scores)
        assert rows[step]["eval/reward"] == pytest.approx(mean, abs=1e-6)
        assert rows[step]["eval/rewards/digits/mean"] == pytest.approx(mean, abs=1e-6)
    return rows, completions


def test_colocate_split_eval_every_step_with_sleep_and_offload(tiny, tmp_path):
    """--split_dataset_ratio on DP=2 with vLLM asleep (level 1) and Megatron offloaded around
    generation, two optimizer steps per rollout: step 1 evaluates between the two steps of
    a rollout (vLLM synced for it, then put back to sleep), step 2 right after the rollout's
    sync (vLLM stays awake for the next generation), step 3 is the last."""
    from megatron_grpo.data import load_prompt_dataset, split_validation

    out = str(tmp_path / "run")
    r = _run(_argv(tiny, out, split_dataset_ratio=0.05, eval_steps=1, num_generations_eval=2,
                   generation_batch_size=16, train_iters=3, sleep_level=1, offload_model="true",
                   offload_optimizer="true", check_weight_sync="true", log_completions="true"))
    assert r.returncode == 0, r.stderr[-4000:]
    held = split_validation(load_prompt_dataset([ARITHMETIC], seed=7), 0.05, seed=7)[1]
    assert len(held) == 10                  # 5% of 200 prompts
    assert "eval at step 3: 10 prompts x 2" in r.stdout
    _check_metrics(_metrics(out), 3, steps_per_generation=2)
    _, completions = _check_eval(out, [1, 2, 3], len(held), 2)
    # Each evaluation takes the whole held-out set; training never sees one of its prompts.
    for step in (1, 2, 3):
        assert sorted({c["prompt_index"] for c in completions if c["step"] == step}) == \
            list(range(len(held)))
    held_texts = [m[-1]["content"] for m in held.messages]
    for c in completions:
        assert held_texts[c["prompt_index"]] in c["prompt"]
        assert c["solution"] == held.columns["solution"][c["prompt_index"]]
    trained = _rows(os.path.join(out, "completions.jsonl"))
    assert trained and not any(q in t["prompt"] for t in trained for q in held_texts)
