"""`countdown`: the Countdown numbers game (columns `nums` and `target`).

The completion's answer is the last `<answer>...</answer>`; it must be an
arithmetic expression over the given numbers that uses each of them exactly once
(the rule of the common Countdown reward, TinyZero / ms-swift's example), with
only + - * / and parentheses, and evaluate exactly (fractions, no float rounding)
to the target. One `=` is tolerated when its other side is a bare number
(`(6-2)*3 = 12` or `12 = (6-2)*3`). Reward 1.0 when all holds, else 0.0.

The expression is parsed with `ast` and evaluated by walking only the allowed
node types; nothing is ever passed to eval().
"""
from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any, List, Optional, Sequence, Tuple

from .accuracy import extract_answer
from .registry import register_reward

MAX_EXPRESSION_CHARS = 200  # longer answers are rejected before parsing
_ALLOWED_CHARS = re.compile(r"[\d+\-*/().\s]+")
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _walk(node: ast.AST, used: List[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, used), _walk(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"{type(node).__name__} is not allowed")


def evaluate_expression(expr: str) -> Optional[Tuple[Fraction, List[int]]]:
    """(exact value, numbers used) of an arithmetic expression, or None if not one."""
    expr = expr.replace("×", "*").replace("÷", "/").strip()
    if "=" in expr:
        sides = [s.strip() for s in expr.split("=")]
        if len(sides) != 2:
            return None
        # Keep the side that is not a bare number (the claimed result).
        numeric = [bool(re.fullmatch(r"\d+", s)) for s in sides]
        if numeric == [False, True]:
            expr = sides[0]
        elif numeric == [True, False]:
            expr = sides[1]
        else:
            return None
    if not expr or len(expr) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: List[int] = []
        return _walk(tree, used), used
    except (SyntaxError, ValueError, RecursionError):
        return None


def countdown_correct(completion: str, nums: Sequence[int], target: Any) -> bool:
    result = evaluate_expression(extract_answer(completion)) if "<answer>" in completion else None
    if result is None:
        return False
    value, used = result
    return sorted(used) == sorted(int(n) for n in nums) and value == Fraction(str(target))


@register_reward("countdown")
def countdown_reward(completions: List[str], nums: List[Sequence[int]], target: List[Any],
                     **kwargs: Any) -> List[float]:
    return [1.0 if countdown_correct(c, n, t) else 0.0 for c, n, t in zip(completions, nums, target)]
