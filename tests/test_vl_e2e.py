"""Vision-language GRPO end to end (issue 18): `megatron rlhf` on 2 CPU processes (TP=2)
with a colocated vLLM engine, on the tiny Qwen2.5-VL of tools/make_tiny_vl_model.py and
the red-square counting task of tools/make_vl_count_data.py, in fp32.

What must hold for the trainer to train on what vLLM sampled from:
- the images reach the trainer: each completion's prompt (completions.jsonl
  `image_tokens`, counted in the trainer's prompt ids) has as many image tokens as the
  model's processor makes at the run's pixel budget (--max_pixels below the model's own,
  so a budget that missed the trainer's processor or vLLM's changes the count; vLLM's
  expansion is also checked against the processor's inside the run);
- the trainer's log-probs of the sampled tokens equal vLLM's (rollout_correction/* in
  fp32 noise): the image rows and the mrope positions of the old-log-prob forward are
  vLLM's. Without the images the tiny model's logits move by ~4, without mrope by ~1.6
  (tests/test_vl_tiny_model.py), far outside 1e-4;
- step 2 samples from the weights step 1 changed (its KL to the reference is not 0) and
  still agrees with the trainer: the sync carries the language model, and the frozen
  vision tower (--freeze_vit and --freeze_aligner default true) that vLLM loaded from the
  checkpoint is the trainer's.
The evaluation on the held-out prompts goes through the same image path. 6 training
prompts, 2 per step: step 4 samples images vLLM has seen before the weights changed (its
encoder cache must be reset with them: rollout/colocate.py reset_prefix_cache).
"""
import json
import os

import pytest

from tests.test_trainer_e2e import ROOT, _argv, _metrics, _run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET = 28 * 28 * 6      # 4 image tokens per count image; the model's own budget gives 12


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from tools.make_tiny_vl_model import make_tiny_vl_model

    return str(make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl"))


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    from tools.make_vl_count_data import main

    return main(["--out_dir", str(tmp_path_factory.mktemp("count")), "--n", "8",
                 "--distractors"])


def test_vl_grpo_tp2_colocate(vl_model, count_data, tmp_path):
    out = str(tmp_path / "run")
    # digits (a dense reward the random model can climb) varies within groups, so step 1
    # has a gradient; accuracy is the task's reward.
    r = _run(_argv(vl_model, out, dataset=count_data, reward_funcs=["accuracy", "digits"],
                   tensor_model_parallel_size=2, bf16="false", beta=0.04, lr=1e-2,
                   max_pixels=BUDGET, vllm_max_model_len=256, log_completions="true",
                   log_rollout_offpolicy_metrics="true", split_dataset_ratio=0.25,
                   eval_steps=2, train_iters=4))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        for key in ("kl", "log_ppl_diff_max", "log_ppl_diff_min"):
            assert abs(row["rollout_correction/" + key]) < 1e-4, row
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] != 0.0, rows
    assert "eval/reward" in rows[-1] and "rewards/accuracy/mean" in rows[-1]

    from megatron_grpo.data import load_prompt_dataset
    from megatron_grpo.data.vision import VisionProcessor

    ds = load_prompt_dataset([count_data])
    base = os.path.dirname(count_data)
    budget, own = VisionProcessor(vl_model, BUDGET), VisionProcessor(vl_model)

    def image_tokens(vp):     # per row of the dataset (all its images are 112x84)
        return {vp.encode(ds.messages[i], ds.images[i], base).prompt_ids.count(vp.image_token_id)
                for i in range(len(ds))}

    want = image_tokens(budget)
    assert len(want) == 1 and want != image_tokens(own), (want, image_tokens(own))
    with open(os.path.join(out, "completions.jsonl")) as f:
        done = [json.loads(line) for line in f]
    assert len(done) == 32 and {d["image_tokens"] for d in done} == want, done[0]
