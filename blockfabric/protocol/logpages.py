"""Log pages (spec sheet sections 6 and 10; NVMe base 2.0 figures 205-208, NVMe-oF 1.1
figures 38-40; kernel struct nvmf_disc_rsp_page_hdr / _entry, nvme_smart_log,
nvme_error_slot)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

from blockfabric.protocol._wire import (Buffer, Packed, array, nested, packed, text, u8, u16,
                                        u32, u64, u128)
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.status import StatusCode

_SHORT = StatusCode.SGL_DATA_LENGTH_INVALID


class TransportType(enum.IntEnum):
    """Discovery entry trtype."""

    RDMA = 1
    FC = 2
    TCP = 3
    LOOP = 254


class AddressFamily(enum.IntEnum):
    """Discovery entry adrfam."""

    IPV4 = 1
    IPV6 = 2
    IB = 3
    FC = 4


class SubsystemType(enum.IntEnum):
    """Discovery entry subtype."""

    REFERRAL = 1
    NVM = 2
    CURRENT_DISCOVERY = 3


class RdmaQpType(enum.IntEnum):
    CONNECTED = 1
    DATAGRAM = 2


class RdmaProviderType(enum.IntEnum):
    NOT_SPECIFIED = 1
    IB = 2
    ROCE = 3
    ROCEV2 = 4
    IWARP = 5


RDMA_CMS_RDMA_CM = 1


@packed(256)
class RdmaTsas(Packed):
    """The RDMA transport specific address subtype, the entry's @768..1023."""

    qptype: int = u8(0, RdmaQpType.CONNECTED)  # @768 1 = reliable connected
    prtype: int = u8(1, RdmaProviderType.NOT_SPECIFIED)  # @769 1 not specified, 4 RoCEv2
    cms: int = u8(2, RDMA_CMS_RDMA_CM)  # @770 1 = RDMA_CM
    pkey: int = u16(8)  # @776 InfiniBand partition key


#: NVMe/TCP's TSAS (@768): SECTYPE 0, no security; the rest reserved (all zero, which is
#: what an RdmaTsas of zeros packs to)
TCP_TSAS = RdmaTsas(qptype=0, prtype=0, cms=0, pkey=0)
#: TREQ bit 2: the controller lets a host disable SQ flow control
TREQ_SQFLOW_DISABLE = 0x04

DISCOVERY_ENTRY_SIZE = 1024
DISCOVERY_HEADER_SIZE = 1024


@packed(DISCOVERY_HEADER_SIZE, short=_SHORT)
class DiscoveryLogHeader(Packed):
    """The first 1024 bytes of the discovery log page (LID 0x70)."""

    genctr: int = u64(0)  # @0 generation counter, changes when the log changes
    numrec: int = u64(8)  # @8 number of entries in the whole log
    recfmt: int = u16(16)  # @16 record format, 0

    def _check(self) -> None:
        if self.recfmt != 0:
            raise ProtocolError(f"discovery log recfmt {self.recfmt}", StatusCode.INVALID_FIELD)


@packed(DISCOVERY_ENTRY_SIZE, short=_SHORT)
class DiscoveryLogEntry(Packed):
    """One 1024-byte discovery log entry: a subsystem and a port to reach it on."""

    trtype: int = u8(0, TransportType.RDMA)  # @0 a TransportType
    adrfam: int = u8(1, AddressFamily.IPV4)  # @1 an AddressFamily
    subtype: int = u8(2, SubsystemType.NVM)  # @2 a SubsystemType
    treq: int = u8(3)  # @3 transport requirements
    portid: int = u16(4)  # @4
    cntlid: int = u16(6, 0xFFFF)  # @6 0xFFFF: dynamic controller model
    asqsz: int = u16(8, 32)  # @8 max admin SQ size
    eflags: int = u16(10)  # @10 entry flags
    trsvcid: str = text(32, 32)  # @32 e.g. "4420", NUL padded
    subnqn: str = text(256, 256)  # @256
    traddr: str = text(512, 256)  # @512 e.g. "192.168.1.2"
    tsas: RdmaTsas = nested(768, RdmaTsas)  # @768 transport specific (RDMA layout)

    @classmethod
    def iter_from(cls, buf: Buffer, count: int, offset: int = DISCOVERY_HEADER_SIZE
                  ) -> Iterator[DiscoveryLogEntry]:
        """Decode lazily up to ``count`` entries, stopping at the end of ``buf`` (a host may
        have read fewer entries than ``numrec``)."""
        for _ in range(count):
            if len(buf) - offset < DISCOVERY_ENTRY_SIZE:
                return
            yield cls.unpack_from(buf, offset)
            offset += DISCOVERY_ENTRY_SIZE


def discovery_log_size(numrec: int) -> int:
    """Bytes in a discovery log page holding ``numrec`` entries."""
    return DISCOVERY_HEADER_SIZE + numrec * DISCOVERY_ENTRY_SIZE


def pack_discovery_log(genctr: int, entries: Sequence[DiscoveryLogEntry]) -> bytearray:
    """The whole page; a Get Log Page serves ``page[lpo:lpo+length]`` of it."""
    page = bytearray(discovery_log_size(len(entries)))
    DiscoveryLogHeader(genctr, len(entries), 0).pack_into(page)
    for i, entry in enumerate(entries):
        entry.pack_into(page, discovery_log_size(i))
    return page


@packed(64, short=_SHORT)
class ErrorLogEntry(Packed):
    """Error Information log (LID 0x01) entry, 64 bytes."""

    error_count: int = u64(0)  # @0 unique, increasing; 0 = empty entry
    sqid: int = u16(8)  # @8
    cid: int = u16(10)  # @10
    status: int = u16(12)  # @12 status field as in the CQE word (phase bit 0)
    param_error_location: int = u16(14)  # @14 byte bits 7:0, bit bits 10:8
    lba: int = u64(16)  # @16
    nsid: int = u32(24)  # @24
    vendor_info: int = u8(28)  # @28
    trtype: int = u8(29)  # @29
    csi: int = u8(30)  # @30 command set identifier
    opcode: int = u8(31)  # @31
    cs_info: int = u64(32)  # @32 command specific information
    trtype_info: int = u16(40)  # @40 transport type specific; @42..63 reserved


@packed(512, short=_SHORT)
class SmartLog(Packed):
    """SMART / Health Information log (LID 0x02), 512 bytes."""

    critical_warning: int = u8(0)  # @0
    temperature: int = u16(1)  # @1 composite temperature, kelvin
    avail_spare: int = u8(3)  # @3 percent
    spare_thresh: int = u8(4)  # @4 percent
    percent_used: int = u8(5)  # @5
    endu_grp_crit_warn: int = u8(6)  # @6
    data_units_read: int = u128(32)  # @32 thousands of 512-byte units
    data_units_written: int = u128(48)  # @48
    host_reads: int = u128(64)  # @64 read commands completed
    host_writes: int = u128(80)  # @80
    ctrl_busy_time: int = u128(96)  # @96 minutes
    power_cycles: int = u128(112)  # @112
    power_on_hours: int = u128(128)  # @128
    unsafe_shutdowns: int = u128(144)  # @144
    media_errors: int = u128(160)  # @160
    num_err_log_entries: int = u128(176)  # @176
    warning_temp_time: int = u32(192)  # @192 minutes
    critical_comp_time: int = u32(196)  # @196 minutes
    temp_sensor: tuple[int, ...] = array(200, "H", 8)  # @200 8 sensors, kelvin, 0 = absent
    thm_temp1_trans_count: int = u32(216)  # @216
    thm_temp2_trans_count: int = u32(220)  # @220
    thm_temp1_total_time: int = u32(224)  # @224
    thm_temp2_total_time: int = u32(228)  # @228; @232..511 reserved


CHANGED_NS_OVERFLOW = 0xFFFFFFFF  # sole first entry when more than 1024 namespaces changed


@packed(4096, short=_SHORT)
class ChangedNamespaceList(Packed):
    """Changed Namespace List log (LID 0x04): up to 1024 NSIDs, ending at the first zero."""

    nsids: tuple[int, ...] = array(0, "I", 1024, list_end=True)  # @0 u32 each

    @property
    def overflowed(self) -> bool:
        """More namespaces changed than the list holds: rescan them all."""
        return self.nsids[:1] == (CHANGED_NS_OVERFLOW,)


class AnaState(enum.IntEnum):
    """An ANA group's state on one controller (the ANA log's per-group state byte)."""

    OPTIMIZED = 0x1
    NON_OPTIMIZED = 0x2
    INACCESSIBLE = 0x3
    PERSISTENT_LOSS = 0x4
    CHANGE = 0xF


ANA_LOG_HEADER = struct.Struct("<QH6x")        # chgcnt @0, ngrps @8
ANA_GROUP_HEADER = struct.Struct("<IIQB15x")   # grpid @0, nnsids @4, chgcnt @8, state @16
ANA_LSP_RGO = 0x1  # Get Log Page LSP bit 0: return groups only (no NSID lists)


@dataclass(frozen=True, slots=True)
class AnaGroupDescriptor:
    grpid: int
    state: AnaState
    chgcnt: int = 0
    nsids: tuple[int, ...] = ()


def pack_ana_log(chgcnt: int, groups: Sequence[AnaGroupDescriptor],
                 rgo: bool = False) -> bytes:
    """The ANA log page (LID 0x0C): a 16-byte header, then per group 32 bytes and (without
    RGO) its NSIDs as u32s, ascending (the Linux host merges them in order)."""
    out = bytearray(ANA_LOG_HEADER.pack(chgcnt, len(groups)))
    for g in groups:
        nsids = () if rgo else tuple(sorted(g.nsids))
        out += ANA_GROUP_HEADER.pack(g.grpid, len(nsids), g.chgcnt, int(g.state))
        out += struct.pack(f"<{len(nsids)}I", *nsids)
    return bytes(out)


def unpack_ana_log(buf: bytes) -> tuple[int, list[AnaGroupDescriptor]]:
    """(chgcnt, groups) from an ANA log page; ProtocolError when what it says does not fit
    the bytes read (more groups or NSIDs than there are) or names an unknown state."""
    if len(buf) < ANA_LOG_HEADER.size:
        raise ProtocolError(f"ANA log of {len(buf)} bytes, shorter than its header",
                            StatusCode.INVALID_FIELD)
    chgcnt, ngrps = ANA_LOG_HEADER.unpack_from(buf, 0)
    at, groups = ANA_LOG_HEADER.size, []
    for _ in range(ngrps):
        if at + ANA_GROUP_HEADER.size > len(buf):
            raise ProtocolError(f"ANA log: {ngrps} groups do not fit its {len(buf)} bytes",
                                StatusCode.INVALID_FIELD)
        grpid, n, gchg, state = ANA_GROUP_HEADER.unpack_from(buf, at)
        at += ANA_GROUP_HEADER.size
        if at + 4 * n > len(buf):
            raise ProtocolError(f"ANA log: group {grpid}'s {n} NSIDs do not fit its "
                                f"{len(buf)} bytes", StatusCode.INVALID_FIELD)
        try:
            ana_state = AnaState(state)
        except ValueError:
            raise ProtocolError(f"ANA log: group {grpid} in state {state:#x}",
                                StatusCode.INVALID_FIELD) from None
        nsids = struct.unpack_from(f"<{n}I", buf, at)
        at += 4 * n
        groups.append(AnaGroupDescriptor(grpid, ana_state, gchg, nsids))
    return chgcnt, groups
