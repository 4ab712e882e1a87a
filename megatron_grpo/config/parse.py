"""Flat ms-swift style command lines and YAML files -> values for the option groups.

    --tensor_model_parallel_size 2 --use_vllm true --reward_funcs accuracy format
    --dataset a.jsonl b.jsonl#100 --reward_weights 1 0.5 --config run.yaml

A flag takes every following token up to the next `--flag` (so negative numbers
such as `--reward_weights 1 -0.5` are values); `--flag=value` works too, and a
bare boolean flag means true. `--config file.yaml` is read first, whatever its
position, and the other flags override it. The YAML holds the same flat keys
(`tensor_model_parallel_size: 2`), or group sections (`parallel: {...}`).
"""
from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import MISSING, fields
from typing import Any, Dict, Iterable, List, Literal, Optional, Sequence, Tuple

from .errors import Problems
from .groups import ALIASES, bad_choice, literal_choices
from .swift_flags import rejection

_TRUE = {"true", "1", "yes", "y", "on", "t"}
_FALSE = {"false", "0", "no", "n", "off", "f"}
_NONE = {"none", "null", "~"}


class FieldInfo(typing.NamedTuple):
    group: str        # attribute of the root config holding the group
    name: str         # flag name without dashes
    annotation: Any   # resolved type hint
    help: str
    default: Any      # the default value (a fresh one for default_factory fields)


def field_table(groups: Dict[str, type]) -> Dict[str, FieldInfo]:
    """flag name -> FieldInfo for every field of every group; names must be unique."""
    table: Dict[str, FieldInfo] = {}
    for group_name, cls in groups.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if not f.init:         # derived state (e.g. ExportConfig.dims), not an option
                continue
            if f.name in table:
                raise RuntimeError(f"option {f.name} is defined in two groups")
            default = f.default if f.default is not MISSING else f.default_factory()
            table[f.name] = FieldInfo(group_name, f.name, hints[f.name],
                                      f.metadata.get("help", ""), default)
    return table


def _strip_optional(annotation: Any) -> Tuple[Any, bool]:
    """(inner type, whether None is allowed) of Optional[X]."""
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def is_list(annotation: Any) -> bool:
    inner, _ = _strip_optional(annotation)
    return typing.get_origin(inner) in (list, List)


def is_bool(annotation: Any) -> bool:
    inner, _ = _strip_optional(annotation)
    return inner is bool


def _bad(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"--{name} {value!r} is not valid: expected {expected}. "
                      f"Fix: e.g. --{name} <{expected}>")


def _scalar(name: str, value: Any, kind: Any) -> Any:
    """Convert one scalar (a CLI string or a YAML value) to `kind`."""
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        # CLI strings of int choices (sleep_level 1): compare on the choice's type.
        for c in choices:
            if value == c or (isinstance(value, str) and not isinstance(c, str) and value == str(c)):
                return c
        if isinstance(value, str) and all(type(c) is int for c in choices):
            try:
                return int(value)  # an int out of range: check_choices shows it as such
            except ValueError:
                pass
        return value  # left for check_choices, which lists the choices
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _bad(name, value, "true or false")
    if kind is int:
        if isinstance(value, bool):
            raise _bad(name, value, "an integer")
        if isinstance(value, int):
            return value
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise _bad(name, value, "an integer") from None
        if not as_float.is_integer():
            raise _bad(name, value, "an integer")
        return int(as_float)
    if kind is float:
        if isinstance(value, bool):
            raise _bad(name, value, "a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise _bad(name, value, "a number") from None
    if kind is str:
        if isinstance(value, (dict, list)):
            raise _bad(name, value, "a string")
        return str(value)
    if typing.get_origin(kind) in (dict, Dict):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError):
            raise _bad(name, value, "a JSON object such as '{\"key\": \"value\"}'") from None
        if not isinstance(parsed, dict):
            raise _bad(name, value, "a JSON object such as '{\"key\": \"value\"}'")
        return parsed
    return value  # Any


def convert(name: str, value: Any, annotation: Any) -> Any:
    """Convert a CLI token list / string or a YAML value to the field's type."""
    inner, optional = _strip_optional(annotation)
    # `none` is a value of its own where it is one of the choices (--scale_rewards none,
    # --report_to none), not the "unset" of an Optional option.
    none_is_choice = "none" in (literal_choices(annotation) or ())
    if isinstance(value, list) and not is_list(annotation):
        if len(value) != 1:
            raise ValueError(f"--{name} takes one value, got {len(value)}: {value!r}. "
                             f"Fix: pass a single value, e.g. --{name} {value[0] if value else 'X'}")
        value = value[0]
    if value is None or (optional and not none_is_choice and isinstance(value, str)
                         and value.strip().lower() in _NONE):
        if optional or is_list(annotation):
            return None if optional else []
        raise _bad(name, value, "a value (this option cannot be none)")
    if typing.get_origin(inner) in (list, List):
        (item_type,) = typing.get_args(inner)
        items = value if isinstance(value, list) else [value]
        return [_scalar(name, v, item_type) for v in items]
    return _scalar(name, value, inner)


class UnknownOption(ValueError):
    """An option name that is neither a field nor an alias; `suggestion`: the closest name.

    An ms-swift flag this project does not support yet gets its own line naming the
    feature it belongs to (swift_flags.py), and no suggestion: it is not a typo."""

    def __init__(self, name: str, close: List[str]):
        unsupported = rejection(name)
        if unsupported:
            self.suggestion = None
            super().__init__(unsupported)
            return
        self.suggestion = ALIASES.get(close[0], close[0]) if close else None
        hint = f" Did you mean: {', '.join('--' + c for c in close)}?" if close else ""
        super().__init__(f"unknown option --{name}.{hint} Run with --help for the full list.")


def canonical_name(name: str, table: Dict[str, FieldInfo]) -> str:
    """The option `name` (or an alias) refers to; UnknownOption with suggestions if none."""
    name = name.replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in table:
        raise UnknownOption(name, difflib.get_close_matches(name, list(table) + list(ALIASES),
                                                            n=3, cutoff=0.6))
    return name


def split_argv(argv: Sequence[str], problems: Optional[Problems] = None
               ) -> Tuple[Optional[str], List[Tuple[str, List[str]]]]:
    """(config file or None, [(flag name, raw values)]) from a command line; a stray token
    is recorded in `problems` (raised at once without it) and skipped."""
    p = Problems() if problems is None else problems
    items: List[Tuple[str, List[str]]] = []
    config_path = None
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or tok == "--":
            p.add(f"unexpected argument {tok!r} at position {i}: options are written "
                  "--name value (e.g. --model /path/to/model)")
            i += 1
            continue
        key, eq, inline = tok[2:].partition("=")
        values: List[str] = [inline] if eq else []
        i += 1
        if not eq:
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        if key == "config":
            if len(values) != 1:
                p.add("--config takes one YAML file path, e.g. --config run.yaml")
            else:
                config_path = values[0]
        else:
            items.append((key, values))
    if problems is None:
        p.raise_if_any()
    return config_path, items


def load_yaml(path: str, group_names: Iterable[str]) -> Dict[str, Any]:
    """Flat {option: value} from a YAML file of flat keys and/or group sections."""
    import yaml  # only with --config: the CLI parent's start-up without it skips this

    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: file not found. Fix: pass an existing YAML file")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of option: value, "
                         f"not a {type(data).__name__}")
    flat: Dict[str, Any] = {}
    group_names = set(group_names)
    for key, value in data.items():
        # `model` is both a group and an option: a mapping means the group section.
        if key in group_names and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _checked(name: str, raw: Any, info: FieldInfo, p: Problems) -> Tuple[bool, Any]:
    """(usable, value): `raw` converted to the option's type and within its choices."""
    try:
        value = convert(name, raw, info.annotation)
    except ValueError as e:
        p.add(str(e), drop=name)
        return False, None
    message = bad_choice(name, value, info.annotation)
    if message:
        p.add(message, drop=name)
        return False, None
    return True, value


def _lookup(key: str, table: Dict[str, FieldInfo], p: Problems, suggested: List[str]
            ) -> Optional[str]:
    try:
        return canonical_name(key, table)
    except UnknownOption as e:
        p.add_unknown(str(e))
        if e.suggestion:
            suggested.append(e.suggestion)
        return None


def collect_values(argv: Sequence[str], table: Dict[str, FieldInfo],
                   group_names: Iterable[str], problems: Optional[Problems] = None
                   ) -> Dict[str, Any]:
    """{option: converted value} from YAML (if --config) overridden by the flags.

    Every unknown flag, malformed value and choice not allowed goes into `problems`
    (that option is then left out); without `problems` they are raised together.
    """
    p = Problems() if problems is None else problems
    config_path, items = split_argv(argv, p)
    values: Dict[str, Any] = {}
    suggested: List[str] = []       # what the unknown flags probably meant
    if config_path is not None:
        overridden = set()           # options the flags set: the file's value does not count
        for key, _ in items:
            try:
                overridden.add(canonical_name(key, table))
            except UnknownOption:
                pass
        try:
            from_yaml = load_yaml(config_path, group_names)
        except ValueError as e:
            p.add(str(e))
            from_yaml = {}
        spelled: Dict[str, str] = {}
        for key, raw in from_yaml.items():
            name = _lookup(str(key), table, p, suggested)
            if name is None:
                continue
            if name in spelled:
                p.add(f"--config {config_path!r} sets {name} twice (as {spelled[name]!r} "
                      f"and {key!r}). Fix: keep one of them")
                continue
            spelled[name] = str(key)
            if name in overridden:
                continue
            ok, value = _checked(name, raw, table[name], p)
            if ok:
                values[name] = value
    for key, raw in items:
        name = _lookup(key, table, p, suggested)
        if name is None:
            continue
        info = table[name]
        if not raw:
            if is_bool(info.annotation):
                raw = ["true"]  # a bare boolean flag
            elif not is_list(info.annotation):
                p.add(f"--{name} needs a value. Fix: e.g. --{name} <value>", drop=name)
                continue
        ok, value = _checked(name, raw, info, p)    # a bare list flag: []
        if ok:
            values[name] = value
    # A misspelt flag stands for the option it resembles, whose default now stands in for
    # the user's value: later checks of that option would report the default, not the user.
    p.dropped.update(name for name in suggested if name not in values)
    if problems is None:
        p.raise_if_any()
    return values


def parse_command(cls: type, argv: Sequence[str], prog: str, group: str,
                  problems: Optional[Problems] = None) -> Any:
    """`cls(**options)` for a command whose options are one dataclass (`megatron rollout`,
    `megatron export`): `--help` prints them and exits; every unknown flag, bad value and
    failed check of `cls.__post_init__` (with those already in `problems`) in one ConfigError."""
    groups = {group: cls}
    if "-h" in argv or "--help" in argv:
        print(format_help(groups, prog=prog))
        raise SystemExit(0)
    p = Problems() if problems is None else problems
    values = collect_values(argv, field_table(groups), groups, p)
    cfg = None
    try:
        cfg = cls(**values)
    except ValueError as e:
        p.add(e)
    p.raise_if_any()
    return cfg


def format_help(groups: Dict[str, type], prog: str = "megatron rlhf --rlhf_type grpo") -> str:
    """Every option by group, with its type, default and help."""
    table = field_table(groups)
    lines = [f"usage: {prog} [--config FILE.yaml] [--option value ...]", ""]
    for group_name, cls in groups.items():
        lines.append(f"{group_name}: {(cls.__doc__ or '').strip()}")
        for info in table.values():
            if info.group != group_name:
                continue
            choices = literal_choices(info.annotation)
            kind = ("{" + ",".join(map(str, choices)) + "}") if choices else _type_name(info.annotation)
            lines.append(f"  --{info.name} {kind}  (default: {info.default!r})")
            lines.append(f"      {info.help}")
        lines.append("")
    aliases = ", ".join(f"--{a} = --{b}" for a, b in ALIASES.items())
    lines.append(f"aliases: {aliases}")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    inner, _ = _strip_optional(annotation)
    if typing.get_origin(inner) in (list, List):
        return f"{_type_name(typing.get_args(inner)[0])} ..."
    if typing.get_origin(inner) in (dict, Dict):
        return "JSON"
    return getattr(inner, "__name__", str(inner)).upper()
