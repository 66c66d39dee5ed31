"""Identify data structures, 4096 bytes each (spec sheet section 6; NVMe base 2.0 figures 275
and 276, NVM command set figure 97; kernel struct nvme_id_ctrl / nvme_id_ns)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterable

from blockfabric.protocol._wire import (Bits, Buffer, Encodable, Packed, array, bitfields, bits,
                                        need_bytes, packed, raw, text, u8, u16, u32, u64,
                                        u128)
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.status import StatusCode

IDENTIFY_SIZE = 4096
_SHORT = StatusCode.SGL_DATA_LENGTH_INVALID  # a host handed a buffer shorter than 4096

CMIC_MULTI_PORT = 1 << 0
CMIC_MULTI_CTRL = 1 << 1
CMIC_ANA = 1 << 3
SGLS_SUPPORTED = 1 << 0  # sgls bit 0 (bits 1:0 = 01: SGLs, no alignment requirement)
SGLS_KEYED = 1 << 2  # keyed SGL data block descriptor
SGLS_OFFSET = 1 << 20  # offset addressing (in-capsule data)
ONCS_DSM = 1 << 2
ONCS_WRITE_ZEROES = 1 << 3
NSATTR_WRITE_PROTECTED = 1 << 0
CNTRLTYPE_IO = 1
CNTRLTYPE_DISCOVERY = 2


@packed(IDENTIFY_SIZE, short=_SHORT)
class IdentifyController(Packed):
    """Identify Controller (CNS 1).  Defaults are what a fabrics NVM controller reports."""

    vid: int = u16(0)  # @0 PCI vendor id
    ssvid: int = u16(2)  # @2 subsystem vendor id
    sn: str = text(4, 20, pad=b" ")  # @4 serial number, ASCII space padded
    mn: str = text(24, 40, pad=b" ")  # @24 model number
    fr: str = text(64, 8, pad=b" ")  # @64 firmware revision
    rab: int = u8(72)  # @72 recommended arbitration burst
    ieee: bytes = raw(73, 3)  # @73 IEEE OUI
    cmic: int = u8(76)  # @76 multi-path / ANA capabilities (bit 3 ANA)
    mdts: int = u8(77)  # @77 max data transfer 2^n min pages (0 = no limit)
    cntlid: int = u16(78)  # @78 must equal the admin Connect's cntlid
    ver: int = u32(80)  # @80 version, as the VS register
    rtd3r: int = u32(84)  # @84
    rtd3e: int = u32(88)  # @88
    oaes: int = u32(92)  # @92 optional async events (bits 8, 11, 31)
    ctratt: int = u32(96)  # @96 controller attributes
    cntrltype: int = u8(111)  # @111 1 I/O, 2 discovery, 3 admin
    oacs: int = u16(256)  # @256 optional admin commands
    acl: int = u8(258)  # @258 abort command limit, 0-based
    aerl: int = u8(259)  # @259 async event request limit, 0-based
    frmw: int = u8(260)  # @260 firmware updates
    lpa: int = u8(261)  # @261 log page attributes (bit 1: commands supported and effects)
    elpe: int = u8(262)  # @262 error log page entries, 0-based
    npss: int = u8(263)  # @263 power states, 0-based
    kas: int = u16(320)  # @320 keep-alive support, units of 100 ms
    anatt: int = u8(342)  # @342 ANA transition time, seconds
    anacap: int = u8(343)  # @343 ANA capabilities (bits 0-4: states reported)
    anagrpmax: int = u32(344)  # @344 highest ANA group id
    nanagrpid: int = u32(348)  # @348 number of ANA group ids
    sqes: int = u8(512, 0x66)  # @512 SQ entry size max:min (log2)
    cqes: int = u8(513, 0x44)  # @513 CQ entry size max:min (log2)
    maxcmd: int = u16(514)  # @514 max outstanding commands per queue
    nn: int = u32(516)  # @516 number of namespaces (highest nsid)
    oncs: int = u16(520)  # @520 optional NVM commands (bit 2 DSM, bit 3 write zeroes)
    fuses: int = u16(522)  # @522
    fna: int = u8(524)  # @524 format NVM attributes
    vwc: int = u8(525)  # @525 volatile write cache (bit 0 present)
    awun: int = u16(526)  # @526
    awupf: int = u16(528)  # @528
    sgls: int = u32(536)  # @536 SGL support (bits 0, 2, 20)
    mnan: int = u32(540)  # @540 max number of allowed namespaces
    subnqn: str = text(768, 256)  # @768 NUL terminated
    ioccsz: int = u32(1792)  # @1792 command capsule size, 16-byte units ((64+inline)/16)
    iorcsz: int = u32(1796)  # @1796 response capsule size, 16-byte units (1)
    icdoff: int = u16(1800)  # @1800 in-capsule data offset, 16-byte units (0)
    fcatt: int = u8(1802)  # @1802 fabrics controller attributes (bit 0 static)
    msdbd: int = u8(1803)  # @1803 max SGL data block descriptors (1)
    ofcs: int = u16(1804)  # @1804 optional fabric commands


@bitfields
class LBAFormat(Bits):
    """One LBA format, 4 bytes at IdentifyNamespace @128 + 4*i."""

    ms: int = bits(0, 16)  # metadata bytes per block
    ds: int = bits(16, 8)  # log2 of the block size (9 = 512, 12 = 4096)
    rp: int = bits(24, 2)  # relative performance

    @property
    def block_size(self) -> int:
        return 1 << self.ds


@packed(IDENTIFY_SIZE, short=_SHORT)
class IdentifyNamespace(Packed):
    """Identify Namespace (CNS 0).  An inactive namespace is the all-zero page."""

    nsze: int = u64(0)  # @0 size in blocks
    ncap: int = u64(8)  # @8 capacity in blocks
    nuse: int = u64(16)  # @16 blocks in use
    nsfeat: int = u8(24)  # @24 features (bit 2 deallocated/unwritten error support)
    nlbaf: int = u8(25)  # @25 number of LBA formats, 0-based
    flbas: int = u8(26)  # @26 formatted LBA size: bits 3:0 index into lbaf
    mc: int = u8(27)  # @27 metadata capabilities
    dpc: int = u8(28)  # @28 end-to-end protection capabilities
    dps: int = u8(29)  # @29 end-to-end protection settings
    nmic: int = u8(30)  # @30 multi-path (bit 0 shared)
    rescap: int = u8(31)  # @31 reservation capabilities
    fpi: int = u8(32)  # @32 format progress indicator
    dlfeat: int = u8(33)  # @33 deallocate features (bits 2:0 = 1: reads back zeroes)
    nawun: int = u16(34)  # @34
    nawupf: int = u16(36)  # @36
    nacwu: int = u16(38)  # @38
    nabsn: int = u16(40)  # @40
    nabo: int = u16(42)  # @42
    nabspf: int = u16(44)  # @44
    noiob: int = u16(46)  # @46 optimal I/O boundary
    nvmcap: int = u128(48)  # @48 NVM capacity in bytes (u128)
    npwg: int = u16(64)  # @64 preferred write granularity, 0-based
    npwa: int = u16(66)  # @66
    npdg: int = u16(68)  # @68 preferred deallocate granularity
    npda: int = u16(70)  # @70
    nows: int = u16(72)  # @72 optimal write size
    anagrpid: int = u32(92)  # @92 ANA group id
    nsattr: int = u8(99)  # @99 bit 0 write protected
    nvmsetid: int = u16(100)  # @100
    endgid: int = u16(102)  # @102
    nguid: bytes = raw(104, 16)  # @104 namespace globally unique id
    eui64: bytes = raw(120, 8)  # @120 IEEE extended unique id
    lbaf: tuple[LBAFormat, ...] = array(128, "I", 64, elem=LBAFormat)  # @128 4 B each

    @property
    def block_size(self) -> int:
        """Block size of the formatted LBA format."""
        index = self.flbas & 0xF
        if index >= len(self.lbaf):
            raise ProtocolError(f"flbas {index} names no LBA format", StatusCode.INVALID_FIELD)
        return self.lbaf[index].block_size


MAX_NSID_LIST = 1024


@packed(IDENTIFY_SIZE, short=_SHORT)
class ActiveNamespaceList(Packed):
    """Identify CNS 2: up to 1024 active NSIDs above the command's NSID, ascending; the list
    ends at the first zero entry."""

    nsids: tuple[int, ...] = array(0, "I", MAX_NSID_LIST, list_end=True)  # @0 u32 each


class NidType(enum.IntEnum):
    """Namespace identification descriptor types (CNS 3)."""

    EUI64 = 1
    NGUID = 2
    UUID = 3
    CSI = 4


NID_LENGTHS = {NidType.EUI64: 8, NidType.NGUID: 16, NidType.UUID: 16, NidType.CSI: 1}
_NID_BY_VALUE = {int(m): m for m in NidType}
_NID_HEADER = struct.Struct("<BBxx")  # nidt @0, nidl @1, reserved @2..3, then nid


@dataclass(frozen=True, slots=True)
class NamespaceIdDescriptor:
    """One {nidt, nidl, id} record."""

    nidt: NidType  # @0
    nid: bytes  # @4, nidl @1 bytes long

    def __post_init__(self) -> None:
        if len(self.nid) != NID_LENGTHS[self.nidt]:
            raise ValueError(f"{self.nidt.name} id must be {NID_LENGTHS[self.nidt]} bytes")


@dataclass(frozen=True, slots=True)
class NamespaceIdDescriptorList(Encodable):
    """Identify CNS 3: the descriptor list, zero padded to 4096 bytes."""

    descriptors: tuple[NamespaceIdDescriptor, ...] = ()

    SIZE = IDENTIFY_SIZE

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        end = offset + IDENTIFY_SIZE
        memoryview(buf)[offset:end] = bytes(IDENTIFY_SIZE)
        pos = offset
        for d in self.descriptors:
            if pos + 4 + len(d.nid) > end - 4:  # keep room for the terminating zero header
                raise ValueError("descriptors exceed the 4096-byte page")
            _NID_HEADER.pack_into(buf, pos, d.nidt, len(d.nid))
            memoryview(buf)[pos + 4:pos + 4 + len(d.nid)] = d.nid
            pos += 4 + len(d.nid)

    @classmethod
    def unpack_from(cls, buf: Buffer, offset: int = 0) -> NamespaceIdDescriptorList:
        need_bytes(buf, offset, IDENTIFY_SIZE, cls.__name__, _SHORT)
        end = offset + IDENTIFY_SIZE
        pos = offset
        found: list[NamespaceIdDescriptor] = []
        while pos + 4 <= end:
            nidt, nidl = _NID_HEADER.unpack_from(buf, pos)
            if nidt == 0:
                break
            kind = _NID_BY_VALUE.get(nidt)
            if pos + 4 + nidl > end or (kind is not None and nidl != NID_LENGTHS[kind]):
                raise ProtocolError(f"namespace id descriptor type {nidt} length {nidl}",
                                    StatusCode.INVALID_FIELD)
            if kind is not None:  # unknown types are skipped, as hosts do
                found.append(NamespaceIdDescriptor(kind, bytes(buf[pos + 4:pos + 4 + nidl])))
            pos += 4 + nidl
        return cls(tuple(found))

    @classmethod
    def of(cls, items: Iterable[tuple[NidType, bytes]]) -> NamespaceIdDescriptorList:
        return cls(tuple(NamespaceIdDescriptor(t, b) for t, b in items))
