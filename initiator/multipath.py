"""Further paths to a subsystem as users write them: ``ADDR``, ``ADDR:PORT``, ``[V6ADDR]`` or
``[V6ADDR]:PORT``.  Shared by ``--path`` on the command line and ``paths:`` in the initiator
YAML, so both accept and refuse the same things.  Imports nothing heavy (``--help`` stays
fast)."""

from __future__ import annotations

import ipaddress

FORMS = "ADDR, ADDR:PORT, [IPV6ADDR] or [IPV6ADDR]:PORT"


def parse_port(text: str) -> int:
    """A TCP/RDMA-CM port, 1..65535, from its decimal text; ValueError says what was
    expected."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError("a port: an integer from 1 to 65535")
    return int(text)


def parse_path(text: str) -> tuple[str, int | None]:
    """``(address, port)`` from one of :data:`FORMS`; the port is None when not given (the
    caller fills in the primary path's).  An IPv6 address must be in brackets: in
    ``fd00::2:4420`` the last group could be a port or part of the address.  Raises
    ValueError whose message says what was expected (the caller names the value)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(FORMS)
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("a ']' after the IPv6 address: [ADDR] or [ADDR]:PORT")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError("':PORT' or nothing after ']'")
        port_text = rest[1:] if rest else None
        if ":" not in host:
            raise ValueError("brackets only around an IPv6 address")
    elif text.count(":") > 1:
        raise ValueError("an IPv6 address in brackets: [ADDR] or [ADDR]:PORT")
    else:
        host, colon, port_text = text.partition(":")
        if not colon:
            port_text = None
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise ValueError(f"an IPv4 or IPv6 address ({FORMS})") from None
    if port_text is None:
        return address, None
    return address, parse_port(port_text)


def format_path(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets (the form :func:`parse_path` reads)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def resolve_paths(primary: tuple[str, int], extra: list[tuple[str, int | None]]
                  ) -> list[tuple[str, int]]:
    """The further paths with their ports filled in from ``primary``; ValueError for a path
    given twice or equal to the primary one (it would only be tried twice in a row)."""
    out: list[tuple[str, int]] = []
    seen = {_key(*primary): "the primary path (-a/-s, traddr/trsvcid)"}
    for address, port in extra:
        path = (address, primary[1] if port is None else port)
        key = _key(*path)
        if key in seen:
            raise ValueError(f"path {format_path(*path)} is the same as {seen[key]}")
        seen[key] = f"path {format_path(*path)} given before"
        out.append(path)
    return out


def _key(address: str, port: int) -> tuple[object, int]:
    try:
        return ipaddress.ip_address(address), int(port)
    except ValueError:          # a primary traddr that is a host name: compare as text
        return address, int(port)
