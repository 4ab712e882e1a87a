"""`accuracy` (math answers) and `cosine` (length-scaled accuracy).

accuracy: the answer is the text of the last `<answer>...</answer>` of the
completion (the whole completion when there is none), compared with the
`solution` column (its own `<answer>` tags stripped). With the `math-verify`
package both are parsed to sympy and checked for equivalence (1/2 == 0.5 ==
\\frac{1}{2}); when either does not parse, or the package is missing, the two are
compared after normalisation (case, spaces, `$`, `\\boxed{}`, thousands commas,
a final period; numbers by value).

cosine (Chen et al., https://arxiv.org/abs/2502.03373): with t the completion's
token count, L = cosine_max_len, and (v0, vL) the rewards at length 0 and L (per
correct / wrong answer):
    r(t) = vL + (v0 - vL) * (1 + cos(pi * t / L)) / 2
so short right answers earn most and short wrong answers are punished most. As
ms-swift, t is not clamped to L: past L the cosine turns back (only reachable when
cosine_max_len < max_completion_length).
"""
from __future__ import annotations

import math
import re
import threading
from typing import Any, List, Optional

from .registry import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\s*\{(.*)\}", re.DOTALL)


def extract_answer(text: str) -> str:
    """Content of the last <answer>...</answer>, else the text itself (stripped)."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def normalize_answer(text: str) -> str:
    s = str(text).strip()
    boxed = _BOXED.search(s)
    if boxed:
        s = boxed.group(1)
    s = s.strip().strip("$").strip()
    s = s.rstrip(".").lower()
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 12,000 -> 12000
        s = s.replace(",", "")
    return s


def exact_match(answer: str, gold: str) -> bool:
    a, g = normalize_answer(answer), normalize_answer(gold)
    try:
        fa, fg = float(a), float(g)
    except ValueError:
        return a == g
    return math.isclose(fa, fg, rel_tol=1e-9, abs_tol=1e-9)


def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


class Accuracy:
    """1.0 when the completion's answer equals the solution, else 0.0."""

    def __init__(self, use_math_verify: bool = True) -> None:
        self.mv = _math_verify() if use_math_verify else None

    @classmethod
    def from_config(cls, config: Any = None) -> "Accuracy":
        return cls()

    def _verify(self, answer: str, gold: str, tagged: bool) -> Optional[bool]:
        """math-verify's verdict, or None when it cannot decide (unparsable / error)."""
        mv = self.mv
        if mv is None:
            return None
        # math-verify's timeouts use SIGALRM, which only the main thread may set.
        main = threading.current_thread() is threading.main_thread()
        timeout = 5 if main else None
        try:
            gold_parsed = mv.parse(gold, parsing_timeout=timeout)
            if not gold_parsed:
                return None
            if tagged:
                pred = mv.parse(answer, parsing_timeout=timeout)
            else:
                # Untagged free text: only anchored answers (\boxed{}, "answer is"),
                # not whatever number appears first (ms-swift does the same).
                cfg = mv.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
                pred = mv.parse(answer, extraction_config=[cfg], parsing_timeout=timeout)
            if not pred:
                return None
            return bool(mv.verify(gold_parsed, pred, timeout_seconds=timeout))
        except Exception:
            return None

    def __call__(self, completions: List[str], solution: List[Any], **kwargs: Any) -> List[float]:
        rewards = []
        for completion, sol in zip(completions, solution):
            tagged = bool(_ANSWER.search(completion))
            answer = extract_answer(completion)
            gold = extract_answer(str(sol))
            verdict = self._verify(answer, gold, tagged)
            if verdict is None:
                verdict = exact_match(answer, gold)
            rewards.append(1.0 if verdict else 0.0)
        return rewards


def cosine_scaled(t: float, max_len: int, value_at_0: float, value_at_max: float) -> float:
    """r(t) = vL + (v0 - vL) * (1 + cos(pi * t / L)) / 2 (ms-swift's, t not clamped)."""
    return value_at_max + (value_at_0 - value_at_max) * (1 + math.cos(math.pi * t / max_len)) / 2


class Cosine:
    """Accuracy scaled by completion length (needs `completion_lengths` and `solution`)."""

    def __init__(self, max_len: int, min_len_value_wrong: float = -0.5,
                 max_len_value_wrong: float = 0.0, min_len_value_correct: float = 1.0,
                 max_len_value_correct: float = 0.5, accuracy: Optional[Accuracy] = None) -> None:
        if max_len < 1:
            raise ValueError(f"--cosine_max_len {max_len} must be >= 1")
        self.max_len = max_len
        self.wrong = (min_len_value_wrong, max_len_value_wrong)
        self.correct = (min_len_value_correct, max_len_value_correct)
        self.accuracy = accuracy or Accuracy()

    @classmethod
    def from_config(cls, config: Any = None) -> "Cosine":
        if config is None:
            return cls(max_len=512)  # ms-swift: max_completion_length, whose default is 512
        r = config.reward
        return cls(max_len=r.cosine_max_len or config.grpo.max_completion_length,
                   min_len_value_wrong=r.cosine_min_len_value_wrong,
                   max_len_value_wrong=r.cosine_max_len_value_wrong,
                   min_len_value_correct=r.cosine_min_len_value_correct,
                   max_len_value_correct=r.cosine_max_len_value_correct)

    def __call__(self, completions: List[str], solution: List[Any],
                 completion_lengths: Optional[List[int]] = None, **kwargs: Any) -> List[float]:
        if completion_lengths is None:
            raise ValueError("the cosine reward needs `completion_lengths` (token counts of the "
                             "completions)")
        correct = self.accuracy(completions, solution)
        return [cosine_scaled(n, self.max_len, *(self.correct if ok >= 1.0 else self.wrong))
                for ok, n in zip(correct, completion_lengths)]


register_reward("accuracy")(Accuracy)
register_reward("cosine")(Cosine)
