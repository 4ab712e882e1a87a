"""Flat ms-swift style command lines and YAML files -> values for the option groups.

    --tensor_model_parallel_size 2 --use_vllm true --reward_funcs accuracy format
    --dataset a.jsonl b.jsonl#100 --reward_weights 1 0.5 --config run.yaml

The command line is parsed by the standard library's argparse, from one argument per
option (built from the dataclass fields: name, aliases, `-` spellings, help). Each option
takes every following token up to the next `--flag` (nargs="*"; a token that starts with
a single dash, such as `-1e-5`, is a value too), and the tokens are then converted
here, so that every malformed value, unknown flag and choice not allowed is collected
(errors.py) rather than argparse's stop at the first. `--flag=value` works too, and a bare
boolean flag means true. `--config file.yaml` is read first, whatever its position, and
the other flags override it. The YAML holds the same flat keys
(`tensor_model_parallel_size: 2`), or group sections (`parallel: {...}`).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Sequence, Tuple

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


_DASH = "\0"   # marks a token that starts with one dash, so argparse takes it as a value


def _mark(tok: str) -> str:
    """`--tensor-model-parallel-size` (ms-swift's other spelling) as
    `--tensor_model_parallel_size`; `-1e-5` or `-x` marked as a value, not a flag (`-h`,
    like `--help`, prints the help and exits)."""
    if tok.startswith("--"):
        key, eq, value = tok[2:].partition("=")
        return "--" + key.replace("-", "_") + eq + value
    return _DASH + tok if tok.startswith("-") and tok != "-h" else tok


class _Formatter(argparse.HelpFormatter):
    """Options as `--name TYPE`, without argparse's `[TYPE ...]` of nargs="*"; 100 columns
    whatever the terminal, so the help reads the same in a file, a pipe or a test."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=100, max_help_position=36)

    def _format_args(self, action, default_metavar):
        return action.metavar or default_metavar


def build_parser(groups: Dict[str, type], prog: str) -> argparse.ArgumentParser:
    """An argparse parser with one argument per option (and --config), by group: each keeps
    its raw tokens (a list, absent when not given) for `collect_values` to convert."""
    parser = argparse.ArgumentParser(prog=prog, usage=f"{prog} [--config FILE.yaml] "
                                     "[--option value ...]", allow_abbrev=False,
                                     formatter_class=_Formatter, exit_on_error=False)
    parser.add_argument("--config", nargs="*", default=argparse.SUPPRESS, metavar="FILE.yaml",
                        help="YAML file of options (flat keys or group sections), read first; "
                             "the other flags override it.")
    aliases: Dict[str, List[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    table = field_table(groups)
    for group_name, cls in groups.items():
        section = parser.add_argument_group(group_name, (cls.__doc__ or "").strip())
        for info in table.values():
            if info.group == group_name:
                choices = literal_choices(info.annotation)
                kind = ("{" + ",".join(map(str, choices)) + "}") if choices else \
                    _type_name(info.annotation)
                text = f"{info.help} (default: {info.default!r})".replace("%", "%%")
                section.add_argument(*(f"--{n}" for n in [info.name, *aliases.get(info.name, ())]),
                                     dest=info.name, nargs="*", default=argparse.SUPPRESS,
                                     metavar=kind, help=text)
    return parser


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser, p: Problems
               ) -> Tuple[Dict[str, List[str]], List[Tuple[str, str]]]:
    """({option: its raw tokens}, [(unknown flag, it and its tokens as given)]) as `parser`
    splits `argv`, aliases resolved; a token before any flag is recorded in `p`."""
    unexpected = ("unexpected argument {!r}: options are written --name value "
                  "(e.g. --model /path/to/model)")
    if "--" in argv:      # argparse would take every flag after it for a positional argument
        p.add(unexpected.format("--"))
    try:
        known, extras = parser.parse_known_args([_mark(t) for t in argv if t != "--"])
    except argparse.ArgumentError as e:    # not expected with nargs="*"; reported, not raised
        p.add(str(e))
        return {}, []
    unknown: List[Tuple[str, str]] = []
    for tok in (t.removeprefix(_DASH) for t in extras):
        if tok.startswith("--"):
            unknown.append((tok[2:].partition("=")[0], tok))
        elif unknown:
            unknown[-1] = (unknown[-1][0], f"{unknown[-1][1]} {tok}")
        else:
            p.add(unexpected.format(tok))
    return {k: [t.removeprefix(_DASH) for t in v] for k, v in vars(known).items()}, unknown


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


def collect_values(argv: Sequence[str], groups: Dict[str, type],
                   problems: Optional[Problems] = None,
                   prog: str = "megatron rlhf --rlhf_type grpo",
                   refuse: Callable[[str, str], Optional[str]] = lambda name, given: None
                   ) -> Dict[str, Any]:
    """{option: converted value} from YAML (if --config) overridden by the flags; `-h` or
    `--help` prints the help of `prog` and exits. `refuse(name, flag as given)`: the message
    for a flag the command has not but names a reason for (instead of "unknown option").

    Every unknown flag, malformed value and choice not allowed goes into `problems`
    (that option is then left out); without `problems` they are raised together.
    """
    p = Problems() if problems is None else problems
    table = field_table(groups)
    flags, unknown = split_argv(argv, build_parser(groups, prog), p)
    config = flags.pop("config", None)
    values: Dict[str, Any] = {}
    suggested: List[str] = []       # what the unknown flags probably meant
    if config is not None and len(config) != 1:
        p.add("--config takes one YAML file path, e.g. --config run.yaml")
    elif config is not None:
        try:
            from_yaml = load_yaml(config[0], groups)
        except ValueError as e:
            p.add(str(e))
            from_yaml = {}
        spelled: Dict[str, str] = {}
        for key, raw in from_yaml.items():
            name = _lookup(str(key), table, p, suggested)
            if name is None:
                continue
            if name in spelled:
                p.add(f"--config {config[0]!r} sets {name} twice (as {spelled[name]!r} "
                      f"and {key!r}). Fix: keep one of them")
                continue
            spelled[name] = str(key)
            if name not in flags:      # a flag overrides the file
                ok, value = _checked(name, raw, table[name], p)
                if ok:
                    values[name] = value
    for key, given in unknown:
        reason = refuse(key, given)
        if reason:
            p.add(reason)
        else:
            _lookup(key, table, p, suggested)
    for name, raw in flags.items():
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
                  refuse: Callable[[str, str], Optional[str]] = lambda name, given: None) -> Any:
    """`cls(**options)` for a command whose options are one dataclass (`megatron rollout`,
    `megatron export`): `--help` prints them and exits; every unknown flag (or `refuse`d
    one, see collect_values), bad value and failed check of `cls.__post_init__` in one
    ConfigError."""
    p = Problems()
    values = collect_values(argv, {group: cls}, p, prog, refuse)
    cfg = None
    try:
        cfg = cls(**values)
    except ValueError as e:
        p.add(e)
    p.raise_if_any()
    return cfg


def format_help(groups: Dict[str, type], prog: str = "megatron rlhf --rlhf_type grpo") -> str:
    """Every option by group, with its type, default, aliases and help (argparse's layout)."""
    return build_parser(groups, prog).format_help()


def _type_name(annotation: Any) -> str:
    inner, _ = _strip_optional(annotation)
    if typing.get_origin(inner) in (list, List):
        return f"{_type_name(typing.get_args(inner)[0])} ..."
    if typing.get_origin(inner) in (dict, Dict):
        return "JSON"
    return getattr(inner, "__name__", str(inner)).upper()
