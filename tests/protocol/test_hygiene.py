"""Input hygiene as pure functions: the NQN check a Connect applies (base spec 4.7) and the
one escaping of peer text for logs and metrics (issue 13, class 6)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from blockfabric.logutil import printable
from blockfabric.protocol.fabrics import ConnectData, nqn_problem

HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
SUB = "nqn.2026-12.io.blockfabric:ram0"

VALID = [HOST, SUB, "nqn.2014-08.org.nvmexpress.discovery", "nqn.2026-12.io.x",
         "nqn.2014-08.org.nvmexpress:uuid:3F1A2B4C-5D6E-4F70-8A9B-0C1D2E3F4A5B",
         "nqn.2014-08.org.nvmexpress:NVMf:uuid:3f1a2b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b",
         "nqn.2026-12.io.x:" + "é" * 100,               # 17 + 200 bytes of UTF-8
         "nqn.2026-12.io.x:" + "a" * 206]               # exactly 223 bytes

#: (NQN as ConnectData decodes it, what the refusal says)
INVALID = [
    ("", "empty"),
    ("nqn.2026-12.io.x:" + "a" * 207, "224 bytes"),
    ("nqn.2026-12.io.x:" + "a" * 239, "256 bytes"),    # the whole field, no NUL
    ("nqn.2026-12.io.x:\udcff\udcfe", "not UTF-8"),
    ("nqn.2026-12.io.x:a\nINFO forged line", "not printable"),
    ("nqn.2026-12.io.x:a\r", "not printable"),
    ("nqn.2026-12.io.x:\x1b[31mred", "not printable"),
    ("nqn.2026-12.io.x:\u202eevil", "not printable"),  # right-to-left override
    ("nqn.2026-12.io.x:a b", "not of the form"),
    ("nqn.2026-13.io.x:a", "not of the form"),
    ("iqn.2026-12.io.x:a", "not of the form"),
    ("nqn.2026-12.:a", "not of the form"),
    ("nqn.2014-08.org.nvmexpress:uuid:any", "not followed by a UUID"),
    ("nqn.2014-08.org.nvmexpress:uuid:3f1a2b4c-5d6e-4f70-8a9b-0c1d2e3f4a5bX",
     "not followed by a UUID"),
]


@pytest.mark.parametrize("nqn", VALID)
def test_valid_nqns_pass(nqn: str) -> None:
    assert nqn_problem(nqn) is None


@pytest.mark.parametrize("nqn, why", INVALID)
def test_invalid_nqns_say_why(nqn: str, why: str) -> None:
    assert why in (nqn_problem(nqn) or "valid")


def test_field_without_a_nul_decodes_too_long() -> None:
    """256 bytes and no terminating NUL: what ConnectData gives is refused for its length."""
    raw = bytearray(1024)
    raw[512:768] = b"n" * 256
    data = ConnectData.unpack_from(bytes(raw))
    assert "256 bytes" in nqn_problem(data.hostnqn)


@given(st.binary(max_size=256))
def test_any_field_is_checked_without_an_exception(raw: bytes) -> None:
    data = ConnectData.unpack_from(bytes(512) + raw.ljust(256, b"\0") + bytes(256))
    problem = nqn_problem(data.hostnqn)
    assert problem is None or isinstance(problem, str)
    if problem is None:
        assert data.hostnqn.isprintable() and len(data.hostnqn.encode()) <= 223


# ------------------------------------------------------------------ escaping


@pytest.mark.parametrize("text, shown", [
    (HOST, HOST),
    ("a\nINFO forged", "a\\nINFO forged"),
    ("a\\nb", "a\\\\nb"),                      # a literal backslash cannot fake an escape
    ("x\udcffy", "x\\xffy"),                   # a byte that was not UTF-8, as itself
    ("\x1b[31m\x00\x7f", "\\x1b[31m\\x00\\x7f"),
    ("\u202e\u2028", "\\u202e\\u2028"),
    ("é", "é"),
])
def test_printable_escapes_what_is_not(text: str, shown: str) -> None:
    assert printable(text) == shown


@given(st.text(max_size=300))
def test_printable_is_one_printable_line(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    shown.encode("utf-8")                       # never a surrogate left
    assert len(shown) <= 4 * 256 + 3 or len(text) <= 256


def test_printable_cuts_long_text() -> None:
    assert printable("a" * 1000, 10) == "a" * 10 + "..."


def test_metrics_labels_survive_hostile_values() -> None:
    from blockfabric.target import metrics
    fam = metrics.Family("blockfabric_x", "gauge", "x",
                         [({"hostnqn": 'a\n"b"\\\udcff\u2028'}, 1)])
    text = metrics.render([fam])
    text.encode("utf-8")
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[2] == 'blockfabric_x{hostnqn="a\\\\n\\"b\\"\\\\\\\\\\\\xff\\\\u2028"} 1'
