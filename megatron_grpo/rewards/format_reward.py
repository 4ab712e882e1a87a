"""`format`: 1.0 when the completion is exactly `<think>...</think><answer>...</answer>`.

Strict, as ms-swift's Format reward: the completion starts with `<think>`, ends
with `</answer>` (nothing after it, not even a newline), and only whitespace
separates `</think>` from `<answer>`. One step stricter than ms-swift: each block
appears once (no `<think>`/`<answer>` tags nested inside the blocks).
"""
from __future__ import annotations

import re
from typing import Any, List

from .registry import register_reward

FORMAT_PATTERN = re.compile(r"<think>(?:(?!</?think>).)*</think>\s*"
                            r"<answer>(?:(?!</?answer>).)*</answer>\Z", re.DOTALL)


@register_reward("format")
def format_reward(completions: List[str], **kwargs: Any) -> List[float]:
    return [1.0 if FORMAT_PATTERN.match(c) else 0.0 for c in completions]
