"""Length-shaped rewards: `repetition` and `soft_overlong`.

repetition (https://arxiv.org/abs/2502.03373, ms-swift's RepetitionPenalty): the
completion is lower-cased and split on whitespace into words; with U unique and
T total word n-grams (n = repetition_n_grams),
    r = (1 - U / T) * repetition_max_penalty
and 0 for an empty completion or one shorter than n words.

soft_overlong (DAPO, https://arxiv.org/abs/2503.14476): with L the completion's
token count, L_max = soft_max_length and L_cache = soft_cache_length,
    r = min((L_max - L_cache - L) / L_cache, 0)
i.e. 0 up to L_max - L_cache, then linear down to -1 at L_max. As ms-swift, not floored
at -1 beyond L_max (the paper's -1 there): completions longer than L_max only exist when
soft_max_length < max_completion_length, and they keep getting worse.
"""
from __future__ import annotations

from typing import Any, List, Optional

from .registry import register_reward


class Repetition:
    def __init__(self, n_grams: int = 3, max_penalty: float = -1.0) -> None:
        if n_grams < 1:
            raise ValueError(f"--repetition_n_grams {n_grams} must be >= 1")
        if max_penalty > 0:
            raise ValueError(f"--repetition_max_penalty {max_penalty} must be <= 0")
        self.n = n_grams
        self.max_penalty = max_penalty

    @classmethod
    def from_config(cls, config: Any = None) -> "Repetition":
        if config is None:
            return cls()
        return cls(config.reward.repetition_n_grams, config.reward.repetition_max_penalty)

    def __call__(self, completions: List[str], **kwargs: Any) -> List[float]:
        rewards = []
        for text in completions:
            words = text.lower().split()
            if len(words) < self.n:
                rewards.append(0.0)
                continue
            grams = [tuple(words[i:i + self.n]) for i in range(len(words) - self.n + 1)]
            rewards.append((1 - len(set(grams)) / len(grams)) * self.max_penalty)
        return rewards


class SoftOverlong:
    def __init__(self, soft_max_length: int, soft_cache_length: int) -> None:
        if not 0 < soft_cache_length < soft_max_length:
            raise ValueError(f"--soft_cache_length {soft_cache_length} must be in "
                             f"(0, soft_max_length={soft_max_length})")
        self.max_length = soft_max_length
        self.cache_length = soft_cache_length

    @classmethod
    def from_config(cls, config: Any = None) -> "SoftOverlong":
        if config is None or config.reward.soft_cache_length is None:
            raise ValueError("--reward_funcs soft_overlong needs --soft_cache_length")
        r = config.reward
        return cls(r.soft_max_length or config.grpo.max_completion_length, r.soft_cache_length)

    def __call__(self, completions: List[str], completion_lengths: Optional[List[int]] = None,
                 **kwargs: Any) -> List[float]:
        if completion_lengths is None:
            raise ValueError("the soft_overlong reward needs `completion_lengths` (token counts of "
                             "the completions)")
        expected = self.max_length - self.cache_length
        return [min((expected - n) / self.cache_length, 0.0) for n in completion_lengths]


register_reward("repetition")(Repetition)
register_reward("soft_overlong")(SoftOverlong)
