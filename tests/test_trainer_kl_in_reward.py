"""kl_in_reward: the sequence KL that the trainer takes off each sample's reward.

`train.rollout_step.fill_logps` + `reward_kl_values` run on real Megatron models (DP=2 and
PP=2 on 2 gloo ranks, a policy and a reference with different weights) and must give,
on every rank and in the generation batch's order, sum over the completion of
log p_policy - log p_ref, as HF transformers computes it in float64.
"""
import pytest
import torch

from tests.harness import run_distributed

TEMPERATURE = 0.7
PER_STEP, STEPS = 4, 2          # 8 samples: 2 optimizer steps of 4


def _samples(vocab):
    from megatron_grpo.train.batch import Sample

    g = torch.Generator().manual_seed(3)
    out = []
    for j in range(PER_STEP * STEPS):
        p, c = 2 + j % 3, 1 + (5 * j) % 7
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        out.append(Sample(prompt_ids=ids[:p], completion_ids=ids[p:], meta={"j": j}))
    return out


def _chunks(path, tp, pp):
    from bridge import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config

    config, args = build_transformer_config(path, tp=tp, pp=pp)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, path)
    for c in chunks:
        c.eval()
    return args, chunks


def _body(rank, world, policy_dir, ref_dir, tp, pp):
    from megatron.core import parallel_state as ps

    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train.rollout_step import fill_logps, reward_kl_values

    init_parallel(ParallelDims(world_size=world, tp=tp, pp=pp), seed=0)
    args, policy = _chunks(policy_dir, tp, pp)
    _, ref = _chunks(ref_dir, tp, pp)
    samples = _samples(args.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    steps_data = [samples[k * PER_STEP:(k + 1) * PER_STEP] for k in range(STEPS)]
    mine = [sl[dp_rank::dp] for sl in steps_data]
    pad = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    fill_logps(policy, ref, mine, 1, pad, need_old=True, temperature=TEMPERATURE,
               vocab_size=args.vocab_size)
    return reward_kl_values(mine, len(samples), PER_STEP, dp, dp_rank)


def _hf_reference(policy_dir, ref_dir):
    from transformers import AutoModelForCausalLM

    hf = {p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64).eval()
          for p in (policy_dir, ref_dir)}

    def logps(path, s):
        model = hf[path]
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1] / TEMPERATURE
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[len(s.prompt_ids) - 1:]

    import json
    import os

    vocab = json.load(open(os.path.join(policy_dir, "config.json")))["vocab_size"]
    return torch.tensor([float((logps(policy_dir, s) - logps(ref_dir, s)).sum())
                         for s in _samples(vocab)], dtype=torch.float64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("kl")
    kw = dict(family="qwen2", num_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, vocab_size=999)
    return str(make_tiny_model(d / "policy", seed=1, **kw)), str(make_tiny_model(d / "ref", seed=0, **kw))


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)], ids=["dp2", "pp2"])
def test_reward_kl_matches_hf_float64(models, tp, pp):
    policy_dir, ref_dir = models
    expected = _hf_reference(policy_dir, ref_dir)
    assert expected.abs().min() > 1e-3          # the two models differ on every sample
    results = run_distributed(_body, 2, args=(policy_dir, ref_dir, tp, pp))
    for got in results:                         # every rank holds every sample's KL
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
