"""Byte sizes as people write them in models.yaml and on command lines: ``512MiB``, ``2GB``,
``1048576``."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(value: str | int) -> int:
    """Parse a byte size such as ``512MiB``, ``2GB`` or ``1048576``."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {value!r}: expected e.g. 512MiB, 2GiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def format_size(size: int) -> str:
    """``size`` bytes as people read them: ``0 B``, ``512 B``, ``12 KiB``, ``310 MiB``,
    ``1.2 GiB``: binary units, one decimal below 10 of a unit, none from 10 on."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B" or round(abs(value), 1) >= 10:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}"
