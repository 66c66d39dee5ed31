"""NVMe completion status codes and the 16-bit CQE status word (spec sheet sections 2 and 7)."""

from __future__ import annotations

import enum
from typing import cast


class StatusCode(enum.IntEnum):
    """Status as the kernel keeps it: SCT<<8 | SC (NVMe base spec 2.0, figures 100-102).

    Codes not named here (vendor specific, newer specs) still decode: they become unnamed
    members called ``STATUS_0xNNN``, so a CQE never fails to decode because of its status.
    """

    # SCT 0: generic command status
    SUCCESS = 0x000
    INVALID_OPCODE = 0x001
    INVALID_FIELD = 0x002
    CMDID_CONFLICT = 0x003
    DATA_TRANSFER_ERROR = 0x004
    POWER_LOSS_ABORT = 0x005
    INTERNAL_ERROR = 0x006
    ABORT_REQUESTED = 0x007
    INVALID_NS = 0x00B
    CMD_SEQ_ERROR = 0x00C
    SGL_INVALID_LAST = 0x00D
    SGL_INVALID_COUNT = 0x00E
    SGL_DATA_LENGTH_INVALID = 0x00F
    SGL_METADATA_LENGTH_INVALID = 0x010
    SGL_DESCRIPTOR_TYPE_INVALID = 0x011
    SGL_INVALID_OFFSET = 0x016
    HOST_ID_INCONSISTENT = 0x018
    KEEP_ALIVE_EXPIRED = 0x019
    KEEP_ALIVE_INVALID = 0x01A
    NS_WRITE_PROTECTED = 0x020
    LBA_OUT_OF_RANGE = 0x080
    CAPACITY_EXCEEDED = 0x081
    NS_NOT_READY = 0x082
    RESERVATION_CONFLICT = 0x083
    # SCT 1: command specific status
    INVALID_CQ = 0x100
    INVALID_QID = 0x101
    INVALID_QUEUE_SIZE = 0x102
    ABORT_LIMIT = 0x103
    AER_LIMIT_EXCEEDED = 0x105
    INVALID_FW_SLOT = 0x106
    INVALID_LOG_PAGE = 0x109
    INVALID_FORMAT = 0x10A
    FEATURE_NOT_SAVEABLE = 0x10D
    FEATURE_NOT_CHANGEABLE = 0x10E
    CONNECT_INCOMPATIBLE_FORMAT = 0x180
    CONNECT_CTRL_BUSY = 0x181
    CONNECT_INVALID_PARAM = 0x182
    CONNECT_RESTART_DISC = 0x183
    CONNECT_INVALID_HOST = 0x184
    AUTH_REQUIRED = 0x191
    # SCT 2: media and data integrity errors
    WRITE_FAULT = 0x280
    UNRECOVERED_READ_ERROR = 0x281
    GUARD_CHECK_ERROR = 0x282
    APPTAG_CHECK_ERROR = 0x283
    REFTAG_CHECK_ERROR = 0x284
    COMPARE_FAILED = 0x285
    ACCESS_DENIED = 0x286
    DEALLOCATED_OR_UNWRITTEN = 0x287
    # SCT 3: path related status (a host retries these on another path)
    PATH_INTERNAL_ERROR = 0x300
    ANA_PERSISTENT_LOSS = 0x301
    ANA_INACCESSIBLE = 0x302
    ANA_TRANSITION = 0x303

    @classmethod
    def _missing_(cls, value: object) -> StatusCode | None:
        """Give any 11-bit code a (cached, unnamed) member instead of failing."""
        if not isinstance(value, int) or not 0 <= value <= STATUS_MASK:
            return None
        member = int.__new__(cls, value)
        member._name_ = f"STATUS_{value:#05x}"
        member._value_ = value
        return cast("StatusCode", cls._value2member_map_.setdefault(value, member))

    @property
    def sct(self) -> int:
        """Status code type (0 generic, 1 command specific, 2 media, 3 path, 7 vendor)."""
        return self >> 8

    @property
    def sc(self) -> int:
        """Status code within its type."""
        return self & 0xFF


STATUS_MASK = 0x7FF  # SC bits 7:0, SCT bits 10:8
CRD_SHIFT = 11  # command retry delay, 2 bits
MORE = 1 << 13
DNR = 1 << 14

_STATUS_MEMBERS = StatusCode._value2member_map_


def status_code(value: int) -> StatusCode:
    """``StatusCode(value & 0x7FF)`` without enum machinery on the common (named) path."""
    value &= STATUS_MASK
    member = _STATUS_MEMBERS.get(value)
    return member if member is not None else StatusCode(value)  # type: ignore[return-value]


def encode_status(status: int, *, dnr: bool = False, more: bool = False, crd: int = 0) -> int:
    """The 15-bit status field in the kernel's unshifted form, e.g. INTERNAL_ERROR|DNR = 0x4006."""
    if not 0 <= crd <= 3:
        raise ValueError(f"crd must be 0..3, got {crd}")
    return (status & STATUS_MASK) | crd << CRD_SHIFT | (MORE if more else 0) | (DNR if dnr else 0)


def decode_status(value: int) -> tuple[StatusCode, bool, bool, int]:
    """Split an unshifted status field into (status, dnr, more, crd)."""
    return (status_code(value), bool(value & DNR), bool(value & MORE),
            (value >> CRD_SHIFT) & 3)


def encode_status_word(status: int, *, dnr: bool = False, more: bool = False, crd: int = 0,
                       phase: int = 0) -> int:
    """The u16 at CQE @14: the status field shifted left by one, phase tag in bit 0."""
    return encode_status(status, dnr=dnr, more=more, crd=crd) << 1 | (phase & 1)


def decode_status_word(word: int) -> tuple[StatusCode, bool, bool, int, int]:
    """Split the CQE status word into (status, dnr, more, crd, phase)."""
    return (*decode_status(word >> 1), word & 1)
