"""Hypothesis strategies for every structure, derived from the field declarations' types and
widths (what values are legal), not from their offsets (the golden tests pin those)."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from hypothesis import strategies as st

from blockfabric.protocol import (
    CQE, SQE, ConnectCommand, DSMRange, GetLogPage, IOOpcode, KeyedSGL,
    NamespaceIdDescriptor, NamespaceIdDescriptorList, NidType, OffsetSGL, ReadWrite, StatusCode)
from blockfabric.protocol.identify import NID_LENGTHS

_TEXT_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")


def _text(size: int, pad: bytes) -> st.SearchStrategy[str]:
    base = st.text(_TEXT_CHARS, max_size=size // 4)
    return base.map(lambda t: t.rstrip(" ")) if pad == b" " else base


def bits_strategy(cls: Any) -> st.SearchStrategy[Any]:
    """Any legal value of a bitfields class."""
    kw: dict[str, st.SearchStrategy[Any]] = {}
    for name, _lo, mask, lookup, _status, is_bool in cls._FIELDS:
        kw[name] = (st.sampled_from(sorted(lookup.values())) if lookup
                    else st.booleans() if is_bool else st.integers(0, mask))
    return st.builds(cls, **kw)


def _field(spec: Any) -> st.SearchStrategy[Any]:
    if spec.kind == "int":
        return st.integers(0, (1 << 8 * struct.calcsize("<" + spec.fmt)) - 1)
    if spec.kind == "u128":
        return st.integers(0, (1 << 128) - 1)
    if spec.kind == "raw":
        size = struct.calcsize("<" + spec.fmt)
        return st.binary(min_size=size, max_size=size)
    if spec.kind == "text":
        return _text(struct.calcsize("<" + spec.fmt), spec.extra)
    if spec.kind == "nested":
        return packed_strategy(spec.extra)
    if spec.kind == "array":  # non-zero items: the list ends at the first zero
        width = struct.calcsize("<" + spec.fmt) // spec.nvals
        item: st.SearchStrategy[Any] = st.integers(1, (1 << 8 * width) - 1)
        if spec.extra is not None:
            item = bits_strategy(spec.extra).filter(lambda v: v.to_int() != 0)
        return st.lists(item, max_size=min(spec.nvals, 6)).map(tuple)
    raise AssertionError(spec.kind)


def packed_strategy(cls: Any) -> st.SearchStrategy[Any]:
    """Any legal value of a packed structure (record formats other than 0 are refused)."""
    kw = {f.name: _field(f.metadata["wire"]) for f in dataclasses.fields(cls)}
    if "recfmt" in kw:
        kw["recfmt"] = st.just(0)
    return st.builds(cls, **kw)


_COMMAND_OVERRIDES: dict[Any, dict[str, st.SearchStrategy[Any]]] = {
    ConnectCommand: {"recfmt": st.just(0)},  # other record formats are refused
    GetLogPage: {"lpo": st.integers(0, (1 << 62) - 1).map(lambda v: v * 4)},  # dword aligned
}


def command_strategy(cls: Any) -> st.SearchStrategy[Any]:
    """Any legal value of a declared command."""
    kw: dict[str, st.SearchStrategy[Any]] = {}
    for name, _in_nsid, _shift, mask, lookup, _status, is_bool in cls._FIELDS:
        kw[name] = (st.sampled_from(sorted(lookup.values())) if lookup
                    else st.booleans() if is_bool else st.integers(0, mask))
    kw.update(_COMMAND_OVERRIDES.get(cls, {}))
    return st.builds(cls, **kw)


u8, u16, u32, u64 = (st.integers(0, (1 << n) - 1) for n in (8, 16, 32, 64))

keyed_sgls = st.builds(KeyedSGL, u64, st.integers(0, (1 << 24) - 1), u32, st.booleans())
offset_sgls = st.builds(OffsetSGL, u64, u32)
sgls = st.one_of(keyed_sgls, offset_sgls)
sqes = st.builds(SQE, u8, st.just(0x40), u16, u32, u32, u32, u64, sgls, u32, u32, u32, u32,
                 u32, u32)
statuses = st.integers(0, 0x7FF).map(StatusCode)
cqes = st.builds(CQE, u64, u16, u16, u16, statuses, st.booleans(), st.booleans(),
                 st.integers(0, 3), st.integers(0, 1))
read_writes = st.builds(ReadWrite, st.sampled_from([IOOpcode.READ, IOOpcode.WRITE]), u32, u64,
                        u16, u16, u32, u32)
dsm_ranges = st.builds(DSMRange, u32, u32, u64)
nid_descriptors = st.sampled_from(list(NidType)).flatmap(
    lambda t: st.binary(min_size=NID_LENGTHS[t], max_size=NID_LENGTHS[t]).map(
        lambda b: NamespaceIdDescriptor(t, b)))
nid_lists = st.lists(nid_descriptors, max_size=8).map(
    lambda items: NamespaceIdDescriptorList(tuple(items)))
