"""Declarative wire layouts, so each structure states its fields and offsets exactly once.

Two kinds of declaration:

* :func:`packed` byte layouts (``u8(at)``, ``u16(at)``, ``text(at, size)``, ``array(...)``):
  the decorator turns the field list into one precompiled little-endian ``struct.Struct``
  (checking that offsets ascend and do not overlap) and :class:`Packed` supplies ``pack``,
  ``pack_into`` and ``unpack_from`` for every such structure.
* :func:`bitfields` for registers and dwords (``bits(lo, width)``): :class:`Bits` supplies
  ``from_int`` and ``to_int``.

The per-I/O structures (SQE, CQE, SGL, DSM range) are written by hand for speed instead.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any, Callable, ClassVar, TypeVar, Union, dataclass_transform

from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.status import StatusCode

Buffer = Union[bytes, bytearray, memoryview]
T = TypeVar("T")

_WIRE = "wire"
_BITS = "bits"


@dataclasses.dataclass(frozen=True)
class _Field:
    """Where one field lives and how it converts: ``nvals`` struct items <-> one value."""

    at: int
    fmt: str
    nvals: int = 1
    decode: Callable[..., Any] | None = None  # struct item(s) -> value
    encode: Callable[[Any], tuple[Any, ...]] | None = None  # value -> struct items
    kind: str = "int"  # int, u128, raw, text, array, nested: for introspection (tests, docs)
    extra: Any = None  # text: the pad byte; array: the element type; nested: the class


def _wire(spec: _Field, default: Any) -> Any:
    if isinstance(default, (bytes, int, str, bool)) or default is None:
        return dataclasses.field(default=default, metadata={_WIRE: spec})
    return dataclasses.field(default_factory=lambda: default, metadata={_WIRE: spec})


def u8(at: int, default: int = 0) -> Any:
    """An unsigned byte at offset ``at``."""
    return _wire(_Field(at, "B"), default)


def u16(at: int, default: int = 0) -> Any:
    """A little-endian u16 at offset ``at``."""
    return _wire(_Field(at, "H"), default)


def u32(at: int, default: int = 0) -> Any:
    """A little-endian u32 at offset ``at``."""
    return _wire(_Field(at, "I"), default)


def u64(at: int, default: int = 0) -> Any:
    """A little-endian u64 at offset ``at``."""
    return _wire(_Field(at, "Q"), default)


def u128(at: int, default: int = 0) -> Any:
    """A little-endian 16-byte counter (SMART log), as a Python int."""
    return _wire(_Field(at, "16s", decode=lambda b: int.from_bytes(b, "little"),
                        encode=lambda v: (v.to_bytes(16, "little"),), kind="u128"), default)


def raw(at: int, size: int) -> Any:
    """``size`` opaque bytes (ids, vendor areas); shorter values are zero padded."""
    return _wire(_Field(at, f"{size}s", decode=bytes, encode=lambda v: (bytes(v),),
                        kind="raw"), bytes(size))


def _text_codec(size: int, pad: bytes) -> tuple[Callable[[bytes], str],
                                                 Callable[[str], tuple[bytes]]]:
    def decode(value: bytes) -> str:
        value = value.split(b"\0", 1)[0]
        if pad != b"\0":
            value = value.rstrip(pad)
        return value.decode("utf-8", "surrogateescape")

    def encode(value: str) -> tuple[bytes]:
        data = value.encode("utf-8", "surrogateescape")
        if len(data) > size:
            raise ValueError(f"{value!r} is longer than the {size}-byte field")
        return (data.ljust(size, pad),)

    return decode, encode


def text(at: int, size: int, *, pad: bytes = b"\0") -> Any:
    """A string field: NUL padded (NQNs, addresses) or space padded (``pad=b" "``: sn, mn,
    fr).  Decoding stops at the first NUL; undecodable bytes survive via surrogateescape."""
    decode, encode = _text_codec(size, pad)
    return _wire(_Field(at, f"{size}s", decode=decode, encode=encode, kind="text", extra=pad),
                 "")


def array(at: int, fmt: str, count: int, *, elem: type[Bits] | None = None,
          list_end: bool = False) -> Any:
    """``count`` items of ``fmt`` as a tuple, trailing zero items trimmed; ``list_end``: a
    list that ends at its first zero entry (an NSID list: what follows it is unused, and
    not read); ``elem`` converts items (``from_int``/``int``)."""
    def decode(*items: int) -> tuple[Any, ...]:
        if list_end:
            n = items.index(0) if 0 in items else len(items)
        else:
            n = len(items)
            while n and not items[n - 1]:
                n -= 1
        return tuple(elem.from_int(v) for v in items[:n]) if elem else items[:n]

    def encode(value: tuple[Any, ...]) -> tuple[int, ...]:
        if len(value) > count:
            raise ValueError(f"at most {count} entries, got {len(value)}")
        return tuple(int(v) for v in value) + (0,) * (count - len(value))

    return _wire(_Field(at, f"{count}{fmt}", count, decode, encode, "array", elem), ())


def nested(at: int, cls: type[Packed]) -> Any:
    """A fixed-size sub-structure (e.g. the RDMA TSAS inside a discovery log entry)."""
    return _wire(_Field(at, f"{cls.SIZE}s", decode=cls.unpack_from,
                        encode=lambda v: (v.pack(),), kind="nested", extra=cls), cls())


class Encodable:
    """``pack()`` for every fixed-size structure, from its ``pack_into`` and ``SIZE``."""

    __slots__ = ()
    SIZE: ClassVar[int]

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        raise NotImplementedError

    def pack(self) -> bytes:
        """Encode to ``SIZE`` new bytes."""
        buf = bytearray(self.SIZE)
        self.pack_into(buf, 0)
        return bytes(buf)


class Packed(Encodable):
    """Base of every :func:`packed` structure: encode to and decode from a buffer."""

    __slots__ = ()
    _S: ClassVar[struct.Struct]
    _PLAN: ClassVar[tuple[tuple[str, int, Any, Any], ...]]
    _SHORT: ClassVar[tuple[StatusCode, Any]]

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        """Encode into ``buf`` at ``offset`` (e.g. a registered memoryview)."""
        items: list[Any] = []
        for name, nvals, _decode, encode in self._PLAN:
            value = getattr(self, name)
            if encode is None:
                items.append(value)
            else:
                items.extend(encode(value))
        self._S.pack_into(buf, offset, *items)

    @classmethod
    def unpack_from(cls: type[T], buf: Buffer, offset: int = 0) -> T:
        """Decode from ``buf`` at ``offset``; ProtocolError if too short or invalid."""
        self_cls: Any = cls
        need_bytes(buf, offset, self_cls.SIZE, self_cls.__name__, *self_cls._SHORT)
        items = self_cls._S.unpack_from(buf, offset)
        args: list[Any] = []
        i = 0
        for _name, nvals, decode, _encode in self_cls._PLAN:
            if decode is None:
                args.append(items[i])
            else:
                args.append(decode(*items[i:i + nvals]))
            i += nvals
        obj = cls(*args)
        self_cls._check(obj)
        return obj

    def _check(self) -> None:
        """Reject values the spec forbids (override); runs after every decode."""


def need_bytes(buf: Buffer, offset: int, size: int, what: str,
               status: StatusCode = StatusCode.INVALID_FIELD, cm_reject: Any = None,
               cid: int | None = None) -> None:
    """Raise the structure's own 'too short' answer unless ``buf[offset:]`` holds ``size``."""
    have = len(buf) - offset if offset >= 0 else -1
    if have < size or offset < 0:
        raise ProtocolError(f"{what}: need {size} bytes at offset {offset}, have {max(have, 0)}",
                            status, True, cm_reject, cid=cid)


@dataclass_transform(frozen_default=True)
def packed(size: int, *, short: StatusCode = StatusCode.INVALID_FIELD,
           cm_reject: Any = None) -> Callable[[type[T]], type[T]]:
    """Make a frozen, slotted dataclass of the fields and compile its byte layout.

    ``short``/``cm_reject``: the answer when a buffer is too short to hold the structure.
    """
    def build(cls: type[T]) -> type[T]:
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        fmt = ["<"]
        plan = []
        pos = 0
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec: _Field = f.metadata[_WIRE]
            if spec.at < pos:
                raise TypeError(f"{cls.__name__}.{f.name} @{spec.at} overlaps the field before")
            if spec.at > pos:
                fmt.append(f"{spec.at - pos}x")
            fmt.append(spec.fmt)
            pos = spec.at + struct.calcsize("<" + spec.fmt)
            plan.append((f.name, spec.nvals, spec.decode, spec.encode))
        if pos > size:
            raise TypeError(f"{cls.__name__}: fields end at {pos}, beyond {size}")
        fmt.append(f"{size - pos}x" if size > pos else "")
        klass: Any = cls
        klass.SIZE = size
        klass._S = struct.Struct("".join(fmt))
        klass._PLAN = tuple(plan)
        klass._SHORT = (short, cm_reject)
        return cls
    return build


# --------------------------------------------------------------------------- bit fields

@dataclasses.dataclass(frozen=True)
class _Bits:
    lo: int
    width: int
    enum: type[enum.IntEnum] | None = None
    status: StatusCode = StatusCode.INVALID_FIELD


def bits(lo: int, width: int = 1, default: Any = 0, *, enum: type[enum.IntEnum] | None = None,
         status: StatusCode = StatusCode.INVALID_FIELD) -> Any:
    """Bits ``lo .. lo+width-1``.  With ``enum``, a value outside it is a ProtocolError with
    ``status`` (DNR); one-bit fields without an enum are bools."""
    if width == 1 and enum is None and default == 0:
        default = False
    return dataclasses.field(default=default, metadata={_BITS: _Bits(lo, width, enum, status)})


def enum_lookup(cls: type[enum.IntEnum]) -> dict[int, Any]:
    """value -> member, to convert without constructing enums from untrusted values."""
    return {int(m): m for m in cls}


class Bits:
    """Base of every :func:`bitfields` value: an int register or dword with named fields."""

    __slots__ = ()
    _FIELDS: ClassVar[tuple[tuple[str, int, int, dict[int, Any] | None, StatusCode, bool], ...]]
    MASK: ClassVar[int]

    @classmethod
    def from_int(cls: type[T], value: int) -> T:
        """Decode; bits outside the declared fields (reserved) are ignored."""
        args = []
        for name, lo, mask, lookup, status, is_bool in cls._FIELDS:  # type: ignore[attr-defined]
            v = (value >> lo) & mask
            if lookup is not None:
                member = lookup.get(v)
                if member is None:
                    raise ProtocolError(f"{cls.__name__}.{name}: invalid value {v:#x}", status)
                v = member
            elif is_bool:
                v = bool(v)
            args.append(v)
        return cls(*args)

    def to_int(self) -> int:
        """Encode; raises ValueError for a field value that does not fit its bits."""
        value = 0
        for name, lo, mask, _lookup, _status, _is_bool in self._FIELDS:
            v = int(getattr(self, name))
            if not 0 <= v <= mask:
                raise ValueError(f"{type(self).__name__}.{name}={v} does not fit")
            value |= v << lo
        return value

    def __int__(self) -> int:
        return self.to_int()


@dataclass_transform(frozen_default=True)
def bitfields(cls: type[T]) -> type[T]:
    """Make a frozen, slotted dataclass of ``bits`` fields with ``from_int``/``to_int``."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    plan = []
    mask_all = 0
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        spec: _Bits = f.metadata[_BITS]
        mask = (1 << spec.width) - 1
        if mask_all & (mask << spec.lo):
            raise TypeError(f"{cls.__name__}.{f.name} overlaps another field")
        mask_all |= mask << spec.lo
        lookup = enum_lookup(spec.enum) if spec.enum else None
        plan.append((f.name, spec.lo, mask, lookup, spec.status,
                     spec.width == 1 and spec.enum is None))
    klass: Any = cls
    klass._FIELDS = tuple(plan)
    klass.MASK = mask_all
    return cls
