"""Validation of string options shared by the algorithm modules.

Every choice-valued option (`loss_type`, `scale_rewards`, ...) is checked the same
way, so a user sees one message shape: the option, the value given and the values
accepted.
"""
from __future__ import annotations

from typing import Iterable


def check_option(option: str, value, valid: Iterable[str]) -> str:
    """Return `value` if it is one of `valid`, else raise ValueError naming all three."""
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{option}={value!r} is not supported; valid values: {', '.join(map(repr, valid))}")
    return value
