"""The benchmark's pure parts: fio size syntax, the verify block format, percentiles."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfabric.initiator.benchopts import BenchError, parse_fio_size
from blockfabric.initiator.benchreport import DirStats, fio_num
from blockfabric.initiator.benchverify import (VerifyHeader, _crc32c, check_block, crc32c_py,
                                               fill_block)

crc = _crc32c()


@pytest.mark.parametrize("text,value", [("4k", 4096), ("128K", 128 << 10), ("1m", 1 << 20),
                                        ("1MiB", 1 << 20), ("2g", 2 << 30), ("512", 512),
                                        ("64kb", 64 << 10)])
def test_fio_sizes(text, value):
    assert parse_fio_size(text) == value


@pytest.mark.parametrize("text", ["", "k", "4x", "1.5m", "-4k"])
def test_bad_fio_sizes(text):
    with pytest.raises(BenchError):
        parse_fio_size(text)


def _block(size=4096, offset=0x3000, seed=7, numberio=42) -> bytes:
    buf = bytearray(random.Random(seed).randbytes(size))
    fill_block(crc, buf, offset, seed, numberio)
    return bytes(buf)


def test_a_sealed_block_checks_and_names_its_writer():
    block = _block()
    hdr = VerifyHeader.unpack_from(block)
    assert (hdr.length, hdr.offset, hdr.seed, hdr.numberio) == (4096, 0x3000, 7, 42)
    assert check_block(crc, block, 0x3000, None) is None
    assert check_block(crc, block, 0x3000, (7, 42)) is None
    assert "stale" in check_block(crc, block, 0x3000, (7, 43))
    assert "belongs at offset 0x3000" in check_block(crc, block, 0x4000, None)
    assert "bad magic" in check_block(crc, bytes(4096), 0, None)


@settings(max_examples=200, derandomize=True, deadline=None)   # (timing is not the property)
@given(st.integers(0, 4095), st.integers(1, 255))
def test_any_damaged_byte_is_caught(at, flip):
    block = bytearray(_block())
    block[at] ^= flip
    assert check_block(crc, bytes(block), 0x3000, (7, 42)) is not None


def test_percentiles_are_nearest_rank_with_fios_keys():
    stats = DirStats()
    for v in range(1, 1001):          # 1..1000 ns
        stats.record(4096, 0, v)
    p = stats.percentiles()
    assert p["50.000000"] == 500 and p["90.000000"] == 900
    assert p["99.000000"] == 990 and p["99.900000"] == 999 and p["99.990000"] == 1000
    report = stats.as_fio(2_000_000_000)             # 2 s
    assert report["iops"] == 500.0 and report["bw_bytes"] == 2048000
    assert report["clat_ns"]["min"] == 1 and report["clat_ns"]["max"] == 1000
    assert report["clat_ns"]["mean"] == pytest.approx(500.5)


def test_fio_style_numbers():
    assert [fio_num(v) for v in (950, 12345, 1_234_567)] == ["950", "12.3k", "1.23M"]


def test_the_pure_python_crc32c_matches_the_check_value_and_continues():
    assert crc32c_py(b"123456789") == 0xE3069283              # RFC 3720's check value
    data = random.Random(5).randbytes(3000)
    assert crc32c_py(data[1000:], crc32c_py(data[:1000])) == crc32c_py(data) == crc(data)
