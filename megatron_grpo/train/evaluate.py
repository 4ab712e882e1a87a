"""Evaluation on held-out prompts: `--eval_steps` with `--val_dataset` or `--split_dataset_ratio`.

What Megatron-SWIFT's GRPO does (ms-swift 3602360a: trainers/base.py `evaluate`,
callbacks/default_flow.py, grpo_trainer.py in eval mode), and so what this does:
  - when: every `eval_steps` optimizer steps and after the last step, if there is a
    validation set and eval_iters != 0 (eval_steps defaults to save_steps);
  - what: the current policy (vLLM holds the weights of the step just taken) samples
    `num_generations_eval` completions per validation prompt with the training sampling
    settings (temperature, top_p, top_k: sampled, not greedy), and the reward functions
    score them;
  - which prompts: eval_iters batches of global_batch_size completions, the validation
    set walked in order and continued from one evaluation to the next; here eval_iters
    -1 (the default) takes the whole validation set every time, so that successive
    evaluations compare the same prompts;
  - metrics: ms-swift's reward metrics under eval/: eval/reward, eval/reward_std,
    eval/frac_reward_zero_std, eval/rewards/{name}/mean|std, and
    eval/completions/mean_length|min_length|max_length|clipped_ratio; with a teacher
    (on-policy distillation) eval/teacher_kl, the training metric's k3 distance to the
    teacher on the evaluation completions (a forward of the policy, and of a local teacher,
    over them: rollout_step.eval_teacher_kl), which pure distillation has no reward for.
Left out on purpose: ms-swift also runs the GRPO loss forward-only on the evaluation
batch (eval/loss, clip ratios); on freshly sampled completions the ratio is 1 and the
loss says nothing the rewards do not. The eval reward has no KL term (kl_in_reward).

Every rank holds the whole scored evaluation batch (train/rollout_step.py gathers
completions and rewards), so every rank computes the same metrics.

    evaluator = Evaluator(cfg, val_dataset, ...)            # None-safe: build_evaluator
    metrics.update(evaluator.maybe_evaluate(step, vllm_fresh=...))
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import console
from ..algorithms import reward_metrics
from ..rewards import TrainerState
from .rollout_step import GenerationBatch, generate_and_score


def should_evaluate(step: int, eval_steps: int, total_steps: int) -> bool:
    """ms-swift's rule: every eval_steps steps, and after the last one."""
    return step % eval_steps == 0 or step >= total_steps


def evaluation_prompts(num_prompts: int, step: int, *, eval_steps: int, eval_iters: int,
                       prompts_per_iter: int) -> List[int]:
    """Validation prompt indices of the evaluation after optimizer step `step`.

    eval_iters -1: all of them. eval_iters N > 0: N * prompts_per_iter indices, continuing
    cyclically after the previous evaluations' (those at the multiples of eval_steps before
    `step`), so the sequence is a pure function of the step and survives a resume.
    """
    if eval_iters < 0:
        return list(range(num_prompts))
    count = eval_iters * prompts_per_iter
    earlier = step // eval_steps - (1 if step % eval_steps == 0 else 0)
    start = earlier * count
    return [(start + i) % num_prompts for i in range(count)]


class _WithGenerations:
    """An engine whose `generate` samples n completions per prompt (num_generations_eval)."""

    def __init__(self, engine, n: int) -> None:
        self.engine, self.n = engine, n
        self.tp_size = getattr(engine, "tp_size", 1)

    def generate(self, prompt_ids, **overrides):
        return self.engine.generate(prompt_ids, **{"num_generations": self.n, **overrides})

    def generate_turns(self, prompt_ids, next_turn, **overrides):
        """Multi-turn: one trajectory per prompt (the caller repeats prompts n times)."""
        return self.engine.generate_turns(prompt_ids, next_turn, **overrides)


def _concat(parts: List[GenerationBatch]) -> GenerationBatch:
    return GenerationBatch([s for p in parts for s in p.samples],
                           [t for p in parts for t in p.texts], [q for p in parts for q in p.prompts],
                           torch.cat([p.rewards_per_func for p in parts], dim=0))


def evaluation_metrics(batch: GenerationBatch, num_generations: int, reward_names, *,
                       reward_weights=None, scale_rewards="group") -> dict:
    """eval/* metrics of a scored evaluation batch (num_generations completions per prompt,
    contiguous): ms-swift's reward metrics and the completion lengths."""
    per_func = batch.rewards_per_func.double()                              # [N, F]
    weights = torch.ones(per_func.shape[1], dtype=torch.float64) if reward_weights is None \
        else torch.as_tensor(reward_weights, dtype=torch.float64)
    rewards = (per_func * weights).nansum(dim=1)                            # [N]
    metrics = reward_metrics(rewards, per_func, num_generations, scale_rewards, reward_names)
    lengths = torch.tensor([s.model_tokens for s in batch.samples], dtype=torch.float64)
    metrics.update({
        "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": sum(s.truncated for s in batch.samples) / len(batch.samples),
    })
    return {f"eval/{k}": float(v) for k, v in metrics.items()}


class Evaluator:
    """Runs the evaluation phase of the loop; holds what it needs from the run.

    sync: the run's rollout.sync.WeightSync: streams the policy's weights into vLLM (for
    an evaluation on a step that did not sync) and hands device memory over around the
    evaluation's generation. logger: the RunLogger (eval completions with
    --log_completions go to eval_completions.jsonl).
    """

    def __init__(self, cfg, dataset, *, engine, tokenizer, render, reward_funcs, reward_names,
                 total_steps: int, sync, logger, multi_turn=None, vision=None,
                 served_teacher=None, teacher_kl=None) -> None:
        e, g = cfg.evaluation, cfg.grpo
        self.cfg, self.dataset, self.engine = cfg, dataset, engine
        self.tokenizer, self.render = tokenizer, render
        self.reward_funcs, self.reward_names = reward_funcs, list(reward_names)
        self.total_steps, self.sync, self.logger = total_steps, sync, logger
        self.multi_turn = multi_turn     # rollout.trajectory.MultiTurnRollout, or None
        self.vision = vision             # data.vision.VisionProcessor (image prompts), or None
        self.served_teacher = served_teacher  # rollout.teacher.ServedTeacher, or None
        self.teacher_kl = teacher_kl     # samples -> eval/teacher_kl (with a teacher), or None
        self.n = e.num_generations_eval
        # Prompts per engine call: a generation batch's worth of completions.
        self.chunk = max(1, g.generation_batch_size // self.n)
        self.prompts_per_iter = max(1, cfg.training.global_batch_size // self.n)

    def maybe_evaluate(self, step: int, *, vllm_fresh: bool) -> dict:
        """eval/* metrics after optimizer step `step` ({} when this step does not evaluate).

        vllm_fresh: vLLM received this step's weights (the loop synced; the next thing it
        does is generate, so vLLM stays awake). Otherwise vLLM is synced here first and put
        back to sleep afterwards, as the loop left it.
        """
        e = self.cfg.evaluation
        if not should_evaluate(step, e.eval_steps, self.total_steps):
            return {}
        t0 = time.perf_counter()
        if not vllm_fresh:
            self.sync()
        index = evaluation_prompts(len(self.dataset), step, eval_steps=e.eval_steps,
                                   eval_iters=e.eval_iters, prompts_per_iter=self.prompts_per_iter)
        # As the loop's own hand-over, except that after an evaluation on a step that
        # synced vLLM stays awake: the loop generates next.
        self.sync.hand_over()
        state = TrainerState(step, self.total_steps, self.cfg.training.global_batch_size)
        try:
            batch = _concat([self._generate(index[i:i + self.chunk], state)
                             for i in range(0, len(index), self.chunk)])
        finally:   # vLLM sleeps through the forwards of eval/teacher_kl
            self.sync.take_back(keep_awake=vllm_fresh and self.teacher_kl is None)
        metrics = evaluation_metrics(batch, self.n, self.reward_names,
                                     reward_weights=self.cfg.reward.reward_weights,
                                     scale_rewards=self.cfg.grpo.scale_rewards)
        if self.teacher_kl is not None:
            metrics["eval/teacher_kl"] = self.teacher_kl(batch.samples)
        metrics["timing/eval"] = time.perf_counter() - t0
        self._log(step, index, batch, metrics)
        return metrics

    def _generate(self, prompt_indices: List[int], state: TrainerState) -> GenerationBatch:
        return generate_and_score(
            engine=_WithGenerations(self.engine, self.n), tokenizer=self.tokenizer,
            dataset=self.dataset, prompt_indices=prompt_indices, reward_funcs=self.reward_funcs,
            num_generations=self.n, render=self.render,
            max_prompt_length=self.cfg.data.max_length, multi_turn=self.multi_turn,
            vision=self.vision, trainer_state=state, teacher=self.served_teacher)

    def _log(self, step: int, index: List[int], batch: GenerationBatch, metrics: dict) -> None:
        rows = [i for i in index for _ in range(self.n)]
        extra = {"prompt_index": rows}
        for name, values in self.dataset.columns.items():   # e.g. solution, as in training
            extra[name] = [values[i] for i in rows]
        if self.multi_turn is not None:                      # whole trajectories
            extra["messages"] = [s.meta["messages"] for s in batch.samples]
            extra["num_turns"] = [s.meta["num_turns"] for s in batch.samples]
        self.logger.completions(step, batch.prompts, batch.texts, batch.rewards_per_func.tolist(),
                                self.reward_names, extra=extra, file="eval_completions.jsonl")
        if dist.get_rank() == 0:
            shown = ", ".join(f"{k[5:]}={metrics[k]:.4g}" for k in
                              ["eval/reward", "eval/reward_std", "eval/completions/mean_length",
                               "eval/teacher_kl"] if k in metrics)
            console.say(f"[megatron] eval at step {step}: {len(index)} prompts x {self.n}: {shown}")


def build_evaluator(cfg, dataset, **kwargs) -> Optional[Evaluator]:
    """An Evaluator, or None when the run does not evaluate (no validation set, eval_iters 0)."""
    if dataset is None or cfg.evaluation.eval_iters == 0:
        return None
    if cfg.data.max_length and cfg.data.truncation_strategy == "delete":
        from ..data import drop_long_prompts, prompt_length

        length = prompt_length(dataset, kwargs["tokenizer"], kwargs["render"],
                               kwargs.get("vision"))
        try:
            dataset, dropped = drop_long_prompts(dataset, length, cfg.data.max_length)
        except ValueError as e:    # its message is about --dataset
            raise ValueError(str(e).replace("prompt of --dataset", "validation prompt")) from None
        if dropped and dist.get_rank() == 0:
            console.say(f"[megatron] --truncation_strategy delete: dropped {dropped} validation "
                        f"prompts longer than --max_length {cfg.data.max_length}; {len(dataset)} left")
    return Evaluator(cfg, dataset, **kwargs)
