"""Multi-turn end to end: `megatron rlhf` on 2 CPU processes with a colocated vLLM engine.

test_gym_multi_turn: the gym scheduler (number guessing), Megatron TP=2 or CP=2 with
packed sequences, vLLM in fp32, a reference model (beta > 0), 4 steps from 2 generation
batches of 2 optimizer steps each (old log-probs; the second generation samples from
synced weights) and an evaluation on held-out prompts (multi-turn as well). The random tiny model rarely guesses right, so almost every trajectory runs to
--max_turns with the environment's feedback between turns: the loop, the masks and the
trainer see real multi-turn trajectories. The trainer's log-probs (TP=2; CP=2) of the
model's tokens equal vLLM's: rollout_correction/log_ppl_diff_max|min (per trajectory, the
mean over its model tokens of rollout - trainer log-prob) stay within fp32 noise; a mask
shifted by one token, or tool tokens counted, would move them by ~1. The [cp2_packed]
run is also the suite's `--padding_free true` end-to-end run (it was
tests/test_train_packing.py's own CLI run before): every forward (old, reference,
training) runs packed in 2*cp chunks, every logged metric is finite, and the KL is 0 at
step 1 (policy == reference) and not after. The [tp2_last_round] run trains the last model message of each trajectory
only (--loss_scale last_round). Both runs have a teacher (--teacher_model: a
frozen copy of the start): teacher_kl is 0 on the first generation's two steps and not on
the second's, and the evaluation logs eval/teacher_kl.

test_calculator_learns_to_call_the_tool, test_guess_number_learns_to_guess: each
built-in example learns something measurable on a tiny model in a few dozen steps (the
quickstart's recipe). The model's markers (<tool_call>, <guess>) are single tokens of its
vocabulary, as Qwen2.5's <tool_call> is, so that a random policy writes them sometimes;
the example reward plugins shape toward a whole call / guess.
"""
import json
import math
import os

import pytest

from tests.test_trainer_e2e import (ROOT, METRIC_KEYS, _argv, _metrics, _run,  # noqa: F401
                                    tiny)                                     # (fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("parallel", [dict(tensor_model_parallel_size=2, loss_scale="last_round"),
                                      dict(context_parallel_size=2, padding_free="true")],
                         ids=["tp2_last_round", "cp2_packed"])
def test_gym_multi_turn(tiny, tmp_path, parallel):  # noqa: F811
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"game {i}"}],
                                        "env_config": {"seed": i, "high": 4}}) + "\n"
                            for i in range(8)))
    out = str(tmp_path / "run")
    # Each generation of 16 trajectories (4 prompts x 4) feeds 2 optimizer steps of 8.
    argv = _argv(tiny, out, dataset=str(data), gym_env="guess_number", max_turns=3,
                 max_length=400, vllm_max_model_len=512, **parallel,
                 log_rollout_offpolicy_metrics="true", log_completions="true", bf16="false",
                 beta=0.04, generation_batch_size=16, global_batch_size=8, train_iters=4,
                 split_dataset_ratio=0.25, eval_steps=4,     # 2 held-out prompts, multi-turn too
                 teacher_model=tiny)                         # a frozen copy of the start
    for flag in ("--reward_funcs", "--external_plugins"):   # the environment's reward only
        i = argv.index(flag)
        del argv[i:i + 2]
    r = _run(argv)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # Every metric a user reads, finite; timing/generate and timing/score come with the
    # steps that generated (1, 3), timing/sync (weights to vLLM) with steps 2 and 4.
    once = {"timing/generate": (0, 2), "timing/score": (0, 2), "timing/sync": (1, 3)}
    for k, steps in once.items():
        for i in steps:
            assert k in rows[i], f"step {i + 1}: metrics.jsonl lacks {k}"
    keys = [k for k in METRIC_KEYS if k not in once and not k.startswith("rewards/digits")]
    for row in rows:
        for k in keys + ["kl", "rollout_correction/log_ppl_abs_diff"]:
            assert k in row, f"step {row['step']}: metrics.jsonl lacks {k}"
        for k, v in row.items():
            assert v is not None and math.isfinite(v), f"step {row['step']}: {k}={v}"
        assert row["rollout_correction/log_ppl_abs_diff"] < 1e-4, row
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)     # policy == reference at step 1
    assert all(row["kl"] > 0 for row in rows[1:]), [row["kl"] for row in rows]
    # The teacher (the start) scored the first generation's trajectories as the policy that
    # sampled them (old log-probs, model tokens only), the second's not; and the held-out ones.
    kl = [row["teacher_kl"] for row in rows]
    assert kl[:2] == [pytest.approx(0.0, abs=1e-9)] * 2 and min(kl[2:]) > 0, kl
    assert rows[-1]["eval/teacher_kl"] > 0, rows[-1]
    for row in rows:
        assert 1 <= row["num_turns"] <= 3 and "rewards/gym_reward/mean" in row
        assert row["completions/max_length"] <= 3 * 8          # model tokens only
        assert abs(row["rollout_correction/log_ppl_diff_max"]) < 1e-4, row
        assert abs(row["rollout_correction/log_ppl_diff_min"]) < 1e-4, row
    assert max(row["num_turns"] for row in rows) > 1
    with open(os.path.join(out, "completions.jsonl")) as f:
        done = [json.loads(line) for line in f]
    assert len(done) == 32
    assert "eval/reward" in rows[-1] and "eval/completions/mean_length" in rows[-1]
    with open(os.path.join(out, "eval_completions.jsonl")) as f:
        evals = [json.loads(line) for line in f]
    assert len(evals) == 8 and all(e["messages"][-1]["role"] == "assistant" for e in evals)
    multi = [d for d in done if d["num_turns"] > 1]
    assert multi, done[0]
    roles = [m["role"] for m in multi[0]["messages"]]
    assert roles[:3] == ["system", "user", "assistant"] and roles.count("assistant") == \
        multi[0]["num_turns"] and roles[3] == "user"


def _marker_model(tmp_path_factory, markers):
    """The tiny Qwen2 with each of `markers` one token, as `<tool_call>` is in Qwen2.5's
    vocabulary, and 400 tokens in all: its random policy writes each marker in a few
    percent of its turns (spelt out in ~5 tokens, a marker would almost never occur)."""
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("markers") / "qwen2", family="qwen2",
                               hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=256, vocab_size=400, added_tokens=markers))


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return _marker_model(tmp_path_factory, ("<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def guess_model(tmp_path_factory):
    return _marker_model(tmp_path_factory, ("<guess>", "</guess>"))


def _learning_argv(model, out, *extra, steps):
    """The quickstart's recipe (DP=2, 8 samples of 4 prompts a step, lr 3e-3) in float32
    (the thresholds below were set on float32 runs; the quickstart itself runs in bf16,
    whose samples differ from the same seed's), 2 turns of up to 16 tokens, every
    step's trajectories in completions.jsonl."""
    return ["--config", os.path.join(ROOT, "configs", "quickstart_cpu.yaml"), "--model", model,
            "--output_dir", out, "--bf16", "false", "--max_turns", "2", "--max_length", "400",
            "--vllm_max_model_len", "512", "--max_completion_length", "16",
            "--train_iters", str(steps), "--report_to", "none", "--save_steps", "1000",
            "--log_completions", "true", *extra]


def _completions(out):
    with open(os.path.join(out, "completions.jsonl")) as f:
        return [json.loads(line) for line in f]


def _rate_per_step(rows, hit):
    """Fraction of trajectories with hit(messages), per step of completions.jsonl."""
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(bool(hit(row["messages"])))
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


def test_calculator_learns_to_call_the_tool(tool_model, tmp_path):
    """The built-in tool-calling example learns (the quickstart's recipe, DP=2, 30 steps):
    the `calculator` scheduler on the arithmetic prompts with --max_turns 2, rewarded by
    examples/plugins/tool_call_reward.py (1 when the tool ran and answered a number, 0.75
    when it answered an error, 0.25 per marker otherwise). The rate of trajectories in
    which the calculator ran (a well-formed call, then the turn's stop token) starts near
    0 and rises past 0.6; each tool message holds the calculator's answer to the model's
    calls."""
    from megatron_grpo.multi_turn.builtin import TOOL_CALL, calculate

    out = str(tmp_path / "run")
    r = _run(_learning_argv(
        tool_model, out, "--multi_turn_scheduler", "calculator",
        "--system", "Use the calculator: write <tool_call>EXPRESSION</tool_call> and wait for "
                    "its result. Give the final answer as a number.",
        "--reward_funcs", "tool_call_format",
        "--external_plugins", os.path.join(ROOT, "examples/plugins/tool_call_reward.py"), steps=30))
    assert r.returncode == 0, r.stderr[-4000:]
    rows, done = _metrics(out), _completions(out)
    rate = _rate_per_step(done, lambda messages: any(m["role"] == "tool" for m in messages))
    assert len(rate) == len(rows) == 30
    # --max_turns 2: a second turn happens exactly when the tool ran
    assert [round(row["num_turns"] - 1, 4) for row in rows] == [round(x, 4) for x in rate]
    first, last = sum(rate[:4]) / 4, sum(rate[-4:]) / 4
    assert first <= 0.1 and last >= first + 0.6, [round(x, 2) for x in rate]
    calls = [d for d in done if any(m["role"] == "tool" for m in d["messages"])]
    for d in calls:
        said, tool = d["messages"][2], d["messages"][3]
        assert said["role"] == "assistant" and tool["role"] == "tool", d["messages"]
        assert tool["content"] == "\n".join(calculate(c) for c in TOOL_CALL.findall(said["content"]))


def test_guess_number_learns_to_guess(guess_model, tmp_path):
    """The built-in gym example learns (same recipe, 36 steps): `--gym_env guess_number`
    (secrets in 1..4) rewarded by examples/plugins/guess_reward.py (1 for a guess the
    environment reads, 0.25 per marker otherwise) beside the environment's own gym_reward
    (1 for the right number). The rate of trajectories with a valid <guess>N</guess> starts
    near 0 and rises past 0.6, and games start being won (gym_reward above 0). The
    environment's tokens are masked: only the model's turns learn."""
    from megatron_grpo.multi_turn.builtin import GUESS

    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"game {i}"}],
                                        "env_config": {"seed": i, "high": 4}}) + "\n"
                            for i in range(64)))
    out = str(tmp_path / "run")
    r = _run(_learning_argv(
        guess_model, out, "--dataset", str(data), "--gym_env", "guess_number",
        "--reward_funcs", "guess_format",
        "--external_plugins", os.path.join(ROOT, "examples/plugins/guess_reward.py"), steps=36))
    assert r.returncode == 0, r.stderr[-4000:]
    rows, done = _metrics(out), _completions(out)
    rate = _rate_per_step(done, lambda messages: any(
        m["role"] == "assistant" and GUESS.search(m["content"]) for m in messages))
    assert len(rate) == len(rows) == 36
    first, last = sum(rate[:4]) / 4, sum(rate[-4:]) / 4
    assert first <= 0.1 and last >= first + 0.6, [round(x, 2) for x in rate]
    won = [row["rewards/gym_reward/mean"] for row in rows]
    assert sum(won[:4]) == 0 and sum(won[-8:]) > 0, won
