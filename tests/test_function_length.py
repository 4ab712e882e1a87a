"""Functions stay short: at most MAX_LINES lines (from `def` to the last line, docstring
included), so each reads as one step with a name. A longer one is split into named
steps. LONGER holds the functions that were longer when the rule came in, each with a
ceiling (its length then): a listed function may not grow past its ceiling, and the list
may only shrink (an entry whose function is gone or now within the limit fails until it
is dropped). Lower a ceiling when a function shrinks."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_grpo", "bridge")
MAX_LINES = 80

# qualified name -> ceiling in lines (lower it, or drop the entry, on a split)
LONGER = {
    "megatron_grpo.model.config.build_transformer_config": 125,
    "megatron_grpo.rollout.colocate.ColocateEngine.__init__": 106,
    "megatron_grpo.cli._rlhf": 82,
}


def _function_lengths(path: str, module: str) -> dict[str, int]:
    """Qualified name (module.Class.function, nested functions under their parent) -> lines."""
    out: dict[str, int] = {}

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, name)
            else:
                visit(child, prefix)

    visit(ast.parse(open(path).read()), module)
    return out


def _all_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    lengths.update(_function_lengths(path, module.removesuffix(".__init__")))
    return lengths


def _problems(lengths: dict[str, int], longer: dict[str, int], limit: int) -> list[str]:
    """What breaks the rule: functions over `limit` not in `longer`, listed ones past their
    ceiling, and listed ones that are gone or now within the limit (their entry should go)."""
    bad = [f"{name}: {n} lines (at most {limit}; split it into named steps)"
           for name, n in sorted(lengths.items()) if n > limit and name not in longer]
    for name, was in sorted(longer.items()):
        n = lengths.get(name)
        if n is None or n <= limit:
            bad.append(f"{name}: {'gone' if n is None else f'{n} lines now'}; drop it from LONGER")
        elif n > was:
            bad.append(f"{name}: {n} lines, longer than the {was} of LONGER (it may only shrink)")
    return bad


def test_functions_are_at_most_max_lines():
    bad = _problems(_all_lengths(), LONGER, MAX_LINES)
    assert not bad, "function lengths:\n" + "\n".join(bad)


def test_length_rule_can_fail(tmp_path):
    """The rule reports a new long function, a listed one that grew, and a stale entry;
    nested functions count under their parent, methods under their class."""
    f = tmp_path / "m.py"
    f.write_text("class C:\n    def m(self):\n        def inner():\n            pass\n"
                 "        return 1\n\n\ndef g():\n" + "    x = 1\n" * 5)
    lengths = _function_lengths(str(f), "p.m")
    assert lengths == {"p.m.C.m": 4, "p.m.C.m.inner": 2, "p.m.g": 6}
    assert _problems(lengths, {"p.m.C.m": 4}, 5) == [
        "p.m.g: 6 lines (at most 5; split it into named steps)",
        "p.m.C.m: 4 lines now; drop it from LONGER"]
    assert _problems(lengths, {"p.m.g": 5, "p.m.h": 9}, 5) == [
        "p.m.g: 6 lines, longer than the 5 of LONGER (it may only shrink)",
        "p.m.h: gone; drop it from LONGER"]
