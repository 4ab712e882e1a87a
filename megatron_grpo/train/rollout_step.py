"""The rollout phase of a step (docs/architecture.md, steps 1-5): generate -> score -> gather ->
old/ref log-probs -> advantages, one generation batch as training Samples
(`rollout_phase`).

Every rank ends with the SAME full list of Samples of the generation batch (prompt
order, num_generations completions per prompt contiguous), so the ranks of one
model-parallel group train on identical data and advantages (which need whole
groups, and batch statistics for scale_rewards=batch) are computed once, identically.

Sampling is spread over the ranks: each takes a contiguous share of the prompts (a
vLLM TP group pools its members' shares inside the engine) and scores the completions
it sampled; completions and rewards are then all-gathered together, in one collective.

Image prompts (vision-language models, `vision`: a data.vision.VisionProcessor): the
rank that samples a prompt encodes it once with the model's processor; vLLM gets the
ids with one image placeholder per image plus the PIL images, and must expand them to
the processor's ids (`check_expanded`). The prompt's `ImageInputs` (pixel values, grid,
mrope positions) are all-gathered once per prompt, not per completion, and every
completion of the prompt carries that one object as `Sample.images`, so the old, ref
and training forwards see the pixels and positions vLLM sampled from.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import console
from ..algorithms import compute_advantages, count_partials, sequence_kl_for_reward
from ..model.lora import adapters_disabled
from ..rollout.offload import offload_model, onload_model
from ..rewards import TrainerState, score
from .batch import (ImageInputs, Sample, collate, dp_indices, dp_shard, dp_unshard,
                    micro_batches, split_completion_values)
from .engine import forward_logprobs, is_last_stage


@dataclass
class GenerationBatch:
    samples: list[Sample]
    texts: list[str]
    prompts: list[str]
    rewards_per_func: torch.Tensor          # [N, F]
    metrics: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)


def all_gather_objects(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# vLLM's OpenAI routes write a -inf log-prob as this floor (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def checked_rollout_logps(logps, loss_mask, num_tokens: int, where: str):
    """The sampler's log-probs of one completion (one per model token: loss_mask 1, all
    tokens when None), checked before anything trains on them; returns (log-probs, loss
    mask, tokens dropped).

    NaN fails the step: the engine's model gave non-finite logits, so the sampled tokens
    themselves are meaningless (colocate mode gets the NaN; server mode cannot carry it
    through JSON, and RolloutClient fails with the same explanation). -inf (colocate) or
    LOGPROB_FLOOR (server) means the sampler drew a token its processed distribution gave
    probability 0 (top_k/top_p/min_p had masked it: a sampler defect). Its behaviour
    probability is 0, so no importance weight old / rollout exists for it: the token
    leaves the loss (loss mask 0, as an environment token: context, not trained), and
    -inf never reaches rollout_is_weights or the rollout_correction metrics.
    """
    logps = [float(x) for x in logps]
    bad = [k for k, x in enumerate(logps) if math.isnan(x) or x == math.inf]
    if bad:
        raise RuntimeError(
            f"rollout log-prob {logps[bad[0]]} at model token {bad[0]} of {where} ({len(bad)} "
            "non-finite in it): the rollout engine's model produced non-finite logits. Its "
            "weights are broken: a diverged update (see grad_norm and loss) or an incomplete "
            "weight sync (--check_weight_sync true names the tensors)")
    low = {k for k, x in enumerate(logps) if x <= LOGPROB_FLOOR}
    if not low:
        return logps, loss_mask, 0
    mask = [1] * num_tokens if loss_mask is None else list(loss_mask)
    model_positions = [i for i, m in enumerate(mask) if m]
    for k in low:
        mask[model_positions[k]] = 0
    return [x for k, x in enumerate(logps) if k not in low], mask, len(low)


def generate_and_score(*, engine, tokenizer, dataset, prompt_indices: list[int], reward_funcs,
                       num_generations: int, render, max_prompt_length=None,
                       multi_turn=None, vision=None, trainer_state=None,
                       teacher=None) -> GenerationBatch:
    """Sample `num_generations` completions for each prompt index and score them.

    `multi_turn` (a rollout.trajectory.MultiTurnRollout): whole trajectories instead of
    single completions; each sample then carries its loss mask, the reward functions see
    the last model message as the completion (plus `messages` and `rollout_infos`).
    Advantages and reward metrics are left to `finish_batch` (after dynamic sampling).
    `vision` (data.vision.VisionProcessor): a dataset with images (module docstring).
    `trainer_state` (rewards.TrainerState): handed to the reward functions. `teacher`
    (rollout.teacher.ServedTeacher, --teacher_model_server): scores the completions each
    rank sampled, beside their rewards (a local --teacher_model scores in `fill_logps`).
    A row with a `teacher_prompt` column (OPSD) gives its samples the prompt the teacher
    sees instead (`teacher_prompt_ids`)."""
    t0 = time.perf_counter()
    views: dict = {}          # dataset row -> the teacher's prompt ids (OPSD), or None

    def view(row):
        if row not in views:
            views[row] = teacher_prompt_ids(dataset, row, tokenizer, render, max_prompt_length)
        return views[row]

    payload, images = _sample_share(engine, tokenizer, dataset, prompt_indices, num_generations,
                                    render, max_prompt_length, multi_turn, vision)
    t1 = time.perf_counter()
    # Each rank scores the completions it sampled, then completions and rewards are
    # gathered together: one pickled all-gather per batch (each costs two collectives,
    # ~1 ms apiece over gloo on a small CPU node).
    rows = _score(reward_funcs, dataset, prompt_indices, payload, trainer_state)
    t2 = time.perf_counter()
    taught = teacher.score([view(prompt_indices[x[0]]) or x[1] for x in payload],
                           [x[2] for x in payload], [prompt_indices[x[0]] for x in payload],
                           dataset) \
        if teacher is not None and payload else [None] * len(payload)
    t_teacher = time.perf_counter() - t2
    gathered = sorted((x for part in all_gather_objects(
        [item + (row, t) for item, row, t in zip(payload, rows.tolist(), taught)])
        for x in part), key=lambda x: x[0])                  # stable: keeps sample order
    if len(gathered) != len(prompt_indices) * num_generations:
        raise RuntimeError(f"expected {len(prompt_indices) * num_generations} completions, "
                           f"gathered {len(gathered)}")
    texts = [g[3] for g in gathered]
    rewards = torch.tensor([g[8] for g in gathered], dtype=torch.float32)     # [N, F]
    t3 = time.perf_counter()

    samples = _gathered_samples(gathered, rewards, prompt_indices, images, view)
    rendered = {}
    prompts = [g[6]["prompt"] if g[6] else rendered.setdefault(
        g[0], render(tokenizer, dataset.messages[prompt_indices[g[0]]])) for g in gathered]
    timing = {"timing/generate": (t1 - t0) + (t3 - t2 - t_teacher), "timing/score": t2 - t1}
    if teacher is not None:
        timing["timing/teacher"] = t_teacher
    return GenerationBatch(samples, texts, prompts, rewards, {}, timing)


def _sample_share(engine, tokenizer, dataset, prompt_indices: list[int], num_generations: int,
                  render, max_prompt_length, multi_turn, vision) -> tuple[list, dict]:
    """(payload, images): this rank's samples of its contiguous share of the prompts, one
    tuple (prompt position, prompt ids, completion ids, text, truncated, rollout log-probs,
    multi-turn extras or None, routed experts) per completion; images: prompt position ->
    ImageInputs of every rank's image prompts (gathered: each sample finds its own).
    vLLM TP groups pool their members' shares inside `engine.generate`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    lo, hi = rank * len(prompt_indices) // world, (rank + 1) * len(prompt_indices) // world
    images = {}                  # prompt position -> ImageInputs (image prompts)
    if multi_turn is None and getattr(dataset, "images", None) is not None:
        payload, images = _single_turn_images(engine, vision, dataset, prompt_indices, lo, hi)
        images = {k: v for part in all_gather_objects(images) for k, v in part.items()}
        # Left truncation (text prompts) could cut an image's tokens: refused, on every
        # rank alike (after the gather: one rank raising alone would hang the others).
        long = {k: img.image_mask.numel() for k, img in images.items()
                if max_prompt_length and img.image_mask.numel() > max_prompt_length}
        if long:
            k, n = min(long.items())
            raise ValueError(f"--max_length {max_prompt_length}: prompt {prompt_indices[k]} of the "
                             f"dataset has {n} tokens with its images; image prompts are not "
                             "truncated: raise --max_length or lower --max_pixels")
    elif multi_turn is None:
        payload = _single_turn(engine, tokenizer, dataset, prompt_indices, render,
                               max_prompt_length, lo, hi)
    else:
        trajectories = multi_turn(engine, [dataset[i] for i in prompt_indices[lo:hi]],
                                  num_generations) if hi > lo or engine.tp_size > 1 else []
        payload = [(lo + j // num_generations, t.prompt_ids, t.completion_ids, t.text, t.truncated,
                    t.logprobs, {"prompt": t.prompt_text, "loss_mask": t.loss_mask,
                                 "messages": t.messages, "rollout_infos": t.rollout_infos}, None)
                   for j, t in enumerate(trajectories)]
    return payload, images


def _gathered_samples(gathered: list, rewards: torch.Tensor, prompt_indices: list[int],
                      images: dict, view) -> list[Sample]:
    """A Sample per gathered completion (payload tuple + reward row + teacher log-probs),
    in sample order. Rollout log-probs of -inf (a token vLLM's own sampling filters had
    excluded) leave that token out of the loss, with one warning per batch."""
    samples, impossible = [], 0
    for j, (pi, prompt_ids, tokens, text, truncated, logps, extra, routed, _, taught) in \
            enumerate(gathered):
        meta = {"prompt_index": prompt_indices[pi], "rewards": rewards[j].tolist()}
        if extra:
            meta.update(messages=extra["messages"],
                        num_turns=int(extra["rollout_infos"].get("num_turns", 1)))
        loss_mask = list(extra["loss_mask"]) if extra else None
        if logps:
            logps, loss_mask, dropped = checked_rollout_logps(
                logps, loss_mask, len(tokens), f"completion {j} (prompt {prompt_indices[pi]})")
            impossible += dropped
        samples.append(Sample(prompt_ids=list(prompt_ids), completion_ids=list(tokens),
                              truncated=bool(truncated),
                              # [] (every token's was -inf): kept, the micro-batch keeps the field
                              rollout_logps=list(logps) if logps is not None else None, meta=meta,
                              loss_mask=loss_mask, images=images.get(pi), routed_experts=routed,
                              teacher_logps=None if taught is None else torch.tensor(
                                  [x for k, x in enumerate(taught) if loss_mask is None or
                                   loss_mask[k]], dtype=torch.float32),
                              teacher_prompt_ids=view(prompt_indices[pi])))
    if impossible and (not dist.is_initialized() or dist.get_rank() == 0):
        console.warn(f"[megatron] {impossible} sampled token(s) had rollout log-prob -inf (vLLM "
                     "drew a token its own top_k/top_p/min_p had excluded): left out of the loss")
    return samples


def teacher_prompt_ids(dataset, row: int, tokenizer, render, max_prompt_length=None):
    """OPSD (ms-swift's on-policy self-distillation): the prompt ids the teacher scores a
    sample of `row` with, the row's messages with its last user message replaced by its
    `teacher_prompt` column (privileged information, e.g. a reference solution), rendered
    and cut as the policy's prompt; None for a row without one."""
    column = dataset.columns.get("teacher_prompt")
    text = column[row] if column is not None else None
    if not text:
        return None
    messages = [dict(m) for m in dataset.messages[row]]
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError(f"teacher_prompt of a prompt without a user message: {messages}")
    users[-1]["content"] = text
    ids = tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]
    return ids[-max_prompt_length:] if max_prompt_length else ids


def _score(reward_funcs, dataset, prompt_indices, payload, trainer_state) -> torch.Tensor:
    """Rewards [n, F] of this rank's completions (`payload`, see `_single_turn`), each
    with its prompt's dataset columns and ms-swift's extra ones; [0, F] without any."""
    if not payload:
        return torch.empty(0, len(reward_funcs), dtype=torch.float32)
    columns = dataset.reward_columns([prompt_indices[x[0]] for x in payload], 1)
    # ms-swift's names, for plugins (its OnPolicySample.to_reward_row); lengths count the
    # model's tokens; `messages`: the conversation with the completion as its last message.
    columns["completion_lengths"] = [sum(x[6]["loss_mask"]) if x[6] else len(x[2]) for x in payload]
    columns["response_token_ids"] = [list(x[2]) for x in payload]
    columns["is_truncated"] = [bool(x[4]) for x in payload]
    columns["finish_reason"] = ["length" if x[4] else "stop" for x in payload]
    prompt_ids = {pos: uuid.uuid4().hex for pos in sorted({x[0] for x in payload})}
    columns["prompt_id"] = [prompt_ids[x[0]] for x in payload]    # shared by a group
    columns["request_id"] = [uuid.uuid4().hex for _ in payload]
    if payload[0][6]:                                       # multi-turn trajectories
        columns["messages"] = [x[6]["messages"] for x in payload]
        columns["rollout_infos"] = [x[6]["rollout_infos"] for x in payload]
    else:
        columns["messages"] = [dataset.messages[prompt_indices[x[0]]]
                               + [{"role": "assistant", "content": x[3]}] for x in payload]
        columns["rollout_infos"] = [{} for _ in payload]
    return score(reward_funcs, [x[3] for x in payload], columns, trainer_state)


def _single_turn(engine, tokenizer, dataset, prompt_indices, render, max_prompt_length, lo, hi):
    """This rank's share [lo, hi) of the prompts, one completion per sample: (prompt
    position, prompt ids, completion ids, text, truncated, log-probs, None, the experts
    vLLM routed its tokens to (router replay R3, else None)) each."""
    prompt_ids = [tokenizer(render(tokenizer, dataset.messages[i]),
                            add_special_tokens=False)["input_ids"] for i in prompt_indices[lo:hi]]
    if max_prompt_length:
        prompt_ids = [ids[-max_prompt_length:] for ids in prompt_ids]   # keep the question's end
    completions = []
    if hi > lo or engine.tp_size > 1:       # a vLLM TP group generates together
        completions = engine.generate(prompt_ids)            # num_generations per prompt
    return [(lo + c.prompt_index, list(prompt_ids[c.prompt_index]), c.token_ids, c.text,
             c.truncated, c.logprobs, None, c.routed_experts) for c in completions]


def _single_turn_images(engine, vision, dataset, prompt_indices, lo, hi):
    """`_single_turn` for a dataset with images: this rank's payload, and the ImageInputs
    of its image prompts by prompt position (one object per prompt)."""
    if vision is None:
        raise ValueError("the dataset has an `images` column, but --model is not a "
                         "vision-language model (no image processor)")
    encoded = []
    for i in prompt_indices[lo:hi]:
        base = os.path.dirname(dataset.sources[i]) if dataset.sources else None
        encoded.append(vision.encode(dataset.messages[i], dataset.images[i], base_dir=base))
    completions = []
    if hi > lo or engine.tp_size > 1:       # a vLLM TP group generates together
        completions = engine.generate([p.vllm_prompt_ids for p in encoded],
                                      images=[p.images for p in encoded])
    images = {}
    for k, p in enumerate(encoded):
        if p.images:
            images[lo + k] = ImageInputs.from_prompt(p.prompt_ids, p.pixel_values,
                                                     p.image_grid_thw, vision.image_token_id,
                                                     vision.spatial_merge_size)
    for c in completions:
        p = encoded[c.prompt_index]
        if p.images:     # vLLM's expansion of the placeholders must be the processor's
            p.check_expanded(c.prompt_token_ids)
    payload = [(lo + c.prompt_index, list(encoded[c.prompt_index].prompt_ids), c.token_ids,
                c.text, c.truncated, c.logprobs, None, c.routed_experts) for c in completions]
    return payload, images


def _select_groups(batch: GenerationBatch, groups: list[int], k: int) -> GenerationBatch:
    idx = [g * k + j for g in groups for j in range(k)]
    return GenerationBatch([batch.samples[i] for i in idx], [batch.texts[i] for i in idx],
                           [batch.prompts[i] for i in idx], batch.rewards_per_func[idx],
                           dict(batch.metrics), dict(batch.timing))


def _concat(parts: list[GenerationBatch]) -> GenerationBatch:
    timing = {}
    for p in parts:
        for key, v in p.timing.items():
            timing[key] = timing.get(key, 0.0) + v
    return GenerationBatch([s for p in parts for s in p.samples], [t for p in parts for t in p.texts],
                           [q for p in parts for q in p.prompts],
                           torch.cat([p.rewards_per_func for p in parts], dim=0), {}, timing)


def collect_rollouts(sample, num_prompts: int, num_generations: int, *, dynamic_sample=False,
                     max_resample_times=3, reward_weights=None) -> GenerationBatch:
    """One generation batch; with `dynamic_sample` (DAPO) groups whose rewards all agree
    are replaced by groups of freshly drawn prompts, up to `max_resample_times` rounds.

    `sample()` draws the next prompts from the sampler and returns a scored batch. If the
    rounds run out, the groups with a reward spread found so far are kept and the batch is
    filled up with the first batch's zero-variance groups, so its size never changes
    (ms-swift falls back to the first batch as drawn, dropping what the rounds found).
    """
    first = sample()
    if not dynamic_sample:
        return first
    k = num_generations
    weights = torch.ones(first.rewards_per_func.shape[1]) if reward_weights is None else \
        torch.as_tensor(reward_weights, dtype=torch.float32)

    def varied(b):
        r = (b.rewards_per_func * weights).nansum(dim=1).view(-1, k)
        return [g for g in range(r.shape[0]) if r[g].std() > 0]

    kept = [_select_groups(first, varied(first), k)]
    have, rounds = len(varied(first)), 0
    while have < num_prompts and rounds < max_resample_times:
        more = sample()
        groups = varied(more)
        kept.append(_select_groups(more, groups, k))
        have += len(groups)
        rounds += 1
    batch = _concat(kept)
    if have < num_prompts:   # pad with the first batch's zero-variance groups
        flat = [g for g in range(num_prompts) if g not in varied(first)][:num_prompts - have]
        batch = _concat([batch, _select_groups(first, flat, k)])
    batch = _select_groups(batch, list(range(num_prompts)), k)
    batch.metrics["dynamic_sample/resample_rounds"] = float(rounds)
    return batch


def finish_batch(batch: GenerationBatch, num_generations: int, *, reward_names, reward_weights=None,
                 advantage_estimator="grpo", scale_rewards=None, kl_in_reward=None, beta=0.0,
                 kl_values=None) -> GenerationBatch:
    """Advantages of every completion, and the rollout's reward and length metrics.

    With `kl_in_reward` and beta != 0, `kl_values` [N] (the sequence KL of each sample,
    see `algorithms.sequence_kl_for_reward`) is taken off the rewards before the
    advantages, and logged as `kl`."""
    adv = compute_advantages(batch.rewards_per_func, num_generations,
                             reward_weights=reward_weights, advantage_estimator=advantage_estimator,
                             scale_rewards=scale_rewards, kl_in_reward=kl_in_reward, beta=beta,
                             kl_values=kl_values, reward_func_names=reward_names)
    for j, s in enumerate(batch.samples):
        s.advantage = float(adv.advantages[j])
        s.meta["reward"] = float(adv.rewards[j])
    lengths = torch.tensor([s.model_tokens for s in batch.samples], dtype=torch.float64)
    batch.metrics.update({k: float(v) for k, v in adv.metrics.items()})
    batch.metrics.update({
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": sum(s.truncated for s in batch.samples) / len(batch.samples),
    })
    if any("num_turns" in s.meta for s in batch.samples):      # multi-turn (ms-swift's name)
        batch.metrics["num_turns"] = sum(s.meta.get("num_turns", 1) for s in batch.samples) / \
            len(batch.samples)
    return batch


# ---- old / reference log-probs (step 5) ------------------------------------------------------

def _per_token(chunks, batches, samples, field, temperature, vocab_size):
    """Fill samples' `field` with per-token log-probs (last pipeline stage only)."""
    outs = forward_logprobs(chunks, batches, temperature=temperature, vocab_size=vocab_size)
    if outs is None:
        return
    mbs = len(samples) // len(batches)
    for b, (batch, out) in enumerate(zip(batches, outs)):
        for i, values in enumerate(split_completion_values(out["logps"], batch)):
            setattr(samples[b * mbs + i], field, values)


def fill_logps(policy_chunks, ref, mine, mbs: int, pad: int, *, need_old: bool,
               temperature: float, vocab_size: int, teacher=None,
               offload_teacher: bool = False, teacher_is_policy: bool = False,
               pad_multiple: int = 1, ref_is_other: bool = False) -> None:
    """Old (sampling-policy), reference and teacher (`teacher`: --teacher_model's chunks)
    log-probs of this rank's samples (`mine`: one list per optimizer step), before any
    update of the generation batch. On-policy with beta 0 and no teacher there is nothing
    to compute, and no micro-batch is built. `offload_teacher`: the teacher is held off the
    device (--offload_teacher_model) and comes back for this call only.
    `teacher_is_policy`: OPSD's dynamic teacher, the policy itself (its adapters on).
    `ref_is_other`: `ref` is another model than the policy's start (--ref_model); like a
    teacher of its own, it routes for itself (router replay replays the policy's experts).
    OPSD: a sample with `teacher_prompt_ids` is scored by the teacher behind that prompt
    (micro-batches of their own, padded to a multiple of `pad_multiple`)."""
    if not need_old and ref is None and teacher is None:
        return
    with _onloaded(teacher if offload_teacher else None):
        for part in mine:
            batches = micro_batches(part, mbs, pad_to_length=pad)
            if need_old:
                _per_token(policy_chunks, batches, part, "old_logps", temperature, vocab_size)
            if ref is not None:   # LoRA: `ref` is the policy; adapters off = the base model
                # (a reference of its own keeps its adapters: --ref_adapters)
                with adapters_disabled(ref) if ref is policy_chunks else \
                        contextlib.nullcontext():
                    _per_token(ref, _own_routing(batches) if ref_is_other else batches, part,
                               "ref_logps", temperature, vocab_size)
            if teacher is None:
                continue
            # LoRA with --teacher_model = --model: the base, as `ref` (not OPSD's dynamic one)
            base = contextlib.nullcontext() if teacher_is_policy else adapters_disabled(teacher)
            views = [dataclasses.replace(s, prompt_ids=s.teacher_prompt_ids, routed_experts=None)
                     if s.teacher_prompt_ids else s for s in part]
            if any(v is not s for v, s in zip(views, part)):       # OPSD
                batches = micro_batches(views, mbs, pad_to_length=max(
                    pad, padded_length(views, pad_multiple)))
            own = teacher is not policy_chunks    # another model: it routes for itself (R3)
            with base:
                _per_token(teacher, _own_routing(batches) if own else batches, views,
                           "teacher_logps", temperature, vocab_size)
            for v, s in zip(views, part):
                s.teacher_logps = v.teacher_logps


def padded_length(samples, multiple: int = 1) -> int:
    """The micro-batches' common length for `samples`: their longest input row, rounded up
    to `multiple` (Policy.pad_multiple)."""
    longest = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    return -(-longest // multiple) * multiple


def _own_routing(batches):
    """Micro-batches for another model than the policy: its routers choose their experts
    (the ones vLLM routed the policy's tokens to are the policy's)."""
    return [{k: v for k, v in b.items() if k != "routed_experts"} for b in batches]


@contextlib.contextmanager
def _onloaded(chunks):
    """`chunks` (offloaded) on the device inside the block, offloaded again after it."""
    if chunks is None:
        yield
        return
    onload_model(chunks)
    try:
        yield
    finally:
        offload_model(chunks)


def reward_kl_values(mine, n: int, per_step: int, dp: int, dp_rank: int, group: int = 1) -> torch.Tensor:
    """The sequence KL of every sample of the generation batch ([n] float64, the same on
    every rank), for `kl_in_reward`: sum over the completion of old - ref log-probs.

    `mine` is this data rank's `batch.dp_shard` of the batch, whose old_logps / ref_logps
    `fill_logps` set on the last pipeline stage. One rank per data rank (last stage, TP
    and CP rank 0) contributes its values; all ranks gather them (`batch.dp_unshard`).
    """
    from megatron.core import parallel_state as ps

    local = None
    if is_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_context_parallel_rank() == 0:
        local = (dp_rank, [[_sequence_kl(s) for s in part] for part in mine])
    shards = dict(x for x in all_gather_objects(local) if x is not None)
    if len(shards) != dp:
        missing = [j for r in range(dp) if r not in shards
                   for idx in dp_indices(n, per_step, dp, r, group) for j in idx]
        raise RuntimeError(f"kl_in_reward: no sequence KL for samples {sorted(missing)[:8]} of {n}")
    return torch.tensor(dp_unshard([shards[r] for r in range(dp)], n, per_step, group),
                        dtype=torch.float64)


def eval_teacher_kl(samples: list[Sample], policy_chunks, teacher, *, micro_batch_size: int,
                    temperature: float, vocab_size: int, offload_teacher: bool = False,
                    teacher_is_policy: bool = False, pad_multiple: int = 1) -> float:
    """eval/teacher_kl of a scored evaluation batch (`samples`, the same on every rank): the
    token mean of k3 = exp(d) - d - 1, d = teacher - policy log-prob of each model token, as
    the training metric. The policy's log-probs (and a local teacher's, `teacher`: its
    chunks; a served teacher's are on the samples already) come from a forward of every
    dp-th sample on each DP rank, padded with copies of the first to the same number of
    whole micro-batches on every rank (pipeline stages and expert all-to-alls need it); one
    rank per DP rank (last stage, TP and CP rank 0) contributes its sums."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = list(samples[dp_rank::dp])
    real = len(mine)
    count = -(-len(samples) // dp)
    mine += [samples[0]] * (-(-count // micro_batch_size) * micro_batch_size - real)
    fill_logps(policy_chunks, None, [mine], micro_batch_size,
               padded_length(samples, pad_multiple), need_old=True, temperature=temperature,
               vocab_size=vocab_size, teacher=teacher, offload_teacher=offload_teacher,
               teacher_is_policy=teacher_is_policy, pad_multiple=pad_multiple)
    local = None
    if is_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_context_parallel_rank() == 0:
        d = [s.teacher_logps.double() - s.old_logps.double() for s in mine[:real]]
        local = (sum(float((torch.exp(x) - x - 1).sum()) for x in d), sum(x.numel() for x in d))
    parts = [x for x in all_gather_objects(local) if x is not None]
    return sum(x[0] for x in parts) / max(1, sum(x[1] for x in parts))


def _sequence_kl(s: Sample) -> float:
    old, ref = s.old_logps.double()[None], s.ref_logps.double()[None]
    return float(sequence_kl_for_reward(old, ref, torch.ones_like(old, dtype=torch.bool))[0])


# ---- the phase ---------------------------------------------------------------------------------

@dataclass
class RolloutBatch:
    """One generation batch, ready for its optimizer steps."""
    gen: GenerationBatch
    steps: list[list[Sample]]     # the whole batch's samples of each optimizer step
    mine: list[list[Sample]]      # this DP rank's share of each step (batch.dp_shard)
    pad: int                      # the common micro-batch length
    gen_counts: dict              # token counts of the whole generation batch (normalisers)
    logprobs_seconds: float       # time of the old/ref log-prob forwards


def rollout_phase(run) -> RolloutBatch:
    """Steps 1-5 (docs/architecture.md) for the next steps_per_generation optimizer steps: sample and
    score (vLLM holds the device meanwhile), then old (off-policy) and reference
    log-probs before any update of the batch, then the advantages (after the log-probs:
    with kl_in_reward the KL is part of the reward). `run`: a train.run.Run."""
    cfg, g = run.cfg, run.cfg.grpo
    prompts = g.generation_batch_size // g.num_generations
    with run.memory.phase("generate"):
        gen = _generate(run, cfg, g, prompts)
    samples, per_step = gen.samples, run.per_step
    steps = [samples[k * per_step:(k + 1) * per_step] for k in range(g.steps_per_generation)]
    mine = dp_shard(samples, per_step, run.dp, run.dp_rank, run.dp_group)
    pad = padded_length(samples, run.policy.pad_multiple)
    t0 = time.perf_counter()
    with run.memory.phase("logprobs"):
        fill_logps(run.policy.chunks, run.ref, mine, cfg.training.micro_batch_size, pad,
                   need_old=run.need_old_logps, temperature=run.loss.temperature,
                   vocab_size=run.policy.args.vocab_size, teacher=run.teacher,
                   offload_teacher=run.teacher_offloaded, teacher_is_policy=run.teacher_is_policy,
                   ref_is_other=run.ref_is_other, pad_multiple=run.policy.pad_multiple)
    kl_values = reward_kl_values(mine, len(samples), per_step, run.dp, run.dp_rank, run.dp_group) \
        if run.kl_in_reward else None
    logprobs_seconds = time.perf_counter() - t0
    gen = finish_batch(gen, g.num_generations, reward_names=run.reward_names,
                       reward_weights=cfg.reward.reward_weights,
                       advantage_estimator=g.advantage_estimator, scale_rewards=g.scale_rewards,
                       kl_in_reward=bool(g.kl_in_reward), beta=g.beta, kl_values=kl_values)
    mask = collate(samples)["completion_mask"]
    return RolloutBatch(gen, steps, mine, pad, count_partials(mask, mask), logprobs_seconds)


def _generate(run, cfg, g, prompts) -> GenerationBatch:
    """Steps 1-3: vLLM gets the device, samples and the completions are scored."""
    run.sync.hand_over()
    gen = collect_rollouts(
        lambda: generate_and_score(
            engine=run.engine, tokenizer=run.tokenizer, dataset=run.dataset,
            prompt_indices=run.sampler.next_batch(), reward_funcs=run.reward_funcs,
            num_generations=g.num_generations, render=run.render,
            max_prompt_length=cfg.data.max_length, multi_turn=run.multi_turn,
            vision=run.vision, trainer_state=TrainerState(
                run.step, run.total_steps, cfg.training.global_batch_size),
            teacher=run.served_teacher),
        prompts, g.num_generations, dynamic_sample=g.dynamic_sample,
        max_resample_times=g.max_resample_times, reward_weights=cfg.reward.reward_weights)
    run.sync.take_back()
    return gen
