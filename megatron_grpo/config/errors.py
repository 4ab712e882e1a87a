"""Every problem of a command line in one message.

Porting a 20-flag ms-swift script should take one rerun, not one per typo, so the
parser and the checks collect their problems instead of stopping at the first:

    p = Problems()
    p.unknown_option(...)                       # the parser: unknown flags first
    p.require(lr > 0, "--lr -1 must be > 0")    # the checks: invalid values
    p.raise_if_any()                            # ConfigError listing all of them

A later stage must not repeat an earlier mistake: once an option's value could not
be used (unknown flag -> its suggestion, a malformed value, a choice not allowed),
the option is `dropped` and a later message that names it is left out (it would be
about the default that stood in for the user's value).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterable, Iterator, List, Sequence, Set


def format_messages(messages: Sequence[str]) -> str:
    """One problem: its line. Several: a count, then one numbered line each."""
    if len(messages) == 1:
        return messages[0]
    lines = [f"{len(messages)} problems in the configuration:"]
    lines += [f"  {i}. {m}" for i, m in enumerate(messages, 1)]
    return "\n".join(lines)


class ConfigError(ValueError):
    """One or more configuration problems (`messages`), each naming the option, the value
    and what is allowed."""

    def __init__(self, messages: Sequence[str]):
        self.messages = list(messages)
        super().__init__(format_messages(self.messages))


def _names(message: str, options: Iterable[str]) -> bool:
    """Whether `message` names one of `options` (as --name, or name followed by a value)."""
    return any(re.search(rf"(?<![\w-])(?:--)?{re.escape(o)}(?!\w)", message) for o in options)


class Problems:
    """Collects problems: unknown flags (reported first), then invalid values."""

    def __init__(self) -> None:
        self.unknown: List[str] = []
        self.invalid: List[str] = []
        self.dropped: Set[str] = set()   # options whose user value could not be used

    @property
    def messages(self) -> List[str]:
        return self.unknown + self.invalid

    def __bool__(self) -> bool:
        return bool(self.unknown or self.invalid)

    def add_unknown(self, message: str) -> None:
        self.unknown.append(message)

    def add(self, message: str, drop: str | None = None) -> None:
        """Record an invalid value; `drop`: the option whose value is therefore not used."""
        if isinstance(message, ConfigError):
            for m in message.messages:
                self.add(m)
            return
        message = str(message)
        if message in self.invalid or _names(message, self.dropped):
            return
        self.invalid.append(message)
        if drop:
            self.dropped.add(drop)

    def require(self, ok: bool, message: str) -> bool:
        """Record `message` unless `ok`; returns `ok`, so dependent checks can be skipped."""
        if not ok:
            self.add(message)
        return bool(ok)

    def names_any(self, options: Iterable[str]) -> bool:
        """Whether a problem so far concerns one of `options` (checks on them would repeat it)."""
        options = list(options)
        return bool(self.dropped.intersection(options)) or any(_names(m, options)
                                                               for m in self.invalid)

    @contextmanager
    def section(self) -> Iterator[None]:
        """Run a group of checks: a ValueError is recorded and ends the group only. Any other
        error while problems are already recorded is taken as their consequence (e.g. a
        division by a size already reported as 0) and ends the group silently."""
        try:
            yield
        except ValueError as e:
            self.add(e)
        except Exception:
            if not self:
                raise

    def raise_if_any(self) -> None:
        if self:
            raise ConfigError(self.messages)
