"""The multi-turn rollout loop: token-exact trajectories with a loss mask.

A trajectory is the prompt's token ids followed by everything after it, as vLLM saw
it: the model's turns (loss mask 1, a rollout log-prob each) and the spans the
scheduler's messages add (tool answers, observations, the next turn's header: mask 0).
Nothing is re-tokenised: each turn samples from the exact ids of the trajectory so far,
and a message added by the scheduler becomes the tokens of the text the chat template
adds for it, and only that text:

    full  = template(messages, the model's turn's text replaced by a marker, + added
                     messages, generation prompt)
    span  = full after the marker, less the template's text up to and including the stop
            token the model wrote

    e.g. ChatML: model tokens "...</tool_call><|im_end|>"; after the marker
    "<|im_end|>\\n<|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n"; span from
    its "\\n<|im_start|>tool".

Earlier turns are never rendered again: a template that renders them differently once
more messages follow (Qwen3's drops the <think> block of turns before the last user
message) changes nothing, the trajectory stays the tokens the model saw.

All trajectories stay in flight together, each at its own pace (continuous batching
across turns): the engine's `generate_turns` hands each finished turn to the loop at
once, the scheduler decides, and the trajectory's next turn enters the engine while the
others keep decoding; no turn waits for the slowest of a round. Colocated, the engine
is stepped with new requests added between steps (inside a vLLM TP group its ranks
share what each has ready before every step); in server mode each trajectory's turn is
its own request and the server's engine batches them. The scheduler's hooks run in the
loop's thread, one turn at a time.

Lengths. `max_completion_length` caps each turn (ms-swift's default scope, per_round);
`max_length` caps the whole trajectory (prompt included): a trajectory that would pass
it is cut there (the excess sampled tokens are dropped) and marked truncated, as is
one whose last turn stopped at max_completion_length. With
`--completion_length_limit_scope total` everything after the prompt (the model's turns
and the spans between them, as ms-swift counts it) is cut at max_completion_length too.

Loss mask. Every model token trains (`--loss_scale default`): the trajectory is
token-exact, as ms-swift's is when a scheduler returns response_token_ids (whose mask it
keeps, whatever --loss_scale says). `--loss_scale last_round`, ms-swift's mask for
schedulers that return text, keeps only the last model message's tokens (a message the
scheduler let the model continue counts as one).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..data.template import render_chat
from ..multi_turn import (ChatCompletionResponseChoice, ChatMessage, RolloutInferRequest,
                         RolloutScheduler, build_scheduler, call_hook)

_SENTINEL = "\u2063MGRPO_TURN\u2063"


@dataclass
class Trajectory:
    """One rollout, token-exact (module docstring)."""
    prompt_ids: List[int]
    completion_ids: List[int]          # everything after the prompt
    loss_mask: List[int]               # per completion_ids: 1 model token, 0 tool/env/template
    logprobs: List[float]              # one per loss_mask 1 (vLLM's, as sampled)
    truncated: bool
    messages: List[Dict[str, Any]]     # the whole conversation, roles included
    num_turns: int
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""

    @property
    def text(self) -> str:
        """What reward functions see as the completion: the last model message."""
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                return m.get("content") or ""
        return ""


@dataclass
class _State:
    request: RolloutInferRequest
    prompt_ids: List[int]
    ids: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logps: List[float] = field(default_factory=list)
    turns: int = 0
    truncated: bool = False
    done: bool = False
    infos: Dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    continues: bool = False     # the next turn continues the model's last message
    limit: Optional[int] = None  # the trajectory's tokens at most (prompt included)
    rounds: List[int] = field(default_factory=list)   # per ids: its model message's number
    round: int = 0              # the model message being written (1, 2, ...)

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add(self, ids: Sequence[int], mask: Sequence[int], logps: Sequence[float]) -> None:
        self.ids += [int(t) for t in ids]
        self.mask += [int(m) for m in mask]
        self.logps += [float(x) for x in logps]
        self.rounds += [self.round] * len(ids)

    def last_round_only(self) -> None:
        """ms-swift's --loss_scale last_round: of the model's tokens, only those of its last
        message stay in the loss (their log-probs with them)."""
        last = max((r for r, m in zip(self.rounds, self.mask) if m), default=None)
        kept = [bool(m) and r == last for r, m in zip(self.rounds, self.mask)]
        self.logps = [x for x, k in zip(self.logps, (k for k, m in zip(kept, self.mask) if m))
                      if k]
        self.mask = [int(k) for k in kept]

    def cut(self, max_length: Optional[int]) -> bool:
        """Cut the trajectory to max_length tokens; True when it was longer."""
        if not max_length or self.length() <= max_length:
            return False
        # At least the first model token: a prompt that fills max_length alone (it was
        # cut to max_length) still gets a trajectory to train on.
        keep = max(1, max_length - len(self.prompt_ids))
        self.ids, self.mask, self.rounds = self.ids[:keep], self.mask[:keep], self.rounds[:keep]
        self.logps = self.logps[:sum(self.mask)]
        self.truncated = self.done = True
        return True


class TurnSpans:
    """Token ids of what a scheduler's messages add to a conversation (module docstring)."""

    def __init__(self, tokenizer: Any, enable_thinking: Optional[bool] = None) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def render(self, messages, generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt=generation_prompt,
                           enable_thinking=self.enable_thinking)

    def span(self, messages: List[Dict[str, Any]], turn_end: int,
             last_token: Optional[int]) -> List[int]:
        """Ids of messages[turn_end:] plus the generation prompt, after the model's turn
        messages[turn_end - 1], whose last token was `last_token` (module docstring)."""
        if len(messages) <= turn_end or messages[turn_end - 1].get("role") != "assistant":
            raise ValueError(
                "multi-turn scheduler removed or replaced the model's last turn; token-exact "
                "trajectories need schedulers that only append messages")
        marked = dict(messages[turn_end - 1], content=_SENTINEL)
        marked.pop("reasoning_content", None)
        text = self.render(messages[:turn_end - 1] + [marked] + messages[turn_end:], True)
        after = text[text.index(_SENTINEL) + len(_SENTINEL):]
        if last_token is not None and last_token in self.special:
            stop = self.tokenizer.decode([last_token], skip_special_tokens=False)
            at = after.find(stop) if stop else -1
            if at >= 0:     # the model wrote it: in the trajectory already
                after = after[at + len(stop):]
        return list(self.tokenizer(after, add_special_tokens=False)["input_ids"])


def _choice(c) -> ChatCompletionResponseChoice:
    return ChatCompletionResponseChoice(
        index=0, message=ChatMessage("assistant", c.text), finish_reason=c.finish_reason,
        token_ids=list(c.token_ids),
        logprobs={"content": [{"token": t, "logprob": x} for t, x in zip(c.token_ids, c.logprobs)]})


def run_trajectories(engine, tokenizer, scheduler: RolloutScheduler,
                     requests: List[RolloutInferRequest], *, max_length: Optional[int] = None,
                     max_turns: Optional[int] = None,
                     enable_thinking: Optional[bool] = None,
                     max_total_completion: Optional[int] = None,
                     loss_scale: str = "default") -> List[Trajectory]:
    """Roll every request out to the end of its trajectory (module docstring); one
    trajectory per request, in order. `engine`: a rollout.engine.RolloutEngine (its
    generate_turns drives the turns). Collective over the engine's vLLM TP group when it
    spans ranks (engine.tp_size > 1): its ranks call together, with or without requests.
    `max_total_completion`: the tokens after the prompt at most (scope total). `loss_scale`:
    default (every model token trains) or last_round (those of the last model message)."""
    spans = TurnSpans(tokenizer, enable_thinking)
    call_hook(scheduler.on_trajectory_start(requests))
    states = []
    for req in requests:
        prompt_text = spans.render(req.messages, True)
        ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        if max_length:
            ids = ids[-max_length:]                      # keep the question's end
        limits = [n for n in (max_length, max_total_completion and
                              len(ids) + max_total_completion) if n]
        states.append(_State(req, ids, prompt_text=prompt_text,
                             limit=min(limits) if limits else None))

    def next_turn(i: int, c) -> Optional[List[int]]:
        s = states[i]
        _advance(s, c, scheduler, spans, max_turns)
        return None if s.done else s.prompt_ids + s.ids

    engine.generate_turns([s.prompt_ids for s in states], next_turn)
    close = getattr(scheduler, "close", None)
    if callable(close):
        close()
    if loss_scale == "last_round":
        for s in states:
            s.last_round_only()
    return [Trajectory(s.prompt_ids, s.ids, s.mask, s.logps, s.truncated, s.request.messages,
                       s.turns, {**s.infos, "num_turns": s.turns}, s.prompt_text) for s in states]


def _advance(s: _State, c, scheduler: RolloutScheduler, spans: TurnSpans,
             max_turns: Optional[int]) -> None:
    """One model turn of trajectory `s` (completion `c`): record it, then ask the scheduler."""
    s.turns += 1
    choice = _choice(c)
    start = len(s.ids)
    if not s.continues:      # a new model message (a continued one is the same round)
        s.round += 1
    s.add(c.token_ids, [1] * len(c.token_ids), c.logprobs)
    messages = s.request.messages
    if s.continues:          # the scheduler left the model's message open: continue it
        messages[-1]["content"] = (messages[-1].get("content") or "") + c.text
    else:
        messages.append({"role": "assistant", "content": c.text})
    turn_end = len(messages)
    if s.cut(s.limit):
        return
    result = call_hook(scheduler.on_turn_end(s.request, choice, s.turns)) or {}
    s.infos.update(result.get("rollout_infos") or {})
    finished = result["done"] if "done" in result else \
        scheduler.check_finished(s.request, choice, s.turns)
    if finished or (max_turns and s.turns >= max_turns):
        s.truncated = c.finish_reason == "length"
        s.done = True
        return
    said = messages[-1]["content"]
    ret = scheduler.step(s.request, choice, s.turns)
    s.request = ret["infer_request"]
    s.infos.update(ret.get("rollout_infos") or {})
    last = c.token_ids[-1] if c.token_ids else None
    if "response_token_ids" in ret:             # the scheduler's own tokens for this turn
        ids = list(ret["response_token_ids"])
        mask = list(ret.get("response_loss_mask") or [1] * len(ids))
        if len(mask) != len(ids):
            raise ValueError(f"{type(scheduler).__name__}.step returned {len(mask)} "
                             f"response_loss_mask values for {len(ids)} response_token_ids")
        logps = list(ret.get("rollout_logprobs") or c.logprobs)
        if len(logps) != sum(mask):
            raise ValueError(f"{type(scheduler).__name__}.step: {sum(mask)} tokens of mask 1 but "
                             f"{len(logps)} rollout log-probs; return rollout_logprobs, one per "
                             "token of response_loss_mask 1")
        del s.ids[start:], s.mask[start:], s.rounds[start:]
        del s.logps[len(s.logps) - len(c.logprobs):]
        s.add(ids, mask, logps)
        last = ids[-1] if ids else None
    messages = s.request.messages
    s.continues = len(messages) == turn_end and messages[-1].get("role") == "assistant"
    if not s.continues:
        added = spans.span(messages, turn_end, last)
    elif "response_token_ids" not in ret and messages[-1]["content"] != said:
        # text appended to the model's message without tokens: tokenise the addition
        now = messages[-1]["content"] or ""
        if not now.startswith(said):
            raise ValueError(f"{type(scheduler).__name__}.step rewrote the model's message; "
                             "append to it, or return response_token_ids")
        added = list(spans.tokenizer(now[len(said):], add_special_tokens=False)["input_ids"])
    else:
        added = []
    s.add(added, [0] * len(added), [])
    s.cut(s.limit)


class MultiTurnRollout:
    """The run's multi-turn sampler: one scheduler for the run (built from the options
    of the same names), `num_generations` trajectories per prompt."""

    def __init__(self, tokenizer, *, multi_turn_scheduler: str, max_turns: Optional[int],
                 max_length: Optional[int], gym_env: Optional[str] = None,
                 enable_thinking: Optional[bool] = None, args: Any = None,
                 max_total_completion: Optional[int] = None,
                 loss_scale: str = "default") -> None:
        self.tokenizer, self.max_turns, self.max_length = tokenizer, max_turns, max_length
        self.max_total_completion, self.loss_scale = max_total_completion, loss_scale
        self.enable_thinking = enable_thinking
        self.scheduler = build_scheduler(multi_turn_scheduler, max_turns=max_turns,
                                         tokenizer=tokenizer, gym_env=gym_env, args=args)

    def __call__(self, engine, rows: List[Dict[str, Any]], num_generations: int) -> List[Trajectory]:
        """`rows`: dataset rows ({"messages": [...], other columns}); trajectories ordered
        by row, then sample."""
        requests = [RolloutInferRequest(copy.deepcopy(row["messages"]),
                                        data_dict={k: v for k, v in row.items() if k != "messages"})
                    for row in rows for _ in range(num_generations)]
        return run_trajectories(engine, self.tokenizer, self.scheduler, requests,
                                max_length=self.max_length, max_turns=self.max_turns,
                                enable_thinking=self.enable_thinking,
                                max_total_completion=self.max_total_completion,
                                loss_scale=self.loss_scale)
