"""Memory sizes on the command line: a byte count or a number with a unit.

    parse_size("512MiB") == 536870912;  parse_size("2GB") == 2_000_000_000;  parse_size(None) is None

Kept free of heavy imports: options are checked before anything starts.
"""
from __future__ import annotations

import re
from typing import Optional, Union

SIZE_FORMS = ("a byte count (e.g. 536870912) or a number with a unit: KiB, MiB, GiB, TiB "
              "(powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. 512MiB, 2GiB")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: Union[None, int, float, str],
               option: str = "--vllm_kv_cache_memory") -> Optional[int]:
    """Bytes from an int or a size string; None (or "none") stays None.

    Raises a one-line ValueError naming the option, the value and the allowed forms.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    bad = ValueError(f"{option} {value!r} is not a valid size: expected {SIZE_FORMS}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _SIZE.fullmatch(str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise bad
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0 or (unit in ("", "b") and not number.is_integer()):
        raise bad
    return size
