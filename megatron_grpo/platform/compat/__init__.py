"""Every name megatron-grpo takes from vLLM or Megatron-Core beyond their public API,
in one module per library: `compat/vllm.py` and `compat/megatron.py`.

Why: private helpers, internal modules and monkeypatches are what a library upgrade
breaks. Kept here, an upgrade means reading two files instead of hunting through
the package. Each module

- wraps every such use in a small named function whose docstring says what it does,
  why the public API does not do it, and on which versions it was checked;
- lists the names in `PRIVATE_NAMES` ("module:attribute.path"): tests/test_platform_compat.py
  resolves each against the installed version, and checks that no other module of
  the package spells a private vLLM / Megatron name;
- knows the version range it was verified on and, at its first use, raises
  `UntestedVersionError` on any other version (set MEGATRON_GRPO_ALLOW_UNTESTED=1 to go
  on anyway, with a warning).

Nothing here imports vLLM or Megatron at module level (the package must import
where they are not installed, and option errors must come before the heavy imports).
"""
from __future__ import annotations

import importlib
import os
import re
import warnings
from typing import Any, Tuple

ALLOW_UNTESTED_ENV = "MEGATRON_GRPO_ALLOW_UNTESTED"


class UntestedVersionError(RuntimeError):
    """An installed vLLM / Megatron-Core version the compatibility layer was not checked on."""


def parse_version(text: str) -> Tuple[int, ...]:
    """(major, minor[, patch]) of a version string; () when it has no numeric prefix
    ("0.32.0+cpu" -> (0, 32, 0); "dev" -> ())."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        return ()
    return tuple(int(g) for g in m.groups() if g is not None)


def check_version(library: str, version: str, lower: Tuple[int, ...], upper: Tuple[int, ...],
                  verified: str, module: str) -> None:
    """Raise UntestedVersionError unless lower <= version < upper (or the escape hatch is set)."""
    parsed = parse_version(version)
    if parsed and lower <= parsed < upper:
        return
    span = f">={'.'.join(map(str, lower))},<{'.'.join(map(str, upper))}"
    what = (f"{library} {version} is outside the versions megatron-grpo's compatibility "
            f"layer was checked on ({span}; verified on {verified}): the non-public {library} "
            f"names it uses (megatron_grpo/platform/compat/{module}.py) may have changed.")
    if os.environ.get(ALLOW_UNTESTED_ENV, "") == "1":
        warnings.warn(f"{what} Going on because {ALLOW_UNTESTED_ENV}=1.", RuntimeWarning,
                      stacklevel=3)
        return
    raise UntestedVersionError(
        f"{what} Install a version in {span}, or set {ALLOW_UNTESTED_ENV}=1 to try anyway "
        "(then run tests/test_platform_compat.py to see which names still resolve).")


def resolve(name: str) -> Any:
    """The object a PRIVATE_NAMES entry "package.module:Attr.path" names (raises
    ImportError / AttributeError when it is gone)."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj
