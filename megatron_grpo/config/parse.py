"""Flat ms-swift style command lines and YAML files -> values for the option groups.

    --tensor_model_parallel_size 2 --use_vllm true --reward_funcs accuracy format
    --dataset a.jsonl b.jsonl#100 --reward_weights 1 0.5 --config run.yaml

argparse splits the command line, from one argument per option built from the dataclass
fields (name, aliases, help). Each option takes every token up to the next `--flag`
(`-1e-5` is a value), `--flag=value` and `--a-b` work, and a bare boolean flag means true.
The tokens are converted here, so that every malformed value, unknown flag and choice not
allowed is collected (errors.py) instead of argparse's stop at the first. `--config
file.yaml` (flat keys, or group sections `parallel: {...}`) is read first, wherever it
stands; the flags override it.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple

from .errors import Problems
from .groups import ALIASES, bad_choice, literal_choices
from .swift_flags import OFF_HERE, rejection

_TRUE = {"true", "1", "yes", "y", "on", "t"}
_FALSE = {"false", "0", "no", "n", "off", "f"}
_NONE = {"none", "null", "~"}


class FieldInfo(typing.NamedTuple):
    group: str        # attribute of the root config holding the group
    name: str         # flag name without dashes
    annotation: Any   # resolved type hint
    help: str
    default: Any      # the default value (a fresh one for default_factory fields)
    # `none` is a value of its own, not the "unset" of an Optional option: where it is one of
    # the choices (--scale_rewards none, --report_to none) or the field says so (--resume).
    none_is_value: bool = False


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
            none_is_value = (f.metadata.get("none_is_value", False)
                             or "none" in (literal_choices(hints[f.name]) or ()))
            table[f.name] = FieldInfo(group_name, f.name, hints[f.name],
                                      f.metadata.get("help", ""), default, none_is_value)
    return table


def _unwrap(annotation: Any) -> Tuple[Any, bool, bool]:
    """(item type, None allowed, a list) of an option's type: Optional[List[int]] -> int."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation, optional = args[0], True
    many = typing.get_origin(annotation) is list
    return (typing.get_args(annotation)[0] if many else annotation), optional, many


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in _TRUE | _FALSE:
        raise ValueError(value)
    return text in _TRUE


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = _to_float(value)            # "1e3" or 2.0 as a count: fine; 2.5: not
    if not number.is_integer():
        raise ValueError(value)
    return int(number)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def _to_str(value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise ValueError(value)
    return str(value)


def _to_dict(value: Any) -> dict:
    parsed = value if isinstance(value, dict) else json.loads(value)
    if not isinstance(parsed, dict):
        raise ValueError(value)
    return parsed


# type -> (converter raising ValueError/TypeError, what a value must be)
_CONVERT = {bool: (_to_bool, "true or false"), int: (_to_int, "an integer"),
            float: (_to_float, "a number"), str: (_to_str, "a string"),
            dict: (_to_dict, "a JSON object such as '{\"key\": \"value\"}'")}


def _scalar(name: str, value: Any, kind: Any) -> Any:
    """One scalar (a CLI string or a YAML value) as `kind`."""
    if typing.get_origin(kind) is Literal:   # left as is when not a choice: bad_choice lists them
        choices = typing.get_args(kind)
        for c in choices:                    # CLI strings of int choices (sleep_level 1)
            if value == c or (isinstance(value, str) and not isinstance(c, str) and value == str(c)):
                return c
        if isinstance(value, str) and all(type(c) is int for c in choices):
            try:
                return int(value)
            except ValueError:
                pass
        return value
    converter, expected = _CONVERT.get(typing.get_origin(kind) or kind, (None, ""))
    if converter is None:                    # Any
        return value
    try:
        return converter(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{name} {value!r} is not valid: expected {expected}. "
                         f"Fix: e.g. --{name} <{expected}>") from None


def convert(info: FieldInfo, value: Any) -> Any:
    """A CLI token list / string or a YAML value as the type of option `info`."""
    name = info.name
    kind, optional, many = _unwrap(info.annotation)
    if isinstance(value, list) and not many:
        if len(value) != 1:
            raise ValueError(f"--{name} takes one value, got {len(value)}: {value!r}. "
                             f"Fix: pass a single value, e.g. --{name} {value[0] if value else 'X'}")
        value = value[0]
    if value is None or (optional and not info.none_is_value and isinstance(value, str)
                         and value.strip().lower() in _NONE):
        if optional or many:
            return None if optional else []
        expected = "a value (this option cannot be none)"
        raise ValueError(f"--{name} {value!r} is not valid: expected {expected}. "
                         f"Fix: e.g. --{name} <{expected}>")
    if many:
        return [_scalar(name, v, kind) for v in (value if isinstance(value, list) else [value])]
    return _scalar(name, value, kind)


def _lookup(key: str, table: Dict[str, FieldInfo], p: Problems, suggested: List[str]
            ) -> Optional[str]:
    """The option `key` (or an alias, or a `-` spelling) names; None when it names none, with
    the problem in `p`: an ms-swift flag not supported yet gets a line naming its feature, a
    typo the closest names (the first also goes to `suggested`)."""
    name = key.replace("-", "_")
    name = ALIASES.get(name, name)
    if name in table:
        return name
    unsupported = rejection(name)
    close = [] if unsupported else difflib.get_close_matches(name, [*table, *ALIASES], 3, 0.6)
    hint = f" Did you mean: {', '.join('--' + c for c in close)}?" if close else ""
    p.add_unknown(unsupported or f"unknown option --{name}.{hint} "
                                 "Run with --help for the full list.")
    suggested.extend(ALIASES.get(c, c) for c in close[:1])
    return None


def _off_here(key: str, raw: Any) -> bool:
    """Whether an ms-swift flag we do not have asks for what runs here anyway: `false` for
    one of swift_flags.OFF_HERE (a YAML value, or the flag's tokens)."""
    if key.replace("-", "_") not in OFF_HERE:
        return False
    try:
        return not _to_bool(raw[0] if isinstance(raw, list) and len(raw) == 1 else raw)
    except ValueError:
        return False


def _store(values: Dict[str, Any], info: FieldInfo, raw: Any, p: Problems) -> None:
    """values[name] = `raw` converted and within its choices; else the problem goes to `p`."""
    try:
        value = convert(info, raw)
        message = bad_choice(info.name, value, info.annotation)
    except ValueError as e:
        message = str(e)
    if message:
        p.add(message, drop=info.name)
    else:
        values[info.name] = value


def values_from_mapping(data: Mapping[str, Any], table: Dict[str, FieldInfo], p: Problems,
                        source: str, suggested: Optional[List[str]] = None,
                        skip: Sequence[str] = ()) -> Dict[str, Any]:
    """{option: converted value} from {name or alias: raw value} (a YAML file, a saved
    config); the options in `skip` are only checked for names. Problems go to `p`."""
    values: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    for key, raw in data.items():
        if _off_here(str(key), raw):
            continue
        name = _lookup(str(key), table, p, [] if suggested is None else suggested)
        if name is None:
            continue
        if name in spelled:
            p.add(f"{source} sets {name} twice (as {spelled[name]!r} and {key!r}). "
                  "Fix: keep one of them")
            continue
        spelled[name] = str(key)
        if name not in skip:
            _store(values, table[name], raw, p)
    return values


def load_yaml(path: str, group_names: Sequence[str]) -> Dict[str, Any]:
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
    for key, value in data.items():
        # `model` is both a group and an option: a mapping means the group section.
        if key in group_names and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


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


def _metavar(annotation: Any) -> str:
    """`{a,b}` for choices, else the type: INT, FLOAT ..., JSON."""
    choices = literal_choices(annotation)
    if choices:
        return "{" + ",".join(map(str, choices)) + "}"
    kind, _, many = _unwrap(annotation)
    name = "JSON" if typing.get_origin(kind) is dict else getattr(kind, "__name__", str(kind))
    return name.upper() + (" ..." if many else "")


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
    sections = {g: parser.add_argument_group(g, (cls.__doc__ or "").strip())
                for g, cls in groups.items()}
    for info in field_table(groups).values():
        text = f"{info.help} (default: {info.default!r})".replace("%", "%%")
        sections[info.group].add_argument(
            *(f"--{n}" for n in [info.name, *aliases.get(info.name, ())]), dest=info.name,
            nargs="*", default=argparse.SUPPRESS, metavar=_metavar(info.annotation), help=text)
    return parser


def format_help(groups: Dict[str, type], prog: str = "megatron rlhf --rlhf_type grpo") -> str:
    """Every option by group, with its type, default, aliases and help (argparse's layout)."""
    return build_parser(groups, prog).format_help()


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
            from_yaml = load_yaml(config[0], list(groups))
        except ValueError as e:
            p.add(str(e))
            from_yaml = {}
        values = values_from_mapping(from_yaml, table, p, f"--config {config[0]!r}",
                                     suggested, skip=list(flags))   # a flag overrides the file
    for key, given in unknown:
        first, *rest = given.split()
        reason = refuse(key, given)
        if reason:
            p.add(reason)
        elif not _off_here(key, [first.partition("=")[2]] if "=" in first else rest):
            _lookup(key, table, p, suggested)
    for name, raw in flags.items():
        kind, _, many = _unwrap(table[name].annotation)
        if not raw and kind is bool and not many:
            raw = ["true"]          # a bare boolean flag
        elif not raw and not many:  # (a bare list flag: [])
            p.add(f"--{name} needs a value. Fix: e.g. --{name} <value>", drop=name)
            continue
        _store(values, table[name], raw, p)
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
