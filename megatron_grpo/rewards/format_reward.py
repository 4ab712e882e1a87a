"""`format` and `react_format`: 1.0 when the completion has the expected layout, as ms-swift's.

format        `<think>...</think>`, optional whitespace, `<answer>...</answer>`, and nothing
              before `<think>` or after the last `</answer>` (not even a newline).
react_format  `<think>...</think>`, optional whitespace, then `Action:` followed somewhere by
              `Action Input:` (a ReAct tool call).

Both are ms-swift's regular expressions with its flags (DOTALL: `.` crosses lines), so the
blocks are not checked for nesting: `<think>a</think><answer>b</answer><answer>c</answer>`
passes, as it does in ms-swift.
"""
from __future__ import annotations

import re
from typing import Any, List

from .registry import register_reward

FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>\Z", re.DOTALL)
REACT_FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*Action:.*?Action Input:", re.DOTALL)


@register_reward("format")
def format_reward(completions: List[str], **kwargs: Any) -> List[float]:
    return [1.0 if FORMAT_PATTERN.match(c) else 0.0 for c in completions]


@register_reward("react_format")
def react_format_reward(completions: List[str], **kwargs: Any) -> List[float]:
    return [1.0 if REACT_FORMAT_PATTERN.match(c) else 0.0 for c in completions]
