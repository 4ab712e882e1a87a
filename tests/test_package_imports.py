"""The package's import structure: `bridge/` is a library that imports nothing
from `megatron_grpo`, and no two modules import each other, not even through an import
inside a function (a cycle hidden that way still ties the modules together)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_grpo", "bridge")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for both packages."""
    mods = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: str, mods: dict[str, str],
             typing_blocks: bool = False) -> dict[str, int]:
    """Modules of the packages that `name` imports anywhere (module level or inside a
    function; `if TYPE_CHECKING:` blocks only with `typing_blocks`) -> the line of the first
    such import."""
    tree = ast.parse(open(path).read())
    typing_only = set() if typing_blocks else {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body for n in ast.walk(stmt)}
    is_pkg = path.endswith("__init__.py")
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            # a module importing its own package's __init__ is not an edge of interest
            if t and t != name and not name.startswith(t + "."):
                found.setdefault(t, node.lineno)
    return found


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_bridge_imports_nothing_from_megatron_grpo():
    mods = _modules()
    bad = [f"{name} line {line}" for name, path in mods.items() if name.startswith("bridge")
           for target, line in _imports(name, path, mods).items()
           if target.startswith("megatron_grpo")]
    assert not bad, "bridge/ imports megatron_grpo: " + "; ".join(bad)
    # And at run time: importing every bridge module loads no megatron_grpo module.
    names = sorted(n for n in mods if n.startswith("bridge"))
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names) +
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron_grpo'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_no_import_cycles():
    """No cycle, counting the imports under `if TYPE_CHECKING:` as well: a cycle that only
    type annotations close still means neither module can be read (or moved) without the
    other; the type both need belongs in a third module (bridge/groups.py)."""
    mods = _modules()
    edges = {name: _imports(name, path, mods, typing_blocks=True) for name, path in mods.items()}
    described = [" <-> ".join(c) + ": " + ", ".join(
        f"{a} imports {b} (line {edges[a][b]})" for a in c for b in edges[a] if b in c)
        for c in _cycles(edges)]
    assert not described, "import cycles:\n" + "\n".join(described)


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module cycle hidden in a function is reported."""
    edges = {"a": {"b": 3}, "b": {"a": 9}, "c": {"a": 1}}
    assert _cycles(edges) == [["a", "b"]]


def test_cycle_edges_include_type_checking_imports(tmp_path):
    """An import under `if TYPE_CHECKING:` is an edge of the cycle check (and, without
    `typing_blocks`, not one of the run-time check that bridge/ loads no megatron_grpo)."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    mods = {"p.m": str(f), "p.b": str(f)}
    assert _imports("p.m", str(f), mods, typing_blocks=True) == {"p.b": 3}
    assert _imports("p.m", str(f), mods) == {}


# Libraries that may be imported inside a function without a comment: heavy ones (an import
# costs seconds and the CLI parent or a CPU run never needs them) and optional ones (a run
# without the feature must not need them installed). Anything else there (our own modules,
# the standard library, light dependencies) needs a reason: a comment on the import's line or
# the line above its block of imports, an enclosing `if`/`try` (a conditional or optional import), or a module
# comment starting with "# Function-level imports:" (cli.py: each command imports its own).
LAZY_LIBRARIES = {
    "torch", "megatron", "vllm", "transformers", "safetensors", "tokenizers", "torchvision",
    "PIL", "datasets", "pyarrow", "matplotlib", "triton",                      # heavy
    "sympy", "math_verify", "fastapi", "uvicorn", "uvloop", "wandb", "swanlab",  # optional
    "tensorboard", "peft",
}
MODULE_REASON = "# Function-level imports:"


def _unexplained_function_imports(path: str) -> list[str]:
    """`path:line: statement` of each import inside a function that the rule above refuses."""
    src = open(path).read()
    lines = src.splitlines()
    if any(line.startswith(MODULE_REASON) for line in lines):
        return []
    bad = []

    def visit(node, in_function: bool, conditional: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, True, False)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                if isinstance(child, ast.Import):
                    top = child.names[0].name.split(".")[0]
                else:
                    top = "" if child.level else (child.module or "").split(".")[0]
                line = lines[child.lineno - 1]
                i = child.lineno - 2    # the line above this block of imports
                while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
                    i -= 1
                above = lines[i].strip() if i >= 0 else ""
                explained = (top in LAZY_LIBRARIES or conditional or "#" in line
                             or above.startswith("#"))
                if not explained:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{child.lineno}: {line.strip()}")
            else:
                visit(child, in_function,
                      conditional or (in_function and isinstance(child, (ast.If, ast.Try))))

    visit(ast.parse(src), False, False)
    return bad


def test_imports_inside_functions_are_heavy_optional_or_explained():
    """docs/architecture.md's rule: imports sit at module level; inside a function only a
    heavy or optional library, or with a reason (start-up time, a cycle, a conditional)."""
    bad = [b for path in _modules().values() for b in _unexplained_function_imports(path)]
    assert not bad, ("imports inside functions without a reason (move them to the top of the "
                     "module, or say why in a comment):\n" + "\n".join(bad))


def test_import_rule_refuses_an_unexplained_import(tmp_path):
    """The rule can fail: our own module and a light library imported in a function without
    a reason are reported; a heavy library, a commented one and a conditional one are not."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from . import a\n    import json\n    import torch\n"
                 "    import yaml  # only with --config\n    if x:\n        import b\n"
                 "    # a cycle\n    from . import c\n    from . import d\n")
    assert [b.split(": ", 1)[1] for b in _unexplained_function_imports(str(f))] == \
        ["from . import a", "import json"]
