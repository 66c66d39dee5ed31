"""Byte sizes as people write them in configs and on command lines, shared by both sides.

Only binary units are accepted (``KiB`` = 1024, and ``K`` as its short form), because a
volume that is "1 GB" to one reader and 1 GiB to another silently loses its last 7 % of
blocks.  Decimal units (``KB``, ``GB``...) are rejected with a message saying which binary unit
to write instead.  No fractions: ``1.5GiB`` is ambiguous about rounding; write ``1536MiB``.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50

#: Binary units, largest first (format_size picks the first that divides exactly).
UNITS: tuple[tuple[str, int], ...] = (("PiB", PiB), ("TiB", TiB), ("GiB", GiB),
                                      ("MiB", MiB), ("KiB", KiB))
_FACTORS: dict[str, int] = {"": 1, "B": 1}
for _name, _factor in UNITS:
    _FACTORS[_name] = _factor
    _FACTORS[_name[0]] = _factor  # K, M, G, T, P: short forms of the same binary units
_DECIMAL = {"KB", "MB", "GB", "TB", "PB", "kB"}

_SIZE_RE = re.compile(r"(?P<number>[0-9]+) ?(?P<unit>[A-Za-z]*)")

#: What a size may look like, for error messages.
SIZE_SYNTAX = "an integer number of bytes or one with a binary unit (512, 4KiB, 64MiB, 1GiB, 2TiB)"


class SizeError(ValueError):
    """A size that cannot be read; ``expected`` and ``value`` let a caller (the config loader)
    put the problem into its own message."""

    def __init__(self, expected: str, value: object) -> None:
        self.expected = expected
        self.value = value
        super().__init__(f"expected {expected}, got {value!r}")


def parse_size(value: int | str) -> int:
    """Return the number of bytes that ``value`` (an int, or a string like ``"4KiB"``) means.

    Raises SizeError (a ValueError) with a message meant for the user.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SizeError(SIZE_SYNTAX, value)
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE_RE.fullmatch(value.strip())
        if match is None:
            raise SizeError(SIZE_SYNTAX, value)
        unit = match["unit"]
        if unit in _DECIMAL:
            binary = unit[0].upper() + "iB"
            raise SizeError(f"a binary unit, not the decimal {unit}: write {binary} "
                            f"(1 {binary} = {_FACTORS[binary]} bytes)", value)
        if unit not in _FACTORS:
            raise SizeError("a unit of B, KiB, MiB, GiB, TiB, PiB (or K, M, G, T, P)", value)
        number = int(match["number"]) * _FACTORS[unit]
    if number < 0:
        raise SizeError("a size of 0 bytes or more", value)
    return number


def format_size(nbytes: int) -> str:
    """Format ``nbytes`` exactly, in the largest binary unit that divides it: parse_size reads
    it back to the same number (``format_size(3 * MiB) == "3MiB"``, ``format_size(1000) ==
    "1000B"``)."""
    if nbytes < 0:
        raise ValueError(f"a size cannot be negative, got {nbytes}")
    for name, factor in UNITS:
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{name}"
    return f"{nbytes}B"


def human_size(nbytes: int) -> str:
    """Format ``nbytes`` for people, rounded to one decimal (``"1.5 GiB"``); not exact."""
    for name, factor in UNITS:
        if nbytes >= factor:
            return f"{nbytes / factor:.1f} {name}".replace(".0 ", " ")
    return f"{nbytes} B"
