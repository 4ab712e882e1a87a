"""Multi-turn end to end: `megatron rlhf` with the gym scheduler (number guessing) on 2
CPU processes, Megatron TP=2 or CP=2 with packed sequences, a colocated vLLM engine in
fp32, 2 steps and an evaluation on held-out prompts (multi-turn as well).

The random tiny model rarely guesses right, so almost every trajectory runs to
--max_turns with the environment's feedback between turns: the loop, the masks and
the trainer see real multi-turn trajectories. The trainer's log-probs (TP=2; CP=2) of the
model's tokens equal vLLM's: rollout_correction/log_ppl_diff_max|min (per trajectory,
the mean over its model tokens of rollout - trainer log-prob) stay within fp32 noise;
a mask shifted by one token, or tool tokens counted, would move them by ~1.
"""
import json
import os

import pytest

from tests.test_trainer_e2e import _argv, _metrics, _run, tiny  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("parallel", [dict(tensor_model_parallel_size=2),
                                      dict(context_parallel_size=2, padding_free="true")],
                         ids=["tp2", "cp2_packed"])
def test_gym_multi_turn(tiny, tmp_path, parallel):  # noqa: F811
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"game {i}"}],
                                        "env_config": {"seed": i, "high": 4}}) + "\n"
                            for i in range(8)))
    out = str(tmp_path / "run")
    argv = _argv(tiny, out, dataset=str(data), gym_env="guess_number", max_turns=3,
                 max_length=400, vllm_max_model_len=512, **parallel,
                 log_rollout_offpolicy_metrics="true", log_completions="true", bf16="false",
                 split_dataset_ratio=0.25, eval_steps=2)     # 2 held-out prompts, multi-turn too
    for flag in ("--reward_funcs", "--external_plugins"):   # the environment's reward only
        i = argv.index(flag)
        del argv[i:i + 2]
    r = _run(argv)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 1 <= row["num_turns"] <= 3 and "rewards/gym_reward/mean" in row
        assert row["completions/max_length"] <= 3 * 8          # model tokens only
        assert abs(row["rollout_correction/log_ppl_diff_max"]) < 1e-4, row
        assert abs(row["rollout_correction/log_ppl_diff_min"]) < 1e-4, row
    assert max(row["num_turns"] for row in rows) > 1
    with open(os.path.join(out, "completions.jsonl")) as f:
        done = [json.loads(line) for line in f]
    assert len(done) == 16
    assert "eval/reward" in rows[-1] and "eval/completions/mean_length" in rows[-1]
    with open(os.path.join(out, "eval_completions.jsonl")) as f:
        evals = [json.loads(line) for line in f]
    assert len(evals) == 8 and all(e["messages"][-1]["role"] == "assistant" for e in evals)
    multi = [d for d in done if d["num_turns"] > 1]
    assert multi, done[0]
    roles = [m["role"] for m in multi[0]["messages"]]
    assert roles[:3] == ["system", "user", "assistant"] and roles.count("assistant") == \
        multi[0]["num_turns"] and roles[3] == "user"


def test_multi_turn_learns_digits(tiny, tmp_path):  # noqa: F811
    """A learning bar through the multi-turn path (the quickstart's recipe, DP=2): every
    trajectory is 2 turns of the guessing game (the tiny model never writes a valid
    guess, so the environment always answers), and the `digits` reward of the last model
    message climbs. The environment's tokens are masked, so only the model's turns learn."""
    out = str(tmp_path / "run")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["--config", os.path.join(root, "configs", "quickstart_cpu.yaml"), "--model", tiny,
            "--output_dir", out, "--gym_env", "guess_number", "--max_turns", "2",
            "--max_length", "400", "--vllm_max_model_len", "512",
            "--max_completion_length", "16", "--reward_weights", "1", "0",
            "--train_iters", "14", "--report_to", "none", "--save_steps", "1000",
            "--log_completions", "false"]
    r = _run(argv)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert all(row["num_turns"] > 1.9 for row in rows)        # (a lucky right guess ends one)
    first = sum(row["reward"] for row in rows[:4]) / 4
    last = sum(row["reward"] for row in rows[-4:]) / 4
    assert last >= first + 0.5, [round(row["reward"], 3) for row in rows]
