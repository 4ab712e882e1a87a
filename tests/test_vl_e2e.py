"""Vision-language GRPO end to end: `megatron rlhf` on 2 CPU processes (TP=2)
with a colocated vLLM engine, on the tiny Qwen2.5-VL of tools/make_tiny_vl_model.py and
the square-colour task of tools/make_vl_colour_data.py, in fp32. One run, 40 steps.

What must hold for the trainer to train on what vLLM sampled from:
- the images reach the trainer: each completion's prompt (completions.jsonl
  `image_tokens`, counted in the trainer's prompt ids) has as many image tokens as the
  model's processor makes at the run's pixel budget (--max_pixels below the model's own,
  so a budget that missed the trainer's processor or vLLM's changes the count; vLLM's
  expansion is also checked against the processor's inside the run);
- the trainer's log-probs of the sampled tokens equal vLLM's at every step
  (rollout_correction/* in fp32 noise): the image rows and the mrope positions of the
  old-log-prob forward are vLLM's. Without the images the tiny model's logits move by
  ~4, without mrope by ~1.6 (tests/test_vl_tiny_model.py), far outside 1e-4;
- step 2 samples from the weights step 1 changed (its KL to the reference is not 0) and
  still agrees with the trainer: the sync carries the language model and the vision
  tower with its merger (--freeze_vit false --freeze_aligner false: streamed, so vLLM's
  encoder cache must be reset with them: rollout/colocate.py reset_prefix_cache; images
  repeat from step 9 on).

And the run learns from the images (the issue's bar): the answer (1 red, 2 green) is the
colour of the one large square. Each step's 8 prompts hold 4 of each colour (rows
interleaved, --dataset_shuffle false), so a policy that ignores the image is right on
half of them: accuracy 0.5 is the best an image-blind policy can reach, and the warm
start (uniform over "1"/"2", whatever the image) starts there. The run must reach >= 0.8
over the last 10 steps and on the 8 held-out images at step 40 (seen: 0.50 over steps
1-5, 0.975 over steps 31-40, 0.92 held out at step 40; with --seed 8: 0.91 and 0.92).
With blank images instead (make_vl_colour_data.py --blank, run by hand) the same recipe
stays at 0.50 (held out 0.50): it is the image path that carries the answer. The
evaluation on the held-out prompts goes through the same image path.
"""
import json
import os

import pytest

from tests.test_trainer_e2e import ROOT, _argv, _metrics, _run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET = 28 * 28 * 6      # 4 image tokens per 112x84 image; the model's own budget gives 12
STEPS, BAR = 40, 0.8


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from tools.make_tiny_vl_model import make_tiny_vl_model

    return str(make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl"))


@pytest.fixture(scope="module")
def colour_data(vl_model, tmp_path_factory):
    """64 training rows, 8 held out, and the warm-started model (OUT/model)."""
    from tools.make_vl_colour_data import main

    return main(["--out_dir", str(tmp_path_factory.mktemp("colour")), "--n", "64",
                 "--n_val", "8", "--model", vl_model, "--max_pixels", str(BUDGET)])


def test_warm_start_knows_the_answers_not_which_is_right(colour_data):
    """The warm-started model's first token, by HF transformers: the two answers take
    almost all the mass, about half each, on red and green images alike (the mean over
    the training images of p("1") for red ones and for green ones differ by < 0.1), so
    its accuracy is the image-blind 0.5 and only the GRPO run can teach the mapping.
    Seen: p("1") = 0.556 on each of the 16 images (to 1e-4), p("1") + p("2") = 1.000;
    the random model before the warm start: 0.0009."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_grpo.data import load_prompt_dataset
    from megatron_grpo.data.vision import VisionProcessor

    ds = load_prompt_dataset([colour_data["train"]])
    base = os.path.dirname(colour_data["train"])
    vp = VisionProcessor(colour_data["model"], BUDGET)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(colour_data["model"],
                                                               dtype=torch.float32).eval()
    answers = [vp.tokenizer.convert_tokens_to_ids(a) for a in ("1", "2")]
    p1 = {"1": [], "2": []}
    with torch.no_grad():
        for i in range(16):
            e = vp.encode(ds.messages[i], ds.images[i], base)
            probs = model(input_ids=torch.tensor([e.prompt_ids]), pixel_values=e.pixel_values,
                          image_grid_thw=e.image_grid_thw).logits[0, -1].softmax(-1)[answers]
            assert probs.sum() > 0.95 and 0.3 < probs[0] < 0.7, (i, probs)
            p1[ds.columns["solution"][i]].append(probs[0].item())
    red, green = (sum(v) / len(v) for v in (p1["1"], p1["2"]))
    assert abs(red - green) < 0.1, (red, green)


def test_vl_grpo_tp2_colocate_learns_colours(colour_data, tmp_path):
    out = str(tmp_path / "run")
    # 8 prompts x 8 completions of one token per step, one optimizer step each. The tower
    # trains: a random one passes the colour on only faintly (the merger alone: 0.74 over
    # steps 31-40, the whole tower: 0.975). beta keeps the policy near the warm start's
    # uniform answer while the image-specific signal is small (without it, or at lr 2e-3,
    # a noisy step's drift toward one answer can take over every image).
    r = _run(_argv(colour_data["model"], out, dataset=colour_data["train"],
                   val_dataset=colour_data["val"], dataset_shuffle="false",
                   reward_funcs=["accuracy"], max_completion_length=1, num_generations=8,
                   generation_batch_size=64, global_batch_size=64, micro_batch_size=16,
                   freeze_vit="false", freeze_aligner="false", tensor_model_parallel_size=2,
                   bf16="false", beta=0.04, lr=1e-3, max_pixels=BUDGET, vllm_max_model_len=256,
                   log_completions="true", log_rollout_offpolicy_metrics="true",
                   eval_steps=STEPS // 2, train_iters=STEPS))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in ("kl", "log_ppl_diff_max", "log_ppl_diff_min"):
            assert abs(row["rollout_correction/" + key]) < 1e-4, row
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] != 0.0, rows

    # Learning: from the image-blind 0.5 to the bar, on the training prompts and held out.
    acc = [row["rewards/accuracy/mean"] for row in rows]
    first, last = sum(acc[:5]) / 5, sum(acc[-10:]) / 10
    assert first < 0.7, acc          # the warm start knows the answers, not which is right
    assert last >= BAR and rows[-1]["eval/rewards/accuracy/mean"] >= BAR, (acc, rows[-1])

    from megatron_grpo.data import load_prompt_dataset
    from megatron_grpo.data.vision import VisionProcessor

    ds = load_prompt_dataset([colour_data["train"]])
    base = os.path.dirname(colour_data["train"])
    model = colour_data["model"]
    budget, own = VisionProcessor(model, BUDGET), VisionProcessor(model)

    def image_tokens(vp):     # per row of the dataset (all its images are 112x84)
        return {vp.encode(ds.messages[i], ds.images[i], base).prompt_ids.count(vp.image_token_id)
                for i in range(len(ds))}

    want = image_tokens(budget)
    assert len(want) == 1 and want != image_tokens(own), (want, image_tokens(own))
    with open(os.path.join(out, "completions.jsonl")) as f:
        done = [json.loads(line) for line in f]
    assert len(done) == STEPS * 64 and {d["image_tokens"] for d in done} == want, done[0]


def test_vl_teacher_is_the_policy_at_step_one(colour_data, tmp_path):
    """On-policy distillation of a vision-language policy at TP=2: --teacher_model =
    --model, a frozen copy that gets the images of every micro-batch (its tower and mrope
    positions). Its log-probs of the sampled tokens are the policy's before the first update
    (teacher_kl exactly 0; without the images its logits would move by ~4, with other
    positions by ~1.6), and not after it."""
    from tests.test_trainer_e2e import _varied_reward

    out = str(tmp_path / "run")
    model = colour_data["model"]
    r = _run(_argv(model, out, dataset=colour_data["train"], teacher_model=model,
                   max_completion_length=4, num_generations=4, generation_batch_size=8,
                   global_batch_size=8, micro_batch_size=2, tensor_model_parallel_size=2,
                   bf16="false", lr=1e-2, max_pixels=BUDGET, vllm_max_model_len=256,
                   train_iters=2, **_varied_reward(tmp_path)))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert rows[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-9), rows[0]
    assert rows[1]["teacher_kl"] > 1e-4, rows[1]
