"""Reservations on the wire (NVMe base spec 2.0 section 8.19 and figures 337-352; the
kernel's struct nvme_reservation_status_ext, nvme_registered_ctrl_ext and nvme_pr_log;
/work/shared/spec/nvmeof-tcp-ana-resv.md section 3).  Pure encoding, no I/O: the host
builds the commands and reads the answers with it, the target decodes and encodes."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from blockfabric.protocol.capsule import SQE

# I/O opcodes (the NVM command set's reservation commands)
OP_REGISTER = 0x0D
OP_REPORT = 0x0E
OP_ACQUIRE = 0x11
OP_RELEASE = 0x15
OPCODES = (OP_REGISTER, OP_REPORT, OP_ACQUIRE, OP_RELEASE)

# Feature identifiers
FID_HOST_ID = 0x81
FID_RESV_MASK = 0x82
FID_RESV_PERSIST = 0x83
LID_RESV_NOTIFY = 0x80

ONCS_RESERVATIONS = 1 << 5
CTRATT_HOSTID_128 = 1 << 0
RESCAP_PTPL = 1 << 0
RESCAP_TYPES = 0x7E         # bits 1-6: the six reservation types
RESCAP_IEKEY13 = 1 << 7     # "ignore existing key" as NVMe 1.3 defines it
#: AER dword 0: type 6 (I/O command set specific), info 0 (reservation log page available),
#: log page 0x80.
AEN_RESV = 6 | 0 << 8 | LID_RESV_NOTIFY << 16
#: Set Features 0x82 cdw11: the notices a host may mask.
MASK_REG_PREEMPTED = 1 << 1
MASK_RELEASED = 1 << 2
MASK_PREEMPTED = 1 << 3
MASK_ALL = MASK_REG_PREEMPTED | MASK_RELEASED | MASK_PREEMPTED

STATUS_HEADER = 24
STATUS_ENTRY = 24
STATUS_EXT_HEADER = 64
STATUS_EXT_ENTRY = 64
LOG_ENTRY = 64


class RType(enum.IntEnum):
    """Reservation type (RTYPE, cdw10 bits 15:8)."""

    NONE = 0
    WRITE_EXCLUSIVE = 1
    EXCLUSIVE_ACCESS = 2
    WRITE_EXCLUSIVE_REG_ONLY = 3
    EXCLUSIVE_ACCESS_REG_ONLY = 4
    WRITE_EXCLUSIVE_ALL_REGS = 5
    EXCLUSIVE_ACCESS_ALL_REGS = 6


#: nvme-cli's and the kernel's short names, for the command line and JSON.
RTYPE_NAMES = {0: "none", 1: "write-exclusive", 2: "exclusive-access",
               3: "write-exclusive-registrants-only", 4: "exclusive-access-registrants-only",
               5: "write-exclusive-all-registrants", 6: "exclusive-access-all-registrants"}


class RegisterAction(enum.IntEnum):
    REGISTER = 0
    UNREGISTER = 1
    REPLACE = 2


class AcquireAction(enum.IntEnum):
    ACQUIRE = 0
    PREEMPT = 1
    PREEMPT_AND_ABORT = 2


class ReleaseAction(enum.IntEnum):
    RELEASE = 0
    CLEAR = 1


class Cptpl(enum.IntEnum):
    """Change Persist Through Power Loss (Register cdw10 bits 31:30)."""

    NO_CHANGE = 0
    RESERVED = 1
    CLEAR = 2
    PERSIST = 3


class LogType(enum.IntEnum):
    """Reservation notification log page entry types."""

    EMPTY = 0
    REGISTRATION_PREEMPTED = 1
    RESERVATION_RELEASED = 2
    RESERVATION_PREEMPTED = 3


#: The mask bit of each notice type (Set Features 0x82).
LOG_MASK_BIT = {LogType.REGISTRATION_PREEMPTED: MASK_REG_PREEMPTED,
                LogType.RESERVATION_RELEASED: MASK_RELEASED,
                LogType.RESERVATION_PREEMPTED: MASK_PREEMPTED}


@dataclass(frozen=True)
class ResvCommand:
    """The cdw10 fields the three key-carrying commands share: action (bits 2:0), IEKEY
    (bit 3), RTYPE (bits 15:8, Acquire and Release) and CPTPL (bits 31:30, Register)."""

    action: int
    iekey: bool
    rtype: int
    cptpl: int

    @classmethod
    def from_cdw10(cls, cdw10: int) -> ResvCommand:
        return cls(cdw10 & 7, bool(cdw10 >> 3 & 1), cdw10 >> 8 & 0xFF, cdw10 >> 30 & 3)

    def cdw10(self) -> int:
        return (self.action & 7) | (1 << 3 if self.iekey else 0) | (self.rtype & 0xFF) << 8 \
            | (self.cptpl & 3) << 30


def keys(data: bytes | memoryview) -> tuple[int, int]:
    """The two u64 keys of a Register/Acquire payload (the second is 0 when the payload is
    the 8 bytes of a Release)."""
    if len(data) >= 16:
        return struct.unpack_from("<QQ", data)
    return struct.unpack_from("<Q", data)[0], 0


def pack_keys(first: int, second: int = 0) -> bytes:
    return struct.pack("<QQ", first, second)


def register_sqe(nsid: int, action: int, crkey: int, nrkey: int, *, iekey: bool = False,
                 cptpl: int = 0) -> tuple[SQE, bytes]:
    return (SQE(opcode=OP_REGISTER, nsid=nsid,
                cdw10=ResvCommand(action, iekey, 0, cptpl).cdw10()), pack_keys(crkey, nrkey))


def acquire_sqe(nsid: int, action: int, rtype: int, crkey: int, prkey: int, *,
                iekey: bool = False) -> tuple[SQE, bytes]:
    return (SQE(opcode=OP_ACQUIRE, nsid=nsid,
                cdw10=ResvCommand(action, iekey, rtype, 0).cdw10()), pack_keys(crkey, prkey))


def release_sqe(nsid: int, action: int, rtype: int, crkey: int, *,
                iekey: bool = False) -> tuple[SQE, bytes]:
    """16 bytes, as the Linux host sends (host/pr.c), of which the target reads 8."""
    return (SQE(opcode=OP_RELEASE, nsid=nsid,
                cdw10=ResvCommand(action, iekey, rtype, 0).cdw10()), pack_keys(crkey))


def report_sqe(nsid: int, length: int, eds: bool = True) -> SQE:
    return SQE(opcode=OP_REPORT, nsid=nsid, cdw10=length // 4 - 1, cdw11=1 if eds else 0)


@dataclass(frozen=True)
class Registrant:
    cntlid: int
    holder: bool
    hostid: bytes       # 16 bytes (EDS) or 8
    rkey: int

    def as_dict(self) -> dict[str, object]:
        return {"cntlid": self.cntlid, "rcsts": int(self.holder), "hostid": self.hostid.hex(),
                "rkey": self.rkey}


@dataclass(frozen=True)
class ReservationStatus:
    gen: int
    rtype: int
    regctl: int         # registrants in all, even if fewer entries fit the buffer
    ptpls: bool
    registrants: tuple[Registrant, ...]

    def pack(self, length: int, eds: bool = True) -> bytes:
        """The first ``length`` bytes (zero padded) of the data structure."""
        header, entry = (STATUS_EXT_HEADER, STATUS_EXT_ENTRY) if eds else \
            (STATUS_HEADER, STATUS_ENTRY)
        out = bytearray(max(length, header))
        struct.pack_into("<IBHxxB", out, 0, self.gen & 0xFFFFFFFF, self.rtype,
                         self.regctl & 0xFFFF, int(self.ptpls))
        at = header
        for reg in self.registrants:
            if at + entry > length:
                break
            if eds:
                struct.pack_into("<HBxxxxxQ16s", out, at, reg.cntlid, int(reg.holder),
                                 reg.rkey, reg.hostid.ljust(16, b"\0")[:16])
            else:
                struct.pack_into("<HBxxxxxQQ", out, at, reg.cntlid, int(reg.holder),
                                 int.from_bytes(reg.hostid[:8], "little"), reg.rkey)
            at += entry
        return bytes(out[:length])

    @classmethod
    def unpack(cls, data: bytes, eds: bool = True) -> ReservationStatus:
        header, entry = (STATUS_EXT_HEADER, STATUS_EXT_ENTRY) if eds else \
            (STATUS_HEADER, STATUS_ENTRY)
        if len(data) < header:
            raise ValueError(f"reservation status: {len(data)} bytes, header needs {header}")
        gen, rtype, regctl, ptpls = struct.unpack_from("<IBHxxB", data, 0)
        regs = []
        for i in range(regctl):
            at = header + i * entry
            if at + entry > len(data):
                break
            if eds:
                cntlid, rcsts, rkey, hostid = struct.unpack_from("<HBxxxxxQ16s", data, at)
            else:
                cntlid, rcsts, hostid_int, rkey = struct.unpack_from("<HBxxxxxQQ", data, at)
                hostid = hostid_int.to_bytes(8, "little")
            regs.append(Registrant(cntlid, bool(rcsts & 1), hostid, rkey))
        return cls(gen, rtype, regctl, bool(ptpls & 1), tuple(regs))

    def as_dict(self) -> dict[str, object]:
        """nvme-cli's `resv-report -o json` keys (gen, rtype, regctl, ptpls, regctlext)."""
        return {"gen": self.gen, "rtype": self.rtype,
                "rtype_name": RTYPE_NAMES.get(self.rtype, "unknown"),
                "regctl": self.regctl, "ptpls": int(self.ptpls),
                "regctlext": [r.as_dict() for r in self.registrants]}


@dataclass(frozen=True)
class NotificationLog:
    """One entry of the reservation notification log page (LID 0x80)."""

    count: int
    log_type: int
    available: int      # entries still queued after this one (nr_pages)
    nsid: int

    def pack(self) -> bytes:
        out = bytearray(LOG_ENTRY)
        struct.pack_into("<QBBxxI", out, 0, self.count, self.log_type, self.available,
                         self.nsid)
        return bytes(out)

    @classmethod
    def unpack(cls, data: bytes) -> NotificationLog:
        return cls(*struct.unpack_from("<QBBxxI", data, 0))

    def as_dict(self) -> dict[str, object]:
        name = LogType(self.log_type).name.lower() if self.log_type in LogType._value2member_map_ \
            else "unknown"
        return {"count": self.count, "type": self.log_type, "type_name": name,
                "nr_pages": self.available, "nsid": self.nsid}
