"""The sampler's interface: what the trainer, weights.py and verify.py call.

Two implementations: `ColocateEngine` (vLLM inside each training rank) and
`RolloutClient` (a `megatron rollout` server over HTTP). Each implements every
method; where a mode has nothing to do (a server never sleeps, a client holds
nothing to close) the method is a documented no-op, so callers never probe.
tests/test_rollout_engine.py holds both classes to this Protocol, signatures included.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, runtime_checkable

from .colocate import Completion
from .weights import Bucket


@runtime_checkable
class RolloutEngine(Protocol):
    """A vLLM sampler the trainer drives: sampling, scoring, weight updates, sleep."""

    # Ranks that generate together: every one of them must call generate()/score(),
    # even with no prompts of its own (a colocated vLLM TP group); 1 when each rank
    # samples on its own (server mode).
    tp_size: int

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 images: Optional[Sequence[Sequence[Any]]] = None, **overrides) -> List[Completion]:
        """`num_generations` completions per prompt, ordered by prompt then sample;
        `images`: per prompt, its PIL images (vision-language models; the ids hold one
        placeholder per image, and each completion carries vLLM's expanded
        `prompt_token_ids`); `overrides`: any SamplingOptions field for this call."""

    def generate_turns(self, prompt_token_ids: Sequence[Sequence[int]],
                       next_turn: Callable[[int, Completion], Optional[Sequence[int]]],
                       **overrides) -> None:
        """Continuous batching across turns (multi-turn rollouts): one completion per
        prompt; when prompt i's completion c is done, `next_turn(i, c)` (called in the
        caller's thread) returns i's next prompt, sampled at once while the others go on,
        or None when i is finished. Returns when every chain is finished."""

    def score(self, prompt_ids: Sequence[Sequence[int]],
              completion_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """Per-token log-probs (temperature 1) of each completion given its prompt."""

    def begin_weight_update(self) -> None:
        """Start an in-place weight update (weights.load_weight_stream)."""

    def load_bucket(self, bucket: Bucket) -> None:
        """Load one bucket of (HF name, full tensor); the caller may reuse its tensors after."""

    def finish_weight_update(self, complete: bool = True) -> None:
        """Finish the update (also after a failed stream: `complete` False, the weights
        held are then incomplete)."""

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed with the old weights)."""

    def weight_fingerprints(self) -> List[List[dict]]:
        """Fingerprint pieces of the weights vLLM holds, one list per engine (verify.py)."""

    def begin_adapter_update(self) -> None:
        """Start an adapter-only LoRA sync (weights.load_adapter_stream); the base
        weights stay as they are."""

    def load_adapter_bucket(self, bucket: Bucket) -> None:
        """Load one bucket of (PEFT name, full adapter tensor)."""

    def finish_adapter_update(self, peft_config: dict) -> str:
        """Make what arrived the adapter every later request runs with (a new id: the
        previous adapter is removed); returns its name."""

    def adapter_fingerprints(self) -> List[dict]:
        """Per engine, its workers' adapter fingerprints (verify.check_adapter_sync)."""

    def sleep(self, level: int) -> None:
        """Free memory for training (sleep_level 1 or 2)."""

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """Undo sleep(); `tags` "weights" / "kv_cache" for a staged wake-up; None: all."""

    def close(self) -> None:
        """Release the engine at the end of a run."""
