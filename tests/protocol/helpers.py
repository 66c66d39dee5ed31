"""Shared test helpers: hypothesis settings (seeded, bounded) and encode/decode checks."""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import HealthCheck, settings

# derandomize: the examples come from a fixed seed, so every run tries the same inputs.
FAST = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def check_wire(obj: Any, expected: bytes | bytearray) -> None:
    """``obj`` encodes to exactly ``expected`` and ``expected`` decodes to ``obj``, also at an
    offset inside a larger buffer and through a memoryview."""
    cls = type(obj)
    assert obj.pack() == bytes(expected)
    assert cls.unpack_from(bytes(expected)) == obj
    buf = bytearray(len(expected) + 24)
    obj.pack_into(memoryview(buf), 8)
    assert bytes(buf[8:8 + len(expected)]) == bytes(expected)
    assert cls.unpack_from(memoryview(buf), 8) == obj


def sqe_bytes(opcode: int, cid: int = 0, nsid: int = 0, *, sgl: bytes = bytes(15) + b"\x40",
              flags: int = 0x40, dwords: dict[int, tuple[str, int]] | None = None) -> bytearray:
    """A 64-byte SQE built at the spec sheet's literal offsets: opcode @0, flags @1, cid @2,
    nsid @4, SGL1 @24..39, then ``dwords`` {offset: (struct format, value)} at @40..63."""
    buf = bytearray(64)
    struct.pack_into("<B", buf, 0, opcode)
    struct.pack_into("<B", buf, 1, flags)
    struct.pack_into("<H", buf, 2, cid)
    struct.pack_into("<I", buf, 4, nsid)
    buf[24:40] = sgl
    for offset, (fmt, value) in (dwords or {}).items():
        struct.pack_into("<" + fmt, buf, offset, value)
    return buf


def check_command(cmd: Any, expected: bytes | bytearray, cid: int = 0, **to_sqe: Any) -> None:
    """A typed command encodes to the golden SQE bytes and decodes back from them."""
    from blockfabric.protocol import SQE

    assert cmd.to_sqe(cid=cid, **to_sqe).pack() == bytes(expected)
    assert type(cmd).from_sqe(SQE.unpack_from(bytes(expected))) == cmd
