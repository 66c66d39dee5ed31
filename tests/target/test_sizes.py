"""Size parsing and formatting (blockfabric.sizes), shared by the target config and the CLIs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfabric.sizes import GiB, KiB, MiB, TiB, SizeError, format_size, human_size, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    (512, 512), ("512", 512), ("512B", 512), ("4KiB", 4 * KiB), ("4K", 4 * KiB),
    ("64MiB", 64 * MiB), ("64M", 64 * MiB), ("1GiB", GiB), ("1 GiB", GiB), (" 2TiB ", 2 * TiB),
    ("2T", 2 * TiB), ("1PiB", 1 << 50), (0, 0), ("0", 0), ("1536MiB", 1536 * MiB),
])
def test_parse_accepts(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("1GB", "write GiB"), ("10MB", "write MiB"), ("4KB", "write KiB"), ("4kB", "write KiB"),
    ("2TB", "write TiB"),
    ("1.5GiB", "binary unit"), ("-1", "binary unit"), ("", "binary unit"), ("GiB", "binary unit"),
    ("1  GiB", "binary unit"), ("0x10", "binary unit"), ("1Gib", "a unit of"), ("1g", "a unit of"),
    ("1KIB", "a unit of"), ("12 bytes", "a unit of"),
    (-5, "0 bytes or more"), (True, "binary unit"), (1.0, "binary unit"), (None, "binary unit"),
])
def test_parse_rejects_with_a_clear_reason(text: object, fragment: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(text)  # type: ignore[arg-type]
    assert fragment in info.value.expected
    assert info.value.value == text
    assert str(info.value).startswith("expected ")


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0B"), (1, "1B"), (1000, "1000B"), (1024, "1KiB"), (1536, "1536B"), (3 * MiB, "3MiB"),
    (1536 * MiB, "1536MiB"), (GiB, "1GiB"), (2 * TiB, "2TiB"), (TiB + GiB, "1025GiB"),
])
def test_format_is_exact_in_the_largest_unit(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_format_rejects_negative() -> None:
    with pytest.raises(ValueError):
        format_size(-1)


@settings(derandomize=True, max_examples=300, deadline=None)   # (timing is not the property)
@given(st.one_of(st.integers(0, 1 << 62),
                 st.builds(lambda n, s: n << s, st.integers(0, 1 << 20), st.integers(0, 50))))
def test_format_then_parse_round_trips(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes


@pytest.mark.parametrize(("nbytes", "text"), [
    (12, "12 B"), (1536, "1.5 KiB"), (GiB, "1 GiB"), (1536 * MiB, "1.5 GiB"),
])
def test_human_size(nbytes: int, text: str) -> None:
    assert human_size(nbytes) == text
