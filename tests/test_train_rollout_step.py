"""Dynamic sampling and advantages over a generation batch (no vLLM: batches are built
directly, the sampler is a list)."""
import pytest
import torch

from megatron_grpo.train.batch import Sample
from megatron_grpo.train.rollout_step import GenerationBatch, collect_rollouts, finish_batch


def _batch(tag, group_rewards, k=2):
    samples, rows = [], []
    for g, rs in enumerate(group_rewards):
        for j in range(k):
            samples.append(Sample(prompt_ids=[1], completion_ids=[2, 3],
                                  meta={"prompt_index": f"{tag}{g}"}))
            rows.append([rs[j]])
    n = len(samples)
    return GenerationBatch(samples, ["t"] * n, [f"{tag}{i // k}" for i in range(n)],
                           torch.tensor(rows, dtype=torch.float32), {},
                           {"timing/generate": 1.0})


def test_dynamic_sample_replaces_flat_groups():
    draws = iter([_batch("a", [[1, 1], [0, 1]]), _batch("b", [[0, 0], [1, 0]]),
                  _batch("c", [[0, 1], [1, 0]])])
    out = collect_rollouts(lambda: next(draws), 2, 2, dynamic_sample=True, max_resample_times=3)
    # a1 (varied) then b1 (varied): two groups, one resampling round.
    assert [s.meta["prompt_index"] for s in out.samples] == ["a1", "a1", "b1", "b1"]
    assert out.metrics["dynamic_sample/resample_rounds"] == 1.0
    assert out.timing["timing/generate"] == 2.0


def test_dynamic_sample_pads_when_rounds_run_out():
    draws = iter([_batch("a", [[1, 1], [0, 1]]), _batch("b", [[0, 0], [1, 1]])])
    out = collect_rollouts(lambda: next(draws), 2, 2, dynamic_sample=True, max_resample_times=1)
    assert [s.meta["prompt_index"] for s in out.samples] == ["a1", "a1", "a0", "a0"]


def test_without_dynamic_sample_and_advantages():
    b = _batch("a", [[1, 0], [2, 2]])
    out = finish_batch(collect_rollouts(lambda: b, 2, 2), 2, reward_names=["r"])
    adv = [s.advantage for s in out.samples]
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0
    assert out.metrics["frac_reward_zero_std"] == 0.5
    assert out.metrics["completions/mean_length"] == 2.0


@pytest.mark.slow     # builds the tiny Qwen2.5-VL and its processor (~10 s)
def test_image_prompts_encode_once_and_share_their_images(tmp_path):
    """The rollout step's image path with a stand-in engine (the real one is
    tests/test_vl_e2e.py): vLLM gets the unexpanded ids and the images, the samples carry
    the processor's expanded ids and one ImageInputs per prompt; an expansion that differs
    from the processor's, and an image prompt over --max_length, stop the step."""
    from megatron_grpo.data import load_prompt_dataset
    from megatron_grpo.data.vision import VisionProcessor
    from megatron_grpo.rollout.colocate import Completion
    from megatron_grpo.train.rollout_step import generate_and_score
    from tools.make_tiny_vl_model import make_tiny_vl_model
    from tools.make_vl_count_data import main as make_count_data

    model = str(make_tiny_vl_model(tmp_path / "vl"))
    ds = load_prompt_dataset([make_count_data(["--out_dir", str(tmp_path / "c"), "--n", "2"])])
    vp = VisionProcessor(model)
    want = [vp.encode(ds.messages[i], ds.images[i], str(tmp_path / "c")) for i in range(2)]

    class Engine:
        tp_size, calls, expand = 1, [], None

        def generate(self, ids, images=None):
            self.calls.append((ids, images))
            return [Completion(k, [7, 8], "2", False, [-0.5, -0.25],
                               prompt_token_ids=self.expand or want[k].prompt_ids)
                    for k in range(len(ids)) for _ in range(2)]

    def ones(completions, **kwargs):
        return [1.0] * len(completions)

    def run(engine, **kw):
        return generate_and_score(engine=engine, tokenizer=vp.tokenizer, dataset=ds,
                                  prompt_indices=[0, 1], reward_funcs=[ones], num_generations=2,
                                  render=lambda t, m: "", vision=vp, **kw)

    engine = Engine()
    batch = run(engine)
    ids, images = engine.calls[0]
    assert ids == [w.vllm_prompt_ids for w in want] and len(images[0]) == 1
    s = batch.samples
    assert [x.prompt_ids for x in s] == [want[0].prompt_ids] * 2 + [want[1].prompt_ids] * 2
    assert s[0].images is s[1].images and s[2].images is not s[0].images
    assert int(s[0].images.image_mask.sum()) == want[0].prompt_ids.count(vp.image_token_id) > 1
    engine.expand = want[0].prompt_ids[:-1]
    with pytest.raises(RuntimeError, match="expanded an image prompt"):
        run(engine)
    engine.expand = None
    with pytest.raises(ValueError, match="--max_length 10: prompt 0 .* image prompts are not"):
        run(engine, max_prompt_length=10)


def test_rollout_logprobs_nan_fails_and_minus_inf_leaves_the_loss():
    """The sampler's log-probs, before anything trains on them (a stand-in engine; the
    real engine gives -inf when it draws a token its own top_k/top_p masked, and NaN
    when its model's logits are non-finite). -inf (colocate) and vLLM's JSON floor -9999
    (server) take the token out of the loss, so the IS weights stay finite; NaN stops the
    step with what it means."""
    from megatron_grpo.algorithms.policy_loss import rollout_is_weights
    from megatron_grpo.rollout.colocate import Completion
    from megatron_grpo.train.batch import collate
    from megatron_grpo.train.rollout_step import checked_rollout_logps, generate_and_score

    class Engine:
        tp_size, logps = 1, None

        def generate(self, ids):
            return [Completion(k, [7, 8, 9], "x", False, list(self.logps)) for k in range(len(ids))]

    class Data:
        messages = [[{"role": "user", "content": "q"}]]
        columns: dict = {}

        def reward_columns(self, indices, n):
            return {}

    engine = Engine()

    def run():
        return generate_and_score(
            engine=engine, tokenizer=lambda text, add_special_tokens: {"input_ids": [1, 2]},
            dataset=Data(), prompt_indices=[0], reward_funcs=[lambda c, **kw: [1.0] * len(c)],
            num_generations=1, render=lambda t, m: "")

    for impossible in (float("-inf"), -9999.0):
        engine.logps = [-0.5, impossible, -1.25]
        [s] = run().samples
        assert s.loss_mask == [1, 0, 1] and s.rollout_logps == [-0.5, -1.25]
        b = collate([s])
        assert b["completion_mask"].sum() == 2 and torch.isfinite(b["rollout_logps"]).all()
        w = rollout_is_weights(torch.zeros_like(b["rollout_logps"]), b["rollout_logps"],
                               b["completion_mask"], "token_truncate", 2.0)
        assert torch.isfinite(w).all()
    # Every token's -inf: nothing of it trains, and it still has (no) rollout log-probs, so
    # a micro-batch with it keeps the field (it was dropped for the whole micro-batch: the
    # IS correction failed on that rank alone, and the others waited for it).
    engine.logps = [float("-inf")] * 3
    [lost] = run().samples
    assert lost.loss_mask == [0, 0, 0] and lost.rollout_logps == []
    b = collate([lost, s])
    assert "rollout_logps" in b and b["completion_mask"][0].sum() == 0
    engine.logps = [-0.5, -0.1, -1.0]
    assert run().samples[0].loss_mask is None                  # nothing to change
    engine.logps = [-0.5, float("nan"), -1.0]
    with pytest.raises(RuntimeError, match=r"rollout log-prob nan at model token 1 of completion "
                                           r"0 \(prompt 0\).*non-finite logits.*check_weight_sync"):
        run()
    # Multi-turn: one log-prob per model token (loss_mask 1); the 2nd model token is index 2.
    assert checked_rollout_logps([-1.0, float("-inf"), -2.0], [1, 0, 1, 1], 4, "t") == \
        ([-1.0, -2.0], [1, 0, 0, 1], 1)


def test_served_teacher_scores_every_token_behind_its_prompt_and_the_loss_keeps_model_tokens():
    """--teacher_model_server (a stand-in for rollout.teacher.ServedTeacher and the engine):
    the teacher is asked for each sampled completion with its prompt ids (OPSD: the row's
    teacher_prompt in place of its last user message, cut as the policy's prompt) and
    dataset row, and of its per-token log-probs a Sample keeps those of the tokens that stay
    in the loss (here a token the sampler drew at -inf leaves it), as old_logps has them."""
    from megatron_grpo.rollout.colocate import Completion
    from megatron_grpo.train.rollout_step import generate_and_score

    class Engine:
        tp_size = 1

        def generate(self, ids):
            return [Completion(k, [7, 8, 9], "x", False, [-0.5, float("-inf"), -1.25])
                    for k in range(len(ids))]

    class Teacher:
        asked = []

        def score(self, prompt_ids, completion_ids, rows, dataset):
            self.asked.append((prompt_ids, completion_ids, rows, type(dataset).__name__))
            return [[-0.1 * (r + 1), -0.2, -0.3] for r in rows]

    class Data:
        messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]] * 4
        # OPSD: row 3's teacher sees a privileged prompt in place of the last user message
        columns = {"teacher_prompt": [None, None, None, "q; the answer is 7"]}

        def reward_columns(self, indices, n):
            return {}

    def tokenizer(text, add_special_tokens):          # a token per character
        return {"input_ids": [ord(c) for c in text]}

    batch = generate_and_score(
        engine=Engine(), tokenizer=tokenizer, dataset=Data(), prompt_indices=[3, 1],
        reward_funcs=[lambda c, **kw: [1.0] * len(c)], num_generations=1,
        render=lambda t, m: "|".join(x["content"] for x in m), max_prompt_length=12,
        teacher=Teacher())
    plain, privileged = tokenizer("be brief|q", 0)["input_ids"], \
        tokenizer("be brief|q; the answer is 7", 0)["input_ids"][-12:]
    assert Teacher.asked == [([privileged, plain], [[7, 8, 9], [7, 8, 9]], [3, 1], "Data")]
    assert [s.teacher_logps.tolist() for s in batch.samples] == \
        [pytest.approx([-0.4, -0.3]), pytest.approx([-0.2, -0.3])]
    assert [s.teacher_prompt_ids for s in batch.samples] == [privileged, None]
    assert [s.prompt_ids for s in batch.samples] == [plain, plain]
    assert "timing/teacher" in batch.timing


def test_reward_functions_get_ms_swift_keywords():
    """A reward function written to ms-swift's documented signature
    `__call__(completions, solution, trainer_state, **kwargs)` runs, and sees ms-swift's
    per-sample keywords (OnPolicySample.to_reward_row): the conversation with the
    completion last, finish reason, ids (a prompt's group shares its prompt_id), and the
    step in trainer_state; a list of bools counts 1/0. A stand-in engine samples."""
    from megatron_grpo.rewards import TrainerState
    from megatron_grpo.rollout.colocate import Completion
    from megatron_grpo.train.rollout_step import generate_and_score

    class Engine:
        tp_size = 1

        def generate(self, ids):
            return [Completion(k, [7, 8], f"answer {k}{j}", j == 1, None, "length" if j else "stop")
                    for k in range(len(ids)) for j in range(2)]

    class Data:
        messages = [[{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"}]
                    for i in range(3)]
        columns = {"solution": ["a", "b", "c"]}

        def reward_columns(self, indices, n):
            return {"solution": [self.columns["solution"][i] for i in indices for _ in range(n)]}

    seen = {}

    def swift_style(completions, solution, trainer_state, **kwargs):
        seen.update(kwargs, solution=solution, state=trainer_state)
        return [c.endswith("0") for c in completions]

    batch = generate_and_score(
        engine=Engine(), tokenizer=lambda text, add_special_tokens: {"input_ids": [1, 2]},
        dataset=Data(), prompt_indices=[2, 0], reward_funcs=[swift_style], num_generations=2,
        render=lambda t, m: "", trainer_state=TrainerState(4, 10, 64))
    assert batch.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert seen["solution"] == ["c", "c", "a", "a"]
    assert (seen["state"].global_step, seen["state"].max_steps) == (4, 10)
    assert seen["messages"][1] == [{"role": "system", "content": "s"},
                                   {"role": "user", "content": "q2"},
                                   {"role": "assistant", "content": "answer 01"}]
    assert seen["finish_reason"] == ["stop", "length"] * 2
    assert seen["is_truncated"] == [False, True] * 2
    assert seen["response_token_ids"] == [[7, 8]] * 4 and seen["completion_lengths"] == [2] * 4
    p = seen["prompt_id"]
    assert p[0] == p[1] != p[2] == p[3] and len(set(seen["request_id"])) == 4
    assert seen["rollout_infos"] == [{}] * 4


def test_fill_logps_on_policy_without_reference_builds_nothing(monkeypatch):
    """On-policy with beta 0 (the quickstart) there are no old or reference log-probs:
    no micro-batch is collated and no forward runs."""
    import megatron_grpo.train.rollout_step as rs

    def fail(*a, **k):
        raise AssertionError("built or ran a micro-batch")

    monkeypatch.setattr(rs, "micro_batches", fail)
    monkeypatch.setattr(rs, "forward_logprobs", fail)
    mine = [[Sample(prompt_ids=[1], completion_ids=[2, 3], meta={})] * 4]
    rs.fill_logps(None, None, mine, 2, 8, need_old=False, temperature=1.0, vocab_size=10)
    assert all(s.old_logps is None and s.ref_logps is None for s in mine[0])
    with pytest.raises(AssertionError, match="micro-batch"):    # off-policy: it does build
        rs.fill_logps(None, None, mine, 2, 8, need_old=True, temperature=1.0, vocab_size=10)
