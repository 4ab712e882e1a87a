"""`math`: ms-swift's MathORM, 1.0 when the boxed answer equals the ground truth.

For the completion and the `ground_truths` column (ms-swift's name; `solution` when
that column is absent):
1. keep what follows `# Answer` if present, strip;
2. take the content of the first `\\boxed{...}` (no nested braces), else the text;
3. clean: drop `\\(`, `\\)`, `\\[`, `\\]` and every brace (`}}` first becomes `}`);
4. equal cleaned strings score 1.0; otherwise both are parsed with sympy's LaTeX parser
   and simplified, and score 1.0 when sympy says they are equal. sympy's parser needs
   `antlr4-python3-runtime` 4.11; without it (math-verify pins 4.13) a failed parse
   scores 0.0, as in ms-swift, so only step 4's string equality decides.
Use `accuracy` (math-verify) for robust equivalence; `math` exists so that ms-swift
scripts naming it score the same way.
"""
from __future__ import annotations

import re
from typing import Any, List, Optional

from .registry import register_reward

_BOXED = re.compile(r"\\boxed{([^}]*)}")
_DELIMITERS = re.compile(r"\\\(|\\\)|\\\[|\\]")


def boxed_or_text(text: str) -> str:
    found = _BOXED.search(text)
    return found.group(1).strip() if found else text


def clean_latex(text: str) -> str:
    text = _DELIMITERS.sub("", text)
    return text.replace("}}", "}").replace("{", "").replace("}", "").strip()


def _sympy_expr(latex: str) -> Optional[Any]:
    try:
        from sympy import simplify
        from sympy.parsing.latex import parse_latex
        return simplify(parse_latex(latex))
    except Exception:  # no/mismatched antlr4, or not LaTeX sympy can read
        return None


def same_answer(prediction: str, truth: str) -> bool:
    a, b = clean_latex(prediction), clean_latex(truth)
    if a == b:
        return True
    ea, eb = _sympy_expr(a), _sympy_expr(b)
    if ea is None or eb is None:
        return False
    try:
        same = ea.equals(eb) if hasattr(ea, "equals") and hasattr(eb, "equals") else ea == eb
    except Exception:
        return False
    return bool(same)  # equals() may answer None (undecided): not equal


def _answer_part(text: str) -> str:
    if "# Answer" in text:
        text = text.split("# Answer")[1]
    return boxed_or_text(text.strip())


@register_reward("math")
def math_reward(completions: List[str], ground_truths: Optional[List[Any]] = None,
                **kwargs: Any) -> List[float]:
    if ground_truths is None:
        ground_truths = kwargs.get("solution")
    if ground_truths is None:
        raise ValueError("the math reward needs a `ground_truths` (or `solution`) dataset column")
    return [float(same_answer(_answer_part(c), _answer_part(str(t)))) for c, t in zip(completions, ground_truths)]
