"""Deterministic generators of the small builtin datasets (see tools/make_countdown_data.py).

countdown: three numbers from 1..9 and a target in 1..50 reachable by using each
number exactly once with + - * / (built from a random expression, so every
problem is solvable; `solution` holds that expression). Small numbers and short
answers, so a tiny model can learn at least the answer format on CPU.

arithmetic: "What is a op b?" over single digits with + - *, and the `solution`.
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple

COUNTDOWN_SYSTEM = ("Use every number exactly once with + - * / and parentheses to reach the target. "
                    "Reply as <think>reasoning</think><answer>equation</answer>.")

_OPS = ("+", "-", "*", "/")
_OP_WEIGHTS = (4, 3, 3, 1)  # division rarely leaves an integer; keep it rare


def _random_expression(nums: List[int], rng: random.Random) -> Tuple[str, Optional[Fraction]]:
    """Combine the numbers pairwise at random into one expression and its exact value."""
    items = [(str(n), Fraction(n)) for n in nums]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ea, va), (eb, vb) = items[i], items[j]
        for k in sorted((i, j), reverse=True):
            items.pop(k)
        op = rng.choices(_OPS, weights=_OP_WEIGHTS)[0]
        if op == "/" and vb == 0:
            return "", None
        value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else None}[op]
        items.append((f"({ea} {op} {eb})", value))
    expr, value = items[0]
    return (expr[1:-1] if expr.startswith("(") else expr), value


def make_countdown(n: int = 400, seed: int = 1234, max_number: int = 9,
                   max_target: int = 50) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    rows, seen = [], set()
    for _ in range(100 * n):
        if len(rows) == n:
            break
        nums = [rng.randint(1, max_number) for _ in range(3)]
        expr, value = _random_expression(nums, rng)
        if value is None or value.denominator != 1 or not 1 <= value <= max_target:
            continue
        target = int(value)
        key = (tuple(sorted(nums)), target)
        if key in seen:
            continue
        seen.add(key)
        rows.append({
            "messages": [{"role": "system", "content": COUNTDOWN_SYSTEM},
                         {"role": "user", "content": f"Numbers: {' '.join(map(str, nums))}. Target: {target}."}],
            "nums": nums, "target": target, "solution": expr,
        })
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} distinct countdown problems found; ask for fewer")
    return rows


def make_arithmetic(n: int = 200, seed: int = 1234) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    problems = [(a, op, b) for a in range(10) for b in range(10) for op in "+-*"
                if not (op == "-" and a < b)]
    if n > len(problems):
        raise ValueError(f"at most {len(problems)} distinct arithmetic problems; asked for {n}")
    rows = []
    for a, op, b in rng.sample(problems, n):
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"query": f"What is {a} {op} {b}?", "solution": str(value)})
    return rows
