"""Further paths to a subsystem as users write them: ``ADDR``, ``ADDR:PORT``, ``[V6ADDR]`` or
``[V6ADDR]:PORT`` (over the transport of ``-t``), each optionally after ``tcp://`` or
``rdma://`` (over that transport: one subsystem reached through NVMe/TCP and RDMA listeners
at once).  Shared by ``--path`` on the command line and ``paths:`` in the initiator
YAML, so both accept and refuse the same things.  Imports nothing heavy (``--help`` stays
fast)."""

from __future__ import annotations

import ipaddress

FORMS = "ADDR, ADDR:PORT, [IPV6ADDR] or [IPV6ADDR]:PORT, optionally after tcp:// or rdma://"
#: the transports a path can name (``tcp://`` / ``rdma://``, ``transport:`` in the YAML)
TRANSPORTS = ("rdma", "tcp")


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


def parse_transport(text: str) -> str:
    """A path's transport name, ``rdma`` or ``tcp`` (any case); ValueError otherwise."""
    name = text.strip().lower() if isinstance(text, str) else ""
    if name not in TRANSPORTS:
        raise ValueError("a transport: rdma or tcp")
    return name


def parse_path_spec(text: str) -> tuple[str, int | None] | tuple[str, int | None, str]:
    """:func:`parse_path` of one of :data:`FORMS`, with the transport as a third item when
    the text names one (``tcp://10.0.0.2:4420``): that path goes over it, whatever ``-t``
    says.  ``://`` cannot be part of an address (nor of a bracketed IPv6 one), so the forms
    stay unambiguous."""
    if isinstance(text, str) and "://" in text:
        scheme, _, rest = text.strip().partition("://")
        try:
            transport = parse_transport(scheme)
        except ValueError:
            raise ValueError(f"tcp:// or rdma:// before the address ({FORMS})") from None
        return (*parse_path(rest), transport)
    return parse_path(text)


def format_path(address: str, port: int, transport: str | None = None) -> str:
    """``address:port``, with an IPv6 address in brackets (the form :func:`parse_path` reads),
    after ``transport://`` when given."""
    where = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return f"{transport}://{where}" if transport else where


def resolve_paths(primary: tuple[str, int], extra: list[tuple],
                  transport: str | None = None) -> list[tuple]:
    """The further paths with their ports filled in from ``primary``: ``(address, port)``,
    or ``(address, port, transport)`` for one that names its transport; ValueError for a
    path given twice or equal to the primary one (it would only be tried twice in a row).
    ``transport``: the primary path's (``-t``), which a path naming none uses; the same
    address and port over RDMA and over TCP are two paths."""
    out: list[tuple] = []
    seen = {_key(*primary, transport): "the primary path (-a/-s, traddr/trsvcid)"}
    for item in extra:
        address, port = item[0], item[1]
        own = item[2] if len(item) > 2 and item[2] else None
        port = primary[1] if port is None else port
        key = _key(address, port, own or transport)
        if key in seen:
            raise ValueError(f"path {format_path(address, port, own)} is the same as "
                             f"{seen[key]}")
        seen[key] = f"path {format_path(address, port, own)} given before"
        out.append((address, port) + ((own,) if own else ()))
    return out


def _key(address: str, port: int, transport: str | None) -> tuple[object, int, str | None]:
    try:
        return ipaddress.ip_address(address), int(port), transport
    except ValueError:          # a primary traddr that is a host name: compare as text
        return address, int(port), transport
