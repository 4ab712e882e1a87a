"""Generate -> gather -> score -> advantages: one generation batch as training Samples.

Every rank ends with the SAME full list of Samples of the generation batch (prompt
order, num_generations completions per prompt contiguous), so the ranks of one
model-parallel group train on identical data and advantages (which need whole
groups, and batch statistics for scale_rewards=batch) are computed once, identically.

Sampling is spread over the ranks: each takes a contiguous share of the prompts (a
vLLM TP group pools its members' shares inside the engine); scoring likewise; both
are then all-gathered.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..algorithms import compute_advantages
from ..rewards import score
from .batch import Sample


@dataclass
class GenerationBatch:
    samples: list[Sample]
    texts: list[str]
    prompts: list[str]
    rewards_per_func: torch.Tensor          # [N, F]
    metrics: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)


def _all_gather_objects(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def generate_and_score(*, engine, tokenizer, dataset, prompt_indices: list[int], reward_funcs,
                       reward_names: list[str], num_generations: int, max_prompt_length=None,
                       reward_weights=None, advantage_estimator="grpo", scale_rewards=None,
                       render) -> GenerationBatch:
    """Sample `num_generations` completions for each prompt index and score them."""
    t0 = time.perf_counter()
    prompts = [render(tokenizer, dataset.messages[i]) for i in prompt_indices]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if max_prompt_length:
        prompt_ids = [ids[-max_prompt_length:] for ids in prompt_ids]   # keep the question's end
    # Each rank samples a contiguous share of the prompts (vLLM TP groups pool their
    # members' shares inside `engine.generate`), then every rank gathers everything.
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    lo, hi = rank * len(prompt_ids) // world, (rank + 1) * len(prompt_ids) // world
    completions = []
    if hi > lo or getattr(engine, "tp_size", 1) > 1:
        completions = engine.generate(prompt_ids[lo:hi])     # num_generations per prompt
    payload = [(lo + c.prompt_index, c.token_ids, c.text, c.truncated, c.logprobs)
               for c in completions]
    gathered = sorted((x for part in _all_gather_objects(payload) for x in part),
                      key=lambda x: x[0])                    # stable: keeps sample order
    if len(gathered) != len(prompt_ids) * num_generations:
        raise RuntimeError(f"expected {len(prompt_ids) * num_generations} completions, gathered "
                           f"{len(gathered)}")
    t1 = time.perf_counter()

    # Score a 1/world share on each rank, then share the rows.
    texts = [g[2] for g in gathered]
    columns = dataset.reward_columns(prompt_indices, num_generations)
    columns["completion_lengths"] = [len(g[1]) for g in gathered]
    n = len(texts)
    share = range(rank * n // world, (rank + 1) * n // world)
    rows = score(reward_funcs, [texts[i] for i in share],
                 {k: [v[i] for i in share] for k, v in columns.items()})
    rewards = torch.cat(_all_gather_objects(rows), dim=0)              # [N, F]
    t2 = time.perf_counter()

    adv = compute_advantages(rewards, num_generations, reward_weights=reward_weights,
                             advantage_estimator=advantage_estimator, scale_rewards=scale_rewards,
                             reward_func_names=reward_names)
    samples = []
    for j, (pi, tokens, text, truncated, logps) in enumerate(gathered):
        samples.append(Sample(
            prompt_ids=list(prompt_ids[pi]), completion_ids=list(tokens),
            advantage=float(adv.advantages[j]), truncated=bool(truncated),
            rollout_logps=list(logps) if logps else None,
            meta={"prompt_index": prompt_indices[pi], "reward": float(adv.rewards[j]),
                  "rewards": rewards[j].tolist()}))
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float64)
    metrics = {k: float(v) for k, v in adv.metrics.items()}
    metrics.update({
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": sum(s.truncated for s in samples) / len(samples),
    })
    return GenerationBatch(samples, texts, [prompts[g[0]] for g in gathered], rewards, metrics,
                           {"timing/generate": t1 - t0, "timing/score": t2 - t1})
